#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries on this machine (no GPU and no CUDA toolkit
# needed: CUDA libraries are loaded at run time) and packs them, with a runner, into a
# folder to copy to a GPU machine that has no Rust toolchain.
#
#   scripts/gpu-bundle.sh [DIR]        # default DIR = .gpu (git-ignored)
#   # on the GPU machine:
#   DIR/run.sh [tests|kernels|model|rollout|wheel|grpo|dp]   # all parts, or one (each fits a
#                                            # 10-minute call);
#                                            # after `grpo`: dotted overrides of the RL step
#   DIR/check.sh                             # every part time-boxed in one call (~8 min)
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
want() { [ "$part" = all ] || [ "$part" = "$1" ]; }
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

# One time-boxed device call for a short lease (15 minutes of device time, starts included):
# every part of run.sh under its own limit, the RL step reduced to 16 prompts x 8 and 2 steps,
# at most 10 files back in $OUT. T_TESTS, T_KERNELS, T_MODEL, T_ROLLOUT, T_WHEEL, T_GRPO, T_DP
# set the limits (seconds; the defaults add up to 590: give the call 600).
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
part tests "${T_TESTS:-180}"
grep -E "^test result|panicked" "$final/tests.txt" | sort | uniq -c | head -30
part kernels "${T_KERNELS:-60}"
cp "$work/gpu_kernels.jsonl" "$final/" 2>/dev/null
part model "${T_MODEL:-70}"
part rollout "${T_ROLLOUT:-90}"
part wheel "${T_WHEEL:-35}"
TORCH_ARGS="--prompts 16 --steps 2" part grpo "${T_GRPO:-100}" \
  data.rollout_batch_size=16 worker.actor.global_batch_size=16 trainer.max_steps=2
part dp "${T_DP:-55}"
tail -n 12 "$final/kernels.txt" "$final/model.txt" "$final/rollout.txt" "$final/wheel.txt" "$final/grpo.txt" \
  "$final/dp.txt"
CHECK
chmod +x "$dir/check.sh"
du -sh "$dir"
ls -la "$dir/bin"
