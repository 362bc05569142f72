//! Shared pieces of the ares benchmarks: realistic token-tensor shapes, deterministic
//! synthetic data, and the read-only baselines every benchmark is reported against.
//!
//! A baseline reads exactly the bytes the measured function reads and does the least
//! possible work with them (a sum), so `time(baseline) / time(function)` says how close the
//! function runs to what memory bandwidth allows on this machine.

pub mod fused_products;
pub mod model;
pub mod train_step;

/// Prompts per batch in the realistic size (512 prompts × 8 samples × 4096 tokens).
pub const PROMPTS: usize = 512;
/// Samples per prompt.
pub const N: usize = 8;
/// Padded response length.
pub const COLS: usize = 4096;
/// Rows of the realistic batch.
pub const ROWS: usize = PROMPTS * N;

/// A small deterministic generator (SplitMix64), so benches need no RNG dependency and
/// every run sees the same data.
pub struct SplitMix(u64);

impl SplitMix {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// `n` values uniform in [-0.5, 0.5) from a [`SplitMix`] seeded by `seed`.
pub fn centered_values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix::new(seed);
    (0..n).map(|_| rng.unit() - 0.5).collect()
}

/// A padded batch of responses: per-row lengths between `cols/4` and `cols`, mask 1 on
/// the response and 0 on padding, as rollouts produce them.
pub struct TokenBatch {
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// 0/1 mask, row-major.
    pub mask: Vec<f32>,
    /// Response length per row.
    pub lengths: Vec<usize>,
}

impl TokenBatch {
    /// A batch with random response lengths.
    pub fn new(rows: usize, cols: usize, seed: u64) -> Self {
        let mut rng = SplitMix::new(seed);
        let mut mask = vec![0.0f32; rows * cols];
        let mut lengths = Vec::with_capacity(rows);
        for row in mask.chunks_exact_mut(cols) {
            let len = cols / 4 + (rng.next_u64() as usize % (cols - cols / 4 + 1));
            row[..len].fill(1.0);
            lengths.push(len);
        }
        TokenBatch {
            rows,
            cols,
            mask,
            lengths,
        }
    }

    /// Values drawn uniformly from `[lo, hi)` for every position (padding included, as a
    /// GPU buffer would hold leftovers there).
    pub fn values(&self, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix::new(seed);
        (0..self.rows * self.cols)
            .map(|_| lo + (hi - lo) * rng.unit())
            .collect()
    }

    /// Bytes of one f32 token tensor.
    pub fn tensor_bytes(&self) -> u64 {
        (self.rows * self.cols * std::mem::size_of::<f32>()) as u64
    }
}

/// The read-only baseline: sums every input slice, in 16 independent lanes so the sum is
/// limited by loads, not by the latency of one add chain.
pub fn read_baseline(inputs: &[&[f32]]) -> f32 {
    let mut lanes = [0.0f32; 16];
    for x in inputs {
        let chunks = x.chunks_exact(16);
        let tail = chunks.remainder();
        for c in chunks {
            for (l, v) in lanes.iter_mut().zip(c) {
                *l += *v;
            }
        }
        for (l, v) in lanes.iter_mut().zip(tail) {
            *l += *v;
        }
    }
    lanes.iter().sum()
}

/// Parallel (rayon) read-only baseline over an f32 buffer: each worker sums a contiguous
/// part with [`read_baseline`]. Reads exactly the bytes a row-parallel kernel reads.
pub fn par_read_baseline_f32(x: &[f32], part: usize) -> f32 {
    use rayon::prelude::*;
    x.par_chunks(part.max(1)).map(|c| read_baseline(&[c])).sum()
}

/// Parallel read-only baseline over 16-bit elements (bf16/f16 bit patterns).
pub fn par_read_baseline_u16(x: &[u16], part: usize) -> u64 {
    use rayon::prelude::*;
    x.par_chunks(part.max(1))
        .map(|c| {
            let mut lanes = [0u32; 32];
            let chunks = c.chunks_exact(32);
            let tail: u64 = chunks.remainder().iter().map(|&v| u64::from(v)).sum();
            for ch in chunks {
                for (l, v) in lanes.iter_mut().zip(ch) {
                    *l = l.wrapping_add(u32::from(*v));
                }
            }
            lanes.iter().map(|&l| u64::from(l)).sum::<u64>() + tail
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_masks_are_prefixes_of_the_stated_length() {
        let b = TokenBatch::new(6, 64, 1);
        for (row, &len) in b.mask.chunks_exact(64).zip(&b.lengths) {
            assert!((16..=64).contains(&len));
            assert!(row[..len].iter().all(|&m| m == 1.0));
            assert!(row[len..].iter().all(|&m| m == 0.0));
        }
    }

    #[test]
    fn baseline_sums_everything() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let b = vec![1.0f32; 5];
        assert_eq!(read_baseline(&[&a, &b]), (36 * 37 / 2 + 5) as f32);
    }
}
