#!/usr/bin/env bash
# The ranks' gradient sum after the backward and overlapped with it, side by side: a world
# of 2 processes launched the torchrun way (TCP through rank 0, one thread each),
# `gradient_sum: ranks`, the two settings alternated ROUNDS times. Prints the sums of
# time/step, time/update and time/collective over the steps after the first two.
#
#   scripts/bench_dp.sh                         # the demo's tiny model, random weights
#   CONFIG=runs/demo-ares/config.yaml scripts/bench_dp.sh   # any run's config
set -euo pipefail
bin=${ARES_RUNNER:-target/release/ares-runner}
dir=${DIR:-/tmp/ares-bench-dp}
steps=${STEPS:-12}
mkdir -p "$dir"
config=${CONFIG:-}
if [ -z "$config" ]; then
  "$bin" demo-data --shape demo -o "$dir/assets" > "$dir/demo-data.log" 2>&1
  config=$dir/run.yaml
  cat > "$config" <<YAML
data: {train_files: $dir/assets/data/train.jsonl, max_prompt_length: 64, max_response_length: 16, rollout_batch_size: 8, bootstrap: true}
algorithm: {online_filtering: false}
worker: {actor: {model: {model_path: $dir/assets/model}, global_batch_size: 4, micro_batch_size_per_device_for_update: 8}, rollout: {n: 4}}
trainer: {save_freq: 0, val_before_train: false, val_freq: 0, device: cpu, logger: [file]}
YAML
fi
run() {  # run NAME OVERLAP
  local port=$((29600 + RANDOM % 2000)) pids=() r
  rm -rf "${dir:?}/$1"
  for r in 0 1; do
    env RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port ARES_NO_PROGRESS=1 \
      "$bin" train -c "$config" "trainer.save_checkpoint_path=$dir/$1" "trainer.max_steps=$steps" \
      trainer.save_freq=0 trainer.val_freq=0 trainer.val_before_train=false \
      trainer.gradient_sum=ranks "trainer.overlap_gradient_sum=$2" trainer.threads=1 \
      > "$dir/$1.rank$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  python3 - "$dir/$1/metrics.jsonl" "$1" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])][2:]
s = lambda k: sum(l.get(k, 0) for l in lines)
print(f"{sys.argv[2]:>12}: {len(lines)} steps, step {s('time/step'):.2f} s, update "
      f"{s('time/update'):.2f} s, collective {s('time/collective'):.2f} s, "
      f"{s('perf/collective_ops'):.0f} ops ({s('perf/collective_overlapped_ops'):.0f} overlapped)")
PY
}
for round in $(seq "${ROUNDS:-2}"); do
  run "overlap-$round" true
  run "after-$round" false
done
