//! RMSNorm forward and backward, and the deterministic column sums behind the weight and
//! bias gradients.

use super::{ModelOps, State, bad, check_len, grid, i64_of, mul, row_cfg, scratch};
use crate::error::{DriverContext, Result};
use cudarc::driver::{
    CudaFunction, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

/// Threads per row of the RMSNorm kernels.
const ROW_BLOCK: u32 = 256;
/// Threads per block (one column each) of the column-sum kernels.
const COL_BLOCK: u32 = 256;
/// Rows per chunk of a column sum at least; more when that would make over
/// [`MAX_CHUNKS`] chunks. Depends on the row count only, so sums are reproducible.
const MIN_CHUNK_ROWS: usize = 32;
/// Chunks of a column sum at most (bounds the scratch to `MAX_CHUNKS · cols`).
const MAX_CHUNKS: usize = 256;

/// What is summed down the columns.
enum ColumnTerm<'a, 'b> {
    /// `a[r, c]` (a bias gradient).
    Plain,
    /// `a[r, c] · (b[r, c] · s[r])` (RMSNorm's weight gradient: `dout · (x · rstd)`).
    Scaled(&'a CudaView<'b, f32>, &'a CudaView<'b, f32>),
}

impl ModelOps {
    /// RMSNorm over rows of `dim`: `out = weight · (x · r)`, `r = 1/sqrt(mean(x²) + eps)`
    /// saved in `rstd` `[rows]` (twin of `ares_cpu::ops::rmsnorm::rmsnorm_forward`, same
    /// numerics: f32 squares summed in f64).
    ///
    /// # Errors
    /// `dim == 0`, `x` not whole rows, lengths that do not match, `eps` not finite and > 0.
    pub fn rmsnorm(
        &self,
        x: &CudaView<'_, f32>,
        weight: &CudaView<'_, f32>,
        eps: f32,
        dim: usize,
        out: &mut CudaViewMut<'_, f32>,
        rstd: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        const K: &str = "rmsnorm";
        let rows = rows_of(K, x.len(), dim)?;
        check_len(K, "weight", dim, weight.len())?;
        check_len(K, "out", x.len(), out.len())?;
        check_len(K, "rstd", rows, rstd.len())?;
        if !(eps.is_finite() && eps > 0.0) {
            return Err(bad(K, format!("eps = {eps} must be finite and > 0")));
        }
        if rows == 0 {
            return Ok(());
        }
        let (r64, d64) = (i64_of(K, "rows", rows)?, i64_of(K, "dim", dim)?);
        let mut l = self.stream.launch_builder(&self.f.rmsnorm_fwd);
        l.arg(x)
            .arg(weight)
            .arg(&eps)
            .arg(&r64)
            .arg(&d64)
            .arg(out)
            .arg(rstd);
        // SAFETY: argument order as `rmsnorm_fwd`; lengths checked above.
        unsafe { l.launch(row_cfg(rows, ROW_BLOCK)) }.during(K)?;
        Ok(())
    }

    /// The residual add fused with the next RMSNorm (twin of
    /// `ares_cpu::ops::rmsnorm::add_rmsnorm_forward`): `sum = a + b`, then
    /// [`ModelOps::rmsnorm`] of `sum` into `out` and `rstd` — the bits of [`ModelOps::add`]
    /// followed by [`ModelOps::rmsnorm`], in one kernel.
    ///
    /// # Errors
    /// As [`ModelOps::rmsnorm`]; `b` or `sum` not the length of `a`.
    #[allow(clippy::too_many_arguments)] // the two outputs of the norm and the sum
    pub fn add_rmsnorm(
        &self,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        weight: &CudaView<'_, f32>,
        eps: f32,
        dim: usize,
        sum: &mut CudaViewMut<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
        rstd: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let k = ("add_rmsnorm", &self.f.add_rmsnorm_fwd);
        self.add_rmsnorm_as(k, a, b, weight, (eps, dim), sum, out, rstd)
    }

    /// [`ModelOps::add_rmsnorm`] with the norm's output stored in bf16 (bits, rounded to
    /// nearest even); `sum` and `rstd` as there (twin of
    /// `ares_cpu::ops::rmsnorm::add_rmsnorm_forward_bf16`).
    ///
    /// # Errors
    /// As [`ModelOps::add_rmsnorm`].
    #[allow(clippy::too_many_arguments)] // the two outputs of the norm and the sum
    pub fn add_rmsnorm_bf16(
        &self,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        weight: &CudaView<'_, f32>,
        eps: f32,
        dim: usize,
        sum: &mut CudaViewMut<'_, f32>,
        out: &mut CudaViewMut<'_, u16>,
        rstd: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let k = ("add_rmsnorm_bf16", &self.f.add_rmsnorm_fwd_bf16);
        self.add_rmsnorm_as(k, a, b, weight, (eps, dim), sum, out, rstd)
    }

    /// The launch of `add_rmsnorm_fwd` or its bf16-output twin (`kernel`), `out` as stored.
    #[allow(clippy::too_many_arguments)]
    fn add_rmsnorm_as<T: DeviceRepr>(
        &self,
        (k, kernel): (&'static str, &CudaFunction),
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        weight: &CudaView<'_, f32>,
        (eps, dim): (f32, usize),
        sum: &mut CudaViewMut<'_, f32>,
        out: &mut CudaViewMut<'_, T>,
        rstd: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let rows = rows_of(k, a.len(), dim)?;
        check_len(k, "b", a.len(), b.len())?;
        check_len(k, "weight", dim, weight.len())?;
        check_len(k, "sum", a.len(), sum.len())?;
        check_len(k, "out", a.len(), out.len())?;
        check_len(k, "rstd", rows, rstd.len())?;
        if !(eps.is_finite() && eps > 0.0) {
            return Err(bad(k, format!("eps = {eps} must be finite and > 0")));
        }
        if rows == 0 {
            return Ok(());
        }
        let (r64, d64) = (i64_of(k, "rows", rows)?, i64_of(k, "dim", dim)?);
        let mut l = self.stream.launch_builder(kernel);
        l.arg(a)
            .arg(b)
            .arg(weight)
            .arg(&eps)
            .arg(&r64)
            .arg(&d64)
            .arg(sum)
            .arg(out)
            .arg(rstd);
        // SAFETY: argument order as `add_rmsnorm_fwd` / `add_rmsnorm_fwd_bf16` (their `out`
        // of `T`); lengths checked above.
        unsafe { l.launch(row_cfg(rows, ROW_BLOCK)) }.during(k)?;
        Ok(())
    }

    /// RMSNorm backward (twin of `ares_cpu::ops::rmsnorm::rmsnorm_backward`): with
    /// `g = dout·weight` and `r = rstd[t]`, `dx[t] += r·g − r³·x[t]·(g·x[t])/dim` and
    /// `dweight += Σ_t dout[t]·(x[t]·r)`; both **accumulate**. The weight gradient is a
    /// two-stage column sum in a fixed order (deterministic).
    ///
    /// # Errors
    /// `dim == 0`, `x` not whole rows, lengths that do not match.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(
        &self,
        dout: &CudaView<'_, f32>,
        x: &CudaView<'_, f32>,
        weight: &CudaView<'_, f32>,
        rstd: &CudaView<'_, f32>,
        dim: usize,
        dx: &mut CudaViewMut<'_, f32>,
        dweight: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()> {
        const K: &str = "rmsnorm_backward";
        let rows = rows_of(K, x.len(), dim)?;
        check_len(K, "dout", x.len(), dout.len())?;
        check_len(K, "weight", dim, weight.len())?;
        check_len(K, "rstd", rows, rstd.len())?;
        check_len(K, "dx", x.len(), dx.len())?;
        if let Some(dw) = &dweight {
            check_len(K, "dweight", dim, dw.len())?;
        }
        if rows == 0 {
            return Ok(());
        }
        let (r64, d64) = (i64_of(K, "rows", rows)?, i64_of(K, "dim", dim)?);
        let mut l = self.stream.launch_builder(&self.f.rmsnorm_bwd_dx);
        l.arg(dout)
            .arg(x)
            .arg(weight)
            .arg(rstd)
            .arg(&r64)
            .arg(&d64)
            .arg(dx);
        // SAFETY: argument order as `rmsnorm_bwd_dx`; lengths checked above.
        unsafe { l.launch(row_cfg(rows, ROW_BLOCK)) }.during(K)?;
        // a frozen weight (`None`) has no gradient to sum
        let Some(dweight) = dweight else {
            return Ok(());
        };
        let mut state = self.lock();
        self.column_sum(
            K,
            &mut state,
            dout,
            ColumnTerm::Scaled(x, rstd),
            rows,
            dweight,
        )
    }

    /// `out[c] += Σ_r a[r, c]` over the `rows` rows of `a` `[rows, out.len()]`, in a fixed
    /// order (the bias gradient of a linear layer).
    pub(crate) fn column_sum_plain(
        &self,
        kernel: &'static str,
        a: &CudaView<'_, f32>,
        rows: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let mut state = self.lock();
        self.column_sum(kernel, &mut state, a, ColumnTerm::Plain, rows, out)
    }

    /// `out[c] += Σ_r term(r, c)`: per chunk of rows a partial sum in row order, then the
    /// partials added in chunk order.
    fn column_sum(
        &self,
        k: &'static str,
        state: &mut State,
        a: &CudaView<'_, f32>,
        term: ColumnTerm<'_, '_>,
        rows: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let cols = out.len();
        check_len(
            k,
            "column sum input",
            mul(k, "rows × cols", rows, cols)?,
            a.len(),
        )?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let chunk_rows = rows.div_ceil(MAX_CHUNKS).max(MIN_CHUNK_ROWS);
        let chunks = rows.div_ceil(chunk_rows);
        let (r64, c64, cr64, ch64) = (
            i64_of(k, "rows", rows)?,
            i64_of(k, "cols", cols)?,
            i64_of(k, "chunk rows", chunk_rows)?,
            i64_of(k, "chunks", chunks)?,
        );
        let col_blocks = u32::try_from(cols.div_ceil(COL_BLOCK as usize))
            .ok()
            .filter(|&b| b <= i32::MAX as u32)
            .ok_or_else(|| bad(k, format!("{cols} columns exceed the grid")))?;
        if let ColumnTerm::Scaled(b, s) = &term {
            check_len(k, "x", a.len(), b.len())?;
            check_len(k, "rstd", rows, s.len())?;
        }
        let mut partial = scratch(&mut state.scratch, &self.stream, chunks * cols)?;
        {
            let null = 0u64;
            let mut l = self.stream.launch_builder(&self.f.col_partials);
            l.arg(a);
            match &term {
                ColumnTerm::Plain => l.arg(&null).arg(&null),
                ColumnTerm::Scaled(b, s) => l.arg(*b).arg(*s),
            };
            l.arg(&r64)
                .arg(&c64)
                .arg(&cr64)
                .arg(&ch64)
                .arg(&mut partial);
            let cfg = LaunchConfig {
                grid_dim: (col_blocks, chunks.min(65_535) as u32, 1),
                block_dim: (COL_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order as `col_partials`; `partial` holds chunks × cols, `a`
            // (and b) rows × cols, s rows (checked above).
            unsafe { l.launch(cfg) }.during(format!("{k}: column partials"))?;
        }
        let partial = partial.as_view();
        let mut l = self.stream.launch_builder(&self.f.col_reduce);
        l.arg(&partial).arg(&ch64).arg(&c64).arg(out);
        let cfg = LaunchConfig {
            grid_dim: (grid(col_blocks as usize), 1, 1),
            block_dim: (COL_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument order as `col_reduce`; lengths as above.
        unsafe { l.launch(cfg) }.during(format!("{k}: column reduce"))?;
        Ok(())
    }
}

/// Rows of a `[rows, dim]` tensor of `len` elements.
fn rows_of(k: &'static str, len: usize, dim: usize) -> crate::Result<usize> {
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
