//! Packed sequences (`ForwardExtras::segments`): several sequences back to back in one row,
//! each attending only to itself, give the log-probs, entropies and gradients of the same
//! sequences right-padded into a batch — on the tiny fixtures (Qwen2 with q/k/v biases,
//! Qwen3 with q/k norms), in f32 and with bf16 products, with and without activation
//! checkpointing, with the attention on the backend's segments and padded by gathers (what
//! CUDA runs). Plus the refusals: a batch of several rows, offsets out of order.

use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::{Backend, MatmulPrecision};
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::model::{Activations, ForwardExtras, Grads, Inputs, Model, ModelError};

mod common;
use common::fixture;

/// Sequences of these lengths, and a pad of 3 tokens after them in the packed row.
const LENS: [usize; 4] = [5, 9, 1, 3];
const TAIL: usize = 3;

/// The parameters compared (a layer's attention and MLP weights, biases, the embedding).
const PARAMS: [&str; 4] = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
];

/// A layout's host tensors: ids, mask, positions, next-token targets and loss
/// coefficients (`-1/N` on each sequence's tokens that have a next token, 0 elsewhere).
struct Layout {
    batch: usize,
    seq: usize,
    ids: Vec<u32>,
    mask: Vec<u32>,
    positions: Vec<u32>,
    targets: Vec<u32>,
    coeffs: Vec<f32>,
    /// Where token `j` of sequence `i` is, in the flattened layout.
    at: Vec<Vec<usize>>,
}

impl Layout {
    fn inputs(&self) -> Inputs<'_> {
        Inputs {
            batch: self.batch,
            seq: self.seq,
            input_ids: &self.ids,
            attention_mask: &self.mask,
            position_ids: &self.positions,
        }
    }

    /// `rows × seq` empty, then sequence `i` placed from flat index `start(i)`.
    fn place(batch: usize, seq: usize, seqs: &[Vec<u32>], start: impl Fn(usize) -> usize) -> Self {
        let n = batch * seq;
        let tokens: usize = seqs.iter().map(|s| s.len().saturating_sub(1)).sum();
        let mut l = Layout {
            batch,
            seq,
            ids: vec![0; n],
            mask: vec![0; n],
            positions: vec![0; n],
            targets: vec![0; n],
            coeffs: vec![0.0; n],
            at: Vec::new(),
        };
        for (i, s) in seqs.iter().enumerate() {
            let at: Vec<usize> = (0..s.len()).map(|j| start(i) + j).collect();
            for (j, (&c, &id)) in at.iter().zip(s).enumerate() {
                l.ids[c] = id;
                l.mask[c] = 1;
                l.positions[c] = j as u32;
                if j + 1 < s.len() {
                    l.targets[c] = s[j + 1];
                    l.coeffs[c] = -1.0 / tokens as f32;
                }
            }
            l.at.push(at);
        }
        l
    }
}

fn sequences(vocab: usize) -> Vec<Vec<u32>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    LENS.iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

/// Offsets of the packed row: the sequences, then the pad as a segment of its own.
fn cu_seqlens() -> Vec<u32> {
    let mut cu = vec![0u32];
    for n in LENS.iter().chain([&TAIL]) {
        cu.push(cu.last().unwrap() + *n as u32);
    }
    cu
}

/// Forward, log-probs and entropies, backward from the coefficients: (log-probs,
/// entropies, gradients of [`PARAMS`]), each sequence's tokens in order.
fn run(
    model: &Model<CpuBackend>,
    l: &Layout,
    segments: Option<&[u32]>,
) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let be = model.backend();
    let mut acts: Activations<CpuBackend> = model.activations(l.batch, l.seq).unwrap();
    let extras = ForwardExtras {
        segments,
        ..ForwardExtras::default()
    };
    model.forward_with(&l.inputs(), &extras, &mut acts).unwrap();
    model.log_prob_entropy(&mut acts, &l.targets, 1.0).unwrap();
    let n = l.batch * l.seq;
    let (mut lp, mut ent) = (vec![0.0; n], vec![0.0; n]);
    be.download(acts.log_probs(), &mut lp).unwrap();
    be.download(acts.entropies(), &mut ent).unwrap();
    let mut grads: Grads<CpuBackend> = model.grads().unwrap();
    model
        .backward_from_log_prob_grads(
            &l.inputs(),
            &mut acts,
            &l.targets,
            &l.coeffs,
            1.0,
            &mut grads,
        )
        .unwrap();
    let pick = |v: &[f32]| -> Vec<f32> { l.at.iter().flatten().map(|&c| v[c]).collect() };
    let g = PARAMS
        .iter()
        .map(|p| grads.download(be, p).unwrap())
        .collect();
    (pick(&lp), pick(&ent), g)
}

fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}[{i}]: {g} vs {w} (scale {scale})"
        );
    }
}

fn check(name: &str, precision: MatmulPrecision, checkpointing: bool, native: bool) {
    let ckpt = Checkpoint::load(&fixture(name)).unwrap();
    let mut model = Model::from_checkpoint(CpuBackend, &ckpt).unwrap();
    model.set_matmul_precision(precision);
    model.set_gradient_checkpointing(checkpointing);
    model.set_native_packed_attention(native);
    let seqs = sequences(model.spec().vocab);
    let longest = *LENS.iter().max().unwrap();
    let padded = Layout::place(LENS.len(), longest, &seqs, |i| i * longest);
    let starts = cu_seqlens();
    let tokens = *starts.last().unwrap() as usize;
    let packed = Layout::place(1, tokens, &seqs, |i| starts[i] as usize);
    let want = run(&model, &padded, None);
    let got = run(&model, &packed, Some(&starts));
    // The same products over other row counts: the GEMMs' summation order differs by the
    // blocking of 20 against 36 rows, nothing else (the attention is per sequence either way).
    let tol = if precision == MatmulPrecision::Bf16 {
        2e-2
    } else {
        1e-5
    };
    let what = |x: &str| format!("{name} {precision:?} ckpt {checkpointing} native {native}: {x}");
    close(&what("log-probs"), &got.0, &want.0, tol);
    close(&what("entropies"), &got.1, &want.1, tol);
    for ((p, g), w) in PARAMS.iter().zip(&got.2).zip(&want.2) {
        close(&what(p), g, w, tol);
    }
}

#[test]
fn qwen2_packed_equals_padded() {
    check("qwen2_tiny", MatmulPrecision::F32, false, true);
    check("qwen2_tiny", MatmulPrecision::F32, true, true);
}

#[test]
fn qwen3_packed_equals_padded_in_f32_and_bf16() {
    check("qwen3_tiny", MatmulPrecision::F32, false, true);
    check("qwen3_tiny", MatmulPrecision::Bf16, false, true);
}

/// The attention padded by gathers (segments right-aligned in `[segments, longest]` rows):
/// the padding slots' copied rows must add nothing to the real tokens' gradients.
#[test]
fn packed_through_the_padded_attention_equals_padded() {
    check("qwen2_tiny", MatmulPrecision::F32, false, false);
    check("qwen2_tiny", MatmulPrecision::F32, true, false);
    check("qwen3_tiny", MatmulPrecision::Bf16, false, false);
}

/// Without the segments the packed row is one long sequence: later sequences see earlier
/// ones and their log-probs change (so the comparison above can fail).
#[test]
fn without_segments_the_sequences_see_each_other() {
    let ckpt = Checkpoint::load(&fixture("qwen2_tiny")).unwrap();
    let model = Model::from_checkpoint(CpuBackend, &ckpt).unwrap();
    let seqs = sequences(model.spec().vocab);
    let starts = cu_seqlens();
    let packed = Layout::place(1, *starts.last().unwrap() as usize, &seqs, |i| {
        starts[i] as usize
    });
    let with = run(&model, &packed, Some(&starts));
    let without = run(&model, &packed, None);
    let first = LENS[0];
    close(
        "the first sequence",
        &with.0[..first],
        &without.0[..first],
        1e-5,
    );
    let scale = with.0.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let worst = with.0[first..]
        .iter()
        .zip(&without.0[first..])
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst > 1e-2 * scale, "{worst} against a scale of {scale}");
}

/// One arena through packed passes of other layouts (the gathered attention's scratch kept
/// when the new layout's slots fit, made anew when not): each pass's log-probs are those of
/// a fresh arena, bit for bit.
#[test]
fn one_arena_serves_packed_passes_of_other_layouts() {
    let ckpt = Checkpoint::load(&fixture("qwen2_tiny")).unwrap();
    let mut model = Model::from_checkpoint(CpuBackend, &ckpt).unwrap();
    model.set_native_packed_attention(false);
    let tokens = *cu_seqlens().last().unwrap() as usize;
    let ids: Vec<u32> = (0..tokens as u32).map(|i| (i * 31 + 7) % 64).collect();
    let mask = vec![1u32; tokens];
    let targets: Vec<u32> = ids.iter().skip(1).copied().chain([0]).collect();
    let t = tokens as u32;
    let layouts: [Vec<u32>; 4] = [
        cu_seqlens(),       // 5 segments, longest 9: 45 slots
        vec![0, 1, 2, t],   // 3 × 19 = 57 slots: new scratch
        vec![0, 10, 20, t], // 3 × 10 = 30 slots: kept
        vec![0, t],         // one sequence, 21 slots: kept
    ];
    let pass = |acts: &mut Activations<CpuBackend>, cu: &[u32]| -> Vec<f32> {
        let mut positions = vec![0u32; tokens];
        for w in cu.windows(2) {
            for i in w[0]..w[1] {
                positions[i as usize] = i - w[0];
            }
        }
        let inputs = Inputs {
            batch: 1,
            seq: tokens,
            input_ids: &ids,
            attention_mask: &mask,
            position_ids: &positions,
        };
        let extras = ForwardExtras {
            segments: Some(cu),
            ..ForwardExtras::default()
        };
        model.forward_with(&inputs, &extras, acts).unwrap();
        model.log_prob_entropy(acts, &targets, 1.0).unwrap();
        let mut lp = vec![0.0f32; tokens];
        model.backend().download(acts.log_probs(), &mut lp).unwrap();
        lp
    };
    let mut kept = model.activations(1, tokens).unwrap();
    for cu in &layouts {
        let again = pass(&mut kept, cu);
        let fresh = pass(&mut model.activations(1, tokens).unwrap(), cu);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&again), bits(&fresh), "{cu:?}");
    }
}

#[test]
fn bad_segments_are_refused_naming_them() {
    let ckpt = Checkpoint::load(&fixture("qwen2_tiny")).unwrap();
    let model = Model::from_checkpoint(CpuBackend, &ckpt).unwrap();
    let seqs = sequences(model.spec().vocab);
    let starts = cu_seqlens();
    let tokens = *starts.last().unwrap() as usize;
    let packed = Layout::place(1, tokens, &seqs, |i| starts[i] as usize);
    let mut acts = model.activations(1, tokens).unwrap();
    for bad in [
        &[0u32, 5, 4, tokens as u32][..],
        &[0, 5],
        &[1, tokens as u32],
    ] {
        let extras = ForwardExtras {
            segments: Some(bad),
            ..ForwardExtras::default()
        };
        let e = model
            .forward_with(&packed.inputs(), &extras, &mut acts)
            .unwrap_err();
        assert!(
            matches!(&e, ModelError::InvalidValue { what, .. } if what.contains("cu_seqlens")),
            "{bad:?}: {e}"
        );
    }
    let longest = *LENS.iter().max().unwrap();
    let padded = Layout::place(LENS.len(), longest, &seqs, |i| i * longest);
    let mut acts = model.activations(LENS.len(), longest).unwrap();
    let cu = [0u32, longest as u32];
    let extras = ForwardExtras {
        segments: Some(&cu),
        ..ForwardExtras::default()
    };
    let e = model
        .forward_with(&padded.inputs(), &extras, &mut acts)
        .unwrap_err();
    assert!(
        e.to_string().contains("packed sequences are one row"),
        "{e}"
    );
}
