//! An advantage estimators' test batch, shared by `emulated.rs` and `gpu.rs`.

use crate::loss_reference::Rng;

/// A batch of `rows` responses of up to `cols` tokens in groups keyed by uid (sizes 2–5,
/// rows shuffled), with holes in the masks, groups of equal rewards and a weighted KL.
pub struct Case {
    pub cols: usize,
    pub rewards: Vec<f32>,
    pub uids: Vec<u64>,
    pub mask: Vec<f32>,
    pub kl: Vec<f32>,
}

impl Case {
    pub fn new(rng: &mut Rng, groups: usize, cols: usize) -> Self {
        let mut uids = Vec::new();
        let mut rewards = Vec::new();
        for g in 0..groups {
            let n = 2 + (rng.unit() * 4.0) as usize;
            let flat = g % 4 == 1;
            let binary = g % 4 == 2;
            for _ in 0..n {
                uids.push(g as u64 * 7919);
                rewards.push(if flat {
                    0.5
                } else if binary {
                    f32::from(rng.unit() < 0.5)
                } else {
                    rng.range(-2.0, 3.0)
                });
            }
        }
        // shuffle the rows (Fisher–Yates), so groups are not contiguous
        for i in (1..uids.len()).rev() {
            let j = (rng.unit() * (i + 1) as f32) as usize % (i + 1);
            uids.swap(i, j);
            rewards.swap(i, j);
        }
        let rows = uids.len();
        let mut mask = vec![0.0f32; rows * cols];
        for r in 0..rows {
            let len = 1 + (rng.unit() * cols as f32) as usize % cols;
            for t in 0..len {
                mask[r * cols + t] = f32::from(rng.unit() > 0.1 || t + 1 == len);
            }
        }
        let kl = (0..rows * cols).map(|_| rng.range(-0.02, 0.05)).collect();
        Case {
            cols,
            rewards,
            uids,
            mask,
            kl,
        }
    }

    pub fn rows(&self) -> usize {
        self.rewards.len()
    }
}
