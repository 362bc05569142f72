//! From graded rollouts to what the PPO update needs (docs/algorithms.md §§1–8), in the order
//! of a step: online filtering ([`keep_groups`]), the ARES controllers ([`control`]: HWE
//! tokens, τ, buckets, targets, α), rewards, old and reference log-probs with the dynamic
//! token-level KL ([`score`]), advantages, and the KL controller's move — [`prepare`] runs
//! them in turn. The step's token tensors live on the backend's device; what comes back to
//! the host is counted (`perf/d2h_bytes`).

pub mod advantages;
pub mod controllers;
pub mod device;
pub mod hwe;
pub mod rewards;
pub mod sequences;

use std::collections::BTreeMap;

use ares_core::Groups;
use ares_core::difficulty::{Difficulty, PerBucket, bucket_means, classify_groups};
use ares_core::filter::{FilterParams, filter_groups};

use crate::backend::{Backend, KlSumViews, KlViews, View, ViewMut};
use crate::trainer::TrainError;
use crate::trainer::actor::Actor;
use crate::trainer::collect::batch::Batch;
use crate::trainer::setup::settings::{FilterKey, StepSettings};
use advantages::Advantages;
use controllers::AresState;
use device::{Downloads, alloc, download, upload};
use hwe::{HwePass, hwe_pass, update_tau};
use rewards::{FunctionCall, Grade, RewardParts, function_rewards, rewards};

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

/// What the ARES controllers made of a batch ([`control`]).
pub struct Controlled<B: Backend> {
    /// HWE tokens under the τ in force (mask on the device).
    pub hwe: HwePass<B>,
    /// τ after this batch's candidate moved it.
    pub tau_after: Option<f64>,
    /// Bucket per group.
    pub buckets: Vec<Difficulty>,
    /// Each bucket's mean HWE count `h̄_d` (mean over its groups of the group mean).
    pub mean_hwe: PerBucket<Option<f64>>,
}

/// The ARES controllers on a kept batch (docs/algorithms.md §1–§2): HWE tokens under the τ
/// in force, then τ moves; buckets, the difficulty map, then targets and α move (when
/// entropy shaping is on). `entropies`, `mask` and `trigger` are `[rows, T]` device tensors.
///
/// # Errors
/// Non-finite entropies, invalid parameters (each named).
#[allow(clippy::too_many_arguments)] // the batch's device tensors and the controllers
pub fn control<B: Backend>(
    be: &B,
    settings: &StepSettings,
    state: &mut AresState,
    step: u64,
    batch: &Batch,
    entropies: &B::Buffer,
    mask: &B::Buffer,
    trigger: Option<&B::Buffer>,
    downloads: &mut Downloads,
) -> Result<Controlled<B>, TrainError> {
    let n = batch.n;
    let hwe = hwe_pass(
        be,
        batch.tokens.shape,
        View::whole(entropies),
        View::whole(mask),
        trigger.map(View::whole),
        &settings.hwe,
        state.tau.tau(),
        downloads,
    )?;
    let tau_after = update_tau(&mut state.tau, &hwe)?;
    let buckets = group_buckets(settings, n, &batch.grades)?;
    for (item, &d) in batch.items.iter().zip(&buckets) {
        state.difficulty.insert(item.global_id.clone(), d);
    }
    let mean_hwe = bucket_means(&buckets, &group_means(&hwe.counts, n, |&c| c as f64))?;
    if settings.reward.shaping.is_some() {
        state
            .buckets
            .step(&mean_hwe, &PerBucket::splat(None), step)?;
    }
    Ok(Controlled {
        hwe,
        tau_after,
        buckets,
        mean_hwe,
    })
}

/// Per group of `n` consecutive rows, the mean of `value(row)`.
fn group_means<T>(rows: &[T], n: usize, value: impl Fn(&T) -> f64) -> Vec<f64> {
    rows.chunks_exact(n)
        .map(|g| g.iter().map(&value).sum::<f64>() / n as f64)
        .collect()
}

/// A batch's log-probs and KL ([`score`]).
#[derive(Debug)]
pub struct Scored {
    /// logπ_old `[rows, T]` (0 on padding), for the PPO loss on the host.
    pub old_logp: Vec<f32>,
    /// logπ_ref `[rows, T]`, on the host only when the KL is a loss term.
    pub ref_logp: Option<Vec<f32>>,
    /// The HWE mask `[rows, T]` on the host, only when the KL loss weights HWE tokens.
    pub hwe_mask: Option<Vec<f32>>,
    /// β per row (before HWE weighting).
    pub beta: Vec<f32>,
    /// `β_t·k_t` `[rows, T]`, only when the KL is folded into the rewards.
    pub weighted_kl: Option<Vec<f32>>,
    /// Per-row mean KL (when KL is on).
    pub row_mean_kl: Option<Vec<f32>>,
    /// The batch's token-mean KL, `Σ_r mean_r·len_r / Σ_r len_r` (0 without KL).
    pub token_mean_kl: f64,
}

/// Old and reference log-probs of the batch, scored on the device, and the dynamic
/// token-level KL between them with β per row (docs/algorithms.md §4).
///
/// # Errors
/// The model's, non-finite log-probs.
#[allow(clippy::too_many_arguments)] // the models, the batch's device tensors and β
pub fn score<B: Backend>(
    settings: &StepSettings,
    batch: &Batch,
    actor: &Actor<B>,
    reference: Option<&Actor<B>>,
    mask: &B::Buffer,
    hwe_mask: &B::Buffer,
    beta: Vec<f32>,
    downloads: &mut Downloads,
) -> Result<Scored, TrainError> {
    let be = actor.backend();
    let (rows, cols) = (batch.rows(), batch.tokens.cols());
    let temperature = settings.sampling.temperature();
    let ranks = settings.ranks.as_ref();
    let d_old = batch.score(
        actor,
        (settings.micro_batch, settings.padding_free),
        temperature,
        ranks,
    )?;
    // logπ_old comes back with the KL's results, after the reference pass is queued: one
    // wait for the scoring, not one before the reference pass and one after
    let mut out = Scored {
        old_logp: Vec::new(),
        ref_logp: None,
        hwe_mask: None,
        beta,
        weighted_kl: None,
        row_mean_kl: None,
        token_mean_kl: 0.0,
    };
    let d_ref = match (settings.kl.enabled, reference) {
        (true, Some(m)) => batch.score(
            m,
            (settings.micro_batch, settings.padding_free),
            temperature,
            ranks,
        )?,
        // LoRA: the reference policy is the base, the actor with its adapters off
        (true, None) if actor.lm().lora_config().is_some() => {
            let _off = actor.adapters_off();
            batch.score(
                actor,
                (settings.micro_batch, settings.padding_free),
                temperature,
                ranks,
            )?
        }
        _ => {
            out.old_logp = masked(download(be, &d_old, downloads)?, &batch.tokens.mask);
            return Ok(out);
        }
    };
    let fold_kl = !settings.kl.use_kl_loss;
    let d_beta = upload(be, &out.beta)?;
    let mut d_weighted = fold_kl.then(|| alloc(be, rows * cols)).transpose()?;
    let (mut d_row_sum, mut d_row_mean) = (alloc(be, rows)?, alloc(be, rows)?);
    be.masked_dynamic_kl(
        KlViews {
            logp: View::whole(&d_old),
            ref_logp: View::whole(&d_ref),
            mask: View::whole(mask),
            hwe_mask: settings.kl.dynamic.then(|| View::whole(hwe_mask)),
            beta_rows: View::whole(&d_beta),
            low_ratio: settings.kl.low_ratio as f32,
            estimator: settings.kl.estimator,
            cols,
        },
        KlSumViews {
            weighted: d_weighted.as_mut().map(ViewMut::whole),
            row_weighted_sum: ViewMut::whole(&mut d_row_sum),
            row_mean_kl: ViewMut::whole(&mut d_row_mean),
        },
    )?;
    out.old_logp = masked(download(be, &d_old, downloads)?, &batch.tokens.mask);
    let row_mean_kl = download(be, &d_row_mean, downloads)?;
    let lengths = batch.lengths();
    let valid: usize = lengths.iter().sum();
    if valid > 0 {
        out.token_mean_kl = row_mean_kl
            .iter()
            .zip(&lengths)
            .map(|(&k, &l)| f64::from(k) * l as f64)
            .sum::<f64>()
            / valid as f64;
    }
    out.row_mean_kl = Some(row_mean_kl);
    if let Some(w) = &d_weighted {
        // the token-level estimators take the KL per token when it is in the reward
        out.weighted_kl = Some(download(be, w, downloads)?);
    }
    if settings.kl.use_kl_loss {
        out.ref_logp = Some(masked(download(be, &d_ref, downloads)?, &batch.tokens.mask));
        if settings.kl.dynamic {
            out.hwe_mask = Some(download(be, hwe_mask, downloads)?);
        }
    }
    Ok(out)
}

/// Everything the update reads, and what the step's report shows.
#[derive(Debug)]
pub struct Prepared {
    /// HWE tokens per row under the τ in force.
    pub hwe_counts: Vec<usize>,
    /// Σ over each row's HWE tokens of `W_t − τ`.
    pub hwe_soft_cost: Vec<f32>,
    /// The τ the tokens were counted with, and τ after the update.
    pub tau: (f64, Option<f64>),
    /// Bucket per group.
    pub buckets: Vec<Difficulty>,
    /// Each bucket's mean HWE count.
    pub mean_hwe: PerBucket<Option<f64>>,
    /// Reward parts per row.
    pub rewards: Vec<RewardParts>,
    /// The mean of each key the Python reward function returned (empty without one).
    pub function_metrics: BTreeMap<String, f64>,
    /// logπ of the sampler `[rows, T]`.
    pub rollout_logp: Vec<f32>,
    /// Log-probs and KL.
    pub scored: Scored,
    /// Each bucket's mean per-sample KL (when KL is on).
    pub bucket_kl: Option<PerBucket<Option<f64>>>,
    /// Token advantages.
    pub advantages: Advantages,
    /// Bytes that crossed device → host in this phase.
    pub d2h_bytes: usize,
    /// The forking-token mask, when forking tokens are on.
    pub forking: Option<Forking>,
    /// The entropy bonus's coefficient for this step's update (`None`: no bonus).
    pub entropy_coef: Option<f64>,
}

/// The step's forking tokens (docs/algorithms.md §16.1): the response tokens whose policy
/// gradient is kept.
#[derive(Debug, Clone, PartialEq)]
pub struct Forking {
    /// 1 on a kept token, 0 elsewhere (padding included), `[rows, T]`.
    pub keep: Vec<f32>,
    /// Kept over valid tokens.
    pub kept_fraction: f64,
    /// The entropy threshold τ_ρ (`None`: no valid token).
    pub threshold: Option<f64>,
}

/// The top-ρ tokens of the whole step by the sampler's entropy (the ones the rollout
/// computed; the paper's batch B is the training batch, and the sampler's entropies are the
/// behaviour policy's, which is the policy being updated up to the importance ratio).
fn forking_tokens(entropies: &[f32], mask: &[f32], rho: f32) -> Result<Forking, TrainError> {
    let mut keep = vec![0.0f32; mask.len()];
    let mut scratch = vec![0.0f32; mask.len()];
    let stats =
        ares_core::forking::forking_token_mask(entropies, mask, rho, &mut scratch, &mut keep)?;
    Ok(Forking {
        keep,
        kept_fraction: f64::from(stats.fraction),
        threshold: stats.threshold.map(f64::from),
    })
}

/// The mean of `values` over the positions where `mask` is 1 (0 when there are none).
pub(crate) fn masked_mean(values: &[f32], mask: &[f32]) -> f64 {
    let (mut sum, mut count) = (0.0f64, 0usize);
    for (&v, &m) in values.iter().zip(mask) {
        if m != 0.0 {
            sum += f64::from(v);
            count += 1;
        }
    }
    if count == 0 { 0.0 } else { sum / count as f64 }
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

/// Runs a kept batch through the controllers, rewards, scoring and advantages, in the order
/// of docs/algorithms.md: HWE tokens (τ from before this step) and τ's move, buckets,
/// targets and α → rewards with the updated targets and α (§3, §8, §9) → old/ref log-probs
/// and the KL with the step's β (§4) → advantages, the KL folded into the rewards when it
/// is not a loss term (§5) → β moves (dual ascent or adaptive, after the step's β was
/// charged). `trigger_mask` (`[rows, T]`) restricts HWE candidates to trigger words. With
/// a Python reward function (`function`), its `overall` is each row's reward.
///
/// # Errors
/// Any core or model error (non-finite values name their tensor).
#[allow(clippy::too_many_arguments)] // one argument per input of the step's phases
pub fn prepare<B: Backend>(
    settings: &StepSettings,
    state: &mut AresState,
    step: u64,
    batch: &Batch,
    trigger_mask: Option<&[f32]>,
    actor: &Actor<B>,
    reference: Option<&Actor<B>>,
    function: Option<FunctionCall<'_>>,
) -> Result<Prepared, TrainError> {
    let (n, rows) = (batch.n, batch.rows());
    // the step's token tensors go to the device once
    let be = actor.backend();
    let mut downloads = Downloads::default();
    let d_mask = upload(be, &batch.tokens.mask)?;
    // the sampler's token entropies, padded once for the controllers, the bonus and forking
    let entropies = batch.padded(|r| &r.entropies);
    let d_entropies = upload(be, &entropies)?;
    let d_trigger = trigger_mask.map(|t| upload(be, t)).transpose()?;

    let c = control(
        be,
        settings,
        state,
        step,
        batch,
        &d_entropies,
        &d_mask,
        d_trigger.as_ref(),
        &mut downloads,
    )?;
    let lengths = batch.lengths();
    let mut parts = rewards(
        &settings.reward,
        n,
        &batch.grades,
        &c.hwe.counts,
        &lengths,
        &c.buckets,
        &state.bucket_values(),
    )?;
    let function_metrics = match function {
        Some(call) => function_rewards(
            call,
            n,
            &mut parts,
            &c.hwe.counts,
            &lengths,
            &c.buckets,
            &state.bucket_values(),
        )?,
        None => BTreeMap::new(),
    };
    let beta = (0..rows)
        .map(|r| state.beta(c.buckets[r / n]) as f32)
        .collect();
    let scored = score(
        settings,
        batch,
        actor,
        reference,
        &d_mask,
        &c.hwe.mask,
        beta,
        &mut downloads,
    )?;
    let overall: Vec<f32> = parts.iter().map(|p| p.overall as f32).collect();
    let advantages = advantages::compute(
        settings.estimator,
        n,
        &overall,
        &batch.tokens,
        scored.weighted_kl.as_deref(),
    )?;
    // the bonus's coefficient in force, then its move from this step's mean token entropy
    // (the sampler's, over the response tokens), for the next step
    let entropy_coef = state.use_entropy_coef(masked_mean(&entropies, &batch.tokens.mask))?;
    let forking = settings
        .forking_rho
        .map(|rho| forking_tokens(&entropies, &batch.tokens.mask, rho))
        .transpose()?;
    let bucket_kl = match &scored.row_mean_kl {
        Some(k) => {
            let bucket_kl = bucket_means(&c.buckets, &group_means(k, n, |&x| f64::from(x)))?;
            state.update_kl(scored.token_mean_kl, rows, &bucket_kl, step)?;
            Some(bucket_kl)
        }
        None => None,
    };
    Ok(Prepared {
        hwe_counts: c.hwe.counts,
        hwe_soft_cost: c.hwe.soft_cost,
        tau: (c.hwe.tau, c.tau_after),
        buckets: c.buckets,
        mean_hwe: c.mean_hwe,
        rewards: parts,
        function_metrics,
        rollout_logp: batch.padded(|r| &r.log_probs),
        scored,
        bucket_kl,
        advantages,
        d2h_bytes: downloads.bytes,
        forking,
        entropy_coef,
    })
}
