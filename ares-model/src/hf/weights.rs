//! The weights of a Qwen2/Qwen3/Llama decoder as f32 tensors, keyed and shaped as the
//! Hugging Face checkpoint names them (`model.layers.{i}.self_attn.q_proj.weight`, ...),
//! loaded with every name and shape checked against `config.json`.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use super::HfError;
use super::config::ModelConfig;
use super::tensor_files::{NamedTensor, SaveDtype, TensorFiles, write_safetensors};

/// A dense row-major f32 tensor (PyTorch's layout: a linear layer's weight is `[out, in]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values, row-major.
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Self {
            shape: shape.to_vec(),
            data: vec![0.0; shape.iter().product()],
        }
    }
}

/// The tensors of one decoder layer. Optional ones exist exactly when the config asks for
/// them (biases per [`ModelConfig`]'s `qkv_bias`/`o_bias`/`mlp_bias`, q/k norms for Qwen3).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights {
    /// `input_layernorm.weight` `[hidden]`.
    pub input_layernorm: Tensor,
    /// `self_attn.q_proj.weight` `[heads * head_dim, hidden]`.
    pub q_proj: Tensor,
    /// `self_attn.q_proj.bias` `[heads * head_dim]`.
    pub q_proj_bias: Option<Tensor>,
    /// `self_attn.k_proj.weight` `[kv_heads * head_dim, hidden]`.
    pub k_proj: Tensor,
    /// `self_attn.k_proj.bias` `[kv_heads * head_dim]`.
    pub k_proj_bias: Option<Tensor>,
    /// `self_attn.v_proj.weight` `[kv_heads * head_dim, hidden]`.
    pub v_proj: Tensor,
    /// `self_attn.v_proj.bias` `[kv_heads * head_dim]`.
    pub v_proj_bias: Option<Tensor>,
    /// `self_attn.o_proj.weight` `[hidden, heads * head_dim]`.
    pub o_proj: Tensor,
    /// `self_attn.o_proj.bias` `[hidden]`.
    pub o_proj_bias: Option<Tensor>,
    /// `self_attn.q_norm.weight` `[head_dim]` (Qwen3).
    pub q_norm: Option<Tensor>,
    /// `self_attn.k_norm.weight` `[head_dim]` (Qwen3).
    pub k_norm: Option<Tensor>,
    /// `post_attention_layernorm.weight` `[hidden]`.
    pub post_attention_layernorm: Tensor,
    /// `mlp.gate_proj.weight` `[intermediate, hidden]`.
    pub gate_proj: Tensor,
    /// `mlp.gate_proj.bias` `[intermediate]`.
    pub gate_proj_bias: Option<Tensor>,
    /// `mlp.up_proj.weight` `[intermediate, hidden]`.
    pub up_proj: Tensor,
    /// `mlp.up_proj.bias` `[intermediate]`.
    pub up_proj_bias: Option<Tensor>,
    /// `mlp.down_proj.weight` `[hidden, intermediate]`.
    pub down_proj: Tensor,
    /// `mlp.down_proj.bias` `[hidden]`.
    pub down_proj_bias: Option<Tensor>,
}

/// The name suffixes of a layer's tensors, in [`LayerWeights`] field order.
pub(crate) const LAYER_SUFFIXES: [&str; 18] = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "self_attn.o_proj.bias",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.gate_proj.bias",
    "mlp.up_proj.weight",
    "mlp.up_proj.bias",
    "mlp.down_proj.weight",
    "mlp.down_proj.bias",
];

impl LayerWeights {
    /// `(suffix, tensor)` for every field, in [`LAYER_SUFFIXES`] order.
    fn slots(&self) -> [(&'static str, Option<&Tensor>); 18] {
        let s = LAYER_SUFFIXES;
        [
            (s[0], Some(&self.input_layernorm)),
            (s[1], Some(&self.q_proj)),
            (s[2], self.q_proj_bias.as_ref()),
            (s[3], Some(&self.k_proj)),
            (s[4], self.k_proj_bias.as_ref()),
            (s[5], Some(&self.v_proj)),
            (s[6], self.v_proj_bias.as_ref()),
            (s[7], Some(&self.o_proj)),
            (s[8], self.o_proj_bias.as_ref()),
            (s[9], self.q_norm.as_ref()),
            (s[10], self.k_norm.as_ref()),
            (s[11], Some(&self.post_attention_layernorm)),
            (s[12], Some(&self.gate_proj)),
            (s[13], self.gate_proj_bias.as_ref()),
            (s[14], Some(&self.up_proj)),
            (s[15], self.up_proj_bias.as_ref()),
            (s[16], Some(&self.down_proj)),
            (s[17], self.down_proj_bias.as_ref()),
        ]
    }

    /// Mutable twin of [`Self::slots`].
    fn slots_mut(&mut self) -> [(&'static str, Option<&mut Tensor>); 18] {
        let s = LAYER_SUFFIXES;
        [
            (s[0], Some(&mut self.input_layernorm)),
            (s[1], Some(&mut self.q_proj)),
            (s[2], self.q_proj_bias.as_mut()),
            (s[3], Some(&mut self.k_proj)),
            (s[4], self.k_proj_bias.as_mut()),
            (s[5], Some(&mut self.v_proj)),
            (s[6], self.v_proj_bias.as_mut()),
            (s[7], Some(&mut self.o_proj)),
            (s[8], self.o_proj_bias.as_mut()),
            (s[9], self.q_norm.as_mut()),
            (s[10], self.k_norm.as_mut()),
            (s[11], Some(&mut self.post_attention_layernorm)),
            (s[12], Some(&mut self.gate_proj)),
            (s[13], self.gate_proj_bias.as_mut()),
            (s[14], Some(&mut self.up_proj)),
            (s[15], self.up_proj_bias.as_mut()),
            (s[16], Some(&mut self.down_proj)),
            (s[17], self.down_proj_bias.as_mut()),
        ]
    }
}

/// All weights of a decoder model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelWeights {
    /// `model.embed_tokens.weight` `[vocab, hidden]`.
    pub embed_tokens: Tensor,
    /// `model.layers.{i}.*`.
    pub layers: Vec<LayerWeights>,
    /// `model.norm.weight` `[hidden]`.
    pub norm: Tensor,
    /// `lm_head.weight` `[vocab, hidden]`; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Tensor>,
}

/// The name and shape of every tensor a model with `config` has, in checkpoint order
/// (embedding, layers, final norm, `lm_head` unless tied).
pub fn expected_tensors(config: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let c = config;
    let (h, i, q, kv, d) = (
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.head_dim,
    );
    // Shapes in LAYER_SUFFIXES order; None where the config has no such tensor.
    let layer: [Option<Vec<usize>>; 18] = [
        Some(vec![h]),
        Some(vec![q, h]),
        c.qkv_bias.then(|| vec![q]),
        Some(vec![kv, h]),
        c.qkv_bias.then(|| vec![kv]),
        Some(vec![kv, h]),
        c.qkv_bias.then(|| vec![kv]),
        Some(vec![h, q]),
        c.o_bias.then(|| vec![h]),
        c.qk_norm.then(|| vec![d]),
        c.qk_norm.then(|| vec![d]),
        Some(vec![h]),
        Some(vec![i, h]),
        c.mlp_bias.then(|| vec![i]),
        Some(vec![i, h]),
        c.mlp_bias.then(|| vec![i]),
        Some(vec![h, i]),
        c.mlp_bias.then(|| vec![h]),
    ];
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![c.vocab_size, h],
    )];
    for l in 0..c.num_hidden_layers {
        for (suffix, shape) in LAYER_SUFFIXES.iter().zip(&layer) {
            if let Some(shape) = shape {
                out.push((format!("model.layers.{l}.{suffix}"), shape.clone()));
            }
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !c.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![c.vocab_size, h]));
    }
    out
}

/// Tensors a checkpoint may hold that the model does not use: rotary caches that old
/// exports saved, and a duplicate `lm_head.weight` in a tied checkpoint (transformers
/// re-ties it to the embedding, so it is ignored here too).
fn ignorable(name: &str, config: &ModelConfig) -> bool {
    name.ends_with("rotary_emb.inv_freq")
        || (config.tie_word_embeddings && name == "lm_head.weight")
}

impl ModelWeights {
    /// Loads the weights of the model directory `dir` (`model.safetensors` or a sharded
    /// index), converting F32/BF16/F16 to f32. Every tensor `config` implies must be there
    /// with its shape; any other tensor is an error unless known to be ignorable.
    pub fn load(dir: &Path, config: &ModelConfig) -> Result<Self, HfError> {
        let files = TensorFiles::open(dir)?;
        let expected = expected_tensors(config);
        let wanted: BTreeSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
        for name in files.names() {
            if !wanted.contains(name) && !ignorable(name, config) {
                let path = files
                    .shape(name)
                    .map_or(files.source(), |(p, _)| p)
                    .to_path_buf();
                return Err(HfError::UnexpectedTensor {
                    path,
                    tensor: name.to_string(),
                    arch: config.arch.to_string(),
                });
            }
        }
        let mut map = HashMap::with_capacity(expected.len());
        for (name, shape) in expected {
            let Some((path, actual)) = files.shape(&name) else {
                return Err(HfError::MissingTensor {
                    path: files.source().to_path_buf(),
                    tensor: name,
                });
            };
            if actual != shape.as_slice() {
                return Err(HfError::ShapeMismatch {
                    path: path.to_path_buf(),
                    tensor: name,
                    expected: shape,
                    actual: actual.to_vec(),
                });
            }
            let data = files.read_f32(&name)?;
            map.insert(name, Tensor { shape, data });
        }
        Self::from_map(config, map)
    }

    /// Assembles the typed weights from tensors keyed by HF name. Every tensor the config
    /// implies must be present with its shape; others are an error.
    pub fn from_map(config: &ModelConfig, map: HashMap<String, Tensor>) -> Result<Self, HfError> {
        let have: Vec<(&str, &Tensor)> = map.iter().map(|(n, t)| (n.as_str(), t)).collect();
        check_tensors(&expected_tensors(config), &have)?;
        let mut map = Taker(map);
        let embed_tokens = map.take("model.embed_tokens.weight")?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        let (qkv, o, mlp, qk) = (
            config.qkv_bias,
            config.o_bias,
            config.mlp_bias,
            config.qk_norm,
        );
        for l in 0..config.num_hidden_layers {
            let n = |i: usize| format!("model.layers.{l}.{}", LAYER_SUFFIXES[i]);
            layers.push(LayerWeights {
                input_layernorm: map.take(&n(0))?,
                q_proj: map.take(&n(1))?,
                q_proj_bias: map.opt(&n(2), qkv)?,
                k_proj: map.take(&n(3))?,
                k_proj_bias: map.opt(&n(4), qkv)?,
                v_proj: map.take(&n(5))?,
                v_proj_bias: map.opt(&n(6), qkv)?,
                o_proj: map.take(&n(7))?,
                o_proj_bias: map.opt(&n(8), o)?,
                q_norm: map.opt(&n(9), qk)?,
                k_norm: map.opt(&n(10), qk)?,
                post_attention_layernorm: map.take(&n(11))?,
                gate_proj: map.take(&n(12))?,
                gate_proj_bias: map.opt(&n(13), mlp)?,
                up_proj: map.take(&n(14))?,
                up_proj_bias: map.opt(&n(15), mlp)?,
                down_proj: map.take(&n(16))?,
                down_proj_bias: map.opt(&n(17), mlp)?,
            });
        }
        let norm = map.take("model.norm.weight")?;
        let lm_head = map.opt("lm_head.weight", !config.tie_word_embeddings)?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }

    /// Every tensor with its HF name, in checkpoint order.
    pub fn tensors(&self) -> Vec<(String, &Tensor)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), &self.embed_tokens)];
        for (l, layer) in self.layers.iter().enumerate() {
            for (suffix, t) in layer.slots() {
                if let Some(t) = t {
                    out.push((format!("model.layers.{l}.{suffix}"), t));
                }
            }
        }
        out.push(("model.norm.weight".to_string(), &self.norm));
        if let Some(t) = &self.lm_head {
            out.push(("lm_head.weight".to_string(), t));
        }
        out
    }

    /// Every tensor with its HF name, mutably, in checkpoint order (for optimizers).
    pub fn tensors_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            &mut self.embed_tokens,
        )];
        for (l, layer) in self.layers.iter_mut().enumerate() {
            for (suffix, t) in layer.slots_mut() {
                if let Some(t) = t {
                    out.push((format!("model.layers.{l}.{suffix}"), t));
                }
            }
        }
        out.push(("model.norm.weight".to_string(), &mut self.norm));
        if let Some(t) = &mut self.lm_head {
            out.push(("lm_head.weight".to_string(), t));
        }
        out
    }

    /// Checks that these weights are exactly the tensors `config` implies (names, shapes,
    /// value counts), so a checkpoint is never written that would not load back.
    pub fn check(&self, config: &ModelConfig) -> Result<(), HfError> {
        let named = self.tensors();
        let have: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        check_tensors(&expected_tensors(config), &have)
    }

    /// Writes these weights as one safetensors file at `path` in `dtype`, after [`Self::check`].
    pub fn write_safetensors(
        &self,
        path: &Path,
        config: &ModelConfig,
        dtype: SaveDtype,
    ) -> Result<(), HfError> {
        self.check(config)?;
        let named = self.tensors();
        let list: Vec<NamedTensor<'_>> = named
            .iter()
            .map(|(n, t)| (n.as_str(), t.shape.as_slice(), t.data.as_slice()))
            .collect();
        write_safetensors(path, &list, dtype)
    }
}

/// Checks `have` holds exactly the `expected` tensors, with their shapes and value counts.
fn check_tensors(
    expected: &[(String, Vec<usize>)],
    have: &[(&str, &Tensor)],
) -> Result<(), HfError> {
    let by_name: HashMap<&str, &Tensor> = have.iter().copied().collect();
    for (name, shape) in expected {
        let Some(t) = by_name.get(name.as_str()) else {
            return Err(invalid(name, "missing"));
        };
        if t.shape != *shape {
            return Err(invalid(
                name,
                format!("shape {:?}, expected {shape:?}", t.shape),
            ));
        }
        if t.data.len() != shape.iter().product::<usize>() {
            return Err(invalid(
                name,
                format!("{} values for shape {shape:?}", t.data.len()),
            ));
        }
    }
    let known: BTreeSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    if let Some((name, _)) = have.iter().find(|(n, _)| !known.contains(n)) {
        return Err(invalid(
            name,
            "not part of this model (a tied lm_head or an unused bias?)",
        ));
    }
    Ok(())
}

/// Removes checked tensors from the map; a miss is an error, never a panic.
struct Taker(HashMap<String, Tensor>);

impl Taker {
    fn take(&mut self, name: &str) -> Result<Tensor, HfError> {
        self.0.remove(name).ok_or_else(|| invalid(name, "missing"))
    }

    fn opt(&mut self, name: &str, present: bool) -> Result<Option<Tensor>, HfError> {
        present.then(|| self.take(name)).transpose()
    }
}

fn invalid(tensor: &str, message: impl Into<String>) -> HfError {
    HfError::InvalidWeights {
        tensor: tensor.to_string(),
        message: message.into(),
    }
}
