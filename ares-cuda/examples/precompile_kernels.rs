//! Compiles every kernel source with NVRTC for the given architectures into the kernel cache
//! (`$ARES_KERNEL_CACHE`, else `~/.cache/ares/kernels`), as a device of that architecture
//! would on first use — so a machine that has NVRTC can fill the cache of one that will run
//! the kernels (`scripts/gpu-bundle.sh` fills the bundle's for sm_90). The cache key holds
//! the NVRTC version: a device whose NVRTC has another major.minor compiles afresh.
//!
//! `cargo run --release -p ares-cuda --example precompile_kernels -- 90 80`

use ares_cuda::kernels::ALL;
use ares_cuda::nvrtc::{Image, cache_dir, compile_cached, nvrtc_available, nvrtc_version};

fn main() -> std::process::ExitCode {
    if !nvrtc_available() {
        eprintln!("precompile_kernels: libnvrtc not found on LD_LIBRARY_PATH; nothing compiled");
        return std::process::ExitCode::FAILURE;
    }
    let mut archs = Vec::new();
    for a in std::env::args().skip(1) {
        match a.parse::<u32>() {
            Ok(n) if n >= 50 => archs.push(n),
            _ => {
                eprintln!("precompile_kernels: `{a}` is not an architecture like 90 (sm_90)");
                return std::process::ExitCode::FAILURE;
            }
        }
    }
    if archs.is_empty() {
        archs.push(90);
    }
    let version = nvrtc_version()
        .map(|(a, b)| format!("{a}.{b}"))
        .unwrap_or_default();
    let dir = cache_dir()
        .map(|d| d.display().to_string())
        .unwrap_or_default();
    for arch in archs {
        for src in ALL {
            let start = std::time::Instant::now();
            match compile_cached(src.name, src.code, arch) {
                Ok(image) => println!(
                    "{} sm_{arch}: {} with NVRTC {version} in {:.1} s → {dir}",
                    src.name,
                    match image {
                        Image::Cubin(_) => "CUBIN",
                        Image::Ptx(_) => "PTX",
                    },
                    start.elapsed().as_secs_f64()
                ),
                Err(e) => {
                    eprintln!("precompile_kernels: {e}");
                    return std::process::ExitCode::FAILURE;
                }
            }
        }
    }
    std::process::ExitCode::SUCCESS
}
