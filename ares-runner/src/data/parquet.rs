//! Parquet files through the `parquet` crate's record API (no arrow): each row becomes a
//! JSON object, so Parquet and JSON lines rows go through the same checks. Nested columns
//! map as pyarrow writes them: structs → objects, lists → arrays, maps → objects. A binary
//! field named `bytes` inside a struct (the encoded file of Hugging Face `datasets`' `Image`
//! feature, `{bytes, path}`) becomes base64 text, as a JSON lines row gives it.

use std::fs::File;
use std::path::Path;

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};
use serde_json::{Map, Number, Value};

use super::error::{DataError, Location, Result};
use super::media::base64_encode;
use super::row::RawRow;

mod pages;

/// The most uncompressed bytes a row group may declare (1 GiB): the loader reads a group's
/// pages whole, and dataset files hold groups of a few to a few hundred MiB.
const MAX_ROW_GROUP_BYTES: u64 = 1 << 30;

/// Reads every row of a Parquet file.
pub(crate) fn read_parquet(path: &Path) -> Result<Vec<RawRow>> {
    // The `parquet` crate can panic on a malformed file (found by fuzzing: a slice past a
    // page's end in its bit reader). A downloaded file must give an error, so a panic in
    // reading is caught and reported as this file's error.
    std::panic::catch_unwind(|| read_parquet_unguarded(path)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        Err(DataError::Parquet {
            path: path.to_path_buf(),
            row: None,
            message: format!("the Parquet decoder failed on this malformed file ({what})"),
        })
    })
}

fn read_parquet_unguarded(path: &Path) -> Result<Vec<RawRow>> {
    let file = File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let fail = |row: Option<usize>, e: parquet::errors::ParquetError| DataError::Parquet {
        path: path.to_path_buf(),
        row,
        message: e.to_string(),
    };
    let reader = SerializedFileReader::new(file).map_err(|e| fail(None, e))?;
    // the footer's and the page headers' sizes come from the file: refuse what declares
    // more than a dataset holds before the decoder allocates it
    let mut again = File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let len = again
        .metadata()
        .map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    pages::check_declared_sizes(&mut again, len, reader.metadata(), MAX_ROW_GROUP_BYTES).map_err(
        |message| DataError::Parquet {
            path: path.to_path_buf(),
            row: None,
            message,
        },
    )?;
    let iter = reader.get_row_iter(None).map_err(|e| fail(None, e))?;
    let mut rows = Vec::new();
    for (row, r) in iter.enumerate() {
        let r = r.map_err(|e| fail(Some(row), e))?;
        rows.push(RawRow {
            at: Location {
                path: path.to_path_buf(),
                row,
                line: None,
            },
            value: Value::Object(row_to_json(&r, false)),
        });
    }
    Ok(rows)
}

/// A row or struct as an object; `nested` for a struct, whose binary `bytes` field is an
/// encoded image or video, kept whole as base64.
fn row_to_json(row: &Row, nested: bool) -> Map<String, Value> {
    row.get_column_iter()
        .map(|(name, field)| {
            let value = match field {
                Field::Bytes(b) if nested && name == "bytes" => {
                    Value::String(base64_encode(b.data()))
                }
                _ => field_to_json(field),
            };
            (name.clone(), value)
        })
        .collect()
}

fn float(x: f64) -> Value {
    // NaN/∞ have no JSON form; as null they read as "absent", which the checks then report.
    Number::from_f64(x).map_or(Value::Null, Value::Number)
}

fn field_to_json(field: &Field) -> Value {
    match field {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(v) => Value::from(*v),
        Field::Short(v) => Value::from(*v),
        Field::Int(v) => Value::from(*v),
        Field::Long(v) => Value::from(*v),
        Field::UByte(v) => Value::from(*v),
        Field::UShort(v) => Value::from(*v),
        Field::UInt(v) => Value::from(*v),
        Field::ULong(v) => Value::from(*v),
        Field::Float16(v) => float(f64::from(*v)),
        Field::Float(v) => float(f64::from(*v)),
        Field::Double(v) => float(*v),
        Field::Str(s) => Value::String(s.clone()),
        // Binary columns: text if it is UTF-8 (some writers store strings as plain binary),
        // else the bytes as numbers, so a non-empty binary column is never mistaken for empty.
        Field::Bytes(b) => match std::str::from_utf8(b.data()) {
            Ok(s) => Value::String(s.to_owned()),
            Err(_) => Value::Array(b.data().iter().map(|&x| Value::from(x)).collect()),
        },
        // Decimals, dates and times are not training data; their printed form suffices.
        Field::Decimal(_)
        | Field::Date(_)
        | Field::TimeMillis(_)
        | Field::TimeMicros(_)
        | Field::TimestampMillis(_)
        | Field::TimestampMicros(_) => Value::String(field.to_string()),
        Field::Group(row) => Value::Object(row_to_json(row, true)),
        Field::ListInternal(list) => {
            Value::Array(list.elements().iter().map(field_to_json).collect())
        }
        Field::MapInternal(map) => {
            let entries = map.entries();
            if entries.iter().all(|(k, _)| matches!(k, Field::Str(_))) {
                Value::Object(
                    entries
                        .iter()
                        .map(|(k, v)| {
                            let key = match k {
                                Field::Str(s) => s.clone(),
                                other => other.to_string(),
                            };
                            (key, field_to_json(v))
                        })
                        .collect(),
                )
            } else {
                Value::Array(
                    entries
                        .iter()
                        .map(|(k, v)| Value::Array(vec![field_to_json(k), field_to_json(v)]))
                        .collect(),
                )
            }
        }
    }
}
