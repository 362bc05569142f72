//! Token embedding: a row lookup forward, a scatter-add backward.
//!
//! The backward is deterministic without atomics: every row of the table gradient is owned
//! by one task, which adds the gradients of its tokens in token order, so the result is the
//! same bit for bit for any thread count (repeated ids sum in the same order).

use crate::error::{check_len, product};
use ares_core::Error as CoreError;
use rayon::prelude::*;

use crate::Result;

/// Element counts (`tokens · dim`) below this run on one thread.
const PAR_MIN_ELEMS: usize = 1 << 16;

/// Embedding lookup: `out[t, :] = table[ids[t], :]` for `t < T = ids.len()`, with `table`
/// `[vocab, dim]` and `out` `[T, dim]` row-major. `out` is overwritten.
///
/// # Errors
/// - `LengthMismatch` for `table` (`vocab·dim`) or `out` (`T·dim`);
/// - `InvalidIndex` for `ids` naming the first id `>= vocab` and its position.
///
/// Nothing is written on error.
pub fn embedding_forward(
    ids: &[u32],
    table: &[f32],
    vocab: usize,
    dim: usize,
    out: &mut [f32],
) -> Result<()> {
    gather(ids, table, vocab, dim, out, |row, src| {
        row.copy_from_slice(src)
    })
}

/// [`embedding_forward`] from a table stored in bf16 (`table` holds the bits): each row
/// widened to f32 (exact) as it is gathered — a model's embedding stored in bf16.
///
/// # Errors
/// As [`embedding_forward`]; nothing is written on error.
pub fn embedding_forward_bf16(
    ids: &[u32],
    table: &[u16],
    vocab: usize,
    dim: usize,
    out: &mut [f32],
) -> Result<()> {
    gather(ids, table, vocab, dim, out, |row, src| {
        for (o, &b) in row.iter_mut().zip(src) {
            *o = f32::from_bits(u32::from(b) << 16);
        }
    })
}

/// `out[t, :] = widen(table[ids[t], :])` after the shapes and ids are checked.
fn gather<T: Sync>(
    ids: &[u32],
    table: &[T],
    vocab: usize,
    dim: usize,
    out: &mut [f32],
    widen: impl Fn(&mut [f32], &[T]) + Sync,
) -> Result<()> {
    check_shapes(ids, vocab, dim, ("table", table.len()), ("out", out.len()))?;
    if dim == 0 {
        return Ok(());
    }
    // Ids were checked against `vocab`, and `table` holds `vocab` rows, so the slices are in
    // range.
    let copy_row = |(row, &id): (&mut [f32], &u32)| {
        let start = id as usize * dim;
        widen(row, &table[start..start + dim]);
    };
    if out.len() >= PAR_MIN_ELEMS {
        out.par_chunks_mut(dim)
            .zip(ids.par_iter())
            .for_each(copy_row);
    } else {
        out.chunks_mut(dim).zip(ids).for_each(copy_row);
    }
    Ok(())
}

/// Embedding backward: `dtable[ids[t], :] += dout[t, :]` for every `t` in order, with `dout`
/// `[T, dim]` and `dtable` `[vocab, dim]`. Accumulates, so tied input/output embeddings and
/// micro-batches add up; a token id repeated in `ids` contributes once per occurrence.
///
/// Deterministic: each table row sums its tokens' gradients in token order whatever the
/// number of threads.
///
/// # Errors
/// As [`embedding_forward`] (`dtable` for the table, `dout` for the output); nothing is
/// written on error.
pub fn embedding_backward(
    ids: &[u32],
    dout: &[f32],
    vocab: usize,
    dim: usize,
    dtable: &mut [f32],
) -> Result<()> {
    check_shapes(
        ids,
        vocab,
        dim,
        ("dtable", dtable.len()),
        ("dout", dout.len()),
    )?;
    if dim == 0 || ids.is_empty() {
        return Ok(());
    }
    // Rows [first, first + block rows) of the table gradient: scan all tokens, add those
    // whose id falls in the block. A token scan is cheap next to the row adds.
    let add_block = |first: usize, block: &mut [f32]| {
        let rows = block.len() / dim;
        for (&id, g) in ids.iter().zip(dout.chunks_exact(dim)) {
            let r = (id as usize).wrapping_sub(first);
            if r < rows {
                let dst = &mut block[r * dim..(r + 1) * dim];
                for (d, s) in dst.iter_mut().zip(g) {
                    *d += s;
                }
            }
        }
    };
    if dout.len() >= PAR_MIN_ELEMS {
        // A few blocks per thread balance the load when ids cluster in part of the vocabulary.
        let blocks = rayon::current_num_threads().saturating_mul(4).max(1);
        let rows_per_block = vocab.div_ceil(blocks).max(1);
        dtable
            .par_chunks_mut(rows_per_block * dim)
            .enumerate()
            .for_each(|(b, block)| add_block(b * rows_per_block, block));
    } else {
        add_block(0, dtable);
    }
    Ok(())
}

/// Checks the table length (`vocab·dim`), the token-side length (`T·dim`) and every id;
/// the pairs are (argument name, length).
fn check_shapes(
    ids: &[u32],
    vocab: usize,
    dim: usize,
    (table_what, table_len): (&'static str, usize),
    (tokens_what, tokens_len): (&'static str, usize),
) -> Result<()> {
    check_len(table_what, product(vocab, dim)?, table_len)?;
    check_len(tokens_what, product(ids.len(), dim)?, tokens_len)?;
    if let Some((position, &id)) = ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= vocab)
    {
        return Err(CoreError::InvalidIndex {
            what: "ids",
            position,
            value: id as usize,
            len: vocab,
        }
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use crate::test_rng::rand_vec;

    #[test]
    fn forward_gathers_rows() {
        let (vocab, dim) = (5, 3);
        let table = rand_vec(vocab * dim, 1);
        let ids = [4u32, 0, 2, 2, 4, 1];
        let mut out = vec![f32::NAN; ids.len() * dim];
        embedding_forward(&ids, &table, vocab, dim, &mut out).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            let id = id as usize;
            assert_eq!(out[t * dim..(t + 1) * dim], table[id * dim..(id + 1) * dim]);
        }
    }

    /// A bf16 table gathers the rows widened: the f32 table of the same values, bit for
    /// bit, at both the serial and the parallel sizes; a bad id writes nothing.
    #[test]
    fn bf16_table_gathers_widened_rows() {
        for (vocab, dim, tokens) in [(5, 3, 6), (40, 1024, 70)] {
            let bits: Vec<u16> = rand_vec(vocab * dim, 2)
                .iter()
                .map(|x| (x.to_bits() >> 16) as u16)
                .collect();
            let table: Vec<f32> = bits
                .iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16))
                .collect();
            let ids: Vec<u32> = (0..tokens).map(|t| (t * 7 % vocab) as u32).collect();
            let (mut want, mut got) = (vec![0.0; tokens * dim], vec![f32::NAN; tokens * dim]);
            embedding_forward(&ids, &table, vocab, dim, &mut want).unwrap();
            embedding_forward_bf16(&ids, &bits, vocab, dim, &mut got).unwrap();
            assert_eq!(got, want);
        }
        let mut out = vec![0.0; 4];
        assert!(embedding_forward_bf16(&[0, 5], &[0; 10], 5, 2, &mut out).is_err());
        assert!(out.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn out_of_range_id_is_named_and_nothing_is_written() {
        let table = vec![1.0; 4 * 2];
        let mut out = vec![0.0; 3 * 2];
        let err = embedding_forward(&[1, 4, 9], &table, 4, 2, &mut out);
        assert_eq!(
            err,
            Err(Error::Core(CoreError::InvalidIndex {
                what: "ids",
                position: 1,
                value: 4,
                len: 4
            }))
        );
        assert!(out.iter().all(|&v| v == 0.0));
        let mut dtable = vec![0.0; 8];
        assert!(embedding_backward(&[0, 7], &out[..4], 4, 2, &mut dtable).is_err());
        assert!(dtable.iter().all(|&v| v == 0.0));
        // Lengths name their argument.
        let what = |r: Result<()>| match r {
            Err(Error::Core(CoreError::LengthMismatch { what, .. })) => what,
            other => panic!("expected a length error, got {other:?}"),
        };
        assert_eq!(
            what(embedding_forward(&[0], &table[..7], 4, 2, &mut out[..2])),
            "table"
        );
        assert_eq!(
            what(embedding_forward(&[0], &table, 4, 2, &mut out[..3])),
            "out"
        );
        assert_eq!(
            what(embedding_backward(&[0], &out[..3], 4, 2, &mut dtable)),
            "dout"
        );
        assert_eq!(
            what(embedding_backward(&[0], &out[..2], 4, 2, &mut dtable[..6])),
            "dtable"
        );
    }

    #[test]
    fn backward_accumulates_repeated_ids_and_matches_finite_differences() {
        // L = Σ c ⊙ out is linear in the table, so central differences are exact up to
        // rounding; repeated ids must add their gradients.
        let (vocab, dim) = (5, 3);
        let table = rand_vec(vocab * dim, 2);
        let ids = [3u32, 1, 3, 0, 3, 1];
        let c = rand_vec(ids.len() * dim, 3);
        let prior = rand_vec(vocab * dim, 4);
        let mut dtable = prior.clone();
        embedding_backward(&ids, &c, vocab, dim, &mut dtable).unwrap();

        let loss = |table: &[f32]| -> f64 {
            let mut out = vec![0.0; ids.len() * dim];
            embedding_forward(&ids, table, vocab, dim, &mut out).unwrap();
            out.iter()
                .zip(&c)
                .map(|(&o, &c)| f64::from(o) * f64::from(c))
                .sum()
        };
        let h = 1e-2f32;
        for i in 0..vocab * dim {
            let (mut tp, mut tm) = (table.clone(), table.clone());
            tp[i] += h;
            tm[i] -= h;
            let fd = (loss(&tp) - loss(&tm)) / (2.0 * f64::from(h));
            let got = f64::from(dtable[i] - prior[i]);
            assert!((got - fd).abs() < 1e-4, "dtable[{i}]: {got} vs {fd}");
        }
        // Row 2 and 4 have no tokens: untouched.
        assert_eq!(dtable[2 * dim..3 * dim], prior[2 * dim..3 * dim]);
        assert_eq!(dtable[4 * dim..5 * dim], prior[4 * dim..5 * dim]);
    }

    #[test]
    fn parallel_paths_match_serial_bit_for_bit() {
        // Large enough for the rayon paths; the reference adds in token order, as promised.
        let (vocab, dim, tokens) = (37, 256, 300);
        let table = rand_vec(vocab * dim, 5);
        let ids: Vec<u32> = (0..tokens)
            .map(|t| ((t * 7 + t / 5) % vocab) as u32)
            .collect();
        let mut out = vec![0.0; tokens * dim];
        embedding_forward(&ids, &table, vocab, dim, &mut out).unwrap();
        let dout = rand_vec(tokens * dim, 6);
        let mut dtable = rand_vec(vocab * dim, 7);
        let mut want = dtable.clone();
        embedding_backward(&ids, &dout, vocab, dim, &mut dtable).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            let id = id as usize;
            assert_eq!(out[t * dim..(t + 1) * dim], table[id * dim..(id + 1) * dim]);
            for j in 0..dim {
                want[id * dim + j] += dout[t * dim + j];
            }
        }
        assert_eq!(dtable, want);
    }

    #[test]
    fn empty_inputs_are_fine() {
        let mut dtable = vec![0.0; 6];
        embedding_forward(&[], &[0.0; 6], 3, 2, &mut []).unwrap();
        embedding_backward(&[], &[], 3, 2, &mut dtable).unwrap();
        embedding_forward(&[1, 2], &[], 3, 0, &mut []).unwrap();
        assert!(embedding_forward(&[3], &[], 3, 0, &mut []).is_err());
    }
}
