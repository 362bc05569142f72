//! The vision tower's ops (Qwen2-VL / Qwen2.5-VL), kernels in `vision_ops.cu`: LayerNorm
//! forward and backward, the GELU-family activations, non-causal attention within
//! `cu_seqlens` segments, and the row scatter of image embeddings. Twins of
//! `ares_cpu::ops::{layer_norm, activation, segment_attention, scatter}`.

use super::attention::{
    AttentionGradsMut, MMA_ROWS, MMA_WARPS, Operands, OutMut, OutView, attention_cfg, dkv_mma_smem,
};
use super::{
    ArgOrNull, ModelOps, bad, check_len, element_cfg, grid, i32_of, i64_of, mul, row_cfg, scratch,
};
use crate::error::{DriverContext, Result};
use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Threads per row of the LayerNorm kernels and per source row of the scatter.
const ROW_BLOCK: u32 = 256;
/// Threads per block (one column each) of the LayerNorm column partial sums.
const COL_BLOCK: u32 = 256;
/// Rows per chunk of the weight/bias column sums at least; more when that would make over
/// [`MAX_CHUNKS`] chunks. Depends on the row count only, so sums are reproducible.
const MIN_CHUNK_ROWS: usize = 32;
/// Chunks of a column sum at most (bounds the scratch to `2 · MAX_CHUNKS · dim`).
const MAX_CHUNKS: usize = 256;
/// Warps per block of the segment attention kernels (`NW` in `vision_ops.cu`).
const WARPS: usize = 8;
/// Keys (queries in the dk/dv pass) per shared-memory tile (`KT`).
const KEY_TILE: usize = 32;
/// Rows per warp of the forward, dq and dk/dv kernels per head-size class (≤ 64, ≤ 128):
/// must match the `SEG_*` instantiations in `vision_ops.cu`.
const FWD_ROWS_PER_WARP: [usize; 2] = [2, 2];
const DQ_ROWS_PER_WARP: [usize; 2] = [1, 1];
const DKV_ROWS_PER_WARP: [usize; 2] = [1, 1];
/// Largest head size the segment attention kernels take (Qwen2-VL and Qwen2.5-VL use 80).
pub const MAX_SEGMENT_HEAD_DIM: usize = 128;

/// An activation of the vision tower (twin of `ares_cpu::ops::activation::Activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// torch's exact GELU: `x·Φ(x) = ½·x·(1 + erf(x/√2))`.
    GeluErf,
    /// QuickGELU: `x·σ(1.702·x)`.
    QuickGelu,
    /// GELU, tanh approximation: `½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    GeluTanh,
}

impl Activation {
    /// The kernels' `kind` argument (`ACT_*` in `vision_ops.cu`).
    fn code(self) -> i32 {
        match self {
            Activation::GeluErf => 0,
            Activation::QuickGelu => 1,
            Activation::GeluTanh => 2,
        }
    }
}

/// The sizes of a segment attention call: `tokens` tokens in `segments` segments (offsets
/// `cu_seqlens`, `segments + 1` of them), `heads` heads of `head_dim` features for q, k, v
/// and out `[tokens, heads, head_dim]`, logits `scale · q·k`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SegmentAttentionShape {
    /// Tokens over all segments, `< 2³¹`.
    pub tokens: usize,
    /// Segments.
    pub segments: usize,
    /// Heads.
    pub heads: usize,
    /// Features per head, `1..=128`.
    pub head_dim: usize,
    /// Logit multiplier, finite and > 0 (usually `1/√head_dim`).
    pub scale: f32,
}

/// Validated sizes of a segment attention call.
struct SegDims {
    q_len: usize,
    lse_len: usize,
    /// Head-size class: 0 (≤ 64), 1 (≤ 128).
    class: usize,
    segments: i32,
    tokens: i32,
    heads: i32,
    d: i32,
}

impl SegmentAttentionShape {
    /// Checks the shape and the number of offsets.
    fn dims(&self, k: &'static str, cu_len: usize) -> Result<SegDims> {
        for (what, n) in [("heads", self.heads), ("head_dim", self.head_dim)] {
            if n == 0 {
                return Err(bad(k, format!("{what} = 0 must be >= 1")));
            }
        }
        if self.head_dim > MAX_SEGMENT_HEAD_DIM {
            return Err(bad(
                k,
                format!(
                    "head_dim = {} exceeds the CUDA kernels' limit {MAX_SEGMENT_HEAD_DIM}",
                    self.head_dim
                ),
            ));
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(bad(
                k,
                format!("scale = {} must be finite and > 0", self.scale),
            ));
        }
        check_len(k, "cu_seqlens", self.segments.saturating_add(1), cu_len)?;
        if self.segments == 0 && self.tokens > 0 {
            return Err(bad(
                k,
                format!(
                    "0 segments cannot hold tokens = {} (cu_seqlens must end at tokens)",
                    self.tokens
                ),
            ));
        }
        let lse_len = mul(k, "tokens × heads", self.tokens, self.heads)?;
        Ok(SegDims {
            q_len: mul(k, "q elements", lse_len, self.head_dim)?,
            lse_len,
            class: usize::from(self.head_dim > 64),
            segments: i32_of(k, "segments", self.segments)?,
            tokens: i32_of(k, "tokens", self.tokens)?,
            heads: i32_of(k, "heads", self.heads)?,
            d: i32_of(k, "head_dim", self.head_dim)?,
        })
    }
}

/// Rows of a `[rows, dim]` tensor of `len` elements.
fn rows_of(k: &'static str, len: usize, dim: usize) -> Result<usize> {
    if dim == 0 {
        return Err(bad(k, "dim = 0 must be >= 1".into()));
    }
    if !len.is_multiple_of(dim) {
        return Err(bad(
            k,
            format!("`x` has {len} elements, not a multiple of dim = {dim}"),
        ));
    }
    Ok(len / dim)
}

/// Launch shape of a segment attention kernel: `blocks` blocks of [`WARPS`] warps with
/// `smem` bytes of dynamic shared memory (within the default 48 KiB for head sizes up to
/// [`MAX_SEGMENT_HEAD_DIM`]).
fn segment_cfg(
    ops: &ModelOps,
    k: &'static str,
    blocks: usize,
    smem: usize,
) -> Result<LaunchConfig> {
    if smem > ops.info.max_shared_per_block.min(48 * 1024) {
        return Err(bad(
            k,
            format!(
                "needs {smem} bytes of shared memory; this device allows {}",
                ops.info.max_shared_per_block
            ),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (grid(blocks), 1, 1),
        block_dim: ((WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    })
}

/// Blocks of a row-tiled segment kernel: per head, the tokens in tiles of `rows`.
fn seg_blocks(k: &'static str, shape: &SegmentAttentionShape, rows: usize) -> Result<usize> {
    mul(
        k,
        "attention blocks",
        shape.heads,
        shape.tokens.div_ceil(rows),
    )
}

/// The checks of a backward call: the shape and offsets, then the lengths of q, k, v, out,
/// dout, dq, dk, dv (`lens`, each `[tokens, heads, head_dim]`) and of lse.
fn check_backward(
    k: &'static str,
    shape: &SegmentAttentionShape,
    cu_len: usize,
    lens: [usize; 8],
    lse_len: usize,
) -> Result<SegDims> {
    let dims = shape.dims(k, cu_len)?;
    for (name, len) in ["q", "k", "v", "out", "dout", "dq", "dk", "dv"]
        .into_iter()
        .zip(lens)
    {
        check_len(k, name, dims.q_len, len)?;
    }
    check_len(k, "lse", dims.lse_len, lse_len)?;
    Ok(dims)
}

/// The launch of a tensor-core segment kernel: four warps, a block per 64 tokens of a head,
/// `smem` bytes of dynamic shared memory (raising the kernel's limit past 48 KiB).
fn mma_cfg(
    ops: &ModelOps,
    k: &'static str,
    func: &cudarc::driver::CudaFunction,
    shape: &SegmentAttentionShape,
    smem: usize,
) -> Result<LaunchConfig> {
    let blocks = seg_blocks(k, shape, MMA_ROWS)?;
    Ok(LaunchConfig {
        block_dim: ((MMA_WARPS * 32) as u32, 1, 1),
        ..attention_cfg(ops, k, func, blocks, smem)?
    })
}

/// Bytes of dynamic shared memory: two `[KT, d + 1]` tiles and `row_buffers` `[rows, d]`
/// row buffers.
fn seg_smem(d: usize, rows: usize, row_buffers: usize) -> usize {
    4 * (2 * KEY_TILE * (d + 1) + row_buffers * rows * d)
}

impl ModelOps {
    /// LayerNorm over rows of `dim` (twin of `ares_cpu::ops::layer_norm::layer_norm_forward`,
    /// same numerics): `out = x̂·weight + bias`, `x̂ = (x − mean)·rstd`, the mean and the
    /// biased variance two f64 passes, `rstd = 1/sqrt(var + eps)`; saves `mean` and `rstd`
    /// `[rows]`.
    ///
    /// # Errors
    /// `dim == 0`, `x` not whole rows, lengths that do not match, `eps` not finite and > 0.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm(
        &self,
        x: &CudaView<'_, f32>,
        weight: &CudaView<'_, f32>,
        bias: &CudaView<'_, f32>,
        eps: f32,
        dim: usize,
        out: &mut CudaViewMut<'_, f32>,
        mean: &mut CudaViewMut<'_, f32>,
        rstd: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "layer_norm";
        let rows = rows_of(K, x.len(), dim)?;
        check_len(K, "weight", dim, weight.len())?;
        check_len(K, "bias", dim, bias.len())?;
        check_len(K, "out", x.len(), out.len())?;
        check_len(K, "mean", rows, mean.len())?;
        check_len(K, "rstd", rows, rstd.len())?;
        if !(eps.is_finite() && eps > 0.0) {
            return Err(bad(K, format!("eps = {eps} must be finite and > 0")));
        }
        if rows == 0 {
            return Ok(());
        }
        let (r64, d64) = (i64_of(K, "rows", rows)?, i64_of(K, "dim", dim)?);
        let mut l = self.stream.launch_builder(&self.vision.layer_norm_fwd);
        l.arg(x)
            .arg(weight)
            .arg(bias)
            .arg(&eps)
            .arg(&r64)
            .arg(&d64)
            .arg(out)
            .arg(mean)
            .arg(rstd);
        // SAFETY: argument order as `layer_norm_fwd`; lengths checked above.
        unsafe { l.launch(row_cfg(rows, ROW_BLOCK)) }.during(K)?;
        Ok(())
    }

    /// LayerNorm backward (twin of `ares_cpu::ops::layer_norm::layer_norm_backward`): with
    /// `x̂` recomputed from the saved `mean`, `rstd` and `g = dout·weight`,
    /// `dx += rstd·(g − mean(g) − x̂·mean(g·x̂))`, `dweight += Σ_rows dout·x̂`,
    /// `dbias += Σ_rows dout`; all three **accumulate**. The column sums are two-stage, in
    /// a fixed order (deterministic).
    ///
    /// # Errors
    /// `dim == 0`, `x` not whole rows, lengths that do not match.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_backward(
        &self,
        dout: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        weight: &CudaView<'_, f32>,
        mean: &CudaView<'_, f32>,
        rstd: &CudaView<'_, f32>,
        dim: usize,
        dx: &mut CudaViewMut<'_, f32>,
        dweight: &mut CudaViewMut<'_, f32>,
        dbias: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "layer_norm_backward";
        let rows = rows_of(K, x.len(), dim)?;
        check_len(K, "dout", x.len(), dout.len())?;
        check_len(K, "weight", dim, weight.len())?;
        check_len(K, "mean", rows, mean.len())?;
        check_len(K, "rstd", rows, rstd.len())?;
        check_len(K, "dx", x.len(), dx.len())?;
        check_len(K, "dweight", dim, dweight.len())?;
        check_len(K, "dbias", dim, dbias.len())?;
        if rows == 0 {
            return Ok(());
        }
        let chunk_rows = rows.div_ceil(MAX_CHUNKS).max(MIN_CHUNK_ROWS);
        let chunks = rows.div_ceil(chunk_rows);
        let n = mul(K, "chunks × dim", chunks, dim)?;
        let (r64, d64, cr64, ch64) = (
            i64_of(K, "rows", rows)?,
            i64_of(K, "dim", dim)?,
            i64_of(K, "chunk rows", chunk_rows)?,
            i64_of(K, "chunks", chunks)?,
        );
        let col_blocks = u32::try_from(dim.div_ceil(COL_BLOCK as usize))
            .ok()
            .filter(|&b| b <= i32::MAX as u32)
            .ok_or_else(|| bad(K, format!("dim = {dim} exceeds the grid")))?;
        let v = &self.vision;
        {
            let mut l = self.stream.launch_builder(&v.layer_norm_bwd_dx);
            l.arg(dout)
                .arg(x)
                .arg(weight)
                .arg(mean)
                .arg(rstd)
                .arg(&r64)
                .arg(&d64)
                .arg(dx);
            // SAFETY: argument order as `layer_norm_bwd_dx`; lengths checked above.
            unsafe { l.launch(row_cfg(rows, ROW_BLOCK)) }.during(K)?;
        }
        let mut state = self.lock();
        let mut partial = scratch(&mut state.scratch, &self.stream, 2 * n)?;
        let (mut pw, mut pb) = partial.split_at_mut(n);
        {
            let mut l = self.stream.launch_builder(&v.layer_norm_col_partials);
            l.arg(dout)
                .arg(x)
                .arg(mean)
                .arg(rstd)
                .arg(&r64)
                .arg(&d64)
                .arg(&cr64)
                .arg(&ch64)
                .arg(&mut pw)
                .arg(&mut pb);
            let cfg = LaunchConfig {
                grid_dim: (col_blocks, chunks.min(65_535) as u32, 1),
                block_dim: (COL_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order as `layer_norm_col_partials`; pw and pb hold chunks ×
            // dim, dout and x rows × dim, mean and rstd rows (checked above).
            unsafe { l.launch(cfg) }.during(format!("{K}: column partials"))?;
        }
        let reduce = |p: &CudaViewMut<'_, f32>, target: &mut CudaViewMut<'_, f32>, what| {
            let p = p.as_view();
            let mut l = self.stream.launch_builder(&self.f.col_reduce);
            l.arg(&p).arg(&ch64).arg(&d64).arg(target);
            let cfg = LaunchConfig {
                grid_dim: (grid(col_blocks as usize), 1, 1),
                block_dim: (COL_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order as `col_reduce`; the partials hold chunks × dim, the
            // target dim elements.
            unsafe { l.launch(cfg) }.during(format!("{K}: {what} column reduce"))?;
            Ok::<(), crate::Error>(())
        };
        reduce(&pw, dweight, "dweight")?;
        reduce(&pb, dbias, "dbias")
    }

    /// Element-wise `out = act(x)` (twin of
    /// `ares_cpu::ops::activation::activation_forward`; f32 math with CUDA's `erfcf` and
    /// `expf`, so within a few ulps of the CPU's f64 evaluation).
    ///
    /// # Errors
    /// Lengths that differ.
    pub fn activation(
        &self,
        kind: Activation,
        x: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "activation";
        let n = x.len();
        check_len(K, "out", n, out.len())?;
        if n == 0 {
            return Ok(());
        }
        let (n64, code) = (i64_of(K, "len", n)?, kind.code());
        let mut l = self.stream.launch_builder(&self.vision.activation_fwd);
        l.arg(x).arg(out).arg(&n64).arg(&code);
        // SAFETY: argument order as `activation_fwd`; both hold n elements.
        unsafe { l.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// `dx = dout · act'(x)`, **overwriting** `dx` (twin of
    /// `ares_cpu::ops::activation::activation_backward`).
    ///
    /// # Errors
    /// Lengths that differ.
    pub fn activation_backward(
        &self,
        kind: Activation,
        dout: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        dx: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "activation_backward";
        let n = dout.len();
        check_len(K, "x", n, x.len())?;
        check_len(K, "dx", n, dx.len())?;
        if n == 0 {
            return Ok(());
        }
        let (n64, code) = (i64_of(K, "len", n)?, kind.code());
        let mut l = self.stream.launch_builder(&self.vision.activation_bwd);
        l.arg(dout).arg(x).arg(dx).arg(&n64).arg(&code);
        // SAFETY: argument order as `activation_bwd`; all hold n elements.
        unsafe { l.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// Row scatter `dst[index[i], :] = src[i, :]`, other rows untouched (twin of
    /// `ares_cpu::ops::scatter::scatter_rows`). An index `>= rows` writes nothing and is
    /// reported at the next [`ModelOps::check_status`]; repeated indices are not detected
    /// (one of their rows wins).
    ///
    /// # Errors
    /// `dim == 0`, lengths that do not match.
    pub fn scatter_rows(
        &self,
        src: &CudaView<'_, f32>,
        index: &CudaView<'_, u32>,
        rows: usize,
        dim: usize,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "scatter_rows";
        if dim == 0 {
            return Err(bad(K, "dim = 0 must be >= 1".into()));
        }
        let n = index.len();
        check_len(K, "src", mul(K, "index × dim", n, dim)?, src.len())?;
        check_len(K, "dst", mul(K, "rows × dim", rows, dim)?, dst.len())?;
        if n == 0 {
            return Ok(());
        }
        let (n64, r64, d64) = (
            i64_of(K, "index len", n)?,
            i64_of(K, "rows", rows)?,
            i64_of(K, "dim", dim)?,
        );
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(&self.vision.scatter_rows);
        l.arg(src)
            .arg(index)
            .arg(&n64)
            .arg(&r64)
            .arg(&d64)
            .arg(dst)
            .arg(&mut state.status);
        // SAFETY: argument order as `scatter_rows`; src holds n × dim, dst rows × dim, and
        // the kernel skips indices >= rows.
        unsafe { l.launch(row_cfg(n, ROW_BLOCK)) }.during(K)?;
        Ok(())
    }

    /// Non-causal attention within segments (twin of
    /// `ares_cpu::ops::segment_attention::segment_attention_forward`): q, k, v `[tokens,
    /// heads, head_dim]`, offsets `cu_seqlens` `[segments + 1]`; a query attends to every key
    /// of its segment. Writes `out` like q and the log-sum-exp `lse` `[tokens, heads]`; a
    /// visible non-finite score makes its row NaN. The offsets' values are not checked
    /// before launch: offsets that do not start at 0, decrease or do not end at `tokens`
    /// are reported at the next [`ModelOps::check_status`] (the rows are then unspecified,
    /// the memory accesses still in bounds).
    ///
    /// # Errors
    /// `heads` or `head_dim` 0, `head_dim > 128`, a scale not finite and > 0, lengths that
    /// do not match (`cu_seqlens` included), no segment for a non-empty input.
    #[allow(clippy::too_many_arguments)]
    pub fn segment_attention(
        &self,
        shape: SegmentAttentionShape,
        cu_seqlens: &CudaView<'_, u32>,
        q: &CudaView<'_, f32>,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "segment_attention";
        let dims = shape.dims(K, cu_seqlens.len())?;
        check_len(K, "q", dims.q_len, q.len())?;
        check_len(K, "k", dims.q_len, k.len())?;
        check_len(K, "v", dims.q_len, v.len())?;
        check_len(K, "out", dims.q_len, out.len())?;
        check_len(K, "lse", dims.lse_len, lse.len())?;
        if dims.q_len == 0 {
            return Ok(());
        }
        let rows = WARPS * FWD_ROWS_PER_WARP[dims.class];
        let cfg = segment_cfg(
            self,
            K,
            seg_blocks(K, &shape, rows)?,
            seg_smem(shape.head_dim, rows, 1),
        )?;
        let mut state = self.lock();
        let mut l = self
            .stream
            .launch_builder(&self.vision.segment_fwd[dims.class]);
        l.arg(q)
            .arg(k)
            .arg(v)
            .arg(cu_seqlens)
            .arg(&dims.segments)
            .arg(&dims.tokens)
            .arg(&dims.heads)
            .arg(&dims.d)
            .arg(&shape.scale)
            .arg(out)
            .arg(lse)
            .arg(&mut state.status);
        // SAFETY: argument order as the `SEG_FWD` kernels; lengths checked above, offsets
        // clamped by the kernel; grid and shared memory match the variant.
        unsafe { l.launch(cfg) }.during(K)?;
        Ok(())
    }

    /// [`ModelOps::segment_attention`] on tensor cores (twin of
    /// `ares_cpu::ops::segment_attention::segment_attention_forward_bf16`): the kernels of
    /// [`ModelOps::attention_bf16`] over the segments — q, k, v and each 64-key tile's
    /// probabilities rounded to bf16, f32 sums and softmax state. Head sizes 64, 80, 128;
    /// compute capability 8.0 or later.
    ///
    /// # Errors
    /// As [`ModelOps::segment_attention`]; another head size; an older device.
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, in its order
    pub fn segment_attention_bf16(
        &self,
        shape: SegmentAttentionShape,
        cu_seqlens: &CudaView<'_, u32>,
        q: &CudaView<'_, f32>,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let qkv = Operands::F32(q, k, v);
        let op = "segment_attention_bf16";
        self.segment_mma(op, shape, cu_seqlens, qkv, OutMut::F32(out), lse)
    }

    /// [`ModelOps::segment_attention_bf16`] over q, k, v stored in bf16 (the vision tower's
    /// activations kept in bf16): the kernels read the bits as stored where they round f32
    /// ones as they load — the same bits for the same values. The output goes to exactly
    /// one of `out` (f32) and `out16` (bf16, rounded once to nearest even).
    ///
    /// # Errors
    /// As [`ModelOps::segment_attention_bf16`]; both outputs or neither.
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, in its order
    pub fn segment_attention_bf16_stored<'o>(
        &self,
        shape: SegmentAttentionShape,
        cu_seqlens: &CudaView<'_, u32>,
        q: &CudaView<'_, u16>,
        k: &CudaView<'_, u16>,
        v: &CudaView<'_, u16>,
        out: Option<&mut CudaViewMut<'o, f32>>,
        out16: Option<&mut CudaViewMut<'o, u16>>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "segment_attention_bf16_stored";
        let out = match (out, out16) {
            (Some(o), None) => OutMut::F32(o),
            (None, Some(o)) => OutMut::Bf16(o),
            _ => return Err(bad(K, "exactly one of out (f32) and out16 (bf16)".into())),
        };
        self.segment_mma(K, shape, cu_seqlens, Operands::Bf16(q, k, v), out, lse)
    }

    /// Checks and launches the tensor-core segment forward on `qkv` as stored.
    fn segment_mma(
        &self,
        op: &'static str,
        shape: SegmentAttentionShape,
        cu_seqlens: &CudaView<'_, u32>,
        qkv: Operands<'_, '_>,
        out: OutMut<'_, '_>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let dims = shape.dims(op, cu_seqlens.len())?;
        let variant = self.tensor_core_head(op, shape.head_dim)?;
        for (name, len) in ["q", "k", "v"].into_iter().zip(qkv.lens()) {
            check_len(op, name, dims.q_len, len)?;
        }
        check_len(op, "out", dims.q_len, out.len())?;
        check_len(op, "lse", dims.lse_len, lse.len())?;
        if dims.q_len == 0 {
            return Ok(());
        }
        let func = &self.f.segment_fwd_mma[variant];
        let cfg = mma_cfg(self, op, func, &shape, 0)?;
        let tokens = i64_of(op, "tokens", shape.tokens)?;
        let (o32, o16) = match out {
            OutMut::F32(o) => (Some(o), None),
            OutMut::Bf16(o) => (None, Some(o)),
        };
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(func);
        qkv.push_f32(&mut l)
            .arg(cu_seqlens)
            .arg(&dims.segments)
            .arg(&tokens)
            .arg(&dims.heads)
            .arg(&shape.scale)
            .arg_or_null(o32)
            .arg(lse)
            .arg(&mut state.status);
        qkv.push_bf16(&mut l);
        l.arg_or_null(o16);
        // SAFETY: argument order as `ATTN_FWD_MMA`'s segment kernel; lengths checked above,
        // offsets clamped by the kernel; the head size is the variant's; exactly one of each
        // operand's f32 and bf16 pointers, and of the output's, is set.
        unsafe { l.launch(cfg) }.during(op)?;
        Ok(())
    }

    /// Backward of [`ModelOps::segment_attention_bf16`] on tensor cores (twin of
    /// `ares_cpu::ops::segment_attention::segment_attention_backward_bf16`): the kernels of
    /// [`ModelOps::attention_backward_bf16`] over the segments. **Overwrites** the gradients.
    ///
    /// # Errors
    /// As [`ModelOps::segment_attention_backward`]; as [`ModelOps::segment_attention_bf16`].
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, in its order
    pub fn segment_attention_backward_bf16<'v>(
        &self,
        shape: SegmentAttentionShape,
        cu_seqlens: &CudaView<'_, u32>,
        q: &CudaView<'_, f32>,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
        out: &CudaView<'_, f32>,
        lse: &CudaView<'_, f32>,
        dout: &CudaView<'_, f32>,
        dq: &mut CudaViewMut<'v, f32>,
        dk: &mut CudaViewMut<'v, f32>,
        dv: &mut CudaViewMut<'v, f32>,
    ) -> Result<()> {
        let qkv = Operands::F32(q, k, v);
        let saved = (OutView::F32(out), lse, dout);
        let grads = AttentionGradsMut { dq, dk, dv };
        let op = "segment_attention_backward_bf16";
        self.segment_mma_backward(op, shape, cu_seqlens, qkv, saved, grads)
    }

    /// [`ModelOps::segment_attention_backward_bf16`] over q, k, v stored in bf16, read as
    /// stored, and the forward's output from exactly one of `out` (f32) and `out16` (bf16,
    /// widened): the same bits as from those values in f32. **Overwrites** the gradients.
    ///
    /// # Errors
    /// As [`ModelOps::segment_attention_backward_bf16`]; both outputs or neither.
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, in its order
    pub fn segment_attention_backward_bf16_stored<'o, 'v>(
        &self,
        shape: SegmentAttentionShape,
        cu_seqlens: &CudaView<'_, u32>,
        q: &CudaView<'_, u16>,
        k: &CudaView<'_, u16>,
        v: &CudaView<'_, u16>,
        out: Option<&CudaView<'o, f32>>,
        out16: Option<&CudaView<'o, u16>>,
        lse: &CudaView<'_, f32>,
        dout: &CudaView<'_, f32>,
        dq: &mut CudaViewMut<'v, f32>,
        dk: &mut CudaViewMut<'v, f32>,
        dv: &mut CudaViewMut<'v, f32>,
    ) -> Result<()> {
        const K: &str = "segment_attention_backward_bf16_stored";
        let out = match (out, out16) {
            (Some(o), None) => OutView::F32(o),
            (None, Some(o)) => OutView::Bf16(o),
            _ => return Err(bad(K, "exactly one of out (f32) and out16 (bf16)".into())),
        };
        let grads = AttentionGradsMut { dq, dk, dv };
        let qkv = Operands::Bf16(q, k, v);
        self.segment_mma_backward(K, shape, cu_seqlens, qkv, (out, lse, dout), grads)
    }

    /// Checks and launches the tensor-core segment backward: δ, then dq, then dk and dv.
    fn segment_mma_backward(
        &self,
        op: &'static str,
        shape: SegmentAttentionShape,
        cu_seqlens: &CudaView<'_, u32>,
        qkv: Operands<'_, '_>,
        (out, lse, dout): (OutView<'_, '_>, &CudaView<'_, f32>, &CudaView<'_, f32>),
        grads: AttentionGradsMut<'_, '_>,
    ) -> Result<()> {
        let variant = self.tensor_core_head(op, shape.head_dim)?;
        let [ql, kl, vl] = qkv.lens();
        let lens = [
            ql,
            kl,
            vl,
            out.len(),
            dout.len(),
            grads.dq.len(),
            grads.dk.len(),
            grads.dv.len(),
        ];
        let dims = check_backward(op, &shape, cu_seqlens.len(), lens, lse.len())?;
        if dims.q_len == 0 {
            return Ok(());
        }
        let rows64 = i64_of(op, "lse rows", dims.lse_len)?;
        let tokens = i64_of(op, "tokens", shape.tokens)?;
        let dq_func = &self.f.segment_bwd_dq_mma[variant];
        let dkv_func = &self.f.segment_bwd_dkv_mma[variant];
        let dq_cfg = mma_cfg(self, op, dq_func, &shape, 0)?;
        let dkv_cfg = mma_cfg(self, op, dkv_func, &shape, dkv_mma_smem(shape.head_dim))?;
        let mut guard = self.lock();
        let state = &mut *guard;
        let mut delta = scratch(&mut state.scratch, &self.stream, dims.lse_len)?;
        {
            // δ = Σ bf16(dout)·out per (token, head) row (model_ops.cu), out as stored.
            let (o32, o16) = match out {
                OutView::F32(o) => (Some(o), None),
                OutView::Bf16(o) => (None, Some(o)),
            };
            let mut l = self.stream.launch_builder(&self.f.attention_bwd_delta_bf16);
            l.arg(dout)
                .arg_or_null(o32)
                .arg(&rows64)
                .arg(&dims.d)
                .arg(&mut delta)
                .arg_or_null(o16);
            let cfg = LaunchConfig {
                grid_dim: (grid(dims.lse_len.div_ceil(WARPS)), 1, 1),
                block_dim: ((WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order as `attention_bwd_delta_bf16`; dout/out hold rows × d,
            // delta rows; exactly one of out and out16 is set.
            unsafe { l.launch(cfg) }.during(format!("{op}: delta"))?;
        }
        let delta = delta.as_view();
        let status = &mut state.status;
        let AttentionGradsMut { dq, dk, dv } = grads;
        for (func, cfg, grads) in [
            (dq_func, dq_cfg, [Some(&mut *dq), None]),
            (dkv_func, dkv_cfg, [Some(&mut *dk), Some(&mut *dv)]),
        ] {
            let mut l = self.stream.launch_builder(func);
            qkv.push_f32(&mut l)
                .arg(cu_seqlens)
                .arg(&dims.segments)
                .arg(&tokens)
                .arg(&dims.heads)
                .arg(&shape.scale)
                .arg(lse)
                .arg(&delta)
                .arg(dout);
            for g in grads.into_iter().flatten() {
                l.arg(g);
            }
            l.arg(&mut *status);
            qkv.push_bf16(&mut l);
            // SAFETY: argument order as `ATTN_BWD_MMA`'s segment kernels (dq: one gradient,
            // dk/dv: two); lengths checked above, dynamic shared memory as `dkv_mma_smem`;
            // exactly one of each operand's f32 and bf16 pointers is set.
            unsafe { l.launch(cfg) }.during(format!("{op}: gradients"))?;
        }
        Ok(())
    }

    /// Backward of [`ModelOps::segment_attention`] (twin of
    /// `ares_cpu::ops::segment_attention::segment_attention_backward`) from `saved.dout` and
    /// the forward's `saved.out` and `saved.lse` (all `[tokens, heads, ·]`): **overwrites**
    /// `grads.dq`, `grads.dk`, `grads.dv`. Two passes, over query rows (dq) and over key
    /// rows (dk, dv), each element written by one warp in a fixed order (deterministic).
    ///
    /// # Errors
    /// As [`ModelOps::segment_attention`], and lengths of `out`, `lse`, `dout` and the
    /// gradients.
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, in its order
    pub fn segment_attention_backward<'v>(
        &self,
        shape: SegmentAttentionShape,
        cu_seqlens: &CudaView<'_, u32>,
        q: &CudaView<'_, f32>,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
        out: &CudaView<'_, f32>,
        lse: &CudaView<'_, f32>,
        dout: &CudaView<'_, f32>,
        dq: &mut CudaViewMut<'v, f32>,
        dk: &mut CudaViewMut<'v, f32>,
        dv: &mut CudaViewMut<'v, f32>,
    ) -> Result<()> {
        let grads = AttentionGradsMut { dq, dk, dv };
        const K: &str = "segment_attention_backward";
        let lens = [
            q.len(),
            k.len(),
            v.len(),
            out.len(),
            dout.len(),
            grads.dq.len(),
            grads.dk.len(),
            grads.dv.len(),
        ];
        let dims = check_backward(K, &shape, cu_seqlens.len(), lens, lse.len())?;
        if dims.q_len == 0 {
            return Ok(());
        }
        let rows64 = i64_of(K, "lse rows", dims.lse_len)?;
        let dq_rows = WARPS * DQ_ROWS_PER_WARP[dims.class];
        let dq_cfg = segment_cfg(
            self,
            K,
            seg_blocks(K, &shape, dq_rows)?,
            seg_smem(shape.head_dim, dq_rows, 2),
        )?;
        let key_rows = WARPS * DKV_ROWS_PER_WARP[dims.class];
        let dkv_cfg = segment_cfg(
            self,
            K,
            seg_blocks(K, &shape, key_rows)?,
            seg_smem(shape.head_dim, key_rows, 2),
        )?;
        let mut guard = self.lock();
        let state = &mut *guard;
        let mut delta = scratch(&mut state.scratch, &self.stream, dims.lse_len)?;
        {
            // δ = Σ dout·out per (token, head) row; one warp per row (model_ops.cu).
            let mut l = self.stream.launch_builder(&self.f.attention_bwd_delta);
            l.arg(dout)
                .arg(out)
                .arg(&rows64)
                .arg(&dims.d)
                .arg(&mut delta);
            let cfg = LaunchConfig {
                grid_dim: (grid(dims.lse_len.div_ceil(WARPS)), 1, 1),
                block_dim: ((WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order as `attention_bwd_delta`; dout/out hold rows × d,
            // delta rows.
            unsafe { l.launch(cfg) }.during(format!("{K}: delta"))?;
        }
        let delta = delta.as_view();
        let status = &mut state.status;
        let vf = &self.vision;
        {
            let mut l = self.stream.launch_builder(&vf.segment_bwd_dq[dims.class]);
            l.arg(q)
                .arg(k)
                .arg(v)
                .arg(cu_seqlens)
                .arg(&dims.segments)
                .arg(&dims.tokens)
                .arg(&dims.heads)
                .arg(&dims.d)
                .arg(&shape.scale)
                .arg(lse)
                .arg(&delta)
                .arg(dout)
                .arg(grads.dq)
                .arg(&mut *status);
            // SAFETY: argument order as the `SEG_BWD_DQ` kernels; lengths checked above.
            unsafe { l.launch(dq_cfg) }.during(format!("{K}: dq"))?;
        }
        let mut l = self.stream.launch_builder(&vf.segment_bwd_dkv[dims.class]);
        l.arg(q)
            .arg(k)
            .arg(v)
            .arg(cu_seqlens)
            .arg(&dims.segments)
            .arg(&dims.tokens)
            .arg(&dims.heads)
            .arg(&dims.d)
            .arg(&shape.scale)
            .arg(lse)
            .arg(&delta)
            .arg(dout)
            .arg(grads.dk)
            .arg(grads.dv)
            .arg(status);
        // SAFETY: argument order as the `SEG_BWD_DKV` kernels; lengths checked above.
        unsafe { l.launch(dkv_cfg) }.during(format!("{K}: dk, dv"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::VISION_OPS;

    /// The launch geometry and codes here must be the ones the kernels were written with.
    #[test]
    fn constants_match_the_kernel_source() {
        let src = VISION_OPS.code;
        assert!(src.contains(&format!("#define NW {WARPS}\n")), "NW");
        assert!(src.contains(&format!("#define KT {KEY_TILE}\n")), "KT");
        let dpl = [2, 4];
        for (class, d) in [64, 128].iter().enumerate() {
            for (mac, kernel, rw) in [
                ("SEG_FWD", "segment_attention_fwd", FWD_ROWS_PER_WARP[class]),
                (
                    "SEG_BWD_DQ",
                    "segment_attention_bwd_dq",
                    DQ_ROWS_PER_WARP[class],
                ),
                (
                    "SEG_BWD_DKV",
                    "segment_attention_bwd_dkv",
                    DKV_ROWS_PER_WARP[class],
                ),
            ] {
                let line = format!("{mac}({kernel}_d{d}, {}, {rw})", dpl[class]);
                assert!(src.contains(&line), "missing `{line}` in vision_ops.cu");
            }
        }
        for (kind, name) in [
            (Activation::GeluErf, "ACT_GELU_ERF"),
            (Activation::QuickGelu, "ACT_QUICK_GELU"),
            (Activation::GeluTanh, "ACT_GELU_TANH"),
        ] {
            let line = format!("#define {name} {}\n", kind.code());
            assert!(src.contains(&line), "missing `{line}`");
        }
        // Shared memory stays within the default 48 KiB up to the largest head size: the
        // forward's one row buffer, the dq and dk/dv passes' two.
        for class in 0..2 {
            let (fwd, dq, dkv) = (
                WARPS * FWD_ROWS_PER_WARP[class],
                WARPS * DQ_ROWS_PER_WARP[class],
                WARPS * DKV_ROWS_PER_WARP[class],
            );
            for (rows, buffers) in [(fwd, 1), (dq, 2), (dkv, 2)] {
                assert!(seg_smem(MAX_SEGMENT_HEAD_DIM, rows, buffers) <= 48 * 1024);
            }
        }
    }

    #[test]
    fn shapes_are_checked_with_named_errors() {
        let ok = SegmentAttentionShape {
            tokens: 10,
            segments: 3,
            heads: 2,
            head_dim: 80,
            scale: 0.5,
        };
        let d = ok.dims("t", 4).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((d.q_len, d.lse_len, d.class), (1600, 20, 1));
        let msg =
            |s: SegmentAttentionShape, cu: usize| s.dims("t", cu).err().map(|e| e.to_string());
        assert!(msg(ok, 3).is_some_and(|m| m.contains("`cu_seqlens` has 3 elements, expected 4")));
        let wide = SegmentAttentionShape {
            head_dim: 129,
            ..ok
        };
        assert!(msg(wide, 4).is_some_and(|m| m.contains("head_dim = 129")));
        let zero = SegmentAttentionShape { heads: 0, ..ok };
        assert!(msg(zero, 4).is_some_and(|m| m.contains("heads = 0")));
        let no_scale = SegmentAttentionShape {
            scale: f32::INFINITY,
            ..ok
        };
        assert!(msg(no_scale, 4).is_some_and(|m| m.contains("scale")));
        let none = SegmentAttentionShape { segments: 0, ..ok };
        assert!(msg(none, 1).is_some_and(|m| m.contains("0 segments")));
        let empty = SegmentAttentionShape {
            tokens: 0,
            segments: 0,
            ..ok
        };
        assert!(empty.dims("t", 1).is_ok());
        let huge = SegmentAttentionShape {
            tokens: 1 << 31,
            ..ok
        };
        assert!(msg(huge, 4).is_some_and(|m| m.contains("tokens")));
    }
}
