//! [`Counting`]: a backend that runs another and records what each call asks of the device —
//! allocations, transfers, host waits, and the order of the ops — so a test can check what
//! capturing a decode step as a CUDA graph requires of it: after warm-up no allocation, at
//! most one host synchronisation, and the same op sequence every step. On a backend that
//! records no graph (the CPU) it can stand in for one that does
//! ([`Counting::emulating_capture`]): captures "succeed" as far as the caller can tell up
//! to their end, the ops run as called, and whatever a real capture would refuse inside
//! one — an allocation, a transfer, a wait — is noted.

use super::ops::{declared_ops, op_arg_type};
use super::{
    Activation, ActorLossGrads, ActorLossSpec, ActorLossViews, AdamWUpdate, AttentionDims, Backend,
    DType, GradWrites, HweViews, KlSumViews, KlViews, KvCacheView, KvCacheViewMut, LinearDims,
    PagedKvView, PagedKvViewMut, PickBuffersOf, PickRule, Result, SegmentAttentionDims, Stored,
    Tensor, TensorMut, View, ViewMut, WindowSpec,
};
use ares_cpu::sampler::{SampleKey, Sampler};
use std::sync::{Arc, Mutex};

/// What the device was asked for since the last [`Counting::take`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Buffers allocated.
    pub allocations: usize,
    /// Host-to-device copies.
    pub uploads: usize,
    /// Calls that wait for the device and bring results to the host (downloads, picks,
    /// `sums_of_squares`, `synchronize`).
    pub host_waits: usize,
    /// Every call, in order, by its method's name.
    pub calls: Vec<&'static str>,
    /// Captures begun.
    pub captures: usize,
    /// Graphs replayed.
    pub replays: usize,
    /// Calls made inside a capture that a capture cannot record (allocations, transfers,
    /// waits), by name.
    pub in_capture: Vec<&'static str>,
}

/// Runs backend `B`, counting (see the module docs). The buffers are `B`'s own.
#[derive(Debug, Default)]
pub struct Counting<B> {
    inner: B,
    /// Shared by the clones (a trainer clones its backend for the reference policy).
    counts: Arc<Mutex<Counts>>,
    /// Captures emulated (see the module docs).
    emulate: bool,
    capturing: Arc<Mutex<bool>>,
    /// [`Backend::has_actor_loss`] answers no (a trainer computes every loss on the host).
    host_loss: bool,
}

#[derive(Clone, Copy)]
enum Kind {
    Alloc,
    Upload,
    Wait,
    Op,
}

impl<B: Clone> Clone for Counting<B> {
    /// A clone counting into the same [`Counts`].
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            counts: Arc::clone(&self.counts),
            emulate: self.emulate,
            capturing: Arc::clone(&self.capturing),
            host_loss: self.host_loss,
        }
    }
}

impl<B> Counting<B> {
    /// Wraps `inner`.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            counts: Arc::new(Mutex::new(Counts::default())),
            emulate: false,
            capturing: Arc::new(Mutex::new(false)),
            host_loss: false,
        }
    }

    /// Wraps `inner`, answering [`Backend::has_actor_loss`] with no: a trainer on it
    /// computes every loss on the host, as it does Clip-Cov's — so its two loss paths can be
    /// compared on one backend.
    pub fn with_host_loss(inner: B) -> Self {
        Self {
            host_loss: true,
            ..Self::new(inner)
        }
    }

    /// Wraps `inner`, a backend that records no graph, answering captures itself:
    /// [`Backend::begin_capture`] says yes, the ops then run as called, and
    /// [`Backend::end_capture`] reports the capture failed (`None`), so the caller runs
    /// them again — checking a caller's capture discipline without a GPU.
    pub fn emulating_capture(inner: B) -> Self {
        Self {
            emulate: true,
            ..Self::new(inner)
        }
    }

    /// What was counted since the last call (or the start), resetting the counts.
    pub fn take(&self) -> Counts {
        std::mem::take(&mut *self.lock())
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        // a panic while counting leaves plain numbers behind: still usable
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn note(&self, kind: Kind, name: &'static str) {
        let capturing = *self.capturing.lock().unwrap_or_else(|e| e.into_inner());
        let mut c = self.lock();
        match kind {
            Kind::Alloc => c.allocations += 1,
            Kind::Upload => c.uploads += 1,
            Kind::Wait => c.host_waits += 1,
            Kind::Op => {}
        }
        if capturing && !matches!(kind, Kind::Op) {
            c.in_capture.push(name);
        }
        c.calls.push(name);
    }

    fn set_capturing(&self, on: bool) {
        *self.capturing.lock().unwrap_or_else(|e| e.into_inner()) = on;
    }
}

/// A [`Stored`] view of the counter's as the inner backend's (the same buffers).
fn inner_stored<B: Backend>(x: Stored<'_, Counting<B>>) -> Stored<'_, B> {
    match x {
        Stored::F32(x) => Stored::F32(x),
        Stored::Bf16(x) => Stored::Bf16(x),
    }
}

/// Argument `$a` of a declared op as the inner backend takes it.
#[rustfmt::skip]
macro_rules! inner_arg {
    ($a:ident: In<stored>) => { inner_stored($a) };
    ($a:ident: $($t:tt)+) => { $a };
}

/// The declared ops: noted, then run by the inner backend.
macro_rules! counting_ops {
    ($(
        $(#[$meta:meta])*
        fn $name:ident($($arg:ident: $kind:ident $(<$dt:ident>)?),* $(,)?)
            cpu $cpu:path, cuda $cuda:ident;
    )*) => {
        $(
            #[allow(clippy::too_many_arguments)]
            fn $name(&self, $($arg: op_arg_type!($kind $(<$dt>)?)),*) -> Result<()> {
                self.note(Kind::Op, stringify!($name));
                self.inner.$name($(inner_arg!($arg: $kind $(<$dt>)?)),*)
            }
        )*
    };
}

impl<B: Backend> Backend for Counting<B> {
    type Buffer = B::Buffer;
    type Ids = B::Ids;
    type Half = B::Half;
    type Bytes = B::Bytes;
    type Graph = B::Graph;

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn memory_info(&self) -> Option<(u64, u64)> {
        self.inner.memory_info()
    }

    fn begin_capture(&self) -> Result<bool> {
        self.lock().captures += 1;
        self.lock().calls.push("begin_capture");
        let on = if self.emulate {
            true
        } else {
            self.inner.begin_capture()?
        };
        self.set_capturing(on);
        Ok(on)
    }

    fn end_capture(&self) -> Result<Option<Self::Graph>> {
        self.lock().calls.push("end_capture");
        self.set_capturing(false);
        if self.emulate {
            return Ok(None);
        }
        self.inner.end_capture()
    }

    fn replay(&self, graph: &Self::Graph) -> Result<()> {
        self.lock().replays += 1;
        self.note(Kind::Op, "replay");
        self.inner.replay(graph)
    }

    fn op_profile(&self) -> Result<Option<String>> {
        self.inner.op_profile()
    }

    fn decodes_from_training_weights(&self) -> bool {
        self.inner.decodes_from_training_weights()
    }

    fn packs_sequences(&self) -> bool {
        self.inner.packs_sequences()
    }

    fn keeps_bf16_weights(&self) -> bool {
        self.inner.keeps_bf16_weights()
    }

    fn alloc(&self, len: usize) -> Result<Self::Buffer> {
        self.note(Kind::Alloc, "alloc");
        self.inner.alloc(len)
    }

    fn alloc_ids(&self, len: usize) -> Result<Self::Ids> {
        self.note(Kind::Alloc, "alloc_ids");
        self.inner.alloc_ids(len)
    }

    fn alloc_half(&self, len: usize, dtype: DType) -> Result<Self::Half> {
        self.note(Kind::Alloc, "alloc_half");
        self.inner.alloc_half(len, dtype)
    }

    fn alloc_bytes(&self, len: usize) -> Result<Self::Bytes> {
        self.note(Kind::Alloc, "alloc_bytes");
        self.inner.alloc_bytes(len)
    }

    fn upload_bytes(&self, src: &[u8], dst: ViewMut<'_, Self::Bytes>) -> Result<()> {
        self.note(Kind::Upload, "upload_bytes");
        self.inner.upload_bytes(src, dst)
    }

    fn download_bytes(&self, src: View<'_, Self::Bytes>, dst: &mut [u8]) -> Result<()> {
        self.note(Kind::Wait, "download_bytes");
        self.inner.download_bytes(src, dst)
    }

    fn upload(&self, src: &[f32], dst: TensorMut<'_, Self>) -> Result<()> {
        self.note(Kind::Upload, "upload");
        self.inner.upload(src, dst)
    }

    fn upload_ids(&self, src: &[u32], dst: &mut Self::Ids) -> Result<()> {
        self.note(Kind::Upload, "upload_ids");
        self.inner.upload_ids(src, dst)
    }

    fn upload_half(&self, src: &[u16], dst: ViewMut<'_, Self::Half>) -> Result<()> {
        self.note(Kind::Upload, "upload_half");
        self.inner.upload_half(src, dst)
    }

    fn download_half(&self, src: View<'_, Self::Half>, dst: &mut [u16]) -> Result<()> {
        self.note(Kind::Wait, "download_half");
        self.inner.download_half(src, dst)
    }

    fn download(&self, src: Tensor<'_, Self>, dst: &mut [f32]) -> Result<()> {
        self.note(Kind::Wait, "download");
        self.inner.download(src, dst)
    }

    fn synchronize(&self) -> Result<()> {
        self.note(Kind::Wait, "synchronize");
        self.inner.synchronize()
    }

    declared_ops!(counting_ops);

    fn add(
        &self,
        a: Tensor<'_, Self>,
        b: Tensor<'_, Self>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        self.note(Kind::Op, "add");
        self.inner.add(a, b, out)
    }

    fn greedy_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        ids: &mut Self::Ids,
        host: &mut [u32],
    ) -> Result<()> {
        self.note(Kind::Wait, "greedy_tokens");
        self.inner.greedy_tokens(logits, vocab, ids, host)
    }

    fn sample_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        sampler: &Sampler,
        keys: &[SampleKey],
        ids: &mut Self::Ids,
        host: &mut [u32],
    ) -> Result<()> {
        self.note(Kind::Wait, "sample_tokens");
        self.inner
            .sample_tokens(logits, vocab, sampler, keys, ids, host)
    }

    fn pick_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        rule: PickRule<'_>,
        temperature: f32,
        bufs: &mut PickBuffersOf<Self>,
        host: &mut [u32],
    ) -> Result<()> {
        self.note(Kind::Wait, "pick_tokens");
        self.inner
            .pick_tokens(logits, vocab, rule, temperature, bufs, host)
    }

    fn sums_of_squares(&self, xs: &[Stored<'_, Self>], out: &mut [f64]) -> Result<()> {
        self.note(Kind::Wait, "sums_of_squares");
        let xs: Vec<Stored<'_, B>> = xs.iter().map(|&x| inner_stored(x)).collect();
        self.inner.sums_of_squares(&xs, out)
    }

    fn kv_cache_append(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: KvCacheViewMut<'_, Self::Buffer>,
    ) -> Result<()> {
        self.note(Kind::Op, "kv_cache_append");
        self.inner.kv_cache_append(dims, k_new, v_new, cache)
    }

    fn attention_decode(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: KvCacheView<'_, Self::Buffer>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        self.note(Kind::Op, "attention_decode");
        self.inner.attention_decode(dims, q, cache, out)
    }

    fn paged_kv_cache_append(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: PagedKvViewMut<'_, Self::Buffer, Self::Ids>,
    ) -> Result<()> {
        self.note(Kind::Op, "paged_kv_cache_append");
        self.inner.paged_kv_cache_append(dims, k_new, v_new, cache)
    }

    fn paged_attention_decode(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, Self::Buffer, Self::Ids>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        self.note(Kind::Op, "paged_attention_decode");
        self.inner.paged_attention_decode(dims, q, cache, out)
    }

    fn paged_kv_cache_append_bf16(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: PagedKvViewMut<'_, Self::Half, Self::Ids>,
    ) -> Result<()> {
        self.note(Kind::Op, "paged_kv_cache_append_bf16");
        self.inner
            .paged_kv_cache_append_bf16(dims, k_new, v_new, cache)
    }

    fn paged_attention_decode_bf16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, Self::Half, Self::Ids>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        self.note(Kind::Op, "paged_attention_decode_bf16");
        self.inner.paged_attention_decode_bf16(dims, q, cache, out)
    }

    fn paged_attention_prefill_bf16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, Self::Buffer, Self::Ids>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        self.note(Kind::Op, "paged_attention_prefill_bf16");
        self.inner.paged_attention_prefill_bf16(dims, q, cache, out)
    }

    fn paged_attention_prefill_bf16_kv16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, Self::Half, Self::Ids>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        self.note(Kind::Op, "paged_attention_prefill_bf16_kv16");
        self.inner
            .paged_attention_prefill_bf16_kv16(dims, q, cache, out)
    }

    fn entropy_windows(
        &self,
        entropy: Tensor<'_, Self>,
        mask: Tensor<'_, Self>,
        spec: WindowSpec,
        hwe: Option<HweViews<'_, Self::Buffer>>,
        means: TensorMut<'_, Self>,
        valid: TensorMut<'_, Self>,
    ) -> Result<()> {
        self.note(Kind::Op, "entropy_windows");
        self.inner
            .entropy_windows(entropy, mask, spec, hwe, means, valid)
    }

    fn masked_dynamic_kl(
        &self,
        inputs: KlViews<'_, Self::Buffer>,
        outputs: KlSumViews<'_, Self::Buffer>,
    ) -> Result<()> {
        self.note(Kind::Op, "masked_dynamic_kl");
        self.inner.masked_dynamic_kl(inputs, outputs)
    }

    fn actor_loss(
        &self,
        spec: &ActorLossSpec,
        inputs: ActorLossViews<'_, Self::Buffer>,
        grads: ActorLossGrads<'_, Self::Buffer>,
        report: TensorMut<'_, Self>,
    ) -> Result<std::result::Result<(), ares_core::Error>> {
        // queued: the report comes back with a download of the caller's
        self.note(Kind::Op, "actor_loss");
        self.inner.actor_loss(spec, inputs, grads, report)
    }

    fn actor_loss_output(
        &self,
        report: &[f32; super::ACTOR_LOSS_REPORT],
    ) -> std::result::Result<ares_core::loss::ActorLossOutput<f32>, ares_core::Error> {
        self.inner.actor_loss_output(report)
    }

    fn has_actor_loss(&self, objective: &ares_core::loss::Objective<f32>) -> bool {
        !self.host_loss && self.inner.has_actor_loss(objective)
    }
}
