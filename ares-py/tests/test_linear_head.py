"""ares.linear_log_prob_entropy (the LM head fused with log-prob and entropy) against a float64
numpy reference over whole logits (CI runs these), and ares.torch's autograd function against
torch's own head + log_softmax (where torch imports)."""

import numpy as np
import pytest

import ares


def problem(seed, n=9, h=16, v=29):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = (0.5 * rng.standard_normal((v, h))).astype(np.float32)
    ids = rng.integers(0, v, n)
    return x, w, ids


def reference(x, w, ids, t, g, gh):
    z = x.astype(np.float64) @ w.T.astype(np.float64) / t
    lse = np.logaddexp.reduce(z, axis=1)
    logp = z - lse[:, None]
    p = np.exp(logp)
    lp = logp[np.arange(len(ids)), ids]
    ent = -(p * logp).sum(1)
    onehot = np.zeros_like(z)
    onehot[np.arange(len(ids)), ids] = 1.0
    dz = g[:, None] / t * (onehot - p) + gh[:, None] * (-p * (logp + ent[:, None]) / t)
    return lp, ent, dz @ w.astype(np.float64), dz.T @ x.astype(np.float64)


@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 100])
def test_forward_and_backward_equal_the_whole_logits(chunk_rows):
    x, w, ids = problem(0)
    rng = np.random.default_rng(1)
    g, gh = rng.standard_normal(len(ids)).astype(np.float32), rng.standard_normal(len(ids)).astype(np.float32)
    lp, ent = ares.linear_log_prob_entropy(x, w, ids, temperature=0.8, chunk_rows=chunk_rows)
    gx, gw = ares.linear_log_prob_entropy_backward(x, w, ids, g, gh, temperature=0.8, chunk_rows=chunk_rows)
    want = reference(x, w, ids, 0.8, g.astype(np.float64), gh.astype(np.float64))
    for got, exp, what in zip((lp, ent, gx, gw), want, ("log_prob", "entropy", "grad_hidden", "grad_weight")):
        np.testing.assert_allclose(got, exp, rtol=2e-5, atol=2e-5, err_msg=what)
    # the fused head equals the head followed by ares's log_prob_entropy on the logits
    lp2, ent2 = ares.log_prob_entropy(np.ascontiguousarray((x @ w.T) / 1.0, dtype=np.float32), ids)
    lp1, ent1 = ares.linear_log_prob_entropy(x, w, ids)
    np.testing.assert_allclose(lp1, lp2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent1, ent2, rtol=1e-5, atol=1e-5)


def test_entropy_only():
    x, w, ids = problem(2)
    gh = np.ones(len(ids), dtype=np.float32)
    lp, ent = ares.linear_log_prob_entropy(x, w)
    assert lp is None
    gx, gw = ares.linear_log_prob_entropy_backward(x, w, grad_entropy=gh)
    _, ent_want, gx_want, gw_want = reference(x, w, ids, 1.0, np.zeros(len(ids)), gh.astype(np.float64))
    np.testing.assert_allclose(ent, ent_want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(gx, gx_want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(gw, gw_want, rtol=2e-5, atol=2e-5)


def test_errors_name_the_argument():
    x, w, ids = problem(3)
    with pytest.raises(ValueError, match="`weight` has shape"):
        ares.linear_log_prob_entropy(x, w[:, :-1].copy(), ids)
    with pytest.raises(ValueError, match="float32"):
        ares.linear_log_prob_entropy(x.astype(np.float64), w, ids)
    with pytest.raises(ValueError, match="out of range"):
        ares.linear_log_prob_entropy(x, w, np.full(len(ids), w.shape[0]))
    with pytest.raises(ValueError, match="chunk_rows"):
        ares.linear_log_prob_entropy(x, w, ids, chunk_rows=0)
    with pytest.raises(ValueError, match="go together"):
        ares.linear_log_prob_entropy_backward(x, w, ids)
    with pytest.raises(ValueError, match="give `grad_log_prob`"):
        ares.linear_log_prob_entropy_backward(x, w)
    with pytest.raises(ValueError, match="one per row"):
        ares.linear_log_prob_entropy_backward(x, w, grad_entropy=np.ones(3, dtype=np.float32))
    bad = x.copy()
    bad[2, 0] = np.nan
    with pytest.raises(ValueError):
        ares.linear_log_prob_entropy(bad, w, ids)


def test_torch_autograd_equals_torchs_own_head():
    torch = pytest.importorskip("torch")
    import ares.torch as at

    x, w, ids = problem(4, n=12)
    hidden = torch.from_numpy(x).reshape(3, 4, -1).requires_grad_(True)
    weight = torch.from_numpy(w).requires_grad_(True)
    targets = torch.from_numpy(ids).reshape(3, 4)
    adv = torch.linspace(-1, 1, 12).reshape(3, 4)
    lp, ent = at.linear_log_prob_entropy(hidden, weight, targets, temperature=0.9, chunk_rows=5)
    (-(adv * lp).sum() - 0.1 * ent.sum()).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    logp = torch.log_softmax((h2 @ w2.T) / 0.9, dim=-1)
    lp2 = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent2 = -(logp.exp() * logp).sum(-1)
    (-(adv * lp2).sum() - 0.1 * ent2.sum()).backward()
    torch.testing.assert_close(lp, lp2.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent2.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="`targets` has shape"):
        at.linear_log_prob_entropy(hidden, weight, targets.reshape(-1))
