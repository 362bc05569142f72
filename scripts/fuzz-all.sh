#!/usr/bin/env bash
# Runs every ares-core fuzz target for a fixed number of executions (default 1,000,000)
# and prints one summary line per target. Needs nightly and cargo-fuzz:
#   rustup toolchain install nightly && cargo install cargo-fuzz
# ares-core forbids unsafe code, so the address sanitizer adds nothing but time: targets
# are built without it, with debug assertions (integer overflow checks) on.
set -euo pipefail
runs=${1:-1000000}
cd "$(dirname "$0")/../fuzz"
targets=$(cargo +nightly fuzz list)
cargo +nightly fuzz build --sanitizer none --debug-assertions
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
