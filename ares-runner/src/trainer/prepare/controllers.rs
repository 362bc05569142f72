//! [`AresState`]: what the ARES controllers carry from step to step (docs/algorithms.md §1–§2, §4) —
//! the global threshold τ, each bucket's target `T_d`, `α_d`, `λ_d`, the adaptive KL
//! coefficient, and the last known difficulty of every prompt — with its serialisable
//! snapshot for checkpoints.

use std::collections::BTreeMap;

use ares_core::difficulty::{
    BucketController, BucketState, Difficulty, DifficultyConfig, PerBucket,
};
use ares_core::entropy::ThresholdEma;
use ares_core::entropy_bonus::{EntropyCoefController, EntropyCoefState};
use ares_core::kl::{AdaptiveKlController, KlController};
use serde::{Deserialize, Serialize};

use crate::trainer::TrainError;
use crate::trainer::prepare::rewards::BucketValues;
use crate::trainer::setup::settings::{KlControl, StepSettings};

/// The controllers' live state.
#[derive(Debug, Clone)]
pub struct AresState {
    /// τ.
    pub tau: ThresholdEma<f64>,
    /// `T_d`, `α_d`, `λ_d`.
    pub buckets: BucketController<f64>,
    /// The KL coefficient's controller (one β under `Global`, the buckets' λ_d under dual
    /// ascent).
    pub kl: KlControl,
    /// Last bucket of each prompt, by `global_id`.
    pub difficulty: BTreeMap<String, Difficulty>,
    /// The entropy bonus's coefficient (`None`: no bonus).
    pub entropy_coef: Option<EntropyCoefController<f64>>,
}

/// One bucket in a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BucketSnapshot {
    /// `T_d`.
    pub target: Option<f64>,
    /// `α_d`.
    pub alpha: f64,
    /// `λ_d`.
    pub lambda: f64,
}

/// [`AresState`] as saved in `trainer_state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AresSnapshot {
    /// τ (`None` before the first batch without bootstrap).
    pub tau: Option<f64>,
    /// Buckets by name.
    pub buckets: BTreeMap<String, BucketSnapshot>,
    /// β of the adaptive controller.
    pub adaptive_kl: Option<f64>,
    /// Difficulty name of each prompt seen.
    pub difficulty: BTreeMap<String, String>,
    /// The entropy bonus's coefficient for the next step (absent in checkpoints of runs
    /// without the bonus, and of versions before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy_coef: Option<f64>,
}

impl AresState {
    /// Fresh controllers from the settings.
    ///
    /// # Errors
    /// Invalid controller settings.
    pub fn new(settings: &StepSettings) -> Result<Self, TrainError> {
        Ok(Self {
            tau: ThresholdEma::new(settings.tau_momentum)?,
            buckets: BucketController::new(settings.difficulty)?,
            kl: settings.kl.control,
            difficulty: BTreeMap::new(),
            entropy_coef: settings.entropy_bonus,
        })
    }

    /// Each bucket's target `T_d` and `α_d` in force: what the rewards read.
    pub fn bucket_values(&self) -> BucketValues {
        let st = self.buckets.state();
        BucketValues {
            target: PerBucket::new(st.easy.target, st.medium.target, st.hard.target),
            alpha: PerBucket::new(st.easy.alpha, st.medium.alpha, st.hard.alpha),
        }
    }

    /// The β of a sample in bucket `d` (before dynamic HWE weighting).
    pub fn beta(&self, d: Difficulty) -> f64 {
        match self.kl {
            KlControl::Global(c) => c.value(),
            KlControl::DualAscent => self.buckets.lambda(d),
        }
    }

    /// Moves β after a step charged the KL with it (docs/algorithms.md §4, §2): the adaptive
    /// controller from the batch's token-mean KL `token_mean_kl` over `rows` samples, dual
    /// ascent from the mean KL of each bucket `bucket_kl` at RL step `step`; a fixed β stays.
    ///
    /// # Errors
    /// Non-finite KL values.
    pub fn update_kl(
        &mut self,
        token_mean_kl: f64,
        rows: usize,
        bucket_kl: &PerBucket<Option<f64>>,
        step: u64,
    ) -> Result<(), TrainError> {
        match &mut self.kl {
            KlControl::Global(c) => {
                c.update(token_mean_kl, rows)?;
            }
            KlControl::DualAscent => {
                self.buckets
                    .step(&PerBucket::splat(None), bucket_kl, step)?;
            }
        }
        Ok(())
    }

    /// The entropy bonus's coefficient in force, then moves it toward the target from the
    /// step's mean token entropy `mean_entropy` (docs/algorithms.md §16.2); `None` without
    /// a bonus.
    ///
    /// # Errors
    /// A mean entropy that is not finite and ≥ 0.
    pub fn use_entropy_coef(&mut self, mean_entropy: f64) -> Result<Option<f64>, TrainError> {
        match &mut self.entropy_coef {
            Some(c) => {
                let used = c.coef;
                c.update(mean_entropy)?;
                Ok(Some(used))
            }
            None => Ok(None),
        }
    }

    /// The serialisable snapshot.
    pub fn snapshot(&self) -> AresSnapshot {
        let buckets = Difficulty::ALL
            .iter()
            .map(|&d| {
                let s = self.buckets.state()[d];
                (
                    d.name().to_string(),
                    BucketSnapshot {
                        target: s.target,
                        alpha: s.alpha,
                        lambda: s.lambda,
                    },
                )
            })
            .collect();
        AresSnapshot {
            tau: self.tau.tau(),
            buckets,
            adaptive_kl: match self.kl {
                KlControl::Global(KlController::Adaptive(c)) => Some(c.value()),
                _ => None,
            },
            difficulty: self
                .difficulty
                .iter()
                .map(|(k, d)| (k.clone(), d.name().to_string()))
                .collect(),
            entropy_coef: self.entropy_coef.map(|c| c.coef),
        }
    }

    /// The state of `snapshot` under `settings`.
    ///
    /// # Errors
    /// A snapshot that does not fit the settings (unknown bucket name, non-finite values).
    pub fn restore(settings: &StepSettings, snapshot: &AresSnapshot) -> Result<Self, TrainError> {
        let mut state = Self::new(settings)?;
        state.tau.restore(snapshot.tau)?;
        let get = |d: Difficulty| -> Result<BucketState<f64>, TrainError> {
            let b = snapshot.buckets.get(d.name()).ok_or_else(|| {
                TrainError::Invalid(format!(
                    "trainer_state.json: bucket {:?} is missing",
                    d.name()
                ))
            })?;
            Ok(BucketState {
                target: b.target,
                alpha: b.alpha,
                lambda: b.lambda,
            })
        };
        let buckets = PerBucket::new(
            get(Difficulty::Easy)?,
            get(Difficulty::Medium)?,
            get(Difficulty::Hard)?,
        );
        let config: DifficultyConfig<f64> = settings.difficulty;
        state.buckets = BucketController::with_state(config, buckets)?;
        if let (KlControl::Global(KlController::Adaptive(c)), Some(v)) =
            (&mut state.kl, snapshot.adaptive_kl)
        {
            *c = AdaptiveKlController::new(v, c.target(), c.horizon())?;
        }
        match (&mut state.entropy_coef, snapshot.entropy_coef) {
            (Some(c), Some(coef)) => c.restore(EntropyCoefState { coef })?,
            (Some(_), None) => {
                return Err(TrainError::Invalid(
                    "trainer_state.json has no entropy_coef, but worker.actor.entropy_bonus is \
                     on: the checkpoint was written by a run without the bonus"
                        .into(),
                ));
            }
            _ => {}
        }
        for (id, name) in &snapshot.difficulty {
            let d = Difficulty::from_name(name).ok_or_else(|| {
                TrainError::Invalid(format!(
                    "trainer_state.json: difficulty of {id:?} is {name:?}, not easy/medium/hard"
                ))
            })?;
            state.difficulty.insert(id.clone(), d);
        }
        Ok(state)
    }
}
