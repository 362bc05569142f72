//! Errors of the CUDA backend. Every CUDA failure names the kernel or step it came from.

/// What went wrong in `ares-cuda`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA library could not be found at run time.
    #[error(
        "{library} was not found: install the CUDA driver / toolkit libraries and put their \
         directory on LD_LIBRARY_PATH (e.g. /usr/local/cuda/lib64)"
    )]
    LibraryMissing {
        /// The library, e.g. `libcuda.so` or `libnvrtc.so.13`.
        library: &'static str,
    },
    /// NVRTC rejected a kernel source; `log` is its full compiler log.
    #[error("NVRTC failed to compile `{source_name}` for {target}:\n{log}")]
    Compile {
        /// The kernel source file.
        source_name: &'static str,
        /// The target, e.g. `sm_90` (CUBIN) or `compute_90` (PTX).
        target: String,
        /// The compiler log.
        log: String,
    },
    /// A CUDA driver call failed during `step` (a kernel launch names the kernel).
    #[error("CUDA error in {step}: {source}")]
    Driver {
        /// What was being done, e.g. `launch log_prob_entropy_bf16`.
        step: String,
        /// The driver's error.
        source: cudarc::driver::DriverError,
    },
    /// Arguments that do not fit the kernel (lengths, ranges).
    #[error("{kernel}: {message}")]
    BadArgument {
        /// The kernel.
        kernel: &'static str,
        /// What is wrong, naming the argument and value.
        message: String,
    },
    /// A kernel flagged bad input data (NaN/+∞ logits, impossible targets, …).
    #[error("{kernel}: {message}")]
    BadData {
        /// The kernel.
        kernel: &'static str,
        /// What the kernel found.
        message: &'static str,
    },
    /// A kernel flagged input that core's twin rejects: the error core returns for it
    /// (non-finite value, mask entry not 0/1, empty row, a group of one, …).
    #[error("{kernel}: {source}")]
    Invalid {
        /// The kernel (or op) that found it.
        kernel: &'static str,
        /// Core's error.
        source: ares_core::Error,
    },
    /// Kernels met bad values (an id out of range, a mask value not 0/1, NaN logits, a
    /// non-finite gradient) since the last check; the affected outputs are NaN.
    #[error("a device op met bad values (status {bits:#x}): {what}")]
    DeviceStatus {
        /// The status bits (see `model_ops.cu`).
        bits: u32,
        /// What each bit means.
        what: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS error in {step}: {source}")]
    Blas {
        /// The call, e.g. `linear: sgemm`.
        step: String,
        /// cuBLAS's status.
        source: cudarc::cublas::result::CublasError,
    },
    /// A cuBLASLt call failed.
    #[error("cuBLASLt error in {step}: {source}")]
    BlasLt {
        /// The call, e.g. `cublasLtMatmul with the bias epilogue`.
        step: String,
        /// cuBLASLt's status.
        source: cudarc::cublaslt::result::CublasError,
    },
    /// A collective made no progress within its limit (another rank died or hangs).
    #[error(
        "NCCL {what}: no progress in {secs} s (a rank died or hangs; ARES_COLLECTIVE_TIMEOUT \
         sets the limit, in seconds)"
    )]
    CollectiveTimeout {
        /// The operation.
        what: String,
        /// Seconds waited.
        secs: u64,
    },
    /// The on-disk kernel cache could not be written (compiling still worked).
    #[error("kernel cache at {path}: {source}")]
    Cache {
        /// The cache file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Attaches a step name to a driver error.
pub(crate) trait DriverContext<T> {
    fn during(self, step: impl Into<String>) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, cudarc::driver::DriverError> {
    fn during(self, step: impl Into<String>) -> Result<T> {
        self.map_err(|source| Error::Driver {
            step: step.into(),
            source,
        })
    }
}
