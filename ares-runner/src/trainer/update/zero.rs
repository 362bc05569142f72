//! ZeRO-1 (`trainer.zero_stage: 1`): each rank of a data-parallel run keeps the AdamW
//! moments of its share of the trainable buffers ([`crate::parallel::shares`]), updates
//! those buffers alone and sends them to the others; a checkpoint gathers every rank's
//! moments so `optimizer.safetensors` is the whole optimizer's, as without sharding.
//!
//! The update is elementwise and the gradient norm is taken over every buffer on every
//! rank, so a sharded step gives the bits of an unsharded one.

use crate::backend::{Backend, Stored};
use crate::model::{AdamW, Grads, HostMoment, Model, ModelError, TrainableMut};
use crate::parallel::wire::{Reader, WireError, Writer};
use crate::parallel::{Holder, Ranks, shares};
use crate::trainer::TrainError;

/// Who needs each gradient buffer's sum under ZeRO-1 (`None` without sharding, or alone):
/// `(len, holder)` for the language model's buffers — their owner, as the run sharded them
/// ([`shares`]) — then the tower's `tower` lengths, held by every rank (its moments are).
pub fn gradient_spans<B: Backend>(
    ranks: &Ranks,
    adamw: &AdamW<B>,
    grads: &Grads<B>,
    tower: &[usize],
) -> Option<Vec<(usize, Holder)>> {
    adamw.owned()?;
    if ranks.world() < 2 {
        return None;
    }
    // every buffer's length, one stored in bf16 too: the shares the optimizer made
    let sizes = grads.lens();
    let owners = shares(&sizes, ranks.world());
    let mut spans: Vec<(usize, Holder)> = sizes
        .iter()
        .zip(owners)
        .map(|(&n, r)| (n, Holder::Rank(r)))
        .collect();
    spans.extend(tower.iter().map(|&n| (n, Holder::All)));
    Some(spans)
}

/// The gradients' `Σ g²` in the global norm's order, each from the rank that holds its
/// summed buffer: this rank's own ([`AdamW::grad_sums`]) completed by the owners' —
/// so every rank folds the same values in the same order, the unsharded norm's bits.
///
/// # Errors
/// A collective or backend failure; a buffer no rank reported.
pub fn gather_grad_sums<B: Backend>(
    ranks: &Ranks,
    model: &Model<B>,
    adamw: &AdamW<B>,
    grads: &Grads<B>,
    tower: &[Stored<'_, B>],
) -> Result<Vec<f64>, TrainError> {
    let mut sums = adamw.grad_sums(model, grads, tower)?;
    let lm = grads.buffers().len();
    let mut w = Writer::default();
    for (i, s) in sums.iter().enumerate().take(lm) {
        if let Some(s) = s {
            w.u64(i as u64);
            w.f64(*s);
        }
    }
    let all = ranks.all_gather(w.finish())?;
    let bad = |e: WireError| TrainError::from(e.at(ranks.rank()));
    for bytes in &all {
        let mut r = Reader::new(bytes);
        while r.end().is_err() {
            let i = usize::try_from(r.u64().map_err(bad)?).unwrap_or(usize::MAX);
            let v = r.f64().map_err(bad)?;
            match sums.get_mut(i) {
                Some(slot) if i < lm => *slot = Some(v),
                _ => return Err(bad(WireError(format!("a gradient sum of buffer {i}")))),
            }
        }
    }
    sums.into_iter()
        .enumerate()
        .map(|(i, s)| {
            s.ok_or_else(|| {
                TrainError::Internal(format!("no rank reported the gradient sum of buffer {i}"))
            })
        })
        .collect()
}

/// Sends the buffers this rank's optimizer updated to every rank and writes the others'
/// into `model` (after an applied step): broadcast from each owner on the device where the
/// transport can (NCCL), else through the host.
///
/// # Errors
/// A collective or backend failure; owners other than the optimizer's.
pub fn share_updated<B: Backend>(
    ranks: &Ranks,
    model: &mut Model<B>,
    owned: &[bool],
) -> Result<(), TrainError> {
    let sizes = model.trainable_lens();
    let owners = shares(&sizes, ranks.world());
    if owners.len() != owned.len()
        || owners
            .iter()
            .zip(owned)
            .any(|(&r, &o)| (r == ranks.rank()) != o)
    {
        return Err(TrainError::Internal(
            "ZeRO-1: the optimizer's shard is not the run's".into(),
        ));
    }
    // the optimizer's kernels first (NCCL runs on its own stream)
    model.backend().synchronize()?;
    let mut sent = None;
    // on the device each buffer as it is stored (bf16 weights as their bits)
    model.write_trainable_on_device(|buffers| {
        let mut items: Vec<_> = buffers
            .iter_mut()
            .map(|b| match b {
                TrainableMut::F32(b) => TrainableMut::F32(&mut **b),
                TrainableMut::Bf16(h) => TrainableMut::Bf16(&mut **h),
            })
            .zip(owners.iter().copied())
            .collect();
        sent = ranks.broadcast_device::<B>(&mut items);
        // on the device every buffer another rank owns was written
        Ok(match &sent {
            Some(Ok(())) => (0..owners.len()).filter(|&b| !owned[b]).collect(),
            _ => Vec::new(),
        })
    })?;
    if let Some(r) = sent {
        return Ok(r?);
    }
    // through the host: f32 values, or a bf16-stored weight's bits (half the bytes)
    let mut w = Writer::default();
    for (b, _) in owned.iter().enumerate().filter(|(_, o)| **o) {
        w.u64(b as u64);
        match model.read_trainable_bits(b)? {
            Some(bits) => {
                w.u8(1);
                w.bytes(
                    &bits
                        .iter()
                        .flat_map(|h| h.to_le_bytes())
                        .collect::<Vec<u8>>(),
                );
            }
            None => {
                w.u8(0);
                w.f32s(&model.read_trainable(b)?);
            }
        }
    }
    let all = ranks.all_gather(w.finish())?;
    let bad = |e: WireError| TrainError::from(e.at(ranks.rank()));
    for (r, bytes) in all.iter().enumerate() {
        if r == ranks.rank() {
            continue;
        }
        let mut reader = Reader::new(bytes);
        while reader.end().is_err() {
            let b = usize::try_from(reader.u64().map_err(bad)?).unwrap_or(usize::MAX);
            match reader.u8().map_err(bad)? {
                0 => model.write_trainable(b, &reader.f32s().map_err(bad)?)?,
                _ => {
                    let raw = reader.bytes().map_err(bad)?;
                    let bits: Vec<u16> = raw
                        .chunks_exact(2)
                        .map(|p| u16::from_le_bytes([p[0], p[1]]))
                        .collect();
                    model.write_trainable_bits(b, &bits)?;
                }
            }
        }
    }
    Ok(())
}

/// Every rank's moments, for rank 0 to save: `(buffer, item) → [first, second]`.
pub type Gathered = std::collections::HashMap<(usize, usize), [HostMoment; 2]>;

/// Gathers the moments every rank's optimizer holds (every rank calls it).
///
/// # Errors
/// A collective or backend failure.
pub fn gather_moments<B: Backend>(
    ranks: &Ranks,
    model: &Model<B>,
    adamw: &AdamW<B>,
) -> Result<Gathered, TrainError> {
    let mut w = Writer::default();
    for (buffer, item, moments) in adamw.owned_moments(model)? {
        w.u64(buffer as u64);
        w.u64(item as u64);
        for m in &moments {
            encode_moment(&mut w, m);
        }
    }
    let all = ranks.all_gather(w.finish())?;
    let bad = |e: WireError| TrainError::from(e.at(ranks.rank()));
    let mut out = Gathered::new();
    for bytes in &all {
        let mut r = Reader::new(bytes);
        while r.end().is_err() {
            let at = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
            let (buffer, item) = (at(r.u64().map_err(bad)?), at(r.u64().map_err(bad)?));
            let first = decode_moment(&mut r).map_err(bad)?;
            let second = decode_moment(&mut r).map_err(bad)?;
            out.insert((buffer, item), [first, second]);
        }
    }
    Ok(out)
}

/// Moments of `(buffer, item)` from `gathered` (for [`AdamW::save_with`]).
///
/// # Errors
/// A tensor no rank sent.
pub fn from_gathered(
    gathered: &Gathered,
    buffer: usize,
    item: usize,
) -> Result<[HostMoment; 2], ModelError> {
    gathered
        .get(&(buffer, item))
        .cloned()
        .ok_or(ModelError::LayoutMismatch {
            what: "optimizer moments (no rank holds this tensor's)",
        })
}

fn encode_moment(w: &mut Writer, m: &HostMoment) {
    match m {
        HostMoment::F32(x) => {
            w.u8(0);
            w.f32s(x);
        }
        HostMoment::Bf16(x) => {
            w.u8(1);
            w.u32s(&x.iter().map(|&h| u32::from(h)).collect::<Vec<u32>>());
        }
        HostMoment::Int8 { codes, absmax } => {
            w.u8(2);
            w.bytes(codes);
            w.f32s(absmax);
        }
    }
}

fn decode_moment(r: &mut Reader<'_>) -> Result<HostMoment, WireError> {
    Ok(match r.u8()? {
        0 => HostMoment::F32(r.f32s()?),
        1 => HostMoment::Bf16(
            r.u32s()?
                .into_iter()
                .map(|h| u16::try_from(h).map_err(|_| WireError("a bf16 out of range".into())))
                .collect::<Result<_, _>>()?,
        ),
        2 => HostMoment::Int8 {
            codes: r.bytes()?.to_vec(),
            absmax: r.f32s()?,
        },
        k => return Err(WireError(format!("moment kind {k}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_round_trip_in_every_dtype() {
        let ms = [
            HostMoment::F32(vec![1.5, -0.0, f32::MIN_POSITIVE]),
            HostMoment::Bf16(vec![0, 0x3f80, u16::MAX]),
            HostMoment::Int8 {
                codes: vec![0, 7, 255],
                absmax: vec![0.25],
            },
        ];
        let mut w = Writer::default();
        for m in &ms {
            encode_moment(&mut w, m);
        }
        let bytes = w.finish();
        let mut r = Reader::new(&bytes);
        for m in &ms {
            assert_eq!(&decode_moment(&mut r).unwrap(), m);
        }
        r.end().unwrap();
    }
}
