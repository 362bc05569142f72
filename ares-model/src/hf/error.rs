//! The one error type of the Hugging Face model I/O: every variant names the file and the
//! field or tensor at fault, and the values involved.

use std::path::PathBuf;

/// What went wrong reading or writing a Hugging Face model directory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HfError {
    /// A file could not be read, written, renamed or created.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },
    /// A file the model needs is not there.
    #[error("{}: not found ({what})", path.display())]
    MissingFile {
        /// The file that was looked for.
        path: PathBuf,
        /// What it is and what else was looked for.
        what: String,
    },
    /// A JSON file is not valid JSON, or not a JSON object.
    #[error("{}: {message}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A field of a JSON file is missing, has the wrong type or an invalid value.
    #[error("{}: {field}: {message}", path.display())]
    Field {
        /// The file.
        path: PathBuf,
        /// The field, dotted for nested ones (`rope_scaling.factor`).
        field: String,
        /// What is wrong, with the value found.
        message: String,
    },
    /// `model_type` / `architectures` names a model this runner does not implement.
    #[error("{}: unknown architecture `{found}` (supported model_type: {supported})", path.display())]
    UnknownArchitecture {
        /// The file.
        path: PathBuf,
        /// The model type or architecture found.
        found: String,
        /// The supported `model_type` values, comma separated.
        supported: String,
    },
    /// A safetensors file is malformed (header, offsets, sizes).
    #[error("{}: invalid safetensors file: {message}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The safetensors crate's message.
        message: String,
    },
    /// A tensor is stored in a dtype the loader does not convert (only F32, BF16, F16).
    #[error("{}: tensor `{tensor}` has dtype {dtype}; supported: F32, BF16, F16", path.display())]
    UnsupportedDtype {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// Its dtype as safetensors names it.
        dtype: String,
    },
    /// A tensor's shape does not match what `config.json` implies.
    #[error("{}: tensor `{tensor}` has shape {actual:?}, config.json implies {expected:?}", path.display())]
    ShapeMismatch {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        actual: Vec<usize>,
    },
    /// A tensor the config requires is in none of the weight files.
    #[error("{}: missing tensor `{tensor}`", path.display())]
    MissingTensor {
        /// The weight file (or shard index) that was searched.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
    },
    /// A weight file holds a tensor this model does not use (and that is not known to be
    /// safe to ignore, like `rotary_emb.inv_freq`).
    #[error("{}: unexpected tensor `{tensor}` (not part of a {arch} model with this config.json)", path.display())]
    UnexpectedTensor {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The architecture the config names.
        arch: String,
    },
    /// In-memory weights handed to the saver do not fit the config (programming error in
    /// the caller, reported instead of writing a broken checkpoint).
    #[error("cannot save `{tensor}`: {message}")]
    InvalidWeights {
        /// The tensor's name.
        tensor: String,
        /// What is wrong.
        message: String,
    },
}

impl HfError {
    /// An [`HfError::Io`] for `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// An [`HfError::Field`] for `field` of `path`.
    pub(crate) fn field(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self::Field {
            path: path.into(),
            field: field.into(),
            message: message.into(),
        }
    }
}
