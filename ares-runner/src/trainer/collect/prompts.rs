//! Prompts as the model sees them: the dataset's prompt, through the `format_prompt`
//! template, the model's chat template (with a generation prompt) and the tokenizer; and
//! the graded system prompts (docs/algorithms.md §9), one per sample.

use ares_core::rubric::{
    GradedSchedule, RevealRule, RubricPrompt, StepRule, select_criteria, write_rubric_message,
};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

use std::sync::Arc;

use crate::config::{GradedPromptConfig, RubricSchedule};
use crate::data::{Example, MediaProcessor, PromptTemplate, render_prompt_with};
use crate::hf::chat::{ChatTemplate, RenderOptions};
use crate::hf::tokenizer::Tokenizer;
use crate::trainer::TrainError;
use crate::trainer::actor::PromptVision;
use crate::vision::config::VlConfig;

/// Turns examples into token ids.
#[derive(Debug)]
pub struct PromptRenderer {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template (`None`: the prompt text is used as is).
    pub chat: Option<ChatTemplate>,
    /// The `format_prompt` template.
    pub format: Option<PromptTemplate>,
    /// A vision-language model's image/video processing (`None`: a text model, whose
    /// examples must have no media).
    pub media: Option<MediaPrompts>,
    /// The chat template's inputs besides the messages.
    pub template_inputs: TemplateInputs,
}

/// What the chat template renders besides the messages: `data.tools` and
/// `data.apply_chat_template_kwargs`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TemplateInputs {
    /// Tool schemas (transformers' `tools=`).
    pub tools: Option<Vec<serde_json::Value>>,
    /// Extra template variables (transformers' `**kwargs`, e.g. `enable_thinking`).
    pub kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

impl TemplateInputs {
    /// Options for a prompt the model continues (`add_generation_prompt = true`).
    pub fn generation(&self) -> RenderOptions<'_> {
        RenderOptions {
            add_generation_prompt: true,
            tools: self.tools.as_deref(),
            extra: self.kwargs.as_ref(),
        }
    }
}

/// How a vision-language model sees a prompt's images and videos.
#[derive(Debug)]
pub struct MediaPrompts {
    /// The processor with the data section's pixel bounds and video rate.
    pub processor: MediaProcessor,
    /// The model's config (placeholder ids, merge size).
    pub config: VlConfig,
}

fn media_error(e: &Example, err: impl std::fmt::Display) -> TrainError {
    TrainError::Invalid(format!("row {} ({}): {err}", e.row, e.global_id))
}

impl PromptRenderer {
    /// The prompt text of `example`, with `system` as the system turn when given.
    ///
    /// # Errors
    /// Template errors, naming the example.
    pub fn text(&self, example: &Example, system: Option<&str>) -> Result<String, TrainError> {
        if example.has_media() {
            return match (&self.chat, &self.media) {
                (Some(chat), Some(m)) => render_prompt_with(
                    chat,
                    example,
                    self.format.as_ref(),
                    system,
                    &m.processor.keys,
                    &self.template_inputs.generation(),
                )
                .map_err(|err| TrainError::Invalid(err.to_string())),
                _ => Err(media_error(
                    example,
                    "has images or videos: worker.actor.model.model_path must be a Qwen2-VL / \
                     Qwen2.5-VL model with a chat template",
                )),
            };
        }
        let prompt = match &self.format {
            Some(t) => t.apply(&example.prompt).map_err(|e| {
                TrainError::Invalid(format!("format_prompt on {}: {e}", example.global_id))
            })?,
            None => example.prompt.clone(),
        };
        let messages = prompt.to_messages();
        match &self.chat {
            Some(chat) => {
                let options = self.template_inputs.generation();
                let rendered = match system {
                    Some(s) => chat.render_with_system(s, &messages, &options),
                    None => chat.render(&messages, &options),
                };
                rendered.map_err(|e| {
                    TrainError::Invalid(format!("chat template on {}: {e}", example.global_id))
                })
            }
            None => {
                let mut text = String::new();
                if let Some(s) = system {
                    text.push_str(s);
                    text.push_str("\n\n");
                }
                for m in &messages {
                    text.push_str(&m.content);
                }
                Ok(text)
            }
        }
    }

    /// The conversation of a text `example` as the chat template renders it (after
    /// `format_prompt`): what a multi-turn episode continues.
    ///
    /// # Errors
    /// `format_prompt` errors, naming the example.
    pub fn messages(&self, example: &Example) -> Result<Vec<serde_json::Value>, TrainError> {
        let prompt = match &self.format {
            Some(t) => t.apply(&example.prompt).map_err(|e| {
                TrainError::Invalid(format!("format_prompt on {}: {e}", example.global_id))
            })?,
            None => example.prompt.clone(),
        };
        prompt
            .to_messages()
            .iter()
            .map(|m| serde_json::to_value(m).map_err(|e| TrainError::Internal(e.to_string())))
            .collect()
    }

    /// Token ids of a rendered prompt (a chat template writes the special tokens itself).
    ///
    /// # Errors
    /// Tokenizer errors.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TrainError> {
        self.tokenizer
            .encode(text, self.chat.is_none())
            .map_err(|e| TrainError::Invalid(format!("tokenizer: {e}")))
    }

    /// Token ids of `example`'s prompt.
    ///
    /// # Errors
    /// As [`PromptRenderer::text`] and [`PromptRenderer::encode`].
    pub fn ids(&self, example: &Example, system: Option<&str>) -> Result<Vec<u32>, TrainError> {
        self.encode(&self.text(example, system)?)
    }

    /// The length `ids` (the example's rendered prompt) takes once its image/video
    /// placeholders are expanded, from the media's sizes only (no pixels processed).
    ///
    /// # Errors
    /// Unreadable media, naming the row.
    pub fn prompt_len(&self, example: &Example, ids: &[u32]) -> Result<usize, TrainError> {
        Ok(self.expanded_len(example, ids)?.0)
    }

    /// [`PromptRenderer::prompt_len`] and the merged image/video tokens among them (0
    /// without media: what the vision tower's activations scale with).
    ///
    /// # Errors
    /// As [`PromptRenderer::prompt_len`].
    pub fn expanded_len(
        &self,
        example: &Example,
        ids: &[u32],
    ) -> Result<(usize, usize), TrainError> {
        match (&self.media, example.has_media()) {
            (Some(m), true) => m
                .processor
                .expanded_prompt(example, ids.len())
                .map_err(|err| TrainError::Invalid(err.to_string())),
            _ => Ok((ids.len(), 0)),
        }
    }

    /// The example's images and videos processed for the model (`None`: no media).
    ///
    /// # Errors
    /// Unreadable media, naming the row.
    pub fn vision(&self, example: &Example) -> Result<PromptVision, TrainError> {
        match (&self.media, example.has_media()) {
            (Some(m), true) => {
                let media = m
                    .processor
                    .load(example)
                    .map_err(|err| TrainError::Invalid(err.to_string()))?;
                Ok(Some(Arc::new(media.vision_batch())))
            }
            (None, true) => Err(media_error(
                example,
                "has images or videos but the model is a text model",
            )),
            _ => Ok(None),
        }
    }

    /// `ids` with the placeholders expanded to `vision`'s grids (unchanged without vision).
    ///
    /// # Errors
    /// Placeholders that do not match the grids, naming the row.
    pub fn expand(
        &self,
        example: &Example,
        ids: Vec<u32>,
        vision: &PromptVision,
    ) -> Result<Vec<u32>, TrainError> {
        match (&self.media, vision) {
            (Some(m), Some(v)) => m
                .config
                .expand_prompt(&ids, &v.image_grids, &v.video_grids)
                .map_err(|err| media_error(example, err)),
            _ => Ok(ids),
        }
    }

    /// The model inputs of `example`'s prompt: expanded ids and its images and videos.
    ///
    /// # Errors
    /// As [`PromptRenderer::ids`], [`PromptRenderer::vision`] and [`PromptRenderer::expand`].
    pub fn inputs(
        &self,
        example: &Example,
        system: Option<&str>,
    ) -> Result<(Vec<u32>, PromptVision), TrainError> {
        let ids = self.ids(example, system)?;
        let vision = self.vision(example)?;
        Ok((self.expand(example, ids, &vision)?, vision))
    }
}

/// The ares-core schedule of a graded-prompt config.
pub fn schedule(cfg: &GradedPromptConfig) -> GradedSchedule<f64> {
    let linear = RevealRule::Linear;
    let (reveal, step) = match cfg.schedule {
        RubricSchedule::Linear => (linear, StepRule::Constant),
        RubricSchedule::Binary => (
            RevealRule::Binary {
                full_reveal_count: cfg.full_reveal_count,
            },
            StepRule::Constant,
        ),
        RubricSchedule::StepLinear => (linear, StepRule::StepLinear),
        RubricSchedule::StepPower => (linear, StepRule::StepPower { power: cfg.power }),
        RubricSchedule::StepSigmoid => (
            linear,
            StepRule::StepSigmoid {
                start_point: cfg.x0,
                steepness: cfg.k,
            },
        ),
    };
    GradedSchedule { reveal, step }
}

/// The graded system message of sample `k` of `n` for `example` at `step` of
/// `total_steps`, or `None` when no criterion is shown (and no base message is asked
/// for). The criteria subset is drawn from a ChaCha stream keyed by `seed`, the step, the
/// sample and the prompt, so a resumed run draws the same subsets.
///
/// # Errors
/// Invalid schedule parameters.
#[allow(clippy::too_many_arguments)]
pub fn graded_system_message(
    cfg: &GradedPromptConfig,
    example: &Example,
    k: usize,
    n: usize,
    step: u64,
    total_steps: u64,
    seed: u64,
) -> Result<Option<String>, TrainError> {
    let total = example.rubrics.len();
    let reveal = schedule(cfg).reveal(k, n, step.max(1), total_steps.max(1), total)?;
    let mut key = seed
        ^ step.wrapping_mul(0xA24B_AED4_963E_E407)
        ^ (k as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25);
    for b in example.global_id.bytes() {
        key = key.rotate_left(5) ^ u64::from(b);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(key);
    let mut draw = || rng.next_u64();
    let mut shown = vec![0usize; total];
    let count = select_criteria(reveal, total, &mut draw, &mut shown)?;
    let criteria: Vec<(&str, f64)> = example
        .rubrics
        .iter()
        .map(|c| (c.criterion.as_str(), c.points))
        .collect();
    let prompt = RubricPrompt {
        hide_instruction: cfg
            .hide_criteria_instruction
            .then_some(ares_core::rubric::DEFAULT_HIDE_INSTRUCTION),
        add_base_when_zero: cfg.add_base_when_zero,
        ..RubricPrompt::default()
    };
    let mut message = String::new();
    let written = write_rubric_message(&criteria, &shown[..count], &prompt, &mut message)?;
    Ok(written.then_some(message))
}
