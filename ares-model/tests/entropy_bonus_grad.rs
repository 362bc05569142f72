//! The entropy term of the loss head on the CPU backend with the tiny fixtures
//! (`tests/fixtures/models`): the gradient that
//! [`Model::backward_from_log_prob_grads_with`] makes from per-token ∂L/∂H
//! (`entropy_coeffs`) equals central finite differences of `Σ_t c_t·H_t`, with `H_t` the
//! entropies of [`Model::log_prob_entropy`] at a temperature ≠ 1; log-prob and entropy
//! coefficients together give the sum of their separate gradients, with whole logits and
//! with a chunked head (chunks active through either kind of coefficient); zero entropy
//! coefficients change nothing; bad entropy coefficients are errors.

use ares_model::backend::Backend;
use ares_model::backend::cpu::CpuBackend;
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::hf::weights::expected_tensors;
use ares_model::model::{Activations, Grads, Model, ModelError};

mod common;
use common::{Batch, batch, fixture, rel_err};

fn load(name: &str) -> (Checkpoint, Model<CpuBackend>) {
    let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
    (checkpoint, model)
}

/// Entropy coefficients of both signs at every valid position (also the last one of a
/// sequence, which has no log-prob target), 0 at padding.
fn entropy_coeffs(s: &Batch) -> Vec<f32> {
    s.attention_mask
        .iter()
        .enumerate()
        .map(|(i, &m)| {
            if m == 1 {
                [0.8, -0.5, 1.3, -0.9, 0.35][(i * 3) % 5]
            } else {
                0.0
            }
        })
        .collect()
}

/// `Σ_t c_t·H_t` from the forward pass and the fused entropy kernel (f32), summed in f64.
fn weighted_entropy(model: &Model<CpuBackend>, s: &Batch, c: &[f32], temperature: f32) -> f64 {
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    model
        .log_prob_entropy(&mut acts, &s.targets, temperature)
        .unwrap();
    let mut h = vec![0.0; s.tokens()];
    model.backend().download(acts.entropies(), &mut h).unwrap();
    h.iter()
        .zip(c)
        .map(|(&h, &c)| f64::from(h) * f64::from(c))
        .sum()
}

/// The gradients the loss head makes from log-prob coefficients `lp` and entropy
/// coefficients `ent`, after a forward (and scoring) pass on `acts`.
fn head_grads(
    model: &Model<CpuBackend>,
    acts: &mut Activations<CpuBackend>,
    s: &Batch,
    lp: &[f32],
    ent: Option<&[f32]>,
    temperature: f32,
) -> Grads<CpuBackend> {
    model.forward(&s.inputs(), acts).unwrap();
    model
        .log_prob_entropy(acts, &s.targets, temperature)
        .unwrap();
    let mut grads = model.grads().unwrap();
    model
        .backward_from_log_prob_grads_with(
            &s.inputs(),
            acts,
            &s.targets,
            lp,
            temperature,
            &mut grads,
            None,
            ent,
        )
        .unwrap();
    grads
}

/// Every parameter's gradient, by name.
fn named(
    model: &Model<CpuBackend>,
    checkpoint: &Checkpoint,
    grads: &Grads<CpuBackend>,
) -> Vec<(String, Vec<f32>)> {
    expected_tensors(&checkpoint.config)
        .into_iter()
        .map(|(name, _)| {
            let g = grads.download(model.backend(), &name).unwrap();
            (name, g)
        })
        .collect()
}

/// A parameter's name and where its values are in a checkpoint.
type Param = (&'static str, fn(&mut Checkpoint) -> &mut Vec<f32>);

/// Central differences of `Σ_t c_t·H_t` at the two largest-gradient entries of each
/// parameter against the loss head's gradient from `entropy_coeffs = c` (log-prob
/// coefficients all 0).
fn finite_differences(name: &str, temperature: f32, params: &[Param]) {
    let (checkpoint, model) = load(name);
    let s = batch(name, "left");
    let c = entropy_coeffs(&s);
    let zeros = vec![0.0f32; s.tokens()];
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    let grads = head_grads(&model, &mut acts, &s, &zeros, Some(&c), temperature);
    for (param, get) in params {
        let analytic = grads.download(model.backend(), param).unwrap();
        let mut order: Vec<usize> = (0..analytic.len()).collect();
        order.sort_by(|&a, &b| analytic[b].abs().total_cmp(&analytic[a].abs()));
        for &idx in &order[..2] {
            let g = f64::from(analytic[idx]);
            assert!(g != 0.0, "{name} {param}: no gradient");
            // f32 forward, f64 sum: h = 1e-2 keeps the forward's rounding (~1e-6 of a loss
            // of a few units, over 2h) near 1e-4 of these gradients, and the O(h²)
            // truncation as small; the 1e-2 bound then fails a 5 % error by a wide margin.
            let h = 1e-2f32;
            let at = |delta: f32| {
                let mut ck = checkpoint.clone();
                get(&mut ck)[idx] += delta;
                let m = Model::from_checkpoint(CpuBackend, &ck).unwrap();
                weighted_entropy(&m, &s, &c, temperature)
            };
            let numeric = (at(h) - at(-h)) / (2.0 * f64::from(h));
            let err = (numeric - g).abs() / g.abs();
            eprintln!(
                "{name} T={temperature} {param}[{idx}]: analytic {g:.6}, numeric {numeric:.6}, rel {err:.2e}"
            );
            assert!(err < 1e-2, "{name} {param}[{idx}]: {g} vs {numeric}");
        }
    }
}

#[test]
fn entropy_head_matches_finite_differences() {
    finite_differences(
        "qwen3_tiny",
        0.7,
        &[
            ("lm_head.weight", |c| {
                &mut c.weights.lm_head.as_mut().unwrap().data
            }),
            ("model.layers.0.mlp.up_proj.weight", |c| {
                &mut c.weights.layers[0].up_proj.data
            }),
        ],
    );
    // Tied embeddings: the LM head's gradient lands in the embedding.
    finite_differences(
        "qwen2_tiny",
        1.4,
        &[
            ("model.embed_tokens.weight", |c| {
                &mut c.weights.embed_tokens.data
            }),
            ("model.layers.1.self_attn.q_proj.bias", |c| {
                &mut c.weights.layers[1].q_proj_bias.as_mut().unwrap().data
            }),
        ],
    );
}

#[test]
fn log_prob_and_entropy_terms_add_up() {
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let (checkpoint, model) = load(name);
        let s = batch(name, "left");
        let n = s.tokens();
        let zeros = vec![0.0f32; n];
        // Log-prob coefficients on the first half of the tokens, entropy ones on the
        // second half plus a few shared positions: with chunks of 3 rows some chunks are
        // active only through their entropy coefficients.
        let lp: Vec<f32> = (0..n)
            .map(|t| if t < n / 2 { s.coeffs[t] } else { 0.0 })
            .collect();
        let ent: Vec<f32> = entropy_coeffs(&s)
            .iter()
            .enumerate()
            .map(|(t, &c)| if t >= n / 2 || t % 5 == 0 { c } else { 0.0 })
            .collect();
        let temperature = 0.8;
        let mut full = model.activations_full(s.batch, s.seq).unwrap();
        let mut chunked = model.activations_chunked(s.batch, s.seq, 3).unwrap();
        let run = |acts: &mut Activations<CpuBackend>, lp: &[f32], ent: Option<&[f32]>| {
            let g = head_grads(&model, acts, &s, lp, ent, temperature);
            named(&model, &checkpoint, &g)
        };
        let lp_only = run(&mut full, &lp, None);
        let ent_only = run(&mut full, &zeros, Some(&ent));
        let both = run(&mut full, &lp, Some(&ent));
        let both_chunked = run(&mut chunked, &lp, Some(&ent));
        let ent_chunked = run(&mut chunked, &zeros, Some(&ent));
        for i in 0..both.len() {
            let param = &both[i].0;
            let sum: Vec<f32> = lp_only[i]
                .1
                .iter()
                .zip(&ent_only[i].1)
                .map(|(a, b)| a + b)
                .collect();
            assert!(
                ent_only[i].1.iter().any(|&x| x != 0.0),
                "{name} {param}: the entropy term gives no gradient"
            );
            let err = rel_err(&both[i].1, &sum);
            assert!(err < 1e-5, "{name} {param}: both vs sum {err:e}");
            // the chunked head sums its GEMMs in another order than the whole one, and the
            // order differs by CPU path (16-lane AVX-512 reached 5.3e-6 on a k_proj bias):
            // rounding, where a wrong chunk would be off by O(1)
            let err = rel_err(&both_chunked[i].1, &both[i].1);
            assert!(err < 2e-5, "{name} {param}: chunked vs whole {err:e}");
            let err = rel_err(&ent_chunked[i].1, &ent_only[i].1);
            assert!(
                err < 2e-5,
                "{name} {param}: entropy chunked vs whole {err:e}"
            );
        }
        // Zero entropy coefficients are no entropy term.
        let zero_ent = run(&mut full, &lp, Some(&zeros));
        for ((param, a), (_, b)) in zero_ent.iter().zip(&lp_only) {
            assert_eq!(a, b, "{name} {param}");
        }
    }
}

#[test]
fn bad_entropy_coefficients_are_errors() {
    let (_, model) = load("qwen2_tiny");
    let s = batch("qwen2_tiny", "left");
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    let mut grads = model.grads().unwrap();
    let mut run = |ent: &[f32]| {
        model.backward_from_log_prob_grads_with(
            &s.inputs(),
            &mut acts,
            &s.targets,
            &s.coeffs,
            0.9,
            &mut grads,
            None,
            Some(ent),
        )
    };
    let good = entropy_coeffs(&s);
    let e = run(&good[1..]).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::InputLength {
                what: "entropy_coeffs",
                ..
            }
        ),
        "{e}"
    );
    let mut nan = good.clone();
    nan[4] = f32::NAN;
    let e = run(&nan).unwrap_err();
    assert!(e.to_string().contains("entropy_coeffs[4]"), "{e}");
    let mut inf = good.clone();
    inf[2] = f32::NEG_INFINITY;
    let e = run(&inf).unwrap_err();
    assert!(e.to_string().contains("entropy_coeffs[2]"), "{e}");
    let pad = s.attention_mask.iter().position(|&m| m == 0).unwrap();
    let mut on_pad = good.clone();
    on_pad[pad] = 0.5;
    let e = run(&on_pad).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("entropy_coeffs[{pad}]")) && msg.contains("padding"),
        "{e}"
    );
    // Nothing was accumulated by the failed calls.
    let embed = grads
        .download(model.backend(), "model.embed_tokens.weight")
        .unwrap();
    assert!(embed.iter().all(|&x| x == 0.0));
}
