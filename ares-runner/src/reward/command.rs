//! [`CommandGrader`]: rubric verdicts from an external program (for example a script that
//! asks an LLM judge), over JSON lines on its stdin and stdout.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::{Result, RewardError};
use super::process::LineProcess;
use super::rubric::RubricGrader;
use crate::data::Criterion;

/// Longest excerpt of a bad reply quoted in an error.
const QUOTE: usize = 200;

/// An external grader process, started once and asked once per response.
///
/// The command line is split like a POSIX shell splits words (quotes and backslashes) but
/// run without a shell: `python3 judge.py --model x` runs `python3` with three arguments;
/// pipes, redirections and `$VAR`s are not interpreted. The process's stderr is passed
/// through (its logs reach the terminal).
///
/// Protocol, one exchange per [`grade`](RubricGrader::grade) call: the trainer writes one
/// line
///
/// ```text
/// {"prompt": "…", "response": "…", "criteria": [{"criterion": "…", "points": 8.0}, …]}
/// ```
///
/// and reads one line `{"met": [true, false, …]}` with one boolean per criterion (other
/// fields in the reply are ignored, e.g. explanations). Blank lines in the output are
/// skipped. A reply that is not that JSON, or has the wrong length, is an error for that
/// call. If the process exits, or a timeout set with [`with_timeout`](Self::with_timeout)
/// passes, the grader is stopped and every later call fails too (the exchange is out of
/// step). Dropping the grader closes its stdin, waits up to 2 s for it to exit, then kills
/// it.
#[derive(Debug)]
pub struct CommandGrader {
    command: String,
    process: LineProcess,
    timeout: Option<Duration>,
}

#[derive(Serialize)]
struct Request<'a> {
    prompt: &'a str,
    response: &'a str,
    criteria: Vec<RequestCriterion<'a>>,
}

#[derive(Serialize)]
struct RequestCriterion<'a> {
    criterion: &'a str,
    points: f64,
}

#[derive(Deserialize)]
struct Reply {
    met: Vec<bool>,
}

impl CommandGrader {
    /// Starts the grader program.
    ///
    /// Errors ([`RewardError::Command`]): an empty command, unbalanced quotes, or a program
    /// that cannot be started (not found, not executable).
    pub fn spawn(command: &str) -> Result<Self> {
        let fail = |message: String| RewardError::Command {
            command: command.to_owned(),
            message,
        };
        let words = shlex::split(command)
            .ok_or_else(|| fail("unbalanced quotes or a trailing backslash".into()))?;
        let (program, args) = words
            .split_first()
            .ok_or_else(|| fail("empty command".into()))?;
        let process = LineProcess::spawn(program, args).map_err(fail)?;
        Ok(Self {
            command: command.to_owned(),
            process,
            timeout: None,
        })
    }

    /// Fails a call (and stops the grader) when no reply comes within `timeout`. Default:
    /// wait as long as it takes.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The command line as given.
    pub fn command(&self) -> &str {
        &self.command
    }

    fn error(&self, message: impl Into<String>) -> RewardError {
        RewardError::Command {
            command: self.command.clone(),
            message: message.into(),
        }
    }
}

fn quote(s: &str) -> String {
    let s = s.trim_end();
    match s.char_indices().nth(QUOTE) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

impl RubricGrader for CommandGrader {
    fn grade(&mut self, prompt: &str, response: &str, criteria: &[Criterion]) -> Result<Vec<bool>> {
        if let Some(why) = self.process.broken() {
            return Err(self.error(format!("unusable after an earlier failure: {why}")));
        }
        if criteria.is_empty() {
            return Ok(Vec::new());
        }
        let request = Request {
            prompt,
            response,
            criteria: criteria
                .iter()
                .map(|c| RequestCriterion {
                    criterion: &c.criterion,
                    points: c.points,
                })
                .collect(),
        };
        let line =
            serde_json::to_string(&request).map_err(|e| self.error(format!("request: {e}")))?;
        self.process.send(&line).map_err(|e| self.error(e))?;
        let reply = self
            .process
            .next_line(self.timeout)
            .map_err(|e| self.error(e))?;
        parse_reply(&reply, criteria.len()).map_err(|e| self.error(e))
    }
}

/// A grader's reply line: `{"met": [bool, …]}` with one verdict per criterion (other fields
/// ignored). Public for fuzzing and for graders that speak the protocol in Rust.
///
/// # Errors
/// Not that JSON (the reply is quoted, cut at 200 characters), or the wrong number of
/// verdicts.
pub fn parse_reply(reply: &str, criteria: usize) -> std::result::Result<Vec<bool>, String> {
    let met = serde_json::from_str::<Reply>(reply)
        .map_err(|e| {
            format!(
                "expected one line {{\"met\": [true, false, …]}}, got `{}` ({e})",
                quote(reply)
            )
        })?
        .met;
    if met.len() != criteria {
        return Err(format!(
            "replied {} verdicts for {criteria} criteria",
            met.len()
        ));
    }
    Ok(met)
}
