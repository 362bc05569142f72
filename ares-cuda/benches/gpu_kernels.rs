//! GPU benchmark of the token kernels (a plain binary: criterion's statistics are not
//! needed for device-timed kernels, and the GPU machine has no Rust toolchain).
//!
//! Reports, for each kernel, the median of timed runs (CUDA events), the bytes it must
//! move, the achieved GB/s, and the ratio to a device-to-device copy of the same bytes
//! measured in the same run — the physical limit of a kernel that reads its input once.
//! Without a GPU it prints why and exits 0. Output is also written as JSON lines to
//! `$ARES_BENCH_OUT` when set.

use ares_core::kl::KlEstimator;
use ares_cuda::{Cuda, HweOutputs, MaskedKlInputs, MaskedKlOutputs, WindowSpec};
use cudarc::driver::{CudaSlice, sys::CUevent_flags};
use half::bf16;
use std::io::Write;

const REPEATS: usize = 20;

fn main() {
    let mut cuda = match Cuda::new(0) {
        Ok(c) => c,
        Err(e) => {
            println!("gpu_kernels: skipped, no usable GPU: {e}");
            return;
        }
    };
    println!("device: {}", cuda.info());
    let mut report = Report::new();

    // --- fused log-prob + entropy, 8192 × 151 936 bf16 (Qwen2.5's vocabulary) --------
    let (rows, vocab) = (8192usize, 151_936usize);
    let logits: CudaSlice<bf16> = random_bf16(&cuda, rows * vocab, 1);
    let ids: Vec<u32> = (0..rows as u32).map(|r| r * 7919 % vocab as u32).collect();
    let d_ids = cuda.stream().clone_htod(&ids).expect("upload ids");
    let mut lp = cuda.stream().alloc_zeros::<f32>(rows).expect("alloc");
    let mut h = cuda.stream().alloc_zeros::<f32>(rows).expect("alloc");
    let logit_bytes = (rows * vocab * 2) as f64;
    let mut copy_dst = cuda
        .stream()
        .alloc_zeros::<bf16>(rows * vocab)
        .expect("alloc copy");
    let copy_ms = time_ms_mut(&mut cuda, |c| {
        c.stream()
            .memcpy_dtod(&logits, &mut copy_dst)
            .expect("dtod");
    });
    drop(copy_dst);
    // a copy moves the bytes twice (read + write)
    let copy_gbs = 2.0 * logit_bytes / (copy_ms * 1e-3) / 1e9;
    report.line(
        "dtod_copy_bf16_8192x151936",
        copy_ms,
        2.0 * logit_bytes,
        copy_gbs,
    );
    let ms = time_ms_mut(&mut cuda, |c| {
        c.log_prob_entropy(&logits, vocab, 1.0, Some((&d_ids, &mut lp)), &mut h)
            .expect("kernel");
    });
    let gbs = logit_bytes / (ms * 1e-3) / 1e9;
    report.line("log_prob_entropy_bf16_8192x151936", ms, logit_bytes, gbs);
    println!("  = {:.1} % of copy bandwidth", 100.0 * gbs / copy_gbs);
    drop(logits);

    // --- windows / percentile / KL at 4 M tokens (1024 rows × 4096) ------------------
    let (rows, cols) = (1024usize, 4096usize);
    let n = rows * cols;
    let entropy = random_f32(&cuda, n, 2, 0.0, 2.0);
    let mask = prefix_mask(&cuda, rows, cols, 3);
    let mut means = cuda.stream().alloc_zeros::<f32>(n).expect("alloc");
    let mut valid = cuda.stream().alloc_zeros::<f32>(n).expect("alloc");
    let mut hwe = cuda.stream().alloc_zeros::<f32>(n).expect("alloc");
    let mut counts = cuda.stream().alloc_zeros::<f32>(rows).expect("alloc");
    let mut cost = cuda.stream().alloc_zeros::<f32>(rows).expect("alloc");
    let spec = WindowSpec {
        cols,
        window_size: 4,
        includes_self: false,
    };
    let ms = time_ms_mut(&mut cuda, |c| {
        let outs = HweOutputs {
            tau: 1.2,
            trigger: None,
            hwe_mask: hwe.as_view_mut(),
            counts: counts.as_view_mut(),
            soft_cost: cost.as_view_mut(),
        };
        c.token_ops()
            .entropy_windows(
                &entropy.as_view(),
                &mask.as_view(),
                spec,
                Some(outs),
                &mut means.as_view_mut(),
                &mut valid.as_view_mut(),
            )
            .expect("kernel");
    });
    let bytes = (n * 4 * 5) as f64; // read H, mask; write means, valid, hwe
    report.line(
        "entropy_windows_hwe_4M",
        ms,
        bytes,
        bytes / (ms * 1e-3) / 1e9,
    );

    let mut thr = cuda.stream().alloc_zeros::<f32>(rows).expect("alloc");
    let mut has = cuda.stream().alloc_zeros::<f32>(rows).expect("alloc");
    let ms = time_ms_mut(&mut cuda, |c| {
        c.token_ops()
            .row_percentile(
                &means.as_view(),
                &valid.as_view(),
                cols,
                95.0,
                &mut thr.as_view_mut(),
                &mut has.as_view_mut(),
            )
            .expect("kernel");
    });
    let bytes = (n * 4 * 2) as f64;
    report.line(
        "row_percentile_p95_4M",
        ms,
        bytes,
        bytes / (ms * 1e-3) / 1e9,
    );

    let logp = random_f32(&cuda, n, 4, -3.0, 0.0);
    let ref_logp = random_f32(&cuda, n, 5, -3.0, 0.0);
    let beta = cuda
        .stream()
        .clone_htod(&vec![0.001f32; rows])
        .expect("upload");
    let mut weighted = cuda.stream().alloc_zeros::<f32>(n).expect("alloc");
    let mut row_sum = cuda.stream().alloc_zeros::<f32>(rows).expect("alloc");
    let mut row_mean = cuda.stream().alloc_zeros::<f32>(rows).expect("alloc");
    let mut total = cuda.stream().alloc_zeros::<f32>(1).expect("alloc");
    let ms = time_ms_mut(&mut cuda, |c| {
        let inputs = MaskedKlInputs {
            logp: logp.as_view(),
            ref_logp: ref_logp.as_view(),
            mask: mask.as_view(),
            hwe_mask: Some(hwe.as_view()),
            beta_rows: beta.as_view(),
            low_ratio: 0.5,
            estimator: KlEstimator::K3,
            cols,
        };
        let outputs = MaskedKlOutputs {
            kl: None,
            weighted: Some(weighted.as_view_mut()),
            row_weighted_sum: row_sum.as_view_mut(),
            row_mean_kl: row_mean.as_view_mut(),
            total: total.as_view_mut(),
        };
        c.token_ops()
            .masked_dynamic_kl(inputs, outputs)
            .expect("kernel");
    });
    let bytes = (n * 4 * 5) as f64; // read logp, ref, mask, hwe; write weighted
    report.line(
        "masked_dynamic_kl_k3_4M",
        ms,
        bytes,
        bytes / (ms * 1e-3) / 1e9,
    );
}

struct Report {
    out: Option<std::fs::File>,
}

impl Report {
    fn new() -> Self {
        let out = std::env::var_os("ARES_BENCH_OUT").and_then(|p| std::fs::File::create(p).ok());
        Report { out }
    }

    fn line(&mut self, name: &str, ms: f64, bytes: f64, gbs: f64) {
        println!(
            "{name}: {:.1} µs median of {REPEATS}, {:.3} GB moved, {gbs:.0} GB/s",
            ms * 1e3,
            bytes / 1e9
        );
        if let Some(f) = &mut self.out {
            let _ = writeln!(
                f,
                "{{\"name\":\"{name}\",\"us\":{:.2},\"bytes\":{bytes},\"gbps\":{gbs:.1}}}",
                ms * 1e3
            );
        }
    }
}

/// Median over REPEATS of `f`, timed with CUDA events on the device stream (one warm-up).
fn time_ms_mut(cuda: &mut Cuda, mut f: impl FnMut(&mut Cuda)) -> f64 {
    let stream = cuda.stream().clone();
    let ctx = stream.context().clone();
    f(cuda);
    let mut times: Vec<f64> = (0..REPEATS)
        .map(|_| {
            let start = ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .expect("event");
            let end = ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .expect("event");
            start.record(&stream).expect("record");
            f(cuda);
            end.record(&stream).expect("record");
            end.synchronize().expect("sync");
            f64::from(start.elapsed_ms(&end).expect("elapsed"))
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[REPEATS / 2]
}

fn host_values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

fn random_f32(cuda: &Cuda, n: usize, seed: u64, lo: f32, hi: f32) -> CudaSlice<f32> {
    cuda.stream()
        .clone_htod(&host_values(n, seed, lo, hi))
        .expect("upload")
}

fn random_bf16(cuda: &Cuda, n: usize, seed: u64) -> CudaSlice<bf16> {
    let host: Vec<bf16> = host_values(n, seed, -10.0, 10.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    cuda.stream().clone_htod(&host).expect("upload")
}

fn prefix_mask(cuda: &Cuda, rows: usize, cols: usize, seed: u64) -> CudaSlice<f32> {
    let lens = host_values(rows, seed, 0.25, 1.0);
    let mut m = vec![0.0f32; rows * cols];
    for (row, frac) in m.chunks_exact_mut(cols).zip(lens) {
        let len = ((cols as f32) * frac) as usize;
        row[..len].fill(1.0);
    }
    cuda.stream().clone_htod(&m).expect("upload")
}
