//! The model's device ops: one CUDA device with the kernels of `model_ops.cu` (and the
//! fused log-prob/entropy kernel of `token_kernels.cu`, the vision tower's kernels of
//! `vision_ops.cu`) loaded, cuBLAS for the linear
//! layers, and the small device state the kernels share (a status word for bad values, a
//! scratch buffer for two-stage reductions).
//!
//! Every op takes cudarc views ([`CudaView`] in, [`CudaViewMut`] out), checks their
//! lengths against the shape it is given and returns [`Error::BadArgument`] naming the
//! argument before anything is launched; ops are queued on one stream and return without
//! waiting. Bad *values* (an id out of range, a mask value not 0/1, NaN logits, a
//! non-finite gradient) cannot be seen before launch: kernels write NaN into the affected
//! outputs and set a bit of a device status word, which [`ModelOps::check_status`] reads
//! (it waits for the stream) and turns into [`Error::DeviceStatus`]. The ops that wait
//! anyway ([`ModelOps::download`], [`ModelOps::synchronize`], [`ModelOps::sum_of_squares`])
//! check it, so a bad value is reported at the next synchronisation point at the latest.
//!
//! Semantics and numerics are those of the CPU twins in `ares-cpu` named on each op;
//! where the GPU sums in another order the results agree to f32 rounding, not bit for bit.

mod attention;
mod elementwise;
mod head;
mod linear;
mod loss;
mod norm;
mod optim;
mod vision;

pub use attention::{
    AttentionGrads, AttentionInputs, AttentionShape, BF16_HEAD_DIMS, BlockTablesView, KvCache,
    KvCacheMut, MAX_HEAD_DIM, PagedKvCache, PagedKvCacheMut,
};
pub use head::HeadDims;
pub use loss::RacePick;
pub use optim::{AdamWScalars, AdamWStep, StoredView, sum_of_squares_partition};
pub use vision::{Activation, MAX_SEGMENT_HEAD_DIM, SegmentAttentionShape};

use crate::device::{DeviceInfo, load_module, open_device};
use crate::error::{DriverContext, Error, Result};
use crate::gemm::Blas;
use crate::kernels::{
    MODEL_OPS, ModelFunctions, TOKEN_KERNELS, TokenFunctions, VISION_OPS, VisionFunctions,
};
pub(crate) use crate::launch::{ArgOrNull, bad, check_len, grid, i32_of, i64_of, mul};
use crate::staging::Staging;
use crate::token_ops::TokenOps;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, LaunchConfig,
    ValidAsZeroBits,
};
use std::sync::{Arc, Mutex, MutexGuard};

/// Threads per block of the element-wise (grid-stride) kernels.
const ELEMENT_BLOCK: u32 = 256;

/// A CUDA graph of ops captured on a [`ModelOps`] stream ([`ModelOps::begin_capture`]).
pub struct DecodeGraph(cudarc::driver::CudaGraph);

impl std::fmt::Debug for DecodeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraph").finish_non_exhaustive()
    }
}

// SAFETY: a graph is not internally synchronised, so it is not `Sync`; moving one to
// another thread is allowed (CUDA only asks that calls on one graph be serialised, which
// owning it ensures), and its stream is `Send`.
unsafe impl Send for DecodeGraph {}

/// `Ok` for a status word of 0, else [`Error::DeviceStatus`] naming what each bit set means.
fn status_result(word: u32) -> Result<()> {
    if word == 0 {
        return Ok(());
    }
    let what: Vec<&str> = STATUS_BITS
        .iter()
        .filter(|(bit, _)| word & bit != 0)
        .map(|&(_, what)| what)
        .collect();
    Err(Error::DeviceStatus {
        bits: word,
        what: what.join("; "),
    })
}

/// Status bits the kernels set (see `model_ops.cu` and `vision_ops.cu`), with what each
/// means.
const STATUS_BITS: [(u32, &str); 7] = [
    (
        1,
        "a logits row holds NaN or +inf, or every entry is -inf (log_prob_entropy / log_prob_backward / entropy_backward / pick_rows)",
    ),
    (
        2,
        "a target id is >= vocab or has logit -inf (log_prob_entropy / log_prob_backward / pick_rows)",
    ),
    (
        4,
        "a token id is >= the table's rows (embedding / embedding_backward), or a row index >= rows (scatter_rows)",
    ),
    (8, "a key mask value is neither 0 nor 1 (attention)"),
    (
        16,
        "a log-prob or entropy coefficient is NaN or ±inf, or so large against the temperature that the gradient overflows (log_prob_backward / entropy_backward)",
    ),
    (
        32,
        "a gradient holds NaN or ±inf (adamw_step; that step was not applied)",
    ),
    (
        64,
        "cu_seqlens do not start at 0, decrease, or do not end at tokens (segment_attention, or attention over packed segments)",
    ),
];

/// Device state written by kernels and by the host between launches.
struct State {
    /// Status word the kernels OR bits into.
    status: CudaSlice<u32>,
    /// Per-call flag of AdamW's finiteness check.
    guard: CudaSlice<u32>,
    /// Partial sums of `sums_of_squares`, then the totals and the status word (grown on
    /// demand).
    sums: CudaSlice<f64>,
    /// The tensor table of `sums_of_squares` (grown on demand).
    sum_table: CudaSlice<u64>,
    /// Scratch of the two-stage reductions and the attention backward (grown on demand).
    scratch: CudaSlice<f32>,
    /// Blocks-finished counter of the token ops' last-block reductions (the kernel resets
    /// it to 0).
    blocks_done: CudaSlice<u32>,
    /// The one-element total of `masked_dynamic_kl` (the backend reads per-row sums).
    kl_total: CudaSlice<f32>,
    /// bf16 copies of GEMM operands (grown on demand; reused in stream order, since every
    /// op is queued on the one stream).
    bf16: CudaSlice<u16>,
    /// The split-K workspace of paged decoding (allocated at its first use, then kept).
    split_ws: Option<CudaSlice<f32>>,
}

/// The model's ops on one CUDA device (see the module docs).
pub struct ModelOps {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    f: ModelFunctions,
    token: TokenFunctions,
    vision: VisionFunctions,
    blas: Blas,
    state: Mutex<State>,
    /// Page-locked memory the small transfers go through (lock order: `state` first).
    staging: Mutex<Staging>,
    info: DeviceInfo,
}

impl std::fmt::Debug for ModelOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelOps")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl ModelOps {
    /// Opens CUDA device `ordinal`, compiles (or loads from the kernel cache, see
    /// [`crate::nvrtc::cache_dir`]) and loads the kernels, and creates the cuBLAS handle.
    ///
    /// # Errors
    /// [`Error::LibraryMissing`] when libcuda, libnvrtc or libcublas cannot be loaded (a
    /// machine without a GPU driver or CUDA libraries on `LD_LIBRARY_PATH`),
    /// [`Error::Driver`] when the device cannot be opened (no GPU with that ordinal),
    /// [`Error::Compile`] if NVRTC rejects a kernel.
    pub fn new(ordinal: usize) -> Result<Self> {
        let (ctx, mut info) = open_device(ordinal, true)?;
        let (model, image) = load_module(&ctx, &MODEL_OPS, info.arch)?;
        let (token, _) = load_module(&ctx, &TOKEN_KERNELS, info.arch)?;
        let (vision, _) = load_module(&ctx, &VISION_OPS, info.arch)?;
        info.image = image;
        let f = ModelFunctions::load(&model)?;
        let token = TokenFunctions::load(&token)?;
        let vision = VisionFunctions::load(&vision)?;
        // SAFETY: every buffer of this context is used on `stream` alone (NCCL's stream,
        // the only other, gets gradient buffers after a `synchronize`), so cudarc's
        // cross-stream events — two made per allocation — would synchronise nothing.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own, not the legacy default stream, on which CUDA graphs cannot be
        // captured.
        let stream = ctx.new_stream().during("creating the stream")?;
        keep_freed_memory_pooled(&ctx);
        let blas = Blas::new(stream.clone())?;
        let state = State {
            status: stream.alloc_zeros::<u32>(1).during("allocating status")?,
            guard: stream.alloc_zeros::<u32>(1).during("allocating guard")?,
            sums: stream
                .alloc_zeros::<f64>(1 << 10)
                .during("allocating sum partials")?,
            sum_table: stream
                .alloc_zeros::<u64>(1 << 8)
                .during("allocating the sum table")?,
            scratch: stream
                .alloc_zeros::<f32>(1 << 16)
                .during("allocating scratch")?,
            blocks_done: stream
                .alloc_zeros::<u32>(1)
                .during("allocating the block counter")?,
            kl_total: stream
                .alloc_zeros::<f32>(1)
                .during("allocating the KL total")?,
            bf16: stream
                .alloc_zeros::<u16>(1 << 16)
                .during("allocating bf16 scratch")?,
            split_ws: None,
        };
        Ok(Self {
            ctx,
            stream,
            f,
            token,
            vision,
            blas,
            state: Mutex::new(state),
            staging: Mutex::default(),
            info,
        })
    }

    /// Device, driver and kernel-image description.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The stream every op is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A new zeroed f32 buffer of `len` elements (`len >= 1`: CUDA refuses empty
    /// allocations).
    ///
    /// # Errors
    /// `len` 0 or past the address space, the device is out of memory.
    pub fn alloc(&self, len: usize) -> Result<CudaSlice<f32>> {
        self.alloc_zeroed("alloc", len)
    }

    /// A new zeroed u32 buffer of `len` elements (`len >= 1`).
    ///
    /// # Errors
    /// As [`ModelOps::alloc`].
    pub fn alloc_ids(&self, len: usize) -> Result<CudaSlice<u32>> {
        self.alloc_zeroed("alloc_ids", len)
    }

    /// A new zeroed buffer of `len` 16-bit elements (bf16 or f16 bits; `len >= 1`).
    ///
    /// # Errors
    /// As [`ModelOps::alloc`].
    pub fn alloc_half(&self, len: usize) -> Result<CudaSlice<u16>> {
        self.alloc_zeroed("alloc_half", len)
    }

    /// A new zeroed byte buffer of `len` elements (8-bit codes; `len >= 1`).
    ///
    /// # Errors
    /// As [`ModelOps::alloc`].
    pub fn alloc_bytes(&self, len: usize) -> Result<CudaSlice<u8>> {
        self.alloc_zeroed("alloc_bytes", len)
    }

    /// [`ModelOps::alloc`] of any element type, errors naming `kernel`.
    fn alloc_zeroed<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        kernel: &'static str,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        check_alloc(kernel, len, std::mem::size_of::<T>())?;
        self.stream
            .alloc_zeros::<T>(len)
            .during(format!("allocating {len} {}", std::any::type_name::<T>()))
    }

    /// Copies `src` into `dst` (same length); `src` may be reused when this returns. Up to
    /// 1 MiB the copy goes through page-locked memory and is queued without waiting; larger
    /// ones wait while the driver stages them.
    ///
    /// # Errors
    /// Lengths that differ, a driver failure.
    pub fn upload<T: DeviceRepr + ValidAsZeroBits + Copy + 'static>(
        &self,
        src: &[T],
        dst: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        check_len("upload", "dst", src.len(), dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        if Staging::stages::<T>(&self.stream, src.len()) {
            return self.staging().upload(&self.stream, src, dst);
        }
        self.stream.memcpy_htod(src, dst).during("upload")
    }

    /// The page-locked staging buffers.
    fn staging(&self) -> MutexGuard<'_, Staging> {
        self.staging
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Copies `src` to the host after every queued op, then reports bad values any op met
    /// ([`ModelOps::check_status`]).
    ///
    /// # Errors
    /// Lengths that differ, a driver failure, [`Error::DeviceStatus`].
    pub fn download(&self, src: &CudaView<'_, f32>, dst: &mut [f32]) -> Result<()> {
        self.download_as("download", src, dst)
    }

    /// A new device buffer holding `src` (the sampler's keys).
    ///
    /// # Errors
    /// An allocation or copy failure.
    pub fn upload_new<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &[T],
    ) -> Result<cudarc::driver::CudaSlice<T>> {
        self.stream.clone_htod(src).during("upload_new")
    }

    /// [`ModelOps::download`] for ids.
    ///
    /// # Errors
    /// As [`ModelOps::download`].
    pub fn download_ids(&self, src: &CudaView<'_, u32>, dst: &mut [u32]) -> Result<()> {
        self.download_as("download_ids", src, dst)
    }

    /// [`ModelOps::download`] for 16-bit floats (their bits).
    ///
    /// # Errors
    /// As [`ModelOps::download`].
    pub fn download_half(&self, src: &CudaView<'_, u16>, dst: &mut [u16]) -> Result<()> {
        self.download_as("download_half", src, dst)
    }

    /// [`ModelOps::download`] for bytes.
    ///
    /// # Errors
    /// As [`ModelOps::download`].
    pub fn download_bytes(&self, src: &CudaView<'_, u8>, dst: &mut [u8]) -> Result<()> {
        self.download_as("download_bytes", src, dst)
    }

    /// [`ModelOps::download`] of any element type, errors naming `step`.
    fn download_as<T: DeviceRepr + ValidAsZeroBits + Copy + 'static>(
        &self,
        step: &'static str,
        src: &CudaView<'_, T>,
        dst: &mut [T],
    ) -> Result<()> {
        check_len(step, "dst", src.len(), dst.len())?;
        if dst.is_empty() {
            return self.synchronize();
        }
        // the data and the status word in one wait
        let mut state = self.lock();
        let word =
            self.staging()
                .download_checked(&self.stream, src, dst, &state.status.as_view())?;
        if word == 0 {
            return Ok(());
        }
        self.stream
            .memset_zeros(&mut state.status)
            .during("clearing the status word")?;
        status_result(word)
    }

    /// Waits for every queued op, then reports bad values ([`ModelOps::check_status`]).
    ///
    /// # Errors
    /// A failure of a queued op, [`Error::DeviceStatus`].
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().during("synchronize")?;
        self.check_status()
    }

    /// An event recorded on the ops' stream after everything queued so far, with timing on
    /// (`ARES_PROFILE`: a pair brackets an op;
    /// [`CudaEvent::elapsed_ms`](cudarc::driver::CudaEvent::elapsed_ms) reads the time between
    /// them once both are reached).
    ///
    /// # Errors
    /// A driver failure.
    pub fn timing_event(&self) -> Result<cudarc::driver::CudaEvent> {
        self.stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .during("recording a timing event")
    }

    /// Reads the status word (waiting for the queued ops) and clears it: `Ok` when no
    /// kernel met a bad value since the last check.
    ///
    /// # Errors
    /// [`Error::DeviceStatus`] listing what was found; a driver failure.
    pub fn check_status(&self) -> Result<()> {
        let mut state = self.lock();
        let mut word = [0u32; 1];
        self.staging()
            .download(&self.stream, &state.status.as_view(), &mut word)?;
        if word[0] == 0 {
            return Ok(());
        }
        self.stream
            .memset_zeros(&mut state.status)
            .during("clearing the status word")?;
        status_result(word[0])
    }

    /// Starts recording the ops queued on this device's stream into a graph instead of
    /// running them (stream capture, thread-local mode: a call from this thread that a
    /// capture cannot record — an allocation, a transfer, a wait — fails it).
    ///
    /// # Errors
    /// A driver failure (a capture already under way).
    pub fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .during("beginning a graph capture")
    }

    /// Ends the capture [`ModelOps::begin_capture`] began: the instantiated graph of the ops
    /// queued since (none of which ran), or `None` when nothing was recorded or the capture
    /// was invalidated by a call it cannot record — the stream is out of capture mode either
    /// way, and the caller runs the ops again.
    pub fn end_capture(&self) -> Option<DecodeGraph> {
        let flags = cudarc::driver::sys::CUgraphInstantiate_flags(0);
        match self.stream.end_capture(flags) {
            Ok(Some(graph)) => Some(DecodeGraph(graph)),
            Ok(None) | Err(_) => None,
        }
    }

    /// Runs a captured graph again on this device's stream (its kernels read the buffers'
    /// current contents), without waiting.
    ///
    /// # Errors
    /// A driver failure.
    pub fn replay(&self, graph: &DecodeGraph) -> Result<()> {
        graph.0.launch().during("replaying a graph")
    }

    /// Runs `f` with the ARES token ops (HWE windows, row percentiles, masked dynamic KL,
    /// the actor's loss) on this device's stream; `f` also gets the one-element buffer `masked_dynamic_kl`
    /// writes its total to. The ops are queued and return without waiting.
    ///
    /// # Errors
    /// `f`'s.
    pub fn with_token_ops<R>(
        &self,
        f: impl FnOnce(TokenOps<'_>, CudaViewMut<'_, f32>) -> Result<R>,
    ) -> Result<R> {
        let mut state = self.lock();
        let State {
            blocks_done,
            kl_total,
            ..
        } = &mut *state;
        let ops = TokenOps {
            stream: &self.stream,
            entropy_windows: &self.token.entropy_windows,
            row_percentile: &self.token.row_percentile,
            masked_dynamic_kl: &self.token.masked_dynamic_kl,
            mask_row_counts: &self.token.mask_row_counts,
            policy_loss: &self.token.policy_loss,
            cov_select: &self.token.cov_select,
            blocks_done,
            max_shared_per_block: self.info.max_shared_per_block,
        };
        f(ops, kl_total.as_view_mut())
    }

    /// [`TokenOps::row_percentile`] on this device's stream.
    ///
    /// # Errors
    /// As [`TokenOps::row_percentile`].
    pub fn row_percentile(
        &self,
        means: &CudaView<'_, f32>,
        valid: &CudaView<'_, f32>,
        cols: usize,
        q: f32,
        threshold: &mut CudaViewMut<'_, f32>,
        has: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.with_token_ops(|mut t, _| t.row_percentile(means, valid, cols, q, threshold, has))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is plain device memory: a panic elsewhere cannot leave it half-updated
        // in a way that matters, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Raises the release threshold of the device's default memory pool to "never", so memory
/// freed in stream order (buffers of one micro-batch, regrown scratch) stays in the pool for
/// the next allocation instead of going back to the driver at every synchronisation (the
/// default threshold, 0) and being mapped again. A performance hint only: a device without
/// memory pools, or a driver that refuses, keeps the default behaviour.
fn keep_freed_memory_pooled(ctx: &CudaContext) {
    use cudarc::driver::sys;
    let pools = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
        .unwrap_or(0);
    if pools == 0 {
        return;
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the device handle is live (owned by `ctx`); the pool pointer is written by
    // the driver before use; the attribute takes a pointer to a u64 (cuuint64_t).
    unsafe {
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .is_ok()
        {
            let _ = sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut threshold).cast(),
            );
        }
    }
}

/// The first `len` elements of `scratch`, grown (stream-ordered) if needed.
fn scratch<'a, T: DeviceRepr + ValidAsZeroBits>(
    scratch: &'a mut CudaSlice<T>,
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaViewMut<'a, T>> {
    if scratch.len() < len {
        *scratch = stream
            .alloc_zeros::<T>(len.next_power_of_two())
            .during(format!(
                "growing scratch to {len} {}",
                std::any::type_name::<T>()
            ))?;
    }
    scratch
        .try_slice_mut(0..len)
        .ok_or_else(|| bad("scratch", format!("scratch of {len} elements")))
}

/// Errors unless `len` elements of `size` bytes can be asked of the allocator.
fn check_alloc(kernel: &'static str, len: usize, size: usize) -> Result<()> {
    if len == 0 {
        return Err(bad(
            kernel,
            "len = 0: CUDA refuses empty allocations".into(),
        ));
    }
    if len
        .checked_mul(size)
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(bad(
            kernel,
            format!("len = {len} exceeds the address space"),
        ));
    }
    Ok(())
}

/// Launch shape of a grid-stride element-wise kernel over `n` elements.
pub(crate) fn element_cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid(n.div_ceil(ELEMENT_BLOCK as usize)), 1, 1),
        block_dim: (ELEMENT_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch shape of a kernel with one block of `threads` per row (grid-stride over rows).
pub(crate) fn row_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid(rows), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::MAX_GRID;

    #[test]
    fn without_a_driver_new_is_an_error_naming_the_library() {
        if crate::cuda_available() {
            return; // a machine with a driver: covered by the GPU tests
        }
        let err = ModelOps::new(0).err().map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|m| m.contains("libcuda") && m.contains("LD_LIBRARY_PATH")),
            "{err:?}"
        );
    }

    #[test]
    fn launch_shapes_stay_in_limits() {
        assert_eq!(element_cfg(0).grid_dim.0, 1);
        assert_eq!(element_cfg(257).grid_dim.0, 2);
        assert_eq!(element_cfg(usize::MAX).grid_dim.0, MAX_GRID as u32);
        assert_eq!(row_cfg(5, 128).grid_dim, (5, 1, 1));
        assert!(i32_of("k", "x", 1 << 31).is_err());
        assert!(mul("k", "x", usize::MAX, 2).is_err());
        let e = check_len("k", "dst", 3, 4).err().map(|e| e.to_string());
        assert_eq!(e.as_deref(), Some("k: `dst` has 4 elements, expected 3"));
    }

    #[test]
    fn every_status_bit_has_a_message() {
        let all = STATUS_BITS.iter().fold(0u32, |acc, (bit, _)| acc | bit);
        assert_eq!(all, 127);
        // The bit values match the kernel source's definitions.
        for (bit, name) in [
            (1, "ST_BAD_ROW"),
            (2, "ST_BAD_TARGET"),
            (4, "ST_BAD_ID"),
            (8, "ST_BAD_MASK"),
            (16, "ST_BAD_COEFF"),
            (32, "ST_BAD_GRAD"),
        ] {
            assert!(
                MODEL_OPS.code.contains(&format!("#define {name} {bit}u")),
                "{name}"
            );
        }
        // vision_ops.cu shares the status word: its bits have the same values.
        for (bit, name) in [(4, "ST_BAD_ID"), (64, "ST_BAD_SEGMENTS")] {
            assert!(
                VISION_OPS.code.contains(&format!("#define {name} {bit}u")),
                "{name}"
            );
        }
    }
}
