//! Scalar reward of each sample (docs/algorithms.md §3, §8, §9): a base reward — the answer's accuracy,
//! the GRPO-λ length-penalised accuracy, or the rubric score — plus the ARES entropy reward
//! `S` when entropy shaping is on, plus `format_weight ×` the format reward.

use std::collections::BTreeMap;

use ares_core::Groups;
use ares_core::difficulty::{Difficulty, PerBucket};
use ares_core::length::{GrpoLambda, grpo_lambda_rewards};
use ares_core::overlong::overlong_penalties;
use ares_core::shaping::{ShapingConfig, entropy_reward, overall_reward};

use crate::reward::{PythonWorker, RewardInput};
use crate::trainer::TrainError;

/// What grading found in one response.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grade {
    /// The final answer is right (docs/algorithms.md §10), or the rubric score reached 1/2 for rubric rows
    /// without an answer.
    pub correct: bool,
    /// Format reward in [0, 1].
    pub format: f64,
    /// Rubric score (docs/algorithms.md §9), for rubric rows.
    pub rubric: Option<f64>,
    /// A multi-turn episode's interaction score times its weight
    /// (`worker.rollout.multi_turn.interaction.reward_weight`), added to the reward; 0
    /// without an interaction.
    pub interaction: f64,
    /// A multi-turn episode's cost of its tool calls, `−call_cost · calls`
    /// (`worker.rollout.multi_turn.call_cost`), added to the reward; 0 without.
    pub tool_cost: f64,
}

/// Where the base reward comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Base {
    /// 1 if correct, else 0.
    Accuracy,
    /// GRPO-λ: the top ⌈λ·G⌉ groups by accuracy get a length-penalised reward.
    GrpoLambda(GrpoLambda<f64>),
    /// The rubric score (0 for a row without rubric score).
    Rubric,
}

/// How rewards are formed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardParams {
    /// The base reward.
    pub base: Base,
    /// ARES shaping constants (`None`: no entropy reward).
    pub shaping: Option<ShapingConfig<f64>>,
    /// Weight of the format reward.
    pub format_weight: f64,
    /// DAPO's soft overlong penalty (`None`: off).
    pub overlong: Option<Overlong>,
}

/// DAPO's soft overlong penalty (docs/algorithms.md §16.3), added to the reward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlong {
    /// `L_max`: `data.max_response_length`.
    pub max_len: usize,
    /// `L_cache`: the penalty zone's length.
    pub buffer_len: usize,
    /// The penalty at `L_max`.
    pub penalty_factor: f64,
    /// Only correct responses are penalised.
    pub only_correct: bool,
}

/// The ARES state a step's rewards read: each bucket's target `T_d` and coefficient `α_d`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketValues {
    /// `T_d` (`None` before the bucket's first target: then `S = 0`).
    pub target: PerBucket<Option<f64>>,
    /// `α_d`.
    pub alpha: PerBucket<f64>,
}

/// The parts of one sample's reward.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RewardParts {
    /// 1 or 0.
    pub accuracy: f64,
    /// The base reward (accuracy, GRPO-λ or rubric score).
    pub base: f64,
    /// The ARES entropy reward `S` (0 without shaping).
    pub entropy: f64,
    /// The format reward (added with `format_weight`).
    pub format: f64,
    /// DAPO's overlong penalty (≤ 0; 0 when off).
    pub overlong: f64,
    /// The weighted interaction score of a multi-turn episode (0 without).
    pub interaction: f64,
    /// The cost of a multi-turn episode's tool calls (≤ 0; 0 without).
    pub tool_cost: f64,
    /// `base + S + format_weight·format + overlong + interaction + tool_cost`: the reward
    /// the advantages see.
    pub overall: f64,
}

/// Rewards of a batch of `grades.len()` samples in groups of `n` consecutive rows.
/// `buckets[g]` is group `g`'s difficulty, `hwe_counts`/`lengths` are per sample.
///
/// # Errors
/// Shapes, invalid GRPO-λ or shaping parameters, non-finite results.
pub fn rewards(
    params: &RewardParams,
    n: usize,
    grades: &[Grade],
    hwe_counts: &[usize],
    lengths: &[usize],
    buckets: &[Difficulty],
    state: &BucketValues,
) -> Result<Vec<RewardParts>, TrainError> {
    let rows = grades.len();
    if hwe_counts.len() != rows || lengths.len() != rows || buckets.len() * n != rows {
        return Err(TrainError::Internal(format!(
            "rewards: {rows} grades, {} HWE counts, {} lengths, {} groups of {n}",
            hwe_counts.len(),
            lengths.len(),
            buckets.len()
        )));
    }
    let correct: Vec<bool> = grades.iter().map(|g| g.correct).collect();
    let base: Vec<f64> = match params.base {
        Base::Accuracy => correct.iter().map(|&c| f64::from(u8::from(c))).collect(),
        Base::Rubric => grades.iter().map(|g| g.rubric.unwrap_or(0.0)).collect(),
        Base::GrpoLambda(p) => {
            let groups = Groups::contiguous(rows, n)?;
            let lens: Vec<f64> = lengths.iter().map(|&l| l as f64).collect();
            let mut order = vec![0usize; buckets.len()];
            let mut top = vec![false; buckets.len()];
            let mut out = vec![0.0f64; rows];
            grpo_lambda_rewards(&groups, &correct, &lens, &p, &mut order, &mut top, &mut out)?;
            out
        }
    };
    let mut overlong = vec![0.0f64; rows];
    if let Some(o) = &params.overlong {
        let only = o.only_correct.then_some(correct.as_slice());
        overlong_penalties(
            lengths,
            o.max_len,
            o.buffer_len,
            o.penalty_factor,
            only,
            &mut overlong,
        )?;
    }
    let mut parts = Vec::with_capacity(rows);
    for (i, g) in grades.iter().enumerate() {
        let d = buckets[i / n];
        let entropy = match (&params.shaping, state.target[d]) {
            (Some(cfg), Some(target)) => entropy_reward(
                d,
                g.correct,
                hwe_counts[i] as f64,
                target,
                state.alpha[d],
                cfg,
            )?,
            _ => 0.0,
        };
        let overall =
            overall_reward(base[i], entropy, g.format, params.format_weight).map_err(|e| {
                TrainError::NonFinite {
                    what: format!("reward of sample {i} ({e})"),
                }
            })? + overlong[i]
                + g.interaction
                + g.tool_cost;
        parts.push(RewardParts {
            accuracy: f64::from(u8::from(g.correct)),
            base: base[i],
            entropy,
            format: g.format,
            overlong: overlong[i],
            interaction: g.interaction,
            tool_cost: g.tool_cost,
            overall,
        });
    }
    Ok(parts)
}

/// A Python reward function's call for one batch: the function and, per row, what
/// EasyR1's reward managers pass besides the ARES fields.
pub struct FunctionCall<'a> {
    /// The function in its worker.
    pub function: &'a mut PythonWorker,
    /// Decoded responses, one per row.
    pub texts: &'a [String],
    /// Reference answers, one per row.
    pub ground_truths: &'a [&'a str],
    /// Mean token entropy of each response.
    pub mean_entropies: &'a [f64],
}

/// Replaces each row's `overall` with the reward function's (`worker.reward.reward_function`:
/// its `overall` is the whole reward, so the built-in entropy, format and overlong terms are
/// not added; they stay in `parts` as metrics, the entropy term as 0) plus the row's
/// interaction score (the environment's, not a built-in term). The function sees each
/// row's built-in accuracy, its group's bucket, the row's HWE count and the bucket's `T_d`
/// and `α_d` (before the bucket's first target: `T = 0` and `α = 0`, no shaping). Returns the mean of every key the function
/// returned, over the batch, for the metrics (`reward_function/<key>`).
///
/// # Errors
/// Shapes; the function's errors ([`crate::reward::RewardError::Function`]).
pub fn function_rewards(
    call: FunctionCall<'_>,
    n: usize,
    parts: &mut [RewardParts],
    hwe_counts: &[usize],
    lengths: &[usize],
    buckets: &[Difficulty],
    state: &BucketValues,
) -> Result<BTreeMap<String, f64>, TrainError> {
    let rows = parts.len();
    if call.texts.len() != rows
        || call.ground_truths.len() != rows
        || call.mean_entropies.len() != rows
        || hwe_counts.len() != rows
        || lengths.len() != rows
        || buckets.len() * n != rows
    {
        return Err(TrainError::Internal(format!(
            "function rewards: {rows} rows, {} texts, {} answers, {} HWE counts, {} groups of {n}",
            call.texts.len(),
            call.ground_truths.len(),
            hwe_counts.len(),
            buckets.len()
        )));
    }
    let inputs: Vec<RewardInput<'_>> = (0..rows)
        .map(|i| {
            let d = buckets[i / n];
            RewardInput {
                response: &call.texts[i],
                response_length: lengths[i],
                ground_truth: call.ground_truths[i],
                accuracy: parts[i].accuracy,
                difficulty: d.name(),
                high_entropy_token_num: hwe_counts[i],
                // before the bucket's first target there is no shaping: α = 0 says so to
                // any shaping that scales with α (ARES's does, docs/algorithms.md §3), T = 0 as
                // the ARES fork
                target_high_entropy_token_num: state.target[d].unwrap_or(0.0),
                alpha_entropy: if state.target[d].is_some() {
                    state.alpha[d]
                } else {
                    0.0
                },
                entropies: call.mean_entropies[i],
            }
        })
        .collect();
    let scores = call
        .function
        .score(&inputs)
        .map_err(|e| TrainError::Invalid(e.to_string()))?;
    let mut sums: BTreeMap<String, f64> = BTreeMap::new();
    for (p, score) in parts.iter_mut().zip(&scores) {
        let overall = score.get("overall").copied().unwrap_or(f64::NAN);
        p.base = overall;
        p.entropy = 0.0;
        p.overall = overall + p.interaction + p.tool_cost;
        for (k, v) in score {
            *sums.entry(k.clone()).or_default() += v;
        }
    }
    for v in sums.values_mut() {
        *v /= rows.max(1) as f64;
    }
    Ok(sums)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grade(correct: bool) -> Grade {
        Grade {
            interaction: 0.0,
            tool_cost: 0.0,
            correct,
            format: 1.0,
            rubric: None,
        }
    }

    #[test]
    fn ares_overall_matches_spec_vectors_1_and_2() {
        let params = RewardParams {
            base: Base::Accuracy,
            shaping: Some(ShapingConfig::default()),
            format_weight: 0.0,
            overlong: None,
        };
        let state = BucketValues {
            target: PerBucket::splat(Some(4.0)),
            alpha: PerBucket::splat(0.5),
        };
        let grades = [grade(true), grade(true), grade(false), grade(false)];
        let r = rewards(
            &params,
            4,
            &grades,
            &[10, 6, 5, 9],
            &[1, 1, 1, 1],
            &[Difficulty::Easy],
            &state,
        )
        .unwrap();
        let want = [0.5, 0.9583333, 0.15, 0.2642391];
        for (p, w) in r.iter().zip(want) {
            assert!((p.overall - w).abs() < 1e-6, "{r:?}");
        }
    }

    /// An episode's interaction score and the cost of its calls add to the reward as they
    /// are, after the shaping.
    #[test]
    fn interaction_and_tool_cost_add_to_the_reward() {
        let params = RewardParams {
            base: Base::Accuracy,
            shaping: None,
            format_weight: 0.0,
            overlong: None,
        };
        let state = BucketValues {
            target: PerBucket::splat(None),
            alpha: PerBucket::splat(0.5),
        };
        let mut g = [grade(true), grade(true), grade(false), grade(false)];
        g[1].tool_cost = -0.25;
        g[2].tool_cost = -0.5;
        g[3].interaction = 0.75;
        let r = rewards(
            &params,
            4,
            &g,
            &[1; 4],
            &[1; 4],
            &[Difficulty::Easy],
            &state,
        )
        .unwrap();
        let overall: Vec<f64> = r.iter().map(|p| p.overall).collect();
        assert_eq!(overall, [1.0, 0.75, -0.5, 0.75]);
        assert_eq!((r[1].tool_cost, r[3].interaction), (-0.25, 0.75));
    }

    #[test]
    fn grpo_lambda_spec_vector_12() {
        let params = RewardParams {
            base: Base::GrpoLambda(GrpoLambda {
                lambda_: 0.2,
                alpha: 0.6,
            }),
            shaping: None,
            format_weight: 0.0,
            overlong: None,
        };
        let state = BucketValues {
            target: PerBucket::splat(None),
            alpha: PerBucket::splat(0.5),
        };
        let r = rewards(
            &params,
            4,
            &[grade(true); 4],
            &[0; 4],
            &[100, 200, 300, 400],
            &[Difficulty::Easy],
            &state,
        )
        .unwrap();
        let want = [0.8756558, 0.7659859, 0.6340141, 0.5243442];
        for (p, w) in r.iter().zip(want) {
            assert!((p.overall - w).abs() < 1e-6, "{r:?}");
        }
    }

    #[test]
    fn no_target_means_no_shaping_and_format_weight_adds() {
        let params = RewardParams {
            base: Base::Accuracy,
            shaping: Some(ShapingConfig::default()),
            format_weight: 0.5,
            overlong: None,
        };
        let state = BucketValues {
            target: PerBucket::splat(None),
            alpha: PerBucket::splat(0.5),
        };
        let r = rewards(
            &params,
            2,
            &[grade(true), grade(false)],
            &[3, 3],
            &[1, 1],
            &[Difficulty::Hard],
            &state,
        )
        .unwrap();
        assert_eq!(r[0].overall, 1.5);
        assert_eq!(r[1].overall, 0.5);
    }

    #[test]
    fn dapo_overlong_penalty_is_added_to_correct_or_every_response() {
        let mut params = RewardParams {
            base: Base::Accuracy,
            shaping: None,
            format_weight: 0.0,
            overlong: Some(Overlong {
                max_len: 20,
                buffer_len: 8,
                penalty_factor: 1.0,
                only_correct: false,
            }),
        };
        let state = BucketValues {
            target: PerBucket::splat(None),
            alpha: PerBucket::splat(0.5),
        };
        let grades = [grade(true), grade(true), grade(false), grade(true)];
        // lengths 10 (before the zone), 16 (half way: −0.5), 20 (the limit: −1), 14 (−0.25)
        let lengths = [10, 16, 20, 14];
        let run = |p: &RewardParams| {
            rewards(
                p,
                4,
                &grades,
                &[0; 4],
                &lengths,
                &[Difficulty::Easy],
                &state,
            )
            .unwrap()
        };
        let r = run(&params);
        let overall: Vec<f64> = r.iter().map(|p| p.overall).collect();
        assert_eq!(overall, [1.0, 0.5, -1.0, 0.75]);
        params.overlong = params.overlong.map(|o| Overlong {
            only_correct: true,
            ..o
        });
        let r = run(&params);
        let overall: Vec<f64> = r.iter().map(|p| p.overall).collect();
        assert_eq!(overall, [1.0, 0.5, 0.0, 0.75]);
        assert_eq!(r[2].overlong, 0.0);
    }
}
