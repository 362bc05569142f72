//! Helpers shared by the integration tests that read the transformers fixtures. Each test
//! crate uses some of them.
#![allow(dead_code)]

pub mod lora_vl;
pub mod vl;

use std::path::{Path, PathBuf};

use ares_model::model::Inputs;
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
