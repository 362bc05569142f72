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

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use super::config::VisionConfig;
use super::tower::VisionTower;
use super::weights::{Slot, param_table};
use crate::backend::{Backend, DeviceBuffer, Tensor, TensorMut, View, ViewMut};
use crate::hf::lora::{LoraAdapter, LoraConfig, LoraPair, TOWER, tower_module};
use crate::model::ModelError;
use crate::model::lora::{LoraParams, PairShape, PairStack, lora_error, uniform};
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

    /// Its module path (block index left out: `attn.qkv`) and parameter name
    /// (`blocks.{}.attn.qkv.weight`) in a tower of `cfg`, `None` when the tower has no such
    /// layer (the SwiGLU up projection of Qwen2-VL).
    fn names(self, cfg: &VisionConfig) -> Option<(&'static str, &'static str)> {
        let spec = param_table(cfg)
            .into_iter()
            .find(|s| s.slot == self.slot())?;
        Some((tower_module(spec.slot, spec.name)?, spec.name))
    }

    /// Pairs of this target: `depth` or 1.
    fn count(self, cfg: &VisionConfig) -> usize {
        if self.per_block() { cfg.depth } else { 1 }
    }

    /// The name of block `l`'s adapted weight as [`LoraAdapter::pairs`] keys it.
    fn weight_name(self, cfg: &VisionConfig, l: usize) -> Option<String> {
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
    u: [Option<Stack<B>>; TOWER_TARGETS],
    tmp: B::Buffer,
    du: B::Buffer,
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
fn rows(t: TowerTarget, patches: usize, units: usize) -> usize {
    match t {
        TowerTarget::Merger0 | TowerTarget::Merger2 => units,
        _ => patches,
    }
}

/// Floats of the tower's LoRA intermediates for `patches` patches, `units` merged tokens
/// and `blocks` kept block slots, under `config` (the memory plan's figure; the same sums as
/// the allocation).
pub fn tower_lora_elements(
    cfg: &VisionConfig,
    config: &LoraConfig,
    patches: u64,
    units: u64,
    blocks: u64,
) -> u64 {
    let r = config.r as u64;
    let (mut u, mut tmp, mut widest_rows) = (0, 0, 0);
    for t in TowerTarget::ALL {
        let Some((path, _)) = t.names(cfg) else {
            continue;
        };
        if !config.adapts_tower(path) {
            continue;
        }
        let n = rows(t, patches as usize, units as usize) as u64;
        let slots = if t.per_block() { blocks } else { 1 };
        u += slots * n * r;
        let out = if t == TowerTarget::Qkv {
            cfg.hidden
        } else {
            t.in_out(cfg).1
        };
        tmp = tmp.max(n * out as u64);
        widest_rows = widest_rows.max(n);
    }
    u + tmp + widest_rows * r
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

impl<B: Backend> VisionTower<B> {
    /// Adds fresh LoRA pairs to the tower's modules `config` selects ([`LoraConfig::adapts_tower`];
    /// PEFT's default initialisation, `A` drawn from `seed`): the tower's base weights are
    /// frozen from now on. Returns whether any module was adapted (none: nothing changes).
    ///
    /// # Errors
    /// [`ModelError::Lora`] for a tower with adapters already or a rank of 0; a backend
    /// failure.
    pub fn add_lora(&mut self, be: &B, config: &LoraConfig, seed: u64) -> Result<bool, ModelError> {
        self.install_lora(
            be,
            config,
            |t, l, r, (inp, _out)| {
                let bound = 1.0 / (inp as f32).sqrt();
                // streams apart from the decoder's (layer · 7 + target)
                let k = (1u64 << 32) + (l * TOWER_TARGETS + t as usize) as u64;
                Ok(uniform(r * inp, bound, seed, k))
            },
            |_, _| Ok(None),
        )
    }

    /// Installs the tower's pairs of `adapter` (read with [`LoraAdapter::read_vl`]) for
    /// training. Returns whether it has any.
    ///
    /// # Errors
    /// As [`VisionTower::add_lora`]; a pair missing or of the wrong shape.
    pub fn load_lora(&mut self, be: &B, adapter: &LoraAdapter) -> Result<bool, ModelError> {
        let cfg = self.config().clone();
        let get = |t: TowerTarget, l: usize| -> Result<&LoraPair, ModelError> {
            let name = t
                .weight_name(&cfg, l)
                .ok_or_else(|| lora_error("a tower target the tower lacks"))?;
            adapter
                .pairs
                .get(&name)
                .ok_or_else(|| lora_error(format!("the adapter has no pair for {name}")))
        };
        self.install_lora(
            be,
            &adapter.config,
            |t, l, r, (inp, out)| {
                let p = get(t, l)?;
                if p.out_in != [out, inp] || p.a.len() != r * inp {
                    return Err(lora_error(format!(
                        "the pair for {} is for a [{}, {}] weight; the tower's is [{out}, {inp}]",
                        t.weight_name(&cfg, l).unwrap_or_default(),
                        p.out_in[0],
                        p.out_in[1]
                    )));
                }
                Ok(p.a.clone())
            },
            |t, l| Ok(Some(get(t, l)?.b.clone())),
        )
    }

    /// Uploads the pairs (`A` from `pair_a(target, block, r, (in, out))`, `B` from `pair_b`
    /// or zero) of every tower module `config` selects; turns them on.
    fn install_lora(
        &mut self,
        be: &B,
        config: &LoraConfig,
        mut pair_a: impl FnMut(
            TowerTarget,
            usize,
            usize,
            (usize, usize),
        ) -> Result<Vec<f32>, ModelError>,
        mut pair_b: impl FnMut(TowerTarget, usize) -> Result<Option<Vec<f32>>, ModelError>,
    ) -> Result<bool, ModelError> {
        if self.lora.is_some() {
            return Err(lora_error("the vision tower has LoRA adapters already"));
        }
        if config.r == 0 {
            return Err(lora_error("rank r = 0: a LoRA pair needs r >= 1"));
        }
        let cfg = self.config().clone();
        config.tower_weights(&cfg).map_err(lora_error)?;
        let r = config.r;
        let mut pairs: [Option<PairStack<B>>; TOWER_TARGETS] = std::array::from_fn(|_| None);
        let mut any = false;
        for (t, slot) in TowerTarget::ALL.into_iter().zip(&mut pairs) {
            let Some((path, _)) = t.names(&cfg) else {
                continue;
            };
            if !config.adapts_tower(path) {
                continue;
            }
            let (inp, out) = t.in_out(&cfg);
            let (ia, ib) = (r * inp, out * r);
            let n = t.count(&cfg);
            let mut a = be.alloc(ia * n)?;
            let mut b = be.alloc(ib * n)?;
            for l in 0..n {
                let ha = pair_a(t, l, r, (inp, out))?;
                let hb = pair_b(t, l)?.unwrap_or_else(|| vec![0.0; ib]);
                if hb.len() != ib {
                    return Err(lora_error(format!(
                        "the pair for {} has a B of {} values; rank {r} needs {ib}",
                        t.weight_name(&cfg, l).unwrap_or_default(),
                        hb.len()
                    )));
                }
                be.upload(&ha, ViewMut::item(&mut a, l, ia)?)?;
                be.upload(&hb, ViewMut::item(&mut b, l, ib)?)?;
            }
            *slot = Some(PairStack {
                a: Stack::new(a, ia),
                b: Stack::new(b, ib),
            });
            any = true;
        }
        if any {
            self.lora = Some(TowerLora {
                config: config.clone(),
                scale: config.scale() as f32,
                params: LoraParams { pairs },
                enabled: AtomicBool::new(true),
            });
        }
        Ok(any)
    }

    /// Whether the tower has LoRA pairs (its base frozen).
    pub fn has_lora(&self) -> bool {
        self.lora.is_some()
    }

    /// The tower's pairs copied to the host, keyed as [`LoraAdapter::pairs`] keys them
    /// (`visual.blocks.0.attn.qkv.weight`); empty without adapters.
    ///
    /// # Errors
    /// A backend failure.
    pub fn lora_pairs(&self, be: &B) -> Result<BTreeMap<String, LoraPair>, ModelError> {
        let mut out = BTreeMap::new();
        let Some(lora) = &self.lora else {
            return Ok(out);
        };
        let cfg = &self.cfg;
        let r = lora.config.r;
        let table = param_table(cfg);
        for t in TowerTarget::ALL {
            let (inp, outf) = t.in_out(cfg);
            for l in 0..t.count(cfg) {
                let Some([a, b]) = lora.params.pair_at(t as usize, l)? else {
                    continue;
                };
                let (mut ha, mut hb) = (vec![0.0; r * inp], vec![0.0; outf * r]);
                be.download(a, &mut ha)?;
                be.download(b, &mut hb)?;
                let kernel = match table.iter().find(|s| s.slot == t.slot()) {
                    Some(spec) if spec.shape.len() > 2 => spec.shape[1..].to_vec(),
                    _ => Vec::new(),
                };
                let name = t
                    .weight_name(cfg, l)
                    .ok_or_else(|| lora_error("a tower target the tower lacks"))?;
                out.insert(
                    name,
                    LoraPair {
                        a: ha,
                        b: hb,
                        out_in: [outf, inp],
                        kernel,
                    },
                );
            }
        }
        Ok(out)
    }

    /// Merges the pairs into the base weights (`W ← W + s·B·A`) and removes them.
    ///
    /// # Errors
    /// A backend failure.
    pub fn merge_lora(&mut self, be: &B) -> Result<(), ModelError> {
        let Some(lora) = self.lora.take() else {
            return Ok(());
        };
        let cfg = self.cfg.clone();
        for t in TowerTarget::ALL {
            let Some(p) = &lora.params.pairs[t as usize] else {
                continue;
            };
            let io = t.in_out(&cfg);
            let w = self
                .weights
                .get_mut(t.slot())
                .ok_or_else(|| lora_error("a tower target the tower lacks"))?;
            p.add_delta(be, lora.scale, lora.config.r, io, w, io.0 * io.1, false)?;
        }
        Ok(())
    }

    /// The adapters when the passes apply them.
    pub(crate) fn active_lora(&self) -> Option<&TowerLora<B>> {
        self.lora
            .as_ref()
            .filter(|l| l.enabled.load(Ordering::SeqCst))
    }

    /// The flag that turns the tower's adapters on and off, if it has any.
    pub(crate) fn lora_flag(&self) -> Option<&AtomicBool> {
        self.lora.as_ref().map(|l| &l.enabled)
    }

    /// The intermediates of a call over `patches` patches and `units` merged tokens with
    /// `blocks` block slots kept (`None` without adapters).
    pub(crate) fn lora_acts(
        &self,
        be: &B,
        patches: usize,
        units: usize,
        blocks: usize,
    ) -> Result<Option<TowerLoraActs<B>>, ModelError> {
        let Some(lora) = &self.lora else {
            return Ok(None);
        };
        let cfg = &self.cfg;
        let r = lora.config.r;
        let mut u: [Option<Stack<B>>; TOWER_TARGETS] = std::array::from_fn(|_| None);
        let (mut tmp, mut widest) = (0, 0);
        for (t, slot) in TowerTarget::ALL.into_iter().zip(&mut u) {
            if lora.params.pairs[t as usize].is_none() {
                continue;
            }
            let n = rows(t, patches, units);
            let slots = if t.per_block() { blocks } else { 1 };
            *slot = Some(Stack::new(be.alloc(slots * n * r)?, n * r));
            let out = if t == TowerTarget::Qkv {
                cfg.hidden
            } else {
                t.in_out(cfg).1
            };
            tmp = tmp.max(n * out);
            widest = widest.max(n);
        }
        Ok(Some(TowerLoraActs {
            u,
            tmp: be.alloc(tmp)?,
            du: be.alloc(widest * r)?,
            applied: false,
        }))
    }

    /// Marks whether this pass applies the adapters (before a forward).
    pub(crate) fn begin_lora(&self, la: Option<&mut TowerLoraActs<B>>) -> Result<(), ModelError> {
        match (self.active_lora(), la) {
            (None, Some(la)) => la.applied = false,
            (None, None) => {}
            (Some(_), Some(la)) => la.applied = true,
            (Some(_), None) => {
                return Err(lora_error(
                    "the tower's activations were planned before its adapters were added: plan them again",
                ));
            }
        }
        Ok(())
    }

    fn shape(&self, t: TowerTarget, rows: usize, r: usize) -> PairShape {
        let (inp, out) = t.in_out(&self.cfg);
        let out = if t == TowerTarget::Qkv { out / 3 } else { out };
        PairShape::new(rows, inp, out, r, self.precision)
    }

    /// Forward of target `t`'s pair of block `l` (`u` in slot `slot`): `y += s·(x·Aᵀ)·Bᵀ`
    /// over `rows` rows; for the fused qkv, `ys` are q, k, v, each adding its part.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lora_forward(
        &self,
        be: &B,
        la: Option<&mut TowerLoraActs<B>>,
        t: TowerTarget,
        l: usize,
        slot: usize,
        rows: usize,
        x: Tensor<'_, B>,
        ys: Vec<TensorMut<'_, B>>,
    ) -> Result<(), ModelError> {
        let (Some(lora), Some(la)) = (self.active_lora(), la) else {
            return Ok(());
        };
        let Some(p) = &lora.params.pairs[t as usize] else {
            return Ok(());
        };
        let shape = self.shape(t, rows, lora.config.r);
        let TowerLoraActs { u, tmp, .. } = la;
        let u = u[t as usize]
            .as_mut()
            .ok_or_else(|| lora_error("the activations were planned for other adapters"))?;
        shape.down(be, x, p.a.layer(l)?, u.layer_mut(slot)?)?;
        for (part, y) in ys.into_iter().enumerate() {
            let b = b_part(p, t, l, part, &self.cfg, lora.config.r)?;
            shape.up(be, lora.scale, u.layer(slot)?, b, tmp, y)?;
        }
        Ok(())
    }

    /// Backward of [`VisionTower::lora_forward`] from `dys` (one per part): adds into the
    /// pair's gradients in `g` and, when given, `du·A` into `dx`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lora_backward(
        &self,
        be: &B,
        la: Option<&mut TowerLoraActs<B>>,
        g: Option<&mut LoraParams<B, TOWER_TARGETS>>,
        t: TowerTarget,
        l: usize,
        slot: usize,
        rows: usize,
        dys: Vec<Tensor<'_, B>>,
        x: Tensor<'_, B>,
        dx: Option<TensorMut<'_, B>>,
    ) -> Result<(), ModelError> {
        let Some(la) = la.filter(|la| la.applied) else {
            return Ok(());
        };
        let Some(lora) = &self.lora else {
            return Ok(());
        };
        let Some(p) = &lora.params.pairs[t as usize] else {
            return Ok(());
        };
        let gp =
            g.and_then(|g| g.pairs[t as usize].as_mut())
                .ok_or(ModelError::LayoutMismatch {
                    what: "vision LoRA gradients",
                })?;
        let r = lora.config.r;
        let shape = self.shape(t, rows, r);
        let TowerLoraActs { u, tmp, du, .. } = la;
        let u = u[t as usize]
            .as_ref()
            .ok_or_else(|| lora_error("the activations were planned for other adapters"))?;
        be.fill(ViewMut::whole(du), 0.0)?;
        let PairStack { a: ga, b: gb } = gp;
        let (_, out) = t.in_out(&self.cfg);
        let part_len = out / dys.len().max(1) * r;
        for (part, dy) in dys.into_iter().enumerate() {
            let b = b_part(p, t, l, part, &self.cfg, r)?;
            let at = l * gb.item() + part * part_len;
            let db = ViewMut::new(gb.buffer_mut(), at, part_len)?;
            shape.up_backward(be, lora.scale, dy, u.layer(slot)?, b, tmp, du, db)?;
        }
        shape.down_backward(be, du, x, p.a.layer(l)?, dx, ga.layer_mut(l)?)
    }
}

/// Rows `part·h..(part+1)·h` of block `l`'s qkv `B` (`[3h, r]`), or the whole `B` of
/// another target.
fn b_part<'p, B: Backend>(
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
