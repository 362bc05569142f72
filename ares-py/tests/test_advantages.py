"""Advantage estimators: spec vectors (literal numbers), verl 0.9.1 fixtures, n= vs uid=,
dtypes, zero-copy inputs / single-allocation outputs, errors."""

import numpy as np
import pytest

import ares

DTYPES = [np.float32, np.float64]


def tol(dtype):
    return 1e-6 if dtype == np.float32 else 5e-8


# ---------------------------------------------------------------- spec vectors (literal numbers)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_spec_vector_7(dtype):
    # mean 0.5, unbiased std sqrt(1/3); 0.5 / (0.5773503 + 1e-6) = 0.8660239
    out = ares.grpo_advantages(np.array([1, 0, 0, 1], dtype=dtype), n=4)
    assert out.dtype == dtype and out.shape == (4,)
    np.testing.assert_allclose(out, [0.8660239, -0.8660239, -0.8660239, 0.8660239], atol=tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_epsilon_and_norm_flag(dtype):
    r = np.array([1, 0, 0, 1], dtype=dtype)
    # epsilon = 0.5: 0.5 / (0.5773503 + 0.5) = 0.4641016
    np.testing.assert_allclose(ares.grpo_advantages(r, n=4, epsilon=0.5), [0.4641016, -0.4641016, -0.4641016, 0.4641016], atol=tol(dtype))
    np.testing.assert_array_equal(ares.grpo_advantages(r, n=4, norm_adv_by_std=False), [0.5, -0.5, -0.5, 0.5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dr_grpo_and_constant_group_is_exactly_zero(dtype):
    out = ares.dr_grpo_advantages(np.array([1.0, 3.0, 0.1, 0.1], dtype=dtype), n=2)
    np.testing.assert_array_equal(out, np.array([-1.0, 1.0, 0.0, 0.0], dtype=dtype))
    # all-equal group: exactly 0, no 1/eps blow-up of the mean's rounding
    out = ares.grpo_advantages(np.full(4, 0.7, dtype=dtype), n=4)
    assert (out == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rloo_spec_vector(dtype):
    out = ares.rloo_advantages(np.array([1, 0, 0, 0], dtype=dtype), n=4)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, [1.0, -1 / 3, -1 / 3, -1 / 3], atol=tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reinforce_baseline(dtype):
    out = ares.reinforce_baseline_advantages(np.array([1, 0, 1, 3], dtype=dtype), n=2)
    np.testing.assert_array_equal(out, np.array([0.5, -0.5, -1.0, 1.0], dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_token_broadcast(dtype):
    mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=dtype)
    out = ares.grpo_token_advantages(np.array([1, 0, 0, 1], dtype=dtype), mask, n=4)
    assert out.shape == (4, 3) and out.dtype == dtype
    a = 0.8660239
    np.testing.assert_allclose(out, [[a, a, 0], [-a, 0, 0], [-a, -a, -a], [0, a, a]], atol=tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rloo_token_with_kl(dtype):
    # r~ = (1 - 0, 0 - 1) = (1, -1); KL folded as returns-to-go with gamma = 1:
    # row 0: tokens (1 - 0.1 - 0.2, 1 - 0.2) = (0.7, 0.8); row 1: (-1 - 0.3, 0)
    mask = np.array([[1, 1], [1, 0]], dtype=dtype)
    wkl = np.array([[0.1, 0.2], [0.3, 0.0]], dtype=dtype)
    out = ares.rloo_token_advantages(np.array([1, 0], dtype=dtype), mask, n=2, weighted_kl=wkl)
    np.testing.assert_allclose(out, [[0.7, 0.8], [-1.3, 0.0]], atol=tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reinforce_pp_hand_checked(dtype):
    # r = (1, 0), lengths (2, 1), gamma = 1 -> returns (1, 1 | 0); mu = 2/3, var = 2/9
    mask = np.array([[1, 1], [1, 0]], dtype=dtype)
    out = ares.reinforce_pp_advantages(np.array([1, 0], dtype=dtype), mask)
    np.testing.assert_allclose(out, [[0.7071068, 0.7071068], [-1.4142136, 0.0]], atol=tol(dtype) * 4)
    # gamma = 0.5 with the reward on the last token: returns (0.5, 1 | 0), mu = 0.5, var = 1/6
    out = ares.reinforce_pp_advantages(np.array([1, 0], dtype=dtype), mask, gamma=0.5)
    np.testing.assert_allclose(out, [[0.0, 1.2247449], [-1.2247449, 0.0]], atol=tol(dtype) * 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reinforce_pp_baseline_hand_checked(dtype):
    # r - mean_g = (0.5, -0.5 | -1, 1), one token each: whitened over 4 tokens, mu = 0,
    # var = (0.25 + 0.25 + 1 + 1)/4 = 0.625 -> x / 0.7905694
    mask = np.ones((4, 1), dtype=dtype)
    out = ares.reinforce_pp_baseline_advantages(np.array([1, 0, 1, 3], dtype=dtype), mask, n=2)
    np.testing.assert_allclose(out[:, 0], [0.6324555, -0.6324555, -1.2649111, 1.2649111], atol=tol(dtype) * 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pro_max_spec_vector_11(dtype):
    mask = np.array([[1, 1, 0], [1, 1, 1]], dtype=dtype)
    out = ares.reinforce_pro_max(np.array([1, 0], dtype=dtype), mask, n=2)
    want = [[1.2247449, 1.2247449, 0.0], [-0.8164966, -0.8164966, -0.8164966]]
    np.testing.assert_allclose(out, want, atol=tol(dtype) * 2)
    ones = np.ones((4, 1), dtype=dtype)
    out = ares.reinforce_pro_max(np.array([1, 0, 0, 0], dtype=dtype), ones, n=4)
    np.testing.assert_allclose(out[:, 0], [1.7320508, -0.5773503, -0.5773503, -0.5773503], atol=tol(dtype) * 2)
    out = ares.reinforce_pro_max(np.ones(4, dtype=dtype), ones, n=4)
    assert (out == 0).all()
    out = ares.reinforce_pro_max(np.ones(4, dtype=dtype), ones, n=4, uniform_scale=True)
    np.testing.assert_allclose(out[:, 0], [0.25] * 4, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_whiten(dtype):
    values = np.array([[1, 1], [0, 9]], dtype=dtype)  # the 9 is padding
    mask = np.array([[1, 1], [1, 0]], dtype=dtype)
    out, mean, var = ares.masked_whiten(values, mask)
    np.testing.assert_allclose(out, [[0.7071068, 0.7071068], [-1.4142136, 0.0]], atol=tol(dtype) * 4)
    assert abs(mean - 2 / 3) < 1e-6 and abs(var - 2 / 9) < 1e-6
    assert values[1, 1] == 9  # the input is not written


# ---------------------------------------------------------------- numpy re-implementation (second check)


def np_grpo(r, n, eps=1e-6):
    g = r.reshape(-1, n)
    mean = g.mean(1, keepdims=True)
    std = g.std(1, ddof=1, keepdims=True)
    out = (g - mean) / (std + eps)
    out[(g == g[:, :1]).all(1)] = 0.0
    return out.reshape(-1)


def test_grpo_matches_numpy_on_random_batches():
    rng = np.random.default_rng(0)
    for n in (2, 3, 8):
        r = rng.normal(size=16 * n)
        np.testing.assert_allclose(ares.grpo_advantages(r, n=n), np_grpo(r, n), rtol=1e-12, atol=1e-12)
        g = r.reshape(-1, n)
        rloo = (g - (g.sum(1, keepdims=True) - g) / (n - 1)).reshape(-1)
        np.testing.assert_allclose(ares.rloo_advantages(r, n=n), rloo, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- n= vs uid= on shuffled rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "fn",
    [ares.grpo_advantages, ares.dr_grpo_advantages, ares.rloo_advantages, ares.reinforce_baseline_advantages],
)
def test_uid_on_shuffled_rows_equals_n(fn, dtype):
    rng = np.random.default_rng(1)
    n, groups = 5, 7
    r = rng.integers(0, 3, size=n * groups).astype(dtype)
    want = fn(r, n=n)
    perm = rng.permutation(n * groups)
    int_uid = (np.arange(n * groups) // n)[perm] * 1000 - 7  # negative keys too
    str_uid = np.array([f"prompt-{u}" for u in int_uid], dtype=object)
    for uid in (int_uid, int_uid.astype(np.uint32) if (int_uid >= 0).all() else int_uid, str_uid, list(str_uid)):
        got = fn(np.ascontiguousarray(r[perm]), uid=uid)
        # a group's members are summed in another order: equal up to rounding
        np.testing.assert_allclose(got, want[perm], rtol=tol(dtype), atol=tol(dtype))


def test_uid_token_estimators_on_shuffled_rows():
    rng = np.random.default_rng(2)
    n, groups, T = 4, 3, 6
    r = rng.normal(size=n * groups)
    mask = (rng.random((n * groups, T)) < 0.7).astype(np.float64)
    mask[:, 0] = 1
    perm = rng.permutation(n * groups)
    uid = (np.arange(n * groups) // n)[perm]
    rs, ms = np.ascontiguousarray(r[perm]), np.ascontiguousarray(mask[perm])
    for fn in (ares.grpo_token_advantages, ares.rloo_token_advantages, ares.reinforce_pro_max):
        np.testing.assert_allclose(fn(rs, ms, uid=uid), fn(r, mask, n=n)[perm], rtol=1e-12, atol=1e-14)
    # whitening is over the whole batch, so only the summation order differs
    np.testing.assert_allclose(
        ares.reinforce_pp_baseline_advantages(rs, ms, uid=uid),
        ares.reinforce_pp_baseline_advantages(r, mask, n=n)[perm],
        rtol=1e-12,
        atol=1e-12,
    )


def test_uid_groups_of_different_sizes():
    # uid groups: 9 -> rows 0, 3, 5 (r = 1, 0, 2); 4 -> rows 1, 2 (r = 5, 1)
    r = np.array([1.0, 5.0, 1.0, 0.0, 4.0, 2.0])
    uid = np.array([9, 4, 4, 9, 7, 9])
    uid[4] = 4  # three in group 4 now: rows 1, 2, 4 (r = 5, 1, 4)
    out = ares.dr_grpo_advantages(r, uid=uid)
    np.testing.assert_allclose(out, [0.0, 5 - 10 / 3, 1 - 10 / 3, -1.0, 4 - 10 / 3, 1.0], atol=1e-15)


# ---------------------------------------------------------------- verl 0.9.1 fixtures


def rewhiten_unbiased(values, mask):
    """verl's masked_whiten: count + 1e-8 in the means, unbiased variance, rsqrt(var + 1e-8)."""
    n = mask.sum()
    mean = (values * mask).sum() / (n + 1e-8)
    var = (mask * (values - mean) ** 2).sum() / (n + 1e-8) * (n / (n - 1))
    return mask * (values - mean) / np.sqrt(var + 1e-8)


def test_verl_advantage_fixture(verl):
    seen = set()
    for i, c in enumerate(verl["advantage"]):
        name = c["estimator"]
        rows, cols = c["rows"], c["cols"]
        mask = np.array(c["mask"], dtype=np.float64).reshape(rows, cols)
        scores = np.array(c["scores"], dtype=np.float64)
        uid = np.array(c["uid"])
        want = np.array(c["advantages"]).reshape(rows, cols)
        if name == "grpo":
            got = ares.grpo_advantages(scores, uid=uid)[:, None] * mask
            np.testing.assert_allclose(ares.grpo_token_advantages(scores, mask, uid=uid), got, rtol=0, atol=0)
        elif name == "dr_grpo":
            got = ares.dr_grpo_advantages(scores, uid=uid)[:, None] * mask
        elif name == "rloo":
            got = ares.rloo_advantages(scores, uid=uid)[:, None] * mask
        elif name == "reinforce_plus_plus_baseline":
            # same before the whitening, whose variance rule differs on purpose
            # (docs/algorithms.md §15)
            got = rewhiten_unbiased(ares.reinforce_baseline_advantages(scores, uid=uid)[:, None] * mask, mask)
        else:
            continue
        seen.add(name)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"advantage #{i} {name}")
    assert seen == {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"}


def test_verl_masked_whiten_fixture(verl):
    # ares whitens with the population variance, verl with the unbiased one: map verl's
    # output onto ares' rule through the documented formula
    for i, c in enumerate(verl["masked_whiten"]):
        values = np.array(c["values"], dtype=np.float64).reshape(c["rows"], c["cols"])
        mask = np.array(c["mask"], dtype=np.float64).reshape(c["rows"], c["cols"])
        ours, mean, var = ares.masked_whiten(values, mask)
        theirs = np.array(c["out"]).reshape(values.shape)
        v = mask != 0
        n = v.sum()
        assert abs(mean - values[v].mean()) <= 1e-9 * (1 + abs(mean))
        var_u = rewhiten_unbiased(values, mask)
        np.testing.assert_allclose(var_u[v], theirs[v], rtol=1e-9, atol=1e-9, err_msg=f"whiten #{i}")
        mean_v = values[v].sum() / (n + 1e-8)
        var_v = ((values[v] - mean_v) ** 2).sum() / (n + 1e-8) * (n / (n - 1))
        scaled = (theirs[v] * np.sqrt(var_v + 1e-8) + mean_v - values[v].mean()) / np.sqrt(max(var, 1e-8))
        np.testing.assert_allclose(ours[v], scaled, rtol=2e-8, atol=2e-8, err_msg=f"whiten #{i}")


# ---------------------------------------------------------------- zero copy, one allocation


def test_inputs_read_in_place_readonly_and_memmap(tmp_path):
    r = np.array([1.0, 0.0, 0.0, 1.0])
    r.setflags(write=False)
    np.testing.assert_allclose(ares.grpo_advantages(r, n=4), [0.8660239, -0.8660239, -0.8660239, 0.8660239], atol=5e-8)
    path = tmp_path / "rewards.f32"
    np.array([1, 0, 0, 0], dtype=np.float32).tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode="r")
    out = ares.rloo_advantages(mm, n=4)
    np.testing.assert_allclose(out, [1.0, -1 / 3, -1 / 3, -1 / 3], atol=1e-6)
    # a strided view would need a copy: refused, not silently copied
    with pytest.raises(ValueError, match="`rewards` is not C-contiguous"):
        ares.rloo_advantages(np.arange(8.0)[::2], n=4)
    # a float dtype other than the call's would need a conversion: refused
    with pytest.raises(ValueError, match="`mask` has dtype float32, expected float64"):
        ares.grpo_token_advantages(r, np.ones((4, 2), dtype=np.float32), n=4)


def test_outputs_are_one_numpy_allocation():
    r = np.array([1.0, 0.0, 0.0, 1.0])
    for out in (
        ares.grpo_advantages(r, n=4),
        ares.grpo_token_advantages(r, np.ones((4, 3)), n=4),
        ares.reinforce_pp_advantages(r, np.ones((4, 3))),
    ):
        # owned by numpy itself: no view of an intermediate buffer, no copy behind it
        assert out.base is None and out.flags.owndata and out.flags.c_contiguous and out.flags.writeable
        assert not np.shares_memory(out, r)


def test_gil_released_threads_agree():
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(3)
    r = rng.normal(size=8 * 4096)
    want = ares.grpo_advantages(r, n=8)
    with ThreadPoolExecutor(4) as ex:
        for got in ex.map(lambda _: ares.grpo_advantages(r, n=8), range(8)):
            np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ares.grpo_advantages(np.array([1, 0, 0, 1]), n=4), "`rewards` must have dtype float32 or float64, got int64"),
        (lambda: ares.grpo_advantages([1.0, 0.0], n=2), "`rewards` must be a numpy array"),
        (lambda: ares.grpo_advantages(np.ones((2, 2)), n=2), "`rewards` must have 1 dimension"),
        (lambda: ares.grpo_advantages(np.array([1.0, np.nan]), n=2), r"`rewards` holds a non-finite value \(NaN or ±inf\) at index 1"),
        (lambda: ares.grpo_advantages(np.array([1.0, 0.0, 1.0]), n=1), "advantage estimator `grpo` needs at least 2 samples per group, got n = 1"),
        (lambda: ares.dr_grpo_advantages(np.array([1.0, 0.0]), n=1), "`dr_grpo` needs at least 2 samples"),
        (lambda: ares.rloo_advantages(np.array([1.0, 0.0, 1.0]), n=2), "`n` = 2 does not fit the batch"),
        (lambda: ares.rloo_advantages(np.array([1.0, 0.0]), n=0), r"`n` = 0 does not fit the batch: `n \(group size\)` = 0"),
        (lambda: ares.rloo_advantages(np.array([1.0, 0.0]), n=-2), "`n` = -2 is out of range"),
        (lambda: ares.rloo_advantages(np.array([1.0, 0.0])), "give `n`"),
        (lambda: ares.rloo_advantages(np.array([1.0, 0.0]), n=2, uid=[1, 1]), "not both"),
        (lambda: ares.rloo_advantages(np.array([1.0, 0.0, 3.0]), uid=["a", "b", "a"]), r"`rloo` needs at least 2 samples per group; group 1 \(uid 'b', first at row 1\) has 1"),
        (lambda: ares.rloo_advantages(np.array([1.0, 0.0, 3.0]), uid=[1, 1]), "`uid` has 2 elements, expected 3"),
        (lambda: ares.rloo_advantages(np.array([1.0, 0.0]), uid=np.zeros((2, 1), dtype=int)), "`uid` must have 1 dimension"),
        (lambda: ares.rloo_advantages(np.array([1.0, 0.0]), uid=[[1], [1]]), "`uid` holds an unhashable key"),
        (lambda: ares.grpo_advantages(np.array([1.0, 0.0]), n=2, epsilon=-1.0), "`grpo epsilon` = -1 is out of range"),
        (lambda: ares.grpo_token_advantages(np.ones(2), np.ones((3, 2)), n=2), "`mask` has 3 rows, expected 2"),
        (lambda: ares.grpo_token_advantages(np.ones(2), np.ones(2), n=2), "`mask` must have 2 dimensions"),
        (lambda: ares.grpo_token_advantages(np.array([1.0, 0.0]), np.array([[1.0, 0.5], [1.0, 1.0]]), n=2), "mask `mask` holds a value other than 0 or 1 at index 1"),
        (lambda: ares.rloo_token_advantages(np.ones(2), np.ones((2, 2)), n=2, weighted_kl=np.ones((2, 3))), r"`weighted_kl` has shape \(2, 3\), expected \(2, 2\)"),
        (lambda: ares.reinforce_pp_advantages(np.ones(2), np.array([[1.0, 1.0], [0.0, 0.0]])), "`mask row \\(no valid token to carry the sequence reward\\)` is empty"),
        (lambda: ares.reinforce_pp_advantages(np.ones(2), np.ones((2, 2)), gamma=1.5), "gamma"),
        (lambda: ares.reinforce_pro_max(np.ones(2), np.ones((2, 2)), n=2, eps=0.0), "`pro_max eps` = 0 is out of range"),
    ],
)
def test_bad_input_is_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
