//! The bootstrap's result (docs/algorithms.md §2): the first τ, the per-bucket targets `T_d`
//! and every prompt's difficulty, saved as `bootstrap.json` beside the checkpoints and
//! reused on resume. The pass that computes it is [`Trainer::bootstrap`](crate::trainer::Trainer),
//! in `run.rs` with the rest of the loop.

use std::collections::BTreeMap;
use std::path::Path;

use ares_core::difficulty::{Difficulty, PerBucket};
use serde::{Deserialize, Serialize};

use crate::trainer::TrainError;
use crate::trainer::prepare::controllers::AresState;

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

/// Reads `bootstrap.json` of a run, if any.
pub(crate) fn read_bootstrap(run_dir: &Path) -> Result<Option<BootstrapResult>, TrainError> {
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
pub(crate) fn apply_bootstrap(ares: &mut AresState, b: &BootstrapResult) -> Result<(), TrainError> {
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
