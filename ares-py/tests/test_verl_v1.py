"""ares.verl_v1: the ARES step of the verl trainer modes on host arrays (numpy + ares; CI runs
these), and with verl 0.9.1 (where torch, verl and TransferQueue import) the multi-trajectory
groups, the trainer step over a TransferQueue stand-in, checkpoints and the plugin's
registrations."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ares
from ares.verl import AresRewardManager
from ares.verl_v1 import AresSettingsError, AresStep, _values, final_session_rows, kl_loss_np, settings_from_config


def batch(seed, groups=6, n=4, t=24, holes=False):
    rng = np.random.default_rng(seed)
    b = groups * n
    uid = np.array([f"p{i // n}" for i in rng.permutation(b)], dtype=object)
    lengths = rng.integers(6, t + 1, b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    if holes:  # tool answers masked out inside the response, as multi-turn rows have
        mask[:, 2:4] = 0.0
    entropies = (rng.gamma(0.6, 1.0, (b, t)) * mask).astype(np.float32)
    scores = rng.integers(0, 2, b).astype(np.float64)
    ids = np.array([f"q-{u}" for u in uid], dtype=object)
    old = (-rng.random((b, t)) * 3).astype(np.float32)
    ref = (old + 0.4 * rng.standard_normal((b, t))).astype(np.float32)
    return dict(scores=scores, mask=mask, uid=uid, entropies=entropies, ids=ids, old=old, ref=ref)


def run(ares_step, d, **kw):
    return ares_step(
        d["scores"], d["mask"], d["uid"], entropies=d["entropies"], difficulty_ids=d["ids"],
        old_log_probs=d["old"], ref_log_probs=d["ref"], **kw,
    )


def last_valid(mask):
    return np.array([np.nonzero(r)[0][-1] if r.any() else -1 for r in mask])


def k3(old, ref):
    # docs/algorithms.md §4: x = clamp(−δ, −20, 20), k = clamp(eˣ − x − 1, −10, 10), δ = logπ − logπ_ref
    x = np.clip(-(old.astype(np.float64) - ref), -20, 20)
    return np.clip(np.expm1(x) - x, -10, 10)


def test_without_kl_the_shaped_reward_sits_on_each_rows_last_valid_token():
    d = batch(0, holes=True)
    step = AresStep({"kl": {"enable": False}})
    token, metrics, *_ = step(d["scores"], d["mask"], d["uid"], entropies=d["entropies"], difficulty_ids=d["ids"], step=1)
    want = AresRewardManager(mode="ares").shape_rewards(
        d["scores"], d["mask"].sum(1), d["uid"], entropies=d["entropies"], mask=d["mask"], global_id=d["ids"], step=1
    )["reward"]
    last = last_valid(d["mask"])
    np.testing.assert_array_equal(token[np.arange(len(last)), last], want.astype(np.float32))
    token[np.arange(len(last)), last] = 0.0
    assert not token.any()
    assert metrics["ares/acc"] == pytest.approx(np.mean(d["scores"] > 0.5))


def test_kl_is_charged_per_token_with_the_buckets_lambda_then_lambda_moves():
    d = batch(1)
    step = AresStep({"kl": {"placement": "reward"}})
    lam0 = {b: step.shaper.controller.lambda_(b) for b in ("easy", "medium", "hard")}
    token, metrics, weights, *_ = run(step, d, step=1)
    assert weights is None  # charged in the rewards, nothing for the actor's loss
    # the shaping part, from a manager that saw the same batch
    ref_mgr = AresRewardManager(mode="ares")
    out = ref_mgr.shape_rewards(
        d["scores"], d["mask"].sum(1), d["uid"], entropies=d["entropies"], mask=d["mask"], global_id=d["ids"], step=1
    )
    diff = out["difficulty"]
    names = np.array(["easy", "medium", "hard"])[diff]
    beta = np.array([lam0[n] for n in names])[:, None] * np.where(out["hwe_mask"] > 0, 0.5, 1.0)
    kl = k3(d["old"], d["ref"]) * d["mask"]
    want = -beta * kl
    last = last_valid(d["mask"])
    want[np.arange(len(last)), last] += out["reward"]
    np.testing.assert_allclose(token, want, rtol=2e-6, atol=2e-7)
    assert out["hwe_mask"].any()  # the dynamic weighting is exercised
    # dual ascent (§2): λ_d ← min(10, max(0, λ_d + 0.01·(KL_d − ε_d))), KL_d the mean over the
    # bucket's groups of their mean per-sample mean token KL
    row_kl = kl.sum(1) / d["mask"].sum(1)
    eps = {"easy": 0.05, "medium": 0.1, "hard": 0.2}
    for b in ("easy", "medium", "hard"):
        groups = sorted({u for u, n in zip(d["uid"], names) if n == b})
        if not groups:
            assert step.shaper.controller.lambda_(b) == lam0[b]
            continue
        kl_d = np.mean([row_kl[d["uid"] == g].mean() for g in groups])
        assert step.shaper.controller.lambda_(b) == pytest.approx(min(10.0, max(0.0, lam0[b] + 0.01 * (kl_d - eps[b]))))
        assert metrics[f"ares/lambda_{b}"] == step.shaper.controller.lambda_(b)


def test_kl_in_the_loss_gives_per_token_weights_and_moves_lambda_as_in_the_reward():
    """``kl.placement: loss`` (the default): no KL in the token rewards; each token's weight
    β_t·m_t = λ_d·(HWE ? low_ratio : 1) for the actor's loss; τ, the buckets and λ move exactly
    as with the KL in the rewards."""
    d = batch(1)
    in_loss, in_reward = AresStep({"kl": {"low_ratio": 0.25}}), AresStep({"kl": {"low_ratio": 0.25, "placement": "reward"}})
    lam0 = {b: in_loss.shaper.controller.lambda_(b) for b in ("easy", "medium", "hard")}
    token, metrics, weights, beta, tau = run(in_loss, d, step=1)
    token_r, metrics_r, *_ = run(in_reward, d, step=1)
    assert in_loss.state_dict() == in_reward.state_dict()
    assert json.dumps(metrics, sort_keys=True) == json.dumps(metrics_r, sort_keys=True)  # NaN targets too
    out = AresRewardManager(mode="ares").shape_rewards(
        d["scores"], d["mask"].sum(1), d["uid"], entropies=d["entropies"], mask=d["mask"], global_id=d["ids"], step=1
    )
    last = last_valid(d["mask"])
    want = np.zeros_like(token)
    want[np.arange(len(last)), last] = out["reward"]
    np.testing.assert_array_equal(token, want.astype(np.float32))
    names = np.array(["easy", "medium", "hard"])[out["difficulty"]]
    np.testing.assert_array_equal(beta, np.array([lam0[n] for n in names], dtype=np.float32))
    hwe = out["hwe_mask"] > 0
    assert hwe.any() and tau == out["tau"]
    np.testing.assert_array_equal(weights, (beta[:, None] * np.where(hwe, np.float32(0.25), 1) * d["mask"]).astype(np.float32))
    # what the rewards were charged with the other placement, token by token
    np.testing.assert_allclose(token - token_r, weights * k3(d["old"], d["ref"]), rtol=2e-6, atol=2e-7)
    # the same weights for rows the step did not shape, from their entropies and the step's τ
    np.testing.assert_array_equal(in_loss.kl_weights(beta, d["mask"], in_loss.hwe_mask(d["entropies"], d["mask"], tau)), weights)
    undynamic = AresStep({"kl": {"dynamic": False}})
    _, _, w, b, _ = run(undynamic, d, step=1)
    np.testing.assert_array_equal(w, b[:, None] * d["mask"])


def test_the_kl_term_of_the_loss_by_hand():
    rng = np.random.default_rng(7)
    mask = np.ones((3, 5), np.float32)
    mask[1, 3:] = 0
    mask[2, 1] = 0
    lp = (-rng.random((3, 5)) * 2).astype(np.float32)
    ref = (lp + 0.3 * rng.standard_normal((3, 5))).astype(np.float32)
    w = (rng.random((3, 5)) * 0.1 * mask).astype(np.float32)
    k = k3(lp, ref) * mask
    dk = (1 - np.exp(np.clip(ref.astype(np.float64) - lp, -20, 20))) * mask  # k3's dk/dlogπ = 1 − eˣ
    for mode, agg in [
        ("token-mean", lambda x: x.sum() / mask.sum()),
        ("token-sum", lambda x: x.sum()),
        ("seq-mean-token-sum", lambda x: x.sum(1).mean()),
        ("seq-mean-token-mean", lambda x: (x.sum(1) / mask.sum(1)).mean()),
        ("seq-mean-token-sum-norm", lambda x: x.sum() / (3 * 5)),
    ]:
        loss, grad = kl_loss_np(lp, ref, mask, w, "k3", mode)
        assert loss == pytest.approx(agg(w * k), rel=1e-6), mode
        # the gradient: agg is linear, so ∂/∂logπ_t = agg's weight of t · w_t · dk_t
        unit = np.eye(15).reshape(15, 3, 5)
        want = np.array([agg(u * w * dk) for u in unit]).reshape(3, 5)
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-9, err_msg=mode)
    # verl's global batch: tokens of all micro-batches and ranks
    loss, _ = kl_loss_np(lp, ref, mask, w, "k3", "token-mean", {"dp_size": 2, "batch_num_tokens": 40})
    assert loss == pytest.approx((w * k).sum() * 2 / 40, rel=1e-6)
    assert kl_loss_np(lp, ref, np.zeros_like(mask), w, "k3") is None
    for bad, match in [(-w, "must be finite and >= 0"), (np.where(mask > 0, np.nan, 0).astype(np.float32), r"\[0, 0\] = nan")]:
        with pytest.raises(ValueError, match=match):
            kl_loss_np(lp, ref, mask, bad, "k3")
    with pytest.raises(ValueError, match="shape"):
        kl_loss_np(lp, ref, mask, w[:, :4], "k3")


def test_state_round_trip_gives_the_same_next_step():
    d1, d2 = batch(2), batch(3)
    a = AresStep()
    run(a, d1, step=1)
    b = AresStep()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # as ares_state.json holds it
    ta, ma, wa, *_ = run(a, d2, step=2)
    tb, mb, wb, *_ = run(b, d2, step=2)
    np.testing.assert_array_equal(ta, tb)
    np.testing.assert_array_equal(wa, wb)
    assert ma == mb and a.state_dict() == b.state_dict()
    tc, _, wc, *_ = run(AresStep(), d2, step=2)
    assert not np.array_equal(ta, tc) and not np.array_equal(wa, wc)  # the state matters


def test_grpo_lambda_mode():
    d = batch(4)
    step = AresStep({"mode": "grpo_lambda", "grpo_lambda": 0.5, "grpo_lambda_alpha": 0.4, "kl": {"enable": False}})
    token, *_ = step(d["scores"], d["mask"], d["uid"])
    want = ares.grpo_lambda_rewards(d["scores"] > 0.5, d["mask"].sum(1).astype(np.float64), uid=d["uid"], lambda_=0.5, alpha=0.4)
    np.testing.assert_allclose(token.sum(1), want["rewards"], rtol=1e-6)


def test_settings_are_checked_by_name():
    s = settings_from_config({"controller": {"alpha_lr": 0.1}, "kl": {"low_ratio": 0.25}})
    assert s["kl"]["low_ratio"] == 0.25 and s["kl"]["estimator"] == "k3" and s["difficulty_key"] == "index"
    for bad, match in [
        ({"modee": "ares"}, "`ares.modee` is not an ares setting"),
        ({"kl": {"lowratio": 1}}, "`ares.kl.lowratio`"),
        ({"mode": "dapo"}, "`ares.mode`"),
        ({"kl": {"low_ratio": 2}}, "`ares.kl.low_ratio`"),
        ({"kl": {"estimator": "k4"}}, "`ares.kl.estimator`"),
        ({"mode": "grpo_lambda"}, "`ares.kl.enable` needs `ares.mode: ares`"),
        ({"window_size": 0}, "`ares.window_size`"),
        ({"kl": {"placement": "actor"}}, "`ares.kl.placement`"),
    ]:
        with pytest.raises(AresSettingsError, match=match.replace(".", r"\.").replace("(", r"\(")):
            settings_from_config(bad)


def test_errors_move_no_state():
    d = batch(5)
    step = AresStep()
    with pytest.raises(ValueError, match="needs old_log_probs"):
        step(d["scores"], d["mask"], d["uid"], entropies=d["entropies"], difficulty_ids=d["ids"])
    with pytest.raises(ValueError, match="entropies"):
        step(d["scores"], d["mask"], d["uid"])
    fresh = AresStep().state_dict()
    bad = dict(d, entropies=np.full_like(d["entropies"], np.nan))
    with pytest.raises(ValueError):
        run(step, bad)
    assert step.state_dict()["shaper"]["tau"] == fresh["shaper"]["tau"]


def test_final_session_rows():
    keys = ["a_0_0", "a_0_1", "b_0_0", "a_1_0", "a_0_2", "b_0_1"]
    final, to_final = final_session_rows(keys)
    assert final == [4, 5, 3]  # a_0 ends at index 2 (row 4), b_0 at row 5, a_1 at row 3
    assert to_final == [0, 0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="not verl v1's"):
        final_session_rows(["no-underscores"])


def test_verls_own_tests_pass_with_ares_substituted():
    # the committed result of scripts/verl_tests_with_ares.py (CI has neither torch nor verl)
    path = os.path.join(os.path.dirname(__file__), "fixtures", "verl_0_9_1_own_tests.json")
    with open(path) as f:
        result = json.load(f)
    assert result["verl"] == "0.9.1" and result["differ"] == []
    assert set(result["ares_substituted"]) == set(result["shipped"]) and len(result["shipped"]) >= 40
    assert all(v == "passed" for v in result["ares_substituted"].values())
    assert {"ares_grpo", "ares_rloo", "ares_vanilla"} <= {k for k, n in result["ares_calls"].items() if n > 0}


# ---------------------------------------------------------------- with verl 0.9.1


def _verl_v1():
    pytest.importorskip("torch")
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")
    from verl.trainer.ppo.v1 import trainer_base

    return trainer_base


def test_outcome_estimators_take_multi_trajectory_groups_as_verls_grpo():
    tb = _verl_v1()
    import torch
    from verl import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    import ares.verl as av

    av.register()
    g = torch.Generator().manual_seed(0)
    # 3 prompts × 4 sessions; some sessions have 2 or 3 outputs (turns), the reward on the last
    keys, rows = [], 0
    for p in range(3):
        for s in range(4):
            for i in range(1 + (p + s) % 3):
                keys.append(f"u{p}_{s}_{i}")
                rows += 1
    t = 10
    mask = (torch.rand(rows, t, generator=g) > 0.2).float()
    mask[:, 0] = 1.0
    rewards = torch.zeros(rows, t)
    rewards[torch.arange(rows), t - 1] = torch.randint(0, 2, (rows,), generator=g).float()
    uid = np.array([k.split("_")[0] for k in keys], dtype=object)

    def data():
        d = DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(), "response_mask": mask.clone()})
        d.non_tensor_batch["uid"] = uid
        return d

    f = tb.compute_advantage_for_multi_trajectories
    want = f(data(), keys, AdvantageEstimator.GRPO, num_repeat=4, config=None).batch["advantages"]
    got = f(data(), keys, "ares_grpo", num_repeat=4, config=None).batch["advantages"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # without the treatment every output would be its own sample: not the same numbers
    plain = f.__wrapped__(data(), keys, "ares_grpo", num_repeat=4, config=None).batch["advantages"]
    assert not torch.allclose(plain, want, atol=1e-4)


def _registrations_script():
    return (
        "import json, verl\n"
        "from verl.trainer.ppo import core_algos as ca\n"
        "from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "out = {\n"
        " 'est': [ca.get_adv_estimator_fn(n).__name__ for n in ('ares_grpo', 'ares_rloo', 'ares_reinforce_pro_max', 'ares_grpo_lambda')],\n"
        " 'loss': [ca.get_policy_loss_fn(n).__name__ for n in ('ares_vanilla', 'ares_gspo', 'ares_gspo_seq', 'ares_cispo', 'ares_clip_cov', 'ares_kl_cov')],\n"
        " 'rm': get_reward_manager_cls('ares').__name__,\n"
        " 'trainers': [get_trainer_cls(n).__name__ for n in ('ares_sync', 'ares_colocate_async', 'ares_separate_async')],\n"
        "}\n"
        "from verl.trainer import main_ppo\n"
        "out['validate_config_checks_ares'] = hasattr(main_ppo.validate_config, '__wrapped__')\n"
        "print(json.dumps(out))\n"
    )


def _plugin_installed():
    from importlib.metadata import entry_points

    return any(ep.value == "ares.verl_plugin" for ep in entry_points(group="verl.plugins"))


def test_the_entry_point_alone_registers_everything_in_a_fresh_process():
    _verl_v1()
    if not _plugin_installed():
        pytest.skip("ares is not installed as a wheel here (no verl.plugins entry point)")
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    out = subprocess.run([sys.executable, "-c", _registrations_script()], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["est"] == ["ares_grpo", "ares_rloo", "ares_reinforce_pro_max", "ares_grpo_lambda"]
    assert got["loss"] == ["ares_vanilla", "ares_gspo", "ares_gspo_seq", "ares_cispo", "ares_clip_cov", "ares_kl_cov"]
    assert got["rm"] == "AresRewardLoopManager"
    assert got["trainers"] == ["AresPPOTrainerSync", "AresPPOTrainerColocateAsync", "AresPPOTrainerSeparateAsync"]
    assert got["validate_config_checks_ares"]
    # and verl's switch turns it off
    off = subprocess.run(
        [sys.executable, "-c", _registrations_script()], env=dict(env, VERL_USE_EXTERNAL_PLUGINS="none"),
        capture_output=True, text=True, timeout=300,
    )
    assert off.returncode != 0 and "ares_grpo" in off.stderr


def test_a_ray_actor_resolves_every_name_through_the_entry_point_alone():
    _verl_v1()
    ray = pytest.importorskip("ray")
    if not _plugin_installed():
        pytest.skip("ares is not installed as a wheel here (no verl.plugins entry point)")
    script = (
        "import json, ray\n"
        "ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        "@ray.remote\n"
        "class TaskRunner:\n"
        "    def names(self):\n"
        "        ns = {}\n"
        f"        exec({_registrations_script()!r}.replace('print(json.dumps(out))', ''), ns)\n"
        "        return ns['out']\n"
        "r = TaskRunner.remote()\n"
        "print(json.dumps(ray.get(r.names.remote())))\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rm"] == "AresRewardLoopManager" and len(got["trainers"]) == 3 and len(got["est"]) == 4
    del ray


@pytest.fixture(scope="module")
def ares_sync_trainer(tmp_path_factory):
    """An ``ares_sync`` trainer over a real TransferQueue on a local Ray (no workers: only the
    TaskRunner-side steps are called)."""
    _verl_v1()
    ray = pytest.importorskip("ray")
    from hydra import compose, initialize_config_module

    import ares.verl as av

    av.register()
    ckpt = tmp_path_factory.mktemp("ckpt")
    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            "trainer.v1.trainer_mode=ares_sync", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0",
            f"trainer.default_local_dir={ckpt}", "+ares.window_size=2",
        ])
    import transfer_queue as tq
    from verl.trainer.ppo.v1 import get_trainer_cls

    # TransferQueue's controller and storage units each take a logical CPU
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    tq.init()
    trainer = get_trainer_cls("ares_sync")(cfg)
    yield trainer, tq
    tq.close()
    ray.shutdown()


def _tq_batch(tq, seed, prompts=5, n=4, turns=lambda p, s: 1, prefix=None):
    """Rows as verl's agent loop puts them: keys {uid}_{session}_{turn}, ragged response
    fields; every output of a session carries its final score (verl's reward loop copies it)."""
    import torch
    from transfer_queue import KVBatchMeta
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rng = np.random.default_rng(seed)
    prefix = prefix or f"s{seed}p"
    rows, keys = [], []
    for p in range(prompts):
        for s in range(n):
            score = float(rng.integers(0, 2))
            for i in range(turns(p, s)):
                length = int(rng.integers(4, 12))
                rm = torch.zeros(length)
                rm[-1] = score
                old = torch.from_numpy((-rng.random(length) * 3).astype(np.float32))
                keys.append(f"{prefix}{p}_{s}_{i}")
                rows.append(dict(
                    uid=f"{prefix}{p}", index=100 + p, response_mask=torch.ones(length, dtype=torch.int64),
                    prompts=torch.ones(3 + p, dtype=torch.int64), responses=torch.ones(length, dtype=torch.int64),
                    rm_scores=rm, entropy=torch.from_numpy(rng.gamma(0.6, 1.0, length).astype(np.float32)),
                    old_log_probs=old,
                    ref_log_prob=old + torch.from_numpy((0.4 * rng.standard_normal(length)).astype(np.float32)),
                ))
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows))
    return KVBatchMeta(keys=keys, tags=[{} for _ in keys], partition_id="train")


def _padded(tq, batch, fields):
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields).to_padded_tensor()
    return {f: (_values(data[f]) if f in ("uid", "index") else data[f].float().numpy()) for f in fields}


def test_ares_sync_step_over_the_transfer_queue_equals_the_host_step_then_grpo(ares_sync_trainer):
    trainer, tq = ares_sync_trainer
    trainer.global_steps = 1
    batch = _tq_batch(tq, 0)
    before = _padded(tq, batch, ["uid", "index", "response_mask", "rm_scores", "entropy", "old_log_probs", "ref_log_prob"])
    reference = AresStep(trainer.ares.settings)
    reference.load_state_dict(trainer.ares.state_dict())
    metrics = {}
    out = trainer._compute_advantage(batch, metrics)
    after = _padded(tq, batch, ["advantages", "rm_scores", "ares_kl_weights"])
    mask, uid = before["response_mask"], np.array(before["uid"], dtype=object)
    token, want_metrics, weights, *_ = reference(
        before["rm_scores"].sum(1).astype(np.float64), mask, uid, entropies=before["entropy"],
        difficulty_ids=np.array([str(i) for i in before["index"]], dtype=object),
        old_log_probs=before["old_log_probs"], ref_log_probs=before["ref_log_prob"], step=1,
    )
    np.testing.assert_allclose(after["rm_scores"], token, rtol=1e-6, atol=1e-7)
    # the KL is charged in the actor's loss (the default placement): its weights travel with the batch
    np.testing.assert_array_equal(after["ares_kl_weights"], weights)
    assert "ares_kl_weights" in out.fields
    adv = ares.grpo_token_advantages(token.sum(1), mask, uid=uid)
    np.testing.assert_allclose(after["advantages"], adv, rtol=1e-5, atol=1e-6)
    assert metrics["ares/lambda_easy"] == want_metrics["ares/lambda_easy"] and "ares/tau" in metrics
    assert trainer.ares.state_dict() == reference.state_dict()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_the_actors_loss_charges_the_kl_weights_the_batch_carries(ares_sync_trainer, agg):
    """The actor's batch as verl's worker receives it (TransferQueue fields of the meta the
    trainer hands ``update_actor``) carries the KL weights and the estimator; verl's loss, as its
    engine workers bind it, then equals verl's own loss plus ``agg(β_t·k3_t)`` — value and
    gradient."""
    trainer, tq = ares_sync_trainer
    import torch
    from hydra import compose, initialize_config_module
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.transferqueue_utils import _meta_to_realdata
    from verl.workers import engine_workers
    from verl.workers.utils import losses
    from verl.workers.utils.padding import no_padding_2_padding

    trainer.global_steps = 5
    meta = trainer._compute_advantage(_tq_batch(tq, 21, prefix=f"al{agg}"), {})
    seen = []

    class ActorGroup:
        def update_actor(self, batch):
            seen.append(batch)
            return {"metrics": {"mfu": [0.0]}}

    trainer.actor_rollout_wg = ActorGroup()
    try:
        trainer._update_actor(meta, {})
    finally:
        del trainer.actor_rollout_wg
    data = _meta_to_realdata(seen[0])
    assert "ares_kl_weights" in data.keys() and tu.get_non_tensor_data(data, "ares_kl_estimator", None) == "k3"
    # what the engine adds to each micro-batch before the loss
    tokens = int(data["response_mask"].values().sum())
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=tokens)
    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", f"actor_rollout_ref.actor.loss_agg_mode={agg}",
        ])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert engine_workers.ppo_loss is losses.ppo_loss and losses.ppo_loss.__wrapped__ is not None
    total = int(data["prompts"].offsets()[-1] + data["responses"].offsets()[-1])
    g = torch.Generator().manual_seed(5)
    values = (-torch.rand(total, generator=g, dtype=torch.float64) * 2).float()

    def loss_of(fn, plus_kl):
        v = values.clone().requires_grad_(True)
        loss, metrics = fn(actor, {"log_probs": v}, data)
        if plus_kl:
            f = data.select("response_mask", "ref_log_prob", "ares_kl_weights").to_padded_tensor()
            kld = kl_penalty(no_padding_2_padding(v, data), f["ref_log_prob"], "low_var_kl")
            mask = f["response_mask"].bool()
            loss = loss + agg_loss(kld * f["ares_kl_weights"], mask, agg, **actor.global_batch_info)
        loss.backward()
        return loss.detach(), v.grad, metrics

    got, got_grad, metrics = loss_of(losses.ppo_loss, False)
    want, want_grad, _ = loss_of(losses.ppo_loss.__wrapped__, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-9)
    verl_only, _, _ = loss_of(losses.ppo_loss.__wrapped__, False)
    assert float(metrics["ares_kl_loss"].values[0]) == pytest.approx(float(got - verl_only), rel=1e-4) and float(got - verl_only) > 0


def test_ares_state_is_saved_before_verl_marks_the_checkpoint_and_restored(ares_sync_trainer, monkeypatch):
    trainer, tq = ares_sync_trainer
    from verl.trainer.ppo.v1 import PPOTrainerSync

    trainer.global_steps = 2
    trainer._compute_advantage(_tq_batch(tq, 1), {})
    folder = os.path.join(trainer.config.trainer.default_local_dir, "global_step_2")
    seen = []
    monkeypatch.setattr(PPOTrainerSync, "_save_checkpoint", lambda self: seen.append(os.path.exists(os.path.join(folder, "ares_state.json"))))
    trainer._save_checkpoint()
    assert seen == [True]
    saved = trainer.ares.state_dict()
    trainer.global_steps = 3
    trainer._compute_advantage(_tq_batch(tq, 2), {})
    assert trainer.ares.state_dict() != saved

    def resume(self):
        self.global_steps = 2

    monkeypatch.setattr(PPOTrainerSync, "_load_checkpoint", resume)
    trainer._load_checkpoint()
    assert trainer.ares.state_dict() == saved
    os.remove(os.path.join(folder, "ares_state.json"))
    with pytest.raises(FileNotFoundError, match="no ares_state.json"):
        trainer._load_checkpoint()


def test_settings_that_cannot_run_are_refused_before_any_rollout():
    _verl_v1()
    from hydra import compose, initialize_config_module

    import ares.verl as av
    from ares.verl_v1 import AresSettingsError

    av.register()
    from verl.trainer.ppo.v1 import get_trainer_cls

    cases = [
        (["algorithm.use_kl_in_reward=true"], "would both charge the KL"),
        (["+ares.kl.enable=true"], "`ares.kl.placement: loss` charges the KL in the actor's loss"),
        (["+ares.kl.placement=reward"], "needs the reference log-probs"),
        (["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001"],
         "kl_loss_coef=0.001` would charge verl's own KL term"),
        (["+ares.klx=1"], "`ares.klx` is not an ares setting"),
    ]
    for overrides, match in cases:
        with initialize_config_module("verl.trainer.config", version_base=None):
            cfg = compose("ppo_trainer", overrides=["trainer.v1.trainer_mode=ares_sync", *overrides])
        with pytest.raises(AresSettingsError, match=match.replace(".", r"\.")):
            get_trainer_cls("ares_sync")(cfg)


def test_the_ares_reward_loop_manager_scores_for_ares_modes_only():
    _verl_v1()
    from hydra import compose, initialize_config_module

    import ares.verl as av

    av.register()
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

    cls = get_reward_manager_cls("ares")
    assert issubclass(cls, NaiveRewardManager)
    with initialize_config_module("verl.trainer.config", version_base=None):
        stock = compose("ppo_trainer", overrides=["reward.reward_manager.name=ares"])
        ours = compose("ppo_trainer", overrides=["reward.reward_manager.name=ares", "trainer.v1.trainer_mode=ares_sync"])
    with pytest.raises(ValueError, match="trainer.v1.trainer_mode is 'sync'"):
        cls(stock, None, None)
    assert cls(ours, None, None).compute_score is not None  # verl's default scoring, as `naive`


def test_names_and_settings_are_checked_with_verls_config_check():
    _verl_v1()
    from hydra import compose, initialize_config_module

    import ares.verl as av

    av.register()
    from verl.utils import config as verl_config

    from ares.verl_v1 import check_config

    assert verl_config.validate_config.__wrapped__ is not None
    cases = [
        (["algorithm.adv_estimator=ares_grpoo"], "`algorithm.adv_estimator=ares_grpoo` is not a name ares registers.*did you mean 'ares_grpo'"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=ares_vanila"], "did you mean 'ares_vanilla'"),
        (["reward.reward_manager.name=aress"], "did you mean 'ares'"),
        (["trainer.v1.trainer_mode=ares_synch"], "did you mean 'ares_sync'"),
        (["+ares.mode=ares"], "read by ares's trainer modes only"),
        (["trainer.v1.trainer_mode=ares_sync", "+ares.mode=dapo"], "`ares.mode`"),
        (["trainer.v1.trainer_mode=ares_sync"], "charges the KL in the actor's loss, which needs ref_log_prob"),
        (["trainer.v1.trainer_mode=ares_sync", "+ares.kl.placement=reward"], "needs the reference log-probs"),
    ]
    for overrides, match in cases:
        with initialize_config_module("verl.trainer.config", version_base=None):
            cfg = compose("ppo_trainer", overrides=overrides)
        with pytest.raises(ValueError, match=match):
            verl_config.validate_config(cfg, use_reference_policy=False, use_critic=False)
    with initialize_config_module("verl.trainer.config", version_base=None):
        fine = compose("ppo_trainer", overrides=[
            "trainer.v1.trainer_mode=ares_sync", "algorithm.adv_estimator=ares_grpo", "reward.reward_manager.name=ares",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0",
        ])
    check_config(fine)  # verl's own checks need model paths etc.; ares's pass


def test_multi_turn_sessions_are_shaped_on_their_final_output(ares_sync_trainer):
    """Sessions with several outputs (turns): the ARES step sees each session's final output;
    the earlier outputs get the session's outcome on their last valid token, and KL weights of
    their own."""
    trainer, tq = ares_sync_trainer
    trainer.global_steps = 4
    batch = _tq_batch(tq, 9, prompts=4, turns=lambda p, s: 1 + (p + s) % 2, prefix="mt")
    keys = batch.keys
    before = _padded(tq, batch, ["uid", "index", "response_mask", "rm_scores", "entropy", "old_log_probs", "ref_log_prob"])
    reference = AresStep(trainer.ares.settings)
    reference.load_state_dict(trainer.ares.state_dict())
    trainer._compute_advantage(batch, {})
    after = _padded(tq, batch, ["rm_scores", "advantages"])
    final, to_final = final_session_rows(keys)
    fr = np.asarray(final)
    token, _, weights, beta, tau = reference(
        before["rm_scores"][fr].sum(1).astype(np.float64), before["response_mask"][fr],
        np.array(before["uid"], dtype=object)[fr], entropies=before["entropy"][fr],
        difficulty_ids=np.array([str(i) for i in before["index"]], dtype=object)[fr],
        old_log_probs=before["old_log_probs"][fr], ref_log_probs=before["ref_log_prob"][fr], step=4,
    )
    last = last_valid(before["response_mask"])
    for row, f in enumerate(to_final):
        if row == final[f]:
            np.testing.assert_allclose(after["rm_scores"][row], token[f], rtol=1e-6, atol=1e-7)
        else:
            want = np.zeros_like(after["rm_scores"][row])
            want[last[row]] = token[f].sum()
            np.testing.assert_allclose(after["rm_scores"][row], want, rtol=1e-6, atol=1e-7)
    assert trainer.ares.state_dict() == reference.state_dict()
    # every output's tokens carry KL weights for the actor's loss: the session's β, its own HWE tokens
    got = _padded(tq, batch, ["ares_kl_weights"])["ares_kl_weights"]
    for row, f in enumerate(to_final):
        m = before["response_mask"][row : row + 1]
        hwe = reference.hwe_mask(before["entropy"][row : row + 1], m, tau)
        want = weights[f] if row == final[f] else reference.kl_weights(beta[f : f + 1], m, hwe)[0]
        np.testing.assert_array_equal(got[row], want)
        assert (got[row][m[0] > 0] > 0).all() == (beta[f] > 0)  # dual ascent may have driven a λ_d to 0
    assert got.any()
    # and every output of a session carries the advantage of its final output (verl's grpo path)
    adv_final = after["advantages"][fr, 0]
    for row, f in enumerate(to_final):
        np.testing.assert_allclose(after["advantages"][row][before["response_mask"][row] > 0], adv_final[f], rtol=1e-6)


def test_resume_from_a_named_checkpoint_folder(ares_sync_trainer, monkeypatch, tmp_path):
    trainer, tq = ares_sync_trainer
    from omegaconf import open_dict
    from verl.trainer.ppo.v1 import PPOTrainerSync

    from ares.verl_v1 import _write_state

    folder = tmp_path / "elsewhere" / "global_step_7"
    saved = AresStep(trainer.ares.settings)
    run(saved, batch(11), step=1)
    _write_state(str(folder), {"global_steps": 7, **saved.state_dict()})
    with open_dict(trainer.config):
        trainer.config.trainer.resume_mode = "resume_path"
        trainer.config.trainer.resume_from_path = str(folder)

    def resume(self):
        self.global_steps = 7

    monkeypatch.setattr(PPOTrainerSync, "_load_checkpoint", resume)
    try:
        trainer._load_checkpoint()
        assert trainer.ares.state_dict() == saved.state_dict()
    finally:
        with open_dict(trainer.config):
            trainer.config.trainer.resume_mode = "auto"


def test_dr_grpo_flag_reaches_ares_grpo_without_a_config():
    _verl_v1()
    import torch
    from verl import DataProto
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    import ares.verl as av

    av.register()
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(8, 5)
    rewards = torch.zeros(8, 5)
    rewards[:, -1] = torch.rand(8, generator=g)
    uid = np.array([f"p{i // 4}" for i in range(8)], dtype=object)

    def adv(estimator, norm):
        d = DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(), "response_mask": mask.clone()})
        d.non_tensor_batch["uid"] = uid
        return ray_trainer.compute_advantage(d, estimator, norm_adv_by_std_in_grpo=norm).batch["advantages"]

    for norm in (True, False):
        torch.testing.assert_close(adv("ares_grpo", norm), adv(AdvantageEstimator.GRPO, norm), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(adv("ares_grpo", True), adv("ares_grpo", False))
