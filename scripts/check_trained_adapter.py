#!/usr/bin/env python3
"""Check that a LoRA adapter trained by ares loads in peft and gives ares's model.

    ares-runner merge --model BASE --adapter RUN/checkpoints/step_N/adapter -o MERGED --dtype f32
    /work/venv-torch/bin/python scripts/check_trained_adapter.py BASE RUN/.../adapter MERGED

`PeftModel.from_pretrained` loads the adapter onto the base model; its logits on a batch of
random token ids must equal, to 1e-4 of their scale, the logits of the model ares merged
(`ares-runner merge`, whose merge equals ares's adapted forward pass: ares-model's
tests/lora_train.rs). Exit status 1 on failure.
"""

import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def load(path):
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def main(base, adapter, merged):
    peft_model = PeftModel.from_pretrained(load(base), adapter).eval()
    ours = load(merged)
    vocab = ours.config.vocab_size
    ids = torch.randint(0, vocab, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = ours(input_ids=ids).logits
        base_logits = load(base)(input_ids=ids).logits
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
