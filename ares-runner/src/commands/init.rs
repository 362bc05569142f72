//! `ares-runner init`: a model folder of random weights at a real model's shape — a named
//! one (`qwen2.5-7b`, `qwen2.5-vl-7b`, …) or any `config.json` ares reads — with the demo's
//! character tokenizer, so a step at that shape can be measured with nothing but the binary:
//! no download, no network (the GPU machines have none).
//!
//! The weights are not a trained model's and the tokenizer is not the model's: the folder is
//! for measuring time and memory (`ares-runner train` on it with the demo's data, written by
//! `ares-runner demo-data`), not for results. Special token ids in the config are the demo
//! tokenizer's. Every value is drawn uniformly with the initializer's σ (`initializer_range`,
//! 0.02; output projections σ/√(2L)), norms 1, biases 0 — uniform rather than normal because
//! seven billion values must be drawn in seconds, in parallel, from a counter-based stream:
//! the same seed gives the same bytes on any number of threads.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde_json::{Value, json};

use crate::demo::model::TinyModelSpec;
use crate::demo::tokenizer::{VOCAB_SIZE, special_ids, write_tokenizer};
use crate::demo::vision_model::{
    TinyVisionSpec, VL_VOCAB_SIZE, preprocessor_config_json, vl_config_json, vl_special_ids,
    write_vl_tokenizer,
};
use crate::hf::config::{CONFIG_FILE, ModelConfig};
use crate::hf::generation::GENERATION_CONFIG_FILE;
use crate::hf::tensor_files::{SINGLE_FILE, SaveDtype, write_safetensors_streamed};
use crate::hf::weights::expected_tensors;
use crate::trainer::TrainError;
use crate::trainer::setup::memory::text_parameters;
use crate::vision::checkpoint::WeightLayout;
use crate::vision::config::VlConfig;
use crate::vision::weights::{VisionWeights, tower_parameters};

/// Model shapes `init` knows by name (the published configs' sizes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NamedShape {
    /// Qwen2.5-0.5B: 24 layers, hidden 896, 14/2 heads, MLP 4864, tied (494 M).
    #[value(name = "qwen2.5-0.5b")]
    Qwen2_5_0_5b,
    /// Qwen2.5-1.5B: 28 layers, hidden 1536, 12/2 heads, MLP 8960, tied (1.54 B).
    #[value(name = "qwen2.5-1.5b")]
    Qwen2_5_1_5b,
    /// Qwen2.5-3B: 36 layers, hidden 2048, 16/2 heads, MLP 11008, tied (3.09 B).
    #[value(name = "qwen2.5-3b")]
    Qwen2_5_3b,
    /// Qwen2.5-7B: 28 layers, hidden 3584, 28/4 heads, MLP 18944, untied (7.62 B).
    #[value(name = "qwen2.5-7b")]
    Qwen2_5_7b,
    /// Qwen2.5-VL-3B: Qwen2.5-3B's decoder and the 32-block, 1280-wide tower (3.75 B).
    #[value(name = "qwen2.5-vl-3b")]
    Qwen2_5Vl3b,
    /// Qwen2.5-VL-7B: Qwen2.5-7B's decoder and the 32-block, 1280-wide tower (8.29 B).
    #[value(name = "qwen2.5-vl-7b")]
    Qwen2_5Vl7b,
}

/// `(hidden, layers, heads, kv_heads, intermediate, tied)` of a Qwen2.5 decoder.
fn decoder(
    hidden: usize,
    layers: usize,
    heads: (usize, usize),
    mlp: usize,
    tied: bool,
) -> TinyModelSpec {
    TinyModelSpec {
        hidden,
        layers,
        heads: heads.0,
        kv_heads: heads.1,
        intermediate: mlp,
        max_positions: 32_768,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        init_std: 0.02,
        tie_embeddings: tied,
    }
}

/// Qwen2.5-VL's vision tower (3B and 7B alike but for its output width).
fn qwen2_5_vl_tower() -> TinyVisionSpec {
    TinyVisionSpec {
        depth: 32,
        hidden: 1280,
        heads: 16,
        intermediate: 3420,
        patch_size: 14,
        temporal_patch_size: 2,
        spatial_merge_size: 2,
        window_size: 112,
        fullatt_block_indexes: vec![7, 15, 23, 31],
        tokens_per_second: 2,
        init_std: 0.02,
    }
}

impl NamedShape {
    /// The shape's `config.json`, with the demo tokenizers' special ids.
    pub fn config_json(self) -> Value {
        let ids = special_ids();
        let text =
            |spec: TinyModelSpec, vocab| spec.config_json(vocab, ids.im_end, ids.endoftext, None);
        match self {
            Self::Qwen2_5_0_5b => text(decoder(896, 24, (14, 2), 4864, true), 151_936),
            Self::Qwen2_5_1_5b => text(decoder(1536, 28, (12, 2), 8960, true), 151_936),
            Self::Qwen2_5_3b => text(decoder(2048, 36, (16, 2), 11_008, true), 151_936),
            Self::Qwen2_5_7b => text(decoder(3584, 28, (28, 4), 18_944, false), 152_064),
            Self::Qwen2_5Vl3b => vl_config_json(
                &decoder(2048, 36, (16, 2), 11_008, true),
                &qwen2_5_vl_tower(),
                151_936,
            ),
            Self::Qwen2_5Vl7b => vl_config_json(
                &decoder(3584, 28, (28, 4), 18_944, false),
                &qwen2_5_vl_tower(),
                152_064,
            ),
        }
    }
}

/// What `init` writes.
#[derive(Debug, Clone, PartialEq)]
pub struct InitOptions {
    /// The model folder (created; its model, config and tokenizer files are replaced).
    pub output: PathBuf,
    /// The config: `Err(path)` of a `config.json`, or a named shape.
    pub shape: Result<NamedShape, PathBuf>,
    /// How the weights are stored.
    pub dtype: SaveDtype,
    /// Seed of the weights.
    pub seed: u64,
}

/// What `init` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitReport {
    /// Parameters (language model and vision tower).
    pub parameters: u64,
    /// Whether the model is vision-language.
    pub vision: bool,
}

fn invalid(what: impl std::fmt::Display) -> TrainError {
    TrainError::Invalid(what.to_string())
}

/// Writes the model folder of `options` (see the module docs).
///
/// # Errors
/// A config ares cannot read (naming the file), a vocabulary smaller than the demo
/// tokenizer's, I/O errors.
pub fn init(options: &InitOptions) -> Result<InitReport, TrainError> {
    let (mut raw, origin) = match &options.shape {
        Ok(shape) => (shape.config_json(), PathBuf::from("<named shape>")),
        Err(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
            let value: Value = serde_json::from_str(&text)
                .map_err(|e| invalid(format!("{}: not JSON: {e}", path.display())))?;
            (value, path.clone())
        }
    };
    let Value::Object(map) = &mut raw else {
        return Err(invalid(format!("{}: not a JSON object", origin.display())));
    };
    map.insert("torch_dtype".into(), json!(options.dtype.torch_name()));
    let vision = map.contains_key("vision_config");
    // the demo tokenizers' special ids stand in for the model's own
    let (ids, smallest) = if vision {
        let v = vl_special_ids();
        for (key, id) in [
            ("vision_start_token_id", v.vision_start),
            ("vision_end_token_id", v.vision_end),
            ("image_token_id", v.image_pad),
            ("video_token_id", v.video_pad),
        ] {
            map.insert(key.into(), json!(id));
        }
        ((v.im_end, v.endoftext), VL_VOCAB_SIZE)
    } else {
        let t = special_ids();
        ((t.im_end, t.endoftext), VOCAB_SIZE)
    };
    map.insert("eos_token_id".into(), json!(ids.0));
    map.insert("pad_token_id".into(), json!(ids.1));
    map.insert("bos_token_id".into(), Value::Null);
    let config_path = options.output.join(CONFIG_FILE);
    let shown = |e: &dyn std::fmt::Display| invalid(format!("{}: {e}", origin.display()));
    let (text, vision_cfg) = if vision {
        let vl = VlConfig::from_map(&config_path, map.clone()).map_err(|e| shown(&e))?;
        (vl.text.clone(), Some(vl))
    } else {
        let text =
            ModelConfig::from_json_str(&config_path, &raw.to_string()).map_err(|e| shown(&e))?;
        (text, None)
    };
    if text.vocab_size < smallest {
        return Err(invalid(format!(
            "{}: vocab_size {} is smaller than the demo tokenizer's {smallest} ids",
            origin.display(),
            text.vocab_size
        )));
    }
    std::fs::create_dir_all(&options.output).map_err(|e| TrainError::io(&options.output, e))?;
    // the language model's tensors, drawn in parallel
    let layers = text.num_hidden_layers.max(1) as f64;
    let std = raw
        .get("initializer_range")
        .and_then(Value::as_f64)
        .unwrap_or(0.02) as f32;
    let vision_tower = vision_cfg.as_ref().map(|vl| vl.vision.clone());
    // the language model's tensors, each drawn just before it is written: a 7B folder
    // never holds more than one tensor of the language model in memory
    let text_tensors = expected_tensors(&text);
    let draw = |k: usize| -> Vec<f32> {
        let (name, shape) = &text_tensors[k];
        let n: usize = shape.iter().product();
        if name.ends_with("norm.weight") {
            vec![1.0; n]
        } else if name.ends_with(".bias") {
            vec![0.0; n]
        } else {
            let out = name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight");
            let sigma = if out {
                std / (2.0 * layers).sqrt() as f32
            } else {
                std
            };
            uniform(n, sigma, options.seed, k as u64)
        }
    };
    let path = options.output.join(SINGLE_FILE);
    let metadata = [("format".to_string(), "pt".to_string())]
        .into_iter()
        .collect();
    // (a vision-language folder names the language model as the Hub does, and adds the
    // tower, drawn whole: a few hundred million parameters at most)
    let (text_names, vision) = match &vision_cfg {
        None => (
            text_tensors
                .iter()
                .map(|(n, _)| n.clone())
                .collect::<Vec<_>>(),
            None,
        ),
        Some(config) => {
            let layout = WeightLayout::Hub;
            let names = text_tensors
                .iter()
                .map(|(n, _)| layout.text_name(n))
                .collect();
            let tower = VisionWeights::random(&config.vision, std, options.seed ^ 0x5EED);
            (names, Some((layout.vision_prefix(), tower, &config.vision)))
        }
    };
    let named_vision = vision
        .as_ref()
        .map(|(prefix, tower, cfg)| {
            tower
                .named(cfg)
                .into_iter()
                .map(|(n, shape, data)| (format!("{prefix}{n}"), shape, data))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let mut heads: Vec<(&str, &[usize])> = text_names
        .iter()
        .zip(&text_tensors)
        .map(|(n, (_, shape))| (n.as_str(), shape.as_slice()))
        .collect();
    heads.extend(
        named_vision
            .iter()
            .map(|(n, s, _)| (n.as_str(), s.as_slice())),
    );
    let t = text_tensors.len();
    write_safetensors_streamed(&path, &heads, options.dtype, metadata, |i| {
        Ok(if i < t {
            std::borrow::Cow::Owned(draw(i))
        } else {
            std::borrow::Cow::Borrowed(named_vision[i - t].2)
        })
    })
    .map_err(|e| shown(&e))?;
    let parameters = count(heads.iter().map(|(_, s)| s.iter().product::<usize>()));
    write_json(&config_path, &raw)?;
    let generation = json!({
        "bos_token_id": null,
        "eos_token_id": ids.0,
        "pad_token_id": ids.1,
        "do_sample": true,
        "temperature": 1.0,
        "top_p": 1.0,
    });
    write_json(&options.output.join(GENERATION_CONFIG_FILE), &generation)?;
    let demo = |e: crate::demo::DemoError| invalid(e);
    match &vision_tower {
        Some(vl) => {
            write_vl_tokenizer(&options.output).map_err(demo)?;
            let tower_spec = TinyVisionSpec {
                patch_size: vl.patch_size,
                temporal_patch_size: vl.temporal_patch_size,
                spatial_merge_size: vl.spatial_merge_size,
                ..TinyVisionSpec::default()
            };
            let pre = preprocessor_config_json(&tower_spec, 448);
            write_json(&options.output.join("preprocessor_config.json"), &pre)?;
        }
        None => write_tokenizer(&options.output).map_err(demo)?,
    }
    Ok(InitReport {
        parameters,
        vision: vision_tower.is_some(),
    })
}

/// `n` values uniform on `[−√3·σ, √3·σ]` (standard deviation σ) from the counter-based
/// stream `(seed, tensor)`: chunks of 64 Ki values drawn in parallel, each from its own
/// SplitMix64 counter, so the values do not depend on the thread count.
fn uniform(n: usize, sigma: f32, seed: u64, tensor: u64) -> Vec<f32> {
    const CHUNK: usize = 1 << 16;
    let half_width = sigma * 3f32.sqrt();
    let mut out = vec![0.0f32; n];
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut state = splitmix(seed ^ splitmix(tensor ^ splitmix(c as u64)));
            for x in chunk.iter_mut() {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let u = (splitmix(state) >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                *x = (2.0 * u - 1.0) * half_width;
            }
        });
    out
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn write_json(path: &Path, value: &Value) -> Result<(), TrainError> {
    let text =
        serde_json::to_string_pretty(value).map_err(|e| TrainError::Internal(e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|e| TrainError::io(path, e))
}

/// The parameter count of a config (language model and tower), without drawing weights.
///
/// # Errors
/// A config ares cannot read.
pub fn parameter_count(config: &Value) -> Result<u64, TrainError> {
    let Value::Object(map) = config else {
        return Err(invalid("a config is a JSON object"));
    };
    let path = Path::new(CONFIG_FILE);
    if map.contains_key("vision_config") {
        let vl = VlConfig::from_map(path, map.clone()).map_err(invalid)?;
        Ok(text_parameters(&vl.text) + tower_parameters(&vl.vision))
    } else {
        let c = ModelConfig::from_json_str(path, &config.to_string()).map_err(invalid)?;
        Ok(text_parameters(&c))
    }
}

/// Every named shape, for tests and the help text.
pub const SHAPES: [NamedShape; 6] = [
    NamedShape::Qwen2_5_0_5b,
    NamedShape::Qwen2_5_1_5b,
    NamedShape::Qwen2_5_3b,
    NamedShape::Qwen2_5_7b,
    NamedShape::Qwen2_5Vl3b,
    NamedShape::Qwen2_5Vl7b,
];

fn count(lengths: impl Iterator<Item = usize>) -> u64 {
    lengths.map(|n| n as u64).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::checkpoint::Checkpoint;

    /// The named shapes have the published models' parameter counts.
    #[test]
    fn named_shapes_have_the_published_sizes() {
        let published = [
            (NamedShape::Qwen2_5_0_5b, 494_032_768u64),
            (NamedShape::Qwen2_5_1_5b, 1_543_714_304),
            (NamedShape::Qwen2_5_3b, 3_085_938_688),
            (NamedShape::Qwen2_5_7b, 7_615_616_512),
            (NamedShape::Qwen2_5Vl3b, 3_754_622_976),
            (NamedShape::Qwen2_5Vl7b, 8_292_166_656),
        ];
        assert_eq!(published.len(), SHAPES.len());
        for (shape, count) in published {
            assert_eq!(
                parameter_count(&shape.config_json()).unwrap(),
                count,
                "{shape:?}"
            );
        }
    }

    fn tiny_text() -> Value {
        let ids = special_ids();
        let spec = TinyModelSpec {
            hidden: 32,
            layers: 2,
            heads: 2,
            kv_heads: 1,
            intermediate: 64,
            ..TinyModelSpec::default()
        };
        spec.config_json(100, ids.im_end, ids.endoftext, None)
    }

    fn write(dir: &Path, config: &Value, dtype: SaveDtype, seed: u64) -> InitReport {
        let path = dir.join("in.json");
        std::fs::write(&path, config.to_string()).unwrap();
        init(&InitOptions {
            output: dir.join("model"),
            shape: Err(path),
            dtype,
            seed,
        })
        .unwrap()
    }

    /// A config file's model: a folder ares loads (bf16 weights), the demo tokenizer's ids,
    /// σ as asked, the same bytes for the same seed; a VL config gets its tower and
    /// processor.
    #[test]
    fn a_config_file_becomes_a_loadable_model_folder() {
        let dir = tempfile::tempdir().unwrap();
        let r = write(dir.path(), &tiny_text(), SaveDtype::Bf16, 7);
        assert!(!r.vision);
        assert_eq!(r.parameters, parameter_count(&tiny_text()).unwrap());
        let ck = Checkpoint::load(&dir.path().join("model")).unwrap();
        assert_eq!(ck.config.vocab_size, 100);
        assert_eq!(ck.config.eos_token_ids, [special_ids().im_end]);
        let q = &ck.weights.layers[0].q_proj.data;
        let var = q.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() / q.len() as f64;
        assert!((var.sqrt() - 0.02).abs() < 0.003, "σ {}", var.sqrt());
        assert!(ck.weights.norm.data.iter().all(|&x| x == 1.0));
        let tok = crate::hf::tokenizer::Tokenizer::from_dir(&dir.path().join("model")).unwrap();
        assert!(!tok.encode("1+1", false).unwrap().is_empty());
        let bytes = |d: &Path| std::fs::read(d.join("model").join(SINGLE_FILE)).unwrap();
        let again = tempfile::tempdir().unwrap();
        write(again.path(), &tiny_text(), SaveDtype::Bf16, 7);
        assert_eq!(bytes(dir.path()), bytes(again.path()));
        write(again.path(), &tiny_text(), SaveDtype::Bf16, 8);
        assert_ne!(bytes(dir.path()), bytes(again.path()));

        let vl = vl_config_json(
            &TinyModelSpec::default(),
            &TinyVisionSpec::default(),
            VL_VOCAB_SIZE,
        );
        let vdir = tempfile::tempdir().unwrap();
        let r = write(vdir.path(), &vl, SaveDtype::F32, 1);
        assert!(r.vision);
        assert_eq!(r.parameters, parameter_count(&vl).unwrap());
        let ck = crate::vision::checkpoint::VlCheckpoint::load(&vdir.path().join("model")).unwrap();
        assert_eq!(ck.config.vision.depth, 2);
        assert!(vdir.path().join("model/preprocessor_config.json").exists());
    }

    #[test]
    fn bad_configs_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut small = tiny_text();
        small["vocab_size"] = json!(10);
        let path = dir.path().join("small.json");
        std::fs::write(&path, small.to_string()).unwrap();
        let options = |shape| InitOptions {
            output: dir.path().join("model"),
            shape,
            dtype: SaveDtype::Bf16,
            seed: 1,
        };
        let e = init(&options(Err(path.clone()))).unwrap_err().to_string();
        assert!(
            e.contains("small.json") && e.contains("vocab_size 10"),
            "{e}"
        );
        std::fs::write(&path, "{oops").unwrap();
        let e = init(&options(Err(path))).unwrap_err().to_string();
        assert!(e.contains("not JSON"), "{e}");
        let e = init(&options(Err(dir.path().join("missing.json"))))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.json"), "{e}");
    }
}
