//! The model's weights on the backend: uploaded once at load time, one buffer per kind of
//! tensor stacked over layers (`[layers, rows, cols]`, llm.c style), read through per-layer
//! views.

use super::{ModelError, ModelSpec};
use crate::backend::{Backend, DeviceBuffer, Tensor, TensorMut, View, ViewMut};
use crate::hf::weights::{LayerWeights, ModelWeights, Tensor as HostTensor};

/// One kind of per-layer tensor, `[layers, item]` in one buffer.
#[derive(Debug)]
pub(crate) struct Stack<B: Backend> {
    buffer: B::Buffer,
    item: usize,
}

impl<B: Backend> Stack<B> {
    /// The tensor of layer `layer`.
    pub(crate) fn layer(&self, layer: usize) -> Result<Tensor<'_, B>, ModelError> {
        Ok(View::item(&self.buffer, layer, self.item)?)
    }

    /// The tensor of layer `layer`, writable (gradients).
    pub(crate) fn layer_mut(&mut self, layer: usize) -> Result<TensorMut<'_, B>, ModelError> {
        Ok(ViewMut::item(&mut self.buffer, layer, self.item)?)
    }

    /// The whole `[layers, item]` buffer.
    pub(crate) fn buffer(&self) -> &B::Buffer {
        &self.buffer
    }

    /// The whole `[layers, item]` buffer, writable.
    pub(crate) fn buffer_mut(&mut self) -> &mut B::Buffer {
        &mut self.buffer
    }

    /// A zeroed stack of the same shape (a gradient).
    pub(crate) fn zeros_like(&self, backend: &B) -> Result<Self, ModelError> {
        Ok(Self {
            buffer: backend.alloc(self.buffer.len())?,
            item: self.item,
        })
    }
}

/// The writable layer `l` tensor of an optional stack.
pub(crate) fn layer_of_mut<B: Backend>(
    stack: &mut Option<Stack<B>>,
    layer: usize,
) -> Result<Option<TensorMut<'_, B>>, ModelError> {
    stack.as_mut().map(|s| s.layer_mut(layer)).transpose()
}

/// The layer `l` tensor of an optional stack (a bias, Qwen3's q/k norm).
pub(crate) fn layer_of<B: Backend>(
    stack: &Option<Stack<B>>,
    layer: usize,
) -> Result<Option<Tensor<'_, B>>, ModelError> {
    stack.as_ref().map(|s| s.layer(layer)).transpose()
}

/// The model's parameters on backend `B`.
#[derive(Debug)]
pub(crate) struct DeviceWeights<B: Backend> {
    /// `[vocab, hidden]`.
    pub embed: B::Buffer,
    /// `[vocab, hidden]`, `None` when tied to `embed`.
    pub lm_head: Option<B::Buffer>,
    /// Final norm `[hidden]`.
    pub norm: B::Buffer,
    pub ln1: Stack<B>,
    pub q: Stack<B>,
    pub q_bias: Option<Stack<B>>,
    pub k: Stack<B>,
    pub k_bias: Option<Stack<B>>,
    pub v: Stack<B>,
    pub v_bias: Option<Stack<B>>,
    pub o: Stack<B>,
    pub o_bias: Option<Stack<B>>,
    pub q_norm: Option<Stack<B>>,
    pub k_norm: Option<Stack<B>>,
    pub ln2: Stack<B>,
    pub gate: Stack<B>,
    pub gate_bias: Option<Stack<B>>,
    pub up: Stack<B>,
    pub up_bias: Option<Stack<B>>,
    pub down: Stack<B>,
    pub down_bias: Option<Stack<B>>,
}

/// `model.layers.{l}.{suffix}`, for messages.
fn layer_name(layer: usize, suffix: &str) -> String {
    format!("model.layers.{layer}.{suffix}")
}

/// Uploads one host tensor after checking its size.
fn upload<B: Backend>(
    backend: &B,
    name: &str,
    tensor: &HostTensor,
    expected: usize,
) -> Result<B::Buffer, ModelError> {
    check_len(name, expected, tensor.data.len())?;
    let mut buffer = backend.alloc(expected)?;
    backend.upload(&tensor.data, ViewMut::whole(&mut buffer))?;
    Ok(buffer)
}

fn check_len(name: &str, expected: usize, actual: usize) -> Result<(), ModelError> {
    if expected == actual {
        Ok(())
    } else {
        Err(ModelError::WeightShape {
            name: name.to_string(),
            expected,
            actual,
        })
    }
}

/// Stacks tensor `suffix` of every layer (`get` picks it) into one buffer; a layer without
/// it is an error.
fn stack<B: Backend>(
    backend: &B,
    layers: &[LayerWeights],
    suffix: &str,
    item: usize,
    get: impl Fn(&LayerWeights) -> Option<&HostTensor>,
) -> Result<Stack<B>, ModelError> {
    let total = item
        .checked_mul(layers.len())
        .ok_or_else(|| ModelError::WeightShape {
            name: layer_name(0, suffix),
            expected: usize::MAX,
            actual: item,
        })?;
    let mut buffer = backend.alloc(total)?;
    for (l, layer) in layers.iter().enumerate() {
        let name = layer_name(l, suffix);
        let tensor = get(layer).ok_or_else(|| ModelError::MissingWeight { name: name.clone() })?;
        check_len(&name, item, tensor.data.len())?;
        backend.upload(&tensor.data, ViewMut::item(&mut buffer, l, item)?)?;
    }
    Ok(Stack { buffer, item })
}

/// [`stack`] when `present`, else `None`.
fn optional<B: Backend>(
    present: bool,
    backend: &B,
    layers: &[LayerWeights],
    suffix: &str,
    item: usize,
    get: impl Fn(&LayerWeights) -> Option<&HostTensor>,
) -> Result<Option<Stack<B>>, ModelError> {
    present
        .then(|| stack(backend, layers, suffix, item, get))
        .transpose()
}

impl<B: Backend> DeviceWeights<B> {
    /// Uploads `weights`, checking every tensor against `spec`.
    pub(crate) fn upload(
        backend: &B,
        spec: &ModelSpec,
        weights: &ModelWeights,
    ) -> Result<Self, ModelError> {
        let (c, i, v) = (spec.hidden, spec.intermediate, spec.vocab);
        let (qd, kvd, d) = (spec.q_dim(), spec.kv_dim(), spec.head_dim);
        let layers = weights.layers.as_slice();
        if layers.len() != spec.layers {
            return Err(ModelError::WeightShape {
                name: "model.layers (count)".into(),
                expected: spec.layers,
                actual: layers.len(),
            });
        }
        let embed_name = "model.embed_tokens.weight";
        let embed = upload(backend, embed_name, &weights.embed_tokens, v * c)?;
        let lm_head = match (&weights.lm_head, spec.tied_embeddings) {
            (Some(t), _) => Some(upload(backend, "lm_head.weight", t, v * c)?),
            (None, true) => None,
            (None, false) => {
                return Err(ModelError::MissingWeight {
                    name: "lm_head.weight (tie_word_embeddings is false)".into(),
                });
            }
        };
        Ok(Self {
            embed,
            lm_head,
            norm: upload(backend, "model.norm.weight", &weights.norm, c)?,
            ln1: stack(backend, layers, "input_layernorm.weight", c, |l| {
                Some(&l.input_layernorm)
            })?,
            q: stack(backend, layers, "self_attn.q_proj.weight", qd * c, |l| {
                Some(&l.q_proj)
            })?,
            q_bias: optional(
                spec.qkv_bias,
                backend,
                layers,
                "self_attn.q_proj.bias",
                qd,
                |l| l.q_proj_bias.as_ref(),
            )?,
            k: stack(backend, layers, "self_attn.k_proj.weight", kvd * c, |l| {
                Some(&l.k_proj)
            })?,
            k_bias: optional(
                spec.qkv_bias,
                backend,
                layers,
                "self_attn.k_proj.bias",
                kvd,
                |l| l.k_proj_bias.as_ref(),
            )?,
            v: stack(backend, layers, "self_attn.v_proj.weight", kvd * c, |l| {
                Some(&l.v_proj)
            })?,
            v_bias: optional(
                spec.qkv_bias,
                backend,
                layers,
                "self_attn.v_proj.bias",
                kvd,
                |l| l.v_proj_bias.as_ref(),
            )?,
            o: stack(backend, layers, "self_attn.o_proj.weight", c * qd, |l| {
                Some(&l.o_proj)
            })?,
            o_bias: optional(
                spec.o_bias,
                backend,
                layers,
                "self_attn.o_proj.bias",
                c,
                |l| l.o_proj_bias.as_ref(),
            )?,
            q_norm: optional(
                spec.qk_norm,
                backend,
                layers,
                "self_attn.q_norm.weight",
                d,
                |l| l.q_norm.as_ref(),
            )?,
            k_norm: optional(
                spec.qk_norm,
                backend,
                layers,
                "self_attn.k_norm.weight",
                d,
                |l| l.k_norm.as_ref(),
            )?,
            ln2: stack(backend, layers, "post_attention_layernorm.weight", c, |l| {
                Some(&l.post_attention_layernorm)
            })?,
            gate: stack(backend, layers, "mlp.gate_proj.weight", i * c, |l| {
                Some(&l.gate_proj)
            })?,
            gate_bias: optional(
                spec.mlp_bias,
                backend,
                layers,
                "mlp.gate_proj.bias",
                i,
                |l| l.gate_proj_bias.as_ref(),
            )?,
            up: stack(backend, layers, "mlp.up_proj.weight", i * c, |l| {
                Some(&l.up_proj)
            })?,
            up_bias: optional(spec.mlp_bias, backend, layers, "mlp.up_proj.bias", i, |l| {
                l.up_proj_bias.as_ref()
            })?,
            down: stack(backend, layers, "mlp.down_proj.weight", c * i, |l| {
                Some(&l.down_proj)
            })?,
            down_bias: optional(
                spec.mlp_bias,
                backend,
                layers,
                "mlp.down_proj.bias",
                c,
                |l| l.down_proj_bias.as_ref(),
            )?,
        })
    }

    /// The LM head `[vocab, hidden]`: its own tensor, or the embedding when tied.
    pub(crate) fn lm_head(&self) -> Tensor<'_, B> {
        View::whole(self.lm_head.as_ref().unwrap_or(&self.embed))
    }
}
