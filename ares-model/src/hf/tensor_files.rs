//! The safetensors files of a model directory — one `model.safetensors`, or shards listed
//! by `model.safetensors.index.json` — memory-mapped, read as f32, and written back.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};

use super::HfError;
use super::json::{self, Fields};

/// The weights of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint: `weight_map` from tensor name to shard file.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The dtype weights are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveDtype {
    /// 32-bit floats: a bit-exact copy of the in-memory weights.
    F32,
    /// bfloat16, rounded to nearest even (as `tensor.to(torch.bfloat16)`): half the size.
    Bf16,
}

impl SaveDtype {
    /// The name transformers writes in `config.json` (`dtype` / `torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            SaveDtype::F32 => "float32",
            SaveDtype::Bf16 => "bfloat16",
        }
    }
}

struct Mapped {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    metadata: Metadata,
}

/// The tensors of a model directory, memory-mapped: names, shapes, and f32 copies on demand.
pub struct TensorFiles {
    source: PathBuf,
    files: Vec<Mapped>,
    location: BTreeMap<String, usize>,
}

impl TensorFiles {
    /// Opens `<dir>/model.safetensors`, or else the shards listed in
    /// `<dir>/model.safetensors.index.json`, checking every header.
    pub fn open(dir: &Path) -> Result<Self, HfError> {
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            let file = map(&single)?;
            let location = file
                .metadata
                .tensors()
                .into_keys()
                .map(|name| (name, 0))
                .collect();
            return Ok(Self {
                source: single,
                files: vec![file],
                location,
            });
        }
        let index = dir.join(INDEX_FILE);
        if !index.is_file() {
            return Err(HfError::MissingFile {
                path: single,
                what: format!("the model weights; no {INDEX_FILE} either"),
            });
        }
        let map_json = json::read_object(&index, "the shard index")?;
        let fields = Fields::new(&index, &map_json);
        let weight_map: BTreeMap<String, String> = fields.req("weight_map")?;
        let mut shards: BTreeMap<String, usize> = BTreeMap::new();
        let mut files = Vec::new();
        let mut location = BTreeMap::new();
        for (tensor, shard) in weight_map {
            let plain = Path::new(&shard)
                .file_name()
                .is_some_and(|n| n == shard.as_str());
            if !plain {
                return Err(fields.error(
                    "weight_map",
                    format!("shard `{shard}` of `{tensor}` is not a file name in this directory"),
                ));
            }
            let i = match shards.get(&shard) {
                Some(&i) => i,
                None => {
                    let path = dir.join(&shard);
                    if !path.is_file() {
                        return Err(HfError::MissingFile {
                            path,
                            what: format!("a shard listed in {}", index.display()),
                        });
                    }
                    files.push(map(&path)?);
                    shards.insert(shard.clone(), files.len() - 1);
                    files.len() - 1
                }
            };
            if files[i].metadata.info(&tensor).is_none() {
                return Err(fields.error(
                    &format!("weight_map.{tensor}"),
                    format!("shard `{shard}` has no tensor `{tensor}`"),
                ));
            }
            location.insert(tensor, i);
        }
        Ok(Self {
            source: index,
            files,
            location,
        })
    }

    /// The single weight file or the shard index: what the tensors were looked up in.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(String::as_str)
    }

    /// The file holding `name` and its shape, if present.
    pub fn shape(&self, name: &str) -> Option<(&Path, &[usize])> {
        let (file, info) = self.info(name)?;
        Some((&file.path, &info.shape))
    }

    fn info(&self, name: &str) -> Option<(&Mapped, &TensorInfo)> {
        let file = &self.files[*self.location.get(name)?];
        Some((file, file.metadata.info(name)?))
    }

    /// Tensor `name` converted to f32 (row-major), from F32, BF16 or F16 storage.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, HfError> {
        let (file, info) = self.info(name).ok_or_else(|| HfError::MissingTensor {
            path: self.source.clone(),
            tensor: name.to_string(),
        })?;
        let (start, end) = info.data_offsets;
        // read_metadata checked every offset against the file length.
        let bytes = &file.mmap[file.data_start + start..file.data_start + end];
        let out = match info.dtype {
            Dtype::F32 => le_f32s(bytes),
            Dtype::BF16 => le_u16s(bytes)
                .into_iter()
                .map(|b| bf16::from_bits(b).to_f32())
                .collect(),
            Dtype::F16 => le_u16s(bytes)
                .into_iter()
                .map(|b| f16::from_bits(b).to_f32())
                .collect(),
            other => {
                return Err(HfError::UnsupportedDtype {
                    path: file.path.clone(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        Ok(out)
    }
}

fn map(path: &Path) -> Result<Mapped, HfError> {
    let file = File::open(path).map_err(|e| HfError::io(path, e))?;
    // SAFETY: the map is read-only and lives as long as `Mapped`. Another process
    // truncating or rewriting the file while it is mapped is undefined behaviour that no
    // safe API can rule out; checkpoints are written by rename (never in place), as the
    // saver here and transformers do.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| HfError::io(path, e))?;
    let (n, metadata) = SafeTensors::read_metadata(&mmap).map_err(|e| HfError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    Ok(Mapped {
        path: path.to_path_buf(),
        mmap,
        data_start: 8 + n,
        metadata,
    })
}

/// One tensor to write: name, shape, f32 values (row-major).
pub type NamedTensor<'a> = (&'a str, &'a [usize], &'a [f32]);

/// Writes `tensors` as one safetensors file at `path` in `dtype`, with the
/// `{"format": "pt"}` metadata transformers expects.
pub fn write_safetensors(
    path: &Path,
    tensors: &[NamedTensor<'_>],
    dtype: SaveDtype,
) -> Result<(), HfError> {
    let metadata = [("format".to_string(), "pt".to_string())]
        .into_iter()
        .collect();
    write_safetensors_with_metadata(path, tensors, dtype, metadata)
}

/// Writes `tensors` as one safetensors file at `path` in `dtype`, with `metadata` as the
/// header's `__metadata__` (string to string).
pub fn write_safetensors_with_metadata(
    path: &Path,
    tensors: &[NamedTensor<'_>],
    dtype: SaveDtype,
    metadata: std::collections::HashMap<String, String>,
) -> Result<(), HfError> {
    let heads: Vec<(&str, &[usize])> = tensors.iter().map(|&(n, s, _)| (n, s)).collect();
    write_safetensors_streamed(path, &heads, dtype, metadata, |i| {
        Ok(Cow::Borrowed(tensors[i].2))
    })
}

/// Writes a safetensors file of the tensors `heads` (name, shape) whose values `tensor(i)`
/// gives one at a time, converted to `dtype` and written a chunk at a time: no copy of the
/// whole file is ever held, and a caller that downloads each tensor just before it is
/// written holds one tensor's values (a device's weights). See [`write_safetensors_typed`].
///
/// # Errors
/// A tensor whose values do not match its shape, `tensor`'s errors, I/O errors.
pub fn write_safetensors_streamed<'a>(
    path: &Path,
    heads: &[(&str, &[usize])],
    dtype: SaveDtype,
    metadata: std::collections::HashMap<String, String>,
    mut tensor: impl FnMut(usize) -> Result<Cow<'a, [f32]>, HfError>,
) -> Result<(), HfError> {
    let dtype = match dtype {
        SaveDtype::F32 => Dtype::F32,
        SaveDtype::Bf16 => Dtype::BF16,
    };
    let typed: Vec<(&str, Dtype, &[usize])> = heads.iter().map(|&(n, s)| (n, dtype, s)).collect();
    write_safetensors_typed(path, &typed, metadata, |i| Ok(TensorData::F32(tensor(i)?)))
}

/// The values of one tensor handed to [`write_safetensors_typed`].
#[derive(Debug, Clone)]
pub enum TensorData<'a> {
    /// f32 values, written as F32 or rounded to BF16 (nearest even) as the head says.
    F32(Cow<'a, [f32]>),
    /// bf16 bits, written as BF16.
    Bf16(Cow<'a, [u16]>),
    /// Bytes, written as U8.
    U8(Cow<'a, [u8]>),
}

impl TensorData<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(x) => x.len(),
            Self::Bf16(x) => x.len(),
            Self::U8(x) => x.len(),
        }
    }
}

/// Writes a safetensors file of the tensors `heads` (name, dtype: F32, BF16 or U8, shape)
/// whose data `tensor(i)` gives one at a time, each written a chunk at a time (f32 data under
/// a BF16 head rounded on the way). The header is safetensors' own: an 8-byte little-endian
/// length, the JSON (offsets in `heads`' order, `__metadata__`), padded with spaces to 8
/// bytes.
///
/// # Errors
/// A tensor whose data does not match its shape or head dtype, `tensor`'s errors, I/O
/// errors.
pub fn write_safetensors_typed<'a>(
    path: &Path,
    heads: &[(&str, Dtype, &[usize])],
    metadata: std::collections::HashMap<String, String>,
    mut tensor: impl FnMut(usize) -> Result<TensorData<'a>, HfError>,
) -> Result<(), HfError> {
    use std::io::Write;
    let io = |e: std::io::Error| HfError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let bad = |message: String| HfError::Safetensors {
        path: path.to_path_buf(),
        message,
    };
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let meta: serde_json::Map<String, serde_json::Value> = metadata
            .into_iter()
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .map(|(k, v)| (k, serde_json::Value::String(v)))
            .collect();
        header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    }
    let mut offset = 0usize;
    for &(tensor_name, dtype, shape) in heads {
        let name = match dtype {
            Dtype::F32 => "F32",
            Dtype::BF16 => "BF16",
            Dtype::U8 => "U8",
            other => return Err(bad(format!("tensor {tensor_name}: cannot write {other:?}"))),
        };
        let bytes = shape.iter().product::<usize>() * (dtype.bitsize() / 8);
        header.insert(
            tensor_name.to_string(),
            serde_json::json!({
                "dtype": name,
                "shape": shape,
                "data_offsets": [offset, offset + bytes],
            }),
        );
        offset += bytes;
    }
    let mut text = serde_json::Value::Object(header).to_string();
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(' ');
    }
    let file = File::create(path).map_err(io)?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(text.as_bytes()).map_err(io)?;
    let mut buf = Vec::with_capacity(1 << 18);
    const CHUNK: usize = 1 << 16;
    for (i, &(tensor_name, dtype, shape)) in heads.iter().enumerate() {
        let data = tensor(i)?;
        let expected = shape.iter().product::<usize>();
        if data.len() != expected {
            return Err(bad(format!(
                "tensor {tensor_name}: {} values for shape {shape:?} ({expected})",
                data.len()
            )));
        }
        let little = cfg!(target_endian = "little");
        match (&data, dtype) {
            (TensorData::F32(x), Dtype::F32) => {
                for chunk in x.chunks(CHUNK) {
                    buf.clear();
                    if little {
                        buf.extend_from_slice(bytemuck::cast_slice(chunk));
                    } else {
                        chunk.iter().for_each(|x| buf.extend(x.to_le_bytes()));
                    }
                    out.write_all(&buf).map_err(io)?;
                }
            }
            (TensorData::F32(x), Dtype::BF16) => {
                for chunk in x.chunks(CHUNK) {
                    buf.clear();
                    chunk
                        .iter()
                        .for_each(|&x| buf.extend(bf16::from_f32(x).to_bits().to_le_bytes()));
                    out.write_all(&buf).map_err(io)?;
                }
            }
            (TensorData::Bf16(x), Dtype::BF16) => {
                for chunk in x.chunks(CHUNK) {
                    buf.clear();
                    chunk.iter().for_each(|b| buf.extend(b.to_le_bytes()));
                    out.write_all(&buf).map_err(io)?;
                }
            }
            (TensorData::U8(x), Dtype::U8) => out.write_all(x).map_err(io)?,
            _ => {
                return Err(bad(format!(
                    "tensor {tensor_name}: data does not match its dtype {dtype:?}"
                )));
            }
        }
    }
    out.flush().map_err(io)?;
    out.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)
}

/// The little-endian f32s of `bytes` (safetensors' byte order; any alignment: the bytes are
/// copied into an aligned vector), a trailing partial element dropped.
pub(crate) fn le_f32s(bytes: &[u8]) -> Vec<f32> {
    let mut out: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes[..bytes.len() / 4 * 4]);
    if cfg!(target_endian = "big") {
        out.iter_mut()
            .for_each(|x| *x = f32::from_bits(x.to_bits().swap_bytes()));
    }
    out
}

/// The little-endian 16-bit words of `bytes` (bf16 / f16 bits), as [`le_f32s`].
pub(crate) fn le_u16s(bytes: &[u8]) -> Vec<u16> {
    let mut out: Vec<u16> = bytemuck::pod_collect_to_vec(&bytes[..bytes.len() / 2 * 2]);
    if cfg!(target_endian = "big") {
        out.iter_mut().for_each(|x| *x = x.swap_bytes());
    }
    out
}
