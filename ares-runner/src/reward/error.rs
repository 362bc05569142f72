//! Errors of the reward functions and graders.

/// Errors from rubric grading and scoring (math grading and the format reward cannot fail).
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// The built-in keyword grader got a criterion with neither keywords nor a regex.
    #[error(
        "rubric criterion `{criterion}` has neither `keywords` nor `regex`, so the built-in \
         keyword grader cannot judge it; add matchers or use an external grader command"
    )]
    NoMatcher {
        /// The criterion's text.
        criterion: String,
    },
    /// A criterion's regex does not compile.
    #[error("rubric criterion `{criterion}`: invalid regex `{regex}`: {message}")]
    Regex {
        /// The criterion's text.
        criterion: String,
        /// The pattern.
        regex: String,
        /// The regex crate's message.
        message: String,
    },
    /// The external grader command failed: cannot start, exited, timed out, or answered
    /// something other than one `{"met": [bool, …]}` line of the right length.
    #[error("grader command `{command}`: {message}")]
    Command {
        /// The command line as configured.
        command: String,
        /// What went wrong.
        message: String,
    },
    /// The Python reward function failed: the worker could not start or import it, the
    /// function raised, returned something other than EasyR1's dicts, hung or crashed.
    #[error("reward function {function}: {message}")]
    Function {
        /// `path.py:name` as configured.
        function: String,
        /// What went wrong (with the Python traceback and the sample, when there are).
        message: String,
    },
    /// The rubric score is undefined (no positive points, `met` of the wrong length).
    #[error("rubric score: {0}")]
    Score(#[from] ares_core::Error),
}

/// Result alias of the reward module.
pub type Result<T, E = RewardError> = std::result::Result<T, E>;
