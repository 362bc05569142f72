//! Multi-turn rollouts on the CPU backend: P prompts of ~100 tokens × n = 8 samples, each a
//! conversation of T = 4 turns; a turn samples at T = 1 until an EOS id (≈ 1 % of a random
//! model's mass: roughly geometric lengths) or 64 tokens, then a "tool answer" of 24 random
//! tokens is appended and the next turn starts. Two ways, in the same run:
//!
//! - **re-prefill**: a round at a time, each round a fresh engine over every conversation
//!   still going, prefilling its whole trajectory (ares's episodes before the engine kept
//!   turns; what a loop over `generate` calls does);
//! - **kept**: one engine with [`Engine::keep_finished`]: a turn that ends is continued at
//!   once with [`Engine::continue_with`], prefilling only the appended tokens.
//!
//! Turn `t` of conversation `j` samples from stream `(seed ^ t, j)` both ways, so the tokens
//! agree but where a kept cache's rounding (decode-written keys against prefill-written
//! ones) flips a sampled token; the count of conversations whose tokens agree is printed.
//! Prints prefill tokens per conversation, new tokens/s, and the lines
//! `multi-turn prefill saving (re-prefill / kept): X` and `multi-turn speedup (kept /
//! re-prefill): Y`. Sizes: the bench model of `rollout` (4 layers, hidden 256, vocab 8192).
//! `cargo bench -p ares-benches --bench multi_turn`; `ARES_BENCH_PROMPTS` (default 4),
//! `ARES_BENCH_RUNS` (default 3).

use std::path::Path;

use ares_benches::SplitMix;
use ares_benches::model::{BENCH_MODEL, best_and_median, env_usize, random_weights, report};
use ares_model::backend::cpu::CpuBackend;
use ares_model::hf::config::ModelConfig;
use ares_model::model::{Engine, EngineConfig, EngineRequest, Generator, Model, Sampling};

const TURNS: usize = 4;
const MAX_NEW: usize = 64;
const TOOL_TOKENS: usize = 24;

/// The workload: prompts, the tool answer appended after turn `t` of conversation `j`,
/// and the sampling.
struct Workload {
    prompts: Vec<Vec<u32>>,
    answers: Vec<Vec<Vec<u32>>>,
    request: EngineRequest,
}

/// Each conversation's turns, and the tokens prefilled.
type Turns = (Vec<Vec<Vec<u32>>>, usize);

fn stream(w: &Workload, j: usize, t: usize) -> (u64, u64) {
    (w.request.seed ^ t as u64, j as u64)
}

fn engine<'a>(g: &'a Generator<'a, CpuBackend>, w: &Workload) -> Engine<'a, CpuBackend> {
    let config = EngineConfig {
        max_seqs: w.prompts.len(),
        ..EngineConfig::default()
    };
    Engine::new(g, w.request.clone(), config).expect("engine")
}

/// A round at a time, each round's conversations re-prefilled in a fresh engine.
fn re_prefill(g: &Generator<'_, CpuBackend>, w: &Workload) -> Turns {
    let mut convs = w.prompts.clone();
    let mut turns = vec![Vec::new(); convs.len()];
    let mut prefilled = 0;
    for t in 0..TURNS {
        let mut e = engine(g, w);
        for (j, c) in convs.iter().enumerate() {
            assert_eq!(
                e.submit_with_stream(c.clone(), stream(w, j, t))
                    .expect("submit"),
                j
            );
        }
        let out = e.run_to_end(&mut |_, _| {}).expect("generate");
        prefilled += e.stats().prefill_tokens;
        for (j, tokens) in out.tokens.into_iter().enumerate() {
            convs[j].extend(&tokens);
            convs[j].extend(&w.answers[j][t]);
            turns[j].push(tokens);
        }
    }
    (turns, prefilled)
}

/// One engine, each turn continued over its kept blocks as soon as it ends.
fn kept(g: &Generator<'_, CpuBackend>, w: &Workload) -> Turns {
    let mut e = engine(g, w);
    e.keep_finished(true);
    let mut owner = std::collections::HashMap::new();
    for (j, p) in w.prompts.iter().enumerate() {
        owner.insert(
            e.submit_with_stream(p.clone(), stream(w, j, 0))
                .expect("submit"),
            j,
        );
    }
    let mut turns = vec![Vec::new(); w.prompts.len()];
    while !e.is_idle() {
        for f in e.step().expect("step") {
            let j = owner[&f.id];
            turns[j].push(f.tokens);
            let t = turns[j].len();
            if t < TURNS {
                let next = e
                    .continue_with(f.id, &w.answers[j][t - 1], stream(w, j, t), MAX_NEW)
                    .expect("continue");
                owner.insert(next, j);
            } else {
                e.release(f.id);
            }
        }
    }
    let s = e.stats();
    (turns, s.prefill_tokens + s.extend_tokens)
}

fn main() {
    let runs = env_usize("ARES_BENCH_RUNS", 3);
    let prompts = env_usize("ARES_BENCH_PROMPTS", 4);
    let config = ModelConfig::from_json_str(Path::new("bench/config.json"), BENCH_MODEL)
        .expect("the bench config parses");
    let mut rng = SplitMix::new(11);
    let w = random_weights(&config, &mut rng);
    let model = Model::new(CpuBackend, &config, &w).expect("the bench model builds");
    let vocab = config.vocab_size as u64;
    let n = 8usize;
    let mut random =
        |len: usize| -> Vec<u32> { (0..len).map(|_| (rng.next_u64() % vocab) as u32).collect() };
    let prompts: Vec<Vec<u32>> = (0..prompts)
        .flat_map(|_| {
            let len = 90 + (random(1)[0] % 21) as usize;
            std::iter::repeat_n(random(len), n)
        })
        .collect();
    let answers = (0..prompts.len())
        .map(|_| (0..TURNS).map(|_| random(TOOL_TOKENS)).collect())
        .collect();
    let mut eos_ids: Vec<u32> = (0..(vocab as u32).div_ceil(100))
        .map(|i| 100 + 97 * i)
        .collect();
    eos_ids.sort_unstable();
    let work = Workload {
        prompts,
        answers,
        request: EngineRequest {
            max_new_tokens: MAX_NEW,
            eos_ids,
            sampling: Sampling::Sample {
                temperature: 1.0,
                top_k: None,
                top_p: 1.0,
                min_p: 0.0,
            },
            seed: 5,
        },
    };
    let g = model.generator().expect("generator");
    let (a, prefill_a) = re_prefill(&g, &work);
    let (b, prefill_b) = kept(&g, &work);
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    let new_a: usize = a.iter().flatten().map(Vec::len).sum();
    let new_b: usize = b.iter().flatten().map(Vec::len).sum();
    let convs = work.prompts.len();
    println!(
        "bench model: {} layers, hidden {}; {} conversations of {TURNS} turns (≤ {MAX_NEW} new tokens a turn, {TOOL_TOKENS}-token tool answers); {} threads; CPU path {}",
        config.num_hidden_layers,
        config.hidden_size,
        convs,
        rayon::current_num_threads(),
        ares_cpu::Isa::active(),
    );
    println!(
        "  same tokens both ways: {same} of {convs} conversations ({new_a} and {new_b} new tokens)"
    );
    println!(
        "  prefill tokens per conversation: re-prefill {:.0}, kept {:.0}",
        prefill_a as f64 / convs as f64,
        prefill_b as f64 / convs as f64
    );
    let ta = best_and_median(runs, || {
        re_prefill(&g, &work);
    });
    report("  re-prefill", new_a, "tokens", ta);
    let tb = best_and_median(runs, || {
        kept(&g, &work);
    });
    report("  kept", new_b, "tokens", tb);
    println!(
        "multi-turn prefill saving (re-prefill / kept): {:.2}",
        prefill_a as f64 / prefill_b as f64
    );
    println!(
        "multi-turn speedup (kept / re-prefill): {:.2}",
        (new_b as f64 / tb.0.as_secs_f64()) / (new_a as f64 / ta.0.as_secs_f64())
    );
}
