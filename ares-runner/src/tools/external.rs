//! Tools that are programs: a command spoken to in JSON lines, as the rubric grader is.
//!
//! Each call writes one line `{"name": …, "arguments": {…}}` (with `"kwargs"`: the data
//! row's entry for this tool in verl's `extra_info.tools_kwargs`, when it has one) and reads
//! one line back,
//! `{"content": "…"}` or `{"error": "…"}`. The program is started without a shell and kept
//! running between calls; at most `max_concurrency` copies run at once. Whatever goes
//! wrong — the program hangs past the timeout (it is killed), exits, prints something that
//! is not a reply, or floods its output — is that call's error, shown to the model; the
//! next call starts a fresh copy. A reply's content is cut at [`MAX_TOOL_OUTPUT_BYTES`].

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::Tool;
use crate::reward::process::LineProcess;

/// The most of a reply's content the model is shown.
pub const MAX_TOOL_OUTPUT_BYTES: usize = 16 << 10;

/// Copies of a program spoken to in JSON lines: one request line, one reply line, each
/// exchange within a timeout, at most `max_concurrency` copies at once (tools and
/// interactions).
pub struct CommandPool {
    program: String,
    args: Vec<String>,
    timeout: Duration,
    max_concurrency: usize,
    /// Idle copies, and how many copies exist (idle or in an exchange).
    pool: Mutex<(Vec<LineProcess>, usize)>,
    freed: Condvar,
}

impl std::fmt::Debug for CommandPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandPool")
            .field("program", &self.program)
            .field("args", &self.args)
            .finish_non_exhaustive()
    }
}

impl CommandPool {
    /// Copies of `command` (split as a shell would, run without one), started when needed.
    ///
    /// # Errors
    /// An empty command or unbalanced quotes; a zero timeout or concurrency.
    pub fn new(command: &str, timeout: Duration, max_concurrency: usize) -> Result<Self, String> {
        let words = shlex::split(command)
            .ok_or_else(|| format!("`{command}`: unbalanced quotes or a trailing backslash"))?;
        let (program, args) = words
            .split_first()
            .ok_or_else(|| "an empty command".to_string())?;
        if timeout.is_zero() || max_concurrency == 0 {
            return Err(format!(
                "`{command}`: the timeout and the concurrency limit must be above 0"
            ));
        }
        Ok(Self {
            program: program.clone(),
            args: args.to_vec(),
            timeout,
            max_concurrency,
            pool: Mutex::new((Vec::new(), 0)),
            freed: Condvar::new(),
        })
    }

    /// Sends `request` (one line) to an idle copy and reads its reply as JSON. A copy whose
    /// exchange failed is dropped (the next exchange starts a fresh one).
    ///
    /// # Errors
    /// The program cannot start, exits, sends nothing within the timeout (it is killed) or
    /// a line that is not JSON.
    pub fn exchange(&self, request: &str) -> Result<Value, String> {
        let mut p = self.acquire()?;
        let reply = (|| {
            p.send(request)?;
            let line = p.next_line(Some(self.timeout))?;
            serde_json::from_str(line.trim()).map_err(|_| {
                let shown: String = line.trim().chars().take(200).collect();
                format!("the program replied with something that is not JSON: {shown:?}")
            })
        })();
        // a copy whose exchange failed is out of step (or dead): drop it
        let healthy = reply.is_ok() && p.broken().is_none();
        self.release(healthy.then_some(p));
        reply
    }

    /// An idle copy, or a new one while fewer than `max_concurrency` exist; else waits.
    fn acquire(&self) -> Result<LineProcess, String> {
        let mut pool = self
            .pool
            .lock()
            .map_err(|_| "an exchange panicked".to_string())?;
        loop {
            if let Some(p) = pool.0.pop() {
                return Ok(p);
            }
            if pool.1 < self.max_concurrency {
                pool.1 += 1;
                drop(pool);
                return LineProcess::spawn(&self.program, &self.args).inspect_err(|_| {
                    self.release(None);
                });
            }
            pool = self
                .freed
                .wait(pool)
                .map_err(|_| "an exchange panicked".to_string())?;
        }
    }

    /// Returns a copy to the pool (`None`: it is gone).
    fn release(&self, process: Option<LineProcess>) {
        if let Ok(mut pool) = self.pool.lock() {
            match process {
                Some(p) => pool.0.push(p),
                None => pool.1 = pool.1.saturating_sub(1),
            }
        }
        self.freed.notify_one();
    }
}

/// Cuts `content` at [`MAX_TOOL_OUTPUT_BYTES`] (on a character boundary), saying so.
pub(crate) fn cap_output(mut content: String) -> String {
    if content.len() > MAX_TOOL_OUTPUT_BYTES {
        let mut cut = MAX_TOOL_OUTPUT_BYTES;
        while !content.is_char_boundary(cut) {
            cut -= 1;
        }
        content.truncate(cut);
        content.push_str(&format!(" [cut at {} KiB]", MAX_TOOL_OUTPUT_BYTES >> 10));
    }
    content
}

/// A tool run by an external command.
#[derive(Debug)]
pub struct CommandTool {
    schema: Value,
    pool: CommandPool,
}

impl CommandTool {
    /// A tool described by `schema` (its `function.name` is the tool's name), answered by
    /// `command` (split as a shell would, run without one).
    ///
    /// # Errors
    /// An empty command or unbalanced quotes; a zero timeout or concurrency.
    pub fn new(
        schema: Value,
        command: &str,
        timeout: Duration,
        max_concurrency: usize,
    ) -> Result<Self, String> {
        let pool = CommandPool::new(command, timeout, max_concurrency)
            .map_err(|e| e.replace("an empty command", "an empty tool command"))?;
        Ok(Self { schema, pool })
    }
}

impl Tool for CommandTool {
    fn schema(&self) -> Value {
        self.schema.clone()
    }

    fn call(&self, arguments: &Map<String, Value>, row: Option<&Value>) -> Result<String, String> {
        let name = super::schema_name(&self.schema).unwrap_or_default();
        let mut request = json!({"name": name, "arguments": arguments});
        if let Some(kwargs) = row {
            request["kwargs"] = kwargs.clone();
        }
        let reply = self
            .pool
            .exchange(&request.to_string())
            .map_err(|e| e.replace("the program replied", "the tool replied"))?;
        let content = match (reply.get("content"), reply.get("error")) {
            (_, Some(Value::String(e))) => return Err(e.clone()),
            (Some(Value::String(c)), None) => c.clone(),
            (Some(other), None) => other.to_string(),
            _ => return Err("the tool's reply has neither `content` nor `error`".into()),
        };
        Ok(cap_output(content))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{ParsedCall, ToolBox, ToolCall};
    use std::time::Instant;

    fn tool(command: &str) -> CommandTool {
        CommandTool::new(
            json!({"type": "function", "function": {"name": "echo"}}),
            command,
            Duration::from_millis(500),
            2,
        )
        .unwrap()
    }

    fn call(t: CommandTool) -> (String, bool) {
        let mut b = ToolBox::default();
        b.add(Box::new(t)).unwrap();
        let r = b.run(
            &ParsedCall::Call(ToolCall {
                name: "echo".into(),
                arguments: json!({"x": 1}).as_object().unwrap().clone(),
            }),
            None,
        );
        (r.content, r.ok)
    }

    #[test]
    fn a_command_answers_in_json_lines() {
        // replies with the request it read
        let t = tool(
            r#"sh -c 'while read -r l; do printf "{\"content\": %s}\n" "$(printf %s "$l" | sed "s/\"/\\\\\"/g; s/.*/\"&\"/")"; done'"#,
        );
        let (content, ok) = call(t);
        assert!(ok, "{content}");
        assert_eq!(content, r#"{"name":"echo","arguments":{"x":1}}"#);
        // the row's entry for this tool goes with the call
        let t = tool(
            r#"sh -c 'while read -r l; do printf "{\"content\": %s}\n" "$(printf %s "$l" | sed "s/\"/\\\\\"/g; s/.*/\"&\"/")"; done'"#,
        );
        let got = t.call(&Map::new(), Some(&json!({"ground_truth": "408"})));
        assert_eq!(
            got.as_deref(),
            Ok(r#"{"name":"echo","arguments":{},"kwargs":{"ground_truth":"408"}}"#)
        );
        let t = tool(r#"sh -c 'read -r l; echo "{\"error\": \"no such city\"}"'"#);
        assert_eq!(call(t), ("error: no such city".into(), false));
    }

    /// A tool that hangs, crashes, prints garbage or floods its output is a tool-error
    /// message, and the call returns within the timeout.
    #[test]
    fn misbehaving_tools_are_errors_for_the_model() {
        let t0 = Instant::now();
        for (command, part) in [
            ("sleep 30", "no reply within 0.5 s"),
            ("sh -c 'read -r l; exit 3'", "closed its output"),
            (
                "sh -c 'read -r l; echo not json; sleep 30'",
                "not JSON: \"not json\"",
            ),
            (
                "sh -c 'read -r l; echo {}'",
                "neither `content` nor `error`",
            ),
            ("/nonexistent/tool", "cannot start"),
        ] {
            let (content, ok) = call(tool(command));
            assert!(!ok && content.contains(part), "{command}: {content}");
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        // a flood is cut for the model
        let (content, ok) = call(tool(
            r#"sh -c 'read -r l; printf "{\"content\": \""; head -c 100000 /dev/zero | tr "\0" a; printf "\"}\n"'"#,
        ));
        assert!(ok);
        assert!(content.ends_with(" [cut at 16 KiB]") && content.len() < 17 << 10);
    }

    #[test]
    fn a_broken_copy_is_replaced_and_concurrency_is_bounded() {
        // the first copy exits after one call; the next call starts a fresh one
        let t = tool(r#"sh -c 'read -r l; echo "{\"content\": \"once\"}"'"#);
        let mut b = ToolBox::default();
        b.add(Box::new(t)).unwrap();
        let c = ParsedCall::Call(ToolCall {
            name: "echo".into(),
            arguments: Map::new(),
        });
        assert_eq!(b.run(&c, None).content, "once");
        // the copy exited: this call fails on it or starts a new one, never hangs
        let second = b.run(&c, None);
        assert!(second.content == "once" || !second.ok, "{second:?}");
        assert_eq!(b.run(&c, None).content, "once");

        // 4 threads, 3 calls each, at most 2 copies: each copy writes its pid once
        let dir = tempfile::tempdir().unwrap();
        let pids = dir.path().join("pids");
        let t = CommandTool::new(
            json!({"type": "function", "function": {"name": "echo"}}),
            &format!(
                r#"sh -c 'echo $$ >> {}; while read -r l; do sleep 0.05; echo "{{\"content\": \"ok\"}}"; done'"#,
                pids.display()
            ),
            Duration::from_secs(5),
            2,
        )
        .unwrap();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..3 {
                        assert_eq!(t.call(&Map::new(), None).as_deref(), Ok("ok"));
                    }
                });
            }
        });
        let started = std::fs::read_to_string(&pids).unwrap();
        let copies = started.lines().count();
        assert!((1..=2).contains(&copies), "{started}");
        assert!(CommandTool::new(json!({}), "x", Duration::ZERO, 1).is_err());
        assert!(CommandTool::new(json!({}), "", Duration::from_secs(1), 1).is_err());
    }
}
