"""Type stubs of the native module (re-exported by ``ares``)."""

from typing import Any, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import numpy.typing as npt

_F = TypeVar("_F", np.float32, np.float64)
_Arr = npt.NDArray[_F]
_Uid = Union[npt.NDArray[Any], Sequence[Any]]

__version__: str
GRPO_EPSILON: float

def grpo_advantages(
    rewards: _Arr[_F],
    n: Optional[int] = None,
    uid: Optional[_Uid] = None,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> _Arr[_F]: ...
def dr_grpo_advantages(rewards: _Arr[_F], n: Optional[int] = None, uid: Optional[_Uid] = None) -> _Arr[_F]: ...
def rloo_advantages(rewards: _Arr[_F], n: Optional[int] = None, uid: Optional[_Uid] = None) -> _Arr[_F]: ...
def reinforce_baseline_advantages(
    rewards: _Arr[_F], n: Optional[int] = None, uid: Optional[_Uid] = None
) -> _Arr[_F]: ...
def grpo_token_advantages(
    rewards: _Arr[_F],
    mask: _Arr[_F],
    n: Optional[int] = None,
    uid: Optional[_Uid] = None,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> _Arr[_F]: ...
def rloo_token_advantages(
    rewards: _Arr[_F],
    mask: _Arr[_F],
    n: Optional[int] = None,
    uid: Optional[_Uid] = None,
    *,
    weighted_kl: Optional[_Arr[_F]] = None,
) -> _Arr[_F]: ...
def reinforce_pp_advantages(
    rewards: _Arr[_F], mask: _Arr[_F], *, weighted_kl: Optional[_Arr[_F]] = None, gamma: float = 1.0
) -> _Arr[_F]: ...
def reinforce_pp_baseline_advantages(
    rewards: _Arr[_F],
    mask: _Arr[_F],
    n: Optional[int] = None,
    uid: Optional[_Uid] = None,
    *,
    weighted_kl: Optional[_Arr[_F]] = None,
    gamma: float = 1.0,
) -> _Arr[_F]: ...
def reinforce_pro_max(
    rewards: _Arr[_F],
    mask: _Arr[_F],
    n: Optional[int] = None,
    uid: Optional[_Uid] = None,
    *,
    weighted_kl: Optional[_Arr[_F]] = None,
    uniform_scale: bool = False,
    eps: float = 1e-8,
    max_scale: float = 10.0,
    product_cap: float = 1e8,
    uniform_std: float = 1e-8,
) -> _Arr[_F]: ...
def masked_whiten(values: _Arr[_F], mask: _Arr[_F]) -> Tuple[_Arr[_F], float, float]: ...
