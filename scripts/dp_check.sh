#!/usr/bin/env bash
# Data parallelism on one machine: the demo's tiny model for 2 RL steps as a world of 1
# and as a world of 2 ranks launched the torchrun way (both ranks on device 0 — on a GPU,
# NCCL is told they are two hosts: NCCL_HOSTID, no P2P or shared memory, sockets on
# loopback), over TCP and over NCCL; then whether the checkpoints hold the same bytes.
#
#   scripts/dp_check.sh                 # DEVICE=cuda: tcp and nccl
#   DEVICE=cpu TRANSPORTS=tcp scripts/dp_check.sh
#
# Expected: every world-2 run equals the world-1 run on the CPU (the same bits at any world
# size); on a GPU the decode batches differ between worlds, so world 2 may differ from
# world 1 in the last bits, but TCP and NCCL carry the same bytes and must agree exactly.
# With `gradient_sum: ranks`, the sum overlapped with the backward (the default) and the sum
# after it must agree exactly too, over each transport (two ranks: a + b either way) — with
# CUDA's default bf16 gradients (over NCCL summed as bf16) and with f32 ones.
set -uo pipefail
bin=${ARES_RUNNER:-target/release/ares-runner}
device=${DEVICE:-cuda}
dir=${DIR:-/tmp/ares-dp-check}
rm -rf "$dir" && mkdir -p "$dir"
"$bin" demo-data --shape demo -o "$dir/assets" > "$dir/demo-data.log" 2>&1 || { cat "$dir/demo-data.log"; exit 1; }
cat > "$dir/run.yaml" <<YAML
data: {train_files: $dir/assets/data/train.jsonl, max_prompt_length: 64, max_response_length: 16, rollout_batch_size: 8, bootstrap: true}
algorithm: {online_filtering: false}
worker: {actor: {model: {model_path: $dir/assets/model}, global_batch_size: 4, micro_batch_size_per_device_for_update: 8}, rollout: {n: 4}}
trainer: {max_steps: 2, save_freq: 0, val_before_train: false, device: $device, logger: [file]}
YAML
status=0
launch() {  # launch NAME WORLD TRANSPORT [OVERRIDE...]: the run's ranks, waited for
  local name=$1 world=$2 transport=$3 port=$((29600 + RANDOM % 2000)) pids=() r
  shift 3
  for r in $(seq 0 $((world - 1))); do
    env RANK=$r WORLD_SIZE=$world LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      ARES_TRANSPORT=$transport ARES_COLLECTIVE_TIMEOUT=120 ARES_NO_PROGRESS=1 \
      NCCL_HOSTID="ares-dp-check-$r" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
      "$bin" train -c "$dir/run.yaml" "trainer.save_checkpoint_path=$dir/$name" "$@" \
      > "$dir/$name.rank$r.log" 2>&1 &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  if [ $rc -ne 0 ]; then
    echo "$name: FAILED"; tail -n 3 "$dir/$name".rank*.log; status=1
  else
    echo "$name: done"
  fi
}
same() {  # same A B [strict]: whether two runs' final checkpoints hold the same bytes
  local a b
  a=$(ls -d "$dir/$1"/checkpoints/step_* 2>/dev/null | tail -1)
  b=$(ls -d "$dir/$2"/checkpoints/step_* 2>/dev/null | tail -1)
  if [ -z "$a" ] || [ -z "$b" ]; then echo "$1 vs $2: no checkpoint"; status=1; return; fi
  if diff -rq -x config.yaml "$a" "$b" > /dev/null; then
    echo "$1 vs $2: the same bytes"
  else
    echo "$1 vs $2: differ"
    [ "${3:-}" = strict ] && status=1
  fi
}
launch w1 1 tcp
for t in ${TRANSPORTS:-tcp nccl}; do
  launch "w2-$t" 2 "$t"
  same w1 "w2-$t"
done
[ -d "$dir/w2-tcp" ] && [ -d "$dir/w2-nccl" ] && same w2-tcp w2-nccl
for t in ${TRANSPORTS:-tcp nccl}; do
  launch "w2-$t-ranks" 2 "$t" trainer.gradient_sum=ranks trainer.overlap_gradient_sum=true
  launch "w2-$t-ranks-after" 2 "$t" trainer.gradient_sum=ranks trainer.overlap_gradient_sum=false
  same "w2-$t-ranks" "w2-$t-ranks-after" strict
  launch "w2-$t-ranks-g32" 2 "$t" trainer.gradient_sum=ranks trainer.overlap_gradient_sum=true trainer.grad_dtype=f32
  launch "w2-$t-ranks-after-g32" 2 "$t" trainer.gradient_sum=ranks trainer.overlap_gradient_sum=false trainer.grad_dtype=f32
  same "w2-$t-ranks-g32" "w2-$t-ranks-after-g32" strict
done
exit $status
