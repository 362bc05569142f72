//! M-RoPE of Qwen2-VL / Qwen2.5-VL (`ares_model::vision::mrope`) against transformers 5.24.
//!
//! Fixture: `scripts/make_mrope_fixtures.py` (transformers 5.24, torch 2.15 CPU) runs the real
//! `Qwen2VLProcessor` / `Qwen2_5_VLProcessor` text side and the tiny random models'
//! `get_rope_index`, generation positions and rotary embedding, and writes
//! `tests/fixtures/mrope/mrope.json`. Integers (expanded ids, position ids, `rope_deltas`,
//! decode positions) must be equal; cos / sin within [`TRIG_TOL`].
//!
//! Every case but `video_rules_differ` is one where transformers 5.24's continuation after a
//! vision block (`start + max(h, w) / merge`) and the original Qwen rule this crate follows
//! (largest position + 1) agree. `video_rules_differ` checks, by hand-computed values, where
//! they part.

use std::path::Path;

use ares_model::vision::mrope::{
    MropeConfig, MropeError, MropeRope, TemporalScale, VisionGrids, VisionTokens, decode_position,
    expand_placeholders, rope_index,
};
use serde_json::Value;

/// Largest |Δ| allowed on cos / sin (both are computed with the same f32 angle and rounded
/// from f64 trig, so they are expected equal or within an ulp).
const TRIG_TOL: f32 = 1e-6;

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mrope/mrope.json");
    let text =
        std::fs::read_to_string(&path).expect("mrope fixture (scripts/make_mrope_fixtures.py)");
    serde_json::from_str(&text).expect("valid JSON")
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("unsigned integer"))
        .collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    u64s(v).into_iter().map(|x| x as u32).collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn grids(v: &Value) -> Vec<[usize; 3]> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|g| {
            let g = u64s(g);
            [g[0] as usize, g[1] as usize, g[2] as usize]
        })
        .collect()
}

/// `[3, batch, seq]` nested arrays, flattened.
fn flat3(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("axes")
        .iter()
        .flat_map(|axis| axis.as_array().expect("rows").iter().flat_map(u32s))
        .collect()
}

struct Case {
    name: String,
    v: Value,
    config: MropeConfig,
    images: Vec<[usize; 3]>,
    videos: Vec<[usize; 3]>,
    spg: Option<Vec<f64>>,
    input_ids: Vec<u32>,
    mask: Vec<u32>,
    batch: usize,
    seq: usize,
}

impl Case {
    fn new(name: &str, v: &Value) -> Self {
        let temporal = match v["family"].as_str().expect("family") {
            "qwen2_vl" => TemporalScale::Index,
            "qwen2_5_vl" => TemporalScale::PerSecond {
                tokens_per_second: v["tokens_per_second"].as_f64().expect("tokens_per_second"),
            },
            f => panic!("unknown family {f}"),
        };
        let config = MropeConfig {
            tokens: VisionTokens {
                image_pad: v["image_pad_id"].as_u64().unwrap() as u32,
                video_pad: v["video_pad_id"].as_u64().unwrap() as u32,
            },
            spatial_merge_size: v["spatial_merge_size"].as_u64().unwrap() as usize,
            temporal,
        };
        let rows = v["input_ids"].as_array().unwrap();
        let batch = rows.len();
        let seq = rows[0].as_array().unwrap().len();
        let spg = v["second_per_grid_ts"]
            .as_array()
            .map(|a| a.iter().map(|x| x.as_f64().unwrap()).collect());
        Case {
            name: name.to_string(),
            config,
            images: grids(&v["image_grid_thw"]),
            videos: grids(&v["video_grid_thw"]),
            spg,
            input_ids: rows.iter().flat_map(u32s).collect(),
            mask: v["attention_mask"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(u32s)
                .collect(),
            batch,
            seq,
            v: v.clone(),
        }
    }

    fn grids(&self) -> VisionGrids<'_> {
        VisionGrids {
            images: &self.images,
            videos: &self.videos,
            second_per_grid_ts: self.spg.as_deref(),
        }
    }

    fn valid_len(&self, row: usize) -> usize {
        self.mask[row * self.seq..(row + 1) * self.seq]
            .iter()
            .filter(|&&m| m == 1)
            .count()
    }
}

fn cases() -> Vec<Case> {
    let f = fixture();
    f["cases"]
        .as_object()
        .expect("cases")
        .iter()
        .map(|(name, v)| Case::new(name, v))
        .collect()
}

#[test]
fn fixture_has_every_kind_of_case() {
    let f = fixture();
    assert_eq!(f["transformers"].as_str().unwrap(), "5.24.0");
    let names: Vec<String> = cases().into_iter().map(|c| c.name).collect();
    for want in [
        "text_only",
        "one_image",
        "two_images",
        "one_video",
        "image_video",
        "left_padding",
        "video_rules_differ",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "case {want} missing: {names:?}"
        );
    }
}

/// The processor's text side: each prompt's pads expanded with that prompt's grids (taken in
/// order across the batch) equal transformers' `input_ids` (valid tokens).
#[test]
fn expansion_equals_the_processor() {
    for c in cases() {
        let (mut next_image, mut next_video) = (0, 0);
        for (row, prompt) in c.v["prompt_ids"].as_array().unwrap().iter().enumerate() {
            let prompt = u32s(prompt);
            let n_img = prompt
                .iter()
                .filter(|&&t| t == c.config.tokens.image_pad)
                .count();
            let n_vid = prompt
                .iter()
                .filter(|&&t| t == c.config.tokens.video_pad)
                .count();
            let expanded = expand_placeholders(
                &prompt,
                c.config.tokens,
                &c.images[next_image..next_image + n_img],
                &c.videos[next_video..next_video + n_vid],
                c.config.spatial_merge_size,
            )
            .unwrap_or_else(|e| panic!("{}: {e}", c.name));
            next_image += n_img;
            next_video += n_vid;
            let want: Vec<u32> = (0..c.seq)
                .filter(|&i| c.mask[row * c.seq + i] == 1)
                .map(|i| c.input_ids[row * c.seq + i])
                .collect();
            assert_eq!(expanded, want, "{} row {row}", c.name);
        }
        assert_eq!(
            (next_image, next_video),
            (c.images.len(), c.videos.len()),
            "{}",
            c.name
        );
    }
}

/// Position ids, rope deltas and decode positions equal transformers' where the rules agree.
#[test]
fn positions_equal_transformers() {
    let mut checked = 0;
    for c in cases()
        .into_iter()
        .filter(|c| c.name != "video_rules_differ")
    {
        let p = rope_index(&c.config, &c.input_ids, c.batch, Some(&c.mask), &c.grids())
            .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        assert_eq!(
            p.position_ids,
            flat3(&c.v["position_ids"]),
            "{} position_ids",
            c.name
        );
        let deltas: Vec<i64> = c.v["rope_deltas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_i64().unwrap())
            .collect();
        assert_eq!(p.rope_deltas, deltas, "{} rope_deltas", c.name);
        let dec = c.v["decode_position_ids"].as_array().unwrap();
        for row in 0..c.batch {
            for axis in dec {
                let want = u32s(&axis[row]);
                let got: Vec<u32> = (0..want.len())
                    .map(|k| decode_position(c.valid_len(row), k, p.rope_deltas[row]).unwrap())
                    .collect();
                assert_eq!(got, want, "{} decode row {row}", c.name);
            }
        }
        checked += 1;
    }
    assert!(checked >= 8);
}

/// cos / sin of our positions, in the `[tokens, head_dim/2]` layout of `Backend::rope`, equal
/// the rotary embedding's (both halves of transformers' `head_dim` vectors).
#[test]
fn cos_sin_equal_transformers() {
    let mut worst = 0.0f32;
    for c in cases()
        .into_iter()
        .filter(|c| c.name != "video_rules_differ")
    {
        let head_dim = c.v["head_dim"].as_u64().unwrap() as usize;
        let section: Vec<usize> = u64s(&c.v["mrope_section"])
            .into_iter()
            .map(|s| s as usize)
            .collect();
        let rope = MropeRope::new(
            head_dim,
            c.v["rope_theta"].as_f64().unwrap(),
            [section[0], section[1], section[2]],
        )
        .unwrap();
        let p = rope_index(&c.config, &c.input_ids, c.batch, Some(&c.mask), &c.grids()).unwrap();
        let half = head_dim / 2;
        let n = c.batch * c.seq;
        let (mut cos, mut sin) = (vec![0.0; n * half], vec![0.0; n * half]);
        rope.cos_sin(&p.position_ids, &mut cos, &mut sin).unwrap();
        let row = c.v["cos_sin_row"].as_u64().unwrap() as usize;
        let tokens = u64s(&c.v["cos_sin_tokens"]);
        for (k, &tok) in tokens.iter().enumerate() {
            let t = row * c.seq + tok as usize;
            for (ours, theirs) in [(&cos, &c.v["cos"][k]), (&sin, &c.v["sin"][k])] {
                let theirs = f32s(theirs);
                assert_eq!(theirs.len(), head_dim);
                for j in 0..head_dim {
                    let d = (ours[t * half + j % half] - theirs[j]).abs();
                    worst = worst.max(d);
                    assert!(d <= TRIG_TOL, "{} token {tok} dim {j}: Δ {d}", c.name);
                }
            }
        }
    }
    eprintln!("cos/sin: max |Δ| = {worst:e}");
}

/// Large positions that differ per axis (f32 angle rounding, every section boundary).
#[test]
fn cos_sin_at_large_positions() {
    let f = fixture();
    for (family, v) in f["big_positions"].as_object().unwrap() {
        let head_dim = v["head_dim"].as_u64().unwrap() as usize;
        let s: Vec<usize> = u64s(&v["mrope_section"])
            .into_iter()
            .map(|s| s as usize)
            .collect();
        let rope = MropeRope::new(
            head_dim,
            v["rope_theta"].as_f64().unwrap(),
            [s[0], s[1], s[2]],
        )
        .unwrap();
        let pos: Vec<u32> = v["position_ids"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(u32s)
            .collect();
        let n = pos.len() / 3;
        let half = head_dim / 2;
        let (mut cos, mut sin) = (vec![0.0; n * half], vec![0.0; n * half]);
        rope.cos_sin(&pos, &mut cos, &mut sin).unwrap();
        let mut worst = 0.0f32;
        for (ours, theirs) in [(&cos, &v["cos"]), (&sin, &v["sin"])] {
            for (t, row) in theirs.as_array().unwrap().iter().enumerate() {
                let row = f32s(row);
                for j in 0..head_dim {
                    let d = (ours[t * half + j % half] - row[j]).abs();
                    worst = worst.max(d);
                    assert!(d <= TRIG_TOL, "{family} token {t} dim {j}: Δ {d}");
                }
            }
        }
        eprintln!("{family} large positions: max |Δ| = {worst:e}");
    }
}

/// A 12-frame 56×56 video at 2 fps in Qwen2.5-VL: grid [6, 4, 4], merged 2×2, temporal step
/// `tokens_per_second · second_per_grid_ts` = 2 · 1.0, so θ = 0, 2, …, 10. The prompt is
/// `v <|vision_start|> [24 pads] <|vision_end|> after` (33 tokens): text 0..=2, the block
/// starts at 3. Here the text after it continues at 3 + 10 + 1 = 14 (largest position + 1,
/// the original Qwen rule); transformers 5.24 continues at 3 + max(2, 2) = 5. Everything up to
/// the end of the block is equal.
#[test]
fn video_rules_differ_as_documented() {
    let c = cases()
        .into_iter()
        .find(|c| c.name == "video_rules_differ")
        .unwrap();
    assert_eq!(c.videos, [[6, 4, 4]]);
    assert_eq!(c.seq, 33);
    let p = rope_index(&c.config, &c.input_ids, 1, Some(&c.mask), &c.grids()).unwrap();
    let theirs = flat3(&c.v["position_ids"]);
    let block = 3..27;
    // Hand-computed: text before, the block, text after.
    for a in 0..3 {
        assert_eq!(&p.axis(a)[..3], [0, 1, 2]);
        assert_eq!(&p.axis(a)[27..], [14, 15, 16, 17, 18, 19], "axis {a}");
        assert_eq!(
            &theirs[a * 33 + 27..(a + 1) * 33],
            [5, 6, 7, 8, 9, 10],
            "axis {a}"
        );
    }
    for (k, i) in block.clone().enumerate() {
        let (tau, r, col) = (k / 4, (k / 2) % 2, k % 2);
        assert_eq!(p.axis(0)[i], 3 + 2 * tau as u32);
        assert_eq!(p.axis(1)[i], 3 + r as u32);
        assert_eq!(p.axis(2)[i], 3 + col as u32);
    }
    for a in 0..3 {
        assert_eq!(
            &p.axis(a)[..27],
            &theirs[a * 33..a * 33 + 27],
            "axis {a} up to the block's end"
        );
    }
    // Ours: 19 + 1 − 33; transformers: max(13, 10) + 1 − 33.
    assert_eq!(p.rope_deltas, [-13]);
    assert_eq!(c.v["rope_deltas"][0].as_i64(), Some(-19));
    assert_eq!(decode_position(33, 0, -13).unwrap(), 20);
}

/// Bad input with the fixture's real prompts: too many or too few grids name the counts.
#[test]
fn placeholder_count_errors() {
    let c = cases()
        .into_iter()
        .find(|c| c.name == "two_images")
        .unwrap();
    let prompt = u32s(&c.v["prompt_ids"][0]);
    let m = c.config.spatial_merge_size;
    let e = expand_placeholders(&prompt, c.config.tokens, &c.images[..1], &[], m).unwrap_err();
    assert_eq!(
        e,
        MropeError::PlaceholderCount {
            kind: "image",
            token: "<|image_pad|>",
            found: 2,
            grids: 1
        }
    );
    let three = [c.images[0], c.images[1], c.images[0]];
    let e = expand_placeholders(&prompt, c.config.tokens, &three, &[], m).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("2 <|image_pad|> placeholder(s) in the prompt but 3 image grid(s)"),
        "{e}"
    );
    // Position ids of the expanded batch with a grid missing or one too many.
    let few = VisionGrids {
        images: &c.images[..1],
        ..Default::default()
    };
    let e = rope_index(&c.config, &c.input_ids, 1, None, &few).unwrap_err();
    assert!(
        matches!(
            e,
            MropeError::MissingGrid {
                kind: "image",
                block: 1,
                grids: 1,
                ..
            }
        ),
        "{e}"
    );
    let many = VisionGrids {
        images: &three,
        ..Default::default()
    };
    let e = rope_index(&c.config, &c.input_ids, 1, None, &many).unwrap_err();
    assert_eq!(
        e,
        MropeError::UnusedGrids {
            kind: "image",
            grids: 3,
            blocks: 2
        }
    );
}
