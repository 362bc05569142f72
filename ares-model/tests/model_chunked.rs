//! The chunked LM head ([`HeadMode::Chunked`]) on the CPU backend with the tiny fixtures
//! (`tests/fixtures/models`: qwen2_tiny has tied embeddings, qwen3_tiny and llama_tiny an
//! untied `lm_head`): log-probs, entropies and every parameter's gradient equal those of
//! whole logits for chunks of 1, 3, N − 1, N and more than N rows, right and left
//! padding; the arena holds `[rows, vocab]` logits; calls that need whole logits refuse a
//! chunked arena; the automatic policy.

use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::{Backend, View};
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::hf::weights::expected_tensors;
use ares_model::model::{Activations, Grads, HeadMode, KvCache, Model, ModelError};

mod common;
use common::{Batch, batch, fixture, rel_err};

/// qwen2_tiny: tied embeddings; qwen3_tiny (q/k norm) and llama_tiny: untied head.
const MODELS: [(&str, bool); 3] = [
    ("qwen2_tiny", true),
    ("qwen3_tiny", false),
    ("llama_tiny", false),
];

fn load(name: &str) -> (Checkpoint, Model<CpuBackend>) {
    load_on(CpuBackend, name)
}

fn load_on<B: Backend>(backend: B, name: &str) -> (Checkpoint, Model<B>) {
    let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(backend, &checkpoint).unwrap();
    (checkpoint, model)
}

/// Chunk sizes to try for `n` tokens: 1, 3, N − 1, N, more than N.
fn chunk_sizes(n: usize) -> [usize; 5] {
    [1, 3, n - 1, n, n + 5]
}

/// How close a chunked head must come to whole logits on one backend.
#[derive(Clone, Copy)]
struct Tolerance {
    /// One chunk of every row runs the very same ops as whole logits: bitwise equal
    /// (the CPU; a GPU's atomic adds make even a repeat differ in the last bit).
    exact_single_chunk: bool,
    /// `|a − b| / max(1, |b|)` of log-probs and entropies.
    score: f32,
    /// `max |a − b| / max |b|` of a parameter's gradient.
    grad: f64,
}

/// The CPU, on every instruction-set path (`ARES_CPU_ISA`).
///
/// Scores: a logit is a sum of `hidden` (48–64 here) products, and `gemm` orders that sum
/// by the number of rows it multiplies (a one-row chunk takes its vector kernel) and by
/// path (its AVX-512, AVX2 and scalar kernels block it differently). Another order moves a
/// logit by up to `hidden`·2⁻²⁴ ≈ 3–4e-6 of the sum of its products' magnitudes, and a
/// log-prob or an entropy by about as much as its row's logits move. Seen: 0.9e-6 on the
/// AVX-512 path, 2.0e-6 on AVX2, 2.4e-6 portable; 1e-5 holds every path with room and is
/// still far below a real mistake (1e-2 and more).
///
/// Gradients: smaller chunks add the LM head's weight gradient chunk by chunk and multiply
/// fewer rows per GEMM, so f32 sums run in another order; through the attention backward
/// of two layers that rounding reaches about 2e-6 of the largest entry (q/k projections
/// of a loss on one sequence), against 1e-2 and more for a real mistake.
const CPU: Tolerance = Tolerance {
    exact_single_chunk: true,
    score: 1e-5,
    grad: 5e-6,
};

/// Forward and scoring at `temperature`: the per-token log-probs and entropies.
fn score<B: Backend>(
    model: &Model<B>,
    acts: &mut Activations<B>,
    s: &Batch,
    temperature: f32,
) -> (Vec<f32>, Vec<f32>) {
    model.forward(&s.inputs(), acts).unwrap();
    model
        .log_prob_entropy(acts, &s.targets, temperature)
        .unwrap();
    let be = model.backend();
    let (mut lp, mut ent) = (vec![0.0; s.tokens()], vec![0.0; s.tokens()]);
    be.download(acts.log_probs(), &mut lp).unwrap();
    be.download(acts.entropies(), &mut ent).unwrap();
    (lp, ent)
}

/// Every parameter's gradient of `Σ_t coeffs_t·logπ_t` at `temperature`, by name, after a
/// forward pass (and scoring first when `score_first`).
fn gradients<B: Backend>(
    model: &Model<B>,
    checkpoint: &Checkpoint,
    acts: &mut Activations<B>,
    s: &Batch,
    coeffs: &[f32],
    temperature: f32,
    score_first: bool,
) -> Vec<(String, Vec<f32>)> {
    model.forward(&s.inputs(), acts).unwrap();
    if score_first {
        model
            .log_prob_entropy(acts, &s.targets, temperature)
            .unwrap();
    }
    let mut grads = model.grads().unwrap();
    model
        .backward_from_log_prob_grads(
            &s.inputs(),
            acts,
            &s.targets,
            coeffs,
            temperature,
            &mut grads,
        )
        .unwrap();
    named_grads(model, checkpoint, &grads)
}

fn named_grads<B: Backend>(
    model: &Model<B>,
    checkpoint: &Checkpoint,
    grads: &Grads<B>,
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
fn fixtures_cover_tied_and_untied_heads() {
    for (name, tied) in MODELS {
        let (checkpoint, model) = load(name);
        assert_eq!(model.spec().tied_embeddings, tied, "{name}");
        let has_head = expected_tensors(&checkpoint.config)
            .iter()
            .any(|(n, _)| n == "lm_head.weight");
        assert_eq!(has_head, !tied, "{name}");
    }
}

/// Chunked log-probs and entropies of every fixture, both paddings, two temperatures and
/// every chunk size equal those of whole logits within `tol`.
fn check_scores<B: Backend + Clone>(backend: &B, tol: Tolerance) {
    for (name, _) in MODELS {
        let (_, model) = load_on(backend.clone(), name);
        for set in ["right", "left"] {
            let s = batch(name, set);
            for temperature in [1.0f32, 0.7] {
                let mut full = model.activations_full(s.batch, s.seq).unwrap();
                let (want_lp, want_ent) = score(&model, &mut full, &s, temperature);
                for rows in chunk_sizes(s.tokens()) {
                    let mut acts = model.activations_chunked(s.batch, s.seq, rows).unwrap();
                    // Twice on one arena: reused buffers leave nothing behind.
                    for _ in 0..2 {
                        let (lp, ent) = score(&model, &mut acts, &s, temperature);
                        let pairs = lp.iter().zip(&want_lp).zip(ent.iter().zip(&want_ent));
                        for (t, ((a, b), (c, d))) in pairs.enumerate() {
                            let ctx = format!("{name} {set} T={temperature} rows={rows} t={t}");
                            if tol.exact_single_chunk && rows >= s.tokens() {
                                let bits = (a.to_bits(), c.to_bits());
                                assert_eq!(bits, (b.to_bits(), d.to_bits()), "{ctx}");
                            }
                            let close =
                                |x: f32, y: f32| (x - y).abs() <= tol.score * y.abs().max(1.0);
                            assert!(close(*a, *b), "{ctx}: log-prob {a} vs {b}");
                            assert!(close(*c, *d), "{ctx}: entropy {c} vs {d}");
                        }
                    }
                }
            }
        }
    }
}

/// Every parameter's gradient through a chunked head, for every fixture (tied and untied
/// heads), both paddings and every chunk size, equals that of whole logits within `tol`.
fn check_gradients<B: Backend + Clone>(backend: &B, tol: Tolerance) {
    for (name, _) in MODELS {
        let (checkpoint, model) = load_on(backend.clone(), name);
        for set in ["right", "left"] {
            let s = batch(name, set);
            for (temperature, score_first) in [(1.0f32, true), (0.7, false)] {
                let mut full = model.activations_full(s.batch, s.seq).unwrap();
                let want = gradients(
                    &model,
                    &checkpoint,
                    &mut full,
                    &s,
                    &s.coeffs,
                    temperature,
                    score_first,
                );
                for rows in chunk_sizes(s.tokens()) {
                    let mut acts = model.activations_chunked(s.batch, s.seq, rows).unwrap();
                    let ours = gradients(
                        &model,
                        &checkpoint,
                        &mut acts,
                        &s,
                        &s.coeffs,
                        temperature,
                        score_first,
                    );
                    let exact = tol.exact_single_chunk && rows >= s.tokens();
                    let allowed = if exact { 0.0 } else { tol.grad };
                    for ((param, a), (_, b)) in ours.iter().zip(&want) {
                        let err = rel_err(a, b);
                        let ctx = format!("{name} {set} T={temperature} rows={rows} {param}");
                        assert!(err <= allowed, "{ctx}: {err:e}");
                        assert!(b.iter().any(|&x| x != 0.0), "{ctx}: zero gradient");
                    }
                }
            }
        }
    }
}

#[test]
fn chunked_log_probs_and_entropies_equal_whole_logits() {
    check_scores(&CpuBackend, CPU);
}

#[test]
fn chunked_gradients_equal_whole_logits() {
    check_gradients(&CpuBackend, CPU);
}

#[test]
fn chunks_without_coefficients_are_skipped_without_changing_the_gradients() {
    // Only the second sequence carries a loss: with 3-row chunks the first chunks have no
    // nonzero coefficient and are skipped; the gradient must still be the whole head's.
    for (name, _) in MODELS {
        let (checkpoint, model) = load(name);
        let s = batch(name, "left");
        let mut coeffs = s.coeffs.clone();
        coeffs[..s.seq].iter_mut().for_each(|c| *c = 0.0);
        assert!(coeffs.iter().any(|&c| c != 0.0));
        let mut full = model.activations_full(s.batch, s.seq).unwrap();
        let want = gradients(&model, &checkpoint, &mut full, &s, &coeffs, 1.0, false);
        let mut acts = model.activations_chunked(s.batch, s.seq, 3).unwrap();
        let ours = gradients(&model, &checkpoint, &mut acts, &s, &coeffs, 1.0, false);
        for ((param, a), (_, b)) in ours.iter().zip(&want) {
            let err = rel_err(a, b);
            assert!(err <= CPU.grad, "{name} {param}: {err:e}");
        }
        // No loss at all: nothing but zeros is added.
        let zero = vec![0.0f32; s.tokens()];
        for (param, g) in gradients(&model, &checkpoint, &mut acts, &s, &zero, 1.0, false) {
            assert!(g.iter().all(|&x| x == 0.0), "{name} {param}");
        }
    }
}

#[test]
fn a_chunked_arena_holds_rows_times_vocab_logits() {
    let (_, model) = load("qwen3_tiny");
    let vocab = model.spec().vocab;
    let s = batch("qwen3_tiny", "right");
    let n = s.tokens();
    for rows in chunk_sizes(n) {
        let acts = model.activations_chunked(s.batch, s.seq, rows).unwrap();
        let planned = rows.min(n);
        assert_eq!(acts.head_mode(), HeadMode::Chunked { rows: planned });
        assert_eq!(acts.logits_buffer_len(), planned * vocab, "rows={rows}");
        assert!(acts.logits().is_empty());
    }
    let full = model.activations_full(s.batch, s.seq).unwrap();
    assert_eq!(full.head_mode(), HeadMode::Full);
    assert_eq!(full.logits_buffer_len(), n * vocab);
    assert_eq!(full.logits().len(), n * vocab);
}

#[test]
fn small_batches_keep_whole_logits_by_default() {
    let (_, model) = load("llama_tiny");
    let acts = model.activations(2, 7).unwrap();
    assert_eq!(acts.head_mode(), HeadMode::Full);
    // 256 MiB of logits is the boundary of the automatic policy.
    let vocab = 151_936;
    let limit_tokens = HeadMode::AUTO_LOGITS_BYTES / (4 * vocab);
    assert_eq!(HeadMode::auto(limit_tokens, vocab), HeadMode::Full);
    assert_eq!(
        HeadMode::auto(8 * 1024, vocab),
        HeadMode::Chunked { rows: 441 }
    );
    assert_eq!(
        HeadMode::auto(limit_tokens + 1, vocab),
        HeadMode::Chunked { rows: 441 }
    );
}

#[test]
fn calls_needing_whole_logits_refuse_a_chunked_arena() {
    let (_, model) = load("qwen2_tiny");
    let s = batch("qwen2_tiny", "right");
    let mut acts = model.activations_chunked(s.batch, s.seq, 4).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();

    let mut out = vec![0.0; s.tokens() * model.spec().vocab];
    let err = model.download_logits(&acts, &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::ChunkedLogits {
                what: "download_logits",
                rows: 4
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("activations_full"), "{err}");

    let be = model.backend();
    let dlogits = be.alloc(out.len()).unwrap();
    let mut grads = model.grads().unwrap();
    let err = model
        .backward(&s.inputs(), &mut acts, View::whole(&dlogits), &mut grads)
        .unwrap_err();
    assert!(
        matches!(err, ModelError::ChunkedLogits { rows: 4, .. }),
        "{err}"
    );

    let mut cache = KvCache::new(be, model.spec(), s.batch, s.seq).unwrap();
    let err = model
        .forward_cached(&s.inputs(), &mut acts, &mut cache)
        .unwrap_err();
    assert!(err.to_string().contains("chunked LM head"), "{err}");
    assert_eq!(cache.len(), 0);

    let err = model.activations_chunked(s.batch, s.seq, 0).unwrap_err();
    assert!(matches!(err, ModelError::InvalidValue { .. }), "{err}");
    assert!(err.to_string().contains("chunk rows"), "{err}");
}

#[test]
fn chunked_scoring_checks_its_arguments() {
    let (_, model) = load("llama_tiny");
    let s = batch("llama_tiny", "right");
    let mut acts = model.activations_chunked(s.batch, s.seq, 5).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    let mut bad = s.targets.clone();
    bad[9] = 97;
    let err = model.log_prob_entropy(&mut acts, &bad, 1.0).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::TokenOutOfRange {
                index: 9,
                id: 97,
                ..
            }
        ),
        "{err}"
    );
    let short = &s.targets[1..];
    assert!(model.log_prob_entropy(&mut acts, short, 1.0).is_err());
    let mut grads = model.grads().unwrap();
    let mut coeffs = s.coeffs.clone();
    coeffs[3] = f32::NAN;
    let err = model
        .backward_from_log_prob_grads(&s.inputs(), &mut acts, &s.targets, &coeffs, 1.0, &mut grads)
        .unwrap_err();
    assert!(err.to_string().contains("coeffs[3]"), "{err}");
}

/// The same comparisons on the CUDA backend (owed: skipped without a GPU, unless
/// `ARES_REQUIRE_GPU=1`). cuBLAS picks its algorithm by shape and the backward kernels add
/// atomically, so nothing is bitwise; 1e-5 still tells rounding from a wrong row.
#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use ares_model::backend::cuda::CudaBackend;

    const GPU: Tolerance = Tolerance {
        exact_single_chunk: false,
        score: 1e-5,
        grad: 1e-5,
    };

    fn gpu_or_skip() -> Option<CudaBackend> {
        match CudaBackend::new(0) {
            Ok(be) => Some(be),
            Err(e) => {
                let required = std::env::var("ARES_REQUIRE_GPU").is_ok_and(|v| v == "1");
                assert!(!required, "ARES_REQUIRE_GPU=1 but no usable GPU: {e}");
                eprintln!("skipped (no GPU): {e}");
                None
            }
        }
    }

    #[test]
    fn chunked_head_equals_whole_logits_on_the_gpu() {
        if let Some(gpu) = gpu_or_skip() {
            check_scores(&gpu, GPU);
            check_gradients(&gpu, GPU);
        }
    }
}
