//! Appending records to a metrics file.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::reader::parse_lines;
use super::{MetricsError, Record};

/// Appends one JSON object per line to a metrics file.
///
/// Each record is encoded in memory, then handed to the kernel with a single `write_all` of
/// the whole line (newline included) and flushed: the file is never buffered in the process,
/// so a killed trainer leaves whole lines only. A power loss can still cut the last line;
/// [`MetricsWriter::create`] with `append` and [`MetricsWriter::resume`] repair that, and
/// [`super::read_metrics`] reports it. [`MetricsWriter::sync`] forces the data to disk.
#[derive(Debug)]
pub struct MetricsWriter {
    file: File,
    path: PathBuf,
    dropped_lines: usize,
}

impl MetricsWriter {
    /// Opens `path` for writing records, creating missing parent directories.
    ///
    /// `append = false` starts an empty file (truncating any old one). `append = true` keeps
    /// the existing lines and checks the end of the file: a last line without newline is
    /// completed with one when it is a valid JSON object, and removed when it is not (a cut
    /// write; counted in [`MetricsWriter::dropped_lines`]).
    pub fn create(path: &Path, append: bool) -> Result<Self, MetricsError> {
        create_parent(path)?;
        if !append {
            let file = File::create(path).map_err(|e| io_err("create", path, e))?;
            return Ok(Self {
                file,
                path: path.to_path_buf(),
                dropped_lines: 0,
            });
        }
        let dropped_lines = repair_tail(path)?;
        let file = open_append(path)?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
            dropped_lines,
        })
    }

    /// Opens `path` to continue a run resumed from the checkpoint of step `through_step`.
    ///
    /// Records with `"step"` greater than `through_step` were written after that checkpoint
    /// and will be produced again, so they are removed (as is a cut last line); records
    /// without a `step` key are kept. The file is rewritten through a temporary file and a
    /// rename, so it is never half-rewritten. A missing file is created. A malformed line or a
    /// non-numeric `step` is an error naming its line, and leaves the file untouched.
    pub fn resume(path: &Path, through_step: u64) -> Result<Self, MetricsError> {
        if !path.exists() {
            return Self::create(path, false);
        }
        let text = fs::read_to_string(path).map_err(|e| io_err("read", path, e))?;
        let parsed = parse_lines(&text, path)?;
        let mut kept = String::with_capacity(text.len());
        let mut dropped_lines = usize::from(parsed.torn.is_some());
        for (line, span, record) in &parsed.records {
            let keep = match record.get("step") {
                None => true,
                Some(step) => {
                    let value = step.as_f64().ok_or_else(|| MetricsError::BadStep {
                        path: path.to_path_buf(),
                        line: *line,
                        found: step.to_string(),
                    })?;
                    // u64 → f64 is exact for every step a run can reach (< 2^53).
                    value <= through_step as f64
                }
            };
            if keep {
                let raw = &text[span.clone()];
                kept.push_str(raw);
                if !raw.ends_with('\n') {
                    kept.push('\n');
                }
            } else {
                dropped_lines += 1;
            }
        }
        if kept != text {
            let tmp = tmp_path(path);
            fs::write(&tmp, kept.as_bytes()).map_err(|e| io_err("write", &tmp, e))?;
            fs::rename(&tmp, path).map_err(|e| io_err("replace", path, e))?;
        }
        let file = open_append(path)?;
        Ok(Self {
            file,
            path: path.to_path_buf(),
            dropped_lines,
        })
    }

    /// Appends `record` as one line and flushes it.
    pub fn write(&mut self, record: &Record) -> Result<(), MetricsError> {
        let mut line = serde_json::to_vec(record.as_map()).map_err(|e| MetricsError::Encode {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|()| self.file.flush())
            .map_err(|e| io_err("write", &self.path, e))
    }

    /// Forces the written lines to the disk (`fsync`); a power loss after it loses none.
    pub fn sync(&mut self) -> Result<(), MetricsError> {
        self.file
            .sync_data()
            .map_err(|e| io_err("sync", &self.path, e))
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Lines removed when the file was opened: a cut last line, and with
    /// [`MetricsWriter::resume`] the records after the resumed step.
    pub fn dropped_lines(&self) -> usize {
        self.dropped_lines
    }
}

/// Makes the file end with a newline after a whole record; returns the lines removed (0 or 1).
fn repair_tail(path: &Path) -> Result<usize, MetricsError> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io_err("read", path, e)),
    };
    let tail_start = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let tail = &bytes[tail_start..];
    if tail.is_empty() {
        return Ok(0);
    }
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| io_err("open", path, e))?;
    if matches!(serde_json::from_slice::<Value>(tail), Ok(Value::Object(_))) {
        // A whole record whose newline is missing (written by hand or by another tool).
        let mut file = file;
        use std::io::{Seek, SeekFrom};
        file.seek(SeekFrom::End(0))
            .and_then(|_| file.write_all(b"\n"))
            .map_err(|e| io_err("write", path, e))?;
        Ok(0)
    } else {
        file.set_len(tail_start as u64)
            .map_err(|e| io_err("truncate", path, e))?;
        Ok(1)
    }
}

fn open_append(path: &Path) -> Result<File, MetricsError> {
    OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|e| io_err("open", path, e))
}

fn create_parent(path: &Path) -> Result<(), MetricsError> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            fs::create_dir_all(dir).map_err(|e| io_err("create the directory of", path, e))
        }
        _ => Ok(()),
    }
}

/// `<name>.tmp` next to `path`, so the rename stays on one filesystem.
fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".tmp");
    path.with_file_name(name)
}

fn io_err(action: &'static str, path: &Path, source: std::io::Error) -> MetricsError {
    MetricsError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::read_metrics;

    fn rec(step: u64, reward: f64) -> Record {
        let mut r = Record::with_step(step);
        r.insert("reward/mean", reward);
        r
    }

    #[test]
    fn writes_one_object_per_line_with_null_for_nan() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/a/metrics.jsonl");
        let mut w = MetricsWriter::create(&path, false).unwrap();
        w.write(&rec(1, 0.5)).unwrap();
        w.write(&rec(2, f64::NAN)).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "{\"step\":1,\"reward/mean\":0.5}\n{\"step\":2,\"reward/mean\":null}\n"
        );
        let back = read_metrics(&path).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(back[0]["reward/mean"].as_f64(), Some(0.5));
    }

    #[test]
    fn create_without_append_truncates_with_append_keeps() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        MetricsWriter::create(&path, false)
            .unwrap()
            .write(&rec(1, 1.0))
            .unwrap();
        MetricsWriter::create(&path, true)
            .unwrap()
            .write(&rec(2, 2.0))
            .unwrap();
        assert_eq!(read_metrics(&path).unwrap().len(), 2);
        MetricsWriter::create(&path, false)
            .unwrap()
            .write(&rec(3, 3.0))
            .unwrap();
        let back = read_metrics(&path).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0]["step"].as_u64(), Some(3));
    }

    #[test]
    fn append_removes_a_cut_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        fs::write(&path, "{\"step\":1}\n{\"step\":2,\"rew").unwrap();
        let mut w = MetricsWriter::create(&path, true).unwrap();
        assert_eq!(w.dropped_lines(), 1);
        w.write(&rec(2, 0.25)).unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"step\":1}\n{\"step\":2,\"reward/mean\":0.25}\n"
        );
    }

    #[test]
    fn append_completes_a_whole_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        fs::write(&path, "{\"step\":1}").unwrap();
        let mut w = MetricsWriter::create(&path, true).unwrap();
        assert_eq!(w.dropped_lines(), 0);
        w.write(&Record::with_step(2)).unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"step\":1}\n{\"step\":2}\n"
        );
    }

    #[test]
    fn resume_drops_records_after_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        fs::write(
            &path,
            "{\"note\":\"start\"}\n{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n{\"step\":4,\"x\"",
        )
        .unwrap();
        let mut w = MetricsWriter::resume(&path, 2).unwrap();
        assert_eq!(w.dropped_lines(), 2);
        w.write(&Record::with_step(3)).unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"note\":\"start\"}\n{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n"
        );
        assert!(!tmp_path(&path).exists());
    }

    #[test]
    fn resume_of_a_missing_file_creates_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("new.jsonl");
        let w = MetricsWriter::resume(&path, 5).unwrap();
        assert_eq!(w.dropped_lines(), 0);
        assert!(path.exists());
    }

    #[test]
    fn resume_rejects_a_text_step_and_leaves_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let text = "{\"step\":1}\n{\"step\":\"two\"}\n";
        fs::write(&path, text).unwrap();
        let err = MetricsWriter::resume(&path, 1).unwrap_err();
        assert!(
            matches!(err, MetricsError::BadStep { line: 2, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("\"two\""), "{err}");
        assert_eq!(fs::read_to_string(&path).unwrap(), text);
    }

    #[test]
    fn unwritable_path_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        // A directory cannot be opened as a file.
        let err = MetricsWriter::create(dir.path(), false).unwrap_err();
        assert!(
            err.to_string().contains(&dir.path().display().to_string()),
            "{err}"
        );
    }
}
