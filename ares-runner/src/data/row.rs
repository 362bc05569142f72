//! One raw row (a JSON object, whatever the file format) checked and turned into an
//! [`Example`].

use serde_json::{Map, Value};

use super::criterion::{kind, parse_criteria};
use super::error::{DataError, Location, Result};
use super::example::{Example, Prompt};
use super::keys::{ANSWER_FALLBACKS, DataKeys, MediaKeys, lookup};
use super::media::{
    IMAGE_PLACEHOLDER, MediaKind, VIDEO_PLACEHOLDER, count_mismatch, count_placeholders,
    media_column,
};
use crate::hf::chat::ChatMessage;

/// A row as read from a file, before validation.
#[derive(Debug, Clone)]
pub(crate) struct RawRow {
    /// Where it comes from.
    pub at: Location,
    /// The row: a JSON object with one entry per column.
    pub value: Value,
}

/// Checks `raw` and builds its [`Example`]; `stem` is the file stem used for generated ids.
pub(crate) fn to_example(
    raw: &RawRow,
    keys: &DataKeys,
    media: &MediaKeys,
    stem: &str,
) -> Result<Example> {
    let at = &raw.at;
    let Value::Object(row) = &raw.value else {
        return Err(DataError::row(
            at,
            "(row)",
            format!("{}, expected a JSON object", kind(&raw.value)),
        ));
    };
    let (prompt, items) = prompt(row, &keys.prompt, at)?;
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
    let base = media.base_dir.as_deref();
    let images = media_column(row, &media.image, MediaKind::Image, at, base, &global_id)?;
    let videos = media_column(row, &media.video, MediaKind::Video, at, base, &global_id)?;
    // In a text row, `<image>` in the text is plain text; content items always count.
    let (image_marks, video_marks) = if images.is_empty() && videos.is_empty() {
        items
    } else {
        prompt
            .to_messages()
            .iter()
            .map(|m| count_placeholders(&m.content))
            .fold((0, 0), |(a, b), (i, v)| (a + i, b + v))
    };
    for (kind, key, have, found) in [
        (MediaKind::Image, &media.image, images.len(), image_marks),
        (MediaKind::Video, &media.video, videos.len(), video_marks),
    ] {
        if have != found {
            return Err(DataError::media(
                at,
                &global_id,
                key,
                count_mismatch(kind, have, found),
            ));
        }
    }
    let tools_kwargs = match lookup(row, TOOLS_KWARGS) {
        None => None,
        Some(Value::Object(m)) => Some(m.clone()),
        Some(other) => {
            return Err(DataError::row(
                at,
                TOOLS_KWARGS,
                format!("{}, expected an object of tool names", kind(other)),
            ));
        }
    };
    let interaction_kwargs = lookup(row, INTERACTION_KWARGS).cloned();
    Ok(Example {
        global_id,
        prompt,
        answer,
        difficulty,
        rubrics,
        row: at.row,
        images,
        videos,
        tools_kwargs,
        interaction_kwargs,
    })
}

/// Where verl's multi-turn rows keep what each tool is given.
const TOOLS_KWARGS: &str = "extra_info.tools_kwargs";
/// Where verl's multi-turn rows keep what the interaction is given.
const INTERACTION_KWARGS: &str = "extra_info.interaction_kwargs";

/// The prompt at `key`, with the number of image and video content items of its messages
/// (which the text holds as placeholders).
fn prompt(row: &Map<String, Value>, key: &str, at: &Location) -> Result<(Prompt, (usize, usize))> {
    let value = lookup(row, key)
        .ok_or_else(|| DataError::row(at, key, "no prompt (the column is missing or null)"))?;
    match value {
        Value::String(s) if s.trim().is_empty() => Err(DataError::row(at, key, "empty prompt")),
        Value::String(s) => Ok((Prompt::Text(s.clone()), (0, 0))),
        Value::Array(items) if items.is_empty() => {
            Err(DataError::row(at, key, "empty list of messages"))
        }
        Value::Array(items) => {
            let mut messages = Vec::with_capacity(items.len());
            let (mut images, mut videos) = (0, 0);
            for (i, m) in items.iter().enumerate() {
                let (msg, (im, vi)) =
                    message(m).map_err(|e| DataError::row(at, key, format!("message {i}: {e}")))?;
                messages.push(msg);
                images += im;
                videos += vi;
            }
            Ok((Prompt::Messages(messages), (images, videos)))
        }
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

/// One chat message; a content list (`[{"type": "text", "text": …}, {"type": "image"}, …]`)
/// becomes its text with `<image>` / `<video>` where the image and video items are, and their
/// counts.
fn message(m: &Value) -> std::result::Result<(ChatMessage, (usize, usize)), String> {
    let Value::Object(obj) = m else {
        return Err(format!("{}, expected an object {{role, content}}", kind(m)));
    };
    let role = match obj.get("role") {
        Some(Value::String(r)) if !r.trim().is_empty() => r.clone(),
        Some(other) => return Err(format!("`role` is {other}, expected a non-empty string")),
        None => return Err("no `role`".into()),
    };
    let (content, counts) = match obj.get("content") {
        Some(Value::String(c)) => (c.clone(), (0, 0)),
        Some(Value::Array(parts)) => content_items(parts)?,
        Some(other) => {
            return Err(format!(
                "`content` is {}, expected a string or a list of content items",
                kind(other)
            ));
        }
        None => return Err("no `content`".into()),
    };
    Ok((ChatMessage { role, content }, counts))
}

/// A content list as text with placeholders, and its image and video item counts.
fn content_items(parts: &[Value]) -> std::result::Result<(String, (usize, usize)), String> {
    let mut text = String::new();
    let (mut images, mut videos) = (0, 0);
    for (j, part) in parts.iter().enumerate() {
        let Value::Object(p) = part else {
            return Err(format!(
                "content item {j}: {}, expected an object {{\"type\": …}}",
                kind(part)
            ));
        };
        match p.get("type").and_then(Value::as_str) {
            Some("text") => match p.get("text") {
                Some(Value::String(t)) => text.push_str(t),
                Some(other) => {
                    return Err(format!(
                        "content item {j}: `text` is {}, expected a string",
                        kind(other)
                    ));
                }
                None => return Err(format!("content item {j}: a text item without `text`")),
            },
            Some("image") => {
                images += 1;
                text.push_str(IMAGE_PLACEHOLDER);
            }
            Some("video") => {
                videos += 1;
                text.push_str(VIDEO_PLACEHOLDER);
            }
            Some(other) => {
                return Err(format!(
                    "content item {j}: type `{other}` (expected `text`, `image` or `video`)"
                ));
            }
            None => return Err(format!("content item {j}: no `type`")),
        }
    }
    Ok((text, (images, videos)))
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
    use crate::data::MediaSource;
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
        to_example(&raw(v), &DataKeys::default(), &MediaKeys::default(), "d")
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
            &MediaKeys::default(),
            "d",
        )
        .unwrap();
        assert_eq!(e.answer, "g");
    }

    #[test]
    fn content_lists_and_inline_media() {
        // text-only content items are joined
        let e = ex(json!({
            "prompt": [{"role": "user", "content": [
                {"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}
            ]}],
            "answer": "4"
        }))
        .unwrap();
        assert_eq!(
            e.prompt,
            Prompt::Messages(vec![ChatMessage::user("What is 2+2?")])
        );
        assert!(!e.has_media());
        // image items become placeholders; inline bytes need no file
        let e = ex(json!({
            "prompt": [{"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": "Describe."}
            ]}],
            "answer": "x",
            "images": [{"bytes": "TWFu", "path": null}]
        }))
        .unwrap();
        assert_eq!(
            e.prompt,
            Prompt::Messages(vec![ChatMessage::user("<image>Describe.")])
        );
        assert_eq!(e.images, vec![MediaSource::Bytes(b"Man".to_vec())]);
        // a text row keeps `<image>` as text
        let e =
            ex(json!({"prompt": "Is <image> an HTML tag?", "answer": "no", "images": []})).unwrap();
        assert!(!e.has_media());
        // a single struct (non-list `Image` feature) and `{}` as no media
        let e = ex(
            json!({"prompt": "<image>", "answer": "1", "images": {"bytes": [1, 2]}, "videos": {}}),
        )
        .unwrap();
        assert_eq!(e.images, vec![MediaSource::Bytes(vec![1, 2])]);
        assert!(e.videos.is_empty());
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
                "d.jsonl: row 3 (line 5) (global_id `d-3`): `images`: the row has 0 image(s) but \
                 its prompt has 1 `<image>` placeholder(s)",
            ),
            (
                json!({"prompt": [{"role": "user", "content": [{"type": "video"}, {"type": "video"}]}], "answer": "1", "global_id": 7}),
                "(global_id `7`): `videos`: the row has 0 video(s) but its prompt has 2 `<video>`",
            ),
            (
                json!({"prompt": [{"role": "user", "content": [{"type": "audio"}]}], "answer": "1"}),
                "`prompt`: message 0: content item 0: type `audio` (expected `text`, `image` or `video`)",
            ),
            (
                json!({"prompt": [{"role": "user", "content": [{"type": "text"}]}], "answer": "1"}),
                "message 0: content item 0: a text item without `text`",
            ),
            (
                json!({"prompt": [{"role": "user", "content": ["x"]}], "answer": "1"}),
                "message 0: content item 0: a string, expected an object",
            ),
            (
                json!({"prompt": [{"role": "user", "content": 3}], "answer": "1"}),
                "message 0: `content` is a number, expected a string or a list of content items",
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
                json!({"prompt": "<image>p", "answer": "1", "images": ["a.png"]}),
                "(global_id `d-3`): `images`: image 0: no such file: a.png",
            ),
            (
                json!({"prompt": "<video>p", "answer": "1", "videos": "v.mp4"}),
                "(global_id `d-3`): `videos`: video 0: no such file: v.mp4",
            ),
            (
                json!({"prompt": "<image>p", "answer": "1", "images": 5}),
                "(global_id `d-3`): `images`: a number, expected a list of images",
            ),
            (
                json!({"prompt": "<image>p", "answer": "1", "images": [true]}),
                "`images`: image 0: a boolean, expected a path or a {bytes, path} struct",
            ),
            (
                json!({"prompt": "p", "answer": "1", "images": [{"bytes": "TWFu"}]}),
                "`images`: the row has 1 image(s) but its prompt has 0 `<image>` placeholder(s)",
            ),
            (
                json!({"prompt": "<image><image>", "answer": "1", "images": [{"bytes": "TWFu"}]}),
                "`images`: the row has 1 image(s) but its prompt has 2 `<image>`",
            ),
            (
                json!({"prompt": "<image>", "answer": "1", "images": [{"bytes": "TWFu"}], "videos": [[1, 2]]}),
                "`videos`: the row has 1 video(s) but its prompt has 0 `<video>`",
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
