//! ZeRO-1 (`trainer.zero_stage: 1`): each rank of a data-parallel run keeps the AdamW
//! moments of its share of the trainable buffers ([`crate::parallel::shares`]), updates
//! those buffers alone and sends them to the others; a checkpoint gathers every rank's
//! moments so `optimizer.safetensors` is the whole optimizer's, as without sharding.
//!
//! The update is elementwise and the gradient norm is taken over every buffer on every
//! rank, so a sharded step gives the bits of an unsharded one.

use crate::backend::Backend;
use crate::model::{AdamW, HostMoment, Model, ModelError};
use crate::parallel::Ranks;
use crate::parallel::wire::{Reader, WireError, Writer};
use crate::trainer::TrainError;

/// Sends the buffers this rank's optimizer updated to every rank and writes the others'
/// into `model` (after an applied step).
///
/// # Errors
/// A collective or backend failure.
pub fn share_updated<B: Backend>(
    ranks: &Ranks,
    model: &mut Model<B>,
    owned: &[bool],
) -> Result<(), TrainError> {
    let mut w = Writer::default();
    for (b, _) in owned.iter().enumerate().filter(|(_, o)| **o) {
        w.u64(b as u64);
        w.f32s(&model.read_trainable(b)?);
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
            let values = reader.f32s().map_err(bad)?;
            model.write_trainable(b, &values)?;
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
