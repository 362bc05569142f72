//! An interaction: a program that answers each model turn that calls no tool, as a user
//! would — feedback, a follow-up question, or the end of the episode with a reward (verl's
//! `interaction` idea, spoken in JSON lines like the tools of [`super::external`]).
//!
//! Each turn writes one line `{"messages": [...], "kwargs": {...}, "turn": n}` — the
//! conversation so far (the model's turn last), the data row's verl
//! `extra_info.interaction_kwargs` (`null` without) and the turn's number from 1 — and reads
//! one line back: `{"content": "…", "done": false, "reward": 0.5}`. `content` becomes the
//! next user message (unused when `done`); `reward` (a finite number, 0 when left out) is
//! this turn's score; `done: true` ends the episode. A program that hangs past the timeout
//! (it is killed), exits, or replies with anything else ends the episode: it is counted as
//! an interaction error, never an error of the run.

use std::time::Duration;

use serde_json::{Value, json};

use super::external::{CommandPool, cap_output};

/// An interaction program (at most `max_concurrency` copies at once).
#[derive(Debug)]
pub struct Interaction {
    pool: CommandPool,
}

/// What the interaction said after a model turn.
#[derive(Debug, Clone, PartialEq)]
pub struct InteractionReply {
    /// The next user message (cut at [`super::external::MAX_TOOL_OUTPUT_BYTES`]).
    pub content: String,
    /// Whether the episode ends here.
    pub done: bool,
    /// This turn's score.
    pub reward: f64,
}

impl Interaction {
    /// An interaction answered by `command` (split as a shell would, run without one).
    ///
    /// # Errors
    /// An empty command or unbalanced quotes; a zero timeout or concurrency.
    pub fn new(command: &str, timeout: Duration, max_concurrency: usize) -> Result<Self, String> {
        Ok(Self {
            pool: CommandPool::new(command, timeout, max_concurrency)?,
        })
    }

    /// The program's reply to turn `turn` of `messages`, given the row's `kwargs`.
    ///
    /// # Errors
    /// The program's failure, or a reply that is not of the form above, as text.
    pub fn respond(
        &self,
        messages: &[Value],
        kwargs: Option<&Value>,
        turn: usize,
    ) -> Result<InteractionReply, String> {
        let request = json!({"messages": messages, "kwargs": kwargs, "turn": turn});
        let reply = self.pool.exchange(&request.to_string())?;
        let bad = |what: &str| format!("the interaction's reply {what}: {reply}");
        let done = match reply.get("done") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(bad("has a `done` that is not true or false")),
        };
        let reward = match reply.get("reward") {
            None | Some(Value::Null) => 0.0,
            Some(v) => v
                .as_f64()
                .filter(|r| r.is_finite())
                .ok_or_else(|| bad("has a `reward` that is not a finite number"))?,
        };
        let content = match reply.get("content") {
            Some(Value::String(c)) => cap_output(c.clone()),
            None if done => String::new(),
            _ => return Err(bad("has no `content` text")),
        };
        Ok(InteractionReply {
            content,
            done,
            reward,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(script: &str) -> Interaction {
        Interaction::new(&format!("sh -c '{script}'"), Duration::from_millis(500), 2).unwrap()
    }

    #[test]
    fn replies_are_read_and_checked() {
        let messages = [json!({"role": "assistant", "content": "12"})];
        let ok = env(
            r#"while read -r l; do echo "{\"content\": \"try again\", \"reward\": -0.5}"; done"#,
        );
        let r = ok.respond(&messages, None, 1).unwrap();
        assert_eq!(
            (r.content.as_str(), r.done, r.reward),
            ("try again", false, -0.5)
        );
        let end = env(r#"read -r l; echo "{\"done\": true, \"reward\": 1}""#);
        let r = end
            .respond(&messages, Some(&json!({"answer": 12})), 2)
            .unwrap();
        assert_eq!((r.done, r.reward), (true, 1.0));
        // the request carries the conversation, the row's kwargs and the turn
        let echo = env(
            r#"read -r l; printf "{\"content\": %s}\n" "$(printf %s "$l" | sed "s/\"/\\\\\"/g; s/.*/\"&\"/")""#,
        );
        let r = echo
            .respond(&messages, Some(&json!({"answer": 12})), 3)
            .unwrap();
        assert_eq!(
            r.content,
            r#"{"messages":[{"role":"assistant","content":"12"}],"kwargs":{"answer":12},"turn":3}"#
        );
        for (script, part) in [
            (
                r#"read -r l; echo "{\"done\": 1}""#,
                "`done` that is not true or false",
            ),
            (
                r#"read -r l; echo "{\"content\": \"x\", \"reward\": \"high\"}""#,
                "not a finite number",
            ),
            (
                r#"read -r l; echo "{\"done\": false}""#,
                "no `content` text",
            ),
            ("read -r l; echo nope", "not JSON"),
            ("sleep 30", "no reply within 0.5 s"),
            ("read -r l; exit 2", "closed its output"),
        ] {
            let e = env(script).respond(&messages, None, 1).unwrap_err();
            assert!(e.contains(part), "{script}: {e}");
        }
        assert!(Interaction::new("", Duration::from_secs(1), 1).is_err());
        assert!(Interaction::new("x", Duration::ZERO, 1).is_err());
    }
}
