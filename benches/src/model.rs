//! Shared pieces of the model benchmarks (`model_cpu`, `model_cuda`, `rollout`,
//! `rollout_cuda`): random weights for a config, best/median timing, the report line,
//! environment knobs, the rollout workload and an engine run.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ares_model::backend::Backend;
use ares_model::hf::config::ModelConfig;
use ares_model::hf::weights::{ModelWeights, Tensor, expected_tensors};
use ares_model::model::{
    Engine, EngineConfig, EngineRequest, EngineStats, ForwardExtras, GenerateOutput,
    GenerateRequest, Generator, Inputs, Model, Sampling,
};

use crate::SplitMix;
use rayon::prelude::*;

/// Random weights for `config`: norms 1, everything else uniform with standard deviation
/// 0.02 (the `initializer_range` of transformers' init).
///
/// # Panics
/// If `config`'s own tensor list does not build a model (a bench config bug).
pub fn random_weights(config: &ModelConfig, rng: &mut SplitMix) -> ModelWeights {
    let map: HashMap<String, Tensor> = expected_tensors(config)
        .into_iter()
        .map(|(name, shape)| random_tensor(name, &shape, rng))
        .collect();
    ModelWeights::from_map(config, map).expect("the bench config's own tensors")
}

/// [`random_weights`] with each tensor from its own stream (`seed` and the tensor's index),
/// the tensors drawn in parallel: a 3B shape's values in seconds, the same for any number
/// of threads.
///
/// # Panics
/// As [`random_weights`].
pub fn random_weights_parallel(config: &ModelConfig, seed: u64) -> ModelWeights {
    let map: HashMap<String, Tensor> = expected_tensors(config)
        .into_par_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let mut rng = SplitMix::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9));
            random_tensor(name, &shape, &mut rng)
        })
        .collect();
    ModelWeights::from_map(config, map).expect("the bench config's own tensors")
}

/// Tensor `name` of `shape`: ones for a norm, else uniform with standard deviation 0.02.
fn random_tensor(name: String, shape: &[usize], rng: &mut SplitMix) -> (String, Tensor) {
    let half_width = 0.02 * 3f32.sqrt();
    let mut t = Tensor::zeros(shape);
    if name.ends_with("norm.weight") {
        t.data.fill(1.0);
    } else {
        t.data
            .iter_mut()
            .for_each(|x| *x = (2.0 * rng.unit() - 1.0) * half_width);
    }
    (name, t)
}

/// Best and median of `runs` (at least 1) timings of `f`, after one warm-up call.
pub fn best_and_median(runs: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    let never = try_best_and_median(runs, || -> Result<(), std::convert::Infallible> {
        f();
        Ok(())
    });
    match never {
        Ok(t) => t,
        Err(e) => match e {},
    }
}

/// [`best_and_median`] of a fallible `f`: the first error ends it.
pub fn try_best_and_median<E>(
    runs: usize,
    mut f: impl FnMut() -> Result<(), E>,
) -> Result<(Duration, Duration), E> {
    f()?;
    let mut t = Vec::with_capacity(runs.max(1));
    for _ in 0..runs.max(1) {
        let start = Instant::now();
        f()?;
        t.push(start.elapsed());
    }
    t.sort();
    Ok((t[0], t[t.len() / 2]))
}

/// Prints `what: <rate> <unit>/s best (<ms>), <rate> <unit>/s median (<ms>)` for `units`
/// of work per call.
pub fn report(what: &str, units: usize, unit: &str, (best, median): (Duration, Duration)) {
    let rate = |d: Duration| units as f64 / d.as_secs_f64();
    println!(
        "{what}: {:.0} {unit}/s best ({:.1} ms), {:.0} {unit}/s median ({:.1} ms)",
        rate(best),
        best.as_secs_f64() * 1e3,
        rate(median),
        median.as_secs_f64() * 1e3,
    );
}

/// The environment variable `key` as a number, or `default` when unset or not a number.
pub fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The benchmarks' small Qwen2-shaped model (4 layers, hidden 256, 4 query / 2 KV heads of
/// 64, MLP 704, vocab 8192, tied embeddings): `config.json` text.
pub const BENCH_MODEL: &str = r#"{
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": true
}"#;

/// Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 query / 2 KV heads of 64, MLP 4864,
/// vocab 151 936, tied embeddings; random weights in the benches): `config.json` text.
pub const QWEN05_MODEL: &str = r#"{
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": true
}"#;

/// Qwen2.5-1.5B's shape (28 layers, hidden 1536, 12 query / 2 KV heads of 128, MLP 8960,
/// vocab 151 936, tied embeddings; as `ares-runner init --shape qwen2.5-1.5b`).
pub const QWEN15_MODEL: &str = r#"{
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": true
}"#;

/// Qwen2.5-3B's shape (36 layers, hidden 2048, 16 query / 2 KV heads of 128, MLP 11008,
/// vocab 151 936, tied embeddings; as `ares-runner init --shape qwen2.5-3b`).
pub const QWEN3B_MODEL: &str = r#"{
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
    "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": true
}"#;

/// The RL rollout's request: `prompts` random prompts of 90–110 tokens, each `n` times,
/// sampled at T = 1 up to `max_new` tokens; with `eos`, ~1 % of the vocabulary are EOS ids
/// (a random model samples one with probability ≈ 1 % a token: roughly geometric lengths),
/// without, every sequence runs to `max_new`.
pub fn rollout_request(
    rng: &mut SplitMix,
    vocab: u64,
    prompts: usize,
    n: usize,
    max_new: usize,
    eos: bool,
) -> GenerateRequest {
    let mut eos_ids: Vec<u32> = if eos {
        (0..(vocab as u32).div_ceil(100))
            .map(|i| 100 + 97 * i)
            .collect()
    } else {
        Vec::new()
    };
    eos_ids.sort_unstable();
    GenerateRequest {
        prompts: (0..prompts)
            .flat_map(|_| {
                let len = 90 + (rng.next_u64() % 21) as usize;
                let p: Vec<u32> = (0..len).map(|_| (rng.next_u64() % vocab) as u32).collect();
                std::iter::repeat_n(p, n)
            })
            .collect(),
        max_new_tokens: max_new,
        eos_ids,
        sampling: Sampling::with_temperature(1.0),
        seed: 3,
    }
}

/// `request` through an engine of `slots` decode slots (unbounded KV pool): the outputs and
/// the engine's statistics.
///
/// # Panics
/// If the engine fails (a bench bug).
pub fn engine_run<B: Backend>(
    generator: &Generator<'_, B>,
    request: &GenerateRequest,
    slots: usize,
) -> (GenerateOutput, EngineStats) {
    let engine_request = EngineRequest {
        max_new_tokens: request.max_new_tokens,
        eos_ids: request.eos_ids.clone(),
        sampling: request.sampling,
        seed: request.seed,
    };
    let config = EngineConfig {
        max_seqs: slots,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(generator, engine_request, config).expect("engine");
    for p in &request.prompts {
        engine.submit(p.clone()).expect("submit");
    }
    let out = engine.run_to_end(&mut |_, _| {}).expect("generate");
    (out, engine.stats())
}

/// A ragged batch's host tensors in one layout: ids, mask, positions, next-token targets and
/// `∂L/∂logπ = −1/N` on the response tokens.
struct Laid {
    batch: usize,
    seq: usize,
    ids: Vec<u32>,
    mask: Vec<u32>,
    positions: Vec<u32>,
    targets: Vec<u32>,
    coeffs: Vec<f32>,
}

impl Laid {
    /// Sample `i` (`prompt ++ response`) at flat index `start(i)`, the prompt's first token
    /// there.
    fn new(
        batch: usize,
        seq: usize,
        samples: &[(Vec<u32>, Vec<u32>)],
        start: impl Fn(usize) -> usize,
    ) -> Self {
        let n = batch * seq;
        let responses: usize = samples.iter().map(|s| s.1.len()).sum();
        let mut l = Laid {
            batch,
            seq,
            ids: vec![0; n],
            mask: vec![0; n],
            positions: vec![0; n],
            targets: vec![0; n],
            coeffs: vec![0.0; n],
        };
        for (i, (p, a)) in samples.iter().enumerate() {
            let all: Vec<u32> = p.iter().chain(a).copied().collect();
            for (k, &id) in all.iter().enumerate() {
                let c = start(i) + k;
                l.ids[c] = id;
                l.mask[c] = 1;
                l.positions[c] = k as u32;
                if k + 1 < all.len() {
                    l.targets[c] = all[k + 1];
                    if k + 1 >= p.len() {
                        l.coeffs[c] = -1.0 / responses as f32;
                    }
                }
            }
        }
        l
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

/// The RL update's shape, ragged: 16 samples of a prompt (16–47 tokens) and a long-tailed
/// response (8–191) from a vocabulary of `vocab`, forward + backward from the responses'
/// log-probs, laid out padded (`[16, P + T]`, prompts left-padded, responses right-padded)
/// beside packed (one row with `cu_seqlens` segments: the model's default path on this
/// backend), and where the backend takes segments also packed with the attention padded by
/// gathers (the path of a backend without them); `sync` waits for the device. Prints
/// tokens/s of real tokens and the ratios, same run.
///
/// # Panics
/// A model or backend failure (a bench bug).
pub fn ragged<B: Backend>(
    model: &mut Model<B>,
    rng: &mut SplitMix,
    runs: usize,
    vocab: u64,
    sync: impl Fn(),
) {
    let samples: Vec<(Vec<u32>, Vec<u32>)> = (0..16)
        .map(|_| {
            let p = 16 + (rng.next_u64() % 32) as usize;
            // long-tailed: most responses short, a few near the cap (as sampled ones are)
            let u = (rng.next_u64() % 1000) as f64 / 1000.0;
            let a = 8 + (183.0 * u.powi(3)) as usize;
            let tok = |rng: &mut SplitMix| (rng.next_u64() % vocab) as u32;
            (
                (0..p).map(|_| tok(rng)).collect(),
                (0..a).map(|_| tok(rng)).collect(),
            )
        })
        .collect();
    let (pmax, amax) = samples
        .iter()
        .fold((0, 0), |(p, a), s| (p.max(s.0.len()), a.max(s.1.len())));
    let seq = pmax + amax;
    let padded = Laid::new(samples.len(), seq, &samples, |i| {
        i * seq + pmax - samples[i].0.len()
    });
    let mut cu = vec![0u32];
    for s in &samples {
        cu.push(cu[cu.len() - 1] + (s.0.len() + s.1.len()) as u32);
    }
    let tokens = cu[cu.len() - 1] as usize;
    let packed = Laid::new(1, tokens, &samples, |i| cu[i] as usize);
    println!(
        "ragged batch: 16 samples, {tokens} tokens; padded [16, {seq}] = {} positions ({:.2}× the tokens)",
        16 * seq,
        (16 * seq) as f64 / tokens as f64
    );
    let mut grads = model.grads().expect("grads");
    let mut time = |model: &Model<B>, l: &Laid, segments: Option<&[u32]>| {
        let be = model.backend();
        let mut acts = model.activations(l.batch, l.seq).expect("activations");
        let extras = ForwardExtras {
            segments,
            ..ForwardExtras::default()
        };
        best_and_median(runs, || {
            grads.zero(be).expect("zero");
            model
                .forward_with(&l.inputs(), &extras, &mut acts)
                .expect("forward");
            model
                .backward_from_log_prob_grads(
                    &l.inputs(),
                    &mut acts,
                    &l.targets,
                    &l.coeffs,
                    1.0,
                    &mut grads,
                )
                .expect("backward");
            sync();
        })
    };
    let tp = time(model, &padded, None);
    report("ragged forward+backward, padded", tokens, "tokens", tp);
    let native = model.backend().packs_sequences();
    let what = if native {
        "packed (segments in the attention)"
    } else {
        "packed, attention padded by gathers"
    };
    let tk = time(model, &packed, Some(&cu));
    report(
        &format!("ragged forward+backward, {what}"),
        tokens,
        "tokens",
        tk,
    );
    let ratio = |t: (Duration, Duration)| {
        (
            t.0.as_secs_f64() / tp.0.as_secs_f64(),
            t.1.as_secs_f64() / tp.1.as_secs_f64(),
        )
    };
    let (kb, km) = ratio(tk);
    println!("  time ratio {what} / padded: {kb:.2} best, {km:.2} median");
    if native {
        // the path of a backend without segments: the attention gathered into padded rows
        model.set_native_packed_attention(false);
        let tg = time(model, &packed, Some(&cu));
        model.set_native_packed_attention(true);
        let what = "packed, attention padded by gathers";
        report(
            &format!("ragged forward+backward, {what}"),
            tokens,
            "tokens",
            tg,
        );
        let (gb, gm) = ratio(tg);
        println!("  time ratio {what} / padded: {gb:.2} best, {gm:.2} median");
    }
}
