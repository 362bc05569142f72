//! The kernels' CUDA C, run on the CPU: `token_kernels.cu` and `model_ops.cu` (as NVRTC gets
//! them) are compiled by the host's C++ compiler with `emulate/cuda_on_cpu.h` in front — a
//! fiber per CUDA thread, real barriers, warp shuffles, `mma.sync` by its fragment maps and
//! last-block reductions — and each kernel's outputs are checked against its CPU twin. So a kernel's indexing, reductions and
//! arithmetic are tested on every CI run, not only when a GPU is lent; `gpu.rs` holds the
//! same kernels to the same twins on a device.
//!
//! Needs a C++20 compiler (`$CXX`, else `c++`). Without one the tests are skipped with a
//! message, unless `ARES_REQUIRE_CXX=1` (CI sets it), which turns the skip into a failure.
//! Every test's name starts with `kernel_on_cpu_` (CI's reruns on narrower CPU paths skip
//! them: the emulation does not depend on the path).

#[path = "common/advantage_batch.rs"]
mod advantage_batch;
#[path = "common/loss_reference.rs"]
mod loss_reference;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use ares_cuda::kernels::{MODEL_OPS, TOKEN_KERNELS};
use ares_cuda::{CovScalars, LOSS_REPORT, LOSS_STATS, LossReport, LossScalars, LossSpec};
use libloading::Library;
use loss_reference::{Batch, Rng, assert_values, close, expected, specs};

const HEADER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/emulate/cuda_on_cpu.h");
/// Threads per block, as `ares-cuda` launches the row kernels.
const ROW_BLOCK: u32 = 512;

/// `source` with `launchers` after it, compiled for the CPU and loaded (`None`: no compiler,
/// skipped).
fn build(name: &str, source: &str, launchers: &str) -> Option<Library> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let required = std::env::var("ARES_REQUIRE_CXX").is_ok_and(|v| v == "1");
    if Command::new(&cxx).arg("--version").output().is_err() {
        assert!(!required, "ARES_REQUIRE_CXX=1 but `{cxx}` does not run");
        eprintln!("skipped: no C++ compiler (`{cxx}`); set CXX to run the emulated kernels");
        return None;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("emulated-kernels");
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let cpp = dir.join(format!("{name}.cpp"));
    std::fs::write(&cpp, format!("{source}\n{launchers}")).expect("source");
    let lib = dir.join(format!("lib{name}_{}.so", std::process::id()));
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O2", "-ffp-contract=off", "-fno-fast-math"])
        .args(["-fPIC", "-shared", "-DARES_EMULATE"])
        .args(["-Wno-unknown-pragmas", "-include", HEADER, "-x", "c++"])
        .arg(&cpp)
        .arg("-o")
        .arg(&lib)
        .output()
        .expect("running the C++ compiler");
    assert!(
        out.status.success(),
        "compiling {name} for the CPU failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // SAFETY: the library is ours, just built; its initialisers only set up globals.
    Some(unsafe { Library::new(&lib) }.expect("loading the emulated kernels"))
}

/// `token_kernels.cu`, built once per test run.
fn kernels() -> Option<&'static Library> {
    static LIB: OnceLock<Option<Library>> = OnceLock::new();
    LIB.get_or_init(|| {
        build(
            "token_kernels",
            TOKEN_KERNELS.code,
            include_str!("emulate/token_launchers.cpp"),
        )
    })
    .as_ref()
}

/// `model_ops.cu`, built once per test run.
fn model_kernels() -> Option<&'static Library> {
    static LIB: OnceLock<Option<Library>> = OnceLock::new();
    LIB.get_or_init(|| {
        build(
            "model_ops",
            MODEL_OPS.code,
            include_str!("emulate/model_launchers.cpp"),
        )
    })
    .as_ref()
}

/// A launcher of the library, by name.
macro_rules! launcher {
    ($lib:expr, $name:literal, $ty:ty) => {{
        // SAFETY: the launcher's C signature in emulate/token_launchers.cpp is `$ty`.
        let f: libloading::Symbol<'_, $ty> =
            unsafe { $lib.get(concat!($name, "\0").as_bytes()) }.expect($name);
        f
    }};
}

const NAN: f32 = f32::NAN;

#[path = "emulate/advantages.rs"]
mod advantages;

/// The C struct of the loss's tensors (`EmuLossTensors`).
#[repr(C)]
struct LossTensors {
    logp: *const f32,
    logp_old: *const f32,
    advantages: *const f32,
    mask: *const f32,
    rollout: *const f32,
    keep: *const f32,
    refp: *const f32,
    hwe: *const f32,
    beta_rows: *const f32,
    entropy: *const f32,
    selected: *const f32,
    row_counts: *const f32,
    grad: *mut f32,
    entropy_grad: *mut f32,
    row_stats: *mut f32,
    totals: *mut f32,
    status: *mut u32,
    blocks_done: *mut u32,
}

/// The kernel's outputs for one micro-batch.
struct Got {
    grad: Vec<f32>,
    entropy_grad: Vec<f32>,
    totals: [f32; LOSS_STATS],
    status: [u32; 2],
}

type LossLauncher = unsafe extern "C" fn(u32, u32, *const LossScalars, *const LossTensors);
type CountsLauncher = unsafe extern "C" fn(u32, u32, *const f32, i64, *mut f32, *mut u32);
type CovLauncher = unsafe extern "C" fn(
    u32,
    u32,
    *const CovScalars,
    *const f32,
    *const f32,
    *const f32,
    *const f32,
    *mut f32,
);

/// Runs `cov_select` on `b` (one block, as `TokenOps::policy_loss` launches it): the chosen
/// tokens, 0/1 (`None` for a loss that chooses none).
fn run_cov_select(lib: &Library, spec: &LossSpec, b: &Batch) -> Option<Vec<f32>> {
    let n = b.rows * b.cols;
    let scalars = spec.cov_scalars(n as i64)?;
    let launch = launcher!(lib, "emu_cov_select", CovLauncher);
    let mut selected = vec![NAN; n];
    // SAFETY: the four inputs and `selected` hold n floats each.
    unsafe {
        launch(
            1,
            ROW_BLOCK,
            &scalars,
            b.logp.as_ptr(),
            b.old.as_ptr(),
            b.adv.as_ptr(),
            b.mask.as_ptr(),
            selected.as_mut_ptr(),
        );
    }
    Some(selected)
}

/// Runs `mask_row_counts`, `cov_select` where the loss chooses tokens, then `policy_loss` on
/// `b` as `TokenOps::policy_loss` launches them (the same scalars, the optional tensors
/// passed as the spec asks).
fn run_loss(lib: &Library, spec: &LossSpec, b: &Batch, forking: bool, hwe: bool) -> Got {
    let (rows, cols) = (b.rows, b.cols);
    let n = rows * cols;
    let mut counts = vec![NAN; rows];
    let mut stats = vec![NAN; rows * LOSS_STATS];
    let mut got = Got {
        grad: vec![NAN; n],
        entropy_grad: vec![NAN; n],
        totals: [NAN; LOSS_STATS],
        status: [7, 7],
    };
    let mut blocks_done = 0u32;
    // the kernel writes a whole report: the totals, then the status words' bits
    let mut report = [NAN; LOSS_REPORT];
    let null = std::ptr::null::<f32>();
    let opt = |on: bool, v: &Vec<f32>| if on { v.as_ptr() } else { null };
    let with_kl = spec.kl.is_some();
    let with_entropy = spec.entropy_coef.is_some();
    let scalars = spec.scalars(rows as i64, cols as i64);
    let selected = run_cov_select(lib, spec, b);
    let counts_launch = launcher!(lib, "emu_mask_row_counts", CountsLauncher);
    let loss_launch = launcher!(lib, "emu_policy_loss", LossLauncher);
    // SAFETY: every pointer covers the lengths the kernels read and write (rows × cols
    // tensors, rows counts, rows × LOSS_STATS statistics, LOSS_REPORT words, 2 words).
    unsafe {
        counts_launch(
            rows as u32,
            ROW_BLOCK,
            b.mask.as_ptr(),
            cols as i64,
            counts.as_mut_ptr(),
            got.status.as_mut_ptr(),
        );
        let t = LossTensors {
            logp: b.logp.as_ptr(),
            logp_old: b.old.as_ptr(),
            advantages: b.adv.as_ptr(),
            mask: b.mask.as_ptr(),
            rollout: opt(
                spec.config.is_correction.mode != ares_core::loss::IsMode::None,
                &b.rollout,
            ),
            keep: opt(forking, &b.keep),
            refp: opt(with_kl, &b.refp),
            hwe: opt(with_kl && hwe, &b.hwe),
            beta_rows: opt(with_kl, &b.beta),
            entropy: opt(with_entropy, &b.entropy),
            selected: selected.as_ref().map_or(null, |s| s.as_ptr()),
            row_counts: counts.as_ptr(),
            grad: got.grad.as_mut_ptr(),
            entropy_grad: if with_entropy {
                got.entropy_grad.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            },
            row_stats: stats.as_mut_ptr(),
            totals: report.as_mut_ptr(),
            status: got.status.as_mut_ptr(),
            blocks_done: &mut blocks_done,
        };
        loss_launch(rows as u32, ROW_BLOCK, &scalars, &t);
    }
    assert_eq!(blocks_done, 0, "the last block resets the counter");
    got.totals.copy_from_slice(&report[..LOSS_STATS]);
    assert_eq!(
        [
            report[LOSS_STATS].to_bits(),
            report[LOSS_STATS + 1].to_bits()
        ],
        got.status,
        "the report carries the status words"
    );
    // (as text: a refused β carries a NaN value)
    assert_eq!(
        format!("{:?}", LossReport::from_report(&report)),
        format!("{:?}", LossReport::read(&got.totals, got.status))
    );
    got
}

#[test]
fn kernel_on_cpu_policy_loss_is_cores_loss() {
    let Some(lib) = kernels() else { return };
    let mut rng = Rng(0x5EED_1234);
    let mut checked = 0;
    for (rows, cols) in [(1usize, 1usize), (3, 7), (4, 300), (6, 129)] {
        let b = Batch::random(&mut rng, rows, cols);
        for (spec, forking, hwe) in specs() {
            let what = format!("{rows}×{cols} {spec:?} forking {forking} hwe {hwe}");
            let got = run_loss(lib, &spec, &b, forking, hwe);
            let want = match expected(&spec, &b, forking, hwe) {
                Ok(w) => w,
                Err(e) => {
                    // a batch whose only row is empty: the kernel says so too
                    assert_eq!(
                        LossReport::read(&got.totals, got.status).unwrap_err(),
                        e,
                        "{what}"
                    );
                    continue;
                }
            };
            let report =
                LossReport::read(&got.totals, got.status).unwrap_or_else(|e| panic!("{what}: {e}"));
            // GSPO's sequence ratio sums a row (in another order) and uses libm's exp; every
            // other gradient is core's arithmetic, operation for operation
            // (a token's gradient adds its KL term to the policy's: GSPO's tolerance is set by
            // the batch's largest gradient, as the two may cancel)
            let gspo = matches!(spec.kind, ares_cuda::LossKind::Gspo(_));
            let largest = want.grad.iter().fold(1e-3f32, |m, g| m.max(g.abs()));
            for (t, (&g, &w)) in got.grad.iter().zip(&want.grad).enumerate() {
                if gspo {
                    assert!(
                        (g - w).abs() <= 1e-5 * largest,
                        "{what}: grad[{t}] {g} vs {w}"
                    );
                } else {
                    assert_eq!(g.to_bits(), w.to_bits(), "{what}: grad[{t}] {g} vs {w}");
                }
            }
            if spec.entropy_coef.is_some() {
                for (t, (&g, &w)) in got.entropy_grad.iter().zip(&want.entropy_grad).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{what}: entropy_grad[{t}]");
                }
            }
            assert_values(&what, &report, &want, 2e-5);
            checked += 1;
        }
    }
    assert!(checked > 100, "{checked} cases compared");
}

#[test]
fn kernel_on_cpu_policy_loss_flags_what_core_refuses() {
    let Some(lib) = kernels() else { return };
    let mut rng = Rng(77);
    let b = Batch::random(&mut rng, 3, 16);
    let (spec, _, _) = specs()
        .into_iter()
        .find(|(s, f, h)| s.kl.is_some() && s.entropy_coef.is_some() && *f && *h)
        .expect("a spec with everything on");
    let first_valid = b
        .mask
        .iter()
        .position(|&m| m == 1.0)
        .expect("a valid token");
    // NaN on padding is never read; on a valid token it is named with its index
    for (field, bad) in [
        ("logp", 0usize),
        ("logp_old", 1),
        ("advantages", 2),
        ("logp_ref", 3),
        ("entropy", 4),
    ] {
        let mut c = b.clone();
        let fields = [
            &mut c.logp,
            &mut c.old,
            &mut c.adv,
            &mut c.refp,
            &mut c.entropy,
        ];
        fields.into_iter().nth(bad).expect("a field")[first_valid] = f32::INFINITY;
        let got = run_loss(lib, &spec, &c, true, true);
        let core = expected(&spec, &c, true, true).err();
        let kernel = LossReport::read(&got.totals, got.status).unwrap_err();
        assert_eq!(
            kernel,
            ares_core::Error::NonFinite {
                what: field,
                index: first_valid
            }
        );
        assert!(
            matches!(core, Some(ares_core::Error::NonFinite { .. })),
            "{field}: core {core:?}"
        );
        // a refused report leaves every gradient 0 (a backward queued before the report is
        // read changes nothing)
        assert!(
            got.grad.iter().chain(&got.entropy_grad).all(|&g| g == 0.0),
            "{field}: gradients of a refused report"
        );
    }
    // finite inputs whose loss overflows: the report reads, the loss is not finite, and the
    // gradients are 0 too
    let mut c = b.clone();
    c.adv.iter_mut().for_each(|a| *a = 3e38);
    let got = run_loss(lib, &spec, &c, true, true);
    let report = LossReport::read(&got.totals, got.status).expect("finite inputs");
    assert!(!report.policy.loss.is_finite());
    assert!(got.grad.iter().chain(&got.entropy_grad).all(|&g| g == 0.0));
    // ... and a clean batch's are not
    let got = run_loss(lib, &spec, &b, true, true);
    assert!(got.grad.iter().any(|&g| g != 0.0));
    let mut c = b.clone();
    let pad = c.mask.iter().position(|&m| m == 0.0).expect("padding");
    c.mask[pad] = 0.5;
    let got = run_loss(lib, &spec, &c, true, true);
    assert_eq!(
        LossReport::read(&got.totals, got.status).unwrap_err(),
        ares_core::Error::InvalidMask {
            what: "mask",
            index: pad
        }
    );
    let mut c = b.clone();
    c.beta[2] = -1.0;
    let got = run_loss(lib, &spec, &c, true, true);
    assert!(matches!(
        LossReport::read(&got.totals, got.status),
        Err(ares_core::Error::OutOfRange { .. })
    ));
    // a clean batch after the bad ones: the status words were reset
    let got = run_loss(lib, &spec, &b, true, true);
    assert!(LossReport::read(&got.totals, got.status).is_ok());
}

/// The tokens Clip-Cov or KL-Cov choose, by the definition (docs/algorithms.md §12.3, §12.4)
/// written plainly: every candidate's key, sorted, the first k.
fn chosen_by_definition(spec: &LossSpec, b: &Batch) -> Vec<f32> {
    let n = b.rows * b.cols;
    let valid: Vec<usize> = (0..n).filter(|&i| b.mask[i] != 0.0).collect();
    let mean = |v: &[f32]| {
        (valid.iter().map(|&i| f64::from(v[i])).sum::<f64>() / valid.len() as f64) as f32
    };
    let (mean_a, mean_l) = (mean(&b.adv), mean(&b.logp));
    let cov = |i: usize| (b.adv[i] - mean_a) * (b.logp[i] - mean_l);
    let splitmix = |seed: u64, i: usize| {
        let mut z = seed.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let clip = spec.config.clip;
    // (key, index) of each candidate; KL-Cov's key orders covariances descending
    let (mut keys, ratio): (Vec<(u64, usize)>, f32) = match spec.kind {
        ares_cuda::LossKind::KlCov(p) => (
            valid
                .iter()
                .map(|&i| {
                    let u = cov(i).to_bits();
                    let asc = u ^ if u >> 31 == 1 { u32::MAX } else { 0x8000_0000 };
                    (u64::from(!asc), i)
                })
                .collect(),
            p.ratio,
        ),
        ares_cuda::LossKind::ClipCov(p) => (
            valid
                .iter()
                .filter(|&&i| {
                    let d = (b.logp[i] - b.old[i]).clamp(-20.0, 20.0);
                    let r = f64::from(d).exp();
                    let a = f64::from(b.adv[i]);
                    let clipped =
                        -a * r.clamp(
                            1.0 - f64::from(clip.clip_ratio_low),
                            1.0 + f64::from(clip.clip_ratio_high),
                        ) > -a * r;
                    !clipped && cov(i) > p.lb && cov(i) < p.ub
                })
                .map(|&i| (splitmix(p.seed, i), i))
                .collect(),
            p.ratio,
        ),
        _ => panic!("a loss that chooses no tokens"),
    };
    keys.sort_unstable();
    let k = ((f64::from(ratio) * valid.len() as f64) as usize).max(1);
    let mut out = vec![0.0f32; n];
    for &(_, i) in keys.iter().take(k) {
        out[i] = 1.0;
    }
    out
}

#[test]
fn kernel_on_cpu_cov_select_chooses_the_definitions_tokens() {
    let Some(lib) = kernels() else { return };
    let mut rng = Rng(0xC0F);
    let spec_of = |kind| LossSpec {
        kind,
        config: ares_core::loss::PolicyLossConfig::default(),
        kl: None,
        entropy_coef: None,
        scale: 1.0,
    };
    let clip_cov = |ratio, lb, ub, seed| {
        spec_of(ares_cuda::LossKind::ClipCov(
            ares_core::loss::ClipCovParams {
                ratio,
                lb,
                ub,
                seed,
            },
        ))
    };
    let kl_cov = |ratio| {
        spec_of(ares_cuda::LossKind::KlCov(ares_core::loss::KlCovParams {
            ratio,
            coef: 1.0,
        }))
    };
    let mut compared = 0;
    for (rows, cols) in [(1usize, 1usize), (2, 5), (7, 300), (16, 700)] {
        let random = Batch::random(&mut rng, rows, cols);
        // one advantage for every token: every covariance is ±0, and the order is the
        // index's (−0 after +0: the total order)
        let mut flat = random.clone();
        flat.adv.iter_mut().for_each(|a| *a = 0.75);
        for b in [&random, &flat] {
            for spec in [
                clip_cov(2e-4, 1.0, 5.0, 0),
                clip_cov(0.01, 0.1, 3.0, 42),
                clip_cov(0.3, -100.0, 100.0, u64::MAX),
                clip_cov(1.0, -100.0, 100.0, 9),
                kl_cov(2e-4),
                kl_cov(0.1),
                kl_cov(0.999),
                kl_cov(1.0),
            ] {
                let got = run_cov_select(lib, &spec, b).expect("a choosing loss");
                let want = chosen_by_definition(&spec, b);
                let differ: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
                assert!(
                    differ.is_empty(),
                    "{rows}×{cols} {:?}: tokens {differ:?} differ (kernel {:?})",
                    spec.kind,
                    differ.iter().map(|&i| got[i]).collect::<Vec<_>>()
                );
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 64);
}

#[test]
fn kernel_on_cpu_masked_dynamic_kl_is_the_cpu_twin() {
    // a kernel the H100 run verified (benches/RESULTS.md): the emulation must agree too
    let Some(lib) = kernels() else { return };
    type KlLauncher = unsafe extern "C" fn(
        u32,
        u32,
        *const f32,
        *const f32,
        *const f32,
        *const f32,
        *const f32,
        f32,
        i32,
        i64,
        *mut f32,
        *mut f32,
        *mut f32,
        *mut f32,
        *mut f32,
        *mut u32,
    );
    let launch = launcher!(lib, "emu_masked_dynamic_kl", KlLauncher);
    let mut rng = Rng(4);
    for (rows, cols) in [(3usize, 5usize), (4, 1000)] {
        let b = Batch::random(&mut rng, rows, cols);
        let n = rows * cols;
        for (e, estimator) in [
            ares_core::kl::KlEstimator::K1,
            ares_core::kl::KlEstimator::Abs,
            ares_core::kl::KlEstimator::K2,
            ares_core::kl::KlEstimator::K3,
        ]
        .into_iter()
        .enumerate()
        {
            let (mut kl, mut w) = (vec![0.0; n], vec![0.0; n]);
            let (mut sums, mut means) = (vec![0.0; rows], vec![0.0; rows]);
            let total = ares_cpu::masked_dynamic_kl(
                ares_cpu::MaskedKlInputs {
                    logp: &b.logp,
                    ref_logp: &b.refp,
                    mask: &b.mask,
                    hwe_mask: Some(&b.hwe),
                    beta_rows: &b.beta,
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
            let (mut g_kl, mut g_w) = (vec![NAN; n], vec![NAN; n]);
            let (mut g_sums, mut g_means, mut g_total) = (vec![NAN; rows], vec![NAN; rows], NAN);
            let mut done = 0u32;
            // SAFETY: pointers cover [rows, cols] tensors, [rows] outputs and one total.
            unsafe {
                launch(
                    rows as u32,
                    ROW_BLOCK,
                    b.logp.as_ptr(),
                    b.refp.as_ptr(),
                    b.mask.as_ptr(),
                    b.hwe.as_ptr(),
                    b.beta.as_ptr(),
                    0.5,
                    e as i32,
                    cols as i64,
                    g_kl.as_mut_ptr(),
                    g_w.as_mut_ptr(),
                    g_sums.as_mut_ptr(),
                    g_means.as_mut_ptr(),
                    &mut g_total,
                    &mut done,
                );
            }
            let what = format!("{rows}×{cols} {}", estimator.name());
            for (name, got, want) in [
                ("kl", &g_kl, &kl),
                ("weighted", &g_w, &w),
                ("row sums", &g_sums, &sums),
                ("row means", &g_means, &means),
            ] {
                for (i, (&g, &w)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(close(g, w, 1e-5), "{what}: {name}[{i}] {g} vs {w}");
                }
            }
            assert!(close(g_total, total, 1e-5), "{what}: total");
        }
    }
}

#[test]
fn kernel_on_cpu_stochastic_bf16_rounding_is_the_cpu_twin() {
    // written in the bf16-weight work, never run on a GPU: the CPU's bits, whatever the
    // launch shape (three blocks of 64 threads stride over the tensor)
    let Some(lib) = model_kernels() else { return };
    type Round = unsafe extern "C" fn(u32, u32, *const f32, *mut u16, i64, u64);
    type Widen = unsafe extern "C" fn(u32, u32, *const u16, *mut f32, i64);
    let round = launcher!(lib, "emu_f32_to_bf16_stochastic", Round);
    let widen = launcher!(lib, "emu_bf16_to_f32", Widen);
    let mut rng = Rng(9);
    let mut x: Vec<f32> = (0..1000).map(|_| rng.range(-3.0, 3.0) * 1e-3).collect();
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0,
        f32::MAX,
    ]);
    let n = x.len();
    for key in [0u64, 0xDEAD_BEEF_1234_5678] {
        let mut want = vec![0u16; n];
        ares_cpu::ops::precision::round_to_bf16_stochastic(&x, key, &mut want).expect("cpu");
        let mut got = vec![0xAAAAu16; n];
        // SAFETY: x holds n values, got n slots.
        unsafe { round(3, 64, x.as_ptr(), got.as_mut_ptr(), n as i64, key) };
        assert_eq!(got, want, "key {key:#x}");
        let mut wide = vec![NAN; n];
        let mut wide_cpu = vec![0.0f32; n];
        ares_cpu::ops::precision::widen_bf16(&want, &mut wide_cpu).expect("cpu");
        // SAFETY: want holds n values, wide n slots.
        unsafe { widen(2, 32, want.as_ptr(), wide.as_mut_ptr(), n as i64) };
        for (g, w) in wide.iter().zip(&wide_cpu) {
            assert_eq!(g.to_bits(), w.to_bits());
        }
    }
}

/// The gather of an embedding stored in bf16 (`embedding_fwd_bf16`, never run on a GPU):
/// the CPU's rows, widened, whatever the launch shape (two blocks of 32 threads stride over
/// 7 tokens of 70 features); an id past the table gives a NaN row and the status bit.
#[test]
fn kernel_on_cpu_bf16_embedding_is_the_cpu_twin() {
    let Some(lib) = model_kernels() else { return };
    type Gather =
        unsafe extern "C" fn(u32, u32, *const u32, *const u16, i64, i64, i64, *mut f32, *mut u32);
    let gather = launcher!(lib, "emu_embedding_fwd_bf16", Gather);
    let (rows, dim) = (11usize, 70usize);
    let mut rng = Rng(4);
    let table: Vec<u16> = (0..rows * dim)
        .map(|_| (rng.range(-2.0, 2.0).to_bits() >> 16) as u16)
        .collect();
    let ids = [3u32, 0, 10, 3, 7, 7, 1];
    let mut want = vec![0.0f32; ids.len() * dim];
    ares_cpu::ops::embedding::embedding_forward_bf16(&ids, &table, rows, dim, &mut want)
        .expect("cpu");
    let mut got = vec![NAN; want.len()];
    let mut status = 0u32;
    // SAFETY: ids holds 7 ids < rows, table rows × dim values, got 7 × dim slots.
    unsafe {
        gather(
            2,
            32,
            ids.as_ptr(),
            table.as_ptr(),
            rows as i64,
            dim as i64,
            7,
            got.as_mut_ptr(),
            &mut status,
        )
    };
    assert_eq!(got, want);
    assert_eq!(status, 0);
    let bad = [2u32, rows as u32];
    // SAFETY: as above, two ids.
    unsafe {
        gather(
            1,
            32,
            bad.as_ptr(),
            table.as_ptr(),
            rows as i64,
            dim as i64,
            2,
            got.as_mut_ptr(),
            &mut status,
        )
    };
    let row_2: Vec<f32> = table[2 * dim..3 * dim]
        .iter()
        .map(|&b| f32::from_bits(u32::from(b) << 16))
        .collect();
    assert_eq!(got[..dim], row_2);
    assert!(got[dim..2 * dim].iter().all(|x| x.is_nan()));
    assert_ne!(status, 0);
}

/// `emu_attention_fwd_mma`: grid, head size, then the kernel's arguments (packed segments:
/// offsets and their count, or null and 0; then q, k, v stored in bf16, or null).
type AttnFwdMma = unsafe extern "C" fn(
    u32,
    i32,
    *const f32,
    *const f32,
    *const f32,
    *const f32,
    i64,
    i64,
    i64,
    i64,
    i32,
    i32,
    f32,
    *mut f32,
    *mut f32,
    *mut u32,
    *const u32,
    i32,
    *const u16,
    *const u16,
    *const u16,
    *mut u16,
);
/// `emu_paged_attention_fwd_mma`: grid, head size, then the paged kernel's arguments.
type PagedAttnFwdMma = unsafe extern "C" fn(
    u32,
    i32,
    *const f32,
    *const f32,
    *const f32,
    *const u16,
    *const u16,
    i64,
    i64,
    i32,
    i32,
    f32,
    *const u32,
    *const u32,
    i64,
    i64,
    i64,
    *mut f32,
    *mut u32,
);
/// `emu_attention_bwd_mma`: δ, dq, then dk and dv, as `attention_backward_bf16` runs them.
type AttnBwdMma = unsafe extern "C" fn(
    u32,
    i32,
    *const f32,
    *const f32,
    *const f32,
    *const f32,
    i64,
    i64,
    i32,
    i32,
    f32,
    *const f32,
    *const f32,
    *const f32,
    *mut f32,
    *mut f32,
    *mut f32,
    *mut f32,
    *mut u32,
    *const u32,
    i32,
    *const u16,
    *const u16,
    *const u16,
    *const u16,
);

/// The tensor-core forward of a prefill chunk over a paged cache (`paged_attention_fwd_mma_*`,
/// never run on a GPU) against its CPU twin: two sequences with 70 and 3 earlier slots, a
/// chunk of 100 queries each, a scrambled pool of 16-slot blocks, f32 and bf16 pools, GQA,
/// each head size; a block id past the pool raises the status word's id bit.
#[test]
fn kernel_on_cpu_paged_tensor_core_prefill_is_the_cpu_twin() {
    use ares_cpu::ops::attention::{
        AttentionShape, PagedKvCache, PagedKvCacheMut, paged_attention_prefill_bf16,
        paged_attention_prefill_bf16_kv16, paged_kv_cache_append, paged_kv_cache_append_bf16,
    };
    let Some(lib) = model_kernels() else { return };
    let fwd = launcher!(lib, "emu_paged_attention_fwd_mma", PagedAttnFwdMma);
    let mut rng = Rng(47);
    let (bs, chunk, max_blocks, blocks) = (16usize, 100usize, 12usize, 24usize);
    let before = [70usize, 3];
    for (d, hq, hkv) in [(64usize, 4usize, 2usize), (80, 2, 2), (128, 2, 1)] {
        let tok = hkv * d;
        let mut tables = vec![0u32; 2 * max_blocks];
        for c in 0..max_blocks {
            for s in 0..2 {
                tables[s * max_blocks + c] = (blocks - 1 - (2 * c + s)) as u32;
            }
        }
        let (mut pk, mut pv) = (
            vec![0.0f32; blocks * bs * tok],
            vec![0.0f32; blocks * bs * tok],
        );
        let (mut pk16, mut pv16) = (vec![0u16; pk.len()], vec![0u16; pk.len()]);
        // every sequence's slots written, earlier and new
        for (s, &n0) in before.iter().enumerate() {
            let n = n0 + chunk;
            let one = AttentionShape::new(1, n, hq, hkv, d);
            let k: Vec<f32> = (0..n * tok).map(|_| rng.range(-1.0, 1.0)).collect();
            let v: Vec<f32> = (0..n * tok).map(|_| rng.range(-1.0, 1.0)).collect();
            let table = &tables[s * max_blocks..(s + 1) * max_blocks];
            let c = PagedKvCacheMut {
                k: &mut pk[..],
                v: &mut pv[..],
                block_size: bs,
                block_tables: table,
                max_blocks,
                len: &[0],
            };
            paged_kv_cache_append(&one, &k, &v, c).expect("append");
            let c16 = PagedKvCacheMut {
                k: &mut pk16[..],
                v: &mut pv16[..],
                block_size: bs,
                block_tables: table,
                max_blocks,
                len: &[0],
            };
            paged_kv_cache_append_bf16(&one, &k, &v, c16).expect("append bf16");
        }
        let shape = AttentionShape::new(2, chunk, hq, hkv, d);
        let q: Vec<f32> = (0..2 * chunk * hq * d)
            .map(|_| rng.range(-1.0, 1.0))
            .collect();
        // the CPU twin counts the new keys in its lengths, the kernel starts from the earlier
        let after: Vec<u32> = before.iter().map(|&n| (n + chunk) as u32).collect();
        let earlier: Vec<u32> = before.iter().map(|&n| n as u32).collect();
        for bf16_pool in [false, true] {
            let mut want = vec![0.0f32; q.len()];
            if bf16_pool {
                let cache = PagedKvCache {
                    k: &pk16,
                    v: &pv16,
                    block_size: bs,
                    block_tables: &tables,
                    max_blocks,
                    len: &after,
                };
                paged_attention_prefill_bf16_kv16(&shape, &q, cache, &mut want).expect("cpu");
            } else {
                let cache = PagedKvCache {
                    k: &pk,
                    v: &pv,
                    block_size: bs,
                    block_tables: &tables,
                    max_blocks,
                    len: &after,
                };
                paged_attention_prefill_bf16(&shape, &q, cache, &mut want).expect("cpu");
            }
            let launch = |tables: &[u32], out: &mut [f32], status: &mut u32| {
                let null = std::ptr::null();
                let (k, v, k16, v16) = if bf16_pool {
                    (null, null, pk16.as_ptr(), pv16.as_ptr())
                } else {
                    (pk.as_ptr(), pv.as_ptr(), std::ptr::null(), std::ptr::null())
                };
                // SAFETY: q, out of the shape's lengths; the pools hold `blocks` blocks, the
                // tables 2 × max_blocks ids; the kernel strides over its blocks.
                unsafe {
                    fwd(
                        5,
                        d as i32,
                        q.as_ptr(),
                        k,
                        v,
                        k16,
                        v16,
                        2,
                        chunk as i64,
                        hq as i32,
                        hkv as i32,
                        shape.scale,
                        tables.as_ptr(),
                        earlier.as_ptr(),
                        bs as i64,
                        max_blocks as i64,
                        blocks as i64,
                        out.as_mut_ptr(),
                        status,
                    )
                }
            };
            let (mut out, mut status) = (vec![NAN; q.len()], 0u32);
            launch(&tables, &mut out, &mut status);
            let what = format!("d {d}, bf16 pool {bf16_pool}");
            assert_eq!(status, 0, "{what}: status");
            for (i, (g, w)) in out.iter().zip(&want).enumerate() {
                assert!(close(*g, *w, 1e-4), "{what}: out[{i}] {g} vs {w}");
            }
            // a block id past the pool is flagged, not read
            let mut bad = tables.clone();
            bad[1] = blocks as u32 + 5;
            let mut status = 0u32;
            launch(&bad, &mut out, &mut status);
            assert_ne!(status & 4, 0, "{what}: bad id status {status:#x}");
        }
    }
}

#[test]
fn kernel_on_cpu_tensor_core_attention_is_the_cpu_twin() {
    // mma.sync m16n8k16 emulated by its fragment maps: the forward and backward written for
    // the tensor cores, never run on a GPU, against the CPU twin that rounds the same operands
    use ares_cpu::ops::attention::{AttentionInputs, AttentionShape, attention_forward_bf16};
    let Some(lib) = model_kernels() else { return };
    let fwd = launcher!(lib, "emu_attention_fwd_mma", AttnFwdMma);
    let bwd = launcher!(lib, "emu_attention_bwd_mma", AttnBwdMma);
    let mut rng = Rng(31);
    for (d, batch, seq, hq, hkv) in [
        (64usize, 2usize, 70usize, 4usize, 2usize),
        (80, 1, 33, 2, 2),
        (128, 1, 80, 2, 1),
    ] {
        let shape = AttentionShape {
            batch,
            seq,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let q: Vec<f32> = (0..batch * seq * hq * d)
            .map(|_| rng.range(-1.0, 1.0))
            .collect();
        let k: Vec<f32> = (0..batch * seq * hkv * d)
            .map(|_| rng.range(-1.0, 1.0))
            .collect();
        let v: Vec<f32> = (0..batch * seq * hkv * d)
            .map(|_| rng.range(-1.0, 1.0))
            .collect();
        // the first sequence's last 5 keys are padding
        let mask: Vec<f32> = (0..batch * seq)
            .map(|i| f32::from(u8::from(!(i < seq && i >= seq - 5))))
            .collect();
        let (mut want, mut want_lse) = (vec![0.0f32; q.len()], vec![0.0f32; batch * seq * hq]);
        attention_forward_bf16(
            &shape,
            AttentionInputs {
                q: &q,
                k: &k,
                v: &v,
                key_mask: Some(&mask),
                segments: None,
            },
            &mut want,
            &mut want_lse,
        )
        .expect("cpu");
        let (mut out, mut lse) = (vec![NAN; q.len()], vec![NAN; want_lse.len()]);
        let mut status = 0u32;
        // SAFETY: q, k, v, mask, out, lse have the shape's lengths; the kernel strides over
        // its blocks, so 5 blocks cover any shape.
        unsafe {
            fwd(
                5,
                d as i32,
                q.as_ptr(),
                k.as_ptr(),
                v.as_ptr(),
                mask.as_ptr(),
                batch as i64,
                seq as i64,
                seq as i64,
                0,
                hq as i32,
                hkv as i32,
                shape.scale,
                out.as_mut_ptr(),
                lse.as_mut_ptr(),
                &mut status,
                std::ptr::null(),
                0,
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(status, 0, "d {d}: status");
        for (i, (g, w)) in out.iter().zip(&want).enumerate() {
            assert!(close(*g, *w, 1e-4), "d {d}: out[{i}] {g} vs {w}");
        }
        for (i, (g, w)) in lse.iter().zip(&want_lse).enumerate() {
            assert!(
                (g.is_infinite() && g == w) || close(*g, *w, 1e-5),
                "d {d}: lse[{i}] {g} vs {w}"
            );
        }
        // the backward (δ, dq, then dk and dv) from the twin's forward outputs
        let dout: Vec<f32> = (0..q.len()).map(|_| rng.range(-1.0, 1.0)).collect();
        let (mut dq, mut dk, mut dv) = (
            vec![0.0f32; q.len()],
            vec![0.0f32; k.len()],
            vec![0.0f32; v.len()],
        );
        ares_cpu::ops::attention::attention_backward_bf16(
            &shape,
            AttentionInputs {
                q: &q,
                k: &k,
                v: &v,
                key_mask: Some(&mask),
                segments: None,
            },
            &want,
            &want_lse,
            &dout,
            ares_cpu::ops::attention::AttentionGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
            },
        )
        .expect("cpu backward");
        let mut delta = vec![NAN; want_lse.len()];
        let (mut g_dq, mut g_dk, mut g_dv) =
            (vec![NAN; q.len()], vec![NAN; k.len()], vec![NAN; v.len()]);
        // SAFETY: every buffer has the shape's length (delta: one per (token, head) row).
        unsafe {
            bwd(
                5,
                d as i32,
                q.as_ptr(),
                k.as_ptr(),
                v.as_ptr(),
                mask.as_ptr(),
                batch as i64,
                seq as i64,
                hq as i32,
                hkv as i32,
                shape.scale,
                want.as_ptr(),
                want_lse.as_ptr(),
                dout.as_ptr(),
                delta.as_mut_ptr(),
                g_dq.as_mut_ptr(),
                g_dk.as_mut_ptr(),
                g_dv.as_mut_ptr(),
                &mut status,
                std::ptr::null(),
                0,
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(status, 0, "d {d}: backward status");
        for (name, got, want) in [("dq", &g_dq, &dq), ("dk", &g_dk, &dk), ("dv", &g_dv, &dv)] {
            let largest = want.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
            for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * largest,
                    "d {d}: {name}[{i}] {g} vs {w}"
                );
            }
        }
        // q, k, v stored in bf16 (activation dtype bf16): the kernels read the rounded bits
        // as stored, the f32 pointers null — the bits of rounding them as they load
        let bits = |x: &[f32]| -> Vec<u16> {
            x.iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect()
        };
        let same = |got: &[f32], want: &[f32]| {
            got.iter()
                .map(|x| x.to_bits())
                .eq(want.iter().map(|x| x.to_bits()))
        };
        let (q16, k16, v16) = (bits(&q), bits(&k), bits(&v));
        let null = std::ptr::null::<f32>();
        let (mut out16, mut lse16) = (vec![NAN; q.len()], vec![NAN; lse.len()]);
        // SAFETY: as the f32 launch, q16/k16/v16 of q/k/v's lengths in their place.
        unsafe {
            fwd(
                5,
                d as i32,
                null,
                null,
                null,
                mask.as_ptr(),
                batch as i64,
                seq as i64,
                seq as i64,
                0,
                hq as i32,
                hkv as i32,
                shape.scale,
                out16.as_mut_ptr(),
                lse16.as_mut_ptr(),
                &mut status,
                std::ptr::null(),
                0,
                q16.as_ptr(),
                k16.as_ptr(),
                v16.as_ptr(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(status, 0, "d {d}: bf16-stored status");
        assert!(
            same(&out16, &out) && same(&lse16, &lse),
            "d {d}: bf16-stored forward"
        );
        let (mut s_dq, mut s_dk, mut s_dv) =
            (vec![NAN; q.len()], vec![NAN; k.len()], vec![NAN; v.len()]);
        // SAFETY: as the f32 launch above.
        unsafe {
            bwd(
                5,
                d as i32,
                null,
                null,
                null,
                mask.as_ptr(),
                batch as i64,
                seq as i64,
                hq as i32,
                hkv as i32,
                shape.scale,
                want.as_ptr(),
                want_lse.as_ptr(),
                dout.as_ptr(),
                delta.as_mut_ptr(),
                s_dq.as_mut_ptr(),
                s_dk.as_mut_ptr(),
                s_dv.as_mut_ptr(),
                &mut status,
                std::ptr::null(),
                0,
                q16.as_ptr(),
                k16.as_ptr(),
                v16.as_ptr(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(status, 0, "d {d}: bf16-stored backward status");
        for (name, got, want) in [
            ("dq", &s_dq, &g_dq),
            ("dk", &s_dk, &g_dk),
            ("dv", &s_dv, &g_dv),
        ] {
            assert!(same(got, want), "d {d}: bf16-stored {name}");
        }
        // the output stored in bf16 too: the f32 output rounded once, and the backward from
        // it (δ over its widened bits) the backward from those values in f32, bit for bit
        let mut out_16 = vec![0u16; q.len()];
        let mut lse_16 = vec![NAN; lse.len()];
        // SAFETY: as above, out16 of out's length in its place.
        unsafe {
            fwd(
                5,
                d as i32,
                null,
                null,
                null,
                mask.as_ptr(),
                batch as i64,
                seq as i64,
                seq as i64,
                0,
                hq as i32,
                hkv as i32,
                shape.scale,
                std::ptr::null_mut(),
                lse_16.as_mut_ptr(),
                &mut status,
                std::ptr::null(),
                0,
                q16.as_ptr(),
                k16.as_ptr(),
                v16.as_ptr(),
                out_16.as_mut_ptr(),
            )
        };
        assert_eq!(status, 0, "d {d}: bf16 output status");
        assert_eq!(out_16, bits(&out), "d {d}: bf16 output");
        assert!(same(&lse_16, &lse), "d {d}: bf16 output's lse");
        let widened: Vec<f32> = out_16
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        let mut grads =
            [(); 2].map(|()| (vec![NAN; q.len()], vec![NAN; k.len()], vec![NAN; v.len()]));
        for (i, (dq_, dk_, dv_)) in grads.iter_mut().enumerate() {
            let (out_f32, out16) = match i {
                0 => (widened.as_ptr(), std::ptr::null()),
                _ => (null, out_16.as_ptr()),
            };
            // SAFETY: as the launches above.
            unsafe {
                bwd(
                    5,
                    d as i32,
                    null,
                    null,
                    null,
                    mask.as_ptr(),
                    batch as i64,
                    seq as i64,
                    hq as i32,
                    hkv as i32,
                    shape.scale,
                    out_f32,
                    lse.as_ptr(),
                    dout.as_ptr(),
                    delta.as_mut_ptr(),
                    dq_.as_mut_ptr(),
                    dk_.as_mut_ptr(),
                    dv_.as_mut_ptr(),
                    &mut status,
                    std::ptr::null(),
                    0,
                    q16.as_ptr(),
                    k16.as_ptr(),
                    v16.as_ptr(),
                    out16,
                )
            };
            assert_eq!(status, 0, "d {d}: bf16 output backward status");
        }
        let [(a_dq, a_dk, a_dv), (b_dq, b_dk, b_dv)] = &grads;
        for (name, x, y) in [("dq", a_dq, b_dq), ("dk", a_dk, b_dk), ("dv", a_dv, b_dv)] {
            assert!(same(x, y), "d {d}: bf16 output {name}");
        }
    }
}

/// A packed attention case (batch 1, segments `cu`): random q, k, v, dout, a key mask with
/// every 29th key from the 4th masked, and the CPU's forward and backward over the
/// segments (`bf16`: the tensor-core twin's).
struct PackedCase {
    shape: ares_cpu::ops::attention::AttentionShape,
    cu: Vec<u32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    mask: Vec<f32>,
    dout: Vec<f32>,
    /// The CPU's out, lse, dq, dk, dv.
    want: [Vec<f32>; 5],
}

impl PackedCase {
    fn new(rng: &mut Rng, (cu, hq, hkv, d): (&[u32], usize, usize, usize), bf16: bool) -> Self {
        use ares_cpu::ops::attention as att;
        let seq = *cu.last().expect("offsets") as usize;
        let shape = att::AttentionShape {
            batch: 1,
            seq,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let mut values = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.range(-1.0, 1.0)).collect() };
        let (q, k, v) = (
            values(seq * hq * d),
            values(seq * hkv * d),
            values(seq * hkv * d),
        );
        let dout = values(q.len());
        let mask: Vec<f32> = (0..seq).map(|i| f32::from(u8::from(i % 29 != 3))).collect();
        let inputs = att::AttentionInputs {
            q: &q,
            k: &k,
            v: &v,
            key_mask: Some(&mask),
            segments: Some(cu),
        };
        let (mut out, mut lse) = (vec![0.0f32; q.len()], vec![0.0f32; seq * hq]);
        let (mut dq, mut dk, mut dv) = (
            vec![0.0f32; q.len()],
            vec![0.0f32; k.len()],
            vec![0.0f32; v.len()],
        );
        let grads = att::AttentionGrads {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
        };
        if bf16 {
            att::attention_forward_bf16(&shape, inputs, &mut out, &mut lse).expect("cpu");
            att::attention_backward_bf16(&shape, inputs, &out, &lse, &dout, grads).expect("cpu");
        } else {
            att::attention_forward(&shape, inputs, &mut out, &mut lse).expect("cpu");
            att::attention_backward(&shape, inputs, &out, &lse, &dout, grads).expect("cpu");
        }
        Self {
            shape,
            cu: cu.to_vec(),
            q,
            k,
            v,
            mask,
            dout,
            want: [out, lse, dq, dk, dv],
        }
    }

    /// Fresh NaN-filled outputs shaped as `want`.
    fn outputs(&self) -> [Vec<f32>; 5] {
        self.want.clone().map(|w| vec![NAN; w.len()])
    }

    /// `got` (out, lse, dq, dk, dv) against the CPU's: lse within `rel` of each value (equal
    /// infinities), the others within `rel` of their tensor's largest magnitude.
    fn check(&self, got: &[Vec<f32>; 5], rel: f32) {
        let d = self.shape.head_dim;
        for (name, (got, want)) in ["out", "lse", "dq", "dk", "dv"]
            .iter()
            .zip(got.iter().zip(&self.want))
        {
            let largest = want
                .iter()
                .filter(|x| x.is_finite())
                .fold(1e-3f32, |m, x| m.max(x.abs()));
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let ok = if *name == "lse" {
                    (g.is_infinite() && g == w) || close(*g, *w, rel)
                } else {
                    (g - w).abs() <= rel * largest
                };
                assert!(ok, "d {d}: {name}[{i}] {g} vs {w}");
            }
        }
    }
}

#[test]
fn kernel_on_cpu_tensor_core_attention_over_packed_segments_is_the_cpu_twin() {
    // the decoder's packed batches (cu_seqlens) on the tensor-core kernels: each segment a
    // causal sequence of its own, keys from its own start — the CPU twin's spans — with
    // empty, one-token and multi-tile segments, a key mask, and GQA
    let Some(lib) = model_kernels() else { return };
    let fwd = launcher!(lib, "emu_attention_fwd_mma", AttnFwdMma);
    let bwd = launcher!(lib, "emu_attention_bwd_mma", AttnBwdMma);
    let mut rng = Rng(47);
    for (d, hq, hkv, cu) in [
        (64usize, 4usize, 2usize, vec![0u32, 5, 75, 76, 76, 150]),
        (80, 2, 2, vec![0, 33, 40]),
        (128, 2, 1, vec![0, 1, 66, 66]),
    ] {
        let c = PackedCase::new(&mut rng, (&cu, hq, hkv, d), true);
        let [mut out, mut lse, mut dq, mut dk, mut dv] = c.outputs();
        let mut delta = vec![NAN; lse.len()];
        let (seq, scale, segments) = (c.shape.seq as i64, c.shape.scale, (cu.len() - 1) as i32);
        let mut status = 0u32;
        // SAFETY: every buffer has the shape's length (delta: one per (token, head) row), cu
        // holds segments + 1 offsets; 7 blocks stride over the segments' tiles. The
        // backward reads the CPU twin's out and lse.
        unsafe {
            fwd(
                7,
                d as i32,
                c.q.as_ptr(),
                c.k.as_ptr(),
                c.v.as_ptr(),
                c.mask.as_ptr(),
                1,
                seq,
                seq,
                0,
                hq as i32,
                hkv as i32,
                scale,
                out.as_mut_ptr(),
                lse.as_mut_ptr(),
                &mut status,
                c.cu.as_ptr(),
                segments,
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null_mut(),
            );
            bwd(
                7,
                d as i32,
                c.q.as_ptr(),
                c.k.as_ptr(),
                c.v.as_ptr(),
                c.mask.as_ptr(),
                1,
                seq,
                hq as i32,
                hkv as i32,
                scale,
                c.want[0].as_ptr(),
                c.want[1].as_ptr(),
                c.dout.as_ptr(),
                delta.as_mut_ptr(),
                dq.as_mut_ptr(),
                dk.as_mut_ptr(),
                dv.as_mut_ptr(),
                &mut status,
                c.cu.as_ptr(),
                segments,
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null_mut(),
            );
        }
        assert_eq!(status, 0, "d {d}: status");
        c.check(&[out, lse, dq, dk, dv], 1e-4);
        // offsets out of order: flagged, and every access stays inside the tokens (the
        // clamped segments), so nothing but the flag is promised
        let bad_cu: Vec<u32> = vec![0, seq as u32, 2, seq as u32 + 40];
        let [mut out, mut lse, ..] = c.outputs();
        // SAFETY: as above; the kernels clamp the offsets to the tokens.
        unsafe {
            fwd(
                3,
                d as i32,
                c.q.as_ptr(),
                c.k.as_ptr(),
                c.v.as_ptr(),
                c.mask.as_ptr(),
                1,
                seq,
                seq,
                0,
                hq as i32,
                hkv as i32,
                scale,
                out.as_mut_ptr(),
                lse.as_mut_ptr(),
                &mut status,
                bad_cu.as_ptr(),
                3,
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(status, 64, "d {d}: bad offsets flag ST_BAD_SEGMENTS");
    }
}

#[test]
fn kernel_on_cpu_f32_attention_over_packed_segments_is_the_cpu_attention() {
    // the f32 kernels' packed variants (`packed_attention_*`) at each head-size class:
    // forward, δ, dq and dk/dv against the CPU's packed attention
    let Some(lib) = model_kernels() else { return };
    type Packed = unsafe extern "C" fn(
        u32,
        *const f32,
        *const f32,
        *const f32,
        *const f32,
        *const u32,
        i32,
        i64,
        i32,
        i32,
        i32,
        f32,
        *mut f32,
        *mut f32,
        *const f32,
        *mut f32,
        *mut f32,
        *mut f32,
        *mut f32,
        *mut u32,
    );
    let run = launcher!(lib, "emu_packed_attention", Packed);
    let mut rng = Rng(53);
    for (d, hq, hkv, cu) in [
        (64usize, 4usize, 2usize, vec![0u32, 5, 45, 46, 46, 90]),
        (96, 3, 1, vec![0, 17, 50]),
        (160, 2, 2, vec![0, 1, 30, 30]),
    ] {
        let c = PackedCase::new(&mut rng, (&cu, hq, hkv, d), false);
        let [mut out, mut lse, mut dq, mut dk, mut dv] = c.outputs();
        let mut delta = vec![NAN; lse.len()];
        let mut status = 0u32;
        // SAFETY: every buffer has the shape's length, cu holds segments + 1 offsets; the
        // kernels stride over their blocks, so 5 cover any shape.
        unsafe {
            run(
                5,
                c.q.as_ptr(),
                c.k.as_ptr(),
                c.v.as_ptr(),
                c.mask.as_ptr(),
                c.cu.as_ptr(),
                (cu.len() - 1) as i32,
                c.shape.seq as i64,
                hq as i32,
                hkv as i32,
                d as i32,
                c.shape.scale,
                out.as_mut_ptr(),
                lse.as_mut_ptr(),
                c.dout.as_ptr(),
                delta.as_mut_ptr(),
                dq.as_mut_ptr(),
                dk.as_mut_ptr(),
                dv.as_mut_ptr(),
                &mut status,
            )
        };
        assert_eq!(status, 0, "d {d}: status");
        // f32 both sides, summed in other orders
        c.check(&[out, lse, dq, dk, dv], 1e-5);
    }
}

#[test]
fn kernel_on_cpu_tensor_core_segment_attention_is_the_cpu_twin() {
    // the vision tower's attention on the tensor cores (written, never run on a GPU):
    // forward and backward within uneven segments, against the CPU twins; then over q, k, v
    // stored in bf16 (the same bits) and with the output stored in bf16 (rounded once)
    use ares_cpu::ops::segment_attention::{
        SegmentAttentionSaved, SegmentAttentionShape, segment_attention_backward_bf16,
        segment_attention_forward_bf16,
    };
    let Some(lib) = model_kernels() else { return };
    type Seg = unsafe extern "C" fn(
        u32,
        i32,
        *const f32,
        *const f32,
        *const f32,
        *const u32,
        i32,
        i64,
        i32,
        f32,
        *mut f32,
        *mut f32,
        *const f32,
        *mut f32,
        *mut f32,
        *mut f32,
        *mut f32,
        *mut u32,
        *const u16,
        *const u16,
        *const u16,
        *mut u16,
    );
    let run = launcher!(lib, "emu_segment_attention_mma", Seg);
    let mut rng = Rng(57);
    // segments of 5, 64 and 31 tokens: tiles that straddle segment ends
    let cu = [0u32, 5, 69, 100];
    let tokens = 100usize;
    let bits = |x: &[f32]| -> Vec<u16> {
        x.iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect()
    };
    let same = |got: &[f32], want: &[f32]| {
        got.iter()
            .map(|x| x.to_bits())
            .eq(want.iter().map(|x| x.to_bits()))
    };
    let close = |what: &str, got: &[f32], want: &[f32]| {
        let largest = want.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
            assert!((g - w).abs() <= 1e-4 * largest, "{what}[{i}] {g} vs {w}");
        }
    };
    for (d, heads) in [(64usize, 2usize), (80, 1), (128, 1)] {
        let shape = SegmentAttentionShape::new(tokens, heads, d);
        let n = tokens * heads * d;
        let q: Vec<f32> = (0..n).map(|_| rng.range(-1.0, 1.0)).collect();
        let k: Vec<f32> = (0..n).map(|_| rng.range(-1.0, 1.0)).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.range(-1.0, 1.0)).collect();
        let dout: Vec<f32> = (0..n).map(|_| rng.range(-1.0, 1.0)).collect();
        let (mut out, mut lse) = (vec![0.0f32; n], vec![0.0f32; tokens * heads]);
        segment_attention_forward_bf16(&shape, &cu, &q, &k, &v, &mut out, &mut lse).expect("cpu");
        let cpu_backward = |out: &[f32]| {
            let (mut dq, mut dk, mut dv) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
            let saved = SegmentAttentionSaved {
                out,
                lse: &lse,
                dout: &dout,
            };
            segment_attention_backward_bf16(
                &shape, &cu, &q, &k, &v, saved, &mut dq, &mut dk, &mut dv,
            )
            .expect("cpu backward");
            [dq, dk, dv]
        };
        let [dq, dk, dv] = cpu_backward(&out);
        // one launch of forward and backward: q, k, v in f32 (`stored` None) or as bf16
        // bits; the output in f32 or bf16 (`out16`)
        let (q16, k16, v16) = (bits(&q), bits(&k), bits(&v));
        let launch = |stored: bool, out16: bool| {
            let null = std::ptr::null::<f32>();
            let f = |x: &Vec<f32>| if stored { null } else { x.as_ptr() };
            let h = |x: &Vec<u16>| if stored { x.as_ptr() } else { std::ptr::null() };
            let (mut g_out, mut g_lse, mut delta) = (
                vec![NAN; n],
                vec![NAN; tokens * heads],
                vec![NAN; tokens * heads],
            );
            let mut g_out16 = vec![0u16; if out16 { n } else { 0 }];
            let (mut g_dq, mut g_dk, mut g_dv) = (vec![NAN; n], vec![NAN; n], vec![NAN; n]);
            let mut status = 0u32;
            // SAFETY: every buffer has the shape's length; cu holds segments + 1 offsets;
            // exactly one of each operand's f32 and bf16 pointers, and of the output's.
            unsafe {
                run(
                    3,
                    d as i32,
                    f(&q),
                    f(&k),
                    f(&v),
                    cu.as_ptr(),
                    (cu.len() - 1) as i32,
                    tokens as i64,
                    heads as i32,
                    shape.scale,
                    if out16 {
                        std::ptr::null_mut()
                    } else {
                        g_out.as_mut_ptr()
                    },
                    g_lse.as_mut_ptr(),
                    dout.as_ptr(),
                    delta.as_mut_ptr(),
                    g_dq.as_mut_ptr(),
                    g_dk.as_mut_ptr(),
                    g_dv.as_mut_ptr(),
                    &mut status,
                    h(&q16),
                    h(&k16),
                    h(&v16),
                    if out16 {
                        g_out16.as_mut_ptr()
                    } else {
                        std::ptr::null_mut()
                    },
                )
            };
            assert_eq!(status, 0, "d {d}: status (stored {stored}, out16 {out16})");
            (g_out, g_out16, g_lse, [g_dq, g_dk, g_dv])
        };
        let (g_out, _, g_lse, g) = launch(false, false);
        close(&format!("d {d}: out"), &g_out, &out);
        close(&format!("d {d}: lse"), &g_lse, &lse);
        for (name, got, want) in [("dq", &g[0], &dq), ("dk", &g[1], &dk), ("dv", &g[2], &dv)] {
            close(&format!("d {d}: {name}"), got, want);
        }
        // q, k, v as bf16 bits: the kernels round f32 ones as they load them — the same bits
        let (s_out, _, s_lse, s) = launch(true, false);
        assert!(
            same(&s_out, &g_out) && same(&s_lse, &g_lse),
            "d {d}: stored forward"
        );
        for (name, got, want) in [
            ("dq", &s[0], &g[0]),
            ("dk", &s[1], &g[1]),
            ("dv", &s[2], &g[2]),
        ] {
            assert!(same(got, want), "d {d}: stored {name}");
        }
        // and the output in bf16: the f32 output rounded once; the backward's δ reads its
        // widened bits, as the CPU twin from those values
        let (_, o16, h_lse, hg) = launch(true, true);
        assert_eq!(o16, bits(&g_out), "d {d}: bf16 output");
        assert!(same(&h_lse, &g_lse), "d {d}: bf16 output's lse");
        let widened: Vec<f32> = o16
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        let want = cpu_backward(&widened);
        for (name, got, want) in [
            ("dq", &hg[0], &want[0]),
            ("dk", &hg[1], &want[1]),
            ("dv", &hg[2], &want[2]),
        ] {
            close(&format!("d {d}: bf16 output {name}"), got, want);
        }
    }
}

/// `emu_adamw_step`: adamw_check then the update (`model_launchers.cpp`): grid, block, the
/// moments' kind, param, bf16 weight, key, f32 and bf16 gradient, moments, their scales,
/// maps, length, grad_scale, factors, bf16 copy, status.
type AdamWLaunch = unsafe extern "C" fn(
    u32,
    u32,
    i32,
    *mut f32,
    *mut u16,
    u64,
    *const f32,
    *const u16,
    *mut std::ffi::c_void,
    *mut std::ffi::c_void,
    *mut f32,
    *mut f32,
    *const f32,
    i64,
    f32,
    *const ares_cuda::AdamWScalars,
    *mut u16,
    *mut u32,
);

#[test]
fn kernel_on_cpu_adamw_reads_bf16_gradients_as_their_widened_values() {
    // a gradient kept in bf16, read by the check and the update as stored: every output the
    // bits of the same launch on its widened f32 values, for each moment kind, an f32
    // parameter with its bf16 copy and a weight stored in bf16; a bf16 NaN or ∞ is flagged
    // and changes nothing
    use ares_cpu::ops::optim::AdamWConfig;
    use ares_cpu::ops::optim_int8::{BLOCK, blocks, dynamic_map};
    use ares_cpu::ops::precision::round_to_bf16;
    use ares_cuda::AdamWStep;
    let Some(lib) = model_kernels() else { return };
    let step_of = launcher!(lib, "emu_adamw_step", AdamWLaunch);
    let mut rng = Rng(57);
    let n = BLOCK + 700;
    let cfg = AdamWConfig::default();
    let mut maps = dynamic_map(true).to_vec();
    maps.extend(dynamic_map(false));
    let b = blocks(n);
    let p0: Vec<f32> = (0..n).map(|_| rng.range(-0.1, 0.1)).collect();
    let mut w0 = vec![0u16; n];
    round_to_bf16(&p0, &mut w0).expect("lengths");
    let grads16: Vec<Vec<u16>> = (0..3)
        .map(|t| {
            let g: Vec<f32> = (0..n).map(|_| rng.range(-1.0, 1.0)).collect();
            let mut bits = vec![0u16; n];
            round_to_bf16(&g, &mut bits).expect("lengths");
            if t == 1 {
                bits[BLOCK + 5] = 0xff80; // -∞
            }
            bits
        })
        .collect();
    /// One run's state: parameter or weight, copy, moments (as bytes), scales.
    #[derive(Clone, PartialEq, Debug)]
    struct State {
        p: Vec<u32>,
        w: Vec<u16>,
        copy: Vec<u16>,
        m: Vec<u8>,
        v: Vec<u8>,
        am: Vec<u32>,
        av: Vec<u32>,
    }
    for moments in 0..3i32 {
        let width = [4, 2, 1][moments as usize];
        for stored_weight in [false, true] {
            let fresh = State {
                p: p0.iter().map(|x| x.to_bits()).collect(),
                w: w0.clone(),
                copy: vec![0; n],
                m: vec![0; n * width],
                v: vec![0; n * width],
                am: vec![0; b],
                av: vec![0; b],
            };
            let (mut wide, mut narrow) = (fresh.clone(), fresh.clone());
            let mut step = 0u64;
            for (t, g16) in grads16.iter().enumerate() {
                let g32: Vec<f32> = g16
                    .iter()
                    .map(|&x| f32::from_bits(u32::from(x) << 16))
                    .collect();
                let bad = g32.iter().any(|x| !x.is_finite());
                step += u64::from(!bad);
                let s = AdamWStep {
                    lr: 3e-4,
                    beta1: cfg.beta1,
                    beta2: cfg.beta2,
                    eps: cfg.eps,
                    weight_decay: cfg.weight_decay,
                    step: step.max(1),
                    grad_scale: 0.75,
                }
                .scalars()
                .expect("scalars");
                let key = 0x5EED_0000 + t as u64;
                let before = narrow.clone();
                let mut statuses = [0u32; 2];
                let runs = [(&mut wide, false), (&mut narrow, true)];
                for ((run, from_bf16), status) in runs.into_iter().zip(&mut statuses) {
                    let (param, weight, copy) = if stored_weight {
                        (
                            std::ptr::null_mut(),
                            run.w.as_mut_ptr(),
                            std::ptr::null_mut(),
                        )
                    } else {
                        let p = run.p.as_mut_ptr().cast::<f32>();
                        (p, std::ptr::null_mut(), run.copy.as_mut_ptr())
                    };
                    let (g, g16p) = if from_bf16 {
                        (std::ptr::null(), g16.as_ptr())
                    } else {
                        (g32.as_ptr(), std::ptr::null())
                    };
                    // SAFETY: every tensor holds n elements (moments n of their width), the
                    // scales one per block, the maps 512 values.
                    unsafe {
                        step_of(
                            5,
                            128,
                            moments,
                            param,
                            weight,
                            key,
                            g,
                            g16p,
                            run.m.as_mut_ptr().cast(),
                            run.v.as_mut_ptr().cast(),
                            run.am.as_mut_ptr().cast(),
                            run.av.as_mut_ptr().cast(),
                            maps.as_ptr(),
                            n as i64,
                            0.75,
                            &s,
                            copy,
                            status,
                        )
                    };
                }
                let what = format!("moments {moments}, stored weight {stored_weight}, step {t}");
                assert_eq!(statuses[0] != 0, bad, "{what}: the f32 check");
                assert_eq!(statuses, [statuses[0]; 2], "{what}: the bf16 check");
                assert_eq!(narrow, wide, "{what}");
                if bad {
                    assert_eq!(narrow, before, "{what}: nothing written");
                } else {
                    assert_ne!(narrow, before, "{what}: the update moved");
                }
            }
        }
    }
}

#[test]
fn kernel_on_cpu_adamw_of_a_bf16_weight_is_widen_update_round_in_one_pass() {
    // a weight stored in bf16: the fused update (one pass) against what the CPU backend runs
    // in three — widen, the f32 update with each moment dtype, stochastic rounding under the
    // key — to the bit, over three steps; a non-finite gradient leaves everything as it was
    use ares_cpu::ops::optim::{AdamWConfig, adamw_step_scaled};
    use ares_cpu::ops::optim_int8::{BLOCK, adamw_step_int8, blocks, dynamic_map};
    use ares_cpu::ops::precision::{round_to_bf16, round_to_bf16_stochastic, widen_bf16};
    use ares_cuda::AdamWStep;
    let Some(lib) = model_kernels() else { return };
    let fused = launcher!(lib, "emu_adamw_step", AdamWLaunch);
    let mut rng = Rng(93);
    let n = 2 * BLOCK + 300;
    let cfg = AdamWConfig::default();
    // a learning rate whose updates are mostly below half a bf16 ulp: the rounding decides
    let (lr, grad_scale) = (2e-4, 0.5f32);
    let mut weight0 = vec![0u16; n];
    let init: Vec<f32> = (0..n).map(|_| rng.range(-0.1, 0.1)).collect();
    round_to_bf16(&init, &mut weight0).expect("lengths");
    let mut grads: Vec<Vec<f32>> = (0..4)
        .map(|_| (0..n).map(|_| rng.range(-1.0, 1.0)).collect())
        .collect();
    grads[2][777] = f32::NAN;
    let mut maps = dynamic_map(true).to_vec();
    maps.extend(dynamic_map(false));
    let b = blocks(n);
    for moments in 0..3i32 {
        let mut w_cpu = weight0.clone();
        let mut w_emu = weight0.clone();
        let (mut m32, mut v32) = (vec![0.0f32; n], vec![0.0f32; n]);
        let (mut m16, mut v16) = (vec![0u16; n], vec![0u16; n]);
        let (mut m8, mut v8) = (vec![0u8; n], vec![0u8; n]);
        let (mut am, mut av) = (vec![0.0f32; b], vec![0.0f32; b]);
        let (mut em32, mut ev32) = (m32.clone(), v32.clone());
        let (mut em16, mut ev16) = (m16.clone(), v16.clone());
        let (mut em8, mut ev8) = (m8.clone(), v8.clone());
        let (mut eam, mut eav) = (am.clone(), av.clone());
        let mut step = 0u64;
        for (t, g) in grads.iter().enumerate() {
            let key = 0xABCD_0000 + t as u64;
            let bad = g.iter().any(|x| !x.is_finite());
            if !bad {
                step += 1;
            }
            // the three passes, on the CPU
            let mut p = vec![0.0f32; n];
            widen_bf16(&w_cpu, &mut p).expect("lengths");
            let before = w_cpu.clone();
            let ok = match moments {
                0 => adamw_step_scaled(
                    &mut p,
                    g,
                    &mut m32,
                    &mut v32,
                    step.max(1),
                    &cfg,
                    lr,
                    grad_scale,
                    key,
                ),
                // bf16 moments round under the weight's key's moment streams
                1 => adamw_step_scaled(
                    &mut p,
                    g,
                    &mut m16,
                    &mut v16,
                    step.max(1),
                    &cfg,
                    lr,
                    grad_scale,
                    key,
                ),
                _ => adamw_step_int8(
                    &mut p,
                    g,
                    &mut m8,
                    &mut v8,
                    &mut am,
                    &mut av,
                    &maps,
                    step.max(1),
                    &cfg,
                    lr,
                    grad_scale,
                ),
            };
            assert_eq!(ok.is_err(), bad, "the CPU refuses a non-finite gradient");
            round_to_bf16_stochastic(&p, key, &mut w_cpu).expect("lengths");
            if bad {
                assert_eq!(w_cpu, before, "widened and rounded back unchanged");
            }
            // the check, then the fused kernel
            let mut status = 0u32;
            let s = AdamWStep {
                lr,
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                weight_decay: cfg.weight_decay,
                step: step.max(1),
                grad_scale,
            }
            .scalars()
            .expect("scalars");
            let (m_ptr, v_ptr): (*mut std::ffi::c_void, *mut std::ffi::c_void) = match moments {
                0 => (em32.as_mut_ptr().cast(), ev32.as_mut_ptr().cast()),
                1 => (em16.as_mut_ptr().cast(), ev16.as_mut_ptr().cast()),
                _ => (em8.as_mut_ptr().cast(), ev8.as_mut_ptr().cast()),
            };
            // SAFETY: the weight, gradient and moments hold n elements, the scales one per
            // block, the maps 512 values.
            unsafe {
                fused(
                    3,
                    128,
                    moments,
                    std::ptr::null_mut(),
                    w_emu.as_mut_ptr(),
                    key,
                    g.as_ptr(),
                    std::ptr::null(),
                    m_ptr,
                    v_ptr,
                    eam.as_mut_ptr(),
                    eav.as_mut_ptr(),
                    maps.as_ptr(),
                    n as i64,
                    grad_scale,
                    &s,
                    std::ptr::null_mut(),
                    &mut status,
                )
            };
            let what = format!("moments {moments}, update {t}");
            assert_eq!(status != 0, bad, "{what}: the check flags a bad gradient");
            assert_eq!(w_emu, w_cpu, "{what}: the bf16 weight");
            match moments {
                0 => {
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        (bits(&em32), bits(&ev32)),
                        (bits(&m32), bits(&v32)),
                        "{what}"
                    );
                }
                1 => assert_eq!((&em16, &ev16), (&m16, &v16), "{what}"),
                _ => {
                    assert_eq!((&em8, &ev8), (&m8, &v8), "{what}: codes");
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        (bits(&eam), bits(&eav)),
                        (bits(&am), bits(&av)),
                        "{what}: scales"
                    );
                }
            }
        }
        assert_ne!(w_emu, weight0, "moments {moments}: the weight moved");
    }
}

#[test]
fn kernel_on_cpu_adamw_with_bf16_and_8_bit_moments_is_the_cpu_twin() {
    // the low-memory optimizer states (written, never run on a GPU): three steps each, the
    // CPU's bits in the weights, the moments and the bf16 weight copy
    use ares_cpu::ops::optim::{AdamWConfig, adamw_step_scaled};
    use ares_cpu::ops::optim_int8::{BLOCK, adamw_step_int8, blocks, dynamic_map};
    use ares_cuda::{AdamWScalars, AdamWStep};
    let Some(lib) = model_kernels() else { return };
    type Bf16 = unsafe extern "C" fn(
        u32,
        u32,
        u64,
        *mut f32,
        *const f32,
        *mut u16,
        *mut u16,
        i64,
        f32,
        *const AdamWScalars,
        *const u32,
        *mut u16,
    );
    type Int8 = unsafe extern "C" fn(
        *mut f32,
        *const f32,
        *mut u8,
        *mut u8,
        *mut f32,
        *mut f32,
        *const f32,
        i64,
        f32,
        *const AdamWScalars,
        *const u32,
        *mut u16,
    );
    let bf16_launch = launcher!(lib, "emu_adamw_update_bf16", Bf16);
    let int8_launch = launcher!(lib, "emu_adamw_update_int8", Int8);
    let mut rng = Rng(71);
    // two quantisation blocks and a partial third
    let n = 2 * BLOCK + 300;
    let cfg = AdamWConfig::default();
    let (lr, grad_scale) = (1e-3, 0.5f32);
    let params0: Vec<f32> = (0..n).map(|_| rng.range(-0.1, 0.1)).collect();
    let grads: Vec<Vec<f32>> = (0..3)
        .map(|_| (0..n).map(|_| rng.range(-1.0, 1.0)).collect())
        .collect();
    let guard = 0u32;
    // the kernels' per-step factors, as the device gets them
    let scalars = |step: u64| {
        AdamWStep {
            lr,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
            step,
            grad_scale,
        }
        .scalars()
        .expect("scalars")
    };
    let rounded = |p: &[f32]| -> Vec<u16> {
        p.iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect()
    };

    // bf16 moments
    let (mut p_cpu, mut m_cpu, mut v_cpu) = (params0.clone(), vec![0u16; n], vec![0u16; n]);
    let (mut p_emu, mut m_emu, mut v_emu) = (params0.clone(), vec![0u16; n], vec![0u16; n]);
    let mut copy = vec![0u16; n];
    for (t, g) in grads.iter().enumerate() {
        let step = t as u64 + 1;
        // the moments round stochastically under a key of the step's
        let key = 0x5EED_0000 ^ step;
        adamw_step_scaled(
            &mut p_cpu, g, &mut m_cpu, &mut v_cpu, step, &cfg, lr, grad_scale, key,
        )
        .expect("cpu");
        let s = scalars(step);
        // SAFETY: every tensor holds n elements.
        unsafe {
            bf16_launch(
                3,
                128,
                key,
                p_emu.as_mut_ptr(),
                g.as_ptr(),
                m_emu.as_mut_ptr(),
                v_emu.as_mut_ptr(),
                n as i64,
                grad_scale,
                &s,
                &guard,
                copy.as_mut_ptr(),
            )
        };
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&p_emu),
            bits(&p_cpu),
            "bf16 moments, step {step}: weights"
        );
        assert_eq!(
            (&m_emu, &v_emu),
            (&m_cpu, &v_cpu),
            "bf16 moments, step {step}"
        );
        assert_eq!(copy, rounded(&p_cpu), "step {step}: the bf16 copy");
    }

    // 8-bit moments
    let mut maps = dynamic_map(true).to_vec();
    maps.extend(dynamic_map(false));
    let b = blocks(n);
    let (mut p_cpu, mut m_cpu, mut v_cpu) = (params0.clone(), vec![0u8; n], vec![0u8; n]);
    let (mut am_cpu, mut av_cpu) = (vec![0.0f32; b], vec![0.0f32; b]);
    let (mut p_emu, mut m_emu, mut v_emu) = (params0.clone(), vec![0u8; n], vec![0u8; n]);
    let (mut am_emu, mut av_emu) = (vec![0.0f32; b], vec![0.0f32; b]);
    for (t, g) in grads.iter().enumerate() {
        let step = t as u64 + 1;
        adamw_step_int8(
            &mut p_cpu,
            g,
            &mut m_cpu,
            &mut v_cpu,
            &mut am_cpu,
            &mut av_cpu,
            &maps,
            step,
            &cfg,
            lr,
            grad_scale,
        )
        .expect("cpu");
        let s = scalars(step);
        // SAFETY: every tensor holds n elements, the absmax arrays one per block, maps 512.
        unsafe {
            int8_launch(
                p_emu.as_mut_ptr(),
                g.as_ptr(),
                m_emu.as_mut_ptr(),
                v_emu.as_mut_ptr(),
                am_emu.as_mut_ptr(),
                av_emu.as_mut_ptr(),
                maps.as_ptr(),
                n as i64,
                grad_scale,
                &s,
                &guard,
                copy.as_mut_ptr(),
            )
        };
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&p_emu),
            bits(&p_cpu),
            "8-bit moments, step {step}: weights"
        );
        assert_eq!(
            (&m_emu, &v_emu),
            (&m_cpu, &v_cpu),
            "8-bit moments, step {step}: codes"
        );
        assert_eq!(
            bits(&am_emu),
            bits(&am_cpu),
            "step {step}: first-moment absmax"
        );
        assert_eq!(
            bits(&av_emu),
            bits(&av_cpu),
            "step {step}: second-moment absmax"
        );
        assert_eq!(copy, rounded(&p_cpu), "step {step}: the bf16 copy");
    }
}

#[test]
fn kernel_on_cpu_backward_from_16_bit_logits_is_the_f32_kernels_rounded() {
    // the fused bf16/f16 backward against the f32 kernels on the widened logits (rounded to
    // the logits' dtype: bit for bit, status bits equal) and the CPU twin (to an ulp)
    use ares_cpu::ops::entropy_backward::entropy_backward;
    use ares_cpu::ops::log_prob_backward::log_prob_backward;
    use half::{bf16, f16};
    let Some(lib) = model_kernels() else { return };
    type F32 = unsafe extern "C" fn(
        u32,
        *const f32,
        i64,
        f32,
        *const u32,
        *const f32,
        *const f32,
        *mut f32,
        *mut u32,
    );
    type Half = unsafe extern "C" fn(
        i32,
        u32,
        *const u16,
        i64,
        f32,
        *const u32,
        *const f32,
        *const f32,
        *mut u16,
        *mut u32,
    );
    let f32_launch = launcher!(lib, "emu_log_prob_entropy_bwd_f32", F32);
    let half_launch = launcher!(lib, "emu_log_prob_entropy_bwd_16", Half);
    let (rows, vocab, temperature) = (10usize, 777usize, 0.7f32);
    let inv_t = 1.0 / temperature;
    let mut rng = Rng(17);
    let raw: Vec<f32> = (0..rows * vocab).map(|_| rng.range(-4.0, 4.0)).collect();
    let mut targets: Vec<u32> = (0..rows).map(|r| (r * 71 % vocab) as u32).collect();
    let mut lp: Vec<f32> = (0..rows).map(|_| rng.range(-1.0, 1.0)).collect();
    let mut ent: Vec<f32> = (0..rows).map(|_| rng.range(-1.0, 1.0)).collect();
    // rows 0, 4: both parts; 1: log-prob only; 2: entropy only; 3: neither; 4: a −∞ logit;
    // bad: 5 the target's logit −∞, 6 a NaN logit, 7 a NaN coefficient, 8 a target past
    // the vocabulary, 9 an entropy coefficient whose gradient overflows
    let mut raw = raw;
    (ent[1], lp[2], lp[3], ent[3]) = (0.0, 0.0, 0.0, 0.0);
    raw[4 * vocab + 3] = f32::NEG_INFINITY;
    raw[5 * vocab + targets[5] as usize] = f32::NEG_INFINITY;
    raw[6 * vocab + 10] = f32::NAN;
    lp[7] = f32::NAN;
    targets[8] = vocab as u32;
    ent[9] = 3e38;
    let good = [0usize, 1, 2, 3, 4];
    for is_bf16 in [true, false] {
        let (bits, widened): (Vec<u16>, Vec<f32>) = raw
            .iter()
            .map(|&x| {
                if is_bf16 {
                    let h = bf16::from_f32(x);
                    (h.to_bits(), h.to_f32())
                } else {
                    let h = f16::from_f32(x);
                    (h.to_bits(), h.to_f32())
                }
            })
            .unzip();
        let round = |x: f32| -> u16 {
            if is_bf16 {
                bf16::from_f32(x).to_bits()
            } else {
                f16::from_f32(x).to_bits()
            }
        };
        let widen = |b: u16| -> f32 {
            if is_bf16 {
                bf16::from_bits(b).to_f32()
            } else {
                f16::from_bits(b).to_f32()
            }
        };
        for (parts, label) in [
            ((true, true), "both"),
            ((true, false), "log-prob"),
            ((false, true), "entropy"),
        ] {
            let (tp, lpp) = if parts.0 {
                (targets.as_ptr(), lp.as_ptr())
            } else {
                (std::ptr::null(), std::ptr::null())
            };
            let ep = if parts.1 {
                ent.as_ptr()
            } else {
                std::ptr::null()
            };
            let (mut want, mut want_status) = (vec![0f32; rows * vocab], 0u32);
            let (mut got, mut got_status) = (vec![0u16; rows * vocab], 0u32);
            // SAFETY: buffers of rows × vocab (logits, outputs) and rows (ids,
            // coefficients), or null for an absent part.
            unsafe {
                f32_launch(
                    rows as u32,
                    widened.as_ptr(),
                    vocab as i64,
                    inv_t,
                    tp,
                    lpp,
                    ep,
                    want.as_mut_ptr(),
                    &mut want_status,
                );
                half_launch(
                    i32::from(is_bf16),
                    rows as u32,
                    bits.as_ptr(),
                    vocab as i64,
                    inv_t,
                    tp,
                    lpp,
                    ep,
                    got.as_mut_ptr(),
                    &mut got_status,
                );
            }
            let what = format!("{} {label}", if is_bf16 { "bf16" } else { "f16" });
            assert_eq!(got_status, want_status, "{what}: status bits");
            for r in 0..rows {
                let (g, w) = (
                    &got[r * vocab..(r + 1) * vocab],
                    &want[r * vocab..(r + 1) * vocab],
                );
                if w.iter().any(|v| v.is_nan()) {
                    assert!(
                        g.iter().all(|&b| widen(b).is_nan()),
                        "{what} row {r}: a NaN row"
                    );
                    continue;
                }
                for (i, (&gb, &wv)) in g.iter().zip(w).enumerate() {
                    assert_eq!(
                        gb,
                        round(wv),
                        "{what} row {r} logit {i}: {} vs {wv}",
                        widen(gb)
                    );
                }
            }
            // the good rows against the CPU twin on the widened logits, to an ulp
            let n = good.len();
            let x: Vec<f32> = good
                .iter()
                .flat_map(|&r| widened[r * vocab..(r + 1) * vocab].to_vec())
                .collect();
            let mut cpu = vec![0f32; n * vocab];
            let pick = |v: &[f32]| good.iter().map(|&r| v[r]).collect::<Vec<f32>>();
            if parts.0 {
                let ids: Vec<u32> = good.iter().map(|&r| targets[r]).collect();
                log_prob_backward(&x, vocab, temperature, &ids, &pick(&lp), &mut cpu).unwrap();
            }
            if parts.1 {
                entropy_backward(&x, vocab, temperature, &pick(&ent), &mut cpu).unwrap();
            }
            for (k, &r) in good.iter().enumerate() {
                for i in 0..vocab {
                    let (g, c) = (widen(got[r * vocab + i]), cpu[k * vocab + i]);
                    let ulp = (widen(round(c)) - c)
                        .abs()
                        .max(c.abs() * if is_bf16 { 1.0 / 128.0 } else { 1.0 / 1024.0 });
                    assert!(
                        (g - c).abs() <= ulp + 1e-30,
                        "{what} row {r} logit {i}: {g} vs the CPU's {c}"
                    );
                }
            }
        }
    }
}

#[test]
fn kernel_on_cpu_sums_of_squares_of_many_tensors_in_one_read() {
    // the gradient norm's two launches over a whole table of tensors: each tensor's sum as
    // it is alone (bit for bit), as the CPU's up to order, the status word in the same read
    use ares_cpu::ops::optim::sum_of_squares_f64;
    use ares_cuda::sum_of_squares_partition;
    let Some(lib) = model_kernels() else { return };
    type Sums = unsafe extern "C" fn(u32, *const u64, i32, *mut f64, *mut u32, *mut f64);
    let run = launcher!(lib, "emu_sums_of_squares", Sums);
    // (sums, status word read back) of tensors `(address, len, bf16)` in one launch pair,
    // with `status` set before
    let sums_of = |xs: &[(u64, usize, bool)], status: u32| {
        let (mut table, mut partials) = (Vec::new(), 0usize);
        for &(at, len, bf16) in xs {
            let (chunk, blocks) = sum_of_squares_partition(len);
            let words = [len as u64, chunk as u64, partials as u64, u64::from(bf16)];
            table.push(at);
            table.extend(words);
            partials += blocks;
        }
        let mut part = vec![f64::NAN; partials];
        let mut out = vec![f64::NAN; xs.len() + 1];
        let mut word = status;
        // SAFETY: the table points at live slices of the stated lengths; `part` has one slot
        // per block, `out` one per tensor and one for the status.
        unsafe {
            run(
                partials as u32,
                table.as_ptr(),
                xs.len() as i32,
                part.as_mut_ptr(),
                &mut word,
                out.as_mut_ptr(),
            )
        };
        assert_eq!(word, 0, "the status word is cleared");
        let read = out.pop().unwrap();
        (out, read)
    };
    let sums = |xs: &[&[f32]], status: u32| {
        let table: Vec<_> = xs
            .iter()
            .map(|x| (x.as_ptr() as u64, x.len(), false))
            .collect();
        sums_of(&table, status)
    };
    let mut rng = Rng(5);
    // one block, a block boundary, many blocks, and the 1 024-block cap (chunk above 8 192)
    let lens = [1usize, 3000, 8192, 8193, 40_000, 8192 * 1024 + 5];
    let mut xs: Vec<Vec<f32>> = lens
        .iter()
        .map(|&n| (0..n).map(|_| rng.range(-2.0, 2.0)).collect())
        .collect();
    xs[2].iter_mut().for_each(|v| *v *= 1e-20); // squares far below f32's range
    let views: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
    let (together, read) = sums(&views, 0x24);
    assert_eq!(
        read,
        f64::from(0x24u32),
        "the status word travels with the sums"
    );
    for (i, x) in views.iter().enumerate() {
        let cpu = sum_of_squares_f64(x);
        assert!(
            (together[i] - cpu).abs() <= 1e-12 * cpu,
            "tensor {i} (len {}): {} vs the CPU's {cpu}",
            x.len(),
            together[i]
        );
        let (alone, read) = sums(&[x], 0);
        assert_eq!(read, 0.0);
        assert_eq!(
            alone[0].to_bits(),
            together[i].to_bits(),
            "tensor {i}: alone and among others"
        );
    }
    // a bad value spoils its own tensor's sum only
    xs[3][8192] = f32::NAN;
    xs[4][7] = f32::INFINITY;
    let views: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
    let (bad, _) = sums(&views[..5], 0);
    assert!(bad[3].is_nan() && bad[4] == f64::INFINITY, "{bad:?}");
    for i in 0..3 {
        assert_eq!(bad[i].to_bits(), together[i].to_bits(), "tensor {i}");
    }
    // gradients stored in bf16 among f32 ones: each bf16 tensor's sum is its widened
    // values' sum as an f32 tensor, bit for bit, and the CPU's up to order
    let halves: Vec<Vec<u16>> = views[..3]
        .iter()
        .map(|x| {
            x.iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect()
        })
        .collect();
    let widened: Vec<Vec<f32>> = halves
        .iter()
        .map(|h| {
            h.iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16))
                .collect()
        })
        .collect();
    let mut table = Vec::new();
    for (h, x) in halves.iter().zip(&views) {
        table.push((h.as_ptr() as u64, h.len(), true));
        table.push((x.as_ptr() as u64, x.len(), false));
    }
    let (mixed, _) = sums_of(&table, 0);
    for (i, (h, w)) in halves.iter().zip(&widened).enumerate() {
        let (alone, _) = sums(&[w], 0);
        assert_eq!(
            mixed[2 * i].to_bits(),
            alone[0].to_bits(),
            "bf16 tensor {i}"
        );
        let cpu = ares_cpu::ops::optim::sum_of_squares_bf16(h);
        assert!((mixed[2 * i] - cpu).abs() <= 1e-12 * cpu, "bf16 tensor {i}");
        assert_eq!(
            mixed[2 * i + 1].to_bits(),
            together[i].to_bits(),
            "f32 tensor {i}"
        );
    }
}

#[test]
fn kernel_on_cpu_bf16_gradient_accumulation_and_fill_are_the_cpu_twin() {
    // written for gradients stored in bf16, never run on a GPU: the CPU's bits whatever the
    // launch shape (three blocks of 64 threads stride over the tensor)
    let Some(lib) = model_kernels() else { return };
    type Accumulate = unsafe extern "C" fn(u32, u32, *const f32, *mut u16, i64, u64);
    type Fill = unsafe extern "C" fn(u32, u32, *mut u16, i64, u16);
    let accumulate = launcher!(lib, "emu_accumulate_bf16_stochastic", Accumulate);
    let fill = launcher!(lib, "emu_fill_bf16", Fill);
    let mut rng = Rng(21);
    let mut x: Vec<f32> = (0..1500).map(|_| rng.range(-1.0, 1.0) * 1e-3).collect();
    x.extend([0.0, -0.0, f32::INFINITY, f32::NAN, 1.0, f32::MAX]);
    let n = x.len();
    let start: Vec<u16> = (0..n)
        .map(|i| half::bf16::from_f32(rng.range(-2.0, 2.0) * (i % 7) as f32).to_bits())
        .collect();
    for key in [0u64, 0x0123_4567_89AB_CDEF] {
        let mut want = start.clone();
        ares_cpu::ops::precision::accumulate_bf16_stochastic(&x, key, &mut want).expect("cpu");
        let mut got = start.clone();
        // SAFETY: x holds n values, got n slots.
        unsafe { accumulate(3, 64, x.as_ptr(), got.as_mut_ptr(), n as i64, key) };
        assert_eq!(got, want, "key {key:#x}");
    }
    for value in [0.0f32, 1.0 + 2f32.powi(-9), -3.5] {
        let mut want = vec![0xAAAAu16; n];
        ares_cpu::ops::precision::fill_bf16(&mut want, value);
        let mut got = vec![0xAAAAu16; n];
        let bits = half::bf16::from_f32(value).to_bits();
        // SAFETY: got holds n slots.
        unsafe { fill(2, 32, got.as_mut_ptr(), n as i64, bits) };
        assert_eq!(got, want, "fill {value}");
    }
}

#[test]
fn kernel_on_cpu_bf16_mlp_activations_are_the_cpu_twin() {
    // written for the MLP's activations stored in bf16, never run on a GPU: SwiGLU over
    // bf16 gate/up (forward and backward) and the residual add + norm with a bf16 output
    let Some(lib) = model_kernels() else { return };
    type Fwd = unsafe extern "C" fn(u32, u32, *const u16, *const u16, *mut u16, i64);
    type Bwd =
        unsafe extern "C" fn(u32, u32, *const f32, *const u16, *const u16, *mut f32, *mut f32, i64);
    type Norm = unsafe extern "C" fn(
        u32,
        u32,
        *const f32,
        *const f32,
        *const f32,
        f32,
        i64,
        i64,
        *mut f32,
        *mut u16,
        *mut f32,
    );
    type Rope =
        unsafe extern "C" fn(u32, u32, *const f32, *const f32, *const f32, i64, i32, i32, *mut u16);
    let fwd = launcher!(lib, "emu_swiglu_fwd_bf16", Fwd);
    let bwd = launcher!(lib, "emu_swiglu_bwd_bf16", Bwd);
    let norm = launcher!(lib, "emu_add_rmsnorm_fwd_bf16", Norm);
    let rope = launcher!(lib, "emu_rope_fwd_bf16", Rope);
    let mut rng = Rng(22);
    let bf = |x: f32| half::bf16::from_f32(x).to_bits();
    let mut g: Vec<u16> = (0..999).map(|_| bf(rng.range(-9.0, 9.0))).collect();
    g.extend([
        bf(0.0),
        bf(-0.0),
        bf(f32::INFINITY),
        bf(f32::NEG_INFINITY),
        bf(f32::NAN),
    ]);
    let n = g.len();
    let u: Vec<u16> = (0..n).map(|_| bf(rng.range(-3.0, 3.0))).collect();
    let mut want = vec![0u16; n];
    ares_cpu::ops::swiglu::swiglu_forward_bf16(&g, &u, &mut want).expect("cpu");
    let mut got = vec![0xAAAAu16; n];
    // SAFETY: g, u hold n values, got n slots.
    unsafe { fwd(3, 64, g.as_ptr(), u.as_ptr(), got.as_mut_ptr(), n as i64) };
    assert_eq!(got, want, "swiglu forward");
    let dy: Vec<f32> = (0..n).map(|_| rng.range(-1.0, 1.0)).collect();
    let (mut wg, mut wu) = (vec![0.0f32; n], vec![0.0f32; n]);
    ares_cpu::ops::swiglu::swiglu_backward_bf16(&dy, &g, &u, &mut wg, &mut wu).expect("cpu");
    let (mut gg, mut gu) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    // SAFETY: every buffer holds n values.
    unsafe {
        bwd(
            2,
            64,
            dy.as_ptr(),
            g.as_ptr(),
            u.as_ptr(),
            gg.as_mut_ptr(),
            gu.as_mut_ptr(),
            n as i64,
        )
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&gg), bits(&wg), "swiglu dgate");
    assert_eq!(bits(&gu), bits(&wu), "swiglu dup");

    let (rows, dim) = (5usize, 96usize);
    let a: Vec<f32> = (0..rows * dim).map(|_| rng.range(-2.0, 2.0)).collect();
    let b: Vec<f32> = (0..rows * dim).map(|_| rng.range(-2.0, 2.0)).collect();
    let w: Vec<f32> = (0..dim).map(|_| rng.range(0.5, 1.5)).collect();
    let (mut ws, mut wo, mut wr) = (
        vec![0.0f32; rows * dim],
        vec![0u16; rows * dim],
        vec![0.0f32; rows],
    );
    ares_cpu::ops::rmsnorm::add_rmsnorm_forward_bf16(
        &a, &b, &w, 1e-6, dim, &mut ws, &mut wo, &mut wr,
    )
    .expect("cpu");
    let (mut gs, mut go, mut gr) = (
        vec![f32::NAN; rows * dim],
        vec![0u16; rows * dim],
        vec![f32::NAN; rows],
    );
    // SAFETY: a, b, sum, out hold rows·dim values, w dim, rstd rows.
    unsafe {
        norm(
            2,
            32,
            a.as_ptr(),
            b.as_ptr(),
            w.as_ptr(),
            1e-6,
            rows as i64,
            dim as i64,
            gs.as_mut_ptr(),
            go.as_mut_ptr(),
            gr.as_mut_ptr(),
        )
    };
    assert_eq!(bits(&gs), bits(&ws), "add_rmsnorm sum");
    assert_eq!(go, wo, "add_rmsnorm bf16 output");
    assert_eq!(bits(&gr), bits(&wr), "add_rmsnorm rstd");
    // RoPE into bf16 (q and k kept in bf16): 5 tokens, 3 heads of 8, NaN kept
    let (tokens, heads, head_dim) = (5usize, 3usize, 8usize);
    let mut x: Vec<f32> = (0..tokens * heads * head_dim)
        .map(|_| rng.range(-4.0, 4.0))
        .collect();
    x[7] = f32::NAN;
    let cos: Vec<f32> = (0..tokens * 4).map(|_| rng.range(-1.0, 1.0)).collect();
    let sin: Vec<f32> = (0..tokens * 4).map(|_| rng.range(-1.0, 1.0)).collect();
    let mut want = vec![0u16; x.len()];
    ares_cpu::ops::rope::rope_forward_bf16(&x, &cos, &sin, heads, head_dim, &mut want)
        .expect("cpu");
    let mut got = vec![0xAAAAu16; x.len()];
    // SAFETY: x and got hold tokens·heads·head_dim values, cos/sin tokens·head_dim/2.
    unsafe {
        rope(
            2,
            32,
            x.as_ptr(),
            cos.as_ptr(),
            sin.as_ptr(),
            tokens as i64,
            heads as i32,
            head_dim as i32,
            got.as_mut_ptr(),
        )
    };
    assert_eq!(got, want, "rope into bf16");
}

#[test]
fn kernel_on_cpu_race_sampler_and_one_kernel_pick_are_the_cpu_twin() {
    // the rollout's sampler and a decode step's one-kernel pick (written, never run on a
    // GPU): the CPU's ids under every filter, and the pick's log-probs and entropies
    use ares_cpu::sampler::{SampleKey, Sampler, sample_rows};
    let Some(lib) = model_kernels() else { return };
    type Race =
        unsafe extern "C" fn(u32, *const f32, i64, i64, f32, u32, f32, f32, *const u32, *mut u32);
    type Pick = unsafe extern "C" fn(
        u32,
        *const f32,
        i64,
        i64,
        i32,
        f32,
        u32,
        f32,
        f32,
        *const u32,
        f32,
        *mut u32,
        *mut u32,
        *mut u32,
        *mut u32,
    );
    let race = launcher!(lib, "emu_sample_race", Race);
    let pick = launcher!(lib, "emu_pick_rows", Pick);
    let mut rng = Rng(83);
    let (rows, vocab) = (5usize, 3000usize);
    let mut logits: Vec<f32> = (0..rows * vocab).map(|_| rng.range(-8.0, 8.0)).collect();
    // row 3: a few finite tokens among −∞; row 4: a NaN (no token)
    for (t, x) in logits[3 * vocab..4 * vocab].iter_mut().enumerate() {
        if t % 97 != 5 {
            *x = f32::NEG_INFINITY;
        }
    }
    logits[4 * vocab + 17] = f32::NAN;
    let keys: Vec<SampleKey> = (0..rows as u64)
        .map(|r| SampleKey {
            seed: 0x1234_5678_9ABC,
            sequence: r,
            step: 7,
        })
        .collect();
    let words: Vec<u32> = keys.iter().flat_map(|k| k.words()).collect();
    let samplers = [
        Sampler::with_temperature(1.0),
        Sampler {
            temperature: 0.7,
            top_k: 50,
            top_p: 1.0,
            min_p: 0.0,
        },
        Sampler {
            temperature: 1.3,
            top_k: 0,
            top_p: 0.9,
            min_p: 0.0,
        },
        Sampler {
            temperature: 0.9,
            top_k: 200,
            top_p: 0.8,
            min_p: 0.05,
        },
    ];
    for sampler in samplers {
        let mut want = vec![0u32; rows];
        sample_rows(&logits, vocab, &sampler, &keys, &mut want).expect("cpu");
        let inv_t = 1.0 / sampler.temperature;
        let mut got = vec![7u32; rows];
        // SAFETY: logits hold rows × vocab values, words 5 a row, got one a row.
        unsafe {
            race(
                ROW_BLOCK,
                logits.as_ptr(),
                vocab as i64,
                rows as i64,
                inv_t,
                sampler.top_k,
                sampler.top_p,
                sampler.min_p,
                words.as_ptr(),
                got.as_mut_ptr(),
            )
        };
        assert_eq!(got, want, "{sampler:?}: sample_race");
        // the one-kernel pick: the same ids, with log-probs and entropies at temperature 1
        let (mut ids, mut status, mut done) = (vec![7u32; rows], 0u32, 0u32);
        let mut packed = vec![7u32; 3 * rows + 1];
        // SAFETY: as above; packed holds 3 words a row and the status word.
        unsafe {
            pick(
                ROW_BLOCK,
                logits.as_ptr(),
                vocab as i64,
                rows as i64,
                1,
                inv_t,
                sampler.top_k,
                sampler.top_p,
                sampler.min_p,
                words.as_ptr(),
                1.0,
                ids.as_mut_ptr(),
                &mut status,
                &mut done,
                packed.as_mut_ptr(),
            )
        };
        assert_eq!(&packed[..rows], &want[..], "{sampler:?}: pick_rows ids");
        assert_eq!(&ids[..rows - 1], &want[..rows - 1], "{sampler:?}: ids stay");
        assert_eq!(packed[3 * rows] & 1, 1, "the NaN row sets status bit 1");
        for r in 0..rows - 1 {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
            let lp = f64::from(row[want[r] as usize] - max) - z.ln();
            let h: f64 = row
                .iter()
                .filter(|x| x.is_finite())
                .map(|&x| {
                    let p = f64::from(x - max).exp() / z;
                    -p * p.ln()
                })
                .sum();
            let got_lp = f64::from(f32::from_bits(packed[rows + r]));
            let got_h = f64::from(f32::from_bits(packed[2 * rows + r]));
            assert!(
                (got_lp - lp).abs() < 1e-4 * lp.abs().max(1.0),
                "row {r}: log-prob {got_lp} vs {lp}"
            );
            assert!(
                (got_h - h).abs() < 1e-4 * h.abs().max(1.0),
                "row {r}: entropy {got_h} vs {h}"
            );
        }
    }
}

#[test]
fn kernel_on_cpu_paged_bf16_kv_append_and_split_k_decode_are_the_cpu_twin() {
    // bf16 KV pages and split-K decoding (written, never run on a GPU): the append's bits,
    // and the decode of long tables (split-K) and short ones against the CPU twins
    use ares_cpu::ops::attention::{
        AttentionShape, PagedKvCache, PagedKvCacheMut, paged_attention_decode_bf16,
        paged_kv_cache_append_bf16,
    };
    let Some(lib) = model_kernels() else { return };
    type Append = unsafe extern "C" fn(
        *const f32,
        *const f32,
        i64,
        i64,
        i64,
        *const u32,
        *const u32,
        i64,
        i64,
        i64,
        *mut u16,
        *mut u16,
        *mut u32,
    );
    type Decode = unsafe extern "C" fn(
        *const f32,
        *const u16,
        *const u16,
        i64,
        i64,
        i32,
        i32,
        i32,
        f32,
        *const u32,
        *const u32,
        i64,
        i64,
        i64,
        *mut f32,
        *mut u32,
        *mut f32,
    );
    let append = launcher!(lib, "emu_paged_kv_append_bf16", Append);
    let decode = launcher!(lib, "emu_paged_decode_kv16", Decode);
    let mut rng = Rng(97);
    let bits = |x: f32| half::bf16::from_f32(x).to_bits();
    // (head_dim, new tokens a sequence, table width in blocks, lengths before the step):
    // one query a sequence over 48 blocks of 16 (768 slots: split-K), then three queries
    // over 8 blocks (unsplit)
    for (d, seq, max_blocks, before) in [
        (64usize, 1usize, 48usize, vec![0u32, 300, 767]),
        (128, 1, 48, vec![40, 511, 600]),
        (64, 3, 8, vec![0, 60, 125]),
    ] {
        let (batch, hq, hkv, block_size) = (before.len(), 4usize, 2usize, 16usize);
        let pool_blocks = batch * max_blocks;
        let tok = hkv * d;
        // each sequence's blocks scattered over the pool (a permutation)
        let mut ids: Vec<u32> = (0..pool_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            let j = (rng.unit() * (i + 1) as f32) as usize % (i + 1);
            ids.swap(i, j);
        }
        let pool = pool_blocks * block_size * tok;
        let mut k_cpu: Vec<u16> = (0..pool).map(|_| bits(rng.range(-1.0, 1.0))).collect();
        let mut v_cpu: Vec<u16> = (0..pool).map(|_| bits(rng.range(-1.0, 1.0))).collect();
        let (mut k_emu, mut v_emu) = (k_cpu.clone(), v_cpu.clone());
        let shape = AttentionShape {
            batch,
            seq,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let k_new: Vec<f32> = (0..batch * seq * tok)
            .map(|_| rng.range(-1.0, 1.0))
            .collect();
        let v_new: Vec<f32> = (0..batch * seq * tok)
            .map(|_| rng.range(-1.0, 1.0))
            .collect();
        paged_kv_cache_append_bf16(
            &shape,
            &k_new,
            &v_new,
            PagedKvCacheMut {
                k: &mut k_cpu,
                v: &mut v_cpu,
                block_size,
                block_tables: &ids,
                max_blocks,
                len: &before,
            },
        )
        .expect("cpu append");
        let mut status = 0u32;
        // SAFETY: the pools hold pool_blocks blocks, the tables batch × max_blocks ids, the
        // new tokens batch × seq × tok values.
        unsafe {
            append(
                k_new.as_ptr(),
                v_new.as_ptr(),
                batch as i64,
                seq as i64,
                tok as i64,
                ids.as_ptr(),
                before.as_ptr(),
                block_size as i64,
                max_blocks as i64,
                pool_blocks as i64,
                k_emu.as_mut_ptr(),
                v_emu.as_mut_ptr(),
                &mut status,
            )
        };
        assert_eq!(status, 0);
        assert!(
            k_emu == k_cpu && v_emu == v_cpu,
            "d {d}: the appended pools"
        );
        let q: Vec<f32> = (0..batch * seq * hq * d)
            .map(|_| rng.range(-1.0, 1.0))
            .collect();
        let after: Vec<u32> = before.iter().map(|&l| l + seq as u32).collect();
        let mut want = vec![0.0f32; q.len()];
        paged_attention_decode_bf16(
            &shape,
            &q,
            PagedKvCache {
                k: &k_cpu,
                v: &v_cpu,
                block_size,
                block_tables: &ids,
                max_blocks,
                len: &after,
            },
            &mut want,
        )
        .expect("cpu decode");
        let mut out = vec![NAN; q.len()];
        let mut ws = vec![NAN; 1 << 16];
        // SAFETY: as above; the workspace holds SPLIT_MAX states of every row.
        unsafe {
            decode(
                q.as_ptr(),
                k_emu.as_ptr(),
                v_emu.as_ptr(),
                batch as i64,
                seq as i64,
                hq as i32,
                hkv as i32,
                d as i32,
                shape.scale,
                ids.as_ptr(),
                before.as_ptr(),
                block_size as i64,
                max_blocks as i64,
                pool_blocks as i64,
                out.as_mut_ptr(),
                &mut status,
                ws.as_mut_ptr(),
            )
        };
        assert_eq!(status, 0, "d {d}: status");
        // sums over hundreds of keys in other orders (chunks merged): to the outputs' scale
        let largest = want.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        for (i, (g, w)) in out.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * largest,
                "d {d} seq {seq}: out[{i}] {g} vs {w}"
            );
        }
    }
}
