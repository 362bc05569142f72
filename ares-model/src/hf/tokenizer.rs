//! `tokenizer.json` and the special tokens of `tokenizer_config.json`: the encode/decode calls
//! the rollout engine makes.
//!
//! A thin wrapper over the [`tokenizers`] crate (the Rust core of HF's Python `tokenizers`,
//! built with its pure-Rust `fancy-regex` backend). It behaves as transformers'
//! `PreTrainedTokenizerFast` does by default:
//!
//! - padding and truncation stored in `tokenizer.json` are switched off (transformers only
//!   applies them when a call asks for them), so `encode` returns exactly the text's ids;
//! - [`Tokenizer::decode`] applies `clean_up_tokenization_spaces` when `tokenizer_config.json`
//!   sets it — but, as transformers 5 does, not for a BPE model (Llama 3 sets it and is BPE:
//!   no clean-up), unless `clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`
//!   is set too.
//!
//! Prompts rendered by a chat template already hold their special tokens as text (`bos_token`
//! included), so encode them with `add_special_tokens = false`, as transformers'
//! `apply_chat_template(tokenize=True)` does.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

/// File name of the tokenizer inside a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// File name of the tokenizer config (special tokens, chat template) inside a model directory.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// Errors from loading or using a tokenizer; each names the file (and field) at fault.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The file could not be read (missing, unreadable).
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid JSON.
    #[error("{}: not valid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error (with line and column).
        source: serde_json::Error,
    },
    /// `tokenizer.json` is JSON but not a tokenizer the `tokenizers` crate can build.
    #[error("{}: not a valid tokenizer: {message}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// What `tokenizers` reported.
        message: String,
    },
    /// A field of `tokenizer_config.json` has the wrong type or an unusable value.
    #[error("{}: `{field}`: {reason}", path.display())]
    Field {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Encoding a text failed.
    #[error("{}: encoding failed: {message}", path.display())]
    Encode {
        /// The tokenizer file.
        path: PathBuf,
        /// What `tokenizers` reported.
        message: String,
    },
    /// Decoding ids failed.
    #[error("{}: decoding failed: {message}", path.display())]
    Decode {
        /// The tokenizer file.
        path: PathBuf,
        /// What `tokenizers` reported.
        message: String,
    },
}

/// Result alias of this module.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// The special tokens named in `tokenizer_config.json`, as strings.
///
/// Hub files write each either as a string or (older files) as an `AddedToken` object
/// `{"__type": "AddedToken", "content": "<s>", …}`; both are read. `null` means unset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token`.
    pub bos_token: Option<String>,
    /// `eos_token`.
    pub eos_token: Option<String>,
    /// `unk_token`.
    pub unk_token: Option<String>,
    /// `sep_token`.
    pub sep_token: Option<String>,
    /// `pad_token`.
    pub pad_token: Option<String>,
    /// `cls_token`.
    pub cls_token: Option<String>,
    /// `mask_token`.
    pub mask_token: Option<String>,
    /// `additional_special_tokens`.
    pub additional_special_tokens: Vec<String>,
}

impl SpecialTokens {
    /// The single-token fields by the names transformers passes to chat templates, in its
    /// order (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`,
    /// `mask_token`); unset ones are left out.
    pub fn named(&self) -> Vec<(&'static str, &str)> {
        [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
            ("unk_token", &self.unk_token),
            ("sep_token", &self.sep_token),
            ("pad_token", &self.pad_token),
            ("cls_token", &self.cls_token),
            ("mask_token", &self.mask_token),
        ]
        .into_iter()
        .filter_map(|(name, v)| v.as_deref().filter(|s| !s.is_empty()).map(|s| (name, s)))
        .collect()
    }

    /// Reads the special-token fields of a parsed `tokenizer_config.json`; `path` is only used
    /// in errors.
    pub fn from_config_json(config: &Json, path: &Path) -> Result<Self> {
        let one = |field: &str| token_field(config.get(field), path, field);
        let additional = match config.get("additional_special_tokens") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Array(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let field = format!("additional_special_tokens[{i}]");
                    match token_field(Some(item), path, &field)? {
                        Some(t) => out.push(t),
                        None => return Err(field_error(path, &field, "is null")),
                    }
                }
                out
            }
            Some(other) => {
                return Err(field_error(
                    path,
                    "additional_special_tokens",
                    &format!("expected a list of tokens, found {}", json_kind(other)),
                ));
            }
        };
        Ok(Self {
            bos_token: one("bos_token")?,
            eos_token: one("eos_token")?,
            unk_token: one("unk_token")?,
            sep_token: one("sep_token")?,
            pad_token: one("pad_token")?,
            cls_token: one("cls_token")?,
            mask_token: one("mask_token")?,
            additional_special_tokens: additional,
        })
    }
}

fn token_field(value: Option<&Json>, path: &Path, field: &str) -> Result<Option<String>> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(map)) => match map.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(
                path,
                field,
                "an AddedToken object needs a string `content`",
            )),
        },
        Some(other) => Err(field_error(
            path,
            field,
            &format!(
                "expected a token string or AddedToken object, found {}",
                json_kind(other)
            ),
        )),
    }
}

fn field_error(path: &Path, field: &str, reason: &str) -> TokenizerError {
    TokenizerError::Field {
        path: path.to_path_buf(),
        field: field.to_string(),
        reason: reason.to_string(),
    }
}

pub(crate) fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

/// Reads and parses a JSON file, with errors naming it.
pub(crate) fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// The parts of `tokenizer_config.json` the runner uses, plus the whole parsed file.
#[derive(Debug, Clone)]
pub struct TokenizerConfig {
    /// Where it was read from (used in errors).
    pub path: PathBuf,
    /// The special tokens.
    pub special: SpecialTokens,
    /// `clean_up_tokenization_spaces` (transformers' default when absent: `false`).
    pub clean_up_tokenization_spaces: bool,
    /// `clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`: the
    /// clean-up for a BPE model too (default `false`: transformers 5 skips it there).
    pub clean_up_bpe: bool,
    /// The whole file, for fields not modelled here (the chat module reads `chat_template`).
    pub raw: Json,
}

impl TokenizerConfig {
    /// Reads `tokenizer_config.json` (the path of the file itself).
    pub fn from_file(path: &Path) -> Result<Self> {
        let raw = read_json(path)?;
        Self::from_json(raw, path)
    }

    /// Builds the config from already parsed JSON; `path` is only used in errors.
    pub fn from_json(raw: Json, path: &Path) -> Result<Self> {
        if !raw.is_object() {
            return Err(field_error(
                path,
                "(top level)",
                &format!("expected an object, found {}", json_kind(&raw)),
            ));
        }
        let special = SpecialTokens::from_config_json(&raw, path)?;
        let flag = |key: &str| match raw.get(key) {
            None | Some(Json::Null) => Ok(false),
            Some(Json::Bool(b)) => Ok(*b),
            Some(other) => Err(field_error(
                path,
                key,
                &format!("expected a boolean, found {}", json_kind(other)),
            )),
        };
        Ok(Self {
            path: path.to_path_buf(),
            special,
            clean_up_tokenization_spaces: flag("clean_up_tokenization_spaces")?,
            clean_up_bpe: flag(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            )?,
            raw,
        })
    }
}

/// A loaded `tokenizer.json`, optionally with its `tokenizer_config.json`.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    config: Option<TokenizerConfig>,
}

impl Tokenizer {
    /// Loads a `tokenizer.json` file (no config: no special-token names, no decode clean-up).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // Parse as JSON first so that syntax errors carry line and column.
        let json: Json = serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let mut inner: tokenizers::Tokenizer =
            serde_json::from_value(json).map_err(|e| TokenizerError::Tokenizer {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| TokenizerError::Tokenizer {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        Ok(Self {
            inner,
            path: path.to_path_buf(),
            config: None,
        })
    }

    /// An upper bound on the UTF-8 bytes of input one token can cover: the longest token
    /// of the vocabulary (added tokens included), times 4 when a normalizer may shrink the
    /// text first (a character of up to 4 bytes normalized to 1). A text of `b` bytes is
    /// therefore at least `b / max_token_bytes()` tokens — enough to refuse a book-length
    /// prompt without tokenizing it.
    pub fn max_token_bytes(&self) -> usize {
        let longest = self
            .inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1);
        if self.inner.get_normalizer().is_some() {
            longest * 4
        } else {
            longest
        }
    }

    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json` from a model
    /// directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tok = Self::from_file(&dir.join(TOKENIZER_FILE))?;
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        if config_path.exists() {
            tok.with_config(TokenizerConfig::from_file(&config_path)?)
        } else {
            Ok(tok)
        }
    }

    /// Attaches a `tokenizer_config.json`. Fails when its `bos_token`, `eos_token` or
    /// `pad_token` is not a token of this tokenizer.
    pub fn with_config(mut self, config: TokenizerConfig) -> Result<Self> {
        for (field, token) in [
            ("bos_token", &config.special.bos_token),
            ("eos_token", &config.special.eos_token),
            ("pad_token", &config.special.pad_token),
        ] {
            if let Some(t) = token
                .as_deref()
                .filter(|t| self.inner.token_to_id(t).is_none())
            {
                return Err(field_error(
                    &config.path,
                    field,
                    &format!("{t:?} is not a token of {}", self.path.display()),
                ));
            }
        }
        self.config = Some(config);
        Ok(self)
    }

    /// The `tokenizer.json` path this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The attached `tokenizer_config.json`, if any.
    pub fn config(&self) -> Option<&TokenizerConfig> {
        self.config.as_ref()
    }

    /// The underlying `tokenizers` tokenizer, for calls this wrapper does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Encodes one text. `add_special_tokens` runs the post-processor (e.g. Llama's BOS);
    /// special tokens written in the text are matched either way.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// Encodes several texts (in parallel), each as [`Tokenizer::encode`] would; no padding.
    pub fn encode_batch(&self, texts: &[&str], add_special_tokens: bool) -> Result<Vec<Vec<u32>>> {
        self.inner
            .encode_batch(texts.to_vec(), add_special_tokens)
            .map(|encs| encs.iter().map(|e| e.get_ids().to_vec()).collect())
            .map_err(|e| TokenizerError::Encode {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// Decodes ids to text as transformers' `decode` does: ids outside the vocabulary are
    /// skipped, `skip_special_tokens` drops special tokens, and `clean_up_tokenization_spaces`
    /// is applied when the config sets it and the model is not BPE (transformers 5 skips the
    /// clean-up there: it would strip spaces a BPE model meant, ` 're` → `'re`).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let text =
            self.inner
                .decode(ids, skip_special_tokens)
                .map_err(|e| TokenizerError::Decode {
                    path: self.path.clone(),
                    message: e.to_string(),
                })?;
        let bpe = matches!(self.inner.get_model(), tokenizers::ModelWrapper::BPE(_));
        let clean = self
            .config
            .as_ref()
            .is_some_and(|c| c.clean_up_tokenization_spaces && (!bpe || c.clean_up_bpe));
        Ok(if clean {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// Number of ids, added tokens included (Python's `len(tokenizer)`). The model's
    /// embedding table may be larger (padded); never smaller.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token (special or not), if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of an id, if the id is in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    fn special_id(&self, pick: impl Fn(&SpecialTokens) -> &Option<String>) -> Option<u32> {
        let config = self.config.as_ref()?;
        pick(&config.special)
            .as_deref()
            .and_then(|t| self.inner.token_to_id(t))
    }

    /// The id of the config's `bos_token` (None without config or when unset, as in Qwen2).
    pub fn bos_id(&self) -> Option<u32> {
        self.special_id(|s| &s.bos_token)
    }

    /// The id of the config's `eos_token`.
    pub fn eos_id(&self) -> Option<u32> {
        self.special_id(|s| &s.eos_token)
    }

    /// The id of the config's `pad_token`.
    pub fn pad_id(&self) -> Option<u32> {
        self.special_id(|s| &s.pad_token)
    }

    /// The ids that end a generation: `generation_eos` (`eos_token_id` of
    /// `generation_config.json`, in its order) followed by the config's `eos_token` when it is
    /// not among them; duplicates removed.
    pub fn eos_ids(&self, generation_eos: &[u32]) -> Vec<u32> {
        let mut out: Vec<u32> = Vec::with_capacity(generation_eos.len() + 1);
        for &id in generation_eos.iter().chain(self.eos_id().as_ref()) {
            if !out.contains(&id) {
                out.push(id);
            }
        }
        out
    }
}

/// transformers' `clean_up_tokenization`: removes the spaces a word-level tokenizer puts
/// before punctuation and English contractions.
pub fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn special_tokens_strings_and_added_token_objects() {
        let cfg = json!({
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": true},
            "eos_token": "</s>",
            "pad_token": null,
            "additional_special_tokens": ["<a>", {"content": "<b>"}],
        });
        let s = SpecialTokens::from_config_json(&cfg, Path::new("tokenizer_config.json")).unwrap();
        assert_eq!(s.bos_token.as_deref(), Some("<s>"));
        assert_eq!(s.eos_token.as_deref(), Some("</s>"));
        assert_eq!(s.pad_token, None);
        assert_eq!(s.additional_special_tokens, ["<a>", "<b>"]);
        assert_eq!(s.named(), [("bos_token", "<s>"), ("eos_token", "</s>")]);
    }

    #[test]
    fn bad_special_token_field_names_file_and_field() {
        let cfg = json!({"eos_token": 7});
        let err = SpecialTokens::from_config_json(&cfg, Path::new("m/tokenizer_config.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("m/tokenizer_config.json"), "{err}");
        assert!(err.contains("eos_token"), "{err}");
        let cfg = json!({"additional_special_tokens": "x"});
        let err = SpecialTokens::from_config_json(&cfg, Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("additional_special_tokens"), "{err}");
    }

    #[test]
    fn config_must_be_an_object() {
        let err = TokenizerConfig::from_json(json!([1]), Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("expected an object"), "{err}");
    }

    #[test]
    fn clean_up_matches_transformers_rules() {
        assert_eq!(
            clean_up_tokenization("a , b . c ? d ! I 'm do n't it 's we 're they 've x ' y"),
            "a, b. c? d! I'm don't it's we're they've x'y"
        );
    }
}
