//! Activations stored in bf16 ([`ActivationDtype::Bf16`], `trainer.activation_dtype: bf16`):
//! the MLP block's saved tensors — the post-attention norm's output and the gate, up and
//! SwiGLU outputs, `C + 3I` of a layer's `4C + 3·Hq·D + 4·Hkv·D + 3I` floats a token — are
//! kept as the bf16 their products read, half their memory, and on a GPU the GEMMs read and
//! write them as they are (no conversion per product). Where a pass's attention runs on the
//! tensor cores the attention block's follow ([`ActLayout`]): the input norm's output and
//! q, k (after RoPE), v — which the bf16 products and the tensor-core kernels round to bf16
//! as they read them anyway, so the forward's numbers are its f32 activations', bit for bit
//! — and the attention's output, `2·Hq·D + 2·Hkv·D + C` more, which the output projection
//! rounds anyway and the backward's `δ = Σ dout·out` reads as stored (a change within bf16,
//! as FlashAttention's bf16 output).
//!
//! Each is rounded once, to nearest even, where it is written: the norm's output (which the
//! gate and up products round to bf16 anyway), the gate and up projections' f32 sums, and
//! the SwiGLU of the rounded gate and up (which the down product rounds anyway); `ln1`, q,
//! k, v are made in an f32 one-layer staging buffer and rounded from it, the attention's
//! output as the kernel stores it. The residual stream, the norms' `rstd`, the attention's
//! log-sum-exp and every gradient stay f32. The MLP's products are bf16
//! (`Backend::linear_bf16_io` and its kin) whatever the row count.

use super::ModelError;
use super::weights::{HalfStack, Stack};
use crate::backend::{Backend, Tensor, TensorMut, View, ViewMut};

/// What a LoRA pair of the MLP block cannot read.
pub(crate) const MLP_PAIR: &str = "a LoRA pair on gate, up or down (train it with f32 activations)";

/// How the activations a training pass saves are stored
/// ([`Model::set_activation_dtype`](super::Model::set_activation_dtype)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum ActivationDtype {
    /// Every activation in f32.
    #[default]
    F32,
    /// The MLP block's (the norm's output, gate, up and their SwiGLU) in bf16, and the
    /// attention block's input-norm output, q, k and v where its attention runs on the
    /// tensor cores ([`ActLayout`]); the others f32.
    Bf16,
}

impl ActivationDtype {
    /// The configuration name: `f32` or `bf16`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

/// Which of a layer's saved activations an arena stores in bf16: [`ActivationDtype::Bf16`]
/// stores the MLP block's, and the attention block's where the pass runs that block in
/// bf16 — its products in bf16 and its attention on the tensor cores, which round these
/// to bf16 as they read them anyway: q, k (after RoPE) and v, and the input norm's output
/// (`ln1`) unless a LoRA pair on q, k or v reads it (in f32) — so the forward's numbers are
/// those of f32 activations, bit for bit; each is made in an f32 one-layer staging buffer
/// and rounded once, to nearest even, into its stack — and the attention's output unless a
/// LoRA pair on o reads it, rounded as the kernel stores it (the output projection rounds
/// it anyway; the backward's `δ` reads the rounded values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct ActLayout {
    /// The MLP block's: the post-attention norm's output, gate, up and their SwiGLU.
    pub mlp: bool,
    /// The input norm's output.
    pub ln1: bool,
    /// q, k after RoPE, and v.
    pub qkv: bool,
    /// The attention's output.
    pub att: bool,
}

impl ActLayout {
    /// Every activation in f32.
    pub const F32: Self = Self {
        mlp: false,
        ln1: false,
        qkv: false,
        att: false,
    };

    /// The layout of `dtype` for a pass whose attention runs on the tensor cores or not
    /// (`tensor_core_attention`: bf16 products at the pass's rows, a head size they take,
    /// packed sequences on the backend) in a model with or without LoRA pairs on q, k or v
    /// (`lora.0`) and on o (`lora.1`), which read their inputs in f32.
    pub const fn of(
        dtype: ActivationDtype,
        tensor_core_attention: bool,
        lora: (bool, bool),
    ) -> Self {
        let attention = matches!(dtype, ActivationDtype::Bf16) && tensor_core_attention;
        Self {
            mlp: matches!(dtype, ActivationDtype::Bf16),
            ln1: attention && !lora.0,
            qkv: attention,
            att: attention && !lora.1,
        }
    }

    /// Whether an activation is staged in f32 before it is rounded: the attention block's
    /// in the forward, and `ln1` and `ln2` made again in the backward.
    pub const fn stages(self) -> bool {
        self.ln1 || self.qkv || self.mlp
    }
}

/// A stack of activations `[layers, item]` stored as [`ActivationDtype`] says.
pub(crate) enum ActStack<B: Backend> {
    F32(Stack<B>),
    Bf16(HalfStack<B>),
}

impl<B: Backend> std::fmt::Debug for ActStack<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dtype = if self.is_bf16() { "bf16" } else { "f32" };
        write!(f, "ActStack({dtype}, {} elements)", self.len())
    }
}

/// One layer of an [`ActStack`], read.
pub(crate) enum Act<'a, B: Backend> {
    F32(Tensor<'a, B>),
    Bf16(View<'a, B::Half>),
}

impl<B: Backend> Clone for Act<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Act<'_, B> {}

/// One layer of an [`ActStack`], written.
pub(crate) enum ActMut<'a, B: Backend> {
    F32(TensorMut<'a, B>),
    Bf16(ViewMut<'a, B::Half>),
}

impl<B: Backend> ActStack<B> {
    /// `len` elements in layers of `item`, stored in bf16 or f32.
    pub(crate) fn new(
        backend: &B,
        bf16: bool,
        len: usize,
        item: usize,
    ) -> Result<Self, ModelError> {
        Ok(match bf16 {
            false => Self::F32(Stack::new(backend.alloc(len)?, item)),
            true => Self::Bf16(HalfStack::zeros(backend, len, item)?),
        })
    }

    /// Elements over every layer.
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::F32(s) => s.len(),
            Self::Bf16(s) => s.len(),
        }
    }

    /// Whether the stack holds bf16.
    pub(crate) fn is_bf16(&self) -> bool {
        matches!(self, Self::Bf16(_))
    }

    /// Layer `layer`, read.
    pub(crate) fn layer(&self, layer: usize) -> Result<Act<'_, B>, ModelError> {
        Ok(match self {
            Self::F32(s) => Act::F32(s.layer(layer)?),
            Self::Bf16(s) => Act::Bf16(s.layer(layer)?),
        })
    }

    /// Layer `layer`, written.
    pub(crate) fn layer_mut(&mut self, layer: usize) -> Result<ActMut<'_, B>, ModelError> {
        Ok(match self {
            Self::F32(s) => ActMut::F32(s.layer_mut(layer)?),
            Self::Bf16(s) => ActMut::Bf16(s.layer_mut(layer)?),
        })
    }
}

impl<'a, B: Backend> Act<'a, B> {
    /// The f32 tensor; [`ModelError::Bf16Activations`] naming `what` for a bf16 one (an
    /// op without a bf16 form, as a LoRA pair's).
    pub(crate) fn f32(self, what: &'static str) -> Result<Tensor<'a, B>, ModelError> {
        match self {
            Self::F32(t) => Ok(t),
            Self::Bf16(_) => Err(ModelError::Bf16Activations { what }),
        }
    }
}

impl<'a, B: Backend> ActMut<'a, B> {
    /// The f32 tensor; [`ModelError::Bf16Activations`] naming `what` for a bf16 one.
    pub(crate) fn f32(self, what: &'static str) -> Result<TensorMut<'a, B>, ModelError> {
        match self {
            Self::F32(t) => Ok(t),
            Self::Bf16(_) => Err(ModelError::Bf16Activations { what }),
        }
    }

    /// Where to make this activation in f32: its own layer of an f32 stack, or for a bf16
    /// one the first elements of `stage` ([`ActMut::round_staged`] rounds them in).
    pub(crate) fn f32_or<'s>(
        &'s mut self,
        stage: &'s mut B::Buffer,
    ) -> Result<TensorMut<'s, B>, ModelError> {
        Ok(match self {
            Self::F32(t) => t.slice_mut(0, t.len())?,
            Self::Bf16(h) => ViewMut::new(stage, 0, h.len())?,
        })
    }

    /// RoPE of q or k made in `stage` or its own f32 layer ([`ActMut::f32_or`]): in place
    /// for an f32 one, into a bf16 one's stack rounded (one pass, `Backend::rope_bf16`).
    pub(crate) fn rope_staged(
        self,
        backend: &B,
        stage: &mut B::Buffer,
        (cos, sin): (Tensor<'_, B>, Tensor<'_, B>),
        (heads, head_dim): (usize, usize),
    ) -> Result<(), ModelError> {
        match self {
            Self::F32(t) => backend.rope(t, cos, sin, heads, head_dim)?,
            Self::Bf16(h) => {
                let x = View::new(stage, 0, h.len())?;
                backend.rope_bf16(x, cos, sin, heads, head_dim, h)?
            }
        }
        Ok(())
    }

    /// Rounds a bf16 activation made in `stage` ([`ActMut::f32_or`]) into its stack, to
    /// nearest even; nothing for an f32 one.
    pub(crate) fn round_staged(self, backend: &B, stage: &B::Buffer) -> Result<(), ModelError> {
        if let Self::Bf16(h) = self {
            let len = h.len();
            backend.round_bf16(View::new(stage, 0, len)?, h)?;
        }
        Ok(())
    }
}

impl<B: Backend> super::Model<B> {
    /// The layout of `dtype` for a pass over `n` tokens of this model ([`ActLayout::of`]):
    /// q, k, v in bf16 where its attention runs on the tensor cores over the backend's
    /// packed sequences, `ln1` unless a LoRA pair on q, k or v reads it.
    pub fn act_layout(&self, n: usize, dtype: ActivationDtype) -> ActLayout {
        let tensor_cores = self.attention_in_bf16(n) && self.native_packing;
        let lora = (self.lora_adapts_qkv(), self.lora_adapts_o());
        ActLayout::of(dtype, tensor_cores, lora)
    }

    /// Whether the model can run a pass with the MLP block's activations in bf16: its
    /// products need the weights in bf16, and a LoRA pair of the MLP reads f32.
    pub(crate) fn check_bf16_activations(&self) -> Result<(), ModelError> {
        if self.bf16_weights.is_none() {
            return Err(ModelError::Bf16Activations {
                what: "the MLP's products in bf16 read the weights in bf16: keep bf16 \
                       copies (Model::set_bf16_weights) or store the weights in bf16",
            });
        }
        if self.lora_adapts_mlp() {
            return Err(ModelError::Bf16Activations { what: MLP_PAIR });
        }
        Ok(())
    }
}
