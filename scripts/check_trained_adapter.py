#!/usr/bin/env python3
"""Check that a LoRA adapter trained by ares loads in peft and gives ares's model.

    ares-runner merge --model BASE --adapter RUN/checkpoints/step_N/adapter -o MERGED --dtype f32
    /work/venv-torch/bin/python scripts/check_trained_adapter.py BASE RUN/.../adapter MERGED

`PeftModel.from_pretrained` loads the adapter onto the base model; its logits on a batch of
random token ids must equal, to 1e-4 of their scale, the logits of the model ares merged
(`ares-runner merge`, whose merge equals ares's adapted forward pass: ares-model's
tests/lora_train.rs and tests/lora_vision.rs). A vision-language base (Qwen2-VL,
Qwen2.5-VL) gets one random 56×56 image among the tokens, so pairs on the vision tower count
too. Exit status 1 on failure.
"""

import json
import os
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText


def is_vl(path):
    with open(os.path.join(path, "config.json")) as f:
        return "vision_config" in json.load(f)


def load(path):
    cls = AutoModelForImageTextToText if is_vl(path) else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def inputs(model):
    """Three rows of random token ids; a vision-language model's first row holds an image."""
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    vocab = getattr(cfg, "vocab_size", None) or cfg.text_config.vocab_size
    if not hasattr(cfg, "vision_config"):
        return dict(input_ids=torch.randint(0, vocab, (3, 24), generator=g))
    v = cfg.vision_config
    special = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    ids = torch.randint(0, min(special) - 1, (1, 24), generator=g)
    grid = torch.tensor([[1, 4, 4]])  # 4 × 4 patches of 14 px: 56 × 56 pixels
    merge = v.spatial_merge_size
    pads = 16 // (merge * merge)
    row = [cfg.vision_start_token_id] + [cfg.image_token_id] * pads + [cfg.vision_end_token_id]
    ids = torch.cat([ids[:, :4], torch.tensor([row]), ids[:, 4:]], dim=1)
    patch_dim = v.in_chans * v.temporal_patch_size * v.patch_size * v.patch_size
    pixels = torch.randn(16, patch_dim, generator=g)
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == cfg.image_token_id).long(),
        pixel_values=pixels,
        image_grid_thw=grid,
    )


def main(base, adapter, merged):
    peft_model = PeftModel.from_pretrained(load(base), adapter).eval()
    ours = load(merged)
    x = inputs(ours)
    with torch.no_grad():
        want = peft_model(**x).logits
        got = ours(**x).logits
        base_logits = load(base)(**x).logits
    err = ((got - want).abs().max() / want.abs().max()).item()
    moved = ((base_logits - want).abs().max() / want.abs().max()).item()
    print(f"peft vs ares merged: max rel error {err:.2e}; the adapter moves the logits by {moved:.2e}")
    if err > 1e-4 or moved < 1e-3:
        print("FAILED")
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
