"""ares on PyTorch CUDA tensors (ares._cuda): each function equals its CPU twin on the same
data, runs on the caller's current stream, and refuses what it cannot take. Without a GPU
only the routing and its errors are checked. Runs under pytest, or as a script on a machine
without pytest (``python3 test_cuda_tensors.py``: the GPU bundle's check does that)."""

import sys
import types

import numpy as np

try:
    import pytest
except ImportError:  # the GPU machine's Python may have no pytest
    pytest = None

import ares


def _torch():
    if pytest is not None:
        return pytest.importorskip("torch")
    import torch

    return torch


def _gpu():
    torch = _torch()
    if not torch.cuda.is_available():
        if pytest is not None:
            pytest.skip("no CUDA device")
        raise RuntimeError("no CUDA device")
    return torch


def _raises(exc, match, fn):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{match!r} not in {str(e)!r}"
        return
    raise AssertionError(f"no {exc.__name__} raised (wanted {match!r})")


class FakeCuda:
    """Looks like a torch CUDA tensor to the routing (type module, device type)."""

    __module__ = "torch.fake"

    def __init__(self):
        self.device = types.SimpleNamespace(type="cuda", index=0)

    def detach(self):
        return self

    def contiguous(self):
        return self


def test_a_cuda_tensor_beside_a_cpu_array_is_named():
    _torch()
    _raises(ValueError, "`mask` is a CPU tensor or array while other arguments are CUDA tensors",
            lambda: ares.entropy_windows(FakeCuda(), np.ones((2, 3), dtype=np.float32)))


def test_functions_without_a_cuda_path_still_refuse_cuda_tensors():
    torch = _torch()
    t = torch.ones(4, device="meta")
    _raises(ValueError, "this function runs on CPU arrays; move the tensor with .cpu()",
            lambda: ares.group_means(t, n=4))


def test_the_advantage_estimators_route_cuda_tensors():
    _torch()
    _raises(ValueError, "rloo_token_advantages: `mask` is a CPU tensor or array while other arguments are CUDA",
            lambda: ares.rloo_token_advantages(FakeCuda(), np.ones((2, 3), dtype=np.float32), n=2))
    _raises(ValueError, "masked_whiten: `mask` is a CPU tensor or array",
            lambda: ares.masked_whiten(FakeCuda(), np.ones((2, 3), dtype=np.float32)))


def test_without_a_cuda_driver_the_error_names_the_library():
    from ares import _ares

    if _ares.cuda_driver_available():
        if pytest is not None:
            pytest.skip("libcuda loads here")
        return
    _raises(ValueError, "log_prob_entropy: CUDA device 0:",
            lambda: _ares.cuda_log_prob_entropy(0, 0, 0, "float32", 1, 1, 1.0, 0, 0, 0))
    _raises(ValueError, "log_prob_entropy_backward: CUDA device 0:",
            lambda: _ares.cuda_log_prob_entropy_backward(0, 0, 0, 1, 1, 1.0, 0, 0, 0, 0))


def _close(got, want, rtol, atol, what):
    got = got.detach().cpu().numpy() if hasattr(got, "detach") else np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def test_log_prob_entropy_equals_the_cpu_on_every_logit_dtype():
    torch = _gpu()
    g = torch.Generator().manual_seed(0)
    for rows, vocab in [(7, 33), (64, 151936 // 8), (3, 1)]:
        x32 = torch.randn(rows, vocab, generator=g) * 3
        x32[0, : vocab // 2] = float("-inf") if vocab > 1 else x32[0, 0]
        ids = torch.randint(0, vocab, (rows,), generator=g)
        if vocab > 1:
            ids[0] = vocab - 1
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = x32.to(dtype)
            want_lp, want_h = ares.log_prob_entropy(x, ids.numpy(), temperature=0.7)
            lp, h = ares.log_prob_entropy(x.cuda(), ids.cuda(), temperature=0.7)
            assert lp.is_cuda and h.is_cuda and lp.dtype == torch.float32
            _close(lp, want_lp, 1e-5, 1e-5, f"log_prob {rows}x{vocab} {dtype}")
            _close(h, want_h, 1e-5, 1e-5, f"entropy {rows}x{vocab} {dtype}")
            none, h2 = ares.log_prob_entropy(x.cuda())
            assert none is None
            _close(h2, ares.log_prob_entropy(x)[1], 1e-5, 1e-5, "entropy without targets")
    # leading axes
    x = torch.randn(2, 3, 50, generator=g)
    lp, h = ares.log_prob_entropy(x.cuda(), torch.zeros(2, 3, dtype=torch.int64).cuda())
    assert tuple(lp.shape) == (2, 3) and tuple(h.shape) == (2, 3)


def test_log_prob_entropy_refuses_bad_rows_and_ids():
    torch = _gpu()
    x = torch.randn(4, 10, device="cuda")
    x[2, 3] = float("nan")
    _raises(ValueError, "NaN", lambda: ares.log_prob_entropy(x))
    ok = torch.randn(4, 10, device="cuda")
    _raises(ValueError, "outside [0, 10)", lambda: ares.log_prob_entropy(ok, torch.full((4,), 10, device="cuda")))
    _raises(ValueError, "integer ids", lambda: ares.log_prob_entropy(ok, torch.zeros(4, device="cuda")))
    _raises(ValueError, "int64", lambda: ares.log_prob_entropy(ok.long()))


def test_the_autograd_function_equals_the_cpus_on_cuda():
    torch = _gpu()
    import ares.torch as at

    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3000, generator=g) * 2
    ids = torch.randint(0, 3000, (6,), generator=g)
    a, b = torch.randn(6, generator=g), torch.randn(6, generator=g)
    with torch.no_grad():
        lp, h = at.log_prob_entropy(x.cuda(), ids.cuda(), temperature=0.8)
    want_lp, want_h = ares.log_prob_entropy(x, ids, temperature=0.8)
    _close(lp, want_lp, 1e-5, 1e-5, "log_prob through ares.torch")
    _close(h, want_h, 1e-5, 1e-5, "entropy through ares.torch")
    grads = {}
    for dev in ("cpu", "cuda"):
        xd = x.to(dev).requires_grad_(True)
        lp, h = at.log_prob_entropy(xd, ids.to(dev), temperature=0.8)
        (lp * a.to(dev) + h * b.to(dev)).sum().backward()
        grads[dev] = xd.grad
    assert grads["cuda"].is_cuda
    _close(grads["cuda"], grads["cpu"].numpy(), 1e-4, 1e-6, "dlogits on CUDA")
    # the entropy's gradient alone, without targets
    xd = x.cuda().requires_grad_(True)
    at.log_prob_entropy(xd)[1].sum().backward()
    xc = x.clone().requires_grad_(True)
    at.log_prob_entropy(xc)[1].sum().backward()
    _close(xd.grad, xc.grad.numpy(), 1e-4, 1e-6, "entropy-only dlogits on CUDA")
    # 16-bit logits: the fused kernel's gradient in their dtype, the CPU's (the float32
    # backward of the widened logits, rounded) to one ulp of that dtype
    for dtype, ulp in ((torch.bfloat16, 2.0**-7), (torch.float16, 2.0**-10)):
        half = x.to(dtype)
        grads = {}
        for dev in ("cpu", "cuda"):
            xd = half.to(dev).requires_grad_(True)
            lp, h = at.log_prob_entropy(xd, ids.to(dev), temperature=0.8)
            (lp * a.to(dev) + h * b.to(dev)).sum().backward()
            grads[dev] = xd.grad
        assert grads["cuda"].dtype == dtype, dtype
        got, want = grads["cuda"].float().cpu(), grads["cpu"].float()
        assert bool(((got - want).abs() <= want.abs() * ulp + 1e-7).all()), f"{dtype} dlogits on CUDA"


def _windows_data(torch, rows=9, cols=300, seed=1):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, cols + 1, rows)
    mask = (np.arange(cols)[None, :] < lengths[:, None]).astype(np.float32)
    ent = (rng.gamma(0.6, 1.0, (rows, cols)) * mask).astype(np.float32)
    trig = (rng.random((rows, cols)) < 0.5).astype(np.float32)
    return ent, mask, trig


def test_entropy_windows_and_row_percentile_equal_the_cpu():
    torch = _gpu()
    ent, mask, trig = _windows_data(torch)
    for w, inc in [(4, False), (1, True), (7, True)]:
        want = ares.entropy_windows(ent, mask, window_size=w, includes_self=inc, tau=0.9, trigger=trig)
        got = ares.entropy_windows(torch.from_numpy(ent).cuda(), torch.from_numpy(mask).cuda(), window_size=w,
                                   includes_self=inc, tau=0.9, trigger=torch.from_numpy(trig).cuda())
        for k in ("means", "valid", "hwe_mask", "counts", "soft_cost"):
            _close(got[k], want[k], 1e-5, 1e-5, f"{k} w={w}")
        thr, has = ares.row_percentile(got["means"], got["valid"], 95.0)
        want_thr, want_has = ares.row_percentile(want["means"], want["valid"], 95.0)
        _close(thr, want_thr, 1e-5, 1e-6, "threshold")
        _close(has, want_has, 0, 0, "has")


def test_masked_dynamic_kl_equals_the_cpu_for_every_estimator():
    torch = _gpu()
    rng = np.random.default_rng(2)
    rows, cols = 6, 130
    a = (-rng.random((rows, cols)) * 3).astype(np.float32)
    b = (a + 0.4 * rng.standard_normal((rows, cols))).astype(np.float32)
    m = (rng.random((rows, cols)) < 0.8).astype(np.float32)
    h = (rng.random((rows, cols)) < 0.3).astype(np.float32)
    beta = rng.random(rows).astype(np.float32)
    c = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
    for est in ("k1", "abs", "k2", "k3", "k1+", "k3+"):
        for bt, hm in [(beta, h), (0.05, None)]:
            want = ares.masked_dynamic_kl(a, b, m, bt, hwe_mask=hm, low_ratio=0.5, estimator=est)
            got = ares.masked_dynamic_kl(c(a), c(b), c(m), c(bt) if isinstance(bt, np.ndarray) else bt,
                                         hwe_mask=None if hm is None else c(hm), low_ratio=0.5, estimator=est)
            for k in ("kl", "weighted", "row_weighted_sum", "row_mean_kl"):
                _close(got[k], want[k], 2e-5, 1e-6, f"{k} {est}")
            assert abs(got["total"] - want["total"]) <= 2e-5 * (1 + abs(want["total"])), est
    _raises(ValueError, "unknown estimator", lambda: ares.masked_dynamic_kl(c(a), c(b), c(m), 0.1, estimator="k9"))


def test_policy_loss_refuses_what_has_no_kernel():
    # checked before any device is touched: the fake tensors reach no driver
    x = FakeCuda()
    _raises(ValueError, "`is_correction` = 'tis' needs `logp_rollout`",
            lambda: ares.policy_loss(x, x, x, x, is_correction="tis"))
    _raises(TypeError, "unexpected keyword argument 'clip_ratio'",
            lambda: ares.policy_loss(x, x, x, x, clip_ratio=0.2))


def test_policy_loss_equals_the_cpu_for_every_mode():
    torch = _gpu()
    rng = np.random.default_rng(5)
    rows, cols = 7, 300
    logp = (-rng.random((rows, cols)) * 3).astype(np.float32)
    old = (logp - 0.5 * rng.standard_normal((rows, cols))).astype(np.float32)
    roll = (old + 0.8 * rng.standard_normal((rows, cols))).astype(np.float32)
    adv = rng.standard_normal((rows, cols)).astype(np.float32)
    mask = (rng.random((rows, cols)) < 0.8).astype(np.float32)
    mask[2] = 0.0  # an empty row
    c = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
    # Clip-Cov with every unclipped token a candidate and a budget of a third, KL-Cov with a
    # tenth: the covariance means are summed in f64 on both sides, so the same tokens are chosen
    cov = dict(clip_cov_ratio=0.3, clip_cov_lb=-50.0, clip_cov_ub=50.0, clip_cov_seed=11, kl_cov_ratio=0.1,
               ppo_kl_coef=0.5)
    for mode in ("vanilla", "gspo", "gspo_token", "cispo", "clip_cov", "kl_cov"):
        for agg in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            for isc in ("none", "tis", "icepop", "reinforce_pro"):
                kw = dict(loss_mode=mode, loss_agg_mode=agg, is_correction=isc, **cov)
                want = ares.policy_loss(logp, old, adv, mask, logp_rollout=roll, **kw)
                got = ares.policy_loss(c(logp), c(old), c(adv), c(mask), logp_rollout=c(roll), **kw)
                what = f"{mode} {agg} {isc}"
                _close(got["grad"], want["grad"], 1e-5, 1e-7, f"grad {what}")
                for k in ("loss", "clipfrac", "clipfrac_lower", "approx_kl", "is_weight_mean", "is_changed_frac",
                          "selected_frac"):
                    assert abs(got[k] - want[k]) <= 1e-4 * (1 + abs(want[k])), f"{k} {what}: {got[k]} vs {want[k]}"
                assert got["valid_tokens"] == want["valid_tokens"], what
    bad = logp.copy()
    bad[0, 0] = np.nan
    mask[0, 0] = 1.0
    _raises(ValueError, "logp", lambda: ares.policy_loss(c(bad), c(old), c(adv), c(mask)))


def test_the_policy_loss_autograd_function_equals_the_cpus_on_cuda():
    torch = _gpu()
    import ares.torch as at

    g = torch.Generator().manual_seed(9)
    rows, cols = 5, 200
    old = -torch.rand(rows, cols, generator=g) * 3
    logp = old + torch.randn(rows, cols, generator=g) * 0.3
    adv = torch.randn(rows, cols, generator=g)
    mask = (torch.rand(rows, cols, generator=g) < 0.8).float()
    for mode in ("vanilla", "gspo", "cispo"):
        got = {}
        for dev in ("cpu", "cuda"):
            x = logp.to(dev).requires_grad_(True)
            loss, metrics = at.policy_loss(x, old.to(dev), adv.to(dev), mask.to(dev), loss_mode=mode)
            (2.0 * loss).backward()
            got[dev] = (loss, metrics, x.grad)
        (lc, mc, gc), (lg, mg, gg) = got["cpu"], got["cuda"]
        assert lg.is_cuda and gg.is_cuda, mode
        assert abs(lg.item() - lc.item()) <= 1e-5 * (1 + abs(lc.item())), mode
        assert mg["valid_tokens"] == mc["valid_tokens"], mode
        _close(gg, gc.numpy(), 1e-5, 1e-7, f"autograd grad {mode}")


def test_verl_losses_run_the_kernel_on_cuda_tensors():
    # ares.verl's losses on verl's CUDA tensors: the loss kernel, no host copy, equal to the
    # CPU route (with IS weights, data-parallel batch info and a bf16 log_prob's gradient)
    torch = _gpu()
    import ares.verl as av

    g = torch.Generator().manual_seed(12)
    rows, cols = 6, 150
    old = -torch.rand(rows, cols, generator=g) * 3
    lp = old + torch.randn(rows, cols, generator=g) * 0.3
    adv = torch.randn(rows, cols, generator=g)
    mask = (torch.rand(rows, cols, generator=g) < 0.8).to(torch.int64)
    w = torch.rand(rows, cols, generator=g) + 0.5
    info = {"dp_size": 2, "batch_num_tokens": int(mask.sum()) * 2, "global_batch_size": 2 * rows}
    config = {"clip_ratio": 0.2, "global_batch_info": info}
    for name in ("ares_vanilla", "ares_gspo", "ares_gspo_seq", "ares_cispo"):
        fn = getattr(av, name)
        for agg in ("token-mean", "seq-mean-token-mean"):
            weights = w if name != "ares_gspo_seq" else None
            got = {}
            for dev in ("cpu", "cuda"):
                x = lp.to(dev).requires_grad_(True)
                loss, metrics = fn(old.to(dev), x, adv.to(dev), mask.to(dev), agg, config,
                                   None if weights is None else weights.to(dev))
                loss.backward()
                got[dev] = (float(loss), metrics, x.grad)
            (lc, mc, gc), (lg, mg, gg) = got["cpu"], got["cuda"]
            what = f"{name} {agg}"
            assert gg.is_cuda, what
            assert abs(lg - lc) <= 1e-5 * (1 + abs(lc)), f"{what}: {lg} vs {lc}"
            for k in mc:
                assert abs(mg[k] - mc[k]) <= 1e-4 * (1 + abs(mc[k])), f"{what} {k}"
            _close(gg, gc.numpy(), 1e-5, 1e-7, f"{what} grad")
    x = lp.cuda().bfloat16().requires_grad_(True)
    loss, _ = av.ares_vanilla(old.cuda(), x, adv.cuda(), mask.cuda(), "token-mean", config)
    loss.backward()
    assert x.grad.dtype == torch.bfloat16


def test_the_fused_linear_head_equals_the_cpu_on_cuda():
    # float32: exact products on both sides (to f32 rounding of the sums' order); bfloat16:
    # the CPU on the same values widened, the GPU rounding each chunk's dlogits to bfloat16
    torch = _gpu()
    import ares.torch as at

    g = torch.Generator().manual_seed(4)
    rows, hidden, vocab = 200, 64, 3000
    x = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.2
    ids = torch.randint(0, vocab, (rows,), generator=g)
    a, b = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    for dtype, tol_fwd, tol_bwd in ((torch.float32, 2e-5, 2e-5), (torch.bfloat16, 2e-5, 2e-2)):
        xs, ws = x.to(dtype), w.to(dtype)
        grads = {}
        for dev in ("cpu", "cuda"):
            xd = (xs.float() if dev == "cpu" else xs).to(dev).requires_grad_(True)
            wd = (ws.float() if dev == "cpu" else ws).to(dev).requires_grad_(True)
            lp, h = at.linear_log_prob_entropy(xd, wd, ids.to(dev), temperature=0.9, chunk_rows=37)
            (lp * a.to(dev) + h * b.to(dev)).sum().backward()
            grads[dev] = (lp.detach().float().cpu(), h.detach().float().cpu(), xd.grad, wd.grad)
        (lpc, hc, gxc, gwc), (lpd, hd, gxd, gwd) = grads["cpu"], grads["cuda"]
        assert gxd.dtype == dtype and gwd.dtype == dtype, (gxd.dtype, gwd.dtype)
        _close(lpd, lpc.numpy(), tol_fwd, 1e-5, f"log_prob {dtype}")
        _close(hd, hc.numpy(), tol_fwd, 1e-5, f"entropy {dtype}")
        for name, got, want in (("grad_hidden", gxd, gxc), ("grad_weight", gwd, gwc)):
            scale = float(want.abs().max())
            err = float((got.float().cpu() - want.float()).abs().max())
            assert err <= tol_bwd * scale + (2.0**-8) * scale * (dtype == torch.bfloat16), f"{name} {dtype}: {err} vs {scale}"
    _raises(ValueError, "both must be float32 or both bfloat16",
            lambda: ares.linear_log_prob_entropy(x.cuda(), w.cuda().to(torch.bfloat16), ids.cuda()))
    _raises(ValueError, "`targets` holds ids outside",
            lambda: ares.linear_log_prob_entropy(x.cuda(), w.cuda(), torch.full((rows,), vocab, device="cuda")))


def _advantage_batch(rng, groups, cols):
    """Rewards in shuffled groups of 2–5 keyed by uid (some all equal, some 0/1), masks with
    holes, a weighted KL."""
    sizes = rng.integers(2, 6, groups)
    uid = np.repeat(np.arange(groups) * 31, sizes)
    rewards = np.concatenate([
        np.full(n, 0.5) if g % 4 == 1 else (rng.integers(0, 2, n) if g % 4 == 2 else rng.normal(size=n))
        for g, n in enumerate(sizes)
    ]).astype(np.float32)
    order = rng.permutation(len(uid))
    uid, rewards = uid[order], rewards[order]
    rows = len(uid)
    lengths = rng.integers(1, cols + 1, rows)
    mask = (np.arange(cols)[None, :] < lengths[:, None]) & (rng.random((rows, cols)) > 0.1)
    mask[np.arange(rows), lengths - 1] = True
    kl = rng.uniform(-0.02, 0.05, (rows, cols)).astype(np.float32)
    return rewards, uid, mask.astype(np.float32), kl


def test_the_advantage_estimators_equal_the_cpu_on_cuda():
    # per-sample advantages: the CPU's bits; token advantages: sums in another order, a few
    # ulps of the row's scale (whitened values: of 1)
    torch = _gpu()
    rng = np.random.default_rng(11)
    for groups, cols in [(3, 1), (40, 300), (128, 2048)]:
        rewards, uid, mask, kl = _advantage_batch(rng, groups, cols)
        r, m, k = (torch.from_numpy(a).cuda() for a in (rewards, mask, kl))
        for name in ("grpo_advantages", "dr_grpo_advantages", "rloo_advantages", "reinforce_baseline_advantages"):
            got = getattr(ares, name)(r, uid=uid)
            assert got.is_cuda and got.dtype == torch.float32
            np.testing.assert_array_equal(got.cpu().numpy(), getattr(ares, name)(rewards, uid=uid), err_msg=name)
        got = ares.grpo_advantages(r, uid=torch.from_numpy(uid).cuda(), epsilon=0.1, norm_adv_by_std=False)
        np.testing.assert_array_equal(got.cpu().numpy(), ares.dr_grpo_advantages(rewards, uid=uid))
        cases = [
            ("grpo_token_advantages", {"uid": uid}),
            ("grpo_token_advantages", {"uid": uid, "norm_adv_by_std": False}),
            ("rloo_token_advantages", {"uid": uid}),
            ("rloo_token_advantages", {"uid": uid, "weighted_kl": kl}),
            ("reinforce_pp_advantages", {"gamma": 0.97, "weighted_kl": kl}),
            ("reinforce_pp_advantages", {}),
            ("reinforce_pp_baseline_advantages", {"uid": uid, "gamma": 0.9, "weighted_kl": kl}),
            ("reinforce_pro_max", {"uid": uid}),
            ("reinforce_pro_max", {"uid": uid, "weighted_kl": kl}),
            ("reinforce_pro_max", {"uid": uid, "uniform_scale": True, "uniform_std": 0.05}),
        ]
        for name, kw in cases:
            want = getattr(ares, name)(rewards, mask, **kw)
            dev = {key: torch.from_numpy(v).cuda() if key == "weighted_kl" else v for key, v in kw.items()}
            got = getattr(ares, name)(r, m, **dev)
            assert got.is_cuda and tuple(got.shape) == mask.shape
            _close(got, want, 2e-5, 2e-5, f"{name} {kw.keys()} {groups}x{cols}")
        values = kl * 40 + 3
        want, mean, var = ares.masked_whiten(values, mask)
        got, dmean, dvar = ares.masked_whiten(torch.from_numpy(values).cuda(), m)
        _close(got, want, 1e-4, 1e-4, "masked_whiten")
        assert abs(dmean - mean) <= 1e-5 * max(1.0, abs(mean)) and abs(dvar - var) <= 1e-4 * var


def test_the_advantage_estimators_refuse_what_the_cpu_refuses_on_cuda():
    torch = _gpu()
    rewards = np.array([1.0, 0.0, float("nan"), 1.0], dtype=np.float32)
    mask = np.ones((4, 3), dtype=np.float32)
    for call in (lambda r, m: ares.grpo_advantages(r, n=2), lambda r, m: ares.rloo_token_advantages(r, m, n=2),
                 lambda r, m: ares.reinforce_pp_advantages(r, m)):
        cpu = None
        try:
            call(rewards, mask)
        except ValueError as e:
            cpu = str(e)
        assert cpu is not None
        _raises(ValueError, cpu, lambda: call(torch.from_numpy(rewards).cuda(), torch.from_numpy(mask).cuda()))
    ok = torch.tensor([1.0, 0.0, 0.0, 1.0], device="cuda")
    _raises(ValueError, "needs at least 2 samples per group; group 1 (uid 'b', first at row 2) has 1",
            lambda: ares.rloo_advantages(ok, uid=np.array(["a", "a", "b", "c"], dtype=object)))
    bad = torch.ones((4, 3), device="cuda")
    bad[1, 2] = 0.5
    _raises(ValueError, "mask", lambda: ares.reinforce_pro_max(ok, bad, n=2))
    empty = torch.ones((4, 3), device="cuda")
    empty[3] = 0
    _raises(ValueError, "no valid token", lambda: ares.rloo_token_advantages(ok, empty, n=2))
    values = torch.ones((2, 3), device="cuda")
    values[0, 0] = float("inf")
    _raises(ValueError, "values", lambda: ares.masked_whiten(values, torch.ones((2, 3), device="cuda")))
    assert float(values[0, 0]) == float("inf")


def test_the_kernels_run_on_the_callers_stream():
    torch = _gpu()
    x = torch.randn(256, 4096, device="cuda")
    want = ares.log_prob_entropy(x.cpu())[1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 1.0  # written on the side stream just before the kernel reads it
        ent, mask, _ = _windows_data(torch, rows=256, cols=512)
        e = torch.from_numpy(ent).cuda(non_blocking=False)
        out = ares.entropy_windows(e, torch.from_numpy(mask).cuda(), tau=1.0)
        _, h = ares.log_prob_entropy(y)
    torch.cuda.current_stream().wait_stream(side)
    _close(h, want, 1e-5, 1e-5, "entropy on a side stream")
    _close(out["counts"], ares.entropy_windows(ent, mask, tau=1.0)["counts"], 0, 0, "counts on a side stream")


if __name__ == "__main__":
    failed = 0
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"ok   {name}")
            except BaseException as e:  # noqa: BLE001 - a report of every test
                if type(e).__name__ == "Skipped":
                    print(f"skip {name}: {e}")
                    continue
                if isinstance(e, KeyboardInterrupt):
                    raise
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
    print(f"{failed} failed")
    sys.exit(1 if failed else 0)
