"""Array interop without copies: __array_interface__ and __dlpack__ objects everywhere; torch
CPU tensors (float32/float64, bfloat16 logits, requires_grad) where torch is installed; a
clear error for tensors on another device."""

import numpy as np
import pytest

import ares


class ArrayInterfaceOnly:
    """Exposes a numpy array's memory through __array_interface__ only."""

    def __init__(self, a):
        self._a = a
        self.__array_interface__ = a.__array_interface__


class DlpackOnly:
    """Exposes a numpy array's memory through __dlpack__ only."""

    def __init__(self, a, device=(1, 0)):
        self._a = a
        self._device = device

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._device


def ptr(a):
    return a.__array_interface__["data"][0]


def test_array_interface_and_dlpack_are_views():
    r = np.array([1.0, 0.0, 0.0, 1.0])
    for wrapped in [ArrayInterfaceOnly(r), DlpackOnly(r)]:
        v = ares.as_array(wrapped)
        assert isinstance(v, np.ndarray) and ptr(v) == ptr(r)
        np.testing.assert_array_equal(ares.grpo_advantages(wrapped, n=4), ares.grpo_advantages(r, n=4))
    with pytest.raises(ValueError, match="ares runs on CPU arrays"):
        ares.grpo_advantages(DlpackOnly(r, device=(2, 0)), n=4)
    # keyword arguments and the classes' array methods convert too
    mask = np.ones((2, 3))
    out = ares.grpo_token_advantages(rewards=ArrayInterfaceOnly(np.array([1.0, 0.0])), mask=DlpackOnly(mask), n=2)
    assert out.shape == (2, 3)
    c = ares.BucketController()
    np.testing.assert_array_equal(c.classify(ArrayInterfaceOnly(np.array([1, 1, 0], dtype=bool)), n=3), [0, 0, 0])
    g = ares.GrpoLambda()
    assert g.rewards(DlpackOnly(np.ones(2, dtype=bool)), ArrayInterfaceOnly(np.array([1.0, 2.0])), n=2)["top_count"] == 1


def test_plain_values_pass_through():
    assert ares.as_array(None) is None and ares.as_array([1, 2]) == [1, 2] and ares.as_array(0.5) == 0.5
    # a plain list is still a ValueError from the native function (no hidden conversion)
    with pytest.raises(ValueError, match="`rewards` must be a numpy array"):
        ares.grpo_advantages([1.0, 0.0], n=2)


# ---------------------------------------------------------------- torch (skipped without it)


def test_torch_cpu_tensors_zero_copy():
    torch = pytest.importorskip("torch")
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    v = ares.as_array(r)
    assert ptr(v) == r.data_ptr() and v.dtype == np.float64
    np.testing.assert_allclose(ares.grpo_advantages(r, n=4), [0.8660239, -0.8660239, -0.8660239, 0.8660239], atol=5e-8)
    # requires_grad: detach shares the storage
    lp = torch.randn(2, 5, requires_grad=True)
    assert ptr(ares.as_array(lp)) == lp.data_ptr()
    out = ares.policy_loss(lp, lp.detach().clone(), torch.ones(2, 5), torch.ones(2, 5))
    assert out["grad"].shape == (2, 5)
    # uid as a tensor
    np.testing.assert_array_equal(ares.rloo_advantages(r, uid=torch.tensor([0, 1, 0, 1])), [1.0, -1.0, -1.0, 1.0])
    # a strided tensor is an error, not a copy
    with pytest.raises(ValueError, match="not C-contiguous"):
        ares.grpo_token_advantages(torch.ones(2), torch.ones(3, 2).T, n=2)


def test_torch_bf16_logits():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 4, 1000, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 1000, (3, 4), generator=g)
    bits = ares.as_array(logits, "log_prob_entropy", "logits", bf16_ok=True)
    assert bits.dtype == np.int16 and ptr(bits) == logits.data_ptr()
    lp, h = ares.log_prob_entropy(logits, targets)
    ref = torch.log_softmax(logits.double(), dim=-1)
    want_h = -(ref.exp() * ref).sum(-1)
    want_lp = ref.gather(-1, targets[..., None])[..., 0]
    np.testing.assert_allclose(h, want_h.numpy(), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(lp, want_lp.numpy(), atol=2e-5, rtol=1e-5)
    lp2, h2 = ares.log_prob_entropy(logits.float(), targets)
    np.testing.assert_array_equal(h2, h)
    np.testing.assert_array_equal(lp2, lp)
    # bf16 anywhere else is a clear error
    with pytest.raises(ValueError, match="only log_prob_entropy's logits take bfloat16"):
        ares.grpo_advantages(torch.ones(4, dtype=torch.bfloat16), n=4)


def test_torch_non_cpu_tensor_is_a_clear_error():
    torch = pytest.importorskip("torch")
    t = torch.ones(4, device="meta")
    with pytest.raises(ValueError, match="grpo_advantages: `rewards` is a tensor on meta: this function runs on CPU arrays; move the tensor with .cpu\\(\\)"):
        ares.grpo_advantages(t, n=4)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="move the tensor with .cpu"):
            ares.grpo_advantages(torch.ones(4, device="cuda"), n=4)
