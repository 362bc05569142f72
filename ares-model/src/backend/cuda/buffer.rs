//! Device buffers of the CUDA backend and the conversion of backend views into cudarc
//! views (the form `ares-cuda`'s ops take).

use crate::backend::{BackendError, DType, DeviceBuffer, Result, View, ViewMut};
use ares_cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use ares_cuda::model_ops::StoredView;

/// An f32 allocation on the GPU (the CUDA backend's [`Backend::Buffer`]). Freed,
/// stream-ordered, on drop.
///
/// [`Backend::Buffer`]: crate::backend::Backend::Buffer
pub struct CudaBuffer {
    /// At least one element: CUDA refuses empty allocations.
    pub(super) slice: CudaSlice<f32>,
    /// Elements of the buffer (`<= slice.len()`).
    pub(super) len: usize,
}

/// A u32 allocation on the GPU (token ids, positions; the CUDA backend's
/// [`Backend::Ids`]).
///
/// [`Backend::Ids`]: crate::backend::Backend::Ids
pub struct CudaIds {
    /// At least one element (see [`CudaBuffer`]).
    pub(super) slice: CudaSlice<u32>,
    /// Elements of the buffer (`<= slice.len()`).
    pub(super) len: usize,
}

/// A 16-bit float allocation on the GPU, bf16 or f16 (the CUDA backend's
/// [`Backend::Half`]).
///
/// [`Backend::Half`]: crate::backend::Backend::Half
pub struct CudaHalf {
    /// At least one element (see [`CudaBuffer`]).
    pub(super) slice: CudaSlice<u16>,
    /// Elements of the buffer (`<= slice.len()`).
    pub(super) len: usize,
    pub(super) dtype: DType,
}

/// A byte allocation on the GPU (8-bit codes; the CUDA backend's [`Backend::Bytes`]).
///
/// [`Backend::Bytes`]: crate::backend::Backend::Bytes
pub struct CudaBytes {
    /// At least one element (see [`CudaBuffer`]).
    pub(super) slice: CudaSlice<u8>,
    /// Elements of the buffer (`<= slice.len()`).
    pub(super) len: usize,
}

impl std::fmt::Debug for CudaBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBytes(u8 × {})", self.len)
    }
}

impl DeviceBuffer for CudaBytes {
    fn len(&self) -> usize {
        self.len
    }

    fn dtype(&self) -> DType {
        DType::U8
    }
}

/// The device bytes a view names.
pub(super) fn bytes_view<'a>(v: View<'a, CudaBytes>) -> Result<CudaView<'a, u8>> {
    let buffer = v.buffer();
    window(v.offset(), v.len(), buffer.len, |r| {
        buffer.slice.try_slice(r)
    })
}

/// [`bytes_view`], writable.
pub(super) fn bytes_view_mut<'a>(v: ViewMut<'a, CudaBytes>) -> Result<CudaViewMut<'a, u8>> {
    let (offset, len) = (v.offset(), v.len());
    let buffer = v.into_buffer();
    window(offset, len, buffer.len, |r| buffer.slice.try_slice_mut(r))
}

impl std::fmt::Debug for CudaHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaHalf({} × {})", self.dtype, self.len)
    }
}

impl DeviceBuffer for CudaHalf {
    fn len(&self) -> usize {
        self.len
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

impl CudaHalf {
    /// Broadcasts each of `items` — `(buffer, root)`: its 16-bit values as they are (bf16
    /// weights) — from its root to every rank of `comm`, in one NCCL group
    /// ([`NcclComm::broadcast_u16`]).
    ///
    /// [`NcclComm::broadcast_u16`]: ares_cuda::nccl::NcclComm::broadcast_u16
    ///
    /// # Errors
    /// A root past the world; NCCL's or CUDA's failure.
    pub fn nccl_broadcast(
        comm: &ares_cuda::nccl::NcclComm,
        items: &mut [(&mut CudaHalf, usize)],
    ) -> Result<()> {
        let mut slices: Vec<_> = items
            .iter_mut()
            .map(|(b, root)| {
                let len = b.len;
                (&mut b.slice, len, *root)
            })
            .collect();
        comm.broadcast_u16(&mut slices)
            .map_err(|e| BackendError::Op {
                op: "nccl",
                source: Box::new(e),
            })
    }
}

impl CudaHalf {
    /// Sums each of `items` — `(buffer, root)`: bf16 values (gradients stored in bf16) —
    /// over the ranks of `comm` in place, to every rank or to the root alone, in one NCCL
    /// group ([`NcclComm::grouped_bf16`]: NCCL's order, its partial sums in bf16).
    ///
    /// [`NcclComm::grouped_bf16`]: ares_cuda::nccl::NcclComm::grouped_bf16
    ///
    /// # Errors
    /// A buffer not bf16, a root past the world; NCCL's or CUDA's failure.
    pub fn nccl_sums(
        comm: &ares_cuda::nccl::NcclComm,
        items: &mut [(&mut CudaHalf, Option<usize>)],
    ) -> Result<()> {
        for (b, _) in items.iter() {
            BackendError::check_dtype("nccl", "summed 16-bit values", DType::Bf16, b.dtype)?;
        }
        let mut slices: Vec<_> = items
            .iter_mut()
            .map(|(b, root)| {
                let len = b.len;
                (&mut b.slice, len, *root)
            })
            .collect();
        comm.grouped_bf16(ares_cuda::nccl::GroupOp::Sum, &mut slices)
            .map_err(|e| BackendError::Op {
                op: "nccl",
                source: Box::new(e),
            })
    }

    /// [`CudaBuffer::nccl_queue_sums`] of bf16 values (gradients stored in bf16), summed as
    /// [`CudaHalf::nccl_sums`] sums them.
    ///
    /// # Safety
    /// As [`CudaBuffer::nccl_queue_sums`].
    ///
    /// # Errors
    /// A view out of its buffer or not bf16, a root past the world; NCCL's or CUDA's
    /// failure.
    pub unsafe fn nccl_queue_sums(
        comm: &ares_cuda::nccl::NcclComm,
        items: &[(View<'_, CudaHalf>, Option<usize>)],
    ) -> Result<()> {
        let mut queued = Vec::with_capacity(items.len());
        for (v, root) in items {
            use ares_cuda::cudarc::driver::{DevicePtr, DeviceSlice};
            let bits = half_view("nccl", "summed 16-bit values", *v, DType::Bf16)?;
            let stream = bits.stream().clone();
            let (ptr, _) = bits.device_ptr(&stream);
            queued.push((ptr, v.len(), *root));
        }
        // SAFETY: each pointer names its view's bf16 values, which the caller leaves alone
        // until the wait
        unsafe { comm.queue_bf16(ares_cuda::nccl::GroupOp::Sum, &queued) }.map_err(|e| {
            BackendError::Op {
                op: "nccl",
                source: Box::new(e),
            }
        })
    }
}

/// A [`Stored`](crate::backend::Stored) view on the device: f32 values or bf16 bits.
pub(super) enum CudaStored<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, u16>),
}

impl<'a> CudaStored<'a> {
    /// The form `ares-cuda`'s ops take.
    pub(super) fn as_view(&self) -> StoredView<'_, 'a> {
        match self {
            Self::F32(v) => StoredView::F32(v),
            Self::Bf16(v) => StoredView::Bf16(v),
        }
    }
}

/// The device elements of argument `arg` of `op`, as stored (a bf16 view's dtype checked).
pub(super) fn stored_view<'a>(
    op: &'static str,
    arg: &'static str,
    x: crate::backend::Stored<'a, super::CudaBackend>,
) -> Result<CudaStored<'a>> {
    use crate::backend::Stored;
    Ok(match x {
        Stored::F32(v) => CudaStored::F32(view(v)?),
        Stored::Bf16(v) => CudaStored::Bf16(half_view(op, arg, v, DType::Bf16)?),
    })
}

/// The device bits a 16-bit view names, after checking it holds `want` (argument `arg` of
/// `op`).
pub(super) fn half_view<'a>(
    op: &'static str,
    arg: &'static str,
    v: View<'a, CudaHalf>,
    want: DType,
) -> Result<CudaView<'a, u16>> {
    let buffer = v.buffer();
    BackendError::check_dtype(op, arg, want, buffer.dtype)?;
    window(v.offset(), v.len(), buffer.len, |r| {
        buffer.slice.try_slice(r)
    })
}

/// [`half_view`], writable.
pub(super) fn half_view_mut<'a>(
    op: &'static str,
    arg: &'static str,
    v: ViewMut<'a, CudaHalf>,
    want: DType,
) -> Result<CudaViewMut<'a, u16>> {
    BackendError::check_dtype(op, arg, want, v.as_view().buffer().dtype)?;
    let (offset, len) = (v.offset(), v.len());
    let buffer = v.into_buffer();
    window(offset, len, buffer.len, |r| buffer.slice.try_slice_mut(r))
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBuffer(f32 × {})", self.len)
    }
}

impl std::fmt::Debug for CudaIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaIds(u32 × {})", self.len)
    }
}

impl DeviceBuffer for CudaBuffer {
    fn len(&self) -> usize {
        self.len
    }

    fn dtype(&self) -> DType {
        DType::F32
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

impl CudaBuffer {
    /// Queues sums over the ranks of `comm` of each of `items` — `(values, root)`: to every
    /// rank, or to the root alone — in place, in one NCCL group on NCCL's stream, and
    /// returns without waiting ([`NcclComm::queue_f32`]; [`NcclComm::wait_queued`] waits).
    /// The work queued on this backend's stream is not waited for: synchronize it first.
    ///
    /// [`NcclComm::queue_f32`]: ares_cuda::nccl::NcclComm::queue_f32
    /// [`NcclComm::wait_queued`]: ares_cuda::nccl::NcclComm::wait_queued
    ///
    /// # Safety
    /// Nothing may read, write or free the viewed values until `wait_queued` returns (a
    /// backward pass past the layer they belong to does not).
    ///
    /// # Errors
    /// A view out of its buffer, a root past the world; NCCL's or CUDA's failure.
    pub unsafe fn nccl_queue_sums(
        comm: &ares_cuda::nccl::NcclComm,
        items: &[(View<'_, CudaBuffer>, Option<usize>)],
    ) -> Result<()> {
        let mut queued = Vec::with_capacity(items.len());
        for (v, root) in items {
            use ares_cuda::cudarc::driver::{DevicePtr, DeviceSlice};
            let values = view(*v)?;
            let stream = values.stream().clone();
            let (ptr, _) = values.device_ptr(&stream);
            queued.push((ptr, v.len(), *root));
        }
        // SAFETY: each pointer names its view's values, which the caller leaves alone until
        // the wait
        unsafe { comm.queue_f32(ares_cuda::nccl::GroupOp::Sum, &queued) }.map_err(|e| {
            BackendError::Op {
                op: "nccl",
                source: Box::new(e),
            }
        })
    }

    /// Runs `op` over the ranks of `comm` on each of `items` — `(buffer, root)` — in place,
    /// on the device, in one NCCL group ([`NcclComm::grouped_f32`]: sums to every rank or to
    /// the root, ZeRO-1's reduce-scatter; broadcasts from the root). NCCL's order, not rank
    /// order.
    ///
    /// [`NcclComm::grouped_f32`]: ares_cuda::nccl::NcclComm::grouped_f32
    ///
    /// # Errors
    /// A root past the world or missing for a broadcast; NCCL's or CUDA's failure.
    pub fn nccl_grouped(
        comm: &ares_cuda::nccl::NcclComm,
        op: ares_cuda::nccl::GroupOp,
        items: &mut [(&mut CudaBuffer, Option<usize>)],
    ) -> Result<()> {
        let mut slices: Vec<_> = items
            .iter_mut()
            .map(|(b, root)| {
                let len = b.len;
                (&mut b.slice, len, *root)
            })
            .collect();
        comm.grouped_f32(op, &mut slices)
            .map_err(|e| BackendError::Op {
                op: "nccl",
                source: Box::new(e),
            })
    }
}

impl DeviceBuffer for CudaIds {
    fn len(&self) -> usize {
        self.len
    }

    fn dtype(&self) -> DType {
        DType::U32
    }
}

/// `sub(offset..offset + len)` of a buffer of `buffer_len` elements, or
/// [`BackendError::ViewOutOfBounds`] when the window does not fit (a cudarc slice out of
/// range would panic; `sub` is its `try_slice`).
fn window<V>(
    offset: usize,
    len: usize,
    buffer_len: usize,
    sub: impl FnOnce(std::ops::Range<usize>) -> Option<V>,
) -> Result<V> {
    offset
        .checked_add(len)
        .filter(|&end| end <= buffer_len)
        .and_then(|end| sub(offset..end))
        .ok_or(BackendError::ViewOutOfBounds {
            offset,
            len,
            buffer_len,
        })
}

/// The device elements a view names. Views are bounds-checked when made; this re-checks
/// and reports instead of panicking.
pub(super) fn view<'a>(v: View<'a, CudaBuffer>) -> Result<CudaView<'a, f32>> {
    let buffer = v.buffer();
    window(v.offset(), v.len(), buffer.len, |r| {
        buffer.slice.try_slice(r)
    })
}

/// The device elements a writable view names (see [`view`]).
pub(super) fn view_mut<'a>(v: ViewMut<'a, CudaBuffer>) -> Result<CudaViewMut<'a, f32>> {
    let (offset, len) = (v.offset(), v.len());
    let buffer = v.into_buffer();
    window(offset, len, buffer.len, |r| buffer.slice.try_slice_mut(r))
}

/// [`view`] of an optional view.
pub(super) fn view_opt<'a>(v: Option<View<'a, CudaBuffer>>) -> Result<Option<CudaView<'a, f32>>> {
    v.map(view).transpose()
}

/// [`view_mut`] of an optional view.
pub(super) fn view_mut_opt<'a>(
    v: Option<ViewMut<'a, CudaBuffer>>,
) -> Result<Option<CudaViewMut<'a, f32>>> {
    v.map(view_mut).transpose()
}

/// The whole of an ids buffer.
pub(super) fn ids(ids: &CudaIds) -> Result<CudaView<'_, u32>> {
    window(0, ids.len, ids.slice.len(), |r| ids.slice.try_slice(r))
}

/// The whole of an ids buffer, for writing.
pub(super) fn ids_mut(ids: &mut CudaIds) -> Result<CudaViewMut<'_, u32>> {
    let buffer_len = ids.slice.len();
    window(0, ids.len, buffer_len, |r| ids.slice.try_slice_mut(r))
}
