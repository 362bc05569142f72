//! The [`AdamW`] state on disk: one safetensors file holding, for every parameter of the
//! model (Hugging Face name and shape, as in the checkpoint), its first and second moments
//! as f32 tensors `<param>.exp_avg` and `<param>.exp_avg_sq`, with the step count and the
//! hyper-parameters in the header's metadata:
//!
//! ```text
//! format = "ares-adamw", version = "1", step = "<updates applied>",
//! beta1, beta2, eps, weight_decay   (informational: `load` takes the config to use)
//! ```
//!
//! Written atomically (a temporary file in the same directory, flushed to disk, then
//! renamed over the target), so a crash leaves the old file or the new one.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::optim::check_config;
use super::{AdamW, AdamWConfig, Model, ModelError};
use crate::backend::Backend;
use crate::hf::tensor_files::le_f32s;
use crate::hf::tensor_files::{SaveDtype, write_safetensors_streamed};
use crate::hf::weights::expected_tensors;

/// The `format` metadata value of an optimizer state file.
const FORMAT: &str = "ares-adamw";
/// The `version` metadata value this code writes and reads.
const VERSION: &str = "1";
/// Name suffixes of the two moments.
const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn bad(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::OptimizerState {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// `.<name>.tmp-<pid>` next to `path`.
fn temp_path(path: &Path) -> Result<PathBuf, ModelError> {
    let name = path.file_name().ok_or_else(|| {
        io(path)(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a file name",
        ))
    })?;
    let tmp = format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id());
    Ok(path.with_file_name(tmp))
}

impl<B: Backend> AdamW<B> {
    /// Writes the moments and step count of this optimizer for `model` to `path` (see the
    /// module docs for the format), atomically.
    ///
    /// # Errors
    /// This optimizer made for another model ([`ModelError::LayoutMismatch`]), a backend
    /// failure, or an I/O error naming the file.
    pub fn save(&self, model: &Model<B>, path: &Path) -> Result<(), ModelError> {
        if !model.weights.same_layout(&self.exp_avg) {
            return Err(ModelError::LayoutMismatch {
                what: "optimizer moments",
            });
        }
        let be = &model.backend;
        let params = expected_tensors(&model.config);
        // (name, shape, parameter, which moment): each downloaded just before it is written
        let mut names = Vec::with_capacity(2 * params.len());
        for (name, shape) in &params {
            for (k, suffix) in MOMENTS.iter().enumerate() {
                names.push((
                    format!("{name}.{suffix}"),
                    shape.as_slice(),
                    name.as_str(),
                    k,
                ));
            }
        }
        let heads: Vec<(&str, &[usize])> =
            names.iter().map(|(n, s, _, _)| (n.as_str(), *s)).collect();
        let c = &self.config;
        let metadata: HashMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("version", VERSION.to_string()),
            ("step", self.step.to_string()),
            ("beta1", c.beta1.to_string()),
            ("beta2", c.beta2.to_string()),
            ("eps", c.eps.to_string()),
            ("weight_decay", c.weight_decay.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();

        let tmp = temp_path(path)?;
        let moment = |i: usize| -> Result<std::borrow::Cow<'static, [f32]>, crate::hf::HfError> {
            let (_, _, param, k) = &names[i];
            let moments = if *k == 0 {
                &self.exp_avg
            } else {
                &self.exp_avg_sq
            };
            let fail = |e: ModelError| crate::hf::HfError::Safetensors {
                path: path.to_path_buf(),
                message: e.to_string(),
            };
            let t = moments.tensor(param).map_err(fail)?;
            let mut host = vec![0.0f32; t.len()];
            be.download(t, &mut host).map_err(|e| fail(e.into()))?;
            Ok(std::borrow::Cow::Owned(host))
        };
        let written = write_safetensors_streamed(&tmp, &heads, SaveDtype::F32, metadata, moment)
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

    /// An optimizer for `model` with hyper-parameters `config`, its moments and step count
    /// read from `path` (written by [`AdamW::save`]).
    ///
    /// # Errors
    /// A bad `config`; the file missing or unreadable ([`ModelError::Io`]); or
    /// [`ModelError::OptimizerState`] naming what does not fit: not an ares AdamW file (or
    /// another version), no valid `step`, a moment of a parameter of this model missing, a
    /// tensor that is not one (the state of another model), a dtype other than F32, a shape
    /// other than the parameter's, a non-finite moment or a negative second moment.
    pub fn load(model: &Model<B>, config: AdamWConfig, path: &Path) -> Result<Self, ModelError> {
        check_config(&config)?;
        let file = File::open(path).map_err(io(path))?;
        // SAFETY: the map is read-only and dropped before this function returns; a file
        // changed underneath by another process could only give wrong values, which the
        // checks below catch as far as they can (it is our own state file).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io(path))?;
        let (_, header) =
            SafeTensors::read_metadata(&mmap).map_err(|e| bad(path, e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let get = |key: &str| {
            meta.get(key)
                .map(String::as_str)
                .ok_or_else(|| bad(path, format!("metadata has no `{key}`")))
        };
        let format = get("format")?;
        if format != FORMAT {
            return Err(bad(
                path,
                format!("metadata format = `{format}`, expected `{FORMAT}`"),
            ));
        }
        let version = get("version")?;
        if version != VERSION {
            return Err(bad(
                path,
                format!("metadata version = `{version}`, this build reads `{VERSION}`"),
            ));
        }
        let step_text = get("step")?;
        let step: u64 = step_text.parse().map_err(|_| {
            bad(
                path,
                format!("metadata step = `{step_text}` is not a whole number"),
            )
        })?;

        let st = SafeTensors::deserialize(&mmap).map_err(|e| bad(path, e.to_string()))?;
        let params = expected_tensors(&model.config);
        let wanted: BTreeSet<String> = params
            .iter()
            .flat_map(|(n, _)| MOMENTS.iter().map(move |m| format!("{n}.{m}")))
            .collect();
        if let Some(extra) = st.names().into_iter().find(|n| !wanted.contains(*n)) {
            return Err(bad(
                path,
                format!(
                    "tensor `{extra}` is not a moment of this model's parameters (the state of another model?)"
                ),
            ));
        }

        let be = &model.backend;
        let mut exp_avg = model.weights.zeros_like(be)?;
        let mut exp_avg_sq = model.weights.zeros_like(be)?;
        for (name, shape) in &params {
            for (suffix, moments) in MOMENTS.iter().zip([&mut exp_avg, &mut exp_avg_sq]) {
                let key = format!("{name}.{suffix}");
                let t = st
                    .tensor(&key)
                    .map_err(|_| bad(path, format!("tensor `{key}` is missing")))?;
                if t.dtype() != Dtype::F32 {
                    return Err(bad(
                        path,
                        format!("tensor `{key}` is {:?}, expected F32", t.dtype()),
                    ));
                }
                if t.shape() != shape.as_slice() {
                    return Err(bad(
                        path,
                        format!(
                            "tensor `{key}` has shape {:?}, the parameter has {shape:?}",
                            t.shape()
                        ),
                    ));
                }
                let values = le_f32s(t.data());
                let second = *suffix == "exp_avg_sq";
                if let Some((i, v)) = values
                    .iter()
                    .enumerate()
                    .find(|(_, v)| !v.is_finite() || (second && **v < 0.0))
                {
                    return Err(bad(
                        path,
                        format!("tensor `{key}` holds {v} at index {i} (corrupt state)"),
                    ));
                }
                be.upload(&values, moments.tensor_mut(name)?)?;
            }
        }
        Ok(Self {
            config,
            step,
            exp_avg,
            exp_avg_sq,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_file_sits_next_to_the_target() {
        let t = temp_path(Path::new("/a/b/opt.safetensors")).unwrap();
        assert_eq!(t.parent(), Some(Path::new("/a/b")));
        let name = t.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(".opt.safetensors.tmp-"), "{name}");
        assert!(temp_path(Path::new("/")).is_err());
    }
}
