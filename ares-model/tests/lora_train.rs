//! LoRA training on the CPU backend (`model/lora.rs`): with the adapters off the model is
//! the base model bit for bit; the pairs' gradients are the full model's gradient at the
//! merged weights projected onto the `B·A` parametrisation, and match finite differences;
//! checkpointed gradients are the stored ones bit for bit; AdamW moves the pairs only and
//! its state round-trips exactly; generation (adapters merged into the decode weights)
//! equals the merged model's.

use std::collections::BTreeMap;

use ares_model::backend::Backend;
use ares_model::backend::cpu::CpuBackend;
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::hf::lora::{LoraAdapter, LoraConfig, LoraPair, TARGETS, weight_name};
use ares_model::model::{
    AdamW, AdamWConfig, GenerateRequest, Grads, Model, ModelError, Sampling, StateDtype,
};

mod common;
use common::{Batch, batch, fixture, rel_err};

const MODELS: [&str; 3] = ["qwen2_tiny", "qwen3_tiny", "llama_tiny"];

fn load(name: &str) -> (Checkpoint, Model<CpuBackend>) {
    let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
    (checkpoint, model)
}

fn config(r: usize, targets: &[&str], layers: Option<Vec<usize>>) -> LoraConfig {
    LoraConfig {
        r,
        lora_alpha: 2.0 * r as f64,
        use_rslora: false,
        target_modules: targets.iter().map(|t| t.to_string()).collect(),
        layers_to_transform: layers,
        exclude_modules: None,
    }
}

/// An adapter with every pair drawn at random (`B` too, so it changes the model).
fn random_adapter(checkpoint: &Checkpoint, config: LoraConfig, seed: u64) -> LoraAdapter {
    let shapes: BTreeMap<String, Vec<usize>> = checkpoint
        .weights
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.shape.clone()))
        .collect();
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
    };
    let mut pairs = BTreeMap::new();
    let layers = checkpoint.config.num_hidden_layers;
    for l in 0..layers {
        for t in TARGETS {
            if !config.adapts(l, t) {
                continue;
            }
            let name = weight_name(l, t);
            let (out, inp) = (shapes[&name][0], shapes[&name][1]);
            let a = (0..config.r * inp).map(|_| next()).collect();
            let b = (0..out * config.r).map(|_| next()).collect();
            pairs.insert(
                name,
                LoraPair {
                    a,
                    b,
                    out_in: [out, inp],
                    kernel: Vec::new(),
                },
            );
        }
    }
    LoraAdapter {
        config,
        pairs,
        language_model: false,
    }
}

fn logits(model: &Model<CpuBackend>, b: &Batch) -> Vec<u32> {
    let l = model.forward_logits(&b.inputs()).unwrap();
    l.iter().map(|x| x.to_bits()).collect()
}

/// `L = Σ coeff · logπ(target)` and (when `grads`) its gradient added into `grads`.
fn loss(model: &Model<CpuBackend>, b: &Batch, grads: Option<&mut Grads<CpuBackend>>) -> f64 {
    let mut acts = model.activations(b.batch, b.seq).unwrap();
    model.forward(&b.inputs(), &mut acts).unwrap();
    model.log_prob_entropy(&mut acts, &b.targets, 1.0).unwrap();
    let mut logp = vec![0.0; b.tokens()];
    model
        .backend()
        .download(acts.log_probs(), &mut logp)
        .unwrap();
    if let Some(g) = grads {
        model
            .backward_from_log_prob_grads(&b.inputs(), &mut acts, &b.targets, &b.coeffs, 1.0, g)
            .unwrap();
    }
    logp.iter()
        .zip(&b.coeffs)
        .map(|(&l, &c)| f64::from(l) * f64::from(c))
        .sum()
}

#[test]
fn adapters_off_is_the_base_model_bit_for_bit() {
    for name in MODELS {
        let (checkpoint, base) = load(name);
        let b = batch(name, "left");
        let want = logits(&base, &b);

        // fresh pairs (B = 0) change nothing
        let mut fresh = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
        fresh.add_lora(&config(4, &TARGETS, None), 7).unwrap();
        assert_eq!(logits(&fresh, &b), want, "{name}: a fresh adapter");

        let mut model = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
        let adapter = random_adapter(&checkpoint, config(4, &TARGETS, None), 3);
        model.load_lora(&adapter).unwrap();
        assert!(model.adapters_active());
        assert_ne!(
            logits(&model, &b),
            want,
            "{name}: the adapter changes the model"
        );
        {
            let _off = model.adapters_off();
            assert!(!model.adapters_active());
            assert_eq!(logits(&model, &b), want, "{name}: adapters off");
        }
        assert!(model.adapters_active(), "the guard turns them back on");

        // and the merged model is the adapted one, up to the order of the sums
        let mut merged = checkpoint.clone();
        adapter.merge_into(&mut merged.weights).unwrap();
        let merged = Model::from_checkpoint(CpuBackend, &merged).unwrap();
        let (ours, theirs) = (
            model.forward_logits(&b.inputs()).unwrap(),
            merged.forward_logits(&b.inputs()).unwrap(),
        );
        let err = rel_err(&ours, &theirs);
        assert!(err < 1e-5, "{name}: adapted vs merged logits {err:e}");
    }
}

/// `y = x·(W + s·B·A)ᵀ`: `∂L/∂B = s·G·Aᵀ` and `∂L/∂A = s·Bᵀ·G` with `G = ∂L/∂W` at the
/// merged weights.
#[test]
fn adapter_gradients_are_the_full_gradient_projected() {
    for name in MODELS {
        let (checkpoint, mut model) = load(name);
        let b = batch(name, "right");
        let cfg = config(3, &TARGETS, None);
        let adapter = random_adapter(&checkpoint, cfg.clone(), 11);
        model.load_lora(&adapter).unwrap();
        let mut grads = model.grads().unwrap();
        loss(&model, &b, Some(&mut grads));

        let mut merged = checkpoint.clone();
        adapter.merge_into(&mut merged.weights).unwrap();
        let full = Model::from_checkpoint(CpuBackend, &merged).unwrap();
        let mut full_grads = full.grads().unwrap();
        loss(&full, &b, Some(&mut full_grads));

        let (r, s) = (cfg.r, cfg.scale());
        for (weight, pair) in &adapter.pairs {
            let [out, inp] = pair.out_in;
            let g = full_grads.download(full.backend(), weight).unwrap();
            let mut want_b = vec![0.0f32; out * r];
            let mut want_a = vec![0.0f32; r * inp];
            for o in 0..out {
                for k in 0..r {
                    let mut db = 0.0f64;
                    for i in 0..inp {
                        db += f64::from(g[o * inp + i]) * f64::from(pair.a[k * inp + i]);
                    }
                    want_b[o * r + k] = (s * db) as f32;
                }
            }
            for k in 0..r {
                for i in 0..inp {
                    let mut da = 0.0f64;
                    for o in 0..out {
                        da += f64::from(pair.b[o * r + k]) * f64::from(g[o * inp + i]);
                    }
                    want_a[k * inp + i] = (s * da) as f32;
                }
            }
            let stem = weight.trim_end_matches(".weight");
            let got_a = grads
                .download(model.backend(), &format!("{stem}.lora_A.weight"))
                .unwrap();
            let got_b = grads
                .download(model.backend(), &format!("{stem}.lora_B.weight"))
                .unwrap();
            let (ea, eb) = (rel_err(&got_a, &want_a), rel_err(&got_b, &want_b));
            assert!(
                ea < 1e-4 && eb < 1e-4,
                "{name} {weight}: A {ea:e}, B {eb:e}"
            );
        }
        // the base weights have no gradient
        let e = grads
            .download(model.backend(), "model.layers.0.self_attn.q_proj.weight")
            .unwrap_err();
        assert!(matches!(e, ModelError::UnknownParameter { .. }), "{e}");
    }
}

#[test]
fn adapter_gradients_match_finite_differences() {
    let name = "qwen3_tiny";
    let (checkpoint, mut model) = load(name);
    let b = batch(name, "left");
    let adapter = random_adapter(
        &checkpoint,
        config(2, &["q_proj", "v_proj", "down_proj"], None),
        5,
    );
    model.load_lora(&adapter).unwrap();
    let mut grads = model.grads().unwrap();
    loss(&model, &b, Some(&mut grads));
    for (weight, which) in [
        ("model.layers.0.self_attn.q_proj.weight", "A"),
        ("model.layers.1.self_attn.v_proj.weight", "B"),
        ("model.layers.1.mlp.down_proj.weight", "A"),
        ("model.layers.0.mlp.down_proj.weight", "B"),
    ] {
        let stem = weight.trim_end_matches(".weight");
        let analytic = grads
            .download(model.backend(), &format!("{stem}.lora_{which}.weight"))
            .unwrap();
        let (idx, &g) = analytic
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap();
        let h = 1e-2f32;
        let at = |delta: f32| {
            let mut a = adapter.clone();
            let p = a.pairs.get_mut(weight).unwrap();
            match which {
                "A" => p.a[idx] += delta,
                _ => p.b[idx] += delta,
            }
            let mut m = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
            m.load_lora(&a).unwrap();
            loss(&m, &b, None)
        };
        let numeric = (at(h) - at(-h)) / (2.0 * f64::from(h));
        let err = (numeric - f64::from(g)).abs() / f64::from(g).abs();
        eprintln!("{weight} lora_{which}[{idx}]: analytic {g:.6}, numeric {numeric:.6}");
        assert!(err < 1e-2, "{weight} lora_{which}[{idx}]: {g} vs {numeric}");
    }
}

fn lora_grads(model: &Model<CpuBackend>, adapter: &LoraAdapter, b: &Batch) -> Vec<Vec<u32>> {
    let mut grads = model.grads().unwrap();
    loss(model, b, Some(&mut grads));
    let mut out = Vec::new();
    for weight in adapter.pairs.keys() {
        let stem = weight.trim_end_matches(".weight");
        for which in ["A", "B"] {
            let g = grads
                .download(model.backend(), &format!("{stem}.lora_{which}.weight"))
                .unwrap();
            out.push(g.iter().map(|x| x.to_bits()).collect());
        }
    }
    out
}

#[test]
fn checkpointed_lora_gradients_are_the_stored_ones_bit_for_bit() {
    for name in MODELS {
        let (checkpoint, mut model) = load(name);
        let adapter = random_adapter(&checkpoint, config(4, &TARGETS, None), 9);
        model.load_lora(&adapter).unwrap();
        for set in ["right", "left"] {
            let b = batch(name, set);
            model.set_gradient_checkpointing(false);
            let stored = lora_grads(&model, &adapter, &b);
            model.set_gradient_checkpointing(true);
            let recomputed = lora_grads(&model, &adapter, &b);
            assert!(stored.iter().flatten().any(|&x| x != 0));
            assert_eq!(stored, recomputed, "{name} {set}");
        }
    }
}

/// The layer watcher under LoRA: each layer's pairs handed over once they are final.
#[test]
fn each_layer_s_adapter_gradients_are_handed_over_once_final() {
    for name in MODELS {
        let (checkpoint, mut model) = load(name);
        let adapter = random_adapter(&checkpoint, config(4, &TARGETS, None), 9);
        model.load_lora(&adapter).unwrap();
        let b = batch(name, "left");
        let mut grads = model.grads().unwrap();
        let layers = model.spec().layers;
        common::check_layer_watch(model.backend(), layers, &mut grads, |g| {
            loss(&model, &b, Some(g));
        });
    }
}

/// Two AdamW steps; with `save_between`, the optimizer saved after the first and a fresh
/// one loaded from the file for the second. Returns the adapter after both.
fn two_steps(name: &str, dtype: StateDtype, save_between: bool) -> (LoraAdapter, Vec<u32>) {
    let (checkpoint, mut model) = load(name);
    let b = batch(name, "left");
    let base = logits(&model, &b);
    model.add_lora(&config(4, &TARGETS, None), 21).unwrap();
    let cfg = AdamWConfig::default();
    let mut opt = AdamW::with_state_dtype(&model, cfg, dtype).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("optimizer.safetensors");
    for step in 0..2 {
        if step == 1 && save_between {
            opt.save(&model, &path).unwrap();
            opt = AdamW::load_as(&model, cfg, dtype, &path).unwrap();
            assert_eq!(opt.step_count(), 1);
        }
        let mut grads = model.grads().unwrap();
        loss(&model, &b, Some(&mut grads));
        let report = opt.step(&mut model, &grads, 1e-2, Some(1.0)).unwrap();
        assert!(report.applied && report.grad_norm > 0.0);
    }
    // the base weights did not move
    {
        let _off = model.adapters_off();
        assert_eq!(logits(&model, &b), base, "{name}: the base is frozen");
    }
    drop(checkpoint);
    (model.lora_adapter().unwrap().unwrap(), logits(&model, &b))
}

#[test]
fn adamw_trains_the_adapters_only_and_resumes_exactly() {
    for dtype in [StateDtype::F32, StateDtype::Int8] {
        let (straight, l1) = two_steps("qwen2_tiny", dtype, false);
        let (resumed, l2) = two_steps("qwen2_tiny", dtype, true);
        assert_eq!(straight, resumed, "{dtype}: resume");
        assert_eq!(l1, l2);
        assert!(
            straight
                .pairs
                .values()
                .any(|p| p.b.iter().any(|&x| x != 0.0)),
            "{dtype}: B moved off zero"
        );
    }
}

#[test]
fn generation_merges_the_adapters() {
    for name in MODELS {
        let (checkpoint, mut model) = load(name);
        let adapter = random_adapter(&checkpoint, config(4, &TARGETS, None), 13);
        model.load_lora(&adapter).unwrap();
        let mut merged = checkpoint.clone();
        adapter.merge_into(&mut merged.weights).unwrap();
        let merged = Model::from_checkpoint(CpuBackend, &merged).unwrap();
        let request = GenerateRequest {
            prompts: vec![vec![3, 17, 5], vec![9, 2]],
            max_new_tokens: 6,
            eos_ids: Vec::new(),
            sampling: Sampling::Greedy,
            seed: 1,
        };
        let ours = model.generate(&request).unwrap();
        let theirs = merged.generate(&request).unwrap();
        assert_eq!(ours.tokens, theirs.tokens, "{name}");
        let lp = |o: &ares_model::model::GenerateOutput| o.log_probs.concat();
        let err = rel_err(&lp(&ours), &lp(&theirs));
        assert!(err < 1e-4, "{name}: log-probs {err:e}");
        // adapters off: the base model's tokens
        let base = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
        let _off = model.adapters_off();
        assert_eq!(
            model.generate(&request).unwrap().tokens,
            base.generate(&request).unwrap().tokens
        );
    }
}

/// `Model::merge_lora` gives the merged model `LoraAdapter::merge_into` makes on the host
/// (the same `W + s·B·A`, summed in another order) and leaves no adapters.
#[test]
fn merging_on_the_device_equals_merging_the_files() {
    for name in MODELS {
        let (checkpoint, mut model) = load(name);
        let adapter = random_adapter(&checkpoint, config(4, &TARGETS, None), 23);
        model.load_lora(&adapter).unwrap();
        let b = batch(name, "right");
        let adapted = model.forward_logits(&b.inputs()).unwrap();
        model.merge_lora().unwrap();
        assert!(model.lora_config().is_none() && !model.adapters_active());
        let mut host = checkpoint.clone();
        adapter.merge_into(&mut host.weights).unwrap();
        let ours = model.to_weights().unwrap();
        for ((n, a), (_, b)) in ours.tensors().iter().zip(host.weights.tensors()) {
            let err = rel_err(&a.data, &b.data);
            assert!(err < 1e-6, "{name} {n}: {err:e}");
        }
        let merged = model.forward_logits(&b.inputs()).unwrap();
        let err = rel_err(&merged, &adapted);
        assert!(err < 1e-5, "{name}: merged vs adapted logits {err:e}");
    }
}

/// Over linear weights stored in bf16, `merge_lora` merges in f32 and rounds the merged
/// weight to the nearest bf16: the host merge of the bf16 weights, rounded, within one bf16
/// ulp (the sums' order differs); the model stays in bf16 and generation reads the merged
/// weights.
#[test]
fn merging_into_bf16_weights_rounds_the_merged_weight() {
    use ares_model::backend::MatmulPrecision;
    use ares_model::model::WeightStorage;
    let round = |t: &mut [f32]| {
        t.iter_mut()
            .for_each(|x| *x = MatmulPrecision::Bf16.round(*x))
    };
    for name in MODELS {
        let (checkpoint, mut model) = load(name);
        model.set_weight_storage(WeightStorage::Bf16).unwrap();
        let adapter = random_adapter(&checkpoint, config(4, &TARGETS, None), 23);
        model.load_lora(&adapter).unwrap();
        model.merge_lora().unwrap();
        assert_eq!(model.weight_storage(), WeightStorage::Bf16);
        assert!(model.lora_config().is_none());
        let mut host = checkpoint.clone();
        let linear = |n: &str| n.ends_with("_proj.weight");
        for (n, t) in host.weights.tensors_mut() {
            if linear(&n) {
                round(&mut t.data);
            }
        }
        adapter.merge_into(&mut host.weights).unwrap();
        let ours = model.to_weights().unwrap();
        for ((n, a), (_, b)) in ours.tensors().iter().zip(host.weights.tensors()) {
            for (&x, &y) in a.data.iter().zip(&b.data) {
                let want = if linear(n) {
                    MatmulPrecision::Bf16.round(y)
                } else {
                    y
                };
                let ulp =
                    f32::from_bits((want.abs().to_bits() & 0xffff_0000) + 0x1_0000) - want.abs();
                assert!(
                    (x - want).abs() <= ulp.max(1e-30),
                    "{name} {n}: {x} vs {want}"
                );
            }
        }
        let request = GenerateRequest {
            prompts: vec![vec![1, 2, 3]],
            max_new_tokens: 4,
            eos_ids: vec![],
            sampling: Sampling::Greedy,
            seed: 0,
        };
        assert_eq!(model.generate(&request).unwrap().tokens[0].len(), 4);
    }
}

/// The memory plan's figure of the LoRA intermediates is what an arena allocates, stored
/// and checkpointed.
#[test]
fn lora_arena_elements_predict_the_allocation() {
    use ares_model::model::{ActLayout, HeadMode, ModelSpec, arena_elements, lora_arena_elements};
    for name in MODELS {
        let (checkpoint, mut model) = load(name);
        let spec = ModelSpec::from_config(&checkpoint.config).unwrap();
        let cfg = config(8, &["q_proj", "down_proj", "up_proj"], None);
        model.add_lora(&cfg, 1).unwrap();
        for checkpointed in [false, true] {
            model.set_gradient_checkpointing(checkpointed);
            let (batch, seq) = (3, 7);
            let acts = model.activations_full(batch, seq).unwrap();
            let kept = if checkpointed { 1 } else { spec.layers as u64 };
            let f32 = ActLayout::F32;
            let mut want =
                arena_elements(&spec, batch, seq, HeadMode::Full, checkpointed, f32).unwrap();
            want.f32s += lora_arena_elements(&spec, &cfg, (batch * seq) as u64, kept);
            assert_eq!(acts.elements(), want, "{name} checkpointed={checkpointed}");
        }
    }
}

#[test]
fn adapters_round_trip_through_peft_files() {
    let name = "llama_tiny";
    let (checkpoint, mut model) = load(name);
    let cfg = config(2, &["k_proj", "up_proj"], Some(vec![1]));
    let adapter = random_adapter(&checkpoint, cfg, 17);
    model.load_lora(&adapter).unwrap();
    let out = model.lora_adapter().unwrap().unwrap();
    assert_eq!(
        out, adapter,
        "layers outside layers_to_transform are left out"
    );
    let dir = tempfile::tempdir().unwrap();
    out.write(dir.path(), "base").unwrap();
    let back = LoraAdapter::read(dir.path(), &checkpoint.config).unwrap();
    assert_eq!(back, adapter);
}

#[test]
fn misuse_is_an_error() {
    let (checkpoint, mut model) = load("qwen2_tiny");
    let bad = |m: &mut Model<CpuBackend>, c: LoraConfig| m.add_lora(&c, 1).unwrap_err().to_string();
    assert!(bad(&mut model, config(0, &["q_proj"], None)).contains("r = 0"));
    assert!(bad(&mut model, config(2, &["lm_head"], None)).contains("lm_head"));
    assert!(bad(&mut model, config(2, &[], None)).contains("empty"));
    assert!(bad(&mut model, config(2, &["q_proj"], Some(vec![9]))).contains("layer 9"));
    model.add_lora(&config(2, &["q_proj"], None), 1).unwrap();
    assert!(bad(&mut model, config(2, &["q_proj"], None)).contains("already"));

    // a backward after a forward with the adapters off has nothing to train
    let b = batch("qwen2_tiny", "left");
    let mut acts = model.activations(b.batch, b.seq).unwrap();
    {
        let _off = model.adapters_off();
        model.forward(&b.inputs(), &mut acts).unwrap();
    }
    let mut grads = model.grads().unwrap();
    let e = model
        .backward_from_log_prob_grads(
            &b.inputs(),
            &mut acts,
            &b.targets,
            &b.coeffs,
            1.0,
            &mut grads,
        )
        .unwrap_err();
    assert!(matches!(e, ModelError::Lora { .. }), "{e}");

    // an arena planned before the adapters were added
    let mut plain = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
    let mut old = plain.activations(b.batch, b.seq).unwrap();
    plain.add_lora(&config(2, &["v_proj"], None), 1).unwrap();
    let e = plain.forward(&b.inputs(), &mut old).unwrap_err();
    assert!(e.to_string().contains("plan them again"), "{e}");

    // gradients of the full model do not fit the adapted one
    let full = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
    let mut wrong = full.grads().unwrap();
    let mut acts = plain.activations(b.batch, b.seq).unwrap();
    plain.forward(&b.inputs(), &mut acts).unwrap();
    let e = plain
        .backward_from_log_prob_grads(
            &b.inputs(),
            &mut acts,
            &b.targets,
            &b.coeffs,
            1.0,
            &mut wrong,
        )
        .unwrap_err();
    assert!(matches!(e, ModelError::LayoutMismatch { .. }), "{e}");
}
