//! The vision tower of Qwen2-VL and Qwen2.5-VL on a [`Backend`], forward and hand-written
//! backward, read top to bottom like the decoder (`model/forward.rs`):
//!
//! ```text
//! x = pixels · W_patchᵀ                                 (the Conv3d: stride = kernel)
//! per block:  n1 = Norm(x);  q, k, v = n1·W_qkvᵀ + b    (rows of the fused qkv weight)
//!             q, k = rope2d(q), rope2d(k)               (h and w positions, a quarter of
//!                                                        the head each, rotate-half)
//!             a = attention within segments(q, k, v)    (one frame, or one window)
//!             x = x + a·W_projᵀ + b
//!             n2 = Norm(x);  x = x + MLP(n2)            (QuickGELU fc1/fc2, or SwiGLU)
//! merger:     y = Norm(x) viewed [tokens/m², m²·C];  out = GELU(y·W0ᵀ + b0)·W2ᵀ + b2
//! ```
//!
//! Norm is LayerNorm for Qwen2-VL and RMSNorm for Qwen2.5-VL (eps 1e-6 both). Qwen2.5-VL
//! attends within windows of `window_size` pixels except in `fullatt_block_indexes`; its
//! patches are put in window order before the tower (the merge units of each window
//! contiguous, [`VisionPlan`]), so a window is a segment, and the merged rows come out in
//! that order: [`VisionPlan::unit_order`] maps them back. Full attention is per frame, as
//! transformers' `cu_seqlens`.
//!
//! Everything the backward needs is kept when the arena is planned for training
//! ([`VisionTower::activations`] with `keep = true`); inference keeps one block's activations.

use super::config::{VisionConfig, VisionMlp, VlKind};
use super::half_grads::TowerHalfGrads;
use super::lora::{TOWER_TARGETS, TowerLora, TowerLoraActs, TowerTarget};
use super::mrope::tokens_per_grid;
use super::weights::{Slot, VisionParams, VisionWeights, param_table};
use crate::backend::DType;
use crate::backend::{
    Activation, Backend, DeviceBuffer, GradWrite, GradWrites, LinearDims, MatmulPrecision,
    SegmentAttentionDims, Stored, Tensor, TensorMut, View, ViewMut,
};
use crate::model::lora::LoraParams;
use crate::model::weights::HalfStack;
use crate::model::{
    Act, ActMut, ActStack, ActivationDtype, GradDtype, ModelError, TrainableMut, WeightStorage,
};

/// Epsilon of every norm of the tower (transformers hard-codes 1e-6).
const EPS: f32 = 1e-6;

/// Host-side layout of one tower call: token order, segments and rotary tables.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionPlan {
    /// Patches (rows of `pixel_values`).
    pub patches: usize,
    /// Merged tokens, `patches / spatial_merge_size²`.
    pub units: usize,
    /// Merge unit of each position in tower order: the tower's merged row `j` is the
    /// processor's merged token `unit_order[j]` (identity for Qwen2-VL).
    pub unit_order: Vec<u32>,
    /// Segment bounds of full attention (one per frame), `[frames + 1]`.
    pub cu_full: Vec<u32>,
    /// Segment bounds of window attention (Qwen2.5-VL; equals `cu_full` for Qwen2-VL).
    pub cu_window: Vec<u32>,
    /// Rotary cos / sin `[patches, head_dim/2]`, in tower order.
    pub cos: Vec<f32>,
    /// See `cos`.
    pub sin: Vec<f32>,
}

pub(crate) fn input_error(message: impl Into<String>) -> ModelError {
    ModelError::VisionInput {
        message: message.into(),
    }
}

impl VisionPlan {
    /// The plan of the grids `[t, h, w]` (patches, before the merge) of the images and
    /// videos of one call, in the order their patches are stacked.
    ///
    /// # Errors
    /// No grid, a grid with a zero side or a side not a multiple of `spatial_merge_size`,
    /// or more patches than `u32` indexes.
    pub fn new(cfg: &VisionConfig, grids: &[[usize; 3]]) -> Result<Self, ModelError> {
        let m = cfg.spatial_merge_size;
        let unit = m * m;
        if grids.is_empty() {
            return Err(input_error("no image or video grid"));
        }
        let mut patches = 0usize;
        for (i, &g) in grids.iter().enumerate() {
            let n =
                tokens_per_grid(g, m).map_err(|e| input_error(format!("grid {i} {g:?}: {e}")))?;
            patches = patches
                .checked_add(n * unit)
                .filter(|&p| p <= u32::MAX as usize)
                .ok_or_else(|| input_error("more patches than u32 indexes"))?;
        }
        let units = patches / unit;
        let mut unit_order = Vec::with_capacity(units);
        let (mut cu_full, mut cu_window) = (vec![0u32], vec![0u32]);
        let mut base = 0usize;
        let window = (cfg.window_size / m / cfg.patch_size).max(1);
        for &[t, h, w] in grids {
            let (lh, lw) = (h / m, w / m);
            for frame in 0..t {
                let first = base + frame * lh * lw;
                cu_full.push(cu_full[cu_full.len() - 1] + (h * w) as u32);
                if cfg.kind == VlKind::Qwen2Vl {
                    unit_order.extend((first..first + lh * lw).map(|u| u as u32));
                    continue;
                }
                // windows of `window × window` units, row-major, the last ones partial
                for wr in (0..lh).step_by(window) {
                    for wc in (0..lw).step_by(window) {
                        let before = unit_order.len();
                        for r in wr..(wr + window).min(lh) {
                            for c in wc..(wc + window).min(lw) {
                                unit_order.push((first + r * lw + c) as u32);
                            }
                        }
                        let len = ((unit_order.len() - before) * unit) as u32;
                        cu_window.push(cu_window[cu_window.len() - 1] + len);
                    }
                }
            }
            base += t * lh * lw;
        }
        if cfg.kind == VlKind::Qwen2Vl {
            cu_window = cu_full.clone();
        }
        let (cos, sin) = rope_tables(cfg, grids, &unit_order, patches)?;
        Ok(Self {
            patches,
            units,
            unit_order,
            cu_full,
            cu_window,
            cos,
            sin,
        })
    }

    /// `pixel_values` `[patches, patch_dim]` (processor order) rearranged into tower order.
    ///
    /// # Errors
    /// `pixel_values` not `patches · patch_dim` long.
    pub fn reorder_pixels(
        &self,
        cfg: &VisionConfig,
        pixels: &[f32],
    ) -> Result<Vec<f32>, ModelError> {
        let row = cfg.patch_dim() * cfg.spatial_merge_size * cfg.spatial_merge_size;
        if pixels.len() != self.units * row {
            return Err(input_error(format!(
                "pixel_values has {} values, the grids need {} patches × {} = {}",
                pixels.len(),
                self.patches,
                cfg.patch_dim(),
                self.units * row
            )));
        }
        let mut out = Vec::with_capacity(pixels.len());
        for &u in &self.unit_order {
            let u = u as usize;
            out.extend_from_slice(&pixels[u * row..(u + 1) * row]);
        }
        Ok(out)
    }
}

/// The 2-D rotary cos/sin of every patch in tower order, as transformers computes them in
/// f32: `inv_freq[j] = 1 / θ^(2j / (head_dim/2))` for `j < head_dim/4`, angle `pos · inv_freq`,
/// the h angles then the w angles.
fn rope_tables(
    cfg: &VisionConfig,
    grids: &[[usize; 3]],
    unit_order: &[u32],
    patches: usize,
) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
    let m = cfg.spatial_merge_size;
    let half = cfg.head_dim / 2;
    let quarter = half / 2;
    let theta = cfg.rope_theta as f32;
    let inv: Vec<f32> = (0..quarter)
        .map(|j| 1.0 / theta.powf((2 * j) as f32 / half as f32))
        .collect();
    // (h, w) of each merge unit's patches, processor order: block-major within a frame
    let mut hw: Vec<[u32; 2]> = Vec::with_capacity(patches);
    for &[t, h, w] in grids {
        for _ in 0..t {
            for bh in 0..h / m {
                for bw in 0..w / m {
                    for ih in 0..m {
                        for iw in 0..m {
                            hw.push([(bh * m + ih) as u32, (bw * m + iw) as u32]);
                        }
                    }
                }
            }
        }
    }
    let unit = m * m;
    let (mut cos, mut sin) = (vec![0.0f32; patches * half], vec![0.0f32; patches * half]);
    let rows = unit_order
        .iter()
        .flat_map(|&u| (0..unit).map(move |r| u as usize * unit + r));
    for (p, src) in rows.enumerate() {
        let [ph, pw] = hw[src];
        for (axis, pos) in [ph, pw].into_iter().enumerate() {
            for (j, &f) in inv.iter().enumerate() {
                let angle = pos as f32 * f;
                let i = p * half + axis * quarter + j;
                cos[i] = angle.cos();
                sin[i] = angle.sin();
            }
        }
    }
    Ok((cos, sin))
}

/// The tower on backend `B`: its config and weights (one buffer per [`Slot`], per-block
/// ones stacked over blocks).
#[derive(Debug)]
pub struct VisionTower<B: Backend> {
    pub(super) cfg: VisionConfig,
    pub(super) weights: VisionParams<B::Buffer>,
    pub(super) precision: MatmulPrecision,
    /// Whether training arenas keep one block's activations ([`Self::set_gradient_checkpointing`]).
    gradient_checkpointing: bool,
    /// How the arenas store the MLP block's activations ([`Self::set_activation_dtype`]).
    activation_dtype: ActivationDtype,
    /// LoRA pairs (`vision/lora.rs`): with them the base weights are frozen.
    pub(super) lora: Option<TowerLora<B>>,
    /// The linear layers' weights stored in bf16 ([`Self::set_weight_storage`]): their f32
    /// buffers in `weights` are then empty.
    pub(super) stored: Option<VisionParams<B::Half>>,
}

/// What reads a block's activations in f32 only (they are then kept in f32:
/// [`tower_act_layout`]).
const LORA_F32: &str = "a LoRA pair on the tower (its activations in bf16)";
const PLAIN_F32: &str = "the tower's QuickGELU MLP (its activations in bf16)";
const MIXED: &str = "the tower's attention block in mixed dtypes";

/// A block's activations stored in mixed dtypes, or in bf16 over f32 weights: never
/// planned so ([`tower_act_layout`]).
fn mixed_dtypes() -> ModelError {
    ModelError::Bf16Activations {
        what: "the tower's activations in bf16 without bf16 weights, or mixed",
    }
}

/// A linear layer's weight as the tower's products read it: f32, or its bf16 bits when
/// the tower stores it in bf16.
enum TowerWeight<'a, B: Backend> {
    F32(Tensor<'a, B>),
    Bf16(View<'a, B::Half>),
}

/// Gradients of the tower's trained parameters: every weight slot's (full fine-tuning), or
/// with LoRA pairs on the tower only the pairs' ([`VisionTower::zero_grads`]). Under
/// [`GradDtype::Bf16`] ([`VisionTower::zero_grads_in`]) the linear slots' are kept in bf16
/// (`vision/half_grads.rs`) and their f32 buffers are empty.
pub struct VisionGrads<B: Backend> {
    pub(crate) base: Option<VisionParams<B::Buffer>>,
    pub(crate) lora: Option<LoraParams<B, TOWER_TARGETS>>,
    pub(crate) half: Option<TowerHalfGrads<B>>,
}

impl<B: Backend> VisionGrads<B> {
    /// The f32 gradient of weight slot `slot` (full fine-tuning), if the tower has it
    /// (empty for a linear slot kept in bf16: [`Self::stored`] has it).
    pub fn get(&self, slot: Slot) -> Option<&B::Buffer> {
        self.base.as_ref()?.get(slot)
    }

    /// Every weight slot's f32 gradient (full fine-tuning; nothing under LoRA), in
    /// checkpoint order (see [`Self::get`]).
    pub fn iter(&self) -> impl Iterator<Item = (Slot, &B::Buffer)> {
        self.base.iter().flat_map(|b| b.iter())
    }

    /// How the gradients are stored: [`GradDtype::Bf16`] when the linear slots' are bf16.
    pub fn dtype(&self) -> GradDtype {
        match self.half {
            Some(_) => GradDtype::Bf16,
            None => GradDtype::F32,
        }
    }

    /// Every gradient buffer as stored (f32, or a linear slot's bf16 bits), in the order of
    /// [`VisionTower::trainable_names`].
    pub fn stored(&self) -> Vec<Stored<'_, B>> {
        match (&self.base, &self.lora) {
            (_, Some(l)) => l
                .buffers()
                .into_iter()
                .map(|b| Stored::F32(View::whole(b)))
                .collect(),
            (Some(b), None) => (b.iter())
                .map(
                    |(slot, g)| match self.half.as_ref().and_then(|h| h.get(slot)) {
                        Some(h) => Stored::Bf16(View::whole(h)),
                        None => Stored::F32(View::whole(g)),
                    },
                )
                .collect(),
            (None, None) => Vec::new(),
        }
    }

    /// [`Self::stored`], writable (a data-parallel run sums them in place).
    pub fn stored_mut(&mut self) -> Vec<TrainableMut<'_, B>> {
        match (&mut self.base, &mut self.lora) {
            (_, Some(l)) => TrainableMut::f32s(l.buffers_mut()),
            (Some(b), None) => {
                let mut halves: Vec<(Slot, &mut B::Half)> = match &mut self.half {
                    Some(h) => h.iter_mut().collect(),
                    None => Vec::new(),
                };
                (b.iter_mut())
                    .map(
                        |(slot, g)| match halves.iter().position(|(s, _)| *s == slot) {
                            Some(i) => TrainableMut::Bf16(halves.swap_remove(i).1),
                            None => TrainableMut::F32(g),
                        },
                    )
                    .collect()
            }
            (None, None) => Vec::new(),
        }
    }

    /// The elements of each buffer of [`Self::stored`].
    pub fn lens(&self) -> Vec<usize> {
        self.stored().iter().map(Stored::len).collect()
    }

    /// Bytes the gradients hold on the device (with bf16 ones, their one-block scratch).
    pub fn bytes(&self) -> u64 {
        let f32s: u64 = match (&self.base, &self.lora) {
            (_, Some(l)) => l.buffers().iter().map(|b| b.len() as u64).sum(),
            (Some(b), None) => b.iter().map(|(_, g)| g.len() as u64).sum(),
            (None, None) => 0,
        };
        4 * f32s + self.half.as_ref().map_or(0, TowerHalfGrads::bytes)
    }

    /// Zeroes every gradient (before a mini-batch accumulates into them).
    ///
    /// # Errors
    /// A backend failure.
    pub fn zero(&mut self, be: &B) -> Result<(), ModelError> {
        for g in self.stored_mut() {
            match g {
                TrainableMut::F32(g) => be.fill(ViewMut::whole(g), 0.0)?,
                TrainableMut::Bf16(h) => be.fill_bf16(ViewMut::whole(h), 0.0)?,
            }
        }
        Ok(())
    }

    /// Sets the stochastic rounding of gradients stored in bf16, as
    /// [`Grads::set_rounding`](crate::model::Grads::set_rounding). Nothing for f32 ones.
    pub fn set_rounding(&mut self, seed: u64, step: u64) {
        if let Some(h) = &mut self.half {
            h.keys.set_rounding(seed, step);
        }
    }

    /// Keys the coming backward pass's rounding by `pass`, as
    /// [`Grads::set_rounding_pass`](crate::model::Grads::set_rounding_pass).
    pub fn set_rounding_pass(&mut self, pass: u64) {
        if let Some(h) = &mut self.half {
            h.keys.set_pass(pass);
        }
    }
}

/// The activations of one tower call.
#[derive(Debug)]
pub struct VisionActs<B: Backend> {
    plan: VisionPlan,
    /// Whether every block's activations are kept (training) or one block's (inference).
    keep: bool,
    /// Training with per-block activation checkpointing: every block's input kept, the
    /// rest of one block's, which the backward pass recomputes block by block.
    checkpointed: bool,
    pixels: B::Buffer,
    cos: B::Buffer,
    sin: B::Buffer,
    cu_full: B::Ids,
    cu_window: B::Ids,
    /// Residual stream `[depth + 1, N, C]` (training) or `[2, N, C]`.
    resid: B::Buffer,
    /// The attention block's activations, f32 or bf16 ([`TowerActLayout::attention`]).
    n1: ActStack<B>,
    n1_mean: B::Buffer,
    n1_rstd: B::Buffer,
    q: ActStack<B>,
    k: ActStack<B>,
    v: ActStack<B>,
    att: ActStack<B>,
    lse: B::Buffer,
    mid: B::Buffer,
    /// The MLP block's activations, f32 or bf16 ([`TowerActLayout::mlp`]).
    n2: ActStack<B>,
    n2_mean: B::Buffer,
    n2_rstd: B::Buffer,
    mlp_in: ActStack<B>,
    mlp_up: ActStack<B>,
    mlp_act: ActStack<B>,
    /// Scratch `[N, C]` for a block's projection outputs.
    branch: B::Buffer,
    merge_norm: B::Buffer,
    merge_mean: B::Buffer,
    merge_rstd: B::Buffer,
    merge_hidden: B::Buffer,
    merge_act: B::Buffer,
    /// The merged tokens `[units, out_hidden]`, in tower order.
    out: B::Buffer,
    /// The LoRA pairs' intermediates (a tower with pairs).
    lora: Option<TowerLoraActs<B>>,
}

/// Which of a tower arena's activations are stored in bf16 ([`tower_act_layout`]); the
/// residual stream, the norms' statistics, the attention's log-sum-exp and every gradient
/// stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct TowerActLayout {
    /// The MLP block's: the second norm's output, gate, up and their SwiGLU.
    pub mlp: bool,
    /// The attention block's: the first norm's output, q and k after the 2-D RoPE, v, and
    /// the attention's output.
    pub attention: bool,
}

impl TowerActLayout {
    /// Every activation in f32.
    pub const F32: Self = Self {
        mlp: false,
        attention: false,
    };
}

/// Which of a tower's activations an arena of `patches` patches keeps in bf16 under
/// `dtype`, for a tower whose linear weights are stored in bf16 (`weights_bf16`) and
/// multiplied in bf16 (`products_bf16`), without LoRA pairs (whose ops read f32 inputs):
/// - the MLP block's for an RMSNorm tower with a SwiGLU MLP (Qwen2.5-VL): the products
///   read them as stored (`linear_bf16_io`, `linear_bf16_x`), as the decoder's MLP does;
///   Qwen2-VL's LayerNorm and QuickGELU have no bf16 forms and keep f32;
/// - the attention block's where its attention runs on the tensor cores (bf16 products
///   at these rows, a head size of `ares_cpu::ops::attention::BF16_HEAD_DIMS`): the first
///   norm's output, q, k (after RoPE) and v are made in f32 and rounded once — the bits
///   the bf16 products and the tensor-core kernels take of f32 ones, so the forward is
///   the f32 activations' bit for bit — and the attention's output is stored rounded
///   (the projection rounds it anyway; the backward's `δ = Σ dout·out` reads the rounded
///   values), as the decoder's attention block ([`crate::model::ActLayout`]).
pub fn tower_act_layout(
    cfg: &VisionConfig,
    dtype: ActivationDtype,
    (weights_bf16, products_bf16): (bool, bool),
    lora: bool,
    patches: usize,
) -> TowerActLayout {
    let stored = dtype == ActivationDtype::Bf16 && weights_bf16 && products_bf16 && !lora;
    TowerActLayout {
        mlp: stored && cfg.mlp == VisionMlp::SwiGlu && !cfg.layer_norm(),
        attention: stored && tensor_core_segments(MatmulPrecision::Bf16, cfg.head_dim, patches),
    }
}

/// Whether segment attention over `tokens` tokens at `head_dim` runs on the tensor-core
/// kernels (and their CPU twin) at `precision`: bf16 at these tokens (≥ 64) and a head
/// size they take — as the decoder's `tensor_core_attention`.
fn tensor_core_segments(precision: MatmulPrecision, head_dim: usize, tokens: usize) -> bool {
    precision.for_rows(tokens) == MatmulPrecision::Bf16
        && ares_cpu::ops::attention::BF16_HEAD_DIMS.contains(&head_dim)
}

/// Lengths in elements of the buffers of a tower arena ([`VisionTower::activations`]):
/// what it allocates and what the memory plan counts ([`tower_arena_bytes`]).
struct ArenaLens {
    pixels: usize,
    /// cos and sin, each.
    rope: usize,
    resid: usize,
    /// Each of n1, q, k, v, att, mid, n2: `[blocks, N, C]`.
    block: usize,
    lse: usize,
    /// Each of n1_mean and n2_mean (LayerNorm only).
    stats: usize,
    /// Each of n1_rstd and n2_rstd.
    rows: usize,
    /// Each of mlp_in and mlp_act.
    mlp: usize,
    /// mlp_up (SwiGLU only).
    up: usize,
    /// Which are stored in bf16: n2, mlp_in, mlp_up and mlp_act (`mlp`); n1, q, k, v and
    /// att (`attention`).
    layout: TowerActLayout,
    /// Each of branch and merge_norm: `[N, C]`.
    scratch: usize,
    merge_mean: usize,
    merge_rstd: usize,
    /// Each of merge_hidden and merge_act.
    merged: usize,
    out: usize,
}

impl ArenaLens {
    /// An arena of `patches` patches: every block's activations (`keep`), every block's
    /// input and one block's rest (`keep` and `checkpointed`), or one block's (inference).
    fn new(
        c: &VisionConfig,
        patches: usize,
        keep: bool,
        checkpointed: bool,
        layout: TowerActLayout,
    ) -> Self {
        let n = patches;
        let units = n / (c.spatial_merge_size * c.spatial_merge_size).max(1);
        let (h, i) = (c.hidden, c.intermediate);
        let blocks = if keep && !checkpointed { c.depth } else { 1 };
        let resid_items = if keep { c.depth + 1 } else { 2 };
        let ln = c.layer_norm();
        Self {
            pixels: n * c.patch_dim(),
            rope: n * (c.head_dim / 2),
            resid: resid_items * n * h,
            block: blocks * n * h,
            lse: blocks * n * c.heads,
            stats: if ln { blocks * n } else { 0 },
            rows: blocks * n,
            mlp: blocks * n * i,
            up: if c.mlp == VisionMlp::SwiGlu {
                blocks * n * i
            } else {
                0
            },
            layout,
            scratch: n * h,
            merge_mean: if ln { n } else { 0 },
            merge_rstd: n,
            merged: units * c.merged_dim(),
            out: units * c.out_hidden,
        }
    }

    /// Bytes of every buffer (the plan's segment bounds, a few integers, aside).
    fn bytes(&self) -> u64 {
        let n = |x: usize| x as u64;
        let bytes = |bf16: bool| if bf16 { 2 } else { 4 };
        let f32s = n(self.pixels)
            + 2 * n(self.rope)
            + n(self.resid)
            + n(self.block)
            + n(self.lse)
            + 2 * n(self.stats)
            + 2 * n(self.rows)
            + 2 * n(self.scratch)
            + n(self.merge_mean)
            + n(self.merge_rstd)
            + 2 * n(self.merged)
            + n(self.out);
        // n2 with the MLP's three; n1, q, k, v and att
        let mlp = n(self.block) + 2 * n(self.mlp) + n(self.up);
        let attention = 5 * n(self.block);
        4 * f32s + bytes(self.layout.mlp) * mlp + bytes(self.layout.attention) * attention
    }
}

/// Bytes of a tower arena of `patches` patches (LoRA pairs' intermediates aside), as
/// [`VisionTower::activations`] allocates it: `keep` for a backward, `checkpointed` with
/// [`VisionTower::set_gradient_checkpointing`], the activations `layout` keeps in bf16
/// ([`tower_act_layout`] at these patches) — what the memory plan counts.
pub fn tower_arena_bytes(
    cfg: &VisionConfig,
    patches: usize,
    keep: bool,
    checkpointed: bool,
    layout: TowerActLayout,
) -> u64 {
    ArenaLens::new(cfg, patches, keep, checkpointed, layout).bytes()
}

/// Bytes of the scratch [`VisionTower::backward`] allocates beside the arena for `patches`
/// patches: the gradients of a block's activations and of the merger's (f32).
pub fn tower_backward_bytes(cfg: &VisionConfig, patches: usize) -> u64 {
    let n = patches as u64;
    let units = n / (cfg.spatial_merge_size * cfg.spatial_merge_size).max(1) as u64;
    let (h, i) = (cfg.hidden as u64, cfg.intermediate as u64);
    // d_resid, d_mid, d_norm, d_att, dq, dk, dv; d_act, d_in, d_up; the merger's two; a
    // frozen LayerNorm's two (at most)
    4 * (7 * n * h + 3 * n * i + 2 * units * cfg.merged_dim() as u64 + 2 * h)
}

impl<B: Backend> VisionActs<B> {
    /// The plan this arena was made for.
    pub fn plan(&self) -> &VisionPlan {
        &self.plan
    }

    /// Bytes of the arena's buffers, f32 and bf16 (the tower's activation memory).
    pub fn bytes(&self) -> usize {
        let bufs = [
            &self.pixels,
            &self.cos,
            &self.sin,
            &self.resid,
            &self.n1_mean,
            &self.n1_rstd,
            &self.lse,
            &self.mid,
            &self.n2_mean,
            &self.n2_rstd,
            &self.branch,
            &self.merge_norm,
            &self.merge_mean,
            &self.merge_rstd,
            &self.merge_hidden,
            &self.merge_act,
            &self.out,
        ];
        let stacks = [
            &self.n1,
            &self.q,
            &self.k,
            &self.v,
            &self.att,
            &self.n2,
            &self.mlp_in,
            &self.mlp_up,
            &self.mlp_act,
        ];
        bufs.iter().map(|b| b.len() * 4).sum::<usize>()
            + stacks
                .iter()
                .map(|s| s.len() * if s.is_bf16() { 2 } else { 4 })
                .sum::<usize>()
            + self.lora.as_ref().map_or(0, |l| l.elements() * 4)
    }

    /// The merged tokens `[units, out_hidden]` of the last forward, in tower order.
    pub fn output(&self) -> Tensor<'_, B> {
        View::whole(&self.out)
    }

    /// The residual stream after the last block `[patches, hidden]` (transformers'
    /// `last_hidden_state`), in tower order.
    ///
    /// # Errors
    /// A view error (never for an arena made by [`VisionTower::activations`]).
    pub fn last_hidden(&self, depth: usize) -> Result<Tensor<'_, B>, ModelError> {
        let n = self.resid.len() / if self.keep { depth + 1 } else { 2 };
        Ok(View::item(&self.resid, self.rslot(depth), n)?)
    }

    /// Where block `l`'s activations (but the residual stream) live: its own slot when
    /// every block's are kept, else the one slot.
    fn slot(&self, l: usize) -> usize {
        if self.keep && !self.checkpointed {
            l
        } else {
            0
        }
    }

    /// Where the residual stream entering block `l` lives (`l = depth`: the tower's
    /// output): its own slot when kept for the backward pass, else one of two.
    fn rslot(&self, l: usize) -> usize {
        if self.keep { l } else { l % 2 }
    }
}

impl<B: Backend> VisionTower<B> {
    /// Uploads `weights` (checked against `cfg`'s parameter table).
    ///
    /// # Errors
    /// A weight of the wrong size, or a backend failure.
    pub fn new(be: &B, cfg: &VisionConfig, weights: &VisionWeights) -> Result<Self, ModelError> {
        let table = param_table(cfg);
        let uploaded = VisionParams::build(&table, |spec| {
            let t = weights
                .get(spec.slot)
                .ok_or_else(|| ModelError::MissingWeight {
                    name: spec.hf_name(0),
                })?;
            let blocks = if spec.per_block { cfg.depth } else { 1 };
            let expected = blocks * spec.item();
            if t.data.len() != expected {
                return Err(ModelError::WeightShape {
                    name: spec.hf_name(0),
                    expected,
                    actual: t.data.len(),
                });
            }
            let mut buf = be.alloc(expected)?;
            be.upload(&t.data, ViewMut::whole(&mut buf))?;
            Ok(buf)
        })?;
        Ok(Self {
            cfg: cfg.clone(),
            weights: uploaded,
            precision: MatmulPrecision::F32,
            gradient_checkpointing: false,
            activation_dtype: ActivationDtype::F32,
            lora: None,
            stored: None,
        })
    }

    /// Stores the linear layers' weights (patch embedding, qkv, projection, MLP, merger) as
    /// [`Model::set_weight_storage`](crate::model::Model::set_weight_storage) does the
    /// language model's: [`WeightStorage::Bf16`] rounds them to bf16 (nearest) as the
    /// weights and frees their f32 buffers — every product of those layers then reads the
    /// bf16 weight at any number of rows, and [`AdamW`](crate::model::AdamW) updates them
    /// with stochastic rounding; [`WeightStorage::F32`] widens them back (exact). Norms and
    /// biases stay f32.
    ///
    /// # Errors
    /// A backend failure.
    pub fn set_weight_storage(&mut self, be: &B, storage: WeightStorage) -> Result<(), ModelError> {
        match (storage, self.stored.is_some()) {
            (WeightStorage::Bf16, false) => {
                let table: Vec<_> = param_table(&self.cfg)
                    .into_iter()
                    .filter(|spec| spec.slot.is_linear())
                    .collect();
                let stored = VisionParams::build(&table, |spec| {
                    let w = self
                        .weights
                        .get(spec.slot)
                        .ok_or_else(|| missing("a linear slot"))?;
                    let mut half = be.alloc_half(w.len(), DType::Bf16)?;
                    be.round_bf16(View::whole(w), ViewMut::whole(&mut half))?;
                    Ok::<_, ModelError>(half)
                })?;
                for (slot, _) in stored.iter() {
                    if let Some(w) = self.weights.get_mut(slot) {
                        *w = be.alloc(0)?;
                    }
                }
                self.stored = Some(stored);
            }
            (WeightStorage::F32, true) => {
                let Some(stored) = self.stored.take() else {
                    return Ok(());
                };
                for (slot, half) in stored.iter() {
                    let mut w = be.alloc(half.len())?;
                    be.widen_bf16(View::whole(half), ViewMut::whole(&mut w))?;
                    if let Some(dst) = self.weights.get_mut(slot) {
                        *dst = w;
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// How the linear layers' weights are stored ([`Self::set_weight_storage`]).
    pub fn weight_storage(&self) -> WeightStorage {
        match self.stored {
            Some(_) => WeightStorage::Bf16,
            None => WeightStorage::F32,
        }
    }

    /// Bytes the weights hold on the device: the f32 buffers and the bf16 ones.
    pub fn weight_bytes(&self) -> u64 {
        let f32s: u64 = self.weights.iter().map(|(_, w)| 4 * w.len() as u64).sum();
        let halves = self.stored.iter().flat_map(|s| s.iter());
        f32s + halves.map(|(_, h)| 2 * h.len() as u64).sum::<u64>()
    }

    /// Elements of `slot`'s parameter (also of a weight stored in bf16).
    fn slot_len(&self, slot: Slot) -> usize {
        match self.stored.as_ref().and_then(|s| s.get(slot)) {
            Some(half) => half.len(),
            None => self.weights.get(slot).map_or(0, DeviceBuffer::len),
        }
    }

    /// The config.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// Activation checkpointing per block for the training arenas planned from now on
    /// (as [`crate::model::Model::set_gradient_checkpointing`]): every block's input kept,
    /// the rest recomputed block by block in [`Self::backward`] — the same gradients, bit
    /// for bit.
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.gradient_checkpointing = on;
    }

    /// Sets how the linear layers multiply (as [`crate::model::Model::set_matmul_precision`]).
    pub fn set_matmul_precision(&mut self, precision: MatmulPrecision) {
        self.precision = precision;
    }

    /// How the arenas planned from now on store the blocks' activations, as
    /// [`crate::model::Model::set_activation_dtype`] does the decoder's: in bf16 where
    /// [`tower_act_layout`] says the tower can (the MLP block's; the attention block's
    /// where its attention runs on the tensor cores), else in f32.
    pub fn set_activation_dtype(&mut self, dtype: ActivationDtype) {
        self.activation_dtype = dtype;
    }

    /// Which activations this tower's arenas of `patches` patches keep in bf16
    /// ([`tower_act_layout`] of its settings).
    pub fn act_layout(&self, patches: usize) -> TowerActLayout {
        tower_act_layout(
            &self.cfg,
            self.activation_dtype,
            (
                self.stored.is_some(),
                self.precision == MatmulPrecision::Bf16,
            ),
            self.lora.is_some(),
            patches,
        )
    }

    /// The weights on the device, in f32 (a linear layer's is empty while the tower stores
    /// it in bf16: [`Self::set_weight_storage`], [`Self::download_weights`]).
    pub fn weights(&self) -> &VisionParams<B::Buffer> {
        &self.weights
    }

    /// The weights on the device, mutably (the optimizer).
    pub fn weights_mut(&mut self) -> &mut VisionParams<B::Buffer> {
        &mut self.weights
    }

    /// Downloads the weights to the host.
    ///
    /// # Errors
    /// A backend failure.
    pub fn download_weights(&self, be: &B) -> Result<VisionWeights, ModelError> {
        let table = param_table(&self.cfg);
        VisionParams::build(&table, |spec| {
            let data = match self.stored.as_ref().and_then(|s| s.get(spec.slot)) {
                // stored in bf16: widened (exact)
                Some(half) => HalfStack::<B>::download_widened(be, View::whole(half))?,
                None => {
                    let buf =
                        self.weights
                            .get(spec.slot)
                            .ok_or_else(|| ModelError::MissingWeight {
                                name: spec.hf_name(0),
                            })?;
                    let mut data = vec![0.0; buf.len()];
                    be.download(View::whole(buf), &mut data)?;
                    data
                }
            };
            let mut shape = if spec.per_block {
                vec![self.cfg.depth]
            } else {
                Vec::new()
            };
            shape.extend(&spec.shape);
            Ok(crate::hf::weights::Tensor { shape, data })
        })
    }

    /// Zeroed gradients of every trained parameter: the weights, or with LoRA pairs on the
    /// tower the pairs.
    ///
    /// # Errors
    /// A backend failure.
    pub fn zero_grads(&self, be: &B) -> Result<VisionGrads<B>, ModelError> {
        self.zero_grads_in(be, GradDtype::F32)
    }

    /// [`Self::zero_grads`] stored as `dtype` says: [`GradDtype::Bf16`] keeps the linear
    /// slots' gradients in bf16 (the backward folds each block's into them with stochastic
    /// rounding, `vision/half_grads.rs`), their f32 buffers empty; LoRA pairs' stay f32.
    ///
    /// # Errors
    /// A backend failure.
    pub fn zero_grads_in(&self, be: &B, dtype: GradDtype) -> Result<VisionGrads<B>, ModelError> {
        if let Some(l) = &self.lora {
            return Ok(VisionGrads {
                base: None,
                lora: Some(l.params.zeros_like(be)?),
                half: None,
            });
        }
        let table = param_table(&self.cfg);
        let bf16 = dtype == GradDtype::Bf16;
        let base = VisionParams::build(&table, |spec| {
            let len = match bf16 && spec.slot.is_linear() {
                true => 0,
                false => self.slot_len(spec.slot),
            };
            Ok::<_, ModelError>(be.alloc(len)?)
        })?;
        let half = match bf16 {
            true => Some(TowerHalfGrads::new(be, &table, self.cfg.depth)?),
            false => None,
        };
        Ok(VisionGrads {
            base: Some(base),
            lora: None,
            half,
        })
    }

    /// The trained parameters' buffers, in the order of [`Self::trainable_names`]: the
    /// weights (full fine-tuning) or the LoRA pairs.
    pub(crate) fn trainable_mut(&mut self) -> Vec<TrainableMut<'_, B>> {
        match &mut self.lora {
            Some(l) => TrainableMut::f32s(l.params.buffers_mut()),
            None => {
                let mut halves: Vec<(Slot, &mut B::Half)> = match &mut self.stored {
                    Some(s) => s.iter_mut().collect(),
                    None => Vec::new(),
                };
                self.weights
                    .iter_mut()
                    .map(
                        |(slot, w)| match halves.iter().position(|(s, _)| *s == slot) {
                            Some(i) => TrainableMut::Bf16(halves.swap_remove(i).1),
                            None => TrainableMut::F32(w),
                        },
                    )
                    .collect()
            }
        }
    }

    /// Name and shape of each trained parameter (blocks stacked, `#` for the block index,
    /// as the optimizer file names them): a weight slot's name, or a pair's
    /// (`blocks.#.attn.qkv.lora_A.weight`).
    pub fn trainable_names(&self) -> Vec<(String, Vec<usize>)> {
        let c = &self.cfg;
        let mut out = Vec::new();
        for spec in param_table(c) {
            let mut shape = if spec.per_block {
                vec![c.depth]
            } else {
                Vec::new()
            };
            match &self.lora {
                None => {
                    shape.extend(&spec.shape);
                    out.push((spec.name.replace("{}", "#"), shape));
                }
                Some(l) => {
                    let Some(t) = TowerTarget::ALL.into_iter().find(|t| t.slot() == spec.slot)
                    else {
                        continue;
                    };
                    if l.params.pairs[t as usize].is_none() {
                        continue;
                    }
                    let (inp, outf) = t.in_out(c);
                    let stem = spec.name.trim_end_matches(".weight").replace("{}", "#");
                    let r = l.config.r;
                    for (which, dims) in [("A", [r, inp]), ("B", [outf, r])] {
                        let mut s = shape.clone();
                        s.extend(dims);
                        out.push((format!("{stem}.lora_{which}.weight"), s));
                    }
                }
            }
        }
        out
    }

    /// An arena for `plan`; `keep`: for [`Self::backward`] — every block's activations, or
    /// with [`Self::set_gradient_checkpointing`] every block's input and one block's rest.
    ///
    /// # Errors
    /// A backend failure (out of memory).
    pub fn activations(
        &self,
        be: &B,
        plan: VisionPlan,
        keep: bool,
    ) -> Result<VisionActs<B>, ModelError> {
        let c = &self.cfg;
        let n = plan.patches;
        let checkpointed = keep && self.gradient_checkpointing;
        let blocks = if keep && !checkpointed { c.depth } else { 1 };
        // every arena alike: a forward-only pass (old log-probs) gives the bits of the
        // update's forward
        let layout = self.act_layout(n);
        let len = ArenaLens::new(c, n, keep, checkpointed, layout);
        let mlp = |len: usize, item: usize| ActStack::new(be, layout.mlp, len, item);
        let att = |len: usize| ActStack::new(be, layout.attention, len, n * c.hidden);
        let mut cu_full = be.alloc_ids(plan.cu_full.len())?;
        be.upload_ids(&plan.cu_full, &mut cu_full)?;
        let mut cu_window = be.alloc_ids(plan.cu_window.len())?;
        be.upload_ids(&plan.cu_window, &mut cu_window)?;
        let mut cos = be.alloc(plan.cos.len())?;
        be.upload(&plan.cos, ViewMut::whole(&mut cos))?;
        let mut sin = be.alloc(plan.sin.len())?;
        be.upload(&plan.sin, ViewMut::whole(&mut sin))?;
        Ok(VisionActs {
            keep,
            checkpointed,
            pixels: be.alloc(len.pixels)?,
            cos,
            sin,
            cu_full,
            cu_window,
            resid: be.alloc(len.resid)?,
            n1: att(len.block)?,
            n1_mean: be.alloc(len.stats)?,
            n1_rstd: be.alloc(len.rows)?,
            q: att(len.block)?,
            k: att(len.block)?,
            v: att(len.block)?,
            att: att(len.block)?,
            lse: be.alloc(len.lse)?,
            mid: be.alloc(len.block)?,
            n2: mlp(len.block, n * c.hidden)?,
            n2_mean: be.alloc(len.stats)?,
            n2_rstd: be.alloc(len.rows)?,
            mlp_in: mlp(len.mlp, n * c.intermediate)?,
            mlp_up: mlp(len.up, n * c.intermediate)?,
            mlp_act: mlp(len.mlp, n * c.intermediate)?,
            branch: be.alloc(len.scratch)?,
            merge_norm: be.alloc(len.scratch)?,
            merge_mean: be.alloc(len.merge_mean)?,
            merge_rstd: be.alloc(len.merge_rstd)?,
            merge_hidden: be.alloc(len.merged)?,
            merge_act: be.alloc(len.merged)?,
            out: be.alloc(len.out)?,
            lora: self.lora_acts(be, n, plan.units, blocks)?,
            plan,
        })
    }

    /// Whether segment attention of `dims` runs on the tensor-core kernels (and their CPU
    /// twin): bf16 at these tokens (≥ 64) and a head size they take — as the decoder's
    /// `Model::attention_in_bf16`.
    fn attention_in_bf16(&self, dims: &SegmentAttentionDims) -> bool {
        tensor_core_segments(self.precision, dims.head_dim, dims.tokens)
    }

    fn dims(&self, rows: usize, in_features: usize, out_features: usize) -> LinearDims {
        LinearDims {
            rows,
            in_features,
            out_features,
            precision: self.precision,
        }
    }

    /// The weight of `slot` for block `l` (or the whole tensor).
    fn w(&self, slot: Slot, l: usize, item: usize) -> Result<Tensor<'_, B>, ModelError> {
        Ok(View::item(self.buffer(slot)?, l, item)?)
    }

    /// The f32 buffer of `slot` (empty for a weight stored in bf16).
    fn buffer(&self, slot: Slot) -> Result<&B::Buffer, ModelError> {
        self.weights
            .get(slot)
            .ok_or_else(|| ModelError::MissingWeight {
                name: format!("{slot:?}"),
            })
    }

    /// The weight of linear slot `slot` for block `l` (or the whole tensor) as the
    /// products read it: elements `offset..offset + len` of the block's.
    fn lin(
        &self,
        slot: Slot,
        l: usize,
        item: usize,
        (offset, len): (usize, usize),
    ) -> Result<TowerWeight<'_, B>, ModelError> {
        if let Some(half) = self.stored.as_ref().and_then(|s| s.get(slot)) {
            return Ok(TowerWeight::Bf16(View::new(half, l * item + offset, len)?));
        }
        let buf = self.buffer(slot)?;
        Ok(TowerWeight::F32(View::new(buf, l * item + offset, len)?))
    }

    /// [`Self::lin`] of a whole block's (or the tower's) weight.
    fn lw(&self, slot: Slot, l: usize, item: usize) -> Result<TowerWeight<'_, B>, ModelError> {
        self.lin(slot, l, item, (0, item))
    }

    /// Rows `part·h .. (part+1)·h` of block `l`'s fused qkv weight (0 q, 1 k, 2 v) and bias.
    fn qkv(
        &self,
        l: usize,
        part: usize,
    ) -> Result<(TowerWeight<'_, B>, Tensor<'_, B>), ModelError> {
        let h = self.cfg.hidden;
        let b = self
            .weights
            .get(Slot::QkvBias)
            .ok_or_else(|| missing("qkv bias"))?;
        Ok((
            self.lin(Slot::Qkv, l, 3 * h * h, (part * h * h, h * h))?,
            View::new(b, (l * 3 + part) * h, h)?,
        ))
    }

    /// `out = x · wᵀ (+ bias)` by a linear layer's weight: [`Backend::linear`], or
    /// [`Backend::linear_bf16`] for a weight stored in bf16.
    fn linear(
        be: &B,
        x: Tensor<'_, B>,
        w: TowerWeight<'_, B>,
        bias: Option<Tensor<'_, B>>,
        dims: LinearDims,
        out: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        Self::linear_stored(be, Act::F32(x), w, bias, dims, ActMut::F32(out))
    }

    /// Backward of [`Self::linear`] (as [`Backend::linear_backward`]).
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        be: &B,
        dout: Tensor<'_, B>,
        x: Tensor<'_, B>,
        w: TowerWeight<'_, B>,
        dims: LinearDims,
        write: GradWrites,
        dx: Option<TensorMut<'_, B>>,
        (dw, db): (Option<TensorMut<'_, B>>, Option<TensorMut<'_, B>>),
    ) -> Result<(), ModelError> {
        Self::linear_backward_stored(be, dout, Act::F32(x), w, dims, write, dx, (dw, db))
    }

    /// Norm of `x` (`rows × dim`) by `slot`'s weight (and bias: LayerNorm) into `out`.
    #[allow(clippy::too_many_arguments)]
    fn norm(
        &self,
        be: &B,
        slot: Slot,
        l: usize,
        x: Tensor<'_, B>,
        out: TensorMut<'_, B>,
        mean: Option<TensorMut<'_, B>>,
        rstd: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let h = self.cfg.hidden;
        let w = self.w(slot, l, h)?;
        match (bias_slot(slot), mean) {
            (Some(bs), Some(mean)) if self.cfg.layer_norm() => {
                let b = self.w(bs, l, h)?;
                be.layer_norm(x, w, b, EPS, h, out, mean, rstd)?;
            }
            _ => be.rmsnorm(x, w, EPS, h, out, rstd)?,
        }
        Ok(())
    }

    /// Runs the tower on `pixel_values` `[patches, patch_dim]` (processor order, as
    /// [`VisionPlan::reorder_pixels`] takes them), leaving the merged tokens in
    /// [`VisionActs::output`] (tower order).
    ///
    /// # Errors
    /// `pixel_values` of the wrong length, or a backend failure.
    pub fn forward(
        &self,
        be: &B,
        pixel_values: &[f32],
        a: &mut VisionActs<B>,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (h, n) = (c.hidden, a.plan.patches);
        let rows = a.plan.reorder_pixels(c, pixel_values)?;
        be.upload(&rows, ViewMut::whole(&mut a.pixels))?;
        let nc = n * h;
        let ln = c.layer_norm();
        self.begin_lora(a.lora.as_mut())?;

        // Patch embedding: the Conv3d with stride = kernel is one linear layer over patches.
        Self::linear(
            be,
            View::whole(&a.pixels),
            self.lw(Slot::Patch, 0, h * c.patch_dim())?,
            None,
            self.dims(n, c.patch_dim(), h),
            ViewMut::item(&mut a.resid, 0, nc)?,
        )?;
        self.lora_forward(
            be,
            a.lora.as_mut(),
            TowerTarget::Patch,
            0,
            0,
            n,
            View::whole(&a.pixels),
            vec![ViewMut::item(&mut a.resid, 0, nc)?],
        )?;
        for l in 0..c.depth {
            self.block_forward(be, l, a)?;
        }

        // Patch merger: norm per patch, then m² patches side by side per merged token.
        let units = a.plan.units;
        let m = c.merged_dim();
        let x = View::item(&a.resid, a.rslot(c.depth), nc)?;
        let mean = ln.then(|| ViewMut::whole(&mut a.merge_mean));
        self.norm(
            be,
            Slot::MergerNorm,
            0,
            x,
            ViewMut::whole(&mut a.merge_norm),
            mean,
            ViewMut::whole(&mut a.merge_rstd),
        )?;
        Self::linear(
            be,
            View::whole(&a.merge_norm),
            self.lw(Slot::Merger0, 0, m * m)?,
            Some(self.w(Slot::Merger0Bias, 0, m)?),
            self.dims(units, m, m),
            ViewMut::whole(&mut a.merge_hidden),
        )?;
        self.lora_forward(
            be,
            a.lora.as_mut(),
            TowerTarget::Merger0,
            0,
            0,
            units,
            View::whole(&a.merge_norm),
            vec![ViewMut::whole(&mut a.merge_hidden)],
        )?;
        be.activation(
            Activation::GeluErf,
            View::whole(&a.merge_hidden),
            ViewMut::whole(&mut a.merge_act),
        )?;
        Self::linear(
            be,
            View::whole(&a.merge_act),
            self.lw(Slot::Merger2, 0, c.out_hidden * m)?,
            Some(self.w(Slot::Merger2Bias, 0, c.out_hidden)?),
            self.dims(units, m, c.out_hidden),
            ViewMut::whole(&mut a.out),
        )?;
        self.lora_forward(
            be,
            a.lora.as_mut(),
            TowerTarget::Merger2,
            0,
            0,
            units,
            View::whole(&a.merge_act),
            vec![ViewMut::whole(&mut a.out)],
        )?;
        Ok(())
    }

    /// Block `l`'s forward pass: reads its input from the arena's residual stream and writes
    /// its activations and output there. [`Self::backward`] calls it again for a block whose
    /// activations a checkpointed arena did not keep (the same ops, the same bits).
    fn block_forward(&self, be: &B, l: usize, a: &mut VisionActs<B>) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (h, i, n) = (c.hidden, c.intermediate, a.plan.patches);
        let (nh, hd) = (c.heads, c.head_dim);
        let nc = n * h;
        let (s, r_in, r_out) = (a.slot(l), a.rslot(l), a.rslot(l + 1));
        let ln = c.layer_norm();
        let seg_full = SegmentAttentionDims::new(n, a.plan.cu_full.len() - 1, nh, hd);
        let seg_window = SegmentAttentionDims::new(n, a.plan.cu_window.len() - 1, nh, hd);
        // Attention block. With its activations in bf16 (`TowerActLayout::attention`) n1,
        // q, k and v are each made in f32 in the `branch` scratch and rounded once into
        // their stacks (q and k with their RoPE, in one pass) — the bits the bf16 products
        // and the tensor-core attention take of f32 ones — and the attention stores its
        // output rounded. Such a tower has no LoRA pairs.
        let x = View::item(&a.resid, r_in, nc)?;
        let mean = ln
            .then(|| ViewMut::item(&mut a.n1_mean, s, n))
            .transpose()?;
        let mut n1 = a.n1.layer_mut(s)?;
        let rstd = ViewMut::item(&mut a.n1_rstd, s, n)?;
        self.norm(be, Slot::Norm1, l, x, n1.f32_or(&mut a.branch)?, mean, rstd)?;
        n1.round_staged(be, &a.branch)?;
        let n1 = a.n1.layer(s)?;
        let (cos, sin) = (View::whole(&a.cos), View::whole(&a.sin));
        if a.q.is_bf16() {
            for (part, stack) in [(0, &mut a.q), (1, &mut a.k), (2, &mut a.v)] {
                let (w, b) = self.qkv(l, part)?;
                let staged = ActMut::F32(ViewMut::whole(&mut a.branch));
                Self::linear_stored(be, n1, w, Some(b), self.dims(n, h, h), staged)?;
                let y = stack.layer_mut(s)?;
                match part {
                    2 => y.round_staged(be, &a.branch)?,
                    _ => y.rope_staged(be, &mut a.branch, (cos, sin), (nh, hd))?,
                }
            }
        } else {
            let n1 = n1.f32(MIXED)?;
            for (part, buf) in [(0, &mut a.q), (1, &mut a.k), (2, &mut a.v)] {
                let (w, b) = self.qkv(l, part)?;
                let y = buf.layer_mut(s)?.f32(MIXED)?;
                Self::linear(be, n1, w, Some(b), self.dims(n, h, h), y)?;
            }
            self.lora_forward(
                be,
                a.lora.as_mut(),
                TowerTarget::Qkv,
                l,
                s,
                n,
                n1,
                vec![
                    a.q.layer_mut(s)?.f32(MIXED)?,
                    a.k.layer_mut(s)?.f32(MIXED)?,
                    a.v.layer_mut(s)?.f32(MIXED)?,
                ],
            )?;
            be.rope(a.q.layer_mut(s)?.f32(MIXED)?, cos, sin, nh, hd)?;
            be.rope(a.k.layer_mut(s)?.f32(MIXED)?, cos, sin, nh, hd)?;
        }
        let (dims, cu) = if c.full_attention(l) {
            (seg_full, &a.cu_full)
        } else {
            (seg_window, &a.cu_window)
        };
        let lse = ViewMut::item(&mut a.lse, s, n * nh)?;
        match (
            a.q.layer(s)?,
            a.k.layer(s)?,
            a.v.layer(s)?,
            a.att.layer_mut(s)?,
        ) {
            (Act::F32(q), Act::F32(k), Act::F32(v), ActMut::F32(out)) => {
                let attend = if self.attention_in_bf16(&dims) {
                    B::segment_attention_bf16
                } else {
                    B::segment_attention
                };
                attend(be, dims, cu, q, k, v, out, lse)?
            }
            (Act::Bf16(q), Act::Bf16(k), Act::Bf16(v), ActMut::Bf16(out16)) => {
                be.segment_attention_bf16_stored(dims, cu, q, k, v, None, Some(out16), lse)?
            }
            _ => return Err(mixed_dtypes()),
        }
        let att = a.att.layer(s)?;
        Self::linear_stored(
            be,
            att,
            self.lw(Slot::Proj, l, h * h)?,
            Some(self.w(Slot::ProjBias, l, h)?),
            self.dims(n, h, h),
            ActMut::F32(ViewMut::whole(&mut a.branch)),
        )?;
        if a.lora.is_some() {
            self.lora_forward(
                be,
                a.lora.as_mut(),
                TowerTarget::Proj,
                l,
                s,
                n,
                att.f32(LORA_F32)?,
                vec![ViewMut::whole(&mut a.branch)],
            )?;
        }
        // MLP block. With its activations in bf16 the residual add and the norm are one op
        // whose output is rounded once (`add_rmsnorm_bf16`: the bits of add then rmsnorm).
        match a.n2.layer_mut(s)? {
            ActMut::Bf16(n2) => be.add_rmsnorm_bf16(
                View::item(&a.resid, r_in, nc)?,
                View::whole(&a.branch),
                self.w(Slot::Norm2, l, h)?,
                EPS,
                h,
                ViewMut::item(&mut a.mid, s, nc)?,
                n2,
                ViewMut::item(&mut a.n2_rstd, s, n)?,
            )?,
            // RMSNorm: the same fusion in f32 (the bits of add then rmsnorm)
            ActMut::F32(n2) if !ln => be.add_rmsnorm(
                View::item(&a.resid, r_in, nc)?,
                View::whole(&a.branch),
                self.w(Slot::Norm2, l, h)?,
                EPS,
                h,
                ViewMut::item(&mut a.mid, s, nc)?,
                n2,
                ViewMut::item(&mut a.n2_rstd, s, n)?,
            )?,
            ActMut::F32(n2) => {
                be.add(
                    View::item(&a.resid, r_in, nc)?,
                    View::whole(&a.branch),
                    ViewMut::item(&mut a.mid, s, nc)?,
                )?;
                let mean = ln
                    .then(|| ViewMut::item(&mut a.n2_mean, s, n))
                    .transpose()?;
                self.norm(
                    be,
                    Slot::Norm2,
                    l,
                    View::item(&a.mid, s, nc)?,
                    n2,
                    mean,
                    ViewMut::item(&mut a.n2_rstd, s, n)?,
                )?;
            }
        }
        let n2 = a.n2.layer(s)?;
        Self::linear_stored(
            be,
            n2,
            self.lw(Slot::MlpIn, l, i * h)?,
            Some(self.w(Slot::MlpInBias, l, i)?),
            self.dims(n, h, i),
            a.mlp_in.layer_mut(s)?,
        )?;
        if a.lora.is_some() {
            let (x, y) = (n2.f32(LORA_F32)?, a.mlp_in.layer_mut(s)?.f32(LORA_F32)?);
            let la = a.lora.as_mut();
            self.lora_forward(be, la, TowerTarget::MlpIn, l, s, n, x, vec![y])?;
        }
        match c.mlp {
            VisionMlp::Plain(act) => {
                be.activation(
                    act,
                    a.mlp_in.layer(s)?.f32(PLAIN_F32)?,
                    a.mlp_act.layer_mut(s)?.f32(PLAIN_F32)?,
                )?;
            }
            VisionMlp::SwiGlu => {
                Self::linear_stored(
                    be,
                    n2,
                    self.lw(Slot::MlpUp, l, i * h)?,
                    Some(self.w(Slot::MlpUpBias, l, i)?),
                    self.dims(n, h, i),
                    a.mlp_up.layer_mut(s)?,
                )?;
                if a.lora.is_some() {
                    let (x, y) = (n2.f32(LORA_F32)?, a.mlp_up.layer_mut(s)?.f32(LORA_F32)?);
                    let la = a.lora.as_mut();
                    self.lora_forward(be, la, TowerTarget::MlpUp, l, s, n, x, vec![y])?;
                }
                match (
                    a.mlp_in.layer(s)?,
                    a.mlp_up.layer(s)?,
                    a.mlp_act.layer_mut(s)?,
                ) {
                    (Act::F32(g), Act::F32(u), ActMut::F32(o)) => be.swiglu(g, u, o)?,
                    (Act::Bf16(g), Act::Bf16(u), ActMut::Bf16(o)) => be.swiglu_bf16(g, u, o)?,
                    _ => return Err(mixed_dtypes()),
                }
            }
        }
        Self::linear_stored(
            be,
            a.mlp_act.layer(s)?,
            self.lw(Slot::MlpOut, l, h * i)?,
            Some(self.w(Slot::MlpOutBias, l, h)?),
            self.dims(n, i, h),
            ActMut::F32(ViewMut::whole(&mut a.branch)),
        )?;
        if a.lora.is_some() {
            let x = a.mlp_act.layer(s)?.f32(LORA_F32)?;
            let y = vec![ViewMut::whole(&mut a.branch)];
            self.lora_forward(be, a.lora.as_mut(), TowerTarget::MlpOut, l, s, n, x, y)?;
        }
        be.add(
            View::item(&a.mid, s, nc)?,
            View::whole(&a.branch),
            ViewMut::item(&mut a.resid, r_out, nc)?,
        )?;
        Ok(())
    }

    /// [`Self::linear`] over activations stored as the arena says: f32 both (over an f32
    /// weight or one stored in bf16), or a bf16 `x` into a bf16 or f32 `out` (under
    /// [`tower_act_layout`], which stores the weights in bf16 too) — the ops the decoder's
    /// bf16 blocks run on.
    fn linear_stored(
        be: &B,
        x: Act<'_, B>,
        w: TowerWeight<'_, B>,
        bias: Option<Tensor<'_, B>>,
        dims: LinearDims,
        out: ActMut<'_, B>,
    ) -> Result<(), ModelError> {
        match (x, w, out) {
            (Act::F32(x), TowerWeight::F32(w), ActMut::F32(out)) => {
                be.linear(x, w, bias, dims, out)?
            }
            (Act::F32(x), TowerWeight::Bf16(w), ActMut::F32(out)) => {
                be.linear_bf16(x, w, bias, dims, out)?
            }
            (Act::Bf16(x), TowerWeight::Bf16(w), ActMut::Bf16(out)) => {
                be.linear_bf16_io(x, w, bias, dims, out)?
            }
            (Act::Bf16(x), TowerWeight::Bf16(w), ActMut::F32(out)) => {
                be.linear_bf16_x(x, w, bias, dims, out)?
            }
            _ => return Err(mixed_dtypes()),
        }
        Ok(())
    }

    /// Backward of [`Self::linear_stored`]: as [`Self::linear_backward`], reading a bf16
    /// `x` as it is stored.
    #[allow(clippy::too_many_arguments)]
    fn linear_backward_stored(
        be: &B,
        dout: Tensor<'_, B>,
        x: Act<'_, B>,
        w: TowerWeight<'_, B>,
        dims: LinearDims,
        write: GradWrites,
        dx: Option<TensorMut<'_, B>>,
        (dw, db): (Option<TensorMut<'_, B>>, Option<TensorMut<'_, B>>),
    ) -> Result<(), ModelError> {
        match (x, w) {
            (Act::F32(x), TowerWeight::F32(w)) => {
                be.linear_backward(dout, x, w, dims, write, dx, dw, db)?
            }
            (Act::F32(x), TowerWeight::Bf16(w)) => {
                be.linear_backward_bf16(dout, x, w, dims, write, dx, dw, db)?
            }
            (Act::Bf16(x), TowerWeight::Bf16(w)) => {
                be.linear_backward_bf16_x(dout, x, w, dims, write, dx, dw, db)?
            }
            (Act::Bf16(_), TowerWeight::F32(_)) => return Err(mixed_dtypes()),
        }
        Ok(())
    }

    /// Backward of [`Self::forward`] (on an arena made with `keep = true`) from `dout`
    /// `[units, out_hidden]` (tower order): **adds** every trained parameter's gradient
    /// into `g` — the weights', or with LoRA pairs on the tower only the pairs' (the frozen
    /// weights get none).
    ///
    /// # Errors
    /// An arena without every block's activations, `dout` of the wrong length, gradients
    /// of another layout, or a backend failure.
    pub fn backward(
        &self,
        be: &B,
        a: &mut VisionActs<B>,
        dout: Tensor<'_, B>,
        g: &mut VisionGrads<B>,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        if !a.keep {
            return Err(ModelError::Unsupported {
                what: "vision backward on an inference arena (plan it with keep = true)".into(),
            });
        }
        let VisionGrads {
            base,
            lora: lg,
            half,
        } = g;
        let pairs = a.lora.as_ref().is_some_and(|l| l.applied);
        if base.is_none() && !pairs {
            return Err(ModelError::LayoutMismatch {
                what: "vision gradients (LoRA pairs' for a pass without them)",
            });
        }
        let (h, i, n, units, m) = (
            c.hidden,
            c.intermediate,
            a.plan.patches,
            a.plan.units,
            c.merged_dim(),
        );
        let (nh, hd) = (c.heads, c.head_dim);
        let (nc, ni) = (n * h, n * i);
        let ln = c.layer_norm();
        let mut d_resid = be.alloc(nc)?;
        let mut d_mid = be.alloc(nc)?;
        let mut d_norm = be.alloc(nc)?;
        let mut d_att = be.alloc(nc)?;
        let (mut dq, mut dk, mut dv) = (be.alloc(nc)?, be.alloc(nc)?, be.alloc(nc)?);
        let (mut d_act, mut d_in, mut d_up) = (be.alloc(ni)?, be.alloc(ni)?, be.alloc(ni)?);
        let (mut d_mh, mut d_ma) = (be.alloc(units * m)?, be.alloc(units * m)?);
        // a frozen LayerNorm's weight and bias gradients land here, unread
        let frozen_len = if base.is_none() && ln { h } else { 0 };
        let mut frozen_norm = [be.alloc(frozen_len)?, be.alloc(frozen_len)?];

        // Merger.
        let (w2, b2, dw) = linear_grads(
            (base.as_mut(), half.as_mut()),
            (Slot::Merger2, Slot::Merger2Bias),
            0,
            c.out_hidden * m,
            c.out_hidden,
        )?;
        Self::linear_backward(
            be,
            dout,
            View::whole(&a.merge_act),
            self.lw(Slot::Merger2, 0, c.out_hidden * m)?,
            self.dims(units, m, c.out_hidden),
            GradWrites {
                dx: GradWrite::Accumulate,
                dw,
            },
            Some(ViewMut::whole(&mut d_ma)),
            (w2, b2),
        )?;
        fold(be, half.as_mut(), Slot::Merger2, 0)?;
        self.lora_backward(
            be,
            a.lora.as_mut(),
            lg.as_mut(),
            TowerTarget::Merger2,
            0,
            0,
            units,
            vec![dout],
            View::whole(&a.merge_act),
            Some(ViewMut::whole(&mut d_ma)),
        )?;
        be.activation_backward(
            Activation::GeluErf,
            View::whole(&d_ma),
            View::whole(&a.merge_hidden),
            ViewMut::whole(&mut d_mh),
        )?;
        let (w0, b0, dw) = linear_grads(
            (base.as_mut(), half.as_mut()),
            (Slot::Merger0, Slot::Merger0Bias),
            0,
            m * m,
            m,
        )?;
        // each scratch gradient's first product writes it (β = 0), the rest add: no fills
        Self::linear_backward(
            be,
            View::whole(&d_mh),
            View::whole(&a.merge_norm),
            self.lw(Slot::Merger0, 0, m * m)?,
            self.dims(units, m, m),
            GradWrites {
                dx: GradWrite::Overwrite,
                dw,
            },
            Some(ViewMut::whole(&mut d_norm)),
            (w0, b0),
        )?;
        fold(be, half.as_mut(), Slot::Merger0, 0)?;
        self.lora_backward(
            be,
            a.lora.as_mut(),
            lg.as_mut(),
            TowerTarget::Merger0,
            0,
            0,
            units,
            vec![View::whole(&d_mh)],
            View::whole(&a.merge_norm),
            Some(ViewMut::whole(&mut d_norm)),
        )?;
        be.fill(ViewMut::whole(&mut d_resid), 0.0)?;
        let x = View::item(&a.resid, c.depth, nc)?;
        let mean = ln.then(|| View::whole(&a.merge_mean));
        self.norm_backward(
            be,
            (base.as_mut(), &mut frozen_norm),
            Slot::MergerNorm,
            0,
            View::whole(&d_norm),
            x,
            mean,
            View::whole(&a.merge_rstd),
            ViewMut::whole(&mut d_resid),
        )?;

        let seg_full = SegmentAttentionDims::new(n, a.plan.cu_full.len() - 1, nh, hd);
        let seg_window = SegmentAttentionDims::new(n, a.plan.cu_window.len() - 1, nh, hd);
        for l in (0..c.depth).rev() {
            if a.checkpointed {
                // not kept: block l's forward again, from its input
                self.block_forward(be, l, a)?;
            }
            let s = a.slot(l);
            // MLP block: resid_out = mid + MLP(Norm(mid)).
            be.copy(View::whole(&d_resid), ViewMut::whole(&mut d_mid))?;
            let (wo, bo, dw) = linear_grads(
                (base.as_mut(), half.as_mut()),
                (Slot::MlpOut, Slot::MlpOutBias),
                l,
                h * i,
                h,
            )?;
            let act = a.mlp_act.layer(s)?;
            Self::linear_backward_stored(
                be,
                View::whole(&d_resid),
                act,
                self.lw(Slot::MlpOut, l, h * i)?,
                self.dims(n, i, h),
                GradWrites {
                    dx: GradWrite::Overwrite,
                    dw,
                },
                Some(ViewMut::whole(&mut d_act)),
                (wo, bo),
            )?;
            fold(be, half.as_mut(), Slot::MlpOut, l)?;
            if a.lora.is_some() {
                let x = act.f32(LORA_F32)?;
                self.lora_backward(
                    be,
                    a.lora.as_mut(),
                    lg.as_mut(),
                    TowerTarget::MlpOut,
                    l,
                    s,
                    n,
                    vec![View::whole(&d_resid)],
                    x,
                    Some(ViewMut::whole(&mut d_act)),
                )?;
            }
            // d_norm: written by the first of up (SwiGLU) and in, added to by the other
            let mut d_norm_write = GradWrite::Overwrite;
            let n2 = a.n2.layer(s)?;
            match c.mlp {
                VisionMlp::Plain(act) => {
                    be.activation_backward(
                        act,
                        View::whole(&d_act),
                        a.mlp_in.layer(s)?.f32(PLAIN_F32)?,
                        ViewMut::whole(&mut d_in),
                    )?;
                }
                VisionMlp::SwiGlu => {
                    let (dg, du) = (ViewMut::whole(&mut d_in), ViewMut::whole(&mut d_up));
                    let da = View::whole(&d_act);
                    match (a.mlp_in.layer(s)?, a.mlp_up.layer(s)?) {
                        (Act::F32(g), Act::F32(u)) => be.swiglu_backward(da, g, u, dg, du)?,
                        (Act::Bf16(g), Act::Bf16(u)) => {
                            be.swiglu_backward_bf16(da, g, u, dg, du)?
                        }
                        _ => return Err(mixed_dtypes()),
                    }
                    let (wu, bu, dw) = linear_grads(
                        (base.as_mut(), half.as_mut()),
                        (Slot::MlpUp, Slot::MlpUpBias),
                        l,
                        i * h,
                        i,
                    )?;
                    Self::linear_backward_stored(
                        be,
                        View::whole(&d_up),
                        n2,
                        self.lw(Slot::MlpUp, l, i * h)?,
                        self.dims(n, h, i),
                        GradWrites {
                            dx: std::mem::replace(&mut d_norm_write, GradWrite::Accumulate),
                            dw,
                        },
                        Some(ViewMut::whole(&mut d_norm)),
                        (wu, bu),
                    )?;
                    fold(be, half.as_mut(), Slot::MlpUp, l)?;
                    if a.lora.is_some() {
                        self.lora_backward(
                            be,
                            a.lora.as_mut(),
                            lg.as_mut(),
                            TowerTarget::MlpUp,
                            l,
                            s,
                            n,
                            vec![View::whole(&d_up)],
                            n2.f32(LORA_F32)?,
                            Some(ViewMut::whole(&mut d_norm)),
                        )?;
                    }
                }
            }
            let (wi, bi, dw) = linear_grads(
                (base.as_mut(), half.as_mut()),
                (Slot::MlpIn, Slot::MlpInBias),
                l,
                i * h,
                i,
            )?;
            Self::linear_backward_stored(
                be,
                View::whole(&d_in),
                n2,
                self.lw(Slot::MlpIn, l, i * h)?,
                self.dims(n, h, i),
                GradWrites {
                    dx: d_norm_write,
                    dw,
                },
                Some(ViewMut::whole(&mut d_norm)),
                (wi, bi),
            )?;
            fold(be, half.as_mut(), Slot::MlpIn, l)?;
            if a.lora.is_some() {
                self.lora_backward(
                    be,
                    a.lora.as_mut(),
                    lg.as_mut(),
                    TowerTarget::MlpIn,
                    l,
                    s,
                    n,
                    vec![View::whole(&d_in)],
                    n2.f32(LORA_F32)?,
                    Some(ViewMut::whole(&mut d_norm)),
                )?;
            }
            let mean = ln.then(|| View::item(&a.n2_mean, s, n)).transpose()?;
            self.norm_backward(
                be,
                (base.as_mut(), &mut frozen_norm),
                Slot::Norm2,
                l,
                View::whole(&d_norm),
                View::item(&a.mid, s, nc)?,
                mean,
                View::item(&a.n2_rstd, s, n)?,
                ViewMut::whole(&mut d_mid),
            )?;

            // Attention block: mid = resid_in + proj(attention(rope(qkv(Norm(resid_in))))).
            be.copy(View::whole(&d_mid), ViewMut::whole(&mut d_resid))?;
            let (wp, bp, dw) = linear_grads(
                (base.as_mut(), half.as_mut()),
                (Slot::Proj, Slot::ProjBias),
                l,
                h * h,
                h,
            )?;
            let att = a.att.layer(s)?;
            Self::linear_backward_stored(
                be,
                View::whole(&d_mid),
                att,
                self.lw(Slot::Proj, l, h * h)?,
                self.dims(n, h, h),
                GradWrites {
                    dx: GradWrite::Overwrite,
                    dw,
                },
                Some(ViewMut::whole(&mut d_att)),
                (wp, bp),
            )?;
            fold(be, half.as_mut(), Slot::Proj, l)?;
            if a.lora.is_some() {
                self.lora_backward(
                    be,
                    a.lora.as_mut(),
                    lg.as_mut(),
                    TowerTarget::Proj,
                    l,
                    s,
                    n,
                    vec![View::whole(&d_mid)],
                    att.f32(LORA_F32)?,
                    Some(ViewMut::whole(&mut d_att)),
                )?;
            }
            let (dims, cu) = if c.full_attention(l) {
                (seg_full, &a.cu_full)
            } else {
                (seg_window, &a.cu_window)
            };
            let lse = View::item(&a.lse, s, n * nh)?;
            let (d_out, grads) = (
                View::whole(&d_att),
                [&mut dq, &mut dk, &mut dv].map(ViewMut::whole),
            );
            let [g_q, g_k, g_v] = grads;
            match (a.q.layer(s)?, a.k.layer(s)?, a.v.layer(s)?, att) {
                (Act::F32(q), Act::F32(k), Act::F32(v), Act::F32(out)) => {
                    let attend_backward = if self.attention_in_bf16(&dims) {
                        B::segment_attention_backward_bf16
                    } else {
                        B::segment_attention_backward
                    };
                    attend_backward(be, dims, cu, q, k, v, out, lse, d_out, g_q, g_k, g_v)?
                }
                (Act::Bf16(q), Act::Bf16(k), Act::Bf16(v), Act::Bf16(out16)) => be
                    .segment_attention_backward_bf16_stored(
                        dims,
                        cu,
                        q,
                        k,
                        v,
                        None,
                        Some(out16),
                        lse,
                        d_out,
                        g_q,
                        g_k,
                        g_v,
                    )?,
                _ => return Err(mixed_dtypes()),
            }
            let (cos, sin) = (View::whole(&a.cos), View::whole(&a.sin));
            be.rope_backward(ViewMut::whole(&mut dq), cos, sin, nh, hd)?;
            be.rope_backward(ViewMut::whole(&mut dk), cos, sin, nh, hd)?;
            let n1 = a.n1.layer(s)?;
            for (part, d) in [(0, &dq), (1, &dk), (2, &dv)] {
                let (w, _) = self.qkv(l, part)?;
                let (gw, gb, dw) = qkv_grads((base.as_mut(), half.as_mut()), l, part, h)?;
                Self::linear_backward_stored(
                    be,
                    View::whole(d),
                    n1,
                    w,
                    self.dims(n, h, h),
                    GradWrites {
                        // q's product writes d_norm, k's and v's add
                        dx: match part {
                            0 => GradWrite::Overwrite,
                            _ => GradWrite::Accumulate,
                        },
                        dw,
                    },
                    Some(ViewMut::whole(&mut d_norm)),
                    (gw, gb),
                )?;
            }
            fold(be, half.as_mut(), Slot::Qkv, l)?;
            if a.lora.is_some() {
                self.lora_backward(
                    be,
                    a.lora.as_mut(),
                    lg.as_mut(),
                    TowerTarget::Qkv,
                    l,
                    s,
                    n,
                    vec![View::whole(&dq), View::whole(&dk), View::whole(&dv)],
                    n1.f32(LORA_F32)?,
                    Some(ViewMut::whole(&mut d_norm)),
                )?;
            }
            let mean = ln.then(|| View::item(&a.n1_mean, s, n)).transpose()?;
            self.norm_backward(
                be,
                (base.as_mut(), &mut frozen_norm),
                Slot::Norm1,
                l,
                View::whole(&d_norm),
                View::item(&a.resid, l, nc)?,
                mean,
                View::item(&a.n1_rstd, s, n)?,
                ViewMut::whole(&mut d_resid),
            )?;
        }

        // Patch embedding (no gradient for the pixels).
        if let Some(g) = base.as_mut() {
            let (gp, dw) = match half.as_mut() {
                Some(h) => (h.scratch_mut(Slot::Patch)?, GradWrite::Overwrite),
                None => {
                    let gp = g.get_mut(Slot::Patch);
                    (
                        gp.ok_or_else(|| missing("patch grad"))?,
                        GradWrite::Accumulate,
                    )
                }
            };
            Self::linear_backward(
                be,
                View::whole(&d_resid),
                View::whole(&a.pixels),
                self.lw(Slot::Patch, 0, h * c.patch_dim())?,
                self.dims(n, c.patch_dim(), h),
                GradWrites {
                    dx: GradWrite::Accumulate,
                    dw,
                },
                None,
                (Some(ViewMut::whole(gp)), None),
            )?;
            fold(be, half.as_mut(), Slot::Patch, 0)?;
        }
        self.lora_backward(
            be,
            a.lora.as_mut(),
            lg.as_mut(),
            TowerTarget::Patch,
            0,
            0,
            n,
            vec![View::whole(&d_resid)],
            View::whole(&a.pixels),
            None,
        )?;
        if let Some(h) = half {
            h.keys.end_pass();
        }
        Ok(())
    }

    /// Backward of [`Self::norm`]: **adds** into `dx` and the weight's (and bias's)
    /// gradient — in `g`, or for a frozen tower (`None`) a LayerNorm's into the scratch
    /// pair `frozen` (`[dim]` each), RMSNorm's nowhere.
    #[allow(clippy::too_many_arguments)]
    fn norm_backward(
        &self,
        be: &B,
        (g, frozen): (Option<&mut VisionParams<B::Buffer>>, &mut [B::Buffer; 2]),
        slot: Slot,
        l: usize,
        dout: Tensor<'_, B>,
        x: Tensor<'_, B>,
        mean: Option<Tensor<'_, B>>,
        rstd: Tensor<'_, B>,
        dx: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let h = self.cfg.hidden;
        let w = self.w(slot, l, h)?;
        match (bias_slot(slot), mean) {
            (Some(bs), Some(mean)) if self.cfg.layer_norm() => match g {
                Some(g) => {
                    let (gw, gb) = grad_pair(Some(g), slot, bs, l, h, h)?;
                    let (gw, gb) = gw.zip(gb).ok_or_else(|| missing("norm grad"))?;
                    be.layer_norm_backward(dout, x, w, mean, rstd, h, dx, gw, gb)?;
                }
                None => {
                    let [fw, fb] = frozen;
                    let (gw, gb) = (ViewMut::whole(fw), ViewMut::whole(fb));
                    be.layer_norm_backward(dout, x, w, mean, rstd, h, dx, gw, gb)?;
                }
            },
            _ => {
                let gw = match g {
                    Some(g) => Some(ViewMut::item(
                        g.get_mut(slot).ok_or_else(|| missing("norm grad"))?,
                        l,
                        h,
                    )?),
                    None => None,
                };
                be.rmsnorm_backward(dout, x, w, rstd, h, dx, gw)?;
            }
        }
        Ok(())
    }
}

fn missing(what: &str) -> ModelError {
    ModelError::MissingWeight {
        name: format!("vision tower {what}"),
    }
}

/// The bias slot of a norm's weight slot.
fn bias_slot(slot: Slot) -> Option<Slot> {
    match slot {
        Slot::Norm1 => Some(Slot::Norm1Bias),
        Slot::Norm2 => Some(Slot::Norm2Bias),
        Slot::MergerNorm => Some(Slot::MergerNormBias),
        _ => None,
    }
}

/// Writable gradient views of a weight and its bias for block `l` (`None`s for a frozen
/// tower, `g = None`).
#[allow(clippy::type_complexity)]
fn grad_pair<'g, T: DeviceBuffer>(
    g: Option<&'g mut VisionParams<T>>,
    w: Slot,
    b: Slot,
    l: usize,
    w_len: usize,
    b_len: usize,
) -> Result<(Option<ViewMut<'g, T>>, Option<ViewMut<'g, T>>), ModelError> {
    let Some(g) = g else {
        return Ok((None, None));
    };
    let (gw, gb) = g
        .pair_mut(w, b)
        .ok_or_else(|| missing(&format!("{w:?} gradient")))?;
    Ok((
        Some(ViewMut::item(gw, l, w_len)?),
        Some(ViewMut::item(gb, l, b_len)?),
    ))
}

/// Block `l`'s gradient views of linear weight `w` and its bias `b`, and how the weight's
/// is written: added into its f32 gradient, or — a gradient kept in bf16 — written over in
/// its one-block scratch, which [`fold`] adds in after the product (`None`s for a frozen
/// tower).
#[allow(clippy::type_complexity)]
fn linear_grads<'g, B: Backend>(
    (base, half): (
        Option<&'g mut VisionParams<B::Buffer>>,
        Option<&'g mut TowerHalfGrads<B>>,
    ),
    (w, b): (Slot, Slot),
    l: usize,
    w_len: usize,
    b_len: usize,
) -> Result<
    (
        Option<TensorMut<'g, B>>,
        Option<TensorMut<'g, B>>,
        GradWrite,
    ),
    ModelError,
> {
    let Some(h) = half else {
        let (gw, gb) = grad_pair(base, w, b, l, w_len, b_len)?;
        return Ok((gw, gb, GradWrite::Accumulate));
    };
    let gb = match base {
        Some(g) => {
            let gb = g.get_mut(b).ok_or_else(|| missing("bias gradient"))?;
            Some(ViewMut::item(gb, l, b_len)?)
        }
        None => None,
    };
    let gw = ViewMut::new(h.scratch_mut(w)?, 0, w_len)?;
    Ok((Some(gw), gb, GradWrite::Overwrite))
}

/// [`linear_grads`] of rows `part` (q, k or v) of block `l`'s fused qkv weight and bias.
#[allow(clippy::type_complexity)]
fn qkv_grads<'g, B: Backend>(
    (base, half): (
        Option<&'g mut VisionParams<B::Buffer>>,
        Option<&'g mut TowerHalfGrads<B>>,
    ),
    l: usize,
    part: usize,
    h: usize,
) -> Result<
    (
        Option<TensorMut<'g, B>>,
        Option<TensorMut<'g, B>>,
        GradWrite,
    ),
    ModelError,
> {
    let Some(g) = base else {
        return Ok((None, None, GradWrite::Accumulate));
    };
    let (gw, gb) = g
        .pair_mut(Slot::Qkv, Slot::QkvBias)
        .ok_or_else(|| missing("qkv gradient"))?;
    let gb = ViewMut::new(gb, (l * 3 + part) * h, h)?;
    let (gw, dw) = match half {
        Some(half) => {
            let scratch = half.scratch_mut(Slot::Qkv)?;
            (
                ViewMut::new(scratch, part * h * h, h * h)?,
                GradWrite::Overwrite,
            )
        }
        None => (
            ViewMut::new(gw, (l * 3 + part) * h * h, h * h)?,
            GradWrite::Accumulate,
        ),
    };
    Ok((Some(gw), Some(gb), dw))
}

/// Adds `slot`'s scratch into block `l` of its bf16 gradient (nothing for f32 gradients).
fn fold<B: Backend>(
    be: &B,
    half: Option<&mut TowerHalfGrads<B>>,
    slot: Slot,
    l: usize,
) -> Result<(), ModelError> {
    match half {
        Some(h) => h.fold(be, slot, l),
        None => Ok(()),
    }
}
