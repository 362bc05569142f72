//! The loss head of training: the policy losses (docs/algorithms.md §6) hand back ∂L/∂logπ per token, so
//! the model only needs the backward of the per-token log-prob to reach ∂L/∂θ — no
//! autodiff, and no `[tokens, vocab]` log-softmax kept between the passes. An entropy bonus
//! (docs/algorithms.md §16) adds ∂L/∂H per token, back-propagated the same way.

use super::activations::head_chunks;
use super::backward::EmbedGrad;
use super::backward::HeadGrad;
use super::{Activations, Grads, Inputs, Model, ModelError};
use crate::backend::{Backend, ViewMut};

/// Checks `targets` is `n` ids below `vocab`.
pub(crate) fn check_targets(targets: &[u32], n: usize, vocab: usize) -> Result<(), ModelError> {
    if targets.len() != n {
        return Err(ModelError::InputLength {
            what: "targets",
            expected: n,
            actual: targets.len(),
        });
    }
    if let Some((index, &id)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= vocab)
    {
        return Err(ModelError::TokenOutOfRange {
            what: "targets",
            index,
            id,
            vocab,
        });
    }
    Ok(())
}

/// Checks a sampling/scoring temperature is finite and > 0.
pub(crate) fn check_temperature(temperature: f32) -> Result<(), ModelError> {
    if temperature.is_finite() && temperature > 0.0 && (1.0 / temperature).is_finite() {
        Ok(())
    } else {
        Err(ModelError::InvalidValue {
            what: "temperature".into(),
            value: f64::from(temperature),
            expected: "finite and > 0",
        })
    }
}

/// Checks per-token coefficients `what` (`coeffs` or `entropy_coeffs`): `n` long, finite,
/// and 0 at padding positions (`attention_mask = 0`, where the logits are meaningless).
fn check_coeffs(
    what: &'static str,
    coeffs: &[f32],
    attention_mask: &[u32],
    n: usize,
) -> Result<(), ModelError> {
    if coeffs.len() != n {
        return Err(ModelError::InputLength {
            what,
            expected: n,
            actual: coeffs.len(),
        });
    }
    for (t, (&c, &m)) in coeffs.iter().zip(attention_mask).enumerate() {
        if !c.is_finite() {
            return Err(ModelError::InvalidValue {
                what: format!("{what}[{t}]"),
                value: f64::from(c),
                expected: "finite",
            });
        }
        if m == 0 && c != 0.0 {
            return Err(ModelError::InvalidValue {
                what: format!("{what}[{t}] (a padding position, attention_mask = 0)"),
                value: f64::from(c),
                expected: "0 at padding positions",
            });
        }
    }
    Ok(())
}

impl<B: Backend> Model<B> {
    /// The backward pass of a loss given through its per-token log-prob gradients: with
    /// `coeffs[t] = ∂L/∂logπ_t` for `logπ_t = log softmax(logits_t / temperature)[targets[t]]`
    /// (all `[batch, seq]`, row-major; 0 where the loss ignores the token), computes on the
    /// device
    ///
    /// ```text
    /// ∂L/∂logits_t = coeffs[t]/T · (onehot(targets[t]) − softmax(logits_t / T))
    /// ```
    ///
    /// into the arena (no host copy of the logits), then runs [`Model::backward`] from it,
    /// **adding** ∂L/∂θ into `grads`. Run [`Model::forward`] on the same `inputs` and
    /// `acts` first ([`Model::log_prob_entropy`] in between is fine: it leaves the logits
    /// and the final-norm output). Use the temperature the log-probs of the loss were
    /// computed at (the rollout's sampling temperature, as `logits / T` in verl-style
    /// trainers).
    ///
    /// With a chunked LM head ([`HeadMode::Chunked`](super::HeadMode::Chunked)) this runs
    /// per chunk of rows: the chunk's logits are recomputed from the final-norm output,
    /// turned into the chunk's ∂L/∂logits (`[rows, vocab]`, the largest head buffer), and
    /// pushed through the LM head's backward (its rows of ∂L/∂lnf, its part of the head's — or
    /// with tied embeddings the embedding's — gradient); chunks whose coefficients are all
    /// zero are skipped. Then the layers' backward runs once, as with whole logits.
    ///
    /// # Errors
    /// Invalid inputs, `acts` planned for another `(batch, seq)`, `targets` or `coeffs` not
    /// `batch · seq` long, a target `>= vocab`, a non-finite coefficient, a nonzero
    /// coefficient at a padding position (`attention_mask = 0`: its logits are
    /// meaningless), a temperature not finite and > 0, non-finite logits at a token with a
    /// nonzero coefficient, `grads` made for another model, or a backend failure. Nothing
    /// is added to `grads` unless every argument check passed; non-finite logits are found
    /// chunk by chunk, so with a chunked head the LM head's gradient of earlier chunks may
    /// already have been added when they are (the layers' are not; zero the gradients
    /// before retrying). [`Model::log_prob_entropy`] on the same pass finds them first.
    pub fn backward_from_log_prob_grads(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        targets: &[u32],
        coeffs: &[f32],
        temperature: f32,
        grads: &mut Grads<B>,
    ) -> Result<(), ModelError> {
        self.backward_from_log_prob_grads_with(
            inputs,
            acts,
            targets,
            coeffs,
            temperature,
            grads,
            None,
            None,
        )
    }

    /// [`Model::backward_from_log_prob_grads`] with two optional extras:
    ///
    /// - `embeds`: after a forward with replaced embedding rows ([`Model::forward_with`]),
    ///   also writes their gradient into `embeds.d_embeds`;
    /// - `entropy_coeffs`: an entropy term of the loss, `entropy_coeffs[t] = ∂L/∂H_t` for the
    ///   entropy `H_t` of `softmax(logits_t / temperature)` (what [`Model::log_prob_entropy`]
    ///   computes at the same temperature; e.g. `−c·w_t` for a bonus `−c·Σ_t w_t·H_t`), per
    ///   position like `coeffs` (`batch · seq`, finite, 0 at padding). The loss head then
    ///   makes, per token, with `p_t = softmax(logits_t / T)`,
    ///
    ///   ```text
    ///   ∂L/∂logits_t = coeffs[t]/T · (onehot(targets[t]) − p_t)
    ///                − entropy_coeffs[t] · p_t·(ln p_t + H_t)/T
    ///   ```
    ///
    ///   ([`Backend::log_prob_backward`], then [`Backend::entropy_backward`] adding to it).
    ///   A head chunk runs when any of its log-prob or entropy coefficients is nonzero.
    ///   `None` is the same as all zeros, without the upload or the extra pass.
    ///
    /// # Errors
    /// As [`Model::backward_from_log_prob_grads`]; `d_embeds` not a whole number of rows;
    /// `entropy_coeffs` checked as `coeffs` (length, finite, 0 at padding), and non-finite
    /// logits at a token with a nonzero entropy coefficient.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_from_log_prob_grads_with(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        targets: &[u32],
        coeffs: &[f32],
        temperature: f32,
        grads: &mut Grads<B>,
        embeds: Option<EmbedGrad<'_, B>>,
        entropy_coeffs: Option<&[f32]>,
    ) -> Result<(), ModelError> {
        let n = self.check_head_call(inputs, acts, targets, temperature)?;
        check_coeffs("coeffs", coeffs, inputs.attention_mask, n)?;
        if let Some(ec) = entropy_coeffs {
            check_coeffs("entropy_coeffs", ec, inputs.attention_mask, n)?;
        }
        let be = &self.backend;
        let mut active = Vec::with_capacity(acts.targets.len());
        for ((start, rows), ids) in head_chunks(n, acts.chunk_rows).zip(&mut acts.targets) {
            be.upload_ids(&targets[start..start + rows], ids)?;
            let nonzero = |c: &[f32]| c[start..start + rows].iter().any(|&c| c != 0.0);
            active.push(nonzero(coeffs) || entropy_coeffs.is_some_and(nonzero));
        }
        be.upload(coeffs, ViewMut::whole(&mut acts.coeffs))?;
        if let Some(ec) = entropy_coeffs {
            be.upload(ec, ViewMut::whole(&mut acts.entropy_coeffs))?;
        }
        let head = HeadGrad::LogProb {
            temperature,
            active: &active,
            entropy: entropy_coeffs.is_some(),
        };
        self.backward_impl(inputs, acts, head, grads, embeds)
    }

    /// [`Model::backward_from_log_prob_grads_with`] from coefficients a loss on the device
    /// wrote into `acts` ([`Activations::loss_buffers`]: `coeffs`, and `entropy_coeffs` when
    /// `entropy`), `[batch · seq]` in the pass's token order, 0 at every position without a
    /// loss term: only the targets cross to the device. Every head chunk runs (the host
    /// cannot see which coefficients are zero), so a chunk of prompt tokens costs its head
    /// pass where the host variant skips it.
    ///
    /// # Errors
    /// As [`Model::backward_from_log_prob_grads_with`] (the coefficients are not checked:
    /// non-finite ones give non-finite gradients, which the optimizer step refuses).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_from_device_log_prob_grads(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        targets: &[u32],
        temperature: f32,
        grads: &mut Grads<B>,
        embeds: Option<EmbedGrad<'_, B>>,
        entropy: bool,
    ) -> Result<(), ModelError> {
        let n = self.check_head_call(inputs, acts, targets, temperature)?;
        let be = &self.backend;
        for ((start, rows), ids) in head_chunks(n, acts.chunk_rows).zip(&mut acts.targets) {
            be.upload_ids(&targets[start..start + rows], ids)?;
        }
        let active = vec![true; acts.targets.len()];
        let head = HeadGrad::LogProb {
            temperature,
            active: &active,
            entropy,
        };
        self.backward_impl(inputs, acts, head, grads, embeds)
    }

    /// The checks both backward entries start with: the inputs, `acts` planned for them,
    /// the targets and the temperature; the number of positions.
    fn check_head_call(
        &self,
        inputs: &Inputs<'_>,
        acts: &Activations<B>,
        targets: &[u32],
        temperature: f32,
    ) -> Result<usize, ModelError> {
        let n = inputs.check(&self.spec)?;
        if acts.shape() != (inputs.batch, inputs.seq) {
            return Err(ModelError::ActivationShape {
                planned: acts.shape(),
                actual: (inputs.batch, inputs.seq),
            });
        }
        check_targets(targets, n, self.spec.vocab)?;
        check_temperature(temperature)?;
        Ok(n)
    }
}
