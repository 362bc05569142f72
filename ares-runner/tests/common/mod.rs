//! Helpers shared by the integration tests that read the transformers fixtures. Each test
//! crate uses some of them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

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
