//! `generation_config.json`: the sampling defaults a checkpoint ships with. Every field is
//! optional; the rollout engine decides what an absent field means.

use std::path::Path;

use serde_json::{Map, Value};

use super::HfError;
use super::json::{self, Fields};

/// The name of the generation config file in a Hugging Face model directory.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// A validated `generation_config.json`; the original JSON is kept for saving.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (`eos_token_id` may be one id or a list).
    pub eos_token_ids: Option<Vec<u32>>,
    /// Padding token.
    pub pad_token_id: Option<u32>,
    /// Sample (`true`) or decode greedily (`false`).
    pub do_sample: Option<bool>,
    /// Softmax temperature, >= 0.
    pub temperature: Option<f64>,
    /// Nucleus sampling mass, in (0, 1].
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens (0 = off).
    pub top_k: Option<usize>,
    /// Minimum probability relative to the most likely token, in [0, 1].
    pub min_p: Option<f64>,
    /// Repetition penalty, > 0 (1 = off).
    pub repetition_penalty: Option<f64>,
    /// Most new tokens to generate.
    pub max_new_tokens: Option<usize>,
    /// Most tokens in total, prompt included.
    pub max_length: Option<usize>,
    raw: Map<String, Value>,
}

impl GenerationConfig {
    /// Reads `<dir>/generation_config.json`; `Ok(None)` when the file does not exist.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, HfError> {
        let path = dir.join(GENERATION_CONFIG_FILE);
        match Self::from_file(&path) {
            Ok(g) => Ok(Some(g)),
            Err(HfError::MissingFile { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads and validates a `generation_config.json` file.
    pub fn from_file(path: &Path) -> Result<Self, HfError> {
        let map = json::read_object(path, "the generation config")?;
        Self::from_map(path, map)
    }

    /// Parses and validates `text` as the contents of `path` (used in messages only).
    pub fn from_json_str(path: &Path, text: &str) -> Result<Self, HfError> {
        let map = json::parse_object(path, text)?;
        Self::from_map(path, map)
    }

    fn from_map(path: &Path, raw: Map<String, Value>) -> Result<Self, HfError> {
        let f = Fields::new(path, &raw);
        let in_range = |key: &str, ok: fn(f64) -> bool, what: &str| -> Result<_, HfError> {
            let v: Option<f64> = f.opt(key)?;
            match v {
                Some(x) if !(x.is_finite() && ok(x)) => {
                    Err(f.error(key, format!("must be {what}, found {x}")))
                }
                _ => Ok(v),
            }
        };
        Ok(Self {
            bos_token_id: f.opt("bos_token_id")?,
            eos_token_ids: f.token_ids("eos_token_id")?,
            pad_token_id: f.opt("pad_token_id")?,
            do_sample: f.opt("do_sample")?,
            temperature: in_range("temperature", |x| x >= 0.0, ">= 0")?,
            top_p: in_range("top_p", |x| x > 0.0 && x <= 1.0, "in (0, 1]")?,
            top_k: f.opt("top_k")?,
            min_p: in_range("min_p", |x| (0.0..=1.0).contains(&x), "in [0, 1]")?,
            repetition_penalty: in_range("repetition_penalty", |x| x > 0.0, "> 0")?,
            max_new_tokens: f.opt("max_new_tokens")?,
            max_length: f.opt("max_length")?,
            raw,
        })
    }

    /// The JSON object this config was read from, unchanged (saved back as is).
    pub fn raw(&self) -> &Map<String, Value> {
        &self.raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<GenerationConfig, HfError> {
        GenerationConfig::from_json_str(Path::new("generation_config.json"), text)
    }

    #[test]
    fn fields_are_optional_and_eos_is_int_or_list() {
        let g = parse("{}").unwrap();
        assert_eq!(
            (g.eos_token_ids, g.temperature, g.top_k),
            (None, None, None)
        );
        assert_eq!(
            parse(r#"{"eos_token_id": 5}"#).unwrap().eos_token_ids,
            Some(vec![5])
        );
        let g = parse(r#"{"eos_token_id": [5, 6], "top_k": 0, "min_p": 0.1}"#).unwrap();
        assert_eq!(
            (g.eos_token_ids, g.top_k, g.min_p),
            (Some(vec![5, 6]), Some(0), Some(0.1))
        );
    }

    #[test]
    fn bad_values_are_named() {
        let e = parse(r#"{"top_p": 1.5}"#).unwrap_err().to_string();
        assert_eq!(
            e,
            "generation_config.json: top_p: must be in (0, 1], found 1.5"
        );
        let e = parse(r#"{"temperature": -1}"#).unwrap_err().to_string();
        assert!(e.contains("temperature: must be >= 0"), "{e}");
        let e = parse(r#"{"eos_token_id": "x"}"#).unwrap_err().to_string();
        assert!(e.contains("eos_token_id: invalid type: string"), "{e}");
        let e = parse(r#"{"eos_token_id": [1, -2]}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("eos_token_id: invalid value"), "{e}");
    }
}
