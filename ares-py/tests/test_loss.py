"""Policy losses, aggregation and token KL: spec vectors (literal numbers), the verl 0.9.1
fixture, dtypes, errors."""

import math

import numpy as np
import pytest

import ares

DTYPES = [np.float32, np.float64]

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_aggregation_spec_vector_10(dtype):
    values = np.array([[1, 2, 3], [4, 0, 0]], dtype=dtype)
    mask = np.array([[1, 1, 1], [1, 0, 0]], dtype=dtype)
    for mode, want in zip(MODES, [2.5, 10.0, 5.0, 3.0, 1.6666667]):
        assert abs(ares.aggregate(values, mask, mode) - want) < 1e-6, mode
        w = ares.aggregate_weights(mask, mode)
        assert w.dtype == dtype and w.shape == (2, 3)
        assert abs(float((w * values).sum()) - want) < 1e-6, mode
    np.testing.assert_allclose(ares.aggregate_weights(mask, "seq-mean-token-mean"), [[1 / 6, 1 / 6, 1 / 6], [0.5, 0, 0]], atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ppo_dual_clip_spec_vector_9(dtype):
    # clip 0.2 / 0.2, c = 3; (A, r, loss) with logp_old = 0, one token
    for a, r, want in [(-1.0, 5.0, 3.0), (-1.0, 2.0, 2.0), (1.0, 5.0, -1.2), (1.0, 0.5, -0.5)]:
        one = np.ones((1, 1), dtype=dtype)
        out = ares.policy_loss(
            np.full((1, 1), math.log(r), dtype=dtype), 0 * one, a * one, one,
            clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
        )
        assert abs(out["loss"] - want) < (1e-6 if dtype == np.float32 else 1e-12), (a, r)
        assert out["grad"].dtype == dtype and out["valid_tokens"] == 1
    # A = -1, r = 5: the dual clip is active; A = 1, r = 5: clipped, no gradient
    one = np.ones((1, 1), dtype=dtype)
    out = ares.policy_loss(np.full((1, 1), math.log(5.0), dtype=dtype), 0 * one, -one, one, clip_ratio_high=0.2)
    assert out["clipfrac_lower"] == 1.0 and out["grad"][0, 0] == 0.0
    out = ares.policy_loss(np.full((1, 1), math.log(5.0), dtype=dtype), 0 * one, one, one, clip_ratio_high=0.2)
    assert out["clipfrac"] == 1.0 and out["grad"][0, 0] == 0.0
    # unclipped: L = -A r, dL/dlogp = -A r
    out = ares.policy_loss(np.full((1, 1), math.log(1.1), dtype=dtype), 0 * one, 2 * one, one)
    assert abs(out["loss"] + 2.2) < 1e-6 and abs(out["grad"][0, 0] + 2.2) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_k3_spec_vector_8(dtype):
    logp = np.array([[-1.0, -2.0, 5.0]], dtype=dtype)
    ref = np.array([[-1.5, -1.0, 0.0]], dtype=dtype)
    mask = np.array([[1, 1, 0]], dtype=dtype)
    out = ares.token_kl(logp, ref, mask, estimator="low_var_kl", kl_coef=0.5)
    assert out["kl"].dtype == dtype
    np.testing.assert_allclose(out["kl"], [[0.1065307, 0.7182818, 0.0]], atol=1e-6)
    np.testing.assert_allclose(out["weighted"], [[0.05326535, 0.3591409, 0.0]], atol=1e-6)
    # k3 gradient: d/dlogp (e^x - x - 1), x = ref - logp: 1 - e^x
    np.testing.assert_allclose(out["grad"], [[0.5 * (1 - math.exp(-0.5)), 0.5 * (1 - math.e), 0.0]], atol=1e-6)
    np.testing.assert_allclose(out["row_mean_kl"], [(0.1065307 + 0.7182818) / 2], atol=1e-6)
    assert out["valid_tokens"] == 2 and out["nonempty_rows"] == 1
    assert abs(out["kl_sum"] - 0.8248125) < 1e-6


def test_token_kl_per_row_beta_and_hwe():
    logp = np.array([[0.0, 0.0], [0.0, 0.0]])
    ref = np.array([[-1.0, -1.0], [-1.0, -1.0]])  # k1 = 1 everywhere
    mask = np.ones((2, 2))
    hwe = np.array([[1.0, 0.0], [0.0, 0.0]])
    out = ares.token_kl(logp, ref, mask, estimator="k1", kl_coef=np.array([0.1, 0.2]), hwe_mask=hwe, low_ratio=0.5)
    np.testing.assert_allclose(out["weighted"], [[0.05, 0.1], [0.2, 0.2]], atol=1e-15)
    np.testing.assert_allclose(out["row_weighted_sum"], [0.15, 0.4], atol=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_kl_weights_are_what_token_kl_charges(dtype):
    mask = np.array([[1, 1, 0], [1, 1, 1]], dtype=dtype)
    hwe = np.array([[1, 0, 1], [0, 1, 0]], dtype=dtype)
    w = ares.dynamic_kl_weights(mask, kl_coef=np.array([0.1, 0.2], dtype=dtype), hwe_mask=hwe, low_ratio=0.25)
    assert w.dtype == dtype
    np.testing.assert_array_equal(w, np.array([[0.025, 0.1, 0], [0.2, 0.05, 0.2]], dtype=dtype))
    np.testing.assert_array_equal(ares.dynamic_kl_weights(mask, kl_coef=0.5), 0.5 * mask)
    np.testing.assert_array_equal(ares.dynamic_kl_weights(mask), mask)  # β = 1
    rng = np.random.default_rng(0)
    logp, ref = (-rng.random((2, 3))).astype(dtype), (-rng.random((2, 3))).astype(dtype)
    out = ares.token_kl(logp, ref, mask, kl_coef=np.array([0.1, 0.2], dtype=dtype), hwe_mask=hwe, low_ratio=0.25)
    np.testing.assert_array_equal(out["weighted"], w * out["kl"])
    for kw, match in [
        (dict(kl_coef=np.array([0.1], dtype=dtype)), "has 1 elements, expected 2"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(hwe_mask=np.ascontiguousarray(hwe[:, :2])), "`hwe_mask` has shape"),
        (dict(low_ratio=2.0), "low_ratio"),
    ]:
        with pytest.raises(ValueError, match=match):
            ares.dynamic_kl_weights(mask, **kw)
    with pytest.raises(ValueError, match="mask"):
        ares.dynamic_kl_weights(mask * 0.5)


# ---------------------------------------------------------------- verl 0.9.1 fixture


def test_verl_agg_loss(verl):
    for i, c in enumerate(verl["agg_loss"]):
        shape = (c["rows"], c["cols"])
        got = ares.aggregate(np.array(c["values"]).reshape(shape), np.array(c["mask"], dtype=np.float64).reshape(shape), c["mode"])
        tol = 2e-8 if c["mode"] == "seq-mean-token-mean" else 1e-9
        assert abs(got - c["loss"]) <= tol * (1 + abs(c["loss"])), f"agg_loss #{i} {c['mode']}"


def test_verl_kl_penalty(verl):
    seen = set()
    for i, c in enumerate(verl["kl_penalty"]):
        logp = np.array(c["logp"])[None, :]
        ref = np.array(c["logp_ref"])[None, :]
        out = ares.token_kl(logp, ref, np.ones_like(logp), estimator=c["estimator"], kl_coef=1.0)
        np.testing.assert_allclose(out["kl"][0], c["value"], rtol=1e-9, atol=1e-9, err_msg=f"kl #{i} {c['estimator']}")
        np.testing.assert_allclose(out["grad"][0], c["grad"], rtol=1e-9, atol=1e-9, err_msg=f"kl grad #{i}")
        seen.add(c["estimator"])
    assert len(seen) >= 4


def test_verl_policy_losses(verl):
    seen = set()
    for i, c in enumerate(verl["policy_loss"]):
        p, name = c["params"], c["loss"]
        shape = (c["rows"], c["cols"])
        arr = lambda k, dt=np.float64: np.array(c[k], dtype=dt).reshape(shape)  # noqa: E731
        mode = {"gspo": "gspo_token"}.get(name, name)  # verl's gspo is GSPO-token
        out = ares.policy_loss(
            arr("logp"), arr("logp_old"), arr("advantages"), arr("mask"),
            loss_mode=mode, loss_agg_mode=c["agg"],
            clip_ratio_low=p["clip_ratio_low"], clip_ratio_high=p["clip_ratio_high"],
            # verl's GSPO, CISPO and Clip-Cov have no dual clip; its vanilla loss always has one
            clip_ratio_c=p["clip_ratio_c"] if name == "vanilla" else 0.0,
            clip_cov_ratio=p["clip_cov_ratio"], clip_cov_lb=p["clip_cov_lb"], clip_cov_ub=p["clip_cov_ub"],
            kl_cov_ratio=p["kl_cov_ratio"], ppo_kl_coef=p["ppo_kl_coef"],
        )
        tol = 2e-8 if c["agg"] == "seq-mean-token-mean" else 1e-9
        what = f"policy_loss #{i} {name} {c['agg']}"
        assert abs(out["loss"] - c["out"]) <= tol * (1 + abs(c["out"])), what
        np.testing.assert_allclose(out["grad"].reshape(-1), c["grad"], rtol=tol, atol=tol, err_msg=what)
        metrics = c.get("metrics", {})
        if name in ("clip_cov", "kl_cov"):
            selected = len(c.get("selected") or [])
            assert abs(out["selected_frac"] * out["valid_tokens"] - selected) < 1e-6, what
        else:
            for key, ours in [("actor/pg_clipfrac", "clipfrac"), ("actor/pg_clipfrac_lower", "clipfrac_lower"), ("actor/ppo_kl", "approx_kl")]:
                if key in metrics and metrics[key] is not None:
                    assert abs(out[ours] - metrics[key]) <= 2e-8 * (1 + abs(metrics[key])), f"{what} {ours}"
        seen.add(name)
    assert seen == {"vanilla", "gspo", "cispo", "clip_cov", "kl_cov"}


# ---------------------------------------------------------------- errors


def _tok(dtype=np.float64):
    return np.zeros((2, 3), dtype=dtype)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ares.aggregate(_tok(), _tok(), "mean"), '`loss_agg_mode` = "mean" is not one of'),
        (lambda: ares.aggregate(_tok(), np.zeros((2, 3))), r"`mask` is empty"),
        (lambda: ares.aggregate(np.full((1, 1), np.nan), np.ones((1, 1))), "`values` holds a non-finite value"),
        (lambda: ares.aggregate(_tok(), np.ones((2, 2))), r"`mask` has shape \(2, 2\), expected \(2, 3\)"),
        (lambda: ares.policy_loss(_tok(), _tok(), _tok(), np.ones((2, 3)), clip_ratio_low=1.5), "`clip_ratio_low` = 1.5 is out of range"),
        (lambda: ares.policy_loss(_tok(), _tok(), _tok(), np.ones((2, 3)), clip_ratio_c=0.5), "`clip_ratio_c` = 0.5"),
        (lambda: ares.policy_loss(_tok(), _tok(), _tok(np.float32), np.ones((2, 3))), "`advantages` has dtype float32, expected float64"),
        (lambda: ares.policy_loss(_tok(), np.full((2, 3), np.inf), _tok(), np.ones((2, 3))), "`logp_old` holds a non-finite value"),
        (lambda: ares.policy_loss(_tok(), _tok(), _tok(), np.ones((2, 3)), is_correction="tis"), "`logp_rollout` has 0 elements"),
        (lambda: ares.policy_loss(_tok(), _tok(), _tok(), np.ones((2, 3)), is_correction="foo"), '`is_correction` = "foo"'),
        (lambda: ares.policy_loss(_tok(), _tok(), _tok(), np.ones((2, 3)), loss_mode="dpo"), '`loss_mode` = "dpo"'),
        (lambda: ares.policy_loss(np.zeros((2, 6))[:, ::2], _tok(), _tok(), np.ones((2, 3))), "`logp` is not C-contiguous"),
        (lambda: ares.token_kl(_tok(), _tok(), np.ones((2, 3)), estimator="k4"), '`estimator` = "k4"'),
        (lambda: ares.token_kl(_tok(), _tok(), np.ones((2, 3)), kl_coef=-1.0), r"`kl_coef \(β\)` = -1 is out of range"),
        (lambda: ares.token_kl(_tok(), _tok(), np.ones((2, 3)), kl_coef=np.ones(3)), "`kl_coef` has 3 elements, expected 2"),
        (lambda: ares.token_kl(_tok(), _tok(), np.ones((2, 3)), low_ratio=2.0), "`low_ratio` = 2 is out of range"),
        (lambda: ares.token_kl(_tok(), np.full((2, 3), np.nan), np.ones((2, 3))), "`logp_ref` holds a non-finite value"),
    ],
)
def test_bad_input_is_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
