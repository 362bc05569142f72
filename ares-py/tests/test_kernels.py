"""CPU token kernels: fused log-prob + entropy (float32, float16, bfloat16 bits) against a
float64 numpy reference and hand values; entropy windows / HWE, row percentiles and the
masked dynamic KL against spec vectors and ares.token_kl."""

import math

import numpy as np
import pytest

import ares


def ref_log_prob_entropy(logits, targets, temperature=1.0):
    z = logits.astype(np.float64) / temperature
    m = z.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True))
    logp = z - lse
    p = np.exp(logp)
    h = -(p * np.where(p > 0, logp, 0.0)).sum(axis=-1)
    lp = None if targets is None else np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return lp, h


def to_bf16_bits(x):
    """float32 → bfloat16 bits (round to nearest even), as uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def test_hand_values():
    # logits (0, ln 2): p = (1/3, 2/3), H = ln 3 − (2/3) ln 2
    logits = np.array([[0.0, math.log(2.0)]], dtype=np.float32)
    lp, h = ares.log_prob_entropy(logits, np.array([1]))
    assert lp.dtype == np.float32 and h.dtype == np.float32 and h.shape == (1,)
    assert abs(h[0] - (math.log(3) - 2 / 3 * math.log(2))) < 1e-6
    assert abs(lp[0] - math.log(2 / 3)) < 1e-6
    # (0, 2 ln 2) at T = 2 is the same distribution
    lp2, h2 = ares.log_prob_entropy(np.array([[0.0, 2 * math.log(2.0)]], dtype=np.float32), np.array([1]), temperature=2.0)
    assert abs(h2[0] - h[0]) < 1e-6 and abs(lp2[0] - lp[0]) < 1e-6
    # uniform over V: H = ln V; −inf entries have probability 0; V = 1: H = 0, log p = 0
    lp, h = ares.log_prob_entropy(np.zeros((2, 5), dtype=np.float32), np.array([0, 4]))
    np.testing.assert_allclose(h, [math.log(5)] * 2, atol=1e-6)
    np.testing.assert_allclose(lp, [-math.log(5)] * 2, atol=1e-6)
    x = np.array([[0.0, -np.inf, 0.0]], dtype=np.float32)
    lp, h = ares.log_prob_entropy(x, np.array([2]))
    assert abs(h[0] - math.log(2)) < 1e-6 and abs(lp[0] + math.log(2)) < 1e-6
    lp, h = ares.log_prob_entropy(np.array([[3.0]], dtype=np.float32), np.array([0]))
    assert (lp[0], h[0]) == (0.0, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_against_float64_reference(temperature):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 7, 3001)) * 4).astype(np.float32)
    targets = rng.integers(0, 3001, size=(3, 7))
    lp, h = ares.log_prob_entropy(logits, targets, temperature=temperature)
    assert lp.shape == (3, 7) and h.shape == (3, 7)
    rlp, rh = ref_log_prob_entropy(logits, targets, temperature)
    np.testing.assert_allclose(h, rh, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(lp, rlp, atol=2e-5, rtol=1e-5)
    lp_none, h_only = ares.log_prob_entropy(logits, temperature=temperature)
    assert lp_none is None
    np.testing.assert_array_equal(h_only, h)


def test_bf16_bits_and_float16():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((16, 2048)) * 3).astype(np.float32)
    targets = rng.integers(0, 2048, size=16).astype(np.int32)
    bits = to_bf16_bits(x)
    rlp, rh = ref_log_prob_entropy(from_bf16_bits(bits), targets)  # the exact bf16 values
    for arr in [bits, bits.view(np.int16)]:
        lp, h = ares.log_prob_entropy(arr, targets)
        np.testing.assert_allclose(h, rh, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(lp, rlp, atol=2e-5, rtol=1e-5)
    # a bf16 value: 1.0 is 0x3F80
    assert to_bf16_bits(np.array([1.0], dtype=np.float32))[0] == 0x3F80
    x16 = x.astype(np.float16)
    rlp, rh = ref_log_prob_entropy(x16, targets)
    lp, h = ares.log_prob_entropy(x16, targets)
    np.testing.assert_allclose(h, rh, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(lp, rlp, atol=2e-5, rtol=1e-5)


def test_log_prob_entropy_errors():
    x = np.zeros((2, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="`logits` must have dtype float32, float16"):
        ares.log_prob_entropy(x.astype(np.float64))
    with pytest.raises(ValueError, match="`logits` is not C-contiguous"):
        ares.log_prob_entropy(np.zeros((4, 2), dtype=np.float32).T)
    with pytest.raises(ValueError, match="`targets` has shape \\[3\\], expected \\[2\\]"):
        ares.log_prob_entropy(x, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="`targets` element 1 = 4 is out of range"):
        ares.log_prob_entropy(x, np.array([0, 4]))
    with pytest.raises(ValueError, match="`targets` must have an integer dtype"):
        ares.log_prob_entropy(x, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="temperature"):
        ares.log_prob_entropy(x, temperature=0.0)
    bad = x.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="logits row 1"):
        ares.log_prob_entropy(bad)
    y = np.array([[0.0, -np.inf]], dtype=np.float32)
    with pytest.raises(ValueError, match="logit -inf"):
        ares.log_prob_entropy(y, np.array([1]))


def test_entropy_windows_spec_vector_5_and_hwe():
    h = np.array([[0.2, 1.0, 1.2, 0.8, 0.4, 0.1, 0.0, 0.0]], dtype=np.float32)
    mask = np.ones_like(h)
    # following tokens (o = 1): W_0 = mean(1.0, 1.2, 0.8, 0.4) = 0.85, …; 4 complete windows
    out = ares.entropy_windows(h, mask, window_size=4)
    assert set(out) == {"means", "valid"}
    np.testing.assert_allclose(out["means"], [[0.85, 0.625, 0.325, 0.125, 0, 0, 0, 0]], atol=1e-6)
    np.testing.assert_array_equal(out["valid"], [[1, 1, 1, 1, 0, 0, 0, 0]])
    # includes_self (o = 0): 5 complete windows
    out = ares.entropy_windows(h, mask, window_size=4, includes_self=True, tau=0.6)
    np.testing.assert_allclose(out["means"], [[0.8, 0.85, 0.625, 0.325, 0.125, 0, 0, 0]], atol=1e-6)
    np.testing.assert_array_equal(out["hwe_mask"], [[1, 1, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(out["counts"], [3])
    np.testing.assert_allclose(out["soft_cost"], [0.2 + 0.25 + 0.025], atol=1e-6)
    # a trigger mask restricts the candidates; a hole in the mask breaks windows
    trig = np.array([[0, 1, 0, 0, 0, 0, 0, 0]], dtype=np.float32)
    out = ares.entropy_windows(h, mask, window_size=4, includes_self=True, tau=0.6, trigger=trig)
    np.testing.assert_array_equal(out["counts"], [1])
    holed = mask.copy()
    holed[0, 2] = 0
    out = ares.entropy_windows(h, holed, window_size=4, includes_self=True)
    np.testing.assert_array_equal(out["valid"], [[0, 0, 0, 1, 1, 0, 0, 0]])
    with pytest.raises(ValueError, match="`entropy` must have dtype float32"):
        ares.entropy_windows(h.astype(np.float64), mask)
    with pytest.raises(ValueError, match="`mask` has shape"):
        ares.entropy_windows(h, mask[:, :4])
    with pytest.raises(ValueError, match="window_size"):
        ares.entropy_windows(h, mask, window_size=0)


def test_row_percentile_spec_vector_6():
    means = np.array([[1.25, 0.75, 0.8, 9.0], [0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    valid = np.array([[1, 1, 1, 0], [0, 0, 0, 0]], dtype=np.float32)
    thr, has = ares.row_percentile(means, valid, 95.0)
    np.testing.assert_allclose(thr, [1.205, 0.0], atol=1e-6)
    np.testing.assert_array_equal(has, [1, 0])
    thr, _ = ares.row_percentile(means, valid, 25.0)
    assert abs(thr[0] - 0.775) < 1e-6
    with pytest.raises(ValueError, match="percentile"):
        ares.row_percentile(means, valid, 101.0)


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3", "low_var_kl", "k3+"])
def test_masked_dynamic_kl_matches_token_kl(estimator):
    rng = np.random.default_rng(2)
    logp = rng.normal(-2, 1, (5, 9)).astype(np.float32)
    ref = rng.normal(-2, 1, (5, 9)).astype(np.float32)
    mask = (rng.random((5, 9)) < 0.8).astype(np.float32)
    hwe = (rng.random((5, 9)) < 0.3).astype(np.float32) * mask
    beta = rng.uniform(0.01, 0.2, 5).astype(np.float32)
    out = ares.masked_dynamic_kl(logp, ref, mask, beta, hwe_mask=hwe, low_ratio=0.5, estimator=estimator)
    want = ares.token_kl(logp, ref, mask, estimator=estimator, kl_coef=beta, hwe_mask=hwe, low_ratio=0.5)
    np.testing.assert_allclose(out["kl"], want["kl"], atol=1e-6)
    np.testing.assert_allclose(out["weighted"], want["weighted"], atol=1e-6)
    np.testing.assert_allclose(out["row_weighted_sum"], want["row_weighted_sum"], atol=1e-5)
    np.testing.assert_allclose(out["row_mean_kl"], want["row_mean_kl"], atol=1e-5)
    assert abs(out["total"] - float(out["row_weighted_sum"].sum())) < 1e-4


def test_masked_dynamic_kl_spec_vector_8_and_errors():
    logp = np.array([[-1.0, -2.0, 5.0]], dtype=np.float32)
    ref = np.array([[-1.5, -1.0, 0.0]], dtype=np.float32)
    mask = np.array([[1, 1, 0]], dtype=np.float32)
    out = ares.masked_dynamic_kl(logp, ref, mask, 0.5)
    np.testing.assert_allclose(out["kl"], [[0.1065307, 0.7182818, 0.0]], atol=1e-6)
    np.testing.assert_allclose(out["weighted"], [[0.05326535, 0.3591409, 0.0]], atol=1e-6)
    assert abs(out["total"] - (0.05326535 + 0.3591409)) < 1e-6
    with pytest.raises(ValueError, match="`beta` has 2 elements"):
        ares.masked_dynamic_kl(logp, ref, mask, np.ones(2, dtype=np.float32))
    with pytest.raises(ValueError, match="`estimator` = \"k9\" is not one of"):
        ares.masked_dynamic_kl(logp, ref, mask, 0.5, estimator="k9")
    with pytest.raises(ValueError, match="`logp_ref` must have dtype float32"):
        ares.masked_dynamic_kl(logp, ref.astype(np.float64), mask, 0.5)
