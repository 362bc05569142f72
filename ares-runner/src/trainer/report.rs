//! The step's metrics, assembled in one place from what each phase returned: the
//! collection (rollout rounds, filtering), the prepared batch (controllers, rewards, KL,
//! advantages), the update, and the phase times. One [`Record`] per step, one line of
//! `metrics.jsonl`.

use std::time::Duration;

use ares_core::difficulty::Difficulty;
use ares_core::kl::KlController;

use crate::metrics::{PhaseTimes, Record};
use crate::trainer::collect::batch::Batch;
use crate::trainer::prepare::controllers::AresState;
use crate::trainer::prepare::{Prepared, masked_mean};
use crate::trainer::setup::settings::KlControl;
use crate::trainer::update::UpdateReport;

/// What the rollout and online filtering of a step did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Collection {
    /// Groups generated over all rounds.
    pub generated_groups: usize,
    /// Response tokens generated over all rounds.
    pub generated_tokens: usize,
    /// Rounds of generation.
    pub rounds: u64,
    /// Seconds spent generating.
    pub rollout_secs: f64,
    /// What multi-turn episodes did (all zero for a single-turn rollout).
    pub episodes: crate::trainer::collect::episodes::EpisodeCounts,
}

/// Counters of the run at the end of the step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunCounters {
    /// The data epoch.
    pub epoch: u64,
    /// Mini-batches skipped for non-finite values so far.
    pub skipped_updates: u64,
    /// Prompts dropped as solved so far.
    pub dropped_solved: usize,
}

/// The record of step `step` (see the module docs).
#[allow(clippy::too_many_arguments)] // one argument per phase of the step
pub fn step_record(
    step: u64,
    batch: &Batch,
    prep: &Prepared,
    state: &AresState,
    update: &UpdateReport,
    collection: &Collection,
    counters: &RunCounters,
    times: &PhaseTimes,
    elapsed: Duration,
) -> Record {
    let (n, rows) = (batch.n, batch.rows() as f64);
    let mut r = Record::with_step(step);
    r.insert("epoch", counters.epoch as f64);

    // the batch: rewards, accuracy, lengths, entropy
    let parts = &prep.rewards;
    let lengths = batch.lengths();
    let mean = |f: &dyn Fn(&crate::trainer::prepare::rewards::RewardParts) -> f64| {
        parts.iter().map(f).sum::<f64>() / rows
    };
    r.insert("reward/mean", mean(&|p| p.overall));
    r.insert("accuracy/mean", mean(&|p| p.accuracy));
    r.insert("reward/entropy", mean(&|p| p.entropy));
    r.insert("reward/format", mean(&|p| p.format));
    // DAPO's overlong penalty: 0 and 0 when it is off
    r.insert("reward/overlong", mean(&|p| p.overlong));
    r.insert("reward/interaction", mean(&|p| p.interaction));
    r.insert("reward/tool_cost", mean(&|p| p.tool_cost));
    // every key a Python reward function returned, as its batch mean
    for (key, value) in &prep.function_metrics {
        r.insert(format!("reward_function/{key}"), *value);
    }
    r.insert(
        "response_length/overlong_frac",
        mean(&|p| f64::from(u8::from(p.overlong < 0.0))),
    );
    r.insert(
        "response_length/mean",
        lengths.iter().sum::<usize>() as f64 / rows,
    );
    r.insert(
        "response_length/clip_ratio",
        batch.responses.iter().filter(|x| !x.finished).count() as f64 / rows,
    );
    r.insert(
        "entropy/mean",
        masked_mean(&batch.padded(|x| &x.entropies), &batch.tokens.mask),
    );

    if let Some(c) = prep.entropy_coef {
        r.insert("actor/entropy_coef", c);
    }
    // forking tokens: the kept fraction of the response tokens and the entropy threshold
    if let Some(f) = &prep.forking {
        r.insert("forking/kept_frac", f.kept_fraction);
        if let Some(t) = f.threshold {
            r.insert("forking/entropy_threshold", t);
        }
    }

    // the controllers: HWE tokens, τ, per-bucket state
    r.insert(
        "hwe/count_mean",
        prep.hwe_counts.iter().sum::<usize>() as f64 / rows,
    );
    r.insert(
        "hwe/soft_cost_mean",
        prep.hwe_soft_cost
            .iter()
            .map(|&c| f64::from(c))
            .sum::<f64>()
            / rows,
    );
    r.insert("tau/used", prep.tau.0);
    if let Some(t) = prep.tau.1 {
        r.insert("tau", t);
    }
    let st = state.buckets.state();
    for d in Difficulty::ALL {
        let (s, name) = (st[d], d.name());
        if let Some(t) = s.target {
            r.insert(format!("target/{name}"), t);
        }
        r.insert(format!("alpha/{name}"), s.alpha);
        r.insert(format!("lambda/{name}"), s.lambda);
        let groups = prep.buckets.iter().filter(|&&b| b == d).count();
        r.insert(format!("groups/{name}"), groups as f64);
        if let Some(h) = prep.mean_hwe[d] {
            r.insert(format!("hwe/{name}"), h);
        }
        let (mut acc, mut len, mut k) = (0.0, 0.0, 0usize);
        for (row, p) in parts.iter().enumerate() {
            if prep.buckets[row / n] == d {
                acc += p.accuracy;
                len += lengths[row] as f64;
                k += 1;
            }
        }
        if k > 0 {
            r.insert(format!("accuracy/{name}"), acc / k as f64);
            r.insert(format!("response_length/{name}"), len / k as f64);
        }
    }

    // KL and advantages
    if let Some(bucket_kl) = &prep.bucket_kl {
        for d in Difficulty::ALL {
            if let Some(k) = bucket_kl[d] {
                r.insert(format!("kl/{}", d.name()), k);
            }
        }
        r.insert("kl/mean", prep.scored.token_mean_kl);
    }
    if let KlControl::Global(KlController::Adaptive(c)) = state.kl {
        r.insert("kl/beta", c.value());
    }
    r.insert("advantage/mean", prep.advantages.mean);
    r.insert("advantage/std", prep.advantages.std);

    // the update
    for (k, v) in &update.metrics {
        r.insert(k.clone(), *v);
    }

    // collection, counters, performance
    r.insert(
        "filter/keep_ratio",
        batch.items.len() as f64 / collection.generated_groups.max(1) as f64,
    );
    r.insert("filter/rounds", collection.rounds as f64);
    let e = &collection.episodes;
    if e.episodes > 0 {
        // multi-turn episodes, over every round's responses
        let per = |x: usize| x as f64 / e.episodes as f64;
        r.insert("tools/turns_per_response", per(e.turns));
        r.insert("tools/calls_per_response", per(e.calls));
        r.insert(
            "tools/failed_call_ratio",
            e.failed_calls as f64 / e.calls.max(1) as f64,
        );
        r.insert(
            "tools/interaction_turns_per_response",
            per(e.interaction_turns),
        );
        r.insert("tools/interaction_error_ratio", per(e.interaction_errors));
        // prefill per response, and how many times that re-prefilling every turn's whole
        // trajectory for each sample would take
        r.insert("tools/prefill_tokens_per_response", per(e.prefill_tokens));
        r.insert(
            "tools/prefill_saving",
            e.conversation_tokens as f64 / e.prefill_tokens.max(1) as f64,
        );
    }
    r.insert("actor/skipped_updates", counters.skipped_updates as f64);
    r.insert("data/dropped_solved", counters.dropped_solved as f64);
    r.insert(
        "perf/rollout_tokens_per_s",
        collection.generated_tokens as f64 / collection.rollout_secs.max(1e-9),
    );
    r.insert("perf/d2h_bytes", prep.d2h_bytes as f64);
    r.insert("time/step", elapsed.as_secs_f64());
    times.write_to(&mut r);
    r
}
