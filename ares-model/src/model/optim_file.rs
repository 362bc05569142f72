//! The [`AdamW`] state on disk: one safetensors file holding, for every parameter of the
//! model (Hugging Face name and shape, as in the checkpoint), its first and second moments
//! `<param>.exp_avg` and `<param>.exp_avg_sq` as stored, with the step count and the
//! hyper-parameters in the header's metadata:
//!
//! ```text
//! format = "ares-adamw", version = "2", step = "<updates applied>",
//! state_dtype = "f32" | "bf16" | "int8",
//! beta1, beta2, eps, weight_decay   (informational: `load` takes the config to use)
//! ```
//!
//! A moment is an F32 tensor, a BF16 one (`state_dtype: bf16`), or under `int8` a U8
//! tensor of codes with an F32 tensor `<param>.exp_avg.absmax` (`.exp_avg_sq.absmax`) of
//! one scale per block of 2 048 (tensors too short to quantise stay F32). Version 1 files
//! (f32 moments, no `state_dtype`) read as before. Loading into another state dtype reads
//! the moments as f32 and stores them again; into the same one, bit for bit.
//!
//! Written atomically (a temporary file in the same directory, flushed to disk, then
//! renamed over the target), so a crash leaves the old file or the new one.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::moments::{HostMoment, StateDtype};
use super::optim::{check_config, upload_maps};
use super::{AdamW, AdamWConfig, Model, ModelError, Moments};
use crate::backend::Backend;
use crate::hf::tensor_files::{TensorData, le_f32s, le_u16s, write_safetensors_typed};

/// The `format` metadata value of an optimizer state file.
const FORMAT: &str = "ares-adamw";
/// The `version` metadata value this code writes.
const VERSION: &str = "2";
/// The versions this code reads (1: f32 moments only).
const READS: [&str; 2] = ["1", "2"];
/// Name suffixes of the two moments.
const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];
/// Name suffix of an 8-bit moment's block scales.
const ABSMAX: &str = "absmax";

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

/// Writes `path` through a temporary file: `write` fills the temporary, which is then
/// flushed to disk and renamed over `path`; on any failure the temporary is removed.
pub(crate) fn write_atomically(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    let tmp = temp_path(path)?;
    let written = write(&tmp)
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

/// The safetensors tensors of one parameter's moments as stored in `dtype`: `(name, dtype,
/// shape)` with `(which moment, is the scale)`.
pub(crate) fn moment_heads(
    param: &str,
    shape: &[usize],
    dtype: StateDtype,
) -> Vec<(String, Dtype, Vec<usize>, usize, bool)> {
    let len = shape.iter().product::<usize>();
    let mut out = Vec::with_capacity(4);
    for (k, suffix) in MOMENTS.iter().enumerate() {
        let name = format!("{param}.{suffix}");
        match dtype {
            StateDtype::F32 => out.push((name, Dtype::F32, shape.to_vec(), k, false)),
            StateDtype::Bf16 => out.push((name, Dtype::BF16, shape.to_vec(), k, false)),
            StateDtype::Int8 => {
                let blocks = ares_cpu::ops::optim_int8::blocks(len);
                out.push((
                    format!("{name}.{ABSMAX}"),
                    Dtype::F32,
                    vec![blocks],
                    k,
                    true,
                ));
                out.push((name, Dtype::U8, shape.to_vec(), k, false));
            }
        }
    }
    out
}

/// The data of head `(moment k, scale?)` of `moments` (one parameter's, as read).
pub(crate) fn moment_data(moments: &[HostMoment; 2], k: usize, scale: bool) -> TensorData<'_> {
    match (&moments[k], scale) {
        (HostMoment::F32(x), _) => TensorData::F32(Cow::Borrowed(x)),
        (HostMoment::Bf16(x), _) => TensorData::Bf16(Cow::Borrowed(x)),
        (HostMoment::Int8 { absmax, .. }, true) => TensorData::F32(Cow::Borrowed(absmax)),
        (HostMoment::Int8 { codes, .. }, false) => TensorData::U8(Cow::Borrowed(codes)),
    }
}

/// Writes the moments `read(p)` of the parameters `params` (name, shape, stored dtype) to
/// `path` with `metadata`, atomically, one parameter's moments held at a time.
pub(crate) fn save_moments(
    path: &Path,
    params: &[(String, Vec<usize>, StateDtype)],
    metadata: HashMap<String, String>,
    mut read: impl FnMut(usize) -> Result<[HostMoment; 2], ModelError>,
) -> Result<(), ModelError> {
    // (name, dtype, shape, parameter, moment, scale?)
    let mut heads = Vec::new();
    for (p, (name, shape, dtype)) in params.iter().enumerate() {
        for (n, d, s, k, scale) in moment_heads(name, shape, *dtype) {
            heads.push((n, d, s, p, k, scale));
        }
    }
    let typed: Vec<(&str, Dtype, &[usize])> = heads
        .iter()
        .map(|h| (h.0.as_str(), h.1, h.2.as_slice()))
        .collect();
    write_atomically(path, |tmp| {
        let mut held: Option<(usize, [HostMoment; 2])> = None;
        write_safetensors_typed(tmp, &typed, metadata, |i| {
            let (_, _, _, p, k, scale) = heads[i];
            if held.as_ref().is_none_or(|(q, _)| *q != p) {
                let moments = read(p).map_err(|e| crate::hf::HfError::Safetensors {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
                held = Some((p, moments));
            }
            let moments =
                held.as_ref()
                    .map(|(_, m)| m)
                    .ok_or_else(|| crate::hf::HfError::Safetensors {
                        path: path.to_path_buf(),
                        message: "moments not read".into(),
                    })?;
            // the data is copied out: `held` is replaced when the next parameter is read
            Ok(match moment_data(moments, k, scale) {
                TensorData::F32(x) => TensorData::F32(Cow::Owned(x.into_owned())),
                TensorData::Bf16(x) => TensorData::Bf16(Cow::Owned(x.into_owned())),
                TensorData::U8(x) => TensorData::U8(Cow::Owned(x.into_owned())),
            })
        })
        .map_err(|e| bad(path, e.to_string()))
    })
}

/// Reads one parameter's two moments (`<param>.exp_avg`, `.exp_avg_sq`) of `shape` from
/// `st`, checked: dtype F32, BF16 or U8 with its scales, the parameter's shape, finite
/// values, a second moment never negative.
pub(crate) fn read_moments(
    st: &SafeTensors<'_>,
    path: &Path,
    param: &str,
    shape: &[usize],
) -> Result<[HostMoment; 2], ModelError> {
    let len = shape.iter().product::<usize>();
    let read = |k: usize| -> Result<HostMoment, ModelError> {
        let key = format!("{param}.{}", MOMENTS[k]);
        let t = st
            .tensor(&key)
            .map_err(|_| bad(path, format!("tensor `{key}` is missing")))?;
        if t.shape() != shape {
            return Err(bad(
                path,
                format!(
                    "tensor `{key}` has shape {:?}, the parameter has {shape:?}",
                    t.shape()
                ),
            ));
        }
        let moment = match t.dtype() {
            Dtype::F32 => HostMoment::F32(le_f32s(t.data())),
            Dtype::BF16 => HostMoment::Bf16(le_u16s(t.data())),
            Dtype::U8 => {
                let scale_key = format!("{key}.{ABSMAX}");
                let s = st.tensor(&scale_key).map_err(|_| {
                    bad(
                        path,
                        format!("tensor `{scale_key}` (the 8-bit scales of `{key}`) is missing"),
                    )
                })?;
                let blocks = ares_cpu::ops::optim_int8::blocks(len);
                if s.dtype() != Dtype::F32 || s.shape() != [blocks] {
                    return Err(bad(
                        path,
                        format!(
                            "tensor `{scale_key}` must be F32 [{blocks}], it is {:?} {:?}",
                            s.dtype(),
                            s.shape()
                        ),
                    ));
                }
                let absmax = le_f32s(s.data());
                if let Some((i, a)) = absmax
                    .iter()
                    .enumerate()
                    .find(|(_, a)| !(a.is_finite() && **a >= 0.0))
                {
                    return Err(bad(
                        path,
                        format!("tensor `{scale_key}` holds {a} at index {i} (corrupt state)"),
                    ));
                }
                HostMoment::Int8 {
                    codes: t.data().to_vec(),
                    absmax,
                }
            }
            other => {
                return Err(bad(
                    path,
                    format!("tensor `{key}` is {other:?}, expected F32, BF16 or U8"),
                ));
            }
        };
        let second = k == 1;
        let values = moment.to_f32(second)?;
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
        Ok(moment)
    };
    Ok([read(0)?, read(1)?])
}

/// The checked metadata of a state file: `format` must be `format`, `version` one this
/// code reads; returns the step count (when `with_step`) and the state dtype (`f32` when
/// absent).
pub(crate) fn read_header(
    st_meta: &HashMap<String, String>,
    path: &Path,
    format: &str,
    with_step: bool,
) -> Result<(u64, StateDtype), ModelError> {
    let get = |key: &str| {
        st_meta
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| bad(path, format!("metadata has no `{key}`")))
    };
    let found = get("format")?;
    if found != format {
        return Err(bad(
            path,
            format!("metadata format = `{found}`, expected `{format}`"),
        ));
    }
    let version = get("version")?;
    if !READS.contains(&version) {
        return Err(bad(
            path,
            format!(
                "metadata version = `{version}`, this build reads {}",
                READS.join(" and ")
            ),
        ));
    }
    let step = if with_step {
        let text = get("step")?;
        text.parse().map_err(|_| {
            bad(
                path,
                format!("metadata step = `{text}` is not a whole number"),
            )
        })?
    } else {
        0
    };
    let dtype = match st_meta.get("state_dtype") {
        None => StateDtype::F32,
        Some(name) => StateDtype::from_name(name).ok_or_else(|| {
            bad(
                path,
                format!("metadata state_dtype = `{name}`: expected f32, bf16 or int8"),
            )
        })?,
    };
    Ok((step, dtype))
}

impl<B: Backend> AdamW<B> {
    /// Writes the moments and step count of this optimizer for `model` to `path` (see the
    /// module docs for the format), atomically.
    ///
    /// # Errors
    /// This optimizer made for another model ([`ModelError::LayoutMismatch`]), a backend
    /// failure, or an I/O error naming the file.
    pub fn save(&self, model: &Model<B>, path: &Path) -> Result<(), ModelError> {
        self.save_with(model, path, |_, _| {
            Err(ModelError::LayoutMismatch {
                what: "optimizer moments (a ZeRO-1 shard saves with the other ranks' moments)",
            })
        })
    }

    /// The moments of tensor `item` of each trainable buffer this optimizer updates
    /// (ZeRO-1: a rank's share), as stored: `(buffer, item, [first, second])`.
    ///
    /// # Errors
    /// A backend failure.
    pub fn owned_moments(
        &self,
        model: &Model<B>,
    ) -> Result<Vec<(usize, usize, [HostMoment; 2])>, ModelError> {
        let be = &model.backend;
        let mut out = Vec::new();
        for (_, _, (buffer, item)) in model.trainable_tensors()? {
            if self.owns(buffer) {
                out.push((buffer, item, self.moments[buffer].read(be, item)?));
            }
        }
        Ok(out)
    }

    /// [`AdamW::save`] of a ZeRO-1 shard: the moments of buffers another rank updates come
    /// from `others(buffer, item)` (what that rank's [`AdamW::owned_moments`] gave), so
    /// the file is the whole optimizer's, as a run without shards writes it.
    ///
    /// # Errors
    /// As [`AdamW::save`]; `others`' error.
    pub fn save_with(
        &self,
        model: &Model<B>,
        path: &Path,
        others: impl Fn(usize, usize) -> Result<[HostMoment; 2], ModelError>,
    ) -> Result<(), ModelError> {
        if !self.fits(model.trainable_lens().into_iter()) {
            return Err(ModelError::LayoutMismatch {
                what: "optimizer moments",
            });
        }
        let be = &model.backend;
        let mut params = Vec::new();
        let mut places = Vec::new();
        for (name, shape, (buffer, item)) in model.trainable_tensors()? {
            params.push((name, shape, self.moments[buffer].dtype()));
            places.push((buffer, item));
        }
        let c = &self.config;
        let metadata: HashMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("version", VERSION.to_string()),
            ("step", self.step.to_string()),
            ("state_dtype", self.state_dtype.name().to_string()),
            ("beta1", c.beta1.to_string()),
            ("beta2", c.beta2.to_string()),
            ("eps", c.eps.to_string()),
            ("weight_decay", c.weight_decay.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        save_moments(path, &params, metadata, |p| {
            let (buffer, item) = places[p];
            if self.owns(buffer) {
                self.moments[buffer].read(be, item)
            } else {
                others(buffer, item)
            }
        })
    }

    /// An optimizer for `model` with hyper-parameters `config`, its moments and step count
    /// read from `path` (written by [`AdamW::save`]), stored in the file's state dtype.
    ///
    /// # Errors
    /// As [`AdamW::load_as`].
    pub fn load(model: &Model<B>, config: AdamWConfig, path: &Path) -> Result<Self, ModelError> {
        Self::load_with(model, config, None, path)
    }

    /// [`AdamW::load`] with the moments stored as `state_dtype` says: bit for bit when the
    /// file holds that dtype, otherwise read as f32 and stored again (rounded or quantised).
    ///
    /// # Errors
    /// A bad `config`; the file missing or unreadable ([`ModelError::Io`]); or
    /// [`ModelError::OptimizerState`] naming what does not fit: not an ares AdamW file (or
    /// another version), no valid `step`, a moment of a parameter of this model missing, a
    /// tensor that is not one (the state of another model), a dtype other than F32, BF16
    /// or U8 (with its scales), a shape other than the parameter's, a non-finite moment or
    /// a negative second moment.
    pub fn load_as(
        model: &Model<B>,
        config: AdamWConfig,
        state_dtype: StateDtype,
        path: &Path,
    ) -> Result<Self, ModelError> {
        Self::load_with(model, config, Some(state_dtype), path)
    }

    fn load_with(
        model: &Model<B>,
        config: AdamWConfig,
        state_dtype: Option<StateDtype>,
        path: &Path,
    ) -> Result<Self, ModelError> {
        check_config(&config)?;
        let file = File::open(path).map_err(io(path))?;
        // SAFETY: the map is read-only and dropped before this function returns; a file
        // changed underneath by another process could only give wrong values, which the
        // checks below catch as far as they can (it is our own state file).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io(path))?;
        let (_, header) =
            SafeTensors::read_metadata(&mmap).map_err(|e| bad(path, e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let (step, file_dtype) = read_header(&meta, path, FORMAT, true)?;
        let state_dtype = state_dtype.unwrap_or(file_dtype);

        let st = SafeTensors::deserialize(&mmap).map_err(|e| bad(path, e.to_string()))?;
        let params = model.trainable_tensors()?;
        let wanted: BTreeSet<String> = params
            .iter()
            .flat_map(|(n, s, _)| {
                moment_heads(n, s, StateDtype::Int8)
                    .into_iter()
                    .chain(moment_heads(n, s, StateDtype::F32))
                    .map(|h| h.0)
            })
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
        let mut moments: Vec<Moments<B>> = model
            .trainable_lens()
            .into_iter()
            .zip(model.trainable_items())
            .map(|(len, item)| Moments::zeros(be, len, item, state_dtype))
            .collect::<Result<_, _>>()?;
        for (name, shape, (buffer, item)) in &params {
            let host = read_moments(&st, path, name, shape)?;
            moments[*buffer].write(be, *item, [&host[0], &host[1]])?;
        }
        Ok(Self {
            config,
            step,
            state_dtype,
            moments,
            maps: upload_maps(be)?,
            owned: None,
            rounding_seed: 0,
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
