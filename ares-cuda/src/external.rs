//! The token kernels on memory and streams another library owns (PyTorch, CuPy): the
//! caller's device pointers lent as slices that are never freed here, and the caller's
//! stream for the launches, so each kernel is ordered with the caller's own work and no
//! tensor is copied. What the Python wheel runs on `__cuda_array_interface__` tensors.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, sys};

use crate::device::Cuda;
use crate::error::{DriverContext, Result};

/// A device buffer the caller owns, lent to the kernels as a [`CudaSlice`]; dropping it
/// hands the memory back untouched (it is never freed here).
pub struct Borrowed<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
}

impl<T> Deref for Borrowed<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for Borrowed<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> Drop for Borrowed<T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken once, here, and not used after.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        // `leak` gives up the pointer without freeing it: the caller's allocator owns it
        let _ = slice.leak();
    }
}

impl Cuda {
    /// Device `ordinal` for kernels on another library's memory and streams: as
    /// [`Cuda::new`] (the primary context, which PyTorch uses too), with cudarc's
    /// cross-stream events off — every launch goes on the one stream the caller names
    /// ([`Cuda::use_stream`]), whose owner orders its own work around it.
    ///
    /// # Errors
    /// As [`Cuda::new`].
    pub fn for_external(ordinal: usize) -> Result<Self> {
        let cuda = Cuda::new(ordinal)?;
        // SAFETY: buffers lent by the caller are used on the caller's stream alone, and the
        // status word and block counter on whichever stream is current, one call at a time.
        unsafe { cuda.stream.context().disable_event_tracking() };
        Ok(cuda)
    }

    /// Queues this device's next operations on the caller's `stream` (a `CUstream` handle
    /// as an integer: `torch.cuda.current_stream().cuda_stream`; 0 is the legacy default
    /// stream). The status word each checked kernel reports into is cleared and read on it
    /// too, so a call that reads it waits for that stream (and only it). When the stream
    /// changes, the new one first waits for what was queued on the previous one: the status
    /// word and the block counter of the last-block reductions are shared by every call.
    ///
    /// # Safety
    /// `stream` is 0 or a live stream of this device's primary context, and stays alive while
    /// operations are queued on it; the previous stream is still alive.
    ///
    /// # Errors
    /// The driver's, recording or waiting for the previous stream's work.
    pub unsafe fn use_stream(&mut self, stream: u64) -> Result<()> {
        let handle = stream as usize as sys::CUstream;
        if self.stream.cu_stream() == handle {
            return Ok(());
        }
        let ctx = self.stream.context().clone();
        // SAFETY: forwarded from the caller's contract; a borrowed stream is never destroyed.
        let next = unsafe { ctx.wrap_borrowed_stream(handle) };
        next.join(&self.stream)
            .during("ordering a new stream after the previous one")?;
        self.stream = next;
        Ok(())
    }

    /// `len` elements of `T` at the caller's device address `ptr`, lent to the kernels.
    ///
    /// # Safety
    /// `ptr` is a live allocation of at least `len · size_of::<T>()` bytes on this device,
    /// aligned for `T`, holding valid `T`s where the kernels read; it is not freed, and no
    /// other borrow of it is written, while the returned value lives.
    pub unsafe fn borrow<T>(&self, ptr: u64, len: usize) -> Borrowed<T> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { borrow_on(&self.stream, ptr, len) }
    }
}

/// [`Cuda::borrow`] for kernels queued on `stream` (a [`crate::ModelOps`]' stream).
///
/// # Safety
/// As [`Cuda::borrow`], on `stream`'s device.
pub unsafe fn borrow_on<T>(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> Borrowed<T> {
    // SAFETY: forwarded from the caller's contract.
    let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr as sys::CUdeviceptr, len) };
    Borrowed {
        slice: ManuallyDrop::new(slice),
    }
}

/// The caller's stream `stream` (as in [`Cuda::use_stream`]) of `ops`' device, with `ops`'
/// stream made to wait for what is queued on it: [`crate::ModelOps`] kernels then read what
/// the caller's work wrote. Call [`after_ops`] once they are queued.
///
/// # Safety
/// `stream` is 0 or a live stream of that device's primary context, alive for the call.
///
/// # Errors
/// The driver's.
pub unsafe fn before_ops(ops: &crate::ModelOps, stream: u64) -> Result<Arc<CudaStream>> {
    let ctx = ops.stream().context().clone();
    // SAFETY: forwarded from the caller's contract.
    let caller = unsafe { ctx.wrap_borrowed_stream(stream as usize as sys::CUstream) };
    ops.stream()
        .join(&caller)
        .during("ordering the device's stream after the caller's")?;
    Ok(caller)
}

/// The caller's stream (from [`before_ops`]) made to wait for what `ops` queued since.
///
/// # Errors
/// The driver's.
pub fn after_ops(ops: &crate::ModelOps, caller: &Arc<CudaStream>) -> Result<()> {
    caller
        .join(ops.stream())
        .during("ordering the caller's stream after the device's")
}
