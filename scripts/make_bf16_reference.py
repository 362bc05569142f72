#!/usr/bin/env python3
"""transformers' own bf16 forward on the tiny model fixtures, as a reference for ares's bf16
path (`ares-model/tests/model_precision.rs::bf16_logits_are_as_close_as_transformers_bf16`).

Re-run from the repository root with any Python that has torch and transformers (made with
torch 2.15.0, transformers 5.24.0):

    /tmp/tv/bin/python scripts/make_bf16_reference.py

For each of `qwen2_tiny`, `qwen3_tiny` and `llama_tiny` (tests/fixtures/models/, made by
`make_hf_fixtures.py`) it writes `bf16_reference.safetensors` next to the model:

* `input_ids` [2, 40] i64: `(7·i + 3) mod vocab` over the flattened batch, every position a
  token (80 tokens: enough rows for ares's bf16 products, which start at 64);
* `logits_f32` [2, 40, 97]: the model loaded in f32, eager attention;
* `logits_bf16` [2, 40, 97] (stored as f32, exact): the model loaded with
  `dtype=torch.bfloat16` — bf16 weights *and* activations, as transformers runs a bf16
  checkpoint — eager attention.

Deterministic: CPU, no sampling.
"""

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent / "ares-model" / "tests" / "fixtures" / "models"
BATCH, SEQ = 2, 40


def logits(path, dtype, ids):
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return out.float().contiguous()


def main():
    torch.use_deterministic_algorithms(True)
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"]:
        path = ROOT / name
        vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
        ids = (torch.arange(BATCH * SEQ) * 7 + 3) % vocab
        ids = ids.reshape(BATCH, SEQ).to(torch.int64)
        tensors = {
            "input_ids": ids,
            "logits_f32": logits(path, torch.float32, ids),
            "logits_bf16": logits(path, torch.bfloat16, ids),
        }
        save_file(tensors, str(path / "bf16_reference.safetensors"))
        err = (tensors["logits_bf16"] - tensors["logits_f32"]).abs().max()
        scale = tensors["logits_f32"].abs().max()
        print(f"{name}: transformers bf16 against f32, max rel error {float(err / scale):.3e}")


if __name__ == "__main__":
    main()
