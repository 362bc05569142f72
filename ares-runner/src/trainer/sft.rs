//! Supervised fine-tuning (the ARES cold-start stage): minimise the mean negative
//! log-likelihood of the response tokens given the prompt,
//! `L = −(1/N) Σ_t log π(y_t | x, y_<t)` over the `N` response tokens of a batch, so
//! `∂L/∂logπ_t = −1/N` — the same loss head and backward as the RL update.

use crate::backend::Backend;
use crate::trainer::TrainError;
use crate::trainer::actor::{Actor, PromptVision, concat_vision};
use crate::trainer::prepare::sequences::{Packed, packed_tokens, response_log_probs_after_forward};
use crate::trainer::update::Optimizer;

/// One prompt/response pair, tokenised (the response ends with EOS).
#[derive(Debug, Clone, PartialEq)]
pub struct SftExample {
    /// Prompt ids (chat template applied).
    pub prompt: Vec<u32>,
    /// Response ids.
    pub response: Vec<u32>,
    /// A multi-turn trace's: per response token, whether the model wrote it (only those
    /// are in the loss; the rest are the template's and the tools'). `None`: every token.
    pub from_model: Option<Vec<bool>>,
    /// The prompt's images and videos (`None`: text), placeholders in `prompt` expanded.
    pub vision: PromptVision,
}

impl SftExample {
    /// Whether response token `t` is the model's (in the loss).
    fn learns(&self, t: usize) -> bool {
        self.from_model.as_ref().is_none_or(|m| m[t])
    }

    /// The response tokens in the loss.
    fn learned_tokens(&self) -> usize {
        (0..self.response.len()).filter(|&t| self.learns(t)).count()
    }
}

/// Loss of one SFT optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SftStep {
    /// Mean NLL per response token before the update.
    pub loss: f64,
    /// Global grad norm (before clipping).
    pub grad_norm: f64,
    /// Whether the update was applied (false: non-finite loss or gradient, skipped).
    pub applied: bool,
    /// Response tokens in the loss (a trace's model tokens).
    pub tokens: usize,
}

/// One optimizer step on `examples` (a mini-batch), `micro` examples per forward/backward
/// (without padding with `padding_free`: `Packed::unpadded`),
/// at learning rate `lr`. A vision-language model's tower trains too when `opt.tower` holds
/// its gradients and moments (`None`: frozen).
///
/// # Errors
/// Model errors; examples with an empty prompt or response.
pub fn sft_step<B: Backend>(
    model: &mut Actor<B>,
    opt: &mut Optimizer<B>,
    examples: &[&SftExample],
    (micro, padding_free): (usize, bool),
    lr: f64,
    max_grad_norm: Option<f32>,
) -> Result<SftStep, TrainError> {
    let total: usize = examples.iter().map(|e| e.learned_tokens()).sum();
    if let Some(e) = examples
        .iter()
        .find(|e| e.prompt.is_empty() || e.learned_tokens() == 0)
    {
        return Err(TrainError::Invalid(format!(
            "sft: an example has {} prompt and {} response tokens to learn; both must be \
             non-empty",
            e.prompt.len(),
            e.learned_tokens()
        )));
    }
    if let Some(e) = examples.iter().find(|e| {
        e.from_model
            .as_ref()
            .is_some_and(|m| m.len() != e.response.len())
    }) {
        return Err(TrainError::Internal(format!(
            "sft: a trace's mask has {} entries for {} response tokens",
            e.from_model.as_ref().map_or(0, Vec::len),
            e.response.len()
        )));
    }
    let prompt_cols = examples.iter().map(|e| e.prompt.len()).max().unwrap_or(1);
    let response_cols = examples.iter().map(|e| e.response.len()).max().unwrap_or(1);
    super::update::zero_grads(model.backend(), opt)?;
    let mut nll = 0.0f64;
    let mut finite = true;
    for chunk in examples.chunks(micro.max(1)) {
        let prompts: Vec<&[u32]> = chunk.iter().map(|e| e.prompt.as_slice()).collect();
        let responses: Vec<&[u32]> = chunk.iter().map(|e| e.response.as_slice()).collect();
        // packed (each chunk to its own length: its arena is its own)
        let packed = if padding_free {
            let tokens = packed_tokens(&prompts, &responses);
            Packed::unpadded(&prompts, &responses, response_cols, tokens)?
        } else {
            Packed::new(&prompts, &responses, prompt_cols, response_cols)?
        };
        let mut acts = model.lm().activations(packed.batch(), packed.seq())?;
        let rows: Vec<&PromptVision> = chunk.iter().map(|e| &e.vision).collect();
        let vision = concat_vision(&rows);
        let mut pass = model.forward(&packed, vision.as_ref(), &mut acts, opt.tower.is_some())?;
        let (logp, _) = response_log_probs_after_forward(model.lm(), &mut acts, &packed, 1.0)?;
        let mut coeffs = vec![0.0f32; chunk.len() * response_cols];
        let w = -1.0 / total as f32;
        for (r, e) in chunk.iter().enumerate() {
            for t in (0..e.response.len()).filter(|&t| e.learns(t)) {
                let i = r * response_cols + t;
                nll -= f64::from(logp[i]);
                coeffs[i] = w;
            }
        }
        if !nll.is_finite() {
            finite = false;
            break;
        }
        let spread = packed.spread_response(&coeffs);
        model.backward_from_log_prob_grads(
            &packed.inputs(),
            &mut acts,
            &mut pass,
            &packed.targets,
            &spread,
            1.0,
            &mut opt.grads,
            opt.tower.as_mut(),
            None,
        )?;
    }
    opt.steps += 1;
    if !finite {
        return Ok(SftStep {
            loss: f64::NAN,
            grad_norm: f64::NAN,
            applied: false,
            tokens: total,
        });
    }
    let r = model.optimizer_step(
        &mut opt.adamw,
        &opt.grads,
        opt.tower.as_mut(),
        lr,
        max_grad_norm,
        None,
    )?;
    Ok(SftStep {
        loss: nll / total as f64,
        grad_norm: f64::from(r.grad_norm),
        applied: r.applied,
        tokens: total,
    })
}
