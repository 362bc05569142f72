//! The memory plan: what a run holds at its peak, phase by phase, from the model's
//! `config.json` and the run's config alone — computed before anything is allocated, so a
//! run that cannot fit stops with the parts it needs and the settings that would shrink
//! them, not with the kernel's out-of-memory kill an hour in.
//!
//! What is counted (f32, as the trainer stores everything today):
//! - **held for the whole run**: the actor's weights and RoPE tables, its gradients, both
//!   AdamW moments in their `state_dtype` (the vision tower's too, unless frozen), and the
//!   reference policy when the KL needs one; under LoRA the pairs, and gradients and moments
//!   of the pairs only, with no reference copy (the base with the adapters off);
//! - **rollout**: the decode weights (a transposed copy of every linear layer and the LM
//!   head, f32 or bf16), the paged KV cache (f32 or bf16) when `min(rollout_batch_size · n,
//!   64)` sequences are at `max_prompt_length + max_response_length` (its pool grows by
//!   doubling), the decode arena and one prefill pass with its cache;
//! - **scoring** (old and reference log-probs) and **update**: the activation arena of a
//!   micro-batch at the longest packed length (`arena_elements`, the same sizes the model
//!   allocates: checkpointed or not, whole or chunked LM head);
//! - **checkpoint save**: the weights copied to the host, then the optimizer's moments
//!   streamed to the file one tensor at a time (on a GPU the copies are host memory: the
//!   device holds one moment tensor more).
//!
//! When only the KV pool keeps a run from fitting, [`fit`] caps it to what the rest leaves
//! (the engine then holds fewer sequences at once and preempts the others).
//!
//! The peak is the held memory plus the largest phase. It is an upper bound of the model's
//! memory — every sequence at its longest, which a random or rambling policy does reach —
//! and leaves out the program itself and the datasets. The vision tower's activations are
//! counted from the data's largest prompt in image tokens (the trainer reads the images'
//! sizes at its start; `ares-runner plan` without the data says it leaves them out).

use crate::config::{Config, MatmulPrecisionCfg, WeightDtypeCfg};
use crate::hf::config::ModelConfig;
use crate::model::{
    ActLayout, ActivationDtype, GradDtype, HeadMode, ModelSpec, StateDtype, arena_elements,
    lora_arena_elements, tensor_core_attention,
};

use crate::trainer::TrainError;

/// One part of a run's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// What it is, as the table names it.
    pub what: String,
    /// Its bytes.
    pub bytes: u64,
}

/// The parts a phase of a step adds to what the run holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Phase {
    /// `rollout`, `scoring` or `update`.
    pub name: &'static str,
    /// Its parts.
    pub parts: Vec<Part>,
}

impl Phase {
    /// The parts' sum.
    pub fn total(&self) -> u64 {
        self.parts.iter().fold(0, |a, p| a.saturating_add(p.bytes))
    }
}

/// A run's memory, held and per phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Where the model lives: `host` or `GPU`.
    pub place: &'static str,
    /// Held for the whole run.
    pub held: Vec<Part>,
    /// The phases of a step.
    pub phases: Vec<Phase>,
    /// The rollout's KV pool as planned (`None`: no rollout), which the run may cap to fit.
    pub kv: Option<KvPlan>,
}

/// The rollout's KV pool in a [`MemoryPlan`]: part `part` of the `rollout` phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPlan {
    /// Index of the KV cache's part in the rollout phase.
    pub part: usize,
    /// Bytes of one block (16 token slots, every layer, keys and values).
    pub block_bytes: u64,
    /// Blocks one sequence takes at its longest (the fewest the pool can run with).
    pub blocks_per_sequence: u64,
}

/// How a run fits the memory it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// As planned.
    Whole,
    /// With the rollout's KV pool capped at `blocks` blocks (vLLM's
    /// `gpu_memory_utilization` sizing: the pool takes what the rest leaves): about
    /// `sequences` sequences at their longest at once, the others waiting for a slot or
    /// preempted and restarted (the same tokens).
    KvCapped {
        /// Blocks the pool may hold.
        blocks: u64,
        /// Sequences at their longest that fit at once.
        sequences: u64,
    },
}

impl MemoryPlan {
    /// What is held for the whole run.
    pub fn held_total(&self) -> u64 {
        self.held.iter().fold(0, |a, p| a.saturating_add(p.bytes))
    }

    /// The largest phase.
    pub fn peak_phase(&self) -> Option<&Phase> {
        self.phases.iter().max_by_key(|p| p.total())
    }

    /// The held memory plus the largest phase.
    pub fn peak(&self) -> u64 {
        self.held_total()
            .saturating_add(self.peak_phase().map_or(0, Phase::total))
    }

    /// The plan as a table: each part, each phase's total, the peak.
    pub fn table(&self) -> String {
        let mut out = format!(
            "memory plan ({} memory; every sequence at its longest)\n",
            self.place
        );
        let row = |out: &mut String, what: &str, bytes: u64| {
            out.push_str(&format!("  {what:<58} {:>10}\n", human(bytes)));
        };
        out.push_str("held for the whole run:\n");
        for p in &self.held {
            row(&mut out, &p.what, p.bytes);
        }
        row(&mut out, "held, in all", self.held_total());
        for phase in &self.phases {
            out.push_str(&format!("{}:\n", phase.name));
            for p in &phase.parts {
                row(&mut out, &p.what, p.bytes);
            }
            row(
                &mut out,
                &format!("{} peak (held + these)", phase.name),
                self.held_total().saturating_add(phase.total()),
            );
        }
        let peak = self.peak_phase().map_or("-", |p| p.name);
        out.push_str(&format!("peak: {} (in {peak})\n", human(self.peak())));
        out
    }
}

fn human(bytes: u64) -> String {
    crate::host_memory::human_bytes(bytes)
}

/// What the plan is made from besides the run's config.
#[derive(Debug, Clone, Copy)]
pub struct PlanModel<'a> {
    /// The language model's config.
    pub text: &'a ModelConfig,
    /// The vision tower's parameters (0 for a text model).
    pub tower_params: u64,
    /// The vision tower's config (`None` for a text model): where LoRA pairs go.
    pub vision: Option<&'a crate::vision::config::VisionConfig>,
    /// The most merged image/video tokens one prompt of the data holds, which the tower's
    /// activations scale with (`None`: not known, e.g. `ares-runner plan` without the
    /// data — the tower's activations are then left out and the table says so).
    pub vision_tokens: Option<u64>,
    /// The most such tokens one prompt of the validation data holds (0: none, or no
    /// validation data): those prompts are generated from, never trained on, so they bound
    /// the rollout's tower arena only.
    pub eval_vision_tokens: u64,
    /// Whether the model is trained in host memory (else on a GPU).
    pub on_cpu: bool,
    /// Whether the KL needs a reference policy (under LoRA it is the actor with its
    /// adapters off and takes no memory, unless `worker.ref.model_path` names a model).
    pub reference: bool,
}

/// The language model's parameters as `config.json` declares them.
pub fn text_parameters(config: &ModelConfig) -> u64 {
    crate::hf::weights::expected_tensors(config)
        .iter()
        .map(|(_, shape)| shape.iter().map(|&d| d as u64).fold(1, u64::saturating_mul))
        .fold(0, u64::saturating_add)
}

/// Sequences the rollout engine decodes at once (the trainer's 64 slots).
const ROLLOUT_SLOTS: u64 = 64;
/// Token slots per KV block, and the prompt tokens a prefill pass takes at most.
const BLOCK: u64 = 16;
const PREFILL_TOKENS: u64 = 8192;

/// The plan of a run of `cfg` on `model`.
///
/// # Errors
/// A config the model code cannot build a spec from.
pub fn plan(cfg: &Config, model: PlanModel<'_>) -> Result<MemoryPlan, TrainError> {
    let spec = ModelSpec::from_config(model.text)?;
    let f32s = |n: u64| n.saturating_mul(4);
    let p = text_parameters(model.text);
    let t = model.tower_params;
    let rope = f32s((spec.max_positions as u64).saturating_mul(spec.head_dim as u64));
    // LoRA: the pairs (the language model's and the tower's) are trained, the base frozen
    let lora = super::lora_settings(cfg)?;
    let pairs = lora
        .as_ref()
        .map(|l| {
            let mut pairs = lora_tensors(&spec, l);
            if let Some(v) = model.vision {
                pairs.extend(crate::vision::lora::tower_lora_tensors(v, l));
            }
            pairs
        })
        .unwrap_or_default();
    let adapter = pairs.iter().map(|&n| n as u64).sum::<u64>();
    let frozen = cfg.worker.actor.model.freeze_vision_tower || lora.is_some();
    let trained = match lora {
        Some(_) => adapter,
        None => p + if frozen { 0 } else { t },
    };
    let (c, v, l) = (spec.hidden as u64, spec.vocab as u64, spec.layers as u64);
    let (qd, kvd, i) = (
        spec.q_dim() as u64,
        spec.kv_dim() as u64,
        spec.intermediate as u64,
    );
    let layers = l * (c * qd + 2 * c * kvd + qd * c + 3 * c * i);
    let linear = layers + c * v;
    // `trainer.weight_dtype: bf16`: the weight matrices — the decoder's linear layers, the
    // embedding and the LM head (one matrix when tied), the tower's linear layers — are
    // their bf16 copies alone
    // (`Model::set_weight_storage`), in the actor and the reference policy
    let stored_bf16 = cfg.trainer.weight_dtype == WeightDtypeCfg::Bf16;
    let tower_linear = model
        .vision
        .map_or(0, crate::vision::weights::tower_linear_parameters);
    let matrices = layers + c * v * if spec.tied_embeddings { 1 } else { 2 } + tower_linear;
    // one model's weights: f32, or the matrices in bf16
    let weights = match stored_bf16 {
        true => f32s(p + t - matrices) + 2 * matrices + rope,
        false => f32s(p + t) + rope,
    };
    let mut held = vec![Part {
        what: match stored_bf16 {
            true => "weights and RoPE tables (weight matrices bf16, the rest f32)".into(),
            false => "weights and RoPE tables (f32)".into(),
        },
        bytes: weights,
    }];
    // bf16 copies of the actor's linear weights and LM head, which a GPU's bf16 products
    // and products over bf16 activations read (`Model::set_bf16_weights`; the reference
    // policy keeps none)
    let act16 = cfg.activation_dtype() == ActivationDtype::Bf16;
    let bf16_copies =
        cfg.trainer.matmul_precision == MatmulPrecisionCfg::Bf16 && (!model.on_cpu || act16);
    if bf16_copies && !stored_bf16 {
        held.push(Part {
            what: "bf16 copies of the linear weights (bf16 products)".into(),
            bytes: linear * 2,
        });
    }
    if let Some(l) = &lora {
        held.push(Part {
            what: format!("LoRA pairs (r = {}, f32)", l.r),
            bytes: f32s(adapter),
        });
    }
    if !cfg.trainer.val_only {
        // gradients in bf16 (`trainer.grad_dtype`, `Model::grads_in`,
        // `VisionTower::zero_grads_in`): the decoder's and a trained tower's linear layers'
        // in bf16 and one layer (block) of them in f32 (the backward's scratch; AdamW reads
        // the bf16 ones as stored); the rest f32
        let bf16_grads = lora.is_none() && cfg.trainer.grad_dtype() == GradDtype::Bf16;
        let (tower_half, tower_scratch) = match (model.vision, frozen) {
            (Some(v), false) => (
                tower_linear,
                crate::vision::weights::tower_linear_block_parameters(v),
            ),
            _ => (0, 0),
        };
        held.push(match bf16_grads {
            true => Part {
                what: "gradients (linear layers' bf16, the rest f32)".into(),
                bytes: 2 * (layers + tower_half)
                    + f32s(trained - layers - tower_half + layers / l.max(1) + tower_scratch),
            },
            false => Part {
                what: "gradients (f32)".into(),
                bytes: f32s(trained),
            },
        });
        let dtype: StateDtype = cfg.worker.actor.optim.state_dtype.into();
        // per tensor, as the optimizer stores them (int8 keeps short tensors in f32); the
        // tower's slots are stacked over blocks, one tensor each, counted here as one
        let lm = match lora {
            Some(_) => pairs
                .iter()
                .map(|&n| dtype.moment_bytes(n))
                .fold(0, u64::saturating_add),
            None => crate::hf::weights::expected_tensors(model.text)
                .iter()
                .map(|(_, shape)| dtype.moment_bytes(shape.iter().product()))
                .fold(0, u64::saturating_add),
        };
        let tower = if frozen || t == 0 {
            0
        } else {
            dtype.moment_bytes(t as usize)
        };
        held.push(Part {
            what: format!("AdamW moments (2 × {dtype})"),
            bytes: lm.saturating_add(tower),
        });
    }
    // under LoRA the reference is the actor with its adapters off, unless another model
    // is named
    if model.reference && (lora.is_none() || cfg.worker.ref_.model_path.is_some()) {
        held.push(Part {
            what: match stored_bf16 {
                true => "reference policy (weight matrices bf16)".into(),
                false => "reference policy (f32)".into(),
            },
            bytes: weights,
        });
    }

    let (prompt, response) = (
        cfg.data.max_prompt_length as u64,
        cfg.data.max_response_length as u64,
    );
    let longest = prompt + response;
    // an arena's bytes; generation's keep f32 activations, training's the actor's dtype —
    // the attention block's too where its attention runs on the tensor cores (`ActLayout`)
    let precision = cfg.trainer.matmul_precision.precision();
    let lora_reads = (cfg.lora_adapts_qkv(), cfg.lora_adapts_o());
    let arena_as = |batch: u64, seq: u64, head: HeadMode, checkpointed: bool, dtype| -> u64 {
        let rows = batch.saturating_mul(seq) as usize;
        let tensor_cores = tensor_core_attention(&spec, precision, rows);
        let layout = ActLayout::of(dtype, tensor_cores, lora_reads);
        let kept = if checkpointed { l.min(1) } else { l };
        let pairs = lora
            .as_ref()
            .map_or(0, |lc| lora_arena_elements(&spec, lc, batch * seq, kept));
        arena_elements(
            &spec,
            batch as usize,
            seq as usize,
            head,
            checkpointed,
            layout,
        )
        .map_or(u64::MAX, |e| e.bytes().saturating_add(f32s(pairs)))
    };
    let arena = |batch: u64, seq: u64, head: HeadMode, checkpointed: bool| -> u64 {
        arena_as(batch, seq, head, checkpointed, ActivationDtype::F32)
    };

    // rollout: decode weights, the KV pool at its largest, the decode and prefill arenas
    let bf16 = cfg.worker.rollout.weight_dtype == crate::config::WeightDtype::Bf16;
    // on a GPU without LoRA pairs to merge: the training weights themselves in f32, their
    // bf16 copies in bf16 when the products keep them (`Backend::decodes_from_training_weights`)
    let shared = !model.on_cpu && lora.is_none() && (!bf16 || bf16_copies || stored_bf16);
    let decode = match (bf16, shared) {
        (_, true) => 0,
        (true, false) => linear * 2,
        (false, false) => f32s(linear),
    };
    let sequences = ((cfg.data.rollout_batch_size as u64) * (cfg.worker.rollout.n as u64))
        .clamp(1, ROLLOUT_SLOTS);
    let blocks = sequences * (longest + 1).div_ceil(BLOCK);
    let mut capacity = 4 * sequences;
    while capacity < blocks {
        capacity *= 2;
    }
    let kv_dtype = cfg.worker.rollout.kv_cache_dtype;
    let block_bytes = (l * 2 * kvd * BLOCK).saturating_mul(kv_dtype.bytes());
    let prompts = (cfg.data.rollout_batch_size as u64)
        .min(PREFILL_TOKENS / prompt.max(1))
        .max(1);
    let prefill = arena(
        prompts,
        prompt.max(1),
        HeadMode::Chunked {
            rows: prompts as usize,
        },
        true, // (a forward pass keeps one layer's activations)
    ) + f32s(prompts * prompt * l * 2 * kvd);
    let kv = KvPlan {
        part: 1,
        block_bytes,
        blocks_per_sequence: (longest + 1).div_ceil(BLOCK),
    };
    let rollout = Phase {
        name: "rollout",
        parts: vec![
            Part {
                what: match (bf16, shared) {
                    (true, true) => "decode weights: the bf16 copies (no copy)".into(),
                    (true, false) => "decode weights (bf16)".into(),
                    (false, true) => "decode weights: the training weights (no copy)".into(),
                    (false, false) => "decode weights (f32)".into(),
                },
                bytes: decode,
            },
            Part {
                what: format!(
                    "KV cache ({sequences} sequences × {longest} tokens, {capacity} blocks, {})",
                    match kv_dtype {
                        crate::config::KvCacheDtype::F32 => "f32",
                        crate::config::KvCacheDtype::Bf16 => "bf16",
                    }
                ),
                bytes: capacity * block_bytes,
            },
            if cfg.worker.rollout.cuda_graphs {
                // a decode arena per bucket (1, 2, 4, … rows), each kept for its graph
                let mut rows = vec![sequences];
                while let Some(&r) = rows.last().filter(|&&r| r > 1) {
                    rows.push(r.div_ceil(2).next_power_of_two().min(r - 1).max(1));
                }
                let arenas: u64 = rows
                    .iter()
                    .map(|&r| arena(r, 1, HeadMode::Full, false))
                    .sum();
                Part {
                    what: format!(
                        "decode arenas of every bucket ({} … 1 rows, kept for CUDA graphs) and a \
                         prefill of {prompts} prompts",
                        sequences
                    ),
                    bytes: arenas + prefill,
                }
            } else {
                Part {
                    what: format!(
                        "decode arena ({sequences} rows) and a prefill of {prompts} prompts"
                    ),
                    bytes: arena(sequences, 1, HeadMode::Full, false) + prefill,
                }
            },
        ],
    };

    let mut phases = vec![rollout];
    // scoring and update: an arena of a micro-batch at the longest packed length
    let micro = (cfg.worker.actor.micro_batch_size_per_device_for_update as u64).max(1);
    // the vision tower's arena: a prompt's images at the rollout (one prompt at a time, the
    // one before kept while the next is made), a micro-batch's in scoring and the update —
    // each of its sequences at the data's most image tokens (the n samples of one prompt
    // sit side by side, so a micro-batch does reach it)
    let tower = |phase: &str| -> Option<Part> {
        let v = model.vision?;
        let Some(tokens) = model.vision_tokens else {
            return Some(Part {
                what: "vision tower activations: not counted (they scale with the data's images)"
                    .into(),
                bytes: 0,
            });
        };
        let m2 = (v.spatial_merge_size * v.spatial_merge_size) as u64;
        let one = tokens.saturating_mul(m2);
        // the rollout generates from the validation prompts too (evaluation)
        let one_generated = tokens.max(model.eval_vision_tokens).saturating_mul(m2);
        // the tower's LoRA pairs, where the config puts any on it: their intermediates
        // beside the arena (every arena of such a tower holds them), its activations f32
        let tower_lora = lora
            .as_ref()
            .filter(|l| !crate::vision::lora::tower_lora_tensors(v, l).is_empty());
        // the actor's activations in bf16 where it can; the reference's scoring in f32
        let bytes = |patches: u64, keep: bool, checkpointed: bool| {
            use crate::vision::tower::{TowerActLayout, tower_act_layout, tower_arena_bytes};
            let blocks = if keep && !checkpointed { v.depth } else { 1 } as u64;
            let pairs = tower_lora.map_or(0, |l| {
                let units = patches / m2;
                let elements =
                    crate::vision::lora::tower_lora_elements(v, l, patches, units, blocks);
                elements.saturating_mul(4)
            });
            let patches = usize::try_from(patches).unwrap_or(usize::MAX);
            let layout = match phase == "scoring" && model.reference {
                true => TowerActLayout::F32,
                false => tower_act_layout(
                    v,
                    cfg.activation_dtype(),
                    (
                        cfg.trainer.weight_dtype == WeightDtypeCfg::Bf16,
                        cfg.trainer.matmul_precision == MatmulPrecisionCfg::Bf16,
                    ),
                    tower_lora.is_some(),
                    patches,
                ),
            };
            tower_arena_bytes(v, patches, keep, checkpointed, layout).saturating_add(pairs)
        };
        // the update keeps what the tower's backward reads when the tower is trained
        let keep = !cfg.worker.actor.model.freeze_vision_tower;
        let checkpointed = cfg.worker.actor.model.enable_gradient_checkpointing;
        let (what, b) = match phase {
            "rollout" => (
                "one prompt's, twice",
                2 * bytes(one_generated, false, false),
            ),
            "scoring" => ("forward only", bytes(micro * one, false, false)),
            _ if keep => (
                if checkpointed {
                    "kept for the backward, checkpointed, with its gradients' scratch"
                } else {
                    "kept for the backward, with its gradients' scratch"
                },
                bytes(micro * one, true, checkpointed).saturating_add(
                    crate::vision::tower::tower_backward_bytes(
                        v,
                        usize::try_from(micro * one).unwrap_or(usize::MAX),
                    ),
                ),
            ),
            _ => ("forward only (frozen)", bytes(micro * one, false, false)),
        };
        Some(Part {
            what: match phase == "rollout" && one_generated > one {
                true => format!(
                    "vision tower activations ({what}; {one_generated} patches a prompt of \
                     the validation data)"
                ),
                false => format!("vision tower activations ({what}; {one} patches a prompt)"),
            },
            bytes: b,
        })
    };
    phases[0].parts.extend(tower("rollout"));
    let rows = micro * longest;
    let head = HeadMode::auto(rows as usize, spec.vocab);
    let checkpointed = cfg.worker.actor.model.enable_gradient_checkpointing;
    let head_note = match head {
        HeadMode::Full => "whole logits".to_string(),
        HeadMode::Chunked { rows } => format!("LM head {rows} rows at a time"),
    };
    let step_rows = (cfg.data.rollout_batch_size as u64) * (cfg.worker.rollout.n as u64);
    for name in ["scoring", "update"] {
        // scoring runs forward only, in the checkpointed layout (`Model::activations_forward`);
        // the reference policy scores in f32 activations (it keeps no bf16 copies)
        let scoring = name == "scoring";
        let dtype = match scoring && model.reference {
            true => ActivationDtype::F32,
            false => cfg.activation_dtype(),
        };
        let one_layer = checkpointed || scoring;
        let what = format!(
            "activations of {micro} sequences × {longest} tokens ({head_note}{}{})",
            match (scoring, checkpointed) {
                (true, _) => ", forward only: one layer kept",
                (false, true) => ", checkpointed",
                (false, false) => "",
            },
            {
                let rows = micro.saturating_mul(longest) as usize;
                let tensor_cores = tensor_core_attention(&spec, precision, rows);
                match ActLayout::of(dtype, tensor_cores, lora_reads) {
                    ActLayout { mlp: false, .. } => "",
                    ActLayout { qkv: false, .. } => ", MLP in bf16",
                    ActLayout {
                        ln1: true,
                        att: true,
                        ..
                    } => ", MLP and attention in bf16",
                    _ => ", MLP and attention in bf16, LoRA's inputs f32",
                }
            }
        );
        let mut parts = vec![
            Part {
                what,
                bytes: arena_as(micro, longest, head, one_layer, dtype),
            },
            Part {
                what: "per-token log-probs and masks of the step".into(),
                bytes: f32s(step_rows * response * 6),
            },
        ];
        // a packed pass on a GPU gathers its attention into padded rows (model/unpack.rs):
        // q, k, v, out, lse and the backward's dout, dq, dk, dv, at most a padded
        // micro-batch's slots, and the two maps
        if cfg.worker.actor.padding_free && !model.on_cpu {
            let (hq, hkv, d) = (
                spec.q_heads as u64,
                spec.kv_heads as u64,
                spec.head_dim as u64,
            );
            parts.push(Part {
                what: "packed attention's padded rows".into(),
                bytes: f32s(rows * (4 * hq * d + 4 * hkv * d + hq + 1)) + 4 * 2 * rows,
            });
        }
        parts.extend(tower(name));
        phases.push(Phase { name, parts });
    }
    // a checkpoint: the weights (under LoRA the pairs) copied to the host, then the
    // moments one tensor at a time
    let largest = match lora {
        Some(_) => pairs.iter().copied().max().unwrap_or(0) as u64,
        None => c * v.max(i.max(c)),
    };
    // on a GPU the copies are host memory (each tensor downloaded as it is, a bf16 one as
    // its bits): the device holds one moment tensor more
    let (copied, copy_note) = match (lora, model.on_cpu) {
        (_, false) => (
            0,
            "one moment tensor (the weights go to the host as they are)",
        ),
        (Some(_), true) => (
            adapter,
            "LoRA pairs copied to the host (f32), one moment tensor",
        ),
        (None, true) => (p + t, "weights copied to the host (f32), one moment tensor"),
    };
    phases.push(Phase {
        name: "checkpoint save",
        parts: vec![Part {
            what: copy_note.into(),
            bytes: f32s(copied) + f32s(largest),
        }],
    });
    Ok(MemoryPlan {
        place: if model.on_cpu { "host" } else { "GPU" },
        held,
        phases,
        kv: Some(kv),
    })
}

/// Elements of each LoRA tensor of `config` on a model of `spec`: `A` `[r, in]` and `B`
/// `[out, r]` per adapted projection and layer (the optimizer's tensors).
fn lora_tensors(spec: &ModelSpec, config: &crate::hf::lora::LoraConfig) -> Vec<usize> {
    let (c, i, qd, kvd) = (spec.hidden, spec.intermediate, spec.q_dim(), spec.kv_dim());
    let shapes = [(c, qd), (c, kvd), (c, kvd), (qd, c), (c, i), (c, i), (i, c)];
    let mut out = Vec::new();
    for (name, (inp, o)) in crate::hf::lora::TARGETS.iter().zip(shapes) {
        if config.adapts_module(name) {
            for _ in 0..spec.layers {
                out.extend([config.r * inp, o * config.r]);
            }
        }
    }
    out
}

/// Whether the plan fits `available` bytes: as planned, or with the rollout's KV pool
/// capped — when the rollout is what passes `available`, everything else fits and the room
/// left holds one sequence at its longest (one block spare, for the decode buckets).
pub fn fit(plan: &MemoryPlan, available: u64) -> Option<Fit> {
    if plan.peak() <= available {
        return Some(Fit::Whole);
    }
    let kv = plan.kv?;
    let held = plan.held_total();
    let rollout = plan.phases.iter().find(|p| p.name == "rollout")?;
    let others = plan
        .phases
        .iter()
        .filter(|p| p.name != "rollout")
        .map(Phase::total)
        .max()
        .unwrap_or(0);
    let pool = rollout.parts.get(kv.part)?.bytes;
    let without_pool = held.saturating_add(rollout.total() - pool);
    if held.saturating_add(others) > available || without_pool >= available {
        return None;
    }
    let blocks = ((available - without_pool) / kv.block_bytes.max(1)).saturating_sub(1);
    (blocks >= kv.blocks_per_sequence).then_some(Fit::KvCapped {
        blocks,
        sequences: blocks / kv.blocks_per_sequence.max(1),
    })
}

/// Refuses a run whose peak passes `available` (from `source`) even with its KV pool
/// capped ([`fit`]), naming its largest parts and the settings that would shrink them.
///
/// # Errors
/// [`TrainError::Invalid`] when the plan does not fit what is available.
pub fn check(
    plan: &MemoryPlan,
    available: u64,
    source: &str,
    cfg: &Config,
) -> Result<Fit, TrainError> {
    let peak = plan.peak();
    if let Some(fit) = fit(plan, available) {
        return Ok(fit);
    }
    let phase = plan.peak_phase().map_or("-", |p| p.name);
    let mut ways = Vec::new();
    if plan.held_total() > available {
        // what the run holds throughout is too much already: only the model's size helps
    } else if phase != "rollout" {
        if cfg.worker.actor.micro_batch_size_per_device_for_update > 1 {
            ways.push("a smaller worker.actor.micro_batch_size_per_device_for_update");
        }
        if !cfg.worker.actor.model.enable_gradient_checkpointing {
            ways.push("worker.actor.model.enable_gradient_checkpointing=true");
        }
        if cfg.activation_dtype() == ActivationDtype::F32
            && cfg.trainer.matmul_precision == MatmulPrecisionCfg::Bf16
            && !cfg.lora_adapts_mlp()
        {
            ways.push("trainer.activation_dtype=bf16 (the MLP's activations in bf16)");
        }
        // a vision tower's activations scale with the images' pixels
        let tower = |p: &Phase| {
            p.parts
                .iter()
                .any(|p| p.what.starts_with("vision tower") && p.bytes > 0)
        };
        if plan.peak_phase().is_some_and(tower) {
            ways.push("smaller images (data.max_pixels)");
            if !cfg.worker.actor.model.freeze_vision_tower {
                ways.push("worker.actor.model.freeze_vision_tower=true");
            }
        }
    } else {
        // decode weights that are the training weights (no copy) shrink no further
        let decode_copy = plan
            .phases
            .iter()
            .find(|p| p.name == "rollout")
            .and_then(|p| p.parts.first())
            .is_some_and(|p| p.bytes > 0);
        if decode_copy && cfg.worker.rollout.weight_dtype != crate::config::WeightDtype::Bf16 {
            ways.push("worker.rollout.weight_dtype=bf16");
        }
        if cfg.worker.rollout.kv_cache_dtype == crate::config::KvCacheDtype::F32 {
            ways.push("worker.rollout.kv_cache_dtype=bf16");
        }
        ways.push("a smaller data.rollout_batch_size or worker.rollout.n");
    }
    if cfg.trainer.weight_dtype == WeightDtypeCfg::F32 {
        ways.push(
            "trainer.weight_dtype=bf16 with trainer.matmul_precision=bf16 (the weight \
             matrices in bf16; their gradients and the MLP's activations follow)",
        );
    }
    if plan.held.iter().any(|p| p.what == "gradients (f32)")
        && cfg.worker.actor.model.lora.rank == 0
    {
        ways.push("trainer.grad_dtype=bf16 (the linear layers' gradients in bf16)");
    }
    if cfg.worker.actor.optim.state_dtype != crate::config::StateDtype::Int8
        && plan.held.iter().any(|p| p.what.starts_with("AdamW"))
    {
        ways.push("worker.actor.optim.state_dtype=int8 (or bf16)");
    }
    if cfg.worker.actor.model.lora.rank == 0 && !cfg.trainer.val_only {
        ways.push("LoRA (worker.actor.model.lora.rank=16: the base frozen, no reference copy)");
    }
    if plan.held.iter().any(|p| p.what.starts_with("reference")) {
        ways.push(
            "no reference policy (algorithm.disable_kl, or algorithm.kl_coef 0 without a KL loss)",
        );
    }
    ways.push("shorter data.max_prompt_length / max_response_length, or a smaller model");
    Err(TrainError::Invalid(format!(
        "this run needs up to {} of {} memory at its peak (in {phase}), more than the {} \
         available ({source}); it could fit with {}. The plan (`ares-runner plan` prints \
         it):\n{}(set ARES_MEMORY_LIMIT to state the memory yourself)",
        human(peak),
        plan.place,
        human(available),
        ways.join(", or "),
        plan.table()
    )))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A two-layer Qwen2 `config.json` (hidden 64, MLP 128, 4/2 heads, vocab 100, tied).
    pub(crate) const TINY_CONFIG: &str = r#"{
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": true
    }"#;

    fn tiny() -> ModelConfig {
        ModelConfig::from_json_str(std::path::Path::new("config.json"), TINY_CONFIG).unwrap()
    }

    /// The text model `text` on the CPU, every weight 0.01.
    fn cpu_model(text: &ModelConfig) -> crate::model::Model<crate::backend::cpu::CpuBackend> {
        let map = crate::hf::weights::expected_tensors(text)
            .into_iter()
            .map(|(name, shape)| {
                let data = vec![0.01; shape.iter().product()];
                (name, crate::hf::weights::Tensor { shape, data })
            })
            .collect();
        let weights = crate::hf::weights::ModelWeights::from_map(text, map).unwrap();
        let ck = crate::hf::checkpoint::Checkpoint {
            config: text.clone(),
            generation: None,
            weights,
        };
        crate::model::Model::from_checkpoint(crate::backend::cpu::CpuBackend, &ck).unwrap()
    }

    /// The plan of `cfg` on the text model `text`.
    fn text_plan(cfg: &Config, text: &ModelConfig, on_cpu: bool, reference: bool) -> MemoryPlan {
        let model = PlanModel {
            text,
            tower_params: 0,
            vision: None,
            vision_tokens: None,
            eval_vision_tokens: 0,
            on_cpu,
            reference,
        };
        plan(cfg, model).unwrap()
    }

    /// The moments in each state dtype, by hand: bf16 half of f32; int8 two bytes an
    /// element and four a block of 2 048 each, tensors under 4 096 elements in f32.
    #[test]
    fn moments_follow_the_state_dtype() {
        let text = tiny();
        let moments = |dtype| {
            let mut cfg = Config::default();
            cfg.worker.actor.optim.state_dtype = dtype;
            let model = PlanModel {
                text: &text,
                tower_params: 0,
                vision: None,
                vision_tokens: None,
                eval_vision_tokens: 0,
                on_cpu: true,
                reference: false,
            };
            let plan = plan(&cfg, model).unwrap();
            (plan.held[2].what.clone(), plan.held[2].bytes)
        };
        use crate::config::StateDtype as D;
        let p = text_parameters(&text);
        assert_eq!(moments(D::F32), ("AdamW moments (2 × f32)".into(), 8 * p));
        assert_eq!(moments(D::Bf16).1, 4 * p);
        // embed 6400 (4 blocks); per layer q, o 4096 (2 blocks), gate/up/down 8192 (4),
        // k, v 2048 and the biases and norms in f32; the final norm in f32
        let embed = 2 * 6400 + 8 * 4;
        let layer =
            2 * (2 * 4096 + 8 * 2) + 3 * (2 * 8192 + 8 * 4) + 8 * (2 * 2048 + 64 + 64 + 128);
        let (what, bytes) = moments(D::Int8);
        assert_eq!(bytes, embed + 2 * layer + 8 * 64, "{what}");
        assert!(what.contains("int8"));
    }

    /// bf16 products on a GPU hold bf16 copies of the actor's linear weights and LM head (2
    /// bytes each, by hand), not the reference policy's; none on the CPU, none in f32.
    #[test]
    fn bf16_products_on_a_gpu_hold_bf16_weight_copies() {
        let text = tiny();
        let held = |precision, on_cpu| {
            let mut cfg = Config::default();
            cfg.trainer.matmul_precision = precision;
            let model = PlanModel {
                text: &text,
                tower_params: 0,
                vision: None,
                vision_tokens: None,
                eval_vision_tokens: 0,
                on_cpu,
                reference: true,
            };
            plan(&cfg, model).unwrap().held
        };
        // per layer q, o 64·64, k, v 64·32, gate, up, down 64·128; the tied head 100·64
        let linear = 2 * (2 * 4096 + 2 * 2048 + 3 * 8192) + 6400;
        let gpu = held(MatmulPrecisionCfg::Bf16, false);
        let copies: Vec<u64> = gpu
            .iter()
            .filter(|p| p.what.contains("bf16 copies"))
            .map(|p| p.bytes)
            .collect();
        assert_eq!(copies, vec![2 * linear], "{gpu:?}");
        for (precision, on_cpu) in [
            (MatmulPrecisionCfg::Bf16, true),
            (MatmulPrecisionCfg::F32, false),
            (MatmulPrecisionCfg::Tf32, false),
        ] {
            let parts = held(precision, on_cpu);
            assert!(
                !parts.iter().any(|p| p.what.contains("bf16 copies")),
                "{parts:?}"
            );
        }
        // bf16 decode weights on a GPU are those copies; without them a copy of their own
        let decode = |precision| {
            let mut cfg = Config::default();
            cfg.trainer.matmul_precision = precision;
            cfg.worker.rollout.weight_dtype = crate::config::WeightDtype::Bf16;
            let plan = text_plan(&cfg, &text, false, false);
            let rollout = plan.phases.iter().find(|p| p.name == "rollout").unwrap();
            rollout.parts[0].clone()
        };
        let shared = decode(MatmulPrecisionCfg::Bf16);
        assert_eq!(shared.bytes, 0, "{}", shared.what);
        assert!(shared.what.contains("no copy"), "{}", shared.what);
        assert_eq!(decode(MatmulPrecisionCfg::F32).bytes, 2 * linear);
    }

    /// `trainer.weight_dtype: bf16` holds the weight matrices (the decoder's linear layers,
    /// the tied embedding and LM head) in 2 bytes each (no f32 master, no separate copies),
    /// in the actor and the reference policy alike — what the model allocates
    /// (`Model::weight_bytes`) — and decodes from them on a GPU without a copy.
    #[test]
    fn bf16_weights_halve_the_weight_matrices() {
        let text = tiny();
        let plan_of = |weight_dtype, on_cpu| {
            let mut cfg = Config::default();
            cfg.trainer.matmul_precision = MatmulPrecisionCfg::Bf16;
            cfg.trainer.weight_dtype = weight_dtype;
            cfg.worker.rollout.weight_dtype = crate::config::WeightDtype::Bf16;
            text_plan(&cfg, &text, on_cpu, true)
        };
        let part = |plan: &MemoryPlan, what: &str| -> u64 {
            plan.held
                .iter()
                .filter(|p| p.what.starts_with(what))
                .map(|p| p.bytes)
                .sum()
        };
        // per layer q, o 64·64, k, v 64·32, gate, up, down 64·128 (two layers)
        let layers = 2 * (2 * 4096 + 2 * 2048 + 3 * 8192);
        let (f32s, bf16) = (
            plan_of(WeightDtypeCfg::F32, false),
            plan_of(WeightDtypeCfg::Bf16, false),
        );
        let w32 = part(&f32s, "weights") + part(&f32s, "bf16 copies");
        let w16 = part(&bf16, "weights") + part(&bf16, "bf16 copies");
        // the 100·64 tied embedding and head: 4 + 2 bytes (f32, a copy) down to 2
        let head = 6400;
        assert_eq!(w32 - w16, 4 * (layers + head), "{:?}", bf16.held);
        assert_eq!(part(&bf16, "reference"), part(&bf16, "weights"));
        assert_eq!(
            part(&f32s, "reference") - part(&bf16, "reference"),
            2 * (layers + head)
        );
        let rollout = bf16.phases.iter().find(|p| p.name == "rollout").unwrap();
        assert_eq!(rollout.parts[0].bytes, 0, "{}", rollout.parts[0].what);
        // the model's own count, on the CPU (RoPE tables apart)
        let spec = ModelSpec::from_config(&text).unwrap();
        let rope = 4 * (spec.max_positions * spec.head_dim) as u64;
        let mut m = cpu_model(&text);
        m.set_weight_storage(crate::model::WeightStorage::Bf16)
            .unwrap();
        let cpu = plan_of(WeightDtypeCfg::Bf16, true);
        assert_eq!(part(&cpu, "weights") - rope, m.weight_bytes());
    }

    /// Gradients stored in bf16 (`trainer.grad_dtype`, bf16 by default with bf16 weights)
    /// are planned as the model allocates them (`Grads::bytes`), nothing more (AdamW reads
    /// them as stored); an explicit `f32` keeps f32.
    #[test]
    fn bf16_grads_are_planned_as_allocated() {
        use crate::config::StorageDtypeCfg;
        let text = tiny();
        let grads_of = |grad_dtype: Option<StorageDtypeCfg>| -> u64 {
            let mut cfg = Config::default();
            cfg.trainer.matmul_precision = MatmulPrecisionCfg::Bf16;
            cfg.trainer.weight_dtype = WeightDtypeCfg::Bf16;
            cfg.trainer.grad_dtype = grad_dtype;
            let plan = text_plan(&cfg, &text, true, true);
            let grads = plan.held.iter().find(|p| p.what.starts_with("gradients"));
            grads.unwrap().bytes
        };
        let m = cpu_model(&text);
        let g16 = m.grads_in(GradDtype::Bf16).unwrap().bytes();
        let g32 = m.grads_in(GradDtype::F32).unwrap().bytes();
        assert_eq!(grads_of(None), g16);
        assert_eq!(grads_of(Some(StorageDtypeCfg::Bf16)), g16);
        assert_eq!(grads_of(Some(StorageDtypeCfg::F32)), g32);
        // two layers: the bf16 stacks save 2 bytes × 2 layers of linear weights, what the
        // one-layer f32 scratch takes (4 bytes × 1 layer) — bf16 saves from 3 layers on
        assert_eq!(g16, g32);
    }

    /// The MLP's activations stored in bf16 (`trainer.activation_dtype`, bf16 by default
    /// with bf16 weights) are planned as the arena allocates them: the update's arena
    /// shrinks by 2 bytes × L·N·(C + 3I), and the reference policy's scoring stays f32.
    #[test]
    fn bf16_activations_are_planned_as_allocated() {
        use crate::config::StorageDtypeCfg;
        let text = tiny();
        let arena_of = |act: Option<StorageDtypeCfg>, phase: &str, reference: bool| -> u64 {
            let mut cfg = Config::default();
            cfg.trainer.matmul_precision = MatmulPrecisionCfg::Bf16;
            cfg.trainer.weight_dtype = WeightDtypeCfg::Bf16;
            cfg.trainer.activation_dtype = act;
            let plan = text_plan(&cfg, &text, true, reference);
            let phase = plan.phases.iter().find(|p| p.name == phase).unwrap();
            let part = phase
                .parts
                .iter()
                .find(|p| p.what.starts_with("activations"));
            part.unwrap().bytes
        };
        let spec = ModelSpec::from_config(&text).unwrap();
        let cfg = Config::default();
        let micro = cfg.worker.actor.micro_batch_size_per_device_for_update as u64;
        let n = micro * (cfg.data.max_prompt_length + cfg.data.max_response_length) as u64;
        // gate, up of every layer, act and ln2 of one (the backward recomputes them), less
        // the f32 staging buffer ln2 is made in again
        let mlp = n
            * (spec.layers as u64 * 2 * spec.intermediate as u64
                + (spec.intermediate + spec.hidden) as u64);
        let stage = n * spec.hidden.max(spec.q_dim()) as u64;
        let (f32_update, bf16_update) = (
            arena_of(Some(StorageDtypeCfg::F32), "update", true),
            arena_of(None, "update", true),
        );
        assert_eq!(f32_update - bf16_update, 2 * mlp - 4 * stage);
        assert_eq!(
            arena_of(Some(StorageDtypeCfg::Bf16), "update", true),
            bf16_update
        );
        // scoring: forward only, one layer kept (f32 with a reference policy)
        let one_layer = |dtype| {
            let n = n as usize;
            let head = HeadMode::auto(n, spec.vocab);
            let e = arena_elements(&spec, micro as usize, n / micro as usize, head, true, dtype);
            e.unwrap().bytes()
        };
        let (f32s, mlp16) = (
            ActLayout::F32,
            ActLayout::of(ActivationDtype::Bf16, false, (false, false)),
        );
        assert_eq!(arena_of(None, "scoring", true), one_layer(f32s));
        assert_eq!(arena_of(None, "scoring", false), one_layer(mlp16));
        assert!(one_layer(f32s) < bf16_update);
    }

    /// At a head size of the tensor-core kernels the attention block's activations follow
    /// (ln1, q, k, v in bf16, `ActLayout`): the update's arena is the allocation's, smaller
    /// than the MLP-only layout's, and named so; a LoRA pair on q keeps ln1 in f32.
    #[test]
    fn bf16_attention_activations_are_planned_as_allocated() {
        let mut text = tiny();
        text.head_dim = 64;
        let spec = ModelSpec::from_config(&text).unwrap();
        let update = |lora: bool| {
            let mut cfg = Config::default();
            cfg.trainer.matmul_precision = MatmulPrecisionCfg::Bf16;
            cfg.trainer.weight_dtype = WeightDtypeCfg::Bf16;
            if lora {
                cfg.worker.actor.model.lora.rank = 4;
                cfg.worker.actor.model.lora.target_modules =
                    crate::config::LoraTargets::One("q_proj".into());
            }
            let plan = text_plan(&cfg, &text, true, true);
            let phase = plan.phases.iter().find(|p| p.name == "update").unwrap();
            let part = phase
                .parts
                .iter()
                .find(|p| p.what.starts_with("activations"));
            let part = part.unwrap();
            (part.what.clone(), part.bytes)
        };
        let cfg = Config::default();
        let micro = cfg.worker.actor.micro_batch_size_per_device_for_update;
        let seq = cfg.data.max_prompt_length + cfg.data.max_response_length;
        let head = HeadMode::auto(micro * seq, spec.vocab);
        let bytes = |layout| {
            arena_elements(&spec, micro, seq, head, false, layout)
                .unwrap()
                .bytes()
        };
        let bf16 = ActivationDtype::Bf16;
        let (what, got) = update(false);
        assert_eq!(
            got,
            bytes(ActLayout::of(bf16, true, (false, false))),
            "{what}"
        );
        assert!(
            got < bytes(ActLayout::of(bf16, false, (false, false))),
            "{what}"
        );
        assert!(what.contains("MLP and attention in bf16"), "{what}");
        let (what, got) = update(true);
        assert!(what.contains("LoRA's inputs f32"), "{what}");
        assert!(
            got > bytes(ActLayout::of(bf16, true, (false, false))),
            "{what}"
        );
    }

    /// A run whose update does not fit is told of bf16 activations when its products are
    /// bf16 and its activations f32, and not once they are bf16.
    #[test]
    fn a_refused_update_suggests_bf16_activations() {
        use crate::config::StorageDtypeCfg;
        let text = tiny();
        let refusal = |act: StorageDtypeCfg, weights: WeightDtypeCfg| {
            let mut cfg = Config::default();
            cfg.trainer.matmul_precision = MatmulPrecisionCfg::Bf16;
            cfg.trainer.weight_dtype = weights;
            cfg.trainer.activation_dtype = Some(act);
            cfg.data.max_response_length = 4096;
            let plan = text_plan(&cfg, &text, false, true);
            assert_eq!(plan.peak_phase().unwrap().name, "update");
            let available = plan.held_total() + 1;
            check(&plan, available, "test", &cfg)
                .unwrap_err()
                .to_string()
        };
        let msg = refusal(StorageDtypeCfg::F32, WeightDtypeCfg::F32);
        assert!(msg.contains("trainer.activation_dtype=bf16"), "{msg}");
        // f32 weights: their bf16 storage is named too, and not once they are bf16
        assert!(msg.contains("trainer.weight_dtype=bf16"), "{msg}");
        let msg = refusal(StorageDtypeCfg::Bf16, WeightDtypeCfg::Bf16);
        assert!(!msg.contains("trainer.activation_dtype"), "{msg}");
        assert!(!msg.contains("trainer.weight_dtype"), "{msg}");
    }

    /// A bf16 KV cache is planned at half the f32 one's bytes, named as such; the other
    /// rollout parts do not change.
    #[test]
    fn a_bf16_kv_cache_is_half_the_f32_one() {
        let text = tiny();
        let rollout = |dtype: crate::config::KvCacheDtype| {
            let mut cfg = Config::default();
            cfg.worker.rollout.kv_cache_dtype = dtype;
            let model = PlanModel {
                text: &text,
                tower_params: 0,
                vision: None,
                vision_tokens: None,
                eval_vision_tokens: 0,
                on_cpu: true,
                reference: false,
            };
            let plan = plan(&cfg, model).unwrap();
            let phase = plan.phases.iter().find(|p| p.name == "rollout").unwrap();
            phase.parts.clone()
        };
        let (f32_parts, bf16_parts) = (
            rollout(crate::config::KvCacheDtype::F32),
            rollout(crate::config::KvCacheDtype::Bf16),
        );
        let kv = |parts: &[Part]| {
            parts
                .iter()
                .find(|p| p.what.starts_with("KV cache"))
                .cloned()
        };
        let (a, b) = (kv(&f32_parts).unwrap(), kv(&bf16_parts).unwrap());
        assert!(
            a.bytes > 0 && b.bytes * 2 == a.bytes,
            "{} vs {}",
            a.bytes,
            b.bytes
        );
        assert!(
            a.what.ends_with("f32)") && b.what.ends_with("bf16)"),
            "{}",
            b.what
        );
        let others = |parts: &[Part]| -> Vec<u64> {
            parts
                .iter()
                .filter(|p| !p.what.starts_with("KV cache"))
                .map(|p| p.bytes)
                .collect()
        };
        assert_eq!(others(&f32_parts), others(&bf16_parts));
    }

    /// With CUDA graphs the rollout keeps a decode arena per bucket (64, 32, …, 1 rows): the
    /// plan counts them all; the decode copy of the weights is gone on a GPU without LoRA.
    #[test]
    fn cuda_graphs_keep_an_arena_per_bucket() {
        let text = tiny();
        let rollout = |graphs: bool, on_cpu: bool| {
            let mut cfg = Config::default();
            cfg.worker.rollout.cuda_graphs = graphs;
            let model = PlanModel {
                text: &text,
                tower_params: 0,
                vision: None,
                vision_tokens: None,
                eval_vision_tokens: 0,
                on_cpu,
                reference: false,
            };
            let plan = plan(&cfg, model).unwrap();
            let phase = plan
                .phases
                .iter()
                .find(|p| p.name == "rollout")
                .unwrap()
                .clone();
            phase.parts
        };
        let (plain, graphs) = (rollout(false, false), rollout(true, false));
        assert_eq!(plain[0].bytes, 0, "{}", plain[0].what); // the training weights, no copy
        assert!(rollout(false, true)[0].bytes > 0); // the CPU's tile copy
        assert!(
            graphs[2].what.contains("every bucket"),
            "{}",
            graphs[2].what
        );
        // 64 + 32 + … + 1 = 127 rows of arena against 64 (the prefill is the same)
        let extra = graphs[2].bytes - plain[2].bytes;
        assert!(
            extra > 0 && extra < plain[2].bytes,
            "{extra} vs {}",
            plain[2].bytes
        );
    }

    /// `trainer.weight_dtype: bf16` on a vision-language model stores the tower's linear
    /// layers in bf16 too: what the model allocates (`Model::weight_bytes` and
    /// `VisionTower::weight_bytes`, the tiny Qwen2.5-VL fixture).
    #[test]
    fn bf16_weights_count_the_towers_linear_layers() {
        use crate::backend::cpu::CpuBackend;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ares-model/tests/fixtures/vl/qwen2_5_vl_tiny");
        let vl = crate::vision::config::VlConfig::from_dir(&dir).unwrap();
        let weights = |dtype| {
            let mut cfg = Config::default();
            cfg.trainer.matmul_precision = MatmulPrecisionCfg::Bf16;
            cfg.trainer.weight_dtype = dtype;
            let model = PlanModel {
                text: &vl.text,
                tower_params: crate::vision::weights::tower_parameters(&vl.vision),
                vision: Some(&vl.vision),
                vision_tokens: None,
                eval_vision_tokens: 0,
                on_cpu: true,
                reference: false,
            };
            let plan = plan(&cfg, model).unwrap();
            plan.held[0].bytes
        };
        let ck = crate::vision::checkpoint::VlCheckpoint::load(&dir).unwrap();
        let mut m = crate::vision::model::VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        let f32s = m.lm().weight_bytes() + m.tower().weight_bytes();
        m.set_weight_storage(crate::model::WeightStorage::Bf16)
            .unwrap();
        let bf16 = m.lm().weight_bytes() + m.tower().weight_bytes();
        assert!(bf16 < f32s);
        assert_eq!(
            weights(WeightDtypeCfg::F32) - weights(WeightDtypeCfg::Bf16),
            f32s - bf16
        );
    }

    /// Gradients in bf16 on a vision-language model keep the trained tower's linear layers'
    /// in bf16 too: planned as the language model and the tower allocate them (`Grads::bytes`,
    /// `VisionGrads::bytes`), f32 ones as before; a frozen tower's count nothing.
    #[test]
    fn bf16_grads_count_the_towers_linear_layers() {
        use crate::backend::cpu::CpuBackend;
        use crate::config::StorageDtypeCfg;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ares-model/tests/fixtures/vl/qwen2_5_vl_tiny");
        let vl = crate::vision::config::VlConfig::from_dir(&dir).unwrap();
        let grads = |dtype, frozen| {
            let mut cfg = Config::default();
            cfg.trainer.grad_dtype = Some(dtype);
            cfg.worker.actor.model.freeze_vision_tower = frozen;
            let model = PlanModel {
                text: &vl.text,
                tower_params: crate::vision::weights::tower_parameters(&vl.vision),
                vision: Some(&vl.vision),
                vision_tokens: None,
                eval_vision_tokens: 0,
                on_cpu: true,
                reference: false,
            };
            let plan = plan(&cfg, model).unwrap();
            let g = plan.held.iter().find(|p| p.what.starts_with("gradients"));
            g.unwrap().bytes
        };
        let ck = crate::vision::checkpoint::VlCheckpoint::load(&dir).unwrap();
        let m = crate::vision::model::VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        let be = m.backend();
        for dtype in [GradDtype::F32, GradDtype::Bf16] {
            let lm = m.lm().grads_in(dtype).unwrap().bytes();
            let tower = m.tower().zero_grads_in(be, dtype).unwrap().bytes();
            let cfg_dtype = match dtype {
                GradDtype::F32 => StorageDtypeCfg::F32,
                GradDtype::Bf16 => StorageDtypeCfg::Bf16,
            };
            assert_eq!(grads(cfg_dtype, false), lm + tower, "{dtype:?}");
            assert_eq!(grads(cfg_dtype, true), lm, "{dtype:?}, frozen tower");
        }
    }

    /// The vision tower's activations: an arena of the data's largest prompt in image
    /// tokens at the rollout (twice), of a micro-batch of them in scoring and the update —
    /// what `VisionTower::activations` allocates (the tiny Qwen2.5-VL fixture), kept for
    /// the backward unless the tower is frozen, checkpointed with the decoder; unknown
    /// tokens leave them out, saying so.
    #[test]
    fn the_towers_activations_are_arenas_of_the_datas_largest_prompt() {
        use crate::backend::cpu::CpuBackend;
        use crate::vision::tower::{VisionPlan, tower_backward_bytes};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ares-model/tests/fixtures/vl/qwen2_5_vl_tiny");
        let vl = crate::vision::config::VlConfig::from_dir(&dir).unwrap();
        let ck = crate::vision::checkpoint::VlCheckpoint::load(&dir).unwrap();
        let mut m = crate::vision::model::VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        assert_eq!(vl.vision.spatial_merge_size, 2);
        // 16 merged tokens a prompt: one 8 × 8 grid of patches
        let tower_part = |tokens, frozen, checkpointed, phase: &str, bf16: bool| {
            let mut cfg = Config::default();
            if bf16 {
                // bf16 weights and products: the MLP block's activations in bf16
                cfg.trainer.weight_dtype = WeightDtypeCfg::Bf16;
                cfg.trainer.matmul_precision = MatmulPrecisionCfg::Bf16;
            }
            cfg.worker.actor.model.freeze_vision_tower = frozen;
            cfg.worker.actor.model.enable_gradient_checkpointing = checkpointed;
            let model = PlanModel {
                text: &vl.text,
                tower_params: crate::vision::weights::tower_parameters(&vl.vision),
                vision: Some(&vl.vision),
                vision_tokens: tokens,
                eval_vision_tokens: 0,
                on_cpu: true,
                reference: false,
            };
            let plan = plan(&cfg, model).unwrap();
            let phase = plan.phases.iter().find(|p| p.name == phase).unwrap();
            let part = phase
                .parts
                .iter()
                .find(|p| p.what.starts_with("vision tower"));
            part.unwrap().clone()
        };
        let micro = Config::default()
            .worker
            .actor
            .micro_batch_size_per_device_for_update;
        let mut arena = |prompts: usize, keep: bool, checkpointed: bool, bf16: bool| {
            use crate::backend::MatmulPrecision;
            use crate::model::{ActivationDtype, WeightStorage};
            let t = m.tower_mut();
            t.set_gradient_checkpointing(checkpointed);
            let (precision, storage, dtype) = match bf16 {
                true => (
                    MatmulPrecision::Bf16,
                    WeightStorage::Bf16,
                    ActivationDtype::Bf16,
                ),
                false => (
                    MatmulPrecision::F32,
                    WeightStorage::F32,
                    ActivationDtype::F32,
                ),
            };
            t.set_matmul_precision(precision);
            t.set_weight_storage(&CpuBackend, storage).unwrap();
            t.set_activation_dtype(dtype);
            assert_eq!(t.act_layout(64).mlp, bf16);
            let plan = VisionPlan::new(&vl.vision, &vec![[1, 8, 8]; prompts]).unwrap();
            let acts = m.tower().activations(&CpuBackend, plan, keep).unwrap();
            acts.bytes() as u64
        };
        for bf16 in [false, true] {
            let rollout = tower_part(Some(16), false, false, "rollout", bf16);
            assert_eq!(
                rollout.bytes,
                2 * arena(1, false, false, bf16),
                "{}",
                rollout.what
            );
            assert!(
                rollout.what.contains("64 patches a prompt"),
                "{}",
                rollout.what
            );
            for frozen in [false, true] {
                let scoring = tower_part(Some(16), frozen, false, "scoring", bf16);
                assert_eq!(
                    scoring.bytes,
                    arena(micro, false, false, bf16),
                    "{}",
                    scoring.what
                );
                for checkpointed in [false, true] {
                    let update = tower_part(Some(16), frozen, checkpointed, "update", bf16);
                    let want = match frozen {
                        true => arena(micro, false, false, bf16),
                        false => {
                            arena(micro, true, checkpointed, bf16)
                                + tower_backward_bytes(&vl.vision, micro * 64)
                        }
                    };
                    assert_eq!(update.bytes, want, "{}", update.what);
                }
            }
        }
        let unknown = tower_part(None, false, false, "update", false);
        assert_eq!(unknown.bytes, 0);
        assert!(unknown.what.contains("not counted"), "{}", unknown.what);
        // an update too large for its images says so among the ways to shrink it
        let cfg = Config::default();
        let model = PlanModel {
            text: &vl.text,
            tower_params: crate::vision::weights::tower_parameters(&vl.vision),
            vision: Some(&vl.vision),
            vision_tokens: Some(1 << 16),
            eval_vision_tokens: 0,
            on_cpu: true,
            reference: false,
        };
        let big = plan(&cfg, model).unwrap();
        assert_eq!(big.peak_phase().unwrap().name, "update");
        let refused = check(&big, big.held_total() + 1, "a test", &cfg).unwrap_err();
        let refused = refused.to_string();
        assert!(
            refused.contains("smaller images (data.max_pixels)"),
            "{refused}"
        );
        assert!(refused.contains("freeze_vision_tower=true"), "{refused}");
    }

    /// At a head size of the tensor-core attention (64) the plan counts the tower's
    /// attention block in bf16 too, as the tower allocates it: the update's arena is the
    /// trained tower's (bf16 weights, products and activations) at a micro-batch of 64-patch
    /// prompts, and smaller than with f32 activations by the ten `[N, C]` bf16 halves.
    #[test]
    fn the_plan_counts_the_towers_attention_block_in_bf16() {
        use crate::backend::MatmulPrecision;
        use crate::backend::cpu::CpuBackend;
        use crate::model::{ActivationDtype, WeightStorage};
        use crate::vision::tower::{VisionPlan, VisionTower, tower_backward_bytes};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ares-model/tests/fixtures/vl/qwen2_5_vl_tiny");
        let vl = crate::vision::config::VlConfig::from_dir(&dir).unwrap();
        let mut v = vl.vision.clone();
        (v.hidden, v.heads, v.head_dim) = (128, 2, 64);
        let update = |bf16: bool| {
            let mut cfg = Config::default();
            cfg.trainer.weight_dtype = WeightDtypeCfg::Bf16;
            cfg.trainer.matmul_precision = MatmulPrecisionCfg::Bf16;
            if !bf16 {
                cfg.trainer.activation_dtype = Some(crate::config::StorageDtypeCfg::F32);
            }
            let model = PlanModel {
                text: &vl.text,
                tower_params: crate::vision::weights::tower_parameters(&v),
                vision: Some(&v),
                vision_tokens: Some(16),
                eval_vision_tokens: 0,
                on_cpu: true,
                reference: false,
            };
            let plan = plan(&cfg, model).unwrap();
            let phase = plan.phases.iter().find(|p| p.name == "update").unwrap();
            let part = phase
                .parts
                .iter()
                .find(|p| p.what.starts_with("vision tower"));
            part.unwrap().bytes
        };
        let micro = Config::default()
            .worker
            .actor
            .micro_batch_size_per_device_for_update;
        let weights = crate::vision::weights::VisionWeights::random(&v, 0.1, 3);
        let mut tower = VisionTower::new(&CpuBackend, &v, &weights).unwrap();
        tower.set_matmul_precision(MatmulPrecision::Bf16);
        tower
            .set_weight_storage(&CpuBackend, WeightStorage::Bf16)
            .unwrap();
        tower.set_activation_dtype(ActivationDtype::Bf16);
        let plan = VisionPlan::new(&v, &vec![[1, 8, 8]; micro]).unwrap();
        let layout = tower.act_layout(plan.patches);
        assert!(layout.mlp && layout.attention, "{layout:?}");
        let arena = tower.activations(&CpuBackend, plan, true).unwrap().bytes() as u64;
        let scratch = tower_backward_bytes(&v, micro * 64);
        assert_eq!(update(true), arena + scratch);
        // n1, q, k, v, att of every block at 2 bytes instead of 4
        let halves = 5 * 2 * (micro * 64 * v.hidden * v.depth) as u64;
        let mlp = 2 * (micro * 64 * (v.hidden + 3 * v.intermediate) * v.depth) as u64;
        assert_eq!(update(false) - update(true), halves + mlp);
    }

    /// With LoRA pairs on the tower each of its arenas holds their intermediates, and its
    /// activations stay f32: every phase's tower part is the arena the tower allocates
    /// (with the backward's scratch in the update), checkpointed or not; a config that
    /// leaves the tower out counts none.
    #[test]
    fn the_towers_lora_intermediates_are_in_its_arenas() {
        use crate::backend::cpu::CpuBackend;
        use crate::vision::tower::{VisionPlan, tower_backward_bytes};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ares-model/tests/fixtures/vl/qwen2_5_vl_tiny");
        let vl = crate::vision::config::VlConfig::from_dir(&dir).unwrap();
        let ck = crate::vision::checkpoint::VlCheckpoint::load(&dir).unwrap();
        let micro = Config::default()
            .worker
            .actor
            .micro_batch_size_per_device_for_update;
        for exclude in [false, true] {
            let mut cfg = Config::default();
            cfg.worker.actor.model.lora.rank = 4;
            if exclude {
                cfg.worker.actor.model.lora.exclude_modules = Some(".*visual.*".into());
            }
            let lc = super::super::lora_settings(&cfg).unwrap().unwrap();
            let mut m = crate::vision::model::VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
            m.add_lora(&lc, 1).unwrap();
            assert_eq!(m.tower().has_lora(), !exclude);
            for checkpointed in [false, true] {
                cfg.worker.actor.model.enable_gradient_checkpointing = checkpointed;
                let model = PlanModel {
                    text: &vl.text,
                    tower_params: crate::vision::weights::tower_parameters(&vl.vision),
                    vision: Some(&vl.vision),
                    vision_tokens: Some(16),
                    eval_vision_tokens: 0,
                    on_cpu: true,
                    reference: false,
                };
                let plan = plan(&cfg, model).unwrap();
                let part = |phase: &str| {
                    let phase = plan.phases.iter().find(|p| p.name == phase).unwrap();
                    let part = phase
                        .parts
                        .iter()
                        .find(|p| p.what.starts_with("vision tower"));
                    part.unwrap().bytes
                };
                m.tower_mut().set_gradient_checkpointing(checkpointed);
                let arena = |prompts: usize, keep: bool| {
                    let plan = VisionPlan::new(&vl.vision, &vec![[1, 8, 8]; prompts]).unwrap();
                    let acts = m.tower().activations(&CpuBackend, plan, keep).unwrap();
                    acts.bytes() as u64
                };
                let what = format!("exclude {exclude}, checkpointed {checkpointed}");
                assert_eq!(part("rollout"), 2 * arena(1, false), "{what}");
                assert_eq!(part("scoring"), arena(micro, false), "{what}");
                let scratch = tower_backward_bytes(&vl.vision, micro * 64);
                assert_eq!(part("update"), arena(micro, true) + scratch, "{what}");
            }
        }
    }

    /// LoRA on a vision-language model: the tower's pairs are held, trained and counted
    /// beside the language model's unless the tower is excluded or frozen (the tiny
    /// Qwen2.5-VL fixture by hand: hidden 32, MLP 48, 4 blocks, merger 128 → 48, r = 4).
    #[test]
    fn lora_pairs_on_the_tower_are_counted() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ares-model/tests/fixtures/vl/qwen2_5_vl_tiny");
        let vl = crate::vision::config::VlConfig::from_dir(&dir).unwrap();
        let pairs = |overrides: &[&str]| {
            let mut cfg = Config::default();
            cfg.worker.actor.model.lora.rank = 4;
            for o in overrides {
                match *o {
                    "exclude" => {
                        cfg.worker.actor.model.lora.exclude_modules = Some(".*visual.*".into())
                    }
                    "freeze" => cfg.worker.actor.model.freeze_vision_tower = true,
                    _ => unreachable!(),
                }
            }
            let model = PlanModel {
                text: &vl.text,
                tower_params: crate::vision::weights::tower_parameters(&vl.vision),
                vision: Some(&vl.vision),
                vision_tokens: None,
                eval_vision_tokens: 0,
                on_cpu: true,
                reference: true,
            };
            let plan = plan(&cfg, model).unwrap();
            let part = plan.held.iter().find(|p| p.what.starts_with("LoRA pairs"));
            part.unwrap().bytes / 4
        };
        // per block r·(in + out): qkv 32 → 96, proj 32 → 32, gate and up 32 → 48, down 48 → 32
        let block = 4 * (128 + 64 + 80 + 80 + 80);
        let tower = 4 * block + 4 * (128 + 128) + 4 * (128 + 48);
        let lm = pairs(&["exclude"]);
        assert_eq!(pairs(&[]), lm + tower as u64);
        assert_eq!(pairs(&["freeze"]), lm);
    }

    /// Hand-checked parts for a 2-layer model: weights, moments, decode copy, KV pool.
    #[test]
    fn parts_are_what_the_model_allocates() {
        let text = tiny();
        let mut cfg = Config::default();
        cfg.data.rollout_batch_size = 4;
        cfg.worker.rollout.n = 2;
        cfg.data.max_prompt_length = 20;
        cfg.data.max_response_length = 11;
        let plan = plan(
            &cfg,
            PlanModel {
                text: &text,
                tower_params: 0,
                vision: None,
                vision_tokens: None,
                eval_vision_tokens: 0,
                on_cpu: true,
                reference: true,
            },
        )
        .unwrap();
        // 100·64 embed + 2·(q 64·64+64, k,v 64·32+32 each, o 64·64, mlp 3·64·128, norms
        // 2·64) + 64 final norm
        let p = 6400 + 2 * (4160 + 2 * 2080 + 4096 + 24_576 + 128) + 64;
        assert_eq!(text_parameters(&text), p);
        let rope = 4 * 256 * 16;
        assert_eq!(plan.held[0].bytes, 4 * p + rope);
        assert_eq!(plan.held[2].bytes, 8 * p);
        assert_eq!(plan.held[3].bytes, 4 * p + rope);
        let rollout = &plan.phases[0];
        // linear weights (no biases, norms or embedding) and the head
        let linear = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 64 * 100;
        assert_eq!(rollout.parts[0].bytes, 4 * linear);
        // 8 sequences × ⌈32 / 16⌉ = 16 blocks ≤ the first 32; 2 layers × k,v × 32 × 16 slots
        assert_eq!(rollout.parts[1].bytes, 32 * 4 * 2 * 2 * 32 * 16);
        assert!(plan.peak() > plan.held_total());
        let table = plan.table();
        assert!(
            table.contains("KV cache (8 sequences × 31 tokens, 32 blocks, f32)"),
            "{table}"
        );
        assert!(table.contains("peak:"), "{table}");
        // too little memory: refused with the plan and the ways to fit
        let e = check(&plan, 1 << 20, "test", &cfg).unwrap_err().to_string();
        assert!(
            e.contains("more than the 1.0 MiB available (test)") && e.contains("memory plan"),
            "{e}"
        );
        assert!(e.contains("no reference policy"), "{e}");
        assert!(check(&plan, plan.peak(), "test", &cfg).is_ok());
        // checkpointing shrinks the update's arena
        cfg.worker.actor.model.enable_gradient_checkpointing = true;
        let small = crate::trainer::setup::memory::plan(
            &cfg,
            PlanModel {
                text: &text,
                tower_params: 0,
                vision: None,
                vision_tokens: None,
                eval_vision_tokens: 0,
                on_cpu: true,
                reference: true,
            },
        )
        .unwrap();
        assert!(small.phases[2].total() < plan.phases[2].total());
    }
}
