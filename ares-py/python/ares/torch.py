"""PyTorch autograd functions over ares's CPU kernels (CPU float32 tensors, read in place).

``ares.torch.log_prob_entropy(logits, targets)`` is the per-token log-prob and entropy of
``softmax(logits / T)`` in one read of each row (``ares.log_prob_entropy``), differentiable in
``logits`` (``ares.log_prob_entropy_backward``); on CUDA tensors both run ares-cuda's kernels
(the backward on float32 logits).

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
from . import log_prob_entropy as _lpe
from . import log_prob_entropy_backward as _lpe_backward

__all__ = ["LinearLogProbEntropy", "LogProbEntropy", "linear_log_prob_entropy", "log_prob_entropy"]


class LogProbEntropy(torch.autograd.Function):
    """``(logits [N, V], targets [N] or None) → (log_prob [N] or None, entropy [N])``, the
    fused row pass of ``ares.log_prob_entropy`` with its backward
    (``ares.log_prob_entropy_backward``, or ``ares._cuda``'s on CUDA tensors: ``∂L/∂logits``
    from both outputs' gradients)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature=1.0):
        if ctx.needs_input_grad[0] and logits.dtype != torch.float32:
            raise ValueError(
                f"ares.torch.log_prob_entropy: the backward runs on float32 logits, got {logits.dtype} (convert "
                f"with .float(), or call it under torch.no_grad() for the forward alone)"
            )
        x = logits.detach().contiguous()
        lp, ent = _lpe(x, targets, temperature=temperature)
        if x.device.type == "cpu":
            lp = None if lp is None else torch.from_numpy(lp)
            ent = torch.from_numpy(ent)
        ctx.save_for_backward(x, targets if targets is not None else torch.empty(0, dtype=torch.int64))
        ctx.temperature, ctx.has_targets = temperature, targets is not None
        return lp, ent

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        x, targets = ctx.saved_tensors
        g = lambda t: None if t is None else t.detach().float().contiguous()  # noqa: E731
        args = (
            x,
            targets if ctx.has_targets else None,
            g(grad_log_prob) if ctx.has_targets else None,
            g(grad_entropy),
        )
        if x.device.type == "cuda":
            from . import _cuda

            return _cuda.log_prob_entropy_backward(*args, temperature=ctx.temperature), None, None
        return torch.from_numpy(_lpe_backward(*args, temperature=ctx.temperature)), None, None


def log_prob_entropy(logits, targets=None, *, temperature=1.0):
    """:class:`LogProbEntropy` over any leading shape: ``logits`` [..., V], ``targets`` [...]
    integer ids or ``None``; returns ``(log_prob or None, entropy)`` of shape
    ``logits.shape[:-1]``, differentiable in ``logits`` (float32, CPU or CUDA). The per-token log-prob
    and entropy of an RL loss from logits in one read of each row::

        log_prob, entropy = ares.torch.log_prob_entropy(logits, ids)
        loss = -(adv * log_prob).mean() - 0.01 * entropy.mean()
    """
    lead = logits.shape[:-1]
    if targets is not None and tuple(targets.shape) != tuple(lead):
        raise ValueError(
            f"ares.torch.log_prob_entropy: `targets` has shape {tuple(targets.shape)}, expected {tuple(lead)} "
            f"(logits.shape[:-1])"
        )
    x = logits.reshape(-1, logits.shape[-1])
    t = None if targets is None else torch.as_tensor(targets).reshape(-1)
    lp, ent = LogProbEntropy.apply(x, t, temperature)
    return (None if lp is None else lp.reshape(lead)), ent.reshape(lead)


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
