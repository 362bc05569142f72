"""ares.verl against verl 0.9.1's own functions, on random CPU inputs (float32; runs where torch
and verl import, e.g. /work/verl-venv; CI's venv has neither and skips this file)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")

from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos as ca  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

import ares  # noqa: E402
import ares.verl as av  # noqa: E402

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TOL = dict(rtol=1e-6, atol=1e-6)  # float32


@pytest.fixture(scope="module", autouse=True)
def registered():
    names = av.register()
    yield names
    av.register()  # back to the default settings


def batch(seed, groups=16, n=4, t=48):
    """verl-shaped float32 inputs: outcome reward on the last valid token, uid strings in
    shuffled order, responses of 1..t tokens (one row padded to full length)."""
    g = torch.Generator().manual_seed(seed)
    b = groups * n
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    scores = torch.randint(0, 2, (b,), generator=g).float() + 0.25 * torch.rand(b, generator=g)
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = scores
    perm = np.random.default_rng(seed).permutation(b)
    index = np.array([f"prompt-{i // n}" for i in perm], dtype=object)
    old = -torch.rand(b, t, generator=g) * 3
    logp = old + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g) * mask
    weights = torch.rand(b, t, generator=g) * 2
    return dict(rewards=rewards, mask=mask, index=index, old=old, logp=logp, adv=adv, weights=weights)


def close(a, b, what):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), err_msg=what, **TOL)


# ---------------------------------------------------------------- registration


def test_registered_in_verls_registries(registered):
    assert registered["adv_estimators"] == list(av.ESTIMATORS)
    for name in av.ESTIMATORS:
        assert ca.get_adv_estimator_fn(name) is getattr(av, name)
    for name in av.POLICY_LOSSES:
        assert ca.get_policy_loss_fn(name) is getattr(av, name)
    av.register()  # idempotent: verl refuses a second, different function under a name
    assert ca.get_adv_estimator_fn("ares_grpo") is av.ares_grpo


def test_plugin_module_registers(monkeypatch):
    import importlib
    import sys

    monkeypatch.setenv("ARES_GRPO_LAMBDA", "0.5")
    sys.modules.pop("ares.verl_plugin", None)
    importlib.import_module("ares.verl_plugin")
    assert av.settings()["grpo_lambda"] == 0.5
    av.register()


# ---------------------------------------------------------------- advantage estimators


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_equals_verl(seed, norm):
    d = batch(seed)
    want, want_ret = ca.compute_grpo_outcome_advantage(
        d["rewards"].clone(), d["mask"], d["index"], norm_adv_by_std_in_grpo=norm
    )
    got, got_ret = av.ares_grpo(d["rewards"], d["mask"], d["index"], norm_adv_by_std_in_grpo=norm)
    assert got.shape == want.shape and got.dtype == torch.float32
    close(got, want, "ares_grpo")
    close(got_ret, want_ret, "ares_grpo returns")
    # the way verl's trainer calls a registered estimator: keywords, the flag in the AlgoConfig
    fn = ca.get_adv_estimator_fn("ares_grpo")
    cfg = AlgoConfig(norm_adv_by_std_in_grpo=norm)
    got2, _ = fn(token_level_rewards=d["rewards"], response_mask=d["mask"], config=cfg, index=d["index"])
    close(got2, want, "ares_grpo via the registry")


@pytest.mark.parametrize("seed", [0, 1])
def test_rloo_equals_verl(seed):
    d = batch(seed, n=5)
    want, _ = ca.compute_rloo_outcome_advantage(d["rewards"].clone(), d["mask"], d["index"], config=AlgoConfig())
    got, got_ret = av.ares_rloo(d["rewards"], d["mask"], index=d["index"], config=AlgoConfig())
    assert got.shape == want.shape and got.dtype == torch.float32
    close(got, want, "ares_rloo")
    close(got_ret, want, "ares_rloo returns")


def test_grpo_wrong_result_is_caught():
    # the comparison is tight enough to see a one-sample change in the groups
    d = batch(3)
    want, _ = ca.compute_grpo_outcome_advantage(d["rewards"].clone(), d["mask"], d["index"])
    index = d["index"].copy()
    index[[0, 1]] = index[[1, 0]] if index[0] != index[1] else index[[0, 2]]
    got, _ = av.ares_grpo(d["rewards"], d["mask"], index)
    with pytest.raises(AssertionError):
        close(got, want, "swapped uids")


def test_pro_max_is_ares_reinforce_pro_max():
    # verl 0.9.1 has no Pro Max: the adapter's plumbing against the direct call
    d = batch(4)
    got, ret = av.ares_reinforce_pro_max(d["rewards"], d["mask"], index=d["index"], config=AlgoConfig())
    want = ares.reinforce_pro_max(d["rewards"].sum(-1).numpy(), d["mask"].numpy(), uid=d["index"])
    assert got.shape == d["mask"].shape and got.dtype == torch.float32 and ret is got
    close(got, want, "ares_reinforce_pro_max")


def test_grpo_lambda_is_lambda_rewards_then_grpo():
    d = batch(5)
    av.register(grpo_lambda=0.5, grpo_lambda_alpha=0.4)
    try:
        got, _ = av.ares_grpo_lambda(d["rewards"], d["mask"], index=d["index"], config=AlgoConfig())
    finally:
        av.register()
    scores = d["rewards"].sum(-1)
    lengths = d["mask"].sum(-1).numpy()
    lam = ares.grpo_lambda_rewards((scores > 0.5).numpy(), lengths, uid=d["index"], lambda_=0.5, alpha=0.4)
    assert lam["top_count"] == 8
    want, _ = ca.compute_grpo_outcome_advantage(
        torch.from_numpy(lam["rewards"])[:, None] * torch.nn.functional.one_hot(
            d["mask"].sum(-1).long() - 1, d["mask"].shape[1]
        ).float(),
        d["mask"],
        d["index"],
    )
    close(got, want, "ares_grpo_lambda")


def test_estimator_errors():
    d = batch(0)
    with pytest.raises(ValueError, match="index"):
        av.ares_grpo(d["rewards"], d["mask"], None)
    with pytest.raises(ValueError, match="meta"):
        av.ares_grpo(d["rewards"].to("meta"), d["mask"], d["index"])
    with pytest.raises(ValueError, match="copy_to_cpu"):
        av.ares_rloo(d["rewards"], d["mask"].to("meta"), index=d["index"])


# ---------------------------------------------------------------- policy losses


def actor_config(**kw):
    base = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2, clip_ratio_high=0.28)
    base.update(kw)
    return ActorConfig(**base)


def f64(d):
    """float64 copies of the tensors of `d` (or of one tensor; None stays None)."""
    if d is None or torch.is_tensor(d):
        return None if d is None else d.double()
    return {k: (v.double() if torch.is_tensor(v) else v) for k, v in d.items()}


def run_loss(fn, d, mode, cfg, weights, mask=None):
    logp = d["logp"].clone().requires_grad_(True)
    loss, metrics = fn(
        old_log_prob=d["old"],
        log_prob=logp,
        advantages=d["adv"],
        response_mask=d["mask"] if mask is None else mask,
        loss_agg_mode=mode,
        config=cfg,
        rollout_is_weights=weights,
    )
    loss.backward()
    return loss.detach(), logp.grad, metrics


PAIRS = [("ares_vanilla", "vanilla"), ("ares_gspo", "gspo"), ("ares_cispo", "cispo")]


@pytest.mark.parametrize("ours,theirs", PAIRS)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_policy_loss_equals_verl(ours, theirs, mode, weighted):
    d = batch(10)
    cfg = actor_config()
    w = d["weights"] if weighted else None
    # the reference: verl's function in float64 on the same (float32) values, so float32
    # summation order in verl's token sums does not count against ares
    want_loss, want_grad, want_m = run_loss(ca.get_policy_loss_fn(theirs), f64(d), mode, cfg, f64(w))
    got_loss, got_grad, got_m = run_loss(ca.get_policy_loss_fn(ours), d, mode, cfg, w)
    assert got_loss.shape == () and got_loss.dtype == torch.float32
    if mode == "token-sum":  # a float32 sum of ~1,500 terms of size ~3: float32's own rounding
        np.testing.assert_allclose(got_loss.double(), want_loss, rtol=1e-5, err_msg=f"{ours} {mode} loss")
    else:
        close(got_loss, want_loss, f"{ours} {mode} loss")
    close(got_grad, want_grad, f"{ours} {mode} grad")
    assert set(got_m) == set(want_m)
    for k in want_m:
        close(got_m[k], want_m[k], f"{ours} {mode} {k}")
    if ours == "ares_vanilla" and not weighted:
        assert want_m["actor/pg_clipfrac"] > 0.05  # the clip is live


@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_global_batch_info_equals_verl(mode):
    # a data-parallel micro-batch: dp 4, global token / row counts, a constant loss_scale_factor
    d = batch(11)
    info = dict(dp_size=4, batch_num_tokens=9000, global_batch_size=700, loss_scale_factor=512)
    cfg = actor_config()
    cfg.global_batch_info.update(info)
    want_loss, want_grad, _ = run_loss(ca.get_policy_loss_fn("vanilla"), f64(d), mode, cfg, None)
    got_loss, got_grad, _ = run_loss(av.ares_vanilla, d, mode, cfg, None)
    close(got_loss, want_loss, f"{mode} loss")
    close(got_grad, want_grad, f"{mode} grad")


def test_policy_loss_bool_mask_and_dual_clip_config():
    d = batch(12)
    cfg = actor_config(clip_ratio_c=2.0, clip_ratio_low=0.1, clip_ratio_high=0.1)
    want_loss, want_grad, want_m = run_loss(ca.compute_policy_loss_vanilla, d, "token-mean", cfg, None)
    got_loss, got_grad, got_m = run_loss(av.ares_vanilla, d, "token-mean", cfg, None, mask=d["mask"].bool())
    close(got_loss, want_loss, "loss")
    close(got_grad, want_grad, "grad")
    close(got_m["actor/pg_clipfrac_lower"], want_m["actor/pg_clipfrac_lower"], "clipfrac_lower")
    assert want_m["actor/pg_clipfrac_lower"] > 0  # the dual clip is live


def test_policy_loss_wrong_result_is_caught():
    d = batch(13)
    cfg = actor_config()
    want_loss, want_grad, _ = run_loss(ca.compute_policy_loss_vanilla, d, "token-mean", cfg, None)
    got_loss, got_grad, _ = run_loss(av.ares_vanilla, d, "token-mean", actor_config(clip_ratio_high=0.27), None)
    with pytest.raises(AssertionError):
        close(got_grad, want_grad, "other clip")


def test_policy_loss_float64_and_empty_mask():
    d = {k: (v.double() if torch.is_tensor(v) else v) for k, v in batch(14).items()}
    cfg = actor_config()
    want_loss, want_grad, _ = run_loss(ca.compute_policy_loss_vanilla, d, "seq-mean-token-mean", cfg, None)
    got_loss, got_grad, _ = run_loss(av.ares_vanilla, d, "seq-mean-token-mean", cfg, None)
    assert got_loss.dtype == torch.float64 and got_grad.dtype == torch.float64
    # verl divides each row by (n_r + 1e-8): a relative 1e-8 / n_r that float64 shows
    np.testing.assert_allclose(got_loss.numpy(), want_loss.numpy(), rtol=1e-7, atol=1e-12)
    np.testing.assert_allclose(got_grad.numpy(), want_grad.numpy(), rtol=1e-7, atol=1e-12)
    loss, grad, metrics = run_loss(av.ares_vanilla, d, "token-mean", cfg, None, mask=torch.zeros_like(d["mask"]))
    assert loss.item() == 0.0 and grad.abs().max().item() == 0.0 and metrics["actor/ppo_kl"] == 0.0


def test_policy_loss_refusals():
    d = batch(15)
    cfg = actor_config()
    with pytest.raises(ValueError, match="rollout_is_weights"):
        run_loss(av.ares_kl_cov, d, "token-mean", cfg, d["weights"])
    meta = dict(d, logp=d["logp"].to("meta"))
    with pytest.raises(ValueError, match="copy_to_cpu"):
        run_loss(av.ares_vanilla, meta, "token-mean", cfg, None)


def test_gspo_seq_equals_gspo_token_for_row_constant_advantages():
    # docs/algorithms.md §12.1: with one advantage per row and seq-mean-token-mean the paper's
    # sequence-level GSPO and verl's GSPO-token agree in value and gradient
    d = batch(16)
    d["adv"] = torch.randn(d["mask"].shape[0], 1) * d["mask"]
    cfg = actor_config()
    want_loss, want_grad, _ = run_loss(ca.get_policy_loss_fn("gspo"), f64(d), "seq-mean-token-mean", cfg, None)
    got_loss, got_grad, _ = run_loss(av.ares_gspo_seq, d, "seq-mean-token-mean", cfg, None)
    close(got_loss, want_loss, "loss")
    close(got_grad, want_grad, "grad")
