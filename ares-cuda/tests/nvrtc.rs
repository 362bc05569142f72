//! Compiles every kernel source with NVRTC for sm_80 and sm_90 as CUBINs (registers and
//! spills checked) and for compute_90 as PTX, without a GPU.
//!
//! Without libnvrtc on the library path the test is skipped with a message, unless
//! `ARES_REQUIRE_NVRTC=1` (CI sets it), which turns the skip into a failure.

use ares_cuda::kernels::ALL;
use ares_cuda::nvrtc::{
    Image, compile_cubin, compile_ptx, cubin_functions, kernel_resources, nvrtc_available,
};

/// ptxas register budget per thread: above it occupancy of these bandwidth-bound kernels
/// drops; a kernel crossing it must be looked at.
const MAX_REGISTERS: u32 = 64;

/// The budget of a kernel: the tensor-core kernels (`_mma_` in the name) keep a warp's
/// 16 × head_dim output, its q fragments and a 16 × 64 score tile in registers — about
/// 160 at head_dim 128, the most a 128-thread block may have is 255 — and are compute-bound.
fn register_budget(kernel: &str) -> u32 {
    if kernel.contains("_mma_") {
        255
    } else if kernel.starts_with("packed_") {
        // `__launch_bounds__(256, 2)`: the f32 attention over packed segments keeps two
        // blocks an SM rather than spill at 64
        128
    } else {
        MAX_REGISTERS
    }
}

fn nvrtc_or_skip() -> bool {
    if nvrtc_available() {
        return true;
    }
    let required = std::env::var("ARES_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "ARES_REQUIRE_NVRTC=1 but libnvrtc was not found on LD_LIBRARY_PATH"
    );
    eprintln!("skipped: libnvrtc not found (set LD_LIBRARY_PATH; see docs/kernels.md 'CUDA')");
    false
}

#[test]
fn every_kernel_compiles_to_sm80_and_sm90_cubins_without_spills() {
    if !nvrtc_or_skip() {
        return;
    }
    let (major, minor) = ares_cuda::nvrtc::nvrtc_version().expect("version");
    eprintln!("NVRTC {major}.{minor}");
    for (arch, src) in [80, 90]
        .into_iter()
        .flat_map(|a| ALL.iter().map(move |s| (a, s)))
    {
        eprintln!("sm_{arch}:");
        let compiled = compile_cubin(src.name, src.code, arch).unwrap_or_else(|e| panic!("{e}"));
        let Image::Cubin(bytes) = &compiled.image else {
            panic!("asked for a CUBIN")
        };
        assert_eq!(
            &bytes[..4],
            b"\x7fELF",
            "{}: CUBIN is an ELF image",
            src.name
        );
        // Registers and stack frame from the CUBIN itself; ptxas's report, where NVRTC
        // gives one, must agree with it (one NVRTC install gave none: benches/RESULTS.md).
        let functions = cubin_functions(bytes).unwrap_or_else(|e| panic!("{}: {e}", src.name));
        let report = kernel_resources(&compiled.log);
        if report.is_empty() {
            eprintln!(
                "{}: NVRTC gave no ptxas report; registers and stack frame from the CUBIN",
                src.name
            );
        }
        for kernel in src.kernels {
            let f = functions
                .iter()
                .find(|f| f.name == *kernel)
                .unwrap_or_else(|| panic!("{kernel} missing from the CUBIN's .nv.info"));
            eprintln!(
                "{kernel}: {} registers, {} bytes stack frame",
                f.registers, f.stack_frame
            );
            assert!(
                f.stack_frame == 0,
                "{kernel} has a stack frame of {} bytes on sm_{arch} (spills)",
                f.stack_frame
            );
            assert!(
                f.registers <= register_budget(kernel),
                "{kernel} uses {} registers",
                f.registers
            );
            if !report.is_empty() {
                let r = report
                    .iter()
                    .find(|r| r.kernel == *kernel)
                    .unwrap_or_else(|| {
                        panic!("{kernel} missing from ptxas report:\n{}", compiled.log)
                    });
                assert!(r.spill_bytes == 0, "{kernel} spills registers on sm_{arch}");
                assert_eq!(
                    r.registers, f.registers,
                    "{kernel}: ptxas and the CUBIN disagree"
                );
            }
        }
    }
}

#[test]
fn every_kernel_compiles_to_ptx() {
    if !nvrtc_or_skip() {
        return;
    }
    for src in ALL {
        let compiled = compile_ptx(src.name, src.code, 90).unwrap_or_else(|e| panic!("{e}"));
        let Image::Ptx(ptx) = &compiled.image else {
            panic!("asked for PTX")
        };
        for kernel in src.kernels {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} missing from PTX"
            );
        }
    }
}

#[test]
fn a_syntax_error_reports_the_nvrtc_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let err = compile_ptx(
        "broken.cu",
        "extern \"C\" __global__ void k() { int x = ; }",
        90,
    )
    .expect_err("must not compile");
    let msg = err.to_string();
    assert!(msg.contains("broken.cu") && msg.contains("error"), "{msg}");
}
