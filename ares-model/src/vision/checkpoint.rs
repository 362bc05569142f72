//! A Qwen2-VL / Qwen2.5-VL model directory: config, generation config, the language
//! model's and the vision tower's weights, in either tensor-name layout, loaded in one
//! call and saved atomically in the layout it came from (or another).

use std::collections::HashMap;
use std::path::Path;

use super::config::VlConfig;
use super::weights::{VisionWeights, take_from};
use crate::hf::HfError;
use crate::hf::checkpoint::save_atomically;
use crate::hf::config::CONFIG_FILE;
use crate::hf::generation::{GENERATION_CONFIG_FILE, GenerationConfig};
use crate::hf::json;
use crate::hf::tensor_files::{
    NamedTensor, SINGLE_FILE, SaveDtype, TensorFiles, write_safetensors,
};
use crate::hf::weights::{ModelWeights, Tensor};

/// How a checkpoint names its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// The Hub's checkpoints: `visual.*`, `model.*` (language model), `lm_head.weight`.
    Hub,
    /// transformers ≥ 4.52: `model.visual.*`, `model.language_model.*`, `lm_head.weight`.
    Nested,
}

impl WeightLayout {
    /// Prefix of the vision tower's tensors.
    pub fn vision_prefix(self) -> &'static str {
        match self {
            WeightLayout::Hub => "visual.",
            WeightLayout::Nested => "model.visual.",
        }
    }

    /// The checkpoint name of a language-model tensor named `model.…` / `lm_head.weight` in
    /// the text layout.
    pub fn text_name(self, name: &str) -> String {
        match (self, name.strip_prefix("model.")) {
            (WeightLayout::Nested, Some(rest)) => format!("model.language_model.{rest}"),
            _ => name.to_string(),
        }
    }

    /// The text-layout name of a checkpoint tensor of the language model, `None` for
    /// tensors that are not the language model's.
    fn canonical_text_name(self, name: &str) -> Option<String> {
        if name == "lm_head.weight" {
            return Some(name.to_string());
        }
        match self {
            WeightLayout::Hub => (name.starts_with("model.")).then(|| name.to_string()),
            WeightLayout::Nested => name
                .strip_prefix("model.language_model.")
                .map(|rest| format!("model.{rest}")),
        }
    }
}

/// Config, optional generation config and weights of a vision-language model.
#[derive(Debug, Clone, PartialEq)]
pub struct VlCheckpoint {
    /// `config.json`.
    pub config: VlConfig,
    /// `generation_config.json`, when present.
    pub generation: Option<GenerationConfig>,
    /// The language model's weights, named as a text model's (`model.layers.…`).
    pub text: ModelWeights,
    /// The vision tower's weights.
    pub vision: VisionWeights,
    /// The layout the weights were read in (and are saved in by default).
    pub layout: WeightLayout,
}

impl VlCheckpoint {
    /// Loads a model directory (`model.safetensors` or sharded; f32, bf16 or f16).
    ///
    /// # Errors
    /// A missing or malformed file, a tensor missing, of the wrong shape or not part of
    /// the model (each named).
    pub fn load(dir: &Path) -> Result<Self, HfError> {
        let config = VlConfig::from_dir(dir)?;
        let generation = GenerationConfig::from_dir(dir)?;
        let files = TensorFiles::open(dir)?;
        let layout = if files
            .names()
            .any(|n| n.starts_with("model.visual.") || n.starts_with("model.language_model."))
        {
            WeightLayout::Nested
        } else {
            WeightLayout::Hub
        };
        let vision_prefix = layout.vision_prefix();
        let tied = config.text.tie_word_embeddings;
        let (mut text, mut vision) = (HashMap::new(), HashMap::new());
        let names: Vec<String> = files.names().map(str::to_owned).collect();
        for name in names {
            let shape = files
                .shape(&name)
                .map(|(_, s)| s.to_vec())
                .unwrap_or_default();
            if name.ends_with("rotary_emb.inv_freq") || (tied && name == "lm_head.weight") {
                continue;
            }
            if name.starts_with(vision_prefix) {
                let data = files.read_f32(&name)?;
                vision.insert(name, Tensor { shape, data });
            } else if let Some(canonical) = layout.canonical_text_name(&name) {
                let data = files.read_f32(&name)?;
                text.insert(canonical, Tensor { shape, data });
            } else {
                let path = files
                    .shape(&name)
                    .map_or(files.source(), |(p, _)| p)
                    .to_path_buf();
                return Err(HfError::UnexpectedTensor {
                    path,
                    tensor: name,
                    arch: config.kind().model_type().to_string(),
                });
            }
        }
        let text =
            ModelWeights::from_map(&config.text, text).map_err(|e| rename_text_error(e, layout))?;
        let vision_weights = VisionWeights::collect(&config.vision, |name, shape| {
            take_from(&mut vision, vision_prefix, name, shape)
        })?;
        if let Some(name) = vision.keys().next() {
            return Err(HfError::InvalidWeights {
                tensor: name.clone(),
                message: "not part of this model's vision tower".into(),
            });
        }
        Ok(Self {
            config,
            generation,
            text,
            vision: vision_weights,
            layout,
        })
    }

    /// Every tensor with its checkpoint name in `layout`, in checkpoint order (language
    /// model, then vision tower, as transformers writes them).
    pub fn named(&self, layout: WeightLayout) -> Vec<(String, Vec<usize>, &[f32])> {
        let mut out: Vec<(String, Vec<usize>, &[f32])> = self
            .text
            .tensors()
            .into_iter()
            .map(|(n, t)| (layout.text_name(&n), t.shape.clone(), t.data.as_slice()))
            .collect();
        let prefix = layout.vision_prefix();
        for (n, shape, data) in self.vision.named(&self.config.vision) {
            out.push((format!("{prefix}{n}"), shape, data));
        }
        out
    }

    /// Writes `model.safetensors` (in `dtype`, names in `layout`), `config.json` and, if
    /// loaded, `generation_config.json` into `dir`, atomically (as
    /// [`crate::hf::checkpoint::Checkpoint::save`]).
    ///
    /// # Errors
    /// Weights that do not match the config, or a file system failure.
    pub fn save(&self, dir: &Path, dtype: SaveDtype, layout: WeightLayout) -> Result<(), HfError> {
        self.text.check(&self.config.text)?;
        save_atomically(dir, |tmp| {
            let named = self.named(layout);
            let list: Vec<NamedTensor<'_>> = named
                .iter()
                .map(|(n, s, d)| (n.as_str(), s.as_slice(), *d))
                .collect();
            write_safetensors(&tmp.join(SINGLE_FILE), &list, dtype)?;
            let mut config = self.config.raw().clone();
            for key in ["dtype", "torch_dtype"] {
                if config.contains_key(key) {
                    config.insert(key.into(), dtype.torch_name().into());
                }
            }
            if let Some(serde_json::Value::Object(text)) = config.get_mut("text_config") {
                for key in ["dtype", "torch_dtype"] {
                    if text.contains_key(key) {
                        text.insert(key.into(), dtype.torch_name().into());
                    }
                }
            }
            json::write_pretty(&tmp.join(CONFIG_FILE), &serde_json::Value::Object(config))?;
            if let Some(g) = &self.generation {
                json::write_pretty(
                    &tmp.join(GENERATION_CONFIG_FILE),
                    &serde_json::Value::Object(g.raw().clone()),
                )?;
            }
            Ok(())
        })
    }
}

/// A language-model weight error names the tensor as the checkpoint does.
fn rename_text_error(e: HfError, layout: WeightLayout) -> HfError {
    match e {
        HfError::InvalidWeights { tensor, message } => HfError::InvalidWeights {
            tensor: layout.text_name(&tensor),
            message,
        },
        other => other,
    }
}
