//! The one error type of the metrics files.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// What went wrong reading or writing a metrics file; every variant names the file, and the
/// line (1-based) when one line is at fault.
#[derive(Debug, Error)]
pub enum MetricsError {
    /// The file could not be created, opened, read, written or renamed.
    #[error("cannot {action} metrics file {}: {source}", path.display())]
    Io {
        /// What was being done: "create", "open", "read", "write", ...
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// A line is not valid JSON.
    #[error("metrics file {}, line {line}: not valid JSON ({message})", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// serde_json's description, with the column.
        message: String,
    },
    /// The last line has no newline and is not valid JSON: the writer was stopped mid-line
    /// (by a power loss; a killed process cannot do this, see [`super::MetricsWriter`]).
    #[error(
        "metrics file {}, line {line}: the last line is cut off (no newline, not valid JSON)",
        path.display()
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// 1-based line number of the cut line.
        line: usize,
    },
    /// A line is valid JSON but not an object (`[1,2]`, `3`, `"x"`).
    #[error("metrics file {}, line {line}: expected a JSON object, found {found}", path.display())]
    NotObject {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The JSON kind found: "an array", "a number", ...
        found: &'static str,
    },
    /// A record's `step` is not a number (resuming must compare steps).
    #[error("metrics file {}, line {line}: \"step\" is {found}, expected a number", path.display())]
    BadStep {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The value found, as JSON.
        found: String,
    },
    /// A record could not be turned into JSON text (serde_json refused it).
    #[error("cannot encode a metrics record for {}: {message}", path.display())]
    Encode {
        /// The file it was meant for.
        path: PathBuf,
        /// serde_json's description.
        message: String,
    },
}
