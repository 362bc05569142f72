"""Array interop without copies: torch CPU tensors, objects with ``__array_interface__`` or
``__dlpack__`` become numpy views of the same memory before they reach the native module.

- ``torch.Tensor`` on the CPU: ``t.detach().numpy()`` (a view; ``detach`` shares storage);
  a ``torch.bfloat16`` tensor is viewed as ``int16`` bits (``t.view(torch.int16)``), which
  only ``log_prob_entropy``'s ``logits`` accepts;
- a tensor on another device (CUDA, MPS, meta) is a ``ValueError`` (the function runs on CPU
  arrays), except CUDA tensors given to the functions of :data:`CUDA_FUNCTIONS`, which
  :func:`routed` sends to ``ares._cuda``;
- other objects: ``np.asarray`` for ``__array_interface__`` / ``__array__``, else
  ``np.from_dlpack`` for ``__dlpack__`` (CPU only).

torch is never imported here: a tensor is recognised by its type's module.
"""

import functools
import inspect

import numpy as np

__all__ = ["as_array", "routed", "wrap"]

# the functions with a CUDA path (ares._cuda)
CUDA_FUNCTIONS = (
    "log_prob_entropy",
    "linear_log_prob_entropy",
    "linear_log_prob_entropy_backward",
    "entropy_windows",
    "row_percentile",
    "masked_dynamic_kl",
    "policy_loss",
    "grpo_advantages",
    "dr_grpo_advantages",
    "rloo_advantages",
    "reinforce_baseline_advantages",
    "grpo_token_advantages",
    "rloo_token_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "reinforce_pro_max",
    "masked_whiten",
)

# (function name, argument name) pairs that take bfloat16 bits
_BF16_ARGS = {("log_prob_entropy", "logits")}


def _is_torch_tensor(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "device")


def as_array(x, func="ares", name="argument", bf16_ok=False):
    """``x`` as a numpy array sharing its memory (numpy arrays, scalars, sequences and
    ``None`` are returned as they are)."""
    if x is None or isinstance(x, (np.ndarray, np.generic, str, bytes, int, float, bool, list, tuple, dict)):
        return x
    if _is_torch_tensor(x):
        dev = x.device
        if dev.type != "cpu":
            raise ValueError(
                f"{func}: `{name}` is a tensor on {dev}: this function runs on CPU arrays; move the tensor with "
                f".cpu() (CUDA tensors are taken by {', '.join(CUDA_FUNCTIONS)})"
            )
        t = x.detach()
        if str(t.dtype) == "torch.bfloat16":
            if not bf16_ok:
                raise ValueError(
                    f"{func}: `{name}` is a torch.bfloat16 tensor: only log_prob_entropy's logits take "
                    f"bfloat16; convert with .float()"
                )
            import torch  # only reached with a torch tensor in hand

            t = t.view(torch.int16)
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        return t.numpy()
    if hasattr(x, "__array_interface__") or hasattr(x, "__array_struct__") or hasattr(x, "__array__"):
        return np.asarray(x)
    if hasattr(x, "__dlpack__"):
        dev = getattr(x, "__dlpack_device__", None)
        if dev is not None and dev()[0] != 1:  # kDLCPU = 1
            raise ValueError(
                f"{func}: `{name}` lives on DLPack device {dev()}: ares runs on CPU arrays; move it to the CPU first"
            )
        return np.from_dlpack(x)
    return x


def wrap(fn, name=None):
    """``fn`` (a native function or method) with every array-like argument passed through
    :func:`as_array`."""
    fname = name or fn.__name__
    try:
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
    except (TypeError, ValueError):  # pragma: no cover - every native function has a signature
        params = []
    is_method = False
    try:
        is_method = next(iter(inspect.signature(fn).parameters)) == "self"
    except (TypeError, ValueError, StopIteration):  # pragma: no cover
        pass
    short = fname.rsplit(".", 1)[-1]

    def conv(i_or_name, v):
        pname = params[i_or_name] if isinstance(i_or_name, int) and i_or_name < len(params) else i_or_name
        return as_array(v, fname, pname, bf16_ok=(short, pname) in _BF16_ARGS)

    if is_method:

        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            args = [conv(i, a) for i, a in enumerate(args)]
            kwargs = {k: conv(k, v) for k, v in kwargs.items()}
            return fn(self, *args, **kwargs)

        return method

    @functools.wraps(fn)
    def function(*args, **kwargs):
        args = [conv(i, a) for i, a in enumerate(args)]
        kwargs = {k: conv(k, v) for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return function


def routed(cpu):
    """``cpu`` (a wrapped native function of :data:`CUDA_FUNCTIONS`), or its twin in
    ``ares._cuda`` when any argument is a CUDA tensor."""
    short = cpu.__name__.rsplit(".", 1)[-1]

    @functools.wraps(cpu)
    def function(*args, **kwargs):
        from . import _cuda

        if any(_cuda.is_cuda(a) for a in (*args, *kwargs.values())):
            return getattr(_cuda, short)(*args, **kwargs)
        return cpu(*args, **kwargs)

    return function
