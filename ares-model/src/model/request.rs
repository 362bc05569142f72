//! What a generation request is and gives back: [`GenerateRequest`], [`GenerateOutput`],
//! [`GenerateError`], the multimodal side [`PromptVision`], and the per-sequence output the
//! rollout engine and static batching fill ([`SequenceOutput`]).

use super::{ModelError, Sampling};
use crate::backend::{Backend, BackendError, Tensor};

/// A generation request: a batch of prompts and how to continue them.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Prompt token ids, unpadded, one or more tokens each (padding is internal).
    pub prompts: Vec<Vec<u32>>,
    /// Tokens to generate at most per prompt (0: return empty outputs).
    pub max_new_tokens: usize,
    /// A sequence ends after producing any of these ids (included in its tokens).
    pub eos_ids: Vec<u32>,
    /// Greedy or sampled decoding.
    pub sampling: Sampling,
    /// Seed of the sampling streams (one per prompt, from the seed and the prompt's index,
    /// so prompt `i` gets the same tokens in any batch at index `i`); unused by greedy.
    pub seed: u64,
}

/// What [`Model::generate`](super::Model::generate) produced, one entry per prompt.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerateOutput {
    /// New token ids (the prompt excluded), the EOS id included if one ended the sequence.
    pub tokens: Vec<Vec<u32>>,
    /// Log-prob of each new token under the sampling distribution `softmax(logits /
    /// temperature)` (temperature 1 for greedy), before top-k/top-p truncation.
    pub log_probs: Vec<Vec<f32>>,
    /// Entropy (nats) of that distribution at each new token, before truncation.
    pub entropies: Vec<Vec<f32>>,
    /// Whether the sequence ended with an EOS id (else it hit `max_new_tokens`).
    pub finished_by_eos: Vec<bool>,
}

impl GenerateOutput {
    /// The output of sequences in order.
    pub(crate) fn from_sequences(seqs: Vec<SequenceOutput>) -> Self {
        let mut out = Self::default();
        for s in seqs {
            out.tokens.push(s.tokens);
            out.log_probs.push(s.log_probs);
            out.entropies.push(s.entropies);
            out.finished_by_eos.push(s.finished_by_eos);
        }
        out
    }
}

/// Why a generation request or cached forward pass failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GenerateError {
    /// The request has no prompt.
    #[error("generate: no prompts")]
    NoPrompts,
    /// A prompt has no token.
    #[error("generate: prompt {index} is empty")]
    EmptyPrompt {
        /// Index of the prompt.
        index: usize,
    },
    /// A prompt or EOS token id is not below the vocabulary size.
    #[error("generate: {what} id {id} is out of range for vocab_size {vocab}")]
    TokenOutOfRange {
        /// Which id (`prompt 3 token 5`, `eos_ids[0]`).
        what: String,
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A prompt plus the new tokens would need positions past the model's
    /// `max_position_embeddings` (the RoPE table), or more memory than can be addressed.
    #[error(
        "generate: prompt {index} of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds the maximum sequence length {max_len}"
    )]
    TooLong {
        /// Index of the prompt.
        index: usize,
        /// Its length.
        prompt_len: usize,
        /// The requested new tokens.
        max_new_tokens: usize,
        /// The longest sequence the model supports.
        max_len: usize,
    },
    /// Invalid sampling parameters.
    #[error("generate: invalid sampling: {0}")]
    Sampling(String),
    /// No token can be picked from a row of logits (NaN, +∞, or all −∞).
    #[error("generate: sequence {sequence}, new token {step}: logits are not finite")]
    NonFiniteLogits {
        /// Index of the sequence.
        sequence: usize,
        /// Index of the new token.
        step: usize,
    },
    /// The cache holds another number of sequences than the input.
    #[error("KV cache holds {cache} sequences, the input has {input}")]
    CacheBatch {
        /// Sequences in the cache.
        cache: usize,
        /// Sequences in the input.
        input: usize,
    },
    /// The new tokens do not fit in the cache.
    #[error("KV cache of {max_len} slots holds {len}, {new} new tokens do not fit")]
    CacheFull {
        /// Filled slots.
        len: usize,
        /// New tokens per sequence.
        new: usize,
        /// Slots per sequence.
        max_len: usize,
    },
    /// A sequence cannot get the KV blocks it needs even with every other sequence
    /// preempted: the engine's `max_blocks` is too small for it.
    #[error(
        "KV cache budget of {budget} blocks × {block_size} slots cannot hold sequence {sequence} ({slots} slots); raise max_blocks"
    )]
    KvBudget {
        /// Index of the sequence.
        sequence: usize,
        /// Slots it needs now.
        slots: usize,
        /// The engine's block budget.
        budget: usize,
        /// Slots per block.
        block_size: usize,
    },
    /// The model or backend failed.
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl From<BackendError> for GenerateError {
    fn from(e: BackendError) -> Self {
        Self::Model(e.into())
    }
}

/// The multimodal side of a generation request (Qwen2-VL family): the embeddings that
/// replace prompt tokens, and M-RoPE positions in place of `0..len`.
pub struct PromptVision<'a, B: Backend> {
    /// Embeddings `[k, hidden]` replacing prompt tokens (image / video placeholders).
    pub embeds: Tensor<'a, B>,
    /// For each row of `embeds`, `(prompt, token index in that prompt)`.
    pub rows: &'a [(usize, usize)],
    /// Per prompt, the M-RoPE cos and sin `[len, head_dim/2]` of its tokens.
    pub rope: &'a [(Vec<f32>, Vec<f32>)],
    /// Per prompt, `rope_delta`: new token `k` (from 0) sits at position `len + k +
    /// rope_delta` on all three axes (a text position).
    pub rope_deltas: &'a [i64],
    /// Per prompt, the first prompt whose embedding rows are the same values (itself when
    /// none before is; `usize::MAX` for a prompt without embedding rows), as the caller knows it (the VL generator runs the tower once per
    /// image set); `None`: no sharing. Prompts equal in ids, embeddings, M-RoPE tables and
    /// delta then share one prefill.
    pub same_embeds: Option<&'a [usize]>,
}

/// One sequence's new tokens, their log-probs and entropies so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct SequenceOutput {
    pub(crate) tokens: Vec<u32>,
    pub(crate) log_probs: Vec<f32>,
    pub(crate) entropies: Vec<f32>,
    pub(crate) finished_by_eos: bool,
}

impl SequenceOutput {
    /// Appends `pick` (a token, its log-prob and the entropy, one row of [`Picks`]) as the
    /// next new token of sequence `sequence`; returns whether the sequence has ended (an
    /// EOS id, or `max_new` tokens).
    ///
    /// [`Picks`]: super::picks::Picks
    pub(crate) fn push(
        &mut self,
        pick: (u32, f32, f32),
        request: (&[u32], usize),
        sequence: usize,
        on_token: &mut dyn FnMut(usize, u32),
    ) -> Result<bool, GenerateError> {
        let (eos_ids, max_new) = request;
        let (id, log_prob, entropy) = pick;
        if id == u32::MAX {
            let step = self.tokens.len();
            return Err(GenerateError::NonFiniteLogits { sequence, step });
        }
        self.tokens.push(id);
        on_token(sequence, id);
        self.log_probs.push(log_prob);
        self.entropies.push(entropy);
        self.finished_by_eos = eos_ids.contains(&id);
        Ok(self.finished_by_eos || self.tokens.len() >= max_new)
    }
}

/// The distinct multimodal prompts of `prompts` (indices of their first occurrences, in
/// order) and, for every prompt, the index of its distinct prompt: two prompts are equal when their ids, their
/// embedding rows (by the caller's `same_embeds`), M-RoPE tables and deltas are; without
/// `same_embeds` every prompt is its own.
pub(crate) fn unique_vision_prompts<B: Backend>(
    prompts: &[Vec<u32>],
    v: &PromptVision<'_, B>,
) -> (Vec<usize>, Vec<usize>) {
    let Some(same) = v.same_embeds else {
        return ((0..prompts.len()).collect(), (0..prompts.len()).collect());
    };
    let mut unique: Vec<usize> = Vec::new();
    let mut of_row = Vec::with_capacity(prompts.len());
    for b in 0..prompts.len() {
        let equal = |&a: &usize| {
            prompts[a] == prompts[b]
                && same.get(a) == same.get(b)
                && v.rope_deltas[a] == v.rope_deltas[b]
                && v.rope[a] == v.rope[b]
        };
        match unique.iter().position(equal) {
            Some(k) => of_row.push(k),
            None => {
                of_row.push(unique.len());
                unique.push(b);
            }
        }
    }
    (unique, of_row)
}
