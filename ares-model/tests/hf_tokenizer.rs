//! Tokenizer and chat-template I/O against fixtures made by `scripts/make_tokenizer_fixtures.py`
//! with HF `tokenizers` and transformers' `apply_chat_template`.

use std::path::{Path, PathBuf};

use ares_model::hf::chat::{
    CHAT_TEMPLATE_FILE, ChatError, ChatMessage, ChatTemplate, CivilDateTime, RenderOptions,
};
use ares_model::hf::tokenizer::{Tokenizer, TokenizerConfig, TokenizerError};
use serde_json::Value as Json;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn read_json(name: &str) -> Json {
    let text = std::fs::read_to_string(fixtures().join(name)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A fresh scratch directory under the target dir (no tempfile crate).
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("hf_tokenizer_{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn fixed_now() -> CivilDateTime {
    // expected_chats.json "now": 2024-07-06T09:05:03
    CivilDateTime::new(2024, 7, 6, 9, 5, 3).unwrap()
}

#[test]
fn golden_ids_match_python_tokenizers() {
    let golden = read_json("golden.json");
    for dir in ["qwen_style", "llama_style"] {
        let tok = Tokenizer::from_dir(&fixtures().join(dir)).unwrap();
        let cases = golden[dir].as_array().unwrap();
        assert!(cases.len() >= 100, "{dir}: {} strings", cases.len());
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            let with_special: Vec<u32> =
                serde_json::from_value(case["ids_with_special"].clone()).unwrap();
            assert_eq!(tok.encode(text, false).unwrap(), ids, "{dir}: {text:?}");
            assert_eq!(
                tok.encode(text, true).unwrap(),
                with_special,
                "{dir}: {text:?}"
            );
            // Raw `tokenizers` decode (no config clean-up) and transformers' decode.
            let raw = Tokenizer::from_file(&fixtures().join(dir).join("tokenizer.json")).unwrap();
            assert_eq!(
                raw.decode(&ids, false).unwrap(),
                case["decoded"],
                "{dir}: {text:?}"
            );
            assert_eq!(
                raw.decode(&ids, true).unwrap(),
                case["decoded_skip_special"],
                "{dir}: {text:?}"
            );
            assert_eq!(
                tok.decode(&ids, false).unwrap(),
                case["transformers_decoded"],
                "{dir}: {text:?}"
            );
            assert_eq!(
                tok.decode(&ids, true).unwrap(),
                case["transformers_decoded_skip_special"],
                "{dir}: {text:?}"
            );
        }
    }
}

#[test]
fn decode_round_trips_nfc_text() {
    let tok = Tokenizer::from_dir(&fixtures().join("qwen_style")).unwrap();
    for text in [
        "Hello  world\n\n",
        "日本語 🙂 café",
        "<|im_start|>user\nx<|im_end|>",
        "  \t ",
    ] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
}

#[test]
fn batch_encode_equals_single_encodes() {
    let tok = Tokenizer::from_dir(&fixtures().join("llama_style")).unwrap();
    let texts = ["a", "", "the model answer", "日本語<|eot_id|>x"];
    let batch = tok.encode_batch(&texts, true).unwrap();
    assert_eq!(batch.len(), texts.len());
    for (t, ids) in texts.iter().zip(&batch) {
        assert_eq!(&tok.encode(t, true).unwrap(), ids);
    }
}

#[test]
fn special_ids_vocab_eos_pad() {
    let golden = read_json("golden.json");
    let qwen = Tokenizer::from_dir(&fixtures().join("qwen_style")).unwrap();
    assert_eq!(
        qwen.vocab_size() as u64,
        golden["vocab_size"].as_u64().unwrap()
    );
    for (token, id) in golden["special_ids"].as_object().unwrap() {
        let id = id.as_u64().unwrap() as u32;
        assert_eq!(qwen.token_to_id(token), Some(id));
        assert_eq!(qwen.id_to_token(id).as_deref(), Some(token.as_str()));
    }
    let im_end = qwen.token_to_id("<|im_end|>").unwrap();
    let eot = qwen.token_to_id("<|endoftext|>").unwrap();
    assert_eq!(qwen.bos_id(), None);
    assert_eq!(qwen.eos_id(), Some(im_end));
    assert_eq!(qwen.pad_id(), Some(eot));
    // generation_config.json eos ids first, then tokenizer_config's eos, no duplicates.
    assert_eq!(qwen.eos_ids(&[eot, im_end]), vec![eot, im_end]);
    assert_eq!(qwen.eos_ids(&[eot]), vec![eot, im_end]);
    assert_eq!(qwen.eos_ids(&[]), vec![im_end]);

    let llama = Tokenizer::from_dir(&fixtures().join("llama_style")).unwrap();
    let bos = llama.token_to_id("<|begin_of_text|>").unwrap();
    assert_eq!(llama.bos_id(), Some(bos));
    assert_eq!(llama.pad_id(), None);
    assert_eq!(llama.encode("hi", true).unwrap()[0], bos);
    assert!(llama.config().unwrap().clean_up_tokenization_spaces);
}

#[test]
fn missing_and_malformed_tokenizer_name_the_file() {
    let dir = scratch("missing");
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, TokenizerError::Io { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    std::fs::write(dir.join("tokenizer.json"), "{\"model\": [1, 2").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, TokenizerError::Json { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    std::fs::write(dir.join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, TokenizerError::Tokenizer { .. }), "{err}");

    std::fs::copy(
        fixtures().join("qwen_style/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        "{\"eos_token\": \"<nope>\"}",
    )
    .unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("eos_token"),
        "{err}"
    );

    std::fs::write(dir.join("tokenizer_config.json"), "not json").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("JSON"),
        "{err}"
    );
}

fn case_messages(expected: &Json, case: &Json) -> Vec<Json> {
    match case.get("messages") {
        Some(m) => m.as_array().unwrap().clone(),
        None => expected["conversations"][case["conversation"].as_str().unwrap()]
            .as_array()
            .unwrap()
            .clone(),
    }
}

#[test]
fn rendered_chats_equal_transformers() {
    let expected = read_json("expected_chats.json");
    let tools = expected["tools"].as_array().unwrap().clone();
    let cases = expected["cases"].as_array().unwrap();
    assert!(cases.len() >= 40);
    for (i, case) in cases.iter().enumerate() {
        let dir = fixtures().join(case["model_dir"].as_str().unwrap());
        let template = match case.get("template_file").and_then(Json::as_str) {
            Some(file) => {
                let source =
                    std::fs::read_to_string(fixtures().join("templates").join(file)).unwrap();
                let config =
                    TokenizerConfig::from_file(&dir.join("tokenizer_config.json")).unwrap();
                ChatTemplate::from_source(&source, config.special).unwrap()
            }
            None => ChatTemplate::from_dir(&dir).unwrap(),
        }
        .with_fixed_time(fixed_now())
        .unwrap();
        let messages = case_messages(&expected, case);
        let extra = case["extra"].as_object().unwrap();
        let options = RenderOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            tools: case["tools"].as_bool().unwrap().then_some(tools.as_slice()),
            extra: Some(extra),
        };
        let got = template.render(&messages, &options).unwrap();
        let want = case["expected"].as_str().unwrap();
        let what = || {
            serde_json::to_string(&case)
                .unwrap()
                .chars()
                .take(200)
                .collect::<String>()
        };
        assert_eq!(got, want, "case {i}: {}", what());
        // Qwen3's real template: the prompt's ids too, as transformers encodes them
        if let Some(ids) = case.get("expected_ids") {
            let ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
            let tok = Tokenizer::from_dir(&dir).unwrap();
            assert_eq!(
                tok.encode(&got, false).unwrap(),
                ids,
                "case {i} ids: {}",
                what()
            );
        }
    }
    let qwen3 = cases.iter().filter(|c| c["model_dir"] == "qwen3").count();
    assert!(qwen3 >= 40, "{qwen3} cases of Qwen3's real template");
}

#[test]
fn separate_jinja_file_wins_over_config_field() {
    let t = ChatTemplate::from_dir(&fixtures().join("llama_style")).unwrap();
    assert!(t.source(false).unwrap().contains("start_header_id"));
    assert!(!t.source(false).unwrap().contains("DECOY"));
    assert_eq!(
        t.special_tokens().bos_token.as_deref(),
        Some("<|begin_of_text|>")
    );
}

#[test]
fn named_templates_pick_tool_use_with_tools() {
    let t = ChatTemplate::from_dir(&fixtures().join("named")).unwrap();
    assert_eq!(t.names().collect::<Vec<_>>(), ["default", "tool_use"]);
    assert!(t.source(false).unwrap().contains("namespace("));
    assert!(t.source(true).unwrap().contains("<tools>"));
}

#[test]
fn system_helper_replaces_default_system_turn() {
    let t = ChatTemplate::from_dir(&fixtures().join("qwen_style")).unwrap();
    let rubric = "Grade with the rubric.";
    let prompt = [ChatMessage::user("What is 2+2?")];
    let got = t
        .render_with_system(rubric, &prompt, &RenderOptions::generation())
        .unwrap();
    assert_eq!(
        got,
        "<|im_start|>system\nGrade with the rubric.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(got.matches("<|im_start|>system").count(), 1);
    assert!(!got.contains("helpful assistant for tests"));
    // An existing system message is replaced, not doubled.
    let prompt = [
        ChatMessage::system("old"),
        ChatMessage::user("What is 2+2?"),
    ];
    let again = t
        .render_with_system(rubric, &prompt, &RenderOptions::generation())
        .unwrap();
    assert_eq!(again, got);
    // Without the helper the template's default system turn is there.
    let plain = t
        .render(
            &[ChatMessage::user("What is 2+2?")],
            &RenderOptions::generation(),
        )
        .unwrap();
    assert!(plain.contains("helpful assistant for tests"));
}

#[test]
fn missing_template_is_a_clear_error() {
    let dir = scratch("no_template");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        "{\"eos_token\": \"</s>\"}",
    )
    .unwrap();
    let err = ChatTemplate::from_dir(&dir).unwrap_err();
    assert!(matches!(err, ChatError::NoTemplate { .. }), "{err}");
    assert!(err.to_string().contains("has no chat template"), "{err}");

    let empty = scratch("no_files");
    let err = ChatTemplate::from_dir(&empty).unwrap_err();
    assert!(matches!(err, ChatError::NoTemplate { .. }), "{err}");

    std::fs::write(dir.join("tokenizer_config.json"), "{\"chat_template\": ").unwrap();
    let err = ChatTemplate::from_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
}

#[test]
fn jinja_file_alone_is_enough() {
    let dir = scratch("jinja_only");
    std::fs::write(
        dir.join(CHAT_TEMPLATE_FILE),
        "{% for m in messages %}[{{ m.content }}]{% endfor %}\n",
    )
    .unwrap();
    let t = ChatTemplate::from_dir(&dir).unwrap();
    let out = t
        .render(
            &[ChatMessage::user("a"), ChatMessage::assistant("b")],
            &RenderOptions::default(),
        )
        .unwrap();
    assert_eq!(out, "[a][b]");
}

#[test]
fn raise_exception_on_bad_role_carries_message() {
    let t = ChatTemplate::from_dir(&fixtures().join("qwen_style")).unwrap();
    let err = t
        .render(
            &[ChatMessage::new("robot", "beep")],
            &RenderOptions::default(),
        )
        .unwrap_err();
    match &err {
        ChatError::Raised { origin, message } => {
            assert_eq!(message, "Unsupported role: robot");
            assert!(origin.contains("tokenizer_config.json"), "{origin}");
        }
        other => panic!("expected Raised, got {other}"),
    }
    assert!(err.to_string().contains("Unsupported role: robot"));

    let named = ChatTemplate::from_dir(&fixtures().join("named")).unwrap();
    let err = named
        .render(
            &[ChatMessage::user("a"), ChatMessage::system("late")],
            &RenderOptions::default(),
        )
        .unwrap_err();
    assert!(
        matches!(&err, ChatError::Raised { message, .. } if message.contains("must come first")),
        "{err}"
    );
}

#[test]
fn strftime_now_uses_the_fixed_time() {
    let t = ChatTemplate::from_source("{{ strftime_now('%d %b %Y') }}", Default::default())
        .unwrap()
        .with_fixed_time(fixed_now())
        .unwrap();
    assert_eq!(
        t.render::<Json>(&[], &RenderOptions::default()).unwrap(),
        "06 Jul 2024"
    );
    let live = ChatTemplate::from_source("{{ strftime_now('%Y') }}", Default::default()).unwrap();
    let year: i32 = live
        .render::<Json>(&[], &RenderOptions::default())
        .unwrap()
        .parse()
        .unwrap();
    assert!(year >= 2024);
}

/// A chat template is a program from a downloaded model folder: one that does not end, or
/// that writes without bound, is stopped at its limits with a message that says which.
#[test]
fn chat_templates_are_bounded() {
    // the cap bounds what is resident, not only what is returned: 64 MiB written of the
    // 125 MiB the template asks for
    let Some(_peak) = ares_tests::bounded::rerun(
        "chat_templates_are_bounded",
        ares_tests::bounded::Bounds {
            address_space_mib: 2048,
            peak_rss_mib: 96,
        },
    ) else {
        return;
    };
    use ares_model::hf::chat::{ChatError, ChatMessage, RenderOptions};
    let render = |source: &str, content: &str| {
        ChatTemplate::from_source(source, Default::default())
            .unwrap()
            .render(&[ChatMessage::user(content)], &RenderOptions::generation())
    };
    let forever =
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
    let e = render(forever, "hi").unwrap_err();
    assert!(matches!(e, ChatError::Limit { .. }), "{e:?}");
    assert!(e.to_string().contains("instructions"), "{e}");
    // 64 KiB × 2 000 = 125 MiB of output: stopped at the 64 MiB cap, not built
    let big = "x".repeat(64 << 10);
    let e = render(
        "{% for i in range(2000) %}{{ messages[0]['content'] }}{% endfor %}",
        &big,
    )
    .unwrap_err();
    assert!(e.to_string().contains("output passed 64 MiB"), "{e}");
    // ordinary templates are far from both
    assert_eq!(
        render(
            "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "hi"
        )
        .unwrap(),
        "hi"
    );
}

/// `trim`, `.strip()`, `.lstrip()`, `.rstrip()` and `.split()` see whitespace as Python
/// does: U+001C–U+001F too (Rust's `str::trim` keeps them, and a Llama 3 prompt ending in
/// `\x1f` rendered one token longer than transformers'). Expected: Jinja2 3.1 on the same
/// template and string.
#[test]
fn templates_strip_what_python_strips() {
    let source = "[{{ messages[0]['content']|trim }}][{{ messages[0]['content'].strip() }}]\
        [{{ messages[0]['content'].lstrip() }}][{{ messages[0]['content'].rstrip() }}]\
        [{{ messages[0]['content'].split()|join('|') }}]\
        [{{ messages[0]['content'].split(none, 1)|join('|') }}]\
        [{{ messages[0]['content'].strip('\x1c ') }}][{{ 'a,b'.split(',')|join('|') }}]";
    let t = ChatTemplate::from_source(source, Default::default()).unwrap();
    let out = t
        .render(
            &[ChatMessage::user("\x1c a\u{3000}b  c \x1f")],
            &RenderOptions::default(),
        )
        .unwrap();
    assert_eq!(
        out,
        "[a\u{3000}b  c][a\u{3000}b  c][a\u{3000}b  c \x1f][\x1c a\u{3000}b  c][a|b|c]\
         [a|b  c \x1f][a\u{3000}b  c \x1f][a|b]"
    );
    // the Llama 3-style template of the fixtures trims each message
    let llama = ChatTemplate::from_source(
        &std::fs::read_to_string(fixtures().join("templates/llama3_like.jinja")).unwrap(),
        Default::default(),
    )
    .unwrap();
    let a = llama
        .render(
            &[ChatMessage::user("What is 2+2?\x1f")],
            &RenderOptions::generation(),
        )
        .unwrap();
    let b = llama
        .render(
            &[ChatMessage::user("What is 2+2?")],
            &RenderOptions::generation(),
        )
        .unwrap();
    assert_eq!(a, b);
}

/// After a model's tool-calling turn, the text to append to its tokens is what the template
/// writes after its end-of-turn text, the tool turn and the generation prompt; appended to
/// the conversation rendered up to that end-of-turn, it gives the whole conversation
/// rendered with the tool messages (what a re-render would prefill).
#[test]
fn tool_messages_continue_a_conversation_as_the_template_renders_it() {
    use serde_json::json;
    let template = |name: &str| {
        ChatTemplate::from_source(
            &std::fs::read_to_string(fixtures().join("templates").join(name)).unwrap(),
            Default::default(),
        )
        .unwrap()
    };
    let tools = [json!({"type": "function", "function": {"name": "calculator"}})];
    let options = RenderOptions {
        tools: Some(&tools),
        ..RenderOptions::generation()
    };
    for (name, end, call) in [
        (
            "qwen25_like.jinja",
            "<|im_end|>",
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}\n</tool_call>",
        ),
        (
            "llama3_like.jinja",
            "<|eot_id|>",
            "{\"name\": \"calculator\", \"parameters\": {\"expression\": \"12*34\"}}",
        ),
    ] {
        let t = template(name);
        let conversation = [
            json!({"role": "user", "content": "What is 12*34?"}),
            json!({"role": "assistant", "content": call}),
        ];
        let results = [json!({"role": "tool", "content": "408"})];
        let cont = t
            .tool_continuation(&conversation, &results, end, &options)
            .unwrap();
        let closed = RenderOptions {
            add_generation_prompt: false,
            ..options
        };
        let before = t.render(&conversation, &closed).unwrap();
        let mut all = conversation.to_vec();
        all.extend_from_slice(&results);
        let after = t.render(&all, &options).unwrap();
        let cut = before.rfind(end).unwrap() + end.len();
        assert_eq!(format!("{}{cont}", &before[..cut]), after, "{name}");
        assert!(cont.contains("408"), "{name}: {cont}");
    }
    let qwen = template("qwen25_like.jinja");
    let conversation = [
        json!({"role": "user", "content": "What is 12*34?"}),
        json!({"role": "assistant", "content": "<tool_call>{}</tool_call>"}),
    ];
    let results = [
        json!({"role": "tool", "content": "408"}),
        json!({"role": "tool", "content": "2"}),
    ];
    assert_eq!(
        qwen.tool_continuation(&conversation, &results, "<|im_end|>", &options)
            .unwrap(),
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n2\n\
         </tool_response><|im_end|>\n<|im_start|>assistant\n"
    );
    // an end-of-turn the template does not write
    let e = qwen
        .tool_continuation(&conversation, &results, "</s>", &options)
        .unwrap_err();
    assert!(matches!(e, ChatError::Continuation { .. }), "{e}");
    // a template that rewrites earlier turns once more messages follow
    let rewriting = ChatTemplate::from_source(
        "{% for m in messages %}{{ m['content'] }}{% if loop.last %}<end>{% endif %}{% endfor %}",
        Default::default(),
    )
    .unwrap();
    let e = rewriting
        .tool_continuation(&conversation, &results, "<end>", &options)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("renders the earlier turns differently"),
        "{e}"
    );
}
