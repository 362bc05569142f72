//! Per-layer views of the stacked buffers (`[layers, ...]`), made once per decoder layer so
//! that every op of the forward and backward passes is one line, as llm.c's
//! `matmul_forward(l_qkv, l_ln1, l_qkvw, l_qkvb, ...)` after its `l_* = base + l * size`
//! pointers:
//!
//! - [`LayerParams`] `p`: layer `l`'s weights, each projection a [`Linear`] (weight, its
//!   transposed copy when generating, bias, dims) and each norm a [`Norm`] (weight, dim);
//! - [`LayerGrads`] `g`: their gradients, each paired with the parameter view its backward
//!   op reads, so a backward call names the parameter once;
//! - [`LayerActsMut`] `a` (forward: every activation a [`Slot`], written, then read) and
//!   [`LayerActs`] `a` (backward: what the forward saved, read-only), with the names of
//!   the arena's fields ([`LayerBuffers`]);
//! - the ops on them: [`Model::matmul`], [`Model::matmul_backward`], [`Model::rmsnorm`] and
//!   [`Model::rmsnorm_backward`], thin wrappers that only unpack the views.

use super::act_dtype::{Act, ActMut, ActStack};
use super::activations::{LayerBuffers, Scratch};
use super::decode_weights::{DecodeStack, DecodeView, DecodeWeights};
use super::weights::{DeviceWeights, HalfStack, Stack, layer_of, layer_of_mut};
use super::{Model, ModelError};
use crate::backend::{
    AttentionGrads, AttentionInputs, Backend, DeviceBuffer, GradWrite, GradWrites, LinearDims,
    MatmulPrecision, Tensor, TensorMut, View, ViewMut,
};

/// One projection of a layer, `out = x · wᵀ (+ bias)`, for a fixed number of token rows.
pub(crate) struct Linear<'a, B: Backend> {
    /// `[out, in]` (Hugging Face layout).
    pub(crate) w: Tensor<'a, B>,
    /// `[in, out]`: the transposed copy generation multiplies by ([`DecodeWeights`]).
    pub(crate) wt: Option<DecodeView<'a, B>>,
    /// `[out, in]` in bf16: the copy the bf16 products read ([`Model::set_bf16_weights`]),
    /// or the weight itself when the model stores it in bf16 (`w` then empty).
    pub(crate) w16: Option<View<'a, B::Half>>,
    /// The weight is stored in bf16 only ([`Model::set_weight_storage`]): every product
    /// reads `w16`.
    pub(crate) stored_bf16: bool,
    /// `[out]`, where the architecture has one.
    pub(crate) bias: Option<Tensor<'a, B>>,
    /// Rows, in and out features, precision.
    pub(crate) dims: LinearDims,
}

impl<'a, B: Backend> Linear<'a, B> {
    /// The bf16 copy of the weight when this product runs in bf16 (its precision at its
    /// rows) and the model keeps one: the op that reads it gives the numbers of rounding `w`.
    fn bf16_weight(&self) -> Option<View<'a, B::Half>> {
        let bf16 = self.dims.precision.for_rows(self.dims.rows) == MatmulPrecision::Bf16;
        self.w16.filter(|_| bf16 || self.stored_bf16)
    }
}

/// One RMSNorm weight of a layer, over rows of `dim` (hidden, or head_dim for q/k norms).
pub(crate) struct Norm<'a, B: Backend> {
    /// `[dim]`.
    pub(crate) w: Tensor<'a, B>,
    /// Features normalised together.
    pub(crate) dim: usize,
}

/// Qwen3's q/k RMSNorm weights of one layer (`None` in models without them).
pub(crate) struct QkNorm<'a, B: Backend> {
    layer: usize,
    q: Option<Norm<'a, B>>,
    k: Option<Norm<'a, B>>,
}

impl<'a, B: Backend> QkNorm<'a, B> {
    /// The q and k norms, or [`ModelError::MissingWeight`] naming them.
    pub(crate) fn get(self) -> Result<(Norm<'a, B>, Norm<'a, B>), ModelError> {
        match (self.q, self.k) {
            (Some(q), Some(k)) => Ok((q, k)),
            _ => Err(ModelError::MissingWeight {
                name: qk_norm_name(self.layer),
            }),
        }
    }
}

/// `model.layers.{layer}.self_attn.q_norm/k_norm.weight`, for messages.
fn qk_norm_name(layer: usize) -> String {
    format!("model.layers.{layer}.self_attn.q_norm/k_norm.weight")
}

/// The weights of one decoder layer, in the order the forward pass uses them.
pub(crate) struct LayerParams<'a, B: Backend> {
    pub(crate) ln1: Norm<'a, B>,
    pub(crate) q: Linear<'a, B>,
    pub(crate) k: Linear<'a, B>,
    pub(crate) v: Linear<'a, B>,
    pub(crate) qk_norm: QkNorm<'a, B>,
    pub(crate) o: Linear<'a, B>,
    pub(crate) ln2: Norm<'a, B>,
    pub(crate) gate: Linear<'a, B>,
    pub(crate) up: Linear<'a, B>,
    pub(crate) down: Linear<'a, B>,
}

/// The gradient of a [`Linear`]'s weight and bias, with the [`Linear`] itself (`None`:
/// frozen, as the base weights under LoRA), and how the weight's is written: added into,
/// or written over where it is a layer's scratch that the one product fills (gradients
/// stored in bf16).
pub(crate) struct LinearGrad<'a, B: Backend> {
    pub(crate) param: Linear<'a, B>,
    pub(crate) dw: Option<TensorMut<'a, B>>,
    pub(crate) dw_write: GradWrite,
    pub(crate) dbias: Option<TensorMut<'a, B>>,
}

/// The gradient of a [`Norm`]'s weight, with the [`Norm`] itself (`None`: frozen).
pub(crate) struct NormGrad<'a, B: Backend> {
    pub(crate) param: Norm<'a, B>,
    pub(crate) dw: Option<TensorMut<'a, B>>,
}

/// The gradients of Qwen3's q/k norms of one layer, with the norms.
pub(crate) struct QkNormGrad<'a, B: Backend> {
    param: QkNorm<'a, B>,
    dq: Option<TensorMut<'a, B>>,
    dk: Option<TensorMut<'a, B>>,
    /// The base weights are frozen: no gradients wanted.
    frozen: bool,
}

impl<'a, B: Backend> QkNormGrad<'a, B> {
    /// The q and k norms with their gradients; [`ModelError::MissingWeight`] without the
    /// norms, [`ModelError::UnknownParameter`] with gradients made for a model without.
    pub(crate) fn get(self) -> Result<(NormGrad<'a, B>, NormGrad<'a, B>), ModelError> {
        let layer = self.param.layer;
        let (q, k) = self.param.get()?;
        if self.frozen {
            return Ok((
                NormGrad { param: q, dw: None },
                NormGrad { param: k, dw: None },
            ));
        }
        match (self.dq, self.dk) {
            (Some(dq), Some(dk)) => Ok((
                NormGrad {
                    param: q,
                    dw: Some(dq),
                },
                NormGrad {
                    param: k,
                    dw: Some(dk),
                },
            )),
            _ => Err(ModelError::UnknownParameter {
                name: qk_norm_name(layer),
                why: "the gradients were made for a model without q/k norm".into(),
            }),
        }
    }
}

/// The gradients of one decoder layer's weights (added into by the backward ops), each with
/// its parameter; the names of [`LayerParams`].
pub(crate) struct LayerGrads<'a, B: Backend> {
    pub(crate) ln1: NormGrad<'a, B>,
    pub(crate) q: LinearGrad<'a, B>,
    pub(crate) k: LinearGrad<'a, B>,
    pub(crate) v: LinearGrad<'a, B>,
    pub(crate) qk_norm: QkNormGrad<'a, B>,
    pub(crate) o: LinearGrad<'a, B>,
    pub(crate) ln2: NormGrad<'a, B>,
    pub(crate) gate: LinearGrad<'a, B>,
    pub(crate) up: LinearGrad<'a, B>,
    pub(crate) down: LinearGrad<'a, B>,
}

/// Layer `layer` of a projection's weight stack, its transposed copy and its bias.
fn linear<'a, B: Backend>(
    layer: usize,
    (w, w16): (&'a Stack<B>, Option<&'a HalfStack<B>>),
    wt: Option<&'a DecodeStack<B>>,
    bias: &'a Option<Stack<B>>,
    dims: LinearDims,
) -> Result<Linear<'a, B>, ModelError> {
    let stored_bf16 = w.is_released();
    Ok(Linear {
        // stored in bf16: no f32 values, and an empty view that no op accepts as a weight
        w: match stored_bf16 {
            true => View::new(w.buffer(), 0, 0)?,
            false => w.layer(layer)?,
        },
        w16: w16.map(|s| s.layer(layer)).transpose()?,
        stored_bf16,
        wt: match wt {
            Some(t) => t.layer(layer)?,
            None => None,
        },
        bias: layer_of(bias, layer)?,
        dims,
    })
}

/// A [`Linear`] with layer `layer` of its gradient stacks, the weight's written to
/// `scratch` instead when given (a gradient stored in bf16).
fn linear_grad<'a, B: Backend>(
    layer: usize,
    param: Linear<'a, B>,
    (dw, scratch): (&'a mut Stack<B>, Option<&'a mut B::Buffer>),
    dbias: &'a mut Option<Stack<B>>,
) -> Result<LinearGrad<'a, B>, ModelError> {
    Ok(LinearGrad {
        param,
        dw_write: match scratch {
            Some(_) => GradWrite::Overwrite,
            None => GradWrite::Accumulate,
        },
        dw: Some(match scratch {
            Some(s) => ViewMut::whole(s),
            None => dw.layer_mut(layer)?,
        }),
        dbias: layer_of_mut(dbias, layer)?,
    })
}

/// A frozen [`Linear`]: no gradients.
fn frozen<B: Backend>(param: Linear<'_, B>) -> LinearGrad<'_, B> {
    LinearGrad {
        param,
        dw: None,
        dw_write: GradWrite::Accumulate,
        dbias: None,
    }
}

impl<B: Backend> Model<B> {
    /// The weights of layer `layer` applied to `rows` tokens; with `tw` the projections
    /// multiply by its transposed copies (generation).
    pub(crate) fn layer_params<'a>(
        &'a self,
        layer: usize,
        rows: usize,
        tw: Option<&'a DecodeWeights<B>>,
    ) -> Result<LayerParams<'a, B>, ModelError> {
        let (w, s) = (&self.weights, &self.spec);
        let c16 = self.bf16_weights.as_ref();
        let (c, i, qd, kvd) = (s.hidden, s.intermediate, s.q_dim(), s.kv_dim());
        let dims = |in_features, out_features| self.linear_dims(rows, in_features, out_features);
        let norm = |stack: &'a Stack<B>, dim| -> Result<Norm<'a, B>, ModelError> {
            Ok(Norm {
                w: stack.layer(layer)?,
                dim,
            })
        };
        let qk = |stack: &'a Option<Stack<B>>| -> Result<Option<Norm<'a, B>>, ModelError> {
            Ok(layer_of(stack, layer)?.map(|w| Norm { w, dim: s.head_dim }))
        };
        Ok(LayerParams {
            ln1: norm(&w.ln1, c)?,
            q: linear(
                layer,
                (&w.q, c16.map(|c| &c.q)),
                tw.map(|t| &t.q),
                &w.q_bias,
                dims(c, qd),
            )?,
            k: linear(
                layer,
                (&w.k, c16.map(|c| &c.k)),
                tw.map(|t| &t.k),
                &w.k_bias,
                dims(c, kvd),
            )?,
            v: linear(
                layer,
                (&w.v, c16.map(|c| &c.v)),
                tw.map(|t| &t.v),
                &w.v_bias,
                dims(c, kvd),
            )?,
            qk_norm: QkNorm {
                layer,
                q: qk(&w.q_norm)?,
                k: qk(&w.k_norm)?,
            },
            o: linear(
                layer,
                (&w.o, c16.map(|c| &c.o)),
                tw.map(|t| &t.o),
                &w.o_bias,
                dims(qd, c),
            )?,
            ln2: norm(&w.ln2, c)?,
            gate: linear(
                layer,
                (&w.gate, c16.map(|c| &c.gate)),
                tw.map(|t| &t.gate),
                &w.gate_bias,
                dims(c, i),
            )?,
            up: linear(
                layer,
                (&w.up, c16.map(|c| &c.up)),
                tw.map(|t| &t.up),
                &w.up_bias,
                dims(c, i),
            )?,
            down: linear(
                layer,
                (&w.down, c16.map(|c| &c.down)),
                tw.map(|t| &t.down),
                &w.down_bias,
                dims(i, c),
            )?,
        })
    }

    /// The gradients `grads` (laid out as the weights) of layer `layer` applied to `rows`
    /// tokens, each with its parameter; with no `grads` (the base frozen under LoRA) the
    /// parameters alone. With `scratch` (gradients stored in bf16: one layer of q, k, v,
    /// o, gate, up, down in f32) the linear weights' gradients are written there.
    pub(crate) fn layer_grads<'a>(
        &'a self,
        layer: usize,
        rows: usize,
        grads: Option<&'a mut DeviceWeights<B>>,
        scratch: Option<&'a mut [B::Buffer]>,
    ) -> Result<LayerGrads<'a, B>, ModelError> {
        let p = self.layer_params(layer, rows, None)?;
        let Some(grads) = grads else {
            let norm = |param| NormGrad { param, dw: None };
            return Ok(LayerGrads {
                ln1: norm(p.ln1),
                q: frozen(p.q),
                k: frozen(p.k),
                v: frozen(p.v),
                qk_norm: QkNormGrad {
                    param: p.qk_norm,
                    dq: None,
                    dk: None,
                    frozen: true,
                },
                o: frozen(p.o),
                ln2: norm(p.ln2),
                gate: frozen(p.gate),
                up: frozen(p.up),
                down: frozen(p.down),
            });
        };
        let DeviceWeights {
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
            ..
        } = grads;
        let [sq, sk, sv, so, sg, su, sd] = match scratch {
            Some([q, k, v, o, g, u, d]) => [q, k, v, o, g, u, d].map(Some),
            Some(_) => {
                return Err(ModelError::LayoutMismatch {
                    what: "bf16 gradients' scratch (one buffer per linear stack)",
                });
            }
            None => [None, None, None, None, None, None, None],
        };
        Ok(LayerGrads {
            ln1: NormGrad {
                param: p.ln1,
                dw: Some(ln1.layer_mut(layer)?),
            },
            q: linear_grad(layer, p.q, (q, sq), q_bias)?,
            k: linear_grad(layer, p.k, (k, sk), k_bias)?,
            v: linear_grad(layer, p.v, (v, sv), v_bias)?,
            qk_norm: QkNormGrad {
                param: p.qk_norm,
                dq: layer_of_mut(q_norm, layer)?,
                dk: layer_of_mut(k_norm, layer)?,
                frozen: false,
            },
            o: linear_grad(layer, p.o, (o, so), o_bias)?,
            ln2: NormGrad {
                param: p.ln2,
                dw: Some(ln2.layer_mut(layer)?),
            },
            gate: linear_grad(layer, p.gate, (gate, sg), gate_bias)?,
            up: linear_grad(layer, p.up, (up, su), up_bias)?,
            down: linear_grad(layer, p.down, (down, sd), down_bias)?,
        })
    }

    /// The LM head applied to `rows` tokens (its transposed copy from `tw` when given).
    pub(crate) fn lm_head<'a>(
        &'a self,
        rows: usize,
        tw: Option<&'a DecodeWeights<B>>,
    ) -> Linear<'a, B> {
        let (c, v) = (self.spec.hidden, self.spec.vocab);
        Linear {
            w: self.weights.lm_head(),
            wt: tw.and_then(|t| t.lm_head.whole()),
            w16: self.bf16_weights.as_ref().map(|c| c.lm_head.whole()),
            stored_bf16: self.weights.head_stack().is_released(),
            bias: None,
            dims: self.linear_dims(rows, c, v),
        }
    }

    /// `out = x · wᵀ (+ bias)` (llm.c's `matmul_forward`), by the transposed copy when `p`
    /// has one.
    pub(crate) fn matmul(
        &self,
        x: Tensor<'_, B>,
        p: Linear<'_, B>,
        out: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        match p.wt {
            Some(DecodeView::Bf16(wt)) => self
                .backend
                .linear_transposed_bf16(x, wt, p.bias, p.dims, out)?,
            Some(DecodeView::F32(wt)) => {
                self.backend.linear_decode_f32(x, wt, p.bias, p.dims, out)?
            }
            Some(DecodeView::TrainingBf16) => {
                let w16 = p.w16.ok_or(ModelError::LayoutMismatch {
                    what: "bf16 decode weights: the model keeps no bf16 copies",
                })?;
                self.backend.linear_bf16(x, w16, p.bias, p.dims, out)?
            }
            None => match p.bf16_weight() {
                Some(w16) => self.backend.linear_bf16(x, w16, p.bias, p.dims, out)?,
                None => self.backend.linear(x, p.w, p.bias, p.dims, out)?,
            },
        }
        Ok(())
    }

    /// Backward of [`Model::matmul`] from `dout`: writes (`dx_write`) `dout · w` into `dx`
    /// and **adds** the weight and bias gradients into `g`.
    pub(crate) fn matmul_backward(
        &self,
        dout: Tensor<'_, B>,
        x: Tensor<'_, B>,
        g: LinearGrad<'_, B>,
        dx_write: GradWrite,
        dx: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let (p, be) = (g.param, &self.backend);
        let (dims, dx) = (p.dims, Some(dx));
        let w = GradWrites {
            dx: dx_write,
            dw: g.dw_write,
        };
        match p.bf16_weight() {
            Some(w16) => be.linear_backward_bf16(dout, x, w16, dims, w, dx, g.dw, g.dbias)?,
            None => be.linear_backward(dout, x, p.w, dims, w, dx, g.dw, g.dbias)?,
        }
        Ok(())
    }

    /// [`Model::matmul`] over activations stored as their arena says: f32 both, or a bf16
    /// `x` into an f32 or bf16 `out` (`act_dtype.rs`) — always in bf16, by the weight's
    /// bf16 copy (or the weight itself stored in bf16).
    pub(crate) fn matmul_stored(
        &self,
        x: Act<'_, B>,
        p: Linear<'_, B>,
        out: ActMut<'_, B>,
    ) -> Result<(), ModelError> {
        let w16 = p.w16.filter(|_| p.wt.is_none());
        let w16 = || {
            w16.ok_or(ModelError::Bf16Activations {
                what: "a product without bf16 weights (bf16 copies or bf16 storage)",
            })
        };
        let be = &self.backend;
        match (x, out) {
            (Act::F32(x), ActMut::F32(out)) => self.matmul(x, p, out)?,
            (Act::Bf16(x), ActMut::Bf16(out)) => {
                be.linear_bf16_io(x, w16()?, p.bias, p.dims, out)?
            }
            (Act::Bf16(x), ActMut::F32(out)) => be.linear_bf16_x(x, w16()?, p.bias, p.dims, out)?,
            (Act::F32(_), ActMut::Bf16(_)) => {
                return Err(ModelError::Bf16Activations {
                    what: "a product of an f32 input into a bf16 output",
                });
            }
        }
        Ok(())
    }

    /// Backward of [`Model::matmul_stored`] from `dout` (f32, as every gradient): as
    /// [`Model::matmul_backward`], reading a bf16 `x` as it is stored.
    pub(crate) fn matmul_backward_stored(
        &self,
        dout: Tensor<'_, B>,
        x: Act<'_, B>,
        g: LinearGrad<'_, B>,
        dx_write: GradWrite,
        dx: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let x = match x {
            Act::F32(x) => return self.matmul_backward(dout, x, g, dx_write, dx),
            Act::Bf16(x) => x,
        };
        let p = g.param;
        let w16 = p.w16.ok_or(ModelError::Bf16Activations {
            what: "a backward product without bf16 weights (bf16 copies or bf16 storage)",
        })?;
        let (dims, dx) = (p.dims, Some(dx));
        let w = GradWrites {
            dx: dx_write,
            dw: g.dw_write,
        };
        self.backend
            .linear_backward_bf16_x(dout, x, w16, dims, w, dx, g.dw, g.dbias)?;
        Ok(())
    }

    /// SwiGLU `out = silu(gate)·up` over activations stored alike (f32 or bf16).
    pub(crate) fn swiglu(
        &self,
        gate: Act<'_, B>,
        up: Act<'_, B>,
        out: ActMut<'_, B>,
    ) -> Result<(), ModelError> {
        let be = &self.backend;
        match (gate, up, out) {
            (Act::F32(g), Act::F32(u), ActMut::F32(o)) => be.swiglu(g, u, o)?,
            (Act::Bf16(g), Act::Bf16(u), ActMut::Bf16(o)) => be.swiglu_bf16(g, u, o)?,
            _ => return Err(mixed_mlp()),
        }
        Ok(())
    }

    /// Layer `layer`'s `silu(gate) · up` again, from its saved gate and up, into the
    /// arena's one-layer `act` (which keeps the layer last run): what the backward reads
    /// there, the forward's bits.
    pub(crate) fn recompute_act(
        &self,
        layers: &mut LayerBuffers<B>,
        layer: usize,
    ) -> Result<(), ModelError> {
        let at = layers.slot_of(layer);
        let (gate, up) = (layers.gate.layer(at)?, layers.up.layer(at)?);
        self.swiglu(gate, up, layers.act.layer_mut(0)?)
    }

    /// Layer `layer`'s input norm again, from the residual stream entering it, into the
    /// arena's one-layer `ln1` (and its rstd, the same bits again) — made in the staging
    /// buffer and rounded where stored in bf16, as the forward makes it: the forward's
    /// bits.
    pub(crate) fn recompute_ln1(
        &self,
        layers: &mut LayerBuffers<B>,
        layer: usize,
    ) -> Result<(), ModelError> {
        let at = layers.slot_of(layer);
        let input = match layer.checked_sub(1) {
            None => View::whole(&layers.encoded),
            Some(prev) => layers.resid_out.layer(prev)?,
        };
        let norm = Norm {
            w: self.weights.ln1.layer(layer)?,
            dim: self.spec.hidden,
        };
        let mut ln1 = layers.ln1.layer_mut(0)?;
        let out = ln1.f32_or(&mut layers.stage)?;
        self.rmsnorm(input, norm, out, layers.ln1_rstd.layer_mut(at)?)?;
        ln1.round_staged(&self.backend, &layers.stage)
    }

    /// Layer `layer`'s MLP norm again, from its saved residual stream after attention, into
    /// the arena's one-layer `ln2`, as [`Model::recompute_ln1`] — the bits of the forward's
    /// fused add and norm, which are those of the add then the norm.
    pub(crate) fn recompute_ln2(
        &self,
        layers: &mut LayerBuffers<B>,
        layer: usize,
    ) -> Result<(), ModelError> {
        let at = layers.slot_of(layer);
        let norm = Norm {
            w: self.weights.ln2.layer(layer)?,
            dim: self.spec.hidden,
        };
        let mid = layers.resid_mid.layer(at)?;
        let mut ln2 = layers.ln2.layer_mut(0)?;
        let out = ln2.f32_or(&mut layers.stage)?;
        self.rmsnorm(mid, norm, out, layers.ln2_rstd.layer_mut(at)?)?;
        ln2.round_staged(&self.backend, &layers.stage)
    }

    /// Backward of [`Model::swiglu`]: overwrites the f32 `dgate`, `dup`.
    pub(crate) fn swiglu_backward(
        &self,
        dout: Tensor<'_, B>,
        (gate, up): (Act<'_, B>, Act<'_, B>),
        dgate: TensorMut<'_, B>,
        dup: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let be = &self.backend;
        match (gate, up) {
            (Act::F32(g), Act::F32(u)) => be.swiglu_backward(dout, g, u, dgate, dup)?,
            (Act::Bf16(g), Act::Bf16(u)) => be.swiglu_backward_bf16(dout, g, u, dgate, dup)?,
            _ => return Err(mixed_mlp()),
        }
        Ok(())
    }

    /// The residual add `sum = a + b` and the MLP block's norm of it by `p` into `out`
    /// (stored f32 or bf16), saving each row's `rstd`: one op.
    pub(crate) fn add_rmsnorm(
        &self,
        (a, b): (Tensor<'_, B>, Tensor<'_, B>),
        p: Norm<'_, B>,
        sum: TensorMut<'_, B>,
        out: ActMut<'_, B>,
        rstd: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let (be, eps) = (&self.backend, self.spec.eps);
        match out {
            ActMut::F32(o) => be.add_rmsnorm(a, b, p.w, eps, p.dim, sum, o, rstd)?,
            ActMut::Bf16(o) => be.add_rmsnorm_bf16(a, b, p.w, eps, p.dim, sum, o, rstd)?,
        }
        Ok(())
    }

    /// RMSNorm of `x`'s rows by `p` into `out`, saving each row's `rstd`.
    pub(crate) fn rmsnorm(
        &self,
        x: Tensor<'_, B>,
        p: Norm<'_, B>,
        out: TensorMut<'_, B>,
        rstd: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let eps = self.spec.eps;
        Ok(self.backend.rmsnorm(x, p.w, eps, p.dim, out, rstd)?)
    }

    /// Backward of [`Model::rmsnorm`] from `dout`, the forward's input `x` and saved `rstd`:
    /// **adds** into `dx` and into the weight's gradient in `g`.
    pub(crate) fn rmsnorm_backward(
        &self,
        dout: Tensor<'_, B>,
        x: Tensor<'_, B>,
        rstd: Tensor<'_, B>,
        g: NormGrad<'_, B>,
        dx: TensorMut<'_, B>,
    ) -> Result<(), ModelError> {
        let p = g.param;
        Ok(self
            .backend
            .rmsnorm_backward(dout, x, p.w, rstd, p.dim, dx, g.dw)?)
    }
}

/// The MLP block's activations stored in two dtypes: an arena never plans them so.
fn mixed_mlp() -> ModelError {
    ModelError::Bf16Activations {
        what: "internal: the MLP block's activations in two dtypes",
    }
}

/// Layer `layer`'s window of an activation stack, written then read by the forward pass.
pub(crate) struct Slot<'a, B: Backend> {
    stack: &'a mut Stack<B>,
    layer: usize,
}

impl<B: Backend> Slot<'_, B> {
    /// The window, read-only.
    pub(crate) fn r(&self) -> Result<Tensor<'_, B>, ModelError> {
        self.stack.layer(self.layer)
    }

    /// The window, writable.
    pub(crate) fn w(&mut self) -> Result<TensorMut<'_, B>, ModelError> {
        self.stack.layer_mut(self.layer)
    }
}

/// Layer `layer`'s window of an activation stack stored as its arena says (f32 or bf16).
pub(crate) struct ActSlot<'a, B: Backend> {
    stack: &'a mut ActStack<B>,
    layer: usize,
}

impl<B: Backend> ActSlot<'_, B> {
    /// The window, read-only.
    pub(crate) fn r(&self) -> Result<Act<'_, B>, ModelError> {
        self.stack.layer(self.layer)
    }

    /// The window, writable.
    pub(crate) fn w(&mut self) -> Result<ActMut<'_, B>, ModelError> {
        self.stack.layer_mut(self.layer)
    }
}

/// The residual stream around layer `layer`: its input (the embeddings for layer 0, else
/// the previous layer's output) and its output, the same stack.
pub(crate) struct Residual<'a, B: Backend> {
    encoded: &'a B::Buffer,
    out: &'a mut Stack<B>,
    layer: usize,
}

impl<B: Backend> Residual<'_, B> {
    /// The stream entering the layer.
    pub(crate) fn input(&self) -> Result<Tensor<'_, B>, ModelError> {
        match self.layer.checked_sub(1) {
            None => Ok(View::whole(self.encoded)),
            Some(prev) => self.out.layer(prev),
        }
    }

    /// The stream leaving the layer (`resid_out`).
    pub(crate) fn output(&mut self) -> Result<TensorMut<'_, B>, ModelError> {
        self.out.layer_mut(self.layer)
    }
}

/// One layer's activations for the forward pass, in the order it writes them.
pub(crate) struct LayerActsMut<'a, B: Backend> {
    pub(crate) resid: Residual<'a, B>,
    pub(crate) ln1: ActSlot<'a, B>,
    pub(crate) ln1_rstd: Slot<'a, B>,
    pub(crate) q_raw: Slot<'a, B>,
    pub(crate) k_raw: Slot<'a, B>,
    pub(crate) q_rstd: Slot<'a, B>,
    pub(crate) k_rstd: Slot<'a, B>,
    pub(crate) q: ActSlot<'a, B>,
    pub(crate) k: ActSlot<'a, B>,
    pub(crate) v: ActSlot<'a, B>,
    /// Where the attention block's activations stored in bf16 are made in f32 first.
    pub(crate) stage: &'a mut B::Buffer,
    pub(crate) att: ActSlot<'a, B>,
    pub(crate) lse: Slot<'a, B>,
    pub(crate) att_proj: Slot<'a, B>,
    pub(crate) resid_mid: Slot<'a, B>,
    pub(crate) ln2: ActSlot<'a, B>,
    pub(crate) ln2_rstd: Slot<'a, B>,
    pub(crate) gate: ActSlot<'a, B>,
    pub(crate) up: ActSlot<'a, B>,
    pub(crate) act: ActSlot<'a, B>,
    pub(crate) mlp_out: Slot<'a, B>,
}

/// What the forward pass saved of one layer, read by the backward pass (the names of
/// [`LayerActsMut`]; `input` is the residual stream entering the layer).
pub(crate) struct LayerActs<'a, B: Backend> {
    pub(crate) input: Tensor<'a, B>,
    pub(crate) ln1: Act<'a, B>,
    pub(crate) ln1_rstd: Tensor<'a, B>,
    pub(crate) q_raw: Tensor<'a, B>,
    pub(crate) k_raw: Tensor<'a, B>,
    pub(crate) q_rstd: Tensor<'a, B>,
    pub(crate) k_rstd: Tensor<'a, B>,
    pub(crate) q: Act<'a, B>,
    pub(crate) k: Act<'a, B>,
    pub(crate) v: Act<'a, B>,
    pub(crate) att: Act<'a, B>,
    pub(crate) lse: Tensor<'a, B>,
    pub(crate) resid_mid: Tensor<'a, B>,
    pub(crate) ln2: Act<'a, B>,
    pub(crate) ln2_rstd: Tensor<'a, B>,
    pub(crate) gate: Act<'a, B>,
    pub(crate) up: Act<'a, B>,
    pub(crate) act: Act<'a, B>,
}

/// f32 q, k, v.
pub(crate) type F32Qkv<'a, B> = (Tensor<'a, B>, Tensor<'a, B>, Tensor<'a, B>);

/// q, k, v as the attention reads them: f32, or all three stored in bf16.
pub(crate) enum StoredQkv<'a, B: Backend> {
    F32(Tensor<'a, B>, Tensor<'a, B>, Tensor<'a, B>),
    Bf16(View<'a, B::Half>, View<'a, B::Half>, View<'a, B::Half>),
}

impl<'a, B: Backend> StoredQkv<'a, B> {
    /// `q`, `k`, `v` as stored (an arena stores the three alike).
    pub(crate) fn of(q: Act<'a, B>, k: Act<'a, B>, v: Act<'a, B>) -> Result<Self, ModelError> {
        match (q, k, v) {
            (Act::F32(q), Act::F32(k), Act::F32(v)) => Ok(Self::F32(q, k, v)),
            (Act::Bf16(q), Act::Bf16(k), Act::Bf16(v)) => Ok(Self::Bf16(q, k, v)),
            _ => Err(ModelError::Bf16Activations {
                what: "internal: q, k and v stored in two dtypes",
            }),
        }
    }

    /// The f32 q, k, v; [`ModelError::Bf16Activations`] naming `what` for bf16 ones (an
    /// attention without a bf16-stored form).
    pub(crate) fn f32(self, what: &'static str) -> Result<F32Qkv<'a, B>, ModelError> {
        match self {
            Self::F32(q, k, v) => Ok((q, k, v)),
            Self::Bf16(..) => Err(ModelError::Bf16Activations { what }),
        }
    }
}

/// The attention's inputs q, k, v under the key `mask`.
pub(crate) fn qkv<'a, T: ?Sized>(
    q: View<'a, T>,
    k: View<'a, T>,
    v: View<'a, T>,
    mask: View<'a, T>,
) -> AttentionInputs<'a, T> {
    AttentionInputs {
        q,
        k,
        v,
        key_mask: Some(mask),
    }
}

/// The attention's gradients dq, dk, dv (overwritten), whole scratch buffers.
pub(crate) fn dqkv<'a, T: DeviceBuffer>(
    dq: &'a mut Scratch<T>,
    dk: &'a mut Scratch<T>,
    dv: &'a mut Scratch<T>,
) -> AttentionGrads<'a, T> {
    AttentionGrads {
        dq: dq.w(),
        dk: dk.w(),
        dv: dv.w(),
    }
}

impl<B: Backend> LayerBuffers<B> {
    /// Layer `layer`'s activations, to be written by the forward pass.
    pub(crate) fn at_mut(&mut self, layer: usize) -> LayerActsMut<'_, B> {
        let inner = self.slot_of(layer);
        let Self {
            count: _,
            checkpointed: _,
            encoded,
            ln1,
            ln1_rstd,
            q_raw,
            k_raw,
            q_rstd,
            k_rstd,
            q,
            k,
            v,
            stage,
            att,
            lse,
            att_proj,
            resid_mid,
            ln2,
            ln2_rstd,
            gate,
            up,
            act,
            mlp_out,
            resid_out,
        } = self;
        let slot = |stack| Slot {
            stack,
            layer: inner,
        };
        let stored = |stack| ActSlot {
            stack,
            layer: inner,
        };
        LayerActsMut {
            resid: Residual {
                encoded,
                out: resid_out,
                layer,
            },
            // one layer's, whatever the checkpointing: the backward recomputes it
            ln1: ActSlot {
                stack: ln1,
                layer: 0,
            },
            ln1_rstd: slot(ln1_rstd),
            q_raw: slot(q_raw),
            k_raw: slot(k_raw),
            q_rstd: slot(q_rstd),
            k_rstd: slot(k_rstd),
            q: stored(q),
            k: stored(k),
            v: stored(v),
            stage,
            att: stored(att),
            lse: slot(lse),
            // one layer's, whatever the checkpointing
            att_proj: Slot {
                stack: att_proj,
                layer: 0,
            },
            resid_mid: slot(resid_mid),
            ln2: ActSlot {
                stack: ln2,
                layer: 0,
            },
            ln2_rstd: slot(ln2_rstd),
            gate: stored(gate),
            up: stored(up),
            // one layer's, whatever the checkpointing: the backward recomputes it
            act: ActSlot {
                stack: act,
                layer: 0,
            },
            mlp_out: Slot {
                stack: mlp_out,
                layer: 0,
            },
        }
    }

    /// Layer `layer`'s saved activations, for the backward pass.
    pub(crate) fn at(&self, layer: usize) -> Result<LayerActs<'_, B>, ModelError> {
        let input = match layer.checked_sub(1) {
            None => View::whole(&self.encoded),
            Some(prev) => self.resid_out.layer(prev)?,
        };
        let at = self.slot_of(layer);
        Ok(LayerActs {
            input,
            ln1: self.ln1.layer(0)?,
            ln1_rstd: self.ln1_rstd.layer(at)?,
            q_raw: self.q_raw.layer(at)?,
            k_raw: self.k_raw.layer(at)?,
            q_rstd: self.q_rstd.layer(at)?,
            k_rstd: self.k_rstd.layer(at)?,
            q: self.q.layer(at)?,
            k: self.k.layer(at)?,
            v: self.v.layer(at)?,
            att: self.att.layer(at)?,
            lse: self.lse.layer(at)?,
            resid_mid: self.resid_mid.layer(at)?,
            ln2: self.ln2.layer(0)?,
            ln2_rstd: self.ln2_rstd.layer(at)?,
            gate: self.gate.layer(at)?,
            up: self.up.layer(at)?,
            act: self.act.layer(0)?,
        })
    }

    /// Where layer `layer`'s activations live in the stacks other than the residual
    /// stream: its own slot, or the one slot of a checkpointed arena.
    pub(crate) fn slot_of(&self, layer: usize) -> usize {
        if self.checkpointed { 0 } else { layer }
    }

    /// The residual stream leaving the last layer (the embeddings with no layers): the
    /// final norm's input.
    pub(crate) fn output(&self) -> Result<Tensor<'_, B>, ModelError> {
        match self.count.checked_sub(1) {
            None => Ok(View::whole(&self.encoded)),
            Some(last) => self.resid_out.layer(last),
        }
    }
}
