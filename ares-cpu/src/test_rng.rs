//! A tiny deterministic generator (an LCG) for the ops' tests: no dependency, same data on
//! every run and platform.

/// Linear congruential generator; the state is the seed.
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    /// Uniform in [-1, 1).
    pub(crate) fn sym(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        2.0 * ((self.0 >> 11) as f64 / (1u64 << 53) as f64) - 1.0
    }
    /// `n` values uniform in [-scale, scale), as f32.
    pub(crate) fn vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.sym() * scale) as f32).collect()
    }
}

/// `len` deterministic values uniform in [-1, 1) from an xorshift stream seeded by `seed`.
pub(crate) fn rand_vec(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}
