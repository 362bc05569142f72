//! Products with the weights stored in column tiles, the layout of generation's decode
//! weights: a decode step multiplies a few rows (one token per sequence) by every weight, so
//! it is bound by reading the weights, and a layout read as one stream per tile of output
//! columns lets the product keep its sums in registers and read each weight once.
//!
//! - [`pack_bf16`]: f32 → bf16 bits, round to nearest even (as `torch.Tensor.bfloat16`).
//! - [`pack_bf16_tiles`] / [`pack_f32_tiles`]: a `[in, out]` weight matrix in column tiles
//!   (rounded to bf16, or f32 as it is): tile `t` (output columns `32t .. 32t + w`, `w = 32`
//!   but for the last) holds its `in` rows of `w` values one after the other.
//! - [`linear_forward_t_bf16`]: `out = x · W (+ bias)` with `W` from [`pack_bf16_tiles`],
//!   each weight widened to f32 (exact); half the weight bytes of f32.
//! - [`linear_forward_t_tiles`]: the same with `W` from [`pack_f32_tiles`], in a
//!   [`MatmulPrecision`] (TF32 / bf16 operands rounded as
//!   [`linear_forward_t_in`](super::matmul::linear_forward_t_in) rounds them).
//!
//! Every output is `bias + Σᵢ x[i] · w[i]` summed over `i` in order by fused multiply-adds,
//! whatever the row count, the other rows or the thread count: a row's result is the same
//! bits alone or in any batch (batch invariance — a sampled decode does not depend on which
//! sequences share its step). Equal to the f32 product of the (widened) weights up to the
//! order of the sums.
//!
//! The work is split by ranges of whole tiles, one per thread; a thread walks its tiles
//! once per [`ROW_CHUNK`] rows and multiplies each tile by [`ROW_BLOCK`] rows at a time
//! (the block's sums stay in registers), so a decode step reads each weight once and a
//! prefill of many rows re-reads a tile from cache, not memory, within a chunk.

use crate::Result;
use crate::error::{check_len, product};
use crate::isa::Isa;
use crate::ops::matmul::MatmulDims;
use crate::ops::precision::{MatmulPrecision, round_to_bits};
use crate::ops::stored::{Bf16Bits, F32Exact, Widen};
use half::bf16;
use rayon::prelude::*;

/// Output columns per tile.
pub const TILE: usize = 32;
/// Rows whose sums share one pass over a tile (kept in registers).
pub const ROW_BLOCK: usize = 8;
/// Rows per pass over a thread's tiles: a tile stays in cache across the chunk's blocks.
pub const ROW_CHUNK: usize = 64;
/// How far ahead of its multiply-adds the AVX-512 kernel prefetches the weight stream. With
/// weights from memory (a 0.5B model's do not fit any cache) the hardware prefetcher alone
/// left an 8-row product at ~14 GB/s of weights against a 29 GB/s read limit; 4 KB ahead
/// gave 20–22 GB/s in f32 and 1.6–1.9× in bf16 (2–4 KB measured best of 0.25–4 KB).
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 4096;

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
    pack_tiles(src, k, m, dst, |v| bf16::from_f32(v).to_bits())
}

/// `src` `[k, m]` (row-major) into `dst` in the column-tile layout
/// [`linear_forward_t_tiles`] reads (see the module docs); the values are not changed.
///
/// # Errors
/// Lengths that do not match `k · m`.
pub fn pack_f32_tiles(src: &[f32], k: usize, m: usize, dst: &mut [f32]) -> Result<()> {
    pack_tiles(src, k, m, dst, |v| v)
}

fn pack_tiles<E: Copy + Send>(
    src: &[f32],
    k: usize,
    m: usize,
    dst: &mut [E],
    to: impl Fn(f32) -> E + Sync,
) -> Result<()> {
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
                    *d = to(v);
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
    tiled_product::<Bf16Bits>(Isa::active(), x, wt, bias, dims, out)
}

/// `out = x · W (+ bias)` with `x` `[n, k]`, `W` `[k, m]` packed by [`pack_f32_tiles`],
/// `out` `[n, m]`, both operands rounded to `precision`'s format for `n` rows
/// ([`MatmulPrecision::for_rows`]); see the module docs.
///
/// # Errors
/// Lengths that do not match `dims`, or a size that overflows.
pub fn linear_forward_t_tiles(
    precision: MatmulPrecision,
    x: &[f32],
    wt: &[f32],
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<()> {
    let p = precision.for_rows(dims.n);
    let x = p.rounded(x);
    let isa = Isa::active();
    match p {
        MatmulPrecision::F32 => tiled_product::<F32Exact>(isa, &x, wt, bias, dims, out),
        MatmulPrecision::Tf32 => tiled_product::<F32Rounded<13>>(isa, &x, wt, bias, dims, out),
        MatmulPrecision::Bf16 => tiled_product::<F32Rounded<16>>(isa, &x, wt, bias, dims, out),
    }
}

/// f32 rounded to nearest even with its `DROP` low significand bits cleared (TF32: 13,
/// bf16: 16), as [`MatmulPrecision::round`].
struct F32Rounded<const DROP: u32>;

impl<const DROP: u32> Widen for F32Rounded<DROP> {
    type Elem = f32;
    #[inline(always)]
    fn widen(e: f32) -> f32 {
        round_to_bits(e, DROP)
    }
    #[inline(always)]
    fn narrow(x: f32) -> f32 {
        round_to_bits(x, DROP)
    }
    // a reference mode (the GPU's TF32 / bf16 operands on the CPU), not a fast one
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        let mut v = [0.0f32; 16];
        for (i, d) in v.iter_mut().enumerate() {
            // SAFETY: the caller guarantees 16 readable f32 at `p`.
            *d = Self::widen(unsafe { *p.add(i) });
        }
        // SAFETY: `v` holds 16 floats.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(v.as_ptr()) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        let mut v = [0.0f32; 8];
        for (i, d) in v.iter_mut().enumerate() {
            // SAFETY: the caller guarantees 8 readable f32 at `p`.
            *d = Self::widen(unsafe { *p.add(i) });
        }
        // SAFETY: `v` holds 8 floats.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(v.as_ptr()) }
    }
}

/// `out = x · W (+ bias)`, `W` in column tiles of `W::Elem`, with `isa` (the CPU supports
/// it: [`Isa::active`], or a test's choice of a supported one).
fn tiled_product<W: Widen>(
    isa: Isa,
    x: &[f32],
    wt: &[W::Elem],
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
    if k == 0 {
        // no sums: every row is the bias (or 0)
        for row in out.chunks_exact_mut(m) {
            match bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
        }
        return Ok(());
    }
    // each block of rows transposed to [k][rows]: one slice of the rows' values per step
    // of the sum (by hand: `matmul::transpose`'s cache tiles cost ~15 % of an 8-row decode
    // product at k = 4 864, measured)
    let blocks: Vec<Vec<f32>> = x
        .chunks(ROW_BLOCK * k)
        .map(|b| {
            let rows = b.len() / k;
            let mut t = vec![0.0f32; b.len()];
            for (r, row) in b.chunks_exact(k).enumerate() {
                for (i, &v) in row.iter().enumerate() {
                    t[i * rows + r] = v;
                }
            }
            t
        })
        .collect();
    let tiles = m.div_ceil(TILE);
    let per = tiles.div_ceil(rayon::current_num_threads().clamp(1, tiles));
    let run = |c0: usize, c1: usize, out: &mut [f32]| {
        let part = Part {
            blocks: &blocks,
            wt,
            bias,
            k,
            c0,
            c1,
        };
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is one the CPU supports (the caller's contract).
            Isa::Avx512 | Isa::Amx => unsafe { part_avx512::<W>(&part, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { part_avx2::<W>(&part, out) },
            _ => part_loop::<W, PORTABLE>(&part, out),
        }
    };
    if per >= tiles {
        // one part (one thread): its rows are whole rows of `out`, written in place — a
        // part's buffer and its copy cost ~7 % of a one-thread decode step
        run(0, m, out);
        return Ok(());
    }
    let pieces: Vec<(usize, Vec<f32>)> = (0..tiles.div_ceil(per))
        .into_par_iter()
        .map(|p| {
            let (c0, c1) = (p * per * TILE, ((p + 1) * per * TILE).min(m));
            let mut local = vec![0.0f32; n * (c1 - c0)];
            run(c0, c1, &mut local);
            (c0, local)
        })
        .collect();
    for (c0, local) in pieces {
        let w = local.len() / n;
        for (r, row) in local.chunks_exact(w).enumerate() {
            out[r * m + c0..r * m + c0 + w].copy_from_slice(row);
        }
    }
    Ok(())
}

/// One thread's share of a product: columns `c0..c1` (whole tiles) of every row.
struct Part<'a, E> {
    /// Row blocks in order, each transposed to `[k][rows]`.
    blocks: &'a [Vec<f32>],
    wt: &'a [E],
    bias: Option<&'a [f32]>,
    k: usize,
    c0: usize,
    c1: usize,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn part_avx512<W: Widen>(part: &Part<'_, W::Elem>, out: &mut [f32]) {
    part_loop::<W, AVX512>(part, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn part_avx2<W: Widen>(part: &Part<'_, W::Elem>, out: &mut [f32]) {
    part_loop::<W, AVX2>(part, out);
}

/// The kernels [`part_loop`] multiplies full tiles with (a const parameter: the choice is
/// made once per part, not per tile).
const PORTABLE: u8 = 0;
#[cfg(target_arch = "x86_64")]
const AVX2: u8 = 1;
#[cfg(target_arch = "x86_64")]
const AVX512: u8 = 2;

/// Calls `$f::<W, R>(args…)` with `R` = `$rows` (1 ..= [`ROW_BLOCK`]): a fixed row count
/// per instance keeps the block's sums in registers.
macro_rules! by_row_count {
    ($rows:expr, $f:ident, $w:ty, ($($arg:expr),*)) => {
        match $rows {
            1 => $f::<$w, 1>($($arg),*),
            2 => $f::<$w, 2>($($arg),*),
            3 => $f::<$w, 3>($($arg),*),
            4 => $f::<$w, 4>($($arg),*),
            5 => $f::<$w, 5>($($arg),*),
            6 => $f::<$w, 6>($($arg),*),
            7 => $f::<$w, 7>($($arg),*),
            _ => $f::<$w, ROW_BLOCK>($($arg),*),
        }
    };
}

/// The tiles of `part` × its row blocks into `out` (every row, `c1 − c0` columns), a chunk
/// of [`ROW_CHUNK`] rows per pass over the tiles; full tiles by the `KERNEL`'s intrinsics.
#[inline(always)]
fn part_loop<W: Widen, const KERNEL: u8>(part: &Part<'_, W::Elem>, out: &mut [f32]) {
    let Part {
        blocks,
        wt,
        bias,
        k,
        c0,
        c1,
    } = *part;
    let width = c1 - c0;
    // every block but the last holds ROW_BLOCK rows, so block i starts at row i·ROW_BLOCK
    for (ch, chunk) in blocks.chunks(ROW_CHUNK / ROW_BLOCK).enumerate() {
        let mut c = c0;
        while c < c1 {
            let w = TILE.min(c1 - c);
            // this tile's k rows of w values, one stream (c is a multiple of TILE)
            let tile = &wt[c * k..c * k + w * k];
            let b = bias.map(|b| &b[c..c + w]);
            for (i, xt) in chunk.iter().enumerate() {
                let (r, rows) = (ch * ROW_CHUNK + i * ROW_BLOCK, xt.len() / k);
                let o = &mut out[r * width + (c - c0)..];
                #[cfg(target_arch = "x86_64")]
                if KERNEL == AVX512 && w == TILE {
                    // SAFETY: `AVX512` only under `part_avx512` (a path the CPU supports).
                    unsafe { by_row_count!(rows, tile_avx512, W, (xt, tile, b, o, width)) };
                    continue;
                }
                #[cfg(target_arch = "x86_64")]
                if KERNEL == AVX2 && w == TILE {
                    // SAFETY: `AVX2` only under `part_avx2` (a path the CPU supports).
                    unsafe { by_row_count!(rows, tile_avx2, W, (xt, tile, b, o, width)) };
                    continue;
                }
                by_row_count!(rows, tile_portable, W, (xt, tile, w, b, o, width));
            }
            c += w;
        }
    }
}

/// `R` rows (`xt`: `[k][R]`) times one tile (`k` rows of `w` weights) plus the tile's
/// bias, into `R` rows of `out` at stride `ld`.
#[inline(always)]
fn tile_portable<W: Widen, const R: usize>(
    xt: &[f32],
    tile: &[W::Elem],
    w: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    ld: usize,
) {
    let mut acc = [[0.0f32; TILE]; R];
    if let Some(b) = bias {
        for a in acc.iter_mut() {
            a[..w].copy_from_slice(b);
        }
    }
    let (xt, _) = xt.as_chunks::<R>();
    if w == TILE {
        for (row, xs) in tile.chunks_exact(TILE).zip(xt) {
            let mut wf = [0.0f32; TILE];
            for (f, &e) in wf.iter_mut().zip(row) {
                *f = W::widen(e);
            }
            for (a, &xv) in acc.iter_mut().zip(xs) {
                for (s, &f) in a.iter_mut().zip(&wf) {
                    *s = xv.mul_add(f, *s);
                }
            }
        }
    } else if w > 0 {
        for (row, xs) in tile.chunks_exact(w).zip(xt) {
            for (a, &xv) in acc.iter_mut().zip(xs) {
                for (s, &e) in a.iter_mut().zip(row) {
                    *s = xv.mul_add(W::widen(e), *s);
                }
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        out[r * ld..r * ld + w].copy_from_slice(&a[..w]);
    }
}

/// [`tile_portable`] for a full tile in explicit AVX-512: the 32 weights widened into two
/// registers, each of the `R` rows keeping its 32 sums in two more (at most 16 of the
/// 32). The compiler's vectorisation of the portable loop left the product compute-bound
/// at ~35 GFLOP/s on 2 cores (8 rows); this one streams the weights. Same fused
/// multiply-adds in the same order, so the same bits (test below).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn tile_avx512<W: Widen, const R: usize>(
    xt: &[f32],
    tile: &[W::Elem],
    bias: Option<&[f32]>,
    out: &mut [f32],
    ld: usize,
) {
    use std::arch::x86_64::{
        _MM_HINT_T0, _mm_prefetch, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_set1_ps,
        _mm512_setzero_ps, _mm512_storeu_ps,
    };
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    if let Some(b) = bias {
        for a in acc.iter_mut() {
            // SAFETY: `b` holds the tile's 32 floats; each load reads 16 of them.
            unsafe {
                a[0] = _mm512_loadu_ps(b.as_ptr());
                a[1] = _mm512_loadu_ps(b[16..].as_ptr());
            }
        }
    }
    let (xt, _) = xt.as_chunks::<R>();
    let ahead = PREFETCH_BYTES / size_of::<W::Elem>();
    let two_lines = TILE * size_of::<W::Elem>() > 64;
    for (row, xs) in tile.chunks_exact(TILE).zip(xt) {
        // the weights PREFETCH_BYTES ahead (into the next tile past this one's end: the
        // tiles are one stream), so memory and the multiply-adds overlap
        // (a prefetch never faults, whatever the address)
        let p = row.as_ptr().wrapping_add(ahead).cast::<i8>();
        _mm_prefetch::<_MM_HINT_T0>(p);
        if two_lines {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
        }
        // SAFETY: `row` holds 32 weights; each load reads 16 of them; AVX-512F is enabled.
        let (lo, hi) = unsafe { (W::load16(row.as_ptr()), W::load16(row[16..].as_ptr())) };
        for (a, &xv) in acc.iter_mut().zip(xs) {
            let v = _mm512_set1_ps(xv);
            a[0] = _mm512_fmadd_ps(v, lo, a[0]);
            a[1] = _mm512_fmadd_ps(v, hi, a[1]);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let o = &mut out[r * ld..r * ld + TILE];
        // SAFETY: `o` holds 32 floats; each store writes 16 of them.
        unsafe {
            _mm512_storeu_ps(o.as_mut_ptr(), a[0]);
            _mm512_storeu_ps(o[16..].as_mut_ptr(), a[1]);
        }
    }
}

/// [`tile_portable`] for a full tile in explicit AVX2: AVX2 has 16 registers of 8 floats,
/// too few for [`tile_avx512`]'s `R` rows × 32 sums, so the rows go in groups of at most
/// three, each a pass over the tile with its 3 × 32 sums in 12 registers (3 broadcasts
/// and 4 weight loads, one weight register at a time, feed 12 FMAs). The first pass reads the weights from memory and
/// prefetches them; the others find them in cache. The portable loop compiled for AVX2
/// spilled its sums (2 µops of memory per FMA). Same FMAs in the same order: same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn tile_avx2<W: Widen, const R: usize>(
    xt: &[f32],
    tile: &[W::Elem],
    bias: Option<&[f32]>,
    out: &mut [f32],
    ld: usize,
) {
    let mut first = 0;
    while first < R {
        let o = &mut out[first * ld..];
        first += match R - first {
            1 => tile_rows_avx2::<W, R, 1>(xt, first, tile, bias, o, ld),
            2 => tile_rows_avx2::<W, R, 2>(xt, first, tile, bias, o, ld),
            _ => tile_rows_avx2::<W, R, 3>(xt, first, tile, bias, o, ld),
        };
    }
}

/// Rows `first .. first + G` of a block of `R` (`xt`: `[k][R]`) times one full tile, into
/// `G` rows of `out` at stride `ld`; returns `G`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn tile_rows_avx2<W: Widen, const R: usize, const G: usize>(
    xt: &[f32],
    first: usize,
    tile: &[W::Elem],
    bias: Option<&[f32]>,
    out: &mut [f32],
    ld: usize,
) -> usize {
    use std::arch::x86_64::{
        __m256, _MM_HINT_T0, _mm_prefetch, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps,
        _mm256_setzero_ps, _mm256_storeu_ps,
    };
    const V: usize = TILE / 8;
    let mut acc = [[_mm256_setzero_ps(); V]; G];
    if let Some(b) = bias {
        for a in acc.iter_mut() {
            for (j, a) in a.iter_mut().enumerate() {
                // SAFETY: `b` holds the tile's 32 floats; each load reads 8 of them.
                *a = unsafe { _mm256_loadu_ps(b[8 * j..].as_ptr()) };
            }
        }
    }
    let (xt, _) = xt.as_chunks::<R>();
    let prefetch = first == 0;
    let ahead = PREFETCH_BYTES / size_of::<W::Elem>();
    let two_lines = TILE * size_of::<W::Elem>() > 64;
    for (row, xs) in tile.chunks_exact(TILE).zip(xt) {
        if prefetch {
            // as in `tile_avx512`: the weight stream PREFETCH_BYTES ahead (never faults)
            let p = row.as_ptr().wrapping_add(ahead).cast::<i8>();
            _mm_prefetch::<_MM_HINT_T0>(p);
            if two_lines {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
            }
        }
        let mut v = [_mm256_setzero_ps(); G];
        for (v, &xv) in v.iter_mut().zip(&xs[first..first + G]) {
            *v = _mm256_set1_ps(xv);
        }
        // one weight register at a time: G broadcasts + 1 weight + 4G sums ≤ 16 registers
        for j in 0..V {
            // SAFETY: `row` holds 32 weights; each load reads 8 of them; AVX2 is enabled.
            let w: __m256 = unsafe { W::load8(row[8 * j..].as_ptr()) };
            for (a, &v) in acc.iter_mut().zip(&v) {
                a[j] = _mm256_fmadd_ps(v, w, a[j]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let o = &mut out[r * ld..r * ld + TILE];
        for (j, a) in a.iter().enumerate() {
            // SAFETY: `o` holds 32 floats; each store writes 8 of them.
            unsafe { _mm256_storeu_ps(o[8 * j..].as_mut_ptr(), *a) };
        }
    }
    G
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::matmul::linear_forward_t;
    use crate::test_rng::rand_vec;

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
        assert_eq!(Bf16Bits::widen(dst[4]), -2.5);
        assert!(Bf16Bits::widen(dst[5]).is_nan());
        assert!(pack_bf16(&src, &mut [0u16; 5]).is_err());
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    /// `W` packed in column tiles of `E` by `to`.
    fn tiles<E: Copy + Send + Default>(w: &[f32], k: usize, m: usize, to: fn(f32) -> E) -> Vec<E> {
        let mut t = vec![E::default(); k * m];
        pack_tiles(w, k, m, &mut t, to).unwrap();
        t
    }

    /// Every path the CPU has (AVX-512 and AVX2 tiles) gives the portable code's bits (the
    /// same FMAs in the same order), for every stored format, row counts within a block,
    /// over several blocks and over more than a chunk, full and partial tiles, with and
    /// without a bias.
    #[test]
    fn every_path_equals_the_portable_code_bit_for_bit() {
        fn check<W: Widen>(x: &[f32], wt: &[W::Elem], b: Option<&[f32]>, dims: MatmulDims) {
            let MatmulDims { n, k, m } = dims;
            let mut want = vec![f32::NAN; n * m];
            tiled_product::<W>(Isa::Portable, x, wt, b, dims, &mut want).unwrap();
            for isa in [Isa::Avx2, Isa::Avx512]
                .into_iter()
                .filter(|i| i.supported())
            {
                let mut got = vec![f32::NAN; n * m];
                tiled_product::<W>(isa, x, wt, b, dims, &mut got).unwrap();
                assert_eq!(bits(&got), bits(&want), "{isa} {n}x{k}x{m}");
            }
        }
        for n in (1..=ROW_BLOCK).chain([9, 17, ROW_CHUNK + 3]) {
            for (k, m) in [(5, 32), (37, 96), (64, 70), (3, 7), (0, 40)] {
                let x = rand_vec(n * k, 4);
                let w = rand_vec(k * m, 5);
                let bias = rand_vec(m, 6);
                let dims = MatmulDims { n, k, m };
                for b in [None, Some(&bias[..])] {
                    check::<Bf16Bits>(
                        &x,
                        &tiles(&w, k, m, |v| bf16::from_f32(v).to_bits()),
                        b,
                        dims,
                    );
                    let t = tiles(&w, k, m, |v| v);
                    check::<F32Exact>(&x, &t, b, dims);
                    check::<F32Rounded<13>>(&x, &t, b, dims);
                }
            }
        }
    }

    /// Batch invariance: a row's outputs are the same bits alone, at any place in a batch of
    /// any size, and with any number of threads (another split of the tiles).
    #[test]
    fn a_row_gives_the_same_bits_in_any_batch() {
        let (k, m) = (96, 200);
        let w = tiles(&rand_vec(k * m, 7), k, m, |v| v);
        let wb = tiles(&rand_vec(k * m, 7), k, m, |v| bf16::from_f32(v).to_bits());
        let bias = rand_vec(m, 8);
        let x = rand_vec(80 * k, 9);
        let alone: Vec<(Vec<f32>, Vec<f32>)> = (0..80)
            .map(|r| {
                let dims = MatmulDims { n: 1, k, m };
                let (mut f, mut b) = (vec![0.0; m], vec![0.0; m]);
                let row = &x[r * k..(r + 1) * k];
                linear_forward_t_tiles(MatmulPrecision::F32, row, &w, Some(&bias), dims, &mut f)
                    .unwrap();
                linear_forward_t_bf16(row, &wb, Some(&bias), dims, &mut b).unwrap();
                (f, b)
            })
            .collect();
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                for (start, n) in [(0, 8), (5, 3), (10, 11), (0, 80), (7, 66)] {
                    let dims = MatmulDims { n, k, m };
                    let xs = &x[start * k..(start + n) * k];
                    let (mut f, mut b) = (vec![0.0; n * m], vec![0.0; n * m]);
                    linear_forward_t_tiles(MatmulPrecision::F32, xs, &w, Some(&bias), dims, &mut f)
                        .unwrap();
                    linear_forward_t_bf16(xs, &wb, Some(&bias), dims, &mut b).unwrap();
                    for r in 0..n {
                        let (af, ab) = &alone[start + r];
                        let at = r * m..(r + 1) * m;
                        assert_eq!(
                            bits(&f[at.clone()]),
                            bits(af),
                            "f32 row {} of {n}",
                            start + r
                        );
                        assert_eq!(bits(&b[at]), bits(ab), "bf16 row {} of {n}", start + r);
                    }
                }
            });
        }
    }

    /// f32 tiles against the row-major product in every precision (the same rounded
    /// operands, sums in another order).
    #[test]
    fn f32_tiles_equal_the_row_major_product() {
        use crate::ops::matmul::linear_forward_t_in;
        for (n, k, m) in [
            (1, 7, 5),
            (3, 64, 96),
            (9, 40, 31),
            (70, 128, 70),
            (2, 0, 3),
        ] {
            let x = rand_vec(n * k, 11);
            let w = rand_vec(k * m, 12);
            let t = tiles(&w, k, m, |v| v);
            let mut sorted = t.clone();
            sorted.sort_by(f32::total_cmp);
            let mut plain = w.clone();
            plain.sort_by(f32::total_cmp);
            assert_eq!(
                bits(&sorted),
                bits(&plain),
                "the tiles hold every weight once"
            );
            let bias = rand_vec(m, 13);
            let dims = MatmulDims { n, k, m };
            for p in [
                MatmulPrecision::F32,
                MatmulPrecision::Tf32,
                MatmulPrecision::Bf16,
            ] {
                for b in [None, Some(&bias[..])] {
                    let mut want = vec![f32::NAN; n * m];
                    linear_forward_t_in(p, &x, &w, b, dims, &mut want).unwrap();
                    let mut got = vec![f32::NAN; n * m];
                    linear_forward_t_tiles(p, &x, &t, b, dims, &mut got).unwrap();
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                            "{p:?} {n}x{k}x{m} [{i}]: {g} vs {w}"
                        );
                    }
                }
            }
        }
        // TF32 rounds: a weight of 1 + 2⁻¹² times 1 is 1 in TF32, not in f32
        let w = [1.0 + 2f32.powi(-12)];
        let dims = MatmulDims { n: 1, k: 1, m: 1 };
        let mut out = [0.0f32];
        linear_forward_t_tiles(MatmulPrecision::Tf32, &[1.0], &w, None, dims, &mut out).unwrap();
        assert_eq!(out[0], 1.0);
        linear_forward_t_tiles(MatmulPrecision::F32, &[1.0], &w, None, dims, &mut out).unwrap();
        assert_eq!(out[0], w[0]);
        let e = linear_forward_t_tiles(
            MatmulPrecision::F32,
            &[0.0; 6],
            &[0.0; 11],
            None,
            MatmulDims { n: 2, k: 3, m: 4 },
            &mut [0.0; 8],
        )
        .unwrap_err();
        assert!(e.to_string().contains("wt"), "{e}");
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
            let x = rand_vec(n * k, 1);
            let w = rand_vec(k * m, 2);
            let mut bits = vec![0u16; k * m];
            pack_bf16(&w, &mut bits).unwrap();
            let widened: Vec<f32> = bits.iter().map(|&b| Bf16Bits::widen(b)).collect();
            let mut tiles = vec![0u16; k * m];
            pack_bf16_tiles(&w, k, m, &mut tiles).unwrap();
            let mut sorted = tiles.clone();
            sorted.sort_unstable();
            let mut plain = bits.clone();
            plain.sort_unstable();
            assert_eq!(sorted, plain, "the tiles hold every rounded weight once");
            let bits = tiles;
            let bias = rand_vec(m, 3);
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
