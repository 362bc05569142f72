//! Prompts as the model sees them: the dataset's prompt, through the `format_prompt`
//! template, the model's chat template (with a generation prompt) and the tokenizer; and
//! the graded system prompts of seed 003 (docs/algorithms.md §9), one per sample.

use ares_core::rubric::{
    GradedSchedule, RevealRule, RubricPrompt, StepRule, select_criteria, write_rubric_message,
};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

use super::TrainError;
use crate::config::{GradedPromptConfig, RubricSchedule};
use crate::data::{Example, PromptTemplate};
use crate::hf::chat::{ChatTemplate, RenderOptions};
use crate::hf::tokenizer::Tokenizer;

/// Turns examples into token ids.
#[derive(Debug)]
pub struct PromptRenderer {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template (`None`: the prompt text is used as is).
    pub chat: Option<ChatTemplate>,
    /// The `format_prompt` template.
    pub format: Option<PromptTemplate>,
}

impl PromptRenderer {
    /// The prompt text of `example`, with `system` as the system turn when given.
    ///
    /// # Errors
    /// Template errors, naming the example.
    pub fn text(&self, example: &Example, system: Option<&str>) -> Result<String, TrainError> {
        let prompt = match &self.format {
            Some(t) => t.apply(&example.prompt).map_err(|e| {
                TrainError::Invalid(format!("format_prompt on {}: {e}", example.global_id))
            })?,
            None => example.prompt.clone(),
        };
        let messages = prompt.to_messages();
        match &self.chat {
            Some(chat) => {
                let options = RenderOptions::generation();
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
