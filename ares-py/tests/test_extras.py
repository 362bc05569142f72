"""Forking-token mask, overlong penalty, entropy-bonus gradient, ARES entropy shaping:
ares-core's doc examples and spec vectors (literal numbers), both dtypes, errors."""

import numpy as np
import pytest

import ares

DTYPES = [np.float32, np.float64]


def tol(dtype):
    return 1e-6 if dtype == np.float32 else 5e-8


# ---------------------------------------------------------------- forking tokens (§16 example)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forking_doc_example(dtype):
    # index 4 is padding (NaN there is never read)
    h = np.array([0.9, 0.1, 0.5, 0.5, np.nan, 0.5, 2.0, 0.0, 0.3, 0.7], dtype=dtype)
    m = np.array([1, 1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=dtype)
    keep, st = ares.forking_token_mask(h, m, rho=0.2)
    assert keep.dtype == dtype and keep.shape == (10,)
    assert np.flatnonzero(keep).tolist() == [0, 6]
    assert st["kept"] == 2 and st["valid"] == 9
    assert st["fraction"] == pytest.approx(2 / 9, rel=1e-6)
    assert st["threshold"] == pytest.approx(0.9, rel=1e-6)
    keep, st = ares.forking_token_mask(h, m, rho=0.5)
    assert np.flatnonzero(keep).tolist() == [0, 2, 3, 6, 9]
    assert st["kept"] == 5 and st["threshold"] == pytest.approx(0.5)
    # default rho = 0.2, 2-D input keeps its shape (row-major order)
    keep2, st2 = ares.forking_token_mask(h.reshape(2, 5), m.reshape(2, 5))
    assert keep2.shape == (2, 5) and np.flatnonzero(keep2).tolist() == [0, 6]
    assert st2["kept"] == 2


def test_forking_empty_and_errors():
    keep, st = ares.forking_token_mask(np.ones(3), np.zeros(3))
    assert keep.tolist() == [0, 0, 0] and st == {"kept": 0, "valid": 0, "fraction": 0.0, "threshold": None}
    with pytest.raises(ValueError, match="rho"):
        ares.forking_token_mask(np.ones(3), np.ones(3), rho=0.0)
    with pytest.raises(ValueError, match="mask"):
        ares.forking_token_mask(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="mask"):
        ares.forking_token_mask(np.ones(3), np.ones(3, dtype=np.float32))


# ---------------------------------------------------------------- overlong penalty (§16.3)


def test_overlong_penalty_vector():
    got = [ares.overlong_penalty(L, 10, 4) for L in range(6, 12)]
    assert got == [0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert ares.overlong_penalty(8, 10, 4, penalty_factor=2.0) == -1.0
    # DAPO scale: L_max 20480, L_cache 4096
    assert ares.overlong_penalty(16385, 20480, 4096) == pytest.approx(-1 / 4096)
    assert ares.overlong_penalty(18432, 20480, 4096) == -0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_overlong_penalties_batch(dtype):
    lengths = np.arange(6, 12)
    out, n = ares.overlong_penalties(lengths, 10, 4, dtype=dtype)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, np.array([0, -0.25, -0.5, -0.75, -1, -1], dtype=dtype))
    assert n == 5
    correct = np.array([True, True, False, True, False, True])
    out, n = ares.overlong_penalties(list(range(6, 12)), 10, 4, 1.0, correct, dtype=dtype)
    np.testing.assert_array_equal(out, np.array([0, -0.25, 0, -0.75, 0, -1], dtype=dtype))
    assert n == 3


def test_overlong_errors():
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        ares.overlong_penalty(5, 10, 0)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        ares.overlong_penalty(5, 10, 11)
    with pytest.raises(ValueError, match="lengths"):
        ares.overlong_penalties(np.array([1, -1]), 10, 4)
    with pytest.raises(ValueError, match="correct"):
        ares.overlong_penalties(np.array([1, 2]), 10, 4, correct=np.array([True]))


# ---------------------------------------------------------------- entropy-bonus gradient


@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_grad_logits_vector(dtype):
    x = np.array([0.0, np.log(2.0)], dtype=dtype)
    h, g = ares.entropy_grad_logits(x)
    assert isinstance(h, float) and g.dtype == dtype
    assert h == pytest.approx(0.6365142, abs=tol(dtype))
    np.testing.assert_allclose(g, [0.1540327, -0.1540327], atol=tol(dtype))
    # (0, 2 ln 2) at T = 2: the same H, half the gradient; rows of a 2-D batch
    x2 = np.array([[0.0, 2 * np.log(2.0)], [1.0, 1.0]], dtype=dtype)
    h2, g2 = ares.entropy_grad_logits(x2, temperature=2.0)
    assert h2.shape == (2,) and g2.shape == (2, 2)
    np.testing.assert_allclose(h2, [0.6365142, np.log(2.0)], atol=tol(dtype))
    np.testing.assert_allclose(g2, [[0.0770164, -0.0770164], [0.0, 0.0]], atol=tol(dtype))


def test_entropy_grad_errors():
    with pytest.raises(ValueError, match="temperature"):
        ares.entropy_grad_logits(np.zeros(3), temperature=0.0)
    with pytest.raises(ValueError, match="row 1"):
        ares.entropy_grad_logits(np.array([[0.0, 1.0], [np.nan, 0.0]]))


# ---------------------------------------------------------------- ARES entropy shaping (§3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_rewards_spec_vectors(dtype):
    # spec vectors 1-4 of ares-core's shaping tests, α = 0.5 everywhere
    rows = [
        ("easy", True, 10, 4, 0.5),
        ("easy", True, 6, 4, 0.9583333),
        ("easy", False, 9, 4, 0.2642391),
        ("medium", True, 27, 20, 0.9583333),
        ("medium", True, 13, 20, 0.9583333),
        ("medium", False, 0, 20, 0.2),
        ("hard", True, 20, 20, 1.5469602),
        ("hard", False, 0, 0, 0.3),
        ("hard", True, 0, 20, 0.7),
    ]
    d = [r[0] for r in rows]
    c = np.array([r[1] for r in rows])
    g = np.array([r[2] for r in rows], dtype=dtype)
    t = np.array([r[3] for r in rows], dtype=dtype)
    a = np.full(len(rows), 0.5, dtype=dtype)
    s, overall = ares.entropy_rewards(c, g, t, a, d)
    assert s.dtype == dtype and overall.dtype == dtype
    np.testing.assert_allclose(overall, [r[4] for r in rows], atol=1e-6)
    np.testing.assert_allclose(s, overall - c.astype(dtype), atol=1e-6)
    # buckets as indices, format reward added with its weight
    idx = np.array([{"easy": 0, "medium": 1, "hard": 2}[x] for x in d])
    s2, o2 = ares.entropy_rewards(c, g, t, a, idx, format_reward=np.ones(len(rows), dtype=dtype), format_weight=0.5)
    np.testing.assert_allclose(s2, s, atol=1e-7)
    np.testing.assert_allclose(o2, overall + 0.5, atol=1e-6)


def test_entropy_rewards_errors():
    c, x = np.array([True]), np.array([1.0])
    with pytest.raises(ValueError, match="alpha"):
        ares.entropy_rewards(c, x, x, np.array([-1.0]), ["easy"])
    with pytest.raises(ValueError, match="difficulty"):
        ares.entropy_rewards(c, x, x, x, ["trivial"])
    with pytest.raises(ValueError, match="target"):
        ares.entropy_rewards(c, x, np.ones(2), x, ["easy"])
