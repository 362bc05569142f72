//! [`VlModel`]: a Qwen2-VL / Qwen2.5-VL model on a backend — the language model
//! ([`Model`]) and the vision tower ([`VisionTower`]) — and how a batch with images and
//! videos becomes one forward pass:
//!
//! 1. the tower runs once over every image and video of the batch (images first, then
//!    videos, each in prompt order), giving one embedding per `<|image_pad|>` /
//!    `<|video_pad|>` token;
//! 2. the language model embeds the tokens and replaces the placeholders' rows by those
//!    embeddings ([`ForwardExtras::embeds`]);
//! 3. rotary angles come from the 3-D M-RoPE positions of [`rope_index`] instead of the
//!    1-D lookup ([`ForwardExtras::rope`]).

use std::borrow::Borrow;

use super::checkpoint::VlCheckpoint;
use super::config::VlConfig;
use super::mrope::{MropePositions, MropeRope, VisionGrids, rope_index};
use super::processor::{ProcessedImage, ProcessedVideo};
use super::tower::{VisionActs, VisionGrads, VisionPlan, VisionTower, input_error};
use crate::backend::{Backend, Tensor, View, ViewMut};
use crate::hf::lora::{LoraAdapter, LoraConfig, TARGETS};
use crate::model::{
    Activations, EmbedGrad, ForwardExtras, GenerateError, GenerateOutput, GenerateRequest,
    Generator, Grads, Inputs, Model, ModelError, PromptVision,
};
use crate::model::{
    AdamW, AdaptersOff, Engine, EngineConfig, ExtraParam, Moments, StateDtype, StepReport,
    WeightDtype, WeightStorage,
};

/// The images and videos of one batch, as the processor gives them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VisionBatch {
    /// `pixel_values` of every image, concatenated in prompt order `[patches, patch_dim]`.
    pub image_pixels: Vec<f32>,
    /// `image_grid_thw`, one per image.
    pub image_grids: Vec<[usize; 3]>,
    /// `pixel_values_videos` of every video, concatenated.
    pub video_pixels: Vec<f32>,
    /// `video_grid_thw`, one per video.
    pub video_grids: Vec<[usize; 3]>,
    /// `second_per_grid_ts`, one per video (`temporal_patch_size / fps`; Qwen2.5-VL).
    pub second_per_grid_ts: Vec<f64>,
}

impl VisionBatch {
    /// The batch of one prompt's processed images and videos, in prompt order;
    /// `second_per_grid_ts` one per video (`temporal_patch_size / fps`, Qwen2.5-VL) or empty.
    pub fn from_processed(
        images: &[ProcessedImage],
        videos: &[ProcessedVideo],
        second_per_grid_ts: &[f64],
    ) -> Self {
        let mut out = Self::default();
        for i in images {
            out.image_pixels.extend_from_slice(&i.pixel_values);
            out.image_grids.push(i.grid_thw);
        }
        for v in videos {
            out.video_pixels.extend_from_slice(&v.pixel_values_videos);
            out.video_grids.push(v.video_grid_thw);
        }
        out.second_per_grid_ts = second_per_grid_ts.to_vec();
        out
    }

    /// Whether the batch has no image and no video.
    pub fn is_empty(&self) -> bool {
        self.image_grids.is_empty() && self.video_grids.is_empty()
    }
}

/// A batch prepared for the language model: M-RoPE positions and tables, and where the
/// tower's rows go.
#[derive(Debug, Clone, PartialEq)]
pub struct MultimodalLayout {
    /// 3-D positions and `rope_deltas`.
    pub positions: MropePositions,
    /// cos `[batch · seq, head_dim/2]`.
    pub cos: Vec<f32>,
    /// sin `[batch · seq, head_dim/2]`.
    pub sin: Vec<f32>,
    /// Flattened token index of each of the tower's merged rows (tower order).
    pub rows: Vec<u32>,
    /// The tower's plan (`None`: a text-only batch).
    pub plan: Option<VisionPlan>,
    /// Packed sequences (`cu_seqlens` of a single row, [`ForwardExtras::segments`]): set
    /// by [`MultimodalLayout::packed`]; `None` for padded rows.
    pub segments: Option<Vec<u32>>,
}

impl MultimodalLayout {
    /// This layout — made for padded rows — moved to the same tokens packed back to back in
    /// one row (`cu_seqlens`, one segment a sequence): packed token `j` takes padded token
    /// `from[j]`'s positions and rotary rows (`None`: a padding token, at position 0), and
    /// each placeholder row follows its token. A token's M-RoPE positions depend on its own
    /// sequence alone, so computing them padded and moving them is exact.
    ///
    /// # Errors
    /// [`ModelError::VisionInput`]: a `from` index past the padded tokens, two packed tokens
    /// from one padded token, or a placeholder whose token is not packed.
    pub fn packed(&self, from: &[Option<usize>], cu_seqlens: Vec<u32>) -> Result<Self, ModelError> {
        let n = self.positions.batch * self.positions.seq;
        let half = self.cos.len() / n.max(1);
        let mut to = vec![None; n];
        for (j, f) in from.iter().enumerate() {
            if let Some(i) = *f {
                match to.get_mut(i) {
                    Some(slot @ None) => *slot = Some(j as u32),
                    _ => {
                        return Err(input_error(format!(
                            "packed token {j} from padded token {i}: past the {n} padded \
                             tokens or taken twice"
                        )));
                    }
                }
            }
        }
        let m = from.len();
        let mut position_ids = vec![0u32; 3 * m];
        // position 0's rotary row: cos 1, sin 0
        let (mut cos, mut sin) = (vec![1.0f32; m * half], vec![0.0f32; m * half]);
        for (j, f) in from.iter().enumerate() {
            let Some(i) = *f else { continue };
            for axis in 0..3 {
                position_ids[axis * m + j] = self.positions.position_ids[axis * n + i];
            }
            cos[j * half..(j + 1) * half].copy_from_slice(&self.cos[i * half..(i + 1) * half]);
            sin[j * half..(j + 1) * half].copy_from_slice(&self.sin[i * half..(i + 1) * half]);
        }
        let rows = self
            .rows
            .iter()
            .map(|&r| {
                to.get(r as usize).copied().flatten().ok_or_else(|| {
                    input_error(format!("the placeholder at padded token {r} is not packed"))
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            positions: MropePositions {
                batch: 1,
                seq: m,
                position_ids,
                rope_deltas: vec![0],
            },
            cos,
            sin,
            rows,
            plan: self.plan.clone(),
            segments: Some(cu_seqlens),
        })
    }
}

/// What [`VlModel::forward`] keeps for the backward pass besides the language model's
/// arena: the tower's activations and the placeholder rows (`None` for a text-only batch).
pub struct VlActs<B: Backend> {
    /// The tower's arena and the device ids of the placeholder rows.
    pub tower: Option<(VisionActs<B>, B::Ids)>,
}

/// AdamW moments of the vision tower's trained parameters ([`VlModel::vision_moments`]),
/// one per [`VisionTower::trainable_names`] entry: each weight slot stacked over blocks, or
/// each LoRA pair's `A` and `B` stacked over blocks.
pub struct VisionMoments<B: Backend> {
    /// The moments of each trained parameter.
    pub(crate) moments: Vec<Moments<B>>,
    /// How they are stored (short slots keep f32 under `int8`).
    pub(crate) state_dtype: StateDtype,
}

/// A vision-language model on backend `B`.
pub struct VlModel<B: Backend> {
    lm: Model<B>,
    tower: VisionTower<B>,
    config: VlConfig,
    mrope: MropeRope,
}

impl<B: Backend> VlModel<B> {
    /// Builds the model of a loaded checkpoint on `backend`.
    ///
    /// # Errors
    /// As [`Model::new`] and [`VisionTower::new`].
    pub fn from_checkpoint(backend: B, ck: &VlCheckpoint) -> Result<Self, ModelError> {
        let c = &ck.config;
        let mrope =
            MropeRope::new(c.text.head_dim, c.text.rope.theta, c.mrope_section).map_err(|e| {
                ModelError::Unsupported {
                    what: e.to_string(),
                }
            })?;
        let tower = VisionTower::new(&backend, &c.vision, &ck.vision)?;
        let lm = Model::new(backend, &c.text, &ck.text)?;
        Ok(Self {
            lm,
            tower,
            config: c.clone(),
            mrope,
        })
    }

    /// The language model.
    pub fn lm(&self) -> &Model<B> {
        &self.lm
    }

    /// The language model, mutably (precision, optimizer).
    pub fn lm_mut(&mut self) -> &mut Model<B> {
        &mut self.lm
    }

    /// The vision tower.
    pub fn tower(&self) -> &VisionTower<B> {
        &self.tower
    }

    /// The vision tower, mutably.
    pub fn tower_mut(&mut self) -> &mut VisionTower<B> {
        &mut self.tower
    }

    /// Stores the weight matrices of the language model and of the tower in `storage`
    /// ([`Model::set_weight_storage`], [`VisionTower::set_weight_storage`]).
    ///
    /// # Errors
    /// A backend failure.
    pub fn set_weight_storage(&mut self, storage: WeightStorage) -> Result<(), ModelError> {
        self.lm.set_weight_storage(storage)?;
        self.tower.set_weight_storage(self.lm.backend(), storage)
    }

    /// The config.
    pub fn config(&self) -> &VlConfig {
        &self.config
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        self.lm.backend()
    }

    /// Positions, rotary tables and placeholder rows of a batch of expanded prompts
    /// `input_ids` `[batch, seq]` with `attention_mask`, and its images and videos.
    ///
    /// # Errors
    /// A placeholder count that does not match the grids, an invalid grid, lengths that do
    /// not fit `batch`.
    pub fn layout(
        &self,
        input_ids: &[u32],
        attention_mask: &[u32],
        batch: usize,
        vision: &VisionBatch,
    ) -> Result<MultimodalLayout, ModelError> {
        self.layout_prompts(input_ids, attention_mask, batch, vision, None)
    }

    /// [`Self::layout`] of prompt + response rows whose prompts fill the first
    /// `prompt_cols` columns (`None`: every column is prompt): placeholder ids in the
    /// responses are text there (a sampled `<|image_pad|>` is a token like any other, at
    /// a text position, as generation treated it).
    ///
    /// # Errors
    /// As [`Self::layout`].
    pub fn layout_prompts(
        &self,
        input_ids: &[u32],
        attention_mask: &[u32],
        batch: usize,
        vision: &VisionBatch,
        prompt_cols: Option<usize>,
    ) -> Result<MultimodalLayout, ModelError> {
        let c = &self.config;
        let neutral;
        let input_ids = match prompt_cols {
            Some(p) if batch > 0 && input_ids.len().is_multiple_of(batch) => {
                let seq = input_ids.len() / batch;
                let pads = [c.tokens.image_pad, c.tokens.video_pad];
                // an id that is neither placeholder
                let text = (0..3u32).find(|t| !pads.contains(t)).unwrap_or(0);
                neutral = input_ids
                    .iter()
                    .enumerate()
                    .map(|(i, &t)| {
                        if i % seq >= p && pads.contains(&t) {
                            text
                        } else {
                            t
                        }
                    })
                    .collect::<Vec<u32>>();
                neutral.as_slice()
            }
            _ => input_ids,
        };
        let spt = (!vision.video_grids.is_empty() && !vision.second_per_grid_ts.is_empty())
            .then_some(vision.second_per_grid_ts.as_slice());
        let grids = VisionGrids {
            images: &vision.image_grids,
            videos: &vision.video_grids,
            second_per_grid_ts: spt,
        };
        let positions = rope_index(&c.mrope(), input_ids, batch, Some(attention_mask), &grids)
            .map_err(|e| input_error(e.to_string()))?;
        let half = c.text.head_dim / 2;
        let n = input_ids.len();
        let (mut cos, mut sin) = (vec![0.0; n * half], vec![0.0; n * half]);
        self.mrope
            .cos_sin(&positions.position_ids, &mut cos, &mut sin)
            .map_err(|e| input_error(e.to_string()))?;
        if vision.is_empty() {
            return Ok(MultimodalLayout {
                positions,
                cos,
                sin,
                rows: Vec::new(),
                plan: None,
                segments: None,
            });
        }
        let mut all = vision.image_grids.clone();
        all.extend(&vision.video_grids);
        let plan = VisionPlan::new(&c.vision, &all)?;
        // Placeholder positions in flattened order, images' then videos'.
        let pads = |id: u32| -> Vec<u32> {
            (0..n as u32)
                .filter(|&i| input_ids[i as usize] == id && attention_mask[i as usize] == 1)
                .collect()
        };
        let (image_rows, video_rows) = (pads(c.tokens.image_pad), pads(c.tokens.video_pad));
        let m2 = c.vision.spatial_merge_size * c.vision.spatial_merge_size;
        let units = |grids: &[[usize; 3]]| {
            grids
                .iter()
                .map(|g| g.iter().product::<usize>() / m2)
                .sum::<usize>()
        };
        let (image_units, video_units) = (units(&vision.image_grids), units(&vision.video_grids));
        for (what, found, need) in [
            ("<|image_pad|>", image_rows.len(), image_units),
            ("<|video_pad|>", video_rows.len(), video_units),
        ] {
            if found != need {
                return Err(input_error(format!(
                    "the prompts hold {found} {what} tokens, the grids need {need} \
                     (one per merged patch: expand each placeholder first)"
                )));
            }
        }
        let rows = plan
            .unit_order
            .iter()
            .map(|&u| {
                let u = u as usize;
                if u < image_units {
                    image_rows[u]
                } else {
                    video_rows[u - image_units]
                }
            })
            .collect();
        Ok(MultimodalLayout {
            positions,
            cos,
            sin,
            rows,
            plan: Some(plan),
            segments: None,
        })
    }

    /// The tower's pixel rows of `vision`: images then videos.
    pub fn pixels(vision: &VisionBatch) -> Vec<f32> {
        let mut p = vision.image_pixels.clone();
        p.extend_from_slice(&vision.video_pixels);
        p
    }

    /// Runs the tower (when the batch has images or videos) and the language model,
    /// leaving the language model's activations and logits in `acts`; returns the tower's
    /// arena and the placeholder rows (`keep`: the tower's activations kept for
    /// [`Self::backward`]).
    ///
    /// # Errors
    /// As [`Self::layout`], [`VisionTower::forward`] and [`Model::forward_with`].
    pub fn forward(
        &self,
        inputs: &Inputs<'_>,
        vision: &VisionBatch,
        layout: &MultimodalLayout,
        acts: &mut Activations<B>,
        keep: bool,
    ) -> Result<VlActs<B>, ModelError> {
        let be = self.lm.backend();
        let segments = layout.segments.as_deref();
        let Some(plan) = &layout.plan else {
            let extras = ForwardExtras {
                embeds: None,
                rope: Some((&layout.cos, &layout.sin)),
                segments,
            };
            self.lm.forward_with(inputs, &extras, acts)?;
            return Ok(VlActs { tower: None });
        };
        let mut va = self.tower.activations(be, plan.clone(), keep)?;
        self.tower.forward(be, &Self::pixels(vision), &mut va)?;
        let mut rows = be.alloc_ids(layout.rows.len())?;
        be.upload_ids(&layout.rows, &mut rows)?;
        let extras = ForwardExtras {
            embeds: Some((&rows, va.output())),
            rope: Some((&layout.cos, &layout.sin)),
            segments,
        };
        self.lm.forward_with(inputs, &extras, acts)?;
        Ok(VlActs {
            tower: Some((va, rows)),
        })
    }

    /// Backward of [`Self::forward`] (run with `keep = true`) from `dlogits`: **adds** the
    /// language model's gradients into `lm_grads` and, when `vision_grads` is given (an
    /// unfrozen tower), the tower's into it.
    ///
    /// # Errors
    /// As [`Model::backward_with`] and [`VisionTower::backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        vl: &mut VlActs<B>,
        dlogits: Tensor<'_, B>,
        lm_grads: &mut Grads<B>,
        vision_grads: Option<&mut VisionGrads<B>>,
    ) -> Result<(), ModelError> {
        self.backward_through(vl, vision_grads, |embeds| match embeds {
            Some(e) => self.lm.backward_with(inputs, acts, dlogits, e, lm_grads),
            None => self.lm.backward(inputs, acts, dlogits, lm_grads),
        })
    }

    /// Backward of [`Self::forward`] (run with `keep = true`) from per-token `∂L/∂logπ`
    /// (`coeffs`, as [`Model::backward_from_log_prob_grads`]) and, when given, per-token
    /// `∂L/∂H` of an entropy term (`entropy_coeffs`, as
    /// [`Model::backward_from_log_prob_grads_with`]): the training step's backward.
    /// `vision_grads`: `None` for a frozen tower (no tower backward at all).
    ///
    /// # Errors
    /// As [`Model::backward_from_log_prob_grads_with`] and [`VisionTower::backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn backward_from_log_prob_grads(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        vl: &mut VlActs<B>,
        targets: &[u32],
        coeffs: &[f32],
        temperature: f32,
        lm_grads: &mut Grads<B>,
        vision_grads: Option<&mut VisionGrads<B>>,
        entropy_coeffs: Option<&[f32]>,
    ) -> Result<(), ModelError> {
        let frozen = vision_grads.is_none();
        self.backward_through(vl, vision_grads, |embeds| {
            // a frozen tower needs no gradient at its output
            let embeds = if frozen { None } else { embeds };
            self.lm.backward_from_log_prob_grads_with(
                inputs,
                acts,
                targets,
                coeffs,
                temperature,
                lm_grads,
                embeds,
                entropy_coeffs,
            )
        })
    }

    /// [`VlModel::backward_from_log_prob_grads`] from coefficients a loss on the device wrote
    /// into `acts` (`Model::backward_from_device_log_prob_grads`).
    ///
    /// # Errors
    /// As [`VlModel::backward_from_log_prob_grads`].
    #[allow(clippy::too_many_arguments)]
    pub fn backward_from_device_log_prob_grads(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        vl: &mut VlActs<B>,
        targets: &[u32],
        temperature: f32,
        lm_grads: &mut Grads<B>,
        vision_grads: Option<&mut VisionGrads<B>>,
        entropy: bool,
    ) -> Result<(), ModelError> {
        let frozen = vision_grads.is_none();
        self.backward_through(vl, vision_grads, |embeds| {
            let embeds = if frozen { None } else { embeds };
            self.lm.backward_from_device_log_prob_grads(
                inputs,
                acts,
                targets,
                temperature,
                lm_grads,
                embeds,
                entropy,
            )
        })
    }

    /// Runs the language model's backward `lm` (given where to put the placeholder rows'
    /// gradient, when the batch has any), then the tower's from that gradient.
    fn backward_through(
        &self,
        vl: &mut VlActs<B>,
        vision_grads: Option<&mut VisionGrads<B>>,
        lm: impl FnOnce(Option<EmbedGrad<'_, B>>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let be = self.lm.backend();
        let Some((va, rows)) = &mut vl.tower else {
            return lm(None);
        };
        let mut d_embeds = be.alloc(va.output().len())?;
        lm(Some(EmbedGrad {
            rows: &*rows,
            d_embeds: ViewMut::whole(&mut d_embeds),
        }))?;
        if let Some(g) = vision_grads {
            self.tower.backward(be, va, View::whole(&d_embeds), g)?;
        }
        Ok(())
    }

    /// Zeroed AdamW moments for the tower's parameters, stored as `dtype` says.
    ///
    /// # Errors
    /// A backend failure.
    pub fn vision_moments(&self, dtype: StateDtype) -> Result<VisionMoments<B>, ModelError> {
        let be = self.lm.backend();
        let moments = self
            .tower
            .trainable_names()
            .iter()
            .map(|(_, shape)| {
                let len = shape.iter().product::<usize>();
                Moments::zeros(be, len, len.max(1), dtype)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(VisionMoments {
            moments,
            state_dtype: dtype,
        })
    }

    /// One AdamW step of the language model and, with `vision` (moments and gradients:
    /// an unfrozen tower), of the tower too, under one global gradient norm
    /// ([`AdamW::step_with`]). A frozen tower's weights are not touched.
    ///
    /// # Errors
    /// As [`AdamW::step_with`].
    pub fn optimizer_step(
        &mut self,
        opt: &mut AdamW<B>,
        lm_grads: &Grads<B>,
        vision: Option<(&mut VisionMoments<B>, &VisionGrads<B>)>,
        lr: f64,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport, ModelError> {
        self.optimizer_step_with_sums(opt, lm_grads, vision, lr, max_grad_norm, None)
    }

    /// [`VlModel::optimizer_step`] with the gradients' `Σ g²` given, the language model's
    /// buffers then the tower's ([`AdamW::step_with_sums`]).
    ///
    /// # Errors
    /// As [`AdamW::step_with_sums`].
    pub fn optimizer_step_with_sums(
        &mut self,
        opt: &mut AdamW<B>,
        lm_grads: &Grads<B>,
        vision: Option<(&mut VisionMoments<B>, &VisionGrads<B>)>,
        lr: f64,
        max_grad_norm: Option<f32>,
        sums: Option<&[f64]>,
    ) -> Result<StepReport, ModelError> {
        let mut extra = Vec::new();
        if let Some((moments, grads)) = vision {
            let params = self.tower.trainable_mut();
            let grads = grads.stored();
            if params.len() != grads.len() || params.len() != moments.moments.len() {
                return Err(ModelError::LayoutMismatch {
                    what: "vision gradients or moments",
                });
            }
            for ((param, grad), moments) in params.into_iter().zip(grads).zip(&mut moments.moments)
            {
                extra.push(ExtraParam {
                    param,
                    grad,
                    moments,
                });
            }
        }
        opt.step_with_sums(&mut self.lm, lm_grads, &mut extra, lr, max_grad_norm, sums)
    }

    /// Adds fresh LoRA pairs (PEFT's default initialisation, `A` drawn from `seed`) to the
    /// modules `config` selects in the language model and in the vision tower (unless
    /// `exclude_modules` names the tower): from now on every base weight is frozen and the
    /// passes, gradients and optimizer train the pairs only.
    ///
    /// # Errors
    /// [`ModelError::Lora`]: a config that selects no module of the model, or that
    /// [`Model::add_lora`] or [`VisionTower::add_lora`] refuses; a backend failure.
    pub fn add_lora(&mut self, config: &LoraConfig, seed: u64) -> Result<(), ModelError> {
        self.check_selects(config)?;
        self.lm.add_lora_with(config, seed, false)?;
        self.tower.add_lora(self.lm.backend(), config, seed)?;
        Ok(())
    }

    /// Installs `adapter` (read with [`LoraAdapter::read_vl`]) on the language model and
    /// the tower for training, as [`VlModel::add_lora`] does with fresh pairs.
    ///
    /// # Errors
    /// As [`VlModel::add_lora`]; a pair missing or of the wrong shape.
    pub fn load_lora(&mut self, adapter: &LoraAdapter) -> Result<(), ModelError> {
        self.check_selects(&adapter.config)?;
        self.lm.load_lora_with(adapter, false)?;
        self.tower.load_lora(self.lm.backend(), adapter)?;
        Ok(())
    }

    /// Refuses a config that selects no module of this model.
    fn check_selects(&self, config: &LoraConfig) -> Result<(), ModelError> {
        let lm = TARGETS.iter().any(|t| config.adapts_module(t));
        let tower = config
            .tower_weights(self.tower.config())
            .map_err(|message| ModelError::Lora { message })?;
        if !lm && tower.is_empty() {
            return Err(ModelError::Lora {
                message: format!(
                    "target_modules [{}]{} selects no linear layer of this model",
                    config.target_modules.join(", "),
                    if config.exclude_modules.is_some() {
                        " outside the vision tower"
                    } else {
                        ""
                    }
                ),
            });
        }
        Ok(())
    }

    /// The adapters as PEFT writes them — the language model's pairs and the tower's, in
    /// transformers' module names — copied to the host; `None` without adapters.
    ///
    /// # Errors
    /// A backend failure.
    pub fn lora_adapter(&self) -> Result<Option<LoraAdapter>, ModelError> {
        let Some(mut adapter) = self.lm.lora_adapter()? else {
            return Ok(None);
        };
        adapter.language_model = true;
        adapter
            .pairs
            .extend(self.tower.lora_pairs(self.lm.backend())?);
        Ok(Some(adapter))
    }

    /// Turns the adapters of the language model and the tower off until the guard is
    /// dropped: the passes are the base model's, bit for bit (the reference policy).
    pub fn adapters_off(&self) -> AdaptersOff<'_> {
        AdaptersOff::new([self.lm.lora_flag(), self.tower.lora_flag()])
    }

    /// Merges every pair into the base weights (peft's `merge_and_unload`) and removes the
    /// adapters.
    ///
    /// # Errors
    /// A backend failure.
    pub fn merge_lora(&mut self) -> Result<(), ModelError> {
        self.lm.merge_lora()?;
        self.tower.merge_lora(self.lm.backend())
    }

    /// The model's current weights as a checkpoint (config and generation config of `like`,
    /// its layout), e.g. to save after training.
    ///
    /// # Errors
    /// A backend failure.
    pub fn to_checkpoint(&self, like: &VlCheckpoint) -> Result<VlCheckpoint, ModelError> {
        Ok(VlCheckpoint {
            config: like.config.clone(),
            generation: like.generation.clone(),
            text: self.lm.to_weights()?,
            vision: self.tower.download_weights(self.lm.backend())?,
            layout: like.layout,
        })
    }

    /// Convenience: the logits `[batch, seq, vocab]` of one batch on the host.
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn forward_logits(
        &self,
        input_ids: &[u32],
        attention_mask: &[u32],
        batch: usize,
        vision: &VisionBatch,
    ) -> Result<Vec<f32>, ModelError> {
        let layout = self.layout(input_ids, attention_mask, batch, vision)?;
        let seq = input_ids.len() / batch.max(1);
        let position_ids = layout.positions.axis(0).to_vec();
        let inputs = Inputs {
            batch,
            seq,
            input_ids,
            attention_mask,
            position_ids: &position_ids,
        };
        let mut acts = self.lm.activations_full(batch, seq)?;
        let _tower = self.forward(&inputs, vision, &layout, &mut acts, false)?;
        let mut out = vec![0.0; acts.logits().len()];
        self.lm.download_logits(&acts, &mut out)?;
        Ok(out)
    }

    /// A generator: the language model's weights transposed once for any number of
    /// [`VlGenerator::generate`] calls.
    ///
    /// # Errors
    /// A backend failure.
    pub fn generator(&self) -> Result<VlGenerator<'_, B>, GenerateError> {
        self.generator_with(WeightDtype::F32)
    }

    /// [`VlModel::generator`] with the language model's decode weights in `dtype` (the
    /// tower stays f32; see [`Model::generator_with`](crate::model::Model::generator_with)).
    ///
    /// # Errors
    /// As [`VlModel::generator`].
    pub fn generator_with(&self, dtype: WeightDtype) -> Result<VlGenerator<'_, B>, GenerateError> {
        Ok(VlGenerator {
            model: self,
            lm: self.lm.generator_with(dtype)?,
            share: true,
        })
    }
}

/// [`VlModel::generator`]: generation with images and videos.
pub struct VlGenerator<'m, B: Backend> {
    model: &'m VlModel<B>,
    lm: Generator<'m, B>,
    /// Reuse the tower output of a prompt repeated with the same images (default true).
    share: bool,
}

impl<B: Backend> VlGenerator<'_, B> {
    /// Runs the tower for every prompt, even a repeat with the same images (outputs are the
    /// same; only for measuring what sharing saves).
    pub fn without_tower_sharing(mut self) -> Self {
        self.share = false;
        self
    }

    /// Decode buckets and, on CUDA, graphs of the decode passes
    /// ([`Generator::decode_buckets`]).
    pub fn decode_buckets(mut self, on: bool) -> Self {
        self.lm = self.lm.decode_buckets(on);
        self
    }

    /// Caps the KV pool at `blocks` blocks ([`Generator::max_kv_blocks`]).
    pub fn max_kv_blocks(mut self, blocks: Option<usize>) -> Self {
        self.lm = self.lm.max_kv_blocks(blocks);
        self
    }

    /// Keeps the KV cache in `dtype` ([`Generator::kv_cache_dtype`]).
    pub fn kv_cache_dtype(mut self, dtype: crate::model::KvCacheDtype) -> Self {
        self.lm = self.lm.kv_cache_dtype(dtype);
        self
    }

    /// Prefills at most `tokens` prompt tokens per step, a longer prompt (its image and
    /// video rows with it) in chunks ([`Generator::max_prefill_tokens`]).
    pub fn max_prefill_tokens(mut self, tokens: usize) -> Self {
        self.lm = self.lm.max_prefill_tokens(tokens);
        self
    }

    /// Generates after each prompt of `request` (placeholders expanded, as
    /// [`super::mrope::expand_placeholders`] makes them) with `vision[i]` the images and
    /// videos of prompt `i`: the tower runs once per prompt, its rows replace the
    /// placeholders, positions are M-RoPE's in the prompt and `len + k + rope_delta` after
    /// it (transformers' rule). `on_token(prompt, token)` sees each new token.
    ///
    /// # Errors
    /// `vision` not one batch per prompt, placeholders that do not match the grids, and
    /// as [`Generator::generate_vision`].
    pub fn generate<V: Borrow<VisionBatch>>(
        &self,
        request: &GenerateRequest,
        vision: &[V],
        on_token: impl FnMut(usize, u32),
    ) -> Result<GenerateOutput, GenerateError> {
        self.with_prompt_vision(request, vision, |pv| {
            self.lm.generate_vision(request, pv, on_token)
        })
    }

    /// A rollout engine holding `request`'s prompts with `vision[i]` the images and videos
    /// of prompt `i` (the tower run as [`VlGenerator::generate`] runs it; sequence `i`
    /// samples from stream `(request.seed, i)`), of `config`'s sizes (`None`: those
    /// [`VlGenerator::generate`] takes), handed to `f` — for callers that drive it
    /// themselves, e.g. multi-turn episodes continuing each finished turn over its kept
    /// blocks ([`Engine::continue_with`]; a conversation keeps its first turn's images).
    ///
    /// # Errors
    /// As [`VlGenerator::generate`], bad `config` sizes, and `f`'s.
    pub fn with_engine<V: Borrow<VisionBatch>, R, E: From<GenerateError>>(
        &self,
        request: &GenerateRequest,
        vision: &[V],
        config: Option<EngineConfig>,
        f: impl FnOnce(&mut Engine<'_, B>) -> Result<R, E>,
    ) -> Result<R, E> {
        let mut f = Some(f);
        let mut out = None;
        self.with_prompt_vision(request, vision, |pv| {
            let m = self.lm.model();
            m.check_request(request)?;
            m.check_vision(request, pv)?;
            if request.max_new_tokens == 0 {
                return Err(GenerateError::Sampling(
                    "engine: max_new_tokens must be > 0".into(),
                ));
            }
            let config = config.unwrap_or_else(|| self.lm.engine_config(request));
            let mut engine = Engine::with_prompts(&self.lm, request, Some(pv), config)?;
            if let Some(f) = f.take() {
                out = Some(f(&mut engine));
            }
            Ok(())
        })?;
        out.unwrap_or_else(|| unreachable!("the engine was handed over"))
    }

    /// Runs the tower for `request`'s prompts and hands `f` their [`PromptVision`].
    fn with_prompt_vision<V: Borrow<VisionBatch>, R>(
        &self,
        request: &GenerateRequest,
        vision: &[V],
        f: impl FnOnce(&PromptVision<'_, B>) -> Result<R, GenerateError>,
    ) -> Result<R, GenerateError> {
        let vision: Vec<&VisionBatch> = vision.iter().map(Borrow::borrow).collect();
        let m = self.model;
        let be = m.backend();
        if vision.len() != request.prompts.len() {
            return Err(GenerateError::Model(input_error(format!(
                "{} vision batches for {} prompts",
                vision.len(),
                request.prompts.len()
            ))));
        }
        let hidden = m.config.text.hidden_size;
        let mut layouts = Vec::with_capacity(vision.len());
        for (p, v) in request.prompts.iter().zip(&vision) {
            let mask = vec![1u32; p.len()];
            layouts.push(m.layout(p, &mask, 1, v)?);
        }
        let total: usize = layouts.iter().map(|l| l.rows.len()).sum();
        let mut embeds = be.alloc(total * hidden)?;
        let mut rows = Vec::with_capacity(total);
        // The tower runs once per distinct image set: a prompt repeated with the same
        // images (the n samples of a rollout group) copies the previous tower output.
        let mut previous: Option<(usize, VisionActs<B>)> = None;
        // per prompt, the first prompt of its run of equal tower outputs
        let mut same_embeds: Vec<usize> = (0..layouts.len()).collect();
        for (b, (l, &v)) in layouts.iter().zip(&vision).enumerate() {
            let Some(plan) = &l.plan else {
                // no embedding rows: equal to every other such prompt
                same_embeds[b] = usize::MAX;
                continue;
            };
            let at = rows.len() * hidden;
            let same = self.share
                && previous.as_ref().is_some_and(|(p, _)| {
                    // the same batch (a group's samples share one), or equal pixels
                    (std::ptr::eq(vision[*p], v) || vision[*p] == v)
                        && layouts[*p].rows.len() == l.rows.len()
                });
            if same {
                if let Some((p, _)) = &previous {
                    same_embeds[b] = same_embeds[*p];
                }
            } else {
                let mut va = m.tower.activations(be, plan.clone(), false)?;
                m.tower.forward(be, &VlModel::<B>::pixels(v), &mut va)?;
                previous = Some((b, va));
            }
            if let Some((_, va)) = &previous {
                be.copy(
                    va.output(),
                    ViewMut::new(&mut embeds, at, va.output().len())?,
                )?;
            }
            rows.extend(l.rows.iter().map(|&t| (b, t as usize)));
        }
        let mut rope = Vec::with_capacity(layouts.len());
        let mut rope_deltas = Vec::with_capacity(layouts.len());
        for l in layouts {
            rope_deltas.push(l.positions.rope_deltas[0]);
            rope.push((l.cos, l.sin));
        }
        let pv = PromptVision {
            embeds: View::whole(&embeds),
            rows: &rows,
            rope: &rope,
            rope_deltas: &rope_deltas,
            same_embeds: self.share.then_some(same_embeds.as_slice()),
        };
        f(&pv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A padded layout of 2 rows × 3 tokens (head_dim 4: 2 rotary values a token) whose
    /// values name their token, a placeholder at padded token 4.
    fn padded() -> MultimodalLayout {
        let n = 6;
        MultimodalLayout {
            positions: MropePositions {
                batch: 2,
                seq: 3,
                position_ids: (0..3 * n as u32).collect(),
                rope_deltas: vec![0, 0],
            },
            cos: (0..2 * n).map(|i| i as f32).collect(),
            sin: (0..2 * n).map(|i| -(i as f32)).collect(),
            rows: vec![4],
            plan: None,
            segments: None,
        }
    }

    #[test]
    fn a_layout_moves_to_packed_tokens() {
        // packed: row 0's tokens 1, 2, then row 1's 3, 4, then a padding token
        let from = [Some(1), Some(2), Some(3), Some(4), None];
        let p = padded().packed(&from, vec![0, 2, 4, 5]).unwrap();
        assert_eq!((p.positions.batch, p.positions.seq), (1, 5));
        // axis 0 of padded token i is i, axis 1 is 6 + i, axis 2 is 12 + i
        assert_eq!(p.positions.axis(0), &[1, 2, 3, 4, 0]);
        assert_eq!(p.positions.axis(2), &[13, 14, 15, 16, 0]);
        assert_eq!(p.cos, [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 1.0, 1.0]);
        assert_eq!(&p.sin[6..], [-8.0, -9.0, 0.0, 0.0]);
        assert_eq!(p.rows, vec![3], "the placeholder follows its token");
        assert_eq!(p.segments, Some(vec![0, 2, 4, 5]));
    }

    #[test]
    fn bad_maps_are_refused() {
        let l = padded();
        for from in [
            vec![Some(6)],                   // past the padded tokens
            vec![Some(4), Some(4)],          // one token twice
            vec![Some(1), Some(2), Some(3)], // the placeholder's token left out
        ] {
            let err = l.packed(&from, vec![0, from.len() as u32]).unwrap_err();
            assert!(matches!(err, ModelError::VisionInput { .. }), "{err}");
        }
    }
}
