//! One line of the metrics file.

use serde_json::{Map, Number, Value};

/// One step's metrics: key → JSON value, kept in insertion order (so `step` written first
/// stays first on the line).
///
/// Numbers go in through [`Record::insert`], which turns a non-finite `f64` into `null`:
/// JSON cannot spell NaN or ∞, and writing them as a string or a huge number would be read
/// back as data. Inserting a key again replaces its value (in its first position).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Record {
    map: Map<String, Value>,
}

impl Record {
    /// An empty record.
    pub fn new() -> Self {
        Self::default()
    }

    /// A record that starts with `"step": step`.
    pub fn with_step(step: u64) -> Self {
        let mut record = Self::new();
        record.insert_value("step", Value::from(step));
        record
    }

    /// Sets `key` to `value`, or to `null` when `value` is NaN or ±∞.
    pub fn insert(&mut self, key: impl Into<String>, value: f64) -> &mut Self {
        let value = Number::from_f64(value).map_or(Value::Null, Value::Number);
        self.map.insert(key.into(), value);
        self
    }

    /// Sets `key` to any JSON value (an integer count, a string tag, `null`).
    pub fn insert_value(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        self.map.insert(key.into(), value);
        self
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key)
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no key is set.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The keys and values in insertion order.
    pub fn as_map(&self) -> &Map<String, Value> {
        &self.map
    }

    /// The underlying JSON object.
    pub fn into_map(self) -> Map<String, Value> {
        self.map
    }
}

impl From<Map<String, Value>> for Record {
    /// Wraps an object as is (its numbers are finite already: `serde_json` cannot hold others).
    fn from(map: Map<String, Value>) -> Self {
        Self { map }
    }
}

impl<K: Into<String>> Extend<(K, f64)> for Record {
    /// Inserts each pair with [`Record::insert`] (non-finite → `null`).
    fn extend<I: IntoIterator<Item = (K, f64)>>(&mut self, iter: I) {
        for (key, value) in iter {
            self.insert(key, value);
        }
    }
}

impl<K: Into<String>> FromIterator<(K, f64)> for Record {
    /// Collects pairs with [`Record::insert`] (non-finite → `null`).
    fn from_iter<I: IntoIterator<Item = (K, f64)>>(iter: I) -> Self {
        let mut record = Self::new();
        record.extend(iter);
        record
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn non_finite_numbers_become_null_and_order_is_kept() {
        let mut r = Record::with_step(7);
        r.insert("b", 0.25)
            .insert("a", f64::NAN)
            .insert("c", f64::INFINITY)
            .insert("d", f64::NEG_INFINITY);
        let text = serde_json::to_string(r.as_map()).unwrap_or_default();
        assert_eq!(text, r#"{"step":7,"b":0.25,"a":null,"c":null,"d":null}"#);
    }

    #[test]
    fn reinserting_replaces_in_place() {
        let mut r = Record::new();
        r.insert("x", 1.0).insert("y", 2.0).insert("x", 3.0);
        let text = serde_json::to_string(r.as_map()).unwrap_or_default();
        assert_eq!(text, r#"{"x":3.0,"y":2.0}"#);
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn collects_from_a_btreemap() {
        let m: BTreeMap<String, f64> = [("k/b".to_string(), 2.0), ("k/a".to_string(), f64::NAN)]
            .into_iter()
            .collect();
        let r: Record = m.into_iter().collect();
        assert_eq!(r.get("k/a"), Some(&Value::Null));
        assert_eq!(r.get("k/b").and_then(Value::as_f64), Some(2.0));
        assert!(!r.is_empty());
    }
}
