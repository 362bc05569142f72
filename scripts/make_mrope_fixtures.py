#!/usr/bin/env python3
"""Fixtures for the multimodal rotary positions (M-RoPE) of Qwen2-VL / Qwen2.5-VL
(ares-model/src/vision/mrope.rs, tested by ares-model/tests/vision_mrope.rs).

Run with the verl venv (transformers 5.24, torch 2.15 CPU); the venv stays outside the repo:

    /work/verl-venv/bin/python scripts/make_mrope_fixtures.py

Writes ares-model/tests/fixtures/mrope/mrope.json. Everything in it comes from transformers
itself, on tiny random models (one text layer, one vision block; the weights play no part):

  - the text side of the real processors (`Qwen2VLProcessor`, `Qwen2_5_VLProcessor`) with a
    small BPE tokenizer from the tokenizer fixtures plus the four vision special tokens: each
    case's prompt ids before expansion (the tokenizer on the raw text), the grids and
    `second_per_grid_ts` the image / video processors give for random pixels of chosen sizes,
    and the expanded `input_ids`, `attention_mask` and `mm_token_type_ids`;
  - `get_rope_index` of the model: `position_ids` [3, batch, seq] and `rope_deltas` [batch];
  - the decode positions of the next few generated tokens, from the model's
    `_prepare_position_ids_for_generation` with a cache that already holds the prompt;
  - cos / sin of the model's rotary embedding (`head_dim` values each, the layout
    transformers uses: the `head_dim/2` frequencies twice) at a few tokens of each case,
    plus one case of large positions that differ per axis.

Every case is one where transformers 5.24's rule for the text after a vision block
(`start + max(h, w) / merge`) and the original Qwen rule (max position so far + 1) agree,
except `video_rules_differ`, whose transformers positions the Rust test compares with its
own hand-computed ones to show exactly where they part.
"""

import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import (
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "ares-model", "tests", "fixtures", "mrope")
TOKENIZER = os.path.join(ROOT, "ares-model", "tests", "fixtures", "tokenizer", "qwen_style")
SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
MERGE = 2
TOKENS_PER_SECOND = 2  # the Qwen2.5-VL hub value (transformers' default is 4)
DECODE_STEPS = 3

# family -> text config of the tiny model: head_dim, theta and mrope_section differ on purpose.
FAMILIES = {
    # head_dim 128 with the hub's [16, 24, 24]
    "qwen2_vl": {"hidden_size": 256, "heads": 2, "theta": 10000.0, "mrope_section": [16, 24, 24]},
    # head_dim 32, a smaller split
    "qwen2_5_vl": {"hidden_size": 64, "heads": 2, "theta": 1000000.0, "mrope_section": [4, 6, 6]},
}

VIS = "<|vision_start|>{}<|vision_end|>"
IMG = VIS.format("<|image_pad|>")
VID = VIS.format("<|video_pad|>")

# name -> family, prompts, image sizes (h, w), videos (frames, h, w, fps)
CASES = {
    "text_only": ("qwen2_vl", ["hello there, how are you"], [], []),
    "one_image": ("qwen2_vl", [f"look {IMG} what is it"], [(56, 84)], []),
    "two_images": ("qwen2_vl", [f"a {IMG} b {IMG} which"], [(56, 84), (112, 56)], []),
    "one_image_qwen2_5": ("qwen2_5_vl", [f"see {IMG} ok"], [(84, 56)], []),
    # 8 frames at 3 fps: grid t 4, second_per_grid_ts 2/3, temporal step 4/3 (0, 1, 2, 4);
    # merged 4 x 6, so the temporal span (4) stays within the spatial one (5): rules agree.
    "one_video": ("qwen2_5_vl", [f"watch {VID} then"], [], [(8, 112, 168, 3.0)]),
    # fps 2.5: step 1.6 (0, 1, 3, 4), merged 6 x 4.
    "image_video": ("qwen2_5_vl", [f"i {IMG} v {VID} end"], [(56, 56)], [(8, 168, 112, 2.5)]),
    "image_video_qwen2": ("qwen2_vl", [f"i {VID} v {IMG} end"], [(84, 84)], [(6, 84, 112, 2.0)]),
    # left padding: the second prompt is shorter; images of both prompts, in order.
    "left_padding": (
        "qwen2_5_vl",
        [f"first prompt {IMG} is long {IMG} here", f"short {IMG}"],
        [(56, 84), (56, 56), (112, 84)],
        [],
    ),
    # 12 frames of 56 x 56 at 2 fps: grid [6, 4, 4], merged 2 x 2, temporal step 2: positions
    # 0, 2, ..., 10 -- transformers 5.24 continues at start + 2, the original rule at start + 11.
    "video_rules_differ": ("qwen2_5_vl", [f"v {VID} after"], [], [(12, 56, 56, 2.0)]),
}

# Large positions per axis (t, h, w) for cos / sin: the f32 angle rounding matters there.
BIG_POSITIONS = [[0, 7, 1000, 32767, 100000, 5], [0, 3, 999, 40000, 99999, 70000], [0, 11, 1001, 12345, 1, 123456]]


def tiny_model(family):
    f = FAMILIES[family]
    text = {
        "vocab_size": 512,
        "hidden_size": f["hidden_size"],
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": f["heads"],
        "num_key_value_heads": 1,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": f["theta"], "mrope_section": f["mrope_section"]},
    }
    if family == "qwen2_vl":
        vision = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 1,
                  "spatial_merge_size": MERGE}
        config = Qwen2VLConfig(text_config=text, vision_config=vision)
        model = Qwen2VLForConditionalGeneration(config)
    else:
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": f["hidden_size"],
                  "spatial_merge_size": MERGE, "tokens_per_second": TOKENS_PER_SECOND, "fullatt_block_indexes": [0]}
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.eval()
    return model


def processor(family):
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.add_tokens(SPECIALS, special_tokens=True)
    tok.padding_side = "left"
    ip = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 64, merge_size=MERGE)
    vp = Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 64, merge_size=MERGE)
    cls = Qwen2VLProcessor if family == "qwen2_vl" else Qwen2_5_VLProcessor
    return cls(image_processor=ip, video_processor=vp, tokenizer=tok), tok


class HeldCache:
    """Stands for a KV cache that already holds `n` tokens (all the position code asks)."""

    def __init__(self, n):
        self.n = n

    def get_seq_length(self, *args, **kwargs):
        return self.n


def ints(t):
    return [int(v) for v in t.reshape(-1).tolist()] if t.ndim <= 1 else [ints(r) for r in t]


def floats(t):
    return [float(v) for v in t.reshape(-1).tolist()] if t.ndim <= 1 else [floats(r) for r in t]


def run_case(name, family, prompts, images, videos, models, rng):
    model = models[family]
    proc, tok = processor(family)
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    imgs = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in images]
    vids = [rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8) for n, h, w, _ in videos]
    kwargs = {"text": prompts, "return_tensors": "pt", "padding": True}
    if imgs:
        kwargs["images"] = imgs
    if vids:
        # Frames as given (no sampling); the metadata carries the fps that second_per_grid_ts uses.
        kwargs["videos"] = vids
        kwargs["videos_kwargs"] = {
            "do_sample_frames": False,
            "cap_pixels_per_frame": False,
            "video_metadata": [{"fps": fps, "total_num_frames": n} for n, _, _, fps in videos],
        }
    out = proc(**kwargs)
    input_ids, mask, mm = out["input_ids"], out["attention_mask"], out["mm_token_type_ids"]
    image_grid = out.get("image_grid_thw")
    video_grid = out.get("video_grid_thw")
    spg = out.get("second_per_grid_ts")
    rope_kwargs = {"image_grid_thw": image_grid, "video_grid_thw": video_grid, "attention_mask": mask,
                   "mm_token_type_ids": mm}
    if family == "qwen2_5_vl":
        rope_kwargs["second_per_grid_ts"] = spg
    with torch.no_grad():
        position_ids, deltas = model.model.get_rope_index(input_ids, **rope_kwargs)

        # Decode: the prompt is in the cache; DECODE_STEPS more tokens, all valid.
        b, s = input_ids.shape
        model.model.rope_deltas = deltas
        ext_ids = torch.cat([input_ids, torch.zeros(b, DECODE_STEPS, dtype=input_ids.dtype)], dim=1)
        ext_mask = torch.cat([mask, torch.ones(b, DECODE_STEPS, dtype=mask.dtype)], dim=1)
        ext_mm = torch.cat([mm, torch.zeros(b, DECODE_STEPS, dtype=mm.dtype)], dim=1)
        dec = model._prepare_position_ids_for_generation(
            ext_ids, {"attention_mask": ext_mask, "cache": HeldCache(s), "mm_token_type_ids": ext_mm}
        )
        dec = dec.expand(3, -1, -1)[:, :, s:]

        # cos / sin at a few tokens of row 0: first, last, and the middle of each vision run.
        rotary = model.model.language_model.rotary_emb
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), position_ids)
    row_mm = mm[0].tolist()
    picks = {0, s - 1}
    start = None
    for i, v in enumerate(row_mm + [0]):
        if v and start is None:
            start = i
        if not v and start is not None:
            picks.add((start + i) // 2)
            picks.add(i - 1)
            start = None
    picks = sorted(picks)
    case = {
        "family": family,
        "spatial_merge_size": MERGE,
        "tokens_per_second": TOKENS_PER_SECOND if family == "qwen2_5_vl" else None,
        "head_dim": FAMILIES[family]["hidden_size"] // FAMILIES[family]["heads"],
        "rope_theta": FAMILIES[family]["theta"],
        "mrope_section": FAMILIES[family]["mrope_section"],
        "image_pad_id": ids["<|image_pad|>"],
        "video_pad_id": ids["<|video_pad|>"],
        "vision_start_id": ids["<|vision_start|>"],
        "vision_end_id": ids["<|vision_end|>"],
        "prompts": prompts,
        "prompt_ids": [tok(p)["input_ids"] for p in prompts],
        "image_grid_thw": ints(image_grid) if image_grid is not None else [],
        "video_grid_thw": ints(video_grid) if video_grid is not None else [],
        "second_per_grid_ts": floats(spg) if (spg is not None and family == "qwen2_5_vl") else None,
        "input_ids": ints(input_ids),
        "attention_mask": ints(mask),
        "mm_token_type_ids": ints(mm),
        "position_ids": ints(position_ids),
        "rope_deltas": ints(deltas.reshape(-1)),
        "decode_position_ids": ints(dec),
        "cos_sin_row": 0,
        "cos_sin_tokens": picks,
        "cos": [floats(cos[0, i]) for i in picks],
        "sin": [floats(sin[0, i]) for i in picks],
    }
    return case


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    os.makedirs(OUT, exist_ok=True)
    models = {f: tiny_model(f) for f in FAMILIES}
    cases = {}
    for name, (family, prompts, images, videos) in CASES.items():
        cases[name] = run_case(name, family, prompts, images, videos, models, rng)
        c = cases[name]
        print(name, "grids", c["image_grid_thw"], c["video_grid_thw"], "deltas", c["rope_deltas"], file=sys.stderr)

    big = {}
    for family, f in FAMILIES.items():
        pos = torch.tensor(BIG_POSITIONS, dtype=torch.long)[:, None, :]
        with torch.no_grad():
            cos, sin = models[family].model.language_model.rotary_emb(torch.zeros(1), pos)
        big[family] = {
            "head_dim": f["hidden_size"] // f["heads"],
            "rope_theta": f["theta"],
            "mrope_section": f["mrope_section"],
            "position_ids": BIG_POSITIONS,
            "cos": floats(cos[0]),
            "sin": floats(sin[0]),
        }

    doc = {
        "generator": "scripts/make_mrope_fixtures.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "decode_steps": DECODE_STEPS,
        "cases": cases,
        "big_positions": big,
    }
    path = os.path.join(OUT, "mrope.json")
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path}: {os.path.getsize(path)} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
