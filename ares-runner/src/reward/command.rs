//! [`CommandGrader`]: rubric verdicts from an external program (for example a script that
//! asks an LLM judge), over JSON lines on its stdin and stdout.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::thread;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::error::{Result, RewardError};
use super::rubric::RubricGrader;
use crate::data::Criterion;

/// How long a grader may take to exit after its stdin is closed before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(2);
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
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<std::io::Result<String>>,
    timeout: Option<Duration>,
    /// Why the grader can no longer be used, once it cannot.
    broken: Option<String>,
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
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| fail(format!("cannot start `{program}`: {e}")))?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| fail("no stdout pipe".into()))?;
        // A reader thread turns the blocking pipe into a channel, so a reply can be waited
        // for with a timeout; it ends when the pipe closes.
        let (tx, lines) = channel();
        thread::Builder::new()
            .name("grader-stdout".into())
            .spawn(move || {
                let mut reader = BufReader::new(stdout);
                loop {
                    let mut line = String::new();
                    match reader.read_line(&mut line) {
                        Ok(0) => break,
                        Ok(_) => {
                            if tx.send(Ok(line)).is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            break;
                        }
                    }
                }
            })
            .map_err(|e| fail(format!("cannot start the reader thread: {e}")))?;
        Ok(Self {
            command: command.to_owned(),
            child,
            stdin,
            lines,
            timeout: None,
            broken: None,
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

    /// Marks the grader unusable, stops the process and returns the error.
    fn fail(&mut self, message: String) -> RewardError {
        let status = self.stop();
        let message = format!("{message}{status}");
        self.broken = Some(message.clone());
        self.error(message)
    }

    /// Closes stdin, waits briefly, kills if needed; describes the exit for messages.
    fn stop(&mut self) -> String {
        drop(self.stdin.take());
        let deadline = Instant::now() + EXIT_GRACE;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return format!(" (the process exited: {status})"),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return " (the process was killed)".into();
                }
                Err(e) => return format!(" (its status is unknown: {e})"),
            }
        }
    }

    fn next_line(&mut self) -> Result<String> {
        let deadline = self.timeout.map(|t| Instant::now() + t);
        loop {
            let received = match deadline {
                None => self
                    .lines
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected),
                Some(d) => self
                    .lines
                    .recv_timeout(d.saturating_duration_since(Instant::now())),
            };
            match received {
                Ok(Ok(line)) if line.trim().is_empty() => continue,
                Ok(Ok(line)) => return Ok(line),
                Ok(Err(e)) => return Err(self.fail(format!("cannot read its output: {e}"))),
                Err(RecvTimeoutError::Timeout) => {
                    let secs = self.timeout.map_or(0.0, |t| t.as_secs_f64());
                    return Err(self.fail(format!("no reply within {secs} s")));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.fail("closed its output without replying".into()));
                }
            }
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
        if let Some(why) = &self.broken {
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
        let mut line =
            serde_json::to_string(&request).map_err(|e| self.error(format!("request: {e}")))?;
        line.push('\n');
        let written = match self.stdin.as_mut() {
            Some(stdin) => stdin
                .write_all(line.as_bytes())
                .and_then(|()| stdin.flush()),
            None => Err(std::io::Error::other("stdin is closed")),
        };
        if let Err(e) = written {
            return Err(self.fail(format!("cannot write the request: {e}")));
        }
        let reply = self.next_line()?;
        let met = serde_json::from_str::<Reply>(&reply)
            .map_err(|e| {
                self.error(format!(
                    "expected one line {{\"met\": [true, false, …]}}, got `{}` ({e})",
                    quote(&reply)
                ))
            })?
            .met;
        if met.len() != criteria.len() {
            return Err(self.error(format!(
                "replied {} verdicts for {} criteria",
                met.len(),
                criteria.len()
            )));
        }
        Ok(met)
    }
}

impl Drop for CommandGrader {
    fn drop(&mut self) {
        if self.broken.is_none() {
            self.stop();
        }
    }
}
