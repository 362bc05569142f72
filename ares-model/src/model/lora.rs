//! LoRA training on the decoder's linear layers: the base weights frozen, a pair `A`
//! `[r, in]`, `B` `[out, r]` trained on each adapted projection, which computes
//!
//! ```text
//! y = x·Wᵀ (+ bias) + s · (x·Aᵀ)·Bᵀ          s = lora_alpha / r  (rsLoRA: / √r)
//! ```
//!
//! as PEFT's `lora.Linear` does (no dropout). Forward and backward of one pair, side by
//! side (`u = x·Aᵀ` `[N, r]` is kept for the backward pass):
//!
//! ```text
//! forward                      backward, from dy = ∂L/∂y
//! u  = x·Aᵀ                    ds = s·dy
//! t  = u·Bᵀ                    dB += dsᵀ·u ;  du = ds·B
//! y += s·t                     dA += duᵀ·x ;  dx += du·A   (the frozen W adds dy·W)
//! ```
//!
//! Each target's pairs are stacked over layers like the weights (`A` `[L, r, in]`, `B` `[L,
//! out, r]`); a layer outside `layers_to_transform` holds a zero pair, whose gradients are
//! zero, so it stays zero under AdamW and is left out of the saved adapter. Fresh pairs
//! are initialised as PEFT's default (`init_lora_weights=True`): `A` from
//! `kaiming_uniform_(a=√5)`, i.e. uniform on `±1/√in`, and `B = 0`, so a fresh adapter
//! changes nothing. With the adapters turned off ([`Model::adapters_off`]) the model is the
//! base model, bit for bit: the reference policy of a LoRA run without a second copy.

use std::sync::atomic::{AtomicBool, Ordering};

use super::act_dtype::{Act, ActMut, MLP_PAIR};
use super::weights::Stack;
use super::{Model, ModelError, ModelSpec};
use crate::backend::{
    Backend, DeviceBuffer, GradWrites, LinearDims, MatmulPrecision, Tensor, TensorMut, View,
    ViewMut,
};
use crate::hf::lora::{LoraAdapter, LoraConfig, LoraPair, TARGETS, is_target_name, weight_name};

/// A projection of a decoder layer a pair can sit on, in [`TARGETS`] order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    /// Every target, in [`TARGETS`] order.
    pub(crate) const ALL: [Self; 7] = [
        Self::Q,
        Self::K,
        Self::V,
        Self::O,
        Self::Gate,
        Self::Up,
        Self::Down,
    ];

    /// PEFT's module name (`q_proj`, …).
    pub(crate) fn name(self) -> &'static str {
        TARGETS[self as usize]
    }

    /// `(in, out)` features of the projection.
    fn in_out(self, s: &ModelSpec) -> (usize, usize) {
        let (c, i, qd, kvd) = (s.hidden, s.intermediate, s.q_dim(), s.kv_dim());
        match self {
            Self::Q => (c, qd),
            Self::K | Self::V => (c, kvd),
            Self::O => (qd, c),
            Self::Gate | Self::Up => (c, i),
            Self::Down => (i, c),
        }
    }
}

/// One target's pairs over every layer.
pub(crate) struct PairStack<B: Backend> {
    /// `[L, r, in]`.
    pub(crate) a: Stack<B>,
    /// `[L, out, r]`.
    pub(crate) b: Stack<B>,
}

/// The pairs of every adapted target (or their gradients, or anything laid out alike), `N`
/// targets: the decoder's 7 ([`Target`]) or the vision tower's.
pub(crate) struct LoraParams<B: Backend, const N: usize = 7> {
    pub(crate) pairs: [Option<PairStack<B>>; N],
}

impl<B: Backend, const N: usize> LoraParams<B, N> {
    /// Every buffer: each adapted target's `A` then `B`, in [`Target::ALL`] order.
    pub(crate) fn buffers(&self) -> Vec<&B::Buffer> {
        self.pairs
            .iter()
            .flatten()
            .flat_map(|p| [p.a.buffer(), p.b.buffer()])
            .collect()
    }

    /// [`Self::buffers`], writable.
    pub(crate) fn buffers_mut(&mut self) -> Vec<&mut B::Buffer> {
        self.pairs
            .iter_mut()
            .flatten()
            .flat_map(|p| {
                let PairStack { a, b } = p;
                [a.buffer_mut(), b.buffer_mut()]
            })
            .collect()
    }

    /// One layer's tensor length of each of [`Self::buffers`].
    pub(crate) fn buffer_items(&self) -> Vec<usize> {
        self.pairs
            .iter()
            .flatten()
            .flat_map(|p| [p.a.item(), p.b.item()])
            .collect()
    }

    /// A zeroed copy of the same layout (gradients).
    pub(crate) fn zeros_like(&self, be: &B) -> Result<Self, ModelError> {
        let mut pairs: [Option<PairStack<B>>; N] = std::array::from_fn(|_| None);
        for (slot, p) in pairs.iter_mut().zip(&self.pairs) {
            if let Some(p) = p {
                *slot = Some(PairStack {
                    a: p.a.zeros_like(be)?,
                    b: p.b.zeros_like(be)?,
                });
            }
        }
        Ok(Self { pairs })
    }

    /// The pair of target number `target` at `layer`: `(A, B)`, when the target is adapted.
    pub(crate) fn pair_at(
        &self,
        target: usize,
        layer: usize,
    ) -> Result<Option<[Tensor<'_, B>; 2]>, ModelError> {
        match &self.pairs[target] {
            None => Ok(None),
            Some(p) => Ok(Some([p.a.layer(layer)?, p.b.layer(layer)?])),
        }
    }
}

impl<B: Backend> LoraParams<B> {
    /// The pair of `target` at `layer`: `(A, B)`, when the target is adapted.
    fn pair(&self, target: Target, layer: usize) -> Result<Option<[Tensor<'_, B>; 2]>, ModelError> {
        self.pair_at(target as usize, layer)
    }

    /// Where the tensor named `name` (see [`lora_tensor_name`]) lives: its buffer's index
    /// in [`Self::buffers`] and its layer.
    pub(crate) fn locate(&self, name: &str) -> Option<(usize, usize)> {
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let mut index = 0;
        for t in Target::ALL {
            let Some(p) = &self.pairs[t as usize] else {
                continue;
            };
            let layers = p.a.len() / p.a.item().max(1);
            for (k, which) in ["A", "B"].into_iter().enumerate() {
                let suffix = lora_tensor_name(0, t, which);
                let suffix = suffix.strip_prefix("model.layers.0.")?;
                if rest == suffix && layer < layers {
                    return Some((index + k, layer));
                }
            }
            index += 2;
        }
        None
    }
}

/// The name of `which` (`A` or `B`) of the pair on `target` of layer `layer` in gradients
/// and optimizer state files: `model.layers.{layer}.self_attn.q_proj.lora_A.weight`
/// (PEFT's module names, without its `base_model.model.` prefix).
pub(crate) fn lora_tensor_name(layer: usize, target: Target, which: &str) -> String {
    let w = weight_name(layer, target.name());
    format!("{}.lora_{which}.weight", w.trim_end_matches(".weight"))
}

/// A model's adapters: configuration, scale, pairs, and whether the passes apply them.
pub(crate) struct Lora<B: Backend> {
    pub(crate) config: LoraConfig,
    /// `s` (f32, as PEFT multiplies the f32 product by the Python float).
    pub(crate) scale: f32,
    pub(crate) params: LoraParams<B>,
    /// Off: the passes are the base model's ([`Model::adapters_off`]).
    pub(crate) enabled: AtomicBool,
}

/// The LoRA intermediates of one pass: `u = x·Aᵀ` `[N, r]` per adapted target and kept
/// layer, and two per-layer scratch buffers of the backward pass (`t`/`ds` `[N, max out]`,
/// `du` `[N, r]`).
pub(crate) struct LoraActs<B: Backend> {
    u: [Option<Stack<B>>; 7],
    tmp: B::Buffer,
    du: B::Buffer,
    /// Whether the last forward pass applied the adapters (its backward must).
    pub(crate) applied: bool,
}

impl<B: Backend> std::fmt::Debug for Lora<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lora")
            .field("config", &self.config)
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> std::fmt::Debug for LoraActs<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraActs")
            .field("elements", &self.elements())
            .field("applied", &self.applied)
            .finish_non_exhaustive()
    }
}

/// The adapters a pass applies, with its intermediates.
pub(crate) type ActiveLora<'a, B> = (&'a Lora<B>, &'a mut LoraActs<B>);

/// Floats of the LoRA intermediates of an arena for `n` tokens, `kept` layers and `config`'s targets: the
/// memory plan's figure (the same sums as the allocation).
pub fn lora_arena_elements(spec: &ModelSpec, config: &LoraConfig, n: u64, kept: u64) -> u64 {
    let r = config.r as u64;
    let mut targets = 0;
    let mut widest = 0;
    for t in Target::ALL {
        if config.adapts_module(t.name()) {
            targets += 1;
            widest = widest.max(t.in_out(spec).1 as u64);
        }
    }
    n * (kept * targets * r + widest + r)
}

impl<B: Backend> LoraActs<B> {
    /// The intermediates for `n` tokens with `kept` layers of `u` kept.
    pub(crate) fn new(
        be: &B,
        spec: &ModelSpec,
        lora: &Lora<B>,
        n: usize,
        kept: usize,
    ) -> Result<Self, ModelError> {
        let r = lora.config.r;
        let overflow = || ModelError::BatchShape { batch: n, seq: 1 };
        let mut u: [Option<Stack<B>>; 7] = Default::default();
        let mut widest = 0;
        for (t, slot) in Target::ALL.into_iter().zip(&mut u) {
            if lora.params.pairs[t as usize].is_some() {
                let item = n.checked_mul(r).ok_or_else(overflow)?;
                let total = item.checked_mul(kept).ok_or_else(overflow)?;
                *slot = Some(Stack::new(be.alloc(total)?, item));
                widest = widest.max(t.in_out(spec).1);
            }
        }
        Ok(Self {
            u,
            tmp: be.alloc(n.checked_mul(widest).ok_or_else(overflow)?)?,
            du: be.alloc(n.checked_mul(r).ok_or_else(overflow)?)?,
            applied: false,
        })
    }

    /// Floats held.
    pub(crate) fn elements(&self) -> usize {
        self.u.iter().flatten().map(Stack::len).sum::<usize>() + self.tmp.len() + self.du.len()
    }
}

/// Uniform draws on `[-bound, bound)` from a xorshift64* stream (`seed`, stream `k`): the
/// same numbers on every backend and thread count.
pub(crate) fn uniform(n: usize, bound: f32, seed: u64, k: u64) -> Vec<f32> {
    let mut state = (seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
    (0..n)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let u = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u32 << 24) as f32;
            (2.0 * u - 1.0) * bound
        })
        .collect()
}

pub(crate) fn lora_error(message: impl Into<String>) -> ModelError {
    ModelError::Lora {
        message: message.into(),
    }
}

impl<B: Backend> Model<B> {
    /// Adds fresh LoRA adapters as `config` says (PEFT's default initialisation, `A` drawn
    /// from `seed`): from now on the base weights are frozen and [`Model::grads`],
    /// [`super::AdamW`] and the passes train the pairs only. Arenas planned before this call
    /// lack the adapters' intermediates: plan new ones.
    ///
    /// # Errors
    /// [`ModelError::Lora`] for a rank of 0, a target that is not a linear layer of a
    /// decoder layer, a layer past the model's, or a model that has adapters already; a
    /// backend failure.
    pub fn add_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<(), ModelError> {
        self.add_lora_with(config, seed, true)
    }

    /// [`Model::add_lora`]; `need_pairs`: refuse a config that selects no decoder module
    /// (a vision-language model's may adapt its tower only).
    pub(crate) fn add_lora_with(
        &mut self,
        config: &LoraConfig,
        seed: u64,
        need_pairs: bool,
    ) -> Result<(), ModelError> {
        self.check_lora_config(config, need_pairs)?;
        self.install_lora(config, |t, layer, adapted, r, (inp, out)| {
            let a = if adapted {
                let bound = 1.0 / (inp as f32).sqrt();
                uniform(
                    r * inp,
                    bound,
                    seed,
                    (layer * TARGETS.len() + t as usize) as u64,
                )
            } else {
                vec![0.0; r * inp]
            };
            Ok((a, vec![0.0; out * r]))
        })
    }

    /// Installs the adapter `adapter` (read from PEFT's files, [`LoraAdapter::read`]) for
    /// training, as [`Model::add_lora`] does with fresh pairs.
    ///
    /// # Errors
    /// As [`Model::add_lora`]; a pair missing for an adapted weight or of the wrong shape.
    pub fn load_lora(&mut self, adapter: &LoraAdapter) -> Result<(), ModelError> {
        self.load_lora_with(adapter, true)
    }

    /// [`Model::load_lora`]; `need_pairs` as in [`Model::add_lora_with`].
    pub(crate) fn load_lora_with(
        &mut self,
        adapter: &LoraAdapter,
        need_pairs: bool,
    ) -> Result<(), ModelError> {
        self.check_lora_config(&adapter.config, need_pairs)?;
        self.install_lora(&adapter.config, |t, layer, adapted, r, (inp, out)| {
            if !adapted {
                return Ok((vec![0.0; r * inp], vec![0.0; out * r]));
            }
            let name = weight_name(layer, t.name());
            let pair = adapter
                .pairs
                .get(&name)
                .ok_or_else(|| lora_error(format!("the adapter has no pair for {name}")))?;
            if pair.out_in != [out, inp] || pair.a.len() != r * inp || pair.b.len() != out * r {
                return Err(lora_error(format!(
                    "the pair for {name} is for a [{}, {}] weight with rank {r}; the model's is \
                     [{out}, {inp}]",
                    pair.out_in[0], pair.out_in[1]
                )));
            }
            Ok((pair.a.clone(), pair.b.clone()))
        })
    }

    fn check_lora_config(&self, config: &LoraConfig, need_pairs: bool) -> Result<(), ModelError> {
        if self.lora.is_some() {
            return Err(lora_error("the model has LoRA adapters already"));
        }
        if config.r == 0 {
            return Err(lora_error("rank r = 0: a LoRA pair needs r >= 1"));
        }
        if !(config.lora_alpha.is_finite() && config.lora_alpha > 0.0) {
            return Err(lora_error(format!(
                "lora_alpha = {}: expected finite and > 0",
                config.lora_alpha
            )));
        }
        if config.target_modules.is_empty() {
            return Err(lora_error(
                "target_modules is empty: nothing would be trained",
            ));
        }
        if let Some(bad) = config.target_modules.iter().find(|m| !is_target_name(m)) {
            return Err(lora_error(format!(
                "target module {bad:?} is not a linear layer (expected some of {}, or a vision \
                 tower's qkv, proj, fc1, fc2, mlp.0, mlp.2)",
                TARGETS.join(", ")
            )));
        }
        if need_pairs && !TARGETS.iter().any(|t| config.adapts_module(t)) {
            return Err(lora_error(format!(
                "target_modules [{}] selects no linear layer of the decoder (expected some of {})",
                config.target_modules.join(", "),
                TARGETS.join(", ")
            )));
        }
        if let Some(bad) = config
            .layers_to_transform
            .iter()
            .flatten()
            .find(|&&l| l >= self.spec.layers)
        {
            return Err(lora_error(format!(
                "layers_to_transform names layer {bad}; the model has {} layers",
                self.spec.layers
            )));
        }
        Ok(())
    }

    /// Uploads the pairs `pair(target, layer, adapted, r, (in, out))` gives for every
    /// target of `config`, and turns the adapters on.
    #[allow(clippy::type_complexity)]
    fn install_lora(
        &mut self,
        config: &LoraConfig,
        mut pair: impl FnMut(
            Target,
            usize,
            bool,
            usize,
            (usize, usize),
        ) -> Result<(Vec<f32>, Vec<f32>), ModelError>,
    ) -> Result<(), ModelError> {
        let be = &self.backend;
        let (r, layers) = (config.r, self.spec.layers);
        let mut pairs: [Option<PairStack<B>>; 7] = Default::default();
        for (t, slot) in Target::ALL.into_iter().zip(&mut pairs) {
            if !config.adapts_module(t.name()) {
                continue;
            }
            let (inp, out) = t.in_out(&self.spec);
            let (ia, ib) = (r * inp, out * r);
            let mut a = be.alloc(ia * layers)?;
            let mut b = be.alloc(ib * layers)?;
            for l in 0..layers {
                let (ha, hb) = pair(t, l, config.adapts(l, t.name()), r, (inp, out))?;
                be.upload(&ha, ViewMut::item(&mut a, l, ia)?)?;
                be.upload(&hb, ViewMut::item(&mut b, l, ib)?)?;
            }
            *slot = Some(PairStack {
                a: Stack::new(a, ia),
                b: Stack::new(b, ib),
            });
        }
        self.lora = Some(Lora {
            config: config.clone(),
            scale: config.scale() as f32,
            params: LoraParams { pairs },
            enabled: AtomicBool::new(true),
        });
        Ok(())
    }

    /// The adapters' configuration, if the model has adapters.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref().map(|l| &l.config)
    }

    /// The adapters as PEFT writes them (pairs of the adapted layers only), copied to the
    /// host; `None` without adapters.
    ///
    /// # Errors
    /// A backend failure.
    pub fn lora_adapter(&self) -> Result<Option<LoraAdapter>, ModelError> {
        let Some(lora) = &self.lora else {
            return Ok(None);
        };
        let be = &self.backend;
        let r = lora.config.r;
        let mut pairs = std::collections::BTreeMap::new();
        for t in Target::ALL {
            let (inp, out) = t.in_out(&self.spec);
            for l in 0..self.spec.layers {
                let Some([a, b]) = lora.params.pair(t, l)? else {
                    continue;
                };
                if !lora.config.adapts(l, t.name()) {
                    continue;
                }
                let (mut ha, mut hb) = (vec![0.0; r * inp], vec![0.0; out * r]);
                be.download(a, &mut ha)?;
                be.download(b, &mut hb)?;
                let pair = LoraPair {
                    a: ha,
                    b: hb,
                    out_in: [out, inp],
                    kernel: Vec::new(),
                };
                pairs.insert(weight_name(l, t.name()), pair);
            }
        }
        Ok(Some(LoraAdapter {
            config: lora.config.clone(),
            pairs,
            language_model: false,
        }))
    }

    /// Turns the adapters off until the guard is dropped: the passes are the base
    /// model's, bit for bit (the reference policy of a LoRA run). Without adapters the
    /// guard does nothing.
    pub fn adapters_off(&self) -> AdaptersOff<'_> {
        AdaptersOff::new([self.lora.as_ref().map(|l| &l.enabled), None])
    }

    /// The flag that turns the adapters on and off, if the model has any.
    pub(crate) fn lora_flag(&self) -> Option<&AtomicBool> {
        self.lora.as_ref().map(|l| &l.enabled)
    }

    /// Whether the passes apply adapters (the model has some, turned on).
    pub fn adapters_active(&self) -> bool {
        self.lora
            .as_ref()
            .is_some_and(|l| l.enabled.load(Ordering::SeqCst))
    }

    /// The scratch of a pass over `n` tokens keeping `kept` layers (`None` without
    /// adapters).
    pub(crate) fn lora_acts(
        &self,
        n: usize,
        kept: usize,
    ) -> Result<Option<LoraActs<B>>, ModelError> {
        self.lora
            .as_ref()
            .map(|l| LoraActs::new(&self.backend, &self.spec, l, n, kept))
            .transpose()
    }

    /// The adapters the forward pass applies now, with their intermediates, or `None`
    /// (no adapters, turned off, or decode weights `tw` with the adapters merged in).
    pub(crate) fn active_lora<'a>(
        &'a self,
        acts: Option<&'a mut LoraActs<B>>,
        decode: bool,
    ) -> Result<Option<ActiveLora<'a, B>>, ModelError> {
        let Some(lora) = self
            .lora
            .as_ref()
            .filter(|_| self.adapters_active() && !decode)
        else {
            if let Some(a) = acts {
                a.applied = false;
            }
            return Ok(None);
        };
        let acts = acts.ok_or_else(|| {
            lora_error(
                "the activations were planned before the adapters were added: plan them again",
            )
        })?;
        acts.applied = true;
        Ok(Some((lora, acts)))
    }

    /// Whether a LoRA pair sits on the MLP (gate, up or down), whose products read f32
    /// activations.
    pub(crate) fn lora_adapts_mlp(&self) -> bool {
        self.lora_adapts(&[Target::Gate, Target::Up, Target::Down])
    }

    /// Whether a LoRA pair adapts q, k or v (it reads the input norm's output in f32).
    pub(crate) fn lora_adapts_qkv(&self) -> bool {
        self.lora_adapts(&[Target::Q, Target::K, Target::V])
    }

    /// Whether a LoRA pair adapts o (it reads the attention's output in f32).
    pub(crate) fn lora_adapts_o(&self) -> bool {
        self.lora_adapts(&[Target::O])
    }

    /// Whether a LoRA pair adapts one of `targets`.
    fn lora_adapts(&self, targets: &[Target]) -> bool {
        self.lora.as_ref().is_some_and(|l| {
            targets
                .iter()
                .any(|&t| l.params.pairs[t as usize].is_some())
        })
    }

    /// Forward of `target`'s pair at layer `layer` (its `u` in slot `slot`): `y += s ·
    /// (x·Aᵀ)·Bᵀ` for the `n` rows of `x`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lora_forward(
        &self,
        (lora, la): (&Lora<B>, &mut LoraActs<B>),
        target: Target,
        layer: usize,
        slot: usize,
        n: usize,
        x: Act<'_, B>,
        y: ActMut<'_, B>,
    ) -> Result<(), ModelError> {
        let Some([a, b]) = lora.params.pair(target, layer)? else {
            return Ok(());
        };
        let (x, y) = (x.f32(MLP_PAIR)?, y.f32(MLP_PAIR)?);
        let (inp, out) = target.in_out(&self.spec);
        let shape = PairShape::new(n, inp, out, lora.config.r, self.matmul_precision);
        let LoraActs { u, tmp, .. } = la;
        let u = u[target as usize]
            .as_mut()
            .ok_or_else(|| lora_error("the activations were planned for other adapters"))?;
        let be = &self.backend;
        shape.down(be, x, a, u.layer_mut(slot)?)?;
        shape.up(be, lora.scale, u.layer(slot)?, b, tmp, y)
    }

    /// Backward of [`Model::lora_forward`] from `dy`: adds into the pair's gradients in
    /// `grads` and `du·A` into `dx` (the frozen weight's `dy·W` is the caller's).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lora_backward(
        &self,
        (lora, la): (&Lora<B>, &mut LoraActs<B>),
        grads: &mut LoraParams<B>,
        target: Target,
        layer: usize,
        slot: usize,
        n: usize,
        dy: Tensor<'_, B>,
        x: Act<'_, B>,
        dx: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let Some([a, b]) = lora.params.pair(target, layer)? else {
            return Ok(());
        };
        let x = x.f32(MLP_PAIR)?;
        let g = grads.pairs[target as usize]
            .as_mut()
            .ok_or(ModelError::LayoutMismatch { what: "gradients" })?;
        let (inp, out) = target.in_out(&self.spec);
        let shape = PairShape::new(n, inp, out, lora.config.r, self.matmul_precision);
        let LoraActs { u, tmp, du, .. } = la;
        let u = u[target as usize]
            .as_ref()
            .ok_or_else(|| lora_error("the activations were planned for other adapters"))?;
        let be = &self.backend;
        be.fill(ViewMut::whole(du), 0.0)?;
        let du = &mut *du;
        shape.up_backward(
            be,
            lora.scale,
            dy,
            u.layer(slot)?,
            b,
            tmp,
            du,
            g.b.layer_mut(layer)?,
        )?;
        shape.down_backward(be, du, x, a, Some(dx), g.a.layer_mut(layer)?)
    }
}

/// The shape of one pair's pass: `rows` rows of `in` features to `out`, rank `r`. Its four
/// steps are the whole of a pair's arithmetic, for the decoder's pairs and the vision
/// tower's alike:
///
/// ```text
/// down:           u  = x·Aᵀ                 down_backward:  dA += duᵀ·x ;  dx += du·A
/// up:             y += s·(u·Bᵀ)             up_backward:    ds = s·dy ;  dB += dsᵀ·u ;  du += ds·B
/// ```
#[derive(Debug, Clone, Copy)]
pub(crate) struct PairShape {
    rows: usize,
    inp: usize,
    out: usize,
    r: usize,
    precision: MatmulPrecision,
}

impl PairShape {
    pub(crate) fn new(
        rows: usize,
        inp: usize,
        out: usize,
        r: usize,
        precision: MatmulPrecision,
    ) -> Self {
        Self {
            rows,
            inp,
            out,
            r,
            precision,
        }
    }

    fn dims(&self, in_features: usize, out_features: usize) -> LinearDims {
        LinearDims {
            rows: self.rows,
            in_features,
            out_features,
            precision: self.precision,
        }
    }

    /// `u = x·Aᵀ` (`u` `[rows, r]`, overwritten).
    pub(crate) fn down<B: Backend>(
        &self,
        be: &B,
        x: Tensor<'_, B>,
        a: Tensor<'_, B>,
        u: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        be.linear(x, a, None, self.dims(self.inp, self.r), u)?;
        Ok(())
    }

    /// `y += s·(u·Bᵀ)`, the product in scratch `tmp` (at least `rows · out` long).
    pub(crate) fn up<B: Backend>(
        &self,
        be: &B,
        scale: f32,
        u: Tensor<'_, B>,
        b: Tensor<'_, B>,
        tmp: &mut B::Buffer,
        y: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let len = self.rows * self.out;
        be.linear(
            u,
            b,
            None,
            self.dims(self.r, self.out),
            ViewMut::new(tmp, 0, len)?,
        )?;
        be.axpy(scale, View::new(tmp, 0, len)?, y)?;
        Ok(())
    }

    /// Backward of [`PairShape::up`] from `dy`: `dB += dsᵀ·u` and `du += ds·B`, with
    /// `ds = s·dy` in scratch `tmp`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn up_backward<B: Backend>(
        &self,
        be: &B,
        scale: f32,
        dy: Tensor<'_, B>,
        u: Tensor<'_, B>,
        b: Tensor<'_, B>,
        tmp: &mut B::Buffer,
        du: &mut B::Buffer,
        db: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let len = self.rows * self.out;
        be.fill(ViewMut::new(tmp, 0, len)?, 0.0)?;
        be.axpy(scale, dy, ViewMut::new(tmp, 0, len)?)?;
        be.linear_backward(
            View::new(tmp, 0, len)?,
            u,
            b,
            self.dims(self.r, self.out),
            GradWrites::ACCUMULATE,
            Some(ViewMut::new(du, 0, self.rows * self.r)?),
            Some(db),
            None,
        )?;
        Ok(())
    }

    /// Backward of [`PairShape::down`] from `du`: `dA += duᵀ·x` and, when given, `dx +=
    /// du·A`.
    pub(crate) fn down_backward<B: Backend>(
        &self,
        be: &B,
        du: &B::Buffer,
        x: Tensor<'_, B>,
        a: Tensor<'_, B>,
        dx: Option<TensorMut<'_, B>>,
        da: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        be.linear_backward(
            View::new(du, 0, self.rows * self.r)?,
            x,
            a,
            self.dims(self.inp, self.r),
            GradWrites::ACCUMULATE,
            dx,
            Some(da),
            None,
        )?;
        Ok(())
    }
}

/// Turns a model's adapters back on when dropped ([`Model::adapters_off`]).
#[derive(Debug)]
pub struct AdaptersOff<'a> {
    /// Each flag turned off, with what it was.
    flags: [Option<(&'a AtomicBool, bool)>; 2],
}

impl<'a> AdaptersOff<'a> {
    /// Turns `flags` off (a language model's and a vision tower's adapters).
    pub(crate) fn new(flags: [Option<&'a AtomicBool>; 2]) -> Self {
        Self {
            flags: flags.map(|f| f.map(|f| (f, f.swap(false, Ordering::SeqCst)))),
        }
    }
}

impl Drop for AdaptersOff<'_> {
    fn drop(&mut self) {
        for (f, was) in self.flags.iter().flatten() {
            f.store(*was, Ordering::SeqCst);
        }
    }
}

impl<B: Backend> Lora<B> {
    /// Adds `s·(B·A)` of `target`'s pair at every layer to `w`, the layer stack of that
    /// projection: `[L, out, in]`, or with `transposed` the decode copy `[L, in, out]`
    /// (`s·Aᵀ·Bᵀ`). Nothing when the target is not adapted.
    pub(crate) fn add_delta(
        &self,
        be: &B,
        spec: &ModelSpec,
        target: Target,
        w: &mut Stack<B>,
        transposed: bool,
    ) -> Result<(), ModelError> {
        let Some(p) = &self.params.pairs[target as usize] else {
            return Ok(());
        };
        let stride = w.item();
        let io = target.in_out(spec);
        p.add_delta(
            be,
            self.scale,
            self.config.r,
            io,
            w.buffer_mut(),
            stride,
            transposed,
        )
    }
}

impl<B: Backend> PairStack<B> {
    /// Adds `s·(B·A)` (`[out, in]`, or with `transposed` `s·Aᵀ·Bᵀ` `[in, out]`) of each
    /// layer `l`'s pair (rank `r`) to the `out·in` values of `w` from `l·stride`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_delta(
        &self,
        be: &B,
        scale: f32,
        r: usize,
        (inp, out): (usize, usize),
        w: &mut B::Buffer,
        stride: usize,
        transposed: bool,
    ) -> Result<(), ModelError> {
        let mut at = be.alloc(inp * r)?;
        let mut delta = be.alloc(inp * out)?;
        let layers = self.a.len() / self.a.item().max(1);
        for l in 0..layers {
            // Aᵀ [in, r]; then Aᵀ·Bᵀ = linear(Aᵀ, B) [in, out] or B·A = linear(B, Aᵀ) [out, in]
            be.transpose(self.a.layer(l)?, r, inp, ViewMut::whole(&mut at))?;
            let (x, wt, rows, cols) = if transposed {
                (View::whole(&at), self.b.layer(l)?, inp, out)
            } else {
                (self.b.layer(l)?, View::whole(&at), out, inp)
            };
            let dims = LinearDims {
                rows,
                in_features: r,
                out_features: cols,
                precision: MatmulPrecision::F32,
            };
            be.linear(x, wt, None, dims, ViewMut::whole(&mut delta))?;
            be.axpy(
                scale,
                View::whole(&delta),
                ViewMut::new(w, l * stride, inp * out)?,
            )?;
        }
        Ok(())
    }
}

impl<B: Backend> Model<B> {
    /// The adapters when the passes apply them (generation merges them into its decode
    /// weights).
    pub(crate) fn active_lora_params(&self) -> Option<&Lora<B>> {
        self.lora.as_ref().filter(|_| self.adapters_active())
    }
}

impl<B: Backend> Model<B> {
    /// Merges the adapters into the base weights on the device (`W ← W + s·B·A`, peft's
    /// `merge_and_unload`) and removes them: the model is then an ordinary one (to save as
    /// a full checkpoint). Without adapters, nothing happens. Arenas planned before keep
    /// LoRA intermediates the passes no longer use.
    ///
    /// # Errors
    /// A backend failure.
    pub fn merge_lora(&mut self) -> Result<(), ModelError> {
        let Some(lora) = self.lora.take() else {
            return Ok(());
        };
        let (be, spec, w) = (&self.backend, &self.spec, &mut self.weights);
        match self.bf16_weights.as_mut().filter(|c| c.master) {
            // weights stored in bf16: merged in f32, rounded back to nearest
            Some(copies) => {
                for t in Target::ALL {
                    let copy = copies.by_index_mut(t as usize)?;
                    let mut merged = copy.widened(be)?;
                    lora.add_delta(be, spec, t, &mut merged, false)?;
                    copy.round_from(be, merged.whole())?;
                }
            }
            None => {
                for t in Target::ALL {
                    let stack = match t {
                        Target::Q => &mut w.q,
                        Target::K => &mut w.k,
                        Target::V => &mut w.v,
                        Target::O => &mut w.o,
                        Target::Gate => &mut w.gate,
                        Target::Up => &mut w.up,
                        Target::Down => &mut w.down,
                    };
                    lora.add_delta(be, spec, t, stack, false)?;
                }
            }
        }
        self.refresh_bf16_weights(None)
    }
}
