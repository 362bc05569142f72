//! Small LaTeX scanning helpers shared by the answer extraction and normalisation.

/// Deepest nesting the recursive helpers follow; deeper input is treated as plain text, so
/// adversarial responses cannot exhaust the stack.
pub(crate) const MAX_DEPTH: usize = 32;

/// The byte index of the `}` closing the `{` at byte `open` of `s`, skipping escaped
/// characters (`\{`, `\}`, `\\`). `None` when it never closes (or `open` is not a `{`).
pub(crate) fn matching_brace(s: &str, open: usize) -> Option<usize> {
    let bytes = s.as_bytes();
    if bytes.get(open) != Some(&b'{') {
        return None;
    }
    let mut depth = 0usize;
    let mut i = open;
    while i < bytes.len() {
        match bytes[i] {
            // the next byte is escaped; if it starts a multi-byte char, its continuation
            // bytes are never braces, so skipping one byte is enough
            b'\\' => i += 1,
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The end (exclusive) of the ASCII-letter macro name starting at byte `start`.
pub(crate) fn name_end(s: &str, start: usize) -> usize {
    start
        + s.as_bytes()[start.min(s.len())..]
            .iter()
            .take_while(|b| b.is_ascii_alphabetic())
            .count()
}

/// Byte offsets of each `\name` command in `s` that is exactly `name` (not a prefix of a
/// longer command name such as `\boxedx`).
pub(crate) fn commands<'a>(s: &'a str, name: &'a str) -> impl Iterator<Item = usize> + 'a {
    s.match_indices(name).filter_map(move |(i, _)| {
        let after = i + name.len();
        let is_exact = !s
            .as_bytes()
            .get(after)
            .is_some_and(|b| b.is_ascii_alphabetic());
        // `\\boxed` is a line break then the text "boxed": not the command
        let escaped = s[..i].bytes().rev().take_while(|&b| b == b'\\').count() % 2 == 1;
        (is_exact && !escaped).then_some(i)
    })
}

/// Splits `s` at the commas outside any bracket (`(`, `[`, `{` against `)`, `]`, `}`, mixed
/// as intervals mix them). `None` if the brackets do not balance.
pub(crate) fn split_top_level(s: &str, sep: u8) -> Option<Vec<&str>> {
    let mut parts = Vec::new();
    let mut depth = 0i64;
    let mut start = 0;
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => {
                i += 1;
                // `\{` and `\}` are set braces: they nest like brackets
                match bytes.get(i) {
                    Some(b'{') => depth += 1,
                    Some(b'}') => depth -= 1,
                    _ => {}
                }
            }
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth -= 1,
            c if c == sep && depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if depth < 0 {
            return None;
        }
        i += 1;
    }
    if depth != 0 {
        return None;
    }
    parts.push(&s[start..]);
    Some(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn braces() {
        let s = r"a{b{c}\}d}e";
        assert_eq!(matching_brace(s, 1), Some(9));
        assert_eq!(matching_brace(s, 3), Some(5));
        assert_eq!(matching_brace("{ab", 0), None);
        assert_eq!(matching_brace("x}", 0), None);
        assert_eq!(matching_brace(r"{\\}", 0), Some(3));
        assert_eq!(matching_brace("{é}", 0), Some(3));
    }

    #[test]
    fn exact_commands() {
        let s = r"\boxed{1} \boxedx \\boxed{2} \boxed";
        assert_eq!(commands(s, r"\boxed").collect::<Vec<_>>(), vec![0, 29]);
        assert_eq!(name_end(r"\frac12", 1), 5);
    }

    #[test]
    fn top_level_split() {
        assert_eq!(
            split_top_level("(1,2),[3,4)", b','),
            Some(vec!["(1,2)", "[3,4)"])
        );
        assert_eq!(
            split_top_level(r"\{1,2\},3", b','),
            Some(vec![r"\{1,2\}", "3"])
        );
        assert_eq!(split_top_level("5", b','), Some(vec!["5"]));
        assert_eq!(split_top_level("(1,2", b','), None);
        assert_eq!(split_top_level("1),(2", b','), None);
    }
}
