//! The CUDA backend against the CPU backend: every op forward and backward on fresh
//! random data (including views at nonzero offsets), bad-value reporting, the tiny
//! transformers fixtures (logits, gradients, a training step, greedy generation) through
//! `Model<CudaBackend>`, and run-to-run determinism.
//!
//! Needs a GPU: without one every test is skipped with a message saying why, unless
//! `ARES_REQUIRE_GPU=1` (set by `scripts/gpu-bundle.sh`'s runner), which makes the skip a
//! failure.
//!
//! Tolerances, `|gpu − cpu| <= tol · max(1, |cpu|)` unless a test says otherwise:
//! - 0 (bit for bit) for copies and ops written in the CPU's order of separately rounded
//!   operations: fill, add, transpose, embedding forward and backward, RoPE, the KV-cache
//!   append;
//! - 1e-6 for element-wise ops with a transcendental (SwiGLU: CUDA's `expf` and Rust's
//!   `exp` may differ by an ulp), RMSNorm forward and AdamW;
//! - 1e-5 for reductions in another order: GEMMs (cuBLAS's blocking vs the CPU GEMM's),
//!   RMSNorm backward, log-prob/entropy (the token kernel's `ex2.approx`);
//! - 2e-6 for the vision activations (CUDA's f32 `erfcf`/`expf` vs the CPU's f64);
//! - 1e-4 for attention (online softmax vs the CPU's two-pass blocks; segment attention
//!   too) and whole models (the fixtures' own bound against transformers);
//! - 1e-10 relative for the f64 sum of squares.

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};

use ares_model::backend::cpu::CpuBackend;
use ares_model::backend::cuda::{CudaBackend, CudaBuffer, CudaIds};
use ares_model::backend::{
    Activation, AdamWConfig, AdamWUpdate, AttentionDims, AttentionGrads, AttentionInputs, Backend,
    BlockTables, DType, DeviceBuffer, GradWrite, GradWrites, KvCacheView, KvCacheViewMut,
    LinearDims, MatmulPrecision, PagedKvView, PagedKvViewMut, SegmentAttentionDims, Stored, View,
    ViewMut,
};
use ares_model::hf::checkpoint::Checkpoint;
use ares_model::model::{
    AdamW, ForwardExtras, GenerateRequest, GradDtype, Grads, Inputs, Model, Sampling, StepReport,
    WeightDtype,
};
use safetensors::{Dtype, SafeTensors};

mod common;

// ----- Set-up and comparison helpers. -----

fn gpu_or_skip() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(be) => {
            eprintln!("GPU: {}", be.info());
            Some(be)
        }
        Err(e) => {
            let required = std::env::var("ARES_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!required, "ARES_REQUIRE_GPU=1 but no usable GPU: {e}");
            eprintln!("skipped (no GPU): {e}");
            None
        }
    }
}

/// Deterministic uniform values (SplitMix64), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-scale, scale)`.
    fn f32(&mut self, scale: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32(scale)).collect()
    }

    fn ids(&mut self, n: usize, below: u32) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next() % u64::from(below)) as u32)
            .collect()
    }
}

fn up(be: &CudaBackend, host: &[f32]) -> CudaBuffer {
    let mut b = be.alloc(host.len()).unwrap();
    be.upload(host, ViewMut::whole(&mut b)).unwrap();
    b
}

fn up_ids(be: &CudaBackend, host: &[u32]) -> CudaIds {
    let mut b = be.alloc_ids(host.len()).unwrap();
    be.upload_ids(host, &mut b).unwrap();
    b
}

/// `host` rounded to bf16 (to nearest even) and uploaded to a half buffer of `be`.
fn up_bf16<B: Backend>(be: &B, host: &[f32]) -> B::Half {
    let bits: Vec<u16> = host
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let mut b = be.alloc_half(bits.len(), DType::Bf16).unwrap();
    be.upload_half(&bits, ViewMut::whole(&mut b)).unwrap();
    b
}

fn down(be: &CudaBackend, b: &CudaBuffer) -> Vec<f32> {
    let mut v = vec![0.0; b.len()];
    be.download(View::whole(b), &mut v).unwrap();
    v
}

/// `|got − want| <= tol · max(1, |want|)` element-wise; equal infinities and NaN in both
/// count as equal.
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0.0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g == w || (g.is_nan() && w.is_nan()) {
            continue;
        }
        let err = (g - w).abs() / w.abs().max(1.0);
        assert!(
            err <= tol,
            "{what}[{i}]: GPU {g}, CPU {w} (error {err:e} > {tol:e})"
        );
        worst = worst.max(err);
    }
    eprintln!("{what}: max error {worst:.2e}");
}

/// `max |got − want| / max |want|`: for outputs whose scale is far from 1.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff = got
        .iter()
        .zip(want)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).abs())
        .fold(0.0, f64::max);
    let scale = want.iter().map(|&y| f64::from(y).abs()).fold(0.0, f64::max);
    diff / scale.max(1e-30)
}

// ----- Ops. -----

#[test]
fn elementwise_ops_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(1);

    // fill of a window leaves the rest alone.
    let host = rng.vec(10, 1.0);
    let mut d = up(&gpu, &host);
    gpu.fill(ViewMut::new(&mut d, 3, 4).unwrap(), 2.5).unwrap();
    let mut want = host.clone();
    cpu.fill(ViewMut::new(&mut want, 3, 4).unwrap(), 2.5)
        .unwrap();
    assert_close("fill", &down(&gpu, &d), &want, 0.0);

    // add, swiglu and its backward on views at offsets.
    let n = 1000;
    let (a, b, dy) = (rng.vec(n + 5, 4.0), rng.vec(n, 4.0), rng.vec(n, 1.0));
    let (da, db, ddy) = (up(&gpu, &a), up(&gpu, &b), up(&gpu, &dy));
    let av = |buf| View::new(buf, 5, n).unwrap();
    let mut out_g = gpu.alloc(n + 2).unwrap();
    gpu.add(
        av(&da),
        View::whole(&db),
        ViewMut::new(&mut out_g, 2, n).unwrap(),
    )
    .unwrap();
    let mut out_c = vec![0.0; n];
    cpu.add(
        View::new(&a, 5, n).unwrap(),
        View::whole(&b),
        ViewMut::whole(&mut out_c),
    )
    .unwrap();
    assert_close("add", &down(&gpu, &out_g)[2..], &out_c, 0.0);

    // axpy into a window: the same bits (the product rounded, then the sum)
    let mut y_g = up(&gpu, &b);
    gpu.axpy(0.3, av(&da), ViewMut::whole(&mut y_g)).unwrap();
    let mut y_c = b.clone();
    cpu.axpy(0.3, View::new(&a, 5, n).unwrap(), ViewMut::whole(&mut y_c))
        .unwrap();
    assert_close("axpy", &down(&gpu, &y_g), &y_c, 0.0);

    let mut sg = gpu.alloc(n).unwrap();
    gpu.swiglu(av(&da), View::whole(&db), ViewMut::whole(&mut sg))
        .unwrap();
    let mut sc = vec![0.0; n];
    cpu.swiglu(
        View::new(&a, 5, n).unwrap(),
        View::whole(&b),
        ViewMut::whole(&mut sc),
    )
    .unwrap();
    assert_close("swiglu", &down(&gpu, &sg), &sc, 1e-6);

    let (mut dg_g, mut du_g) = (up(&gpu, &vec![f32::NAN; n]), up(&gpu, &vec![f32::NAN; n]));
    gpu.swiglu_backward(
        View::whole(&ddy),
        av(&da),
        View::whole(&db),
        ViewMut::whole(&mut dg_g),
        ViewMut::whole(&mut du_g),
    )
    .unwrap();
    let (mut dg_c, mut du_c) = (vec![0.0; n], vec![0.0; n]);
    cpu.swiglu_backward(
        View::whole(&dy),
        View::new(&a, 5, n).unwrap(),
        View::whole(&b),
        ViewMut::whole(&mut dg_c),
        ViewMut::whole(&mut du_c),
    )
    .unwrap();
    assert_close("swiglu_backward dgate", &down(&gpu, &dg_g), &dg_c, 1e-6);
    assert_close("swiglu_backward dup", &down(&gpu, &du_g), &du_c, 1e-6);

    // transpose, odd sizes across several 32×32 tiles.
    for (rows, cols) in [(37usize, 70usize), (1, 5), (64, 32)] {
        let src = rng.vec(rows * cols, 1.0);
        let mut t_g = gpu.alloc(rows * cols).unwrap();
        gpu.transpose(
            View::whole(&up(&gpu, &src)),
            rows,
            cols,
            ViewMut::whole(&mut t_g),
        )
        .unwrap();
        let mut t_c = vec![0.0; rows * cols];
        cpu.transpose(View::whole(&src), rows, cols, ViewMut::whole(&mut t_c))
            .unwrap();
        assert_close(
            &format!("transpose {rows}x{cols}"),
            &down(&gpu, &t_g),
            &t_c,
            0.0,
        );
    }

    // RoPE forward and backward (its inverse rotation).
    let (tokens, heads, head_dim) = (5, 3, 16);
    let x = rng.vec(tokens * heads * head_dim, 2.0);
    let (cos, sin) = (
        rng.vec(tokens * head_dim / 2, 1.0),
        rng.vec(tokens * head_dim / 2, 1.0),
    );
    let (dcos, dsin) = (up(&gpu, &cos), up(&gpu, &sin));
    let mut xg = up(&gpu, &x);
    let mut xc = x.clone();
    gpu.rope(
        ViewMut::whole(&mut xg),
        View::whole(&dcos),
        View::whole(&dsin),
        heads,
        head_dim,
    )
    .unwrap();
    cpu.rope(
        ViewMut::whole(&mut xc),
        View::whole(&cos),
        View::whole(&sin),
        heads,
        head_dim,
    )
    .unwrap();
    assert_close("rope", &down(&gpu, &xg), &xc, 0.0);
    gpu.rope_backward(
        ViewMut::whole(&mut xg),
        View::whole(&dcos),
        View::whole(&dsin),
        heads,
        head_dim,
    )
    .unwrap();
    cpu.rope_backward(
        ViewMut::whole(&mut xc),
        View::whole(&cos),
        View::whole(&sin),
        heads,
        head_dim,
    )
    .unwrap();
    assert_close("rope_backward", &down(&gpu, &xg), &xc, 0.0);

    // Argument errors come back from the op, naming it.
    let e = gpu
        .add(
            av(&da),
            View::new(&db, 0, n - 1).unwrap(),
            ViewMut::new(&mut out_g, 0, n).unwrap(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("add b"), "{e}");
    let e = gpu
        .rope(
            ViewMut::whole(&mut xg),
            View::whole(&dcos),
            View::whole(&dsin),
            heads,
            15,
        )
        .unwrap_err();
    assert!(e.to_string().starts_with("rope: head_dim = 15"), "{e}");
}

#[test]
fn embedding_matches_cpu_and_reports_bad_ids() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(2);
    let (rows, dim, tokens) = (50usize, 40usize, 300usize);
    let table = rng.vec(rows * dim, 1.0);
    // Few distinct ids, so most repeat many times (the owner/duplicate scan).
    let ids = rng
        .ids(tokens, 7)
        .iter()
        .map(|&i| i * 7)
        .collect::<Vec<_>>();
    let (dtable, dids) = (up(&gpu, &table), up_ids(&gpu, &ids));

    let mut out_g = gpu.alloc(tokens * dim).unwrap();
    gpu.embedding(
        &dids,
        View::whole(&dtable),
        rows,
        dim,
        ViewMut::whole(&mut out_g),
    )
    .unwrap();
    let mut out_c = vec![0.0; tokens * dim];
    cpu.embedding(
        &ids,
        View::whole(&table),
        rows,
        dim,
        ViewMut::whole(&mut out_c),
    )
    .unwrap();
    assert_close("embedding", &down(&gpu, &out_g), &out_c, 0.0);

    // Backward accumulates into a prior, in token order: bit for bit the CPU's sums.
    let dout = rng.vec(tokens * dim, 1.0);
    let prior = rng.vec(rows * dim, 1.0);
    let mut grad_g = up(&gpu, &prior);
    gpu.embedding_backward(
        &dids,
        View::whole(&up(&gpu, &dout)),
        rows,
        dim,
        ViewMut::whole(&mut grad_g),
    )
    .unwrap();
    let mut grad_c = prior.clone();
    cpu.embedding_backward(
        &ids,
        View::whole(&dout),
        rows,
        dim,
        ViewMut::whole(&mut grad_c),
    )
    .unwrap();
    assert_close("embedding_backward", &down(&gpu, &grad_g), &grad_c, 0.0);

    // An id >= rows: NaN row, reported at the next waiting call, then cleared.
    let bad = up_ids(&gpu, &[3, 50, 1]);
    let mut out = gpu.alloc(3 * dim).unwrap();
    gpu.embedding(
        &bad,
        View::whole(&dtable),
        rows,
        dim,
        ViewMut::whole(&mut out),
    )
    .unwrap();
    let mut host = vec![0.0; 3 * dim];
    let e = gpu.download(View::whole(&out), &mut host).unwrap_err();
    assert!(
        e.to_string().contains("token id is >= the table's rows"),
        "{e}"
    );
    assert!(host[dim..2 * dim].iter().all(|x| x.is_nan()));
    assert_eq!(host[..dim], table[3 * dim..4 * dim]);
    gpu.synchronize().unwrap();
}

/// The linear layers in every [`MatmulPrecision`] against the CPU's emulation of it (the
/// same rounded operands, so bf16 agrees as closely as f32: only the order of the f32 sums
/// differs). TF32 gets a looser bound: cuBLAS does not document how it rounds to TF32, and
/// the CPU rounds to nearest even, so an operand may differ in its last TF32 bit.
#[test]
fn linear_matches_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(3);
    // Products of 64 rows or more run in bf16 under `Bf16`; fewer rows fall back to f32.
    let shapes = [
        (33usize, 70usize, 45usize),
        (1, 64, 129),
        (16, 1, 3),
        (5, 0, 4),
        (100, 70, 45),
        (64, 33, 129),
    ];
    let precisions = [
        (MatmulPrecision::F32, 1e-5),
        (MatmulPrecision::Tf32, 5e-3),
        (MatmulPrecision::Bf16, 2e-5),
    ];
    // biased products take cuBLASLt's epilogue where it has an algorithm (ares-cuda's
    // `gemm_lt.rs`); the rest multiply, then add the bias
    let epilogues_before = gpu.ops().bias_epilogues();
    for ((rows, inp, out), (precision, tol)) in shapes
        .into_iter()
        .flat_map(|s| precisions.into_iter().map(move |p| (s, p)))
    {
        let dims = LinearDims {
            rows,
            in_features: inp,
            out_features: out,
            precision,
        };
        let what = |op: &str| format!("{op} {rows}x{inp}->{out} {}", precision.name());
        let x = rng.vec(rows * inp, 1.0);
        // Two weights in one buffer: the second is used through a view at an offset.
        let w2 = rng.vec(2 * out * inp, 1.0);
        let w = w2[out * inp..].to_vec();
        let bias = rng.vec(out, 1.0);
        let (dx_, dw2, db) = (up(&gpu, &x), up(&gpu, &w2), up(&gpu, &bias));
        let wv = || View::item(&dw2, 1, out * inp).unwrap();
        for with_bias in [false, true] {
            let bg = with_bias.then(|| View::whole(&db));
            let bc = with_bias.then(|| View::whole(&bias));
            let mut yg = up(&gpu, &vec![f32::NAN; rows * out]);
            gpu.linear(View::whole(&dx_), wv(), bg, dims, ViewMut::whole(&mut yg))
                .unwrap();
            let mut yc = vec![0.0; rows * out];
            cpu.linear(
                View::whole(&x),
                View::whole(&w),
                bc,
                dims,
                ViewMut::whole(&mut yc),
            )
            .unwrap();
            assert_close(&what("linear"), &down(&gpu, &yg), &yc, tol);

            // The transposed weight, made on the GPU.
            let mut wt = gpu.alloc(out * inp).unwrap();
            gpu.transpose(wv(), out, inp, ViewMut::whole(&mut wt))
                .unwrap();
            let mut yt = up(&gpu, &vec![f32::NAN; rows * out]);
            gpu.linear_transposed(
                View::whole(&dx_),
                View::whole(&wt),
                bg,
                dims,
                ViewMut::whole(&mut yt),
            )
            .unwrap();
            assert_close(&what("linear_transposed"), &down(&gpu, &yt), &yc, tol);

            // The f32 decode layout, each backend's own (CPU column tiles, CUDA row-major).
            let mut wd = gpu.alloc(out * inp).unwrap();
            gpu.pack_decode_f32(View::whole(&wt), inp, out, ViewMut::whole(&mut wd))
                .unwrap();
            let mut yd = up(&gpu, &vec![f32::NAN; rows * out]);
            gpu.linear_decode_f32(
                View::whole(&dx_),
                View::whole(&wd),
                bg,
                dims,
                ViewMut::whole(&mut yd),
            )
            .unwrap();
            let mut wtc = vec![0.0f32; out * inp];
            cpu.transpose(View::whole(&w), out, inp, ViewMut::whole(&mut wtc))
                .unwrap();
            let mut wdc = vec![0.0f32; out * inp];
            cpu.pack_decode_f32(View::whole(&wtc), inp, out, ViewMut::whole(&mut wdc))
                .unwrap();
            let mut ydc = vec![0.0f32; rows * out];
            cpu.linear_decode_f32(
                View::whole(&x),
                View::whole(&wdc),
                bc,
                dims,
                ViewMut::whole(&mut ydc),
            )
            .unwrap();
            assert_close(&what("linear_decode_f32 (cpu)"), &ydc, &yc, tol);
            assert_close(&what("linear_decode_f32"), &down(&gpu, &yd), &ydc, tol);
        }

        // Backward: all three accumulate into priors; dx and dbias optional.
        let dy = rng.vec(rows * out, 1.0);
        let (pdx, pdw, pdb) = (
            rng.vec(rows * inp, 1.0),
            rng.vec(out * inp, 1.0),
            rng.vec(out, 1.0),
        );
        let ddy = up(&gpu, &dy);
        // (dx and dbias given, dw given, how dx is written): every gradient, the weight's
        // alone, a frozen weight's (dw None: left as it was), and dx overwritten (cuBLAS
        // β = 0: the NaNs it held are not read)
        let (nan_dx, nan_dw) = (vec![f32::NAN; pdx.len()], vec![f32::NAN; pdw.len()]);
        let both = GradWrites {
            dx: GradWrite::Overwrite,
            dw: GradWrite::Overwrite,
        };
        for (with_optional, with_dw, write) in [
            (true, true, GradWrites::ACCUMULATE),
            (false, true, GradWrites::ACCUMULATE),
            (true, false, GradWrites::ACCUMULATE),
            (true, true, GradWrites::dx(GradWrite::Overwrite)),
            (true, true, both),
        ] {
            let pdx = if write.dx == GradWrite::Overwrite {
                &nan_dx
            } else {
                &pdx
            };
            let pdw = if write.dw == GradWrite::Overwrite {
                &nan_dw
            } else {
                &pdw
            };
            let (mut gdx, mut gdw, mut gdb) = (up(&gpu, pdx), up(&gpu, pdw), up(&gpu, &pdb));
            gpu.linear_backward(
                View::whole(&ddy),
                View::whole(&dx_),
                wv(),
                dims,
                write,
                with_optional.then(|| ViewMut::whole(&mut gdx)),
                with_dw.then(|| ViewMut::whole(&mut gdw)),
                with_optional.then(|| ViewMut::whole(&mut gdb)),
            )
            .unwrap();
            let (mut cdx, mut cdw, mut cdb) = (pdx.clone(), pdw.clone(), pdb.clone());
            cpu.linear_backward(
                View::whole(&dy),
                View::whole(&x),
                View::whole(&w),
                dims,
                write,
                with_optional.then(|| ViewMut::whole(&mut cdx)),
                with_dw.then(|| ViewMut::whole(&mut cdw)),
                with_optional.then(|| ViewMut::whole(&mut cdb)),
            )
            .unwrap();
            assert_close(&what("linear_backward dx"), &down(&gpu, &gdx), &cdx, tol);
            assert_close(&what("linear_backward dw"), &down(&gpu, &gdw), &cdw, tol);
            if !with_dw {
                assert_eq!(&cdw, pdw, "a frozen weight's gradient is left alone");
            }
            assert_close(
                &what("linear_backward dbias"),
                &down(&gpu, &gdb),
                &cdb,
                1e-5,
            );
        }
    }
    let epilogues = gpu.ops().bias_epilogues();
    eprintln!("linear_matches_cpu: bias epilogues {epilogues_before:?} -> {epilogues:?}");
    if let (Some(before), Some(after)) = (epilogues_before, epilogues) {
        assert!(after > before, "no biased product took cuBLASLt's epilogue");
    }
}

/// Stored bf16 weights (`linear_bf16`, `linear_backward_bf16`, a model's bf16 copies): the
/// GPU's products equal the CPU's over the same bf16 operands (only the sum order differs),
/// and from 64 rows on equal the bf16 products over the f32 weight they were rounded from.
#[test]
fn stored_bf16_weight_products_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(21);
    for (rows, inp, out) in [(64usize, 70usize, 45usize), (100, 33, 129), (3, 64, 96)] {
        let dims = LinearDims {
            rows,
            in_features: inp,
            out_features: out,
            precision: MatmulPrecision::Bf16,
        };
        let what = |op: &str| format!("{op} {rows}x{inp}->{out}");
        let (x, w, bias) = (
            rng.vec(rows * inp, 1.0),
            rng.vec(out * inp, 1.0),
            rng.vec(out, 1.0),
        );
        let (gx, gwf, gb) = (up(&gpu, &x), up(&gpu, &w), up(&gpu, &bias));
        let mut gw = gpu.alloc_half(out * inp, DType::Bf16).unwrap();
        gpu.round_bf16(View::whole(&gwf), ViewMut::whole(&mut gw))
            .unwrap();
        let mut cw = cpu.alloc_half(out * inp, DType::Bf16).unwrap();
        cpu.round_bf16(View::whole(&w), ViewMut::whole(&mut cw))
            .unwrap();
        let mut gbits = vec![0u16; out * inp];
        gpu.download_half(View::whole(&gw), &mut gbits).unwrap();
        assert_eq!(gbits, cw.bits(), "{}: the copies", what("round_bf16"));
        let mut yg = up(&gpu, &vec![f32::NAN; rows * out]);
        gpu.linear_bf16(
            View::whole(&gx),
            View::whole(&gw),
            Some(View::whole(&gb)),
            dims,
            ViewMut::whole(&mut yg),
        )
        .unwrap();
        let mut yc = vec![0.0; rows * out];
        cpu.linear_bf16(
            View::whole(&x),
            View::whole(&cw),
            Some(View::whole(&bias)),
            dims,
            ViewMut::whole(&mut yc),
        )
        .unwrap();
        assert_close(&what("linear_bf16"), &down(&gpu, &yg), &yc, 2e-5);
        if rows >= 64 {
            let mut yf = up(&gpu, &vec![f32::NAN; rows * out]);
            gpu.linear(
                View::whole(&gx),
                View::whole(&gwf),
                Some(View::whole(&gb)),
                dims,
                ViewMut::whole(&mut yf),
            )
            .unwrap();
            assert_close(
                &what("linear_bf16 vs f32 w"),
                &down(&gpu, &yg),
                &down(&gpu, &yf),
                2e-5,
            );
        }
        let dy = rng.vec(rows * out, 1.0);
        let (pdx, pdw, pdb) = (
            rng.vec(rows * inp, 1.0),
            rng.vec(out * inp, 1.0),
            rng.vec(out, 1.0),
        );
        let (mut gdx, mut gdw, mut gdb) = (up(&gpu, &pdx), up(&gpu, &pdw), up(&gpu, &pdb));
        gpu.linear_backward_bf16(
            View::whole(&up(&gpu, &dy)),
            View::whole(&gx),
            View::whole(&gw),
            dims,
            GradWrites::ACCUMULATE,
            Some(ViewMut::whole(&mut gdx)),
            Some(ViewMut::whole(&mut gdw)),
            Some(ViewMut::whole(&mut gdb)),
        )
        .unwrap();
        let (mut cdx, mut cdw, mut cdb) = (pdx.clone(), pdw.clone(), pdb.clone());
        cpu.linear_backward_bf16(
            View::whole(&dy),
            View::whole(&x),
            View::whole(&cw),
            dims,
            GradWrites::ACCUMULATE,
            Some(ViewMut::whole(&mut cdx)),
            Some(ViewMut::whole(&mut cdw)),
            Some(ViewMut::whole(&mut cdb)),
        )
        .unwrap();
        assert_close(
            &what("linear_backward_bf16 dx"),
            &down(&gpu, &gdx),
            &cdx,
            2e-5,
        );
        assert_close(
            &what("linear_backward_bf16 dw"),
            &down(&gpu, &gdw),
            &cdw,
            2e-5,
        );
        assert_close(
            &what("linear_backward_bf16 db"),
            &down(&gpu, &gdb),
            &cdb,
            1e-5,
        );
    }
    // The model: bf16 products with and without the copies, on the GPU and against the CPU.
    let (mut cpu_model, mut gpu_model) = models(&gpu, "qwen2_tiny");
    cpu_model.set_matmul_precision(MatmulPrecision::Bf16);
    gpu_model.set_matmul_precision(MatmulPrecision::Bf16);
    let s = Set::load("qwen2_tiny", "right");
    let rounded = gpu_model.forward_logits(&s.inputs()).unwrap();
    gpu_model.set_bf16_weights(true).unwrap();
    let stored = gpu_model.forward_logits(&s.inputs()).unwrap();
    let cpu_logits = cpu_model.forward_logits(&s.inputs()).unwrap();
    assert_close(
        "qwen2_tiny bf16 logits, copies vs none",
        &stored,
        &rounded,
        1e-5,
    );
    assert_close(
        "qwen2_tiny bf16 logits, GPU copies vs CPU",
        &stored,
        &cpu_logits,
        1e-4,
    );
    // bf16 decode weights are then the copies themselves (no second copy), and generate as
    // a decode copy of the same bf16 values does (only GEMM sum orders differ)
    let (_, mut packed_model) = models(&gpu, "qwen2_tiny");
    packed_model.set_matmul_precision(MatmulPrecision::Bf16);
    let text = std::fs::read_to_string(fixture("qwen2_tiny").join("greedy.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let request = GenerateRequest {
        prompts: serde_json::from_value(doc["prompts"].clone()).unwrap(),
        max_new_tokens: 8,
        eos_ids: Vec::new(),
        sampling: Sampling::Greedy,
        seed: 0,
    };
    let shared = gpu_model.generator_with(WeightDtype::Bf16).unwrap();
    let packed = packed_model.generator_with(WeightDtype::Bf16).unwrap();
    let (a, b) = (
        shared.generate(&request).unwrap(),
        packed.generate(&request).unwrap(),
    );
    assert_eq!(a.tokens, b.tokens, "bf16 decode: copies vs a decode copy");
    assert_close(
        "bf16 decode log-probs: copies vs a decode copy",
        &a.log_probs.concat(),
        &b.log_probs.concat(),
        1e-4,
    );
}

/// bf16 decode weights: each backend packs `[in, out]` weights in its own layout, and the
/// products agree within bf16 rounding (CUDA also rounds `x` to bf16; the CPU keeps it f32).
#[test]
fn bf16_weight_products_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(12);
    for (rows, inp, out) in [(1usize, 64usize, 96usize), (8, 128, 70), (20, 33, 64)] {
        let dims = LinearDims {
            rows,
            in_features: inp,
            out_features: out,
            precision: MatmulPrecision::F32,
        };
        let (x, wt, bias) = (
            rng.vec(rows * inp, 1.0),
            rng.vec(inp * out, 1.0),
            rng.vec(out, 1.0),
        );
        let mut gw = gpu.alloc_half(inp * out, DType::Bf16).unwrap();
        gpu.pack_bf16(
            View::whole(&up(&gpu, &wt)),
            inp,
            out,
            ViewMut::whole(&mut gw),
        )
        .unwrap();
        let mut cw = cpu.alloc_half(inp * out, DType::Bf16).unwrap();
        cpu.pack_bf16(View::whole(&wt), inp, out, ViewMut::whole(&mut cw))
            .unwrap();
        let (gx, gb) = (up(&gpu, &x), up(&gpu, &bias));
        let mut yg = up(&gpu, &vec![f32::NAN; rows * out]);
        gpu.linear_transposed_bf16(
            View::whole(&gx),
            View::whole(&gw),
            Some(View::whole(&gb)),
            dims,
            ViewMut::whole(&mut yg),
        )
        .unwrap();
        let mut yc = vec![0.0; rows * out];
        cpu.linear_transposed_bf16(
            View::whole(&x),
            View::whole(&cw),
            Some(View::whole(&bias)),
            dims,
            ViewMut::whole(&mut yc),
        )
        .unwrap();
        // |error| of bf16 x: 2^-9 relative per term, over `inp` terms of size ~1
        let tol = 0.01 * (inp as f32).sqrt();
        let got = down(&gpu, &yg);
        for (i, (g, c)) in got.iter().zip(&yc).enumerate() {
            assert!(
                (g - c).abs() <= tol,
                "{rows}x{inp}->{out} [{i}]: {g} vs {c}"
            );
        }
    }
    // an f16 buffer where the op takes bf16: the CPU backend's error, before any launch
    let mut f16 = gpu.alloc_half(4, DType::F16).unwrap();
    let src = up(&gpu, &[1.0, 2.0, 3.0, 4.0]);
    let e = gpu
        .pack_bf16(View::whole(&src), 2, 2, ViewMut::whole(&mut f16))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "pack_bf16: `dst` holds f16, the op takes bf16"
    );
}

#[test]
fn rmsnorm_matches_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(4);
    // The last shape makes the weight gradient's column sum span many chunks.
    for (rows, dim) in [(7usize, 100usize), (3, 1), (2000, 12)] {
        let what = |op: &str| format!("{op} {rows}x{dim}");
        let x = rng.vec(rows * dim, 3.0);
        let w = rng.vec(dim, 2.0);
        let (dx_, dw_) = (up(&gpu, &x), up(&gpu, &w));
        let (mut og, mut rg) = (gpu.alloc(rows * dim).unwrap(), gpu.alloc(rows).unwrap());
        gpu.rmsnorm(
            View::whole(&dx_),
            View::whole(&dw_),
            1e-6,
            dim,
            ViewMut::whole(&mut og),
            ViewMut::whole(&mut rg),
        )
        .unwrap();
        let (mut oc, mut rc) = (vec![0.0; rows * dim], vec![0.0; rows]);
        cpu.rmsnorm(
            View::whole(&x),
            View::whole(&w),
            1e-6,
            dim,
            ViewMut::whole(&mut oc),
            ViewMut::whole(&mut rc),
        )
        .unwrap();
        assert_close(&what("rmsnorm out"), &down(&gpu, &og), &oc, 1e-6);
        assert_close(&what("rmsnorm rstd"), &down(&gpu, &rg), &rc, 1e-6);

        // The fused add + norm: on each backend the bits of its add then its norm.
        let b = rng.vec(rows * dim, 3.0);
        let db = up(&gpu, &b);
        let mut gsum = gpu.alloc(rows * dim).unwrap();
        gpu.add(
            View::whole(&dx_),
            View::whole(&db),
            ViewMut::whole(&mut gsum),
        )
        .unwrap();
        let (mut og2, mut rg2) = (gpu.alloc(rows * dim).unwrap(), gpu.alloc(rows).unwrap());
        gpu.rmsnorm(
            View::whole(&gsum),
            View::whole(&dw_),
            1e-6,
            dim,
            ViewMut::whole(&mut og2),
            ViewMut::whole(&mut rg2),
        )
        .unwrap();
        let mut fused = [
            gpu.alloc(rows * dim).unwrap(),
            gpu.alloc(rows * dim).unwrap(),
            gpu.alloc(rows).unwrap(),
        ];
        let [fs, fo, fr] = &mut fused;
        gpu.add_rmsnorm(
            View::whole(&dx_),
            View::whole(&db),
            View::whole(&dw_),
            1e-6,
            dim,
            ViewMut::whole(fs),
            ViewMut::whole(fo),
            ViewMut::whole(fr),
        )
        .unwrap();
        assert_close(
            &what("add_rmsnorm sum"),
            &down(&gpu, fs),
            &down(&gpu, &gsum),
            0.0,
        );
        assert_close(
            &what("add_rmsnorm out"),
            &down(&gpu, fo),
            &down(&gpu, &og2),
            0.0,
        );
        assert_close(
            &what("add_rmsnorm rstd"),
            &down(&gpu, fr),
            &down(&gpu, &rg2),
            0.0,
        );
        let (mut cs, mut co2, mut cr2) = (
            vec![0.0; rows * dim],
            vec![0.0; rows * dim],
            vec![0.0; rows],
        );
        cpu.add_rmsnorm(
            View::whole(&x),
            View::whole(&b),
            View::whole(&w),
            1e-6,
            dim,
            ViewMut::whole(&mut cs),
            ViewMut::whole(&mut co2),
            ViewMut::whole(&mut cr2),
        )
        .unwrap();
        assert_close(&what("add_rmsnorm out vs CPU"), &down(&gpu, fo), &co2, 1e-6);

        let dy = rng.vec(rows * dim, 1.0);
        let (pdx, pdw) = (rng.vec(rows * dim, 1.0), rng.vec(dim, 1.0));
        let (mut gdx, mut gdw) = (up(&gpu, &pdx), up(&gpu, &pdw));
        gpu.rmsnorm_backward(
            View::whole(&up(&gpu, &dy)),
            View::whole(&dx_),
            View::whole(&dw_),
            View::whole(&rg),
            dim,
            ViewMut::whole(&mut gdx),
            Some(ViewMut::whole(&mut gdw)),
        )
        .unwrap();
        let (mut cdx, mut cdw) = (pdx.clone(), pdw.clone());
        cpu.rmsnorm_backward(
            View::whole(&dy),
            View::whole(&x),
            View::whole(&w),
            View::whole(&rc),
            dim,
            ViewMut::whole(&mut cdx),
            Some(ViewMut::whole(&mut cdw)),
        )
        .unwrap();
        assert_close(&what("rmsnorm_backward dx"), &down(&gpu, &gdx), &cdx, 1e-5);
        assert_close(
            &what("rmsnorm_backward dweight"),
            &down(&gpu, &gdw),
            &cdw,
            1e-5,
        );
        // a frozen weight: dx alone, the same as with dweight
        let mut gdx2 = up(&gpu, &pdx);
        gpu.rmsnorm_backward(
            View::whole(&up(&gpu, &dy)),
            View::whole(&dx_),
            View::whole(&dw_),
            View::whole(&rg),
            dim,
            ViewMut::whole(&mut gdx2),
            None,
        )
        .unwrap();
        assert_close(
            &what("rmsnorm_backward frozen dx"),
            &down(&gpu, &gdx2),
            &down(&gpu, &gdx),
            0.0,
        );
    }
}

/// A key mask `[batch, seq]`: sequence 0 right-padded (its last `pad` tokens), the others
/// left-padded (their first `pad` tokens), so some queries have no valid key.
fn padding_mask(batch: usize, seq: usize, pad: usize) -> Vec<f32> {
    (0..batch * seq)
        .map(|i| {
            let (b, t) = (i / seq, i % seq);
            let valid = if b == 0 { t < seq - pad } else { t >= pad };
            if valid { 1.0 } else { 0.0 }
        })
        .collect()
}

#[test]
fn attention_forward_and_backward_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(5);
    // Every head-size class (≤ 64, ≤ 128, ≤ 256, partial warps of dims), GQA and MHA,
    // sequences across several key tiles of 32.
    for (batch, seq, hq, hkv, d) in [
        (2usize, 5usize, 4usize, 2usize, 8usize),
        (2, 70, 6, 2, 64),
        (2, 40, 2, 1, 96),
        (1, 33, 4, 4, 128),
        (2, 9, 2, 1, 256),
    ] {
        let dims = AttentionDims::new(batch, seq, hq, hkv, d);
        let what = |op: &str| format!("{op} b{batch} t{seq} hq{hq} hkv{hkv} d{d}");
        let (qn, kn, ln) = (
            batch * seq * hq * d,
            batch * seq * hkv * d,
            batch * seq * hq,
        );
        let (q, k, v) = (rng.vec(qn, 1.0), rng.vec(kn, 1.0), rng.vec(kn, 1.0));
        let mask = padding_mask(batch, seq, 2.min(seq - 1));
        let (gq, gk, gv, gm) = (up(&gpu, &q), up(&gpu, &k), up(&gpu, &v), up(&gpu, &mask));
        for masked in [true, false] {
            let gin = || AttentionInputs {
                q: View::whole(&gq),
                k: View::whole(&gk),
                v: View::whole(&gv),
                key_mask: masked.then(|| View::whole(&gm)),
            };
            let cin = || AttentionInputs {
                q: View::whole(&q),
                k: View::whole(&k),
                v: View::whole(&v),
                key_mask: masked.then(|| View::whole(&mask)),
            };
            let (mut go, mut gl) = (up(&gpu, &vec![f32::NAN; qn]), up(&gpu, &vec![f32::NAN; ln]));
            gpu.attention(
                dims,
                gin(),
                None,
                ViewMut::whole(&mut go),
                ViewMut::whole(&mut gl),
            )
            .unwrap();
            let (mut co, mut cl) = (vec![0.0; qn], vec![0.0; ln]);
            cpu.attention(
                dims,
                cin(),
                None,
                ViewMut::whole(&mut co),
                ViewMut::whole(&mut cl),
            )
            .unwrap();
            let m = if masked { " masked" } else { "" };
            assert_close(
                &what(&format!("attention out{m}")),
                &down(&gpu, &go),
                &co,
                1e-4,
            );
            assert_close(
                &what(&format!("attention lse{m}")),
                &down(&gpu, &gl),
                &cl,
                1e-4,
            );

            let dout = rng.vec(qn, 1.0);
            let (mut gdq, mut gdk, mut gdv) = (
                up(&gpu, &vec![f32::NAN; qn]),
                up(&gpu, &vec![f32::NAN; kn]),
                up(&gpu, &vec![f32::NAN; kn]),
            );
            gpu.attention_backward(
                dims,
                gin(),
                None,
                View::whole(&go),
                View::whole(&gl),
                View::whole(&up(&gpu, &dout)),
                AttentionGrads {
                    dq: ViewMut::whole(&mut gdq),
                    dk: ViewMut::whole(&mut gdk),
                    dv: ViewMut::whole(&mut gdv),
                },
            )
            .unwrap();
            let (mut cdq, mut cdk, mut cdv) = (vec![0.0; qn], vec![0.0; kn], vec![0.0; kn]);
            cpu.attention_backward(
                dims,
                cin(),
                None,
                View::whole(&co),
                View::whole(&cl),
                View::whole(&dout),
                AttentionGrads {
                    dq: ViewMut::whole(&mut cdq),
                    dk: ViewMut::whole(&mut cdk),
                    dv: ViewMut::whole(&mut cdv),
                },
            )
            .unwrap();
            assert_close(
                &what(&format!("attention dq{m}")),
                &down(&gpu, &gdq),
                &cdq,
                1e-4,
            );
            assert_close(
                &what(&format!("attention dk{m}")),
                &down(&gpu, &gdk),
                &cdk,
                1e-4,
            );
            assert_close(
                &what(&format!("attention dv{m}")),
                &down(&gpu, &gdv),
                &cdv,
                1e-4,
            );
        }
    }
    // A mask value other than 0/1 is reported at the next waiting call.
    let dims = AttentionDims::new(1, 3, 1, 1, 4);
    let (q, mask) = (up(&gpu, &[0.5; 12]), up(&gpu, &[1.0, 0.5, 1.0]));
    let (mut o, mut l) = (gpu.alloc(12).unwrap(), gpu.alloc(3).unwrap());
    let inputs = AttentionInputs {
        q: View::whole(&q),
        k: View::whole(&q),
        v: View::whole(&q),
        key_mask: Some(View::whole(&mask)),
    };
    gpu.attention(
        dims,
        inputs,
        None,
        ViewMut::whole(&mut o),
        ViewMut::whole(&mut l),
    )
    .unwrap();
    let e = gpu.synchronize().unwrap_err();
    assert!(e.to_string().contains("key mask value"), "{e}");
}

/// A tensor-core kernel's output against its CPU twin's: every element within `worst` of
/// the largest magnitude, 99 % of them within 1e-4 of it — the twin rounds the same
/// operands at the same tiles, so only f32 sum order differs, and that moves a bf16 rounding
/// now and then (reordering the twin's own sums moves 0.04–0.2 % of the elements past 1e-5).
fn assert_twin(label: &str, got: &[f32], want: &[f32], worst: f32) {
    let scale = want.iter().fold(0.0f32, |a, x| a.max(x.abs())).max(1e-6);
    let (mut near, mut far) = (0usize, 0.0f32);
    for (x, y) in got.iter().zip(want) {
        let e = (x - y).abs();
        far = far.max(if e.is_nan() { f32::INFINITY } else { e });
        near += usize::from(e <= 1e-4 * scale);
    }
    assert!(far <= worst * scale, "{label}: worst {far} of {scale}");
    assert!(
        near * 100 >= 99 * got.len(),
        "{label}: {near} of {} within 1e-4",
        got.len()
    );
}

/// The tensor-core forward against its CPU twin at each head size it takes: the same bf16
/// operands, tiles and exp, so the scores differ by the order of f32 sums only. That moves
/// a probability across a bf16 rounding boundary now and then (one step of 2⁻⁸ relative in
/// one term: ≤ 5e-3 here), so the bound is two-fold: every element within 5e-3, 99 % of
/// them within 1e-5; the log-sum-exp, which sums unrounded probabilities, within 1e-5.
/// A GPU that took another tile size or rescaled otherwise would fail the 99 % bound. The
/// backward likewise, below.
#[test]
fn tensor_core_attention_matches_its_cpu_twin() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(55);
    for (batch, seq, hq, hkv, d) in [
        (2usize, 150usize, 6usize, 2usize, 64usize),
        (1, 64, 4, 4, 64),
        (2, 97, 16, 16, 80),
        (2, 130, 4, 1, 128),
        (1, 1, 2, 1, 128),
    ] {
        let dims = AttentionDims::new(batch, seq, hq, hkv, d);
        let what = |op: &str| format!("{op} b{batch} t{seq} hq{hq} hkv{hkv} d{d}");
        let (qn, kn, ln) = (
            batch * seq * hq * d,
            batch * seq * hkv * d,
            batch * seq * hq,
        );
        let (q, k, v) = (rng.vec(qn, 2.0), rng.vec(kn, 2.0), rng.vec(kn, 1.0));
        let mask = padding_mask(batch, seq, 3.min(seq - 1));
        let (gq, gk, gv, gm) = (up(&gpu, &q), up(&gpu, &k), up(&gpu, &v), up(&gpu, &mask));
        for masked in [true, false] {
            let (mut go, mut gl) = (up(&gpu, &vec![f32::NAN; qn]), up(&gpu, &vec![f32::NAN; ln]));
            gpu.attention_bf16(
                dims,
                AttentionInputs {
                    q: View::whole(&gq),
                    k: View::whole(&gk),
                    v: View::whole(&gv),
                    key_mask: masked.then(|| View::whole(&gm)),
                },
                None,
                ViewMut::whole(&mut go),
                ViewMut::whole(&mut gl),
            )
            .unwrap();
            let (mut co, mut cl) = (vec![0.0; qn], vec![0.0; ln]);
            cpu.attention_bf16(
                dims,
                AttentionInputs {
                    q: View::whole(&q),
                    k: View::whole(&k),
                    v: View::whole(&v),
                    key_mask: masked.then(|| View::whole(&mask)),
                },
                None,
                ViewMut::whole(&mut co),
                ViewMut::whole(&mut cl),
            )
            .unwrap();
            let m = if masked { " masked" } else { "" };
            let got = down(&gpu, &go);
            assert_close(&what(&format!("bf16 attention out{m}")), &got, &co, 5e-3);
            let near = got
                .iter()
                .zip(&co)
                .filter(|(g, c)| (*g - *c).abs() <= 1e-5)
                .count();
            assert!(
                near * 100 >= 99 * qn,
                "{}: only {near} of {qn} within 1e-5",
                what("bf16 attention out")
            );
            let lse = down(&gpu, &gl);
            for (i, (g, c)) in lse.iter().zip(&cl).enumerate() {
                let same = g.to_bits() == c.to_bits() || (g - c).abs() <= 1e-5 * c.abs().max(1.0);
                assert!(same, "{}: lse[{i}] {g} vs {c}", what("bf16 attention"));
            }

            // The backward from each side's own forward (the same out and lse up to the
            // bounds above): gradients within 2e-3 of their largest magnitude, 99 % within
            // 1e-4 (reordering the twin's sums moves 0.1-0.2 % past 1e-5).
            let dout = rng.vec(qn, 1.0);
            let (mut gdq, mut gdk, mut gdv) = (
                up(&gpu, &vec![f32::NAN; qn]),
                up(&gpu, &vec![f32::NAN; kn]),
                up(&gpu, &vec![f32::NAN; kn]),
            );
            gpu.attention_backward_bf16(
                dims,
                AttentionInputs {
                    q: View::whole(&gq),
                    k: View::whole(&gk),
                    v: View::whole(&gv),
                    key_mask: masked.then(|| View::whole(&gm)),
                },
                None,
                View::whole(&go),
                View::whole(&gl),
                View::whole(&up(&gpu, &dout)),
                AttentionGrads {
                    dq: ViewMut::whole(&mut gdq),
                    dk: ViewMut::whole(&mut gdk),
                    dv: ViewMut::whole(&mut gdv),
                },
            )
            .unwrap();
            let (mut cdq, mut cdk, mut cdv) = (vec![0.0; qn], vec![0.0; kn], vec![0.0; kn]);
            cpu.attention_backward_bf16(
                dims,
                AttentionInputs {
                    q: View::whole(&q),
                    k: View::whole(&k),
                    v: View::whole(&v),
                    key_mask: masked.then(|| View::whole(&mask)),
                },
                None,
                View::whole(&co),
                View::whole(&cl),
                View::whole(&dout),
                AttentionGrads {
                    dq: ViewMut::whole(&mut cdq),
                    dk: ViewMut::whole(&mut cdk),
                    dv: ViewMut::whole(&mut cdv),
                },
            )
            .unwrap();
            for (name, g, c) in [("dq", &gdq, &cdq), ("dk", &gdk, &cdk), ("dv", &gdv, &cdv)] {
                let label = what(&format!("bf16 attention {name}{m}"));
                assert_twin(&label, &down(&gpu, g), c, 2e-3);
            }

            // q, k, v stored in bf16 (activation dtype bf16): the kernels read the bits
            // where they rounded the f32 values — the same outputs, bit for bit
            let half = |x: &[f32]| up_bf16(&gpu, x);
            let (hq16, hk16, hv16) = (half(&q), half(&k), half(&v));
            let key_mask = masked.then(|| View::whole(&gm));
            let (mut so, mut sl) = (up(&gpu, &vec![f32::NAN; qn]), up(&gpu, &vec![f32::NAN; ln]));
            gpu.attention_bf16_stored(
                dims,
                View::whole(&hq16),
                View::whole(&hk16),
                View::whole(&hv16),
                key_mask,
                None,
                Some(ViewMut::whole(&mut so)),
                None,
                ViewMut::whole(&mut sl),
            )
            .unwrap();
            let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            let label = what(&format!("bf16-stored attention{m}"));
            assert_eq!(bits(down(&gpu, &so)), bits(down(&gpu, &go)), "{label}: out");
            assert_eq!(bits(down(&gpu, &sl)), bits(down(&gpu, &gl)), "{label}: lse");
            let (mut sdq, mut sdk, mut sdv) = (
                up(&gpu, &vec![f32::NAN; qn]),
                up(&gpu, &vec![f32::NAN; kn]),
                up(&gpu, &vec![f32::NAN; kn]),
            );
            gpu.attention_backward_bf16_stored(
                dims,
                View::whole(&hq16),
                View::whole(&hk16),
                View::whole(&hv16),
                key_mask,
                None,
                Some(View::whole(&go)),
                None,
                View::whole(&gl),
                View::whole(&up(&gpu, &dout)),
                AttentionGrads {
                    dq: ViewMut::whole(&mut sdq),
                    dk: ViewMut::whole(&mut sdk),
                    dv: ViewMut::whole(&mut sdv),
                },
            )
            .unwrap();
            for (name, s16, g) in [("dq", &sdq, &gdq), ("dk", &sdk, &gdk), ("dv", &sdv, &gdv)] {
                assert_eq!(
                    bits(down(&gpu, s16)),
                    bits(down(&gpu, g)),
                    "{label}: {name}"
                );
            }
            // the output stored in bf16 too: the f32 output rounded once, as it is stored
            let mut o16 = gpu.alloc_half(qn, DType::Bf16).unwrap();
            gpu.attention_bf16_stored(
                dims,
                View::whole(&hq16),
                View::whole(&hk16),
                View::whole(&hv16),
                key_mask,
                None,
                None,
                Some(ViewMut::whole(&mut o16)),
                ViewMut::whole(&mut sl),
            )
            .unwrap();
            let mut got16 = vec![0u16; qn];
            gpu.download_half(View::whole(&o16), &mut got16).unwrap();
            let want16: Vec<u16> = down(&gpu, &go)
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect();
            assert_eq!(got16, want16, "{label}: the output in bf16");
        }
    }
    // Another head size is an error naming it.
    let dims = AttentionDims::new(1, 4, 2, 1, 32);
    let x = up(&gpu, &[0.5; 4 * 2 * 32]);
    let (mut o, mut l) = (gpu.alloc(4 * 2 * 32).unwrap(), gpu.alloc(8).unwrap());
    let inputs = AttentionInputs {
        q: View::whole(&x),
        k: View::whole(&x),
        v: View::whole(&x),
        key_mask: None,
    };
    let e = gpu
        .attention_bf16(
            dims,
            inputs,
            None,
            ViewMut::whole(&mut o),
            ViewMut::whole(&mut l),
        )
        .unwrap_err();
    assert!(e.to_string().contains("head_dim = 32"), "{e}");
}

#[test]
fn kv_cache_and_decode_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(6);
    let (batch, hq, hkv, d, max_len, prompt) = (2usize, 4usize, 2usize, 32usize, 20usize, 6usize);
    let slot = hkv * d;
    let cache_len = batch * max_len * slot;
    let (mut gk, mut gv) = (gpu.alloc(cache_len).unwrap(), gpu.alloc(cache_len).unwrap());
    let (mut ck, mut cv) = (vec![0.0; cache_len], vec![0.0; cache_len]);
    // Left-padded prompt of sequence 1: its first two slots are padding.
    let mask: Vec<f32> = (0..batch * max_len)
        .map(|i| {
            if i / max_len == 1 && i % max_len < 2 {
                0.0
            } else {
                1.0
            }
        })
        .collect();
    let gmask = up(&gpu, &mask);
    let mut len = 0;
    for (step, seq) in [prompt, 1, 1, 1].into_iter().enumerate() {
        let dims = AttentionDims::new(batch, seq, hq, hkv, d);
        let what = |op: &str| format!("{op} step {step}");
        let (kn, qn) = (batch * seq * slot, batch * seq * hq * d);
        let (k_new, v_new, q) = (rng.vec(kn, 1.0), rng.vec(kn, 1.0), rng.vec(qn, 1.0));
        gpu.kv_cache_append(
            dims,
            View::whole(&up(&gpu, &k_new)),
            View::whole(&up(&gpu, &v_new)),
            KvCacheViewMut {
                k: ViewMut::whole(&mut gk),
                v: ViewMut::whole(&mut gv),
                max_len,
                len,
            },
        )
        .unwrap();
        cpu.kv_cache_append(
            dims,
            View::whole(&k_new),
            View::whole(&v_new),
            KvCacheViewMut {
                k: ViewMut::whole(&mut ck),
                v: ViewMut::whole(&mut cv),
                max_len,
                len,
            },
        )
        .unwrap();
        len += seq;
        assert_close(&what("k cache"), &down(&gpu, &gk), &ck, 0.0);
        assert_close(&what("v cache"), &down(&gpu, &gv), &cv, 0.0);

        let mut go = up(&gpu, &vec![f32::NAN; qn]);
        gpu.attention_decode(
            dims,
            View::whole(&up(&gpu, &q)),
            KvCacheView {
                k: View::whole(&gk),
                v: View::whole(&gv),
                max_len,
                len,
                key_mask: Some(View::whole(&gmask)),
            },
            ViewMut::whole(&mut go),
        )
        .unwrap();
        let mut co = vec![0.0; qn];
        cpu.attention_decode(
            dims,
            View::whole(&q),
            KvCacheView {
                k: View::whole(&ck),
                v: View::whole(&cv),
                max_len,
                len,
                key_mask: Some(View::whole(&mask)),
            },
            ViewMut::whole(&mut co),
        )
        .unwrap();
        assert_close(&what("attention_decode"), &down(&gpu, &go), &co, 1e-4);
    }
    // A full cache is an argument error.
    let dims = AttentionDims::new(batch, max_len, hq, hkv, d);
    let new = gpu.alloc(batch * max_len * slot).unwrap();
    let e = gpu
        .kv_cache_append(
            dims,
            View::whole(&new),
            View::whole(&new),
            KvCacheViewMut {
                k: ViewMut::whole(&mut gk),
                v: ViewMut::whole(&mut gv),
                max_len,
                len,
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("cache is full"), "{e}");
}

/// Split-K paged decoding (tables wider than 512 keys): sequences whose keys make 1 to 16
/// chunks (lengths 5 … 9 000, the last capped at 16) attended together equal the CPU; each
/// equals itself attended alone, bit for bit (the plan is the sequence's own); a short
/// sequence gives the same bits under a narrow table (no split) and a wide one (split-K, one
/// chunk); bf16 pools alike.
#[test]
fn split_k_paged_decode_matches_cpu_and_each_sequence_alone() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(41);
    let (hq, hkv, bs) = (8usize, 2usize, 16usize);
    let lens = [5u32, 511, 512, 1000, 3000, 9000];
    let batch = lens.len();
    let max_blocks = 9001usize.div_ceil(bs);
    let pool_blocks = batch * max_blocks;
    // every sequence's blocks scattered over the pool (7919 is prime to the block count)
    let tables: Vec<u32> = (0..pool_blocks)
        .map(|i| ((i * 7919) % pool_blocks) as u32)
        .collect();
    for d in [64usize, 128] {
        let pool = pool_blocks * bs * hkv * d;
        let (k, v) = (rng.vec(pool, 1.0), rng.vec(pool, 1.0));
        let bits = |x: &[f32]| -> Vec<u16> {
            x.iter()
                .map(|&y| half::bf16::from_f32(y).to_bits())
                .collect()
        };
        let (gk, gv) = (up(&gpu, &k), up(&gpu, &v));
        let (mut gk16, mut gv16) = (
            gpu.alloc_half(pool, DType::Bf16).unwrap(),
            gpu.alloc_half(pool, DType::Bf16).unwrap(),
        );
        gpu.upload_half(&bits(&k), ViewMut::whole(&mut gk16))
            .unwrap();
        gpu.upload_half(&bits(&v), ViewMut::whole(&mut gv16))
            .unwrap();
        let (mut ck16, mut cv16) = (
            cpu.alloc_half(pool, DType::Bf16).unwrap(),
            cpu.alloc_half(pool, DType::Bf16).unwrap(),
        );
        cpu.upload_half(&bits(&k), ViewMut::whole(&mut ck16))
            .unwrap();
        cpu.upload_half(&bits(&v), ViewMut::whole(&mut cv16))
            .unwrap();
        let q = rng.vec(batch * hq * d, 1.0);
        // rows `seqs` of the batch under tables of `width` blocks: (f32, bf16) outputs
        let gpu_run = |seqs: &[usize], width: usize| -> (Vec<f32>, Vec<f32>) {
            let n = seqs.len();
            let host_tables: Vec<u32> = seqs
                .iter()
                .flat_map(|&b| tables[b * max_blocks..b * max_blocks + width].to_vec())
                .collect();
            let host_len: Vec<u32> = seqs.iter().map(|&b| lens[b]).collect();
            let (gt, gl) = (up_ids(&gpu, &host_tables), up_ids(&gpu, &host_len));
            let blocks = || BlockTables {
                block_size: bs,
                max_blocks: width,
                tables: &gt,
                len: &gl,
                host_tables: &host_tables,
                host_len: &host_len,
            };
            let qs: Vec<f32> = seqs
                .iter()
                .flat_map(|&b| q[b * hq * d..(b + 1) * hq * d].to_vec())
                .collect();
            let dims = AttentionDims::new(n, 1, hq, hkv, d);
            let gq = up(&gpu, &qs);
            let mut o = up(&gpu, &vec![f32::NAN; n * hq * d]);
            gpu.paged_attention_decode(
                dims,
                View::whole(&gq),
                PagedKvView {
                    k: View::whole(&gk),
                    v: View::whole(&gv),
                    blocks: blocks(),
                },
                ViewMut::whole(&mut o),
            )
            .unwrap();
            let mut o16 = up(&gpu, &vec![f32::NAN; n * hq * d]);
            gpu.paged_attention_decode_bf16(
                dims,
                View::whole(&gq),
                PagedKvView {
                    k: View::whole(&gk16),
                    v: View::whole(&gv16),
                    blocks: blocks(),
                },
                ViewMut::whole(&mut o16),
            )
            .unwrap();
            (down(&gpu, &o), down(&gpu, &o16))
        };
        let all: Vec<usize> = (0..batch).collect();
        let (go, go16) = gpu_run(&all, max_blocks);
        // the CPU
        let host_len = lens.to_vec();
        let blocks = || BlockTables {
            block_size: bs,
            max_blocks,
            tables: &tables,
            len: &host_len,
            host_tables: &tables,
            host_len: &host_len,
        };
        let dims = AttentionDims::new(batch, 1, hq, hkv, d);
        let (mut co, mut co16) = (vec![0.0; q.len()], vec![0.0; q.len()]);
        let kv = PagedKvView {
            k: View::whole(&k),
            v: View::whole(&v),
            blocks: blocks(),
        };
        cpu.paged_attention_decode(dims, View::whole(&q), kv, ViewMut::whole(&mut co))
            .unwrap();
        let kv16 = PagedKvView {
            k: View::whole(&ck16),
            v: View::whole(&cv16),
            blocks: blocks(),
        };
        cpu.paged_attention_decode_bf16(dims, View::whole(&q), kv16, ViewMut::whole(&mut co16))
            .unwrap();
        assert_close(&format!("split-K d{d}"), &go, &co, 1e-4);
        assert_close(&format!("split-K bf16 pools d{d}"), &go16, &co16, 1e-4);
        let row = hq * d;
        for b in 0..batch {
            let (alone, alone16) = gpu_run(&[b], max_blocks);
            assert_eq!(alone, go[b * row..(b + 1) * row], "d{d} sequence {b} alone");
            assert_eq!(
                alone16,
                go16[b * row..(b + 1) * row],
                "d{d} bf16 sequence {b} alone"
            );
        }
        // sequence 0 (5 keys + 1) under one block of 16 keys: no split
        let (narrow, narrow16) = gpu_run(&[0], 1);
        assert_eq!(narrow, go[..row], "d{d} narrow table");
        assert_eq!(narrow16, go16[..row], "d{d} bf16 narrow table");
    }
}

/// Paged cache: three sequences of different lengths over a scrambled pool of 4-slot
/// blocks, appended a prompt each then decoded three steps together; pools and outputs
/// equal the CPU's, and a block id past the pool is an error naming the tables. The same
/// steps over bf16 pools: the pools hold the CPU's bits, and the attention gives the f32
/// kernel's bits over an f32 pool of the rounded values. Every step also through the
/// tensor-core prefill kernel over both pools, against its CPU twin.
#[test]
fn paged_kv_cache_and_decode_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(8);
    let (hq, hkv, d, bs, max_blocks) = (4usize, 2usize, 64usize, 4usize, 4usize);
    let slot = hkv * d;
    let prompts = [5usize, 9, 1];
    let batch = prompts.len();
    let order: [u32; 12] = [7, 2, 9, 0, 11, 4, 1, 10, 3, 6, 5, 8];
    let tables: Vec<u32> = (0..batch * max_blocks)
        .map(|i| order[(i * 5 + 3) % order.len()])
        .collect();
    let pool = 12 * bs * slot;
    let (mut gk, mut gv) = (gpu.alloc(pool).unwrap(), gpu.alloc(pool).unwrap());
    let (mut ck, mut cv) = (vec![0.0; pool], vec![0.0; pool]);
    let (mut gk16, mut gv16) = (
        gpu.alloc_half(pool, DType::Bf16).unwrap(),
        gpu.alloc_half(pool, DType::Bf16).unwrap(),
    );
    let (mut ck16, mut cv16) = (
        cpu.alloc_half(pool, DType::Bf16).unwrap(),
        cpu.alloc_half(pool, DType::Bf16).unwrap(),
    );
    // f32 pools of the rounded keys and values: what the bf16 pools must attend as
    let (mut grk, mut grv) = (gpu.alloc(pool).unwrap(), gpu.alloc(pool).unwrap());
    let gtables = up_ids(&gpu, &tables);
    // the prompts one sequence at a time (a batch-1 table row each), a second chunk of the
    // first prompt after its first (chunked prefill: queries at slots 5..8 over 0..=slot),
    // two tokens of every sequence at once (continuations after a tool turn), then three
    // joint steps
    let mut lens = vec![0u32; batch];
    let mut steps: Vec<(Vec<usize>, usize)> = (0..batch).map(|b| (vec![b], prompts[b])).collect();
    steps.push((vec![0], 3));
    steps.push(((0..batch).collect(), 2));
    steps.extend((0..3).map(|_| ((0..batch).collect(), 1)));
    for (step, (rows, seq)) in steps.into_iter().enumerate() {
        let n = rows.len();
        let dims = AttentionDims::new(n, seq, hq, hkv, d);
        let host_tables: Vec<u32> = rows
            .iter()
            .flat_map(|&b| tables[b * max_blocks..(b + 1) * max_blocks].to_vec())
            .collect();
        let host_len: Vec<u32> = rows.iter().map(|&b| lens[b]).collect();
        let (gt, gl) = (up_ids(&gpu, &host_tables), up_ids(&gpu, &host_len));
        let (ht, hl) = (&host_tables[..], &host_len[..]);
        fn block_tables<'a, I>(
            b: (usize, usize),
            t: &'a I,
            l: &'a I,
            h: (&'a [u32], &'a [u32]),
        ) -> BlockTables<'a, I> {
            BlockTables {
                block_size: b.0,
                max_blocks: b.1,
                tables: t,
                len: l,
                host_tables: h.0,
                host_len: h.1,
            }
        }
        let blocks = |t, l| block_tables((bs, max_blocks), t, l, (ht, hl));
        let cpu_blocks = || block_tables((bs, max_blocks), &host_tables, &host_len, (ht, hl));
        let what = |op: &str| format!("{op} step {step}");
        let (kn, qn) = (n * seq * slot, n * seq * hq * d);
        let (k_new, v_new, q) = (rng.vec(kn, 1.0), rng.vec(kn, 1.0), rng.vec(qn, 1.0));
        gpu.paged_kv_cache_append(
            dims,
            View::whole(&up(&gpu, &k_new)),
            View::whole(&up(&gpu, &v_new)),
            PagedKvViewMut {
                k: ViewMut::whole(&mut gk),
                v: ViewMut::whole(&mut gv),
                blocks: blocks(&gt, &gl),
            },
        )
        .unwrap();
        cpu.paged_kv_cache_append(
            dims,
            View::whole(&k_new),
            View::whole(&v_new),
            PagedKvViewMut {
                k: ViewMut::whole(&mut ck),
                v: ViewMut::whole(&mut cv),
                blocks: cpu_blocks(),
            },
        )
        .unwrap();
        assert_close(&what("k pool"), &down(&gpu, &gk), &ck, 0.0);
        assert_close(&what("v pool"), &down(&gpu, &gv), &cv, 0.0);
        let mut go = up(&gpu, &vec![f32::NAN; qn]);
        gpu.paged_attention_decode(
            dims,
            View::whole(&up(&gpu, &q)),
            PagedKvView {
                k: View::whole(&gk),
                v: View::whole(&gv),
                blocks: blocks(&gt, &gl),
            },
            ViewMut::whole(&mut go),
        )
        .unwrap();
        let mut co = vec![0.0; qn];
        cpu.paged_attention_decode(
            dims,
            View::whole(&q),
            PagedKvView {
                k: View::whole(&ck),
                v: View::whole(&cv),
                blocks: cpu_blocks(),
            },
            ViewMut::whole(&mut co),
        )
        .unwrap();
        assert_close(&what("paged_attention_decode"), &down(&gpu, &go), &co, 1e-4);

        // bf16 pools
        let round = |x: &[f32]| -> Vec<f32> {
            x.iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect()
        };
        let (gkn, gvn) = (up(&gpu, &k_new), up(&gpu, &v_new));
        gpu.paged_kv_cache_append_bf16(
            dims,
            View::whole(&gkn),
            View::whole(&gvn),
            PagedKvViewMut {
                k: ViewMut::whole(&mut gk16),
                v: ViewMut::whole(&mut gv16),
                blocks: blocks(&gt, &gl),
            },
        )
        .unwrap();
        cpu.paged_kv_cache_append_bf16(
            dims,
            View::whole(&k_new),
            View::whole(&v_new),
            PagedKvViewMut {
                k: ViewMut::whole(&mut ck16),
                v: ViewMut::whole(&mut cv16),
                blocks: cpu_blocks(),
            },
        )
        .unwrap();
        gpu.paged_kv_cache_append(
            dims,
            View::whole(&up(&gpu, &round(&k_new))),
            View::whole(&up(&gpu, &round(&v_new))),
            PagedKvViewMut {
                k: ViewMut::whole(&mut grk),
                v: ViewMut::whole(&mut grv),
                blocks: blocks(&gt, &gl),
            },
        )
        .unwrap();
        for (name, g, c) in [("k16 pool", &gk16, &ck16), ("v16 pool", &gv16, &cv16)] {
            let (mut gb, mut cb) = (vec![0u16; pool], vec![0u16; pool]);
            gpu.download_half(View::whole(g), &mut gb).unwrap();
            cpu.download_half(View::whole(c), &mut cb).unwrap();
            assert_eq!(gb, cb, "{}", what(name));
        }
        let gq = up(&gpu, &q);
        let mut g16 = up(&gpu, &vec![f32::NAN; qn]);
        gpu.paged_attention_decode_bf16(
            dims,
            View::whole(&gq),
            PagedKvView {
                k: View::whole(&gk16),
                v: View::whole(&gv16),
                blocks: blocks(&gt, &gl),
            },
            ViewMut::whole(&mut g16),
        )
        .unwrap();
        let mut grounded = up(&gpu, &vec![f32::NAN; qn]);
        gpu.paged_attention_decode(
            dims,
            View::whole(&gq),
            PagedKvView {
                k: View::whole(&grk),
                v: View::whole(&grv),
                blocks: blocks(&gt, &gl),
            },
            ViewMut::whole(&mut grounded),
        )
        .unwrap();
        let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(down(&gpu, &g16)),
            bits(down(&gpu, &grounded)),
            "{}",
            what("paged_attention_decode_bf16")
        );
        let mut c16 = vec![0.0; qn];
        cpu.paged_attention_decode_bf16(
            dims,
            View::whole(&q),
            PagedKvView {
                k: View::whole(&ck16),
                v: View::whole(&cv16),
                blocks: cpu_blocks(),
            },
            ViewMut::whole(&mut c16),
        )
        .unwrap();
        assert_close(&what("bf16 vs CPU"), &down(&gpu, &g16), &c16, 1e-4);
        // the tensor-core prefill kernel over both pools against its CPU twin
        let mut gtc = up(&gpu, &vec![f32::NAN; qn]);
        let mut ctc = vec![0.0; qn];
        gpu.paged_attention_prefill_bf16(
            dims,
            View::whole(&gq),
            PagedKvView {
                k: View::whole(&gk),
                v: View::whole(&gv),
                blocks: blocks(&gt, &gl),
            },
            ViewMut::whole(&mut gtc),
        )
        .unwrap();
        cpu.paged_attention_prefill_bf16(
            dims,
            View::whole(&q),
            PagedKvView {
                k: View::whole(&ck),
                v: View::whole(&cv),
                blocks: cpu_blocks(),
            },
            ViewMut::whole(&mut ctc),
        )
        .unwrap();
        let tc = what("paged_attention_prefill_bf16");
        assert_close(&tc, &down(&gpu, &gtc), &ctc, 1e-4);
        gpu.paged_attention_prefill_bf16_kv16(
            dims,
            View::whole(&gq),
            PagedKvView {
                k: View::whole(&gk16),
                v: View::whole(&gv16),
                blocks: blocks(&gt, &gl),
            },
            ViewMut::whole(&mut gtc),
        )
        .unwrap();
        cpu.paged_attention_prefill_bf16_kv16(
            dims,
            View::whole(&q),
            PagedKvView {
                k: View::whole(&ck16),
                v: View::whole(&cv16),
                blocks: cpu_blocks(),
            },
            ViewMut::whole(&mut ctc),
        )
        .unwrap();
        let tc = what("paged_attention_prefill_bf16_kv16");
        assert_close(&tc, &down(&gpu, &gtc), &ctc, 1e-4);
        for &b in &rows {
            lens[b] += seq as u32;
        }
    }
    drop(gtables);
    // a block id past the pool is refused before any launch
    let bad_tables = vec![12u32; max_blocks];
    let (gt, gl) = (up_ids(&gpu, &bad_tables), up_ids(&gpu, &[0]));
    let new = gpu.alloc(slot).unwrap();
    let e = gpu
        .paged_kv_cache_append(
            AttentionDims::new(1, 1, hq, hkv, d),
            View::whole(&new),
            View::whole(&new),
            PagedKvViewMut {
                k: ViewMut::whole(&mut gk),
                v: ViewMut::whole(&mut gv),
                blocks: BlockTables {
                    block_size: bs,
                    max_blocks,
                    tables: &gt,
                    len: &gl,
                    host_tables: &bad_tables,
                    host_len: &[0],
                },
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("block id 12"), "{e}");
}

#[test]
fn log_prob_ops_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(7);
    for (rows, vocab, temperature) in [(6usize, 1000usize, 0.7f32), (3, 1, 1.0), (4, 151_936, 1.0)]
    {
        let what = |op: &str| format!("{op} {rows}x{vocab} T{temperature}");
        let logits = rng.vec(rows * vocab, 8.0);
        let targets = rng.ids(rows, vocab as u32);
        let (gl, gt) = (up(&gpu, &logits), up_ids(&gpu, &targets));
        let (mut glp, mut ge) = (gpu.alloc(rows).unwrap(), gpu.alloc(rows).unwrap());
        gpu.log_prob_entropy(
            View::whole(&gl),
            vocab,
            temperature,
            &gt,
            ViewMut::whole(&mut glp),
            ViewMut::whole(&mut ge),
        )
        .unwrap();
        let (mut clp, mut ce) = (vec![0.0; rows], vec![0.0; rows]);
        cpu.log_prob_entropy(
            View::whole(&logits),
            vocab,
            temperature,
            &targets,
            ViewMut::whole(&mut clp),
            ViewMut::whole(&mut ce),
        )
        .unwrap();
        assert_close(&what("log_prob"), &down(&gpu, &glp), &clp, 1e-5);
        assert_close(&what("entropy"), &down(&gpu, &ge), &ce, 1e-5);

        // Row 1 has coefficient 0: zero and unread.
        let mut coeffs = rng.vec(rows, 2.0);
        coeffs[1] = 0.0;
        let mut gd = up(&gpu, &vec![f32::NAN; rows * vocab]);
        gpu.log_prob_backward(
            View::whole(&gl),
            vocab,
            temperature,
            &gt,
            View::whole(&up(&gpu, &coeffs)),
            ViewMut::whole(&mut gd),
        )
        .unwrap();
        let mut cd = vec![0.0; rows * vocab];
        cpu.log_prob_backward(
            View::whole(&logits),
            vocab,
            temperature,
            &targets,
            View::whole(&coeffs),
            ViewMut::whole(&mut cd),
        )
        .unwrap();
        let gd = down(&gpu, &gd);
        assert!(
            gd[vocab..2 * vocab].iter().all(|&x| x == 0.0),
            "{}",
            what("zero row")
        );
        let err = rel_err(&gd, &cd);
        eprintln!("{}: max rel error {err:.2e}", what("log_prob_backward"));
        assert!(err <= 1e-5, "{}: {err:e}", what("log_prob_backward"));
    }
    // A NaN logit in a scored row: NaN outputs, reported at the next waiting call.
    let (gl, gt) = (up(&gpu, &[0.0, f32::NAN, 1.0]), up_ids(&gpu, &[0]));
    let (mut lp, mut h) = (gpu.alloc(1).unwrap(), gpu.alloc(1).unwrap());
    gpu.log_prob_entropy(
        View::whole(&gl),
        3,
        1.0,
        &gt,
        ViewMut::whole(&mut lp),
        ViewMut::whole(&mut h),
    )
    .unwrap();
    let e = gpu.synchronize().unwrap_err();
    assert!(e.to_string().contains("logits row holds NaN"), "{e}");
}

#[test]
fn entropy_backward_matches_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(17);
    for (rows, vocab, temperature) in [
        (6usize, 1000usize, 0.7f32),
        (3, 1, 1.0),
        (5, 37, 1.6),
        (4, 151_936, 1.0),
    ] {
        let what = format!("entropy_backward {rows}x{vocab} T{temperature}");
        let mut logits = rng.vec(rows * vocab, 8.0);
        // Row 1 has coefficient 0: NaN logits there are never read, its output untouched.
        logits[vocab..2 * vocab].fill(f32::NAN);
        // A −∞ logit of a scored row gets exactly 0 added (a row needs one finite logit).
        if vocab > 1 {
            logits[2 * vocab] = f32::NEG_INFINITY;
        }
        let mut coeffs = rng.vec(rows, 2.0);
        coeffs[1] = 0.0;
        // It accumulates: both start from the same values. They are scaled like the
        // gradient (whose entries are about 1/vocab): against a base of 1 the f32 rounding
        // of `base + g` alone would be ~1e-4 of a 151 936-wide row's largest `g`.
        let base = rng.vec(rows * vocab, 1.0 / vocab as f32);
        let mut gd = up(&gpu, &base);
        gpu.entropy_backward(
            View::whole(&up(&gpu, &logits)),
            vocab,
            temperature,
            View::whole(&up(&gpu, &coeffs)),
            ViewMut::whole(&mut gd),
        )
        .unwrap();
        let mut cd = base.clone();
        cpu.entropy_backward(
            View::whole(&logits),
            vocab,
            temperature,
            View::whole(&coeffs),
            ViewMut::whole(&mut cd),
        )
        .unwrap();
        let gd = down(&gpu, &gd);
        assert_eq!(
            gd[vocab..2 * vocab],
            base[vocab..2 * vocab],
            "{what}: zero row"
        );
        if vocab > 1 {
            assert_eq!(gd[2 * vocab], base[2 * vocab], "{what}: -inf logit");
        }
        // Compare what was added (the base values would hide a gradient's error).
        let added = |d: &[f32]| -> Vec<f32> { d.iter().zip(&base).map(|(a, b)| a - b).collect() };
        let err = rel_err(&added(&gd), &added(&cd));
        eprintln!("{what}: max rel error {err:.2e}");
        assert!(err <= 1e-5, "{what}: {err:e}");
        if vocab == 1 {
            // One token: H = 0 whatever the logit, nothing added.
            assert_eq!(gd, base, "{what}");
        }
    }
    // A non-finite coefficient of a row, and NaN logits of a scored row: NaN rows,
    // reported at the next waiting call.
    let logits = up(&gpu, &[0.0, 1.0, 2.0, 3.0]);
    let mut d = up(&gpu, &[0.0; 4]);
    gpu.entropy_backward(
        View::whole(&logits),
        2,
        1.0,
        View::whole(&up(&gpu, &[1.0, f32::INFINITY])),
        ViewMut::whole(&mut d),
    )
    .unwrap();
    let e = gpu.synchronize().unwrap_err();
    assert!(e.to_string().contains("entropy coefficient"), "{e}");
    let mut d = up(&gpu, &[0.0; 3]);
    gpu.entropy_backward(
        View::whole(&up(&gpu, &[0.0, f32::NAN, 1.0])),
        3,
        1.0,
        View::whole(&up(&gpu, &[1.0])),
        ViewMut::whole(&mut d),
    )
    .unwrap();
    let e = gpu.synchronize().unwrap_err();
    assert!(e.to_string().contains("logits row holds NaN"), "{e}");
}

/// Rows for greedy decoding: random, with planted ties of the maximum (the lowest index
/// wins), −∞ runs, and rows without a token (NaN, +∞, all −∞).
fn greedy_rows(rng: &mut Rng, rows: usize, vocab: usize) -> Vec<f32> {
    let mut x = rng.vec(rows * vocab, 8.0);
    for (r, row) in x.chunks_exact_mut(vocab).enumerate() {
        match r % 6 {
            1 if vocab > 3 => {
                row[vocab - 1] = 100.0;
                row[vocab / 2] = 100.0;
                row[vocab / 3] = 100.0;
            }
            2 => row[..vocab / 2].fill(f32::NEG_INFINITY),
            3 => row[vocab / 2] = f32::NAN,
            4 => row.fill(f32::NEG_INFINITY),
            5 => row[0] = f32::INFINITY,
            _ => {}
        }
    }
    x
}

#[test]
fn greedy_tokens_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(17);
    for (rows, vocab) in [(12usize, 1usize), (12, 7), (30, 1000), (18, 151_936)] {
        let logits = greedy_rows(&mut rng, rows, vocab);
        let (mut cids, mut chost) = (vec![0u32; rows], vec![0u32; rows]);
        cpu.greedy_tokens(View::whole(&logits), vocab, &mut cids, &mut chost)
            .unwrap();
        let gl = up(&gpu, &logits);
        let mut gids = up_ids(&gpu, &vec![7u32; rows]);
        let mut ghost = vec![7u32; rows];
        gpu.greedy_tokens(View::whole(&gl), vocab, &mut gids, &mut ghost)
            .unwrap();
        assert_eq!(ghost, chost, "{rows}x{vocab}");
        // and no status bit is left behind for the next op
        gpu.synchronize().unwrap();
    }
}

/// The race sampler: the device's Gumbel draws are the twin's bit for bit, and so are its
/// tokens, with every filter, on rows with ties, −∞, NaN and +∞.
#[test]
fn sampled_tokens_match_cpu() {
    use ares_cpu::sampler::{SampleKey, Sampler, gumbel, random_bits};
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    // the draws of 3 keys over a vocabulary
    for key in [
        SampleKey::default(),
        SampleKey {
            seed: 42,
            sequence: 7,
            step: 3,
        },
        SampleKey {
            seed: u64::MAX,
            sequence: u64::MAX,
            step: u32::MAX,
        },
    ] {
        let n = 151_937;
        let words = gpu.ops().upload_new(&key.words()).unwrap();
        let mut out = gpu.ops().alloc(n).unwrap();
        gpu.ops()
            .race_draws(&words.as_view(), &mut out.as_view_mut())
            .unwrap();
        let mut got = vec![0f32; n];
        gpu.ops().download(&out.as_view(), &mut got).unwrap();
        for (i, g) in got.iter().enumerate() {
            let want = gumbel(random_bits(key, (i / 4) as u32)[i % 4]);
            assert_eq!(
                g.to_bits(),
                want.to_bits(),
                "{key:?} token {i}: {g} vs {want}"
            );
        }
    }
    let mut rng = Rng(19);
    // (rows, vocab, temperature, top_k, top_p, min_p)
    let cases = [
        (12usize, 1usize, 1.0f32, 0u32, 1.0f32, 0.0f32),
        (30, 7, 0.7, 0, 0.9, 0.0),
        (30, 1000, 1.0, 0, 1.0, 0.0),
        (30, 1000, 1.3, 5, 1.0, 0.0),
        (30, 1000, 1.0, 50, 0.8, 0.0),
        (30, 1000, 0.8, 0, 1.0, 0.05),
        (30, 1000, 1.0, 40, 0.9, 0.01),
        (18, 151_936, 1.0, 0, 1.0, 0.0),
        (18, 151_936, 0.6, 20, 0.95, 0.0),
        (18, 151_936, 1.0, 0, 0.9, 0.0),
        (18, 151_936, 1.0, 0, 1.0, 0.1),
    ];
    for (rows, vocab, temperature, top_k, top_p, min_p) in cases {
        let sampler = Sampler {
            temperature,
            top_k,
            top_p,
            min_p,
        };
        let logits = greedy_rows(&mut rng, rows, vocab);
        let gl = up(&gpu, &logits);
        for step in 0..4 {
            let keys: Vec<SampleKey> = (0..rows as u64)
                .map(|r| SampleKey {
                    seed: 5,
                    sequence: r,
                    step,
                })
                .collect();
            let (mut cids, mut chost) = (vec![0u32; rows], vec![0u32; rows]);
            cpu.sample_tokens(
                View::whole(&logits),
                vocab,
                &sampler,
                &keys,
                &mut cids,
                &mut chost,
            )
            .unwrap();
            let mut gids = up_ids(&gpu, &vec![7u32; rows]);
            let mut ghost = vec![7u32; rows];
            gpu.sample_tokens(
                View::whole(&gl),
                vocab,
                &sampler,
                &keys,
                &mut gids,
                &mut ghost,
            )
            .unwrap();
            assert_eq!(ghost, chost, "{rows}x{vocab} {sampler:?} step {step}");
        }
        gpu.synchronize().unwrap();
    }
}

/// A decode step's pick in one kernel and one transfer (`pick_rows`): the same ids as the
/// CPU, left on the device too, log-probs and entropies as `log_prob_entropy`'s (summed in
/// the pick's order), a clear status word — greedy, the race without filters (the online
/// state gathered in the race's own pass) and with each filter (gathered in the max pass),
/// rows with −∞ entries — and a row the pick cannot score is the step's error, reported by
/// that same transfer.
#[test]
fn picked_tokens_match_cpu_in_one_transfer() {
    use ares_cpu::sampler::{SampleKey, Sampler};
    use ares_model::backend::{PickBuffers, PickBuffersOf, PickRule, picked_row};
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(23);
    let samplers = [
        (0.8f32, 0u32, 0.95f32, 0.0f32),
        (1.3, 0, 1.0, 0.0),
        (1.0, 40, 1.0, 0.05),
    ];
    for (rows, vocab) in [(1usize, 7usize), (16, 1000), (9, 151_936)] {
        let mut logits = rng.vec(rows * vocab, 6.0);
        for i in (0..logits.len()).step_by(5) {
            logits[i] = f32::NEG_INFINITY;
        }
        let gl = up(&gpu, &logits);
        let keys: Vec<SampleKey> = (0..rows as u64)
            .map(|r| SampleKey {
                seed: 3,
                sequence: r,
                step: 2,
            })
            .collect();
        let samplers: Vec<Sampler> = samplers
            .iter()
            .map(|&(temperature, top_k, top_p, min_p)| Sampler {
                temperature,
                top_k,
                top_p,
                min_p,
            })
            .collect();
        let mut rules = vec![(PickRule::Greedy, 1.0f32), (PickRule::Greedy, 0.7)];
        for sampler in &samplers {
            let rule = PickRule::Sample {
                sampler,
                keys: &keys,
            };
            rules.push((rule, sampler.temperature));
        }
        for (rule, temperature) in rules {
            let words = PickBuffersOf::<CpuBackend>::host_len(rows);
            let (mut cb, mut ch) = (PickBuffers::new(&cpu, rows).unwrap(), vec![0u32; words]);
            cpu.pick_tokens(
                View::whole(&logits),
                vocab,
                rule,
                temperature,
                &mut cb,
                &mut ch,
            )
            .unwrap();
            let (mut gb, mut gh) = (PickBuffers::new(&gpu, rows).unwrap(), vec![7u32; words]);
            gpu.pick_tokens(View::whole(&gl), vocab, rule, temperature, &mut gb, &mut gh)
                .unwrap();
            assert_eq!(gh[words - 1], 0, "status word");
            // the ids left on the device as targets: log_prob_entropy scores the picks
            let (mut lp, mut ent) = (gpu.alloc(rows).unwrap(), gpu.alloc(rows).unwrap());
            gpu.log_prob_entropy(
                View::whole(&gl),
                vocab,
                temperature,
                &gb.targets,
                ViewMut::whole(&mut lp),
                ViewMut::whole(&mut ent),
            )
            .unwrap();
            let mut left = vec![0f32; rows];
            gpu.download(View::whole(&lp), &mut left).unwrap();
            for (r, left) in left.iter().enumerate() {
                let (c, g) = (picked_row(&ch, rows, r), picked_row(&gh, rows, r));
                assert_eq!(g.0, c.0, "{rows}x{vocab} {rule:?} row {r}");
                assert!(
                    (g.1 - c.1).abs() <= 1e-4 * (1.0 + c.1.abs()),
                    "log-prob row {r}: {g:?} vs {c:?}"
                );
                assert!(
                    (g.2 - c.2).abs() <= 1e-4 * (1.0 + c.2.abs()),
                    "entropy row {r}: {g:?} vs {c:?}"
                );
                assert!(
                    (left - g.1).abs() <= 1e-4 * (1.0 + g.1.abs()),
                    "row {r}: the id left on the device scores {left}, the pick {g:?}"
                );
            }
        }
    }
    // a NaN row: no token, and log_prob_entropy's bad-target flag comes back with the ids
    let mut logits = rng.vec(2 * 50, 3.0);
    logits[60] = f32::NAN;
    let mut gb = PickBuffers::new(&gpu, 2).unwrap();
    let mut gh = vec![0u32; PickBuffersOf::<CudaBackend>::host_len(2)];
    let err = gpu
        .pick_tokens(
            View::whole(&up(&gpu, &logits)),
            50,
            PickRule::Greedy,
            1.0,
            &mut gb,
            &mut gh,
        )
        .unwrap_err();
    assert!(err.to_string().contains("NaN"), "{err}");
    gpu.synchronize().unwrap(); // the status word was cleared by the pick
}

/// Small transfers go through page-locked memory and are queued without waiting: many
/// uploads of one length back to back (one staging buffer, rewritten while earlier copies
/// may still be queued) each land their own values; above the staging limit, and for ids
/// and downloads, the same bytes arrive.
#[test]
fn staged_transfers_keep_every_uploads_values() {
    let Some(gpu) = gpu_or_skip() else { return };
    let mut rng = Rng(31);
    for n in [1usize, 300, 262_144, 1 << 19] {
        let hosts: Vec<Vec<f32>> = (0..24).map(|_| rng.vec(n, 5.0)).collect();
        let mut bufs: Vec<CudaBuffer> = (0..24).map(|_| gpu.alloc(n).unwrap()).collect();
        for (h, b) in hosts.iter().zip(&mut bufs) {
            gpu.upload(h, ViewMut::whole(b)).unwrap();
        }
        for (h, b) in hosts.iter().zip(&bufs) {
            let mut back = vec![0f32; n];
            gpu.download(View::whole(b), &mut back).unwrap();
            assert_eq!(&back, h, "{n} values");
        }
        // ids read back through an embedding of a one-column table whose row r holds r
        let rows = 2 * n;
        let table: Vec<f32> = (0..rows).map(|r| r as f32).collect();
        let dtable = up(&gpu, &table);
        let ids: Vec<Vec<u32>> = (0..8u32)
            .map(|k| (0..n as u32).map(|i| (i * 7 + k) % rows as u32).collect())
            .collect();
        let mut id_bufs: Vec<CudaIds> = (0..8).map(|_| gpu.alloc_ids(n).unwrap()).collect();
        for (h, b) in ids.iter().zip(&mut id_bufs) {
            gpu.upload_ids(h, b).unwrap();
        }
        for (h, b) in ids.iter().zip(&id_bufs) {
            let mut out = gpu.alloc(n).unwrap();
            gpu.embedding(b, View::whole(&dtable), rows, 1, ViewMut::whole(&mut out))
                .unwrap();
            let want: Vec<f32> = h.iter().map(|&i| i as f32).collect();
            assert_eq!(down(&gpu, &out), want, "{n} ids");
        }
    }
}

#[test]
fn optimizer_ops_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(8);
    let lens = [0usize, 1, 1000, 300_001, 9_000_000];
    let (mut dev, mut alone) = (Vec::new(), Vec::new());
    for n in lens {
        let x = rng.vec(n, 3.0);
        let d = up(&gpu, &x);
        let g = gpu.sum_of_squares(View::whole(&d)).unwrap();
        let c = cpu.sum_of_squares(View::whole(&x)).unwrap();
        assert!(
            (g - c).abs() <= 1e-10 * c.max(1e-30),
            "sum_of_squares n={n}: {g} vs {c}"
        );
        dev.push(d);
        alone.push(g);
    }
    // the gradient norm's one read: every tensor's sum as it is alone, bit for bit
    let views: Vec<_> = dev.iter().map(|d| Stored::F32(View::whole(d))).collect();
    let mut together = vec![f64::NAN; lens.len()];
    gpu.sums_of_squares(&views, &mut together).unwrap();
    for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(t.to_bits(), a.to_bits(), "sums_of_squares tensor {i}");
    }
    assert!(gpu.sums_of_squares(&views, &mut [0.0; 2]).is_err());
    // gradients stored in bf16 among them: each one's sum is its widened values' sum
    let halves: Vec<_> = dev
        .iter()
        .map(|d| {
            let mut h = gpu.alloc_half(d.len(), DType::Bf16).unwrap();
            gpu.round_bf16(View::whole(d), ViewMut::whole(&mut h))
                .unwrap();
            h
        })
        .collect();
    let mut mixed: Vec<_> = halves
        .iter()
        .map(|h| Stored::Bf16(View::whole(h)))
        .collect();
    mixed.extend(views.iter().copied());
    let mut sums = vec![f64::NAN; mixed.len()];
    gpu.sums_of_squares(&mixed, &mut sums).unwrap();
    for (i, h) in halves.iter().enumerate() {
        let mut wide = gpu.alloc(h.len()).unwrap();
        gpu.widen_bf16(View::whole(h), ViewMut::whole(&mut wide))
            .unwrap();
        let alone = gpu.sum_of_squares(View::whole(&wide)).unwrap();
        assert_eq!(sums[i].to_bits(), alone.to_bits(), "bf16 tensor {i}");
        assert_eq!(sums[lens.len() + i].to_bits(), together[i].to_bits());
    }
    // their accumulation and zeroing: the CPU's bits
    let n = 300_001;
    let (start, add) = (rng.vec(n, 2.0), rng.vec(n, 1e-2));
    let (mut g16, mut c16) = (
        gpu.alloc_half(n, DType::Bf16).unwrap(),
        cpu.alloc_half(n, DType::Bf16).unwrap(),
    );
    gpu.round_bf16(View::whole(&up(&gpu, &start)), ViewMut::whole(&mut g16))
        .unwrap();
    cpu.round_bf16(View::whole(&start), ViewMut::whole(&mut c16))
        .unwrap();
    for key in [1u64, 0xFEED_5EED] {
        let src = up(&gpu, &add);
        gpu.accumulate_bf16_stochastic(View::whole(&src), key, ViewMut::whole(&mut g16))
            .unwrap();
        cpu.accumulate_bf16_stochastic(View::whole(&add), key, ViewMut::whole(&mut c16))
            .unwrap();
        let mut bits = vec![0u16; n];
        gpu.download_half(View::whole(&g16), &mut bits).unwrap();
        assert_eq!(bits, c16.bits(), "accumulate_bf16_stochastic key {key:#x}");
    }
    gpu.fill_bf16(ViewMut::whole(&mut g16), 0.0).unwrap();
    let mut bits = vec![1u16; n];
    gpu.download_half(View::whole(&g16), &mut bits).unwrap();
    assert!(bits.iter().all(|&b| b == 0), "fill_bf16");

    let n = 70_000;
    let p0 = rng.vec(n, 1.0);
    let (mut gp, mut gm, mut gv) = (up(&gpu, &p0), gpu.alloc(n).unwrap(), gpu.alloc(n).unwrap());
    let (mut cp, mut cm, mut cv) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
    for step in 1..=3u64 {
        let grad = rng.vec(n, 0.1);
        let update = AdamWUpdate {
            config: AdamWConfig {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            },
            lr: 1e-3,
            step,
            grad_scale: if step == 2 { 0.5 } else { 1.0 },
        };
        let dg = up(&gpu, &grad);
        // the GPU writes a bf16 copy of the updated parameter with the update
        let mut copy = gpu.alloc_half(n, DType::Bf16).unwrap();
        gpu.adamw_step(
            ViewMut::whole(&mut gp),
            Stored::F32(View::whole(&dg)),
            ViewMut::whole(&mut gm),
            ViewMut::whole(&mut gv),
            &update,
            Some(ViewMut::whole(&mut copy)),
        )
        .unwrap();
        let mut bits = vec![0u16; n];
        gpu.download_half(View::whole(&copy), &mut bits).unwrap();
        let rounded: Vec<u16> = down(&gpu, &gp)
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        assert_eq!(
            bits, rounded,
            "the bf16 copy written by adamw_step, step {step}"
        );
        cpu.adamw_step(
            ViewMut::whole(&mut cp),
            Stored::F32(View::whole(&grad)),
            ViewMut::whole(&mut cm),
            ViewMut::whole(&mut cv),
            &update,
            None,
        )
        .unwrap();
        assert_close(
            &format!("adamw param step {step}"),
            &down(&gpu, &gp),
            &cp,
            1e-6,
        );
        assert_close(
            &format!("adamw exp_avg step {step}"),
            &down(&gpu, &gm),
            &cm,
            1e-6,
        );
        assert_close(
            &format!("adamw exp_avg_sq step {step}"),
            &down(&gpu, &gv),
            &cv,
            1e-6,
        );
    }
    // a gradient stored in bf16 is read as stored: the update of its widened values, bit
    // for bit (the check reads it too)
    {
        let mut g16 = gpu.alloc_half(n, DType::Bf16).unwrap();
        let grad = up(&gpu, &rng.vec(n, 0.1));
        gpu.round_bf16(View::whole(&grad), ViewMut::whole(&mut g16))
            .unwrap();
        let mut wide = gpu.alloc(n).unwrap();
        gpu.widen_bf16(View::whole(&g16), ViewMut::whole(&mut wide))
            .unwrap();
        let update = AdamWUpdate {
            config: AdamWConfig::default(),
            lr: 1e-3,
            step: 4,
            grad_scale: 0.5,
        };
        let bits = |b: &CudaBuffer| {
            down(&gpu, b)
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        let mut runs = Vec::new();
        for g in [
            Stored::Bf16(View::whole(&g16)),
            Stored::F32(View::whole(&wide)),
        ] {
            let [mut p, mut m, mut v] = [&gp, &gm, &gv].map(|b| up(&gpu, &down(&gpu, b)));
            let (pm, mm, vm) = (
                ViewMut::whole(&mut p),
                ViewMut::whole(&mut m),
                ViewMut::whole(&mut v),
            );
            gpu.adamw_step(pm, g, mm, vm, &update, None).unwrap();
            runs.push([bits(&p), bits(&m), bits(&v)]);
        }
        assert_eq!(runs[0], runs[1], "adamw from a bf16 gradient");
    }
    // bf16 moments: the same update, the moments rounded back (twin of the CPU's).
    let widen = |b: &[u16]| -> Vec<f32> {
        b.iter()
            .map(|&x| f32::from_bits(u32::from(x) << 16))
            .collect()
    };
    let (mut gp16, mut cp16) = (up(&gpu, &p0), p0.clone());
    let mut gm16 = gpu.alloc_half(n, DType::Bf16).unwrap();
    let mut gv16 = gpu.alloc_half(n, DType::Bf16).unwrap();
    let mut cm16 = cpu.alloc_half(n, DType::Bf16).unwrap();
    let mut cv16 = cpu.alloc_half(n, DType::Bf16).unwrap();
    for step in 1..=3u64 {
        let grad = rng.vec(n, 0.1);
        let update = AdamWUpdate {
            config: AdamWConfig::default(),
            lr: 1e-3,
            step,
            grad_scale: 1.0,
        };
        let dg = up(&gpu, &grad);
        // the moments round stochastically under the same key on both backends
        let key = 0x00C0_FFEE ^ step;
        gpu.adamw_step_bf16(
            ViewMut::whole(&mut gp16),
            key,
            Stored::F32(View::whole(&dg)),
            ViewMut::whole(&mut gm16),
            ViewMut::whole(&mut gv16),
            &update,
            None,
        )
        .unwrap();
        cpu.adamw_step_bf16(
            ViewMut::whole(&mut cp16),
            key,
            Stored::F32(View::whole(&grad)),
            ViewMut::whole(&mut cm16),
            ViewMut::whole(&mut cv16),
            &update,
            None,
        )
        .unwrap();
        assert_close(
            &format!("adamw bf16 param step {step}"),
            &down(&gpu, &gp16),
            &cp16,
            1e-6,
        );
        for (what, g, c) in [("exp_avg", &gm16, &cm16), ("exp_avg_sq", &gv16, &cv16)] {
            let mut bits = vec![0u16; n];
            gpu.download_half(View::whole(g), &mut bits).unwrap();
            let mut cbits = vec![0u16; n];
            cpu.download_half(View::whole(c), &mut cbits).unwrap();
            // one bf16 step apart at most where the f32 values straddle a rounding boundary
            assert_close(
                &format!("adamw bf16 {what} step {step}"),
                &widen(&bits),
                &widen(&cbits),
                3e-4,
            );
        }
    }
    // 8-bit moments, block-wise: the same update on the read-back moments, quantised with
    // each block's new scale (twin of the CPU's). Each step starts both from the CPU's
    // state, so a code one apart at a midpoint cannot grow into later steps' differences.
    let maps = {
        let mut m = ares_cpu::ops::optim_int8::dynamic_map(true).to_vec();
        m.extend(ares_cpu::ops::optim_int8::dynamic_map(false));
        m
    };
    let blocks = n.div_ceil(2048);
    let mut cp8 = p0.clone();
    let (mut cm8, mut cv8) = (cpu.alloc_bytes(n).unwrap(), cpu.alloc_bytes(n).unwrap());
    let (mut cma, mut cva) = (vec![0.0f32; blocks], vec![0.0f32; blocks]);
    let (mut gm8, mut gv8) = (gpu.alloc_bytes(n).unwrap(), gpu.alloc_bytes(n).unwrap());
    let gmaps = up(&gpu, &maps);
    let mut copy8 = gpu.alloc_half(n, DType::Bf16).unwrap();
    for step in 1..=3u64 {
        let grad = rng.vec(n, 0.1);
        let update = AdamWUpdate {
            config: AdamWConfig::default(),
            lr: 1e-3,
            step,
            grad_scale: if step == 3 { 0.25 } else { 1.0 },
        };
        // the GPU starts from the CPU's state
        let mut gp8 = up(&gpu, &cp8);
        let (mut gma, mut gva) = (up(&gpu, &cma), up(&gpu, &cva));
        gpu.upload_bytes(&cm8, ViewMut::whole(&mut gm8)).unwrap();
        gpu.upload_bytes(&cv8, ViewMut::whole(&mut gv8)).unwrap();
        let dg = up(&gpu, &grad);
        gpu.adamw_step_int8(
            ViewMut::whole(&mut gp8),
            Stored::F32(View::whole(&dg)),
            ViewMut::whole(&mut gm8),
            ViewMut::whole(&mut gv8),
            ViewMut::whole(&mut gma),
            ViewMut::whole(&mut gva),
            View::whole(&gmaps),
            &update,
            Some(ViewMut::whole(&mut copy8)),
        )
        .unwrap();
        let mut bits = vec![0u16; n];
        gpu.download_half(View::whole(&copy8), &mut bits).unwrap();
        let rounded: Vec<u16> = down(&gpu, &gp8)
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        assert_eq!(
            bits, rounded,
            "the bf16 copy written by adamw_step_int8, step {step}"
        );
        cpu.adamw_step_int8(
            ViewMut::whole(&mut cp8),
            Stored::F32(View::whole(&grad)),
            ViewMut::whole(&mut cm8),
            ViewMut::whole(&mut cv8),
            ViewMut::whole(&mut cma),
            ViewMut::whole(&mut cva),
            View::whole(&maps),
            &update,
            None,
        )
        .unwrap();
        let label = format!("adamw int8 step {step}");
        assert_close(&format!("{label} param"), &down(&gpu, &gp8), &cp8, 1e-6);
        assert_close(
            &format!("{label} exp_avg absmax"),
            &down(&gpu, &gma),
            &cma,
            1e-6,
        );
        assert_close(
            &format!("{label} exp_avg_sq absmax"),
            &down(&gpu, &gva),
            &cva,
            1e-6,
        );
        for (what, g, c) in [("exp_avg", &gm8, &cm8), ("exp_avg_sq", &gv8, &cv8)] {
            let mut codes = vec![0u8; n];
            gpu.download_bytes(View::whole(g), &mut codes).unwrap();
            let apart = codes.iter().zip(c.iter()).filter(|(a, b)| a != b).count();
            let far = codes.iter().zip(c.iter()).any(|(a, b)| a.abs_diff(*b) > 1);
            assert!(
                !far && apart <= n / 1000,
                "{label} {what}: {apart} codes differ (more than one apart: {far})"
            );
        }
    }
    // A non-finite gradient changes nothing and is reported.
    let before = down(&gpu, &gp);
    let mut grad = vec![0.01f32; n];
    grad[n - 1] = f32::INFINITY;
    let update = AdamWUpdate {
        config: AdamWConfig::default(),
        lr: 1e-3,
        step: 4,
        grad_scale: 1.0,
    };
    gpu.adamw_step(
        ViewMut::whole(&mut gp),
        Stored::F32(View::whole(&up(&gpu, &grad))),
        ViewMut::whole(&mut gm),
        ViewMut::whole(&mut gv),
        &update,
        None,
    )
    .unwrap();
    let e = gpu.synchronize().unwrap_err();
    assert!(e.to_string().contains("gradient holds NaN"), "{e}");
    assert_eq!(down(&gpu, &gp), before);
    // Hyper-parameters are argument errors.
    let bad = AdamWUpdate { step: 0, ..update };
    let e = gpu
        .adamw_step(
            ViewMut::whole(&mut gp),
            Stored::F32(View::whole(&up(&gpu, &grad))),
            ViewMut::whole(&mut gm),
            ViewMut::whole(&mut gv),
            &bad,
            None,
        )
        .unwrap_err();
    assert!(e.to_string().contains("step = 0"), "{e}");
}

// ----- Models: the transformers fixtures through Model<CudaBackend>. -----

const MODELS: [&str; 3] = ["qwen2_tiny", "qwen3_tiny", "llama_tiny"];

/// A fixture model's directory: under `$ARES_FIXTURE_MODELS` when set (the GPU bundle
/// carries a copy, since the test binary runs on another machine), else the fixtures in
/// `ares-model/tests/fixtures/models`.
fn fixture(name: &str) -> PathBuf {
    std::env::var_os("ARES_FIXTURE_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models"))
        .join(name)
}

fn u32s(st: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<u32>) {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::I64, "{name}");
    let values = t
        .data()
        .chunks_exact(8)
        .map(|b| u32::try_from(i64::from_le_bytes(b.try_into().unwrap())).unwrap())
        .collect();
    (t.shape().to_vec(), values)
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// One input set of a fixture with its expected logits and gradients.
struct Set {
    batch: usize,
    seq: usize,
    input_ids: Vec<u32>,
    attention_mask: Vec<u32>,
    position_ids: Vec<u32>,
    logits: Vec<f32>,
    /// `∂L/∂logits = W · mask` of the fixtures' gradient loss.
    dlogits: Vec<f32>,
}

impl Set {
    fn load(name: &str, set: &str) -> Self {
        let bytes = std::fs::read(fixture(name).join("expected.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (shape, input_ids) = u32s(&st, &format!("{set}.input_ids"));
        let (_, attention_mask) = u32s(&st, &format!("{set}.attention_mask"));
        let (_, position_ids) = u32s(&st, &format!("{set}.position_ids"));
        let w = f32s(&st, &format!("{set}.W"));
        let vocab = w.len() / attention_mask.len();
        let dlogits = w
            .chunks_exact(vocab)
            .zip(&attention_mask)
            .flat_map(|(row, &m)| row.iter().map(move |&x| x * m as f32))
            .collect();
        Self {
            batch: shape[0],
            seq: shape[1],
            input_ids,
            attention_mask,
            position_ids,
            logits: f32s(&st, &format!("{set}.logits")),
            dlogits,
        }
    }

    fn inputs(&self) -> Inputs<'_> {
        Inputs {
            batch: self.batch,
            seq: self.seq,
            input_ids: &self.input_ids,
            attention_mask: &self.attention_mask,
            position_ids: &self.position_ids,
        }
    }

    /// The rows (tokens) with `attention_mask = 1`.
    fn valid_rows<'a>(
        &'a self,
        x: &'a [f32],
        vocab: usize,
    ) -> impl Iterator<Item = &'a [f32]> + 'a {
        x.chunks_exact(vocab)
            .zip(&self.attention_mask)
            .filter(|(_, m)| **m == 1)
            .map(|(r, _)| r)
    }
}

fn models(gpu: &CudaBackend, name: &str) -> (Model<CpuBackend>, Model<CudaBackend>) {
    let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
    (
        Model::from_checkpoint(CpuBackend, &checkpoint).unwrap(),
        Model::from_checkpoint(gpu.clone(), &checkpoint).unwrap(),
    )
}

#[test]
fn fixture_logits_match_transformers_and_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    for name in MODELS {
        let (cpu_model, gpu_model) = models(&gpu, name);
        let vocab = gpu_model.spec().vocab;
        for set in ["right", "left"] {
            let s = Set::load(name, set);
            let ours = gpu_model.forward_logits(&s.inputs()).unwrap();
            let cpu = cpu_model.forward_logits(&s.inputs()).unwrap();
            let flat = |x: &[f32]| {
                s.valid_rows(x, vocab)
                    .flatten()
                    .copied()
                    .collect::<Vec<_>>()
            };
            assert_close(
                &format!("{name} {set} logits vs transformers"),
                &flat(&ours),
                &flat(&s.logits),
                1e-4,
            );
            assert_close(
                &format!("{name} {set} logits vs CPU"),
                &flat(&ours),
                &flat(&cpu),
                1e-4,
            );
        }
    }
}

/// Forward then backward of the fixture loss on `model`, returning every gradient.
fn fixture_grads<B: Backend>(model: &Model<B>, s: &Set) -> Vec<(String, Vec<f32>)> {
    let be = model.backend();
    let grads = fixture_loss_grads(model, s);
    let names: Vec<String> = model
        .to_weights()
        .unwrap()
        .tensors()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    names
        .into_iter()
        .map(|n| {
            let g = grads.download(be, &n).unwrap();
            (n, g)
        })
        .collect()
}

#[test]
fn fixture_gradients_match_cpu_and_repeat_exactly() {
    let Some(gpu) = gpu_or_skip() else { return };
    for name in MODELS {
        let (cpu_model, gpu_model) = models(&gpu, name);
        for set in ["right", "left"] {
            let s = Set::load(name, set);
            let ours = fixture_grads(&gpu_model, &s);
            let cpu = fixture_grads(&cpu_model, &s);
            for ((n, g), (_, c)) in ours.iter().zip(&cpu) {
                let err = rel_err(g, c);
                eprintln!("{name} {set} {n}: max rel error {err:.2e}");
                assert!(err <= 1e-4, "{name} {set} {n}: {err:e}");
            }
            // No float atomics anywhere: a second run is bit for bit the first.
            let again = fixture_grads(&gpu_model, &s);
            assert!(ours == again, "{name} {set}: gradients differ between runs");
        }
    }
}

/// A packed pass (segments of 5, 9, 1 and 3 tokens, then 3 of padding) on `model`: the
/// log-probs of each next token and the gradients of a loss on them.
fn packed_pass<B: Backend>(model: &Model<B>) -> (Vec<f32>, Vec<(String, Vec<f32>)>) {
    let be = model.backend();
    let cu = [0u32, 5, 14, 15, 18, 21];
    let n = 21usize;
    let vocab = model.spec().vocab as u64;
    let ids: Vec<u32> = (0..n as u64)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    let mask: Vec<u32> = (0..n).map(|i| u32::from(i < 18)).collect();
    let mut positions = vec![0u32; n];
    let (mut targets, mut coeffs) = (vec![0u32; n], vec![0.0f32; n]);
    for w in cu.windows(2) {
        for i in w[0] as usize..w[1] as usize {
            positions[i] = i as u32 - w[0];
            if i + 1 < w[1] as usize && i < 18 {
                targets[i] = ids[i + 1];
                coeffs[i] = -0.1;
            }
        }
    }
    let inputs = Inputs {
        batch: 1,
        seq: n,
        input_ids: &ids,
        attention_mask: &mask,
        position_ids: &positions,
    };
    let extras = ForwardExtras {
        segments: Some(&cu),
        ..ForwardExtras::default()
    };
    let mut acts = model.activations(1, n).unwrap();
    model.forward_with(&inputs, &extras, &mut acts).unwrap();
    model.log_prob_entropy(&mut acts, &targets, 1.0).unwrap();
    let mut lp = vec![0.0f32; n];
    be.download(acts.log_probs(), &mut lp).unwrap();
    let mut grads = model.grads().unwrap();
    model
        .backward_from_log_prob_grads(&inputs, &mut acts, &targets, &coeffs, 1.0, &mut grads)
        .unwrap();
    let names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
    ];
    let g = names
        .iter()
        .map(|name| (name.to_string(), grads.download(be, name).unwrap()))
        .collect();
    (lp, g)
}

/// Packed sequences on CUDA, the attention on the kernels' segments and gathered into padded
/// rows (`set_native_packed_attention(false)`), every other op on the packed tokens; each
/// equal to the CPU's packed pass (segments in its attention).
#[test]
fn packed_pass_through_gathered_attention_matches_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    for (name, native) in MODELS.iter().flat_map(|n| [(*n, true), (*n, false)]) {
        let (cpu_model, mut gpu_model) = models(&gpu, name);
        gpu_model.set_native_packed_attention(native);
        let (lp, grads) = packed_pass(&gpu_model);
        let (lp_cpu, grads_cpu) = packed_pass(&cpu_model);
        let real: Vec<usize> = (0..18).collect();
        let pick = |v: &[f32]| real.iter().map(|&i| v[i]).collect::<Vec<_>>();
        assert_close(
            &format!("{name} packed (native {native}) log-probs"),
            &pick(&lp),
            &pick(&lp_cpu),
            1e-4,
        );
        for ((n, g), (_, c)) in grads.iter().zip(&grads_cpu) {
            let err = rel_err(g, c);
            assert!(err <= 1e-4, "{name} packed (native {native}) {n}: {err:e}");
        }
    }
}

/// One loss-head training step (log-probs and entropies, the backward from ∂L/∂logπ,
/// two AdamW steps with clipping) on `model`; returns the log-probs, entropies, the step
/// reports and the weights after.
fn train_step<B: Backend>(
    model: &mut Model<B>,
    s: &Set,
) -> (Vec<f32>, Vec<f32>, Vec<StepReport>, Vec<Vec<f32>>) {
    train_step_in(model, s, GradDtype::F32)
}

/// [`train_step`] with gradients stored as `dtype`.
fn train_step_in<B: Backend>(
    model: &mut Model<B>,
    s: &Set,
    dtype: GradDtype,
) -> (Vec<f32>, Vec<f32>, Vec<StepReport>, Vec<Vec<f32>>) {
    let n = s.batch * s.seq;
    // Targets: the next input token (0 past the end); coefficients on valid tokens only.
    let targets: Vec<u32> = (0..n)
        .map(|i| {
            if (i + 1) % s.seq == 0 {
                0
            } else {
                s.input_ids[i + 1]
            }
        })
        .collect();
    let coeffs: Vec<f32> = (0..n)
        .map(|i| {
            if s.attention_mask[i] == 1 {
                ((i % 5) as f32 - 2.0) * 0.1
            } else {
                0.0
            }
        })
        .collect();
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    model.log_prob_entropy(&mut acts, &targets, 0.8).unwrap();
    let be = model.backend();
    let (mut lp, mut h) = (vec![0.0; n], vec![0.0; n]);
    be.download(acts.log_probs(), &mut lp).unwrap();
    be.download(acts.entropies(), &mut h).unwrap();
    let mut grads = model.grads_in(dtype).unwrap();
    model
        .backward_from_log_prob_grads(&s.inputs(), &mut acts, &targets, &coeffs, 0.8, &mut grads)
        .unwrap();
    // ε = 1e-3 rather than 1e-8: Adam's first steps move each weight by about ±lr·sign(g),
    // so a gradient element within rounding of 0 (GPU and CPU sum in different orders)
    // could move its weight by 2·lr on one device and not the other. With ε above the
    // rounding, the update is smooth in g and the comparison means something.
    let config = ares_model::model::AdamWConfig {
        eps: 1e-3,
        ..Default::default()
    };
    let mut opt = AdamW::new(model, config).unwrap();
    let reports = (0..2)
        .map(|_| opt.step(model, &grads, 1e-3, Some(0.05)).unwrap())
        .collect();
    let weights = model
        .to_weights()
        .unwrap()
        .tensors()
        .into_iter()
        .map(|(_, t)| t.data.clone())
        .collect();
    (lp, h, reports, weights)
}

/// A bf16 training step of a model whose heads the tensor-core kernels take (qwen3_tiny
/// redrawn at head_dim 64 and 128, 2 × 80 tokens: bf16 products throughout), on the GPU and
/// on the CPU twin: log-probs within 2e-3, the gradient norm within 1e-3 relative, the
/// weights after two AdamW steps within 1e-3 — bf16 rounding that an f32 sum order flips
/// now and then, not the f32 runs' 1e-5.
#[test]
fn bf16_training_step_on_tensor_cores_matches_the_cpu_twin() {
    let Some(gpu) = gpu_or_skip() else { return };
    for head_dim in [64, 128] {
        let ck = common::with_head_dim(Checkpoint::load(&fixture("qwen3_tiny")).unwrap(), head_dim);
        let mut cpu_model = Model::from_checkpoint(CpuBackend, &ck).unwrap();
        let mut gpu_model = Model::from_checkpoint(gpu.clone(), &ck).unwrap();
        cpu_model.set_matmul_precision(MatmulPrecision::Bf16);
        gpu_model.set_matmul_precision(MatmulPrecision::Bf16);
        let s = random_set(2, 80, ck.config.vocab_size as u32);
        let (glp, _, grep, gw) = train_step(&mut gpu_model, &s);
        let (clp, _, crep, cw) = train_step(&mut cpu_model, &s);
        let name = format!("head_dim {head_dim}");
        assert_close(&format!("{name} log_probs"), &glp, &clp, 2e-3);
        for (g, c) in grep.iter().zip(&crep) {
            assert!(g.applied && c.applied);
            let err = (g.grad_norm - c.grad_norm).abs() / c.grad_norm;
            assert!(
                err <= 1e-3,
                "{name} grad norm {} vs {}",
                g.grad_norm,
                c.grad_norm
            );
        }
        for (i, (g, c)) in gw.iter().zip(&cw).enumerate() {
            let err = rel_err(g, c);
            assert!(err <= 1e-3, "{name} weight tensor {i}: {err:e}");
        }
    }
}

/// `batch` rows of `seq` random tokens (a fixed seed), the first row's last 5 padding.
fn random_set(batch: usize, seq: usize, vocab: u32) -> Set {
    let mut rng = Rng(99);
    let ids = rng.ids(batch * seq, vocab);
    let mut mask = vec![1u32; batch * seq];
    mask[seq - 5..seq].fill(0); // sequence 0 right-padded
    Set {
        batch,
        seq,
        input_ids: ids,
        attention_mask: mask,
        position_ids: (0..batch * seq).map(|i| (i % seq) as u32).collect(),
        logits: Vec::new(),
        dlogits: Vec::new(),
    }
}

/// Linear weights stored in bf16 (`Model::set_weight_storage`): the stochastic rounding
/// and widening kernels give the CPU's bits (the same counter-based random bits), and a
/// bf16 training step on the GPU matches the CPU twin's — log-probs within 2e-3, and after
/// two AdamW steps the weights within one bf16 ulp, unequal in few elements (an f32
/// update that lands on the other side of a rounding threshold on one device) — with f32
/// gradients and with gradients stored in bf16 (`GradDtype::Bf16`: the accumulation's
/// stochastic rounding draws the CPU's bits too).
#[test]
fn bf16_weight_storage_matches_cpu() {
    use ares_model::model::WeightStorage;
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(21);
    for n in [0usize, 1, 1000, 300_001] {
        let x = rng.vec(n, 2.0);
        let key = 0x1234_5678_9abc_def0 ^ n as u64;
        let mut g16 = gpu.alloc_half(n, DType::Bf16).unwrap();
        gpu.round_bf16_stochastic(View::whole(&up(&gpu, &x)), key, ViewMut::whole(&mut g16))
            .unwrap();
        let mut c16 = cpu.alloc_half(n, DType::Bf16).unwrap();
        cpu.round_bf16_stochastic(View::whole(&x), key, ViewMut::whole(&mut c16))
            .unwrap();
        let (mut gb, mut cb) = (vec![0u16; n], vec![0u16; n]);
        gpu.download_half(View::whole(&g16), &mut gb).unwrap();
        cpu.download_half(View::whole(&c16), &mut cb).unwrap();
        assert_eq!(gb, cb, "round_bf16_stochastic n={n}");
        let mut g32 = gpu.alloc(n).unwrap();
        gpu.widen_bf16(View::whole(&g16), ViewMut::whole(&mut g32))
            .unwrap();
        let widened: Vec<f32> = cb
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        assert_eq!(down(&gpu, &g32), widened, "widen_bf16 n={n}");
    }
    // the weight matrices stored in bf16 (a tied and an untied embedding): two steps
    for (name, dtype) in [
        ("qwen2_tiny", GradDtype::F32),
        ("llama_tiny", GradDtype::F32),
        ("qwen2_tiny", GradDtype::Bf16),
        ("llama_tiny", GradDtype::Bf16),
    ] {
        let (mut cpu_model, mut gpu_model) = models(&gpu, name);
        cpu_model.set_matmul_precision(MatmulPrecision::Bf16);
        gpu_model.set_matmul_precision(MatmulPrecision::Bf16);
        cpu_model.set_weight_storage(WeightStorage::Bf16).unwrap();
        gpu_model.set_weight_storage(WeightStorage::Bf16).unwrap();
        assert_eq!(gpu_model.weight_storage(), WeightStorage::Bf16);
        let s = random_set(2, 40, gpu_model.spec().vocab as u32);
        let (glp, _, _, gw) = train_step_in(&mut gpu_model, &s, dtype);
        let (clp, _, _, cw) = train_step_in(&mut cpu_model, &s, dtype);
        let name = format!("{name} ({} gradients)", dtype.name());
        assert_close(&format!("{name} bf16 weights: log_probs"), &glp, &clp, 2e-3);
        let (mut unequal, mut total) = (0usize, 0usize);
        for (i, (g, c)) in gw.iter().zip(&cw).enumerate() {
            for (&a, &b) in g.iter().zip(c) {
                let ulp = f32::from_bits((b.abs().to_bits() & 0xffff_0000) + 0x1_0000) - b.abs();
                assert!(
                    (a - b).abs() <= ulp.max(1e-6),
                    "{name} tensor {i}: {a} vs {b}"
                );
                unequal += usize::from(a != b);
            }
            total += c.len();
        }
        eprintln!(
            "{name} bf16 weights after two steps: {unequal} of {total} elements differ by an ulp"
        );
        assert!(unequal * 100 <= total, "{name}: {unequal} of {total}");
    }
}

#[test]
fn training_step_matches_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    for name in ["qwen2_tiny", "qwen3_tiny"] {
        let (mut cpu_model, mut gpu_model) = models(&gpu, name);
        let s = Set::load(name, "left");
        let (glp, gh, grep, gw) = train_step(&mut gpu_model, &s);
        let (clp, ch, crep, cw) = train_step(&mut cpu_model, &s);
        let valid = |x: &[f32]| -> Vec<f32> {
            x.iter()
                .zip(&s.attention_mask)
                .filter(|(_, m)| **m == 1)
                .map(|(v, _)| *v)
                .collect()
        };
        assert_close(
            &format!("{name} log_probs"),
            &valid(&glp),
            &valid(&clp),
            1e-5,
        );
        assert_close(&format!("{name} entropies"), &valid(&gh), &valid(&ch), 1e-5);
        for (g, c) in grep.iter().zip(&crep) {
            assert!(g.applied && c.applied);
            let err = (g.grad_norm - c.grad_norm).abs() / c.grad_norm;
            assert!(
                err <= 1e-4,
                "{name} grad norm {} vs {}",
                g.grad_norm,
                c.grad_norm
            );
        }
        for (i, (g, c)) in gw.iter().zip(&cw).enumerate() {
            let err = rel_err(g, c);
            assert!(err <= 1e-5, "{name} weight tensor {i}: {err:e}");
        }
    }
}

#[test]
fn greedy_generation_equals_cpu_and_transformers() {
    let Some(gpu) = gpu_or_skip() else { return };
    for name in MODELS {
        let (cpu_model, gpu_model) = models(&gpu, name);
        let text = std::fs::read_to_string(fixture(name).join("greedy.json")).unwrap();
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        let prompts: Vec<Vec<u32>> = serde_json::from_value(doc["prompts"].clone()).unwrap();
        let expected: Vec<Vec<u32>> =
            serde_json::from_value(doc["batched_left_padded"].clone()).unwrap();
        let request = GenerateRequest {
            prompts,
            max_new_tokens: 8,
            eos_ids: Vec::new(),
            sampling: Sampling::Greedy,
            seed: 0,
        };
        let ours = gpu_model.generate(&request).unwrap();
        let cpu = cpu_model.generate(&request).unwrap();
        assert_eq!(ours.tokens, expected, "{name}: greedy vs transformers");
        assert_eq!(ours.tokens, cpu.tokens, "{name}: greedy vs CPU");
        let flat = |x: &[Vec<f32>]| x.concat();
        assert_close(
            &format!("{name} generation log_probs"),
            &flat(&ours.log_probs),
            &flat(&cpu.log_probs),
            1e-4,
        );
        assert_close(
            &format!("{name} generation entropies"),
            &flat(&ours.entropies),
            &flat(&cpu.entropies),
            1e-4,
        );
    }
}

// ----- ARES token ops and copy. -----

/// A `[rows, cols]` 0/1 response mask with rows of random lengths (some empty, some full).
fn response_mask(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut m = vec![0.0f32; rows * cols];
    for r in 0..rows {
        let len = (rng.next() % (cols as u64 + 1)) as usize;
        m[r * cols..r * cols + len].fill(1.0);
    }
    m
}

/// `host` in a buffer with `pad` junk elements before it: the op must honour view offsets.
fn up_at<B: Backend>(be: &B, host: &[f32], pad: usize) -> B::Buffer {
    let mut b = be.alloc(pad + host.len()).unwrap();
    be.fill(ViewMut::whole(&mut b), f32::NAN).unwrap();
    be.upload(host, ViewMut::new(&mut b, pad, host.len()).unwrap())
        .unwrap();
    b
}

fn tail<T: DeviceBuffer>(b: &T, pad: usize) -> View<'_, T> {
    View::new(b, pad, b.len() - pad).unwrap()
}

fn tail_mut<T: DeviceBuffer>(b: &mut T, pad: usize) -> ViewMut<'_, T> {
    let len = b.len() - pad;
    ViewMut::new(b, pad, len).unwrap()
}

fn down_tail<B: Backend>(be: &B, b: &B::Buffer, pad: usize) -> Vec<f32> {
    let mut v = vec![0.0; b.len() - pad];
    be.download(tail(b, pad), &mut v).unwrap();
    v
}

/// HWE windows, counts and soft costs, and the row percentiles, on views at odd offsets:
/// windows and counts exactly, means and costs to f32 summation order.
#[test]
fn entropy_windows_and_row_percentile_match_cpu() {
    use ares_model::backend::{HweViews, WindowSpec};
    let Some(gpu) = gpu_or_skip() else { return };
    let mut rng = Rng(21);
    for (rows, cols, window, includes_self, pad) in [
        (1, 8, 4, false, 0),
        (7, 33, 4, true, 3),
        (64, 257, 6, false, 5),
        (3, 1, 1, true, 1),
    ] {
        let n = rows * cols;
        let h: Vec<f32> = rng.vec(n, 1.5).iter().map(|x| x + 1.5).collect();
        let mask = response_mask(&mut rng, rows, cols);
        let trigger: Vec<f32> = (0..n)
            .map(|_| f32::from(rng.next().is_multiple_of(3)))
            .collect();
        let spec = WindowSpec {
            cols,
            window_size: window,
            includes_self,
        };
        let mut outs: Vec<Vec<Vec<f32>>> = Vec::new();
        macro_rules! pass {
            ($be:expr) => {{
                let be = $be;
                let (dh, dm, dt) = (
                    up_at(be, &h, pad),
                    up_at(be, &mask, pad),
                    up_at(be, &trigger, pad),
                );
                let (mut means, mut valid, mut hwe) = (
                    up_at(be, &vec![0.0; n], pad),
                    up_at(be, &vec![0.0; n], pad),
                    up_at(be, &vec![0.0; n], pad),
                );
                let (mut counts, mut cost) = (
                    up_at(be, &vec![0.0; rows], pad),
                    up_at(be, &vec![0.0; rows], pad),
                );
                be.entropy_windows(
                    tail(&dh, pad),
                    tail(&dm, pad),
                    spec,
                    Some(HweViews {
                        tau: 1.4,
                        trigger: Some(tail(&dt, pad)),
                        hwe_mask: tail_mut(&mut hwe, pad),
                        counts: tail_mut(&mut counts, pad),
                        soft_cost: tail_mut(&mut cost, pad),
                    }),
                    tail_mut(&mut means, pad),
                    tail_mut(&mut valid, pad),
                )
                .unwrap();
                let (mut thr, mut has) = (
                    up_at(be, &vec![0.0; rows], pad),
                    up_at(be, &vec![0.0; rows], pad),
                );
                be.row_percentile(
                    tail(&means, pad),
                    tail(&valid, pad),
                    cols,
                    95.0,
                    tail_mut(&mut thr, pad),
                    tail_mut(&mut has, pad),
                )
                .unwrap();
                vec![
                    down_tail(be, &means, pad),
                    down_tail(be, &valid, pad),
                    down_tail(be, &hwe, pad),
                    down_tail(be, &counts, pad),
                    down_tail(be, &cost, pad),
                    down_tail(be, &thr, pad),
                    down_tail(be, &has, pad),
                ]
            }};
        }
        outs.push(pass!(&CpuBackend));
        outs.push(pass!(&gpu));
        let (c, g) = (&outs[0], &outs[1]);
        let what = format!("rows {rows} cols {cols} w {window} self {includes_self} pad {pad}");
        assert_close(&format!("{what}: means"), &g[0], &c[0], 1e-6);
        for (i, name) in [(1, "valid"), (2, "hwe mask"), (3, "counts"), (6, "has")] {
            assert_eq!(g[i], c[i], "{what}: {name}");
        }
        assert_close(&format!("{what}: soft cost"), &g[4], &c[4], 1e-5);
        assert_close(&format!("{what}: thresholds"), &g[5], &c[5], 1e-6);
    }
}

/// The masked dynamic KL for every estimator, with and without an HWE mask, on views at
/// odd offsets (the kernel's 16-byte path must not be taken there).
#[test]
fn masked_dynamic_kl_matches_cpu() {
    use ares_core::kl::KlEstimator;
    use ares_model::backend::{KlSumViews, KlViews};
    let Some(gpu) = gpu_or_skip() else { return };
    let mut rng = Rng(22);
    for (rows, cols, pad) in [(4, 16, 0), (9, 40, 1), (33, 129, 2)] {
        let n = rows * cols;
        let logp: Vec<f32> = rng.vec(n, 1.5).iter().map(|x| x - 1.6).collect();
        let ref_logp: Vec<f32> = rng.vec(n, 1.5).iter().map(|x| x - 1.6).collect();
        let mask = response_mask(&mut rng, rows, cols);
        let hwe: Vec<f32> = (0..n)
            .map(|_| f32::from(rng.next().is_multiple_of(4)))
            .collect();
        let beta: Vec<f32> = (0..rows).map(|_| 0.01 + rng.f32(0.005)).collect();
        for estimator in [
            KlEstimator::K1,
            KlEstimator::Abs,
            KlEstimator::K2,
            KlEstimator::K3,
            KlEstimator::K3Plus,
        ] {
            for with_hwe in [false, true] {
                macro_rules! pass {
                    ($be:expr) => {{
                        let be = $be;
                        let (dl, dr, dm, dh, db) = (
                            up_at(be, &logp, pad),
                            up_at(be, &ref_logp, pad),
                            up_at(be, &mask, pad),
                            up_at(be, &hwe, pad),
                            up_at(be, &beta, pad),
                        );
                        let mut w = up_at(be, &vec![0.0; n], pad);
                        let (mut sums, mut means) = (
                            up_at(be, &vec![0.0; rows], pad),
                            up_at(be, &vec![0.0; rows], pad),
                        );
                        be.masked_dynamic_kl(
                            KlViews {
                                logp: tail(&dl, pad),
                                ref_logp: tail(&dr, pad),
                                mask: tail(&dm, pad),
                                hwe_mask: with_hwe.then(|| tail(&dh, pad)),
                                beta_rows: tail(&db, pad),
                                low_ratio: 0.5,
                                estimator,
                                cols,
                            },
                            KlSumViews {
                                weighted: Some(tail_mut(&mut w, pad)),
                                row_weighted_sum: tail_mut(&mut sums, pad),
                                row_mean_kl: tail_mut(&mut means, pad),
                            },
                        )
                        .unwrap();
                        [
                            down_tail(be, &w, pad),
                            down_tail(be, &sums, pad),
                            down_tail(be, &means, pad),
                        ]
                    }};
                }
                let (c, g) = (pass!(&CpuBackend), pass!(&gpu));
                let what = format!(
                    "rows {rows} cols {cols} pad {pad} {} hwe {with_hwe}",
                    estimator.name()
                );
                assert_close(&format!("{what}: weighted"), &g[0], &c[0], 1e-5);
                assert!(rel_err(&g[1], &c[1]) <= 1e-5, "{what}: row sums");
                assert!(rel_err(&g[2], &c[2]) <= 1e-5, "{what}: row means");
            }
        }
    }
}

/// `copy` between views at different offsets, bit for bit.
#[test]
fn copy_matches_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let mut rng = Rng(23);
    let src = rng.vec(1000, 3.0);
    let d_src = up(&gpu, &src);
    let mut d_dst = up(&gpu, &vec![0.0; 1003]);
    gpu.copy(
        View::new(&d_src, 7, 500).unwrap(),
        ViewMut::new(&mut d_dst, 3, 500).unwrap(),
    )
    .unwrap();
    let got = down(&gpu, &d_dst);
    assert_eq!(&got[3..503], &src[7..507]);
    assert!(got[..3].iter().chain(&got[503..]).all(|&x| x == 0.0));
    let e = gpu.copy(
        View::new(&d_src, 0, 10).unwrap(),
        ViewMut::new(&mut d_dst, 0, 11).unwrap(),
    );
    assert!(e.is_err(), "lengths that differ are an error");
}

// ----- Vision tower ops (Qwen2-VL / Qwen2.5-VL). -----

/// LayerNorm forward and backward on views at odd offsets: forward to 1e-6 (the same f64
/// statistics), backward to 1e-5 (sums in another order), including rows whose mean is
/// large next to their spread and a weight/bias gradient spanning many chunks.
#[test]
fn layer_norm_matches_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(31);
    for (rows, dim, offset) in [
        (7usize, 100usize, 0.0f32),
        (3, 1, 0.0),
        (2000, 12, 0.0),
        (5, 1280, 50.0),
    ] {
        let what = |op: &str| format!("{op} {rows}x{dim}");
        let pad = 3;
        let x: Vec<f32> = rng
            .vec(rows * dim, 3.0)
            .iter()
            .map(|v| v + offset)
            .collect();
        let (w, b) = (rng.vec(dim, 2.0), rng.vec(dim, 1.0));
        let (gx, gw, gb) = (up_at(&gpu, &x, pad), up(&gpu, &w), up(&gpu, &b));
        let mut go = up_at(&gpu, &vec![0.0; rows * dim], pad);
        let (mut gm, mut gr) = (gpu.alloc(rows).unwrap(), gpu.alloc(rows).unwrap());
        gpu.layer_norm(
            tail(&gx, pad),
            View::whole(&gw),
            View::whole(&gb),
            1e-6,
            dim,
            tail_mut(&mut go, pad),
            ViewMut::whole(&mut gm),
            ViewMut::whole(&mut gr),
        )
        .unwrap();
        let (mut co, mut cm, mut cr) = (vec![0.0; rows * dim], vec![0.0; rows], vec![0.0; rows]);
        cpu.layer_norm(
            View::whole(&x),
            View::whole(&w),
            View::whole(&b),
            1e-6,
            dim,
            ViewMut::whole(&mut co),
            ViewMut::whole(&mut cm),
            ViewMut::whole(&mut cr),
        )
        .unwrap();
        assert_close(
            &what("layer_norm out"),
            &down_tail(&gpu, &go, pad),
            &co,
            1e-6,
        );
        assert_close(&what("layer_norm mean"), &down(&gpu, &gm), &cm, 1e-6);
        assert_close(&what("layer_norm rstd"), &down(&gpu, &gr), &cr, 1e-6);

        // The gradients accumulate onto priors.
        let dy = rng.vec(rows * dim, 1.0);
        let (pdx, pdw, pdb) = (
            rng.vec(rows * dim, 1.0),
            rng.vec(dim, 1.0),
            rng.vec(dim, 1.0),
        );
        let (mut gdx, mut gdw, mut gdb) = (up_at(&gpu, &pdx, pad), up(&gpu, &pdw), up(&gpu, &pdb));
        gpu.layer_norm_backward(
            View::whole(&up(&gpu, &dy)),
            tail(&gx, pad),
            View::whole(&gw),
            View::whole(&gm),
            View::whole(&gr),
            dim,
            tail_mut(&mut gdx, pad),
            ViewMut::whole(&mut gdw),
            ViewMut::whole(&mut gdb),
        )
        .unwrap();
        let (mut cdx, mut cdw, mut cdb) = (pdx.clone(), pdw.clone(), pdb.clone());
        cpu.layer_norm_backward(
            View::whole(&dy),
            View::whole(&x),
            View::whole(&w),
            View::whole(&cm),
            View::whole(&cr),
            dim,
            ViewMut::whole(&mut cdx),
            ViewMut::whole(&mut cdw),
            ViewMut::whole(&mut cdb),
        )
        .unwrap();
        assert_close(
            &what("layer_norm_backward dx"),
            &down_tail(&gpu, &gdx, pad),
            &cdx,
            1e-5,
        );
        assert_close(
            &what("layer_norm_backward dweight"),
            &down(&gpu, &gdw),
            &cdw,
            1e-5,
        );
        assert_close(
            &what("layer_norm_backward dbias"),
            &down(&gpu, &gdb),
            &cdb,
            1e-5,
        );
    }
    let mut o = gpu.alloc(6).unwrap();
    let (mut m, mut r) = (gpu.alloc(2).unwrap(), gpu.alloc(2).unwrap());
    let x = up(&gpu, &[1.0; 6]);
    let e = gpu
        .layer_norm(
            View::whole(&x),
            View::new(&x, 0, 3).unwrap(),
            View::new(&x, 0, 2).unwrap(),
            1e-6,
            3,
            ViewMut::whole(&mut o),
            ViewMut::whole(&mut m),
            ViewMut::whole(&mut r),
        )
        .unwrap_err();
    assert!(e.to_string().contains("`bias` has 2 elements"), "{e}");
}

/// The three activations and their derivatives over a wide range and in the tails: the
/// GPU's f32 `erfcf`/`expf` against the CPU's f64 evaluation, to 2e-6 (a few ulps).
#[test]
fn activations_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(32);
    let mut x = rng.vec(20_000, 8.0);
    x.extend([0.0, 1e-3, -1e-3, 20.0, -20.0, 100.0, -100.0, 1e30, -1e30]);
    let dout = rng.vec(x.len(), 2.0);
    let (gx, gd) = (up(&gpu, &x), up(&gpu, &dout));
    for kind in [
        Activation::GeluErf,
        Activation::QuickGelu,
        Activation::GeluTanh,
    ] {
        let mut go = gpu.alloc(x.len()).unwrap();
        gpu.activation(kind, View::whole(&gx), ViewMut::whole(&mut go))
            .unwrap();
        let mut co = vec![0.0; x.len()];
        cpu.activation(kind, View::whole(&x), ViewMut::whole(&mut co))
            .unwrap();
        assert_close(&format!("{kind:?}"), &down(&gpu, &go), &co, 2e-6);

        let mut gdx = up(&gpu, &vec![f32::NAN; x.len()]);
        gpu.activation_backward(
            kind,
            View::whole(&gd),
            View::whole(&gx),
            ViewMut::whole(&mut gdx),
        )
        .unwrap();
        let mut cdx = vec![0.0; x.len()];
        cpu.activation_backward(
            kind,
            View::whole(&dout),
            View::whole(&x),
            ViewMut::whole(&mut cdx),
        )
        .unwrap();
        assert_close(&format!("{kind:?} backward"), &down(&gpu, &gdx), &cdx, 2e-6);
    }
}

/// Segment attention forward and backward: empty segments, segments spanning several
/// query/key tiles and tiles spanning segment boundaries, both head-size classes (16 and
/// Qwen2-VL's 80); attention tolerance 1e-4. Offsets that are not cu_seqlens are reported
/// at the next waiting call; a wrong count is an error before launch.
/// The tensor-core kernels over segments against their CPU twin (bounds as
/// `tensor_core_attention_matches_its_cpu_twin`): empty segments, segments crossing the
/// 64-key tiles, head sizes 64, 80 and 128.
/// One packed attention call and its backward on the GPU and on the CPU (`bf16`: the
/// tensor-core ops and the CPU twin; else the f32 ops), the key at index 40 masked:
/// `(what, GPU, CPU)` for out, lse, dq, dk and dv.
fn packed_attention_pair(
    gpu: &CudaBackend,
    rng: &mut Rng,
    (cu, hq, hkv, d): (&[u32], usize, usize, usize),
    bf16: bool,
) -> Vec<(&'static str, Vec<f32>, Vec<f32>)> {
    let cpu = CpuBackend;
    let seq = *cu.last().unwrap() as usize;
    let dims = AttentionDims::new(1, seq, hq, hkv, d);
    let (qn, kn, ln) = (seq * hq * d, seq * hkv * d, seq * hq);
    let (q, k, v) = (rng.vec(qn, 2.0), rng.vec(kn, 2.0), rng.vec(kn, 1.0));
    let dout = rng.vec(qn, 1.0);
    let mask: Vec<f32> = (0..seq).map(|i| f32::from(u8::from(i != 40))).collect();
    let (gq, gk, gv, gm) = (up(gpu, &q), up(gpu, &k), up(gpu, &v), up(gpu, &mask));
    let (gcu, gdout) = (up_ids(gpu, cu), up(gpu, &dout));
    let cpu_cu = cu.to_vec(); // the CPU backend's id buffer
    let (mut go, mut gl) = (up(gpu, &vec![f32::NAN; qn]), up(gpu, &vec![f32::NAN; ln]));
    let (mut gdq, mut gdk, mut gdv) = (
        up(gpu, &vec![f32::NAN; qn]),
        up(gpu, &vec![f32::NAN; kn]),
        up(gpu, &vec![f32::NAN; kn]),
    );
    let g_in = || AttentionInputs {
        q: View::whole(&gq),
        k: View::whole(&gk),
        v: View::whole(&gv),
        key_mask: Some(View::whole(&gm)),
    };
    let (mut co, mut cl) = (vec![0.0; qn], vec![0.0; ln]);
    let (mut cdq, mut cdk, mut cdv) = (vec![0.0; qn], vec![0.0; kn], vec![0.0; kn]);
    let c_in = || AttentionInputs {
        q: View::whole(&q),
        k: View::whole(&k),
        v: View::whole(&v),
        key_mask: Some(View::whole(&mask)),
    };
    let (g_out, g_lse) = (ViewMut::whole(&mut go), ViewMut::whole(&mut gl));
    let (c_out, c_lse) = (ViewMut::whole(&mut co), ViewMut::whole(&mut cl));
    if bf16 {
        gpu.attention_bf16(dims, g_in(), Some(&gcu), g_out, g_lse)
            .unwrap();
        cpu.attention_bf16(dims, c_in(), Some(&cpu_cu), c_out, c_lse)
            .unwrap();
    } else {
        gpu.attention(dims, g_in(), Some(&gcu), g_out, g_lse)
            .unwrap();
        cpu.attention(dims, c_in(), Some(&cpu_cu), c_out, c_lse)
            .unwrap();
    }
    let g_saved = (View::whole(&go), View::whole(&gl), View::whole(&gdout));
    let g_grads = AttentionGrads {
        dq: ViewMut::whole(&mut gdq),
        dk: ViewMut::whole(&mut gdk),
        dv: ViewMut::whole(&mut gdv),
    };
    let c_saved = (View::whole(&co), View::whole(&cl), View::whole(&dout));
    let c_grads = AttentionGrads {
        dq: ViewMut::whole(&mut cdq),
        dk: ViewMut::whole(&mut cdk),
        dv: ViewMut::whole(&mut cdv),
    };
    let (o, l, g) = g_saved;
    let (co_, cl_, cg) = c_saved;
    if bf16 {
        gpu.attention_backward_bf16(dims, g_in(), Some(&gcu), o, l, g, g_grads)
            .unwrap();
        cpu.attention_backward_bf16(dims, c_in(), Some(&cpu_cu), co_, cl_, cg, c_grads)
            .unwrap();
    } else {
        gpu.attention_backward(dims, g_in(), Some(&gcu), o, l, g, g_grads)
            .unwrap();
        cpu.attention_backward(dims, c_in(), Some(&cpu_cu), co_, cl_, cg, c_grads)
            .unwrap();
    }
    gpu.synchronize().unwrap(); // and the status word: no flag
    vec![
        ("out", down(gpu, &go), co),
        ("lse", down(gpu, &gl), cl),
        ("dq", down(gpu, &gdq), cdq),
        ("dk", down(gpu, &gdk), cdk),
        ("dv", down(gpu, &gdv), cdv),
    ]
}

/// Packed sequences (cu_seqlens) on the CUDA attention against the CPU's packed attention:
/// an empty segment, a one-token one, segments across several 64-row tiles, a masked key,
/// GQA. The tensor-core kernels against their CPU twin with the bounds of
/// `tensor_core_attention_matches_its_cpu_twin`; the f32 kernels' packed variants against
/// the CPU's f32 attention at two head-size classes.
#[test]
fn tensor_core_attention_over_packed_segments_matches_its_cpu_twin() {
    let Some(gpu) = gpu_or_skip() else { return };
    let mut rng = Rng(57);
    for (cu, hq, hkv, d) in [
        (vec![0u32, 5, 75, 76, 76, 206], 6usize, 2usize, 64usize),
        (vec![0u32, 97, 130], 4, 4, 80),
        (vec![0u32, 1, 130, 130], 4, 1, 128),
    ] {
        let what = |op: &str| {
            format!(
                "bf16 packed {op} t{} hq{hq} hkv{hkv} d{d}",
                cu[cu.len() - 1]
            )
        };
        for (name, got, want) in packed_attention_pair(&gpu, &mut rng, (&cu, hq, hkv, d), true) {
            match name {
                "lse" => {
                    for (i, (g, c)) in got.iter().zip(&want).enumerate() {
                        let same =
                            g.to_bits() == c.to_bits() || (g - c).abs() <= 1e-5 * c.abs().max(1.0);
                        assert!(same, "{}: [{i}] {g} vs {c}", what(name));
                    }
                }
                "out" => assert_twin(&what(name), &got, &want, 5e-3),
                _ => assert_twin(&what(name), &got, &want, 2e-3),
            }
        }
    }
    for (cu, hq, hkv, d) in [
        (vec![0u32, 5, 75, 76, 76, 206], 6usize, 2usize, 64usize),
        (vec![0u32, 1, 40, 45, 45], 2, 1, 200),
    ] {
        for (name, got, want) in packed_attention_pair(&gpu, &mut rng, (&cu, hq, hkv, d), false) {
            let tol = if name.starts_with('d') { 1e-4 } else { 1e-5 };
            assert_close(&format!("f32 packed {name} d{d}"), &got, &want, tol);
        }
    }
}

#[test]
fn tensor_core_segment_attention_matches_its_cpu_twin() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(34);
    for (cu, heads, d) in [
        (vec![0u32, 0, 5, 5, 75, 76, 206, 206], 3usize, 64usize),
        (vec![0u32, 64, 128, 192, 256, 300], 2, 80),
        (vec![0u32, 130], 2, 128),
    ] {
        let tokens = *cu.last().unwrap() as usize;
        let dims = SegmentAttentionDims::new(tokens, cu.len() - 1, heads, d);
        let what = |op: &str| format!("{op} t{tokens} h{heads} d{d}");
        let (n, ln) = (tokens * heads * d, tokens * heads);
        let (q, k, v, dout) = (
            rng.vec(n, 2.0),
            rng.vec(n, 2.0),
            rng.vec(n, 1.0),
            rng.vec(n, 1.0),
        );
        let (gq, gk, gv, gcu) = (up(&gpu, &q), up(&gpu, &k), up(&gpu, &v), up_ids(&gpu, &cu));
        let (mut go, mut gl) = (up(&gpu, &vec![f32::NAN; n]), up(&gpu, &vec![f32::NAN; ln]));
        gpu.segment_attention_bf16(
            dims,
            &gcu,
            View::whole(&gq),
            View::whole(&gk),
            View::whole(&gv),
            ViewMut::whole(&mut go),
            ViewMut::whole(&mut gl),
        )
        .unwrap();
        let (mut co, mut cl) = (vec![0.0; n], vec![0.0; ln]);
        cpu.segment_attention_bf16(
            dims,
            &cu,
            View::whole(&q),
            View::whole(&k),
            View::whole(&v),
            ViewMut::whole(&mut co),
            ViewMut::whole(&mut cl),
        )
        .unwrap();
        let mut outputs = vec![(what("bf16 segment out"), down(&gpu, &go), co.clone())];
        let lse = down(&gpu, &gl);
        for (i, (g, c)) in lse.iter().zip(&cl).enumerate() {
            assert!(
                (g - c).abs() <= 1e-5 * c.abs().max(1.0),
                "{}: lse[{i}] {g} vs {c}",
                what("bf16 segment")
            );
        }
        let (mut gdq, mut gdk, mut gdv) = (
            up(&gpu, &vec![f32::NAN; n]),
            up(&gpu, &vec![f32::NAN; n]),
            up(&gpu, &vec![f32::NAN; n]),
        );
        gpu.segment_attention_backward_bf16(
            dims,
            &gcu,
            View::whole(&gq),
            View::whole(&gk),
            View::whole(&gv),
            View::whole(&go),
            View::whole(&gl),
            View::whole(&up(&gpu, &dout)),
            ViewMut::whole(&mut gdq),
            ViewMut::whole(&mut gdk),
            ViewMut::whole(&mut gdv),
        )
        .unwrap();
        let (mut cdq, mut cdk, mut cdv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        cpu.segment_attention_backward_bf16(
            dims,
            &cu,
            View::whole(&q),
            View::whole(&k),
            View::whole(&v),
            View::whole(&co),
            View::whole(&cl),
            View::whole(&dout),
            ViewMut::whole(&mut cdq),
            ViewMut::whole(&mut cdk),
            ViewMut::whole(&mut cdv),
        )
        .unwrap();
        for (name, g, c) in [("dq", &gdq, cdq), ("dk", &gdk, cdk), ("dv", &gdv, cdv)] {
            outputs.push((what(&format!("bf16 segment {name}")), down(&gpu, g), c));
        }
        for (label, got, want) in outputs {
            assert_twin(&label, &got, &want, 5e-3);
        }

        // q, k, v stored in bf16 (the tower's activations in bf16): the kernels read the
        // bits where they rounded the f32 values — the same outputs, bit for bit; the
        // output stored in bf16 is the f32 one rounded once
        let half = |x: &[f32]| up_bf16(&gpu, x);
        let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let (hq16, hk16, hv16) = (half(&q), half(&k), half(&v));
        let (mut so, mut sl) = (up(&gpu, &vec![f32::NAN; n]), up(&gpu, &vec![f32::NAN; ln]));
        gpu.segment_attention_bf16_stored(
            dims,
            &gcu,
            View::whole(&hq16),
            View::whole(&hk16),
            View::whole(&hv16),
            Some(ViewMut::whole(&mut so)),
            None,
            ViewMut::whole(&mut sl),
        )
        .unwrap();
        let label = what("bf16-stored segment");
        assert_eq!(bits(down(&gpu, &so)), bits(down(&gpu, &go)), "{label}: out");
        assert_eq!(bits(down(&gpu, &sl)), bits(down(&gpu, &gl)), "{label}: lse");
        let mut o16 = gpu.alloc_half(n, DType::Bf16).unwrap();
        gpu.segment_attention_bf16_stored(
            dims,
            &gcu,
            View::whole(&hq16),
            View::whole(&hk16),
            View::whole(&hv16),
            None,
            Some(ViewMut::whole(&mut o16)),
            ViewMut::whole(&mut sl),
        )
        .unwrap();
        let mut got16 = vec![0u16; n];
        gpu.download_half(View::whole(&o16), &mut got16).unwrap();
        let want16: Vec<u16> = down(&gpu, &go)
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        assert_eq!(got16, want16, "{label}: the output in bf16");
        // the backward over the stored bits: from the f32 output, the f32 kernels' bits;
        // from the bf16 output, the CPU's stored backward
        let gdout = up(&gpu, &dout);
        let stored_backward = |out: Option<View<'_, _>>, out16| {
            let mut g = [(); 3].map(|()| up(&gpu, &vec![f32::NAN; n]));
            let [dq, dk, dv] = &mut g;
            gpu.segment_attention_backward_bf16_stored(
                dims,
                &gcu,
                View::whole(&hq16),
                View::whole(&hk16),
                View::whole(&hv16),
                out,
                out16,
                View::whole(&gl),
                View::whole(&gdout),
                ViewMut::whole(dq),
                ViewMut::whole(dk),
                ViewMut::whole(dv),
            )
            .unwrap();
            g.map(|b| down(&gpu, &b))
        };
        let from_f32 = stored_backward(Some(View::whole(&go)), None);
        for (name, s16, g) in [("dq", 0, &gdq), ("dk", 1, &gdk), ("dv", 2, &gdv)] {
            let stored = bits(from_f32[s16].clone());
            assert_eq!(stored, bits(down(&gpu, g)), "{label}: {name}");
        }
        let from_16 = stored_backward(None, Some(View::whole(&o16)));
        let hb = |x: &[f32]| up_bf16(&cpu, x);
        let (cq16, ck16, cv16, co16) = (hb(&q), hb(&k), hb(&v), hb(&down(&gpu, &go)));
        let mut want = [(); 3].map(|()| vec![0.0f32; n]);
        let [wq, wk, wv] = &mut want;
        cpu.segment_attention_backward_bf16_stored(
            dims,
            &cu,
            View::whole(&cq16),
            View::whole(&ck16),
            View::whole(&cv16),
            None,
            Some(View::whole(&co16)),
            View::whole(&cl),
            View::whole(&dout),
            ViewMut::whole(wq),
            ViewMut::whole(wk),
            ViewMut::whole(wv),
        )
        .unwrap();
        for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
            let l = format!("{label}: {name} from the bf16 output");
            assert_twin(&l, &from_16[i], &want[i], 5e-3);
        }
    }
}

#[test]
fn segment_attention_matches_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(33);
    for (cu, heads, d) in [
        (vec![0u32, 0, 5, 5, 75, 76, 206, 206], 3usize, 16usize),
        (vec![0u32, 40, 41, 150], 2, 80),
        (vec![0u32, 33], 1, 128),
    ] {
        let tokens = *cu.last().unwrap() as usize;
        let dims = SegmentAttentionDims::new(tokens, cu.len() - 1, heads, d);
        let what = |op: &str| format!("{op} t{tokens} h{heads} d{d}");
        let (n, ln) = (tokens * heads * d, tokens * heads);
        let (q, k, v) = (rng.vec(n, 1.5), rng.vec(n, 1.5), rng.vec(n, 1.0));
        let (gq, gk, gv, gcu) = (up(&gpu, &q), up(&gpu, &k), up(&gpu, &v), up_ids(&gpu, &cu));
        let (mut go, mut gl) = (up(&gpu, &vec![f32::NAN; n]), up(&gpu, &vec![f32::NAN; ln]));
        gpu.segment_attention(
            dims,
            &gcu,
            View::whole(&gq),
            View::whole(&gk),
            View::whole(&gv),
            ViewMut::whole(&mut go),
            ViewMut::whole(&mut gl),
        )
        .unwrap();
        let (mut co, mut cl) = (vec![0.0; n], vec![0.0; ln]);
        cpu.segment_attention(
            dims,
            &cu,
            View::whole(&q),
            View::whole(&k),
            View::whole(&v),
            ViewMut::whole(&mut co),
            ViewMut::whole(&mut cl),
        )
        .unwrap();
        assert_close(&what("segment_attention out"), &down(&gpu, &go), &co, 1e-4);
        assert_close(&what("segment_attention lse"), &down(&gpu, &gl), &cl, 1e-4);

        let dout = rng.vec(n, 1.0);
        let (mut gdq, mut gdk, mut gdv) = (
            up(&gpu, &vec![f32::NAN; n]),
            up(&gpu, &vec![f32::NAN; n]),
            up(&gpu, &vec![f32::NAN; n]),
        );
        gpu.segment_attention_backward(
            dims,
            &gcu,
            View::whole(&gq),
            View::whole(&gk),
            View::whole(&gv),
            View::whole(&go),
            View::whole(&gl),
            View::whole(&up(&gpu, &dout)),
            ViewMut::whole(&mut gdq),
            ViewMut::whole(&mut gdk),
            ViewMut::whole(&mut gdv),
        )
        .unwrap();
        let (mut cdq, mut cdk, mut cdv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        cpu.segment_attention_backward(
            dims,
            &cu,
            View::whole(&q),
            View::whole(&k),
            View::whole(&v),
            View::whole(&co),
            View::whole(&cl),
            View::whole(&dout),
            ViewMut::whole(&mut cdq),
            ViewMut::whole(&mut cdk),
            ViewMut::whole(&mut cdv),
        )
        .unwrap();
        assert_close(&what("segment_attention dq"), &down(&gpu, &gdq), &cdq, 1e-4);
        assert_close(&what("segment_attention dk"), &down(&gpu, &gdk), &cdk, 1e-4);
        assert_close(&what("segment_attention dv"), &down(&gpu, &gdv), &cdv, 1e-4);
    }

    let dims = SegmentAttentionDims::new(4, 2, 1, 4);
    let x = up(&gpu, &[0.5; 16]);
    let (mut o, mut l) = (gpu.alloc(16).unwrap(), gpu.alloc(4).unwrap());
    for (cu, before_launch) in [
        (vec![0u32, 4], true),
        (vec![0u32, 3, 2], false),
        (vec![0u32, 2, 5], false),
    ] {
        let r = gpu.segment_attention(
            dims,
            &up_ids(&gpu, &cu),
            View::whole(&x),
            View::whole(&x),
            View::whole(&x),
            ViewMut::whole(&mut o),
            ViewMut::whole(&mut l),
        );
        let e = if before_launch {
            r.unwrap_err()
        } else {
            r.unwrap();
            gpu.synchronize().unwrap_err()
        };
        assert!(e.to_string().contains("cu_seqlens"), "{cu:?}: {e}");
    }
    gpu.synchronize().unwrap();
}

/// Row scatter bit for bit, on views at an offset, and an index >= rows reported at the
/// next waiting call with the other rows written.
#[test]
fn scatter_rows_matches_cpu_and_reports_bad_indices() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(34);
    let (rows, dim, pad) = (300usize, 40usize, 5usize);
    let index: Vec<u32> = (0..rows as u32).rev().step_by(3).collect();
    let src = rng.vec(index.len() * dim, 1.0);
    let before = rng.vec(rows * dim, 1.0);
    let mut gdst = up_at(&gpu, &before, pad);
    gpu.scatter_rows(
        View::whole(&up(&gpu, &src)),
        &up_ids(&gpu, &index),
        rows,
        dim,
        tail_mut(&mut gdst, pad),
    )
    .unwrap();
    let mut cdst = before.clone();
    cpu.scatter_rows(
        View::whole(&src),
        &index,
        rows,
        dim,
        ViewMut::whole(&mut cdst),
    )
    .unwrap();
    assert_close("scatter_rows", &down_tail(&gpu, &gdst, pad), &cdst, 0.0);

    let mut dst = up(&gpu, &[0.0; 8]);
    gpu.scatter_rows(
        View::whole(&up(&gpu, &[1.0, 2.0, 3.0, 4.0])),
        &up_ids(&gpu, &[4, 1]),
        4,
        2,
        ViewMut::whole(&mut dst),
    )
    .unwrap();
    let mut host = vec![0.0; 8];
    let e = gpu.download(View::whole(&dst), &mut host).unwrap_err();
    assert!(e.to_string().contains("scatter_rows"), "{e}");
    assert_eq!(host, [0.0, 0.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0]);
    gpu.synchronize().unwrap();
}

/// LoRA on the GPU (`model/lora.rs`): the same random pairs on every linear layer of each
/// fixture on both backends, the base frozen. The adapted logits and the pairs' gradients
/// equal the CPU's, one AdamW step sees the same gradient norm, and with the adapters off the
/// logits are the base model's, bit for bit.
#[test]
fn lora_training_matches_cpu() {
    use ares_model::hf::lora::{LoraAdapter, LoraConfig, LoraPair, TARGETS, weight_name};
    let Some(gpu) = gpu_or_skip() else { return };
    let config = LoraConfig::all_linear(4, 8.0);
    let mut rng = Rng(7);
    for name in MODELS {
        let checkpoint = Checkpoint::load(&fixture(name)).unwrap();
        let (mut cpu_model, mut gpu_model) = models(&gpu, name);
        let s = Set::load(name, "left");
        let base = gpu_model.forward_logits(&s.inputs()).unwrap();
        let mut pairs = std::collections::BTreeMap::new();
        for (n, t) in checkpoint.weights.tensors() {
            let adapted = (0..checkpoint.config.num_hidden_layers)
                .any(|l| TARGETS.iter().any(|m| weight_name(l, m) == n));
            if adapted {
                let (out, inp) = (t.shape[0], t.shape[1]);
                let pair = LoraPair {
                    a: rng.vec(config.r * inp, 0.3),
                    b: rng.vec(out * config.r, 0.3),
                    out_in: [out, inp],
                    kernel: Vec::new(),
                };
                pairs.insert(n, pair);
            }
        }
        let adapter = LoraAdapter {
            config: config.clone(),
            pairs,
            language_model: false,
        };
        cpu_model.load_lora(&adapter).unwrap();
        gpu_model.load_lora(&adapter).unwrap();
        let ours = gpu_model.forward_logits(&s.inputs()).unwrap();
        let cpu = cpu_model.forward_logits(&s.inputs()).unwrap();
        assert_close(&format!("{name} adapted logits"), &ours, &cpu, 1e-4);
        assert!(ours != base, "{name}: the adapter changes the model");
        {
            let _off = gpu_model.adapters_off();
            let off = gpu_model.forward_logits(&s.inputs()).unwrap();
            assert!(off == base, "{name}: adapters off is the base, bit for bit");
        }
        let (g_gpu, g_cpu) = (
            fixture_loss_grads(&gpu_model, &s),
            fixture_loss_grads(&cpu_model, &s),
        );
        for n in adapter.pairs.keys() {
            let stem = n.trim_end_matches(".weight");
            for which in ["A", "B"] {
                let t = format!("{stem}.lora_{which}.weight");
                let err = rel_err(
                    &g_gpu.download(&gpu, &t).unwrap(),
                    &g_cpu.download(&CpuBackend, &t).unwrap(),
                );
                assert!(err <= 1e-4, "{name} {t}: {err:e}");
            }
        }
        let (r_gpu, r_cpu) = (
            adamw_once(&mut gpu_model, &g_gpu),
            adamw_once(&mut cpu_model, &g_cpu),
        );
        assert!(r_gpu.applied && (r_gpu.grad_norm / r_cpu.grad_norm - 1.0).abs() < 1e-4);
        let _off = gpu_model.adapters_off();
        let off = gpu_model.forward_logits(&s.inputs()).unwrap();
        assert!(off == base, "{name}: the step left the base alone");
    }
}

/// One AdamW step of `model` from `g` at lr 1e-2.
fn adamw_once<B: Backend>(model: &mut Model<B>, g: &Grads<B>) -> StepReport {
    let mut opt = AdamW::new(model, Default::default()).unwrap();
    opt.step(model, g, 1e-2, None).unwrap()
}

/// The gradients of the fixture loss (explicit ∂L/∂logits): the weights', or with LoRA the
/// pairs'.
fn fixture_loss_grads<B: Backend>(model: &Model<B>, s: &Set) -> Grads<B> {
    let be = model.backend();
    let mut acts = model.activations(s.batch, s.seq).unwrap();
    model.forward(&s.inputs(), &mut acts).unwrap();
    let mut dlogits = be.alloc(s.dlogits.len()).unwrap();
    be.upload(&s.dlogits, ViewMut::whole(&mut dlogits)).unwrap();
    let mut grads: Grads<B> = model.grads().unwrap();
    model
        .backward(&s.inputs(), &mut acts, View::whole(&dlogits), &mut grads)
        .unwrap();
    grads
}

/// The engine on the GPU, counted (`backend::Counting`), with decode buckets: a decode step
/// without a prefill waits for the device once (the one-transfer pick), a shape's passes
/// after its first allocate nothing, its second pass is captured as a CUDA graph and the
/// later ones replayed; the tokens, log-probs and entropies are the bits of the same
/// passes run without graphs (`Counting::emulating_capture`: the captures "fail", the
/// passes run as they are), and the greedy tokens the CPU engine's.
#[test]
fn engine_decode_steps_wait_once_and_replay_graphs_on_the_gpu() {
    use ares_model::backend::Counting;
    use ares_model::model::{Engine, EngineConfig, EngineRequest, FinishedSequence};
    let Some(gpu) = gpu_or_skip() else { return };
    let checkpoint = Checkpoint::load(&fixture("qwen2_tiny")).unwrap();
    let graphs = Model::from_checkpoint(Counting::new(gpu.clone()), &checkpoint).unwrap();
    let eager = Model::from_checkpoint(Counting::emulating_capture(gpu), &checkpoint).unwrap();
    let cpu = Model::from_checkpoint(CpuBackend, &checkpoint).unwrap();
    let config = EngineConfig {
        decode_buckets: true,
        ..EngineConfig::default()
    };
    let prompts = [vec![1u32, 5, 9], vec![2, 7], vec![3, 4, 8, 6]];
    let sampled = Sampling::Sample {
        temperature: 1.0,
        top_k: None,
        top_p: 1.0,
        min_p: 0.0,
    };
    for sampling in [Sampling::Greedy, sampled] {
        let request = EngineRequest {
            max_new_tokens: 24,
            eos_ids: Vec::new(),
            sampling,
            seed: 3,
        };
        let mut outs: Vec<Vec<FinishedSequence>> = Vec::new();
        for (k, m) in [&graphs, &eager].into_iter().enumerate() {
            let generator = m.generator().unwrap();
            let mut engine = Engine::new(&generator, request.clone(), config).unwrap();
            for p in &prompts {
                engine.submit(p.clone()).unwrap();
            }
            m.backend().take();
            let (mut decode_steps, mut finished) = (0, Vec::new());
            while !engine.is_idle() {
                let before = engine.stats();
                finished.extend(engine.step().unwrap());
                let (after, c) = (engine.stats(), m.backend().take());
                let prefilled = after.prefill_passes > before.prefill_passes;
                if after.decode_passes > before.decode_passes && !prefilled {
                    assert_eq!(
                        c.host_waits, 1,
                        "{sampling:?} step {decode_steps}: {:?}",
                        c.calls
                    );
                    assert!(c.in_capture.is_empty(), "{sampling:?}: {:?}", c.in_capture);
                    decode_steps += 1;
                }
            }
            let stats = engine.stats();
            eprintln!("{sampling:?} {}: {stats:?}", ["graphs", "eager"][k]);
            assert!(decode_steps >= 20, "{decode_steps} decode steps");
            if k == 0 {
                assert_eq!(
                    stats.graph_failures, 0,
                    "a capture failed on the GPU: {stats:?}"
                );
                assert!(
                    stats.graph_captures >= 2 && stats.graph_replays >= 10,
                    "{stats:?}"
                );
            } else {
                assert_eq!((stats.graph_captures, stats.graph_replays), (0, 0));
            }
            finished.sort_by_key(|f| f.id);
            outs.push(finished);
        }
        for (a, b) in outs[0].iter().zip(&outs[1]) {
            assert_eq!(
                a.tokens, b.tokens,
                "{sampling:?} sequence {}: graphs vs eager",
                a.id
            );
            assert_eq!(a.log_probs, b.log_probs, "{sampling:?} sequence {}", a.id);
            assert_eq!(a.entropies, b.entropies, "{sampling:?} sequence {}", a.id);
        }
        if sampling == Sampling::Greedy {
            let g = cpu.generator().unwrap();
            let mut on_cpu = Engine::new(&g, request, config).unwrap();
            for p in &prompts {
                on_cpu.submit(p.clone()).unwrap();
            }
            let want = on_cpu.run_to_end(&mut |_, _| {}).unwrap();
            let got: Vec<Vec<u32>> = outs[0].iter().map(|f| f.tokens.clone()).collect();
            assert_eq!(
                got, want.tokens,
                "greedy tokens: the GPU engine with graphs vs the CPU's"
            );
        }
    }
}

/// The ops over activations stored in bf16 (`linear_bf16_io`, `linear_bf16_x`,
/// `linear_backward_bf16_x`, `swiglu_bf16`, `swiglu_backward_bf16`, `add_rmsnorm_bf16`,
/// `rope_bf16`):
/// the GPU's equal the CPU twins' — elementwise ones bit for bit, products to their sum
/// order (bf16 outputs within one ulp).
#[test]
fn bf16_activation_ops_match_cpu() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(23);
    let bf = |v: &[f32]| -> Vec<u16> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect()
    };
    let widen = |b: &[u16]| -> Vec<f32> {
        b.iter()
            .map(|&x| f32::from_bits(u32::from(x) << 16))
            .collect()
    };
    let g16 = |bits: &[u16]| {
        let mut b = gpu.alloc_half(bits.len(), DType::Bf16).unwrap();
        gpu.upload_half(bits, ViewMut::whole(&mut b)).unwrap();
        b
    };
    let c16 = |bits: &[u16]| {
        let mut b = cpu.alloc_half(bits.len(), DType::Bf16).unwrap();
        cpu.upload_half(bits, ViewMut::whole(&mut b)).unwrap();
        b
    };
    let g16_down = |b: &_| {
        let b: &<CudaBackend as Backend>::Half = b;
        let mut bits = vec![0u16; b.len()];
        gpu.download_half(View::whole(b), &mut bits).unwrap();
        bits
    };
    for (rows, inp, out, biased) in [
        (64usize, 70usize, 45usize, false),
        (100, 33, 129, true),
        (3, 64, 96, false),
    ] {
        let dims = LinearDims {
            rows,
            in_features: inp,
            out_features: out,
            precision: MatmulPrecision::Bf16,
        };
        let what = |op: &str| format!("{op} {rows}x{inp}->{out} bias={biased}");
        let (x, w, bias) = (
            bf(&rng.vec(rows * inp, 1.0)),
            bf(&rng.vec(out * inp, 1.0)),
            rng.vec(out, 1.0),
        );
        let (gx, gw, cx, cw) = (g16(&x), g16(&w), c16(&x), c16(&w));
        let gb = up(&gpu, &bias);
        let (gbias, cbias) = match biased {
            true => (Some(View::whole(&gb)), Some(View::whole(&bias))),
            false => (None, None),
        };
        // bf16 output
        let mut gy = g16(&vec![0xffff; rows * out]);
        gpu.linear_bf16_io(
            View::whole(&gx),
            View::whole(&gw),
            gbias,
            dims,
            ViewMut::whole(&mut gy),
        )
        .unwrap();
        let mut cy = c16(&vec![0; rows * out]);
        cpu.linear_bf16_io(
            View::whole(&cx),
            View::whole(&cw),
            cbias,
            dims,
            ViewMut::whole(&mut cy),
        )
        .unwrap();
        assert_close(
            &what("linear_bf16_io"),
            &widen(&g16_down(&gy)),
            &widen(cy.bits()),
            8e-3,
        );
        // f32 output
        let mut gyf = up(&gpu, &vec![f32::NAN; rows * out]);
        gpu.linear_bf16_x(
            View::whole(&gx),
            View::whole(&gw),
            gbias,
            dims,
            ViewMut::whole(&mut gyf),
        )
        .unwrap();
        let mut cyf = vec![0.0; rows * out];
        cpu.linear_bf16_x(
            View::whole(&cx),
            View::whole(&cw),
            cbias,
            dims,
            ViewMut::whole(&mut cyf),
        )
        .unwrap();
        assert_close(&what("linear_bf16_x"), &down(&gpu, &gyf), &cyf, 2e-5);
        // backward from the saved bf16 input
        let dy = rng.vec(rows * out, 1.0);
        let (dx0, dw0, db0) = (
            rng.vec(rows * inp, 1.0),
            rng.vec(out * inp, 1.0),
            rng.vec(out, 1.0),
        );
        let (mut gdx, mut gdw, mut gdb) = (up(&gpu, &dx0), up(&gpu, &dw0), up(&gpu, &db0));
        let (mut cdx, mut cdw, mut cdb) = (dx0.clone(), dw0.clone(), db0.clone());
        gpu.linear_backward_bf16_x(
            View::whole(&up(&gpu, &dy)),
            View::whole(&gx),
            View::whole(&gw),
            dims,
            GradWrites::dx(GradWrite::Overwrite),
            Some(ViewMut::whole(&mut gdx)),
            Some(ViewMut::whole(&mut gdw)),
            Some(ViewMut::whole(&mut gdb)),
        )
        .unwrap();
        cpu.linear_backward_bf16_x(
            View::whole(&dy),
            View::whole(&cx),
            View::whole(&cw),
            dims,
            GradWrites::dx(GradWrite::Overwrite),
            Some(ViewMut::whole(&mut cdx)),
            Some(ViewMut::whole(&mut cdw)),
            Some(ViewMut::whole(&mut cdb)),
        )
        .unwrap();
        assert_close(
            &what("linear_backward_bf16_x dx"),
            &down(&gpu, &gdx),
            &cdx,
            2e-5,
        );
        assert_close(
            &what("linear_backward_bf16_x dw"),
            &down(&gpu, &gdw),
            &cdw,
            2e-5,
        );
        assert_close(
            &what("linear_backward_bf16_x dbias"),
            &down(&gpu, &gdb),
            &cdb,
            1e-5,
        );
    }
    // the element-wise ones: bit for bit
    let n = 70_001;
    let (gate, upv) = (bf(&rng.vec(n, 6.0)), bf(&rng.vec(n, 2.0)));
    let mut go = g16(&vec![0; n]);
    gpu.swiglu_bf16(
        View::whole(&g16(&gate)),
        View::whole(&g16(&upv)),
        ViewMut::whole(&mut go),
    )
    .unwrap();
    let mut co = c16(&vec![0; n]);
    cpu.swiglu_bf16(
        View::whole(&c16(&gate)),
        View::whole(&c16(&upv)),
        ViewMut::whole(&mut co),
    )
    .unwrap();
    assert_eq!(g16_down(&go), co.bits(), "swiglu_bf16");
    let dy = rng.vec(n, 1.0);
    let (mut gdg, mut gdu) = (up(&gpu, &vec![0.0; n]), up(&gpu, &vec![0.0; n]));
    gpu.swiglu_backward_bf16(
        View::whole(&up(&gpu, &dy)),
        View::whole(&g16(&gate)),
        View::whole(&g16(&upv)),
        ViewMut::whole(&mut gdg),
        ViewMut::whole(&mut gdu),
    )
    .unwrap();
    let (mut cdg, mut cdu) = (vec![0.0; n], vec![0.0; n]);
    cpu.swiglu_backward_bf16(
        View::whole(&dy),
        View::whole(&c16(&gate)),
        View::whole(&c16(&upv)),
        ViewMut::whole(&mut cdg),
        ViewMut::whole(&mut cdu),
    )
    .unwrap();
    assert_eq!(down(&gpu, &gdg), cdg, "swiglu_backward_bf16 dgate");
    assert_eq!(down(&gpu, &gdu), cdu, "swiglu_backward_bf16 dup");
    let (rows, dim) = (37, 896);
    let (a, b, wn) = (
        rng.vec(rows * dim, 2.0),
        rng.vec(rows * dim, 2.0),
        rng.vec(dim, 1.0),
    );
    let (mut gs, mut gr) = (up(&gpu, &vec![0.0; rows * dim]), up(&gpu, &vec![0.0; rows]));
    let mut gout = g16(&vec![0; rows * dim]);
    gpu.add_rmsnorm_bf16(
        View::whole(&up(&gpu, &a)),
        View::whole(&up(&gpu, &b)),
        View::whole(&up(&gpu, &wn)),
        1e-6,
        dim,
        ViewMut::whole(&mut gs),
        ViewMut::whole(&mut gout),
        ViewMut::whole(&mut gr),
    )
    .unwrap();
    let (mut cs, mut cr) = (vec![0.0; rows * dim], vec![0.0; rows]);
    let mut cout = c16(&vec![0; rows * dim]);
    cpu.add_rmsnorm_bf16(
        View::whole(&a),
        View::whole(&b),
        View::whole(&wn),
        1e-6,
        dim,
        ViewMut::whole(&mut cs),
        ViewMut::whole(&mut cout),
        ViewMut::whole(&mut cr),
    )
    .unwrap();
    assert_eq!(down(&gpu, &gs), cs, "add_rmsnorm_bf16 sum");
    assert_eq!(down(&gpu, &gr), cr, "add_rmsnorm_bf16 rstd");
    assert_eq!(g16_down(&gout), cout.bits(), "add_rmsnorm_bf16 out");

    // RoPE into bf16 (q and k kept in bf16): bit for bit
    let (tokens, heads, head_dim) = (9usize, 4usize, 64usize);
    let x = rng.vec(tokens * heads * head_dim, 3.0);
    let (cos, sin) = (rng.vec(tokens * 32, 1.0), rng.vec(tokens * 32, 1.0));
    let mut gout = g16(&vec![0; x.len()]);
    let (gx, gc, gs) = (up(&gpu, &x), up(&gpu, &cos), up(&gpu, &sin));
    let (gx, gc, gs) = (View::whole(&gx), View::whole(&gc), View::whole(&gs));
    gpu.rope_bf16(gx, gc, gs, heads, head_dim, ViewMut::whole(&mut gout))
        .unwrap();
    let mut cout = c16(&vec![0; x.len()]);
    let (cx, cc, cs) = (View::whole(&x), View::whole(&cos), View::whole(&sin));
    cpu.rope_bf16(cx, cc, cs, heads, head_dim, ViewMut::whole(&mut cout))
        .unwrap();
    assert_eq!(g16_down(&gout), cout.bits(), "rope_bf16");
}

/// A bf16 training step with the MLP's activations stored in bf16 (and the weight
/// matrices): the GPU matches the CPU twin as with f32 activations — log-probs within
/// 2e-3, the weights after two steps within one bf16 ulp, unequal in few elements.
#[test]
fn bf16_mlp_activations_training_step_matches_cpu() {
    use ares_model::model::{ActivationDtype, WeightStorage};
    let Some(gpu) = gpu_or_skip() else { return };
    for name in ["qwen2_tiny", "llama_tiny"] {
        let (mut cpu_model, mut gpu_model) = models(&gpu, name);
        for m in [&mut cpu_model as &mut dyn SetBf16, &mut gpu_model] {
            m.bf16_mlp();
        }
        let s = random_set(2, 40, gpu_model.spec().vocab as u32);
        let (glp, _, _, gw) = train_step_in(&mut gpu_model, &s, GradDtype::Bf16);
        let (clp, _, _, cw) = train_step_in(&mut cpu_model, &s, GradDtype::Bf16);
        assert_close(
            &format!("{name} bf16 MLP activations: log_probs"),
            &glp,
            &clp,
            2e-3,
        );
        let (mut unequal, mut total) = (0usize, 0usize);
        for (i, (g, c)) in gw.iter().zip(&cw).enumerate() {
            for (&a, &b) in g.iter().zip(c) {
                let ulp = f32::from_bits((b.abs().to_bits() & 0xffff_0000) + 0x1_0000) - b.abs();
                assert!(
                    (a - b).abs() <= ulp.max(1e-6),
                    "{name} tensor {i}: {a} vs {b}"
                );
                unequal += usize::from(a != b);
            }
            total += c.len();
        }
        eprintln!("{name} bf16 MLP activations, two steps: {unequal} of {total} elements differ");
        assert!(unequal * 100 <= total, "{name}: {unequal} of {total}");
    }

    /// bf16 products, weights stored in bf16 and the MLP's activations in bf16.
    trait SetBf16 {
        fn bf16_mlp(&mut self);
    }
    impl<B: Backend> SetBf16 for Model<B> {
        fn bf16_mlp(&mut self) {
            self.set_matmul_precision(MatmulPrecision::Bf16);
            self.set_weight_storage(WeightStorage::Bf16).unwrap();
            self.set_activation_dtype(ActivationDtype::Bf16);
        }
    }
}
