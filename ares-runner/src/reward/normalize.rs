//! Answer normalisation for string comparison (docs/algorithms.md §10).

use super::latex::{MAX_DEPTH, matching_brace, name_end};

/// Text-style macros (and boxes: a box inside the final box is still the answer) whose
/// argument is kept and whose name and braces are dropped.
const UNWRAP: [&str; 10] = [
    "text",
    "textbf",
    "textit",
    "textrm",
    "textnormal",
    "mathrm",
    "mathbf",
    "mbox",
    "boxed",
    "fbox",
];

/// Pieces removed outright (after `\text{}` is unwrapped and before spaces are removed):
/// dollar signs, percent signs, spacing commands, `\displaystyle`, degree marks.
const REMOVE: [&str; 15] = [
    r"\displaystyle",
    r"^{\circ}",
    r"^\circ",
    r"\%",
    "%",
    r"\$",
    "$",
    r"\!",
    r"\,",
    r"\;",
    r"\:",
    r"\ ",
    "~",
    r"\qquad",
    r"\quad",
];

/// The canonical form of an answer: `\text{…}`-like wrappers and boxes unwrapped, `$`, `%`, spacing
/// commands and degree marks removed, `{,}` → `,`, `\left`/`\right` dropped (with
/// `\left.`/`\right.`),
/// `\dfrac`/`\tfrac` → `\frac`, U+2212 → `-`, all whitespace removed, trailing `.` removed,
/// single-token arguments braced (`\frac12` → `\frac{1}{2}`, `\sqrt3` → `\sqrt{3}`), and
/// braces around the whole answer removed. Case is kept.
pub(crate) fn normalize(answer: &str) -> String {
    // `{,}` is LaTeX's thousands separator (`1{,}000`)
    let mut s = unwrap_text(answer)
        .replace('\u{2212}', "-")
        .replace("{,}", ",");
    s = drop_left_right(&s)
        .replace(r"\dfrac", r"\frac")
        .replace(r"\tfrac", r"\frac");
    for piece in REMOVE {
        s = s.replace(piece, "");
    }
    s.retain(|c| !c.is_whitespace());
    while s.ends_with('.') {
        s.pop();
    }
    let s = brace_arguments(&s, 0);
    strip_outer_braces(&s).to_owned()
}

/// `\text{abc}` → `abc` (and the other [`UNWRAP`] macros), nested or not, without
/// recursion: the closing braces still to drop are kept on a stack.
fn unwrap_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut pending: Vec<usize> = Vec::new(); // closing braces to drop, innermost last
    let mut i = 0;
    while i < s.len() {
        if pending.last() == Some(&i) {
            pending.pop();
            i += 1;
            continue;
        }
        if s.as_bytes()[i] == b'\\' {
            let end = name_end(s, i + 1);
            if UNWRAP.contains(&&s[i + 1..end]) {
                let rest = &s[end..];
                let open = end + (rest.len() - rest.trim_start().len());
                if let Some(close) = matching_brace(s, open) {
                    pending.push(close);
                    i = open + 1;
                    continue;
                }
            }
            // copy the command (or the escaped character) whole
            let end = if end > i + 1 {
                end
            } else {
                i + 1 + s[i + 1..].chars().next().map_or(0, char::len_utf8)
            };
            out.push_str(&s[i..end]);
            i = end;
            continue;
        }
        let c = s[i..].chars().next().unwrap_or_default();
        out.push(c);
        i += c.len_utf8().max(1);
    }
    out
}

/// Removes `\left` and `\right` (not `\leftarrow`, `\rightarrow`, …), with the invisible
/// delimiter `.` of `\left.` / `\right.`.
fn drop_left_right(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s.as_bytes()[i] == b'\\' {
            let end = name_end(s, i + 1);
            let name = &s[i + 1..end];
            if name == "left" || name == "right" {
                i = if s.as_bytes().get(end) == Some(&b'.') {
                    end + 1
                } else {
                    end
                };
                continue;
            }
            if end > i + 1 {
                out.push_str(&s[i..end]);
                i = end;
                continue;
            }
            // escaped character: copy the backslash and the character
            let len = 1 + s[i + 1..].chars().next().map_or(0, char::len_utf8);
            out.push_str(&s[i..i + len]);
            i += len;
            continue;
        }
        let c = s[i..].chars().next().unwrap_or_default();
        out.push(c);
        i += c.len_utf8().max(1);
    }
    out
}

/// Braces the single-token arguments of `\frac` (two) and `\sqrt` (one): `\frac12` →
/// `\frac{1}{2}`, `\frac\pi2` → `\frac{\pi}{2}`. Works on whitespace-free text; braced
/// arguments are processed recursively (down to [`MAX_DEPTH`]).
fn brace_arguments(s: &str, depth: usize) -> String {
    if depth > MAX_DEPTH || !(s.contains(r"\frac") || s.contains(r"\sqrt")) {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len() + 8);
    let mut i = 0;
    while i < s.len() {
        if s.as_bytes()[i] != b'\\' {
            let c = s[i..].chars().next().unwrap_or_default();
            out.push(c);
            i += c.len_utf8().max(1);
            continue;
        }
        let end = name_end(s, i + 1);
        let args = match &s[i + 1..end] {
            "frac" => 2,
            "sqrt" => 1,
            "" => {
                let len = 1 + s[i + 1..].chars().next().map_or(0, char::len_utf8);
                out.push_str(&s[i..i + len]);
                i += len;
                continue;
            }
            _ => 0,
        };
        out.push_str(&s[i..end]);
        i = end;
        for _ in 0..args {
            let Some((arg, next)) = argument(s, i) else {
                break;
            };
            out.push('{');
            out.push_str(&brace_arguments(arg, depth + 1));
            out.push('}');
            i = next;
        }
    }
    out
}

/// The argument at byte `i`: a brace group's content, a `\command`, or one character;
/// with the index after it.
fn argument(s: &str, i: usize) -> Option<(&str, usize)> {
    match *s.as_bytes().get(i)? {
        b'{' => {
            let close = matching_brace(s, i)?;
            Some((&s[i + 1..close], close + 1))
        }
        b'\\' => {
            let end = name_end(s, i + 1);
            (end > i + 1).then(|| (&s[i..end], end))
        }
        b'}' => None,
        _ => {
            let len = s[i..].chars().next()?.len_utf8();
            Some((&s[i..i + len], i + len))
        }
    }
}

/// `s` without braces that enclose all of it (`{{5}}` → `5`, `{1}{2}` unchanged). One pass:
/// the leading `{`s are matched against their closing braces.
pub(crate) fn strip_outer_braces(s: &str) -> &str {
    let bytes = s.as_bytes();
    let leading = bytes.iter().take_while(|&&b| b == b'{').count();
    if leading == 0 {
        return s;
    }
    let mut close_of = vec![usize::MAX; leading];
    let mut stack: Vec<usize> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 1,
            b'{' => stack.push(i),
            b'}' => match stack.pop() {
                Some(open) if open < leading => close_of[open] = i,
                Some(_) => {}
                None => return s,
            },
            _ => {}
        }
        i += 1;
    }
    let layers = close_of
        .iter()
        .enumerate()
        .take_while(|&(j, &c)| c == bytes.len() - 1 - j)
        .count();
    &s[layers..s.len() - layers]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let cases = [
            (r"\text{(B)}", "(B)"),
            (r"\textbf{\text{yes}}", "yes"),
            (r"5\text{ cm}", "5cm"),
            (r"\boxed{\fbox{7}}", "7"),
            (r"$18.90$", "18.90"),
            (r"\$18.90", "18.90"),
            (r"50\%", "50"),
            ("50 %", "50"),
            (r"\left( 1, 2 \right)", "(1,2)"),
            (r"\left.\frac{x}{2}\right|", r"\frac{x}{2}|"),
            (r"x \rightarrow 3", r"x\rightarrow3"),
            (r"\dfrac{1}{2}", r"\frac{1}{2}"),
            (r"\tfrac12", r"\frac{1}{2}"),
            (r"\frac\pi2", r"\frac{\pi}{2}"),
            (r"\frac{\sqrt3}{2}", r"\frac{\sqrt{3}}{2}"),
            (r"\sqrt{2}", r"\sqrt{2}"),
            ("10.", "10"),
            ("  7 . ", "7"),
            (r"90^\circ", "90"),
            (r"90^{\circ}", "90"),
            ("{{5}}", "5"),
            ("{1}{2}", "{1}{2}"),
            ("{{1}{2}}", "{1}{2}"),
            ("{{5}", "{{5}"),
            (r"{1\}", r"{1\}"),
            ("{}", ""),
            ("\u{2212}3", "-3"),
            (r"1\,000", "1000"),
            (r"1{,}000", "1,000"),
            (r"\displaystyle \frac{1}{2}", r"\frac{1}{2}"),
            (r"\text{unclosed", r"\text{unclosed"),
            (r"\frac", r"\frac"),
            ("é \\é", "é\\é"),
        ];
        for (input, want) in cases {
            assert_eq!(normalize(input), want, "{input}");
        }
    }
}
