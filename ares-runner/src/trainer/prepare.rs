//! From graded rollouts to what the PPO update needs (seed 001 §3.2, docs/algorithms.md §§1–8): online
//! filtering, the ARES controllers (HWE tokens, τ, buckets, targets, α), rewards, old and
//! reference log-probs, dynamic token-level KL, advantages — and the step's metrics.

use std::collections::BTreeMap;

use ares_core::Groups;
use ares_core::difficulty::{Difficulty, PerBucket, bucket_means, classify_groups};
use ares_core::filter::{FilterParams, filter_groups};

use super::TrainError;
use super::advantages::{self, Advantages};
use super::batch::Batch;
use super::controllers::AresState;
use super::device::{Downloads, alloc, download, upload};
use super::hwe::{hwe_pass, update_tau};
use super::rewards::{BucketValues, Grade, RewardParts, rewards};
use super::settings::{FilterKey, KlControl, StepSettings};
use crate::backend::{Backend, KlSumViews, KlViews, View, ViewMut};
use crate::model::Model;

/// Step metrics, by name (one JSON line per step).
pub type Metrics = BTreeMap<String, f64>;

/// Which groups of a graded round online filtering keeps (docs/algorithms.md §7): the group mean of the
/// filter key strictly inside `(low, high)`, by ares-core's [`filter_groups`]. `rewards` are
/// only read for reward keys.
///
/// # Errors
/// A non-finite filter value (naming its row), bad bounds.
pub fn keep_groups(
    settings: &StepSettings,
    n: usize,
    grades: &[Grade],
    rewards: Option<&[RewardParts]>,
) -> Result<Vec<bool>, TrainError> {
    let Some(f) = settings.filter else {
        return Ok(vec![true; grades.len() / n]);
    };
    let values: Vec<f64> = (0..grades.len())
        .map(|i| match (f.key, rewards) {
            (FilterKey::Accuracy, _) | (_, None) => f64::from(u8::from(grades[i].correct)),
            (FilterKey::Overall, Some(r)) => r[i].overall,
            (FilterKey::Entropy, Some(r)) => r[i].entropy,
            (FilterKey::Format, Some(r)) => r[i].format,
        })
        .collect();
    let groups = Groups::contiguous(values.len(), n)?;
    let params = FilterParams {
        filter_low: f.low,
        filter_high: f.high,
    };
    let mut keep = vec![false; groups.count()];
    filter_groups(&groups, &values, &params, &mut keep)?;
    Ok(keep)
}

/// Bucket of each group from its samples' correctness, by ares-core's [`classify_groups`]
/// with the configured accuracy thresholds.
///
/// # Errors
/// Invalid thresholds.
pub fn group_buckets(
    settings: &StepSettings,
    n: usize,
    grades: &[Grade],
) -> Result<Vec<Difficulty>, TrainError> {
    let correct: Vec<bool> = grades.iter().map(|g| g.correct).collect();
    let groups = Groups::contiguous(correct.len(), n)?;
    let mut out = vec![Difficulty::Hard; groups.count()];
    classify_groups(
        &correct,
        &groups,
        &settings.difficulty.accuracy_thresholds,
        &mut out,
    )?;
    Ok(out)
}

/// Everything the update reads, with the metrics gathered so far.
#[derive(Debug)]
pub struct Prepared {
    /// HWE tokens per row under the τ in force.
    pub hwe_counts: Vec<usize>,
    /// The HWE mask `[rows, T]` on the host, only when the KL loss weights HWE tokens
    /// (`use_kl_loss` with dynamic KL); otherwise it stays on the device.
    pub hwe_mask: Option<Vec<f32>>,
    /// Bucket per group.
    pub buckets: Vec<Difficulty>,
    /// Reward parts per row.
    pub rewards: Vec<RewardParts>,
    /// logπ_old `[rows, T]`.
    pub old_logp: Vec<f32>,
    /// logπ of the sampler `[rows, T]`.
    pub rollout_logp: Vec<f32>,
    /// logπ_ref `[rows, T]`, on the host only when the KL is a loss term.
    pub ref_logp: Option<Vec<f32>>,
    /// β per row (before HWE weighting).
    pub beta: Vec<f32>,
    /// Token advantages.
    pub advantages: Advantages,
    /// Metrics of the step so far.
    pub metrics: Metrics,
}

/// `values` with 0 where `mask` is 0 (padding positions hold whatever the model computed).
fn masked(mut values: Vec<f32>, mask: &[f32]) -> Vec<f32> {
    for (v, &m) in values.iter_mut().zip(mask) {
        if m == 0.0 {
            *v = 0.0;
        }
    }
    values
}

/// Mean of `values` where `mask` is 1.
fn masked_mean(values: &[f32], mask: &[f32]) -> f64 {
    let (mut s, mut k) = (0.0f64, 0usize);
    for (&v, &m) in values.iter().zip(mask) {
        if m != 0.0 {
            s += f64::from(v);
            k += 1;
        }
    }
    if k == 0 { 0.0 } else { s / k as f64 }
}

/// Runs the ARES controllers and the scoring on a kept batch: HWE tokens (τ from before
/// this step), τ update, buckets and difficulty map, targets and α, rewards, old/ref
/// log-probs, KL, advantages. `actor` and `reference` score the responses; `trigger_mask`
/// (`[rows, T]`) restricts HWE candidates to trigger words.
///
/// # Errors
/// Any core or model error (non-finite values name their tensor).
#[allow(clippy::too_many_arguments)]
pub fn prepare<B: Backend>(
    settings: &StepSettings,
    state: &mut AresState,
    step: u64,
    batch: &Batch,
    trigger_mask: Option<&[f32]>,
    actor: &Model<B>,
    reference: Option<&Model<B>>,
) -> Result<Prepared, TrainError> {
    let n = batch.n;
    let rows = batch.rows();
    let shape = batch.tokens.shape;
    let mask = &batch.tokens.mask;
    let mut metrics = Metrics::new();

    // The step's token tensors go to the device once; the HWE tokens and the KL are
    // computed there and only per-row numbers come back (docs/algorithms.md §1, §4).
    let be = actor.backend();
    let mut downloads = Downloads::default();
    let d_mask = upload(be, mask)?;
    let entropies = batch.padded(|r| &r.entropies);
    let d_entropies = upload(be, &entropies)?;
    let d_trigger = trigger_mask.map(|t| upload(be, t)).transpose()?;

    // 1. HWE tokens under the τ in force, then τ moves (docs/algorithms.md §1)
    let tau_before = state.tau.tau();
    let hwe = hwe_pass(
        be,
        shape,
        View::whole(&d_entropies),
        View::whole(&d_mask),
        d_trigger.as_ref().map(View::whole),
        &settings.hwe,
        tau_before,
        &mut downloads,
    )?;
    let tau_after = update_tau(&mut state.tau, &hwe)?;

    // 2. buckets, difficulty map, targets and α (docs/algorithms.md §2)
    let buckets = group_buckets(settings, n, &batch.grades)?;
    for (item, &d) in batch.items.iter().zip(&buckets) {
        state.difficulty.insert(item.global_id.clone(), d);
    }
    let group_hwe: Vec<f64> = hwe
        .counts
        .chunks_exact(n)
        .map(|c| c.iter().sum::<usize>() as f64 / n as f64)
        .collect();
    let mean_hwe = bucket_means(&buckets, &group_hwe)?;
    if settings.reward.shaping.is_some() {
        state
            .buckets
            .step(&mean_hwe, &PerBucket::splat(None), step)?;
    }

    // 3. rewards with the updated targets and α (docs/algorithms.md §3, §8, §9)
    let bstate = state.buckets.state();
    let values = BucketValues {
        target: PerBucket::new(bstate.easy.target, bstate.medium.target, bstate.hard.target),
        alpha: PerBucket::new(bstate.easy.alpha, bstate.medium.alpha, bstate.hard.alpha),
    };
    let lengths = batch.lengths();
    let parts = rewards(
        &settings.reward,
        n,
        &batch.grades,
        &hwe.counts,
        &lengths,
        &buckets,
        &values,
    )?;

    // 4. log-probs: old policy (training time), sampler, reference — scored on the device;
    // the PPO loss reads logπ_old on the host
    let temperature = settings.sampling.temperature();
    let d_old = batch.score(actor, settings.micro_batch, temperature)?;
    let old_logp = masked(download(be, &d_old, &mut downloads)?, mask);
    let rollout_logp = batch.padded(|r| &r.log_probs);
    let d_ref = match (settings.kl.enabled, reference) {
        (true, Some(m)) => Some(batch.score(m, settings.micro_batch, temperature)?),
        _ => None,
    };

    // 5. KL per token with β per row (dynamic on HWE tokens) (docs/algorithms.md §4)
    let beta: Vec<f32> = (0..rows)
        .map(|r| state.beta(settings.kl.control, buckets[r / n]) as f32)
        .collect();
    let fold_kl = !settings.kl.use_kl_loss && d_ref.is_some();
    let mut weighted = Vec::new();
    let mut row_mean_kl = vec![0.0f32; rows];
    let mut kl_token_mean = 0.0;
    let mut ref_logp = None;
    let mut hwe_mask = None;
    if let Some(d_ref) = &d_ref {
        let d_beta = upload(be, &beta)?;
        let mut d_weighted = fold_kl.then(|| alloc(be, rows * shape.cols)).transpose()?;
        let (mut d_row_sum, mut d_row_mean) = (alloc(be, rows)?, alloc(be, rows)?);
        be.masked_dynamic_kl(
            KlViews {
                logp: View::whole(&d_old),
                ref_logp: View::whole(d_ref),
                mask: View::whole(&d_mask),
                hwe_mask: settings.kl.dynamic.then(|| View::whole(&hwe.mask)),
                beta_rows: View::whole(&d_beta),
                low_ratio: settings.kl.low_ratio as f32,
                estimator: settings.kl.estimator,
                cols: shape.cols,
            },
            KlSumViews {
                weighted: d_weighted.as_mut().map(ViewMut::whole),
                row_weighted_sum: ViewMut::whole(&mut d_row_sum),
                row_mean_kl: ViewMut::whole(&mut d_row_mean),
            },
        )
        .map_err(crate::model::ModelError::from)?;
        row_mean_kl = download(be, &d_row_mean, &mut downloads)?;
        // the batch's token mean from the row means: Σ_r mean_r·len_r / Σ_r len_r
        let valid: usize = batch.lengths().iter().sum();
        if valid > 0 {
            kl_token_mean = row_mean_kl
                .iter()
                .zip(batch.lengths())
                .map(|(&k, l)| f64::from(k) * l as f64)
                .sum::<f64>()
                / valid as f64;
        }
        if let Some(w) = &d_weighted {
            // the token-level estimators take the KL per token when it is in the reward
            weighted = download(be, w, &mut downloads)?;
        }
        if settings.kl.use_kl_loss {
            ref_logp = Some(masked(download(be, d_ref, &mut downloads)?, mask));
            if settings.kl.dynamic {
                hwe_mask = Some(download(be, &hwe.mask, &mut downloads)?);
            }
        }
    }

    // 6. advantages (docs/algorithms.md §5), KL folded into the rewards when it is not a loss term
    let overall: Vec<f32> = parts.iter().map(|p| p.overall as f32).collect();
    let fold = fold_kl.then_some(weighted.as_slice());
    let adv = advantages::compute(settings.estimator, n, &overall, &batch.tokens, fold)?;

    // 7. dual ascent on the per-bucket KL, adaptive β (after the step's β was used)
    if d_ref.is_some() {
        let seq_kl: Vec<f64> = row_mean_kl.iter().map(|&k| f64::from(k)).collect();
        let group_kl: Vec<f64> = seq_kl
            .chunks_exact(n)
            .map(|c| c.iter().sum::<f64>() / n as f64)
            .collect();
        let mean_kl = bucket_means(&buckets, &group_kl)?;
        match settings.kl.control {
            KlControl::DualAscent => {
                state
                    .buckets
                    .step(&PerBucket::splat(None), &mean_kl, step)?;
            }
            KlControl::Adaptive { .. } => {
                if let Some(c) = state.adaptive_kl.as_mut() {
                    c.update(kl_token_mean, rows)?;
                }
            }
            KlControl::Fixed(_) => {}
        }
        for d in Difficulty::ALL {
            if let Some(k) = mean_kl[d] {
                metrics.insert(format!("kl/{}", d.name()), k);
            }
        }
        metrics.insert("kl/mean".into(), kl_token_mean);
    }

    // metrics of the batch and the controllers
    let mean = |f: &dyn Fn(&RewardParts) -> f64| parts.iter().map(f).sum::<f64>() / rows as f64;
    metrics.insert("reward/mean".into(), mean(&|p| p.overall));
    metrics.insert("accuracy/mean".into(), mean(&|p| p.accuracy));
    metrics.insert("reward/entropy".into(), mean(&|p| p.entropy));
    metrics.insert("reward/format".into(), mean(&|p| p.format));
    metrics.insert(
        "response_length/mean".into(),
        lengths.iter().sum::<usize>() as f64 / rows as f64,
    );
    metrics.insert(
        "response_length/clip_ratio".into(),
        batch.responses.iter().filter(|r| !r.finished).count() as f64 / rows as f64,
    );
    metrics.insert("entropy/mean".into(), masked_mean(&entropies, mask));
    metrics.insert(
        "hwe/count_mean".into(),
        hwe.counts.iter().sum::<usize>() as f64 / rows as f64,
    );
    metrics.insert(
        "hwe/soft_cost_mean".into(),
        hwe.soft_cost.iter().map(|&c| f64::from(c)).sum::<f64>() / rows as f64,
    );
    metrics.insert("tau/used".into(), hwe.tau);
    if let Some(t) = tau_after {
        metrics.insert("tau".into(), t);
    }
    metrics.insert("advantage/mean".into(), adv.mean);
    metrics.insert("advantage/std".into(), adv.std);
    let st = state.buckets.state();
    for d in Difficulty::ALL {
        let s = st[d];
        let name = d.name();
        if let Some(t) = s.target {
            metrics.insert(format!("target/{name}"), t);
        }
        metrics.insert(format!("alpha/{name}"), s.alpha);
        metrics.insert(format!("lambda/{name}"), s.lambda);
        let groups = buckets.iter().filter(|&&b| b == d).count();
        metrics.insert(format!("groups/{name}"), groups as f64);
        if let Some(h) = mean_hwe[d] {
            metrics.insert(format!("hwe/{name}"), h);
        }
        // accuracy and length per bucket
        let (mut acc, mut len, mut k) = (0.0, 0.0, 0usize);
        for (r, p) in parts.iter().enumerate() {
            if buckets[r / n] == d {
                acc += p.accuracy;
                len += lengths[r] as f64;
                k += 1;
            }
        }
        if k > 0 {
            metrics.insert(format!("accuracy/{name}"), acc / k as f64);
            metrics.insert(format!("response_length/{name}"), len / k as f64);
        }
    }
    if let Some(adaptive) = &state.adaptive_kl {
        metrics.insert("kl/beta".into(), adaptive.value());
    }

    metrics.insert("perf/d2h_bytes".into(), downloads.bytes as f64);
    Ok(Prepared {
        hwe_counts: hwe.counts,
        hwe_mask,
        buckets,
        rewards: parts,
        old_logp,
        rollout_logp,
        ref_logp,
        beta,
        advantages: adv,
        metrics,
    })
}
