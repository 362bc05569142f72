//! The decoder backward pass on the CPU backend against transformers' gradients for the
//! tiny fixtures (`tests/fixtures/models`, see its README): for both input sets, the loss
//! `L = Σ_{valid b,t} Σ_v logits·W`, so `∂L/∂logits = W · mask`; plus finite differences
//! of the whole model, accumulation semantics and name errors.

use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::{Backend, View, ViewMut};
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::model::{Grads, Inputs, Model, ModelError};
use safetensors::SafeTensors;

mod common;
use common::{f32s, fixture, rel_err, u32s};

/// Bound on `max |ours − theirs| / max |theirs|` per gradient tensor.
const REL: f64 = 1e-4;

/// The gradients the fixtures hold.
const PARAMS: [&str; 4] = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
];

/// One input set of a fixture.
struct Set {
    batch: usize,
    seq: usize,
    input_ids: Vec<u32>,
    attention_mask: Vec<u32>,
    position_ids: Vec<u32>,
    /// `∂L/∂logits = W · mask`, `[batch, seq, vocab]`.
    dlogits: Vec<f32>,
    /// The expected gradients, in [`PARAMS`] order.
    grads: Vec<Vec<f32>>,
}

impl Set {
    fn inputs(&self) -> Inputs<'_> {
        Inputs {
            batch: self.batch,
            seq: self.seq,
            input_ids: &self.input_ids,
            attention_mask: &self.attention_mask,
            position_ids: &self.position_ids,
        }
    }
}

fn set(name: &str, set: &str) -> Set {
    let bytes = std::fs::read(fixture(name).join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (shape, input_ids) = u32s(&st, &format!("{set}.input_ids"));
    let (_, attention_mask) = u32s(&st, &format!("{set}.attention_mask"));
    let (_, position_ids) = u32s(&st, &format!("{set}.position_ids"));
    let w = f32s(&st, &format!("{set}.W"));
    let vocab = w.len() / attention_mask.len();
    let dlogits = w
        .chunks_exact(vocab)
        .zip(&attention_mask)
        .flat_map(|(row, &m)| row.iter().map(move |&x| x * m as f32))
        .collect();
    let grads = PARAMS
        .iter()
        .map(|p| f32s(&st, &format!("{set}.grad.{p}")))
        .collect();
    Set {
        batch: shape[0],
        seq: shape[1],
        input_ids,
        attention_mask,
        position_ids,
        dlogits,
        grads,
    }
}

/// Forward then backward of `set` on `model`, adding into `grads`.
fn forward_backward(model: &Model<CpuBackend>, s: &Set, grads: &mut Grads<CpuBackend>) {
    let be = model.backend();
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    let mut dlogits = be.alloc(s.dlogits.len()).unwrap();
    be.upload(&s.dlogits, ViewMut::whole(&mut dlogits)).unwrap();
    model
        .backward(&s.inputs(), &mut acts, View::whole(&dlogits), grads)
        .unwrap();
}

fn load(name: &str) -> (Checkpoint, Model<CpuBackend>) {
    let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
    (checkpoint, model)
}

fn check(name: &str) {
    let (_, model) = load(name);
    for set_name in ["right", "left"] {
        let s = set(name, set_name);
        let mut grads = model.grads().unwrap();
        forward_backward(&model, &s, &mut grads);
        for (param, expected) in PARAMS.iter().zip(&s.grads) {
            let ours = grads.download(model.backend(), param).unwrap();
            let err = rel_err(&ours, expected);
            eprintln!("{name} {set_name} {param}: max rel error {err:.2e}");
            assert!(err <= REL, "{name} {set_name} {param}: {err:e} > {REL:e}");
        }
    }
}

#[test]
fn qwen2_gradients_match_transformers() {
    check("qwen2_tiny");
}

#[test]
fn qwen3_gradients_match_transformers() {
    check("qwen3_tiny");
}

#[test]
fn llama_gradients_match_transformers() {
    check("llama_tiny");
}

/// The fixture loss of `set` for `model`, in f64.
fn loss(model: &Model<CpuBackend>, s: &Set) -> f64 {
    let logits = model.forward_logits(&s.inputs()).unwrap();
    logits
        .iter()
        .zip(&s.dlogits)
        .map(|(&x, &w)| f64::from(x) * f64::from(w))
        .sum()
}

/// Central differences of the loss for the largest-gradient element of each parameter
/// (picked by `get`), against the backward pass; covers biases and Qwen3's q/k norm.
/// A parameter's name and where its values are in a checkpoint.
type Param = (&'static str, fn(&mut Checkpoint) -> &mut Vec<f32>);

fn finite_differences(name: &str, params: &[Param]) {
    let (checkpoint, model) = load(name);
    let s = set(name, "left");
    let mut grads = model.grads().unwrap();
    forward_backward(&model, &s, &mut grads);
    for (param, get) in params {
        let analytic = grads.download(model.backend(), param).unwrap();
        let (idx, &g) = analytic
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap();
        let h = 1e-2f32;
        let at = |delta: f32| {
            let mut c = checkpoint.clone();
            get(&mut c)[idx] += delta;
            loss(&Model::from_checkpoint(CpuBackend, &c).unwrap(), &s)
        };
        let numeric = (at(h) - at(-h)) / (2.0 * f64::from(h));
        let err = (numeric - f64::from(g)).abs() / f64::from(g).abs();
        eprintln!("{name} {param}[{idx}]: analytic {g:.6}, numeric {numeric:.6}, rel {err:.2e}");
        assert!(err < 1e-2, "{name} {param}[{idx}]: {g} vs {numeric}");
    }
}

#[test]
fn qwen2_matches_finite_differences() {
    finite_differences(
        "qwen2_tiny",
        &[
            ("model.layers.0.self_attn.k_proj.bias", |c| {
                &mut c.weights.layers[0].k_proj_bias.as_mut().unwrap().data
            }),
            ("model.layers.1.input_layernorm.weight", |c| {
                &mut c.weights.layers[1].input_layernorm.data
            }),
        ],
    );
}

#[test]
fn qwen3_matches_finite_differences() {
    finite_differences(
        "qwen3_tiny",
        &[
            ("model.layers.0.self_attn.k_norm.weight", |c| {
                c.weights.layers[0]
                    .k_norm
                    .as_mut()
                    .map(|t| &mut t.data)
                    .unwrap()
            }),
            ("model.layers.1.self_attn.v_proj.weight", |c| {
                &mut c.weights.layers[1].v_proj.data
            }),
            ("lm_head.weight", |c| {
                &mut c.weights.lm_head.as_mut().unwrap().data
            }),
        ],
    );
}

#[test]
fn backward_accumulates_until_zeroed() {
    let (_, model) = load("qwen3_tiny");
    let s = set("qwen3_tiny", "right");
    let mut grads = model.grads().unwrap();
    forward_backward(&model, &s, &mut grads);
    let once: Vec<Vec<f32>> = PARAMS
        .iter()
        .map(|p| grads.download(model.backend(), p).unwrap())
        .collect();
    forward_backward(&model, &s, &mut grads);
    for (p, once) in PARAMS.iter().zip(&once) {
        let twice = grads.download(model.backend(), p).unwrap();
        let doubled: Vec<f32> = once.iter().map(|x| 2.0 * x).collect();
        assert!(rel_err(&twice, &doubled) < 1e-6, "{p}");
    }
    grads.zero(model.backend()).unwrap();
    forward_backward(&model, &s, &mut grads);
    for (p, once) in PARAMS.iter().zip(&once) {
        assert_eq!(&grads.download(model.backend(), p).unwrap(), once, "{p}");
    }
}

/// The arena keeps one layer's `silu(gate) · up` and the backward recomputes each layer's:
/// a second backward of the same forward gives the first one's gradients, bit for bit.
#[test]
fn a_second_backward_of_one_forward_gives_the_same_gradients() {
    let (_, model) = load("qwen2_tiny");
    let s = set("qwen2_tiny", "right");
    let be = model.backend();
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    let mut dlogits = be.alloc(s.dlogits.len()).unwrap();
    be.upload(&s.dlogits, ViewMut::whole(&mut dlogits)).unwrap();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut grads = model.grads().unwrap();
        model
            .backward(&s.inputs(), &mut acts, View::whole(&dlogits), &mut grads)
            .unwrap();
        let all: Vec<Vec<f32>> = PARAMS
            .iter()
            .map(|p| grads.download(be, p).unwrap())
            .collect();
        runs.push(all);
    }
    assert_eq!(runs[0], runs[1]);
}

#[test]
fn bad_backward_arguments_are_errors() {
    let (_, model) = load("qwen2_tiny");
    let s = set("qwen2_tiny", "right");
    let mut grads = model.grads().unwrap();
    let e = grads.tensor("lm_head.weight").unwrap_err();
    assert!(matches!(e, ModelError::UnknownParameter { .. }), "{e}");
    assert!(e.to_string().contains("tied"), "{e}");
    assert!(grads.tensor("model.layers.2.mlp.up_proj.weight").is_err());
    assert!(
        grads
            .tensor("model.layers.0.self_attn.q_norm.weight")
            .is_err()
    );
    assert!(grads.tensor("model.layers.x.mlp.up_proj.weight").is_err());
    assert_eq!(
        grads
            .tensor("model.layers.1.self_attn.q_proj.bias")
            .unwrap()
            .len(),
        48
    );

    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    let short = vec![0.0f32; 10];
    let e = model
        .backward(&s.inputs(), &mut acts, View::whole(&short), &mut grads)
        .unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::InputLength {
                what: "dlogits",
                ..
            }
        ),
        "{e}"
    );
    let mut other = model.activations(1, 3).unwrap();
    let dl = vec![0.0f32; s.dlogits.len()];
    let e = model
        .backward(&s.inputs(), &mut other, View::whole(&dl), &mut grads)
        .unwrap_err();
    assert!(matches!(e, ModelError::ActivationShape { .. }), "{e}");
}

/// Every gradient of `model` after one forward/backward of `s` — with explicit ∂L/∂logits,
/// or (`log_prob`) from per-token log-prob coefficients through a chunked LM head — in
/// arenas with and without activation checkpointing.
fn all_grads(
    model: &Model<CpuBackend>,
    checkpoint: &Checkpoint,
    s: &Set,
    log_prob: bool,
) -> Vec<Vec<f32>> {
    let mut grads = model.grads().unwrap();
    if log_prob {
        let mut acts = model.activations_chunked(s.batch, s.seq, 3).unwrap();
        model.forward(&s.inputs(), &mut acts).unwrap();
        let n = s.batch * s.seq;
        let targets: Vec<u32> = (0..n).map(|t| (t * 7 % 50) as u32).collect();
        let coeffs: Vec<f32> = (0..n)
            .map(|t| s.attention_mask[t] as f32 * (0.5 - (t % 3) as f32 * 0.25))
            .collect();
        model
            .backward_from_log_prob_grads(
                &s.inputs(),
                &mut acts,
                &targets,
                &coeffs,
                0.9,
                &mut grads,
            )
            .unwrap();
    } else {
        forward_backward(model, s, &mut grads);
    }
    checkpoint
        .weights
        .tensors()
        .iter()
        .map(|(name, _)| grads.download(model.backend(), name).unwrap())
        .collect()
}

/// Activation checkpointing (`Model::set_gradient_checkpointing`): an arena that keeps one
/// layer's activations, the backward pass recomputing each layer's forward from its input,
/// gives every gradient bit for bit as the arena that keeps them all — all three
/// architectures (Qwen3's q/k norms included), both padding sides, explicit ∂L/∂logits and
/// the chunked log-prob head.
#[test]
fn checkpointed_gradients_are_the_stored_ones_bit_for_bit() {
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let (checkpoint, mut model) = load(name);
        for set_name in ["right", "left"] {
            let s = set(name, set_name);
            for log_prob in [false, true] {
                model.set_gradient_checkpointing(false);
                let stored = all_grads(&model, &checkpoint, &s, log_prob);
                model.set_gradient_checkpointing(true);
                assert!(model.activations(s.batch, s.seq).unwrap().checkpointed());
                let recomputed = all_grads(&model, &checkpoint, &s, log_prob);
                let bits = |g: &[Vec<f32>]| -> Vec<Vec<u32>> {
                    g.iter()
                        .map(|t| t.iter().map(|x| x.to_bits()).collect())
                        .collect()
                };
                assert!(stored.iter().flatten().any(|&x| x != 0.0));
                assert_eq!(
                    bits(&stored),
                    bits(&recomputed),
                    "{name} {set_name} log_prob={log_prob}"
                );
            }
        }
    }
}

/// The layer watcher a data-parallel run starts its sums from: told of each layer once,
/// last to first, when its gradients are final — every architecture, stored and
/// checkpointed activations, explicit ∂L/∂logits and the chunked log-prob head.
#[test]
fn each_layer_is_handed_over_once_its_gradients_are_final() {
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let (checkpoint, mut model) = load(name);
        let s = set(name, "left");
        let layers = model.spec().layers;
        for checkpointed in [false, true] {
            model.set_gradient_checkpointing(checkpointed);
            let mut grads = model.grads().unwrap();
            common::check_layer_watch(model.backend(), layers, &mut grads, |g| {
                forward_backward(&model, &s, g);
            });
            let mut acts = model.activations_chunked(s.batch, s.seq, 3).unwrap();
            model.forward(&s.inputs(), &mut acts).unwrap();
            let n = s.batch * s.seq;
            let targets: Vec<u32> = (0..n).map(|t| (t * 7 % 50) as u32).collect();
            let coeffs: Vec<f32> = (0..n).map(|t| s.attention_mask[t] as f32 * 0.5).collect();
            let mut grads = model.grads().unwrap();
            common::check_layer_watch(model.backend(), layers, &mut grads, |g| {
                model
                    .backward_from_log_prob_grads(&s.inputs(), &mut acts, &targets, &coeffs, 0.9, g)
                    .unwrap();
            });
        }
        drop(checkpoint);
    }
}

/// The memory plan's arena size (`arena_elements`) is what `Activations::planned`
/// allocates, element for element: every architecture, whole and chunked heads, stored and
/// checkpointed, every layout of bf16 activations.
#[test]
fn arena_elements_predict_the_allocation() {
    use ares_model::model::{ActLayout, Activations, HeadMode, ModelSpec, arena_elements};
    let layouts = [
        ActLayout::F32,
        ActLayout {
            mlp: true,
            ..ActLayout::F32
        },
        ActLayout {
            mlp: true,
            ln1: true,
            qkv: true,
            att: true,
        },
        ActLayout {
            mlp: true,
            ln1: false,
            qkv: true,
            att: false,
        },
    ];
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let (checkpoint, _) = load(name);
        let spec = ModelSpec::from_config(&checkpoint.config).unwrap();
        for (batch, seq) in [(1, 1), (2, 7), (3, 16)] {
            for head in [
                HeadMode::Full,
                HeadMode::Chunked { rows: 1 },
                HeadMode::Chunked { rows: 5 },
            ] {
                for (checkpointed, dtype) in [false, true]
                    .into_iter()
                    .flat_map(|c| layouts.map(|l| (c, l)))
                {
                    let acts = Activations::planned(
                        &CpuBackend,
                        &spec,
                        batch,
                        seq,
                        head,
                        checkpointed,
                        dtype,
                    )
                    .unwrap();
                    let planned = arena_elements(&spec, batch, seq, head, checkpointed, dtype);
                    assert_eq!(
                        planned,
                        Some(acts.elements()),
                        "{name} {batch}x{seq} {head:?} checkpointed={checkpointed} {dtype:?}"
                    );
                    let bf16s = planned.unwrap().bf16s;
                    assert_eq!(bf16s > 0, dtype != ActLayout::F32);
                }
            }
        }
    }
}

/// A forward-only arena (`Model::activations_forward`, the scoring passes'): the
/// checkpointed layout whatever the model says, the log-probs and entropies of a full
/// arena bit for bit, in fewer elements.
#[test]
fn forward_only_arenas_score_the_same_bits_in_less_memory() {
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let (_, model) = load(name);
        let (batch, seq) = (2, 9);
        let v = model.spec().vocab as u32;
        let ids: Vec<u32> = (0..batch * seq).map(|i| (i as u32 * 7 + 3) % v).collect();
        let mask = vec![1u32; batch * seq];
        let positions: Vec<u32> = (0..batch * seq).map(|i| (i % seq) as u32).collect();
        let inputs = Inputs {
            batch,
            seq,
            input_ids: &ids,
            attention_mask: &mask,
            position_ids: &positions,
        };
        let targets: Vec<u32> = ids.iter().map(|&t| (t + 1) % v).collect();
        let score = |acts: &mut ares_model::model::Activations<CpuBackend>| {
            model.forward(&inputs, acts).unwrap();
            model.log_prob_entropy(acts, &targets, 0.9).unwrap();
            let n = batch * seq;
            let (mut lp, mut h) = (vec![0.0; n], vec![0.0; n]);
            model.backend().download(acts.log_probs(), &mut lp).unwrap();
            model.backend().download(acts.entropies(), &mut h).unwrap();
            (lp, h)
        };
        let mut full = model.activations(batch, seq).unwrap();
        let mut forward = model.activations_forward(batch, seq).unwrap();
        assert!(!full.checkpointed() && forward.checkpointed(), "{name}");
        assert!(
            forward.elements().bytes() < full.elements().bytes(),
            "{name}"
        );
        assert_eq!(score(&mut forward), score(&mut full), "{name}");
    }
}
