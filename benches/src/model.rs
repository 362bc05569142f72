//! Shared pieces of the model benchmarks (`model_cpu`, `model_cuda`): random weights for a
//! config, best/median timing, the report line, and environment knobs.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ares_model::hf::config::ModelConfig;
use ares_model::hf::weights::{ModelWeights, Tensor, expected_tensors};

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
