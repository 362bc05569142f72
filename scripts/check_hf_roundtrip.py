#!/usr/bin/env python3
"""Check that checkpoints saved by ares-runner load in transformers.

    ARES_HF_ROUNDTRIP_DIR=/tmp/ares_rt cargo test -p ares-model --test hf_models \\
        -- --ignored write_roundtrip
    /tmp/pyenv/bin/python scripts/check_hf_roundtrip.py /tmp/ares_rt

For every `<fixture>-<dtype>` directory there, `AutoModelForCausalLM.from_pretrained` must
load it without missing/unexpected keys, into the right class, and every parameter must
equal the fixture's (exactly for f32; for bf16, the fixture's values rounded to bf16). The
f32 checkpoints must also reproduce the fixture's expected logits. Exit status 1 on failure.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

FIXTURES = Path(__file__).resolve().parent.parent / "ares-model" / "tests" / "fixtures" / "models"


def load(path):
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    return model.eval(), bad


def main(root):
    failures = 0
    for out in sorted(Path(root).iterdir()):
        if not out.is_dir():
            continue
        name, dtype = out.name.rsplit("-", 1)
        source = "llama_tiny" if name == "llama_tiny_rope_parameters" else name
        ours, bad = load(out)
        ref, _ = load(FIXTURES / source)
        problems = [f"loading info {bad}"] if bad else []
        if type(ours) is not type(ref):
            problems.append(f"class {type(ours).__name__} != {type(ref).__name__}")
        if ours.config.rope_scaling != ref.config.rope_scaling or ours.config.rope_theta != ref.config.rope_theta:
            problems.append(f"rope {ours.config.rope_theta} {ours.config.rope_scaling}")
        a, b = dict(ours.named_parameters()), dict(ref.named_parameters())
        if a.keys() != b.keys():
            problems.append(f"parameter names differ: {sorted(a.keys() ^ b.keys())}")
        worst = 0.0
        for k in sorted(a.keys() & b.keys()):
            want = b[k].detach()
            if dtype == "bf16":
                want = want.to(torch.bfloat16).float()
            if not torch.equal(a[k].detach(), want):
                worst = max(worst, float((a[k].detach() - want).abs().max()))
                problems.append(f"{k} differs (max abs {worst:.3g})")
        if dtype == "f32":
            e = load_file(str(FIXTURES / source / "expected.safetensors"))
            for s in ("right", "left"):
                with torch.no_grad():
                    logits = ours(
                        input_ids=e[f"{s}.input_ids"],
                        attention_mask=e[f"{s}.attention_mask"],
                        position_ids=e[f"{s}.position_ids"],
                    ).logits
                m = e[f"{s}.attention_mask"].bool()
                diff = float((logits[m] - e[f"{s}.logits"][m]).abs().max())
                if diff > 1e-5:
                    problems.append(f"{s} logits differ by {diff:.3g}")
        status = "OK " if not problems else "FAIL"
        print(f"{status} {out.name}: {type(ours).__name__}, {len(a)} parameters"
              + "".join(f"\n     {p}" for p in problems[:5]))
        failures += bool(problems)
    print("all checkpoints load in transformers" if failures == 0 else f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
