#!/usr/bin/env python3
"""Make the tiny Hugging Face model fixtures of `ares-model` (tests/fixtures/models/).

Re-run from the repository root with any Python that has torch and transformers
(made with torch 2.9.1, transformers 4.57.6):

    /tmp/pyenv/bin/python scripts/make_hf_fixtures.py

Deterministic: fixed seeds, CPU, f32 math. Every model has 2 layers and grouped-query
attention (6 query heads, 2 key/value heads) with odd sizes (hidden 48, intermediate 80,
vocab 97), so a mixed-up dimension shows up as a shape error, not a silent pass.

Models (one directory each, written by `save_pretrained(..., safe_serialization=True)`):

* `qwen2_tiny`  Qwen2ForCausalLM, tied embeddings (no lm_head tensor), q/k/v biases, f32.
* `qwen3_tiny`  Qwen3ForCausalLM, explicit head_dim 12 (!= 48/6), q/k RMSNorm, untied,
                saved in **bf16**; the expected values are computed in f32 from the
                bf16-rounded weights (bf16 -> f32 is exact, so a loader sees the same numbers).
* `llama_tiny`  LlamaForCausalLM, untied, rope_scaling llama3, f32, **sharded**
                (`model.safetensors.index.json` + several shards).
* `llama_tiny_rope_parameters`  only a `config.json`: the llama_tiny config rewritten in the
                newer `rope_parameters` style (rope_theta and rope_scaling folded into one
                `rope_parameters` object, as transformers v5 writes it). Same model as
                llama_tiny; its weights are llama_tiny's.

Next to each model, `expected.safetensors` (f32 unless noted) holds, for two input sets
`right` (right padding) and `left` (left padding):

* `<set>.input_ids` [2, 7] i64, `<set>.attention_mask` [2, 7] i64 (1 = token, 0 = pad; pad
  ids are 0), `<set>.position_ids` [2, 7] i64: `right` uses 0..7 for both rows (what the
  model does without position_ids); `left` uses `cumsum(mask) - 1` with pads set to 1, as
  `generate` derives them.
* `<set>.logits` [2, 7, 97]: eager attention, f32. Logits at pad positions are whatever
  transformers computes there and are not meaningful; compare valid positions only.
* `<set>.loss` [] and `<set>.grad.<param name>`: the gradient of
      loss = sum_{b,t: mask[b,t]=1} sum_v logits[b,t,v] * W[b,t,v]
  with `<set>.W` [2, 7, 97] a fixed normal(0,1) tensor (so dloss/dlogits = W * mask),
  w.r.t. `model.embed_tokens.weight` (for tied qwen2 this includes the lm_head use),
  `model.layers.0.self_attn.q_proj.weight`, `model.layers.1.mlp.down_proj.weight`,
  `model.norm.weight`.

`params.json` per model: for every tensor of the checkpoint, its shape, first 4 values
(row-major, as f32) and its sum (f64), so a loader can be checked against transformers.

`scripts/check_hf_roundtrip.py` checks the other direction: checkpoints saved by
ares-runner load in transformers with the same parameters and logits.
"""

import json
import os
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent / "ares-model" / "tests" / "fixtures" / "models"
COMMON = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
GRAD_PARAMS = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
]


def randomize(model, seed):
    """Replace the tiny 0.02-std init by values that make the numbers non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (2, 7), generator=g)
    right_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    left_mask = torch.tensor([[1] * 7, [0] * 3 + [1] * 4])
    sets = {}
    for name, mask in (("right", right_mask), ("left", left_mask)):
        input_ids = torch.where(mask.bool(), ids, torch.zeros_like(ids))
        if name == "right":
            pos = torch.arange(7).unsqueeze(0).expand(2, 7).clone()
        else:
            pos = mask.long().cumsum(-1) - 1
            pos.masked_fill_(mask == 0, 1)
        w = torch.randn((2, 7, 97), generator=g)
        sets[name] = (input_ids, mask, pos, w)
    return sets


def expected(model, seed):
    out = {}
    params = dict(model.named_parameters())
    for name, (ids, mask, pos, w) in inputs(seed).items():
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        loss = (logits * w * mask.unsqueeze(-1)).sum()
        loss.backward()
        out[f"{name}.input_ids"] = ids.long()
        out[f"{name}.attention_mask"] = mask.long()
        out[f"{name}.position_ids"] = pos.long()
        out[f"{name}.W"] = w.float()
        out[f"{name}.logits"] = logits.detach().float()
        out[f"{name}.loss"] = loss.detach().float()
        for p in GRAD_PARAMS:
            out[f"{name}.grad.{p}"] = params[p].grad.detach().float().clone()
    return {k: v.contiguous() for k, v in out.items()}


def summary(directory):
    from safetensors import safe_open

    files = sorted(Path(directory).glob("model*.safetensors"))
    rows = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k).float()
                rows[k] = {
                    "shape": list(t.shape),
                    "first": [float(x) for x in t.flatten()[:4]],
                    "sum": float(t.double().sum()),
                }
    return dict(sorted(rows.items()))


def make(name, cls, config, seed, dtype=torch.float32, max_shard_size=None, generation=None):
    torch.manual_seed(seed)
    model = cls(config).eval()
    if generation is not None:
        model.generation_config = generation
    randomize(model, seed)
    model.to(dtype)
    out = ROOT / name
    if out.exists():
        shutil.rmtree(out)
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    # Expected values: f32 math on exactly the saved (possibly bf16-rounded) weights, from a
    # fresh f32 load (casting the bf16 model back would leave its RoPE inv_freq bf16-rounded).
    model = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    save_file(expected(model, seed + 1000), str(out / "expected.safetensors"))
    (out / "params.json").write_text(json.dumps(summary(out), indent=1) + "\n")
    return out


def main():
    torch.use_deterministic_algorithms(True)
    ROOT.mkdir(parents=True, exist_ok=True)
    eager = dict(attn_implementation="eager")

    qwen2 = Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=10000.0, **eager)
    # A generation_config.json like Qwen2.5-Instruct's: sampling on, eos a list.
    generation = GenerationConfig(
        bos_token_id=1,
        eos_token_id=[2, 96],
        pad_token_id=0,
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
        max_new_tokens=32,
    )
    make("qwen2_tiny", Qwen2ForCausalLM, qwen2, seed=1, generation=generation)

    qwen3 = Qwen3Config(
        **COMMON, head_dim=12, tie_word_embeddings=False, rope_theta=1000000.0, **eager
    )
    make("qwen3_tiny", Qwen3ForCausalLM, qwen3, seed=2, dtype=torch.bfloat16)

    llama3_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    llama = LlamaConfig(
        **COMMON,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=llama3_scaling,
        **eager,
    )
    out = make("llama_tiny", LlamaForCausalLM, llama, seed=3, max_shard_size="40KB")

    # The same llama config in the newer `rope_parameters` style.
    cfg = json.loads((out / "config.json").read_text())
    new = {}
    for k, v in cfg.items():
        if k == "rope_scaling":
            new["rope_parameters"] = {"rope_theta": cfg["rope_theta"], **v}
        elif k != "rope_theta":
            new[k] = v
    rp = ROOT / "llama_tiny_rope_parameters"
    if rp.exists():
        shutil.rmtree(rp)
    rp.mkdir()
    (rp / "config.json").write_text(json.dumps(new, indent=2) + "\n")

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    (ROOT / "README.md").write_text(
        "# Tiny Hugging Face model fixtures\n\n"
        "Generated by `scripts/make_hf_fixtures.py` (" + versions + "); do not edit by hand.\n"
        "Re-run from the repository root: `python scripts/make_hf_fixtures.py` with any Python\n"
        "that has torch and transformers.\n\n```text\n" + __doc__.strip() + "\n```\n"
    )
    print(versions)
    total = sum(f.stat().st_size for f in ROOT.rglob("*") if f.is_file())
    print(f"wrote {ROOT} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
