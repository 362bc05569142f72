//! Errors of loading and checking a configuration. Every message names the dotted key, the
//! value and what is accepted, and where the value came from (file or override).

use std::path::PathBuf;

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The text is not YAML (or not a YAML the loader accepts: duplicate keys, non-finite
    /// numbers).
    #[error(
        "malformed YAML in {source_name} at line {line}, column {column}: {message}\n{snippet}"
    )]
    Yaml {
        /// The file name, or `override <text>`.
        source_name: String,
        /// 1-based line of the problem (0 when the parser gave none).
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's message.
        message: String,
        /// The offending lines with a caret under the column.
        snippet: String,
    },
    /// The document (or a section) is not a mapping.
    #[error("`{key}` ({origin}) must be a mapping of keys to values, found {found}")]
    NotAMapping {
        /// The section (`<top level>` for the document).
        key: String,
        /// Where the value came from.
        origin: String,
        /// What was found instead (`a list`, `the number 3`, ...).
        found: String,
    },
    /// A key that no section has.
    #[error(
        "unknown key `{key}` ({origin}); valid keys of {section}: {}{}",
        valid.join(", "),
        suggestion.as_ref().map(|s| format!("; did you mean `{s}`?")).unwrap_or_default()
    )]
    UnknownKey {
        /// The full dotted key.
        key: String,
        /// Where it came from.
        origin: String,
        /// The section it was looked up in (`worker.rollout`, or `the top level`).
        section: String,
        /// The keys that section accepts.
        valid: Vec<String>,
        /// The closest valid key, when one is close.
        suggestion: Option<String>,
    },
    /// An override walks into a key that holds a value, not a section.
    #[error("`{key}` is a value, not a section, so it has no key `{child}` ({origin})")]
    NotASection {
        /// The value's dotted key.
        key: String,
        /// The key asked for below it.
        child: String,
        /// The override.
        origin: String,
    },
    /// A command-line override that is not `dotted.key=value`.
    #[error("bad override `{text}`: {reason}")]
    BadOverride {
        /// The override as given.
        text: String,
        /// What is wrong.
        reason: String,
    },
    /// A value of the wrong type, or an enum value that is not one of the accepted ones.
    #[error("`{key}` ({origin}): {message}")]
    Type {
        /// The full dotted key.
        key: String,
        /// Where the value came from.
        origin: String,
        /// What serde found and expected (`invalid type: string "x", expected usize`;
        /// `unknown variant ..., expected one of ...`).
        message: String,
    },
    /// A value outside its range.
    #[error("{key} = {value} is out of range: expected {expected}")]
    OutOfRange {
        /// The full dotted key.
        key: String,
        /// The value as written back.
        value: String,
        /// The accepted range or values.
        expected: String,
    },
    /// `worker.rollout.n` is too small for a method that compares the samples of a group.
    #[error(
        "worker.rollout.n = {n} is too small: {user} compares the samples of a prompt's group and needs n >= 2"
    )]
    GroupSize {
        /// The configured n.
        n: usize,
        /// The setting that needs a group (`algorithm.adv_estimator = grpo`, ...).
        user: String,
    },
    /// Settings that are fine one by one but not together, or a value required by another.
    #[error("{key} = {value}: {reason}")]
    Inconsistent {
        /// The full dotted key.
        key: String,
        /// Its value.
        value: String,
        /// Why it does not fit the rest of the config.
        reason: String,
    },
    /// The defaults could not be turned into a tree (a bug, not a user error).
    #[error("internal error while resolving the configuration: {0}")]
    Internal(String),
}
