//! Batched generation with a KV cache on the CPU backend: greedy output against
//! transformers' `generate` (tests/fixtures/models/*/greedy.json, written by
//! `scripts/make_generation_fixtures.py`), batched = one by one, seeded sampling, EOS,
//! log-probs against a full forward pass, and request errors.

use ares_model::backend::MatmulPrecision;
use ares_model::backend::cpu::CpuBackend;
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::model::{
    Engine, EngineConfig, EngineRequest, EngineStats, GenerateError, GenerateOutput,
    GenerateRequest, HeadMode, Inputs, KvCache, KvCacheDtype, Model, Sampling, WeightDtype,
};

mod common;
use common::fixture;

const MODELS: [&str; 3] = ["qwen2_tiny", "qwen3_tiny", "llama_tiny"];

fn model(name: &str) -> Model<CpuBackend> {
    let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
    Model::from_checkpoint(CpuBackend, &checkpoint).unwrap()
}

struct Greedy {
    prompts: Vec<Vec<u32>>,
    batched: Vec<Vec<u32>>,
    one_by_one: Vec<Vec<u32>>,
}

fn greedy_fixture(name: &str) -> Greedy {
    let text = std::fs::read_to_string(fixture(name).join("greedy.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| -> Vec<Vec<u32>> { serde_json::from_value(doc[key].clone()).unwrap() };
    Greedy {
        prompts: ids("prompts"),
        batched: ids("batched_left_padded"),
        one_by_one: ids("one_by_one"),
    }
}

fn request(prompts: Vec<Vec<u32>>, sampling: Sampling, seed: u64) -> GenerateRequest {
    GenerateRequest {
        prompts,
        max_new_tokens: 8,
        eos_ids: Vec::new(),
        sampling,
        seed,
    }
}

const SAMPLE: Sampling = Sampling::Sample {
    temperature: 1.3,
    top_k: Some(40),
    top_p: 0.95,
    min_p: 0.0,
};

/// Generates each prompt alone and stacks the outputs.
fn one_by_one(model: &Model<CpuBackend>, req: &GenerateRequest) -> GenerateOutput {
    let mut out = GenerateOutput::default();
    for (i, p) in req.prompts.iter().enumerate() {
        // Prompt i of a batch uses stream i: put it at index i with dummy prompts before.
        let mut prompts = vec![vec![1u32]; i];
        prompts.push(p.clone());
        let single = model
            .generate(&GenerateRequest {
                prompts,
                ..req.clone()
            })
            .unwrap();
        out.tokens.push(single.tokens[i].clone());
        out.log_probs.push(single.log_probs[i].clone());
        out.entropies.push(single.entropies[i].clone());
        out.finished_by_eos.push(single.finished_by_eos[i]);
    }
    out
}

fn assert_close(a: &[Vec<f32>], b: &[Vec<f32>], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len(), "{what}");
        for (p, q) in x.iter().zip(y) {
            assert!((p - q).abs() <= tol, "{what}: {p} vs {q}");
        }
    }
}

#[test]
fn greedy_matches_transformers() {
    for name in MODELS {
        let m = model(name);
        let f = greedy_fixture(name);
        assert_eq!(
            f.batched, f.one_by_one,
            "{name}: fixture disagrees with itself"
        );
        let out = m
            .generate(&request(f.prompts.clone(), Sampling::Greedy, 0))
            .unwrap();
        assert_eq!(out.tokens, f.batched, "{name}: batched greedy");
        assert_eq!(out.finished_by_eos, vec![false; f.prompts.len()]);
        for (i, p) in f.prompts.iter().enumerate() {
            let single = m
                .generate(&request(vec![p.clone()], Sampling::Greedy, 0))
                .unwrap();
            assert_eq!(
                single.tokens[0], f.one_by_one[i],
                "{name}: prompt {i} alone"
            );
        }
    }
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// Batch invariance: a prompt's tokens, log-probs and entropies are the same bits in a
/// batch as alone (the CPU's decode products sum each output in order whatever the rows),
/// in f32 and with TF32 operands.
#[test]
fn batched_equals_one_by_one() {
    for name in MODELS {
        let mut m = model(name);
        let prompts = greedy_fixture(name).prompts;
        for precision in [MatmulPrecision::F32, MatmulPrecision::Tf32] {
            m.set_matmul_precision(precision);
            for sampling in [Sampling::Greedy, SAMPLE] {
                let req = request(prompts.clone(), sampling, 7);
                let batched = m.generate(&req).unwrap();
                let single = one_by_one(&m, &req);
                let what = format!("{name} {precision:?} {sampling:?}");
                assert_eq!(batched.tokens, single.tokens, "{what}");
                assert_eq!(bits(&batched.log_probs), bits(&single.log_probs), "{what}");
                assert_eq!(bits(&batched.entropies), bits(&single.entropies), "{what}");
            }
        }
    }
}

/// A rollout batch (each prompt repeated, n samples each, in any order) prefills each
/// distinct prompt once and shares its blocks: the outputs equal each sequence
/// generated alone, greedy and sampled, with EOS ending some sequences early.
#[test]
fn shared_prefill_equals_one_by_one() {
    for name in MODELS {
        let m = model(name);
        let p = greedy_fixture(name).prompts;
        let prompts: Vec<Vec<u32>> = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 0, 1]
            .iter()
            .map(|&i| p[i % p.len()].clone())
            .collect();
        for sampling in [Sampling::Greedy, SAMPLE] {
            let mut req = request(prompts.clone(), sampling, 11);
            req.max_new_tokens = 12;
            let single = one_by_one(&m, &req);
            // an EOS that some sampled sequences produce and others do not
            req.eos_ids = vec![single.tokens[5][3]];
            let shared = m.generate(&req).unwrap();
            let single = one_by_one(&m, &req);
            assert_eq!(shared.tokens, single.tokens, "{name} {sampling:?}");
            assert_eq!(shared.finished_by_eos, single.finished_by_eos, "{name}");
            assert_close(&shared.log_probs, &single.log_probs, 1e-4, name);
            assert_close(&shared.entropies, &single.entropies, 1e-4, name);
        }
    }
}

/// Sequences that finish leave the decode batch (their blocks back to the pool) without
/// changing anyone's tokens: a sampled batch whose sequences end at many different steps
/// equals each sequence generated alone.
#[test]
fn finished_sequences_leave_the_batch_without_changing_tokens() {
    for name in MODELS {
        let m = model(name);
        let p = greedy_fixture(name).prompts;
        let prompts: Vec<Vec<u32>> = (0..16).map(|i| p[i % p.len()].clone()).collect();
        let mut req = request(prompts, SAMPLE, 3);
        req.max_new_tokens = 16;
        // EOS: a token sampled mid-way in a run without EOS, the first that ends at least
        // 4 sequences at 3 or more different steps
        let free = m.generate(&req).unwrap();
        let spread = |out: &GenerateOutput| {
            let ended = out.finished_by_eos.iter().filter(|&&f| f).count();
            let steps: std::collections::BTreeSet<usize> = out
                .tokens
                .iter()
                .zip(&out.finished_by_eos)
                .filter(|&(_, &f)| f)
                .map(|(t, _)| t.len())
                .collect();
            ended >= 4 && steps.len() >= 3
        };
        let batched = (0..16)
            .flat_map(|k| [4, 8].map(|at| free.tokens[k][at]))
            .find_map(|eos| {
                req.eos_ids = vec![eos];
                let out = m.generate(&req).unwrap();
                spread(&out).then_some(out)
            })
            .unwrap_or_else(|| panic!("{name}: no EOS candidate ends sequences at 3 steps"));
        let single = one_by_one(&m, &req);
        assert_eq!(batched.tokens, single.tokens, "{name}");
        assert_eq!(batched.finished_by_eos, single.finished_by_eos, "{name}");
        assert_close(&batched.log_probs, &single.log_probs, 1e-4, name);
        assert_close(&batched.entropies, &single.entropies, 1e-4, name);
    }
}

/// Runs `req`'s prompts through an engine of `config`; returns the outputs, the most rows a
/// decode pass carried, the preemptions, and the blocks still in use at the end.
fn engine_run(
    m: &Model<CpuBackend>,
    req: &GenerateRequest,
    config: EngineConfig,
) -> (GenerateOutput, usize, usize, usize) {
    let generator = m.generator().unwrap();
    let request = EngineRequest {
        max_new_tokens: req.max_new_tokens,
        eos_ids: req.eos_ids.clone(),
        sampling: req.sampling,
        seed: req.seed,
    };
    let mut engine = Engine::new(&generator, request, config).unwrap();
    for (i, p) in req.prompts.iter().enumerate() {
        assert_eq!(engine.submit(p.clone()).unwrap(), i);
    }
    let mut outs = vec![None; req.prompts.len()];
    let mut widest = 0;
    while !engine.is_idle() {
        let before = engine.stats();
        for f in engine.step().unwrap() {
            let id = f.id;
            assert!(outs[id].is_none(), "sequence {id} finished twice");
            outs[id] = Some(f);
        }
        let after = engine.stats();
        if after.decode_passes > before.decode_passes {
            widest = widest.max(after.decode_rows - before.decode_rows);
        }
        assert!(engine.pool().capacity() <= config.max_blocks.unwrap_or(usize::MAX));
    }
    let mut out = GenerateOutput::default();
    for f in outs.into_iter().map(Option::unwrap) {
        out.tokens.push(f.tokens);
        out.log_probs.push(f.log_probs);
        out.entropies.push(f.entropies);
        out.finished_by_eos.push(f.finished_by_eos);
    }
    let stats = engine.stats();
    (out, widest, stats.preemptions, engine.pool().in_use())
}

/// The rollout engine with fewer decode slots than sequences, a small prefill budget and
/// KV budgets small enough to preempt sequences: every sequence equals it generated alone
/// (greedy and sampled; n = 1, 4, 8 samples per prompt; prompts of different lengths; EOS
/// at different steps and the length limit hit), and every block is back in the pool.
#[test]
fn engine_with_few_slots_and_blocks_equals_one_by_one() {
    let mut preempted = 0;
    for name in MODELS {
        let m = model(name);
        let p = greedy_fixture(name).prompts;
        for n in [1usize, 4, 8] {
            let prompts: Vec<Vec<u32>> = (0..3 * n).map(|i| p[(i / n) % p.len()].clone()).collect();
            for sampling in [Sampling::Greedy, SAMPLE] {
                let mut req = request(prompts.clone(), sampling, 5);
                req.max_new_tokens = 12;
                let free = one_by_one(&m, &req);
                req.eos_ids = vec![free.tokens[req.prompts.len() - 1][2]];
                let want = one_by_one(&m, &req);
                let longest = req.prompts.iter().map(Vec::len).max().unwrap() + 12;
                for (max_seqs, max_blocks, decode_buckets) in [
                    (3, None, false),
                    (3, None, true),
                    (2, Some(longest.div_ceil(4) + 2), false),
                    (5, Some(12), false),
                    (5, Some(12), true),
                ] {
                    let config = EngineConfig {
                        max_seqs,
                        block_size: 4,
                        max_blocks,
                        max_prefill_tokens: 8,
                        decode_buckets,
                        ..EngineConfig::default()
                    };
                    let what = format!("{name} n={n} {sampling:?} {config:?}");
                    let (out, widest, preemptions, in_use) = engine_run(&m, &req, config);
                    assert_eq!(out.tokens, want.tokens, "{what}");
                    assert_eq!(out.finished_by_eos, want.finished_by_eos, "{what}");
                    assert_close(&out.log_probs, &want.log_probs, 1e-4, &what);
                    assert_close(&out.entropies, &want.entropies, 1e-4, &what);
                    assert!(widest <= max_seqs, "{what}: {widest} rows");
                    assert_eq!(in_use, 0, "{what}: blocks leaked");
                    preempted += preemptions;
                }
            }
        }
    }
    assert!(
        preempted > 0,
        "no run was preempted: the budgets test nothing"
    );
}

/// Chunked prefill: prompts longer than `max_prefill_tokens` are prefilled a chunk a step
/// over their own blocks while the running sequences keep decoding. Each sequence equals
/// its one-pass-prefill generation (tokens; log-probs and entropies within rounding: the
/// paged attention sums in another order) and is the same bits in its own engine of the
/// same chunk size (batch invariance); budgets that preempt leak no block.
#[test]
fn chunked_prefill_equals_one_pass_prefill() {
    for name in MODELS {
        let m = model(name);
        let p = greedy_fixture(name).prompts;
        // 18, 2 and 11 tokens, two samples each
        let long: Vec<u32> = [&p[0], &p[2], &p[0]]
            .into_iter()
            .flatten()
            .copied()
            .collect();
        let mid: Vec<u32> = [&p[0], &p[2]].into_iter().flatten().copied().collect();
        let prompts: Vec<Vec<u32>> = [&p[1], &long, &mid]
            .into_iter()
            .flat_map(|q| [q.clone(), q.clone()])
            .collect();
        for sampling in [Sampling::Greedy, SAMPLE] {
            let mut req = request(prompts.clone(), sampling, 9);
            req.max_new_tokens = 10;
            let want = one_by_one(&m, &req);
            for (chunk, max_seqs, max_blocks) in [(3, 2, None), (5, 6, None), (4, 3, Some(12))] {
                let config = EngineConfig {
                    max_seqs,
                    block_size: 4,
                    max_blocks,
                    max_prefill_tokens: chunk,
                    decode_buckets: false,
                    ..EngineConfig::default()
                };
                let what = format!("{name} {sampling:?} {config:?}");
                let (out, widest, _, in_use) = engine_run(&m, &req, config);
                assert_eq!(out.tokens, want.tokens, "{what}");
                assert_close(&out.log_probs, &want.log_probs, 1e-4, &what);
                assert_close(&out.entropies, &want.entropies, 1e-4, &what);
                assert!(widest <= max_seqs, "{what}: {widest} rows");
                assert_eq!(in_use, 0, "{what}: blocks leaked");
                // each sequence alone in an engine of the same chunk size: the same bits
                for (i, q) in req.prompts.iter().enumerate() {
                    let mut alone = req.clone();
                    // sequence i samples from stream i: dummy one-token prompts before it
                    alone.prompts = vec![vec![1u32]; i];
                    alone.prompts.push(q.clone());
                    let (single, ..) = engine_run(&m, &alone, config);
                    assert_eq!(single.tokens[i], out.tokens[i], "{what} [{i}]");
                    let b = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        b(&single.log_probs[i]),
                        b(&out.log_probs[i]),
                        "{what} [{i}]"
                    );
                    assert_eq!(
                        b(&single.entropies[i]),
                        b(&out.entropies[i]),
                        "{what} [{i}]"
                    );
                }
            }
        }
    }
}

/// While a long prompt is prefilled in chunks, the running sequences decode every step.
#[test]
fn chunked_prefill_does_not_stall_decoding() {
    let m = model("qwen2_tiny");
    let generator = m.generator().unwrap();
    let request = EngineRequest {
        max_new_tokens: 20,
        eos_ids: Vec::new(),
        sampling: Sampling::Greedy,
        seed: 0,
    };
    let config = EngineConfig {
        max_seqs: 4,
        block_size: 4,
        max_blocks: None,
        max_prefill_tokens: 4,
        decode_buckets: false,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&generator, request, config).unwrap();
    engine.submit(vec![3, 4]).unwrap();
    let long: Vec<u32> = (0..30).map(|i| 5 + (i * 7) % 50).collect();
    engine.submit(long).unwrap();
    let mut tokens = [0usize; 2];
    let mut steps_both = 0;
    while !engine.is_idle() {
        let before = tokens;
        engine.step_with(&mut |id, _| tokens[id] += 1).unwrap();
        // a step of the long prompt's prefill (tokens[1] still 0) in which the short
        // sequence decoded
        if tokens[1] == 0 && tokens[0] > before[0] && before[0] > 0 {
            steps_both += 1;
        }
    }
    let stats = engine.stats();
    // 2 tokens in one pass, then 30 in chunks of 4: 8 chunk passes
    assert_eq!(stats.prefill_tokens, 32, "{stats:?}");
    assert_eq!(stats.prefill_passes, 9, "{stats:?}");
    assert!(
        steps_both >= 7,
        "decoding stalled: {steps_both} steps with both"
    );
    assert_eq!(tokens, [20, 20]);
}

/// A budget that cannot hold one sequence is an error naming it; bad sizes are refused.
#[test]
fn engine_budget_and_config_errors() {
    let m = model("qwen3_tiny");
    let generator = m.generator().unwrap();
    let request = EngineRequest {
        max_new_tokens: 8,
        eos_ids: Vec::new(),
        sampling: Sampling::Greedy,
        seed: 0,
    };
    let small = EngineConfig {
        block_size: 2,
        max_blocks: Some(3),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&generator, request.clone(), small).unwrap();
    engine.submit(vec![1, 2, 3, 4, 5, 6, 7]).unwrap();
    let e = engine.run_to_end(&mut |_, _| {}).unwrap_err();
    assert!(
        matches!(e, GenerateError::KvBudget { sequence: 0, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("raise max_blocks"), "{e}");
    for bad in [
        EngineConfig {
            max_seqs: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            block_size: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            max_blocks: Some(0),
            ..EngineConfig::default()
        },
        EngineConfig {
            max_prefill_tokens: 0,
            ..EngineConfig::default()
        },
    ] {
        assert!(
            Engine::new(&generator, request.clone(), bad).is_err(),
            "{bad:?}"
        );
    }
    let zero = EngineRequest {
        max_new_tokens: 0,
        ..request.clone()
    };
    assert!(Engine::new(&generator, zero, EngineConfig::default()).is_err());
    let mut engine = Engine::new(&generator, request, EngineConfig::default()).unwrap();
    let e = engine.submit(Vec::new()).unwrap_err();
    assert!(matches!(e, GenerateError::EmptyPrompt { index: 0 }), "{e}");
    let e = engine.submit(vec![u32::MAX]).unwrap_err();
    assert!(matches!(e, GenerateError::TokenOutOfRange { .. }), "{e}");
}

/// Turns of every conversation, tokens appended after each turn (a tool's answer), and
/// the new tokens each turn may take, for the continuation tests.
const TURNS: usize = 3;

fn appended(row: usize, turn: usize) -> Vec<u32> {
    (0..1 + (row + 2 * turn) % 5)
        .map(|i| 3 + ((row * 7 + turn * 5 + i * 3) % 40) as u32)
        .collect()
}

fn turn_budget(row: usize, turn: usize) -> usize {
    // turn 0 takes the engine's budget
    if turn == 0 { 5 } else { 4 + (row + turn) % 3 }
}

/// One turn of a conversation: the conversation before it, and what it generated.
type Turn = (Vec<u32>, ares_model::model::FinishedSequence);

/// Runs [`TURNS`]-turn conversations through one engine that keeps each finished turn's
/// blocks and continues it with [`appended`] tokens (turn `t` of row `j` samples from
/// stream `(seed ^ t, j)`); returns each row's turns, the engine's statistics and the
/// blocks in use once every kept sequence is released.
fn multi_turn_run(
    m: &Model<CpuBackend>,
    prompts: &[Vec<u32>],
    sampling: Sampling,
    seed: u64,
    config: EngineConfig,
) -> (Vec<Vec<Turn>>, EngineStats, usize) {
    let generator = m.generator().unwrap();
    let request = EngineRequest {
        max_new_tokens: turn_budget(0, 0),
        eos_ids: Vec::new(),
        sampling,
        seed,
    };
    let mut engine = Engine::new(&generator, request, config).unwrap();
    engine.keep_finished(true);
    let mut owner = std::collections::HashMap::new();
    let mut convs: Vec<Vec<u32>> = prompts.to_vec();
    let mut turns: Vec<Vec<Turn>> = vec![Vec::new(); prompts.len()];
    for (j, p) in prompts.iter().enumerate() {
        let id = engine
            .submit_with_stream(p.clone(), (seed, j as u64))
            .unwrap();
        owner.insert(id, (j, 0usize));
    }
    let mut steps = 0;
    while !engine.is_idle() {
        steps += 1;
        assert!(steps < 10_000, "the engine does not finish");
        for f in engine.step().unwrap() {
            let (j, t) = owner[&f.id];
            let id = f.id;
            let before = convs[j].clone();
            convs[j].extend(&f.tokens);
            turns[j].push((before, f));
            if t + 1 < TURNS {
                let app = appended(j, t);
                convs[j].extend(&app);
                let stream = (seed ^ (t as u64 + 1), j as u64);
                let next = engine
                    .continue_with(id, &app, stream, turn_budget(j, t + 1))
                    .unwrap();
                owner.insert(next, (j, t + 1));
            } else {
                engine.release(id);
            }
        }
    }
    (turns, engine.stats(), engine.pool().in_use())
}

/// Multi-turn conversations through one engine that keeps each turn's KV blocks and
/// prefills only the appended tokens ([`Engine::continue_with`]) equal re-prefilling each
/// whole conversation alone: the same tokens, log-probs and entropies within rounding
/// (decode-written keys against prefill-written ones), greedy and sampled, with budgets
/// that drop kept blocks and preempt; no block leaks, and with room to spare each turn
/// prefills its new tokens only.
#[test]
fn continued_turns_equal_re_prefilling_the_conversation() {
    let (mut squeezed, mut preempted) = (0, 0);
    for name in MODELS {
        let m = model(name);
        let p = greedy_fixture(name).prompts;
        let prompts: Vec<Vec<u32>> = (0..6).map(|i| p[i / 2].clone()).collect();
        for sampling in [Sampling::Greedy, SAMPLE] {
            let seed = 11;
            for (max_seqs, max_blocks, max_prefill_tokens) in [
                (8, None, 64),
                (3, None, 6),
                (4, Some(14), 8),
                (6, Some(10), 40),
            ] {
                let config = EngineConfig {
                    max_seqs,
                    block_size: 4,
                    max_blocks,
                    max_prefill_tokens,
                    decode_buckets: false,
                    ..EngineConfig::default()
                };
                let what = format!("{name} {sampling:?} {config:?}");
                let (turns, stats, in_use) = multi_turn_run(&m, &prompts, sampling, seed, config);
                assert_eq!(in_use, 0, "{what}: blocks leaked");
                for (j, row) in turns.iter().enumerate() {
                    assert_eq!(row.len(), TURNS, "{what} row {j}");
                    for (t, (conv, f)) in row.iter().enumerate() {
                        // the conversation alone, from the same stream
                        let mut prompts = vec![vec![1u32]; j];
                        prompts.push(conv.clone());
                        let want = m
                            .generate(&GenerateRequest {
                                prompts,
                                max_new_tokens: turn_budget(j, t),
                                eos_ids: Vec::new(),
                                sampling,
                                seed: seed ^ t as u64,
                            })
                            .unwrap();
                        let at = format!("{what} row {j} turn {t}");
                        assert_eq!(f.tokens, want.tokens[j], "{at}");
                        assert_close(
                            &want.log_probs[j..=j],
                            std::slice::from_ref(&f.log_probs),
                            1e-4,
                            &at,
                        );
                        assert_close(
                            &want.entropies[j..=j],
                            std::slice::from_ref(&f.entropies),
                            1e-4,
                            &at,
                        );
                    }
                }
                let continued: usize = (0..prompts.len())
                    .flat_map(|j| (0..TURNS - 1).map(move |t| 1 + appended(j, t).len()))
                    .sum();
                if max_blocks.is_none() {
                    // every continuation prefilled its new tokens only; the prompts once
                    assert_eq!(stats.extend_tokens, continued, "{what}");
                    assert_eq!(
                        stats.prefill_tokens,
                        p.iter().map(Vec::len).sum::<usize>(),
                        "{what}"
                    );
                    assert_eq!(stats.preemptions, 0, "{what}");
                } else {
                    assert!(stats.extend_tokens <= continued, "{what}");
                    squeezed += usize::from(stats.extend_tokens < continued);
                    preempted += stats.preemptions;
                }
            }
        }
    }
    eprintln!("squeezed {squeezed} preempted {preempted}");
    assert!(
        squeezed > 0,
        "no budget dropped kept blocks: the budgets test nothing"
    );
}

/// Continuing what cannot be continued is an error; `parent` stays kept.
#[test]
fn continue_with_errors() {
    let m = model("qwen2_tiny");
    let generator = m.generator().unwrap();
    let request = EngineRequest {
        max_new_tokens: 3,
        eos_ids: Vec::new(),
        sampling: Sampling::Greedy,
        seed: 0,
    };
    let mut engine = Engine::new(&generator, request.clone(), EngineConfig::default()).unwrap();
    let a = engine.submit(vec![3, 4, 5]).unwrap();
    // not finished yet
    let e = engine.continue_with(a, &[6], (0, 1), 3).unwrap_err();
    assert!(
        e.to_string().contains("not a finished sequence kept"),
        "{e}"
    );
    engine.run_to_end(&mut |_, _| {}).unwrap();
    // keep_finished was off
    let e = engine.continue_with(a, &[6], (0, 1), 3).unwrap_err();
    assert!(e.to_string().contains("keep_finished is off"), "{e}");

    let mut engine = Engine::new(&generator, request, EngineConfig::default()).unwrap();
    engine.keep_finished(true);
    let a = engine.submit(vec![3, 4, 5]).unwrap();
    engine.run_to_end(&mut |_, _| {}).unwrap();
    let held = engine.pool().in_use();
    assert!(held > 0);
    let e = engine.continue_with(a, &[6], (0, 1), 0).unwrap_err();
    assert!(e.to_string().contains("max_new_tokens > 0"), "{e}");
    let e = engine.continue_with(a, &[500], (0, 1), 3).unwrap_err();
    assert!(matches!(e, GenerateError::TokenOutOfRange { .. }), "{e}");
    let e = engine.continue_with(a, &[6; 60], (0, 1), 3).unwrap_err();
    assert!(e.to_string().contains("maximum sequence length"), "{e}");
    assert_eq!(
        engine.pool().in_use(),
        held,
        "a refused continuation keeps its parent"
    );
    let b = engine.continue_with(a, &[6], (0, 1), 3).unwrap();
    let e = engine.continue_with(a, &[6], (0, 1), 3).unwrap_err();
    assert!(e.to_string().contains("continued or released"), "{e}");
    engine.run_to_end(&mut |_, _| {}).unwrap();
    engine.release(b);
    engine.release(b); // releasing twice does nothing
    assert_eq!(engine.pool().in_use(), 0);
}

/// Several requests (distinct seeds, prompts repeated within each) through one engine with
/// fewer slots than their sequences give each request's own outputs.
#[test]
fn generate_many_equals_each_request_alone() {
    let m = model("qwen2_tiny");
    let p = greedy_fixture("qwen2_tiny").prompts;
    let generator = m.generator().unwrap();
    let requests: Vec<GenerateRequest> = (0..3u64)
        .map(|k| {
            let prompts = (0..6)
                .map(|i| p[(i / 2 + k as usize) % p.len()].clone())
                .collect();
            let mut r = request(prompts, SAMPLE, 100 + k);
            r.max_new_tokens = 10;
            r.eos_ids = vec![5, 17, 61];
            r
        })
        .collect();
    let mut reported = Vec::new();
    let many = generator
        .generate_many(&requests, 4, |n| reported.push(n))
        .unwrap();
    assert_eq!(many.len(), 3);
    for (r, out) in requests.iter().zip(&many) {
        let alone = generator.generate(r).unwrap();
        assert_eq!(out.tokens, alone.tokens);
        assert_eq!(out.finished_by_eos, alone.finished_by_eos);
        assert_close(&out.log_probs, &alone.log_probs, 1e-4, "log-probs");
    }
    assert_eq!(reported.last(), Some(&18));
    assert!(reported.windows(2).all(|w| w[0] <= w[1]));
    let mut other = requests[1].clone();
    other.max_new_tokens = 3;
    let e = generator
        .generate_many(&[requests[0].clone(), other], 4, |_| {})
        .unwrap_err();
    assert!(e.to_string().contains("differ"), "{e}");
}

/// bf16 decode weights: generation equals the f32 model whose linear weights were rounded
/// to bf16 (greedy and sampled; untied models, whose LM head is not also the embedding),
/// and stays close to the f32 model itself (the log-prob gap is printed).
#[test]
fn bf16_decode_weights_equal_the_rounded_model() {
    for name in ["qwen3_tiny", "llama_tiny"] {
        let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
        let f32_model = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
        let mut rounded = checkpoint.weights.clone();
        for (tensor, t) in rounded.tensors_mut() {
            if tensor.ends_with("_proj.weight") || tensor == "lm_head.weight" {
                for x in &mut t.data {
                    *x = half::bf16::from_f32(*x).to_f32();
                }
            }
        }
        let reference = Model::new(CpuBackend, &checkpoint.config, &rounded).unwrap();
        let bf16 = f32_model.generator_with(WeightDtype::Bf16).unwrap();
        let prompts = greedy_fixture(name).prompts;
        for sampling in [Sampling::Greedy, SAMPLE] {
            let mut req = request(prompts.clone(), sampling, 21);
            req.max_new_tokens = 12;
            let want = reference.generate(&req).unwrap();
            let got = bf16.generate(&req).unwrap();
            assert_eq!(got.tokens, want.tokens, "{name} {sampling:?}");
            assert_close(&got.log_probs, &want.log_probs, 1e-4, name);
            assert_close(&got.entropies, &want.entropies, 1e-4, name);
        }
        // the gap to f32 on the tokens both pick greedily, before they first differ
        let req = request(prompts.clone(), Sampling::Greedy, 0);
        let (a, b) = (
            f32_model.generate(&req).unwrap(),
            bf16.generate(&req).unwrap(),
        );
        let mut gaps = Vec::new();
        for (i, (ta, tb)) in a.tokens.iter().zip(&b.tokens).enumerate() {
            for (j, _) in ta.iter().zip(tb).take_while(|(x, y)| x == y).enumerate() {
                gaps.push((a.log_probs[i][j] - b.log_probs[i][j]).abs());
            }
        }
        let mean = gaps.iter().sum::<f32>() / gaps.len().max(1) as f32;
        let max = gaps.iter().copied().fold(0.0f32, f32::max);
        eprintln!(
            "{name}: bf16 vs f32 greedy log-prob gap over {} tokens: mean {mean:.2e}, max {max:.2e}",
            gaps.len()
        );
        assert!(!gaps.is_empty() && max < 0.1, "{name}: gap {max}");
    }
    // a tied model too (its LM head rounded, its embedding lookup not): it runs and stays close
    let m = model("qwen2_tiny");
    let req = request(greedy_fixture("qwen2_tiny").prompts, Sampling::Greedy, 0);
    let out = m
        .generator_with(WeightDtype::Bf16)
        .unwrap()
        .generate(&req)
        .unwrap();
    assert!(
        out.log_probs
            .iter()
            .flatten()
            .all(|lp| lp.is_finite() && *lp <= 0.0)
    );
}

/// A KV cache in bf16: every sequence is the same bits alone or in a batch with budgets
/// that preempt and chunk (the pages round each key and value once, whichever block holds
/// it), the paged bf16 ops run in place of the f32 ones, and the greedy log-probs stay
/// within bf16's rounding of the f32 cache's.
#[test]
fn bf16_kv_cache_is_batch_invariant_and_close_to_f32() {
    use ares_model::backend::Counting;
    for name in MODELS {
        let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
        let m = Model::from_checkpoint(Counting::new(CpuBackend), &checkpoint).unwrap();
        let generator = m.generator().unwrap().kv_cache_dtype(KvCacheDtype::Bf16);
        let p = greedy_fixture(name).prompts;
        let prompts: Vec<Vec<u32>> = (0..6).map(|i| p[(i / 2) % p.len()].clone()).collect();
        for sampling in [Sampling::Greedy, SAMPLE] {
            let mut req = request(prompts.clone(), sampling, 13);
            req.max_new_tokens = 12;
            // each sequence alone (at its own stream index)
            let mut want = GenerateOutput::default();
            for (i, prompt) in req.prompts.iter().enumerate() {
                let mut alone = vec![vec![1u32]; i];
                alone.push(prompt.clone());
                let one = generator
                    .generate(&GenerateRequest {
                        prompts: alone,
                        ..req.clone()
                    })
                    .unwrap();
                want.tokens.push(one.tokens[i].clone());
                want.log_probs.push(one.log_probs[i].clone());
            }
            m.backend().take();
            let batched = generator.generate(&req).unwrap();
            let calls = m.backend().take().calls;
            assert!(calls.contains(&"paged_attention_decode_bf16"), "{name}");
            assert!(!calls.contains(&"paged_attention_decode"), "{name}");
            assert_eq!(batched.tokens, want.tokens, "{name} {sampling:?}");
            assert_eq!(bits(&batched.log_probs), bits(&want.log_probs), "{name}");
            let longest = req.prompts.iter().map(Vec::len).max().unwrap() + 12;
            let config = EngineConfig {
                max_seqs: 3,
                block_size: 4,
                max_blocks: Some(longest.div_ceil(4) + 2),
                max_prefill_tokens: 8,
                kv_cache_dtype: KvCacheDtype::Bf16,
                ..EngineConfig::default()
            };
            let request = EngineRequest {
                max_new_tokens: req.max_new_tokens,
                eos_ids: Vec::new(),
                sampling,
                seed: req.seed,
            };
            let mut engine = Engine::new(&generator, request, config).unwrap();
            for prompt in &req.prompts {
                engine.submit(prompt.clone()).unwrap();
            }
            let mut tokens = vec![Vec::new(); req.prompts.len()];
            while !engine.is_idle() {
                for f in engine.step().unwrap() {
                    tokens[f.id] = f.tokens;
                }
            }
            assert!(engine.stats().preemptions > 0, "{name}: nothing preempted");
            // a chunked prompt attends over its own rounded keys, where a one-pass prefill
            // attends over the f32 ones: compare tokens up to the first such difference
            let same = tokens
                .iter()
                .zip(&want.tokens)
                .filter(|(a, b)| a == b)
                .count();
            assert!(
                same >= tokens.len() - 1,
                "{name} {sampling:?}: {same} equal"
            );
        }
        // close to the f32 cache's greedy log-probs, up to where the tokens part
        let req = request(prompts.clone(), Sampling::Greedy, 0);
        let f32_out = m.generator().unwrap().generate(&req).unwrap();
        let bf16_out = generator.generate(&req).unwrap();
        let mut gaps = Vec::new();
        for (i, (a, b)) in f32_out.tokens.iter().zip(&bf16_out.tokens).enumerate() {
            for (j, _) in a.iter().zip(b).take_while(|(x, y)| x == y).enumerate() {
                gaps.push((f32_out.log_probs[i][j] - bf16_out.log_probs[i][j]).abs());
            }
        }
        let max = gaps.iter().copied().fold(0.0f32, f32::max);
        eprintln!(
            "{name}: bf16 vs f32 KV greedy log-prob gap over {} tokens: max {max:.2e}",
            gaps.len()
        );
        assert!(!gaps.is_empty() && max < 0.05, "{name}: gap {max}");
    }
}

/// Static batching (the benchmark's baseline) gives the engine's outputs.
#[test]
fn static_batching_equals_the_engine() {
    for name in MODELS {
        let m = model(name);
        let p = greedy_fixture(name).prompts;
        let prompts: Vec<Vec<u32>> = (0..8).map(|i| p[i % p.len()].clone()).collect();
        let mut req = request(prompts, SAMPLE, 9);
        req.max_new_tokens = 10;
        req.eos_ids = vec![m.generate(&req).unwrap().tokens[1][3]];
        let engine = m.generate(&req).unwrap();
        let generator = m.generator().unwrap().static_batching();
        let fixed = generator.generate(&req).unwrap();
        assert_eq!(fixed.tokens, engine.tokens, "{name}");
        assert_eq!(fixed.finished_by_eos, engine.finished_by_eos, "{name}");
        assert_close(&fixed.log_probs, &engine.log_probs, 1e-4, name);
    }
}

#[test]
fn sampling_is_seeded() {
    let m = model("qwen3_tiny");
    let prompts = greedy_fixture("qwen3_tiny").prompts;
    let a = m.generate(&request(prompts.clone(), SAMPLE, 42)).unwrap();
    let b = m.generate(&request(prompts.clone(), SAMPLE, 42)).unwrap();
    let c = m.generate(&request(prompts.clone(), SAMPLE, 43)).unwrap();
    assert_eq!(a, b);
    // 24 draws at temperature 1.3 over 97 tokens: equal by chance with negligible odds.
    assert_ne!(a.tokens, c.tokens);
    // Sampled log-probs are of the full tempered distribution, so at most 0.
    assert!(a.log_probs.iter().flatten().all(|&lp| lp <= 0.0));
    // Top-k 1 is greedy whatever the temperature and seed.
    let top1 = Sampling::Sample {
        temperature: 0.5,
        top_k: Some(1),
        top_p: 1.0,
        min_p: 0.0,
    };
    let greedy = m
        .generate(&request(prompts.clone(), Sampling::Greedy, 0))
        .unwrap();
    let k1 = m.generate(&request(prompts, top1, 5)).unwrap();
    assert_eq!(greedy.tokens, k1.tokens);
}

#[test]
fn eos_stops_a_sequence() {
    let m = model("qwen3_tiny");
    let f = greedy_fixture("qwen3_tiny");
    // Prompt 2 greedily produces 33, 58, 22, ...: with EOS 22 it stops after 3 tokens.
    let eos = f.batched[2][2];
    let mut req = request(f.prompts.clone(), Sampling::Greedy, 0);
    req.eos_ids = vec![eos];
    let out = m.generate(&req).unwrap();
    for (i, expected) in f.batched.iter().enumerate() {
        let stop = expected.iter().position(|&t| t == eos);
        let want = stop.map_or(&expected[..], |s| &expected[..=s]);
        assert_eq!(out.tokens[i], want, "prompt {i}");
        assert_eq!(out.finished_by_eos[i], stop.is_some());
        assert_eq!(out.log_probs[i].len(), want.len());
        assert_eq!(out.entropies[i].len(), want.len());
    }
    assert!(out.finished_by_eos[2]);
    // Every sequence finished early: the loop ends there.
    req.prompts = vec![f.prompts[2].clone()];
    let out = m.generate(&req).unwrap();
    assert_eq!(out.tokens[0], f.batched[2][..3]);
}

/// Log-softmax (f64) of `logits` at `target`, and the entropy of the softmax.
fn log_softmax_entropy(logits: &[f32], target: u32) -> (f64, f64) {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let lse = max
        + logits
            .iter()
            .map(|&x| (f64::from(x) - max).exp())
            .sum::<f64>()
            .ln();
    let entropy = -logits
        .iter()
        .map(|&x| {
            let lp = f64::from(x) - lse;
            lp.exp() * lp
        })
        .sum::<f64>();
    (f64::from(logits[target as usize]) - lse, entropy)
}

#[test]
fn greedy_log_probs_match_a_full_forward() {
    for name in MODELS {
        let m = model(name);
        let vocab = m.spec().vocab;
        let prompts = greedy_fixture(name).prompts;
        let out = m
            .generate(&request(prompts.clone(), Sampling::Greedy, 0))
            .unwrap();
        for (i, p) in prompts.iter().enumerate() {
            let new = &out.tokens[i];
            let seq: Vec<u32> = p.iter().chain(new).copied().collect();
            let n = seq.len();
            let mask = vec![1u32; n];
            let positions: Vec<u32> = (0..n as u32).collect();
            let logits = m
                .forward_logits(&Inputs {
                    batch: 1,
                    seq: n,
                    input_ids: &seq,
                    attention_mask: &mask,
                    position_ids: &positions,
                })
                .unwrap();
            for (j, &tok) in new.iter().enumerate() {
                let t = p.len() - 1 + j;
                let row = &logits[t * vocab..(t + 1) * vocab];
                let (lp, ent) = log_softmax_entropy(row, tok);
                let argmax = (0..vocab).max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)));
                assert_eq!(argmax, Some(tok as usize), "{name} prompt {i} token {j}");
                assert!(
                    (f64::from(out.log_probs[i][j]) - lp).abs() <= 1e-5,
                    "{name} lp"
                );
                assert!(
                    (f64::from(out.entropies[i][j]) - ent).abs() <= 1e-5,
                    "{name} ent"
                );
            }
        }
    }
}

#[test]
fn request_errors() {
    let m = model("llama_tiny");
    let ok = request(vec![vec![5, 6]], Sampling::Greedy, 0);
    let err = |req: GenerateRequest| m.generate(&req).unwrap_err();

    let e = err(GenerateRequest {
        prompts: vec![],
        ..ok.clone()
    });
    assert!(matches!(e, GenerateError::NoPrompts), "{e}");

    let e = err(GenerateRequest {
        prompts: vec![vec![3], vec![]],
        ..ok.clone()
    });
    assert!(matches!(e, GenerateError::EmptyPrompt { index: 1 }), "{e}");

    let e = err(GenerateRequest {
        prompts: vec![vec![3, 97]],
        ..ok.clone()
    });
    assert!(
        matches!(
            e,
            GenerateError::TokenOutOfRange {
                id: 97,
                vocab: 97,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("prompt 0 token 1"), "{e}");

    let e = err(GenerateRequest {
        eos_ids: vec![2, 500],
        ..ok.clone()
    });
    assert!(e.to_string().contains("eos_ids[1]"), "{e}");

    let max = m.spec().max_positions;
    let e = err(GenerateRequest {
        max_new_tokens: max,
        ..ok.clone()
    });
    assert!(
        matches!(
            e,
            GenerateError::TooLong {
                index: 0,
                prompt_len: 2,
                ..
            }
        ),
        "{e}"
    );
    // One past the maximum fails, exactly the maximum fits.
    let e = err(GenerateRequest {
        prompts: vec![vec![1; max]],
        max_new_tokens: 1,
        ..ok.clone()
    });
    assert!(matches!(e, GenerateError::TooLong { .. }), "{e}");
    let out = m
        .generate(&GenerateRequest {
            prompts: vec![vec![1; max - 1]],
            max_new_tokens: 1,
            ..ok.clone()
        })
        .unwrap();
    assert_eq!(out.tokens[0].len(), 1);

    for bad in [
        Sampling::Sample {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
        },
        Sampling::Sample {
            temperature: f32::NAN,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
        },
        Sampling::Sample {
            temperature: 1.0,
            top_k: Some(0),
            top_p: 1.0,
            min_p: 0.0,
        },
        Sampling::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: 0.0,
            min_p: 0.0,
        },
        Sampling::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: 1.5,
            min_p: 0.0,
        },
    ] {
        let e = err(GenerateRequest {
            sampling: bad,
            ..ok.clone()
        });
        assert!(matches!(e, GenerateError::Sampling(_)), "{bad:?}: {e}");
    }

    // Zero new tokens: empty outputs.
    let out = m
        .generate(&GenerateRequest {
            max_new_tokens: 0,
            ..ok
        })
        .unwrap();
    assert_eq!(out.tokens, vec![Vec::<u32>::new()]);
}

#[test]
fn prefill_computes_the_head_for_each_prompts_last_position_only() {
    for name in MODELS {
        let m = model(name);
        let vocab = m.spec().vocab;
        // 5 prompts of width 9: the prefill arena holds 5 · V logits, not 5 · 9 · V.
        let acts = m.prefill_activations(5, 9).unwrap();
        assert_eq!(acts.shape(), (5, 9));
        assert_eq!(acts.logits_buffer_len(), 5 * vocab, "{name}");
        assert_eq!(acts.head_mode(), HeadMode::Chunked { rows: 5 }, "{name}");
        // One prompt of one token: a single row.
        let acts = m.prefill_activations(1, 1).unwrap();
        assert_eq!(acts.logits_buffer_len(), vocab, "{name}");
        // The public cached pass still wants whole logits: it refuses this arena.
        let mut acts = m.prefill_activations(2, 3).unwrap();
        let mut cache = KvCache::new(m.backend(), m.spec(), 2, 4).unwrap();
        let (ids, mask, pos) = ([1u32; 6], [1u32; 6], [0u32, 1, 2, 0, 1, 2]);
        let err = m
            .forward_cached(
                &Inputs {
                    batch: 2,
                    seq: 3,
                    input_ids: &ids,
                    attention_mask: &mask,
                    position_ids: &pos,
                },
                &mut acts,
                &mut cache,
            )
            .unwrap_err();
        assert!(err.to_string().contains("chunked LM head"), "{err}");
        assert_eq!(cache.len(), 0);
    }
}

#[test]
fn a_generator_reused_for_several_batches_gives_what_generate_gives() {
    for name in MODELS {
        let m = model(name);
        let requests = [
            GenerateRequest {
                prompts: vec![vec![1, 2, 3], vec![4, 5]],
                max_new_tokens: 6,
                eos_ids: vec![],
                sampling: SAMPLE,
                seed: 11,
            },
            GenerateRequest {
                prompts: vec![vec![7, 8, 9, 10]],
                max_new_tokens: 4,
                eos_ids: vec![],
                sampling: Sampling::Greedy,
                seed: 0,
            },
        ];
        let generator = m.generator().unwrap();
        for (i, r) in requests.iter().enumerate() {
            assert_eq!(
                generator.generate(r).unwrap(),
                m.generate(r).unwrap(),
                "{name} request {i}"
            );
        }
        // a bad request is still refused
        let bad = GenerateRequest {
            prompts: vec![],
            ..requests[1].clone()
        };
        assert!(matches!(
            generator.generate(&bad),
            Err(GenerateError::NoPrompts)
        ));
    }
}

/// What capturing a decode step as a CUDA graph needs of the engine, counted by a backend
/// that runs the CPU backend (`backend::Counting`). Every decode step (no prefill in it)
/// makes **one** host synchronisation — the pick of its tokens, ids, log-probs, entropies
/// and the device status in one transfer. With `decode_buckets` the passes come in fixed
/// shapes: once a bucket has run, its steps allocate nothing and run the same ops in the
/// same order, however many of its rows are real — the outputs the same bits as without
/// padding. Without buckets a change in the number of rows re-plans the arena (the check
/// can fail).
#[test]
fn a_decode_step_waits_once_and_buckets_repeat_their_ops() {
    use ares_model::backend::{Counting, Counts};
    let checkpoint = Checkpoint::load(&fixture("qwen2_tiny")).unwrap();
    let m = Model::from_checkpoint(Counting::new(CpuBackend), &checkpoint).unwrap();
    let generator = m.generator().unwrap();
    let ops = |c: &Counts| -> Vec<&'static str> {
        c.calls
            .iter()
            .copied()
            .filter(|n| !n.starts_with("alloc") && !n.starts_with("upload"))
            .filter(|n| !n.ends_with("_capture"))
            .collect()
    };
    for sampling in [Sampling::Greedy, SAMPLE] {
        let mut outputs = Vec::new();
        for decode_buckets in [false, true] {
            let request = EngineRequest {
                max_new_tokens: 10,
                eos_ids: Vec::new(),
                sampling,
                seed: 3,
            };
            let config = EngineConfig {
                decode_buckets,
                ..EngineConfig::default()
            };
            let mut engine = Engine::new(&generator, request, config).unwrap();
            for p in [vec![1u32, 5, 9], vec![2, 7], vec![3, 4, 8, 6]] {
                engine.submit(p).unwrap();
            }
            m.backend().take();
            // (real rows, counts) of each decode step without a prefill
            let mut steps: Vec<(usize, Counts)> = Vec::new();
            let mut finished = Vec::new();
            while !engine.is_idle() {
                if engine.stats().steps == 3 {
                    engine.submit(vec![11, 12]).unwrap(); // 3 rows, then 4, then 1
                }
                let before = engine.stats();
                finished.extend(engine.step().unwrap());
                let (after, counts) = (engine.stats(), m.backend().take());
                let prefilled = after.prefill_passes + after.extend_passes
                    > before.prefill_passes + before.extend_passes;
                if after.decode_passes > before.decode_passes && !prefilled {
                    steps.push((after.decode_rows - before.decode_rows, counts));
                }
            }
            let rows: Vec<usize> = steps.iter().map(|s| s.0).collect();
            for n in [3, 4, 1] {
                assert!(rows.iter().filter(|&&r| r == n).count() >= 2, "{rows:?}");
            }
            for (i, (_, c)) in steps.iter().enumerate() {
                assert_eq!(c.host_waits, 1, "{sampling:?} step {i}: {:?}", c.calls);
                assert_eq!(
                    c.calls.last(),
                    Some(&"pick_tokens"),
                    "{sampling:?} step {i}"
                );
            }
            let bucket = |n: usize| {
                if decode_buckets {
                    n.next_power_of_two()
                } else {
                    n
                }
            };
            for (i, (n, c)) in steps.iter().enumerate() {
                let Some(first) = steps[..i]
                    .iter()
                    .position(|(m, _)| bucket(*m) == bucket(*n))
                else {
                    continue; // a bucket's first step plans its buffers
                };
                assert_eq!(
                    c.allocations, 0,
                    "{sampling:?} buckets {decode_buckets} step {i} ({n} rows)"
                );
                assert_eq!(
                    ops(c),
                    ops(&steps[first].1),
                    "{sampling:?} step {i} ({n} rows)"
                );
            }
            // 3 and 4 rows share a bucket: the step where the fourth row joins allocates
            // nothing with buckets, and re-plans without
            let joined = rows.iter().position(|&r| r == 4).unwrap();
            assert_eq!(steps[joined - 1].0, 3, "{rows:?}");
            assert_eq!(steps[joined].1.allocations == 0, decode_buckets, "{rows:?}");
            finished.sort_by_key(|f| f.id);
            outputs.push(finished);
        }
        for (a, b) in outputs[0].iter().zip(&outputs[1]) {
            assert_eq!(a.tokens, b.tokens, "{sampling:?} sequence {}", a.id);
            assert_eq!(a.log_probs, b.log_probs, "{sampling:?} sequence {}", a.id);
            assert_eq!(a.entropies, b.entropies, "{sampling:?} sequence {}", a.id);
        }
    }
}

/// `WeightDtype::Training` generates with the training weights themselves: no copy is
/// made (the generator allocates nothing), and the tokens are the f32 decode copy's, the
/// log-probs within rounding (a GEMM instead of the column tiles) — what the CUDA backend
/// now does for f32 (`Backend::decodes_from_training_weights`).
#[test]
fn training_weights_generate_without_a_copy() {
    use ares_model::backend::Counting;
    for name in MODELS {
        let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
        let m = Model::from_checkpoint(Counting::new(CpuBackend), &checkpoint).unwrap();
        m.backend().take();
        let copy = m.generator_with(WeightDtype::F32).unwrap();
        assert!(
            m.backend().take().allocations >= 8,
            "{name}: the f32 copies"
        );
        let shared = m.generator_with(WeightDtype::Training).unwrap();
        assert_eq!(m.backend().take().allocations, 0, "{name}: no copy");
        for sampling in [Sampling::Greedy, SAMPLE] {
            let req = request(greedy_fixture(name).prompts, sampling, 4);
            let (want, got) = (copy.generate(&req).unwrap(), shared.generate(&req).unwrap());
            assert_eq!(got.tokens, want.tokens, "{name} {sampling:?}");
            assert_close(&got.log_probs, &want.log_probs, 1e-4, name);
            assert_close(&got.entropies, &want.entropies, 1e-4, name);
        }
    }
}

/// The capture of a decode pass as a graph, on a backend that stands in for one that records
/// graphs (`Counting::emulating_capture` over the CPU): every shape's second pass is
/// captured, and inside each capture there is nothing a capture cannot record — no
/// allocation, no transfer, no wait — only the pass's ops, the same as its eager run. The
/// emulated captures report failure, so the engine runs those passes again as they are and
/// never tries that shape again: the outputs are the same bits as without buckets.
#[test]
fn decode_passes_are_capturable() {
    use ares_model::backend::Counting;
    let checkpoint = Checkpoint::load(&fixture("qwen2_tiny")).unwrap();
    let plain = model("qwen2_tiny");
    let m = Model::from_checkpoint(Counting::emulating_capture(CpuBackend), &checkpoint).unwrap();
    for sampling in [Sampling::Greedy, SAMPLE] {
        let mut req = request(greedy_fixture("qwen2_tiny").prompts, sampling, 6);
        req.max_new_tokens = 24; // past a block of 16: the tables widen
        let want = plain.generate(&req).unwrap();
        let generator = m.generator().unwrap();
        let request = EngineRequest {
            max_new_tokens: req.max_new_tokens,
            eos_ids: Vec::new(),
            sampling,
            seed: 6,
        };
        let config = EngineConfig {
            decode_buckets: true,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(&generator, request, config).unwrap();
        for p in &req.prompts {
            engine.submit(p.clone()).unwrap();
        }
        m.backend().take();
        let out = engine.run_to_end(&mut |_, _| {}).unwrap();
        let c = m.backend().take();
        let stats = engine.stats();
        assert!(c.captures >= 2, "{sampling:?}: {} captures", c.captures);
        assert_eq!(stats.graph_failures, c.captures, "{sampling:?}");
        assert_eq!((stats.graph_captures, stats.graph_replays), (0, 0));
        assert!(
            c.in_capture.is_empty(),
            "{sampling:?}: inside a capture: {:?}",
            c.in_capture
        );
        // each capture holds the pass's ops, which then run again as they are
        let mut at = 0;
        while let Some(b) = c.calls[at..].iter().position(|&n| n == "begin_capture") {
            let begin = at + b;
            let end = begin
                + c.calls[begin..]
                    .iter()
                    .position(|&n| n == "end_capture")
                    .unwrap();
            let captured = &c.calls[begin + 1..end];
            assert!(captured.len() > 20 && captured.contains(&"paged_attention_decode"));
            assert_eq!(
                &c.calls[end + 1..end + 1 + captured.len()],
                captured,
                "{sampling:?}"
            );
            at = end + 1;
        }
        assert_eq!(out.tokens, want.tokens, "{sampling:?}");
        assert_eq!(out.log_probs, want.log_probs, "{sampling:?}");
    }
}
