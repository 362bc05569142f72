//! The CPU backend's ARES token ops against ares-core computed on the host over the whole
//! batch: the masked dynamic KL (every estimator, with and without HWE weighting, views at
//! offsets) and `copy`. The HWE windows are checked the same way at the trainer level
//! (`ares-runner`'s `trainer::hwe` tests); the CUDA twins against these in `cuda_backend.rs`.

use ares_core::Shape;
use ares_core::kl::{KlCoefficient, KlEstimator, TokenKlConfig, TokenKlOutputs, token_kl};
use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::{Backend, KlSumViews, KlViews, View, ViewMut};

/// Deterministic uniform values in [0, 1) (an LCG: enough for test data).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// `host` placed after `pad` junk elements.
fn padded(host: &[f32], pad: usize) -> Vec<f32> {
    let mut v = vec![f32::NAN; pad];
    v.extend_from_slice(host);
    v
}

#[test]
fn masked_dynamic_kl_equals_core_on_random_batches() {
    let mut rng = Lcg(7);
    for case in 0..30usize {
        let (rows, cols, pad) = (1 + case % 6, 1 + (case * 7) % 19, case % 3);
        let n = rows * cols;
        let logp: Vec<f32> = (0..n).map(|_| -3.0 * rng.next()).collect();
        let ref_logp: Vec<f32> = (0..n).map(|_| -3.0 * rng.next()).collect();
        let mut mask = vec![0.0f32; n];
        for r in 0..rows {
            let len = (rng.next() * (cols + 1) as f32) as usize;
            mask[r * cols..r * cols + len.min(cols)].fill(1.0);
        }
        let hwe: Vec<f32> = (0..n).map(|_| f32::from(rng.next() < 0.3)).collect();
        let beta: Vec<f32> = (0..rows).map(|_| 0.05 * rng.next()).collect();
        let estimator = [
            KlEstimator::K1,
            KlEstimator::Abs,
            KlEstimator::K2,
            KlEstimator::K3,
            KlEstimator::K1Plus,
            KlEstimator::K3Plus,
        ][case % 6];
        let with_hwe = case % 2 == 1;

        // host: ares-core over the whole batch
        let shape = Shape { rows, cols };
        let mut cfg = TokenKlConfig::new(estimator, KlCoefficient::PerRow(&beta));
        if with_hwe {
            cfg = cfg.with_hwe(&hwe, 0.5);
        }
        let (mut w, mut sums, mut means) =
            (vec![0.0f32; n], vec![0.0f32; rows], vec![0.0f32; rows]);
        token_kl(
            shape,
            &logp,
            &ref_logp,
            &mask,
            &cfg,
            TokenKlOutputs {
                weighted: Some(&mut w),
                row_weighted_sum: Some(&mut sums),
                row_mean_kl: Some(&mut means),
                ..TokenKlOutputs::default()
            },
        )
        .unwrap();

        // the CPU backend, on views that start after `pad` junk elements
        let (dl, dr, dm, dh, db) = (
            padded(&logp, pad),
            padded(&ref_logp, pad),
            padded(&mask, pad),
            padded(&hwe, pad),
            padded(&beta, pad),
        );
        let (mut dw, mut ds, mut dmean) = (
            padded(&vec![0.0; n], pad),
            padded(&vec![0.0; rows], pad),
            padded(&vec![0.0; rows], pad),
        );
        fn v(b: &Vec<f32>, pad: usize) -> View<'_, Vec<f32>> {
            View::new(b, pad, b.len() - pad).unwrap()
        }
        CpuBackend
            .masked_dynamic_kl(
                KlViews {
                    logp: v(&dl, pad),
                    ref_logp: v(&dr, pad),
                    mask: v(&dm, pad),
                    hwe_mask: with_hwe.then(|| v(&dh, pad)),
                    beta_rows: v(&db, pad),
                    low_ratio: 0.5,
                    estimator,
                    cols,
                },
                KlSumViews {
                    weighted: Some(ViewMut::new(&mut dw, pad, n).unwrap()),
                    row_weighted_sum: ViewMut::new(&mut ds, pad, rows).unwrap(),
                    row_mean_kl: ViewMut::new(&mut dmean, pad, rows).unwrap(),
                },
            )
            .unwrap();
        let what = format!("case {case}: {} hwe {with_hwe}", estimator.name());
        assert_eq!(&dw[pad..], &w[..], "{what}: weighted");
        assert_eq!(&ds[pad..], &sums[..], "{what}: row sums");
        assert_eq!(&dmean[pad..], &means[..], "{what}: row means");
        assert!(
            dw[..pad].iter().all(|x| x.is_nan()),
            "{what}: wrote before the view"
        );
    }
}

#[test]
fn masked_dynamic_kl_names_bad_input() {
    let (logp, mask, beta) = (vec![-1.0f32; 6], vec![1.0f32; 6], vec![0.1f32; 2]);
    let mut nan = logp.clone();
    nan[4] = f32::NAN;
    let (mut sums, mut means) = (vec![0.0f32; 2], vec![0.0f32; 2]);
    let e = CpuBackend
        .masked_dynamic_kl(
            KlViews {
                logp: View::whole(&logp),
                ref_logp: View::whole(&nan),
                mask: View::whole(&mask),
                hwe_mask: None,
                beta_rows: View::whole(&beta),
                low_ratio: 0.5,
                estimator: KlEstimator::K3,
                cols: 3,
            },
            KlSumViews {
                weighted: None,
                row_weighted_sum: ViewMut::whole(&mut sums),
                row_mean_kl: ViewMut::whole(&mut means),
            },
        )
        .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("masked_dynamic_kl"), "{msg}");
}

#[test]
fn copy_copies_between_views_and_checks_lengths() {
    let src: Vec<f32> = (0..10).map(|x| x as f32).collect();
    let mut dst = vec![0.0f32; 8];
    CpuBackend
        .copy(
            View::new(&src, 2, 5).unwrap(),
            ViewMut::new(&mut dst, 1, 5).unwrap(),
        )
        .unwrap();
    assert_eq!(dst, [0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0]);
    let e = CpuBackend.copy(
        View::new(&src, 0, 3).unwrap(),
        ViewMut::new(&mut dst, 0, 4).unwrap(),
    );
    assert!(e.is_err());
}
