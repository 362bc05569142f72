//! [`CpuBackend`]: the [`Backend`] over the f32 slice kernels of `ares-cpu`. Buffers are
//! plain vectors, views are sub-slices, ops run on the calling thread (parallel inside
//! over rayon) and have finished when they return, so nothing ever needs synchronising.

use ares_cpu::ops::attention::{self, AttentionShape, attention_decode, kv_cache_append};
use ares_cpu::ops::matmul::{
    MatmulDims, linear_backward_in, linear_forward_in, linear_forward_t_in,
};
use ares_cpu::ops::matmul_tiles;
use ares_cpu::ops::optim::{Moment, adamw_step_scaled, sum_of_squares_bf16, sum_of_squares_f64};
use ares_cpu::ops::{activation, segment_attention};
use ares_cpu::sampler::{SampleKey, Sampler};

use super::BlockTables;
use super::check_half;
use super::profile::{self, CpuTimer};
use super::sampling::greedy_row;

use super::ops::{declared_ops, op_arg_type};
use super::{
    ACTOR_LOSS_REPORT, Activation, ActorLossGrads, ActorLossSpec, ActorLossViews, AdamWUpdate,
    AttentionDims, AttentionGrads, AttentionInputs, Backend, BackendError, DType, DeviceBuffer,
    GradWrite, GradWrites, HweViews, KlSumViews, KlViews, KvCacheView, KvCacheViewMut, LinearDims,
    PagedKvView, PagedKvViewMut, Result, SegmentAttentionDims, Stored, Tensor, TensorMut, View,
    ViewMut, WindowSpec,
};

/// The CPU backend: f32, u32 and 16-bit vectors, `ares-cpu` kernels.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl DeviceBuffer for Vec<f32> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn dtype(&self) -> DType {
        DType::F32
    }
}

impl DeviceBuffer for Vec<u32> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn dtype(&self) -> DType {
        DType::U32
    }
}

impl DeviceBuffer for Vec<u8> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn dtype(&self) -> DType {
        DType::U8
    }
}

/// 16-bit floats on the host (the CPU backend's [`Backend::Half`]): their bits, and
/// whether they are bf16 or f16.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HalfBuffer {
    dtype: DType,
    bits: Vec<u16>,
}

impl HalfBuffer {
    /// The element bits.
    pub fn bits(&self) -> &[u16] {
        &self.bits
    }
}

impl DeviceBuffer for HalfBuffer {
    fn len(&self) -> usize {
        self.bits.len()
    }

    fn dtype(&self) -> DType {
        self.dtype
    }
}

/// A paged cache of `ares-cpu` over pools `k`, `v` with the tables of `b`.
fn paged_mut<'a, E>(
    k: &'a mut [E],
    v: &'a mut [E],
    b: BlockTables<'a, Vec<u32>>,
) -> attention::PagedKvCacheMut<'a, E> {
    attention::PagedKvCacheMut {
        k,
        v,
        block_size: b.block_size,
        block_tables: b.host_tables,
        max_blocks: b.max_blocks,
        len: b.host_len,
    }
}

/// [`paged_mut`] to attend over, with the lengths after the new tokens (`len`).
fn paged<'a, E>(
    k: &'a [E],
    v: &'a [E],
    b: BlockTables<'a, Vec<u32>>,
    len: &'a [u32],
) -> attention::PagedKvCache<'a, E> {
    attention::PagedKvCache {
        k,
        v,
        block_size: b.block_size,
        block_tables: b.host_tables,
        max_blocks: b.max_blocks,
        len,
    }
}

/// Each sequence's length after this step's `dims.seq` new tokens.
fn lens_after(b: BlockTables<'_, Vec<u32>>, dims: AttentionDims) -> Vec<u32> {
    b.host_len
        .iter()
        .map(|&n| n.saturating_add(dims.seq as u32))
        .collect()
}

/// The bits a 16-bit view names, after checking it holds `want` (argument `arg` of `op`).
fn half<'a>(
    op: &'static str,
    arg: &'static str,
    view: View<'a, HalfBuffer>,
    want: DType,
) -> Result<&'a [u16]> {
    let buffer = view.buffer();
    BackendError::check_dtype(op, arg, want, buffer.dtype)?;
    let (offset, len) = (view.offset(), view.len());
    Ok(&buffer.bits[offset..offset + len])
}

/// [`half`], writable.
fn half_mut<'a>(
    op: &'static str,
    arg: &'static str,
    view: ViewMut<'a, HalfBuffer>,
    want: DType,
) -> Result<&'a mut [u16]> {
    BackendError::check_dtype(op, arg, want, view.as_view().buffer().dtype)?;
    let (offset, len) = (view.offset(), view.len());
    Ok(&mut view.into_buffer().bits[offset..offset + len])
}

/// A [`Stored`] view's elements on the host: f32 values or bf16 bits.
#[derive(Clone, Copy)]
enum StoredSlice<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

/// The elements of argument `arg` of `op`, as stored (a bf16 view's dtype checked).
fn stored<'a>(
    op: &'static str,
    arg: &'static str,
    x: Stored<'a, CpuBackend>,
) -> Result<StoredSlice<'a>> {
    Ok(match x {
        Stored::F32(v) => StoredSlice::F32(slice(v)?),
        Stored::Bf16(v) => StoredSlice::Bf16(half(op, arg, v, DType::Bf16)?),
    })
}

/// The elements a view names. Views are bounds-checked when made, so this only fails if
/// the buffer shrank since, which `Vec`s held by a view cannot.
fn slice<'a>(view: View<'a, Vec<f32>>) -> Result<&'a [f32]> {
    let (offset, len) = (view.offset(), view.len());
    let buffer = view.buffer();
    buffer
        .get(offset..offset + len)
        .ok_or(BackendError::ViewOutOfBounds {
            offset,
            len,
            buffer_len: buffer.len(),
        })
}

/// The elements a writable view names (see [`slice`]).
fn slice_mut<'a, T>(view: ViewMut<'a, Vec<T>>) -> Result<&'a mut [T]> {
    let (offset, len) = (view.offset(), view.len());
    let buffer = view.into_buffer();
    let buffer_len = buffer.len();
    buffer
        .get_mut(offset..offset + len)
        .ok_or(BackendError::ViewOutOfBounds {
            offset,
            len,
            buffer_len,
        })
}

/// [`slice`] of an optional view.
fn slice_opt<'a>(view: Option<View<'a, Vec<f32>>>) -> Result<Option<&'a [f32]>> {
    view.map(slice).transpose()
}

/// [`slice_mut`] of an optional view.
fn slice_mut_opt<'a>(view: Option<ViewMut<'a, Vec<f32>>>) -> Result<Option<&'a mut [f32]>> {
    view.map(slice_mut).transpose()
}

/// The `ares-cpu` matmul dims of a linear layer.
fn matmul_dims(dims: LinearDims) -> MatmulDims {
    MatmulDims {
        n: dims.rows,
        k: dims.in_features,
        m: dims.out_features,
    }
}

/// A struct of backend views in the form its `ares-cpu` kernel takes (a `Views<T>` kind of
/// a declared op).
trait CpuViews<'a> {
    type Kernel;
    fn cpu(self) -> Result<Self::Kernel>;
}

impl<'a> CpuViews<'a> for AttentionInputs<'a, Vec<f32>> {
    type Kernel = attention::AttentionInputs<'a>;
    fn cpu(self) -> Result<Self::Kernel> {
        Ok(attention::AttentionInputs {
            q: slice(self.q)?,
            k: slice(self.k)?,
            v: slice(self.v)?,
            key_mask: slice_opt(self.key_mask)?,
            segments: None,
        })
    }
}

impl<'a> CpuViews<'a> for AttentionGrads<'a, Vec<f32>> {
    type Kernel = attention::AttentionGrads<'a>;
    fn cpu(self) -> Result<Self::Kernel> {
        Ok(attention::AttentionGrads {
            dq: slice_mut(self.dq)?,
            dk: slice_mut(self.dk)?,
            dv: slice_mut(self.dv)?,
        })
    }
}

/// Wraps a kernel error with the op that raised it.
fn op(name: &'static str) -> impl FnOnce(ares_cpu::Error) -> BackendError {
    move |e| BackendError::Op {
        op: name,
        source: Box::new(e),
    }
}

/// The `ares-cpu` shape of an attention call.
fn attention_shape(dims: AttentionDims) -> AttentionShape {
    AttentionShape::new(
        dims.batch,
        dims.seq,
        dims.q_heads,
        dims.kv_heads,
        dims.head_dim,
    )
    .with_scale(dims.scale)
}

/// The `ares-cpu` activation of a backend one.
fn cpu_activation(kind: Activation) -> activation::Activation {
    match kind {
        Activation::GeluErf => activation::Activation::GeluErf,
        Activation::QuickGelu => activation::Activation::QuickGelu,
        Activation::GeluTanh => activation::Activation::GeluTanh,
    }
}

/// The `ares-cpu` shape of a segment attention call, after checking that `cu_seqlens`
/// holds `segments + 1` offsets (the kernel checks their values).
fn segment_shape(
    dims: SegmentAttentionDims,
    cu_seqlens: &[u32],
) -> std::result::Result<segment_attention::SegmentAttentionShape, ares_cpu::Error> {
    let expected = dims.segments.saturating_add(1);
    if cu_seqlens.len() != expected {
        return Err(ares_cpu::Error::Core(ares_core::Error::LengthMismatch {
            what: "cu_seqlens",
            expected,
            actual: cu_seqlens.len(),
        }));
    }
    Ok(segment_attention::SegmentAttentionShape {
        tokens: dims.tokens,
        heads: dims.heads,
        head_dim: dims.head_dim,
        scale: dims.scale,
    })
}

/// The checks shared by [`Backend::greedy_tokens`] and [`Backend::sample_tokens`]: `vocab`
/// in `1..2³²−1` (ids are u32, `u32::MAX` means "no token") and `rows` ids, host slots and
/// `rows × vocab` logits.
fn check_token_rows(
    op: &'static str,
    vocab: usize,
    rows: usize,
    host: usize,
    logits: usize,
) -> Result<()> {
    if vocab == 0 || vocab >= u32::MAX as usize {
        return Err(BackendError::Op {
            op,
            source: format!("vocab = {vocab} must be in 1..2^32-1").into(),
        });
    }
    BackendError::check_len("token rows: host", rows, host)?;
    BackendError::check_len("token rows: logits", rows.saturating_mul(vocab), logits)
}

/// The CPU form of argument `$a` of declared op `$op` (`ops.rs`): views become slices (a
/// 16-bit view's dtype checked), ids and host values pass as they are.
#[rustfmt::skip]
macro_rules! cpu_arg {
    ($op:ident, $a:ident: In<f32>) => { slice($a)? };
    ($op:ident, $a:ident: Out<f32>) => { slice_mut($a)? };
    ($op:ident, $a:ident: InOpt<f32>) => { slice_opt($a)? };
    ($op:ident, $a:ident: OutOpt<f32>) => { slice_mut_opt($a)? };
    ($op:ident, $a:ident: In<u32>) => { $a };
    ($op:ident, $a:ident: InOpt<u32>) => { $a.map(Vec::as_slice) };
    ($op:ident, $a:ident: In<bf16>) => {
        half(stringify!($op), stringify!($a), $a, DType::Bf16)?
    };
    ($op:ident, $a:ident: Out<bf16>) => {
        half_mut(stringify!($op), stringify!($a), $a, DType::Bf16)?
    };
    ($op:ident, $a:ident: InOpt<bf16>) => {
        $a.map(|v| half(stringify!($op), stringify!($a), v, DType::Bf16)).transpose()?
    };
    ($op:ident, $a:ident: OutOpt<bf16>) => {
        $a.map(|v| half_mut(stringify!($op), stringify!($a), v, DType::Bf16)).transpose()?
    };
    ($op:ident, $a:ident: Out<u8>) => { slice_mut($a)? };
    ($op:ident, $a:ident: In<stored>) => { stored(stringify!($op), stringify!($a), $a)? };
    ($op:ident, $a:ident: Views<$t:ident>) => { CpuViews::cpu($a)? };
    ($op:ident, $a:ident: ViewsMut<$t:ident>) => { CpuViews::cpu($a)? };
    ($op:ident, $a:ident: Ref<$t:ident>) => { $a };
    ($op:ident, $a:ident: $t:ident) => { $a };
}

/// The CPU implementations of the declared ops: the `ares-cpu` function named by each
/// declaration, called with its arguments in order, its error wrapped with the op's name.
macro_rules! cpu_ops {
    ($(
        $(#[$meta:meta])*
        fn $name:ident($($arg:ident: $kind:ident $(<$dt:ident>)?),* $(,)?)
            cpu $cpu:path, cuda $cuda:ident;
    )*) => {
        $(
            #[allow(clippy::too_many_arguments)]
            fn $name(&self, $($arg: op_arg_type!($kind $(<$dt>)?)),*) -> Result<()> {
                let _timer = CpuTimer::start(stringify!($name));
                $cpu($(cpu_arg!($name, $arg: $kind $(<$dt>)?)),*).map_err(op(stringify!($name)))
            }
        )*
    };
}

/// `ares-cpu` kernels whose arguments differ from their op's declaration, in the declared
/// order and types.
mod kernels {
    use super::{
        Activation, AdamWUpdate, AttentionDims, GradWrites, LinearDims, Moment,
        SegmentAttentionDims, StoredSlice, activation, adamw_step_scaled, attention,
        attention_shape, cpu_activation, linear_backward_in, linear_forward_in,
        linear_forward_t_in, matmul_dims, matmul_tiles, segment_attention, segment_shape,
    };
    use ares_cpu::Logits;

    type Result = std::result::Result<(), ares_cpu::Error>;

    /// Which gradients `writes` writes over, as `ares-cpu` takes it.
    fn overwrite_of(writes: GradWrites) -> ares_cpu::ops::matmul::Overwrite {
        use super::GradWrite::Overwrite;
        ares_cpu::ops::matmul::Overwrite {
            dx: writes.dx == Overwrite,
            dw: writes.dw == Overwrite,
        }
    }

    pub(super) fn linear(
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        dims: LinearDims,
        out: &mut [f32],
    ) -> Result {
        linear_forward_in(dims.precision, x, w, bias, matmul_dims(dims), out)
    }

    pub(super) fn linear_transposed(
        x: &[f32],
        wt: &[f32],
        bias: Option<&[f32]>,
        dims: LinearDims,
        out: &mut [f32],
    ) -> Result {
        linear_forward_t_in(dims.precision, x, wt, bias, matmul_dims(dims), out)
    }

    #[allow(clippy::too_many_arguments)] // the declared op's arguments
    pub(super) fn linear_backward(
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        dims: LinearDims,
        writes: GradWrites,
        dx: Option<&mut [f32]>,
        dw: Option<&mut [f32]>,
        dbias: Option<&mut [f32]>,
    ) -> Result {
        let md = matmul_dims(dims);
        let overwrite = overwrite_of(writes);
        linear_backward_in(dims.precision, dout, x, w, md, overwrite, dx, dw, dbias)
    }

    pub(super) fn linear_bf16(
        x: &[f32],
        w: &[u16],
        bias: Option<&[f32]>,
        dims: LinearDims,
        out: &mut [f32],
    ) -> Result {
        ares_cpu::ops::matmul::linear_forward_bf16(x, w, bias, matmul_dims(dims), out)
    }

    #[allow(clippy::too_many_arguments)] // the declared op's arguments
    pub(super) fn linear_backward_bf16(
        dout: &[f32],
        x: &[f32],
        w: &[u16],
        dims: LinearDims,
        writes: GradWrites,
        dx: Option<&mut [f32]>,
        dw: Option<&mut [f32]>,
        dbias: Option<&mut [f32]>,
    ) -> Result {
        let md = matmul_dims(dims);
        let overwrite = overwrite_of(writes);
        ares_cpu::ops::matmul::linear_backward_bf16(dout, x, w, md, overwrite, dx, dw, dbias)
    }

    pub(super) fn linear_bf16_x(
        x: &[u16],
        w: &[u16],
        bias: Option<&[f32]>,
        dims: LinearDims,
        out: &mut [f32],
    ) -> Result {
        ares_cpu::ops::matmul::linear_forward_bf16_x(x, w, bias, matmul_dims(dims), out)
    }

    pub(super) fn linear_bf16_io(
        x: &[u16],
        w: &[u16],
        bias: Option<&[f32]>,
        dims: LinearDims,
        out: &mut [u16],
    ) -> Result {
        ares_cpu::ops::matmul::linear_forward_bf16_io(x, w, bias, matmul_dims(dims), out)
    }

    #[allow(clippy::too_many_arguments)] // the declared op's arguments
    pub(super) fn linear_backward_bf16_x(
        dout: &[f32],
        x: &[u16],
        w: &[u16],
        dims: LinearDims,
        writes: GradWrites,
        dx: Option<&mut [f32]>,
        dw: Option<&mut [f32]>,
        dbias: Option<&mut [f32]>,
    ) -> Result {
        let md = matmul_dims(dims);
        let overwrite = overwrite_of(writes);
        ares_cpu::ops::matmul::linear_backward_bf16_x(dout, x, w, md, overwrite, dx, dw, dbias)
    }

    pub(super) fn linear_decode_f32(
        x: &[f32],
        wt: &[f32],
        bias: Option<&[f32]>,
        dims: LinearDims,
        out: &mut [f32],
    ) -> Result {
        let md = matmul_dims(dims);
        matmul_tiles::linear_forward_t_tiles(dims.precision, x, wt, bias, md, out)
    }

    pub(super) fn fill(dst: &mut [f32], value: f32) -> Result {
        dst.fill(value);
        Ok(())
    }

    pub(super) fn fill_bf16(dst: &mut [u16], value: f32) -> Result {
        ares_cpu::ops::precision::fill_bf16(dst, value);
        Ok(())
    }

    pub(super) fn attention<'a>(
        dims: AttentionDims,
        inputs: attention::AttentionInputs<'a>,
        segments: Option<&'a [u32]>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result {
        let inputs = attention::AttentionInputs { segments, ..inputs };
        attention::attention_forward(&attention_shape(dims), inputs, out, lse)
    }

    pub(super) fn attention_bf16<'a>(
        dims: AttentionDims,
        inputs: attention::AttentionInputs<'a>,
        segments: Option<&'a [u32]>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result {
        let inputs = attention::AttentionInputs { segments, ..inputs };
        attention::attention_forward_bf16(&attention_shape(dims), inputs, out, lse)
    }

    pub(super) fn attention_backward<'a>(
        dims: AttentionDims,
        inputs: attention::AttentionInputs<'a>,
        segments: Option<&'a [u32]>,
        out: &[f32],
        lse: &[f32],
        dout: &[f32],
        grads: attention::AttentionGrads<'_>,
    ) -> Result {
        let inputs = attention::AttentionInputs { segments, ..inputs };
        let shape = attention_shape(dims);
        attention::attention_backward(&shape, inputs, out, lse, dout, grads)
    }

    pub(super) fn attention_backward_bf16<'a>(
        dims: AttentionDims,
        inputs: attention::AttentionInputs<'a>,
        segments: Option<&'a [u32]>,
        out: &[f32],
        lse: &[f32],
        dout: &[f32],
        grads: attention::AttentionGrads<'_>,
    ) -> Result {
        let inputs = attention::AttentionInputs { segments, ..inputs };
        let shape = attention_shape(dims);
        attention::attention_backward_bf16(&shape, inputs, out, lse, dout, grads)
    }

    /// q, k, v stored in bf16, widened (exact) for the twin, which rounds them back to the
    /// same bits as it loads them.
    fn widened(
        q: &[u16],
        k: &[u16],
        v: &[u16],
    ) -> std::result::Result<[Vec<f32>; 3], ares_cpu::Error> {
        let mut out = [q, k, v].map(|x| vec![0.0f32; x.len()]);
        for (src, dst) in [q, k, v].into_iter().zip(&mut out) {
            ares_cpu::ops::precision::widen_bf16(src, dst)?;
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)] // the declared op's arguments
    pub(super) fn attention_bf16_stored<'a>(
        dims: AttentionDims,
        q: &[u16],
        k: &[u16],
        v: &[u16],
        key_mask: Option<&'a [f32]>,
        segments: Option<&'a [u32]>,
        out: Option<&mut [f32]>,
        out16: Option<&mut [u16]>,
        lse: &mut [f32],
    ) -> Result {
        let [q, k, v] = widened(q, k, v)?;
        let (q, k, v) = (q.as_slice(), k.as_slice(), v.as_slice());
        let inputs = attention::AttentionInputs {
            q,
            k,
            v,
            key_mask,
            segments,
        };
        let shape = attention_shape(dims);
        stored_output(out, out16, |out| {
            attention::attention_forward_bf16(&shape, inputs, out, lse)
        })
    }

    /// Runs `forward` into `out` (f32), or into an f32 scratch then rounded once into
    /// `out16` (the kernels round as they store); exactly one of them.
    fn stored_output(
        out: Option<&mut [f32]>,
        out16: Option<&mut [u16]>,
        forward: impl FnOnce(&mut [f32]) -> Result,
    ) -> Result {
        match (out, out16) {
            (Some(out), None) => forward(out),
            (None, Some(out16)) => {
                let mut out = vec![0.0f32; out16.len()];
                forward(&mut out)?;
                ares_cpu::ops::precision::round_to_bf16(&out, out16)
            }
            (out, out16) => Err(one_output(
                usize::from(out.is_some()) + usize::from(out16.is_some()),
            )),
        }
    }

    /// The forward's output as a stored backward reads it: `out` (f32), or `out16`'s bits
    /// widened into `scratch`; exactly one of them.
    fn saved_output<'a>(
        out: Option<&'a [f32]>,
        out16: Option<&[u16]>,
        scratch: &'a mut Vec<f32>,
    ) -> std::result::Result<&'a [f32], ares_cpu::Error> {
        match (out, out16) {
            (Some(out), None) => Ok(out),
            (None, Some(out16)) => {
                scratch.resize(out16.len(), 0.0);
                ares_cpu::ops::precision::widen_bf16(out16, scratch)?;
                Ok(scratch)
            }
            (out, out16) => Err(one_output(
                usize::from(out.is_some()) + usize::from(out16.is_some()),
            )),
        }
    }

    /// Both of an attention's outputs given, or neither: how many were.
    fn one_output(given: usize) -> ares_cpu::Error {
        ares_cpu::Error::Core(ares_core::Error::OutOfRange {
            what: "outputs given (out, out16)",
            value: given as f64,
            expected: "exactly 1: the f32 or the bf16 output",
        })
    }

    #[allow(clippy::too_many_arguments)] // the declared op's arguments
    pub(super) fn attention_backward_bf16_stored<'a>(
        dims: AttentionDims,
        q: &[u16],
        k: &[u16],
        v: &[u16],
        key_mask: Option<&'a [f32]>,
        segments: Option<&'a [u32]>,
        out: Option<&[f32]>,
        out16: Option<&[u16]>,
        lse: &[f32],
        dout: &[f32],
        grads: attention::AttentionGrads<'_>,
    ) -> Result {
        let mut scratch = Vec::new();
        let out = saved_output(out, out16, &mut scratch)?;
        let [q, k, v] = widened(q, k, v)?;
        let (q, k, v) = (q.as_slice(), k.as_slice(), v.as_slice());
        let inputs = attention::AttentionInputs {
            q,
            k,
            v,
            key_mask,
            segments,
        };
        let shape = attention_shape(dims);
        attention::attention_backward_bf16(&shape, inputs, out, lse, dout, grads)
    }

    pub(super) fn round_bf16(src: &[f32], dst: &mut [u16]) -> Result {
        ares_cpu::ops::precision::round_to_bf16(src, dst)
    }

    pub(super) fn copy<T: Copy>(src: &[T], dst: &mut [T]) -> Result {
        if src.len() != dst.len() {
            return Err(ares_cpu::Error::Core(ares_core::Error::LengthMismatch {
                what: "dst",
                expected: src.len(),
                actual: dst.len(),
            }));
        }
        dst.copy_from_slice(src);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)] // the declared op's arguments, in its order
    pub(super) fn segment_attention_backward(
        dims: SegmentAttentionDims,
        cu_seqlens: &[u32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &[f32],
        lse: &[f32],
        dout: &[f32],
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    ) -> Result {
        let shape = segment_shape(dims, cu_seqlens)?;
        let saved = segment_attention::SegmentAttentionSaved { out, lse, dout };
        segment_attention::segment_attention_backward(
            &shape, cu_seqlens, q, k, v, saved, dq, dk, dv,
        )
    }

    #[allow(clippy::too_many_arguments)] // the declared op's arguments, in its order
    pub(super) fn segment_attention_backward_bf16(
        dims: SegmentAttentionDims,
        cu_seqlens: &[u32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &[f32],
        lse: &[f32],
        dout: &[f32],
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    ) -> Result {
        let shape = segment_shape(dims, cu_seqlens)?;
        let saved = segment_attention::SegmentAttentionSaved { out, lse, dout };
        segment_attention::segment_attention_backward_bf16(
            &shape, cu_seqlens, q, k, v, saved, dq, dk, dv,
        )
    }

    #[allow(clippy::too_many_arguments)] // the declared op's arguments
    pub(super) fn segment_attention_bf16_stored(
        dims: SegmentAttentionDims,
        cu_seqlens: &[u32],
        q: &[u16],
        k: &[u16],
        v: &[u16],
        out: Option<&mut [f32]>,
        out16: Option<&mut [u16]>,
        lse: &mut [f32],
    ) -> Result {
        let shape = segment_shape(dims, cu_seqlens)?;
        let [q, k, v] = widened(q, k, v)?;
        stored_output(out, out16, |out| {
            segment_attention::segment_attention_forward_bf16(
                &shape, cu_seqlens, &q, &k, &v, out, lse,
            )
        })
    }

    #[allow(clippy::too_many_arguments)] // the declared op's arguments
    pub(super) fn segment_attention_backward_bf16_stored(
        dims: SegmentAttentionDims,
        cu_seqlens: &[u32],
        q: &[u16],
        k: &[u16],
        v: &[u16],
        out: Option<&[f32]>,
        out16: Option<&[u16]>,
        lse: &[f32],
        dout: &[f32],
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
    ) -> Result {
        let shape = segment_shape(dims, cu_seqlens)?;
        let mut scratch = Vec::new();
        let out = saved_output(out, out16, &mut scratch)?;
        let [q, k, v] = widened(q, k, v)?;
        let saved = segment_attention::SegmentAttentionSaved { out, lse, dout };
        segment_attention::segment_attention_backward_bf16(
            &shape, cu_seqlens, &q, &k, &v, saved, dq, dk, dv,
        )
    }

    pub(super) fn segment_attention_bf16(
        dims: SegmentAttentionDims,
        cu_seqlens: &[u32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result {
        let shape = segment_shape(dims, cu_seqlens)?;
        segment_attention::segment_attention_forward_bf16(&shape, cu_seqlens, q, k, v, out, lse)
    }

    pub(super) fn linear_transposed_bf16(
        x: &[f32],
        wt: &[u16],
        bias: Option<&[f32]>,
        dims: LinearDims,
        out: &mut [f32],
    ) -> Result {
        matmul_tiles::linear_forward_t_bf16(x, wt, bias, matmul_dims(dims), out)
    }

    pub(super) fn log_prob_entropy(
        logits: &[f32],
        vocab: usize,
        temperature: f32,
        targets: &[u32],
        log_prob: &mut [f32],
        entropy: &mut [f32],
    ) -> Result {
        if entropy.len() != targets.len() {
            return Err(ares_cpu::Error::Core(ares_core::Error::LengthMismatch {
                what: "entropy",
                expected: targets.len(),
                actual: entropy.len(),
            }));
        }
        let logits = Logits::F32(logits);
        ares_cpu::log_prob_entropy(
            logits,
            vocab,
            temperature,
            Some((targets, log_prob)),
            entropy,
        )
    }

    /// AdamW with 8-bit moments.
    #[allow(clippy::too_many_arguments)] // the declared op's arguments
    pub(super) fn adamw_step_int8(
        param: &mut [f32],
        grad: StoredSlice<'_>,
        exp_avg: &mut [u8],
        exp_avg_sq: &mut [u8],
        exp_avg_absmax: &mut [f32],
        exp_avg_sq_absmax: &mut [f32],
        maps: &[f32],
        u: &AdamWUpdate,
        copy: Option<&mut [u16]>,
    ) -> Result {
        let (step, lr, scale) = (u.step, u.lr, u.grad_scale);
        let (m, v) = (exp_avg, exp_avg_sq);
        let (ma, va) = (exp_avg_absmax, exp_avg_sq_absmax);
        check_copy(param.len(), copy.as_deref())?;
        use ares_cpu::ops::optim_int8::adamw_step_int8 as int8;
        let cfg = &u.config;
        match grad {
            StoredSlice::F32(g) => int8(param, g, m, v, ma, va, maps, step, cfg, lr, scale),
            StoredSlice::Bf16(g) => int8(param, g, m, v, ma, va, maps, step, cfg, lr, scale),
        }?;
        write_copy(param, copy)
    }

    /// AdamW with f32 moments.
    pub(super) fn adamw_step(
        param: &mut [f32],
        grad: StoredSlice<'_>,
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
        u: &AdamWUpdate,
        copy: Option<&mut [u16]>,
    ) -> Result {
        adamw_step_keyed(param, 0, grad, exp_avg, exp_avg_sq, u, copy)
    }

    /// AdamW with moments stored as `M` (f32, or bf16 bits rounded stochastically under
    /// `key`'s moment streams).
    pub(super) fn adamw_step_keyed<M: Moment>(
        param: &mut [f32],
        key: u64,
        grad: StoredSlice<'_>,
        exp_avg: &mut [M],
        exp_avg_sq: &mut [M],
        u: &AdamWUpdate,
        copy: Option<&mut [u16]>,
    ) -> Result {
        let (step, lr, scale) = (u.step, u.lr, u.grad_scale);
        let (m, v, cfg) = (exp_avg, exp_avg_sq, &u.config);
        check_copy(param.len(), copy.as_deref())?;
        match grad {
            StoredSlice::F32(g) => adamw_step_scaled(param, g, m, v, step, cfg, lr, scale, key),
            StoredSlice::Bf16(g) => adamw_step_scaled(param, g, m, v, step, cfg, lr, scale, key),
        }?;
        write_copy(param, copy)
    }

    thread_local! {
        /// The f32 copy of a bf16-stored weight during its update, reused (grown to the
        /// largest tensor once: no allocation, no page faults, in later steps).
        static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// `update` applied to `weight` (bf16 bits) widened into the reused f32 copy, the result
    /// rounded back stochastically under `key`: nothing is written when `update` fails.
    fn on_bf16_weight(
        weight: &mut [u16],
        key: u64,
        update: impl FnOnce(&mut [f32]) -> Result,
    ) -> Result {
        use ares_cpu::ops::precision::{round_to_bf16_stochastic, widen_bf16};
        WIDE.with(|wide| {
            let mut wide = wide.borrow_mut();
            if wide.len() < weight.len() {
                wide.resize(weight.len(), 0.0);
            }
            let p = &mut wide[..weight.len()];
            widen_bf16(weight, p)?;
            update(p)?;
            round_to_bf16_stochastic(p, key, weight)
        })
    }

    /// AdamW of a weight stored in bf16, moments stored as `M`: widen, update, round
    /// stochastically (the declared op's three ops in turn).
    pub(super) fn adamw_step_bf16_weight<M: Moment>(
        weight: &mut [u16],
        key: u64,
        grad: StoredSlice<'_>,
        exp_avg: &mut [M],
        exp_avg_sq: &mut [M],
        u: &AdamWUpdate,
    ) -> Result {
        on_bf16_weight(weight, key, |p| {
            adamw_step_keyed(p, key, grad, exp_avg, exp_avg_sq, u, None)
        })
    }

    /// AdamW of a weight stored in bf16 with 8-bit moments (as above).
    #[allow(clippy::too_many_arguments)] // the declared op's arguments, in its order
    pub(super) fn adamw_step_bf16_weight_int8(
        weight: &mut [u16],
        key: u64,
        grad: StoredSlice<'_>,
        exp_avg: &mut [u8],
        exp_avg_sq: &mut [u8],
        exp_avg_absmax: &mut [f32],
        exp_avg_sq_absmax: &mut [f32],
        maps: &[f32],
        u: &AdamWUpdate,
    ) -> Result {
        on_bf16_weight(weight, key, |p| {
            let (m, v, ma, va) = (exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax);
            adamw_step_int8(p, grad, m, v, ma, va, maps, u, None)
        })
    }

    /// A bf16 copy as long as its parameter (checked before the update, so a bad one
    /// changes nothing).
    fn check_copy(len: usize, copy: Option<&[u16]>) -> Result {
        match copy {
            Some(c) if c.len() != len => {
                Err(ares_cpu::Error::Core(ares_core::Error::LengthMismatch {
                    what: "copy",
                    expected: len,
                    actual: c.len(),
                }))
            }
            _ => Ok(()),
        }
    }

    /// The updated parameter into its bf16 copy: the bits of `round_bf16` (on the GPU the
    /// update kernel writes them; here a pass over the parameter just written).
    fn write_copy(param: &[f32], copy: Option<&mut [u16]>) -> Result {
        match copy {
            Some(c) => round_bf16(param, c),
            None => Ok(()),
        }
    }

    pub(super) fn activation(kind: Activation, x: &[f32], out: &mut [f32]) -> Result {
        activation::activation_forward(cpu_activation(kind), x, out)
    }

    pub(super) fn activation_backward(
        kind: Activation,
        dout: &[f32],
        x: &[f32],
        dx: &mut [f32],
    ) -> Result {
        activation::activation_backward(cpu_activation(kind), dout, x, dx)
    }

    pub(super) fn segment_attention(
        dims: SegmentAttentionDims,
        cu_seqlens: &[u32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result {
        let shape = segment_shape(dims, cu_seqlens)?;
        segment_attention::segment_attention_forward(&shape, cu_seqlens, q, k, v, out, lse)
    }
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type Ids = Vec<u32>;
    type Half = HalfBuffer;
    type Bytes = Vec<u8>;
    type Graph = ();

    fn packs_sequences(&self) -> bool {
        true
    }

    fn replay(&self, (): &()) -> Result<()> {
        Err(BackendError::Op {
            op: "replay",
            source: "the CPU backend records no graph (begin_capture is false)".into(),
        })
    }

    fn op_profile(&self) -> Result<Option<String>> {
        Ok(profile::cpu_table())
    }

    fn name(&self) -> &str {
        "cpu"
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn alloc_ids(&self, len: usize) -> Result<Vec<u32>> {
        Ok(vec![0; len])
    }

    fn alloc_half(&self, len: usize, dtype: DType) -> Result<HalfBuffer> {
        check_half("alloc_half", dtype)?;
        Ok(HalfBuffer {
            dtype,
            bits: vec![0; len],
        })
    }

    fn alloc_bytes(&self, len: usize) -> Result<Vec<u8>> {
        Ok(vec![0; len])
    }

    fn upload_bytes(&self, src: &[u8], dst: ViewMut<'_, Vec<u8>>) -> Result<()> {
        let _timer = CpuTimer::start("upload_bytes");
        let dst = slice_mut(dst)?;
        BackendError::check_len("upload_bytes destination", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn download_bytes(&self, src: View<'_, Vec<u8>>, dst: &mut [u8]) -> Result<()> {
        let _timer = CpuTimer::start("download_bytes");
        BackendError::check_len("download_bytes destination", src.len(), dst.len())?;
        let (offset, len) = (src.offset(), src.len());
        dst.copy_from_slice(&src.buffer()[offset..offset + len]);
        Ok(())
    }

    fn upload(&self, src: &[f32], dst: TensorMut<'_, Self>) -> Result<()> {
        let _timer = CpuTimer::start("upload");
        let dst = slice_mut(dst)?;
        BackendError::check_len("upload destination", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn upload_ids(&self, src: &[u32], dst: &mut Vec<u32>) -> Result<()> {
        let _timer = CpuTimer::start("upload_ids");
        BackendError::check_len("upload_ids destination", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: Tensor<'_, Self>, dst: &mut [f32]) -> Result<()> {
        let _timer = CpuTimer::start("download");
        let src = slice(src)?;
        BackendError::check_len("download destination", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn upload_half(&self, src: &[u16], dst: ViewMut<'_, HalfBuffer>) -> Result<()> {
        let _timer = CpuTimer::start("upload_half");
        BackendError::check_len("upload_half destination", src.len(), dst.len())?;
        let (offset, len) = (dst.offset(), dst.len());
        dst.into_buffer().bits[offset..offset + len].copy_from_slice(src);
        Ok(())
    }

    fn download_half(&self, src: View<'_, HalfBuffer>, dst: &mut [u16]) -> Result<()> {
        let _timer = CpuTimer::start("download_half");
        BackendError::check_len("download_half destination", src.len(), dst.len())?;
        let (offset, len) = (src.offset(), src.len());
        dst.copy_from_slice(&src.buffer().bits[offset..offset + len]);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    declared_ops!(cpu_ops);

    fn add(
        &self,
        a: Tensor<'_, Self>,
        b: Tensor<'_, Self>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("add");
        let (a, b, out) = (slice(a)?, slice(b)?, slice_mut(out)?);
        BackendError::check_len("add b", a.len(), b.len())?;
        BackendError::check_len("add out", a.len(), out.len())?;
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = x + y;
        }
        Ok(())
    }

    fn greedy_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        ids: &mut Vec<u32>,
        host: &mut [u32],
    ) -> Result<()> {
        let _timer = CpuTimer::start("greedy_tokens");
        let logits = slice(logits)?;
        check_token_rows("greedy_tokens", vocab, ids.len(), host.len(), logits.len())?;
        for ((id, h), row) in ids
            .iter_mut()
            .zip(host.iter_mut())
            .zip(logits.chunks_exact(vocab))
        {
            *id = greedy_row(row).unwrap_or(u32::MAX);
            *h = *id;
        }
        Ok(())
    }

    fn sample_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        sampler: &Sampler,
        keys: &[SampleKey],
        ids: &mut Vec<u32>,
        host: &mut [u32],
    ) -> Result<()> {
        let _timer = CpuTimer::start("sample_tokens");
        let logits = slice(logits)?;
        check_token_rows("sample_tokens", vocab, ids.len(), host.len(), logits.len())?;
        BackendError::check_len("sample_tokens keys", ids.len(), keys.len())?;
        ares_cpu::sampler::sample_rows(logits, vocab, sampler, keys, ids).map_err(|e| {
            BackendError::Op {
                op: "sample_tokens",
                source: e.into(),
            }
        })?;
        host.copy_from_slice(ids);
        Ok(())
    }

    fn sums_of_squares(&self, xs: &[Stored<'_, Self>], out: &mut [f64]) -> Result<()> {
        const OP: &str = "sums_of_squares";
        let _timer = CpuTimer::start(OP);
        BackendError::check_len("sums_of_squares: out", xs.len(), out.len())?;
        for (x, o) in xs.iter().zip(out) {
            *o = match *x {
                Stored::F32(x) => sum_of_squares_f64(slice(x)?),
                Stored::Bf16(x) => sum_of_squares_bf16(half(OP, "xs", x, DType::Bf16)?),
            };
        }
        Ok(())
    }

    fn kv_cache_append(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: KvCacheViewMut<'_, Vec<f32>>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("kv_cache_append");
        let mut len = vec![cache.len; dims.batch];
        kv_cache_append(
            &attention_shape(dims),
            slice(k_new)?,
            slice(v_new)?,
            attention::KvCacheMut {
                k: slice_mut(cache.k)?,
                v: slice_mut(cache.v)?,
                max_len: cache.max_len,
                len: &mut len,
            },
        )
        .map_err(op("kv_cache_append"))
    }

    fn attention_decode(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: KvCacheView<'_, Vec<f32>>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("attention_decode");
        let len = vec![cache.len; dims.batch];
        let cache = attention::KvCache {
            k: slice(cache.k)?,
            v: slice(cache.v)?,
            max_len: cache.max_len,
            len: &len,
            key_mask: slice_opt(cache.key_mask)?,
        };
        attention_decode(&attention_shape(dims), slice(q)?, cache, slice_mut(out)?)
            .map_err(op("attention_decode"))
    }

    fn paged_kv_cache_append(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: PagedKvViewMut<'_, Vec<f32>, Vec<u32>>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("paged_kv_cache_append");
        let b = cache.blocks;
        attention::paged_kv_cache_append(
            &attention_shape(dims),
            slice(k_new)?,
            slice(v_new)?,
            paged_mut(slice_mut(cache.k)?, slice_mut(cache.v)?, b),
        )
        .map_err(op("paged_kv_cache_append"))
    }

    fn paged_attention_decode(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, Vec<f32>, Vec<u32>>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("paged_attention_decode");
        let len = lens_after(cache.blocks, dims);
        attention::paged_attention_decode(
            &attention_shape(dims),
            slice(q)?,
            paged(slice(cache.k)?, slice(cache.v)?, cache.blocks, &len),
            slice_mut(out)?,
        )
        .map_err(op("paged_attention_decode"))
    }

    fn paged_kv_cache_append_bf16(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: PagedKvViewMut<'_, HalfBuffer, Vec<u32>>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("paged_kv_cache_append_bf16");
        const OP: &str = "paged_kv_cache_append_bf16";
        let b = cache.blocks;
        attention::paged_kv_cache_append_bf16(
            &attention_shape(dims),
            slice(k_new)?,
            slice(v_new)?,
            paged_mut(
                half_mut(OP, "k_cache", cache.k, DType::Bf16)?,
                half_mut(OP, "v_cache", cache.v, DType::Bf16)?,
                b,
            ),
        )
        .map_err(op(OP))
    }

    fn paged_attention_decode_bf16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, HalfBuffer, Vec<u32>>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("paged_attention_decode_bf16");
        const OP: &str = "paged_attention_decode_bf16";
        let len = lens_after(cache.blocks, dims);
        let (k, v) = (
            half(OP, "k_cache", cache.k, DType::Bf16)?,
            half(OP, "v_cache", cache.v, DType::Bf16)?,
        );
        attention::paged_attention_decode_bf16(
            &attention_shape(dims),
            slice(q)?,
            paged(k, v, cache.blocks, &len),
            slice_mut(out)?,
        )
        .map_err(op(OP))
    }

    fn paged_attention_prefill_bf16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, Vec<f32>, Vec<u32>>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("paged_attention_prefill_bf16");
        let len = lens_after(cache.blocks, dims);
        attention::paged_attention_prefill_bf16(
            &attention_shape(dims),
            slice(q)?,
            paged(slice(cache.k)?, slice(cache.v)?, cache.blocks, &len),
            slice_mut(out)?,
        )
        .map_err(op("paged_attention_prefill_bf16"))
    }

    fn paged_attention_prefill_bf16_kv16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, HalfBuffer, Vec<u32>>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("paged_attention_prefill_bf16_kv16");
        const OP: &str = "paged_attention_prefill_bf16_kv16";
        let len = lens_after(cache.blocks, dims);
        let (k, v) = (
            half(OP, "k_cache", cache.k, DType::Bf16)?,
            half(OP, "v_cache", cache.v, DType::Bf16)?,
        );
        attention::paged_attention_prefill_bf16_kv16(
            &attention_shape(dims),
            slice(q)?,
            paged(k, v, cache.blocks, &len),
            slice_mut(out)?,
        )
        .map_err(op(OP))
    }

    fn entropy_windows(
        &self,
        entropy: Tensor<'_, Self>,
        mask: Tensor<'_, Self>,
        spec: WindowSpec,
        hwe: Option<HweViews<'_, Vec<f32>>>,
        means: TensorMut<'_, Self>,
        valid: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("entropy_windows");
        let hwe = match hwe {
            Some(h) => Some(ares_cpu::HweOutputs {
                tau: h.tau,
                trigger: slice_opt(h.trigger)?,
                hwe_mask: slice_mut(h.hwe_mask)?,
                counts: slice_mut(h.counts)?,
                soft_cost: slice_mut(h.soft_cost)?,
            }),
            None => None,
        };
        ares_cpu::entropy_windows(
            slice(entropy)?,
            slice(mask)?,
            spec,
            hwe,
            slice_mut(means)?,
            slice_mut(valid)?,
        )
        .map_err(op("entropy_windows"))
    }

    fn masked_dynamic_kl(
        &self,
        inputs: KlViews<'_, Vec<f32>>,
        outputs: KlSumViews<'_, Vec<f32>>,
    ) -> Result<()> {
        let _timer = CpuTimer::start("masked_dynamic_kl");
        let inputs = ares_cpu::MaskedKlInputs {
            logp: slice(inputs.logp)?,
            ref_logp: slice(inputs.ref_logp)?,
            mask: slice(inputs.mask)?,
            hwe_mask: slice_opt(inputs.hwe_mask)?,
            beta_rows: slice(inputs.beta_rows)?,
            low_ratio: inputs.low_ratio,
            estimator: inputs.estimator,
            cols: inputs.cols,
        };
        let outputs = ares_cpu::MaskedKlOutputs {
            kl: None,
            weighted: slice_mut_opt(outputs.weighted)?,
            row_weighted_sum: slice_mut(outputs.row_weighted_sum)?,
            row_mean_kl: slice_mut(outputs.row_mean_kl)?,
        };
        ares_cpu::masked_dynamic_kl(inputs, outputs)
            .map(|_| ())
            .map_err(op("masked_dynamic_kl"))
    }

    fn actor_loss(
        &self,
        spec: &ActorLossSpec,
        inputs: ActorLossViews<'_, Vec<f32>>,
        grads: ActorLossGrads<'_, Vec<f32>>,
        report: TensorMut<'_, Self>,
    ) -> Result<std::result::Result<(), ares_core::Error>> {
        use ares_core::loss::{ActorLoss, EntropyTerm, KlTerm, PolicyLossInput};
        let _timer = CpuTimer::start("actor_loss");
        let logp = slice(inputs.logp)?;
        let cols = inputs.cols.max(1);
        let shape = ares_core::Shape::new(logp.len() / cols, inputs.cols);
        fn need<'v>(what: &str, v: Option<&'v [f32]>) -> Result<&'v [f32]> {
            v.ok_or_else(|| BackendError::Refused {
                op: "actor_loss",
                message: format!("`{what}` is required by the spec"),
            })
        }
        let (logp_ref, beta, hwe) = (
            slice_opt(inputs.logp_ref)?,
            slice_opt(inputs.beta_rows)?,
            slice_opt(inputs.hwe_mask)?,
        );
        let entropy = slice_opt(inputs.entropy)?;
        let kl = match spec.kl {
            Some((estimator, low_ratio)) => Some(KlTerm {
                estimator,
                beta: need("beta_rows", beta)?,
                hwe_mask: hwe,
                low_ratio,
                logp_ref: need("logp_ref", logp_ref)?,
            }),
            None => None,
        };
        let entropy = match spec.entropy_coef {
            Some(coef) => Some(EntropyTerm {
                coef,
                entropy: need("entropy", entropy)?,
            }),
            None => None,
        };
        let input = PolicyLossInput {
            shape,
            logp,
            logp_old: slice(inputs.logp_old)?,
            advantages: slice(inputs.advantages)?,
            mask: slice(inputs.mask)?,
            logp_rollout: slice_opt(inputs.logp_rollout)?,
        };
        let loss = ActorLoss {
            objective: spec.objective,
            config: spec.config,
            keep: slice_opt(inputs.keep)?,
            kl,
            entropy,
            scale: spec.scale,
        };
        let grad = slice_mut(grads.grad)?;
        let mut entropy_grad = slice_mut_opt(grads.entropy_grad)?;
        let n = grad.len();
        let mut scratch = vec![0.0f32; if loss.kl.is_some() { 2 * n } else { 0 }];
        let mut index_scratch = vec![
            0usize;
            if spec.objective.selects_tokens() {
                n
            } else {
                0
            }
        ];
        let report = slice_mut(report)?;
        BackendError::check_len("actor_loss: report", ACTOR_LOSS_REPORT, report.len())?;
        let out = ares_core::loss::actor_loss(
            &input,
            &loss,
            &mut *grad,
            entropy_grad.as_deref_mut(),
            &mut scratch,
            &mut index_scratch,
        );
        let finite = |o: &ares_core::loss::ActorLossOutput<f32>| {
            o.policy.loss.is_finite() && o.kl_loss.is_finite() && o.entropy.is_finite()
        };
        if !out.as_ref().is_ok_and(finite) {
            // a refused report: no gradient (as the kernel leaves it)
            grad.fill(0.0);
            if let Some(e) = entropy_grad {
                e.fill(0.0);
            }
        }
        let out = match out {
            Ok(o) => o,
            Err(e) => return Ok(Err(e)),
        };
        let p = &out.policy;
        let valid = u32::try_from(p.valid_tokens).unwrap_or(u32::MAX);
        report.copy_from_slice(&[
            p.loss,
            p.clipfrac,
            p.clipfrac_lower,
            p.approx_kl,
            p.is_weight_mean,
            p.is_changed_frac,
            p.selected_frac,
            f32::from_bits(valid),
            out.kl_loss,
            out.entropy,
            0.0,
            0.0,
        ]);
        Ok(Ok(()))
    }

    fn actor_loss_output(
        &self,
        report: &[f32; ACTOR_LOSS_REPORT],
    ) -> std::result::Result<ares_core::loss::ActorLossOutput<f32>, ares_core::Error> {
        // the layout `actor_loss` writes: core's values, the valid count as its bits
        let r = report;
        Ok(ares_core::loss::ActorLossOutput {
            policy: ares_core::loss::PolicyLossOutput {
                loss: r[0],
                clipfrac: r[1],
                clipfrac_lower: r[2],
                approx_kl: r[3],
                is_weight_mean: r[4],
                is_changed_frac: r[5],
                selected_frac: r[6],
                valid_tokens: r[7].to_bits() as usize,
            },
            kl_loss: r[8],
            entropy: r[9],
        })
    }
}

#[cfg(test)]
mod backward_tests {
    use super::*;
    use crate::backend::MatmulPrecision;

    /// `actor_loss` queues its values into a report that `actor_loss_output` reads back as
    /// core's; a refused report (a non-finite input, a loss that overflows) leaves the
    /// gradients 0, as the CUDA kernel does, so a backward queued before the read is
    /// harmless.
    #[test]
    fn actor_loss_reports_core_values_and_zeroes_refused_gradients() {
        use ares_core::loss::{Objective, PolicyLossConfig};
        let be = CpuBackend;
        let spec = ActorLossSpec {
            objective: Objective::Ppo,
            config: PolicyLossConfig::default(),
            kl: None,
            entropy_coef: None,
            scale: 0.5,
        };
        let run = |adv: f32, logp0: f32| {
            let (logp, old) = (vec![logp0, -1.0, -0.5, -2.0], vec![-1.1, -0.9, -0.5, -2.0]);
            let (adv, mask) = (vec![adv, -adv, adv, 0.0], vec![1.0, 1.0, 1.0, 0.0]);
            let (mut grad, mut report) = (vec![7.0f32; 4], vec![f32::NAN; ACTOR_LOSS_REPORT]);
            let views = ActorLossViews {
                logp: View::whole(&logp),
                logp_old: View::whole(&old),
                advantages: View::whole(&adv),
                mask: View::whole(&mask),
                logp_rollout: None,
                keep: None,
                logp_ref: None,
                beta_rows: None,
                hwe_mask: None,
                entropy: None,
                cols: 2,
            };
            let grads = ActorLossGrads {
                grad: ViewMut::whole(&mut grad),
                entropy_grad: None,
            };
            let queued = be
                .actor_loss(&spec, views, grads, ViewMut::whole(&mut report))
                .unwrap();
            (queued, grad, report)
        };
        let (queued, grad, report) = run(1.5, -1.0);
        assert!(queued.is_ok());
        let out = be
            .actor_loss_output(&report.clone().try_into().unwrap())
            .unwrap();
        assert_eq!(out.policy.valid_tokens, 3);
        assert!(out.policy.loss.is_finite() && grad.iter().any(|&g| g != 0.0));
        assert_eq!(grad[3], 0.0, "padding");
        // overflowing advantages: the report reads, its loss is not finite, no gradient
        let (queued, grad, report) = run(3e38, 5.0);
        assert!(queued.is_ok());
        let out = be.actor_loss_output(&report.try_into().unwrap()).unwrap();
        assert!(!out.policy.loss.is_finite());
        assert_eq!(grad, [0.0; 4]);
        // a NaN input: core's error at once, no gradient
        let (queued, grad, _) = run(1.5, f32::NAN);
        assert!(matches!(queued, Err(ares_core::Error::NonFinite { .. })));
        assert_eq!(grad, [0.0; 4]);
    }

    #[test]
    fn backward_ops_accumulate_or_overwrite_as_documented() {
        let be = CpuBackend;
        // linear: y = x·wᵀ with x [1, 2], w [1, 2]; dout = [1] → dx = w, dw = x, db = 1.
        let (x, w, dout) = (vec![2.0f32, 3.0], vec![5.0f32, 7.0], vec![1.0f32]);
        let (mut dx, mut dw, mut db) = (vec![1.0f32; 2], vec![1.0f32; 2], vec![1.0f32]);
        let dims = LinearDims {
            rows: 1,
            in_features: 2,
            out_features: 1,
            precision: MatmulPrecision::F32,
        };
        be.linear_backward(
            View::whole(&dout),
            View::whole(&x),
            View::whole(&w),
            dims,
            GradWrites::ACCUMULATE,
            Some(ViewMut::whole(&mut dx)),
            Some(ViewMut::whole(&mut dw)),
            Some(ViewMut::whole(&mut db)),
        )
        .unwrap();
        assert_eq!((dx, dw, db), (vec![6.0, 8.0], vec![3.0, 4.0], vec![2.0]));
        // dx overwritten (its NaNs not read); dw and db still accumulate
        let (mut dx, mut dw, mut db) = (vec![f32::NAN; 2], vec![1.0f32; 2], vec![1.0f32]);
        be.linear_backward(
            View::whole(&dout),
            View::whole(&x),
            View::whole(&w),
            dims,
            GradWrites::dx(GradWrite::Overwrite),
            Some(ViewMut::whole(&mut dx)),
            Some(ViewMut::whole(&mut dw)),
            Some(ViewMut::whole(&mut db)),
        )
        .unwrap();
        assert_eq!((dx, dw, db), (vec![5.0, 7.0], vec![3.0, 4.0], vec![2.0]));
        // dw overwritten too (its NaNs not read); db still accumulates
        let (mut dx, mut dw, mut db) = (vec![f32::NAN; 2], vec![f32::NAN; 2], vec![1.0f32]);
        let both = GradWrites {
            dx: GradWrite::Overwrite,
            dw: GradWrite::Overwrite,
        };
        be.linear_backward(
            View::whole(&dout),
            View::whole(&x),
            View::whole(&w),
            dims,
            both,
            Some(ViewMut::whole(&mut dx)),
            Some(ViewMut::whole(&mut dw)),
            Some(ViewMut::whole(&mut db)),
        )
        .unwrap();
        assert_eq!((dx, dw, db), (vec![5.0, 7.0], vec![2.0, 3.0], vec![2.0]));

        // fill zeroes a window only.
        let mut buf = vec![1.0f32; 4];
        be.fill(ViewMut::new(&mut buf, 1, 2).unwrap(), 0.0).unwrap();
        assert_eq!(buf, [1.0, 0.0, 0.0, 1.0]);

        // rope_backward inverts rope (an orthogonal rotation).
        let (cos, sin) = (vec![0.6f32], vec![0.8f32]);
        let mut v = vec![1.0f32, 2.0];
        be.rope(
            ViewMut::whole(&mut v),
            View::whole(&cos),
            View::whole(&sin),
            1,
            2,
        )
        .unwrap();
        be.rope_backward(
            ViewMut::whole(&mut v),
            View::whole(&cos),
            View::whole(&sin),
            1,
            2,
        )
        .unwrap();
        assert!((v[0] - 1.0).abs() < 1e-6 && (v[1] - 2.0).abs() < 1e-6);

        // swiglu_backward overwrites: at gate 0, silu'(0) = 1/2 and silu(0) = 0.
        let (g, u, d) = (vec![0.0f32], vec![4.0f32], vec![1.0f32]);
        let (mut dg, mut du) = (vec![9.0f32], vec![9.0f32]);
        be.swiglu_backward(
            View::whole(&d),
            View::whole(&g),
            View::whole(&u),
            ViewMut::whole(&mut dg),
            ViewMut::whole(&mut du),
        )
        .unwrap();
        assert_eq!((dg[0], du[0]), (2.0, 0.0));

        // Errors name the op.
        let e = be
            .swiglu_backward(
                View::whole(&d),
                View::whole(&g),
                View::whole(&x),
                ViewMut::whole(&mut dg),
                ViewMut::whole(&mut du),
            )
            .unwrap_err();
        assert!(e.to_string().starts_with("swiglu_backward"), "{e}");
    }
}

#[cfg(test)]
mod dtype_tests {
    use super::*;
    use crate::backend::MatmulPrecision;

    /// 16-bit buffers carry their dtype; an op given another one than it declares is an
    /// error naming the op, the argument and both dtypes, before anything runs.
    #[test]
    fn ops_refuse_a_dtype_they_do_not_take() {
        let be = CpuBackend;
        let e = be.alloc_half(4, DType::F32).unwrap_err();
        assert!(e.to_string().contains("dtype = f32"), "{e}");
        let src = vec![1.0f32, 2.0, 3.0, 4.0];
        let mut f16 = be.alloc_half(4, DType::F16).unwrap();
        let e = be
            .pack_bf16(View::whole(&src), 2, 2, ViewMut::whole(&mut f16))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "pack_bf16: `dst` holds f16, the op takes bf16"
        );
        assert!(f16.bits().iter().all(|&b| b == 0), "nothing written");
        let mut out = vec![0.0f32; 2];
        let dims = LinearDims {
            rows: 1,
            in_features: 2,
            out_features: 2,
            precision: MatmulPrecision::F32,
        };
        let e = be
            .linear_transposed_bf16(
                View::new(&src, 0, 2).unwrap(),
                View::whole(&f16),
                None,
                dims,
                ViewMut::whole(&mut out),
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                BackendError::DType {
                    op: "linear_transposed_bf16",
                    arg: "wt",
                    expected: DType::Bf16,
                    actual: DType::F16
                }
            ),
            "{e}"
        );
        // AdamW with bf16 moments refuses f16 ones
        let (mut p, g) = (vec![1.0f32; 4], vec![0.5f32; 4]);
        let mut v16 = be.alloc_half(4, DType::Bf16).unwrap();
        let update = AdamWUpdate {
            config: crate::backend::AdamWConfig::default(),
            lr: 1e-3,
            step: 1,
            grad_scale: 1.0,
        };
        let e = be
            .adamw_step_bf16(
                ViewMut::whole(&mut p),
                0,
                Stored::F32(View::whole(&g)),
                ViewMut::whole(&mut f16),
                ViewMut::whole(&mut v16),
                &update,
                None,
            )
            .unwrap_err();
        assert!(e.to_string().contains("`exp_avg` holds f16"), "{e}");
        assert_eq!(p, [1.0; 4], "nothing stepped");
        // a bf16 copy of the wrong length: an error, and nothing stepped
        let (mut m, mut v) = (vec![0.0f32; 4], vec![0.0f32; 4]);
        let mut short = be.alloc_half(3, DType::Bf16).unwrap();
        let e = be
            .adamw_step(
                ViewMut::whole(&mut p),
                Stored::F32(View::whole(&g)),
                ViewMut::whole(&mut m),
                ViewMut::whole(&mut v),
                &update,
                Some(ViewMut::whole(&mut short)),
            )
            .unwrap_err();
        assert!(e.to_string().contains("copy"), "{e}");
        assert_eq!(p, [1.0; 4], "nothing stepped");
        // a gradient held as f16 is refused by name (a stored gradient is f32 or bf16); a
        // bf16 one steps as its widened values
        let mut g16 = be.alloc_half(4, DType::F16).unwrap();
        let e = be
            .adamw_step(
                ViewMut::whole(&mut p),
                Stored::Bf16(View::whole(&g16)),
                ViewMut::whole(&mut m),
                ViewMut::whole(&mut v),
                &update,
                None,
            )
            .unwrap_err();
        assert!(e.to_string().contains("`grad` holds f16"), "{e}");
        assert_eq!(p, [1.0; 4], "nothing stepped");
        g16 = be.alloc_half(4, DType::Bf16).unwrap();
        be.round_bf16(View::whole(&g), ViewMut::whole(&mut g16))
            .unwrap();
        let mut p32 = p.clone();
        let (mut m32, mut v32) = (m.clone(), v.clone());
        be.adamw_step(
            ViewMut::whole(&mut p),
            Stored::Bf16(View::whole(&g16)),
            ViewMut::whole(&mut m),
            ViewMut::whole(&mut v),
            &update,
            None,
        )
        .unwrap();
        be.adamw_step(
            ViewMut::whole(&mut p32),
            Stored::F32(View::whole(&g)),
            ViewMut::whole(&mut m32),
            ViewMut::whole(&mut v32),
            &update,
            None,
        )
        .unwrap();
        assert_eq!((&p, &m, &v), (&p32, &m32, &v32), "0.5 is exact in bf16");
        assert_ne!(p, [1.0; 4], "stepped");
        // bf16 round trip of the right dtype: 1, 2, 3, 4 are exact in bf16
        let mut bf16 = be.alloc_half(4, DType::Bf16).unwrap();
        be.pack_bf16(View::whole(&src), 2, 2, ViewMut::whole(&mut bf16))
            .unwrap();
        assert_eq!(bf16.dtype(), DType::Bf16);
        assert!(bf16.bits().iter().all(|&b| b != 0));
    }
}

#[cfg(test)]
mod greedy_tests {
    use super::*;

    #[test]
    fn greedy_tokens_pick_the_first_maximum_and_flag_rows_without_one() {
        let inf = f32::INFINITY;
        let rows: [&[f32]; 7] = [
            &[1.0, 3.0, 3.0, 2.0],             // tie: the lower index
            &[-0.0, 0.0, -1.0, -2.0],          // −0 = +0: index 0
            &[-inf, -inf, -5.0, -inf],         // −∞ never picked
            &[-inf, -inf, -inf, -inf],         // nothing to pick
            &[0.0, f32::NAN, 1.0, 2.0],        // NaN anywhere
            &[0.0, 1.0, inf, 2.0],             // +∞ anywhere
            &[f32::MIN, f32::MIN, -inf, -inf], // the lowest finite values
        ];
        let logits: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        let (mut ids, mut host) = (vec![9u32; 7], vec![9u32; 7]);
        CpuBackend
            .greedy_tokens(View::whole(&logits), 4, &mut ids, &mut host)
            .unwrap();
        let none = u32::MAX;
        assert_eq!(host, [1, 0, 2, none, none, none, 0]);
        assert_eq!(ids, host);
        // shapes and vocab are checked
        let mut short = vec![0u32; 6];
        assert!(
            CpuBackend
                .greedy_tokens(View::whole(&logits), 4, &mut ids, &mut short)
                .is_err()
        );
        assert!(
            CpuBackend
                .greedy_tokens(View::whole(&logits), 5, &mut ids, &mut host)
                .is_err()
        );
        assert!(
            CpuBackend
                .greedy_tokens(View::whole(&logits), 0, &mut ids, &mut host)
                .is_err()
        );
    }

    #[test]
    fn pick_tokens_pack_ids_log_probs_entropies_and_a_clear_status() {
        use crate::backend::{PickBuffers, PickBuffersOf, PickRule, picked_row};
        let logits = vec![0.0f32, 2.0, 1.0, 2.5, 3.0, -1.0, 0.5, 0.0];
        let (rows, vocab, t) = (2, 4, 0.7f32);
        let keys: Vec<SampleKey> = (0..2)
            .map(|r| SampleKey {
                seed: 1,
                sequence: r,
                step: 4,
            })
            .collect();
        let sampler = Sampler::with_temperature(t);
        for rule in [
            PickRule::Greedy,
            PickRule::Sample {
                sampler: &sampler,
                keys: &keys,
            },
        ] {
            let mut bufs = PickBuffers::new(&CpuBackend, rows).unwrap();
            let mut host = vec![7u32; PickBuffersOf::<CpuBackend>::host_len(rows)];
            let l = View::whole(&logits);
            CpuBackend
                .pick_tokens(l, vocab, rule, t, &mut bufs, &mut host)
                .unwrap();
            let mut ids = vec![0u32; rows];
            match rule {
                PickRule::Greedy => CpuBackend.greedy_tokens(l, vocab, &mut vec![0; 2], &mut ids),
                PickRule::Sample { sampler, keys } => {
                    let mut dev = vec![0; 2];
                    CpuBackend.sample_tokens(l, vocab, sampler, keys, &mut dev, &mut ids)
                }
            }
            .unwrap();
            let (mut lp, mut ent) = (vec![0f32; rows], vec![0f32; rows]);
            kernels::log_prob_entropy(&logits, vocab, t, &ids, &mut lp, &mut ent).unwrap();
            assert_eq!(bufs.targets, ids, "{rule:?}: the ids stay on the device");
            for r in 0..rows {
                assert_eq!(
                    picked_row(&host, rows, r),
                    (ids[r], lp[r], ent[r]),
                    "{rule:?} row {r}"
                );
            }
            assert_eq!(host[3 * rows], 0, "status word");
            let mut short = vec![0u32; 3 * rows];
            assert!(
                CpuBackend
                    .pick_tokens(l, vocab, rule, t, &mut bufs, &mut short)
                    .is_err()
            );
        }
    }

    #[test]
    fn sample_tokens_run_the_race_sampler_and_check_their_arguments() {
        let logits = vec![0.0f32, 2.0, 1.0, 2.0, f32::NAN, 0.0, 0.0, 0.0];
        let (mut ids, mut host) = (vec![9u32; 2], vec![9u32; 2]);
        let keys: Vec<SampleKey> = (0..2)
            .map(|r| SampleKey {
                seed: 3,
                sequence: r,
                step: 0,
            })
            .collect();
        let plain = Sampler::with_temperature(1.0);
        CpuBackend
            .sample_tokens(View::whole(&logits), 4, &plain, &keys, &mut ids, &mut host)
            .unwrap();
        let want = ares_cpu::sampler::sample_row(&logits[..4], &plain, keys[0]).unwrap();
        assert_eq!(host, [want, u32::MAX]);
        assert_eq!(ids, host);
        // top_k 1 keeps only id 1 whatever the draw
        let top1 = Sampler { top_k: 1, ..plain };
        let first_row = logits[..4].to_vec();
        for step in 0..20 {
            let key = SampleKey { step, ..keys[0] };
            let mut one = [0u32];
            CpuBackend
                .sample_tokens(
                    View::whole(&first_row),
                    4,
                    &top1,
                    &[key],
                    &mut vec![0],
                    &mut one,
                )
                .unwrap();
            assert_eq!(one[0], 1);
        }
        let call = |s: Sampler, keys: &[SampleKey]| {
            CpuBackend.sample_tokens(
                View::whole(&logits),
                4,
                &s,
                keys,
                &mut vec![0; 2],
                &mut [0; 2],
            )
        };
        assert!(call(plain, &keys).is_ok());
        for (bad, what) in [
            (call(Sampler::with_temperature(0.0), &keys), "temperature"),
            (
                call(Sampler::with_temperature(f32::NAN), &keys),
                "temperature",
            ),
            (
                call(
                    Sampler {
                        top_p: 0.0,
                        ..plain
                    },
                    &keys,
                ),
                "top_p",
            ),
            (
                call(
                    Sampler {
                        min_p: 2.0,
                        ..plain
                    },
                    &keys,
                ),
                "min_p",
            ),
            (call(plain, &keys[..1]), "keys"),
        ] {
            let message = bad.unwrap_err().to_string();
            assert!(message.contains(what), "{what}: {message}");
        }
    }
}
