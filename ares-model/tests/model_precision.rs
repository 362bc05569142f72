//! The model in reduced-precision matmuls (`Model::set_matmul_precision`) against itself in
//! exact f32 on the CPU backend, which emulates the GPU's TF32 and bf16 operand rounding:
//! the rounding reaches logits and gradients, stays within the formats' bounds, TF32 is
//! closer than bf16, and few-token products stay f32 under bf16.

use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::{Backend, MatmulPrecision, View, ViewMut};
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::model::{Inputs, Model};

mod common;
use common::{fixture, rel_err};

fn model(name: &str) -> Model<CpuBackend> {
    Model::from_checkpoint(CpuBackend, &Checkpoint::load(&fixture(name)).unwrap()).unwrap()
}

/// `batch` sequences of `seq` tokens, ids from a fixed LCG, no padding.
struct Batch {
    batch: usize,
    seq: usize,
    ids: Vec<u32>,
    mask: Vec<u32>,
    positions: Vec<u32>,
}

impl Batch {
    fn new(batch: usize, seq: usize, vocab: usize) -> Self {
        let mut state = 12_345u64;
        let ids = (0..batch * seq)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                ((state >> 33) % vocab as u64) as u32
            })
            .collect();
        Batch {
            batch,
            seq,
            ids,
            mask: vec![1; batch * seq],
            positions: (0..batch * seq).map(|i| (i % seq) as u32).collect(),
        }
    }

    fn inputs(&self) -> Inputs<'_> {
        Inputs {
            batch: self.batch,
            seq: self.seq,
            input_ids: &self.ids,
            attention_mask: &self.mask,
            position_ids: &self.positions,
        }
    }
}

fn logits(m: &Model<CpuBackend>, b: &Batch) -> Vec<f32> {
    let mut acts = m.activations_full(b.batch, b.seq).unwrap();
    m.forward(&b.inputs(), &mut acts).unwrap();
    let mut out = vec![0.0; b.batch * b.seq * m.spec().vocab];
    m.backend().download(acts.logits(), &mut out).unwrap();
    out
}

#[test]
fn logits_move_by_the_operand_rounding_and_no_more() {
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let mut m = model(name);
        // 4 × 20 = 80 tokens: every product has ≥ 64 rows, so bf16 applies throughout
        let b = Batch::new(4, 20, m.spec().vocab);
        let exact = logits(&m, &b);
        m.set_matmul_precision(MatmulPrecision::Tf32);
        let tf32 = rel_err(&logits(&m, &b), &exact);
        m.set_matmul_precision(MatmulPrecision::Bf16);
        let bf16 = rel_err(&logits(&m, &b), &exact);
        eprintln!("{name}: logits max rel error tf32 {tf32:.2e}, bf16 {bf16:.2e}");
        assert!(tf32 > 0.0 && bf16 > 0.0, "{name}: rounding had no effect");
        assert!(
            tf32 < bf16,
            "{name}: tf32 {tf32:e} not closer than bf16 {bf16:e}"
        );
        assert!(tf32 < 5e-3, "{name}: tf32 {tf32:e}");
        assert!(bf16 < 4e-2, "{name}: bf16 {bf16:e}");
    }
}

#[test]
fn few_token_products_stay_f32_under_bf16() {
    let mut m = model("qwen2_tiny");
    // 2 × 8 = 16 tokens: below the 64 rows where bf16 starts
    let b = Batch::new(2, 8, m.spec().vocab);
    let exact = logits(&m, &b);
    m.set_matmul_precision(MatmulPrecision::Bf16);
    assert_eq!(logits(&m, &b), exact);
    m.set_matmul_precision(MatmulPrecision::Tf32);
    assert_ne!(logits(&m, &b), exact, "tf32 applies at any size");
}

#[test]
fn gradients_move_by_the_operand_rounding_and_no_more() {
    let mut m = model("qwen2_tiny");
    let b = Batch::new(4, 20, m.spec().vocab);
    let n = b.batch * b.seq * m.spec().vocab;
    // a fixed ∂L/∂logits with entries in [-1, 1)
    let dl: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 % 2000) as f32 / 1000.0) - 1.0)
        .collect();
    let grads_in = |m: &Model<CpuBackend>| {
        let be = m.backend();
        let mut acts = m.activations_full(b.batch, b.seq).unwrap();
        m.forward(&b.inputs(), &mut acts).unwrap();
        let mut d = be.alloc(n).unwrap();
        be.upload(&dl, ViewMut::whole(&mut d)).unwrap();
        let mut g = m.grads().unwrap();
        m.backward(&b.inputs(), &mut acts, View::whole(&d), &mut g)
            .unwrap();
        g
    };
    let exact = grads_in(&m);
    m.set_matmul_precision(MatmulPrecision::Bf16);
    let bf16 = grads_in(&m);
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ] {
        let want = exact.download(m.backend(), name).unwrap();
        let got = bf16.download(m.backend(), name).unwrap();
        let err = rel_err(&got, &want);
        let dot: f64 = got
            .iter()
            .zip(&want)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum();
        let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        let cosine = dot / (norm(&got) * norm(&want));
        eprintln!("{name}: max rel error {err:.2e}, cosine {cosine:.6}");
        assert!(err > 0.0 && err < 5e-2, "{name}: {err:e}");
        assert!(cosine > 0.999, "{name}: cosine {cosine}");
    }
}
