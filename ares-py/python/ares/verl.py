"""verl 0.9 registrations: ARES's advantage estimators and policy losses inside a verl run.

``ares.verl.register()`` adds, to verl's own registries (``verl.trainer.ppo.core_algos``'s
``register_adv_est`` / ``register_policy_loss``), functions with verl's signatures that run
ares-core:

- advantage estimators (``algorithm.adv_estimator=...``): ``ares_grpo`` (verl's ``grpo``;
  ``algorithm.norm_adv_by_std_in_grpo=False`` gives Dr.GRPO's ``r − mean``), ``ares_rloo``
  (verl's ``rloo``), ``ares_reinforce_pro_max`` (REINFORCE Pro Max, which verl lacks) and
  ``ares_grpo_lambda`` (GRPO-λ rewards from the outcome scores, then GRPO);
- policy losses (``actor_rollout_ref.actor.policy_loss.loss_mode=...``): ``ares_vanilla``
  (verl's ``vanilla``: PPO clip / dual clip), ``ares_gspo`` (verl's ``gspo``, GSPO-token),
  ``ares_gspo_seq`` (the GSPO paper's sequence-level objective), ``ares_cispo`` (verl's
  ``cispo``), ``ares_clip_cov`` and ``ares_kl_cov``.

verl is imported inside ``register()`` only; ``import ares`` and ``import ares.verl`` import
neither verl nor torch.

**What the estimators need from the rollout**: what verl already passes — ``token_level_rewards``
``[B, T]`` (summed per row into the outcome reward), ``response_mask`` ``[B, T]`` and
``index`` (``non_tensor_batch["uid"]``, one key per row; every group needs ≥ 2 samples, a group
of one is a ``ValueError`` where verl passes the reward through). ``ares_grpo_lambda`` takes a
sample as correct when its outcome reward is ``> correct_threshold`` and its length from the
response mask. ARES's entropy machinery (HWE windows, the bucket controller) further needs the
per-token entropies of the training forward and a stable per-prompt ``global_id``; verl's
estimator and loss signatures carry neither, so use ``ares.entropy_windows`` and
``ares.BucketController`` from your own hook with those.

**Devices.** ares runs on CPU memory. CPU tensors are read in place (no copy; a bool or integer
mask is converted to the float dtype, and a non-contiguous tensor is made contiguous, which do
copy). A CUDA tensor is a ``ValueError`` unless ``register(copy_to_cpu=True)``: then every input
is copied to the host with ``.cpu()`` (a device→host transfer and a synchronisation per call)
and the results copied back to the input's device. verl's actor computes the policy loss on the
GPU, so ``ares_*`` losses there only run with ``copy_to_cpu=True`` and cost two transfers of
``[B, T]`` per micro-batch; the estimators run once per step on the driver, where the tensors
usually are on the CPU already.

**Losses and autograd.** ares returns the aggregated loss and ∂loss/∂logπ; the returned loss is a
0-d tensor whose backward multiplies that gradient in (a ``torch.autograd.Function``), so verl's
``loss.backward()`` works unchanged. verl's ``rollout_is_weights`` are applied by scaling the
advantages (exact for ``ares_vanilla``, ``ares_gspo`` and ``ares_cispo``, whose per-token losses
are positively homogeneous in A; the clip metrics then skip tokens of weight 0); the other losses
refuse them. ``config.global_batch_info`` (dp size, global token / sequence counts,
``loss_scale_factor``) rescales the local aggregate exactly as verl's ``agg_loss``.
"""

__all__ = ["ESTIMATORS", "POLICY_LOSSES", "register", "settings"]

ESTIMATORS = ("ares_grpo", "ares_rloo", "ares_reinforce_pro_max", "ares_grpo_lambda")
# registered name -> ares.policy_loss loss_mode
POLICY_LOSSES = {
    "ares_vanilla": "vanilla",
    "ares_gspo": "gspo_token",
    "ares_gspo_seq": "gspo",
    "ares_cispo": "cispo",
    "ares_clip_cov": "clip_cov",
    "ares_kl_cov": "kl_cov",
}
# losses whose per-token loss is positively homogeneous in the advantage: w·L(A) = L(w·A), w ≥ 0
_WEIGHT_BY_ADVANTAGE = {"vanilla", "gspo_token", "cispo"}

_SETTINGS = {
    "copy_to_cpu": False,
    "grpo_lambda": 0.2,
    "grpo_lambda_alpha": 0.6,
    "correct_threshold": 0.5,
}


def settings():
    """The settings of the last ``register()`` call (a copy)."""
    return dict(_SETTINGS)


def register(*, copy_to_cpu=False, grpo_lambda=0.2, grpo_lambda_alpha=0.6, correct_threshold=0.5):
    """Registers ARES's estimators and policy losses with verl (imported here). Idempotent; a
    later call changes the settings of the functions already registered.

    copy_to_cpu: copy CUDA tensors to the host and the results back (else a ``ValueError``).
    grpo_lambda, grpo_lambda_alpha: GRPO-λ's λ (fraction of groups penalised) and α (strength).
    correct_threshold: ``ares_grpo_lambda`` counts a sample correct when its reward exceeds it.

    Returns ``{"adv_estimators": [...], "policy_losses": [...]}``, the registered names.
    """
    from verl.trainer.ppo import core_algos

    if not 0.0 < float(grpo_lambda) <= 1.0:
        raise ValueError(f"ares.verl.register: `grpo_lambda` must be in (0, 1], got {grpo_lambda}")
    if not 0.0 <= float(grpo_lambda_alpha) <= 1.0:
        raise ValueError(f"ares.verl.register: `grpo_lambda_alpha` must be in [0, 1], got {grpo_lambda_alpha}")
    _SETTINGS.update(
        copy_to_cpu=bool(copy_to_cpu),
        grpo_lambda=float(grpo_lambda),
        grpo_lambda_alpha=float(grpo_lambda_alpha),
        correct_threshold=float(correct_threshold),
    )
    for name in ESTIMATORS:
        core_algos.register_adv_est(name)(globals()[name])
    for name in POLICY_LOSSES:
        core_algos.register_policy_loss(name)(globals()[name])
    return {"adv_estimators": list(ESTIMATORS), "policy_losses": list(POLICY_LOSSES)}


# ---------------------------------------------------------------- tensors in and out


def _host(t, func, name, dtype=None):
    """``t`` (a torch tensor) as a contiguous CPU tensor of ``dtype``, sharing memory where it
    can; a tensor on another device is copied only with ``copy_to_cpu``."""
    if t.device.type != "cpu":
        if not _SETTINGS["copy_to_cpu"]:
            raise ValueError(
                f"ares.verl.{func}: `{name}` is a tensor on {t.device}: ares runs on CPU arrays; "
                f"call ares.verl.register(copy_to_cpu=True) to copy verl's tensors to the host "
                f"(.cpu(), a device-to-host copy per call)"
            )
        t = t.detach().cpu()
    else:
        t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def _float_dtype(t):
    import torch

    return t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32


def _out(array, like):
    """A numpy result as a tensor on ``like``'s device with its dtype (no copy on the CPU)."""
    import torch

    t = torch.from_numpy(array)
    return t.to(device=like.device, dtype=like.dtype) if (t.device != like.device or t.dtype != like.dtype) else t


def _index(index, func):
    if index is None:
        raise ValueError(f"ares.verl.{func}: needs `index` (verl's non_tensor_batch['uid'], one key per row)")
    if hasattr(index, "detach") and hasattr(index, "device"):  # a torch tensor of group ids
        return _host(index, func, "index").numpy()
    return index


def _norm_by_std(norm_adv_by_std_in_grpo, config):
    if norm_adv_by_std_in_grpo is not None:
        return bool(norm_adv_by_std_in_grpo)
    if config is not None:
        value = _cfg(config, "norm_adv_by_std_in_grpo", None)
        if value is not None:
            return bool(value)
    return True


def _cfg(config, key, default):
    if config is None:
        return default
    try:
        value = getattr(config, key)
    except AttributeError:
        getter = getattr(config, "get", None)
        value = getter(key, default) if getter is not None else default
    return default if value is None else value


# ---------------------------------------------------------------- advantage estimators


def _outcome(token_level_rewards, response_mask, func):
    dtype = _float_dtype(token_level_rewards)
    scores = _host(token_level_rewards.sum(dim=-1), func, "token_level_rewards", dtype)
    mask = _host(response_mask, func, "response_mask", dtype)
    return scores, mask


# numpy cores: what each estimator computes once its tensors are host arrays (scores [B] and
# mask [B, T] of one float dtype, uid one key per row). The torch functions below only convert;
# tests/test_verl_fixtures.py checks these cores against verl's outputs without torch.


def _grpo_np(scores, mask, uid, epsilon=1e-6, norm_adv_by_std=True):
    from . import grpo_token_advantages

    return grpo_token_advantages(scores, mask, uid=uid, epsilon=float(epsilon), norm_adv_by_std=bool(norm_adv_by_std))


def _rloo_np(scores, mask, uid):
    from . import rloo_token_advantages

    return rloo_token_advantages(scores, mask, uid=uid)


def _pro_max_np(scores, mask, uid):
    from . import reinforce_pro_max

    return reinforce_pro_max(scores, mask, uid=uid)


def _grpo_lambda_np(scores, mask, uid, epsilon=1e-6, norm_adv_by_std=True):
    """GRPO-λ rewards (correct = score > ``correct_threshold``, L = valid tokens of the mask,
    λ and α from the settings), then GRPO token advantages over them."""
    from . import grpo_lambda_rewards

    rewards = grpo_lambda_rewards(
        scores > _SETTINGS["correct_threshold"],
        mask.sum(axis=-1),
        uid=uid,
        lambda_=_SETTINGS["grpo_lambda"],
        alpha=_SETTINGS["grpo_lambda_alpha"],
    )["rewards"]
    return _grpo_np(rewards, mask, uid, epsilon, norm_adv_by_std)


def ares_grpo(
    token_level_rewards,
    response_mask,
    index=None,
    epsilon=1e-6,
    norm_adv_by_std_in_grpo=None,
    config=None,
    **kwargs,
):
    """GRPO outcome advantages ``(r − mean_g)/(std_g + ε)`` (unbiased std; without the division
    when ``norm_adv_by_std_in_grpo`` is False, from the argument or ``config``) broadcast over
    the response mask. Returns ``(advantages, returns)``, the same tensor, ``[B, T]``."""
    scores, mask = _outcome(token_level_rewards, response_mask, "ares_grpo")
    adv = _grpo_np(
        scores.numpy(),
        mask.numpy(),
        _index(index, "ares_grpo"),
        epsilon,
        _norm_by_std(norm_adv_by_std_in_grpo, config),
    )
    adv = _out(adv, token_level_rewards)
    return adv, adv


def ares_rloo(token_level_rewards, response_mask, index=None, epsilon=1e-6, config=None, **kwargs):
    """RLOO outcome advantages ``r_i − mean of the group's other samples`` broadcast over the
    response mask. Returns ``(advantages, returns)``, the same tensor, ``[B, T]``."""
    scores, mask = _outcome(token_level_rewards, response_mask, "ares_rloo")
    adv = _out(_rloo_np(scores.numpy(), mask.numpy(), _index(index, "ares_rloo")), token_level_rewards)
    return adv, adv


def ares_reinforce_pro_max(token_level_rewards, response_mask, index=None, config=None, **kwargs):
    """REINFORCE Pro Max token advantages (RLOO shaped rewards, per-group adaptive scaling of
    positive and negative tokens to mean 0, variance 1) from the outcome rewards. A KL folded
    into ``token_level_rewards`` (``use_kl_in_reward``) is summed into the outcome; prefer the
    actor's KL loss. Returns ``(advantages, returns)``, the same tensor, ``[B, T]``."""
    scores, mask = _outcome(token_level_rewards, response_mask, "ares_reinforce_pro_max")
    adv = _pro_max_np(scores.numpy(), mask.numpy(), _index(index, "ares_reinforce_pro_max"))
    adv = _out(adv, token_level_rewards)
    return adv, adv


def ares_grpo_lambda(
    token_level_rewards,
    response_mask,
    index=None,
    epsilon=1e-6,
    norm_adv_by_std_in_grpo=None,
    config=None,
    **kwargs,
):
    """GRPO-λ: the batch's groups ranked by accuracy (correct = outcome reward >
    ``correct_threshold``), the top ``⌈λ·G⌉`` get the length-penalised rewards
    ``1 − α·sigmoid(z(L))`` on correct samples (L = valid response tokens), the others 0/1;
    then GRPO advantages over those rewards. Returns ``(advantages, returns)``, ``[B, T]``."""
    scores, mask = _outcome(token_level_rewards, response_mask, "ares_grpo_lambda")
    adv = _grpo_lambda_np(
        scores.numpy(),
        mask.numpy(),
        _index(index, "ares_grpo_lambda"),
        epsilon,
        _norm_by_std(norm_adv_by_std_in_grpo, config),
    )
    adv = _out(adv, token_level_rewards)
    return adv, adv


# ---------------------------------------------------------------- policy losses


_LOSS_FN = None


def _loss_fn():
    """A ``torch.autograd.Function``: forward gives the precomputed loss, backward
    ``grad_output · ∂loss/∂logπ``."""
    global _LOSS_FN
    if _LOSS_FN is None:
        import torch

        class AresPolicyLoss(torch.autograd.Function):
            @staticmethod
            def forward(ctx, log_prob, loss, grad):
                ctx.save_for_backward(grad)
                return torch.tensor(loss, dtype=log_prob.dtype, device=log_prob.device)

            @staticmethod
            def backward(ctx, grad_output):
                (grad,) = ctx.saved_tensors
                return grad_output * grad, None, None

        _LOSS_FN = AresPolicyLoss
    return _LOSS_FN


def _agg_scale(mask, loss_agg_mode, info):
    """The factor turning ares's local aggregate into verl's ``agg_loss`` with
    ``global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor``). ``mask``: the numpy response mask [B, T]."""
    dp = info.get("dp_size") or 1
    if loss_agg_mode == "token-mean":
        total = info.get("batch_num_tokens")
        if total is None:
            if dp > 1:
                raise ValueError("ares.verl: (global) batch_num_tokens is required when dp_size > 1")
            return 1.0
        return float(mask.sum()) * dp / float(total)
    if loss_agg_mode == "token-sum":
        return float(dp)
    rows = float((mask.sum(axis=-1) > 0).sum())
    gbs = info.get("global_batch_size")
    if gbs is None:
        if dp > 1:
            raise ValueError("ares.verl: global_batch_size is required when dp_size > 1")
        scale = 1.0
    else:
        scale = rows * dp / float(gbs)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        lsf = info.get("loss_scale_factor")
        if lsf is not None:
            scale *= mask.shape[-1] / float(lsf)
    return scale


_METRIC_KEYS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def _policy_loss_np(registered, old, lp, adv, mask, loss_agg_mode="token-mean", config=None, weights=None):
    """The numpy core of a registered loss: host arrays [B, T] of one float dtype in,
    ``(loss, grad, metrics)`` out, loss and grad already scaled as verl's ``agg_loss`` with
    ``config.global_batch_info``; ``None`` when the mask is empty. ``config`` may be verl's
    ActorConfig or a dict of the same keys."""
    from . import policy_loss

    mode = POLICY_LOSSES[registered]
    if weights is not None:
        if mode not in _WEIGHT_BY_ADVANTAGE:
            raise ValueError(
                f"ares.verl.{registered}: rollout_is_weights are supported by ares_vanilla, ares_gspo "
                f"and ares_cispo only"
            )
        adv = adv * weights
    if float(mask.sum()) == 0.0:  # nothing to learn from this micro-batch; ares refuses an empty mask
        return None
    clip = _cfg(config, "clip_ratio", 0.2)
    pl = _cfg(config, "policy_loss", None)
    info = _cfg(config, "global_batch_info", None) or {}
    out = policy_loss(
        lp,
        old,
        adv,
        mask,
        loss_mode=mode,
        loss_agg_mode=loss_agg_mode,
        clip_ratio_low=float(_cfg(config, "clip_ratio_low", clip)),
        clip_ratio_high=float(_cfg(config, "clip_ratio_high", clip)),
        clip_ratio_c=float(_cfg(config, "clip_ratio_c", 3.0)),
        clip_cov_ratio=float(_cfg(pl, "clip_cov_ratio", 2e-4)),
        clip_cov_lb=float(_cfg(pl, "clip_cov_lb", 1.0)),
        clip_cov_ub=float(_cfg(pl, "clip_cov_ub", 5.0)),
        kl_cov_ratio=float(_cfg(pl, "kl_cov_ratio", 2e-4)),
        ppo_kl_coef=float(_cfg(pl, "ppo_kl_coef", 0.1)),
    )
    scale = _agg_scale(mask, loss_agg_mode, info)
    grad = out["grad"]
    if scale != 1.0:
        grad *= scale  # ares's own output array, not shared
    metrics = {
        "actor/pg_clipfrac": float(out["clipfrac"]),
        "actor/ppo_kl": float(out["approx_kl"]),
        "actor/pg_clipfrac_lower": float(out["clipfrac_lower"]),
    }
    return float(out["loss"]) * scale, grad, metrics


def _policy_loss(
    registered, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
):
    import torch

    dtype = _float_dtype(log_prob)
    lp = _host(log_prob, registered, "log_prob", dtype)
    old = _host(old_log_prob, registered, "old_log_prob", dtype)
    adv = _host(advantages, registered, "advantages", dtype)
    mask = _host(response_mask, registered, "response_mask", dtype)
    w = None
    if rollout_is_weights is not None:
        w = _host(rollout_is_weights, registered, "rollout_is_weights", dtype).numpy()
    res = _policy_loss_np(registered, old.numpy(), lp.numpy(), adv.numpy(), mask.numpy(), loss_agg_mode, config, w)
    if res is None:
        zero = (log_prob * 0.0).sum()
        return zero, dict.fromkeys(_METRIC_KEYS, 0.0)
    loss, grad, metrics = res
    grad = torch.from_numpy(grad).to(device=log_prob.device, dtype=log_prob.dtype)
    return _loss_fn().apply(log_prob, loss, grad), metrics


def _make_loss(registered):
    def fn(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        return _policy_loss(
            registered, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )

    fn.__name__ = fn.__qualname__ = registered
    fn.__doc__ = (
        f"verl policy loss `{registered}`: ares.policy_loss(loss_mode={POLICY_LOSSES[registered]!r}) with "
        f"verl's signature; returns (loss, metrics) with a differentiable 0-d loss."
    )
    return fn


ares_vanilla = _make_loss("ares_vanilla")
ares_gspo = _make_loss("ares_gspo")
ares_gspo_seq = _make_loss("ares_gspo_seq")
ares_cispo = _make_loss("ares_cispo")
ares_clip_cov = _make_loss("ares_clip_cov")
ares_kl_cov = _make_loss("ares_kl_cov")
