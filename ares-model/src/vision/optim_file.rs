//! The vision tower's AdamW moments on disk ([`VisionMoments::save`] / [`VisionMoments::load`]):
//! one safetensors file, beside the language model's optimizer file, holding per parameter
//! slot its two moments stacked over blocks, `<name>.exp_avg` and `<name>.exp_avg_sq` (the
//! name of [`ParamSpec`](super::weights::ParamSpec) with `#` for the block index), and
//! `format = "ares-adamw-vision"`, `version = "1"` in the metadata. The step count is the
//! language model's optimizer's (one step for both). Written atomically (temporary file,
//! flushed, renamed).

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use super::model::VisionMoments;
use super::tower::VisionTower;
use super::weights::{VisionParams, param_table};
use crate::backend::{Backend, DeviceBuffer, View, ViewMut};
use crate::hf::tensor_files::le_f32s;
use crate::hf::tensor_files::{NamedTensor, SaveDtype, write_safetensors_with_metadata};
use crate::model::ModelError;

const FORMAT: &str = "ares-adamw-vision";
const VERSION: &str = "1";

fn bad(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::OptimizerState {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl<B: Backend> VisionMoments<B> {
    /// Writes both moments of every tower parameter to `path`, atomically.
    ///
    /// # Errors
    /// A backend failure, or an I/O error naming the file.
    pub fn save(&self, be: &B, tower: &VisionTower<B>, path: &Path) -> Result<(), ModelError> {
        let table = param_table(tower.config());
        let mut named = Vec::new();
        for spec in &table {
            let mut shape = if spec.per_block {
                vec![tower.config().depth]
            } else {
                Vec::new()
            };
            shape.extend(&spec.shape);
            for (suffix, m) in [("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)] {
                let buf = m
                    .get(spec.slot)
                    .ok_or_else(|| bad(path, "moment missing"))?;
                let mut host = vec![0.0f32; buf.len()];
                be.download(View::whole(buf), &mut host)?;
                named.push((
                    format!("{}.{suffix}", spec.name.replace("{}", "#")),
                    shape.clone(),
                    host,
                ));
            }
        }
        let list: Vec<NamedTensor<'_>> = named
            .iter()
            .map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice()))
            .collect();
        let metadata: HashMap<String, String> = [("format", FORMAT), ("version", VERSION)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
        let written = write_safetensors_with_metadata(&tmp, &list, SaveDtype::F32, metadata)
            .map_err(|e| bad(path, e.to_string()))
            .and_then(|()| {
                File::open(&tmp)
                    .and_then(|f| f.sync_all())
                    .map_err(io(&tmp))
            })
            .and_then(|()| std::fs::rename(&tmp, path).map_err(io(path)));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// Reads moments written by [`VisionMoments::save`] for `tower`.
    ///
    /// # Errors
    /// A missing or malformed file, a tensor missing or of another shape (named), or a
    /// backend failure.
    pub fn load(be: &B, tower: &VisionTower<B>, path: &Path) -> Result<Self, ModelError> {
        let bytes = std::fs::read(path).map_err(io(path))?;
        let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(path, e.to_string()))?;
        let format = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("format").cloned());
        if format.as_deref() != Some(FORMAT) {
            return Err(bad(
                path,
                format!("format {format:?}, expected \"{FORMAT}\""),
            ));
        }
        let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(path, e.to_string()))?;
        let table = param_table(tower.config());
        let read = |suffix: &str| -> Result<VisionParams<B::Buffer>, ModelError> {
            VisionParams::build(&table, |spec| {
                let name = format!("{}.{suffix}", spec.name.replace("{}", "#"));
                let t = st
                    .tensor(&name)
                    .map_err(|_| bad(path, format!("{name} is missing")))?;
                let blocks = if spec.per_block {
                    tower.config().depth
                } else {
                    1
                };
                let len = blocks * spec.item();
                if t.dtype() != Dtype::F32 || t.data().len() != 4 * len {
                    return Err(bad(path, format!("{name}: expected {len} f32 values")));
                }
                let host = le_f32s(t.data());
                let mut buf = be.alloc(len)?;
                be.upload(&host, ViewMut::whole(&mut buf))?;
                Ok(buf)
            })
        };
        Ok(Self {
            exp_avg: read("exp_avg")?,
            exp_avg_sq: read("exp_avg_sq")?,
        })
    }
}
