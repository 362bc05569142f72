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
3. with ``kl.enable``: the dynamic token-level KL, ``β_t = λ_d·(HWE ? low_ratio : 1)`` with
   the λ_d in force, charged where ``kl.placement`` says (docs/algorithms.md §4, "Placement"):
   ``loss`` (the default, as ares-runner's ``use_kl_loss``) — each token's weight ``β_t·m_t``
   goes to the actor as the batch field ``ares_kl_weights`` (the estimator's name in its extra
   info), and verl's actor loss, wrapped where its engine workers bind it, adds
   ``agg(β_t·k_t)`` between the current and the reference policy with the loss's own
   aggregation; ``reward`` — folded into the token rewards between the old and the reference
   policy, ``R_t = −β_t·k_t + [t = last valid token]·r`` (GRPO then groups the folded score
   ``r − Σ β_t·k_t``). Either way λ_d then moves by dual ascent on each bucket's mean KL
   between the old and the reference policy;
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
``ares.kl.enable`` (the KL would be charged twice), the KL in the loss without
``actor_rollout_ref.actor.use_kl_loss=true`` (no ``ref_log_prob`` in the actor's batch) or with
a non-zero ``kl_loss_coef`` (verl's fixed-coefficient term beside ares's), and the
rollout-correction bypass mode (no old-log-prob pass, hence no entropies).

**Bootstrap** (``ares.bootstrap``, default true in ``mode: ares``; docs/algorithms.md §2): before
the first step the whole training set is rolled out once, scored and given the old-log-prob
pass, with no update; :class:`AresBootstrap` then sets the first τ, the targets and every
prompt's difficulty (:func:`_ares_bootstrap`; saved as ``ares_bootstrap.json`` and reused by a
restart before the first checkpoint).

verl's padding rows (``is_padding`` in their tags) are left out of the step and the pass.

**Not built**: CUDA tensors are copied to the host (on the TaskRunner ``[B, T]`` per step; in the
actor's KL term four ``[b, T]`` per micro-batch).

**Dr.GRPO's flag.** verl's ``compute_advantage`` passes ``norm_adv_by_std_in_grpo`` to its own
GRPO only; for ``ares_grpo`` and ``ares_grpo_lambda`` called without a ``config`` the flag now
reaches them as a one-key config (with a config, they read it there, as before).

In multi-turn sessions every output's tokens are trained, so with ``kl.placement: loss`` each
output carries its own KL weights: its session's β (the final output's bucket) and its own HWE
tokens under the step's τ.

**Multi-trajectory groups.** verl's v1 trainer gives GRPO only the final output of each
session (``{uid}_{session}_{index}`` keys) and broadcasts its advantage to the session's other
outputs; any other estimator sees every output. ares's outcome estimators (``ares_grpo``,
``ares_rloo``, ``ares_reinforce_pro_max``, ``ares_grpo_lambda``) are given the same treatment
as verl's ``grpo`` (:func:`final_session_rows`).

**Reward-loop manager** ``ares`` (``reward.reward_manager.name=ares``): verl's ``naive``
per-sample scoring, refused with a message unless the trainer mode is an ares mode (the
batch-level shaping happens there). Any other manager works with the ares modes too.
"""

import collections
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
    "AresBootstrap",
    "AresStep",
    "StepOutput",
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
BOOTSTRAP_FILE = "ares_bootstrap.json"
PLACEMENTS = ("loss", "reward")
# what the TaskRunner hands the actor's loss with ``ares.kl.placement: loss``: the weight β_t·m_t
# of each response token's KL (a batch field), and the estimator's name (the batch's extra info)
KL_WEIGHTS_FIELD = "ares_kl_weights"
KL_ESTIMATOR_KEY = "ares_kl_estimator"

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
    # mode ares: roll out the whole training set once before the first update (no parameter
    # change) for the first τ, the targets and every prompt's difficulty (docs/algorithms.md §2)
    "bootstrap": True,
    "kl": {
        "enable": True,
        "estimator": "k3",
        "dynamic": True,  # HWE tokens weighted by low_ratio
        "low_ratio": 0.5,
        "placement": "loss",  # "loss": agg(β_t·k_t) in the actor's loss; "reward": folded into the rewards
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
    if not isinstance(s["bootstrap"], bool):
        raise AresSettingsError(f"`ares.bootstrap` must be true or false, got {s['bootstrap']!r}")
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
    if s["kl"]["placement"] not in PLACEMENTS:
        raise AresSettingsError(f"`ares.kl.placement` = {s['kl']['placement']!r}: use 'loss' or 'reward'")
    if s["mode"] == "grpo_lambda" and s["kl"]["enable"]:
        raise AresSettingsError(
            "`ares.kl.enable` needs `ares.mode: ares` (λ_d is per difficulty bucket); set `+ares.kl.enable=false` "
            "with grpo_lambda and use verl's KL"
        )
    return s


# ---------------------------------------------------------------- the per-step transform


StepOutput = collections.namedtuple("StepOutput", ["token_rewards", "metrics", "kl_weights", "beta", "tau"])
StepOutput.__doc__ = """What :meth:`AresStep.__call__` returns: ``token_rewards`` float32 [B, T]; ``metrics``;
with the KL on, ``beta`` float32 [B] (each row's λ_d in force during the step), and with
``kl.placement: loss`` ``kl_weights`` float32 [B, T] (β_t·m_t, what the actor's loss charges
each token's KL with; else ``None``); ``tau`` the τ the HWE tokens were counted with (``None``
in ``grpo_lambda`` mode)."""


class AresStep:
    """The ARES step on host arrays (module docs, steps 1–3), with its state. Testable without
    verl: :meth:`__call__` takes numpy arrays and returns a :class:`StepOutput`."""

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
        ref_log_probs [B, T] with the KL on. Returns a :class:`StepOutput`; moves τ, the
        buckets and λ — or, on an error, nothing."""
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
        kl_weights = beta = tau = None
        metrics = {
            "ares/score_mean": float(np.mean(scores)),
            "ares/acc": float(np.mean(out["correct"])),
            "ares/reward_mean": float(np.mean(reward)),
        }
        if s["mode"] == "ares":
            ctrl = self.shaper.controller
            diff = np.asarray(out["difficulty"], dtype=np.int64)
            tau = float(out["tau"])
            metrics.update({
                "ares/tau": tau,
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
                kl_hwe = out["hwe_mask"] if s["kl"]["dynamic"] else None
                kl = masked_dynamic_kl(
                    np.ascontiguousarray(old_log_probs, dtype=np.float32),
                    np.ascontiguousarray(ref_log_probs, dtype=np.float32),
                    mask,
                    beta,
                    hwe_mask=kl_hwe,
                    low_ratio=float(s["kl"]["low_ratio"]),
                    estimator=s["kl"]["estimator"],
                )
                if s["kl"]["placement"] == "reward":
                    token -= kl["weighted"]
                else:
                    kl_weights = self.kl_weights(beta, mask, hwe_mask=kl_hwe)
                # KL_d: the mean over the bucket's samples of each sample's mean token KL;
                # λ_d's dual ascent as ares-runner moves it (the controller's step, KL only)
                per_group = group_means(kl["row_mean_kl"].astype(np.float64), uid=uid)
                kl_d = bucket_means(diff[_first_rows(uid)], per_group)
                ctrl.step(mean_hwe=None, mean_kl=kl_d, step=int(self.shaper.steps))
                metrics["ares/kl_mean"] = float(np.sum(kl["row_mean_kl"]) / max(1, int(has.sum())))
                metrics["ares/kl_penalty_mean"] = float(np.mean(kl["row_weighted_sum"]))
                for d, name in enumerate(("easy", "medium", "hard")):
                    metrics[f"ares/lambda_{name}"] = float(ctrl.lambda_(d))
        return StepOutput(token, metrics, kl_weights, beta, tau)

    def hwe_mask(self, entropies, mask, tau):
        """The 0/1 HWE mask [B, T] of responses under a given τ (docs/algorithms.md §1): what
        the step computes for the rows it shapes, for rows it does not (the earlier outputs of
        a multi-turn session)."""
        import numpy as np

        from . import entropy_windows

        s = self.settings
        h = np.ascontiguousarray(entropies, dtype=np.float32)
        m = np.ascontiguousarray(mask, dtype=np.float32)
        out = entropy_windows(h, m, window_size=s["window_size"], includes_self=s["window_includes_self"], tau=tau)
        return out["hwe_mask"]

    def kl_weights(self, beta, mask, hwe_mask=None):
        """β_t·m_t [B, T] float32 (docs/algorithms.md §4's dynamic token-level KL): ``beta`` [B]
        each row's coefficient, ``hwe_mask`` [B, T] or ``None`` (no HWE discount, also when
        ``kl.dynamic`` is off)."""
        import numpy as np

        from . import dynamic_kl_weights

        s = self.settings
        if not s["kl"]["dynamic"]:
            hwe_mask = None
        return dynamic_kl_weights(
            np.ascontiguousarray(mask, dtype=np.float32),
            kl_coef=np.ascontiguousarray(beta, dtype=np.float32),
            hwe_mask=hwe_mask,
            low_ratio=float(s["kl"]["low_ratio"]),
        )


class AresBootstrap:
    """The bootstrap pass's host side (docs/algorithms.md §2) on numpy arrays, fed a batch at a
    time: :meth:`add` each batch of final outputs (whole uid groups), then :meth:`finish` sets
    the first τ (the median of every response's entropy-window percentile over the whole
    pass), each bucket's target ``T_d = round(h̄_d)`` (``h̄_d`` the mean HWE count under that
    τ over every sample of the bucket's prompts) and every prompt's difficulty in an
    :class:`AresStep` — what ares-runner's ``data.bootstrap`` does before its first update.

    Memory: each batch's entropies and mask are kept until :meth:`finish` (the HWE counts need
    the pass's τ), about 5 bytes a response token."""

    def __init__(self, settings=None):
        from . import BucketController

        self.settings = settings_from_config(settings)
        if self.settings["mode"] != "ares":
            raise AresSettingsError("the bootstrap pass sets ARES's targets: it needs `ares.mode: ares`")
        # classifies each batch's groups and remembers each prompt's bucket, apart from the
        # step's controller until finish()
        self.classifier = BucketController(**(self.settings["controller"] or {}))
        self._thresholds = []
        self._batches = []
        self.responses = 0
        self.correct = 0

    def add(self, scores, mask, uid, entropies, difficulty_ids):
        """One batch: ``scores`` [B] outcome scores, ``mask`` and ``entropies`` [B, T], ``uid``
        [B] group keys, ``difficulty_ids`` [B] each sample's prompt id."""
        import numpy as np

        from . import entropy_windows, row_percentile

        s = self.settings
        mask = np.ascontiguousarray(mask, dtype=np.float32)
        h = np.ascontiguousarray(entropies, dtype=np.float32)
        scores = np.ascontiguousarray(scores, dtype=np.float64)
        if mask.ndim != 2 or h.shape != mask.shape or scores.shape != (mask.shape[0],):
            raise ValueError(
                f"ares bootstrap: scores {scores.shape}, mask {mask.shape} and entropies {h.shape} "
                f"do not describe one batch of [B] and [B, T]"
            )
        if mask.shape[0] == 0:
            return
        correct = scores > s["correct_threshold"]
        ids = [str(g) for g in difficulty_ids]
        buckets = self.classifier.classify(correct, uid=uid, global_id=ids)
        w = entropy_windows(h, mask, window_size=s["window_size"], includes_self=s["window_includes_self"])
        thr, has = row_percentile(w["means"], w["valid"], s["percentile"])
        self._thresholds.append(np.asarray(thr, dtype=np.float32)[np.asarray(has) > 0])
        self._batches.append((h, mask.astype(bool), np.asarray(buckets, dtype=np.int64)))
        self.responses += int(mask.shape[0])
        self.correct += int(correct.sum())

    def finish(self, step):
        """Sets τ, the targets and every prompt's difficulty in ``step`` (an :class:`AresStep`)
        and returns what the pass found: ``tau``, ``targets`` (by bucket name), ``mean_hwe``,
        ``prompts``, ``responses``, ``accuracy``."""
        import numpy as np

        from . import batch_median_threshold, bucket_means, entropy_windows

        if self.responses == 0:
            raise ValueError("ares bootstrap: the pass rolled out no response (is the training set empty?)")
        s = self.settings
        thr = np.concatenate(self._thresholds) if self._thresholds else np.zeros(0, dtype=np.float32)
        tau = batch_median_threshold(thr, np.ones_like(thr)) if len(thr) else None
        counts, buckets = [], []
        for h, m, b in self._batches:
            # with no τ no response has a complete window, so no token is HWE whatever τ is
            w = entropy_windows(
                h, m.astype(np.float32), window_size=s["window_size"], includes_self=s["window_includes_self"],
                tau=0.0 if tau is None else tau,
            )
            counts.append(np.asarray(w["counts"], dtype=np.float64))
            buckets.append(b)
        mean_hwe = bucket_means(np.concatenate(buckets), np.concatenate(counts))
        shaper = step.shaper
        shaper.tau.restore(tau)
        shaper.controller.bootstrap(mean_hwe)
        difficulty = self.classifier.difficulty
        for gid, bucket in difficulty.items():
            shaper.controller.set_difficulty(gid, bucket)
        return {
            "tau": tau,
            "targets": shaper.controller.targets,
            "mean_hwe": mean_hwe,
            "prompts": len(difficulty),
            "responses": self.responses,
            "accuracy": self.correct / self.responses,
        }


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


# ---------------------------------------------------------------- the KL in the actor's loss


def kl_loss_np(log_prob, ref_log_prob, mask, weights, estimator="k3", loss_agg_mode="token-mean", info=None):
    """The KL term of the actor's loss on host arrays [B, T] of one float dtype:
    ``agg(w_t·k_t)`` with verl's aggregation ``loss_agg_mode`` and ``global_batch_info``
    (``info``), ``w_t`` the per-token weights (β_t·m_t), ``k_t`` ``estimator``'s KL between
    the policy and the reference (docs/algorithms.md §4, "Placement"). Returns ``(loss,
    ∂loss/∂logπ)``, or ``None`` for an empty mask."""
    import numpy as np

    from . import aggregate_weights, token_kl
    from .verl import _agg_scale

    mask = np.ascontiguousarray(mask)
    if float(mask.sum()) == 0.0:
        return None
    weights = np.ascontiguousarray(weights, dtype=mask.dtype)
    if weights.shape != mask.shape:
        raise ValueError(f"ares kl loss: `{KL_WEIGHTS_FIELD}` has shape {weights.shape}, the response mask {mask.shape}")
    bad = ~np.isfinite(weights) | (weights < 0)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"ares kl loss: `{KL_WEIGHTS_FIELD}`{list(at)} = {float(weights[at])}: weights must be finite and >= 0")
    out = token_kl(log_prob, ref_log_prob, mask, estimator=estimator)  # β = 1: k·m and dk/dlogπ·m
    scale = aggregate_weights(mask, loss_agg_mode) * weights
    scale *= _agg_scale(mask, loss_agg_mode, info or {})
    loss = float(np.sum(scale * out["kl"], dtype=np.float64))
    return loss, scale * out["grad"]


def ares_kl_loss(log_prob, ref_log_prob, response_mask, weights, estimator, loss_agg_mode, info):
    """:func:`kl_loss_np` on torch tensors, differentiable in ``log_prob`` (ares's kernels on
    host copies, as ares's policy losses: ``ares.verl``)."""
    import torch

    from .verl import _float_dtype, _host, _loss_fn

    dtype = _float_dtype(log_prob)
    args = [
        _host(t, "ares_kl_loss", name, dtype).numpy()
        for t, name in (
            (log_prob, "log_prob"), (ref_log_prob, "ref_log_prob"), (response_mask, "response_mask"),
            (weights, KL_WEIGHTS_FIELD),
        )
    ]
    res = kl_loss_np(*args, estimator=estimator, loss_agg_mode=loss_agg_mode, info=info)
    if res is None:
        return (log_prob * 0.0).sum(), 0.0
    loss, grad = res
    grad = torch.from_numpy(grad).to(device=log_prob.device, dtype=log_prob.dtype)
    return _loss_fn().apply(log_prob, loss, grad), loss


def _ppo_loss_wrapper(original):
    """verl's actor loss (``verl.workers.utils.losses.ppo_loss``) plus, for a batch that carries
    ares's per-token KL weights, ``agg(β_t·k_t)`` (:func:`ares_kl_loss`); any other batch gets
    verl's loss unchanged."""

    def ppo_loss(config, model_output, data, dp_group=None):
        loss, metrics = original(config, model_output, data, dp_group=dp_group)
        if KL_WEIGHTS_FIELD not in data.keys():
            return loss, metrics
        from verl.utils import tensordict_utils as tu
        from verl.utils.metric import AggregationType, Metric
        from verl.workers.utils.padding import no_padding_2_padding

        estimator = tu.get_non_tensor_data(data=data, key=KL_ESTIMATOR_KEY, default=None)
        if estimator is None:
            raise ValueError(f"ares kl loss: the batch has `{KL_WEIGHTS_FIELD}` but no `{KL_ESTIMATOR_KEY}`")
        if "ref_log_prob" not in data.keys():
            raise ValueError(
                "ares kl loss: the actor's batch has no ref_log_prob: set actor_rollout_ref.actor.use_kl_loss=true"
            )
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        fields = data.select("response_mask", "ref_log_prob", KL_WEIGHTS_FIELD).to_padded_tensor()
        term, value = ares_kl_loss(
            log_prob, fields["ref_log_prob"], fields["response_mask"], fields[KL_WEIGHTS_FIELD], estimator,
            config.loss_agg_mode, config.global_batch_info,
        )
        pg = metrics.get("actor/pg_loss")
        aggregation = getattr(pg, "aggregation", AggregationType.MEAN)
        metrics["ares_kl_loss"] = Metric(value=value, aggregation=aggregation)
        return loss + term, metrics

    ppo_loss.__wrapped__ = original
    ppo_loss.__doc__ = original.__doc__
    return ppo_loss


def _wrap_ppo_loss():
    """Puts :func:`_ppo_loss_wrapper` where verl defines ``ppo_loss`` and where its modules
    imported it by name (the engine workers bind it when their model is built, after the
    plugin ran)."""
    import importlib
    import sys

    from verl.workers.utils import losses

    original = losses.ppo_loss
    if getattr(original, "__wrapped__", None) is not None:
        return
    wrapped = _ppo_loss_wrapper(original)
    losses.ppo_loss = wrapped
    for name in ("verl.workers.engine_workers", "verl.trainer.distillation.losses"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
        if getattr(module, "ppo_loss", None) is original:
            module.ppo_loss = wrapped


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
    _wrap_ppo_loss()
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
            self._ares_resumed = False
            super().__init__(config)

        def on_train_begin(self):
            # after verl's validation, before the first step (and the async modes' warm-up)
            s = self.ares.settings
            if s["mode"] == "ares" and s["bootstrap"] and not self._ares_resumed:
                _ares_bootstrap(self, base_mode)
            return super().on_train_begin()

        def _compute_advantage(self, batch, metrics):
            _ares_rewards(self, batch, metrics)
            return super()._compute_advantage(batch, metrics)

        def _update_actor(self, batch, metrics):
            # the estimator the actor's loss charges the KL weights with (ares_kl_loss)
            s = self.ares.settings
            if s["mode"] == "ares" and s["kl"]["enable"] and s["kl"]["placement"] == "loss":
                batch.extra_info[KL_ESTIMATOR_KEY] = s["kl"]["estimator"]
            return super()._update_actor(batch, metrics)

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
                self._ares_resumed = True
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
    if s["kl"]["enable"] and s["kl"]["placement"] == "loss":
        actor = "actor_rollout_ref.actor"
        if not _get(config, f"{actor}.use_kl_loss", False):
            raise AresSettingsError(
                f"`ares.kl.placement: loss` charges the KL in the actor's loss, which needs ref_log_prob in the "
                f"actor's batch: set `{actor}.use_kl_loss=true` with `{actor}.kl_loss_coef=0`, or "
                f"`+ares.kl.placement=reward`"
            )
        coef = float(_get(config, f"{actor}.kl_loss_coef", 0.0))
        if coef != 0.0:
            raise AresSettingsError(
                f"`{actor}.kl_loss_coef={coef}` would charge verl's own KL term beside ares's per-token one "
                f"(`ares.kl.placement: loss`): set `{actor}.kl_loss_coef=0`"
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
    data, padded = _batch_fields(tq, batch, fields, "ares")
    nested_mask = data["response_mask"]
    uid_all = np.array(_values(padded.pop("uid")), dtype=object)
    ids_all = np.array([str(x) for x in _values(padded.pop(key))], dtype=object) if s["mode"] == "ares" else None
    mask_all = padded["response_mask"].float().cpu().numpy()
    rm = padded["rm_scores"].float().cpu().numpy()
    real, final_rows, row_to_final = _real_sessions(batch)
    fr = real[np.asarray(final_rows)]
    scores = rm[fr].sum(axis=1).astype(np.float64)
    kw = {}
    if s["mode"] == "ares":
        kw["entropies"] = padded["entropy"].float().cpu().numpy()[fr]
        kw["difficulty_ids"] = ids_all[fr]
    if s["kl"]["enable"]:
        kw["old_log_probs"] = padded["old_log_probs"].float().cpu().numpy()[fr]
        kw["ref_log_probs"] = padded["ref_log_prob"].float().cpu().numpy()[fr]
    res = trainer.ares(scores, mask_all[fr], uid_all[fr], step=int(trainer.global_steps), **kw)
    token_final = res.token_rewards
    # the final output's rewards on its own row; earlier outputs of a session get the final
    # output's folded outcome (the sum of its token rewards, what GRPO groups) on their last
    # valid token, as verl's reward loop copies the score, and no KL of their own; padding
    # rows keep zero rewards and weights
    token = np.zeros_like(mask_all)
    last = _last_valid(mask_all)
    outcome = token_final.sum(axis=1)
    for j, f in enumerate(row_to_final):
        row = real[j]
        if j == final_rows[f]:
            token[row] = token_final[f]
        elif last[row] >= 0:
            token[row, last[row]] = outcome[f]
    new = torch.from_numpy(token).to(dtype=padded["rm_scores"].dtype)
    fields = {"rm_scores": trainer_base.response_to_nested(new, nested_mask)}
    if res.kl_weights is not None:
        # every output's tokens are trained, so each row carries its own KL weights: the
        # session's β (its final output's bucket) and its own HWE tokens under the step's τ
        weights = np.zeros_like(mask_all)
        weights[fr] = res.kl_weights
        earlier = [j for j, f in enumerate(row_to_final) if j != final_rows[f]]
        other = real[np.asarray(earlier, dtype=np.int64)]
        if len(other):
            beta = res.beta[np.asarray(row_to_final)[earlier]]
            hwe = None
            if s["kl"]["dynamic"]:
                hwe = trainer.ares.hwe_mask(padded["entropy"].float().cpu().numpy()[other], mask_all[other], res.tau)
            weights[other] = trainer.ares.kl_weights(beta, mask_all[other], hwe_mask=hwe)
        fields[KL_WEIGHTS_FIELD] = trainer_base.response_to_nested(torch.from_numpy(weights), nested_mask)
    tq.kv_batch_put(
        keys=batch.keys,
        partition_id=batch.partition_id,
        fields=TensorDict(fields, batch_size=len(batch)),
    )
    metrics.update(res.metrics)


def _ares_bootstrap(trainer, base_mode):
    """The bootstrap pass (docs/algorithms.md §2) in a verl run: the whole training set, in
    order, ``data.train_batch_size`` prompts at a time, rolled out as a training step rolls out
    (``rollout.n`` samples, the training sampling settings), scored, and given the old-log-prob
    pass for its per-token entropies — no update. :class:`AresBootstrap` then sets the first τ,
    the targets and every prompt's difficulty. The result is saved as ``ares_bootstrap.json`` in
    ``trainer.default_local_dir`` and reused by a run that restarts before its first checkpoint
    with the same model, training files, set size and ``rollout.n`` (with
    ``trainer.resume_mode=disable`` it is made anew)."""
    import uuid

    import numpy as np
    from torch.utils.data import DataLoader
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.utils import tensordict_utils as tu

    tq = trainer_base.tq
    config = trainer.config
    s = trainer.ares.settings
    path = os.path.join(_local_dir(config), BOOTSTRAP_FILE)
    identity = {
        "model": str(_get(config, "actor_rollout_ref.model.path", "")),
        "train_files": [str(f) for f in _as_list(_get(config, "data.train_files", []))],
        "prompts": len(trainer.train_dataset),
        "n": int(_get(config, "actor_rollout_ref.rollout.n", 1)),
    }
    if config.trainer.resume_mode != "disable" and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("identity") == identity:
            trainer.ares.load_state_dict(saved["state"])
            print(f"ares bootstrap: reusing {path} (delete it to roll the training set out anew)", flush=True)
            return saved["result"]
        logger.warning("ares bootstrap: %s is of another run (%s); rolling the training set out anew", path,
                       saved.get("identity"))
    boot = AresBootstrap(s)
    key = s["difficulty_key"]
    loader = DataLoader(
        trainer.train_dataset,
        batch_size=int(config.data.train_batch_size),
        shuffle=False,
        drop_last=False,
        collate_fn=trainer_base.collate_fn,
        num_workers=0,
    )
    # a plain synchronous buffer of the pass's own: no group filtering, no refills from the
    # training dataloader, whose order the pass leaves untouched
    buffer = ReplayBuffer(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="wait",
        sampler_kwargs={},
        poll_interval=float(getattr(trainer.replay_buffer, "poll_interval", 2.0)),
    )
    total, done = len(trainer.train_dataset), 0
    for batch_dict in loader:
        batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch_dict["raw_prompt"]))], dtype=object)
        batch = tu.get_tensordict(batch_dict)
        tu.assign_non_tensor_data(batch, "global_steps", trainer.global_steps)
        tags = [{"is_prompt": True, "status": "pending", "global_steps": trainer.global_steps} for _ in range(len(batch))]
        tq.kv_batch_put(keys=list(batch["uid"]), partition_id="train", tags=tags)
        trainer.agent_loop_manager.generate_sequences(batch)
        meta, _ = buffer.sample(global_steps=trainer.global_steps, partition_id="train", batch_size=len(batch))
        try:
            _bootstrap_to_trainer(trainer, base_mode)
            metrics = {}
            if trainer.reward_loop_manager.reward_loop_worker_handles is None:
                meta = trainer._compute_reward_colocate(meta)
            meta = trainer._balance_batch(meta, metrics=metrics)
            # the base class's pass: the weights are the initial ones (no version bookkeeping)
            meta = trainer_base.PPOTrainer._compute_old_log_prob(trainer, meta, metrics)
            fields = ["uid", "response_mask", "rm_scores", "entropy", key]
            _, padded = _batch_fields(tq, meta, fields, "ares bootstrap")
            real, final_rows, _ = _real_sessions(meta)
            fr = real[np.asarray(final_rows)]
            boot.add(
                padded["rm_scores"].float().cpu().numpy()[fr].sum(axis=1),
                padded["response_mask"].float().cpu().numpy()[fr],
                np.array(_values(padded.pop("uid")), dtype=object)[fr],
                padded["entropy"].float().cpu().numpy()[fr],
                np.array([str(x) for x in _values(padded.pop(key))], dtype=object)[fr],
            )
        finally:
            tq.kv_clear(keys=meta.keys, partition_id=meta.partition_id)
        _bootstrap_to_rollout(trainer, base_mode)
        done += len(batch)
        print(f"ares bootstrap: {done}/{total} prompts rolled out", flush=True)
    result = boot.finish(trainer.ares)
    _write_json(path, {"identity": identity, "result": result, "state": trainer.ares.state_dict()})
    print(
        f"ares bootstrap: {result['responses']} responses, accuracy {100 * result['accuracy']:.1f}%, "
        f"τ = {result['tau']}, targets {result['targets']}",
        flush=True,
    )
    log = getattr(trainer, "logger", None)
    if log is not None:
        metrics = {"ares/bootstrap_acc": result["accuracy"]}
        if result["tau"] is not None:
            metrics["ares/bootstrap_tau"] = result["tau"]
        for name, target in result["targets"].items():
            if target is not None:
                metrics[f"ares/bootstrap_target_{name}"] = target
        log.log(data=metrics, step=max(0, int(trainer.global_steps) - 1))
    return result


def _bootstrap_to_trainer(trainer, base_mode):
    """The GPUs to the actor for the old-log-prob pass, as verl's own steps hand them over."""
    if base_mode == "separate_async":
        # the standalone rollout keeps its GPUs; hybrid replicas lent to generation come back
        from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

        if getattr(trainer, "current_mode", None) == HybridEngineMode.ROLLOUT:
            trainer.switch_to_trainer()
    else:
        trainer.checkpoint_manager.sleep_replicas()


def _bootstrap_to_rollout(trainer, base_mode):
    """The rollout replicas awake again with the (unchanged) weights, as after verl's validation."""
    if base_mode != "separate_async":
        # the version the replicas were given at start (fit() has already counted step 1)
        trainer.checkpoint_manager.update_weights(max(0, int(trainer.global_steps) - 1))


def _as_list(value):
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


def _local_dir(config):
    folder = config.trainer.default_local_dir
    return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)


def _batch_fields(tq, batch, fields, who):
    """``fields`` of the TransferQueue's ``batch``, as stored (ragged) and padded to
    ``[B, T]``; a ``KeyError`` names the missing ones."""
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    missing = [f for f in fields if f not in data.keys()]
    if missing:
        raise KeyError(f"{who}: the batch has no field {missing} (it has {sorted(data.keys())})")
    return data, data.to_padded_tensor()


def _values(field):
    """A non-tensor field of a TransferQueue batch as a plain list: depending on the
    TransferQueue and tensordict versions it comes back as a numpy array, a ``NonTensorStack``
    (``tolist``) or a tensordict ``LinkedList`` (a ``list`` subclass)."""
    return field.tolist() if hasattr(field, "tolist") else list(field)


def _real_sessions(batch):
    """``(real, final_rows, row_to_final)`` of a batch: the rows that are not verl's padding
    (``_balance_batch`` appends copies of a real row's prompt id with an empty response mask and
    ``is_padding`` in their tags, which must not be graded as a group of wrong answers), and
    :func:`final_session_rows` over those rows (positions into ``real``)."""
    import numpy as np

    tags = list(batch.tags) if batch.tags is not None else [{}] * len(batch.keys)
    real = np.array([i for i, tag in enumerate(tags) if not (tag or {}).get("is_padding", False)], dtype=np.int64)
    if len(real) == 0:
        raise ValueError(f"ares: the batch has no rows but verl's padding ({len(batch.keys)} padding rows)")
    final_rows, row_to_final = final_session_rows([batch.keys[i] for i in real])
    return real, final_rows, row_to_final


def _write_state(folder, state):
    _write_json(os.path.join(folder, STATE_FILE), state)


def _write_json(path, value):
    """``value`` as JSON at ``path``, whole or not at all (a temporary file renamed)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
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
    folder = _local_dir(config)
    if config.trainer.resume_mode == "resume_path":
        folder = os.path.dirname(os.path.normpath(config.trainer.resume_from_path))
        if not os.path.isabs(folder):
            folder = os.path.join(os.getcwd(), folder)
    return os.path.join(folder, f"global_step_{global_steps}")
