//! One training or evaluation example ([`Example`]) and its prompt ([`Prompt`]).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::criterion::Criterion;
use super::error::{DataError, Result};
use super::media::{MediaKind, MediaSource, Piece, count_mismatch, split_placeholders};
use crate::hf::chat::ChatMessage;

/// A prompt as a dataset gives it: plain text (to be wrapped as one user turn) or a chat
/// conversation (verl's `[{"role": "user", "content": …}]`).
///
/// In a row with images or videos, `<image>` / `<video>` in the text mark where each goes
/// (EasyR1's convention); content items `{"type": "image"}` / `{"type": "video"}` of chat
/// messages are read as these placeholders. [`Example::chat_messages`] turns them back into
/// content items for a vision-language chat template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Prompt {
    /// Plain text.
    Text(String),
    /// Chat messages in order; never empty.
    Messages(Vec<ChatMessage>),
}

impl Prompt {
    /// The conversation the chat template renders: a text prompt becomes one `user` turn.
    pub fn to_messages(&self) -> Vec<ChatMessage> {
        match self {
            Prompt::Text(t) => vec![ChatMessage::user(t.clone())],
            Prompt::Messages(m) => m.clone(),
        }
    }

    /// The question itself: the text, or the content of the last `user` message (the last
    /// message when no message is a user turn). What a grader is shown as the prompt.
    pub fn question(&self) -> &str {
        match self {
            Prompt::Text(t) => t,
            Prompt::Messages(m) => m
                .iter()
                .rev()
                .find(|msg| msg.role == "user")
                .or(m.last())
                .map_or("", |msg| msg.content.as_str()),
        }
    }
}

/// One row of a dataset, validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Example {
    /// Stable id for per-sample state (difficulty tracking): the row's `global_id`, or
    /// `<file stem>-<row>` when the dataset has none. Unique within a dataset.
    pub global_id: String,
    /// The prompt.
    pub prompt: Prompt,
    /// The reference answer (numbers are kept as written, e.g. `42` or `0.5`); empty only
    /// for rubric rows without an answer.
    pub answer: String,
    /// The difficulty label, if the row has one (e.g. `easy`, `medium`, `hard`).
    pub difficulty: Option<String>,
    /// The rubric criteria (graded prompts, rubric reward); empty for plain rows.
    pub rubrics: Vec<Criterion>,
    /// 0-based row in its file.
    pub row: usize,
    /// The row's images (`data.image_key`), one per `<image>` placeholder of the prompt, in
    /// order; empty for a text row.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<MediaSource>,
    /// The row's videos (`data.video_key`), one per `<video>` placeholder, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub videos: Vec<MediaSource>,
    /// verl's `extra_info.tools_kwargs`: per tool name, what this row gives the tool
    /// (passed to a program tool with each call in a multi-turn episode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// verl's `extra_info.interaction_kwargs`: what this row gives the interaction with
    /// each turn of a multi-turn episode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interaction_kwargs: Option<serde_json::Value>,
}

impl Example {
    /// Whether the row has images or videos.
    pub fn has_media(&self) -> bool {
        !self.images.is_empty() || !self.videos.is_empty()
    }

    /// The conversation of `prompt` (this example's prompt, after `format_prompt`) as chat
    /// template messages (`{"role", "content"}` JSON objects, for
    /// [`ChatTemplate::render`](crate::hf::chat::ChatTemplate::render)).
    ///
    /// For a row with media, a message whose text holds `<image>` / `<video>` placeholders gets
    /// a content list as Qwen2-VL's template and transformers expect:
    /// `[{"type": "image"}, {"type": "text", "text": "…"}, …]` (empty text pieces dropped, as
    /// EasyR1 does); other messages keep their string content. A text row's messages are its
    /// plain messages, placeholders or not.
    ///
    /// Errors ([`DataError::Example`]): the prompt's placeholders do not match the row's images
    /// or videos (a `format_prompt` template that adds or drops one); `image_key` /
    /// `video_key` name the columns in the message.
    pub fn chat_messages(
        &self,
        prompt: &Prompt,
        image_key: &str,
        video_key: &str,
    ) -> Result<Vec<Value>> {
        let messages = prompt.to_messages();
        let plain = |m: &ChatMessage| {
            let mut o = Map::new();
            o.insert("role".into(), Value::String(m.role.clone()));
            o.insert("content".into(), Value::String(m.content.clone()));
            Value::Object(o)
        };
        if !self.has_media() {
            return Ok(messages.iter().map(plain).collect());
        }
        let (mut images, mut videos) = (0usize, 0usize);
        let mut out = Vec::with_capacity(messages.len());
        for m in &messages {
            let pieces = split_placeholders(&m.content);
            if !pieces
                .iter()
                .any(|p| matches!(p, Piece::Image | Piece::Video))
            {
                out.push(plain(m));
                continue;
            }
            let items: Vec<Value> = pieces
                .iter()
                .map(|p| {
                    let mut o = Map::new();
                    match p {
                        Piece::Image => {
                            images += 1;
                            o.insert("type".into(), Value::from("image"));
                        }
                        Piece::Video => {
                            videos += 1;
                            o.insert("type".into(), Value::from("video"));
                        }
                        Piece::Text(t) => {
                            o.insert("type".into(), Value::from("text"));
                            o.insert("text".into(), Value::from(*t));
                        }
                    }
                    Value::Object(o)
                })
                .collect();
            let mut o = Map::new();
            o.insert("role".into(), Value::String(m.role.clone()));
            o.insert("content".into(), Value::Array(items));
            out.push(Value::Object(o));
        }
        for (media, key, have, found) in [
            (MediaKind::Image, image_key, self.images.len(), images),
            (MediaKind::Video, video_key, self.videos.len(), videos),
        ] {
            if have != found {
                return Err(DataError::Example {
                    row: self.row,
                    global_id: self.global_id.clone(),
                    key: key.to_owned(),
                    reason: format!(
                        "after format_prompt: {}",
                        count_mismatch(media, have, found)
                    ),
                });
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_question() {
        let t = Prompt::Text("1+1?".into());
        assert_eq!(t.to_messages(), vec![ChatMessage::user("1+1?")]);
        assert_eq!(t.question(), "1+1?");
        let m = Prompt::Messages(vec![
            ChatMessage::system("be brief"),
            ChatMessage::user("first"),
            ChatMessage::assistant("ok"),
            ChatMessage::user("second"),
            ChatMessage::assistant("…"),
        ]);
        assert_eq!(m.question(), "second");
        let s = Prompt::Messages(vec![ChatMessage::system("only")]);
        assert_eq!(s.question(), "only");
    }

    fn example(prompt: Prompt, images: usize, videos: usize) -> Example {
        Example {
            global_id: "g".into(),
            prompt,
            answer: "1".into(),
            difficulty: None,
            rubrics: vec![],
            row: 4,
            images: vec![MediaSource::Path("a.png".into()); images],
            videos: vec![MediaSource::Path("v.mp4".into()); videos],
            tools_kwargs: None,
            interaction_kwargs: None,
        }
    }

    #[test]
    fn chat_messages_with_content_items() {
        use serde_json::json;
        let p = Prompt::Text("<image>Compare it with <image>.".into());
        let e = example(p.clone(), 2, 0);
        assert_eq!(
            e.chat_messages(&p, "images", "videos").unwrap(),
            vec![json!({"role": "user", "content": [
                {"type": "image"},
                {"type": "text", "text": "Compare it with "},
                {"type": "image"},
                {"type": "text", "text": "."}
            ]})]
        );
        let p = Prompt::Messages(vec![
            ChatMessage::system("Look <image> closely"),
            ChatMessage::user("<video>What happens?"),
        ]);
        let e = example(p.clone(), 1, 1);
        assert_eq!(
            e.chat_messages(&p, "images", "videos").unwrap(),
            vec![
                json!({"role": "system", "content": [
                    {"type": "text", "text": "Look "},
                    {"type": "image"},
                    {"type": "text", "text": " closely"}
                ]}),
                json!({"role": "user", "content": [
                    {"type": "video"},
                    {"type": "text", "text": "What happens?"}
                ]}),
            ]
        );
        // text rows: placeholders are plain text
        let p = Prompt::Text("What does <image> mean in HTML?".into());
        let e = example(p.clone(), 0, 0);
        assert_eq!(
            e.chat_messages(&p, "images", "videos").unwrap(),
            vec![json!({"role": "user", "content": "What does <image> mean in HTML?"})]
        );
        // a formatted prompt that lost a placeholder
        let e = example(Prompt::Text("<image><image>x".into()), 2, 0);
        let err = e
            .chat_messages(&Prompt::Text("<image>x".into()), "pics", "videos")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("row 4 (global_id `g`): `pics`: after format_prompt: the row has 2 image(s) but its prompt has 1 `<image>` placeholder(s)"),
            "{err}"
        );
        let e = example(Prompt::Text("<image>x".into()), 1, 1);
        let err = e
            .chat_messages(&e.prompt, "images", "clips")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`clips`: after format_prompt: the row has 1 video(s) but its prompt has 0 `<video>`"), "{err}");
    }

    #[test]
    fn old_checkpoint_json_loads() {
        let text = r#"{"global_id":"a","prompt":{"Text":"q"},"answer":"1","difficulty":null,"rubrics":[],"row":0}"#;
        let e: Example = serde_json::from_str(text).unwrap();
        assert!(!e.has_media());
        assert_eq!(serde_json::to_string(&e).unwrap(), text);
        let e = example(Prompt::Text("<image>".into()), 1, 0);
        let back: Example = serde_json::from_str(&serde_json::to_string(&e).unwrap()).unwrap();
        assert_eq!(back, e);
    }
}
