"""ares's token kernels on PyTorch CUDA tensors (the wheel, ares._cuda) beside PyTorch eager on
the same tensors, same process (the advantage estimators too) (issue 29's goals: the fused log-prob + entropy from bf16
logits within 10 % of the Rust benchmark's time, >= 20x eager; the fused linear head's
forward + backward from bf16 hidden states in no more time and memory than Liger's fused
linear cross-entropy, which is timed too where it imports).

    python3 scripts/bench_cuda_tensors.py [--rows 8192] [--vocab 151936] [--runs 10]

Times are CUDA-event medians; GB/s counts the logits read once, beside a device copy of the
same tensor (read + write) in the same run.
"""

import argparse

import torch

import ares


def timed(fn, runs):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def eager_log_prob_entropy(x, ids):
    logp = torch.log_softmax(x.float(), dim=-1)
    lp = logp.gather(-1, ids[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def eager_linear_head(x, w, ids, a, b):
    """What a PyTorch RL loss does without a fused head: [N, V] logits, their log-softmax."""
    logits = (x @ w.t()).float()
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, ids[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp * a + ent * b).sum().backward()


def fused_linear_head(x, w, ids, a, b):
    import ares.torch as at

    lp, ent = at.linear_log_prob_entropy(x, w, ids)
    (lp * a + ent * b).sum().backward()


def liger_linear_head(liger, x, w, ids):
    """Liger's fused linear cross-entropy (the log-prob alone: its loss is the mean −logπ)."""
    liger(w, x, ids).backward()


def linear_heads(rows, vocab, runs):
    """Forward + backward of the head from bf16 hidden states: time and peak memory over the
    inputs, for hidden sizes of Qwen2.5-0.5B, 1.5B and 7B."""
    dev = torch.device("cuda")
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        liger = None
        print(f"Liger not importable here ({type(e).__name__}): its line is skipped")
    for hidden in (896, 1536, 3584):
        x = (torch.randn(rows, hidden, device=dev) * 0.5).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(vocab, hidden, device=dev) * 0.02).to(torch.bfloat16).requires_grad_(True)
        ids = torch.randint(0, vocab, (rows,), device=dev)
        a, b = torch.randn(rows, device=dev), torch.randn(rows, device=dev) * 0.01

        def measured(fn):
            x.grad = w.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t = timed(fn, runs)
            return t, (torch.cuda.max_memory_allocated() - base) / 2**30

        cases = [("ares fused", lambda: fused_linear_head(x, w, ids, a, b))]
        cases.append(("torch eager", lambda: eager_linear_head(x, w, ids, a, b)))
        if liger is not None:
            cases.append(("Liger FLCE", lambda: liger_linear_head(liger, x, w, ids)))
        line = []
        for name, fn in cases:
            try:
                t, gib = measured(fn)
                line.append(f"{name} {t:.1f} ms / {gib:.2f} GiB")
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                line.append(f"{name}: out of memory")
        print(f"linear head fwd+bwd {rows} x {hidden} -> {vocab} bf16: " + "; ".join(line) +
              " (peak memory above the inputs; the gradients' own memory included)")
        del x, w
        torch.cuda.empty_cache()


def eager_grpo_tokens(r, group, groups, mask):
    """GRPO token advantages as a PyTorch trainer writes them (verl's recipe, vectorised):
    group means and unbiased stds by scatter, (r − mean)/(std + 1e-6) broadcast on the mask."""
    n = torch.zeros(groups, device=r.device).index_add_(0, group, torch.ones_like(r))
    mean = torch.zeros(groups, device=r.device).index_add_(0, group, r) / n
    d = r - mean[group]
    var = torch.zeros(groups, device=r.device).index_add_(0, group, d * d) / (n - 1)
    return (d / (var.sqrt()[group] + 1e-6))[:, None] * mask


def eager_reinforce_pp(r, mask, kl, gamma):
    """REINFORCE++ as OpenRLHF writes it: token rewards, a reversed loop of returns, whitening."""
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    rewards = -kl * mask + last.float() * r[:, None]
    ret = torch.zeros_like(rewards)
    g = torch.zeros_like(r)
    for t in range(rewards.shape[1] - 1, -1, -1):
        g = rewards[:, t] + gamma * g
        ret[:, t] = g
    ret = ret * mask
    mean = ret.sum() / mask.sum()
    var = ((ret - mean) ** 2 * mask).sum() / mask.sum()
    return (ret - mean) * var.clamp(min=1e-8).rsqrt() * mask


def advantages(runs):
    """The advantage estimators on CUDA tensors beside PyTorch eager (1 024 rows in groups of
    8, 4 096 tokens), with the largest difference."""
    dev = torch.device("cuda")
    rows, cols, n = 1024, 4096, 8
    r = (torch.rand(rows, device=dev) < 0.5).float()
    lengths = torch.randint(1, cols + 1, (rows,), device=dev)
    mask = (torch.arange(cols, device=dev)[None, :] < lengths[:, None]).float()
    kl = torch.rand(rows, cols, device=dev) * 0.01
    group = torch.arange(rows, device=dev) // n
    t_ares = timed(lambda: ares.grpo_token_advantages(r, mask, n=n), runs)
    t_eager = timed(lambda: eager_grpo_tokens(r, group, rows // n, mask), runs)
    err = float((ares.grpo_token_advantages(r, mask, n=n) - eager_grpo_tokens(r, group, rows // n, mask)).abs().max())
    print(f"grpo_token_advantages {rows} x {cols}, n = {n}: ares {t_ares:.3f} ms, torch eager {t_eager:.3f} ms: "
          f"{t_eager / t_ares:.1f}x; max |diff| {err:.2e} (ares's time includes reading its status, one sync)")
    t_ares = timed(lambda: ares.reinforce_pp_advantages(r, mask, weighted_kl=kl, gamma=0.99), runs)
    t_eager = timed(lambda: eager_reinforce_pp(r, mask, kl, 0.99), max(2, runs // 5))
    got = ares.reinforce_pp_advantages(r, mask, weighted_kl=kl, gamma=0.99)
    err = float((got - eager_reinforce_pp(r, mask, kl, 0.99)).abs().max())
    print(f"reinforce_pp_advantages {rows} x {cols}, γ 0.99, KL: ares {t_ares:.3f} ms, torch eager (a loop over "
          f"tokens) {t_eager:.3f} ms: {t_eager / t_ares:.1f}x; max |diff| {err:.2e}")
    t_ares = timed(lambda: ares.reinforce_pro_max(r, mask, n=n, weighted_kl=kl), runs)
    print(f"reinforce_pro_max {rows} x {cols}, n = {n}, KL: ares {t_ares:.3f} ms (no PyTorch reference here)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--runs", type=int, default=10)
    a = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, ares {ares.__version__}")
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        rows = a.rows if dtype == torch.bfloat16 else a.rows // 2
        x = (torch.randn(rows, a.vocab, device=dev) * 2).to(dtype)
        ids = torch.randint(0, a.vocab, (rows,), device=dev)
        gb = x.numel() * x.element_size() / 1e9
        t_copy = timed(lambda: x.clone(), a.runs)
        t_ares = timed(lambda: ares.log_prob_entropy(x, ids), a.runs)
        t_eager = timed(lambda: eager_log_prob_entropy(x, ids), max(3, a.runs // 3))
        lp, h = ares.log_prob_entropy(x, ids)
        lp_t, h_t = eager_log_prob_entropy(x, ids)
        err = max(float((lp - lp_t).abs().max()), float((h - h_t).abs().max()))
        name = str(dtype).replace("torch.", "")
        print(
            f"log_prob_entropy {rows} x {a.vocab} {name}: ares {t_ares:.3f} ms ({gb / t_ares * 1e3:.0f} GB/s of "
            f"logits read; a device copy moves {2 * gb / t_copy * 1e3:.0f} GB/s read + write), torch eager "
            f"{t_eager:.3f} ms: {t_eager / t_ares:.1f}x; max |diff| {err:.2e} (ares's time includes its "
            f"status check, one sync)"
        )
    rows, cols = 1024, 4096
    logp = -torch.rand(rows, cols, device=dev) * 3
    ref = logp + 0.3 * torch.randn(rows, cols, device=dev)
    mask = (torch.rand(rows, cols, device=dev) < 0.8).float()
    beta = torch.rand(rows, device=dev)

    def eager_kl():
        d = ref - logp
        k = (d.exp() - d - 1).clamp(-10, 10) * mask
        w = k * beta[:, None]
        return w.sum(-1), k.sum(-1) / mask.sum(-1).clamp(min=1)

    t_ares = timed(lambda: ares.masked_dynamic_kl(logp, ref, mask, beta), a.runs)
    t_eager = timed(eager_kl, a.runs)
    print(f"masked_dynamic_kl k3 {rows} x {cols}: ares {t_ares:.3f} ms, torch eager {t_eager:.3f} ms: "
          f"{t_eager / t_ares:.1f}x (ares's time includes reading `total`, one sync)")
    ent = torch.rand(rows, cols, device=dev) * mask
    t_win = timed(lambda: ares.entropy_windows(ent, mask, tau=0.5), a.runs)
    out = ares.entropy_windows(ent, mask)
    t_pct = timed(lambda: ares.row_percentile(out["means"], out["valid"], 95.0), a.runs)
    print(f"entropy_windows + HWE {rows} x {cols}: {t_win:.3f} ms; row_percentile: {t_pct:.3f} ms")
    advantages(a.runs)
    linear_heads(a.rows, a.vocab, max(3, a.runs // 2))


if __name__ == "__main__":
    main()
