//! Policy losses with dL/dlogπ, loss aggregation, and the token-level KL family.

use crate::args::by_dtype;
use crate::args::{
    Input, Output, Real, cast, core_err, f64_of, float_dtype, token_input, value_error,
};
use ares_core::kl::{KlCoefficient, KlEstimator, TokenKlConfig, TokenKlOutputs};
use ares_core::loss::{
    self, ClipCovParams, ClipParams, GspoLevel, IsCorrection, IsMode, KlCovParams, LossAggMode,
    PolicyLossConfig, PolicyLossInput,
};
use ares_core::{Error, Shape};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Registers the functions of this file.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(policy_loss, m)?)?;
    m.add_function(wrap_pyfunction!(aggregate, m)?)?;
    m.add_function(wrap_pyfunction!(aggregate_weights, m)?)?;
    m.add_function(wrap_pyfunction!(token_kl, m)?)?;
    m.add_function(wrap_pyfunction!(dynamic_kl_weights, m)?)?;
    Ok(())
}

pub(crate) fn agg_mode(func: &str, name: &str) -> PyResult<LossAggMode> {
    LossAggMode::from_name(name).ok_or_else(|| {
        value_error(format!(
            "{func}: `loss_agg_mode` = {name:?} is not one of \"token-mean\", \"token-sum\", \
             \"seq-mean-token-sum\", \"seq-mean-token-mean\", \"seq-mean-token-sum-norm\""
        ))
    })
}

/// A policy loss by its `loss_mode` name.
#[derive(Clone, Copy)]
pub(crate) enum Mode {
    Vanilla,
    Gspo(GspoLevel),
    Cispo,
    ClipCov,
    KlCov,
}

/// `loss_mode` parsed, or an error listing the names.
pub(crate) fn loss_mode_of(func: &str, loss_mode: &str) -> PyResult<Mode> {
    Ok(match loss_mode {
        "vanilla" | "ppo" => Mode::Vanilla,
        "gspo" => Mode::Gspo(GspoLevel::Sequence),
        "gspo_token" => Mode::Gspo(GspoLevel::Token),
        "cispo" => Mode::Cispo,
        "clip_cov" => Mode::ClipCov,
        "kl_cov" => Mode::KlCov,
        other => {
            return Err(value_error(format!(
                "{func}: `loss_mode` = {other:?} is not one of \"vanilla\", \"gspo\", \
                 \"gspo_token\", \"cispo\", \"clip_cov\", \"kl_cov\""
            )));
        }
    })
}

/// `is_correction` parsed, or an error listing the names.
pub(crate) fn is_mode(func: &str, is_correction: &str) -> PyResult<IsMode> {
    IsMode::from_name(is_correction).ok_or_else(|| {
        value_error(format!(
            "{func}: `is_correction` = {is_correction:?} is not one of \"none\", \"tis\", \
             \"icepop\", \"reinforce_pro\""
        ))
    })
}

/// The policy loss of `loss_mode` over `[B, T]` token tensors, with its gradient.
///
/// `vanilla` (PPO clip / dual clip): per token `L = max(−A·r, −A·clip(r, 1 − ε_low,
/// 1 + ε_high))`, capped at `−A·c` for A < 0 (c = `clip_ratio_c`, 0 = off), with
/// `r = exp(clamp(logp − logp_old, ±20))`. Also `gspo` (sequence ratio `exp(mean_t ℓ_t)`),
/// `gspo_token` (verl's `gspo`), `cispo` (`−sg(clip(r))·A·logπ`), `clip_cov` and `kl_cov`.
/// The loss is `agg(w_t·L_t)` by `loss_agg_mode`; `w_t` is the rollout importance weight of
/// `is_correction` ("none", "tis", "icepop", "reinforce_pro"; needs `logp_rollout`).
///
/// logp, logp_old, advantages, mask: [B, T], one float dtype. Returns a dict: `loss`
/// (float), `grad` (∂loss/∂logp, [B, T], 0 on padding), `clipfrac`, `clipfrac_lower`,
/// `approx_kl`, `is_weight_mean`, `is_changed_frac`, `selected_frac` (floats),
/// `valid_tokens` (int).
#[pyfunction]
#[pyo3(signature = (logp, logp_old, advantages, mask, *, loss_mode="vanilla",
    loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0,
    is_correction="none", is_threshold_low=0.5, is_threshold_high=5.0, logp_rollout=None,
    clip_cov_ratio=loss::CLIP_COV_RATIO, clip_cov_lb=loss::CLIP_COV_LB,
    clip_cov_ub=loss::CLIP_COV_UB, clip_cov_seed=0, kl_cov_ratio=loss::KL_COV_RATIO,
    ppo_kl_coef=loss::PPO_KL_COEF))]
#[allow(clippy::too_many_arguments)]
fn policy_loss<'py>(
    py: Python<'py>,
    logp: &Bound<'py, PyAny>,
    logp_old: &Bound<'py, PyAny>,
    advantages: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    loss_mode: &str,
    loss_agg_mode: &str,
    clip_ratio_low: f64,
    clip_ratio_high: f64,
    clip_ratio_c: f64,
    is_correction: &str,
    is_threshold_low: f64,
    is_threshold_high: f64,
    logp_rollout: Option<&Bound<'py, PyAny>>,
    clip_cov_ratio: f64,
    clip_cov_lb: f64,
    clip_cov_ub: f64,
    clip_cov_seed: u64,
    kl_cov_ratio: f64,
    ppo_kl_coef: f64,
) -> PyResult<Bound<'py, PyDict>> {
    const FUNC: &str = "policy_loss";
    let agg = agg_mode(FUNC, loss_agg_mode)?;
    let is_mode = is_mode(FUNC, is_correction)?;
    let mode = loss_mode_of(FUNC, loss_mode)?;
    by_dtype!(float_dtype(FUNC, "logp", logp)?, F => {
        let (lp, shape) = token_input::<F>(FUNC, "logp", logp, None)?;
        let (old, _) = token_input::<F>(FUNC, "logp_old", logp_old, Some(shape))?;
        let (adv, _) = token_input::<F>(FUNC, "advantages", advantages, Some(shape))?;
        let (m, _) = token_input::<F>(FUNC, "mask", mask, Some(shape))?;
        let rollout = match logp_rollout {
            Some(r) => Some(token_input::<F>(FUNC, "logp_rollout", r, Some(shape))?.0),
            None => None,
        };
        let config = PolicyLossConfig::<F> {
            clip: ClipParams {
                clip_ratio_low: cast(clip_ratio_low),
                clip_ratio_high: cast(clip_ratio_high),
                clip_ratio_c: cast(clip_ratio_c),
            },
            agg,
            is_correction: IsCorrection {
                mode: is_mode,
                low: cast(is_threshold_low),
                high: cast(is_threshold_high),
            },
        };
        let clip_cov = ClipCovParams::<F> {
            ratio: cast(clip_cov_ratio),
            lb: cast(clip_cov_lb),
            ub: cast(clip_cov_ub),
            seed: clip_cov_seed,
        };
        let kl_cov = KlCovParams::<F> { ratio: cast(kl_cov_ratio), coef: cast(ppo_kl_coef) };
        let grad = Output::<F>::new(py, &[shape.rows, shape.cols]);
        let out = {
            let mut w = grad.write()?;
            let g = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let input = PolicyLossInput {
                shape,
                logp: lp.slice(),
                logp_old: old.slice(),
                advantages: adv.slice(),
                mask: m.slice(),
                logp_rollout: rollout.as_ref().map(|r| r.slice()),
            };
            py.detach(move || match mode {
                Mode::Vanilla => loss::policy_loss(&input, &config, g),
                Mode::Gspo(level) => loss::gspo_loss(&input, &config, level, g),
                Mode::Cispo => loss::cispo_loss(&input, &config, g),
                Mode::ClipCov | Mode::KlCov => {
                    let mut scratch = vec![0usize; input.logp.len()];
                    if let Mode::ClipCov = mode {
                        loss::clip_cov_loss(&input, &config, &clip_cov, &mut scratch, g)
                    } else {
                        loss::kl_cov_loss(&input, &config, &kl_cov, &mut scratch, g)
                    }
                }
            })
            .map_err(|e| core_err(FUNC, e))?
        };
        let d = PyDict::new(py);
        d.set_item("loss", f64_of(out.loss))?;
        d.set_item("grad", grad.array)?;
        d.set_item("clipfrac", f64_of(out.clipfrac))?;
        d.set_item("clipfrac_lower", f64_of(out.clipfrac_lower))?;
        d.set_item("approx_kl", f64_of(out.approx_kl))?;
        d.set_item("is_weight_mean", f64_of(out.is_weight_mean))?;
        d.set_item("is_changed_frac", f64_of(out.is_changed_frac))?;
        d.set_item("selected_frac", f64_of(out.selected_frac))?;
        d.set_item("valid_tokens", out.valid_tokens)?;
        Ok(d)
    })
}

/// Aggregates per-token `values` [B, T] over `mask` by `loss_agg_mode` (verl's names), with
/// n_r valid tokens in row r, R rows with n_r > 0, T = columns:
/// `token-mean` Σm·L/Σm; `token-sum` Σm·L; `seq-mean-token-sum` (1/R)Σ_r Σ_t m·L;
/// `seq-mean-token-mean` (1/R)Σ_r (Σ_t m·L / n_r); `seq-mean-token-sum-norm` Σm·L/(R·T).
/// Returns a float. Spec vector: L = [[1, 2, 3], [4, 0, 0]], m = [[1, 1, 1], [1, 0, 0]] →
/// 2.5, 10, 5, 3, 1.6666667.
#[pyfunction]
#[pyo3(signature = (values, mask, loss_agg_mode="token-mean"))]
fn aggregate(
    py: Python<'_>,
    values: &Bound<'_, PyAny>,
    mask: &Bound<'_, PyAny>,
    loss_agg_mode: &str,
) -> PyResult<f64> {
    const FUNC: &str = "aggregate";
    let mode = agg_mode(FUNC, loss_agg_mode)?;
    by_dtype!(float_dtype(FUNC, "values", values)?, F => {
        let (v, shape) = token_input::<F>(FUNC, "values", values, None)?;
        let (m, _) = token_input::<F>(FUNC, "mask", mask, Some(shape))?;
        let (vs, ms) = (v.slice(), m.slice());
        py.detach(move || loss::aggregate(shape, vs, ms, mode))
            .map(f64_of)
            .map_err(|e| core_err(FUNC, e))
    })
}

/// The weights `∂agg/∂L_t` of `loss_agg_mode` over `mask` [B, T] (0 on padding):
/// Σ_t weights·L is the aggregate. Returns [B, T] in the dtype of `mask`.
#[pyfunction]
#[pyo3(signature = (mask, loss_agg_mode="token-mean"))]
fn aggregate_weights<'py>(
    py: Python<'py>,
    mask: &Bound<'py, PyAny>,
    loss_agg_mode: &str,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "aggregate_weights";
    let mode = agg_mode(FUNC, loss_agg_mode)?;
    by_dtype!(float_dtype(FUNC, "mask", mask)?, F => {
        let (m, shape) = token_input::<F>(FUNC, "mask", mask, None)?;
        let out = Output::<F>::new(py, &[shape.rows, shape.cols]);
        {
            let mut w = out.write()?;
            let o = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let ms = m.slice();
            py.detach(move || loss::aggregate_weights(shape, ms, mode, o))
                .map_err(|e| core_err(FUNC, e))?;
        }
        Ok(out.array.into_any())
    })
}

/// The token-level KL pass: per token δ = logp − logp_ref and `k_t` by `estimator`
/// ("k1"/"kl": δ; "abs": |δ|; "k2"/"mse": δ²/2; "k3"/"low_var_kl": e^x − x − 1 with x = −δ,
/// clamped; "k1+"/"k3+": value of k1/k3 with the gradient of k2), weighted by
/// `β_t = β_r·(hwe_t ? low_ratio : 1)` with β_r = `kl_coef` (a float, or an array [B]).
///
/// logp, logp_ref, mask (and hwe_mask): [B, T], one float dtype. Returns a dict: `kl`
/// (k·m), `weighted` (β·k·m), `grad` (β·m·dk/dlogp) [B, T]; `row_weighted_sum`,
/// `row_mean_kl` [B]; `weighted_sum`, `kl_sum`, `token_mean_kl`, `seq_mean_kl` (floats),
/// `valid_tokens`, `nonempty_rows` (ints). Spec vector: k3(−1, −1.5) = 0.1065307,
/// k3(−2, −1) = 0.7182818.
#[pyfunction]
#[pyo3(signature = (logp, logp_ref, mask, *, estimator="k3", kl_coef=None, hwe_mask=None,
    low_ratio=ares_core::kl::DEFAULT_LOW_RATIO))]
#[allow(clippy::too_many_arguments)]
fn token_kl<'py>(
    py: Python<'py>,
    logp: &Bound<'py, PyAny>,
    logp_ref: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    estimator: &str,
    kl_coef: Option<&Bound<'py, PyAny>>,
    hwe_mask: Option<&Bound<'py, PyAny>>,
    low_ratio: f64,
) -> PyResult<Bound<'py, PyDict>> {
    const FUNC: &str = "token_kl";
    let est = KlEstimator::from_name(estimator).ok_or_else(|| {
        value_error(format!(
            "{FUNC}: `estimator` = {estimator:?} is not one of \"k1\" (\"kl\"), \"abs\", \
             \"k2\" (\"mse\"), \"k3\" (\"low_var_kl\"), \"k1+\", \"k3+\""
        ))
    })?;
    let uniform_beta = uniform_kl_coef(FUNC, kl_coef)?;
    by_dtype!(float_dtype(FUNC, "logp", logp)?, F => {
        let (lp, shape) = token_input::<F>(FUNC, "logp", logp, None)?;
        let (lr, _) = token_input::<F>(FUNC, "logp_ref", logp_ref, Some(shape))?;
        let (m, _) = token_input::<F>(FUNC, "mask", mask, Some(shape))?;
        let hwe = match hwe_mask {
            Some(h) => Some(token_input::<F>(FUNC, "hwe_mask", h, Some(shape))?.0),
            None => None,
        };
        let per_row = per_row_kl_coef::<F>(FUNC, uniform_beta, kl_coef, shape)?;
        let tok = |py| Output::<F>::new(py, &[shape.rows, shape.cols]);
        let (kl, weighted, grad) = (tok(py), tok(py), tok(py));
        let row_sum = Output::<F>::new(py, &[shape.rows]);
        let row_mean = Output::<F>::new(py, &[shape.rows]);
        let summary = {
            let (mut w1, mut w2, mut w3) = (kl.write()?, weighted.write()?, grad.write()?);
            let (mut w4, mut w5) = (row_sum.write()?, row_mean.write()?);
            let err = |e: numpy::AsSliceError| value_error(e.to_string());
            let outs = TokenKlOutputs {
                kl: Some(w1.as_slice_mut().map_err(err)?),
                weighted: Some(w2.as_slice_mut().map_err(err)?),
                grad: Some(w3.as_slice_mut().map_err(err)?),
                row_weighted_sum: Some(w4.as_slice_mut().map_err(err)?),
                row_mean_kl: Some(w5.as_slice_mut().map_err(err)?),
            };
            let mut cfg = TokenKlConfig::new(est, kl_coefficient(&per_row, uniform_beta));
            cfg.low_ratio = cast(low_ratio);
            if let Some(h) = &hwe {
                cfg = cfg.with_hwe(h.slice(), cast(low_ratio));
            }
            let (lps, lrs, ms) = (lp.slice(), lr.slice(), m.slice());
            run_kl(py, shape, lps, lrs, ms, &cfg, outs).map_err(|e| core_err(FUNC, e))?
        };
        let d = PyDict::new(py);
        d.set_item("kl", kl.array)?;
        d.set_item("weighted", weighted.array)?;
        d.set_item("grad", grad.array)?;
        d.set_item("row_weighted_sum", row_sum.array)?;
        d.set_item("row_mean_kl", row_mean.array)?;
        d.set_item("weighted_sum", f64_of(summary.weighted_sum))?;
        d.set_item("kl_sum", f64_of(summary.kl_sum))?;
        d.set_item("token_mean_kl", f64_of(summary.token_mean_kl))?;
        d.set_item("seq_mean_kl", f64_of(summary.seq_mean_kl))?;
        d.set_item("valid_tokens", summary.valid_tokens)?;
        d.set_item("nonempty_rows", summary.nonempty_rows)?;
        Ok(d)
    })
}

/// `kl_coef` as one β: `None` → 1, a Python number → that number; `None` when it is an
/// array (β per row, read by [`per_row_kl_coef`] once the dtype is known).
fn uniform_kl_coef(func: &str, kl_coef: Option<&Bound<'_, PyAny>>) -> PyResult<Option<f64>> {
    match kl_coef {
        None => Ok(Some(1.0)),
        Some(k) if k.cast::<numpy::PyUntypedArray>().is_err() => {
            Ok(Some(k.extract::<f64>().map_err(|_| {
                value_error(format!(
                    "{func}: `kl_coef` must be a float or a numpy array [B]"
                ))
            })?))
        }
        Some(_) => Ok(None),
    }
}

/// `kl_coef` as β per row (an array of `shape.rows` elements), when it is not one number.
fn per_row_kl_coef<'py, F: Real>(
    func: &str,
    uniform: Option<f64>,
    kl_coef: Option<&Bound<'py, PyAny>>,
    shape: Shape,
) -> PyResult<Option<Input<'py, F>>> {
    let (None, Some(k)) = (uniform, kl_coef) else {
        return Ok(None);
    };
    let b = Input::<F>::new(func, "kl_coef", k, 1)?;
    if b.shape()[0] != shape.rows {
        return Err(value_error(format!(
            "{func}: `kl_coef` has {} elements, expected {} (one per row)",
            b.shape()[0],
            shape.rows
        )));
    }
    Ok(Some(b))
}

fn kl_coefficient<'a, F: Real>(
    per_row: &'a Option<Input<'_, F>>,
    uniform: Option<f64>,
) -> KlCoefficient<'a, F> {
    match per_row {
        Some(b) => KlCoefficient::PerRow(b.slice()),
        None => KlCoefficient::Uniform(cast::<F>(uniform.unwrap_or(1.0))),
    }
}

/// The weight of each token's KL, `β_t·m_t` with `β_t = β_r·(hwe_t ? low_ratio : 1)` and β_r
/// = `kl_coef` (a float, or an array [B]): what `token_kl` multiplies `k_t` by
/// (`weighted = weights · kl`), for a loss that charges the KL elsewhere.
///
/// mask (and hwe_mask): [B, T], one float dtype; returns [B, T] of that dtype. Errors as
/// `token_kl`'s: masks of 0/1 only, β finite and ≥ 0, `low_ratio` in [0, 1].
#[pyfunction]
#[pyo3(signature = (mask, *, kl_coef=None, hwe_mask=None,
    low_ratio=ares_core::kl::DEFAULT_LOW_RATIO))]
fn dynamic_kl_weights<'py>(
    py: Python<'py>,
    mask: &Bound<'py, PyAny>,
    kl_coef: Option<&Bound<'py, PyAny>>,
    hwe_mask: Option<&Bound<'py, PyAny>>,
    low_ratio: f64,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "dynamic_kl_weights";
    let uniform_beta = uniform_kl_coef(FUNC, kl_coef)?;
    by_dtype!(float_dtype(FUNC, "mask", mask)?, F => {
        let (m, shape) = token_input::<F>(FUNC, "mask", mask, None)?;
        let hwe = match hwe_mask {
            Some(h) => Some(token_input::<F>(FUNC, "hwe_mask", h, Some(shape))?.0),
            None => None,
        };
        let per_row = per_row_kl_coef::<F>(FUNC, uniform_beta, kl_coef, shape)?;
        let out = Output::<F>::new(py, &[shape.rows, shape.cols]);
        {
            let mut w = out.write()?;
            let o = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let coefficient = kl_coefficient(&per_row, uniform_beta);
            let (ms, hs) = (m.slice(), hwe.as_ref().map(|h| h.slice()));
            py.detach(|| {
                ares_core::kl::dynamic_kl_weights(shape, coefficient, ms, hs, cast(low_ratio), o)
            })
            .map_err(|e| core_err(FUNC, e))?;
        }
        Ok(out.array.into_any())
    })
}

/// [`ares_core::kl::token_kl`] with the GIL released.
fn run_kl<F: Real>(
    py: Python<'_>,
    shape: Shape,
    logp: &[F],
    logp_ref: &[F],
    mask: &[F],
    cfg: &TokenKlConfig<'_, F>,
    outs: TokenKlOutputs<'_, F>,
) -> Result<ares_core::kl::TokenKlSummary<F>, Error> {
    py.detach(move || ares_core::kl::token_kl(shape, logp, logp_ref, mask, cfg, outs))
}
