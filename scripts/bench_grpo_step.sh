#!/usr/bin/env bash
# One full RL step, ares-runner against PyTorch + transformers on the same machine:
# 64 prompts x 8 samples of up to 256 tokens on a random Qwen2.5-0.5B-shaped model with a
# 151 936-row vocabulary, old + reference log-probs, one PPO epoch, one AdamW step
# (examples/configs/bench_grpo_step.yaml; scripts/bench_torch_grpo_step.py for PyTorch).
#
#   scripts/bench_grpo_step.sh                      # GPU: ares (cuda) f32 and bf16 matmuls,
#                                                   # then PyTorch f32 and bf16
#   DEVICE=cpu SHAPE=demo VOCAB=59 scripts/bench_grpo_step.sh data.rollout_batch_size=4 \
#       worker.rollout.n=2 data.max_response_length=16 worker.actor.global_batch_size=4
#                                                   # a quick check of the script on a CPU
#
# Extra arguments are dotted overrides for ares-runner. Environment: ARES_RUNNER (the
# binary, default target/release/ares-runner), DEVICE (cuda), SHAPE (qwen2.5-0.5b), VOCAB
# (151936), DIR (runs/bench-grpo), PRECISIONS ("f32 bf16": trainer.matmul_precision
# values to run), PYTHON (python3), TORCH_ARGS (extra arguments of the
# PyTorch script, e.g. "--prompts 4 --n 2 --response 16"). Peak device memory is sampled
# with nvidia-smi every 100 ms when it is there.
set -euo pipefail
bin=${ARES_RUNNER:-target/release/ares-runner}
device=${DEVICE:-cuda}
dir=${DIR:-runs/bench-grpo}
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
config=${CONFIG:-$here/../examples/configs/bench_grpo_step.yaml}

"$bin" demo-data --shape "${SHAPE:-qwen2.5-0.5b}" --vocab "${VOCAB:-151936}" -o "$dir/assets"
sampler=""
peak() {  # max of the sampled device memory, MiB
  [ -n "$sampler" ] || return 0
  kill "$sampler" 2>/dev/null || true
  wait "$sampler" 2>/dev/null || true
  sort -n "$dir/memory.txt" | tail -1 | awk '{print "  peak device memory (nvidia-smi): " $1 " MiB"}'
  sampler=""
}
sample_memory() {
  if [ "$device" != cpu ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$dir/memory.txt" &
    sampler=$!
  fi
}

for precision in ${PRECISIONS:-f32 bf16}; do
  echo "== ares-runner ($device, matmul_precision $precision)"
  rm -rf "$dir/run"
  sample_memory
  "$bin" train -c "$config" "trainer.device=$device" "trainer.matmul_precision=$precision" \
    "data.train_files=$dir/assets/data/train.jsonl" "worker.actor.model_path=$dir/assets/model" \
    "trainer.save_checkpoint_path=$dir/run" "$@"
  peak
  metrics=$(find "$dir/run" -name metrics.jsonl | head -1)
  "$python" - "$metrics" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    phases = ", ".join(f"{k[5:]} {v:.2f} s" for k, v in m.items() if k.startswith("time/") and k != "time/step")
    print(f"step {m['step']}: {m['time/step']:.2f} s ({phases}); "
          f"{m.get('perf/rollout_tokens_per_s', 0):.0f} generated tokens/s")
    if m.get("advantage/mean") == 0 and m.get("advantage/std") == 0:
        print("  warning: all advantages are 0; the loss head skips work PyTorch does: not comparable")
PY
done

if "$python" -c 'import torch, transformers' 2>/dev/null; then
  for dtype in f32 bf16; do
    echo "== PyTorch + transformers ($dtype)"
    sample_memory
    # shellcheck disable=SC2086 # TORCH_ARGS is a list of arguments
    "$python" "$here/bench_torch_grpo_step.py" "$dir/assets" --device "$device" --dtype "$dtype" ${TORCH_ARGS:-}
    peak
  done
else
  echo "PyTorch side skipped: no torch/transformers for $python"
fi
