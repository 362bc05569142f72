//! Linear layers and matrix products on the `gemm` crate.
//!
//! `gemm` takes a row and a column stride for every operand, so the transposed products of
//! the backward pass (`dout · W`, `doutᵀ · x`) and per-head attention products read the
//! original buffers with swapped or widened strides instead of materialising copies, and
//! its "read the destination" flag gives the `+=` accumulation that gradients need.
//!
//! - [`linear_forward`] / [`linear_backward`]: `y = x · Wᵀ + b` with `W` as `[out, in]`.
//! - [`matmul`]: plain `c = a · b` on contiguous row-major matrices.
//! - [`matmul_batched`]: `c = β·c + α·a·b` over a batch of strided matrices (attention).

use crate::error::{check_len, product};
use ares_core::Error as CoreError;
use gemm::Parallelism;
use rayon::prelude::*;

use crate::Result;
use crate::isa::Isa;
use crate::ops::matmul_amx;
use crate::ops::precision::{MatmulPrecision, map_elements};
use crate::ops::stored::{Bf16Bits, Widen};
use std::borrow::Cow;

/// Sizes of a matrix product `[n, k] · [k, m] → [n, m]`.
///
/// For a linear layer: `n` rows (tokens), `k` input features, `m` output features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    /// Rows of the left operand and of the result.
    pub n: usize,
    /// The contracted dimension: columns of the left operand, rows of the right one.
    pub k: usize,
    /// Columns of the right operand and of the result.
    pub m: usize,
}

/// Where the matrices of a batch lie inside one slice: element `(b, i, j)` (matrix `b`, row
/// `i`, column `j`) is at `offset + b·batch_stride + i·row_stride + j·col_stride`.
///
/// Strides are free to be anything that stays inside the slice, so transposes and heads
/// interleaved in a `[tokens, heads·head_dim]` activation need no copy: head `h` of such
/// an activation is `MatLayout { offset: 0, batch_stride: head_dim, row_stride:
/// heads·head_dim, col_stride: 1 }` with the batch running over heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatLayout {
    /// Position of element `(0, 0, 0)`.
    pub offset: usize,
    /// Distance between consecutive matrices of the batch.
    pub batch_stride: usize,
    /// Distance between consecutive rows.
    pub row_stride: usize,
    /// Distance between consecutive columns.
    pub col_stride: usize,
}

impl MatLayout {
    /// Contiguous row-major `[batch, rows, cols]` matrices, one after the other.
    pub const fn row_major(rows: usize, cols: usize) -> Self {
        Self {
            offset: 0,
            // Saturating: an overflowing stride then fails the bounds check instead of wrapping.
            batch_stride: rows.saturating_mul(cols),
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transposed view: element `(b, i, j)` of the result is element `(b, j, i)` of `self`.
    pub const fn t(self) -> Self {
        Self {
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// The same layout starting at `offset`.
    pub const fn at(self, offset: usize) -> Self {
        Self { offset, ..self }
    }
}

/// A read-only batch of strided matrices: a slice and where the elements lie in it.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    /// The storage.
    pub data: &'a [f32],
    /// Where element `(b, i, j)` lies in `data`.
    pub layout: MatLayout,
}

/// A writable batch of strided matrices: a slice and where the elements lie in it.
#[derive(Debug)]
pub struct MatMut<'a> {
    /// The storage.
    pub data: &'a mut [f32],
    /// Where element `(b, i, j)` lies in `data`; no two elements may share a position.
    pub layout: MatLayout,
}

/// Linear layer forward: `out[n, m] = x[n, k] · w[m, k]ᵀ (+ bias[m])`, i.e.
/// `out[i, j] = Σ_l x[i, l]·w[j, l] + bias[j]`.
///
/// `w` is `[out_features, in_features]` (the Hugging Face layout). `out` is overwritten
/// (its previous contents are never read, so it may hold garbage).
///
/// # Errors
/// A length that does not match `dims` (`x`: `n·k`, `w`: `m·k`, `bias`: `m`, `out`: `n·m`).
pub fn linear_forward(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<()> {
    linear_forward_in(MatmulPrecision::F32, x, w, bias, dims, out)
}

/// [`linear_forward`] with the operands `x` and `w` rounded to `precision` (as
/// [`MatmulPrecision::for_rows`] with `dims.n` rows decides); the bias is added in f32.
///
/// # Errors
/// As [`linear_forward`].
pub fn linear_forward_in(
    precision: MatmulPrecision,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<()> {
    linear_forward_w(
        precision.for_rows(dims.n),
        Operand::F32(x),
        Operand::F32(w),
        bias,
        dims,
        out,
    )
}

/// [`linear_forward`] in bf16 with the weight already stored in bf16: `w16` `[m, k]` holds
/// bf16 bits (`torch.bfloat16`'s), widened exactly; `x` is rounded to bf16; products and sums
/// in f32. Always bf16, whatever the number of rows. For any f32 `w` that rounds to `w16`
/// the result is the bits of [`linear_forward_in`] in [`MatmulPrecision::Bf16`] over `w`
/// (at [`BF16_MIN_ROWS`](crate::ops::precision::BF16_MIN_ROWS) rows or more): a model that
/// keeps a bf16 copy of its weights multiplies by it without rounding them per product.
///
/// # Errors
/// As [`linear_forward`] (`w16`: `m·k`).
pub fn linear_forward_bf16(
    x: &[f32],
    w16: &[u16],
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<()> {
    linear_forward_w(
        MatmulPrecision::Bf16,
        Operand::F32(x),
        Operand::Bf16(w16),
        bias,
        dims,
        out,
    )
}

/// [`linear_forward_bf16`] with the input stored in bf16 too: `x16` `[n, k]` bits, widened
/// exactly, so the result is the bits of [`linear_forward_bf16`] over the widened `x16` (a
/// bf16 activation multiplied as it is stored, with no rounding of its own).
///
/// # Errors
/// As [`linear_forward`] (`x16`: `n·k`, `w16`: `m·k`).
pub fn linear_forward_bf16_x(
    x16: &[u16],
    w16: &[u16],
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<()> {
    let (x, w) = (Operand::Bf16(x16), Operand::Bf16(w16));
    linear_forward_w(MatmulPrecision::Bf16, x, w, bias, dims, out)
}

/// [`linear_forward_bf16_x`] with the output stored in bf16: each element of
/// `x16 · w16ᵀ (+ bias)`, summed in f32, rounded once to the nearest bf16 (ties to even)
/// into `out16` — a projection whose output is an activation stored in bf16. (The f32
/// result is made in a scratch of `n·m` floats first; the CUDA twin writes bf16 from the
/// GEMM.)
///
/// # Errors
/// As [`linear_forward_bf16_x`] (`out16`: `n·m`); nothing is written then.
pub fn linear_forward_bf16_io(
    x16: &[u16],
    w16: &[u16],
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out16: &mut [u16],
) -> Result<()> {
    check_len("out", product(dims.n, dims.m)?, out16.len())?;
    let mut out = vec![0.0f32; out16.len()];
    linear_forward_bf16_x(x16, w16, bias, dims, &mut out)?;
    map_elements(&out, out16, Bf16Bits::narrow);
    Ok(())
}

/// A product's operand as stored: f32, or bf16 bits (a linear layer's weight).
#[derive(Clone, Copy)]
enum Operand<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> Operand<'a> {
    fn len(self) -> usize {
        match self {
            Self::F32(w) => w.len(),
            Self::Bf16(w) => w.len(),
        }
    }

    /// The operand the product multiplies by in precision `p` (already decided for the
    /// rows): f32 elements rounded to `p`, bf16 ones widened (exact; `p` is then bf16).
    fn operand(self, p: MatmulPrecision) -> Cow<'a, [f32]> {
        match self {
            Self::F32(w) => p.rounded(w),
            Self::Bf16(w) => Cow::Owned(widen_bf16(w)),
        }
    }

    /// The operand as the AMX product packs it (rounding f32 elements to bf16).
    fn elems(self) -> matmul_amx::Elems<'a> {
        match self {
            Self::F32(w) => matmul_amx::Elems::F32(w),
            Self::Bf16(w) => matmul_amx::Elems::Bf16(w),
        }
    }
}

/// Whether products in precision `p` run on AMX tiles: bf16 on the `amx` path.
fn on_tiles(p: MatmulPrecision) -> bool {
    p == MatmulPrecision::Bf16 && Isa::active() == Isa::Amx
}

/// `c = beta·c + a·b` with the operands as stored, rounded to `p` (already decided for the
/// rows): in bf16 on the `amx` path on AMX tiles (`matmul_amx`), else the rounded
/// operands through `gemm`'s f32 product. `beta = 0` never reads `c`.
///
/// # Safety
/// As [`gemm_raw`].
#[allow(clippy::too_many_arguments)] // a GEMM's own argument list
unsafe fn product_in(
    p: MatmulPrecision,
    d: MatmulDims,
    a: Operand<'_>,
    sa: Strides,
    b: Operand<'_>,
    sb: Strides,
    c: *mut f32,
    sc: Strides,
    beta: f32,
) {
    if on_tiles(p)
        && let (Some(la), Some(lb), Some(lc)) = (sa.amx(), sb.amx(), sc.amx())
    {
        // SAFETY: the path is `amx` only where `isa::amx_available()`; the rest is
        // the caller's contract (the same as `gemm_raw`'s).
        unsafe {
            matmul_amx::product(
                d.n,
                d.k,
                d.m,
                a.elems(),
                la,
                b.elems(),
                lb,
                c,
                lc,
                1.0,
                beta,
                true,
            )
        };
        return;
    }
    let (a, b) = (a.operand(p), b.operand(p));
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        gemm_raw(
            d,
            a.as_ptr(),
            sa,
            b.as_ptr(),
            sb,
            c,
            sc,
            1.0,
            beta,
            parallelism(d),
        );
    }
}

/// bf16 bits widened to f32 (exact), in parallel for large slices.
fn widen_bf16(src: &[u16]) -> Vec<f32> {
    let mut out = vec![0.0f32; src.len()];
    map_elements(src, &mut out, Bf16Bits::widen);
    out
}

/// [`linear_forward_in`] with the weight as stored and the precision `p` already decided
/// for the rows.
fn linear_forward_w(
    p: MatmulPrecision,
    x: Operand<'_>,
    w: Operand<'_>,
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<()> {
    check_len("w", product(dims.m, dims.k)?, w.len())?;
    // wᵀ: element (l, j) of the right operand is w[j, l].
    let sw = Strides::row_major(dims.k)?.t();
    linear_with(p, x, w, sw, bias, dims, out)
}

/// [`linear_forward`] with the weight stored transposed: `out[n, m] = x[n, k] · wt[k, m]
/// (+ bias[m])`, `wt` `[in_features, out_features]` row-major (see [`transpose`]).
///
/// Same numbers as [`linear_forward`] up to summation order, but for a few rows of `x`
/// (one generated token per sequence) several times faster: the GEMM reads this layout
/// as it is, where the Hugging Face layout is first copied into panels on every call.
///
/// # Errors
/// A length that does not match `dims` (`x`: `n·k`, `wt`: `k·m`, `bias`: `m`, `out`: `n·m`).
pub fn linear_forward_t(
    x: &[f32],
    wt: &[f32],
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<()> {
    linear_forward_t_in(MatmulPrecision::F32, x, wt, bias, dims, out)
}

/// [`linear_forward_t`] with the operands rounded to `precision` (as
/// [`linear_forward_in`]).
///
/// # Errors
/// As [`linear_forward_t`].
pub fn linear_forward_t_in(
    precision: MatmulPrecision,
    x: &[f32],
    wt: &[f32],
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<()> {
    check_len("wt", product(dims.k, dims.m)?, wt.len())?;
    let p = precision.for_rows(dims.n);
    let sw = Strides::row_major(dims.m)?;
    linear_with(p, Operand::F32(x), Operand::F32(wt), sw, bias, dims, out)
}

/// `out = x · W (+ bias)` with the right operand `W` `[k, m]` at `w` under strides `sw`
/// (the caller checked `w` holds every element they address).
fn linear_with(
    p: MatmulPrecision,
    x: Operand<'_>,
    w: Operand<'_>,
    sw: Strides,
    bias: Option<&[f32]>,
    dims: MatmulDims,
    out: &mut [f32],
) -> Result<()> {
    let MatmulDims { n, k, m } = dims;
    check_len("x", product(n, k)?, x.len())?;
    check_len("out", product(n, m)?, out.len())?;
    let beta = match bias {
        Some(b) => {
            check_len("bias", m, b.len())?;
            // Start every row from the bias and let the GEMM add onto it: one pass over `out`.
            for row in out.chunks_exact_mut(m.max(1)) {
                row.copy_from_slice(b);
            }
            1.0
        }
        None => 0.0,
    };
    // SAFETY: the lengths were checked above and by the caller (for `w` under `sw`), so
    // every addressed element is in bounds; `out` is a unique borrow, so it overlaps
    // neither input, and row-major strides with `m` columns map distinct elements to
    // distinct positions.
    unsafe {
        product_in(
            p,
            dims,
            x,
            Strides::row_major(k)?,
            w,
            sw,
            out.as_mut_ptr(),
            Strides::row_major(m)?,
            beta,
        );
    }
    Ok(())
}

/// `dst[cols, rows] = src[rows, cols]ᵀ`, row-major both, in cache-sized tiles, rows of
/// `dst` in parallel for large matrices.
///
/// # Errors
/// `src` or `dst` not `rows · cols` long.
pub fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) -> Result<()> {
    const TILE: usize = 64;
    let len = product(rows, cols)?;
    check_len("src", len, src.len())?;
    check_len("dst", len, dst.len())?;
    if len == 0 {
        return Ok(());
    }
    // A band of TILE rows of dst (= TILE columns of src), filled tile by tile: each dst
    // row segment is written contiguously from a TILE × TILE block of src that stays in L1
    // (182 → 79 ms for the 151936 × 896 LM head on 2 threads; TILE 32: 109 ms, 128: 76 ms
    // with half the parallel bands).
    let band = |(b, out): (usize, &mut [f32])| {
        let c0 = b * TILE;
        let width = out.len() / rows;
        for r0 in (0..rows).step_by(TILE) {
            let h = TILE.min(rows - r0);
            for c in 0..width {
                let start = c * rows + r0;
                let (Some(dst), Some(from)) =
                    (out.get_mut(start..start + h), src.get(r0 * cols + c0 + c..))
                else {
                    continue; // not reached: the band and tile bounds are in range
                };
                for (d, s) in dst.iter_mut().zip(from.iter().step_by(cols)) {
                    *d = *s;
                }
            }
        }
    };
    if len >= PAR_MIN_ELEMS {
        dst.par_chunks_mut(TILE * rows).enumerate().for_each(band);
    } else {
        dst.chunks_mut(TILE * rows).enumerate().for_each(band);
    }
    Ok(())
}

/// Linear layer backward for `y = x · wᵀ + b` (shapes as in [`linear_forward`]), given
/// `dout = ∂L/∂y` `[n, m]`. Every gradient is **accumulated** (`+=`), since shared weights
/// and micro-batches add up:
///
/// - `dx[n, k] += dout · w`            (`dx[i, l] += Σ_j dout[i, j]·w[j, l]`), skipped if `None`;
/// - `dw[m, k] += doutᵀ · x`           (`dw[j, l] += Σ_i dout[i, j]·x[i, l]`), skipped if `None`
///   (a frozen weight);
/// - `dbias[m] += Σ_i dout[i, ·]`, skipped if `None`.
///
/// The bias sum runs over rows in order for every thread count (deterministic).
///
/// # Errors
/// A length that does not match `dims` (`dout`: `n·m`, `x`, `dx`: `n·k`, `w`, `dw`: `m·k`,
/// `dbias`: `m`); nothing is written then.
pub fn linear_backward(
    dout: &[f32],
    x: &[f32],
    w: &[f32],
    dims: MatmulDims,
    dx: Option<&mut [f32]>,
    dw: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
) -> Result<()> {
    let add = Overwrite::NONE;
    linear_backward_in(MatmulPrecision::F32, dout, x, w, dims, add, dx, dw, dbias)
}

/// Which gradients of a linear backward are written over — the product alone, the old
/// contents never read (a BLAS `β = 0`) — rather than added into (`β = 1`): the bits of a
/// zero fill followed by the accumulation, up to the sign of a zero. The bias gradient
/// always adds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overwrite {
    /// The input gradient `dx`.
    pub dx: bool,
    /// The weight gradient `dw`.
    pub dw: bool,
}

impl Overwrite {
    /// Every gradient added into.
    pub const NONE: Self = Self {
        dx: false,
        dw: false,
    };
}

/// [`linear_backward`] with the operands of both products (`dout`, `w`; `dout`, `x`)
/// rounded to `precision` (as [`MatmulPrecision::for_rows`] with `dims.n` rows decides);
/// the bias gradient sums the unrounded `dout` in f32. The input and weight gradients are
/// written (`dx = dout · w`, `dw = doutᵀ · x`, the old contents never read) instead of
/// added where `overwrite` says.
///
/// # Errors
/// As [`linear_backward`]; nothing is written then.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_in(
    precision: MatmulPrecision,
    dout: &[f32],
    x: &[f32],
    w: &[f32],
    dims: MatmulDims,
    overwrite: Overwrite,
    dx: Option<&mut [f32]>,
    dw: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
) -> Result<()> {
    let p = precision.for_rows(dims.n);
    linear_backward_w(
        p,
        dout,
        Operand::F32(x),
        Operand::F32(w),
        dims,
        overwrite,
        dx,
        dw,
        dbias,
    )
}

/// [`linear_backward`] in bf16 with the weight stored in bf16 bits `w16` (as
/// [`linear_forward_bf16`]): `dout`, `x` rounded to bf16, `w16` widened, whatever the
/// number of rows; the bits of [`linear_backward_in`] in [`MatmulPrecision::Bf16`] over any
/// f32 weight that rounds to `w16` (at `BF16_MIN_ROWS` rows or more).
///
/// # Errors
/// As [`linear_backward`]; nothing is written then.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_bf16(
    dout: &[f32],
    x: &[f32],
    w16: &[u16],
    dims: MatmulDims,
    overwrite: Overwrite,
    dx: Option<&mut [f32]>,
    dw: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
) -> Result<()> {
    let p = MatmulPrecision::Bf16;
    linear_backward_w(
        p,
        dout,
        Operand::F32(x),
        Operand::Bf16(w16),
        dims,
        overwrite,
        dx,
        dw,
        dbias,
    )
}

/// [`linear_backward_bf16`] with the forward's input stored in bf16 (`x16`, as
/// [`linear_forward_bf16_x`]): the bits of [`linear_backward_bf16`] over the widened `x16`.
///
/// # Errors
/// As [`linear_backward`]; nothing is written then.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_bf16_x(
    dout: &[f32],
    x16: &[u16],
    w16: &[u16],
    dims: MatmulDims,
    overwrite: Overwrite,
    dx: Option<&mut [f32]>,
    dw: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
) -> Result<()> {
    let (x, w) = (Operand::Bf16(x16), Operand::Bf16(w16));
    let p = MatmulPrecision::Bf16;
    linear_backward_w(p, dout, x, w, dims, overwrite, dx, dw, dbias)
}

/// [`linear_backward_in`] with the weight as stored and the precision `p` already decided
/// for the rows.
#[allow(clippy::too_many_arguments)]
fn linear_backward_w(
    p: MatmulPrecision,
    dout: &[f32],
    x: Operand<'_>,
    w: Operand<'_>,
    dims: MatmulDims,
    overwrite: Overwrite,
    dx: Option<&mut [f32]>,
    dw: Option<&mut [f32]>,
    dbias: Option<&mut [f32]>,
) -> Result<()> {
    let MatmulDims { n, k, m } = dims;
    let (nk, mk, nm) = (product(n, k)?, product(m, k)?, product(n, m)?);
    check_len("dout", nm, dout.len())?;
    check_len("x", nk, x.len())?;
    check_len("w", mk, w.len())?;
    if let Some(dw) = dw.as_deref() {
        check_len("dw", mk, dw.len())?;
    }
    if let Some(dx) = dx.as_deref() {
        check_len("dx", nk, dx.len())?;
    }
    if let Some(db) = dbias.as_deref() {
        check_len("dbias", m, db.len())?;
    }
    let (row_m, row_k) = (Strides::row_major(m)?, Strides::row_major(k)?);
    if let Some(db) = dbias {
        bias_backward(dout, m, db);
    }
    // rounded once for both products (the AMX product rounds as it packs; a bf16 `x` is
    // widened, exactly)
    let amx = on_tiles(p);
    let dout = if amx {
        Cow::Borrowed(dout)
    } else {
        p.rounded(dout)
    };
    let widened;
    let x = if amx {
        x
    } else {
        widened = x.operand(p);
        Operand::F32(&widened)
    };
    let dout = Operand::F32(&dout);
    let q = if amx { p } else { MatmulPrecision::F32 };

    if let Some(dx) = dx {
        // dx[n, k] (+)= dout[n, m] · w[m, k]; `w` is only needed (and rounded) here
        let d = MatmulDims { n, k: m, m: k };
        let beta = if overwrite.dx { 0.0 } else { 1.0 };
        let rounded;
        let w = match amx {
            true => w,
            false => {
                rounded = w.operand(p);
                Operand::F32(&rounded)
            }
        };
        // SAFETY: lengths checked above; `dx` is a unique borrow with row-major strides.
        unsafe { product_in(q, d, dout, row_m, w, row_k, dx.as_mut_ptr(), row_k, beta) };
    }

    // dw[m, k] (+)= dout[n, m]ᵀ · x[n, k] (none for a frozen weight)
    let Some(dw) = dw else { return Ok(()) };
    if overwrite.dw && n == 0 {
        // an empty sum over no rows, written: zeros
        dw.fill(0.0);
        return Ok(());
    }
    let d = MatmulDims { n: m, k: n, m: k };
    let beta = if overwrite.dw { 0.0 } else { 1.0 };
    // SAFETY: lengths checked above; `dw` is a unique borrow with row-major strides.
    unsafe {
        product_in(
            q,
            d,
            dout,
            row_m.t(),
            x,
            row_k,
            dw.as_mut_ptr(),
            row_k,
            beta,
        )
    };
    Ok(())
}

/// `dbias[j] += Σ_i dout[i, j]` over the rows of `dout` `[n, m]`, `m = dbias.len()`.
fn bias_backward(dout: &[f32], m: usize, dbias: &mut [f32]) {
    // Each task owns a block of columns and walks every row in order, so each sum has the
    // same order for any thread count, and the inner loop is a contiguous, vectorisable add.
    const COLS: usize = 256;
    let add_block = |(block, db): (usize, &mut [f32])| {
        let c0 = block * COLS;
        for row in dout.chunks_exact(m.max(1)) {
            if let Some(src) = row.get(c0..c0 + db.len()) {
                for (d, s) in db.iter_mut().zip(src) {
                    *d += s;
                }
            }
        }
    };
    if dout.len() >= PAR_MIN_ELEMS {
        dbias.par_chunks_mut(COLS).enumerate().for_each(add_block);
    } else {
        dbias.chunks_mut(COLS).enumerate().for_each(add_block);
    }
}

/// Plain matrix product of contiguous row-major matrices: `c[n, m] = a[n, k] · b[k, m]`
/// (`c[i, j] = Σ_l a[i, l]·b[l, j]`). `c` is overwritten without being read.
///
/// # Errors
/// A length that does not match `dims` (`a`: `n·k`, `b`: `k·m`, `c`: `n·m`).
pub fn matmul(a: &[f32], b: &[f32], dims: MatmulDims, c: &mut [f32]) -> Result<()> {
    let MatmulDims { n, k, m } = dims;
    check_len("a", product(n, k)?, a.len())?;
    check_len("b", product(k, m)?, b.len())?;
    check_len("c", product(n, m)?, c.len())?;
    // SAFETY: lengths checked above; `c` is a unique borrow with row-major strides.
    unsafe {
        gemm_raw(
            dims,
            a.as_ptr(),
            Strides::row_major(k)?,
            b.as_ptr(),
            Strides::row_major(m)?,
            c.as_mut_ptr(),
            Strides::row_major(m)?,
            1.0,
            0.0,
            parallelism(dims),
        );
    }
    Ok(())
}

/// Batched strided product: for every `b < batch`,
/// `c[b] = beta·c[b] + alpha·a[b] · b[b]` with `a[b]` `[n, k]`, `b[b]` `[k, m]`, `c[b]` `[n, m]`,
/// each laid out as its [`MatLayout`] says.
///
/// `beta = 0` overwrites `c` without reading it (the BLAS convention: it may hold garbage);
/// `beta = 1` accumulates. Transposed operands are a matter of layout ([`MatLayout::t`]);
/// e.g. attention scores of one head are `q · kᵀ`, with `alpha = 1/√head_dim`.
///
/// Small matrices run one per thread across the batch; large ones run one after the other,
/// each spread over all threads.
///
/// # Errors
/// - `LengthMismatch` if a layout reaches past the end of its slice (`expected` is then the
///   smallest length that would hold it);
/// - `OutOfRange` for `c.layout` if two elements of `c` share a position, or for `alpha` /
///   `beta` if not finite. Nothing is written then.
pub fn matmul_batched(
    batch: usize,
    dims: MatmulDims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: MatMut<'_>,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    matmul_batched_with(batch, dims, a, b, c, alpha, beta, true, false)
}

/// One strided product `c = beta·c + alpha·a·b` ([`matmul_batched`] with a batch of 1) on
/// the calling thread: for kernels that already run one task per thread.
pub(crate) fn matmul_seq(
    dims: MatmulDims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: MatMut<'_>,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    matmul_batched_with(1, dims, a, b, c, alpha, beta, false, false)
}

/// [`matmul_seq`] of operands that already hold bf16 values when `bf16` (the bf16 attention
/// twins' rounded copies of q, k, v, dout and their rounded probabilities): on the `amx`
/// path on AMX tiles, elsewhere `gemm`'s f32 product — the same exact products summed in
/// f32 either way, in another order. With `bf16` false, or operands the tiles cannot
/// address (a batch, a negative stride, `k = 0`), [`matmul_seq`] itself.
///
/// # Errors
/// As [`matmul_seq`].
pub(crate) fn matmul_seq_rounded(
    bf16: bool,
    dims: MatmulDims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: MatMut<'_>,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    matmul_batched_with(1, dims, a, b, c, alpha, beta, false, bf16)
}

/// [`matmul_batched`], multithreaded only when `parallel`; one product of operands that
/// hold bf16 values (`bf16`) on AMX tiles on the `amx` path (see [`matmul_seq_rounded`]).
#[allow(clippy::too_many_arguments)]
fn matmul_batched_with(
    batch: usize,
    dims: MatmulDims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: MatMut<'_>,
    alpha: f32,
    beta: f32,
    parallel: bool,
    bf16: bool,
) -> Result<()> {
    let MatmulDims { n, k, m } = dims;
    check_finite("alpha", alpha)?;
    check_finite("beta", beta)?;
    let sa = check_layout("a", a.data.len(), a.layout, [batch, n, k])?;
    let sb = check_layout("b", b.data.len(), b.layout, [batch, k, m])?;
    let sc = check_layout("c", c.data.len(), c.layout, [batch, n, m])?;
    check_no_overlap(c.layout, [batch, n, m])?;
    if batch == 0 || n == 0 || m == 0 {
        return Ok(());
    }
    if bf16
        && batch == 1
        && k > 0
        && on_tiles(MatmulPrecision::Bf16)
        && let (Some(la), Some(lb), Some(lc)) = (sa.mat.amx(), sb.mat.amx(), sc.mat.amx())
    {
        // `check_layout` proved every element in bounds (the operands are non-empty
        // here), so the offsets are too.
        let (a, b) = (&a.data[a.layout.offset..], &b.data[b.layout.offset..]);
        let pc = c.data[c.layout.offset..].as_mut_ptr();
        // SAFETY: the path is `amx` only where `isa::amx_available()`; the layouts were
        // checked above (every element of each operand in bounds, distinct elements of
        // `c` at distinct positions); `c` is a unique borrow, so it overlaps neither.
        unsafe {
            matmul_amx::product(
                n,
                k,
                m,
                matmul_amx::Elems::F32(a),
                la,
                matmul_amx::Elems::F32(b),
                lb,
                pc,
                lc,
                alpha,
                beta,
                parallel,
            );
        }
        return Ok(());
    }
    // Pointers to element (0, 0, 0) of each operand; `check_layout` proved the offsets in
    // bounds (the batch, rows and columns are non-empty here).
    let pa = SendPtr(a.data.as_ptr().wrapping_add(a.layout.offset).cast_mut());
    let pb = SendPtr(b.data.as_ptr().wrapping_add(b.layout.offset).cast_mut());
    let pc = SendPtr(c.data.as_mut_ptr().wrapping_add(c.layout.offset));
    let (ba, bb, bc) = (sa.batch, sb.batch, sc.batch);
    // SAFETY (for each call): `check_layout` proved every element of matrix `i` of each operand
    // in bounds; `check_no_overlap` proved that distinct elements of `c` (within a matrix and
    // across the batch) have distinct positions, so concurrent calls write disjoint elements;
    // `c` is a unique borrow, so it overlaps neither `a` nor `b`.
    let one = |i: usize, par: Parallelism| unsafe {
        let i = i as isize;
        gemm_raw(
            dims,
            pa.get().wrapping_offset(i * ba),
            sa.mat,
            pb.get().wrapping_offset(i * bb),
            sb.mat,
            pc.get().wrapping_offset(i * bc),
            sc.mat,
            alpha,
            beta,
            par,
        );
    };
    let per_matrix = if parallel {
        parallelism(dims)
    } else {
        Parallelism::None
    };
    if !parallel {
        for i in 0..batch {
            one(i, Parallelism::None);
        }
    } else if batch > 1 && matches!(per_matrix, Parallelism::None) {
        // Small matrices: spread the batch over threads, each product single-threaded.
        (0..batch)
            .into_par_iter()
            .for_each(|i| one(i, Parallelism::None));
    } else {
        for i in 0..batch {
            one(i, per_matrix);
        }
    }
    Ok(())
}

/// Products with fewer multiply-adds than this run on one thread: rayon's hand-off costs
/// more than it saves.
const PAR_MIN_FLOPS: usize = 1 << 18;
/// Element-wise passes over fewer elements than this run on one thread.
const PAR_MIN_ELEMS: usize = 1 << 16;

fn parallelism(d: MatmulDims) -> Parallelism {
    if d.n.saturating_mul(d.k).saturating_mul(d.m) >= PAR_MIN_FLOPS {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

/// Row and column strides of one matrix, as `gemm` takes them.
#[derive(Clone, Copy, Debug)]
struct Strides {
    row: isize,
    col: isize,
}

impl Strides {
    /// Row-major with `cols` columns.
    fn row_major(cols: usize) -> Result<Self> {
        Ok(Self {
            row: to_isize("cols", cols)?,
            col: 1,
        })
    }

    fn t(self) -> Self {
        Self {
            row: self.col,
            col: self.row,
        }
    }

    /// The strides as the AMX product takes them: `None` if one is negative.
    fn amx(self) -> Option<matmul_amx::Layout> {
        Some(matmul_amx::Layout {
            row: usize::try_from(self.row).ok()?,
            col: usize::try_from(self.col).ok()?,
        })
    }
}

/// Strides of a validated batched layout.
#[derive(Clone, Copy, Debug)]
struct BatchStrides {
    batch: isize,
    mat: Strides,
}

/// `c = beta·c + alpha·a·b` for one `[n, k]·[k, m]` product at raw positions.
///
/// # Safety
/// For all `i < n`, `l < k`, `j < m` the positions `a + i·sa.row + l·sa.col`,
/// `b + l·sb.row + j·sb.col` and `c + i·sc.row + j·sc.col` lie inside live allocations;
/// distinct `(i, j)` give distinct positions of `c`; no element of `c` is an element of `a`
/// or `b`, nor accessed by any other thread during the call.
#[allow(clippy::too_many_arguments)] // mirrors gemm's own argument list
unsafe fn gemm_raw(
    dims: MatmulDims,
    a: *const f32,
    sa: Strides,
    b: *const f32,
    sb: Strides,
    c: *mut f32,
    sc: Strides,
    alpha: f32,
    beta: f32,
    par: Parallelism,
) {
    let MatmulDims { n, k, m } = dims;
    if n == 0 || m == 0 {
        return;
    }
    if k == 0 {
        // Empty sums: only the `beta·c` term is left. Handled here rather than trusting
        // the kernel with a zero-depth product.
        for i in 0..n {
            for j in 0..m {
                // SAFETY: in bounds by the caller's contract.
                let p = unsafe { c.offset(i as isize * sc.row + j as isize * sc.col) };
                // SAFETY: as above; `beta = 0` must not read `c` (it may be garbage/NaN).
                unsafe { *p = if beta == 0.0 { 0.0 } else { beta * *p } };
            }
        }
        return;
    }
    // gemm's `dst := alpha·dst + beta·lhs·rhs` names the scales the other way round from
    // BLAS, takes (column, row) stride pairs, and reads `dst` only if asked to.
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        gemm_on(
            Isa::active(),
            n,
            m,
            k,
            c,
            sc.col,
            sc.row,
            beta != 0.0,
            a,
            sa.col,
            sa.row,
            b,
            sb.col,
            sb.row,
            beta,
            alpha,
            par,
        );
    }
}

/// `gemm::gemm` for f32 on the kernels of the path `isa` (one the CPU supports).
///
/// `gemm` picks its kernels from the CPU alone and has no setting, so when `ARES_CPU_ISA`
/// forces a narrower path than the CPU's this calls that path's kernels itself: the very
/// driver (`gemm_basic_generic`) and microkernel tables (`gemm_f32::microkernel::{fma,
/// scalar}`) that `gemm::gemm` dispatches to on an AVX2-only or a pre-AVX2 CPU. Those are
/// gemm's internals at the exact version this crate pins (`=0.19.0`);
/// `tests::gemm_paths_agree` checks every path against an f64 product, and the CPU's own
/// path against `gemm::gemm` bit for bit.
///
/// # Safety
/// As `gemm::gemm` (the caller's contract of [`gemm_raw`]).
#[allow(clippy::too_many_arguments)] // gemm's own argument list
unsafe fn gemm_on(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_cs: isize,
    dst_rs: isize,
    read_dst: bool,
    lhs: *const f32,
    lhs_cs: isize,
    lhs_rs: isize,
    rhs: *const f32,
    rhs_cs: isize,
    rhs_rs: isize,
    alpha: f32,
    beta: f32,
    par: Parallelism,
) {
    macro_rules! on {
        ($simd:expr, $kernels:path, $lanes:expr) => {{
            use $kernels as ukr;
            // SAFETY: forwarded from the caller's contract; `$simd` proves the CPU's features.
            unsafe {
                gemm_common::gemm::gemm_basic_generic::<
                    _,
                    f32,
                    { $lanes },
                    { ukr::MR_DIV_N * $lanes },
                    { ukr::NR },
                    { ukr::MR_DIV_N },
                    { ukr::H_M },
                    { ukr::H_N },
                >(
                    $simd,
                    m,
                    n,
                    k,
                    dst,
                    dst_cs,
                    dst_rs,
                    read_dst,
                    lhs,
                    lhs_cs,
                    lhs_rs,
                    rhs,
                    rhs_cs,
                    rhs_rs,
                    alpha,
                    beta,
                    false,
                    false,
                    false,
                    |a, b, c| a * b + c,
                    &ukr::UKR,
                    &ukr::H_UKR,
                    false,
                    par,
                )
            }
        }};
    }
    #[cfg(target_arch = "x86_64")]
    use gemm_common::simd::MixedSimd;
    if isa != Isa::detected() {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                // gemm's AVX2 path also asks for F16C, which every AVX2 CPU has; were it
                // missing, gemm's own dispatch below is the fallback.
                if let Some(v3) =
                    <gemm_common::simd::V3 as MixedSimd<f32, f32, f32, f32>>::try_new()
                {
                    return on!(v3, gemm_f32::microkernel::fma::f32, 8);
                }
            }
            Isa::Portable => {
                return on!(
                    gemm_common::simd::Scalar,
                    gemm_f32::microkernel::scalar::f32,
                    1
                );
            }
            _ => {}
        }
    }
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        gemm::gemm(
            m, n, k, dst, dst_cs, dst_rs, read_dst, lhs, lhs_cs, lhs_rs, rhs, rhs_cs, rhs_rs,
            alpha, beta, false, false, false, par,
        );
    }
}

/// A raw pointer that rayon tasks may share; every use is covered by a SAFETY note.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the pointer is only dereferenced under the disjointness proven by
// `check_no_overlap` (writes) or for reads of data borrowed shared for the whole call.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    // A method (not field access) so closures capture the whole `Send` wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Checks that every element `(b, i, j)` of `[batch, rows, cols]` under `layout` lies in a
/// slice of length `len`, and returns the strides as `isize` (those of unit extents zeroed,
/// since they are never used and may be arbitrary).
fn check_layout(
    what: &'static str,
    len: usize,
    layout: MatLayout,
    [batch, rows, cols]: [usize; 3],
) -> Result<BatchStrides> {
    let stride = |extent: usize, s: usize| if extent > 1 { s } else { 0 };
    let (bs, rs, cs) = (
        stride(batch, layout.batch_stride),
        stride(rows, layout.row_stride),
        stride(cols, layout.col_stride),
    );
    if batch > 0 && rows > 0 && cols > 0 {
        let last = [(batch, bs), (rows, rs), (cols, cs)]
            .iter()
            .try_fold(layout.offset, |acc, &(e, s)| {
                (e - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
            });
        match last {
            Some(last) if last < len => {}
            _ => {
                return Err(CoreError::LengthMismatch {
                    what,
                    expected: last.map_or(usize::MAX, |l| l.saturating_add(1)),
                    actual: len,
                }
                .into());
            }
        }
    }
    Ok(BatchStrides {
        batch: to_isize(what, bs)?,
        mat: Strides {
            row: to_isize(what, rs)?,
            col: to_isize(what, cs)?,
        },
    })
}

/// Checks that no two elements of `[batch, rows, cols]` under `layout` share a position:
/// taking the dimensions by increasing stride, each stride must step over everything the
/// smaller ones span. (Sufficient, and exact for the layouts that occur in practice.)
fn check_no_overlap(layout: MatLayout, extents: [usize; 3]) -> Result<()> {
    let strides = [layout.batch_stride, layout.row_stride, layout.col_stride];
    let mut dims: Vec<(usize, usize)> = extents
        .into_iter()
        .zip(strides)
        .filter(|&(e, _)| e > 1)
        .map(|(e, s)| (s, e))
        .collect();
    dims.sort_unstable();
    let mut span = 1usize; // positions covered so far, from the first element
    for (s, e) in dims {
        if s < span {
            return Err(CoreError::OutOfRange {
                what: "c.layout",
                value: s as f64,
                expected: "strides under which no two elements of `c` share a position",
            }
            .into());
        }
        span = (e - 1).saturating_mul(s).saturating_add(span);
    }
    Ok(())
}

fn check_finite(what: &'static str, x: f32) -> Result<()> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(CoreError::OutOfRange {
            what,
            value: f64::from(x),
            expected: "finite",
        }
        .into())
    }
}

fn to_isize(what: &'static str, x: usize) -> Result<isize> {
    isize::try_from(x).map_err(|_| {
        CoreError::OutOfRange {
            what,
            value: x as f64,
            expected: "a stride or size <= isize::MAX",
        }
        .into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The input gradient written over, the weight's added into.
    const WRITE_DX: Overwrite = Overwrite {
        dx: true,
        dw: false,
    };
    use crate::Error;
    use crate::test_rng::rand_vec;

    #[test]
    fn transposed_weights_give_the_same_linear_layer() {
        for (n, k, m) in [(1, 1, 1), (3, 5, 7), (16, 64, 40), (70, 33, 130)] {
            let x = rand_vec(n * k, 1);
            let w = rand_vec(m * k, 2);
            let b = rand_vec(m, 3);
            let mut wt = vec![0.0f32; k * m];
            transpose(&w, m, k, &mut wt).unwrap();
            for (j, l) in [(0, 0), (m - 1, k - 1), (m / 2, k / 3)] {
                assert_eq!(wt[l * m + j], w[j * k + l]);
            }
            let want = naive_linear(&x, &w, Some(&b), dims(n, k, m));
            let mut out = vec![f32::NAN; n * m];
            linear_forward_t(&x, &wt, Some(&b), dims(n, k, m), &mut out).unwrap();
            assert_close(&out, &want, 1e-5);
        }
        // A large transpose takes the parallel path and is exact.
        let (r, c) = (300, 257);
        let src = rand_vec(r * c, 4);
        let mut t = vec![0.0f32; r * c];
        transpose(&src, r, c, &mut t).unwrap();
        for i in 0..r {
            for j in 0..c {
                assert_eq!(t[j * r + i], src[i * c + j], "({i}, {j})");
            }
        }
        let mut back = vec![0.0f32; r * c];
        transpose(&t, c, r, &mut back).unwrap();
        assert_eq!(back, src);
        assert!(transpose(&src, r, c + 1, &mut t).is_err());
        let mut out = vec![0.0f32; 4];
        assert!(linear_forward_t(&[1.0; 2], &[1.0; 3], None, dims(2, 1, 2), &mut out).is_err());
    }

    fn dims(n: usize, k: usize, m: usize) -> MatmulDims {
        MatmulDims { n, k, m }
    }

    /// y = x·wᵀ + b in f64, the reference.
    fn naive_linear(x: &[f32], w: &[f32], b: Option<&[f32]>, d: MatmulDims) -> Vec<f64> {
        let mut y = vec![0.0f64; d.n * d.m];
        for i in 0..d.n {
            for j in 0..d.m {
                let mut s = b.map_or(0.0, |b| f64::from(b[j]));
                for l in 0..d.k {
                    s += f64::from(x[i * d.k + l]) * f64::from(w[j * d.k + l]);
                }
                y[i * d.m + j] = s;
            }
        }
        y
    }

    fn assert_close(got: &[f32], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let err = (f64::from(g) - w).abs();
            assert!(err <= tol * (1.0 + w.abs()), "at {i}: got {g}, want {w}");
        }
    }

    const SIZES: [(usize, usize, usize); 5] =
        [(7, 13, 5), (1, 1, 1), (64, 96, 80), (3, 0, 4), (0, 5, 2)];

    /// Every path the CPU supports (gemm's AVX-512, AVX2 or scalar kernels, the narrower ones
    /// called through gemm's internals) computes `c = β·c + α·a·b` within f32 rounding of
    /// an f64 sum, on one row (gemm's vector kernels), small and blocked shapes, a transposed
    /// right operand and an accumulated destination; the CPU's own path gives gemm's bits.
    #[test]
    fn gemm_paths_agree() {
        let shapes = [
            (1, 37, 300),
            (7, 13, 5),
            (64, 96, 80),
            (130, 257, 70),
            (33, 1, 9),
        ];
        for (seed, (n, k, m)) in shapes.into_iter().enumerate() {
            let seed = seed as u64 * 4;
            let (a, b) = (rand_vec(n * k, seed), rand_vec(k * m, seed + 1));
            let c0 = rand_vec(n * m, seed + 2);
            for (transposed_b, alpha, beta) in [(false, 1.0f32, 0.0f32), (true, 0.5, 1.0)] {
                // b as [k, m] row-major, or the same values stored [m, k] and read transposed
                let (bt, sb) = if transposed_b {
                    let mut t = vec![0.0; k * m];
                    transpose(&b, k, m, &mut t).unwrap();
                    (
                        t,
                        Strides {
                            row: 1,
                            col: k as isize,
                        },
                    )
                } else {
                    (
                        b.clone(),
                        Strides {
                            row: m as isize,
                            col: 1,
                        },
                    )
                };
                let want: Vec<f64> = (0..n * m)
                    .map(|e| {
                        let (i, j) = (e / m, e % m);
                        let dot: f64 = (0..k)
                            .map(|l| f64::from(a[i * k + l]) * f64::from(b[l * m + j]))
                            .sum();
                        f64::from(beta) * f64::from(c0[e]) + f64::from(alpha) * dot
                    })
                    .collect();
                let run = |isa: Isa| {
                    let mut c = c0.clone();
                    let (sa, sc) = (
                        Strides {
                            row: k as isize,
                            col: 1,
                        },
                        Strides {
                            row: m as isize,
                            col: 1,
                        },
                    );
                    // SAFETY: every operand is a live row-major buffer of its full size.
                    unsafe {
                        gemm_on(
                            isa,
                            n,
                            m,
                            k,
                            c.as_mut_ptr(),
                            sc.col,
                            sc.row,
                            beta != 0.0,
                            a.as_ptr(),
                            sa.col,
                            sa.row,
                            bt.as_ptr(),
                            sb.col,
                            sb.row,
                            beta,
                            alpha,
                            Parallelism::None,
                        );
                    }
                    c
                };
                for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
                    let got = run(isa);
                    let ctx = format!("{isa} {n}x{k}x{m} transposed_b={transposed_b}");
                    for (e, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        // k products in another order: within k·2⁻²⁴ of the sum of magnitudes
                        let mag: f64 = (0..k)
                            .map(|l| {
                                (f64::from(a[e / m * k + l]) * f64::from(b[l * m + e % m])).abs()
                            })
                            .sum::<f64>()
                            + f64::from(c0[e]).abs();
                        let tol = (k as f64 + 2.0) * f64::from(f32::EPSILON) * mag;
                        assert!((f64::from(g) - w).abs() <= tol, "{ctx} at {e}: {g} vs {w}");
                    }
                    if isa == Isa::detected() {
                        let mut c = c0.clone();
                        // SAFETY: as above.
                        unsafe {
                            gemm::gemm(
                                n,
                                m,
                                k,
                                c.as_mut_ptr(),
                                1,
                                m as isize,
                                beta != 0.0,
                                a.as_ptr(),
                                1,
                                k as isize,
                                bt.as_ptr(),
                                sb.col,
                                sb.row,
                                beta,
                                alpha,
                                false,
                                false,
                                false,
                                Parallelism::None,
                            );
                        }
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&c), "{ctx}: gemm's own dispatch");
                    }
                }
            }
        }
    }

    #[test]
    fn forward_matches_naive_with_and_without_bias() {
        for (seed, &(n, k, m)) in SIZES.iter().enumerate() {
            let d = dims(n, k, m);
            let x = rand_vec(n * k, seed as u64);
            let w = rand_vec(m * k, 100 + seed as u64);
            let b = rand_vec(m, 200 + seed as u64);
            for bias in [None, Some(&b[..])] {
                // NaN prefill: the forward must overwrite, never read, `out`.
                let mut out = vec![f32::NAN; n * m];
                linear_forward(&x, &w, bias, d, &mut out).unwrap();
                assert_close(&out, &naive_linear(&x, &w, bias, d), 1e-5);
            }
        }
    }

    #[test]
    fn backward_accumulates_onto_existing_gradients() {
        for (seed, &(n, k, m)) in SIZES.iter().enumerate() {
            let s = seed as u64 * 10;
            let x = rand_vec(n * k, s);
            let w = rand_vec(m * k, s + 1);
            let dout = rand_vec(n * m, s + 2);
            let (dx0, dw0, db0) = (
                rand_vec(n * k, s + 3),
                rand_vec(m * k, s + 4),
                rand_vec(m, s + 5),
            );
            let (mut dx, mut dw, mut db) = (dx0.clone(), dw0.clone(), db0.clone());
            linear_backward(
                &dout,
                &x,
                &w,
                dims(n, k, m),
                Some(&mut dx),
                Some(&mut dw),
                Some(&mut db),
            )
            .unwrap();
            let mut want_dx: Vec<f64> = dx0.iter().map(|&v| f64::from(v)).collect();
            let mut want_dw: Vec<f64> = dw0.iter().map(|&v| f64::from(v)).collect();
            let mut want_db: Vec<f64> = db0.iter().map(|&v| f64::from(v)).collect();
            for i in 0..n {
                for j in 0..m {
                    let g = f64::from(dout[i * m + j]);
                    want_db[j] += g;
                    for l in 0..k {
                        want_dx[i * k + l] += g * f64::from(w[j * k + l]);
                        want_dw[j * k + l] += g * f64::from(x[i * k + l]);
                    }
                }
            }
            assert_close(&dx, &want_dx, 1e-5);
            assert_close(&dw, &want_dw, 1e-5);
            assert_close(&db, &want_db, 1e-5);
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        // L = Σ c ⊙ y, so ∂L/∂y = c; central differences of the f32 forward, in f64.
        let d = dims(7, 13, 5);
        let x = rand_vec(d.n * d.k, 1);
        let w = rand_vec(d.m * d.k, 2);
        let b = rand_vec(d.m, 3);
        let c = rand_vec(d.n * d.m, 4);
        let loss = |x: &[f32], w: &[f32], b: &[f32]| -> f64 {
            let mut y = vec![0.0; d.n * d.m];
            linear_forward(x, w, Some(b), d, &mut y).unwrap();
            y.iter()
                .zip(&c)
                .map(|(&y, &c)| f64::from(y) * f64::from(c))
                .sum()
        };
        let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; w.len()], vec![0.0; d.m]);
        linear_backward(&c, &x, &w, d, Some(&mut dx), Some(&mut dw), Some(&mut db)).unwrap();

        let h = 1e-2f32;
        let fd = |which: usize, idx: usize| -> f64 {
            let (mut xp, mut wp, mut bp) = (x.clone(), w.clone(), b.clone());
            let (mut xm, mut wm, mut bm) = (x.clone(), w.clone(), b.clone());
            match which {
                0 => (xp[idx] += h, xm[idx] -= h),
                1 => (wp[idx] += h, wm[idx] -= h),
                _ => (bp[idx] += h, bm[idx] -= h),
            };
            (loss(&xp, &wp, &bp) - loss(&xm, &wm, &bm)) / (2.0 * f64::from(h))
        };
        for (which, grad) in [(0, &dx), (1, &dw), (2, &db)] {
            for (idx, &g) in grad.iter().enumerate() {
                let want = fd(which, idx);
                assert!(
                    (f64::from(g) - want).abs() <= 1e-3 * (1.0 + want.abs()),
                    "grad {which}[{idx}]: analytic {g}, finite difference {want}"
                );
            }
        }
    }

    #[test]
    fn backward_without_dx_or_dbias_touches_only_dw() {
        let d = dims(4, 3, 2);
        let (x, w, dout) = (rand_vec(12, 1), rand_vec(6, 2), rand_vec(8, 3));
        let mut dw = vec![0.0; 6];
        linear_backward(&dout, &x, &w, d, None, Some(&mut dw), None).unwrap();
        let mut dw_full = vec![0.0; 6];
        let (mut dx, mut db) = (vec![0.0; 12], vec![0.0; 2]);
        linear_backward(
            &dout,
            &x,
            &w,
            d,
            Some(&mut dx),
            Some(&mut dw_full),
            Some(&mut db),
        )
        .unwrap();
        assert_eq!(dw, dw_full);
    }

    #[test]
    fn bad_lengths_name_the_argument() {
        let d = dims(2, 3, 4);
        let (x, w, b) = (vec![0.0; 6], vec![0.0; 12], vec![0.0; 4]);
        let mut out = vec![0.0; 8];
        let what = |r: Result<()>| match r {
            Err(Error::Core(CoreError::LengthMismatch { what, .. })) => what,
            other => panic!("expected a length error, got {other:?}"),
        };
        assert_eq!(what(linear_forward(&x[..5], &w, None, d, &mut out)), "x");
        assert_eq!(what(linear_forward(&x, &w[..11], None, d, &mut out)), "w");
        assert_eq!(
            what(linear_forward(&x, &w, Some(&b[..3]), d, &mut out)),
            "bias"
        );
        assert_eq!(what(linear_forward(&x, &w, None, d, &mut out[..7])), "out");
        let mut dw = vec![0.0; 12];
        let mut dx = vec![0.0; 5];
        assert_eq!(
            what(linear_backward(
                &out,
                &x,
                &w,
                d,
                Some(&mut dx),
                Some(&mut dw),
                None
            )),
            "dx"
        );
        assert!(dw.iter().all(|&v| v == 0.0), "nothing written on error");
        assert_eq!(
            what(linear_backward(
                &out[..7],
                &x,
                &w,
                d,
                None,
                Some(&mut dw),
                None
            )),
            "dout"
        );
        let mut db = vec![0.0; 5];
        assert_eq!(
            what(linear_backward(
                &out,
                &x,
                &w,
                d,
                None,
                Some(&mut dw),
                Some(&mut db)
            )),
            "dbias"
        );
        assert_eq!(what(matmul(&x, &w[..11], d, &mut out)), "b");
        let huge = dims(usize::MAX, 2, 1);
        assert!(linear_forward(&x, &w, None, huge, &mut out).is_err());
    }

    #[test]
    fn matmul_matches_naive() {
        for (seed, &(n, k, m)) in SIZES.iter().enumerate() {
            let a = rand_vec(n * k, seed as u64);
            let b = rand_vec(k * m, 50 + seed as u64);
            let mut c = vec![f32::NAN; n * m];
            matmul(&a, &b, dims(n, k, m), &mut c).unwrap();
            let mut want = vec![0.0f64; n * m];
            for i in 0..n {
                for j in 0..m {
                    want[i * m + j] = (0..k)
                        .map(|l| f64::from(a[i * k + l]) * f64::from(b[l * m + j]))
                        .sum();
                }
            }
            assert_close(&c, &want, 1e-5);
        }
    }

    /// Attention-like use: q, k as `[t, heads·hd]`, scores `[heads, t, t] = α·q_h·k_hᵀ`.
    fn check_heads(t: usize, heads: usize, hd: usize) {
        let (q, kk) = (rand_vec(t * heads * hd, 7), rand_vec(t * heads * hd, 8));
        let per_head = MatLayout {
            offset: 0,
            batch_stride: hd,
            row_stride: heads * hd,
            col_stride: 1,
        };
        let alpha = 0.125;
        let want = |h: usize, i: usize, j: usize| -> f64 {
            (0..hd)
                .map(|l| {
                    f64::from(q[i * heads * hd + h * hd + l])
                        * f64::from(kk[j * heads * hd + h * hd + l])
                })
                .sum::<f64>()
                * f64::from(alpha)
        };
        let d = dims(t, hd, t);
        let mut s = vec![f32::NAN; heads * t * t];
        let (qa, ka) = (
            MatRef {
                data: &q,
                layout: per_head,
            },
            MatRef {
                data: &kk,
                layout: per_head.t(),
            },
        );
        let c = MatMut {
            data: &mut s,
            layout: MatLayout::row_major(t, t),
        };
        matmul_batched(heads, d, qa, ka, c, alpha, 0.0).unwrap();
        let mut expect = vec![0.0; heads * t * t];
        for h in 0..heads {
            for i in 0..t {
                for j in 0..t {
                    expect[(h * t + i) * t + j] = want(h, i, j);
                }
            }
        }
        assert_close(&s, &expect, 1e-5);

        // beta = 1 accumulates: a second identical product doubles the scores.
        let c = MatMut {
            data: &mut s,
            layout: MatLayout::row_major(t, t),
        };
        matmul_batched(heads, d, qa, ka, c, alpha, 1.0).unwrap();
        let doubled: Vec<f64> = expect.iter().map(|v| 2.0 * v).collect();
        assert_close(&s, &doubled, 1e-5);
    }

    #[test]
    fn batched_strided_heads_match_naive() {
        check_heads(5, 3, 4); // small: batch spread over threads
        check_heads(70, 2, 64); // large: each product spread over threads
    }

    #[test]
    fn batched_unit_extents_ignore_their_strides() {
        // One query row against 5 keys (decoding), 3 heads: row strides of unit extents
        // are never used, so even absurd ones are accepted.
        let (heads, t, hd) = (3, 5, 4);
        let q = rand_vec(heads * hd, 1);
        let k = rand_vec(t * heads * hd, 2);
        let q_layout = MatLayout {
            offset: 0,
            batch_stride: hd,
            row_stride: usize::MAX,
            col_stride: 1,
        };
        let k_layout = MatLayout {
            offset: 0,
            batch_stride: hd,
            row_stride: heads * hd,
            col_stride: 1,
        }
        .t();
        let mut s = vec![f32::NAN; heads * t];
        let c = MatMut {
            data: &mut s,
            layout: MatLayout::row_major(1, t),
        };
        let (qa, ka) = (
            MatRef {
                data: &q,
                layout: q_layout,
            },
            MatRef {
                data: &k,
                layout: k_layout,
            },
        );
        matmul_batched(heads, dims(1, hd, t), qa, ka, c, 1.0, 0.0).unwrap();
        for h in 0..heads {
            for j in 0..t {
                let want: f64 = (0..hd)
                    .map(|l| f64::from(q[h * hd + l]) * f64::from(k[j * heads * hd + h * hd + l]))
                    .sum();
                assert!((f64::from(s[h * t + j]) - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn batched_writes_strided_output_and_rejects_bad_layouts() {
        // out[t, heads·hd] written per head from p[heads, t, t] · v_h (attention context).
        let (t, heads, hd) = (4, 2, 3);
        let p = rand_vec(heads * t * t, 1);
        let v = rand_vec(t * heads * hd, 2);
        let per_head = MatLayout {
            offset: 0,
            batch_stride: hd,
            row_stride: heads * hd,
            col_stride: 1,
        };
        let mut out = vec![f32::NAN; t * heads * hd];
        let d = dims(t, t, hd);
        let pa = MatRef {
            data: &p,
            layout: MatLayout::row_major(t, t),
        };
        let va = MatRef {
            data: &v,
            layout: per_head,
        };
        matmul_batched(
            heads,
            d,
            pa,
            va,
            MatMut {
                data: &mut out,
                layout: per_head,
            },
            1.0,
            0.0,
        )
        .unwrap();
        for h in 0..heads {
            for i in 0..t {
                for j in 0..hd {
                    let want: f64 = (0..t)
                        .map(|l| {
                            f64::from(p[(h * t + i) * t + l])
                                * f64::from(v[l * heads * hd + h * hd + j])
                        })
                        .sum();
                    let got = out[i * heads * hd + h * hd + j];
                    assert!((f64::from(got) - want).abs() < 1e-5, "{got} vs {want}");
                }
            }
        }

        // Reaching past the end of a slice.
        let mut small = vec![0.0; t * heads * hd - 1];
        let err = matmul_batched(
            heads,
            d,
            pa,
            va,
            MatMut {
                data: &mut small,
                layout: per_head,
            },
            1.0,
            0.0,
        );
        assert!(matches!(
            err,
            Err(Error::Core(CoreError::LengthMismatch {
                what: "c",
                expected: 24,
                actual: 23
            }))
        ));
        // Two heads writing the same place.
        let clash = MatLayout {
            batch_stride: 1,
            ..per_head
        };
        let err = matmul_batched(
            heads,
            d,
            pa,
            va,
            MatMut {
                data: &mut out,
                layout: clash,
            },
            1.0,
            0.0,
        );
        assert!(matches!(
            err,
            Err(Error::Core(CoreError::OutOfRange {
                what: "c.layout",
                ..
            }))
        ));
        let err = matmul_batched(
            heads,
            d,
            pa,
            va,
            MatMut {
                data: &mut out,
                layout: per_head,
            },
            f32::NAN,
            0.0,
        );
        assert!(matches!(
            err,
            Err(Error::Core(CoreError::OutOfRange { what: "alpha", .. }))
        ));
    }

    #[test]
    fn reduced_precision_rounds_the_operands_by_hand() {
        use crate::ops::precision::{BF16_MIN_ROWS, MatmulPrecision as P};
        let one = MatmulDims { n: 1, k: 1, m: 1 };
        // x = 1 + 2⁻¹² is 1 in TF32 (half an ulp is 2⁻¹¹): 3·1 = 3 instead of 3 + 3·2⁻¹²
        let x = 1.0 + 2f32.powi(-12);
        let mut y = [0.0f32];
        linear_forward_in(P::Tf32, &[x], &[3.0], Some(&[0.5]), one, &mut y).unwrap();
        assert_eq!(y[0], 3.5);
        linear_forward_in(P::F32, &[x], &[3.0], Some(&[0.5]), one, &mut y).unwrap();
        assert_eq!(y[0], 3.5 + 3.0 * 2f32.powi(-12));
        linear_forward_t_in(P::Tf32, &[x], &[3.0], None, one, &mut y).unwrap();
        assert_eq!(y[0], 3.0);

        // bf16 from BF16_MIN_ROWS rows on: 1 + 2⁻⁹ is 1 in bf16
        let x = 1.0 + 2f32.powi(-9);
        for (n, want) in [(BF16_MIN_ROWS - 1, x), (BF16_MIN_ROWS, 1.0)] {
            let mut y = vec![0.0f32; n];
            let d = MatmulDims { n, k: 1, m: 1 };
            linear_forward_in(P::Bf16, &vec![x; n], &[1.0], None, d, &mut y).unwrap();
            assert!(y.iter().all(|&v| v == want), "{n} rows: {} vs {want}", y[0]);
        }

        // backward in TF32: the products see rounded dout, x, w; the bias sums dout as is
        let (dout, xs, w) = ([1.0 + 2f32.powi(-12)], [2.0 + 2f32.powi(-11)], [1.0f32]);
        let (mut dx, mut dw, mut db) = ([0.0f32], [0.0f32], [0.0f32]);
        linear_backward_in(
            P::Tf32,
            &dout,
            &xs,
            &w,
            one,
            Overwrite::NONE,
            Some(&mut dx),
            Some(&mut dw),
            Some(&mut db),
        )
        .unwrap();
        assert_eq!((dx[0], dw[0], db[0]), (1.0, 2.0, dout[0]));
    }

    #[test]
    fn an_overwritten_gradient_is_a_zero_fill_then_an_accumulation() {
        use crate::ops::precision::MatmulPrecision as P;
        // shapes on both sides of the parallel threshold, and empty products (m = 0, n = 0)
        for (n, k, m) in [
            (3, 5, 4),
            (70, 33, 130),
            (256, 64, 96),
            (4, 6, 0),
            (0, 6, 4),
        ] {
            let d = dims(n, k, m);
            let (x, w, dout) = (
                rand_vec(n * k, 21),
                rand_vec(m * k, 22),
                rand_vec(n * m, 23),
            );
            for p in [P::F32, P::Bf16] {
                let run = |overwrite: Overwrite, (dx0, dw0): (f32, f32)| {
                    let (mut dx, mut dw) = (vec![dx0; n * k], vec![dw0; m * k]);
                    linear_backward_in(
                        p,
                        &dout,
                        &x,
                        &w,
                        d,
                        overwrite,
                        Some(&mut dx),
                        Some(&mut dw),
                        None,
                    )
                    .unwrap();
                    (dx, dw)
                };
                let want = run(Overwrite::NONE, (0.0, 0.0));
                // the old contents (NaN here) of what is written over are never read
                for (dx, dw) in [(true, false), (false, true), (true, true)] {
                    let start = (
                        if dx { f32::NAN } else { 0.0 },
                        if dw { f32::NAN } else { 0.0 },
                    );
                    let got = run(Overwrite { dx, dw }, start);
                    assert_eq!(got, want, "{p:?} {n}×{k}×{m} dx {dx} dw {dw}");
                }
                // accumulating adds onto what is there
                let (acc_dx, acc_dw) = run(Overwrite::NONE, (1.0, 0.25));
                let near = |got: &[f32], want: &[f32], plus: f32| {
                    got.iter()
                        .zip(want)
                        .all(|(a, b)| (a - (b + plus)).abs() <= 1e-5 * (1.0 + b.abs()))
                };
                assert!(near(&acc_dx, &want.0, 1.0) && near(&acc_dw, &want.1, 0.25));
            }
        }
    }

    #[test]
    fn stored_bf16_weights_give_the_bits_of_per_product_rounding() {
        use crate::ops::precision::{BF16_MIN_ROWS, MatmulPrecision as P, round_to_bf16};
        // Above the row threshold, the large case through the parallel widening.
        for (n, k, m) in [(BF16_MIN_ROWS, 7, 5), (70, 33, 130), (64, 96, 700)] {
            let d = dims(n, k, m);
            let (x, w, b) = (rand_vec(n * k, 11), rand_vec(m * k, 12), rand_vec(m, 13));
            let mut w16 = vec![0u16; w.len()];
            round_to_bf16(&w, &mut w16).unwrap();
            let (mut want, mut got) = (vec![0.0f32; n * m], vec![f32::NAN; n * m]);
            linear_forward_in(P::Bf16, &x, &w, Some(&b), d, &mut want).unwrap();
            linear_forward_bf16(&x, &w16, Some(&b), d, &mut got).unwrap();
            assert_eq!(got, want, "forward {n}×{k}×{m}");

            let dout = rand_vec(n * m, 14);
            let grads = |stored: bool| {
                let (mut dx, mut dw, mut db) =
                    (rand_vec(n * k, 15), rand_vec(m * k, 16), vec![0.5; m]);
                let (gx, gw, gb) = (Some(&mut dx[..]), Some(&mut dw[..]), Some(&mut db[..]));
                if stored {
                    linear_backward_bf16(&dout, &x, &w16, d, Overwrite::NONE, gx, gw, gb).unwrap();
                } else {
                    linear_backward_in(P::Bf16, &dout, &x, &w, d, Overwrite::NONE, gx, gw, gb)
                        .unwrap();
                }
                (dx, dw, db)
            };
            assert_eq!(grads(true), grads(false), "backward {n}×{k}×{m}");
        }
        // Below the threshold the f32-weight op multiplies in f32; the stored one stays bf16.
        let d = dims(1, 1, 1);
        let x = 1.0 + 2f32.powi(-9);
        let mut y = [0.0f32];
        linear_forward_bf16(&[x], &[0x3f80], None, d, &mut y).unwrap();
        assert_eq!(y[0], 1.0);
        // A stored weight of the wrong length names it.
        let err = linear_forward_bf16(&[1.0; 2], &[0; 3], None, dims(1, 2, 2), &mut [0.0; 2]);
        assert!(err.unwrap_err().to_string().contains('w'));
    }

    #[test]
    fn bf16_inputs_give_the_bits_of_their_widened_values() {
        use crate::ops::precision::{round_to_bf16, widen_bf16};
        let bf16 = |v: &[f32]| {
            let mut b = vec![0u16; v.len()];
            round_to_bf16(v, &mut b).unwrap();
            b
        };
        for (n, k, m) in [(3, 7, 5), (70, 33, 130)] {
            let d = dims(n, k, m);
            let (x16, w16, b) = (
                bf16(&rand_vec(n * k, 21)),
                bf16(&rand_vec(m * k, 22)),
                rand_vec(m, 23),
            );
            let mut x = vec![0.0f32; x16.len()];
            widen_bf16(&x16, &mut x).unwrap();
            let (mut want, mut got) = (vec![0.0f32; n * m], vec![f32::NAN; n * m]);
            linear_forward_bf16(&x, &w16, Some(&b), d, &mut want).unwrap();
            linear_forward_bf16_x(&x16, &w16, Some(&b), d, &mut got).unwrap();
            assert_eq!(got, want, "forward {n}×{k}×{m}");
            // the bf16 output: each f32 sum rounded once
            let mut got16 = vec![0u16; n * m];
            linear_forward_bf16_io(&x16, &w16, Some(&b), d, &mut got16).unwrap();
            assert_eq!(got16, bf16(&want), "bf16 output {n}×{k}×{m}");

            let dout = rand_vec(n * m, 24);
            let grads = |stored: bool| {
                let (mut dx, mut dw, mut db) =
                    (rand_vec(n * k, 25), rand_vec(m * k, 26), vec![0.5; m]);
                let (gx, gw, gb) = (Some(&mut dx[..]), Some(&mut dw[..]), Some(&mut db[..]));
                if stored {
                    linear_backward_bf16_x(&dout, &x16, &w16, d, WRITE_DX, gx, gw, gb).unwrap();
                } else {
                    linear_backward_bf16(&dout, &x, &w16, d, WRITE_DX, gx, gw, gb).unwrap();
                }
                (dx, dw, db)
            };
            assert_eq!(grads(true), grads(false), "backward {n}×{k}×{m}");
        }
        let short = linear_forward_bf16_io(&[0; 2], &[0; 4], None, dims(1, 2, 2), &mut [0; 1]);
        assert!(short.unwrap_err().to_string().contains("out"));
        let x_len = linear_forward_bf16_x(&[0; 3], &[0; 4], None, dims(1, 2, 2), &mut [0.0; 2]);
        assert!(x_len.unwrap_err().to_string().contains('x'));
    }
}
