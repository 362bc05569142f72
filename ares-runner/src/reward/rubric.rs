//! Rubric rewards (docs/algorithms.md §9): which criteria a response meets, decided by a
//! pluggable [`RubricGrader`], and the score `Σ points of met criteria / Σ positive points`.

use std::collections::HashMap;

use regex::Regex;

use super::error::{Result, RewardError};
use crate::data::Criterion;

/// Decides which rubric criteria a response meets.
pub trait RubricGrader {
    /// One verdict per criterion, in order (`result.len() == criteria.len()`). `prompt` is
    /// the question (without any rubric system message).
    fn grade(&mut self, prompt: &str, response: &str, criteria: &[Criterion]) -> Result<Vec<bool>>;
}

/// The rubric score of docs/algorithms.md §9: `Σ_{met} points / Σ_{points > 0} points`. Met criteria with
/// negative points subtract, so the score lies in `[Σ negative / Σ positive, 1]`; it is not
/// clipped.
///
/// Errors ([`RewardError::Score`]): `met.len() ≠ criteria.len()`, or no criterion with
/// positive points (the score is undefined).
pub fn rubric_score(criteria: &[Criterion], met: &[bool]) -> Result<f64> {
    let points: Vec<f64> = criteria.iter().map(|c| c.points).collect();
    Ok(ares_core::rubric::rubric_score(&points, met)?)
}

/// Grades a response with `grader` and scores it with [`rubric_score`].
///
/// Errors: the grader's, a verdict list of the wrong length, or an undefined score.
pub fn rubric_reward(
    grader: &mut dyn RubricGrader,
    prompt: &str,
    response: &str,
    criteria: &[Criterion],
) -> Result<f64> {
    let met = grader.grade(prompt, response, criteria)?;
    rubric_score(criteria, &met)
}

/// The built-in grader: a criterion is met iff one of its `keywords` occurs in the response
/// (as a substring, case-insensitively: `rest` also matches "interest"; use a regex with
/// `\b` for whole words), or its `regex` matches the response (case-sensitive unless the
/// pattern says `(?i)`). A criterion with neither is an error
/// ([`RewardError::NoMatcher`]) rather than a guess from its wording: a wrong verdict would
/// silently train toward it. Check a whole dataset up front with
/// [`KeywordGrader::check`].
#[derive(Debug, Default, Clone)]
pub struct KeywordGrader {
    /// Compiled regexes by pattern (datasets repeat criteria across rows).
    cache: HashMap<String, Regex>,
}

impl KeywordGrader {
    /// A grader with an empty regex cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Errors on the first criterion this grader cannot judge (no keywords and no regex)
    /// or whose regex does not compile.
    pub fn check(criteria: &[Criterion]) -> Result<()> {
        for c in criteria {
            if c.keywords.is_empty() && c.regex.is_none() {
                return Err(RewardError::NoMatcher {
                    criterion: c.criterion.clone(),
                });
            }
            if let Some(Err(e)) = c.compile_regex() {
                return Err(regex_error(c, &e));
            }
        }
        Ok(())
    }

    fn regex(&mut self, c: &Criterion, pattern: &str) -> Result<&Regex> {
        if !self.cache.contains_key(pattern) {
            let re = match c.compile_regex() {
                Some(Ok(re)) => re,
                Some(Err(e)) => return Err(regex_error(c, &e)),
                None => {
                    return Err(RewardError::NoMatcher {
                        criterion: c.criterion.clone(),
                    });
                }
            };
            self.cache.insert(pattern.to_owned(), re);
        }
        self.cache
            .get(pattern)
            .ok_or_else(|| RewardError::NoMatcher {
                criterion: c.criterion.clone(),
            })
    }
}

fn regex_error(c: &Criterion, e: &regex::Error) -> RewardError {
    RewardError::Regex {
        criterion: c.criterion.clone(),
        regex: c.regex.clone().unwrap_or_default(),
        message: e.to_string(),
    }
}

impl RubricGrader for KeywordGrader {
    fn grade(
        &mut self,
        _prompt: &str,
        response: &str,
        criteria: &[Criterion],
    ) -> Result<Vec<bool>> {
        // every criterion must be judgeable before any verdict is given (regexes compile
        // once, through the cache, below)
        if let Some(c) = criteria
            .iter()
            .find(|c| c.keywords.is_empty() && c.regex.is_none())
        {
            return Err(RewardError::NoMatcher {
                criterion: c.criterion.clone(),
            });
        }
        let lower = response.to_lowercase();
        criteria
            .iter()
            .map(|c| {
                if c.keywords.iter().any(|k| lower.contains(&k.to_lowercase())) {
                    return Ok(true);
                }
                match &c.regex {
                    Some(pattern) => Ok(self.regex(c, pattern)?.is_match(response)),
                    None => Ok(false),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crit(text: &str, points: f64, keywords: &[&str], regex: Option<&str>) -> Criterion {
        Criterion {
            criterion: text.into(),
            points,
            keywords: keywords.iter().map(|k| (*k).to_owned()).collect(),
            regex: regex.map(str::to_owned),
        }
    }

    #[test]
    fn score_by_hand() {
        let c = [
            crit("a", 8.0, &["x"], None),
            crit("b", 6.0, &["x"], None),
            crit("c", -2.0, &["x"], None),
        ];
        // (8 + 6) / 14
        assert_eq!(rubric_score(&c, &[true, true, false]).unwrap(), 1.0);
        // (8 − 2) / 14
        assert!((rubric_score(&c, &[true, false, true]).unwrap() - 6.0 / 14.0).abs() < 1e-15);
        // −2 / 14
        assert!((rubric_score(&c, &[false, false, true]).unwrap() + 1.0 / 7.0).abs() < 1e-15);
        assert_eq!(rubric_score(&c, &[false, false, false]).unwrap(), 0.0);
        let e = rubric_score(&c, &[true]).unwrap_err().to_string();
        assert!(e.starts_with("rubric score:") && e.contains("`met`"), "{e}");
        let e = rubric_score(&c[2..], &[true]).unwrap_err().to_string();
        assert!(e.contains("total positive points"), "{e}");
        assert!(rubric_score(&[], &[]).is_err());
    }

    #[test]
    fn keywords_and_regex() {
        let c = [
            crit("symptoms", 8.0, &["Fever", "cough"], None),
            crit("rest", 6.0, &["REST"], None),
            crit("drugs", -2.0, &[], Some(r"\bantibiotics?\b")),
            crit("dose", 3.0, &["mg"], Some(r"(?i)\d+\s*ml")),
        ];
        let mut g = KeywordGrader::new();
        let met = g
            .grade("q", "You have a FEVER; get some rest. 10 ML twice.", &c)
            .unwrap();
        assert_eq!(met, vec![true, true, false, true]);
        let met = g.grade("q", "Take Antibiotics. antibiotic", &c).unwrap();
        assert_eq!(met, vec![false, false, true, false]);
        // the regex is case-sensitive unless it says otherwise
        let met = g.grade("q", "ANTIBIOTIC", &c).unwrap();
        assert_eq!(met, vec![false, false, false, false]);
        // substring semantics
        assert_eq!(g.grade("q", "interest", &c[1..2]).unwrap(), vec![true]);
        let mut g2 = KeywordGrader::new();
        let r = rubric_reward(&mut g2, "q", "fever, rest, antibiotics", &c).unwrap();
        // (8 + 6 − 2) / 17
        assert!((r - 12.0 / 17.0).abs() < 1e-15);
        assert_eq!(g.grade("q", "x", &[]).unwrap(), Vec::<bool>::new());
    }

    #[test]
    fn criterion_without_matchers_is_an_error() {
        let c = [
            crit("has one", 1.0, &["a"], None),
            crit("has none", 2.0, &[], None),
        ];
        let e = KeywordGrader::new().grade("q", "a", &c).unwrap_err();
        assert!(matches!(&e, RewardError::NoMatcher { criterion } if criterion == "has none"));
        assert!(e.to_string().contains("`has none` has neither"));
        assert!(KeywordGrader::check(&c[..1]).is_ok());
        let bad = [crit("bad", 1.0, &[], Some("(x"))];
        let e = KeywordGrader::check(&bad).unwrap_err().to_string();
        assert!(e.contains("`bad`: invalid regex `(x`"), "{e}");
        let e = KeywordGrader::new().grade("q", "x", &bad).unwrap_err();
        assert!(matches!(e, RewardError::Regex { .. }), "{e:?}");
    }
}
