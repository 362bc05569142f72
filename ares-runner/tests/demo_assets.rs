//! The demo's assets through the runner's own loaders: the model directory loads as a
//! checkpoint, a model, a tokenizer and a chat template; every text of the datasets
//! round-trips through the tokenizer; train and eval share no prompt; the same seed gives the
//! same files.

use std::collections::HashSet;
use std::path::Path;

use ares_runner::backend::cpu::CpuBackend;
use ares_runner::demo::model::TinyModelSpec;
use ares_runner::demo::task::{self, MAX_PROMPT_CHARS, MAX_RESPONSE_CHARS, Split};
use ares_runner::demo::tokenizer::{self, CHARS, IM_END, VOCAB_SIZE};
use ares_runner::demo::{DemoAssets, DemoOptions, write_demo_assets, write_demo_assets_with};
use ares_runner::hf::chat::{ChatMessage, ChatTemplate, RenderOptions};
use ares_runner::hf::checkpoint::Checkpoint;
use ares_runner::hf::tokenizer::Tokenizer;
use ares_runner::model::{GenerateRequest, Inputs, Model, Sampling};
use serde_json::Value;

fn rows(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn small(seed: u64) -> DemoOptions {
    DemoOptions {
        seed,
        train_per_level: 40,
        eval_per_level: 20,
        sft_examples: 300,
        ..DemoOptions::default()
    }
}

#[test]
fn model_dir_loads_and_gives_finite_logits() {
    let dir = tempfile::tempdir().unwrap();
    let assets = write_demo_assets_with(dir.path(), &small(3)).unwrap();
    let ckpt = Checkpoint::load(&assets.model_dir).unwrap();
    let spec = TinyModelSpec::default();
    assert_eq!(ckpt.config.vocab_size, VOCAB_SIZE);
    assert_eq!(ckpt.config.hidden_size, spec.hidden);
    assert_eq!(ckpt.config.num_hidden_layers, spec.layers);
    assert!(ckpt.config.qkv_bias && ckpt.config.tie_word_embeddings);
    let model = Model::from_checkpoint(CpuBackend, &ckpt).unwrap();

    let tok = Tokenizer::from_dir(&assets.model_dir).unwrap();
    let chat = ChatTemplate::from_dir(&assets.model_dir).unwrap();
    let text = chat
        .render(
            &[ChatMessage::user("(3+4)*5")],
            &RenderOptions::generation(),
        )
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\n(3+4)*5<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&text, false).unwrap();
    // 3 special tokens + "user\n" + the 7 characters of the prompt + "\n" + "assistant\n".
    assert_eq!(ids.len(), 3 + 5 + 7 + 1 + 10);
    let seq = ids.len();
    let mask = vec![1u32; seq];
    let positions: Vec<u32> = (0..seq as u32).collect();
    let logits = model
        .forward_logits(&Inputs {
            batch: 1,
            seq,
            input_ids: &ids,
            attention_mask: &mask,
            position_ids: &positions,
        })
        .unwrap();
    assert_eq!(logits.len(), seq * VOCAB_SIZE);
    assert!(logits.iter().all(|x| x.is_finite()));
    // The final RMSNorm output has unit RMS and the tied head rows σ = 0.02, so the logits'
    // spread is about 0.02·√128 ≈ 0.23: a near-uniform start.
    let n = logits.len() as f64;
    let mean = logits.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let sd = (logits
        .iter()
        .map(|&x| (f64::from(x) - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    assert!((0.15..0.35).contains(&sd), "logit sd {sd}");

    let gen_eos = ckpt
        .generation
        .as_ref()
        .unwrap()
        .eos_token_ids
        .clone()
        .unwrap();
    let eos = tok.eos_ids(&gen_eos);
    assert_eq!(eos, [tok.token_to_id(IM_END).unwrap()]);
    let out = model
        .generate(&GenerateRequest {
            prompts: vec![ids.clone(), ids],
            max_new_tokens: 8,
            eos_ids: eos,
            sampling: Sampling::Sample {
                temperature: 1.0,
                top_k: None,
                top_p: 1.0,
                min_p: 0.0,
            },
            seed: 1,
        })
        .unwrap();
    for t in &out.tokens {
        assert!(!t.is_empty() && t.len() <= 8);
        assert!(t.iter().all(|&id| (id as usize) < VOCAB_SIZE));
    }
}

#[test]
fn tokenizer_round_trips_every_character_and_dataset_text() {
    let dir = tempfile::tempdir().unwrap();
    let assets = write_demo_assets_with(dir.path(), &small(4)).unwrap();
    let tok = Tokenizer::from_dir(&assets.model_dir).unwrap();
    assert_eq!(tok.vocab_size(), VOCAB_SIZE);
    let ids = tokenizer::special_ids();
    assert_eq!(tok.eos_id(), Some(ids.im_end));
    assert_eq!(tok.pad_id(), Some(ids.endoftext));
    assert_eq!(tok.bos_id(), None);
    for (i, ch) in CHARS.chars().enumerate() {
        let s = ch.to_string();
        assert_eq!(tok.encode(&s, false).unwrap(), [i as u32], "{ch:?}");
        assert_eq!(tok.decode(&[i as u32], false).unwrap(), s, "{ch:?}");
    }
    // Every text the demo trains or evaluates on: one id per character, exact round trip.
    let mut texts: Vec<String> = Vec::new();
    for path in [&assets.train, &assets.eval] {
        for row in rows(path) {
            texts.push(row["prompt"].as_str().unwrap().to_string());
            texts.push(format!("\\boxed{{{}}}", row["answer"].as_str().unwrap()));
        }
    }
    for row in rows(&assets.sft) {
        texts.push(row["prompt"].as_str().unwrap().to_string());
        texts.push(row["response"].as_str().unwrap().to_string());
    }
    for text in &texts {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids.len(), text.chars().count(), "{text:?}");
        assert_eq!(&tok.decode(&ids, false).unwrap(), text);
    }
    // Special tokens are single ids and are dropped by skip_special_tokens.
    let with_eos = format!("1+2=3{IM_END}");
    let ids_eos = tok.encode(&with_eos, false).unwrap();
    assert_eq!(ids_eos.len(), 6);
    assert_eq!(*ids_eos.last().unwrap(), ids.im_end);
    assert_eq!(tok.decode(&ids_eos, false).unwrap(), with_eos);
    assert_eq!(tok.decode(&ids_eos, true).unwrap(), "1+2=3");
    // Capitals are lower-cased; a character outside the vocabulary is an error, not <unk>.
    assert_eq!(
        tok.encode("Check", false).unwrap(),
        tok.encode("check", false).unwrap()
    );
    assert!(tok.encode("1 # 2", false).is_err());
}

#[test]
fn datasets_have_the_documented_rows_and_no_overlap() {
    let dir = tempfile::tempdir().unwrap();
    let assets = write_demo_assets_with(dir.path(), &small(5)).unwrap();
    assert_eq!(
        assets,
        DemoAssets {
            root: dir.path().to_path_buf(),
            model_dir: dir.path().join("model"),
            train: dir.path().join("data/train.jsonl"),
            eval: dir.path().join("data/eval.jsonl"),
            sft: dir.path().join("data/sft.jsonl"),
        }
    );
    let train = rows(&assets.train);
    let eval = rows(&assets.eval);
    assert_eq!(train.len(), 120);
    assert_eq!(eval.len(), 60);
    let prompts = |rows: &[Value]| -> HashSet<String> {
        rows.iter()
            .map(|r| r["prompt"].as_str().unwrap().to_string())
            .collect()
    };
    let (train_prompts, eval_prompts) = (prompts(&train), prompts(&eval));
    assert_eq!(train_prompts.len(), train.len());
    assert_eq!(eval_prompts.len(), eval.len());
    assert!(train_prompts.is_disjoint(&eval_prompts));
    for row in train.iter().chain(&eval) {
        let keys: Vec<&str> = row
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys, ["prompt", "answer", "difficulty", "global_id"]);
        let prompt = row["prompt"].as_str().unwrap();
        assert!(prompt.len() <= MAX_PROMPT_CHARS);
        let answer: u64 = row["answer"].as_str().unwrap().parse().unwrap();
        assert!(answer > 0);
        let level = row["difficulty"].as_str().unwrap();
        assert!(["easy", "medium", "hard"].contains(&level));
        assert_eq!(row["global_id"], format!("{level}:{prompt}"));
    }
    // Held-out prompts never reach SFT either; responses end with the right boxed answer.
    for row in rows(&assets.sft) {
        let prompt = row["prompt"].as_str().unwrap();
        let response = row["response"].as_str().unwrap();
        assert_eq!(Split::of(prompt), Split::Train);
        assert!(!eval_prompts.contains(prompt));
        assert!(response.len() <= MAX_RESPONSE_CHARS);
        assert!(response.ends_with('}') && response.contains("\\boxed{"));
    }
    // Larger draws with other seeds stay disjoint too.
    let train = task::problems(Split::Train, 11, 190).unwrap();
    let eval = task::problems(Split::Eval, 12, 60).unwrap();
    let train: HashSet<&str> = train.iter().map(|p| p.prompt.as_str()).collect();
    assert!(eval.iter().all(|p| !train.contains(p.prompt.as_str())));
}

#[test]
fn same_seed_same_files_and_sizes_are_checked_first() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = (
        write_demo_assets_with(a.path(), &small(6)).unwrap(),
        write_demo_assets_with(b.path(), &small(6)).unwrap(),
    );
    for name in [
        "model/config.json",
        "model/model.safetensors",
        "model/generation_config.json",
        "model/tokenizer.json",
        "model/tokenizer_config.json",
        "data/train.jsonl",
        "data/eval.jsonl",
        "data/sft.jsonl",
    ] {
        let read = |root: &Path| std::fs::read(root.join(name)).unwrap();
        assert_eq!(read(&a.root), read(&b.root), "{name}");
    }
    // Too many eval problems: an error naming the level and split, and nothing written.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("demo");
    let err = write_demo_assets_with(
        &root,
        &DemoOptions {
            eval_per_level: 1000,
            ..small(6)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("easy") && err.contains("eval"), "{err}");
    assert!(!root.exists());
}

#[test]
fn default_assets_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let assets = write_demo_assets(dir.path(), 1).unwrap();
    let opts = DemoOptions::default();
    assert_eq!(rows(&assets.train).len(), 3 * opts.train_per_level);
    assert_eq!(rows(&assets.eval).len(), 3 * opts.eval_per_level);
    assert_eq!(rows(&assets.sft).len(), opts.sft_examples);
}

#[test]
fn padded_vocabulary_and_the_benchmark_shape() {
    // More embedding rows than the tokenizer has ids (as Qwen pads its vocabulary).
    let dir = tempfile::tempdir().unwrap();
    let assets = write_demo_assets_with(
        dir.path(),
        &DemoOptions {
            vocab_size: 1000,
            ..small(4)
        },
    )
    .unwrap();
    let ckpt = Checkpoint::load(&assets.model_dir).unwrap();
    assert_eq!(ckpt.config.vocab_size, 1000);
    let tok = Tokenizer::from_dir(&assets.model_dir).unwrap();
    assert_eq!(tok.vocab_size(), VOCAB_SIZE);
    Model::from_checkpoint(CpuBackend, &ckpt).unwrap();

    // Fewer rows than tokenizer ids: an error naming the field, nothing written.
    let root = dir.path().join("too-small");
    let err = write_demo_assets_with(
        &root,
        &DemoOptions {
            vocab_size: VOCAB_SIZE - 1,
            ..small(4)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("vocab_size") && err.contains("58"), "{err}");
    assert!(!root.exists());

    // Qwen2.5-0.5B's shape: 494.0 M parameters with its 151 936-row vocabulary, as
    // transformers counts them (tied embeddings counted once).
    let qwen = TinyModelSpec::qwen2_5_0_5b();
    qwen.validate().unwrap();
    assert_eq!(qwen.parameter_count(151_936), 494_032_768);
}
