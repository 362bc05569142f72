//! Few-row products with bf16 weights: the decode steps of generation read every weight once
//! per token, so storing them in bf16 halves the bytes a memory-bound step moves. The
//! activations, the products and the sums stay f32; only the weights are rounded.
//!
//! - [`pack_bf16`]: f32 → bf16 bits, round to nearest even (as `torch.Tensor.bfloat16`).
//! - [`pack_bf16_tiles`]: a `[in, out]` weight matrix rounded to bf16 in column tiles:
//!   tile `t` (output columns `32t .. 32t + w`, `w = 32` but for the last) holds its `in`
//!   rows of `w` values one after the other, so the product reads each tile as one stream.
//! - [`linear_forward_t_bf16`]: `out = x · W (+ bias)` with `W` packed by
//!   [`pack_bf16_tiles`], each weight widened to f32 (exact) and multiplied in f32, every
//!   output a sum over `in` in order: equal to
//!   [`linear_forward_t`](super::matmul::linear_forward_t) on the widened weights up to the
//!   order of the f32 sums.
//!
//! The product walks the weights once per block of up to [`ROW_BLOCK`] rows, a tile of
//! [`TILE`] output columns at a time (the tile's accumulators stay in registers), so a decode
//! step of a few rows reads each weight once; blocks of rows (or, for one block, ranges of
//! tiles) run in parallel.

use crate::Result;
use crate::error::{check_len, product};
use crate::ops::matmul::MatmulDims;
use half::bf16;
use rayon::prelude::*;

/// Output columns per tile.
pub const TILE: usize = 32;
/// Rows sharing one pass over the weights.
pub const ROW_BLOCK: usize = 8;

/// Rounds `src` to bf16 (nearest even; NaN stays NaN) into `dst`, as bits.
///
/// # Errors
/// Lengths that differ.
pub fn pack_bf16(src: &[f32], dst: &mut [u16]) -> Result<()> {
    check_len("dst", src.len(), dst.len())?;
    dst.par_chunks_mut(1 << 14)
        .zip(src.par_chunks(1 << 14))
        .for_each(|(d, s)| {
            for (d, &s) in d.iter_mut().zip(s) {
                *d = bf16::from_f32(s).to_bits();
            }
        });
    Ok(())
}

/// `src` `[k, m]` (row-major) rounded to bf16 into `dst` in the column-tile layout
/// [`linear_forward_t_bf16`] reads (see the module docs).
///
/// # Errors
/// Lengths that do not match `k · m`.
pub fn pack_bf16_tiles(src: &[f32], k: usize, m: usize, dst: &mut [u16]) -> Result<()> {
    check_len("src", product(k, m)?, src.len())?;
    check_len("dst", product(k, m)?, dst.len())?;
    if k == 0 {
        return Ok(());
    }
    // tile t starts at element t·TILE·k: every tile before it is TILE wide
    dst.par_chunks_mut(TILE * k)
        .enumerate()
        .for_each(|(t, tile)| {
            let c = t * TILE;
            let w = tile.len() / k;
            for (i, row) in tile.chunks_exact_mut(w).enumerate() {
                for (d, &v) in row.iter_mut().zip(&src[i * m + c..i * m + c + w]) {
                    *d = bf16::from_f32(v).to_bits();
                }
            }
        });
    Ok(())
}

/// `out = x · W (+ bias)` with `x` `[n, k]`, `W` `[k, m]` packed by [`pack_bf16_tiles`],
/// `out` `[n, m]` (f32); see the module docs.
///
/// # Errors
/// Lengths that do not match `dims`, or a size that overflows.
pub fn linear_forward_t_bf16(
    x: &[f32],
    wt: &[u16],
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<()> {
    let MatmulDims { n, k, m } = dims;
    check_len("x", product(n, k)?, x.len())?;
    check_len("wt", product(k, m)?, wt.len())?;
    check_len("out", product(n, m)?, out.len())?;
    if let Some(b) = bias {
        check_len("bias", m, b.len())?;
    }
    if n == 0 || m == 0 {
        return Ok(());
    }
    if n > ROW_BLOCK {
        // blocks of rows in parallel, each writing its own rows
        out.par_chunks_mut(ROW_BLOCK * m)
            .zip(x.par_chunks(ROW_BLOCK * k))
            .for_each(|(o, xb)| block(xb, wt, bias, k, m, 0, m, o));
    } else {
        // one block: ranges of whole tiles in parallel, each into its own buffer
        let parts = rayon::current_num_threads().clamp(1, m.div_ceil(TILE));
        let width = m.div_ceil(parts).next_multiple_of(TILE);
        let pieces: Vec<(usize, Vec<f32>)> = (0..m.div_ceil(width))
            .into_par_iter()
            .map(|p| {
                let (c0, c1) = (p * width, ((p + 1) * width).min(m));
                let mut local = vec![0.0f32; n * (c1 - c0)];
                block(x, wt, bias, k, m, c0, c1, &mut local);
                (c0, local)
            })
            .collect();
        for (c0, local) in pieces {
            let w = local.len() / n;
            for (r, row) in local.chunks_exact(w).enumerate() {
                out[r * m + c0..r * m + c0 + w].copy_from_slice(row);
            }
        }
    }
    Ok(())
}

/// Calls `$f::<R>(args, out)` with `R` = the row count of `args.0` (at most [`ROW_BLOCK`]): a
/// fixed row count per instance keeps the accumulators in registers.
macro_rules! by_row_count {
    ($f:ident, $args:expr, $out:expr) => {{
        let args = $args;
        match args.0.len() / args.3.max(1) {
            1 => $f::<1>(args, $out),
            2 => $f::<2>(args, $out),
            3 => $f::<3>(args, $out),
            4 => $f::<4>(args, $out),
            5 => $f::<5>(args, $out),
            6 => $f::<6>(args, $out),
            7 => $f::<7>(args, $out),
            _ => $f::<ROW_BLOCK>(args, $out),
        }
    }};
}

/// `x` (`R` rows of `k`) transposed to `[k][R]`: one slice of the rows' values per step of
/// the sum.
fn rows_by_k<const R: usize>(x: &[f32], k: usize) -> Vec<[f32; R]> {
    let mut xt = vec![[0.0f32; R]; k];
    for (r, row) in x.chunks_exact(k.max(1)).take(R).enumerate() {
        for (t, &v) in xt.iter_mut().zip(row) {
            t[r] = v;
        }
    }
    xt
}

/// Rows `x` (`rows · k`, at most [`ROW_BLOCK`] rows) times columns `c0..c1` of `W` into
/// `out` (`rows` rows of `c1 − c0`, or of `m` when the range is every column).
#[allow(clippy::too_many_arguments)]
fn block(
    x: &[f32],
    wt: &[u16],
    bias: Option<&[f32]>,
    k: usize,
    m: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { block_avx512(x, wt, bias, k, m, c0, c1, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            return unsafe { block_avx2(x, wt, bias, k, m, c0, c1, out) };
        }
    }
    block_portable(x, wt, bias, k, m, c0, c1, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn block_avx512(
    x: &[f32],
    wt: &[u16],
    bias: Option<&[f32]>,
    k: usize,
    m: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    let _ = m; // tiles are addressed by their first column
    by_row_count!(block_rows_avx512, (x, wt, bias, k, c0, c1), out)
}

/// [`block_rows`] with explicit AVX-512: a full tile's 32 weights are widened by two
/// zero-extensions and shifts, and each of the `R` rows keeps its 32 sums in two registers
/// (at most 16 of the 32). The compiler's vectorisation of the portable loop left the
/// product compute-bound at ~35 GFLOP/s on 2 cores (8 rows); this one streams the weights.
/// Same fused multiply-adds in the same order, so the same bits (test below); a last,
/// partial tile goes through the portable code.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::type_complexity)]
fn block_rows_avx512<const R: usize>(
    (x, wt, bias, k, c0, c1): (&[f32], &[u16], Option<&[f32]>, usize, usize, usize),
    out: &mut [f32],
) {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm512_castsi512_ps, _mm512_cvtepu16_epi32, _mm512_fmadd_ps,
        _mm512_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_slli_epi32, _mm512_storeu_ps,
    };
    let width = c1 - c0;
    let full_end = c0 + (width / TILE) * TILE;
    if full_end < c1 {
        // the last, partial tile: the portable code into a buffer of its width
        let w = c1 - full_end;
        let mut part = vec![0.0f32; R * w];
        block_rows::<R>((x, wt, bias, k, full_end, c1), &mut part);
        for (r, row) in part.chunks_exact(w).enumerate() {
            let at = r * width + (full_end - c0);
            out[at..at + w].copy_from_slice(row);
        }
    }
    let xt = rows_by_k::<R>(x, k);
    let mut c = c0;
    while c < full_end {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        if let Some(b) = bias {
            let b = &b[c..c + TILE];
            for a in acc.iter_mut() {
                // SAFETY: `b` holds 32 floats; each load reads 16 of them.
                unsafe {
                    a[0] = _mm512_loadu_ps(b.as_ptr());
                    a[1] = _mm512_loadu_ps(b[16..].as_ptr());
                }
            }
        }
        let tile = &wt[c * k..(c + TILE) * k];
        for (row, xs) in tile.chunks_exact(TILE).zip(&xt) {
            // SAFETY: `row` holds 32 u16 values; each load reads 16 of them (32 bytes).
            let (lo, hi) = unsafe {
                (
                    _mm256_loadu_si256(row.as_ptr().cast::<__m256i>()),
                    _mm256_loadu_si256(row[16..].as_ptr().cast::<__m256i>()),
                )
            };
            // bf16 → f32: the 16 bits become the high half of the f32 (exact)
            let lo = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(lo)));
            let hi = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)));
            for (a, &xv) in acc.iter_mut().zip(xs) {
                let v = _mm512_set1_ps(xv);
                a[0] = _mm512_fmadd_ps(v, lo, a[0]);
                a[1] = _mm512_fmadd_ps(v, hi, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let at = r * width + (c - c0);
            let o = &mut out[at..at + TILE];
            // SAFETY: `o` holds 32 floats; each store writes 16 of them.
            unsafe {
                _mm512_storeu_ps(o.as_mut_ptr(), a[0]);
                _mm512_storeu_ps(o[16..].as_mut_ptr(), a[1]);
            }
        }
        c += TILE;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn block_avx2(
    x: &[f32],
    wt: &[u16],
    bias: Option<&[f32]>,
    k: usize,
    m: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    block_portable(x, wt, bias, k, m, c0, c1, out);
}

/// The widened bf16 weight.
#[inline(always)]
fn widen(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block_portable(
    x: &[f32],
    wt: &[u16],
    bias: Option<&[f32]>,
    k: usize,
    m: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    let _ = m; // tiles are addressed by their first column
    by_row_count!(block_rows, (x, wt, bias, k, c0, c1), out)
}

/// [`block_portable`] for `R` rows.
#[inline(always)]
#[allow(clippy::type_complexity)]
fn block_rows<const R: usize>(
    (x, wt, bias, k, c0, c1): (&[f32], &[u16], Option<&[f32]>, usize, usize, usize),
    out: &mut [f32],
) {
    let width = c1 - c0;
    let xt = rows_by_k::<R>(x, k);
    let mut c = c0;
    while c < c1 {
        let w = TILE.min(c1 - c);
        let mut acc = [[0.0f32; TILE]; R];
        if let Some(b) = bias {
            for a in acc.iter_mut() {
                a[..w].copy_from_slice(&b[c..c + w]);
            }
        }
        // this tile's k rows of w values, one stream (c is a multiple of TILE)
        let tile = wt.get(c * k..c * k + w * k).unwrap_or_default();
        if w == TILE {
            for (row, xs) in tile.chunks_exact(TILE).zip(&xt) {
                let mut wf = [0.0f32; TILE];
                for (f, &b) in wf.iter_mut().zip(row) {
                    *f = widen(b);
                }
                for (a, &xv) in acc.iter_mut().zip(xs) {
                    for (s, &f) in a.iter_mut().zip(&wf) {
                        *s = xv.mul_add(f, *s);
                    }
                }
            }
        } else {
            for (row, xs) in tile.chunks_exact(w).zip(&xt) {
                for (a, &xv) in acc.iter_mut().zip(xs) {
                    for (s, &b) in a.iter_mut().zip(row) {
                        *s = xv.mul_add(widen(b), *s);
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let at = r * width + (c - c0);
            out[at..at + w].copy_from_slice(&a[..w]);
        }
        c += w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::matmul::linear_forward_t;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(747_796_405).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn packing_rounds_to_nearest_even() {
        // bf16 keeps 7 mantissa bits: the step above 1 is 1/128
        let src = [
            1.0f32,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            1.0 + 3.0 / 512.0,
            -2.5,
            f32::NAN,
        ];
        let mut dst = [0u16; 6];
        pack_bf16(&src, &mut dst).unwrap();
        assert_eq!(dst[0], 0x3F80);
        assert_eq!(
            dst[1], 0x3F80,
            "the tie at half a step rounds down to the even mantissa"
        );
        assert_eq!(
            dst[2], 0x3F82,
            "the tie at 1.5 steps rounds up to the even mantissa"
        );
        assert_eq!(
            dst[3], 0x3F81,
            "0.75 of a step rounds to the nearest, one step"
        );
        assert_eq!(widen(dst[4]), -2.5);
        assert!(widen(dst[5]).is_nan());
        assert!(pack_bf16(&src, &mut [0u16; 5]).is_err());
    }

    /// The AVX-512 tiles give the portable code's bits (same FMAs in the same order), for
    /// every row count of a block, full and partial tiles, with and without a bias.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx512_equals_the_portable_code_bit_for_bit() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        for rows in 1..=ROW_BLOCK {
            for (k, m) in [(5, 32), (37, 96), (64, 70), (3, 7)] {
                let x = values(rows * k, 4);
                let mut tiles = vec![0u16; k * m];
                pack_bf16_tiles(&values(k * m, 5), k, m, &mut tiles).unwrap();
                let bias = values(m, 6);
                for b in [None, Some(&bias[..])] {
                    // every column, then a range starting at the second tile
                    for (c0, c1) in [(0, m), (TILE.min(m), m)] {
                        let mut want = vec![f32::NAN; rows * (c1 - c0)];
                        block_portable(&x, &tiles, b, k, m, c0, c1, &mut want);
                        let mut got = vec![f32::NAN; rows * (c1 - c0)];
                        // SAFETY: the CPU supports AVX-512F, checked above.
                        unsafe { block_avx512(&x, &tiles, b, k, m, c0, c1, &mut got) };
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "{rows}x{k}x{m} [{c0}, {c1})");
                    }
                }
            }
        }
    }

    /// Against the f32 product of the widened weights, for row counts around the block
    /// size and widths around the tile, with and without a bias.
    #[test]
    fn equals_the_f32_product_of_the_widened_weights() {
        for (n, k, m) in [
            (1, 7, 5),
            (3, 64, 96),
            (8, 33, 100),
            (9, 40, 31),
            (20, 128, 70),
        ] {
            let x = values(n * k, 1);
            let w = values(k * m, 2);
            let mut bits = vec![0u16; k * m];
            pack_bf16(&w, &mut bits).unwrap();
            let widened: Vec<f32> = bits.iter().map(|&b| widen(b)).collect();
            let mut tiles = vec![0u16; k * m];
            pack_bf16_tiles(&w, k, m, &mut tiles).unwrap();
            let mut sorted = tiles.clone();
            sorted.sort_unstable();
            let mut plain = bits.clone();
            plain.sort_unstable();
            assert_eq!(sorted, plain, "the tiles hold every rounded weight once");
            let bits = tiles;
            let bias = values(m, 3);
            for b in [None, Some(&bias[..])] {
                let dims = MatmulDims { n, k, m };
                let mut want = vec![0.0f32; n * m];
                linear_forward_t(&x, &widened, b, dims, &mut want).unwrap();
                let mut got = vec![f32::NAN; n * m];
                linear_forward_t_bf16(&x, &bits, b, dims, &mut got).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "{n}x{k}x{m} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
        let dims = MatmulDims { n: 2, k: 3, m: 4 };
        let e = linear_forward_t_bf16(&[0.0; 6], &[0; 11], None, dims, &mut [0.0; 8]).unwrap_err();
        assert!(e.to_string().contains("wt"), "{e}");
    }
}
