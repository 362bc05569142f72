//! LoRA adapters in PEFT's files: `adapter_config.json` and `adapter_model.safetensors` as
//! `PeftModel.save_pretrained` writes them, read and checked against the base model's
//! `config.json`, merged into its weights (`merge_and_unload`'s arithmetic), and written
//! back in the same form so `PeftModel.from_pretrained` loads them.
//!
//! A LoRA pair on a linear layer `y = x·Wᵀ` adds `s · x·Aᵀ·Bᵀ`, with `A` `[r, in]`, `B`
//! `[out, r]` and `s = lora_alpha / r` (`lora_alpha / √r` with `use_rslora`). Merged:
//! `W ← W + s·(B·A)`, the product in f32, as peft computes `delta = (B @ A) * scaling`.
//!
//! `target_modules` names modules as PEFT matches them: a name selects every module whose
//! path is the name or ends with `.name` (`q_proj`, `self_attn.q_proj`; `proj` selects the
//! tower's `attn.proj` *and* its patch embedding's `patch_embed.proj`, a Conv3d); `all-linear`
//! is [`ALL_LINEAR`], every linear layer but the LM head, as peft 0.21 expands it.
//!
//! Supported: the decoder's linear layers (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
//! `gate_proj`, `up_proj`, `down_proj`), `layers_to_transform`, rsLoRA; a vision-language
//! model's language model (transformers' `model.language_model.` names) and its vision
//! tower (`model.visual.`: `attn.qkv`, `attn.proj`, the MLP's `fc1`/`fc2` or
//! `gate_proj`/`up_proj`/`down_proj`, the merger's `mlp.0`/`mlp.2`, and the patch
//! embedding's Conv3d, whose pair PEFT stores as convolutions: `A` `[r, C, T, P, P]`, `B`
//! `[out, r, 1, 1, 1]`); `exclude_modules` naming the tower (`.*visual.*`: the language model
//! only). Refused with the field named: other PEFT types, DoRA, LoRA biases,
//! `fan_in_fan_out`, `modules_to_save`, per-module ranks or alphas, a regex
//! `target_modules`, other exclusions, adapters on the embedding or the LM head, and
//! `layers_to_transform` with pairs on the tower.

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
use crate::vision::config::VisionConfig;
use crate::vision::weights::{ParamSpec, VisionWeights, param_table};

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
/// What `target_modules: all-linear` stands for: every linear layer of the models here but
/// the LM head, by the shortest names that select them (as peft 0.21 writes them): the
/// decoder's, then the vision tower's (the SwiGLU tower's MLP shares the decoder's names).
pub const ALL_LINEAR: [&str; 13] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv",
    "attn.proj",
    "fc1",
    "fc2",
    "mlp.0",
    "mlp.2",
];
/// The paths, within a decoder layer or the vision tower (block index left out), of every
/// module a pair can sit on.
const MODULES: [&str; 14] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "patch_embed.proj",
    "attn.qkv",
    "attn.proj",
    "mlp.fc1",
    "mlp.fc2",
    "merger.mlp.0",
    "merger.mlp.2",
    // (the SwiGLU tower's mlp.gate_proj/up_proj/down_proj are the decoder's paths)
];
/// The prefix PEFT puts before a module's name in the weights file.
const PREFIX: &str = "base_model.model.";
/// The prefix of the vision tower's pairs in [`LoraAdapter::pairs`].
pub const TOWER: &str = "visual.";

/// Whether target name `target` selects the module at `path` (PEFT's rule: the path is
/// the name or ends with `.name`).
pub fn selects(target: &str, path: &str) -> bool {
    path == target
        || path
            .strip_suffix(target)
            .is_some_and(|head| head.ends_with('.'))
}

/// Whether `name` is a `target_modules` entry this crate can adapt: it selects some module a
/// pair can sit on (and is not a bare block index, which PEFT would match to whole blocks).
pub fn is_target_name(name: &str) -> bool {
    !name.is_empty()
        && !name.chars().all(|c| c.is_ascii_digit() || c == '.')
        && MODULES.iter().any(|m| selects(name, m))
}

/// Whether `pattern` (`exclude_modules`) is one this crate understands: a pattern naming the
/// vision tower (`.*visual.*`), which leaves the language model's modules in.
pub fn is_tower_exclusion(pattern: &str) -> bool {
    pattern.contains("visual")
}

/// The target names of `target_modules` as written (`all-linear`, one name, or names):
/// [`ALL_LINEAR`] for `all-linear`.
///
/// # Errors
/// An empty list, or the first name [`is_target_name`] refuses.
pub fn target_names(names: &[String]) -> Result<Vec<String>, String> {
    if let [one] = names
        && one == "all-linear"
    {
        return Ok(ALL_LINEAR.iter().map(|t| t.to_string()).collect());
    }
    if names.is_empty() {
        return Err("[]".into());
    }
    match names.iter().find(|n| !is_target_name(n)) {
        Some(bad) => Err(bad.clone()),
        None => Ok(names.to_vec()),
    }
}

/// What `adapter_config.json` says that matters here.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` of every pair.
    pub r: usize,
    /// `lora_alpha`.
    pub lora_alpha: f64,
    /// Scale `α/√r` rather than `α/r`.
    pub use_rslora: bool,
    /// The names selecting the adapted modules ([`selects`]; `all-linear` is
    /// [`ALL_LINEAR`]).
    pub target_modules: Vec<String>,
    /// The decoder layers adapted (`None`: every layer).
    pub layers_to_transform: Option<Vec<usize>>,
    /// `None`, or a pattern naming the vision tower ([`is_tower_exclusion`]): the language
    /// model's modules only.
    pub exclude_modules: Option<String>,
}

impl LoraConfig {
    /// Pairs of rank `r` on every linear layer but the LM head — the decoder's and a vision
    /// tower's (PEFT's `target_modules="all-linear"`), scale `alpha / r`.
    pub fn all_linear(r: usize, lora_alpha: f64) -> Self {
        Self {
            r,
            lora_alpha,
            use_rslora: false,
            target_modules: ALL_LINEAR.iter().map(|t| t.to_string()).collect(),
            layers_to_transform: None,
            exclude_modules: None,
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

    /// Whether some target name selects the module at `path` ([`selects`]).
    pub fn selects(&self, path: &str) -> bool {
        self.target_modules.iter().any(|t| selects(t, path))
    }

    /// Whether the decoder's module `module` (a [`TARGETS`] name) carries pairs (in the
    /// layers of `layers_to_transform`).
    pub fn adapts_module(&self, module: &str) -> bool {
        self.selects(&format!("{}.{module}", section(module)))
    }

    /// Whether layer `layer`'s module `module` (a [`TARGETS`] name) carries a pair.
    pub fn adapts(&self, layer: usize, module: &str) -> bool {
        self.adapts_module(module)
            && self
                .layers_to_transform
                .as_ref()
                .is_none_or(|l| l.contains(&layer))
    }

    /// Whether the vision tower's module at `path` (`attn.qkv`, `merger.mlp.0`, …; the
    /// block index left out) carries a pair (in every block).
    pub fn adapts_tower(&self, path: &str) -> bool {
        self.exclude_modules.is_none() && self.selects(path)
    }

    /// The names of the vision tower's weights that carry a pair, each with the weight's
    /// shape (`visual.blocks.0.attn.qkv.weight`, as [`LoraAdapter::pairs`] keys them).
    ///
    /// # Errors
    /// Pairs on the tower with `layers_to_transform` (which PEFT would apply to the tower's
    /// block indices too).
    pub fn tower_weights(&self, cfg: &VisionConfig) -> Result<Vec<(String, Vec<usize>)>, String> {
        let mut out = Vec::new();
        for spec in param_table(cfg) {
            let Some(path) = tower_module(&spec) else {
                continue;
            };
            if !self.adapts_tower(path) {
                continue;
            }
            if self.layers_to_transform.is_some() {
                return Err(format!(
                    "`{path}` of the vision tower is adapted and layers_to_transform is set; \
                     set exclude_modules to `.*visual.*` or leave layers_to_transform out"
                ));
            }
            let blocks = if spec.per_block { cfg.depth } else { 1 };
            for l in 0..blocks {
                out.push((format!("{TOWER}{}", spec.hf_name(l)), spec.shape.clone()));
            }
        }
        Ok(out)
    }
}

/// The module path (block index left out) of a tower parameter a pair can sit on — a
/// weight of two or more dims, a linear layer's or the patch embedding's — from its name
/// (`blocks.{}.attn.qkv.weight` → `attn.qkv`); `None` for biases and norms.
pub(crate) fn tower_module(spec: &ParamSpec) -> Option<&'static str> {
    let path = spec.name.strip_suffix(".weight")?;
    (spec.shape.len() >= 2).then(|| path.strip_prefix("blocks.{}.").unwrap_or(path))
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
    /// For a convolution (the tower's patch embedding), the kernel's dims `[C, T, P, P]`
    /// whose product is `in` (PEFT stores `A` `[r, C, T, P, P]` and `B` `[out, r, 1, 1,
    /// 1]`); empty for a linear layer.
    pub kernel: Vec<usize>,
}

impl LoraPair {
    /// The shapes of `A` and `B` in PEFT's file for rank `r`.
    fn file_shapes(&self, r: usize) -> [Vec<usize>; 2] {
        let [out, inp] = self.out_in;
        if self.kernel.is_empty() {
            return [vec![r, inp], vec![out, r]];
        }
        let mut a = vec![r];
        a.extend(&self.kernel);
        let mut b = vec![out, r];
        // a convolution's kernel dims are the input's but the channels
        b.extend(std::iter::repeat_n(1, self.kernel.len().saturating_sub(1)));
        [a, b]
    }
}

/// An adapter: its configuration and a pair per adapted weight, keyed by the weight's
/// Hugging Face name (`model.layers.1.self_attn.q_proj.weight`; a vision tower's
/// `visual.blocks.0.attn.qkv.weight`, [`TOWER`] before the tower's own name).
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
/// (`model.layers.…` or `visual.…`), in transformers' current module names when
/// `language_model` (`model.language_model.layers.…`, `model.visual.…`).
fn pair_key(name: &str, which: &str, language_model: bool) -> String {
    let stem = name.trim_end_matches(".weight");
    let stem = match (language_model, stem.strip_prefix("model.")) {
        (true, Some(rest)) => format!("model.language_model.{rest}"),
        (true, None) => format!("model.{stem}"),
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
    let written: Vec<String> = match o.get("target_modules") {
        Some(Value::String(s)) if s == "all-linear" => vec![s.clone()],
        Some(Value::Array(list)) => list
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    field(
                        path,
                        "target_modules",
                        format!("{v}: expected module names"),
                    )
                })
            })
            .collect::<Result<_, _>>()?,
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
    let target_modules = target_names(&written).map_err(|bad| {
        field(
            path,
            "target_modules",
            format!(
                "`{bad}`: not a module a LoRA pair can sit on (the decoder's {}; the vision \
                 tower's qkv, proj, fc1, fc2, mlp.0, mlp.2)",
                TARGETS.join(", ")
            ),
        )
    })?;
    let exclude_modules = match o.get("exclude_modules") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) if is_tower_exclusion(p) => Some(p.clone()),
        Some(v) => {
            return Err(field(
                path,
                "exclude_modules",
                format!(
                    "{v}: only null or a pattern naming the vision tower (.*visual.*) is supported"
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
        exclude_modules,
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

/// The weights an adapter of `config` puts pairs on in a model of `text`'s shape (with the
/// tower of `vision`), each with its shape: the decoder's `model.layers.…`, then the tower's
/// `visual.…`.
///
/// # Errors
/// What [`LoraConfig::tower_weights`] refuses.
pub fn adapted_weights(
    config: &LoraConfig,
    text: &ModelConfig,
    vision: Option<&VisionConfig>,
) -> Result<BTreeMap<String, Vec<usize>>, String> {
    let shapes: BTreeMap<String, Vec<usize>> = expected_tensors(text).into_iter().collect();
    let mut wanted = BTreeMap::new();
    for layer in 0..text.num_hidden_layers {
        for module in TARGETS {
            if config.adapts(layer, module) {
                let name = weight_name(layer, module);
                let shape = shapes.get(&name).cloned().unwrap_or_default();
                wanted.insert(name, shape);
            }
        }
    }
    if let Some(v) = vision {
        wanted.extend(config.tower_weights(v)?);
    }
    Ok(wanted)
}

impl LoraAdapter {
    /// Reads the adapter in `dir` made for a text model of `model`'s shape: every pair
    /// present, of rank `r` and the adapted weight's shape, and nothing else in the file.
    ///
    /// # Errors
    /// A missing or malformed file; an unsupported setting (named, see the module docs); a
    /// tensor that is not a LoRA pair of this model (another model's adapter, an embedding
    /// adapter, DoRA magnitudes, a vision tower's), of another shape, or missing.
    pub fn read(dir: &Path, model: &ModelConfig) -> Result<Self, HfError> {
        Self::read_with(dir, model, None)
    }

    /// [`LoraAdapter::read`] for a vision-language model: the language model of `text`'s
    /// shape and the vision tower of `vision`'s.
    ///
    /// # Errors
    /// As [`LoraAdapter::read`].
    pub fn read_vl(dir: &Path, text: &ModelConfig, vision: &VisionConfig) -> Result<Self, HfError> {
        Self::read_with(dir, text, Some(vision))
    }

    fn read_with(
        dir: &Path,
        model: &ModelConfig,
        vision: Option<&VisionConfig>,
    ) -> Result<Self, HfError> {
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
        let wanted = adapted_weights(&config, model, vision)
            .map_err(|m| field(&config_path, "layers_to_transform", m))?;
        // sorted: the first offending tensor named is the same on every run
        let mut names = st.names();
        names.sort_unstable();
        if vision.is_none()
            && let Some(tower) = names.iter().find(|n| n.contains(".visual."))
        {
            return Err(HfError::Safetensors {
                path: path.clone(),
                message: format!(
                    "tensor `{tower}` adapts a vision tower; the model is a text model"
                ),
            });
        }
        let language_model = names.iter().any(|n| {
            n.contains(".language_model.") || n.starts_with("base_model.model.model.visual.")
        });
        let key = |name: &str, which: &str| pair_key(name, which, language_model);
        let known: std::collections::BTreeSet<String> = wanted
            .keys()
            .flat_map(|n| [key(n, "A"), key(n, "B")])
            .collect();
        if let Some(extra) = names.into_iter().find(|n| !known.contains(*n)) {
            return Err(HfError::Safetensors {
                path: path.clone(),
                message: format!(
                    "tensor `{extra}` is not a LoRA pair of this model's {}{} (another model's adapter, or an unsupported kind)",
                    config.target_modules.join("/"),
                    if config.exclude_modules.is_some() {
                        " outside the vision tower"
                    } else {
                        ""
                    }
                ),
            });
        }
        let r = config.r;
        let mut pairs = BTreeMap::new();
        for (name, shape) in wanted {
            let (out, kernel) = match &shape[..] {
                [out, _] => (*out, Vec::new()),
                [out, rest @ ..] if rest.len() > 1 => (*out, rest.to_vec()),
                _ => {
                    return Err(field(
                        &config_path,
                        "target_modules",
                        format!("{name} is not a matrix"),
                    ));
                }
            };
            let inp = shape[1..].iter().product();
            let pair = LoraPair {
                a: Vec::new(),
                b: Vec::new(),
                out_in: [out, inp],
                kernel,
            };
            let get = |which: &str, want: &[usize]| -> Result<Vec<f32>, HfError> {
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
            let [sa, sb] = pair.file_shapes(r);
            let a = get("A", &sa)?;
            let b = get("B", &sb)?;
            pairs.insert(name, LoraPair { a, b, ..pair });
        }
        Ok(Self {
            config,
            pairs,
            language_model,
        })
    }

    /// Adds each of the language model's pairs' `s·(B·A)` to its weight in `weights`
    /// (PEFT's `merge_and_unload`; a tower's pairs: [`LoraAdapter::merge_into_tower`]).
    ///
    /// # Errors
    /// A pair whose weight `weights` lacks or holds in another shape.
    pub fn merge_into(&self, weights: &mut ModelWeights) -> Result<(), HfError> {
        let mut by_name: BTreeMap<String, &mut super::weights::Tensor> =
            weights.tensors_mut().into_iter().collect();
        for (name, pair) in self.pairs.iter().filter(|(n, _)| !n.starts_with(TOWER)) {
            let w = by_name
                .get_mut(name.as_str())
                .ok_or_else(|| HfError::MissingTensor {
                    path: CONFIG_FILE.into(),
                    tensor: name.clone(),
                })?;
            self.merge_pair(name, pair, &w.shape, &mut w.data)?;
        }
        Ok(())
    }

    /// Adds each of the vision tower's pairs' `s·(B·A)` to its weight in `weights`, the
    /// tower of `cfg` (blocks stacked).
    ///
    /// # Errors
    /// A pair whose weight the tower lacks or holds in another shape.
    pub fn merge_into_tower(
        &self,
        cfg: &VisionConfig,
        weights: &mut VisionWeights,
    ) -> Result<(), HfError> {
        let table = param_table(cfg);
        for (name, pair) in &self.pairs {
            let Some(rest) = name.strip_prefix(TOWER) else {
                continue;
            };
            let found = table.iter().find_map(|spec| {
                let blocks = if spec.per_block { cfg.depth } else { 1 };
                (0..blocks)
                    .find(|&l| spec.hf_name(l) == rest)
                    .map(|l| (spec, l))
            });
            let missing = || HfError::MissingTensor {
                path: CONFIG_FILE.into(),
                tensor: name.clone(),
            };
            let (spec, l) = found.ok_or_else(missing)?;
            let t = weights.get_mut(spec.slot).ok_or_else(missing)?;
            let item = spec.item();
            let block = t
                .data
                .get_mut(l * item..(l + 1) * item)
                .ok_or_else(missing)?;
            self.merge_pair(name, pair, &spec.shape, block)?;
        }
        Ok(())
    }

    /// `w += s·(B·A)` for one pair, `w` of shape `shape` (`[out, in…]`).
    fn merge_pair(
        &self,
        name: &str,
        pair: &LoraPair,
        shape: &[usize],
        w: &mut [f32],
    ) -> Result<(), HfError> {
        let scale = self.config.scale() as f32;
        let r = self.config.r;
        let [out, inp] = pair.out_in;
        if shape.len() < 2 || shape[0] != out || shape[1..].iter().product::<usize>() != inp {
            return Err(HfError::ShapeMismatch {
                path: CONFIG_FILE.into(),
                tensor: name.to_string(),
                expected: vec![out, inp],
                actual: shape.to_vec(),
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
            for (w, d) in w[o * inp..(o + 1) * inp].iter_mut().zip(&row) {
                *w += d * scale;
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
            "target_modules": self.written_targets(),
            "layers_to_transform": c.layers_to_transform,
            "exclude_modules": c.exclude_modules,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
        });
        write_pretty(&dir.join(CONFIG_FILE), &config)?;
        let mut named = Vec::new();
        for (name, p) in &self.pairs {
            let lm = self.language_model;
            let [sa, sb] = p.file_shapes(c.r);
            named.push((pair_key(name, "A", lm), sa, &p.a));
            named.push((pair_key(name, "B", lm), sb, &p.b));
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

    /// The target names to write: those of the configuration that select some pair of the
    /// adapter (so PEFT, reading them, selects no module the adapter has no pair for), or
    /// all of them for an adapter without pairs.
    fn written_targets(&self) -> Vec<String> {
        let stems: Vec<&str> = self
            .pairs
            .keys()
            .map(|n| n.trim_end_matches(".weight"))
            .collect();
        let used: Vec<String> = self
            .config
            .target_modules
            .iter()
            .filter(|t| stems.iter().any(|s| selects(t, s)))
            .cloned()
            .collect();
        if used.is_empty() {
            self.config.target_modules.clone()
        } else {
            used
        }
    }
}
