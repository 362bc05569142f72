"""PyTorch autograd functions over ares's CPU kernels (CPU float32 tensors, read in place).

``ares.torch.linear_log_prob_entropy(hidden, weight, targets)`` is the LM head fused with the
per-token log-prob and entropy (``ares.linear_log_prob_entropy``): ``hidden`` [..., H],
``weight`` [V, H] (the head, Hugging Face layout), ``targets`` [...] integer ids; returns
``(log_prob, entropy)`` of shape ``hidden.shape[:-1]``, differentiable in ``hidden`` and
``weight``. Neither pass holds the [N, V] logits: the forward computes them ``chunk_rows``
rows at a time, the backward recomputes each chunk. Use it in place of ``lm_head`` +
``log_softmax`` + ``gather`` + an entropy in an RL loss::

    log_prob, entropy = ares.torch.linear_log_prob_entropy(hidden, model.lm_head.weight, ids)
    loss = -(adv * log_prob).mean() - 0.01 * entropy.mean()

CUDA tensors are a ``ValueError`` here (this function runs on CPU arrays; ``ares.log_prob_entropy``
and the token kernels take CUDA tensors, see ``ares._cuda``). ``import ares`` never imports
torch; this module does.
"""

import torch

from . import linear_log_prob_entropy as _forward
from . import linear_log_prob_entropy_backward as _backward

__all__ = ["LinearLogProbEntropy", "linear_log_prob_entropy"]


class LinearLogProbEntropy(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], targets [N]) → (log_prob [N], entropy [N])``."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature=1.0, chunk_rows=None):
        x, w = hidden.detach().contiguous(), weight.detach().contiguous()
        lp, ent = _forward(x, w, targets, temperature=temperature, chunk_rows=chunk_rows)
        ctx.save_for_backward(x, w, targets)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return torch.from_numpy(lp), torch.from_numpy(ent)

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        x, w, targets = ctx.saved_tensors
        gx, gw = _backward(
            x,
            w,
            targets,
            grad_log_prob.detach().float().contiguous(),
            grad_entropy.detach().float().contiguous(),
            temperature=ctx.temperature,
            chunk_rows=ctx.chunk_rows,
        )
        gx = torch.from_numpy(gx) if ctx.needs_input_grad[0] else None
        gw = torch.from_numpy(gw) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None


def linear_log_prob_entropy(hidden, weight, targets, *, temperature=1.0, chunk_rows=None):
    """:class:`LinearLogProbEntropy` over any leading shape of ``hidden`` [..., H] and
    ``targets`` [...]; returns ``(log_prob, entropy)`` of shape ``hidden.shape[:-1]``."""
    lead = hidden.shape[:-1]
    if tuple(targets.shape) != tuple(lead):
        raise ValueError(
            f"ares.torch.linear_log_prob_entropy: `targets` has shape {tuple(targets.shape)}, expected "
            f"{tuple(lead)} (hidden.shape[:-1])"
        )
    x = hidden.reshape(-1, hidden.shape[-1])
    lp, ent = LinearLogProbEntropy.apply(x, weight, targets.reshape(-1), temperature, chunk_rows)
    return lp.reshape(lead), ent.reshape(lead)
