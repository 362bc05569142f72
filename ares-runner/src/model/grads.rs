//! [`Grads`]: the gradient of every parameter, laid out exactly like the model's weights
//! (one buffer per kind of tensor, stacked over layers), so an optimizer can walk weights
//! and gradients side by side. Tied embeddings have one gradient, `embed_tokens`, into
//! which the LM head's gradient is added.

use super::weights::{DeviceWeights, Stack};
use super::{Model, ModelError};
use crate::backend::{Backend, DeviceBuffer, Tensor, View, ViewMut};

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

/// A zeroed copy of an optional stack.
fn zeros_opt<B: Backend>(
    stack: &Option<Stack<B>>,
    backend: &B,
) -> Result<Option<Stack<B>>, ModelError> {
    stack.as_ref().map(|s| s.zeros_like(backend)).transpose()
}

impl<B: Backend> Grads<B> {
    /// Zeroed gradients with the layout of `weights`.
    pub(crate) fn zeros_like(backend: &B, w: &DeviceWeights<B>) -> Result<Self, ModelError> {
        let g = DeviceWeights {
            embed: backend.alloc(w.embed.len())?,
            lm_head: w
                .lm_head
                .as_ref()
                .map(|h| backend.alloc(h.len()))
                .transpose()?,
            norm: backend.alloc(w.norm.len())?,
            ln1: w.ln1.zeros_like(backend)?,
            q: w.q.zeros_like(backend)?,
            q_bias: zeros_opt(&w.q_bias, backend)?,
            k: w.k.zeros_like(backend)?,
            k_bias: zeros_opt(&w.k_bias, backend)?,
            v: w.v.zeros_like(backend)?,
            v_bias: zeros_opt(&w.v_bias, backend)?,
            o: w.o.zeros_like(backend)?,
            o_bias: zeros_opt(&w.o_bias, backend)?,
            q_norm: zeros_opt(&w.q_norm, backend)?,
            k_norm: zeros_opt(&w.k_norm, backend)?,
            ln2: w.ln2.zeros_like(backend)?,
            gate: w.gate.zeros_like(backend)?,
            gate_bias: zeros_opt(&w.gate_bias, backend)?,
            up: w.up.zeros_like(backend)?,
            up_bias: zeros_opt(&w.up_bias, backend)?,
            down: w.down.zeros_like(backend)?,
            down_bias: zeros_opt(&w.down_bias, backend)?,
        };
        Ok(Self { g })
    }

    /// Every gradient buffer, stacked ones whole.
    fn buffers_mut(&mut self) -> Vec<&mut B::Buffer> {
        let g = &mut self.g;
        let mut out = vec![&mut g.embed, &mut g.norm];
        out.extend(g.lm_head.as_mut());
        for s in [
            &mut g.ln1,
            &mut g.q,
            &mut g.k,
            &mut g.v,
            &mut g.o,
            &mut g.ln2,
            &mut g.gate,
            &mut g.up,
            &mut g.down,
        ] {
            out.push(s.buffer_mut());
        }
        for s in [
            &mut g.q_bias,
            &mut g.k_bias,
            &mut g.v_bias,
            &mut g.o_bias,
            &mut g.q_norm,
            &mut g.k_norm,
            &mut g.gate_bias,
            &mut g.up_bias,
            &mut g.down_bias,
        ]
        .into_iter()
        .flatten()
        {
            out.push(s.buffer_mut());
        }
        out
    }

    /// Sets every gradient to zero.
    ///
    /// # Errors
    /// A backend failure.
    pub fn zero(&mut self, backend: &B) -> Result<(), ModelError> {
        for buffer in self.buffers_mut() {
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
        let g = &self.g;
        let unknown = |why: &str| ModelError::UnknownParameter {
            name: name.to_string(),
            why: why.to_string(),
        };
        match name {
            "model.embed_tokens.weight" => return Ok(View::whole(&g.embed)),
            "model.norm.weight" => return Ok(View::whole(&g.norm)),
            "lm_head.weight" => {
                return g.lm_head.as_ref().map(View::whole).ok_or_else(|| {
                    unknown("embeddings are tied: the LM head's gradient is in model.embed_tokens.weight")
                });
            }
            _ => {}
        }
        let rest = name
            .strip_prefix("model.layers.")
            .ok_or_else(|| unknown("expected model.embed_tokens/norm or model.layers.N.*"))?;
        let (layer, suffix) = rest
            .split_once('.')
            .ok_or_else(|| unknown("expected model.layers.N.<tensor>"))?;
        let layer: usize = layer
            .parse()
            .map_err(|_| unknown("the layer index is not a number"))?;
        let stack: Option<&Stack<B>> = match suffix {
            "input_layernorm.weight" => Some(&g.ln1),
            "self_attn.q_proj.weight" => Some(&g.q),
            "self_attn.q_proj.bias" => g.q_bias.as_ref(),
            "self_attn.k_proj.weight" => Some(&g.k),
            "self_attn.k_proj.bias" => g.k_bias.as_ref(),
            "self_attn.v_proj.weight" => Some(&g.v),
            "self_attn.v_proj.bias" => g.v_bias.as_ref(),
            "self_attn.o_proj.weight" => Some(&g.o),
            "self_attn.o_proj.bias" => g.o_bias.as_ref(),
            "self_attn.q_norm.weight" => g.q_norm.as_ref(),
            "self_attn.k_norm.weight" => g.k_norm.as_ref(),
            "post_attention_layernorm.weight" => Some(&g.ln2),
            "mlp.gate_proj.weight" => Some(&g.gate),
            "mlp.gate_proj.bias" => g.gate_bias.as_ref(),
            "mlp.up_proj.weight" => Some(&g.up),
            "mlp.up_proj.bias" => g.up_bias.as_ref(),
            "mlp.down_proj.weight" => Some(&g.down),
            "mlp.down_proj.bias" => g.down_bias.as_ref(),
            _ => return Err(unknown("not a tensor of a decoder layer")),
        };
        let stack = stack.ok_or_else(|| unknown("this architecture has no such tensor"))?;
        let layers = g.ln1.buffer().len() / g.norm.len().max(1);
        if layer >= layers {
            return Err(unknown(&format!("the model has {layers} layers")));
        }
        stack.layer(layer)
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
        Grads::zeros_like(&self.backend, &self.weights)
    }
}
