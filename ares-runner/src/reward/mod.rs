//! Rewards: math answer grading (docs/algorithms.md §10), the format reward, and rubric rewards with a
//! built-in keyword/regex grader or an external grader command (docs/algorithms.md §9).
//!
//! - [`grade_math`]: the last `\boxed{…}` of a response against the reference answer
//!   (normalised strings, numbers within 1e−6 relative, tuples/intervals element-wise; the
//!   supported subset is listed in [`math`]).
//! - [`format_reward`]: 1 for exactly one well-formed final `\boxed{}` (after `</think>`
//!   when the response thinks), else 0.
//! - [`RubricGrader`] with [`KeywordGrader`] and [`CommandGrader`]; [`rubric_score`]
//!   `= Σ points met / Σ positive points`.
//! - [`PythonWorker`]: a Python reward function in EasyR1's interface, and EasyR1's
//!   experiment loggers, run in one worker process.

mod boxed;
mod command;
mod error;
mod format;
mod latex;
pub mod math;
mod normalize;
mod number;
pub(crate) mod process;
mod python;
mod rubric;

pub use boxed::extract_boxed;
pub use command::{CommandGrader, parse_reply as parse_grader_reply};
pub use error::{Result, RewardError};
pub use format::format_reward;
pub use math::{MathGrade, answers_match, grade_math};
pub use python::{
    CallMode, DEFAULT_PYTHON, FunctionSpec, Generation, LoggerSetup, PythonWorker, RewardInput,
    Score, parse_spec,
};
pub use rubric::{KeywordGrader, RubricGrader, rubric_reward, rubric_score};
