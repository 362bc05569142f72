//! LoRA adapters in PEFT's files: `adapter_config.json` and `adapter_model.safetensors` as
//! `PeftModel.save_pretrained` writes them, read and checked against the base model's
//! `config.json`, merged into its weights (`merge_and_unload`'s arithmetic), and written
//! back in the same form so `PeftModel.from_pretrained` loads them.
//!
//! A LoRA pair on a linear layer `y = x·Wᵀ` adds `s · x·Aᵀ·Bᵀ`, with `A` `[r, in]`, `B`
//! `[out, r]` and `s = lora_alpha / r` (`lora_alpha / √r` with `use_rslora`). Merged:
//! `W ← W + s·(B·A)`, the product in f32, as peft computes `delta = (B @ A) * scaling`.
//!
//! Supported: the decoder's linear layers (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
//! `gate_proj`, `up_proj`, `down_proj`, or `all-linear`), `layers_to_transform`, rsLoRA; the
//! language model of a vision-language model (transformers' `model.language_model.` names).
//! Refused with the field named: other PEFT types, DoRA, LoRA biases, `fan_in_fan_out`,
//! `modules_to_save`, per-module ranks or alphas, a regex `target_modules`, adapters on the
//! embedding, the LM head or a vision tower.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use serde_json::{Map, Value};

use super::HfError;
use super::config::ModelConfig;
use super::json::{read_object, write_pretty};
use super::tensor_files::{
    NamedTensor, SaveDtype, le_f32s, le_u16s, write_safetensors_with_metadata,
};
use super::weights::{ModelWeights, expected_tensors};

/// The adapter's configuration file.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The adapter's weights file.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The linear layers of a decoder layer a LoRA pair can sit on, by PEFT's module names.
pub const TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];
/// The prefix PEFT puts before a module's name in the weights file.
const PREFIX: &str = "base_model.model.";

/// What `adapter_config.json` says that matters here.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` of every pair.
    pub r: usize,
    /// `lora_alpha`.
    pub lora_alpha: f64,
    /// Scale `α/√r` rather than `α/r`.
    pub use_rslora: bool,
    /// The module names adapted, from [`TARGETS`].
    pub target_modules: Vec<String>,
    /// The layers adapted (`None`: every layer).
    pub layers_to_transform: Option<Vec<usize>>,
}

impl LoraConfig {
    /// Pairs of rank `r` on every linear layer of every decoder layer (PEFT's
    /// `target_modules="all-linear"`), scale `alpha / r`.
    pub fn all_linear(r: usize, lora_alpha: f64) -> Self {
        Self {
            r,
            lora_alpha,
            use_rslora: false,
            target_modules: TARGETS.iter().map(|t| t.to_string()).collect(),
            layers_to_transform: None,
        }
    }

    /// The factor `s` on `B·A`: `lora_alpha / r`, or `lora_alpha / √r` with rsLoRA.
    pub fn scale(&self) -> f64 {
        let r = self.r as f64;
        if self.use_rslora {
            self.lora_alpha / r.sqrt()
        } else {
            self.lora_alpha / r
        }
    }

    /// Whether layer `layer`'s module `module` (a [`TARGETS`] name) carries a pair.
    pub fn adapts(&self, layer: usize, module: &str) -> bool {
        self.target_modules.iter().any(|t| t == module)
            && self
                .layers_to_transform
                .as_ref()
                .is_none_or(|l| l.contains(&layer))
    }
}

/// One LoRA pair: `a` `[r, in]`, `b` `[out, r]`, row-major f32.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPair {
    /// `lora_A.weight`.
    pub a: Vec<f32>,
    /// `lora_B.weight`.
    pub b: Vec<f32>,
    /// `[out, in]` of the adapted weight.
    pub out_in: [usize; 2],
}

/// An adapter: its configuration and a pair per adapted weight, keyed by the weight's
/// Hugging Face name (`model.layers.1.self_attn.q_proj.weight`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraAdapter {
    /// The configuration.
    pub config: LoraConfig,
    /// The pairs.
    pub pairs: BTreeMap<String, LoraPair>,
    /// Whether the file names the decoder `model.language_model.` (a vision-language model
    /// in transformers' module names) rather than `model.`.
    pub language_model: bool,
}

/// The weights-file key of `which` (`A` or `B`) of the pair on weight `name`
/// (`model.layers.…`), the decoder named `model.language_model.` when `language_model`.
fn pair_key(name: &str, which: &str, language_model: bool) -> String {
    let stem = name.trim_end_matches(".weight");
    let stem = match (language_model, stem.strip_prefix("model.")) {
        (true, Some(rest)) => format!("model.language_model.{rest}"),
        _ => stem.to_string(),
    };
    format!("{PREFIX}{stem}.lora_{which}.weight")
}

/// The module of a decoder layer's linear weight: `self_attn` or `mlp`.
fn section(module: &str) -> &'static str {
    if module.ends_with("_proj") && ["gate_proj", "up_proj", "down_proj"].contains(&module) {
        "mlp"
    } else {
        "self_attn"
    }
}

/// `model.layers.{layer}.{section}.{module}.weight`.
pub fn weight_name(layer: usize, module: &str) -> String {
    format!("model.layers.{layer}.{}.{module}.weight", section(module))
}

fn field(path: &Path, field: &str, message: impl Into<String>) -> HfError {
    HfError::Field {
        path: path.to_path_buf(),
        field: field.to_string(),
        message: message.into(),
    }
}

/// Reads `adapter_config.json` from its parsed object, refusing what is not supported.
fn parse_config(path: &Path, o: &Map<String, Value>) -> Result<LoraConfig, HfError> {
    let text = |k: &str| o.get(k).and_then(Value::as_str);
    let peft_type = text("peft_type").unwrap_or("LORA");
    if peft_type != "LORA" {
        return Err(field(
            path,
            "peft_type",
            format!("`{peft_type}`: only LORA adapters are supported"),
        ));
    }
    let r = o
        .get("r")
        .and_then(Value::as_u64)
        .filter(|&r| r > 0)
        .ok_or_else(|| {
            field(
                path,
                "r",
                format!("{:?}: expected a whole number > 0", o.get("r")),
            )
        })?;
    let lora_alpha = match o.get("lora_alpha") {
        None => 8.0, // PEFT's default
        Some(v) => v
            .as_f64()
            .filter(|a| a.is_finite())
            .ok_or_else(|| field(path, "lora_alpha", format!("{v}: expected a finite number")))?,
    };
    let flag = |k: &str| o.get(k).and_then(Value::as_bool).unwrap_or(false);
    for (k, why) in [
        ("use_dora", "DoRA adapters are not supported"),
        (
            "fan_in_fan_out",
            "only the (out, in) layout of nn.Linear is supported",
        ),
        ("lora_bias", "LoRA biases are not supported"),
    ] {
        if flag(k) {
            return Err(field(path, k, format!("true: {why}")));
        }
    }
    if let Some(b) = text("bias")
        && b != "none"
    {
        return Err(field(
            path,
            "bias",
            format!("`{b}`: only `none` is supported"),
        ));
    }
    let empty = |v: Option<&Value>| match v {
        None | Some(Value::Null) => true,
        Some(Value::Object(m)) => m.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        _ => false,
    };
    for (k, why) in [
        (
            "modules_to_save",
            "fully trained extra modules are not supported",
        ),
        ("rank_pattern", "per-module ranks are not supported"),
        ("alpha_pattern", "per-module alphas are not supported"),
        ("layer_replication", "layer replication is not supported"),
    ] {
        if !empty(o.get(k)) {
            return Err(field(path, k, format!("{}: {why}", o[k])));
        }
    }
    let target_modules = match o.get("target_modules") {
        Some(Value::String(s)) if s == "all-linear" => {
            TARGETS.iter().map(|t| t.to_string()).collect()
        }
        Some(Value::Array(list)) => {
            let mut names = Vec::new();
            for v in list {
                let name = v.as_str().ok_or_else(|| {
                    field(
                        path,
                        "target_modules",
                        format!("{v}: expected module names"),
                    )
                })?;
                if !TARGETS.contains(&name) {
                    return Err(field(
                        path,
                        "target_modules",
                        format!("`{name}`: supported modules are {}", TARGETS.join(", ")),
                    ));
                }
                names.push(name.to_string());
            }
            names
        }
        other => {
            return Err(field(
                path,
                "target_modules",
                format!(
                    "{other:?}: expected a list of module names or \"all-linear\" (a regex is not supported)"
                ),
            ));
        }
    };
    let layers_to_transform = match o.get("layers_to_transform") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => Some(vec![n.as_u64().unwrap_or(u64::MAX) as usize]),
        Some(Value::Array(list)) => Some(
            list.iter()
                .map(|v| v.as_u64().map(|x| x as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| field(path, "layers_to_transform", "expected layer indices"))?,
        ),
        Some(v) => {
            return Err(field(
                path,
                "layers_to_transform",
                format!("{v}: expected layer indices"),
            ));
        }
    };
    Ok(LoraConfig {
        r: r as usize,
        lora_alpha,
        use_rslora: flag("use_rslora"),
        target_modules,
        layers_to_transform,
    })
}

/// A tensor of the weights file as f32 (from F32, BF16 or F16).
fn f32_tensor(
    path: &Path,
    st: &SafeTensors<'_>,
    name: &str,
) -> Result<(Vec<usize>, Vec<f32>), HfError> {
    let t = st.tensor(name).map_err(|e| HfError::Safetensors {
        path: path.to_path_buf(),
        message: format!("{name}: {e}"),
    })?;
    let data = match t.dtype() {
        Dtype::F32 => le_f32s(t.data()),
        Dtype::BF16 => le_u16s(t.data())
            .into_iter()
            .map(|b| half::bf16::from_bits(b).to_f32())
            .collect(),
        Dtype::F16 => le_u16s(t.data())
            .into_iter()
            .map(|b| half::f16::from_bits(b).to_f32())
            .collect(),
        other => {
            return Err(HfError::UnsupportedDtype {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                dtype: format!("{other:?}"),
            });
        }
    };
    Ok((t.shape().to_vec(), data))
}

impl LoraAdapter {
    /// Reads the adapter in `dir` made for a model of `model`'s shape: every pair present,
    /// of rank `r` and the adapted weight's shape, and nothing else in the file.
    ///
    /// # Errors
    /// A missing or malformed file; an unsupported setting (named, see the module docs); a
    /// tensor that is not a LoRA pair of this model (another model's adapter, an embedding
    /// adapter, DoRA magnitudes), of another shape, or missing.
    pub fn read(dir: &Path, model: &ModelConfig) -> Result<Self, HfError> {
        let config_path = dir.join(CONFIG_FILE);
        let o = read_object(&config_path, "a PEFT adapter's configuration")?;
        let config = parse_config(&config_path, &o)?;
        let layers = model.num_hidden_layers;
        if let Some(bad) = config
            .layers_to_transform
            .iter()
            .flatten()
            .find(|&&l| l >= layers)
        {
            return Err(field(
                &config_path,
                "layers_to_transform",
                format!("layer {bad}: the model has {layers} layers"),
            ));
        }

        let path = dir.join(WEIGHTS_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(HfError::MissingFile {
                    path,
                    what: "a PEFT adapter's weights".into(),
                });
            }
            Err(e) => return Err(HfError::io(&path, e)),
        };
        let st = SafeTensors::deserialize(&bytes).map_err(|e| HfError::Safetensors {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let shapes: BTreeMap<String, Vec<usize>> = expected_tensors(model).into_iter().collect();
        let mut wanted = BTreeMap::new();
        for layer in 0..layers {
            for module in TARGETS {
                if config.adapts(layer, module) {
                    let name = weight_name(layer, module);
                    let shape = shapes.get(&name).cloned().unwrap_or_default();
                    wanted.insert(name, shape);
                }
            }
        }
        // sorted: the first offending tensor named is the same on every run
        let mut names = st.names();
        names.sort_unstable();
        if let Some(tower) = names.iter().find(|n| n.contains(".visual.")) {
            return Err(HfError::Safetensors {
                path: path.clone(),
                message: format!(
                    "tensor `{tower}` adapts the vision tower; adapters on the tower are not supported (target the language model only)"
                ),
            });
        }
        let language_model = names.iter().any(|n| n.contains(".language_model."));
        let key = |name: &str, which: &str| pair_key(name, which, language_model);
        let known: std::collections::BTreeSet<String> = wanted
            .keys()
            .flat_map(|n| [key(n, "A"), key(n, "B")])
            .collect();
        if let Some(extra) = names.into_iter().find(|n| !known.contains(*n)) {
            return Err(HfError::Safetensors {
                path: path.clone(),
                message: format!(
                    "tensor `{extra}` is not a LoRA pair of this model's {} (another model's adapter, or an unsupported kind)",
                    config.target_modules.join("/")
                ),
            });
        }
        let r = config.r;
        let mut pairs = BTreeMap::new();
        for (name, shape) in wanted {
            let [out, inp] = shape[..] else {
                return Err(field(
                    &config_path,
                    "target_modules",
                    format!("{name} is not a matrix"),
                ));
            };
            let get = |which: &str, want: [usize; 2]| -> Result<Vec<f32>, HfError> {
                let k = key(&name, which);
                if !st.names().contains(&&*k) {
                    return Err(HfError::MissingTensor {
                        path: path.clone(),
                        tensor: k,
                    });
                }
                let (s, data) = f32_tensor(&path, &st, &k)?;
                if s != want {
                    return Err(HfError::ShapeMismatch {
                        path: path.clone(),
                        tensor: k,
                        expected: want.to_vec(),
                        actual: s,
                    });
                }
                Ok(data)
            };
            let a = get("A", [r, inp])?;
            let b = get("B", [out, r])?;
            pairs.insert(
                name,
                LoraPair {
                    a,
                    b,
                    out_in: [out, inp],
                },
            );
        }
        Ok(Self {
            config,
            pairs,
            language_model,
        })
    }

    /// Adds each pair's `s·(B·A)` to its weight in `weights` (PEFT's `merge_and_unload`).
    ///
    /// # Errors
    /// A pair whose weight `weights` lacks or holds in another shape.
    pub fn merge_into(&self, weights: &mut ModelWeights) -> Result<(), HfError> {
        let scale = self.config.scale() as f32;
        let r = self.config.r;
        let mut by_name: BTreeMap<String, &mut super::weights::Tensor> =
            weights.tensors_mut().into_iter().collect();
        for (name, pair) in &self.pairs {
            let [out, inp] = pair.out_in;
            let w = by_name
                .get_mut(name.as_str())
                .ok_or_else(|| HfError::MissingTensor {
                    path: CONFIG_FILE.into(),
                    tensor: name.clone(),
                })?;
            if w.shape != [out, inp] {
                return Err(HfError::ShapeMismatch {
                    path: CONFIG_FILE.into(),
                    tensor: name.clone(),
                    expected: vec![out, inp],
                    actual: w.shape.clone(),
                });
            }
            let mut row = vec![0.0f32; inp];
            for o in 0..out {
                row.fill(0.0);
                for k in 0..r {
                    let b = pair.b[o * r + k];
                    for (acc, &a) in row.iter_mut().zip(&pair.a[k * inp..(k + 1) * inp]) {
                        *acc += b * a;
                    }
                }
                for (w, d) in w.data[o * inp..(o + 1) * inp].iter_mut().zip(&row) {
                    *w += d * scale;
                }
            }
        }
        Ok(())
    }

    /// Writes the adapter to `dir` as PEFT does (`adapter_config.json` with
    /// `base_model_name_or_path`, `adapter_model.safetensors` in f32), creating `dir`.
    ///
    /// # Errors
    /// I/O errors naming the file.
    pub fn write(&self, dir: &Path, base_model_name_or_path: &str) -> Result<(), HfError> {
        std::fs::create_dir_all(dir).map_err(|e| HfError::io(dir, e))?;
        let c = &self.config;
        let config = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": c.r,
            "lora_alpha": c.lora_alpha,
            "use_rslora": c.use_rslora,
            "target_modules": c.target_modules,
            "layers_to_transform": c.layers_to_transform,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
        });
        write_pretty(&dir.join(CONFIG_FILE), &config)?;
        let mut named = Vec::new();
        for (name, p) in &self.pairs {
            let [out, inp] = p.out_in;
            let lm = self.language_model;
            named.push((pair_key(name, "A", lm), vec![c.r, inp], &p.a));
            named.push((pair_key(name, "B", lm), vec![out, c.r], &p.b));
        }
        let list: Vec<NamedTensor<'_>> = named
            .iter()
            .map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice()))
            .collect();
        let metadata = [("format".to_string(), "pt".to_string())]
            .into_iter()
            .collect();
        write_safetensors_with_metadata(&dir.join(WEIGHTS_FILE), &list, SaveDtype::F32, metadata)
    }
}
