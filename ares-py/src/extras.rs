//! The other ares-core families: forking-token masks, DAPO's overlong penalty, the entropy
//! bonus gradient and the ARES entropy-shaping reward.

use crate::args::by_dtype;
use crate::args::{
    BoolInput, Dtype, Input, Output, cast, core_err, f64_of, float_dtype, value_error,
};
use crate::controllers::bucket_of;
use ares_core::difficulty::Difficulty;
use ares_core::shaping::{self, ShapingConfig};
use ares_core::{entropy_bonus, forking, overlong};
use numpy::{
    PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Registers every function of this file in the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("DEFAULT_FORKING_RHO", forking::DEFAULT_FORKING_RHO)?;
    m.add_function(wrap_pyfunction!(forking_token_mask, m)?)?;
    m.add_function(wrap_pyfunction!(overlong_penalty, m)?)?;
    m.add_function(wrap_pyfunction!(overlong_penalties, m)?)?;
    m.add_function(wrap_pyfunction!(entropy_grad_logits, m)?)?;
    m.add_function(wrap_pyfunction!(entropy_rewards, m)?)?;
    Ok(())
}

/// The number of dimensions of a numpy array (1 when `obj` is not one: `Input` then reports).
fn ndim_of(obj: &Bound<'_, PyAny>) -> usize {
    obj.cast::<PyUntypedArray>().map(|a| a.ndim()).unwrap_or(1)
}

// ---------------------------------------------------------------------------------------------
// Forking tokens.

/// The forking-token mask (Wang et al. 2025, "Beyond the 80/20 rule"): `keep = 1` on exactly
/// the top `k = min(N, max(1, ⌈ρ·N⌉))` valid tokens by entropy (N = number of tokens with
/// `mask = 1`), 0 elsewhere. Ties at the threshold τ (the k-th largest valid entropy) are
/// kept in index order (row-major), so exactly k are kept and a larger ρ keeps a superset.
///
/// entropies, mask: float32/float64 of one shape (1-D or [B, T]; mask 0/1; entropies are read
/// only where mask is 1). Returns `(keep, stats)`: keep has the shape and dtype of
/// `entropies`; stats is `{"kept": k, "valid": N, "fraction": k/N, "threshold": τ or None}`.
/// Example: entropies (0.9, 0.1, 0.5, 0.5, pad, 0.5, 2.0, 0.0, 0.3, 0.7): ρ = 0.2 keeps
/// {0, 6}, τ = 0.9; ρ = 0.5 keeps {0, 2, 3, 6, 9}, τ = 0.5.
#[pyfunction]
#[pyo3(signature = (entropies, mask, rho=forking::DEFAULT_FORKING_RHO))]
fn forking_token_mask<'py>(
    py: Python<'py>,
    entropies: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    rho: f64,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyDict>)> {
    const FUNC: &str = "forking_token_mask";
    by_dtype!(float_dtype(FUNC, "entropies", entropies)?, F => {
        let ndim = ndim_of(entropies);
        let h = Input::<F>::new(FUNC, "entropies", entropies, ndim)?;
        let m = Input::<F>::new(FUNC, "mask", mask, ndim)?;
        if h.shape() != m.shape() {
            return Err(value_error(format!(
                "{FUNC}: `mask` has shape {:?}, expected {:?} (the shape of `entropies`)",
                m.shape(),
                h.shape()
            )));
        }
        let out = Output::<F>::new(py, h.shape());
        let stats = {
            let mut w = out.write()?;
            let o = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let (hs, ms, rho) = (h.slice(), m.slice(), cast::<F>(rho));
            py.detach(move || {
                let mut scratch = vec![F::default(); hs.len()];
                forking::forking_token_mask(hs, ms, rho, &mut scratch, o)
            })
            .map_err(|e| core_err(FUNC, e))?
        };
        let d = PyDict::new(py);
        d.set_item("kept", stats.kept)?;
        d.set_item("valid", stats.valid)?;
        d.set_item("fraction", f64_of(stats.fraction))?;
        d.set_item("threshold", stats.threshold.map(f64_of))?;
        Ok((out.array.into_any(), d))
    })
}

// ---------------------------------------------------------------------------------------------
// Overlong penalty.

/// Non-negative integer lengths from a 1-D integer numpy array or a sequence of ints.
fn lengths_of(func: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let raw: Vec<i64> = if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(value_error(format!(
                "{func}: `lengths` must have 1 dimension, got shape {:?}",
                arr.shape()
            )));
        }
        if !matches!(arr.dtype().kind(), b'i' | b'u') {
            return Err(value_error(format!(
                "{func}: `lengths` must be an integer array, got dtype {}",
                arr.dtype()
            )));
        }
        let as_i64 = obj.call_method1("astype", ("int64",))?;
        let typed = as_i64
            .cast::<PyArrayDyn<i64>>()
            .map_err(|e| value_error(format!("{func}: `lengths`: {e}")))?;
        let ro = typed.readonly();
        ro.as_array().iter().copied().collect()
    } else {
        obj.extract::<Vec<i64>>().map_err(|_| {
            value_error(format!(
                "{func}: `lengths` must be a 1-D integer array or a sequence of ints"
            ))
        })?
    };
    raw.iter()
        .enumerate()
        .map(|(i, &l)| {
            usize::try_from(l)
                .map_err(|_| value_error(format!("{func}: `lengths`[{i}] = {l} is negative")))
        })
        .collect()
}

/// A non-negative integer argument.
fn count_arg(func: &str, name: &str, x: i64) -> PyResult<usize> {
    usize::try_from(x).map_err(|_| value_error(format!("{func}: `{name}` = {x} is negative")))
}

/// DAPO's soft overlong penalty of one response of `length` tokens, with `L_max = max_len`,
/// `L_cache = buffer_len`, `f = penalty_factor`: 0 when `L ≤ L_max − L_cache`;
/// `−(L − (L_max − L_cache))/L_cache · f` up to `L_max`; `−f` beyond. Returns a float.
/// Example (L_max 10, L_cache 4): L = 6, 7, 8, 9, 10, 11 → 0, −0.25, −0.5, −0.75, −1, −1.
#[pyfunction]
#[pyo3(signature = (length, max_len, buffer_len, penalty_factor=1.0))]
fn overlong_penalty(
    length: i64,
    max_len: i64,
    buffer_len: i64,
    penalty_factor: f64,
) -> PyResult<f64> {
    const FUNC: &str = "overlong_penalty";
    let length = count_arg(FUNC, "length", length)?;
    let max_len = count_arg(FUNC, "max_len", max_len)?;
    let buffer_len = count_arg(FUNC, "buffer_len", buffer_len)?;
    overlong::overlong_penalty(length, max_len, buffer_len, penalty_factor)
        .map_err(|e| core_err(FUNC, e))
}

/// `overlong_penalty` for a batch: lengths is a 1-D integer array (or sequence of ints);
/// `correct` (bool [B] or None) limits the penalty to correct answers (a wrong one gets 0).
/// Returns `(penalties, n_penalised)`: penalties float64 [B] (float32 with
/// `dtype=np.float32`), n_penalised the number of samples with a penalty < 0.
#[pyfunction]
#[pyo3(signature = (lengths, max_len, buffer_len, penalty_factor=1.0, correct=None, *, dtype=None))]
fn overlong_penalties<'py>(
    py: Python<'py>,
    lengths: &Bound<'py, PyAny>,
    max_len: i64,
    buffer_len: i64,
    penalty_factor: f64,
    correct: Option<&Bound<'py, PyAny>>,
    dtype: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, usize)> {
    const FUNC: &str = "overlong_penalties";
    let ls = lengths_of(FUNC, lengths)?;
    let max_len = count_arg(FUNC, "max_len", max_len)?;
    let buffer_len = count_arg(FUNC, "buffer_len", buffer_len)?;
    let correct = correct
        .map(|c| BoolInput::new(FUNC, "correct", c))
        .transpose()?;
    let dt = match dtype {
        None => Dtype::F64,
        Some(d) => {
            let d = numpy::PyArrayDescr::new(py, d)
                .map_err(|e| value_error(format!("{FUNC}: `dtype`: {e}")))?;
            if d.is_equiv_to(&numpy::dtype::<f32>(py)) {
                Dtype::F32
            } else if d.is_equiv_to(&numpy::dtype::<f64>(py)) {
                Dtype::F64
            } else {
                return Err(value_error(format!(
                    "{FUNC}: `dtype` must be float32 or float64, got {d}"
                )));
            }
        }
    };
    by_dtype!(dt, F => {
        let out = Output::<F>::new(py, &[ls.len()]);
        let n = {
            let mut w = out.write()?;
            let o = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let cs = correct.as_ref().map(|c| c.slice());
            let f = cast::<F>(penalty_factor);
            py.detach(move || overlong::overlong_penalties(&ls, max_len, buffer_len, f, cs, o))
                .map_err(|e| core_err(FUNC, e))?
        };
        Ok((out.array.into_any(), n))
    })
}

// ---------------------------------------------------------------------------------------------
// Entropy bonus.

/// The entropy of softmax(logits/T) and its gradient with respect to the logits:
/// `H = −Σ p_v ln p_v`, `∂H/∂x_v = −p_v(ln p_v + H)/T` (sums to 0; a −∞ logit gets 0).
///
/// logits: float32/float64 [V] (one position) or [N, V] (one row per position). Returns
/// `(H, grad)`: H a float for 1-D logits, else an array [N]; grad the shape of logits.
/// Example: logits (0, ln 2), T = 1: H = 0.6365142, grad = (0.1540327, −0.1540327).
#[pyfunction]
#[pyo3(signature = (logits, temperature=1.0))]
fn entropy_grad_logits<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    temperature: f64,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    const FUNC: &str = "entropy_grad_logits";
    by_dtype!(float_dtype(FUNC, "logits", logits)?, F => {
        let ndim = ndim_of(logits);
        if ndim != 1 && ndim != 2 {
            return Err(value_error(format!(
                "{FUNC}: `logits` must have 1 or 2 dimensions, got {ndim}"
            )));
        }
        let x = Input::<F>::new(FUNC, "logits", logits, ndim)?;
        let shape = x.shape().to_vec();
        let (rows, vocab) = if ndim == 1 { (1, shape[0]) } else { (shape[0], shape[1]) };
        let grad = Output::<F>::new(py, &shape);
        let hs = Output::<F>::new(py, &[rows]);
        {
            let mut gw = grad.write()?;
            let g = gw.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let mut hw = hs.write()?;
            let h = hw.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let (xs, t) = (x.slice(), cast::<F>(temperature));
            let res = py.detach(move || {
                if vocab == 0 {
                    // let core report the empty row
                    return entropy_bonus::entropy_grad_logits(&[], t, &mut []).map(|_| ()).map_err(|e| (0, e));
                }
                for (r, ((xr, gr), hr)) in
                    xs.chunks(vocab).zip(g.chunks_mut(vocab)).zip(h.iter_mut()).enumerate()
                {
                    *hr = entropy_bonus::entropy_grad_logits(xr, t, gr).map_err(|e| (r, e))?;
                }
                Ok(())
            });
            if let Err((r, e)) = res {
                return Err(if ndim == 1 {
                    core_err(FUNC, e)
                } else {
                    value_error(format!("{FUNC}: row {r}: {e}"))
                });
            }
        }
        if ndim == 1 {
            let h0 = hs.array.readonly().as_slice().map(|s| s[0]).unwrap_or(F::NAN);
            let h = f64_of(h0).into_pyobject(py)?.into_any();
            Ok((h, grad.array.into_any()))
        } else {
            Ok((hs.array.into_any(), grad.array.into_any()))
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Entropy shaping.

/// One bucket per row: a 1-D integer array (0 easy, 1 medium, 2 hard) or a sequence of
/// names / indices.
fn buckets_of(func: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<Difficulty>> {
    let iter = obj.try_iter().map_err(|_| {
        value_error(format!(
            "{func}: `difficulty` must be a 1-D array or sequence of bucket names / indices"
        ))
    })?;
    let mut out = Vec::new();
    for item in iter {
        let item = item?;
        // numpy integer scalars: through int()
        let item =
            if item.extract::<String>().is_err() && !item.is_instance_of::<pyo3::types::PyBool>() {
                match item.call_method0("__index__") {
                    Ok(i) => i,
                    Err(_) => item,
                }
            } else {
                item
            };
        out.push(bucket_of(func, "difficulty", &item)?);
    }
    Ok(out)
}

/// The ARES difficulty-aware entropy reward (docs/algorithms.md §3), per response, with the
/// default bucket constants (easy f 0.15 κ 2 t 2 c 1 w 0.6; medium 0.25 3 2.5 1 0.8;
/// hard 0.35 4 3 1.2 1): with `m = max(1, f·max(T, 1))`, `Δ = g − T`, `cap = α·c`,
/// `D = m + κ`:
/// easy correct `S = −min(cap, huber(Δ − m, κ)/D·cap)`; medium correct the same with `|Δ|`;
/// hard correct `S = sig(Δ + m, t)·cap` if `Δ ≥ −m`, else `−min(cap, ½·huber(−Δ − m, κ)/D·cap)`;
/// wrong `S = sig(max(Δ − m, 0), t)·cap·w`. Overall = `correct + S + format_weight·format`.
///
/// correct: bool [B]; hwe_count, target, alpha: float32/float64 [B] (g, T_d, α_d of each
/// response's prompt); difficulty: [B] bucket per row (0/1/2 or "easy"/"medium"/"hard");
/// format_reward: [B] or None. Returns `(entropy_reward, overall)`, both [B].
/// Spec vectors (α = 0.5): easy correct g 10 T 4 → overall 0.5; easy wrong g 9 T 4 →
/// 0.2642391; medium correct g 27 T 20 → 0.9583333; hard correct g 20 T 20 → 1.5469602.
#[pyfunction]
#[pyo3(signature = (correct, hwe_count, target, alpha, difficulty, *, format_reward=None, format_weight=0.0))]
#[allow(clippy::too_many_arguments)]
fn entropy_rewards<'py>(
    py: Python<'py>,
    correct: &Bound<'py, PyAny>,
    hwe_count: &Bound<'py, PyAny>,
    target: &Bound<'py, PyAny>,
    alpha: &Bound<'py, PyAny>,
    difficulty: &Bound<'py, PyAny>,
    format_reward: Option<&Bound<'py, PyAny>>,
    format_weight: f64,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    const FUNC: &str = "entropy_rewards";
    by_dtype!(float_dtype(FUNC, "hwe_count", hwe_count)?, F => {
        let c = BoolInput::new(FUNC, "correct", correct)?;
        let g = Input::<F>::new(FUNC, "hwe_count", hwe_count, 1)?;
        let t = Input::<F>::new(FUNC, "target", target, 1)?;
        let a = Input::<F>::new(FUNC, "alpha", alpha, 1)?;
        let fr = format_reward.map(|f| Input::<F>::new(FUNC, "format_reward", f, 1)).transpose()?;
        let ds = buckets_of(FUNC, difficulty)?;
        let b = g.shape()[0];
        let lens = [
            ("correct", c.slice().len()),
            ("target", t.shape()[0]),
            ("alpha", a.shape()[0]),
            ("difficulty", ds.len()),
            ("format_reward", fr.as_ref().map_or(b, |f| f.shape()[0])),
        ];
        for (name, len) in lens {
            if len != b {
                return Err(value_error(format!(
                    "{FUNC}: `{name}` has {len} elements, expected {b} (the length of `hwe_count`)"
                )));
            }
        }
        let cfg = ShapingConfig::<F> { format_weight: cast(format_weight), ..ShapingConfig::default() };
        let s_out = Output::<F>::new(py, &[b]);
        let o_out = Output::<F>::new(py, &[b]);
        {
            let mut sw = s_out.write()?;
            let s = sw.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let mut ow = o_out.write()?;
            let o = ow.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let (cs, gs, ts, als) = (c.slice(), g.slice(), t.slice(), a.slice());
            let frs = fr.as_ref().map(|f| f.slice());
            let fail = py.detach(move || {
                for i in 0..b {
                    let fmt = frs.map_or(F::default(), |f| f[i]);
                    match shaping::shaped_reward(ds[i], cs[i], gs[i], ts[i], als[i], fmt, &cfg) {
                        Ok(r) => {
                            s[i] = r.entropy;
                            o[i] = r.overall;
                        }
                        Err(e) => return Err((i, e)),
                    }
                }
                Ok(())
            });
            if let Err((i, e)) = fail {
                return Err(value_error(format!("{FUNC}: row {i}: {e}")));
            }
        }
        Ok((s_out.array.into_any(), o_out.array.into_any()))
    })
}
