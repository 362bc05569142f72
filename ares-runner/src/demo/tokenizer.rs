//! The demo's character-level tokenizer, written as a Hugging Face `tokenizer.json` and
//! `tokenizer_config.json` that [`crate::hf::tokenizer::Tokenizer`] and
//! [`crate::hf::chat::ChatTemplate`] load like any Hub model's (and transformers'
//! `PreTrainedTokenizerFast` too).
//!
//! - Model: `WordLevel` over single characters ([`CHARS`]: digits, `+ - * / = ( )`,
//!   space, newline, `a`–`z`, `\ { }` and a little punctuation for system prompts), then the
//!   special tokens [`ENDOFTEXT`], [`IM_START`], [`IM_END`]: [`VOCAB_SIZE`] ids in all, in
//!   that order.
//! - Normaliser `Lowercase` (so rubric or system text with capitals still encodes; the task
//!   itself is lower-case and round-trips exactly); pre-tokeniser `Split` on the regex
//!   `[\s\S]` with `Isolated` behaviour, i.e. one piece per character; decoder `Fuse`
//!   (pieces joined with nothing in between).
//! - Any other character is an encoding error (the `WordLevel` unknown token `<unk>` is
//!   deliberately not in the vocabulary), never a silent substitute; [`check_text`] names it.
//! - `tokenizer_config.json`: EOS `<|im_end|>`, PAD `<|endoftext|>`, no BOS (as Qwen2), and a
//!   ChatML template like Qwen's without a default system turn: each message
//!   `<|im_start|>{role}\n{content}<|im_end|>\n`, roles `system`, `user`, `assistant`, then
//!   `<|im_start|>assistant\n` when a generation prompt is asked for.

use std::path::Path;

use serde_json::{Map, Value, json};
use tokenizers::decoders::fuse::Fuse;
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::normalizers::utils::Lowercase;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::error::DemoError;
use super::task::write_text;
use crate::hf::tokenizer::{TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};

/// The ordinary tokens, one per character, in id order (id 0 is `'0'`).
pub const CHARS: &str = "0123456789+-*/=() \nabcdefghijklmnopqrstuvwxyz\\{}.,:;?!'\"";
/// End of text; the padding token.
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// Start of a chat turn.
pub const IM_START: &str = "<|im_start|>";
/// End of a chat turn; the end-of-sequence token generation stops at.
pub const IM_END: &str = "<|im_end|>";
/// The special tokens, in id order after [`CHARS`].
pub const SPECIALS: [&str; 3] = [ENDOFTEXT, IM_START, IM_END];
/// Number of ids: one per character of [`CHARS`] plus the three specials.
pub const VOCAB_SIZE: usize = 59;
// Every character is one ASCII byte, and the vocabulary stays small.
const _: () = assert!(CHARS.len() + SPECIALS.len() == VOCAB_SIZE && VOCAB_SIZE < 64);

/// Context length written as `model_max_length`.
pub const MODEL_MAX_LENGTH: usize = 512;

/// The demo's ChatML template (see the module docs).
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}\n\
{%- if message['role'] not in ['system', 'user', 'assistant'] %}\n\
{{- raise_exception('the demo chat template has the roles system, user and assistant, not ' + message['role']) }}\n\
{%- endif %}\n\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n\
{%- endfor %}\n\
{%- if add_generation_prompt %}\n\
{{- '<|im_start|>assistant\\n' }}\n\
{%- endif %}\n";

/// Every token in id order: the characters of [`CHARS`], then [`SPECIALS`].
pub fn vocabulary() -> Vec<String> {
    CHARS
        .chars()
        .map(String::from)
        .chain(SPECIALS.iter().map(|s| s.to_string()))
        .collect()
}

/// The id of `token` (a character as a one-character string, or a special token).
pub fn token_id(token: &str) -> Option<u32> {
    vocabulary()
        .iter()
        .position(|t| t == token)
        .and_then(|i| u32::try_from(i).ok())
}

/// The ids of the three special tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialIds {
    /// [`ENDOFTEXT`], the padding token.
    pub endoftext: u32,
    /// [`IM_START`].
    pub im_start: u32,
    /// [`IM_END`], the end-of-sequence token.
    pub im_end: u32,
}

/// The ids of [`ENDOFTEXT`], [`IM_START`] and [`IM_END`] (56, 57, 58).
pub fn special_ids() -> SpecialIds {
    let base = CHARS.chars().count() as u32;
    SpecialIds {
        endoftext: base,
        im_start: base + 1,
        im_end: base + 2,
    }
}

/// Checks that every character of `text` (after lower-casing, as the normaliser does) is in
/// the vocabulary. Special tokens written in the text are not recognised here: check the
/// plain parts.
///
/// # Errors
/// [`DemoError::UnsupportedChar`] naming the first character that is not.
pub fn check_text(text: &str) -> Result<(), DemoError> {
    for ch in text.chars() {
        if !ch.to_lowercase().all(|c| CHARS.contains(c)) {
            return Err(DemoError::UnsupportedChar {
                ch,
                text: text.to_string(),
            });
        }
    }
    Ok(())
}

/// The tokenizer as a `tokenizers` object (what [`write_tokenizer`] saves).
fn build(path: &Path) -> Result<Tokenizer, DemoError> {
    build_with(path, vocabulary(), &SPECIALS)
}

/// A character-level tokenizer of `vocab` (ids in order) with the added special tokens
/// `specials`: the text demo's, and the vision demo's with the vision tokens added.
pub(crate) fn build_with(
    path: &Path,
    vocab: Vec<String>,
    specials: &[&str],
) -> Result<Tokenizer, DemoError> {
    build_char_tokenizer(path, vocab, specials, &[], true)
}

/// A character-level tokenizer of `vocab` (ids in order; an `<unk>` entry there maps every
/// other character to it, else they are encoding errors), then the added special tokens
/// `specials` and the added ordinary tokens `words` (whole strings matched before the
/// characters, kept when special tokens are skipped — as Qwen's `<tool_call>`), lower-casing
/// the text first when `lowercase`.
pub(crate) fn build_char_tokenizer(
    path: &Path,
    vocab: Vec<String>,
    specials: &[&str],
    words: &[&str],
    lowercase: bool,
) -> Result<Tokenizer, DemoError> {
    let fail = |message: String| DemoError::Tokenizer {
        path: path.to_path_buf(),
        message,
    };
    let vocab = vocab
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab)
        .unk_token("<unk>".to_string())
        .build()
        .map_err(|e| fail(e.to_string()))?;
    let split = Split::new(
        SplitPattern::Regex(r"[\s\S]".to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| fail(e.to_string()))?;
    let mut tok = Tokenizer::new(model);
    if lowercase {
        tok.with_normalizer(Some(Lowercase))
            .map_err(|e| fail(e.to_string()))?;
    }
    tok.with_pre_tokenizer(Some(split))
        .with_decoder(Some(Fuse::new()));
    let specials: Vec<AddedToken> = specials
        .iter()
        .map(|s| AddedToken::from(s.to_string(), true))
        .collect();
    tok.add_special_tokens(specials)
        .map_err(|e| fail(e.to_string()))?;
    let words: Vec<AddedToken> = words
        .iter()
        .map(|s| AddedToken::from(s.to_string(), false).normalized(false))
        .collect();
    tok.add_tokens(words).map_err(|e| fail(e.to_string()))?;
    Ok(tok)
}

/// `tokenizer_config.json` (see the module docs).
fn config() -> Value {
    let ids = special_ids();
    config_with(
        &[
            (ids.endoftext, ENDOFTEXT),
            (ids.im_start, IM_START),
            (ids.im_end, IM_END),
        ],
        &[IM_START, IM_END],
        CHAT_TEMPLATE,
    )
}

/// A `tokenizer_config.json` of the demo tokenizers: the special tokens `added` (id,
/// content) in transformers' `added_tokens_decoder`, `additional` as
/// `additional_special_tokens`, `chat_template`, end of turn `<|im_end|>`, padding
/// `<|endoftext|>`.
pub(crate) fn config_with(
    added: &[(u32, &str)],
    additional: &[&str],
    chat_template: &str,
) -> Value {
    let mut decoder = Map::new();
    for &(id, content) in added {
        decoder.insert(
            id.to_string(),
            json!({
                "content": content,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": true,
            }),
        );
    }
    json!({
        "added_tokens_decoder": decoder,
        "additional_special_tokens": additional,
        "bos_token": null,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": false,
        "eos_token": IM_END,
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": null,
    })
}

/// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` (created if missing; other
/// files there are left alone).
///
/// # Errors
/// [`DemoError::Io`] or [`DemoError::Tokenizer`] when a file cannot be written.
pub fn write_tokenizer(dir: &Path) -> Result<(), DemoError> {
    write_files(dir, build, &config())
}

/// Writes the tokenizer `build` makes (given the `tokenizer.json` path, for messages) and
/// `config` into `dir` (created if missing; other files there are left alone).
///
/// # Errors
/// [`DemoError::Io`], [`DemoError::Json`] or [`DemoError::Tokenizer`] when a file cannot be
/// written.
pub(crate) fn write_files(
    dir: &Path,
    build: impl FnOnce(&Path) -> Result<Tokenizer, DemoError>,
    config: &Value,
) -> Result<(), DemoError> {
    std::fs::create_dir_all(dir).map_err(|e| DemoError::io(dir, e))?;
    let path = dir.join(TOKENIZER_FILE);
    let tok = build(&path)?;
    let text = tok.to_string(true).map_err(|e| DemoError::Tokenizer {
        path: path.clone(),
        message: e.to_string(),
    })?;
    write_text(&path, &text)?;
    super::model::write_json(&dir.join(TOKENIZER_CONFIG_FILE), config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabulary_is_small_unique_and_ordered() {
        let v = vocabulary();
        assert_eq!(v.len(), VOCAB_SIZE);
        let unique: std::collections::HashSet<&String> = v.iter().collect();
        assert_eq!(unique.len(), v.len());
        assert_eq!(token_id("0"), Some(0));
        assert_eq!(token_id("\n"), Some(18));
        assert_eq!(token_id("\\"), Some(45));
        let ids = special_ids();
        assert_eq!((ids.endoftext, ids.im_start, ids.im_end), (56, 57, 58));
        assert_eq!(token_id(IM_END), Some(ids.im_end));
        assert_eq!(token_id("A"), None);
    }

    #[test]
    fn check_text_names_the_first_foreign_character() {
        check_text("check 12+7=19\n\\boxed{19}").unwrap();
        check_text("Criterion 1: Be brief.").unwrap();
        let err = check_text("x = 3 # note").unwrap_err().to_string();
        assert!(err.contains("'#'") && err.contains("x = 3 # note"), "{err}");
        assert!(check_text("é").is_err());
    }

    #[test]
    fn template_renders_chatml() {
        use crate::hf::chat::{ChatMessage, ChatTemplate, RenderOptions};
        use crate::hf::tokenizer::{SpecialTokens, TokenizerConfig};
        let cfg = TokenizerConfig::from_json(config(), Path::new("tokenizer_config.json")).unwrap();
        assert_eq!(cfg.special.eos_token.as_deref(), Some(IM_END));
        assert_eq!(cfg.special.pad_token.as_deref(), Some(ENDOFTEXT));
        let t = ChatTemplate::from_source(CHAT_TEMPLATE, SpecialTokens::default()).unwrap();
        let out = t
            .render(&[ChatMessage::user("3+4")], &RenderOptions::generation())
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\n3+4<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t
            .render(
                &[
                    ChatMessage::system("be brief"),
                    ChatMessage::user("3+4"),
                    ChatMessage::assistant("3+4=7\n\\boxed{7}"),
                ],
                &RenderOptions::default(),
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n3+4<|im_end|>\n\
             <|im_start|>assistant\n3+4=7\n\\boxed{7}<|im_end|>\n"
        );
        let err = t
            .render(&[ChatMessage::new("tool", "x")], &RenderOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("not tool"), "{err}");
    }
}
