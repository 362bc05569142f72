//! The step's tensors on the backend's device: allocation, upload, and the downloads that
//! bring results back, counted so that a step reports how many bytes crossed device → host
//! (`perf/d2h_bytes`).

use crate::backend::{Backend, View, ViewMut};
use crate::trainer::TrainError;

/// Bytes downloaded from the device so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Downloads {
    /// Bytes, from the buffers' sizes.
    pub bytes: usize,
}

/// A zeroed device buffer of `len` f32.
///
/// # Errors
/// The backend's (out of memory).
pub fn alloc<B: Backend>(be: &B, len: usize) -> Result<B::Buffer, TrainError> {
    Ok(be.alloc(len)?)
}

/// A device copy of `host`.
///
/// # Errors
/// The backend's.
pub fn upload<B: Backend>(be: &B, host: &[f32]) -> Result<B::Buffer, TrainError> {
    let mut buf = alloc(be, host.len())?;
    be.upload(host, ViewMut::whole(&mut buf))?;
    Ok(buf)
}

/// The contents of `buf` on the host (waits for the queued ops), counted in `downloads`.
///
/// # Errors
/// The backend's, including a bad value a queued kernel found.
pub fn download<B: Backend>(
    be: &B,
    buf: &B::Buffer,
    downloads: &mut Downloads,
) -> Result<Vec<f32>, TrainError> {
    let view = View::whole(buf);
    let mut host = vec![0.0f32; view.len()];
    be.download(view, &mut host)?;
    downloads.bytes += 4 * host.len();
    Ok(host)
}
