//! Token entropy, window entropy and high-window-entropy (HWE) tokens (docs/algorithms.md §1).
//!
//! The ARES pipeline for one step, as data flows through this module:
//!
//! 1. [`token_log_prob_and_entropy`] (or [`token_entropy`]): per token, from the logits
//!    divided by the sampling temperature, `H = logsumexp(z) − Σ softmax(z)·z`, in one pass.
//! 2. [`window_means`]: per response position `t`, the mean entropy `W_t` of the `w`
//!    following tokens (or of `t … t+w−1` with `window_includes_self`), only where the whole
//!    window lies inside the response.
//! 3. [`response_thresholds`]: per response, the `percentile` (default 95, numpy's linear
//!    interpolation) of its complete-window means.
//! 4. [`batch_median_threshold`]: `m` = median of the per-response thresholds;
//!    [`ThresholdEma::update`] folds it into the global threshold `τ`.
//! 5. [`hwe`]: HWE tokens (`W_t ≥ τ` on a complete window, optionally only at trigger
//!    words), their count per response (`high_entropy_token_num`) and the soft cost
//!    `Σ max(0, W_t − τ)`.
//!
//! Token tensors are padded row-major `[rows, cols]` slices described by a [`crate::Shape`]
//! with 0/1 float masks. Outputs are caller-provided; on error their contents are
//! unspecified (rows before the offending one may already be written).

mod logits;
mod threshold;
mod window;

pub use logits::{token_entropy, token_log_prob_and_entropy};
pub use threshold::{
    DEFAULT_EMA_RHO, DEFAULT_PERCENTILE, ThresholdEma, batch_median_threshold, median, percentile,
    response_thresholds,
};
pub use window::{DEFAULT_WINDOW_SIZE, hwe, window_means};
