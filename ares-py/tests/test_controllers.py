"""Stateful controllers: hand values from ares-core's unit tests, state_dict round trips
(identical next updates), bad states rejected with the key named, GRPO-λ rewards."""

import copy
import json

import numpy as np
import pytest

import ares

# ---------------------------------------------------------------- τ


def test_threshold_ema_updates_and_clamp():
    ema = ares.ThresholdEma()
    assert ema.rho == 0.99 and ema.tau is None
    assert ema.update(2.0) == 2.0  # first update: τ = m
    assert ema.update(4.0) == pytest.approx(0.99 * 2.0 + 0.01 * 4.0, abs=1e-15)
    e = ares.ThresholdEma(rho=0.5, tau=1.0)
    assert e.update(3.0) == 2.0 and e.update(2.0) == 2.0
    e.restore(None)
    assert e.tau is None
    with pytest.raises(ValueError, match="m \\(batch threshold\\)"):
        e.update(float("nan"))
    with pytest.raises(ValueError, match="rho"):
        ares.ThresholdEma(rho=1.5)


def test_threshold_ema_state_round_trip():
    a = ares.ThresholdEma(rho=0.9)
    for m in [1.0, 1.7, 0.4]:
        a.update(m)
    state = a.state_dict()
    assert state == {"rho": 0.9, "tau": a.tau}
    json.dumps(state)
    b = ares.ThresholdEma()
    b.load_state_dict(state)
    for m in [2.5, 0.1, 3.3]:
        assert a.update(m) == b.update(m)
    with pytest.raises(ValueError, match="`tau` = inf"):
        b.load_state_dict({"rho": 0.9, "tau": float("inf")})
    with pytest.raises(ValueError, match="`rho`"):
        b.load_state_dict({"rho": -0.1, "tau": None})
    with pytest.raises(ValueError, match="key `tau` is missing"):
        b.load_state_dict({"rho": 0.9})
    with pytest.raises(ValueError, match="unexpected key `taus`"):
        b.load_state_dict({"rho": 0.9, "tau": 1.0, "taus": 1.0})
    with pytest.raises(ValueError, match="`tau` must be a float, got str"):
        b.load_state_dict({"rho": 0.9, "tau": "1.0"})
    assert b.tau == a.tau  # failed loads changed nothing


# ---------------------------------------------------------------- buckets


def test_bucket_controller_bootstrap_and_step_order():
    # ares-core difficulty::tests::bootstrap_and_step_order
    c = ares.BucketController()
    assert c.targets == {"easy": None, "medium": None, "hard": None}
    assert c.lambdas == {"easy": 0.002, "medium": 0.001, "hard": 0.0005}
    c.bootstrap({"easy": 4.5, "medium": 7.5})  # round half to even: 4, 8
    assert c.targets == {"easy": 4.0, "medium": 8.0, "hard": None}
    # α = 0.5 + 0.05·(10 − 4) = 0.8 against the old target, then T = 10;
    # λ = 0.002 + 0.01·(0.25 − 0.05) = 0.004
    c.step_bucket("easy", 10.0, 0.25, step=1)
    assert abs(c.alpha("easy") - 0.8) < 1e-15 and c.target("easy") == 10.0
    assert abs(c.lambda_("easy") - 0.004) < 1e-15
    # hard without a target: α unchanged, T = round(2.5) = 2
    c.step_bucket(2, 2.5, step=1)
    assert (c.alpha("hard"), c.target("hard"), c.lambda_("hard")) == (0.5, 2.0, 0.0005)
    # hard: Δ = T − h̄ = 2 − 12 → α = 0
    c.step_bucket("Hard", 12.0, step=2)
    assert c.alpha("hard") == 0.0 and c.target("hard") == 12.0
    # clipped at alpha_max = 2
    c.step_bucket("medium", 108.0, step=3)
    assert c.alpha("medium") == 2.0
    assert c.update_lambda("medium", -100.0) == 0.0
    assert c.update_lambda("medium", 1e6) == 10.0


def test_bucket_controller_momentum_scale_interval():
    # ares-core difficulty::tests::target_momentum_scale_and_interval
    c = ares.BucketController(target_momentum=0.5, target_scale=(2.0, 1.0, 1.0), target_update_interval=3)
    c.bootstrap([10.0, None, None])
    assert not c.update_target("easy", 20.0, step=1)
    assert not c.update_target("easy", 20.0, step=2)
    assert c.update_target("easy", 20.0, step=3) and c.target("easy") == 25.0
    c.update_target("easy", 0.25, step=6)
    assert c.target("easy") == 13.0
    c.update_target("easy", 1.0, step=9)
    assert c.target("easy") == 8.0
    assert c.update_target("medium", 3.0, step=1) and c.target("medium") == 3.0


def test_bucket_controller_step_checks_everything_first():
    c = ares.BucketController()
    c.bootstrap([4.0, 4.0, 4.0])
    before = c.state_dict()
    with pytest.raises(ValueError, match="mean_kl \\(KL_d\\)"):
        c.step({"easy": 6.0}, {"medium": float("nan")}, step=1)
    with pytest.raises(ValueError, match="mean_hwe"):
        c.step_bucket("easy", -1.0, step=1)
    assert c.state_dict() == before
    c.step({"easy": 6.0}, [None, 0.2, None], step=1)
    assert abs(c.alpha("easy") - 0.6) < 1e-15 and c.target("easy") == 6.0
    assert abs(c.lambda_("medium") - 0.002) < 1e-15
    assert c.state_dict()["buckets"]["hard"] == before["buckets"]["hard"]
    for bad, msg in [("extreme", "not a bucket"), (3, "not a bucket index"), (1.5, "bucket name or index")]:
        with pytest.raises(ValueError, match=msg):
            c.alpha(bad)
    with pytest.raises(ValueError, match="alpha_init"):
        ares.BucketController(alpha_init={"easy": 3.0, "medium": 0.5, "hard": 0.5})
    with pytest.raises(ValueError, match="has no value for bucket \"hard\""):
        ares.BucketController(kl_budget={"easy": 0.1, "medium": 0.1})


def test_bucket_controller_classify_and_difficulty():
    c = ares.BucketController()
    # groups of 3: (T, T, F) = 2/3 easy; (F, T, F) = 1/3 medium; (F, F, F) hard
    correct = np.array([1, 1, 0, 0, 1, 0, 0, 0, 0], dtype=bool)
    ids = ["a", "a", "a", "b", "b", "b", "c", "c", "c"]
    out = c.classify(correct, n=3, global_id=ids)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, [0, 0, 0, 1, 1, 1, 2, 2, 2])
    assert c.difficulty == {"a": "easy", "b": "medium", "c": "hard"}
    # by uid, shuffled
    perm = np.random.default_rng(0).permutation(9)
    np.testing.assert_array_equal(c.classify(correct[perm], uid=np.array(ids)[perm]), out[perm])
    strict = ares.BucketController(accuracy_thresholds=(0.9, 0.5))
    # 2/3 < 0.9 is medium, 1/3 < 0.5 hard
    np.testing.assert_array_equal(strict.classify(correct, n=3), [1, 1, 1, 2, 2, 2, 2, 2, 2])
    with pytest.raises(ValueError, match="`correct` must have dtype bool"):
        c.classify(correct.astype(np.float64), n=3)
    with pytest.raises(ValueError, match="`global_id` has 2 elements"):
        c.classify(correct, n=3, global_id=["a", "b"])


def _drive(c, steps):
    out = []
    for i, (h, kl) in enumerate(steps):
        c.step(h, kl, step=i + 1)
        out.append(c.state_dict()["buckets"])
    return out


def test_bucket_controller_state_round_trip():
    rng = np.random.default_rng(1)
    a = ares.BucketController(target_momentum=0.7, target_update_interval=2, alpha_lr=0.01)
    a.bootstrap([3.0, 5.0, 8.0])
    a.set_difficulty("p1", "hard")
    _drive(a, [([float(x) for x in rng.uniform(0, 20, 3)], [float(x) for x in rng.uniform(0, 0.3, 3)]) for _ in range(5)])
    state = a.state_dict()
    json.loads(json.dumps(state))  # plain data
    assert state["difficulty"] == {"p1": "hard"}
    assert set(state["config"]) >= {"alpha_lr", "kl_budget", "target_update_interval"}
    b = ares.BucketController()  # other config: load_state_dict replaces it
    b.load_state_dict(copy.deepcopy(state))
    assert b.state_dict() == state
    later = [([float(x) for x in rng.uniform(0, 20, 3)], [float(x) for x in rng.uniform(0, 0.3, 3)]) for _ in range(6)]
    assert _drive(a, later) == _drive(b, later)


@pytest.mark.parametrize(
    "path, value, msg",
    [
        (("buckets", "hard", "alpha"), 2.5, "`buckets.hard.alpha` = 2.5 is out of range"),
        (("buckets", "easy", "target"), -1.0, "`buckets.easy.target` = -1 is out of range"),
        (("buckets", "medium", "lambda"), float("nan"), "`buckets.medium.lambda` = NaN is out of range"),
        (("config", "target_momentum"), 1.5, "target_momentum"),
        (("config", "kl_budget", "medium"), -0.1, "kl_budget.medium"),
        (("config", "target_update_interval"), 0, "target_update_interval"),
        (("config", "target_update_interval"), 1.5, "`config.target_update_interval` must be an int"),
        (("config", "alpha_lr"), "fast", "`config.alpha_lr` must be a float"),
        (("difficulty", "p1"), "extreme", "difficulty\\[\"p1\"\\]"),
    ],
)
def test_bucket_controller_bad_states(path, value, msg):
    c = ares.BucketController()
    c.set_difficulty("p1", "easy")
    good = c.state_dict()
    bad = copy.deepcopy(good)
    d = bad
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    with pytest.raises(ValueError, match=msg):
        c.load_state_dict(bad)
    assert c.state_dict() == good


def test_bucket_controller_missing_and_unknown_keys():
    c = ares.BucketController()
    s = c.state_dict()
    del s["buckets"]["medium"]["lambda"]
    with pytest.raises(ValueError, match="key `buckets.medium.lambda` is missing"):
        c.load_state_dict(s)
    s = c.state_dict()
    s["config"]["alpha_rate"] = 1.0
    with pytest.raises(ValueError, match="unexpected key `config.alpha_rate`"):
        c.load_state_dict(s)
    with pytest.raises(ValueError, match="the state must be a dict"):
        c.load_state_dict([1, 2])


# ---------------------------------------------------------------- β


def test_adaptive_kl_hand_values():
    # ares-core kl::tests::adaptive_controller
    c = ares.AdaptiveKlController(0.1)
    assert (c.target, c.horizon) == (0.1, 10000.0)
    b = c.update(0.2, 1000)  # e = clip(1) = 0.2; N/horizon = 0.1 → β·1.02
    assert abs(b - 0.102) < 1e-15
    b2 = c.update(0.05, 1000)
    assert abs(b2 - 0.102 * 0.98) < 1e-15
    b3 = c.update(0.11, 1000)
    assert abs(b3 - b2 * (1 + (0.11 / 0.1 - 1) * 0.1)) < 1e-15
    with pytest.raises(ValueError, match="current_kl"):
        c.update(float("nan"), 10)
    with pytest.raises(ValueError, match="n_samples"):
        c.update(0.1, 50000)
    assert c.value == b3
    with pytest.raises(ValueError, match="kl_target"):
        ares.AdaptiveKlController(0.1, target=0.0)


def test_adaptive_kl_state_round_trip_and_bad_states():
    a = ares.AdaptiveKlController(0.05, target=0.2, horizon=5000)
    a.update(0.3, 256)
    s = a.state_dict()
    assert s == {"kl_coef": a.value, "target": 0.2, "horizon": 5000.0}
    b = ares.AdaptiveKlController(1.0)
    b.load_state_dict(s)
    for kl in [0.1, 0.5, 0.21]:
        assert a.update(kl, 100) == b.update(kl, 100)
    for key, v in [("kl_coef", -1.0), ("target", 0.0), ("horizon", float("inf"))]:
        with pytest.raises(ValueError, match=f"`{key}` = "):
            b.load_state_dict({**s, key: v})
    assert b.state_dict() == a.state_dict()


# ---------------------------------------------------------------- entropy coefficient


def test_entropy_coef_controller():
    c = ares.EntropyCoefController(lr=0.01, max=1.0)
    # H̄ = 0.1 below target 0.2: c = 0 + 0.01·0.1 = 0.001
    assert abs(c.update(0.1) - 0.001) < 1e-15
    # above target: clamps at min 0
    assert c.update(5.0) == 0.0
    with pytest.raises(ValueError, match="mean_entropy"):
        c.update(-1.0)
    a = ares.EntropyCoefController(coef=0.002, target=0.3, lr=0.005)
    a.update(0.25)
    s = a.state_dict()
    assert set(s) == {"entropy_coeff", "target_entropy", "entropy_coeff_lr", "entropy_coeff_min", "entropy_coeff_max"}
    b = ares.EntropyCoefController()
    b.load_state_dict(s)
    for h in [0.1, 0.4, 0.29]:
        assert a.update(h) == b.update(h)
    for key, v in [("entropy_coeff", 1.0), ("entropy_coeff_lr", -1.0), ("entropy_coeff_max", -1.0), ("target_entropy", float("nan"))]:
        with pytest.raises(ValueError, match=f"`{key}` = "):
            b.load_state_dict({**s, key: v})
    assert b.state_dict() == a.state_dict()


# ---------------------------------------------------------------- GRPO-λ


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grpo_lambda_spec_vector_12(dtype):
    out = ares.grpo_lambda_rewards(np.ones(4, dtype=bool), np.array([100, 200, 300, 400], dtype=dtype), n=4, lambda_=0.2, alpha=0.6)
    assert out["rewards"].dtype == dtype
    np.testing.assert_allclose(out["rewards"], [0.8756558, 0.7659859, 0.6340141, 0.5243442], atol=1e-6)
    assert out["top"].tolist() == [True] and out["top_count"] == 1


def test_grpo_lambda_ties_and_top_groups():
    # ares-core length::tests::ties_keep_batch_order_and_others_get_zero_one
    # accuracies (1/2, 1, 1/2, 1): order 1, 3, 0, 2
    correct = np.array([1, 0, 1, 1, 0, 1, 1, 1], dtype=bool)
    lengths = np.array([1, 2, 10, 30, 4, 5, 20, 20], dtype=np.float64)
    g = ares.GrpoLambda(lambda_=0.5, alpha=0.6)
    out = g.rewards(correct, lengths, n=2)
    assert out["order"].tolist() == [1, 3, 0, 2] and out["top_count"] == 2
    assert out["top"].tolist() == [False, True, False, True]
    r = out["rewards"]
    assert (r[0], r[1], r[4], r[5]) == (1.0, 0.0, 0.0, 1.0)
    np.testing.assert_allclose(r[2:4], [0.8386352, 0.5613648], atol=1e-7)
    np.testing.assert_allclose(r[6:8], [0.7, 0.7], atol=1e-7)
    # uid= in another order gives the same rewards per row
    perm = np.array([7, 2, 0, 5, 1, 3, 6, 4])
    uid = np.repeat(np.arange(4), 2)
    by_uid = ares.grpo_lambda_rewards(correct[perm], lengths[perm], uid=uid[perm], lambda_=0.5, alpha=0.6)
    np.testing.assert_array_equal(by_uid["rewards"], r[perm])
    assert g.state_dict() == {"lambda_": 0.5, "alpha": 0.6} and g.top_group_count(10) == 5
    h = ares.GrpoLambda()
    h.load_state_dict(g.state_dict())
    np.testing.assert_array_equal(h.rewards(correct, lengths, n=2)["rewards"], r)
    with pytest.raises(ValueError, match="`alpha` = 1.5"):
        h.load_state_dict({"lambda_": 0.5, "alpha": 1.5})
    with pytest.raises(ValueError, match="lambda_"):
        ares.GrpoLambda(lambda_=-0.1)
    with pytest.raises(ValueError, match="`lengths` has 3 elements"):
        g.rewards(correct, lengths[:3], n=2)
    with pytest.raises(ValueError, match="lengths"):
        g.rewards(correct, -lengths, n=2)
