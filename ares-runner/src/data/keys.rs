//! Which columns of a row hold what ([`DataKeys`]), and how a dotted key finds a nested value.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Fallback answer columns, tried in order when the configured answer key is absent from a
/// row: EasyR1's `ground_truth`, then verl's `reward_model.ground_truth`.
pub const ANSWER_FALLBACKS: [&str; 2] = ["ground_truth", "reward_model.ground_truth"];

/// Column names of a dataset (the `data.*_key` settings). Every key is a dotted path into
/// nested columns (`reward_model.rubrics` is the `rubrics` field of the `reward_model`
/// struct); a column whose own name contains the dots wins over the nested path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataKeys {
    /// The prompt: a string or a list of chat messages `{role, content}` (default `prompt`).
    pub prompt: String,
    /// The reference answer (default `answer`). When a row has no such column, the loader
    /// takes [`ANSWER_FALLBACKS`] instead: `ground_truth`, then `reward_model.ground_truth`.
    pub answer: String,
    /// The difficulty label, optional in every row (default `difficulty`).
    pub difficulty: String,
    /// The stable sample id used for difficulty tracking, optional (default `global_id`).
    pub global_id: String,
    /// The rubric criteria of graded prompts, optional (default `reward_model.rubrics`).
    pub rubrics: String,
}

impl Default for DataKeys {
    fn default() -> Self {
        Self {
            prompt: "prompt".into(),
            answer: "answer".into(),
            difficulty: "difficulty".into(),
            global_id: "global_id".into(),
            rubrics: "reward_model.rubrics".into(),
        }
    }
}

/// Columns of a row's images and videos (`data.image_key`, `data.video_key`), dotted paths as
/// in [`DataKeys`]. Kept apart from [`DataKeys`] so that code building a `DataKeys` field by
/// field keeps compiling.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MediaKeys {
    /// The images: a list of paths or `{bytes, path}` structs (default `images`).
    pub image: String,
    /// The videos: a list of video files, frame directories or lists of frame files (default
    /// `videos`).
    pub video: String,
    /// The directory relative image and video paths are joined to (EasyR1's `image_dir`);
    /// `None` (default): the dataset file's directory.
    pub base_dir: Option<std::path::PathBuf>,
}

impl Default for MediaKeys {
    fn default() -> Self {
        Self {
            image: "images".into(),
            video: "videos".into(),
            base_dir: None,
        }
    }
}

impl DataKeys {
    /// The keys of a config's `data` section.
    pub fn from_config(d: &crate::config::DataConfig) -> Self {
        Self {
            prompt: d.prompt_key.clone(),
            answer: d.answer_key.clone(),
            difficulty: d.difficulty_key.clone(),
            global_id: d.global_id_key.clone(),
            rubrics: d.rubrics_key.clone(),
        }
    }
}

impl MediaKeys {
    /// The media keys of a config's `data` section.
    pub fn from_config(d: &crate::config::DataConfig) -> Self {
        Self {
            image: d.image_key.clone(),
            video: d.video_key.clone(),
            base_dir: d.image_dir.as_ref().map(Into::into),
        }
    }
}

/// The value at dotted `key` in `row`: the column literally named `key` if there is one,
/// else the walk through nested objects (`a.b.c`). A JSON `null` counts as absent.
pub(crate) fn lookup<'a>(row: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    if let Some(v) = row.get(key) {
        return non_null(v);
    }
    let mut parts = key.split('.');
    let mut value = row.get(parts.next()?)?;
    for part in parts {
        value = value.as_object()?.get(part)?;
    }
    non_null(value)
}

fn non_null(v: &Value) -> Option<&Value> {
    if v.is_null() { None } else { Some(v) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    #[test]
    fn dotted_paths_and_literal_names() {
        let row = obj(json!({
            "a": {"b": {"c": 1}},
            "x.y": 2,
            "x": {"y": 3},
            "n": null,
            "m": {"k": null}
        }));
        assert_eq!(lookup(&row, "a.b.c"), Some(&json!(1)));
        assert_eq!(lookup(&row, "a.b"), Some(&json!({"c": 1})));
        // the literal column wins over the nested path
        assert_eq!(lookup(&row, "x.y"), Some(&json!(2)));
        assert_eq!(lookup(&row, "a.z"), None);
        assert_eq!(lookup(&row, "a.b.c.d"), None);
        assert_eq!(lookup(&row, "n"), None);
        assert_eq!(lookup(&row, "m.k"), None);
        assert_eq!(lookup(&row, "missing"), None);
    }

    #[test]
    fn defaults() {
        let k = DataKeys::default();
        assert_eq!(
            (
                k.prompt.as_str(),
                k.answer.as_str(),
                k.difficulty.as_str(),
                k.global_id.as_str(),
                k.rubrics.as_str()
            ),
            (
                "prompt",
                "answer",
                "difficulty",
                "global_id",
                "reward_model.rubrics"
            )
        );
    }
}
