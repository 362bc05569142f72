"""ares.torch.policy_loss (autograd over ares.policy_loss): PPO's clipped loss against the same
formula written in PyTorch with autograd (float64), GSPO by finite differences, CISPO's
stop-gradient weight, the chain from logits, and its errors. Skipped without torch."""

import numpy as np
import pytest

import ares

torch = pytest.importorskip("torch")
import ares.torch as at  # noqa: E402


def batch(seed, rows=4, cols=9, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g, dtype=dtype) * 3
    logp = old + torch.randn(rows, cols, generator=g, dtype=dtype) * 0.3
    adv = torch.randn(rows, cols, generator=g, dtype=dtype)
    mask = (torch.rand(rows, cols, generator=g) > 0.25).to(dtype)
    mask[:, 0] = 1
    return logp, old, adv, mask


def ppo_reference(logp, old, adv, mask, low, high, c):
    """verl's dual-clip PPO loss, token-mean, written with torch ops."""
    ratio = torch.exp(logp - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clipped = torch.maximum(pg1, pg2)
    dual = torch.minimum(-adv * c, clipped)
    pg = torch.where(adv < 0, dual, clipped)
    return (pg * mask).sum() / mask.sum()


def test_ppo_value_and_gradient_equal_torch_autograd():
    logp, old, adv, mask = batch(1)
    a = logp.clone().requires_grad_(True)
    loss, metrics = at.policy_loss(a, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    loss.backward()
    b = logp.clone().requires_grad_(True)
    want = ppo_reference(b, old, adv, mask, 0.2, 0.28, 3.0)
    want.backward()
    assert loss.dtype == torch.float64 and loss.shape == ()
    assert abs(loss.item() - want.item()) < 1e-12
    np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-12, atol=1e-15)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-15)
    assert metrics["valid_tokens"] == int(mask.sum().item())
    for key in ("clipfrac", "clipfrac_lower", "approx_kl", "selected_frac"):
        assert key in metrics


def test_the_incoming_gradient_multiplies_ares_gradient():
    logp, old, adv, mask = batch(2)
    a = logp.clone().requires_grad_(True)
    loss, _ = at.policy_loss(a, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    (3.0 * loss).backward()
    got = ares.policy_loss(logp.numpy(), old.numpy(), adv.numpy(), mask.numpy(), loss_agg_mode="seq-mean-token-mean")
    np.testing.assert_allclose(a.grad.numpy(), 3.0 * got["grad"], rtol=1e-15)


def test_gspo_gradients_are_the_losss_derivative():
    # GSPO's sequence ratio is smooth inside its clip range: finite differences hold
    logp, old, adv, mask = batch(3, rows=3, cols=6)
    logp = old + (logp - old) * 0.05  # ratios near 1: inside the clip range
    x = logp.clone().requires_grad_(True)

    def f(lp):
        return at.policy_loss(lp, old, adv, mask, loss_mode="gspo", loss_agg_mode="seq-mean-token-mean")[0]

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-8)


def test_gspo_token_gradient_is_per_token():
    # GSPO-token: s_t = sg(s)·π_t/sg(π_t), so ∂/∂logπ_t of −A_t·s_t is −A_t·s (inside the clip
    # range), s = exp(the row's mean of logπ − logπ_old), times seq-mean-token-mean's weights
    logp, old, adv, mask = batch(8, rows=3, cols=6)
    logp = old + (logp - old) * 0.05
    a = logp.clone().requires_grad_(True)
    loss, _ = at.policy_loss(a, old, adv, mask, loss_mode="gspo_token", loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    lens = mask.sum(-1, keepdim=True)
    s = torch.exp(((logp - old) * mask).sum(-1, keepdim=True) / lens)
    want = -adv * s * mask / lens / mask.shape[0]
    np.testing.assert_allclose(a.grad.numpy(), want.numpy(), rtol=1e-12, atol=1e-15)


def test_cispo_weight_is_a_stop_gradient():
    # CISPO: loss = −sg(clip(r, 1 − low, 1 + high))·A·logπ, token-mean
    logp, old, adv, mask = batch(4)
    a = logp.clone().requires_grad_(True)
    loss, _ = at.policy_loss(a, old, adv, mask, loss_mode="cispo", clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss.backward()
    weight = torch.clamp(torch.exp(logp - old), 0.8, 1.28)
    np.testing.assert_allclose(a.grad.numpy(), (-weight * adv * mask / mask.sum()).numpy(), rtol=1e-12, atol=1e-15)


def test_chain_from_logits_equals_torch_autograd():
    # log_prob_entropy then the PPO loss, back to the logits (float32 kernels, float64 reference)
    g = torch.Generator().manual_seed(5)
    rows, cols, vocab = 3, 5, 17
    logits = torch.randn(rows, cols, vocab, generator=g)
    ids = torch.randint(0, vocab, (rows, cols), generator=g)
    ref_lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None]).squeeze(-1)
    old = (ref_lp + torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.2).float()
    adv = torch.randn(rows, cols, generator=g)
    mask = torch.ones(rows, cols)
    x = logits.clone().requires_grad_(True)
    lp, _ = at.log_prob_entropy(x, ids)
    loss, _ = at.policy_loss(lp, old, adv, mask)
    loss.backward()
    y = logits.double().clone().requires_grad_(True)
    lp64 = torch.log_softmax(y, -1).gather(-1, ids[..., None]).squeeze(-1)
    want = ppo_reference(lp64, old.double(), adv.double(), mask.double(), 0.2, 0.3, 3.0)
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-5
    np.testing.assert_allclose(x.grad.numpy(), y.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_clip_cov_and_rollout_correction_reach_ares():
    logp, old, adv, mask = batch(6)
    rollout = old + 0.1
    a = logp.clone().requires_grad_(True)
    loss, m = at.policy_loss(a, old, adv, mask, logp_rollout=rollout, is_correction="tis", loss_mode="clip_cov")
    loss.backward()
    got = ares.policy_loss(
        logp.numpy(), old.numpy(), adv.numpy(), mask.numpy(), logp_rollout=rollout.numpy(), is_correction="tis",
        loss_mode="clip_cov",
    )
    np.testing.assert_array_equal(a.grad.numpy(), got["grad"])
    assert m["is_weight_mean"] == got["is_weight_mean"]


def test_errors_name_the_input():
    logp, old, adv, mask = batch(7)
    with pytest.raises(ValueError, match="`mask` has shape"):
        at.policy_loss(logp, old, adv, mask[:, :3])
    with pytest.raises(ValueError, match="loss_mode"):
        at.policy_loss(logp, old, adv, mask, loss_mode="nope")
    with pytest.raises(ValueError):
        at.policy_loss(logp, old, adv, torch.zeros_like(mask))
