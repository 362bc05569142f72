//! The tool-use demo (`ares-runner train --demo tools`): arithmetic that a tiny model can
//! do in its head at one level and cannot at another, an exact `calculator` it may call,
//! and worked multi-turn traces to warm-start it.
//!
//! **Problems** (the prompt is the bare expression):
//!
//! | level | prompts | in its head |
//! |---|---|---|
//! | easy | `a+b`, `a` in `1..=29`, `b` in `1..=9` (261) | one small sum, as in the text demo |
//! | medium | `a+b`, `a, b` in `10..=99` (8 100) | carries: sometimes |
//! | hard | `a*b`, `a, b` in `10..=99` (8 100) | no: four-digit products of unseen pairs |
//!
//! **Traces**: the answer straight away, `\boxed{408}`; or a calculator call, the tool's
//! answer as a `tool` turn, then the answer:
//!
//! ```text
//! <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>
//!                                                       (tool) 408
//! \boxed{408}
//! ```
//!
//! The warm start calls with a probability per level ([`CALL_RATE`]) that does not follow
//! need (a fifth of the easy problems, half of the others): RL has to learn when a call
//! pays (the demo gives each call a cost, `worker.rollout.multi_turn.call_cost`). The tool's answers in the traces are the [`calculator`]'s own.
//!
//! **Tokenizer**: one token per printable ASCII character and newline (anything else is
//! `<unk>`, so no tool output can fail to encode), ChatML's special tokens, and as single
//! ordinary tokens — as a BPE vocabulary would merge them — `<tool_call>`, `</tool_call>`,
//! `calculator`, the call's three JSON keys with their quotes, the four roles and `boxed`.
//! A call is 27 tokens with a five-character expression; the words keep what the model
//! copies (the question into its call, the tool's answer into its own) a few tokens away.
//!
//! **Template**: ChatML with a system turn naming the tools (`tools: calculator`) when the
//! trainer passes them, `tool` turns for their answers; calls in the Hermes format
//! (`crate::tools::calls`), as Qwen2.5's template teaches.
//!
//! Splits as the text demo's ([`Split::of`]): train and eval never share a problem.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};
use tokenizers::Tokenizer;

use super::error::DemoError;
use super::model::{TinyModelSpec, write_random_model};
use super::rng::{self, Stream};
use super::task::{Level, Problem, Split, to_jsonl, write_text};
use super::tokenizer::{
    ENDOFTEXT, IM_END, IM_START, build_char_tokenizer, config_with, write_files,
};
use crate::tools::calculator;

/// Probability that a warm-start trace of each level (easy, medium, hard) calls the
/// calculator.
pub const CALL_RATE: [f64; 3] = [0.2, 0.5, 0.5];

/// The unknown-character token.
pub const UNK: &str = "<unk>";
/// Ordinary tokens of more than one character, in id order after the special tokens.
pub const WORDS: [&str; 11] = [
    "<tool_call>",
    "</tool_call>",
    "calculator",
    "\"name\"",
    "\"arguments\"",
    "\"expression\"",
    "system",
    "user",
    "assistant",
    "tool",
    "boxed",
];
/// Special tokens in id order after the characters.
pub const SPECIALS: [&str; 4] = [UNK, ENDOFTEXT, IM_START, IM_END];

/// The characters, one token each, in id order: newline, then `' '..='~'`.
pub fn characters() -> Vec<char> {
    std::iter::once('\n').chain(' '..='~').collect()
}

/// Number of ids: characters, specials and words.
pub fn vocab_size() -> usize {
    characters().len() + SPECIALS.len() + WORDS.len()
}

/// The id of `token` (a character as a one-character string, a special token or a word).
pub fn token_id(token: &str) -> Option<u32> {
    let chars = characters();
    let specials = SPECIALS.iter().copied();
    let words = WORDS.iter().copied();
    chars
        .iter()
        .map(|c| c.to_string())
        .chain(specials.chain(words).map(String::from))
        .position(|t| t == token)
        .and_then(|i| u32::try_from(i).ok())
}

fn id(token: &str) -> u32 {
    token_id(token).unwrap_or_default()
}

/// The demo's chat template (see the module docs).
pub const CHAT_TEMPLATE: &str = "{#- The model calls a tool as \
<tool_call>{\"name\": <its name>, \"arguments\": {<its arguments>}}</tool_call> and reads \
its answer in a tool turn. -#}\n\
{%- if tools %}\n\
{{- '<|im_start|>system\\ntools:' }}\n\
{%- for tool in tools %}\n\
{{- ' ' + (tool.function.name if tool.function is defined else tool.name) }}\n\
{%- endfor %}\n\
{{- '<|im_end|>\\n' }}\n\
{%- endif %}\n\
{%- for message in messages %}\n\
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n\
{{- raise_exception('the tools demo template has the roles system, user, assistant and tool, not ' + message['role']) }}\n\
{%- endif %}\n\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n\
{%- endfor %}\n\
{%- if add_generation_prompt %}\n\
{{- '<|im_start|>assistant\\n' }}\n\
{%- endif %}\n";

fn build_tokenizer(path: &Path) -> Result<Tokenizer, DemoError> {
    let mut vocab: Vec<String> = characters().iter().map(char::to_string).collect();
    vocab.push(UNK.into());
    build_char_tokenizer(path, vocab, &SPECIALS, &WORDS, false)
}

fn tokenizer_config() -> Value {
    let specials: Vec<(u32, &str)> = SPECIALS.iter().map(|s| (id(s), *s)).collect();
    let mut config = config_with(&specials, &[IM_START, IM_END], CHAT_TEMPLATE);
    if let Some(decoder) = config
        .get_mut("added_tokens_decoder")
        .and_then(Value::as_object_mut)
    {
        for w in WORDS {
            decoder.insert(
                id(w).to_string(),
                json!({"content": w, "lstrip": false, "normalized": false, "rstrip": false,
                       "single_word": false, "special": false}),
            );
        }
    }
    config["unk_token"] = json!(UNK);
    config
}

/// Every prompt of `level`, in a fixed order.
fn kind_prompts(level: Level) -> Vec<String> {
    let (a, b, op) = match level {
        Level::Easy => ((1, 29), (1, 9), '+'),
        Level::Medium => ((10, 99), (10, 99), '+'),
        Level::Hard => ((10, 99), (10, 99), '*'),
    };
    let mut out = Vec::new();
    for x in a.0..=a.1 {
        for y in b.0..=b.1 {
            out.push(format!("{x}{op}{y}"));
        }
    }
    out
}

/// `per_level` distinct problems of each level from `split`, chosen with `seed`, levels
/// interleaved (`easy, medium, hard, easy, …`).
///
/// # Errors
/// [`DemoError::NotEnoughProblems`] when a level's split is smaller (easy eval has 67
/// prompts, easy train 194).
pub fn problems(split: Split, seed: u64, per_level: usize) -> Result<Vec<Problem>, DemoError> {
    let mut rng = rng::seeded(seed, Stream::Problems);
    let mut by_level = Vec::with_capacity(Level::ALL.len());
    for level in Level::ALL {
        let mut pool: Vec<String> = kind_prompts(level)
            .into_iter()
            .filter(|p| Split::of(p) == split)
            .collect();
        if pool.len() < per_level {
            return Err(DemoError::NotEnoughProblems {
                level: level.as_str(),
                split: split.as_str(),
                wanted: per_level,
                available: pool.len(),
            });
        }
        rng::shuffle(&mut rng, &mut pool);
        let list = pool[..per_level]
            .iter()
            .map(|p| Problem::new(p, level))
            .collect::<Result<Vec<_>, _>>()?;
        by_level.push(list);
    }
    Ok((0..per_level)
        .flat_map(|i| by_level.iter().map(move |l: &Vec<Problem>| l[i].clone()))
        .collect())
}

/// The call a trace makes for `expression`, as the model writes it.
pub fn call_text(expression: &str) -> String {
    format!(
        "<tool_call>{}</tool_call>",
        json!({"name": "calculator", "arguments": {"expression": expression}})
            .to_string()
            .replace("\":", "\": ")
            .replace(",\"", ", \"")
    )
}

/// The trace of `p`: the answer, or (`call`) a calculator call, its answer and the answer.
///
/// # Errors
/// [`DemoError::Expression`] when the calculator's value is not the problem's answer.
pub fn trace(p: &Problem, call: bool) -> Result<Vec<Value>, DemoError> {
    let answer = json!({"role": "assistant", "content": format!("\\boxed{{{}}}", p.answer)});
    if !call {
        return Ok(vec![answer]);
    }
    let value = calculator::evaluate(&p.prompt).map_err(|reason| DemoError::Expression {
        prompt: p.prompt.clone(),
        reason,
    })?;
    if value != p.answer {
        return Err(DemoError::Expression {
            prompt: p.prompt.clone(),
            reason: format!("the calculator gives {value}, the answer is {}", p.answer),
        });
    }
    Ok(vec![
        json!({"role": "assistant", "content": call_text(&p.prompt)}),
        json!({"role": "tool", "name": "calculator", "content": value}),
        answer,
    ])
}

/// `count` warm-start rows `(prompt, trace)`: level uniform, a uniformly random prompt of
/// it from the train split (with replacement), a call with the level's [`CALL_RATE`].
///
/// # Errors
/// As [`trace`] (never, for the task's own prompts).
pub fn sft_traces(seed: u64, count: usize) -> Result<Vec<(String, Vec<Value>)>, DemoError> {
    let mut rng = rng::seeded(seed, Stream::Sft);
    let pools: Vec<Vec<String>> = Level::ALL
        .iter()
        .map(|&l| {
            kind_prompts(l)
                .into_iter()
                .filter(|p| Split::of(p) == Split::Train)
                .collect()
        })
        .collect();
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let l = rng::below(&mut rng, Level::ALL.len());
        let prompt = &pools[l][rng::below(&mut rng, pools[l].len())];
        let call = rng::unit_open0(&mut rng) <= CALL_RATE[l];
        let p = Problem::new(prompt, Level::ALL[l])?;
        out.push((prompt.clone(), trace(&p, call)?));
    }
    Ok(out)
}

/// What [`write_tools_demo_assets`] makes.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolsDemoOptions {
    /// Seed of the problems, the traces and the initial weights.
    pub seed: u64,
    /// Training problems per level (RL prompts).
    pub train_per_level: usize,
    /// Held-out problems per level.
    pub eval_per_level: usize,
    /// Warm-start traces.
    pub sft_examples: usize,
    /// The model's sizes.
    pub model: TinyModelSpec,
}

impl Default for ToolsDemoOptions {
    /// Seed 1, 192 training and 64 held-out problems per level, 8192 traces, the text
    /// demo's model size.
    fn default() -> Self {
        Self {
            seed: 1,
            train_per_level: 192,
            eval_per_level: 64,
            sft_examples: 8192,
            model: TinyModelSpec::default(),
        }
    }
}

/// Paths of what [`write_tools_demo_assets`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolsDemoAssets {
    /// `root/model`: a random tiny Qwen2 with the tokenizer and template above.
    pub model_dir: PathBuf,
    /// `root/data/train.jsonl` and `eval.jsonl`: `prompt`, `answer`, `difficulty`,
    /// `global_id`.
    pub train: PathBuf,
    /// See `train`.
    pub eval: PathBuf,
    /// `root/data/sft.jsonl`: `prompt` and `response`, a trace (a list of messages).
    pub sft: PathBuf,
}

/// Writes the tools demo's model directory and datasets under `dir`; the same options give
/// the same bytes.
///
/// # Errors
/// Too few problems or a bad model spec (before anything is written); I/O and tokenizer
/// errors.
pub fn write_tools_demo_assets(
    dir: &Path,
    options: &ToolsDemoOptions,
) -> Result<ToolsDemoAssets, DemoError> {
    options.model.validate()?;
    let train = problems(Split::Train, options.seed, options.train_per_level)?;
    let eval = problems(Split::Eval, options.seed, options.eval_per_level)?;
    let sft = sft_traces(options.seed, options.sft_examples)?;
    let data = dir.join("data");
    let assets = ToolsDemoAssets {
        model_dir: dir.join("model"),
        train: data.join("train.jsonl"),
        eval: data.join("eval.jsonl"),
        sft: data.join("sft.jsonl"),
    };
    write_random_model(
        &assets.model_dir,
        &options.model,
        vocab_size(),
        id(IM_END),
        id(ENDOFTEXT),
        None,
        options.seed,
    )?;
    write_files(&assets.model_dir, build_tokenizer, &tokenizer_config())?;
    to_jsonl(&train, &assets.train)?;
    to_jsonl(&eval, &assets.eval)?;
    let mut text = String::new();
    for (prompt, trace) in &sft {
        let mut row = Map::new();
        row.insert("prompt".into(), json!(prompt));
        row.insert("response".into(), Value::Array(trace.clone()));
        text.push_str(&Value::Object(row).to_string());
        text.push('\n');
    }
    write_text(&assets.sft, &text)?;
    Ok(assets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::chat::{ChatTemplate, RenderOptions};
    use crate::hf::tokenizer::{SpecialTokens, Tokenizer as HfTokenizer};
    use crate::tools::{ParsedCall, ToolBox, ToolCallFormat, parse_turn};

    #[test]
    fn the_vocabulary_has_every_token_once() {
        assert_eq!(vocab_size(), 111);
        let unique: std::collections::HashSet<u32> = characters()
            .iter()
            .map(|c| c.to_string())
            .chain(SPECIALS.iter().chain(WORDS.iter()).map(|s| s.to_string()))
            .map(|t| token_id(&t).unwrap())
            .collect();
        assert_eq!(unique.len(), vocab_size());
        assert_eq!((id("\n"), id(" "), id("~")), (0, 1, 95));
        assert_eq!((id(UNK), id(IM_END), id("\"expression\"")), (96, 99, 105));
    }

    /// Levels have the sizes the docs give; train and eval share nothing; each level's
    /// split is big enough for the default sizes; the list is a function of the seed.
    #[test]
    fn problems_are_split_and_seeded() {
        assert_eq!(kind_prompts(Level::Easy).len(), 261);
        assert_eq!(kind_prompts(Level::Medium).len(), 8100);
        assert_eq!(kind_prompts(Level::Hard).len(), 8100);
        let train = problems(Split::Train, 1, 192).unwrap();
        let eval = problems(Split::Eval, 1, 64).unwrap();
        assert_eq!(problems(Split::Train, 1, 192).unwrap(), train);
        assert_ne!(problems(Split::Train, 2, 192).unwrap(), train);
        let seen: std::collections::HashSet<&str> =
            train.iter().map(|p| p.prompt.as_str()).collect();
        assert!(eval.iter().all(|p| !seen.contains(p.prompt.as_str())));
        assert_eq!(train[2].level, Level::Hard);
        assert!(train[2].prompt.contains('*'));
        let e = problems(Split::Eval, 1, 100).unwrap_err().to_string();
        assert!(e.contains("easy"), "{e}");
    }

    /// A call trace parses as the rollout parses the model's turn, and the calculator's
    /// answer is the problem's; the rate of calls per level is near [`CALL_RATE`].
    #[test]
    fn traces_call_as_the_rollout_parses() {
        let p = Problem::new("12*34", Level::Hard).unwrap();
        let t = trace(&p, true).unwrap();
        let call = t[0]["content"].as_str().unwrap();
        assert_eq!(
            call,
            r#"<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>"#
        );
        let turn = parse_turn(call, ToolCallFormat::Hermes);
        let mut tools = ToolBox::default();
        tools.add(Box::new(crate::tools::Calculator)).unwrap();
        assert!(matches!(turn.calls[0], ParsedCall::Call(_)));
        assert_eq!(tools.run(&turn.calls[0], None).content, "408");
        assert_eq!(t[1]["content"], "408");
        assert_eq!(t[2]["content"], "\\boxed{408}");
        assert_eq!(trace(&p, false).unwrap(), vec![t[2].clone()]);
        let rows = sft_traces(1, 3000).unwrap();
        for (l, level) in Level::ALL.iter().enumerate() {
            let of: Vec<&(String, Vec<Value>)> = rows
                .iter()
                .filter(|(p, _)| kind_prompts(*level).contains(p))
                .collect();
            let calls = of.iter().filter(|(_, t)| t.len() == 3).count();
            let rate = calls as f64 / of.len() as f64;
            assert!((rate - CALL_RATE[l]).abs() < 0.06, "{level}: {rate}");
            assert!(of.iter().all(|(p, _)| Split::of(p) == Split::Train));
        }
    }

    /// The written tokenizer and template: a call is 27 tokens and decodes back with its
    /// words kept when special tokens are skipped; other characters become `<unk>`; the
    /// template names the tools, renders tool turns and shows the Hermes format.
    #[test]
    fn tokenizer_and_template_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        write_files(dir.path(), build_tokenizer, &tokenizer_config()).unwrap();
        let tok = HfTokenizer::from_dir(dir.path()).unwrap();
        let call = call_text("12*34");
        let ids = tok.encode(&call, false).unwrap();
        assert_eq!(ids.len(), 27);
        assert_eq!(tok.decode(&ids, true).unwrap(), call);
        let ids = tok.encode("é<|im_end|>", false).unwrap();
        assert_eq!(ids, vec![id(UNK), id(IM_END)]);
        let t = ChatTemplate::from_source(CHAT_TEMPLATE, SpecialTokens::default()).unwrap();
        assert_eq!(
            ToolCallFormat::of_template(CHAT_TEMPLATE),
            Some(ToolCallFormat::Hermes)
        );
        let schemas = vec![crate::tools::Tool::schema(&crate::tools::Calculator)];
        let out = t
            .render(
                &[json!({"role": "user", "content": "12*34"})],
                &RenderOptions {
                    tools: Some(&schemas),
                    ..RenderOptions::generation()
                },
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\ntools: calculator<|im_end|>\n<|im_start|>user\n12*34<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let out = t
            .render(
                &[json!({"role": "tool", "content": "408"})],
                &RenderOptions::default(),
            )
            .unwrap();
        assert_eq!(out, "<|im_start|>tool\n408<|im_end|>\n");
        let cfg = tokenizer_config();
        assert_eq!(cfg["added_tokens_decoder"]["100"]["special"], false);
        assert_eq!(cfg["added_tokens_decoder"]["99"]["content"], IM_END);
    }
}
