//! One training or evaluation example ([`Example`]) and its prompt ([`Prompt`]).

use serde::{Deserialize, Serialize};

use super::criterion::Criterion;
use crate::hf::chat::ChatMessage;

/// A prompt as a dataset gives it: plain text (to be wrapped as one user turn) or a chat
/// conversation (verl's `[{"role": "user", "content": …}]`).
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
}
