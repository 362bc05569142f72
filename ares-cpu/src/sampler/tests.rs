use super::*;
use crate::test_rng::Rng;

/// Random123's known-answer vectors for Philox4x32-10 (the last one from randomgen 2.5.1's
/// `Philox(number=4, width=32)`).
#[test]
fn philox_known_answers() {
    let cases: [([u32; 4], [u32; 2], [u32; 4]); 4] = [
        (
            [0; 4],
            [0; 2],
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
        ),
        (
            [u32::MAX; 4],
            [u32::MAX; 2],
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
        ),
        (
            [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
            [0xa409_3822, 0x299f_31d0],
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
        ),
        (
            [7, 3, 5, 0],
            [0x1234_5678, 0x9abc_def0],
            [0x6d77_88aa, 0xa05f_c848, 0xab0a_966d, 0x2422_45dd],
        ),
    ];
    for (counter, key, want) in cases {
        assert_eq!(philox4x32_10(counter, key), want, "{counter:x?} {key:x?}");
    }
    // the key's words: seed lo/hi; the counter's: quad, step, sequence lo/hi
    let key = SampleKey {
        seed: 0x9abc_def0_1234_5678,
        sequence: 5,
        step: 3,
    };
    assert_eq!(random_bits(key, 7), cases[3].2);
}

fn ulps(got: f32, want: f64) -> f64 {
    let w = want as f32;
    let ulp = f64::from(f32::from_bits(w.abs().to_bits() + 1)) - f64::from(w.abs());
    (f64::from(got) - want).abs() / ulp
}

#[test]
fn ln_and_log1p_are_within_two_ulp() {
    let mut worst = 0.0f64;
    let mut x = 1.0f32 / 8_589_934_592.0;
    while x < 20.0 {
        worst = worst.max(ulps(ln(x), f64::from(x).ln()));
        x *= 1.000_37;
    }
    for &x in &[
        1.0f32,
        2.0,
        0.5,
        core::f32::consts::SQRT_2,
        1.414_213_7,
        1.0 - 1e-7,
    ] {
        worst = worst.max(ulps(ln(x), f64::from(x).ln()));
    }
    assert!(worst <= 2.0, "ln: worst {worst} ulp");
    assert_eq!(ln(1.0), 0.0);
    let mut worst = 0.0f64;
    let mut y = -BELOW_ONE;
    while y < -1e-12 {
        worst = worst.max(ulps(log1p(y), f64::from(y).ln_1p()));
        y *= 0.999_3;
    }
    assert!(worst <= 3.0, "log1p: worst {worst} ulp");
    assert_eq!(log1p(-1e-30), -1e-30);
    assert_eq!(log1p(0.0), 0.0);
}

#[test]
fn gumbel_draws_are_bounded_and_gumbel_distributed() {
    for bits in [0, 1, 2, 255, 1 << 31, u32::MAX - 1, u32::MAX] {
        let g = gumbel(bits);
        assert!((GUMBEL_MIN..=GUMBEL_MAX).contains(&g), "{bits}: {g}");
    }
    assert!(gumbel(0) > 22.8 && gumbel(u32::MAX) < -2.8);
    // each top byte's bound holds for its bits: the bucket's edges and a stride through it
    let bounds = gumbel_bounds();
    for k in 0..256u32 {
        for low in (0..1u32 << 24).step_by(4099).chain([1, (1 << 24) - 1]) {
            let bits = (k << 24) | low;
            assert!(gumbel(bits) <= bounds[k as usize], "{bits}");
        }
    }
    // monotone: more bits, a larger V, a larger E, a smaller g
    let mut last = f32::INFINITY;
    for k in 0..=4096u64 {
        let g = gumbel((k * (u64::from(u32::MAX) / 4096)) as u32);
        assert!(g <= last, "{k}");
        last = g;
    }
    // mean γ = 0.5772, variance π²/6 over 2²⁰ draws of a Philox stream
    let n = 1 << 20;
    let (mut sum, mut sq) = (0.0f64, 0.0f64);
    for q in 0..n / 4 {
        for b in random_bits(SampleKey::default(), q) {
            let g = f64::from(gumbel(b));
            sum += g;
            sq += g * g;
        }
    }
    let mean = sum / f64::from(n);
    let var = sq / f64::from(n) - mean * mean;
    assert!((mean - 0.577_215_7).abs() < 0.006, "mean {mean}");
    assert!((var - 1.644_934).abs() < 0.02, "variance {var}");
}

#[test]
fn radix_select_is_the_sorted_cut() {
    let mut rng = Rng(3);
    for trial in 0..300 {
        let n = [1usize, 2, 7, 300, 2000][trial % 5];
        let items: Vec<(u64, u64)> = (0..n)
            .map(|i| {
                let hi = ((rng.sym() + 1.0) * 1e3) as u64 % [3, 50, 4_000_000][trial % 3];
                let w = if trial % 2 == 0 {
                    1
                } else {
                    ((rng.sym() + 1.0) * 1e9) as u64
                };
                ((hi << 32) | i as u64, w)
            })
            .collect();
        let mut sorted = items.clone();
        sorted.sort_unstable();
        let total: u64 = items.iter().map(|p| p.1).sum();
        for need in [1, (total / 3).max(1), total / 2 + 1, total, total + 1] {
            let mut cum = 0;
            let want = sorted.iter().find(|p| {
                cum += p.1;
                cum >= need
            });
            let each = |f: &mut dyn FnMut(u64, u64)| {
                for &(k, w) in items.iter().rev() {
                    f(k, w);
                }
            };
            assert_eq!(
                radix_select(each, need),
                want.map(|p| p.0),
                "trial {trial} need {need}"
            );
        }
    }
}

/// The definition, step by step: candidates sorted by key, the filters' cuts by
/// cumulative count and fixed-point mass, then every candidate's score drawn.
fn reference(row: &[f32], s: &Sampler, key: SampleKey) -> Option<u32> {
    if row.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
        return None;
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let inv_t = 1.0 / s.temperature;
    let mut order: Vec<(u64, u32)> = (0..row.len() as u32)
        .filter(|&i| row[i as usize] > f32::NEG_INFINITY)
        .map(|i| (descending_key(row[i as usize], i), i))
        .collect();
    order.sort_unstable();
    if s.top_k != 0 {
        order.truncate(s.top_k as usize);
    }
    if s.top_p < 1.0 {
        let w = |i: u32| fixed_weight(relative_weight(row[i as usize], max, inv_t));
        let total: u64 = order.iter().map(|&(_, i)| w(i)).sum();
        let need = (f64::from(s.top_p) * total as f64).ceil() as u64;
        let mut cum = 0;
        let kept = order.iter().position(|&(_, i)| {
            cum += w(i);
            cum >= need
        });
        order.truncate(kept.map_or(order.len(), |k| k + 1));
    }
    if s.min_p > 0.0 {
        order.retain(|&(_, i)| relative_weight(row[i as usize], max, inv_t) >= s.min_p);
    }
    let score =
        |i: u32| row[i as usize] * inv_t + gumbel(random_bits(key, i / 4)[(i % 4) as usize]);
    let mut ids: Vec<u32> = order.iter().map(|p| p.1).collect();
    ids.sort_unstable();
    let mut best: Option<(f32, u32)> = None;
    for i in ids {
        if best.is_none_or(|(b, _)| score(i) > b) {
            best = Some((score(i), i));
        }
    }
    best.map(|b| b.1)
}

fn random_row(rng: &mut Rng, vocab: usize, spread: f64) -> Vec<f32> {
    (0..vocab)
        .map(|_| {
            let r = rng.sym();
            match ((r + 1.0) * 1e6) as u64 % 16 {
                0 => f32::NEG_INFINITY,
                1 => 1.5, // ties
                2 => -0.0,
                3 => 0.0,
                _ => (rng.sym() * spread) as f32,
            }
        })
        .collect()
}

/// Skipping tokens that cannot win, the radix cuts and the quad-at-a-time draws change
/// nothing: the same token as the definition, on rows with ties, ±0, −∞ and wide ranges.
#[test]
fn sample_row_is_the_definition() {
    let mut rng = Rng(11);
    let mut sampled = 0;
    for trial in 0..3000 {
        let vocab = [1usize, 2, 5, 17, 64, 300, 1500][trial % 7];
        let spread = [0.5, 4.0, 30.0, 300.0][trial % 4];
        let row = random_row(&mut rng, vocab, spread);
        let s = Sampler {
            temperature: [1.0, 0.6, 1.7, 0.05][trial % 4],
            top_k: [0, 1, 2, 7][(trial / 4) % 4],
            top_p: [1.0, 0.9, 0.5, 0.05][(trial / 16) % 4],
            min_p: [0.0, 0.0, 0.1, 0.9][(trial / 64) % 4],
        };
        let key = SampleKey {
            seed: trial as u64,
            sequence: (trial % 5) as u64,
            step: (trial % 11) as u32,
        };
        let want = reference(&row, &s, key);
        assert_eq!(
            sample_row(&row, &s, key),
            want,
            "trial {trial}: {s:?} {row:?}"
        );
        sampled += usize::from(want.is_some());
    }
    assert!(sampled > 2700, "{sampled}");
    let s = Sampler::with_temperature(1.0);
    assert_eq!(sample_row(&[0.0, f32::NAN], &s, SampleKey::default()), None);
    assert_eq!(sample_row(&[f32::INFINITY], &s, SampleKey::default()), None);
    assert_eq!(
        sample_row(&[f32::NEG_INFINITY; 3], &s, SampleKey::default()),
        None
    );
    assert_eq!(sample_row(&[], &s, SampleKey::default()), None);
    let mut row = vec![f32::NEG_INFINITY; 9];
    row[6] = -3.0;
    assert_eq!(sample_row(&row, &s, SampleKey::default()), Some(6));
}

/// Pearson's χ² of `counts` against probabilities `p` (cells of probability 0 must be
/// empty), and its degrees of freedom.
fn chi_square(counts: &[u64], p: &[f64]) -> (f64, usize) {
    let n: u64 = counts.iter().sum();
    let mut chi = 0.0;
    let mut cells = 0;
    for (&c, &q) in counts.iter().zip(p) {
        if q == 0.0 {
            assert_eq!(c, 0, "a token of probability 0 was drawn");
            continue;
        }
        let e = q * n as f64;
        chi += (c as f64 - e).powi(2) / e;
        cells += 1;
    }
    (chi, cells - 1)
}

/// Draws `n` tokens (a step each) and tests them against `p` with χ²: the bound is the
/// 1 − 10⁻⁹ quantile's Wilson–Hilferty approximation, so a right sampler fails with
/// probability ~10⁻⁹ (the seeds are fixed: the outcome is too).
fn assert_draws(row: &[f32], s: &Sampler, p: &[f64], what: &str) {
    let n = 200_000u32;
    let mut counts = vec![0u64; row.len()];
    for step in 0..n {
        let key = SampleKey {
            seed: 42,
            sequence: 3,
            step,
        };
        counts[sample_row(row, s, key).expect("a token") as usize] += 1;
    }
    let (chi, df) = chi_square(&counts, p);
    let d = df as f64;
    let z = 6.0; // ~1e-9 upper tail
    let bound = d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3);
    assert!(
        chi < bound.max(40.0),
        "{what}: chi² {chi} over {df} df (bound {bound}); {counts:?}"
    );
}

fn softmax(row: &[f32], t: f64, keep: impl Fn(usize) -> bool) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = (0..row.len())
        .map(|i| {
            if keep(i) {
                ((f64::from(row[i]) - m) / t).exp()
            } else {
                0.0
            }
        })
        .collect();
    let s: f64 = w.iter().sum();
    w.iter().map(|x| x / s).collect()
}

#[test]
fn draws_follow_the_filtered_softmax() {
    // probabilities far from every cut, so the f64 definition keeps the same tokens
    let row = [
        2.0f32,
        1.3,
        0.9,
        0.4,
        0.0,
        -0.5,
        -1.2,
        -2.0,
        f32::NEG_INFINITY,
        -4.0,
    ];
    for t in [1.0f32, 0.7, 1.6] {
        let s = Sampler::with_temperature(t);
        assert_draws(
            &row,
            &s,
            &softmax(&row, f64::from(t), |_| true),
            &format!("T {t}"),
        );
    }
    let top_k = Sampler {
        top_k: 3,
        ..Sampler::with_temperature(1.0)
    };
    assert_draws(&row, &top_k, &softmax(&row, 1.0, |i| i < 3), "top-k 3");
    // T = 1: the first two hold 0.65 of the mass, the first three 0.79
    let top_p = Sampler {
        top_p: 0.7,
        ..Sampler::with_temperature(1.0)
    };
    let full = softmax(&row, 1.0, |_| true);
    assert!(full[..2].iter().sum::<f64>() < 0.69 && full[..3].iter().sum::<f64>() > 0.71);
    assert_draws(&row, &top_p, &softmax(&row, 1.0, |i| i < 3), "top-p 0.7");
    // min-p 0.2: e^{x − 2} ≥ 0.2 ⇔ x ≥ 0.39
    let min_p = Sampler {
        min_p: 0.2,
        ..Sampler::with_temperature(1.0)
    };
    assert_draws(&row, &min_p, &softmax(&row, 1.0, |i| i < 4), "min-p 0.2");
    // all three, at T = 0.5: top-k 5, then top-p 0.95 of those (first two: 0.88, three:
    // 0.958), then min-p 0.05 (x ≥ 2 + 0.5·ln 0.05 = 0.50, the same three)
    let all = Sampler {
        temperature: 0.5,
        top_k: 5,
        top_p: 0.95,
        min_p: 0.05,
    };
    let p5 = softmax(&row, 0.5, |i| i < 5);
    assert!(p5[..2].iter().sum::<f64>() < 0.945 && p5[..3].iter().sum::<f64>() > 0.955);
    assert_draws(
        &row,
        &all,
        &softmax(&row, 0.5, |i| i < 3),
        "top-k, top-p, min-p",
    );
    // a long row at T = 1: 1000 tokens, the cells pooled by tens
    let mut rng = Rng(8);
    let long: Vec<f32> = (0..1000).map(|_| (rng.sym() * 3.0) as f32).collect();
    let s = Sampler::with_temperature(1.0);
    let p = softmax(&long, 1.0, |_| true);
    let n = 100_000u32;
    let (mut counts, mut pooled) = (vec![0u64; 100], vec![0f64; 100]);
    for step in 0..n {
        let key = SampleKey {
            seed: 9,
            sequence: 0,
            step,
        };
        counts[sample_row(&long, &s, key).unwrap() as usize / 10] += 1;
    }
    for (i, q) in p.iter().enumerate() {
        pooled[i / 10] += q;
    }
    let (chi, df) = chi_square(&counts, &pooled);
    assert!(chi < 190.0, "long row: chi² {chi} over {df} df");
}

/// A sequence's tokens are its key's: the same alone and in a batch of any order, and
/// different streams differ.
#[test]
fn rows_depend_on_their_keys_only() {
    let mut rng = Rng(5);
    let (rows, vocab) = (6, 500);
    let logits = rng.vec(rows * vocab, 2.0);
    let s = Sampler::with_temperature(1.0);
    let keys: Vec<SampleKey> = (0..rows)
        .map(|r| SampleKey {
            seed: 7,
            sequence: r as u64,
            step: 0,
        })
        .collect();
    let mut out = vec![0; rows];
    sample_rows(&logits, vocab, &s, &keys, &mut out).unwrap();
    for r in 0..rows {
        let alone = sample_row(&logits[r * vocab..(r + 1) * vocab], &s, keys[r]);
        assert_eq!(Some(out[r]), alone, "row {r}");
    }
    // one row's logits under 64 keys: many different tokens
    let row = &logits[..vocab];
    let mut seen: Vec<u32> = (0..64)
        .map(|q| {
            sample_row(
                row,
                &s,
                SampleKey {
                    seed: 7,
                    sequence: q,
                    step: 0,
                },
            )
            .unwrap()
        })
        .collect();
    seen.sort_unstable();
    seen.dedup();
    assert!(seen.len() > 20, "{}", seen.len());
}

#[test]
fn bad_inputs_are_named() {
    let s = Sampler::with_temperature(1.0);
    let key = [SampleKey::default()];
    let mut out = [0u32];
    let err = |r: crate::Result<()>| r.unwrap_err().to_string();
    assert!(err(sample_rows(&[0.0; 4], 0, &s, &key, &mut out)).contains("vocab"));
    assert!(err(sample_rows(&[0.0; 3], 4, &s, &key, &mut out)).contains("logits"));
    assert!(err(sample_rows(&[0.0; 4], 4, &s, &[], &mut out)).contains("keys"));
    for (bad, name) in [
        (
            Sampler {
                temperature: 0.0,
                ..s
            },
            "temperature",
        ),
        (
            Sampler {
                temperature: f32::NAN,
                ..s
            },
            "temperature",
        ),
        (Sampler { top_p: 0.0, ..s }, "top_p"),
        (Sampler { top_p: 1.5, ..s }, "top_p"),
        (Sampler { min_p: -0.1, ..s }, "min_p"),
        (
            Sampler {
                min_p: f32::NAN,
                ..s
            },
            "min_p",
        ),
    ] {
        assert!(
            err(sample_rows(&[0.0; 4], 4, &bad, &key, &mut out)).contains(name),
            "{name}"
        );
    }
    // a row with no token is u32::MAX, the others are drawn
    let mut two = [0u32; 2];
    let keys = [SampleKey::default(); 2];
    sample_rows(&[0.0, f32::NAN, 1.0, 2.0], 2, &s, &keys, &mut two).unwrap();
    assert_eq!(two[0], u32::MAX);
    assert!(two[1] < 2);
}
