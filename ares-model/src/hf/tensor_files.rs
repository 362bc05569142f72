//! The safetensors files of a model directory — one `model.safetensors`, or shards listed
//! by `model.safetensors.index.json` — memory-mapped, read as f32, and written back.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use safetensors::{SafeTensors, View};

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
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
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

struct Encoded<'a> {
    dtype: Dtype,
    shape: &'a [usize],
    bytes: Vec<u8>,
}

impl View for &Encoded<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

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
    let encoded: Vec<(&str, Encoded<'_>)> = tensors
        .iter()
        .map(|&(name, shape, data)| {
            let (dtype, bytes) = match dtype {
                SaveDtype::F32 => (
                    Dtype::F32,
                    data.iter().flat_map(|x| x.to_le_bytes()).collect(),
                ),
                SaveDtype::Bf16 => (
                    Dtype::BF16,
                    data.iter()
                        .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
                        .collect(),
                ),
            };
            (
                name,
                Encoded {
                    dtype,
                    shape,
                    bytes,
                },
            )
        })
        .collect();
    safetensors::serialize_to_file(encoded.iter().map(|(n, e)| (*n, e)), Some(metadata), path)
        .map_err(|e| HfError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
}
