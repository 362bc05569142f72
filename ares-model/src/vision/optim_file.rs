//! The vision tower's AdamW moments on disk ([`VisionMoments::save`] / [`VisionMoments::load`]):
//! one safetensors file, beside the language model's optimizer file, holding per parameter
//! slot its two moments stacked over blocks, `<name>.exp_avg` and `<name>.exp_avg_sq` (the
//! name of [`ParamSpec`](super::weights::ParamSpec) with `#` for the block index; with LoRA
//! on the tower, each pair's `A` and `B`: `blocks.#.attn.qkv.lora_A.weight`), and
//! `format = "ares-adamw-vision"`, `version = "1"` in the metadata. The step count is the
//! language model's optimizer's (one step for both). Written atomically (temporary file,
//! flushed, renamed).

use std::collections::HashMap;
use std::path::Path;

use safetensors::SafeTensors;

use super::model::VisionMoments;
use super::tower::VisionTower;
use crate::backend::Backend;
use crate::model::optim_file::{read_header, read_moments, save_moments};
use crate::model::{ModelError, Moments, StateDtype};

const FORMAT: &str = "ares-adamw-vision";
const VERSION: &str = "2";

fn bad(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::OptimizerState {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

impl<B: Backend> VisionMoments<B> {
    /// Writes both moments of every trained tower parameter to `path`, atomically.
    ///
    /// # Errors
    /// A backend failure, or an I/O error naming the file.
    pub fn save(&self, be: &B, tower: &VisionTower<B>, path: &Path) -> Result<(), ModelError> {
        let names = tower.trainable_names();
        if names.len() != self.moments.len() {
            return Err(bad(path, "the moments are not the tower's"));
        }
        let params: Vec<_> = names
            .into_iter()
            .zip(&self.moments)
            .map(|((name, shape), m)| (name, shape, m.dtype()))
            .collect();
        let dtype = self.state_dtype();
        let metadata: HashMap<String, String> = [
            ("format", FORMAT),
            ("version", VERSION),
            ("state_dtype", dtype.name()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        save_moments(path, &params, metadata, |p| self.moments[p].read(be, 0))
    }

    /// How the moments are stored (short tensors keep f32 under `int8`).
    pub fn state_dtype(&self) -> StateDtype {
        self.state_dtype
    }

    /// Reads moments written by [`VisionMoments::save`] for `tower` (its weights, or its
    /// LoRA pairs), stored as `dtype` says (bit for bit when the file holds that dtype).
    ///
    /// # Errors
    /// A missing or malformed file, a tensor missing or of another shape or dtype (named),
    /// or a backend failure.
    pub fn load(
        be: &B,
        tower: &VisionTower<B>,
        dtype: StateDtype,
        path: &Path,
    ) -> Result<Self, ModelError> {
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(path, e.to_string()))?;
        let meta = meta.metadata().clone().unwrap_or_default();
        read_header(&meta, path, FORMAT, false)?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(path, e.to_string()))?;
        let moments = tower
            .trainable_names()
            .iter()
            .map(|(name, shape)| {
                let host = read_moments(&st, path, name, shape)?;
                let len = shape.iter().product::<usize>();
                let mut m = Moments::zeros(be, len, len.max(1), dtype)?;
                m.write(be, 0, [&host[0], &host[1]])?;
                Ok::<_, ModelError>(m)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            moments,
            state_dtype: dtype,
        })
    }
}
