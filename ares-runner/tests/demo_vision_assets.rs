//! The vision demo's assets through the runner's own loaders: the same seed gives the same
//! bytes; the levels hold what they promise; every worked solution's `\boxed{}` is its
//! picture's count; the pictures decode to 84 × 84 and process to 6 × 6 patches; the model
//! directory loads as a Qwen2.5-VL checkpoint whose model runs a rendered, tokenized and
//! expanded demo prompt with its picture; the tokenizer round-trips the vision tokens.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use ares_runner::backend::cpu::CpuBackend;
use ares_runner::config::DataConfig;
use ares_runner::data::{
    DataKeys, MediaKeys, MediaProcessor, load_dataset, load_media, render_prompt,
    vision_token_count,
};
use ares_runner::demo::model::{TinyModelSpec, write_random_model};
use ares_runner::demo::tokenizer::VOCAB_SIZE;
use ares_runner::demo::vision_assets::{
    VisionDemoAssets, VisionDemoOptions, write_vision_demo_assets_with,
};
use ares_runner::demo::vision_model::{
    IMAGE_PAD, TinyVisionSpec, VIDEO_PAD, VISION_END, VISION_START, VL_VOCAB_SIZE, vl_special_ids,
    write_random_vl_model,
};
use ares_runner::demo::vision_task::{
    self, IMAGE_SIZE, Level, MAX_QUESTION_CHARS, MAX_RESPONSE_CHARS, PATCHES_PER_IMAGE, Split,
    TOKENS_PER_IMAGE, distractor_range, target_range,
};
use ares_runner::hf::chat::{ChatTemplate, RenderOptions};
use ares_runner::hf::checkpoint::Checkpoint;
use ares_runner::hf::tokenizer::Tokenizer;
use ares_runner::model::{GenerateRequest, Sampling};
use ares_runner::reward::extract_boxed;
use ares_runner::vision::checkpoint::{VlCheckpoint, WeightLayout};
use ares_runner::vision::config::VlKind;
use ares_runner::vision::model::{VisionBatch, VlModel};
use ares_runner::vision::mrope::expand_placeholders;
use ares_runner::vision::processor::{ProcessorConfig, load_rgb, process_image_file};
use serde_json::{Value, json};

fn rows(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn small(seed: u64) -> VisionDemoOptions {
    VisionDemoOptions {
        seed,
        train_per_level: 24,
        eval_per_level: 8,
        sft_images_per_level: 16,
        sft_examples: 200,
        ..VisionDemoOptions::default()
    }
}

fn write(seed: u64) -> (tempfile::TempDir, VisionDemoAssets) {
    let dir = tempfile::tempdir().unwrap();
    let assets = write_vision_demo_assets_with(dir.path(), &small(seed)).unwrap();
    (dir, assets)
}

/// Every file under `root`, relative path → bytes.
fn tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(root).unwrap().to_path_buf();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn same_seed_same_bytes_and_the_documented_layout() {
    let (a, assets) = write(5);
    let (b, _) = write(5);
    let (ta, tb) = (tree(a.path()), tree(b.path()));
    assert_eq!(ta, tb);
    let names: Vec<String> = ta.keys().map(|p| p.display().to_string()).collect();
    for f in [
        "model/config.json",
        "model/model.safetensors",
        "model/generation_config.json",
        "model/preprocessor_config.json",
        "model/tokenizer.json",
        "model/tokenizer_config.json",
        "data/train.jsonl",
        "data/eval.jsonl",
        "data/sft.jsonl",
        "data/images/train-000000.png",
        "data/images/train-000071.png",
        "data/images/eval-000023.png",
        "data/images/sft-000047.png",
    ] {
        assert!(names.iter().any(|n| n == f), "{f} missing: {names:?}");
    }
    // 72 + 24 + 48 pictures, 6 model files, 3 datasets
    assert_eq!(ta.len(), 72 + 24 + 48 + 6 + 3);
    assert!(!names.iter().any(|n| n == "data/images/train-000072.png"));
    assert_eq!(assets.images, a.path().join("data/images"));

    // another seed: other pictures and weights
    let (c, _) = write(6);
    let tc = tree(c.path());
    for f in [
        "data/train.jsonl",
        "model/model.safetensors",
        "data/images/eval-000000.png",
    ] {
        assert_ne!(ta[Path::new(f)], tc[Path::new(f)], "{f}");
    }
    // the tokenizer and the configs do not depend on the seed
    for f in ["model/tokenizer.json", "model/config.json"] {
        assert_eq!(ta[Path::new(f)], tc[Path::new(f)], "{f}");
    }
}

#[test]
fn rows_follow_easyr1_and_levels_hold_what_they_promise() {
    let (_d, assets) = write(2);
    let train = rows(&assets.train);
    assert_eq!(train.len(), 72);
    let first = &train[0];
    let keys: Vec<&str> = first
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        ["prompt", "images", "answer", "difficulty", "global_id"]
    );
    assert_eq!(first["images"], json!(["images/train-000000.png"]));
    for (i, r) in train.iter().enumerate() {
        let level = Level::ALL[i % 3];
        assert_eq!(r["difficulty"], level.as_str());
        let prompt = r["prompt"].as_str().unwrap();
        let q = prompt.strip_prefix("<image>").unwrap();
        assert!(q.starts_with("How many ") && q.ends_with(" shapes are in the picture?"));
        assert!(q.len() <= MAX_QUESTION_CHARS);
        let n: usize = r["answer"].as_str().unwrap().parse().unwrap();
        let (lo, hi) = target_range(level);
        assert!((lo..=hi).contains(&n), "{r}");
        assert!(
            r["global_id"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{}:", level.as_str()))
        );
    }

    // the problems behind the rows: counts, distractors, splits, distinct layouts
    let seed = 2;
    let train = vision_task::problems(Split::Train, seed, 300).unwrap();
    let eval = vision_task::problems(Split::Eval, seed, 100).unwrap();
    let small_train = vision_task::problems(Split::Train, seed, 24).unwrap();
    // a longer list extends the shorter one level by level
    assert_eq!(small_train[..], train[..72]);
    let mut answers: BTreeMap<(&str, usize), usize> = BTreeMap::new();
    for p in &train {
        assert_eq!(p.split(), Split::Train);
        let n = p.scene.count();
        let (lo, hi) = distractor_range(p.level);
        assert!((lo..=hi).contains(&(p.scene.shapes.len() - n)));
        *answers.entry((p.level.as_str(), n)).or_default() += 1;
    }
    // each count of a level about equally often: 300 draws over 3 values (100 each, sd ≈ 8)
    assert_eq!(answers.len(), 9, "{answers:?}");
    assert!(
        answers.values().all(|&c| (70..=130).contains(&c)),
        "{answers:?}"
    );
    assert!(eval.iter().all(|p| p.split() == Split::Eval));
    let train_layouts: HashSet<String> = train.iter().map(|p| p.scene.layout_code()).collect();
    assert_eq!(train_layouts.len(), train.len());
    assert!(
        eval.iter()
            .all(|p| !train_layouts.contains(&p.scene.layout_code()))
    );
    let ids: HashSet<&str> = train.iter().map(|p| p.global_id.as_str()).collect();
    assert_eq!(ids.len(), train.len());
    // the SFT pictures are train pictures other than the RL prompts
    let pool = vision_task::sft_problems(seed, 50).unwrap();
    assert!(pool.iter().all(|p| p.split() == Split::Train));
    let overlap = pool
        .iter()
        .filter(|p| train_layouts.contains(&p.scene.layout_code()))
        .count();
    assert!(overlap <= 2, "{overlap}");
}

#[test]
fn every_boxed_answer_is_the_count_and_checks_vary() {
    let (_d, assets) = write(3);
    let pool = vision_task::sft_problems(3, 16).unwrap();
    let sft = rows(&assets.sft);
    assert_eq!(sft.len(), 200);
    let mut per_redundancy = [0usize; 4];
    let mut lengths: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for r in &sft {
        let image = r["images"][0].as_str().unwrap();
        let i: usize = image
            .strip_prefix("images/sft-")
            .and_then(|s| s.strip_suffix(".png"))
            .unwrap()
            .parse()
            .unwrap();
        let p = &pool[i];
        assert_eq!(r["prompt"], p.prompt.as_str());
        let response = r["response"].as_str().unwrap();
        assert_eq!(
            extract_boxed(response),
            Some(p.answer.as_str()),
            "{response}"
        );
        assert!(response.len() <= MAX_RESPONSE_CHARS);
        let lines: Vec<&str> = response.lines().collect();
        let colour = p.scene.target.name();
        assert!(
            lines[0].starts_with(&format!("{colour} squares: ")),
            "{response}"
        );
        assert!(
            lines[1].starts_with(&format!("{colour} discs: ")),
            "{response}"
        );
        let checks = lines.iter().filter(|l| l.starts_with("check ")).count();
        assert_eq!(lines.len(), 4 + checks);
        per_redundancy[checks] += 1;
        lengths
            .entry(p.level.as_str())
            .or_default()
            .push(response.len());
    }
    // redundancy uniform over 0..=3: 50 each (sd ≈ 6)
    assert!(
        per_redundancy.iter().all(|&c| (25..=75).contains(&c)),
        "{per_redundancy:?}"
    );
    assert_eq!(lengths.len(), 3);
    // the eval and train rows' answers are their pictures' counts too
    for (path, list) in [
        (
            &assets.train,
            vision_task::problems(Split::Train, 3, 24).unwrap(),
        ),
        (
            &assets.eval,
            vision_task::problems(Split::Eval, 3, 8).unwrap(),
        ),
    ] {
        for (r, p) in rows(path).iter().zip(&list) {
            assert_eq!(r["answer"], p.scene.count().to_string());
            assert_eq!(r["global_id"], p.global_id.as_str());
        }
    }
}

#[test]
fn pictures_decode_to_the_stated_size_and_keep_it_through_the_processor() {
    let (_d, assets) = write(4);
    let processor = ProcessorConfig::from_model_dir(&assets.model_dir).unwrap();
    assert_eq!((processor.min_pixels, processor.max_pixels), (3136, 7056));
    let data = assets.train.parent().unwrap();
    for r in rows(&assets.train).iter().take(6) {
        let path = data.join(r["images"][0].as_str().unwrap());
        let img = load_rgb(&path).unwrap();
        assert_eq!((img.height, img.width), (IMAGE_SIZE, IMAGE_SIZE));
        let processed = process_image_file(&path, &processor).unwrap();
        assert_eq!(processed.grid_thw, [1, 6, 6]);
        assert_eq!(
            processed.pixel_values.len(),
            PATCHES_PER_IMAGE * processor.patch_dim()
        );
    }
    // the PNG is the rendered scene, pixel for pixel
    let p = &vision_task::problems(Split::Train, 4, 1).unwrap()[0];
    let img = load_rgb(&data.join("images/train-000000.png")).unwrap();
    assert_eq!(img.pixels, p.scene.render());
}

#[test]
fn tokenizer_round_trips_the_vision_tokens_and_the_template_renders_image_items() {
    let (_d, assets) = write(1);
    let tok = Tokenizer::from_dir(&assets.model_dir).unwrap();
    assert_eq!(tok.vocab_size(), VL_VOCAB_SIZE);
    // the text demo's ids are kept: its tokens, then the four vision tokens
    let text_vocab = ares_runner::demo::tokenizer::vocabulary();
    assert_eq!(text_vocab.len(), VOCAB_SIZE);
    for (id, t) in text_vocab.iter().enumerate() {
        assert_eq!(tok.id_to_token(id as u32).as_deref(), Some(t.as_str()));
    }
    let ids = vl_special_ids();
    for (t, id) in [
        (VISION_START, ids.vision_start),
        (VISION_END, ids.vision_end),
        (IMAGE_PAD, ids.image_pad),
        (VIDEO_PAD, ids.video_pad),
    ] {
        assert_eq!(tok.token_to_id(t), Some(id), "{t}");
        assert_eq!(tok.encode(t, false).unwrap(), [id]);
        assert_eq!(tok.decode(&[id], false).unwrap(), t);
        assert_eq!(tok.decode(&[id], true).unwrap(), "");
    }
    let text = "<|vision_start|><|image_pad|><|vision_end|>how many red shapes?";
    let enc = tok.encode(text, false).unwrap();
    assert_eq!(enc[..3], [59, 61, 60]);
    assert_eq!(enc.len(), 3 + "how many red shapes?".len());
    assert_eq!(tok.decode(&enc, false).unwrap(), text);
    // every response of the SFT set round-trips exactly (questions lower-case: the
    // normaliser's, as in the text demo)
    for r in rows(&assets.sft) {
        let s = r["response"].as_str().unwrap();
        let ids = tok.encode(s, false).unwrap();
        assert_eq!(ids.len(), s.len());
        assert_eq!(tok.decode(&ids, false).unwrap(), s);
    }

    let chat = ChatTemplate::from_dir(&assets.model_dir).unwrap();
    let messages = json!([{"role": "user", "content": [
        {"type": "image"},
        {"type": "text", "text": "How many red shapes are in the picture?"},
    ]}]);
    let out = chat
        .render(messages.as_array().unwrap(), &RenderOptions::generation())
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many red shapes are \
         in the picture?<|im_end|>\n<|im_start|>assistant\n"
    );
    let video = json!([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "x"}]},
                       {"role": "assistant", "content": "y"}]);
    let out = chat
        .render(video.as_array().unwrap(), &RenderOptions::default())
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>x<|im_end|>\n\
         <|im_start|>assistant\ny<|im_end|>\n"
    );
}

#[test]
fn model_dir_loads_and_runs_a_rendered_demo_prompt() {
    let (_d, assets) = write(7);
    let ck = VlCheckpoint::load(&assets.model_dir).unwrap();
    let spec = TinyModelSpec::default();
    let vision = TinyVisionSpec::default();
    assert_eq!(ck.config.kind(), VlKind::Qwen25Vl);
    assert_eq!(ck.layout, WeightLayout::Hub);
    assert_eq!(ck.config.text.vocab_size, VL_VOCAB_SIZE);
    assert_eq!(ck.config.text.hidden_size, spec.hidden);
    assert_eq!(ck.config.mrope_section, [4, 6, 6]);
    let v = &ck.config.vision;
    assert_eq!(
        (v.depth, v.hidden, v.heads, v.intermediate, v.out_hidden),
        (2, vision.hidden, 2, vision.intermediate, spec.hidden)
    );
    assert_eq!(
        (v.patch_size, v.spatial_merge_size, v.window_size),
        (14, 2, 56)
    );
    assert!(!v.full_attention(0) && v.full_attention(1));
    let ids = vl_special_ids();
    assert_eq!(ck.config.tokens.image_pad, ids.image_pad);
    assert_eq!(ck.config.vision_start_token_id, ids.vision_start);

    // the language model is the text demo's initialisation of the same sizes and seed
    let text_dir = tempfile::tempdir().unwrap();
    write_random_model(
        text_dir.path(),
        &spec,
        VL_VOCAB_SIZE,
        ids.im_end,
        ids.endoftext,
        None,
        7,
    )
    .unwrap();
    let text = Checkpoint::load(text_dir.path()).unwrap();
    assert_eq!(ck.text, text.weights);
    let n_vision: usize = ck.vision.iter().map(|(_, t)| t.data.len()).sum();
    let n_text: usize = ck.text.tensors().iter().map(|(_, t)| t.data.len()).sum();
    eprintln!("parameters: language model {n_text}, vision tower {n_vision}");
    assert_eq!(n_text, spec.parameter_count(VL_VOCAB_SIZE));
    // tied like the text demo (no `lm_head.weight`); untied, the head is written and loads
    assert!(ck.config.text.tie_word_embeddings);
    let untied_dir = tempfile::tempdir().unwrap();
    let untied = TinyModelSpec {
        tie_embeddings: false,
        ..spec.clone()
    };
    write_random_vl_model(untied_dir.path(), &untied, &vision, 64, IMAGE_SIZE, 7).unwrap();
    let names: Vec<String> = ares_runner::hf::tensor_files::TensorFiles::open(untied_dir.path())
        .unwrap()
        .names()
        .map(str::to_owned)
        .collect();
    assert!(names.iter().any(|n| n == "lm_head.weight"));
    assert!(names.iter().any(|n| n == "visual.merger.mlp.2.weight"));
    let loaded = VlCheckpoint::load(untied_dir.path()).unwrap();
    assert!(!loaded.config.text.tie_word_embeddings);
    assert_eq!(loaded.config.text.vocab_size, 64);

    // a train row through the trainer's data path: load, render, tokenize, process, expand
    let examples = load_dataset(&assets.train, &DataKeys::default()).unwrap();
    let example = &examples[0];
    assert_eq!(example.images.len(), 1);
    let tok = Tokenizer::from_dir(&assets.model_dir).unwrap();
    let chat = ChatTemplate::from_dir(&assets.model_dir).unwrap();
    let rendered = render_prompt(&chat, example, None, None, &MediaKeys::default()).unwrap();
    assert!(
        rendered
            .starts_with("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many "),
        "{rendered}"
    );
    let prompt_ids = tok.encode(&rendered, false).unwrap();
    let processor =
        MediaProcessor::from_model_dir(&assets.model_dir, &DataConfig::default()).unwrap();
    let media = load_media(example, &processor).unwrap();
    assert_eq!(media.images[0].grid_thw, [1, 6, 6]);
    assert_eq!(
        vision_token_count(example, &processor).unwrap(),
        TOKENS_PER_IMAGE
    );
    let vision_batch: VisionBatch = media.vision_batch();
    let expanded = expand_placeholders(
        &prompt_ids,
        ck.config.tokens,
        &vision_batch.image_grids,
        &[],
        2,
    )
    .unwrap();
    assert_eq!(expanded.len(), prompt_ids.len() - 1 + TOKENS_PER_IMAGE);
    assert_eq!(
        processor
            .expanded_prompt_length(example, prompt_ids.len())
            .unwrap(),
        expanded.len()
    );
    eprintln!(
        "prompt: {} tokens rendered, {} expanded ({} image tokens from {} patches)",
        prompt_ids.len(),
        expanded.len(),
        TOKENS_PER_IMAGE,
        PATCHES_PER_IMAGE
    );

    let model = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    let seq = expanded.len();
    let mask = vec![1u32; seq];
    let logits = model
        .forward_logits(&expanded, &mask, 1, &vision_batch)
        .unwrap();
    let started = Instant::now();
    let runs = 5;
    for _ in 0..runs {
        model
            .forward_logits(&expanded, &mask, 1, &vision_batch)
            .unwrap();
    }
    eprintln!(
        "forward_logits (1 prompt, {seq} tokens, CPU, this build's profile): {:.2} ms",
        started.elapsed().as_secs_f64() * 1e3 / runs as f64
    );
    assert_eq!(logits.len(), seq * VL_VOCAB_SIZE);
    assert!(logits.iter().all(|x| x.is_finite()));
    // the picture matters: another picture, other logits after it
    let other = load_media(&examples[1], &processor).unwrap().vision_batch();
    let logits2 = model.forward_logits(&expanded, &mask, 1, &other).unwrap();
    let last = (seq - 1) * VL_VOCAB_SIZE;
    assert_ne!(logits[last..], logits2[last..]);
    // the tokens before the picture see no picture
    assert_eq!(logits[..VL_VOCAB_SIZE], logits2[..VL_VOCAB_SIZE]);

    // sampling: two prompts of the same picture, tokens inside the vocabulary
    let out = model
        .generator()
        .unwrap()
        .generate(
            &GenerateRequest {
                prompts: vec![expanded.clone(), expanded.clone()],
                max_new_tokens: 8,
                eos_ids: vec![ids.im_end],
                sampling: Sampling::Sample {
                    temperature: 1.0,
                    top_k: None,
                    top_p: 1.0,
                    min_p: 0.0,
                },
                seed: 1,
            },
            &[vision_batch.clone(), vision_batch],
            |_, _| {},
        )
        .unwrap();
    for t in &out.tokens {
        assert!(!t.is_empty() && t.len() <= 8);
        assert!(t.iter().all(|&id| (id as usize) < VL_VOCAB_SIZE));
    }
}
