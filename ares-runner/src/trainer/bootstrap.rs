//! The bootstrap pass (docs/algorithms.md §2): one rollout over the training set without updates, which
//! sets the first τ, the per-bucket targets `T_d` and every prompt's difficulty, saved as
//! `bootstrap.json` beside the checkpoints and reused on resume.

use std::collections::BTreeMap;
use std::path::Path;

use ares_core::difficulty::{Difficulty, PerBucket, bucket_means};
use serde::{Deserialize, Serialize};

use super::TrainError;
use super::checkpoints::write_atomic;
use super::prepare::group_buckets;
use super::rollout::rollout_items;
use super::run::{Trainer, responses_hwe};
use super::state::AresState;
use crate::backend::Backend;

/// What the bootstrap pass found (`bootstrap.json` in the run directory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BootstrapResult {
    /// The first τ.
    pub tau: Option<f64>,
    /// `T_d` per bucket name.
    pub targets: BTreeMap<String, f64>,
    /// Difficulty per prompt.
    pub difficulty: BTreeMap<String, String>,
    /// Accuracy of the pass.
    pub accuracy: f64,
    /// Responses generated.
    pub responses: usize,
}

impl<B: Backend + Clone> Trainer<B> {
    /// Bootstrap (docs/algorithms.md §2): one rollout over the training set without updates; sets the
    /// first τ, the targets `T_d` and every prompt's difficulty, and saves them as
    /// `bootstrap.json` (reused on resume). Skipped when already done.
    ///
    /// # Errors
    /// Generation, grading or I/O errors.
    pub fn bootstrap(&mut self) -> Result<Option<BootstrapResult>, TrainError> {
        if !self.cfg.data.bootstrap || self.state.step > 0 || self.bootstrap_done {
            return Ok(None);
        }
        let n = self.settings.n;
        let indices: Vec<usize> = (0..self.train.len()).collect();
        let params = self.rollout_params(0, u64::MAX);
        let bar = self.progress.bar((indices.len() * n) as u64, "bootstrap");
        let mut all_responses = Vec::new();
        let mut all_grades = Vec::new();
        let mut items_all = Vec::new();
        for chunk in indices.chunks(self.settings.rollout_chunk.max(n) / n.max(1)) {
            let items = self.items(chunk, 0)?;
            let base = all_responses.len() as u64;
            let responses = rollout_items(&self.actor, &items, n, &params, |d| {
                bar.set_position(base + d as u64);
            })?;
            let (_, grades) = self.grade(&items, &responses)?;
            all_responses.extend(responses);
            all_grades.extend(grades);
            items_all.extend(items);
        }
        bar.finish();
        let pass = responses_hwe(&all_responses, &self.settings, None)?;
        let buckets = group_buckets(&self.settings, n, &all_grades)?;
        // h̄_d over every sample of the bucket's prompts (docs/algorithms.md §2)
        let row_buckets: Vec<Difficulty> = (0..pass.counts.len()).map(|r| buckets[r / n]).collect();
        let counts: Vec<f64> = pass.counts.iter().map(|&c| c as f64).collect();
        let mean_hwe = bucket_means(&row_buckets, &counts)?;
        let mut result = BootstrapResult {
            tau: pass.batch_threshold,
            targets: BTreeMap::new(),
            difficulty: BTreeMap::new(),
            accuracy: all_grades.iter().filter(|g| g.correct).count() as f64
                / all_grades.len().max(1) as f64,
            responses: all_grades.len(),
        };
        for d in Difficulty::ALL {
            if let Some(mean) = mean_hwe[d] {
                result
                    .targets
                    .insert(d.name().into(), ares_core::round_half_even(mean));
            }
        }
        for (item, d) in items_all.iter().zip(&buckets) {
            result
                .difficulty
                .insert(item.global_id.clone(), d.name().into());
        }
        apply_bootstrap(&mut self.ares, &result)?;
        self.state.ares = self.ares.snapshot();
        let json = serde_json::to_vec_pretty(&result)
            .map_err(|e| TrainError::Internal(format!("bootstrap.json: {e}")))?;
        write_atomic(&self.run_dir.join("bootstrap.json"), &json)?;
        self.bootstrap_done = true;
        Ok(Some(result))
    }
}

/// Reads `bootstrap.json` of a run, if any.
pub(super) fn read_bootstrap(run_dir: &Path) -> Result<Option<BootstrapResult>, TrainError> {
    let path = run_dir.join("bootstrap.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(TrainError::io(path, e)),
    }
}

/// Sets τ, the targets and the difficulty map from a bootstrap result.
pub(super) fn apply_bootstrap(ares: &mut AresState, b: &BootstrapResult) -> Result<(), TrainError> {
    ares.tau.restore(b.tau)?;
    let get = |d: Difficulty| b.targets.get(d.name()).copied();
    ares.buckets.bootstrap(&PerBucket::new(
        get(Difficulty::Easy),
        get(Difficulty::Medium),
        get(Difficulty::Hard),
    ))?;
    for (id, name) in &b.difficulty {
        if let Some(d) = Difficulty::from_name(name) {
            ares.difficulty.insert(id.clone(), d);
        }
    }
    Ok(())
}
