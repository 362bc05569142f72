//! The run directory's checkpoints: `checkpoints/step_000042/` each holding the model in
//! Hugging Face format (`model/`), the optimizer state and the trainer state.
//!
//! Atomic: a checkpoint is written into a hidden sibling `.step_000042.tmp-<pid>` and
//! renamed into place only when complete, so a crash leaves the previous checkpoints and
//! at most a hidden temporary directory (removed by the next save), never a half-written
//! `step_*`. Only the newest `save_limit` checkpoints are kept.

use std::path::{Path, PathBuf};

use crate::trainer::TrainError;

/// The `checkpoints/` directory of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointDir {
    root: PathBuf,
}

/// Directory name of the checkpoint of `step`.
fn step_name(step: u64) -> String {
    format!("step_{step:06}")
}

impl CheckpointDir {
    /// The checkpoints under `run_dir/checkpoints`.
    pub fn new(run_dir: &Path) -> Self {
        Self {
            root: run_dir.join("checkpoints"),
        }
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Completed checkpoints, oldest first, as `(step, path)`.
    ///
    /// # Errors
    /// The directory exists but cannot be read.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>, TrainError> {
        let entries = match std::fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(TrainError::io(&self.root, e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| TrainError::io(&self.root, e))?;
            let name = entry.file_name();
            let Some(step) = name
                .to_str()
                .and_then(|n| n.strip_prefix("step_"))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            out.push((step, entry.path()));
        }
        out.sort();
        Ok(out)
    }

    /// The directory of step `step`'s checkpoint (whether or not it exists).
    pub fn path_of(&self, step: u64) -> PathBuf {
        self.root.join(step_name(step))
    }

    /// The newest complete checkpoint: (step, directory).
    ///
    /// # Errors
    /// The directory cannot be listed.
    pub fn latest(&self) -> Result<Option<(u64, PathBuf)>, TrainError> {
        Ok(self.list()?.pop())
    }

    /// Writes the checkpoint of `step` with `write` (which fills the directory it is given),
    /// atomically, then removes all but the newest `keep` checkpoints (`keep = 0` keeps all).
    /// Returns the checkpoint's path.
    ///
    /// # Errors
    /// `write`'s error (the temporary directory is then removed) or an I/O failure.
    pub fn save(
        &self,
        step: u64,
        keep: usize,
        write: impl FnOnce(&Path) -> Result<(), TrainError>,
    ) -> Result<PathBuf, TrainError> {
        std::fs::create_dir_all(&self.root).map_err(|e| TrainError::io(&self.root, e))?;
        self.remove_stale_temporaries()?;
        let name = step_name(step);
        let tmp = self
            .root
            .join(format!(".{name}.tmp-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).map_err(|e| TrainError::io(&tmp, e))?;
        if let Err(e) = write(&tmp) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        sync_dir(&tmp);
        let dst = self.root.join(&name);
        if dst.exists() {
            // the same step saved again (e.g. the final save right after a periodic one)
            let old = self
                .root
                .join(format!(".{name}.old-{}", std::process::id()));
            std::fs::rename(&dst, &old).map_err(|e| TrainError::io(&dst, e))?;
            std::fs::rename(&tmp, &dst).map_err(|e| TrainError::io(&dst, e))?;
            std::fs::remove_dir_all(&old).map_err(|e| TrainError::io(&old, e))?;
        } else {
            std::fs::rename(&tmp, &dst).map_err(|e| TrainError::io(&dst, e))?;
        }
        sync_dir(&self.root);
        if keep > 0 {
            let all = self.list()?;
            let excess = all.len().saturating_sub(keep);
            for (_, path) in all.into_iter().take(excess) {
                std::fs::remove_dir_all(&path).map_err(|e| TrainError::io(&path, e))?;
            }
        }
        Ok(dst)
    }

    /// Removes hidden temporaries left by an interrupted save.
    fn remove_stale_temporaries(&self) -> Result<(), TrainError> {
        let entries = std::fs::read_dir(&self.root).map_err(|e| TrainError::io(&self.root, e))?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(".step_") && (name.contains(".tmp-") || name.contains(".old-")) {
                let p = entry.path();
                std::fs::remove_dir_all(&p).map_err(|e| TrainError::io(&p, e))?;
            }
        }
        Ok(())
    }
}

/// Best-effort fsync of a directory so the rename is durable (not available everywhere).
fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Writes `bytes` to `path` atomically (temporary file in the same directory, fsync,
/// rename).
///
/// # Errors
/// I/O failures, naming the path.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(|e| TrainError::io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| TrainError::io(&tmp, e))?;
    f.sync_all().map_err(|e| TrainError::io(&tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| TrainError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saves_atomically_and_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let ck = CheckpointDir::new(dir.path());
        assert_eq!(ck.latest().unwrap(), None);
        for step in [1u64, 2, 3] {
            ck.save(step, 2, |d| {
                write_atomic(&d.join("state.json"), step.to_string().as_bytes())
            })
            .unwrap();
        }
        let steps: Vec<u64> = ck.list().unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, [2, 3]);
        let (step, path) = ck.latest().unwrap().unwrap();
        assert_eq!(step, 3);
        assert_eq!(
            std::fs::read_to_string(path.join("state.json")).unwrap(),
            "3"
        );
    }

    #[test]
    fn a_failed_write_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let ck = CheckpointDir::new(dir.path());
        let err = ck
            .save(7, 0, |d| {
                std::fs::write(d.join("half"), b"x").unwrap();
                Err(TrainError::Invalid("disk full".into()))
            })
            .unwrap_err();
        assert!(err.to_string().contains("disk full"));
        assert_eq!(ck.list().unwrap(), []);
        let left: Vec<_> = std::fs::read_dir(ck.root()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
