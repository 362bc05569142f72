//! Grading a response (docs/algorithms.md §9, §10): the math answer against the reference, the format
//! reward, and the rubric score from a pluggable grader.

use crate::config::{Config, RewardGrader, RubricGrader as GraderKind};
use crate::data::Example;
use crate::reward::{
    CommandGrader, KeywordGrader, RubricGrader, format_reward, grade_math, rubric_score,
};
use crate::trainer::TrainError;
use crate::trainer::prepare::rewards::Grade;

/// Grades responses for one run.
pub struct Grader {
    grader: RewardGrader,
    rubric: Option<Box<dyn RubricGrader>>,
}

impl std::fmt::Debug for Grader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grader")
            .field("grader", &self.grader)
            .field("rubric", &self.rubric.is_some())
            .finish()
    }
}

impl Grader {
    /// The grader of `cfg` (starts the external rubric grader when configured).
    ///
    /// # Errors
    /// The grader command cannot be started.
    pub fn new(cfg: &Config) -> Result<Self, TrainError> {
        let r = &cfg.worker.reward;
        let rubric: Option<Box<dyn RubricGrader>> = match r.grader {
            RewardGrader::Rubric => Some(match r.rubric_grader {
                GraderKind::Builtin => Box::new(KeywordGrader::new()),
                GraderKind::Command => {
                    let command = r.rubric_command.as_deref().ok_or_else(|| {
                        TrainError::Invalid(
                            "worker.reward.rubric_command is required with rubric_grader: command"
                                .into(),
                        )
                    })?;
                    Box::new(
                        CommandGrader::spawn(command)
                            .map_err(|e| TrainError::Invalid(e.to_string()))?
                            // a hung judge stops the run instead of stalling it
                            .with_timeout(std::time::Duration::from_secs_f64(r.timeout_s)),
                    )
                }
            }),
            _ => None,
        };
        Ok(Self {
            grader: r.grader,
            rubric,
        })
    }

    /// Checks before any work starts that every example can be graded: an answer for math
    /// rows, criteria the built-in grader can match for rubric rows.
    ///
    /// # Errors
    /// The first example that cannot be graded, named.
    pub fn check(&self, examples: &[Example], what: &str) -> Result<(), TrainError> {
        for e in examples {
            match self.grader {
                RewardGrader::Rubric => {
                    if e.rubrics.is_empty() && e.answer.is_empty() {
                        return Err(TrainError::Invalid(format!(
                            "{what}: row {} ({}) has neither rubric criteria nor an answer",
                            e.row, e.global_id
                        )));
                    }
                }
                _ => {
                    if e.answer.trim().is_empty() {
                        return Err(TrainError::Invalid(format!(
                            "{what}: row {} ({}) has no answer; math grading needs one",
                            e.row, e.global_id
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Grades one response to `example`.
    ///
    /// # Errors
    /// Rubric grader failures.
    pub fn grade(&mut self, example: &Example, response: &str) -> Result<Grade, TrainError> {
        let format = format_reward(response);
        let math =
            (!example.answer.is_empty()).then(|| grade_math(response, &example.answer).correct);
        let rubric = match (&mut self.rubric, example.rubrics.is_empty()) {
            (Some(g), false) => {
                let met = g
                    .grade(example.prompt.question(), response, &example.rubrics)
                    .map_err(|e| {
                        TrainError::Invalid(format!("rubric grader on {}: {e}", example.global_id))
                    })?;
                Some(rubric_score(&example.rubrics, &met).map_err(|e| {
                    TrainError::Invalid(format!("rubric score of {}: {e}", example.global_id))
                })?)
            }
            _ => None,
        };
        let correct = match (math, rubric) {
            (Some(c), _) => c,
            (None, Some(s)) => s >= 0.5,
            (None, None) => false,
        };
        Ok(Grade {
            correct,
            format,
            rubric,
            interaction: 0.0,
            tool_cost: 0.0,
        })
    }
}
