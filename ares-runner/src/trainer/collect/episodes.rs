//! The training rollout as multi-turn episodes (`worker.rollout.multi_turn`): every sample
//! is a [`crate::tools::episode`] trajectory. Text episodes run in one rollout engine that
//! keeps each turn's KV blocks: when a turn ends, its tool calls run and the next turn is
//! queued at once, prefilling only the tool's answer ([`Engine::continue_with`]).
//! Vision-language episodes do the same in an engine per chunk of rows that holds their
//! images: a conversation keeps its first turn's images and M-RoPE positions, and the
//! tool turns after them are text at `len + rope_delta` (transformers' rule).
//!
//! A response is the model's tokens as generated with the template's and tools' tokens
//! between its turns, `from_model` marking which are the model's: the step's mask holds
//! those alone, so loss, entropy, HWE, KL and length see the model's tokens only. Tool and
//! template tokens carry no sampler log-prob or entropy (0, masked).
//! `data.max_response_length` bounds the whole trajectory after the prompt.
//!
//! Streams: turn `t` of row `j` samples from stream `(seed ^ t·κ ^ c·φ, i)` with `c, i` the
//! chunk and place of row `j` (as [`crate::trainer::collect::rollout::generate_all`] numbers them), so turn 0
//! samples as the single-turn rollout and a row's tokens do not depend on when its tools
//! answered.

use serde_json::Value as Json;

use std::collections::HashMap;

use ares_model::model::{Engine, EngineConfig, EngineRequest, GenerateRequest, Generator};
use ares_model::vision::model::{VisionBatch, VlGenerator};

use crate::backend::Backend;
use crate::hf::tokenizer::Tokenizer;
use crate::parallel::wire::{Reader, WireError, Writer};
use crate::tools::episode::{EpisodeSettings, Next, RowKwargs, TurnEnd, after_turn};
use crate::trainer::TrainError;
use crate::trainer::actor::{Actor, ActorGenerator, PromptVision, no_vision};
use crate::trainer::collect::rollout::{
    PromptItem, Response, RolloutParams, decode_responses, encode_responses,
};

/// Threads that run a round's tool calls at most.
const TOOL_THREADS: usize = 16;

/// What episodes are run with.
#[derive(Debug, Clone, Copy)]
pub struct EpisodeTools<'a> {
    /// How turns go on (template, tools, call format, turns at most).
    pub settings: EpisodeSettings<'a>,
    /// Decodes turns and encodes the template's continuations.
    pub tokenizer: &'a Tokenizer,
}

/// What the episodes of a rollout did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EpisodeCounts {
    /// Episodes.
    pub episodes: usize,
    /// Model turns, over all episodes.
    pub turns: usize,
    /// Tool calls run.
    pub calls: usize,
    /// Of them, those that failed (malformed, unknown tool, tool error).
    pub failed_calls: usize,
    /// Tokens prefilled (a prompt shared by samples once; a text episode's later turns
    /// their new tokens only).
    pub prefill_tokens: usize,
    /// What re-prefilling each turn's whole trajectory for each sample would prefill.
    pub conversation_tokens: usize,
    /// Episodes the interaction's failure ended.
    pub interaction_errors: usize,
    /// Turns the interaction answered.
    pub interaction_turns: usize,
}

struct Row {
    ids: Vec<u32>,
    /// The prompt's images and videos (every turn of the episode sees them).
    vision: PromptVision,
    /// The data row's `extra_info.tools_kwargs` and `extra_info.interaction_kwargs`.
    tools_kwargs: Option<serde_json::Map<String, Json>>,
    interaction_kwargs: Option<Json>,
    /// Tokens of the tool turn appended since the last generation.
    appended: usize,
    /// Model turns so far.
    turns: usize,
    response: Response,
    from_model: Vec<bool>,
    messages: Vec<Json>,
    done: bool,
}

/// Where an item's episodes start from: its conversation and what its data row gives the
/// tools.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EpisodeStart {
    /// The prompt's conversation (its rendering is the item's `rollout_prompts`).
    pub messages: Vec<Json>,
    /// The row's `extra_info.tools_kwargs`.
    pub tools_kwargs: Option<serde_json::Map<String, Json>>,
    /// The row's `extra_info.interaction_kwargs`.
    pub interaction_kwargs: Option<Json>,
}

/// Rolls out every item's `n` samples as episodes (item-major rows, as
/// [`crate::trainer::collect::rollout::rollout_items`]); `starts[g]` is item `g`'s conversation and tool
/// arguments. Round 0 samples as the
/// single-turn rollout does, so a model that calls no tool gives the same responses.
///
/// A vision-language prompt keeps its images and videos in every turn (the tool turns
/// are text).
///
/// # Errors
/// Items without `n` rollout prompts; generation, tokenizer and template errors (a template that cannot continue a conversation after tool messages).
pub fn rollout_episodes<B: Backend>(
    model: &Actor<B>,
    items: &[PromptItem],
    starts: &[EpisodeStart],
    n: usize,
    params: &RolloutParams,
    tools: &EpisodeTools<'_>,
    mut on_progress: impl FnMut(usize),
) -> Result<(Vec<Response>, EpisodeCounts), TrainError> {
    let mut rows = Vec::with_capacity(items.len() * n);
    for (item, start) in items.iter().zip(starts) {
        if item.rollout_prompts.len() != n {
            return Err(TrainError::Internal(format!(
                "prompt {} has {} rollout prompts, expected n = {n}",
                item.global_id,
                item.rollout_prompts.len()
            )));
        }
        for prompt in &item.rollout_prompts {
            rows.push(Row {
                ids: prompt.clone(),
                vision: item.vision.clone(),
                tools_kwargs: start.tools_kwargs.clone(),
                interaction_kwargs: start.interaction_kwargs.clone(),
                appended: 0,
                turns: 0,
                response: Response::default(),
                from_model: Vec::new(),
                messages: start.messages.clone(),
                done: false,
            });
        }
    }
    let generator = model
        .generator_with(params.weight_dtype)?
        .decode_buckets(params.cuda_graphs)
        .kv_cache_dtype(params.kv_cache_dtype)
        .max_kv_blocks(params.max_kv_blocks);
    let text = items.iter().all(|i| i.vision.is_none());
    // rows `offset..` of the rollout, here
    let mut run = |rows: &mut [Row], offset: usize| -> Result<EpisodeCounts, TrainError> {
        let mut counts = EpisodeCounts {
            episodes: rows.len(),
            ..EpisodeCounts::default()
        };
        let (c, p) = (&mut counts, &mut on_progress);
        match &generator {
            ActorGenerator::Text(g) if text => {
                engine_episodes(g, rows, offset, params, tools, c, p)?
            }
            ActorGenerator::Text(_) => return Err(no_vision("multi-turn rollout")),
            ActorGenerator::Vision(g) => {
                vision_engine_episodes(g, rows, offset, params, tools, c, p)?;
            }
        }
        Ok(counts)
    };
    let Some(ranks) = &params.ranks else {
        let counts = run(&mut rows, 0)?;
        return Ok((rows.into_iter().map(Row::into_response).collect(), counts));
    };
    // a data-parallel run: each rank plays its block of chunks (a row's streams are its
    // place in the rollout's), every rank gets every response and the summed counts
    let chunk = params.chunk.max(1);
    let count = rows.len().div_ceil(chunk);
    let mine: Vec<usize> = (0..count)
        .filter(|&c| ranks.owner(c, count) == ranks.rank())
        .collect();
    let (a, b) = match (mine.first(), mine.last()) {
        (Some(&f), Some(&l)) => (f * chunk, ((l + 1) * chunk).min(rows.len())),
        _ => (0, 0),
    };
    let mut local: Option<(Vec<Response>, EpisodeCounts)> = None;
    let units = ranks.map_units(count, |c| {
        if local.is_none() {
            let mut part: Vec<Row> = rows.drain(a..b).collect();
            let counts = run(&mut part, a)?;
            local = Some((part.into_iter().map(Row::into_response).collect(), counts));
        }
        let (responses, _) = local
            .as_ref()
            .ok_or_else(|| TrainError::Internal("episodes were not played".into()))?;
        let from = c * chunk - a;
        let to = ((c + 1) * chunk - a).min(responses.len());
        Ok(encode_responses(&responses[from..to]))
    })?;
    let bad = |e: WireError| TrainError::from(e.at(ranks.rank()));
    let mut responses = Vec::with_capacity(items.len() * n);
    for bytes in &units {
        responses.extend(decode_responses(bytes).map_err(bad)?);
    }
    // the counts summed over the ranks (sums of whole numbers: in any order)
    let mine = local.map(|(_, c)| c).unwrap_or_default();
    let mut w = Writer::default();
    for v in [
        mine.episodes,
        mine.turns,
        mine.calls,
        mine.failed_calls,
        mine.prefill_tokens,
        mine.conversation_tokens,
        mine.interaction_errors,
        mine.interaction_turns,
    ] {
        w.u64(v as u64);
    }
    let mut counts = EpisodeCounts::default();
    for bytes in ranks.all_gather(w.finish())? {
        let mut r = Reader::new(&bytes);
        let mut next = || -> Result<usize, TrainError> {
            Ok(usize::try_from(r.u64().map_err(bad)?).unwrap_or(usize::MAX))
        };
        counts.add(&EpisodeCounts {
            episodes: next()?,
            turns: next()?,
            calls: next()?,
            failed_calls: next()?,
            prefill_tokens: next()?,
            conversation_tokens: next()?,
            interaction_errors: next()?,
            interaction_turns: next()?,
        });
    }
    Ok((responses, counts))
}

impl Row {
    /// The row's response, with which of its tokens the model wrote.
    fn into_response(self) -> Response {
        let mut response = self.response;
        if self.from_model.iter().any(|&m| !m) {
            response.from_model = Some(self.from_model);
        }
        response
    }
}

/// The stream of turn `turn` of row `row` (see the module docs).
fn stream(params: &RolloutParams, row: usize, turn: usize) -> (u64, u64) {
    let chunk = params.chunk.max(1);
    let (c, i) = (row / chunk, row % chunk);
    let seed = params.seed
        ^ (turn as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)
        ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (seed, i as u64)
}

/// Text episodes through one engine of `params.chunk` slots that keeps each finished
/// turn's blocks: after each step, the turns that ended have their tool calls run and
/// their next turns queued over their kept blocks.
fn engine_episodes<B: Backend>(
    generator: &Generator<'_, B>,
    rows: &mut [Row],
    offset: usize,
    params: &RolloutParams,
    tools: &EpisodeTools<'_>,
    counts: &mut EpisodeCounts,
    on_progress: &mut impl FnMut(usize),
) -> Result<(), TrainError> {
    let request = EngineRequest {
        max_new_tokens: params.max_new_tokens,
        eos_ids: params.eos_ids.clone(),
        sampling: params.sampling,
        seed: params.seed,
    };
    let config = EngineConfig {
        max_seqs: params.chunk.max(1),
        decode_buckets: params.cuda_graphs,
        kv_cache_dtype: params.kv_cache_dtype,
        max_blocks: params.max_kv_blocks,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(generator, request, config)?;
    engine.keep_finished(true);
    let mut row_of = HashMap::new(); // sequence id → row
    for (j, row) in rows.iter().enumerate() {
        let id = engine.submit_with_stream(row.ids.clone(), stream(params, offset + j, 0))?;
        row_of.insert(id, j);
    }
    drive(
        &mut engine,
        rows,
        offset,
        row_of,
        params,
        tools,
        counts,
        on_progress,
    )
}

/// Vision-language episodes: an engine per `params.chunk` rows holding their prompts and
/// images (the tower run once per image set, round 0 sampling as the single-turn rollout),
/// each finished turn continued over its kept blocks as in [`engine_episodes`] — the
/// conversation keeps its first turn's images and M-RoPE positions, the tool turns are
/// text.
fn vision_engine_episodes<B: Backend>(
    generator: &VlGenerator<'_, B>,
    rows: &mut [Row],
    offset: usize,
    params: &RolloutParams,
    tools: &EpisodeTools<'_>,
    counts: &mut EpisodeCounts,
    on_progress: &mut impl FnMut(usize),
) -> Result<(), TrainError> {
    let chunk = params.chunk.max(1);
    let empty = VisionBatch::default();
    let total = rows.len();
    for c in 0..total.div_ceil(chunk) {
        let first = c * chunk;
        let part = &mut rows[first..(first + chunk).min(total)];
        let request = GenerateRequest {
            prompts: part.iter().map(|r| r.ids.clone()).collect(),
            max_new_tokens: params.max_new_tokens,
            eos_ids: params.eos_ids.clone(),
            sampling: params.sampling,
            // as generate_all seeds chunk c: stream i of it is row c·chunk + i's
            seed: stream(params, offset + first, 0).0,
        };
        let vision: Vec<PromptVision> = part.iter().map(|r| r.vision.clone()).collect();
        let batches: Vec<&VisionBatch> = vision
            .iter()
            .map(|v| v.as_deref().unwrap_or(&empty))
            .collect();
        generator.with_engine(&request, &batches, None, |engine| {
            engine.keep_finished(true);
            let row_of = (0..part.len()).map(|i| (i, i)).collect();
            drive(
                engine,
                part,
                offset + first,
                row_of,
                params,
                tools,
                counts,
                &mut |done| {
                    on_progress(first + done);
                },
            )
        })?;
    }
    Ok(())
}

/// Runs `engine` until it is idle: the turns that ended each step have their tool calls
/// run; an episode that goes on has its next turn queued over its kept blocks
/// ([`Engine::continue_with`]), one that ends has them freed. `row_of` maps the engine's
/// sequences to `rows` (row `j` is row `first + j` of the rollout, for its streams);
/// `on_progress` sees the episodes ended so far. Adds the prefill counts.
#[allow(clippy::too_many_arguments)] // the engine, its rows and the rollout's settings
fn drive<B: Backend>(
    engine: &mut Engine<'_, B>,
    rows: &mut [Row],
    first: usize,
    mut row_of: HashMap<usize, usize>,
    params: &RolloutParams,
    tools: &EpisodeTools<'_>,
    counts: &mut EpisodeCounts,
    on_progress: &mut dyn FnMut(usize),
) -> Result<(), TrainError> {
    let budget = params.max_new_tokens;
    counts.conversation_tokens += rows.iter().map(|r| r.ids.len()).sum::<usize>();
    let mut ended = 0;
    while !engine.is_idle() {
        let finished = engine.step()?;
        if finished.is_empty() {
            continue;
        }
        let mut outs: Vec<Option<Response>> = vec![None; rows.len()];
        let mut seq_of = vec![None; rows.len()];
        for f in finished {
            let j = row_of[&f.id];
            seq_of[j] = Some(f.id);
            outs[j] = Some(Response {
                tokens: f.tokens,
                log_probs: f.log_probs,
                entropies: f.entropies,
                finished: f.finished_by_eos,
                from_model: None,
                interaction: None,
                tool_calls: 0,
            });
        }
        let work: Vec<(&mut Row, Response)> = rows
            .iter_mut()
            .zip(outs)
            .filter_map(|(row, out)| out.map(|o| (row, o)))
            .collect();
        counts.add(&after_turns(work, budget, tools)?);
        for (j, row) in rows.iter().enumerate() {
            let Some(id) = seq_of[j] else {
                continue; // its turn goes on
            };
            row_of.remove(&id);
            if row.done {
                engine.release(id);
                ended += 1;
                continue;
            }
            let appended = &row.ids[row.ids.len() - row.appended..];
            let left = budget - row.response.tokens.len();
            let next =
                engine.continue_with(id, appended, stream(params, first + j, row.turns), left)?;
            row_of.insert(next, j);
            counts.conversation_tokens += row.ids.len();
        }
        on_progress(ended);
    }
    let stats = engine.stats();
    counts.prefill_tokens += stats.prefill_tokens + stats.extend_tokens;
    Ok(())
}

impl EpisodeCounts {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &EpisodeCounts) {
        self.episodes += other.episodes;
        self.turns += other.turns;
        self.calls += other.calls;
        self.failed_calls += other.failed_calls;
        self.prefill_tokens += other.prefill_tokens;
        self.conversation_tokens += other.conversation_tokens;
        self.interaction_errors += other.interaction_errors;
        self.interaction_turns += other.interaction_turns;
    }
}

/// [`step_row`] for each row and its new turn, the rows' tool calls side by side (a
/// program tool bounds its own copies); the turns and calls made.
fn after_turns(
    mut work: Vec<(&mut Row, Response)>,
    budget: usize,
    tools: &EpisodeTools<'_>,
) -> Result<EpisodeCounts, TrainError> {
    let per_thread = work.len().div_ceil(TOOL_THREADS).max(1);
    let results: Vec<Result<EpisodeCounts, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .chunks_mut(per_thread)
            .map(|chunk| {
                scope.spawn(move || {
                    let mut c = EpisodeCounts::default();
                    for (row, out) in chunk.iter_mut() {
                        let out = std::mem::take(out);
                        step_row(row, out, budget, tools, &mut c)?;
                    }
                    Ok(c)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(TrainError::Internal(
                        "a tool-running thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let mut counts = EpisodeCounts::default();
    for c in results {
        counts.add(&c?);
    }
    Ok(counts)
}

/// Adds a turn's output to its row: the model's tokens (cut at the budget), then, when the
/// turn called tools and another turn may follow, the tools' results through the template
/// ([`after_turn`]).
fn step_row(
    row: &mut Row,
    out: Response,
    budget: usize,
    tools: &EpisodeTools<'_>,
    counts: &mut EpisodeCounts,
) -> Result<(), TrainError> {
    row.turns += 1;
    counts.turns += 1;
    let left = budget - row.response.tokens.len();
    let cut = out.tokens.len().min(left);
    let ended = out.finished && out.tokens.len() <= left;
    let new = &out.tokens[..cut];
    push(row, new, &out.log_probs[..cut], &out.entropies[..cut], true);
    row.response.finished = ended;
    let turn = TurnEnd {
        tokens: new,
        ended,
        number: row.turns,
        left: budget - row.response.tokens.len(),
    };
    let kwargs = RowKwargs {
        tools: row.tools_kwargs.as_ref(),
        interaction: row.interaction_kwargs.as_ref(),
    };
    let after = after_turn(
        &tools.settings,
        tools.tokenizer,
        turn,
        &mut row.messages,
        kwargs,
    )?;
    counts.calls += after.calls;
    counts.failed_calls += after.failed_calls;
    row.response.tool_calls += after.calls;
    if let Some(r) = after.reward {
        counts.interaction_turns += 1;
        row.response.interaction = Some(row.response.interaction.unwrap_or(0.0) + r);
    }
    if let Some(e) = after.interaction_error {
        counts.interaction_errors += 1;
        // the first failure of the run is shown; the metric counts them all
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            eprintln!(
                "warning: the interaction failed and its episode ended ({e}); \
                 tools/interaction_error_ratio counts such episodes"
            );
        });
    }
    match after.next {
        Next::Stop(_) => row.done = true,
        Next::Append(ids) => {
            let zeros = vec![0.0f32; ids.len()];
            push(row, &ids, &zeros, &zeros, false);
            row.appended = ids.len();
        }
    }
    Ok(())
}

fn push(row: &mut Row, ids: &[u32], log_probs: &[f32], entropies: &[f32], from_model: bool) {
    row.response.tokens.extend_from_slice(ids);
    row.response.log_probs.extend_from_slice(log_probs);
    row.response.entropies.extend_from_slice(entropies);
    row.from_model
        .extend(std::iter::repeat_n(from_model, ids.len()));
    row.ids.extend_from_slice(ids);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::chat::{ChatTemplate, RenderOptions};
    use crate::tools::{Calculator, ToolBox, ToolCallFormat};
    use serde_json::json;
    use std::path::Path;

    fn fixtures() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../ares-model/tests/fixtures/tokenizer")
    }

    /// One turn of a real byte-level tokenizer and the Qwen2.5-style fixture template: a
    /// calculator call is run, and the tool turn is appended as the template writes it,
    /// outside the model's mask; an answer ends the episode; the budget is kept.
    #[test]
    fn a_turn_with_a_call_appends_the_tool_turn_outside_the_mask() {
        let tokenizer = Tokenizer::from_dir(&fixtures().join("qwen_style")).unwrap();
        let template = ChatTemplate::from_source(
            &std::fs::read_to_string(fixtures().join("templates/qwen25_like.jinja")).unwrap(),
            Default::default(),
        )
        .unwrap();
        let mut toolbox = ToolBox::default();
        toolbox.add(Box::new(Calculator)).unwrap();
        let schemas = toolbox.schemas();
        let tools = EpisodeTools {
            settings: EpisodeSettings {
                template: &template,
                options: RenderOptions {
                    tools: Some(&schemas),
                    ..RenderOptions::generation()
                },
                format: ToolCallFormat::Hermes,
                toolbox: &toolbox,
                max_turns: 4,
                interaction: None,
            },
            tokenizer: &tokenizer,
        };
        let im_end = tokenizer.encode("<|im_end|>", false).unwrap();
        assert_eq!(im_end.len(), 1);
        let turn = |text: &str| {
            let mut tokens = tokenizer.encode(text, false).unwrap();
            tokens.extend(&im_end);
            let k = tokens.len();
            Response {
                tokens,
                log_probs: vec![-0.5; k],
                entropies: vec![1.5; k],
                finished: true,
                from_model: None,
                interaction: None,
                tool_calls: 0,
            }
        };
        let new_row = || Row {
            ids: vec![1, 2, 3],
            vision: None,
            tools_kwargs: None,
            interaction_kwargs: None,
            appended: 0,
            turns: 0,
            response: Response::default(),
            from_model: Vec::new(),
            messages: vec![json!({"role": "user", "content": "What is 12*34?"})],
            done: false,
        };
        let call = turn(
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}\n</tool_call>",
        );
        let k = call.tokens.len();
        let mut counts = EpisodeCounts::default();
        let mut row = new_row();
        step_row(&mut row, call.clone(), 1000, &tools, &mut counts).unwrap();
        assert!(!row.done && row.response.finished);
        assert_eq!((counts.calls, counts.failed_calls), (1, 0));
        let appended = tokenizer.decode(&row.response.tokens[k..], false).unwrap();
        assert_eq!(
            appended,
            "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let n_tool = row.response.tokens.len() - k;
        assert!(row.from_model[..k].iter().all(|&m| m));
        assert!(row.from_model[k..].iter().all(|&m| !m));
        assert_eq!(row.response.entropies[k..], vec![0.0; n_tool][..]);
        assert_eq!(row.ids.len(), 3 + k + n_tool);
        assert_eq!(row.appended, n_tool);
        // the answer ends the episode
        step_row(&mut row, turn("\\boxed{408}"), 1000, &tools, &mut counts).unwrap();
        assert!(row.done && row.response.finished);
        assert_eq!(row.messages.len(), 4);

        // the last turn allowed: the call is not run
        let mut row = new_row();
        row.turns = tools.settings.max_turns - 1;
        step_row(&mut row, call.clone(), 1000, &tools, &mut counts).unwrap();
        assert!(row.done && row.response.tokens.len() == k && counts.calls == 1);
        // the budget cuts the turn: not finished, nothing run
        let mut row = new_row();
        step_row(&mut row, call.clone(), 5, &tools, &mut counts).unwrap();
        assert!(row.done && !row.response.finished && row.response.tokens.len() == 5);
        // the tool turn does not fit: the episode ends after the call
        let mut row = new_row();
        step_row(&mut row, call, k + 3, &tools, &mut counts).unwrap();
        assert!(row.done && row.response.finished && row.response.tokens.len() == k);
    }
}
