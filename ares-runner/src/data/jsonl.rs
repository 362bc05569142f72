//! JSON lines files (`.jsonl`, and `.json` written as lines, as HF `datasets` writes it), and
//! `.json` files holding one JSON array of rows.

use std::path::Path;

use serde_json::Value;

use super::error::{DataError, Location, Result};
use super::row::RawRow;

/// Reads every row of a JSON lines file: one JSON object per non-blank line (blank lines are
/// skipped and do not count as rows). With `allow_array`, a file whose first non-blank
/// character is `[` is read as one JSON array of rows instead (no line numbers then).
pub(crate) fn read_json(path: &Path, allow_array: bool) -> Result<Vec<RawRow>> {
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    if allow_array && text.trim_start().starts_with('[') {
        return read_array(path, text);
    }
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value = serde_json::from_str::<Value>(line).map_err(|e| DataError::Json {
            path: path.to_path_buf(),
            line: i + 1,
            message: e.to_string(),
        })?;
        rows.push(RawRow {
            at: Location {
                path: path.to_path_buf(),
                row: rows.len(),
                line: Some(i + 1),
            },
            value,
        });
    }
    Ok(rows)
}

fn read_array(path: &Path, text: &str) -> Result<Vec<RawRow>> {
    let value = serde_json::from_str::<Value>(text).map_err(|e| DataError::Json {
        path: path.to_path_buf(),
        line: e.line(),
        message: e.to_string(),
    })?;
    let Value::Array(items) = value else {
        // unreachable in practice: the text starts with `[`
        return Err(DataError::Json {
            path: path.to_path_buf(),
            line: 1,
            message: "expected a JSON array of rows".into(),
        });
    };
    Ok(items
        .into_iter()
        .enumerate()
        .map(|(row, value)| RawRow {
            at: Location {
                path: path.to_path_buf(),
                row,
                line: None,
            },
            value,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(text: &str, ext: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new().suffix(ext).tempfile().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    #[test]
    fn lines_rows_and_blank_lines() {
        let f = file("\u{feff}{\"a\":1}\n\n  \n{\"a\":2}\r\n{\"a\":3}", ".jsonl");
        let rows = read_json(f.path(), false).unwrap();
        let got: Vec<_> = rows
            .iter()
            .map(|r| (r.at.row, r.at.line, r.value["a"].as_i64()))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, Some(1), Some(1)),
                (1, Some(4), Some(2)),
                (2, Some(5), Some(3))
            ]
        );
    }

    #[test]
    fn malformed_line_is_named() {
        let f = file("{\"a\":1}\n{\"a\":\n", ".jsonl");
        let e = read_json(f.path(), false).unwrap_err().to_string();
        assert!(e.contains(": line 2: malformed JSON"), "{e}");
    }

    #[test]
    fn json_array_file() {
        let f = file("  [{\"a\":1},\n {\"a\":2}]", ".json");
        let rows = read_json(f.path(), true).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[1].at.row, rows[1].at.line), (1, None));
        let f = file("[{\"a\":1},\n {\"a\":]", ".json");
        let e = read_json(f.path(), true).unwrap_err().to_string();
        assert!(e.contains("line 2: malformed JSON"), "{e}");
        // as lines, the same text is one malformed line
        assert!(read_json(f.path(), false).is_err());
    }
}
