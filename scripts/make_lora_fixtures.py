#!/usr/bin/env python3
"""Make the PEFT LoRA adapter fixtures of `ares-model` (tests/fixtures/lora/).

Everything here is written by peft and transformers (made with peft 0.21.2, transformers
5.24.0, torch 2.15, CPU, f32); nothing of peft is re-implemented. Run from the repository
root after `scripts/make_hf_fixtures.py` (the base models are its tiny fixtures):

    /work/venv-torch/bin/pip install torch transformers peft
    /work/venv-torch/bin/python scripts/make_lora_fixtures.py

Adapters (one directory each, `PeftModel.save_pretrained`: `adapter_config.json` and
`adapter_model.safetensors`), on the base model named first:

* `qwen2_all`    qwen2_tiny, r = 4, lora_alpha = 8, every linear layer of the decoder
                 (q, k, v, o, gate, up, down).
* `llama_attn`   llama_tiny, r = 3, lora_alpha = 5, use_rslora (scale α/√r), q_proj and
                 v_proj only, layer 1 only (`layers_to_transform: [1]`).
* `qwen2_5_vl_lm` the tiny Qwen2.5-VL fixture (`tests/fixtures/vl/qwen2_5_vl_tiny`), r = 2,
                 lora_alpha = 4, the language model's q_proj, k_proj, v_proj and o_proj (the
                 tower's attention is `qkv`/`proj`: untouched). Its `expected.safetensors`
                 holds only `merged.model.language_model.layers.1.self_attn.q_proj.weight`
                 and `merged.model.language_model.layers.0.self_attn.o_proj.weight`
                 (`merge_and_unload`), in transformers' module names.

PEFT initialises B to zero (the adapter starts as the identity); these set A and B to
seeded normal values (std 0.02 / 0.05) so the adapter changes the logits.

`expected.safetensors` per adapter: `right.logits` [2, 7, 97] of the PeftModel (adapter on,
not merged) on the base model's `right` input set, and `right.base_logits` with the adapter
disabled (`with model.disable_adapter()`), and `merged.<param>` for one merged weight
(`merge_and_unload`), `model.layers.1.self_attn.q_proj.weight`.
"""

import os

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

MODELS = "ares-model/tests/fixtures/models"
OUT = "ares-model/tests/fixtures/lora"

CASES = [
    (
        "qwen2_all",
        "qwen2_tiny",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    ),
    (
        "llama_attn",
        "llama_tiny",
        dict(r=3, lora_alpha=5, use_rslora=True, target_modules=["q_proj", "v_proj"], layers_to_transform=[1]),
    ),
]

def seeded(peft_model):
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_A" in pname:
                p.normal_(0.0, 0.02)
            elif "lora_B" in pname:
                p.normal_(0.0, 0.05)


def sort_targets(out, targets=None):
    """peft writes target_modules from a set: sorted (or `targets`), so reruns match."""
    import json

    path = os.path.join(out, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["target_modules"] = sorted(targets or cfg["target_modules"])
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    readme = os.path.join(out, "README.md")
    if os.path.exists(readme):
        os.remove(readme)


torch.manual_seed(20261128)
for name, base, kwargs in CASES:
    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(MODELS, base), torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, bias="none", **kwargs))
    seeded(peft_model)
    out = os.path.join(OUT, name)
    peft_model.save_pretrained(out, safe_serialization=True)
    sort_targets(out)

    inputs = load_file(os.path.join(MODELS, base, "expected.safetensors"))
    ids = inputs["right.input_ids"]
    mask = inputs["right.attention_mask"]
    with torch.no_grad():
        logits = peft_model(input_ids=ids, attention_mask=mask).logits.float()
        with peft_model.disable_adapter():
            base_logits = peft_model(input_ids=ids, attention_mask=mask).logits.float()
    # the adapter as a loader would see it: reload from disk onto a fresh base
    fresh = AutoModelForCausalLM.from_pretrained(
        os.path.join(MODELS, base), torch_dtype=torch.float32, attn_implementation="eager"
    )
    reloaded = PeftModel.from_pretrained(fresh, out)
    with torch.no_grad():
        again = reloaded(input_ids=ids, attention_mask=mask).logits.float()
    assert torch.equal(again, logits), "reloaded adapter gives other logits"
    merged = reloaded.merge_and_unload()
    q = merged.state_dict()["model.layers.1.self_attn.q_proj.weight"].float().contiguous()
    save_file(
        {
            "right.logits": logits.contiguous(),
            "right.base_logits": base_logits.contiguous(),
            "merged.model.layers.1.self_attn.q_proj.weight": q,
        },
        os.path.join(out, "expected.safetensors"),
    )
    print(name, "max |Δlogits| from the adapter:", (logits - base_logits).abs().max().item())

# The vision-language model: its language model's attention only.
from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: E402

VL = "ares-model/tests/fixtures/vl/qwen2_5_vl_tiny"
vl = Qwen2_5_VLForConditionalGeneration.from_pretrained(VL, torch_dtype=torch.float32)
targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
peft_vl = get_peft_model(vl, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets))
seeded(peft_vl)
out = os.path.join(OUT, "qwen2_5_vl_lm")
peft_vl.save_pretrained(out, safe_serialization=True)
# ares reads module-name lists, not regexes: the same modules, listed
sort_targets(out, ["q_proj", "k_proj", "v_proj", "o_proj"])
merged = peft_vl.merge_and_unload().state_dict()
save_file(
    {
        f"merged.{k}": merged[k].float().contiguous()
        for k in [
            "model.language_model.layers.1.self_attn.q_proj.weight",
            "model.language_model.layers.0.self_attn.o_proj.weight",
        ]
    },
    os.path.join(out, "expected.safetensors"),
)
print("qwen2_5_vl_lm:", sorted(k for k in load_file(os.path.join(out, "adapter_model.safetensors")))[:2])

# The vision-language models with pairs on the vision tower, fed the VL fixtures' `image`
# case (`tests/fixtures/vl/<model>/expected.safetensors`).
from transformers import Qwen2VLForConditionalGeneration  # noqa: E402

VL_CASES = [
    # every linear layer but the LM head: the tower's qkv, attn.proj, SwiGLU MLP, merger too
    ("qwen2_5_vl_all", Qwen2_5_VLForConditionalGeneration, "qwen2_5_vl_tiny", dict(r=2, lora_alpha=4, target_modules="all-linear")),
    # the tower only, Qwen2-VL (LayerNorm, fc1/fc2): `proj` selects attn.proj and the patch
    # embedding's Conv3d; rsLoRA
    (
        "qwen2_vl_tower",
        Qwen2VLForConditionalGeneration,
        "qwen2_vl_tiny",
        dict(r=3, lora_alpha=5, use_rslora=True, target_modules=["qkv", "proj", "fc1", "mlp.0"]),
    ),
]
IMAGE_INPUTS = ["input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"]
for name, cls, base, kwargs in VL_CASES:
    vl_dir = os.path.join("ares-model/tests/fixtures/vl", base)
    model = cls.from_pretrained(vl_dir, torch_dtype=torch.float32)
    model.eval()
    peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, bias="none", **kwargs))
    seeded(peft_model)
    out = os.path.join(OUT, name)
    peft_model.save_pretrained(out, safe_serialization=True)
    sort_targets(out)
    fixture = load_file(os.path.join(vl_dir, "expected.safetensors"))
    inputs = {k: fixture[f"image.{k}"] for k in IMAGE_INPUTS}
    for k in ["input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"]:
        inputs[k] = inputs[k].long()
    with torch.no_grad():
        logits = peft_model(**inputs).logits.float()
        peft_model.base_model.model.model.rope_deltas = None
        with peft_model.disable_adapter():
            base_logits = peft_model(**inputs).logits.float()
    fresh = cls.from_pretrained(vl_dir, torch_dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(fresh, out)
    with torch.no_grad():
        again = reloaded(**inputs).logits.float()
    assert torch.equal(again, logits), f"{name}: reloaded adapter gives other logits"
    merged = reloaded.merge_and_unload().state_dict()
    keep = [
        k
        for k in merged
        if k
        in {
            "model.visual.blocks.1.attn.qkv.weight",
            "model.visual.patch_embed.proj.weight",
            "model.visual.merger.mlp.0.weight",
            "model.visual.blocks.0.mlp.gate_proj.weight",
            "model.language_model.layers.0.mlp.gate_proj.weight",
        }
    ]
    tensors = {"image.logits": logits.contiguous(), "image.base_logits": base_logits.contiguous()}
    tensors.update({f"merged.{k}": merged[k].float().contiguous() for k in keep})
    save_file(tensors, os.path.join(out, "expected.safetensors"))
    print(name, "max |Δlogits| from the adapter:", (logits - base_logits).abs().max().item(), "merged:", sorted(keep))
