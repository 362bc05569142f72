//! The model in reduced-precision matmuls (`Model::set_matmul_precision`) against itself in
//! exact f32 on the CPU backend, which emulates the GPU's TF32 and bf16 operand rounding:
//! the rounding reaches logits and gradients, stays within the formats' bounds, TF32 is
//! closer than bf16, and few-token products stay f32 under bf16.

use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::{Backend, MatmulPrecision, View, ViewMut};
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::model::{AdamW, AdamWConfig, Inputs, Model};

mod common;
use common::{fixture, rel_err, with_head_dim};

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

/// transformers' own bf16 forward (`dtype=torch.bfloat16`: bf16 weights and activations;
/// `scripts/make_bf16_reference.py`) as a reference for ares's bf16 path — bf16 products
/// and weight matrices stored in bf16, activations in f32 (CUDA's default) — on 80 tokens
/// of each fixture: ares's f32 logits are transformers' f32 ones, and ares's bf16 logits
/// are no farther from them than transformers' bf16 ones, and close to those.
#[test]
fn bf16_logits_are_as_close_as_transformers_bf16() {
    use ares_model::model::WeightStorage;
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let bytes = std::fs::read(fixture(name).join("bf16_reference.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (shape, ids) = common::u32s(&st, "input_ids");
        let (batch, seq) = (shape[0], shape[1]);
        let b = Batch {
            batch,
            seq,
            ids,
            mask: vec![1; batch * seq],
            positions: (0..batch * seq).map(|i| (i % seq) as u32).collect(),
        };
        let (hf32, hf16) = (
            common::f32s(&st, "logits_f32"),
            common::f32s(&st, "logits_bf16"),
        );
        let mut m = model(name);
        let exact = rel_err(&logits(&m, &b), &hf32);
        m.set_matmul_precision(MatmulPrecision::Bf16);
        m.set_weight_storage(WeightStorage::Bf16).unwrap();
        let ours = logits(&m, &b);
        let (err, err_hf, apart) = (
            rel_err(&ours, &hf32),
            rel_err(&hf16, &hf32),
            rel_err(&ours, &hf16),
        );
        eprintln!(
            "{name}: max rel error against transformers f32 — ares f32 {exact:.1e}, ares bf16 \
             {err:.2e}, transformers bf16 {err_hf:.2e}; ares bf16 against transformers bf16 \
             {apart:.2e}"
        );
        assert!(exact < 1e-4, "{name}: f32 {exact:e}");
        assert!(
            err > 0.0 && err <= err_hf,
            "{name}: {err:e} against {err_hf:e}"
        );
        assert!(
            apart <= 2.0 * err_hf,
            "{name}: {apart:e} against {err_hf:e}"
        );
    }
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

/// A model keeping bf16 copies of its weights (`Model::set_bf16_weights`) multiplies by
/// them where it would round the f32 weights per product: the same bits in every pass
/// (whole and chunked LM head, forward, backward), after optimizer steps and after a
/// trainable buffer is written — the copies follow the f32 weights.
#[test]
fn stored_bf16_weights_change_no_bit() {
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let mut rounded = model(name);
        let mut stored = model(name);
        for m in [&mut rounded, &mut stored] {
            m.set_matmul_precision(MatmulPrecision::Bf16);
        }
        stored.set_bf16_weights(true).unwrap();
        let s = stored.spec().clone();
        let linear = s.layers
            * (s.hidden * (2 * s.q_dim() + 2 * s.kv_dim()) + 3 * s.hidden * s.intermediate);
        let head = s.vocab * s.hidden;
        assert_eq!(
            stored.bf16_weight_bytes(),
            2 * (linear + head) as u64,
            "{name}"
        );
        assert_eq!(rounded.bf16_weight_bytes(), 0);

        let b = Batch::new(4, 20, s.vocab);
        let n = b.batch * b.seq;
        let targets: Vec<u32> = b.ids.iter().map(|&t| (t + 1) % s.vocab as u32).collect();
        let coeffs: Vec<f32> = (0..n).map(|i| (i % 7) as f32 / 7.0 - 0.4).collect();
        // log-probs, entropies and every gradient of one pass, with a chunked LM head
        let pass = |m: &Model<CpuBackend>| {
            let be = m.backend();
            let mut acts = m.activations_chunked(b.batch, b.seq, 24).unwrap();
            m.forward(&b.inputs(), &mut acts).unwrap();
            m.log_prob_entropy(&mut acts, &targets, 1.0).unwrap();
            let (mut lp, mut ent) = (vec![0.0; n], vec![0.0; n]);
            be.download(acts.log_probs(), &mut lp).unwrap();
            be.download(acts.entropies(), &mut ent).unwrap();
            let mut g = m.grads().unwrap();
            m.backward_from_log_prob_grads(&b.inputs(), &mut acts, &targets, &coeffs, 1.0, &mut g)
                .unwrap();
            (lp, ent, g)
        };
        let grad_names = [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.1.self_attn.o_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.norm.weight",
        ];
        let mut opt = [&rounded, &stored].map(|m| AdamW::new(m, AdamWConfig::default()).unwrap());
        for step in 0..3 {
            assert_eq!(
                logits(&stored, &b),
                logits(&rounded, &b),
                "{name} step {step}"
            );
            let (lp_r, ent_r, g_r) = pass(&rounded);
            let (lp_s, ent_s, g_s) = pass(&stored);
            assert_eq!((lp_s, ent_s), (lp_r, ent_r), "{name} step {step}");
            for g in grad_names {
                let want = g_r.download(rounded.backend(), g).unwrap();
                assert_eq!(
                    g_s.download(stored.backend(), g).unwrap(),
                    want,
                    "{name} {g}"
                );
            }
            // a step large enough to move the bf16 values
            let [o_r, o_s] = &mut opt;
            assert!(o_r.step(&mut rounded, &g_r, 1e-2, None).unwrap().applied);
            assert!(o_s.step(&mut stored, &g_s, 1e-2, None).unwrap().applied);
        }
        assert_eq!(
            logits(&stored, &b),
            logits(&rounded, &b),
            "{name} after steps"
        );
        // a buffer written from the host (a data-parallel rank's update) reaches the copy
        // (the last buffer: the down projections)
        let before = logits(&stored, &b);
        let last = rounded.trainable_buffers().len() - 1;
        let mut values = rounded.read_trainable(last).unwrap();
        values.iter_mut().for_each(|v| *v *= 1.5);
        rounded.write_trainable(last, &values).unwrap();
        stored.write_trainable(last, &values).unwrap();
        let after = logits(&stored, &b);
        assert_ne!(after, before, "{name}: the write changed nothing");
        assert_eq!(after, logits(&rounded, &b), "{name} written");
        // and without the copies the model is the plain bf16 one again
        stored.set_bf16_weights(false).unwrap();
        assert_eq!(stored.bf16_weight_bytes(), 0);
        assert_eq!(logits(&stored, &b), logits(&rounded, &b));
    }
}

/// With bf16 copies, the products of a bf16 pass read them (no f32-weight product, no
/// per-product rounding of a weight), and an optimizer step writes them with its update (no
/// rounding pass: the AdamW ops take the copies).
#[test]
fn stored_bf16_weights_are_what_the_bf16_products_read() {
    use ares_model::backend::Counting;
    let ck = Checkpoint::load(&fixture("qwen2_tiny")).unwrap();
    let mut m = Model::from_checkpoint(Counting::new(CpuBackend), &ck).unwrap();
    m.set_matmul_precision(MatmulPrecision::Bf16);
    m.set_bf16_weights(true).unwrap();
    let b = Batch::new(4, 20, m.spec().vocab);
    let n = b.batch * b.seq;
    let targets = vec![1u32; n];
    let mut acts = m.activations(b.batch, b.seq).unwrap();
    let mut g = m.grads().unwrap();
    let mut opt = AdamW::new(&m, AdamWConfig::default()).unwrap();
    let calls = counted_pass(&m, &b, &targets, &mut acts, &mut g);
    let count = |op: &str| calls.iter().filter(|&&c| c == op).count();
    // 7 projections a layer and the LM head, forward and backward
    let products = 7 * m.spec().layers + 1;
    assert_eq!(count("linear_bf16"), products);
    assert_eq!(count("linear_backward_bf16"), products);
    assert_eq!(
        count("linear") + count("linear_backward") + count("round_bf16"),
        0
    );
    // a layer's attention residual add and MLP norm run fused; its MLP add and the next
    // norm (the next layer's, or the final one) do not; the backward runs each layer's
    // two norms again (the arena keeps one layer's outputs)
    let layers = m.spec().layers;
    assert_eq!(count("add_rmsnorm"), layers);
    assert_eq!(count("add"), layers);
    assert_eq!(count("rmsnorm"), 3 * layers + 1);
    opt.step(&mut m, &g, 1e-3, Some(1.0)).unwrap();
    // no rounding pass: the copies (7 kinds of projection and the tied head) come with
    // their buffers' updates (`stored_bf16_weights_change_no_bit` checks their bits)
    let counts = m.backend().take();
    let count = |op: &str| counts.calls.iter().filter(|&&c| c == op).count();
    assert_eq!(count("round_bf16"), 0);
    assert_eq!(count("adamw_step"), m.trainable_buffers().len());
    // the clipped step's global norm over every gradient buffer: one read
    assert_eq!(count("sums_of_squares"), 1);
    assert_eq!(counts.host_waits, 1, "{:?}", counts.calls);
}

/// The ops of one forward and backward pass of `b` through `m` (∂L/∂logπ = 0.5 a token).
fn counted_pass(
    m: &Model<ares_model::backend::Counting<CpuBackend>>,
    b: &Batch,
    targets: &[u32],
    acts: &mut ares_model::model::Activations<ares_model::backend::Counting<CpuBackend>>,
    g: &mut ares_model::model::Grads<ares_model::backend::Counting<CpuBackend>>,
) -> Vec<&'static str> {
    let n = b.batch * b.seq;
    m.backend().take();
    m.forward(&b.inputs(), acts).unwrap();
    m.log_prob_entropy(acts, targets, 1.0).unwrap();
    m.backward_from_log_prob_grads(&b.inputs(), acts, targets, &vec![0.5; n], 1.0, g)
        .unwrap();
    m.backend().take().calls
}

/// Stored in bf16, the embedding is gathered from its bf16 table and the LM head multiplies
/// by its bf16 weight, as the linear layers do; AdamW updates each bf16 weight in one op a
/// tensor (the seven projections of every layer, the head, an untied embedding).
#[test]
fn weights_stored_in_bf16_are_read_by_the_bf16_ops() {
    use ares_model::backend::Counting;
    use ares_model::model::WeightStorage;
    for name in ["qwen2_tiny", "llama_tiny"] {
        let ck = Checkpoint::load(&fixture(name)).unwrap();
        let mut m = Model::from_checkpoint(Counting::new(CpuBackend), &ck).unwrap();
        m.set_matmul_precision(MatmulPrecision::Bf16);
        m.set_weight_storage(WeightStorage::Bf16).unwrap();
        let untied = usize::from(!m.spec().tied_embeddings);
        // 4 × 5 tokens: under 64 rows, so only what is stored in bf16 multiplies in bf16
        let b = Batch::new(4, 5, m.spec().vocab);
        let n = b.batch * b.seq;
        let targets = vec![1u32; n];
        let mut acts = m.activations_full(b.batch, b.seq).unwrap();
        let mut g = m.grads().unwrap();
        let mut opt = AdamW::new(&m, AdamWConfig::default()).unwrap();
        let calls = counted_pass(&m, &b, &targets, &mut acts, &mut g);
        let count = |op: &str| calls.iter().filter(|&&c| c == op).count();
        let products = 7 * m.spec().layers + 1;
        assert_eq!(count("embedding_bf16"), 1, "{name}");
        assert_eq!(count("embedding"), 2, "{name}: RoPE's cos and sin only");
        assert_eq!(count("linear_bf16"), products, "{name}");
        assert_eq!(count("linear_backward_bf16"), products, "{name}");
        assert_eq!(count("linear") + count("linear_backward"), 0, "{name}");
        opt.step(&mut m, &g, 1e-3, Some(1.0)).unwrap();
        let calls = m.backend().take().calls;
        let count = |op: &str| calls.iter().filter(|&&c| c == op).count();
        assert_eq!(count("adamw_step_bf16_weight"), products + untied, "{name}");
    }
}

/// Under bf16, a pass of ≥ 64 tokens at a head size of the tensor-core kernels (64 here)
/// runs attention through `attention_bf16` and `attention_backward_bf16` — the kernels'
/// twins on the CPU; the log-probs and gradients stay within bf16 of exact f32, and at
/// another head size (12) attention stays f32.
#[test]
fn bf16_attention_runs_on_the_tensor_core_twin() {
    use ares_model::backend::Counting;
    for (head_dim, tensor_core) in [(64, true), (12, false)] {
        let ck = with_head_dim(Checkpoint::load(&fixture("qwen3_tiny")).unwrap(), head_dim);
        let mut m = Model::from_checkpoint(Counting::new(CpuBackend), &ck).unwrap();
        let b = Batch::new(2, 80, m.spec().vocab);
        let n = b.batch * b.seq;
        let targets = vec![3u32; n];
        let run = |m: &Model<Counting<CpuBackend>>| {
            let mut acts = m.activations(b.batch, b.seq).unwrap();
            let mut g = m.grads().unwrap();
            m.backend().take();
            m.forward(&b.inputs(), &mut acts).unwrap();
            m.log_prob_entropy(&mut acts, &targets, 1.0).unwrap();
            let mut lp = vec![0.0f32; n];
            m.backend().download(acts.log_probs(), &mut lp).unwrap();
            m.backward_from_log_prob_grads(
                &b.inputs(),
                &mut acts,
                &targets,
                &vec![0.5; n],
                1.0,
                &mut g,
            )
            .unwrap();
            let calls = m.backend().take().calls;
            let q = g
                .download(m.backend(), "model.layers.0.self_attn.q_proj.weight")
                .unwrap();
            (lp, q, calls)
        };
        let (lp32, q32, calls32) = run(&m);
        m.set_matmul_precision(MatmulPrecision::Bf16);
        let (lp16, q16, calls16) = run(&m);
        let count = |calls: &[&str], op: &str| calls.iter().filter(|&&c| c == op).count();
        let layers = m.spec().layers;
        assert_eq!(count(&calls32, "attention_bf16"), 0);
        assert_eq!(count(&calls32, "attention"), layers);
        let want = if tensor_core { layers } else { 0 };
        assert_eq!(
            count(&calls16, "attention_bf16"),
            want,
            "head_dim {head_dim}"
        );
        assert_eq!(
            count(&calls16, "attention"),
            layers - want,
            "head_dim {head_dim}"
        );
        assert_eq!(
            count(&calls16, "attention_backward_bf16"),
            want,
            "head_dim {head_dim}"
        );
        assert_eq!(
            count(&calls16, "attention_backward"),
            layers - want,
            "head_dim {head_dim}"
        );
        let lp_err = lp16
            .iter()
            .zip(&lp32)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let q_err = rel_err(&q16, &q32);
        eprintln!(
            "head_dim {head_dim}: log-prob max |bf16 − f32| {lp_err:.2e}, q_proj grad rel {q_err:.2e}"
        );
        assert!(
            lp_err > 0.0 && lp_err < 5e-2,
            "head_dim {head_dim}: {lp_err:e}"
        );
        assert!(
            q_err > 0.0 && q_err < 1e-1,
            "head_dim {head_dim}: {q_err:e}"
        );
    }
}

/// The attention block's activations stored in bf16 too (`ActLayout`: where the pass's
/// attention runs on the tensor cores): `ln1`, q, k, v are rounded once into bf16 stacks
/// and read as stored (`attention_bf16_stored` and its backward, `linear_bf16_x`) — the
/// log-probs and every gradient the bits of the arena that keeps them in f32; the
/// attention's output in bf16 too (the model's layout) leaves the log-probs' bits (the
/// output projection rounds it anyway) and moves the gradients within bf16 (the backward's
/// `δ` reads the rounded output). Stored and checkpointed, three architectures (Qwen3's
/// q/k norms staged too); with a LoRA pair on q the input norm's output stays f32 and q,
/// k, v still go bf16; at a head size without tensor-core kernels the block stays f32.
#[test]
fn bf16_attention_activations_keep_the_forward_bits() {
    use ares_model::backend::Counting;
    use ares_model::model::{ActLayout, ActivationDtype, Activations, HeadMode};
    type Cm = Model<Counting<CpuBackend>>;
    // the base weights' gradients compared (none under LoRA)
    let names = |m: &Cm| -> Vec<String> {
        if m.lora_config().is_some() {
            return Vec::new();
        }
        let mut out = vec![
            "model.embed_tokens.weight".to_string(),
            "model.norm.weight".into(),
        ];
        for l in 0..m.spec().layers {
            for suffix in [
                "input_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "post_attention_layernorm.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            ] {
                out.push(format!("model.layers.{l}.{suffix}"));
            }
            if m.spec().qk_norm {
                out.push(format!("model.layers.{l}.self_attn.q_norm.weight"));
                out.push(format!("model.layers.{l}.self_attn.k_norm.weight"));
            }
        }
        out
    };
    let run = |m: &Cm, acts: &mut Activations<Counting<CpuBackend>>, b: &Batch| {
        let n = b.batch * b.seq;
        let targets: Vec<u32> = (0..n).map(|t| (t * 7 % 50) as u32).collect();
        let mut g = m.grads().unwrap();
        m.backend().take();
        m.forward(&b.inputs(), acts).unwrap();
        m.log_prob_entropy(acts, &targets, 1.0).unwrap();
        let mut lp = vec![0.0f32; n];
        m.backend().download(acts.log_probs(), &mut lp).unwrap();
        let coeffs: Vec<f32> = (0..n).map(|t| 0.25 + (t % 3) as f32 * 0.25).collect();
        m.backward_from_log_prob_grads(&b.inputs(), acts, &targets, &coeffs, 1.0, &mut g)
            .unwrap();
        let calls = m.backend().take().calls;
        let mut grads = Vec::new();
        for name in names(m) {
            grads.push(g.download(m.backend(), &name).unwrap());
        }
        (lp, grads, calls)
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (name, head_dim) in [
        ("qwen2_tiny", 64),
        ("qwen3_tiny", 64),
        ("llama_tiny", 64),
        ("qwen2_tiny", 12),
    ] {
        let ck = with_head_dim(Checkpoint::load(&fixture(name)).unwrap(), head_dim);
        let mut m = Model::from_checkpoint(Counting::new(CpuBackend), &ck).unwrap();
        m.set_matmul_precision(MatmulPrecision::Bf16);
        m.set_bf16_weights(true).unwrap();
        m.set_activation_dtype(ActivationDtype::Bf16);
        let b = Batch::new(2, 40, m.spec().vocab);
        let (n, spec) = (b.batch * b.seq, m.spec().clone());
        let tensor_cores = head_dim == 64;
        let layout = m.act_layout(n, ActivationDtype::Bf16);
        assert_eq!(
            layout,
            ActLayout::of(ActivationDtype::Bf16, tensor_cores, (false, false))
        );
        let mlp_only = ActLayout {
            mlp: true,
            ..ActLayout::F32
        };
        let f32_out = ActLayout {
            att: false,
            ..layout
        };
        for checkpointed in [false, true] {
            m.set_gradient_checkpointing(checkpointed);
            let what = format!("{name} head_dim {head_dim} checkpointed={checkpointed}");
            let plan = |layout| {
                let full = HeadMode::Full;
                Activations::planned(
                    m.backend(),
                    &spec,
                    b.batch,
                    b.seq,
                    full,
                    checkpointed,
                    layout,
                )
                .unwrap()
            };
            let mut acts = m.activations(b.batch, b.seq).unwrap();
            let (mut f32_attn, mut f32_att_out) = (plan(mlp_only), plan(f32_out));
            let (lp, grads, calls) = run(&m, &mut acts, &b);
            let (lp_f, grads_f, calls_f) = run(&m, &mut f32_attn, &b);
            let (lp_o, grads_o, _) = run(&m, &mut f32_att_out, &b);
            assert_eq!(bits(&lp), bits(&lp_f), "{what}: log-probs");
            assert_eq!(bits(&lp_o), bits(&lp_f), "{what}: log-probs (f32 output)");
            for (i, ((g, f), o)) in grads.iter().zip(&grads_f).zip(&grads_o).enumerate() {
                assert_eq!(bits(o), bits(f), "{what}: gradient {i} (f32 output)");
                if !tensor_cores {
                    assert_eq!(bits(g), bits(f), "{what}: gradient {i}");
                    continue;
                }
                let err = rel_err(g, f);
                assert!(err < 2e-2, "{what}: gradient {i}: {err:e}");
            }
            if tensor_cores {
                let worst = grads
                    .iter()
                    .zip(&grads_f)
                    .map(|(g, f)| rel_err(g, f))
                    .fold(0.0, f64::max);
                eprintln!("{what}: gradients' max rel error with the output in bf16 {worst:.2e}");
                let moved = grads.iter().zip(&grads_f).any(|(g, f)| bits(g) != bits(f));
                assert!(moved, "{what}: the bf16 output reaches the gradients");
            }
            let count = |calls: &[&str], op: &str| calls.iter().filter(|&&c| c == op).count();
            let layers = spec.layers * (1 + usize::from(checkpointed));
            let want = if tensor_cores { layers } else { 0 };
            assert_eq!(count(&calls, "attention_bf16_stored"), want, "{what}");
            assert_eq!(count(&calls_f, "attention_bf16_stored"), 0, "{what}");
            // q and k rotated into their bf16 stacks in one pass each; ln1 and v rounded,
            // and ln1 and ln2 again in the backward (the arena keeps one layer's of each;
            // checkpointed, the layer's forward again makes them)
            assert_eq!(count(&calls, "rope_bf16"), 2 * want, "{what}");
            let again = if checkpointed { 0 } else { spec.layers };
            let ln1_again = if tensor_cores { again } else { 0 };
            let rounded = 2 * want + ln1_again + again;
            assert_eq!(count(&calls, "round_bf16"), rounded, "{what}");
            let bwd = if tensor_cores { spec.layers } else { 0 };
            assert_eq!(
                count(&calls, "attention_backward_bf16_stored"),
                bwd,
                "{what}"
            );
            // the f32 arena's bf16 elements are the MLP's; this one's add ln1, q, k, v, out
            let (got, mlp) = (acts.elements().bf16s, f32_attn.elements().bf16s);
            let kept = if checkpointed { 1 } else { spec.layers } as u64;
            let extra = if tensor_cores {
                // ln1 one layer's (the backward recomputes it); q, k, v, out every kept one's
                (n as u64)
                    * (spec.hidden as u64 + kept * (2 * spec.q_dim() + 2 * spec.kv_dim()) as u64)
            } else {
                0
            };
            assert_eq!(got, mlp + extra, "{what}: bf16 elements");
        }
        m.set_gradient_checkpointing(false);
        if head_dim == 64 && name == "qwen2_tiny" {
            // a LoRA pair on q reads the input norm's output in f32
            let cfg = ares_model::hf::lora::LoraConfig {
                r: 4,
                lora_alpha: 8.0,
                use_rslora: false,
                target_modules: vec!["q_proj".into()],
                layers_to_transform: None,
                exclude_modules: None,
            };
            m.add_lora(&cfg, 3).unwrap();
            let layout = m.act_layout(n, ActivationDtype::Bf16);
            assert_eq!((layout.ln1, layout.qkv), (false, true));
            let mut acts = m.activations(b.batch, b.seq).unwrap();
            let (lp, _, calls) = run(&m, &mut acts, &b);
            let stored = calls
                .iter()
                .filter(|&&c| c == "attention_bf16_stored")
                .count();
            assert_eq!(stored, spec.layers, "LoRA on q");
            // without the backend's packed attention q, k, v stay f32: the same bits
            m.set_native_packed_attention(false);
            assert!(!m.act_layout(n, ActivationDtype::Bf16).qkv);
            let mut f32_attn = m.activations(b.batch, b.seq).unwrap();
            let (lp_f, _, _) = run(&m, &mut f32_attn, &b);
            assert_eq!(bits(&lp), bits(&lp_f), "LoRA on q: log-probs");
        }
    }
}

/// A prefill from slot 0 under bf16 (≥ 64 tokens, head size 64) runs its attention through
/// `attention_bf16` — its tokens see only each other, so the tensor-core training forward is
/// the step's attention — and still fills the KV cache: the decode steps after it (over the
/// cache, `attention_decode`) give f32's greedy tokens and log-probs within bf16. Under f32
/// nothing changes (no `attention_bf16`).
#[test]
fn bf16_prefill_runs_on_the_tensor_core_twin() {
    use ares_model::backend::Counting;
    use ares_model::model::{GenerateRequest, Sampling};
    let ck = with_head_dim(Checkpoint::load(&fixture("qwen3_tiny")).unwrap(), 64);
    let mut m = Model::from_checkpoint(Counting::new(CpuBackend), &ck).unwrap();
    let vocab = m.spec().vocab as u32;
    let prompt =
        |len: usize, k: u32| -> Vec<u32> { (0..len as u32).map(|i| (i * 7 + k) % vocab).collect() };
    let request = GenerateRequest {
        prompts: vec![prompt(40, 1), prompt(33, 5)],
        max_new_tokens: 4,
        eos_ids: vec![],
        sampling: Sampling::Greedy,
        seed: 0,
    };
    let run = |m: &Model<Counting<CpuBackend>>| {
        m.backend().take();
        let out = m.generate(&request).unwrap();
        let calls = m.backend().take().calls;
        let count = |op: &str| calls.iter().filter(|&&c| c == op).count();
        (out, count("attention_bf16"), count("attention_decode"))
    };
    let layers = m.spec().layers;
    let (f32_out, f32_bf16, f32_decode) = run(&m);
    assert_eq!(f32_bf16, 0);
    m.set_matmul_precision(MatmulPrecision::Bf16);
    let (out, bf16_calls, decode_calls) = run(&m);
    // the prefill's layers on the tensor-core twin, the 3 decode steps over the cache
    assert_eq!(bf16_calls, layers);
    assert_eq!(decode_calls, f32_decode - layers);
    assert_eq!(out.tokens, f32_out.tokens);
    let worst = out
        .log_probs
        .iter()
        .flatten()
        .zip(f32_out.log_probs.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("bf16 prefill: greedy log-prob max |bf16 − f32| {worst:.2e}");
    assert!(worst > 0.0 && worst < 5e-2, "{worst:e}");
}

/// A chunked prefill under bf16 (chunks of 64 tokens, head size 64) runs each full chunk's
/// attention over the paged pool through `paged_attention_prefill_bf16` (`_kv16` over bf16
/// pools) — the twin of the tensor-core kernel, queries over every earlier slot — and the
/// short last chunk and the decode steps through the scalar paged attention; the greedy
/// tokens are f32's and the log-probs within bf16. Under f32 nothing changes.
#[test]
fn bf16_chunked_prefill_runs_on_the_paged_tensor_core_twin() {
    use ares_model::backend::Counting;
    use ares_model::model::{EngineConfig, EngineRequest, KvCacheDtype, Sampling};
    let ck = with_head_dim(Checkpoint::load(&fixture("qwen3_tiny")).unwrap(), 64);
    let mut m = Model::from_checkpoint(Counting::new(CpuBackend), &ck).unwrap();
    let (vocab, layers) = (m.spec().vocab as u32, m.spec().layers);
    // 200 tokens: chunks of 64, 64, 64 and 8
    let prompt: Vec<u32> = (0..200u32).map(|i| (i * 7 + 3) % vocab).collect();
    let run = |m: &Model<Counting<CpuBackend>>, dtype: KvCacheDtype| {
        let generator = m.generator().unwrap();
        let request = EngineRequest {
            max_new_tokens: 4,
            eos_ids: vec![],
            sampling: Sampling::Greedy,
            seed: 0,
        };
        let config = EngineConfig {
            max_seqs: 2,
            block_size: 16,
            max_prefill_tokens: 64,
            kv_cache_dtype: dtype,
            ..EngineConfig::default()
        };
        let mut engine = ares_model::model::Engine::new(&generator, request, config).unwrap();
        engine.submit(prompt.clone()).unwrap();
        m.backend().take();
        let mut done = Vec::new();
        while !engine.is_idle() {
            done.extend(engine.step().unwrap());
        }
        let calls = m.backend().take().calls;
        let count = |op: &str| calls.iter().filter(|&&c| c == op).count();
        let tensor_cores =
            count("paged_attention_prefill_bf16") + count("paged_attention_prefill_bf16_kv16");
        (done.remove(0), tensor_cores)
    };
    for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16] {
        m.set_matmul_precision(MatmulPrecision::F32);
        let (want, none) = run(&m, dtype);
        assert_eq!(none, 0, "{dtype:?}");
        m.set_matmul_precision(MatmulPrecision::Bf16);
        let (got, calls) = run(&m, dtype);
        assert_eq!(
            calls,
            3 * layers,
            "{dtype:?}: the three full chunks' layers"
        );
        assert_eq!(got.tokens, want.tokens, "{dtype:?}");
        let worst = got
            .log_probs
            .iter()
            .zip(&want.log_probs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!("{dtype:?}: bf16 chunked prefill, greedy log-prob max |bf16 − f32| {worst:.2e}");
        assert!(worst > 0.0 && worst < 5e-2, "{dtype:?}: {worst:e}");
    }
}

/// A Qwen2.5-VL tower at a head size of the tensor-core kernels (64): two blocks, the
/// second of full attention, windows of 64 patches.
fn tower_64() -> ares_model::vision::config::VisionConfig {
    common::tower_at_head(64)
}

/// The tower's linear weights stored in bf16 (`VisionTower::set_weight_storage`) are what
/// its products read, through the bf16 ops: the output and every gradient are the bits of
/// a tower whose f32 weights hold the same bf16 values (bf16 products at 256 patches and 64
/// merged tokens), the weights take 2 bytes instead of 4, they read back widened, and f32
/// storage gives the same tower again.
#[test]
fn tower_weights_stored_in_bf16_are_read_by_the_bf16_ops() {
    use ares_model::backend::Counting;
    use ares_model::model::WeightStorage;
    use ares_model::vision::tower::{VisionPlan, VisionTower};
    use ares_model::vision::weights::{VisionWeights, tower_linear_parameters};
    let cfg = tower_64();
    let be = Counting::new(CpuBackend);
    let weights = VisionWeights::random(&cfg, 0.1, 6);
    let mut rounded = weights.clone();
    for (slot, t) in rounded.iter_mut() {
        if slot.is_linear() {
            t.data
                .iter_mut()
                .for_each(|x| *x = MatmulPrecision::Bf16.round(*x));
        }
    }
    let plan = VisionPlan::new(&cfg, &[[1, 16, 16]]).unwrap();
    let run = |tower: &VisionTower<Counting<CpuBackend>>| {
        be.take();
        let (out, g) = common::tower_pass(&be, tower, &plan);
        (out, g, be.take().calls)
    };
    let mut f32s = VisionTower::new(&be, &cfg, &rounded).unwrap();
    let mut stored = VisionTower::new(&be, &cfg, &weights).unwrap();
    f32s.set_matmul_precision(MatmulPrecision::Bf16);
    stored.set_matmul_precision(MatmulPrecision::Bf16);
    stored.set_weight_storage(&be, WeightStorage::Bf16).unwrap();
    assert_eq!(stored.weight_storage(), WeightStorage::Bf16);
    let linear = tower_linear_parameters(&cfg);
    assert_eq!(f32s.weight_bytes() - stored.weight_bytes(), 2 * linear);
    let (want, want_g, want_calls) = run(&f32s);
    let (got, got_g, calls) = run(&stored);
    assert_eq!(got, want);
    assert_eq!(got_g, want_g);
    let count = |calls: &[&str], op: &str| calls.iter().filter(|&&c| c == op).count();
    // per block qkv (3), proj, gate, up, down; the patch embedding and the merger's two
    let products = 2 * 7 + 3;
    assert_eq!(count(&want_calls, "linear"), products);
    assert_eq!(count(&calls, "linear_bf16"), products);
    assert_eq!(count(&calls, "linear_backward_bf16"), products);
    assert_eq!(
        count(&calls, "linear") + count(&calls, "linear_backward"),
        0
    );
    assert_eq!(stored.download_weights(&be).unwrap(), rounded);
    stored.set_weight_storage(&be, WeightStorage::F32).unwrap();
    assert_eq!(stored.weight_bytes(), f32s.weight_bytes());
    assert_eq!(run(&stored).0, want);
}

/// The tower's activations in bf16 (`VisionTower::set_activation_dtype`, weights stored
/// in bf16, Qwen2.5-VL's RMSNorm and SwiGLU, a tensor-core head size at 256 patches): the
/// MLP block's — the second norm's output, gate, up and their SwiGLU — and the attention
/// block's — the first norm's output, q, k, v and the attention's output — are kept as bf16
/// and read as stored (the add and the norm as one op, gate and up bf16 in and out, the
/// other products bf16 in, RoPE with the rounding, the attention over the stored bits and
/// its output stored rounded; the backward's products, SwiGLU and attention on the stored
/// bits); the output within bf16 of the f32-activation tower's and every gradient along its
/// gradient; a checkpointed arena gives the same bits; the arena is what
/// `tower_arena_bytes` counts, and smaller. f32 weights keep f32 activations; fewer than
/// 64 patches keep the attention block's in f32.
#[test]
fn tower_activations_in_bf16_are_read_as_stored() {
    use ares_model::backend::Counting;
    use ares_model::model::{ActivationDtype, WeightStorage};
    use ares_model::vision::tower::{TowerActLayout, VisionPlan, VisionTower, tower_arena_bytes};
    use ares_model::vision::weights::VisionWeights;
    let cfg = tower_64();
    let be = Counting::new(CpuBackend);
    let weights = VisionWeights::random(&cfg, 0.1, 6);
    let plan = VisionPlan::new(&cfg, &[[1, 16, 16]]).unwrap();
    let run = |tower: &VisionTower<Counting<CpuBackend>>| {
        be.take();
        let (out, g) = common::tower_pass(&be, tower, &plan);
        (out, g, be.take().calls)
    };
    let mut tower = VisionTower::new(&be, &cfg, &weights).unwrap();
    tower.set_matmul_precision(MatmulPrecision::Bf16);
    tower.set_activation_dtype(ActivationDtype::Bf16);
    // f32 weights: the bf16 products would round them per call; every activation f32
    assert_eq!(tower.act_layout(plan.patches), TowerActLayout::F32);
    tower.set_weight_storage(&be, WeightStorage::Bf16).unwrap();
    let both = TowerActLayout {
        mlp: true,
        attention: true,
    };
    assert_eq!(tower.act_layout(plan.patches), both);
    // too few rows for the tensor-core attention: its block stays f32
    assert!(!tower.act_layout(63).attention && tower.act_layout(63).mlp);
    let bytes16 = tower.activations(&be, plan.clone(), true).unwrap().bytes() as u64;
    assert_eq!(
        bytes16,
        tower_arena_bytes(&cfg, plan.patches, true, false, both)
    );
    let (got, got_g, calls) = run(&tower);
    tower.set_activation_dtype(ActivationDtype::F32);
    let bytes32 = tower.activations(&be, plan.clone(), true).unwrap().bytes() as u64;
    // n2, gate, up, act and n1, q, k, v, att of both blocks at half the bytes
    let (n, h, i) = (
        plan.patches as u64,
        cfg.hidden as u64,
        cfg.intermediate as u64,
    );
    assert_eq!(bytes32 - bytes16, 2 * 2 * n * (h + 3 * i + 5 * h));
    let (want, want_g, want_calls) = run(&tower);
    let e = rel_err(&got, &want);
    assert!(e > 0.0 && e < 1e-2, "output rel err {e:e}");
    assert_eq!(got_g.len(), want_g.len());
    for (k, (g, w)) in got_g.iter().zip(&want_g).enumerate() {
        let cos = cosine(g, w);
        assert!(cos > 0.999 || cos.is_nan(), "gradient {k}: cosine {cos}");
    }
    let count = |calls: &[&str], op: &str| calls.iter().filter(|&&c| c == op).count();
    let blocks = cfg.depth;
    for (op, per_block) in [
        ("add_rmsnorm_bf16", 1),
        ("linear_bf16_io", 2),
        ("swiglu_bf16", 1),
        // q, k, v, the projection and down
        ("linear_bf16_x", 5),
        // n1 and v; q and k with their RoPE
        ("round_bf16", 2),
        ("rope_bf16", 2),
        ("segment_attention_bf16_stored", 1),
        ("segment_attention_backward_bf16_stored", 1),
        // gate, up, down, the projection, q, k, v
        ("linear_backward_bf16_x", 7),
        ("swiglu_backward_bf16", 1),
    ] {
        assert_eq!(count(&calls, op), per_block * blocks, "{op}");
        assert_eq!(count(&want_calls, op), 0, "{op} (f32 activations)");
    }
    for op in ["swiglu", "rope", "segment_attention_bf16"] {
        assert_eq!(count(&calls, op), 0, "{op}");
    }
    // with f32 activations the residual add and the second norm are one op too
    assert_eq!(count(&want_calls, "add_rmsnorm"), blocks);
    // checkpointed: each block made again, the same bits
    tower.set_activation_dtype(ActivationDtype::Bf16);
    tower.set_gradient_checkpointing(true);
    let (ck, ck_g, _) = run(&tower);
    assert_eq!(ck, got);
    assert_eq!(ck_g, got_g);
}

/// Segment attention over q, k, v stored in bf16 on the CPU
/// (`Backend::segment_attention_bf16_stored` and its backward) is the twin run on the
/// widened bits: the f32 output, log-sum-exp and gradients of the f32 op over the same
/// values bit for bit, the bf16 output that output rounded once; both outputs or neither
/// is an error saying so.
#[test]
fn segment_attention_over_stored_bf16_is_the_twin_of_the_values() {
    use ares_model::backend::{DType, SegmentAttentionDims};
    let be = CpuBackend;
    let (tokens, heads, d) = (100usize, 2usize, 64usize);
    let cu = vec![0u32, 5, 69, 100];
    let dims = SegmentAttentionDims::new(tokens, cu.len() - 1, heads, d);
    let n = tokens * heads * d;
    let wave = |seed: usize, i: usize| ((i * 7919 + seed * 104_729) % 2000) as f32 / 1000.0 - 1.0;
    let [q, k, v, dout] = [1, 2, 3, 4].map(|s| {
        (0..n)
            .map(|i| MatmulPrecision::Bf16.round(wave(s, i)))
            .collect::<Vec<f32>>()
    });
    let half = |x: &[f32]| {
        let bits: Vec<u16> = x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let mut b = be.alloc_half(n, DType::Bf16).unwrap();
        be.upload_half(&bits, ViewMut::whole(&mut b)).unwrap();
        b
    };
    let (q16, k16, v16) = (half(&q), half(&k), half(&v));
    let (mut out, mut lse) = (vec![0.0f32; n], vec![0.0f32; tokens * heads]);
    let (qv, kv, vv) = (View::whole(&q), View::whole(&k), View::whole(&v));
    let (o, l) = (ViewMut::whole(&mut out), ViewMut::whole(&mut lse));
    be.segment_attention_bf16(dims, &cu, qv, kv, vv, o, l)
        .unwrap();
    let (mut s_out, mut s_lse) = (vec![f32::NAN; n], vec![f32::NAN; tokens * heads]);
    let stored = (View::whole(&q16), View::whole(&k16), View::whole(&v16));
    be.segment_attention_bf16_stored(
        dims,
        &cu,
        stored.0,
        stored.1,
        stored.2,
        Some(ViewMut::whole(&mut s_out)),
        None,
        ViewMut::whole(&mut s_lse),
    )
    .unwrap();
    assert_eq!((&s_out, &s_lse), (&out, &lse));
    let mut o16 = be.alloc_half(n, DType::Bf16).unwrap();
    be.segment_attention_bf16_stored(
        dims,
        &cu,
        stored.0,
        stored.1,
        stored.2,
        None,
        Some(ViewMut::whole(&mut o16)),
        ViewMut::whole(&mut s_lse),
    )
    .unwrap();
    let mut got16 = vec![0u16; n];
    be.download_half(View::whole(&o16), &mut got16).unwrap();
    let want16: Vec<u16> = out
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect();
    assert_eq!(got16, want16);
    let backward = |stored_qkv: bool| {
        let mut g = [(); 3].map(|()| vec![f32::NAN; n]);
        let [dq, dk, dv] = &mut g;
        let (o, l, d) = (View::whole(&out), View::whole(&lse), View::whole(&dout));
        let grads = (ViewMut::whole(dq), ViewMut::whole(dk), ViewMut::whole(dv));
        match stored_qkv {
            false => be.segment_attention_backward_bf16(
                dims, &cu, qv, kv, vv, o, l, d, grads.0, grads.1, grads.2,
            ),
            true => be.segment_attention_backward_bf16_stored(
                dims,
                &cu,
                stored.0,
                stored.1,
                stored.2,
                Some(o),
                None,
                l,
                d,
                grads.0,
                grads.1,
                grads.2,
            ),
        }
        .unwrap();
        g
    };
    assert_eq!(backward(true), backward(false));
    let (mut o32, mut l32) = (vec![0.0f32; n], vec![0.0f32; tokens * heads]);
    let e = be
        .segment_attention_bf16_stored(
            dims,
            &cu,
            stored.0,
            stored.1,
            stored.2,
            Some(ViewMut::whole(&mut o32)),
            Some(ViewMut::whole(&mut o16)),
            ViewMut::whole(&mut l32),
        )
        .unwrap_err();
    assert!(e.to_string().contains("exactly 1"), "{e}");
}

/// The cosine of two vectors (NaN for a zero one).
fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum();
    let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// The attention block alone in bf16 (Qwen2-VL's LayerNorm and QuickGELU keep the MLP's in
/// f32): its forward reads the bits the f32 activations' bf16 products and tensor-core
/// attention take — n1, q, k, v rounded once, the output rounded as the projection rounds
/// it — so the tower's output is the f32-activation tower's bit for bit; the backward's δ
/// reads the rounded output, so the gradients stay along the f32 ones.
#[test]
fn tower_attention_block_in_bf16_is_the_f32_forward_bit_for_bit() {
    use ares_model::model::{ActivationDtype, WeightStorage};
    use ares_model::vision::config::{VisionMlp, VlKind};
    use ares_model::vision::tower::{TowerActLayout, VisionPlan, VisionTower};
    use ares_model::vision::weights::VisionWeights;
    let mut cfg = tower_64();
    cfg.kind = VlKind::Qwen2Vl;
    cfg.mlp = VisionMlp::Plain(ares_model::backend::Activation::QuickGelu);
    cfg.fullatt_block_indexes.clear();
    let be = CpuBackend;
    let weights = VisionWeights::random(&cfg, 0.1, 9);
    let plan = VisionPlan::new(&cfg, &[[1, 16, 16]]).unwrap();
    let mut tower = VisionTower::new(&be, &cfg, &weights).unwrap();
    tower.set_matmul_precision(MatmulPrecision::Bf16);
    tower.set_weight_storage(&be, WeightStorage::Bf16).unwrap();
    tower.set_activation_dtype(ActivationDtype::Bf16);
    let layout = TowerActLayout {
        mlp: false,
        attention: true,
    };
    assert_eq!(tower.act_layout(plan.patches), layout);
    let (got, got_g) = common::tower_pass(&be, &tower, &plan);
    tower.set_activation_dtype(ActivationDtype::F32);
    let (want, want_g) = common::tower_pass(&be, &tower, &plan);
    assert_eq!(got, want);
    for (k, (g, w)) in got_g.iter().zip(&want_g).enumerate() {
        let cos = cosine(g, w);
        assert!(cos > 0.9999 || cos.is_nan(), "gradient {k}: cosine {cos}");
    }
    assert_ne!(got_g, want_g);
}

/// The tower's gradients stored in bf16 (`VisionTower::zero_grads_in`, `grad_dtype: bf16`):
/// one pass gives each linear layer's gradient as its f32 one rounded to one of its two
/// bf16 neighbours — stochastically, so about half the values that round below the
/// midpoint still round up, some above it down — and the norms' and biases' bit for bit;
/// the pass itself (the output) is unchanged; over 64 passes the sum's length along the
/// f32 gradient stays within 0.2 % of 64 (unbiased).
#[test]
fn tower_bf16_grads_are_the_f32_grads_rounded_stochastically() {
    use ares_model::model::GradDtype;
    use ares_model::vision::tower::{VisionPlan, VisionTower};
    use ares_model::vision::weights::VisionWeights;
    let cfg = tower_64();
    let be = CpuBackend;
    let weights = VisionWeights::random(&cfg, 0.1, 8);
    let plan = VisionPlan::new(&cfg, &[[1, 8, 8]]).unwrap();
    let tower = VisionTower::new(&be, &cfg, &weights).unwrap();
    let (out32, g32) = common::tower_passes(&be, &tower, &plan, GradDtype::F32, 1);
    let (out16, g16) = common::tower_passes(&be, &tower, &plan, GradDtype::Bf16, 1);
    assert_eq!(out16, out32);
    assert_eq!(g16.len(), g32.len());
    let (mut linear, mut up, mut moved) = (0usize, [0usize; 2], [0usize; 2]);
    for (i, ((bf16, got), (was_bf16, want))) in g16.iter().zip(&g32).enumerate() {
        assert!(!was_bf16);
        if !bf16 {
            assert_eq!(got, want, "gradient {i}, f32");
            continue;
        }
        linear += 1;
        for (&w, &g) in want.iter().zip(got) {
            let down = f32::from_bits(w.to_bits() & 0xffff_0000);
            let away = f32::from_bits((w.to_bits() & 0xffff_0000) + 0x1_0000);
            assert!(g == down || g == away, "gradient {i}: {g} for {w}");
            if down != w {
                let half = usize::from(w.to_bits() & 0xffff > 0x8000);
                up[half] += usize::from(g == away);
                moved[half] += 1;
            }
        }
    }
    // patch, qkv, proj, gate, up, down, merger 0 and 2
    assert_eq!(linear, 8);
    // stochastic, not to nearest: both halves round both ways
    assert!(
        up[0] > moved[0] / 8 && up[0] < moved[0] / 2,
        "{up:?} of {moved:?}"
    );
    assert!(
        up[1] > moved[1] / 2 && up[1] < moved[1] * 7 / 8,
        "{up:?} of {moved:?}"
    );
    // accumulated over passes: unbiased
    let passes = 64;
    let (_, sum16) = common::tower_passes(&be, &tower, &plan, GradDtype::Bf16, passes);
    for (i, ((bf16, got), (_, one))) in sum16.iter().zip(&g32).enumerate() {
        if !bf16 {
            continue;
        }
        // the sum's length along the f32 gradient: 1 when unbiased
        let dot = |a: &[f32]| {
            a.iter()
                .zip(one)
                .map(|(x, y)| f64::from(*x) * f64::from(*y))
                .sum::<f64>()
        };
        let along = dot(got) / (passes as f64 * dot(one));
        assert!(
            (along - 1.0).abs() < 2e-3,
            "gradient {i}: {along} after {passes} passes"
        );
    }
}

/// The vision tower in bf16 at a head size of the tensor-core kernels (64; windows of 64
/// patches and one full-attention block over 256): every block's segment attention runs
/// through `segment_attention_bf16` and its backward `segment_attention_backward_bf16` (the
/// kernels' CPU twins), and the output and the gradients stay within bf16 of f32.
#[test]
fn bf16_tower_attention_runs_on_the_tensor_core_twin() {
    use ares_model::backend::Counting;
    use ares_model::vision::tower::{VisionPlan, VisionTower};
    use ares_model::vision::weights::VisionWeights;
    let cfg = tower_64();
    let be = Counting::new(CpuBackend);
    let weights = VisionWeights::random(&cfg, 0.1, 5);
    let plan = VisionPlan::new(&cfg, &[[1, 16, 16]]).unwrap();
    let run = |precision: MatmulPrecision| {
        let mut tower = VisionTower::new(&be, &cfg, &weights).unwrap();
        tower.set_matmul_precision(precision);
        be.take();
        let (out, g) = common::tower_pass(&be, &tower, &plan);
        (out, g, be.take().calls)
    };
    let (out32, g32, calls32) = run(MatmulPrecision::F32);
    let (out16, g16, calls16) = run(MatmulPrecision::Bf16);
    let count = |calls: &[&str], op: &str| calls.iter().filter(|&&c| c == op).count();
    assert_eq!(count(&calls32, "segment_attention"), 2);
    assert_eq!(count(&calls32, "segment_attention_bf16"), 0);
    assert_eq!(count(&calls16, "segment_attention_bf16"), 2);
    assert_eq!(count(&calls16, "segment_attention_backward_bf16"), 2);
    assert_eq!(
        count(&calls16, "segment_attention") + count(&calls16, "segment_attention_backward"),
        0
    );
    let out_err = rel_err(&out16, &out32);
    assert!(out_err > 0.0 && out_err < 5e-2, "tower output: {out_err:e}");
    for (i, (a, b)) in g16.iter().zip(&g32).enumerate() {
        let err = rel_err(a, b);
        assert!(err < 1e-1, "gradient {i}: {err:e}");
    }
}

/// Weight matrices stored in bf16 (`Model::set_weight_storage`: the linear layers', the
/// embedding, the LM head) are bf16 copies with the f32 buffers freed: every pass gives the
/// bits of a model keeping copies beside f32 weights (bf16 products, ≥ 64 rows) whose
/// embedding and head hold bf16 values, the weights take 2 bytes instead of 4 (+ 2), the
/// values read back (`to_weights`, `read_trainable`) are the copies widened, and the copies
/// cannot be dropped. Tied (qwen2_tiny) and untied embeddings.
#[test]
fn weights_stored_in_bf16_are_the_copies_without_f32() {
    use ares_model::model::{ModelError, WeightStorage};
    let round =
        |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| MatmulPrecision::Bf16.round(x)).collect() };
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let w0 = model(name).to_weights().unwrap();
        let mut copied = model(name);
        let mut stored = model(name);
        for m in [&mut copied, &mut stored] {
            m.set_matmul_precision(MatmulPrecision::Bf16);
        }
        // the copied model's embedding and head hold the values storing rounds them to
        // (trainable buffers 0 and, untied, 2)
        let untied = !copied.spec().tied_embeddings;
        for i in [0].into_iter().chain(untied.then_some(2)) {
            let v = round(&copied.read_trainable(i).unwrap());
            copied.write_trainable(i, &v).unwrap();
        }
        copied.set_bf16_weights(true).unwrap();
        stored.set_weight_storage(WeightStorage::Bf16).unwrap();
        assert_eq!(stored.weight_storage(), WeightStorage::Bf16);
        let s = stored.spec().clone();
        let linear = s.layers
            * (s.hidden * (2 * s.q_dim() + 2 * s.kv_dim()) + 3 * s.hidden * s.intermediate);
        // f32 linear weights, embedding and head gone; an untied embedding's copy added
        let cv = (s.hidden * s.vocab) as u64;
        let freed =
            4 * linear as u64 + 4 * cv * (1 + u64::from(untied)) - 2 * cv * u64::from(untied);
        assert_eq!(
            copied.weight_bytes() - stored.weight_bytes(),
            freed,
            "{name}"
        );

        let b = Batch::new(4, 20, s.vocab);
        let n = b.batch * b.seq;
        assert_eq!(logits(&stored, &b), logits(&copied, &b), "{name}");
        let targets: Vec<u32> = b.ids.iter().map(|&t| (t + 2) % s.vocab as u32).collect();
        let coeffs: Vec<f32> = (0..n).map(|i| (i % 5) as f32 / 5.0 - 0.3).collect();
        let grads = |m: &Model<CpuBackend>| {
            // the whole head at once: a chunk under 64 rows multiplies in f32 by f32 weights
            let mut acts = m.activations_full(b.batch, b.seq).unwrap();
            m.forward(&b.inputs(), &mut acts).unwrap();
            m.log_prob_entropy(&mut acts, &targets, 1.0).unwrap();
            let mut g = m.grads().unwrap();
            m.backward_from_log_prob_grads(&b.inputs(), &mut acts, &targets, &coeffs, 1.0, &mut g)
                .unwrap();
            g
        };
        let (g_c, g_s) = (grads(&copied), grads(&stored));
        for g in [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.mlp.gate_proj.weight",
            "model.layers.1.input_layernorm.weight",
        ] {
            let want = g_c.download(copied.backend(), g).unwrap();
            assert_eq!(
                g_s.download(stored.backend(), g).unwrap(),
                want,
                "{name} {g}"
            );
        }
        // the values: the f32 weights rounded to nearest once
        let (w_c, w_s) = (copied.to_weights().unwrap(), stored.to_weights().unwrap());
        assert_eq!(w_s.layers[1].v_proj.data, round(&w_c.layers[1].v_proj.data));
        assert_eq!(w_s.embed_tokens.data, round(&w0.embed_tokens.data));
        assert_eq!(
            w_s.lm_head.map(|t| t.data),
            w0.lm_head.map(|t| round(&t.data))
        );
        assert_eq!(
            w_s.layers[0].input_layernorm.data, w0.layers[0].input_layernorm.data,
            "kept in f32"
        );
        assert_eq!(stored.read_trainable(0).unwrap(), w_s.embed_tokens.data);
        let last = stored.trainable_buffers().len() - 1;
        assert_eq!(
            stored.read_trainable(last).unwrap(),
            round(&copied.read_trainable(last).unwrap())
        );
        assert!(matches!(
            stored.set_bf16_weights(false),
            Err(ModelError::Bf16Weights { .. })
        ));
        // back to f32: the same numbers, the f32 buffers again
        stored.set_weight_storage(WeightStorage::F32).unwrap();
        assert_eq!(stored.weight_bytes(), copied.weight_bytes());
        assert_eq!(
            stored.to_weights().unwrap().layers[1].v_proj.data,
            w_s.layers[1].v_proj.data
        );
    }
}

/// AdamW on weights stored in bf16 rounds each update stochastically, so at an RL
/// learning rate (1e-6, a step ~1e-6 against a half ulp of ~6e-5 at these weights' size)
/// the weights move as the f32 master does on average — where rounding the f32 result to
/// nearest (what a bf16 weight updated without it gets) moves none of them. The draws
/// follow the seed: the same seed gives the same bits, another seed other bits.
#[test]
fn bf16_weights_take_updates_below_half_an_ulp() {
    use ares_model::model::WeightStorage;
    const STEPS: usize = 8;
    let lr = 1e-6;
    let mut master = model("qwen2_tiny");
    let stored = |seed| {
        let mut m = model("qwen2_tiny");
        m.set_weight_storage(WeightStorage::Bf16).unwrap();
        let mut opt = AdamW::new(&m, AdamWConfig::default()).unwrap();
        opt.set_rounding_seed(seed);
        (m, opt)
    };
    let (mut a, mut opt_a) = stored(7);
    let (mut b, mut opt_b) = stored(7);
    let (mut c, mut opt_c) = stored(8);
    let mut opt_m = AdamW::new(&master, AdamWConfig::default()).unwrap();
    // every weight stored in bf16 (the linear layers', the tied embedding), flattened
    let linear = |m: &Model<CpuBackend>| -> Vec<f32> {
        let w = m.to_weights().unwrap();
        let embed = w.embed_tokens.data.clone();
        w.layers
            .iter()
            .flat_map(|l| {
                [
                    &l.q_proj,
                    &l.k_proj,
                    &l.v_proj,
                    &l.o_proj,
                    &l.gate_proj,
                    &l.up_proj,
                    &l.down_proj,
                ]
                .into_iter()
                .flat_map(|t| t.data.iter().copied())
                .collect::<Vec<_>>()
            })
            .chain(embed)
            .collect()
    };
    let start = linear(&master);
    // a bf16 weight that takes each f32 update rounded to nearest
    let r = |x: f32| MatmulPrecision::Bf16.round(x);
    let mut nearest: Vec<f32> = start.iter().map(|&x| r(x)).collect();
    // fixed gradients of both signs, the same for every model and step
    let fill = |m: &Model<CpuBackend>, step: usize| {
        let mut g = m.grads().unwrap();
        for (i, buf) in g.buffers_mut().into_iter().enumerate() {
            let v: Vec<f32> = (0..buf.len())
                .map(|j| (((j * 7919 + i * 104_729 + step * 31) % 2001) as f32 - 1000.0) * 1e-3)
                .collect();
            m.backend().upload(&v, ViewMut::whole(buf)).unwrap();
        }
        g
    };
    for step in 0..STEPS {
        let g = fill(&master, step);
        let before = linear(&master);
        assert!(opt_m.step(&mut master, &g, lr, None).unwrap().applied);
        for ((w, &x0), x1) in nearest.iter_mut().zip(&before).zip(linear(&master)) {
            *w = r(*w + (x1 - x0));
        }
        for (m, o) in [
            (&mut a, &mut opt_a),
            (&mut b, &mut opt_b),
            (&mut c, &mut opt_c),
        ] {
            let g = fill(m, step);
            assert!(o.step(m, &g, lr, None).unwrap().applied);
        }
    }
    let end = linear(&master);
    let (wa, wb, wc) = (linear(&a), linear(&b), linear(&c));
    assert_eq!(wa, wb, "the same seed, the same bits");
    assert_ne!(wa, wc, "another seed, other draws");
    // the f32 master's displacement Σ|Δ|, and each bf16 weight's along it, Σ Δ_bf16·sign(Δ)
    let (mut travelled, mut along, mut along_nearest) = (0.0f64, 0.0f64, 0.0f64);
    for (j, (&s0, &s1)) in start.iter().zip(&end).enumerate() {
        let d = f64::from(s1) - f64::from(s0);
        let from = f64::from(r(s0));
        travelled += d.abs();
        along += (f64::from(wa[j]) - from) * d.signum();
        along_nearest += (f64::from(nearest[j]) - from) * d.signum();
    }
    let (ratio, ratio_nearest) = (along / travelled, along_nearest / travelled);
    eprintln!(
        "{} weights, {STEPS} steps at lr {lr:e}: f32 travelled {travelled:.3e}; bf16 along it: \
         stochastic {ratio:.3}×, to nearest {ratio_nearest:.3}×",
        start.len()
    );
    assert!((0.9..1.1).contains(&ratio), "stochastic: {ratio}");
    // to nearest, only weights within a few 1e-6 of 0 (ulp < 2·step) move at all
    assert!(ratio_nearest < 0.05, "to nearest: {ratio_nearest}");
}

/// `(batch, dlogits)` of a fixed ∂L/∂logits with entries in [-1, 1) for `m`.
fn fixed_dlogits(m: &Model<CpuBackend>) -> (Batch, Vec<f32>) {
    let b = Batch::new(2, 16, m.spec().vocab);
    let n = b.batch * b.seq * m.spec().vocab;
    let dl = (0..n)
        .map(|i| ((i * 7919 % 2000) as f32 / 1000.0) - 1.0)
        .collect();
    (b, dl)
}

/// One forward and backward of `m` from `dl` into new gradients stored as `dtype`.
fn grads_of(
    m: &Model<CpuBackend>,
    (b, dl): &(Batch, Vec<f32>),
    dtype: ares_model::model::GradDtype,
) -> ares_model::model::Grads<CpuBackend> {
    let be = m.backend();
    let mut acts = m.activations_full(b.batch, b.seq).unwrap();
    m.forward(&b.inputs(), &mut acts).unwrap();
    let mut d = be.alloc(dl.len()).unwrap();
    be.upload(dl, ViewMut::whole(&mut d)).unwrap();
    let mut g = m.grads_in(dtype).unwrap();
    m.backward(&b.inputs(), &mut acts, View::whole(&d), &mut g)
        .unwrap();
    g
}

/// Gradients stored in bf16 (`trainer.grad_dtype: bf16`): each linear weight's gradient
/// is its f32 gradient rounded stochastically — one of its two bf16 neighbours — and every
/// other gradient (embedding, norms, biases) is the f32 one, bit for bit; the bf16 stacks
/// take half the bytes; an f32 view of one is refused.
#[test]
fn bf16_grads_are_the_f32_grads_rounded_stochastically() {
    use ares_model::model::{GradDtype, ModelError};
    let m = model("qwen2_tiny");
    let batch = fixed_dlogits(&m);
    let g32 = grads_of(&m, &batch, GradDtype::F32);
    let g16 = grads_of(&m, &batch, GradDtype::Bf16);
    assert_eq!(
        (g32.dtype(), g16.dtype()),
        (GradDtype::F32, GradDtype::Bf16)
    );
    let be = m.backend();
    // values below the midpoint of their neighbours (`[0]`) and above it (`[1]`): how many,
    // and how many rounded away from zero — never / always to nearest
    let (mut linear, mut up, mut moved) = (0usize, [0usize; 2], [0usize; 2]);
    for layer in 0..m.spec().layers {
        for suffix in [
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ] {
            let name = format!("model.layers.{layer}.{suffix}");
            let (want, got) = (
                g32.download(be, &name).unwrap(),
                g16.download(be, &name).unwrap(),
            );
            for (&w, &g) in want.iter().zip(&got) {
                // the bf16 neighbours of w: its bits truncated, and one ulp farther from 0
                let down = f32::from_bits(w.to_bits() & 0xffff_0000);
                let away = f32::from_bits((w.to_bits() & 0xffff_0000) + 0x1_0000);
                assert!(g == down || g == away, "{name}: {g} for {w}");
                if down != w {
                    let half = usize::from(w.to_bits() & 0xffff > 0x8000);
                    up[half] += usize::from(g == away);
                    moved[half] += 1;
                }
            }
            linear += want.len();
            assert!(matches!(
                g16.tensor(&name),
                Err(ModelError::Bf16Grads { .. })
            ));
        }
        for suffix in ["input_layernorm.weight", "self_attn.q_proj.bias"] {
            let name = format!("model.layers.{layer}.{suffix}");
            let (want, got) = (
                g32.download(be, &name).unwrap(),
                g16.download(be, &name).unwrap(),
            );
            assert_eq!(want, got, "{name}");
        }
    }
    for name in ["model.embed_tokens.weight", "model.norm.weight"] {
        assert_eq!(
            g32.download(be, name).unwrap(),
            g16.download(be, name).unwrap()
        );
    }
    // stochastic: a value rounds away from zero with its distance from the lower neighbour
    // (on average ¼ of those below the midpoint, ¾ of those above), not to the nearer one
    let share = |h: usize| up[h] as f64 / moved[h] as f64;
    assert!(
        (0.15..0.35).contains(&share(0)),
        "{up:?} of {moved:?} rounded up"
    );
    assert!(
        (0.65..0.85).contains(&share(1)),
        "{up:?} of {moved:?} rounded up"
    );
    // the linear gradients' bytes halve (plus one layer of f32 scratch per stack)
    let saved = g32.bytes() - g16.bytes();
    let layer_scratch = 4 * linear as u64 / m.spec().layers as u64;
    assert_eq!(saved, 2 * linear as u64 - layer_scratch);
}

/// What a data-parallel run reads and writes of gradients stored in bf16: a layer watcher
/// is handed each layer's gradients as stored (the seven linear ones as bf16 bits) once
/// the layer is folded, and they are the values the pass ends with; `read_values` widens
/// them, `write_values` rounds to nearest (ties to even) — f32 gradients as they are; a
/// pass keyed by `set_rounding_pass` draws the same bits for the same key, others for
/// another.
#[test]
fn bf16_grads_are_watched_read_and_written_as_stored() {
    use ares_model::backend::Stored;
    use ares_model::model::{GradDtype, ModelError};
    let m = model("qwen2_tiny");
    let (b, dl) = fixed_dlogits(&m);
    let be = m.backend();
    let pass_into = |g: &mut ares_model::model::Grads<CpuBackend>| {
        let mut acts = m.activations_full(b.batch, b.seq).unwrap();
        m.forward(&b.inputs(), &mut acts).unwrap();
        let mut d = be.alloc(dl.len()).unwrap();
        be.upload(&dl, ViewMut::whole(&mut d)).unwrap();
        m.backward(&b.inputs(), &mut acts, View::whole(&d), g)
            .unwrap();
    };
    let mut g = m.grads_in(GradDtype::Bf16).unwrap();
    let layers = m.spec().layers;
    let halves = common::check_layer_watch(be, layers, &mut g, |g| pass_into(g));
    assert_eq!(
        halves,
        7 * layers,
        "the linear weights' gradients handed over in bf16"
    );
    // a bf16 buffer takes values rounded to nearest, ties to even; an f32 one as they are
    let (lens, stored) = (g.lens(), g.stored());
    let half = stored
        .iter()
        .position(|s| matches!(s, Stored::Bf16(_)))
        .unwrap();
    let f32s = stored
        .iter()
        .position(|s| matches!(s, Stored::F32(_)))
        .unwrap();
    let u = 2f32.powi(-8); // half an ulp of bf16 at 1
    let given = [1.0 + u, 1.0 + 3.0 * u, 1.0 + u + u / 16.0, -0.0, 3.0e-3];
    let rounded = [
        1.0,
        1.0 + 4.0 * u,
        1.0 + 2.0 * u,
        -0.0,
        f32::from_bits(0x3b45_0000),
    ];
    let mut back = [0.0f32; 5];
    for (buffer, want) in [(half, rounded), (f32s, given)] {
        let offset = lens[buffer] - 5;
        g.write_values(be, buffer, offset, &given).unwrap();
        g.read_values(be, buffer, offset, &mut back).unwrap();
        assert_eq!(
            back.map(f32::to_bits),
            want.map(f32::to_bits),
            "buffer {buffer}"
        );
    }
    let past = g.write_values(be, lens.len(), 0, &given);
    assert!(
        matches!(past, Err(ModelError::InvalidValue { .. })),
        "{past:?}"
    );
    let over = g.read_values(be, half, lens[half] - 4, &mut back);
    assert!(over.is_err(), "a range past the buffer: {over:?}");
    // the rounding keyed by the pass given: the same key the same bits
    let name = "model.layers.1.mlp.down_proj.weight";
    let keyed = |pass: u64| {
        let mut g = m.grads_in(GradDtype::Bf16).unwrap();
        g.set_rounding(3, 1);
        g.set_rounding_pass(pass);
        pass_into(&mut g);
        g.download(be, name).unwrap()
    };
    assert_eq!(keyed(5), keyed(5));
    assert_ne!(keyed(5), keyed(6));
}

/// Gradients accumulated in bf16 over many backward passes stay unbiased: 2 048 passes of
/// the same batch sum to 2 048× the f32 gradient within the rounding's spread, where
/// rounding to nearest stalls once a pass's part falls below half an ulp of the sum
/// (from 256–512 passes on) and ends far below it.
#[test]
fn bf16_grads_accumulate_without_bias() {
    use ares_model::model::GradDtype;
    let m = model("qwen2_tiny");
    let (b, dl) = fixed_dlogits(&m);
    let be = m.backend();
    let g32 = grads_of(
        &m,
        &(Batch::new(b.batch, b.seq, m.spec().vocab), dl.clone()),
        GradDtype::F32,
    );
    let mut g16 = m.grads_in(GradDtype::Bf16).unwrap();
    g16.set_rounding(3, 1);
    let mut d = be.alloc(dl.len()).unwrap();
    be.upload(&dl, ViewMut::whole(&mut d)).unwrap();
    const PASSES: usize = 2048;
    for _ in 0..PASSES {
        let mut acts = m.activations_full(b.batch, b.seq).unwrap();
        m.forward(&b.inputs(), &mut acts).unwrap();
        m.backward(&b.inputs(), &mut acts, View::whole(&d), &mut g16)
            .unwrap();
    }
    let name = "model.layers.1.mlp.down_proj.weight";
    let (want, got) = (
        g32.download(be, name).unwrap(),
        g16.download(be, name).unwrap(),
    );
    // the mean error along each sum's sign, relative to the sums' size
    let (mut err, mut size) = (0.0f64, 0.0f64);
    for (&w, &g) in want.iter().zip(&got) {
        let sum = PASSES as f64 * f64::from(w);
        err += (f64::from(g) - sum) * sum.signum();
        size += sum.abs();
    }
    let bias = err / size;
    eprintln!(
        "{} values, {PASSES} passes: relative bias {bias:.2e}",
        want.len()
    );
    assert!(bias.abs() < 5e-3, "bias {bias:e}");
}

/// AdamW steps gradients stored in bf16 as it steps f32 gradients holding the same
/// values: the same norm and the same weights, bit for bit — with f32 weights and with
/// weights stored in bf16 (where both the gradient and the weight are bf16).
#[test]
fn adamw_steps_bf16_grads_as_their_widened_values() {
    use ares_model::backend::Stored;
    use ares_model::model::{GradDtype, WeightStorage};
    for storage in [WeightStorage::F32, WeightStorage::Bf16] {
        let fresh = || {
            let mut m = model("qwen2_tiny");
            m.set_weight_storage(storage).unwrap();
            m
        };
        let (mut a, mut b) = (fresh(), fresh());
        let batch = fixed_dlogits(&a);
        let g16 = grads_of(&a, &batch, GradDtype::Bf16);
        // f32 gradients holding the bf16 gradients' values, widened
        let be = *a.backend();
        let host: Vec<Vec<f32>> = g16
            .stored()
            .iter()
            .map(|s| match *s {
                Stored::F32(v) => {
                    let mut out = vec![0.0; v.len()];
                    be.download(v, &mut out).unwrap();
                    out
                }
                Stored::Bf16(v) => {
                    let mut bits = vec![0u16; v.len()];
                    be.download_half(v, &mut bits).unwrap();
                    bits.iter()
                        .map(|&h| f32::from_bits(u32::from(h) << 16))
                        .collect()
                }
            })
            .collect();
        let mut g32 = b.grads().unwrap();
        for (buf, v) in g32.buffers_mut().into_iter().zip(&host) {
            be.upload(v, ViewMut::whole(buf)).unwrap();
        }
        let config = AdamWConfig::default();
        let (mut opt_a, mut opt_b) = (
            AdamW::new(&a, config).unwrap(),
            AdamW::new(&b, config).unwrap(),
        );
        for _ in 0..2 {
            let ra = opt_a.step(&mut a, &g16, 1e-3, Some(0.5)).unwrap();
            let rb = opt_b.step(&mut b, &g32, 1e-3, Some(0.5)).unwrap();
            assert_eq!(
                ra.grad_norm.to_bits(),
                rb.grad_norm.to_bits(),
                "{storage:?}"
            );
            assert!(ra.applied && rb.applied);
        }
        let (wa, wb) = (a.to_weights().unwrap(), b.to_weights().unwrap());
        for (la, lb) in wa.layers.iter().zip(&wb.layers) {
            assert_eq!(la.down_proj.data, lb.down_proj.data, "{storage:?}");
            assert_eq!(la.q_proj.data, lb.q_proj.data, "{storage:?}");
            assert_eq!(
                la.input_layernorm.data, lb.input_layernorm.data,
                "{storage:?}"
            );
        }
        assert_eq!(wa.embed_tokens.data, wb.embed_tokens.data, "{storage:?}");
        assert_ne!(
            wa.layers[0].q_proj.data,
            fresh().to_weights().unwrap().layers[0].q_proj.data
        );
    }
}

/// One forward and backward of `m` from `dl` in an arena of [`Model::activations`] (the
/// model's activation dtype): the logits and the gradients.
fn pass_with_activations(
    m: &Model<CpuBackend>,
    (b, dl): &(Batch, Vec<f32>),
) -> (Vec<f32>, ares_model::model::Grads<CpuBackend>) {
    let be = m.backend();
    let mut acts = m.activations(b.batch, b.seq).unwrap();
    assert_eq!(
        acts.elements().bf16s > 0,
        m.activation_dtype() == ares_model::model::ActivationDtype::Bf16
    );
    m.forward(&b.inputs(), &mut acts).unwrap();
    let mut logits = vec![0.0; dl.len()];
    be.download(acts.logits(), &mut logits).unwrap();
    let mut d = be.alloc(dl.len()).unwrap();
    be.upload(dl, ViewMut::whole(&mut d)).unwrap();
    let mut g = m.grads().unwrap();
    m.backward(&b.inputs(), &mut acts, View::whole(&d), &mut g)
        .unwrap();
    (logits, g)
}

/// The MLP block's activations stored in bf16 (`trainer.activation_dtype: bf16`): the
/// logits and gradients stay within bf16 of the pass with f32 activations (the same bf16
/// products), the arena keeps `L·N·(C + 3I)` of its values in bf16 (half their bytes), and
/// a checkpointed arena gives the stored one's gradients bit for bit.
#[test]
fn bf16_mlp_activations_stay_within_bf16_of_f32_ones() {
    use ares_model::model::ActivationDtype;
    for name in ["qwen2_tiny", "qwen3_tiny", "llama_tiny"] {
        let mut m = model(name);
        m.set_matmul_precision(MatmulPrecision::Bf16);
        m.set_bf16_weights(true).unwrap();
        let fixed = fixed_dlogits(&m);
        let (l32, g32) = pass_with_activations(&m, &fixed);
        m.set_activation_dtype(ActivationDtype::Bf16);
        let (l16, g16) = pass_with_activations(&m, &fixed);
        let err = rel_err(&l16, &l32);
        eprintln!("{name}: logits max rel error {err:.2e}");
        assert!(err > 0.0 && err < 3e-2, "{name} logits: {err:e}");
        for param in [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.layers.1.post_attention_layernorm.weight",
        ] {
            let want = g32.download(m.backend(), param).unwrap();
            let got = g16.download(m.backend(), param).unwrap();
            let dot: f64 = got
                .iter()
                .zip(&want)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
            let cosine = dot / (norm(&got) * norm(&want));
            eprintln!("{name} {param}: cosine {cosine:.6}");
            assert!(cosine > 0.999, "{name} {param}: cosine {cosine}");
        }
        // the arena: gate and up of every layer in bf16, and act and ln2 of one (the
        // backward recomputes them)
        let s = m.spec();
        let (b, _) = &fixed;
        let n = (b.batch * b.seq) as u64;
        let acts = m.activations(b.batch, b.seq).unwrap();
        let e = acts.elements();
        let mlp =
            n * (s.layers as u64 * 2 * s.intermediate as u64 + (s.intermediate + s.hidden) as u64);
        assert_eq!(e.bf16s, mlp, "{name}");
        let f32_arena = m.activations_full(b.batch, b.seq).unwrap().elements();
        assert_eq!(f32_arena.bf16s, 0, "{name}: generation's arena stays f32");
        // less the f32 staging buffer where the backward makes ln2 again
        let stage = n * s.hidden.max(s.q_dim()) as u64;
        assert_eq!(f32_arena.bytes() - e.bytes(), 2 * mlp - 4 * stage, "{name}");
        // checkpointed: the layers' forward again, the same bits
        m.set_gradient_checkpointing(true);
        let (_, gc) = pass_with_activations(&m, &fixed);
        for param in ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"] {
            let want = g16.download(m.backend(), param).unwrap();
            let got = gc.download(m.backend(), param).unwrap();
            assert_eq!(got, want, "{name} {param}: checkpointed");
        }
    }
}

/// With bf16 MLP activations the MLP runs on the ops that read and write them as stored:
/// per layer the residual add + norm into bf16, gate and up into bf16, SwiGLU in bf16 and
/// down from bf16, and the three backward products from the saved bf16 inputs (after
/// SwiGLU again: the arena keeps one layer's `act`).
#[test]
fn bf16_mlp_activations_are_read_and_written_by_the_bf16_ops() {
    use ares_model::backend::Counting;
    use ares_model::model::ActivationDtype;
    let ck = Checkpoint::load(&fixture("qwen2_tiny")).unwrap();
    let mut m = Model::from_checkpoint(Counting::new(CpuBackend), &ck).unwrap();
    m.set_matmul_precision(MatmulPrecision::Bf16);
    m.set_weight_storage(ares_model::model::WeightStorage::Bf16)
        .unwrap();
    m.set_activation_dtype(ActivationDtype::Bf16);
    let l = m.spec().layers;
    let b = Batch::new(4, 5, m.spec().vocab);
    let targets = vec![1u32; b.batch * b.seq];
    let mut acts = m.activations(b.batch, b.seq).unwrap();
    let mut g = m.grads().unwrap();
    let calls = counted_pass(&m, &b, &targets, &mut acts, &mut g);
    let count = |op: &str| calls.iter().filter(|&&c| c == op).count();
    assert_eq!(count("add_rmsnorm_bf16"), l);
    assert_eq!(count("add_rmsnorm"), 0);
    assert_eq!(count("linear_bf16_io"), 2 * l);
    assert_eq!(count("linear_bf16_x"), l);
    assert_eq!(count("swiglu_bf16"), 2 * l);
    assert_eq!(count("swiglu_backward_bf16"), l);
    assert_eq!(count("swiglu") + count("swiglu_backward"), 0);
    assert_eq!(count("linear_backward_bf16_x"), 3 * l);
}

/// bf16 activations need bf16 products and no LoRA pair on the MLP: planning an arena
/// refuses otherwise, naming why; a pair on the attention's projections is fine.
#[test]
fn bf16_mlp_activations_refuse_what_cannot_read_them() {
    use ares_model::hf::lora::LoraConfig;
    use ares_model::model::{ActivationDtype, ModelError};
    let mut m = model("qwen2_tiny");
    m.set_activation_dtype(ActivationDtype::Bf16);
    let err = m.activations(2, 8).unwrap_err();
    assert!(matches!(err, ModelError::Bf16Activations { .. }), "{err}");
    assert!(err.to_string().contains("set_bf16_weights"), "{err}");
    m.set_matmul_precision(MatmulPrecision::Bf16);
    m.set_bf16_weights(true).unwrap();
    let lora = |targets: &[&str]| LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        use_rslora: false,
        target_modules: targets.iter().map(|t| t.to_string()).collect(),
        layers_to_transform: None,
        exclude_modules: None,
    };
    let mut attention_only = model("qwen2_tiny");
    attention_only.set_matmul_precision(MatmulPrecision::Bf16);
    attention_only.set_bf16_weights(true).unwrap();
    attention_only.set_activation_dtype(ActivationDtype::Bf16);
    attention_only
        .add_lora(&lora(&["q_proj", "v_proj"]), 1)
        .unwrap();
    let fixed = fixed_dlogits(&attention_only);
    let (logits, _) = pass_with_activations(&attention_only, &fixed);
    assert!(logits.iter().all(|x| x.is_finite()));
    m.add_lora(&lora(&["down_proj"]), 1).unwrap();
    let err = m.activations(2, 8).unwrap_err();
    assert!(
        err.to_string().contains("LoRA pair on gate, up or down"),
        "{err}"
    );
}

/// Gradients stored in bf16: each layer's seven weight gradients are written over their
/// f32 scratch by their one product each (`GradWrites::dw`: no zero fill) and folded into
/// the bf16 stacks — a pass fills no more buffers than with f32 gradients.
#[test]
fn bf16_grads_scratch_is_written_over_without_fills() {
    use ares_model::backend::Counting;
    use ares_model::model::GradDtype;
    let ck = Checkpoint::load(&fixture("qwen2_tiny")).unwrap();
    let mut m = Model::from_checkpoint(Counting::new(CpuBackend), &ck).unwrap();
    m.set_matmul_precision(MatmulPrecision::Bf16);
    let l = m.spec().layers;
    let b = Batch::new(4, 5, m.spec().vocab);
    let targets = vec![1u32; b.batch * b.seq];
    let mut acts = m.activations(b.batch, b.seq).unwrap();
    let mut counts = Vec::new();
    for dtype in [GradDtype::F32, GradDtype::Bf16] {
        let mut g = m.grads_in(dtype).unwrap();
        let calls = counted_pass(&m, &b, &targets, &mut acts, &mut g);
        let count = |op: &str| calls.iter().filter(|&&c| c == op).count();
        counts.push((count("fill"), count("accumulate_bf16_stochastic")));
    }
    assert_eq!(counts[0], (counts[1].0, 0));
    assert_eq!(counts[1].1, 7 * l);
}
