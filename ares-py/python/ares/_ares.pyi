"""Type stubs of the native module (re-exported by ``ares``)."""

from typing import Any, Dict, Optional, Sequence, Tuple, TypeVar, Union

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
def policy_loss(
    logp: _Arr[_F],
    logp_old: _Arr[_F],
    advantages: _Arr[_F],
    mask: _Arr[_F],
    *,
    loss_mode: str = "vanilla",
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.3,
    clip_ratio_c: float = 3.0,
    is_correction: str = "none",
    is_threshold_low: float = 0.5,
    is_threshold_high: float = 5.0,
    logp_rollout: Optional[_Arr[_F]] = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    clip_cov_seed: int = 0,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 1.0,
) -> Dict[str, Any]: ...
def aggregate(values: _Arr[_F], mask: _Arr[_F], loss_agg_mode: str = "token-mean") -> float: ...
def aggregate_weights(mask: _Arr[_F], loss_agg_mode: str = "token-mean") -> _Arr[_F]: ...
def token_kl(
    logp: _Arr[_F],
    logp_ref: _Arr[_F],
    mask: _Arr[_F],
    *,
    estimator: str = "k3",
    kl_coef: Union[float, _Arr[_F], None] = None,
    hwe_mask: Optional[_Arr[_F]] = None,
    low_ratio: float = 0.5,
) -> Dict[str, Any]: ...
