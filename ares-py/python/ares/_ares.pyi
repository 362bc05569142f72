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

def dynamic_kl_weights(
    mask: _Arr[_F],
    *,
    kl_coef: Union[float, _Arr[_F], None] = None,
    hwe_mask: Optional[_Arr[_F]] = None,
    low_ratio: float = 0.5,
) -> _Arr[_F]: ...

# ---------------------------------------------------------------- stateful controllers

_Bucket = Union[str, int]
_PerBucket = Union[float, Dict[str, float], Sequence[float]]
_OptPerBucket = Union[Dict[str, Optional[float]], Sequence[Optional[float]], None]

class ThresholdEma:
    def __init__(self, rho: float = 0.99, tau: Optional[float] = None) -> None: ...
    @property
    def rho(self) -> float: ...
    @property
    def tau(self) -> Optional[float]: ...
    def update(self, m: float) -> float: ...
    def restore(self, tau: Optional[float]) -> None: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...

class BucketController:
    def __init__(
        self,
        *,
        accuracy_thresholds: Union[Dict[str, float], Tuple[float, float], None] = None,
        target_momentum: Optional[float] = None,
        target_scale: Optional[_PerBucket] = None,
        target_update_interval: Optional[int] = None,
        alpha_init: Optional[_PerBucket] = None,
        alpha_lr: Optional[float] = None,
        alpha_min: Optional[float] = None,
        alpha_max: Optional[float] = None,
        lambda_init: Optional[_PerBucket] = None,
        kl_budget: Optional[_PerBucket] = None,
        lambda_lr: Optional[float] = None,
        lambda_max: Optional[float] = None,
    ) -> None: ...
    @property
    def config(self) -> Dict[str, Any]: ...
    @property
    def targets(self) -> Dict[str, Optional[float]]: ...
    @property
    def alphas(self) -> Dict[str, float]: ...
    @property
    def lambdas(self) -> Dict[str, float]: ...
    @property
    def difficulty(self) -> Dict[str, str]: ...
    def target(self, bucket: _Bucket) -> Optional[float]: ...
    def alpha(self, bucket: _Bucket) -> float: ...
    def lambda_(self, bucket: _Bucket) -> float: ...
    def bootstrap(self, mean_hwe: _OptPerBucket) -> None: ...
    def step(self, mean_hwe: _OptPerBucket = None, mean_kl: _OptPerBucket = None, *, step: int) -> None: ...
    def step_bucket(self, bucket: _Bucket, mean_hwe: float, mean_kl: Optional[float] = None, *, step: int) -> None: ...
    def update_alpha(self, bucket: _Bucket, mean_hwe: float) -> float: ...
    def update_target(self, bucket: _Bucket, mean_hwe: float, *, step: int) -> bool: ...
    def update_lambda(self, bucket: _Bucket, mean_kl: float) -> float: ...
    def classify(
        self,
        correct: npt.NDArray[np.bool_],
        n: Optional[int] = None,
        uid: Optional[_Uid] = None,
        *,
        global_id: Optional[Sequence[Any]] = None,
    ) -> npt.NDArray[np.int64]: ...
    def set_difficulty(self, global_id: str, bucket: _Bucket) -> None: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...

class AdaptiveKlController:
    def __init__(self, init_kl_coef: float, target: float = 0.1, horizon: float = 10000.0) -> None: ...
    @property
    def value(self) -> float: ...
    @property
    def target(self) -> float: ...
    @property
    def horizon(self) -> float: ...
    def update(self, current_kl: float, n_samples: int) -> float: ...
    def state_dict(self) -> Dict[str, float]: ...
    def load_state_dict(self, state: Dict[str, float]) -> None: ...

class EntropyCoefController:
    def __init__(
        self, coef: float = 0.0, target: float = 0.2, lr: float = 1e-3, min: float = 0.0, max: float = 5e-3
    ) -> None: ...
    @property
    def coef(self) -> float: ...
    @property
    def target(self) -> float: ...
    def update(self, mean_entropy: float) -> float: ...
    def state_dict(self) -> Dict[str, float]: ...
    def load_state_dict(self, state: Dict[str, float]) -> None: ...

def grpo_lambda_rewards(
    correct: npt.NDArray[np.bool_],
    lengths: _Arr[_F],
    n: Optional[int] = None,
    uid: Optional[_Uid] = None,
    *,
    lambda_: float = 0.2,
    alpha: float = 0.6,
) -> Dict[str, Any]: ...

class GrpoLambda:
    def __init__(self, lambda_: float = 0.2, alpha: float = 0.6) -> None: ...
    @property
    def lambda_(self) -> float: ...
    @property
    def alpha(self) -> float: ...
    def top_group_count(self, groups: int) -> int: ...
    def rewards(
        self, correct: npt.NDArray[np.bool_], lengths: _Arr[_F], n: Optional[int] = None, uid: Optional[_Uid] = None
    ) -> Dict[str, Any]: ...
    def state_dict(self) -> Dict[str, float]: ...
    def load_state_dict(self, state: Dict[str, float]) -> None: ...

# ---------------------------------------------------------------- CPU token kernels (float32)

_F32 = npt.NDArray[np.float32]

def log_prob_entropy(
    logits: Union[_F32, npt.NDArray[np.float16], npt.NDArray[np.uint16], npt.NDArray[np.int16]],
    targets: Optional[npt.NDArray[np.integer[Any]]] = None,
    *,
    temperature: float = 1.0,
) -> Tuple[Optional[_F32], _F32]: ...
def log_prob_entropy_backward(
    logits: _F32,
    targets: Optional[npt.NDArray[np.integer[Any]]] = None,
    grad_log_prob: Optional[_F32] = None,
    grad_entropy: Optional[_F32] = None,
    *,
    temperature: float = 1.0,
) -> _F32: ...
def linear_log_prob_entropy(
    hidden: _F32,
    weight: _F32,
    targets: Optional[npt.NDArray[np.integer[Any]]] = None,
    *,
    temperature: float = 1.0,
    chunk_rows: Optional[int] = None,
) -> Tuple[Optional[_F32], _F32]: ...
def linear_log_prob_entropy_backward(
    hidden: _F32,
    weight: _F32,
    targets: Optional[npt.NDArray[np.integer[Any]]] = None,
    grad_log_prob: Optional[_F32] = None,
    grad_entropy: Optional[_F32] = None,
    *,
    temperature: float = 1.0,
    chunk_rows: Optional[int] = None,
) -> Tuple[_F32, _F32]: ...
def entropy_windows(
    entropy: _F32,
    mask: _F32,
    *,
    window_size: int = 4,
    includes_self: bool = False,
    tau: Optional[float] = None,
    trigger: Optional[_F32] = None,
) -> Dict[str, _F32]: ...
def row_percentile(means: _F32, valid: _F32, q: float = 95.0) -> Tuple[_F32, _F32]: ...
def masked_dynamic_kl(
    logp: _F32,
    logp_ref: _F32,
    mask: _F32,
    beta: Union[float, _F32],
    *,
    hwe_mask: Optional[_F32] = None,
    low_ratio: float = 0.5,
    estimator: str = "k3",
) -> Dict[str, Any]: ...

# ---------------------------------------------------------------- forking, overlong, entropy bonus, shaping

DEFAULT_FORKING_RHO: float

def forking_token_mask(
    entropies: _Arr[_F], mask: _Arr[_F], rho: float = 0.2
) -> Tuple[_Arr[_F], Dict[str, Any]]: ...
def overlong_penalty(length: int, max_len: int, buffer_len: int, penalty_factor: float = 1.0) -> float: ...
def overlong_penalties(
    lengths: Union[npt.NDArray[np.integer[Any]], Sequence[int]],
    max_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
    correct: Optional[npt.NDArray[np.bool_]] = None,
    *,
    dtype: Any = None,
) -> Tuple[npt.NDArray[Any], int]: ...
def entropy_grad_logits(logits: _Arr[_F], temperature: float = 1.0) -> Tuple[Union[float, _Arr[_F]], _Arr[_F]]: ...
def entropy_rewards(
    correct: npt.NDArray[np.bool_],
    hwe_count: _Arr[_F],
    target: _Arr[_F],
    alpha: _Arr[_F],
    difficulty: Union[npt.NDArray[np.integer[Any]], Sequence[Union[str, int]]],
    *,
    format_reward: Optional[_Arr[_F]] = None,
    format_weight: float = 0.0,
) -> Tuple[_Arr[_F], _Arr[_F]]: ...

# ---------------------------------------------------------------- online filtering, drop_solved, buckets

def group_means(values: _Arr[_F], n: Optional[int] = None, uid: Optional[_Uid] = None) -> _Arr[_F]: ...
def filter_groups(
    values: _Arr[_F],
    n: Optional[int] = None,
    uid: Optional[_Uid] = None,
    *,
    filter_low: float = 0.01,
    filter_high: float = 0.99,
) -> Tuple[npt.NDArray[np.bool_], int]: ...
def expand_keep(
    keep_groups: npt.NDArray[np.bool_], n: Optional[int] = None, uid: Optional[_Uid] = None
) -> Tuple[npt.NDArray[np.bool_], int]: ...
def solved_streak(prev_streak: int, all_correct: bool, mean_entropy: float, entropy_threshold: float = 0.3) -> int: ...
def is_solved(streak: int, k: int = 3) -> bool: ...
def bucket_means(
    difficulty: Union[npt.NDArray[np.integer[Any]], Sequence[Union[str, int]]], values: _Arr[_F]
) -> Dict[str, Optional[float]]: ...
def batch_median_threshold(threshold: _Arr[_F], has: _Arr[_F]) -> Optional[float]: ...

# ---------------------------------------------------------------- graded rubric prompt

RUBRIC_INTRO: str
RUBRIC_INCLUDE_HEADER: str
RUBRIC_AVOID_HEADER: str
RUBRIC_CLOSING: str
RUBRIC_HIDE_INSTRUCTION: str
RUBRIC_BASE: str

def reveal_ratio(
    k: int,
    n: int,
    *,
    step: int = 1,
    total_steps: int = 1,
    schedule: str = "linear",
    full_reveal_count: int = 1,
    power: float = 1.0,
    start_point: float = 0.3,
    steepness: float = 10.0,
) -> float: ...
def step_factor(
    step: int,
    total_steps: int,
    schedule: str = "step_linear",
    *,
    power: float = 1.0,
    start_point: float = 0.3,
    steepness: float = 10.0,
) -> float: ...
def reveal_count(
    k: int,
    n: int,
    criteria: int,
    *,
    step: int = 1,
    total_steps: int = 1,
    schedule: str = "linear",
    full_reveal_count: int = 1,
    power: float = 1.0,
    start_point: float = 0.3,
    steepness: float = 10.0,
) -> Tuple[int, bool]: ...
def select_criteria(count: int, total: int, seed: int, *, all: bool = False) -> list[int]: ...
def rubric_message(
    criteria: Sequence[Tuple[str, float]],
    shown: Sequence[int],
    *,
    hide_instruction: bool = True,
    add_base_when_zero: bool = False,
    intro: Optional[str] = None,
    include_header: Optional[str] = None,
    avoid_header: Optional[str] = None,
    closing: Optional[str] = None,
    base: Optional[str] = None,
) -> Optional[str]: ...
def rubric_score(
    points: Union[_Arr[_F], Sequence[float]], met: Union[npt.NDArray[np.bool_], Sequence[bool]]
) -> float: ...

# ---------------------------------------------------------------- CUDA tensors (used by ares._cuda)
# Device addresses, the device ordinal and the caller's stream handle as integers; shapes and
# dtypes are checked by ares._cuda before these are called.

def cuda_driver_available() -> bool: ...
def cuda_log_prob_entropy(
    device: int, stream: int, logits: int, dtype: str, rows: int, vocab: int, temperature: float,
    targets: int, out_log_prob: int, out_entropy: int,
) -> None: ...
def cuda_log_prob_entropy_backward(
    device: int, stream: int, logits: int, rows: int, vocab: int, temperature: float, targets: int,
    grad_log_prob: int, grad_entropy: int, out_dlogits: int,
) -> None: ...
def cuda_entropy_windows(
    device: int, stream: int, entropy: int, mask: int, rows: int, cols: int, window_size: int,
    includes_self: bool, out_means: int, out_valid: int, tau: Optional[float], trigger: int,
    out_hwe_mask: int, out_counts: int, out_soft_cost: int,
) -> None: ...
def cuda_row_percentile(
    device: int, stream: int, means: int, valid: int, rows: int, cols: int, q: float, out_threshold: int,
    out_has: int,
) -> None: ...
def cuda_masked_dynamic_kl(
    device: int, stream: int, logp: int, ref_logp: int, mask: int, hwe_mask: int, beta_rows: int, rows: int,
    cols: int, low_ratio: float, estimator: str, out_kl: int, out_weighted: int, out_row_weighted_sum: int,
    out_row_mean_kl: int, out_total: int,
) -> None: ...
def cuda_policy_loss(
    device: int, stream: int, logp: int, logp_old: int, advantages: int, mask: int, logp_rollout: int, rows: int,
    cols: int, loss_mode: str, loss_agg_mode: str, clip_ratio_low: float, clip_ratio_high: float,
    clip_ratio_c: float, is_correction: str, is_threshold_low: float, is_threshold_high: float, out_grad: int,
    clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float, clip_cov_seed: int, kl_cov_ratio: float,
    ppo_kl_coef: float,
) -> Dict[str, Any]: ...
def cuda_linear_log_prob_entropy(
    device: int, stream: int, hidden: int, weight: int, dtype: str, rows: int, hidden_size: int, vocab: int,
    temperature: float, targets: int, out_log_prob: int, out_entropy: int, chunk_rows: int,
) -> None: ...
def cuda_linear_log_prob_entropy_backward(
    device: int, stream: int, hidden: int, weight: int, dtype: str, rows: int, hidden_size: int, vocab: int,
    temperature: float, targets: int, grad_log_prob: int, grad_entropy: int, out_grad_hidden: int,
    out_grad_weight: int, chunk_rows: int,
) -> None: ...
def cuda_sample_advantages(
    device: int, stream: int, func: str, rewards: int, batch: int, n: Optional[int], uid: Optional[_Uid],
    epsilon: float, out: int,
) -> None: ...
def cuda_token_advantages(
    device: int, stream: int, func: str, rewards: int, rows: int, cols: int, mask: int, weighted_kl: int,
    n: Optional[int], uid: Optional[_Uid], out: int, *, epsilon: float = 1e-6, norm_adv_by_std: bool = True,
    gamma: float = 1.0, uniform_scale: bool = False, eps: float = 1e-8, max_scale: float = 10.0,
    product_cap: float = 1e8, uniform_std: float = 1e-8,
) -> Optional[Tuple[float, float]]: ...
def cuda_masked_whiten(device: int, stream: int, values: int, mask: int, rows: int, cols: int) -> Tuple[float, float]: ...
