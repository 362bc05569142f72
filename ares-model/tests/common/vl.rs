//! The Qwen2-VL / Qwen2.5-VL runtime against transformers 5.24, written once for any backend:
//! `tests/vision_model.rs` runs these checks on the CPU backend, `tests/cuda_vision.rs` on
//! the CUDA one. Fixtures: `scripts/make_vl_fixtures.py` (`tests/fixtures/vl/`, README there).

use std::path::{Path, PathBuf};

use super::{f32s, rel_err, u32s};
use ares_model::backend::Backend;
use ares_model::vision::checkpoint::VlCheckpoint;
use ares_model::vision::model::{VisionBatch, VlModel};
use ares_model::vision::tower::VisionPlan;
use safetensors::SafeTensors;

pub const MODELS: [&str; 2] = ["qwen2_vl_tiny", "qwen2_5_vl_tiny"];
pub const CASES: [&str; 4] = ["image", "two_images", "video", "text"];
/// Relative tolerance of activations and logits (f32, other summation orders).
pub const TOL: f64 = 1e-4;

/// A fixture model's directory: under `$ARES_FIXTURE_VL` when set (the GPU bundle carries
/// a copy, since its test binaries run on another machine), else `tests/fixtures/vl`.
pub fn dir(model: &str) -> PathBuf {
    std::env::var_os("ARES_FIXTURE_VL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vl"))
        .join(model)
}

pub fn grids(st: &SafeTensors<'_>, name: &str) -> Vec<[usize; 3]> {
    if st.tensor(name).is_err() {
        return Vec::new();
    }
    let (_, v) = u32s(st, name);
    v.chunks(3)
        .map(|g| [g[0] as usize, g[1] as usize, g[2] as usize])
        .collect()
}

pub fn has(st: &SafeTensors<'_>, name: &str) -> bool {
    st.tensor(name).is_ok()
}

pub struct Case {
    pub ids: Vec<u32>,
    pub mask: Vec<u32>,
    pub vision: VisionBatch,
}

pub fn case(st: &SafeTensors<'_>, c: &str) -> Case {
    let (_, ids) = u32s(st, &format!("{c}.input_ids"));
    let (_, mask) = u32s(st, &format!("{c}.attention_mask"));
    let get = |n: &str| {
        let n = format!("{c}.{n}");
        if has(st, &n) {
            f32s(st, &n)
        } else {
            Vec::new()
        }
    };
    let vision = VisionBatch {
        image_pixels: get("pixel_values"),
        image_grids: grids(st, &format!("{c}.image_grid_thw")),
        video_pixels: get("pixel_values_videos"),
        video_grids: grids(st, &format!("{c}.video_grid_thw")),
        second_per_grid_ts: get("second_per_grid_ts")
            .iter()
            .map(|&x| f64::from(x))
            .collect(),
    };
    Case { ids, mask, vision }
}

pub fn load(model: &str) -> (VlCheckpoint, Vec<u8>) {
    let ck = VlCheckpoint::load(&dir(model)).unwrap();
    let bytes = std::fs::read(dir(model).join("expected.safetensors")).unwrap();
    (ck, bytes)
}

/// Forward and backward of `Σ logits · W` on case `c` of `st` (its `W` the upstream
/// gradient): the language model's gradients and the tower's.
pub fn grads_of_case<B: Backend>(
    m: &VlModel<B>,
    st: &SafeTensors<'_>,
    c: &str,
) -> (
    ares_model::model::Grads<B>,
    ares_model::vision::tower::VisionGrads<B>,
) {
    use ares_model::backend::{View, ViewMut};
    use ares_model::model::Inputs;
    let be = m.backend();
    let cs = case(st, c);
    let layout = m.layout(&cs.ids, &cs.mask, 1, &cs.vision).unwrap();
    let seq = cs.ids.len();
    let positions = layout.positions.axis(0).to_vec();
    let inputs = Inputs {
        batch: 1,
        seq,
        input_ids: &cs.ids,
        attention_mask: &cs.mask,
        position_ids: &positions,
    };
    let mut acts = m.lm().activations_full(1, seq).unwrap();
    let mut vl = m
        .forward(&inputs, &cs.vision, &layout, &mut acts, true)
        .unwrap();
    let w = f32s(st, &format!("{c}.W"));
    let mut dlogits = be.alloc(w.len()).unwrap();
    be.upload(&w, ViewMut::whole(&mut dlogits)).unwrap();
    let mut lm_grads = m.lm().grads().unwrap();
    let mut vg = m.tower().zero_grads(be).unwrap();
    m.backward(
        &inputs,
        &mut acts,
        &mut vl,
        View::whole(&dlogits),
        &mut lm_grads,
        Some(&mut vg),
    )
    .unwrap();
    (lm_grads, vg)
}

pub fn window_order_and_tower_match_transformers<B: Backend>(make: impl Fn() -> B) {
    for model in MODELS {
        let (ck, bytes) = load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let m = VlModel::from_checkpoint(make(), &ck).unwrap();
        let be = m.backend();
        for c in CASES {
            let cs = case(&st, c);
            if cs.vision.is_empty() {
                continue;
            }
            let mut grids = cs.vision.image_grids.clone();
            grids.extend(&cs.vision.video_grids);
            let plan = VisionPlan::new(&ck.config.vision, &grids).unwrap();
            if has(&st, &format!("{c}.vision.window_index")) {
                let (_, wi) = u32s(&st, &format!("{c}.vision.window_index"));
                assert_eq!(plan.unit_order, wi, "{model} {c}: window order");
                let (_, cu) = u32s(&st, &format!("{c}.vision.cu_window_seqlens"));
                assert_eq!(plan.cu_window, cu, "{model} {c}: window bounds");
            }
            let tower = m.tower();
            let mut acts = tower.activations(be, plan.clone(), false).unwrap();
            tower
                .forward(be, &VlModel::<B>::pixels(&cs.vision), &mut acts)
                .unwrap();
            let depth = ck.config.vision.depth;
            let mut last = vec![0.0; acts.last_hidden(depth).unwrap().len()];
            be.download(acts.last_hidden(depth).unwrap(), &mut last)
                .unwrap();
            let want = f32s(&st, &format!("{c}.vision.last_hidden_state"));
            let e = rel_err(&last, &want);
            assert!(e < TOL, "{model} {c}: last_hidden_state rel err {e:e}");
            let mut out = vec![0.0; acts.output().len()];
            be.download(acts.output(), &mut out).unwrap();
            // tower order → processor order
            let d = ck.config.vision.out_hidden;
            let mut merged = vec![0.0; out.len()];
            for (j, &u) in plan.unit_order.iter().enumerate() {
                let u = u as usize;
                merged[u * d..(u + 1) * d].copy_from_slice(&out[j * d..(j + 1) * d]);
            }
            let want = f32s(&st, &format!("{c}.vision.merged"));
            let e = rel_err(&merged, &want);
            assert!(e < TOL, "{model} {c}: merged rel err {e:e}");
        }
    }
}

pub fn positions_and_logits_match_transformers<B: Backend>(make: impl Fn() -> B) {
    for model in MODELS {
        let (ck, bytes) = load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let m = VlModel::from_checkpoint(make(), &ck).unwrap();
        let vocab = ck.config.text.vocab_size;
        for c in CASES {
            let cs = case(&st, c);
            let layout = m.layout(&cs.ids, &cs.mask, 1, &cs.vision).unwrap();
            let (_, pos) = u32s(&st, &format!("{c}.position_ids"));
            assert_eq!(
                layout.positions.position_ids, pos,
                "{model} {c}: position ids"
            );
            let logits = m.forward_logits(&cs.ids, &cs.mask, 1, &cs.vision).unwrap();
            let s = cs.ids.len();
            let last = &logits[(s - 1) * vocab..];
            let want = f32s(&st, &format!("{c}.logits_last"));
            let e = rel_err(last, &want);
            assert!(e < TOL, "{model} {c}: last logits rel err {e:e}");
            if c == "image" {
                let want = f32s(&st, "image.logits");
                let e = rel_err(&logits, &want);
                assert!(e < TOL, "{model} {c}: all logits rel err {e:e}");
            }
        }
    }
}

/// Gradients of `Σ logits · W` (transformers' autograd in the fixture) for every tower
/// parameter and five language-model tensors, on the `image` and `video` cases.
pub fn gradients_match_transformers_autograd<B: Backend>(make: impl Fn() -> B) {
    use ares_model::backend::{DeviceBuffer, View};
    use ares_model::vision::weights::param_table;
    // f32 on both sides, other summation orders: all but one tensor agree within 6e-6; the
    // exception, a norm weight's gradient (a sum over every patch), is at 1.5e-5.
    const GRAD_TOL: f64 = 2e-5;
    for model in MODELS {
        let (ck, bytes) = load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let m = VlModel::from_checkpoint(make(), &ck).unwrap();
        let be = m.backend();
        let vocab = ck.config.text.vocab_size;
        for c in ["image", "video"] {
            let seq = case(&st, c).ids.len();
            assert_eq!(f32s(&st, &format!("{c}.W")).len(), seq * vocab);
            let (lm_grads, vg) = grads_of_case(&m, &st, c);
            let prefix = if has(&st, &format!("{c}.grad.visual.merger.mlp.0.weight")) {
                "visual."
            } else {
                "model.visual."
            };
            let mut checked = 0;
            for spec in param_table(&ck.config.vision) {
                let buf = vg.get(spec.slot).unwrap();
                let mut got = vec![0.0; buf.len()];
                be.download(View::whole(buf), &mut got).unwrap();
                let blocks = if spec.per_block {
                    ck.config.vision.depth
                } else {
                    1
                };
                for l in 0..blocks {
                    let name = format!("{c}.grad.{prefix}{}", spec.hf_name(l));
                    let want = f32s(&st, &name);
                    let item = spec.item();
                    let e = rel_err(&got[l * item..(l + 1) * item], &want);
                    assert!(e < GRAD_TOL, "{model} {name}: rel err {e:e}");
                    checked += 1;
                }
            }
            assert!(checked > 20, "{model}: {checked} vision gradients");
            for name in [
                "model.embed_tokens.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.1.mlp.down_proj.weight",
                "model.norm.weight",
                "lm_head.weight",
            ] {
                let fixture_name = if prefix == "visual." || name == "lm_head.weight" {
                    name.to_string()
                } else {
                    name.replacen("model.", "model.language_model.", 1)
                };
                let want = f32s(&st, &format!("{c}.grad.{fixture_name}"));
                let got = lm_grads.download(be, name).unwrap();
                let e = rel_err(&got, &want);
                assert!(e < GRAD_TOL, "{model} {c} {name}: rel err {e:e}");
            }
        }
    }
}

/// Activation checkpointing of the tower's blocks and the language model's layers
/// (`set_gradient_checkpointing` on both) gives every tower gradient and the language
/// model's, bit for bit, as the arenas that keep every activation — every fixture model,
/// image and video.
pub fn checkpointed_gradients_are_the_stored_ones<B: Backend>(make: impl Fn() -> B) {
    use ares_model::backend::{DeviceBuffer, View};
    use ares_model::vision::weights::param_table;
    for model in MODELS {
        let (ck, bytes) = load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut m = VlModel::from_checkpoint(make(), &ck).unwrap();
        for c in ["image", "video"] {
            let cs = case(&st, c);
            let mut runs: Vec<Vec<Vec<u32>>> = Vec::new();
            for on in [false, true] {
                m.lm_mut().set_gradient_checkpointing(on);
                m.tower_mut().set_gradient_checkpointing(on);
                let be = m.backend();
                assert_eq!(
                    m.lm()
                        .activations_full(1, cs.ids.len())
                        .unwrap()
                        .checkpointed(),
                    on
                );
                let (lm_grads, vg) = grads_of_case(&m, &st, c);
                let mut all = Vec::new();
                for spec in param_table(&ck.config.vision) {
                    let buf = vg.get(spec.slot).unwrap();
                    let mut got = vec![0.0f32; buf.len()];
                    be.download(View::whole(buf), &mut got).unwrap();
                    all.push(got.iter().map(|x| x.to_bits()).collect());
                }
                for name in [
                    "model.embed_tokens.weight",
                    "model.layers.0.self_attn.q_proj.weight",
                    "model.layers.1.mlp.down_proj.weight",
                    "model.norm.weight",
                ] {
                    let got = lm_grads.download(be, name).unwrap();
                    all.push(got.iter().map(|x| x.to_bits()).collect());
                }
                runs.push(all);
            }
            assert!(runs[0].iter().flatten().any(|&b| f32::from_bits(b) != 0.0));
            assert!(
                runs[0] == runs[1],
                "{model} {c}: checkpointed gradients differ"
            );
        }
    }
}

/// Greedy continuations (KV cache, M-RoPE prefill, `len + k + rope_delta` decode positions)
/// equal transformers' `generate`, for every case, each prompt alone and all four batched
/// (left padding).
pub fn greedy_generation_matches_transformers<B: Backend>(make: impl Fn() -> B) {
    use ares_model::model::{GenerateRequest, Sampling};
    for model in MODELS {
        let (ck, bytes) = load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let m = VlModel::from_checkpoint(make(), &ck).unwrap();
        let generator = m.generator().unwrap();
        let (mut prompts, mut visions, mut wants) = (Vec::new(), Vec::new(), Vec::new());
        for c in CASES {
            let cs = case(&st, c);
            let (_, want) = u32s(&st, &format!("{c}.greedy"));
            let request = GenerateRequest {
                prompts: vec![cs.ids.clone()],
                max_new_tokens: want.len(),
                eos_ids: vec![293, 291],
                sampling: Sampling::Greedy,
                seed: 0,
            };
            let out = generator
                .generate(&request, std::slice::from_ref(&cs.vision), |_, _| {})
                .unwrap();
            assert_eq!(out.tokens[0], want, "{model} {c}: greedy tokens");
            prompts.push(cs.ids);
            visions.push(cs.vision);
            wants.push(want);
        }
        let request = GenerateRequest {
            prompts,
            max_new_tokens: 8,
            eos_ids: vec![293, 291],
            sampling: Sampling::Greedy,
            seed: 0,
        };
        let out = generator.generate(&request, &visions, |_, _| {}).unwrap();
        assert_eq!(out.tokens, wants, "{model}: batched greedy tokens");
        // chunked prefill: the prompts prefilled 3, 5 or 7 tokens a step,
        // image and video rows and M-RoPE spans cut across chunks, decode meanwhile
        for chunk in [3, 5, 7] {
            let chunked = m.generator().unwrap().max_prefill_tokens(chunk);
            let got = chunked.generate(&request, &visions, |_, _| {}).unwrap();
            assert_eq!(
                got.tokens, wants,
                "{model}: greedy tokens, chunks of {chunk}"
            );
            for (a, b) in got
                .log_probs
                .iter()
                .flatten()
                .zip(out.log_probs.iter().flatten())
            {
                assert!(
                    (a - b).abs() <= 1e-4,
                    "{model} chunks of {chunk}: {a} vs {b}"
                );
            }
        }
    }
}

/// Multi-turn conversations of image, two-image and text prompts through one engine that
/// keeps each finished turn's blocks and prefills only what a tool appended
/// (`Engine::continue_with`): each turn equals generating after the whole conversation
/// with its images (the same tokens; log-probs within 1e-4), greedy and sampled, on both
/// fixtures — also with budgets that free kept blocks (those continuations prefill the
/// whole conversation, images and M-RoPE positions included) and chunked prefills; no
/// block leaks.
pub fn continued_turns_equal_the_whole_conversation<B: Backend>(make: impl Fn() -> B) {
    use ares_model::model::{EngineConfig, GenerateError, GenerateRequest, Sampling};
    use safetensors::SafeTensors;
    const TURNS: usize = 3;
    let appended = |row: usize, turn: usize| -> Vec<u32> {
        (0..1 + (row + 2 * turn) % 5)
            .map(|i| 3 + ((row * 7 + turn * 5 + i * 3) % 40) as u32)
            .collect()
    };
    let budget = |row: usize, turn: usize| if turn == 0 { 5 } else { 4 + (row + turn) % 3 };
    let sample = Sampling::Sample {
        temperature: 1.2,
        top_k: None,
        top_p: 1.0,
        min_p: 0.0,
    };
    let (mut squeezed, mut compared, mut skipped) = (0, 0, 0);
    for name in MODELS {
        let (ck, bytes) = load(name);
        let c = &ck.config;
        // a random model writes vision tokens too: re-read as a prompt they would be
        // placeholders of images it does not have, so such conversations are not compared
        let vision_ids = [
            c.vision_start_token_id,
            c.vision_end_token_id,
            c.tokens.image_pad,
            c.tokens.video_pad,
        ];
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let m = VlModel::from_checkpoint(make(), &ck).unwrap();
        let cases = [
            case(&st, "image"),
            case(&st, "two_images"),
            case(&st, "text"),
        ];
        let order = [0usize, 0, 1, 2, 1, 0];
        let prompts: Vec<Vec<u32>> = order.iter().map(|&c| cases[c].ids.clone()).collect();
        let visions: Vec<&VisionBatch> = order.iter().map(|&c| &cases[c].vision).collect();
        let longest = prompts.iter().map(Vec::len).max().unwrap();
        // blocks of 4 slots: room for every conversation at once, then for about two
        let roomy = (longest + 24).div_ceil(4) * 6;
        let tight = (longest + 24).div_ceil(4) * 2 + 2;
        for sampling in [Sampling::Greedy, sample] {
            let seed = 7;
            for (max_seqs, max_blocks, max_prefill_tokens, decode_buckets) in [
                (6, None, 4096, false),
                (3, None, 16, false),
                (3, Some(tight), 4096, true),
                (6, Some(roomy / 2), 24, true),
            ] {
                let config = EngineConfig {
                    max_seqs,
                    block_size: 4,
                    max_blocks,
                    max_prefill_tokens,
                    decode_buckets,
                    ..EngineConfig::default()
                };
                let what = format!("{name} {sampling:?} {config:?}");
                let request = GenerateRequest {
                    prompts: prompts.clone(),
                    max_new_tokens: budget(0, 0),
                    eos_ids: Vec::new(),
                    sampling,
                    seed,
                };
                let g = m.generator().unwrap();
                let run = g.with_engine(&request, &visions, Some(config), |engine| {
                    engine.keep_finished(true);
                    let mut owner: std::collections::HashMap<usize, (usize, usize)> =
                        (0..prompts.len()).map(|j| (j, (j, 0))).collect();
                    let mut convs = prompts.clone();
                    let mut turns = vec![Vec::new(); prompts.len()];
                    let mut steps = 0;
                    while !engine.is_idle() {
                        steps += 1;
                        assert!(steps < 10_000, "the engine does not finish");
                        for f in engine.step()? {
                            let (j, t) = owner[&f.id];
                            turns[j].push((convs[j].clone(), f.tokens.clone(), f.log_probs));
                            convs[j].extend(&f.tokens);
                            if t + 1 < TURNS {
                                let app = appended(j, t);
                                convs[j].extend(&app);
                                let stream = (seed ^ (t as u64 + 1), j as u64);
                                let next =
                                    engine.continue_with(f.id, &app, stream, budget(j, t + 1))?;
                                owner.insert(next, (j, t + 1));
                            } else {
                                engine.release(f.id);
                            }
                        }
                    }
                    Ok::<_, GenerateError>((turns, engine.stats(), engine.pool().in_use()))
                });
                let (turns, stats, in_use) = run.unwrap();
                assert_eq!(in_use, 0, "{what}: blocks leaked");
                for (j, row) in turns.iter().enumerate() {
                    assert_eq!(row.len(), TURNS, "{what} row {j}");
                    for (t, (conv, tokens, log_probs)) in row.iter().enumerate() {
                        if conv[prompts[j].len()..]
                            .iter()
                            .any(|id| vision_ids.contains(id))
                        {
                            skipped += 1;
                            continue;
                        }
                        compared += 1;
                        // the conversation alone with its images, from the same stream
                        let mut alone = vec![vec![1u32]; j];
                        alone.push(conv.clone());
                        let empty = VisionBatch::default();
                        let mut vs = vec![&empty; j];
                        vs.push(visions[j]);
                        let want = m
                            .generator()
                            .unwrap()
                            .generate(
                                &GenerateRequest {
                                    prompts: alone,
                                    max_new_tokens: budget(j, t),
                                    eos_ids: Vec::new(),
                                    sampling,
                                    seed: seed ^ t as u64,
                                },
                                &vs,
                                |_, _| {},
                            )
                            .unwrap();
                        let at = format!("{what} row {j} turn {t}");
                        assert_eq!(*tokens, want.tokens[j], "{at}");
                        for (a, b) in log_probs.iter().zip(&want.log_probs[j]) {
                            assert!((a - b).abs() <= 1e-4, "{at}: {a} vs {b}");
                        }
                    }
                }
                let continued: usize = (0..prompts.len())
                    .flat_map(|j| (0..TURNS - 1).map(move |t| 1 + appended(j, t).len()))
                    .sum();
                if max_blocks.is_none() {
                    assert_eq!(stats.extend_tokens, continued, "{what}");
                } else {
                    squeezed += usize::from(stats.extend_tokens < continued);
                }
            }
        }
    }
    assert!(
        squeezed > 0,
        "no budget freed kept blocks: the budgets test nothing"
    );
    eprintln!("compared {compared} turns, skipped {skipped}");
    assert!(
        compared >= 4 * skipped,
        "{compared} turns compared, {skipped} skipped"
    );
}
