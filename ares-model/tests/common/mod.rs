//! Helpers shared by the integration tests that read the transformers fixtures. Each test
//! crate uses some of them.
#![allow(dead_code)]

pub mod lora_vl;
pub mod vl;

use std::path::{Path, PathBuf};

use ares_model::model::{GradDtype, Inputs};
use safetensors::{Dtype, SafeTensors};

/// The directory of fixture model `name` (`tests/fixtures/models/<name>`).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// An i64 tensor of a fixture file as u32 values, with its shape.
pub fn u32s(st: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<u32>) {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::I64, "{name}");
    let values = t
        .data()
        .chunks_exact(8)
        .map(|b| u32::try_from(i64::from_le_bytes(b.try_into().unwrap())).unwrap())
        .collect();
    (t.shape().to_vec(), values)
}

/// An f32 tensor of a fixture file.
pub fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// `max |a − b| / max |b|`.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).abs())
        .fold(0.0, f64::max);
    let scale = b.iter().map(|&y| f64::from(y).abs()).fold(0.0, f64::max);
    diff / scale.max(1e-30)
}

/// One input set of a fixture with next-token targets and per-token ∂L/∂logπ.
pub struct Batch {
    pub batch: usize,
    pub seq: usize,
    pub input_ids: Vec<u32>,
    pub attention_mask: Vec<u32>,
    pub position_ids: Vec<u32>,
    pub targets: Vec<u32>,
    pub coeffs: Vec<f32>,
}

impl Batch {
    pub fn inputs(&self) -> Inputs<'_> {
        Inputs {
            batch: self.batch,
            seq: self.seq,
            input_ids: &self.input_ids,
            attention_mask: &self.attention_mask,
            position_ids: &self.position_ids,
        }
    }

    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }
}

/// The fixture's input set `set` (`right` or `left` padded) with next-token targets and
/// coefficients of both signs at valid positions that have a next valid token (0
/// elsewhere, so some chunks of a few rows have none and are skipped).
pub fn batch(name: &str, set: &str) -> Batch {
    let bytes = std::fs::read(fixture(name).join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (shape, input_ids) = u32s(&st, &format!("{set}.input_ids"));
    let (_, attention_mask) = u32s(&st, &format!("{set}.attention_mask"));
    let (_, position_ids) = u32s(&st, &format!("{set}.position_ids"));
    let (batch, seq) = (shape[0], shape[1]);
    let mut targets = vec![0u32; batch * seq];
    let mut coeffs = vec![0.0f32; batch * seq];
    for b in 0..batch {
        for t in 0..seq - 1 {
            let (i, next) = (b * seq + t, b * seq + t + 1);
            if attention_mask[i] == 1 && attention_mask[next] == 1 {
                targets[i] = input_ids[next];
                coeffs[i] = [-0.4, 0.25, -1.1, 0.6][(i * 7) % 4];
            }
        }
    }
    Batch {
        batch,
        seq,
        input_ids,
        attention_mask,
        position_ids,
        targets,
        coeffs,
    }
}

/// A Qwen3 checkpoint (explicit `head_dim`) with heads of `head_dim` features: its
/// attention weights redrawn at that width (a fixed LCG, ±0.2, q/k norms 1), room for 256
/// positions, everything else as loaded.
pub fn with_head_dim(
    mut ck: ares_model::hf::checkpoint::Checkpoint,
    head_dim: usize,
) -> ares_model::hf::checkpoint::Checkpoint {
    use ares_model::hf::weights::Tensor;
    ck.config.head_dim = head_dim;
    ck.config.max_position_embeddings = ck.config.max_position_embeddings.max(256);
    let (hidden, hq, hkv) = (
        ck.config.hidden_size,
        ck.config.num_attention_heads,
        ck.config.num_key_value_heads,
    );
    let mut state = 777u64;
    let mut draw = |shape: &[usize]| {
        let data = (0..shape.iter().product::<usize>())
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
            })
            .collect();
        Tensor {
            shape: shape.to_vec(),
            data,
        }
    };
    for l in &mut ck.weights.layers {
        l.q_proj = draw(&[hq * head_dim, hidden]);
        l.k_proj = draw(&[hkv * head_dim, hidden]);
        l.v_proj = draw(&[hkv * head_dim, hidden]);
        l.o_proj = draw(&[hidden, hq * head_dim]);
        // biases where the architecture has them (Qwen2's q, k, v)
        if l.q_proj_bias.is_some() {
            l.q_proj_bias = Some(draw(&[hq * head_dim]));
        }
        for (bias, heads) in [(&mut l.k_proj_bias, hkv), (&mut l.v_proj_bias, hkv)] {
            if bias.is_some() {
                *bias = Some(draw(&[heads * head_dim]));
            }
        }
        // Qwen3's q/k norms over the new head size
        if l.q_norm.is_some() {
            l.q_norm = Some(Tensor {
                shape: vec![head_dim],
                data: vec![1.0; head_dim],
            });
            l.k_norm = l.q_norm.clone();
        }
    }
    ck
}

/// Runs `backward` (one backward pass into `grads`) with a layer watcher
/// ([`Grads::watch_layers`]) and checks what it was told: every layer once, last to
/// first, each with its gradients as they are once the whole pass has ended (so nothing
/// after the layer wrote them), laid out as [`Grads::layer_ranges`] says; and that the
/// layers' ranges and the whole buffers cover every gradient once. Gradients stored in
/// bf16 are handed over as bf16 views and read widened; returns how many views were.
///
/// [`Grads::watch_layers`]: ares_model::model::Grads::watch_layers
/// [`Grads::layer_ranges`]: ares_model::model::Grads::layer_ranges
pub fn check_layer_watch(
    be: &ares_model::backend::cpu::CpuBackend,
    layers: usize,
    grads: &mut ares_model::model::Grads<ares_model::backend::cpu::CpuBackend>,
    backward: impl FnOnce(&mut ares_model::model::Grads<ares_model::backend::cpu::CpuBackend>),
) -> usize {
    use ares_model::backend::Stored;
    use std::sync::{Arc, Mutex};
    type Seen = Arc<Mutex<Vec<(usize, Vec<f32>, usize)>>>;
    let seen: Seen = Arc::default();
    let log = Arc::clone(&seen);
    grads.watch_layers(Some(Box::new(move |be, layer, views| {
        let mut values = Vec::new();
        for v in views {
            let mut part = vec![0.0f32; v.len()];
            v.download(be, &mut part).unwrap();
            values.extend(part);
        }
        let halves = views
            .iter()
            .filter(|v| matches!(v, Stored::Bf16(_)))
            .count();
        log.lock().unwrap().push((layer, values, halves));
    })));
    backward(grads);
    grads.watch_layers(None);
    let seen = seen.lock().unwrap();
    let order: Vec<usize> = seen.iter().map(|s| s.0).collect();
    assert_eq!(order, (0..layers).rev().collect::<Vec<_>>());
    let lens = grads.lens();
    let mut covered = vec![0usize; lens.len()];
    for (layer, values, _) in seen.iter() {
        let mut now = Vec::new();
        for (b, offset, len) in grads.layer_ranges(*layer) {
            let mut part = vec![0.0f32; len];
            grads.read_values(be, b, offset, &mut part).unwrap();
            now.extend(part);
            covered[b] += len;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(values.iter().any(|&x| x != 0.0), "layer {layer}: all zero");
        assert_eq!(bits(values), bits(&now), "layer {layer}");
    }
    // each buffer is stacked over the layers (covered whole) or a whole one (none)
    for (b, (&c, &len)) in covered.iter().zip(&lens).enumerate() {
        assert!(c == 0 || c == len, "buffer {b}: {c} of {len}");
    }
    assert!(grads.layer_ranges(layers).is_empty());
    seen.iter().map(|s| s.2).sum()
}

/// A Qwen2.5-VL tower at head size `head_dim` (two heads): two blocks, the second of full
/// attention, windows of 64 patches (112 px), SwiGLU 96, merged to 48.
#[allow(dead_code)] // not every test binary that includes `common` uses it
pub fn tower_at_head(head_dim: usize) -> ares_model::vision::config::VisionConfig {
    use ares_model::vision::config::{VisionConfig, VisionMlp, VlKind};
    VisionConfig {
        kind: VlKind::Qwen25Vl,
        depth: 2,
        hidden: 2 * head_dim,
        heads: 2,
        head_dim,
        intermediate: 96,
        mlp: VisionMlp::SwiGlu,
        out_hidden: 48,
        patch_size: 14,
        temporal_patch_size: 2,
        spatial_merge_size: 2,
        in_channels: 3,
        window_size: 112,
        fullatt_block_indexes: vec![1],
        tokens_per_second: 2.0,
        rope_theta: 10_000.0,
    }
}

/// A forward and backward pass of `tower` over `plan`'s patches with fixed pixel values and
/// output gradient: the output and every weight gradient, on the host.
pub fn tower_pass<B: ares_model::backend::Backend>(
    be: &B,
    tower: &ares_model::vision::tower::VisionTower<B>,
    plan: &ares_model::vision::tower::VisionPlan,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (out, grads) = tower_passes(be, tower, plan, GradDtype::F32, 1);
    (out, grads.into_iter().map(|(_, g)| g).collect())
}

/// `passes` passes of [`tower_pass`] accumulated into gradients stored as `dtype`: the
/// output, and every gradient (whether stored in bf16, its values widened), in trainable
/// order.
pub fn tower_passes<B: ares_model::backend::Backend>(
    be: &B,
    tower: &ares_model::vision::tower::VisionTower<B>,
    plan: &ares_model::vision::tower::VisionPlan,
    dtype: GradDtype,
    passes: usize,
) -> (Vec<f32>, Vec<(bool, Vec<f32>)>) {
    use ares_model::backend::{Stored, View, ViewMut};
    let cfg = tower.config();
    let pixels: Vec<f32> = (0..plan.patches * cfg.patch_dim())
        .map(|i| ((i * 7919 % 2000) as f32 / 1000.0) - 1.0)
        .collect();
    let dout: Vec<f32> = (0..plan.units * cfg.out_hidden)
        .map(|i| ((i * 104_729 % 2000) as f32 / 2000.0) - 0.5)
        .collect();
    let mut acts = tower.activations(be, plan.clone(), true).unwrap();
    let mut grads = tower.zero_grads_in(be, dtype).unwrap();
    assert_eq!(grads.dtype(), dtype);
    grads.set_rounding(7, 1);
    let mut d = be.alloc(dout.len()).unwrap();
    be.upload(&dout, ViewMut::whole(&mut d)).unwrap();
    for _ in 0..passes {
        tower.forward(be, &pixels, &mut acts).unwrap();
        tower
            .backward(be, &mut acts, View::whole(&d), &mut grads)
            .unwrap();
    }
    let mut out = vec![0.0f32; dout.len()];
    be.download(acts.output(), &mut out).unwrap();
    let g = grads
        .stored()
        .into_iter()
        .map(|s| {
            let mut h = vec![0.0f32; s.len()];
            s.download(be, &mut h).unwrap();
            (matches!(s, Stored::Bf16(_)), h)
        })
        .collect();
    (out, g)
}
