"""Greedy-generation fixtures of `ares-model` (tests/fixtures/models/<name>/greedy.json).

Re-run from the repository root after `scripts/make_hf_fixtures.py`, with any Python that
has torch and transformers (made with torch 2.9.1, transformers 4.57.6):

    /tmp/pyenv/bin/python scripts/make_generation_fixtures.py

For each tiny model: transformers' `model.generate(..., do_sample=False,
max_new_tokens=8)` on three prompts of different lengths (ids < vocab 97), in f32 with
eager attention, once batched with left padding (pad id 0, attention_mask) and once one
prompt at a time. EOS is disabled (`eos_token_id=None`; pure argmax, no logits processor), so every
output has exactly 8 new tokens; repetition penalty and other generation_config processors
are overridden off. Both runs are recorded; they agree.
"""

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

ROOT = Path(__file__).resolve().parent.parent / "ares-model/tests/fixtures/models"
MODELS = ["qwen2_tiny", "qwen3_tiny", "llama_tiny"]
PROMPTS = [[5, 17, 42, 8, 91, 33, 60], [12, 3], [77, 21, 64, 9]]
MAX_NEW = 8
PAD = 0


def greedy_config():
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=MAX_NEW,
        eos_token_id=None,
        pad_token_id=PAD,
        bos_token_id=None,
        repetition_penalty=1.0,
    )


def run(model, prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    with torch.no_grad():
        # Replace the model's generation_config outright: passing a config only overrides
        # values that differ from the global defaults, so do_sample=False, eos None and
        # repetition_penalty 1.0 would fall back to the checkpoint's sampling settings.
        model.generation_config = greedy_config()
        out = model.generate(input_ids=ids, attention_mask=mask)
    new = out[:, width:].tolist()
    assert all(len(row) == MAX_NEW for row in new)
    return new


def main():
    torch.manual_seed(0)
    for name in MODELS:
        model = AutoModelForCausalLM.from_pretrained(
            ROOT / name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        batched = run(model, PROMPTS)
        single = [run(model, [p])[0] for p in PROMPTS]
        if batched != single:
            print(f"warning: {name}: batched {batched} != one by one {single}")
        doc = {
            "generator": "scripts/make_generation_fixtures.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "settings": "do_sample=False, max_new_tokens=8, eos disabled, f32, eager attention, left padding with pad id 0",
            "prompts": PROMPTS,
            "batched_left_padded": batched,
            "one_by_one": single,
        }
        (ROOT / name / "greedy.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(name, batched)


if __name__ == "__main__":
    main()
