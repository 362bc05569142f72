"""ARES itself inside a stock verl 0.9.1 run: trainer modes for verl's v1 trainer, a reward-loop
manager, and multi-trajectory groups for ares's outcome estimators. Registered by
``ares.verl.register()``, which the ``verl.plugins`` entry point runs in every process that
imports verl (driver, TaskRunner, workers): nothing to set but the config.

**Trainer modes** (``trainer.v1.trainer_mode=ares_sync``; also ``ares_colocate_async`` and
``ares_separate_async`` over verl's asynchronous trainers). Each is verl's trainer with one
step added before the advantages, on the TaskRunner, from what the v1 trainer already keeps
in its TransferQueue — the per-token ``entropy`` of the old-log-prob pass, ``rm_scores``,
``response_mask``, ``uid`` and the difficulty key (default ``index``, which verl's
``RLHFDataset`` copies from ``extra_info.index``); with the KL on, also ``old_log_probs`` and
``ref_log_prob``. :class:`AresStep` then does, in the order of docs/algorithms.md §1–§4:

1. the outcome score of each sample (the row sum of ``rm_scores``), correct when
   ``> correct_threshold``;
2. ``mode: ares``: HWE tokens under the global τ in force, τ's update, the difficulty buckets by
   the difficulty key, α toward the target, the target, and the entropy-shaped reward
   ``correct + S`` (``ares.verl.AresRewardManager.shape_rewards``, the same numpy core);
   ``mode: grpo_lambda``: GRPO-λ's length-penalised rewards instead;
3. with ``kl.enable``: the dynamic token-level KL folded into the token rewards,
   ``R_t = −β_t·k_t + [t = last valid token]·r``, ``β_t = λ_d·(HWE ? low_ratio : 1)``
   between the old and the reference policy (§4's "KL in the reward" placement: GRPO then
   groups the folded score ``r − Σ β_t·k_t``), and λ_d's dual ascent on each bucket's mean KL;
4. the token rewards written back as ``rm_scores``; verl's own advantage step follows
   (``algorithm.adv_estimator``: ``grpo``, ``ares_grpo``, ``ares_reinforce_pro_max``, …).

τ, the buckets (targets, α, λ, difficulty per prompt) and the step are saved as
``ares_state.json`` in each ``global_step_*`` folder before verl marks the checkpoint as the
latest, and restored on resume (a resumed checkpoint without it is an error). Metrics are
logged under ``ares/``.

Names are checked when the config is: ``verl.utils.config.validate_config`` (run by
``main_ppo`` in the driver, before Ray starts) first runs :func:`check_config` — a misspelt
``ares_*`` name gets the list of ares's names and the closest one, and the ``ares`` settings
below are checked there too.

Settings: a top-level ``ares`` section (``+ares.mode=ares``, ``+ares.kl.enable=true`` on the
command line; every key and default in :data:`DEFAULTS`). Refused at start, before any rollout:
an unknown key, a value out of range, ``algorithm.use_kl_in_reward`` together with
``ares.kl.enable`` (the KL would be charged twice), and the rollout-correction bypass mode
(no old-log-prob pass, hence no entropies).

**Not built**: the KL in the actor's loss with per-token weights (verl's loss takes one
``kl_loss_coef``; use ``ares.kl`` here, or verl's ``use_kl_loss`` with a fixed coefficient);
the bootstrap pass over the whole dataset before the first step (targets start from the
first batch, as with ``data.bootstrap: false`` in ares-runner); CUDA tensors are copied to the
host (``[B, T]`` per step, on the TaskRunner).

**Dr.GRPO's flag.** verl's ``compute_advantage`` passes ``norm_adv_by_std_in_grpo`` to its own
GRPO only; for ``ares_grpo`` and ``ares_grpo_lambda`` called without a ``config`` the flag now
reaches them as a one-key config (with a config, they read it there, as before).

**Multi-trajectory groups.** verl's v1 trainer gives GRPO only the final output of each
session (``{uid}_{session}_{index}`` keys) and broadcasts its advantage to the session's other
outputs; any other estimator sees every output. ares's outcome estimators (``ares_grpo``,
``ares_rloo``, ``ares_reinforce_pro_max``, ``ares_grpo_lambda``) are given the same treatment
as verl's ``grpo`` (:func:`final_session_rows`).

**Reward-loop manager** ``ares`` (``reward.reward_manager.name=ares``): verl's ``naive``
per-sample scoring, refused with a message unless the trainer mode is an ares mode (the
batch-level shaping happens there). Any other manager works with the ares modes too.
"""

import copy
import json
import logging
import os

__all__ = [
    "DEFAULTS",
    "OUTCOME_ESTIMATORS",
    "TRAINER_MODES",
    "AresSettingsError",
    "check_config",
    "AresStep",
    "final_session_rows",
    "register_v1",
    "settings_from_config",
]

logger = logging.getLogger("ares.verl")

# estimators whose advantage is a function of the outcome scores of a uid group
OUTCOME_ESTIMATORS = ("ares_grpo", "ares_rloo", "ares_reinforce_pro_max", "ares_grpo_lambda")
# ares mode -> verl's trainer mode it extends
TRAINER_MODES = {"ares_sync": "sync", "ares_colocate_async": "colocate_async", "ares_separate_async": "separate_async"}
STATE_FILE = "ares_state.json"

DEFAULTS = {
    "mode": "ares",  # "ares" (entropy shaping) or "grpo_lambda"
    "difficulty_key": "index",  # a stable per-prompt id in the batch (RLHFDataset: extra_info.index)
    "correct_threshold": 0.5,
    "window_size": 4,
    "window_includes_self": False,
    "percentile": 95.0,
    "tau_momentum": 0.99,
    "grpo_lambda": 0.2,
    "grpo_lambda_alpha": 0.6,
    "controller": {},  # ares.BucketController keyword arguments
    "kl": {
        "enable": True,
        "estimator": "k3",
        "dynamic": True,  # HWE tokens weighted by low_ratio
        "low_ratio": 0.5,
    },
}


class AresSettingsError(ValueError):
    """A bad ``ares`` setting, named by its dotted key."""


def _merge(defaults, given, prefix):
    out = copy.deepcopy(defaults)
    for key, value in given.items():
        where = f"{prefix}.{key}"
        if key not in defaults:
            raise AresSettingsError(f"`{where}` is not an ares setting (known: {', '.join(sorted(defaults))})")
        if isinstance(defaults[key], dict) and key != "controller":
            if not isinstance(value, dict):
                raise AresSettingsError(f"`{where}` must be a mapping, got {value!r}")
            out[key] = _merge(defaults[key], value, where)
        else:
            out[key] = value
    return out


def settings_from_config(section):
    """The ``ares`` section (a dict, an OmegaConf node or None) merged over :data:`DEFAULTS`
    and checked; :class:`AresSettingsError` names the first bad key."""
    if section is None:
        section = {}
    elif not isinstance(section, dict):
        from omegaconf import OmegaConf

        section = OmegaConf.to_container(section, resolve=True)
    s = _merge(DEFAULTS, section, "ares")
    if s["mode"] not in ("ares", "grpo_lambda"):
        raise AresSettingsError(f"`ares.mode` = {s['mode']!r}: use 'ares' or 'grpo_lambda'")
    if not isinstance(s["difficulty_key"], str) or not s["difficulty_key"]:
        raise AresSettingsError(f"`ares.difficulty_key` must be a field name, got {s['difficulty_key']!r}")
    if not isinstance(s["window_size"], int) or s["window_size"] < 1:
        raise AresSettingsError(f"`ares.window_size` must be an integer >= 1, got {s['window_size']!r}")
    if not 0.0 <= float(s["percentile"]) <= 100.0:
        raise AresSettingsError(f"`ares.percentile` must be in [0, 100], got {s['percentile']!r}")
    if not 0.0 <= float(s["kl"]["low_ratio"]) <= 1.0:
        raise AresSettingsError(f"`ares.kl.low_ratio` must be in [0, 1], got {s['kl']['low_ratio']!r}")
    known = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+")
    if s["kl"]["estimator"] not in known:
        raise AresSettingsError(f"`ares.kl.estimator` = {s['kl']['estimator']!r} is not one of {known}")
    if s["mode"] == "grpo_lambda" and s["kl"]["enable"]:
        raise AresSettingsError(
            "`ares.kl.enable` needs `ares.mode: ares` (λ_d is per difficulty bucket); set `+ares.kl.enable=false` "
            "with grpo_lambda and use verl's KL"
        )
    return s


# ---------------------------------------------------------------- the per-step transform


class AresStep:
    """The ARES step on host arrays (module docs, steps 1–3), with its state. Testable without
    verl: :meth:`__call__` takes numpy arrays and returns the token rewards and metrics."""

    def __init__(self, settings=None):
        from .verl import AresRewardManager

        self.settings = settings_from_config(settings)
        s = self.settings
        self.shaper = AresRewardManager(
            mode=s["mode"],
            correct_threshold=s["correct_threshold"],
            grpo_lambda=s["grpo_lambda"],
            grpo_lambda_alpha=s["grpo_lambda_alpha"],
            window_size=s["window_size"],
            window_includes_self=s["window_includes_self"],
            percentile=s["percentile"],
            tau_momentum=s["tau_momentum"],
            controller=s["controller"],
        )

    def state_dict(self):
        return {"shaper": self.shaper.state_dict()}

    def load_state_dict(self, state):
        if "shaper" not in state:
            raise KeyError("ares state: missing 'shaper'")
        self.shaper.load_state_dict(state["shaper"])

    def __call__(self, scores, mask, uid, *, entropies=None, difficulty_ids=None, old_log_probs=None,
                 ref_log_probs=None, step=None):
        """scores: float64 [B] outcome scores; mask: [B, T] response mask (0/1); uid [B] group
        keys; entropies [B, T] and difficulty_ids [B] for ``mode: ares``; old_log_probs and
        ref_log_probs [B, T] with the KL on. Returns ``(token_rewards float32 [B, T],
        metrics dict)``; moves τ, the buckets and λ — or, on an error, nothing."""
        before = self.state_dict()
        try:
            return self._step(scores, mask, uid, entropies, difficulty_ids, old_log_probs, ref_log_probs, step)
        except BaseException:
            self.load_state_dict(before)
            raise

    def _step(self, scores, mask, uid, entropies, difficulty_ids, old_log_probs, ref_log_probs, step):
        import numpy as np

        from . import bucket_means, group_means, masked_dynamic_kl
        from .verl import _first_rows

        s = self.settings
        mask = np.ascontiguousarray(mask, dtype=np.float32)
        rows, cols = mask.shape
        if rows == 0:
            raise ValueError("ares step: an empty batch")
        lengths = mask.sum(axis=1)
        kw = {}
        if s["mode"] == "ares":
            if entropies is None or difficulty_ids is None:
                raise ValueError("ares step (mode ares): needs the per-token entropies and the difficulty ids")
            kw = dict(entropies=entropies, mask=mask, global_id=difficulty_ids)
            if s["kl"]["enable"] and (old_log_probs is None or ref_log_probs is None):
                raise ValueError("ares step (kl.enable): needs old_log_probs and ref_log_prob")
        out = self.shaper.shape_rewards(scores, lengths, uid, step=step, **kw)
        reward = np.asarray(out["reward"], dtype=np.float64)
        token = np.zeros((rows, cols), dtype=np.float32)
        last = _last_valid(mask)
        has = last >= 0
        token[np.nonzero(has)[0], last[has]] = reward[has].astype(np.float32)
        metrics = {
            "ares/score_mean": float(np.mean(scores)),
            "ares/acc": float(np.mean(out["correct"])),
            "ares/reward_mean": float(np.mean(reward)),
        }
        if s["mode"] == "ares":
            ctrl = self.shaper.controller
            diff = np.asarray(out["difficulty"], dtype=np.int64)
            metrics.update({
                "ares/tau": float(out["tau"]),
                "ares/hwe_count_mean": float(np.mean(out["hwe_count"])),
                "ares/entropy_reward_mean": float(np.mean(out["entropy_reward"])),
            })
            for d, name in enumerate(("easy", "medium", "hard")):
                metrics[f"ares/frac_{name}"] = float(np.mean(diff == d))
                target = ctrl.target(d)
                metrics[f"ares/target_{name}"] = float("nan") if target is None else float(target)
                metrics[f"ares/alpha_{name}"] = float(ctrl.alpha(d))
            if s["kl"]["enable"]:
                # β of each row: its bucket's λ_d in force during the step (it moves after)
                beta = np.array([ctrl.lambda_(int(d)) for d in diff], dtype=np.float32)
                kl = masked_dynamic_kl(
                    np.ascontiguousarray(old_log_probs, dtype=np.float32),
                    np.ascontiguousarray(ref_log_probs, dtype=np.float32),
                    mask,
                    beta,
                    hwe_mask=out["hwe_mask"] if s["kl"]["dynamic"] else None,
                    low_ratio=float(s["kl"]["low_ratio"]),
                    estimator=s["kl"]["estimator"],
                )
                token -= kl["weighted"]
                # KL_d: the mean over the bucket's samples of each sample's mean token KL;
                # λ_d's dual ascent as ares-runner moves it (the controller's step, KL only)
                per_group = group_means(kl["row_mean_kl"].astype(np.float64), uid=uid)
                kl_d = bucket_means(diff[_first_rows(uid)], per_group)
                ctrl.step(mean_hwe=None, mean_kl=kl_d, step=int(self.shaper.steps))
                metrics["ares/kl_mean"] = float(np.sum(kl["row_mean_kl"]) / max(1, int(has.sum())))
                metrics["ares/kl_penalty_mean"] = float(np.mean(kl["row_weighted_sum"]))
                for d, name in enumerate(("easy", "medium", "hard")):
                    metrics[f"ares/lambda_{name}"] = float(ctrl.lambda_(d))
        return token, metrics


def _last_valid(mask):
    """Index of each row's last 1 in ``mask`` (-1 for an empty row); multi-turn masks may
    have holes, so this is not ``length - 1``."""
    import numpy as np

    cols = mask.shape[1]
    rev = np.argmax(mask[:, ::-1] > 0, axis=1)
    last = cols - 1 - rev
    last[~(mask > 0).any(axis=1)] = -1
    return last


# ---------------------------------------------------------------- multi-trajectory groups


def final_session_rows(batch_keys):
    """verl v1's ``{uid}_{session}_{index}`` keys → ``(final_rows, row_to_final)``: the row of
    each session's last output (largest index), in order of first appearance, and for every
    row the position of its session in ``final_rows``."""
    last = {}
    order = []
    sessions = []
    for row, key in enumerate(batch_keys):
        parts = str(key).rsplit("_", 2)
        if len(parts) != 3:
            raise ValueError(f"ares: batch key {key!r} is not verl v1's '{{uid}}_{{session}}_{{index}}'")
        session, index = f"{parts[0]}_{parts[1]}", int(parts[2])
        sessions.append(session)
        if session not in last:
            order.append(session)
            last[session] = (index, row)
        elif last[session][0] < index:
            last[session] = (index, row)
    position = {session: i for i, session in enumerate(order)}
    return [last[session][1] for session in order], [position[s] for s in sessions]


def _multi_trajectory_wrapper(original, compute_advantage):
    """verl's ``compute_advantage_for_multi_trajectories`` with ares's outcome estimators
    treated as its ``grpo``: advantages from the final output of each session, the value at
    its first response token broadcast over every output of the session."""

    def wrapped(data, batch_keys, adv_estimator, *args, **kwargs):
        if str(adv_estimator) not in OUTCOME_ESTIMATORS:
            return original(data, batch_keys, adv_estimator, *args, **kwargs)
        import torch

        final_rows, row_to_final = final_session_rows(batch_keys)
        final = compute_advantage(data.select_idxs(final_rows), adv_estimator, *args, **kwargs)
        mask = final.batch["response_mask"]
        first = mask.argmax(dim=1)
        value = final.batch["advantages"][torch.arange(len(final_rows)), first]
        adv = value[torch.as_tensor(row_to_final)].unsqueeze(-1) * data.batch["response_mask"]
        data.batch["advantages"] = adv
        data.batch["returns"] = adv
        return data

    wrapped.__wrapped__ = original
    wrapped.__name__ = getattr(original, "__name__", "compute_advantage_for_multi_trajectories")
    return wrapped


def _norm_flag_wrapper(original):
    """verl's ``compute_advantage``, which passes ``norm_adv_by_std_in_grpo`` to its own GRPO
    only: for ``ares_grpo`` / ``ares_grpo_lambda`` called without a ``config`` (which would
    carry it), the flag is handed over as a one-key config."""
    import inspect

    sig = inspect.signature(original)

    def compute_advantage(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if str(a["adv_estimator"]) in ("ares_grpo", "ares_grpo_lambda") and a.get("config") is None:
            a["config"] = {"norm_adv_by_std_in_grpo": bool(a["norm_adv_by_std_in_grpo"])}
        return original(*bound.args, **bound.kwargs)

    compute_advantage.__wrapped__ = original
    compute_advantage.__doc__ = original.__doc__
    return compute_advantage


# ---------------------------------------------------------------- registration


def register_v1():
    """Registers the trainer modes, the ``ares`` reward-loop manager and the multi-trajectory
    treatment with verl's v1 trainer. Returns the registered trainer modes (empty when verl's
    v1 trainer cannot be imported here, e.g. without TransferQueue: then nothing changes)."""
    try:
        from verl.trainer.ppo import ray_trainer
        from verl.trainer.ppo.v1 import trainer_base
        from verl.trainer.ppo.v1 import utils as v1_utils
    except ImportError as e:  # verl installed without its v1 trainer's dependencies
        logger.debug("ares: verl's v1 trainer is not importable here (%s); trainer modes not registered", e)
        return []
    _wrap_validate_config()
    if getattr(ray_trainer.compute_advantage, "__wrapped__", None) is None:
        advantage = _norm_flag_wrapper(ray_trainer.compute_advantage)
        ray_trainer.compute_advantage = advantage
        v1_utils.compute_advantage = advantage  # imported there by name
    current = v1_utils.compute_advantage_for_multi_trajectories
    if getattr(current, "__wrapped__", None) is None:
        wrapped = _multi_trajectory_wrapper(current, ray_trainer.compute_advantage)
        # where verl defines it, and where its trainer imported it by name
        v1_utils.compute_advantage_for_multi_trajectories = wrapped
        trainer_base.compute_advantage_for_multi_trajectories = wrapped
    _register_reward_loop_manager()
    modes = []
    for mode, base in TRAINER_MODES.items():
        if mode not in trainer_base.TRAINER_REGISTRY:
            trainer_base.register_trainer(mode)(_trainer_class(trainer_base.get_trainer_cls(base), base))
        modes.append(mode)
    return modes


def check_config(config):
    """What ``verl.utils.config.validate_config`` adds once ares is registered, in the driver
    before Ray starts: a name starting with ``ares`` (estimator, policy loss, reward-loop
    manager, trainer mode) that ares did not register, an ``ares`` section without an ares
    trainer mode, and the ``ares`` settings of an ares trainer mode (:func:`settings_from_config`
    and the verl settings they cannot run with). Raises ``ValueError`` naming the key."""
    import difflib

    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    names = [
        ("algorithm.adv_estimator", core_algos.ADV_ESTIMATOR_REGISTRY),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", core_algos.POLICY_LOSS_REGISTRY),
        ("trainer.v1.trainer_mode", TRAINER_REGISTRY),
    ]
    if _get(config, "reward.reward_manager.source", "register") == "register":
        names.append(("reward.reward_manager.name", REWARD_MANAGER))
    for key, registry in names:
        value = _get(config, key, None)
        if value is None or not str(value).startswith("ares") or str(value) in registry:
            continue
        ours = sorted(k for k in registry if str(k).startswith("ares"))
        close = difflib.get_close_matches(str(value), ours, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"`{key}={value}` is not a name ares registers (it registers {ours}){hint}")
    mode = _get(config, "trainer.v1.trainer_mode", None)
    section = _ares_section(config)
    if mode in TRAINER_MODES:
        _check_verl_config(config, settings_from_config(section))
    elif section is not None:
        raise AresSettingsError(
            f"the `ares` settings are read by ares's trainer modes only, and trainer.v1.trainer_mode is {mode!r}: "
            f"set it to one of {sorted(TRAINER_MODES)}"
        )


def _wrap_validate_config():
    """Has verl's own config check (``main_ppo`` runs it before starting Ray) run
    :func:`check_config` first."""
    from verl.utils import config as verl_config

    original = verl_config.validate_config
    if getattr(original, "__wrapped__", None) is not None:
        return

    def validate_config(config, *args, **kwargs):
        check_config(config)
        return original(config, *args, **kwargs)

    validate_config.__wrapped__ = original
    validate_config.__doc__ = original.__doc__
    verl_config.validate_config = validate_config


def _register_reward_loop_manager():
    from verl.experimental.reward_loop.reward_manager import register
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER

    if "ares" in REWARD_MANAGER:
        return

    class AresRewardLoopManager(NaiveRewardManager):
        """verl's ``naive`` per-sample scoring for the ares trainer modes, which reshape the
        batch's rewards (ares.verl_v1); refused with any other trainer mode."""

        def __init__(self, config, tokenizer, compute_score, **kwargs):
            mode = _get(config, "trainer.v1.trainer_mode", None)
            if mode not in TRAINER_MODES:
                raise ValueError(
                    f"reward manager 'ares' scores samples for ares's trainer modes, which reshape the batch's "
                    f"rewards; trainer.v1.trainer_mode is {mode!r}: set it to one of {sorted(TRAINER_MODES)} "
                    f"(or use reward.reward_manager.name=naive)"
                )
            super().__init__(config, tokenizer, compute_score, **kwargs)

    register("ares")(AresRewardLoopManager)


def _get(config, dotted, default):
    node = config
    for part in dotted.split("."):
        try:
            node = node.get(part) if hasattr(node, "get") else getattr(node, part)
        except (AttributeError, KeyError):
            return default
        if node is None:
            return default
    return node


def _trainer_class(base, base_mode):
    """``base`` (verl's v1 trainer class of mode ``base_mode``) with the ARES step before its
    advantages."""

    class AresTrainer(base):
        # verl's trainer compares `self.trainer_mode` with its own mode names ("sync") and reads
        # `trainer.v1.<mode>` settings by it: it stays the base mode's name here
        trainer_mode = property(lambda self: base_mode, lambda self, value: None)

        def __init__(self, config):
            self.ares = AresStep(_ares_section(config))
            _check_verl_config(config, self.ares.settings)
            super().__init__(config)

        def _compute_advantage(self, batch, metrics):
            _ares_rewards(self, batch, metrics)
            return super()._compute_advantage(batch, metrics)

        def _save_checkpoint(self):
            # before verl's save, which marks the folder as the latest checkpoint last
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
            _write_state(folder, {"global_steps": self.global_steps, **self.ares.state_dict()})
            return super()._save_checkpoint()

        def _load_checkpoint(self):
            out = super()._load_checkpoint()
            if self.global_steps > 0:
                folder = _resumed_folder(self.config, self.global_steps)
                self.ares.load_state_dict(_read_state(folder))
            return out

    AresTrainer.__name__ = AresTrainer.__qualname__ = f"Ares{base.__name__}"
    AresTrainer.__module__ = __name__
    return AresTrainer


def _ares_section(config):
    return config.get("ares", None) if hasattr(config, "get") else None


def _check_verl_config(config, s):
    """What verl settings ARES cannot run with, refused before any rollout."""
    if s["kl"]["enable"] and bool(_get(config, "algorithm.use_kl_in_reward", False)):
        raise AresSettingsError(
            "`ares.kl.enable` and `algorithm.use_kl_in_reward` would both charge the KL in the reward: "
            "set `+ares.kl.enable=false` or `algorithm.use_kl_in_reward=false`"
        )
    if bool(_get(config, "algorithm.rollout_correction.bypass_mode", False)):
        raise AresSettingsError(
            "ARES reads the per-token entropies of verl's old-log-prob pass, which "
            "`algorithm.rollout_correction.bypass_mode=true` skips"
        )
    if s["kl"]["enable"]:
        from verl.trainer.ppo.utils import need_reference_policy

        if not _get(config, "actor_rollout_ref.actor.use_kl_loss", False) and not need_reference_policy(config):
            raise AresSettingsError(
                "`ares.kl.enable` needs the reference log-probs: set "
                "`actor_rollout_ref.actor.use_kl_loss=true` with `actor_rollout_ref.actor.kl_loss_coef=0` "
                "(verl then computes ref_log_prob; ares charges the KL) or `+ares.kl.enable=false`"
            )


def _ares_rewards(trainer, batch, metrics):
    """Steps 1–4 of the module docs on the TransferQueue's batch."""
    import numpy as np
    import torch
    from tensordict import TensorDict
    from verl.trainer.ppo.v1 import trainer_base

    tq = trainer_base.tq
    s = trainer.ares.settings
    key = s["difficulty_key"]
    fields = ["uid", "response_mask", "rm_scores"]
    if s["mode"] == "ares":
        fields += ["entropy", key]
    if s["kl"]["enable"]:
        fields += ["old_log_probs", "ref_log_prob"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    missing = [f for f in fields if f not in data.keys()]
    if missing:
        raise KeyError(f"ares: the batch has no field {missing} (it has {sorted(data.keys())})")
    nested_mask = data["response_mask"]
    padded = data.to_padded_tensor()
    uid_all = np.array(padded.pop("uid").tolist(), dtype=object)
    ids_all = np.array([str(x) for x in padded.pop(key).tolist()], dtype=object) if s["mode"] == "ares" else None
    mask_all = padded["response_mask"].float().cpu().numpy()
    rm = padded["rm_scores"].float().cpu().numpy()
    final_rows, row_to_final = final_session_rows(batch.keys)
    fr = np.asarray(final_rows)
    scores = rm[fr].sum(axis=1).astype(np.float64)
    kw = {}
    if s["mode"] == "ares":
        kw["entropies"] = padded["entropy"].float().cpu().numpy()[fr]
        kw["difficulty_ids"] = ids_all[fr]
    if s["kl"]["enable"]:
        kw["old_log_probs"] = padded["old_log_probs"].float().cpu().numpy()[fr]
        kw["ref_log_probs"] = padded["ref_log_prob"].float().cpu().numpy()[fr]
    token_final, m = trainer.ares(scores, mask_all[fr], uid_all[fr], step=int(trainer.global_steps), **kw)
    # the final output's rewards on its own row; earlier outputs of a session get the final
    # output's folded outcome (the sum of its token rewards, what GRPO groups) on their last
    # valid token, as verl's reward loop copies the score, and no KL of their own
    token = np.zeros_like(mask_all)
    last = _last_valid(mask_all)
    outcome = token_final.sum(axis=1)
    for row, f in enumerate(row_to_final):
        if row == final_rows[f]:
            token[row] = token_final[f]
        elif last[row] >= 0:
            token[row, last[row]] = outcome[f]
    new = torch.from_numpy(token).to(dtype=padded["rm_scores"].dtype)
    nested = trainer_base.response_to_nested(new, nested_mask)
    tq.kv_batch_put(
        keys=batch.keys,
        partition_id=batch.partition_id,
        fields=TensorDict({"rm_scores": nested}, batch_size=len(batch)),
    )
    metrics.update(m)


def _write_state(folder, state):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_state(folder):
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"ares: resuming from {folder}, which has no {STATE_FILE} (τ, the buckets, λ): it was not saved by an "
            f"ares trainer mode; resume with the trainer mode that wrote it, or start fresh (trainer.resume_mode=disable)"
        )
    with open(path) as f:
        return json.load(f)


def _resumed_folder(config, global_steps):
    folder = config.trainer.default_local_dir
    if config.trainer.resume_mode == "resume_path":
        folder = os.path.dirname(os.path.normpath(config.trainer.resume_from_path))
    if not os.path.isabs(folder):
        folder = os.path.join(os.getcwd(), folder)
    return os.path.join(folder, f"global_step_{global_steps}")
