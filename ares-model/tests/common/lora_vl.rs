//! LoRA on the vision tower against peft 0.21.2, written once for any backend:
//! `tests/lora_vision.rs` runs these on the CPU backend, `tests/cuda_vision.rs` on the CUDA
//! one. Fixtures: `scripts/make_lora_fixtures.py` (`tests/fixtures/lora/qwen2_5_vl_all`,
//! `qwen2_vl_tower`) on the VL fixtures.

use std::path::{Path, PathBuf};

use super::vl::{Case, case, grads_of_case, load};
use super::{f32s, rel_err};
use ares_model::backend::Backend;
use ares_model::hf::lora::LoraAdapter;
use ares_model::vision::checkpoint::VlCheckpoint;
use ares_model::vision::model::VlModel;
use ares_model::vision::weights::param_table;
use safetensors::SafeTensors;

/// Each peft adapter with the VL fixture model it was made on.
pub const CASES: [(&str, &str); 2] = [
    ("qwen2_5_vl_all", "qwen2_5_vl_tiny"),
    ("qwen2_vl_tower", "qwen2_vl_tiny"),
];

/// A peft adapter fixture: under `$ARES_FIXTURE_LORA` when set (the GPU bundle's copy),
/// else `tests/fixtures/lora`.
pub fn fixture(name: &str) -> PathBuf {
    std::env::var_os("ARES_FIXTURE_LORA")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora"))
        .join(name)
}

pub fn adapter(name: &str, ck: &VlCheckpoint) -> LoraAdapter {
    LoraAdapter::read_vl(&fixture(name), &ck.config.text, &ck.config.vision).unwrap()
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub fn logits<B: Backend>(m: &VlModel<B>, cs: &Case) -> Vec<f32> {
    m.forward_logits(&cs.ids, &cs.mask, 1, &cs.vision).unwrap()
}

pub fn peft_tower_adapters_give_peft_logits_and_merged_weights<B: Backend>(make: impl Fn() -> B) {
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

        let mut m = VlModel::from_checkpoint(make(), &ck).unwrap();
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

/// The tower's pair gradients (name → values) and the full model's weight gradients of
/// `Σ logits · W` on the `image` case.
pub fn tower_grads<B: Backend>(m: &VlModel<B>, st: &SafeTensors<'_>) -> Vec<(String, Vec<f32>)> {
    let be = m.backend();
    let (_, vg) = grads_of_case(m, st, "image");
    let names = m.tower().trainable_names();
    let bufs = vg.stored();
    assert_eq!(names.len(), bufs.len());
    names
        .into_iter()
        .zip(bufs)
        .map(|((n, _), b)| {
            let mut host = vec![0.0; b.len()];
            b.download(be, &mut host).unwrap();
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

pub fn tower_pair_gradients_are_the_full_gradient_projected<B: Backend>(make: impl Fn() -> B) {
    for (name, model) in CASES {
        let (ck, bytes) = load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let a = adapter(name, &ck);
        let s = a.config.scale() as f32;
        let r = a.config.r;
        let mut m = VlModel::from_checkpoint(make(), &ck).unwrap();
        m.load_lora(&a).unwrap();
        let pair_grads = tower_grads(&m, &st);

        // the full model at the merged weights: its gradient G projects to dA = s·Bᵀ·G,
        // dB = s·G·Aᵀ
        let mut merged = ck.clone();
        a.merge_into(&mut merged.text).unwrap();
        a.merge_into_tower(&ck.config.vision, &mut merged.vision)
            .unwrap();
        let full = VlModel::from_checkpoint(make(), &merged).unwrap();
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
