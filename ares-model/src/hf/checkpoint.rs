//! A whole Hugging Face model directory: loaded in one call, and saved atomically in the
//! layout `transformers.AutoModelForCausalLM.from_pretrained` reads.

use std::path::{Path, PathBuf};

use super::HfError;
use super::config::{CONFIG_FILE, ModelConfig};
use super::generation::{GENERATION_CONFIG_FILE, GenerationConfig};
use super::json;
use super::tensor_files::{SINGLE_FILE, SaveDtype};
use super::weights::ModelWeights;

/// Config, optional generation config and weights of one model.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// `config.json`.
    pub config: ModelConfig,
    /// `generation_config.json`, when the directory has one.
    pub generation: Option<GenerationConfig>,
    /// The weights, as f32.
    pub weights: ModelWeights,
}

impl Checkpoint {
    /// Loads `config.json`, `generation_config.json` (if present) and the weights of `dir`.
    pub fn load(dir: &Path) -> Result<Self, HfError> {
        let config = ModelConfig::from_dir(dir)?;
        let generation = GenerationConfig::from_dir(dir)?;
        let weights = ModelWeights::load(dir, &config)?;
        Ok(Self {
            config,
            generation,
            weights,
        })
    }

    /// Writes `model.safetensors` (in `dtype`), `config.json` and, if loaded,
    /// `generation_config.json` into `dir`.
    ///
    /// Atomic per directory: everything is written into a sibling temporary directory that
    /// is then renamed to `dir`. An existing `dir` is first renamed aside and removed only
    /// after the new one is in place, so a crash leaves the old or the new checkpoint
    /// (the old one possibly under `.<name>.old-<pid>`), never a half-written one.
    pub fn save(&self, dir: &Path, dtype: SaveDtype) -> Result<(), HfError> {
        self.weights.check(&self.config)?;
        save_atomically(dir, |tmp| self.write_files(tmp, dtype))
    }

    fn write_files(&self, dir: &Path, dtype: SaveDtype) -> Result<(), HfError> {
        self.weights
            .write_safetensors(&dir.join(SINGLE_FILE), &self.config, dtype)?;
        json::write_pretty(
            &dir.join(CONFIG_FILE),
            &self.config.to_json(dtype.torch_name()),
        )?;
        if let Some(g) = &self.generation {
            json::write_pretty(
                &dir.join(GENERATION_CONFIG_FILE),
                &serde_json::Value::Object(g.raw().clone()),
            )?;
        }
        Ok(())
    }
}

/// Writes a model directory atomically: `write` fills a sibling temporary directory that is
/// then renamed to `dir`. An existing `dir` is first renamed aside and removed only after
/// the new one is in place, so a crash leaves the old or the new directory (the old one
/// possibly under `.<name>.old-<pid>`), never a half-written one.
pub(crate) fn save_atomically(
    dir: &Path,
    write: impl FnOnce(&Path) -> Result<(), HfError>,
) -> Result<(), HfError> {
    let name = dir.file_name().ok_or_else(|| {
        HfError::io(
            dir,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a directory name"),
        )
    })?;
    let name = name.to_string_lossy();
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| HfError::io(&parent, e))?;
    let pid = std::process::id();
    let tmp = parent.join(format!(".{name}.tmp-{pid}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| HfError::io(&tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| HfError::io(&tmp, e))?;
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if dir.exists() {
        let old = parent.join(format!(".{name}.old-{pid}"));
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| HfError::io(&old, e))?;
        }
        std::fs::rename(dir, &old).map_err(|e| HfError::io(dir, e))?;
        if let Err(e) = std::fs::rename(&tmp, dir) {
            let _ = std::fs::rename(&old, dir);
            return Err(HfError::io(dir, e));
        }
        std::fs::remove_dir_all(&old).map_err(|e| HfError::io(&old, e))?;
    } else {
        std::fs::rename(&tmp, dir).map_err(|e| HfError::io(dir, e))?;
    }
    Ok(())
}
