#!/usr/bin/env bash
# Runs every fuzz target for a fixed number of executions (default 1,000,000) and prints
# one summary line per target: ares-core's math, and the parsers of untrusted model folders
# and datasets (config YAML + overrides, chat templates, the model folder's JSON files,
# image bytes, dataset rows, weight files, rubric criteria and the grader command's replies,
# the answer graders, the model's tool calls). Needs nightly and cargo-fuzz:
#   rustup toolchain install nightly && cargo install cargo-fuzz
#   scripts/fuzz-all.sh [RUNS] [TARGET...]
# The code fuzzed forbids unsafe code or sits on crates that check their own, so the
# address sanitizer adds nothing but time: targets are built without it, with debug
# assertions (integer overflow checks) on. A parser target's corpus starts from the
# repository's fixtures of its input.
set -euo pipefail
runs=${1:-1000000}
shift || true
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/fuzz"
targets=${*:-$(cargo +nightly fuzz list)}
cargo +nightly fuzz build --sanitizer none --debug-assertions

# seed: target -> files of the repository it starts from
seed() {
  local dir="corpus/$1"; shift
  if [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then return 0; fi
  mkdir -p "$dir"
  local f
  for f in "$@"; do
    if [ -f "$f" ]; then cp "$f" "$dir/$(basename "$(dirname "$f")")_$(basename "$f")"; fi
  done
}
fx="$root/ares-model/tests/fixtures"
seed config_yaml "$root"/examples/configs/*.yaml "$root"/ares-runner/tests/fixtures/easyr1/*.yaml
seed chat_template "$fx"/tokenizer/templates/* "$fx"/models/*/tokenizer_config.json
seed hf_configs "$fx"/models/*/config.json "$fx"/models/*/generation_config.json \
  "$fx"/models/*/tokenizer_config.json "$fx"/vl/*/config.json "$fx"/vl/*/preprocessor_config.json
seed image "$fx"/vl/images/*.png "$root"/ares-runner/tests/fixtures/data/images/*
seed dataset_rows "$root"/ares-runner/tests/fixtures/data/*.jsonl "$root"/ares-runner/tests/fixtures/data/*.parquet
seed math_grader "$root"/ares-runner/tests/fixtures/data/math.jsonl
seed rubric_grader "$root"/ares-runner/tests/fixtures/data/rubrics.jsonl
seed safetensors_files "$fx"/models/*/model.safetensors
if [ ! -d corpus/tool_calls ]; then
  mkdir -p corpus/tool_calls
  printf '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(17*23 - 4)/3"}}\n</tool_call>' > corpus/tool_calls/hermes
  printf '<|python_tag|>{"name": "calculator", "parameters": {"expression": "2^-3 + 0.25"}}; {"name": "x"}' > corpus/tool_calls/llama3
  printf '%s' '-(2**10)/(1.5-3/2)' > corpus/tool_calls/expression
fi
if [ ! -d corpus/grader_reply ]; then
  mkdir -p corpus/grader_reply
  printf '{"met": [true, false], "why": "the first is met"}' > corpus/grader_reply/seed
fi

for t in $targets; do
  mkdir -p "corpus/$t"
  log=$(mktemp)
  start=$(date +%s)
  if cargo +nightly fuzz run --sanitizer none --debug-assertions "$t" "corpus/$t" -- \
      -runs="$runs" -max_len=2048 -print_final_stats=1 >"$log" 2>&1; then
    execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo "?")
    echo "$t: ok, $execs executions in $(( $(date +%s) - start )) s, no crash"
  else
    echo "$t: FAILED (log: $log)"
    tail -40 "$log"
    exit 1
  fi
  rm -f "$log"
done
