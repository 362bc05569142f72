//! The vision tower's LoRA methods (`vision/lora.rs` has the pairs and what they are
//! made of): adding fresh pairs or an adapter's, downloading and merging them, and each
//! pair's forward and backward beside its layer's in `tower.rs`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use super::lora::{ArenaLayout, TOWER_TARGETS, TowerLora, TowerLoraActs, TowerTarget, b_part};
use super::tower::VisionTower;
use super::weights::param_table;
use crate::backend::{Backend, DeviceBuffer, Tensor, TensorMut, View, ViewMut};
use crate::hf::lora::{LoraAdapter, LoraConfig, LoraPair};
use crate::model::ModelError;
use crate::model::lora::{LoraParams, PairShape, PairStack, lora_error, uniform};
use crate::model::weights::Stack;

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
            let missing = || lora_error("a tower target the tower lacks");
            match self.stored.as_mut().and_then(|s| s.get_mut(t.slot())) {
                // stored in bf16: merged in f32, rounded back to nearest
                Some(half) => {
                    let mut w = be.alloc(half.len())?;
                    be.widen_bf16(View::whole(&*half), ViewMut::whole(&mut w))?;
                    p.add_delta(
                        be,
                        lora.scale,
                        lora.config.r,
                        io,
                        &mut w,
                        io.0 * io.1,
                        false,
                    )?;
                    be.round_bf16(View::whole(&w), ViewMut::whole(half))?;
                }
                None => {
                    let w = self.weights.get_mut(t.slot()).ok_or_else(missing)?;
                    p.add_delta(be, lora.scale, lora.config.r, io, w, io.0 * io.1, false)?;
                }
            }
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
        let adapted = |t: TowerTarget| lora.params.pairs[t as usize].is_some();
        let layout = ArenaLayout::new(&self.cfg, lora.config.r, adapted, patches, units, blocks);
        let mut u: [Option<Stack<B>>; TOWER_TARGETS] = std::array::from_fn(|_| None);
        for (slot, lens) in u.iter_mut().zip(layout.u) {
            if let Some((total, item)) = lens {
                *slot = Some(Stack::new(be.alloc(total)?, item));
            }
        }
        Ok(Some(TowerLoraActs {
            u,
            tmp: be.alloc(layout.tmp)?,
            du: be.alloc(layout.du)?,
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
        let (inp, _) = t.in_out(&self.cfg);
        PairShape::new(rows, inp, t.part_out(&self.cfg), r, self.precision)
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
