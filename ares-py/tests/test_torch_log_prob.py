"""ares.torch.log_prob_entropy (autograd over ares.log_prob_entropy and its backward) against
PyTorch's own log_softmax + gather + entropy with autograd in float64, and the backward's
errors. Skipped without torch."""

import numpy as np
import pytest

import ares

torch = pytest.importorskip("torch")
import ares.torch as at  # noqa: E402


def reference(x, ids, temperature):
    z = x.double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, ids[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(5, 11), (2, 3, 257), (1, 1)])
def test_values_and_gradients_equal_torch_autograd(shape, temperature):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 2).float()
    ids = torch.randint(0, shape[-1], shape[:-1], generator=g)
    a = torch.randn(shape[:-1], generator=g).double()
    b = torch.randn(shape[:-1], generator=g).double()
    xa = x.clone().requires_grad_(True)
    lp, ent = at.log_prob_entropy(xa, ids, temperature=temperature)
    (lp.double() * a + ent.double() * b).sum().backward()
    xr = x.double().requires_grad_(True)
    lp_r, ent_r = reference(xr, ids, temperature)
    (lp_r * a + ent_r * b).sum().backward()
    np.testing.assert_allclose(lp.detach().numpy(), lp_r.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ent.detach().numpy(), ent_r.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(xa.grad.numpy(), xr.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_each_output_alone_and_without_targets():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 9, generator=g)
    ids = torch.randint(0, 9, (4,), generator=g)
    for use_lp, use_h in [(True, False), (False, True)]:
        xa = x.clone().requires_grad_(True)
        lp, ent = at.log_prob_entropy(xa, ids)
        ((lp.sum() if use_lp else 0) + (ent.sum() if use_h else 0)).backward()
        xr = x.double().requires_grad_(True)
        lp_r, ent_r = reference(xr, ids, 1.0)
        ((lp_r.sum() if use_lp else 0) + (ent_r.sum() if use_h else 0)).backward()
        np.testing.assert_allclose(xa.grad.numpy(), xr.grad.numpy(), rtol=1e-4, atol=1e-6)
    xa = x.clone().requires_grad_(True)
    none, ent = at.log_prob_entropy(xa)
    assert none is None
    ent.sum().backward()
    xr = x.double().requires_grad_(True)
    reference(xr, ids, 1.0)[1].sum().backward()
    np.testing.assert_allclose(xa.grad.numpy(), xr.grad.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_get_the_widened_gradient_rounded(dtype):
    # the gradient in the logits' dtype: the float32 backward of the widened logits, rounded
    # once (the CUDA kernel's definition; test_cuda_tensors.py holds the kernel to it)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 6, 50, generator=g) * 2).to(dtype)
    ids = torch.randint(0, 50, (4, 6), generator=g)
    a, b = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    xa = x.clone().requires_grad_(True)
    lp, ent = at.log_prob_entropy(xa, ids, temperature=0.9)
    assert lp.dtype == torch.float32
    (lp * a + ent * b).sum().backward()
    assert xa.grad.dtype == dtype
    xf = x.float().requires_grad_(True)
    lpf, entf = at.log_prob_entropy(xf, ids, temperature=0.9)
    (lpf * a + entf * b).sum().backward()
    assert torch.equal(xa.grad, xf.grad.to(dtype))
    # and close to float64 autograd on the widened logits
    xr = x.double().requires_grad_(True)
    lpr, entr = reference(xr, ids, 0.9)
    (lpr * a.double() + entr * b.double()).sum().backward()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    np.testing.assert_allclose(xa.grad.double().numpy(), xr.grad.numpy(), rtol=tol, atol=1e-4)


def test_the_backward_refuses_what_it_cannot_take():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="backward runs on float32, bfloat16 or float16 logits"):
        at.log_prob_entropy(x.double().requires_grad_(True), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="`targets` has shape"):
        at.log_prob_entropy(x, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="needs the `targets`"):
        ares.log_prob_entropy_backward(x.numpy(), None, np.ones(3, dtype=np.float32))
    with pytest.raises(ValueError, match="`grad_entropy` has shape"):
        ares.log_prob_entropy_backward(x.numpy(), None, None, np.ones(4, dtype=np.float32))
    bad = x.numpy().copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError):
        ares.log_prob_entropy_backward(bad, None, None, np.ones(3, dtype=np.float32))
    # a row whose coefficient is 0 is not read: its NaN does not matter
    out = ares.log_prob_entropy_backward(bad, None, None, np.array([1.0, 0.0, 1.0], dtype=np.float32))
    assert np.all(out[1] == 0) and np.isfinite(out).all()
