"""ares.verl.AresRewardManager inside verl 0.9.1: DataProto in, reward tensor out, compared with
verl's own NaiveRewardManager on the same batch (runs where torch and verl import)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")

from verl import DataProto  # noqa: E402
from verl.workers.reward_manager import get_reward_manager_cls  # noqa: E402
from verl.workers.reward_manager.naive import NaiveRewardManager  # noqa: E402

import ares  # noqa: E402
import ares.verl as av  # noqa: E402


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(ground_truth in solution_str.split()), "pred_len": len(solution_str.split())}


def data_proto(seed, groups=4, n=4, p=5, t=12, entropies=True, global_id=True, uid=True):
    g = torch.Generator().manual_seed(seed)
    b = groups * n
    prompts = torch.randint(10, 20, (b, p), generator=g)
    responses = torch.randint(0, 10, (b, t), generator=g)
    lengths = torch.randint(3, t + 1, (b,), generator=g)
    resp_mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    attn = torch.cat([torch.ones(b, p, dtype=torch.long), resp_mask], dim=1)
    order = np.random.default_rng(seed).permutation(b)
    tensors = dict(prompts=prompts, responses=responses, attention_mask=attn, response_mask=resp_mask)
    if entropies:
        tensors["entropys"] = torch.rand(b, t, generator=g) * 2 * resp_mask
    ntb = {
        "reward_model": np.array([{"ground_truth": str(int(i) % 10)} for i in order], dtype=object),
        "data_source": np.array(["toy"] * b, dtype=object),
    }
    if uid:
        ntb["uid"] = np.array([f"u{int(i) // n}" for i in order], dtype=object)
    if global_id:
        ntb["index"] = np.array([int(i) // n for i in order], dtype=object)  # RLHFDataset's extra_info.index
    return DataProto.from_dict(tensors=tensors, non_tensors=ntb), lengths


def test_registered_as_ares():
    names = av.register()
    assert names["reward_managers"] == ["ares"]
    assert get_reward_manager_cls("ares") is av.AresRewardManager
    av.register()  # idempotent


def test_validate_equals_verls_naive_manager():
    data, _ = data_proto(0)
    want = NaiveRewardManager(Tok(), 0, compute_score)(data, return_dict=True)
    data.meta_info["validate"] = True
    got = av.AresRewardManager(Tok(), 0, compute_score)(data, return_dict=True)
    assert torch.equal(got["reward_tensor"], want["reward_tensor"])
    assert got["reward_extra_info"]["pred_len"] == want["reward_extra_info"]["pred_len"]
    assert want["reward_tensor"].sum() > 0


@pytest.mark.parametrize("batch_scoring", [False, True])
def test_grpo_lambda_rewards_on_the_last_token(batch_scoring):
    data, lengths = data_proto(1)
    naive = NaiveRewardManager(Tok(), 0, compute_score)(data)
    scores = naive.sum(-1).numpy().astype(np.float64)

    def batch_score(data_sources, solution_strs, ground_truths, extra_infos, **kw):
        return [compute_score(s, x, y, e) for s, x, y, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]

    m = av.AresRewardManager(
        Tok(), 0, batch_score if batch_scoring else compute_score, batch_scoring=batch_scoring, grpo_lambda=0.5
    )
    out = m(data, return_dict=True)
    want = ares.grpo_lambda_rewards(scores > 0.5, lengths.numpy().astype(np.float64), uid=data.non_tensor_batch["uid"], lambda_=0.5)
    r = out["reward_tensor"]
    assert r.dtype == torch.float32 and r.shape == data.batch["responses"].shape
    np.testing.assert_allclose(r.sum(-1).numpy(), want["rewards"], rtol=1e-7)
    last = r[torch.arange(len(lengths)), lengths - 1]  # the reward sits on each row's last valid token
    assert torch.equal(last, r.sum(-1)) and int((r != 0).sum()) == int((last != 0).sum())
    assert out["reward_extra_info"]["acc"] == [float(s > 0.5) for s in scores]
    assert m.steps == 1


def test_ares_mode_equals_the_numpy_core_and_uses_rm_scores():
    data, lengths = data_proto(2)
    data.meta_info["global_steps"] = 7
    m = av.AresRewardManager(Tok(), 0, compute_score, mode="ares")
    ref = av.AresRewardManager(Tok(), 0, compute_score, mode="ares")
    out = m(data, return_dict=True)
    scores = np.array(out["reward_extra_info"]["score"])
    want = ref.shape_rewards(
        scores,
        lengths.numpy(),
        data.non_tensor_batch["uid"],
        entropies=data.batch["entropys"].numpy(),
        mask=data.batch["response_mask"].float().numpy(),
        global_id=data.non_tensor_batch["index"],
        step=7,
    )
    np.testing.assert_allclose(out["reward_tensor"].sum(-1).numpy(), want["reward"], rtol=1e-7)
    assert out["reward_extra_info"]["hwe_count"] == [float(c) for c in want["hwe_count"]]
    assert m.steps == 7 and m.state_dict() == ref.state_dict()
    # rm_scores present: no scoring, the score is the row sum
    data2, _ = data_proto(3)
    data2.batch["rm_scores"] = NaiveRewardManager(Tok(), 0, compute_score)(data2)
    out2 = av.AresRewardManager(Tok(), 0, None, mode="grpo_lambda")(data2, return_dict=True)
    assert out2["reward_extra_info"]["score"] == list(data2.batch["rm_scores"].sum(-1).double().numpy())


@pytest.mark.parametrize(
    "kw, mode, match",
    [
        (dict(uid=False), "grpo_lambda", "non_tensor_batch\\['uid'\\] is missing"),
        (dict(entropies=False), "ares", "batch\\['entropys'\\] is missing"),
        (dict(global_id=False), "ares", "non_tensor_batch\\['index'\\] is missing"),
    ],
)
def test_missing_keys_are_named(kw, mode, match):
    data, _ = data_proto(4, **kw)
    with pytest.raises(KeyError, match=match):
        av.AresRewardManager(Tok(), 0, compute_score, mode=mode)(data)
