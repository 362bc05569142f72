//! Reading a metrics file back.

use std::ops::Range;
use std::path::Path;

use serde_json::{Map, Value};

use super::MetricsError;

/// Reads every record of a JSON-lines metrics file, in file order.
///
/// Blank lines are skipped; `\r\n` endings are accepted. A line that is not a JSON object is
/// an error naming its 1-based line number; a cut-off last line (no newline and not valid
/// JSON) is [`MetricsError::Truncated`].
pub fn read_metrics(path: &Path) -> Result<Vec<Map<String, Value>>, MetricsError> {
    Ok(read_numbered(path)?.into_iter().map(|(_, r)| r).collect())
}

/// A record with its 1-based line number in the file.
pub(crate) type NumberedRecord = (usize, Map<String, Value>);

/// [`read_metrics`] with each record's line number, for messages about a record.
pub(crate) fn read_numbered(path: &Path) -> Result<Vec<NumberedRecord>, MetricsError> {
    let text = std::fs::read_to_string(path).map_err(|source| MetricsError::Io {
        action: "read",
        path: path.to_path_buf(),
        source,
    })?;
    let parsed = parse_lines(&text, path)?;
    match parsed.torn {
        Some(torn) => Err(MetricsError::Truncated {
            path: path.to_path_buf(),
            line: torn.line,
        }),
        None => Ok(parsed
            .records
            .into_iter()
            .map(|(line, _, r)| (line, r))
            .collect()),
    }
}

/// The records of a file and, if its last line was cut off, where.
pub(super) struct Parsed {
    /// `(1-based line number, byte range of the line with its newline, record)`, in file
    /// order.
    pub records: Vec<(usize, Range<usize>, Map<String, Value>)>,
    /// The cut-off last line, if any.
    pub torn: Option<Torn>,
}

/// A last line without a newline that does not parse.
pub(super) struct Torn {
    /// Its 1-based line number.
    pub line: usize,
}

/// Parses `text` line by line; `path` is only for error messages.
pub(super) fn parse_lines(text: &str, path: &Path) -> Result<Parsed, MetricsError> {
    let mut records = Vec::new();
    let mut start = 0;
    for (index, raw) in text.split_inclusive('\n').enumerate() {
        let line = index + 1;
        let line_start = start;
        start += raw.len();
        let ended = raw.ends_with('\n');
        let body = raw.trim_end_matches(['\n', '\r']);
        if body.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(body) {
            Ok(Value::Object(map)) => records.push((line, line_start..start, map)),
            Ok(other) => {
                return Err(MetricsError::NotObject {
                    path: path.to_path_buf(),
                    line,
                    found: kind(&other),
                });
            }
            // Only the last piece can lack its newline, so this is the end of the file.
            Err(_) if !ended => {
                return Ok(Parsed {
                    records,
                    torn: Some(Torn { line }),
                });
            }
            Err(e) => {
                return Err(MetricsError::Parse {
                    path: path.to_path_buf(),
                    line,
                    message: e.to_string(),
                });
            }
        }
    }
    Ok(Parsed {
        records,
        torn: None,
    })
}

/// The JSON kind of a value, for messages.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn file_with(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn reads_records_skipping_blank_lines_and_crlf() {
        let (_d, path) = file_with("{\"step\":1,\"a\":0.5}\r\n\n  \n{\"step\":2,\"a\":null}\n");
        let recs = read_metrics(&path).unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[0]["a"].as_f64(), Some(0.5));
        assert!(recs[1]["a"].is_null());
    }

    #[test]
    fn last_line_without_newline_is_fine_when_valid() {
        let (_d, path) = file_with("{\"step\":1}\n{\"step\":2}");
        assert_eq!(read_metrics(&path).unwrap().len(), 2);
    }

    #[test]
    fn malformed_line_is_named() {
        let (_d, path) = file_with("{\"step\":1}\n\n{\"step\":2,}\n{\"step\":3}\n");
        let err = read_metrics(&path).unwrap_err();
        assert!(matches!(err, MetricsError::Parse { line: 3, .. }), "{err}");
        assert!(err.to_string().contains("line 3"), "{err}");
    }

    #[test]
    fn non_object_line_is_named() {
        let (_d, path) = file_with("{\"step\":1}\n[1,2]\n");
        let err = read_metrics(&path).unwrap_err();
        assert!(
            matches!(
                err,
                MetricsError::NotObject {
                    line: 2,
                    found: "an array",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn cut_last_line_is_truncated_error() {
        let (_d, path) = file_with("{\"step\":1}\n{\"step\":2,\"rew");
        let err = read_metrics(&path).unwrap_err();
        assert!(
            matches!(err, MetricsError::Truncated { line: 2, .. }),
            "{err}"
        );
    }

    #[test]
    fn missing_file_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.jsonl");
        let err = read_metrics(&path).unwrap_err();
        assert!(err.to_string().contains("absent.jsonl"), "{err}");
    }

    #[test]
    fn spans_cover_each_line_with_its_newline() {
        let text = "{\"a\":1}\n\n{\"a\":2}\r\n{\"a\":";
        let parsed = parse_lines(text, Path::new("x")).unwrap();
        assert_eq!(parsed.torn.map(|t| t.line), Some(4));
        let spans: Vec<(usize, &str)> = parsed
            .records
            .iter()
            .map(|(line, span, _)| (*line, &text[span.clone()]))
            .collect();
        assert_eq!(spans, [(1, "{\"a\":1}\n"), (3, "{\"a\":2}\r\n")]);
    }
}
