//! The decoder forward pass on the CPU backend against transformers' logits for the tiny
//! fixtures (`tests/fixtures/models`, see its README): every model, right- and
//! left-padded inputs, valid positions only; plus input errors.

use ares_model::backend::Backend;
use ares_model::backend::cpu::CpuBackend;
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::model::{Inputs, Model, ModelError};
use safetensors::{Dtype, SafeTensors};

mod common;
use common::fixture;

/// Element-wise bound: `|ours − theirs| <= REL · max(1, |theirs|)`.
const REL: f32 = 1e-4;

fn model(name: &str) -> Model<CpuBackend> {
    let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
    Model::from_checkpoint(CpuBackend, &checkpoint).unwrap()
}

/// The expected inputs and logits of one input set.
struct Expected {
    shape: Vec<usize>,
    input_ids: Vec<u32>,
    attention_mask: Vec<u32>,
    position_ids: Vec<u32>,
    logits: Vec<f32>,
}

fn i64_as_u32(st: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<u32>) {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::I64, "{name}");
    let values = t
        .data()
        .chunks_exact(8)
        .map(|b| u32::try_from(i64::from_le_bytes(b.try_into().unwrap())).unwrap())
        .collect();
    (t.shape().to_vec(), values)
}

fn expected(name: &str, set: &str) -> Expected {
    let bytes = std::fs::read(fixture(name).join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (shape, input_ids) = i64_as_u32(&st, &format!("{set}.input_ids"));
    let (_, attention_mask) = i64_as_u32(&st, &format!("{set}.attention_mask"));
    let (_, position_ids) = i64_as_u32(&st, &format!("{set}.position_ids"));
    let t = st.tensor(&format!("{set}.logits")).unwrap();
    assert_eq!(t.dtype(), Dtype::F32);
    let logits = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Expected {
        shape,
        input_ids,
        attention_mask,
        position_ids,
        logits,
    }
}

/// Runs `name` on input set `set`; returns (max abs error, max relative error) over the
/// valid positions, relative to `max(1, |expected|)` per element.
fn parity(name: &str, set: &str) -> (f32, f32) {
    let model = model(name);
    let e = expected(name, set);
    let (batch, seq) = (e.shape[0], e.shape[1]);
    let inputs = Inputs {
        batch,
        seq,
        input_ids: &e.input_ids,
        attention_mask: &e.attention_mask,
        position_ids: &e.position_ids,
    };
    let logits = model.forward_logits(&inputs).unwrap();
    let vocab = model.spec().vocab;
    assert_eq!(logits.len(), e.logits.len());
    let (mut max_abs, mut max_rel, mut valid) = (0.0f32, 0.0f32, 0);
    for (row, &m) in e.attention_mask.iter().enumerate() {
        if m == 0 {
            continue;
        }
        valid += 1;
        let span = row * vocab..(row + 1) * vocab;
        for (&ours, &theirs) in logits[span.clone()].iter().zip(&e.logits[span]) {
            let abs = (ours - theirs).abs();
            max_abs = max_abs.max(abs);
            max_rel = max_rel.max(abs / theirs.abs().max(1.0));
        }
    }
    assert!(valid > 0);
    eprintln!("{name} {set}: max abs error {max_abs:.3e}, max rel error {max_rel:.3e}");
    (max_abs, max_rel)
}

fn check(name: &str) {
    for set in ["right", "left"] {
        let (_, rel) = parity(name, set);
        assert!(rel <= REL, "{name} {set}: relative error {rel:e} > {REL:e}");
    }
}

#[test]
fn qwen2_logits_match_transformers() {
    check("qwen2_tiny");
}

#[test]
fn qwen3_logits_match_transformers() {
    check("qwen3_tiny");
}

#[test]
fn llama_logits_match_transformers() {
    check("llama_tiny");
}

#[test]
fn left_and_right_sets_differ_in_layout() {
    let (right, left) = (
        expected("qwen2_tiny", "right"),
        expected("qwen2_tiny", "left"),
    );
    assert_ne!(right.attention_mask, left.attention_mask);
    assert_ne!(right.position_ids, left.position_ids);
}

#[test]
fn one_arena_serves_both_input_sets() {
    let model = model("llama_tiny");
    let mut acts = model.activations(2, 7).unwrap();
    for set in ["right", "left", "right"] {
        let e = expected("llama_tiny", set);
        let inputs = Inputs {
            batch: 2,
            seq: 7,
            input_ids: &e.input_ids,
            attention_mask: &e.attention_mask,
            position_ids: &e.position_ids,
        };
        model.forward(&inputs, &mut acts).unwrap();
        let mut logits = vec![0.0; acts.logits().len()];
        model.download_logits(&acts, &mut logits).unwrap();
        assert_eq!(logits, model.forward_logits(&inputs).unwrap(), "{set}");
    }
}

#[test]
fn bad_inputs_are_errors_naming_what_is_wrong() {
    let model = model("qwen2_tiny");
    let ids = [1u32, 2, 3, 4, 5, 6];
    let mask = [1u32; 6];
    let pos = [0u32, 1, 2, 0, 1, 2];
    let ok = Inputs {
        batch: 2,
        seq: 3,
        input_ids: &ids,
        attention_mask: &mask,
        position_ids: &pos,
    };
    assert!(model.forward_logits(&ok).is_ok());

    let short = Inputs {
        input_ids: &ids[..5],
        ..ok
    };
    let e = model.forward_logits(&short).unwrap_err();
    assert!(matches!(
        e,
        ModelError::InputLength {
            what: "input_ids",
            expected: 6,
            actual: 5
        }
    ));
    assert_eq!(
        e.to_string(),
        "input input_ids: expected 6 elements (batch × seq), found 5"
    );

    let bad_id = [1u32, 2, 3, 4, 97, 6];
    let e = model
        .forward_logits(&Inputs {
            input_ids: &bad_id,
            ..ok
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::TokenOutOfRange {
                what: "input_ids",
                index: 4,
                id: 97,
                vocab: 97
            }
        ),
        "{e}"
    );

    let bad_mask = [1u32, 1, 2, 1, 1, 1];
    let e = model
        .forward_logits(&Inputs {
            attention_mask: &bad_mask,
            ..ok
        })
        .unwrap_err();
    assert!(
        matches!(e, ModelError::InvalidMask { index: 2, value: 2 }),
        "{e}"
    );

    let max = model.spec().max_positions as u32;
    let bad_pos = [0u32, 1, max, 0, 1, 2];
    let e = model
        .forward_logits(&Inputs {
            position_ids: &bad_pos,
            ..ok
        })
        .unwrap_err();
    assert!(
        matches!(e, ModelError::PositionOutOfRange { index: 2, .. }),
        "{e}"
    );

    let e = model
        .forward_logits(&Inputs {
            batch: 0,
            seq: 3,
            input_ids: &[],
            attention_mask: &[],
            position_ids: &[],
        })
        .unwrap_err();
    assert!(
        matches!(e, ModelError::BatchShape { batch: 0, seq: 3 }),
        "{e}"
    );

    let mut acts = model.activations(1, 6).unwrap();
    let e = model.forward(&ok, &mut acts).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::ActivationShape {
                planned: (1, 6),
                actual: (2, 3)
            }
        ),
        "{e}"
    );
}

#[test]
fn unsupported_rope_type_is_rejected() {
    let mut checkpoint = Checkpoint::load(&fixture("llama_tiny")).unwrap();
    checkpoint.config.rope.scaling = ares_model::hf::rope::RopeScaling::Other {
        rope_type: "yarn".into(),
    };
    let e = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap_err();
    assert_eq!(
        e.to_string(),
        "unsupported model config: rope_type `yarn` (supported: default, linear, llama3)"
    );
}

#[test]
fn untied_model_without_lm_head_is_rejected() {
    let mut checkpoint = Checkpoint::load(&fixture("llama_tiny")).unwrap();
    checkpoint.weights.lm_head = None;
    let e = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap_err();
    assert!(matches!(e, ModelError::MissingWeight { .. }), "{e}");
}

/// `(log softmax(z)[target], H(softmax(z)))` of one row in f64, `z = row / temperature`.
fn reference_log_prob_entropy(row: &[f32], target: usize, temperature: f64) -> (f64, f64) {
    let z: Vec<f64> = row.iter().map(|&x| f64::from(x) / temperature).collect();
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + z.iter().map(|&x| (x - m).exp()).sum::<f64>().ln();
    let entropy = -z.iter().map(|&x| (x - lse).exp() * (x - lse)).sum::<f64>();
    (z[target] - lse, entropy)
}

#[test]
fn log_probs_and_entropies_match_the_logits() {
    let model = model("qwen3_tiny");
    let e = expected("qwen3_tiny", "right");
    let inputs = Inputs {
        batch: 2,
        seq: 7,
        input_ids: &e.input_ids,
        attention_mask: &e.attention_mask,
        position_ids: &e.position_ids,
    };
    let mut acts = model.activations(2, 7).unwrap();
    model.forward(&inputs, &mut acts).unwrap();
    // Next-token targets within each row; the last position predicts token 0.
    let targets: Vec<u32> = (0..14)
        .map(|i| if i % 7 == 6 { 0 } else { e.input_ids[i + 1] })
        .collect();
    let temperature = 0.7;
    model
        .log_prob_entropy(&mut acts, &targets, temperature)
        .unwrap();
    let be = model.backend();
    let (mut log_prob, mut entropy, mut logits) =
        (vec![0.0; 14], vec![0.0; 14], vec![0.0; 14 * 97]);
    be.download(acts.log_probs(), &mut log_prob).unwrap();
    be.download(acts.entropies(), &mut entropy).unwrap();
    model.download_logits(&acts, &mut logits).unwrap();
    for row in 0..14 {
        let (lp, h) = reference_log_prob_entropy(
            &logits[row * 97..(row + 1) * 97],
            targets[row] as usize,
            f64::from(temperature),
        );
        assert!((f64::from(log_prob[row]) - lp).abs() < 1e-5, "row {row}");
        assert!((f64::from(entropy[row]) - h).abs() < 1e-5, "row {row}");
    }

    let e = model
        .log_prob_entropy(&mut acts, &[97; 14], temperature)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "targets[0] = 97 is out of range for vocab_size 97"
    );
    assert!(
        model
            .log_prob_entropy(&mut acts, &[0; 13], temperature)
            .is_err()
    );
    assert!(model.log_prob_entropy(&mut acts, &[0; 14], 0.0).is_err());
}
