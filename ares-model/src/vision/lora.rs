//! LoRA on the vision tower: a pair `A` `[r, in]`, `B` `[out, r]` on any of the tower's
//! linear layers — the fused `attn.qkv`, `attn.proj`, the MLP's (`fc1`/`fc2`, or SwiGLU's
//! `gate_proj`/`up_proj`/`down_proj`), the merger's `mlp.0`/`mlp.2` — and on the patch
//! embedding (a Conv3d with stride = kernel, i.e. a linear layer over flattened patches,
//! which is how PEFT's conv pair computes too). Each pair computes what the decoder's do
//! (`model/lora.rs`, `PairShape`): `y += s·(x·Aᵀ)·Bᵀ`, the base frozen. The fused qkv
//! pair has one `A` and a `B` `[3h, r]` whose row blocks feed q, k and v: the tower runs
//! the three parts as three linear layers, so its pair's `u` is computed once and each
//! part adds `s·u·B_partᵀ`.
//!
//! Per-block targets stack their pairs over blocks like the weights; the patch embedding
//! and the merger hold one pair. Fresh pairs follow PEFT's default (`A` uniform on `±1/√in`,
//! `B = 0`), so a fresh adapter changes nothing; with the adapters off
//! ([`super::model::VlModel::adapters_off`]) the tower is the base tower, bit for bit.

use std::sync::atomic::AtomicBool;

use super::config::VisionConfig;
use super::weights::{Slot, param_table};
use crate::backend::{Backend, DeviceBuffer, Tensor, View};
use crate::hf::lora::{LoraConfig, TOWER, tower_module};
use crate::model::ModelError;
use crate::model::lora::{LoraParams, PairStack};
use crate::model::weights::Stack;

/// A tower module a pair can sit on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TowerTarget {
    Patch,
    Qkv,
    Proj,
    MlpIn,
    MlpUp,
    MlpOut,
    Merger0,
    Merger2,
}

/// Number of [`TowerTarget`]s.
pub(crate) const TOWER_TARGETS: usize = 8;

impl TowerTarget {
    pub(crate) const ALL: [Self; TOWER_TARGETS] = [
        Self::Patch,
        Self::Qkv,
        Self::Proj,
        Self::MlpIn,
        Self::MlpUp,
        Self::MlpOut,
        Self::Merger0,
        Self::Merger2,
    ];

    /// The weight slot the pair sits beside.
    pub(crate) fn slot(self) -> Slot {
        match self {
            Self::Patch => Slot::Patch,
            Self::Qkv => Slot::Qkv,
            Self::Proj => Slot::Proj,
            Self::MlpIn => Slot::MlpIn,
            Self::MlpUp => Slot::MlpUp,
            Self::MlpOut => Slot::MlpOut,
            Self::Merger0 => Slot::Merger0,
            Self::Merger2 => Slot::Merger2,
        }
    }

    /// Whether each block has one (else the tower has one).
    pub(crate) fn per_block(self) -> bool {
        !matches!(self, Self::Patch | Self::Merger0 | Self::Merger2)
    }

    /// `(in, out)` features.
    pub(crate) fn in_out(self, c: &VisionConfig) -> (usize, usize) {
        let (h, i, m) = (c.hidden, c.intermediate, c.merged_dim());
        match self {
            Self::Patch => (c.patch_dim(), h),
            Self::Qkv => (h, 3 * h),
            Self::Proj => (h, h),
            Self::MlpIn | Self::MlpUp => (h, i),
            Self::MlpOut => (i, h),
            Self::Merger0 => (m, m),
            Self::Merger2 => (m, c.out_hidden),
        }
    }

    /// Output features of one part: `hidden` for the fused qkv (its q, k and v are run as
    /// three products), else all of them.
    pub(crate) fn part_out(self, c: &VisionConfig) -> usize {
        match self {
            Self::Qkv => c.hidden,
            _ => self.in_out(c).1,
        }
    }

    /// Its module path (block index left out: `attn.qkv`) and parameter name
    /// (`blocks.{}.attn.qkv.weight`) in a tower of `cfg`, `None` when the tower has no such
    /// layer (the SwiGLU up projection of Qwen2-VL).
    pub(crate) fn names(self, cfg: &VisionConfig) -> Option<(&'static str, &'static str)> {
        let spec = param_table(cfg)
            .into_iter()
            .find(|s| s.slot == self.slot())?;
        Some((tower_module(&spec)?, spec.name))
    }

    /// Pairs of this target: `depth` or 1.
    pub(crate) fn count(self, cfg: &VisionConfig) -> usize {
        if self.per_block() { cfg.depth } else { 1 }
    }

    /// The name of block `l`'s adapted weight as [`LoraAdapter::pairs`] keys it.
    pub(crate) fn weight_name(self, cfg: &VisionConfig, l: usize) -> Option<String> {
        let (_, name) = self.names(cfg)?;
        Some(format!("{TOWER}{}", name.replace("{}", &l.to_string())))
    }
}

/// The tower's adapters: configuration, scale, pairs, and whether the passes apply them.
pub(crate) struct TowerLora<B: Backend> {
    pub(crate) config: LoraConfig,
    pub(crate) scale: f32,
    pub(crate) params: LoraParams<B, TOWER_TARGETS>,
    pub(crate) enabled: AtomicBool,
}

impl<B: Backend> std::fmt::Debug for TowerLora<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TowerLora")
            .field("config", &self.config)
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

/// The intermediates of the tower's pairs in one pass: `u = x·Aᵀ` per adapted target and
/// kept slot, and the backward pass's scratch.
pub(crate) struct TowerLoraActs<B: Backend> {
    pub(crate) u: [Option<Stack<B>>; TOWER_TARGETS],
    pub(crate) tmp: B::Buffer,
    pub(crate) du: B::Buffer,
    /// Whether the last forward pass applied the adapters (its backward must).
    pub(crate) applied: bool,
}

impl<B: Backend> std::fmt::Debug for TowerLoraActs<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TowerLoraActs")
            .field("applied", &self.applied)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> TowerLoraActs<B> {
    /// Floats held.
    pub(crate) fn elements(&self) -> usize {
        self.u.iter().flatten().map(Stack::len).sum::<usize>() + self.tmp.len() + self.du.len()
    }
}

/// Rows a target's pair sees in a call over `patches` patches and `units` merged tokens.
pub(crate) fn rows(t: TowerTarget, patches: usize, units: usize) -> usize {
    match t {
        TowerTarget::Merger0 | TowerTarget::Merger2 => units,
        _ => patches,
    }
}

/// The lengths of a call's LoRA intermediates: per adapted target its `u` stack (`total`,
/// `item` = rows · r), and the two scratch buffers (`tmp`: the widest rows · part out of
/// one product, `du`: the most rows · r).
pub(crate) struct ArenaLayout {
    pub(crate) u: [Option<(usize, usize)>; TOWER_TARGETS],
    pub(crate) tmp: usize,
    pub(crate) du: usize,
}

impl ArenaLayout {
    /// The layout for the targets `adapted` says, rank `r`, over `patches` patches and
    /// `units` merged tokens with `blocks` block slots kept.
    pub(crate) fn new(
        cfg: &VisionConfig,
        r: usize,
        adapted: impl Fn(TowerTarget) -> bool,
        patches: usize,
        units: usize,
        blocks: usize,
    ) -> Self {
        let mut u = [None; TOWER_TARGETS];
        let (mut tmp, mut widest) = (0, 0);
        for t in TowerTarget::ALL.into_iter().filter(|&t| adapted(t)) {
            let n = rows(t, patches, units);
            let slots = if t.per_block() { blocks } else { 1 };
            u[t as usize] = Some((slots * n * r, n * r));
            tmp = tmp.max(n * t.part_out(cfg));
            widest = widest.max(n);
        }
        Self {
            u,
            tmp,
            du: widest * r,
        }
    }
}

/// Floats of the tower's LoRA intermediates for `patches` patches, `units` merged tokens
/// and `blocks` kept block slots, under `config` — what the arena allocates beside
/// [`super::tower::tower_arena_bytes`]' buffers (the memory plan counts both).
pub fn tower_lora_elements(
    cfg: &VisionConfig,
    config: &LoraConfig,
    patches: u64,
    units: u64,
    blocks: u64,
) -> u64 {
    let adapted = |t: TowerTarget| t.names(cfg).is_some_and(|(p, _)| config.adapts_tower(p));
    let l = ArenaLayout::new(
        cfg,
        config.r,
        adapted,
        patches as usize,
        units as usize,
        blocks as usize,
    );
    (l.u.iter().flatten().map(|&(total, _)| total).sum::<usize>() + l.tmp + l.du) as u64
}

/// Elements of each LoRA tensor `config` puts on a tower of `cfg`, as the optimizer holds
/// them: per adapted module its `A` stacked over blocks, then its `B` (the memory plan's
/// figure).
pub fn tower_lora_tensors(cfg: &VisionConfig, config: &LoraConfig) -> Vec<usize> {
    let r = config.r;
    let mut out = Vec::new();
    for t in TowerTarget::ALL {
        let Some((path, _)) = t.names(cfg) else {
            continue;
        };
        if config.adapts_tower(path) {
            let (inp, o) = t.in_out(cfg);
            let n = t.count(cfg);
            out.extend([n * r * inp, n * o * r]);
        }
    }
    out
}

/// Rows `part·h..(part+1)·h` of block `l`'s qkv `B` (`[3h, r]`), or the whole `B` of
/// another target.
pub(crate) fn b_part<'p, B: Backend>(
    p: &'p PairStack<B>,
    t: TowerTarget,
    l: usize,
    part: usize,
    cfg: &VisionConfig,
    r: usize,
) -> Result<Tensor<'p, B>, ModelError> {
    if t != TowerTarget::Qkv {
        return p.b.layer(l);
    }
    let len = cfg.hidden * r;
    Ok(View::new(p.b.buffer(), l * p.b.item() + part * len, len)?)
}

#[cfg(test)]
mod tests {
    use super::TowerTarget;
    use crate::vision::weights::Slot;

    /// The linear slots (those stored in bf16) are exactly the LoRA targets' slots.
    #[test]
    fn linear_slots_are_the_targets_slots() {
        for slot in Slot::ALL {
            let target = TowerTarget::ALL.into_iter().any(|t| t.slot() == slot);
            assert_eq!(slot.is_linear(), target, "{slot:?}");
        }
    }
}
