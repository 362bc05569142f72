//! The format reward: does the response end its reasoning and state one boxed answer?

use super::boxed::extract_boxed;
use super::latex::commands;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// 1.0 when the response is well formed, else 0.0. Well formed means:
///
/// - exactly one `\boxed` in the whole response, written `\boxed{…}` with balanced braces
///   and a non-blank content (text after it, such as a closing sentence, is allowed);
/// - if the response contains `<think>` or `</think>`: exactly one `</think>`, at most one
///   `<think>` and it comes before `</think>`, and the box comes after `</think>`. A lone
///   `</think>` is accepted because some chat templates open the thinking block in the
///   prompt (the response starts inside it).
pub fn format_reward(response: &str) -> f64 {
    if well_formed(response) { 1.0 } else { 0.0 }
}

fn well_formed(response: &str) -> bool {
    let boxes: Vec<usize> = commands(response, r"\boxed").collect();
    let [box_at] = boxes[..] else {
        return false;
    };
    if extract_boxed(response).is_none_or(|a| a.trim().is_empty()) {
        return false;
    }
    let opens: Vec<usize> = response.match_indices(OPEN).map(|(i, _)| i).collect();
    let closes: Vec<usize> = response.match_indices(CLOSE).map(|(i, _)| i).collect();
    if opens.is_empty() && closes.is_empty() {
        return true;
    }
    let [close_at] = closes[..] else {
        return false;
    };
    match opens[..] {
        [] => {}
        [open_at] if open_at < close_at => {}
        _ => return false,
    }
    box_at > close_at
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let cases = [
            (r"The answer is \boxed{5}.", 1.0),
            (r"<think>2+3=5</think> \boxed{5}", 1.0),
            (r"2+3=5</think>The answer: \boxed{5}", 1.0),
            (r"\boxed{\frac{1}{2}}", 1.0),
            ("no box", 0.0),
            (r"\boxed{}", 0.0),
            (r"\boxed{  }", 0.0),
            (r"\boxed{5", 0.0),
            (r"\boxed 5", 0.0),
            (r"\boxed{4} or \boxed{5}", 0.0),
            (r"\boxed{\boxed{5}}", 0.0),
            (r"<think>\boxed{5}</think>", 0.0),
            (r"<think>\boxed{4}</think> \boxed{5}", 0.0),
            (r"<think>no close \boxed{5}", 0.0),
            (r"</think><think> \boxed{5}", 0.0),
            (r"<think></think><think></think> \boxed{5}", 0.0),
            (r"<think>a</think></think> \boxed{5}", 0.0),
            (r"<think><think>a</think> \boxed{5}", 0.0),
        ];
        for (text, want) in cases {
            assert_eq!(format_reward(text), want, "{text}");
        }
    }
}
