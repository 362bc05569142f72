//! `ares-runner generate` through its library function: greedy ids against transformers'
//! (the tiny model fixtures of ares-model, with a word-level tokenizer of their 97 ids),
//! generation defaults, streamed text, prompt files, and the errors a user can act on.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use clap::Parser;
use serde_json::{Value, json};

use ares_runner::commands::generate::{Completion, FinishReason, GenerateArgs, generate};

/// The tiny Hugging Face models of ares-model, with `greedy.json`.
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../ares-model/tests/fixtures/models")
        .join(name)
}

/// A copy of fixture `name`'s model files with a word-level `tokenizer.json` whose token
/// `t<i>` is id `i` (split on whitespace, decoded joined by spaces): prompt text
/// `"t5 t17"` is ids `[5, 17]`.
fn with_id_tokenizer(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture(name);
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_str().unwrap().to_string();
        let model_file = file == "config.json"
            || file == "generation_config.json"
            || file == "model.safetensors.index.json"
            || (file.starts_with("model") && file.ends_with(".safetensors"));
        if model_file {
            std::fs::copy(&path, dir.path().join(&file)).unwrap();
        }
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let vocab: serde_json::Map<String, Value> = (0..config["vocab_size"].as_u64().unwrap())
        .map(|i| (format!("t{i}"), json!(i)))
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    });
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    dir
}

/// The demo's random tiny model with its character tokenizer and ChatML template.
fn demo_model() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let options = ares_runner::demo::DemoOptions {
            train_per_level: 1,
            eval_per_level: 1,
            sft_examples: 1,
            ..Default::default()
        };
        let assets = ares_runner::demo::write_demo_assets_with(dir.path(), &options).unwrap();
        (dir, assets.model_dir)
    })
    .1
}

fn args(model: &Path, rest: &[&str]) -> GenerateArgs {
    let mut argv = vec![
        "generate".to_string(),
        "-m".into(),
        model.display().to_string(),
    ];
    argv.extend(rest.iter().map(|s| s.to_string()));
    GenerateArgs::try_parse_from(argv).unwrap()
}

/// Runs generate; returns the completions and what it wrote.
fn run(model: &Path, rest: &[&str]) -> (Vec<Completion>, String) {
    let mut out = Vec::new();
    let completions = generate(&args(model, rest), &mut out).unwrap();
    (completions, String::from_utf8(out).unwrap())
}

/// The error message of a run that must fail.
fn error(model: &Path, rest: &[&str]) -> String {
    match generate(&args(model, rest), &mut Vec::new()) {
        Ok(c) => panic!("expected an error, got {c:?}"),
        Err(e) => e.to_string(),
    }
}

fn text_of(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| format!("t{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn greedy_json_reproduces_transformers_token_ids() {
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let greedy: Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("greedy.json")).unwrap(),
        )
        .unwrap();
        let prompts: Vec<Vec<u32>> = serde_json::from_value(greedy["prompts"].clone()).unwrap();
        let expected: Vec<Vec<u32>> = serde_json::from_value(greedy["one_by_one"].clone()).unwrap();
        let dir = with_id_tokenizer(name);
        let texts: Vec<String> = prompts.iter().map(|p| text_of(p)).collect();
        let mut rest = vec![
            "--no-chat-template",
            "--greedy",
            "--json",
            "--max-new-tokens",
            "8",
        ];
        for t in &texts {
            rest.extend(["--prompt", t.as_str()]);
        }
        let (completions, out) = run(dir.path(), &rest);
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), prompts.len(), "{name}: {out}");
        for (i, (line, c)) in lines.iter().zip(&completions).enumerate() {
            assert_eq!(line["prompt_index"], json!(i));
            assert_eq!(line["input_ids"], json!(prompts[i]), "{name} prompt {i}");
            assert_eq!(line["token_ids"], json!(expected[i]), "{name} prompt {i}");
            assert_eq!(line["finish_reason"], json!("length"), "{name} prompt {i}");
            assert_eq!(
                line["text"],
                json!(text_of(&expected[i])),
                "{name} prompt {i}"
            );
            assert_eq!(line, &serde_json::to_value(c).unwrap());
            let keys: Vec<&str> = line
                .as_object()
                .unwrap()
                .keys()
                .map(String::as_str)
                .collect();
            assert_eq!(
                keys,
                [
                    "prompt_index",
                    "text",
                    "token_ids",
                    "input_ids",
                    "finish_reason"
                ]
            );
        }
    }
}

/// `--weight-dtype bf16` decodes with bf16 weights: qwen3_tiny's weights are bf16 values
/// already, so its greedy ids stay transformers'; llama_tiny's are rounded (ids may differ).
#[test]
fn bf16_decode_weights_from_the_command_line() {
    for (name, same) in [("qwen3_tiny", true), ("llama_tiny", false)] {
        let greedy: Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("greedy.json")).unwrap(),
        )
        .unwrap();
        let prompts: Vec<Vec<u32>> = serde_json::from_value(greedy["prompts"].clone()).unwrap();
        let expected: Vec<Vec<u32>> = serde_json::from_value(greedy["one_by_one"].clone()).unwrap();
        let dir = with_id_tokenizer(name);
        let text = text_of(&prompts[0]);
        let base = [
            "--no-chat-template",
            "--greedy",
            "--json",
            "--max-new-tokens",
            "8",
            "--prompt",
        ];
        let mut f32_args = base.to_vec();
        f32_args.push(&text);
        let mut bf16_args = f32_args.clone();
        bf16_args.extend(["--weight-dtype", "bf16"]);
        let (f32_out, _) = run(dir.path(), &f32_args);
        let (bf16_out, _) = run(dir.path(), &bf16_args);
        assert_eq!(f32_out[0].token_ids, expected[0], "{name}");
        if same {
            assert_eq!(bf16_out[0].token_ids, expected[0], "{name}");
        }
        assert_eq!(bf16_out[0].token_ids.len(), 8, "{name}");
    }
}

/// `--kv-cache-dtype bf16` generates as many tokens with the cache in bf16 (its first
/// token comes from the prompt's f32 prefill, so it is the f32 cache's).
#[test]
fn bf16_kv_cache_from_the_command_line() {
    let dir = with_id_tokenizer("llama_tiny");
    let text = text_of(&[5, 17, 42, 8, 91, 33, 60]);
    let mut args = vec![
        "--no-chat-template",
        "--greedy",
        "--json",
        "--max-new-tokens",
        "8",
        "--prompt",
        &text,
    ];
    let (f32_out, _) = run(dir.path(), &args);
    args.extend(["--kv-cache-dtype", "bf16"]);
    let (bf16_out, _) = run(dir.path(), &args);
    assert_eq!(bf16_out[0].token_ids.len(), 8);
    assert_eq!(bf16_out[0].token_ids[0], f32_out[0].token_ids[0]);
}

/// `ARES_PROFILE=1` prints the time of every op, summed per op, after the completions, and
/// nothing without it (child processes: the setting is read once a process).
#[test]
fn ares_profile_prints_op_times() {
    let dir = with_id_tokenizer("llama_tiny");
    let prompt = text_of(&[5, 17, 42, 8]);
    let stderr = |profile: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ares-runner"));
        cmd.args(["generate", "-m"]).arg(dir.path()).args([
            "--no-chat-template",
            "--greedy",
            "--max-new-tokens",
            "4",
            "--prompt",
            &prompt,
        ]);
        cmd.env_remove("ARES_PROFILE");
        if let Some(p) = profile {
            cmd.env("ARES_PROFILE", p);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        err
    };
    let err = stderr(Some("1"));
    assert!(err.contains("op times (CPU, ARES_PROFILE):"), "{err}");
    for op in [
        "linear_decode_f32",
        "paged_attention_decode",
        "rmsnorm",
        "download",
    ] {
        let row = err
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{op} ")));
        assert!(row.is_some_and(|r| r.ends_with('%')), "{op}: {err}");
    }
    assert!(!stderr(None).contains("op times"));
    assert!(!stderr(Some("0")).contains("op times"));
}

#[test]
fn generation_config_decides_greedy_or_sampling_and_flags_override_it() {
    // llama_tiny's generation_config.json has no do_sample: greedy, as transformers
    let dir = with_id_tokenizer("llama_tiny");
    let prompt = text_of(&[5, 17, 42, 8, 91, 33, 60]);
    let base = [
        "--no-chat-template",
        "--json",
        "--max-new-tokens",
        "8",
        "--prompt",
    ];
    let mut plain = base.to_vec();
    plain.push(&prompt);
    let (c, _) = run(dir.path(), &plain);
    assert_eq!(c[0].token_ids, [87, 96, 47, 83, 69, 79, 23, 26]);

    // qwen3_tiny's has no do_sample either; a sampling flag turns sampling on
    let dir = with_id_tokenizer("qwen3_tiny");
    let (greedy, _) = run(dir.path(), &plain);
    let mut hot = plain.clone();
    hot.extend(["--temperature", "50", "--top-k", "0"]);
    let (hot1, _) = run(dir.path(), &hot);
    let (hot2, _) = run(dir.path(), &hot);
    assert_eq!(hot1, hot2, "same seed, same samples");
    assert_ne!(hot1[0].token_ids, greedy[0].token_ids);
    hot.extend(["--seed", "7"]);
    let (hot3, _) = run(dir.path(), &hot);
    assert_ne!(hot3[0].token_ids, hot1[0].token_ids, "another seed");

    // qwen2_tiny's samples (do_sample: true, temperature 0.7, top_k 20, top_p 0.8): no flag
    // is the same as those flags, and --greedy overrides it
    let dir = with_id_tokenizer("qwen2_tiny");
    let (defaults, _) = run(dir.path(), &plain);
    let mut explicit = plain.clone();
    explicit.extend(["--temperature", "0.7", "--top-k", "20", "--top-p", "0.8"]);
    let (flags, _) = run(dir.path(), &explicit);
    assert_eq!(defaults, flags);
    let mut greedy = plain.clone();
    greedy.push("--greedy");
    let (greedy, _) = run(dir.path(), &greedy);
    assert_eq!(greedy[0].token_ids, [60; 8]);
    // generation_config.json's max_new_tokens (32) is the default limit; the model has 64
    // positions, so a 7-token prompt gets all 32
    let (c, _) = run(
        dir.path(),
        &[
            "--no-chat-template",
            "--json",
            "--greedy",
            "--prompt",
            &prompt,
        ],
    );
    assert_eq!(c[0].token_ids.len(), 32);
    // without --max-new-tokens a long prompt is capped at the model's positions
    let long = text_of(&[7; 50]);
    let (c, _) = run(
        dir.path(),
        &[
            "--no-chat-template",
            "--json",
            "--greedy",
            "--prompt",
            &long,
        ],
    );
    assert_eq!(
        (c[0].token_ids.len(), c[0].finish_reason),
        (14, FinishReason::Length)
    );
}

#[test]
fn identical_prompts_sample_from_different_streams() {
    let dir = with_id_tokenizer("qwen3_tiny");
    let p = text_of(&[12, 3]);
    let (c, _) = run(
        dir.path(),
        &[
            "--no-chat-template",
            "--json",
            "--temperature",
            "50",
            "--top-k",
            "0",
            "--max-new-tokens",
            "8",
            "--prompt",
            &p,
            "--prompt",
            &p,
        ],
    );
    assert_eq!(c[0].input_ids, c[1].input_ids);
    assert_ne!(c[0].token_ids, c[1].token_ids);
}

#[test]
fn chat_prompts_from_flags_and_files_render_alike_and_stream_the_json_text() {
    let model = demo_model();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompts.jsonl");
    std::fs::write(
        &file,
        "{\"prompt\": \"what is 2+3?\"}\n\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"what is 2+3?\"}], \"id\": 4}\n\
         {\"messages\": [{\"role\": \"system\", \"content\": \"be brief.\"}, \
         {\"role\": \"user\", \"content\": \"1+1\"}]}\n",
    )
    .unwrap();
    let file = file.display().to_string();
    let common = ["--greedy", "--max-new-tokens", "12"];
    let mut json = common.to_vec();
    json.extend(["--json", "--prompts", &file]);
    let (from_file, out) = run(model, &json);
    assert_eq!(from_file.len(), 3);
    assert_eq!(out.lines().count(), 3);
    // the ChatML template with the generation prompt, through the tokenizer
    let tok = ares_runner::hf::tokenizer::Tokenizer::from_dir(model).unwrap();
    let rendered = "<|im_start|>user\nwhat is 2+3?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(from_file[0].input_ids, tok.encode(rendered, false).unwrap());
    assert_eq!(from_file[1].input_ids, from_file[0].input_ids);
    let system = "<|im_start|>system\nbe brief.<|im_end|>\n<|im_start|>user\n1+1<|im_end|>\n\
                  <|im_start|>assistant\n";
    assert_eq!(from_file[2].input_ids, tok.encode(system, false).unwrap());

    let mut flags = common.to_vec();
    flags.extend(["--prompt", "what is 2+3?", "--prompt", "1+1"]);
    let (streamed, text) = run(model, &flags);
    assert_eq!(streamed[0], from_file[0]);
    // streamed text is the completions' text, one per line
    let expected: String = streamed.iter().map(|c| format!("{}\n", c.text)).collect();
    assert_eq!(text, expected);
    for c in &streamed {
        assert_eq!(c.text, tok.decode(&c.token_ids, true).unwrap());
        assert_eq!(
            c.finish_reason == FinishReason::Eos,
            c.token_ids.last() == Some(&58)
        );
    }

    // --no-chat-template: the text as is
    let (raw, _) = run(
        model,
        &[
            "--greedy",
            "--max-new-tokens",
            "4",
            "--no-chat-template",
            "--prompt",
            "1+1=",
        ],
    );
    assert_eq!(raw[0].input_ids, tok.encode("1+1=", true).unwrap());
}

#[test]
fn errors_name_what_to_fix() {
    let model = demo_model();
    let tmp = tempfile::tempdir().unwrap();

    let e = error(&tmp.path().join("nope"), &["--prompt", "x"]);
    assert!(e.contains("does not exist"), "{e}");
    let e = error(tmp.path(), &["--prompt", "x"]);
    assert!(e.contains("has no config.json"), "{e}");
    let e = error(&fixture("qwen2_tiny"), &["--prompt", "x"]);
    assert!(e.contains("has no tokenizer.json"), "{e}");
    let e = error(model, &[]);
    assert!(e.contains("no prompt: give --prompt TEXT"), "{e}");
    let e = error(model, &["--prompt", "x", "--image", "cat.png"]);
    assert!(
        e.contains("(model_type qwen2) takes no images") && e.contains("cat.png"),
        "{e}"
    );
    let e = error(model, &["--prompt", "x", "--video", "cat.mp4"]);
    assert!(e.contains("takes no videos"), "{e}");
    let e = error(model, &["--prompt", "x", "--top-p", "0"]);
    assert!(e.contains("--top-p 0: must be in (0, 1]"), "{e}");
    let e = error(model, &["--prompt", "x", "--temperature=-1"]);
    assert!(e.contains("--temperature -1: must be >= 0"), "{e}");
    let e = error(model, &["--prompt", "x", "--cuda-graphs"]);
    assert!(
        e.contains("--cuda-graphs needs --device cuda or auto"),
        "{e}"
    );
    let e = error(model, &["--prompt", "x", "--max-new-tokens", "600"]);
    assert!(
        e.contains("--max-new-tokens 600 exceed the model's context of 512 tokens")
            && e.contains("use --max-new-tokens 492 or less"),
        "{e}"
    );
    let long = "1".repeat(600);
    let e = error(model, &["--prompt", &long]);
    assert!(
        e.contains("--prompt 1: the prompt has") && e.contains("shorten it"),
        "{e}"
    );
    let e = error(model, &["--no-chat-template", "--prompt", ""]);
    assert!(e.contains("--prompt 1: the prompt has no tokens"), "{e}");

    // a model without a chat template
    let bare = tmp.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ] {
        std::fs::copy(model.join(f), bare.join(f)).unwrap();
    }
    let e = error(&bare, &["--prompt", "x"]);
    assert!(
        e.contains("has no chat template") && e.contains("--no-chat-template"),
        "{e}"
    );

    // --greedy with a sampling flag: clap refuses it, and so does the library
    let err = GenerateArgs::try_parse_from([
        "generate", "-m", "m", "--prompt", "x", "--greedy", "--top-k", "3",
    ])
    .unwrap_err();
    assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
    let mut a = args(model, &["--prompt", "x", "--greedy"]);
    a.temperature = Some(0.5);
    let e = generate(&a, &mut Vec::new()).unwrap_err().to_string();
    assert!(e.contains("--greedy conflicts with --temperature"), "{e}");
    let err =
        GenerateArgs::try_parse_from(["generate", "-m", "m", "--prompt", "x", "--prompts", "f"])
            .unwrap_err();
    assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
}

#[test]
fn prompt_file_errors_name_the_line() {
    let model = demo_model();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("p.jsonl");
    let check = |body: &str, rest: &[&str], want: &[&str]| {
        std::fs::write(&file, body).unwrap();
        let mut a = vec!["--prompts", file.to_str().unwrap()];
        a.extend(rest);
        let e = error(model, &a);
        for w in want {
            assert!(e.contains(w), "{body:?}: {e:?} lacks {w:?}");
        }
    };
    let ok = "{\"prompt\": \"1+1\"}\n";
    check(
        &format!("{ok}{{\"prompt\": \"x\"\n"),
        &[],
        &["p.jsonl line 2: not JSON", "{\"messages\""],
    );
    check(
        &format!("{ok}\n[1, 2]\n"),
        &[],
        &["line 3: not a JSON object"],
    );
    check(
        &format!("{ok}{{\"text\": \"x\"}}\n"),
        &[],
        &["line 2: no `messages` or `prompt`"],
    );
    check(
        "{\"prompt\": \"x\", \"messages\": []}\n",
        &[],
        &["line 1: has both `messages` and `prompt`"],
    );
    check(
        "{\"messages\": [{\"content\": \"x\"}]}\n",
        &[],
        &["line 1: `messages[0]` must be an object with a string \"role\""],
    );
    check(
        "{\"messages\": []}\n",
        &[],
        &["line 1: `messages` must be a non-empty list"],
    );
    check(
        "{\"prompt\": 3}\n",
        &[],
        &["line 1: `prompt` must be a string"],
    );
    check(
        "{\"prompt\": \"x\", \"images\": \"a.png\"}\n",
        &[],
        &["line 1: `images` must be a list of paths"],
    );
    check(
        &format!("{ok}{ok}{{\"prompt\": \"x\", \"images\": [\"a.png\"]}}\n"),
        &[],
        &[
            "(model_type qwen2) takes no images (",
            "p.jsonl line 3: ",
            "a.png",
        ],
    );
    check("\n\n", &[], &["p.jsonl: no prompts in the file"]);
    check(
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n",
        &["--no-chat-template"],
        &["line 1: a conversation (\"messages\") needs the chat template"],
    );
    check(
        "{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}\n",
        &[],
        &["line 1: ", "the chat template raised an exception"],
    );
    let e = error(
        model,
        &[
            "--prompts",
            tmp.path().join("missing.jsonl").to_str().unwrap(),
        ],
    );
    assert!(e.contains("missing.jsonl"), "{e}");
}

/// The vision-language fixtures of ares-model: `qwen2_vl_tiny`, `qwen2_5_vl_tiny`,
/// `images/`, `cases.json`.
fn vl_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ares-model/tests/fixtures/vl")
}

const VL_MODELS: [&str; 2] = ["qwen2_vl_tiny", "qwen2_5_vl_tiny"];

fn vl_cases() -> Value {
    serde_json::from_slice(&std::fs::read(vl_root().join("cases.json")).unwrap()).unwrap()
}

/// transformers' `<case>.input_ids` (i64, placeholders expanded) of a VL fixture model.
fn vl_input_ids(model: &str, case: &str) -> Vec<u32> {
    let bytes = std::fs::read(vl_root().join(model).join("expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(&format!("{case}.input_ids")).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::I64);
    t.data()
        .chunks_exact(8)
        .map(|b| u32::try_from(i64::from_le_bytes(b.try_into().unwrap())).unwrap())
        .collect()
}

/// `cases.json`'s greedy ids of `case` for `model`.
fn vl_greedy(cases: &Value, case: &str, model: &str) -> Vec<u32> {
    serde_json::from_value(cases["cases"][case][model]["greedy"].clone()).unwrap()
}

const GREEDY_8: [&str; 4] = ["--greedy", "--json", "--max-new-tokens", "8"];

#[test]
fn vision_language_models_reproduce_transformers_greedy_ids() {
    let cases = vl_cases();
    let image = vl_root().join("images/image_56x84.png");
    let image = image.to_str().unwrap();
    // a prompt file beside a copy of the images, with paths relative to it
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir(tmp.path().join("pics")).unwrap();
    for f in ["image_56x84.png", "two_a_70x45.png", "two_b_100x80.png"] {
        std::fs::copy(
            vl_root().join("images").join(f),
            tmp.path().join("pics").join(f),
        )
        .unwrap();
    }
    let line = |case: &str, extra: Value| {
        let mut v = json!({"messages": cases["cases"][case]["messages"]});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        v.to_string()
    };
    let file = tmp.path().join("prompts.jsonl");
    std::fs::write(
        &file,
        [
            line(
                "two_images",
                json!({"images": ["pics/two_a_70x45.png", "pics/two_b_100x80.png"]}),
            ),
            line("text", json!({})),
            json!({"prompt": "Describe this picture.", "images": ["pics/image_56x84.png"]})
                .to_string(),
            line("image", json!({"images": ["pics/image_56x84.png"]})),
        ]
        .join("\n"),
    )
    .unwrap();
    for model in VL_MODELS {
        let dir = vl_root().join(model);
        let mut rest = GREEDY_8.to_vec();
        rest.extend(["--prompt", "Describe this picture.", "--image", image]);
        let (c, out) = run(&dir, &rest);
        let line: Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(line, serde_json::to_value(&c[0]).unwrap());
        assert_eq!(c[0].token_ids, vl_greedy(&cases, "image", model), "{model}");
        assert_eq!(c[0].input_ids, vl_input_ids(model, "image"), "{model}");
        assert_eq!(
            json!(c[0].input_ids.len()),
            cases["cases"]["image"][model]["seq_len"]
        );
        assert_eq!(c[0].finish_reason, FinishReason::Length);

        let mut rest = GREEDY_8.to_vec();
        rest.extend(["--prompts", file.to_str().unwrap()]);
        let (c, _) = run(&dir, &rest);
        assert_eq!(c.len(), 4);
        for (i, case) in ["two_images", "text", "image", "image"]
            .into_iter()
            .enumerate()
        {
            assert_eq!(c[i].input_ids, vl_input_ids(model, case), "{model} {case}");
            assert_eq!(
                c[i].token_ids,
                vl_greedy(&cases, case, model),
                "{model} {case}"
            );
        }

        // the same text prompt from the command line; streamed text is the completion's
        let (c, text) = run(
            &dir,
            &[
                "--greedy",
                "--max-new-tokens",
                "8",
                "--prompt",
                "Tell me a story.",
            ],
        );
        assert_eq!(c[0].input_ids, vl_input_ids(model, "text"));
        assert_eq!(c[0].token_ids, vl_greedy(&cases, "text", model));
        assert_eq!(text, format!("{}\n", c[0].text));
    }
}

/// A video as a directory of frame images. The fixture's Qwen2.5-VL ids were made with the
/// frames' rate known (2.5 fps: `second_per_grid_ts` 0.8, temporal positions 0, 1); a
/// directory of frames has none, so without `--video-fps` generate's positions are 0, 2 (one
/// second per temporal patch) and only Qwen2-VL, whose positions ignore the rate, must match
/// transformers' ids; with `--video-fps 2.5` both do, and a bad rate is an error naming it.
#[test]
fn a_video_as_a_directory_of_frames() {
    let cases = vl_cases();
    let tmp = tempfile::tempdir().unwrap();
    let clip = tmp.path().join("clip");
    std::fs::create_dir(&clip).unwrap();
    for i in 0..4 {
        let f = format!("video_frame_{i}.png");
        std::fs::copy(vl_root().join("images").join(&f), clip.join(&f)).unwrap();
    }
    let mut rest = GREEDY_8.to_vec();
    rest.extend([
        "--prompt",
        "What happens here?",
        "--video",
        clip.to_str().unwrap(),
    ]);
    for model in VL_MODELS {
        let (c, _) = run(&vl_root().join(model), &rest);
        assert_eq!(c[0].input_ids, vl_input_ids(model, "video"), "{model}");
        if model == "qwen2_vl_tiny" {
            assert_eq!(c[0].token_ids, vl_greedy(&cases, "video", model));
        } else {
            assert_eq!(c[0].token_ids.len(), 8);
        }
        let mut with_fps = rest.clone();
        with_fps.extend(["--video-fps", "2.5"]);
        let (c, _) = run(&vl_root().join(model), &with_fps);
        assert_eq!(c[0].input_ids, vl_input_ids(model, "video"), "{model}");
        assert_eq!(
            c[0].token_ids,
            vl_greedy(&cases, "video", model),
            "{model} at 2.5 fps"
        );
    }
    let mut bad = rest.clone();
    bad.extend(["--video-fps", "0"]);
    let e = error(&vl_root().join("qwen2_5_vl_tiny"), &bad);
    assert!(e.contains("--video-fps 0"), "{e}");
}

#[test]
fn vision_language_errors_name_the_prompt_and_the_file() {
    let model = vl_root().join("qwen2_vl_tiny");
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope.png");
    let e = error(
        &model,
        &["--prompt", "x", "--image", missing.to_str().unwrap()],
    );
    assert!(
        e.contains("--prompt 1: image ") && e.contains("nope.png does not exist"),
        "{e}"
    );
    // random bytes named .png: not an image format at all
    let noise = tmp.path().join("noise.png");
    std::fs::write(
        &noise,
        (0..200u32)
            .map(|i| (i * 97 % 251) as u8)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let e = error(
        &model,
        &["--prompt", "x", "--image", noise.to_str().unwrap()],
    );
    assert!(
        e.contains("--prompt 1: ") && e.contains("noise.png: unsupported image format"),
        "{e}"
    );
    // a PNG cut short: corrupt
    let png = std::fs::read(vl_root().join("images/image_56x84.png")).unwrap();
    let cut = tmp.path().join("cut.png");
    std::fs::write(&cut, &png[..png.len() / 2]).unwrap();
    let e = error(&model, &["--prompt", "x", "--image", cut.to_str().unwrap()]);
    assert!(e.contains("cut.png: corrupt image"), "{e}");
    let e = error(
        &model,
        &[
            "--prompt",
            "x",
            "--video",
            tmp.path().join("clip").to_str().unwrap(),
        ],
    );
    assert!(
        e.contains("--prompt 1: video ") && e.contains("does not exist"),
        "{e}"
    );
    // a directory without frame images is no video
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = error(
        &model,
        &["--prompt", "x", "--video", empty.to_str().unwrap()],
    );
    assert!(e.contains("no frame images"), "{e}");
    let image = vl_root().join("images/image_56x84.png");
    let e = error(
        &model,
        &[
            "--no-chat-template",
            "--prompt",
            "x",
            "--image",
            image.to_str().unwrap(),
        ],
    );
    assert!(
        e.contains("--prompt 1: images and videos need the chat template")
            && e.contains("drop --no-chat-template"),
        "{e}"
    );

    // a line with more image items than images, or fewer
    let file = tmp.path().join("p.jsonl");
    let two_items = json!([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]);
    let image = image.to_str().unwrap();
    for (images, want) in [
        (
            json!([image]),
            "have 2 image content item(s) but the line gives 1 path(s)",
        ),
        (
            json!([image, image, image]),
            "have 2 image content item(s) but the line gives 3 path(s)",
        ),
    ] {
        std::fs::write(
            &file,
            format!(
                "{}\n{}\n",
                json!({"prompt": "ok"}),
                json!({"messages": two_items, "images": images})
            ),
        )
        .unwrap();
        let e = error(&model, &["--prompts", file.to_str().unwrap()]);
        assert!(
            e.contains("p.jsonl line 2: the messages ") && e.contains(want),
            "{e}"
        );
    }
    // video items without videos
    std::fs::write(
        &file,
        json!({"messages": [{"role": "user", "content": [{"type": "video"}]}]}).to_string(),
    )
    .unwrap();
    let e = error(&model, &["--prompts", file.to_str().unwrap()]);
    assert!(
        e.contains("line 1: the messages have 1 video content item(s) but the line gives 0"),
        "{e}"
    );

    // images in a prompt file are resolved against the file's directory
    std::fs::write(
        &file,
        "{\"prompt\": \"x\", \"images\": [\"img/a.png\", \"/abs/b.png\"]}\n",
    )
    .unwrap();
    let prompts = ares_runner::commands::generate::read_prompts_file(&file).unwrap();
    assert_eq!(
        prompts[0].images,
        [tmp.path().join("img/a.png"), PathBuf::from("/abs/b.png")]
    );
}

#[test]
fn streaming_hook_sees_every_new_token_in_order() {
    use ares_runner::backend::cpu::CpuBackend;
    use ares_runner::hf::checkpoint::Checkpoint;
    use ares_runner::model::{GenerateRequest, Model, Sampling};
    let ckpt = Checkpoint::load(&fixture("qwen3_tiny")).unwrap();
    let model = Model::from_checkpoint(CpuBackend, &ckpt).unwrap();
    let generator = model.generator().unwrap();
    for sampling in [
        Sampling::Greedy,
        Sampling::Sample {
            temperature: 2.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
        },
    ] {
        let request = GenerateRequest {
            prompts: vec![
                vec![5, 17, 42, 8, 91, 33, 60],
                vec![12, 3],
                vec![77, 21, 64, 9],
            ],
            max_new_tokens: 8,
            // an EOS id some sequences produce, so finished ones must stay silent
            eos_ids: vec![58, 28],
            sampling,
            seed: 3,
        };
        let mut seen = vec![Vec::new(); 3];
        let streamed = generator
            .generate_streaming(&request, |b, id| seen[b].push(id))
            .unwrap();
        assert_eq!(seen, streamed.tokens);
        assert_eq!(streamed, generator.generate(&request).unwrap());
    }
}

/// `--tools` and `--chat-template-kwargs` reach the chat template as transformers'
/// `tools=` and `**kwargs`; malformed ones are refused by flag.
#[test]
fn tools_and_template_variables_reach_the_chat_template() {
    let model = demo_model();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for f in std::fs::read_dir(model).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    // digits only, which the demo tokenizer spells one by one
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ tools|length if tools else 0 }}{{ 7 if enable_thinking is false else 3 }}+\
         {% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    .unwrap();
    let tools = tmp.path().join("tools.json");
    std::fs::write(
        &tools,
        r#"[{"type": "function", "function": {"name": "calc", "parameters": {}}}]"#,
    )
    .unwrap();
    let tok = ares_runner::hf::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let common = ["--greedy", "--max-new-tokens", "2", "--prompt", "1+1"];
    let ids = |extra: &[&str]| {
        let mut flags = common.to_vec();
        flags.extend_from_slice(extra);
        run(&dir, &flags).0[0].input_ids.clone()
    };
    assert_eq!(ids(&[]), tok.encode("03+1+1", false).unwrap());
    let t = tools.display().to_string();
    assert_eq!(
        ids(&[
            "--tools",
            &t,
            "--chat-template-kwargs",
            r#"{"enable_thinking": false}"#
        ]),
        tok.encode("17+1+1", false).unwrap()
    );

    let e = error(&dir, &["--prompt", "x", "--chat-template-kwargs", "[1]"]);
    assert!(e.contains("expected a JSON object"), "{e}");
    let e = error(
        &dir,
        &["--prompt", "x", "--chat-template-kwargs", r#"{"tools": 1}"#],
    );
    assert!(e.contains("`tools` is set by ares itself"), "{e}");
    std::fs::write(&tools, r#"{"name": "calc"}"#).unwrap();
    let e = error(&dir, &["--prompt", "x", "--tools", &t]);
    assert!(
        e.contains("tools.json") && e.contains("expected a list of tool schemas, found an object"),
        "{e}"
    );
    std::fs::write(&tools, r#"[{"type": "function"}, "calc"]"#).unwrap();
    let e = error(&dir, &["--prompt", "x", "--tools", &t]);
    assert!(e.contains("`tools[1]`"), "{e}");
}

/// `--max-turns` above 1 runs each prompt as an episode: with a model that calls no tool it
/// is the single-turn completion, with the tool counts reported; a template that shows no
/// tool-call format, and 0 turns, are refused.
#[test]
fn multi_turn_without_calls_is_the_single_turn_completion() {
    let model = demo_model();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for f in std::fs::read_dir(model).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let flags = ["--greedy", "--max-new-tokens", "24", "--prompt", "13+3"];
    let (single, _) = run(&dir, &flags);
    // the demo's template shows no tool-call format
    let mut multi = flags.to_vec();
    multi.extend(["--max-turns", "3"]);
    let e = error(&dir, &multi);
    assert!(e.contains("shows no tool-call format"), "{e}");
    // a template that teaches the Hermes format (and ignores the tools otherwise)
    let source = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    let config: Value = serde_json::from_str(&source).unwrap();
    let template = config["chat_template"].as_str().unwrap();
    std::fs::write(
        dir.join("chat_template.jinja"),
        format!("{{# calls go in <tool_call></tool_call> #}}{template}"),
    )
    .unwrap();
    let (episodes, _) = run(&dir, &multi);
    assert_eq!(episodes[0].token_ids, single[0].token_ids);
    assert_eq!(episodes[0].input_ids, single[0].input_ids);
    let t = episodes[0].tools.as_ref().unwrap();
    assert_eq!((t.turns, t.calls, t.failed_calls), (1, 0, 0));
    assert!(t.from_model.iter().all(|&m| m));
    assert_eq!(t.from_model.len(), single[0].token_ids.len());
    let mut zero = flags.to_vec();
    zero.extend(["--max-turns", "0"]);
    assert!(error(&dir, &zero).contains("--max-turns 0"));

    // tools answered by programs: their schemas come from --tools
    let tools = tmp.path().join("tools.json");
    std::fs::write(
        &tools,
        r#"[{"type": "function", "function": {"name": "lookup"}}]"#,
    )
    .unwrap();
    let t = tools.display().to_string();
    let mut with = multi.clone();
    with.extend(["--tools", &t, "--tool-command", "lookup=cat"]);
    let (episodes, _) = run(&dir, &with);
    assert_eq!(episodes[0].tools.as_ref().unwrap().turns, 1);
    let mut one = flags.to_vec();
    one.extend(["--tools", &t, "--tool-command", "lookup=cat"]);
    assert!(error(&dir, &one).contains("give --max-turns 2 or more"));
    let mut unknown = multi.clone();
    unknown.extend(["--tools", &t, "--tool-command", "search=cat"]);
    assert!(error(&dir, &unknown).contains("--tools has no schema named `search`"));
    let mut bad = multi.clone();
    bad.extend(["--tools", &t, "--tool-command", "lookup"]);
    assert!(error(&dir, &bad).contains("expected NAME=COMMAND"));

    // an interaction answers each turn without calls: `done` ends the episode with its
    // score; else its reply is the user's next turn, until --max-turns (the last scored)
    let done = tmp.path().join("done.sh");
    let again = tmp.path().join("again.sh");
    for (path, body) in [
        (
            &done,
            "while read -r l; do echo '{\"done\": true, \"reward\": 1}'; done\n",
        ),
        (
            &again,
            "while read -r l; do echo '{\"content\": \"again\", \"reward\": 0.5}'; done\n",
        ),
    ] {
        let status = std::process::Command::new("sh")
            .args(["-c", &format!("cat > '{}'", path.display())])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(body.as_bytes())?;
                c.wait()
            })
            .unwrap();
        assert!(status.success());
    }
    // a model whose turns end at once: the untrained demo model writes "\n" (id 18) first
    let gen_config = dir.join("generation_config.json");
    let mut g: Value =
        serde_json::from_str(&std::fs::read_to_string(&gen_config).unwrap()).unwrap();
    g["eos_token_id"] = serde_json::json!(18);
    std::fs::write(&gen_config, g.to_string()).unwrap();
    let with_env = |script: &std::path::Path| {
        // room for the user's turns (one token a character)
        let mut v: Vec<String> = multi
            .iter()
            .map(|s| if *s == "24" { "200" } else { s }.to_string())
            .collect();
        v.extend([
            "--interaction-command".into(),
            format!("sh {}", script.display()),
        ]);
        v
    };
    let args = with_env(&done);
    let (episodes, _) = run(&dir, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(episodes[0].token_ids, [18]);
    let t = episodes[0].tools.as_ref().unwrap();
    assert_eq!(
        (t.turns, t.turn_scores.clone()),
        (1, vec![1.0]),
        "{:?}",
        episodes[0]
    );
    let args = with_env(&again);
    let (episodes, _) = run(&dir, &args.iter().map(String::as_str).collect::<Vec<_>>());
    let t = episodes[0].tools.as_ref().unwrap();
    assert_eq!((t.turns, t.turn_scores.clone()), (3, vec![0.5; 3]));
    assert!(
        t.from_model.iter().any(|&m| !m),
        "the user's turns are not the model's"
    );
    let mut one = flags.to_vec();
    one.extend(["--interaction-command", "cat"]);
    assert!(error(&dir, &one).contains("give --max-turns 2 or more"));
}

/// `--adapter`: a PEFT adapter merged at load generates as the model `ares-runner merge`
/// wrote from it; without it, as the base model (the adapter changes the sampled tokens).
#[test]
fn an_adapter_merged_at_load_generates_as_the_merged_model() {
    let base = with_id_tokenizer("qwen2_tiny");
    let adapter = fixture("../lora/qwen2_all");
    let merged = tempfile::tempdir().unwrap();
    let out = merged.path().join("m");
    ares_runner::commands::merge::merge(
        base.path(),
        &adapter,
        &out,
        ares_runner::hf::tensor_files::SaveDtype::F32,
    )
    .unwrap();
    let texts: Vec<String> = (1..=16u32)
        .map(|i| text_of(&[i, (7 * i) % 97, (31 * i + 5) % 97]))
        .collect();
    // sampled, one seed: the adapter's logits (up to 1.4 from the base's) move the draws,
    // where the tiny model's greedy tokens do not change
    let mut flags = vec![
        "--no-chat-template",
        "--temperature",
        "1",
        "--seed",
        "7",
        "--max-new-tokens",
        "12",
    ];
    for t in &texts {
        flags.extend(["--prompt", t.as_str()]);
    }
    let ids = |model: &Path, more: &[&str]| -> Vec<Vec<u32>> {
        let mut rest = flags.clone();
        rest.extend_from_slice(more);
        run(model, &rest)
            .0
            .into_iter()
            .map(|c| c.token_ids)
            .collect()
    };
    let adapter_arg = adapter.display().to_string();
    let with = ids(base.path(), &["--adapter", &adapter_arg]);
    assert_eq!(with, ids(&out, &[]));
    assert_ne!(
        with,
        ids(base.path(), &[]),
        "the adapter changes the sampled tokens"
    );
    let e = error(
        base.path(),
        &[
            "--no-chat-template",
            "--prompt",
            "t1",
            "--adapter",
            "/nonexistent",
        ],
    );
    assert!(
        e.contains("/nonexistent") && e.contains("adapter_config.json"),
        "{e}"
    );
}

/// `--max-turns` with images: each turn of a vision-language prompt sees its images; the
/// second turn (after an interaction's reply) equals generating after the whole
/// conversation, written out as messages, with the same images.
#[test]
fn multi_turn_with_images_sees_them_every_turn() {
    let cases = vl_cases();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    let model = vl_root().join("qwen2_5_vl_tiny");
    for f in std::fs::read_dir(&model).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
    }
    std::fs::create_dir(tmp.path().join("pics")).unwrap();
    std::fs::copy(
        vl_root().join("images/image_56x84.png"),
        tmp.path().join("pics/image_56x84.png"),
    )
    .unwrap();
    let messages = cases["cases"]["image"]["messages"].clone();
    let prompts = |messages: &Value, name: &str| {
        let file = tmp.path().join(name);
        let line = json!({"messages": messages, "images": ["pics/image_56x84.png"]});
        std::fs::write(&file, line.to_string()).unwrap();
        file.display().to_string()
    };
    let first = prompts(&messages, "first.jsonl");
    let (single, _) = run(
        &dir,
        &["--greedy", "--max-new-tokens", "8", "--prompts", &first],
    );
    // turns that end at once: the model's first greedy token is its end of turn
    let t0 = single[0].token_ids[0];
    let gen_config = dir.join("generation_config.json");
    let mut g: Value =
        serde_json::from_str(&std::fs::read_to_string(&gen_config).unwrap()).unwrap();
    g["eos_token_id"] = json!(t0);
    std::fs::write(&gen_config, g.to_string()).unwrap();
    let source = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    let config: Value = serde_json::from_str(&source).unwrap();
    std::fs::write(
        dir.join("chat_template.jinja"),
        format!(
            "{{# calls go in <tool_call></tool_call> #}}{}",
            config["chat_template"].as_str().unwrap()
        ),
    )
    .unwrap();
    let script = tmp.path().join("more.sh");
    std::fs::write(
        &script,
        "while read -r l; do echo '{\"content\": \"more\"}'; done\n",
    )
    .unwrap();
    let interaction = format!("sh {}", script.display());
    let (episode, _) = run(
        &dir,
        &[
            "--greedy",
            "--max-new-tokens",
            "64",
            "--prompts",
            &first,
            "--max-turns",
            "2",
            "--interaction-command",
            &interaction,
        ],
    );
    let e = &episode[0];
    let t = e.tools.as_ref().unwrap();
    assert_eq!(t.turns, 2, "{e:?}");
    assert_eq!(e.token_ids[0], t0);
    // the whole conversation as messages: the first turn, the user's reply
    let tok = ares_runner::hf::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let said = tok.decode(&[t0], true).unwrap();
    let whole = prompts(
        &json!([
            messages[0],
            {"role": "assistant", "content": said},
            {"role": "user", "content": "more"}
        ]),
        "whole.jsonl",
    );
    let (after, _) = run(
        &dir,
        &["--greedy", "--max-new-tokens", "64", "--prompts", &whole],
    );
    let model_tail: Vec<u32> = e
        .token_ids
        .iter()
        .zip(&t.from_model)
        .skip(1)
        .filter(|&(_, &m)| m)
        .map(|(&id, _)| id)
        .collect();
    let mut conversation = e.input_ids.clone();
    let user_end = t.from_model.iter().rposition(|&m| !m).unwrap() + 1;
    conversation.extend(&e.token_ids[..user_end]);
    assert_eq!(
        after[0].input_ids, conversation,
        "the conversation renders alike"
    );
    assert_eq!(model_tail, after[0].token_ids);
}
