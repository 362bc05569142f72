//! One CUDA device with the token kernels loaded: context, stream, functions, and the small
//! status words kernels report bad input through.

use crate::error::{DriverContext, Error, Result};
use crate::kernels::{KernelSource, TOKEN_KERNELS, TokenFunctions};
use crate::nvrtc::{self, Image};
use cudarc::driver::{CudaContext, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use std::sync::Arc;

/// True when the CUDA driver library (`libcuda.so`) can be loaded.
pub fn cuda_available() -> bool {
    // SAFETY: only tries to dlopen the library; no CUDA function is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The number of CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`); `None`
/// when the driver cannot be loaded or initialised.
pub fn device_count() -> Option<usize> {
    if !cuda_available() {
        return None;
    }
    CudaContext::device_count()
        .ok()
        .and_then(|n| usize::try_from(n).ok())
}

/// A device with the token kernels compiled and loaded.
pub struct Cuda {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) functions: TokenFunctions,
    /// Kernels OR bits into it when they find bad data; zeroed before each launch.
    pub(crate) status: CudaSlice<u32>,
    /// Blocks-finished counter of the last-block reductions; kernels reset it to 0.
    pub(crate) blocks_done: CudaSlice<u32>,
    info: DeviceInfo,
}

/// What was loaded, for logs and benchmark reports.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Device name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Compute capability as `major·10 + minor`, e.g. 90.
    pub arch: u32,
    /// CUDA driver version, e.g. `13.0`.
    pub driver: String,
    /// NVRTC version.
    pub nvrtc: String,
    /// `CUBIN sm_90` or `PTX compute_XY` (the fallback).
    pub image: String,
    /// Largest dynamic shared memory a block may opt into, in bytes.
    pub max_shared_per_block: usize,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (sm_{}), driver {}, NVRTC {}, kernels as {}",
            self.name, self.arch, self.driver, self.nvrtc, self.image
        )
    }
}

/// Opens device `ordinal` after checking that libcuda, libnvrtc and (with `cublas`) libcublas
/// load, and describes it; `image` is left empty for the caller, who compiles the kernels.
pub(crate) fn open_device(ordinal: usize, cublas: bool) -> Result<(Arc<CudaContext>, DeviceInfo)> {
    if !cuda_available() {
        return Err(Error::LibraryMissing {
            library: "libcuda.so (the CUDA driver)",
        });
    }
    if !nvrtc::nvrtc_available() {
        return Err(Error::LibraryMissing {
            library: "libnvrtc.so (NVRTC)",
        });
    }
    if cublas && !crate::gemm::cublas_available() {
        return Err(Error::LibraryMissing {
            library: "libcublas.so (cuBLAS)",
        });
    }
    let ctx = CudaContext::new(ordinal).during(format!("opening CUDA device {ordinal}"))?;
    let (major, minor) = ctx
        .compute_capability()
        .during("reading compute capability")?;
    let arch = u32::try_from(major * 10 + minor).unwrap_or(0);
    let name = ctx.name().during("reading device name")?;
    let max_shared = ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )
        .during("reading shared memory limit")?;
    let mut driver_version = 0i32;
    // SAFETY: libcuda is present (checked above); the pointer is valid.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .during("cuDriverGetVersion")?;
    let (nv_major, nv_minor) = nvrtc::nvrtc_version()?;
    let info = DeviceInfo {
        name,
        arch,
        driver: format!("{}.{}", driver_version / 1000, (driver_version % 1000) / 10),
        nvrtc: format!("{nv_major}.{nv_minor}"),
        image: String::new(),
        max_shared_per_block: usize::try_from(max_shared).unwrap_or(0),
    };
    Ok((ctx, info))
}

/// Compiles `source` for `arch` (CUBIN, else PTX; disk cache) and loads it; also returns
/// the image's description ([`DeviceInfo::image`]).
pub(crate) fn load_module(
    ctx: &Arc<CudaContext>,
    source: &KernelSource,
    arch: u32,
) -> Result<(Arc<CudaModule>, String)> {
    let image = nvrtc::compile_cached(source.name, source.code, arch)?;
    let desc = match &image {
        Image::Cubin(_) => format!("CUBIN sm_{arch}"),
        Image::Ptx(_) => format!("PTX compute_{arch}"),
    };
    let ptx = match image {
        Image::Cubin(bytes) => Ptx::from_binary(bytes),
        Image::Ptx(text) => Ptx::from_src(text),
    };
    let module = ctx
        .load_module(ptx)
        .during(format!("loading {}", source.name))?;
    Ok((module, desc))
}

impl Cuda {
    /// Opens device `ordinal`, compiles (or loads from the cache) and loads the kernels.
    /// Errors instead of panicking when libcuda or libnvrtc is missing.
    pub fn new(ordinal: usize) -> Result<Self> {
        let (ctx, mut info) = open_device(ordinal, false)?;
        let (module, image) = load_module(&ctx, &TOKEN_KERNELS, info.arch)?;
        info.image = image;
        let functions = TokenFunctions::load(&module)?;
        let stream = ctx.default_stream();
        let status = stream
            .alloc_zeros::<u32>(1)
            .during("allocating the status word")?;
        let blocks_done = stream
            .alloc_zeros::<u32>(1)
            .during("allocating the block counter")?;
        Ok(Cuda {
            stream,
            functions,
            status,
            blocks_done,
            info,
        })
    }

    /// The stream every operation is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Device, driver and kernel-image description.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Zeroes the status word before a launch that reports through it.
    pub(crate) fn clear_status(&mut self, kernel: &'static str) -> Result<()> {
        self.stream
            .memset_zeros(&mut self.status)
            .during(format!("clearing status for {kernel}"))
    }

    /// Reads the status word after a launch (synchronises the stream).
    pub(crate) fn read_status(&self, kernel: &'static str) -> Result<u32> {
        let v = self
            .stream
            .clone_dtoh(&self.status)
            .during(format!("reading status of {kernel}"))?;
        Ok(v.first().copied().unwrap_or(0))
    }
}
