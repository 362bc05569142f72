//! Datasets end to end: the JSON lines fixtures (tests/fixtures/data), verl-style nested
//! Parquet written here with the parquet crate in pyarrow's layout (3-level lists, struct
//! columns, snappy), directories, every bad-input error, templates, filtering and the
//! sampler over a loaded dataset.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ares_runner::data::{
    DataError, DataKeys, EpochSampler, Example, Prompt, PromptTemplate, filter_by_prompt_length,
    load_dataset,
};
use ares_runner::hf::chat::ChatMessage;
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, DoubleType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/data")
        .join(name)
}

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

#[test]
fn jsonl_fixture() {
    let path = fixture("math.jsonl");
    let ex = load(&path).unwrap();
    assert_eq!(ex.len(), 4);

    assert_eq!(ex[0].global_id, "add-1");
    assert_eq!(ex[0].prompt, Prompt::Text("What is 2 + 3?".into()));
    assert_eq!(ex[0].answer, "5");
    assert_eq!(ex[0].difficulty.as_deref(), Some("easy"));
    assert_eq!(ex[0].row, 0);

    // the blank line is not a row; no global_id → `<stem>-<row>`; `ground_truth` fallback
    assert_eq!(ex[1].row, 1);
    assert_eq!(ex[1].global_id, "math-1");
    assert_eq!(
        ex[1].prompt,
        Prompt::Messages(vec![ChatMessage::user("Simplify 6/8.")])
    );
    assert_eq!(ex[1].answer, r"\frac{3}{4}");

    // verl row: reward_model.ground_truth, integer global_id, empty images allowed
    assert_eq!(ex[2].global_id, "7");
    assert_eq!(ex[2].answer, "42");
    assert_eq!(ex[2].difficulty.as_deref(), Some("hard"));
    assert_eq!(ex[2].prompt.to_messages().len(), 2);
    assert_eq!(
        ex[2].prompt.question(),
        "A pen costs 3 dollars. How much do 14 pens cost?"
    );

    // `answer` wins over the fallbacks; numbers become text
    assert_eq!(ex[3].answer, "-1");
    assert_eq!(ex[3].difficulty, None);
    assert!(ex.iter().all(|e| e.rubrics.is_empty()));

    // loading is deterministic (generated ids are stable)
    assert_eq!(load(&path).unwrap(), ex);
}

#[test]
fn rubric_fixture() {
    let ex = load(&fixture("rubrics.jsonl")).unwrap();
    assert_eq!(ex.len(), 2);
    // a rubric row needs no answer
    assert_eq!(ex[0].answer, "");
    let r = &ex[0].rubrics;
    assert_eq!(r.len(), 3);
    assert_eq!(r[0].criterion, "Identifies the likely cause");
    assert_eq!(r[0].points, 8.0);
    assert_eq!(r[0].keywords, ["viral", "infection"]);
    assert_eq!(r[2].points, -2.0);
    assert_eq!(r[2].regex.as_deref(), Some(r"(?i)\bantibiotics?\b"));
    // rubrics given as a JSON string, `description` for the text, one keyword as a string
    let r = &ex[1].rubrics;
    assert_eq!(r[0].criterion, "Mentions sunlight");
    assert_eq!(r[0].keywords, ["light"]);
    assert_eq!(r[1].regex.as_deref(), Some("chlorophyll"));
    assert_eq!(ex[1].answer, "light to chemical energy");
}

#[test]
fn custom_keys() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "custom.jsonl",
        r#"{"question": {"text": "q"}, "solution": "s", "level": "3", "uid": "u1", "crit": [{"criterion": "c", "points": 1}]}"#,
    );
    let keys = DataKeys {
        prompt: "question.text".into(),
        answer: "solution".into(),
        difficulty: "level".into(),
        global_id: "uid".into(),
        rubrics: "crit".into(),
    };
    let ex = load_dataset(&p, &keys).unwrap();
    assert_eq!(ex[0].prompt, Prompt::Text("q".into()));
    assert_eq!(ex[0].answer, "s");
    assert_eq!(ex[0].difficulty.as_deref(), Some("3"));
    assert_eq!(ex[0].global_id, "u1");
    assert_eq!(ex[0].rubrics.len(), 1);
}

const VERL_SCHEMA: &str = "
message schema {
  OPTIONAL BYTE_ARRAY data_source (UTF8);
  OPTIONAL group prompt (LIST) {
    REPEATED group list {
      OPTIONAL group element {
        OPTIONAL BYTE_ARRAY content (UTF8);
        OPTIONAL BYTE_ARRAY role (UTF8);
      }
    }
  }
  OPTIONAL group reward_model {
    OPTIONAL BYTE_ARRAY ground_truth (UTF8);
    OPTIONAL group rubrics (LIST) {
      REPEATED group list {
        OPTIONAL group element {
          OPTIONAL BYTE_ARRAY criterion (UTF8);
          OPTIONAL DOUBLE points;
        }
      }
    }
  }
  OPTIONAL BYTE_ARRAY difficulty (UTF8);
  OPTIONAL INT64 global_id;
  OPTIONAL group images (LIST) {
    REPEATED group list {
      OPTIONAL BYTE_ARRAY element (UTF8);
    }
  }
}";

fn bytes(v: &[&str]) -> Vec<ByteArray> {
    v.iter().map(|s| ByteArray::from(*s)).collect()
}

/// Two verl-style rows in pyarrow's layout; `image` puts one image path in row 1.
/// Levels per leaf (values only where the definition level is the maximum).
fn write_verl_parquet(path: &Path, image: bool) {
    let schema = Arc::new(parse_message_type(VERL_SCHEMA).unwrap());
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .build(),
    );
    let file = fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, schema, props).unwrap();
    let mut rg = writer.next_row_group().unwrap();
    let mut leaf = 0;
    while let Some(mut col) = rg.next_column().unwrap() {
        match leaf {
            // data_source: row 0 "gsm8k", row 1 null
            0 => col
                .typed::<ByteArrayType>()
                .write_batch(&bytes(&["gsm8k"]), Some(&[1, 0]), None)
                .map(|_| ()),
            // prompt.list.element.content (max def 4, rep 1): row 0 two messages, row 1 one
            1 => col
                .typed::<ByteArrayType>()
                .write_batch(
                    &bytes(&["Be brief.", "What is 6*7?", "Half of one?"]),
                    Some(&[4, 4, 4]),
                    Some(&[0, 1, 0]),
                )
                .map(|_| ()),
            2 => col
                .typed::<ByteArrayType>()
                .write_batch(
                    &bytes(&["system", "user", "user"]),
                    Some(&[4, 4, 4]),
                    Some(&[0, 1, 0]),
                )
                .map(|_| ()),
            // reward_model.ground_truth (max def 2)
            3 => col
                .typed::<ByteArrayType>()
                .write_batch(&bytes(&["42", r"\frac{1}{2}"]), Some(&[2, 2]), None)
                .map(|_| ()),
            // reward_model.rubrics.list.element.criterion (max def 5, rep 1):
            // row 0 null rubrics (def 1), row 1 two criteria
            4 => col
                .typed::<ByteArrayType>()
                .write_batch(
                    &bytes(&["Explains halving", "Rambles"]),
                    Some(&[1, 5, 5]),
                    Some(&[0, 0, 1]),
                )
                .map(|_| ()),
            5 => col
                .typed::<DoubleType>()
                .write_batch(&[2.0, -1.0], Some(&[1, 5, 5]), Some(&[0, 0, 1]))
                .map(|_| ()),
            // difficulty: row 0 "easy", row 1 null
            6 => col
                .typed::<ByteArrayType>()
                .write_batch(&bytes(&["easy"]), Some(&[1, 0]), None)
                .map(|_| ()),
            // global_id: row 0 100, row 1 null → generated
            7 => col
                .typed::<Int64Type>()
                .write_batch(&[100], Some(&[1, 0]), None)
                .map(|_| ()),
            // images.list.element (max def 3, rep 1): row 0 [] (def 1), row 1 null or ["a.png"]
            8 => {
                let w = col.typed::<ByteArrayType>();
                if image {
                    w.write_batch(&bytes(&["a.png"]), Some(&[1, 3]), Some(&[0, 0]))
                } else {
                    w.write_batch(&[], Some(&[1, 0]), Some(&[0, 0]))
                }
                .map(|_| ())
            }
            other => panic!("unexpected leaf {other}"),
        }
        .unwrap();
        col.close().unwrap();
        leaf += 1;
    }
    assert_eq!(leaf, 9);
    rg.close().unwrap();
    writer.close().unwrap();
}

#[test]
fn verl_parquet() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.parquet");
    write_verl_parquet(&path, false);
    let ex = load(&path).unwrap();
    assert_eq!(ex.len(), 2);
    assert_eq!(
        ex[0].prompt,
        Prompt::Messages(vec![
            ChatMessage::system("Be brief."),
            ChatMessage::user("What is 6*7?")
        ])
    );
    assert_eq!(ex[0].answer, "42");
    assert_eq!(ex[0].global_id, "100");
    assert_eq!(ex[0].difficulty.as_deref(), Some("easy"));
    assert!(ex[0].rubrics.is_empty());
    assert_eq!(ex[1].prompt.question(), "Half of one?");
    assert_eq!(ex[1].answer, r"\frac{1}{2}");
    assert_eq!(ex[1].global_id, "train-1");
    assert_eq!(ex[1].difficulty, None);
    let r = &ex[1].rubrics;
    assert_eq!(r.len(), 2);
    assert_eq!(
        (r[0].criterion.as_str(), r[0].points),
        ("Explains halving", 2.0)
    );
    assert_eq!((r[1].criterion.as_str(), r[1].points), ("Rambles", -1.0));
}

#[test]
fn parquet_image_paths_are_checked() {
    // (tests/data_vision.rs loads multimodal rows; here a missing image file is named)
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mm.parquet");
    write_verl_parquet(&path, true);
    let e = err(&path);
    let want = format!(
        "mm.parquet: row 1 (global_id `mm-1`): `images`: image 0: no such file: {}",
        dir.path().join("a.png").display()
    );
    assert!(e.contains(&want), "{e}");
}

#[test]
fn directory_of_files() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "b.jsonl",
        "{\"prompt\": \"p\", \"answer\": \"1\"}\n",
    );
    write(
        dir.path(),
        "a.json",
        "[{\"prompt\": \"q\", \"answer\": \"2\"}, {\"prompt\": \"r\", \"answer\": \"3\"}]",
    );
    write(dir.path(), "notes.txt", "ignored");
    write_verl_parquet(&dir.path().join("c.parquet"), false);
    let ex = load(dir.path()).unwrap();
    let ids: Vec<_> = ex.iter().map(|e| e.global_id.as_str()).collect();
    assert_eq!(ids, ["a-0", "a-1", "b-0", "100", "c-1"]);
    let rows: Vec<_> = ex.iter().map(|e| e.row).collect();
    assert_eq!(rows, [0, 1, 0, 0, 1]);
}

#[test]
fn bad_inputs_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases: Vec<(PathBuf, &str)> = vec![
        (d.join("missing.jsonl"), "missing.jsonl: cannot read"),
        (
            write(d, "empty.jsonl", ""),
            "empty.jsonl: the dataset is empty",
        ),
        (
            write(d, "blank.jsonl", "\n  \n"),
            "blank.jsonl: the dataset is empty",
        ),
        (
            write(d, "empty.json", "[]"),
            "empty.json: the dataset is empty",
        ),
        (
            write(
                d,
                "malformed.jsonl",
                "{\"prompt\": \"p\", \"answer\": \"1\"}\n\n{\"prompt\": \"p\", \n",
            ),
            "malformed.jsonl: line 3: malformed JSON",
        ),
        (
            write(
                d,
                "noprompt.jsonl",
                "{\"prompt\": \"p\", \"answer\": \"1\"}\n{\"answer\": \"1\"}\n",
            ),
            "noprompt.jsonl: row 1 (line 2): `prompt`: no prompt",
        ),
        (
            write(d, "noanswer.jsonl", "{\"prompt\": \"p\"}\n"),
            "noanswer.jsonl: row 0 (line 1): `answer`: no answer",
        ),
        (
            write(
                d,
                "nullanswer.jsonl",
                "{\"prompt\": \"p\", \"answer\": null, \"ground_truth\": \" \"}\n",
            ),
            "`answer`: no answer",
        ),
        (
            write(d, "data.csv", "prompt,answer\n"),
            "data.csv: unsupported dataset format",
        ),
        (
            write(
                d,
                "dup.jsonl",
                "{\"prompt\": \"p\", \"answer\": \"1\", \"global_id\": \"x\"}\n{\"prompt\": \"q\", \"answer\": \"2\", \"global_id\": \"x\"}\n",
            ),
            "duplicate global_id `x`",
        ),
        (
            // an explicit id equal to a generated one
            write(
                d,
                "gen.jsonl",
                "{\"prompt\": \"p\", \"answer\": \"1\"}\n{\"prompt\": \"q\", \"answer\": \"2\", \"global_id\": \"gen-0\"}\n",
            ),
            "duplicate global_id `gen-0`",
        ),
        (
            write(
                d,
                "video.jsonl",
                "{\"prompt\": \"p\", \"answer\": \"1\", \"videos\": [\"v.mp4\"]}\n",
            ),
            "video.jsonl: row 0 (line 1) (global_id `video-0`): `videos`: video 0: no such file",
        ),
        (
            write(
                d,
                "badrubric.jsonl",
                "{\"prompt\": \"p\", \"reward_model\": {\"rubrics\": [{\"criterion\": \"c\", \"points\": 1, \"regex\": \"[\"}]}}\n",
            ),
            "`reward_model.rubrics`: criterion 0: `c`: invalid regex",
        ),
        (
            write(d, "junk.parquet", "not a parquet file"),
            "junk.parquet: cannot read Parquet",
        ),
    ];
    for (path, want) in cases {
        let e = err(&path);
        assert!(
            e.contains(want),
            "{}: got `{e}`, want `{want}`",
            path.display()
        );
    }
    // the duplicate message names both rows
    let e = err(&d.join("dup.jsonl"));
    assert!(
        e.contains("row 0 (line 1)") && e.contains("row 1 (line 2)"),
        "{e}"
    );

    let empty_dir = tempfile::tempdir().unwrap();
    write(empty_dir.path(), "readme.md", "");
    let e = err(empty_dir.path());
    assert!(e.contains("no .jsonl, .json or .parquet file"), "{e}");
}

#[test]
fn template_filter_and_sampler_over_a_dataset() {
    let ex = load(&fixture("math.jsonl")).unwrap();
    let t = PromptTemplate::from_file(&fixture("math.jinja")).unwrap();
    let formatted: Vec<Prompt> = ex.iter().map(|e| t.apply(&e.prompt).unwrap()).collect();
    assert_eq!(
        formatted[0],
        Prompt::Text(
            "What is 2 + 3?\n\nReason step by step inside <think> </think>, then write the final answer as \\boxed{answer}."
                .into()
        )
    );
    // chat prompts: only the user turn is templated
    let Prompt::Messages(m) = &formatted[2] else {
        panic!("expected messages")
    };
    assert_eq!(m[0].content, "You are a careful solver.");
    assert!(
        m[1].content.starts_with("A pen costs 3 dollars.")
            && m[1].content.ends_with(r"\boxed{answer}.")
    );

    // "lengths" measured in characters of the question for the test
    let lengths: Vec<usize> = ex.iter().map(|e| e.prompt.question().len()).collect();
    let (kept, dropped) = filter_by_prompt_length(ex, &lengths, 20).unwrap();
    assert_eq!(dropped, 1);
    let ids: Vec<_> = kept.iter().map(|e| e.global_id.as_str()).collect();
    assert_eq!(ids, ["add-1", "math-1", "math-3"]);

    let mut s = EpochSampler::new(5, true);
    let mut epoch0 = Vec::new();
    for _ in 0..3 {
        epoch0.extend(s.next_batch(kept.len(), 1).unwrap());
    }
    epoch0.sort_unstable();
    assert_eq!(epoch0, [0, 1, 2]);
    assert_eq!(s.epoch(), 0);
    s.next_batch(kept.len(), 1).unwrap();
    assert_eq!(s.epoch(), 1);
}

/// EasyR1's `name@split`: a dataset in a fake Hugging Face hub cache laid out as the hub
/// lays it out (snapshot files are symlinks into `blobs/`), a local folder of split files,
/// a single file, and the errors that list where it looked.
#[test]
fn datasets_named_as_easyr1_names_them() {
    use ares_runner::data::resolve_data_files_in;
    let tmp = tempfile::tempdir().unwrap();
    let hub = tmp.path().join("hub");
    let repo = hub.join("datasets--owner--math");
    let snap = repo.join("snapshots/0123abcd");
    fs::create_dir_all(snap.join("data")).unwrap();
    fs::create_dir_all(repo.join("blobs")).unwrap();
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs/main"), "0123abcd").unwrap();
    let row = |q: &str, a: &str| format!("{{\"problem\": \"{q}\", \"answer\": \"{a}\"}}\n");
    for (file, blob, rows) in [
        (
            "data/train-00000-of-00002.jsonl",
            "b1",
            row("1+1", "2") + &row("2+2", "4"),
        ),
        ("data/train-00001-of-00002.jsonl", "b2", row("3+3", "6")),
        ("data/test-00000-of-00001.jsonl", "b3", row("5+5", "10")),
    ] {
        fs::write(repo.join("blobs").join(blob), rows).unwrap();
        std::os::unix::fs::symlink(Path::new("../../../blobs").join(blob), snap.join(file))
            .unwrap();
    }
    fs::write(snap.join("README.md"), "# card").unwrap();
    let roots = vec![tmp.path().join("elsewhere"), hub.clone()];
    let train = resolve_data_files_in("owner/math@train", &roots).unwrap();
    assert_eq!(
        train,
        vec![
            snap.join("data/train-00000-of-00002.jsonl"),
            snap.join("data/train-00001-of-00002.jsonl")
        ]
    );
    assert_eq!(resolve_data_files_in("owner/math", &roots).unwrap(), train);
    assert_eq!(
        resolve_data_files_in("owner/math@test", &roots).unwrap(),
        vec![snap.join("data/test-00000-of-00001.jsonl")]
    );
    // the shards load as one dataset (ids from each shard's name)
    let keys = DataKeys {
        prompt: "problem".into(),
        ..DataKeys::default()
    };
    let mut examples = Vec::new();
    for f in &train {
        examples.extend(load_dataset(f, &keys).unwrap());
    }
    assert_eq!(examples.len(), 3);
    // a split that is not there names the files that are
    let e = resolve_data_files_in("owner/math@validation", &roots)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no file of split `validation`") && e.contains("data/test-00000-of-00001.jsonl"),
        "{e}"
    );
    // a dataset that is not cached: every place looked in
    let e = resolve_data_files_in("owner/other@train", &roots)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            &tmp.path()
                .join("elsewhere/datasets--owner--other")
                .display()
                .to_string()
        ) && e.contains(&hub.join("datasets--owner--other").display().to_string())
            && e.contains("huggingface-cli download --repo-type dataset owner/other"),
        "{e}"
    );
    // a local folder with per-split files; files naming no split are all `train`
    let local = tmp.path().join("local");
    fs::create_dir_all(&local).unwrap();
    fs::write(local.join("train.jsonl"), row("1", "1")).unwrap();
    fs::write(local.join("dev.jsonl"), row("2", "2")).unwrap();
    let spec = |s: &str| format!("{}@{s}", local.display());
    assert_eq!(
        resolve_data_files_in(&spec("validation"), &[]).unwrap(),
        vec![local.join("dev.jsonl")]
    );
    let plain = tmp.path().join("plain");
    fs::create_dir_all(&plain).unwrap();
    fs::write(plain.join("part_a.jsonl"), row("1", "1")).unwrap();
    assert_eq!(
        resolve_data_files_in(&format!("{}@train", plain.display()), &[]).unwrap(),
        vec![plain.join("part_a.jsonl")]
    );
    // one file holds only `train`
    let one = local.join("train.jsonl");
    assert_eq!(
        resolve_data_files_in(&format!("{}@train", one.display()), &[]).unwrap(),
        vec![one.clone()]
    );
    let e = resolve_data_files_in(&format!("{}@test", one.display()), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("holds only the `train` split"), "{e}");
    // a missing path is not looked for in the hub
    let e = load_dataset(Path::new("/nonexistent/train.jsonl"), &keys)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("/nonexistent/train.jsonl: cannot read") && !e.contains("hub"),
        "{e}"
    );
}

/// Fuzzing found a Parquet file on which the `parquet` crate panics (a slice past a page's
/// end in its bit reader): loading it is an error naming the file, not a crash.
#[test]
fn a_parquet_file_that_panics_the_decoder_is_an_error() {
    let path = fixture("fuzz_parquet_bit_reader.parquet");
    let e = load_dataset(&path, &DataKeys::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("fuzz_parquet_bit_reader.parquet") && e.contains("malformed file"),
        "{e}"
    );
}

/// A Snappy page whose header declares 128 MiB uncompressed, in a file of 70 KiB: the
/// `parquet` crate would zero-fill 128 MiB before finding the page short. The header is
/// read first and the page refused by name, without that allocation.
#[test]
fn a_page_that_declares_more_than_its_chunk_is_refused() {
    let Some(mut peak) = ares_tests::bounded::rerun(
        "a_page_that_declares_more_than_its_chunk_is_refused",
        ares_tests::bounded::Bounds {
            address_space_mib: 2048,
            peak_rss_mib: 48,
        },
    ) else {
        return;
    };
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bomb.parquet");
    let schema = Arc::new(
        parse_message_type(
            "message m { REQUIRED BYTE_ARRAY prompt (UTF8); REQUIRED BYTE_ARRAY answer (UTF8); }",
        )
        .unwrap(),
    );
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_dictionary_enabled(false)
        .build();
    let mut w =
        SerializedFileWriter::new(fs::File::create(&path).unwrap(), schema, Arc::new(props))
            .unwrap();
    let mut rg = w.next_row_group().unwrap();
    // 1.5 MB: the page's size takes a 4-byte varint, room for 2^27 - 1 in place
    for value in ["0".repeat(1_500_000), "0".into()] {
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>()
            .write_batch(&[ByteArray::from(value.into_bytes())], None, None)
            .unwrap();
        col.close().unwrap();
    }
    rg.close().unwrap();
    w.close().unwrap();
    load_dataset(&path, &DataKeys::default()).unwrap();

    // PageHeader: 0x15 type (DATA_PAGE = zigzag 0), 0x15 uncompressed_page_size (varint)
    let at = SerializedFileReader::new(fs::File::open(&path).unwrap())
        .unwrap()
        .metadata()
        .row_group(0)
        .column(0)
        .data_page_offset() as usize;
    let mut bytes = fs::read(&path).unwrap();
    assert!(bytes.len() < 100 << 10, "{}", bytes.len());
    assert_eq!(&bytes[at..at + 3], &[0x15, 0x00, 0x15]);
    let size = &mut bytes[at + 3..at + 7];
    assert!(size[..3].iter().all(|b| b & 0x80 != 0) && size[3] & 0x80 == 0);
    // zigzag(2^27 - 1) = 2^28 - 2 in four 7-bit groups
    size.copy_from_slice(&[0xfe, 0xff, 0xff, 0x7f]);
    fs::write(&path, &bytes).unwrap();
    drop(bytes);
    peak.restart();
    let e = load_dataset(&path, &DataKeys::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bomb.parquet")
            && e.contains("row group 0, column prompt: page 0")
            && e.contains(
                "declares 134217727 bytes uncompressed, more than its whole column chunk"
            ),
        "{e}"
    );
}

/// verl's multi-turn rows give each tool its arguments in `extra_info.tools_kwargs` and
/// the interaction its own in `extra_info.interaction_kwargs`: kept per example; tools
/// kwargs other than an object are refused by key.
#[test]
fn tools_kwargs_of_verl_rows_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tools.jsonl");
    fs::write(
        &path,
        concat!(
            r#"{"prompt": "What is 12*34?", "answer": "408", "extra_info": {"tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": "408"}}}, "interaction_kwargs": {"name": "judge", "ground_truth": "408"}}}"#,
            "\n",
            r#"{"prompt": "1+1?", "answer": "2"}"#,
            "\n"
        ),
    )
    .unwrap();
    let ex = load_dataset(&path, &DataKeys::default()).unwrap();
    assert_eq!(
        ex[0].tools_kwargs.as_ref().unwrap()["calc"]["create_kwargs"]["ground_truth"],
        "408"
    );
    assert!(ex[1].tools_kwargs.is_none());
    // and the interaction's, as given
    assert_eq!(
        ex[0].interaction_kwargs,
        Some(serde_json::json!({"name": "judge", "ground_truth": "408"}))
    );
    assert!(ex[1].interaction_kwargs.is_none());
    fs::write(
        &path,
        r#"{"prompt": "x", "answer": "1", "extra_info": {"tools_kwargs": "calc"}}"#,
    )
    .unwrap();
    let e = load_dataset(&path, &DataKeys::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`extra_info.tools_kwargs`") && e.contains("expected an object"),
        "{e}"
    );
}
