//! The stateful controllers as Python classes, each wrapping the ares-core type the trainer
//! (`ares-runner/src/trainer/prepare/controllers.rs`) drives, in f64 like the trainer:
//! `ThresholdEma` (τ), `BucketController` (T_d, α_d, λ_d and the difficulty of each prompt
//! by global id), `AdaptiveKlController` (β), `EntropyCoefController` (the entropy bonus's
//! coefficient) and `GrpoLambda` (the GRPO-λ rewards; parameters only, no changing state).
//!
//! `state_dict()` returns plain Python dicts of floats, ints, strings and `None`;
//! `load_state_dict(d)` checks every key (a missing, unknown, mistyped or out-of-range key
//! is a `ValueError` naming it) and changes nothing when it fails.

use std::collections::BTreeMap;

use crate::args::{
    BoolInput, Dtype, GroupSpec, Input, Output, Real, cast, core_err, float_dtype, value_error,
};
use ares_core::difficulty::{
    AccuracyThresholds, BucketController as CoreBuckets, BucketState, Difficulty, DifficultyConfig,
    PerBucket, classify_groups,
};
use ares_core::entropy::{DEFAULT_EMA_RHO, ThresholdEma as CoreEma};
use ares_core::entropy_bonus::{
    DEFAULT_ENTROPY_COEFF_LR, DEFAULT_ENTROPY_COEFF_MAX, DEFAULT_TARGET_ENTROPY,
    EntropyCoefController as CoreEntropyCoef, EntropyCoefState,
};
use ares_core::kl::{ADAPTIVE_KL_HORIZON, ADAPTIVE_KL_TARGET, AdaptiveKlController as CoreKl};
use ares_core::length::{self, GrpoLambda as CoreGrpoLambda};
use ares_core::{Error, Groups};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyDictMethods};

/// Registers the classes of this file.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ThresholdEma>()?;
    m.add_class::<BucketController>()?;
    m.add_class::<AdaptiveKlController>()?;
    m.add_class::<EntropyCoefController>()?;
    m.add_class::<GrpoLambda>()?;
    m.add_function(wrap_pyfunction!(grpo_lambda_rewards, m)?)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Reading state dicts.

/// `obj` as a dict whose keys are exactly `keys` (the error names the missing or unknown
/// key, prefixed by `path`, e.g. `"buckets.easy."`).
fn state_dict<'py>(
    func: &str,
    path: &str,
    obj: &Bound<'py, PyAny>,
    keys: &[&str],
) -> PyResult<Bound<'py, PyDict>> {
    let d = obj.cast::<PyDict>().map_err(|_| {
        let what = if path.is_empty() {
            "the state".to_string()
        } else {
            format!("`{}`", path.trim_end_matches('.'))
        };
        value_error(format!(
            "{func}: {what} must be a dict, got {}",
            type_name(obj)
        ))
    })?;
    for key in keys {
        if !d.contains(*key)? {
            return Err(value_error(format!("{func}: key `{path}{key}` is missing")));
        }
    }
    for (k, _) in d.iter() {
        let name: String = k.str()?.to_string();
        if !keys.contains(&name.as_str()) {
            return Err(value_error(format!(
                "{func}: unexpected key `{path}{name}` (expected {})",
                keys.join(", ")
            )));
        }
    }
    Ok(d.clone())
}

/// `x` as Python writes it (`None` or the float).
fn py_opt(x: Option<f64>) -> String {
    x.map_or_else(|| "None".into(), |t| format!("{t:?}"))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn item<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(key)?
        .ok_or_else(|| value_error(format!("key `{key}` is missing")))
}

/// A float at `key` (ints allowed; bools and strings are not).
fn get_f64(func: &str, path: &str, d: &Bound<'_, PyDict>, key: &str) -> PyResult<f64> {
    let v = item(d, key)?;
    float_of(func, &format!("{path}{key}"), &v)
}

/// A float or `None` at `key`.
fn get_opt_f64(func: &str, path: &str, d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<f64>> {
    let v = item(d, key)?;
    if v.is_none() {
        Ok(None)
    } else {
        float_of(func, &format!("{path}{key}"), &v).map(Some)
    }
}

fn float_of(func: &str, name: &str, v: &Bound<'_, PyAny>) -> PyResult<f64> {
    if v.is_instance_of::<pyo3::types::PyBool>() || v.is_instance_of::<pyo3::types::PyString>() {
        return Err(value_error(format!(
            "{func}: `{name}` must be a float, got {}",
            type_name(v)
        )));
    }
    v.extract::<f64>().map_err(|_| {
        value_error(format!(
            "{func}: `{name}` must be a float, got {}",
            type_name(v)
        ))
    })
}

/// A core error on `key` restated with the dict path.
fn key_err(func: &str, path: &str, e: Error) -> PyErr {
    match e {
        Error::OutOfRange {
            what,
            value,
            expected,
        } => {
            let key = what.strip_prefix("state.").unwrap_or(what);
            value_error(format!(
                "{func}: `{path}{key}` = {value} is out of range: expected {expected}"
            ))
        }
        other => value_error(format!("{func}: `{}`: {other}", path.trim_end_matches('.'))),
    }
}

// ---------------------------------------------------------------------------------------------
// Buckets.

/// A bucket given as a name ("easy", "medium", "hard", any case) or an index (0, 1, 2).
pub(crate) fn bucket_of(func: &str, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Difficulty> {
    if let Ok(s) = obj.extract::<String>() {
        return Difficulty::from_name(&s).ok_or_else(|| {
            value_error(format!(
                "{func}: `{name}` = {s:?} is not a bucket: expected \"easy\", \"medium\" or \"hard\""
            ))
        });
    }
    if !obj.is_instance_of::<pyo3::types::PyBool>()
        && let Ok(i) = obj.extract::<i64>()
    {
        return usize::try_from(i)
            .ok()
            .and_then(Difficulty::from_index)
            .ok_or_else(|| {
                value_error(format!(
                    "{func}: `{name}` = {i} is not a bucket index: expected 0 (easy), 1 (medium) \
                     or 2 (hard)"
                ))
            });
    }
    Err(value_error(format!(
        "{func}: `{name}` must be a bucket name or index, got {}",
        type_name(obj)
    )))
}

/// One optional float per bucket: `None` (no bucket), a dict by bucket name (absent
/// buckets are `None`), or a sequence of 3 (easy, medium, hard) whose items may be `None`.
fn opt_per_bucket(
    func: &str,
    name: &str,
    obj: Option<&Bound<'_, PyAny>>,
) -> PyResult<PerBucket<Option<f64>>> {
    let mut out = PerBucket::splat(None);
    let Some(obj) = obj else { return Ok(out) };
    if obj.is_none() {
        return Ok(out);
    }
    let one = |v: &Bound<'_, PyAny>, d: Difficulty| -> PyResult<Option<f64>> {
        if v.is_none() {
            Ok(None)
        } else {
            float_of(func, &format!("{name}[{:?}]", d.name()), v).map(Some)
        }
    };
    if let Ok(dict) = obj.cast::<PyDict>() {
        for (k, v) in dict.iter() {
            let d = bucket_of(func, &format!("{name} key"), &k)?;
            out[d] = one(&v, d)?;
        }
        return Ok(out);
    }
    let items: Vec<Bound<'_, PyAny>> = obj
        .try_iter()
        .map_err(|_| {
            value_error(format!(
                "{func}: `{name}` must be a dict by bucket name or a sequence of 3 (easy, medium, \
                 hard), got {}",
                type_name(obj)
            ))
        })?
        .collect::<PyResult<_>>()?;
    if items.len() != 3 {
        return Err(value_error(format!(
            "{func}: `{name}` has {} elements, expected 3 (easy, medium, hard)",
            items.len()
        )));
    }
    for (d, v) in Difficulty::ALL.into_iter().zip(&items) {
        out[d] = one(v, d)?;
    }
    Ok(out)
}

/// One float per bucket: a float (every bucket), a dict with the three bucket names, or a
/// sequence of 3.
fn per_bucket(func: &str, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<PerBucket<f64>> {
    if let Ok(x) = float_of(func, name, obj) {
        return Ok(PerBucket::splat(x));
    }
    let got = opt_per_bucket(func, name, Some(obj))?;
    let mut out = PerBucket::splat(0.0);
    for d in Difficulty::ALL {
        out[d] = got[d].ok_or_else(|| {
            value_error(format!(
                "{func}: `{name}` has no value for bucket {:?}",
                d.name()
            ))
        })?;
    }
    Ok(out)
}

fn bucket_dict<'py, T: Copy + IntoPyObject<'py>>(
    py: Python<'py>,
    values: &PerBucket<T>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (b, v) in values.iter() {
        d.set_item(b.name(), *v)?;
    }
    Ok(d)
}

fn config_dict<'py>(py: Python<'py>, c: &DifficultyConfig<f64>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let acc = PyDict::new(py);
    acc.set_item("easy", c.accuracy_thresholds.easy)?;
    acc.set_item("medium", c.accuracy_thresholds.medium)?;
    d.set_item("accuracy_thresholds", acc)?;
    d.set_item("target_momentum", c.target_momentum)?;
    d.set_item("target_scale", bucket_dict(py, &c.target_scale)?)?;
    d.set_item("target_update_interval", c.target_update_interval)?;
    d.set_item("alpha_init", bucket_dict(py, &c.alpha_init)?)?;
    d.set_item("alpha_lr", c.alpha_lr)?;
    d.set_item("alpha_min", c.alpha_min)?;
    d.set_item("alpha_max", c.alpha_max)?;
    d.set_item("lambda_init", bucket_dict(py, &c.lambda_init)?)?;
    d.set_item("kl_budget", bucket_dict(py, &c.kl_budget)?)?;
    d.set_item("lambda_lr", c.lambda_lr)?;
    d.set_item("lambda_max", c.lambda_max)?;
    Ok(d)
}

const CONFIG_KEYS: [&str; 12] = [
    "accuracy_thresholds",
    "target_momentum",
    "target_scale",
    "target_update_interval",
    "alpha_init",
    "alpha_lr",
    "alpha_min",
    "alpha_max",
    "lambda_init",
    "kl_budget",
    "lambda_lr",
    "lambda_max",
];
const BUCKET_NAMES: [&str; 3] = ["easy", "medium", "hard"];

fn bucket_floats(
    func: &str,
    path: &str,
    d: &Bound<'_, PyDict>,
    key: &str,
) -> PyResult<PerBucket<f64>> {
    let sub_path = format!("{path}{key}.");
    let sub = state_dict(func, &sub_path, &item(d, key)?, &BUCKET_NAMES)?;
    Ok(PerBucket::new(
        get_f64(func, &sub_path, &sub, "easy")?,
        get_f64(func, &sub_path, &sub, "medium")?,
        get_f64(func, &sub_path, &sub, "hard")?,
    ))
}

fn config_of(func: &str, obj: &Bound<'_, PyAny>) -> PyResult<DifficultyConfig<f64>> {
    let p = "config.";
    let d = state_dict(func, p, obj, &CONFIG_KEYS)?;
    let acc_path = "config.accuracy_thresholds.";
    let acc = state_dict(
        func,
        acc_path,
        &item(&d, "accuracy_thresholds")?,
        &["easy", "medium"],
    )?;
    let interval = item(&d, "target_update_interval")?;
    let interval = if interval.is_instance_of::<pyo3::types::PyBool>() {
        None
    } else {
        interval.extract::<u64>().ok()
    }
    .ok_or_else(|| {
        value_error(format!(
            "{func}: `config.target_update_interval` must be an int >= 1, got {}",
            interval.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })?;
    let config = DifficultyConfig {
        accuracy_thresholds: AccuracyThresholds {
            easy: get_f64(func, acc_path, &acc, "easy")?,
            medium: get_f64(func, acc_path, &acc, "medium")?,
        },
        target_momentum: get_f64(func, p, &d, "target_momentum")?,
        target_scale: bucket_floats(func, p, &d, "target_scale")?,
        target_update_interval: interval,
        alpha_init: bucket_floats(func, p, &d, "alpha_init")?,
        alpha_lr: get_f64(func, p, &d, "alpha_lr")?,
        alpha_min: get_f64(func, p, &d, "alpha_min")?,
        alpha_max: get_f64(func, p, &d, "alpha_max")?,
        lambda_init: bucket_floats(func, p, &d, "lambda_init")?,
        kl_budget: bucket_floats(func, p, &d, "kl_budget")?,
        lambda_lr: get_f64(func, p, &d, "lambda_lr")?,
        lambda_max: get_f64(func, p, &d, "lambda_max")?,
    };
    config.validate().map_err(|e| key_err(func, p, e))?;
    Ok(config)
}

// ---------------------------------------------------------------------------------------------
// τ.

/// The global HWE threshold τ, an exponential moving average of the batch candidates m
/// (docs/algorithms.md §1): `τ ← m` at the first update, then `τ ← ρ·τ + (1 − ρ)·m`, clamped
/// to `[min(τ, m), max(τ, m)]`. The τ that counts a step's HWE tokens is the one from before
/// that step's update; without a bootstrap, call `update` with the first batch's m first.
///
/// `ThresholdEma(rho=0.99, tau=None)`; state: `{"rho": float, "tau": float | None}`.
#[pyclass(module = "ares._ares")]
#[derive(Clone)]
pub struct ThresholdEma {
    inner: CoreEma<f64>,
}

#[pymethods]
impl ThresholdEma {
    #[new]
    #[pyo3(signature = (rho=DEFAULT_EMA_RHO, tau=None))]
    fn new(rho: f64, tau: Option<f64>) -> PyResult<Self> {
        const FUNC: &str = "ThresholdEma";
        let mut inner = CoreEma::new(rho).map_err(|e| core_err(FUNC, e))?;
        inner.restore(tau).map_err(|e| core_err(FUNC, e))?;
        Ok(ThresholdEma { inner })
    }

    /// The factor ρ.
    #[getter]
    fn rho(&self) -> f64 {
        self.inner.rho()
    }

    /// The current τ (`None` before the first update or restore).
    #[getter]
    fn tau(&self) -> Option<f64> {
        self.inner.tau()
    }

    /// Folds the batch candidate `m` in; returns the new τ. A non-finite `m` is a
    /// ValueError and leaves τ unchanged.
    fn update(&mut self, m: f64) -> PyResult<f64> {
        self.inner
            .update(m)
            .map_err(|e| core_err("ThresholdEma.update", e))
    }

    /// Sets τ directly (bootstrap pass or checkpoint); `None` forgets it.
    #[pyo3(signature = (tau))]
    fn restore(&mut self, tau: Option<f64>) -> PyResult<()> {
        self.inner
            .restore(tau)
            .map_err(|e| core_err("ThresholdEma.restore", e))
    }

    /// `{"rho": ρ, "tau": τ or None}`.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("rho", self.inner.rho())?;
        d.set_item("tau", self.inner.tau())?;
        Ok(d)
    }

    /// Resumes from `state_dict()`'s output (every key checked; nothing changes on error).
    fn load_state_dict(&mut self, state: &Bound<'_, PyAny>) -> PyResult<()> {
        const FUNC: &str = "ThresholdEma.load_state_dict";
        let d = state_dict(FUNC, "", state, &["rho", "tau"])?;
        let rho = get_f64(FUNC, "", &d, "rho")?;
        let tau = get_opt_f64(FUNC, "", &d, "tau")?;
        let mut inner = CoreEma::new(rho).map_err(|e| key_err(FUNC, "", e))?;
        inner.restore(tau).map_err(|e| key_err(FUNC, "", e))?;
        self.inner = inner;
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "ThresholdEma(rho={:?}, tau={})",
            self.inner.rho(),
            py_opt(self.inner.tau())
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Buckets: T_d, α_d, λ_d.

/// The ARES difficulty controller (docs/algorithms.md §2): per bucket d ∈ {easy, medium,
/// hard} the target HWE count `T_d`, the entropy-reward coefficient `α_d` and the KL
/// coefficient `λ_d`, plus the last bucket of every prompt by global id.
///
/// - bootstrap: `T_d = round(h̄_d)` (round half to even);
/// - α (against the target in force during the step): `Δ_d = h̄_d − T_d` (easy, medium) or
///   `T_d − h̄_d` (hard), `α_d ← clip(α_d + alpha_lr·Δ_d, alpha_min, alpha_max)`;
/// - target, every `target_update_interval` steps:
///   `T_d ← round((1 − μ)·T_d + μ·s_d·h̄_d)`; a bucket without a target gets `round(h̄_d)`;
/// - λ (dual ascent on the KL budget ε_d):
///   `λ_d ← min(λ_max, max(0, λ_d + η·(KL_d − ε_d)))`.
///
/// Keyword arguments override the defaults (per-bucket values take a float, a dict by
/// bucket name or a sequence (easy, medium, hard)): `accuracy_thresholds` (easy 2/3, medium
/// 1/3; a dict or a pair), `target_momentum` 1, `target_scale` 1, `target_update_interval`
/// 1, `alpha_init` 0.5, `alpha_lr` 0.05, `alpha_min` 0, `alpha_max` 2, `lambda_init`
/// (0.002, 0.001, 0.0005), `kl_budget` (0.05, 0.1, 0.2), `lambda_lr` 0.01, `lambda_max` 10.
///
/// State: `{"config": {...}, "buckets": {"easy": {"target", "alpha", "lambda"}, ...},
/// "difficulty": {global_id: bucket name}}`.
#[pyclass(module = "ares._ares", subclass)]
#[derive(Clone)]
pub struct BucketController {
    inner: CoreBuckets<f64>,
    difficulty: BTreeMap<String, Difficulty>,
}

impl BucketController {
    fn state_of(&self, py: Python<'_>, pick: fn(&BucketState<f64>) -> f64) -> PyResult<Py<PyDict>> {
        let s = self.inner.state();
        Ok(bucket_dict(
            py,
            &PerBucket::new(pick(&s.easy), pick(&s.medium), pick(&s.hard)),
        )?
        .unbind())
    }
}

#[pymethods]
impl BucketController {
    #[new]
    #[pyo3(signature = (*, accuracy_thresholds=None, target_momentum=None, target_scale=None,
        target_update_interval=None, alpha_init=None, alpha_lr=None, alpha_min=None,
        alpha_max=None, lambda_init=None, kl_budget=None, lambda_lr=None, lambda_max=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        accuracy_thresholds: Option<&Bound<'_, PyAny>>,
        target_momentum: Option<f64>,
        target_scale: Option<&Bound<'_, PyAny>>,
        target_update_interval: Option<u64>,
        alpha_init: Option<&Bound<'_, PyAny>>,
        alpha_lr: Option<f64>,
        alpha_min: Option<f64>,
        alpha_max: Option<f64>,
        lambda_init: Option<&Bound<'_, PyAny>>,
        kl_budget: Option<&Bound<'_, PyAny>>,
        lambda_lr: Option<f64>,
        lambda_max: Option<f64>,
    ) -> PyResult<Self> {
        const FUNC: &str = "BucketController";
        let mut c = DifficultyConfig::<f64>::default();
        if let Some(a) = accuracy_thresholds {
            let (easy, medium) = if let Ok(d) = a.cast::<PyDict>() {
                let d = state_dict(
                    FUNC,
                    "accuracy_thresholds.",
                    d.as_any(),
                    &["easy", "medium"],
                )?;
                (
                    get_f64(FUNC, "accuracy_thresholds.", &d, "easy")?,
                    get_f64(FUNC, "accuracy_thresholds.", &d, "medium")?,
                )
            } else {
                a.extract::<(f64, f64)>().map_err(|_| {
                    value_error(format!(
                        "{FUNC}: `accuracy_thresholds` must be a dict {{\"easy\", \"medium\"}} or \
                         a pair (easy, medium)"
                    ))
                })?
            };
            c.accuracy_thresholds = AccuracyThresholds { easy, medium };
        }
        let set = |slot: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut c.target_momentum, target_momentum);
        set(&mut c.alpha_lr, alpha_lr);
        set(&mut c.alpha_min, alpha_min);
        set(&mut c.alpha_max, alpha_max);
        set(&mut c.lambda_lr, lambda_lr);
        set(&mut c.lambda_max, lambda_max);
        if let Some(i) = target_update_interval {
            c.target_update_interval = i;
        }
        for (slot, obj, name) in [
            (&mut c.target_scale, target_scale, "target_scale"),
            (&mut c.alpha_init, alpha_init, "alpha_init"),
            (&mut c.lambda_init, lambda_init, "lambda_init"),
            (&mut c.kl_budget, kl_budget, "kl_budget"),
        ] {
            if let Some(o) = obj {
                *slot = per_bucket(FUNC, name, o)?;
            }
        }
        let inner = CoreBuckets::new(c).map_err(|e| core_err(FUNC, e))?;
        Ok(BucketController {
            inner,
            difficulty: BTreeMap::new(),
        })
    }

    /// The configuration, as in `state_dict()["config"]`.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        config_dict(py, self.inner.config())
    }

    /// `T_d` by bucket name (`None` before the bootstrap or the bucket's first update).
    #[getter]
    fn targets<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.state();
        bucket_dict(
            py,
            &PerBucket::new(s.easy.target, s.medium.target, s.hard.target),
        )
    }

    /// `α_d` by bucket name.
    #[getter]
    fn alphas(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        self.state_of(py, |s| s.alpha)
    }

    /// `λ_d` by bucket name.
    #[getter]
    fn lambdas(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        self.state_of(py, |s| s.lambda)
    }

    /// `T_d` of `bucket` (name or index).
    fn target(&self, bucket: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
        Ok(self
            .inner
            .target(bucket_of("BucketController.target", "bucket", bucket)?))
    }

    /// `α_d` of `bucket`.
    fn alpha(&self, bucket: &Bound<'_, PyAny>) -> PyResult<f64> {
        Ok(self
            .inner
            .alpha(bucket_of("BucketController.alpha", "bucket", bucket)?))
    }

    /// `λ_d` of `bucket`.
    #[pyo3(name = "lambda_")]
    fn lambda(&self, bucket: &Bound<'_, PyAny>) -> PyResult<f64> {
        Ok(self
            .inner
            .lambda(bucket_of("BucketController.lambda_", "bucket", bucket)?))
    }

    /// Bootstrap: `T_d = round(h̄_d)` for every bucket with a mean in `mean_hwe` (a dict
    /// by bucket name or a sequence of 3 with `None` for no mean).
    fn bootstrap(&mut self, mean_hwe: &Bound<'_, PyAny>) -> PyResult<()> {
        const FUNC: &str = "BucketController.bootstrap";
        let m = opt_per_bucket(FUNC, "mean_hwe", Some(mean_hwe))?;
        self.inner.bootstrap(&m).map_err(|e| core_err(FUNC, e))
    }

    /// One step of every bucket present: a bucket with a mean HWE count in `mean_hwe` gets
    /// α then its target updated, one with a mean per-sequence KL in `mean_kl` its λ (dicts
    /// by bucket name or sequences of 3 with `None`). All inputs are checked before anything
    /// changes.
    #[pyo3(signature = (mean_hwe=None, mean_kl=None, *, step))]
    fn step(
        &mut self,
        mean_hwe: Option<&Bound<'_, PyAny>>,
        mean_kl: Option<&Bound<'_, PyAny>>,
        step: u64,
    ) -> PyResult<()> {
        const FUNC: &str = "BucketController.step";
        let h = opt_per_bucket(FUNC, "mean_hwe", mean_hwe)?;
        let k = opt_per_bucket(FUNC, "mean_kl", mean_kl)?;
        self.inner.step(&h, &k, step).map_err(|e| core_err(FUNC, e))
    }

    /// The whole update of one bucket in step `step`: α against the target in force, then
    /// the target, then λ when `mean_kl` is given.
    #[pyo3(signature = (bucket, mean_hwe, mean_kl=None, *, step))]
    fn step_bucket(
        &mut self,
        bucket: &Bound<'_, PyAny>,
        mean_hwe: f64,
        mean_kl: Option<f64>,
        step: u64,
    ) -> PyResult<()> {
        const FUNC: &str = "BucketController.step_bucket";
        let d = bucket_of(FUNC, "bucket", bucket)?;
        self.inner
            .step_bucket(d, mean_hwe, mean_kl, step)
            .map_err(|e| core_err(FUNC, e))
    }

    /// Adaptive α alone; returns the new α.
    fn update_alpha(&mut self, bucket: &Bound<'_, PyAny>, mean_hwe: f64) -> PyResult<f64> {
        const FUNC: &str = "BucketController.update_alpha";
        let d = bucket_of(FUNC, "bucket", bucket)?;
        self.inner
            .update_alpha(d, mean_hwe)
            .map_err(|e| core_err(FUNC, e))
    }

    /// The target update alone at step `step`; returns whether the target was written.
    #[pyo3(signature = (bucket, mean_hwe, *, step))]
    fn update_target(
        &mut self,
        bucket: &Bound<'_, PyAny>,
        mean_hwe: f64,
        step: u64,
    ) -> PyResult<bool> {
        const FUNC: &str = "BucketController.update_target";
        let d = bucket_of(FUNC, "bucket", bucket)?;
        self.inner
            .update_target(d, mean_hwe, step)
            .map_err(|e| core_err(FUNC, e))
    }

    /// Dual ascent on λ alone; returns the new λ.
    fn update_lambda(&mut self, bucket: &Bound<'_, PyAny>, mean_kl: f64) -> PyResult<f64> {
        const FUNC: &str = "BucketController.update_lambda";
        let d = bucket_of(FUNC, "bucket", bucket)?;
        self.inner
            .update_lambda(d, mean_kl)
            .map_err(|e| core_err(FUNC, e))
    }

    /// The bucket of every group from per-sample correctness (`correct`: numpy bool [B];
    /// groups by `n` or `uid`) with the configured accuracy thresholds: group accuracy
    /// ≥ easy → 0 (easy), ≥ medium → 1 (medium), else 2 (hard). Returns int64 [B], the
    /// bucket of each sample's group. With `global_id` (one key per sample, as str) the
    /// buckets are also remembered in `difficulty`.
    #[pyo3(signature = (correct, n=None, uid=None, *, global_id=None))]
    fn classify<'py>(
        &mut self,
        py: Python<'py>,
        correct: &Bound<'py, PyAny>,
        n: Option<i64>,
        uid: Option<&Bound<'py, PyAny>>,
        global_id: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        const FUNC: &str = "BucketController.classify";
        let c = BoolInput::new(FUNC, "correct", correct)?;
        let batch = c.slice().len();
        let ids: Option<Vec<String>> = match global_id {
            None => None,
            Some(g) => {
                let v: Vec<String> = g
                    .try_iter()
                    .and_then(|it| {
                        it.map(|x| x.and_then(|x| Ok(x.str()?.to_string())))
                            .collect()
                    })
                    .map_err(|_| {
                        value_error(format!("{FUNC}: `global_id` must be a sequence of keys"))
                    })?;
                if v.len() != batch {
                    return Err(value_error(format!(
                        "{FUNC}: `global_id` has {} elements, expected {batch} (one per sample)",
                        v.len()
                    )));
                }
                Some(v)
            }
        };
        let spec = GroupSpec::new(FUNC, n, uid, batch)?;
        let thresholds = self.inner.config().accuracy_thresholds;
        let cs = c.slice();
        let per_row = spec.run(py, FUNC, batch, move |g: &Groups<'_>| {
            let mut per_group = vec![Difficulty::Hard; g.count()];
            classify_groups(cs, g, &thresholds, &mut per_group)?;
            let mut rows = vec![0i64; batch];
            for (grp, d) in per_group.iter().enumerate() {
                for row in g.rows_of(grp) {
                    if let Some(slot) = rows.get_mut(row) {
                        *slot = d.index() as i64;
                    }
                }
            }
            Ok(rows)
        })?;
        if let Some(ids) = ids {
            for (id, &b) in ids.into_iter().zip(&per_row) {
                if let Some(d) = Difficulty::from_index(b as usize) {
                    self.difficulty.insert(id, d);
                }
            }
        }
        Ok(PyArray1::from_vec(py, per_row))
    }

    /// The last bucket of every prompt seen by `classify(..., global_id=...)` or
    /// `set_difficulty`, by global id.
    #[getter]
    fn difficulty<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in &self.difficulty {
            d.set_item(k, v.name())?;
        }
        Ok(d)
    }

    /// Records the bucket of the prompt `global_id`.
    fn set_difficulty(&mut self, global_id: &str, bucket: &Bound<'_, PyAny>) -> PyResult<()> {
        let d = bucket_of("BucketController.set_difficulty", "bucket", bucket)?;
        self.difficulty.insert(global_id.to_string(), d);
        Ok(())
    }

    /// The whole state: configuration, the three buckets and the difficulty by global id.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("config", config_dict(py, self.inner.config())?)?;
        let buckets = PyDict::new(py);
        for (b, s) in self.inner.state().iter() {
            let one = PyDict::new(py);
            one.set_item("target", s.target)?;
            one.set_item("alpha", s.alpha)?;
            one.set_item("lambda", s.lambda)?;
            buckets.set_item(b.name(), one)?;
        }
        d.set_item("buckets", buckets)?;
        d.set_item("difficulty", self.difficulty(py)?)?;
        Ok(d)
    }

    /// Resumes from `state_dict()`'s output: every key is checked (configuration, targets
    /// finite and ≥ 0, α in [alpha_min, alpha_max], λ in [0, lambda_max], bucket names);
    /// nothing changes on error.
    fn load_state_dict(&mut self, state: &Bound<'_, PyAny>) -> PyResult<()> {
        const FUNC: &str = "BucketController.load_state_dict";
        let d = state_dict(FUNC, "", state, &["config", "buckets", "difficulty"])?;
        let config = config_of(FUNC, &item(&d, "config")?)?;
        let buckets = state_dict(FUNC, "buckets.", &item(&d, "buckets")?, &BUCKET_NAMES)?;
        let mut states = PerBucket::splat(BucketState {
            target: None,
            alpha: 0.0,
            lambda: 0.0,
        });
        for b in Difficulty::ALL {
            let path = format!("buckets.{}.", b.name());
            let one = state_dict(
                FUNC,
                &path,
                &item(&buckets, b.name())?,
                &["target", "alpha", "lambda"],
            )?;
            let s = BucketState {
                target: get_opt_f64(FUNC, &path, &one, "target")?,
                alpha: get_f64(FUNC, &path, &one, "alpha")?,
                lambda: get_f64(FUNC, &path, &one, "lambda")?,
            };
            CoreBuckets::with_state(config, PerBucket::splat(s))
                .map_err(|e| key_err(FUNC, &path, e))?;
            states[b] = s;
        }
        let inner = CoreBuckets::with_state(config, states).map_err(|e| core_err(FUNC, e))?;
        let diff_obj = item(&d, "difficulty")?;
        let diff = diff_obj.cast::<PyDict>().map_err(|_| {
            value_error(format!(
                "{FUNC}: `difficulty` must be a dict {{global_id: bucket name}}, got {}",
                type_name(&diff_obj)
            ))
        })?;
        let mut difficulty = BTreeMap::new();
        for (k, v) in diff.iter() {
            let id: String = k.str()?.to_string();
            let b = bucket_of(FUNC, &format!("difficulty[{id:?}]"), &v)?;
            difficulty.insert(id, b);
        }
        self.inner = inner;
        self.difficulty = difficulty;
        Ok(())
    }

    fn __repr__(&self) -> String {
        let s = self.inner.state();
        format!(
            "BucketController(targets=({}, {}, {}), alphas=({:?}, {:?}, {:?}), \
             lambdas=({:?}, {:?}, {:?}), prompts={})",
            py_opt(s.easy.target),
            py_opt(s.medium.target),
            py_opt(s.hard.target),
            s.easy.alpha,
            s.medium.alpha,
            s.hard.alpha,
            s.easy.lambda,
            s.medium.lambda,
            s.hard.lambda,
            self.difficulty.len()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// β.

/// The adaptive KL controller (Ziegler et al.; verl's `AdaptiveKLController`): after a step
/// with observed KL and N samples, `e = clip(KL/target − 1, −0.2, 0.2)`,
/// `β ← β·(1 + e·N/horizon)`.
///
/// `AdaptiveKlController(init_kl_coef, target=0.1, horizon=10000)`; state:
/// `{"kl_coef": β, "target": float, "horizon": float}`.
#[pyclass(module = "ares._ares")]
#[derive(Clone)]
pub struct AdaptiveKlController {
    inner: CoreKl<f64>,
}

#[pymethods]
impl AdaptiveKlController {
    #[new]
    #[pyo3(signature = (init_kl_coef, target=ADAPTIVE_KL_TARGET, horizon=ADAPTIVE_KL_HORIZON))]
    fn new(init_kl_coef: f64, target: f64, horizon: f64) -> PyResult<Self> {
        let inner = CoreKl::new(init_kl_coef, target, horizon)
            .map_err(|e| core_err("AdaptiveKlController", e))?;
        Ok(AdaptiveKlController { inner })
    }

    /// The current β.
    #[getter]
    fn value(&self) -> f64 {
        self.inner.value()
    }

    /// The target KL.
    #[getter]
    fn target(&self) -> f64 {
        self.inner.target()
    }

    /// The horizon in samples.
    #[getter]
    fn horizon(&self) -> f64 {
        self.inner.horizon()
    }

    /// One update from the step's observed KL and its number of samples; returns the new
    /// β (unchanged on error: non-finite KL, `0.2·n_samples/horizon ≥ 1`, overflow).
    fn update(&mut self, current_kl: f64, n_samples: usize) -> PyResult<f64> {
        self.inner
            .update(current_kl, n_samples)
            .map_err(|e| core_err("AdaptiveKlController.update", e))
    }

    /// `{"kl_coef": β, "target": …, "horizon": …}`.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("kl_coef", self.inner.value())?;
        d.set_item("target", self.inner.target())?;
        d.set_item("horizon", self.inner.horizon())?;
        Ok(d)
    }

    /// Resumes from `state_dict()`'s output (β finite and ≥ 0, target and horizon > 0).
    fn load_state_dict(&mut self, state: &Bound<'_, PyAny>) -> PyResult<()> {
        const FUNC: &str = "AdaptiveKlController.load_state_dict";
        let d = state_dict(FUNC, "", state, &["kl_coef", "target", "horizon"])?;
        let (b, t, h) = (
            get_f64(FUNC, "", &d, "kl_coef")?,
            get_f64(FUNC, "", &d, "target")?,
            get_f64(FUNC, "", &d, "horizon")?,
        );
        let inner = CoreKl::new(b, t, h).map_err(|e| match e {
            Error::OutOfRange {
                what,
                value,
                expected,
            } => {
                let key = match what {
                    "init_kl_coef" => "kl_coef",
                    "kl_target" => "target",
                    "kl_horizon" => "horizon",
                    other => other,
                };
                value_error(format!(
                    "{FUNC}: `{key}` = {value} is out of range: expected {expected}"
                ))
            }
            other => core_err(FUNC, other),
        })?;
        self.inner = inner;
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "AdaptiveKlController(kl_coef={:?}, target={:?}, horizon={:?})",
            self.inner.value(),
            self.inner.target(),
            self.inner.horizon()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The entropy bonus's coefficient.

/// The target-entropy controller of the entropy bonus's coefficient c
/// (docs/algorithms.md §16.2): once per optimizer step, from the step's mean token entropy
/// H̄, `c ← clamp(c + lr·(target − H̄), min, max)`.
///
/// `EntropyCoefController(coef=0, target=0.2, lr=1e-3, min=0, max=5e-3)`; state (the keys
/// are verl-style config names): `{"entropy_coeff", "target_entropy", "entropy_coeff_lr",
/// "entropy_coeff_min", "entropy_coeff_max"}`.
#[pyclass(module = "ares._ares")]
#[derive(Clone)]
pub struct EntropyCoefController {
    inner: CoreEntropyCoef<f64>,
}

#[pymethods]
impl EntropyCoefController {
    #[new]
    #[pyo3(signature = (coef=0.0, target=DEFAULT_TARGET_ENTROPY, lr=DEFAULT_ENTROPY_COEFF_LR,
        min=0.0, max=DEFAULT_ENTROPY_COEFF_MAX))]
    fn new(coef: f64, target: f64, lr: f64, min: f64, max: f64) -> PyResult<Self> {
        let inner = CoreEntropyCoef::new(coef, target, lr, min, max)
            .map_err(|e| core_err("EntropyCoefController", e))?;
        Ok(EntropyCoefController { inner })
    }

    /// The current coefficient c (the coefficient of the next step's bonus).
    #[getter]
    fn coef(&self) -> f64 {
        self.inner.coef
    }

    /// The target mean token entropy (nats).
    #[getter]
    fn target(&self) -> f64 {
        self.inner.target
    }

    /// Folds one step's mean token entropy in; returns the new c (unchanged on error).
    fn update(&mut self, mean_entropy: f64) -> PyResult<f64> {
        self.inner
            .update(mean_entropy)
            .map_err(|e| core_err("EntropyCoefController.update", e))
    }

    /// The coefficient and the configuration, under verl-style names.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let c = &self.inner;
        d.set_item("entropy_coeff", c.coef)?;
        d.set_item("target_entropy", c.target)?;
        d.set_item("entropy_coeff_lr", c.lr)?;
        d.set_item("entropy_coeff_min", c.min)?;
        d.set_item("entropy_coeff_max", c.max)?;
        Ok(d)
    }

    /// Resumes from `state_dict()`'s output (all finite; target, lr, min ≥ 0; max ≥ min;
    /// coefficient in [min, max]).
    fn load_state_dict(&mut self, state: &Bound<'_, PyAny>) -> PyResult<()> {
        const FUNC: &str = "EntropyCoefController.load_state_dict";
        let keys = [
            "entropy_coeff",
            "target_entropy",
            "entropy_coeff_lr",
            "entropy_coeff_min",
            "entropy_coeff_max",
        ];
        let d = state_dict(FUNC, "", state, &keys)?;
        let mut next = CoreEntropyCoef {
            coef: 0.0,
            target: get_f64(FUNC, "", &d, "target_entropy")?,
            lr: get_f64(FUNC, "", &d, "entropy_coeff_lr")?,
            min: get_f64(FUNC, "", &d, "entropy_coeff_min")?,
            max: get_f64(FUNC, "", &d, "entropy_coeff_max")?,
        };
        let coef = get_f64(FUNC, "", &d, "entropy_coeff")?;
        next.coef = next.min;
        next.validate().map_err(|e| key_err(FUNC, "", e))?;
        next.restore(EntropyCoefState { coef })
            .map_err(|e| key_err(FUNC, "", e))?;
        self.inner = next;
        Ok(())
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "EntropyCoefController(coef={:?}, target={:?}, lr={:?}, min={:?}, max={:?})",
            c.coef, c.target, c.lr, c.min, c.max
        )
    }
}

// ---------------------------------------------------------------------------------------------
// GRPO-λ.

/// Runs GRPO-λ over a batch; returns the output dict.
#[allow(clippy::too_many_arguments)]
fn run_grpo_lambda<'py, F: Real>(
    py: Python<'py>,
    func: &str,
    params: CoreGrpoLambda<f64>,
    c: &BoolInput<'py>,
    lengths: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let batch = c.slice().len();
    let l = Input::<F>::new(func, "lengths", lengths, 1)?;
    if l.shape()[0] != batch {
        return Err(value_error(format!(
            "{func}: `lengths` has {} elements, expected {batch} (one per element of `correct`)",
            l.shape()[0]
        )));
    }
    let spec = GroupSpec::new(func, n, uid, batch)?;
    let out = Output::<F>::new(py, &[batch]);
    let params = CoreGrpoLambda::<F> {
        lambda_: cast(params.lambda_),
        alpha: cast(params.alpha),
    };
    let (top, order, k) = {
        let mut w = out.write()?;
        let rewards = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let (cs, ls) = (c.slice(), l.slice());
        spec.run(py, func, batch, move |g: &Groups<'_>| {
            let mut order = vec![0usize; g.count()];
            let mut top = vec![false; g.count()];
            let k = length::grpo_lambda_rewards(g, cs, ls, &params, &mut order, &mut top, rewards)?;
            Ok((top, order, k))
        })?
    };
    let d = PyDict::new(py);
    d.set_item("rewards", out.array)?;
    d.set_item("top", PyArray1::from_vec(py, top))?;
    d.set_item(
        "order",
        PyArray1::from_vec(py, order.into_iter().map(|g| g as i64).collect()),
    )?;
    d.set_item("top_count", k)?;
    Ok(d)
}

/// GRPO-λ over `correct` and `lengths` with the dtype of `lengths`.
#[allow(clippy::too_many_arguments)]
fn grpo_lambda<'py>(
    py: Python<'py>,
    func: &str,
    params: CoreGrpoLambda<f64>,
    correct: &Bound<'py, PyAny>,
    lengths: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    params.validate().map_err(|e| core_err(func, e))?;
    let c = BoolInput::new(func, "correct", correct)?;
    match float_dtype(func, "lengths", lengths)? {
        Dtype::F32 => run_grpo_lambda::<f32>(py, func, params, &c, lengths, n, uid),
        Dtype::F64 => run_grpo_lambda::<f64>(py, func, params, &c, lengths, n, uid),
    }
}

/// GRPO-λ rewards (docs/algorithms.md §8): the groups are ranked by accuracy `c_k`
/// (descending, ties in batch order) and the first `min(G, max(1, ⌈λ·G⌉))` get the length
/// penalty: a correct sample gets `1 − α·sigmoid((L − mean_c)/std_c)` over the group's
/// correct lengths (z = 0, so `1 − α/2`, for a single correct sample or equal lengths), an
/// incorrect one 0; a top group without a correct sample and every other group get 0/1.
///
/// correct: numpy bool [B]; lengths: float32/float64 [B] (response lengths in tokens,
/// ≥ 0); groups by `n` or `uid` (groups are numbered in order of first appearance). Returns
/// a dict: `rewards` ([B], the dtype of `lengths`), `top` (bool [G]), `order` (int64 [G],
/// groups best first), `top_count` (int). Spec vector 12: one group of 4 correct samples
/// with lengths (100, 200, 300, 400), λ = 0.2, α = 0.6 → (0.8756558, 0.7659859, 0.6340141,
/// 0.5243442).
#[pyfunction]
#[pyo3(signature = (correct, lengths, n=None, uid=None, *, lambda_=0.2, alpha=0.6))]
fn grpo_lambda_rewards<'py>(
    py: Python<'py>,
    correct: &Bound<'py, PyAny>,
    lengths: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
    lambda_: f64,
    alpha: f64,
) -> PyResult<Bound<'py, PyDict>> {
    let params = CoreGrpoLambda { lambda_, alpha };
    grpo_lambda(py, "grpo_lambda_rewards", params, correct, lengths, n, uid)
}

/// GRPO-λ's parameters as an object: `GrpoLambda(lambda_=0.2, alpha=0.6)`; `rewards(correct,
/// lengths, n=None, uid=None)` is `grpo_lambda_rewards` with them. It has no changing state;
/// `state_dict()` is `{"lambda_": λ, "alpha": α}` for symmetry with the controllers.
#[pyclass(module = "ares._ares", subclass)]
#[derive(Clone)]
pub struct GrpoLambda {
    inner: CoreGrpoLambda<f64>,
}

#[pymethods]
impl GrpoLambda {
    #[new]
    #[pyo3(signature = (lambda_=0.2, alpha=0.6))]
    fn new(lambda_: f64, alpha: f64) -> PyResult<Self> {
        let inner = CoreGrpoLambda { lambda_, alpha };
        inner.validate().map_err(|e| core_err("GrpoLambda", e))?;
        Ok(GrpoLambda { inner })
    }

    /// λ, the fraction of groups that get the length penalty.
    #[getter]
    fn lambda_(&self) -> f64 {
        self.inner.lambda_
    }

    /// α, the length-penalty strength.
    #[getter]
    fn alpha(&self) -> f64 {
        self.inner.alpha
    }

    /// The number of top groups of a batch of `groups` groups: `min(G, max(1, ⌈λ·G⌉))`.
    fn top_group_count(&self, groups: usize) -> PyResult<usize> {
        length::top_group_count(self.inner.lambda_, groups)
            .map_err(|e| core_err("GrpoLambda.top_group_count", e))
    }

    /// `grpo_lambda_rewards` with these parameters.
    #[pyo3(signature = (correct, lengths, n=None, uid=None))]
    fn rewards<'py>(
        &self,
        py: Python<'py>,
        correct: &Bound<'py, PyAny>,
        lengths: &Bound<'py, PyAny>,
        n: Option<i64>,
        uid: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        grpo_lambda(
            py,
            "GrpoLambda.rewards",
            self.inner,
            correct,
            lengths,
            n,
            uid,
        )
    }

    /// `{"lambda_": λ, "alpha": α}`.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("lambda_", self.inner.lambda_)?;
        d.set_item("alpha", self.inner.alpha)?;
        Ok(d)
    }

    /// Sets λ and α from `state_dict()`'s output (both in [0, 1]).
    fn load_state_dict(&mut self, state: &Bound<'_, PyAny>) -> PyResult<()> {
        const FUNC: &str = "GrpoLambda.load_state_dict";
        let d = state_dict(FUNC, "", state, &["lambda_", "alpha"])?;
        let next = CoreGrpoLambda {
            lambda_: get_f64(FUNC, "", &d, "lambda_")?,
            alpha: get_f64(FUNC, "", &d, "alpha")?,
        };
        next.validate().map_err(|e| key_err(FUNC, "", e))?;
        self.inner = next;
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "GrpoLambda(lambda_={:?}, alpha={:?})",
            self.inner.lambda_, self.inner.alpha
        )
    }
}
