#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries on this machine (no GPU and no CUDA toolkit
# needed: CUDA libraries are loaded at run time) and packs them, with a runner, into a
# folder to copy to a GPU machine that has no Rust toolchain.
#
#   scripts/gpu-bundle.sh [DIR]        # default DIR = .gpu (git-ignored)
#   # on the GPU machine:
#   DIR/run.sh [PART]       # every part (model: train, attention and rest whole, with
#                           # PyTorch's whole script), or one: tests, kernels, model, train,
#                           # attention, profile, scale, rest, rollout, wheel, grpo, dp
#                           # (each fits a 10-minute call); after `grpo`: dotted overrides
#                           # of the RL step
#   DIR/check.sh [1|2]      # the parts time-boxed in two device calls: 1 (~9.5 min) the
#                           # tests and the training figures, 2 (~4 min) the rest
#
# With the `device` tool of this workplace: carry `.gpu` and run `.gpu/run.sh`; results
# land in $OUT when it is set.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu}
rm -rf "$dir"
mkdir -p "$dir/bin"

artifacts() {
  # prints "<kind>-<name> <path>" for every test/bench executable cargo built
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m.get("profile", {}).get("test", True):
        kind = m["target"]["kind"][0]
        print(("bench" if kind == "bench" else "test") + "-" + m["target"]["name"], exe)
'
}

echo "building GPU tests (release)…"
# (not the CPU emulation of the kernels: it needs a C++ compiler and the tree, and a GPU adds
# nothing to it)
cargo test --release -p ares-cuda --no-run --message-format=json | artifacts |
  while read -r name exe; do [ "$name" = test-emulated ] || cp "$exe" "$dir/bin/$name"; done
echo "building the CUDA backend and trainer tests (release)…"
cargo test --release -p ares-model --test cuda_backend --no-run --message-format=json | artifacts |
  while read -r name exe; do cp "$exe" "$dir/bin/$name"; done
cargo test --release -p ares-model --test cuda_vision --no-run --message-format=json | artifacts |
  while read -r name exe; do cp "$exe" "$dir/bin/$name"; done
cargo test --release -p ares-runner --test cuda_trainer --no-run --message-format=json | artifacts |
  while read -r name exe; do cp "$exe" "$dir/bin/$name"; done
# The backend tests read the tiny transformers fixtures. A bundle inside the repository
# (the default .gpu, carried beside the working tree) reads the repository's copy; one
# elsewhere carries its own.
case "$(cd "$dir" && pwd)/" in
  "$(pwd)"/*) ;;
  *)
    mkdir -p "$dir/fixtures"
    cp -r ares-model/tests/fixtures/models "$dir/fixtures/models"
    cp -r ares-model/tests/fixtures/vl "$dir/fixtures/vl"
    cp -r ares-model/tests/fixtures/lora "$dir/fixtures/lora"
    ;;
esac
echo "building GPU benchmarks…"
cargo bench -p ares-cuda --bench gpu_kernels --no-run --message-format=json | artifacts |
  while read -r name exe; do cp "$exe" "$dir/bin/$name"; done
cargo bench -p ares-benches --bench model_cuda --no-run --message-format=json | artifacts |
  while read -r name exe; do cp "$exe" "$dir/bin/$name"; done
cargo bench -p ares-benches --bench rollout_cuda --no-run --message-format=json | artifacts |
  while read -r name exe; do cp "$exe" "$dir/bin/$name"; done
echo "building ares-runner (the RL-step benchmark)…"
cargo build --release -p ares-runner
cp target/release/ares-runner "$dir/bin/ares-runner"
cp scripts/torch_token_kernels.py scripts/bench_torch_gpu.py scripts/bench_torch_cpu.py scripts/torch_lora.py \
  scripts/bench_grpo_step.sh scripts/bench_torch_grpo_step.py examples/configs/bench_grpo_step.yaml \
  scripts/dp_check.sh "$dir/"

# The Python wheel (abi3) for the CUDA-tensor check, when maturin is at hand (CI's venv has
# it): installed on the GPU machine into a scratch folder beside PyTorch.
if python3 -m maturin --version >/dev/null 2>&1; then
  echo "building the Python wheel…"
  python3 -m maturin build --release --locked -m ares-py/Cargo.toml -o "$dir" >/dev/null
  cp ares-py/tests/test_cuda_tensors.py scripts/bench_cuda_tensors.py "$dir/"
else
  echo "  no maturin here (pip install maturin): the bundle has no wheel, its check skips it"
fi

# The kernels compiled for sm_90 (H100, H200) into the cache run.sh points at, so the GPU's
# minutes are not spent in NVRTC (model_ops.cu alone takes ~20 s). The key holds NVRTC's
# version: a GPU machine whose NVRTC differs in major.minor compiles them itself.
echo "precompiling the kernels for sm_90…"
nvrtc_lib=${ARES_NVRTC_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ares/nvrtc-13.0.88}/nvidia/cu13/lib
if ! LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ARES_KERNEL_CACHE="$dir/kernel-cache" \
  cargo run --release -q -p ares-cuda --example precompile_kernels -- 90; then
  echo "  not precompiled (no libnvrtc here; .ci/run installs it): the GPU run compiles them"
fi

# Symbols and debug info are most of the size (92 → 41 MB); the device tool carries at
# most 64 MiB, the working tree (~17 MB) included, so the stripped binaries (~54 MB) also
# travel gzipped: run.sh unpacks them on the GPU machine before anything runs.
strip --strip-all "$dir"/bin/*
gzip -9 "$dir"/bin/*

cat > "$dir/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the bundled GPU tests and benchmarks. Needs the CUDA driver and NVRTC on the
# library path; the CUDA toolkit's lib64 is added when present.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# the binaries travel gzipped (the carry's 64 MiB): unpacked once, in place
for z in "$here"/bin/*.gz; do
  [ -e "$z" ] || continue
  gunzip -f "$z" && chmod +x "${z%.gz}" || { echo "could not unpack $z"; exit 1; }
done
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
echo "CUDA libraries found:"
for lib in libcuda.so.1 libnvrtc.so.13 libnvrtc.so.12 libnvrtc.so libcublas.so.13 libcublas.so.12 libcublasLt.so.13; do
  found=$( (IFS=:; for d in $LD_LIBRARY_PATH; do ls "$d/$lib" 2>/dev/null; done; ldconfig -p | awk -v l="$lib" '$1 == l {print $NF}') | head -1)
  echo "  $lib -> ${found:-not found}"
done
export ARES_REQUIRE_GPU=1 ARES_REQUIRE_NVRTC=1 ARES_KERNEL_CACHE="$here/kernel-cache"
fixtures="$here/fixtures"
[ -d "$fixtures" ] || fixtures="$here/../ares-model/tests/fixtures"
export ARES_FIXTURE_MODELS="$fixtures/models"
export ARES_FIXTURE_VL="$fixtures/vl"
export ARES_FIXTURE_LORA="$fixtures/lora"
out=${OUT:-$here}
status=0
part=${1:-all}
shift $(( $# > 0 ? 1 : 0 ))  # the rest: overrides of the RL step (grpo)
# `all` runs every part but train, attention and rest: the model part holds them whole
want() {
  case "$part:$1" in
    all:train | all:attention | all:rest) return 1 ;;
    all:*) return 0 ;;
    *) [ "$part" = "$1" ] ;;
  esac
}
has_torch() { python3 -c 'import torch, transformers' 2>/dev/null; }
if want tests; then
  for t in "$here"/bin/test-*; do
    echo "== $(basename "$t")"
    "$t" --test-threads=1 --nocapture 2>&1 | tee -a "$out/gpu-tests.log" || status=1
  done
fi
if want kernels; then
  echo "== bench-gpu_kernels"
  ARES_BENCH_OUT="$out/gpu_kernels.jsonl" "$here/bin/bench-gpu_kernels" | tee "$out/gpu_kernels.txt" || status=1
  if has_torch; then
    echo "== PyTorch, the token kernels"
    python3 "$here/torch_token_kernels.py" | tee "$out/torch_token_kernels.txt" || status=1
  fi
fi
if want model; then
  echo "== bench-model_cuda"
  "$here/bin/bench-model_cuda" | tee "$out/model_cuda.txt" || status=1
  if has_torch; then
    echo "== PyTorch + transformers, the bench-model_cuda model"
    python3 "$here/bench_torch_gpu.py" --compile | tee "$out/torch_model_gpu.txt" || status=1
  fi
fi
# The model part in pieces that each fit a time box (check.sh): the training step at the
# 0.5B shape in TF32 and in bf16 storage beside PyTorch's bf16 autocast, eager and compiled
# (the issue's headline ratio) ...
if want train; then
  echo "== bench-model_cuda train: TF32, bf16 storage (0.5B, 4 x 512)"
  ARES_BENCH_MODES=tf32,bf16-stored "$here/bin/bench-model_cuda" train | tee "$out/model_train.txt" || status=1
  if has_torch; then
    echo "== PyTorch + transformers: the same step, bf16 autocast + SDPA, eager and torch.compile"
    python3 "$here/bench_torch_gpu.py" --only train --compile --train-dtypes bf16 --no-lora \
      | tee "$out/torch_train.txt" || status=1
  fi
fi
# ... the attention kernels beside SDPA at 4 x 2048 (head size 128 and 64) ...
if want attention; then
  echo "== bench-model_cuda attention"
  "$here/bin/bench-model_cuda" attention | tee "$out/model_attention.txt" || status=1
  if has_torch; then
    echo "== PyTorch SDPA, the same shapes"
    python3 "$here/bench_torch_gpu.py" --only attention | tee "$out/torch_attention.txt" || status=1
  fi
fi
# ... where the bf16 step's time goes, op by op (CUDA events), and what one GEMM for q/k/v
# or gate|up would save ...
if want profile; then
  echo "== bench-model_cuda step under ARES_PROFILE=1 (the 0.5B step in bf16 storage)"
  ARES_PROFILE=1 ARES_BENCH_RUNS=2 "$here/bin/bench-model_cuda" step | tee "$out/model_profile.txt" || status=1
  echo "== bench-model_cuda fuse: q/k/v and gate/up separate beside one product"
  "$here/bin/bench-model_cuda" fuse | tee "$out/model_fuse.txt" || status=1
fi
# ... the 1.5B and 3B shapes, f32 beside bf16 storage (MFU, peak memory) ...
if want scale; then
  echo "== bench-model_cuda scale: Qwen2.5-1.5B and 3B shapes"
  ARES_BENCH_RUNS=2 "$here/bin/bench-model_cuda" scale | tee "$out/model_scale.txt" || status=1
fi
# ... and the rest: decode and chunked-prefill attention, the ragged batch, generation.
if want rest; then
  echo "== bench-model_cuda decode-attention, chunk-attention, ragged, generate"
  "$here/bin/bench-model_cuda" decode-attention,chunk-attention,ragged,generate \
    | tee "$out/model_rest.txt" || status=1
fi
if want rollout; then
  echo "== bench-rollout_cuda: engine greedy / sampled, static, bf16 weights (0.5B, 128 x 256)"
  "$here/bin/bench-rollout_cuda" | tee "$out/rollout_cuda.txt" || status=1
  if has_torch; then
    echo "== transformers generate, the same 128 x 256 (bf16 is the issue's baseline)"
    python3 "$here/bench_torch_gpu.py" --only generate --gen 128x256 --gen-dtypes bf16 --runs 1 \
      | tee "$out/torch_rollout.txt" || status=1
  fi
fi
if want wheel; then
  whl=$(ls "$here"/ares-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ] && has_torch; then
    site=$(mktemp -d)
    python3 -m pip install --quiet --no-deps --target "$site" "$whl" || status=1
    echo "== ares on PyTorch CUDA tensors: the CPU twins, then beside torch eager"
    PYTHONPATH="$site" python3 "$here/test_cuda_tensors.py" 2>&1 | tee "$out/wheel_tests.txt" || status=1
    PYTHONPATH="$site" python3 "$here/bench_cuda_tensors.py" 2>&1 | tee "$out/wheel_bench.txt" || status=1
  else
    echo "no wheel in the bundle or no torch here: skipped"
  fi
fi
if want grpo; then
  # the 2 GB random model and the run stay out of $OUT (it is copied back)
  echo "== one RL step, ares-runner vs PyTorch"
  ARES_RUNNER="$here/bin/ares-runner" CONFIG="$here/bench_grpo_step.yaml" DIR=/tmp/ares-bench-grpo \
    "$here/bench_grpo_step.sh" "$@" 2>&1 | grep -v '^\[' | tee "$out/grpo_step.txt" || status=1
fi
if want dp; then
  echo "== data parallel on one GPU: worlds 1 and 2, TCP and NCCL"
  ARES_RUNNER="$here/bin/ares-runner" "$here/dp_check.sh" 2>&1 | tee "$out/dp_check.txt" || status=1
fi
exit $status
RUN
chmod +x "$dir/run.sh"

# Two time-boxed device calls for a short lease (15 minutes of device time, starts
# included; call 2 right after call 1, while the machine is still warm): every part of run.sh
# under its own limit, the parts that measure the training step first. `check.sh 1` (or no
# argument): the tests, the 0.5B training step beside PyTorch (eager and torch.compile), the
# attention kernels beside SDPA, the op profile, the 1.5B/3B shapes, the token kernels and the
# rollout — limits adding up to 560 s (give the call 600). `check.sh 2`: the rest of the model
# bench, the RL step reduced to 16 prompts x 8 and 2 steps, data parallel, the wheel — 220 s
# (give it 240). T_<PART> (T_TESTS, T_TRAIN, ...) set a part's limit in seconds. Files back
# in $OUT: one log a part and the kernels' JSON lines.
cat > "$dir/check.sh" <<'CHECK'
#!/usr/bin/env bash
set +u
here=$(cd "$(dirname "$0")" && pwd)
final=${OUT:-$here/out}; mkdir -p "$final"
work=$(mktemp -d)
# the CUDA libraries PyTorch's wheels bring, beside the toolkit's (run.sh adds those)
for d in /opt/torch/.venv/lib/python3.*/site-packages/nvidia/*/lib; do
  [ -d "$d" ] && LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
done
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
nvidia-smi -L 2>/dev/null
part() {  # part NAME LIMIT [OVERRIDES]: run.sh NAME under LIMIT seconds, log to $final/NAME.txt
  local t0; t0=$(date +%s)
  OUT=$work timeout "$2" "$here/run.sh" "$1" "${@:3}" > "$final/$1.txt" 2>&1
  echo "$1: rc=$? in $(( $(date +%s) - t0 )) s"
}
case "${1:-1}" in
  1)
    part tests "${T_TESTS:-170}"
    grep -E "^test result|panicked" "$final/tests.txt" | sort | uniq -c | head -30
    part train "${T_TRAIN:-110}"
    part attention "${T_ATTENTION:-35}"
    part profile "${T_PROFILE:-40}"
    part scale "${T_SCALE:-90}"
    part kernels "${T_KERNELS:-45}"
    cp "$work/gpu_kernels.jsonl" "$final/" 2>/dev/null
    part rollout "${T_ROLLOUT:-70}"
    tail -n 14 "$final/train.txt" "$final/attention.txt" "$final/scale.txt" "$final/kernels.txt" \
      "$final/rollout.txt"
    ;;
  2)
    part rest "${T_REST:-45}"
    TORCH_ARGS="--prompts 16 --steps 2" part grpo "${T_GRPO:-90}" \
      data.rollout_batch_size=16 worker.actor.global_batch_size=16 trainer.max_steps=2
    part dp "${T_DP:-55}"
    part wheel "${T_WHEEL:-30}"
    tail -n 12 "$final/rest.txt" "$final/grpo.txt" "$final/dp.txt" "$final/wheel.txt"
    ;;
  *) echo "usage: check.sh [1|2]"; exit 2 ;;
esac
CHECK
chmod +x "$dir/check.sh"
du -sh "$dir"
ls -la "$dir/bin"
