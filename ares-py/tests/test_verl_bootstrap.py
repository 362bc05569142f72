"""ares.verl_v1's bootstrap pass (docs/algorithms.md §2): on host arrays against a plain numpy
reading of §1–§2 (numpy + ares; CI runs these), and with verl 0.9.1 (where torch, verl and
TransferQueue import) the pass of an ``ares_sync`` trainer over a real TransferQueue, with
stand-ins for verl's rollout, actor and weight sync; also verl's padding rows in a step."""

import json
import os

import numpy as np
import pytest

from ares.verl_v1 import AresBootstrap, AresSettingsError, AresStep

WINDOW = 2


def batch(seed, groups=5, n=4, t=20, prefix="q"):
    """A batch of whole uid groups; entropies are multiples of 1/8 so window means are exact
    in float32 and float64 alike."""
    rng = np.random.default_rng(seed)
    b = groups * n
    uid = np.array([f"{prefix}{seed}-{i // n}" for i in rng.permutation(b)], dtype=object)
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    entropies = (rng.integers(0, 40, (b, t)) / 8.0 * mask).astype(np.float32)
    scores = rng.integers(0, 2, b).astype(np.float64)
    ids = np.array([f"id-{u}" for u in uid], dtype=object)
    return dict(scores=scores, mask=mask, uid=uid, entropies=entropies, ids=ids)


def reference(batches, window=WINDOW, q=95.0):
    """§1–§2 read plainly: window means over complete windows, each response's q-th
    percentile, their median τ, HWE counts under τ, buckets by group accuracy (3c ≥ 2n easy,
    3c ≥ n medium), h̄_d over the bucket's samples, T_d = round half to even."""
    means, thresholds = [], []
    for d in batches:
        for h, m in zip(d["entropies"].astype(np.float64), d["mask"]):
            t_max = len(m)
            w = [h[t + 1:t + 1 + window].mean() for t in range(t_max - window) if m[t:t + window + 1].all()]
            means.append(np.array(w))
            if w:
                thresholds.append(np.percentile(w, q))
    tau = float(np.median(thresholds))
    counts = np.array([float((w >= tau).sum()) for w in means])
    buckets, difficulty = [], {}
    for d in batches:
        for u, gid in zip(d["uid"], d["ids"]):
            rows = d["uid"] == u
            c, n = int((d["scores"][rows] > 0.5).sum()), int(rows.sum())
            bucket = "easy" if 3 * c >= 2 * n else "medium" if 3 * c >= n else "hard"
            buckets.append(bucket)
            difficulty[str(gid)] = bucket
    buckets = np.array(buckets)
    targets = {b: (float(np.round(counts[buckets == b].mean())) if (buckets == b).any() else None)
               for b in ("easy", "medium", "hard")}
    return tau, targets, difficulty


def bootstrapped(batches, settings=None):
    settings = settings or {"window_size": WINDOW, "kl": {"enable": False}}
    boot = AresBootstrap(settings)
    for d in batches:
        boot.add(d["scores"], d["mask"], d["uid"], d["entropies"], d["ids"])
    step = AresStep(settings)
    return step, boot.finish(step)


def test_the_pass_sets_the_first_tau_the_targets_and_each_prompts_difficulty():
    batches = [batch(s) for s in range(3)]
    step, result = bootstrapped(batches)
    tau, targets, difficulty = reference(batches)
    assert result["tau"] == pytest.approx(tau, rel=1e-6)
    assert step.shaper.tau.tau == result["tau"]
    assert result["targets"] == targets == step.shaper.controller.targets
    assert step.shaper.controller.difficulty == difficulty
    assert result["prompts"] == 15 and result["responses"] == 60
    correct = sum(int((d["scores"] > 0.5).sum()) for d in batches)
    assert result["accuracy"] == correct / 60
    # the first step counts its HWE tokens with the pass's τ, as after ares-runner's bootstrap
    d = batch(9)
    _, metrics, *_ = step(d["scores"], d["mask"], d["uid"], entropies=d["entropies"], difficulty_ids=d["ids"],
                          step=1)
    assert metrics["ares/tau"] == result["tau"]


def test_the_pass_does_not_depend_on_how_the_set_is_cut_into_batches():
    batches = [batch(s) for s in range(3)]
    whole = {k: np.concatenate([d[k] for d in batches]) for k in batches[0]}
    step_a, _ = bootstrapped(batches)
    step_b, _ = bootstrapped([whole])
    assert step_a.state_dict() == step_b.state_dict()


def test_without_complete_windows_there_is_no_tau_and_no_hwe_token():
    d = batch(4, t=2)  # no response is longer than the window
    step, result = bootstrapped([d])
    assert result["tau"] is None and step.shaper.tau.tau is None
    assert {k: v for k, v in result["targets"].items() if v is not None} == {
        k: 0.0 for k, v in result["mean_hwe"].items() if v is not None
    }


def test_bad_settings_and_empty_passes_are_refused():
    with pytest.raises(AresSettingsError, match="ares.bootstrap"):
        AresBootstrap({"bootstrap": "yes"})
    with pytest.raises(AresSettingsError, match="needs `ares.mode: ares`"):
        AresBootstrap({"mode": "grpo_lambda", "kl": {"enable": False}})
    boot = AresBootstrap()
    with pytest.raises(ValueError, match="no response"):
        boot.finish(AresStep())
    d = batch(1)
    with pytest.raises(ValueError, match="do not describe one batch"):
        boot.add(d["scores"][:-1], d["mask"], d["uid"], d["entropies"], d["ids"])


# ---------------------------------------------------------------- in a verl trainer


def _verl_v1():
    pytest.importorskip("torch")
    pytest.importorskip("verl")
    pytest.importorskip("transfer_queue")


@pytest.fixture(scope="module")
def tq_on_ray():
    _verl_v1()
    ray = pytest.importorskip("ray")
    import transfer_queue as tq

    import ares.verl as av

    av.register()
    # TransferQueue's controller and storage units each take a logical CPU
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    tq.init()
    yield tq
    tq.close()
    ray.shutdown()


def _trainer(folder, *overrides):
    from hydra import compose, initialize_config_module
    from verl.trainer.ppo.v1 import get_trainer_cls

    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            "trainer.v1.trainer_mode=ares_sync", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.train_batch_size=3",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0",
            "actor_rollout_ref.model.path=/models/stand-in", "data.train_files=[/data/train.parquet]",
            f"trainer.default_local_dir={folder}", f"+ares.window_size={WINDOW}", *overrides,
        ])
    return get_trainer_cls("ares_sync")(cfg)


class Tokenizer:
    eos_token_id = 2
    pad_token_id = 0


class Rollout:
    """verl's agent loop as the v1 trainer sees it: each prompt's n sessions written to the
    TransferQueue ({uid}_{session}_{turn} keys, ragged fields, trajectory tags), then the
    prompt marked finished. The second session of every third prompt takes two turns (the
    earlier output carries the final score, as verl's reward loop copies it)."""

    def __init__(self, tq, n=4):
        self.tq, self.n, self.calls = tq, n, 0
        self.full = {}  # key -> per-token entropies over prompt + response, as the actor returns them
        self.final = []  # (score, response entropies, uid, index) of each session's last output

    def generate_sequences(self, batch):
        import torch
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        self.calls += 1
        gs = batch["global_steps"]
        gs = int(getattr(gs, "data", gs))
        for uid, index in zip(list(batch["uid"]), list(batch["index"])):
            uid, index = str(uid), int(getattr(index, "data", index))
            rng = np.random.default_rng(index)
            keys, rows, tags = [], [], []
            for s in range(self.n):
                score = float(rng.integers(0, 2))
                turns = 2 if index % 3 == 0 and s == 1 else 1
                for turn in range(turns):
                    p, r = int(rng.integers(2, 6)), int(rng.integers(1, 12))
                    h = rng.integers(0, 40, r) / 8.0
                    rm = torch.zeros(r)
                    rm[-1] = score
                    key = f"{uid}_{s}_{turn}"
                    self.full[key] = np.concatenate([np.zeros(p - 1), h, np.zeros(1)]).astype(np.float32)
                    if turn == turns - 1:
                        self.final.append((score, h.astype(np.float32), uid, index))
                    keys.append(key)
                    rows.append(dict(
                        uid=uid, index=index, prompts=torch.ones(p, dtype=torch.int64),
                        responses=torch.full((r,), 7, dtype=torch.int64), response_mask=torch.ones(r, dtype=torch.int64),
                        input_ids=torch.ones(p + r, dtype=torch.int64), attention_mask=torch.ones(p + r, dtype=torch.int64),
                        rm_scores=rm, rollout_log_probs=torch.from_numpy(-h).float(),
                    ))
                    tags.append({"status": "success", "prompt_len": p, "response_len": r, "seq_len": p + r,
                                 "global_steps": gs})
            self.tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows), tags=tags)
            self.tq.kv_batch_put(keys=[uid], partition_id="train",
                                 tags=[{"is_prompt": True, "status": "finished", "global_steps": gs}])


class Actor:
    """The actor worker group's ``compute_log_prob``: entropies and log-probs over each row's
    prompt + response (nested), as verl's workers put them; zeros for padding rows."""

    _dispatch_info = {"actor": [0]}

    def __init__(self, tq, rollout):
        self.tq, self.rollout, self.rows = tq, rollout, 0

    def compute_log_prob(self, meta):
        import torch
        from tensordict import TensorDict

        data = self.tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                                    select_fields=["prompts", "responses"])
        lengths = (data["prompts"].offsets().diff() + data["responses"].offsets().diff()).tolist()
        ent = [torch.from_numpy(self.rollout.full.get(k, np.zeros(n, dtype=np.float32))) for k, n in
               zip(meta.keys, lengths)]
        nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
        self.tq.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=TensorDict(
            {"entropy": nested(ent), "log_probs": nested([-e for e in ent])}, batch_size=len(meta.keys)))
        self.rows += len(meta.keys)
        return meta


class Weights:
    def __init__(self):
        self.calls = []

    def sleep_replicas(self):
        self.calls.append("sleep")

    def update_weights(self, global_steps=None):
        self.calls.append(("update", global_steps))


class Rewards:
    reward_loop_worker_handles = ["scored during generation"]


def _wire(trainer, tq, prompts=7):
    rollout = Rollout(tq)
    trainer.train_dataset = [{"raw_prompt": [{"role": "user", "content": f"q{i}"}], "index": i} for i in range(prompts)]
    trainer.agent_loop_manager = rollout
    trainer.actor_rollout_wg = Actor(tq, rollout)
    trainer.checkpoint_manager = Weights()
    trainer.reward_loop_manager = Rewards()
    trainer.tokenizer = Tokenizer()
    trainer.global_steps = 1  # fit() counts step 1 before on_train_begin
    return rollout


def test_an_ares_sync_trainer_bootstraps_over_the_whole_training_set_before_step_one(tq_on_ray, tmp_path):
    tq = tq_on_ray
    trainer = _trainer(tmp_path)
    rollout = _wire(trainer, tq)
    trainer.on_train_begin()
    # 7 prompts in batches of 3, 3 and 1; 4 sessions each, padded to multiples of 8 rows
    assert rollout.calls == 3 and len(rollout.final) == 28
    assert trainer.actor_rollout_wg.rows == 16 + 16 + 8
    assert trainer.checkpoint_manager.calls == ["sleep", ("update", 0)] * 3
    listed = tq.kv_list() or {}
    assert not listed.get("train"), "the pass leaves nothing in the training partition"
    # what the pass computed equals the host pass over each session's final output
    boot = AresBootstrap(trainer.ares.settings)
    scores = np.array([f[0] for f in rollout.final])
    t = max(len(f[1]) for f in rollout.final)
    mask = np.array([[1.0] * len(f[1]) + [0.0] * (t - len(f[1])) for f in rollout.final], dtype=np.float32)
    ent = np.array([np.pad(f[1], (0, t - len(f[1]))) for f in rollout.final], dtype=np.float32)
    boot.add(scores, mask, np.array([f[2] for f in rollout.final], dtype=object), ent,
             np.array([str(f[3]) for f in rollout.final], dtype=object))
    want = AresStep(trainer.ares.settings)
    result = boot.finish(want)
    assert trainer.ares.state_dict() == want.state_dict()
    assert sorted(trainer.ares.shaper.controller.difficulty) == [str(i) for i in range(7)]
    saved = json.loads((tmp_path / "ares_bootstrap.json").read_text())
    assert saved["result"]["targets"] == result["targets"] and saved["identity"]["prompts"] == 7

    # a run restarted before its first checkpoint reuses the pass
    again = _trainer(tmp_path)
    rollout = _wire(again, tq)
    again.on_train_begin()
    assert rollout.calls == 0 and again.ares.state_dict() == trainer.ares.state_dict()
    # ... unless it starts afresh, or its training set differs
    for overrides, prompts in [(["trainer.resume_mode=disable"], 7), ([], 5)]:
        other = _trainer(tmp_path, *overrides)
        rollout = _wire(other, tq, prompts=prompts)
        other.on_train_begin()
        assert rollout.calls == (3 if prompts == 7 else 2)


def test_no_bootstrap_when_resumed_or_switched_off(tq_on_ray, tmp_path):
    tq = tq_on_ray
    trainer = _trainer(tmp_path, "+ares.bootstrap=false")
    rollout = _wire(trainer, tq)
    trainer.on_train_begin()
    assert rollout.calls == 0 and trainer.ares.shaper.tau.tau is None
    trainer = _trainer(tmp_path)
    rollout = _wire(trainer, tq)
    trainer._ares_resumed = True  # what _load_checkpoint sets after restoring ares_state.json
    trainer.on_train_begin()
    assert rollout.calls == 0 and not os.path.exists(tmp_path / "ares_bootstrap.json")


def test_verls_padding_rows_are_not_graded_as_a_group(tq_on_ray, tmp_path):
    """``_balance_batch`` pads a batch with copies of its first row's prompt id (empty response
    mask, ``is_padding`` tag): the step shapes the real rows alone, as if the padding were not
    there, and leaves the padding rows' rewards and KL weights at zero."""
    tq = tq_on_ray
    from tensordict import TensorDict
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import response_from_nested

    trainer = _trainer(tmp_path, "+ares.bootstrap=false")
    rollout = _wire(trainer, tq, prompts=2)
    batch = tu.get_tensordict({"uid": np.array(["pa", "pb"], dtype=object), "index": np.array([100, 101], dtype=object)})
    tu.assign_non_tensor_data(batch, "global_steps", 1)
    rollout.generate_sequences(batch)
    tq.kv_clear(keys=["pa", "pb"], partition_id="train")
    keys = sorted(rollout.full)
    lengths = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["prompts", "responses"])
    seq = (lengths["prompts"].offsets().diff() + lengths["responses"].offsets().diff()).tolist()
    meta = KVBatchMeta(keys=keys, tags=[{"seq_len": n} for n in seq], partition_id="train")
    padded = upsample_batch_to_divisible_size(meta, 16, Tokenizer.eos_token_id)
    assert len(padded) == 16 > len(keys)
    # the old-log-prob pass runs on the padded batch, as in verl's step
    trainer.actor_rollout_wg.compute_log_prob(padded)
    data = tq.kv_batch_get(keys=padded.keys, partition_id="train",
                           select_fields=["entropy", "response_mask", "rm_scores"])
    entropy = response_from_nested(data["entropy"], data["response_mask"])
    old = response_from_nested(-data["entropy"], data["response_mask"])
    raw = TensorDict({"rm_scores": data["rm_scores"], "entropy": entropy, "old_log_probs": old,
                      "ref_log_prob": old * 0.5}, batch_size=len(padded))
    tq.kv_batch_put(keys=padded.keys, partition_id="train", fields=raw)
    start = trainer.ares.state_dict()
    real = [row for row, tag in enumerate(padded.tags) if not tag.get("is_padding")]
    trainer._compute_advantage(KVBatchMeta(keys=[padded.keys[r] for r in real], tags=[padded.tags[r] for r in real],
                                           partition_id="train"), {})
    alone = trainer.ares.state_dict()
    want = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["rm_scores"])["rm_scores"]
    # the same rows with their padding, from the same state and the same raw scores
    trainer.ares.load_state_dict(start)
    tq.kv_batch_put(keys=padded.keys, partition_id="train", fields=raw.select("rm_scores"))
    trainer._compute_advantage(padded, {})
    assert trainer.ares.state_dict() == alone
    out = tq.kv_batch_get(keys=padded.keys, partition_id="train", select_fields=["rm_scores", "ares_kl_weights"])
    for row, tag in enumerate(padded.tags):
        if tag.get("is_padding"):
            assert float(out["rm_scores"][row].abs().sum()) == 0.0
            assert float(out["ares_kl_weights"][row].abs().sum()) == 0.0
        else:
            assert out["rm_scores"][row].tolist() == want[keys.index(padded.keys[row])].tolist()
    assert trainer.ares.shaper.controller.difficulty["100"] == alone["shaper"]["controller"]["difficulty"]["100"]
    tq.kv_clear(keys=padded.keys, partition_id="train")


def test_each_trainer_mode_hands_the_gpus_to_the_actor_and_back():
    """sync and colocate_async sleep the rollout replicas for the log-prob pass and wake them
    with the version they hold (as around verl's validation); separate_async switches a hybrid
    replica lent to generation back to the trainer and leaves the standalone rollout alone."""
    _verl_v1()
    from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

    from ares.verl_v1 import _bootstrap_to_rollout, _bootstrap_to_trainer

    for mode in ("sync", "colocate_async"):
        t = type("T", (), {})()
        t.checkpoint_manager, t.global_steps = Weights(), 1
        _bootstrap_to_trainer(t, mode)
        _bootstrap_to_rollout(t, mode)
        assert t.checkpoint_manager.calls == ["sleep", ("update", 0)], mode
    for current, switched in [(HybridEngineMode.ROLLOUT, 1), (HybridEngineMode.TRAINER, 0)]:
        t = type("T", (), {})()
        t.current_mode, t.switches, t.checkpoint_manager = current, 0, Weights()

        def switch(t=t):
            t.switches += 1

        t.switch_to_trainer = switch
        _bootstrap_to_trainer(t, "separate_async")
        _bootstrap_to_rollout(t, "separate_async")
        assert t.switches == switched and t.checkpoint_manager.calls == []
