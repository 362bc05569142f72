//! Errors of the dataset loader, the prompt template, the length filter and the sampler.

use std::fmt;
use std::path::PathBuf;

/// Where a row comes from: the file, the 0-based row and, for JSON lines, the 1-based line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The data file.
    pub path: PathBuf,
    /// 0-based row (record) in the file.
    pub row: usize,
    /// 1-based line of the record in a JSON lines file; `None` for Parquet and JSON arrays.
    pub line: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: row {}", self.path.display(), self.row)?;
        if let Some(line) = self.line {
            write!(f, " (line {line})")?;
        }
        Ok(())
    }
}

/// Errors from [`load_dataset`](super::load_dataset) and the other data helpers.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file or directory could not be read (missing, permissions, …).
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A dataset named by path or as `name@split` that cannot be found.
    #[error("dataset `{spec}`: {reason}")]
    NotFound {
        /// The dataset as configured.
        spec: String,
        /// Where it was looked for, or which split is missing.
        reason: String,
    },
    /// The file's extension is not one the loader reads.
    #[error("{}: unsupported dataset format (expected .jsonl, .json or .parquet)", path.display())]
    UnsupportedFormat {
        /// The file.
        path: PathBuf,
    },
    /// A directory holds no data file.
    #[error("{}: no .jsonl, .json or .parquet file in this directory", dir.display())]
    NoFiles {
        /// The directory.
        dir: PathBuf,
    },
    /// The dataset's files hold more bytes than the memory available (rows are loaded
    /// whole, and take at least their bytes).
    #[error(
        "{}: the dataset's files hold {}, more than the {} of memory available \
         ({origin}); its rows are loaded into memory whole: split it, or drop columns the \
         run does not read",
        path.display(),
        crate::host_memory::human_bytes(*bytes),
        crate::host_memory::human_bytes(*available)
    )]
    TooLarge {
        /// The dataset (file or directory).
        path: PathBuf,
        /// Its files' bytes.
        bytes: u64,
        /// The memory available.
        available: u64,
        /// Where that figure comes from.
        origin: String,
    },
    /// A file (or a whole directory) holds no rows.
    #[error("{}: the dataset is empty (no rows)", path.display())]
    Empty {
        /// The file or directory.
        path: PathBuf,
    },
    /// A line of a JSON lines file (or a JSON array file) is not valid JSON.
    #[error("{}: line {line}: malformed JSON: {message}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// serde_json's message.
        message: String,
    },
    /// The Parquet file cannot be decoded.
    #[error("{}: {}cannot read Parquet: {message}", path.display(), row.map(|r| format!("row {r}: ")).unwrap_or_default())]
    Parquet {
        /// The file.
        path: PathBuf,
        /// The row being read, if the error came from a row.
        row: Option<usize>,
        /// The parquet crate's message.
        message: String,
    },
    /// A row lacks a column or holds a value of the wrong shape.
    #[error("{at}: `{key}`: {reason}")]
    Row {
        /// The row.
        at: Location,
        /// The column (dotted path), e.g. `prompt` or `reward_model.rubrics`.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A row's images or videos: a column of the wrong type, a missing file, or a number of
    /// `<image>` / `<video>` placeholders different from the number of images / videos.
    #[error("{at} (global_id `{global_id}`): `{key}`: {reason}")]
    Media {
        /// The row (boxed: keeps the error small).
        at: Box<Location>,
        /// The row's `global_id` (given or generated).
        global_id: String,
        /// The column, e.g. `images`.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A loaded example's images or videos cannot be decoded or processed, or its prompt (after
    /// `format_prompt`) no longer has one placeholder per image / video.
    #[error("row {row} (global_id `{global_id}`): `{key}`: {reason}")]
    Example {
        /// 0-based row in its file.
        row: usize,
        /// The example's `global_id`.
        global_id: String,
        /// The column (`images` / `videos`, as configured).
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The image processor's settings (the model's `preprocessor_config.json` with
    /// `data.min_pixels` / `data.max_pixels`) cannot be used.
    #[error("image processor: {0}")]
    Processor(String),
    /// Two rows share a `global_id` (difficulty tracking needs it unique).
    #[error("duplicate global_id `{id}`: {first} and {second}")]
    DuplicateId {
        /// The id.
        id: String,
        /// The first row holding it.
        first: Location,
        /// The second row holding it.
        second: Location,
    },
    /// A prompt template does not compile or does not render.
    #[error("prompt template {origin}: {message}")]
    Template {
        /// The file (or the name given to an inline template).
        origin: String,
        /// minijinja's message, with the line.
        message: String,
    },
    /// The length filter got a number of lengths different from the number of examples.
    #[error("prompt length filter: {lengths} lengths for {examples} examples")]
    LengthCount {
        /// Number of examples.
        examples: usize,
        /// Number of lengths.
        lengths: usize,
    },
    /// Every prompt is longer than the limit.
    #[error(
        "every prompt is longer than max_prompt_length = {max} tokens (the shortest has {shortest}); \
         raise data.max_prompt_length or shorten the prompts"
    )]
    AllTooLong {
        /// The limit.
        max: usize,
        /// The shortest prompt length.
        shortest: usize,
    },
    /// The sampler was asked for an impossible batch or resumed on another dataset.
    #[error("sampler: {0}")]
    Sampler(String),
}

impl DataError {
    /// A [`DataError::Row`] at `at` about `key`.
    pub(crate) fn row(at: &Location, key: &str, reason: impl Into<String>) -> Self {
        DataError::Row {
            at: at.clone(),
            key: key.to_owned(),
            reason: reason.into(),
        }
    }
}

impl DataError {
    /// A [`DataError::Media`] at `at` (row `global_id`) about `key`.
    pub(crate) fn media(
        at: &Location,
        global_id: &str,
        key: &str,
        reason: impl Into<String>,
    ) -> Self {
        DataError::Media {
            at: Box::new(at.clone()),
            global_id: global_id.to_owned(),
            key: key.to_owned(),
            reason: reason.into(),
        }
    }
}

/// Result alias of the data module.
pub type Result<T, E = DataError> = std::result::Result<T, E>;
