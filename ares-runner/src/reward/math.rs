//! Math answer grading (docs/algorithms.md §10): the last `\boxed{…}` of the response against the
//! reference answer.
//!
//! Two answers match when, after [normalisation](#normalisation), they are
//!
//! 1. the same string; or
//! 2. both numbers, equal — exactly for two integers, else within 1e−6 relative
//!    (`|a − b| ≤ 1e−6 · max(|a|, |b|)`); or
//! 3. both tuples, intervals or sets with the same brackets (`(…)`, `[…]`, `(…]`, `\{…\}`,
//!    or none: `1,2`) and the same number of elements, matching element by element, in
//!    order; or
//! 4. an assignment `x = v` (a one-letter variable, optionally subscripted, or a Greek
//!    letter) against a bare `v` (or `x = w` against `x = w'`), comparing the values; or
//! 5. a number followed by a unit in `\text{…}` (`3\text{ hours}`) against a reference
//!    without one, comparing the numbers (when both sides carry units, the units must
//!    match as text: `5\text{ cm}` ≠ `5\text{ m}`).
//!
//! # Normalisation
//!
//! `\text{}` (and `\textbf`, `\mathrm`, `\mbox`, `\boxed`, …) unwrapped to its content; `$`, `\$`,
//! `%`, `\%`, spacing commands (`\,`, `\!`, `\;`, `\:`, `\ `, `~`, `\quad`),
//! `\displaystyle` and degree marks (`^\circ`) removed; `\left`/`\right` dropped;
//! `\dfrac`/`\tfrac` → `\frac`; `−` (U+2212) → `-`; all whitespace removed; trailing `.`
//! removed; single-token arguments braced (`\frac12` ≡ `\frac{1}{2}`, `\sqrt3` ≡
//! `\sqrt{3}`); braces around the whole answer removed.
//!
//! # Numbers
//!
//! Integers, decimals (`.5`, `2.`), thousands separators in groups of three (`1,234`; so
//! `1,2` is a two-element list), an optional sign, `a/b`, `\frac{a}{b}` (nested fractions
//! too), with braces around any of these. A zero denominator is not a number.
//!
//! # Not supported (no symbolic algebra is promised)
//!
//! Scientific notation (`1e5`, `10^{3}`), irrational constants evaluated numerically
//! (`\sqrt{2}` vs `1.41421356`, `\pi` vs `3.14159`), mixed numbers (`2\frac{1}{2}`),
//! algebraic equivalence (`2x+2` vs `2(x+1)`), unordered sets (`\{1,2\}` vs `\{2,1\}`),
//! units written without `\text` (`5 cm` is `5cm`, not `5`), case folding (`Yes` ≠ `yes`), and `\boxed 5`
//! without braces.

use super::boxed::extract_boxed;
use super::latex::{MAX_DEPTH, commands, matching_brace, name_end, split_top_level};
use super::normalize::normalize;
use super::number::parse_number;

/// The result of grading one response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MathGrade {
    /// The content of the response's last `\boxed{…}`, as written; `None` when there is no
    /// box or the last one is unbalanced.
    pub extracted: Option<String>,
    /// Whether the extracted answer matches the reference (false without an answer).
    pub correct: bool,
}

/// Grades a response against the reference answer: extracts the last `\boxed{…}` of the
/// response ([`extract_boxed`]) and compares it with [`answers_match`]. A reference that
/// itself contains a complete `\boxed{…}` is compared by that box's content.
pub fn grade_math(response: &str, ground_truth: &str) -> MathGrade {
    let extracted = extract_boxed(response);
    let reference = if commands(ground_truth, r"\boxed").next().is_some() {
        extract_boxed(ground_truth).unwrap_or(ground_truth)
    } else {
        ground_truth
    };
    MathGrade {
        correct: extracted.is_some_and(|a| answers_match(a, reference)),
        extracted: extracted.map(str::to_owned),
    }
}

/// Whether `answer` matches `reference` under the rules of the module docs. An empty
/// answer (after normalisation) matches nothing.
pub fn answers_match(answer: &str, reference: &str) -> bool {
    let (a, r) = (normalize(answer), normalize(reference));
    if equivalent(&a, &r, 0) {
        return true;
    }
    // a number with a unit against a bare reference (or the reverse)
    let number = |s: &str| Some(normalize(s)).filter(|n| parse_number(n).is_some());
    match (strip_unit(answer), strip_unit(reference)) {
        (Some(x), None) => number(x).is_some_and(|x| equivalent(&x, &r, 0)),
        (None, Some(y)) => number(y).is_some_and(|y| equivalent(&a, &y, 0)),
        _ => false,
    }
}

/// The answer before a trailing unit `\text{…}` (or `\mbox`, `\mathrm`, `\textrm`), if the
/// answer ends with one and something precedes it: `3\text{ hours}` → `3`.
fn strip_unit(raw: &str) -> Option<&str> {
    let t = raw.trim_end();
    let t = t.strip_suffix('.').unwrap_or(t).trim_end();
    UNIT_MACROS.iter().find_map(|name| {
        let start = commands(t, name).last()?;
        let rest = &t[start + name.len()..];
        let open = start + name.len() + (rest.len() - rest.trim_start().len());
        let whole = matching_brace(t, open)? == t.len() - 1;
        let before = t[..start].trim_end();
        (whole && !before.is_empty()).then_some(before)
    })
}

/// Macros that wrap a unit after a number.
const UNIT_MACROS: [&str; 4] = [r"\text", r"\mbox", r"\mathrm", r"\textrm"];

fn equivalent(a: &str, b: &str, depth: usize) -> bool {
    if a.is_empty() || b.is_empty() {
        return false;
    }
    if a == b {
        return true;
    }
    if depth > MAX_DEPTH {
        return false;
    }
    match (parse_number(a), parse_number(b)) {
        (Some(x), Some(y)) => return x.equals(y),
        // one side a number (e.g. `1,000`), the other not: no list reading of either
        (Some(_), None) | (None, Some(_)) => return assignment_match(a, b, depth),
        (None, None) => {}
    }
    if let (Some(x), Some(y)) = (sequence(a), sequence(b)) {
        return x.open == y.open
            && x.close == y.close
            && x.items.len() == y.items.len()
            && x.items
                .iter()
                .zip(&y.items)
                .all(|(p, q)| equivalent(p, q, depth + 1));
    }
    assignment_match(a, b, depth)
}

fn assignment_match(a: &str, b: &str, depth: usize) -> bool {
    match (assignment(a), assignment(b)) {
        (Some((va, ra)), Some((vb, rb))) => va == vb && equivalent(ra, rb, depth + 1),
        (Some((_, ra)), None) => equivalent(ra, b, depth + 1),
        (None, Some((_, rb))) => equivalent(a, rb, depth + 1),
        (None, None) => false,
    }
}

/// A tuple, interval, set or bare list of at least two elements.
struct Sequence<'a> {
    open: &'a str,
    close: &'a str,
    items: Vec<&'a str>,
}

fn sequence(s: &str) -> Option<Sequence<'_>> {
    let top = split_top_level(s, b',')?;
    if top.len() >= 2 {
        return Some(Sequence {
            open: "",
            close: "",
            items: top,
        });
    }
    let (open, rest) = [r"\{", "(", "["]
        .iter()
        .find_map(|o| s.strip_prefix(o).map(|r| (*o, r)))?;
    let (inner, close) = [r"\}", ")", "]"]
        .iter()
        .find_map(|c| rest.strip_suffix(c).map(|r| (r, *c)))?;
    if (open == r"\{") != (close == r"\}") {
        return None;
    }
    let items = split_top_level(inner, b',')?;
    (items.len() >= 2).then_some(Sequence { open, close, items })
}

/// `x=5` → (`x`, `5`) when the left side is a variable: one ASCII letter with an optional
/// subscript (`x_1`, `x_{12}`), or a Greek-letter command (`\theta`).
fn assignment(s: &str) -> Option<(&str, &str)> {
    let (var, value) = s.split_once('=')?;
    if value.contains('=') || value.is_empty() {
        return None;
    }
    let is_var = |v: &str| {
        let b = v.as_bytes();
        let letter = match b.first()? {
            b'\\' => name_end(v, 1),
            c if c.is_ascii_alphabetic() => 1,
            _ => return None,
        };
        if letter < 2 && b[0] == b'\\' {
            return None;
        }
        let sub = &v[letter..];
        let ok = sub.is_empty()
            || sub
                .strip_prefix('_')
                .map(|t| t.trim_start_matches('{').trim_end_matches('}'))
                .is_some_and(|t| !t.is_empty() && t.bytes().all(|c| c.is_ascii_alphanumeric()));
        Some(ok)
    };
    is_var(var)?.then_some((var, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches() {
        let yes = [
            ("5", "5"),
            (r"\frac{1}{2}", "0.5"),
            (r"\dfrac12", "1/2"),
            (r"\tfrac{1}{2}", r"\frac{1}{2}"),
            (r"-\frac{3}{4}", "-0.75"),
            (r"\frac{-3}{4}", "-0.75"),
            (r"\frac{6}{8}", r"\frac{3}{4}"),
            (r"50\%", "50"),
            (r"\$18.90", "18.9"),
            ("10.", "10"),
            (r"\text{(B)}", "(B)"),
            ("(1, 2)", "(1,2)"),
            (r"\left( 1, \frac{1}{2} \right)", "(1, 0.5)"),
            (r"[0, \infty)", r"[0,\infty)"),
            (r"(-\infty, 3]", r"\left(-\infty,3\right]"),
            ("x = 3", "3"),
            ("3", "y=3"),
            ("x_1 = 2", "2.0"),
            (r"\theta = \frac{\pi}{2}", r"\frac\pi2"),
            ("1,000", "1000"),
            (r"1{,}000", "1000"),
            (r"3\text{ hours}", "3"),
            (r"\frac{1}{2}\text{ cup}.", "0.5"),
            (r"\$1{,}000\mbox{ dollars}", "1000"),
            ("1,000,000.5", "1000000.5"),
            ("3.0000001", "3"),
            (r"90^\circ", "90"),
            (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}"),
            (".5", "1/2"),
            ("+5", "5"),
            ("{5}", "5"),
            ("0.333333333", r"\frac{1}{3}"),
            ("1, 2, 3", "1,2,3.0"),
            ("(1,2),(3,4)", "(1, 2), (3.0, 4)"),
            (r"\{1, 2\}", r"\{1,2.0\}"),
            (r"\text{yes}", "yes"),
            ("\u{2212}2", "-2"),
            (r"x^2+1", "x^2 + 1"),
        ];
        for (a, b) in yes {
            assert!(answers_match(a, b), "{a} should match {b}");
            assert!(answers_match(b, a), "{b} should match {a}");
        }
    }

    #[test]
    fn mismatches() {
        let no = [
            ("5", "-5"),
            (r"\frac{1}{2}", r"\frac{2}{1}"),
            ("(1,2)", "[1,2]"),
            ("(1,2)", "[1,2)"),
            ("(1,2)", "(2,1)"),
            ("(1,2)", "(1,2,3)"),
            (r"\{1,2\}", r"\{2,1\}"),
            (r"\{1,2\}", "(1,2)"),
            ("3.001", "3"),
            ("3.00001", "3"),
            ("123456789012", "123456789013"),
            ("1/0", "2/0"),
            ("x=5", "y=5"),
            ("x=5", "6"),
            ("x+y=5", "5"),
            ("2=5", "5"),
            ("5", "50%"),
            ("1,2", "12"),
            ("1,000", "1,0"),
            ("1,000", "1"),
            (r"2\pi", "2"),
            (r"\sqrt{2}", "1.41421356"),
            ("1e3", "1000"),
            ("Yes", "yes"),
            ("", ""),
            ("", "0"),
            (" ", "0"),
            (r"\rightarrow5", r"\right5"),
            ("(5)", "5"),
            (r"5\text{ cm}", r"5\text{ m}"),
            (r"5\text{ cm}", "5 m"),
            (r"x\text{ apples}", "x"),
            (r"\text{(B)}", "B"),
            (r"2\frac{1}{2}", "2.5"),
        ];
        for (a, b) in no {
            assert!(!answers_match(a, b), "{a} should not match {b}");
            assert!(!answers_match(b, a), "{b} should not match {a}");
        }
    }

    #[test]
    fn grading() {
        let g = grade_math(r"<think>2+3</think> The sum is \boxed{5}.", "5");
        assert_eq!(
            g,
            MathGrade {
                extracted: Some("5".into()),
                correct: true
            }
        );
        let g = grade_math(r"first \boxed{4}, finally \boxed{ 5 }", r"\boxed{5}");
        assert_eq!(g.extracted.as_deref(), Some(" 5 "));
        assert!(g.correct);
        assert_eq!(
            grade_math("The answer is 5", "5"),
            MathGrade {
                extracted: None,
                correct: false
            }
        );
        let g = grade_math(r"\boxed{5", "5");
        assert_eq!((g.extracted, g.correct), (None, false));
        let g = grade_math(r"\boxed{}", "5");
        assert_eq!((g.extracted.as_deref(), g.correct), (Some(""), false));
        // the reference's own box wins over the surrounding text
        assert!(grade_math(r"\boxed{\frac12}", r"so $\boxed{0.5}$").correct);
        // a reference with a broken box is compared whole
        assert!(!grade_math(r"\boxed{7}", r"\boxed{7").correct);
        assert!(grade_math(r"\boxed{\boxed{7}}", "7").correct);
    }

    #[test]
    fn deep_nesting_does_not_overflow() {
        let deep = format!("{}1{}", "(1,".repeat(5000), ")".repeat(5000));
        assert!(!answers_match(&deep, "1"));
        let fr = format!("{}1{}", r"\frac{".repeat(3000), "}{2}".repeat(3000));
        assert!(!answers_match(&fr, "0"));
        let boxed = format!(r"\boxed{{{}x{}}}", "{".repeat(10000), "}".repeat(10000));
        assert!(grade_math(&boxed, "x").correct);
    }
}
