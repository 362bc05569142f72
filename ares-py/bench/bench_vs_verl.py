#!/usr/bin/env python3
"""ares vs verl 0.9.1's torch functions on the CPU, same process, same inputs
(docs/python.md, *Speed*): GRPO advantages + REINFORCE Pro Max + the PPO policy loss (forward and
backward) on ROWS x T float32 tokens (default 4096 x 4096 = 16.8 M), and the per-call Python
overhead on a tiny input.

Needs torch and verl with the ares wheel installed, e.g. /work/verl-venv:

    /work/verl-venv/bin/pip install --force-reinstall --no-deps target/wheels/ares-*.whl
    /work/verl-venv/bin/python ares-py/bench/bench_vs_verl.py [--rows 4096] [--t 4096] [--n 8] [--runs 3]

Sides (each the best of --runs after one warm-up; both see the same tensors):
- GRPO: verl's registered `grpo` (compute_grpo_outcome_advantage, a Python loop over rows) and
  `grpo_vectorized`, vs `ares.verl.ares_grpo` (verl's signature; includes the row sum in torch);
- Pro Max: verl has none, so the "torch" side is a vectorized torch transcription of
  docs/algorithms.md §5 (RLOO, per-group adaptive scaling of positive / negative tokens), checked
  against ares here, vs `ares.verl.ares_reinforce_pro_max`;
- PPO loss: verl's compute_policy_loss_vanilla + loss.backward() vs `ares.verl.ares_vanilla` +
  loss.backward() (same gradient in log_prob.grad; checked here).
The sum of the three is the "step" ratio. Timings are wall clock; torch uses its default
intra-op threads (the machine's cores), ares its own.
"""

import argparse
import time
import timeit

import numpy as np
import torch

import ares
import ares.verl as av
from verl.trainer.ppo import core_algos as ca
from verl.workers.config import ActorConfig


def best(runs, f):
    f()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def torch_pro_max(scores, mask, n, eps=1e-8, max_scale=10.0, product_cap=1e8):
    """REINFORCE Pro Max (docs/algorithms.md §5, no KL, consecutive groups of n), in torch."""
    b, t = mask.shape
    g = scores.view(-1, n)
    rt = ((g - g.mean(dim=1, keepdim=True)) * (n / (n - 1))).reshape(b)
    a = rt[:, None] * mask  # returns-to-go of the last-token reward with γ = 1 (prefix masks)
    pos, neg = a > 0, a < 0
    ag = a.view(-1, n * t)
    sp = torch.where(pos, a, 0).view(-1, n * t).sum(1, dtype=torch.float64)
    sn = torch.where(neg, a, 0).view(-1, n * t).sum(1, dtype=torch.float64)
    a2 = ag.double() ** 2
    qp = torch.where(pos.view(-1, n * t), a2, 0).sum(1)
    qn = torch.where(neg.view(-1, n * t), a2, 0).sum(1)
    m = (pos.view(-1, n * t).sum(1) + neg.view(-1, n * t).sum(1)).double()
    ok = (pos.view(-1, n * t).any(1)) & (neg.view(-1, n * t).any(1)) & (sp.abs() >= eps) & (sn.abs() >= eps)
    rho = sp / torch.where(ok, sn, 1.0)
    alpha = torch.sqrt(m / (qp + torch.clamp(rho * rho * qn, max=product_cap) + eps))
    beta = -alpha * rho
    ok &= torch.isfinite(alpha) & torch.isfinite(beta)
    alpha = torch.where(ok, alpha.clamp(eps, max_scale), 1.0).float()
    beta = torch.where(ok, beta.clamp(eps, max_scale), 1.0).float()
    scale = torch.where(pos.view(-1, n * t), alpha[:, None], torch.where(neg.view(-1, n * t), beta[:, None], 0.0))
    return (ag * scale).view(b, t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--t", type=int, default=4096)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows, t, n = args.rows, args.t, args.n
    av.register()
    print(
        f"{rows} rows x {t} tokens = {rows * t / 1e6:.1f} M float32 tokens, groups of {n}; "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}, ares {ares.__version__}"
    )

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(t // 4, t + 1, (rows,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    scores = torch.randint(0, 2, (rows,), generator=g).float() + 0.1 * torch.rand(rows, generator=g)
    rewards = torch.zeros(rows, t)
    rewards[torch.arange(rows), lengths - 1] = scores
    index = np.array([f"prompt-{i // n}" for i in range(rows)], dtype=object)
    old = -torch.rand(rows, t, generator=g) * 3
    logp0 = old + 0.2 * torch.randn(rows, t, generator=g)
    adv = torch.randn(rows, t, generator=g) * mask
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2, clip_ratio_high=0.28)

    # ---- correctness of what is timed
    want = ca.compute_grpo_vectorized_outcome_advantage(rewards, mask, index)[0]
    got = av.ares_grpo(rewards, mask, index)[0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), "grpo differs"
    want = torch_pro_max(scores, mask, n)
    got = av.ares_reinforce_pro_max(rewards, mask, index)[0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), f"pro max differs {(got - want).abs().max()}"

    def loss(fn):
        lp = logp0.clone().requires_grad_(True)
        out, _ = fn(old, lp, adv, mask, "token-mean", cfg, None)
        out.backward()
        return lp.grad

    ga, gv = loss(av.ares_vanilla), loss(ca.compute_policy_loss_vanilla)
    scale = gv.abs().max().item()
    # at an exact tie L1 = L2 (measure zero; a few tokens in 16 M) torch.maximum splits the
    # gradient, ares takes L1's slope (docs/algorithms.md §6): allow those, nothing else
    off = int(((ga - gv).abs() > 1e-5 * scale).sum())
    assert off <= 1e-6 * ga.numel(), f"ppo gradient differs on {off} tokens"

    # ---- throughput
    logp = logp0.clone().requires_grad_(True)

    def verl_loss():
        logp.grad = None
        out, _ = ca.compute_policy_loss_vanilla(old, logp, adv, mask, "token-mean", cfg, None)
        out.backward()

    def ares_loss():
        logp.grad = None
        out, _ = av.ares_vanilla(old, logp, adv, mask, "token-mean", cfg, None)
        out.backward()

    r = args.runs
    res = {
        "grpo (verl grpo, row loop)": best(r, lambda: ca.compute_grpo_outcome_advantage(rewards, mask, index)),
        "grpo (verl grpo_vectorized)": best(r, lambda: ca.compute_grpo_vectorized_outcome_advantage(rewards, mask, index)),
        "grpo (ares_grpo)": best(r, lambda: av.ares_grpo(rewards, mask, index)),
        "pro max (torch)": best(r, lambda: torch_pro_max(rewards.sum(-1), mask, n)),
        "pro max (ares_reinforce_pro_max)": best(r, lambda: av.ares_reinforce_pro_max(rewards, mask, index)),
        "ppo loss fwd+bwd (verl vanilla)": best(r, verl_loss),
        "ppo loss fwd+bwd (ares_vanilla)": best(r, ares_loss),
    }
    for k, v in res.items():
        print(f"  {k:38s} {v * 1e3:9.1f} ms")
    pairs = [
        ("GRPO vs verl grpo", "grpo (verl grpo, row loop)", "grpo (ares_grpo)"),
        ("GRPO vs verl grpo_vectorized", "grpo (verl grpo_vectorized)", "grpo (ares_grpo)"),
        ("Pro Max vs torch", "pro max (torch)", "pro max (ares_reinforce_pro_max)"),
        ("PPO loss vs verl vanilla", "ppo loss fwd+bwd (verl vanilla)", "ppo loss fwd+bwd (ares_vanilla)"),
    ]
    for name, a, b in pairs:
        print(f"  ratio {name:30s} {res[a] / res[b]:6.2f}x")
    for grpo_side in ("grpo (verl grpo, row loop)", "grpo (verl grpo_vectorized)"):
        torch_step = res[grpo_side] + res["pro max (torch)"] + res["ppo loss fwd+bwd (verl vanilla)"]
        ares_step = res["grpo (ares_grpo)"] + res["pro max (ares_reinforce_pro_max)"] + res["ppo loss fwd+bwd (ares_vanilla)"]
        print(
            f"  step GRPO + Pro Max + PPO loss, torch side with {grpo_side.split('(')[1][:-1]}: "
            f"{torch_step * 1e3:.1f} ms vs ares {ares_step * 1e3:.1f} ms = {torch_step / ares_step:.2f}x"
        )

    # ---- per-call overhead on a tiny input (8 rows x 4 tokens, one group)
    tr = torch.tensor([[0, 0, 0, 1.0]] * 4 + [[0, 0, 0, 0.0]] * 4)
    tm = torch.ones(8, 4)
    tid = np.array(["p"] * 8, dtype=object)
    r8 = np.array([1, 0, 0, 1, 1, 0, 1, 0], dtype=np.float32)
    tl = torch.zeros(8, 4, requires_grad=True)
    to = torch.full((8, 4), -0.1)
    ta = torch.randn(8, 4)

    def per_call(f, number):
        return min(timeit.repeat(f, number=number, repeat=5)) / number * 1e6

    tiny = {
        "ares.grpo_advantages(numpy [8], n=8)": per_call(lambda: ares.grpo_advantages(r8, n=8), 20000),
        "ares.grpo_advantages(torch [8], uid=)": per_call(lambda: ares.grpo_advantages(tr[:, -1].contiguous(), uid=tid), 20000),
        "ares.policy_loss(numpy [8, 4])": per_call(
            lambda: ares.policy_loss(to.numpy(), to.numpy(), ta.numpy(), tm.numpy()), 20000
        ),
        "ares.verl.ares_grpo [8, 4]": per_call(lambda: av.ares_grpo(tr, tm, tid), 5000),
        "verl grpo [8, 4]": per_call(lambda: ca.compute_grpo_outcome_advantage(tr, tm, tid), 2000),
        "verl grpo_vectorized [8, 4]": per_call(lambda: ca.compute_grpo_vectorized_outcome_advantage(tr, tm, tid), 2000),
        "ares.verl.ares_vanilla fwd+bwd [8, 4]": per_call(
            lambda: av.ares_vanilla(to, tl, ta, tm, "token-mean", cfg, None)[0].backward(), 2000
        ),
        "verl vanilla fwd+bwd [8, 4]": per_call(
            lambda: ca.compute_policy_loss_vanilla(to, tl, ta, tm, "token-mean", cfg, None)[0].backward(), 2000
        ),
    }
    print("per-call time on a tiny input (best of 5):")
    for k, v in tiny.items():
        print(f"  {k:40s} {v:8.1f} µs")


if __name__ == "__main__":
    main()
