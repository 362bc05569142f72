//! The CPU token kernels of `ares-cpu` over numpy arrays, in float32 (what they compute in),
//! rows in parallel (rayon) with the GIL released: fused log-prob + entropy from logits
//! (float32, float16, or bfloat16 given as uint16/int16 bits), entropy windows with HWE
//! masks, per-row percentiles, and the masked dynamic KL.

use crate::args::{Input, Output, f64_of, value_error};
use ares_core::kl::KlEstimator;
use ares_cpu::ops::linear_head::{self, HeadDims};
use ares_cpu::{HweOutputs, Logits, MaskedKlInputs, MaskedKlOutputs, WindowSpec};
use half::{bf16, f16};
use numpy::{
    PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Registers the functions of this file.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(log_prob_entropy, m)?)?;
    m.add_function(wrap_pyfunction!(log_prob_entropy_backward, m)?)?;
    m.add_function(wrap_pyfunction!(entropy_windows, m)?)?;
    m.add_function(wrap_pyfunction!(row_percentile, m)?)?;
    m.add_function(wrap_pyfunction!(masked_dynamic_kl, m)?)?;
    m.add_function(wrap_pyfunction!(linear_log_prob_entropy, m)?)?;
    m.add_function(wrap_pyfunction!(linear_log_prob_entropy_backward, m)?)?;
    Ok(())
}

fn cpu_err(func: &str, e: ares_cpu::Error) -> PyErr {
    value_error(format!("{func}: {e}"))
}

/// A float32 input of `ndim` dimensions (the kernels compute in float32; other dtypes are an
/// error, not a conversion).
fn f32_input<'py>(
    func: &str,
    name: &str,
    obj: &Bound<'py, PyAny>,
    ndim: usize,
) -> PyResult<Input<'py, f32>> {
    if let Ok(arr) = obj.cast::<PyUntypedArray>()
        && !arr.dtype().is_equiv_to(&numpy::dtype::<f32>(obj.py()))
    {
        return Err(value_error(format!(
            "{func}: `{name}` must have dtype float32 (the CPU kernels compute in float32), got {}",
            arr.dtype()
        )));
    }
    Input::new(func, name, obj, ndim)
}

/// A `[rows, cols]` float32 input whose shape must be `shape` when given.
fn f32_tokens<'py>(
    func: &str,
    name: &str,
    obj: &Bound<'py, PyAny>,
    shape: Option<(usize, usize)>,
) -> PyResult<(Input<'py, f32>, (usize, usize))> {
    let x = f32_input(func, name, obj, 2)?;
    let got = (x.shape()[0], x.shape()[1]);
    if let Some(want) = shape
        && want != got
    {
        return Err(value_error(format!(
            "{func}: `{name}` has shape {got:?}, expected {want:?}"
        )));
    }
    Ok((x, got))
}

/// The element type of a logits array.
enum LogitsKind {
    F32,
    F16,
    Bf16,
}

/// Fused log-prob + entropy over the last axis of `logits`, from one read of the logits:
/// with `z = logits / temperature`, `entropy = H(softmax(z)) = lse(z) − Σ softmax(z)·z` and,
/// with `targets`, `log_prob = z[target] − lse(z)` (an online max, one `exp` per element,
/// f64 accumulation per block of 1024).
///
/// logits: [..., V] C-contiguous, dtype float32, float16, or bfloat16 given as its bits in a
/// uint16 or int16 array (`torch_bf16_tensor.view(torch.int16).numpy()`; read in place).
/// targets: integer token ids of shape `logits.shape[:-1]` (any integer dtype; copied to
/// u32, one id per row). Returns `(log_prob, entropy)`, float32 of shape
/// `logits.shape[:-1]`; `log_prob` is `None` without targets. Errors (ValueError): a row with
/// NaN or +inf or only −inf, a target id ≥ V or whose logit is −inf, temperature not finite
/// and > 0.
#[pyfunction]
#[pyo3(signature = (logits, targets=None, *, temperature=1.0))]
fn log_prob_entropy<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    targets: Option<&Bound<'py, PyAny>>,
    temperature: f32,
) -> PyResult<(Option<Bound<'py, PyAny>>, Bound<'py, PyAny>)> {
    const FUNC: &str = "log_prob_entropy";
    let arr = logits.cast::<PyUntypedArray>().map_err(|_| {
        value_error(format!(
            "{FUNC}: `logits` must be a numpy array (float32, float16, or bfloat16 bits as \
             uint16/int16)"
        ))
    })?;
    let dt = arr.dtype();
    let kind = if dt.is_equiv_to(&numpy::dtype::<f32>(py)) {
        LogitsKind::F32
    } else if dt.kind() == b'f' && dt.itemsize() == 2 {
        LogitsKind::F16
    } else if matches!(dt.kind(), b'u' | b'i') && dt.itemsize() == 2 {
        LogitsKind::Bf16
    } else {
        return Err(value_error(format!(
            "{FUNC}: `logits` must have dtype float32, float16, or uint16/int16 holding bfloat16 \
             bits, got {dt}"
        )));
    };
    let shape: Vec<usize> = arr.shape().to_vec();
    let Some((&vocab, lead)) = shape.split_last() else {
        return Err(value_error(format!(
            "{FUNC}: `logits` must have at least 1 dimension (the vocabulary), got a scalar"
        )));
    };
    if !arr.is_c_contiguous() {
        return Err(value_error(format!(
            "{FUNC}: `logits` is not C-contiguous (inputs are read in place, not copied); pass \
             np.ascontiguousarray(logits)"
        )));
    }
    let rows: usize = lead.iter().product();
    let ids: Option<Vec<u32>> = match targets {
        None => None,
        Some(t) => Some(target_ids(FUNC, t, lead, vocab)?),
    };
    // 2-byte logits are read as uint16 through a view (no copy)
    let bits = match kind {
        LogitsKind::F32 => None,
        _ => Some(logits.call_method1("view", ("uint16",))?),
    };
    let f32_ro = match kind {
        LogitsKind::F32 => Some(
            logits
                .cast::<PyArrayDyn<f32>>()
                .map_err(|e| value_error(format!("{FUNC}: `logits`: {e}")))?
                .try_readonly()
                .map_err(|e| value_error(format!("{FUNC}: `logits`: {e}")))?,
        ),
        _ => None,
    };
    let u16_ro = match &bits {
        Some(b) => Some(
            b.cast::<PyArrayDyn<u16>>()
                .map_err(|e| value_error(format!("{FUNC}: `logits`: {e}")))?
                .try_readonly()
                .map_err(|e| value_error(format!("{FUNC}: `logits`: {e}")))?,
        ),
        None => None,
    };
    let out_h = Output::<f32>::new(py, lead);
    let out_lp = ids.as_ref().map(|_| Output::<f32>::new(py, lead));
    {
        let mut wh = out_h.write()?;
        let h = wh.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let mut wlp = out_lp.as_ref().map(|o| o.write()).transpose()?;
        let lp = match wlp.as_mut() {
            Some(w) => Some(w.as_slice_mut().map_err(|e| value_error(e.to_string()))?),
            None => None,
        };
        let view: Logits<'_> = match (&kind, &f32_ro, &u16_ro) {
            (LogitsKind::F32, Some(x), _) => Logits::F32(x.as_slice().unwrap_or(&[])),
            (LogitsKind::Bf16, _, Some(x)) => {
                Logits::Bf16(reinterpret::<bf16>(x.as_slice().unwrap_or(&[])))
            }
            (LogitsKind::F16, _, Some(x)) => {
                Logits::F16(reinterpret::<f16>(x.as_slice().unwrap_or(&[])))
            }
            _ => return Err(value_error(format!("{FUNC}: `logits`: unreadable"))),
        };
        debug_assert_eq!(view.len(), rows * vocab);
        let targets = ids.as_deref().zip(lp);
        py.detach(move || ares_cpu::log_prob_entropy(view, vocab, temperature, targets, h))
            .map_err(|e| cpu_err(FUNC, e))?;
    }
    Ok((out_lp.map(|o| o.array.into_any()), out_h.array.into_any()))
}

/// Backward of [`log_prob_entropy`] on float32 logits: `∂L/∂logits` from `grad_log_prob`
/// (∂L/∂log_prob per row, with `targets`) and `grad_entropy` (∂L/∂entropy per row), either
/// may be `None`: with `z = logits / T` and `p = softmax(z)`,
/// `dlogits = g_lp/T·(onehot(target) − p) − g_H·p·(ln p + H)/T` (a −∞ logit gets 0; rows
/// whose coefficients are 0 are 0 and not read).
///
/// logits: float32 [..., V] C-contiguous; targets: integer ids [...]; grad_log_prob,
/// grad_entropy: float32 [...]. Returns dlogits, float32 [..., V]. Errors (ValueError): shapes,
/// a non-finite coefficient, a row with NaN or +inf or only −inf where its coefficient is
/// not 0, a target id out of range or with logit −inf, `grad_log_prob` without `targets`.
#[pyfunction]
#[pyo3(signature = (logits, targets=None, grad_log_prob=None, grad_entropy=None, *, temperature=1.0))]
fn log_prob_entropy_backward<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    targets: Option<&Bound<'py, PyAny>>,
    grad_log_prob: Option<&Bound<'py, PyAny>>,
    grad_entropy: Option<&Bound<'py, PyAny>>,
    temperature: f32,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "log_prob_entropy_backward";
    let x = logits.cast::<PyArrayDyn<f32>>().map_err(|_| {
        value_error(format!(
            "{FUNC}: `logits` must be a float32 numpy array (C-contiguous)"
        ))
    })?;
    let shape: Vec<usize> = x.shape().to_vec();
    let Some((&vocab, lead)) = shape.split_last() else {
        return Err(value_error(format!(
            "{FUNC}: `logits` must have at least 1 dimension (the vocabulary), got a scalar"
        )));
    };
    if !x.is_c_contiguous() {
        return Err(value_error(format!(
            "{FUNC}: `logits` is not C-contiguous; pass np.ascontiguousarray(logits)"
        )));
    }
    let coeffs = |name: &str, g: Option<&Bound<'py, PyAny>>| -> PyResult<Option<Vec<f32>>> {
        let Some(g) = g else { return Ok(None) };
        let a = g
            .cast::<PyArrayDyn<f32>>()
            .map_err(|_| value_error(format!("{FUNC}: `{name}` must be a float32 numpy array")))?;
        if a.shape() != lead {
            return Err(value_error(format!(
                "{FUNC}: `{name}` has shape {:?}, expected {lead:?} (logits.shape[:-1])",
                a.shape()
            )));
        }
        Ok(Some(a.readonly().as_array().iter().copied().collect()))
    };
    let g_lp = coeffs("grad_log_prob", grad_log_prob)?;
    let g_h = coeffs("grad_entropy", grad_entropy)?;
    let ids = match (targets, &g_lp) {
        (Some(t), _) => Some(target_ids(FUNC, t, lead, vocab)?),
        (None, Some(_)) => {
            return Err(value_error(format!(
                "{FUNC}: `grad_log_prob` needs the `targets` the log-probs were taken at"
            )));
        }
        (None, None) => None,
    };
    let ro = x
        .try_readonly()
        .map_err(|e| value_error(format!("{FUNC}: `logits`: {e}")))?;
    let out = Output::<f32>::new(py, &shape);
    {
        let mut w = out.write()?;
        let d = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let x = ro.as_slice().map_err(|e| value_error(e.to_string()))?;
        py.detach(|| -> ares_cpu::Result<()> {
            if let (Some(ids), Some(c)) = (&ids, &g_lp) {
                // overwrites every row (0 where the coefficient is 0)
                ares_cpu::ops::log_prob_backward::log_prob_backward(
                    x,
                    vocab,
                    temperature,
                    ids,
                    c,
                    d,
                )?;
            }
            if let Some(c) = &g_h {
                // adds onto the zeros of a new output, or onto the log-prob part
                ares_cpu::ops::entropy_backward::entropy_backward(x, vocab, temperature, c, d)?;
            }
            Ok(())
        })
        .map_err(|e| cpu_err(FUNC, e))?;
    }
    Ok(out.array.into_any())
}

/// `u16` bits as a half-float type of the same layout.
fn reinterpret<T: HalfBits>(bits: &[u16]) -> &[T] {
    T::cast(bits)
}

trait HalfBits: Sized {
    fn cast(bits: &[u16]) -> &[Self];
}

impl HalfBits for bf16 {
    fn cast(bits: &[u16]) -> &[bf16] {
        use half::slice::HalfBitsSliceExt;
        bits.reinterpret_cast()
    }
}

impl HalfBits for f16 {
    fn cast(bits: &[u16]) -> &[f16] {
        use half::slice::HalfBitsSliceExt;
        bits.reinterpret_cast()
    }
}

/// Token ids of shape `lead` (any integer dtype, or a sequence) as u32, each < `vocab`.
fn target_ids(
    func: &str,
    t: &Bound<'_, PyAny>,
    lead: &[usize],
    vocab: usize,
) -> PyResult<Vec<u32>> {
    let arr = t
        .cast::<PyUntypedArray>()
        .map_err(|_| value_error(format!("{func}: `targets` must be a numpy integer array")))?;
    if !matches!(arr.dtype().kind(), b'i' | b'u') {
        return Err(value_error(format!(
            "{func}: `targets` must have an integer dtype, got {}",
            arr.dtype()
        )));
    }
    if arr.shape() != lead {
        return Err(value_error(format!(
            "{func}: `targets` has shape {:?}, expected {lead:?} (logits.shape[:-1])",
            arr.shape()
        )));
    }
    let as_i64 = t.call_method1("astype", ("int64",))?;
    let typed = as_i64
        .cast::<PyArrayDyn<i64>>()
        .map_err(|e| value_error(format!("{func}: `targets`: {e}")))?;
    let ro = typed.readonly();
    ro.as_array()
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            u32::try_from(id)
                .ok()
                .filter(|&v| (v as usize) < vocab)
                .ok_or_else(|| {
                    value_error(format!(
                        "{func}: `targets` element {i} = {id} is out of range for vocabulary \
                         size {vocab}"
                    ))
                })
        })
        .collect()
}

/// Window means of token entropies and, with `tau`, the HWE tokens (docs/algorithms.md §1).
///
/// With `w = window_size` and offset `o = 1` (default, the following w tokens) or 0
/// (`includes_self`), position t has a complete window iff `t + o + w − 1 < cols` and the
/// mask is 1 at t and over the window; then `means[t] = mean(H[t+o .. t+o+w−1])` and
/// `valid[t] = 1`, else both 0. With `tau`: `hwe_mask[t] = 1` iff a complete window (and
/// `trigger[t] = 1` when given) has `W_t ≥ τ`; per row `counts` (HWE tokens) and `soft_cost`
/// (Σ_HWE (W_t − τ)).
///
/// entropy, mask (0/1), trigger: float32 [rows, cols]. Returns a dict of float32 arrays:
/// `means`, `valid` [rows, cols]; with `tau` also `hwe_mask` [rows, cols], `counts`,
/// `soft_cost` [rows]. Spec vector 5: w = 4, H = (0.2, 1.0, 1.2, 0.8, 0.4, 0.1, 0, 0), all
/// valid: means (0.85, 0.625, 0.325, 0.125, 0, 0, 0, 0).
#[pyfunction]
#[pyo3(signature = (entropy, mask, *, window_size=4, includes_self=false, tau=None, trigger=None))]
fn entropy_windows<'py>(
    py: Python<'py>,
    entropy: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    window_size: usize,
    includes_self: bool,
    tau: Option<f32>,
    trigger: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    const FUNC: &str = "entropy_windows";
    let (h, shape) = f32_tokens(FUNC, "entropy", entropy, None)?;
    let (m, _) = f32_tokens(FUNC, "mask", mask, Some(shape))?;
    let trig = trigger
        .map(|t| f32_tokens(FUNC, "trigger", t, Some(shape)).map(|x| x.0))
        .transpose()?;
    let (rows, cols) = shape;
    if cols == 0 {
        return Err(value_error(format!(
            "{FUNC}: `entropy` has 0 columns (the kernels need cols >= 1)"
        )));
    }
    let means = Output::<f32>::new(py, &[rows, cols]);
    let valid = Output::<f32>::new(py, &[rows, cols]);
    let hwe = tau.map(|_| {
        (
            Output::<f32>::new(py, &[rows, cols]),
            Output::<f32>::new(py, &[rows]),
            Output::<f32>::new(py, &[rows]),
        )
    });
    {
        let mut wm = means.write()?;
        let mut wv = valid.write()?;
        let om = wm.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let ov = wv.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let mut hw = match &hwe {
            Some((a, b, c)) => Some((a.write()?, b.write()?, c.write()?)),
            None => None,
        };
        let hwe_out = match (&mut hw, tau) {
            (Some((a, b, c)), Some(tau)) => Some(HweOutputs {
                tau,
                trigger: trig.as_ref().map(|t| t.slice()),
                hwe_mask: a.as_slice_mut().map_err(|e| value_error(e.to_string()))?,
                counts: b.as_slice_mut().map_err(|e| value_error(e.to_string()))?,
                soft_cost: c.as_slice_mut().map_err(|e| value_error(e.to_string()))?,
            }),
            _ => None,
        };
        let spec = WindowSpec {
            cols,
            window_size,
            includes_self,
        };
        let (hs, ms) = (h.slice(), m.slice());
        py.detach(move || ares_cpu::entropy_windows(hs, ms, spec, hwe_out, om, ov))
            .map_err(|e| cpu_err(FUNC, e))?;
    }
    let d = PyDict::new(py);
    d.set_item("means", means.array)?;
    d.set_item("valid", valid.array)?;
    if let Some((a, b, c)) = hwe {
        d.set_item("hwe_mask", a.array)?;
        d.set_item("counts", b.array)?;
        d.set_item("soft_cost", c.array)?;
    }
    Ok(d)
}

/// Per-row `q`-th percentile (numpy's linear interpolation) of the window means whose
/// `valid` is 1 (the per-response HWE threshold candidates of docs/algorithms.md §1); a row
/// without a complete window gets threshold 0 and `has` 0.
///
/// means, valid: float32 [rows, cols] (`entropy_windows`' outputs). Returns
/// `(threshold, has)`, float32 [rows]. Spec vector 6: means (1.25, 0.75, 0.8), q = 95 →
/// 1.205.
#[pyfunction]
#[pyo3(signature = (means, valid, q=95.0))]
fn row_percentile<'py>(
    py: Python<'py>,
    means: &Bound<'py, PyAny>,
    valid: &Bound<'py, PyAny>,
    q: f32,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    const FUNC: &str = "row_percentile";
    let (m, shape) = f32_tokens(FUNC, "means", means, None)?;
    let (v, _) = f32_tokens(FUNC, "valid", valid, Some(shape))?;
    let (rows, cols) = shape;
    if cols == 0 {
        return Err(value_error(format!("{FUNC}: `means` has 0 columns")));
    }
    let thr = Output::<f32>::new(py, &[rows]);
    let has = Output::<f32>::new(py, &[rows]);
    {
        let mut wt = thr.write()?;
        let mut wh = has.write()?;
        let ot = wt.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let oh = wh.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let (ms, vs) = (m.slice(), v.slice());
        py.detach(move || ares_cpu::row_percentile(ms, vs, cols, q, ot, oh))
            .map_err(|e| cpu_err(FUNC, e))?;
    }
    Ok((thr.array.into_any(), has.array.into_any()))
}

/// The masked dynamic KL (docs/algorithms.md §4): per token `k_t` by `estimator` (as
/// `token_kl`: "k1"/"kl", "abs", "k2"/"mse", "k3"/"low_var_kl", "k1+", "k3+"), weight
/// `β_t = β_row·(hwe_t ? low_ratio : 1)·mask_t`; per row `Σ_t β_t·k_t` and the mean `k_t`
/// over valid tokens.
///
/// logp, logp_ref, mask (0/1), hwe_mask (0/1): float32 [rows, cols]; beta: a float (every
/// row) or float32 [rows] (e.g. each sample's bucket λ_d). Returns a dict: `kl`,
/// `weighted` (float32 [rows, cols], 0 on padding), `row_weighted_sum`, `row_mean_kl`
/// (float32 [rows]), `total` (float, Σ of the row sums).
#[pyfunction]
#[pyo3(signature = (logp, logp_ref, mask, beta, *, hwe_mask=None, low_ratio=0.5,
    estimator="k3"))]
#[allow(clippy::too_many_arguments)]
fn masked_dynamic_kl<'py>(
    py: Python<'py>,
    logp: &Bound<'py, PyAny>,
    logp_ref: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    beta: &Bound<'py, PyAny>,
    hwe_mask: Option<&Bound<'py, PyAny>>,
    low_ratio: f32,
    estimator: &str,
) -> PyResult<Bound<'py, PyDict>> {
    const FUNC: &str = "masked_dynamic_kl";
    let est = KlEstimator::from_name(estimator).ok_or_else(|| {
        value_error(format!(
            "{FUNC}: `estimator` = {estimator:?} is not one of \"k1\", \"kl\", \"abs\", \"k2\", \
             \"mse\", \"k3\", \"low_var_kl\", \"k1+\", \"k3+\""
        ))
    })?;
    let (lp, shape) = f32_tokens(FUNC, "logp", logp, None)?;
    let (rl, _) = f32_tokens(FUNC, "logp_ref", logp_ref, Some(shape))?;
    let (m, _) = f32_tokens(FUNC, "mask", mask, Some(shape))?;
    let hw = hwe_mask
        .map(|h| f32_tokens(FUNC, "hwe_mask", h, Some(shape)).map(|x| x.0))
        .transpose()?;
    let (rows, cols) = shape;
    if cols == 0 {
        return Err(value_error(format!("{FUNC}: `logp` has 0 columns")));
    }
    let beta_in;
    let beta_vec;
    let beta_rows: &[f32] = if beta.cast::<PyUntypedArray>().is_ok() {
        beta_in = f32_input(FUNC, "beta", beta, 1)?;
        if beta_in.shape()[0] != rows {
            return Err(value_error(format!(
                "{FUNC}: `beta` has {} elements, expected {rows} (one per row)",
                beta_in.shape()[0]
            )));
        }
        beta_in.slice()
    } else {
        let b: f64 = beta.extract().map_err(|_| {
            value_error(format!(
                "{FUNC}: `beta` must be a float or a float32 array [rows]"
            ))
        })?;
        beta_vec = vec![b as f32; rows];
        &beta_vec
    };
    let kl = Output::<f32>::new(py, &[rows, cols]);
    let weighted = Output::<f32>::new(py, &[rows, cols]);
    let rsum = Output::<f32>::new(py, &[rows]);
    let rmean = Output::<f32>::new(py, &[rows]);
    let total = {
        let (mut a, mut b, mut c, mut d) = (
            kl.write()?,
            weighted.write()?,
            rsum.write()?,
            rmean.write()?,
        );
        let outputs = MaskedKlOutputs {
            kl: Some(a.as_slice_mut().map_err(|e| value_error(e.to_string()))?),
            weighted: Some(b.as_slice_mut().map_err(|e| value_error(e.to_string()))?),
            row_weighted_sum: c.as_slice_mut().map_err(|e| value_error(e.to_string()))?,
            row_mean_kl: d.as_slice_mut().map_err(|e| value_error(e.to_string()))?,
        };
        let inputs = MaskedKlInputs {
            logp: lp.slice(),
            ref_logp: rl.slice(),
            mask: m.slice(),
            hwe_mask: hw.as_ref().map(|h| h.slice()),
            beta_rows,
            low_ratio,
            estimator: est,
            cols,
        };
        py.detach(move || ares_cpu::masked_dynamic_kl(inputs, outputs))
            .map_err(|e| cpu_err(FUNC, e))?
    };
    let d = PyDict::new(py);
    d.set_item("kl", kl.array)?;
    d.set_item("weighted", weighted.array)?;
    d.set_item("row_weighted_sum", rsum.array)?;
    d.set_item("row_mean_kl", rmean.array)?;
    d.set_item("total", f64_of(total))?;
    Ok(d)
}

/// Scratch per chunk of the fused head when `chunk_rows` is not given: one `[chunk, V]`
/// float32 buffer of about this many bytes.
const HEAD_CHUNK_BYTES: usize = 32 << 20;

/// The hidden states `[N, H]` and head `[V, H]` of a fused head call, checked.
fn head_inputs<'py>(
    func: &str,
    hidden: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    chunk_rows: Option<usize>,
) -> PyResult<(Input<'py, f32>, Input<'py, f32>, HeadDims, usize)> {
    let x = f32_input(func, "hidden", hidden, 2)?;
    let w = f32_input(func, "weight", weight, 2)?;
    let (rows, h) = (x.shape()[0], x.shape()[1]);
    let (vocab, hw) = (w.shape()[0], w.shape()[1]);
    if hw != h {
        return Err(value_error(format!(
            "{func}: `weight` has shape [{vocab}, {hw}], expected [V, {h}] (hidden has {h} features)"
        )));
    }
    if chunk_rows == Some(0) {
        return Err(value_error(format!(
            "{func}: `chunk_rows` must be >= 1, got 0"
        )));
    }
    let chunk = chunk_rows.unwrap_or_else(|| linear_head::chunk_rows_for(vocab, HEAD_CHUNK_BYTES));
    Ok((
        x,
        w,
        HeadDims {
            rows,
            hidden: h,
            vocab,
        },
        chunk,
    ))
}

/// The LM head fused with the per-token log-prob and entropy (the Liger / Cut-Cross-Entropy
/// idea for RL): for hidden states `hidden` [N, H] and the head `weight` [V, H] (Hugging Face
/// layout), `z = hidden·weightᵀ / temperature`; returns `(log_prob, entropy)` [N] float32,
/// `log_prob[r] = log softmax(z_r)[targets[r]]` (`None` without targets) and `entropy[r] =
/// H(softmax(z_r))`, computed `chunk_rows` rows at a time (default: ~32 MiB of logits per
/// chunk), so the [N, V] logits are never held. float32 inputs, read in place.
#[pyfunction]
#[pyo3(signature = (hidden, weight, targets=None, *, temperature=1.0, chunk_rows=None))]
fn linear_log_prob_entropy<'py>(
    py: Python<'py>,
    hidden: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    targets: Option<&Bound<'py, PyAny>>,
    temperature: f32,
    chunk_rows: Option<usize>,
) -> PyResult<(Option<Bound<'py, PyAny>>, Bound<'py, PyAny>)> {
    const FUNC: &str = "linear_log_prob_entropy";
    let (x, w, dims, chunk) = head_inputs(FUNC, hidden, weight, chunk_rows)?;
    let ids = targets
        .map(|t| target_ids(FUNC, t, &[dims.rows], dims.vocab))
        .transpose()?;
    let out_h = Output::<f32>::new(py, &[dims.rows]);
    let out_lp = ids.as_ref().map(|_| Output::<f32>::new(py, &[dims.rows]));
    {
        let mut wh = out_h.write()?;
        let ent = wh.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let mut wlp = out_lp.as_ref().map(|o| o.write()).transpose()?;
        let lp = match wlp.as_mut() {
            Some(w) => Some(w.as_slice_mut().map_err(|e| value_error(e.to_string()))?),
            None => None,
        };
        let (xs, ws) = (x.slice(), w.slice());
        let t = ids.as_deref().zip(lp);
        py.detach(move || {
            linear_head::linear_log_prob_entropy(xs, ws, dims, temperature, t, ent, chunk)
        })
        .map_err(|e| cpu_err(FUNC, e))?;
    }
    Ok((out_lp.map(|o| o.array.into_any()), out_h.array.into_any()))
}

/// Backward of [`linear_log_prob_entropy`]: from `grad_log_prob` (∂L/∂logπ [N], with
/// `targets`) and/or `grad_entropy` (∂L/∂H [N]) returns `(grad_hidden [N, H], grad_weight
/// [V, H])`, float32, recomputing each chunk's logits (nothing [N, V] is kept between the
/// passes): `∂L/∂z = g/T·(onehot − p) − h·p∘(ln p + H)/T`, `grad_hidden = ∂L/∂z·weight`,
/// `grad_weight = ∂L/∂zᵀ·hidden`. Rows whose coefficients are 0 contribute nothing.
#[pyfunction]
#[pyo3(signature = (hidden, weight, targets=None, grad_log_prob=None, grad_entropy=None, *,
    temperature=1.0, chunk_rows=None))]
#[allow(clippy::too_many_arguments)]
fn linear_log_prob_entropy_backward<'py>(
    py: Python<'py>,
    hidden: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    targets: Option<&Bound<'py, PyAny>>,
    grad_log_prob: Option<&Bound<'py, PyAny>>,
    grad_entropy: Option<&Bound<'py, PyAny>>,
    temperature: f32,
    chunk_rows: Option<usize>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    const FUNC: &str = "linear_log_prob_entropy_backward";
    let (x, w, dims, chunk) = head_inputs(FUNC, hidden, weight, chunk_rows)?;
    let per_row = |name: &str, obj: &Bound<'py, PyAny>| -> PyResult<Input<'py, f32>> {
        let g = f32_input(FUNC, name, obj, 1)?;
        if g.shape()[0] != dims.rows {
            return Err(value_error(format!(
                "{FUNC}: `{name}` has {} elements, expected {} (one per row of hidden)",
                g.shape()[0],
                dims.rows
            )));
        }
        Ok(g)
    };
    let lp = match (targets, grad_log_prob) {
        (Some(t), Some(g)) => Some((
            target_ids(FUNC, t, &[dims.rows], dims.vocab)?,
            per_row("grad_log_prob", g)?,
        )),
        (None, None) => None,
        _ => {
            return Err(value_error(format!(
                "{FUNC}: `targets` and `grad_log_prob` go together (the log-prob's gradient needs its targets)"
            )));
        }
    };
    let gh = grad_entropy
        .map(|g| per_row("grad_entropy", g))
        .transpose()?;
    if lp.is_none() && gh.is_none() {
        return Err(value_error(format!(
            "{FUNC}: give `grad_log_prob` (with `targets`) or `grad_entropy`, or both"
        )));
    }
    let gx = Output::<f32>::new(py, &[dims.rows, dims.hidden]);
    let gw = Output::<f32>::new(py, &[dims.vocab, dims.hidden]);
    {
        let (mut wx, mut ww) = (gx.write()?, gw.write()?);
        let gxs = wx.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let gws = ww.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        gws.fill(0.0);
        let (xs, ws) = (x.slice(), w.slice());
        let log_prob = lp.as_ref().map(|(ids, g)| (ids.as_slice(), g.slice()));
        let ent = gh.as_ref().map(|g| g.slice());
        py.detach(move || {
            linear_head::linear_log_prob_entropy_backward(
                xs,
                ws,
                dims,
                temperature,
                log_prob,
                ent,
                gxs,
                gws,
                chunk,
            )
        })
        .map_err(|e| cpu_err(FUNC, e))?;
    }
    Ok((gx.array.into_any(), gw.array.into_any()))
}
