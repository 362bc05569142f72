#!/usr/bin/env python3
"""Record verl 0.9.1's own outputs for the calls ``ares.verl`` (the adapter) replaces, into small
``.npz`` files under ``ares-py/tests/fixtures/``; ``ares-py/tests/test_verl_fixtures.py`` checks
the adapter's numpy paths against them with numpy + ares only (no torch, no verl).

The root fixture (``tests/fixtures/verl_0_9_1.json``, ``scripts/make_verl_fixtures.py``) covers
ares-core's math in float64 on contiguous groups. This one covers what the adapter adds on top,
with the inputs verl hands a registered function in a real run: float32 tensors, ``uid`` strings
in shuffled order with groups of different sizes, ``rollout_is_weights``, a data-parallel
``global_batch_info``, an ``ActorConfig`` with asymmetric clips and a live dual clip.

Every expected value comes from calling verl (and torch autograd on verl's output); nothing of
verl is re-implemented here. One exception, said where it happens: the GRPO-λ rewards are ares's
(verl has no GRPO-λ); the fixture stores them so the test can tie them to the GRPO that verl
computes on them.

Environment: /work/verl-venv (torch 2.15 CPU, verl 0.9.1, numpy; the ares wheel installed for
the GRPO-λ rewards). Run from the repository root:

    /work/verl-venv/bin/python scripts/make_verl_adapter_fixtures.py

Deterministic (torch.Generator / numpy Generator with fixed seeds, CPU). Files:

* ``verl_adapter_estimators.npz``: inputs ``rewards`` [B, T] float32 (each row's score on its
  last valid token), ``mask`` [B, T] float32, ``uid`` [B] (str); outputs of
  ``compute_grpo_outcome_advantage`` (``grpo_norm``: norm_adv_by_std_in_grpo=True, ``grpo_nonorm``:
  False; epsilon 1e-6) and ``compute_rloo_outcome_advantage`` (``rloo``), verl in float32 as in
  a run. ``lambda_rewards`` (ares: GRPO-λ with λ 0.5, α 0.4, correct = score > 0.5) and
  ``grpo_lambda``: verl's GRPO over those rewards placed on each row's last valid token.
* ``verl_adapter_losses.npz``: inputs ``old``, ``logp``, ``adv``, ``mask``, ``weights`` [B, T]
  float32; one entry per case, named ``case[k]`` = ``<loss>|<agg>|<variant>``: ``loss[k]``,
  ``grad[k]`` [B, T] (d loss / d log_prob by autograd, stored as float32), ``metrics[k]``
  (verl's values, in ``metric_names`` order, NaN where verl gives none). verl runs in float64
  on the float32 values (the reference: float32 summation order in verl's sums is not
  ares's); ares is checked in float32 against it.
  Variants: ``plain``, ``is`` (rollout_is_weights), ``dp`` (global_batch_info dp_size 4,
  batch_num_tokens 700, global_batch_size 60, loss_scale_factor 32), and for clip_cov /
  kl_cov ``cov`` (config chosen so verl's pick is deterministic: clip_cov keeps every candidate,
  kl_cov has no tie at the top-k boundary). Ratios are kept >= 1e-4 away from every clip bound.
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos as ca
from verl.workers.config import ActorConfig, PolicyLossConfig

OUT = pathlib.Path(__file__).resolve().parents[1] / "ares-py" / "tests" / "fixtures"
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
METRICS = ["actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"]
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
DP_INFO = dict(dp_size=4, batch_num_tokens=700, global_batch_size=60, loss_scale_factor=32)


def layout(seed: int, sizes: list[int], t: int):
    """Rows of groups of `sizes`, interleaved by a shuffle; responses of 1..t tokens."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    uid = np.array([f"prompt-{k}" for k, s in enumerate(sizes) for _ in range(s)], dtype=object)
    uid = uid[rng.permutation(len(uid))]
    b = len(uid)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    return g, uid, lengths, mask


def estimators():
    sizes = [4, 3, 5, 2, 4, 2]
    g, uid, lengths, mask = layout(7, sizes, 12)
    b, t = mask.shape
    scores = torch.randint(0, 2, (b,), generator=g).float() + 0.25 * torch.rand(b, generator=g)
    # one group with equal scores (exact mean): both give 0
    scores[torch.from_numpy(uid == "prompt-3")] = 1.0
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = scores
    out = dict(rewards=rewards.numpy(), mask=mask.numpy(), uid=uid.astype(str))
    for key, norm in [("grpo_norm", True), ("grpo_nonorm", False)]:
        adv, ret = ca.compute_grpo_outcome_advantage(rewards.clone(), mask, uid, epsilon=1e-6, norm_adv_by_std_in_grpo=norm)
        assert adv.dtype == torch.float32 and torch.equal(adv, ret)
        out[key] = adv.numpy()
    adv, _ = ca.compute_rloo_outcome_advantage(rewards.clone(), mask, uid, config=AlgoConfig())
    out["rloo"] = adv.numpy()

    # GRPO-λ: the rewards are ares's (verl has none), the GRPO after them verl's
    import ares

    lam = ares.grpo_lambda_rewards(
        (scores > 0.5).numpy(), mask.sum(-1).numpy(), uid=uid, lambda_=0.5, alpha=0.4
    )["rewards"]
    lam_tok = torch.zeros(b, t)
    lam_tok[torch.arange(b), lengths - 1] = torch.from_numpy(lam)
    adv, _ = ca.compute_grpo_outcome_advantage(lam_tok, mask, uid, epsilon=1e-6, norm_adv_by_std_in_grpo=True)
    out["lambda_rewards"] = lam
    out["grpo_lambda"] = adv.numpy()
    return out


def loss_inputs():
    """Seeds are tried until every ratio (token and GSPO sequence) sits >= 1e-4 away from the
    clip bounds and the dual clip is live."""
    bounds = torch.tensor([1 - CLIP_LOW, 1 + CLIP_HIGH, CLIP_C], dtype=torch.float64)
    for seed in range(100, 200):
        g, uid, lengths, mask = layout(seed, [4, 4, 3, 5], 10)
        b, t = mask.shape
        old = -torch.rand(b, t, generator=g) * 3
        logp = old + 0.5 * torch.randn(b, t, generator=g)
        adv = torch.randn(b, t, generator=g) * mask
        weights = torch.rand(b, t, generator=g) * 2
        d = logp.double() - old.double()
        seq = (d * mask).sum(-1) / mask.sum(-1)
        ratios = torch.cat([d.exp()[mask > 0], seq.exp()])
        if (ratios[:, None] - bounds).abs().min() < 1e-4:
            continue
        dual = ((d.exp() > CLIP_C) & (adv < 0) & (mask > 0)).sum()
        if dual < 2:
            continue
        return dict(old=old, logp=logp, adv=adv, mask=mask, weights=weights)
    raise RuntimeError("no seed fits")


def actor_config(**kw):
    base = dict(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        clip_ratio_c=CLIP_C,
    )
    base.update(kw)
    return ActorConfig(**base)


def run(name, d, agg, cfg, weights):
    f64 = {k: v.double() for k, v in d.items()}
    logp = f64["logp"].clone().requires_grad_(True)
    loss, metrics = ca.get_policy_loss_fn(name)(
        old_log_prob=f64["old"],
        log_prob=logp,
        advantages=f64["adv"],
        response_mask=f64["mask"],
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=None if weights is None else weights.double(),
    )
    loss.backward()
    m = np.array([metrics.get(k, np.nan) for k in METRICS], dtype=np.float64)
    # the gradient is stored rounded to float32 (the size of the file; 6e-8 relative)
    return loss.detach().numpy(), logp.grad.numpy().astype(np.float32), m


def losses():
    d = loss_inputs()
    out = {k: v.numpy() for k, v in d.items()}
    out["metric_names"] = np.array(METRICS)
    cases = []
    for name in ["vanilla", "gspo", "cispo"]:
        for agg in AGG_MODES:
            for variant in ["plain", "is"]:
                w = d["weights"] if variant == "is" else None
                loss, grad, m = run(name, d, agg, actor_config(), w)
                cases.append((f"{name}|{agg}|{variant}", loss, grad, m))
    for agg in AGG_MODES:
        cfg = actor_config()
        cfg.global_batch_info.update(DP_INFO)
        loss, grad, m = run("vanilla", d, agg, cfg, None)
        cases.append((f"vanilla|{agg}|dp", loss, grad, m))
    out["dp_info"] = np.array([DP_INFO[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")])

    # Clip-Cov: a ratio large enough that clip_num >= the number of candidates (verl then keeps
    # them all, in randperm order, which does not matter); KL-Cov: top-k without boundary ties
    n_valid = int(d["mask"].sum())
    cov_cfg = dict(clip_cov_ratio=0.5, clip_cov_lb=0.2, clip_cov_ub=3.0, kl_cov_ratio=0.1, ppo_kl_coef=0.5)
    out["cov_params"] = np.array([cov_cfg[k] for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")])
    for name in ["clip_cov", "kl_cov"]:
        for agg in ["token-mean", "seq-mean-token-mean"]:
            cfg = actor_config(policy_loss=PolicyLossConfig(loss_mode=name, **cov_cfg))
            loss, grad, m = run(name, d, agg, cfg, None)
            cases.append((f"{name}|{agg}|cov", loss, grad, m))
    # the picks are deterministic on this input: count candidates as verl does
    f = {k: v.double() for k, v in d.items()}
    ratio = (f["logp"] - f["old"]).exp()
    l1 = -f["adv"] * ratio
    l2 = -f["adv"] * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
    m = f["mask"] > 0
    cov = (f["adv"] - f["adv"][m].mean()) * (f["logp"] - f["logp"][m].mean())
    cand = ((cov > cov_cfg["clip_cov_lb"]) & (cov < cov_cfg["clip_cov_ub"]) & m & ~(l2 > l1)).sum().item()
    assert 0 < cand <= max(int(cov_cfg["clip_cov_ratio"] * n_valid), 1), cand
    k = max(1, int(n_valid * cov_cfg["kl_cov_ratio"]))
    top = torch.sort(cov[m], descending=True).values
    assert (top[k - 1] - top[k]).abs() > 1e-6
    out["case"] = np.array([c[0] for c in cases])
    out["loss"] = np.array([c[1] for c in cases], dtype=np.float64)
    out["grad"] = np.stack([c[2] for c in cases])
    out["metrics"] = np.stack([c[3] for c in cases])
    out["clip_cov_candidates"] = np.array(cand)
    out["kl_cov_k"] = np.array(k)
    return out


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    est = estimators()
    np.savez_compressed(OUT / "verl_adapter_estimators.npz", **est)
    los = losses()
    np.savez_compressed(OUT / "verl_adapter_losses.npz", **los)
    for f in sorted(OUT.glob("verl_adapter_*.npz")):
        print(f"{f.relative_to(OUT.parents[2])}: {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
