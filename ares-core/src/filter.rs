//! Online group filtering for dynamic sampling and the `drop_solved` bookkeeping
//! (docs/algorithms.md §7).
//!
//! A group whose samples all succeed or all fail carries no GRPO signal (every advantage is
//! 0), so the trainer keeps only groups whose mean `filter_key` lies strictly inside
//! `(filter_low, filter_high)` and samples more batches until enough groups are kept (that
//! loop, with `max_try_make_batch`, is the runner's). Kept groups stay whole.

use crate::error::{Error, Result};
use crate::groups::Groups;
use crate::num::{cast, check_len, check_param};
use num_traits::Float;

/// Keep interval of the online filter: a group is kept iff
/// `filter_low < mean < filter_high` (strict; defaults 0.01 and 0.99, so all-wrong and
/// all-correct groups of a 0/1 accuracy are dropped). Valid when both are finite and
/// `filter_low < filter_high`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FilterParams<F> {
    /// Lower bound (exclusive).
    pub filter_low: F,
    /// Upper bound (exclusive).
    pub filter_high: F,
}

impl<F: Float> Default for FilterParams<F> {
    fn default() -> Self {
        FilterParams {
            filter_low: cast(0.01),
            filter_high: cast(0.99),
        }
    }
}

impl<F: Float> FilterParams<F> {
    /// Errors ([`Error::OutOfRange`]) unless both bounds are finite and
    /// `filter_low < filter_high` (an empty interval would drop every group).
    pub fn validate(&self) -> Result<()> {
        check_param("filter_low", self.filter_low, true, "finite")?;
        check_param(
            "filter_high",
            self.filter_high,
            self.filter_high > self.filter_low,
            "> filter_low",
        )
    }

    /// Whether a group with mean `mean` is kept: `filter_low < mean < filter_high`
    /// (false for NaN).
    #[inline]
    pub fn keeps(&self, mean: F) -> bool {
        self.filter_low < mean && mean < self.filter_high
    }
}

/// The mean of `values` over the rows of group `g` (rows are in range for a validated
/// layout; a layout never holds an empty group).
#[inline]
fn group_mean<F: Float>(groups: &Groups<'_>, values: &[F], g: usize) -> F {
    let sum = groups
        .rows_of(g)
        .map(|row| values.get(row).copied().unwrap_or(F::zero()))
        .fold(F::zero(), |a, b| a + b);
    sum / cast::<F>(groups.size(g) as f64)
}

/// Per-group mean of a per-sample metric: `means[g] = (1/n_g) Σ_i values[row(g, i)]`, with
/// `n_g` the size of group g (groups may differ in size).
///
/// `values` is indexed by batch row (the `filter_key`: accuracy by default, or `overall`,
/// or any reward metric).
///
/// Errors: `values.len()` ≠ batch, `means.len()` ≠ number of groups
/// ([`Error::LengthMismatch`]); a non-finite value ([`Error::NonFinite`], row index).
pub fn group_means<F: Float>(groups: &Groups<'_>, values: &[F], means: &mut [F]) -> Result<()> {
    groups.check_batch("values", values.len())?;
    check_len("means", groups.count(), means.len())?;
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::NonFinite {
            what: "values",
            index,
        });
    }
    for (g, mean) in means.iter_mut().enumerate() {
        *mean = group_mean(groups, values, g);
    }
    Ok(())
}

/// The online filter: `keep[g] = filter_low < mean_g < filter_high` with `mean_g` from
/// [`group_means`]. Returns the number of kept groups.
///
/// Errors: as [`group_means`] (with `keep` in place of `means`), invalid `params`.
pub fn filter_groups<F: Float>(
    groups: &Groups<'_>,
    values: &[F],
    params: &FilterParams<F>,
    keep: &mut [bool],
) -> Result<usize> {
    params.validate()?;
    groups.check_batch("values", values.len())?;
    check_len("keep", groups.count(), keep.len())?;
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::NonFinite {
            what: "values",
            index,
        });
    }
    let mut kept = 0;
    for (g, k) in keep.iter_mut().enumerate() {
        *k = params.keeps(group_mean(groups, values, g));
        kept += usize::from(*k);
    }
    Ok(kept)
}

/// Expands group keep flags to rows: `keep_rows[row(g, i)] = keep_groups[g]` for every
/// sample i, so a kept group stays whole under contiguous or permuted layouts. Returns the
/// number of kept rows (`n ×` kept groups).
///
/// Errors: `keep_groups.len()` ≠ number of groups, `keep_rows.len()` ≠ batch
/// ([`Error::LengthMismatch`]).
pub fn expand_keep(
    groups: &Groups<'_>,
    keep_groups: &[bool],
    keep_rows: &mut [bool],
) -> Result<usize> {
    check_len("keep_groups", groups.count(), keep_groups.len())?;
    groups.check_batch("keep_rows", keep_rows.len())?;
    let mut kept = 0;
    for (g, &k) in keep_groups.iter().enumerate() {
        for row in groups.rows_of(g) {
            if let Some(slot) = keep_rows.get_mut(row) {
                *slot = k;
                kept += usize::from(k);
            }
        }
    }
    Ok(kept)
}

/// `drop_solved` bookkeeping for one prompt visit: the number of consecutive visits on
/// which the prompt was solved, where "solved" means all n samples correct **and** the mean
/// token entropy of its responses below `entropy_threshold`.
///
/// `streak = prev_streak + 1` (saturating) if solved, else 0. A pure update: the caller
/// stores the streak per prompt and removes the prompt once [`is_solved`] says so.
///
/// Errors: non-finite `mean_entropy` ([`Error::NonFinite`], index 0) or
/// `entropy_threshold` ([`Error::OutOfRange`]).
pub fn solved_streak<F: Float>(
    prev_streak: u32,
    all_correct: bool,
    mean_entropy: F,
    entropy_threshold: F,
) -> Result<u32> {
    check_param("entropy_threshold", entropy_threshold, true, "finite")?;
    if !mean_entropy.is_finite() {
        return Err(Error::NonFinite {
            what: "mean_entropy",
            index: 0,
        });
    }
    Ok(if all_correct && mean_entropy < entropy_threshold {
        prev_streak.saturating_add(1)
    } else {
        0
    })
}

/// Whether a prompt with `streak` consecutive solved visits is removed from the training
/// set: `k > 0 && streak ≥ k` (K consecutive visits; `k = 0` disables dropping).
#[inline]
pub fn is_solved(streak: u32, k: u32) -> bool {
    k > 0 && streak >= k
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::{vec, vec::Vec};

    #[test]
    fn filters_all_correct_and_all_wrong() {
        // groups of 4: acc 1, 0, 0.5, 0.25
        let acc = [
            1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0,
        ];
        let g = Groups::contiguous(16, 4).unwrap();
        let mut means = [0.0; 4];
        group_means(&g, &acc, &mut means).unwrap();
        assert_eq!(means, [1.0, 0.0, 0.5, 0.25]);
        let mut keep = [true; 4];
        assert_eq!(
            filter_groups(&g, &acc, &FilterParams::default(), &mut keep),
            Ok(2)
        );
        assert_eq!(keep, [false, false, true, true]);
        let mut rows = [true; 16];
        assert_eq!(expand_keep(&g, &keep, &mut rows), Ok(8));
        assert!(rows[..8].iter().all(|&k| !k) && rows[8..].iter().all(|&k| k));
        // f32 too
        let acc32 = acc.map(|x| x as f32);
        assert_eq!(
            filter_groups(&g, &acc32, &FilterParams::default(), &mut keep),
            Ok(2)
        );
    }

    #[test]
    fn bounds_are_strict() {
        // means 0.25 and 0.75 on the bounds are dropped
        let p = FilterParams {
            filter_low: 0.25,
            filter_high: 0.75,
        };
        assert!(!p.keeps(0.25) && !p.keeps(0.75) && p.keeps(0.5) && !p.keeps(f64::NAN));
        let bad = FilterParams {
            filter_low: 0.5,
            filter_high: 0.5,
        };
        let g = Groups::contiguous(2, 2).unwrap();
        assert!(matches!(
            filter_groups(&g, &[0.0, 1.0], &bad, &mut [false]),
            Err(Error::OutOfRange {
                what: "filter_high",
                ..
            })
        ));
        let nan = FilterParams {
            filter_low: f64::NAN,
            filter_high: 0.5,
        };
        assert!(matches!(
            filter_groups(&g, &[0.0, 1.0], &nan, &mut [false]),
            Err(Error::OutOfRange {
                what: "filter_low",
                ..
            })
        ));
    }

    #[test]
    fn permuted_groups_stay_whole() {
        // rows hold original positions [3, 0, 2, 1]: group 0 = rows 1, 3; group 1 = rows 2, 0
        let index = [3usize, 0, 2, 1];
        let mut inv = [0usize; 4];
        let g = Groups::permuted(&index, 2, &mut inv).unwrap();
        // group 0 (rows 1, 3) acc (1, 0) → kept; group 1 (rows 2, 0) acc (1, 1) → dropped
        let acc = [1.0, 1.0, 1.0, 0.0];
        let mut keep = [false; 2];
        assert_eq!(
            filter_groups(&g, &acc, &FilterParams::default(), &mut keep),
            Ok(1)
        );
        assert_eq!(keep, [true, false]);
        let mut rows = [false; 4];
        assert_eq!(expand_keep(&g, &keep, &mut rows), Ok(2));
        assert_eq!(rows, [false, true, false, true]);
    }

    #[test]
    fn errors() {
        let g = Groups::contiguous(4, 2).unwrap();
        let mut means = [0.0; 2];
        assert_eq!(
            group_means(&g, &[0.0, f64::INFINITY, 0.0, 0.0], &mut means),
            Err(Error::NonFinite {
                what: "values",
                index: 1
            })
        );
        assert!(matches!(
            group_means(&g, &[0.0; 3], &mut means),
            Err(Error::LengthMismatch { what: "values", .. })
        ));
        assert!(matches!(
            group_means(&g, &[0.0; 4], &mut means[..1]),
            Err(Error::LengthMismatch { what: "means", .. })
        ));
        assert!(matches!(
            expand_keep(&g, &[true], &mut [false; 4]),
            Err(Error::LengthMismatch {
                what: "keep_groups",
                ..
            })
        ));
        assert!(matches!(
            expand_keep(&g, &[true; 2], &mut [false; 5]),
            Err(Error::LengthMismatch {
                what: "keep_rows",
                ..
            })
        ));
    }

    #[test]
    fn drop_solved_streaks() {
        // solved three visits in a row, K = 3 → drop on the third
        let mut s = 0;
        for visit in 1..=3 {
            s = solved_streak(s, true, 0.1, 0.3).unwrap();
            assert_eq!(s, visit);
            assert_eq!(is_solved(s, 3), visit == 3);
        }
        // high entropy or a wrong sample resets
        assert_eq!(solved_streak(2, true, 0.3, 0.3), Ok(0)); // not strictly below
        assert_eq!(solved_streak(2, false, 0.0, 0.3), Ok(0));
        assert_eq!(solved_streak(u32::MAX, true, 0.0f32, 0.3), Ok(u32::MAX));
        assert!(!is_solved(100, 0));
        assert_eq!(
            solved_streak(0, true, f64::NAN, 0.3),
            Err(Error::NonFinite {
                what: "mean_entropy",
                index: 0
            })
        );
        assert!(solved_streak(0, true, 0.1, f64::INFINITY).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn keep_matches_means(
            (n, values) in (1usize..6, 1usize..8).prop_flat_map(|(n, g)| {
                (Just(n), proptest::collection::vec(prop_oneof![Just(0.0f64), Just(1.0), 0.0f64..1.0], n * g))
            })
        ) {
            let g = Groups::contiguous(values.len(), n).unwrap();
            let mut means = vec![0.0; g.count()];
            group_means(&g, &values, &mut means).unwrap();
            let mut keep = vec![false; g.count()];
            let p = FilterParams::default();
            let kept = filter_groups(&g, &values, &p, &mut keep).unwrap();
            prop_assert_eq!(kept, keep.iter().filter(|&&k| k).count());
            for (m, k) in means.iter().zip(&keep) {
                prop_assert_eq!(*k, *m > 0.01 && *m < 0.99);
            }
            let mut rows = vec![false; values.len()];
            prop_assert_eq!(expand_keep(&g, &keep, &mut rows).unwrap(), kept * n);
            let rows_kept: Vec<bool> = rows.chunks(n).map(|c| c[0]).collect();
            prop_assert_eq!(rows_kept, keep.clone());
            prop_assert!(rows.chunks(n).all(|c| c.iter().all(|&x| x == c[0])));
        }
    }
}
