//! NCCL as the ranks' transport on GPUs (`ARES_TRANSPORT=nccl`): the ranks meet over TCP
//! ([`TcpRanks`]), rank 0 sends them NCCL's unique id, and every operation then runs
//! through NCCL on the rank's GPU (`ares_cuda::nccl`). The gathered bytes are the TCP
//! transport's, so those do not depend on the transport; `trainer.gradient_sum: ranks`
//! sums the gradient buffers on the device instead (NCCL's all-reduce, in its own order;
//! gradients stored in bf16 as bf16, NCCL's partial sums rounded to bf16 — where the host
//! path sums in f32 and rounds once).

use crate::backend::cuda::nccl::{GroupOp, NcclComm, unique_id};
use crate::backend::cuda::{CudaBuffer, CudaHalf};

use super::launch::{LaunchEnv, TcpRanks};
use super::{Collective, CollectiveError};

/// Ranks connected by NCCL, one GPU each.
#[derive(Debug)]
pub struct NcclRanks {
    comm: NcclComm,
}

impl NcclRanks {
    /// Meets the other ranks of `env` over TCP, shares rank 0's NCCL id and opens the
    /// communicator on GPU `env.local_rank`.
    ///
    /// # Errors
    /// The TCP meeting's errors; NCCL cannot be loaded or initialised (named).
    pub fn connect(env: &LaunchEnv) -> Result<Self, CollectiveError> {
        let rank = env.rank;
        let fail = |what: String| CollectiveError::Transport { rank, what };
        let tcp = TcpRanks::connect(env)?;
        // rank 0's id, or its failure, reaches every rank
        let mine = if rank == 0 {
            match unique_id() {
                Ok(id) => [&[0u8][..], &id[..]].concat(),
                Err(e) => [&[1u8][..], e.to_string().as_bytes()].concat(),
            }
        } else {
            Vec::new()
        };
        let all = tcp.all_gather(mine)?;
        let first = all.first().cloned().unwrap_or_default();
        let id: [u8; 128] = match first.split_first() {
            Some((0, id)) => id
                .try_into()
                .map_err(|_| fail("NCCL's unique id from rank 0 is not 128 bytes".into()))?,
            Some((_, why)) => {
                return Err(fail(format!(
                    "rank 0 could not make NCCL's id: {}",
                    String::from_utf8_lossy(why)
                )));
            }
            None => return Err(fail("rank 0 sent no NCCL id".into())),
        };
        let comm = NcclComm::new(env.local_rank, rank, env.world, id)
            .map_err(|e| fail(format!("NCCL on GPU {}: {e}", env.local_rank)))?;
        Ok(Self { comm })
    }
}

impl NcclRanks {
    /// An NCCL failure as this rank's transport error.
    fn failed(&self, e: &dyn std::fmt::Display) -> CollectiveError {
        CollectiveError::Transport {
            rank: self.comm.rank(),
            what: format!("NCCL: {e}"),
        }
    }

    /// Sums backend buffers over the ranks: the f32 ones in one group, then the bf16 ones
    /// (gradients stored in bf16) in another; `None` when one is not a CUDA buffer.
    fn sums<'a>(
        &self,
        buffers: impl Iterator<Item = (&'a mut dyn std::any::Any, Option<usize>)>,
    ) -> Option<Result<(), CollectiveError>> {
        let (mut f32s, mut halves) = (Vec::new(), Vec::new());
        for (b, root) in buffers {
            if b.is::<CudaBuffer>() {
                f32s.push((b.downcast_mut::<CudaBuffer>()?, root));
            } else {
                halves.push((b.downcast_mut::<CudaHalf>()?, root));
            }
        }
        let summed = CudaBuffer::nccl_grouped(&self.comm, GroupOp::Sum, &mut f32s)
            .and_then(|()| CudaHalf::nccl_sums(&self.comm, &mut halves));
        Some(summed.map_err(|e| self.failed(&e)))
    }
}

impl Collective for NcclRanks {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn sum_device(
        &self,
        buffers: &mut [(&mut dyn std::any::Any, Option<usize>)],
    ) -> Option<Result<(), CollectiveError>> {
        self.sums(buffers.iter_mut().map(|(b, r)| (&mut **b, *r)))
    }

    fn sums_on_device(&self, buffer: &dyn std::any::Any) -> bool {
        buffer.is::<CudaBuffer>() || buffer.is::<CudaHalf>()
    }

    unsafe fn queue_sum_device(
        &self,
        ranges: &[(&dyn std::any::Any, usize, usize, Option<usize>)],
    ) -> Option<Result<(), CollectiveError>> {
        // the f32 values in one group, then the bf16 ones (gradients stored in bf16)
        let (mut f32s, mut halves) = (Vec::new(), Vec::new());
        for &(b, offset, len, root) in ranges {
            let viewed = match b.downcast_ref::<CudaBuffer>() {
                Some(b) => crate::backend::View::new(b, offset, len).map(|v| f32s.push((v, root))),
                None => crate::backend::View::new(b.downcast_ref::<CudaHalf>()?, offset, len)
                    .map(|v| halves.push((v, root))),
            };
            if let Err(e) = viewed {
                return Some(Err(self.failed(&e)));
            }
        }
        // SAFETY: the caller's contract (the values are left alone until the wait)
        let queued = unsafe { CudaBuffer::nccl_queue_sums(&self.comm, &f32s) }
            .and_then(|()| unsafe { CudaHalf::nccl_queue_sums(&self.comm, &halves) });
        Some(queued.map_err(|e| self.failed(&e)))
    }

    fn wait_queued_device(&self) -> Result<(), CollectiveError> {
        self.comm.wait_queued().map_err(|e| self.failed(&e))
    }

    /// The f32 buffers in one group, then the 16-bit ones (bf16 weights) in another.
    fn broadcast_device(
        &self,
        buffers: &mut [(&mut dyn std::any::Any, usize)],
    ) -> Option<Result<(), CollectiveError>> {
        let (mut f32s, mut halves) = (Vec::new(), Vec::new());
        for (b, root) in buffers.iter_mut() {
            if b.is::<CudaBuffer>() {
                f32s.push((b.downcast_mut::<CudaBuffer>()?, Some(*root)));
            } else {
                halves.push((b.downcast_mut::<CudaHalf>()?, *root));
            }
        }
        let comm = &self.comm;
        let sent = CudaBuffer::nccl_grouped(comm, GroupOp::Broadcast, &mut f32s)
            .and_then(|()| CudaHalf::nccl_broadcast(comm, &mut halves));
        Some(sent.map_err(|e| self.failed(&e)))
    }

    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.comm
            .all_gather_bytes(&mine)
            .map_err(|e| CollectiveError::Transport {
                rank: self.comm.rank(),
                what: format!("NCCL: {e}"),
            })
    }
}
