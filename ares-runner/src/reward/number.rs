//! Numbers in normalised answers: integers, decimals, thousands separators, fractions
//! `a/b` and `\frac{a}{b}`, signs, and braces around any of them.

use super::latex::{MAX_DEPTH, matching_brace};
use super::normalize::strip_outer_braces;

/// Relative tolerance of numeric equality (docs/algorithms.md §10).
pub(crate) const REL_TOL: f64 = 1e-6;

/// A parsed number: its value, and its exact value when it is an integer (so large integers
/// compare exactly, not within the tolerance).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Num {
    pub value: f64,
    pub int: Option<i128>,
}

impl Num {
    fn int(v: i128) -> Self {
        Num {
            value: v as f64,
            int: Some(v),
        }
    }

    fn neg(self) -> Self {
        Num {
            value: -self.value,
            int: self.int.and_then(i128::checked_neg),
        }
    }

    fn div(self, d: Num) -> Option<Num> {
        if d.value == 0.0 {
            return None;
        }
        let int = match (self.int, d.int) {
            (Some(a), Some(b)) if b != 0 && a.checked_rem(b) == Some(0) => a.checked_div(b),
            _ => None,
        };
        Some(Num {
            value: self.value / d.value,
            int,
        })
    }

    /// Equal: exactly when both are integers, else within [`REL_TOL`] relative.
    pub fn equals(self, other: Num) -> bool {
        if let (Some(a), Some(b)) = (self.int, other.int) {
            return a == b;
        }
        let (a, b) = (self.value, other.value);
        (a - b).abs() <= REL_TOL * a.abs().max(b.abs())
    }
}

/// Parses a normalised answer as a number; `None` if it is not one of the supported forms.
pub(crate) fn parse_number(s: &str) -> Option<Num> {
    parse(s, 0)
}

fn parse(s: &str, depth: usize) -> Option<Num> {
    if depth > MAX_DEPTH {
        return None;
    }
    let s = strip_outer_braces(s);
    if let Some(rest) = s.strip_prefix('-') {
        return unsigned(rest, depth).map(Num::neg);
    }
    unsigned(s.strip_prefix('+').unwrap_or(s), depth)
}

fn unsigned(s: &str, depth: usize) -> Option<Num> {
    let s = strip_outer_braces(s);
    if s.starts_with(['-', '+']) {
        return None;
    }
    if let Some(args) = s.strip_prefix(r"\frac") {
        let close = matching_brace(args, 0)?;
        let (num, den) = (&args[1..close], &args[close + 1..]);
        if matching_brace(den, 0)? != den.len() - 1 {
            return None;
        }
        return parse(num, depth + 1)?.div(parse(&den[1..den.len() - 1], depth + 1)?);
    }
    if let Some((num, den)) = s.split_once('/') {
        if den.contains('/') {
            return None;
        }
        return parse(num, depth + 1)?.div(parse(den, depth + 1)?);
    }
    decimal(s)
}

/// `123`, `1.5`, `.5`, `2.`, `1,234,567.89`.
fn decimal(s: &str) -> Option<Num> {
    let plain;
    let s = if s.contains(',') {
        plain = thousands(s)?;
        plain.as_str()
    } else {
        s
    };
    let (int_part, frac_part) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    let digits = |t: &str| t.bytes().all(|b| b.is_ascii_digit());
    if !digits(int_part) || !frac_part.is_none_or(digits) {
        return None;
    }
    match frac_part {
        None if int_part.is_empty() => None,
        None => Some(match int_part.parse::<i128>() {
            Ok(v) => Num::int(v),
            Err(_) => Num {
                value: int_part.parse().ok()?,
                int: None,
            },
        }),
        Some(f) if int_part.is_empty() && f.is_empty() => None,
        Some(_) => Some(Num {
            value: s.parse().ok()?,
            int: None,
        }),
    }
}

/// `1,234,567.5` → `1234567.5`; `None` unless the groups after the first have exactly three
/// digits (so `1,2` is a list, not a number).
fn thousands(s: &str) -> Option<String> {
    let (int_part, frac) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    let mut groups = int_part.split(',');
    let first = groups.next()?;
    if first.is_empty() || first.len() > 3 {
        return None;
    }
    let mut out = first.to_owned();
    for g in groups {
        if g.len() != 3 {
            return None;
        }
        out.push_str(g);
    }
    if let Some(f) = frac {
        out.push('.');
        out.push_str(f);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn val(s: &str) -> Option<f64> {
        parse_number(s).map(|n| n.value)
    }

    #[test]
    fn forms() {
        let cases: &[(&str, Option<f64>)] = &[
            ("42", Some(42.0)),
            ("-42", Some(-42.0)),
            ("+7", Some(7.0)),
            ("3.25", Some(3.25)),
            (".5", Some(0.5)),
            ("2.", Some(2.0)),
            ("1,234", Some(1234.0)),
            ("1,234,567.5", Some(1234567.5)),
            ("1/4", Some(0.25)),
            ("-3/4", Some(-0.75)),
            (r"\frac{3}{4}", Some(0.75)),
            (r"-\frac{3}{4}", Some(-0.75)),
            (r"\frac{-3}{4}", Some(-0.75)),
            (r"\frac{1.5}{3}", Some(0.5)),
            (r"\frac{\frac{1}{2}}{2}", Some(0.25)),
            ("{7}", Some(7.0)),
            ("-{7}", Some(-7.0)),
            ("1,2", None),
            ("12,34", None),
            (",123", None),
            ("1/0", None),
            ("1/2/3", None),
            (r"\frac{1}{0}", None),
            (r"\frac{1}{2}3", None),
            (r"\frac{x}{2}", None),
            ("--5", None),
            ("-", None),
            (".", None),
            ("", None),
            ("1e5", None),
            ("1.2.3", None),
            (r"\pi", None),
            ("x", None),
        ];
        for &(s, want) in cases {
            assert_eq!(val(s), want, "{s}");
        }
    }

    #[test]
    fn exact_integers() {
        assert_eq!(parse_number("-12").unwrap().int, Some(-12));
        assert_eq!(parse_number(r"\frac{8}{4}").unwrap().int, Some(2));
        assert_eq!(parse_number("7/2").unwrap().int, None);
        assert_eq!(parse_number("2.0").unwrap().int, None);
        let big = parse_number("123456789012345678").unwrap();
        let near = parse_number("123456789012345679").unwrap();
        assert!(!big.equals(near));
        assert!(big.equals(big));
        // beyond i128: float comparison
        let huge = "1".repeat(50);
        assert_eq!(parse_number(&huge).unwrap().int, None);
    }

    #[test]
    fn tolerance() {
        let n = |s| parse_number(s).unwrap();
        assert!(n("3").equals(n("3.000001")));
        assert!(!n("3").equals(n("3.00001")));
        assert!(n("0.333333333").equals(n("1/3")));
        assert!(!n("0.333").equals(n("1/3")));
        assert!(n("0").equals(n("0.0")));
        assert!(!n("0").equals(n("0.0000001")));
    }
}
