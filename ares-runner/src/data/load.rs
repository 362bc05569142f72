//! [`load_dataset`]: a file or a directory of files into validated [`Example`]s.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::error::{DataError, Location, Result};
use super::example::Example;
use super::hub::resolve_data_files;
use super::jsonl::read_json;
use super::keys::{DataKeys, MediaKeys};
use super::parquet::read_parquet;
use super::row::{RawRow, to_example};

/// File formats by extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// `.jsonl`: JSON lines.
    JsonLines,
    /// `.json`: JSON lines, or one JSON array of rows.
    Json,
    /// `.parquet`.
    Parquet,
}

fn format_of(path: &Path) -> Option<Format> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    match ext.as_str() {
        "jsonl" => Some(Format::JsonLines),
        "json" => Some(Format::Json),
        "parquet" => Some(Format::Parquet),
        _ => None,
    }
}

/// Loads a dataset: one `.jsonl`/`.json`/`.parquet` file, or every such file of a directory
/// (not recursive, in name order). `.json` is JSON lines, or a JSON array of rows when the
/// file starts with `[`. Parquet is read without arrow; compressed columns may be snappy
/// (pyarrow's and HF `datasets`' default) or uncompressed.
///
/// Columns are found with `keys` (dotted paths into nested columns). Each row must have a
/// prompt (a string or a non-empty list of `{role, content}` messages with string content)
/// and an answer (a string or a number; when the row lacks `keys.answer`, `ground_truth` and
/// then `reward_model.ground_truth` are used — EasyR1's and verl's columns), except rows with
/// rubric criteria, which may have none. `difficulty`, `global_id` and the rubrics are
/// optional; a missing `global_id` is generated as `<file stem>-<row>` (0-based row, stable
/// across runs). Images and videos are read from the default columns `images` and `videos`
/// ([`load_dataset_with_media`] takes other columns).
///
/// Errors (each naming the file, the row — and the line for JSON lines — and the key): the
/// path cannot be read, an unknown extension, a directory without data files, a file without
/// rows, malformed JSON, an unreadable Parquet file, a row without prompt or answer or with a
/// value of the wrong type, malformed rubric criteria (including invalid regexes), bad media
/// (see [`load_dataset_with_media`]), and two rows with the same `global_id`.
pub fn load_dataset(path: &Path, keys: &DataKeys) -> Result<Vec<Example>> {
    load_dataset_with_media(path, keys, &MediaKeys::default())
}

/// [`load_dataset`] with the image and video columns of `media` (`data.image_key`,
/// `data.video_key`).
///
/// A media column holds a list (or one item) of: a path (relative paths are joined to the
/// dataset file's directory), a `{bytes, path}` struct (Hugging Face `datasets`' `Image`
/// feature; the bytes, as binary in Parquet or base64 text / a list of numbers in JSON, win
/// over the path), a list of bytes, or — for a video — a list of frame paths. A video path is
/// a video file (decoded with ffmpeg when processed) or a directory of frame images. Null,
/// `[]` and `""` mean no media.
///
/// In a row with media the prompt must hold one `<image>` placeholder per image and one
/// `<video>` per video (EasyR1's convention); chat messages may instead give content lists,
/// `[{"type": "image"}, {"type": "text", "text": …}]`, whose image and video items count as
/// placeholders (and are kept as them in the prompt text). In a text row, `<image>` is plain
/// text, but an image content item is an error.
///
/// Media errors ([`DataError::Media`], naming the file, the row, its `global_id` and the
/// column): a column of the wrong type (a number, …), an item of the wrong type, a missing
/// file (the path is named; files are only checked to exist, not decoded), and a number of
/// images or videos different from the prompt's placeholders. Nothing is written.
pub fn load_dataset_with_media(
    path: &Path,
    keys: &DataKeys,
    media: &MediaKeys,
) -> Result<Vec<Example>> {
    let mut examples = Vec::new();
    for_each_row(
        path,
        keys,
        media,
        |_| Ok(None),
        |example, _| {
            examples.push(example);
            Ok(())
        },
    )?;
    Ok(examples)
}

/// What a supervised row teaches the model to write after its prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum SftTarget {
    /// One response (the trainer appends the end-of-turn token).
    Text(String),
    /// A multi-turn trace: the messages after the prompt, first and last the assistant's,
    /// with `tool` (or `user`) messages between the assistant's turns. The model learns its
    /// own turns; the others are rendered through the chat template as a rollout appends
    /// them, and are not in the loss.
    Turns(Vec<serde_json::Value>),
}

/// Roles a trace's messages may have.
const TRACE_ROLES: [&str; 3] = ["assistant", "tool", "user"];

/// The trace of messages `list`, or why it is not one.
fn trace_of(list: &[serde_json::Value]) -> std::result::Result<Vec<serde_json::Value>, String> {
    if list.is_empty() {
        return Err("an empty trace (a trace needs at least one assistant message)".into());
    }
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(serde_json::Value::as_str);
        let Some(role) = role.filter(|r| TRACE_ROLES.contains(r)) else {
            return Err(format!(
                "message {i} has role {}, expected one of {}",
                m.get("role").map_or("none".into(), ToString::to_string),
                TRACE_ROLES.join(", ")
            ));
        };
        if !m.get("content").is_some_and(serde_json::Value::is_string) {
            return Err(format!("message {i} ({role}) has no string `content`"));
        }
    }
    let role = |m: &serde_json::Value| m["role"].as_str().unwrap_or_default().to_string();
    if role(&list[0]) != "assistant" || role(&list[list.len() - 1]) != "assistant" {
        return Err(format!(
            "a trace starts and ends with the assistant's turn; this one goes from {} to {}",
            role(&list[0]),
            role(&list[list.len() - 1])
        ));
    }
    Ok(list.to_vec())
}

/// Supervised fine-tuning pairs: each row's prompt, images and videos as in
/// [`load_dataset_with_media`] (same formats, columns and errors), and its target at
/// `response_key`: a non-empty string, or a multi-turn trace ([`SftTarget::Turns`]). The
/// [`Example::answer`] is left empty: SFT rows need no reference answer, and the answer
/// fallbacks are not consulted.
///
/// # Errors
/// As [`load_dataset_with_media`], and a row whose `response_key` is missing, blank, of
/// another type or a malformed trace (naming file, row and key).
pub fn load_sft_dataset(
    path: &Path,
    keys: &DataKeys,
    response_key: &str,
    media: &MediaKeys,
) -> Result<Vec<(Example, SftTarget)>> {
    let keys = DataKeys {
        answer: response_key.to_owned(),
        ..keys.clone()
    };
    let mut pairs = Vec::new();
    // the response is checked before the row is built, so that a missing one is named as
    // such rather than as a missing answer; a trace stands in the row as a placeholder
    // answer while the example is built
    let check = |raw: &RawRow| -> Result<Option<SftTarget>> {
        let row = raw.value.as_object();
        match row.and_then(|r| super::keys::lookup(r, response_key)) {
            Some(serde_json::Value::String(s)) if !s.trim().is_empty() => Ok(None),
            Some(serde_json::Value::Array(list)) => trace_of(list)
                .map(|t| Some(SftTarget::Turns(t)))
                .map_err(|e| DataError::row(&raw.at, response_key, e)),
            other => Err(DataError::row(
                &raw.at,
                response_key,
                format!(
                    "{}, expected the response text (a non-empty string) or a trace (a list \
                     of messages)",
                    other.map_or("nothing", super::criterion::kind)
                ),
            )),
        }
    };
    // the row's trace, from `check` to `visit` (called in turn for each row)
    let trace = std::cell::Cell::new(None);
    for_each_row(
        path,
        &keys,
        media,
        |raw| {
            let checked = check(raw)?;
            let placeholder = checked
                .is_some()
                .then(|| with_value_at(&raw.value, response_key, "(trace)".into()));
            trace.set(checked);
            Ok(placeholder)
        },
        |mut example, _| {
            let response = std::mem::take(&mut example.answer);
            let target = match trace.take() {
                Some(t) => t,
                None => SftTarget::Text(response),
            };
            pairs.push((example, target));
            Ok(())
        },
    )?;
    Ok(pairs)
}

/// `row` with the value at dotted `key` (as [`super::keys::lookup`] finds it) replaced by
/// `value`.
fn with_value_at(
    row: &serde_json::Value,
    key: &str,
    value: serde_json::Value,
) -> serde_json::Value {
    let mut out = row.clone();
    if let Some(obj) = out.as_object_mut() {
        if obj.contains_key(key) {
            obj.insert(key.to_owned(), value);
        } else {
            let mut at = Some(obj);
            let parts: Vec<&str> = key.split('.').collect();
            for (i, part) in parts.iter().enumerate() {
                let Some(o) = at.take() else { break };
                if i + 1 == parts.len() {
                    o.insert((*part).to_owned(), value.clone());
                } else {
                    at = o.get_mut(*part).and_then(serde_json::Value::as_object_mut);
                }
            }
        }
    }
    out
}

/// Reads every row of `path` (a file or a directory of files), runs `check` on it, builds
/// its [`Example`] and hands both to `visit`, checking that `global_id`s are unique.
fn for_each_row(
    path: &Path,
    keys: &DataKeys,
    media: &MediaKeys,
    mut check: impl FnMut(&RawRow) -> Result<Option<serde_json::Value>>,
    mut visit: impl FnMut(Example, &RawRow) -> Result<()>,
) -> Result<()> {
    // a path that does not exist may be EasyR1's `name@split`
    let files = if path.exists() {
        let meta = std::fs::metadata(path).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if meta.is_dir() {
            data_files(path)?
        } else {
            vec![path.to_path_buf()]
        }
    } else {
        match path.to_str() {
            Some(spec) => resolve_data_files(spec)?,
            None => {
                return Err(DataError::Io {
                    path: path.to_path_buf(),
                    source: std::io::Error::from(std::io::ErrorKind::NotFound),
                });
            }
        }
    };
    check_fits_memory(path, &files)?;
    let mut seen: HashMap<String, Location> = HashMap::new();
    for file in &files {
        let format =
            format_of(file).ok_or_else(|| DataError::UnsupportedFormat { path: file.clone() })?;
        let rows = match format {
            Format::JsonLines => read_json(file, false)?,
            Format::Json => read_json(file, true)?,
            Format::Parquet => read_parquet(file)?,
        };
        if rows.is_empty() {
            return Err(DataError::Empty { path: file.clone() });
        }
        let stem = file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        for raw in &rows {
            // `check` may give the row to build the example from in the raw row's place
            let example = match check(raw)? {
                Some(value) => to_example(
                    &RawRow {
                        at: raw.at.clone(),
                        value,
                    },
                    keys,
                    media,
                    &stem,
                )?,
                None => to_example(raw, keys, media, &stem)?,
            };
            check_unique(&mut seen, &example.global_id, raw)?;
            visit(example, raw)?;
        }
    }
    Ok(())
}

/// Refuses a dataset whose files hold more bytes than the memory available: its rows,
/// loaded whole, would not fit (`ARES_MEMORY_LIMIT` states the memory).
fn check_fits_memory(path: &Path, files: &[std::path::PathBuf]) -> Result<()> {
    let bytes = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .fold(0u64, u64::saturating_add);
    let available =
        crate::host_memory::available_host_memory().map_err(|reason| DataError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(reason),
        })?;
    match available {
        Some((available, origin)) if bytes > available => Err(DataError::TooLarge {
            path: path.to_path_buf(),
            bytes,
            available,
            origin,
        }),
        _ => Ok(()),
    }
}

fn check_unique(seen: &mut HashMap<String, Location>, id: &str, raw: &RawRow) -> Result<()> {
    if let Some(first) = seen.get(id) {
        return Err(DataError::DuplicateId {
            id: id.to_owned(),
            first: first.clone(),
            second: raw.at.clone(),
        });
    }
    seen.insert(id.to_owned(), raw.at.clone());
    Ok(())
}

/// The data files of `dir`, sorted by name.
fn data_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let io = |source| DataError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.is_file() && format_of(&path).is_some() {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(DataError::NoFiles {
            dir: dir.to_path_buf(),
        });
    }
    files.sort();
    Ok(files)
}
