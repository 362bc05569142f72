//! One raw row (a JSON object, whatever the file format) checked and turned into an
//! [`Example`].

use serde_json::{Map, Value};

use super::criterion::{kind, parse_criteria};
use super::error::{DataError, Location, Result};
use super::example::{Example, Prompt};
use super::keys::{ANSWER_FALLBACKS, DataKeys, lookup};
use crate::hf::chat::ChatMessage;

/// Columns whose non-empty presence means a multimodal row (EasyR1's `image_key`/`video_key`
/// defaults).
const MULTIMODAL_KEYS: [&str; 2] = ["images", "videos"];

/// A row as read from a file, before validation.
#[derive(Debug, Clone)]
pub(crate) struct RawRow {
    /// Where it comes from.
    pub at: Location,
    /// The row: a JSON object with one entry per column.
    pub value: Value,
}

/// Checks `raw` and builds its [`Example`]; `stem` is the file stem used for generated ids.
pub(crate) fn to_example(raw: &RawRow, keys: &DataKeys, stem: &str) -> Result<Example> {
    let at = &raw.at;
    let Value::Object(row) = &raw.value else {
        return Err(DataError::row(
            at,
            "(row)",
            format!("{}, expected a JSON object", kind(&raw.value)),
        ));
    };
    reject_multimodal(row, at)?;
    let prompt = prompt(row, &keys.prompt, at)?;
    let rubrics = match lookup(row, &keys.rubrics) {
        Some(v) => parse_criteria(v).map_err(|e| DataError::row(at, &keys.rubrics, e))?,
        None => Vec::new(),
    };
    let answer = answer(row, &keys.answer, at)?;
    let answer = match answer {
        Some(a) => a,
        None if !rubrics.is_empty() => String::new(),
        None => {
            return Err(DataError::row(
                at,
                &keys.answer,
                format!(
                    "no answer (the column is missing or empty, and so are `{}`); \
                     every row needs a reference answer unless it has rubric criteria",
                    ANSWER_FALLBACKS.join("` and `")
                ),
            ));
        }
    };
    let difficulty = match lookup(row, &keys.difficulty) {
        None => None,
        Some(Value::String(s)) if s.trim().is_empty() => None,
        Some(Value::String(s)) => Some(s.trim().to_owned()),
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(other) => {
            return Err(DataError::row(
                at,
                &keys.difficulty,
                format!("{}, expected a string label", kind(other)),
            ));
        }
    };
    let global_id = match lookup(row, &keys.global_id) {
        None => format!("{stem}-{}", at.row),
        Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
        Some(other) => {
            return Err(DataError::row(
                at,
                &keys.global_id,
                format!("{other}, expected a non-empty string or an integer"),
            ));
        }
    };
    Ok(Example {
        global_id,
        prompt,
        answer,
        difficulty,
        rubrics,
        row: at.row,
    })
}

/// Errors if an `images`/`videos` column holds anything (null, `[]` and `""` are fine).
fn reject_multimodal(row: &Map<String, Value>, at: &Location) -> Result<()> {
    for key in MULTIMODAL_KEYS {
        let empty = match lookup(row, key) {
            None => true,
            Some(Value::Array(a)) => a.is_empty(),
            Some(Value::String(s)) => s.is_empty(),
            Some(Value::Object(o)) => o.is_empty(),
            Some(_) => false,
        };
        if !empty {
            return Err(DataError::Multimodal {
                at: at.clone(),
                key: key.to_owned(),
            });
        }
    }
    Ok(())
}

fn prompt(row: &Map<String, Value>, key: &str, at: &Location) -> Result<Prompt> {
    let value = lookup(row, key)
        .ok_or_else(|| DataError::row(at, key, "no prompt (the column is missing or null)"))?;
    match value {
        Value::String(s) if s.trim().is_empty() => Err(DataError::row(at, key, "empty prompt")),
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) if items.is_empty() => {
            Err(DataError::row(at, key, "empty list of messages"))
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, m)| {
                message(m).map_err(|e| DataError::row(at, key, format!("message {i}: {e}")))
            })
            .collect::<Result<Vec<_>>>()
            .map(Prompt::Messages),
        other => Err(DataError::row(
            at,
            key,
            format!(
                "{}, expected a string or a list of {{role, content}} messages",
                kind(other)
            ),
        )),
    }
}

fn message(m: &Value) -> std::result::Result<ChatMessage, String> {
    let Value::Object(obj) = m else {
        return Err(format!("{}, expected an object {{role, content}}", kind(m)));
    };
    let role = match obj.get("role") {
        Some(Value::String(r)) if !r.trim().is_empty() => r.clone(),
        Some(other) => return Err(format!("`role` is {other}, expected a non-empty string")),
        None => return Err("no `role`".into()),
    };
    let content = match obj.get("content") {
        Some(Value::String(c)) => c.clone(),
        Some(Value::Array(parts)) => {
            let multimodal = parts.iter().any(|p| {
                p.get("type")
                    .and_then(Value::as_str)
                    .is_some_and(|t| t != "text")
            });
            return Err(if multimodal {
                "images/videos are not supported yet (text-only training)".into()
            } else {
                "`content` is a list of parts; only a plain string content is supported".into()
            });
        }
        Some(other) => return Err(format!("`content` is {}, expected a string", kind(other))),
        None => return Err("no `content`".into()),
    };
    Ok(ChatMessage { role, content })
}

/// The answer at `key`, else at the fallbacks; numbers become their decimal text. `None`
/// when every candidate is absent, null or blank.
fn answer(row: &Map<String, Value>, key: &str, at: &Location) -> Result<Option<String>> {
    let candidate = match lookup(row, key) {
        Some(v) => Some((key, v)),
        None => ANSWER_FALLBACKS
            .iter()
            .find_map(|k| lookup(row, k).map(|v| (*k, v))),
    };
    let Some((key, value)) = candidate else {
        return Ok(None);
    };
    match value {
        Value::String(s) if s.trim().is_empty() => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Number(n) => Ok(Some(n.to_string())),
        other => Err(DataError::row(
            at,
            key,
            format!(
                "{}, expected the answer as a string or a number",
                kind(other)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::PathBuf;

    fn raw(v: Value) -> RawRow {
        RawRow {
            at: Location {
                path: PathBuf::from("d.jsonl"),
                row: 3,
                line: Some(5),
            },
            value: v,
        }
    }

    fn ex(v: Value) -> Result<Example> {
        to_example(&raw(v), &DataKeys::default(), "d")
    }

    fn err(v: Value) -> String {
        match ex(v) {
            Ok(e) => format!("unexpected Ok: {e:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn text_prompt_with_defaults() {
        let e = ex(json!({"prompt": "2+2?", "answer": "4"})).unwrap();
        assert_eq!(e.prompt, Prompt::Text("2+2?".into()));
        assert_eq!(e.answer, "4");
        assert_eq!(e.global_id, "d-3");
        assert_eq!(e.row, 3);
        assert_eq!(e.difficulty, None);
        assert!(e.rubrics.is_empty());
    }

    #[test]
    fn verl_row() {
        let e = ex(json!({
            "data_source": "gsm8k",
            "prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}],
            "reward_model": {"style": "rule", "ground_truth": 72},
            "global_id": 17,
            "difficulty": " hard ",
            "images": [],
            "videos": null
        }))
        .unwrap();
        assert_eq!(
            e.prompt,
            Prompt::Messages(vec![ChatMessage::system("sys"), ChatMessage::user("q")])
        );
        assert_eq!(e.answer, "72");
        assert_eq!(e.global_id, "17");
        assert_eq!(e.difficulty.as_deref(), Some("hard"));
    }

    #[test]
    fn answer_fallback_order() {
        let e =
            ex(json!({"prompt": "p", "ground_truth": "g", "reward_model": {"ground_truth": "r"}}))
                .unwrap();
        assert_eq!(e.answer, "g");
        let e = ex(json!({"prompt": "p", "answer": "a", "ground_truth": "g"})).unwrap();
        assert_eq!(e.answer, "a");
        let e = ex(json!({"prompt": "p", "answer": 0.5})).unwrap();
        assert_eq!(e.answer, "0.5");
        // a configured key that a row lacks falls back too
        let keys = DataKeys {
            answer: "solution".into(),
            ..DataKeys::default()
        };
        let e = to_example(
            &raw(json!({"prompt": "p", "ground_truth": "g"})),
            &keys,
            "d",
        )
        .unwrap();
        assert_eq!(e.answer, "g");
    }

    #[test]
    fn rubric_row_needs_no_answer() {
        let e = ex(json!({
            "prompt": [{"role": "user", "content": "q"}],
            "reward_model": {"rubrics": [{"criterion": "c", "points": 2}]}
        }))
        .unwrap();
        assert_eq!(e.answer, "");
        assert_eq!(e.rubrics.len(), 1);
    }

    #[test]
    fn errors_name_file_row_line_and_key() {
        let cases = [
            (
                json!([1]),
                "d.jsonl: row 3 (line 5): `(row)`: a list, expected a JSON object",
            ),
            (json!({"answer": "1"}), "`prompt`: no prompt"),
            (
                json!({"prompt": " ", "answer": "1"}),
                "`prompt`: empty prompt",
            ),
            (
                json!({"prompt": [], "answer": "1"}),
                "empty list of messages",
            ),
            (
                json!({"prompt": 5, "answer": "1"}),
                "a number, expected a string or a list",
            ),
            (
                json!({"prompt": [{"role": "user"}], "answer": "1"}),
                "message 0: no `content`",
            ),
            (
                json!({"prompt": [{"content": "x"}], "answer": "1"}),
                "message 0: no `role`",
            ),
            (
                json!({"prompt": [{"role": "user", "content": [{"type": "image"}]}], "answer": "1"}),
                "images/videos are not supported yet",
            ),
            (
                json!({"prompt": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "answer": "1"}),
                "only a plain string content",
            ),
            (json!({"prompt": "p"}), "`answer`: no answer"),
            (json!({"prompt": "p", "answer": ""}), "`answer`: no answer"),
            (
                json!({"prompt": "p", "answer": [1]}),
                "`answer`: a list, expected the answer",
            ),
            (
                json!({"prompt": "p", "ground_truth": true}),
                "`ground_truth`: a boolean",
            ),
            (
                json!({"prompt": "p", "answer": "1", "images": ["a.png"]}),
                "`images`: images/videos are not supported yet",
            ),
            (
                json!({"prompt": "p", "answer": "1", "videos": "v.mp4"}),
                "`videos`: images/videos are not supported yet",
            ),
            (
                json!({"prompt": "p", "answer": "1", "global_id": ""}),
                "`global_id`: \"\", expected a non-empty string or an integer",
            ),
            (
                json!({"prompt": "p", "answer": "1", "global_id": 1.5}),
                "`global_id`: 1.5",
            ),
            (
                json!({"prompt": "p", "answer": "1", "difficulty": ["e"]}),
                "`difficulty`: a list",
            ),
            (
                json!({"prompt": "p", "answer": "1", "reward_model": {"rubrics": [{"criterion": "c"}]}}),
                "`reward_model.rubrics`: criterion 0: `c`: no `points`",
            ),
        ];
        for (v, want) in cases {
            let e = err(v.clone());
            assert!(e.contains(want), "{v}: got `{e}`, want `{want}`");
        }
    }
}
