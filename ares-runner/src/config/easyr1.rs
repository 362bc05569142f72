//! EasyR1's keys (and those of its ARES fork) read the way EasyR1 reads them, so an
//! experiment's `config.yaml` runs here as written.
//!
//! Where EasyR1 and ares share a setting, EasyR1's key is the canonical one (the typed
//! [`Config`](super::Config) carries it). What is left of EasyR1's schema falls into four
//! kinds of [`Rule`], applied to the parsed file and to each override before they are merged
//! onto the defaults (so unknown keys are still refused, with the did-you-mean message):
//! - **renamed**: an older ares name of a canonical key (`worker.actor.model_path` is now
//!   `worker.actor.model.model_path`): the value moves unchanged;
//! - **mapped**: an EasyR1 key whose values are spelled differently here
//!   (`loss_avg_mode: token` is `loss_agg_mode: token-mean`), or a value with an EasyR1
//!   meaning (`top_k: -1` = off = `0`): the value is translated;
//! - **ignored**: an engine knob of a Ray/FSDP/vLLM stack with no meaning here
//!   (`worker.actor.fsdp.*`, `tensor_parallel_size`): accepted, whatever its value;
//! - **inert**: a key accepted at the values that change nothing here (`override_config: {}`) and
//!   refused, with the reason, at any other.
//!
//! Every rule that fires leaves a [`ConfigNote`]; `ares-runner train` and `ares-runner
//! config` print them once at start, so nothing is dropped silently.

use std::fmt;

use serde_json::{Map, Value};

use super::error::ConfigError;
use super::tree::{Override, describe};

/// What became of one key of a config file or override.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigNote {
    /// The dotted key as written (`worker.actor.fsdp.*` for a whole section).
    pub key: String,
    /// Where it was written (`in config.yaml`, `from override ...`).
    pub origin: String,
    /// What was done with it.
    pub action: NoteAction,
}

/// The action behind a [`ConfigNote`].
#[derive(Debug, Clone, PartialEq)]
pub enum NoteAction {
    /// Read as the canonical key `to` (an older ares name).
    Renamed {
        /// The canonical key.
        to: String,
    },
    /// Read as `to = value` (an EasyR1 spelling or value).
    Mapped {
        /// The key it sets.
        to: String,
        /// The value it sets, as YAML.
        value: String,
    },
    /// Accepted and without effect here.
    Ignored {
        /// Why it has no meaning in ares.
        why: &'static str,
    },
}

impl fmt::Display for ConfigNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.action {
            NoteAction::Renamed { to } => write!(
                f,
                "renamed  {} ({}): read as `{to}`, its name now (EasyR1's)",
                self.key, self.origin
            ),
            NoteAction::Mapped { to, value } => write!(
                f,
                "mapped   {} ({}): read as `{to}: {value}`",
                self.key, self.origin
            ),
            NoteAction::Ignored { why } => {
                write!(f, "ignored  {} ({}): {why}", self.key, self.origin)
            }
        }
    }
}

/// The notes as a table for people: a heading and one line per note (empty for none).
pub fn notes_table(notes: &[ConfigNote]) -> String {
    if notes.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "{} key(s) of EasyR1's schema (or older ares names) read differently:\n",
        notes.len()
    );
    for n in notes {
        out.push_str(&format!("  {n}\n"));
    }
    out
}

/// A translation of an EasyR1 value: the key it sets and the value, or why the value cannot
/// be used.
type Translate = fn(&Value) -> Result<(&'static str, Value), String>;

/// One key of EasyR1's schema that is not, as written, a key of ours. `key` is dotted; a
/// rule on a section covers everything below it.
#[derive(Clone, Copy)]
pub(crate) enum Rule {
    /// An older ares name of `to`.
    Renamed { key: &'static str, to: &'static str },
    /// An EasyR1 spelling: `translate` gives the key and value it sets (possibly `key`
    /// itself, with a value of ours).
    Mapped {
        key: &'static str,
        translate: Translate,
    },
    /// An engine knob without meaning here.
    Ignored {
        key: &'static str,
        why: &'static str,
    },
    /// Accepted where `inert` holds (a value that changes nothing here); otherwise refused
    /// with `refused`.
    Inert {
        key: &'static str,
        inert: fn(&Value) -> bool,
        why: &'static str,
        refused: &'static str,
    },
}

impl Rule {
    fn key(&self) -> &'static str {
        match *self {
            Rule::Renamed { key, .. }
            | Rule::Mapped { key, .. }
            | Rule::Ignored { key, .. }
            | Rule::Inert { key, .. } => key,
        }
    }
}

const NO_FSDP: &str = "ares runs without FSDP: one process holds the whole model";
const NO_OFFLOAD: &str = "ares keeps parameters and optimizer state where the backend runs";
const NO_VLLM: &str = "ares generates with its own engine, not vLLM";
const PACKED: &str = "ares lays out each pass's sequences itself (a text model's on the CPU \
                      back to back without padding; on CUDA and for vision-language models \
                      prompts left-padded, responses right-padded to the step's longest) and \
                      sizes its own chunks";
const ONE_DEVICE: &str = "ares shards no model across devices (no sequence or tensor \
                          parallelism); data parallelism is one process per device, started \
                          by torchrun or srun (docs/training.md, Data parallel)";
const NO_CRITIC: &str = "ares has no critic: every estimator it offers is critic-free";
const SECOND_CHANCE: &str = "a no-op in the ARES fork as released (its actor never receives \
                             the soft cost it reads); not built here";

fn is_false(v: &Value) -> bool {
    v.is_null() || *v == Value::Bool(false)
}

fn is_true(v: &Value) -> bool {
    v.is_null() || *v == Value::Bool(true)
}

fn adamw(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("adamw")
}

fn is_empty_map(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        _ => false,
    }
}

/// `-1` (EasyR1's "none") as `our` value; anything else unchanged.
fn minus_one_as(key: &'static str, value: &Value, our: Value) -> (&'static str, Value) {
    if value.as_i64() == Some(-1) {
        (key, our)
    } else {
        (key, value.clone())
    }
}

fn string_of(value: &Value) -> Option<&str> {
    value.as_str().map(str::trim)
}

/// EasyR1's `loss_avg_mode` (`token`: Σ m·L / Σ m over the mini-batch; `seq`: the mean over
/// sequences of each sequence's token mean, as the ARES fork computes it — EasyR1 itself
/// weights each micro-batch's sequence mean by its tokens).
fn loss_avg_mode(v: &Value) -> Result<(&'static str, Value), String> {
    let to = "worker.actor.loss_agg_mode";
    match string_of(v) {
        Some("token") => Ok((to, "token-mean".into())),
        Some("seq") => Ok((to, "seq-mean-token-mean".into())),
        _ => Err("expected `token` or `seq`".into()),
    }
}

/// EasyR1's `loss_type`: `default` is PPO's clipped loss (with dual clip), `gspo` (the
/// sequence ratio on every token; with outcome advantages the same values and gradients as
/// the token form) and `gspo_token` GSPO's token form, `cispo` CISPO.
fn loss_type(v: &Value) -> Result<(&'static str, Value), String> {
    let to = "worker.actor.policy_loss";
    match string_of(v) {
        Some("default") => Ok((to, "ppo".into())),
        Some("gspo") => Ok((to, "gspo_token".into())),
        Some("gspo_token") => Ok((to, "gspo_token".into())),
        Some("cispo") => Ok((to, "cispo".into())),
        Some("sapo") => Err(
            "EasyR1's SAPO loss is not built; ares offers PPO (`default`), \
                             GSPO, CISPO, Clip-Cov and KL-Cov (worker.actor.policy_loss)"
                .into(),
        ),
        _ => Err("expected `default`, `gspo`, `gspo_token` or `cispo`".into()),
    }
}

/// vLLM's `dtype` of the rollout: the decode weights' format.
fn rollout_dtype(v: &Value) -> Result<(&'static str, Value), String> {
    let to = "worker.rollout.weight_dtype";
    match string_of(v).map(str::to_ascii_lowercase).as_deref() {
        Some("bf16" | "bfloat16") => Ok((to, "bf16".into())),
        Some("fp32" | "f32" | "float32" | "float") => Ok((to, "f32".into())),
        _ => Err("expected `bf16` or `fp32` (ares decodes with f32 or bf16 weights)".into()),
    }
}

/// `top_k: -1` is vLLM's "off", ours is 0.
fn top_k(v: &Value) -> Result<(&'static str, Value), String> {
    Ok(minus_one_as("worker.rollout.top_k", v, Value::from(0)))
}

/// An empty file name is EasyR1's "no file".
fn train_files(v: &Value) -> Result<(&'static str, Value), String> {
    Ok(empty_as_null("data.train_files", v))
}

fn val_files(v: &Value) -> Result<(&'static str, Value), String> {
    Ok(empty_as_null("data.val_files", v))
}

fn empty_as_null(key: &'static str, v: &Value) -> (&'static str, Value) {
    if v.as_str().is_some_and(|s| s.trim().is_empty()) {
        (key, Value::Null)
    } else {
        (key, v.clone())
    }
}

/// `min_lr_ratio: null` is EasyR1's 0 (the cosine schedule's floor).
fn min_lr_ratio(v: &Value) -> Result<(&'static str, Value), String> {
    let to = "worker.actor.optim.min_lr_ratio";
    Ok(if v.is_null() {
        (to, Value::from(0.0))
    } else {
        (to, v.clone())
    })
}

/// `save_freq`/`val_freq: -1` (EasyR1's "never during training") is our 0.
fn save_freq(v: &Value) -> Result<(&'static str, Value), String> {
    Ok(minus_one_as("trainer.save_freq", v, Value::from(0)))
}

fn val_freq(v: &Value) -> Result<(&'static str, Value), String> {
    Ok(minus_one_as("trainer.val_freq", v, Value::from(0)))
}

/// `save_limit: -1` (keep every checkpoint) is our 0.
fn save_limit(v: &Value) -> Result<(&'static str, Value), String> {
    Ok(minus_one_as("trainer.save_limit", v, Value::from(0)))
}

/// Our older `reward_type: math | rubric` named the built-in grader; EasyR1's (ARES fork)
/// `reward_type: batch | sequential` is how a Python reward function is called.
fn reward_type(v: &Value) -> Result<(&'static str, Value), String> {
    match string_of(v) {
        Some("math" | "rubric") => Ok(("worker.reward.grader", v.clone())),
        _ => Ok(("worker.reward.reward_type", v.clone())),
    }
}

/// EasyR1's `val_override_config` replaces the rollout's sampling settings for validation:
/// a key it leaves out is the rollout's, so every key it does not give is written as null.
fn val_override_config(v: &Value) -> Result<(&'static str, Value), String> {
    const KEYS: [&str; 5] = ["temperature", "top_p", "top_k", "min_p", "n"];
    let to = "worker.rollout.val_override_config";
    let given = match v {
        Value::Null => Map::new(),
        Value::Object(m) => m.clone(),
        other => return Err(format!("expected a mapping, found {}", describe(other))),
    };
    if let Some(bad) = given.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(format!(
            "`{bad}` cannot be overridden for validation; valid keys: {}",
            KEYS.join(", ")
        ));
    }
    let mut full = Map::new();
    for key in KEYS {
        let value = given.get(key).cloned().unwrap_or(Value::Null);
        let value = if key == "top_k" && value.as_i64() == Some(-1) {
            Value::from(0)
        } else {
            value
        };
        full.insert(key.to_string(), value);
    }
    Ok((to, Value::Object(full)))
}

/// Every key of EasyR1's schema (and the ARES fork's) that is not, as written, ours.
pub(crate) const RULES: &[Rule] = &[
    // Older ares names of keys that now carry EasyR1's name.
    Rule::Renamed {
        key: "worker.actor.model_path",
        to: "worker.actor.model.model_path",
    },
    Rule::Renamed {
        key: "worker.actor.freeze_vision_tower",
        to: "worker.actor.model.freeze_vision_tower",
    },
    Rule::Renamed {
        key: "worker.actor.micro_batch_size_per_device",
        to: "worker.actor.micro_batch_size_per_device_for_update",
    },
    Rule::Renamed {
        key: "algorithm.max_try_make_batch",
        to: "trainer.max_try_make_batch",
    },
    Rule::Renamed {
        key: "algorithm.kl_ctrl",
        to: "algorithm.kl_type",
    },
    Rule::Renamed {
        key: "worker.actor.optim.lr_scheduler",
        to: "worker.actor.optim.lr_scheduler_type",
    },
    // The ARES fork's name of the same setting.
    Rule::Renamed {
        key: "worker.actor.optim.warmup_style",
        to: "worker.actor.optim.lr_scheduler_type",
    },
    Rule::Renamed {
        key: "trainer.output_dir",
        to: "trainer.save_checkpoint_path",
    },
    Rule::Renamed {
        key: "trainer.resume",
        to: "trainer.find_last_checkpoint",
    },
    Rule::Renamed {
        key: "worker.rollout.val_temperature",
        to: "worker.rollout.val_override_config.temperature",
    },
    Rule::Renamed {
        key: "worker.rollout.val_n",
        to: "worker.rollout.val_override_config.n",
    },
    // EasyR1 spellings and values.
    Rule::Mapped {
        key: "worker.reward.reward_type",
        translate: reward_type,
    },
    Rule::Mapped {
        key: "worker.actor.loss_avg_mode",
        translate: loss_avg_mode,
    },
    Rule::Mapped {
        key: "worker.actor.loss_type",
        translate: loss_type,
    },
    Rule::Mapped {
        key: "worker.rollout.dtype",
        translate: rollout_dtype,
    },
    Rule::Mapped {
        key: "worker.rollout.top_k",
        translate: top_k,
    },
    Rule::Mapped {
        key: "worker.rollout.val_override_config",
        translate: val_override_config,
    },
    Rule::Mapped {
        key: "data.train_files",
        translate: train_files,
    },
    Rule::Mapped {
        key: "data.val_files",
        translate: val_files,
    },
    Rule::Mapped {
        key: "worker.actor.optim.min_lr_ratio",
        translate: min_lr_ratio,
    },
    Rule::Mapped {
        key: "trainer.save_freq",
        translate: save_freq,
    },
    Rule::Mapped {
        key: "trainer.val_freq",
        translate: val_freq,
    },
    Rule::Mapped {
        key: "trainer.save_limit",
        translate: save_limit,
    },
    // Engine knobs.
    Rule::Ignored {
        key: "worker.hybrid_engine",
        why: "ares trains and generates in one process with shared weights",
    },
    Rule::Ignored {
        key: "worker.actor.strategy",
        why: NO_FSDP,
    },
    Rule::Ignored {
        key: "worker.actor.fsdp",
        why: NO_FSDP,
    },
    Rule::Ignored {
        key: "worker.actor.offload",
        why: NO_OFFLOAD,
    },
    Rule::Ignored {
        key: "worker.ref.strategy",
        why: NO_FSDP,
    },
    Rule::Ignored {
        key: "worker.ref.fsdp",
        why: NO_FSDP,
    },
    Rule::Ignored {
        key: "worker.ref.offload",
        why: NO_OFFLOAD,
    },
    Rule::Ignored {
        key: "worker.critic",
        why: NO_CRITIC,
    },
    Rule::Ignored {
        key: "worker.actor.dynamic_batching",
        why: PACKED,
    },
    Rule::Ignored {
        key: "worker.actor.micro_batch_size_per_device_for_experience",
        why: PACKED,
    },
    Rule::Ignored {
        key: "worker.actor.use_torch_compile",
        why: "ares runs no PyTorch",
    },
    Rule::Ignored {
        key: "worker.actor.ulysses_size",
        why: ONE_DEVICE,
    },
    Rule::Ignored {
        key: "worker.actor.model.trust_remote_code",
        why: "ares runs no code from model folders: its own model code reads the weights",
    },
    Rule::Ignored {
        key: "worker.rollout.name",
        why: NO_VLLM,
    },
    Rule::Ignored {
        key: "worker.rollout.gpu_memory_utilization",
        why: NO_VLLM,
    },
    Rule::Ignored {
        key: "worker.rollout.enforce_eager",
        why: "ares's CUDA graphs are worker.rollout.cuda_graphs (off by default)",
    },
    Rule::Ignored {
        key: "worker.rollout.enable_chunked_prefill",
        why: "ares always prefills long prompts in chunks",
    },
    Rule::Ignored {
        key: "worker.rollout.tensor_parallel_size",
        why: ONE_DEVICE,
    },
    Rule::Ignored {
        key: "worker.rollout.max_num_batched_tokens",
        why: NO_VLLM,
    },
    Rule::Ignored {
        key: "worker.rollout.max_model_len",
        why: "ares sizes the KV cache from data.max_prompt_length + max_response_length",
    },
    Rule::Ignored {
        key: "worker.rollout.disable_log_stats",
        why: NO_VLLM,
    },
    Rule::Ignored {
        key: "worker.rollout.disable_tqdm",
        why: "progress bars show on a terminal only, as a line per phase elsewhere",
    },
    Rule::Ignored {
        key: "worker.reward.num_cpus",
        why: "ares grades in its own process (a Python reward function runs in one worker)",
    },
    Rule::Ignored {
        key: "data.val_batch_size",
        why: "validation runs through the rollout engine, which admits prompts as slots free up",
    },
    Rule::Ignored {
        key: "data.filter_overlong_prompts_workers",
        why: "ares measures prompt lengths in its own threads",
    },
    Rule::Ignored {
        key: "trainer.nnodes",
        why: ONE_DEVICE,
    },
    Rule::Ignored {
        key: "trainer.n_gpus_per_node",
        why: ONE_DEVICE,
    },
    Rule::Ignored {
        key: "trainer.ray_timeline",
        why: "ares runs without Ray; per-phase times are in metrics.jsonl",
    },
    Rule::Ignored {
        key: "trainer.critic_warmup",
        why: NO_CRITIC,
    },
    Rule::Ignored {
        key: "algorithm.lam",
        why: "λ of GAE, which needs a critic; ares has none",
    },
    // Keys that change nothing at their default and are not built for other values.
    Rule::Inert {
        key: "worker.actor.model.override_config",
        inert: is_empty_map,
        why: "no config.json entries overridden",
        refused: "overriding config.json entries is not supported; edit the model folder's \
                  config.json instead",
    },
    Rule::Inert {
        key: "worker.rollout.ignore_eos",
        inert: is_false,
        why: "generation stops at EOS, as ares always does",
        refused: "ares always stops a response at EOS",
    },
    Rule::Inert {
        key: "worker.reward.skip_special_tokens",
        inert: is_true,
        why: "responses are decoded without special tokens, as ares always does",
        refused: "ares always decodes responses without special tokens",
    },
    Rule::Inert {
        key: "worker.actor.optim.strategy",
        inert: adamw,
        why: "ares's optimizer is AdamW; how its moments are stored is \
              `worker.actor.optim.state_dtype`",
        refused: "expected `adamw`; EasyR1's `adamw_bf16` (bf16 moments) is written \
                  `worker.actor.optim.state_dtype: bf16` here",
    },
    Rule::Ignored {
        key: "worker.actor.tau_positive",
        why: "read only by EasyR1's `loss_type: sapo`, which ares does not offer",
    },
    Rule::Ignored {
        key: "worker.actor.tau_negative",
        why: "read only by EasyR1's `loss_type: sapo`, which ares does not offer",
    },
    // Keys of the ARES fork that its own code never reads (so ignoring them is what it does).
    Rule::Ignored {
        key: "algorithm.difficulty_aware_kl_penalty",
        why: "read by nothing in the ARES fork; per-bucket KL here is algorithm.kl_type: \
              dual_ascent and worker.actor.dynamic_kl_loss",
    },
    Rule::Ignored {
        key: "worker.actor.enable_second_chance_kl",
        why: SECOND_CHANCE,
    },
    Rule::Ignored {
        key: "worker.actor.second_chance_easy_only",
        why: SECOND_CHANCE,
    },
    Rule::Ignored {
        key: "worker.actor.second_chance_incorrect_only",
        why: SECOND_CHANCE,
    },
    Rule::Ignored {
        key: "worker.actor.second_chance_soft_cost_min",
        why: SECOND_CHANCE,
    },
    Rule::Ignored {
        key: "worker.actor.second_chance_kl_relax",
        why: SECOND_CHANCE,
    },
];

/// The rule covering dotted `segments` (the rule's key equal to them or a section above
/// them), if any.
fn rule_for(segments: &[String]) -> Option<&'static Rule> {
    RULES.iter().find(|r| {
        let key: Vec<&str> = r.key().split('.').collect();
        key.len() <= segments.len() && key.iter().zip(segments).all(|(a, b)| *a == b)
    })
}

/// Removes and returns the value at dotted `key` from `tree`, if present.
fn take(tree: &mut Value, key: &str) -> Option<Value> {
    let segments: Vec<&str> = key.split('.').collect();
    let (last, parents) = segments.split_last()?;
    let mut node = tree;
    for s in parents {
        node = node.get_mut(*s)?;
    }
    node.as_object_mut()?.remove(*last)
}

/// Puts `value` at dotted `key` in `tree`, creating sections on the way.
///
/// Errors: the key (or a section above it) is already set, by the same source: `set_by`
/// names the key written that leads here, for the message.
fn put(
    tree: &mut Value,
    key: &str,
    value: Value,
    set_by: &str,
    origin: &str,
) -> Result<(), ConfigError> {
    let segments: Vec<&str> = key.split('.').collect();
    let Some((last, parents)) = segments.split_last() else {
        return Err(ConfigError::Internal(format!("empty key for `{set_by}`")));
    };
    let mut node = tree;
    for s in parents {
        let Value::Object(section) = node else {
            return Err(ConfigError::Internal(format!(
                "`{key}` crosses a value at `{s}`"
            )));
        };
        node = section
            .entry(s.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    let Value::Object(section) = node else {
        return Err(ConfigError::Internal(format!(
            "`{key}` crosses a value at its parent"
        )));
    };
    if section.contains_key(*last) {
        return Err(ConfigError::Inconsistent {
            key: set_by.to_string(),
            value: format!("({origin})"),
            reason: format!("it sets `{key}`, which is also set there; keep one of the two"),
        });
    }
    section.insert((*last).to_string(), value);
    Ok(())
}

/// A rule's outcome: the key and value to set instead (if any), and the note (if any).
type Applied = (Option<(String, Value)>, Option<ConfigNote>);

/// What a rule makes of `value` written at `key`: the key and value to set instead (if
/// any) and the note.
fn apply_rule(rule: &Rule, key: &str, value: Value, origin: &str) -> Result<Applied, ConfigError> {
    let shown = |v: &Value| {
        if v.is_object() {
            format!("{key}.*")
        } else {
            key.to_string()
        }
    };
    let note = |action| ConfigNote {
        key: shown(&value),
        origin: origin.to_string(),
        action,
    };
    match *rule {
        Rule::Renamed { to, .. } => {
            let n = note(NoteAction::Renamed { to: to.to_string() });
            Ok((Some((to.to_string(), value)), Some(n)))
        }
        Rule::Mapped { translate, .. } => {
            let (to, mapped) = translate(&value).map_err(|reason| ConfigError::Inconsistent {
                key: key.to_string(),
                value: format!("{} ({origin})", describe(&value)),
                reason,
            })?;
            // A value kept as written under its own key is no news.
            let n = (to != key || mapped != value).then(|| {
                note(NoteAction::Mapped {
                    to: to.to_string(),
                    value: yaml_value(&mapped),
                })
            });
            Ok((Some((to.to_string(), mapped)), n))
        }
        Rule::Ignored { why, .. } => Ok((None, Some(note(NoteAction::Ignored { why })))),
        Rule::Inert {
            inert,
            why,
            refused,
            ..
        } => {
            if inert(&value) {
                Ok((None, Some(note(NoteAction::Ignored { why }))))
            } else {
                Err(ConfigError::Inconsistent {
                    key: key.to_string(),
                    value: format!("{} ({origin})", describe(&value)),
                    reason: refused.to_string(),
                })
            }
        }
    }
}

/// A value as one line of YAML flow (JSON is YAML).
fn yaml_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Applies [`RULES`] to a parsed config file (`origin`: `in FILE`), in place, adding a note
/// per key it read differently or ignored.
///
/// Errors: a value a rule cannot use (named with the key and the reason), or a key set both
/// under its EasyR1 or older name and under the one it maps to.
pub(crate) fn translate_tree(
    tree: &mut Value,
    origin: &str,
    notes: &mut Vec<ConfigNote>,
) -> Result<(), ConfigError> {
    let mut moved = Vec::new();
    for rule in RULES {
        let key = rule.key();
        let Some(value) = take(tree, key) else {
            continue;
        };
        let (set, note) = apply_rule(rule, key, value, origin)?;
        notes.extend(note);
        if let Some(set) = set {
            moved.push((key, set));
        }
    }
    for (written, (to, value)) in moved {
        put(tree, &to, value, written, origin)?;
    }
    Ok(())
}

/// Applies [`RULES`] to one override: `None` when the rule ignores it, else the override to
/// apply (rewritten to the key and value it sets).
///
/// Errors: as [`translate_tree`]; a malformed value.
pub(crate) fn translate_override(
    o: Override,
    notes: &mut Vec<ConfigNote>,
) -> Result<Option<Override>, ConfigError> {
    let Some(rule) = rule_for(&o.segments) else {
        return Ok(Some(o));
    };
    let key = o.segments.join(".");
    let origin = o.origin();
    let rule_depth = rule.key().split('.').count();
    // An override of a key inside a renamed section keeps the rest of its path.
    if let Rule::Renamed { to, .. } = *rule {
        let mut segments: Vec<String> = to.split('.').map(str::to_string).collect();
        segments.extend(o.segments[rule_depth..].iter().cloned());
        notes.push(ConfigNote {
            key,
            origin,
            action: NoteAction::Renamed {
                to: segments.join("."),
            },
        });
        return Ok(Some(Override { segments, ..o }));
    }
    // Other rules see the whole value of their key: nest what the override gives inside.
    let mut value = o.value()?;
    for segment in o.segments[rule_depth..].iter().rev() {
        let mut m = Map::new();
        m.insert(segment.clone(), value);
        value = Value::Object(m);
    }
    let (set, note) = apply_rule(rule, rule.key(), value, &origin)?;
    notes.extend(note);
    let Some((to, value)) = set else {
        return Ok(None);
    };
    Ok(Some(Override {
        segments: to.split('.').map(str::to_string).collect(),
        raw: value.to_string(),
        text: o.text,
    }))
}
