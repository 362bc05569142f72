#!/usr/bin/env python3
"""The LM head fused with log-prob and entropy (``ares.torch.linear_log_prob_entropy``) beside
PyTorch eager (``hidden @ weightᵀ``, ``log_softmax``, ``gather``, entropy) on the CPU: forward +
backward of ``-(adv·logπ).mean() - 0.01·H.mean()``, time (best of runs) and the process's peak
resident memory above its state before the first call. Each side runs in a fresh process.
With ``--from-logits`` the same loss from float32 logits that require grad
(``ares.torch.log_prob_entropy`` beside ``log_softmax`` + ``gather`` + entropy; no head).

    python ares-py/bench/bench_linear_head.py [--rows 2048] [--hidden 896] [--vocab 32768]
        [--threads 2] [--runs 3] [--from-logits]
"""

import argparse
import json
import resource
import subprocess
import sys
import time


def run_one(side, rows, hidden, vocab, threads, runs, from_logits=False):
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    if from_logits:
        x, w = 2 * torch.randn(rows, vocab, generator=g), torch.zeros(0)
    else:
        x = torch.randn(rows, hidden, generator=g)
        w = 0.05 * torch.randn(vocab, hidden, generator=g)
    ids = torch.randint(0, vocab, (rows,), generator=g)
    adv = torch.randn(rows, generator=g)

    def torch_rows(z):
        logp = torch.log_softmax(z, dim=-1)
        return logp.gather(-1, ids[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    if side == "ares":
        import ares.torch as at

        def head(h, wt):
            if from_logits:
                return at.log_prob_entropy(h, ids)
            return at.linear_log_prob_entropy(h, wt, ids)
    else:

        def head(h, wt):
            return torch_rows(h if from_logits else h @ wt.T)

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(runs + 1):
        h, wt = x.clone().requires_grad_(True), w.clone().requires_grad_(not from_logits)
        start = time.perf_counter()
        lp, ent = head(h, wt)
        (-(adv * lp).mean() - 0.01 * ent.mean()).backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    return {"best_ms": min(times[1:]) * 1e3, "peak_mib": peak / 1024}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--from-logits", action="store_true")
    ap.add_argument("--side", choices=["ares", "torch"])
    a = ap.parse_args()
    if a.side:
        print(json.dumps(run_one(a.side, a.rows, a.hidden, a.vocab, a.threads, a.runs, a.from_logits)))
        return
    res = {}
    flags = ["--from-logits"] if a.from_logits else []
    for side in ("torch", "ares"):
        out = subprocess.run(
            [sys.executable, __file__, "--side", side] + flags
            + [f"--{k}={getattr(a, k)}" for k in ("rows", "hidden", "vocab", "threads", "runs")],
            capture_output=True, text=True, check=True,
        )
        res[side] = json.loads(out.stdout.strip().splitlines()[-1])
    logits_mib = a.rows * a.vocab * 4 / 2**20
    what = f"{a.rows} x {a.vocab} logits" if a.from_logits else f"{a.rows} x {a.hidden} -> {a.vocab}"
    print(f"{what}, {a.threads} threads (one [N, V] f32 logits tensor: {logits_mib:.0f} MiB)")
    for side in ("torch", "ares"):
        print(f"  {side:5}: {res[side]['best_ms']:8.1f} ms  peak +{res[side]['peak_mib']:7.1f} MiB")
    print(f"  ares / torch: time {res['ares']['best_ms'] / res['torch']['best_ms']:.2f}x, "
          f"peak memory {res['ares']['peak_mib'] / max(res['torch']['peak_mib'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
