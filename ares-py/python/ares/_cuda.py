"""ares's token kernels on PyTorch CUDA tensors, without a copy.

``log_prob_entropy`` (and its backward), ``linear_log_prob_entropy`` (and its backward),
``entropy_windows``, ``row_percentile``, ``masked_dynamic_kl``, ``policy_loss``, the advantage
estimators (``grpo_advantages`` … ``reinforce_pro_max``) and ``masked_whiten`` take CUDA
tensors as they take numpy arrays (the functions of :mod:`ares` route here when an
argument is a CUDA tensor): the kernels of ``ares-cuda`` read the tensors where they are and
write new tensors on the same device, queued on the caller's current stream
(``torch.cuda.current_stream()``), so they are ordered with the caller's own work. The
outputs are torch tensors (float32), shaped as the numpy functions' outputs.

- libcuda and NVRTC are loaded at the first call (the wheel has no CUDA toolkit in it; the
  token kernels are compiled once per GPU architecture and cached on disk, under
  ``$ARES_KERNEL_CACHE`` or ``~/.cache/ares/kernels``). The NVRTC that PyTorch's CUDA wheels
  install (``nvidia/*/lib/libnvrtc.so*``) is found and loaded when the system has none.
- Inputs are made contiguous (``.contiguous()``: a copy only if they are not) and must all
  be on one device; target ids of any integer dtype are converted to int32 on the device.
- The advantage estimators and ``masked_whiten`` check their inputs as the CPU does (a
  non-finite reward or value, a mask entry not 0/1, a row without valid token where the
  reward needs one: ``ValueError`` with the CPU's message) by reading a status, which waits
  for the stream; per-sample advantages equal the CPU's bit for bit, token advantages
  summed in another order agree to a few ulps of the row's scale.
- ``log_prob_entropy`` checks its rows as the CPU does (NaN or +inf, all −inf, a target id
  out of range or with logit −inf: ``ValueError``) by reading a status word, which waits for
  the stream; the other three are queued without waiting and do not check their inputs for
  NaN or for masks other than 0/1 (the numpy functions do).
- Other ``__cuda_array_interface__`` objects (CuPy, Numba): pass them through
  ``torch.as_tensor(x, device="cuda")``, which shares their memory.
"""

import glob
import os
import sys

from . import _ares
from ._interop import CUDA_FUNCTIONS

# what `ares` routes here (ares._interop.CUDA_FUNCTIONS), and the backward they build on
__all__ = ["is_cuda", "log_prob_entropy_backward", *CUDA_FUNCTIONS]

_FLOAT_LOGITS = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}
_nvrtc_tried = False


def is_cuda(x):
    """Whether ``x`` is a torch tensor on a CUDA device (torch is never imported here)."""
    return type(x).__module__.startswith("torch") and getattr(getattr(x, "device", None), "type", None) == "cuda"


def _other_device_array(x):
    return hasattr(x, "__cuda_array_interface__") and not type(x).__module__.startswith("torch")


def _preload(names, stems):
    """Loads a CUDA library by one of ``names`` through the dynamic loader, or else each of
    ``stems`` from PyTorch's CUDA wheels (``site-packages/nvidia/*/lib``), with RTLD_GLOBAL, so
    that ares-cuda's own lookup by name finds it loaded."""
    import ctypes

    for name in names:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            pass
    for stem in stems:
        libs = [lib for root in sys.path for lib in glob.glob(os.path.join(root, "nvidia", "*", "lib", stem + "*"))]
        for lib in sorted(libs, reverse=True):
            if "builtins" in os.path.basename(lib) or ".alt." in os.path.basename(lib):
                continue
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                pass


def _load_nvrtc():
    """NVRTC, once: the token kernels are compiled at the first call."""
    global _nvrtc_tried
    if not _nvrtc_tried:
        _nvrtc_tried = True
        _preload(("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"), ("libnvrtc.so",))


def _load_cublas():
    """cuBLAS, for the backward's model ops."""
    _preload(("libcublas.so", "libcublas.so.13", "libcublas.so.12"), ("libcublasLt.so", "libcublas.so"))


def _prepare(func, named):
    """The named CUDA tensors made contiguous, checked to share one device; returns
    ``(tensors, device index, stream handle)``."""
    import torch

    out, device = {}, None
    for name, t in named.items():
        if t is None:
            out[name] = None
            continue
        if not is_cuda(t):
            kind = "a CPU tensor or array" if not _other_device_array(t) else type(t).__name__
            raise ValueError(
                f"{func}: `{name}` is {kind} while other arguments are CUDA tensors: pass every array on one "
                f"CUDA device (torch.as_tensor(x, device=...))"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{func}: `{name}` is on {t.device}, the other tensors on {device}")
        out[name] = t.detach().contiguous()
    _load_nvrtc()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    return out, index, stream


def _f32(func, name, t):
    import torch

    if t.dtype != torch.float32:
        raise ValueError(f"{func}: `{name}` is {t.dtype}; CUDA tensors here are float32 (convert with .float())")
    return t


def _rows_cols(func, name, t):
    if t.dim() != 2:
        raise ValueError(f"{func}: `{name}` must be 2-D [rows, cols], got shape {tuple(t.shape)}")
    return int(t.shape[0]), int(t.shape[1])


def _same_shape(func, name, t, shape):
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{func}: `{name}` has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _logits_shape(func, x):
    """``(lead, vocab, rows)`` of logits ``[..., V]``."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{func}: `logits` must have a last axis of length >= 1, got shape {tuple(x.shape)}")
    vocab = int(x.shape[-1])
    return tuple(x.shape[:-1]), vocab, x.numel() // vocab


def _target_ids(func, tg, lead, vocab):
    """Integer ids of shape ``lead``, each in ``[0, vocab)``, as int32 on their device (``None``
    stays ``None``)."""
    import torch

    if tg is None:
        return None
    if tg.is_floating_point() or tg.is_complex() or tg.dtype == torch.bool:
        raise ValueError(f"{func}: `targets` must hold integer ids, got {tg.dtype}")
    _same_shape(func, "targets", tg, lead)
    if tg.numel() and (int(tg.min()) < 0 or int(tg.max()) >= vocab):
        raise ValueError(f"{func}: `targets` holds ids outside [0, {vocab}) (min {int(tg.min())}, max {int(tg.max())})")
    return tg.to(torch.int32).contiguous()


def _ptr(t):
    return 0 if t is None else int(t.data_ptr())


def log_prob_entropy(logits, targets=None, *, temperature=1.0):
    """:func:`ares.log_prob_entropy` on CUDA tensors: ``logits`` [..., V] float32, bfloat16 or
    float16; ``targets`` [...] integer ids or ``None``. Returns ``(log_prob or None,
    entropy)``, float32 tensors of shape ``logits.shape[:-1]`` on the logits' device."""
    import torch

    func = "log_prob_entropy"
    t, device, stream = _prepare(func, {"logits": logits, "targets": targets})
    x = t["logits"]
    dtype = _FLOAT_LOGITS.get(str(x.dtype))
    if dtype is None:
        raise ValueError(f"{func}: `logits` is {x.dtype}; use float32, bfloat16 or float16")
    lead, vocab, rows = _logits_shape(func, x)
    ids = _target_ids(func, t["targets"], lead, vocab)
    entropy = torch.empty(lead, dtype=torch.float32, device=x.device)
    log_prob = torch.empty(lead, dtype=torch.float32, device=x.device) if ids is not None else None
    if rows:
        _ares.cuda_log_prob_entropy(
            device, stream, _ptr(x), dtype, rows, vocab, float(temperature), _ptr(ids), _ptr(log_prob), _ptr(entropy)
        )
    return log_prob, entropy


def log_prob_entropy_backward(logits, targets=None, grad_log_prob=None, grad_entropy=None, *, temperature=1.0):
    """:func:`ares.log_prob_entropy_backward` on CUDA tensors: ``logits`` [..., V] float32,
    bfloat16 or float16 and the gradients of the outputs ([...] float32, either ``None``);
    returns ``∂L/∂logits`` [..., V] in the logits' dtype on their device (from 16-bit logits the
    float32 gradient of the widened logits rounded once, by one fused kernel). Runs the model
    ops' kernels (``model_ops.cu``: NVRTC and cuBLAS load at the first call) ordered after the
    caller's stream and before its next work; reads the status word (waits)."""
    import torch

    func = "log_prob_entropy_backward"
    named = {"logits": logits, "targets": targets, "grad_log_prob": grad_log_prob, "grad_entropy": grad_entropy}
    t, device, stream = _prepare(func, named)
    x = t["logits"]
    dtype = _FLOAT_LOGITS.get(str(x.dtype))
    if dtype is None:
        raise ValueError(f"{func}: `logits` is {x.dtype}; use float32, bfloat16 or float16")
    lead, vocab, rows = _logits_shape(func, x)
    for name in ("grad_log_prob", "grad_entropy"):
        if t[name] is not None:
            _same_shape(func, name, _f32(func, name, t[name]), lead)
    if t["grad_log_prob"] is not None and t["targets"] is None:
        raise ValueError(f"{func}: `grad_log_prob` needs the `targets` the log-probs were taken at")
    ids = _target_ids(func, t["targets"], lead, vocab)
    none = t["grad_entropy"] is None and (t["grad_log_prob"] is None or ids is None)
    if dtype != "float32" and none:
        return torch.zeros_like(x)
    out = torch.empty_like(x)
    if rows:
        _load_cublas()
        _ares.cuda_log_prob_entropy_backward(
            device, stream, _ptr(x), rows, vocab, float(temperature), _ptr(ids), _ptr(t["grad_log_prob"]),
            _ptr(t["grad_entropy"]), _ptr(out), dtype,
        )
    return out


_HEAD_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16"}
# Rows of logits per chunk of the fused head: a [chunk, V] float32 scratch of about 256 MiB
# (the backward holds two, and a bfloat16 copy of one)
_HEAD_CHUNK_BYTES = 256 << 20


def _head(func, named):
    """The fused head's checked CUDA inputs: ``(tensors, device, stream, dtype, rows, hidden,
    vocab)`` with ``hidden`` [N, H] and ``weight`` [V, H] of one dtype (float32 or bfloat16)."""
    t, device, stream = _prepare(func, named)
    x, w = t["hidden"], t["weight"]
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"{func}: `hidden` [N, H] and `weight` [V, H] must share H, got shapes {tuple(x.shape)} and "
            f"{tuple(w.shape)}"
        )
    if x.dtype != w.dtype or str(x.dtype) not in _HEAD_DTYPES:
        raise ValueError(
            f"{func}: `hidden` is {x.dtype} and `weight` {w.dtype}; both must be float32 or both bfloat16"
        )
    rows, hidden, vocab = int(x.shape[0]), int(x.shape[1]), int(w.shape[0])
    if hidden == 0 or vocab == 0:
        raise ValueError(f"{func}: `weight` must be [V >= 1, H >= 1], got shape {tuple(w.shape)}")
    return t, device, stream, _HEAD_DTYPES[str(x.dtype)], rows, hidden, vocab


def _chunk(func, chunk_rows, vocab):
    if chunk_rows is None:
        return max(1, _HEAD_CHUNK_BYTES // 4 // vocab)
    if int(chunk_rows) < 1:
        raise ValueError(f"{func}: `chunk_rows` must be >= 1, got {chunk_rows}")
    return int(chunk_rows)


def linear_log_prob_entropy(hidden, weight, targets, *, temperature=1.0, chunk_rows=None):
    """:func:`ares.linear_log_prob_entropy` on CUDA tensors: ``hidden`` [N, H] and ``weight``
    [V, H] (float32, multiplied in float32, or bfloat16, on tensor cores with float32 sums),
    ``targets`` [N] integer ids. Returns ``(log_prob, entropy)``, float32 [N] on their device,
    ``chunk_rows`` rows of logits at a time (default: ~256 MiB of them), never the [N, V]
    logits. Runs the model ops (NVRTC and cuBLAS load at the first call) ordered after the
    caller's stream; reads the status word (waits): a non-finite logit row or a target out
    of range is a ``ValueError``."""
    import torch

    func = "linear_log_prob_entropy"
    t, device, stream, dtype, rows, hidden_size, vocab = _head(
        func, {"hidden": hidden, "weight": weight, "targets": targets}
    )
    if t["targets"] is None:
        raise ValueError(f"{func}: `targets` is required on CUDA tensors")
    ids = _target_ids(func, t["targets"], (rows,), vocab)
    new = lambda: torch.empty(rows, dtype=torch.float32, device=t["hidden"].device)  # noqa: E731
    log_prob, entropy = new(), new()
    if rows:
        _load_cublas()
        _ares.cuda_linear_log_prob_entropy(
            device, stream, _ptr(t["hidden"]), _ptr(t["weight"]), dtype, rows, hidden_size, vocab,
            float(temperature), _ptr(ids), _ptr(log_prob), _ptr(entropy), _chunk(func, chunk_rows, vocab),
        )
    return log_prob, entropy


def linear_log_prob_entropy_backward(hidden, weight, targets=None, grad_log_prob=None, grad_entropy=None, *,
                                     temperature=1.0, chunk_rows=None):
    """:func:`ares.linear_log_prob_entropy_backward` on CUDA tensors: returns ``(grad_hidden
    [N, H], grad_weight [V, H])``, float32 on their device, from the gradients of the log-probs
    (with ``targets``) and of the entropies ([N] float32, either ``None`` but not both),
    recomputing each chunk's logits. In bfloat16, each chunk's ``∂L/∂logits`` is rounded to
    bfloat16 for its two products (float32 sums)."""
    import torch

    func = "linear_log_prob_entropy_backward"
    named = {"hidden": hidden, "weight": weight, "targets": targets, "grad_log_prob": grad_log_prob,
             "grad_entropy": grad_entropy}
    t, device, stream, dtype, rows, hidden_size, vocab = _head(func, named)
    for name in ("grad_log_prob", "grad_entropy"):
        if t[name] is not None:
            _same_shape(func, name, _f32(func, name, t[name]), (rows,))
    if (t["grad_log_prob"] is None) != (t["targets"] is None):
        raise ValueError(f"{func}: `targets` and `grad_log_prob` go together (the log-prob's gradient needs its targets)")
    if t["grad_log_prob"] is None and t["grad_entropy"] is None:
        raise ValueError(f"{func}: give `grad_log_prob` (with `targets`) or `grad_entropy`, or both")
    ids = _target_ids(func, t["targets"], (rows,), vocab)
    dev = t["hidden"].device
    grad_hidden = torch.empty((rows, hidden_size), dtype=torch.float32, device=dev)
    grad_weight = torch.zeros((vocab, hidden_size), dtype=torch.float32, device=dev)
    if rows:
        _load_cublas()
        _ares.cuda_linear_log_prob_entropy_backward(
            device, stream, _ptr(t["hidden"]), _ptr(t["weight"]), dtype, rows, hidden_size, vocab,
            float(temperature), _ptr(ids), _ptr(t["grad_log_prob"]), _ptr(t["grad_entropy"]), _ptr(grad_hidden),
            _ptr(grad_weight), _chunk(func, chunk_rows, vocab),
        )
    return grad_hidden, grad_weight


def entropy_windows(entropy, mask, *, window_size=4, includes_self=False, tau=None, trigger=None):
    """:func:`ares.entropy_windows` on CUDA tensors (float32 [rows, cols]); returns a dict of
    float32 tensors: ``means``, ``valid`` and, with ``tau``, ``hwe_mask``, ``counts``,
    ``soft_cost``."""
    import torch

    func = "entropy_windows"
    t, device, stream = _prepare(func, {"entropy": entropy, "mask": mask, "trigger": trigger})
    h = _f32(func, "entropy", t["entropy"])
    rows, cols = _rows_cols(func, "entropy", h)
    m = _f32(func, "mask", t["mask"])
    _same_shape(func, "mask", m, h.shape)
    trig = t["trigger"]
    if trig is not None:
        _same_shape(func, "trigger", _f32(func, "trigger", trig), h.shape)
    if int(window_size) < 1:
        raise ValueError(f"{func}: `window_size` must be >= 1, got {window_size}")
    new = lambda *shape: torch.empty(shape, dtype=torch.float32, device=h.device)  # noqa: E731
    out = {"means": new(rows, cols), "valid": new(rows, cols)}
    if tau is not None:
        out.update(hwe_mask=new(rows, cols), counts=new(rows), soft_cost=new(rows))
    if rows and cols:
        _ares.cuda_entropy_windows(
            device, stream, _ptr(h), _ptr(m), rows, cols, int(window_size), bool(includes_self),
            _ptr(out["means"]), _ptr(out["valid"]), None if tau is None else float(tau), _ptr(trig),
            _ptr(out.get("hwe_mask")), _ptr(out.get("counts")), _ptr(out.get("soft_cost")),
        )
    elif tau is not None:
        out["counts"].zero_()
        out["soft_cost"].zero_()
    return out


def row_percentile(means, valid, q=95.0):
    """:func:`ares.row_percentile` on CUDA tensors (float32 [rows, cols]); returns
    ``(threshold, has)``, float32 [rows]."""
    import torch

    func = "row_percentile"
    t, device, stream = _prepare(func, {"means": means, "valid": valid})
    m = _f32(func, "means", t["means"])
    rows, cols = _rows_cols(func, "means", m)
    v = _f32(func, "valid", t["valid"])
    _same_shape(func, "valid", v, m.shape)
    thr = torch.zeros(rows, dtype=torch.float32, device=m.device)
    has = torch.zeros(rows, dtype=torch.float32, device=m.device)
    if rows and cols:
        _ares.cuda_row_percentile(device, stream, _ptr(m), _ptr(v), rows, cols, float(q), _ptr(thr), _ptr(has))
    return thr, has


def masked_dynamic_kl(logp, logp_ref, mask, beta, *, hwe_mask=None, low_ratio=0.5, estimator="k3"):
    """:func:`ares.masked_dynamic_kl` on CUDA tensors (float32 [rows, cols]; ``beta`` a float or
    a float32 [rows] tensor); returns a dict: ``kl``, ``weighted`` [rows, cols],
    ``row_weighted_sum``, ``row_mean_kl`` [rows] (float32 tensors) and ``total`` (a float: reading
    it waits for the stream)."""
    import torch

    func = "masked_dynamic_kl"
    beta_t = beta if is_cuda(beta) else None
    t, device, stream = _prepare(
        func, {"logp": logp, "logp_ref": logp_ref, "mask": mask, "hwe_mask": hwe_mask, "beta": beta_t}
    )
    a = _f32(func, "logp", t["logp"])
    rows, cols = _rows_cols(func, "logp", a)
    for name in ("logp_ref", "mask", "hwe_mask"):
        if t[name] is not None:
            _same_shape(func, name, _f32(func, name, t[name]), a.shape)
    if not 0.0 <= float(low_ratio) <= 1.0:
        raise ValueError(f"{func}: `low_ratio` must be in [0, 1], got {low_ratio}")
    if beta_t is None:
        b = torch.full((rows,), float(beta), dtype=torch.float32, device=a.device)
    else:
        b = _f32(func, "beta", t["beta"])
        _same_shape(func, "beta", b, (rows,))
    new = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=a.device)  # noqa: E731
    out = {"kl": new(rows, cols), "weighted": new(rows, cols), "row_weighted_sum": new(rows),
           "row_mean_kl": new(rows)}
    total = new(1)
    if rows and cols:
        _ares.cuda_masked_dynamic_kl(
            device, stream, _ptr(a), _ptr(t["logp_ref"]), _ptr(t["mask"]), _ptr(t["hwe_mask"]), _ptr(b), rows, cols,
            float(low_ratio), str(estimator), _ptr(out["kl"]), _ptr(out["weighted"]), _ptr(out["row_weighted_sum"]),
            _ptr(out["row_mean_kl"]), _ptr(total),
        )
    out["total"] = float(total.item())
    return out


def policy_loss(logp, logp_old, advantages, mask, *, loss_mode="vanilla", loss_agg_mode="token-mean",
                clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0, is_correction="none",
                is_threshold_low=0.5, is_threshold_high=5.0, logp_rollout=None, clip_cov_ratio=2e-4,
                clip_cov_lb=1.0, clip_cov_ub=5.0, clip_cov_seed=0, kl_cov_ratio=2e-4, ppo_kl_coef=1.0):
    """:func:`ares.policy_loss` on CUDA tensors (float32 [rows, cols]): every ``loss_mode``
    runs ares-cuda's loss kernel on the caller's stream (``clip_cov`` and ``kl_cov`` choose
    their tokens over the whole batch with one more kernel first, as the CPU chooses them);
    returns the same dict as on the CPU, ``grad`` a float32 CUDA tensor (reading the floats
    waits for the stream)."""
    func = "policy_loss"
    if is_correction != "none" and logp_rollout is None:
        raise ValueError(f"{func}: `is_correction` = {is_correction!r} needs `logp_rollout`")
    import torch

    t, device, stream = _prepare(
        func,
        {"logp": logp, "logp_old": logp_old, "advantages": advantages, "mask": mask, "logp_rollout": logp_rollout},
    )
    a = _f32(func, "logp", t["logp"])
    rows, cols = _rows_cols(func, "logp", a)
    for name in ("logp_old", "advantages", "mask", "logp_rollout"):
        if t[name] is not None:
            _same_shape(func, name, _f32(func, name, t[name]), a.shape)
    grad = torch.zeros((rows, cols), dtype=torch.float32, device=a.device)
    if rows == 0 or cols == 0:
        raise ValueError(f"{func}: `mask` holds no valid token (shape {tuple(a.shape)})")
    rollout = t["logp_rollout"] if is_correction != "none" else None
    out = _ares.cuda_policy_loss(
        device, stream, _ptr(a), _ptr(t["logp_old"]), _ptr(t["advantages"]), _ptr(t["mask"]), _ptr(rollout),
        rows, cols, str(loss_mode), str(loss_agg_mode), float(clip_ratio_low), float(clip_ratio_high),
        float(clip_ratio_c), str(is_correction), float(is_threshold_low), float(is_threshold_high), _ptr(grad),
        float(clip_cov_ratio), float(clip_cov_lb), float(clip_cov_ub), int(clip_cov_seed), float(kl_cov_ratio),
        float(ppo_kl_coef),
    )
    out["grad"] = grad
    return out


# ---------------------------------------------------------------------------------------------
# The advantage estimators: float32 CUDA rewards [B] (and mask / weighted_kl [B, T]) in,
# float32 CUDA tensors out. The group layout (``n`` or ``uid``) is built on the host (a uid
# CUDA tensor is read back) and uploaded; each call reads the kernels' status (waits).


def _host_uid(uid):
    """The uid keys on the host: a torch tensor (on any device) as a numpy array, as the
    numpy functions read it (a tensor's elements would compare by identity)."""
    if type(uid).__module__.startswith("torch") and hasattr(uid, "detach"):
        return uid.detach().cpu().numpy()
    return uid


def _rewards(func, t):
    r = _f32(func, "rewards", t["rewards"])
    if r.dim() != 1:
        raise ValueError(f"{func}: `rewards` must be 1-D [B], got shape {tuple(r.shape)}")
    return r, int(r.shape[0])


def _sample(func, rewards, n, uid, epsilon=1e-6):
    import torch

    t, device, stream = _prepare(func, {"rewards": rewards})
    r, batch = _rewards(func, t)
    out = torch.empty(batch, dtype=torch.float32, device=r.device)
    _ares.cuda_sample_advantages(device, stream, func, _ptr(r), batch, n, _host_uid(uid), float(epsilon), _ptr(out))
    return out


def grpo_advantages(rewards, n=None, uid=None, *, epsilon=1e-6, norm_adv_by_std=True):
    """:func:`ares.grpo_advantages` on a float32 CUDA tensor ``rewards`` [B]: returns [B] on its
    device, equal to the CPU's bit for bit."""
    func = "grpo_advantages" if norm_adv_by_std else "dr_grpo_advantages"
    return _sample(func, rewards, n, uid, epsilon)


def dr_grpo_advantages(rewards, n=None, uid=None):
    """:func:`ares.dr_grpo_advantages` on a float32 CUDA tensor (bit for bit the CPU's)."""
    return _sample("dr_grpo_advantages", rewards, n, uid)


def rloo_advantages(rewards, n=None, uid=None):
    """:func:`ares.rloo_advantages` on a float32 CUDA tensor (bit for bit the CPU's)."""
    return _sample("rloo_advantages", rewards, n, uid)


def reinforce_baseline_advantages(rewards, n=None, uid=None):
    """:func:`ares.reinforce_baseline_advantages` on a float32 CUDA tensor (bit for bit the
    CPU's)."""
    return _sample("reinforce_baseline_advantages", rewards, n, uid)


def _tokens(func, rewards, mask, weighted_kl, n, uid, **options):
    """Token advantages [B, T] of ``func``, and the whitening's (mean, var) or ``None``."""
    import torch

    t, device, stream = _prepare(func, {"rewards": rewards, "mask": mask, "weighted_kl": weighted_kl})
    r, batch = _rewards(func, t)
    m = _f32(func, "mask", t["mask"])
    rows, cols = _rows_cols(func, "mask", m)
    if rows != batch:
        raise ValueError(f"{func}: `mask` has {rows} rows, expected {batch} (one per element of `rewards`)")
    k = t["weighted_kl"]
    if k is not None:
        _same_shape(func, "weighted_kl", _f32(func, "weighted_kl", k), m.shape)
    if cols == 0:
        raise ValueError(f"{func}: `mask` has 0 columns")
    out = torch.zeros((rows, cols), dtype=torch.float32, device=m.device)
    stats = _ares.cuda_token_advantages(
        device, stream, func, _ptr(r), rows, cols, _ptr(m), _ptr(k), n, _host_uid(uid), _ptr(out), **options
    )
    return out, stats


def grpo_token_advantages(rewards, mask, n=None, uid=None, *, epsilon=1e-6, norm_adv_by_std=True):
    """:func:`ares.grpo_token_advantages` on float32 CUDA tensors: [B, T] on their device."""
    return _tokens("grpo_token_advantages", rewards, mask, None, n, uid, epsilon=float(epsilon),
                   norm_adv_by_std=bool(norm_adv_by_std))[0]


def rloo_token_advantages(rewards, mask, n=None, uid=None, *, weighted_kl=None):
    """:func:`ares.rloo_token_advantages` on float32 CUDA tensors: [B, T] on their device."""
    return _tokens("rloo_token_advantages", rewards, mask, weighted_kl, n, uid)[0]


def reinforce_pp_advantages(rewards, mask, *, weighted_kl=None, gamma=1.0):
    """:func:`ares.reinforce_pp_advantages` on float32 CUDA tensors: [B, T] on their device."""
    return _tokens("reinforce_pp_advantages", rewards, mask, weighted_kl, None, None, gamma=float(gamma))[0]


def reinforce_pp_baseline_advantages(rewards, mask, n=None, uid=None, *, weighted_kl=None, gamma=1.0):
    """:func:`ares.reinforce_pp_baseline_advantages` on float32 CUDA tensors: [B, T] on their
    device."""
    return _tokens("reinforce_pp_baseline_advantages", rewards, mask, weighted_kl, n, uid, gamma=float(gamma))[0]


def reinforce_pro_max(rewards, mask, n=None, uid=None, *, weighted_kl=None, uniform_scale=False, eps=1e-8,
                      max_scale=10.0, product_cap=1e8, uniform_std=1e-8):
    """:func:`ares.reinforce_pro_max` on float32 CUDA tensors: [B, T] on their device."""
    return _tokens("reinforce_pro_max", rewards, mask, weighted_kl, n, uid, uniform_scale=bool(uniform_scale),
                   eps=float(eps), max_scale=float(max_scale), product_cap=float(product_cap),
                   uniform_std=float(uniform_std))[0]


def masked_whiten(values, mask):
    """:func:`ares.masked_whiten` on float32 CUDA tensors [rows, cols]: returns ``(whitened, mean,
    var)``, the whitened values a new tensor on their device."""
    func = "masked_whiten"
    t, device, stream = _prepare(func, {"values": values, "mask": mask})
    v = _f32(func, "values", t["values"])
    rows, cols = _rows_cols(func, "values", v)
    m = _f32(func, "mask", t["mask"])
    _same_shape(func, "mask", m, v.shape)
    if rows == 0 or cols == 0:
        raise ValueError(f"{func}: mask must have at least one element (or one valid element), and has none")
    out = v.clone()
    mean, var = _ares.cuda_masked_whiten(device, stream, _ptr(out), _ptr(m), rows, cols)
    return out, mean, var
