//! Which curves go in which panel, and their points read from the metrics records.

use std::path::Path;

use serde_json::Value;

use super::PlotError;
use crate::metrics::NumberedRecord;

/// The panels drawn when no keys are given, in this order; those absent from the file are
/// left out. Per-bucket keys share a panel; so do all `eval/accuracy/*` keys.
const DEFAULT_SINGLE: [&str; 10] = [
    "reward/mean",
    "accuracy/mean",
    "response_length/mean",
    "entropy/mean",
    "hwe/count_mean",
    "tau",
    "kl/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/clipfrac",
];
/// Difficulty buckets of the per-bucket state (target length T, α, λ).
const BUCKETS: [&str; 3] = ["easy", "medium", "hard"];
/// Per-bucket quantities drawn one panel each, one curve per bucket.
const DEFAULT_GROUPS: [&str; 3] = ["alpha", "target", "lambda"];
/// Prefix of the evaluation accuracies, all in one panel.
const EVAL_PREFIX: &str = "eval/accuracy/";

/// What one panel asks for.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Spec {
    /// One key, its own panel.
    Key(String),
    /// Listed keys `<title>/<label>` in one panel.
    Group { title: String, labels: Vec<String> },
    /// Every key starting with the prefix, in first-seen order, in one panel.
    Prefix(String),
}

impl Spec {
    /// How the spec is written in messages (`reward/mean`, `alpha/{easy,medium,hard}`,
    /// `eval/accuracy/*`).
    pub(super) fn describe(&self) -> String {
        match self {
            Spec::Key(key) => key.clone(),
            Spec::Group { title, labels } => format!("{title}/{{{}}}", labels.join(",")),
            Spec::Prefix(prefix) => format!("{prefix}*"),
        }
    }
}

/// The default panels (see [`DEFAULT_SINGLE`], [`DEFAULT_GROUPS`], [`EVAL_PREFIX`]).
pub(super) fn default_specs() -> Vec<Spec> {
    let mut specs: Vec<Spec> = DEFAULT_SINGLE
        .iter()
        .map(|k| Spec::Key((*k).to_string()))
        .collect();
    specs.extend(DEFAULT_GROUPS.iter().map(|g| Spec::Group {
        title: (*g).to_string(),
        labels: BUCKETS.iter().map(|b| (*b).to_string()).collect(),
    }));
    specs.push(Spec::Prefix(EVAL_PREFIX.to_string()));
    specs
}

/// Panels for keys given by the user: one per key; a key ending in `*` is a prefix whose
/// matching keys share a panel (`alpha/*`). An empty key is an error.
pub(super) fn user_specs(keys: &[String]) -> Result<Vec<Spec>, PlotError> {
    keys.iter()
        .map(|key| {
            let key = key.trim();
            match key.strip_suffix('*') {
                _ if key.is_empty() || key == "*" => Err(PlotError::EmptyKey),
                Some(prefix) => Ok(Spec::Prefix(prefix.to_string())),
                None => Ok(Spec::Key(key.to_string())),
            }
        })
        .collect()
}

/// One curve: `(step, value)` sorted by step; `None` is a `null` (a gap in the line).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Series {
    /// The metrics key.
    pub key: String,
    /// Legend text (the key, or its part after the panel's title).
    pub label: String,
    /// Points in step order (stable: equal steps keep file order).
    pub points: Vec<(f64, Option<f64>)>,
}

impl Series {
    /// The runs of consecutive non-null points; each is drawn as one line (a single point
    /// as a dot).
    pub(super) fn segments(&self) -> Vec<Vec<(f64, f64)>> {
        let mut out = Vec::new();
        let mut current = Vec::new();
        for &(x, y) in &self.points {
            match y {
                Some(y) => current.push((x, y)),
                None if !current.is_empty() => out.push(std::mem::take(&mut current)),
                None => {}
            }
        }
        if !current.is_empty() {
            out.push(current);
        }
        out
    }

    /// Smallest and largest non-null value; `None` when all are null.
    fn value_bounds(&self) -> Option<(f64, f64)> {
        bounds(self.points.iter().filter_map(|&(_, y)| y))
    }
}

/// One small chart.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Panel {
    /// Caption.
    pub title: String,
    /// Curves; each has at least one non-null value.
    pub series: Vec<Series>,
}

impl Panel {
    /// Smallest and largest value over the curves.
    pub(super) fn value_bounds(&self) -> Option<(f64, f64)> {
        let mut all = self.series.iter().filter_map(Series::value_bounds);
        let first = all.next()?;
        Some(all.fold(first, |(lo, hi), (l, h)| (lo.min(l), hi.max(h))))
    }

    /// Smallest and largest step over the curves' points.
    pub(super) fn step_bounds(&self) -> Option<(f64, f64)> {
        bounds(
            self.series
                .iter()
                .flat_map(|s| s.points.iter().map(|&(x, _)| x)),
        )
    }
}

/// Min and max of finite values (all values here are finite: JSON numbers).
fn bounds(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// Builds the panels of `specs` from the records `(line, object)` of the file at `path`.
///
/// Returns the panels that have data and the specs that had none (absent keys, or only
/// nulls), described as in [`Spec::describe`]. A plotted key with a value other than a
/// number or null, or a record with such a key but no numeric `step`, is an error naming the
/// line.
pub(super) fn build(
    specs: &[Spec],
    records: &[NumberedRecord],
    path: &Path,
) -> Result<(Vec<Panel>, Vec<String>), PlotError> {
    let present = present_keys(records);
    let mut panels = Vec::new();
    let mut skipped = Vec::new();
    for spec in specs {
        let (title, members): (String, Vec<(String, String)>) = match spec {
            Spec::Key(key) => (key.clone(), vec![(key.clone(), key.clone())]),
            Spec::Group { title, labels } => (
                title.clone(),
                labels
                    .iter()
                    .map(|l| (format!("{title}/{l}"), l.clone()))
                    .collect(),
            ),
            Spec::Prefix(prefix) => (
                prefix.trim_end_matches('/').to_string(),
                present
                    .iter()
                    .filter_map(|key| {
                        let rest = key.strip_prefix(prefix.as_str())?.trim_start_matches('/');
                        let label = if rest.is_empty() { key } else { rest };
                        Some((key.clone(), label.to_string()))
                    })
                    .collect(),
            ),
        };
        let mut series = Vec::new();
        for (key, label) in members {
            let points = extract(&key, records, path)?;
            if points.iter().any(|(_, y)| y.is_some()) {
                series.push(Series { key, label, points });
            }
        }
        if series.is_empty() {
            skipped.push(spec.describe());
            continue;
        }
        // A lone curve has no legend, so its caption must carry the whole key.
        let title = match (spec, series.as_slice()) {
            (Spec::Group { .. } | Spec::Prefix(_), [only]) => only.key.clone(),
            _ => title,
        };
        panels.push(Panel { title, series });
    }
    Ok((panels, skipped))
}

/// Every key of the records, in first-seen order.
pub(super) fn present_keys(records: &[NumberedRecord]) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    for (_, record) in records {
        for key in record.keys() {
            if !keys.contains(key) {
                keys.push(key.clone());
            }
        }
    }
    keys
}

/// The `(step, value)` points of `key`, sorted by step; records without the key add none.
fn extract(
    key: &str,
    records: &[NumberedRecord],
    path: &Path,
) -> Result<Vec<(f64, Option<f64>)>, PlotError> {
    let mut points = Vec::new();
    for (line, record) in records {
        let Some(value) = record.get(key) else {
            continue;
        };
        let y = match value {
            Value::Null => None,
            Value::Number(n) => n.as_f64(),
            other => {
                return Err(PlotError::NotANumber {
                    path: path.to_path_buf(),
                    line: *line,
                    key: key.to_string(),
                    found: other.to_string(),
                });
            }
        };
        let step = match record.get("step") {
            Some(Value::Number(n)) => n.as_f64(),
            _ => None,
        };
        let Some(step) = step else {
            return Err(PlotError::BadStep {
                path: path.to_path_buf(),
                line: *line,
                found: record
                    .get("step")
                    .map_or_else(|| "missing".to_string(), Value::to_string),
            });
        };
        points.push((step, y));
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(points)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn records(lines: &[Value]) -> Vec<NumberedRecord> {
        lines
            .iter()
            .enumerate()
            .map(|(i, v)| (i + 1, v.as_object().cloned().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn user_keys_and_prefixes() {
        let specs = user_specs(&["tau".into(), " alpha/* ".into()]).unwrap();
        assert_eq!(
            specs,
            [Spec::Key("tau".into()), Spec::Prefix("alpha/".into())]
        );
        assert!(matches!(user_specs(&["".into()]), Err(PlotError::EmptyKey)));
        assert!(matches!(
            user_specs(&["*".into()]),
            Err(PlotError::EmptyKey)
        ));
    }

    #[test]
    fn defaults_group_buckets_and_eval() {
        let recs = records(&[
            json!({"step": 2, "tau": 0.5, "alpha/easy": 1.0, "alpha/hard": 2.0,
                   "eval/accuracy/easy": 0.9, "eval/accuracy/hard": 0.1}),
            json!({"step": 1, "tau": 0.4, "alpha/easy": 1.5}),
        ]);
        let (panels, skipped) = build(&default_specs(), &recs, Path::new("m")).unwrap();
        let titles: Vec<&str> = panels.iter().map(|p| p.title.as_str()).collect();
        assert_eq!(titles, ["tau", "alpha", "eval/accuracy"]);
        // Sorted by step, though the file has step 2 first.
        assert_eq!(
            panels[0].series[0].points,
            [(1.0, Some(0.4)), (2.0, Some(0.5))]
        );
        let alpha: Vec<&str> = panels[1].series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(alpha, ["easy", "hard"]);
        let eval: Vec<&str> = panels[2].series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(eval, ["easy", "hard"]);
        assert!(skipped.contains(&"reward/mean".to_string()));
        assert!(skipped.contains(&"target/{easy,medium,hard}".to_string()));
        assert_eq!(panels[1].value_bounds(), Some((1.0, 2.0)));
        assert_eq!(panels[1].step_bounds(), Some((1.0, 2.0)));
    }

    #[test]
    fn a_lone_curve_of_a_shared_panel_is_captioned_with_its_key() {
        let recs = records(&[json!({"step": 1, "alphabet": 1.0, "eval/accuracy/easy": 0.5})]);
        let specs = user_specs(&["alpha*".into(), "eval/accuracy/*".into()]).unwrap();
        let (panels, _) = build(&specs, &recs, Path::new("m")).unwrap();
        let titles: Vec<&str> = panels.iter().map(|p| p.title.as_str()).collect();
        assert_eq!(titles, ["alphabet", "eval/accuracy/easy"]);
    }

    #[test]
    fn nulls_split_lines_and_all_null_is_skipped() {
        let recs = records(&[
            json!({"step": 1, "a": 1.0, "b": null}),
            json!({"step": 2, "a": 2.0}),
            json!({"step": 3, "a": null}),
            json!({"step": 4, "a": 4.0, "b": null}),
            json!({"step": 5, "a": null}),
            json!({"step": 6, "a": 6.0}),
            json!({"step": 7, "a": 7.0}),
        ]);
        let specs = user_specs(&["a".into(), "b".into()]).unwrap();
        let (panels, skipped) = build(&specs, &recs, Path::new("m")).unwrap();
        assert_eq!(skipped, ["b"]);
        assert_eq!(
            panels[0].series[0].segments(),
            vec![
                vec![(1.0, 1.0), (2.0, 2.0)],
                vec![(4.0, 4.0)],
                vec![(6.0, 6.0), (7.0, 7.0)]
            ]
        );
    }

    #[test]
    fn text_value_and_missing_step_name_the_line() {
        let recs = records(&[
            json!({"step": 1, "a": 1.0}),
            json!({"step": 2, "a": "high"}),
        ]);
        let err = build(&[Spec::Key("a".into())], &recs, Path::new("m.jsonl")).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("line 2") && text.contains("\"high\""),
            "{text}"
        );

        let recs = records(&[json!({"a": 1.0})]);
        let err = build(&[Spec::Key("a".into())], &recs, Path::new("m.jsonl")).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
        // A record without the plotted key needs no step.
        let recs = records(&[json!({"note": "x"}), json!({"step": 1, "a": 1.0})]);
        assert!(build(&[Spec::Key("a".into())], &recs, Path::new("m")).is_ok());
    }
}
