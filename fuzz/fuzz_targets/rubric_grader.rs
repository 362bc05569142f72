#![no_main]
//! Fuzzes rubric criteria as a dataset gives them (JSON with points, keywords and a regex)
//! through the built-in keyword grader and the rubric score, on an arbitrary response:
//! verdicts or an error naming the criterion, never a panic (the regex crate bounds a
//! pattern's compiled size and matches in linear time).

use ares_runner::data::Criterion;
use ares_runner::reward::{KeywordGrader, RubricGrader, rubric_score};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (criteria, response) = text.split_once('\u{0}').unwrap_or((text, "the answer is 4"));
    let Ok(criteria) = serde_json::from_str::<Vec<Criterion>>(criteria) else {
        return;
    };
    let mut grader = KeywordGrader::new();
    if let Ok(met) = grader.grade("a prompt", response, &criteria) {
        assert_eq!(met.len(), criteria.len());
        let _ = rubric_score(&criteria, &met);
    }
});
