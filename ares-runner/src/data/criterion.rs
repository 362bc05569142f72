//! Rubric criteria (`reward_model.rubrics`, docs/algorithms.md §9): what a good answer includes or
//! avoids, with its points, and optional matchers for the built-in keyword grader.

use regex::{Regex, RegexBuilder};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Upper bound on the compiled size of a criterion's regex: user patterns like `a{1000}{1000}`
/// fail to compile instead of eating memory.
const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// One rubric criterion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Criterion {
    /// What the answer should include (positive points) or avoid (negative points).
    pub criterion: String,
    /// Points earned when the criterion is met; negative points are a penalty. Finite.
    pub points: f64,
    /// Keywords for the built-in grader: met if any occurs in the response
    /// (case-insensitively). Never empty strings.
    pub keywords: Vec<String>,
    /// A regular expression (Rust `regex` syntax) for the built-in grader: met if it matches
    /// the response. Validated when the dataset is loaded.
    pub regex: Option<String>,
}

impl Criterion {
    /// Compiles [`regex`](Self::regex), if any, with a size limit.
    pub fn compile_regex(&self) -> Option<Result<Regex, regex::Error>> {
        self.regex.as_deref().map(|pattern| {
            RegexBuilder::new(pattern)
                .size_limit(REGEX_SIZE_LIMIT)
                .build()
        })
    }
}

/// Parses a rubrics column: a list of objects with `criterion` (or `description`),
/// `points`, and optional `keywords` (a list of strings, or one string) and `regex`; other
/// fields (e.g. `tags`) are ignored. A string holding that list as JSON is accepted too
/// (datasets that store the rubric as a JSON string column); an empty string means none.
/// Errors are a reason in words, naming the criterion by 0-based index.
pub(crate) fn parse_criteria(value: &Value) -> Result<Vec<Criterion>, String> {
    let parsed;
    let list = match value {
        Value::Array(items) => items,
        Value::String(s) if s.trim().is_empty() => return Ok(Vec::new()),
        Value::String(s) => {
            parsed = serde_json::from_str::<Value>(s)
                .map_err(|e| format!("a string that is not valid JSON ({e})"))?;
            match &parsed {
                Value::Array(items) => items,
                other => {
                    return Err(format!(
                        "a JSON string holding {}, expected a list of criteria",
                        kind(other)
                    ));
                }
            }
        }
        other => {
            return Err(format!(
                "{}, expected a list of criteria (or a JSON string holding one)",
                kind(other)
            ));
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, item)| parse_one(item).map_err(|e| format!("criterion {i}: {e}")))
        .collect()
}

fn parse_one(item: &Value) -> Result<Criterion, String> {
    let Value::Object(obj) = item else {
        return Err(format!("{}, expected an object", kind(item)));
    };
    let text = ["criterion", "description"]
        .iter()
        .find_map(|k| obj.get(*k).filter(|v| !v.is_null()))
        .ok_or("no `criterion` (or `description`) text")?;
    let Value::String(text) = text else {
        return Err(format!("`criterion` is {}, expected a string", kind(text)));
    };
    if text.trim().is_empty() {
        return Err("`criterion` is empty".into());
    }
    let points = match obj.get("points") {
        None | Some(Value::Null) => return Err(format!("`{text}`: no `points`")),
        Some(Value::Number(n)) => n
            .as_f64()
            .filter(|p| p.is_finite())
            .ok_or_else(|| format!("`{text}`: `points` = {n} is not a finite number"))?,
        Some(other) => {
            return Err(format!(
                "`{text}`: `points` is {}, expected a number",
                kind(other)
            ));
        }
    };
    let keywords = match obj.get("keywords") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|k| match k {
                Value::String(s) => Ok(s.clone()),
                other => Err(format!(
                    "`{text}`: a keyword is {}, expected a string",
                    kind(other)
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(format!(
                "`{text}`: `keywords` is {}, expected a list of strings",
                kind(other)
            ));
        }
    };
    // An empty keyword occurs in every response: certainly a data mistake.
    if keywords.iter().any(|k| k.trim().is_empty()) {
        return Err(format!("`{text}`: empty keyword"));
    }
    let regex = match obj.get("regex") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            return Err(format!(
                "`{text}`: `regex` is {}, expected a string",
                kind(other)
            ));
        }
    };
    let c = Criterion {
        criterion: text.clone(),
        points,
        keywords,
        regex,
    };
    if let Some(Err(e)) = c.compile_regex() {
        return Err(format!("`{text}`: invalid regex: {e}"));
    }
    Ok(c)
}

/// A JSON value's kind in words, for messages.
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn seed_format_with_tags() {
        let v = json!([
            {"criterion": "Identifies the symptoms", "points": 8, "tags": ["clinical"]},
            {"description": "Suggests self care", "points": 6.5, "keywords": ["rest", "fluids"]},
            {"criterion": "Prescribes drugs", "points": -2, "regex": "(?i)antibiotic"},
            {"criterion": "one keyword", "points": 1, "keywords": "exactly", "regex": null}
        ]);
        let c = parse_criteria(&v).unwrap();
        assert_eq!(c.len(), 4);
        assert_eq!(c[0].criterion, "Identifies the symptoms");
        assert_eq!(c[0].points, 8.0);
        assert!(c[0].keywords.is_empty() && c[0].regex.is_none());
        assert_eq!(c[1].criterion, "Suggests self care");
        assert_eq!(c[1].points, 6.5);
        assert_eq!(c[1].keywords, vec!["rest", "fluids"]);
        assert_eq!(c[2].points, -2.0);
        assert_eq!(c[2].regex.as_deref(), Some("(?i)antibiotic"));
        assert_eq!(c[3].keywords, vec!["exactly"]);
    }

    #[test]
    fn json_string_column() {
        let v = json!(r#"[{"criterion": "a", "points": 1}]"#);
        let c = parse_criteria(&v).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].criterion, "a");
        assert!(parse_criteria(&json!("  ")).unwrap().is_empty());
        assert!(parse_criteria(&json!([])).unwrap().is_empty());
    }

    #[test]
    fn bad_criteria_are_named() {
        let cases = [
            (json!(3), "a number, expected a list"),
            (json!("not json"), "not valid JSON"),
            (json!("{\"a\": 1}"), "a JSON string holding an object"),
            (json!([1]), "criterion 0: a number, expected an object"),
            (json!([{"points": 1}]), "criterion 0: no `criterion`"),
            (
                json!([{"criterion": " ", "points": 1}]),
                "`criterion` is empty",
            ),
            (
                json!([{"criterion": "ok", "points": 1}, {"criterion": "x"}]),
                "criterion 1: `x`: no `points`",
            ),
            (
                json!([{"criterion": "x", "points": "3"}]),
                "`points` is a string",
            ),
            (
                json!([{"criterion": "x", "points": 1, "keywords": [""]}]),
                "empty keyword",
            ),
            (
                json!([{"criterion": "x", "points": 1, "keywords": [1]}]),
                "a keyword is a number",
            ),
            (
                json!([{"criterion": "x", "points": 1, "regex": "(unclosed"}]),
                "`x`: invalid regex",
            ),
            (
                json!([{"criterion": "x", "points": 1, "regex": 5}]),
                "`regex` is a number",
            ),
        ];
        for (v, want) in cases {
            let err = parse_criteria(&v).unwrap_err();
            assert!(err.contains(want), "{v}: {err}");
        }
    }

    #[test]
    fn huge_regex_is_refused() {
        let c = Criterion {
            criterion: "x".into(),
            points: 1.0,
            keywords: vec![],
            regex: Some("a{1000}{1000}".into()),
        };
        assert!(matches!(c.compile_regex(), Some(Err(_))));
    }
}
