//! Page-locked host buffers for the small transfers of every decode step (sampling keys,
//! block tables, lengths, positions, the pick's words).
//!
//! A copy from pageable memory makes the host wait while the driver stages it; one from
//! page-locked memory is queued like a kernel, and only page-locked memory can take part in
//! a captured graph. So [`Staging`] keeps one page-locked buffer per element type and
//! length (a decode step's transfers repeat their lengths step after step: after warm-up
//! nothing is allocated), and a transfer goes through it: the host copies into the buffer
//! and queues the device copy. Before a buffer is written again the host waits for the event
//! recorded after its last copy, so a queued copy never reads bytes of the next one.
//!
//! Transfers above [`Staging::MAX_BYTES`] (weights, whole batches) stay pageable: they are
//! rare, and pinning them would hold host memory the operating system cannot page.

use crate::error::{DriverContext, Result};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Arc;

/// One staged buffer and the event after its last queued copy.
struct Pinned<T> {
    host: PinnedHostSlice<T>,
    copied: Option<CudaEvent>,
}

/// The page-locked buffers of one device (see the module docs).
#[derive(Default)]
pub(crate) struct Staging {
    buffers: HashMap<(TypeId, usize), Box<dyn Any + Send>>,
    /// The status word's own buffer ([`Staging::download_checked`]), apart from the
    /// others so a one-word download cannot share it.
    status: Option<PinnedHostSlice<u32>>,
}

impl Staging {
    /// The largest transfer staged (bytes); larger ones go from pageable memory.
    pub(crate) const MAX_BYTES: usize = 1 << 20;

    /// At most this many buffers are kept (a run whose transfer lengths never repeat drops
    /// them all and starts again, so pinned memory stays below `MAX_BUFFERS · MAX_BYTES`).
    const MAX_BUFFERS: usize = 64;

    /// Whether a transfer of `len` elements of `T` on `stream` is staged: not while the
    /// stream is being captured, where a copy from page-locked memory would be recorded
    /// (and replayed from a buffer the next transfer rewrites) — a pageable copy fails the
    /// capture instead, as [`crate::model_ops::ModelOps::begin_capture`] promises.
    pub(crate) fn stages<T>(stream: &CudaStream, len: usize) -> bool {
        let capturing = !matches!(
            stream.capture_status(),
            Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        );
        len > 0 && len.saturating_mul(std::mem::size_of::<T>()) <= Self::MAX_BYTES && !capturing
    }

    /// The buffer of `len` elements of `T`, allocated on first use, after its last copy
    /// finished.
    fn buffer<T: DeviceRepr + ValidAsZeroBits + Copy + 'static>(
        &mut self,
        ctx: &Arc<CudaContext>,
        len: usize,
    ) -> Result<&mut Pinned<T>> {
        let key = (TypeId::of::<T>(), len);
        if !self.buffers.contains_key(&key) {
            if self.buffers.len() >= Self::MAX_BUFFERS {
                self.buffers.clear();
            }
            // flags 0: cached page-locked memory (write-combined memory, cudarc's default,
            // is slow for the host to read, and the pick's words are read back)
            // SAFETY: the contents are written (upload) or overwritten by a copy (download)
            // before they are read.
            let host = unsafe { ctx.alloc_pinned_with_flags::<T>(len, 0) }
                .during(format!("allocating {len} page-locked elements"))?;
            let pinned: Box<dyn Any + Send> = Box::new(Pinned { host, copied: None });
            self.buffers.insert(key, pinned);
        }
        let pinned = self
            .buffers
            .get_mut(&key)
            .and_then(|b| b.downcast_mut::<Pinned<T>>())
            .expect("the buffer was inserted above under its own type");
        if let Some(event) = pinned.copied.take() {
            event
                .synchronize()
                .during("waiting for a staged copy to finish")?;
        }
        Ok(pinned)
    }

    /// Queues the copy of `src` into `dst` on `stream` through page-locked memory: `src`
    /// may be reused as soon as this returns, and the host does not wait for the copy.
    pub(crate) fn upload<T: DeviceRepr + ValidAsZeroBits + Copy + 'static>(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &[T],
        dst: &mut cudarc::driver::CudaViewMut<'_, T>,
    ) -> Result<()> {
        let pinned = self.buffer::<T>(stream.context(), src.len())?;
        pinned
            .host
            .as_mut_slice()
            .during("writing page-locked memory")?
            .copy_from_slice(src);
        stream
            .memcpy_htod(&pinned.host, dst)
            .during("upload (page-locked)")?;
        pinned.copied = Some(
            stream
                .record_event(None)
                .during("recording a staged copy")?,
        );
        Ok(())
    }

    /// Copies `src` to `dst` on `stream` (through page-locked memory when
    /// [`Staging::stages`] says so, else straight into `dst`) and the status word `status`
    /// with it, in **one** wait: the word is copied first, after every op queued before,
    /// so it holds what they reported. Returns the word (not cleared).
    pub(crate) fn download_checked<T: DeviceRepr + ValidAsZeroBits + Copy + 'static>(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &cudarc::driver::CudaView<'_, T>,
        dst: &mut [T],
        status: &cudarc::driver::CudaView<'_, u32>,
    ) -> Result<u32> {
        if self.status.is_none() {
            // SAFETY: overwritten by the copy below before it is read.
            let word = unsafe { stream.context().alloc_pinned_with_flags::<u32>(1, 0) }
                .during("allocating the page-locked status word")?;
            self.status = Some(word);
        }
        let word = self
            .status
            .as_mut()
            .expect("the status word was allocated above");
        stream
            .memcpy_dtoh(status, word)
            .during("reading the status word")?;
        if Self::stages::<T>(stream, dst.len()) {
            // waits (and so for the word's copy, queued before)
            self.download(stream, src, dst)?;
        } else {
            stream.memcpy_dtoh(src, dst).during("download (pageable)")?;
            stream.synchronize().during("waiting for a download")?;
        }
        let word = self
            .status
            .as_ref()
            .expect("the status word was allocated above");
        Ok(word.as_slice().during("reading page-locked memory")?[0])
    }

    /// Copies `src` to `dst` on `stream` through page-locked memory, waiting for it (and so
    /// for every op queued before it).
    pub(crate) fn download<T: DeviceRepr + ValidAsZeroBits + Copy + 'static>(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &cudarc::driver::CudaView<'_, T>,
        dst: &mut [T],
    ) -> Result<()> {
        let pinned = self.buffer::<T>(stream.context(), dst.len())?;
        stream
            .memcpy_dtoh(src, &mut pinned.host)
            .during("download (page-locked)")?;
        stream.synchronize().during("waiting for a download")?;
        dst.copy_from_slice(
            pinned
                .host
                .as_slice()
                .during("reading page-locked memory")?,
        );
        Ok(())
    }
}
