//! Every CUDA kernel against its CPU twin on fresh random data, outputs poisoned with NaN
//! before each run. Needs a GPU: without one each test is skipped with a message, unless
//! `ARES_REQUIRE_GPU=1` (set by `scripts/gpu-bundle.sh`'s runner), which makes it fail.

#[path = "common/advantage_batch.rs"]
mod advantage_batch;
#[path = "common/loss_reference.rs"]
mod loss_reference;

use ares_cuda::Cuda;
use cudarc::driver::CudaSlice;
use half::bf16;

fn gpu_or_skip() -> Option<Cuda> {
    match Cuda::new(0) {
        Ok(cuda) => {
            eprintln!("GPU: {}", cuda.info());
            Some(cuda)
        }
        Err(e) => {
            let required = std::env::var("ARES_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!required, "ARES_REQUIRE_GPU=1 but no usable GPU: {e}");
            eprintln!("skipped (no GPU): {e}");
            None
        }
    }
}

/// Deterministic uniform [0, 1) values (SplitMix64), so failures reproduce.
struct Rng(u64);
impl Rng {
    fn unit(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }
}

fn upload<T: cudarc::driver::DeviceRepr>(cuda: &Cuda, host: &[T]) -> CudaSlice<T> {
    cuda.stream().clone_htod(host).expect("upload")
}

fn poisoned(cuda: &Cuda, n: usize) -> CudaSlice<f32> {
    upload(cuda, &vec![f32::NAN; n])
}

fn download(cuda: &Cuda, dev: &CudaSlice<f32>) -> Vec<f32> {
    cuda.stream().clone_dtoh(dev).expect("download")
}

/// |a − b| ≤ rel·max(1, |b|), element-wise, with a message naming the first failure.
fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rel * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: GPU {g}, CPU {w} (tolerance {tol})"
        );
    }
}

#[test]
fn log_prob_entropy_matches_cpu_f32_and_bf16() {
    let Some(mut cuda) = gpu_or_skip() else {
        return;
    };
    let mut rng = Rng(1);
    // odd vocabularies exercise the unaligned head and the tail; 151 936 is Qwen2's
    for (rows, vocab) in [
        (7usize, 1usize),
        (5, 3),
        (33, 1001),
        (16, 32_000),
        (8, 151_936),
    ] {
        let host: Vec<f32> = (0..rows * vocab)
            .map(|_| (rng.unit() - 0.5) * 30.0)
            .collect();
        let ids: Vec<u32> = (0..rows).map(|r| (r * 7919 % vocab) as u32).collect();
        for temperature in [1.0f32, 0.6] {
            let (mut lp_cpu, mut h_cpu) = (vec![0.0; rows], vec![0.0; rows]);
            ares_cpu::log_prob_entropy(
                ares_cpu::Logits::F32(&host),
                vocab,
                temperature,
                Some((&ids, &mut lp_cpu)),
                &mut h_cpu,
            )
            .expect("cpu");
            let (d_logits, d_ids) = (upload(&cuda, &host), upload(&cuda, &ids));
            let (mut d_lp, mut d_h) = (poisoned(&cuda, rows), poisoned(&cuda, rows));
            cuda.log_prob_entropy(
                &d_logits,
                vocab,
                temperature,
                Some((&d_ids, &mut d_lp)),
                &mut d_h,
            )
            .expect("gpu");
            let what = format!("f32 rows {rows} vocab {vocab} T {temperature}");
            assert_close(
                &format!("{what} entropy"),
                &download(&cuda, &d_h),
                &h_cpu,
                1e-5,
            );
            assert_close(
                &format!("{what} log_prob"),
                &download(&cuda, &d_lp),
                &lp_cpu,
                1e-5,
            );

            // bf16: both sides read the same bf16 values; only accumulation order differs
            let host_bf16: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
            ares_cpu::log_prob_entropy(
                ares_cpu::Logits::Bf16(&host_bf16),
                vocab,
                temperature,
                Some((&ids, &mut lp_cpu)),
                &mut h_cpu,
            )
            .expect("cpu bf16");
            let d_logits = upload(&cuda, &host_bf16);
            let (mut d_lp, mut d_h) = (poisoned(&cuda, rows), poisoned(&cuda, rows));
            cuda.log_prob_entropy(
                &d_logits,
                vocab,
                temperature,
                Some((&d_ids, &mut d_lp)),
                &mut d_h,
            )
            .expect("gpu bf16");
            let what = format!("bf16 rows {rows} vocab {vocab} T {temperature}");
            assert_close(
                &format!("{what} entropy"),
                &download(&cuda, &d_h),
                &h_cpu,
                1e-5,
            );
            assert_close(
                &format!("{what} log_prob"),
                &download(&cuda, &d_lp),
                &lp_cpu,
                1e-5,
            );
        }
    }
}

#[test]
fn log_prob_entropy_reports_bad_rows() {
    let Some(mut cuda) = gpu_or_skip() else {
        return;
    };
    let mut host = vec![0.5f32; 4 * 100];
    host[250] = f32::NAN;
    let d = upload(&cuda, &host);
    let mut h = poisoned(&cuda, 4);
    let err = cuda
        .log_prob_entropy(&d, 100, 1.0, None, &mut h)
        .expect_err("NaN row");
    assert!(err.to_string().contains("log_prob_entropy_f32"), "{err}");
}

/// A `[rows, cols]` batch of entropies and prefix masks of random lengths (some empty).
fn token_batch(rng: &mut Rng, rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let h: Vec<f32> = (0..rows * cols).map(|_| rng.unit() * 2.5).collect();
    let mut m = vec![0.0f32; rows * cols];
    for row in m.chunks_exact_mut(cols) {
        let len = (rng.unit() * (cols + 1) as f32) as usize;
        row[..len.min(cols)].fill(1.0);
    }
    (h, m)
}

#[test]
fn entropy_windows_and_hwe_match_cpu() {
    let Some(mut cuda) = gpu_or_skip() else {
        return;
    };
    let mut rng = Rng(2);
    for (rows, cols, window, includes_self) in [
        (3usize, 8usize, 4usize, false),
        (64, 1000, 4, false),
        (17, 4096, 7, true),
        (5, 300, 1, false),
    ] {
        let (h, m) = token_batch(&mut rng, rows, cols);
        let trigger: Vec<f32> = (0..rows * cols)
            .map(|_| if rng.unit() < 0.7 { 1.0 } else { 0.0 })
            .collect();
        let tau = 1.2f32;
        let n = rows * cols;
        for use_trigger in [false, true] {
            let (mut means, mut valid, mut hwe) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            let (mut counts, mut cost) = (vec![0.0; rows], vec![0.0; rows]);
            let spec = ares_cpu::WindowSpec {
                cols,
                window_size: window,
                includes_self,
            };
            let outs = ares_cpu::HweOutputs {
                tau,
                trigger: use_trigger.then_some(trigger.as_slice()),
                hwe_mask: &mut hwe,
                counts: &mut counts,
                soft_cost: &mut cost,
            };
            ares_cpu::entropy_windows(&h, &m, spec, Some(outs), &mut means, &mut valid)
                .expect("cpu");

            let (dh, dm, dt) = (
                upload(&cuda, &h),
                upload(&cuda, &m),
                upload(&cuda, &trigger),
            );
            let (mut d_means, mut d_valid, mut d_hwe) =
                (poisoned(&cuda, n), poisoned(&cuda, n), poisoned(&cuda, n));
            let (mut d_counts, mut d_cost) = (poisoned(&cuda, rows), poisoned(&cuda, rows));
            let spec = ares_cuda::WindowSpec {
                cols,
                window_size: window,
                includes_self,
            };
            let outs = ares_cuda::HweOutputs {
                tau,
                trigger: use_trigger.then(|| dt.as_view()),
                hwe_mask: d_hwe.as_view_mut(),
                counts: d_counts.as_view_mut(),
                soft_cost: d_cost.as_view_mut(),
            };
            cuda.token_ops()
                .entropy_windows(
                    &dh.as_view(),
                    &dm.as_view(),
                    spec,
                    Some(outs),
                    &mut d_means.as_view_mut(),
                    &mut d_valid.as_view_mut(),
                )
                .expect("gpu");
            let what = format!(
                "rows {rows} cols {cols} w {window} self {includes_self} trigger {use_trigger}"
            );
            assert_eq!(download(&cuda, &d_valid), valid, "{what}: valid");
            assert_close(
                &format!("{what}: means"),
                &download(&cuda, &d_means),
                &means,
                1e-6,
            );
            // a mean within rounding of τ may land on either side; count such ties
            let gpu_hwe = download(&cuda, &d_hwe);
            let disagree: Vec<usize> = (0..n).filter(|&i| gpu_hwe[i] != hwe[i]).collect();
            assert!(
                disagree.iter().all(|&i| (means[i] - tau).abs() < 1e-6),
                "{what}: HWE differs at {disagree:?}"
            );
            if disagree.is_empty() {
                assert_eq!(download(&cuda, &d_counts), counts, "{what}: counts");
                assert_close(
                    &format!("{what}: soft cost"),
                    &download(&cuda, &d_cost),
                    &cost,
                    1e-5,
                );
            }
        }
    }
}

#[test]
fn row_percentile_matches_cpu() {
    let Some(mut cuda) = gpu_or_skip() else {
        return;
    };
    let mut rng = Rng(3);
    for (rows, cols) in [(4usize, 8usize), (33, 1000), (8, 4096), (2, 16_384)] {
        let (h, m) = token_batch(&mut rng, rows, cols);
        let n = rows * cols;
        let (mut means, mut valid) = (vec![0.0; n], vec![0.0; n]);
        let spec = ares_cpu::WindowSpec {
            cols,
            window_size: 4,
            includes_self: false,
        };
        ares_cpu::entropy_windows(&h, &m, spec, None, &mut means, &mut valid).expect("cpu windows");
        for q in [0.0f32, 50.0, 95.0, 100.0] {
            let (mut thr, mut has) = (vec![0.0; rows], vec![0.0; rows]);
            ares_cpu::row_percentile(&means, &valid, cols, q, &mut thr, &mut has).expect("cpu");
            let (dmeans, dvalid) = (upload(&cuda, &means), upload(&cuda, &valid));
            let (mut d_thr, mut d_has) = (poisoned(&cuda, rows), poisoned(&cuda, rows));
            cuda.token_ops()
                .row_percentile(
                    &dmeans.as_view(),
                    &dvalid.as_view(),
                    cols,
                    q,
                    &mut d_thr.as_view_mut(),
                    &mut d_has.as_view_mut(),
                )
                .expect("gpu");
            let what = format!("rows {rows} cols {cols} q {q}");
            assert_eq!(download(&cuda, &d_has), has, "{what}: has");
            assert_close(
                &format!("{what}: threshold"),
                &download(&cuda, &d_thr),
                &thr,
                1e-6,
            );
        }
    }
}

#[test]
fn masked_dynamic_kl_matches_cpu() {
    use ares_core::kl::KlEstimator;
    let Some(mut cuda) = gpu_or_skip() else {
        return;
    };
    let mut rng = Rng(4);
    for (rows, cols) in [(3usize, 5usize), (64, 1000), (16, 4096)] {
        let n = rows * cols;
        let (_, m) = token_batch(&mut rng, rows, cols);
        let logp: Vec<f32> = (0..n).map(|_| -4.0 * rng.unit()).collect();
        let ref_logp: Vec<f32> = logp.iter().map(|&l| l + (rng.unit() - 0.5) * 3.0).collect();
        let hwe: Vec<f32> = (0..n)
            .map(|_| if rng.unit() < 0.2 { 1.0 } else { 0.0 })
            .collect();
        let beta: Vec<f32> = (0..rows).map(|_| rng.unit() * 0.01).collect();
        for estimator in KlEstimator::ALL {
            let (mut kl, mut w) = (vec![0.0; n], vec![0.0; n]);
            let (mut sums, mut means) = (vec![0.0; rows], vec![0.0; rows]);
            let total = ares_cpu::masked_dynamic_kl(
                ares_cpu::MaskedKlInputs {
                    logp: &logp,
                    ref_logp: &ref_logp,
                    mask: &m,
                    hwe_mask: Some(&hwe),
                    beta_rows: &beta,
                    low_ratio: 0.5,
                    estimator,
                    cols,
                },
                ares_cpu::MaskedKlOutputs {
                    kl: Some(&mut kl),
                    weighted: Some(&mut w),
                    row_weighted_sum: &mut sums,
                    row_mean_kl: &mut means,
                },
            )
            .expect("cpu");
            let (dl, dr, dm, dh, db) = (
                upload(&cuda, &logp),
                upload(&cuda, &ref_logp),
                upload(&cuda, &m),
                upload(&cuda, &hwe),
                upload(&cuda, &beta),
            );
            let (mut d_kl, mut d_w) = (poisoned(&cuda, n), poisoned(&cuda, n));
            let (mut d_sums, mut d_means, mut d_total) = (
                poisoned(&cuda, rows),
                poisoned(&cuda, rows),
                poisoned(&cuda, 1),
            );
            cuda.token_ops()
                .masked_dynamic_kl(
                    ares_cuda::MaskedKlInputs {
                        logp: dl.as_view(),
                        ref_logp: dr.as_view(),
                        mask: dm.as_view(),
                        hwe_mask: Some(dh.as_view()),
                        beta_rows: db.as_view(),
                        low_ratio: 0.5,
                        estimator,
                        cols,
                    },
                    ares_cuda::MaskedKlOutputs {
                        kl: Some(d_kl.as_view_mut()),
                        weighted: Some(d_w.as_view_mut()),
                        row_weighted_sum: d_sums.as_view_mut(),
                        row_mean_kl: d_means.as_view_mut(),
                        total: d_total.as_view_mut(),
                    },
                )
                .expect("gpu");
            let what = format!("rows {rows} cols {cols} {}", estimator.name());
            assert_close(&format!("{what}: kl"), &download(&cuda, &d_kl), &kl, 1e-5);
            assert_close(
                &format!("{what}: weighted"),
                &download(&cuda, &d_w),
                &w,
                1e-5,
            );
            assert_close(
                &format!("{what}: row sums"),
                &download(&cuda, &d_sums),
                &sums,
                1e-5,
            );
            assert_close(
                &format!("{what}: row means"),
                &download(&cuda, &d_means),
                &means,
                1e-5,
            );
            assert_close(
                &format!("{what}: total"),
                &download(&cuda, &d_total),
                &[total],
                1e-5,
            );
        }
    }
}

#[test]
fn log_prob_entropy_f16_matches_cpu() {
    use half::f16;
    let Some(mut cuda) = gpu_or_skip() else {
        return;
    };
    let mut rng = Rng(5);
    for (rows, vocab) in [(3usize, 1usize), (9, 1001), (4, 151_936)] {
        let host: Vec<f16> = (0..rows * vocab)
            .map(|_| f16::from_f32((rng.unit() - 0.5) * 30.0))
            .collect();
        let ids: Vec<u32> = (0..rows).map(|r| (r * 7919 % vocab) as u32).collect();
        let (mut lp_cpu, mut h_cpu) = (vec![0.0; rows], vec![0.0; rows]);
        let logits = ares_cpu::Logits::F16(&host);
        ares_cpu::log_prob_entropy(logits, vocab, 0.8, Some((&ids, &mut lp_cpu)), &mut h_cpu)
            .expect("cpu");
        let (d_logits, d_ids) = (upload(&cuda, &host), upload(&cuda, &ids));
        let (mut d_lp, mut d_h) = (poisoned(&cuda, rows), poisoned(&cuda, rows));
        cuda.log_prob_entropy(&d_logits, vocab, 0.8, Some((&d_ids, &mut d_lp)), &mut d_h)
            .expect("gpu");
        let what = format!("f16 rows {rows} vocab {vocab}");
        assert_close(
            &format!("{what} entropy"),
            &download(&cuda, &d_h),
            &h_cpu,
            1e-5,
        );
        assert_close(
            &format!("{what} log_prob"),
            &download(&cuda, &d_lp),
            &lp_cpu,
            1e-5,
        );
    }
}

#[test]
fn policy_loss_matches_core() {
    use ares_cuda::{LOSS_STATS, LossInputs, LossKind, LossOutputs, LossReport};
    use loss_reference::{Batch, assert_values, expected, specs};
    let Some(mut cuda) = gpu_or_skip() else {
        return;
    };
    let mut rng = loss_reference::Rng(0x5EED_1234);
    let mut checked = 0;
    for (rows, cols) in [(1usize, 1usize), (3, 7), (5, 600), (64, 2048)] {
        let b = Batch::random(&mut rng, rows, cols);
        let n = rows * cols;
        let d = |v: &[f32]| upload(&cuda, v);
        let (logp, old, adv, mask) = (d(&b.logp), d(&b.old), d(&b.adv), d(&b.mask));
        let (rollout, keep, refp) = (d(&b.rollout), d(&b.keep), d(&b.refp));
        let (beta, hwe, entropy) = (d(&b.beta), d(&b.hwe), d(&b.entropy));
        for (spec, forking, with_hwe) in specs() {
            let what = format!("{rows}×{cols} {spec:?} forking {forking} hwe {with_hwe}");
            let (mut grad, mut egrad) = (poisoned(&cuda, n), poisoned(&cuda, n));
            let (mut counts, mut stats) =
                (poisoned(&cuda, rows), poisoned(&cuda, rows * LOSS_STATS));
            let mut totals = poisoned(&cuda, LOSS_STATS);
            let mut status = upload(&cuda, &[7u32, 7]);
            let mut selected = poisoned(&cuda, n);
            cuda.token_ops()
                .policy_loss(
                    &spec,
                    LossInputs {
                        logp: logp.as_view(),
                        logp_old: old.as_view(),
                        advantages: adv.as_view(),
                        mask: mask.as_view(),
                        logp_rollout: Some(rollout.as_view()),
                        keep: forking.then(|| keep.as_view()),
                        logp_ref: Some(refp.as_view()),
                        beta_rows: Some(beta.as_view()),
                        hwe: with_hwe.then(|| hwe.as_view()),
                        entropy: Some(entropy.as_view()),
                        cols,
                    },
                    LossOutputs {
                        grad: grad.as_view_mut(),
                        entropy_grad: Some(egrad.as_view_mut()),
                        row_counts: counts.as_view_mut(),
                        row_stats: stats.as_view_mut(),
                        totals: totals.as_view_mut(),
                        status: status.as_view_mut(),
                        selected: spec.kind.selects_tokens().then(|| selected.as_view_mut()),
                    },
                )
                .expect("launch");
            let got_totals: [f32; LOSS_STATS] =
                download(&cuda, &totals).try_into().expect("totals");
            let got_status = cuda.stream().clone_dtoh(&status).expect("status");
            let report = LossReport::read(&got_totals, [got_status[0], got_status[1]]);
            let want = match expected(&spec, &b, forking, with_hwe) {
                Ok(w) => w,
                Err(e) => {
                    assert_eq!(report.unwrap_err(), e, "{what}");
                    continue;
                }
            };
            let report = report.unwrap_or_else(|e| panic!("{what}: {e}"));
            // core's arithmetic operation for operation (GSPO: its row sums and exp aside);
            // a GPU's contraction of a·b + c where the source allows it would show here
            let rel = if matches!(spec.kind, LossKind::Gspo(_)) {
                1e-5
            } else {
                2e-6
            };
            assert_close(
                &format!("{what}: grad"),
                &download(&cuda, &grad),
                &want.grad,
                rel,
            );
            if spec.entropy_coef.is_some() {
                assert_close(
                    &format!("{what}: entropy_grad"),
                    &download(&cuda, &egrad),
                    &want.entropy_grad,
                    2e-6,
                );
            }
            assert_values(&what, &report, &want, 1e-4);
            checked += 1;
        }
    }
    assert!(checked > 100, "{checked} cases compared");
}

/// The fused LM head (`ModelOps::linear_log_prob_entropy` and its backward) against its CPU
/// twin `ares_cpu::ops::linear_head`: f32 operands (exact f32 products) to f32 rounding, and
/// bf16 operands against the twin on the same bf16 values widened (the GPU rounds each
/// chunk's ∂L/∂z to bf16 for its two products: to bf16 rounding), over several chunkings.
#[test]
fn fused_linear_head_matches_the_cpu_twin() {
    use ares_cpu::ops::linear_head::{
        HeadDims as CpuDims, linear_log_prob_entropy, linear_log_prob_entropy_backward,
    };
    use ares_cuda::{GemmPrecision, HeadDims, ModelOps, Operand};
    let ops = match ModelOps::new(0) {
        Ok(ops) => ops,
        Err(e) => {
            let required = std::env::var("ARES_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!required, "ARES_REQUIRE_GPU=1 but no model ops: {e}");
            eprintln!("skipped (no GPU): {e}");
            return;
        }
    };
    let s = ops.stream().clone();
    let to_bf16 = |v: &[f32]| {
        let mut d = vec![0u16; v.len()];
        ares_cpu::ops::precision::round_to_bf16(v, &mut d).expect("lengths");
        d
    };
    let widen = |b: &[u16]| -> Vec<f32> {
        b.iter()
            .map(|&h| f32::from_bits(u32::from(h) << 16))
            .collect()
    };
    let mut rng = Rng(0x4EAD);
    let (rows, hidden, vocab) = (300usize, 96usize, 1000usize);
    let mut vals =
        |n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| (rng.unit() - 0.5) * scale).collect() };
    let (x, w) = (vals(rows * hidden, 2.0), vals(vocab * hidden, 0.6));
    let ids: Vec<u32> = (0..rows).map(|r| (r * 37 % vocab) as u32).collect();
    let (g, gh) = (vals(rows, 1.0), vals(rows, 0.5));
    for bf16 in [false, true] {
        // the CPU twin on the values the GPU multiplies
        let (xr, wr): (Vec<f32>, Vec<f32>) = if bf16 {
            (widen(&to_bf16(&x)), widen(&to_bf16(&w)))
        } else {
            (x.clone(), w.clone())
        };
        let cpu_dims = CpuDims {
            rows,
            hidden,
            vocab,
        };
        let (mut want_lp, mut want_h) = (vec![0.0f32; rows], vec![0.0f32; rows]);
        linear_log_prob_entropy(
            &xr,
            &wr,
            cpu_dims,
            0.8,
            Some((&ids, &mut want_lp)),
            &mut want_h,
            64,
        )
        .expect("cpu forward");
        let (mut want_gx, mut want_gw) =
            (vec![0.0f32; rows * hidden], vec![0.0f32; vocab * hidden]);
        linear_log_prob_entropy_backward(
            &xr,
            &wr,
            cpu_dims,
            0.8,
            Some((&ids, &g)),
            Some(&gh),
            &mut want_gx,
            &mut want_gw,
            64,
        )
        .expect("cpu backward");
        let (xf, wf) = (s.clone_htod(&xr).unwrap(), s.clone_htod(&wr).unwrap());
        let (xb, wb) = (
            s.clone_htod(&to_bf16(&xr)).unwrap(),
            s.clone_htod(&to_bf16(&wr)).unwrap(),
        );
        let (ids_d, g_d, gh_d) = (
            s.clone_htod(&ids).unwrap(),
            s.clone_htod(&g).unwrap(),
            s.clone_htod(&gh).unwrap(),
        );
        let dims = HeadDims {
            rows,
            hidden,
            vocab,
            precision: if bf16 {
                GemmPrecision::Bf16
            } else {
                GemmPrecision::F32
            },
        };
        for chunk in [1usize, 7, 64, 300, 1000] {
            let what = format!("bf16 {bf16} chunk {chunk}");
            let (xfv, wfv, xbv, wbv) = (xf.as_view(), wf.as_view(), xb.as_view(), wb.as_view());
            let (xo, wo) = if bf16 {
                (Operand::Bf16(&xbv), Operand::Bf16(&wbv))
            } else {
                (Operand::F32(&xfv), Operand::F32(&wfv))
            };
            let (mut lp, mut h) = (
                s.clone_htod(&vec![f32::NAN; rows]).unwrap(),
                s.clone_htod(&vec![f32::NAN; rows]).unwrap(),
            );
            ops.linear_log_prob_entropy(
                xo,
                wo,
                dims,
                0.8,
                &ids_d.as_view(),
                &mut lp.as_view_mut(),
                &mut h.as_view_mut(),
                chunk,
            )
            .expect("forward");
            ops.check_status().expect("forward status");
            // the products sum in cuBLAS's order: the log-probs to f32 rounding of the sums
            assert_close(
                &format!("{what}: log_prob"),
                &s.clone_dtoh(&lp).unwrap(),
                &want_lp,
                2e-5,
            );
            assert_close(
                &format!("{what}: entropy"),
                &s.clone_dtoh(&h).unwrap(),
                &want_h,
                2e-5,
            );
            let mut gx = s.clone_htod(&vec![f32::NAN; rows * hidden]).unwrap();
            // accumulates: start from 1 to see the addition
            let mut gw = s.clone_htod(&vec![1.0f32; vocab * hidden]).unwrap();
            ops.linear_log_prob_entropy_backward(
                xo,
                wo,
                dims,
                0.8,
                Some((&ids_d.as_view(), &g_d.as_view())),
                Some(&gh_d.as_view()),
                &mut gx.as_view_mut(),
                &mut gw.as_view_mut(),
                chunk,
            )
            .expect("backward");
            ops.check_status().expect("backward status");
            let want_gw1: Vec<f32> = want_gw.iter().map(|v| v + 1.0).collect();
            // bf16: ∂L/∂z rounded to bf16 (relative 2^-9) before its products
            let rel = if bf16 { 1e-2 } else { 2e-5 };
            let scale = |v: &[f32]| v.iter().fold(0.0f32, |m, a| m.max(a.abs()));
            let (gx_got, gw_got) = (s.clone_dtoh(&gx).unwrap(), s.clone_dtoh(&gw).unwrap());
            for (name, got, want) in [
                ("grad_x", &gx_got, &want_gx),
                ("grad_w", &gw_got, &want_gw1),
            ] {
                let tol = rel * scale(want).max(1e-3);
                for (i, (a, b)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(
                        (a - b).abs() <= tol,
                        "{what}: {name}[{i}] GPU {a}, CPU {b} (tolerance {tol})"
                    );
                }
            }
        }
    }
    // bad input: a target out of range is reported
    let bad: Vec<u32> = (0..rows)
        .map(|r| if r == 5 { vocab as u32 } else { 0 })
        .collect();
    let (xf, wf, bad_d) = (
        s.clone_htod(&x).unwrap(),
        s.clone_htod(&w).unwrap(),
        s.clone_htod(&bad).unwrap(),
    );
    let (mut lp, mut h) = (
        s.clone_htod(&vec![0.0f32; rows]).unwrap(),
        s.clone_htod(&vec![0.0f32; rows]).unwrap(),
    );
    let dims = HeadDims {
        rows,
        hidden,
        vocab,
        precision: GemmPrecision::F32,
    };
    ops.linear_log_prob_entropy(
        Operand::F32(&xf.as_view()),
        Operand::F32(&wf.as_view()),
        dims,
        1.0,
        &bad_d.as_view(),
        &mut lp.as_view_mut(),
        &mut h.as_view_mut(),
        64,
    )
    .expect("queued");
    assert!(
        ops.check_status().is_err(),
        "a target out of range is reported"
    );
    // operands of two kinds are refused
    let wb = s.clone_htod(&vec![0u16; vocab * hidden]).unwrap();
    let e = ops
        .linear_log_prob_entropy(
            Operand::F32(&xf.as_view()),
            Operand::Bf16(&wb.as_view()),
            dims,
            1.0,
            &bad_d.as_view(),
            &mut lp.as_view_mut(),
            &mut h.as_view_mut(),
            64,
        )
        .unwrap_err();
    assert!(e.to_string().contains("must both be bf16"), "{e}");
}

#[test]
fn advantage_estimators_match_core() {
    use advantage_batch::Case;
    use ares_core::advantage::{self as adv, GrpoConfig, ProMaxConfig, ResponseTokens};
    use ares_core::{Groups, Shape};
    use ares_cuda::{DeviceTokens, SampleEstimator, TokenEstimator};
    let Some(mut cuda) = gpu_or_skip() else {
        return;
    };
    let mut rng = loss_reference::Rng(0xAD7);
    for (groups_n, cols) in [(3usize, 1usize), (64, 700), (256, 4096)] {
        let case = Case::new(&mut rng, groups_n, cols);
        let (rows, cols) = (case.rows(), case.cols);
        let Case {
            rewards,
            uids,
            mask,
            kl,
            ..
        } = case;
        let mut scratch = vec![0usize; 2 * rows + 1];
        let groups = Groups::by_uid(&uids, &mut scratch).expect("layout");
        let shape = Shape { rows, cols };
        let (d_r, d_m, d_k) = (
            upload(&cuda, &rewards),
            upload(&cuda, &mask),
            upload(&cuda, &kl),
        );
        for est in [
            SampleEstimator::Grpo(GrpoConfig::default()),
            SampleEstimator::Grpo(GrpoConfig::dr_grpo()),
            SampleEstimator::Rloo,
            SampleEstimator::ReinforceBaseline,
        ] {
            let mut want = vec![0.0f32; rows];
            match est {
                SampleEstimator::Grpo(c) => adv::grpo_advantages(&groups, &rewards, &c, &mut want),
                SampleEstimator::Rloo => adv::rloo_advantages(&groups, &rewards, &mut want),
                _ => adv::reinforce_baseline_advantages(&groups, &rewards, &mut want),
            }
            .expect("core");
            let mut out = poisoned(&cuda, rows);
            cuda.sample_advantages(&groups, &d_r.as_view(), est, &mut out.as_view_mut())
                .expect("gpu");
            let got = download(&cuda, &out);
            for i in 0..rows {
                assert_eq!(got[i].to_bits(), want[i].to_bits(), "{est:?} row {i}");
            }
        }
        for est in [
            TokenEstimator::Grpo(GrpoConfig::default()),
            TokenEstimator::Rloo,
            TokenEstimator::ReinforcePp { gamma: 0.97 },
            TokenEstimator::ReinforcePpBaseline { gamma: 1.0 },
            TokenEstimator::ProMax(ProMaxConfig::default()),
            TokenEstimator::ProMax(ProMaxConfig::uniform_scale()),
        ] {
            let with_kl = !matches!(est, TokenEstimator::Grpo(_));
            let tokens = ResponseTokens::new(shape, &mask);
            let tokens = if with_kl { tokens.with_kl(&kl) } else { tokens };
            let mut want = vec![0.0f32; rows * cols];
            let want_stats = match est {
                TokenEstimator::Grpo(c) => {
                    adv::grpo_token_advantages(&groups, &rewards, shape, &mask, &c, &mut want)
                        .map(|_| None)
                }
                TokenEstimator::Rloo => {
                    adv::rloo_token_advantages(&groups, &rewards, tokens, &mut want).map(|_| None)
                }
                TokenEstimator::ReinforcePp { gamma } => {
                    adv::reinforce_pp_advantages(&rewards, tokens, gamma, &mut want).map(Some)
                }
                TokenEstimator::ReinforcePpBaseline { gamma } => {
                    adv::reinforce_pp_baseline_advantages(
                        &groups, &rewards, tokens, gamma, &mut want,
                    )
                    .map(Some)
                }
                TokenEstimator::ProMax(c) => {
                    adv::reinforce_pro_max(&groups, &rewards, tokens, &c, None, &mut want)
                        .map(|_| None)
                }
            }
            .expect("core");
            let mut out = poisoned(&cuda, rows * cols);
            let dev_tokens = DeviceTokens {
                mask: d_m.as_view(),
                weighted_kl: with_kl.then(|| d_k.as_view()),
                cols,
            };
            let stats = cuda
                .token_advantages(
                    Some(&groups),
                    &d_r.as_view(),
                    dev_tokens,
                    est,
                    &mut out.as_view_mut(),
                )
                .expect("gpu");
            let what = format!("{rows}×{cols} {est:?}");
            assert_close(&what, &download(&cuda, &out), &want, 3e-5);
            if let (Some(s), Some(w)) = (stats, want_stats) {
                assert_eq!(s.valid_tokens, w.valid_tokens, "{what}");
                assert_close(&what, &[s.mean, s.var], &[w.mean, w.var], 1e-5);
            }
        }
        let values: Vec<f32> = kl.iter().map(|k| 3.0 + 40.0 * k).collect();
        let mut want = values.clone();
        let w = adv::masked_whiten(shape, &mut want, &mask).expect("core");
        let mut d_v = upload(&cuda, &values);
        let s = cuda
            .masked_whiten(&mut d_v.as_view_mut(), &d_m.as_view(), cols)
            .expect("gpu");
        assert_close("masked_whiten", &download(&cuda, &d_v), &want, 1e-4);
        assert_eq!(s.valid_tokens, w.valid_tokens);
        // a NaN reward is core's error, naming its row
        let mut bad = rewards.clone();
        bad[rows - 1] = f32::NAN;
        let e = cuda
            .sample_advantages(
                &groups,
                &upload(&cuda, &bad).as_view(),
                SampleEstimator::Rloo,
                &mut poisoned(&cuda, rows).as_view_mut(),
            )
            .expect_err("NaN reward");
        assert!(
            e.to_string().contains(&format!("index {}", rows - 1)),
            "{e}"
        );
    }
}
