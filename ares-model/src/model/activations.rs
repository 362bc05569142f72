//! [`Activations`]: every intermediate tensor of one forward pass, planned up front for a
//! batch shape `(batch, seq)` and reused across calls (llm.c's `ActivationTensors`).
//!
//! Per-layer tensors are one buffer `[layers, tokens, ...]` each, so the backward pass
//! finds every layer's inputs, `rstd` and `lse` where the forward left them. With `N = batch
//! · seq` tokens, `C` hidden, `I` intermediate, `V` vocab, `Hq`/`Hkv` heads of `D`, the
//! arena holds about `L · N · (4C + 3·Hq·D + 4·Hkv·D + 3I) + 2·R·V` floats, plus the
//! backward scratch and one layer's two projections the residual adds read (`att_proj`,
//! `mlp_out`: no backward reads them, so no layer keeps its own), where `R` is the number of logits rows the LM head keeps
//! ([`HeadMode`]): `R = N` with whole logits, `R = rows` with a chunked head (the logits
//! and their gradient, one buffer each). Buffers a call never touches (the gradients
//! during generation) cost address space only: fresh allocations are zero pages until
//! written.
//!
//! # Full or chunked LM head
//! With a real vocabulary the logits dwarf everything else: `N = 8192` tokens of a
//! 151 936-token vocabulary are 5 GB of f32, twice with their gradient. Training and
//! scoring only need each token's log-prob and entropy (and, backwards, ∂L/∂logπ per
//! token), so a **chunked** arena keeps the final-norm output `[N, C]` and one `[rows, V]`
//! logits buffer (and one `[rows, V]` gradient buffer: the backend's ops never write a
//! view of a buffer they read); [`Model::log_prob_entropy`](super::Model::log_prob_entropy)
//! and [`Model::backward_from_log_prob_grads`](super::Model::backward_from_log_prob_grads)
//! run the LM head `rows` tokens at a time, recomputing a chunk's logits in the backward
//! pass. The numbers are those of the full head (the same kernels on the same rows; only
//! the GEMMs' blocking may differ with the row count).
//!
//! **Policy** of [`Model::activations`](super::Model::activations) /
//! [`Activations::new`] ([`HeadMode::auto`]): whole logits while `N · V · 4` bytes is at
//! most [`HeadMode::AUTO_LOGITS_BYTES`] (256 MiB; the tiny test models and short batches),
//! else a chunked head of `max(1, 256 MiB / (4·V))` rows (441 rows for `V = 151 936`), so
//! the head's buffers never exceed 2 × 256 MiB unless a single row does.
//! [`Model::activations_full`](super::Model::activations_full) and
//! [`Model::activations_chunked`](super::Model::activations_chunked) choose explicitly.
//! Whole logits are needed by [`Model::download_logits`](super::Model::download_logits),
//! [`Model::backward`](super::Model::backward) with the caller's ∂L/∂logits and generation
//! ([`Model::forward_cached`](super::Model::forward_cached)); those return
//! [`ModelError::ChunkedLogits`] on a chunked arena.

use super::act_dtype::{ActLayout, ActStack};
use super::lora::LoraActs;
use super::weights::Stack;
use super::{ModelError, ModelSpec};
use crate::backend::{Backend, DeviceBuffer, Tensor, View, ViewMut};

/// How an [`Activations`] arena keeps the output of the LM head (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadMode {
    /// [`Model::forward`](super::Model::forward) writes the whole logits `[N, V]`; the
    /// arena also holds a `[N, V]` ∂L/∂logits buffer.
    Full,
    /// The forward pass stops at the final norm; the log-prob head and its backward run
    /// the LM head `rows` tokens at a time into one `[rows, V]` logits buffer (and one
    /// `[rows, V]` gradient buffer). `rows >= 1`; more rows than the batch has tokens are
    /// planned as `N`.
    Chunked {
        /// Token rows per chunk.
        rows: usize,
    },
}

impl HeadMode {
    /// Size of the whole logits `[N, V]` in f32 bytes above which [`HeadMode::auto`]
    /// chunks the head, and the size of one chunk it plans: 256 MiB.
    pub const AUTO_LOGITS_BYTES: usize = 256 << 20;

    /// The rows per chunk [`HeadMode::auto`] plans for a vocabulary of `vocab`:
    /// `max(1, AUTO_LOGITS_BYTES / (4 · vocab))`.
    pub fn auto_rows(vocab: usize) -> usize {
        (Self::AUTO_LOGITS_BYTES / 4 / vocab.max(1)).max(1)
    }

    /// The mode [`Model::activations`](super::Model::activations) plans for `tokens` rows
    /// of a vocabulary of `vocab`: [`HeadMode::Full`] while `tokens · vocab · 4` bytes is at
    /// most [`HeadMode::AUTO_LOGITS_BYTES`], else chunks of [`HeadMode::auto_rows`].
    pub fn auto(tokens: usize, vocab: usize) -> Self {
        let bytes = tokens.saturating_mul(vocab).saturating_mul(4);
        if bytes <= Self::AUTO_LOGITS_BYTES {
            Self::Full
        } else {
            Self::Chunked {
                rows: Self::auto_rows(vocab),
            }
        }
    }
}

/// The activation arena of a model for a fixed `(batch, seq)`, with whole logits or a
/// chunked LM head ([`HeadMode`]; the policy of [`Activations::new`] is in the module
/// docs: whole logits up to 256 MiB of them, chunks of 256 MiB above).
#[derive(Debug)]
pub struct Activations<B: Backend> {
    pub(crate) batch: usize,
    pub(crate) seq: usize,
    /// `[N]` token ids, uploaded per call.
    pub(crate) ids: B::Ids,
    /// `[N]` positions, uploaded per call.
    pub(crate) positions: B::Ids,
    /// `[N]` key mask (0/1), uploaded per call.
    pub(crate) mask: B::Buffer,
    /// Host staging of the mask as f32, `[N]`.
    pub(crate) host_mask: Vec<f32>,
    /// The packed sequences' offsets of the pass (`ForwardExtras::segments`), uploaded per
    /// call; `None`: the rows are the sequences.
    pub(crate) segments: Option<B::Ids>,
    /// The padded layout the attention of packed segments runs in where the model does not
    /// pass them to the backend ([`Model::set_native_packed_attention`]).
    pub(crate) unpack: Option<super::unpack::Unpack<B>>,
    /// `[N, D/2]` RoPE cos and sin of each token's position.
    pub(crate) cos: B::Buffer,
    pub(crate) sin: B::Buffer,
    /// The decoder layers' activations, and the embeddings entering layer 0.
    pub(crate) layers: LayerBuffers<B>,
    /// `[N, C]` final RMSNorm output, and `[N]` its rstd.
    pub(crate) lnf: B::Buffer,
    pub(crate) lnf_rstd: B::Buffer,
    /// How the LM head's output is kept, and the token rows `R` of one head chunk (`N`
    /// with whole logits).
    pub(crate) head: HeadMode,
    pub(crate) chunk_rows: usize,
    /// `[R, V]` logits: the whole `[N, V]`, or the current chunk's.
    pub(crate) logits: B::Buffer,
    /// Target ids, one buffer per head chunk (`[N]` with whole logits; the backend's
    /// log-prob ops take a whole id buffer per call), and `[N]` the log-prob and entropy
    /// of each token.
    pub(crate) targets: Vec<B::Ids>,
    pub(crate) log_prob: B::Buffer,
    pub(crate) entropy: B::Buffer,
    /// `[N]` ∂L/∂logπ per token and `[R, V]` the ∂L/∂logits they imply (of the current
    /// chunk), written by
    /// [`Model::backward_from_log_prob_grads`](super::Model::backward_from_log_prob_grads).
    pub(crate) coeffs: B::Buffer,
    /// `[N]` ∂L/∂H per token of an entropy bonus, written by
    /// [`Model::backward_from_log_prob_grads_with`](super::Model::backward_from_log_prob_grads_with)
    /// when it is given some. Always allocated: `N` floats are nothing beside the `[L, N,
    /// …]` activations, and a plan that does not depend on the loss keeps one arena good
    /// for every call.
    pub(crate) entropy_coeffs: B::Buffer,
    pub(crate) dlogits: B::Buffer,
    /// Per-layer intermediates of the backward pass, reused by every layer.
    pub(crate) scratch: BackwardScratch<B>,
    /// The LoRA pairs' intermediates (a model with adapters, planned by
    /// [`Model::activations`](super::Model::activations) and the others).
    pub(crate) lora: Option<LoraActs<B>>,
}

/// The activations of the decoder layers, each kind one [`Stack`] `[L, N, ...]` (llm.c's
/// `ActivationTensors`), and the embeddings entering layer 0. The forward and backward
/// passes read and write them one layer at a time through the views of `layer.rs`
/// ([`LayerBuffers::at_mut`], [`LayerBuffers::at`]).
#[derive(Debug)]
pub(crate) struct LayerBuffers<B: Backend> {
    /// Decoder layers `L`.
    pub(crate) count: usize,
    /// Activation checkpointing: the stacks below but `resid_out` hold one layer (`[1, N,
    /// ...]`), which every layer's forward overwrites, and the backward pass recomputes a
    /// layer's from its input before using them ([`Model::layer_forward`]).
    ///
    /// [`Model::layer_forward`]: super::Model::layer_forward
    pub(crate) checkpointed: bool,
    /// `[N, C]` token embeddings (input of layer 0).
    pub(crate) encoded: B::Buffer,
    /// `[N, C]` input RMSNorm output of the layer last run (stored as the arena's
    /// [`ActLayout`] says; one layer's, whatever the checkpointing: the backward recomputes
    /// a layer's from its input), and `[L, N]` its rstd.
    pub(crate) ln1: ActStack<B>,
    pub(crate) ln1_rstd: Stack<B>,
    /// `[L, N, Hq·D]`, `[L, N, Hkv·D]` q/k projections before their RMSNorm (Qwen3 only,
    /// else empty), and `[L, N·Hq]`, `[L, N·Hkv]` their rstd.
    pub(crate) q_raw: Stack<B>,
    pub(crate) k_raw: Stack<B>,
    pub(crate) q_rstd: Stack<B>,
    pub(crate) k_rstd: Stack<B>,
    /// `[L, N, Hq·D]`, `[L, N, Hkv·D]` q, k (after RoPE) and v (stored as the arena's
    /// [`ActLayout`] says).
    pub(crate) q: ActStack<B>,
    pub(crate) k: ActStack<B>,
    pub(crate) v: ActStack<B>,
    /// `[N, max(C, Hq·D)]` f32: where `ln1`, q, k and v stored in bf16 are made before
    /// they are rounded (one layer's; empty when none is).
    pub(crate) stage: B::Buffer,
    /// `[L, N, Hq·D]` attention output (stored as the arena's [`ActLayout`] says) and
    /// `[L, N·Hq]` its log-sum-exp.
    pub(crate) att: ActStack<B>,
    pub(crate) lse: Stack<B>,
    /// `[N, C]` output projection of the layer being run: one layer's only, whatever the
    /// checkpointing (the residual add reads it, the backward pass does not).
    pub(crate) att_proj: Stack<B>,
    /// `[L, N, C]` residual stream after attention.
    pub(crate) resid_mid: Stack<B>,
    /// `[N, C]` post-attention RMSNorm output of the layer last run (one layer's, as `ln1`),
    /// and `[L, N]` its rstd.
    pub(crate) ln2: ActStack<B>,
    pub(crate) ln2_rstd: Stack<B>,
    /// `[L, N, I]` gate and up projections, and `[N, I]` `silu(gate) · up` of the layer
    /// last run: one layer's, whatever the checkpointing — the backward recomputes a
    /// layer's from its gate and up (one elementwise pass, the same bits) rather than keep
    /// every layer's. These and `ln2` are stored as the arena's [`ActLayout`] says
    /// (`act_dtype.rs`).
    pub(crate) gate: ActStack<B>,
    pub(crate) up: ActStack<B>,
    pub(crate) act: ActStack<B>,
    /// `[N, C]` down projection of the layer being run (one layer's, as `att_proj`).
    pub(crate) mlp_out: Stack<B>,
    /// `[L, N, C]` residual stream after the MLP (input of the next layer); every layer's,
    /// checkpointed or not.
    pub(crate) resid_out: Stack<B>,
}

impl<B: Backend> LayerBuffers<B> {
    /// Allocates the layers' activations for `n = batch · seq` tokens (`batch`, `seq` for
    /// the overflow error); `checkpointed`: one layer's but the residual stream; stored as
    /// `layout` says.
    fn new(
        backend: &B,
        spec: &ModelSpec,
        (batch, seq, n): (usize, usize, usize),
        checkpointed: bool,
        layout: ActLayout,
    ) -> Result<Self, ModelError> {
        let layers = spec.layers;
        // the stacks that checkpointing keeps one layer of
        let l = if checkpointed { layers.min(1) } else { layers };
        let (c, i) = (spec.hidden, spec.intermediate);
        let (qd, kvd) = (spec.q_dim(), spec.kv_dim());
        let (hq, hkv) = (spec.q_heads, spec.kv_heads);
        // `[L, item]`, item = the product of `dims`.
        let stack = |dims: &[usize]| -> Result<Stack<B>, ModelError> {
            let item = numel(batch, seq, dims)?;
            let total = numel(batch, seq, &[l, item])?;
            Ok(Stack::new(backend.alloc(total)?, item))
        };
        // `[layers, item]` stored as `bf16` says
        let stored_over = |layers: usize, bf16: bool, dims: &[usize]| {
            let item = numel(batch, seq, dims)?;
            let total = numel(batch, seq, &[layers, item])?;
            ActStack::new(backend, bf16, total, item)
        };
        let stored = |bf16: bool, dims: &[usize]| stored_over(l, bf16, dims);
        let stage = match layout.stages() {
            true => numel(batch, seq, &[n, c.max(qd)])?,
            false => 0,
        };
        let qk_raw = usize::from(spec.qk_norm);
        let resid_item = numel(batch, seq, &[n, c])?;
        let resid_out = Stack::new(
            backend.alloc(numel(batch, seq, &[layers, resid_item])?)?,
            resid_item,
        );
        Ok(Self {
            count: layers,
            checkpointed,
            encoded: backend.alloc(numel(batch, seq, &[n, c])?)?,
            ln1: stored_over(layers.min(1), layout.ln1, &[n, c])?,
            ln1_rstd: stack(&[n])?,
            q_raw: stack(&[qk_raw, n, qd])?,
            k_raw: stack(&[qk_raw, n, kvd])?,
            q_rstd: stack(&[qk_raw, n, hq])?,
            k_rstd: stack(&[qk_raw, n, hkv])?,
            q: stored(layout.qkv, &[n, qd])?,
            k: stored(layout.qkv, &[n, kvd])?,
            v: stored(layout.qkv, &[n, kvd])?,
            stage: backend.alloc(stage)?,
            att: stored(layout.att, &[n, qd])?,
            lse: stack(&[n, hq])?,
            att_proj: Stack::new(backend.alloc(resid_item)?, resid_item),
            resid_mid: stack(&[n, c])?,
            ln2: stored_over(layers.min(1), layout.mlp, &[n, c])?,
            ln2_rstd: stack(&[n])?,
            gate: stored(layout.mlp, &[n, i])?,
            up: stored(layout.mlp, &[n, i])?,
            act: stored_over(layers.min(1), layout.mlp, &[n, i])?,
            mlp_out: Stack::new(backend.alloc(resid_item)?, resid_item),
            resid_out,
        })
    }
}

/// Product of `dims`, or a [`ModelError::BatchShape`] on overflow.
fn numel(batch: usize, seq: usize, dims: &[usize]) -> Result<usize, ModelError> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or(ModelError::BatchShape { batch, seq })
}

/// The head chunks of `n` tokens in chunks of `rows` (`rows >= 1`): `(first token, rows)`
/// for each, in order; the last may be shorter.
pub(crate) fn head_chunks(n: usize, rows: usize) -> impl Iterator<Item = (usize, usize)> {
    let rows = rows.max(1);
    (0..n)
        .step_by(rows)
        .map(move |start| (start, rows.min(n - start)))
}

/// What an activation arena holds, by element type ([`arena_elements`],
/// [`Activations::elements`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArenaElements {
    /// f32 values (with the host's staging of the key mask).
    pub f32s: u64,
    /// bf16 values: the activations an [`ActLayout`] stores in bf16.
    pub bf16s: u64,
    /// u32 ids.
    pub ids: u64,
}

impl ArenaElements {
    /// Bytes: 4 an f32 value or id, 2 a bf16 value.
    pub fn bytes(&self) -> u64 {
        4 * (self.f32s + self.ids) + 2 * self.bf16s
    }
}

/// What an arena of [`Activations::planned`]`(spec, batch, seq, head, checkpointed, layout)`
/// holds, without allocating it (the memory plan's figure), by the same sizes as the
/// allocation (a test checks the two agree). `None` when the shape overflows or is empty,
/// or `head` is a chunk of 0 rows (the allocation's errors).
pub fn arena_elements(
    spec: &ModelSpec,
    batch: usize,
    seq: usize,
    head: HeadMode,
    checkpointed: bool,
    layout: ActLayout,
) -> Option<ArenaElements> {
    if batch == 0 || seq == 0 {
        return None;
    }
    let n = batch.checked_mul(seq)? as u64;
    let rows = match head {
        HeadMode::Full => n,
        HeadMode::Chunked { rows: 0 } => return None,
        HeadMode::Chunked { rows } => (rows as u64).min(n),
    };
    let (c, i, v) = (
        spec.hidden as u64,
        spec.intermediate as u64,
        spec.vocab as u64,
    );
    let (qd, kvd) = (spec.q_dim() as u64, spec.kv_dim() as u64);
    let (hq, hkv) = (spec.q_heads as u64, spec.kv_heads as u64);
    let l = spec.layers as u64;
    let kept = if checkpointed { l.min(1) } else { l };
    let raw = u64::from(spec.qk_norm);
    // per token of one kept layer: ln1's rstd, (Qwen3) q/k before their norm + rstd, q, k,
    // v, att, lse, resid_mid, ln2's rstd, gate, up
    let layer = 1 + raw * (qd + kvd + hq + hkv) + (qd + 2 * kvd) + (qd + hq) + c + 1 + 2 * i;
    // the embeddings, every layer's residual stream out, one layer's att_proj, mlp_out, act,
    // ln1 and ln2
    let one = l.min(1);
    let layers = n * (c + kept * layer + l * c + 2 * c + one * (i + 2 * c));
    // stored in bf16: gate, up, act, ln2; ln1; q, k, v — and the f32 staging
    let on = |b: bool, elements: u64| if b { elements } else { 0 };
    let halves = n
        * (kept * (on(layout.mlp, 2 * i) + on(layout.qkv, qd + 2 * kvd) + on(layout.att, qd))
            + one * (on(layout.mlp, i + c) + on(layout.ln1, c)));
    let stage = on(layout.stages(), n * c.max(qd));
    let scratch = n * (2 * c + 3 * i + 2 * qd + 2 * kvd + raw * (qd + kvd)) + stage;
    // mask (and its host copy), cos + sin, lnf + rstd, log-prob, entropy and both
    // coefficients per token; the logits and their gradient
    let floats = layers + scratch + n * (2 + spec.head_dim as u64 + c + 1 + 4) + 2 * rows * v;
    // ids, positions and the head chunks' targets
    Some(ArenaElements {
        f32s: floats - halves,
        bf16s: halves,
        ids: 3 * n,
    })
}

impl<B: Backend> Activations<B> {
    /// Allocates the arena for `batch` sequences of `seq` tokens of a model with `spec`,
    /// with the LM head mode of [`HeadMode::auto`] (whole logits up to 256 MiB of them).
    ///
    /// # Errors
    /// [`ModelError::BatchShape`] for an empty or overflowing shape; backend allocation
    /// failures.
    pub fn new(
        backend: &B,
        spec: &ModelSpec,
        batch: usize,
        seq: usize,
    ) -> Result<Self, ModelError> {
        let head = HeadMode::auto(batch.saturating_mul(seq), spec.vocab);
        Self::with_head(backend, spec, batch, seq, head)
    }

    /// Whether the arena keeps one layer's activations (activation checkpointing).
    pub fn checkpointed(&self) -> bool {
        self.layers.checkpointed
    }

    /// What the arena holds (what [`arena_elements`] predicts).
    pub fn elements(&self) -> ArenaElements {
        let l = &self.layers;
        let stored = [
            &l.ln1, &l.q, &l.k, &l.v, &l.att, &l.ln2, &l.gate, &l.up, &l.act,
        ];
        let (halves, stored_f32): (Vec<&ActStack<B>>, Vec<&ActStack<B>>) =
            stored.into_iter().partition(|s| s.is_bf16());
        let stacks = [
            &l.ln1_rstd,
            &l.q_raw,
            &l.k_raw,
            &l.q_rstd,
            &l.k_rstd,
            &l.lse,
            &l.att_proj,
            &l.resid_mid,
            &l.ln2_rstd,
            &l.mlp_out,
            &l.resid_out,
        ];
        let sc = &self.scratch;
        let scratch = [
            &sc.dresidual,
            &sc.dln,
            &sc.dact,
            &sc.dgate,
            &sc.dup,
            &sc.datt,
            &sc.dq,
            &sc.dk,
            &sc.dv,
            &sc.dq_raw,
            &sc.dk_raw,
        ];
        let whole = [
            &l.encoded,
            &l.stage,
            &self.mask,
            &self.cos,
            &self.sin,
            &self.lnf,
            &self.lnf_rstd,
            &self.logits,
            &self.log_prob,
            &self.entropy,
            &self.coeffs,
            &self.entropy_coeffs,
            &self.dlogits,
        ];
        let floats = stacks.iter().map(|s| s.len()).sum::<usize>()
            + stored_f32.iter().map(|s| s.len()).sum::<usize>()
            + scratch.iter().map(|s| s.0.len()).sum::<usize>()
            + whole.iter().map(|b| b.len()).sum::<usize>()
            + self.host_mask.len()
            + self.lora.as_ref().map_or(0, LoraActs::elements);
        let ids = self.ids.len()
            + self.positions.len()
            + self.targets.iter().map(|t| t.len()).sum::<usize>();
        ArenaElements {
            f32s: floats as u64,
            bf16s: halves.iter().map(|s| s.len() as u64).sum(),
            ids: ids as u64,
        }
    }

    /// Allocates the arena for `batch` sequences of `seq` tokens of a model with `spec`,
    /// keeping the LM head's output as `head` says.
    ///
    /// # Errors
    /// [`ModelError::BatchShape`] for an empty or overflowing shape,
    /// [`ModelError::InvalidValue`] for a chunk of 0 rows; backend allocation failures.
    pub fn with_head(
        backend: &B,
        spec: &ModelSpec,
        batch: usize,
        seq: usize,
        head: HeadMode,
    ) -> Result<Self, ModelError> {
        Self::planned(backend, spec, batch, seq, head, false, ActLayout::F32)
    }

    /// [`Activations::with_head`], keeping every layer's activations or, `checkpointed`,
    /// one layer's and the residual stream: the backward pass recomputes each layer's
    /// forward from its input first (activation checkpointing: the same gradients, bit for
    /// bit, for about `(L − 1)·N·(3C + 3·Hq·D + 4·Hkv·D + 3I)` fewer floats and one more
    /// forward pass of the layers); stored as `layout` says (`act_dtype.rs`).
    ///
    /// # Errors
    /// As [`Activations::with_head`].
    pub fn planned(
        backend: &B,
        spec: &ModelSpec,
        batch: usize,
        seq: usize,
        head: HeadMode,
        checkpointed: bool,
        layout: ActLayout,
    ) -> Result<Self, ModelError> {
        if batch == 0 || seq == 0 {
            return Err(ModelError::BatchShape { batch, seq });
        }
        let n = numel(batch, seq, &[batch, seq])?;
        let (head, chunk_rows) = match head {
            HeadMode::Full => (HeadMode::Full, n),
            HeadMode::Chunked { rows: 0 } => {
                return Err(ModelError::InvalidValue {
                    what: "LM head chunk rows".into(),
                    value: 0.0,
                    expected: ">= 1",
                });
            }
            HeadMode::Chunked { rows } => {
                let rows = rows.min(n);
                (HeadMode::Chunked { rows }, rows)
            }
        };
        let targets = head_chunks(n, chunk_rows)
            .map(|(_, rows)| backend.alloc_ids(rows))
            .collect::<Result<Vec<_>, _>>()?;
        let (c, v) = (spec.hidden, spec.vocab);
        let alloc = |dims: &[usize]| -> Result<B::Buffer, ModelError> {
            Ok(backend.alloc(numel(batch, seq, dims)?)?)
        };
        Ok(Self {
            batch,
            seq,
            ids: backend.alloc_ids(n)?,
            positions: backend.alloc_ids(n)?,
            mask: alloc(&[n])?,
            host_mask: vec![0.0; n],
            segments: None,
            unpack: None,
            cos: alloc(&[n, spec.head_dim / 2])?,
            sin: alloc(&[n, spec.head_dim / 2])?,
            layers: LayerBuffers::new(backend, spec, (batch, seq, n), checkpointed, layout)?,
            lnf: alloc(&[n, c])?,
            lnf_rstd: alloc(&[n])?,
            head,
            chunk_rows,
            logits: alloc(&[chunk_rows, v])?,
            targets,
            log_prob: alloc(&[n])?,
            entropy: alloc(&[n])?,
            coeffs: alloc(&[n])?,
            entropy_coeffs: alloc(&[n])?,
            dlogits: alloc(&[chunk_rows, v])?,
            scratch: BackwardScratch::new(backend, spec, n)?,
            lora: None,
        })
    }

    /// `(batch, seq)` this arena was planned for.
    pub fn shape(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }

    /// How this arena keeps the LM head's output (a chunk of more rows than the arena
    /// has tokens is reported as `N` rows).
    pub fn head_mode(&self) -> HeadMode {
        self.head
    }

    /// `Ok` with whole logits, else [`ModelError::ChunkedLogits`] naming `what` needed them.
    pub(crate) fn require_full(&self, what: &'static str) -> Result<(), ModelError> {
        match self.head {
            HeadMode::Full => Ok(()),
            HeadMode::Chunked { rows } => Err(ModelError::ChunkedLogits { what, rows }),
        }
    }

    /// Elements of the arena's logits buffer: `N · V` with whole logits, `rows · V` with a
    /// chunked head. The ∂L/∂logits buffer has the same length.
    pub fn logits_buffer_len(&self) -> usize {
        self.logits.len()
    }

    /// The logits `[batch, seq, vocab]` of the last forward pass (zeros before the first).
    /// A chunked arena keeps no whole logits: there this is an empty view (and
    /// [`Model::download_logits`](super::Model::download_logits) an error).
    pub fn logits(&self) -> Tensor<'_, B> {
        match self.head {
            HeadMode::Full => View::whole(&self.logits),
            // An empty window always lies in the buffer; the fallback is unreachable.
            HeadMode::Chunked { .. } => {
                View::new(&self.logits, 0, 0).unwrap_or_else(|_| View::whole(&self.logits))
            }
        }
    }

    /// The per-token log-probs `[batch, seq]` of the last
    /// [`Model::log_prob_entropy`](super::Model::log_prob_entropy) (zeros before the first).
    pub fn log_probs(&self) -> Tensor<'_, B> {
        View::whole(&self.log_prob)
    }

    /// The per-token entropies `[batch, seq]` of the last
    /// [`Model::log_prob_entropy`](super::Model::log_prob_entropy) (zeros before the first).
    pub fn entropies(&self) -> Tensor<'_, B> {
        View::whole(&self.entropy)
    }

    /// The loss head's coefficient buffers `[batch, seq]`, ∂L/∂logπ and ∂L/∂H per token,
    /// for a loss computed on the device to write before
    /// [`Model::backward_from_device_log_prob_grads`](super::Model::backward_from_device_log_prob_grads);
    /// with them, the log-probs and entropies the loss reads.
    pub fn loss_buffers(&mut self) -> LossBuffers<'_, B> {
        LossBuffers {
            log_probs: View::whole(&self.log_prob),
            entropies: View::whole(&self.entropy),
            coeffs: crate::backend::ViewMut::whole(&mut self.coeffs),
            entropy_coeffs: crate::backend::ViewMut::whole(&mut self.entropy_coeffs),
        }
    }
}

/// [`Activations::loss_buffers`]: what a device loss reads and writes, `[batch, seq]` each.
pub struct LossBuffers<'a, B: Backend> {
    /// logπ of each position's target.
    pub log_probs: Tensor<'a, B>,
    /// Entropy of each position's distribution.
    pub entropies: Tensor<'a, B>,
    /// ∂L/∂logπ per position (the loss head's input).
    pub coeffs: crate::backend::TensorMut<'a, B>,
    /// ∂L/∂H per position (the loss head's input with an entropy term).
    pub entropy_coeffs: crate::backend::TensorMut<'a, B>,
}

/// One whole buffer of the [`BackwardScratch`], with short views (`sc.dln.r()`,
/// `sc.dln.w()`) so that a backward op with scratch operands fits one line.
#[derive(Debug)]
pub(crate) struct Scratch<T>(pub(crate) T);

impl<T: DeviceBuffer> Scratch<T> {
    /// The whole buffer, read-only.
    pub(crate) fn r(&self) -> View<'_, T> {
        View::whole(&self.0)
    }

    /// The whole buffer, writable.
    pub(crate) fn w(&mut self) -> ViewMut<'_, T> {
        ViewMut::whole(&mut self.0)
    }
}

/// Backward intermediates of one layer, `N = batch · seq` tokens, reused across layers:
/// about `N · (2C + 3I + 3·Hq·D + 4·Hkv·D)` floats.
#[derive(Debug)]
pub(crate) struct BackwardScratch<B: Backend> {
    /// `[N, C]` gradient of the residual stream at the current point.
    pub(crate) dresidual: Scratch<B::Buffer>,
    /// `[N, C]` gradient of an RMSNorm output (final, post-attention, input norm).
    pub(crate) dln: Scratch<B::Buffer>,
    /// `[N, I]` gradients of `silu(gate)·up`, gate and up.
    pub(crate) dact: Scratch<B::Buffer>,
    pub(crate) dgate: Scratch<B::Buffer>,
    pub(crate) dup: Scratch<B::Buffer>,
    /// `[N, Hq·D]` gradient of the attention output.
    pub(crate) datt: Scratch<B::Buffer>,
    /// `[N, Hq·D]`, `[N, Hkv·D]` gradients of q, k (after RoPE, then before it) and v.
    pub(crate) dq: Scratch<B::Buffer>,
    pub(crate) dk: Scratch<B::Buffer>,
    pub(crate) dv: Scratch<B::Buffer>,
    /// `[N, Hq·D]`, `[N, Hkv·D]` gradients of the q/k projections before their RMSNorm
    /// (Qwen3 only, else empty).
    pub(crate) dq_raw: Scratch<B::Buffer>,
    pub(crate) dk_raw: Scratch<B::Buffer>,
}

impl<B: Backend> BackwardScratch<B> {
    /// Allocates the scratch for `n` tokens (`n` already checked not to overflow the
    /// activations, which are larger).
    pub(crate) fn new(backend: &B, spec: &ModelSpec, n: usize) -> Result<Self, ModelError> {
        let (c, i, qd, kvd) = (spec.hidden, spec.intermediate, spec.q_dim(), spec.kv_dim());
        let raw = usize::from(spec.qk_norm);
        let alloc = |len: usize| backend.alloc(len).map(Scratch);
        Ok(Self {
            dresidual: alloc(n * c)?,
            dln: alloc(n * c)?,
            dact: alloc(n * i)?,
            dgate: alloc(n * i)?,
            dup: alloc(n * i)?,
            datt: alloc(n * qd)?,
            dq: alloc(n * qd)?,
            dk: alloc(n * kvd)?,
            dv: alloc(n * kvd)?,
            dq_raw: alloc(raw * n * qd)?,
            dk_raw: alloc(raw * n * kvd)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_chunks_cover_every_token_once() {
        let all = |n, rows| head_chunks(n, rows).collect::<Vec<_>>();
        assert_eq!(all(7, 3), [(0, 3), (3, 3), (6, 1)]);
        assert_eq!(all(6, 3), [(0, 3), (3, 3)]);
        assert_eq!(all(2, 5), [(0, 2)]);
        assert_eq!(all(3, 1), [(0, 1), (1, 1), (2, 1)]);
        assert_eq!(all(0, 4), []);
    }

    #[test]
    fn auto_policy_chunks_above_256_mib_of_logits() {
        // 256 MiB / 4 B = 67 108 864 floats; / 151 936 = 441.7 rows; / 97 = 691 843.9.
        assert_eq!(HeadMode::auto_rows(151_936), 441);
        assert_eq!(HeadMode::auto_rows(97), 691_843);
        assert_eq!(HeadMode::auto_rows(0), 67_108_864);
        assert_eq!(HeadMode::auto_rows(100_000_000), 1);
        assert_eq!(HeadMode::auto(441, 151_936), HeadMode::Full);
        assert_eq!(HeadMode::auto(14, 97), HeadMode::Full);
        // 8 × 1024 tokens: 5.0 GB of logits.
        assert_eq!(
            HeadMode::auto(8 * 1024, 151_936),
            HeadMode::Chunked { rows: 441 }
        );
        // Exactly 256 MiB stays whole; one more token chunks.
        assert_eq!(HeadMode::auto(1 << 20, 64), HeadMode::Full);
        assert_eq!(
            HeadMode::auto((1 << 20) + 1, 64),
            HeadMode::Chunked { rows: 1 << 20 }
        );
        assert_eq!(
            HeadMode::auto(usize::MAX, 2),
            HeadMode::Chunked { rows: 1 << 25 }
        );
    }
}
