"""verl 0.9 registrations: ARES's advantage estimators, policy losses and a batch-level reward
manager inside a verl run.

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
  ``cispo``), ``ares_clip_cov`` and ``ares_kl_cov``;
- a reward manager (``verl.workers.reward_manager``'s registry, name ``"ares"``):
  :class:`AresRewardManager` scores a batch with the user's ``compute_score`` as verl's
  ``naive`` / ``batch`` managers do, then reshapes the outcome rewards over the whole batch:
  GRPO-λ (``mode="grpo_lambda"``) or ARES entropy shaping (``mode="ares"``: HWE counts under
  the global τ, buckets by global_id, the bucket controller's targets and α), keeping τ, the
  controller and the step in the manager (``state_dict()`` / ``load_state_dict()``).

verl is imported inside ``register()`` only; ``import ares`` and ``import ares.verl`` import
neither verl nor torch.

**What the reward manager reads**: ``prompts``, ``responses``, ``attention_mask`` (or
``rm_scores``) and ``non_tensor_batch["uid"]`` in both modes; ``mode="ares"`` also needs the
per-token entropies of the responses in ``batch["entropys"]`` [B, T] and a stable per-prompt
id, by default ``non_tensor_batch["index"]`` (what verl's ``RLHFDataset`` copies from
``extra_info.index``; key names are arguments); a missing key is a ``KeyError``
naming it. verl 0.9.1's trainers score through its reward loop
(``verl.experimental.reward_loop``, one sample at a time) rather than this registry: inside a
stock verl run, ARES's batch-level step is the trainer modes of :mod:`ares.verl_v1`
(``trainer.v1.trainer_mode=ares_sync``), which use this manager's numpy core; call the manager
yourself only from a trainer of your own.

**What the estimators need from the rollout**: what verl already passes — ``token_level_rewards``
``[B, T]`` (summed per row into the outcome reward), ``response_mask`` ``[B, T]`` and
``index`` (``non_tensor_batch["uid"]``, one key per row; every group needs ≥ 2 samples, a group
of one is a ``ValueError`` where verl passes the reward through). ``ares_grpo_lambda`` takes a
sample as correct when its outcome reward is ``> correct_threshold`` and its length from the
response mask. ARES's entropy machinery (HWE windows, the bucket controller) further needs the
per-token entropies of the training forward and a stable per-prompt ``global_id``; verl's
estimator and loss signatures carry neither: the trainer modes of :mod:`ares.verl_v1`
(``trainer.v1.trainer_mode=ares_sync``) do the whole entropy control inside verl, through
:class:`AresRewardManager`'s numpy core.

**Devices.** CPU tensors are read in place (no copy; a bool or integer mask is converted to the
float dtype, and a non-contiguous tensor is made contiguous, which do copy). verl's actor
computes the policy loss on the GPU: there every registered loss (``ares_vanilla``,
``ares_gspo``, ``ares_gspo_seq``, ``ares_cispo``, ``ares_clip_cov``, ``ares_kl_cov``) runs
ares-cuda's loss kernel on the CUDA tensors where they are (float32; the gradient is cast to
``log_prob``'s dtype), reading back only the loss and its metrics. Any other CUDA input (the
estimators) is a ``ValueError`` unless
``register(copy_to_cpu=True)``: then it is copied to the host with ``.cpu()`` (a device→host
transfer and a synchronisation per call) and the results copied back to the input's device; the
estimators run once per step on the driver, where the tensors usually are on the CPU already.

**Losses and autograd.** ares returns the aggregated loss and ∂loss/∂logπ; the returned loss is a
0-d tensor whose backward multiplies that gradient in (a ``torch.autograd.Function``), so verl's
``loss.backward()`` works unchanged. verl's ``rollout_is_weights`` are applied by scaling the
advantages (exact for ``ares_vanilla``, ``ares_gspo`` and ``ares_cispo``, whose per-token losses
are positively homogeneous in A; the clip metrics then skip tokens of weight 0); the other losses
refuse them. ``config.global_batch_info`` (dp size, global token / sequence counts,
``loss_scale_factor``) rescales the local aggregate exactly as verl's ``agg_loss``. Metrics are
verl's keys; two differ in meaning for the covariance losses (docs/algorithms.md §15):
``actor/pg_clipfrac`` is PPO's clip fraction (verl's Clip-Cov reports the selected fraction
there; ares's ``selected_frac``), and ``actor/ppo_kl`` is ``mean(old − new log-prob)`` (verl's
KL-Cov reports ``mean |log ratio|``).

**Tests.** Each estimator and loss is a numpy core (``_grpo_np``, ``_rloo_np``,
``_pro_max_np``, ``_grpo_lambda_np``, ``_policy_loss_np``) behind a thin torch conversion.
``tests/test_verl_fixtures.py`` checks the cores against committed outputs of verl 0.9.1's own
functions (``tests/fixtures/verl_adapter_*.npz``, written by
``scripts/make_verl_adapter_fixtures.py``) with numpy only; ``tests/test_verl*.py`` compare the
torch side live where torch and verl are installed.
"""

import itertools

__all__ = ["ESTIMATORS", "POLICY_LOSSES", "AresRewardManager", "register", "settings"]

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
# losses with a CUDA kernel (ares._cuda.policy_loss): CUDA tensors stay where they are
_CUDA_LOSSES = {"vanilla", "gspo", "gspo_token", "cispo", "clip_cov", "kl_cov"}
# Clip-Cov's selection seed: one per call in this process, as verl draws a fresh
# ``torch.randperm`` each call (a fixed seed would favour the same flat positions every step)
_CLIP_COV_CALLS = itertools.count()

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

    Also registers :class:`AresRewardManager` as ``"ares"`` in ``verl.workers.reward_manager``
    and, where verl's v1 trainer imports, ``ares.verl_v1``'s trainer modes (``ares_sync``, …),
    the ``"ares"`` reward-loop manager and the multi-trajectory treatment of ares's outcome
    estimators.

    Returns ``{"adv_estimators": [...], "policy_losses": [...], "reward_managers": ["ares"],
    "trainer_modes": [...]}``, the registered names.
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
    from verl.workers.reward_manager import register as register_reward_manager

    register_reward_manager("ares")(AresRewardManager)
    from .verl_v1 import register_v1

    trainers = register_v1()
    return {
        "adv_estimators": list(ESTIMATORS),
        "policy_losses": list(POLICY_LOSSES),
        "reward_managers": ["ares"],
        "trainer_modes": trainers,
    }


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
    ``loss_scale_factor``). ``mask``: the response mask [B, T] (numpy, or a torch tensor)."""
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
    rows = float((mask.sum(-1) > 0).sum())
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
    """The core of a registered loss: host arrays [B, T] of one float dtype (or float32 CUDA
    tensors, for the losses with a kernel) in, ``(loss, grad, metrics)`` out, loss and grad
    already scaled as verl's ``agg_loss`` with
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
        clip_cov_seed=next(_CLIP_COV_CALLS) if mode == "clip_cov" else 0,
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


def _on_device(t, func, name, device):
    """``t`` as a contiguous float32 tensor on CUDA ``device`` (no copy when it is one)."""
    import torch

    if t.device != device:
        raise ValueError(f"ares.verl.{func}: `{name}` is on {t.device}, `log_prob` on {device}")
    return t.detach().to(torch.float32).contiguous()


def _policy_loss(
    registered, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
):
    import torch

    if log_prob.device.type == "cuda" and POLICY_LOSSES[registered] in _CUDA_LOSSES:
        # where verl's actor has them: ares-cuda's loss kernel, no copy to the host
        dev = log_prob.device
        named = (("old_log_prob", old_log_prob), ("log_prob", log_prob), ("advantages", advantages),
                 ("response_mask", response_mask))
        old, lp, adv, mask = (_on_device(t, registered, n, dev) for n, t in named)
        w = None if rollout_is_weights is None else _on_device(rollout_is_weights, registered, "rollout_is_weights", dev)
        res = _policy_loss_np(registered, old, lp, adv, mask, loss_agg_mode, config, w)
    else:
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
    if not torch.is_tensor(grad):
        grad = torch.from_numpy(grad)
    grad = grad.to(device=log_prob.device, dtype=log_prob.dtype)
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


# ---------------------------------------------------------------- reward manager


class AresRewardManager:
    """A verl reward manager (``verl.workers.reward_manager``'s interface: registered by
    :func:`register` as ``"ares"``) that scores a batch like verl's ``naive`` manager (or its
    ``batch`` manager with ``batch_scoring=True``) and then reshapes the outcome rewards over
    the whole batch with ares:

    - ``mode="grpo_lambda"``: GRPO-λ (docs/algorithms.md §8): correct = score >
      ``correct_threshold``, L = valid response tokens, the top ``⌈λ·G⌉`` groups by accuracy
      get ``1 − α·sigmoid(z(L))`` on correct samples, the others 0/1 (``ares.GrpoLambda``).
      Pair it with ``algorithm.adv_estimator=grpo`` (or ``ares_grpo``).
    - ``mode="ares"``: ARES entropy shaping (§1–§3): HWE tokens of each response under the
      global threshold τ in force (``entropy_windows`` → ``row_percentile`` →
      ``batch_median_threshold``; the first batch counts with its own candidate), then τ's
      EMA update (``ThresholdEma``); each group's bucket from this batch's accuracy
      (``BucketController.classify``, remembered by global_id); the controller step with the
      per-bucket mean over groups of their mean HWE count (α toward the target in force, then
      the target); the reward ``correct + S (+ format_weight·format)`` with the updated T_d, α_d
      (``entropy_rewards``). λ's dual ascent needs the step's KL, which a reward manager does
      not see: call ``manager.controller.update_lambda`` from your trainer for it.

    **What it reads from the DataProto**: ``batch["prompts"]``, ``batch["responses"]``,
    ``batch["attention_mask"]`` (lengths and the response mask, as verl's managers), or
    ``batch["rm_scores"]`` when present (then no scoring: the score is its row sum);
    ``non_tensor_batch["reward_model"][i]["ground_truth"]``, ``[reward_fn_key]``,
    ``["extra_info"]`` for ``compute_score``; ``non_tensor_batch[uid_key]`` (default
    ``"uid"``, one group key per row; every group ≥ 2 samples) in both modes; for
    ``mode="ares"`` also ``batch[entropy_key]`` (default ``"entropys"``: per-token entropies
    of the responses [B, T], e.g. from the actor's ``compute_log_prob`` with
    ``calculate_entropy=True``, which verl's trainer pops before scoring: keep a copy under
    this key) and ``non_tensor_batch[global_id_key]`` (default ``"index"``: the stable
    per-prompt id verl's ``RLHFDataset`` copies from ``extra_info.index``). A missing key is a ``KeyError``
    naming it. With ``meta_info["validate"]`` true the raw scores are returned and no state
    moves. The step (target update interval) is ``meta_info["global_steps"]`` when present,
    else the number of training calls so far.

    Returns verl's ``reward_tensor`` [B, T] float32 (the reward on each row's last valid token)
    or, with ``return_dict``, ``{"reward_tensor", "reward_extra_info"}``; the extra info has
    ``score`` (the raw score), ``acc`` and, for ``"ares"``, ``hwe_count``, ``entropy_reward``,
    ``difficulty`` per sample. ``state_dict()`` / ``load_state_dict()`` save and restore τ,
    the bucket controller (targets, α, λ, difficulty by global_id), GRPO-λ's parameters and
    the step.

    Caveat: verl 0.9.1's trainers score through the reward loop
    (``verl.experimental.reward_loop``, one sample at a time), not through this registry; in a
    stock verl run use the trainer modes of :mod:`ares.verl_v1` (which run
    :meth:`shape_rewards` on the TaskRunner), or call the manager on the batch from a trainer of
    your own (``reward_tensor = manager(batch)``).
    """

    MODES = ("grpo_lambda", "ares")

    def __init__(
        self,
        tokenizer=None,
        num_examine=0,
        compute_score=None,
        reward_fn_key="data_source",
        *,
        mode="grpo_lambda",
        batch_scoring=False,
        correct_threshold=0.5,
        grpo_lambda=0.2,
        grpo_lambda_alpha=0.6,
        uid_key="uid",
        global_id_key="index",
        entropy_key="entropys",
        format_key=None,
        format_weight=0.0,
        window_size=4,
        window_includes_self=False,
        percentile=95.0,
        tau_momentum=0.99,
        controller=None,
        **reward_kwargs,
    ):
        from . import BucketController, GrpoLambda, ThresholdEma

        if mode not in self.MODES:
            raise ValueError(f"AresRewardManager: `mode` = {mode!r} is not one of {self.MODES}")
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.compute_score = compute_score
        self.reward_fn_key = reward_fn_key
        self.reward_kwargs = reward_kwargs
        self.mode = mode
        self.batch_scoring = bool(batch_scoring)
        self.correct_threshold = float(correct_threshold)
        self.uid_key, self.global_id_key, self.entropy_key = uid_key, global_id_key, entropy_key
        self.format_key, self.format_weight = format_key, float(format_weight)
        self.window_size, self.window_includes_self = int(window_size), bool(window_includes_self)
        self.percentile = float(percentile)
        self.grpo_lambda = GrpoLambda(grpo_lambda, grpo_lambda_alpha)
        self.tau = ThresholdEma(tau_momentum)
        self.controller = BucketController(**(controller or {}))
        self.steps = 0

    # ------------------------------------------------------------ state

    def state_dict(self):
        """``{"steps", "tau", "controller", "grpo_lambda"}``: everything the next call reads."""
        return {
            "steps": self.steps,
            "tau": self.tau.state_dict(),
            "controller": self.controller.state_dict(),
            "grpo_lambda": self.grpo_lambda.state_dict(),
        }

    def load_state_dict(self, state):
        """Restores :meth:`state_dict`'s output (all parts are checked before any is set)."""
        from . import BucketController, GrpoLambda, ThresholdEma

        missing = [k for k in ("steps", "tau", "controller", "grpo_lambda") if k not in state]
        if missing:
            raise KeyError(f"AresRewardManager.load_state_dict: missing {missing}")
        tau, ctrl, lam = ThresholdEma(), BucketController(), GrpoLambda()
        tau.load_state_dict(state["tau"])
        ctrl.load_state_dict(state["controller"])
        lam.load_state_dict(state["grpo_lambda"])
        self.tau, self.controller, self.grpo_lambda, self.steps = tau, ctrl, lam, int(state["steps"])

    # ------------------------------------------------------------ numpy core

    def shape_rewards(self, scores, lengths, uid, *, entropies=None, mask=None, global_id=None, fmt=None, step=None):
        """The batch-level reshaping on host arrays, updating the state: ``scores`` [B] (the
        raw outcome scores), ``lengths`` [B] (valid response tokens), ``uid`` [B]; for
        ``"ares"`` also ``entropies`` and ``mask`` [B, T] (float32), ``global_id`` [B] and
        optionally ``fmt`` [B] (format rewards). Returns a dict of per-sample numpy arrays:
        ``reward`` (float64 [B]), ``correct``, and for ``"ares"`` ``hwe_count``,
        ``entropy_reward``, ``difficulty`` (0 easy, 1 medium, 2 hard) plus ``tau`` (the τ the
        HWE tokens were counted with) and ``hwe_mask`` (float32 [B, T], 1 on HWE tokens)."""
        import numpy as np

        from . import (
            batch_median_threshold,
            bucket_means,
            entropy_rewards,
            entropy_windows,
            group_means,
            row_percentile,
        )

        scores = np.ascontiguousarray(scores, dtype=np.float64)
        correct = scores > self.correct_threshold
        if step is None:
            step = self.steps + 1
        if self.mode == "grpo_lambda":
            lengths = np.ascontiguousarray(lengths, dtype=np.float64)
            out = self.grpo_lambda.rewards(correct, lengths, uid=uid)
            self.steps = int(step)
            return {"reward": out["rewards"], "correct": correct}
        if entropies is None or mask is None or global_id is None:
            raise ValueError("AresRewardManager(mode='ares'): needs `entropies`, `mask` and `global_id`")
        h = np.ascontiguousarray(entropies, dtype=np.float32)
        m = np.ascontiguousarray(mask, dtype=np.float32)
        win = dict(window_size=self.window_size, includes_self=self.window_includes_self)
        w = entropy_windows(h, m, **win)
        thr, has = row_percentile(w["means"], w["valid"], self.percentile)
        cand = batch_median_threshold(thr, has)
        tau = self.tau.tau if self.tau.tau is not None else (cand if cand is not None else 0.0)
        hwe = entropy_windows(h, m, tau=tau, **win)
        counts = hwe["counts"].astype(np.float64)
        difficulty = self.controller.classify(correct, uid=uid, global_id=[str(g) for g in global_id])
        # per group (numbered by first appearance, as group_means): its bucket and mean HWE
        # count; h̄_d is the mean over the bucket's groups (docs/algorithms.md §2)
        group_bucket = difficulty[_first_rows(uid)]
        mean_hwe = bucket_means(group_bucket, group_means(counts, uid=uid))
        # τ moves after counting (the τ in force counts the step), then the controller
        if cand is not None:
            self.tau.update(cand)
        self.controller.step(mean_hwe=mean_hwe, step=int(step))
        target = np.array([self.controller.target(int(d)) for d in difficulty], dtype=np.float64)
        alpha = np.array([self.controller.alpha(int(d)) for d in difficulty], dtype=np.float64)
        fmt = None if fmt is None else np.ascontiguousarray(fmt, dtype=np.float64)
        s, overall = entropy_rewards(
            correct, counts, target, alpha, difficulty, format_reward=fmt, format_weight=self.format_weight
        )
        self.steps = int(step)
        return {
            "reward": overall,
            "correct": correct,
            "hwe_count": counts,
            "entropy_reward": s,
            "difficulty": difficulty,
            "tau": float(tau),
            "hwe_mask": hwe["hwe_mask"],
        }

    # ------------------------------------------------------------ verl interface

    def _scores(self, data, valid_lengths):
        """Raw scores [B] and the extra info lists, as verl's naive / batch managers."""
        from collections import defaultdict

        extra = defaultdict(list)
        if "rm_scores" in data.batch.keys():
            return data.batch["rm_scores"].sum(dim=-1).float().cpu().numpy(), extra
        compute_score = self.compute_score
        if compute_score is None:
            from verl.utils.reward_score import default_compute_score as compute_score
        ntb = data.non_tensor_batch
        n = len(data)
        for key in ("reward_model", self.reward_fn_key):
            if key not in ntb:
                raise KeyError(f"AresRewardManager: non_tensor_batch[{key!r}] is missing (needed to score)")
        responses = data.batch["responses"]
        strs = [
            self.tokenizer.decode(responses[i][: int(valid_lengths[i])], skip_special_tokens=True) for i in range(n)
        ]
        truths = [ntb["reward_model"][i].get("ground_truth", None) for i in range(n)]
        sources = ntb[self.reward_fn_key]
        extras = ntb.get("extra_info", None)
        extras = [dict(extras[i] or {}) if extras is not None else {} for i in range(n)]
        if self.batch_scoring:
            raw = compute_score(
                data_sources=sources, solution_strs=strs, ground_truths=truths, extra_infos=extras, **self.reward_kwargs
            )
        else:
            raw = [
                compute_score(data_source=sources[i], solution_str=strs[i], ground_truth=truths[i], extra_info=extras[i])
                for i in range(n)
            ]
        scores = []
        for r in raw:
            if isinstance(r, dict):
                for k, v in r.items():
                    extra[k].append(v)
                r = r["score"]
            scores.append(float(r))
        printed = {}
        for i in range(n):
            src = sources[i]
            if printed.get(src, 0) < self.num_examine:
                printed[src] = printed.get(src, 0) + 1
                print("[response]", strs[i])
                print("[ground_truth]", truths[i])
                print("[score]", scores[i])
        import numpy as np

        return np.asarray(scores, dtype=np.float64), extra

    def __call__(self, data, return_dict=False):
        import numpy as np
        import torch

        prompt_len = data.batch["prompts"].shape[-1]
        resp_attn = data.batch["attention_mask"][:, prompt_len:]
        valid = resp_attn.sum(dim=-1)
        scores, extra = self._scores(data, valid)
        extra["score"] = list(scores)
        meta = getattr(data, "meta_info", None) or {}
        if meta.get("validate", False):
            reward = scores
        else:
            ntb = data.non_tensor_batch
            if self.uid_key not in ntb:
                raise KeyError(
                    f"AresRewardManager: non_tensor_batch[{self.uid_key!r}] is missing: the group key of each "
                    f"sample (verl's trainer sets 'uid' when it repeats the prompts n times)"
                )
            kw = {}
            if self.mode == "ares":
                if self.entropy_key not in data.batch.keys():
                    raise KeyError(
                        f"AresRewardManager(mode='ares'): batch[{self.entropy_key!r}] is missing: the per-token "
                        f"entropies of the responses [B, T] (compute_log_prob with calculate_entropy=True; verl's "
                        f"trainer pops 'entropys', keep a copy under this key)"
                    )
                if self.global_id_key not in ntb:
                    raise KeyError(
                        f"AresRewardManager(mode='ares'): non_tensor_batch[{self.global_id_key!r}] is missing: a "
                        f"stable id per prompt (verl's RLHFDataset sets 'index' from extra_info.index; "
                        f"`global_id_key` names another field)"
                    )
                mask = data.batch["response_mask"] if "response_mask" in data.batch.keys() else resp_attn
                kw = dict(
                    entropies=data.batch[self.entropy_key].detach().float().cpu().numpy(),
                    mask=mask.detach().float().cpu().numpy(),
                    global_id=ntb[self.global_id_key],
                )
                if self.format_key is not None:
                    kw["fmt"] = np.asarray(extra[self.format_key], dtype=np.float64)
            step = meta.get("global_steps")
            out = self.shape_rewards(scores, valid.cpu().numpy(), ntb[self.uid_key], step=step, **kw)
            reward = out["reward"]
            extra["acc"] = [float(c) for c in out["correct"]]
            for k in ("hwe_count", "entropy_reward", "difficulty"):
                if k in out:
                    extra[k] = [float(v) for v in out[k]]
        reward_tensor = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        rows = torch.arange(reward_tensor.shape[0])
        reward_tensor[rows, (valid - 1).clamp(min=0).long().cpu()] = torch.as_tensor(reward, dtype=torch.float32)
        if return_dict:
            return {"reward_tensor": reward_tensor, "reward_extra_info": extra}
        return reward_tensor


def _first_rows(keys):
    """The first row of every distinct key, in order of first appearance (the order ares
    numbers uid groups in)."""
    import numpy as np

    seen = {}
    for i, k in enumerate(keys.tolist() if hasattr(keys, "tolist") else keys):
        seen.setdefault(k, i)
    return np.fromiter(seen.values(), dtype=np.int64, count=len(seen))
