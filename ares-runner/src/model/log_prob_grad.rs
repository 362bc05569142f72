//! The loss head of training: the policy losses (spec §6) hand back ∂L/∂logπ per token, so
//! the model only needs the backward of the per-token log-prob to reach ∂L/∂θ — no
//! autodiff, and no `[tokens, vocab]` log-softmax kept between the passes.

use super::{Activations, Grads, Inputs, Model, ModelError};
use crate::backend::{Backend, View, ViewMut};

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
    /// `acts` first ([`Model::log_prob_entropy`] in between is fine: it leaves the logits).
    /// Use the temperature the log-probs of the loss were computed at (the rollout's
    /// sampling temperature, as `logits / T` in verl-style trainers).
    ///
    /// # Errors
    /// Invalid inputs, `acts` planned for another `(batch, seq)`, `targets` or `coeffs` not
    /// `batch · seq` long, a target `>= vocab`, a non-finite coefficient, a nonzero
    /// coefficient at a padding position (`attention_mask = 0`: its logits are
    /// meaningless), a temperature not finite and > 0, non-finite logits at a token with a
    /// nonzero coefficient, `grads` made for another model, or a backend failure. Nothing
    /// is added to `grads` unless every check passed.
    pub fn backward_from_log_prob_grads(
        &self,
        inputs: &Inputs<'_>,
        acts: &mut Activations<B>,
        targets: &[u32],
        coeffs: &[f32],
        temperature: f32,
        grads: &mut Grads<B>,
    ) -> Result<(), ModelError> {
        let n = inputs.check(&self.spec)?;
        if acts.shape() != (inputs.batch, inputs.seq) {
            return Err(ModelError::ActivationShape {
                planned: acts.shape(),
                actual: (inputs.batch, inputs.seq),
            });
        }
        let vocab = self.spec.vocab;
        check_targets(targets, n, vocab)?;
        check_temperature(temperature)?;
        if coeffs.len() != n {
            return Err(ModelError::InputLength {
                what: "coeffs",
                expected: n,
                actual: coeffs.len(),
            });
        }
        for (t, (&c, &m)) in coeffs.iter().zip(inputs.attention_mask).enumerate() {
            if !c.is_finite() {
                return Err(ModelError::InvalidValue {
                    what: format!("coeffs[{t}]"),
                    value: f64::from(c),
                    expected: "finite",
                });
            }
            if m == 0 && c != 0.0 {
                return Err(ModelError::InvalidValue {
                    what: format!("coeffs[{t}] (a padding position, attention_mask = 0)"),
                    value: f64::from(c),
                    expected: "0 at padding positions",
                });
            }
        }
        let be = &self.backend;
        be.upload_ids(targets, &mut acts.targets)?;
        be.upload(coeffs, ViewMut::whole(&mut acts.coeffs))?;
        be.log_prob_backward(
            View::whole(&acts.logits),
            vocab,
            temperature,
            &acts.targets,
            View::whole(&acts.coeffs),
            ViewMut::whole(&mut acts.dlogits),
        )?;
        self.backward_impl(inputs, acts, None, grads)
    }
}
