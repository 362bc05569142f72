//! Reading JSON objects field by field, so that every error names the file and the field
//! (serde's own messages give a line and column but not the field for a wrong type).

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::HfError;

/// Reads `path` as a JSON object; a missing file is [`HfError::MissingFile`] with `what`.
pub(crate) fn read_object(path: &Path, what: &str) -> Result<Map<String, Value>, HfError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(HfError::MissingFile {
                path: path.to_path_buf(),
                what: what.to_string(),
            });
        }
        Err(e) => return Err(HfError::io(path, e)),
    };
    parse_object(path, &text)
}

/// Parses `text` (the contents of `path`) as a JSON object.
pub(crate) fn parse_object(path: &Path, text: &str) -> Result<Map<String, Value>, HfError> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(HfError::Json {
            path: path.to_path_buf(),
            message: format!("expected a JSON object, found {}", kind(&other)),
        }),
        Err(e) => Err(HfError::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        }),
    }
}

/// Writes `value` as pretty JSON (2-space indent, trailing newline), as transformers does.
pub(crate) fn write_pretty(path: &Path, value: &Value) -> Result<(), HfError> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| HfError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| HfError::io(path, e))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The fields of one JSON object in one file; nested objects carry a dotted prefix.
pub(crate) struct Fields<'a> {
    path: &'a Path,
    prefix: String,
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// The top-level fields of the object read from `path`.
    pub(crate) fn new(path: &'a Path, map: &'a Map<String, Value>) -> Self {
        Self {
            path,
            prefix: String::new(),
            map,
        }
    }

    /// The dotted name of `key` for messages.
    pub(crate) fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// A [`HfError::Field`] for `key`.
    pub(crate) fn error(&self, key: &str, message: impl Into<String>) -> HfError {
        HfError::field(PathBuf::from(self.path), self.name(key), message)
    }

    /// `key` converted to `T`; absent or null is `None`.
    pub(crate) fn opt<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, HfError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v.clone())
                .map(Some)
                .map_err(|e| self.error(key, format!("{e} (found {v})"))),
        }
    }

    /// `key` converted to `T`; absent or null is an error.
    pub(crate) fn req<T: DeserializeOwned>(&self, key: &str) -> Result<T, HfError> {
        self.opt(key)?
            .ok_or_else(|| self.error(key, "missing (required)"))
    }

    /// The nested object at `key`; absent or null is `None`, any other non-object an error.
    pub(crate) fn object(&self, key: &str) -> Result<Option<Fields<'a>>, HfError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Fields {
                path: self.path,
                prefix: format!("{}.", self.name(key)),
                map,
            })),
            Some(v) => Err(self.error(key, format!("expected an object, found {}", kind(v)))),
        }
    }

    /// Token ids written as one integer or a list of integers (`eos_token_id`).
    pub(crate) fn token_ids(&self, key: &str) -> Result<Option<Vec<u32>>, HfError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(_)) => self.opt::<Vec<u32>>(key),
            Some(_) => Ok(self.opt::<u32>(key)?.map(|id| vec![id])),
        }
    }
}
