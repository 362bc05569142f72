//! Every CUDA kernel against its CPU twin on fresh random data, outputs poisoned with NaN
//! before each run. Needs a GPU: without one each test is skipped with a message, unless
//! `ARES_REQUIRE_GPU=1` (set by `scripts/gpu-bundle.sh`'s runner), which makes it fail.

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
