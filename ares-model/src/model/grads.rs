//! [`Grads`]: the gradient of every trained parameter, laid out exactly like the model's
//! weights (one buffer per kind of tensor, stacked over layers), so an optimizer can walk
//! weights and gradients side by side. Tied embeddings have one gradient, `embed_tokens`,
//! into which the LM head's gradient is added. A model with LoRA adapters trains the
//! pairs only: its gradients are the pairs' (`…q_proj.lora_A.weight`), none of the base.

use super::half_grads::{GradDtype, HalfGrads};
use super::lora::{LoraParams, lora_tensor_name};
use super::weights::{DeviceWeights, HalfStack};
use super::{Model, ModelError};
use crate::backend::{Backend, DeviceBuffer, Stored, Tensor, View, ViewMut};

/// A trainable buffer as [`Model::write_trainable_on_device`] hands it over: f32 values,
/// or the bf16 bits of a linear weight stored in bf16.
pub enum TrainableMut<'a, B: Backend> {
    /// f32 values.
    F32(&'a mut B::Buffer),
    /// bf16 bits (the weight itself: no f32 master).
    Bf16(&'a mut B::Half),
}

impl<'a, B: Backend> TrainableMut<'a, B> {
    /// `buffers`, each as f32 values (LoRA pairs, which are never stored in bf16).
    pub(crate) fn f32s(buffers: Vec<&'a mut B::Buffer>) -> Vec<Self> {
        buffers.into_iter().map(Self::F32).collect()
    }

    /// Elements of the buffer, whatever its dtype.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(b) => b.len(),
            Self::Bf16(h) => h.len(),
        }
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes `values` from element `offset`: f32 values as they are, or rounded to the
    /// nearest bf16 (ties to even) into bf16 bits — one rounding of a value made in f32 (a
    /// data-parallel run's sum over its ranks).
    ///
    /// # Errors
    /// A range past the buffer's end; a backend failure.
    pub fn write_values(
        self,
        backend: &B,
        offset: usize,
        values: &[f32],
    ) -> Result<(), ModelError> {
        let len = values.len();
        match self {
            Self::F32(b) => backend.upload(values, ViewMut::new(b, offset, len)?)?,
            Self::Bf16(h) => {
                let bits: Vec<u16> = values
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                backend.upload_half(&bits, ViewMut::new(h, offset, len)?)?;
            }
        }
        Ok(())
    }
}

/// No gradient buffer `buffer` among `count`.
fn no_buffer(buffer: usize, count: usize) -> ModelError {
    ModelError::InvalidValue {
        what: format!("gradient buffer (of {count})"),
        value: buffer as f64,
        expected: "an index below the gradients' buffer count",
    }
}

/// A trained tensor: name, shape, and (buffer, layer) among the trained buffers.
pub(crate) type TrainedTensor = (String, Vec<usize>, (usize, usize));

/// Gradient buffers of a [`Model`] on backend `B`, zeroed when made. [`Model::backward`]
/// accumulates into them; call [`Grads::zero`] between optimizer steps.
pub struct Grads<B: Backend> {
    /// The base weights' (none when they are frozen under LoRA).
    pub(crate) g: Option<DeviceWeights<B>>,
    /// The LoRA pairs' (a model with adapters).
    pub(crate) lora: Option<LoraParams<B>>,
    /// Told of each decoder layer whose gradients a backward pass has finished
    /// ([`Grads::watch_layers`]).
    pub(crate) watch: Option<LayerWatch<B>>,
    /// The linear weight gradients stored in bf16 ([`GradDtype::Bf16`]; their f32 stacks
    /// in `g` are released).
    pub(crate) half: Option<HalfGrads<B>>,
}

/// What [`Grads::watch_layers`] calls as a backward pass finishes each decoder layer, last
/// to first: `(backend, layer, views)`, the views being that layer's gradients as
/// [`Grads::layer_ranges`] names them, in its order, each as it is stored (f32, or bf16
/// bits). It cannot fail the backward: a watcher keeps its own errors.
pub type LayerWatch<B> = Box<dyn for<'a> FnMut(&'a B, usize, &'a [Stored<'a, B>]) + Send>;

/// `(buffer, offset, len)` of layer `layer` in each stacked buffer of `base` then `lora`
/// (indices into their buffers in [`Grads::buffers`]' order); whole buffers have none.
fn layer_ranges_of<B: Backend>(
    base: Option<&DeviceWeights<B>>,
    lora: Option<&LoraParams<B>>,
    layer: usize,
) -> Vec<(usize, usize, usize)> {
    let mut out = base.map(|g| g.layer_ranges(layer)).unwrap_or_default();
    let before = base.map_or(0, |g| g.buffers().len());
    if let Some(lora) = lora {
        for (i, (b, item)) in lora.buffers().iter().zip(lora.buffer_items()).enumerate() {
            let offset = layer * item;
            if offset + item <= b.len() {
                out.push((before + i, offset, item));
            }
        }
    }
    out
}

/// Views of `ranges` (of [`layer_ranges_of`]) in the buffers of `base` then `lora`, or in
/// the bf16 stacks of `half` for the gradients stored there.
pub(crate) fn layer_views<'a, B: Backend>(
    base: Option<&'a DeviceWeights<B>>,
    lora: Option<&'a LoraParams<B>>,
    half: Option<&'a HalfGrads<B>>,
    layer: usize,
) -> Result<Vec<Stored<'a, B>>, ModelError> {
    let mut buffers = base.map(|g| g.buffers()).unwrap_or_default();
    buffers.extend(lora.iter().flat_map(|l| l.buffers()));
    let mut out = Vec::new();
    for (b, offset, len) in layer_ranges_of(base, lora, layer) {
        out.push(match half.and_then(|h| h.stack_of(b)) {
            Some(h) => Stored::Bf16(View::new(h.whole().buffer(), offset, len)?),
            None => Stored::F32(View::new(buffers[b], offset, len)?),
        });
    }
    Ok(out)
}

impl<B: Backend> std::fmt::Debug for Grads<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grads")
            .field("base", &self.g.is_some())
            .field("lora", &self.lora.is_some())
            .field("watched", &self.watch.is_some())
            .field("dtype", &self.dtype())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Grads<B> {
    /// Every gradient buffer, in the order of the trained parameters' buffers. A gradient
    /// stored in bf16 ([`GradDtype::Bf16`]) has an empty f32 buffer here: [`Grads::stored`]
    /// lists each as it is stored.
    pub fn buffers(&self) -> Vec<&B::Buffer> {
        let mut out = self.g.as_ref().map(|g| g.buffers()).unwrap_or_default();
        out.extend(self.lora.iter().flat_map(LoraParams::buffers));
        out
    }

    /// [`Grads::buffers`], writable (a data-parallel run writes the ranks' sum back).
    pub fn buffers_mut(&mut self) -> Vec<&mut B::Buffer> {
        let mut all = self.g.as_mut().map(|g| g.buffers_mut()).unwrap_or_default();
        all.extend(self.lora.iter_mut().flat_map(LoraParams::buffers_mut));
        all
    }

    /// How the gradients are stored ([`Model::grads_in`]).
    pub fn dtype(&self) -> GradDtype {
        match self.half {
            Some(_) => GradDtype::Bf16,
            None => GradDtype::F32,
        }
    }

    /// Every gradient as stored, in [`Grads::buffers`]' order: f32 values, or the bits of
    /// a gradient stored in bf16.
    pub fn stored(&self) -> Vec<Stored<'_, B>> {
        self.buffers()
            .into_iter()
            .enumerate()
            .map(
                |(i, b)| match self.half.as_ref().and_then(|h| h.stack_of(i)) {
                    Some(h) => Stored::Bf16(h.whole()),
                    None => Stored::F32(View::whole(b)),
                },
            )
            .collect()
    }

    /// The length of each gradient, in [`Grads::buffers`]' order (a bf16 one's too).
    pub fn lens(&self) -> Vec<usize> {
        let mut out = self
            .g
            .as_ref()
            .map(DeviceWeights::buffer_lens)
            .unwrap_or_default();
        out.extend(
            self.lora
                .iter()
                .flat_map(LoraParams::buffers)
                .map(DeviceBuffer::len),
        );
        out
    }

    /// Bytes the gradients hold on the device (with bf16 ones, their one-layer f32 scratch).
    pub fn bytes(&self) -> u64 {
        let f32s: u64 = self.buffers().iter().map(|b| 4 * b.len() as u64).sum();
        f32s + self.half.as_ref().map_or(0, HalfGrads::bytes)
    }

    /// Sets the stochastic rounding of gradients stored in bf16: the optimizer's rounding
    /// seed and the step the coming backward passes accumulate for (their count restarts).
    /// A run that calls it before each accumulation draws the same bits when resumed.
    /// Nothing for f32 gradients.
    pub fn set_rounding(&mut self, seed: u64, step: u64) {
        if let Some(h) = &mut self.half {
            h.keys.set_rounding(seed, step);
        }
    }

    /// Keys the stochastic rounding of the coming backward pass by `pass` (gradients
    /// stored in bf16): a run that numbers its passes itself — a micro-batch's index in its
    /// mini-batch, whichever rank runs it — draws the same bits for a pass wherever it runs.
    /// Later passes count on from it. Nothing for f32 gradients.
    pub fn set_rounding_pass(&mut self, pass: u64) {
        if let Some(h) = &mut self.half {
            h.keys.set_pass(pass);
        }
    }

    /// Copies `out.len()` values of gradient buffer `buffer` ([`Grads::buffers`]' order)
    /// from `offset` to the host: f32 values, or a gradient stored in bf16 widened (exact).
    ///
    /// # Errors
    /// A buffer index or range past the gradients; a backend failure.
    pub fn read_values(
        &self,
        backend: &B,
        buffer: usize,
        offset: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let len = out.len();
        let range = match self.stored_buffer(buffer)? {
            Stored::F32(b) => Stored::F32(View::new(b.buffer(), offset, len)?),
            Stored::Bf16(h) => Stored::Bf16(View::new(h.buffer(), offset, len)?),
        };
        Ok(range.download(backend, out)?)
    }

    /// Writes `values` into gradient buffer `buffer` from `offset`: f32 values as they
    /// are, or rounded to the nearest bf16 (ties to even) into a gradient stored in bf16 —
    /// one rounding of a sum made in f32 (a data-parallel run's over its ranks).
    ///
    /// # Errors
    /// As [`Grads::read_values`].
    pub fn write_values(
        &mut self,
        backend: &B,
        buffer: usize,
        offset: usize,
        values: &[f32],
    ) -> Result<(), ModelError> {
        let mut all = self.stored_mut();
        if buffer >= all.len() {
            return Err(no_buffer(buffer, all.len()));
        }
        all.swap_remove(buffer)
            .write_values(backend, offset, values)
    }

    /// Gradient buffer `buffer` as it is stored (see [`Grads::stored`]).
    fn stored_buffer(&self, buffer: usize) -> Result<Stored<'_, B>, ModelError> {
        let mut all = self.stored();
        if buffer >= all.len() {
            return Err(no_buffer(buffer, all.len()));
        }
        Ok(all.swap_remove(buffer))
    }

    /// Every gradient buffer as stored, writable, in [`Grads::buffers`]' order (a
    /// data-parallel run sums them over its ranks in place on their device).
    pub fn stored_mut(&mut self) -> Vec<TrainableMut<'_, B>> {
        let mut f32s = self.g.as_mut().map(|g| g.buffers_mut()).unwrap_or_default();
        f32s.extend(self.lora.iter_mut().flat_map(LoraParams::buffers_mut));
        let mut out: Vec<_> = f32s.into_iter().map(TrainableMut::F32).collect();
        if let Some(h) = &mut self.half {
            let indices = h.buffer_indices();
            for (i, stack) in indices.into_iter().zip(h.stacks_mut()) {
                if let Some(slot) = out.get_mut(i) {
                    *slot = TrainableMut::Bf16(stack.buffer_mut());
                }
            }
        }
        out
    }

    /// Where decoder layer `layer`'s gradients lie: `(buffer, offset, len)` for each buffer
    /// of [`Grads::buffers`] stacked over layers, in that order (the embedding, final norm
    /// and LM head are whole buffers, in none). Empty past the last layer.
    pub fn layer_ranges(&self, layer: usize) -> Vec<(usize, usize, usize)> {
        layer_ranges_of(self.g.as_ref(), self.lora.as_ref(), layer)
    }

    /// Has every backward pass into these gradients call `watch` once a decoder layer's
    /// gradients are complete for that pass — last layer first — while the pass goes on
    /// below it (a data-parallel run starts the layer's sum over the ranks there); `None`
    /// stops it. What follows a layer in the pass never writes that layer's gradients.
    pub fn watch_layers(&mut self, watch: Option<LayerWatch<B>>) {
        self.watch = watch;
    }

    /// Sets every gradient to zero.
    ///
    /// # Errors
    /// A backend failure.
    pub fn zero(&mut self, backend: &B) -> Result<(), ModelError> {
        for buffer in self.buffers_mut() {
            backend.fill(ViewMut::whole(buffer), 0.0)?;
        }
        if let Some(h) = &mut self.half {
            h.zero(backend)?;
        }
        Ok(())
    }

    /// The bf16 gradient of parameter `name` and its layer, when it is stored in bf16.
    fn half_tensor(&self, name: &str) -> Option<View<'_, B::Half>> {
        let (h, g) = (self.half.as_ref()?, self.g.as_ref()?);
        let (buffer, layer) = g.buffer_item(name).ok()?;
        h.stack_of(buffer)?.layer(layer).ok()
    }

    /// The gradient of the parameter with Hugging Face name `name`
    /// (`model.embed_tokens.weight`, `model.layers.1.mlp.down_proj.weight`, ...), with the
    /// parameter's shape, row-major.
    ///
    /// # Errors
    /// [`ModelError::UnknownParameter`] for a name that is not a parameter of this model,
    /// including `lm_head.weight` of a model with tied embeddings (its gradient is part of
    /// `model.embed_tokens.weight`'s); [`ModelError::Bf16Grads`] for a gradient stored in
    /// bf16 ([`Grads::download`] reads it widened).
    pub fn tensor(&self, name: &str) -> Result<Tensor<'_, B>, ModelError> {
        if self.half_tensor(name).is_some() {
            return Err(ModelError::Bf16Grads {
                what: "an f32 view of a gradient",
            });
        }
        if let Some(lora) = &self.lora
            && let Some((buffer, layer)) = lora.locate(name)
        {
            let items = lora.buffer_items();
            return Ok(View::item(lora.buffers()[buffer], layer, items[buffer])?);
        }
        match &self.g {
            Some(g) => g.tensor(name),
            None => Err(ModelError::UnknownParameter {
                name: name.to_string(),
                why: "the base weights are frozen (LoRA): only the adapters have gradients".into(),
            }),
        }
    }

    /// Copies the gradient of parameter `name` (see [`Grads::tensor`]) to a new host vector
    /// (a gradient stored in bf16 widened, exact).
    ///
    /// # Errors
    /// As [`Grads::tensor`] (but a bf16 gradient is read), or a backend failure.
    pub fn download(&self, backend: &B, name: &str) -> Result<Vec<f32>, ModelError> {
        if let Some(h) = self.half_tensor(name) {
            return HalfStack::download_widened(backend, h);
        }
        let t = self.tensor(name)?;
        let mut out = vec![0.0; t.len()];
        backend.download(t, &mut out)?;
        Ok(out)
    }
}

impl<B: Backend> Model<B> {
    /// Zeroed gradient buffers for this model's parameters, stored as `dtype` says
    /// ([`GradDtype::Bf16`]: the decoder's linear weight gradients in bf16, see
    /// `half_grads.rs`). Under LoRA the pairs' gradients are f32 whatever `dtype` says:
    /// there are no linear weight gradients to store.
    ///
    /// # Errors
    /// A backend allocation failure.
    pub fn grads_in(&self, dtype: GradDtype) -> Result<Grads<B>, ModelError> {
        let mut grads = self.grads()?;
        if let (GradDtype::Bf16, Some(g)) = (dtype, grads.g.as_mut()) {
            grads.half = Some(HalfGrads::new(&self.backend, g)?);
        }
        Ok(grads)
    }

    /// Zeroed gradient buffers for this model's parameters.
    ///
    /// # Errors
    /// A backend allocation failure.
    pub fn grads(&self) -> Result<Grads<B>, ModelError> {
        let be = &self.backend;
        Ok(match &self.lora {
            Some(lora) => Grads {
                g: None,
                lora: Some(lora.params.zeros_like(be)?),
                watch: None,
                half: None,
            },
            None => Grads {
                g: Some(self.weights.zeros_like(be)?),
                lora: None,
                watch: None,
                half: None,
            },
        })
    }

    /// The buffers of the trained parameters, in the optimizer's order: the weights, or
    /// with LoRA the pairs (a data-parallel run shares updated ones among its ranks).
    pub fn trainable_buffers(&self) -> Vec<&B::Buffer> {
        self.trainable()
    }

    /// Trainable buffer `buffer` (of [`Model::trainable_buffers`]) on the host.
    ///
    /// # Errors
    /// No such buffer; a backend failure.
    pub fn read_trainable(&self, buffer: usize) -> Result<Vec<f32>, ModelError> {
        if let Some(copy) = self.trained_bf16(buffer) {
            // a weight stored in bf16: its values widened (exact)
            return HalfStack::download_widened(&self.backend, copy.whole());
        }
        let all = self.trainable();
        let b = all.get(buffer).ok_or(ModelError::LayoutMismatch {
            what: "trainable buffer index",
        })?;
        let mut out = vec![0.0f32; b.len()];
        self.backend.download(View::whole(*b), &mut out)?;
        Ok(out)
    }

    /// The bf16 weight of trainable buffer `buffer` when the model stores it in bf16 only
    /// (never under LoRA, which trains f32 pairs).
    fn trained_bf16(&self, buffer: usize) -> Option<&HalfStack<B>> {
        self.lora
            .is_none()
            .then(|| self.stored_bf16(buffer))
            .flatten()
    }

    /// The bf16 bits of trainable buffer `buffer` when it is a weight stored in bf16 (its
    /// values exactly, in half the bytes of [`Model::read_trainable`]); `None` otherwise.
    ///
    /// # Errors
    /// A backend failure.
    pub fn read_trainable_bits(&self, buffer: usize) -> Result<Option<Vec<u16>>, ModelError> {
        let Some(copy) = self.trained_bf16(buffer) else {
            return Ok(None);
        };
        let mut bits = vec![0u16; copy.whole().len()];
        self.backend.download_half(copy.whole(), &mut bits)?;
        Ok(Some(bits))
    }

    /// Sets trainable buffer `buffer`, a weight stored in bf16, from its bits
    /// ([`Model::read_trainable_bits`] on another rank).
    ///
    /// # Errors
    /// Not such a buffer, a length other than its; a backend failure.
    pub fn write_trainable_bits(&mut self, buffer: usize, bits: &[u16]) -> Result<(), ModelError> {
        let stored = self.lora.is_none().then(|| self.stored_bf16_index(buffer));
        let mismatch = ModelError::LayoutMismatch {
            what: "trainable bf16 buffer (index or length)",
        };
        let (Some(k), Some(copies)) = (stored.flatten(), self.bf16_weights.as_mut()) else {
            return Err(mismatch);
        };
        let copy = copies.by_index_mut(k)?;
        if copy.len() != bits.len() {
            return Err(mismatch);
        }
        Ok(self
            .backend
            .upload_half(bits, ViewMut::whole(copy.buffer_mut()))?)
    }

    /// Sets trainable buffer `buffer` from the host (a data-parallel rank receiving what
    /// another rank's optimizer updated).
    ///
    /// # Errors
    /// No such buffer, a length other than its; a backend failure.
    pub fn write_trainable(&mut self, buffer: usize, values: &[f32]) -> Result<(), ModelError> {
        let stored = self.lora.is_none().then(|| self.stored_bf16_index(buffer));
        if let (Some(k), Some(copies)) = (stored.flatten(), self.bf16_weights.as_mut()) {
            // a weight stored in bf16 receives bf16 values (another rank's update): rounding
            // to nearest gives them back exactly
            let copy = copies.by_index_mut(k)?;
            if copy.len() != values.len() {
                return Err(ModelError::LayoutMismatch {
                    what: "trainable buffer (index or length)",
                });
            }
            let mut f32s = self.backend.alloc(values.len())?;
            self.backend.upload(values, ViewMut::whole(&mut f32s))?;
            return copy.round_from(&self.backend, View::whole(&f32s));
        }
        let mut all = match &mut self.lora {
            Some(l) => l.params.buffers_mut(),
            None => self.weights.buffers_mut(),
        };
        let b = all
            .get_mut(buffer)
            .filter(|b| b.len() == values.len())
            .ok_or(ModelError::LayoutMismatch {
                what: "trainable buffer (index or length)",
            })?;
        self.backend.upload(values, ViewMut::whole(*b))?;
        self.refresh_bf16_weights(Some(buffer))
    }

    /// Lets `write` set the trainable buffers on the device (a data-parallel transport that
    /// moves updated parameters between GPUs) — each as it is stored: f32, or the bf16 bits
    /// of a linear weight stored in bf16 ([`Model::set_weight_storage`]) — then refreshes
    /// the bf16 copies of the f32 ones it reports written.
    ///
    /// # Errors
    /// `write`'s; a written index past the buffers; a backend failure.
    pub fn write_trainable_on_device(
        &mut self,
        write: impl FnOnce(&mut [TrainableMut<'_, B>]) -> Result<Vec<usize>, ModelError>,
    ) -> Result<(), ModelError> {
        // each buffer's copy index where the copy is the weight (its f32 buffer released)
        let stored: Vec<Option<usize>> = (0..self.trainable().len())
            .map(|b| {
                self.lora
                    .is_none()
                    .then(|| self.stored_bf16_index(b))
                    .flatten()
            })
            .collect();
        let mut all: Vec<TrainableMut<'_, B>> = match &mut self.lora {
            Some(l) => TrainableMut::f32s(l.params.buffers_mut()),
            None => {
                let mut halves: Vec<Option<&mut B::Half>> = match self.bf16_weights.as_mut() {
                    Some(c) => c.copies_mut().into_iter().map(Some).collect(),
                    None => Vec::new(),
                };
                let buffers = self.weights.buffers_mut().into_iter().zip(&stored);
                let mut out = Vec::with_capacity(stored.len());
                for (f32s, k) in buffers {
                    let half = k.and_then(|k| halves.get_mut(k).and_then(Option::take));
                    out.push(match half {
                        Some(h) => TrainableMut::Bf16(h),
                        None => TrainableMut::F32(f32s),
                    });
                }
                out
            }
        };
        let count = all.len();
        let written = write(&mut all)?;
        drop(all);
        for b in written {
            if b >= count {
                return Err(ModelError::LayoutMismatch {
                    what: "trainable buffer index",
                });
            }
            if stored[b].is_none() {
                self.refresh_bf16_weights(Some(b))?;
            }
        }
        Ok(())
    }

    /// The buffers of the trained parameters: the weights, or with LoRA the pairs.
    pub(crate) fn trainable(&self) -> Vec<&B::Buffer> {
        match &self.lora {
            Some(l) => l.params.buffers(),
            None => self.weights.buffers(),
        }
    }

    /// The length of each of [`Model::trainable_buffers`], as the gradients and moments
    /// have it (a linear stack stored in bf16 has an empty f32 buffer: its bf16 length).
    pub fn trainable_lens(&self) -> Vec<usize> {
        match &self.lora {
            Some(l) => l.params.buffers().iter().map(|b| b.len()).collect(),
            None => self.weights.buffer_lens(),
        }
    }

    /// One tensor's length of each of [`Model::trainable`] (a whole buffer's, or one
    /// layer's of a stack).
    pub(crate) fn trainable_items(&self) -> Vec<usize> {
        match &self.lora {
            Some(l) => l.params.buffer_items(),
            None => self.weights.buffer_items(),
        }
    }

    /// Every trained tensor: its name, shape, and where it lives among
    /// [`Model::trainable`] (buffer, layer).
    pub(crate) fn trainable_tensors(&self) -> Result<Vec<TrainedTensor>, ModelError> {
        let Some(lora) = &self.lora else {
            let w = &self.weights;
            return crate::hf::weights::expected_tensors(&self.config)
                .into_iter()
                .map(|(name, shape)| {
                    let place = w.buffer_item(&name)?;
                    Ok((name, shape, place))
                })
                .collect();
        };
        let r = lora.config.r;
        let mut out = Vec::new();
        let mut buffer = 0;
        for t in super::lora::Target::ALL {
            let Some(p) = &lora.params.pairs[t as usize] else {
                continue;
            };
            let (inp, out_f) = (p.a.item() / r, p.b.item() / r);
            let layers = p.a.len() / p.a.item().max(1);
            for l in 0..layers {
                out.push((lora_tensor_name(l, t, "A"), vec![r, inp], (buffer, l)));
                out.push((lora_tensor_name(l, t, "B"), vec![out_f, r], (buffer + 1, l)));
            }
            buffer += 2;
        }
        Ok(out)
    }

    /// Whether `grads` were made for this model's trained parameters.
    pub(crate) fn fits_grads(&self, grads: &Grads<B>) -> bool {
        self.trainable_lens() == grads.lens()
    }
}
