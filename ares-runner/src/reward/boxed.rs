//! The final answer of a response: the last `\boxed{…}`.

use super::latex::{commands, matching_brace};

/// The content of the last top-level `\boxed{…}` of `text`, with brace matching (escaped
/// `\{`/`\}` do not count).
///
/// - `\boxed {x}` (spaces before the brace) counts; `\boxed 5` without braces does not (an
///   ambiguous form that model answers rarely use and that would need a LaTeX tokenizer).
/// - A box inside a box belongs to the outer one: `\boxed{\boxed{1}+1}` gives `\boxed{1}+1`.
/// - If the last `\boxed{` never closes, the answer is unbalanced and the result is `None`,
///   even when an earlier box was complete (the model's final answer is broken).
/// - No `\boxed{` at all → `None`. The content is returned as written (not trimmed).
pub fn extract_boxed(text: &str) -> Option<&str> {
    let mut last = None;
    let mut from = 0;
    for start in commands(text, r"\boxed") {
        if start < from {
            continue; // inside the previous box
        }
        let after = start + r"\boxed".len();
        let rest = &text[after..];
        let open = after + (rest.len() - rest.trim_start().len());
        if text.as_bytes().get(open) != Some(&b'{') {
            continue;
        }
        let close = matching_brace(text, open)?;
        last = Some(&text[open + 1..close]);
        from = close + 1;
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let cases: &[(&str, Option<&str>)] = &[
            (r"so \boxed{5}.", Some("5")),
            (r"\boxed{1} then \boxed{2}", Some("2")),
            (r"\boxed{\frac{1}{2}}", Some(r"\frac{1}{2}")),
            (r"\boxed {x + 1}", Some("x + 1")),
            (r"\boxed{\boxed{1}+1}", Some(r"\boxed{1}+1")),
            (r"\boxed{\{1, 2\}}", Some(r"\{1, 2\}")),
            (r"\boxed{}", Some("")),
            (r"\boxed{1} and \boxed{2", None),
            (r"\boxed{2", None),
            (r"\boxed 5", None),
            (r"\boxed{3} \boxed 5", Some("3")),
            (r"\boxedx{5}", None),
            (r"\\boxed{5}", None),
            ("the answer is 5", None),
            ("", None),
            (r"\boxed{é}", Some("é")),
            (r"\boxed{a}}}", Some("a")),
        ];
        for &(text, want) in cases {
            assert_eq!(extract_boxed(text), want, "{text}");
        }
    }
}
