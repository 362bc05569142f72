//! The RL rollout on the CUDA backend, at the Qwen2.5-0.5B shape (random weights): P prompts
//! of 90–110 tokens × n = 8 samples (`ARES_BENCH_PROMPTS`, default 16: 128 sequences),
//! exactly `ARES_BENCH_NEW` new tokens each (default 256; no EOS, so every step decodes the
//! whole batch), timed several ways in the same run:
//!
//! - **engine, greedy** and **engine, sampled** (T = 1: the race sampler on the device) —
//!   their time ratio is what sampling costs over greedy;
//! - **static, sampled** ([`Generator::static_batching`]) — the engine's speedup over it;
//! - **engine, sampled, bf16 decode weights**;
//! - **engine, sampled, decode buckets + CUDA graphs** (each bucket's decode pass captured
//!   once and replayed; its tokens compared with the plain engine's — the same kernels, so
//!   the same bits wherever the padding does not change cuBLAS's choice);
//! - **engine, sampled, bf16 KV cache** (last, so a time limit cuts it first).
//!
//! The engine's and the static batch's sampled tokens are compared and the count of equal
//! sequences printed (cuBLAS picks GEMM kernels by shape, so a different batch can round
//! differently and a sequence can part ways; on the CPU they are equal). Best and median of
//! `ARES_BENCH_RUNS` (default 1) after a warm-up; each call ends with its tokens on the host.
//! `scripts/bench_torch_gpu.py --only generate --gen 128x256` is transformers' side. Without a
//! GPU the binary says why and exits 0. A plain `main` (`harness = false`).

use std::path::Path;
use std::time::Instant;

use ares_benches::SplitMix;
use ares_benches::model::{
    QWEN05_MODEL, best_and_median, env_usize, random_weights, report, rollout_request,
};
use ares_model::backend::Backend;
use ares_model::backend::cuda::CudaBackend;
use ares_model::hf::config::ModelConfig;
use ares_model::model::{GenerateRequest, KvCacheDtype, Model, Sampling, WeightDtype};

fn main() {
    let gpu = match CudaBackend::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("rollout_cuda: skipped, no usable GPU: {e}");
            return;
        }
    };
    println!("device: {}", gpu.info());
    let config = ModelConfig::from_json_str(Path::new("bench/config.json"), QWEN05_MODEL)
        .expect("the bench config parses");
    let mut rng = SplitMix::new(11);
    let w = random_weights(&config, &mut rng);
    let start = Instant::now();
    let model = Model::new(gpu.clone(), &config, &w).expect("the bench model builds");
    gpu.synchronize().expect("upload");
    println!(
        "model: Qwen2.5-0.5B shape (f32 weights); Model::new {:.0} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    let (prompts, n) = (env_usize("ARES_BENCH_PROMPTS", 16), 8);
    let max_new = env_usize("ARES_BENCH_NEW", 256);
    let runs = env_usize("ARES_BENCH_RUNS", 1);
    let sampled = rollout_request(
        &mut rng,
        config.vocab_size as u64,
        prompts,
        n,
        max_new,
        false,
    );
    let greedy = GenerateRequest {
        sampling: Sampling::Greedy,
        ..sampled.clone()
    };
    let new = prompts * n * max_new;
    println!("{prompts} prompts × {n} samples, {max_new} new tokens each ({new} tokens a call)");
    let engine = model.generator().expect("generator");
    // timings, and the tokens of the last call (so the comparison costs no extra call)
    let time = |generator: &ares_model::model::Generator<'_, CudaBackend>,
                request: &GenerateRequest| {
        let mut tokens = Vec::new();
        let t = best_and_median(runs, || {
            let out = generator.generate(request).expect("generate");
            assert!(out.tokens.iter().all(|t| t.len() == max_new));
            tokens = out.tokens;
        });
        (t, tokens)
    };
    let (tg, _) = time(&engine, &greedy);
    report("engine, greedy", new, "tokens", tg);
    let (ts, a) = time(&engine, &sampled);
    report("engine, sampled (T = 1)", new, "tokens", ts);
    println!(
        "sampling / greedy time: {:.2}",
        ts.0.as_secs_f64() / tg.0.as_secs_f64()
    );
    let fixed = model.generator().expect("generator").static_batching();
    let (tf, b) = time(&fixed, &sampled);
    report("static, sampled (T = 1)", new, "tokens", tf);
    println!(
        "rollout speedup (engine / static): {:.2}",
        tf.0.as_secs_f64() / ts.0.as_secs_f64()
    );
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    println!(
        "engine and static batch: {same} of {} sampled sequences equal",
        a.len()
    );
    let bf16 = model
        .generator_with(WeightDtype::Bf16)
        .expect("bf16 generator");
    let (tb, _) = time(&bf16, &sampled);
    report("engine, sampled, bf16 decode weights", new, "tokens", tb);
    let graphs = model.generator().expect("generator").decode_buckets(true);
    let (tgr, c) = time(&graphs, &sampled);
    report(
        "engine, sampled, decode buckets + graphs",
        new,
        "tokens",
        tgr,
    );
    println!(
        "graphs / plain engine time: {:.2}",
        tgr.0.as_secs_f64() / ts.0.as_secs_f64()
    );
    let same = a.iter().zip(&c).filter(|(x, y)| x == y).count();
    println!(
        "engine with and without graphs: {same} of {} sampled sequences equal",
        a.len()
    );
    // last: a time limit that cuts the run cuts this line before the graphs'
    let kv16 = model
        .generator()
        .expect("generator")
        .kv_cache_dtype(KvCacheDtype::Bf16);
    let (tk, _) = time(&kv16, &sampled);
    report("engine, sampled, bf16 KV cache", new, "tokens", tk);
}
