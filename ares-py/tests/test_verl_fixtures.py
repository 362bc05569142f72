"""ares.verl's numpy cores against verl 0.9.1's own outputs, from committed fixtures
(``tests/fixtures/verl_adapter_*.npz``, written by ``scripts/make_verl_adapter_fixtures.py``).
Needs numpy and ares only: CI runs it. The cores are what the registered torch functions call
once their tensors are host arrays, with the same arguments (test_verl.py checks the torch side
live where torch and verl are installed)."""

import pathlib

import numpy as np
import pytest

import ares
import ares.verl as av

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TOL = dict(rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def est():
    with np.load(FIXTURES / "verl_adapter_estimators.npz") as f:
        return dict(f)


@pytest.fixture(scope="module")
def los():
    with np.load(FIXTURES / "verl_adapter_losses.npz") as f:
        d = dict(f)
    d["cases"] = {str(c): k for k, c in enumerate(d["case"])}
    return d


@pytest.fixture(autouse=True)
def default_settings():
    # register() imports verl, which CI lacks: the tests set the settings directly and restore them
    saved = av.settings()
    yield
    av._SETTINGS.update(saved)


def close(got, want, what, **tol):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), err_msg=what, **(tol or TOL))


def scores_of(est):
    # verl's token_level_rewards.sum(-1): one non-zero per row, so the float32 sum is exact
    return est["rewards"].sum(axis=-1)


# ---------------------------------------------------------------- estimators


def test_fixture_shapes(est):
    b, t = est["rewards"].shape
    assert est["rewards"].dtype == np.float32 and est["mask"].dtype == np.float32
    assert est["uid"].shape == (b,) and len(set(est["uid"])) == 6  # ragged groups, shuffled
    sizes = sorted(np.unique(est["uid"], return_counts=True)[1])
    assert sizes[0] == 2 and sizes[-1] == 5


@pytest.mark.parametrize("key,norm", [("grpo_norm", True), ("grpo_nonorm", False)])
def test_grpo_core_equals_verl(est, key, norm):
    got = av._grpo_np(scores_of(est), est["mask"], est["uid"], 1e-6, norm)
    assert got.dtype == np.float32 and got.shape == est["mask"].shape
    close(got, est[key], key)


def test_grpo_equal_group_is_zero_in_both(est):
    rows = est["uid"] == "prompt-3"
    assert np.all(est["grpo_norm"][rows] == 0.0)
    got = av._grpo_np(scores_of(est), est["mask"], est["uid"])
    assert np.all(got[rows] == 0.0)


def test_rloo_core_equals_verl(est):
    got = av._rloo_np(scores_of(est), est["mask"], est["uid"])
    assert got.dtype == np.float32
    close(got, est["rloo"], "rloo")


def test_grpo_lambda_core_equals_verl_grpo_on_lambda_rewards(est):
    # the λ rewards are ares's (verl has no GRPO-λ); the GRPO over them is verl's
    av._SETTINGS.update(grpo_lambda=0.5, grpo_lambda_alpha=0.4, correct_threshold=0.5)
    scores = scores_of(est)
    lam = ares.grpo_lambda_rewards(scores > 0.5, est["mask"].sum(-1), uid=est["uid"], lambda_=0.5, alpha=0.4)
    close(lam["rewards"], est["lambda_rewards"], "lambda rewards", rtol=0, atol=0)
    got = av._grpo_lambda_np(scores, est["mask"], est["uid"])
    close(got, est["grpo_lambda"], "grpo_lambda")


def test_estimator_fixture_catches_a_wrong_result(est):
    uid = est["uid"].copy()
    i, j = 0, int(np.flatnonzero(uid != uid[0])[0])
    uid[[i, j]] = uid[[j, i]]
    with pytest.raises(AssertionError):
        close(av._grpo_np(scores_of(est), est["mask"], uid), est["grpo_norm"], "swapped uids")
    with pytest.raises(AssertionError):
        close(av._grpo_np(scores_of(est), est["mask"], est["uid"], 1e-6, False), est["grpo_norm"], "no std")


# ---------------------------------------------------------------- policy losses


def config(los, variant, loss):
    """The ActorConfig values the generator used, as a dict (the core reads either)."""
    cfg = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "global_batch_info": {}}
    if variant == "dp":
        keys = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
        cfg["global_batch_info"] = {k: int(v) for k, v in zip(keys, los["dp_info"])}
    if variant == "cov":
        keys = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
        cfg["policy_loss"] = {"loss_mode": loss, **{k: float(v) for k, v in zip(keys, los["cov_params"])}}
    return cfg


def run_case(los, name, agg, variant, **override):
    k = los["cases"][f"{name}|{agg}|{variant}"]
    registered = {"gspo": "ares_gspo"}.get(name, f"ares_{name}")
    inputs = {key: override.get(key, los[key]) for key in ("old", "logp", "adv", "mask", "weights")}
    cfg = override.get("config", config(los, variant, name))
    weights = inputs["weights"] if variant == "is" else None
    res = av._policy_loss_np(
        registered, inputs["old"], inputs["logp"], inputs["adv"], inputs["mask"], agg, cfg, weights
    )
    return res, k


PLAIN = [(n, a, v) for n in ("vanilla", "gspo", "cispo") for a in AGG_MODES for v in ("plain", "is")]


@pytest.mark.parametrize("name,agg,variant", PLAIN + [("vanilla", a, "dp") for a in AGG_MODES])
def test_policy_loss_core_equals_verl(los, name, agg, variant):
    (loss, grad, metrics), k = run_case(los, name, agg, variant)
    assert grad.dtype == np.float32 and grad.shape == los["mask"].shape
    want_loss = los["loss"][k]
    if agg == "token-sum" or variant == "dp":  # a float32 sum of ~100 terms against verl's float64
        close(loss, want_loss, f"{name} {agg} {variant} loss", rtol=2e-6, atol=1e-6)
    else:
        close(loss, want_loss, f"{name} {agg} {variant} loss")
    close(grad, los["grad"][k], f"{name} {agg} {variant} grad")
    for i, key in enumerate(los["metric_names"]):
        want = los["metrics"][k][i]
        if not np.isnan(want):
            close(metrics[str(key)], want, f"{name} {agg} {variant} {key}")
    if name == "vanilla" and variant == "plain":
        assert los["metrics"][k][0] > 0.05 and los["metrics"][k][2] > 0  # clip and dual clip live


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_cov_losses_core_equal_verl(los, name, agg):
    (loss, grad, metrics), k = run_case(los, name, agg, "cov")
    close(loss, los["loss"][k], f"{name} {agg} loss")
    close(grad, los["grad"][k], f"{name} {agg} grad")
    # docs/algorithms.md §15: the adapter's pg_clipfrac is PPO's clip fraction; verl's Clip-Cov
    # reports the selected fraction there (ares: selected_frac), and verl's KL-Cov's ppo_kl is
    # the mean |log-ratio|. The documented relations, on ares's full output:
    mask = los["mask"].astype(np.float32)
    cfg = config(los, "cov", name)
    pl = cfg["policy_loss"]
    out = ares.policy_loss(
        los["logp"], los["old"], los["adv"], mask, loss_mode=name, loss_agg_mode=agg,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
        clip_cov_ratio=pl["clip_cov_ratio"], clip_cov_lb=pl["clip_cov_lb"], clip_cov_ub=pl["clip_cov_ub"],
        kl_cov_ratio=pl["kl_cov_ratio"], ppo_kl_coef=pl["ppo_kl_coef"],
    )
    n_valid = float(mask.sum())
    if name == "clip_cov":
        assert round(out["selected_frac"] * n_valid) == int(los["clip_cov_candidates"])
        close(out["selected_frac"], los["metrics"][k][0], "verl's pg_clipfrac = ares's selected_frac")
    else:
        assert round(out["selected_frac"] * n_valid) == int(los["kl_cov_k"])
        assert metrics["actor/pg_clipfrac"] == 0.0
        # a difference §15 does not list: verl's KL-Cov reports ppo_kl = mean |log ratio|, the
        # adapter reports ares's approx_kl = mean(old − new) as for every other loss
        assert metrics["actor/ppo_kl"] == pytest.approx(out["approx_kl"], rel=1e-6)
        abs_kl = float(np.abs(los["logp"].astype(np.float64) - los["old"])[mask > 0].mean())
        close(abs_kl, los["metrics"][k][1], "verl's KL-Cov ppo_kl = mean |log ratio|")
        assert abs(metrics["actor/ppo_kl"] - abs_kl) > 1e-3


def test_loss_fixture_catches_a_wrong_result(los):
    (loss, grad, _), k = run_case(los, "vanilla", "token-mean", "plain")
    cfg = config(los, "plain", "vanilla")
    cfg["clip_ratio_high"] = 0.2
    (_, grad2, _), _ = run_case(los, "vanilla", "token-mean", "plain", config=cfg)
    with pytest.raises(AssertionError):
        close(grad2, los["grad"][k], "other clip")
    # weights dropped
    (loss3, _, _), k3 = run_case(los, "vanilla", "token-mean", "is", weights=np.ones_like(los["weights"]))
    with pytest.raises(AssertionError):
        close(loss3, los["loss"][k3], "no weights")
    # the dp scaling dropped
    (loss4, _, _), k4 = run_case(los, "vanilla", "seq-mean-token-sum-norm", "dp", config=config(los, "plain", "vanilla"))
    with pytest.raises(AssertionError):
        close(loss4, los["loss"][k4], "no dp info")


def test_empty_mask_and_refusals(los):
    zero = np.zeros_like(los["mask"])
    assert av._policy_loss_np("ares_vanilla", los["old"], los["logp"], los["adv"], zero) is None
    with pytest.raises(ValueError, match="rollout_is_weights"):
        av._policy_loss_np("ares_kl_cov", los["old"], los["logp"], los["adv"], los["mask"], weights=los["weights"])
    with pytest.raises(ValueError, match="batch_num_tokens is required"):
        av._agg_scale(los["mask"], "token-mean", {"dp_size": 2})
