//! The ranks' gradient sum overlapped with the backward (`trainer.overlap_gradient_sum`,
//! with `gradient_sum: ranks`).
//!
//! The sum is cut into buckets: each decoder layer's gradients, last layer first (the order
//! the backward finishes them), then everything else (embedding, final norm, LM head, the
//! vision tower). During this rank's last micro-batch the backward hands each layer's
//! gradients over as soon as they are complete ([`Grads::watch_layers`]), and their sum
//! over the ranks runs while the layers below are differentiated: through the host on a
//! thread of its own (threads, TCP), or queued in place on NCCL's stream (the device waits
//! for the layer's kernels first; the sums run beside the next layers' kernels). What was
//! not handed over — the rest, or every bucket when this rank ran no backward — is sent
//! when the rank's micro-batches end, and the sums are waited for (and, through the host,
//! written back) then.
//!
//! Through the host each element is summed as the exchange after the backward sums it (in
//! rank order, to its holders under ZeRO-1), so the gradients are the same bits; on NCCL
//! the order is NCCL's, as after the backward. Every rank sends the same buckets in the
//! same order, one operation each, whatever happened on it (a failed, skipped or absent
//! micro-batch), so the ranks' operations stay in step.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use super::Optimizer;
use crate::backend::{Backend, Stored, View};
use crate::model::{Grads, LayerWatch};
use crate::parallel::{CollectiveError, Holder, Ranks};
use crate::trainer::TrainError;

/// `(buffer, offset, len)`: a run of gradient values, `buffer` indexing the model's
/// gradient buffers then the tower's.
type Range = (usize, usize, usize);

/// Under ZeRO-1, who holds each range of a bucket (`(len, holder)`); `None` without.
type Holders = Option<Vec<(usize, Holder)>>;

/// A bucket's values and its holders.
type Bucket = (Vec<f32>, Holders);

/// One mini-batch's overlapped gradient sum, from [`Overlap::start`] to [`Overlap::finish`].
pub(super) struct Overlap {
    /// Each bucket's ranges: layer `L − 1 − k` for bucket `k < L`, then the rest.
    buckets: Vec<Vec<Range>>,
    /// Each bucket's holders (ZeRO-1), `None` when every rank receives every sum.
    holders: Arc<Vec<Holders>>,
    /// What the backward's watcher and [`Overlap::finish`] share.
    handed: Arc<Mutex<Handed>>,
    /// The thread that sums the buckets in order, and gives their sums back (`None`
    /// on the device, or when no thread could be started: [`Overlap::finish`] sums them).
    worker: Option<JoinHandle<Result<Vec<Vec<f32>>, CollectiveError>>>,
    /// Whether the sums are queued in place on the device (NCCL) rather than through the
    /// host.
    on_device: bool,
    ranks: Ranks,
}

/// The buckets handed over so far.
struct Handed {
    /// How many, in bucket order.
    count: usize,
    /// The summing thread's queue (closed by [`Overlap::finish`]).
    queue: Option<Sender<Bucket>>,
    /// A device sum that could not be queued (the ranks are then out of step: reported).
    failed: Option<TrainError>,
}

impl Overlap {
    /// Starts the sum of `opt`'s gradients over `ranks` (a model of `layers` decoder
    /// layers): on the device when `on_device` (the transport sums these buffers there),
    /// else through the host on a thread of its own. `spans` are ZeRO-1's holders of each
    /// gradient buffer (`zero::gradient_spans`), `None` without sharding.
    pub(super) fn start<B: Backend>(
        ranks: &Ranks,
        opt: &Optimizer<B>,
        layers: usize,
        spans: Option<&[(usize, Holder)]>,
        on_device: bool,
    ) -> Self {
        let buckets = buckets(&opt.grads, &super::grad_lens(opt), layers);
        let holders = buckets
            .iter()
            .map(|b| {
                let spans = spans?;
                Some(b.iter().map(|&(i, _, n)| (n, spans[i].1)).collect())
            })
            .collect();
        let (queue, received) = channel();
        let mine = ranks.clone();
        let worker = (!on_device).then(|| {
            std::thread::Builder::new()
                .name(format!("ares-gradient-sum-{}", ranks.rank()))
                .spawn(move || sum_each(&mine, &received))
        });
        let (worker, queue) = match worker {
            Some(Ok(w)) => (Some(w), Some(queue)),
            // on the device, or no thread: `finish` sums what the watcher did not
            _ => (None, None),
        };
        let handed = Handed {
            count: 0,
            queue,
            failed: None,
        };
        Self {
            buckets,
            holders: Arc::new(holders),
            handed: Arc::new(Mutex::new(handed)),
            worker,
            on_device,
            ranks: ranks.clone(),
        }
    }

    /// The watcher to give [`Grads::watch_layers`] for this rank's last backward: it hands
    /// each layer over in bucket order (a layer out of order, or one it cannot read, is
    /// left to [`Overlap::finish`]).
    pub(super) fn watch<B: Backend>(&self) -> LayerWatch<B> {
        let (handed, holders) = (Arc::clone(&self.handed), Arc::clone(&self.holders));
        let layers = self.buckets.len() - 1;
        let (on_device, ranks) = (self.on_device, self.ranks.clone());
        Box::new(move |be: &B, layer: usize, views: &[Stored<'_, B>]| {
            let mut h = handed.lock().unwrap_or_else(PoisonError::into_inner);
            if layer >= layers || h.count != layers - 1 - layer || h.failed.is_some() {
                return;
            }
            if on_device {
                // the layer's kernels first; then its sum beside the next layers'
                match queue_on_device(be, &ranks, views, &holders[h.count]) {
                    Ok(()) => h.count += 1,
                    Err(e) => h.failed = Some(e),
                }
                return;
            }
            let mut values = vec![0.0f32; views.iter().map(Stored::len).sum()];
            if read_views(be, views, &mut values).is_err() {
                return;
            }
            let bucket = (values, holders[h.count].clone());
            if let Some(q) = &h.queue
                && q.send(bucket).is_ok()
            {
                h.count += 1;
            }
        })
    }

    /// Stops the watcher, sends every bucket not handed over yet, waits for the sums and
    /// writes them into `opt`'s gradients (under ZeRO-1 the ranges this rank does not hold
    /// are zeroed, as the exchange after the backward leaves them).
    ///
    /// # Errors
    /// A collective failure (this rank's sums are then not written); a backend failure.
    pub(super) fn finish<B: Backend>(
        mut self,
        be: &B,
        opt: &mut Optimizer<B>,
    ) -> Result<(), TrainError> {
        opt.grads.watch_layers(None);
        let (count, queue, failed) = {
            let mut h = self.handed.lock().unwrap_or_else(PoisonError::into_inner);
            (h.count, h.queue.take(), h.failed.take())
        };
        self.ranks.count_overlapped(count as u64);
        if let Some(e) = failed {
            return Err(e);
        }
        if self.on_device {
            // the rest, a bucket a group as the watcher queued them; then the wait
            let stored = super::stored_grads(opt);
            for k in count..self.buckets.len() {
                let ranges = self.buckets[k]
                    .iter()
                    .map(|&(i, offset, len)| sub_view(stored[i], offset, len))
                    .collect::<Result<Vec<_>, _>>()?;
                queue_on_device(be, &self.ranks, &ranges, &self.holders[k])?;
            }
            return Ok(self.ranks.wait_queued_device()?);
        }
        // a bucket that cannot be read is sent as zeros, so the other ranks are not left
        // waiting for it; the error is this rank's
        let mut unread = None;
        let mut late = Vec::new();
        {
            for k in count..self.buckets.len() {
                let ranges = &self.buckets[k];
                let mut values = vec![0.0f32; ranges.iter().map(|r| r.2).sum()];
                if let Err(e) = read(be, opt, ranges, &mut values) {
                    unread.get_or_insert(e);
                    values.fill(0.0);
                }
                let bucket = (values, self.holders[k].clone());
                match &queue {
                    Some(q) => q.send(bucket).unwrap_or(()),
                    None => late.push(bucket),
                }
            }
        }
        drop(queue);
        let rank = self.ranks.rank();
        let mut sums = match self.worker.take() {
            Some(w) => w.join().unwrap_or_else(|_| {
                Err(CollectiveError::Transport {
                    rank,
                    what: "the gradient-summing thread panicked".into(),
                })
            })?,
            None => Vec::new(),
        };
        // without a thread, the buckets are summed here, in the same order
        if !late.is_empty() {
            let (queue, received) = channel();
            late.into_iter().for_each(|b| queue.send(b).unwrap_or(()));
            drop(queue);
            sums.extend(sum_each(&self.ranks, &received)?);
        }
        if let Some(e) = unread {
            return Err(e);
        }
        if sums.len() != self.buckets.len() {
            return Err(CollectiveError::Transport {
                rank,
                what: format!(
                    "{} of {} gradient buckets summed",
                    sums.len(),
                    self.buckets.len()
                ),
            }
            .into());
        }
        write(be, opt, &self.buckets, &sums)
    }
}

/// The buckets of `grads` (a model of `layers` layers) and the tower's buffers beyond
/// them (`lens`: every buffer's length): each layer's ranges, last layer first, then every
/// value no layer holds.
fn buckets<B: Backend>(grads: &Grads<B>, lens: &[usize], layers: usize) -> Vec<Vec<Range>> {
    let mut out: Vec<Vec<Range>> = (0..layers).rev().map(|l| grads.layer_ranges(l)).collect();
    // the rest: per buffer, the gaps between the layers' ranges
    let mut rest = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let mut taken: Vec<(usize, usize)> = out
            .iter()
            .flatten()
            .filter(|r| r.0 == i)
            .map(|r| (r.1, r.1 + r.2))
            .collect();
        taken.sort_unstable();
        let mut at = 0;
        for (start, end) in taken.into_iter().chain([(len, len)]) {
            if start > at {
                rest.push((i, at, start - at));
            }
            at = at.max(end);
        }
    }
    out.push(rest);
    out
}

/// Sums the buckets `received` over `ranks` in the order they come, until the queue closes.
fn sum_each(ranks: &Ranks, received: &Receiver<Bucket>) -> Result<Vec<Vec<f32>>, CollectiveError> {
    let mut out = Vec::new();
    for (mut values, holders) in received {
        match holders {
            Some(spans) => {
                let mut held = vec![0.0f32; values.len()];
                ranks.ordered_sum_held(std::slice::from_ref(&values), &spans, &mut held)?;
                out.push(held);
            }
            None => {
                ranks.all_reduce_sum(&mut values)?;
                out.push(values);
            }
        }
    }
    Ok(out)
}

/// Queues the sum over `ranks` of `ranges` (values as stored, held as `holders` say) in
/// place on their device, in one group, once `be`'s queued work is done.
fn queue_on_device<B: Backend>(
    be: &B,
    ranks: &Ranks,
    ranges: &[Stored<'_, B>],
    holders: &Holders,
) -> Result<(), TrainError> {
    be.synchronize()?;
    let queued: Vec<_> = ranges
        .iter()
        .enumerate()
        .map(|(j, &v)| {
            let root = match holders.as_ref().map(|h| h[j].1) {
                Some(Holder::Rank(r)) => Some(r),
                _ => None,
            };
            (v, root)
        })
        .collect();
    // SAFETY: nothing touches a finished layer's gradients (or, at the end, any) until
    // `finish` has waited for the sums (`Grads::watch_layers`' contract)
    match unsafe { ranks.queue_sum_device(&queued) } {
        Some(r) => Ok(r?),
        None => Err(CollectiveError::Transport {
            rank: ranks.rank(),
            what: "the transport cannot sum these gradients on their device".into(),
        }
        .into()),
    }
}

/// `len` values of `v` from `offset`.
fn sub_view<B: Backend>(
    v: Stored<'_, B>,
    offset: usize,
    len: usize,
) -> Result<Stored<'_, B>, TrainError> {
    Ok(match v {
        Stored::F32(v) => Stored::F32(View::new(v.buffer(), offset, len)?),
        Stored::Bf16(v) => Stored::Bf16(View::new(v.buffer(), offset, len)?),
    })
}

/// Reads `ranges` of `opt`'s gradients into `values`, one after another (bf16 ones
/// widened).
fn read<B: Backend>(
    be: &B,
    opt: &Optimizer<B>,
    ranges: &[Range],
    values: &mut [f32],
) -> Result<(), TrainError> {
    let mut at = 0;
    for &(i, offset, len) in ranges {
        super::read_grads(be, opt, (i, offset), &mut values[at..at + len])?;
        at += len;
    }
    Ok(())
}

/// Reads `views` into `values`, one after another (bf16 ones widened).
fn read_views<B: Backend>(
    be: &B,
    views: &[Stored<'_, B>],
    values: &mut [f32],
) -> Result<(), TrainError> {
    let mut at = 0;
    for v in views {
        v.download(be, &mut values[at..at + v.len()])?;
        at += v.len();
    }
    Ok(())
}

/// Writes each bucket's `sums` into its ranges of `opt`'s gradients (into bf16 ones
/// rounded to nearest).
fn write<B: Backend>(
    be: &B,
    opt: &mut Optimizer<B>,
    buckets: &[Vec<Range>],
    sums: &[Vec<f32>],
) -> Result<(), TrainError> {
    for (ranges, sum) in buckets.iter().zip(sums) {
        let mut at = 0;
        for &(i, offset, len) in ranges {
            super::write_grads(be, opt, (i, offset), &sum[at..at + len])?;
            at += len;
        }
    }
    Ok(())
}
