//! The model the trainer trains and scores with: a text decoder ([`Model`]) or a
//! vision-language model ([`VlModel`]: Qwen2-VL / Qwen2.5-VL), behind one interface so the
//! loop is written once. Every call takes the images and videos of its rows
//! ([`VisionBatch`]es, `None` for text rows); a text model refuses any.
//!
//! A forward pass keeps what its backward needs ([`Pass`]): nothing extra for a text
//! model, the tower's activations and the placeholder rows for a vision-language one.

use std::sync::Arc;

use crate::backend::Backend;
use crate::model::{
    Activations, AdamW, EngineConfig, ForwardExtras, GenerateOutput, GenerateRequest, Generator,
    GradDtype, Grads, Inputs, Model, ModelError, StateDtype, StepReport, WeightDtype,
};
use crate::trainer::prepare::sequences::Packed;
use crate::vision::model::{VisionBatch, VisionMoments, VlActs, VlGenerator, VlModel};
use crate::vision::tower::VisionGrads;

use crate::trainer::TrainError;

/// The images and videos of one prompt (shared by its samples).
pub type PromptVision = Option<Arc<VisionBatch>>;

/// A trained or scored model.
#[allow(clippy::large_enum_variant)] // one or two per run, never moved in a loop
pub enum Actor<B: Backend> {
    /// A text decoder.
    Text(Model<B>),
    /// A vision-language model.
    Vision(VlModel<B>),
}

/// What a forward pass keeps for its backward besides the language model's arena.
pub struct Pass<B: Backend>(Option<VlActs<B>>);

/// A generator of either kind: the language model's weights transposed once.
pub enum ActorGenerator<'m, B: Backend> {
    /// Text.
    Text(Generator<'m, B>),
    /// Vision-language.
    Vision(VlGenerator<'m, B>),
}

/// Gradients and optimizer moments of the vision tower (none for a text model or a frozen
/// tower).
pub struct TowerTraining<B: Backend> {
    /// Gradient buffers.
    pub grads: VisionGrads<B>,
    /// AdamW moments.
    pub moments: VisionMoments<B>,
}

/// The images and videos of `rows` (each row's prompt's, in row order) as one batch, or
/// `None` when no row has any.
pub fn concat_vision(rows: &[&PromptVision]) -> Option<VisionBatch> {
    if rows.iter().all(|v| v.is_none()) {
        return None;
    }
    let mut out = VisionBatch::default();
    for v in rows.iter().filter_map(|v| v.as_deref()) {
        out.image_pixels.extend_from_slice(&v.image_pixels);
        out.image_grids.extend_from_slice(&v.image_grids);
        out.video_pixels.extend_from_slice(&v.video_pixels);
        out.video_grids.extend_from_slice(&v.video_grids);
        out.second_per_grid_ts
            .extend_from_slice(&v.second_per_grid_ts);
    }
    Some(out)
}

pub(crate) fn no_vision(what: &str) -> TrainError {
    TrainError::Invalid(format!(
        "{what}: the data has images or videos but the model is a text model \
         (worker.actor.model.model_path must be a Qwen2-VL / Qwen2.5-VL checkpoint)"
    ))
}

impl<B: Backend> Actor<B> {
    /// The language model.
    pub fn lm(&self) -> &Model<B> {
        match self {
            Actor::Text(m) => m,
            Actor::Vision(m) => m.lm(),
        }
    }

    /// The language model, writable (to add LoRA adapters).
    pub fn lm_mut(&mut self) -> &mut Model<B> {
        match self {
            Actor::Text(m) => m,
            Actor::Vision(m) => m.lm_mut(),
        }
    }

    /// The LoRA adapter as PEFT writes it (a vision-language model's in transformers'
    /// `model.language_model.` / `model.visual.` names, the tower's pairs included), `None`
    /// without adapters.
    ///
    /// # Errors
    /// A backend failure.
    pub fn lora_adapter(&self) -> Result<Option<crate::hf::lora::LoraAdapter>, TrainError> {
        Ok(match self {
            Actor::Text(m) => m.lora_adapter()?,
            Actor::Vision(m) => m.lora_adapter()?,
        })
    }

    /// Installs a LoRA adapter read from PEFT files on the model (both parts of a
    /// vision-language model).
    ///
    /// # Errors
    /// As [`Model::load_lora`] / [`VlModel::load_lora`].
    pub fn load_lora(&mut self, adapter: &crate::hf::lora::LoraAdapter) -> Result<(), TrainError> {
        match self {
            Actor::Text(m) => m.load_lora(adapter)?,
            Actor::Vision(m) => m.load_lora(adapter)?,
        }
        Ok(())
    }

    /// Adds fresh LoRA pairs (drawn from `seed`) to the modules `config` selects.
    ///
    /// # Errors
    /// As [`Model::add_lora`] / [`VlModel::add_lora`].
    pub fn add_lora(
        &mut self,
        config: &crate::hf::lora::LoraConfig,
        seed: u64,
    ) -> Result<(), TrainError> {
        match self {
            Actor::Text(m) => m.add_lora(config, seed)?,
            Actor::Vision(m) => m.add_lora(config, seed)?,
        }
        Ok(())
    }

    /// Turns the adapters off (both parts of a vision-language model) until the guard is
    /// dropped: the reference policy of a LoRA run.
    pub fn adapters_off(&self) -> crate::model::AdaptersOff<'_> {
        match self {
            Actor::Text(m) => m.adapters_off(),
            Actor::Vision(m) => m.adapters_off(),
        }
    }

    /// Merges the adapters into the base weights (both parts) and removes them.
    ///
    /// # Errors
    /// A backend failure.
    pub fn merge_lora(&mut self) -> Result<(), TrainError> {
        match self {
            Actor::Text(m) => m.merge_lora()?,
            Actor::Vision(m) => m.merge_lora()?,
        }
        Ok(())
    }

    /// Whether an optimizer step updates the vision tower: a vision-language model whose
    /// tower is trained in full (`freeze` false, no LoRA) or carries LoRA pairs.
    pub fn trains_tower(&self, freeze: bool) -> bool {
        match self {
            Actor::Text(_) => false,
            Actor::Vision(m) if m.lm().lora_config().is_some() => m.tower().has_lora(),
            Actor::Vision(_) => !freeze,
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        self.lm().backend()
    }

    /// The vision-language model, if this is one.
    pub fn vision(&self) -> Option<&VlModel<B>> {
        match self {
            Actor::Text(_) => None,
            Actor::Vision(m) => Some(m),
        }
    }

    /// A generator for rollouts.
    ///
    /// # Errors
    /// A backend failure.
    pub fn generator(&self) -> Result<ActorGenerator<'_, B>, TrainError> {
        self.generator_with(WeightDtype::F32)
    }

    /// [`Actor::generator`] with the language model's decode weights in `dtype`.
    ///
    /// # Errors
    /// As [`Actor::generator`].
    pub fn generator_with(&self, dtype: WeightDtype) -> Result<ActorGenerator<'_, B>, TrainError> {
        Ok(match self {
            Actor::Text(m) => ActorGenerator::Text(m.generator_with(dtype)?),
            // as the text rollout's engine: a prompt past 8 192 tokens (a long video) is
            // prefilled in chunks while the other sequences decode
            Actor::Vision(m) => ActorGenerator::Vision(
                m.generator_with(dtype)?
                    .max_prefill_tokens(EngineConfig::default().max_prefill_tokens),
            ),
        })
    }

    /// Runs the model on the batch `packed` with the rows' images and videos (`vision`:
    /// the concatenation of the rows', [`concat_vision`]); the prompts fill the first
    /// `packed.prompt_cols` columns (placeholders after them are response text); `keep`: the
    /// tower keeps what its backward needs.
    ///
    /// # Errors
    /// Images for a text model, a packed batch for a vision-language model; the model's
    /// errors.
    pub fn forward(
        &self,
        packed: &Packed,
        vision: Option<&VisionBatch>,
        acts: &mut Activations<B>,
        keep: bool,
    ) -> Result<Pass<B>, TrainError> {
        let (inputs, prompt_cols) = (&packed.inputs(), packed.prompt_cols);
        match self {
            Actor::Text(m) => {
                if vision.is_some() {
                    return Err(no_vision("forward"));
                }
                let extras = ForwardExtras {
                    segments: packed.segments(),
                    ..ForwardExtras::default()
                };
                m.forward_with(inputs, &extras, acts)?;
                Ok(Pass(None))
            }
            Actor::Vision(m) => {
                let empty = VisionBatch::default();
                let v = vision.unwrap_or(&empty);
                let layout = match (packed.padded_view(), packed.segments()) {
                    // packed: the M-RoPE layout of the same samples padded, moved to the
                    // packed tokens
                    (Some(pv), Some(cu)) => m
                        .layout_prompts(
                            &pv.input_ids,
                            &pv.attention_mask,
                            pv.rows,
                            v,
                            Some(prompt_cols),
                        )?
                        .packed(&pv.from, cu.to_vec())?,
                    _ => m.layout_prompts(
                        inputs.input_ids,
                        inputs.attention_mask,
                        inputs.batch,
                        v,
                        Some(prompt_cols),
                    )?,
                };
                let positions = layout.positions.axis(0).to_vec();
                let inputs = Inputs {
                    position_ids: &positions,
                    ..*inputs
                };
                Ok(Pass(Some(m.forward(&inputs, v, &layout, acts, keep)?)))
            }
        }
    }

    /// Backward of [`Actor::forward`] from per-token `∂L/∂logπ` (`coeffs`) and, when given,
    /// per-token `∂L/∂H` of an entropy term (`entropy_coeffs`, same layout and padding rule
    /// as `coeffs`), adding into `grads` and, for an unfrozen tower, into `tower`.
    ///
    /// # Errors
    /// The model's.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_from_log_prob_grads(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        pass: &mut Pass<B>,
        targets: &[u32],
        coeffs: &[f32],
        temperature: f32,
        grads: &mut Grads<B>,
        tower: Option<&mut TowerTraining<B>>,
        entropy_coeffs: Option<&[f32]>,
    ) -> Result<(), TrainError> {
        match (self, &mut pass.0) {
            (Actor::Vision(m), Some(vl)) => {
                // the backward's positions were the forward's (its rotary tables are in `acts`)
                m.backward_from_log_prob_grads(
                    inputs,
                    acts,
                    vl,
                    targets,
                    coeffs,
                    temperature,
                    grads,
                    tower.map(|t| &mut t.grads),
                    entropy_coeffs,
                )?;
            }
            _ => self.lm().backward_from_log_prob_grads_with(
                inputs,
                acts,
                targets,
                coeffs,
                temperature,
                grads,
                None,
                entropy_coeffs,
            )?,
        }
        Ok(())
    }

    /// [`Actor::backward_from_log_prob_grads`] from coefficients a loss on the device wrote
    /// into `acts` (`Activations::loss_buffers`; the entropy coefficients too when
    /// `entropy`).
    ///
    /// # Errors
    /// As [`Actor::backward_from_log_prob_grads`].
    #[allow(clippy::too_many_arguments)]
    pub fn backward_from_device_log_prob_grads(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        pass: &mut Pass<B>,
        targets: &[u32],
        temperature: f32,
        grads: &mut Grads<B>,
        tower: Option<&mut TowerTraining<B>>,
        entropy: bool,
    ) -> Result<(), TrainError> {
        match (self, &mut pass.0) {
            (Actor::Vision(m), Some(vl)) => m.backward_from_device_log_prob_grads(
                inputs,
                acts,
                vl,
                targets,
                temperature,
                grads,
                tower.map(|t| &mut t.grads),
                entropy,
            )?,
            _ => self.lm().backward_from_device_log_prob_grads(
                inputs,
                acts,
                targets,
                temperature,
                grads,
                None,
                entropy,
            )?,
        }
        Ok(())
    }

    /// Zeroed tower gradients (the linear layers' in bf16 under `grad_dtype: bf16`, as
    /// the language model's) and moments for training the tower (`None`: a text model).
    ///
    /// # Errors
    /// A backend failure.
    pub fn tower_training(
        &self,
        state_dtype: StateDtype,
        grad_dtype: GradDtype,
    ) -> Result<Option<TowerTraining<B>>, TrainError> {
        match self {
            Actor::Text(_) => Ok(None),
            Actor::Vision(m) => Ok(Some(TowerTraining {
                grads: m.tower().zero_grads_in(m.backend(), grad_dtype)?,
                moments: m.vision_moments(state_dtype)?,
            })),
        }
    }

    /// One AdamW step (the tower's parameters too when `tower` is given), with the
    /// gradients' `Σ g²` given under ZeRO-1 (`sums`, [`AdamW::step_with_sums`]).
    ///
    /// # Errors
    /// As [`AdamW::step_with_sums`].
    pub fn optimizer_step(
        &mut self,
        opt: &mut AdamW<B>,
        grads: &Grads<B>,
        tower: Option<&mut TowerTraining<B>>,
        lr: f64,
        max_grad_norm: Option<f32>,
        sums: Option<&[f64]>,
    ) -> Result<StepReport, ModelError> {
        match self {
            Actor::Text(m) => opt.step_with_sums(m, grads, &mut [], lr, max_grad_norm, sums),
            Actor::Vision(m) => {
                let tower = tower.map(|t| (&mut t.moments, &t.grads));
                m.optimizer_step_with_sums(opt, grads, tower, lr, max_grad_norm, sums)
            }
        }
    }
}

impl<B: Backend> ActorGenerator<'_, B> {
    /// Decode buckets and, on CUDA, graphs of the decode passes
    /// (`worker.rollout.cuda_graphs`; [`Generator::decode_buckets`]).
    pub fn decode_buckets(self, on: bool) -> Self {
        match self {
            ActorGenerator::Text(g) => ActorGenerator::Text(g.decode_buckets(on)),
            ActorGenerator::Vision(g) => ActorGenerator::Vision(g.decode_buckets(on)),
        }
    }

    /// Caps the KV pool at `blocks` blocks (the memory plan's; [`Generator::max_kv_blocks`]).
    pub fn max_kv_blocks(self, blocks: Option<usize>) -> Self {
        match self {
            ActorGenerator::Text(g) => ActorGenerator::Text(g.max_kv_blocks(blocks)),
            ActorGenerator::Vision(g) => ActorGenerator::Vision(g.max_kv_blocks(blocks)),
        }
    }

    /// The KV cache's number format (`worker.rollout.kv_cache_dtype`;
    /// [`Generator::kv_cache_dtype`]).
    pub fn kv_cache_dtype(self, dtype: crate::model::KvCacheDtype) -> Self {
        match self {
            ActorGenerator::Text(g) => ActorGenerator::Text(g.kv_cache_dtype(dtype)),
            ActorGenerator::Vision(g) => ActorGenerator::Vision(g.kv_cache_dtype(dtype)),
        }
    }

    /// Generates `request` with each prompt's images and videos (`vision[i]` for prompt
    /// `i`; empty: text only).
    ///
    /// # Errors
    /// Images for a text model; the model's errors.
    pub fn generate(
        &self,
        request: &GenerateRequest,
        vision: &[PromptVision],
    ) -> Result<GenerateOutput, TrainError> {
        let any = vision.iter().any(Option::is_some);
        match self {
            ActorGenerator::Text(g) => {
                if any {
                    return Err(no_vision("rollout"));
                }
                Ok(g.generate(request)?)
            }
            ActorGenerator::Vision(g) => {
                // borrowed, not copied: a group's samples share one batch, and the tower
                // runs once for it
                let empty = VisionBatch::default();
                let batches: Vec<&VisionBatch> = (0..request.prompts.len())
                    .map(|i| vision.get(i).and_then(|v| v.as_deref()).unwrap_or(&empty))
                    .collect();
                Ok(g.generate(request, &batches, |_, _| {})?)
            }
        }
    }
}
