use super::*;
use half::{bf16, f16};

/// Naive two-pass f64 reference: max, then lse and Σ p·z.
fn reference(row: &[f64], temperature: f64, target: usize) -> (f64, f64) {
    let z: Vec<f64> = row.iter().map(|x| x / temperature).collect();
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = z.iter().map(|v| (v - m).exp()).sum();
    let lse = m + sum.ln();
    let mean_z: f64 = z
        .iter()
        .filter(|v| v.is_finite())
        .map(|v| (v - lse).exp() * v)
        .sum();
    (z[target] - lse, lse - mean_z)
}

struct Rng(u64);
impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn close(got: f32, want: f64, what: &str) {
    let tol = 2e-5 * want.abs().max(1.0);
    assert!(
        (f64::from(got) - want).abs() <= tol,
        "{what}: got {got}, want {want}"
    );
}

fn check_rows(rows: &[Vec<f64>], temperature: f64) {
    let vocab = rows[0].len();
    let flat: Vec<f32> = rows.iter().flatten().map(|&x| x as f32).collect();
    let ids: Vec<u32> = (0..rows.len())
        .map(|r| ((r * 7919) % vocab) as u32)
        .collect();
    let mut lp = vec![f32::NAN; rows.len()];
    let mut h = vec![f32::NAN; rows.len()];
    log_prob_entropy(
        Logits::F32(&flat),
        vocab,
        temperature as f32,
        Some((&ids, &mut lp)),
        &mut h,
    )
    .unwrap();
    for (r, row) in rows.iter().enumerate() {
        // the reference sees exactly the f32 values the kernel sees
        let row32: Vec<f64> = row.iter().map(|&x| f64::from(x as f32)).collect();
        let (want_lp, want_h) = reference(&row32, f64::from(temperature as f32), ids[r] as usize);
        close(lp[r], want_lp, &format!("log_prob row {r} V {vocab}"));
        close(h[r], want_h, &format!("entropy row {r} V {vocab}"));
    }
}

#[test]
fn spec_vector_14() {
    let h = LogProbEntropy::of_row(&[1.0f32, 2.0, 3.0], 1.0, Some(2)).unwrap();
    assert!((h.entropy - 0.832_395_6).abs() < 1e-6, "{h:?}");
    // log softmax(1,2,3)[2] = 3 − ln(e + e² + e³) = −0.4076059644
    assert!((h.log_prob.unwrap() + 0.407_605_96).abs() < 1e-6);
    let h = LogProbEntropy::of_row(&[0.0f32, 0.0], 1.0, None).unwrap();
    assert!((h.entropy - core::f32::consts::LN_2).abs() < 1e-7);
}

#[test]
fn random_rows_match_two_pass_f64_reference() {
    let mut rng = Rng(7);
    for vocab in [1usize, 2, 3, 15, 16, 17, 255, 256, 257, 1000, 4099] {
        for scale in [0.1, 3.0, 30.0] {
            let rows: Vec<Vec<f64>> = (0..5)
                .map(|_| (0..vocab).map(|_| (rng.unit() - 0.5) * scale).collect())
                .collect();
            check_rows(&rows, 1.0);
            check_rows(&rows, 0.7);
        }
    }
}

#[test]
fn qwen_vocabulary_size() {
    let mut rng = Rng(11);
    let vocab = 151_936;
    let rows: Vec<Vec<f64>> = (0..3)
        .map(|_| (0..vocab).map(|_| (rng.unit() - 0.5) * 20.0).collect())
        .collect();
    check_rows(&rows, 1.0);
}

#[test]
fn extreme_logits() {
    let vocab = 1000;
    // ±1e4: the max dominates completely
    let mut big: Vec<f64> = (0..vocab)
        .map(|i| if i % 2 == 0 { 1e4 } else { -1e4 })
        .collect();
    big[3] = 1e4 - 1.0;
    // one-hot-like: one logit far above a flat floor
    let mut one_hot = vec![-1e4; vocab];
    one_hot[517] = 0.0;
    // increasing max across blocks exercises the rescaling
    let rising: Vec<f64> = (0..vocab).map(|i| i as f64 * 0.05).collect();
    let falling: Vec<f64> = (0..vocab).map(|i| -(i as f64) * 0.05).collect();
    check_rows(&[big, one_hot, rising, falling], 1.0);
}

#[test]
fn negative_infinity_entries_have_zero_probability() {
    let mut row = vec![f32::NEG_INFINITY; 600];
    row[10] = 1.0;
    row[300] = 2.0;
    row[599] = 3.0;
    let got = LogProbEntropy::of_row(&row, 1.0, Some(300)).unwrap();
    let want = LogProbEntropy::of_row(&[1.0f32, 2.0, 3.0], 1.0, Some(1)).unwrap();
    assert!((got.entropy - want.entropy).abs() < 1e-6);
    assert!((got.log_prob.unwrap() - want.log_prob.unwrap()).abs() < 1e-6);
    // a single finite entry: probability 1, entropy 0
    let mut single = vec![f32::NEG_INFINITY; 300];
    single[299] = -5.0;
    let got = LogProbEntropy::of_row(&single, 1.0, Some(299)).unwrap();
    assert_eq!((got.entropy, got.log_prob), (0.0, Some(0.0)));
}

#[test]
fn vocabulary_of_one() {
    let got = LogProbEntropy::of_row(&[42.0f32], 0.5, Some(0)).unwrap();
    assert_eq!((got.entropy, got.log_prob), (0.0, Some(0.0)));
}

#[test]
fn bf16_and_f16_match_f32_on_the_same_values() {
    let mut rng = Rng(3);
    let vocab = 3000;
    let vals: Vec<f32> = (0..2 * vocab)
        .map(|_| ((rng.unit() - 0.5) * 16.0) as f32)
        .collect();
    let as_bf16: Vec<bf16> = vals.iter().map(|&x| bf16::from_f32(x)).collect();
    let as_f16: Vec<f16> = vals.iter().map(|&x| f16::from_f32(x)).collect();
    let ids = [5u32, 2999];
    for (name, logits, widened) in [
        (
            "bf16",
            Logits::Bf16(&as_bf16),
            as_bf16.iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
        ),
        (
            "f16",
            Logits::F16(&as_f16),
            as_f16.iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
        ),
    ] {
        let (mut lp, mut h) = ([0.0f32; 2], [0.0f32; 2]);
        log_prob_entropy(logits, vocab, 1.0, Some((&ids, &mut lp)), &mut h).unwrap();
        let (mut lp32, mut h32) = ([0.0f32; 2], [0.0f32; 2]);
        log_prob_entropy(
            Logits::F32(&widened),
            vocab,
            1.0,
            Some((&ids, &mut lp32)),
            &mut h32,
        )
        .unwrap();
        assert_eq!(
            (lp, h),
            (lp32, h32),
            "{name} must equal f32 on the widened values"
        );
    }
}

#[test]
fn bad_input_is_an_error_naming_it() {
    let mut h = [0.0f32; 2];
    let logits = [0.0f32, 1.0, 2.0, 3.0];
    assert_eq!(
        log_prob_entropy(Logits::F32(&logits[..3]), 2, 1.0, None, &mut h),
        Err(CoreError::LengthMismatch {
            what: "logits",
            expected: 4,
            actual: 3
        }
        .into())
    );
    assert!(matches!(
        log_prob_entropy(Logits::F32(&logits), 0, 1.0, None, &mut h),
        Err(Error::Core(CoreError::OutOfRange { what: "vocab", .. }))
    ));
    for t in [0.0, -1.0, f32::NAN, f32::INFINITY, 1e-45] {
        assert!(matches!(
            log_prob_entropy(Logits::F32(&logits), 2, t, None, &mut h),
            Err(Error::Core(CoreError::OutOfRange {
                what: "temperature",
                ..
            }))
        ));
    }
    let mut lp = [0.0f32; 2];
    assert_eq!(
        log_prob_entropy(
            Logits::F32(&logits),
            2,
            1.0,
            Some((&[0, 2], &mut lp)),
            &mut h
        ),
        Err(Error::TargetOutOfRange {
            row: 1,
            id: 2,
            vocab: 2
        })
    );
    assert!(matches!(
        log_prob_entropy(Logits::F32(&logits), 2, 1.0, Some((&[0], &mut lp)), &mut h),
        Err(Error::Core(CoreError::LengthMismatch {
            what: "targets",
            ..
        }))
    ));
    for bad in [f32::NAN, f32::INFINITY] {
        let row = [0.0f32, 1.0, 2.0, bad];
        assert_eq!(
            log_prob_entropy(Logits::F32(&row), 2, 1.0, None, &mut h),
            Err(Error::BadLogitsRow { row: 1 })
        );
    }
    let all_neg_inf = [0.0f32, 1.0, f32::NEG_INFINITY, f32::NEG_INFINITY];
    assert_eq!(
        log_prob_entropy(Logits::F32(&all_neg_inf), 2, 1.0, None, &mut h),
        Err(Error::BadLogitsRow { row: 1 })
    );
    let impossible = [0.0f32, f32::NEG_INFINITY];
    assert_eq!(
        LogProbEntropy::of_row(&impossible, 1.0, Some(1)),
        Err(Error::ImpossibleTarget { row: 0, id: 1 })
    );
    assert!(LogProbEntropy::of_row::<f32>(&[], 1.0, None).is_err());
}

#[test]
fn no_rows_is_fine() {
    let mut h: [f32; 0] = [];
    assert!(log_prob_entropy(Logits::F32(&[]), 10, 1.0, None, &mut h).is_ok());
}

/// The AVX-512 kernel against the portable one it rewrites: the same bits on every row,
/// or the same rejection.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_kernel_equals_the_portable_kernel_bit_for_bit() {
    if !crate::Isa::Avx512.supported() {
        eprintln!("skipped: this CPU has no AVX-512F");
        return;
    }
    fn same<L: Logit>(row: &[L], inv_t: f32, what: &str) {
        // SAFETY: AVX-512F was detected above.
        let fast = unsafe { super::avx512::row_stats(row, inv_t) };
        let slow = row_stats_portable::<L, true>(row, inv_t);
        let bits = |s: Option<RowStats>| {
            s.map(|s| (s.max2.to_bits(), s.ln_sum.to_bits(), s.entropy.to_bits()))
        };
        assert_eq!(bits(fast), bits(slow), "{what}");
    }
    let mut rng = Rng(23);
    let mut rows: Vec<(String, Vec<f32>)> = Vec::new();
    for vocab in [
        1usize, 2, 15, 16, 17, 63, 64, 65, 1023, 1024, 1025, 3000, 151_936,
    ] {
        for spread in [0.1, 20.0, 300.0] {
            let row = (0..vocab)
                .map(|_| ((rng.unit() - 0.5) * spread) as f32)
                .collect();
            rows.push((format!("V {vocab} spread {spread}"), row));
        }
    }
    // the max rising block after block (rescaling), −∞ runs, underflow, extremes
    rows.push((
        "rising".into(),
        (0..5000).map(|i| i as f32 * 0.01).collect(),
    ));
    let mut holes: Vec<f32> = (0..2100).map(|i| (i % 7) as f32).collect();
    holes[..1500].fill(f32::NEG_INFINITY);
    holes[2099] = f32::NEG_INFINITY;
    rows.push(("leading -inf blocks".into(), holes));
    rows.push((
        "underflow".into(),
        (0..2000).map(|i| -(i as f32) * 0.07).collect(),
    ));
    rows.push((
        "±1e4".into(),
        (0..1500)
            .map(|i| if i % 3 == 0 { 1e4 } else { -1e4 })
            .collect(),
    ));
    let mut bad = vec![0.5f32; 1100];
    bad[1050] = f32::NAN;
    rows.push(("NaN in the last block".into(), bad.clone()));
    bad[1050] = f32::INFINITY;
    rows.push(("+inf".into(), bad.clone()));
    let mut nan_first = vec![f32::NEG_INFINITY; 1100];
    nan_first[7] = f32::NAN;
    nan_first[1090] = 1.0;
    rows.push(("NaN in an all -inf block".into(), nan_first));
    rows.push(("all -inf".into(), vec![f32::NEG_INFINITY; 40]));
    rows.push(("overflowing product".into(), vec![3e38f32, 1.0, 2.0]));
    for (what, row) in &rows {
        for inv_t in [1.0f32, 1.0 / 0.7, 4.0] {
            same(row, inv_t, &format!("f32 {what} 1/T {inv_t}"));
            let b: Vec<bf16> = row.iter().map(|&x| bf16::from_f32(x)).collect();
            same(&b, inv_t, &format!("bf16 {what} 1/T {inv_t}"));
            let h: Vec<f16> = row.iter().map(|&x| f16::from_f32(x)).collect();
            same(&h, inv_t, &format!("f16 {what} 1/T {inv_t}"));
        }
    }
}
