"""LoRA pairs on a transformers decoder for the PyTorch baselines of the benchmarks
(`bench_torch_cpu.py`, `bench_torch_gpu.py`): peft's `get_peft_model` when peft is
installed, else the same pair by hand (`LoraLinear`: peft's `lora.Linear` arithmetic
without dropout, `W x + b + (alpha / r) B A x`, `A` kaiming-uniform, `B = 0`)."""

import torch

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(model, r, alpha):
    """`model` with LoRA pairs of rank `r` on every linear layer of its decoder, the rest
    frozen: peft's `get_peft_model` when peft is installed, else `LoraLinear` (PEFT's
    `lora.Linear` arithmetic without dropout: `W x + b + (alpha / r) B A x`)."""
    try:
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=LORA_TARGETS, lora_dropout=0.0)
        print("LoRA by peft")
        return get_peft_model(model, cfg)
    except ImportError:
        print("LoRA by hand (peft is not installed)")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in LORA_TARGETS:
                if hasattr(parent, name):
                    setattr(parent, name, LoraLinear(getattr(parent, name), r, alpha))
    return model


class LoraLinear(torch.nn.Module):
    """A frozen linear layer plus a trained pair, as peft's `lora.Linear` computes it."""

    def __init__(self, base, r, alpha):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.empty(r, base.in_features))
        torch.nn.init.kaiming_uniform_(self.a, a=5**0.5)
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.a.t() @ self.b.t()) * self.scale
