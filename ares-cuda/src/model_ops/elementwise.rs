//! Element-wise and gather/scatter ops: fill, add, scale, axpy, SwiGLU, RoPE, transpose,
//! embedding forward/backward.

use super::{ModelOps, bad, check_len, element_cfg, i32_of, i64_of, mul, row_cfg};
use crate::error::{DriverContext, Result};
use cudarc::driver::{
    CudaFunction, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

/// Threads per token of the embedding and RoPE kernels.
const TOKEN_BLOCK: u32 = 256;

impl ModelOps {
    /// Sets every element of `dst` to `value`.
    ///
    /// # Errors
    /// A launch failure.
    pub fn fill(&self, dst: &mut CudaViewMut<'_, f32>, value: f32) -> Result<()> {
        const K: &str = "fill";
        let n = dst.len();
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(K, "len", n)?;
        let mut b = self.stream.launch_builder(&self.f.fill);
        b.arg(dst).arg(&n64).arg(&value);
        // SAFETY: (dst, n, value) as `fill_f32` declares them; dst holds n elements.
        unsafe { b.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// `dst = src`: a device-to-device copy queued on the stream (no kernel; twin of the
    /// CPU backend's `copy`).
    ///
    /// # Errors
    /// Lengths that differ.
    pub fn copy(&self, src: &CudaView<'_, f32>, dst: &mut CudaViewMut<'_, f32>) -> Result<()> {
        check_len("copy", "dst", src.len(), dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.stream.memcpy_dtod(src, dst).during("copy")
    }

    /// `dst = src` for bf16 (or any 16-bit) elements: blocks of a bf16 KV pool.
    ///
    /// # Errors
    /// Lengths that differ.
    pub fn copy_bf16(&self, src: &CudaView<'_, u16>, dst: &mut CudaViewMut<'_, u16>) -> Result<()> {
        check_len("copy_bf16", "dst", src.len(), dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.stream.memcpy_dtod(src, dst).during("copy_bf16")
    }

    /// `dst = src` for a `[rows, cols]` matrix: the decode weights' layout on the GPU is the
    /// row-major one cuBLAS reads (the CPU packs tiles, `ares_cpu::ops::matmul_tiles`).
    ///
    /// # Errors
    /// `src` not `rows · cols` long, lengths that differ.
    pub fn copy_matrix(
        &self,
        src: &CudaView<'_, f32>,
        rows: usize,
        cols: usize,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        check_len("copy_matrix", "src", rows.saturating_mul(cols), src.len())?;
        self.copy(src, dst)
    }

    /// `dst` = the `[rows, cols]` matrix `src` rounded to bf16 (row-major, the layout
    /// cuBLAS reads; twin of `ares_cpu::ops::matmul_tiles::pack_bf16_tiles`, whose CPU
    /// layout differs).
    ///
    /// # Errors
    /// `src` not `rows · cols` long, lengths that differ.
    pub fn pack_bf16(
        &self,
        src: &CudaView<'_, f32>,
        rows: usize,
        cols: usize,
        dst: &mut CudaViewMut<'_, u16>,
    ) -> Result<()> {
        check_len("pack_bf16", "src", rows.saturating_mul(cols), src.len())?;
        self.to_bf16(src, dst)
    }

    /// `out = a + b`, element-wise (twin of the CPU backend's `add`).
    ///
    /// # Errors
    /// Lengths that differ.
    pub fn add(
        &self,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "add";
        let n = a.len();
        check_len(K, "b", n, b.len())?;
        check_len(K, "out", n, out.len())?;
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(K, "len", n)?;
        let mut l = self.stream.launch_builder(&self.f.add);
        l.arg(a).arg(b).arg(out).arg(&n64);
        // SAFETY: (a, b, out, n) as `add_f32` declares them; lengths checked above.
        unsafe { l.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// `x *= s`, element-wise, in place.
    ///
    /// # Errors
    /// A launch failure.
    pub fn scale(&self, x: &mut CudaViewMut<'_, f32>, s: f32) -> Result<()> {
        const K: &str = "scale";
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(K, "len", n)?;
        let mut l = self.stream.launch_builder(&self.f.scale);
        l.arg(x).arg(&n64).arg(&s);
        // SAFETY: (x, n, s) as `scale_f32` declares them.
        unsafe { l.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// `y += alpha · x`, element-wise, the product rounded before the sum (twin of
    /// `ares_cpu::ops::axpy::axpy`).
    ///
    /// # Errors
    /// Lengths that differ, a launch failure.
    pub fn axpy(
        &self,
        alpha: f32,
        x: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "axpy";
        let n = x.len();
        check_len(K, "y", n, y.len())?;
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(K, "len", n)?;
        let mut l = self.stream.launch_builder(&self.f.axpy);
        l.arg(&alpha).arg(x).arg(y).arg(&n64);
        // SAFETY: (alpha, x, y, n) as `axpy_f32` declares them; lengths checked above.
        unsafe { l.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// `y = x` rounded to bf16 (to nearest even; NaN stays NaN) as bf16 bit patterns: the
    /// operands of a bf16 GEMM (twin of
    /// `ares_cpu::ops::precision::MatmulPrecision::Bf16.round`).
    ///
    /// # Errors
    /// Lengths that differ, a launch failure.
    pub fn to_bf16(&self, x: &CudaView<'_, f32>, y: &mut CudaViewMut<'_, u16>) -> Result<()> {
        const K: &str = "f32_to_bf16";
        let n = x.len();
        check_len(K, "y", n, y.len())?;
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(K, "len", n)?;
        let mut l = self.stream.launch_builder(&self.f.to_bf16);
        l.arg(x).arg(y).arg(&n64);
        // SAFETY: (x, y, n) as `f32_to_bf16` declares them; both hold n elements.
        unsafe { l.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// `y = x` rounded to bf16 stochastically, element `i` with the random bits of
    /// `(key, i)` (twin of `ares_cpu::ops::precision::round_to_bf16_stochastic`): a weight
    /// stored in bf16 written back by its optimizer step.
    ///
    /// # Errors
    /// Lengths that differ, a launch failure.
    pub fn to_bf16_stochastic(
        &self,
        x: &CudaView<'_, f32>,
        key: u64,
        y: &mut CudaViewMut<'_, u16>,
    ) -> Result<()> {
        const K: &str = "f32_to_bf16_stochastic";
        let n = x.len();
        check_len(K, "y", n, y.len())?;
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(K, "len", n)?;
        let mut l = self.stream.launch_builder(&self.f.to_bf16_stochastic);
        l.arg(x).arg(y).arg(&n64).arg(&key);
        // SAFETY: (x, y, n, key) as `f32_to_bf16_stochastic` declares them; both hold n
        // elements.
        unsafe { l.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// `y = SR(widen(y) + x)`: an f32 contribution added to a tensor stored in bf16, each
    /// sum rounded stochastically with the 16 random bits of `(key, i)` (twin of
    /// `ares_cpu::ops::precision::accumulate_bf16_stochastic`): a layer's weight gradient
    /// folded into a gradient stored in bf16.
    ///
    /// # Errors
    /// Lengths that differ, a launch failure.
    pub fn accumulate_bf16_stochastic(
        &self,
        x: &CudaView<'_, f32>,
        key: u64,
        y: &mut CudaViewMut<'_, u16>,
    ) -> Result<()> {
        const K: &str = "accumulate_bf16_stochastic";
        let n = x.len();
        check_len(K, "y", n, y.len())?;
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(K, "len", n)?;
        let mut l = self
            .stream
            .launch_builder(&self.f.accumulate_bf16_stochastic);
        l.arg(x).arg(y).arg(&n64).arg(&key);
        // SAFETY: (x, y, n, key) as `accumulate_bf16_stochastic` declares them; both hold n
        // elements.
        unsafe { l.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// Every element of `y` set to `value` rounded to the nearest bf16 (twin of
    /// `ares_cpu::ops::precision::fill_bf16`): a gradient stored in bf16 zeroed.
    ///
    /// # Errors
    /// A launch failure.
    pub fn fill_bf16(&self, y: &mut CudaViewMut<'_, u16>, value: f32) -> Result<()> {
        const K: &str = "fill_bf16";
        let n = y.len();
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(K, "len", n)?;
        let bits = half::bf16::from_f32(value).to_bits();
        let mut l = self.stream.launch_builder(&self.f.fill_bf16);
        l.arg(y).arg(&n64).arg(&bits);
        // SAFETY: (y, n, bits) as `fill_bf16` declares them; y holds n elements.
        unsafe { l.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// `y = x` widened from bf16 bits to f32 (exact; twin of
    /// `ares_cpu::ops::precision::widen_bf16`).
    ///
    /// # Errors
    /// Lengths that differ, a launch failure.
    pub fn from_bf16(&self, x: &CudaView<'_, u16>, y: &mut CudaViewMut<'_, f32>) -> Result<()> {
        const K: &str = "bf16_to_f32";
        let n = x.len();
        check_len(K, "y", n, y.len())?;
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(K, "len", n)?;
        let mut l = self.stream.launch_builder(&self.f.from_bf16);
        l.arg(x).arg(y).arg(&n64);
        // SAFETY: (x, y, n) as `bf16_to_f32` declares them; both hold n elements.
        unsafe { l.launch(element_cfg(n)) }.during(K)?;
        Ok(())
    }

    /// SwiGLU `out = silu(gate)·up` (twin of `ares_cpu::ops::swiglu::swiglu_forward`).
    ///
    /// # Errors
    /// Lengths that differ.
    pub fn swiglu(
        &self,
        gate: &CudaView<'_, f32>,
        up: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.swiglu_as(("swiglu", &self.f.swiglu_fwd), gate, up, out)
    }

    /// [`ModelOps::swiglu`] with `gate`, `up` and `out` stored in bf16 (bits: widened, the
    /// output rounded to nearest even; twin of `ares_cpu::ops::swiglu::swiglu_forward_bf16`).
    ///
    /// # Errors
    /// Lengths that differ.
    pub fn swiglu_bf16(
        &self,
        gate: &CudaView<'_, u16>,
        up: &CudaView<'_, u16>,
        out: &mut CudaViewMut<'_, u16>,
    ) -> Result<()> {
        self.swiglu_as(("swiglu_bf16", &self.f.swiglu_fwd_bf16), gate, up, out)
    }

    /// The launch of `swiglu_fwd` or its bf16 twin (`kernel`) over elements of `T`.
    fn swiglu_as<T: DeviceRepr>(
        &self,
        (k, kernel): (&'static str, &CudaFunction),
        gate: &CudaView<'_, T>,
        up: &CudaView<'_, T>,
        out: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let n = gate.len();
        check_len(k, "up", n, up.len())?;
        check_len(k, "out", n, out.len())?;
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(k, "len", n)?;
        let mut l = self.stream.launch_builder(kernel);
        l.arg(gate).arg(up).arg(out).arg(&n64);
        // SAFETY: (gate, up, out, n) as `swiglu_fwd` / `swiglu_fwd_bf16` declare them (of
        // `T`); lengths checked.
        unsafe { l.launch(element_cfg(n)) }.during(k)?;
        Ok(())
    }

    /// SwiGLU backward, overwriting `dgate` and `dup` (twin of
    /// `ares_cpu::ops::swiglu::swiglu_backward`, same order of operations).
    ///
    /// # Errors
    /// Lengths that differ.
    pub fn swiglu_backward(
        &self,
        dout: &CudaView<'_, f32>,
        gate: &CudaView<'_, f32>,
        up: &CudaView<'_, f32>,
        dgate: &mut CudaViewMut<'_, f32>,
        dup: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let k = ("swiglu_backward", &self.f.swiglu_bwd);
        self.swiglu_backward_as(k, dout, (gate, up), dgate, dup)
    }

    /// [`ModelOps::swiglu_backward`] with `gate` and `up` stored in bf16 (twin of
    /// `ares_cpu::ops::swiglu::swiglu_backward_bf16`); the gradients f32.
    ///
    /// # Errors
    /// Lengths that differ.
    pub fn swiglu_backward_bf16(
        &self,
        dout: &CudaView<'_, f32>,
        gate: &CudaView<'_, u16>,
        up: &CudaView<'_, u16>,
        dgate: &mut CudaViewMut<'_, f32>,
        dup: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let k = ("swiglu_backward_bf16", &self.f.swiglu_bwd_bf16);
        self.swiglu_backward_as(k, dout, (gate, up), dgate, dup)
    }

    /// The launch of `swiglu_bwd` or its bf16 twin (`kernel`), `gate` and `up` of `T`.
    fn swiglu_backward_as<T: DeviceRepr>(
        &self,
        (k, kernel): (&'static str, &CudaFunction),
        dout: &CudaView<'_, f32>,
        (gate, up): (&CudaView<'_, T>, &CudaView<'_, T>),
        dgate: &mut CudaViewMut<'_, f32>,
        dup: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let n = gate.len();
        check_len(k, "dout", n, dout.len())?;
        check_len(k, "up", n, up.len())?;
        check_len(k, "dgate", n, dgate.len())?;
        check_len(k, "dup", n, dup.len())?;
        if n == 0 {
            return Ok(());
        }
        let n64 = i64_of(k, "len", n)?;
        let mut l = self.stream.launch_builder(kernel);
        l.arg(dout).arg(gate).arg(up).arg(dgate).arg(dup).arg(&n64);
        // SAFETY: argument order as `swiglu_bwd` / `swiglu_bwd_bf16` (gate, up of `T`);
        // lengths checked above.
        unsafe { l.launch(element_cfg(n)) }.during(k)?;
        Ok(())
    }

    /// RoPE in place on `x` `[tokens, heads, head_dim]` with `cos`, `sin` `[tokens,
    /// head_dim/2]` (twin of `ares_cpu::ops::rope::rope_forward`, bit for bit: separately
    /// rounded products).
    ///
    /// # Errors
    /// `head_dim` odd or 0, `heads` 0, lengths that do not match.
    pub fn rope(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        cos: &CudaView<'_, f32>,
        sin: &CudaView<'_, f32>,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        self.rotate("rope", x, cos, sin, heads, head_dim, false)
    }

    /// Backward of [`ModelOps::rope`], in place: the inverse rotation (twin of
    /// `ares_cpu::ops::rope::rope_backward`).
    ///
    /// # Errors
    /// As [`ModelOps::rope`].
    pub fn rope_backward(
        &self,
        dx: &mut CudaViewMut<'_, f32>,
        cos: &CudaView<'_, f32>,
        sin: &CudaView<'_, f32>,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        self.rotate("rope_backward", dx, cos, sin, heads, head_dim, true)
    }

    /// [`ModelOps::rope`] of `x` into `out` rounded to bf16 (twin of
    /// `ares_cpu::ops::rope::rope_forward_bf16`): q and k kept in bf16, the f32 rotation
    /// rounded once, in one pass.
    ///
    /// # Errors
    /// As [`ModelOps::rope`]; `out` not as long as `x`.
    pub fn rope_bf16(
        &self,
        x: &CudaView<'_, f32>,
        cos: &CudaView<'_, f32>,
        sin: &CudaView<'_, f32>,
        heads: usize,
        head_dim: usize,
        out: &mut CudaViewMut<'_, u16>,
    ) -> Result<()> {
        const K: &str = "rope_bf16";
        check_len(K, "out", x.len(), out.len())?;
        let Some((tokens, t64, h32, d32)) = rope_dims(K, x.len(), cos, sin, heads, head_dim)?
        else {
            return Ok(());
        };
        let mut l = self.stream.launch_builder(&self.f.rope_fwd_bf16);
        l.arg(x)
            .arg(cos)
            .arg(sin)
            .arg(&t64)
            .arg(&h32)
            .arg(&d32)
            .arg(out);
        // SAFETY: argument order as `rope_fwd_bf16`; lengths checked above.
        unsafe { l.launch(row_cfg(tokens, TOKEN_BLOCK)) }.during(K)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn rotate(
        &self,
        k: &'static str,
        x: &mut CudaViewMut<'_, f32>,
        cos: &CudaView<'_, f32>,
        sin: &CudaView<'_, f32>,
        heads: usize,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()> {
        let Some((tokens, t64, h32, d32)) = rope_dims(k, x.len(), cos, sin, heads, head_dim)?
        else {
            return Ok(());
        };
        let inv = i32::from(inverse);
        let mut l = self.stream.launch_builder(&self.f.rope);
        l.arg(x)
            .arg(cos)
            .arg(sin)
            .arg(&t64)
            .arg(&h32)
            .arg(&d32)
            .arg(&inv);
        // SAFETY: argument order as `rope`; lengths checked above.
        unsafe { l.launch(row_cfg(tokens, TOKEN_BLOCK)) }.during(k)?;
        Ok(())
    }

    /// `dst[cols, rows] = src[rows, cols]ᵀ` (twin of `ares_cpu::ops::matmul::transpose`).
    ///
    /// # Errors
    /// `src` or `dst` not `rows · cols` long.
    pub fn transpose(
        &self,
        src: &CudaView<'_, f32>,
        rows: usize,
        cols: usize,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "transpose";
        let n = mul(K, "rows × cols", rows, cols)?;
        check_len(K, "src", n, src.len())?;
        check_len(K, "dst", n, dst.len())?;
        if n == 0 {
            return Ok(());
        }
        let col_tiles = u32::try_from(cols.div_ceil(32))
            .ok()
            .filter(|&t| t <= i32::MAX as u32)
            .ok_or_else(|| bad(K, format!("cols = {cols} exceeds the grid")))?;
        let row_tiles = rows.div_ceil(32).clamp(1, 65_535) as u32;
        let (r64, c64) = (i64_of(K, "rows", rows)?, i64_of(K, "cols", cols)?);
        let mut l = self.stream.launch_builder(&self.f.transpose);
        l.arg(src).arg(&r64).arg(&c64).arg(dst);
        let cfg = LaunchConfig {
            grid_dim: (col_tiles, row_tiles, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument order as `transpose_f32`; lengths checked above.
        unsafe { l.launch(cfg) }.during(K)?;
        Ok(())
    }

    /// Row gather `out[t, :] = table[ids[t], :]`, `table` `[rows, dim]`, `out` `[ids.len(),
    /// dim]` (twin of `ares_cpu::ops::embedding::embedding_forward`). An id `>= rows` gives
    /// a NaN row and is reported at the next [`ModelOps::check_status`].
    ///
    /// # Errors
    /// Lengths that do not match.
    pub fn embedding(
        &self,
        ids: &CudaView<'_, u32>,
        table: &CudaView<'_, f32>,
        rows: usize,
        dim: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "embedding";
        let tokens = ids.len();
        check_len(K, "table", mul(K, "rows × dim", rows, dim)?, table.len())?;
        check_len(K, "out", mul(K, "tokens × dim", tokens, dim)?, out.len())?;
        self.launch_embedding(K, &self.f.embedding_fwd, ids, table, rows, dim, out)
    }

    /// [`ModelOps::embedding`] from a table stored in bf16 (its bits), each row widened to
    /// f32 (exact; twin of `ares_cpu::ops::embedding::embedding_forward_bf16`).
    ///
    /// # Errors
    /// Lengths that do not match.
    pub fn embedding_bf16(
        &self,
        ids: &CudaView<'_, u32>,
        table: &CudaView<'_, u16>,
        rows: usize,
        dim: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "embedding_fwd_bf16";
        let tokens = ids.len();
        check_len(K, "table", mul(K, "rows × dim", rows, dim)?, table.len())?;
        check_len(K, "out", mul(K, "tokens × dim", tokens, dim)?, out.len())?;
        self.launch_embedding(K, &self.f.embedding_fwd_bf16, ids, table, rows, dim, out)
    }

    /// Backward of [`ModelOps::embedding`]: `dtable[ids[t], :] += dout[t, :]`,
    /// **accumulating**, deterministic (each table row sums its tokens in token order, the
    /// CPU's order: bit for bit `ares_cpu::ops::embedding::embedding_backward`). Ids
    /// `>= rows` are skipped and reported at the next [`ModelOps::check_status`].
    ///
    /// # Errors
    /// Lengths that do not match.
    pub fn embedding_backward(
        &self,
        ids: &CudaView<'_, u32>,
        dout: &CudaView<'_, f32>,
        rows: usize,
        dim: usize,
        dtable: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "embedding_backward";
        let tokens = ids.len();
        check_len(K, "dtable", mul(K, "rows × dim", rows, dim)?, dtable.len())?;
        check_len(K, "dout", mul(K, "tokens × dim", tokens, dim)?, dout.len())?;
        self.launch_embedding(K, &self.f.embedding_bwd, ids, dout, rows, dim, dtable)
    }

    /// Launches `embedding_fwd(_bf16)` or `embedding_bwd`, which take the same arguments
    /// `(ids, src, rows, dim, tokens, dst, status)`, one block per token; the caller has
    /// checked `src` and `dst` against `rows × dim` and `tokens × dim`.
    #[allow(clippy::too_many_arguments)]
    fn launch_embedding<T: cudarc::driver::DeviceRepr>(
        &self,
        k: &'static str,
        kernel: &CudaFunction,
        ids: &CudaView<'_, u32>,
        src: &CudaView<'_, T>,
        rows: usize,
        dim: usize,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let tokens = ids.len();
        if tokens == 0 || dim == 0 {
            return Ok(());
        }
        let (r64, d64, t64) = (
            i64_of(k, "rows", rows)?,
            i64_of(k, "dim", dim)?,
            i64_of(k, "tokens", tokens)?,
        );
        let mut state = self.lock();
        let mut l = self.stream.launch_builder(kernel);
        l.arg(ids)
            .arg(src)
            .arg(&r64)
            .arg(&d64)
            .arg(&t64)
            .arg(dst)
            .arg(&mut state.status);
        // SAFETY: argument order as both kernels declare it; lengths checked by the
        // callers, ids range-checked on the device.
        unsafe { l.launch(row_cfg(tokens, TOKEN_BLOCK)) }.during(k)?;
        Ok(())
    }

    /// `out[r, :] += bias` for the `rows = out.len() / bias.len()` rows of `out`.
    pub(crate) fn bias_add(
        &self,
        out: &mut CudaViewMut<'_, f32>,
        bias: &CudaView<'_, f32>,
        rows: usize,
    ) -> Result<()> {
        const K: &str = "linear bias";
        let cols = bias.len();
        check_len(
            K,
            "out",
            mul(K, "rows × out_features", rows, cols)?,
            out.len(),
        )?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let (r64, c64) = (i64_of(K, "rows", rows)?, i64_of(K, "cols", cols)?);
        let mut l = self.stream.launch_builder(&self.f.bias_add);
        l.arg(out).arg(bias).arg(&r64).arg(&c64);
        // SAFETY: argument order as `bias_add`; lengths checked above.
        unsafe { l.launch(row_cfg(rows, TOKEN_BLOCK)) }.during(K)?;
        Ok(())
    }
}

/// The tokens of a RoPE over `len` values of `heads` heads of `head_dim` with its cos/sin
/// tables checked, as the kernel takes them (`None`: no token, nothing to launch).
fn rope_dims(
    k: &'static str,
    len: usize,
    cos: &CudaView<'_, f32>,
    sin: &CudaView<'_, f32>,
    heads: usize,
    head_dim: usize,
) -> Result<Option<(usize, i64, i32, i32)>> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(bad(
            k,
            format!("head_dim = {head_dim} must be even and >= 2"),
        ));
    }
    if heads == 0 {
        return Err(bad(k, "heads = 0 must be >= 1".into()));
    }
    let stride = mul(k, "heads × head_dim", heads, head_dim)?;
    if !len.is_multiple_of(stride) {
        return Err(bad(
            k,
            format!("`x` has {len} elements, not a multiple of heads × head_dim = {stride}"),
        ));
    }
    let tokens = len / stride;
    let half = head_dim / 2;
    check_len(k, "cos", tokens * half, cos.len())?;
    check_len(k, "sin", tokens * half, sin.len())?;
    if tokens == 0 {
        return Ok(None);
    }
    // Pairs of one token are indexed with `int` in the kernel.
    let _ = i32_of(k, "heads × head_dim", stride)?;
    Ok(Some((
        tokens,
        i64_of(k, "tokens", tokens)?,
        i32_of(k, "heads", heads)?,
        i32_of(k, "head_dim", head_dim)?,
    )))
}
