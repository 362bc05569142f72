//! Evaluation: accuracy and mean response length per difficulty of a model on a dataset
//! (greedy at `val_temperature = 0`, else sampled), the numbers of the demo's before/after
//! table and of `ares-runner eval`.

use std::collections::BTreeMap;

use crate::backend::Backend;
use crate::data::Example;
use crate::reward::Generation;
use crate::trainer::TrainError;
use crate::trainer::actor::Actor;
use crate::trainer::collect::episodes::{EpisodeStart, EpisodeTools, rollout_episodes};
use crate::trainer::collect::grading::Grader;
use crate::trainer::collect::prompts::PromptRenderer;
use crate::trainer::collect::rollout::{PromptItem, RolloutParams, generate_all};

/// Accuracy and length of one group of examples.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct EvalRow {
    /// Responses graded.
    pub responses: usize,
    /// Fraction correct.
    pub accuracy: f64,
    /// Mean response length in tokens (the model's: a multi-turn episode's tool turns
    /// left out).
    pub mean_length: f64,
    /// Mean tool calls per response (0 without multi-turn episodes).
    #[serde(default)]
    pub calls_per_response: f64,
}

/// Results per difficulty label (`all` for everything; rows without a label count only
/// there).
pub type EvalReport = BTreeMap<String, EvalRow>;

/// Generates `n` responses per example with `params` (as multi-turn episodes with
/// `episodes`) and grades them on the model's tokens; with `generations`, each response
/// also goes there as (question, response, answer, 1 or 0).
///
/// # Errors
/// Rendering, generation or grading errors.
#[allow(clippy::too_many_arguments)] // the model, its inputs and the two outputs
pub fn evaluate<B: Backend>(
    model: &Actor<B>,
    renderer: &PromptRenderer,
    episodes: Option<&EpisodeTools<'_>>,
    grader: &mut Grader,
    examples: &[Example],
    n: usize,
    params: &RolloutParams,
    on_progress: impl FnMut(usize),
    mut generations: Option<&mut Vec<Generation>>,
) -> Result<EvalReport, TrainError> {
    let mut prompts = Vec::with_capacity(examples.len() * n);
    let mut vision = Vec::with_capacity(examples.len() * n);
    for e in examples {
        let (ids, v) = renderer.inputs(e, None)?;
        for _ in 0..n {
            prompts.push(ids.clone());
            vision.push(v.clone());
        }
    }
    let responses = match episodes {
        None => generate_all(model, &prompts, &vision, params, on_progress)?,
        Some(tools) => {
            let items: Vec<PromptItem> = examples
                .iter()
                .enumerate()
                .map(|(i, e)| PromptItem {
                    example: i,
                    global_id: e.global_id.clone(),
                    train_prompt: prompts[i * n].clone(),
                    rollout_prompts: prompts[i * n..(i + 1) * n].to_vec(),
                    vision: vision[i * n].clone(),
                })
                .collect();
            let starts = examples
                .iter()
                .map(|e| {
                    Ok(EpisodeStart {
                        messages: renderer.messages(e)?,
                        tools_kwargs: e.tools_kwargs.clone(),
                        interaction_kwargs: e.interaction_kwargs.clone(),
                    })
                })
                .collect::<Result<Vec<_>, TrainError>>()?;
            rollout_episodes(model, &items, &starts, n, params, tools, on_progress)?.0
        }
    };
    let mut sums: BTreeMap<String, (usize, usize, usize, usize)> = BTreeMap::new();
    for (i, r) in responses.iter().enumerate() {
        let e = &examples[i / n.max(1)];
        let text = renderer
            .tokenizer
            .decode(&r.model_tokens(), true)
            .map_err(|err| TrainError::Invalid(format!("tokenizer: {err}")))?;
        let g = grader.grade(e, &text)?;
        if let Some(out) = generations.as_deref_mut() {
            out.push((
                e.prompt.question().to_string(),
                text.clone(),
                e.answer.clone(),
                f64::from(u8::from(g.correct)),
            ));
        }
        let mut add = |key: &str| {
            let s = sums.entry(key.to_string()).or_default();
            s.0 += 1;
            s.1 += usize::from(g.correct);
            s.2 += r.model_len();
            s.3 += r.tool_calls;
        };
        add("all");
        if let Some(d) = &e.difficulty {
            add(d);
        }
    }
    Ok(sums
        .into_iter()
        .map(|(k, (count, correct, len, calls))| {
            let c = count.max(1) as f64;
            (
                k,
                EvalRow {
                    responses: count,
                    accuracy: correct as f64 / c,
                    mean_length: len as f64 / c,
                    calls_per_response: calls as f64 / c,
                },
            )
        })
        .collect())
}

/// `count` of `generations` to log, picked as EasyR1 picks them: sorted by prompt, then a
/// shuffle seeded with 42 (ChaCha8 here, numpy's `RandomState` there: the same rule, not the
/// same draw).
pub fn pick_generations(mut generations: Vec<Generation>, count: usize) -> Vec<Generation> {
    use rand_chacha::ChaCha8Rng;
    use rand_chacha::rand_core::{Rng, SeedableRng};
    generations.sort_by(|a, b| a.0.cmp(&b.0));
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    // Fisher–Yates
    for i in (1..generations.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        generations.swap(i, j);
    }
    generations.truncate(count);
    generations
}

/// The report as a table, difficulty labels in the order easy, medium, hard, others, all.
pub fn format_table(report: &EvalReport) -> String {
    let mut keys: Vec<&String> = report.keys().collect();
    let rank = |k: &str| match k {
        "easy" => 0,
        "medium" => 1,
        "hard" => 2,
        "all" => 4,
        _ => 3,
    };
    keys.sort_by_key(|k| (rank(k), (*k).clone()));
    // episodes' tool calls get a column when there are any
    let calls = report.values().any(|r| r.calls_per_response > 0.0);
    let mut out = format!(
        "{:<10} {:>9} {:>9} {:>11}{}\n",
        "difficulty",
        "responses",
        "accuracy",
        "mean length",
        if calls { "  calls/answer" } else { "" }
    );
    for k in keys {
        let r = report[k];
        out.push_str(&format!(
            "{:<10} {:>9} {:>8.1}% {:>11.1}",
            k,
            r.responses,
            100.0 * r.accuracy,
            r.mean_length
        ));
        if calls {
            out.push_str(&format!(" {:>13.2}", r.calls_per_response));
        }
        out.push('\n');
    }
    out
}
