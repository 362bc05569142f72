//! The untyped stage of loading: YAML text → a JSON tree, merged key by key onto the tree of
//! the defaults, then dotted `key=value` overrides applied to it.
//!
//! Working on a tree before any typing is what lets a file and an override be checked the
//! same way: an unknown key is caught while merging (with the valid keys of its section at
//! hand), and types are checked once, by serde, on the fully resolved tree. Merging onto the
//! defaults also means a partial section (`budget: {easy: 0.1}`) keeps the spec default of
//! every key it leaves out.

use serde_json::{Map, Value};

use super::error::ConfigError;

/// Settings that are mappings of the user's own keys (keyword arguments passed on): a
/// dotted override may name a key inside them that is not there yet
/// (`data.apply_chat_template_kwargs.enable_thinking=false`), and one of the whole mapping
/// replaces it.
pub(crate) const FREE_MAPPINGS: [&str; 2] = [
    "data.apply_chat_template_kwargs",
    "worker.reward.reward_function_kwargs",
];

/// How the top-level section is named in messages.
pub(crate) const TOP_LEVEL: &str = "the top level";

/// Parses YAML text into a tree. An empty document is an empty mapping.
///
/// Errors: [`ConfigError::Yaml`] with the line and column of a syntax error, a duplicate
/// key or a non-finite number (`.nan`, `.inf` are refused: no knob accepts them).
pub(crate) fn parse_yaml(text: &str, source_name: &str) -> Result<Value, ConfigError> {
    match serde_saphyr::from_str::<Value>(text) {
        Ok(Value::Null) => Ok(Value::Object(Map::new())),
        Ok(value) => Ok(value),
        Err(e) => Err(yaml_error(&e, source_name)),
    }
}

/// A [`ConfigError::Yaml`] from the parser's error: position, bare message and the snippet
/// (with `source_name` in its header instead of the parser's `<input>`).
fn yaml_error(e: &serde_saphyr::Error, source_name: &str) -> ConfigError {
    let (line, column) = e.location().map_or((0, 0), |l| {
        (
            usize::try_from(l.line()).unwrap_or(usize::MAX),
            usize::try_from(l.column()).unwrap_or(usize::MAX),
        )
    });
    let bare = e.without_snippet().to_string();
    // The bare message ends with its own position, which the error already names.
    let message = bare
        .strip_suffix(&format!(" at line {line}, column {column}"))
        .unwrap_or(&bare)
        .to_string();
    let rendered = e.render_with_options(serde_saphyr::render_options! {
        source_name: Some(source_name),
    });
    // The first rendered line repeats the message; the rest is the snippet.
    let snippet = rendered.lines().skip(1).collect::<Vec<_>>().join("\n");
    ConfigError::Yaml {
        source_name: source_name.to_string(),
        line,
        column,
        message,
        snippet,
    }
}

/// `parent.key`, or `key` at the top level.
pub(crate) fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_string()
    } else {
        format!("{parent}.{key}")
    }
}

/// A short description of a value for messages: `a list`, `the number 3`, ...
pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "a mapping".into(),
    }
}

/// Merges `patch` into `base`, which holds the value at dotted key `path`.
///
/// - Where `base` is a section (a mapping in the defaults), `patch` must be a mapping whose
///   keys all exist in `base`; they are merged one by one. `null` leaves the section as it
///   is (an empty `ref:` in a file is an empty section).
/// - Anywhere else `patch` replaces `base` (scalars and lists are values; their types are
///   checked later, by serde).
///
/// Errors: [`ConfigError::UnknownKey`] naming the full key and the valid keys of its
/// section; [`ConfigError::NotAMapping`] when a section is given a scalar or a list.
pub(crate) fn merge(
    base: &mut Value,
    patch: Value,
    path: &str,
    origin: &str,
) -> Result<(), ConfigError> {
    let Value::Object(section) = base else {
        *base = patch;
        return Ok(());
    };
    match patch {
        Value::Null => Ok(()),
        Value::Object(entries) => {
            for (key, value) in entries {
                let Some(slot) = section.get_mut(&key) else {
                    return Err(unknown_key(section, path, &key, origin));
                };
                merge(slot, value, &join(path, &key), origin)?;
            }
            Ok(())
        }
        other => Err(ConfigError::NotAMapping {
            key: if path.is_empty() {
                "<top level>".into()
            } else {
                path.to_string()
            },
            origin: origin.to_string(),
            found: describe(&other),
        }),
    }
}

/// The error for `key`, absent from `section` (at dotted `path`).
fn unknown_key(section: &Map<String, Value>, path: &str, key: &str, origin: &str) -> ConfigError {
    let valid: Vec<String> = section.keys().cloned().collect();
    ConfigError::UnknownKey {
        key: join(path, key),
        origin: origin.to_string(),
        section: if path.is_empty() {
            TOP_LEVEL.to_string()
        } else {
            format!("`{path}`")
        },
        suggestion: closest(key, &valid),
        valid,
    }
}

/// The valid key nearest to `key` by edit distance, when it is close enough to be a typo
/// (at most a third of the key's length, and at most 3 edits).
fn closest(key: &str, valid: &[String]) -> Option<String> {
    let limit = (key.chars().count() / 3).clamp(1, 3);
    valid
        .iter()
        .map(|v| (edit_distance(key, v), v))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, v)| v.clone())
}

/// Levenshtein distance over chars (insertions, deletions, substitutions cost 1).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// One parsed command-line override `dotted.key=value`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Override {
    /// The key's segments (`["worker", "rollout", "n"]`).
    pub(crate) segments: Vec<String>,
    /// The value text after the first `=`, trimmed.
    pub(crate) raw: String,
    /// The override as given, for messages.
    pub(crate) text: String,
}

impl Override {
    /// Splits `text` at its first `=`. The key is dotted segments, none empty; the value is
    /// required (write `null` for none and `''` for an empty string).
    pub(crate) fn parse(text: &str) -> Result<Self, ConfigError> {
        let bad = |reason: &str| ConfigError::BadOverride {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let Some((key, raw)) = text.split_once('=') else {
            return Err(bad(
                "expected dotted.key=value, e.g. worker.rollout.n=8 or algorithm.adv_estimator=grpo",
            ));
        };
        let key = key.trim();
        if key.is_empty() {
            return Err(bad("the key before `=` is empty"));
        }
        let segments: Vec<String> = key.split('.').map(str::to_string).collect();
        if segments.iter().any(|s| s.is_empty() || s.trim() != s) {
            return Err(bad(
                "the key has an empty or space-padded segment (write dotted.key=value)",
            ));
        }
        let raw = raw.trim();
        if raw.is_empty() {
            return Err(bad(
                "no value after `=` (write null for no value, '' for an empty string)",
            ));
        }
        Ok(Override {
            segments,
            raw: raw.to_string(),
            text: text.to_string(),
        })
    }

    /// The dotted key.
    #[cfg(test)]
    pub(crate) fn key(&self) -> String {
        self.segments.join(".")
    }

    /// The value read as YAML, whatever the key holds (for translating EasyR1 keys, which
    /// are not in the resolved tree).
    pub(crate) fn value(&self) -> Result<Value, ConfigError> {
        parse_yaml_value(&self.raw, &self.text)
    }

    /// Where a value came from, for messages.
    pub(crate) fn origin(&self) -> String {
        format!("from override `{}`", self.text)
    }

    /// Applies the override to `tree` (a resolved tree: every valid key present).
    ///
    /// The value is read as a YAML scalar or flow value (`8`, `0.5`, `grpo`, `null`,
    /// `[0.9, 0.99]`, `{easy: 0.1}`), with one exception: where the key currently holds a
    /// string (names, paths, enum spellings), an unquoted value other than `null`/`~` is taken
    /// verbatim, so `trainer.experiment_name=2024` is the name `"2024"` and not a number, and
    /// nothing after a ` #` is dropped as a YAML comment. A quoted value is always read as
    /// YAML (`'null'` is the string).
    ///
    /// Errors: unknown key (naming the valid keys of its section), a value key used as a
    /// section, malformed YAML in the value, a scalar for a section.
    pub(crate) fn apply(&self, tree: &mut Value) -> Result<(), ConfigError> {
        let origin = self.origin();
        let mut node: &mut Value = tree;
        let mut path = String::new();
        // inside a free-form mapping, keys are the user's: missing ones are made
        let mut free = false;
        for segment in &self.segments {
            free = free || FREE_MAPPINGS.contains(&path.as_str());
            if free && node.is_null() {
                *node = Value::Object(Map::new());
            }
            let Value::Object(section) = node else {
                return Err(ConfigError::NotASection {
                    key: path,
                    child: segment.clone(),
                    origin,
                });
            };
            if free && !section.contains_key(segment) {
                section.insert(segment.clone(), Value::Null);
            }
            if !section.contains_key(segment) {
                return Err(unknown_key(section, &path, segment, &origin));
            }
            path = join(&path, segment);
            let Some(child) = section.get_mut(segment) else {
                return Err(ConfigError::Internal(format!("key `{path}` vanished")));
            };
            node = child;
        }
        let quoted = self.raw.starts_with(['"', '\'']);
        let null = matches!(self.raw.as_str(), "null" | "Null" | "NULL" | "~");
        let value = if node.is_string() && !quoted && !null {
            Value::String(self.raw.clone())
        } else {
            parse_yaml_value(&self.raw, &self.text)?
        };
        if free || FREE_MAPPINGS.contains(&path.as_str()) {
            *node = value;
            return Ok(());
        }
        merge(node, value, &path, &origin)
    }
}

/// The value of an override as YAML (an empty document would be null, but empty values are
/// refused earlier).
fn parse_yaml_value(raw: &str, text: &str) -> Result<Value, ConfigError> {
    serde_saphyr::from_str::<Value>(raw).map_err(|e| yaml_error(&e, &format!("override `{text}`")))
}

/// Whether `tree` has a value at the dotted `segments` (used to tell which source set a key).
pub(crate) fn contains(tree: &Value, segments: &[String]) -> bool {
    let mut node = tree;
    for segment in segments {
        match node.get(segment) {
            Some(child) => node = child,
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn edit_distance_counts_single_edits() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("n", "n"), 0);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("temprature", "temperature"), 1);
    }

    #[test]
    fn closest_only_suggests_near_keys() {
        let valid = vec![
            "n".to_string(),
            "temperature".to_string(),
            "top_p".to_string(),
        ];
        assert_eq!(
            closest("temprature", &valid).as_deref(),
            Some("temperature")
        );
        assert_eq!(closest("top-p", &valid).as_deref(), Some("top_p"));
        assert_eq!(closest("batch_size", &valid), None);
    }

    #[test]
    fn merge_keeps_defaults_of_missing_keys_and_replaces_lists() {
        let mut base = json!({"a": {"x": 1, "y": 2}, "l": [1, 2], "s": null});
        let patch = json!({"a": {"y": 5}, "l": [3], "s": {"free": "form"}});
        merge(&mut base, patch, "", "test").expect("valid patch");
        assert_eq!(
            base,
            json!({"a": {"x": 1, "y": 5}, "l": [3], "s": {"free": "form"}})
        );
    }

    #[test]
    fn merge_null_section_is_no_change_and_scalar_section_is_an_error() {
        let mut base = json!({"a": {"x": 1}});
        merge(&mut base, json!({"a": null}), "", "f.yaml").expect("null section");
        assert_eq!(base, json!({"a": {"x": 1}}));
        let err = merge(&mut base, json!({"a": 3}), "", "f.yaml").expect_err("scalar section");
        assert!(matches!(err, ConfigError::NotAMapping { ref key, .. } if key == "a"));
    }

    #[test]
    fn merge_names_the_full_unknown_key_and_its_section() {
        let mut base = json!({"w": {"r": {"n": 8, "top_p": 1.0}}});
        let err =
            merge(&mut base, json!({"w": {"r": {"m": 1}}}), "", "f.yaml").expect_err("unknown key");
        match err {
            ConfigError::UnknownKey {
                key,
                section,
                valid,
                ..
            } => {
                assert_eq!(key, "w.r.m");
                assert_eq!(section, "`w.r`");
                assert_eq!(valid, vec!["n", "top_p"]);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn override_parse_rejects_malformed_text() {
        for text in [
            "worker.rollout.n",
            "=3",
            "worker..n=3",
            "worker.rollout.n=",
            "a. b=1",
        ] {
            assert!(
                matches!(Override::parse(text), Err(ConfigError::BadOverride { .. })),
                "{text}"
            );
        }
        let o = Override::parse("data.format_prompt = a=b.jinja").expect("valid");
        assert_eq!(o.key(), "data.format_prompt");
        assert_eq!(o.raw, "a=b.jinja");
    }

    #[test]
    fn override_values_are_yaml_except_unquoted_strings_over_strings() {
        let mut tree = json!({"t": {"name": "demo", "n": 1, "p": null, "b": [0.0, 0.0]}});
        for text in [
            "t.name=2024",
            "t.n=8",
            "t.p=~/data/x.jsonl",
            "t.b=[0.9, 0.99]",
        ] {
            Override::parse(text)
                .and_then(|o| o.apply(&mut tree))
                .expect(text);
        }
        assert_eq!(
            tree,
            json!({"t": {"name": "2024", "n": 8, "p": "~/data/x.jsonl", "b": [0.9, 0.99]}})
        );
        Override::parse("t.name='a #b'")
            .and_then(|o| o.apply(&mut tree))
            .expect("quoted");
        assert_eq!(tree["t"]["name"], json!("a #b"));
        for text in ["t.p=null", "t.name=~"] {
            Override::parse(text)
                .and_then(|o| o.apply(&mut tree))
                .expect(text);
        }
        assert_eq!(tree["t"]["p"], Value::Null);
        assert_eq!(tree["t"]["name"], Value::Null);
        Override::parse("t.n='null'")
            .and_then(|o| o.apply(&mut tree))
            .expect("quoted null");
        assert_eq!(tree["t"]["n"], json!("null"));
    }

    #[test]
    fn overrides_make_keys_inside_free_mappings() {
        let mut tree = json!({"data": {"apply_chat_template_kwargs": null, "n": 1}});
        for text in [
            "data.apply_chat_template_kwargs.enable_thinking=false",
            "data.apply_chat_template_kwargs.style.name=terse",
        ] {
            Override::parse(text)
                .and_then(|o| o.apply(&mut tree))
                .expect(text);
        }
        assert_eq!(
            tree["data"]["apply_chat_template_kwargs"],
            json!({"enable_thinking": false, "style": {"name": "terse"}})
        );
        // the whole mapping is replaced, not merged key by key
        Override::parse("data.apply_chat_template_kwargs={a: 1}")
            .and_then(|o| o.apply(&mut tree))
            .expect("whole");
        assert_eq!(tree["data"]["apply_chat_template_kwargs"], json!({"a": 1}));
        // a section's own keys stay checked
        assert!(matches!(
            Override::parse("data.m=1").and_then(|o| o.apply(&mut tree)),
            Err(ConfigError::UnknownKey { .. })
        ));
    }

    #[test]
    fn override_into_a_value_is_not_a_section() {
        let mut tree = json!({"t": {"n": 1}});
        let err = Override::parse("t.n.x=1")
            .and_then(|o| o.apply(&mut tree))
            .expect_err("n is a value");
        assert!(
            matches!(err, ConfigError::NotASection { ref key, ref child, .. } if key == "t.n" && child == "x")
        );
    }

    #[test]
    fn yaml_errors_carry_line_and_column() {
        let err = parse_yaml("a: 1\n  b: 2\n", "cfg.yaml").expect_err("bad indentation");
        match err {
            ConfigError::Yaml {
                source_name,
                line,
                column,
                message,
                snippet,
            } => {
                assert_eq!(source_name, "cfg.yaml");
                assert_eq!((line, column), (2, 4));
                assert!(!message.contains("at line"), "{message}");
                assert!(snippet.contains("cfg.yaml:2:4"), "{snippet}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn empty_yaml_is_an_empty_mapping() {
        assert_eq!(parse_yaml("", "x").expect("empty"), json!({}));
        assert_eq!(
            parse_yaml("# only a comment\n", "x").expect("comment"),
            json!({})
        );
    }
}
