//! The RL rollout workload on the CPU backend: P prompts of ~100 tokens × n = 8 samples,
//! sampled at T = 1, responses of long-tailed length (a set of EOS ids that a random model
//! samples with probability ≈ 1 % per token, so lengths are roughly geometric, mean ~70, cut
//! at the maximum), generated three ways in the same run:
//!
//! - **static**: [`Generator::static_batching`] — every sequence prefilled on its own row,
//!   every row kept until the longest sequence ends (generation before the rollout engine);
//! - **engine**: the default — the rollout engine, each prompt prefilled once for its n
//!   samples into a paged KV cache, every sequence admitted at once, a finished one leaving
//!   the decode batch at once;
//! - **engine, P·n/4 slots**: the same engine with a quarter of the decode slots
//!   (continuous batching: a waiting sequence takes the slot of one that finishes), the
//!   KV memory a quarter of the batch needs.
//!
//! All give the same tokens (checked before timing; the CPU's decode products are
//! batch-invariant, so the slot count changes no token). Prints new tokens/s of each, the KV
//! memory each holds at its peak, and a line `rollout speedup (engine / static): X.XX` per
//! model size. Sizes: the bench model of `model_cpu` (4 layers, hidden 256, vocab 8192) and
//! the demo's 0.56 M model shape with a 8192 vocabulary, and with `ARES_BENCH_05B=1` (`=2`:
//! alone) the
//! Qwen2.5-0.5B shape (random weights; 1 prompt × 8 and 64 new tokens unless
//! `ARES_BENCH_05B_PROMPTS`). Also the engine with bf16 decode weights (a rounded model:
//! other tokens, its own count), with a bf16 KV cache (likewise), with decode buckets (the padding's cost where no graph
//! replays it; the same tokens, asserted) and on the training weights (no decode copy;
//! the GEMM instead of the tiles). `cargo bench -p ares-benches --bench rollout`; threads:
//! rayon's default (`RAYON_NUM_THREADS`).

use std::path::Path;

use ares_benches::SplitMix;
use ares_benches::model::{
    BENCH_MODEL, QWEN05_MODEL, best_and_median, engine_run, env_usize, random_weights, report,
    rollout_request,
};
use ares_model::backend::cpu::CpuBackend;
use ares_model::hf::config::ModelConfig;
use ares_model::model::{KvCacheDtype, Model, WeightDtype};

const DEMO_MODEL: &str = r#"{
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": true
}"#;

fn main() {
    let runs = env_usize("ARES_BENCH_RUNS", 3);
    let prompts = env_usize("ARES_BENCH_PROMPTS", 8);
    let mut sizes = vec![
        ("bench model", BENCH_MODEL, prompts, 256usize, runs),
        ("demo shape", DEMO_MODEL, prompts, 256, runs),
    ];
    let qwen05 = env_usize("ARES_BENCH_05B", 0);
    if qwen05 == 2 {
        sizes.clear(); // the 0.5B shape alone
    }
    if qwen05 >= 1 {
        // one prompt × 8 by default: a decode step streams 2 GB of f32 weights
        sizes.push((
            "Qwen2.5-0.5B shape",
            QWEN05_MODEL,
            env_usize("ARES_BENCH_05B_PROMPTS", 1),
            64,
            1,
        ));
    }
    for (name, config, prompts, max_new, runs) in sizes {
        let config = ModelConfig::from_json_str(Path::new("bench/config.json"), config)
            .expect("the bench config parses");
        let mut rng = SplitMix::new(11);
        let w = random_weights(&config, &mut rng);
        let model = Model::new(CpuBackend, &config, &w).expect("the bench model builds");
        let n = 8usize;
        let request = rollout_request(
            &mut rng,
            config.vocab_size as u64,
            prompts,
            n,
            max_new,
            true,
        );
        let engine = model.generator().expect("generator");
        let fixed = model.generator().expect("generator").static_batching();
        let a = engine.generate(&request).expect("generate");
        let b = fixed.generate(&request).expect("generate");
        assert_eq!(
            a.tokens, b.tokens,
            "the engine must give the static batch's tokens"
        );
        let new: usize = a.tokens.iter().map(Vec::len).sum();
        let mut lengths: Vec<usize> = a.tokens.iter().map(Vec::len).collect();
        lengths.sort_unstable();
        println!(
            "{name}: {} layers, hidden {}; {prompts} prompts × {n}, {new} new tokens (lengths: median {}, max {}); {} threads; CPU path {}",
            config.num_hidden_layers,
            config.hidden_size,
            lengths[lengths.len() / 2],
            lengths[lengths.len() - 1],
            rayon::current_num_threads(),
            ares_cpu::Isa::active(),
        );
        let ts = best_and_median(runs, || {
            fixed.generate(&request).expect("generate");
        });
        report("  static", new, "tokens", ts);
        let te = best_and_median(runs, || {
            engine.generate(&request).expect("generate");
        });
        report("  engine", new, "tokens", te);
        let slots = request.prompts.len() / 4;
        let (c, stats) = engine_run(&engine, &request, slots);
        // The CPU's decode products are batch-invariant: fewer slots, the same tokens.
        assert_eq!(
            c.tokens, a.tokens,
            "the engine with {slots} slots must give the tokens of all slots"
        );
        println!("  engine with {slots} slots: the same tokens as with all slots (asserted)");
        let tq = best_and_median(runs, || {
            engine_run(&engine, &request, slots);
        });
        report(&format!("  engine, {slots} slots"), new, "tokens", tq);
        // bf16 decode weights: another (rounded) model, so other tokens; its own count
        let bf16 = model.generator_with(WeightDtype::Bf16).expect("generator");
        let d = bf16.generate(&request).expect("generate");
        let new_bf16: usize = d.tokens.iter().map(Vec::len).sum();
        let tb = best_and_median(runs, || {
            bf16.generate(&request).expect("generate");
        });
        report("  engine, bf16 weights", new_bf16, "tokens", tb);
        // a bf16 KV cache: keys and values rounded, so other tokens; its own count
        let kv16 = model
            .generator()
            .expect("generator")
            .kv_cache_dtype(KvCacheDtype::Bf16);
        let k = kv16.generate(&request).expect("generate");
        let new_kv16: usize = k.tokens.iter().map(Vec::len).sum();
        let tk = best_and_median(runs, || {
            kv16.generate(&request).expect("generate");
        });
        report("  engine, bf16 KV cache", new_kv16, "tokens", tk);
        // decode buckets: the padding's cost where no graph replays it (the CPU)
        let padded = model.generator().expect("generator").decode_buckets(true);
        let p = padded.generate(&request).expect("generate");
        assert_eq!(p.tokens, a.tokens, "decode buckets must not change a token");
        let tp = best_and_median(runs, || {
            padded.generate(&request).expect("generate");
        });
        report("  engine, decode buckets", new, "tokens", tp);
        // the training weights themselves (no decode copy; the GEMM instead of the tiles)
        let shared = model
            .generator_with(WeightDtype::Training)
            .expect("generator");
        let t = shared.generate(&request).expect("generate");
        let same = t
            .tokens
            .iter()
            .zip(&a.tokens)
            .filter(|(x, y)| x == y)
            .count();
        let new_t: usize = t.tokens.iter().map(Vec::len).sum();
        let tt = best_and_median(runs, || {
            shared.generate(&request).expect("generate");
        });
        report("  engine, training weights", new_t, "tokens", tt);
        println!(
            "  training weights: {same} of {} sequences equal the f32 copy's",
            a.tokens.len()
        );
        // KV memory: the static cache holds batch × (width + max_new) slots; the engine the
        // blocks it allocated at its peak (16 slots each)
        let (_, all) = engine_run(&engine, &request, request.prompts.len());
        let width = request.prompts.iter().map(Vec::len).max().unwrap_or(0);
        let slot_bytes = 2
            * 4
            * config.num_hidden_layers
            * config.num_key_value_heads
            * (config.hidden_size / config.num_attention_heads);
        let mib = |slots: usize| (slots * slot_bytes) as f64 / (1 << 20) as f64;
        println!(
            "  KV cache at peak: static {:.1} MiB, engine {:.1} MiB, engine with {slots} slots {:.1} MiB ({} preemptions)",
            mib(request.prompts.len() * (width + max_new)),
            mib(all.peak_capacity * 16),
            mib(stats.peak_capacity * 16),
            stats.preemptions,
        );
        println!(
            "rollout speedup (engine / static): {:.2}",
            ts.0.as_secs_f64() / te.0.as_secs_f64()
        );
    }
}
