"""ares.verl.AresRewardManager's numpy core (numpy + ares only; CI runs it). The verl side
(DataProto in, reward tensor out, the registry) is in test_verl_reward_manager.py."""

import pathlib

import numpy as np
import pytest

import ares
from ares.verl import AresRewardManager

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


def batch(seed, groups=6, n=4, t=24):
    rng = np.random.default_rng(seed)
    b = groups * n
    uid = np.array([f"p{i // n}" for i in rng.permutation(b)], dtype=object)
    lengths = rng.integers(6, t + 1, b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    entropies = (rng.gamma(0.6, 1.0, (b, t)) * mask).astype(np.float32)
    scores = rng.integers(0, 2, b).astype(np.float64)
    global_id = np.array([f"q-{u}" for u in uid], dtype=object)
    return dict(scores=scores, lengths=lengths, uid=uid, mask=mask, entropies=entropies, global_id=global_id)


def test_grpo_lambda_mode_is_grpo_lambda_rewards():
    d = batch(0)
    m = AresRewardManager(mode="grpo_lambda", grpo_lambda=0.5, grpo_lambda_alpha=0.4)
    out = m.shape_rewards(d["scores"], d["lengths"], d["uid"])
    want = ares.grpo_lambda_rewards(d["scores"] > 0.5, d["lengths"].astype(np.float64), uid=d["uid"], lambda_=0.5, alpha=0.4)
    np.testing.assert_array_equal(out["reward"], want["rewards"])
    assert m.steps == 1


def test_grpo_lambda_mode_then_grpo_equals_verl_fixture():
    # the committed verl fixture: verl's GRPO over the GRPO-λ rewards (λ 0.5, α 0.4)
    with np.load(FIXTURES / "verl_adapter_estimators.npz") as f:
        est = dict(f)
    scores = est["rewards"].sum(-1).astype(np.float64)
    lengths = est["mask"].sum(-1)
    m = AresRewardManager(mode="grpo_lambda", grpo_lambda=0.5, grpo_lambda_alpha=0.4)
    reward = m.shape_rewards(scores, lengths, est["uid"])["reward"]
    np.testing.assert_allclose(reward, est["lambda_rewards"], rtol=1e-6, atol=1e-7)
    adv = ares.grpo_token_advantages(reward.astype(np.float32), est["mask"], uid=est["uid"])
    np.testing.assert_allclose(adv, est["grpo_lambda"], rtol=1e-6, atol=1e-6)


def ares_call(m, d, **kw):
    return m.shape_rewards(
        d["scores"], d["lengths"], d["uid"], entropies=d["entropies"], mask=d["mask"], global_id=d["global_id"], **kw
    )


def test_ares_mode_first_batch():
    d = batch(1)
    m = AresRewardManager(mode="ares")
    out = ares_call(m, d)
    # the first batch counts with its own candidate m, which then becomes τ
    w = ares.entropy_windows(d["entropies"], d["mask"])
    cand = ares.batch_median_threshold(*ares.row_percentile(w["means"], w["valid"]))
    assert out["tau"] == cand and m.tau.tau == pytest.approx(cand)
    counts = ares.entropy_windows(d["entropies"], d["mask"], tau=cand)["counts"]
    np.testing.assert_array_equal(out["hwe_count"], counts)
    # buckets from this batch's accuracy, remembered by global_id
    np.testing.assert_array_equal(out["difficulty"], ares.BucketController().classify(d["scores"] > 0.5, uid=d["uid"]))
    assert m.controller.difficulty[d["global_id"][0]] == ("easy", "medium", "hard")[out["difficulty"][0]]
    # no target in force: α stays, each present bucket's target = round(h̄_d), h̄_d over groups
    gm = ares.group_means(counts.astype(np.float64), uid=d["uid"])
    first = {}
    for i, u in enumerate(d["uid"]):
        first.setdefault(u, i)
    hbar = ares.bucket_means(out["difficulty"][list(first.values())], gm)
    for name, h in hbar.items():
        assert m.controller.target(name) == (None if h is None else round(h))
        assert m.controller.alpha(name) == 0.5
    target = np.array([m.controller.target(int(b)) for b in out["difficulty"]])
    s, overall = ares.entropy_rewards(d["scores"] > 0.5, counts.astype(np.float64), target, np.full(len(target), 0.5), out["difficulty"])
    np.testing.assert_array_equal(out["entropy_reward"], s)
    np.testing.assert_array_equal(out["reward"], overall)
    assert np.any(s != 0.0)


def test_ares_mode_second_batch_uses_the_tau_in_force_and_moves_alpha():
    d1, d2 = batch(2), batch(3)
    m = AresRewardManager(mode="ares")
    ares_call(m, d1)
    tau1, targets1 = m.tau.tau, m.controller.targets
    out = ares_call(m, d2)
    assert out["tau"] == tau1  # counted with τ from before this batch's update
    w = ares.entropy_windows(d2["entropies"], d2["mask"])
    cand = ares.batch_median_threshold(*ares.row_percentile(w["means"], w["valid"]))
    assert m.tau.tau == pytest.approx(0.99 * tau1 + 0.01 * cand)
    np.testing.assert_array_equal(out["hwe_count"], ares.entropy_windows(d2["entropies"], d2["mask"], tau=tau1)["counts"])
    # α moved toward the target in force during the step (easy/medium: α + 0.05·(h̄ − T))
    moved = [b for b in ("easy", "medium", "hard") if targets1[b] is not None and m.controller.alpha(b) != 0.5]
    assert moved


def test_state_dict_round_trip_gives_identical_next_rewards():
    d1, d2 = batch(4), batch(5)
    a = AresRewardManager(mode="ares", format_weight=0.0)
    ares_call(a, d1)
    b = AresRewardManager(mode="ares")
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    ra, rb = ares_call(a, d2), ares_call(b, d2)
    for k in ("reward", "hwe_count", "entropy_reward", "difficulty"):
        np.testing.assert_array_equal(ra[k], rb[k])
    assert a.state_dict() == b.state_dict() and a.steps == 2
    # a fresh manager (lost state) gives other rewards: the state matters
    rc = ares_call(AresRewardManager(mode="ares"), d2)
    assert not np.array_equal(ra["reward"], rc["reward"])


def test_errors():
    with pytest.raises(ValueError, match="`mode`"):
        AresRewardManager(mode="dapo")
    d = batch(6)
    m = AresRewardManager(mode="ares")
    with pytest.raises(ValueError, match="needs `entropies`, `mask` and `global_id`"):
        m.shape_rewards(d["scores"], d["lengths"], d["uid"])
    with pytest.raises(ValueError, match="uid"):
        AresRewardManager().shape_rewards(d["scores"], d["lengths"], d["uid"][:-1])
    with pytest.raises(KeyError, match="missing"):
        m.load_state_dict({"steps": 1})
    before = m.state_dict()
    bad = dict(d, entropies=np.full_like(d["entropies"], np.nan))
    with pytest.raises(ValueError):
        ares_call(m, bad)
    assert m.state_dict() == before  # an error moves no state
