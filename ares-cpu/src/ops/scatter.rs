//! Row scatter: `dst[index[i], :] = src[i, :]`, the placement of the vision tower's image
//! embeddings at the `<|image_pad|>` positions of a text sequence's embeddings (the
//! `masked_scatter` of Hugging Face's Qwen2-VL). Its backward is a row gather
//! ([`crate::ops::embedding::embedding_forward`] with the same indices), so it has no
//! backward of its own.

use crate::Result;
use crate::error::{check_len, product};
use ares_core::Error as CoreError;
use rayon::prelude::*;

/// Element counts below this run on one thread.
const PAR_MIN_ELEMS: usize = 1 << 16;

/// Marks a destination row no source row goes to.
const NONE: u32 = u32::MAX;

/// Row scatter, **overwriting** the named rows: `dst[index[i], :] = src[i, :]` for
/// `i < index.len()`, with `src` `[index.len(), dim]` and `dst` `[rows, dim]` row-major.
/// Rows of `dst` that no index names are left untouched.
///
/// # Errors
/// - `OutOfRange` for `dim` 0;
/// - `LengthMismatch` for `src` (`index.len()·dim`) or `dst` (`rows·dim`);
/// - `InvalidIndex` for `index` naming the first entry `>= rows`, or the first repeat of an
///   earlier entry (two source rows for one destination row).
///
/// Nothing is written on error.
pub fn scatter_rows(
    src: &[f32],
    index: &[u32],
    rows: usize,
    dim: usize,
    dst: &mut [f32],
) -> Result<()> {
    if dim == 0 {
        return Err(CoreError::OutOfRange {
            what: "dim",
            value: 0.0,
            expected: ">= 1",
        }
        .into());
    }
    check_len("src", product(index.len(), dim)?, src.len())?;
    check_len("dst", product(rows, dim)?, dst.len())?;
    if index.is_empty() {
        return Ok(());
    }
    // source[r]: the source row that goes to destination row r, if any. `index.len() <
    // 2³²−1` here: it is at most `rows` (distinct entries below `rows`), checked as we go.
    let mut source = vec![NONE; rows];
    for (i, &r) in index.iter().enumerate() {
        let bad = |len| CoreError::InvalidIndex {
            what: "index",
            position: i,
            value: r as usize,
            len,
        };
        let slot = source.get_mut(r as usize).ok_or_else(|| bad(rows))?;
        if *slot != NONE {
            return Err(bad(rows).into());
        }
        *slot = u32::try_from(i).map_err(|_| bad(rows))?;
    }
    let copy_row = |(row, &s): (&mut [f32], &u32)| {
        if s != NONE {
            let start = s as usize * dim;
            if let Some(from) = src.get(start..start + dim) {
                row.copy_from_slice(from);
            }
        }
    };
    if src.len() >= PAR_MIN_ELEMS {
        dst.par_chunks_mut(dim)
            .zip(source.par_iter())
            .for_each(copy_row);
    } else {
        dst.chunks_mut(dim).zip(&source).for_each(copy_row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::embedding::embedding_forward;
    use crate::test_rng::Rng;

    #[test]
    fn hand_checked_values() {
        // dst rows 0..4 of dim 2; rows 3 and 1 receive src rows 0 and 1, rows 0 and 2 stay.
        let src = [1.0, 2.0, 3.0, 4.0];
        let mut dst = [9.0, 9.0, 8.0, 8.0, 7.0, 7.0, 6.0, 6.0];
        scatter_rows(&src, &[3, 1], 4, 2, &mut dst).unwrap();
        assert_eq!(dst, [9.0, 9.0, 3.0, 4.0, 7.0, 7.0, 1.0, 2.0]);
        // No index: nothing changes.
        scatter_rows(&[], &[], 4, 2, &mut dst).unwrap();
        assert_eq!(dst, [9.0, 9.0, 3.0, 4.0, 7.0, 7.0, 1.0, 2.0]);
    }

    /// A gather with the same indices reads back what was scattered (the backward of a
    /// scatter is that gather), on a size that runs in parallel.
    #[test]
    fn gather_inverts_scatter_and_other_rows_stay() {
        let mut rng = Rng(31);
        let (rows, dim) = (3000, 40);
        // Every third row, in a shuffled order.
        let mut index: Vec<u32> = (0..rows as u32).step_by(3).collect();
        for i in (1..index.len()).rev() {
            let j = ((rng.sym() + 1.0) * 0.5 * (i + 1) as f64) as usize % (i + 1);
            index.swap(i, j);
        }
        let src = rng.vec(index.len() * dim, 1.0);
        let before = rng.vec(rows * dim, 1.0);
        let mut dst = before.clone();
        scatter_rows(&src, &index, rows, dim, &mut dst).unwrap();
        let mut back = vec![0.0; src.len()];
        embedding_forward(&index, &dst, rows, dim, &mut back).unwrap();
        assert_eq!(back, src);
        for r in (0..rows).filter(|r| r % 3 != 0) {
            assert_eq!(dst[r * dim..(r + 1) * dim], before[r * dim..(r + 1) * dim]);
        }
    }

    #[test]
    fn rejects_bad_shapes_and_indices_and_writes_nothing() {
        use ares_core::Error as E;
        let src = [1.0f32; 4];
        let mut dst = [0.0f32; 6];
        let err = |e: E| Err::<(), _>(crate::Error::Core(e));
        assert_eq!(
            scatter_rows(&src, &[0, 1], 3, 0, &mut dst),
            err(E::OutOfRange {
                what: "dim",
                value: 0.0,
                expected: ">= 1"
            })
        );
        assert_eq!(
            scatter_rows(&src, &[0], 3, 2, &mut dst),
            err(E::LengthMismatch {
                what: "src",
                expected: 2,
                actual: 4
            })
        );
        assert_eq!(
            scatter_rows(&src, &[0, 1], 2, 2, &mut dst),
            err(E::LengthMismatch {
                what: "dst",
                expected: 4,
                actual: 6
            })
        );
        assert_eq!(
            scatter_rows(&src, &[0, 3], 3, 2, &mut dst),
            err(E::InvalidIndex {
                what: "index",
                position: 1,
                value: 3,
                len: 3
            })
        );
        assert_eq!(
            scatter_rows(&src, &[2, 2], 3, 2, &mut dst),
            err(E::InvalidIndex {
                what: "index",
                position: 1,
                value: 2,
                len: 3
            })
        );
        assert_eq!(dst, [0.0; 6]);
    }
}
