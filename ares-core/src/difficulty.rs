//! Difficulty buckets, per-bucket HWE targets, adaptive entropy coefficients α and
//! dual-ascent KL coefficients λ (docs/algorithms.md §2).
//!
//! Each prompt is put in a bucket (easy / medium / hard) from its accuracy over its `n`
//! samples. Each bucket `d` carries a state `(T_d, α_d, λ_d)`:
//!
//! - `T_d`, the target number of HWE tokens per response (the reasoning budget), set by the
//!   bootstrap pass to `round(h̄_d)` and moved toward `s_d·h̄_d` with momentum `μ` every
//!   `target_update_interval` steps;
//! - `α_d`, the entropy-reward coefficient, moved by gradient ascent toward the target:
//!   `Δ_d = h̄_d − T_d` (easy, medium) or `T_d − h̄_d` (hard), `α_d ← clip(α_d + lr_α·Δ_d)`;
//! - `λ_d`, the bucket's KL coefficient, by dual ascent on a KL budget `ε_d`:
//!   `λ_d ← min(λ_max, max(0, λ_d + η·(KL_d − ε_d)))`.
//!
//! `h̄_d` is the mean over the bucket's prompts of their mean HWE count ([`bucket_means`]).
//! "Round" is round-half-to-even ([`crate::round_half_even`]).

use crate::error::{Error, Result};
use crate::groups::Groups;
use crate::num::{cast, check_finite, check_len, check_param, round_half_even};
use core::fmt;
use core::ops::{Index, IndexMut};
use num_traits::Float;

/// A prompt's difficulty bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Difficulty {
    /// Accuracy ≥ 2/3 (by default): the model mostly solves it; shaping trims reasoning.
    Easy,
    /// Accuracy in [1/3, 2/3): shaping keeps the reasoning near its target.
    Medium,
    /// Accuracy < 1/3: shaping rewards exploration.
    Hard,
}

impl Difficulty {
    /// The three buckets in index order (easy, medium, hard).
    pub const ALL: [Difficulty; 3] = [Difficulty::Easy, Difficulty::Medium, Difficulty::Hard];

    /// `"easy"`, `"medium"` or `"hard"` (the labels of docs/algorithms.md §2).
    pub const fn name(self) -> &'static str {
        match self {
            Difficulty::Easy => "easy",
            Difficulty::Medium => "medium",
            Difficulty::Hard => "hard",
        }
    }

    /// 0, 1 or 2 (easy, medium, hard).
    pub const fn index(self) -> usize {
        match self {
            Difficulty::Easy => 0,
            Difficulty::Medium => 1,
            Difficulty::Hard => 2,
        }
    }

    /// The bucket with [`Difficulty::index`] `index`, `None` for `index > 2`.
    pub const fn from_index(index: usize) -> Option<Self> {
        match index {
            0 => Some(Difficulty::Easy),
            1 => Some(Difficulty::Medium),
            2 => Some(Difficulty::Hard),
            _ => None,
        }
    }

    /// The bucket named `name` (ASCII case-insensitive: `"easy"`, `"Medium"`, …).
    pub fn from_name(name: &str) -> Option<Self> {
        Difficulty::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(name))
    }

    /// The bucket of a prompt with `correct` right answers out of `n` samples, in exact
    /// integer arithmetic with the default thresholds: easy iff `3·correct ≥ 2·n`
    /// (acc ≥ 2/3), medium iff `3·correct ≥ n` (acc ≥ 1/3), else hard. For `n = 8`: 6–8
    /// correct easy, 3–5 medium, 0–2 hard.
    ///
    /// Errors: `n == 0` ([`Error::Empty`] on `"n (samples)"`); `correct > n`
    /// ([`Error::OutOfRange`] on `"correct"`).
    pub fn from_counts(correct: usize, n: usize) -> Result<Self> {
        if n == 0 {
            return Err(Error::Empty {
                what: "n (samples)",
            });
        }
        if correct > n {
            return Err(Error::OutOfRange {
                what: "correct",
                value: correct as f64,
                expected: "<= n (the number of samples)",
            });
        }
        // u128: the products cannot overflow
        let (c, n) = (correct as u128, n as u128);
        Ok(if 3 * c >= 2 * n {
            Difficulty::Easy
        } else if 3 * c >= n {
            Difficulty::Medium
        } else {
            Difficulty::Hard
        })
    }

    /// The bucket of an accuracy in `[0, 1]` with the default thresholds (2/3, 1/3); see
    /// [`AccuracyThresholds::classify`]. Prefer [`Difficulty::from_counts`] when the counts
    /// are at hand: it is exact at the boundaries.
    ///
    /// Errors: `accuracy` NaN or outside `[0, 1]` ([`Error::OutOfRange`]).
    pub fn from_accuracy<F: Float>(accuracy: F) -> Result<Self> {
        AccuracyThresholds::default().classify(accuracy)
    }
}

impl fmt::Display for Difficulty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Accuracy thresholds of the buckets: easy iff `acc ≥ easy`, medium iff `acc ≥ medium`,
/// else hard. Defaults 2/3 and 1/3.
///
/// With the `serde` feature: a mapping `{easy, medium}`; a key left out keeps its default,
/// an unknown key is an error.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(
        deny_unknown_fields,
        default,
        bound(deserialize = "F: Float + serde::Deserialize<'de>")
    )
)]
pub struct AccuracyThresholds<F> {
    /// Lowest accuracy of an easy prompt (default 2/3).
    pub easy: F,
    /// Lowest accuracy of a medium prompt (default 1/3).
    pub medium: F,
}

impl<F: Float> Default for AccuracyThresholds<F> {
    fn default() -> Self {
        AccuracyThresholds {
            easy: cast(2.0 / 3.0),
            medium: cast(1.0 / 3.0),
        }
    }
}

impl<F: Float> AccuracyThresholds<F> {
    /// Errors unless `0 ≤ medium ≤ easy ≤ 1` ([`Error::OutOfRange`] naming the field).
    pub fn validate(&self) -> Result<()> {
        check_param(
            "accuracy_thresholds.medium",
            self.medium,
            self.medium >= F::zero() && self.medium <= F::one(),
            "in [0, 1]",
        )?;
        check_param(
            "accuracy_thresholds.easy",
            self.easy,
            self.easy >= self.medium && self.easy <= F::one(),
            "in [accuracy_thresholds.medium, 1]",
        )
    }

    /// The bucket of `accuracy`: easy iff `accuracy ≥ easy`, medium iff
    /// `accuracy ≥ medium`, else hard.
    ///
    /// Errors: invalid thresholds (see [`AccuracyThresholds::validate`]); `accuracy` NaN or
    /// outside `[0, 1]` ([`Error::OutOfRange`] on `"accuracy"`).
    pub fn classify(&self, accuracy: F) -> Result<Difficulty> {
        self.validate()?;
        check_param(
            "accuracy",
            accuracy,
            accuracy >= F::zero() && accuracy <= F::one(),
            "in [0, 1]",
        )?;
        Ok(if accuracy >= self.easy {
            Difficulty::Easy
        } else if accuracy >= self.medium {
            Difficulty::Medium
        } else {
            Difficulty::Hard
        })
    }
}

/// Buckets of every group from per-sample correctness: group `g`'s bucket is
/// `thresholds.classify(correct_g / n_g)` ([`AccuracyThresholds::classify`]) with `n_g` its
/// size. With the default thresholds this is [`Difficulty::from_counts`].
///
/// Errors: `correct` not of the batch size ([`Error::LengthMismatch`]); `out` not of
/// length `groups.count()` ([`Error::LengthMismatch`]); invalid thresholds.
pub fn classify_groups<F: Float>(
    correct: &[bool],
    groups: &Groups,
    thresholds: &AccuracyThresholds<F>,
    out: &mut [Difficulty],
) -> Result<()> {
    groups.check_batch("correct", correct.len())?;
    check_len("out (difficulty per group)", groups.count(), out.len())?;
    thresholds.validate()?;
    for (g, slot) in out.iter_mut().enumerate() {
        let right = groups
            .rows_of(g)
            .filter(|&row| correct.get(row).copied().unwrap_or(false))
            .count();
        let accuracy = cast::<F>(right as f64) / cast::<F>(groups.size(g).max(1) as f64);
        *slot = thresholds.classify(accuracy)?;
    }
    Ok(())
}

/// One value per bucket, indexable by [`Difficulty`].
///
/// With the `serde` feature: a mapping `{easy, medium, hard}` (the names of
/// [`Difficulty::name`]), all three required, an unknown key an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(deny_unknown_fields)
)]
pub struct PerBucket<T> {
    /// The easy bucket's value.
    pub easy: T,
    /// The medium bucket's value.
    pub medium: T,
    /// The hard bucket's value.
    pub hard: T,
}

impl<T> PerBucket<T> {
    /// `{ easy, medium, hard }`.
    pub const fn new(easy: T, medium: T, hard: T) -> Self {
        PerBucket { easy, medium, hard }
    }

    /// The value of bucket `d`.
    #[inline]
    pub fn get(&self, d: Difficulty) -> &T {
        match d {
            Difficulty::Easy => &self.easy,
            Difficulty::Medium => &self.medium,
            Difficulty::Hard => &self.hard,
        }
    }

    /// The value of bucket `d`, mutably.
    #[inline]
    pub fn get_mut(&mut self, d: Difficulty) -> &mut T {
        match d {
            Difficulty::Easy => &mut self.easy,
            Difficulty::Medium => &mut self.medium,
            Difficulty::Hard => &mut self.hard,
        }
    }

    /// Applies `f` to each value (easy, medium, hard in that order).
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> PerBucket<U> {
        PerBucket {
            easy: f(self.easy),
            medium: f(self.medium),
            hard: f(self.hard),
        }
    }

    /// Pairs the values of two per-bucket containers.
    pub fn zip<U>(self, other: PerBucket<U>) -> PerBucket<(T, U)> {
        PerBucket {
            easy: (self.easy, other.easy),
            medium: (self.medium, other.medium),
            hard: (self.hard, other.hard),
        }
    }

    /// `(bucket, &value)` for easy, medium, hard.
    pub fn iter(&self) -> impl Iterator<Item = (Difficulty, &T)> {
        [
            (Difficulty::Easy, &self.easy),
            (Difficulty::Medium, &self.medium),
            (Difficulty::Hard, &self.hard),
        ]
        .into_iter()
    }
}

impl<T: Clone> PerBucket<T> {
    /// The same value in every bucket.
    pub fn splat(value: T) -> Self {
        PerBucket {
            easy: value.clone(),
            medium: value.clone(),
            hard: value,
        }
    }
}

impl<T> Index<Difficulty> for PerBucket<T> {
    type Output = T;
    #[inline]
    fn index(&self, d: Difficulty) -> &T {
        self.get(d)
    }
}

impl<T> IndexMut<Difficulty> for PerBucket<T> {
    #[inline]
    fn index_mut(&mut self, d: Difficulty) -> &mut T {
        self.get_mut(d)
    }
}

/// Per-bucket means of `values` (e.g. the per-prompt mean HWE counts, giving `h̄_d`, or the
/// per-sample KL, giving `KL_d`): `None` for a bucket with no entry.
///
/// `difficulty[i]` is the bucket of `values[i]`. Summed in `F`, left to right. With equal
/// group sizes the mean over prompts of their mean HWE count equals the mean over all the
/// bucket's samples, so per-sample values with their prompt's bucket give the same `h̄_d`
/// up to rounding.
///
/// Errors: lengths differ ([`Error::LengthMismatch`] on `"values"`); a NaN/±∞ value
/// ([`Error::NonFinite`]).
pub fn bucket_means<F: Float>(
    difficulty: &[Difficulty],
    values: &[F],
) -> Result<PerBucket<Option<F>>> {
    check_len("values", difficulty.len(), values.len())?;
    check_finite("values", values)?;
    let mut sums = PerBucket::splat((F::zero(), 0usize));
    for (&d, &x) in difficulty.iter().zip(values) {
        let (s, n) = sums.get_mut(d);
        *s = *s + x;
        *n += 1;
    }
    Ok(sums.map(|(s, n)| {
        if n == 0 {
            None
        } else {
            Some(s / cast(n as f64))
        }
    }))
}

/// The configuration of the difficulty controller, with the spec defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DifficultyConfig<F> {
    /// Bucket thresholds on accuracy (default 2/3, 1/3).
    pub accuracy_thresholds: AccuracyThresholds<F>,
    /// Target momentum `μ` in `[0, 1]` (default 1: the target jumps to `s_d·h̄_d`).
    pub target_momentum: F,
    /// Target scale `s_d` ≥ 0 per bucket (default 1).
    pub target_scale: PerBucket<F>,
    /// Update the targets every this many steps, ≥ 1 (default 1).
    pub target_update_interval: u64,
    /// Initial `α_d`, in `[alpha_min, alpha_max]` (default 0.5).
    pub alpha_init: PerBucket<F>,
    /// Step size `lr_α` ≥ 0 of the α ascent (default 0.05).
    pub alpha_lr: F,
    /// Lower clip of α (default 0).
    pub alpha_min: F,
    /// Upper clip of α, ≥ `alpha_min` (default 2).
    pub alpha_max: F,
    /// Initial `λ_d`, in `[0, lambda_max]` (default easy 0.002, medium 0.001, hard 0.0005).
    pub lambda_init: PerBucket<F>,
    /// KL budgets `ε_d` ≥ 0 (default easy 0.05, medium 0.1, hard 0.2).
    pub kl_budget: PerBucket<F>,
    /// Dual step size `η` ≥ 0 (default 0.01).
    pub lambda_lr: F,
    /// Upper clip `λ_max` ≥ 0 of every `λ_d` (default 10).
    pub lambda_max: F,
}

impl<F: Float> Default for DifficultyConfig<F> {
    fn default() -> Self {
        DifficultyConfig {
            accuracy_thresholds: AccuracyThresholds::default(),
            target_momentum: F::one(),
            target_scale: PerBucket::splat(F::one()),
            target_update_interval: 1,
            alpha_init: PerBucket::splat(cast(0.5)),
            alpha_lr: cast(0.05),
            alpha_min: F::zero(),
            alpha_max: cast(2.0),
            lambda_init: PerBucket::new(cast(0.002), cast(0.001), cast(0.0005)),
            kl_budget: PerBucket::new(cast(0.05), cast(0.1), cast(0.2)),
            lambda_lr: cast(0.01),
            lambda_max: cast(10.0),
        }
    }
}

/// Errors at the first bucket whose value is not finite or fails `ok`; `names` are the
/// field's per-bucket names (`"kl_budget.easy"`, …).
fn check_buckets<F: Float>(
    names: [&'static str; 3],
    values: &PerBucket<F>,
    ok: impl Fn(F) -> bool,
    expected: &'static str,
) -> Result<()> {
    for ((_, &v), name) in values.iter().zip(names) {
        check_param(name, v, ok(v), expected)?;
    }
    Ok(())
}

impl<F: Float> DifficultyConfig<F> {
    /// Checks every field; the error names the first bad one ([`Error::OutOfRange`]).
    pub fn validate(&self) -> Result<()> {
        let zero = F::zero();
        self.accuracy_thresholds.validate()?;
        let mu = self.target_momentum;
        check_param(
            "target_momentum",
            mu,
            mu >= zero && mu <= F::one(),
            "in [0, 1]",
        )?;
        check_buckets(
            [
                "target_scale.easy",
                "target_scale.medium",
                "target_scale.hard",
            ],
            &self.target_scale,
            |s| s >= zero,
            "finite and >= 0",
        )?;
        if self.target_update_interval == 0 {
            return Err(Error::OutOfRange {
                what: "target_update_interval",
                value: 0.0,
                expected: ">= 1",
            });
        }
        check_param("alpha_lr", self.alpha_lr, self.alpha_lr >= zero, ">= 0")?;
        check_param("alpha_min", self.alpha_min, true, "finite")?;
        check_param(
            "alpha_max",
            self.alpha_max,
            self.alpha_max >= self.alpha_min,
            "finite and >= alpha_min",
        )?;
        let (lo, hi) = (self.alpha_min, self.alpha_max);
        check_buckets(
            ["alpha_init.easy", "alpha_init.medium", "alpha_init.hard"],
            &self.alpha_init,
            |a| a >= lo && a <= hi,
            "in [alpha_min, alpha_max]",
        )?;
        check_param(
            "lambda_max",
            self.lambda_max,
            self.lambda_max >= zero,
            "finite and >= 0",
        )?;
        let lambda_max = self.lambda_max;
        check_buckets(
            ["lambda_init.easy", "lambda_init.medium", "lambda_init.hard"],
            &self.lambda_init,
            |l| l >= zero && l <= lambda_max,
            "in [0, lambda_max]",
        )?;
        check_buckets(
            ["kl_budget.easy", "kl_budget.medium", "kl_budget.hard"],
            &self.kl_budget,
            |e| e >= zero,
            "finite and >= 0",
        )?;
        check_param(
            "lambda_lr",
            self.lambda_lr,
            self.lambda_lr >= zero,
            "finite and >= 0",
        )
    }
}

/// One bucket's adaptive state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketState<F> {
    /// `T_d`, the target HWE count (a whole number ≥ 0); `None` before the bootstrap or the
    /// first update of this bucket.
    pub target: Option<F>,
    /// `α_d`, the entropy-reward coefficient.
    pub alpha: F,
    /// `λ_d`, the bucket's KL coefficient.
    pub lambda: F,
}

/// The per-bucket controller: a validated [`DifficultyConfig`] and the three
/// [`BucketState`]s. Every update validates its inputs and computes the new values before
/// writing any, so an error leaves the state unchanged.
///
/// ## Order within a step (a decision the spec leaves open)
/// For a bucket present in a step, [`BucketController::step_bucket`] updates **α first,
/// against the target that was in force during the step** (the pre-update `T_d`), then the
/// target, then λ. With the default `μ = 1`, updating the target first would set
/// `T_d = round(h̄_d)` and leave `Δ_d ≈ 0`, so α would never move — defeating the
/// gradient ascent toward the target (docs/algorithms.md §2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketController<F> {
    config: DifficultyConfig<F>,
    state: PerBucket<BucketState<F>>,
}

/// Errors unless a mean HWE count is finite and ≥ 0.
fn check_mean_hwe<F: Float>(mean_hwe: F) -> Result<()> {
    check_param(
        "mean_hwe (h̄_d)",
        mean_hwe,
        mean_hwe >= F::zero(),
        "finite and >= 0",
    )
}

/// Errors unless a restored target is finite and ≥ 0.
fn check_target<F: Float>(what: &'static str, target: Option<F>) -> Result<()> {
    match target {
        Some(t) => check_param(what, t, t >= F::zero(), "finite and >= 0"),
        None => Ok(()),
    }
}

impl<F: Float> BucketController<F> {
    /// A controller with no targets yet, `α_d = alpha_init`, `λ_d = lambda_init`.
    ///
    /// Errors: an invalid `config` ([`DifficultyConfig::validate`]).
    pub fn new(config: DifficultyConfig<F>) -> Result<Self> {
        config.validate()?;
        let state = config
            .alpha_init
            .zip(config.lambda_init)
            .map(|(alpha, lambda)| BucketState {
                target: None,
                alpha,
                lambda,
            });
        Ok(BucketController { config, state })
    }

    /// A controller resumed from a saved state (checkpoint).
    ///
    /// Errors: an invalid `config`; a target not finite or negative, α outside
    /// `[alpha_min, alpha_max]`, or λ outside `[0, lambda_max]` ([`Error::OutOfRange`]).
    pub fn with_state(
        config: DifficultyConfig<F>,
        state: PerBucket<BucketState<F>>,
    ) -> Result<Self> {
        config.validate()?;
        for (_, s) in state.iter() {
            check_target("state.target", s.target)?;
            check_param(
                "state.alpha",
                s.alpha,
                s.alpha >= config.alpha_min && s.alpha <= config.alpha_max,
                "in [alpha_min, alpha_max]",
            )?;
            check_param(
                "state.lambda",
                s.lambda,
                s.lambda >= F::zero() && s.lambda <= config.lambda_max,
                "in [0, lambda_max]",
            )?;
        }
        Ok(BucketController { config, state })
    }

    /// The (validated) configuration.
    #[inline]
    pub fn config(&self) -> &DifficultyConfig<F> {
        &self.config
    }

    /// The three bucket states (to save in a checkpoint).
    #[inline]
    pub fn state(&self) -> &PerBucket<BucketState<F>> {
        &self.state
    }

    /// `T_d`, `None` before the bootstrap or the bucket's first update.
    #[inline]
    pub fn target(&self, d: Difficulty) -> Option<F> {
        self.state[d].target
    }

    /// `α_d`.
    #[inline]
    pub fn alpha(&self, d: Difficulty) -> F {
        self.state[d].alpha
    }

    /// `λ_d`, the bucket's KL coefficient.
    #[inline]
    pub fn lambda(&self, d: Difficulty) -> F {
        self.state[d].lambda
    }

    /// Bootstrap: `T_d = round(h̄_d)` for every bucket with a mean (`None` leaves the
    /// bucket's target as it is).
    ///
    /// Errors: a mean not finite or negative ([`Error::OutOfRange`]); nothing changes then.
    pub fn bootstrap(&mut self, mean_hwe: &PerBucket<Option<F>>) -> Result<()> {
        for (_, m) in mean_hwe.iter() {
            if let Some(m) = *m {
                check_mean_hwe(m)?;
            }
        }
        for (d, m) in mean_hwe.iter() {
            if let Some(m) = *m {
                self.state[d].target = Some(round_half_even(m));
            }
        }
        Ok(())
    }

    /// The α that [`BucketController::update_alpha`] would set (no change without a
    /// target).
    fn next_alpha(&self, d: Difficulty, mean_hwe: F) -> F {
        let s = &self.state[d];
        match s.target {
            None => s.alpha,
            Some(target) => {
                let delta = match d {
                    Difficulty::Easy | Difficulty::Medium => mean_hwe - target,
                    Difficulty::Hard => target - mean_hwe,
                };
                let alpha = s.alpha + self.config.alpha_lr * delta;
                // ±∞ from an overflowing step clips to the bounds
                alpha.max(self.config.alpha_min).min(self.config.alpha_max)
            }
        }
    }

    /// The target that [`BucketController::update_target`] would set, `None` when this
    /// step is not an update step.
    fn next_target(&self, d: Difficulty, mean_hwe: F, step: u64) -> Result<Option<F>> {
        let s = &self.state[d];
        let next = match s.target {
            // first sight of the bucket without bootstrap: this step is its bootstrap
            None => round_half_even(mean_hwe),
            Some(_) if step % self.config.target_update_interval != 0 => return Ok(None),
            Some(target) => {
                let mu = self.config.target_momentum;
                let goal = self.config.target_scale[d] * mean_hwe;
                round_half_even((F::one() - mu) * target + mu * goal)
            }
        };
        check_param("target (T_d)", next, true, "finite (s_d·h̄_d overflowed)")?;
        Ok(Some(next))
    }

    /// The λ that [`BucketController::update_lambda`] would set.
    fn next_lambda(&self, d: Difficulty, mean_kl: F) -> F {
        let lambda =
            self.state[d].lambda + self.config.lambda_lr * (mean_kl - self.config.kl_budget[d]);
        lambda.max(F::zero()).min(self.config.lambda_max)
    }

    /// Adaptive α: with `Δ_d = h̄_d − T_d` (easy, medium) or `T_d − h̄_d` (hard),
    /// `α_d ← clip(α_d + lr_α·Δ_d, alpha_min, alpha_max)`; returns the new α. Without a
    /// target (no bootstrap yet) α is unchanged.
    ///
    /// Errors: `mean_hwe` not finite or negative ([`Error::OutOfRange`]).
    pub fn update_alpha(&mut self, d: Difficulty, mean_hwe: F) -> Result<F> {
        check_mean_hwe(mean_hwe)?;
        let alpha = self.next_alpha(d, mean_hwe);
        self.state[d].alpha = alpha;
        Ok(alpha)
    }

    /// Target update at global step `step`: when `step % target_update_interval == 0`,
    /// `T_d ← round((1−μ)·T_d + μ·s_d·h̄_d)`. A bucket with no target yet gets
    /// `T_d = round(h̄_d)` at once, whatever the step (the bootstrap formula). Returns whether
    /// the target was written.
    ///
    /// Errors: `mean_hwe` not finite or negative, or a new target that overflows
    /// ([`Error::OutOfRange`]); the target is then unchanged.
    pub fn update_target(&mut self, d: Difficulty, mean_hwe: F, step: u64) -> Result<bool> {
        check_mean_hwe(mean_hwe)?;
        match self.next_target(d, mean_hwe, step)? {
            Some(t) => {
                self.state[d].target = Some(t);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Dual ascent on the KL budget: `λ_d ← min(λ_max, max(0, λ_d + η·(KL_d − ε_d)))`, with
    /// `KL_d` the mean per-sequence KL of the bucket's samples this step; returns the new λ.
    ///
    /// Errors: `mean_kl` not finite ([`Error::OutOfRange`]).
    pub fn update_lambda(&mut self, d: Difficulty, mean_kl: F) -> Result<F> {
        check_param("mean_kl (KL_d)", mean_kl, true, "finite")?;
        let lambda = self.next_lambda(d, mean_kl);
        self.state[d].lambda = lambda;
        Ok(lambda)
    }

    /// The whole update of one bucket present in step `step`, in this order: α against the
    /// target in force during the step, then the target, then λ (when `mean_kl` is given;
    /// the KL of a step may come later, see [`BucketController::update_lambda`]).
    ///
    /// Errors: as the three updates; all inputs are checked before anything changes.
    pub fn step_bucket(
        &mut self,
        d: Difficulty,
        mean_hwe: F,
        mean_kl: Option<F>,
        step: u64,
    ) -> Result<()> {
        check_mean_hwe(mean_hwe)?;
        if let Some(kl) = mean_kl {
            check_param("mean_kl (KL_d)", kl, true, "finite")?;
        }
        let alpha = self.next_alpha(d, mean_hwe);
        let target = self.next_target(d, mean_hwe, step)?;
        let lambda = mean_kl.map(|kl| self.next_lambda(d, kl));
        let s = &mut self.state[d];
        s.alpha = alpha;
        if let Some(t) = target {
            s.target = Some(t);
        }
        if let Some(l) = lambda {
            s.lambda = l;
        }
        Ok(())
    }

    /// [`BucketController::step_bucket`] for every bucket present this step: a bucket with
    /// `mean_hwe = Some(h̄_d)` gets its α and target updated, one with `mean_kl = Some(KL_d)`
    /// its λ. Buckets absent from the step keep their state.
    ///
    /// Errors: as [`BucketController::step_bucket`]; all buckets' inputs are checked before
    /// anything changes.
    pub fn step(
        &mut self,
        mean_hwe: &PerBucket<Option<F>>,
        mean_kl: &PerBucket<Option<F>>,
        step: u64,
    ) -> Result<()> {
        let mut next = self.state;
        for d in Difficulty::ALL {
            if let Some(h) = mean_hwe[d] {
                check_mean_hwe(h)?;
                next[d].alpha = self.next_alpha(d, h);
                if let Some(t) = self.next_target(d, h, step)? {
                    next[d].target = Some(t);
                }
            }
            if let Some(kl) = mean_kl[d] {
                check_param("mean_kl (KL_d)", kl, true, "finite")?;
                next[d].lambda = self.next_lambda(d, kl);
            }
        }
        self.state = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buckets_for_n_8() {
        // 3·c ≥ 16 ⇔ c ≥ 6 easy; 3·c ≥ 8 ⇔ c ≥ 3 medium
        for c in 0..=8 {
            let want = match c {
                6..=8 => Difficulty::Easy,
                3..=5 => Difficulty::Medium,
                _ => Difficulty::Hard,
            };
            assert_eq!(Difficulty::from_counts(c, 8), Ok(want), "{c}/8");
            assert_eq!(Difficulty::from_accuracy(c as f64 / 8.0), Ok(want));
            assert_eq!(Difficulty::from_accuracy(c as f32 / 8.0), Ok(want));
        }
    }

    #[test]
    fn exact_boundaries() {
        // acc = 2/3 and 1/3 exactly
        for n in [3usize, 6, 9, 12, 30, 300] {
            assert_eq!(Difficulty::from_counts(2 * n / 3, n), Ok(Difficulty::Easy));
            assert_eq!(
                Difficulty::from_counts(2 * n / 3 - 1, n),
                Ok(Difficulty::Medium)
            );
            assert_eq!(Difficulty::from_counts(n / 3, n), Ok(Difficulty::Medium));
            assert_eq!(Difficulty::from_counts(n / 3 - 1, n), Ok(Difficulty::Hard));
            for c in 0..=n {
                let exact = Difficulty::from_counts(c, n).unwrap();
                assert_eq!(Difficulty::from_accuracy(c as f64 / n as f64), Ok(exact));
                assert_eq!(Difficulty::from_accuracy(c as f32 / n as f32), Ok(exact));
            }
        }
        assert_eq!(Difficulty::from_counts(1, 1), Ok(Difficulty::Easy));
        assert_eq!(Difficulty::from_counts(0, 1), Ok(Difficulty::Hard));
        assert_eq!(
            Difficulty::from_counts(usize::MAX, usize::MAX),
            Ok(Difficulty::Easy)
        );
    }

    #[test]
    fn names_and_indices() {
        for (i, d) in Difficulty::ALL.into_iter().enumerate() {
            assert_eq!(d.index(), i);
            assert_eq!(Difficulty::from_index(i), Some(d));
            assert_eq!(Difficulty::from_name(d.name()), Some(d));
        }
        assert_eq!(Difficulty::from_index(3), None);
        assert_eq!(Difficulty::from_name("HARD"), Some(Difficulty::Hard));
        assert_eq!(Difficulty::from_name("extreme"), None);
        assert_eq!(Difficulty::Medium.name(), "medium");
    }

    #[test]
    fn classification_errors() {
        assert_eq!(
            Difficulty::from_counts(0, 0),
            Err(Error::Empty {
                what: "n (samples)"
            })
        );
        assert!(matches!(
            Difficulty::from_counts(9, 8),
            Err(Error::OutOfRange {
                what: "correct",
                ..
            })
        ));
        for acc in [-0.1, 1.1, f64::NAN] {
            assert!(matches!(
                Difficulty::from_accuracy(acc),
                Err(Error::OutOfRange {
                    what: "accuracy",
                    ..
                })
            ));
        }
        let bad = AccuracyThresholds {
            easy: 0.2,
            medium: 0.5,
        };
        assert!(matches!(
            bad.classify(0.3),
            Err(Error::OutOfRange {
                what: "accuracy_thresholds.easy",
                ..
            })
        ));
        let custom = AccuracyThresholds {
            easy: 0.9,
            medium: 0.1,
        };
        assert_eq!(custom.classify(0.8), Ok(Difficulty::Medium));
        assert_eq!(custom.classify(0.05), Ok(Difficulty::Hard));
    }

    #[test]
    fn groups_classify() {
        // two groups of 3: (T, T, F) = 2/3 easy; (F, T, F) = 1/3 medium
        let correct = [true, true, false, false, true, false];
        let groups = Groups::contiguous(6, 3).unwrap();
        let mut out = [Difficulty::Hard; 2];
        let th = AccuracyThresholds::<f64>::default();
        classify_groups(&correct, &groups, &th, &mut out).unwrap();
        assert_eq!(out, [Difficulty::Easy, Difficulty::Medium]);
        // permuted: rows hold original positions [3, 4, 5, 0, 1, 2]
        let index = [3usize, 4, 5, 0, 1, 2];
        let mut inverse = [0usize; 6];
        let groups = Groups::permuted(&index, 3, &mut inverse).unwrap();
        classify_groups(&correct, &groups, &th, &mut out).unwrap();
        assert_eq!(out, [Difficulty::Medium, Difficulty::Easy]);
        assert!(matches!(
            classify_groups(&correct[..5], &groups, &th, &mut out),
            Err(Error::LengthMismatch { .. })
        ));
        assert!(matches!(
            classify_groups(&correct, &groups, &th, &mut out[..1]),
            Err(Error::LengthMismatch { .. })
        ));
        // custom thresholds: 2/3 is medium under (0.9, 0.5); 1/3 is hard
        let strict = AccuracyThresholds {
            easy: 0.9,
            medium: 0.5,
        };
        classify_groups(&correct, &groups, &strict, &mut out).unwrap();
        assert_eq!(out, [Difficulty::Hard, Difficulty::Medium]);
        // the default thresholds agree with the exact counts, every n ≤ 12
        for n in 1..=12usize {
            for right in 0..=n {
                let c: [bool; 12] = core::array::from_fn(|i| i < right);
                let c = &c[..n];
                let mut o = [Difficulty::Hard];
                classify_groups(c, &Groups::contiguous(n, n).unwrap(), &th, &mut o).unwrap();
                assert_eq!(
                    o[0],
                    Difficulty::from_counts(right, n).unwrap(),
                    "{right}/{n}"
                );
            }
        }
    }

    #[test]
    fn per_bucket() {
        let mut p = PerBucket::new(1, 2, 3);
        assert_eq!(p[Difficulty::Medium], 2);
        *p.get_mut(Difficulty::Hard) += 10;
        p[Difficulty::Easy] = 7;
        assert_eq!(p, PerBucket::new(7, 2, 13));
        assert_eq!(p.map(|x| x * 2), PerBucket::new(14, 4, 26));
        assert_eq!(PerBucket::splat('a').zip(p).hard, ('a', 13));
        let names: [(Difficulty, i32); 3] = {
            let mut it = p.iter().map(|(d, &v)| (d, v));
            [it.next().unwrap(), it.next().unwrap(), it.next().unwrap()]
        };
        assert_eq!(
            names,
            [
                (Difficulty::Easy, 7),
                (Difficulty::Medium, 2),
                (Difficulty::Hard, 13)
            ]
        );
    }

    #[test]
    fn means_per_bucket() {
        use Difficulty::*;
        let d = [Easy, Hard, Easy, Easy];
        // easy: (4 + 6 + 11)/3 = 7; hard: 2; medium: none
        let m = bucket_means(&d, &[4.0, 2.0, 6.0, 11.0]).unwrap();
        assert_eq!(m, PerBucket::new(Some(7.0), None, Some(2.0)));
        assert_eq!(bucket_means::<f32>(&[], &[]), Ok(PerBucket::splat(None)));
        assert_eq!(
            bucket_means(&d, &[1.0, 2.0]),
            Err(Error::LengthMismatch {
                what: "values",
                expected: 4,
                actual: 2
            })
        );
        assert_eq!(
            bucket_means(&d, &[1.0, f64::NAN, 0.0, 0.0]),
            Err(Error::NonFinite {
                what: "values",
                index: 1
            })
        );
    }

    #[test]
    fn config_defaults_and_validation() {
        let c = DifficultyConfig::<f64>::default();
        assert!(c.validate().is_ok());
        assert_eq!(c.lambda_init, PerBucket::new(0.002, 0.001, 0.0005));
        assert_eq!(c.kl_budget, PerBucket::new(0.05, 0.1, 0.2));
        assert_eq!(
            (
                c.target_momentum,
                c.alpha_lr,
                c.alpha_max,
                c.lambda_lr,
                c.lambda_max
            ),
            (1.0, 0.05, 2.0, 0.01, 10.0)
        );
        type Breaker = fn(&mut DifficultyConfig<f64>);
        let cases: [(&str, Breaker); 10] = [
            ("target_momentum", |c| c.target_momentum = 1.5),
            ("target_scale.hard", |c| c.target_scale.hard = -1.0),
            ("target_update_interval", |c| c.target_update_interval = 0),
            ("alpha_lr", |c| c.alpha_lr = f64::NAN),
            ("alpha_max", |c| c.alpha_max = -1.0),
            ("alpha_init.medium", |c| c.alpha_init.medium = 3.0),
            ("lambda_max", |c| c.lambda_max = f64::INFINITY),
            ("lambda_init.easy", |c| c.lambda_init.easy = 11.0),
            ("kl_budget.medium", |c| c.kl_budget.medium = -0.1),
            ("lambda_lr", |c| c.lambda_lr = -0.01),
        ];
        for (field, break_it) in cases {
            let mut c = DifficultyConfig::<f64>::default();
            break_it(&mut c);
            match c.validate() {
                Err(Error::OutOfRange { what, .. }) => assert_eq!(what, field),
                other => panic!("{field}: {other:?}"),
            }
            assert!(BucketController::new(c).is_err());
        }
    }

    #[test]
    fn bootstrap_and_step_order() {
        use Difficulty::*;
        let mut c = BucketController::new(DifficultyConfig::<f64>::default()).unwrap();
        assert_eq!(c.target(Easy), None);
        // bootstrap: T = round_half_even(h̄): 4.5 → 4, 7.5 → 8
        c.bootstrap(&PerBucket::new(Some(4.5), Some(7.5), None))
            .unwrap();
        assert_eq!(
            (c.target(Easy), c.target(Medium), c.target(Hard)),
            (Some(4.0), Some(8.0), None)
        );
        // easy step with h̄ = 10: α = 0.5 + 0.05·(10 − 4) = 0.8 against the OLD target 4,
        // then T = round(0·4 + 1·1·10) = 10; λ = 0.002 + 0.01·(0.25 − 0.05) = 0.004
        c.step_bucket(Easy, 10.0, Some(0.25), 1).unwrap();
        assert!((c.alpha(Easy) - 0.8).abs() < 1e-15);
        assert_eq!(c.target(Easy), Some(10.0));
        assert!((c.lambda(Easy) - 0.004).abs() < 1e-15);
        // hard without a target: α unchanged, T = round(h̄) = round(2.5) = 2
        c.step_bucket(Hard, 2.5, None, 1).unwrap();
        assert_eq!((c.alpha(Hard), c.target(Hard)), (0.5, Some(2.0)));
        assert_eq!(c.lambda(Hard), 0.0005);
        // hard: Δ = T − h̄ = 2 − 12 = −10 → α = 0.5 − 0.5 = 0; h̄ = 0: Δ = 12 → 0.6
        c.step_bucket(Hard, 12.0, None, 2).unwrap();
        assert_eq!(c.alpha(Hard), 0.0);
        assert_eq!(c.target(Hard), Some(12.0));
        // clipped at alpha_max = 2: medium, Δ = 108 − 8 = 100 → 0.5 + 5 → 2
        c.step_bucket(Medium, 108.0, None, 3).unwrap();
        assert_eq!(c.alpha(Medium), 2.0);
        // λ clips at 0 and at λ_max
        assert_eq!(c.update_lambda(Medium, -100.0), Ok(0.0));
        assert_eq!(c.update_lambda(Medium, 1e6), Ok(10.0));
    }

    #[test]
    fn target_momentum_scale_and_interval() {
        use Difficulty::*;
        let config = DifficultyConfig {
            target_momentum: 0.5,
            target_scale: PerBucket::new(2.0, 1.0, 1.0),
            target_update_interval: 3,
            ..DifficultyConfig::default()
        };
        let mut c = BucketController::new(config).unwrap();
        c.bootstrap(&PerBucket::new(Some(10.0), None, None))
            .unwrap();
        // step 1, 2: not an update step
        assert_eq!(c.update_target(Easy, 20.0, 1), Ok(false));
        assert_eq!(c.update_target(Easy, 20.0, 2), Ok(false));
        assert_eq!(c.target(Easy), Some(10.0));
        // step 3: round(0.5·10 + 0.5·2·20) = 25
        assert_eq!(c.update_target(Easy, 20.0, 3), Ok(true));
        assert_eq!(c.target(Easy), Some(25.0));
        // round half to even: 0.5·25 + 0.5·2·0.25 = 12.75 → 13; 0.5·13 + 0.5·2·1 = 7.5 → 8
        c.update_target(Easy, 0.25, 6).unwrap();
        assert_eq!(c.target(Easy), Some(13.0));
        c.update_target(Easy, 1.0, 9).unwrap();
        assert_eq!(c.target(Easy), Some(8.0));
        // a bucket with no target is set at once, whatever the step
        assert_eq!(c.update_target(Medium, 3.0, 1), Ok(true));
        assert_eq!(c.target(Medium), Some(3.0));
    }

    #[test]
    fn step_all_buckets_and_errors_leave_state() {
        use Difficulty::*;
        let mut c = BucketController::new(DifficultyConfig::<f32>::default()).unwrap();
        c.bootstrap(&PerBucket::splat(Some(4.0))).unwrap();
        let before = *c.state();
        // a bad medium KL: nothing changes, easy included
        let err = c.step(
            &PerBucket::new(Some(6.0), None, None),
            &PerBucket::new(None, Some(f32::NAN), None),
            1,
        );
        assert!(matches!(
            err,
            Err(Error::OutOfRange {
                what: "mean_kl (KL_d)",
                ..
            })
        ));
        assert_eq!(*c.state(), before);
        assert!(c.step_bucket(Easy, -1.0, None, 1).is_err());
        assert!(c.update_alpha(Easy, f32::INFINITY).is_err());
        assert!(
            c.bootstrap(&PerBucket::new(Some(1.0), Some(-1.0), None))
                .is_err()
        );
        assert_eq!(*c.state(), before);
        // overflowing target: s_d·h̄ = inf
        let mut big = BucketController::new(DifficultyConfig {
            target_scale: PerBucket::splat(f32::MAX),
            ..DifficultyConfig::default()
        })
        .unwrap();
        big.bootstrap(&PerBucket::splat(Some(1.0))).unwrap();
        assert!(big.update_target(Easy, 10.0, 1).is_err());
        assert_eq!(big.target(Easy), Some(1.0));
        // a good step: easy α moves (h̄ 6 vs T 4), medium λ moves, hard untouched
        c.step(
            &PerBucket::new(Some(6.0), None, None),
            &PerBucket::new(None, Some(0.2), None),
            1,
        )
        .unwrap();
        assert!((c.alpha(Easy) - 0.6).abs() < 1e-6);
        assert_eq!(c.target(Easy), Some(6.0));
        assert!((c.lambda(Medium) - 0.002).abs() < 1e-7);
        assert_eq!(c.state().hard, before.hard);
    }

    #[test]
    fn restore_state() {
        let config = DifficultyConfig::<f64>::default();
        let state = PerBucket::splat(BucketState {
            target: Some(5.0),
            alpha: 1.0,
            lambda: 0.1,
        });
        let c = BucketController::with_state(config, state).unwrap();
        assert_eq!(*c.state(), state);
        assert_eq!(c.config(), &config);
        for (what, bad) in [
            (
                "state.target",
                BucketState {
                    target: Some(-1.0),
                    ..state.easy
                },
            ),
            (
                "state.alpha",
                BucketState {
                    alpha: 2.5,
                    ..state.easy
                },
            ),
            (
                "state.lambda",
                BucketState {
                    lambda: f64::NAN,
                    ..state.easy
                },
            ),
        ] {
            let s = PerBucket { hard: bad, ..state };
            match BucketController::with_state(config, s) {
                Err(Error::OutOfRange { what: w, .. }) => assert_eq!(w, what),
                other => panic!("{what}: {other:?}"),
            }
        }
    }

    proptest! {
        #[test]
        fn updates_stay_in_range(
            steps in prop::collection::vec((0usize..3, 0.0f64..1e4, -10.0f64..10.0), 1..30),
        ) {
            let mut c = BucketController::new(DifficultyConfig::<f64>::default()).unwrap();
            for (i, (d, h, kl)) in steps.into_iter().enumerate() {
                let d = Difficulty::from_index(d).unwrap();
                c.step_bucket(d, h, Some(kl), i as u64 + 1).unwrap();
                let s = c.state()[d];
                prop_assert!((0.0..=2.0).contains(&s.alpha));
                prop_assert!((0.0..=10.0).contains(&s.lambda));
                let t = s.target.unwrap();
                prop_assert!(t >= 0.0 && t == t.round());
            }
        }

        #[test]
        fn alpha_moves_toward_target(h in 0.0f64..100.0, t in 0.0f64..100.0, d in 0usize..3) {
            let d = Difficulty::from_index(d).unwrap();
            let mut c = BucketController::new(DifficultyConfig::<f64>::default()).unwrap();
            c.bootstrap(&PerBucket::splat(Some(t))).unwrap();
            let t = c.target(d).unwrap();
            let a = c.update_alpha(d, h).unwrap();
            // easy/medium: more HWE tokens than the target raise α; hard: fewer raise α
            let up = match d { Difficulty::Hard => h < t, _ => h > t };
            let down = match d { Difficulty::Hard => h > t, _ => h < t };
            if up { prop_assert!(a >= 0.5); }
            if down { prop_assert!(a <= 0.5); }
            if h == t { prop_assert_eq!(a, 0.5); }
        }

        #[test]
        fn counts_and_accuracy_agree(n in 1usize..200, c in 0usize..200) {
            let c = c % (n + 1);
            let exact = Difficulty::from_counts(c, n).unwrap();
            prop_assert_eq!(Difficulty::from_accuracy(c as f64 / n as f64).unwrap(), exact);
        }
    }
}
