//! [`DemoError`]: everything that can go wrong while making the demo's data, tokenizer and
//! model; each variant names the file, field or value at fault.

use std::path::PathBuf;

use crate::hf::HfError;

/// Errors of the [`crate::demo`] module.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// A file or directory could not be created or written.
    #[error("{}: cannot write: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A value could not be serialised to JSON.
    #[error("{}: cannot serialise JSON: {source}", path.display())]
    Json {
        /// The file being written.
        path: PathBuf,
        /// The serialisation error.
        source: serde_json::Error,
    },
    /// The `tokenizers` crate refused the tokenizer or could not save it.
    #[error("{}: tokenizer: {message}", path.display())]
    Tokenizer {
        /// The file being written.
        path: PathBuf,
        /// What `tokenizers` reported.
        message: String,
    },
    /// Writing or validating the model files failed.
    #[error(transparent)]
    Hf(#[from] HfError),
    /// A size or setting of the tiny model (or of the demo options) is unusable.
    #[error("demo setting `{field}` = {value}: {reason}")]
    Setting {
        /// The field, e.g. `hidden`.
        field: &'static str,
        /// Its value, as written.
        value: String,
        /// Why it is unusable.
        reason: String,
    },
    /// More problems were asked for than the split of a level holds.
    #[error(
        "asked for {wanted} distinct {level} problems of the {split} split, which has only {available}"
    )]
    NotEnoughProblems {
        /// The difficulty level (`easy`, `medium`, `hard`).
        level: &'static str,
        /// The split (`train`, `eval`).
        split: &'static str,
        /// How many were asked for.
        wanted: usize,
        /// How many exist.
        available: usize,
    },
    /// A prompt is not an expression of the demo task's grammar.
    #[error("prompt {prompt:?} is not a demo arithmetic expression: {reason}")]
    Expression {
        /// The prompt.
        prompt: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A text holds a character the demo's character-level vocabulary lacks.
    #[error("{ch:?} (in {text:?}) is not in the demo tokenizer's vocabulary")]
    UnsupportedChar {
        /// The first character that is not in the vocabulary.
        ch: char,
        /// The text it is in.
        text: String,
    },
}

impl DemoError {
    /// An I/O error on `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
