"""ares: ares-core's RL math for LLM training over numpy arrays.

Every function takes float32 or float64 numpy arrays (one dtype per call; the outputs have
it too), reads C-contiguous inputs in place without copying, allocates each output once and
runs the computation with the GIL released. Groups of samples are given by ``n=``
(consecutive groups of n rows) or ``uid=`` (one key per row, as verl's ``index``). Bad input
raises ``ValueError`` with ares-core's message naming the argument.

Inputs may also be torch CPU tensors (bfloat16 logits included) or any object with
``__array_interface__`` or ``__dlpack__``: they are turned into numpy views of the same
memory (no copy; see ``ares.as_array``). Outputs are numpy arrays; ``torch.from_numpy`` wraps
them without a copy.

PyTorch CUDA tensors: the functions of ``ares._interop.CUDA_FUNCTIONS`` (the fused log-prob
+ entropy and its linear-head form, entropy windows, row percentile, masked dynamic KL, the
policy losses, the advantage estimators and ``masked_whiten``) run ares-cuda's kernels on them
where they are, on the caller's current stream, and return CUDA tensors (``ares._cuda``);
every other function is a ``ValueError`` on a CUDA tensor (it runs on CPU arrays).
"""

from typing import TYPE_CHECKING

from . import _ares
from ._ares import (
    DEFAULT_FORKING_RHO,
    GRPO_EPSILON,
    RUBRIC_AVOID_HEADER,
    RUBRIC_BASE,
    RUBRIC_CLOSING,
    RUBRIC_HIDE_INSTRUCTION,
    RUBRIC_INCLUDE_HEADER,
    RUBRIC_INTRO,
    AdaptiveKlController,
    EntropyCoefController,
    ThresholdEma,
    __version__,
    is_solved,
    reveal_count,
    reveal_ratio,
    rubric_message,
    select_criteria,
    solved_streak,
    step_factor,
)
from ._interop import as_array, routed, wrap

# Every array argument may be a torch CPU tensor or any __array_interface__ / __dlpack__
# object: it reaches the native function as a numpy view of the same memory.
if TYPE_CHECKING:  # the stubs of the native module give the signatures
    from ._ares import (
        aggregate,
        aggregate_weights,
        batch_median_threshold,
        bucket_means,
        dr_grpo_advantages,
        dynamic_kl_weights,
        entropy_grad_logits,
        entropy_rewards,
        entropy_windows,
        expand_keep,
        filter_groups,
        forking_token_mask,
        group_means,
        grpo_advantages,
        grpo_lambda_rewards,
        grpo_token_advantages,
        linear_log_prob_entropy,
        linear_log_prob_entropy_backward,
        log_prob_entropy,
        masked_dynamic_kl,
        masked_whiten,
        overlong_penalties,
        overlong_penalty,
        policy_loss,
        reinforce_baseline_advantages,
        reinforce_pp_advantages,
        reinforce_pp_baseline_advantages,
        reinforce_pro_max,
        rloo_advantages,
        rloo_token_advantages,
        row_percentile,
        rubric_score,
        token_kl,
    )
else:
    aggregate = wrap(_ares.aggregate)
    aggregate_weights = wrap(_ares.aggregate_weights)
    batch_median_threshold = wrap(_ares.batch_median_threshold)
    bucket_means = wrap(_ares.bucket_means)
    dr_grpo_advantages = routed(wrap(_ares.dr_grpo_advantages))
    dynamic_kl_weights = wrap(_ares.dynamic_kl_weights)
    entropy_grad_logits = wrap(_ares.entropy_grad_logits)
    entropy_rewards = wrap(_ares.entropy_rewards)
    entropy_windows = routed(wrap(_ares.entropy_windows))
    expand_keep = wrap(_ares.expand_keep)
    filter_groups = wrap(_ares.filter_groups)
    forking_token_mask = wrap(_ares.forking_token_mask)
    group_means = wrap(_ares.group_means)
    grpo_advantages = routed(wrap(_ares.grpo_advantages))
    grpo_lambda_rewards = wrap(_ares.grpo_lambda_rewards)
    grpo_token_advantages = routed(wrap(_ares.grpo_token_advantages))
    linear_log_prob_entropy = routed(wrap(_ares.linear_log_prob_entropy))
    linear_log_prob_entropy_backward = routed(wrap(_ares.linear_log_prob_entropy_backward))
    log_prob_entropy = routed(wrap(_ares.log_prob_entropy))
    log_prob_entropy_backward = wrap(_ares.log_prob_entropy_backward)
    masked_dynamic_kl = routed(wrap(_ares.masked_dynamic_kl))
    masked_whiten = routed(wrap(_ares.masked_whiten))
    overlong_penalty = _ares.overlong_penalty
    policy_loss = routed(wrap(_ares.policy_loss))
    reinforce_baseline_advantages = routed(wrap(_ares.reinforce_baseline_advantages))
    reinforce_pp_advantages = routed(wrap(_ares.reinforce_pp_advantages))
    reinforce_pp_baseline_advantages = routed(wrap(_ares.reinforce_pp_baseline_advantages))
    reinforce_pro_max = routed(wrap(_ares.reinforce_pro_max))
    rloo_advantages = routed(wrap(_ares.rloo_advantages))
    rloo_token_advantages = routed(wrap(_ares.rloo_token_advantages))
    row_percentile = routed(wrap(_ares.row_percentile))
    rubric_score = wrap(_ares.rubric_score)
    token_kl = wrap(_ares.token_kl)


    def overlong_penalties(lengths, max_len, buffer_len, penalty_factor=1.0, correct=None, *, dtype=None):
        # `dtype` (a numpy type, which has `__array__`) must not go through as_array
        f = "overlong_penalties"
        return _ares.overlong_penalties(
            as_array(lengths, f, "lengths"), max_len, buffer_len, penalty_factor, as_array(correct, f, "correct"), dtype=dtype
        )

    overlong_penalties.__doc__ = _ares.overlong_penalties.__doc__


class BucketController(_ares.BucketController):
    __doc__ = _ares.BucketController.__doc__
    __module__ = "ares"
    classify = wrap(_ares.BucketController.classify, "BucketController.classify")


class GrpoLambda(_ares.GrpoLambda):
    __doc__ = _ares.GrpoLambda.__doc__
    __module__ = "ares"
    rewards = wrap(_ares.GrpoLambda.rewards, "GrpoLambda.rewards")


__all__ = [
    "DEFAULT_FORKING_RHO",
    "GRPO_EPSILON",
    "RUBRIC_AVOID_HEADER",
    "RUBRIC_BASE",
    "RUBRIC_CLOSING",
    "RUBRIC_HIDE_INSTRUCTION",
    "RUBRIC_INCLUDE_HEADER",
    "RUBRIC_INTRO",
    "AdaptiveKlController",
    "BucketController",
    "EntropyCoefController",
    "GrpoLambda",
    "ThresholdEma",
    "__version__",
    "as_array",
    "aggregate",
    "aggregate_weights",
    "batch_median_threshold",
    "bucket_means",
    "dr_grpo_advantages",
    "dynamic_kl_weights",
    "entropy_grad_logits",
    "entropy_rewards",
    "entropy_windows",
    "expand_keep",
    "filter_groups",
    "forking_token_mask",
    "group_means",
    "grpo_advantages",
    "grpo_lambda_rewards",
    "grpo_token_advantages",
    "is_solved",
    "linear_log_prob_entropy",
    "linear_log_prob_entropy_backward",
    "log_prob_entropy",
    "log_prob_entropy_backward",
    "masked_dynamic_kl",
    "masked_whiten",
    "overlong_penalties",
    "overlong_penalty",
    "policy_loss",
    "reinforce_baseline_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "reinforce_pro_max",
    "reveal_count",
    "reveal_ratio",
    "rloo_advantages",
    "rloo_token_advantages",
    "row_percentile",
    "rubric_message",
    "rubric_score",
    "select_criteria",
    "solved_streak",
    "step_factor",
    "token_kl",
]
