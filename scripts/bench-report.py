#!/usr/bin/env python3
"""Prints a markdown table of criterion results: per group, each function's time, GB/s of
input read, and its ratio to the group's `baseline_read` (same bytes, plain sum).

    cargo bench -p ares-benches --bench core
    scripts/bench-report.py [target/criterion]
"""
import json
import os
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "target/criterion"
rows = []
for group in sorted(os.listdir(root)):
    gdir = os.path.join(root, group)
    if not os.path.isdir(gdir) or group == "report":
        continue
    results = {}
    for fn in sorted(os.listdir(gdir)):
        est = os.path.join(gdir, fn, "new", "estimates.json")
        bench = os.path.join(gdir, fn, "new", "benchmark.json")
        if not (os.path.exists(est) and os.path.exists(bench)):
            continue
        with open(est) as f:
            mean_ns = json.load(f)["mean"]["point_estimate"]
        with open(bench) as f:
            meta = json.load(f)
        nbytes = (meta.get("throughput") or {}).get("Bytes")
        name = meta.get("function_id") or fn
        results[name] = (mean_ns, nbytes)
    def baseline_for(name):
        # "f32/fused" pairs with "f32/baseline_read"; plain names with "baseline_read"
        prefix = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
        return results.get(prefix + "baseline_read")

    for name, (ns, nbytes) in results.items():
        base = baseline_for(name)
        gbs = nbytes / ns if nbytes else float("nan")
        ratio = base[0] / ns if base else float("nan")
        rows.append((group, name, ns / 1e6, gbs, ratio))

print("| group | function | time (ms) | GB/s of input | ratio to baseline |")
print("|---|---|---:|---:|---:|")
for group, name, ms, gbs, ratio in rows:
    print(f"| {group} | {name} | {ms:.2f} | {gbs:.1f} | {ratio:.2f} |")
