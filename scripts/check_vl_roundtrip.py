#!/usr/bin/env python3
"""Check that Qwen2-VL / Qwen2.5-VL checkpoints saved by ares-model load in transformers.

    ARES_VL_ROUNDTRIP_DIR=/tmp/ares_vl_rt cargo test -p ares-model --test vision_model \\
        -- --ignored write_vl_roundtrip
    /work/verl-venv/bin/python scripts/check_vl_roundtrip.py /tmp/ares_vl_rt

For every `<fixture>-<hub|nested>-<f32|bf16>` directory there, `from_pretrained` of the
fixture's class must load it without missing or unexpected keys, and every parameter must
equal the fixture's (exactly for f32; for bf16, the fixture's values rounded to bf16). The
f32 checkpoints must also reproduce the fixture's last-position logits of case `image`
(processor inputs from expected.safetensors). Exit status 1 on failure.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

FIXTURES = Path(__file__).resolve().parent.parent / "ares-model" / "tests" / "fixtures" / "vl"
CLASSES = {"qwen2_vl_tiny": Qwen2VLForConditionalGeneration, "qwen2_5_vl_tiny": Qwen2_5_VLForConditionalGeneration}


def load(cls, path):
    model, info = cls.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    return model.eval(), bad


def main(root):
    failures = 0
    dirs = sorted(p for p in Path(root).iterdir() if p.is_dir())
    if not dirs:
        print(f"no checkpoints under {root}")
        return 1
    for out in dirs:
        name, layout, dtype = out.name.rsplit("-", 2)
        cls = CLASSES[name]
        ours, bad = load(cls, out)
        ref, _ = load(cls, FIXTURES / name)
        problems = [f"loading info {bad}"] if bad else []
        rp = dict(ref.named_parameters())
        for k, p in ours.named_parameters():
            want = rp[k].detach()
            if dtype == "bf16":
                want = want.to(torch.bfloat16).float()
            if not torch.equal(p.detach(), want):
                problems.append(f"{k} differs (max {float((p.detach() - want).abs().max()):.3g})")
        if dtype == "f32":
            exp = load_file(FIXTURES / name / "expected.safetensors")
            inputs = {
                k: exp[f"image.{k}"]
                for k in ["input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"]
            }
            with torch.no_grad():
                logits = ours(**inputs).logits[0, -1]
            err = float((logits - exp["image.logits_last"][0]).abs().max())
            if err > 1e-5:
                problems.append(f"image logits differ by {err:.3g}")
        status = "ok" if not problems else "FAIL: " + "; ".join(problems[:4])
        print(f"{out.name}: {status}")
        failures += bool(problems)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
