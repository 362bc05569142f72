"""ares: ares-core's RL math for LLM training over numpy arrays.

Every function takes float32 or float64 numpy arrays (one dtype per call; the outputs have
it too), reads C-contiguous inputs in place without copying, allocates each output once and
runs the computation with the GIL released. Groups of samples are given by ``n=``
(consecutive groups of n rows) or ``uid=`` (one key per row, as verl's ``index``). Bad input
raises ``ValueError`` with ares-core's message naming the argument.
"""

from ._ares import (
    GRPO_EPSILON,
    AdaptiveKlController,
    BucketController,
    EntropyCoefController,
    GrpoLambda,
    ThresholdEma,
    __version__,
    aggregate,
    aggregate_weights,
    dr_grpo_advantages,
    entropy_windows,
    grpo_advantages,
    grpo_lambda_rewards,
    grpo_token_advantages,
    log_prob_entropy,
    masked_dynamic_kl,
    masked_whiten,
    policy_loss,
    reinforce_baseline_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pro_max,
    rloo_advantages,
    rloo_token_advantages,
    row_percentile,
    token_kl,
)

__all__ = [
    "GRPO_EPSILON",
    "AdaptiveKlController",
    "BucketController",
    "EntropyCoefController",
    "GrpoLambda",
    "ThresholdEma",
    "__version__",
    "aggregate",
    "aggregate_weights",
    "dr_grpo_advantages",
    "entropy_windows",
    "grpo_advantages",
    "grpo_lambda_rewards",
    "grpo_token_advantages",
    "log_prob_entropy",
    "masked_dynamic_kl",
    "masked_whiten",
    "policy_loss",
    "reinforce_baseline_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "reinforce_pro_max",
    "rloo_advantages",
    "rloo_token_advantages",
    "row_percentile",
    "token_kl",
]
