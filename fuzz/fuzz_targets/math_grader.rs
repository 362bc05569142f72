#![no_main]
//! Fuzzes the answer graders on arbitrary responses and references: the last `\boxed{}`,
//! the math comparison (numbers, fractions, LaTeX, tuples, intervals) and the format reward.

use ares_runner::reward::{extract_boxed, format_reward, grade_math};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (response, answer) = text.split_once('\u{0}').unwrap_or((text, "42"));
    let _ = extract_boxed(response);
    let _ = grade_math(response, answer);
    let _ = grade_math(answer, response);
    let f = format_reward(response);
    assert!((0.0..=1.0).contains(&f));
});
