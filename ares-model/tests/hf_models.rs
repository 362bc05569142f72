//! The Hugging Face model I/O against the tiny transformers fixtures in
//! `tests/fixtures/models` (made by `scripts/make_hf_fixtures.py`): configs, weights,
//! dtypes, shards, errors on broken copies, and save → load round trips.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use ares_model::hf::HfError;
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::hf::config::{Arch, ModelConfig};
use ares_model::hf::generation::GenerationConfig;
use ares_model::hf::rope::{Rope, RopeScaling};
use ares_model::hf::tensor_files::{SaveDtype, TensorFiles, write_safetensors};
use ares_model::hf::weights::{ModelWeights, expected_tensors};
use serde_json::Value;

mod common;
use common::fixture;

fn load(name: &str) -> Checkpoint {
    match Checkpoint::load(&fixture(name)) {
        Ok(c) => c,
        Err(e) => panic!("{name}: {e}"),
    }
}

/// A copy of fixture `name` in a fresh temporary directory.
fn copy_fixture(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    (tmp, dir)
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(v.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn err_of<T: std::fmt::Debug>(r: Result<T, HfError>) -> (HfError, String) {
    let e = r.expect_err("expected an error");
    let msg = e.to_string();
    (e, msg)
}

// ---------------------------------------------------------------- configs

#[test]
fn qwen2_config() {
    let c = load("qwen2_tiny").config;
    assert_eq!(c.arch, Arch::Qwen2);
    assert_eq!(
        (
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers,
            c.vocab_size
        ),
        (48, 80, 2, 97)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (6, 2, 8)
    );
    assert!(c.tie_word_embeddings);
    assert!(c.qkv_bias && !c.o_bias && !c.mlp_bias && !c.qk_norm);
    assert_eq!(
        c.rope,
        Rope {
            theta: 10000.0,
            scaling: RopeScaling::Default
        }
    );
    assert_eq!(c.rms_norm_eps, 1e-6);
    assert_eq!(c.max_position_embeddings, 64);
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.as_slice()),
        (Some(1), &[2][..])
    );
    assert_eq!(c.dtype.as_deref(), Some("float32"));
}

#[test]
fn qwen3_config() {
    let c = load("qwen3_tiny").config;
    assert_eq!(c.arch, Arch::Qwen3);
    // head_dim is explicit and not hidden_size / num_attention_heads = 8.
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (6, 2, 12)
    );
    assert!(!c.tie_word_embeddings);
    assert!(!c.qkv_bias && !c.o_bias && !c.mlp_bias && c.qk_norm);
    assert_eq!(
        c.rope,
        Rope {
            theta: 1_000_000.0,
            scaling: RopeScaling::Default
        }
    );
    assert_eq!(c.dtype.as_deref(), Some("bfloat16"));
}

#[test]
fn llama_config_both_rope_styles() {
    let old = load("llama_tiny").config;
    assert_eq!(old.arch, Arch::Llama);
    assert!(!old.tie_word_embeddings && !old.qkv_bias && !old.o_bias && !old.mlp_bias);
    let llama3 = Rope {
        theta: 500_000.0,
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        },
    };
    assert_eq!(old.rope, llama3);
    let new = ModelConfig::from_dir(&fixture("llama_tiny_rope_parameters")).unwrap();
    assert!(new.raw().contains_key("rope_parameters") && !new.raw().contains_key("rope_theta"));
    assert_eq!(new.rope, llama3);
    assert_eq!(
        new.to_json("float32")["rope_scaling"],
        old.raw()["rope_scaling"]
    );
    assert_eq!(
        new.to_json("float32")["rope_theta"],
        old.raw()["rope_theta"]
    );
    // Everything but the raw JSON is the same model.
    let strip = |c: &ModelConfig| format!("{c:?}").split(", raw:").next().unwrap().to_string();
    assert_eq!(strip(&old), strip(&new));
    // Weights of the old-style directory load with the new-style config.
    ModelWeights::load(&fixture("llama_tiny"), &new).unwrap();
}

#[test]
fn generation_configs() {
    let g = load("qwen2_tiny")
        .generation
        .expect("qwen2 has a generation config");
    assert_eq!(g.eos_token_ids, Some(vec![2, 96]));
    assert_eq!((g.bos_token_id, g.pad_token_id), (Some(1), Some(0)));
    assert_eq!(g.do_sample, Some(true));
    assert_eq!(
        (g.temperature, g.top_p, g.top_k),
        (Some(0.7), Some(0.8), Some(20))
    );
    assert_eq!(
        (g.repetition_penalty, g.max_new_tokens),
        (Some(1.05), Some(32))
    );
    let g = load("llama_tiny").generation.unwrap();
    assert_eq!(g.eos_token_ids, Some(vec![2]));
    assert_eq!(
        (g.do_sample, g.temperature, g.top_p, g.top_k),
        (None, None, None, None)
    );
    assert_eq!(
        GenerationConfig::from_dir(&fixture("llama_tiny_rope_parameters")).unwrap(),
        None
    );
}

// ---------------------------------------------------------------- weights

/// `params.json`: per tensor, shape, first 4 values and sum as transformers sees them.
fn params(name: &str) -> BTreeMap<String, (Vec<usize>, Vec<f64>, f64)> {
    let text = std::fs::read_to_string(fixture(name).join("params.json")).unwrap();
    let v: BTreeMap<String, Value> = serde_json::from_str(&text).unwrap();
    v.into_iter()
        .map(|(k, v)| {
            let shape = serde_json::from_value(v["shape"].clone()).unwrap();
            let first = serde_json::from_value(v["first"].clone()).unwrap();
            (k, (shape, first, v["sum"].as_f64().unwrap()))
        })
        .collect()
}

fn check_against_params(name: &str) -> usize {
    let ckpt = load(name);
    let params = params(name);
    let tensors = ckpt.weights.tensors();
    let ours: BTreeSet<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    let theirs: BTreeSet<&str> = params.keys().map(String::as_str).collect();
    assert_eq!(ours, theirs, "{name}: tensor names");
    let expected: Vec<(String, Vec<usize>)> = expected_tensors(&ckpt.config);
    assert_eq!(expected.len(), tensors.len());
    for ((name_e, shape_e), (n, t)) in expected.iter().zip(&tensors) {
        assert_eq!((name_e, shape_e), (n, &t.shape));
        let (shape, first, sum) = &params[n];
        assert_eq!(&t.shape, shape, "{name}: {n}");
        // As f32: serde_json's default float parser may be 1 ulp off in f64.
        let theirs: Vec<f32> = first.iter().map(|&x| x as f32).collect();
        assert_eq!(&t.data[..4], theirs.as_slice(), "{name}: {n} first values");
        let s: f64 = t.data.iter().map(|&x| f64::from(x)).sum();
        assert!(
            (s - sum).abs() <= 1e-9 * (1.0 + sum.abs()) * t.data.len() as f64,
            "{n}: {s} vs {sum}"
        );
    }
    tensors.len()
}

#[test]
fn qwen2_weights_tied_with_biases() {
    // 1 embedding + 2 × (2 norms + 4 proj + 3 biases + 3 mlp) + final norm; no lm_head.
    assert_eq!(check_against_params("qwen2_tiny"), 1 + 2 * 12 + 1);
    let w = load("qwen2_tiny").weights;
    assert!(w.lm_head.is_none());
    assert_eq!(w.layers[0].q_proj_bias.as_ref().unwrap().shape, vec![48]);
    assert_eq!(w.layers[0].k_proj_bias.as_ref().unwrap().shape, vec![16]);
    assert!(w.layers[0].o_proj_bias.is_none() && w.layers[0].q_norm.is_none());
}

#[test]
fn qwen3_weights_from_bf16() {
    let files = TensorFiles::open(&fixture("qwen3_tiny")).unwrap();
    assert!(files.source().ends_with("model.safetensors"));
    // 1 + 2 × (2 norms + 2 qk norms + 4 proj + 3 mlp) + norm + lm_head.
    assert_eq!(check_against_params("qwen3_tiny"), 1 + 2 * 11 + 2);
    let w = load("qwen3_tiny").weights;
    assert_eq!(w.layers[1].q_proj.shape, vec![72, 48]);
    assert_eq!(w.layers[1].o_proj.shape, vec![48, 72]);
    assert_eq!(w.layers[1].k_norm.as_ref().unwrap().shape, vec![12]);
    // Every value is a bf16 widened to f32: the low 16 bits are zero.
    assert!(
        w.tensors()
            .iter()
            .all(|(_, t)| t.data.iter().all(|x| x.to_bits() & 0xffff == 0))
    );
}

#[test]
fn llama_weights_from_shards() {
    let files = TensorFiles::open(&fixture("llama_tiny")).unwrap();
    assert!(files.source().ends_with("model.safetensors.index.json"));
    let shards: BTreeSet<&Path> = files.names().map(|n| files.shape(n).unwrap().0).collect();
    assert_eq!(shards.len(), 5);
    assert_eq!(check_against_params("llama_tiny"), 1 + 2 * 9 + 2);
    assert!(load("llama_tiny").weights.lm_head.is_some());
}

/// The fixture's expected data (for the model tests to come) is readable and consistent.
#[test]
fn expected_data_is_present() {
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let bytes = std::fs::read(fixture(name).join("expected.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let vocab = load(name).config.vocab_size;
        for set in ["right", "left"] {
            assert_eq!(
                st.tensor(&format!("{set}.logits")).unwrap().shape(),
                &[2, 7, vocab]
            );
            assert_eq!(
                st.tensor(&format!("{set}.input_ids")).unwrap().shape(),
                &[2, 7]
            );
            let g = st
                .tensor(&format!(
                    "{set}.grad.model.layers.0.self_attn.q_proj.weight"
                ))
                .unwrap();
            assert_eq!(
                g.shape(),
                load(name).weights.layers[0].q_proj.shape.as_slice()
            );
        }
    }
}

// ---------------------------------------------------------------- errors

#[test]
fn missing_config() {
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::MissingFile { .. }), "{msg}");
    assert!(
        msg.contains("config.json") && msg.contains("not found"),
        "{msg}"
    );
}

#[test]
fn missing_weights() {
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let (_, msg) = err_of(Checkpoint::load(&dir));
    assert!(
        msg.contains("model.safetensors") && msg.contains("index.json"),
        "{msg}"
    );
}

#[test]
fn missing_shard() {
    let (_tmp, dir) = copy_fixture("llama_tiny");
    std::fs::remove_file(dir.join("model-00003-of-00005.safetensors")).unwrap();
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::MissingFile { .. }), "{msg}");
    assert!(
        msg.contains("model-00003-of-00005.safetensors: not found"),
        "{msg}"
    );
    assert!(msg.contains("model.safetensors.index.json"), "{msg}");
}

#[test]
fn unknown_architecture() {
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    edit_config(&dir, |c| {
        c.insert("model_type".into(), "mistral".into());
    });
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::UnknownArchitecture { .. }), "{msg}");
    assert!(
        msg.contains("config.json") && msg.contains("`mistral`"),
        "{msg}"
    );
    assert!(msg.contains("qwen2, qwen3, llama"), "{msg}");
}

#[test]
fn shape_mismatch() {
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    edit_config(&dir, |c| {
        c.insert("intermediate_size".into(), 81.into());
    });
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::ShapeMismatch { .. }), "{msg}");
    assert!(msg.contains("model.safetensors"), "{msg}");
    assert!(
        msg.contains("`model.layers.0.mlp.gate_proj.weight` has shape [80, 48]"),
        "{msg}"
    );
    assert!(msg.contains("implies [81, 48]"), "{msg}");
}

/// Rewrites `dir/model.safetensors` from the fixture's tensors after `edit`, in f32,
/// optionally storing one tensor as f64.
fn rewrite_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>)) {
    let files = TensorFiles::open(dir).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = files
        .names()
        .map(|n| {
            (
                n.to_string(),
                files.shape(n).unwrap().1.to_vec(),
                files.read_f32(n).unwrap(),
            )
        })
        .collect();
    drop(files);
    edit(&mut tensors);
    let list: Vec<(&str, &[usize], &[f32])> = tensors
        .iter()
        .map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice()))
        .collect();
    write_safetensors(&dir.join("model.safetensors"), &list, SaveDtype::F32).unwrap();
}

#[test]
fn missing_tensor() {
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    rewrite_weights(&dir, |t| {
        t.retain(|(n, _, _)| n != "model.layers.1.self_attn.v_proj.bias")
    });
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::MissingTensor { .. }), "{msg}");
    assert!(
        msg.contains("model.safetensors: missing tensor `model.layers.1.self_attn.v_proj.bias`")
    );
}

#[test]
fn unexpected_and_ignorable_tensors() {
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    rewrite_weights(&dir, |t| {
        t.push((
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            vec![4],
            vec![1.0; 4],
        ));
        t.push(("lm_head.weight".into(), vec![97, 48], vec![0.0; 97 * 48])); // tied: ignored
    });
    let ckpt = Checkpoint::load(&dir).unwrap();
    assert_eq!(ckpt.weights, load("qwen2_tiny").weights);
    rewrite_weights(&dir, |t| {
        t.push((
            "model.layers.0.self_attn.o_proj.bias".into(),
            vec![48],
            vec![0.0; 48],
        ))
    });
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::UnexpectedTensor { .. }), "{msg}");
    assert!(
        msg.contains("`model.layers.0.self_attn.o_proj.bias`") && msg.contains("qwen2"),
        "{msg}"
    );
}

#[test]
fn unsupported_dtype() {
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    let files = TensorFiles::open(&dir).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for n in files.names() {
        let (_, shape) = files.shape(n).unwrap();
        let data = files.read_f32(n).unwrap();
        if n == "model.norm.weight" {
            let bytes = data
                .iter()
                .flat_map(|&x| f64::from(x).to_le_bytes())
                .collect();
            owned.push((
                n.to_string(),
                safetensors::Dtype::F64,
                shape.to_vec(),
                bytes,
            ));
        } else {
            let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
            owned.push((
                n.to_string(),
                safetensors::Dtype::F32,
                shape.to_vec(),
                bytes,
            ));
        }
    }
    drop(files);
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.as_str(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::UnsupportedDtype { .. }), "{msg}");
    assert!(msg.contains("`model.norm.weight` has dtype F64"), "{msg}");
}

#[test]
fn truncated_safetensors() {
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::Safetensors { .. }), "{msg}");
    assert!(
        msg.contains("model.safetensors: invalid safetensors file"),
        "{msg}"
    );
}

#[test]
fn config_field_errors_name_the_field() {
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    edit_config(&dir, |c| {
        c.insert("num_key_value_heads".into(), 4.into());
    });
    let (_, msg) = err_of(ModelConfig::from_dir(&dir));
    assert!(
        msg.ends_with(
            "config.json: num_key_value_heads: 4 does not divide num_attention_heads = 6"
        ),
        "{msg}"
    );
    edit_config(&dir, |c| {
        c.insert("hidden_size".into(), "48".into());
    });
    let (_, msg) = err_of(ModelConfig::from_dir(&dir));
    assert!(
        msg.contains("config.json: hidden_size: invalid type: string \"48\""),
        "{msg}"
    );
}

// ---------------------------------------------------------------- saving

#[test]
fn save_load_round_trip_f32_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let ckpt = load(name);
        let out = tmp.path().join("nested").join(name);
        ckpt.save(&out, SaveDtype::F32).unwrap();
        let back = Checkpoint::load(&out).unwrap();
        let bits = |c: &Checkpoint| -> Vec<(String, Vec<u32>)> {
            c.weights
                .tensors()
                .iter()
                .map(|(n, t)| (n.clone(), t.data.iter().map(|x| x.to_bits()).collect()))
                .collect()
        };
        assert_eq!(bits(&ckpt), bits(&back), "{name}");
        assert_eq!(back.generation, ckpt.generation, "{name}");
        assert_eq!(back.config.dtype.as_deref(), Some("float32"));
        assert_eq!(back.config.rope, ckpt.config.rope);
        assert_eq!(
            back.config.tie_word_embeddings,
            ckpt.config.tie_word_embeddings
        );
        // Only model.safetensors, config.json and maybe generation_config.json; no temp dirs.
        let files: BTreeSet<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(files.contains("model.safetensors") && files.contains("config.json"));
        assert!(files.len() <= 3, "{files:?}");
    }
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path().join("nested"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers.len(), 3, "{leftovers:?}");
}

#[test]
fn save_bf16_rounds_and_overwrites() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ckpt");
    let qwen3 = load("qwen3_tiny");
    // Overwrite an existing checkpoint directory.
    load("qwen2_tiny").save(&out, SaveDtype::F32).unwrap();
    qwen3.save(&out, SaveDtype::Bf16).unwrap();
    let back = Checkpoint::load(&out).unwrap();
    // bf16 → f32 → bf16 is exact.
    assert_eq!(back.weights, qwen3.weights);
    assert_eq!(back.config.dtype.as_deref(), Some("bfloat16"));
    assert!(!out.join("generation_config.json").exists() || qwen3.generation.is_some());
    // f32 weights saved as bf16 come back rounded to nearest even.
    let llama = load("llama_tiny");
    llama.save(&out, SaveDtype::Bf16).unwrap();
    let back = Checkpoint::load(&out).unwrap();
    for ((n, a), (_, b)) in llama.weights.tensors().iter().zip(back.weights.tensors()) {
        for (x, y) in a.data.iter().zip(&b.data) {
            assert_eq!(half::bf16::from_f32(*x).to_f32(), *y, "{n}");
        }
    }
}

#[test]
fn save_rejects_weights_that_do_not_fit_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let mut ckpt = load("qwen2_tiny");
    ckpt.weights.layers[1].down_proj.shape = vec![80, 48];
    let (e, msg) = err_of(ckpt.save(&tmp.path().join("x"), SaveDtype::F32));
    assert!(matches!(e, HfError::InvalidWeights { .. }), "{msg}");
    assert!(msg.contains("model.layers.1.mlp.down_proj.weight"), "{msg}");
    assert!(!tmp.path().join("x").exists());
    let mut ckpt = load("qwen2_tiny");
    ckpt.weights.lm_head = Some(ckpt.weights.embed_tokens.clone());
    let (_, msg) = err_of(ckpt.save(&tmp.path().join("x"), SaveDtype::F32));
    assert!(msg.contains("lm_head.weight"), "{msg}");
}

#[test]
fn from_map_and_tensors_mut_use_hf_names() {
    let ckpt = load("qwen3_tiny");
    let map: HashMap<String, ares_model::hf::weights::Tensor> = ckpt
        .weights
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.clone()))
        .collect();
    let mut w = ModelWeights::from_map(&ckpt.config, map).unwrap();
    assert_eq!(w, ckpt.weights);
    for (n, t) in w.tensors_mut() {
        if n == "model.layers.1.self_attn.q_norm.weight" {
            t.data[0] = 42.0;
        }
    }
    assert_eq!(w.layers[1].q_norm.as_ref().unwrap().data[0], 42.0);
}

/// Writes checkpoints saved by this crate for `scripts/check_hf_roundtrip.py`, which loads
/// them with `transformers.AutoModelForCausalLM.from_pretrained` and compares them to the
/// fixtures. Run:
///
/// ```text
/// ARES_HF_ROUNDTRIP_DIR=/tmp/ares_rt cargo test -p ares-model --test hf_models -- --ignored write_roundtrip
/// python scripts/check_hf_roundtrip.py /tmp/ares_rt
/// ```
#[test]
#[ignore = "writes a directory for scripts/check_hf_roundtrip.py (needs Python + transformers)"]
fn write_roundtrip_checkpoints() {
    let root = PathBuf::from(
        std::env::var("ARES_HF_ROUNDTRIP_DIR").unwrap_or_else(|_| "/tmp/ares_hf_roundtrip".into()),
    );
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        load(name)
            .save(&root.join(format!("{name}-f32")), SaveDtype::F32)
            .unwrap();
        load(name)
            .save(&root.join(format!("{name}-bf16")), SaveDtype::Bf16)
            .unwrap();
    }
    // The rope_parameters-only config with llama_tiny's weights.
    let config = ModelConfig::from_dir(&fixture("llama_tiny_rope_parameters")).unwrap();
    let weights = ModelWeights::load(&fixture("llama_tiny"), &config).unwrap();
    let ckpt = Checkpoint {
        config,
        generation: None,
        weights,
    };
    ckpt.save(&root.join("llama_tiny_rope_parameters-f32"), SaveDtype::F32)
        .unwrap();
    println!("wrote {}", root.display());
}

/// A downloaded weight file is untrusted: a header that declares a tensor past the file's
/// end, or a header length of gigabytes, is refused while reading the header, before any
/// tensor is read or allocated.
#[test]
fn safetensors_headers_that_claim_too_much_are_refused() {
    // a 100 GB tensor and a 10 GB header are declared: neither may be reserved
    let Some(_peak) = ares_tests::bounded::rerun(
        "safetensors_headers_that_claim_too_much_are_refused",
        ares_tests::bounded::Bounds {
            address_space_mib: 2048,
            peak_rss_mib: 16,
        },
    ) else {
        return;
    };
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    let path = dir.join("model.safetensors");
    let write_header = |header: &str, data: usize| {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend(std::iter::repeat_n(0u8, data));
        std::fs::write(&path, bytes).unwrap();
    };
    // 100 GB declared, 8 bytes present
    write_header(
        r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[100000,262144],"data_offsets":[0,104857600000]}}"#,
        8,
    );
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::Safetensors { .. }), "{msg}");
    assert!(msg.contains("model.safetensors"), "{msg}");
    // a shape whose bytes disagree with its offsets
    write_header(
        r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[1000000000,1000000000],"data_offsets":[0,8]}}"#,
        8,
    );
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::Safetensors { .. }), "{msg}");
    // a header length of 10 GB in a file of a few bytes
    let mut bytes = (10u64 << 30).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&path, bytes).unwrap();
    let (e, msg) = err_of(Checkpoint::load(&dir));
    assert!(matches!(e, HfError::Safetensors { .. }), "{msg}");
}

/// A config that declares billions of positions does not size the precomputed RoPE tables:
/// they hold at most `MAX_ROPE_POSITIONS`, and a position past them is refused by name.
#[test]
fn a_huge_declared_context_does_not_allocate_its_rope_table() {
    // 4 × 10⁹ positions' tables would be hundreds of GB
    let Some(_peak) = ares_tests::bounded::rerun(
        "a_huge_declared_context_does_not_allocate_its_rope_table",
        ares_tests::bounded::Bounds {
            address_space_mib: 2048,
            peak_rss_mib: 64,
        },
    ) else {
        return;
    };
    use ares_model::model::{MAX_ROPE_POSITIONS, Model};
    let (_tmp, dir) = copy_fixture("qwen2_tiny");
    edit_config(&dir, |c| {
        c.insert("max_position_embeddings".into(), 4_000_000_000u64.into());
    });
    let ckpt = Checkpoint::load(&dir).unwrap();
    let model = Model::from_checkpoint(ares_model::backend::cpu::CpuBackend, &ckpt).unwrap();
    assert_eq!(model.spec().max_positions, MAX_ROPE_POSITIONS);
}
