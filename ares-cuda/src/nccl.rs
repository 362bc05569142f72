//! NCCL between processes, one GPU each (loaded at run time, as the other CUDA libraries):
//! the transport of a data-parallel run launched on GPUs. Rank 0 makes the unique id
//! ([`unique_id`]) and hands it to the other ranks itself (the runner sends it over its
//! TCP rendezvous); every rank then opens its communicator on its own device
//! ([`NcclComm::new`]).
//!
//! [`NcclComm::all_gather_bytes`] carries the runner's collective operations: each rank's
//! bytes (of any length, padded to the longest on the device) gathered in rank order.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp};

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

/// An NCCL communicator that may move between threads.
struct SendComm(Comm);

// SAFETY: NCCL lets any host thread call a communicator so long as no two calls on it
// overlap; `NcclComm` only reaches it through its mutex.
unsafe impl Send for SendComm {}

/// A collective of [`NcclComm::grouped_f32`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupOp {
    /// Sum over the ranks: to every rank, or to a root.
    Sum,
    /// Copy a root's values to every rank.
    Broadcast,
}

/// This process's rank in an NCCL communicator, on one device.
pub struct NcclComm {
    comm: Mutex<SendComm>,
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
        let ctx = CudaContext::new(ordinal).during(format!("opening CUDA device {ordinal}"))?;
        let stream = ctx.new_stream().during("creating NCCL's stream")?;
        let id = Id::uninit(id.map(|b| b as core::ffi::c_char));
        let comm = Comm::from_rank(Arc::clone(&stream), rank, world, id)
            .map_err(|e| nccl("ncclCommInitRank", &e))?;
        Ok(Self {
            comm: Mutex::new(SendComm(comm)),
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
    /// NCCL failure.
    pub fn grouped_f32(
        &self,
        op: GroupOp,
        items: &mut [(&mut CudaSlice<f32>, usize, Option<usize>)],
    ) -> Result<()> {
        let what = match op {
            GroupOp::Sum => "sum",
            GroupOp::Broadcast => "broadcast",
        };
        let run = |comm: &Comm,
                   view: &mut cudarc::driver::CudaViewMut<'_, f32>,
                   root: Option<usize>| {
            match (op, root) {
                (GroupOp::Sum, None) => comm.all_reduce_in_place(view, &ReduceOp::Sum).map(drop),
                (GroupOp::Sum, Some(r)) => comm
                    .reduce_in_place(view, &ReduceOp::Sum, r as i32)
                    .map(drop),
                (GroupOp::Broadcast, r) => comm
                    .broadcast_in_place(view, r.unwrap_or(0) as i32)
                    .map(drop),
            }
        };
        if op == GroupOp::Broadcast && items.iter().any(|(_, _, r)| r.is_none()) {
            return Err(Error::BadArgument {
                kernel: "nccl",
                message: "a broadcast needs a root for every buffer".into(),
            });
        }
        self.grouped(
            what,
            items.iter_mut().map(|(b, n, r)| (&mut **b, *n, *r)),
            run,
        )
    }

    /// Runs `op` on each `(buffer, len, root)` between `ncclGroupStart` and `ncclGroupEnd`
    /// (so NCCL fuses them into few launches: the buckets), then waits.
    fn grouped<'a>(
        &self,
        what: &str,
        items: impl Iterator<Item = (&'a mut CudaSlice<f32>, usize, Option<usize>)>,
        op: impl Fn(
            &Comm,
            &mut cudarc::driver::CudaViewMut<'_, f32>,
            Option<usize>,
        ) -> std::result::Result<(), cudarc::nccl::result::NcclError>,
    ) -> Result<()> {
        let items: Vec<_> = items.collect();
        for (b, n, root) in &items {
            if *n > b.len() || root.is_some_and(|r| r >= self.world) {
                return Err(Error::BadArgument {
                    kernel: "nccl",
                    message: format!(
                        "{what} of {n} values in a buffer of {} (root {root:?}, world {})",
                        b.len(),
                        self.world
                    ),
                });
            }
        }
        let comm = self
            .comm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        cudarc::nccl::result::group_start().map_err(|e| nccl("ncclGroupStart", &e))?;
        let mut failed = None;
        for (b, n, root) in items {
            if n == 0 {
                continue;
            }
            let mut view = b.slice_mut(0..n);
            if let Err(e) = op(&comm.0, &mut view, root) {
                failed = Some(e);
                break;
            }
        }
        // the group is closed whatever happened inside it
        let ended = cudarc::nccl::result::group_end();
        if let Some(e) = failed {
            return Err(nccl(&format!("{what} (in a group)"), &e));
        }
        ended.map_err(|e| nccl("ncclGroupEnd", &e))?;
        self.wait(what)
    }

    /// Waits for NCCL's stream, polling it so that a rank that died or hangs cannot hold
    /// this one forever: after `ARES_COLLECTIVE_TIMEOUT` seconds (600 by default) the wait
    /// is an error saying so (the runner then stops, and the TCP meeting names the rank).
    fn wait(&self, what: &str) -> Result<()> {
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
            if start.elapsed().as_secs() >= timeout {
                return Err(Error::CollectiveTimeout {
                    what: what.to_string(),
                    secs: timeout,
                });
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }

    /// Every rank's `mine`, in rank order: the lengths gathered first, then the bytes
    /// padded to the longest.
    ///
    /// # Errors
    /// A CUDA or NCCL failure (a rank that died makes NCCL fail or hang; the runner's
    /// timeout names it).
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let world = self.world;
        let comm = self
            .comm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let comm = &comm.0;
        let s = &self.stream;
        let len = s
            .clone_htod(&[mine.len() as u64])
            .during("nccl: upload a length")?;
        let mut lens = s
            .alloc_zeros::<u64>(world)
            .during("nccl: allocate lengths")?;
        comm.all_gather(&len, &mut lens)
            .map_err(|e| nccl("ncclAllGather (lengths)", &e))?;
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
        comm.all_gather(&send, &mut recv)
            .map_err(|e| nccl("ncclAllGather (bytes)", &e))?;
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
