//! The token kernels on CUDA tensors, without a copy: `ares/_cuda.py` hands each device
//! tensor over as its address (PyTorch's `data_ptr()`, or `__cuda_array_interface__`), with
//! the caller's device and current stream; the kernels (`ares-cuda`, loaded at run time:
//! libcuda and NVRTC, no toolkit at build time) run on that stream, ordered with the
//! caller's own work. Shapes, dtypes, contiguity and devices are checked in Python before
//! these are called; lengths again here (`ares-cuda` checks every view).
//!
//! One `ares_cuda::Cuda` per device, opened at the first call (NVRTC compiles the token
//! kernels once; the image is cached on disk) and kept for the process.

use std::collections::HashMap;
use std::sync::Mutex;

use ares_core::kl::KlEstimator;
use ares_cuda::external;
use ares_cuda::{Cuda, HweOutputs, MaskedKlInputs, MaskedKlOutputs, ModelOps, WindowSpec};
use half::{bf16, f16};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::args::{GroupSpec, core_err, value_error};
use ares_core::Groups;
use ares_core::advantage::{
    GRPO_EPSILON, GrpoConfig, PRO_MAX_EPSILON, PRO_MAX_MAX_SCALE, PRO_MAX_PRODUCT_CAP,
    PRO_MAX_UNIFORM_STD, ProMaxConfig,
};
use ares_cuda::{DeviceTokens, SampleEstimator, TokenEstimator};

/// Devices opened once per process, by ordinal: `Cuda` (the token kernels) and `ModelOps`
/// (the backward's kernels) hold driver handles that cudarc marks neither `Send` nor
/// `Sync`; every use is under the cell's mutex, one call at a time.
struct Opened<T>(HashMap<usize, T>);
// SAFETY: the handles are only touched with the mutex held; the CUDA driver API is
// thread-safe and the primary context is current on whichever thread makes the call.
unsafe impl<T> Send for Opened<T> {}

static DEVICES: Mutex<Option<Opened<Cuda>>> = Mutex::new(None);
/// The model ops (the log-prob and entropy backward kernels live in `model_ops.cu`), opened
/// at the first backward: NVRTC compiles them once per architecture (cached on disk), and
/// cuBLAS must load.
static BACKWARDS: Mutex<Option<Opened<ModelOps>>> = Mutex::new(None);

/// Runs `f` on device `device` of `cell`, opening it with `open` at the first call.
fn with_opened<T, R>(
    cell: &Mutex<Option<Opened<T>>>,
    func: &str,
    device: usize,
    open: fn(usize) -> ares_cuda::Result<T>,
    f: impl FnOnce(&mut T) -> ares_cuda::Result<R>,
) -> PyResult<R> {
    let mut guard = cell
        .lock()
        .map_err(|_| value_error(format!("{func}: a previous CUDA call panicked")))?;
    let all = &mut guard.get_or_insert_with(|| Opened(HashMap::new())).0;
    let opened = match all.entry(device) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(
            open(device).map_err(|e| value_error(format!("{func}: CUDA device {device}: {e}")))?,
        ),
    };
    f(opened).map_err(|e| match e {
        // input core rejects: core's message, as the CPU path gives it
        ares_cuda::Error::Invalid { source, .. } => core_err(func, source),
        e => value_error(format!("{func}: {e}")),
    })
}

/// Runs `f` on device `device` with its operations queued on `stream`.
fn on_device<R>(
    func: &str,
    device: usize,
    stream: u64,
    f: impl FnOnce(&mut Cuda) -> ares_cuda::Result<R>,
) -> PyResult<R> {
    with_opened(&DEVICES, func, device, Cuda::for_external, |cuda| {
        // SAFETY: `stream` is the caller's current stream of `device` (ares/_cuda.py), alive
        // for the call; the kernels are queued on it and the call returns before it could
        // end. The previous call's stream: PyTorch keeps its streams for the process's life
        // (a stream the caller made and destroyed since is the caller's contract to break).
        unsafe { cuda.use_stream(stream) }?;
        f(cuda)
    })
}

/// `rows · cols` elements, or an error naming `func` when that overflows.
fn elems(func: &str, rows: usize, cols: usize) -> PyResult<usize> {
    rows.checked_mul(cols)
        .ok_or_else(|| value_error(format!("{func}: {rows} × {cols} elements overflow")))
}

/// `log_prob_entropy` on device memory: `logits` `[rows, vocab]` (`dtype` float32,
/// bfloat16 or float16), optional `targets` `[rows]` u32 ids (0: none) with `out_log_prob`
/// `[rows]`, and `out_entropy` `[rows]`, f32. Reads the status word (waits for `stream`).
#[pyfunction]
#[pyo3(signature = (device, stream, logits, dtype, rows, vocab, temperature, targets, out_log_prob, out_entropy))]
#[allow(clippy::too_many_arguments)]
fn cuda_log_prob_entropy(
    py: Python<'_>,
    device: usize,
    stream: u64,
    logits: u64,
    dtype: &str,
    rows: usize,
    vocab: usize,
    temperature: f32,
    targets: u64,
    out_log_prob: u64,
    out_entropy: u64,
) -> PyResult<()> {
    const FUNC: &str = "log_prob_entropy";
    let n = elems(FUNC, rows, vocab)?;
    let dtype = dtype.to_owned();
    py.detach(move || {
        on_device(FUNC, device, stream, |cuda| {
            // SAFETY: _cuda.py passes the addresses of contiguous tensors of these shapes and
            // dtypes on `device`, alive for the call.
            unsafe {
                let mut ent = cuda.borrow::<f32>(out_entropy, rows);
                let mut ids = (targets != 0).then(|| cuda.borrow::<u32>(targets, rows));
                let mut lp = (targets != 0).then(|| cuda.borrow::<f32>(out_log_prob, rows));
                let tg = ids
                    .as_deref_mut()
                    .zip(lp.as_deref_mut())
                    .map(|(i, l)| (&*i, l));
                match dtype.as_str() {
                    "float32" => {
                        let x = cuda.borrow::<f32>(logits, n);
                        cuda.log_prob_entropy(&x, vocab, temperature, tg, &mut ent)
                    }
                    "bfloat16" => {
                        let x = cuda.borrow::<bf16>(logits, n);
                        cuda.log_prob_entropy(&x, vocab, temperature, tg, &mut ent)
                    }
                    _ => {
                        let x = cuda.borrow::<f16>(logits, n);
                        cuda.log_prob_entropy(&x, vocab, temperature, tg, &mut ent)
                    }
                }
            }
        })
    })
}

/// `entropy_windows` on device memory, `[rows, cols]` f32 throughout: window means and
/// their validity, and with `tau` the HWE mask, per-row counts and soft costs (`trigger`
/// 0: every position a candidate). Queued without waiting.
#[pyfunction]
#[pyo3(signature = (device, stream, entropy, mask, rows, cols, window_size, includes_self, out_means, out_valid, tau, trigger, out_hwe_mask, out_counts, out_soft_cost))]
#[allow(clippy::too_many_arguments)]
fn cuda_entropy_windows(
    py: Python<'_>,
    device: usize,
    stream: u64,
    entropy: u64,
    mask: u64,
    rows: usize,
    cols: usize,
    window_size: usize,
    includes_self: bool,
    out_means: u64,
    out_valid: u64,
    tau: Option<f32>,
    trigger: u64,
    out_hwe_mask: u64,
    out_counts: u64,
    out_soft_cost: u64,
) -> PyResult<()> {
    const FUNC: &str = "entropy_windows";
    let n = elems(FUNC, rows, cols)?;
    py.detach(move || {
        on_device(FUNC, device, stream, |cuda| {
            // SAFETY: as in cuda_log_prob_entropy.
            unsafe {
                let h = cuda.borrow::<f32>(entropy, n);
                let m = cuda.borrow::<f32>(mask, n);
                let mut means = cuda.borrow::<f32>(out_means, n);
                let mut valid = cuda.borrow::<f32>(out_valid, n);
                let trig = (trigger != 0).then(|| cuda.borrow::<f32>(trigger, n));
                let mut hwe_mask = tau.map(|_| cuda.borrow::<f32>(out_hwe_mask, n));
                let mut counts = tau.map(|_| cuda.borrow::<f32>(out_counts, rows));
                let mut soft = tau.map(|_| cuda.borrow::<f32>(out_soft_cost, rows));
                let hwe = match (tau, &mut hwe_mask, &mut counts, &mut soft) {
                    (Some(tau), Some(hm), Some(c), Some(s)) => Some(HweOutputs {
                        tau,
                        trigger: trig.as_ref().map(|t| t.as_view()),
                        hwe_mask: hm.as_view_mut(),
                        counts: c.as_view_mut(),
                        soft_cost: s.as_view_mut(),
                    }),
                    _ => None,
                };
                let spec = WindowSpec {
                    cols,
                    window_size,
                    includes_self,
                };
                let (hv, mv) = (h.as_view(), m.as_view());
                let (mut meansv, mut validv) = (means.as_view_mut(), valid.as_view_mut());
                cuda.token_ops()
                    .entropy_windows(&hv, &mv, spec, hwe, &mut meansv, &mut validv)
            }
        })
    })
}

/// `row_percentile` on device memory: per row of `[rows, cols]` window means with 0/1
/// `valid`, the `q`-th percentile into `out_threshold` and 1/0 into `out_has` (`[rows]`).
/// Queued without waiting.
#[pyfunction]
#[pyo3(signature = (device, stream, means, valid, rows, cols, q, out_threshold, out_has))]
#[allow(clippy::too_many_arguments)]
fn cuda_row_percentile(
    py: Python<'_>,
    device: usize,
    stream: u64,
    means: u64,
    valid: u64,
    rows: usize,
    cols: usize,
    q: f32,
    out_threshold: u64,
    out_has: u64,
) -> PyResult<()> {
    const FUNC: &str = "row_percentile";
    let n = elems(FUNC, rows, cols)?;
    py.detach(move || {
        on_device(FUNC, device, stream, |cuda| {
            // SAFETY: as in cuda_log_prob_entropy.
            unsafe {
                let (m, v) = (cuda.borrow::<f32>(means, n), cuda.borrow::<f32>(valid, n));
                let mut thr = cuda.borrow::<f32>(out_threshold, rows);
                let mut has = cuda.borrow::<f32>(out_has, rows);
                let (mv, vv) = (m.as_view(), v.as_view());
                let (mut tv, mut hv) = (thr.as_view_mut(), has.as_view_mut());
                cuda.token_ops()
                    .row_percentile(&mv, &vv, cols, q, &mut tv, &mut hv)
            }
        })
    })
}

/// `masked_dynamic_kl` on device memory: `[rows, cols]` f32 log-probs, reference
/// log-probs, 0/1 mask and optional HWE mask (0: none), `beta_rows` `[rows]`; per-token
/// `out_kl` and `out_weighted` (0: not wanted), per-row weighted sums and mean KL, and the
/// total (one element). Queued without waiting.
#[pyfunction]
#[pyo3(signature = (device, stream, logp, ref_logp, mask, hwe_mask, beta_rows, rows, cols, low_ratio, estimator, out_kl, out_weighted, out_row_weighted_sum, out_row_mean_kl, out_total))]
#[allow(clippy::too_many_arguments)]
fn cuda_masked_dynamic_kl(
    py: Python<'_>,
    device: usize,
    stream: u64,
    logp: u64,
    ref_logp: u64,
    mask: u64,
    hwe_mask: u64,
    beta_rows: u64,
    rows: usize,
    cols: usize,
    low_ratio: f32,
    estimator: &str,
    out_kl: u64,
    out_weighted: u64,
    out_row_weighted_sum: u64,
    out_row_mean_kl: u64,
    out_total: u64,
) -> PyResult<()> {
    const FUNC: &str = "masked_dynamic_kl";
    let estimator = KlEstimator::from_name(estimator)
        .ok_or_else(|| value_error(format!("{FUNC}: unknown estimator {estimator:?}")))?;
    let n = elems(FUNC, rows, cols)?;
    py.detach(move || {
        on_device(FUNC, device, stream, |cuda| {
            // SAFETY: as in cuda_log_prob_entropy.
            unsafe {
                let (a, b) = (cuda.borrow::<f32>(logp, n), cuda.borrow::<f32>(ref_logp, n));
                let m = cuda.borrow::<f32>(mask, n);
                let h = (hwe_mask != 0).then(|| cuda.borrow::<f32>(hwe_mask, n));
                let beta = cuda.borrow::<f32>(beta_rows, rows);
                let mut kl = (out_kl != 0).then(|| cuda.borrow::<f32>(out_kl, n));
                let mut w = (out_weighted != 0).then(|| cuda.borrow::<f32>(out_weighted, n));
                let mut rws = cuda.borrow::<f32>(out_row_weighted_sum, rows);
                let mut rmk = cuda.borrow::<f32>(out_row_mean_kl, rows);
                let mut total = cuda.borrow::<f32>(out_total, 1);
                let inputs = MaskedKlInputs {
                    logp: a.as_view(),
                    ref_logp: b.as_view(),
                    mask: m.as_view(),
                    hwe_mask: h.as_ref().map(|h| h.as_view()),
                    beta_rows: beta.as_view(),
                    low_ratio,
                    estimator,
                    cols,
                };
                let outputs = MaskedKlOutputs {
                    kl: kl.as_mut().map(|k| k.as_view_mut()),
                    weighted: w.as_mut().map(|w| w.as_view_mut()),
                    row_weighted_sum: rws.as_view_mut(),
                    row_mean_kl: rmk.as_view_mut(),
                    total: total.as_view_mut(),
                };
                cuda.token_ops().masked_dynamic_kl(inputs, outputs)
            }
        })
    })
}

/// Backward of `log_prob_entropy` on device memory: from `logits` `[rows, vocab]` of `dtype`
/// ("float32", "bfloat16" or "float16"), the gradients of the log-prob `grad_log_prob`
/// `[rows]` (f32, with `targets` `[rows]` u32 ids; 0: none) and of the entropy
/// `grad_entropy` `[rows]` (f32; 0: none), `out_dlogits` `[rows, vocab]` of the logits' dtype
/// = ∂L/∂logits (overwritten; from 16-bit logits the f32 gradient of the widened logits,
/// rounded once). The model ops run on their own stream, ordered after the caller's `stream`
/// and before its next work; the status word is read (waits).
#[pyfunction]
#[pyo3(signature = (device, stream, logits, rows, vocab, temperature, targets, grad_log_prob, grad_entropy, out_dlogits, dtype="float32"))]
#[allow(clippy::too_many_arguments)]
fn cuda_log_prob_entropy_backward(
    py: Python<'_>,
    device: usize,
    stream: u64,
    logits: u64,
    rows: usize,
    vocab: usize,
    temperature: f32,
    targets: u64,
    grad_log_prob: u64,
    grad_entropy: u64,
    out_dlogits: u64,
    dtype: &str,
) -> PyResult<()> {
    const FUNC: &str = "log_prob_entropy_backward";
    let n = elems(FUNC, rows, vocab)?;
    let bf16 = match dtype {
        "float32" => None,
        "bfloat16" => Some(true),
        "float16" => Some(false),
        other => {
            return Err(value_error(format!(
                "{FUNC}: `logits` dtype {other:?} is not float32, bfloat16 or float16"
            )));
        }
    };
    py.detach(move || {
        with_opened(&BACKWARDS, FUNC, device, ModelOps::new, |ops| {
            // SAFETY: `stream` is the caller's current stream of `device`; the addresses are
            // of contiguous tensors of these shapes on `device`, alive for the call
            // (ares/_cuda.py).
            unsafe {
                let caller = external::before_ops(ops, stream)?;
                let s = ops.stream().clone();
                if let Some(bf16) = bf16 {
                    let x = external::borrow_on::<u16>(&s, logits, n);
                    let mut d = external::borrow_on::<u16>(&s, out_dlogits, n);
                    let ids = (targets != 0 && grad_log_prob != 0)
                        .then(|| external::borrow_on::<u32>(&s, targets, rows));
                    let g = (targets != 0 && grad_log_prob != 0)
                        .then(|| external::borrow_on::<f32>(&s, grad_log_prob, rows));
                    let e = (grad_entropy != 0)
                        .then(|| external::borrow_on::<f32>(&s, grad_entropy, rows));
                    let (iv, gv) = (
                        ids.as_ref().map(|i| i.as_view()),
                        g.as_ref().map(|g| g.as_view()),
                    );
                    let ev = e.as_ref().map(|e| e.as_view());
                    let lp = iv.as_ref().zip(gv.as_ref());
                    let mut dv = d.as_view_mut();
                    // neither part: refused by the op (ares/_cuda.py returns zeros itself)
                    let checked = ops
                        .log_prob_entropy_backward_16(
                            &x.as_view(),
                            bf16,
                            vocab,
                            temperature,
                            lp,
                            ev.as_ref(),
                            &mut dv,
                        )
                        .and_then(|()| ops.check_status());
                    external::after_ops(ops, &caller)?;
                    return checked;
                }
                let x = external::borrow_on::<f32>(&s, logits, n);
                let mut d = external::borrow_on::<f32>(&s, out_dlogits, n);
                let (xv, mut dv) = (x.as_view(), d.as_view_mut());
                if targets != 0 && grad_log_prob != 0 {
                    let ids = external::borrow_on::<u32>(&s, targets, rows);
                    let g = external::borrow_on::<f32>(&s, grad_log_prob, rows);
                    let (iv, gv) = (ids.as_view(), g.as_view());
                    ops.log_prob_backward(&xv, vocab, temperature, &iv, &gv, &mut dv)?;
                } else {
                    ops.fill(&mut dv, 0.0)?;
                }
                if grad_entropy != 0 {
                    let g = external::borrow_on::<f32>(&s, grad_entropy, rows);
                    ops.entropy_backward(&xv, vocab, temperature, &g.as_view(), &mut dv)?;
                }
                let checked = ops.check_status();
                external::after_ops(ops, &caller)?;
                checked
            }
        })
    })
}

/// `policy_loss` on device memory: `logp`, `logp_old`, `advantages`, `mask` and (unless the
/// correction is `none`) `logp_rollout` f32 `[rows, cols]`; writes ∂loss/∂logp to `out_grad`
/// `[rows, cols]` and returns the loss and its metrics as the CPU function's dict does
/// (reading them waits for the stream). ares-cuda's `policy_loss` kernel, the twin of
/// `ares_core::loss`'s PPO / dual clip, GSPO, GSPO-token, CISPO, Clip-Cov and KL-Cov (these
/// two choose their tokens with `cov_select` first, in a scratch tensor of `[rows, cols]`).
#[pyfunction]
#[pyo3(signature = (device, stream, logp, logp_old, advantages, mask, logp_rollout, rows, cols,
    loss_mode, loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c, is_correction,
    is_threshold_low, is_threshold_high, out_grad, clip_cov_ratio, clip_cov_lb, clip_cov_ub,
    clip_cov_seed, kl_cov_ratio, ppo_kl_coef))]
#[allow(clippy::too_many_arguments)]
fn cuda_policy_loss<'py>(
    py: Python<'py>,
    device: usize,
    stream: u64,
    logp: u64,
    logp_old: u64,
    advantages: u64,
    mask: u64,
    logp_rollout: u64,
    rows: usize,
    cols: usize,
    loss_mode: &str,
    loss_agg_mode: &str,
    clip_ratio_low: f32,
    clip_ratio_high: f32,
    clip_ratio_c: f32,
    is_correction: &str,
    is_threshold_low: f32,
    is_threshold_high: f32,
    out_grad: u64,
    clip_cov_ratio: f32,
    clip_cov_lb: f32,
    clip_cov_ub: f32,
    clip_cov_seed: u64,
    kl_cov_ratio: f32,
    ppo_kl_coef: f32,
) -> PyResult<Bound<'py, PyDict>> {
    use crate::loss::{Mode, agg_mode, is_mode, loss_mode_of};
    use ares_core::loss::{ClipCovParams, ClipParams, IsCorrection, KlCovParams, PolicyLossConfig};
    use ares_cuda::{LOSS_STATS, LossInputs, LossKind, LossOutputs, LossReport, LossSpec};
    const FUNC: &str = "policy_loss";
    let kind = match loss_mode_of(FUNC, loss_mode)? {
        Mode::Vanilla => LossKind::Ppo,
        Mode::Gspo(level) => LossKind::Gspo(level),
        Mode::Cispo => LossKind::Cispo,
        Mode::ClipCov => LossKind::ClipCov(ClipCovParams {
            ratio: clip_cov_ratio,
            lb: clip_cov_lb,
            ub: clip_cov_ub,
            seed: clip_cov_seed,
        }),
        Mode::KlCov => LossKind::KlCov(KlCovParams {
            ratio: kl_cov_ratio,
            coef: ppo_kl_coef,
        }),
    };
    let spec = LossSpec {
        kind,
        config: PolicyLossConfig {
            clip: ClipParams {
                clip_ratio_low,
                clip_ratio_high,
                clip_ratio_c,
            },
            agg: agg_mode(FUNC, loss_agg_mode)?,
            is_correction: IsCorrection {
                mode: is_mode(FUNC, is_correction)?,
                low: is_threshold_low,
                high: is_threshold_high,
            },
        },
        kl: None,
        entropy_coef: None,
        scale: 1.0,
    };
    let n = elems(FUNC, rows, cols)?;
    let (totals, status) = py.detach(move || {
        on_device(FUNC, device, stream, |cuda| {
            let s = cuda.stream().clone();
            let alloc = |len: usize| {
                s.alloc_zeros::<f32>(len)
                    .map_err(|source| ares_cuda::Error::Driver {
                        step: format!("{FUNC}: scratch"),
                        source,
                    })
            };
            let (mut counts, mut stats, mut totals) =
                (alloc(rows)?, alloc(rows * LOSS_STATS)?, alloc(LOSS_STATS)?);
            let mut selected = if kind.selects_tokens() {
                Some(alloc(n)?)
            } else {
                None
            };
            let mut status =
                s.alloc_zeros::<u32>(2)
                    .map_err(|source| ares_cuda::Error::Driver {
                        step: format!("{FUNC}: status"),
                        source,
                    })?;
            // SAFETY: as in cuda_log_prob_entropy: contiguous tensors of these shapes on
            // `device`, alive for the call (ares/_cuda.py).
            unsafe {
                let (a, o) = (cuda.borrow::<f32>(logp, n), cuda.borrow::<f32>(logp_old, n));
                let (adv, m) = (
                    cuda.borrow::<f32>(advantages, n),
                    cuda.borrow::<f32>(mask, n),
                );
                let r = (logp_rollout != 0).then(|| cuda.borrow::<f32>(logp_rollout, n));
                let mut g = cuda.borrow::<f32>(out_grad, n);
                let inputs = LossInputs {
                    logp: a.as_view(),
                    logp_old: o.as_view(),
                    advantages: adv.as_view(),
                    mask: m.as_view(),
                    logp_rollout: r.as_ref().map(|r| r.as_view()),
                    keep: None,
                    logp_ref: None,
                    beta_rows: None,
                    hwe: None,
                    entropy: None,
                    cols,
                };
                let outputs = LossOutputs {
                    grad: g.as_view_mut(),
                    entropy_grad: None,
                    row_counts: counts.as_view_mut(),
                    row_stats: stats.as_view_mut(),
                    totals: totals.as_view_mut(),
                    status: status.as_view_mut(),
                    selected: selected.as_mut().map(|v| v.as_view_mut()),
                };
                cuda.token_ops().policy_loss(&spec, inputs, outputs)?;
            }
            let read = |e| ares_cuda::Error::Driver {
                step: format!("{FUNC}: reading the totals"),
                source: e,
            };
            let t = s.clone_dtoh(&totals).map_err(read)?;
            let st = s.clone_dtoh(&status).map_err(read)?;
            Ok((t, st))
        })
    })?;
    let totals: [f32; LOSS_STATS] = totals
        .try_into()
        .map_err(|_| value_error(format!("{FUNC}: short totals")))?;
    let report =
        LossReport::read(&totals, [status[0], status[1]]).map_err(|e| core_err(FUNC, e))?;
    let p = report.policy;
    let d = PyDict::new(py);
    d.set_item("loss", f64::from(p.loss))?;
    d.set_item("clipfrac", f64::from(p.clipfrac))?;
    d.set_item("clipfrac_lower", f64::from(p.clipfrac_lower))?;
    d.set_item("approx_kl", f64::from(p.approx_kl))?;
    d.set_item("is_weight_mean", f64::from(p.is_weight_mean))?;
    d.set_item("is_changed_frac", f64::from(p.is_changed_frac))?;
    d.set_item("selected_frac", f64::from(p.selected_frac))?;
    d.set_item("valid_tokens", p.valid_tokens)?;
    Ok(d)
}

/// The head's sizes, and the elements of the hidden states and of the weight, with the
/// precision of their dtype: float32 exact, bfloat16 on tensor cores.
fn head_dims(
    func: &str,
    dtype: &str,
    rows: usize,
    hidden: usize,
    vocab: usize,
) -> PyResult<(ares_cuda::HeadDims, usize, usize)> {
    let precision = match dtype {
        "float32" => ares_cuda::GemmPrecision::F32,
        "bfloat16" => ares_cuda::GemmPrecision::Bf16,
        other => {
            return Err(value_error(format!(
                "{func}: `hidden` and `weight` are {other}; use float32 or bfloat16 (both the same)"
            )));
        }
    };
    let dims = ares_cuda::HeadDims {
        rows,
        hidden,
        vocab,
        precision,
    };
    Ok((
        dims,
        elems(func, rows, hidden)?,
        elems(func, vocab, hidden)?,
    ))
}

/// The fused head's hidden states and weight, borrowed in their dtype.
enum HeadOperands {
    F32(external::Borrowed<f32>, external::Borrowed<f32>),
    Bf16(external::Borrowed<u16>, external::Borrowed<u16>),
}

impl HeadOperands {
    /// `hidden` (`nx` elements) and `weight` (`nw`) at the caller's addresses, as `precision`
    /// reads them.
    ///
    /// # Safety
    /// As [`external::borrow_on`] for both.
    unsafe fn borrow(
        s: &std::sync::Arc<ares_cuda::cudarc::driver::CudaStream>,
        precision: ares_cuda::GemmPrecision,
        (hidden, nx): (u64, usize),
        (weight, nw): (u64, usize),
    ) -> Self {
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            if precision == ares_cuda::GemmPrecision::Bf16 {
                HeadOperands::Bf16(
                    external::borrow_on(s, hidden, nx),
                    external::borrow_on(s, weight, nw),
                )
            } else {
                HeadOperands::F32(
                    external::borrow_on(s, hidden, nx),
                    external::borrow_on(s, weight, nw),
                )
            }
        }
    }

    /// `f` on the two as GEMM operands.
    fn with<R>(
        &self,
        f: impl FnOnce(ares_cuda::Operand<'_, '_>, ares_cuda::Operand<'_, '_>) -> R,
    ) -> R {
        match self {
            HeadOperands::F32(x, w) => {
                let (xv, wv) = (x.as_view(), w.as_view());
                f(ares_cuda::Operand::F32(&xv), ares_cuda::Operand::F32(&wv))
            }
            HeadOperands::Bf16(x, w) => {
                let (xv, wv) = (x.as_view(), w.as_view());
                f(ares_cuda::Operand::Bf16(&xv), ares_cuda::Operand::Bf16(&wv))
            }
        }
    }
}

/// The LM head fused with the per-token log-prob and entropy on device memory (ares-cuda's
/// `ModelOps::linear_log_prob_entropy`, the twin of the CPU's `linear_log_prob_entropy`):
/// `hidden` `[rows, hidden_size]` and `weight` `[vocab, hidden_size]` of `dtype` (float32 or
/// bfloat16, both), `targets` `[rows]` u32; writes `out_log_prob` and `out_entropy` `[rows]`
/// f32, `chunk_rows` rows of logits at a time (never `[rows, vocab]`). The model ops run on
/// their own stream, ordered after the caller's `stream` and before its next work; the
/// status word is read (waits).
#[pyfunction]
#[pyo3(signature = (device, stream, hidden, weight, dtype, rows, hidden_size, vocab, temperature,
    targets, out_log_prob, out_entropy, chunk_rows))]
#[allow(clippy::too_many_arguments)]
fn cuda_linear_log_prob_entropy(
    py: Python<'_>,
    device: usize,
    stream: u64,
    hidden: u64,
    weight: u64,
    dtype: &str,
    rows: usize,
    hidden_size: usize,
    vocab: usize,
    temperature: f32,
    targets: u64,
    out_log_prob: u64,
    out_entropy: u64,
    chunk_rows: usize,
) -> PyResult<()> {
    const FUNC: &str = "linear_log_prob_entropy";
    let (dims, nx, nw) = head_dims(FUNC, dtype, rows, hidden_size, vocab)?;
    let precision = dims.precision;
    py.detach(move || {
        with_opened(&BACKWARDS, FUNC, device, ModelOps::new, |ops| {
            // SAFETY: `stream` is the caller's current stream of `device`; the addresses are
            // of contiguous tensors of these shapes and dtypes on `device`, alive for the
            // call (ares/_cuda.py).
            unsafe {
                let caller = external::before_ops(ops, stream)?;
                let s = ops.stream().clone();
                let ids = external::borrow_on::<u32>(&s, targets, rows);
                let mut lp = external::borrow_on::<f32>(&s, out_log_prob, rows);
                let mut ent = external::borrow_on::<f32>(&s, out_entropy, rows);
                let (iv, mut lv, mut ev) = (ids.as_view(), lp.as_view_mut(), ent.as_view_mut());
                let head = HeadOperands::borrow(&s, precision, (hidden, nx), (weight, nw));
                let done = head.with(|x, w| {
                    let (t, c) = (temperature, chunk_rows);
                    ops.linear_log_prob_entropy(x, w, dims, t, &iv, &mut lv, &mut ev, c)
                });
                let checked = done.and_then(|()| ops.check_status());
                external::after_ops(ops, &caller)?;
                checked
            }
        })
    })
}

/// Backward of [`cuda_linear_log_prob_entropy`] on device memory: from `grad_log_prob`
/// (`[rows]` f32, with `targets`; 0: none) and `grad_entropy` (`[rows]` f32; 0: none),
/// **overwrites** `out_grad_hidden` `[rows, hidden_size]` and **adds** into
/// `out_grad_weight` `[vocab, hidden_size]`, both f32, recomputing each chunk's logits.
/// Ordered and checked as the forward.
#[pyfunction]
#[pyo3(signature = (device, stream, hidden, weight, dtype, rows, hidden_size, vocab, temperature,
    targets, grad_log_prob, grad_entropy, out_grad_hidden, out_grad_weight, chunk_rows))]
#[allow(clippy::too_many_arguments)]
fn cuda_linear_log_prob_entropy_backward(
    py: Python<'_>,
    device: usize,
    stream: u64,
    hidden: u64,
    weight: u64,
    dtype: &str,
    rows: usize,
    hidden_size: usize,
    vocab: usize,
    temperature: f32,
    targets: u64,
    grad_log_prob: u64,
    grad_entropy: u64,
    out_grad_hidden: u64,
    out_grad_weight: u64,
    chunk_rows: usize,
) -> PyResult<()> {
    const FUNC: &str = "linear_log_prob_entropy_backward";
    let (dims, nx, nw) = head_dims(FUNC, dtype, rows, hidden_size, vocab)?;
    let precision = dims.precision;
    py.detach(move || {
        with_opened(&BACKWARDS, FUNC, device, ModelOps::new, |ops| {
            // SAFETY: as in cuda_linear_log_prob_entropy.
            unsafe {
                let caller = external::before_ops(ops, stream)?;
                let s = ops.stream().clone();
                let lp = (targets != 0 && grad_log_prob != 0).then(|| {
                    (
                        external::borrow_on::<u32>(&s, targets, rows),
                        external::borrow_on::<f32>(&s, grad_log_prob, rows),
                    )
                });
                let ge =
                    (grad_entropy != 0).then(|| external::borrow_on::<f32>(&s, grad_entropy, rows));
                let mut gx = external::borrow_on::<f32>(&s, out_grad_hidden, nx);
                let mut gw = external::borrow_on::<f32>(&s, out_grad_weight, nw);
                let lpv = lp.as_ref().map(|(i, g)| (i.as_view(), g.as_view()));
                let gev = ge.as_ref().map(|g| g.as_view());
                let (mut gxv, mut gwv) = (gx.as_view_mut(), gw.as_view_mut());
                let lp_ref = lpv.as_ref().map(|(i, g)| (i, g));
                let head = HeadOperands::borrow(&s, precision, (hidden, nx), (weight, nw));
                let done = head.with(|x, w| {
                    let (t, c, ge) = (temperature, chunk_rows, gev.as_ref());
                    ops.linear_log_prob_entropy_backward(
                        x, w, dims, t, lp_ref, ge, &mut gxv, &mut gwv, c,
                    )
                });
                let checked = done.and_then(|()| ops.check_status());
                external::after_ops(ops, &caller)?;
                checked
            }
        })
    })
}

/// GRPO's options as the numpy functions take them.
fn grpo_config(norm_adv_by_std: bool, epsilon: f64) -> GrpoConfig<f32> {
    GrpoConfig {
        norm_adv_by_std,
        epsilon: epsilon as f32,
    }
}

/// The advantage estimators' names (as the numpy functions are named) and what each runs.
fn sample_estimator(func: &str, epsilon: f64) -> PyResult<SampleEstimator> {
    Ok(match func {
        "grpo_advantages" => SampleEstimator::Grpo(grpo_config(true, epsilon)),
        "dr_grpo_advantages" => SampleEstimator::Grpo(grpo_config(false, epsilon)),
        "rloo_advantages" => SampleEstimator::Rloo,
        "reinforce_baseline_advantages" => SampleEstimator::ReinforceBaseline,
        _ => {
            return Err(value_error(format!(
                "no CUDA per-sample estimator {func:?}"
            )));
        }
    })
}

/// A per-sample estimator (`func`: `grpo_advantages`, `dr_grpo_advantages`,
/// `rloo_advantages`, `reinforce_baseline_advantages`) on device memory: `rewards` and `out`
/// `[batch]` f32, groups by `n` or `uid` (host keys). Reads the status (waits for `stream`).
#[pyfunction]
#[pyo3(signature = (device, stream, func, rewards, batch, n, uid, epsilon, out))]
#[allow(clippy::too_many_arguments)]
fn cuda_sample_advantages(
    py: Python<'_>,
    device: usize,
    stream: u64,
    func: &str,
    rewards: u64,
    batch: usize,
    n: Option<i64>,
    uid: Option<&Bound<'_, PyAny>>,
    epsilon: f64,
    out: u64,
) -> PyResult<()> {
    let estimator = sample_estimator(func, epsilon)?;
    let spec = GroupSpec::new(func, n, uid, batch)?;
    let name = estimator.name();
    // a group of one: core's error, with the uid named (GroupSpec::run)
    spec.run(py, func, batch, |groups| {
        groups.require_pairs(name)?;
        Ok(on_device(func, device, stream, |cuda| {
            // SAFETY: _cuda.py passes contiguous f32 tensors of `batch` elements on `device`.
            unsafe {
                let r = cuda.borrow::<f32>(rewards, batch);
                let mut o = cuda.borrow::<f32>(out, batch);
                cuda.sample_advantages(groups, &r.as_view(), estimator, &mut o.as_view_mut())
            }
        }))
    })?
}

/// The token-level options of the numpy functions, as one estimator.
#[allow(clippy::too_many_arguments)]
fn token_estimator(
    func: &str,
    epsilon: f64,
    norm_adv_by_std: bool,
    gamma: f64,
    uniform_scale: bool,
    eps: f64,
    max_scale: f64,
    product_cap: f64,
    uniform_std: f64,
) -> PyResult<TokenEstimator> {
    let gamma = gamma as f32;
    Ok(match func {
        "grpo_token_advantages" => TokenEstimator::Grpo(grpo_config(norm_adv_by_std, epsilon)),
        "rloo_token_advantages" => TokenEstimator::Rloo,
        "reinforce_pp_advantages" => TokenEstimator::ReinforcePp { gamma },
        "reinforce_pp_baseline_advantages" => TokenEstimator::ReinforcePpBaseline { gamma },
        "reinforce_pro_max" => TokenEstimator::ProMax(ProMaxConfig {
            uniform_scale,
            eps: eps as f32,
            max_scale: max_scale as f32,
            product_cap: product_cap as f32,
            uniform_std: uniform_std as f32,
        }),
        _ => return Err(value_error(format!("no CUDA token estimator {func:?}"))),
    })
}

/// A token-level estimator (`func`: `grpo_token_advantages`, `rloo_token_advantages`,
/// `reinforce_pp_advantages`, `reinforce_pp_baseline_advantages`, `reinforce_pro_max`) on
/// device memory: `rewards` `[rows]`, `mask`, `weighted_kl` (0: none) and `out` `[rows, cols]`,
/// f32; groups by `n` or `uid` (none for `reinforce_pp_advantages`). Returns the whitening's
/// (mean, var) for the REINFORCE++ pair. Reads the status (waits for `stream`).
#[pyfunction]
#[pyo3(signature = (device, stream, func, rewards, rows, cols, mask, weighted_kl, n, uid, out, *, epsilon=GRPO_EPSILON, norm_adv_by_std=true, gamma=1.0, uniform_scale=false, eps=PRO_MAX_EPSILON, max_scale=PRO_MAX_MAX_SCALE, product_cap=PRO_MAX_PRODUCT_CAP, uniform_std=PRO_MAX_UNIFORM_STD))]
#[allow(clippy::too_many_arguments)]
fn cuda_token_advantages(
    py: Python<'_>,
    device: usize,
    stream: u64,
    func: &str,
    rewards: u64,
    rows: usize,
    cols: usize,
    mask: u64,
    weighted_kl: u64,
    n: Option<i64>,
    uid: Option<&Bound<'_, PyAny>>,
    out: u64,
    epsilon: f64,
    norm_adv_by_std: bool,
    gamma: f64,
    uniform_scale: bool,
    eps: f64,
    max_scale: f64,
    product_cap: f64,
    uniform_std: f64,
) -> PyResult<Option<(f64, f64)>> {
    let estimator = token_estimator(
        func,
        epsilon,
        norm_adv_by_std,
        gamma,
        uniform_scale,
        eps,
        max_scale,
        product_cap,
        uniform_std,
    )?;
    let elements = elems(func, rows, cols)?;
    let run = |groups: Option<&Groups<'_>>| {
        on_device(func, device, stream, |cuda| {
            // SAFETY: _cuda.py passes contiguous f32 tensors of these shapes on `device`.
            unsafe {
                let r = cuda.borrow::<f32>(rewards, rows);
                let m = cuda.borrow::<f32>(mask, elements);
                let k = (weighted_kl != 0).then(|| cuda.borrow::<f32>(weighted_kl, elements));
                let mut o = cuda.borrow::<f32>(out, elements);
                let tokens = DeviceTokens {
                    mask: m.as_view(),
                    weighted_kl: k.as_ref().map(|k| k.as_view()),
                    cols,
                };
                cuda.token_advantages(
                    groups,
                    &r.as_view(),
                    tokens,
                    estimator,
                    &mut o.as_view_mut(),
                )
            }
        })
    };
    let stats = match estimator {
        TokenEstimator::ReinforcePp { .. } => py.detach(|| run(None))?,
        _ => {
            let spec = GroupSpec::new(func, n, uid, rows)?;
            let name = estimator.name();
            spec.run(py, func, rows, |groups| {
                groups.require_pairs(name)?;
                Ok(run(Some(groups)))
            })??
        }
    };
    Ok(stats.map(|s| (f64::from(s.mean), f64::from(s.var))))
}

/// `masked_whiten` in place on device memory: `values` and `mask` `[rows, cols]` f32.
/// Returns (mean, var). Reads the status (waits for `stream`); on error `values` is unchanged.
#[pyfunction]
fn cuda_masked_whiten(
    py: Python<'_>,
    device: usize,
    stream: u64,
    values: u64,
    mask: u64,
    rows: usize,
    cols: usize,
) -> PyResult<(f64, f64)> {
    const FUNC: &str = "masked_whiten";
    let n = elems(FUNC, rows, cols)?;
    py.detach(move || {
        on_device(FUNC, device, stream, |cuda| {
            // SAFETY: _cuda.py passes contiguous f32 tensors of these shapes on `device`.
            unsafe {
                let mut v = cuda.borrow::<f32>(values, n);
                let m = cuda.borrow::<f32>(mask, n);
                cuda.masked_whiten(&mut v.as_view_mut(), &m.as_view(), cols)
            }
        })
    })
    .map(|s| (f64::from(s.mean), f64::from(s.var)))
}

/// Whether libcuda loads in this process (the driver; a GPU is not required to load it).
#[pyfunction]
fn cuda_driver_available() -> bool {
    ares_cuda::cuda_available()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_log_prob_entropy, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_entropy_windows, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_row_percentile, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_masked_dynamic_kl, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_policy_loss, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_log_prob_entropy_backward, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_linear_log_prob_entropy, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_linear_log_prob_entropy_backward, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_driver_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_sample_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_token_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_masked_whiten, m)?)?;
    Ok(())
}
