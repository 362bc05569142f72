//! LoRA on the vision tower of Qwen2-VL / Qwen2.5-VL (`vision/lora.rs`) against peft 0.21.2
//! and transformers 5.24: adapters peft wrote (`scripts/make_lora_fixtures.py`,
//! `tests/fixtures/lora/qwen2_5_vl_all`: every linear layer but the LM head;
//! `qwen2_vl_tower`: the tower's qkv, attn.proj, fc1, merger mlp.0 and the patch
//! embedding's Conv3d, rsLoRA) give peft's logits with the adapter on and off, merge to
//! peft's weights, round-trip through PEFT files; the pairs' gradients are the full
//! model's gradient projected onto `B·A`, bit-identical under activation checkpointing;
//! training moves the pairs only.

mod common;

use std::path::{Path, PathBuf};

use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::{Backend, DeviceBuffer, View, ViewMut};
use ares_model::hf::lora::{LoraAdapter, LoraConfig};
use ares_model::model::{AdamW, AdamWConfig, Inputs, StateDtype};
use ares_model::vision::checkpoint::VlCheckpoint;
use ares_model::vision::model::VlModel;
use ares_model::vision::weights::param_table;
use common::vl::{Case, case, load};
use common::{f32s, rel_err};
use safetensors::SafeTensors;

/// Each peft adapter with the VL fixture model it was made on.
const CASES: [(&str, &str); 2] = [
    ("qwen2_5_vl_all", "qwen2_5_vl_tiny"),
    ("qwen2_vl_tower", "qwen2_vl_tiny"),
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/lora")
        .join(name)
}

fn adapter(name: &str, ck: &VlCheckpoint) -> LoraAdapter {
    LoraAdapter::read_vl(&fixture(name), &ck.config.text, &ck.config.vision).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn logits(m: &VlModel<CpuBackend>, cs: &Case) -> Vec<f32> {
    m.forward_logits(&cs.ids, &cs.mask, 1, &cs.vision).unwrap()
}

#[test]
fn peft_tower_adapters_give_peft_logits_and_merged_weights() {
    for (name, model) in CASES {
        let (ck, bytes) = load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let cs = case(&st, "image");
        let want_bytes = std::fs::read(fixture(name).join("expected.safetensors")).unwrap();
        let want = SafeTensors::deserialize(&want_bytes).unwrap();
        let a = adapter(name, &ck);
        assert!(a.language_model, "{name}: transformers 5 module names");
        assert!(
            a.pairs.keys().any(|k| k.starts_with("visual.blocks.")),
            "{name}: pairs on the tower"
        );

        let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        let base = logits(&m, &cs);
        m.load_lora(&a).unwrap();
        let on = logits(&m, &cs);
        let e = rel_err(&on, &f32s(&want, "image.logits"));
        assert!(e < 1e-4, "{name}: logits with the adapter, rel err {e:e}");
        {
            let _off = m.adapters_off();
            let off = logits(&m, &cs);
            assert_eq!(bits(&off), bits(&base), "{name}: adapters off = base");
            let e = rel_err(&off, &f32s(&want, "image.base_logits"));
            assert!(e < 1e-4, "{name}: base logits rel err {e:e}");
        }
        assert_eq!(bits(&logits(&m, &cs)), bits(&on), "{name}: on again");

        // merged on the host as peft's merge_and_unload
        let mut merged = ck.clone();
        a.merge_into(&mut merged.text).unwrap();
        a.merge_into_tower(&ck.config.vision, &mut merged.vision)
            .unwrap();
        let tower = merged.vision.named(&ck.config.vision);
        let text = merged.text.tensors();
        let mut checked = 0;
        for key in want.names() {
            let Some(param) = key.strip_prefix("merged.") else {
                continue;
            };
            let got: Vec<f32> = if let Some(t) = param.strip_prefix("model.visual.") {
                tower.iter().find(|(n, _, _)| n == t).unwrap().2.to_vec()
            } else {
                let t = param.replace("model.language_model.", "model.");
                text.iter().find(|(n, _)| *n == t).unwrap().1.data.clone()
            };
            let e = rel_err(&got, &f32s(&want, key));
            assert!(e < 1e-6, "{name} {param}: merged rel err {e:e}");
            checked += 1;
        }
        assert!(checked >= 4, "{name}: {checked} merged weights");

        // merged on the device: the same model
        m.merge_lora().unwrap();
        let e = rel_err(&logits(&m, &cs), &on);
        assert!(e < 1e-5, "{name}: merged model's logits rel err {e:e}");
    }
}

#[test]
fn tower_adapters_round_trip_through_peft_files() {
    for (name, model) in CASES {
        let (ck, _) = load(model);
        let a = adapter(name, &ck);
        let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        m.load_lora(&a).unwrap();
        let back = m.lora_adapter().unwrap().unwrap();
        assert_eq!(back, a, "{name}: downloaded adapter");
        let dir = tempfile::tempdir().unwrap();
        back.write(dir.path(), "base").unwrap();
        let again = LoraAdapter::read_vl(dir.path(), &ck.config.text, &ck.config.vision).unwrap();
        assert_eq!(again, a, "{name}: written and read back");
        // a text model's reader refuses the tower's pairs, naming one
        let err = LoraAdapter::read(dir.path(), &ck.config.text).unwrap_err();
        assert!(err.to_string().contains("vision tower"), "{err}");
    }
}

/// The tower's pair gradients (name → values) and the full model's weight gradients of
/// `Σ logits · W` on the `image` case.
fn tower_grads(m: &VlModel<CpuBackend>, st: &SafeTensors<'_>) -> Vec<(String, Vec<f32>)> {
    let be = m.backend();
    let cs = case(st, "image");
    let layout = m.layout(&cs.ids, &cs.mask, 1, &cs.vision).unwrap();
    let seq = cs.ids.len();
    let positions = layout.positions.axis(0).to_vec();
    let inputs = Inputs {
        batch: 1,
        seq,
        input_ids: &cs.ids,
        attention_mask: &cs.mask,
        position_ids: &positions,
    };
    let mut acts = m.lm().activations_full(1, seq).unwrap();
    let mut vl = m
        .forward(&inputs, &cs.vision, &layout, &mut acts, true)
        .unwrap();
    let w = f32s(st, "image.W");
    let mut dlogits = be.alloc(w.len()).unwrap();
    be.upload(&w, ViewMut::whole(&mut dlogits)).unwrap();
    let mut lm_grads = m.lm().grads().unwrap();
    let mut vg = m.tower().zero_grads(be).unwrap();
    m.backward(
        &inputs,
        &mut acts,
        &mut vl,
        View::whole(&dlogits),
        &mut lm_grads,
        Some(&mut vg),
    )
    .unwrap();
    let names = m.tower().trainable_names();
    let bufs = vg.buffers();
    assert_eq!(names.len(), bufs.len());
    names
        .into_iter()
        .zip(bufs)
        .map(|((n, _), b)| {
            let mut host = vec![0.0; b.len()];
            be.download(View::whole(b), &mut host).unwrap();
            (n, host)
        })
        .collect()
}

/// `a [m, k] · b [k, n]`.
fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = a[i * k + p];
            for j in 0..n {
                out[i * n + j] += x * b[p * n + j];
            }
        }
    }
    out
}

fn transpose(a: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; a.len()];
    for i in 0..rows {
        for j in 0..cols {
            out[j * rows + i] = a[i * cols + j];
        }
    }
    out
}

#[test]
fn tower_pair_gradients_are_the_full_gradient_projected() {
    for (name, model) in CASES {
        let (ck, bytes) = load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let a = adapter(name, &ck);
        let s = a.config.scale() as f32;
        let r = a.config.r;
        let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        m.load_lora(&a).unwrap();
        let pair_grads = tower_grads(&m, &st);

        // the full model at the merged weights: its gradient G projects to dA = s·Bᵀ·G,
        // dB = s·G·Aᵀ
        let mut merged = ck.clone();
        a.merge_into(&mut merged.text).unwrap();
        a.merge_into_tower(&ck.config.vision, &mut merged.vision)
            .unwrap();
        let full = VlModel::from_checkpoint(CpuBackend, &merged).unwrap();
        let full_grads = tower_grads(&full, &st);
        let cfg = &ck.config.vision;
        let mut checked = 0;
        for spec in param_table(cfg) {
            let stem = spec.name.trim_end_matches(".weight").replace("{}", "#");
            let find = |which: &str| {
                let n = format!("{stem}.lora_{which}.weight");
                pair_grads.iter().find(|(k, _)| *k == n).map(|(_, v)| v)
            };
            let (Some(ga), Some(gb)) = (find("A"), find("B")) else {
                continue;
            };
            let g = &full_grads
                .iter()
                .find(|(k, _)| *k == spec.name.replace("{}", "#"))
                .unwrap()
                .1;
            let (out, inp) = (spec.shape[0], spec.item() / spec.shape[0]);
            let blocks = if spec.per_block { cfg.depth } else { 1 };
            for l in 0..blocks {
                let pair = &a.pairs[&format!("visual.{}", spec.hf_name(l))];
                let gl = &g[l * out * inp..(l + 1) * out * inp];
                let mut want_a = matmul(&transpose(&pair.b, out, r), gl, r, out, inp);
                let mut want_b = matmul(gl, &transpose(&pair.a, r, inp), out, inp, r);
                want_a.iter_mut().chain(&mut want_b).for_each(|x| *x *= s);
                let got_a = &ga[l * r * inp..(l + 1) * r * inp];
                let got_b = &gb[l * out * r..(l + 1) * out * r];
                let (ea, eb) = (rel_err(got_a, &want_a), rel_err(got_b, &want_b));
                assert!(ea < 1e-4, "{name} {stem} block {l}: dA rel err {ea:e}");
                assert!(eb < 1e-4, "{name} {stem} block {l}: dB rel err {eb:e}");
                checked += 1;
            }
        }
        assert!(checked >= 5, "{name}: {checked} pairs checked");

        // activation checkpointing per block: the same gradients, bit for bit
        m.tower_mut().set_gradient_checkpointing(true);
        let again = tower_grads(&m, &st);
        for ((n, x), (_, y)) in pair_grads.iter().zip(&again) {
            assert_eq!(bits(x), bits(y), "{name} {n}: checkpointed");
        }
    }
}

#[test]
fn training_moves_the_pairs_only() {
    let (ck, bytes) = load("qwen2_5_vl_tiny");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let cs = case(&st, "image");
    let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    let base = logits(&m, &cs);
    m.add_lora(&LoraConfig::all_linear(4, 8.0), 7).unwrap();
    assert!(m.tower().has_lora());
    // fresh pairs (B = 0) change nothing
    assert_eq!(bits(&logits(&m, &cs)), bits(&base));
    let names: Vec<String> = m
        .tower()
        .trainable_names()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(!names.contains(&"patch_embed.proj.lora_A.weight".to_string()));
    assert!(names.contains(&"blocks.#.attn.qkv.lora_B.weight".to_string()));
    assert!(names.contains(&"merger.mlp.2.lora_A.weight".to_string()));

    let be = CpuBackend;
    let grads = tower_grads(&m, &st);
    let nonzero = grads
        .iter()
        .filter(|(n, g)| n.contains("lora_B") && g.iter().any(|&x| x != 0.0))
        .count();
    assert_eq!(nonzero, grads.len() / 2, "every B gets a gradient");

    // one AdamW step over both parts' pairs: the base weights do not move
    let seq = cs.ids.len();
    let layout = m.layout(&cs.ids, &cs.mask, 1, &cs.vision).unwrap();
    let positions = layout.positions.axis(0).to_vec();
    let inputs = Inputs {
        batch: 1,
        seq,
        input_ids: &cs.ids,
        attention_mask: &cs.mask,
        position_ids: &positions,
    };
    let mut acts = m.lm().activations_full(1, seq).unwrap();
    let mut vl = m
        .forward(&inputs, &cs.vision, &layout, &mut acts, true)
        .unwrap();
    let w = f32s(&st, "image.W");
    let mut dlogits = be.alloc(w.len()).unwrap();
    be.upload(&w, ViewMut::whole(&mut dlogits)).unwrap();
    let mut lm_grads = m.lm().grads().unwrap();
    let mut vg = m.tower().zero_grads(&be).unwrap();
    assert!(vg.get(ares_model::vision::weights::Slot::Qkv).is_none());
    m.backward(
        &inputs,
        &mut acts,
        &mut vl,
        View::whole(&dlogits),
        &mut lm_grads,
        Some(&mut vg),
    )
    .unwrap();
    let mut opt = AdamW::new(m.lm(), AdamWConfig::default()).unwrap();
    let mut moments = m.vision_moments(StateDtype::Int8).unwrap();
    let report = m
        .optimizer_step(&mut opt, &lm_grads, Some((&mut moments, &vg)), 1e-3, None)
        .unwrap();
    assert!(report.applied);
    let after = m.to_checkpoint(&ck).unwrap();
    assert_eq!(after.vision, ck.vision, "tower weights frozen");
    assert_eq!(after.text, ck.text, "language model weights frozen");
    let moved = logits(&m, &cs);
    assert!(rel_err(&moved, &base) > 1e-6, "the pairs moved");
    {
        let _off = m.adapters_off();
        assert_eq!(bits(&logits(&m, &cs)), bits(&base), "reference = base");
    }

    // the tower's moments save and load exactly (the pairs' names)
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vision_optimizer.safetensors");
    moments.save(&be, m.tower(), &path).unwrap();
    let back = ares_model::vision::model::VisionMoments::load(&be, m.tower(), StateDtype::Int8, &path)
        .unwrap();
    let again = dir.path().join("again.safetensors");
    back.save(&be, m.tower(), &again).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(&again).unwrap());
    // a full fine-tuning tower cannot load the pairs' moments
    let plain = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    let err = ares_model::vision::model::VisionMoments::load(
        &be,
        plain.tower(),
        StateDtype::Int8,
        &path,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("patch_embed.proj"), "{err}");
}

#[test]
fn tower_settings_are_checked() {
    let (ck, _) = load("qwen2_5_vl_tiny");
    // the language model only: exclude_modules names the tower
    let mut lm_only = LoraConfig::all_linear(2, 4.0);
    lm_only.exclude_modules = Some(".*visual.*".into());
    let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    m.add_lora(&lm_only, 1).unwrap();
    assert!(!m.tower().has_lora());
    let adapter = m.lora_adapter().unwrap().unwrap();
    assert!(adapter.pairs.keys().all(|k| k.starts_with("model.layers.")));

    // the tower only
    let tower_only = LoraConfig {
        target_modules: vec!["qkv".into(), "mlp.2".into()],
        ..LoraConfig::all_linear(2, 4.0)
    };
    let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    m.add_lora(&tower_only, 1).unwrap();
    assert!(m.tower().has_lora());
    let adapter = m.lora_adapter().unwrap().unwrap();
    assert_eq!(adapter.pairs.len(), ck.config.vision.depth + 1);

    // layers_to_transform with pairs on the tower: refused, naming the way out
    let mut layered = LoraConfig::all_linear(2, 4.0);
    layered.layers_to_transform = Some(vec![0]);
    let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    let err = m.add_lora(&layered, 1).unwrap_err().to_string();
    assert!(err.contains("exclude_modules"), "{err}");

    // nothing selected
    let none = LoraConfig {
        target_modules: vec!["qkv".into()],
        exclude_modules: Some(".*visual.*".into()),
        ..LoraConfig::all_linear(2, 4.0)
    };
    let err = m.add_lora(&none, 1).unwrap_err().to_string();
    assert!(err.contains("selects no linear layer"), "{err}");

    // a text model: tower names alone select nothing of its decoder
    let text = ares_model::hf::checkpoint::Checkpoint::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen2_tiny"),
    )
    .unwrap();
    let mut lm = ares_model::model::Model::from_checkpoint(CpuBackend, &text).unwrap();
    let err = lm
        .add_lora(
            &LoraConfig {
                target_modules: vec!["fc1".into()],
                ..LoraConfig::all_linear(2, 4.0)
            },
            1,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("selects no linear layer of the decoder"), "{err}");
    // all-linear on a text model is its decoder's seven
    lm.add_lora(&LoraConfig::all_linear(2, 4.0), 1).unwrap();
    let adapter = lm.lora_adapter().unwrap().unwrap();
    assert_eq!(adapter.pairs.len(), 7 * text.config.num_hidden_layers);
}
