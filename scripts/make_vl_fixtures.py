#!/usr/bin/env python3
"""Tiny Qwen2-VL / Qwen2.5-VL model fixtures (ares-model/tests/fixtures/vl/).

Re-run from the repository root with the verl venv (made with torch 2.15.0 CPU,
transformers 5.24.0, tokenizers 0.23.3, pillow 13.0.0, numpy 2.4.6; the versions are also
written into vl/README.md and printed at the end):

    /work/verl-venv/bin/python scripts/make_vl_fixtures.py

Takes a few seconds. Deterministic (two runs give byte-identical files): fixed seeds, CPU,
one thread, f32 math, `attn_implementation="eager"` for the tower and the language model.
The directory is deleted and rewritten. All expected values come from transformers on a model
freshly loaded (f32, eager) from the files written here, so a loader reading the same files
sees exactly the same weights. The script asserts everything it claims below.

Files
=====

images/                     the inputs, PNG, RGB, smooth gradients plus a disc, a rectangle
                            and a line (no noise, so resizing is meaningful):
  image_56x84.png           case `image` (height 56, width 84; kept: 56 x 84, 4 x 6 patches)
  two_a_70x45.png           case `two_images`, first (70 x 45 -> 56 x 56: 70 / 28 = 2.5 rounds
                            half to even to 2, 45 / 28 = 1.6 rounds to 2)
  two_b_100x80.png          case `two_images`, second (100 x 80 -> 112 x 84)
  video_frame_0..3.png      case `video`: 4 frames of 56 x 56 (a yellow square moving over the
                            same picture)
cases.json                  per case: the chat messages, the prompt the chat template renders
                            (add_generation_prompt=True), the image files, the video frames and
                            fps; per model: sequence length, grids, second_per_grid_ts,
                            rope_delta, the greedy ids and text, the smallest top-1 margin of
                            the greedy steps. Also the special token ids and pixel bounds.
README.md                   this text

qwen2_vl_tiny/              Qwen2VLForConditionalGeneration in the Hub layout (as Qwen/Qwen2-VL-*):
  config.json               Hub layout: language-model fields at the top level, `rope_theta`,
                            `rope_scaling: {"type": "mrope", "mrope_section": [2, 3, 3]}`,
                            `vision_config` with `embed_dim`, `mlp_ratio`, `in_chans`, no
                            `rope_parameters`; transformers loads it to the same config
  model.safetensors         f32, the OLD Hub tensor names: `visual.*` (tower), `model.*`
                            (language model), `lm_head.weight`. transformers >= 4.52 writes
                            `model.visual.*` / `model.language_model.*`; the keys were renamed
                            after save_pretrained. transformers 5.24 still loads this checkpoint
                            (its load-time key conversion maps the old names), with no missing
                            or unexpected keys, bit-identical parameters and identical logits.
  preprocessor_config.json  Hub layout: flat `min_pixels` / `max_pixels` (no `size`) and no
                            video_preprocessor_config.json: transformers then builds the video
                            processor from this file too (same pixel bounds)
qwen2_5_vl_tiny/            Qwen2_5_VLForConditionalGeneration in the transformers 5 layout:
  config.json               as save_pretrained writes it (`text_config` with `rope_parameters`)
  model.safetensors         f32, the NEW names: `model.visual.*`, `model.language_model.*`,
                            `lm_head.weight`
  preprocessor_config.json  as transformers writes it (`size.shortest_edge` / `longest_edge`)
  video_preprocessor_config.json  the video processor's own file, as transformers writes it
both:
  generation_config.json    eos [293 <|im_end|>, 291 <|endoftext|>], bos / pad 291, no sampling
                            settings (greedy by default)
  tokenizer.json            byte-level BPE with Qwen2's pre-tokenizer regex: 256 bytes + 35
                            merges (trained on the prompts' words) = 291, then 8 added specials
  tokenizer_config.json     tokenizer_class Qwen2Tokenizer, eos <|im_end|>, pad <|endoftext|>,
                            no bos, and an inline Qwen2-VL-style chat template written for these
                            tests: a default system turn "You are a helpful assistant.", string
                            content as is, list content item by item: image items (type "image"
                            or an `image` / `image_url` key) -> <|vision_start|><|image_pad|>
                            <|vision_end|> (no spaces), video items -> <|vision_start|>
                            <|video_pad|><|vision_end|>, text items -> their text; optional
                            `add_vision_id` ("Picture n: " / "Video n: ")
  expected.safetensors      transformers' values, below
  params.json               for every checkpoint tensor (checkpoint names): shape, first 4
                            values (row-major, f32) and sum (f64)

Special token ids (vocab 299 = 291 BPE + 8 added, equal to the model's vocab_size):
<|endoftext|> 291, <|im_start|> 292, <|im_end|> 293, <|vision_start|> 294 (vision_start_token_id),
<|vision_end|> 295 (vision_end_token_id), <|vision_pad|> 296, <|image_pad|> 297
(image_token_id), <|video_pad|> 298 (video_token_id).

Models (random init, odd sizes)
===============================

Language model (both): hidden 48, 2 layers, 3 query heads, 1 key/value head (head_dim 16),
intermediate 80, q/k/v biases, vocab 299, untied lm_head, rms_norm_eps 1e-6, mrope_section
[2, 3, 3] (sums to head_dim / 2), rope_theta 1e6 (qwen2_vl_tiny) / 1e4 (qwen2_5_vl_tiny).
Qwen2-VL tower: depth 3, embed_dim 32, 2 heads (head_dim 16), mlp_ratio 2 (fc1 32 -> 64),
quick_gelu, LayerNorms, patch 14, temporal patch 2, merge 2, merger 128 -> 128 -> 48.
Qwen2.5-VL tower: depth 4, hidden 32, 2 heads, SwiGLU intermediate 48 with biases (silu),
RMSNorms, fullatt_block_indexes [1, 3] (blocks 0 and 2 use window attention), window_size 56
pixels = 2 x 2 merged units (4 x 4 patches) per window, tokens_per_second 2, out_hidden_size 48.
Weights (seed 38 for qwen2_vl_tiny, 16 for qwen2_5_vl_tiny): norm weights 1 + 0.2 N(0,1),
biases (LayerNorm ones too) 0.2 N(0,1), embed_tokens N(0,1), every other tensor
N(0,1) / sqrt(fan_in), fan_in = the product of all dims but the first (1176 for patch_embed).
The seeds are chosen so that no case's greedy continuation stops early or generates a special
token, and every greedy step's top-1 logit leads the runner-up by >= 0.01.

Processor: Qwen2VLImageProcessor (torchvision backend) / Qwen2VLVideoProcessor (AutoProcessor
on the model dir), min_pixels 56*56 = 3136, max_pixels 28*28*64 = 50176 (images and video),
patch 14, merge 2, temporal patch 2, OpenAI CLIP mean / std, bicubic. Images are opened with PIL and
`convert("RGB")`-ed; the video is its 4 frames as a uint8 array [4, 56, 56, 3], not sampled
(`do_sample_frames=False`), with metadata fps 2.5 and 4 frames (`cap_pixels_per_frame=False`,
which changes nothing at these sizes but silences a warning).

expected.safetensors (per model; f32 floats, i64 ids; every key prefixed `<case>.`)
===================================================================================

Cases (the same inputs for both models: same tokenizer and processor settings, so the
inputs are identical in the two files):
  image       user: [image_56x84, "Describe this picture."]          S 50, grid [1, 4, 6] (6 pads)
  two_images  user: ["Compare ", two_a, " with ", two_b, "."]        S 57, grids [1, 4, 4], [1, 8, 6] (4 + 12)
  video       user: [video, "What happens here?"]                    S 47, grid [2, 4, 4] (8 pads)
  text        user: "Tell me a story." (a string, no vision)          S 39

  input_ids [1, S] i64, attention_mask [1, S] i64 (all 1), mm_token_type_ids [1, S] i64
      (0 text, 1 image, 2 video): the processor's output, placeholders expanded.
  pixel_values [P, 1176] + image_grid_thw [n, 3] i64 (image cases); pixel_values_videos
      [P, 1176] + video_grid_thw [1, 3] i64 (video). 1176 = 3 channels * 2 frames * 14 * 14;
      patches in the processor's order (2 x 2 merge blocks together).
  second_per_grid_ts [1] f32 (qwen2_5_vl_tiny, video only) = temporal_patch_size / fps = 0.8;
      the temporal position step is tokens_per_second * 0.8 = 1.6, truncated: 0, 1.
  position_ids [3, 1, S] i64 and rope_deltas [1, 1] i64 from `model.model.get_rope_index`
      (also for `text`, where it gives arange(S) on all three axes and delta 0). The model's
      forward computes the same positions itself (asserted: identical logits either way).
  vision.last_hidden_state [P, 32]: the tower's output after its last block, before the
      merger. Qwen2-VL: in the processor's patch order. **Qwen2.5-VL: in window order**: the
      tower permutes merge units (groups of 4 consecutive patches) into windows before block 0
      and un-permutes only after the merger, so row j is patch 4 * window_index[j // 4] + j % 4.
  vision.window_index [P / 4] i64 and vision.cu_window_seqlens [windows + 1] i64
      (qwen2_5_vl_tiny only): that permutation and the window boundaries in patches
      (transformers' `get_vision_window_index`). image: [0, 1, 3, 4, 2, 5], [0, 16, 24] (a full
      2 x 2 window and a partial 2 x 1 one); two_images: second image's merged grid 4 x 3 gives
      partial windows; video: one window per frame, the identity.
  vision.merged [P / 4, 48]: the merger's output (pooler_output), in the original order for
      both models: the embeddings that replace the pad tokens, in order. For `two_images` one
      tower call on both images (grids concatenated), as the model does.
  logits_last [1, 299]: logits at the last prompt position (every case); image.logits
      [1, S, 299]: all positions (case `image` only).
  greedy [1, 8] i64: the new tokens of `model.generate(**inputs, do_sample=False,
      max_new_tokens=8)` (eos from generation_config; no case stops early).
  W [1, S, 299], loss [] and grad.<name> (cases `image` and `video`): the gradient of
      loss = sum_{t, v} logits[0, t, v] * W[0, t, v]   (all positions valid)
      with W a fixed N(0, 1) tensor (seed = model seed + 1000), w.r.t. EVERY vision-tower
      parameter and, of the language model, embed_tokens, layers.0.self_attn.q_proj.weight,
      layers.1.mlp.down_proj.weight, norm.weight and lm_head.weight. <name> is the tensor's
      name in that model's model.safetensors (`visual.blocks.0.attn.qkv.weight`,
      `model.embed_tokens.weight` in qwen2_vl_tiny; `model.visual.blocks.0.attn.qkv.weight`,
      `model.language_model.embed_tokens.weight` in qwen2_5_vl_tiny).

Notes on transformers 5.24
==========================
* get_rope_index continues the text after a vision block at start + max(h, w) / merge, not at
  the largest position + 1 (the original Qwen rule); the two agree for every case here (the
  video's temporal positions 0, 1 stay within its merged 2 x 2 grid).
* Qwen2.5-VL scales only video temporal positions (tokens_per_second * second_per_grid_ts,
  truncated after the multiply); images, and every Qwen2-VL video, use 0, 1, ...
* The Qwen2.5-VL processor takes second_per_grid_ts from the video metadata's sampled fps;
  without metadata it assumes 24 fps (0.0833 s per grid).
* Vision attention is per frame (per temporal patch) in both towers, in Qwen2.5-VL's
  full-attention blocks too; windows never cross a frame.
* The forward caches rope_deltas on the model (`model.model.rope_deltas`); the script resets
  it before every case. generate computes the prompt's positions and rope_deltas itself;
  decode positions are text positions + rope_delta.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import PIL
import tokenizers
import torch
import transformers
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)
from transformers.vision_utils import get_vision_window_index

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "ares-model" / "tests" / "fixtures" / "vl"

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

# Qwen2's pre-tokenizer regex (as in scripts/make_tokenizer_fixtures.py).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BPE_SIZE = 291  # 256 byte symbols + 35 merges
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
VOCAB = BPE_SIZE + len(SPECIALS)  # 299
IDS = {t: BPE_SIZE + i for i, t in enumerate(SPECIALS)}
EOS = IDS["<|im_end|>"]
PAD = IDS["<|endoftext|>"]

SYSTEM = "You are a helpful assistant."
CHAT_TEMPLATE = (
    "{#- Written for ares' VL fixtures: Qwen2-VL-style ChatML; image / video content items become "
    "vision blocks. -#}\n"
    "{%- set image_count = namespace(value=0) %}\n"
    "{%- set video_count = namespace(value=0) %}\n"
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "    {%- if message['content'] is string %}\n"
    "        {{- message['content'] }}\n"
    "    {%- else %}\n"
    "        {%- for content in message['content'] %}\n"
    "            {%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}\n"
    "                {%- set image_count.value = image_count.value + 1 %}\n"
    "                {%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}\n"
    "                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}\n"
    "            {%- elif content['type'] == 'video' or 'video' in content %}\n"
    "                {%- set video_count.value = video_count.value + 1 %}\n"
    "                {%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}\n"
    "                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}\n"
    "            {%- elif 'text' in content %}\n"
    "                {{- content['text'] }}\n"
    "            {%- endif %}\n"
    "        {%- endfor %}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def training_text():
    """The prompts' own words (the rendered chat turns without the special tokens), so the few
    merges shorten the prompts; plus a little filler."""
    texts = [SYSTEM, "Describe this picture.", "Compare", "with", "What happens here?", "Tell me a story."]
    lines = []
    for i in range(60):
        lines += ["system\n" + SYSTEM, "user\n" + texts[1 + i % 5], "assistant\n", " ".join(texts)]
    return lines


def build_tokenizer():
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    assert tok.get_vocab_size() == BPE_SIZE, tok.get_vocab_size()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    assert tok.get_vocab_size() == VOCAB
    for t, i in IDS.items():
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    return tok


def write_json(path, obj, indent=2):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=indent)
        f.write("\n")


def write_tokenizer(tok, out):
    tok.save(str(out / "tokenizer.json"))
    write_json(
        out / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "additional_special_tokens": SPECIALS[1:],
            "bos_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 4096,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 64
VIDEO_FPS = 2.5
# name -> (height, width)
IMAGES = {"image_56x84": (56, 84), "two_a_70x45": (70, 45), "two_b_100x80": (100, 80)}
VIDEO_FRAMES, VIDEO_SIZE = 4, (56, 56)


def picture(h, w, seed, t=None):
    """A smooth picture: per-channel linear / radial gradients, a filled disc, a rectangle and a
    diagonal line; `t` (a frame index) moves a square across the picture."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w, 3))
    img[..., 0] = 40 + 180 * xx / (w - 1)
    img[..., 1] = 30 + 190 * yy / (h - 1)
    img[..., 2] = 200 - 150 * np.hypot(yy - h / 2, xx - w / 2) / np.hypot(h / 2, w / 2)
    colors = rng.integers(0, 256, (3, 3))
    cy, cx, r = h * rng.uniform(0.3, 0.7), w * rng.uniform(0.3, 0.7), min(h, w) * rng.uniform(0.15, 0.3)
    img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = colors[0]
    y0, x0 = int(h * rng.uniform(0.05, 0.4)), int(w * rng.uniform(0.05, 0.4))
    img[y0 : y0 + h // 4, x0 : x0 + w // 3] = colors[1]
    img[np.abs((yy / h) - (xx / w)) < 0.03] = colors[2]
    if t is not None:
        s = h // 4
        oy, ox = 4 + 3 * t, 4 + 9 * t
        img[oy : oy + s, ox : ox + s] = [250, 250, 20]
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def write_inputs():
    d = ROOT / "images"
    d.mkdir(parents=True)
    files = {}
    for i, (name, (h, w)) in enumerate(IMAGES.items()):
        Image.fromarray(picture(h, w, seed=10 + i)).save(d / f"{name}.png", optimize=True)
        files[name] = f"images/{name}.png"
    frames = []
    for t in range(VIDEO_FRAMES):
        name = f"video_frame_{t}"
        Image.fromarray(picture(*VIDEO_SIZE, seed=20, t=t)).save(d / f"{name}.png", optimize=True)
        frames.append(f"images/{name}.png")
    return files, frames


def load_rgb(rel):
    return Image.open(ROOT / rel).convert("RGB")


def cases(files, frames):
    img = {"type": "image"}
    return {
        "image": {
            "messages": [{"role": "user", "content": [img, {"type": "text", "text": "Describe this picture."}]}],
            "images": [files["image_56x84"]],
        },
        "two_images": {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Compare "},
                        img,
                        {"type": "text", "text": " with "},
                        img,
                        {"type": "text", "text": "."},
                    ],
                }
            ],
            "images": [files["two_a_70x45"], files["two_b_100x80"]],
        },
        "video": {
            "messages": [
                {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens here?"}]}
            ],
            "video": {"frames": frames, "fps": VIDEO_FPS},
        },
        "text": {
            "messages": [{"role": "user", "content": "Tell me a story."}],
        },
    }


def processor_inputs(processor, case):
    prompt = processor.tokenizer.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=True)
    kwargs = {"text": [prompt], "return_tensors": "pt"}
    if "images" in case:
        kwargs["images"] = [load_rgb(f) for f in case["images"]]
    if "video" in case:
        v = case["video"]
        arr = np.stack([np.asarray(load_rgb(f)) for f in v["frames"]])
        kwargs["videos"] = [arr]
        kwargs["videos_kwargs"] = {
            "do_sample_frames": False,
            "cap_pixels_per_frame": False,
            "video_metadata": [{"fps": v["fps"], "total_num_frames": len(v["frames"])}],
        }
    return prompt, processor(**kwargs)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=PAD,
    eos_token_id=EOS,
    pad_token_id=PAD,
)
TOKEN_IDS = dict(
    image_token_id=IDS["<|image_pad|>"],
    video_token_id=IDS["<|video_pad|>"],
    vision_start_token_id=IDS["<|vision_start|>"],
    vision_end_token_id=IDS["<|vision_end|>"],
)
MROPE = [2, 3, 3]
LM_GRADS = [
    "embed_tokens.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.1.mlp.down_proj.weight",
    "norm.weight",
]


def qwen2_vl_config():
    text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": MROPE})
    vision = dict(
        depth=3,
        embed_dim=32,
        hidden_size=48,
        num_heads=2,
        mlp_ratio=2,
        hidden_act="quick_gelu",
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
    )
    return Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False, attn_implementation="eager", **TOKEN_IDS
    )


def qwen2_5_vl_config():
    text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": MROPE})
    vision = dict(
        depth=4,
        hidden_size=32,
        num_heads=2,
        intermediate_size=48,
        hidden_act="silu",
        fullatt_block_indexes=[1, 3],
        window_size=56,
        out_hidden_size=48,
        tokens_per_second=2,
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
    )
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False, attn_implementation="eager", **TOKEN_IDS
    )


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or "ln_q.weight" in name:
                if name.endswith(".bias"):
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = int(np.prod(p.shape[1:]))
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


def old_name(name):
    """transformers >= 4.52 name -> Hub (Qwen/Qwen2-VL-*) name."""
    if name.startswith("model.visual."):
        return name[len("model.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def hub_config(cfg):
    """transformers 5 config.json -> the Hub layout of Qwen/Qwen2-VL-*."""
    text = dict(cfg["text_config"])
    rope = text.pop("rope_parameters")
    for k in ["model_type", "layer_types", "dtype"]:
        text.pop(k, None)
    vision = {k: v for k, v in cfg["vision_config"].items() if k not in ("rope_parameters", "model_type", "in_channels")}
    vision["in_chans"] = cfg["vision_config"]["in_channels"]
    vision["spatial_patch_size"] = cfg["vision_config"]["patch_size"]
    out = {"architectures": cfg["architectures"], "model_type": cfg["model_type"]}
    out.update(text)
    out.update({k: cfg[k] for k in TOKEN_IDS})
    out["vision_token_id"] = IDS["<|vision_pad|>"]
    out["rope_theta"] = rope["rope_theta"]
    out["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    out["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    out["torch_dtype"] = "float32"
    out["transformers_version"] = cfg["transformers_version"]
    out["vision_config"] = vision
    return dict(sorted(out.items()))


def write_processor_files(out, hub):
    ip = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2)
    vp = Qwen2VLVideoProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2)
    processor_class = "Qwen2VLProcessor" if hub else "Qwen2_5_VLProcessor"
    if hub:
        # As on the Hub: flat min_pixels / max_pixels, one file for images and videos.
        write_json(
            out / "preprocessor_config.json",
            {
                "min_pixels": MIN_PIXELS,
                "max_pixels": MAX_PIXELS,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": list(ip.image_mean),
                "image_std": list(ip.image_std),
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": processor_class,
            },
        )
    else:
        ip.save_pretrained(out)
        vp.save_pretrained(out)
        for f in ["preprocessor_config.json", "video_preprocessor_config.json"]:
            cfg = json.loads((out / f).read_text())
            cfg["processor_class"] = processor_class
            write_json(out / f, cfg)


def build(name, cls, config, seed, hub):
    out = ROOT / name
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomize(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=PAD, eos_token_id=[EOS, PAD], pad_token_id=PAD)
    model.save_pretrained(out, safe_serialization=True)
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if hub:
        st = load_file(str(out / "model.safetensors"))
        renamed = {old_name(k): v.contiguous() for k, v in st.items()}
        assert len(renamed) == len(st)
        assert any(k.startswith("visual.") for k in renamed) and any(k.startswith("model.layers.") for k in renamed)
        (out / "model.safetensors").unlink()
        save_file(dict(sorted(renamed.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        write_json(out / "config.json", hub_config(cfg))
    write_processor_files(out, hub)
    write_tokenizer(build_tokenizer(), out)
    return out, reference


def summary(path):
    rows = {}
    with safe_open(str(path), "pt") as st:
        for k in st.keys():
            t = st.get_tensor(k).float()
            rows[k] = {
                "shape": list(t.shape),
                "first": [float(x) for x in t.flatten()[:4]],
                "sum": float(t.double().sum()),
            }
    return dict(sorted(rows.items()))


# ---------------------------------------------------------------------------------------------
# Expected values
# ---------------------------------------------------------------------------------------------

MODEL_INPUTS = [
    "input_ids",
    "attention_mask",
    "mm_token_type_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
]
GRAD_CASES = ["image", "video"]
MAX_NEW = 8


def expected(model, processor, all_cases, hub, seed, is_25):
    to_ckpt = old_name if hub else (lambda n: n)
    lm = "model.language_model."
    grad_names = [n for n, _ in model.named_parameters() if n.startswith("model.visual.")]
    grad_names += [lm + n for n in LM_GRADS] + ["lm_head.weight"]
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(seed)
    out, prompts, info = {}, {}, {}
    for case, spec in all_cases.items():
        prompt, inputs = processor_inputs(processor, spec)
        prompts[case] = prompt
        # transformers' tokenizer = the raw `tokenizers` one on the unexpanded prompt.
        raw = Tokenizer.from_file(str(processor.tokenizer.name_or_path) + "/tokenizer.json")
        assert processor.tokenizer(prompt)["input_ids"] == raw.encode(prompt).ids, case
        inputs = {k: v for k, v in inputs.items() if k in MODEL_INPUTS}
        if not is_25:
            inputs.pop("second_per_grid_ts", None)
        elif "second_per_grid_ts" in inputs:
            inputs["second_per_grid_ts"] = torch.as_tensor(inputs["second_per_grid_ts"], dtype=torch.float32)
        extra = set(inputs) - set(MODEL_INPUTS)
        assert not extra, extra
        p = f"{case}."
        for k, v in inputs.items():
            out[p + k] = v.float() if v.is_floating_point() else v.long()
        ids = inputs["input_ids"]
        seq = ids.shape[1]

        rope_kwargs = {
            "mm_token_type_ids": inputs["mm_token_type_ids"],
            "image_grid_thw": inputs.get("image_grid_thw"),
            "video_grid_thw": inputs.get("video_grid_thw"),
            "attention_mask": inputs["attention_mask"],
        }
        if is_25:
            rope_kwargs["second_per_grid_ts"] = inputs.get("second_per_grid_ts")
        with torch.no_grad():
            pos, deltas = model.model.get_rope_index(ids, **rope_kwargs)
        out[p + "position_ids"] = pos.long()
        out[p + "rope_deltas"] = deltas.long().reshape(1, 1)

        # Vision tower alone.
        for kind, pix, grid in [("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")]:
            if pix in inputs:
                with torch.no_grad():
                    vo = model.model.visual(inputs[pix], grid_thw=inputs[grid])
                out[p + "vision.last_hidden_state"] = vo.last_hidden_state.float()
                out[p + "vision.merged"] = vo.pooler_output.float()
                if is_25:
                    vc = model.config.vision_config
                    wi, cu = get_vision_window_index(
                        inputs[grid], spatial_merge_size=vc.spatial_merge_size, window_size=vc.window_size, patch_size=vc.patch_size
                    )
                    out[p + "vision.window_index"] = wi.long()
                    out[p + "vision.cu_window_seqlens"] = cu.long()
                    # last_hidden_state is in window order: the merger on it, un-permuted, is merged.
                    with torch.no_grad():
                        again = model.model.visual.merger(vo.last_hidden_state)[torch.argsort(wi)]
                    assert torch.equal(again, vo.pooler_output), case
                else:
                    with torch.no_grad():
                        assert torch.equal(model.model.visual.merger(vo.last_hidden_state), vo.pooler_output), case
                n_pad = int((ids == model.config.image_token_id).sum() + (ids == model.config.video_token_id).sum())
                assert vo.pooler_output.shape[0] == n_pad, (vo.pooler_output.shape, n_pad)

        # Logits (and gradients).
        model.zero_grad()
        model.model.rope_deltas = None
        grad = case in GRAD_CASES
        with torch.set_grad_enabled(grad):
            logits = model(**inputs).logits
        assert logits.shape == (1, seq, VOCAB), logits.shape
        # The forward's own 3-D positions are get_rope_index's (checked through the logits).
        with torch.no_grad():
            model.model.rope_deltas = None
            again = model(**inputs, position_ids=pos).logits
        assert torch.equal(again, logits.detach()), case
        out[p + "logits_last"] = logits[:, -1].detach().float()
        if case == "image":
            out[p + "logits"] = logits.detach().float()
        if grad:
            w = torch.randn((1, seq, VOCAB), generator=g)
            loss = (logits * w).sum()
            loss.backward()
            out[p + "W"] = w
            out[p + "loss"] = loss.detach().float()
            for n in grad_names:
                gr = params[n].grad
                assert gr is not None, n
                out[p + "grad." + to_ckpt(n)] = gr.detach().float().clone()
            model.zero_grad()

        # Greedy continuation.
        model.model.rope_deltas = None
        with torch.no_grad():
            gen = model.generate(
                **inputs, do_sample=False, max_new_tokens=MAX_NEW, output_scores=True, return_dict_in_generate=True
            )
        new = gen.sequences[:, seq:]
        out[p + "greedy"] = new.long()
        eos_hit = [int(t) for t in new[0] if int(t) in (EOS, PAD)]
        # The seeds are chosen so that no case stops early, no special token is generated and
        # every step's top-1 logit leads the runner-up by >= 0.01 (robust to f32 rounding).
        margin = min(float(sc[0].topk(2).values[0] - sc[0].topk(2).values[1]) for sc in gen.scores)
        assert new.shape[1] == MAX_NEW and int(new.max()) < BPE_SIZE and margin >= 0.01, (case, new, margin)
        info[case] = {
            "seq_len": seq,
            "image_grid_thw": inputs["image_grid_thw"].tolist() if "image_grid_thw" in inputs else [],
            "video_grid_thw": inputs["video_grid_thw"].tolist() if "video_grid_thw" in inputs else [],
            "second_per_grid_ts": inputs["second_per_grid_ts"].tolist() if "second_per_grid_ts" in inputs else None,
            "rope_deltas": int(deltas.reshape(-1)[0]),
            "greedy": new[0].tolist(),
            "greedy_text": processor.tokenizer.decode(new[0].tolist()),
            "greedy_hit_eos": bool(eos_hit),
            "greedy_min_top1_margin": round(margin, 4),
        }
        # generate's first token is the argmax of the last prompt logits.
        assert int(new[0, 0]) == int(logits[0, -1].argmax()), case
    return {k: v.detach().clone().contiguous() for k, v in out.items()}, prompts, info


def check_transformers_roundtrip(cls, out, reference, reference_config):
    """The written checkpoint loads in transformers with the same parameters (and logits)."""
    model, info = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} | ({"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
    assert not bad, f"{out.name}: loading info {bad}"
    sd = model.state_dict()
    assert set(sd) == set(reference), set(sd) ^ set(reference)
    for k, v in reference.items():
        assert torch.equal(sd[k], v), k
    assert model.config.vision_config._attn_implementation == "eager"
    assert model.config.text_config._attn_implementation == "eager"
    # The config (Hub layout for qwen2_vl_tiny) reads back as the one the model was built from.
    tc, want = model.config.text_config, reference_config.text_config
    assert tc.rope_parameters["mrope_section"] == MROPE, tc.rope_parameters
    # (From the Hub layout transformers keeps the legacy `"type": "mrope"` next to rope_type.)
    got_rope = {k: v for k, v in tc.rope_parameters.items() if k != "type"}
    assert got_rope == dict(want.rope_parameters), (tc.rope_parameters, want.rope_parameters)
    for k in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "eos_token_id", "pad_token_id"]:
        assert getattr(tc, k) == getattr(want, k), (k, getattr(tc, k), getattr(want, k))
    vc, want_v = model.config.vision_config.to_dict(), reference_config.vision_config.to_dict()
    for k, v in want_v.items():
        if k not in ("transformers_version", "_name_or_path", "dtype"):
            assert vc.get(k) == v, (k, vc.get(k), v)
    for k in TOKEN_IDS:
        assert getattr(model.config, k) == getattr(reference_config, k), k
    return model.eval()


def main():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if ROOT.exists():
        shutil.rmtree(ROOT)
    ROOT.mkdir(parents=True)
    files, frames = write_inputs()
    all_cases = cases(files, frames)

    summaries = {}
    prompts = None
    for name, cls, config, seed, hub in [
        ("qwen2_vl_tiny", Qwen2VLForConditionalGeneration, qwen2_vl_config(), 38, True),
        ("qwen2_5_vl_tiny", Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_config(), 16, False),
    ]:
        is_25 = cls is Qwen2_5_VLForConditionalGeneration
        out, reference = build(name, cls, config, seed, hub)
        processor = AutoProcessor.from_pretrained(out)
        assert type(processor).__name__ == ("Qwen2_5_VLProcessor" if is_25 else "Qwen2VLProcessor"), type(processor)
        ip, vp = processor.image_processor, processor.video_processor
        assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == (MIN_PIXELS, MAX_PIXELS), ip.size
        assert (vp.size["shortest_edge"], vp.size["longest_edge"]) == (MIN_PIXELS, MAX_PIXELS), vp.size
        tok = processor.tokenizer
        assert len(tok) == VOCAB and tok.eos_token_id == EOS and tok.pad_token_id == PAD
        assert all(tok.convert_tokens_to_ids(t) == i for t, i in IDS.items())
        model = check_transformers_roundtrip(cls, out, reference, config)
        tensors, case_prompts, info = expected(model, processor, all_cases, hub, seed + 1000, is_25)
        save_file(tensors, str(out / "expected.safetensors"))
        write_json(out / "params.json", summary(out / "model.safetensors"), indent=1)
        if prompts is None:
            prompts = case_prompts
        assert prompts == case_prompts
        summaries[name] = {"info": info, "n_tensors": len(tensors)}

        # The renamed Hub checkpoint and the new-name model give the same logits.
        if hub:
            fresh = cls(config).eval()
            fresh.load_state_dict(reference)
            _, inputs = processor_inputs(processor, all_cases["image"])
            inputs = {k: v for k, v in inputs.items() if k in MODEL_INPUTS}
            with torch.no_grad():
                a = fresh(**inputs).logits
            assert torch.equal(a[:, -1], tensors["image.logits_last"]), "renamed checkpoint logits differ"

    doc = {
        "generator": "scripts/make_vl_fixtures.py",
        "special_token_ids": IDS,
        "vocab_size": VOCAB,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "cases": {
            c: {**spec, "prompt": prompts[c], **{m: summaries[m]["info"][c] for m in summaries}}
            for c, spec in all_cases.items()
        },
    }
    write_json(ROOT / "cases.json", doc)

    versions = (
        f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, "
        f"pillow {PIL.__version__}, numpy {np.__version__}"
    )
    (ROOT / "README.md").write_text(
        "# Tiny Qwen2-VL / Qwen2.5-VL fixtures\n\n"
        "Generated by `scripts/make_vl_fixtures.py` (" + versions + "); do not edit by hand.\n"
        "Re-run from the repository root: `/work/verl-venv/bin/python scripts/make_vl_fixtures.py`.\n\n"
        "```text\n" + __doc__.strip() + "\n```\n"
    )
    print(versions)
    for name, s in summaries.items():
        print(name, s["n_tensors"], "tensors")
        for c, i in s["info"].items():
            print(f"  {c}: {i}")
    total = 0
    for f in sorted(ROOT.rglob("*")):
        if f.is_file():
            total += f.stat().st_size
            print(f"  {f.relative_to(ROOT)}  {f.stat().st_size}")
    print(f"wrote {ROOT} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.exit(main())
