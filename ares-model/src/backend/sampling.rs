//! Picking a token from a row of logits, the host's way: greedy (the first largest logit)
//! and the sorted walk of sampling (candidates by decreasing logit, top-k, top-p, inverse
//! CDF at a uniform draw). Shared by generation on the host and the CPU backend's
//! [`Backend::greedy_tokens`](super::Backend::greedy_tokens) /
//! [`Backend::sample_tokens`](super::Backend::sample_tokens); the CUDA kernels
//! `argmax_rows` and `sample_rows` are their twins (`sample_rows` finds the same cuts by
//! bisection instead of sorting, [`pick_by_bisection`] here being its reference).

/// Errors unless `top_k` keeps a token (`None`: no limit; `Some(0)` keeps none), naming
/// `op` (both backends' [`Backend::sample_tokens`](super::Backend::sample_tokens)).
pub(crate) fn check_top_k(op: &'static str, top_k: Option<usize>) -> super::Result<()> {
    if top_k == Some(0) {
        return Err(super::BackendError::Op {
            op,
            source: "top_k = 0 keeps no token (None for no limit)".into(),
        });
    }
    Ok(())
}

/// Whether `row` holds NaN or +∞: then no token is picked, greedy or sampled.
fn has_nan_or_inf(row: &[f32]) -> bool {
    row.iter().any(|x| x.is_nan() || *x == f32::INFINITY)
}

/// The index of the largest logit of `row`, the lowest among equal maxima; `None` when a
/// logit is NaN or +∞ or every logit is −∞ (greedy decoding, host and CPU backend).
pub(crate) fn greedy_row(row: &[f32]) -> Option<u32> {
    ares_cpu::argmax(row).and_then(|i| u32::try_from(i).ok())
}

/// The sort key of logit `x` (not NaN) at index `i` (< 2³²): ascending keys are
/// descending logits, lower index first among equal logits (−0 and +0 are equal).
fn descending_key(x: f32, i: usize) -> u64 {
    let x = if x == 0.0 { 0.0 } else { x };
    let bits = x.to_bits();
    // flips the float order into the unsigned order of the bits
    let ascending = if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    (u64::from(!ascending) << 32) | i as u64
}

/// Sorts keys made by [`descending_key`] in index order: a stable LSD radix sort of the
/// logit half, 8 bits a pass (a full comparison sort of a 152 k vocabulary was 15 ms per
/// token; this is ~1 ms). Short rows use the standard sort.
fn radix_sort_by_logit(keys: &mut Vec<u64>) {
    if keys.len() < 2048 {
        keys.sort_unstable();
        return;
    }
    let mut spare = vec![0u64; keys.len()];
    for shift in [32, 40, 48, 56] {
        let digit = |k: u64| ((k >> shift) & 0xFF) as usize;
        let mut start = [0usize; 256];
        for &k in keys.iter() {
            start[digit(k)] += 1;
        }
        if start.contains(&keys.len()) {
            continue; // one digit value: this pass would not move anything
        }
        let mut sum = 0;
        for c in start.iter_mut() {
            (*c, sum) = (sum, sum + *c);
        }
        for &k in keys.iter() {
            let slot = &mut start[digit(k)];
            spare[*slot] = k;
            *slot += 1;
        }
        std::mem::swap(keys, &mut spare);
    }
}

/// The candidates of a sampled token: ids of logits above −∞ by decreasing logit, lower
/// id first among equal logits, only the `top_k` first when given. With a top-k only the
/// k first are selected and sorted.
fn candidate_order(logits: &[f32], top_k: Option<usize>) -> Vec<usize> {
    let mut keys: Vec<u64> = logits
        .iter()
        .enumerate()
        .filter(|(_, x)| **x > f32::NEG_INFINITY)
        .map(|(i, &x)| descending_key(x, i))
        .collect();
    match top_k {
        Some(k) if k < keys.len() => {
            keys.select_nth_unstable(k.saturating_sub(1));
            keys.truncate(k);
            keys.sort_unstable();
        }
        _ => radix_sort_by_logit(&mut keys),
    }
    keys.iter().map(|k| (k & 0xFFFF_FFFF) as usize).collect()
}

/// The token the sorted walk picks for the uniform draw `u` ∈ [0, 1): candidates (logits
/// above −∞) by decreasing logit, lower id first among equal logits; the `top_k` first
/// (all without one); their weights `e^{(x − max)/T}` in f64; the shortest prefix holding
/// at least `top_p` of the mass; then the first candidate whose cumulative weight exceeds
/// `u ·` the prefix's weight (the prefix's last when rounding leaves none). `None` for a
/// NaN or +∞ logit, or every logit −∞.
pub(crate) fn sample_row(
    logits: &[f32],
    temperature: f32,
    top_k: Option<usize>,
    top_p: f32,
    u: f64,
) -> Option<u32> {
    if has_nan_or_inf(logits) {
        return None;
    }
    if top_k.is_none() && top_p >= 1.0 && logits.len() >= FULL_ROW_MIN {
        return sample_full_row(logits, temperature, u);
    }
    let t = f64::from(temperature);
    let order = candidate_order(logits, top_k);
    let max = f64::from(*logits.get(*order.first()?)?);
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| {
            logits
                .get(i)
                .map_or(0.0, |&x| ((f64::from(x) - max) / t).exp())
        })
        .collect();
    let total: f64 = weights.iter().sum();
    // Nucleus: the shortest prefix holding at least top_p of the mass.
    let mut kept = weights.len();
    let mut cum = 0.0;
    for (j, w) in weights.iter().enumerate() {
        cum += w;
        if cum >= f64::from(top_p) * total {
            kept = j + 1;
            break;
        }
    }
    let weights = weights.get(..kept)?;
    let target = u * weights.iter().sum::<f64>();
    let mut cum = 0.0;
    let mut chosen = *order.get(kept - 1)?;
    for (&i, w) in order.iter().zip(weights) {
        cum += w;
        if cum > target {
            chosen = i;
            break;
        }
    }
    u32::try_from(chosen).ok()
}

/// Rows at least this long sample the whole distribution with [`sample_full_row`].
const FULL_ROW_MIN: usize = 1024;

/// [`sample_row`] without top-k or top-p, without sorting the row: the weights are summed
/// into 256 buckets of logit value (bucket `⌊(max − x)·255/(max − min)⌋`, so the buckets
/// follow the candidate order and equal logits share one), the draw's bucket is found from
/// the bucket sums, and only that bucket's candidates are sorted and walked. The same
/// token as the sorted walk up to the order of the f64 sums (a draw within ~1e-16 of a
/// boundary between two tokens can land on the other one, as with the CUDA kernel);
/// O(vocab) instead of a sort of the vocabulary per token. `logits` holds no NaN or +∞.
fn sample_full_row(logits: &[f32], temperature: f32, u: f64) -> Option<u32> {
    const BUCKETS: usize = 256;
    let valid = |x: f32| x > f32::NEG_INFINITY;
    let (mut max, mut min) = (f32::NEG_INFINITY, f32::INFINITY);
    for &x in logits.iter().filter(|&&x| valid(x)) {
        max = max.max(x);
        min = min.min(x);
    }
    if !valid(max) {
        return None;
    }
    let (t, top) = (f64::from(temperature), f64::from(max));
    let span = top - f64::from(min);
    let scale = if span > 0.0 {
        (BUCKETS - 1) as f64 / span
    } else {
        0.0
    };
    // monotone in x, so bucket order is candidate order; the cast floors (the value is ≥ 0)
    let bucket = |x: f32| (((top - f64::from(x)) * scale) as usize).min(BUCKETS - 1);
    let weight = |x: f32| ((f64::from(x) - top) / t).exp();
    let mut sums = [0.0f64; BUCKETS];
    for &x in logits.iter().filter(|&&x| valid(x)) {
        sums[bucket(x)] += weight(x);
    }
    let target = u * sums.iter().sum::<f64>();
    let last = sums.iter().rposition(|&w| w > 0.0)?;
    let mut cum = 0.0;
    let b = (0..=last)
        .find(|&b| {
            let crossed = cum + sums[b] > target;
            if !crossed {
                cum += sums[b];
            }
            crossed
        })
        .unwrap_or(last);
    let mut keys: Vec<u64> = logits
        .iter()
        .enumerate()
        .filter(|&(_, &x)| valid(x) && bucket(x) == b)
        .map(|(i, &x)| descending_key(x, i))
        .collect();
    keys.sort_unstable();
    let mut chosen = None;
    for k in keys {
        let i = (k & 0xFFFF_FFFF) as usize;
        chosen = u32::try_from(i).ok();
        cum += logits.get(i).map_or(0.0, |&x| weight(x));
        if cum > target {
            break;
        }
    }
    chosen
}

/// A 64-bit LCG: enough to make test rows.
#[cfg(test)]
struct Rng(u64);

#[cfg(test)]
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 11
    }
    fn unit(&mut self) -> f64 {
        self.next() as f64 / (1u64 << 53) as f64
    }
}

/// The device sampler's algorithm (CUDA kernel `sample_rows`), on the host: the same
/// token as [`pick`] without sorting. Candidates are ordered by their [`descending_key`];
/// `F(K)` is the weight `e^{(x − max)/T}` (f64) of the candidates with key ≤ K, and each
/// cut the sorted walk of [`pick`] makes is the smallest key where a monotone condition
/// on `F` (or on a count) turns true, found by bisection over the 64-bit key space:
/// the top-k cut (count ≥ k), the top-p cut (`F ≥ top_p·F(top-k cut)`), the token
/// (`F > u·F(top-p cut)`). Equal to [`pick`] up to the order of the f64 sums: a draw
/// within ~1e-16 of a boundary between two tokens can land on the other one. Kept here as
/// the reference the kernel is written from, and tested against [`pick`].
#[cfg(test)]
fn pick_by_bisection(
    logits: &[f32],
    temperature: f32,
    top_k: Option<usize>,
    top_p: f32,
    u: f64,
) -> Option<u32> {
    if has_nan_or_inf(logits) {
        return None;
    }
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    if max == f32::NEG_INFINITY {
        return None;
    }
    let (max, t) = (f64::from(max), f64::from(temperature));
    let candidates = || {
        logits
            .iter()
            .enumerate()
            .filter(|(_, x)| **x > f32::NEG_INFINITY)
            .map(|(i, &x)| (descending_key(x, i), x))
    };
    let count = |k: u64| candidates().filter(|&(key, _)| key <= k).count();
    let weight = |k: u64| -> f64 {
        candidates()
            .filter(|&(key, _)| key <= k)
            .map(|(_, x)| ((f64::from(x) - max) / t).exp())
            .sum()
    };
    // the smallest key in [0, hi] where `cond` holds (it holds at hi)
    let smallest = |hi: u64, cond: &dyn Fn(u64) -> bool| {
        let (mut lo, mut hi) = (0u64, hi);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if cond(mid) { hi = mid } else { lo = mid + 1 }
        }
        hi
    };
    let k_cut = match top_k {
        Some(k) if k < count(u64::MAX) => smallest(u64::MAX, &|key| count(key) >= k),
        _ => u64::MAX,
    };
    let total = weight(k_cut);
    let p_cut = smallest(k_cut, &|key| weight(key) >= f64::from(top_p) * total);
    let target = u * weight(p_cut);
    let chosen = if weight(p_cut) > target {
        smallest(p_cut, &|key| weight(key) > target)
    } else {
        p_cut
    };
    Some((chosen & 0xFFFF_FFFF) as u32)
}

#[cfg(test)]
mod bisection_tests {
    use super::*;

    #[test]
    fn bisection_picks_the_tokens_of_the_sorted_walk() {
        let mut rng = Rng(21);
        let mut compared = 0;
        for trial in 0..1500 {
            let vocab = [1usize, 2, 3, 10, 64, 300][trial % 6];
            let row: Vec<f32> = (0..vocab)
                .map(|_| match rng.next() % 10 {
                    0 => f32::NEG_INFINITY,
                    1 => 1.5, // ties
                    2 => -0.0,
                    _ => (rng.unit() as f32 - 0.5) * 12.0,
                })
                .collect();
            let temperature = [1.0f32, 0.6, 1.7][trial % 3];
            let top_k = [None, Some(1), Some(2), Some(7)][trial % 4];
            let top_p = [1.0f32, 0.9, 0.5, 0.05][(trial % 4) ^ ((trial / 4) % 4)];
            let u = rng.unit();
            let want = sample_row(&row, temperature, top_k, top_p, u);
            let got = pick_by_bisection(&row, temperature, top_k, top_p, u);
            assert_eq!(
                got, want,
                "trial {trial}: row {row:?} T {temperature} top_k {top_k:?} top_p {top_p} u {u}"
            );
            compared += usize::from(want.is_some());
        }
        assert!(compared > 1300, "{compared}");
        // NaN, +∞ and all −∞ rows have no token
        assert_eq!(
            pick_by_bisection(&[0.0, f32::NAN], 1.0, None, 1.0, 0.5),
            None
        );
        assert_eq!(
            pick_by_bisection(&[f32::INFINITY], 1.0, None, 1.0, 0.5),
            None
        );
        assert_eq!(
            pick_by_bisection(&[f32::NEG_INFINITY; 3], 1.0, None, 1.0, 0.5),
            None
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The candidate order by comparison sort (the first implementation): decreasing
    /// logit, lower id first on ties, −∞ left out, truncated to `top_k`.
    fn reference_order(logits: &[f32], top_k: Option<usize>) -> Vec<usize> {
        let mut order: Vec<usize> = (0..logits.len())
            .filter(|&i| logits[i] > f32::NEG_INFINITY)
            .collect();
        order.sort_by(|&a, &b| {
            logits[b]
                .partial_cmp(&logits[a])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        if let Some(k) = top_k {
            order.truncate(k);
        }
        order
    }

    /// The bucketed walk of long full-distribution rows picks the sorted walk's token: rows
    /// with ties, −∞ and ±0, narrow and wide logit ranges, several temperatures.
    #[test]
    fn full_row_buckets_pick_the_sorted_walks_token() {
        let mut rng = Rng(77);
        for trial in 0..600 {
            let vocab = [1024usize, 1500, 4096][trial % 3];
            let spread = [0.01f32, 1.0, 12.0, 80.0][trial % 4];
            let row: Vec<f32> = (0..vocab)
                .map(|_| match rng.next() % 20 {
                    0 => f32::NEG_INFINITY,
                    1 => 0.5, // ties
                    2 => -0.0,
                    3 => 0.0,
                    _ => (rng.unit() as f32 - 0.5) * spread,
                })
                .collect();
            let temperature = [1.0f32, 0.6, 1.7][trial % 3];
            for _ in 0..4 {
                let u = rng.unit();
                let order = candidate_order(&row, None);
                let top = f64::from(row[order[0]]);
                let weights: Vec<f64> = order
                    .iter()
                    .map(|&i| ((f64::from(row[i]) - top) / f64::from(temperature)).exp())
                    .collect();
                let target = u * weights.iter().sum::<f64>();
                let mut cum = 0.0;
                let want = order
                    .iter()
                    .zip(&weights)
                    .find(|&(_, w)| {
                        cum += w;
                        cum > target
                    })
                    .map_or(order[order.len() - 1], |(&i, _)| i);
                let got = sample_row(&row, temperature, None, 1.0, u);
                assert_eq!(got, Some(want as u32), "trial {trial} u {u}");
            }
        }
        // a row of one value, and one valid logit among −∞
        assert_eq!(sample_full_row(&[2.0; 1024], 1.0, 0.999_9), Some(1023));
        let mut row = vec![f32::NEG_INFINITY; 1024];
        row[700] = -3.0;
        assert_eq!(sample_full_row(&row, 0.7, 0.5), Some(700));
        assert_eq!(sample_full_row(&[f32::NEG_INFINITY; 1024], 1.0, 0.5), None);
    }

    #[test]
    fn key_order_is_descending_logit_then_ascending_id() {
        let xs = [
            f32::MAX,
            3.5,
            1.0,
            f32::MIN_POSITIVE,
            0.0,
            -0.0,
            -f32::MIN_POSITIVE,
            -1.0,
            f32::MIN,
        ];
        for w in xs.windows(2) {
            let (a, b) = (descending_key(w[0], 7), descending_key(w[1], 3));
            if w[0] == w[1] {
                assert!(a > b, "{w:?}: equal logits, lower id first");
            } else {
                assert!(a < b, "{w:?}");
            }
        }
    }

    #[test]
    fn fast_order_equals_the_comparison_sort() {
        let mut rng = Rng(5);
        for trial in 0..400 {
            // long rows take the radix path, short ones the standard sort
            let vocab = [1usize, 2, 17, 2047, 2048, 5000, 151_936][trial % 7];
            let row: Vec<f32> = (0..vocab)
                .map(|_| match rng.next() % 12 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => f32::NEG_INFINITY,
                    3 => 1.5, // ties
                    4 => -1e30,
                    _ => (rng.unit() as f32 - 0.5) * 16.0,
                })
                .collect();
            for top_k in [None, Some(1), Some(3), Some(vocab), Some(vocab + 4)] {
                assert_eq!(
                    candidate_order(&row, top_k),
                    reference_order(&row, top_k),
                    "trial {trial}, V {vocab}, top_k {top_k:?}"
                );
            }
        }
    }
}
