//! The vision tower's parameters, one table for every use: their Hugging Face names and
//! shapes ([`param_table`]), host tensors stacked over blocks ([`VisionWeights`]) and, in
//! `tower.rs`, the same slots as device buffers and gradients.
//!
//! Names are relative to the tower's prefix (`visual.` in Hub checkpoints, `model.visual.`
//! in transformers ≥ 4.52 ones). Per-block tensors (`blocks.{l}.…`) are stacked `[depth,
//! …]` in one tensor, llm.c style, and split back on save.

use std::collections::HashMap;

use super::config::{VisionConfig, VisionMlp};
use crate::hf::HfError;
use crate::hf::weights::Tensor;

/// One parameter of the tower. The discriminant indexes [`VisionParams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Slot {
    Patch,
    Norm1,
    Norm1Bias,
    Qkv,
    QkvBias,
    Proj,
    ProjBias,
    Norm2,
    Norm2Bias,
    MlpIn,
    MlpInBias,
    MlpUp,
    MlpUpBias,
    MlpOut,
    MlpOutBias,
    MergerNorm,
    MergerNormBias,
    Merger0,
    Merger0Bias,
    Merger2,
    Merger2Bias,
}

/// Number of [`Slot`]s.
pub const SLOTS: usize = 21;

impl Slot {
    /// Whether this is a linear layer's weight (one a LoRA pair can sit beside: the slots
    /// of the tower's LoRA targets, a test checks): the weights
    /// [`VisionTower::set_weight_storage`](super::tower::VisionTower::set_weight_storage)
    /// stores in bf16.
    pub fn is_linear(self) -> bool {
        matches!(
            self,
            Slot::Patch
                | Slot::Qkv
                | Slot::Proj
                | Slot::MlpIn
                | Slot::MlpUp
                | Slot::MlpOut
                | Slot::Merger0
                | Slot::Merger2
        )
    }

    /// Every slot, in checkpoint order.
    pub const ALL: [Slot; SLOTS] = [
        Slot::Patch,
        Slot::Norm1,
        Slot::Norm1Bias,
        Slot::Qkv,
        Slot::QkvBias,
        Slot::Proj,
        Slot::ProjBias,
        Slot::Norm2,
        Slot::Norm2Bias,
        Slot::MlpIn,
        Slot::MlpInBias,
        Slot::MlpUp,
        Slot::MlpUpBias,
        Slot::MlpOut,
        Slot::MlpOutBias,
        Slot::MergerNorm,
        Slot::MergerNormBias,
        Slot::Merger0,
        Slot::Merger0Bias,
        Slot::Merger2,
        Slot::Merger2Bias,
    ];
}

/// Where a parameter lives and its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// The slot.
    pub slot: Slot,
    /// Name relative to the tower's prefix; `{}` stands for the block index.
    pub name: &'static str,
    /// Whether there is one per block (stacked `[depth, shape…]`).
    pub per_block: bool,
    /// Shape of one block's tensor (or of the tensor).
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// Elements of one block's tensor.
    pub fn item(&self) -> usize {
        self.shape.iter().product()
    }

    /// The Hugging Face name of block `block`'s tensor (or of the tensor).
    pub fn hf_name(&self, block: usize) -> String {
        self.name.replace("{}", &block.to_string())
    }
}

/// The parameters a tower of `cfg` has, in checkpoint order.
pub fn param_table(cfg: &VisionConfig) -> Vec<ParamSpec> {
    let (h, i, m, out) = (
        cfg.hidden,
        cfg.intermediate,
        cfg.merged_dim(),
        cfg.out_hidden,
    );
    let ln = cfg.layer_norm();
    let swiglu = cfg.mlp == VisionMlp::SwiGlu;
    let (in_w, in_b, out_w, out_b) = if swiglu {
        (
            "blocks.{}.mlp.gate_proj.weight",
            "blocks.{}.mlp.gate_proj.bias",
            "blocks.{}.mlp.down_proj.weight",
            "blocks.{}.mlp.down_proj.bias",
        )
    } else {
        (
            "blocks.{}.mlp.fc1.weight",
            "blocks.{}.mlp.fc1.bias",
            "blocks.{}.mlp.fc2.weight",
            "blocks.{}.mlp.fc2.bias",
        )
    };
    let p = |slot, name: &'static str, per_block, shape: Vec<usize>, present: bool| {
        present.then_some(ParamSpec {
            slot,
            name,
            per_block,
            shape,
        })
    };
    let patch = vec![
        h,
        cfg.in_channels,
        cfg.temporal_patch_size,
        cfg.patch_size,
        cfg.patch_size,
    ];
    [
        p(Slot::Patch, "patch_embed.proj.weight", false, patch, true),
        p(Slot::Norm1, "blocks.{}.norm1.weight", true, vec![h], true),
        p(Slot::Norm1Bias, "blocks.{}.norm1.bias", true, vec![h], ln),
        p(
            Slot::Qkv,
            "blocks.{}.attn.qkv.weight",
            true,
            vec![3 * h, h],
            true,
        ),
        p(
            Slot::QkvBias,
            "blocks.{}.attn.qkv.bias",
            true,
            vec![3 * h],
            true,
        ),
        p(
            Slot::Proj,
            "blocks.{}.attn.proj.weight",
            true,
            vec![h, h],
            true,
        ),
        p(
            Slot::ProjBias,
            "blocks.{}.attn.proj.bias",
            true,
            vec![h],
            true,
        ),
        p(Slot::Norm2, "blocks.{}.norm2.weight", true, vec![h], true),
        p(Slot::Norm2Bias, "blocks.{}.norm2.bias", true, vec![h], ln),
        p(Slot::MlpIn, in_w, true, vec![i, h], true),
        p(Slot::MlpInBias, in_b, true, vec![i], true),
        p(
            Slot::MlpUp,
            "blocks.{}.mlp.up_proj.weight",
            true,
            vec![i, h],
            swiglu,
        ),
        p(
            Slot::MlpUpBias,
            "blocks.{}.mlp.up_proj.bias",
            true,
            vec![i],
            swiglu,
        ),
        p(Slot::MlpOut, out_w, true, vec![h, i], true),
        p(Slot::MlpOutBias, out_b, true, vec![h], true),
        p(Slot::MergerNorm, "merger.ln_q.weight", false, vec![h], true),
        p(Slot::MergerNormBias, "merger.ln_q.bias", false, vec![h], ln),
        p(
            Slot::Merger0,
            "merger.mlp.0.weight",
            false,
            vec![m, m],
            true,
        ),
        p(Slot::Merger0Bias, "merger.mlp.0.bias", false, vec![m], true),
        p(
            Slot::Merger2,
            "merger.mlp.2.weight",
            false,
            vec![out, m],
            true,
        ),
        p(
            Slot::Merger2Bias,
            "merger.mlp.2.bias",
            false,
            vec![out],
            true,
        ),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// One value per [`Slot`], `None` for slots the tower does not have (biases of RMSNorm,
/// the SwiGLU up projection of Qwen2-VL).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionParams<T> {
    items: Vec<Option<T>>,
}

impl<T> VisionParams<T> {
    /// Builds the slots of `table` with `make`.
    pub fn build<E>(
        table: &[ParamSpec],
        mut make: impl FnMut(&ParamSpec) -> Result<T, E>,
    ) -> Result<Self, E> {
        let mut items: Vec<Option<T>> = (0..SLOTS).map(|_| None).collect();
        for spec in table {
            items[spec.slot as usize] = Some(make(spec)?);
        }
        Ok(Self { items })
    }

    /// The value of `slot`, if the tower has it.
    pub fn get(&self, slot: Slot) -> Option<&T> {
        self.items[slot as usize].as_ref()
    }

    /// Every value the tower has, writable.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.items.iter_mut().flatten()
    }

    /// The value of `slot`, mutably.
    pub fn get_mut(&mut self, slot: Slot) -> Option<&mut T> {
        self.items[slot as usize].as_mut()
    }

    /// The values of two different slots, both mutably (a weight's and its bias's
    /// gradients); `None` if either is absent or `a == b`.
    pub fn pair_mut(&mut self, a: Slot, b: Slot) -> Option<(&mut T, &mut T)> {
        let (i, j) = (a as usize, b as usize);
        if i == j {
            return None;
        }
        let (lo, hi) = self.items.split_at_mut(i.max(j));
        let (x, y) = (lo[i.min(j)].as_mut()?, hi[0].as_mut()?);
        Some(if i < j { (x, y) } else { (y, x) })
    }

    /// Every present slot with its value, in checkpoint order.
    pub fn iter(&self) -> impl Iterator<Item = (Slot, &T)> {
        Slot::ALL
            .into_iter()
            .filter_map(|s| self.items[s as usize].as_ref().map(|t| (s, t)))
    }

    /// Every present slot with its value, mutably, in checkpoint order.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (Slot, &mut T)> {
        Slot::ALL
            .into_iter()
            .zip(self.items.iter_mut())
            .filter_map(|(s, t)| t.as_mut().map(|t| (s, t)))
    }
}

/// The tower's weights on the host: one f32 tensor per slot, per-block ones stacked
/// `[depth, …]`.
pub type VisionWeights = VisionParams<Tensor>;

/// The tower's parameters as `cfg` declares them (every slot of [`param_table`], blocks
/// stacked).
pub fn tower_parameters(cfg: &VisionConfig) -> u64 {
    parameters_of(cfg, |_| true)
}

/// The parameters of the tower's linear layers ([`Slot::is_linear`]): those stored in
/// bf16 under `trainer.weight_dtype: bf16`.
pub fn tower_linear_parameters(cfg: &VisionConfig) -> u64 {
    parameters_of(cfg, Slot::is_linear)
}

/// The parameters of one block of each linear layer (the whole tensor of one outside the
/// blocks): the one-block f32 scratch of the tower's gradients kept in bf16.
pub fn tower_linear_block_parameters(cfg: &VisionConfig) -> u64 {
    param_table(cfg)
        .iter()
        .filter(|spec| spec.slot.is_linear())
        .map(|spec| spec.item() as u64)
        .sum()
}

/// The parameters of the slots `keep` picks.
fn parameters_of(cfg: &VisionConfig, keep: impl Fn(Slot) -> bool) -> u64 {
    param_table(cfg)
        .iter()
        .filter(|spec| keep(spec.slot))
        .map(|spec| {
            let blocks = if spec.per_block { cfg.depth } else { 1 };
            (blocks * spec.item()) as u64
        })
        .sum()
}

impl VisionWeights {
    /// Collects the tower's tensors from `take` (called with each Hugging Face name
    /// relative to the prefix, and the expected shape), stacking blocks.
    ///
    /// # Errors
    /// Whatever `take` reports (a missing tensor, a wrong shape).
    pub fn collect(
        cfg: &VisionConfig,
        mut take: impl FnMut(&str, &[usize]) -> Result<Vec<f32>, HfError>,
    ) -> Result<Self, HfError> {
        let table = param_table(cfg);
        Self::build(&table, |spec| {
            if !spec.per_block {
                let data = take(&spec.hf_name(0), &spec.shape)?;
                return Ok(Tensor {
                    shape: spec.shape.clone(),
                    data,
                });
            }
            let mut data = Vec::with_capacity(cfg.depth * spec.item());
            for l in 0..cfg.depth {
                data.extend(take(&spec.hf_name(l), &spec.shape)?);
            }
            let mut shape = vec![cfg.depth];
            shape.extend(&spec.shape);
            Ok(Tensor { shape, data })
        })
    }

    /// Every tensor with its Hugging Face name (relative to the prefix), blocks split, in
    /// checkpoint order.
    pub fn named(&self, cfg: &VisionConfig) -> Vec<(String, Vec<usize>, &[f32])> {
        let mut out = Vec::new();
        for spec in param_table(cfg) {
            let Some(t) = self.get(spec.slot) else {
                continue;
            };
            if spec.per_block {
                for (l, chunk) in t.data.chunks(spec.item()).enumerate() {
                    out.push((spec.hf_name(l), spec.shape.clone(), chunk));
                }
            } else {
                out.push((spec.hf_name(0), spec.shape.clone(), t.data.as_slice()));
            }
        }
        out
    }

    /// Random weights for tests and demos: normal(0, `std`) matrices, zero biases, unit
    /// norm weights, from a xorshift stream of `seed`.
    pub fn random(cfg: &VisionConfig, std: f32, seed: u64) -> Self {
        let mut state = seed | 1;
        let mut next = move || {
            // xorshift64*, then Box–Muller on two uniforms
            let mut u = || {
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                ((state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5)
                    / (1u64 << 53) as f64
            };
            let (a, b) = (u(), u());
            ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
        };
        let table = param_table(cfg);
        let built: Result<Self, std::convert::Infallible> = Self::build(&table, |spec| {
            let blocks = if spec.per_block { cfg.depth } else { 1 };
            let n = blocks * spec.item();
            let is_norm = matches!(spec.slot, Slot::Norm1 | Slot::Norm2 | Slot::MergerNorm);
            let data = if is_norm {
                vec![1.0; n]
            } else if spec.shape.len() == 1 {
                vec![0.0; n]
            } else {
                (0..n).map(|_| std * next()).collect()
            };
            let mut shape = if spec.per_block {
                vec![cfg.depth]
            } else {
                Vec::new()
            };
            shape.extend(&spec.shape);
            Ok(Tensor { shape, data })
        });
        match built {
            Ok(w) => w,
            Err(e) => match e {},
        }
    }
}

/// Takes tensors out of a name → tensor map, checking shapes (for [`VisionWeights::collect`]).
pub(crate) fn take_from(
    map: &mut HashMap<String, Tensor>,
    prefix: &str,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>, HfError> {
    let full = format!("{prefix}{name}");
    let t = map.remove(&full).ok_or_else(|| HfError::InvalidWeights {
        tensor: full.clone(),
        message: "missing".into(),
    })?;
    if t.shape != shape {
        return Err(HfError::InvalidWeights {
            tensor: full,
            message: format!("shape {:?}, expected {shape:?}", t.shape),
        });
    }
    Ok(t.data)
}
