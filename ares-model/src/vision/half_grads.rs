//! The vision tower's linear weight gradients stored in bf16 (`trainer.grad_dtype: bf16`),
//! as the decoder's are (`model/half_grads.rs`): patch embedding, qkv, projection, MLP and
//! merger weights keep bf16 buffers (every block), their f32 buffers empty; norms and
//! biases stay f32. A block's backward writes each weight gradient into a one-block f32
//! scratch (written over by its products) and folds it into the bf16 buffer with
//! [`Backend::accumulate_bf16_stochastic`], keyed by the optimizer's seed and step, the
//! pass, the slot and the block — so an accumulation over micro-batches stays unbiased and
//! a resumed run draws the same bits.

use super::weights::{ParamSpec, Slot, VisionParams};
use crate::backend::{Backend, DType, DeviceBuffer, View, ViewMut};
use crate::model::ModelError;
use crate::model::PassKeys;

/// The rounding keys' domain: the decoder's passes use `usize::MAX`.
const TOWER_DOMAIN: usize = usize::MAX - 1;

/// The tower's bf16 gradient buffers and the scratch a block's backward writes first.
pub(crate) struct TowerHalfGrads<B: Backend> {
    /// Each linear slot's gradient over every block, bf16.
    halves: VisionParams<B::Half>,
    /// Each linear slot's gradient of one block, f32.
    scratch: VisionParams<B::Buffer>,
    /// The rounding keys (`VisionGrads::set_rounding`, `set_rounding_pass`).
    pub(crate) keys: PassKeys,
}

impl<B: Backend> TowerHalfGrads<B> {
    /// Zeroed bf16 gradients (and their scratch) of the linear slots of `table`, `depth`
    /// blocks.
    pub(crate) fn new(be: &B, table: &[ParamSpec], depth: usize) -> Result<Self, ModelError> {
        let linear: Vec<ParamSpec> = table
            .iter()
            .filter(|s| s.slot.is_linear())
            .cloned()
            .collect();
        let halves = VisionParams::build(&linear, |spec| {
            let blocks = if spec.per_block { depth } else { 1 };
            Ok::<_, ModelError>(be.alloc_half(blocks * spec.item(), DType::Bf16)?)
        })?;
        let scratch =
            VisionParams::build(&linear, |spec| Ok::<_, ModelError>(be.alloc(spec.item())?))?;
        Ok(Self {
            halves,
            scratch,
            keys: PassKeys::default(),
        })
    }

    /// The bf16 gradient of `slot`, if it is a linear slot of the tower.
    pub(crate) fn get(&self, slot: Slot) -> Option<&B::Half> {
        self.halves.get(slot)
    }

    /// Every linear slot's bf16 gradient, writable, in checkpoint order.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (Slot, &mut B::Half)> {
        self.halves.iter_mut()
    }

    /// The one-block f32 scratch of `slot`.
    pub(crate) fn scratch_mut(&mut self, slot: Slot) -> Result<&mut B::Buffer, ModelError> {
        self.scratch
            .get_mut(slot)
            .ok_or(ModelError::LayoutMismatch {
                what: "vision tower bf16 gradient scratch",
            })
    }

    /// Adds `slot`'s scratch into block `block` of its bf16 gradient, rounding
    /// stochastically.
    pub(crate) fn fold(&mut self, be: &B, slot: Slot, block: usize) -> Result<(), ModelError> {
        let key = self.keys.key(TOWER_DOMAIN, slot as usize, block);
        let missing = || ModelError::LayoutMismatch {
            what: "vision tower bf16 gradient",
        };
        let scratch = self.scratch.get(slot).ok_or_else(missing)?;
        let half = self.halves.get_mut(slot).ok_or_else(missing)?;
        let item = scratch.len();
        let dst = ViewMut::item(half, block, item)?;
        be.accumulate_bf16_stochastic(View::whole(scratch), key, dst)?;
        Ok(())
    }

    /// Bytes of the bf16 gradients and the scratch.
    pub(crate) fn bytes(&self) -> u64 {
        let halves: u64 = self.halves.iter().map(|(_, h)| 2 * h.len() as u64).sum();
        let scratch: u64 = self.scratch.iter().map(|(_, s)| 4 * s.len() as u64).sum();
        halves + scratch
    }
}
