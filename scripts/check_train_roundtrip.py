#!/usr/bin/env python3
"""Check that a model trained one step by ares-runner loads in transformers, computes the
same logits there, and took the step PyTorch takes.

    ARES_TRAIN_ROUNDTRIP_DIR=/tmp/ares_train_rt cargo test -p ares-model --test model_train \\
        -- --ignored write_train_roundtrip
    /tmp/pyenv/bin/python scripts/check_train_roundtrip.py /tmp/ares_train_rt

The Rust side trains every tiny fixture one step: loss L = sum_t c_t * log pi_t (log-prob of
the next token at a temperature T, fixed per-token coefficients c_t of both signs), backward
from dL/dlog pi through its loss head, global-norm clipping, AdamW. It saves the checkpoint
and `expected.safetensors` (logits after the step on two padded input sets; the training
batch; the hyper-parameters and the gradient norm in the metadata).

For each `<fixture>/` this script checks:

1. `AutoModelForCausalLM.from_pretrained(<fixture>/checkpoint)` loads with no missing or
   unexpected keys, and its logits equal the ones Rust saved at every valid position
   (|diff| <= 1e-4 * max(1, |logit|)).
2. The same step in PyTorch from the original fixture -- `log_softmax(logits / T)`, the
   same loss, `backward`, `clip_grad_norm_`, `torch.optim.AdamW` -- reports the same gradient
   norm (relative 1e-5) and lands on the same weights: every parameter's update agrees with
   Rust's to 1e-2 * lr, except where a gradient is at rounding level (|g| below 1e-5 of the
   tensor's largest), where Adam's first step (about lr * sign(g)) can go either way.

Exit status 1 on any failure.
"""

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

FIXTURES = Path(__file__).resolve().parent.parent / "ares-model" / "tests" / "fixtures" / "models"


def load(path):
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    return model, bad


def read_expected(path):
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    return tensors, meta


def check_logits(ours, e, problems):
    ours.eval()
    for s in ("right", "left"):
        with torch.no_grad():
            logits = ours(
                input_ids=e[f"{s}.input_ids"],
                attention_mask=e[f"{s}.attention_mask"],
                position_ids=e[f"{s}.position_ids"],
            ).logits
        m = e[f"{s}.attention_mask"].bool()
        want = e[f"{s}.logits"][m]
        diff = float(((logits[m] - want).abs() / want.abs().clamp(min=1.0)).max())
        if diff > 1e-4:
            problems.append(f"{s} logits differ by {diff:.3g} (relative)")
    return problems


def torch_step(source, e, meta):
    """The training step of the Rust side, in PyTorch; returns (model before, after, grad norm)."""
    before, _ = load(FIXTURES / source)
    model, _ = load(FIXTURES / source)
    model.train()  # dropout is 0 in the fixtures; train mode as a trainer would run it
    t = float(meta["temperature"])
    logits = model(
        input_ids=e["train.input_ids"],
        attention_mask=e["train.attention_mask"],
        position_ids=e["train.position_ids"],
    ).logits
    logp = torch.log_softmax(logits / t, dim=-1).gather(-1, e["train.targets"][..., None])[..., 0]
    coeffs = e["train.coeffs"]
    loss = torch.where(coeffs != 0, coeffs * logp, torch.zeros_like(logp)).sum()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(meta["max_grad_norm"]))
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=float(meta["lr"]),
        betas=(float(meta["beta1"]), float(meta["beta2"])),
        eps=float(meta["eps"]),
        weight_decay=float(meta["weight_decay"]),
    )
    opt.step()
    return before, model, grads, float(norm)


def check_step(ours, source, e, meta, problems):
    before, theirs, grads, norm = torch_step(source, e, meta)
    rust_norm = float(meta["grad_norm"])
    if abs(norm - rust_norm) > 1e-5 * abs(norm):
        problems.append(f"grad norm {rust_norm} (Rust) vs {norm} (PyTorch)")
    lr = float(meta["lr"])
    a, b, p0 = dict(ours.named_parameters()), dict(theirs.named_parameters()), dict(before.named_parameters())
    if a.keys() != b.keys():
        problems.append(f"parameter names differ: {sorted(a.keys() ^ b.keys())}")
    worst, worst_rounding, ambiguous, total = 0.0, 0.0, 0, 0
    for k in sorted(a.keys() & b.keys()):
        d_ours = a[k].detach() - p0[k].detach()
        d_theirs = b[k].detach() - p0[k].detach()
        g = grads[k].abs()
        settled = g > 1e-5 * g.max()
        off = (d_ours - d_theirs).abs()
        total += off.numel()
        ambiguous += int((~settled).sum())
        if settled.any():
            w = float(off[settled].max()) / lr
            worst = max(worst, w)
            if w > 1e-2:
                problems.append(f"{k}: update differs by {w:.3g} lr")
        if (~settled).any():
            worst_rounding = max(worst_rounding, float(off[~settled].max()) / lr)
        # Rounding-level gradients still step by at most lr·(1 + decay).
        if float(off.max()) > 2.1 * lr:
            problems.append(f"{k}: update differs by {float(off.max()) / lr:.3g} lr")
    return worst, worst_rounding, ambiguous, total


def main(root):
    failures = 0
    dirs = [d for d in sorted(Path(root).iterdir()) if d.is_dir()]
    if not dirs:
        print(f"nothing to check in {root}")
        return 1
    for out in dirs:
        e, meta = read_expected(out / "expected.safetensors")
        ours, bad = load(out / "checkpoint")
        problems = [f"loading info {bad}"] if bad else []
        check_logits(ours, e, problems)
        worst, rounding, ambiguous, total = check_step(ours, meta["fixture"], e, meta, problems)
        status = "OK " if not problems else "FAIL"
        print(
            f"{status} {out.name}: {type(ours).__name__}, logits match, grad norm {meta['grad_norm']}, "
            f"updates within {worst:.2g}·lr of PyTorch ({ambiguous}/{total} with rounding-level gradients: {rounding:.2g}·lr)"
            + "".join(f"\n     {p}" for p in problems[:8])
        )
        failures += bool(problems)
    print("trained checkpoints load in transformers and match PyTorch's step" if failures == 0 else f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
