//! Group layouts: which batch rows hold the samples of one prompt.
//!
//! - **Contiguous**: sample `i` of group `g` is row `g*n + i` (the rollout order).
//! - **Permuted**: after a shuffle (dynamic batching), `index[row]` is the row's original
//!   position `g*n + i`. The index must be a permutation of `0..B`; validating it fills a
//!   caller-provided inverse table, so looking a member up is O(1) and nothing allocates.
//! - **Ragged** (groups of different sizes, as verl keys them by `uid`): either contiguous
//!   runs given by offsets ([`Groups::from_offsets`]) or one uid per row in any order
//!   ([`Groups::by_uid`]), e.g. after a filter dropped some samples of a group.
//!
//! Every estimator reads a layout through [`Groups::count`], [`Groups::size`] and
//! [`Groups::rows_of`], so they all accept every layout.

use crate::error::{Error, Result};

/// A validated grouping of a batch of rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Groups<'a> {
    count: usize,
    batch: usize,
    layout: Layout<'a>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout<'a> {
    /// `count` groups of `n`; `rows[g*n + i]` = the row holding sample `i` of group `g`,
    /// `None` = contiguous.
    Uniform { n: usize, rows: Option<&'a [usize]> },
    /// Group `g` is `rows[offsets[g]..offsets[g + 1]]` (`None` = the rows themselves);
    /// `uids` are the per-row keys of [`Groups::by_uid`].
    Ragged {
        offsets: &'a [usize],
        rows: Option<&'a [usize]>,
        uids: Option<&'a [u64]>,
    },
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
            count: batch / n,
            batch,
            layout: Layout::Uniform { n, rows: None },
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
            count,
            batch,
            layout: Layout::Uniform {
                n,
                rows: Some(inverse),
            },
        })
    }

    /// Contiguous groups of different sizes: group `g` is rows `offsets[g]..offsets[g + 1]`,
    /// so `offsets` starts at 0, strictly increases (no empty group) and ends at the batch
    /// size; `offsets.len()` is the number of groups plus one.
    ///
    /// Errors: `offsets` empty ([`Error::Empty`]), not starting at 0 or not strictly
    /// increasing ([`Error::OutOfRange`] naming `"offsets"`, the value and the rule).
    pub fn from_offsets(offsets: &'a [usize]) -> Result<Self> {
        let (&first, rest) = offsets
            .split_first()
            .ok_or(Error::Empty { what: "offsets" })?;
        if first != 0 {
            return Err(Error::OutOfRange {
                what: "offsets",
                value: first as f64,
                expected: "0 at the start",
            });
        }
        let mut prev = first;
        for &o in rest {
            if o <= prev {
                return Err(Error::OutOfRange {
                    what: "offsets",
                    value: o as f64,
                    expected: "above the previous offset (no empty group)",
                });
            }
            prev = o;
        }
        Ok(Groups {
            count: rest.len(),
            batch: prev,
            layout: Layout::Ragged {
                offsets,
                rows: None,
                uids: None,
            },
        })
    }

    /// Groups keyed by a uid per row (verl's `index`): rows with equal `uids[row]` form one
    /// group, whatever their positions and however many they are. Groups are numbered in
    /// the order of their first row; within a group, rows are in batch order.
    ///
    /// `scratch` needs `2·B + 1` entries (B = `uids.len()`); it receives the row order and the
    /// group offsets and is borrowed by the layout. O(B log B), no allocation.
    ///
    /// Errors: `scratch` too short ([`Error::ScratchTooSmall`]).
    pub fn by_uid(uids: &'a [u64], scratch: &'a mut [usize]) -> Result<Self> {
        let batch = uids.len();
        let needed = 2 * batch + 1;
        crate::num::check_scratch("scratch", needed, scratch.len())?;
        let (rows, rest) = scratch[..needed].split_at_mut(batch);
        let uid = |r: usize| uids.get(r).copied().unwrap_or(0);
        for (i, r) in rows.iter_mut().enumerate() {
            *r = i;
        }
        // (uid, row) order puts each group together with its first row leading it …
        rows.sort_unstable_by_key(|&r| (uid(r), r));
        let leader = &mut rest[..batch];
        let mut first = 0;
        for i in 0..batch {
            if i == 0 || uid(rows[i]) != uid(rows[i - 1]) {
                first = rows[i];
            }
            leader[rows[i]] = first;
        }
        // … and (leader, row) order numbers the groups by their first row.
        rows.sort_unstable_by_key(|&r| (leader[r], r));
        let offsets = rest;
        let mut count = 0;
        offsets[0] = 0;
        for i in 1..=batch {
            if i == batch || uid(rows[i]) != uid(rows[i - 1]) {
                count += 1;
                offsets[count] = i;
            }
        }
        Ok(Groups {
            count,
            batch,
            layout: Layout::Ragged {
                offsets: &offsets[..=count],
                rows: Some(rows),
                uids: Some(uids),
            },
        })
    }

    /// The common group size of a [`contiguous`](Self::contiguous) or
    /// [`permuted`](Self::permuted) layout; `None` for a ragged one.
    #[inline]
    pub fn uniform_size(&self) -> Option<usize> {
        match self.layout {
            Layout::Uniform { n, .. } => Some(n),
            Layout::Ragged { .. } => None,
        }
    }

    /// Number of groups.
    #[inline]
    pub fn count(&self) -> usize {
        self.count
    }

    /// Total rows.
    #[inline]
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The number of samples of group `g` (0 for `g ≥ count`).
    #[inline]
    pub fn size(&self, g: usize) -> usize {
        match self.layout {
            Layout::Uniform { n, .. } => {
                if g < self.count {
                    n
                } else {
                    0
                }
            }
            Layout::Ragged { offsets, .. } => match (offsets.get(g), offsets.get(g + 1)) {
                (Some(&a), Some(&b)) => b - a,
                _ => 0,
            },
        }
    }

    /// The uid of group `g` (a [`by_uid`](Self::by_uid) layout), else `None`.
    pub fn uid(&self, g: usize) -> Option<u64> {
        match self.layout {
            Layout::Ragged {
                uids: Some(uids),
                rows: Some(rows),
                offsets,
            } => {
                let first = *offsets.get(g)?;
                uids.get(*rows.get(first)?).copied()
            }
            _ => None,
        }
    }

    /// The row holding sample `i` of group `g` (`g < count`, `i < size(g)`; other arguments
    /// give an unspecified row).
    #[inline]
    pub fn row(&self, g: usize, i: usize) -> usize {
        match self.layout {
            Layout::Uniform { n, rows } => {
                let pos = g * n + i;
                rows.and_then(|r| r.get(pos).copied()).unwrap_or(pos)
            }
            Layout::Ragged { offsets, rows, .. } => {
                let pos = offsets.get(g).copied().unwrap_or(0) + i;
                rows.and_then(|r| r.get(pos).copied()).unwrap_or(pos)
            }
        }
    }

    /// Iterator over the rows of group `g`, in sample order.
    #[inline]
    pub fn rows_of(&self, g: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.size(g)).map(move |i| self.row(g, i))
    }

    /// Errors with [`Error::GroupTooSmall`] unless every group has at least 2 samples:
    /// every group-relative estimator (GRPO, RLOO, Pro Max, …) is undefined for a single
    /// sample. For a ragged layout the error names the first such group and its uid.
    #[inline]
    pub fn require_pairs(&self, estimator: &'static str) -> Result<()> {
        match self.layout {
            Layout::Uniform { n, .. } if n >= 2 => Ok(()),
            Layout::Uniform { n, .. } => Err(Error::GroupTooSmall { estimator, n }),
            Layout::Ragged { .. } => match (0..self.count).find(|&g| self.size(g) < 2) {
                None => Ok(()),
                Some(group) => Err(Error::RaggedGroupTooSmall {
                    estimator,
                    group,
                    uid: self.uid(group),
                    n: self.size(group),
                }),
            },
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
    extern crate std;
    use super::*;
    use std::vec;

    #[test]
    fn contiguous_rows() {
        let g = Groups::contiguous(6, 3).unwrap();
        assert_eq!((g.uniform_size(), g.count(), g.batch()), (Some(3), 2, 6));
        assert_eq!((g.size(1), g.size(2), g.uid(0)), (3, 0, None));
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

    #[test]
    fn offsets_layout() {
        let g = Groups::from_offsets(&[0, 2, 5, 6]).unwrap();
        assert_eq!((g.count(), g.batch(), g.uniform_size()), (3, 6, None));
        assert_eq!((g.size(0), g.size(1), g.size(2), g.size(3)), (2, 3, 1, 0));
        assert_eq!(g.rows_of(1).collect::<std::vec::Vec<_>>(), [2, 3, 4]);
        assert_eq!(
            g.require_pairs("rloo"),
            Err(Error::RaggedGroupTooSmall {
                estimator: "rloo",
                group: 2,
                uid: None,
                n: 1
            })
        );
        assert!(
            Groups::from_offsets(&[0, 2, 5])
                .unwrap()
                .require_pairs("grpo")
                .is_ok()
        );
        let err = Groups::from_offsets(&[0, 2, 2]).unwrap_err();
        assert_eq!(
            std::format!("{err}"),
            "`offsets` = 2 is out of range: expected above the previous offset (no empty group)"
        );
        assert!(matches!(
            Groups::from_offsets(&[1, 2]),
            Err(Error::OutOfRange { what: "offsets", value, .. }) if value == 1.0
        ));
        assert_eq!(
            Groups::from_offsets(&[]),
            Err(Error::Empty { what: "offsets" })
        );
        let empty = Groups::from_offsets(&[0]).unwrap();
        assert_eq!((empty.count(), empty.batch()), (0, 0));
    }

    #[test]
    fn uid_layout() {
        // uids by row: groups in order of first row: 9 → rows 0, 3, 5; 4 → rows 1, 2; 7 → row 4
        let uids = [9, 4, 4, 9, 7, 9];
        let mut scratch = [0usize; 13];
        let g = Groups::by_uid(&uids, &mut scratch).unwrap();
        assert_eq!((g.count(), g.batch()), (3, 6));
        let groups: std::vec::Vec<std::vec::Vec<usize>> =
            (0..3).map(|k| g.rows_of(k).collect()).collect();
        assert_eq!(groups, [vec![0, 3, 5], vec![1, 2], vec![4]]);
        assert_eq!(
            (g.uid(0), g.uid(1), g.uid(2), g.uid(3)),
            (Some(9), Some(4), Some(7), None)
        );
        let err = g.require_pairs("grpo").unwrap_err();
        assert_eq!(
            err,
            Error::RaggedGroupTooSmall {
                estimator: "grpo",
                group: 2,
                uid: Some(7),
                n: 1
            }
        );
        assert_eq!(
            std::format!("{err}"),
            "advantage estimator `grpo` needs at least 2 samples per group; group 2 (uid 7) has 1"
        );
        let mut short = [0usize; 12];
        assert!(matches!(
            Groups::by_uid(&uids, &mut short),
            Err(Error::ScratchTooSmall { needed: 13, .. })
        ));
        let mut none = [0usize; 1];
        assert_eq!(Groups::by_uid(&[], &mut none).unwrap().count(), 0);
        assert!(g.check_same_prompt(&uids).is_ok());
    }
}
