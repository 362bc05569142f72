#!/usr/bin/env python3
"""Check that LoRA adapters written by ares load in peft and give peft's own logits.

    ARES_PEFT_ROUNDTRIP_DIR=/tmp/ares_peft cargo test -p ares-model --test lora_peft \\
        -- --ignored write_peft_roundtrip
    /work/venv-torch/bin/python scripts/check_peft_roundtrip.py /tmp/ares_peft

For every adapter directory there (named as a fixture of `tests/fixtures/lora`),
`PeftModel.from_pretrained` loads it onto its base model, which must then give the
fixture's `right.logits` (made by peft from the original adapter) to 1e-5. Exit status 1 on
failure.
"""

import sys
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent / "ares-model" / "tests" / "fixtures"
BASES = {"qwen2_all": "qwen2_tiny", "llama_attn": "llama_tiny"}


def main(out_root):
    failures = 0
    for out in sorted(Path(out_root).iterdir()):
        base = BASES[out.name]
        model = AutoModelForCausalLM.from_pretrained(
            ROOT / "models" / base, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        peft_model = PeftModel.from_pretrained(model, out).eval()
        inputs = load_file(ROOT / "models" / base / "expected.safetensors")
        want = load_file(ROOT / "lora" / out.name / "expected.safetensors")["right.logits"]
        with torch.no_grad():
            got = peft_model(
                input_ids=inputs["right.input_ids"], attention_mask=inputs["right.attention_mask"]
            ).logits
        mask = inputs["right.attention_mask"].bool()
        err = (got - want)[mask].abs().max().item()
        ok = err <= 1e-5
        failures += not ok
        print(f"{out.name}: peft loads ares's adapter; max |Δlogits| {err:.2e} {'ok' if ok else 'FAIL'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
