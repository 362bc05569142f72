//! The model's weights on the backend: uploaded once at load time, one buffer per kind of
//! tensor stacked over layers (`[layers, rows, cols]`, llm.c style), read through per-layer
//! views.

use super::{ModelError, ModelSpec};
use crate::backend::{Backend, DType, DeviceBuffer, Stored, Tensor, TensorMut, View, ViewMut};
use crate::hf::weights::{LAYER_SUFFIXES, LayerWeights, ModelWeights, Tensor as HostTensor};

/// One kind of per-layer tensor, `[layers, item]` in one buffer.
///
/// A linear layer's stack of a model whose weights are stored in bf16
/// ([`Model::set_weight_storage`](super::Model::set_weight_storage)) is *released*: its f32
/// buffer is freed (empty) while the stack keeps its length, the bf16 copy being the weight;
/// reading a layer of it is then an error, never an empty tensor.
#[derive(Debug)]
pub(crate) struct Stack<B: Backend> {
    buffer: B::Buffer,
    item: usize,
    /// Elements over every layer (the buffer's length unless released).
    len: usize,
}

/// [`Stack`] of 16-bit floats (bf16 decode weights).
#[derive(Debug)]
pub(crate) struct HalfStack<B: Backend> {
    buffer: B::Half,
    item: usize,
}

impl<B: Backend> HalfStack<B> {
    /// The bits, writable (the optimizer writes a copy with its update).
    pub(crate) fn buffer_mut(&mut self) -> &mut B::Half {
        &mut self.buffer
    }

    /// Elements over every layer.
    pub(crate) fn len(&self) -> usize {
        self.buffer.len()
    }

    /// Every layer at once.
    pub(crate) fn whole(&self) -> View<'_, B::Half> {
        View::whole(&self.buffer)
    }

    /// The tensor of layer `layer`.
    pub(crate) fn layer(&self, layer: usize) -> Result<View<'_, B::Half>, ModelError> {
        Ok(View::item(&self.buffer, layer, self.item)?)
    }

    /// `src` rounded to bf16 (same layout), in a new stack of `item`-element layers.
    pub(crate) fn rounded(
        backend: &B,
        src: Tensor<'_, B>,
        item: usize,
    ) -> Result<Self, ModelError> {
        let mut stack = Self {
            buffer: backend.alloc_half(src.len(), DType::Bf16)?,
            item,
        };
        stack.round_from(backend, src)?;
        Ok(stack)
    }

    /// Rounds `src` (as long as the stack) to bf16 into the stack.
    pub(crate) fn round_from(&mut self, backend: &B, src: Tensor<'_, B>) -> Result<(), ModelError> {
        backend.round_bf16(src, ViewMut::whole(&mut self.buffer))?;
        Ok(())
    }
}

impl<B: Backend> HalfStack<B> {
    /// A zeroed stack of `len` elements in `item`-element layers (`Backend::alloc_half`
    /// zeroes: all-zero bits are bf16 +0).
    pub(crate) fn zeros(backend: &B, len: usize, item: usize) -> Result<Self, ModelError> {
        let buffer = backend.alloc_half(len, DType::Bf16)?;
        Ok(Self { buffer, item })
    }

    /// The tensor of layer `layer`, writable.
    pub(crate) fn layer_mut(&mut self, layer: usize) -> Result<ViewMut<'_, B::Half>, ModelError> {
        Ok(ViewMut::item(&mut self.buffer, layer, self.item)?)
    }

    /// The values widened to f32 (exact), in a new stack.
    pub(crate) fn widened(&self, backend: &B) -> Result<Stack<B>, ModelError> {
        let mut buffer = backend.alloc(self.buffer.len())?;
        backend.widen_bf16(self.whole(), ViewMut::whole(&mut buffer))?;
        Ok(Stack::new(buffer, self.item))
    }

    /// The values of `view` (of this stack) on the host, widened to f32 (exact): the bf16
    /// bits downloaded, no device copy.
    pub(crate) fn download_widened(
        backend: &B,
        view: View<'_, B::Half>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut out = vec![0.0; view.len()];
        Stored::<B>::Bf16(view).download(backend, &mut out)?;
        Ok(out)
    }
}

impl<B: Backend> Stack<B> {
    /// A stack of `buffer.len() / item` layers of `item` elements each.
    pub(crate) fn new(buffer: B::Buffer, item: usize) -> Self {
        let len = buffer.len();
        Self { buffer, item, len }
    }

    /// Elements over every layer (also of a released stack).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the f32 buffer is freed (the weight is stored in bf16 only).
    pub(crate) fn is_released(&self) -> bool {
        self.buffer.len() != self.len
    }

    /// Frees the f32 buffer, keeping the stack's length (its bf16 copy becomes the weight).
    pub(crate) fn release(&mut self, backend: &B) -> Result<(), ModelError> {
        self.buffer = backend.alloc(0)?;
        Ok(())
    }

    /// Gives a released stack its f32 values back (`buffer`, as long as the stack).
    pub(crate) fn restore(&mut self, buffer: B::Buffer) -> Result<(), ModelError> {
        if buffer.len() != self.len {
            return Err(ModelError::LayoutMismatch {
                what: "restored f32 weights",
            });
        }
        self.buffer = buffer;
        Ok(())
    }

    /// Elements of one layer's tensor.
    pub(crate) fn item(&self) -> usize {
        self.item
    }

    /// The buffer, taken (a stack made to be restored into another).
    pub(crate) fn into_buffer(self) -> B::Buffer {
        self.buffer
    }

    /// The buffer of every layer.
    pub(crate) fn buffer(&self) -> &B::Buffer {
        &self.buffer
    }

    /// The buffer of every layer, writable.
    pub(crate) fn buffer_mut(&mut self) -> &mut B::Buffer {
        &mut self.buffer
    }

    /// Every layer at once.
    pub(crate) fn whole(&self) -> Tensor<'_, B> {
        View::whole(&self.buffer)
    }

    /// The tensor of layer `layer`; [`ModelError::Bf16Weights`] for a released stack.
    pub(crate) fn layer(&self, layer: usize) -> Result<Tensor<'_, B>, ModelError> {
        self.check_kept()?;
        Ok(View::item(&self.buffer, layer, self.item)?)
    }

    /// The tensor of layer `layer`, writable (gradients).
    pub(crate) fn layer_mut(&mut self, layer: usize) -> Result<TensorMut<'_, B>, ModelError> {
        self.check_kept()?;
        Ok(ViewMut::item(&mut self.buffer, layer, self.item)?)
    }

    fn check_kept(&self) -> Result<(), ModelError> {
        match self.is_released() {
            true => Err(ModelError::Bf16Weights {
                what: "an f32 read of a linear weight",
            }),
            false => Ok(()),
        }
    }

    /// Every layer's `[rows, cols]` matrix transposed to `[cols, rows]`, in a new stack.
    pub(crate) fn transposed(
        &self,
        backend: &B,
        rows: usize,
        cols: usize,
    ) -> Result<Self, ModelError> {
        let mut buffer = backend.alloc(self.len)?;
        let layers = self.len / self.item.max(1);
        for l in 0..layers {
            backend.transpose(
                self.layer(l)?,
                rows,
                cols,
                ViewMut::item(&mut buffer, l, self.item)?,
            )?;
        }
        Ok(Self::new(buffer, self.item))
    }

    /// Every layer's `[rows, cols]` matrix in the f32 decode layout
    /// ([`Backend::pack_decode_f32`]), in a new stack.
    pub(crate) fn packed_f32(
        &self,
        backend: &B,
        rows: usize,
        cols: usize,
    ) -> Result<Self, ModelError> {
        let layers = self.len / self.item.max(1);
        let mut buffer = backend.alloc(self.len)?;
        for l in 0..layers {
            let dst = ViewMut::item(&mut buffer, l, self.item)?;
            backend.pack_decode_f32(self.layer(l)?, rows, cols, dst)?;
        }
        Ok(Self::new(buffer, self.item))
    }

    /// Every layer's `[rows, cols]` matrix rounded to bf16 in the bf16 decode layout
    /// ([`Backend::pack_bf16`]), in a new stack.
    pub(crate) fn packed_bf16(
        &self,
        backend: &B,
        rows: usize,
        cols: usize,
    ) -> Result<HalfStack<B>, ModelError> {
        let layers = self.len / self.item.max(1);
        let mut buffer = backend.alloc_half(self.len, DType::Bf16)?;
        for l in 0..layers {
            let dst = ViewMut::item(&mut buffer, l, self.item)?;
            backend.pack_bf16(self.layer(l)?, rows, cols, dst)?;
        }
        Ok(HalfStack {
            buffer,
            item: self.item,
        })
    }

    /// A zeroed stack of the same shape (a gradient; f32 also for a released stack).
    pub(crate) fn zeros_like(&self, backend: &B) -> Result<Self, ModelError> {
        Ok(Self::new(backend.alloc(self.len)?, self.item))
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
    /// `[vocab, hidden]` (one layer; released when stored in bf16).
    pub embed: Stack<B>,
    /// `[vocab, hidden]`, `None` when tied to `embed` (one layer; released when stored
    /// in bf16).
    pub lm_head: Option<Stack<B>>,
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
    Ok(Stack::new(buffer, item))
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
        let whole = |buffer: B::Buffer| Stack::new(buffer, v * c);
        let embed = whole(upload(backend, embed_name, &weights.embed_tokens, v * c)?);
        let lm_head = match (&weights.lm_head, spec.tied_embeddings) {
            (Some(t), _) => Some(whole(upload(backend, "lm_head.weight", t, v * c)?)),
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

    /// The LM head `[vocab, hidden]`: its own tensor, or the embedding when tied (empty
    /// when stored in bf16: [`Self::head_stack`] says).
    pub(crate) fn lm_head(&self) -> Tensor<'_, B> {
        self.head_stack().whole()
    }

    /// The LM head's stack: its own, or the embedding's when tied.
    pub(crate) fn head_stack(&self) -> &Stack<B> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// A zeroed copy of the same layout (a gradient, an optimizer moment).
    pub(crate) fn zeros_like(&self, backend: &B) -> Result<Self, ModelError> {
        let zeros = |s: &Option<Stack<B>>| s.as_ref().map(|s| s.zeros_like(backend)).transpose();
        Ok(Self {
            embed: self.embed.zeros_like(backend)?,
            lm_head: zeros(&self.lm_head)?,
            norm: backend.alloc(self.norm.len())?,
            ln1: self.ln1.zeros_like(backend)?,
            q: self.q.zeros_like(backend)?,
            q_bias: zeros(&self.q_bias)?,
            k: self.k.zeros_like(backend)?,
            k_bias: zeros(&self.k_bias)?,
            v: self.v.zeros_like(backend)?,
            v_bias: zeros(&self.v_bias)?,
            o: self.o.zeros_like(backend)?,
            o_bias: zeros(&self.o_bias)?,
            q_norm: zeros(&self.q_norm)?,
            k_norm: zeros(&self.k_norm)?,
            ln2: self.ln2.zeros_like(backend)?,
            gate: self.gate.zeros_like(backend)?,
            gate_bias: zeros(&self.gate_bias)?,
            up: self.up.zeros_like(backend)?,
            up_bias: zeros(&self.up_bias)?,
            down: self.down.zeros_like(backend)?,
            down_bias: zeros(&self.down_bias)?,
        })
    }

    /// The stacks stored in bf16 under [`WeightStorage::Bf16`](super::WeightStorage::Bf16),
    /// in the order of their copies: the linear layers' (q, k, v, o, gate, up, down), the
    /// LM head (the embedding when tied), then an untied embedding.
    pub(crate) fn stored_stacks_mut(&mut self) -> Vec<&mut Stack<B>> {
        let Self {
            q,
            k,
            v,
            o,
            gate,
            up,
            down,
            embed,
            lm_head,
            ..
        } = self;
        let mut out = vec![q, k, v, o, gate, up, down];
        match lm_head {
            Some(head) => out.extend([head, embed]),
            None => out.push(embed),
        }
        out
    }

    /// The linear layers' stacks, q, k, v, o, gate, up, down (the first seven of
    /// [`Self::stored_stacks_mut`]).
    pub(crate) fn linear_stacks_mut(&mut self) -> [&mut Stack<B>; 7] {
        let Self {
            q,
            k,
            v,
            o,
            gate,
            up,
            down,
            ..
        } = self;
        [q, k, v, o, gate, up, down]
    }

    /// Where each of [`Self::linear_stacks_mut`]' stacks lies among [`Self::buffers`].
    pub(crate) fn linear_buffer_indices(&self) -> [usize; 7] {
        let whole = 2 + usize::from(self.lm_head.is_some());
        let present: Vec<&str> = self
            .stacks()
            .into_iter()
            .filter_map(|(suffix, s)| s.map(|_| suffix))
            .collect();
        let at = |suffix: &str| whole + present.iter().position(|p| *p == suffix).unwrap_or(0);
        let s = LAYER_SUFFIXES;
        [s[1], s[3], s[5], s[7], s[12], s[14], s[16]].map(at)
    }

    /// Decoder layers.
    pub(crate) fn layers(&self) -> usize {
        self.ln1.buffer.len() / self.ln1.item.max(1)
    }

    /// Every per-layer stack with its name suffix, in [`LAYER_SUFFIXES`] order (`None`
    /// where the architecture has no such tensor).
    fn stacks(&self) -> [(&'static str, Option<&Stack<B>>); 18] {
        let s = LAYER_SUFFIXES;
        [
            (s[0], Some(&self.ln1)),
            (s[1], Some(&self.q)),
            (s[2], self.q_bias.as_ref()),
            (s[3], Some(&self.k)),
            (s[4], self.k_bias.as_ref()),
            (s[5], Some(&self.v)),
            (s[6], self.v_bias.as_ref()),
            (s[7], Some(&self.o)),
            (s[8], self.o_bias.as_ref()),
            (s[9], self.q_norm.as_ref()),
            (s[10], self.k_norm.as_ref()),
            (s[11], Some(&self.ln2)),
            (s[12], Some(&self.gate)),
            (s[13], self.gate_bias.as_ref()),
            (s[14], Some(&self.up)),
            (s[15], self.up_bias.as_ref()),
            (s[16], Some(&self.down)),
            (s[17], self.down_bias.as_ref()),
        ]
    }

    /// The whole buffers and [`Self::stacks`], writable, borrowed together.
    #[allow(clippy::type_complexity)]
    fn parts_mut(
        &mut self,
    ) -> (
        [&mut B::Buffer; 2],
        Option<&mut Stack<B>>,
        [(&'static str, Option<&mut Stack<B>>); 18],
    ) {
        let Self {
            embed,
            lm_head,
            norm,
            ln1,
            q,
            q_bias,
            k,
            k_bias,
            v,
            v_bias,
            o,
            o_bias,
            q_norm,
            k_norm,
            ln2,
            gate,
            gate_bias,
            up,
            up_bias,
            down,
            down_bias,
        } = self;
        let s = LAYER_SUFFIXES;
        let stacks = [
            (s[0], Some(ln1)),
            (s[1], Some(q)),
            (s[2], q_bias.as_mut()),
            (s[3], Some(k)),
            (s[4], k_bias.as_mut()),
            (s[5], Some(v)),
            (s[6], v_bias.as_mut()),
            (s[7], Some(o)),
            (s[8], o_bias.as_mut()),
            (s[9], q_norm.as_mut()),
            (s[10], k_norm.as_mut()),
            (s[11], Some(ln2)),
            (s[12], Some(gate)),
            (s[13], gate_bias.as_mut()),
            (s[14], Some(up)),
            (s[15], up_bias.as_mut()),
            (s[16], Some(down)),
            (s[17], down_bias.as_mut()),
        ];
        ([&mut embed.buffer, norm], lm_head.as_mut(), stacks)
    }

    /// Every buffer (stacks whole) in a fixed order: embedding, final norm, LM head if
    /// untied, then the stacks in [`LAYER_SUFFIXES`] order. Two `DeviceWeights` of the
    /// same model list matching buffers at the same index.
    pub(crate) fn buffers(&self) -> Vec<&B::Buffer> {
        let mut out = vec![&self.embed.buffer, &self.norm];
        out.extend(self.lm_head.as_ref().map(|s| &s.buffer));
        out.extend(
            self.stacks()
                .into_iter()
                .filter_map(|(_, s)| s.map(|s| &s.buffer)),
        );
        out
    }

    /// `(buffer, offset, len)` of layer `layer` in each stack among [`Self::buffers`] — a
    /// released stack's too, whose values lie in its bf16 stack (gradients stored in bf16);
    /// none past the last layer.
    pub(crate) fn layer_ranges(&self, layer: usize) -> Vec<(usize, usize, usize)> {
        let whole = 2 + usize::from(self.lm_head.is_some());
        self.stacks()
            .into_iter()
            .filter_map(|(_, s)| s)
            .enumerate()
            .filter(|(_, s)| (layer + 1) * s.item <= s.len())
            .map(|(i, s)| (whole + i, layer * s.item, s.item))
            .collect()
    }

    /// [`Self::buffers`], writable.
    pub(crate) fn buffers_mut(&mut self) -> Vec<&mut B::Buffer> {
        let (whole, head, stacks) = self.parts_mut();
        let mut out: Vec<&mut B::Buffer> = whole.into_iter().collect();
        out.extend(head.map(|s| &mut s.buffer));
        out.extend(
            stacks
                .into_iter()
                .filter_map(|(_, s)| s.map(|s| &mut s.buffer)),
        );
        out
    }

    /// The length of each of [`Self::buffers`], in its order — a released stack's too (its
    /// buffer is empty, its weight the bf16 copy).
    pub(crate) fn buffer_lens(&self) -> Vec<usize> {
        let mut out = vec![self.embed.len(), self.norm.len()];
        out.extend(self.lm_head.as_ref().map(Stack::len));
        out.extend(
            self.stacks()
                .into_iter()
                .filter_map(|(_, s)| s.map(Stack::len)),
        );
        out
    }

    /// The tensor length of each of [`Self::buffers`], in its order: a whole buffer's
    /// length, or one layer's tensor of a stack.
    pub(crate) fn buffer_items(&self) -> Vec<usize> {
        let mut out = vec![self.embed.item, self.norm.len()];
        out.extend(self.lm_head.as_ref().map(|s| s.item));
        out.extend(
            self.stacks()
                .into_iter()
                .filter_map(|(_, s)| s.map(|s| s.item)),
        );
        out
    }

    /// Where the parameter with Hugging Face name `name` lives among [`Self::buffers`]:
    /// the buffer's index and the tensor's index in it (its layer; 0 for a whole buffer).
    ///
    /// # Errors
    /// As [`Self::tensor`].
    pub(crate) fn buffer_item(&self, name: &str) -> Result<(usize, usize), ModelError> {
        let whole = 2 + usize::from(self.lm_head.is_some());
        Ok(match self.locate(name)? {
            Place::Embed => (0, 0),
            Place::Norm => (1, 0),
            Place::LmHead => (2, 0),
            Place::Layer { layer, slot } => {
                let stacks = self.stacks();
                let before = stacks[..slot].iter().filter(|(_, s)| s.is_some()).count();
                (whole + before, layer)
            }
        })
    }

    /// Where the parameter with Hugging Face name `name` lives: a whole buffer, or a
    /// layer of a stack.
    fn locate(&self, name: &str) -> Result<Place, ModelError> {
        let unknown = |why: &str| ModelError::UnknownParameter {
            name: name.to_string(),
            why: why.to_string(),
        };
        match name {
            "model.embed_tokens.weight" => return Ok(Place::Embed),
            "model.norm.weight" => return Ok(Place::Norm),
            "lm_head.weight" => {
                return match self.lm_head {
                    Some(_) => Ok(Place::LmHead),
                    None => Err(unknown(
                        "embeddings are tied: the LM head is model.embed_tokens.weight",
                    )),
                };
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
        let slot = LAYER_SUFFIXES
            .iter()
            .position(|s| *s == suffix)
            .ok_or_else(|| unknown("not a tensor of a decoder layer"))?;
        if self.stacks()[slot].1.is_none() {
            return Err(unknown("this architecture has no such tensor"));
        }
        let layers = self.layers();
        if layer >= layers {
            return Err(unknown(&format!("the model has {layers} layers")));
        }
        Ok(Place::Layer { layer, slot })
    }

    /// The parameter with Hugging Face name `name` (`model.embed_tokens.weight`,
    /// `model.layers.1.mlp.down_proj.weight`, ...), row-major in its HF shape.
    ///
    /// # Errors
    /// [`ModelError::UnknownParameter`] for a name that is not a parameter of this model,
    /// including `lm_head.weight` with tied embeddings.
    pub(crate) fn tensor(&self, name: &str) -> Result<Tensor<'_, B>, ModelError> {
        match self.locate(name)? {
            Place::Embed => self.embed.layer(0),
            Place::Norm => Ok(View::whole(&self.norm)),
            Place::LmHead => self.head_stack().layer(0),
            Place::Layer { layer, slot } => match self.stacks()[slot].1 {
                Some(s) => s.layer(layer),
                None => Err(ModelError::UnknownParameter {
                    name: name.to_string(),
                    why: "this architecture has no such tensor".into(),
                }),
            },
        }
    }
}

/// Where a named parameter lives in [`DeviceWeights`].
#[derive(Debug, Clone, Copy)]
enum Place {
    Embed,
    Norm,
    LmHead,
    /// Layer `layer` of the stack at index `slot` of [`LAYER_SUFFIXES`].
    Layer {
        layer: usize,
        slot: usize,
    },
}
