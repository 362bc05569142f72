#!/usr/bin/env python3
"""Record bitsandbytes' 8-bit block-wise quantisation into
ares-cpu/tests/fixtures/int8_blockwise_bnb.safetensors, the reference of
`ares_cpu::ops::optim_int8` (AdamW's `state_dtype: int8`).

Everything expected comes from calling bitsandbytes (made with bitsandbytes 0.50.2, torch
2.15, CPU): its two dynamic maps (`create_dynamic_map(signed=True)` for the first moment,
`signed=False` for the second, as its 8-bit optimizers use them) and its block-wise quantiser
with `blocksize=2048`, the block size of the 8-bit Adam paper; current bitsandbytes
optimizers use 256) on inputs made here. The quantiser is bitsandbytes' reference PyTorch
kernel (its `default` backend, which every device without a native kernel runs): nearest
code, ties to the lower one. Its native CPU kernel searches the map more coarsely (2.4e-7
after scaling lands on 2.1e-5, not 0), so the call below dispatches past it.

    /work/venv-torch/bin/pip install bitsandbytes
    /work/venv-torch/bin/python scripts/make_int8_state_fixtures.py

Tensors (all flat):
- `map_signed`, `map_unsigned`: f32 [256], sorted;
- `x_signed`: f32 inputs of the signed case (two full blocks and a partial one: ordinary
  values, a block of zeros and exact ±absmax ties, values that sit on midpoints of the map);
  `codes_signed` u8, `absmax_signed` f32 [3];
- `x_unsigned` = |x_signed|, `codes_unsigned`, `absmax_unsigned`.
"""

import torch
from safetensors.torch import save_file
import bitsandbytes.functional as F

BLOCK = 2048

torch.manual_seed(20261128)
code_s = F.create_dynamic_map(signed=True)
code_u = F.create_dynamic_map(signed=False)

# block 0: ordinary values over seven decades, signs mixed
a = torch.randn(BLOCK) * torch.pow(10.0, torch.randint(-7, 1, (BLOCK,)).float())
# block 1: zeros except a few, the largest negative (a -1 after scaling), exact midpoints
b = torch.zeros(BLOCK)
b[1] = -3.0
b[2] = 3.0 * 0.5
mids = (code_s[:-1] + code_s[1:]) / 2
b[3 : 3 + 255] = mids * 3.0
b[300:400] = torch.randn(100) * 1e-3
# block 2 (partial): 700 values, a tiny block (scale near the f32 minimum normal)
c = torch.randn(700) * 1e-30
x = torch.cat([a, b, c]).float()

# bitsandbytes' reference kernel, past its native CPU one (see the docstring)
REFERENCE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def quantize_blockwise(values, code):
    return torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(
        REFERENCE, values, code, BLOCK
    )


q_s, absmax_s = quantize_blockwise(x, code_s)
xu = x.abs()
q_u, absmax_u = quantize_blockwise(xu, code_u)

save_file(
    {
        "map_signed": code_s.contiguous(),
        "map_unsigned": code_u.contiguous(),
        "x_signed": x.contiguous(),
        "codes_signed": q_s.to(torch.uint8).contiguous(),
        "absmax_signed": absmax_s.float().contiguous(),
        "x_unsigned": xu.contiguous(),
        "codes_unsigned": q_u.to(torch.uint8).contiguous(),
        "absmax_unsigned": absmax_u.float().contiguous(),
    },
    "ares-cpu/tests/fixtures/int8_blockwise_bnb.safetensors",
    metadata={"made_with": f"bitsandbytes {__import__('bitsandbytes').__version__}, torch {torch.__version__}"},
)
print("codes", q_s[:8].tolist(), "absmax", absmax_s.tolist(), absmax_u.tolist())
