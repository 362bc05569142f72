//! Group layouts: which batch rows hold the `n` samples of one prompt.
//!
//! - **Contiguous**: sample `i` of group `g` is row `g*n + i` (the rollout order).
//! - **Permuted**: after a shuffle (dynamic batching), `index[row]` is the row's original
//!   position `g*n + i`. The index must be a permutation of `0..B`; validating it fills a
//!   caller-provided inverse table, so looking a member up is O(1) and nothing allocates.

use crate::error::{Error, Result};

/// A validated grouping of a batch of `B = groups × n` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Groups<'a> {
    n: usize,
    count: usize,
    /// `rows[g*n + i]` = the row holding sample `i` of group `g`; `None` = contiguous.
    rows: Option<&'a [usize]>,
}

impl<'a> Groups<'a> {
    /// Contiguous groups of `n` over a batch of `batch` rows.
    ///
    /// Errors: `n == 0` ([`Error::OutOfRange`]), `batch` not a multiple of `n`
    /// ([`Error::NotDivisible`]).
    pub fn contiguous(batch: usize, n: usize) -> Result<Self> {
        if n == 0 {
            return Err(Error::OutOfRange {
                what: "n (group size)",
                value: 0.0,
                expected: ">= 1",
            });
        }
        if batch % n != 0 {
            return Err(Error::NotDivisible {
                what: "batch",
                len: batch,
                n,
            });
        }
        Ok(Groups {
            n,
            count: batch / n,
            rows: None,
        })
    }

    /// Groups of `n` over a shuffled batch: `index[row]` is the original position
    /// (`g*n + i`) of the sample now at `row`. `inverse` is scratch of at least
    /// `index.len()` elements; it receives the inverse permutation and is borrowed by the
    /// returned layout.
    ///
    /// Errors: `n == 0`, `index.len()` not a multiple of `n`, `inverse` too short, or an
    /// entry of `index` out of range or repeated ([`Error::NotAPermutation`]).
    pub fn permuted(index: &[usize], n: usize, inverse: &'a mut [usize]) -> Result<Self> {
        let batch = index.len();
        let Groups { count, .. } = Self::contiguous(batch, n)?;
        if inverse.len() < batch {
            return Err(Error::ScratchTooSmall {
                what: "inverse",
                needed: batch,
                actual: inverse.len(),
            });
        }
        let inverse = &mut inverse[..batch];
        inverse.fill(usize::MAX);
        for (row, &pos) in index.iter().enumerate() {
            match inverse.get_mut(pos) {
                Some(slot) if *slot == usize::MAX => *slot = row,
                _ => {
                    return Err(Error::NotAPermutation {
                        position: row,
                        value: pos,
                        len: batch,
                    });
                }
            }
        }
        Ok(Groups {
            n,
            count,
            rows: Some(inverse),
        })
    }

    /// Samples per group.
    #[inline]
    pub fn n(&self) -> usize {
        self.n
    }

    /// Number of groups.
    #[inline]
    pub fn count(&self) -> usize {
        self.count
    }

    /// Total rows, `count × n`.
    #[inline]
    pub fn batch(&self) -> usize {
        self.count * self.n
    }

    /// The row holding sample `i` of group `g` (`g < count`, `i < n`; other arguments give
    /// an unspecified row that is still `< batch` when the layout is contiguous-in-range).
    #[inline]
    pub fn row(&self, g: usize, i: usize) -> usize {
        let pos = g * self.n + i;
        match self.rows {
            None => pos,
            Some(rows) => rows.get(pos).copied().unwrap_or(pos),
        }
    }

    /// Iterator over the rows of group `g`, in sample order.
    #[inline]
    pub fn rows_of(&self, g: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.n).map(move |i| self.row(g, i))
    }

    /// Errors with [`Error::GroupTooSmall`] unless `n ≥ 2`: every group-relative estimator
    /// (GRPO, RLOO, Pro Max, …) is undefined for a single sample.
    #[inline]
    pub fn require_pairs(&self, estimator: &'static str) -> Result<()> {
        if self.n >= 2 {
            Ok(())
        } else {
            Err(Error::GroupTooSmall {
                estimator,
                n: self.n,
            })
        }
    }

    /// Errors unless `len` equals the batch size.
    #[inline]
    pub fn check_batch(&self, what: &'static str, len: usize) -> Result<()> {
        crate::num::check_len(what, self.batch(), len)
    }

    /// Checks that every group's rows carry the same prompt key (`keys[row]`, e.g. a hash
    /// of the prompt tokens or its `uid`): a shuffled batch must not mix prompts.
    pub fn check_same_prompt<K: PartialEq>(&self, keys: &[K]) -> Result<()> {
        self.check_batch("prompt keys", keys.len())?;
        for g in 0..self.count {
            let first = self.row(g, 0);
            for row in self.rows_of(g).skip(1) {
                if keys[row] != keys[first] {
                    return Err(Error::MixedGroup { group: g, row });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_rows() {
        let g = Groups::contiguous(6, 3).unwrap();
        assert_eq!((g.n(), g.count(), g.batch()), (3, 2, 6));
        assert_eq!(g.row(1, 2), 5);
        assert_eq!(
            Groups::contiguous(7, 3),
            Err(Error::NotDivisible {
                what: "batch",
                len: 7,
                n: 3
            })
        );
        assert!(Groups::contiguous(6, 0).is_err());
        assert_eq!(
            Groups::contiguous(4, 1).unwrap().require_pairs("grpo"),
            Err(Error::GroupTooSmall {
                estimator: "grpo",
                n: 1
            })
        );
    }

    #[test]
    fn permuted_rows_and_validation() {
        // rows hold original positions [3, 0, 2, 1]: group 0 = positions 0,1 = rows 1,3
        let index = [3, 0, 2, 1];
        let mut inv = [0usize; 4];
        let g = Groups::permuted(&index, 2, &mut inv).unwrap();
        assert_eq!(g.rows_of(0).count(), 2);
        assert_eq!(
            (g.row(0, 0), g.row(0, 1), g.row(1, 0), g.row(1, 1)),
            (1, 3, 2, 0)
        );
        let mut inv = [0usize; 4];
        assert_eq!(
            Groups::permuted(&[0, 1, 1, 2], 2, &mut inv),
            Err(Error::NotAPermutation {
                position: 2,
                value: 1,
                len: 4
            })
        );
        assert_eq!(
            Groups::permuted(&[0, 1, 4, 2], 2, &mut inv),
            Err(Error::NotAPermutation {
                position: 2,
                value: 4,
                len: 4
            })
        );
        let mut short = [0usize; 3];
        assert!(matches!(
            Groups::permuted(&index, 2, &mut short),
            Err(Error::ScratchTooSmall { .. })
        ));
    }

    #[test]
    fn same_prompt_check() {
        let index = [3, 0, 2, 1];
        let mut inv = [0usize; 4];
        let g = Groups::permuted(&index, 2, &mut inv).unwrap();
        // rows 1,3 are group 0; rows 2,0 are group 1
        assert!(g.check_same_prompt(&["b", "a", "b", "a"]).is_ok());
        assert_eq!(
            g.check_same_prompt(&["b", "a", "b", "c"]),
            Err(Error::MixedGroup { group: 0, row: 3 })
        );
    }
}
