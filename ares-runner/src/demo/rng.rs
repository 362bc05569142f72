//! Seeded randomness of the demo: ChaCha20 streams (portable, the same numbers on every
//! platform and crate version) and the few draws the demo needs, written out here so that
//! no distribution code of another crate can change the generated data.

use rand_chacha::ChaCha20Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

/// Independent streams of one seed, one per use, so that e.g. changing the number of SFT
/// examples never changes the problems or the model's initial weights.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stream {
    /// Choosing the problems of a split.
    Problems = 1,
    /// Drawing SFT examples.
    Sft = 2,
    /// Initialising the model's weights.
    Init = 3,
}

/// The ChaCha20 stream `stream` keyed by `seed` (its 8 little-endian bytes, rest zero).
pub(crate) fn seeded(seed: u64, stream: Stream) -> ChaCha20Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    let mut rng = ChaCha20Rng::from_seed(key);
    rng.set_stream(stream as u64);
    rng
}

/// A uniform integer in `0..n` (unbiased: draws above the largest multiple of `n` are
/// redrawn). `n = 0` returns 0.
pub(crate) fn below<R: Rng + ?Sized>(rng: &mut R, n: usize) -> usize {
    let n = n as u64;
    if n <= 1 {
        return 0;
    }
    // Reject the top `2^64 mod n` values so that every residue is equally likely.
    let accept_max = u64::MAX - (u64::MAX % n + 1) % n;
    loop {
        let x = rng.next_u64();
        if x <= accept_max {
            return (x % n) as usize;
        }
    }
}

/// A uniform draw in `(0, 1]` from the top 53 bits of one output (never 0, so its log is
/// finite).
pub(crate) fn unit_open0<R: Rng + ?Sized>(rng: &mut R) -> f64 {
    ((rng.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A standard normal draw (Box–Muller, one of the pair: simple and exact enough for
/// weight initialisation).
pub(crate) fn normal<R: Rng + ?Sized>(rng: &mut R) -> f64 {
    let u1 = unit_open0(rng);
    let u2 = unit_open0(rng);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Shuffles `items` in place (Fisher–Yates).
pub(crate) fn shuffle<T, R: Rng + ?Sized>(rng: &mut R, items: &mut [T]) {
    for i in (1..items.len()).rev() {
        let j = below(rng, i + 1);
        items.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_deterministic_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| seeded(7, Stream::Sft).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(
            seeded(7, Stream::Sft).next_u64(),
            seeded(7, Stream::Init).next_u64()
        );
        assert_ne!(
            seeded(7, Stream::Sft).next_u64(),
            seeded(8, Stream::Sft).next_u64()
        );
    }

    #[test]
    fn below_is_in_range_and_covers_it() {
        let mut rng = seeded(1, Stream::Problems);
        let mut seen = [0usize; 5];
        for _ in 0..5000 {
            seen[below(&mut rng, 5)] += 1;
        }
        // Each residue ~1000; a biased or broken draw would miss this by far.
        assert!(seen.iter().all(|&c| (850..1150).contains(&c)), "{seen:?}");
        assert_eq!(below(&mut rng, 0), 0);
        assert_eq!(below(&mut rng, 1), 0);
    }

    #[test]
    fn normal_has_unit_moments() {
        let mut rng = seeded(3, Stream::Init);
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|_| normal(&mut rng)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        // Standard errors: mean 0.007, variance 0.01.
        assert!(mean.abs() < 0.03, "{mean}");
        assert!((var - 1.0).abs() < 0.05, "{var}");
        assert!(xs.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut rng = seeded(5, Stream::Problems);
        let mut v: Vec<usize> = (0..50).collect();
        shuffle(&mut rng, &mut v);
        assert_ne!(v, (0..50).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..50).collect::<Vec<_>>());
    }
}
