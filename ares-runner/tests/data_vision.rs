//! Multimodal datasets end to end: the JSON lines and Parquet fixtures (tests/fixtures/data:
//! `vision.jsonl`, `vision.parquet` written by `make_vision_parquet.py` in the layout
//! Hugging Face `datasets` gives EasyR1 data, and the PNG files under `images/`), rendered
//! through the tiny Qwen2-VL fixtures' chat templates (equal to transformers' prompts in
//! ares-model's `cases.json`), processed into the model's inputs, the expanded token counts
//! for prompt-length filtering, videos as frame lists, frame directories and files, and every
//! bad-data error naming the file, the row, its `global_id` and the column.

use std::fs;
use std::path::{Path, PathBuf};

use ares_runner::config::DataConfig;
use ares_runner::data::{
    DataError, DataKeys, Example, MediaKeys, MediaProcessor, MediaSource, Prompt, PromptTemplate,
    filter_by_prompt_length, load_dataset, load_dataset_with_media, load_media, render_prompt,
    vision_token_count,
};
use ares_runner::hf::chat::{ChatMessage, ChatTemplate};
use ares_runner::hf::tokenizer::Tokenizer;
use ares_runner::vision::config::VlConfig;
use ares_runner::vision::processor::{
    ProcessorConfig, VideoSampling, decode_rgb, process_image, process_image_file,
    process_video_files,
};
use ares_runner::vision::video::process_video_path;
use ares_runner::vision::video::{Ffmpeg, INSTALL_HINT};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/data")
        .join(name)
}

fn vl_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ares-model/tests/fixtures/vl")
}

const MODELS: [&str; 2] = ["qwen2_vl_tiny", "qwen2_5_vl_tiny"];

fn load(path: &Path) -> Result<Vec<Example>, DataError> {
    load_dataset(path, &DataKeys::default())
}

fn err(path: &Path) -> String {
    match load(path) {
        Ok(e) => panic!(
            "{}: expected an error, got {} examples",
            path.display(),
            e.len()
        ),
        Err(e) => e.to_string(),
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, text).unwrap();
    p
}

/// The transformers prompt of a `cases.json` case.
fn case_prompt(case: &str) -> String {
    let cases: Value = serde_json::from_slice(&fs::read(vl_root().join("cases.json")).unwrap())
        .expect("cases.json");
    cases["cases"][case]["prompt"].as_str().unwrap().to_owned()
}

fn processor(model: &str, data: &DataConfig) -> MediaProcessor {
    MediaProcessor::from_model_dir(&vl_root().join(model), data).unwrap()
}

#[test]
fn jsonl_rows_with_placeholders_content_items_and_bytes() {
    let ex = load(&fixture("vision.jsonl")).unwrap();
    assert_eq!(ex.len(), 3);
    let images = fixture("images");
    let png = fs::read(images.join("image_56x84.png")).unwrap();

    // `<image>` in a text prompt; the path is relative to the dataset file
    assert_eq!(ex[0].global_id, "img-0");
    assert_eq!(
        ex[0].prompt,
        Prompt::Text("<image>Describe this picture.".into())
    );
    assert_eq!(
        ex[0].images,
        vec![MediaSource::Path(images.join("image_56x84.png"))]
    );
    assert!(ex[0].videos.is_empty());
    assert_eq!(ex[0].difficulty.as_deref(), Some("easy"));

    // content items become placeholders; a `{bytes: null, path}` struct and base64 bytes
    assert_eq!(
        ex[1].prompt,
        Prompt::Messages(vec![ChatMessage::user("Compare <image> with <image>.")])
    );
    assert_eq!(
        ex[1].images,
        vec![
            MediaSource::Path(images.join("two_a_70x45.png")),
            MediaSource::Bytes(png),
        ]
    );
    // a text row, exactly as before
    assert_eq!(ex[2].global_id, "vision-2");
    assert!(!ex[2].has_media());
    assert_eq!(ex[2].prompt, Prompt::Text("Tell me a story.".into()));

    // examples (as checkpoints keep them) round-trip through JSON
    let text = serde_json::to_string(&ex).unwrap();
    let back: Vec<Example> = serde_json::from_str(&text).unwrap();
    assert_eq!(back, ex);
}

#[test]
fn prompts_render_as_transformers_does() {
    let ex = load(&fixture("vision.jsonl")).unwrap();
    let keys = MediaKeys::default();
    for model in MODELS {
        let chat = ChatTemplate::from_dir(&vl_root().join(model)).unwrap();
        for (e, case) in ex.iter().zip(["image", "two_images", "text"]) {
            let text = render_prompt(&chat, e, None, None, &keys).unwrap();
            assert_eq!(text, case_prompt(case), "{model} {case}");
        }
        // a system turn replaces the template's default one
        let text = render_prompt(&chat, &ex[0], None, Some("Count."), &keys).unwrap();
        assert!(
            text.starts_with("<|im_start|>system\nCount.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe"),
            "{text}"
        );
        // format_prompt wraps the text around the placeholder, as EasyR1's templates do
        let t =
            PromptTemplate::from_source("math.jinja", "{{ content | trim }} Answer in \\boxed{}.")
                .unwrap();
        let text = render_prompt(&chat, &ex[0], Some(&t), None, &keys).unwrap();
        assert!(
            text.contains("<|vision_start|><|image_pad|><|vision_end|>Describe this picture. Answer in \\boxed{}.<|im_end|>"),
            "{text}"
        );
        // a template that drops the placeholder is caught
        let t = PromptTemplate::from_source("drop.jinja", "{{ content | replace('<image>', '') }}")
            .unwrap();
        let e = render_prompt(&chat, &ex[0], Some(&t), None, &keys)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("row 0 (global_id `img-0`): `images`: after format_prompt: the row has 1 image(s) but its prompt has 0 `<image>` placeholder(s)"),
            "{e}"
        );
    }
}

#[test]
fn media_become_the_processor_outputs_and_token_counts_match() {
    let ex = load(&fixture("vision.jsonl")).unwrap();
    let images = fixture("images");
    for model in MODELS {
        let dir = vl_root().join(model);
        let p = processor(model, &DataConfig::default());
        let model_cfg = ProcessorConfig::from_model_dir(&dir).unwrap();
        assert_eq!(p.config, model_cfg, "None keeps the model's bounds");
        let m0 = load_media(&ex[0], &p).unwrap();
        assert_eq!(
            m0.images,
            vec![process_image_file(&images.join("image_56x84.png"), &model_cfg).unwrap()]
        );
        assert!(m0.videos.is_empty() && m0.second_per_grid_ts.is_empty());
        let m1 = p.load(&ex[1]).unwrap();
        assert_eq!(
            m1.images,
            vec![
                process_image_file(&images.join("two_a_70x45.png"), &model_cfg).unwrap(),
                m0.images[0].clone(),
            ]
        );
        let batch = m1.vision_batch();
        assert_eq!(
            batch.image_grids,
            vec![m1.images[0].grid_thw, m1.images[1].grid_thw]
        );
        assert!(load_media(&ex[2], &p).unwrap().is_empty());

        // the token count from the sizes alone equals the processed grids', and the
        // expanded prompt length equals the model's expansion of the rendered ids
        let vl = VlConfig::from_dir(&dir).unwrap();
        let tokenizer = Tokenizer::from_dir(&dir).unwrap();
        let chat = ChatTemplate::from_dir(&dir).unwrap();
        for (e, media) in ex.iter().zip([&m0, &m1]) {
            let n = vision_token_count(e, &p).unwrap();
            assert_eq!(n, media.token_count(p.config.merge_size), "{model}");
            assert!(n > 0);
            let text = render_prompt(&chat, e, None, None, &p.keys).unwrap();
            let ids = tokenizer.encode(&text, false).unwrap();
            let b = media.vision_batch();
            let expanded = vl
                .expand_prompt(&ids, &b.image_grids, &b.video_grids)
                .unwrap();
            assert_eq!(
                p.expanded_prompt_length(e, ids.len()).unwrap(),
                expanded.len(),
                "{model} {}",
                e.global_id
            );
            // and the image tokens in it (what the memory plan sizes the tower with)
            assert_eq!(
                p.expanded_prompt(e, ids.len()).unwrap(),
                (expanded.len(), n),
                "{model}"
            );
        }
        assert_eq!(vision_token_count(&ex[2], &p).unwrap(), 0);
        assert_eq!(p.expanded_prompt_length(&ex[2], 17).unwrap(), 17);
        assert_eq!(p.expanded_prompt(&ex[2], 17).unwrap(), (17, 0));
    }
}

#[test]
fn pixel_bounds_come_from_the_data_section() {
    let ex = load(&fixture("vision.jsonl")).unwrap();
    let model = "qwen2_vl_tiny";
    let base = processor(model, &DataConfig::default());
    let small = DataConfig {
        min_pixels: Some(28 * 28),
        max_pixels: Some(28 * 28),
        ..DataConfig::default()
    };
    let p = processor(model, &small);
    assert_eq!((p.config.min_pixels, p.config.max_pixels), (784, 784));
    assert_eq!(p.config.video, base.config.video);
    let m = load_media(&ex[0], &p).unwrap();
    assert_eq!(m.images[0].grid_thw, [1, 2, 2]);
    assert_eq!(vision_token_count(&ex[0], &p).unwrap(), 1);
    let big = DataConfig {
        min_pixels: Some(112 * 112),
        ..DataConfig::default()
    };
    let p = processor(model, &big);
    let m = load_media(&ex[0], &p).unwrap();
    let [t, h, w] = m.images[0].grid_thw;
    assert!(
        t * h * w * 14 * 14 >= 112 * 112,
        "{:?}",
        m.images[0].grid_thw
    );
    assert_eq!(vision_token_count(&ex[0], &p).unwrap(), m.token_count(2));
    // bounds that do not fit the model's
    let bad = DataConfig {
        min_pixels: Some(usize::MAX),
        ..DataConfig::default()
    };
    let e = MediaProcessor::from_model_dir(&vl_root().join(model), &bad)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("image processor: data.min_pixels = "), "{e}");
    let e = MediaProcessor::from_model_dir(&fixture("images"), &DataConfig::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no processor_config.json or preprocessor_config.json"),
        "{e}"
    );
}

#[test]
fn parquet_image_structs() {
    let path = fixture("vision.parquet");
    let ex = load(&path).unwrap();
    assert_eq!(ex.len(), 3);
    let images = fixture("images");
    let png = fs::read(images.join("image_56x84.png")).unwrap();
    // bytes win over the path (which does not exist)
    assert_eq!(ex[0].global_id, "geo-0");
    assert_eq!(ex[0].images, vec![MediaSource::Bytes(png.clone())]);
    assert_eq!(
        ex[1].images,
        vec![
            MediaSource::Path(images.join("two_a_70x45.png")),
            MediaSource::Bytes(png),
        ]
    );
    assert_eq!(
        ex[1].prompt,
        Prompt::Text("Compare <image> with <image>.".into())
    );
    assert!(!ex[2].has_media());
    // the same processing as the JSON lines rows
    let jsonl = load(&fixture("vision.jsonl")).unwrap();
    let p = processor("qwen2_5_vl_tiny", &DataConfig::default());
    assert_eq!(
        load_media(&ex[1], &p).unwrap(),
        load_media(&jsonl[1], &p).unwrap()
    );
    assert_eq!(
        vision_token_count(&ex[0], &p).unwrap(),
        vision_token_count(&jsonl[0], &p).unwrap()
    );
    let chat = ChatTemplate::from_dir(&vl_root().join("qwen2_5_vl_tiny")).unwrap();
    assert_eq!(
        render_prompt(&chat, &ex[1], None, None, &p.keys).unwrap(),
        case_prompt("two_images")
    );
}

#[test]
fn filtering_counts_the_expanded_image_tokens() {
    let ex = load(&fixture("vision.jsonl")).unwrap();
    let dir = vl_root().join("qwen2_vl_tiny");
    let p = processor("qwen2_vl_tiny", &DataConfig::default());
    let chat = ChatTemplate::from_dir(&dir).unwrap();
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let rendered: Vec<usize> = ex
        .iter()
        .map(|e| {
            let text = render_prompt(&chat, e, None, None, &p.keys).unwrap();
            tokenizer.encode(&text, false).unwrap().len()
        })
        .collect();
    let expanded: Vec<usize> = ex
        .iter()
        .zip(&rendered)
        .map(|(e, &n)| p.expanded_prompt_length(e, n).unwrap())
        .collect();
    // a limit every rendered prompt fits, but not the two-image prompt once expanded
    let max = *rendered.iter().max().unwrap();
    assert!(expanded[1] > max, "{rendered:?} {expanded:?}");
    let (kept, dropped) = filter_by_prompt_length(ex, &expanded, max).unwrap();
    assert_eq!(dropped, 1 + usize::from(expanded[0] > max));
    assert!(kept.iter().all(|e| e.global_id != "img-1"));
}

/// The frames of ares-model's video case (4 PNG files).
fn frames() -> Vec<PathBuf> {
    (0..4)
        .map(|i| vl_root().join(format!("images/video_frame_{i}.png")))
        .collect()
}

#[test]
fn videos_as_frame_lists_and_directories() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let clip = d.join("clip");
    fs::create_dir(&clip).unwrap();
    for (i, f) in frames().iter().enumerate() {
        fs::copy(f, clip.join(format!("{i:03}.png"))).unwrap();
    }
    let list: Vec<String> = frames().iter().map(|f| f.display().to_string()).collect();
    let rows = [
        serde_json::json!({"prompt": "<video>What happens here?", "answer": "x", "videos": [list]}),
        serde_json::json!({"prompt": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens here?"}]}],
                           "answer": "x", "videos": ["clip"]}),
    ];
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    let path = write(d, "clips.jsonl", &text);
    let ex = load(&path).unwrap();
    assert_eq!(ex[0].videos, vec![MediaSource::Frames(frames())]);
    assert_eq!(ex[1].videos, vec![MediaSource::Path(clip.clone())]);
    for model in MODELS {
        let data = DataConfig {
            video_fps: 2.5,
            ..DataConfig::default()
        };
        let p = processor(model, &data);
        let chat = ChatTemplate::from_dir(&vl_root().join(model)).unwrap();
        let want = process_video_files(&frames(), VideoSampling::default(), &p.config).unwrap();
        for e in &ex {
            assert_eq!(
                render_prompt(&chat, e, None, None, &p.keys).unwrap(),
                case_prompt("video"),
                "{model}"
            );
            let m = load_media(e, &p).unwrap();
            assert_eq!(m.videos, vec![want.clone()], "{model}");
            assert_eq!(m.second_per_grid_ts, vec![2.0 / 2.5]);
            assert_eq!(m.vision_batch().video_grids, vec![want.video_grid_thw]);
            assert_eq!(
                vision_token_count(e, &p).unwrap(),
                m.token_count(p.config.merge_size)
            );
        }
    }
}

/// The ffmpeg the processor would use, or `None` (with a note) when there is none and
/// `ARES_REQUIRE_FFMPEG` is not `1`.
fn ffmpeg_or_skip() -> Option<Ffmpeg> {
    let ffmpeg = Ffmpeg::from_env();
    match ffmpeg.version() {
        Ok(_) => Some(ffmpeg),
        Err(why) => {
            let required = std::env::var("ARES_REQUIRE_FFMPEG").is_ok_and(|v| v == "1");
            assert!(!required, "ARES_REQUIRE_FFMPEG=1 but {why}");
            eprintln!("skipped: {why} ({INSTALL_HINT})");
            None
        }
    }
}

#[test]
fn video_files_by_path_and_bytes() {
    if ffmpeg_or_skip().is_none() {
        return;
    }
    let video = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../ares-model/tests/fixtures/vision/video/moving_rgb_10fps.mp4");
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    fs::copy(&video, d.join("clip.mp4")).unwrap();
    let bytes = fs::read(&video).unwrap();
    let b64 = {
        // the loader's own serde form of bytes is base64
        let v = serde_json::to_value(MediaSource::Bytes(bytes.clone())).unwrap();
        v["bytes"].as_str().unwrap().to_owned()
    };
    let text = format!(
        "{}\n{}\n",
        serde_json::json!({"prompt": "<video>Which way does it move?", "answer": "left", "videos": ["clip.mp4"]}),
        serde_json::json!({"prompt": "<video>Which way does it move?", "answer": "left", "videos": [{"bytes": b64}]}),
    );
    let path = write(d, "files.jsonl", &text);
    let ex = load(&path).unwrap();
    assert_eq!(ex[0].videos, vec![MediaSource::Path(d.join("clip.mp4"))]);
    assert_eq!(ex[1].videos, vec![MediaSource::Bytes(bytes)]);
    let p = processor("qwen2_5_vl_tiny", &DataConfig::default());
    let want = process_video_path(
        &video,
        VideoSampling {
            source_fps: None,
            fps: Some(2.0),
        },
        &p.config,
    )
    .unwrap();
    for e in &ex {
        let m = load_media(e, &p).unwrap();
        assert_eq!(m.videos, vec![want.clone()]);
        assert_eq!(m.second_per_grid_ts, vec![1.0]);
        assert_eq!(
            vision_token_count(e, &p).unwrap(),
            m.token_count(p.config.merge_size)
        );
    }
    // no temporary file is left behind for the bytes
    let left: Vec<_> = fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("ares-video-{}-", std::process::id()))
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Every file of `dir` with its size, to show that a failed load writes nothing.
fn listing(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut out: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.path(), e.metadata().unwrap().len())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn bad_media_name_the_file_row_global_id_and_column() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    fs::create_dir(d.join("img")).unwrap();
    fs::copy(fixture("images/two_a_70x45.png"), d.join("img/ok.png")).unwrap();
    let ok =
        r#"{"prompt": "<image>Fine.", "answer": "1", "images": ["img/ok.png"], "global_id": "ok"}"#;
    let missing = d.join("img/missing.png");
    let cases: Vec<(PathBuf, String)> = vec![
        (
            write(
                d,
                "missing.jsonl",
                &format!("{ok}\n{}\n", r#"{"prompt": "<image>Gone.", "answer": "1", "images": ["img/missing.png"], "global_id": "q7"}"#),
            ),
            format!(
                "missing.jsonl: row 1 (line 2) (global_id `q7`): `images`: image 0: no such file: {}",
                missing.display()
            ),
        ),
        (
            write(
                d,
                "missing_struct.jsonl",
                r#"{"prompt": "<image><image>Two.", "answer": "1", "images": ["img/ok.png", {"bytes": null, "path": "img/missing.png"}]}"#,
            ),
            format!(
                "missing_struct.jsonl: row 0 (line 1) (global_id `missing_struct-0`): `images`: image 1: no such file: {}",
                missing.display()
            ),
        ),
        (
            write(
                d,
                "type.jsonl",
                &format!("{ok}\n{}\n", r#"{"prompt": "<image>Number.", "answer": "1", "images": 42, "global_id": "n"}"#),
            ),
            "type.jsonl: row 1 (line 2) (global_id `n`): `images`: a number, expected a list of images (paths or {bytes, path} structs)".into(),
        ),
        (
            write(
                d,
                "item_type.jsonl",
                r#"{"prompt": "<image>", "answer": "1", "images": [3.5], "global_id": "i"}"#,
            ),
            "item_type.jsonl: row 0 (line 1) (global_id `i`): `images`: image 0: a number, expected a path or a {bytes, path} struct".into(),
        ),
        (
            write(
                d,
                "video_type.jsonl",
                r#"{"prompt": "<video>", "answer": "1", "videos": true, "global_id": "v"}"#,
            ),
            "video_type.jsonl: row 0 (line 1) (global_id `v`): `videos`: a boolean, expected a list of videos".into(),
        ),
        (
            write(
                d,
                "too_few.jsonl",
                r#"{"prompt": "<image>Compare with <image>.", "answer": "1", "images": ["img/ok.png"], "global_id": "f"}"#,
            ),
            "too_few.jsonl: row 0 (line 1) (global_id `f`): `images`: the row has 1 image(s) but its prompt has 2 `<image>` placeholder(s)".into(),
        ),
        (
            write(
                d,
                "no_placeholder.jsonl",
                r#"{"prompt": "Where is the image?", "answer": "1", "images": ["img/ok.png"], "global_id": "p"}"#,
            ),
            "no_placeholder.jsonl: row 0 (line 1) (global_id `p`): `images`: the row has 1 image(s) but its prompt has 0 `<image>` placeholder(s)".into(),
        ),
        (
            write(
                d,
                "items.jsonl",
                r#"{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}], "answer": "1", "images": ["img/ok.png"], "global_id": 9}"#,
            ),
            "items.jsonl: row 0 (line 1) (global_id `9`): `images`: the row has 1 image(s) but its prompt has 2 `<image>` placeholder(s)".into(),
        ),
        (
            write(
                d,
                "item_no_media.jsonl",
                r#"{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}], "answer": "1", "global_id": "e"}"#,
            ),
            "item_no_media.jsonl: row 0 (line 1) (global_id `e`): `images`: the row has 0 image(s) but its prompt has 1 `<image>` placeholder(s)".into(),
        ),
        (
            write(
                d,
                "videos.jsonl",
                r#"{"prompt": "<image>and<video>", "answer": "1", "images": ["img/ok.png"], "videos": [["img/ok.png", "img/ok.png"], ["img/ok.png"]], "global_id": "vv"}"#,
            ),
            "videos.jsonl: row 0 (line 1) (global_id `vv`): `videos`: the row has 2 video(s) but its prompt has 1 `<video>` placeholder(s)".into(),
        ),
        (
            write(
                d,
                "image_as_video.jsonl",
                r#"{"prompt": "<video>", "answer": "1", "videos": ["img/ok.png"], "global_id": "iv"}"#,
            ),
            format!(
                "image_as_video.jsonl: row 0 (line 1) (global_id `iv`): `videos`: video 0: {} is a single image, not a video",
                d.join("img/ok.png").display()
            ),
        ),
        (
            write(
                d,
                "base64.jsonl",
                r#"{"prompt": "<image>", "answer": "1", "images": [{"bytes": "not base64!"}], "global_id": "b"}"#,
            ),
            "base64.jsonl: row 0 (line 1) (global_id `b`): `images`: image 0: `bytes`: not base64 text".into(),
        ),
        (
            fixture("vision_bad_type.parquet"),
            "vision_bad_type.parquet: row 1 (global_id `t-1`): `images`: a number, expected a list of images".into(),
        ),
        (
            fixture("vision_missing.parquet"),
            format!(
                "vision_missing.parquet: row 1 (global_id `m-1`): `images`: image 0: no such file: {}",
                fixture("images/missing.png").display()
            ),
        ),
    ];
    let before = listing(d);
    for (path, want) in &cases {
        let e = err(path);
        assert!(
            e.contains(want.as_str()),
            "{}: got `{e}`, want `{want}`",
            path.display()
        );
        assert!(matches!(load(path), Err(DataError::Media { .. })));
    }
    assert_eq!(listing(d), before, "a failed load writes nothing");
    // a row without any media column stays a text row even with `<image>` in its text
    let path = write(
        d,
        "html.jsonl",
        r#"{"prompt": "What does <image> do in HTML?", "answer": "nothing"}"#,
    );
    assert!(!load(&path).unwrap()[0].has_media());
}

#[test]
fn configured_columns() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    fs::copy(fixture("images/two_a_70x45.png"), d.join("a.png")).unwrap();
    let path = write(
        d,
        "custom.jsonl",
        r#"{"prompt": "<image>x", "answer": "1", "media": {"pics": ["a.png"]}, "images": 5}"#,
    );
    let media = MediaKeys {
        image: "media.pics".into(),
        video: "clips".into(),
        base_dir: None,
    };
    let ex = load_dataset_with_media(&path, &DataKeys::default(), &media).unwrap();
    assert_eq!(ex[0].images, vec![MediaSource::Path(d.join("a.png"))]);
    let path = write(
        d,
        "custom_bad.jsonl",
        r#"{"prompt": "<image>x", "answer": "1", "media": {"pics": "gone.png"}}"#,
    );
    let e = load_dataset_with_media(&path, &DataKeys::default(), &media)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("(global_id `custom_bad-0`): `media.pics`: image 0: no such file"),
        "{e}"
    );
    // MediaKeys from the config
    let data = DataConfig {
        image_key: "media.pics".into(),
        video_key: "clips".into(),
        ..DataConfig::default()
    };
    assert_eq!(MediaKeys::from_config(&data), media);
    assert_eq!(DataKeys::from_config(&data), DataKeys::default());

    // data.image_dir: relative paths are joined to it (EasyR1), absolute ones kept
    let images = tempfile::tempdir().unwrap();
    fs::copy(
        fixture("images/two_a_70x45.png"),
        images.path().join("b.png"),
    )
    .unwrap();
    let absolute = d.join("a.png");
    let path = write(
        d,
        "elsewhere.jsonl",
        &format!(
            r#"{{"prompt": "<image><image>x", "answer": "1", "media": {{"pics": ["b.png", {:?}]}}}}"#,
            absolute.display().to_string()
        ),
    );
    let data = DataConfig {
        image_dir: Some(images.path().display().to_string()),
        ..data
    };
    let media = MediaKeys::from_config(&data);
    let ex = load_dataset_with_media(&path, &DataKeys::default(), &media).unwrap();
    assert_eq!(
        ex[0].images,
        vec![
            MediaSource::Path(images.path().join("b.png")),
            MediaSource::Path(absolute)
        ]
    );
    // a path missing there is named with the directory it was looked for in
    let path = write(
        d,
        "elsewhere_bad.jsonl",
        r#"{"prompt": "<image>x", "answer": "1", "media": {"pics": ["a.png"]}}"#,
    );
    let e = load_dataset_with_media(&path, &DataKeys::default(), &media)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no such file") && e.contains(&images.path().display().to_string()),
        "{e}"
    );
}

#[test]
fn undecodable_media_are_named_when_processed() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    fs::write(d.join("broken.png"), b"\x89PNG\r\n\x1a\nnot really").unwrap();
    let path = write(
        d,
        "broken.jsonl",
        r#"{"prompt": "<image><image>", "answer": "1", "images": [{"bytes": "aGVsbG8="}, "broken.png"], "global_id": "br"}"#,
    );
    // loading only checks that files exist
    let ex = load(&path).unwrap();
    let p = processor("qwen2_vl_tiny", &DataConfig::default());
    let e = load_media(&ex[0], &p).unwrap_err().to_string();
    assert!(
        e.starts_with("row 0 (global_id `br`): `images`: image 0: "),
        "{e}"
    );
    let e = vision_token_count(&ex[0], &p).unwrap_err().to_string();
    assert!(
        e.starts_with("row 0 (global_id `br`): `images`: image 0: "),
        "{e}"
    );
    let only_file = Example {
        images: vec![ex[0].images[1].clone()],
        prompt: Prompt::Text("<image>".into()),
        ..ex[0].clone()
    };
    let e = load_media(&only_file, &p).unwrap_err().to_string();
    assert!(
        e.starts_with("row 0 (global_id `br`): `images`: image 0: ") && e.contains("broken.png"),
        "{e}"
    );
    // the inline bytes path decodes what the file path decodes
    let png = fs::read(fixture("images/two_a_70x45.png")).unwrap();
    let img = decode_rgb(&png, Path::new("x")).unwrap();
    let inline = Example {
        images: vec![MediaSource::Bytes(png)],
        ..only_file
    };
    assert_eq!(
        load_media(&inline, &p).unwrap().images,
        vec![process_image(&img, &p.config).unwrap()]
    );
}
