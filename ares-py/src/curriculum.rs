//! What decides which prompts and samples a step trains on: online group filtering and
//! `drop_solved` (ares-core's `filter`), per-bucket means (`difficulty::bucket_means`), the
//! batch's HWE threshold candidate (`entropy::batch_median_threshold`), and the graded rubric
//! prompt with its reward (`rubric`).

use crate::args::by_dtype;
use crate::args::{BoolInput, GroupSpec, Input, core_err, float_dtype, value_error};
use crate::controllers::bucket_of;
use ares_core::difficulty::{self, Difficulty};
use ares_core::filter::{self, FilterParams};
use ares_core::rubric::{
    self, DEFAULT_AVOID_HEADER, DEFAULT_BASE, DEFAULT_CLOSING, DEFAULT_HIDE_INSTRUCTION,
    DEFAULT_INCLUDE_HEADER, DEFAULT_INTRO, GradedSchedule, Reveal, RevealRule, RubricPrompt,
    StepRule,
};
use ares_core::{Error, Groups};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

/// Registers every function of this file in the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(group_means, m)?)?;
    m.add_function(wrap_pyfunction!(filter_groups, m)?)?;
    m.add_function(wrap_pyfunction!(expand_keep, m)?)?;
    m.add_function(wrap_pyfunction!(solved_streak, m)?)?;
    m.add_function(wrap_pyfunction!(is_solved, m)?)?;
    m.add_function(wrap_pyfunction!(bucket_means, m)?)?;
    m.add_function(wrap_pyfunction!(batch_median_threshold, m)?)?;
    m.add_function(wrap_pyfunction!(reveal_ratio, m)?)?;
    m.add_function(wrap_pyfunction!(step_factor, m)?)?;
    m.add_function(wrap_pyfunction!(reveal_count, m)?)?;
    m.add_function(wrap_pyfunction!(select_criteria, m)?)?;
    m.add_function(wrap_pyfunction!(rubric_message, m)?)?;
    m.add_function(wrap_pyfunction!(rubric_score, m)?)?;
    m.add("RUBRIC_INTRO", DEFAULT_INTRO)?;
    m.add("RUBRIC_INCLUDE_HEADER", DEFAULT_INCLUDE_HEADER)?;
    m.add("RUBRIC_AVOID_HEADER", DEFAULT_AVOID_HEADER)?;
    m.add("RUBRIC_CLOSING", DEFAULT_CLOSING)?;
    m.add("RUBRIC_HIDE_INSTRUCTION", DEFAULT_HIDE_INSTRUCTION)?;
    m.add("RUBRIC_BASE", DEFAULT_BASE)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Online filtering (docs/algorithms.md §7).

/// Per-group mean of a per-sample metric (the filter key: accuracy, overall reward, …):
/// `means[g] = (1/n_g) Σ_{i in g} values[i]`.
///
/// values: float32/float64 [B]; groups by `n` (consecutive groups of n rows) or `uid` (one key
/// per row; group g is the g-th distinct uid in order of first appearance, sizes may differ).
/// Returns [G] with the dtype of `values`. Example: values (1,1,1,1, 0,0,0,0, 1,0,1,0,
/// 0,0,1,0), n = 4 → (1, 0, 0.5, 0.25).
#[pyfunction]
#[pyo3(signature = (values, n=None, uid=None))]
fn group_means<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "group_means";
    by_dtype!(float_dtype(FUNC, "values", values)?, F => {
        let v = Input::<F>::new(FUNC, "values", values, 1)?;
        let batch = v.shape()[0];
        let spec = GroupSpec::new(FUNC, n, uid, batch)?;
        let vs = v.slice();
        let means = spec.run(py, FUNC, batch, move |g: &Groups<'_>| {
            let mut means = vec![F::default(); g.count()];
            filter::group_means(g, vs, &mut means)?;
            Ok(means)
        })?;
        Ok(PyArray1::from_vec(py, means).into_any())
    })
}

/// The online filter: group g is kept iff `filter_low < mean_g < filter_high` (strict), with
/// `mean_g` as in `group_means`. The defaults 0.01 / 0.99 drop the all-wrong and all-correct
/// groups of a 0/1 accuracy (they carry no GRPO signal).
///
/// values: float32/float64 [B]; groups by `n` or `uid`. Returns `(keep, kept)`: keep is bool
/// [G], kept the number of kept groups. `expand_keep` turns keep into a row mask.
#[pyfunction]
#[pyo3(signature = (values, n=None, uid=None, *, filter_low=0.01, filter_high=0.99))]
fn filter_groups<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
    filter_low: f64,
    filter_high: f64,
) -> PyResult<(Bound<'py, PyAny>, usize)> {
    const FUNC: &str = "filter_groups";
    by_dtype!(float_dtype(FUNC, "values", values)?, F => {
        let v = Input::<F>::new(FUNC, "values", values, 1)?;
        let batch = v.shape()[0];
        let params = FilterParams::<F> {
            filter_low: crate::args::cast(filter_low),
            filter_high: crate::args::cast(filter_high),
        };
        // the bounds are checked in f64 first, so an f32 rounding cannot hide a bad value
        FilterParams { filter_low, filter_high }.validate().map_err(|e| core_err(FUNC, e))?;
        let spec = GroupSpec::new(FUNC, n, uid, batch)?;
        let vs = v.slice();
        let (keep, kept) = spec.run(py, FUNC, batch, move |g: &Groups<'_>| {
            let mut keep = vec![false; g.count()];
            let kept = filter::filter_groups(g, vs, &params, &mut keep)?;
            Ok((keep, kept))
        })?;
        Ok((PyArray1::from_vec(py, keep).into_any(), kept))
    })
}

/// Group keep flags to rows: `keep_rows[i] = keep_groups[group of row i]`, so kept groups
/// stay whole under any layout.
///
/// keep_groups: bool [G]; groups by `n` (then B = G·n) or `uid` (B = len(uid); group g is
/// the g-th distinct uid in order of first appearance, as in `filter_groups`). Returns
/// `(keep_rows, kept_rows)`: bool [B] and the number of kept rows.
#[pyfunction]
#[pyo3(signature = (keep_groups, n=None, uid=None))]
fn expand_keep<'py>(
    py: Python<'py>,
    keep_groups: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, usize)> {
    const FUNC: &str = "expand_keep";
    let k = BoolInput::new(FUNC, "keep_groups", keep_groups)?;
    let ks = k.slice();
    let batch = match (n, uid) {
        (Some(n), None) if n >= 0 => ks
            .len()
            .checked_mul(n as usize)
            .ok_or_else(|| value_error(format!("{FUNC}: `n` = {n} is out of range")))?,
        (_, Some(u)) => u.len().map_err(|_| {
            value_error(format!(
                "{FUNC}: `uid` must be a 1-D array or sequence of hashable keys"
            ))
        })?,
        _ => 0,
    };
    let spec = GroupSpec::new(FUNC, n, uid, batch)?;
    let (rows, kept) = spec.run(py, FUNC, batch, move |g: &Groups<'_>| {
        let mut rows = vec![false; batch];
        let kept = filter::expand_keep(g, ks, &mut rows)?;
        Ok((rows, kept))
    })?;
    Ok((PyArray1::from_vec(py, rows).into_any(), kept))
}

/// `drop_solved` bookkeeping for one visit of a prompt: the number of consecutive visits on
/// which it was solved, "solved" meaning all its samples correct **and** the mean token
/// entropy of its responses strictly below `entropy_threshold` (default 0.3):
/// `prev_streak + 1` if solved, else 0. Returns an int; store it per prompt (e.g. by
/// global_id) and drop the prompt once `is_solved(streak, k)`.
#[pyfunction]
#[pyo3(signature = (prev_streak, all_correct, mean_entropy, entropy_threshold=0.3))]
fn solved_streak(
    prev_streak: u32,
    all_correct: bool,
    mean_entropy: f64,
    entropy_threshold: f64,
) -> PyResult<u32> {
    filter::solved_streak(prev_streak, all_correct, mean_entropy, entropy_threshold)
        .map_err(|e| core_err("solved_streak", e))
}

/// Whether a prompt with `streak` consecutive solved visits leaves the training set:
/// `k > 0 and streak >= k` (k = 3 by default in the trainer; k = 0 never drops).
#[pyfunction]
#[pyo3(signature = (streak, k=3))]
fn is_solved(streak: u32, k: u32) -> bool {
    filter::is_solved(streak, k)
}

/// Per-bucket means of `values` (e.g. per-prompt mean HWE counts → h̄_d for
/// `BucketController.step`, or per-sample KL → KL_d): `difficulty[i]` is the bucket of
/// `values[i]` (0/1/2 or "easy"/"medium"/"hard"). Returns `{"easy": mean or None, "medium":
/// …, "hard": …}` (None for a bucket without entries), which `BucketController.step` takes.
#[pyfunction]
#[pyo3(signature = (difficulty, values))]
fn bucket_means<'py>(
    py: Python<'py>,
    difficulty: &Bound<'py, PyAny>,
    values: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    const FUNC: &str = "bucket_means";
    let iter = difficulty.try_iter().map_err(|_| {
        value_error(format!(
            "{FUNC}: `difficulty` must be a 1-D array or sequence of bucket names / indices"
        ))
    })?;
    let mut ds: Vec<Difficulty> = Vec::new();
    for item in iter {
        let item = item?;
        let item =
            if item.extract::<String>().is_err() && !item.is_instance_of::<pyo3::types::PyBool>() {
                item.call_method0("__index__").unwrap_or(item)
            } else {
                item
            };
        ds.push(bucket_of(FUNC, "difficulty", &item)?);
    }
    let means: [Option<f64>; 3] = by_dtype!(float_dtype(FUNC, "values", values)?, F => {
        let v = Input::<F>::new(FUNC, "values", values, 1)?;
        let m = difficulty::bucket_means(&ds, v.slice()).map_err(|e| core_err(FUNC, e))?;
        [Difficulty::Easy, Difficulty::Medium, Difficulty::Hard]
            .map(|d| (*m.get(d)).map(crate::args::f64_of))
    });
    let d = PyDict::new(py);
    for (name, mean) in ["easy", "medium", "hard"].into_iter().zip(means) {
        d.set_item(name, mean)?;
    }
    Ok(d)
}

/// The batch's candidate `m` for the global HWE threshold τ (docs/algorithms.md §1): the
/// median of the per-response thresholds that exist (`has = 1`), as `row_percentile` returns
/// them. Returns a float, or None when no response has a complete window (keep the old τ).
/// Feed it to `ThresholdEma.update`. Example: thresholds (0.5, 9, 1.5, 0.7), has (1, 0, 1, 1)
/// → 0.7.
#[pyfunction]
#[pyo3(signature = (threshold, has))]
fn batch_median_threshold(
    threshold: &Bound<'_, PyAny>,
    has: &Bound<'_, PyAny>,
) -> PyResult<Option<f64>> {
    const FUNC: &str = "batch_median_threshold";
    by_dtype!(float_dtype(FUNC, "threshold", threshold)?, F => {
        let t = Input::<F>::new(FUNC, "threshold", threshold, 1)?;
        let h = Input::<F>::new(FUNC, "has", has, 1)?;
        let mut scratch = vec![F::default(); t.shape()[0]];
        ares_core::entropy::batch_median_threshold(t.slice(), h.slice(), &mut scratch)
            .map(|m| m.map(crate::args::f64_of))
            .map_err(|e| core_err(FUNC, e))
    })
}

// ---------------------------------------------------------------------------------------------
// Graded rubric prompt (docs/algorithms.md §9).

/// The graded schedule of a schedule name, as the trainer's `graded_prompt.schedule`:
/// `linear` (no step decay), `binary`, `step_linear`, `step_power`, `step_sigmoid` (the step
/// rules multiply the linear in-group ratio).
fn schedule_of(
    func: &str,
    schedule: &str,
    full_reveal_count: usize,
    power: f64,
    start_point: f64,
    steepness: f64,
) -> PyResult<GradedSchedule<f64>> {
    let linear = RevealRule::Linear;
    let (reveal, step) = match schedule {
        "linear" => (linear, StepRule::Constant),
        "binary" => (RevealRule::Binary { full_reveal_count }, StepRule::Constant),
        "step_linear" => (linear, StepRule::StepLinear),
        "step_power" => (linear, StepRule::StepPower { power }),
        "step_sigmoid" => (
            linear,
            StepRule::StepSigmoid {
                start_point,
                steepness,
            },
        ),
        other => {
            return Err(value_error(format!(
                "{func}: `schedule` = {other:?} is not one of \"linear\", \"binary\", \
                 \"step_linear\", \"step_power\", \"step_sigmoid\""
            )));
        }
    };
    Ok(GradedSchedule { reveal, step })
}

/// The reveal ratio of sample `k` (0-based) of `n` at training step `step` (1-based) of
/// `total_steps`: the in-group ratio times the step factor. In-group: `linear`
/// `(n−1−k)/(n−1)`; `binary` 1 for `k < full_reveal_count`, else 0. Step factor (see
/// `step_factor`) for `step_linear` / `step_power` / `step_sigmoid`; 1 for `linear` and
/// `binary`. Example: k = 1 of n = 8 at step 6 of 11, step_linear: (6/7)·0.5 = 3/7.
#[pyfunction]
#[pyo3(signature = (k, n, *, step=1, total_steps=1, schedule="linear", full_reveal_count=1,
    power=1.0, start_point=0.3, steepness=10.0))]
#[allow(clippy::too_many_arguments)]
fn reveal_ratio(
    k: usize,
    n: usize,
    step: u64,
    total_steps: u64,
    schedule: &str,
    full_reveal_count: usize,
    power: f64,
    start_point: f64,
    steepness: f64,
) -> PyResult<f64> {
    const FUNC: &str = "reveal_ratio";
    let s = schedule_of(
        FUNC,
        schedule,
        full_reveal_count,
        power,
        start_point,
        steepness,
    )?;
    s.ratio(k, n, step, total_steps)
        .map_err(|e| core_err(FUNC, e))
}

/// The step factor `s ∈ [0, 1]` at training step `step` (1-based) of `total_steps`, with
/// `x = clip((step − 1)/(T − 1), 0, 1)` (T ≤ 1: s = 1): `step_linear` `1 − x`; `step_power`
/// `(1 − x)^power`; `step_sigmoid` `1/(1 + e^{(x − start_point)·steepness})`; `linear`,
/// `binary` 1. Example (T = 11): step_sigmoid at step 1 → 0.9525741, step 4 → 0.5.
#[pyfunction]
#[pyo3(signature = (step, total_steps, schedule="step_linear", *, power=1.0, start_point=0.3,
    steepness=10.0))]
fn step_factor(
    step: u64,
    total_steps: u64,
    schedule: &str,
    power: f64,
    start_point: f64,
    steepness: f64,
) -> PyResult<f64> {
    const FUNC: &str = "step_factor";
    let s = schedule_of(FUNC, schedule, 1, power, start_point, steepness)?;
    rubric::step_factor(&s.step, step, total_steps).map_err(|e| core_err(FUNC, e))
}

/// How many of `criteria` rubric criteria sample `k` of `n` sees at `step` of `total_steps`
/// (schedule arguments as `reveal_ratio`). Returns `(count, all)`: `all` is True when the
/// ratio is ≥ 1 (every criterion, in the original order); else `count = round_half_even(N ·
/// ratio)` clamped to [0, N] (no "at least one" rule), computed in integers for the plain
/// linear rule so a .5 case cannot flip. Example: n = 5, N = 5, k = 2 → (2, False).
#[pyfunction]
#[pyo3(signature = (k, n, criteria, *, step=1, total_steps=1, schedule="linear",
    full_reveal_count=1, power=1.0, start_point=0.3, steepness=10.0))]
#[allow(clippy::too_many_arguments)]
fn reveal_count(
    k: usize,
    n: usize,
    criteria: usize,
    step: u64,
    total_steps: u64,
    schedule: &str,
    full_reveal_count: usize,
    power: f64,
    start_point: f64,
    steepness: f64,
) -> PyResult<(usize, bool)> {
    const FUNC: &str = "reveal_count";
    let s = schedule_of(
        FUNC,
        schedule,
        full_reveal_count,
        power,
        start_point,
        steepness,
    )?;
    let r = s
        .reveal(k, n, step, total_steps, criteria)
        .map_err(|e| core_err(FUNC, e))?;
    Ok((r.count(criteria), r == Reveal::All))
}

/// The criteria a sample sees: with `all=True`, `[0, 1, …, total − 1]` (the original order,
/// no random draw); else a uniformly random subset of `count` of them in random order
/// (partial Fisher–Yates with rejection sampling), drawn from ChaCha8 seeded with `seed`
/// (`ChaCha8Rng::seed_from_u64`, the generator the ares trainer uses; it derives `seed` from
/// its run seed, the step, k and the prompt's global_id). Returns a list of indices.
#[pyfunction]
#[pyo3(signature = (count, total, seed, *, all=false))]
fn select_criteria(count: usize, total: usize, seed: u64, all: bool) -> PyResult<Vec<usize>> {
    const FUNC: &str = "select_criteria";
    let reveal = if all {
        Reveal::All
    } else {
        Reveal::Subset(count)
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut draw = || rng.next_u64();
    let mut shown = vec![0usize; total];
    let c = rubric::select_criteria(reveal, total, &mut draw, &mut shown)
        .map_err(|e| core_err(FUNC, e))?;
    shown.truncate(c);
    Ok(shown)
}

/// The graded system message for the criteria `shown` (indices into `criteria`, in display
/// order). `criteria` is a sequence of `(text, points)` pairs. Layout (RuscaRL's): the intro
/// line; "IMPORTANT POINTS TO INCLUDE" with `Criterion i: text (worth p points)` for positive
/// points; "IMPORTANT POINTS TO AVOID" with `Criterion i: text (penalty: |p| points)` for
/// negative ones (numbered from 1 per section; integral points without a fraction); the
/// closing request; the instruction to keep the criteria hidden (`hide_instruction=True`).
/// Zero-point criteria are left out. Returns the message, or None when no criterion is
/// printed (with `add_base_when_zero=True`: the base message "You are a helpful assistant.").
#[pyfunction]
#[pyo3(signature = (criteria, shown, *, hide_instruction=true, add_base_when_zero=false,
    intro=None, include_header=None, avoid_header=None, closing=None, base=None))]
#[allow(clippy::too_many_arguments)]
fn rubric_message(
    criteria: &Bound<'_, PyAny>,
    shown: Vec<usize>,
    hide_instruction: bool,
    add_base_when_zero: bool,
    intro: Option<String>,
    include_header: Option<String>,
    avoid_header: Option<String>,
    closing: Option<String>,
    base: Option<String>,
) -> PyResult<Option<String>> {
    const FUNC: &str = "rubric_message";
    let pairs: Vec<(String, f64)> = criteria.extract().map_err(|_| {
        value_error(format!(
            "{FUNC}: `criteria` must be a sequence of (text, points) pairs"
        ))
    })?;
    let refs: Vec<(&str, f64)> = pairs.iter().map(|(t, p)| (t.as_str(), *p)).collect();
    let prompt = RubricPrompt {
        intro: intro.as_deref().unwrap_or(DEFAULT_INTRO),
        include_header: include_header.as_deref().unwrap_or(DEFAULT_INCLUDE_HEADER),
        avoid_header: avoid_header.as_deref().unwrap_or(DEFAULT_AVOID_HEADER),
        closing: closing.as_deref().unwrap_or(DEFAULT_CLOSING),
        hide_instruction: hide_instruction.then_some(DEFAULT_HIDE_INSTRUCTION),
        base: base.as_deref().unwrap_or(DEFAULT_BASE),
        add_base_when_zero,
    };
    let mut message = String::new();
    let written = rubric::write_rubric_message(&refs, &shown, &prompt, &mut message)
        .map_err(|e| core_err(FUNC, e))?;
    Ok(written.then_some(message))
}

/// The rubric reward `Σ points of met criteria / Σ positive points` (met negative criteria
/// subtract; not clipped, so it lies in `[Σ negative / Σ positive, 1]`).
///
/// points: float32/float64 [C] (or a sequence of floats); met: numpy bool [C] (or a sequence
/// of bools). Returns a float. Example: points (8, 6, −2), met (T, F, T) → 6/14 = 0.4285714.
#[pyfunction]
#[pyo3(signature = (points, met))]
fn rubric_score(points: &Bound<'_, PyAny>, met: &Bound<'_, PyAny>) -> PyResult<f64> {
    const FUNC: &str = "rubric_score";
    let met: Vec<bool> = match BoolInput::new(FUNC, "met", met) {
        Ok(b) => b.slice().to_vec(),
        Err(e) => {
            if met.cast::<numpy::PyUntypedArray>().is_ok() {
                return Err(e);
            }
            met.extract().map_err(|_| {
                value_error(format!(
                    "{FUNC}: `met` must be a numpy bool array or a sequence of bools"
                ))
            })?
        }
    };
    if points.cast::<numpy::PyUntypedArray>().is_ok() {
        return by_dtype!(float_dtype(FUNC, "points", points)?, F => {
            let p = Input::<F>::new(FUNC, "points", points, 1)?;
            rubric::rubric_score(p.slice(), &met)
                .map(crate::args::f64_of)
                .map_err(|e| core_err(FUNC, e))
        });
    }
    let p: Vec<f64> = points.extract().map_err(|_| {
        value_error(format!(
            "{FUNC}: `points` must be a float array or a sequence of floats"
        ))
    })?;
    rubric::rubric_score(&p, &met).map_err(|e: Error| core_err(FUNC, e))
}
