//! [`RewardFunction`]: a reward function written in Python for EasyR1's interface
//! (`worker.reward.reward_function: path.py:name`), run in one long-lived worker process.
//!
//! The worker (`python_worker.py`, embedded in the binary and passed with `-c`) imports the
//! file once, then answers one JSON line per batch. A `batch` function is called once with
//! the list of every response's inputs and returns a list of dicts; a `sequential` one is
//! called once per response and returns a dict. Each dict's `overall` is the reward; every
//! other key is a metric. Keyword arguments (`reward_function_kwargs`) are passed on every
//! call, as EasyR1's `functools.partial` does.
//!
//! The inputs are EasyR1's (`response`, `response_length`, `ground_truth`) and the ARES
//! fork's batch fields (`accuracy`, `difficulty`, `high_entropy_token_num`,
//! `target_high_entropy_token_num`, `alpha_entropy`, `entropies`), see [`RewardInput`].
//!
//! What the worker may do: it runs the user's file with the user's rights, environment and
//! working directory (a reward function is the user's own code, like a config file). No
//! shell is involved; the interpreter and the file path are passed as arguments. The user's
//! prints go to stderr; stdout carries the protocol only.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::error::{Result, RewardError};
use super::process::LineProcess;

/// The worker's source, run with `python -c`.
const WORKER: &str = include_str!("python_worker.py");
/// How long the worker may take to import the user's file.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest response quoted in an error.
const QUOTE: usize = 300;

/// How the function is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallMode {
    /// Once per batch with a list of inputs.
    Batch,
    /// Once per response.
    Sequential,
}

/// One response's inputs, as EasyR1's reward managers (and the ARES fork's batch manager)
/// pass them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RewardInput<'a> {
    /// The decoded response, without special tokens.
    pub response: &'a str,
    /// Response tokens.
    pub response_length: usize,
    /// The reference answer.
    pub ground_truth: &'a str,
    /// The built-in grader's 0/1 correctness (the ARES fork's trainer-side accuracy).
    pub accuracy: f64,
    /// The group's difficulty bucket: `easy`, `medium` or `hard`.
    pub difficulty: &'static str,
    /// HWE tokens of the response (docs/algorithms.md §1).
    pub high_entropy_token_num: usize,
    /// The bucket's target `T_d` (0 before the bucket's first target, as the ARES fork's
    /// default).
    pub target_high_entropy_token_num: f64,
    /// The bucket's `α_d`; 0 before the bucket's first target (no shaping yet).
    pub alpha_entropy: f64,
    /// Mean token entropy of the response (nats).
    pub entropies: f64,
}

/// A score: `overall` and the other metrics, by name.
pub type Score = BTreeMap<String, f64>;

#[derive(Deserialize)]
#[serde(untagged)]
enum Reply {
    Ready {
        ready: bool,
        reward_type: Option<String>,
        #[serde(default)]
        loggers: Vec<String>,
    },
    Logged {
        #[allow(dead_code)]
        logged: bool,
    },
    Finished {
        #[allow(dead_code)]
        finished: bool,
    },
    Scores {
        scores: Vec<Score>,
    },
    Error {
        error: String,
        #[serde(default)]
        traceback: String,
        index: Option<usize>,
    },
}

/// The reward function a worker imports.
#[derive(Debug, Clone, Copy)]
pub struct FunctionSpec<'a> {
    /// `path.py:name` (`path.py` alone: `main`).
    pub spec: &'a str,
    /// Keyword arguments of every call.
    pub kwargs: &'a Map<String, Value>,
    /// Batch or sequential calls; `None`: the module's `REWARD_TYPE`, else batch.
    pub mode: Option<CallMode>,
}

/// The experiment loggers a worker opens.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoggerSetup {
    /// `wandb`, `tensorboard`, `swanlab`, `mlflow`.
    pub names: Vec<String>,
    /// `trainer.project_name`.
    pub project: String,
    /// `trainer.experiment_name`.
    pub experiment: String,
    /// The resolved config, logged with the run.
    pub config: Value,
    /// The run directory (wandb's and TensorBoard's files go below it).
    pub run_dir: PathBuf,
    /// Resume this wandb run (`trainer.wandb_run_id`).
    pub wandb_run_id: Option<String>,
}

/// One validation generation for the loggers: prompt, response, ground truth, score.
pub type Generation = (String, String, String, f64);

/// A Python worker: a reward function, loggers, or both.
#[derive(Debug)]
pub struct PythonWorker {
    /// `path.py:name`, or `python worker` when there is no function, for messages.
    spec: String,
    process: LineProcess,
    /// How the function is called (`None`: no function).
    mode: Option<CallMode>,
    loggers: Vec<String>,
    timeout: Duration,
    /// Time spent in [`PythonWorker::score`] since the last [`PythonWorker::take_elapsed`].
    elapsed: Duration,
}

/// Splits `path.py:name` (EasyR1: the last `:`; no `:` → `main`).
pub fn parse_spec(spec: &str) -> (PathBuf, String) {
    match spec.rsplit_once(':') {
        Some((path, name)) if !name.is_empty() && !name.contains(['/', '\\']) => {
            (PathBuf::from(path), name.to_string())
        }
        _ => (PathBuf::from(spec), "main".to_string()),
    }
}

impl PythonWorker {
    /// A worker with the reward function of `spec` only (see [`PythonWorker::start`]).
    ///
    /// # Errors
    /// As [`PythonWorker::start`].
    pub fn start_function(
        spec: &str,
        python: &str,
        kwargs: &Map<String, Value>,
        mode: Option<CallMode>,
        timeout: Duration,
    ) -> Result<Self> {
        let function = FunctionSpec { spec, kwargs, mode };
        Self::start(python, Some(function), None, timeout)
    }

    /// Starts the worker with `python` (e.g. `python3`): imports the reward function, if
    /// any, learns how to call it (`mode`, else the module's `REWARD_TYPE`, else batch), and
    /// opens the loggers, if any. Each call (a batch, a log) must be answered within
    /// `timeout`.
    ///
    /// Errors ([`RewardError::Function`]): the function's file is missing, Python cannot be
    /// started, importing the file raised (with the traceback), the function is missing, a
    /// logger's package is missing or its start raised, or the worker gave no answer within
    /// 120 s.
    pub fn start(
        python: &str,
        function: Option<FunctionSpec<'_>>,
        loggers: Option<&LoggerSetup>,
        timeout: Duration,
    ) -> Result<Self> {
        let spec = function.map_or("python worker", |f| f.spec).to_string();
        let fail = |message: String| RewardError::Function {
            function: spec.clone(),
            message,
        };
        let (path, name, mode_arg) = match function {
            Some(f) => {
                let (path, name) = parse_spec(f.spec);
                if !path.is_file() {
                    return Err(fail(format!(
                        "{} is not a file (worker.reward.reward_function is `path.py:function`, \
                         the path relative to the working directory {})",
                        path.display(),
                        std::env::current_dir()
                            .map(|d| d.display().to_string())
                            .unwrap_or_else(|_| "?".into())
                    )));
                }
                let mode = match f.mode {
                    Some(CallMode::Batch) => "batch",
                    Some(CallMode::Sequential) => "sequential",
                    None => "auto",
                };
                (path.to_string_lossy().into_owned(), name, mode)
            }
            None => ("-".to_string(), "-".to_string(), "auto"),
        };
        let args = ["-u", "-c", WORKER, &path, &name, mode_arg];
        let mut process = LineProcess::spawn(python, &args).map_err(|e| {
            fail(format!(
                "{e} (set worker.reward.python to the interpreter that has your packages)"
            ))
        })?;
        let empty = Map::new();
        let hello = serde_json::json!({
            "kwargs": function.map_or(&empty, |f| f.kwargs),
            "loggers": loggers,
        })
        .to_string();
        process.send(&hello).map_err(&fail)?;
        let line = process.next_line(Some(START_TIMEOUT)).map_err(&fail)?;
        let (mode, opened) = match serde_json::from_str::<Reply>(&line) {
            Ok(Reply::Ready {
                ready: true,
                reward_type,
                loggers,
            }) => {
                let mode = match reward_type.as_deref() {
                    Some("sequential") => Some(CallMode::Sequential),
                    Some(_) => Some(CallMode::Batch),
                    None => None,
                };
                (mode, loggers)
            }
            Ok(Reply::Error {
                error, traceback, ..
            }) => return Err(fail(with_traceback(error, &traceback))),
            _ => return Err(fail(format!("the worker said `{}`", quote(&line)))),
        };
        Ok(Self {
            spec,
            process,
            mode,
            loggers: opened,
            timeout,
            elapsed: Duration::ZERO,
        })
    }

    /// How the function is called (batch when there is none).
    pub fn mode(&self) -> CallMode {
        self.mode.unwrap_or(CallMode::Batch)
    }

    /// Whether the worker has a reward function.
    pub fn has_function(&self) -> bool {
        self.mode.is_some()
    }

    /// The loggers the worker opened.
    pub fn loggers(&self) -> &[String] {
        &self.loggers
    }

    /// Sends one line and reads the reply: the parsed reply, or the unparsed line.
    fn request(&mut self, line: &str) -> Result<std::result::Result<Reply, String>> {
        if let Some(why) = self.process.broken() {
            return Err(self.error(format!("unusable after an earlier failure: {why}")));
        }
        self.process.send(line).map_err(|e| self.error(e))?;
        let reply = self
            .process
            .next_line(Some(self.timeout))
            .map_err(|e| self.error(e))?;
        Ok(serde_json::from_str::<Reply>(&reply).map_err(|_| reply))
    }

    /// Sends `message` and waits for `{"logged": true}`.
    fn exchange_log(&mut self, message: &Value) -> Result<()> {
        match self.request(&message.to_string())? {
            Ok(Reply::Logged { .. }) => Ok(()),
            Ok(Reply::Error {
                error, traceback, ..
            }) => Err(self.error(with_traceback(error, &traceback))),
            Ok(_) => Err(self.error("the worker answered a log with something else".into())),
            Err(reply) => Err(self.error(format!("the worker said `{}`", quote(&reply)))),
        }
    }

    /// Logs one step's numeric metrics (`step` is left out; other values are skipped) to
    /// every logger.
    ///
    /// # Errors
    /// A logger raised (with the traceback), or the worker timed out or died.
    pub fn log(&mut self, step: u64, metrics: &Map<String, Value>) -> Result<()> {
        if self.loggers.is_empty() {
            return Ok(());
        }
        let data: Map<String, Value> = metrics
            .iter()
            .filter(|(k, v)| *k != "step" && v.is_number())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        self.exchange_log(&serde_json::json!({ "log": data, "step": step }))
    }

    /// Logs validation generations to every logger (a table in wandb, text elsewhere).
    ///
    /// # Errors
    /// As [`PythonWorker::log`].
    pub fn log_generations(&mut self, step: u64, rows: &[Generation]) -> Result<()> {
        if self.loggers.is_empty() || rows.is_empty() {
            return Ok(());
        }
        self.exchange_log(&serde_json::json!({ "generations": rows, "step": step }))
    }

    /// Closes the loggers (wandb syncs its run), waiting up to the call timeout.
    ///
    /// # Errors
    /// The worker timed out or died.
    pub fn finish(&mut self) -> Result<()> {
        if self.process.broken().is_some() || self.loggers.is_empty() {
            return Ok(());
        }
        match self.request(r#"{"finish": true}"#)? {
            Ok(Reply::Finished { .. }) => Ok(()),
            Ok(_) => Err(self.error("the worker answered `finish` with something else".into())),
            Err(reply) => Err(self.error(format!("the worker said `{}`", quote(&reply)))),
        }
    }

    /// `path.py:name` as configured.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    fn error(&self, message: String) -> RewardError {
        RewardError::Function {
            function: self.spec.clone(),
            message,
        }
    }

    /// Scores a batch with the reward function: one [`Score`] per input, each with a finite
    /// `overall`.
    ///
    /// Errors ([`RewardError::Function`]): the function raised (the traceback and, where
    /// the worker knows it, the sample), returned the wrong type or count, a dict without
    /// `overall` or with a non-numeric or non-finite value, or no reply came within the
    /// timeout (the worker is killed), or the worker died. After a timeout or a crash every
    /// later call fails too.
    pub fn score(&mut self, inputs: &[RewardInput<'_>]) -> Result<Vec<Score>> {
        let started = std::time::Instant::now();
        let scores = self.score_untimed(inputs);
        self.elapsed += started.elapsed();
        scores
    }

    /// The time spent scoring since the last call (the worker's share of a step).
    pub fn take_elapsed(&mut self) -> Duration {
        std::mem::take(&mut self.elapsed)
    }

    fn score_untimed(&mut self, inputs: &[RewardInput<'_>]) -> Result<Vec<Score>> {
        if self.mode.is_none() {
            return Err(self.error("the worker has no reward function".into()));
        }
        if let Some(why) = self.process.broken() {
            return Err(self.error(format!("unusable after an earlier failure: {why}")));
        }
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let line = serde_json::json!({ "inputs": inputs }).to_string();
        self.process.send(&line).map_err(|e| self.error(e))?;
        let reply = match self.process.next_line(Some(self.timeout)) {
            Ok(reply) => reply,
            Err(e) => {
                return Err(self.error(format!(
                    "{e}, on a batch of {} responses{}",
                    inputs.len(),
                    sample(inputs, 0)
                )));
            }
        };
        match serde_json::from_str::<Reply>(&reply) {
            Ok(Reply::Scores { scores }) if scores.len() == inputs.len() => {
                for (i, s) in scores.iter().enumerate() {
                    if !s.get("overall").is_some_and(|x| x.is_finite()) {
                        return Err(self.error(format!(
                            "score {i} has no finite `overall`{}",
                            sample(inputs, i)
                        )));
                    }
                }
                Ok(scores)
            }
            Ok(Reply::Scores { scores }) => Err(self.error(format!(
                "{} scores for {} responses",
                scores.len(),
                inputs.len()
            ))),
            Ok(Reply::Error {
                error,
                traceback,
                index,
            }) => {
                let at = match index {
                    Some(i) => sample(inputs, i),
                    None => format!(
                        " (a batch of {} responses{})",
                        inputs.len(),
                        sample(inputs, 0)
                    ),
                };
                Err(self.error(with_traceback(format!("{error}{at}"), &traceback)))
            }
            _ => Err(self.error(format!("the worker said `{}`", quote(&reply)))),
        }
    }
}

/// ` on sample i (response "…", ground truth "…")`.
fn sample(inputs: &[RewardInput<'_>], i: usize) -> String {
    inputs.get(i).map_or_else(String::new, |x| {
        format!(
            ", on sample {i}: response {:?}, ground truth {:?}",
            quote(x.response),
            quote(x.ground_truth)
        )
    })
}

fn with_traceback(message: String, traceback: &str) -> String {
    if traceback.trim().is_empty() {
        message
    } else {
        format!("{message}\nPython traceback:\n{}", traceback.trim_end())
    }
}

fn quote(s: &str) -> String {
    let s = s.trim_end();
    match s.char_indices().nth(QUOTE) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// The default interpreter: `python3`, which a user's virtual environment puts first on
/// `PATH` when it is active.
pub const DEFAULT_PYTHON: &str = "python3";
