//! The Qwen2-VL / Qwen2.5-VL runtime (`ares_model::vision::{checkpoint, tower, model}`) on the
//! CPU backend against transformers 5.24: the tiny random models of
//! `scripts/make_vl_fixtures.py` (`tests/fixtures/vl/`, README there), one in the Hub tensor
//! layout and one in transformers 5's. Checked per case (one image, two images of other
//! sizes, a video, text only): the window order, the tower's last hidden state and merged
//! tokens, the M-RoPE positions, the last-position logits (and every position's for `image`),
//! the gradients of `Σ logits · W` for every tower parameter and some of the language
//! model's, and the greedy continuation.

mod common;

use ares_model::backend::cpu::CpuBackend;
use ares_model::vision::checkpoint::{VlCheckpoint, WeightLayout};
use ares_model::vision::model::VlModel;
use common::vl::{self, MODELS, dir};

#[test]
fn loads_both_layouts_with_every_tensor() {
    for model in MODELS {
        let ck = VlCheckpoint::load(&dir(model)).unwrap();
        // transformers 5.24's save_pretrained writes the Hub names for both families
        assert_eq!(ck.layout, WeightLayout::Hub, "{model}");
        let params: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir(model).join("params.json")).unwrap())
                .unwrap();
        let params = params.as_object().unwrap();
        let named = ck.named(ck.layout);
        assert_eq!(named.len(), params.len(), "{model}: tensor count");
        for (name, shape, data) in named {
            let p = &params[&name];
            let want: Vec<usize> = serde_json::from_value(p["shape"].clone()).unwrap();
            assert_eq!(shape, want, "{model} {name}");
            let sum: f64 = data.iter().map(|&x| f64::from(x)).sum();
            let want = p["sum"].as_f64().unwrap();
            assert!(
                (sum - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{model} {name}: {sum} vs {want}"
            );
        }
    }
}

#[test]
fn saves_and_reloads_in_both_layouts() {
    let tmp = std::env::temp_dir().join(format!("ares-vl-roundtrip-{}", std::process::id()));
    for model in MODELS {
        let ck = VlCheckpoint::load(&dir(model)).unwrap();
        for layout in [WeightLayout::Hub, WeightLayout::Nested] {
            let out = tmp.join(format!("{model}-{layout:?}"));
            ck.save(&out, ares_model::hf::tensor_files::SaveDtype::F32, layout)
                .unwrap();
            let back = VlCheckpoint::load(&out).unwrap();
            assert_eq!(back.layout, layout, "{model}");
            assert_eq!(back.text, ck.text, "{model} {layout:?}: language model");
            assert_eq!(back.vision, ck.vision, "{model} {layout:?}: vision tower");
            assert_eq!(back.config, ck.config, "{model} {layout:?}: config");
            if layout == WeightLayout::Nested {
                let files = ares_model::hf::tensor_files::TensorFiles::open(&out).unwrap();
                assert!(
                    files
                        .names()
                        .any(|n| n.starts_with("model.language_model.layers.0."))
                );
                assert!(
                    files
                        .names()
                        .any(|n| n.starts_with("model.visual.blocks.0."))
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn window_order_and_tower_match_transformers() {
    vl::window_order_and_tower_match_transformers(|| CpuBackend);
}

#[test]
fn positions_and_logits_match_transformers() {
    vl::positions_and_logits_match_transformers(|| CpuBackend);
}

#[test]
fn gradients_match_transformers_autograd() {
    vl::gradients_match_transformers_autograd(|| CpuBackend);
}

#[test]
fn checkpointed_gradients_are_the_stored_ones() {
    vl::checkpointed_gradients_are_the_stored_ones(|| CpuBackend);
}

#[test]
fn greedy_generation_matches_transformers() {
    vl::greedy_generation_matches_transformers(|| CpuBackend);
}

/// Whole-model finite differences: `(L(θ + ε) − L(θ − ε)) / 2ε` of `L = Σ logits · W` for
/// single weights of the tower (patch embedding, a block's fused qkv, norm, MLP, the merger)
/// and of the language model, against the backward pass. Independent of transformers.
#[test]
fn gradients_match_finite_differences() {
    use ares_model::backend::{Backend, View};
    use ares_model::vision::weights::Slot;
    use safetensors::SafeTensors;
    let loss = |ck: &VlCheckpoint, cs: &vl::Case, w: &[f32]| -> f64 {
        let m = VlModel::from_checkpoint(CpuBackend, ck).unwrap();
        let logits = m.forward_logits(&cs.ids, &cs.mask, 1, &cs.vision).unwrap();
        logits
            .iter()
            .zip(w)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum()
    };
    for model in MODELS {
        let (ck, bytes) = vl::load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let cs = vl::case(&st, "image");
        let w = common::f32s(&st, "image.W");
        // analytic gradients
        let m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        let be = m.backend();
        let (lg, vg) = vl::grads_of_case(&m, &st, "image");
        let eps = 1e-2f32;
        let probe = |analytic: f64, bump: &dyn Fn(&mut VlCheckpoint, f32), what: &str| {
            let (mut plus, mut minus) = (ck.clone(), ck.clone());
            bump(&mut plus, eps);
            bump(&mut minus, -eps);
            let fd = (loss(&plus, &cs, &w) - loss(&minus, &cs, &w)) / (2.0 * f64::from(eps));
            let err = (fd - analytic).abs() / analytic.abs().max(1.0);
            assert!(
                err < 1e-2,
                "{model} {what}: finite difference {fd}, backward {analytic}"
            );
        };
        for (slot, index) in [
            (Slot::Patch, 7),
            (Slot::Qkv, 5),
            (Slot::Norm1, 3),
            (Slot::MlpIn, 11),
            (Slot::MlpOut, 2),
            (Slot::Merger0, 130),
            (Slot::Merger2, 17),
        ] {
            let buf = vg.get(slot).unwrap();
            let mut g = vec![0.0; buf.len()];
            be.download(View::whole(buf), &mut g).unwrap();
            let bump = move |c: &mut VlCheckpoint, e: f32| {
                c.vision.get_mut(slot).unwrap().data[index] += e;
            };
            probe(f64::from(g[index]), &bump, &format!("{slot:?}[{index}]"));
        }
        let g = lg
            .download(be, "model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        let bump = |c: &mut VlCheckpoint, e: f32| {
            c.text.layers[0].q_proj.data[9] += e;
        };
        probe(f64::from(g[9]), &bump, "q_proj[9]");
    }
}

/// Writes both fixtures in both tensor layouts and both dtypes under
/// `$ARES_VL_ROUNDTRIP_DIR` for `scripts/check_vl_roundtrip.py` (transformers must load
/// them). Ignored: run by hand, `-- --ignored write_vl_roundtrip`.
#[test]
#[ignore = "writes checkpoints for scripts/check_vl_roundtrip.py"]
fn write_vl_roundtrip() {
    use ares_model::hf::tensor_files::SaveDtype;
    let root = std::path::PathBuf::from(
        std::env::var("ARES_VL_ROUNDTRIP_DIR").expect("set ARES_VL_ROUNDTRIP_DIR"),
    );
    for model in MODELS {
        let ck = VlCheckpoint::load(&dir(model)).unwrap();
        for (layout, l) in [(WeightLayout::Hub, "hub"), (WeightLayout::Nested, "nested")] {
            for (dtype, d) in [(SaveDtype::F32, "f32"), (SaveDtype::Bf16, "bf16")] {
                ck.save(&root.join(format!("{model}-{l}-{d}")), dtype, layout)
                    .unwrap();
            }
        }
    }
}

/// Bad multimodal inputs are errors naming what is wrong, never a panic: placeholders that
/// do not match the grids (one too few, one too many), a grid that is not a multiple of
/// the merge size, pixel values of the wrong length, a vision batch per prompt missing.
#[test]
fn bad_vision_inputs_are_clear_errors() {
    use ares_model::model::{GenerateRequest, Sampling};
    use safetensors::SafeTensors;
    let (ck, bytes) = vl::load("qwen2_vl_tiny");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    let cs = vl::case(&st, "image");
    let pad = ck.config.tokens.image_pad;
    let err = |r: Result<Vec<f32>, ares_model::model::ModelError>| r.unwrap_err().to_string();

    // one placeholder too few; a stray one before the block
    let i = cs.ids.iter().position(|&t| t == pad).unwrap();
    let mut fewer = cs.ids.clone();
    fewer[i] = 0;
    let e = err(m.forward_logits(&fewer, &cs.mask, 1, &cs.vision));
    assert!(
        e.contains("5 <|image_pad|>") && e.contains("needs 6"),
        "{e}"
    );
    let mut more = cs.ids.clone();
    more[0] = pad;
    let e = err(m.forward_logits(&more, &cs.mask, 1, &cs.vision));
    assert!(
        e.contains("has 1 <|image_pad|>") && e.contains("needs 6"),
        "{e}"
    );

    // a grid the merge size does not divide
    let mut odd = cs.vision.clone();
    odd.image_grids[0] = [1, 3, 6];
    let e = err(m.forward_logits(&cs.ids, &cs.mask, 1, &odd));
    assert!(e.contains("[1, 3, 6] is invalid"), "{e}");

    // pixel values of the wrong length
    let mut short = cs.vision.clone();
    short.image_pixels.truncate(100);
    let e = err(m.forward_logits(&cs.ids, &cs.mask, 1, &short));
    assert!(e.contains("pixel_values has 100 values"), "{e}");

    // generation: one vision batch per prompt
    let request = GenerateRequest {
        prompts: vec![cs.ids.clone(), cs.ids.clone()],
        max_new_tokens: 2,
        eos_ids: vec![],
        sampling: Sampling::Greedy,
        seed: 0,
    };
    let g = m.generator().unwrap();
    let e = g
        .generate(&request, std::slice::from_ref(&cs.vision), |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 vision batches for 2 prompts"), "{e}");
}

/// The training step's pieces on a multimodal batch: the backward from per-token
/// `∂L/∂logπ` equals the backward from the `∂L/∂logits` it implies (computed on the host),
/// for the tower and the language model; an AdamW step moves tower and LM weights by
/// PyTorch's update of the joint gradient; a frozen tower's weights stay bit-identical.
#[test]
fn training_step_pieces() {
    use ares_model::backend::{Backend, View, ViewMut};
    use ares_model::model::{AdamW, AdamWConfig, Inputs, StateDtype};
    use ares_model::vision::model::VisionMoments;
    use ares_model::vision::weights::Slot;
    use safetensors::SafeTensors;
    let (ck, bytes) = vl::load("qwen2_5_vl_tiny");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let cs = vl::case(&st, "image");
    let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    let vocab = ck.config.text.vocab_size;
    let layout = m.layout(&cs.ids, &cs.mask, 1, &cs.vision).unwrap();
    let positions = layout.positions.axis(0).to_vec();
    let seq = cs.ids.len();
    let inputs = Inputs {
        batch: 1,
        seq,
        input_ids: &cs.ids,
        attention_mask: &cs.mask,
        position_ids: &positions,
    };
    // targets: the next token; coefficients on the last 10 positions
    let mut targets: Vec<u32> = cs.ids[1..].to_vec();
    targets.push(0);
    let coeffs: Vec<f32> = (0..seq)
        .map(|t| {
            if t + 11 > seq && t + 1 < seq {
                0.1 * (t % 3) as f32 - 0.1
            } else {
                0.0
            }
        })
        .collect();
    let temperature = 0.7f32;

    let grads_of = |m: &VlModel<CpuBackend>, from_logprob: bool| {
        let be = m.backend();
        let mut acts = m.lm().activations_full(1, seq).unwrap();
        let mut vla = m
            .forward(&inputs, &cs.vision, &layout, &mut acts, true)
            .unwrap();
        let mut lg = m.lm().grads().unwrap();
        let mut vg = m.tower().zero_grads(be).unwrap();
        if from_logprob {
            m.backward_from_log_prob_grads(
                &inputs,
                &mut acts,
                &mut vla,
                &targets,
                &coeffs,
                temperature,
                &mut lg,
                Some(&mut vg),
                None,
            )
            .unwrap();
        } else {
            let mut logits = vec![0.0; seq * vocab];
            m.lm().download_logits(&acts, &mut logits).unwrap();
            let mut d = vec![0.0f32; seq * vocab];
            for t in 0..seq {
                let row = &logits[t * vocab..(t + 1) * vocab];
                let z: Vec<f64> = row
                    .iter()
                    .map(|&x| f64::from(x) / f64::from(temperature))
                    .collect();
                let mx = z.iter().cloned().fold(f64::MIN, f64::max);
                let sum: f64 = z.iter().map(|&x| (x - mx).exp()).sum();
                for v in 0..vocab {
                    let p = (z[v] - mx).exp() / sum;
                    let onehot = f64::from(u8::from(v as u32 == targets[t]));
                    d[t * vocab + v] =
                        (f64::from(coeffs[t]) / f64::from(temperature) * (onehot - p)) as f32;
                }
            }
            let mut dl = be.alloc(d.len()).unwrap();
            be.upload(&d, ViewMut::whole(&mut dl)).unwrap();
            m.backward(
                &inputs,
                &mut acts,
                &mut vla,
                View::whole(&dl),
                &mut lg,
                Some(&mut vg),
            )
            .unwrap();
        }
        let mut tower = Vec::new();
        for (_, buf) in vg.iter() {
            let mut h = vec![0.0; buf.len()];
            be.download(View::whole(buf), &mut h).unwrap();
            tower.push(h);
        }
        let q = lg
            .download(be, "model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        (tower, q, lg, vg)
    };
    let (t_lp, q_lp, lg, vg) = grads_of(&m, true);
    let (t_dl, q_dl, _, _) = grads_of(&m, false);
    for (i, (a, b)) in t_lp.iter().zip(&t_dl).enumerate() {
        let e = common::rel_err(a, b);
        assert!(e < 1e-5, "tower gradient {i}: {e:e}");
    }
    assert!(common::rel_err(&q_lp, &q_dl) < 1e-5);

    // AdamW on the joint gradient, against PyTorch's formula on the host
    let be = CpuBackend;
    let cfg = AdamWConfig::default();
    let lr = 1e-3;
    let before = m.tower().download_weights(&be).unwrap();
    let g_patch = t_lp[0].clone();
    let mut opt = AdamW::new(m.lm(), cfg).unwrap();
    let mut moments = m.vision_moments(StateDtype::F32).unwrap();
    let report = m
        .optimizer_step(&mut opt, &lg, Some((&mut moments, &vg)), lr, None)
        .unwrap();
    assert!(report.applied);
    let after = m.tower().download_weights(&be).unwrap();
    // first step, no clipping: w ← w(1 − lr·wd) − lr · g/(|g| + eps) (bias-corrected m̂ = g, v̂ = g²)
    let w0 = &before.get(Slot::Patch).unwrap().data;
    let w1 = &after.get(Slot::Patch).unwrap().data;
    for i in [0, 17, 500] {
        let g = f64::from(g_patch[i]);
        let want = f64::from(w0[i]) * (1.0 - lr * cfg.weight_decay) - lr * g / (g.abs() + cfg.eps);
        assert!(
            (f64::from(w1[i]) - want).abs() <= 1e-6 * want.abs().max(1e-3),
            "patch[{i}]: {} vs {want}",
            w1[i]
        );
    }
    // frozen tower: a step without vision gradients leaves every tower weight as it was
    let frozen_before = m.tower().download_weights(&be).unwrap();
    m.optimizer_step(&mut opt, &lg, None, lr, None).unwrap();
    assert_eq!(m.tower().download_weights(&be).unwrap(), frozen_before);

    // the tower's moments in 8 bits: saved and loaded bit for bit
    let mut q = m.vision_moments(StateDtype::Int8).unwrap();
    let mut opt8 = AdamW::with_state_dtype(m.lm(), cfg, StateDtype::Int8).unwrap();
    m.optimizer_step(&mut opt8, &lg, Some((&mut q, &vg)), lr, None)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (dir.path().join("a"), dir.path().join("b"));
    q.save(&be, m.tower(), &first).unwrap();
    let back = VisionMoments::load(&be, m.tower(), StateDtype::Int8, &first).unwrap();
    assert_eq!(back.state_dtype(), StateDtype::Int8);
    back.save(&be, m.tower(), &second).unwrap();
    let (a, b) = (
        std::fs::read(&first).unwrap(),
        std::fs::read(&second).unwrap(),
    );
    assert!(a == b, "the 8-bit tower moments changed on a round trip");
    let text = String::from_utf8_lossy(&a[..a.len().min(4096)]).into_owned();
    assert!(
        text.contains("\"U8\"") && text.contains("\"int8\""),
        "{text}"
    );
}

/// A rollout group (the same prompt and image n times) runs the tower once and shares its
/// rows; each sample's greedy continuation still equals transformers'.
#[test]
fn repeated_prompts_share_the_tower_and_match() {
    use ares_model::model::{GenerateRequest, Sampling};
    use safetensors::SafeTensors;
    let (ck, bytes) = vl::load("qwen2_5_vl_tiny");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let cs = vl::case(&st, "two_images");
    let (_, want) = common::u32s(&st, "two_images.greedy");
    let m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
    let request = GenerateRequest {
        prompts: vec![cs.ids.clone(); 3],
        max_new_tokens: want.len(),
        eos_ids: vec![293, 291],
        sampling: Sampling::Greedy,
        seed: 0,
    };
    let visions = vec![cs.vision.clone(); 3];
    let out = m
        .generator()
        .unwrap()
        .generate(&request, &visions, |_, _| {})
        .unwrap();
    assert_eq!(out.tokens, vec![want; 3]);

    // a mixed rollout batch, sampled: repeats of two image prompts and of a text prompt
    // share their prefill; the outputs equal a run without any sharing (each sequence on
    // its own stream)
    let one = vl::case(&st, "image");
    let text = vl::case(&st, "text");
    let order = [0usize, 0, 2, 2, 0, 1, 1, 2];
    let cases = [&cs, &one, &text];
    let request = GenerateRequest {
        prompts: order.iter().map(|&i| cases[i].ids.clone()).collect(),
        max_new_tokens: 10,
        eos_ids: vec![293, 291],
        sampling: Sampling::Sample {
            temperature: 1.2,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
        },
        seed: 5,
    };
    let visions: Vec<_> = order.iter().map(|&i| cases[i].vision.clone()).collect();
    let shared = m
        .generator()
        .unwrap()
        .generate(&request, &visions, |_, _| {})
        .unwrap();
    let alone = m
        .generator()
        .unwrap()
        .without_tower_sharing()
        .generate(&request, &visions, |_, _| {})
        .unwrap();
    assert_eq!(shared.tokens, alone.tokens);
    for (a, b) in shared
        .log_probs
        .iter()
        .flatten()
        .zip(alone.log_probs.iter().flatten())
    {
        assert!((a - b).abs() <= 1e-4, "{a} vs {b}");
    }
}

/// From the files a user has to the model's inputs, against transformers' processor: the
/// chat template renders image / video content items, the tokenizer, the image processor
/// on the PNG files, and the placeholder expansion give exactly the fixture's `input_ids`
/// and `pixel_values` (cases `image` and `two_images`).
#[test]
fn chat_template_processor_and_expansion_match_transformers() {
    use ares_model::hf::chat::{ChatTemplate, RenderOptions};
    use ares_model::hf::tokenizer::Tokenizer;
    use ares_model::vision::model::VisionBatch;
    use ares_model::vision::processor::{ProcessorConfig, process_image_file};
    use safetensors::SafeTensors;
    let root = dir("qwen2_vl_tiny").parent().unwrap().to_path_buf();
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("cases.json")).unwrap()).unwrap();
    for model in MODELS {
        let (ck, bytes) = vl::load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let chat = ChatTemplate::from_dir(&dir(model)).unwrap();
        let tokenizer = Tokenizer::from_dir(&dir(model)).unwrap();
        let processor = ProcessorConfig::from_model_dir(&dir(model)).unwrap();
        for c in ["image", "two_images"] {
            let case = &cases["cases"][c];
            let text = chat
                .render(
                    case["messages"].as_array().unwrap(),
                    &RenderOptions::generation(),
                )
                .unwrap();
            assert_eq!(
                text,
                case["prompt"].as_str().unwrap(),
                "{model} {c}: rendered prompt"
            );
            let images: Vec<_> = case["images"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| process_image_file(&root.join(p.as_str().unwrap()), &processor).unwrap())
                .collect();
            let vision = VisionBatch::from_processed(&images, &[], &[]);
            let ids = tokenizer.encode(&text, false).unwrap();
            let ids = ck
                .config
                .expand_prompt(&ids, &vision.image_grids, &vision.video_grids)
                .unwrap();
            let (_, want) = common::u32s(&st, &format!("{c}.input_ids"));
            assert_eq!(ids, want, "{model} {c}: input ids");
            let want = common::f32s(&st, &format!("{c}.pixel_values"));
            assert_eq!(vision.image_pixels, want, "{model} {c}: pixel values");
        }
    }
}

/// Multi-turn conversations continued over kept blocks equal generating after the whole
/// conversation with its images (`common::vl`).
#[test]
fn vision_turns_continued_over_kept_blocks_equal_the_whole_conversation() {
    vl::continued_turns_equal_the_whole_conversation(|| CpuBackend);
}

/// `tower_arena_bytes` (what the trainer's memory plan counts) is what an arena holds, for
/// both families (LayerNorm and QuickGELU; RMSNorm and SwiGLU), each kind of arena:
/// inference, training, training checkpointed.
#[test]
fn tower_arena_bytes_are_what_an_arena_holds() {
    use ares_model::vision::tower::{TowerActLayout, VisionPlan, tower_arena_bytes};
    use safetensors::SafeTensors;
    for model in MODELS {
        let (ck, bytes) = vl::load(model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut m = VlModel::from_checkpoint(CpuBackend, &ck).unwrap();
        for c in vl::CASES {
            let cs = vl::case(&st, c);
            if cs.vision.is_empty() {
                continue;
            }
            let mut grids = cs.vision.image_grids.clone();
            grids.extend(&cs.vision.video_grids);
            let cfg = &ck.config.vision;
            let plan = VisionPlan::new(cfg, &grids).unwrap();
            for (keep, checkpointed) in [(false, false), (true, false), (true, true)] {
                m.tower_mut().set_gradient_checkpointing(checkpointed);
                let acts = m
                    .tower()
                    .activations(&CpuBackend, plan.clone(), keep)
                    .unwrap();
                assert_eq!(
                    tower_arena_bytes(cfg, plan.patches, keep, checkpointed, TowerActLayout::F32),
                    acts.bytes() as u64,
                    "{model} {c}: keep {keep}, checkpointed {checkpointed}"
                );
            }
        }
    }
}
