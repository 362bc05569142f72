//! Data parallelism: ranks that share one RL step through a [`Collective`].
//!
//! A data-parallel step here is *replicated decisions, sharded work*: every rank holds the
//! whole batch and runs every controller (online filter, buckets, τ, α/λ/β, advantages)
//! on it, so no batch-wide quantity needs its own reduction; what costs — generating the
//! rollout, scoring old and reference log-probs, the forward and backward passes of the
//! update — is split into *units* (rollout requests, scoring chunks, micro-batches), each
//! computed by one rank and gathered by all ([`Ranks::map_units`]).
//!
//! The units are those of a run without ranks and are computed with the same shapes, so
//! their results are the same bits whatever the world size. The gradients of a mini-batch
//! (`trainer.gradient_sum`) are by default one slice per micro-batch, summed in
//! micro-batch order ([`Ranks::ordered_sum`]), so a run's numbers do not depend on the
//! world size — but a run *without* ranks accumulates its micro-batches inside the
//! backward GEMMs, so it equals a world of one in everything but the last bits of those
//! sums. With `ranks` each rank accumulates as a run without ranks does and the ranks'
//! sums are added ([`Ranks::all_reduce_sum`]): one gradient exchanged a rank, a world of
//! one equal to a run without ranks, other worlds equal to it to rounding.
//!
//! [`threads::ThreadGroup`] is the in-process implementation (threads as ranks), used by
//! the tests. [`launch`] reads a launcher's variables (torchrun, Slurm) and
//! meets the other processes over TCP ([`launch::TcpRanks`]); on GPUs NCCL can carry the
//! same bytes instead (`nccl::NcclRanks`, `ARES_TRANSPORT=nccl`).

pub mod launch;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod threads;
pub mod wire;

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Why a collective operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// Ranks did not arrive in time.
    #[error(
        "rank {rank}: collective operation {round} timed out after {secs} s waiting for rank(s) \
         {missing:?} (a rank that hangs or died; the timeout is ARES_COLLECTIVE_TIMEOUT, seconds)"
    )]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// The operation's sequence number.
        round: u64,
        /// Seconds waited.
        secs: u64,
        /// The ranks that never arrived.
        missing: Vec<usize>,
    },
    /// A rank stopped (its thread or process ended, or it failed).
    #[error("rank {rank}: rank {gone} stopped before collective operation {round}: {why}")]
    RankGone {
        /// The rank that noticed.
        rank: usize,
        /// The rank that stopped.
        gone: usize,
        /// The operation's sequence number.
        round: u64,
        /// What is known of why.
        why: String,
    },
    /// The transport failed or carried something malformed.
    #[error("rank {rank}: {what}")]
    Transport {
        /// The rank that saw it.
        rank: usize,
        /// What went wrong.
        what: String,
    },
    /// Ranks disagree on something they must share (a unit count, a buffer length).
    #[error("rank {rank}: {what}")]
    Mismatch {
        /// The rank that saw it.
        rank: usize,
        /// What differs.
        what: String,
    },
}

/// What ranks can do together. Every rank calls the same operations in the same order;
/// an operation returns once every rank has called it.
pub trait Collective: Send + Sync {
    /// This rank, `0 ≤ rank < world`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world(&self) -> usize;

    /// Every rank's `mine`, in rank order — the same on every rank.
    ///
    /// # Errors
    /// A rank that stopped or timed out; a transport failure.
    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError>;

    /// Part `s` of every rank's `parts` (one per rank) to rank `s`: what this rank receives,
    /// in rank order. The default gathers every part everywhere (right on any transport); a
    /// transport that can route overrides it, so each rank receives its own parts only.
    ///
    /// # Errors
    /// A part count other than the world; as [`Collective::all_gather`].
    fn all_to_all(&self, parts: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let (rank, world) = (self.rank(), self.world());
        if parts.len() != world {
            return Err(CollectiveError::Mismatch {
                rank,
                what: format!("all_to_all: {} parts for {world} ranks", parts.len()),
            });
        }
        let mut w = wire::Writer::default();
        for p in &parts {
            w.bytes(p);
        }
        let all = self.all_gather(w.finish())?;
        let mut out = Vec::with_capacity(world);
        for bytes in &all {
            let mut r = wire::Reader::new(bytes);
            let mut mine = None;
            for s in 0..world {
                let part = r.bytes().map_err(|e| e.at(rank))?;
                if s == rank {
                    mine = Some(part.to_vec());
                }
            }
            r.end().map_err(|e| e.at(rank))?;
            out.push(mine.unwrap_or_default());
        }
        Ok(out)
    }

    /// The sum of every rank's parts, `message` holding this rank's as
    /// [`Ranks::ordered_sum`] writes them (a `u64` count, then that many runs of `len`
    /// values, [`wire::Writer::values`]), folded in rank then part order — the same bits on every rank. The default
    /// gathers every rank's parts everywhere and folds them there (right on any transport);
    /// a transport with a root overrides it, so that the root folds and each rank receives
    /// the sum alone.
    ///
    /// # Errors
    /// A malformed message; as [`Collective::all_gather`].
    fn ordered_sum(&self, message: Vec<u8>, len: usize) -> Result<Vec<f32>, CollectiveError> {
        let all = self.all_gather(message)?;
        let mut out = vec![0.0f32; len];
        fold_parts(self.rank(), &all, &mut out)?;
        Ok(out)
    }

    /// Sums each of `buffers` (a backend's f32 buffers or bf16 ones, gradients stored in
    /// bf16, [`DeviceBuffer::as_any_mut`]) over
    /// the ranks in place on their device, in the transport's own order and as one group:
    /// to every rank where the root is `None`, to the root rank alone otherwise (ZeRO-1's
    /// reduce-scatter: the other ranks' copies are then unspecified). `None` when this
    /// transport cannot reach those buffers (the caller then sums through the host).
    ///
    /// [`DeviceBuffer::as_any_mut`]: crate::backend::DeviceBuffer::as_any_mut
    fn sum_device(
        &self,
        _buffers: &mut [(&mut dyn std::any::Any, Option<usize>)],
    ) -> Option<Result<(), CollectiveError>> {
        None
    }

    /// Queues the sum over the ranks of each of `ranges` — `(buffer, offset, len, root)`:
    /// values of a backend's f32 or bf16 buffer ([`DeviceBuffer::as_any`]), to every rank where the
    /// root is `None` — in place on their device, as one group, after the work already
    /// waited for on that device, and returns without waiting for it
    /// ([`Collective::wait_queued_device`]). `None` when this transport cannot reach them.
    ///
    /// # Safety
    /// Nothing may read, write or free those values until `wait_queued_device` returns.
    ///
    /// [`DeviceBuffer::as_any`]: crate::backend::DeviceBuffer::as_any
    unsafe fn queue_sum_device(
        &self,
        _ranges: &[(&dyn std::any::Any, usize, usize, Option<usize>)],
    ) -> Option<Result<(), CollectiveError>> {
        None
    }

    /// Waits for every sum [`Collective::queue_sum_device`] queued.
    ///
    /// # Errors
    /// A rank that stopped or timed out; a transport failure.
    fn wait_queued_device(&self) -> Result<(), CollectiveError> {
        Ok(())
    }

    /// Whether [`Collective::sum_device`] can sum a buffer like `buffer` on its device
    /// (then the trainer sums there rather than through the host).
    fn sums_on_device(&self, _buffer: &dyn std::any::Any) -> bool {
        false
    }

    /// Broadcasts each of `buffers` (a backend's f32 buffers or 16-bit ones, as they are)
    /// from its root rank to every rank, on their device; `None` when this transport cannot
    /// reach them (see [`Collective::sum_device`]).
    fn broadcast_device(
        &self,
        _buffers: &mut [(&mut dyn std::any::Any, usize)],
    ) -> Option<Result<(), CollectiveError>> {
        None
    }
}

/// The bytes of a trainable buffer (or a gradient) as stored.
fn bytes_of<B: crate::backend::Backend>(b: &crate::model::TrainableMut<'_, B>) -> u64 {
    let size = match b {
        crate::model::TrainableMut::F32(_) => 4,
        crate::model::TrainableMut::Bf16(_) => 2,
    };
    b.len() as u64 * size
}

/// A shared handle on this process's [`Collective`], with the step's helpers.
#[derive(Clone)]
pub struct Ranks(Arc<dyn Collective>, Arc<Mutex<Traffic>>);

/// What this rank's collective operations cost since last asked.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Traffic {
    /// Time inside the operations: moving bytes and waiting for slower ranks.
    pub time: Duration,
    /// Bytes this rank sent.
    pub bytes_sent: u64,
    /// Operations.
    pub operations: u64,
    /// Of those, the gradient sums started while a backward pass went on
    /// (`trainer.overlap_gradient_sum`); their time is in `time` too.
    pub overlapped: u64,
}

impl fmt::Debug for Ranks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Ranks({}/{})", self.rank(), self.world())
    }
}

/// Two handles are equal when they are the same collective.
impl PartialEq for Ranks {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Ranks {
    /// A handle on `collective`.
    pub fn new(collective: Arc<dyn Collective>) -> Self {
        Self(collective, Arc::default())
    }

    /// The collective operations' cost since the last call, and a fresh count.
    pub fn take_traffic(&self) -> Traffic {
        std::mem::take(
            &mut *self
                .1
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.0.rank()
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.0.world()
    }

    /// Whether this rank writes the run's files (rank 0).
    pub fn is_first(&self) -> bool {
        self.rank() == 0
    }

    /// The rank that computes unit `i` of `count`: contiguous blocks, balanced to one
    /// unit (`⌊i·W/count⌋`), so neighbouring units share a rank and its caches.
    pub fn owner(&self, i: usize, count: usize) -> usize {
        owner(i, count, self.world())
    }

    /// Every rank's `mine`, in rank order.
    ///
    /// # Errors
    /// As [`Collective::all_gather`].
    pub fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let (t, sent) = (Instant::now(), mine.len() as u64);
        let out = self.0.all_gather(mine);
        self.count(t, sent);
        out
    }

    /// Units `0..count`, each computed by its [`owner`](Ranks::owner) with `compute` and
    /// gathered by every rank: the results in unit order, the same on every rank.
    /// A unit's failure on its rank reaches every rank (as [`UnitsError::Unit`] there,
    /// [`UnitsError::Elsewhere`] on the others), so all ranks stop together.
    ///
    /// # Errors
    /// A unit's error; a collective failure.
    pub fn map_units<E: fmt::Display>(
        &self,
        count: usize,
        mut compute: impl FnMut(usize) -> Result<Vec<u8>, E>,
    ) -> Result<Vec<Vec<u8>>, UnitsError<E>> {
        self.map_units_then(count, &mut (), |_, i| compute(i), |_, units| Ok(units))
    }

    /// [`Ranks::map_units`] with each unit made in two parts: `compute` for each of this
    /// rank's units in order, then `finish` over all of their results at once (one device
    /// read for all of them, say), which gives each unit's bytes in the same order. Both
    /// are handed `context` (what both need mutably: a model, its optimizer).
    ///
    /// # Errors
    /// As [`Ranks::map_units`]; `finish`'s error, or its giving another number of units
    /// than it was given (a collective error).
    pub fn map_units_then<C, T, E: fmt::Display>(
        &self,
        count: usize,
        context: &mut C,
        mut compute: impl FnMut(&mut C, usize) -> Result<T, E>,
        finish: impl FnOnce(&mut C, Vec<T>) -> Result<Vec<Vec<u8>>, E>,
    ) -> Result<Vec<Vec<u8>>, UnitsError<E>> {
        let mut mine = wire::Writer::default();
        let mut failed = None;
        let mut made = Vec::new();
        for i in (0..count).filter(|&i| self.owner(i, count) == self.rank()) {
            match compute(context, i) {
                Ok(unit) => made.push(unit),
                Err(e) => {
                    failed = Some((format!("unit {i} of {count}"), Some(e)));
                    break;
                }
            }
        }
        let owned = made.len();
        if failed.is_none() {
            match finish(context, made) {
                Ok(units) if units.len() == owned => units.iter().for_each(|b| mine.bytes(b)),
                Ok(units) => {
                    let what = format!("{} units finished from {owned}", units.len());
                    failed = Some((what, None));
                }
                Err(e) => failed = Some((format!("the {owned} units of {count} here"), Some(e))),
            }
        }
        // a failure is sent as a message so the other ranks stop too
        let message = match &failed {
            Some((what, e)) => {
                let mut w = wire::Writer::default();
                w.u8(1);
                let why = e.as_ref().map_or_else(String::new, |e| format!(": {e}"));
                w.bytes(format!("{what} failed{why}").as_bytes());
                w.finish()
            }
            None => {
                let mut w = wire::Writer::default();
                w.u8(0);
                w.bytes(&mine.finish());
                w.finish()
            }
        };
        let all = self.all_gather(message).map_err(UnitsError::Collective)?;
        match failed {
            Some((_, Some(e))) => return Err(UnitsError::Unit(e)),
            Some((what, None)) => {
                return Err(UnitsError::Collective(CollectiveError::Transport {
                    rank: self.rank(),
                    what,
                }));
            }
            None => {}
        }
        let mut out = Vec::with_capacity(count);
        let bad = |e: wire::WireError| UnitsError::Collective(e.at(self.rank()));
        for (r, bytes) in all.iter().enumerate() {
            let mut reader = wire::Reader::new(bytes);
            let (status, body) = (reader.u8().map_err(bad)?, reader.bytes().map_err(bad)?);
            if status != 0 {
                return Err(UnitsError::Elsewhere {
                    rank: r,
                    what: String::from_utf8_lossy(body).into_owned(),
                });
            }
            let mut units = wire::Reader::new(body);
            let owned = (0..count).filter(|&i| self.owner(i, count) == r).count();
            for _ in 0..owned {
                out.push(units.bytes().map_err(bad)?.to_vec());
            }
            units.end().map_err(bad)?;
        }
        Ok(out)
    }

    /// `values` summed over the ranks, in rank order (`((v₀ + v₁) + v₂) + …`, element by
    /// element), on every rank: what an all-reduce gives, with its order fixed. A world of
    /// one leaves `values` as they are.
    ///
    /// # Errors
    /// Ranks with other lengths; a collective failure.
    pub fn all_reduce_sum(&self, values: &mut [f32]) -> Result<(), CollectiveError> {
        if self.world() == 1 {
            return Ok(());
        }
        self.ordered_sum(&[values.to_vec()], values)
    }

    /// [`Ranks::ordered_sum`] as a reduce-scatter: `out` is cut into consecutive `spans`
    /// (`(len, holder)`), and each rank receives — and sums, in the same order, to the same
    /// bits — only the spans it holds; the others are left 0. Where a transport routes
    /// ([`Collective::all_to_all`]) each rank sends every part once and receives only its
    /// share: ZeRO-1's gradient exchange.
    ///
    /// # Errors
    /// Spans that do not cover `out`, a part of another length; a collective failure.
    pub fn ordered_sum_held(
        &self,
        parts: &[Vec<f32>],
        spans: &[(usize, Holder)],
        out: &mut [f32],
    ) -> Result<(), CollectiveError> {
        let (rank, world) = (self.rank(), self.world());
        let mismatch = |what: String| CollectiveError::Mismatch { rank, what };
        if spans.iter().map(|s| s.0).sum::<usize>() != out.len() {
            return Err(mismatch(format!(
                "ordered_sum_held: spans of {} values for {}",
                spans.iter().map(|s| s.0).sum::<usize>(),
                out.len()
            )));
        }
        if let Some(p) = parts.iter().find(|p| p.len() != out.len()) {
            return Err(mismatch(format!(
                "ordered_sum_held: a part of {} values, expected {}",
                p.len(),
                out.len()
            )));
        }
        // the spans `r` holds, as ranges of `out`
        let held = |r: usize| {
            let mut at = 0;
            spans
                .iter()
                .filter_map(move |&(len, h)| {
                    let range = at..at + len;
                    at += len;
                    h.holds(r).then_some(range)
                })
                .collect::<Vec<_>>()
        };
        let sends: Vec<Vec<u8>> = (0..world)
            .map(|r| {
                let mut w = wire::Writer::default();
                w.u64(parts.len() as u64);
                let ranges = held(r);
                for p in parts {
                    let values: Vec<f32> = ranges
                        .iter()
                        .flat_map(|g| p[g.clone()].iter().copied())
                        .collect();
                    w.values(&values);
                }
                w.finish()
            })
            .collect();
        let sent = sends.iter().map(|b| b.len() as u64).sum();
        let t = Instant::now();
        let received = self.0.all_to_all(sends);
        self.count(t, sent);
        let received = received?;
        let mine = held(rank);
        let n: usize = mine.iter().map(ExactSizeIterator::len).sum();
        let mut sum = vec![0.0f32; n];
        fold_parts(rank, &received, &mut sum)?;
        out.fill(0.0);
        let mut at = 0;
        for g in mine {
            let len = g.len();
            out[g].copy_from_slice(&sum[at..at + len]);
            at += len;
        }
        Ok(())
    }

    /// [`Collective::sum_device`] of a model's gradient `buffers` (f32, or the bf16 bits
    /// of gradients stored in bf16), counted as traffic; `None` when the transport cannot
    /// sum them on their device.
    pub fn sum_device<B: crate::backend::Backend>(
        &self,
        buffers: &mut [(crate::model::TrainableMut<'_, B>, Option<usize>)],
    ) -> Option<Result<(), CollectiveError>> {
        use crate::backend::DeviceBuffer;
        use crate::model::TrainableMut;
        let sent = buffers.iter().map(|(b, _)| bytes_of(b)).sum();
        let mut any = Vec::with_capacity(buffers.len());
        for (b, root) in buffers.iter_mut() {
            let b: &mut dyn std::any::Any = match b {
                TrainableMut::F32(b) => b.as_any_mut()?,
                TrainableMut::Bf16(h) => h.as_any_mut()?,
            };
            any.push((b, *root));
        }
        let t = Instant::now();
        let out = self.0.sum_device(&mut any)?;
        self.count(t, sent);
        Some(out)
    }

    /// [`Collective::queue_sum_device`] of `ranges` (`(values, root)`: f32 values, or the
    /// bits of gradients stored in bf16), counted as traffic; `None` when the transport
    /// cannot reach them.
    ///
    /// # Safety
    /// As [`Collective::queue_sum_device`].
    pub unsafe fn queue_sum_device<B: crate::backend::Backend>(
        &self,
        ranges: &[(crate::backend::Stored<'_, B>, Option<usize>)],
    ) -> Option<Result<(), CollectiveError>> {
        use crate::backend::{DeviceBuffer, Stored};
        let mut sent = 0;
        let mut any = Vec::with_capacity(ranges.len());
        for &(v, root) in ranges {
            let (b, offset, len, size): (&dyn std::any::Any, _, _, _) = match v {
                Stored::F32(v) => (v.buffer().as_any()?, v.offset(), v.len(), 4),
                Stored::Bf16(v) => (v.buffer().as_any()?, v.offset(), v.len(), 2),
            };
            sent += len as u64 * size;
            any.push((b, offset, len, root));
        }
        let t = Instant::now();
        // SAFETY: the caller's contract
        let out = unsafe { self.0.queue_sum_device(&any) }?;
        self.count(t, sent);
        Some(out)
    }

    /// [`Collective::wait_queued_device`], its wait counted as traffic time.
    ///
    /// # Errors
    /// As [`Collective::wait_queued_device`].
    pub fn wait_queued_device(&self) -> Result<(), CollectiveError> {
        let t = Instant::now();
        let out = self.0.wait_queued_device();
        let mut traffic = self
            .1
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        traffic.time += t.elapsed();
        out
    }

    /// [`Collective::sums_on_device`] for `buffer`.
    pub fn sums_on_device<D: crate::backend::DeviceBuffer>(&self, buffer: &mut D) -> bool {
        buffer
            .as_any_mut()
            .is_some_and(|b| self.0.sums_on_device(&*b))
    }

    /// [`Collective::broadcast_device`] of a model's trainable `buffers` (f32, or the bf16
    /// bits of weights stored in bf16), each from its root, counted as traffic (the roots'
    /// bytes); `None` when the transport cannot reach them.
    pub fn broadcast_device<B: crate::backend::Backend>(
        &self,
        buffers: &mut [(crate::model::TrainableMut<'_, B>, usize)],
    ) -> Option<Result<(), CollectiveError>> {
        use crate::backend::DeviceBuffer;
        use crate::model::TrainableMut;
        let rank = self.rank();
        let sent = buffers
            .iter()
            .filter(|(_, root)| *root == rank)
            .map(|(b, _)| bytes_of(b))
            .sum();
        let mut any = Vec::with_capacity(buffers.len());
        for (b, root) in buffers.iter_mut() {
            let b: &mut dyn std::any::Any = match b {
                TrainableMut::F32(b) => b.as_any_mut()?,
                TrainableMut::Bf16(h) => h.as_any_mut()?,
            };
            any.push((b, *root));
        }
        let t = Instant::now();
        let out = self.0.broadcast_device(&mut any)?;
        self.count(t, sent);
        Some(out)
    }

    /// Counts `n` operations as started while a backward pass went on.
    pub(crate) fn count_overlapped(&self, n: u64) {
        self.1
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .overlapped += n;
    }

    /// Counts an operation that started at `started` and sent `sent` bytes.
    fn count(&self, started: Instant, sent: u64) {
        let mut traffic = self
            .1
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        traffic.time += started.elapsed();
        traffic.bytes_sent += sent;
        traffic.operations += 1;
    }

    /// The sum of every rank's `parts`, folded left to right in rank order and, within a
    /// rank, in `parts` order — `((p₀ + p₁) + p₂) + …` element by element, exactly as
    /// one rank holding every part would add them — written to `out` on every rank.
    /// With no part anywhere `out` is zeroed.
    ///
    /// # Errors
    /// A part whose length is not `out`'s; a collective failure.
    pub fn ordered_sum(&self, parts: &[Vec<f32>], out: &mut [f32]) -> Result<(), CollectiveError> {
        let mut w = wire::Writer::default();
        w.u64(parts.len() as u64);
        for p in parts {
            if p.len() != out.len() {
                return Err(CollectiveError::Mismatch {
                    rank: self.rank(),
                    what: format!(
                        "ordered_sum: a part of {} values, expected {}",
                        p.len(),
                        out.len()
                    ),
                });
            }
            w.values(p);
        }
        let message = w.finish();
        let sent = message.len() as u64;
        let t = Instant::now();
        let sum = self.0.ordered_sum(message, out.len());
        self.count(t, sent);
        out.copy_from_slice(&sum?);
        Ok(())
    }
}

/// Adds the parts of every rank's message (`u64` count, then that many runs of
/// `out.len()` values, [`wire::Writer::values`]: bf16 blocks at 2 bytes a value), in rank
/// then part order, into `out` (zeroed by the caller, and left so when there is no part).
fn fold_parts(rank: usize, messages: &[Vec<u8>], out: &mut [f32]) -> Result<(), CollectiveError> {
    let mut first = true;
    for bytes in messages {
        let mut r = wire::Reader::new(bytes);
        let k = r.u64().map_err(|e| e.at(rank))?;
        for _ in 0..k {
            let values = r.values(out.len()).map_err(|e| e.at(rank))?;
            if first {
                // 0 + x = x, but −0 would become +0: start from the first part itself
                values.write_to(out);
                first = false;
            } else {
                values.add_to(out);
            }
        }
        r.end().map_err(|e| e.at(rank))?;
    }
    Ok(())
}

/// Which ranks need the sum of a span of values ([`Ranks::ordered_sum_held`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// Every rank (a vision tower's gradients under ZeRO-1).
    All,
    /// One rank (the owner of a buffer's optimizer state).
    Rank(usize),
}

impl Holder {
    /// Whether `rank` needs the span.
    fn holds(self, rank: usize) -> bool {
        match self {
            Holder::All => true,
            Holder::Rank(r) => r == rank,
        }
    }
}

/// The rank of unit `i` of `count` at world `world` (see [`Ranks::owner`]).
pub fn owner(i: usize, count: usize, world: usize) -> usize {
    if count == 0 {
        return 0;
    }
    // i·W/count < W for i < count; u128 so no product overflows
    ((i as u128 * world as u128) / count as u128) as usize
}

/// The rank that owns each of `sizes`' buffers (ZeRO-1): contiguous runs of buffers,
/// each going to the rank whose `1/world` of the total its middle element falls in, so
/// the ranks hold about equal parts (a buffer is never split; a rank may own none).
pub fn shares(sizes: &[usize], world: usize) -> Vec<usize> {
    let total: u128 = sizes.iter().map(|&s| s as u128).sum();
    let mut before = 0u128;
    sizes
        .iter()
        .map(|&s| {
            let middle = 2 * before + s as u128; // twice the middle element's index
            before += s as u128;
            if total == 0 {
                return 0;
            }
            ((middle * world as u128) / (2 * total)).min(world.saturating_sub(1) as u128) as usize
        })
        .collect()
}

/// Why [`Ranks::map_units`] failed.
#[derive(Debug)]
pub enum UnitsError<E> {
    /// A unit this rank computed failed.
    Unit(E),
    /// A unit another rank computed failed.
    Elsewhere {
        /// That rank.
        rank: usize,
        /// Its error, as text.
        what: String,
    },
    /// The collective failed.
    Collective(CollectiveError),
}

impl<E> From<CollectiveError> for UnitsError<E> {
    fn from(e: CollectiveError) -> Self {
        UnitsError::Collective(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts of bf16 values (gradients stored in bf16, widened) travel at 2 bytes a value
    /// and sum to the bits of the f32 parts' sum; other values travel at 4.
    #[test]
    fn bf16_parts_travel_at_half_the_bytes_and_sum_the_same() {
        let n = 3 * wire::BLOCK;
        let part = |r: usize, bf16: bool| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let x = ((i * 7 + r * 13) % 97) as f32 / 9.0 - 5.0;
                    if bf16 {
                        f32::from_bits(x.to_bits() & 0xffff_0000)
                    } else {
                        x
                    }
                })
                .collect()
        };
        for bf16 in [true, false] {
            let handles: Vec<_> = threads::ThreadGroup::ranks(2, Duration::from_secs(30))
                .into_iter()
                .enumerate()
                .map(|(r, c)| {
                    let p = part(r, bf16);
                    std::thread::spawn(move || {
                        let ranks = Ranks::new(Arc::new(c));
                        let mut out = vec![0.0f32; n];
                        ranks.ordered_sum(&[p], &mut out).unwrap();
                        (out, ranks.take_traffic().bytes_sent)
                    })
                })
                .collect();
            let got: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            let (a, b) = (part(0, bf16), part(1, bf16));
            let want: Vec<u32> = a.iter().zip(&b).map(|(x, y)| (x + y).to_bits()).collect();
            for (out, sent) in &got {
                assert_eq!(out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
                let per_value = if bf16 { 2 } else { 4 };
                assert_eq!(*sent as usize, 8 + 8 + 3 + per_value * n, "bf16 {bf16}");
            }
        }
    }

    #[test]
    fn shares_are_contiguous_and_about_equal() {
        let sizes = [100, 10, 10, 10, 50, 50, 10, 10, 100, 1];
        assert_eq!(shares(&sizes, 1), vec![0; 10]);
        let two = shares(&sizes, 2);
        assert!(two.windows(2).all(|w| w[0] <= w[1]), "{two:?}");
        let held = |r: usize, s: &[usize]| -> usize {
            sizes
                .iter()
                .zip(s)
                .filter(|(_, o)| **o == r)
                .map(|(n, _)| n)
                .sum()
        };
        // 351 elements, half 175.5: the 50 at 130..180 has its middle before the half, the
        // next 50 after it: 180 and 171 (moving either 50 would leave them 100 apart)
        assert_eq!((held(0, &two), held(1, &two)), (180, 171));
        let four = shares(&sizes, 4);
        assert!(four.iter().all(|&r| r < 4) && four.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(shares(&[], 3), Vec::<usize>::new());
        assert_eq!(shares(&[0, 0], 3), vec![0, 0]);
    }

    #[test]
    fn owners_are_contiguous_balanced_and_cover_every_rank_when_they_can() {
        for world in 1..=5 {
            for count in 0..=13 {
                let owners: Vec<usize> = (0..count).map(|i| owner(i, count, world)).collect();
                assert!(owners.windows(2).all(|w| w[0] <= w[1]), "{owners:?}");
                assert!(owners.iter().all(|&r| r < world));
                let mut per = vec![0usize; world];
                for &r in &owners {
                    per[r] += 1;
                }
                let (lo, hi) = (per.iter().min().unwrap(), per.iter().max().unwrap());
                assert!(hi - lo <= 1, "world {world} count {count}: {per:?}");
            }
        }
    }
}
