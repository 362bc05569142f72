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

On CUDA tensors (float32 or bfloat16, ``hidden`` and ``weight`` alike) both passes run
ares-cuda's fused head (``ares._cuda.linear_log_prob_entropy``: cuBLAS products of a chunk of
rows, then the row kernels), and the gradients come back in the inputs' dtypes.

``ares.torch.policy_loss(logp, logp_old, advantages, mask, loss_mode=…, …)`` is
``ares.policy_loss`` as a differentiable 0-d loss: ``(loss, metrics)``, where the backward
multiplies the gradient ares computed with the loss (∂loss/∂logp, the same pass) by the
incoming one. On CUDA tensors the forward is ares-cuda's loss kernel (``vanilla``, ``gspo``,
``gspo_token``, ``cispo``), so nothing leaves the device but the metrics; on CPU tensors it is
ares-core's function (every loss mode, float32 or float64)::

    log_prob, entropy = ares.torch.log_prob_entropy(logits, ids)
    pg_loss, metrics = ares.torch.policy_loss(log_prob, old_log_prob, adv, mask, loss_mode="gspo")
    (pg_loss - 0.01 * (entropy * mask).sum() / mask.sum()).backward()

``import ares`` never imports torch; this module does.
"""

import torch

from . import linear_log_prob_entropy as _forward
from . import linear_log_prob_entropy_backward as _backward
from . import log_prob_entropy as _lpe
from . import log_prob_entropy_backward as _lpe_backward
from . import policy_loss as _policy_loss

__all__ = [
    "LinearLogProbEntropy",
    "LogProbEntropy",
    "PolicyLoss",
    "linear_log_prob_entropy",
    "log_prob_entropy",
    "policy_loss",
]


_BACKWARD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LogProbEntropy(torch.autograd.Function):
    """``(logits [N, V], targets [N] or None) → (log_prob [N] or None, entropy [N])``, the
    fused row pass of ``ares.log_prob_entropy`` with its backward
    (``ares.log_prob_entropy_backward``, or ``ares._cuda``'s on CUDA tensors: ``∂L/∂logits``
    from both outputs' gradients)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature=1.0):
        if ctx.needs_input_grad[0] and logits.dtype not in _BACKWARD_DTYPES:
            raise ValueError(
                f"ares.torch.log_prob_entropy: the backward runs on float32, bfloat16 or float16 logits, got "
                f"{logits.dtype} (convert with .float(), or call it under torch.no_grad() for the forward alone)"
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

            # 16-bit logits: one fused kernel, the gradient in their dtype
            return _cuda.log_prob_entropy_backward(*args, temperature=ctx.temperature), None, None
        # on the CPU from the widened logits, rounded to their dtype once (what the kernel does)
        wide = (x.float(),) + args[1:]
        grad = torch.from_numpy(_lpe_backward(*wide, temperature=ctx.temperature))
        return grad.to(x.dtype), None, None


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
        if x.device.type == "cpu":
            lp, ent = torch.from_numpy(lp), torch.from_numpy(ent)
        return lp, ent

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
        if x.device.type == "cpu":
            gx, gw = torch.from_numpy(gx), torch.from_numpy(gw)
        gx = gx.to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = gw.to(w.dtype) if ctx.needs_input_grad[1] else None
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


class PolicyLoss(torch.autograd.Function):
    """``(logp [B, T], logp_old, advantages, mask, logp_rollout or None, options, metrics) → loss``
    (0-d, ``logp``'s dtype and device): ``ares.policy_loss``'s value, differentiable in ``logp``
    only (the other tensors are data). ``options`` are ``ares.policy_loss``'s keywords;
    ``metrics`` (a dict) receives its other outputs."""

    @staticmethod
    def forward(ctx, logp, logp_old, advantages, mask, logp_rollout, options, metrics):
        data = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
        out = _policy_loss(
            data(logp), data(logp_old), data(advantages), data(mask), logp_rollout=data(logp_rollout), **options
        )
        grad = out.pop("grad")
        if not torch.is_tensor(grad):
            grad = torch.from_numpy(grad)
        ctx.save_for_backward(grad)
        metrics.update(out)
        return torch.tensor(out["loss"], dtype=logp.dtype, device=logp.device)

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad_output * grad, None, None, None, None, None, None


def policy_loss(logp, logp_old, advantages, mask, *, logp_rollout=None, **options):
    """:class:`PolicyLoss`: ``(loss, metrics)`` of ``ares.policy_loss`` (same arguments and
    keywords: ``loss_mode``, ``loss_agg_mode``, the clip ratios, ``is_correction`` with
    ``logp_rollout``, Clip-Cov's and KL-Cov's parameters), ``loss`` a 0-d tensor whose
    backward gives ``logp`` the loss's gradient. ``metrics`` holds the floats ares returns
    (``clipfrac``, ``clipfrac_lower``, ``approx_kl``, ``is_weight_mean``, ``is_changed_frac``,
    ``selected_frac``, ``valid_tokens``, and ``loss`` as a float). All tensors [B, T], on one
    device; an empty mask is ares's ``ValueError``."""
    for name, t in (("logp_old", logp_old), ("advantages", advantages), ("mask", mask), ("logp_rollout", logp_rollout)):
        if t is not None and tuple(t.shape) != tuple(logp.shape):
            raise ValueError(
                f"ares.torch.policy_loss: `{name}` has shape {tuple(t.shape)}, expected {tuple(logp.shape)} "
                f"(logp's)"
            )
    metrics = {}
    loss = PolicyLoss.apply(logp, logp_old, advantages, mask, logp_rollout, options, metrics)
    return loss, metrics
