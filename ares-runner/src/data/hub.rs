//! Datasets named as EasyR1 names them: `name@split` (`hiyouga/math12k@train`), resolved
//! to data files without a network.
//!
//! A spec that is an existing file or directory is used as it is (as before). Otherwise it
//! is split at its last `@` (no `@`: split `train`) and `name` is looked up as:
//! 1. a local file: it holds only the `train` split (as `datasets` reads one file);
//! 2. a local directory: the split's files below it (below);
//! 3. a dataset in the Hugging Face hub cache, `datasets--owner--name/snapshots/<rev>/`
//!    (`refs/main`'s revision, else the newest snapshot), under `$HF_HUB_CACHE`,
//!    `$HF_HOME/hub`, `$HF_DATASETS_CACHE` and `~/.cache/huggingface/hub`, in that order —
//!    where `huggingface-cli download --repo-type dataset owner/name` puts it.
//!
//! A split's files (`.parquet`, `.jsonl`, `.json`) are those with the split's name (or an
//! alias: `validation`/`valid`/`val`/`dev`, `test`/`testing`/`eval`, `train`/`training`) as
//! a folder of their path or at the start of their file name followed by a non-letter
//! (`data/train-00000-of-00001.parquet`, `test.jsonl`), as the hub's data-file patterns
//! name them. When no file names any split, every file is `train`.

use std::path::{Path, PathBuf};

use super::error::{DataError, Result};

/// Data file extensions.
const EXTENSIONS: [&str; 3] = ["parquet", "jsonl", "json"];
/// How deep below a dataset's root data files are looked for.
const MAX_DEPTH: usize = 4;

/// The files of `spec` (a path, or `name@split`), sorted.
///
/// # Errors
/// [`DataError::NotFound`] listing where the dataset was looked for, or naming the split
/// that has no files (with the splits that do); I/O errors reading a directory.
pub fn resolve_data_files(spec: &str) -> Result<Vec<PathBuf>> {
    resolve_data_files_in(spec, &hub_roots())
}

/// [`resolve_data_files`] with the hub cache directories given (for tests, and for callers
/// that know their cache).
///
/// # Errors
/// As [`resolve_data_files`].
pub fn resolve_data_files_in(spec: &str, hub_roots: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let as_path = Path::new(spec);
    if as_path.exists() {
        return Ok(vec![as_path.to_path_buf()]);
    }
    let (name, split) = match spec.rsplit_once('@') {
        Some((name, split)) if !name.is_empty() && !split.is_empty() => (name, split),
        _ => (spec, "train"),
    };
    let path = Path::new(name);
    if path.is_file() {
        if split == "train" {
            return Ok(vec![path.to_path_buf()]);
        }
        return Err(not_found(
            spec,
            format!(
                "{name} is one file, which holds only the `train` split (as EasyR1's \
                 `datasets` reads it)"
            ),
        ));
    }
    if path.is_dir() {
        return split_files(path, split, spec);
    }
    // a path (absolute, relative to `.`, or a data file's name) is not a hub name
    let data_file = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()));
    if name.starts_with(['/', '.', '~']) || data_file || name.matches('/').count() > 1 {
        return Err(DataError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        });
    }
    let (found, tried) = cached_snapshot(hub_roots, "datasets", name)?;
    if let Some(snapshot) = found {
        return split_files(&snapshot, split, spec);
    }
    Err(not_found(
        spec,
        format!(
            "no file or directory `{name}`, and no Hugging Face dataset `{name}` in the hub \
             cache (looked in {}); download it with `huggingface-cli download --repo-type \
             dataset {name}`, or give a path",
            tried.join(", ")
        ),
    ))
}

/// The directory of a model named `spec`: the path itself when it exists, else a Hugging
/// Face hub name (`Qwen/Qwen2.5-7B-Instruct`, as EasyR1 configs name models) found in the hub
/// cache (`models--owner--name/snapshots/<refs/main>`, under the directories of
/// [`resolve_data_files`]).
///
/// # Errors
/// Neither exists: the message lists where it looked.
pub fn resolve_model_dir(spec: &str) -> std::result::Result<PathBuf, String> {
    let path = Path::new(spec);
    if path.exists() || spec.starts_with(['/', '.', '~']) || spec.matches('/').count() != 1 {
        return Ok(path.to_path_buf());
    }
    let (found, tried) =
        cached_snapshot(&hub_roots(), "models", spec).map_err(|e| e.to_string())?;
    if let Some(snapshot) = found {
        return Ok(snapshot);
    }
    Err(format!(
        "{spec}: no such directory, and no Hugging Face model `{spec}` in the hub cache \
         (looked in {}); download it with `huggingface-cli download {spec}`, or give a path",
        tried.join(", ")
    ))
}

fn not_found(spec: &str, reason: String) -> DataError {
    DataError::NotFound {
        spec: spec.to_string(),
        reason,
    }
}

/// The hub cache directories, in the order they are searched.
fn hub_roots() -> Vec<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let mut roots = Vec::new();
    roots.extend(var("HF_HUB_CACHE"));
    roots.extend(var("HF_HOME").map(|h| h.join("hub")));
    roots.extend(var("HF_DATASETS_CACHE"));
    roots.extend(var("HOME").map(|h| h.join(".cache/huggingface/hub")));
    roots.dedup();
    roots
}

/// The snapshot of `kind` (`datasets`, `models`) `owner/name` in the first hub cache of
/// `roots` that has it, and the repository directories looked in.
fn cached_snapshot(
    roots: &[PathBuf],
    kind: &str,
    name: &str,
) -> Result<(Option<PathBuf>, Vec<String>)> {
    let mut tried = Vec::new();
    for root in roots {
        let repo = root.join(format!("{kind}--{}", name.replace('/', "--")));
        tried.push(repo.display().to_string());
        if let Some(found) = snapshot(&repo)? {
            return Ok((Some(found), tried));
        }
    }
    Ok((None, tried))
}

/// The snapshot directory of a cached hub repository: `refs/main`'s revision, else the
/// newest snapshot; `None` when the repository is not cached.
fn snapshot(repo: &Path) -> Result<Option<PathBuf>> {
    let snapshots = repo.join("snapshots");
    if !snapshots.is_dir() {
        return Ok(None);
    }
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
        let dir = snapshots.join(rev.trim());
        if dir.is_dir() {
            return Ok(Some(dir));
        }
    }
    let io = |source| DataError::Io {
        path: snapshots.clone(),
        source,
    };
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(&snapshots).map_err(io)? {
        let entry = entry.map_err(io)?;
        let modified = entry
            .metadata()
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH);
        if entry.path().is_dir() && newest.as_ref().is_none_or(|(t, _)| modified > *t) {
            newest = Some((modified, entry.path()));
        }
    }
    Ok(newest.map(|(_, p)| p))
}

/// The names a split's files may carry.
fn aliases(split: &str) -> Vec<String> {
    let known: &[&[&str]] = &[
        &["train", "training"],
        &["validation", "valid", "val", "dev"],
        &["test", "testing", "eval", "evaluation"],
    ];
    let split = split.to_ascii_lowercase();
    known
        .iter()
        .find(|names| names.contains(&split.as_str()))
        .map_or_else(
            || vec![split.clone()],
            |names| names.iter().map(|s| s.to_string()).collect(),
        )
}

/// Whether the file at `rel` (relative to the dataset root) belongs to a split named by one
/// of `names`.
fn names_split(rel: &Path, names: &[String]) -> bool {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().to_ascii_lowercase())
        .collect();
    let file = parts.pop().unwrap_or_default();
    let stem = file.split('.').next().unwrap_or_default().to_string();
    names.iter().any(|n| {
        parts.iter().any(|p| p == n)
            || stem
                .strip_prefix(n.as_str())
                .is_some_and(|rest| rest.chars().next().is_none_or(|c| !c.is_alphabetic()))
    })
}

/// Every data file below `root` (hidden entries skipped), relative to it, sorted.
fn data_files_below(root: &Path) -> Result<Vec<PathBuf>> {
    fn walk(root: &Path, rel: &Path, depth: usize, out: &mut Vec<PathBuf>) -> Result<()> {
        let dir = root.join(rel);
        let io = |source| DataError::Io {
            path: dir.clone(),
            source,
        };
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            let name = entry.file_name();
            if name.to_string_lossy().starts_with('.') {
                continue;
            }
            let child = rel.join(&name);
            // hub snapshots hold symlinks into blobs/: follow them
            let path = root.join(&child);
            if path.is_dir() && depth < MAX_DEPTH {
                walk(root, &child, depth + 1, out)?;
            } else if path.is_file()
                && path
                    .extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
            {
                out.push(child);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(root, Path::new(""), 0, &mut out)?;
    out.sort();
    Ok(out)
}

/// The files of `split` below `root`.
fn split_files(root: &Path, split: &str, spec: &str) -> Result<Vec<PathBuf>> {
    let files = data_files_below(root)?;
    if files.is_empty() {
        return Err(DataError::NoFiles {
            dir: root.to_path_buf(),
        });
    }
    let wanted: Vec<PathBuf> = files
        .iter()
        .filter(|f| names_split(f, &aliases(split)))
        .map(|f| root.join(f))
        .collect();
    if !wanted.is_empty() {
        return Ok(wanted);
    }
    let any_split = ["train", "validation", "test"]
        .iter()
        .any(|s| files.iter().any(|f| names_split(f, &aliases(s))));
    if !any_split && aliases(split).contains(&"train".to_string()) {
        return Ok(files.iter().map(|f| root.join(f)).collect());
    }
    let listed: Vec<String> = files
        .iter()
        .take(8)
        .map(|f| f.display().to_string())
        .collect();
    Err(not_found(
        spec,
        format!(
            "{} has no file of split `{split}` (its data files: {}{})",
            root.display(),
            listed.join(", "),
            if files.len() > 8 { ", …" } else { "" }
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names_follow_the_hub_patterns() {
        let train = aliases("train");
        let val = aliases("validation");
        for (path, t, v) in [
            ("data/train-00000-of-00001.parquet", true, false),
            ("train.jsonl", true, false),
            ("training_set.json", true, false),
            ("trainee.jsonl", false, false),
            ("data/validation-00000.parquet", false, true),
            ("dev.jsonl", false, true),
            ("val/part0.parquet", false, true),
            ("valuable.jsonl", false, false),
        ] {
            assert_eq!(names_split(Path::new(path), &train), t, "{path}");
            assert_eq!(names_split(Path::new(path), &val), v, "{path}");
        }
        assert_eq!(aliases("Val"), aliases("dev"));
        assert_eq!(aliases("geometry"), vec!["geometry".to_string()]);
    }
}
