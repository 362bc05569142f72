//! [`LineProcess`]: a helper program spoken to in JSON lines over its stdin and stdout,
//! shared by the external rubric grader and the Python reward worker.
//!
//! The program is started without a shell (arguments as a list), its stderr is passed
//! through, and a reader thread turns its stdout into a channel so that a reply can be
//! waited for with a timeout; a line longer than 64 MiB is an error, not a growing buffer. Once an exchange fails (the process exited, a timeout passed,
//! a write failed) the process is stopped and every later call fails with the first reason:
//! the exchange is out of step.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::thread;
use std::time::{Duration, Instant};

/// How long a helper may take to exit after its stdin is closed before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(2);
/// Longest line of output read from a helper (a reply of a batch of 128 responses with
/// their metrics is a few KiB): a longer one is an error, not a growing buffer.
pub(crate) const MAX_LINE_BYTES: u64 = 64 << 20;

/// A running helper program.
#[derive(Debug)]
pub(crate) struct LineProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<std::io::Result<String>>,
    /// Why the helper can no longer be used, once it cannot.
    broken: Option<String>,
}

impl LineProcess {
    /// Starts `program` with `args`.
    ///
    /// Errors: the program cannot be started (not found, not executable), as a message.
    pub(crate) fn spawn<S: AsRef<OsStr>>(program: &str, args: &[S]) -> Result<Self, String> {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start `{program}`: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| "no stdout pipe".to_string())?;
        let (tx, lines) = channel();
        thread::Builder::new()
            .name("helper-stdout".into())
            .spawn(move || {
                let mut reader = BufReader::new(stdout);
                loop {
                    let mut line = String::new();
                    match (&mut reader).take(MAX_LINE_BYTES).read_line(&mut line) {
                        Ok(0) => break,
                        Ok(n) if n as u64 == MAX_LINE_BYTES && !line.ends_with('\n') => {
                            let _ = tx.send(Err(std::io::Error::other(format!(
                                "a line of output longer than {} MiB",
                                MAX_LINE_BYTES >> 20
                            ))));
                            break;
                        }
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
            .map_err(|e| format!("cannot start the reader thread: {e}"))?;
        Ok(Self {
            child,
            stdin,
            lines,
            broken: None,
        })
    }

    /// The first failure's reason, once the helper is unusable.
    pub(crate) fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Marks the helper unusable, stops the process and returns the message with how it
    /// ended.
    pub(crate) fn fail(&mut self, message: String) -> String {
        let status = self.stop();
        let message = format!("{message}{status}");
        self.broken = Some(message.clone());
        message
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

    /// Kills the process at once (a helper that overran its time limit is not waited for).
    fn kill(&mut self, message: String) -> String {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let status = match self.child.wait() {
            Ok(s) => format!(" (the process was killed: {s})"),
            Err(e) => format!(" (its status is unknown: {e})"),
        };
        let message = format!("{message}{status}");
        self.broken = Some(message.clone());
        message
    }

    /// Writes one line (a newline is added).
    ///
    /// Errors: the write failed (the helper is then stopped).
    pub(crate) fn send(&mut self, line: &str) -> Result<(), String> {
        let written = match self.stdin.as_mut() {
            Some(stdin) => stdin
                .write_all(line.as_bytes())
                .and_then(|()| stdin.write_all(b"\n"))
                .and_then(|()| stdin.flush()),
            None => Err(std::io::Error::other("stdin is closed")),
        };
        written.map_err(|e| self.fail(format!("cannot write the request: {e}")))
    }

    /// The next non-blank line of output, waiting at most `timeout` (forever when `None`).
    ///
    /// Errors: the output closed, could not be read, or the time ran out (the helper is
    /// then stopped, killed on a timeout).
    pub(crate) fn next_line(&mut self, timeout: Option<Duration>) -> Result<String, String> {
        let deadline = timeout.map(|t| Instant::now() + t);
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
                    let secs = timeout.map_or(0.0, |t| t.as_secs_f64());
                    return Err(self.kill(format!("no reply within {secs} s")));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.fail("closed its output without replying".into()));
                }
            }
        }
    }
}

impl Drop for LineProcess {
    fn drop(&mut self) {
        if self.broken.is_none() {
            self.stop();
        }
    }
}
