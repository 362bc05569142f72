//! NCCL between processes, one GPU each (loaded at run time, as the other CUDA libraries):
//! the transport of a data-parallel run launched on GPUs. Rank 0 makes the unique id
//! ([`unique_id`]) and hands it to the other ranks itself (the runner sends it over its
//! TCP rendezvous); every rank then opens its communicator on its own device
//! ([`NcclComm::new`]).
//!
//! [`NcclComm::all_gather_bytes`] carries the runner's collective operations: each rank's
//! bytes (of any length, padded to the longest on the device) gathered in rank order.
//!
//! Faults: every wait polls the stream and NCCL's asynchronous error of the communicator. An
//! error a peer's failure raises here (a closed connection, a remote error) or a wait past
//! `ARES_COLLECTIVE_TIMEOUT` aborts the communicator (`ncclCommAbort`, which also stops its
//! kernels still spinning on the stream) and is an error naming the collective; the
//! communicator refuses every later call. The handle is NCCL's own (cudarc's `Comm` keeps
//! its handle private, and both the error query and the abort need it).

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{Id, result, sys};

use crate::error::{DriverContext, Error, Result};

/// True when the NCCL library (`libnccl.so`) can be loaded.
pub fn nccl_available() -> bool {
    // SAFETY: only tries to dlopen the library; no NCCL function is called.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn missing() -> Error {
    Error::LibraryMissing {
        library: "libnccl.so.2 (NCCL; pip's nvidia-nccl-cu13 ships it)",
    }
}

fn nccl(step: &str, e: &cudarc::nccl::result::NcclError) -> Error {
    Error::BadArgument {
        kernel: "nccl",
        message: format!("{step}: {:?}", e.0),
    }
}

/// A new NCCL unique id (rank 0 makes it; every rank needs the same).
///
/// # Errors
/// NCCL cannot be loaded, or `ncclGetUniqueId` fails (no usable network interface).
pub fn unique_id() -> Result<[u8; 128]> {
    if !nccl_available() {
        return Err(missing());
    }
    let id = Id::new().map_err(|e| nccl("ncclGetUniqueId", &e))?;
    Ok(id.internal().map(|c| c as u8))
}

/// An element type NCCL moves.
trait Wire {
    const TYPE: sys::ncclDataType_t;
}
impl Wire for f32 {
    const TYPE: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
}
impl Wire for u64 {
    const TYPE: sys::ncclDataType_t = sys::ncclDataType_t::ncclUint64;
}
impl Wire for u8 {
    const TYPE: sys::ncclDataType_t = sys::ncclDataType_t::ncclUint8;
}

/// NCCL's communicator handle, and why it was aborted (it then runs nothing more).
struct RawComm {
    comm: sys::ncclComm_t,
    aborted: Option<String>,
}

// SAFETY: NCCL lets any host thread call a communicator so long as no two calls on it
// overlap; `NcclComm` only reaches it through its mutex.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        if self.aborted.is_none() {
            // SAFETY: the handle came from ncclCommInitRank and is released once; every
            // collective queued on it was waited for. Abort (as cudarc's `Comm` does) returns
            // at once even if a peer is gone.
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }
}

impl RawComm {
    /// An error if the communicator was aborted.
    fn usable(&self, what: &str) -> Result<()> {
        match &self.aborted {
            None => Ok(()),
            Some(why) => Err(Error::BadArgument {
                kernel: "nccl",
                message: format!("{what}: the communicator was aborted earlier ({why})"),
            }),
        }
    }

    /// NCCL's asynchronous error of the communicator, if it has one.
    fn async_error(&self) -> Option<result::NcclError> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: the handle is alive (not aborted: callers check); NCCL writes one value.
        let queried = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        queried.result().err().or_else(|| state.result().err())
    }

    /// Aborts the communicator (its kernels stop, its resources are freed) for `why`.
    fn abort(&mut self, why: String) {
        if self.aborted.is_none() {
            // SAFETY: the handle is alive and released here once (Drop skips it after).
            let _ = unsafe { result::comm_abort(self.comm) };
            self.aborted = Some(why);
        }
    }
}

/// A collective of [`NcclComm::grouped_f32`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupOp {
    /// Sum over the ranks: to every rank, or to a root.
    Sum,
    /// Copy a root's values to every rank.
    Broadcast,
}

impl GroupOp {
    /// The word errors use.
    fn name(self) -> &'static str {
        match self {
            GroupOp::Sum => "sum",
            GroupOp::Broadcast => "broadcast",
        }
    }
}

/// This process's rank in an NCCL communicator, on one device.
pub struct NcclComm {
    comm: Mutex<RawComm>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

/// `n` as NCCL's `int`.
fn c_int(what: &str, n: usize) -> Result<core::ffi::c_int> {
    core::ffi::c_int::try_from(n).map_err(|_| Error::BadArgument {
        kernel: "nccl",
        message: format!("{what} = {n} exceeds 2^31 - 1"),
    })
}

impl NcclComm {
    /// Joins the communicator of `id` as rank `rank` of `world` on device `ordinal` (every
    /// rank calls it; it returns when all have).
    ///
    /// # Errors
    /// CUDA or NCCL cannot be loaded; the device cannot be opened; `ncclCommInitRank` fails.
    pub fn new(ordinal: usize, rank: usize, world: usize, id: [u8; 128]) -> Result<Self> {
        if !crate::cuda_available() {
            return Err(Error::LibraryMissing {
                library: "libcuda.so (the CUDA driver)",
            });
        }
        if !nccl_available() {
            return Err(missing());
        }
        let (rank_c, world_c) = (c_int("rank", rank)?, c_int("world", world)?);
        let ctx = CudaContext::new(ordinal).during(format!("opening CUDA device {ordinal}"))?;
        // NCCL's calls act on the current context: this device's
        ctx.bind_to_thread()
            .during(format!("binding CUDA device {ordinal}"))?;
        let stream = ctx.new_stream().during("creating NCCL's stream")?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as core::ffi::c_char),
        };
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: NCCL writes the handle on success; the id is the one rank 0 made.
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), world_c, id, rank_c)
                .map_err(|e| nccl("ncclCommInitRank", &e))?;
            comm.assume_init()
        };
        Ok(Self {
            comm: Mutex::new(RawComm {
                comm,
                aborted: None,
            }),
            stream,
            rank,
            world,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Runs `op` on each of `items` — `(buffer, len, root)`: the first `len` values — in one
    /// NCCL group, and waits for it (polling, at most `ARES_COLLECTIVE_TIMEOUT` seconds).
    /// [`GroupOp::Sum`]: an
    /// all-reduce where `root` is `None`, a reduce to rank `root` otherwise (only the root's
    /// buffer holds the sum; ZeRO-1's reduce-scatter of buffers of any size);
    /// [`GroupOp::Broadcast`]: from rank `root` to every rank (ZeRO-1's updated parameters).
    ///
    /// # Errors
    /// A `len` past its buffer, a root past the world or missing for a broadcast; a CUDA or
    /// NCCL failure; an asynchronous NCCL error or the timeout (the communicator is then
    /// aborted).
    pub fn grouped_f32(
        &self,
        op: GroupOp,
        items: &mut [(&mut CudaSlice<f32>, usize, Option<usize>)],
    ) -> Result<()> {
        self.grouped(op, items, f32::TYPE)
    }

    /// [`NcclComm::grouped_f32`] on bf16 values (the bits of gradients stored in bf16):
    /// NCCL adds them in its own order, each partial sum rounded to bf16 as it travels (a
    /// world of one leaves them as they are).
    ///
    /// # Errors
    /// As [`NcclComm::grouped_f32`].
    pub fn grouped_bf16(
        &self,
        op: GroupOp,
        items: &mut [(&mut CudaSlice<u16>, usize, Option<usize>)],
    ) -> Result<()> {
        self.grouped(op, items, sys::ncclDataType_t::ncclBfloat16)
    }

    /// [`NcclComm::grouped_f32`] on values of NCCL type `dtype`.
    fn grouped<T: cudarc::driver::DeviceRepr>(
        &self,
        op: GroupOp,
        items: &mut [(&mut CudaSlice<T>, usize, Option<usize>)],
        dtype: sys::ncclDataType_t,
    ) -> Result<()> {
        for (b, n, root) in items.iter() {
            self.check(op, *n, b.len(), *root)?;
        }
        let mut comm = self
            .comm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        comm.usable(op.name())?;
        let mut queued = Vec::with_capacity(items.len());
        // the pointers' guards are held until the group is queued
        let mut guards = Vec::with_capacity(items.len());
        for (b, n, root) in items.iter_mut() {
            let (ptr, guard) = b.device_ptr_mut(&self.stream);
            queued.push((ptr, *n, *root));
            guards.push(guard);
        }
        self.group_typed(&comm, op, &queued, dtype)?;
        drop(guards);
        self.wait(&mut comm, op.name())
    }

    /// Queues `op` (as [`NcclComm::grouped_f32`]) on each of `items` — `(device pointer,
    /// len, root)`: `len` f32 values in place — in one NCCL group on NCCL's stream, and
    /// returns without waiting: [`NcclComm::wait_queued`] waits. The work queued on other
    /// streams is not waited for: synchronize them first.
    ///
    /// # Safety
    /// Each pointer must name `len` f32 on this communicator's device that stay allocated,
    /// and that no other work reads or writes, until [`NcclComm::wait_queued`] returns.
    ///
    /// # Errors
    /// As [`NcclComm::grouped_f32`], but for the wait's.
    pub unsafe fn queue_f32(
        &self,
        op: GroupOp,
        items: &[(cudarc::driver::sys::CUdeviceptr, usize, Option<usize>)],
    ) -> Result<()> {
        // SAFETY: the caller's contract
        unsafe { self.queue(op, items, f32::TYPE) }
    }

    /// [`NcclComm::queue_f32`] on bf16 values (the bits of gradients stored in bf16),
    /// summed as [`NcclComm::grouped_bf16`] sums them.
    ///
    /// # Safety
    /// As [`NcclComm::queue_f32`], each pointer naming `len` bf16 values.
    ///
    /// # Errors
    /// As [`NcclComm::queue_f32`].
    pub unsafe fn queue_bf16(
        &self,
        op: GroupOp,
        items: &[(cudarc::driver::sys::CUdeviceptr, usize, Option<usize>)],
    ) -> Result<()> {
        // SAFETY: the caller's contract
        unsafe { self.queue(op, items, sys::ncclDataType_t::ncclBfloat16) }
    }

    /// [`NcclComm::queue_f32`] on values of NCCL type `dtype`.
    ///
    /// # Safety
    /// As [`NcclComm::queue_f32`], for values of `dtype`.
    unsafe fn queue(
        &self,
        op: GroupOp,
        items: &[(cudarc::driver::sys::CUdeviceptr, usize, Option<usize>)],
        dtype: sys::ncclDataType_t,
    ) -> Result<()> {
        for &(_, n, root) in items {
            self.check(op, n, n, root)?;
        }
        let comm = self
            .comm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        comm.usable(op.name())?;
        self.group_typed(&comm, op, items, dtype)
    }

    /// Waits for every collective [`NcclComm::queue_f32`] queued, as
    /// [`NcclComm::grouped_f32`] waits for its own.
    ///
    /// # Errors
    /// A CUDA failure; an asynchronous NCCL error or the timeout (the communicator is then
    /// aborted).
    pub fn wait_queued(&self) -> Result<()> {
        let mut comm = self
            .comm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        comm.usable("the queued sums")?;
        self.wait(&mut comm, "the queued sums")
    }

    /// An error unless `op` on `n` values of a buffer of `len`, to or from `root`, can run.
    fn check(&self, op: GroupOp, n: usize, len: usize, root: Option<usize>) -> Result<()> {
        let what = op.name();
        if op == GroupOp::Broadcast && root.is_none() {
            return Err(Error::BadArgument {
                kernel: "nccl",
                message: "a broadcast needs a root for every buffer".into(),
            });
        }
        if n > len || root.is_some_and(|r| r >= self.world) {
            return Err(Error::BadArgument {
                kernel: "nccl",
                message: format!(
                    "{what} of {n} values in a buffer of {len} (root {root:?}, world {})",
                    self.world
                ),
            });
        }
        c_int(what, n).map(drop)
    }

    /// Queues `op` on each of `items` (`(pointer, len, root)`, checked values of NCCL type
    /// `dtype`) in one group.
    fn group_typed(
        &self,
        comm: &RawComm,
        op: GroupOp,
        items: &[(cudarc::driver::sys::CUdeviceptr, usize, Option<usize>)],
        dtype: sys::ncclDataType_t,
    ) -> Result<()> {
        let what = op.name();
        result::group_start().map_err(|e| nccl("ncclGroupStart", &e))?;
        let mut failed = None;
        for &(ptr, n, root) in items {
            if n == 0 {
                continue;
            }
            if let Err(e) = self.in_place(comm, op, ptr, n, root, dtype) {
                failed = Some(e);
                break;
            }
        }
        // the group is closed whatever happened inside it
        let ended = result::group_end();
        if let Some(e) = failed {
            return Err(nccl(&format!("{what} (in a group)"), &e));
        }
        ended.map(drop).map_err(|e| nccl("ncclGroupEnd", &e))
    }

    /// Broadcasts each of `items` — `(buffer, len, root)`: the first `len` 16-bit values
    /// (bf16 weights), as they are — from its root to every rank, in one NCCL group, and
    /// waits for it as [`NcclComm::grouped_f32`] does.
    ///
    /// # Errors
    /// As [`NcclComm::grouped_f32`] for a broadcast.
    pub fn broadcast_u16(&self, items: &mut [(&mut CudaSlice<u16>, usize, usize)]) -> Result<()> {
        let op = GroupOp::Broadcast;
        for (b, n, root) in items.iter() {
            // the values move as pairs of bytes, whatever their format
            self.check(op, 2 * *n, 2 * b.len(), Some(*root))?;
        }
        let mut comm = self
            .comm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        comm.usable("broadcast (16-bit)")?;
        let mut queued = Vec::with_capacity(items.len());
        let mut guards = Vec::with_capacity(items.len());
        for (b, n, root) in items.iter_mut() {
            let (ptr, guard) = b.device_ptr_mut(&self.stream);
            queued.push((ptr, 2 * *n, Some(*root)));
            guards.push(guard);
        }
        self.group_typed(&comm, op, &queued, sys::ncclDataType_t::ncclUint8)?;
        drop(guards);
        self.wait(&mut comm, "broadcast (16-bit)")
    }

    /// Queues one in-place collective on the `count` values (of NCCL type `dtype`) at `ptr`:
    /// all-reduce (`Sum`, no root), reduce to `root` (`Sum`), broadcast from `root`.
    fn in_place(
        &self,
        comm: &RawComm,
        op: GroupOp,
        ptr: cudarc::driver::sys::CUdeviceptr,
        count: usize,
        root: Option<usize>,
        dtype: sys::ncclDataType_t,
    ) -> std::result::Result<(), result::NcclError> {
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let (buf, sum) = (ptr as *mut core::ffi::c_void, sys::ncclRedOp_t::ncclSum);
        // roots were checked < world (a c_int)
        let at = |r: Option<usize>| r.unwrap_or(0) as core::ffi::c_int;
        // SAFETY: `buf` holds `count` values of `dtype` on this communicator's device, alive
        // until the wait that follows (the callers' contract); send and receive buffers may
        // coincide.
        unsafe {
            match (op, root) {
                (GroupOp::Sum, None) => {
                    result::all_reduce(buf, buf, count, dtype, sum, comm.comm, stream)
                }
                (GroupOp::Sum, Some(_)) => {
                    result::reduce(buf, buf, count, dtype, sum, at(root), comm.comm, stream)
                }
                (GroupOp::Broadcast, _) => {
                    result::broadcast(buf, buf, count, dtype, at(root), comm.comm, stream)
                }
            }
        }
        .map(drop)
    }

    /// Waits for NCCL's stream, polling it and the communicator's asynchronous error, so
    /// that a rank that died or hangs cannot hold this one forever: an asynchronous error,
    /// or `ARES_COLLECTIVE_TIMEOUT` seconds (600 by default), aborts the communicator and is
    /// an error saying so (the runner then stops, and the TCP meeting names the rank).
    fn wait(&self, comm: &mut RawComm, what: &str) -> Result<()> {
        let timeout = std::env::var("ARES_COLLECTIVE_TIMEOUT")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(600);
        let start = std::time::Instant::now();
        loop {
            // SAFETY: the stream is alive (owned here); cuStreamQuery only reads its state.
            let r = unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) };
            match r {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                _ => return self.stream.synchronize().during(format!("nccl: {what}")),
            }
            if let Some(e) = comm.async_error() {
                let why = format!("NCCL reported {:?} during {what}", e.0);
                comm.abort(why.clone());
                return Err(Error::BadArgument {
                    kernel: "nccl",
                    message: format!(
                        "{why} (a peer rank failed or its connection dropped); the \
                         communicator is aborted"
                    ),
                });
            }
            if start.elapsed().as_secs() >= timeout {
                comm.abort(format!("{what} timed out after {timeout} s"));
                return Err(Error::CollectiveTimeout {
                    what: what.to_string(),
                    secs: timeout,
                });
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    /// Queues an all-gather of `send` (`count` values per rank) into `recv`.
    fn all_gather<T: Wire + cudarc::driver::DeviceRepr>(
        &self,
        comm: &RawComm,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> std::result::Result<(), result::NcclError> {
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let count = send.len();
        let (src, _read) = send.device_ptr(&self.stream);
        let (dst, _write) = recv.device_ptr_mut(&self.stream);
        // SAFETY: `recv` holds world · count values (the callers size it), both buffers on
        // this communicator's device and alive until the wait that follows.
        unsafe {
            result::all_gather(
                src as *const core::ffi::c_void,
                dst as *mut core::ffi::c_void,
                count,
                T::TYPE,
                comm.comm,
                stream,
            )
        }
        .map(drop)
    }

    /// Every rank's `mine`, in rank order: the lengths gathered first, then the bytes
    /// padded to the longest.
    ///
    /// # Errors
    /// A CUDA or NCCL failure; an asynchronous NCCL error or the timeout (the communicator
    /// is then aborted; a rank that died makes NCCL fail or hang, and the runner's TCP
    /// meeting names it).
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let world = self.world;
        let mut comm = self
            .comm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        comm.usable("all-gather")?;
        let s = &self.stream;
        let len = s
            .clone_htod(&[mine.len() as u64])
            .during("nccl: upload a length")?;
        let mut lens = s
            .alloc_zeros::<u64>(world)
            .during("nccl: allocate lengths")?;
        self.all_gather(&comm, &len, &mut lens)
            .map_err(|e| nccl("ncclAllGather (lengths)", &e))?;
        self.wait(&mut comm, "all-gather (lengths)")?;
        let lens: Vec<usize> = s
            .clone_dtoh(&lens)
            .during("nccl: download lengths")?
            .into_iter()
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
            .collect();
        let longest = lens.iter().copied().max().unwrap_or(0);
        if longest == 0 {
            return Ok(vec![Vec::new(); world]);
        }
        let mut padded = mine.to_vec();
        padded.resize(longest, 0);
        let send = s.clone_htod(&padded).during("nccl: upload bytes")?;
        let mut recv = s
            .alloc_zeros::<u8>(longest * world)
            .during("nccl: allocate bytes")?;
        self.all_gather(&comm, &send, &mut recv)
            .map_err(|e| nccl("ncclAllGather (bytes)", &e))?;
        self.wait(&mut comm, "all-gather (bytes)")?;
        let all = s.clone_dtoh(&recv).during("nccl: download bytes")?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &n)| all[r * longest..r * longest + n.min(longest)].to_vec())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without NCCL (a machine with no GPU stack) every entry point says which library is
    /// missing instead of failing inside the loader.
    #[test]
    fn without_nccl_the_error_names_the_library() {
        if nccl_available() {
            eprintln!("NCCL is installed here: nothing to check");
            return;
        }
        let e = unique_id().unwrap_err().to_string();
        assert!(e.contains("libnccl"), "{e}");
        let e = NcclComm::new(0, 0, 1, [0; 128]).unwrap_err().to_string();
        assert!(e.contains("libnccl") || e.contains("libcuda"), "{e}");
    }
}
