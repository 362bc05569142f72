//! Rollout: `n` sampled responses per prompt, with the per-token log-probs and entropies
//! of the sampling distribution (docs/algorithms.md §1 computes HWE tokens from these entropies).

use crate::backend::Backend;
use crate::model::{GenerateOutput, GenerateRequest, Sampling, WeightDtype};

use crate::parallel::wire::{Reader, WireError, Writer};
use crate::trainer::TrainError;
use crate::trainer::actor::{Actor, ActorGenerator, PromptVision};

/// One prompt of a step, prepared for the model.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptItem {
    /// Index of the example in its dataset.
    pub example: usize,
    /// The prompt's `global_id`.
    pub global_id: String,
    /// Token ids of the prompt the policy is trained on.
    pub train_prompt: Vec<u32>,
    /// Token ids of each sample's rollout prompt (`n` of them; all equal to
    /// `train_prompt` unless graded system prompts are on).
    pub rollout_prompts: Vec<Vec<u32>>,
    /// The prompt's images and videos (`None`: text).
    pub vision: PromptVision,
}

/// One generated response.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Response {
    /// New token ids (EOS included when it ended the response).
    pub tokens: Vec<u32>,
    /// Sampler log-prob of each token.
    pub log_probs: Vec<f32>,
    /// Entropy of the sampling distribution at each token.
    pub entropies: Vec<f32>,
    /// Ended by EOS (else truncated at the length limit).
    pub finished: bool,
    /// A multi-turn episode's: per token, whether the model wrote it (the rest are the
    /// chat template's and the tools', which are not the policy's actions). `None`: every
    /// token is the model's.
    pub from_model: Option<Vec<bool>>,
    /// A multi-turn episode's interaction score: the sum of its turns' (`None`: no
    /// interaction answered it).
    pub interaction: Option<f64>,
    /// A multi-turn episode's tool calls (0 for a single turn).
    pub tool_calls: usize,
}

impl Response {
    /// Whether token `t` is the model's.
    pub fn is_model_token(&self, t: usize) -> bool {
        self.from_model.as_ref().is_none_or(|m| m[t])
    }

    /// The model's tokens, in order (an episode's tool turns left out).
    pub fn model_tokens(&self) -> Vec<u32> {
        self.tokens
            .iter()
            .enumerate()
            .filter(|&(t, _)| self.is_model_token(t))
            .map(|(_, &id)| id)
            .collect()
    }

    /// The entropies at the model's tokens.
    pub fn model_entropies(&self) -> impl Iterator<Item = f32> + '_ {
        self.entropies
            .iter()
            .enumerate()
            .filter(|&(t, _)| self.is_model_token(t))
            .map(|(_, &h)| h)
    }

    /// The model's tokens (the response's length as the algorithms count it).
    pub fn model_len(&self) -> usize {
        self.from_model
            .as_ref()
            .map_or(self.tokens.len(), |m| m.iter().filter(|&&b| b).count())
    }
}

/// How responses are generated.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutParams {
    /// New tokens per response at most.
    pub max_new_tokens: usize,
    /// A response ends after any of these ids.
    pub eos_ids: Vec<u32>,
    /// Greedy or sampled.
    pub sampling: Sampling,
    /// Base seed: sequence `i` of a call always gets the same stream.
    pub seed: u64,
    /// Sequences generated together (bounds the KV cache).
    pub chunk: usize,
    /// Decode weights: f32 or a bf16 copy.
    pub weight_dtype: WeightDtype,
    /// Decode passes padded to buckets and, on CUDA, captured as graphs and replayed
    /// (`worker.rollout.cuda_graphs`).
    pub cuda_graphs: bool,
    /// The KV cache's number format (`worker.rollout.kv_cache_dtype`).
    pub kv_cache_dtype: crate::model::KvCacheDtype,
    /// The KV pool's cap in blocks (the memory plan's; `None`: uncapped).
    pub max_kv_blocks: Option<usize>,
    /// A data-parallel run's ranks: each generates its share of the chunks and every
    /// rank gets every response (`None`: this process generates all).
    pub ranks: Option<crate::parallel::Ranks>,
}

/// Generates `prompts` (each once, with `vision[i]` the images of prompt `i`; empty for
/// text) with `params.chunk` sequences decoding at once: text prompts through one rollout
/// engine of that many slots (a sequence takes a slot as soon as one frees), multimodal
/// prompts chunk by chunk. Chunk `c` (prompts `c·chunk ..`) samples from seed
/// `seed ^ c·φ`, stream `i` for its `i`-th prompt, either way, so the tokens do not depend
/// on the path. `on_chunk` is told how many sequences are done (progress).
///
/// # Errors
/// Generation failures.
pub fn generate_all<B: Backend>(
    model: &Actor<B>,
    prompts: &[Vec<u32>],
    vision: &[PromptVision],
    params: &RolloutParams,
    mut on_chunk: impl FnMut(usize),
) -> Result<Vec<Response>, TrainError> {
    let chunk = params.chunk.max(1);
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    // one transpose of the weights for every chunk
    let generator = model
        .generator_with(params.weight_dtype)?
        .decode_buckets(params.cuda_graphs)
        .kv_cache_dtype(params.kv_cache_dtype)
        .max_kv_blocks(params.max_kv_blocks);
    let requests: Vec<GenerateRequest> = prompts
        .chunks(chunk)
        .enumerate()
        .map(|(c, part)| GenerateRequest {
            prompts: part.to_vec(),
            max_new_tokens: params.max_new_tokens,
            eos_ids: params.eos_ids.clone(),
            sampling: params.sampling,
            // a distinct seed per chunk: stream i of chunk c is sequence c·chunk + i
            seed: params.seed ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        })
        .collect();
    // requests `range`, on this process
    let mut run = |range: std::ops::Range<usize>| -> Result<Vec<GenerateOutput>, TrainError> {
        match &generator {
            ActorGenerator::Text(g) if vision.iter().all(Option::is_none) => {
                let done = range.start * chunk;
                Ok(g.generate_many(&requests[range], chunk, |d| on_chunk(done + d))?)
            }
            _ => {
                let mut outputs = Vec::with_capacity(range.len());
                for c in range {
                    let request = &requests[c];
                    let first = c * chunk;
                    let part_vision = vision
                        .get(first..(first + request.prompts.len()).min(vision.len()))
                        .unwrap_or(&[]);
                    outputs.push(generator.generate(request, part_vision)?);
                    on_chunk(first + request.prompts.len());
                }
                Ok(outputs)
            }
        }
    };
    let Some(ranks) = &params.ranks else {
        let outputs = run(0..requests.len())?;
        return Ok(outputs.into_iter().flat_map(responses_of).collect());
    };
    // a data-parallel run: each rank generates its block of chunks (a chunk's streams do
    // not depend on who generates it), every rank gets every response
    let count = requests.len();
    let mine: Vec<usize> = (0..count)
        .filter(|&c| ranks.owner(c, count) == ranks.rank())
        .collect();
    let first = mine.first().copied().unwrap_or(0);
    let mut local: Option<std::vec::IntoIter<GenerateOutput>> = None;
    let units = ranks.map_units(count, |c| {
        if local.is_none() {
            local = Some(run(first..first + mine.len())?.into_iter());
        }
        let output = local
            .as_mut()
            .and_then(Iterator::next)
            .ok_or_else(|| TrainError::Internal(format!("rollout chunk {c} was not generated")))?;
        Ok(encode_responses(&responses_of(output)))
    })?;
    let mut out = Vec::with_capacity(prompts.len());
    for bytes in &units {
        out.extend(decode_responses(bytes).map_err(|e| e.at(ranks.rank()))?);
    }
    on_chunk(out.len());
    Ok(out)
}

/// The responses of one generation output, in order.
fn responses_of(g: GenerateOutput) -> Vec<Response> {
    g.tokens
        .into_iter()
        .zip(g.log_probs)
        .zip(g.entropies)
        .zip(g.finished_by_eos)
        .map(|(((tokens, log_probs), entropies), finished)| Response {
            tool_calls: 0,
            tokens,
            log_probs,
            entropies,
            finished,
            from_model: None,
            interaction: None,
        })
        .collect()
}

/// `responses` as bytes for the other ranks (every field; floats as bits).
pub fn encode_responses(responses: &[Response]) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(responses.len() as u64);
    for r in responses {
        w.u32s(&r.tokens);
        w.f32s(&r.log_probs);
        w.f32s(&r.entropies);
        w.u8(u8::from(r.finished));
        match &r.from_model {
            None => w.u8(0),
            Some(m) => {
                w.u8(1);
                w.bytes(&m.iter().map(|&b| u8::from(b)).collect::<Vec<u8>>());
            }
        }
        match r.interaction {
            None => w.u8(0),
            Some(x) => {
                w.u8(1);
                w.f64(x);
            }
        }
        w.u64(r.tool_calls as u64);
    }
    w.finish()
}

/// The responses [`encode_responses`] wrote.
///
/// # Errors
/// Malformed bytes.
pub fn decode_responses(bytes: &[u8]) -> Result<Vec<Response>, WireError> {
    let mut r = Reader::new(bytes);
    let count = r.u64()?;
    let mut out = Vec::new();
    for _ in 0..count {
        let tokens = r.u32s()?;
        let log_probs = r.f32s()?;
        let entropies = r.f32s()?;
        let finished = r.u8()? != 0;
        let from_model = match r.u8()? {
            0 => None,
            _ => Some(r.bytes()?.iter().map(|&b| b != 0).collect()),
        };
        let interaction = match r.u8()? {
            0 => None,
            _ => Some(r.f64()?),
        };
        let tool_calls = usize::try_from(r.u64()?)
            .map_err(|_| WireError("a tool-call count out of range".into()))?;
        out.push(Response {
            tokens,
            log_probs,
            entropies,
            finished,
            from_model,
            interaction,
            tool_calls,
        });
    }
    r.end()?;
    Ok(out)
}

/// Rolls out every item's `rollout_prompts` (item-major: rows `g·n … g·n + n − 1` are
/// item `g`'s samples).
///
/// # Errors
/// As [`generate_all`]; an item without exactly `n` rollout prompts.
pub fn rollout_items<B: Backend>(
    model: &Actor<B>,
    items: &[PromptItem],
    n: usize,
    params: &RolloutParams,
    on_chunk: impl FnMut(usize),
) -> Result<Vec<Response>, TrainError> {
    let mut prompts = Vec::with_capacity(items.len() * n);
    let mut vision = Vec::with_capacity(items.len() * n);
    for item in items {
        if item.rollout_prompts.len() != n {
            return Err(TrainError::Internal(format!(
                "prompt {} has {} rollout prompts, expected n = {n}",
                item.global_id,
                item.rollout_prompts.len()
            )));
        }
        prompts.extend(item.rollout_prompts.iter().cloned());
        vision.extend(std::iter::repeat_n(item.vision.clone(), n));
    }
    generate_all(model, &prompts, &vision, params, on_chunk)
}
