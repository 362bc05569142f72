//! [`Grads`]: the gradient of every parameter, laid out exactly like the model's weights
//! (one buffer per kind of tensor, stacked over layers), so an optimizer can walk weights
//! and gradients side by side. Tied embeddings have one gradient, `embed_tokens`, into
//! which the LM head's gradient is added.

use super::weights::DeviceWeights;
use super::{Model, ModelError};
use crate::backend::{Backend, DeviceBuffer, Tensor, ViewMut};

/// Gradient buffers of a [`Model`] on backend `B`, zeroed when made. [`Model::backward`]
/// accumulates into them; call [`Grads::zero`] between optimizer steps.
pub struct Grads<B: Backend> {
    pub(crate) g: DeviceWeights<B>,
}

impl<B: Backend> std::fmt::Debug for Grads<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grads")
            .field("embed_tokens", &self.g.embed.len())
            .field("untied_lm_head", &self.g.lm_head.is_some())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Grads<B> {
    /// Sets every gradient to zero.
    ///
    /// # Errors
    /// A backend failure.
    pub fn zero(&mut self, backend: &B) -> Result<(), ModelError> {
        for buffer in self.g.buffers_mut() {
            backend.fill(ViewMut::whole(buffer), 0.0)?;
        }
        Ok(())
    }

    /// The gradient of the parameter with Hugging Face name `name`
    /// (`model.embed_tokens.weight`, `model.layers.1.mlp.down_proj.weight`, ...), with the
    /// parameter's shape, row-major.
    ///
    /// # Errors
    /// [`ModelError::UnknownParameter`] for a name that is not a parameter of this model,
    /// including `lm_head.weight` of a model with tied embeddings (its gradient is part of
    /// `model.embed_tokens.weight`'s).
    pub fn tensor(&self, name: &str) -> Result<Tensor<'_, B>, ModelError> {
        self.g.tensor(name)
    }

    /// Copies the gradient of parameter `name` (see [`Grads::tensor`]) to a new host vector.
    ///
    /// # Errors
    /// As [`Grads::tensor`], or a backend failure.
    pub fn download(&self, backend: &B, name: &str) -> Result<Vec<f32>, ModelError> {
        let t = self.tensor(name)?;
        let mut out = vec![0.0; t.len()];
        backend.download(t, &mut out)?;
        Ok(out)
    }
}

impl<B: Backend> Model<B> {
    /// Zeroed gradient buffers for this model's parameters.
    ///
    /// # Errors
    /// A backend allocation failure.
    pub fn grads(&self) -> Result<Grads<B>, ModelError> {
        Ok(Grads {
            g: self.weights.zeros_like(&self.backend)?,
        })
    }
}
