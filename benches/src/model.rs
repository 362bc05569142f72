//! Shared pieces of the model benchmarks (`model_cpu`, `model_cuda`, `rollout`,
//! `rollout_cuda`): random weights for a config, best/median timing, the report line,
//! environment knobs, the rollout workload and an engine run.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ares_model::backend::Backend;
use ares_model::hf::config::ModelConfig;
use ares_model::hf::weights::{ModelWeights, Tensor, expected_tensors};
use ares_model::model::{
    Engine, EngineConfig, EngineRequest, EngineStats, GenerateOutput, GenerateRequest, Generator,
    Sampling,
};

use crate::SplitMix;

/// Random weights for `config`: norms 1, everything else uniform with standard deviation
/// 0.02 (the `initializer_range` of transformers' init).
///
/// # Panics
/// If `config`'s own tensor list does not build a model (a bench config bug).
pub fn random_weights(config: &ModelConfig, rng: &mut SplitMix) -> ModelWeights {
    let half_width = 0.02 * 3f32.sqrt();
    let map: HashMap<String, Tensor> = expected_tensors(config)
        .into_iter()
        .map(|(name, shape)| {
            let mut t = Tensor::zeros(&shape);
            if name.ends_with("norm.weight") {
                t.data.fill(1.0);
            } else {
                t.data
                    .iter_mut()
                    .for_each(|x| *x = (2.0 * rng.unit() - 1.0) * half_width);
            }
            (name, t)
        })
        .collect();
    ModelWeights::from_map(config, map).expect("the bench config's own tensors")
}

/// Best and median of `runs` (at least 1) timings of `f`, after one warm-up call.
pub fn best_and_median(runs: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    f();
    let mut t: Vec<Duration> = (0..runs.max(1))
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    t.sort();
    (t[0], t[t.len() / 2])
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
