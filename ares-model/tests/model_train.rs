//! Training on the CPU backend with the tiny fixtures (`tests/fixtures/models`): the loss
//! head ([`Model::backward_from_log_prob_grads`]) against the backward of host-computed
//! ∂L/∂logits and against finite differences of the forward log-probs, and its argument
//! errors; [`AdamW`] against `ares-cpu`'s optimizer and a hand computation, skipped steps,
//! and its state file; weights back to the host and trained checkpoints saved and reloaded.

use std::path::{Path, PathBuf};

use ares_cpu::ops::optim::{adamw_step, clip_grad_norm};
use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::{Backend, View, ViewMut};
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::hf::tensor_files::SaveDtype;
use ares_model::hf::weights::expected_tensors;
use ares_model::model::{AdamW, AdamWConfig, Grads, HostMoment, Model, ModelError, StateDtype};
use safetensors::{Dtype, SafeTensors};

mod common;
use common::{Batch, batch, fixture, rel_err};

const MODELS: [&str; 3] = ["qwen2_tiny", "qwen3_tiny", "llama_tiny"];

fn load(name: &str) -> (Checkpoint, Model<CpuBackend>) {
    let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
    (checkpoint, model)
}

/// `∂L/∂logits` of `Σ_t c_t·logπ_t` at temperature `t`, from the logits in f64.
fn host_dlogits(logits: &[f32], vocab: usize, s: &Batch, temperature: f32) -> Vec<f32> {
    let t = f64::from(temperature);
    let mut out = vec![0.0f32; logits.len()];
    for (i, (row, o)) in logits
        .chunks_exact(vocab)
        .zip(out.chunks_exact_mut(vocab))
        .enumerate()
    {
        let c = f64::from(s.coeffs[i]);
        if c == 0.0 {
            continue;
        }
        let z: Vec<f64> = row.iter().map(|&x| f64::from(x) / t).collect();
        let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = z.iter().map(|&v| (v - m).exp()).sum();
        for (v, (o, &zv)) in o.iter_mut().zip(&z).enumerate() {
            let onehot = f64::from(u8::from(v == s.targets[i] as usize));
            *o = (c / t * (onehot - (zv - m).exp() / sum)) as f32;
        }
    }
    out
}

/// Every parameter's gradient, by name.
fn all_grads(
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

#[test]
fn log_prob_head_equals_backward_of_host_dlogits() {
    for name in MODELS {
        let (checkpoint, model) = load(name);
        let vocab = model.spec().vocab;
        for set in ["right", "left"] {
            let s = batch(name, set);
            for temperature in [1.0f32, 0.7] {
                let mut acts = model.activations(s.batch, s.seq).unwrap();
                model.forward(&s.inputs(), &mut acts).unwrap();
                // Scoring in between leaves the logits the head reads.
                model
                    .log_prob_entropy(&mut acts, &s.targets, temperature)
                    .unwrap();
                let mut ours = model.grads().unwrap();
                model
                    .backward_from_log_prob_grads(
                        &s.inputs(),
                        &mut acts,
                        &s.targets,
                        &s.coeffs,
                        temperature,
                        &mut ours,
                    )
                    .unwrap();

                let mut logits = vec![0.0; s.batch * s.seq * vocab];
                model.download_logits(&acts, &mut logits).unwrap();
                let dlogits = host_dlogits(&logits, vocab, &s, temperature);
                let be = model.backend();
                let mut buf = be.alloc(dlogits.len()).unwrap();
                be.upload(&dlogits, ViewMut::whole(&mut buf)).unwrap();
                let mut want = model.grads().unwrap();
                model
                    .backward(&s.inputs(), &mut acts, View::whole(&buf), &mut want)
                    .unwrap();

                let ours = all_grads(&model, &checkpoint, &ours);
                let want = all_grads(&model, &checkpoint, &want);
                for ((param, a), (_, b)) in ours.iter().zip(&want) {
                    let err = rel_err(a, b);
                    assert!(err < 1e-5, "{name} {set} T={temperature} {param}: {err:e}");
                }
            }
        }
    }
}

/// `Σ_t c_t·logπ_t` computed by the forward pass and the fused log-prob kernel, in f64.
fn loss(model: &Model<CpuBackend>, s: &Batch, temperature: f32) -> f64 {
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    model
        .log_prob_entropy(&mut acts, &s.targets, temperature)
        .unwrap();
    let mut lp = vec![0.0; s.batch * s.seq];
    model.backend().download(acts.log_probs(), &mut lp).unwrap();
    lp.iter()
        .zip(&s.coeffs)
        .map(|(&l, &c)| f64::from(l) * f64::from(c))
        .sum()
}

/// A parameter's name and where its values are in a checkpoint.
type Param = (&'static str, fn(&mut Checkpoint) -> &mut Vec<f32>);

/// Central differences of the loss at the largest-gradient element of each parameter.
fn finite_differences(name: &str, temperature: f32, params: &[Param]) {
    let (checkpoint, model) = load(name);
    let s = batch(name, "left");
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    let mut grads = model.grads().unwrap();
    model
        .backward_from_log_prob_grads(
            &s.inputs(),
            &mut acts,
            &s.targets,
            &s.coeffs,
            temperature,
            &mut grads,
        )
        .unwrap();
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
            loss(
                &Model::from_checkpoint(CpuBackend, &c).unwrap(),
                &s,
                temperature,
            )
        };
        let numeric = (at(h) - at(-h)) / (2.0 * f64::from(h));
        let err = (numeric - f64::from(g)).abs() / f64::from(g).abs();
        eprintln!("{name} {param}[{idx}]: analytic {g:.6}, numeric {numeric:.6}, rel {err:.2e}");
        assert!(err < 1e-2, "{name} {param}[{idx}]: {g} vs {numeric}");
    }
}

#[test]
fn log_prob_head_matches_finite_differences() {
    finite_differences(
        "qwen2_tiny",
        0.7,
        &[
            ("model.embed_tokens.weight", |c| {
                &mut c.weights.embed_tokens.data
            }),
            ("model.layers.1.self_attn.q_proj.bias", |c| {
                &mut c.weights.layers[1].q_proj_bias.as_mut().unwrap().data
            }),
        ],
    );
    finite_differences(
        "qwen3_tiny",
        1.0,
        &[
            ("lm_head.weight", |c| {
                &mut c.weights.lm_head.as_mut().unwrap().data
            }),
            ("model.layers.0.self_attn.q_norm.weight", |c| {
                c.weights.layers[0]
                    .q_norm
                    .as_mut()
                    .map(|t| &mut t.data)
                    .unwrap()
            }),
        ],
    );
    finite_differences(
        "llama_tiny",
        1.3,
        &[("model.layers.0.mlp.up_proj.weight", |c| {
            &mut c.weights.layers[0].up_proj.data
        })],
    );
}

#[test]
fn bad_log_prob_head_arguments_are_errors() {
    let (_, model) = load("qwen2_tiny");
    let s = batch("qwen2_tiny", "left");
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    let mut grads = model.grads().unwrap();
    let mut run = |targets: &[u32], coeffs: &[f32], t: f32| {
        model.backward_from_log_prob_grads(&s.inputs(), &mut acts, targets, coeffs, t, &mut grads)
    };
    let e = run(&s.targets[1..], &s.coeffs, 1.0).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::InputLength {
                what: "targets",
                ..
            }
        ),
        "{e}"
    );
    let e = run(&s.targets, &s.coeffs[1..], 1.0).unwrap_err();
    assert!(
        matches!(e, ModelError::InputLength { what: "coeffs", .. }),
        "{e}"
    );
    let mut bad = s.targets.clone();
    bad[3] = 97;
    let e = run(&bad, &s.coeffs, 1.0).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::TokenOutOfRange {
                what: "targets",
                index: 3,
                id: 97,
                ..
            }
        ),
        "{e}"
    );
    let mut nan = s.coeffs.clone();
    nan[5] = f32::NAN;
    let e = run(&s.targets, &nan, 1.0).unwrap_err();
    assert!(e.to_string().contains("coeffs[5]"), "{e}");
    // The left-padded set has padding at position 0 of a row.
    let pad = s.attention_mask.iter().position(|&m| m == 0).unwrap();
    let mut on_pad = s.coeffs.clone();
    on_pad[pad] = 1.0;
    let e = run(&s.targets, &on_pad, 1.0).unwrap_err();
    assert!(e.to_string().contains("padding"), "{e}");
    for t in [0.0, -1.0, f32::INFINITY, f32::NAN] {
        let e = run(&s.targets, &s.coeffs, t).unwrap_err();
        assert!(matches!(e, ModelError::InvalidValue { .. }), "{e}");
    }
    // Nothing was accumulated by the failed calls.
    let embed = grads
        .download(model.backend(), "model.embed_tokens.weight")
        .unwrap();
    assert!(embed.iter().all(|&x| x == 0.0));

    // Gradients of another model are refused before anything is written.
    let (_, other) = load("qwen3_tiny");
    let mut foreign = other.grads().unwrap();
    let e = model
        .backward_from_log_prob_grads(
            &s.inputs(),
            &mut acts,
            &s.targets,
            &s.coeffs,
            1.0,
            &mut foreign,
        )
        .unwrap_err();
    assert!(matches!(e, ModelError::LayoutMismatch { .. }), "{e}");
}

// ----- AdamW over the model. -----

/// Gradients of the loss head on the fixture's left-padded set.
fn loss_grads(model: &Model<CpuBackend>, name: &str) -> Grads<CpuBackend> {
    let s = batch(name, "left");
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    let mut grads = model.grads().unwrap();
    model
        .backward_from_log_prob_grads(
            &s.inputs(),
            &mut acts,
            &s.targets,
            &s.coeffs,
            1.0,
            &mut grads,
        )
        .unwrap();
    grads
}

const CFG: AdamWConfig = AdamWConfig {
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
};

#[test]
fn adamw_steps_equal_ares_cpu_and_the_hand_computation() {
    for name in ["qwen2_tiny", "qwen3_tiny"] {
        let (checkpoint, mut model) = load(name);
        let grads = loss_grads(&model, name);
        let names: Vec<String> = expected_tensors(&checkpoint.config)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let host_grads: Vec<Vec<f32>> = names
            .iter()
            .map(|n| grads.download(model.backend(), n).unwrap())
            .collect();
        let w0 = model.to_weights().unwrap();
        assert_eq!(
            w0, checkpoint.weights,
            "{name}: to_weights is what was loaded"
        );
        let mut reference: Vec<Vec<f32>> =
            w0.tensors().iter().map(|(_, t)| t.data.clone()).collect();
        let mut m: Vec<Vec<f32>> = reference.iter().map(|p| vec![0.0; p.len()]).collect();
        let mut v = m.clone();
        let norm = host_grads
            .iter()
            .flatten()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum::<f64>()
            .sqrt();
        let max_norm = (norm / 4.0) as f32;
        let lr = 1e-3;
        let cpu_cfg = ares_cpu::ops::optim::AdamWConfig {
            beta1: CFG.beta1,
            beta2: CFG.beta2,
            eps: CFG.eps,
            weight_decay: CFG.weight_decay,
        };

        let mut opt = AdamW::new(&model, CFG).unwrap();
        for step in 1..=2u64 {
            let report = opt.step(&mut model, &grads, lr, Some(max_norm)).unwrap();
            assert!(report.applied);
            assert!(
                (f64::from(report.grad_norm) - norm).abs() <= 1e-6 * norm,
                "{name}"
            );
            assert_eq!(opt.step_count(), step);

            // ares-cpu on host copies: clip the same gradients, then one AdamW step each.
            let mut g = host_grads.clone();
            let mut views: Vec<&mut [f32]> = g.iter_mut().map(Vec::as_mut_slice).collect();
            clip_grad_norm(&mut views, max_norm).unwrap();
            let before = reference.clone();
            for (((p, g), m), v) in reference.iter_mut().zip(&g).zip(&mut m).zip(&mut v) {
                adamw_step(p, g, m, v, step, &cpu_cfg, lr).unwrap();
            }
            let ours = model.to_weights().unwrap();
            for ((n, t), want) in ours.tensors().iter().zip(&reference) {
                let err = rel_err(&t.data, want);
                assert!(err < 1e-6, "{name} step {step} {n}: {err:e}");
            }

            // By hand for the first step: m̂ = ĝ and v̂ = ĝ², so
            // θ₁ = θ₀·(1 − lr·wd) − lr·ĝ/(|ĝ| + ε) with ĝ = g·max_norm/(norm + 1e-6).
            if step == 1 {
                let scale = f64::from(max_norm) / (norm + 1e-6);
                for (((n, t), p0), g) in ours.tensors().iter().zip(&before).zip(&host_grads) {
                    for ((&p1, &p0), &g) in t.data.iter().zip(p0).zip(g) {
                        let gh = f64::from(g) * scale;
                        let want = f64::from(p0) * (1.0 - lr * CFG.weight_decay)
                            - lr * gh / (gh.abs() + CFG.eps);
                        let tol = 1e-6 * want.abs() + 2e-8;
                        assert!(
                            (f64::from(p1) - want).abs() <= tol,
                            "{name} {n}: {p1} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// The two moments of every parameter in a saved state, by tensor name.
fn state_tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.data().to_vec()))
        .collect();
    out.sort();
    out
}

#[test]
fn a_non_finite_gradient_changes_nothing() {
    let (_, mut model) = load("llama_tiny");
    let dir = tempfile::tempdir().unwrap();
    let mut opt = AdamW::new(&model, CFG).unwrap();
    let grads = loss_grads(&model, "llama_tiny");
    opt.step(&mut model, &grads, 1e-3, Some(1.0)).unwrap();
    let before = dir.path().join("before.safetensors");
    opt.save(&model, &before).unwrap();
    let weights = model.to_weights().unwrap();

    // NaN in ∂L/∂logits reaches every gradient.
    let s = batch("llama_tiny", "right");
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    let be = model.backend();
    let mut dlogits = be.alloc(s.batch * s.seq * model.spec().vocab).unwrap();
    let mut host = vec![0.0f32; dlogits.len()];
    host[5] = f32::NAN;
    be.upload(&host, ViewMut::whole(&mut dlogits)).unwrap();
    let mut nan_grads = model.grads().unwrap();
    model
        .backward(
            &s.inputs(),
            &mut acts,
            View::whole(&dlogits),
            &mut nan_grads,
        )
        .unwrap();
    let report = opt.step(&mut model, &nan_grads, 1e-3, Some(1.0)).unwrap();
    assert!(!report.applied && report.grad_norm.is_nan(), "{report:?}");
    assert_eq!(opt.step_count(), 1);
    assert_eq!(model.to_weights().unwrap(), weights);
    let after = dir.path().join("after.safetensors");
    opt.save(&model, &after).unwrap();
    assert_eq!(state_tensors(&before), state_tensors(&after));

    // The next finite step goes through as the second update.
    let report = opt.step(&mut model, &grads, 1e-3, None).unwrap();
    assert!(report.applied && report.grad_norm.is_finite());
    assert_eq!(opt.step_count(), 2);
}

#[test]
fn optimizer_state_round_trips_exactly() {
    for name in ["qwen2_tiny", "qwen3_tiny"] {
        let (checkpoint, mut model) = load(name);
        let grads = loss_grads(&model, name);
        let mut opt = AdamW::new(&model, CFG).unwrap();
        for _ in 0..2 {
            opt.step(&mut model, &grads, 1e-3, Some(1.0)).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optimizer.safetensors");
        opt.save(&model, &path).unwrap();
        // Only the file itself is left in the directory (the temporary was renamed).
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

        // A second model with the same weights, and the state loaded from disk.
        let mut twin =
            Model::new(CpuBackend, &checkpoint.config, &model.to_weights().unwrap()).unwrap();
        let mut loaded = AdamW::load(&twin, CFG, &path).unwrap();
        assert_eq!(loaded.step_count(), 2);
        let again = dir.path().join("again.safetensors");
        loaded.save(&twin, &again).unwrap();
        assert_eq!(state_tensors(&path), state_tensors(&again));

        // The next step is the same on both.
        opt.step(&mut model, &grads, 2e-3, Some(1.0)).unwrap();
        loaded.step(&mut twin, &grads, 2e-3, Some(1.0)).unwrap();
        assert_eq!(
            model.to_weights().unwrap(),
            twin.to_weights().unwrap(),
            "{name}"
        );
    }
}

/// bf16 and 8-bit moments: saved in their own dtype, loaded bit for bit (the next step is
/// the same as without the round trip), and close to f32 moments' steps.
#[test]
fn low_memory_optimizer_states_round_trip_exactly() {
    let name = "qwen2_tiny";
    let (checkpoint, base) = load(name);
    let grads = loss_grads(&base, name);
    let start = base.to_weights().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let fresh = || Model::new(CpuBackend, &checkpoint.config, &start).unwrap();
    let mut reference = fresh();
    let mut f32_opt = AdamW::new(&reference, CFG).unwrap();
    for _ in 0..3 {
        f32_opt
            .step(&mut reference, &grads, 1e-3, Some(1.0))
            .unwrap();
    }
    let f32_bytes = f32_opt.moment_bytes();
    for dtype in [StateDtype::Bf16, StateDtype::Int8] {
        let mut model = fresh();
        let mut opt = AdamW::with_state_dtype(&model, CFG, dtype).unwrap();
        assert_eq!(opt.state_dtype(), dtype);
        for _ in 0..2 {
            opt.step(&mut model, &grads, 1e-3, Some(1.0)).unwrap();
        }
        let path = dir.path().join(format!("{dtype}.safetensors"));
        opt.save(&model, &path).unwrap();
        let tensors = state_tensors(&path);
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let want = if dtype == StateDtype::Bf16 {
            Dtype::BF16
        } else {
            Dtype::U8
        };
        let stored = st
            .tensors()
            .into_iter()
            .filter(|(_, t)| t.dtype() == want)
            .count();
        assert!(stored > 0, "{dtype}: no moment stored as {want:?}");

        let mut twin =
            Model::new(CpuBackend, &checkpoint.config, &model.to_weights().unwrap()).unwrap();
        let mut loaded = AdamW::load(&twin, CFG, &path).unwrap();
        assert_eq!((loaded.state_dtype(), loaded.step_count()), (dtype, 2));
        let again = dir.path().join(format!("{dtype}-again.safetensors"));
        loaded.save(&twin, &again).unwrap();
        assert_eq!(tensors, state_tensors(&again), "{dtype}");
        opt.step(&mut model, &grads, 1e-3, Some(1.0)).unwrap();
        loaded.step(&mut twin, &grads, 1e-3, Some(1.0)).unwrap();
        let got = model.to_weights().unwrap();
        assert_eq!(got, twin.to_weights().unwrap(), "{dtype}");

        // the moments' memory, and steps close to the f32 moments' (each step moves a
        // weight by about lr; the stored moments differ by a few per cent at most)
        let want: u64 = expected_tensors(&checkpoint.config)
            .iter()
            .map(|(_, shape)| dtype.moment_bytes(shape.iter().product()))
            .sum();
        assert_eq!(opt.moment_bytes(), want, "{dtype}");
        assert!(want < f32_bytes, "{dtype}: {want} of {f32_bytes}");
        // against the f32 run after the same three steps: the mean difference is a small
        // part of the mean distance travelled
        let (a, b) = (reference.to_weights().unwrap(), got);
        let (mut diff, mut moved, mut n) = (0.0f64, 0.0f64, 0usize);
        for (((_, x), (_, y)), (_, s0)) in a
            .tensors()
            .into_iter()
            .zip(b.tensors())
            .zip(start.tensors())
        {
            for ((u, v), w) in x.data.iter().zip(&y.data).zip(&s0.data) {
                diff += f64::from((u - v).abs());
                moved += f64::from((u - w).abs());
                n += 1;
            }
        }
        let (diff, moved) = (diff / n as f64, moved / n as f64);
        eprintln!("{dtype}: mean |Δ| {diff:.3e} against a mean step of {moved:.3e}");
        assert!(
            diff > 0.0 && diff < 0.05 * moved,
            "{dtype}: {diff} against {moved}"
        );
    }

    // an f32 state loaded as int8 is quantised as the int8 optimizer stores it
    let f32_path = dir.path().join("f32.safetensors");
    f32_opt.save(&reference, &f32_path).unwrap();
    let as_int8 = AdamW::load_as(&reference, CFG, StateDtype::Int8, &f32_path).unwrap();
    let int8_path = dir.path().join("from-f32.safetensors");
    as_int8.save(&reference, &int8_path).unwrap();
    let f32_bytes = std::fs::read(&f32_path).unwrap();
    let f32_st = SafeTensors::deserialize(&f32_bytes).unwrap();
    let q_bytes = std::fs::read(&int8_path).unwrap();
    let q_st = SafeTensors::deserialize(&q_bytes).unwrap();
    let embed = "model.embed_tokens.weight.exp_avg";
    let values: Vec<f32> = f32_st
        .tensor(embed)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let HostMoment::Int8 { codes, absmax } = HostMoment::encode(&values, StateDtype::Int8, false)
    else {
        panic!("the embedding is long enough to quantise");
    };
    assert_eq!(q_st.tensor(embed).unwrap().data(), codes.as_slice());
    let scales: Vec<u8> = absmax.iter().flat_map(|a| a.to_le_bytes()).collect();
    let key = format!("{embed}.absmax");
    assert_eq!(q_st.tensor(&key).unwrap().data(), scales.as_slice());
}

#[test]
fn optimizer_errors_name_the_problem() {
    let (_, mut qwen2) = load("qwen2_tiny");
    let (_, qwen3) = load("qwen3_tiny");
    let dir = tempfile::tempdir().unwrap();

    let bad_cfg = AdamWConfig { beta1: 1.0, ..CFG };
    let e = AdamW::new(&qwen2, bad_cfg).unwrap_err();
    assert!(
        matches!(e, ModelError::AdamWConfig(_)) && e.to_string().contains("beta1"),
        "{e}"
    );

    let mut opt = AdamW::new(&qwen2, CFG).unwrap();
    let grads = qwen2.grads().unwrap();
    for lr in [-1.0, f64::NAN] {
        let e = opt.step(&mut qwen2, &grads, lr, None).unwrap_err();
        assert!(e.to_string().contains("lr"), "{e}");
    }
    let e = opt
        .step(&mut qwen2, &grads, 1e-3, Some(f32::INFINITY))
        .unwrap_err();
    assert!(e.to_string().contains("max_grad_norm"), "{e}");
    // a sharded optimizer (ZeRO-1) holds only its share of the summed gradients: stepping
    // without every rank's sums is refused, not a partial norm; with them it steps
    let mut sharded = AdamW::new(&qwen2, CFG).unwrap();
    let n = qwen2.trainable_buffers().len();
    let owned: Vec<bool> = (0..n).map(|i| i % 2 == 0).collect();
    sharded.shard(qwen2.backend(), owned).unwrap();
    let e = sharded.step(&mut qwen2, &grads, 1e-3, None).unwrap_err();
    assert!(e.to_string().contains("step_with_sums"), "{e}");
    let sums = vec![0.0f64; n];
    let r = sharded
        .step_with_sums(&mut qwen2, &grads, &mut [], 1e-3, None, Some(&sums))
        .unwrap();
    assert!(r.applied);
    let foreign = qwen3.grads().unwrap();
    let e = opt.step(&mut qwen2, &foreign, 1e-3, None).unwrap_err();
    assert!(
        matches!(e, ModelError::LayoutMismatch { what: "gradients" }),
        "{e}"
    );
    assert_eq!(opt.step_count(), 0);

    let missing = dir.path().join("missing.safetensors");
    let e = AdamW::load(&qwen2, CFG, &missing).unwrap_err();
    assert!(
        matches!(e, ModelError::Io { .. }) && e.to_string().contains("missing.safetensors"),
        "{e}"
    );

    // qwen2's state does not fit qwen3 (another architecture, other tensors).
    let path = dir.path().join("qwen2.safetensors");
    opt.save(&qwen2, &path).unwrap();
    let e = AdamW::load(&qwen3, CFG, &path).unwrap_err();
    assert!(matches!(e, ModelError::OptimizerState { .. }), "{e}");
    assert!(e.to_string().contains("another model"), "{e}");
    let e = opt.save(&qwen3, &path).unwrap_err();
    assert!(matches!(e, ModelError::LayoutMismatch { .. }), "{e}");

    // A safetensors file that is not an optimizer state.
    let weights = fixture("qwen2_tiny").join("model.safetensors");
    let e = AdamW::load(&qwen2, CFG, &weights).unwrap_err();
    assert!(e.to_string().contains("format"), "{e}");

    // A state with a moment missing, and one with a negative second moment.
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec(), t.data().to_vec()))
        .collect();
    let write = |tensors: &[(String, Vec<usize>, Vec<u8>)], file: &str| {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, s, d)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), d).unwrap(),
                )
            })
            .collect();
        let p = dir.path().join(file);
        safetensors::serialize_to_file(views, meta.clone(), &p).unwrap();
        p
    };
    let i = tensors
        .iter()
        .position(|t| t.0 == "model.norm.weight.exp_avg_sq")
        .unwrap();
    tensors[i].2[..4].copy_from_slice(&(-1.0f32).to_le_bytes());
    let p = write(&tensors, "negative.safetensors");
    let e = AdamW::load(&qwen2, CFG, &p).unwrap_err();
    assert!(
        e.to_string().contains("model.norm.weight.exp_avg_sq"),
        "{e}"
    );
    tensors.remove(i);
    let p = write(&tensors, "short.safetensors");
    let e = AdamW::load(&qwen2, CFG, &p).unwrap_err();
    assert!(
        e.to_string()
            .contains("`model.norm.weight.exp_avg_sq` is missing"),
        "{e}"
    );
}

// ----- Weights back to the host, and checkpoints. -----

#[test]
fn to_weights_returns_what_was_loaded() {
    for name in MODELS {
        let (checkpoint, model) = load(name);
        assert_eq!(model.to_weights().unwrap(), checkpoint.weights, "{name}");
        assert_eq!(model.config(), &checkpoint.config, "{name}");
    }
}

#[test]
fn a_trained_model_saves_and_reloads_with_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    for name in MODELS {
        let (checkpoint, mut model) = load(name);
        let grads = loss_grads(&model, name);
        let mut opt = AdamW::new(&model, CFG).unwrap();
        assert!(
            opt.step(&mut model, &grads, 1e-2, Some(1.0))
                .unwrap()
                .applied
        );
        let trained = model.to_weights().unwrap();
        assert_ne!(
            trained, checkpoint.weights,
            "{name}: the step changed nothing"
        );

        let out = dir.path().join(name);
        model
            .save_pretrained(
                &out,
                model.config(),
                checkpoint.generation.as_ref(),
                SaveDtype::F32,
            )
            .unwrap();
        let reloaded = Checkpoint::load(&out).unwrap();
        assert_eq!(reloaded.weights, trained, "{name}");
        assert_eq!(reloaded.generation, checkpoint.generation, "{name}");
        let again = Model::from_checkpoint(CpuBackend, &reloaded).unwrap();
        for set in ["right", "left"] {
            let s = batch(name, set);
            assert_eq!(
                again.forward_logits(&s.inputs()).unwrap(),
                model.forward_logits(&s.inputs()).unwrap(),
                "{name} {set}"
            );
        }

        // bf16: every weight rounded once, to nearest even.
        model
            .save_pretrained(&out, model.config(), None, SaveDtype::Bf16)
            .unwrap();
        let half = Checkpoint::load(&out).unwrap();
        assert_eq!(half.config.dtype.as_deref(), Some("bfloat16"));
        assert_eq!(half.generation, None);
        for ((n, a), (_, b)) in half.weights.tensors().iter().zip(trained.tensors()) {
            for (&x, &y) in a.data.iter().zip(&b.data) {
                assert_eq!(x, half::bf16::from_f32(y).to_f32(), "{name} {n}");
            }
        }
    }
}

#[test]
fn saving_with_the_config_of_another_model_is_an_error() {
    let (_, model) = load("qwen2_tiny");
    let (other, _) = load("qwen3_tiny");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let e = model
        .save_pretrained(&out, &other.config, None, SaveDtype::F32)
        .unwrap_err();
    assert!(matches!(e, ModelError::ConfigMismatch { .. }), "{e}");
    assert!(e.to_string().contains("architecture"), "{e}");
    assert!(!out.exists());
    // Other token ids are fine.
    let mut config = model.config().clone();
    config.eos_token_ids = vec![3, 4];
    model
        .save_pretrained(&out, &config, None, SaveDtype::F32)
        .unwrap();
    assert_eq!(Checkpoint::load(&out).unwrap().config.eos_token_ids, [3, 4]);
}

#[test]
fn a_frozen_reference_model_is_built_from_the_same_weights() {
    let (checkpoint, mut policy) = load("qwen3_tiny");
    let reference = Model::new(CpuBackend, policy.config(), &policy.to_weights().unwrap()).unwrap();
    let grads = loss_grads(&policy, "qwen3_tiny");
    let mut opt = AdamW::new(&policy, CFG).unwrap();
    opt.step(&mut policy, &grads, 1e-2, None).unwrap();
    assert_eq!(reference.to_weights().unwrap(), checkpoint.weights);
    assert_ne!(policy.to_weights().unwrap(), checkpoint.weights);
}

// ----- Round trip through transformers (scripts/check_train_roundtrip.py). -----

/// Little-endian bytes of i64 values (the fixtures' id dtype).
fn i64_bytes(values: &[u32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| i64::from(v).to_le_bytes())
        .collect()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Trains every fixture one step (the loss head on the left-padded set, AdamW with
/// clipping) and writes, per fixture, the checkpoint and what
/// `scripts/check_train_roundtrip.py` compares: the logits after the step on both input
/// sets, and the training batch and hyper-parameters so the script can redo the step in
/// PyTorch. Run:
///
/// ```text
/// ARES_TRAIN_ROUNDTRIP_DIR=/tmp/ares_train_rt cargo test -p ares-model --test model_train -- --ignored write_train_roundtrip
/// /tmp/pyenv/bin/python scripts/check_train_roundtrip.py /tmp/ares_train_rt
/// ```
#[test]
#[ignore = "writes a directory for scripts/check_train_roundtrip.py (needs Python + transformers)"]
fn write_train_roundtrip() {
    let root = PathBuf::from(
        std::env::var("ARES_TRAIN_ROUNDTRIP_DIR")
            .unwrap_or_else(|_| "/tmp/ares_train_roundtrip".into()),
    );
    let (temperature, lr, max_grad_norm) = (0.8f32, 1e-3f64, 1.0f32);
    for name in MODELS {
        let (checkpoint, mut model) = load(name);
        let s = batch(name, "left");
        let mut acts = model.activations(s.batch, s.seq).unwrap();
        model.forward(&s.inputs(), &mut acts).unwrap();
        let mut grads = model.grads().unwrap();
        model
            .backward_from_log_prob_grads(
                &s.inputs(),
                &mut acts,
                &s.targets,
                &s.coeffs,
                temperature,
                &mut grads,
            )
            .unwrap();
        let mut opt = AdamW::new(&model, CFG).unwrap();
        let report = opt
            .step(&mut model, &grads, lr, Some(max_grad_norm))
            .unwrap();
        assert!(report.applied);

        let out = root.join(name);
        model
            .save_pretrained(
                &out.join("checkpoint"),
                model.config(),
                checkpoint.generation.as_ref(),
                SaveDtype::F32,
            )
            .unwrap();
        let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let shape = vec![s.batch, s.seq];
        for set in ["right", "left"] {
            let b = batch(name, set);
            let logits = model.forward_logits(&b.inputs()).unwrap();
            let ids = [
                ("input_ids", &b.input_ids),
                ("attention_mask", &b.attention_mask),
                ("position_ids", &b.position_ids),
            ];
            for (what, v) in ids {
                tensors.push((
                    format!("{set}.{what}"),
                    Dtype::I64,
                    shape.clone(),
                    i64_bytes(v),
                ));
            }
            let vocab = model.spec().vocab;
            tensors.push((
                format!("{set}.logits"),
                Dtype::F32,
                vec![b.batch, b.seq, vocab],
                f32_bytes(&logits),
            ));
        }
        let train = [
            ("input_ids", &s.input_ids),
            ("attention_mask", &s.attention_mask),
            ("position_ids", &s.position_ids),
            ("targets", &s.targets),
        ];
        for (what, v) in train {
            tensors.push((
                format!("train.{what}"),
                Dtype::I64,
                shape.clone(),
                i64_bytes(v),
            ));
        }
        tensors.push((
            "train.coeffs".into(),
            Dtype::F32,
            shape.clone(),
            f32_bytes(&s.coeffs),
        ));
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, dt, shape, bytes)| {
                let view = safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes).unwrap();
                (n.clone(), view)
            })
            .collect();
        let meta: std::collections::HashMap<String, String> = [
            ("fixture", name.to_string()),
            ("temperature", temperature.to_string()),
            ("lr", lr.to_string()),
            ("beta1", CFG.beta1.to_string()),
            ("beta2", CFG.beta2.to_string()),
            ("eps", CFG.eps.to_string()),
            ("weight_decay", CFG.weight_decay.to_string()),
            ("max_grad_norm", max_grad_norm.to_string()),
            ("grad_norm", report.grad_norm.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        safetensors::serialize_to_file(views, Some(meta), &out.join("expected.safetensors"))
            .unwrap();
    }
    println!("wrote {}", root.display());
}
