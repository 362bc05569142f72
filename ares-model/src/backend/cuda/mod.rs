//! [`CudaBackend`]: the [`Backend`] on one NVIDIA GPU, over `ares-cuda`'s
//! [`ModelOps`] (NVRTC-compiled kernels plus cuBLAS). CUDA libraries are loaded at run
//! time, so this compiles without a CUDA toolkit and [`CudaBackend::new`] returns an
//! error (not a crash) on a machine without a GPU or driver.
//!
//! - **Buffers** are device allocations ([`CudaBuffer`], [`CudaIds`]); views become
//!   cudarc views of them, so ops read and write device memory in place.
//! - **Ordering.** Every op is queued on one stream the backend creates (not the legacy
//!   default stream, where CUDA graphs cannot be captured) and returns without waiting;
//!   [`Backend::download`], [`Backend::synchronize`], [`Backend::sums_of_squares`] and
//!   [`Backend::pick_tokens`] (a decode step's one transfer, the status word in it) wait.
//! - **Errors.** Argument errors (lengths, shapes, hyper-parameters) are returned by the
//!   op, before anything is queued. Bad *values* (an id `>= rows`, a mask value not 0/1,
//!   NaN logits or an impossible target, a non-finite coefficient or gradient) are found
//!   by the kernels: the affected outputs become NaN (a non-finite gradient leaves the
//!   AdamW step unapplied) and the next waiting call returns the error, naming what was
//!   found. The CPU backend reports those at the op itself.
//! - **Numerics** follow the CPU backend's kernels (f32 storage and math, f64 for long
//!   sums; GEMMs in the [`MatmulPrecision`] each call carries, true f32 by default, and
//!   in TF32 or bf16 with the operands the CPU backend rounds the same way); results
//!   agree to f32 rounding. Reductions are deterministic (fixed order, no float atomics), so a
//!   run repeats bit for bit on the same GPU.
//! - **Sharing.** `CudaBackend` is a cheap handle: clones share the device, its stream
//!   and its kernels (e.g. the policy and a frozen reference model on one GPU).

mod buffer;

pub use ares_cuda::{device_count, nccl};
pub use buffer::{CudaBuffer, CudaBytes, CudaHalf, CudaIds};

use buffer::{
    bytes_view, bytes_view_mut, half_view, half_view_mut, ids, ids_mut, stored_view, view,
    view_mut, view_mut_opt, view_opt,
};

use ares_cuda::model_ops::StoredView;

use super::ops::{declared_ops, op_arg_type};
use super::{
    ACTOR_LOSS_REPORT, Activation, ActorLossGrads, ActorLossSpec, ActorLossViews, AdamWUpdate,
    AttentionDims, AttentionGrads, AttentionInputs, Backend, BackendError, BlockTables, DType,
    GradWrite, GradWrites, HweViews, KlSumViews, KlViews, KvCacheView, KvCacheViewMut, LinearDims,
    MatmulPrecision, PagedKvView, PagedKvViewMut, PickBuffersOf, PickRule, Result,
    SegmentAttentionDims, Stored, Tensor, TensorMut, View, ViewMut, WindowSpec, check_half,
};
use ares_cpu::sampler::{SampleKey, Sampler};
use ares_cuda::cudarc::driver::CudaView;
use ares_cuda::model_ops::{BlockTablesView, KvCache, KvCacheMut, PagedKvCache, PagedKvCacheMut};
use ares_cuda::{AdamWStep, AttentionShape, DeviceInfo, GemmDims, GemmPrecision, ModelOps};
use std::sync::{Arc, Mutex};

use super::profile::OpTimes;
use ares_cuda::cudarc::driver::CudaEvent;

// a report is the loss kernel's totals and status words, read back whole
const _: () = assert!(ACTOR_LOSS_REPORT == ares_cuda::LOSS_REPORT);

/// The CUDA backend: one GPU, its stream, kernels and cuBLAS handle (see the module docs).
#[derive(Clone)]
pub struct CudaBackend {
    ops: Arc<ModelOps>,
    name: Arc<str>,
    /// Op times when `ARES_PROFILE=1` (shared by clones).
    profile: Option<Arc<Mutex<CudaProfile>>>,
}

/// Ops bracketed by events and not yet read back, and the times read so far.
#[derive(Default)]
struct CudaProfile {
    pending: Vec<(&'static str, CudaEvent, CudaEvent)>,
    times: OpTimes,
}

impl CudaProfile {
    /// Events held before they are read back (a wait for the device every so many ops).
    const BATCH: usize = 4096;

    /// Reads the pending pairs' times (waiting for the last of them).
    fn resolve(&mut self) -> Result<()> {
        for (name, start, end) in self.pending.drain(..) {
            let ms = start.elapsed_ms(&end).map_err(|e| BackendError::Op {
                op: "op_profile",
                source: format!("reading an op's time: {e}").into(),
            })?;
            self.times.add(name, f64::from(ms) / 1e3);
        }
        Ok(())
    }
}

/// Brackets one op with events when profiling: the start recorded at creation, the end
/// when dropped (after the op was queued).
struct OpTimer<'a> {
    backend: &'a CudaBackend,
    start: Option<(&'static str, CudaEvent)>,
}

impl<'a> OpTimer<'a> {
    fn start(backend: &'a CudaBackend, op: &'static str) -> Self {
        let start = backend
            .profile
            .as_ref()
            .and_then(|_| backend.ops.timing_event().ok())
            .map(|e| (op, e));
        Self { backend, start }
    }
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        let (Some((op, start)), Some(profile)) = (self.start.take(), &self.backend.profile) else {
            return;
        };
        let Ok(end) = self.backend.ops.timing_event() else {
            return;
        };
        let mut p = profile.lock().unwrap_or_else(|e| e.into_inner());
        p.pending.push((op, start, end));
        if p.pending.len() >= CudaProfile::BATCH {
            // an error here shows again, with its cause, at the next synchronising call
            let _ = p.resolve();
        }
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.name)
            .finish()
    }
}

/// Wraps an `ares-cuda` error with the backend op that raised it. Argument errors already
/// name their kernel, which is the op.
fn op(name: &'static str) -> impl FnOnce(ares_cuda::Error) -> BackendError {
    move |e| match e {
        ares_cuda::Error::BadArgument { kernel, message } => BackendError::Op {
            op: kernel,
            source: message.into(),
        },
        other => BackendError::Op {
            op: name,
            source: Box::new(other),
        },
    }
}

/// The ares-cuda view of a step's block tables (device ids and their host copies).
fn block_tables<'a, 'b>(
    b: &BlockTables<'a, CudaIds>,
    tables: &'a CudaView<'b, u32>,
    lens: &'a CudaView<'b, u32>,
) -> BlockTablesView<'a, 'b> {
    BlockTablesView {
        tables,
        lens,
        host_tables: b.host_tables,
        host_lens: b.host_len,
        block_size: b.block_size,
        max_blocks: b.max_blocks,
    }
}

/// The `ares-cuda` attention shape of a backend call.
fn shape(dims: AttentionDims) -> AttentionShape {
    AttentionShape {
        batch: dims.batch,
        seq: dims.seq,
        q_heads: dims.q_heads,
        kv_heads: dims.kv_heads,
        head_dim: dims.head_dim,
        scale: dims.scale,
    }
}

/// The cuBLAS dims of a linear layer, in the precision [`MatmulPrecision::for_rows`] picks
/// (the CPU backend's rule, so the two stay twins).
fn gemm_dims(dims: LinearDims) -> GemmDims {
    GemmDims {
        rows: dims.rows,
        in_features: dims.in_features,
        out_features: dims.out_features,
        precision: match dims.precision.for_rows(dims.rows) {
            MatmulPrecision::F32 => GemmPrecision::F32,
            MatmulPrecision::Tf32 => GemmPrecision::Tf32,
            MatmulPrecision::Bf16 => GemmPrecision::Bf16,
        },
    }
}

impl CudaBackend {
    /// The race sampler into `out` with the key words `keys` already on the device.
    fn race(
        &self,
        name: &'static str,
        logits: Tensor<'_, Self>,
        vocab: usize,
        sampler: &Sampler,
        keys: &CudaView<'_, u32>,
        out: &mut CudaIds,
    ) -> Result<()> {
        sampler.check().map_err(|e| BackendError::Op {
            op: name,
            source: e.into(),
        })?;
        self.ops
            .sample_race(
                &view(logits)?,
                vocab,
                1.0 / sampler.temperature,
                sampler.top_k,
                sampler.top_p,
                sampler.min_p,
                keys,
                &mut ids_mut(out)?,
            )
            .map_err(op(name))
    }

    /// Opens GPU `ordinal` (0 for the first), compiling the kernels with NVRTC (cached on
    /// disk: `$ARES_KERNEL_CACHE`, else `~/.cache/ares/kernels`) and creating a cuBLAS
    /// handle.
    ///
    /// # Errors
    /// [`BackendError::Op`] (op `cuda device`) when libcuda, libnvrtc or libcublas cannot
    /// be loaded (the message names the library and `LD_LIBRARY_PATH`), when there is no
    /// GPU with that ordinal, or when a kernel fails to compile.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ops = ModelOps::new(ordinal).map_err(op("cuda device"))?;
        let name = format!("cuda:{ordinal} ({})", ops.info().name);
        Ok(Self {
            ops: Arc::new(ops),
            name: name.into(),
            profile: super::profile::enabled().then(Default::default),
        })
    }

    /// Device, driver, NVRTC and kernel-image description (for logs).
    pub fn info(&self) -> &DeviceInfo {
        self.ops.info()
    }

    /// The device ops underneath (for kernels the trait does not expose, and benches).
    pub fn ops(&self) -> &ModelOps {
        &self.ops
    }
}

/// A host argument in the form `ares-cuda` takes it.
trait ToCuda {
    type Cuda;
    fn to_cuda(self) -> Self::Cuda;
}

impl ToCuda for f32 {
    type Cuda = f32;
    fn to_cuda(self) -> f32 {
        self
    }
}

impl ToCuda for u64 {
    type Cuda = u64;
    fn to_cuda(self) -> u64 {
        self
    }
}

impl ToCuda for usize {
    type Cuda = usize;
    fn to_cuda(self) -> usize {
        self
    }
}

/// The cuBLAS dims of a linear layer, in the precision [`MatmulPrecision::for_rows`] picks
/// (the CPU backend's rule, so the two stay twins).
impl ToCuda for LinearDims {
    type Cuda = GemmDims;
    fn to_cuda(self) -> GemmDims {
        gemm_dims(self)
    }
}

/// Which gradients `linear_backward` writes over (cuBLAS `β = 0`).
impl ToCuda for GradWrites {
    type Cuda = ares_cuda::gemm::Overwrite;
    fn to_cuda(self) -> ares_cuda::gemm::Overwrite {
        ares_cuda::gemm::Overwrite {
            dx: self.dx == GradWrite::Overwrite,
            dw: self.dw == GradWrite::Overwrite,
        }
    }
}

impl ToCuda for AttentionDims {
    type Cuda = AttentionShape;
    fn to_cuda(self) -> AttentionShape {
        shape(self)
    }
}

/// A struct of backend views as the struct of cudarc views `ares-cuda` takes (a
/// `Views<T>` kind of a declared op).
trait CudaViews<'a> {
    type Cuda;
    fn cuda(self) -> Result<Self::Cuda>;
}

impl<'a> CudaViews<'a> for AttentionInputs<'a, CudaBuffer> {
    type Cuda = ares_cuda::model_ops::AttentionInputs<'a>;
    fn cuda(self) -> Result<Self::Cuda> {
        Ok(ares_cuda::model_ops::AttentionInputs {
            q: view(self.q)?,
            k: view(self.k)?,
            v: view(self.v)?,
            key_mask: view_opt(self.key_mask)?,
        })
    }
}

impl<'a> CudaViews<'a> for AttentionGrads<'a, CudaBuffer> {
    type Cuda = ares_cuda::model_ops::AttentionGrads<'a>;
    fn cuda(self) -> Result<Self::Cuda> {
        Ok(ares_cuda::model_ops::AttentionGrads {
            dq: view_mut(self.dq)?,
            dk: view_mut(self.dk)?,
            dv: view_mut(self.dv)?,
        })
    }
}

impl ToCuda for Activation {
    type Cuda = ares_cuda::model_ops::Activation;
    fn to_cuda(self) -> Self::Cuda {
        cuda_activation(self)
    }
}

impl ToCuda for SegmentAttentionDims {
    type Cuda = ares_cuda::model_ops::SegmentAttentionShape;
    fn to_cuda(self) -> Self::Cuda {
        segment_shape(self)
    }
}

impl ToCuda for &AdamWUpdate {
    type Cuda = AdamWStep;
    fn to_cuda(self) -> AdamWStep {
        AdamWStep {
            lr: self.lr,
            beta1: self.config.beta1,
            beta2: self.config.beta2,
            eps: self.config.eps,
            weight_decay: self.config.weight_decay,
            step: self.step,
            grad_scale: self.grad_scale,
        }
    }
}

/// The CUDA form of argument `$a` of declared op `$op` (`ops.rs`): views become cudarc
/// views (a 16-bit view's dtype checked), host values [`ToCuda`].
#[rustfmt::skip]
macro_rules! cuda_arg {
    ($op:ident, $a:ident: In<f32>) => { view($a)? };
    ($op:ident, $a:ident: Out<f32>) => { view_mut($a)? };
    ($op:ident, $a:ident: InOpt<f32>) => { view_opt($a)? };
    ($op:ident, $a:ident: OutOpt<f32>) => { view_mut_opt($a)? };
    ($op:ident, $a:ident: In<u32>) => { ids($a)? };
    ($op:ident, $a:ident: InOpt<u32>) => { $a.map(ids).transpose()? };
    ($op:ident, $a:ident: In<bf16>) => {
        half_view(stringify!($op), stringify!($a), $a, DType::Bf16)?
    };
    ($op:ident, $a:ident: Out<bf16>) => {
        half_view_mut(stringify!($op), stringify!($a), $a, DType::Bf16)?
    };
    ($op:ident, $a:ident: InOpt<bf16>) => {
        $a.map(|v| half_view(stringify!($op), stringify!($a), v, DType::Bf16)).transpose()?
    };
    ($op:ident, $a:ident: OutOpt<bf16>) => {
        $a.map(|v| half_view_mut(stringify!($op), stringify!($a), v, DType::Bf16)).transpose()?
    };
    ($op:ident, $a:ident: Out<u8>) => { bytes_view_mut($a)? };
    ($op:ident, $a:ident: In<stored>) => { stored_view(stringify!($op), stringify!($a), $a)? };
    ($op:ident, $a:ident: Views<$t:ident>) => { CudaViews::cuda($a)? };
    ($op:ident, $a:ident: ViewsMut<$t:ident>) => { CudaViews::cuda($a)? };
    ($op:ident, $a:ident: $($t:tt)+) => { ToCuda::to_cuda($a) };
}

/// How a converted argument is passed to a [`ModelOps`] method.
#[rustfmt::skip]
macro_rules! cuda_pass {
    ($a:ident: In<f32>) => { &$a };
    ($a:ident: Out<f32>) => { &mut $a };
    ($a:ident: InOpt<f32>) => { $a.as_ref() };
    ($a:ident: OutOpt<f32>) => { $a.as_mut() };
    ($a:ident: In<u32>) => { &$a };
    ($a:ident: InOpt<u32>) => { $a.as_ref() };
    ($a:ident: In<bf16>) => { &$a };
    ($a:ident: Out<bf16>) => { &mut $a };
    ($a:ident: OutOpt<bf16>) => { $a.as_mut() };
    ($a:ident: InOpt<bf16>) => { $a.as_ref() };
    ($a:ident: Out<u8>) => { &mut $a };
    ($a:ident: In<stored>) => { $a.as_view() };
    ($a:ident: Views<$t:ident>) => { &$a };
    ($a:ident: ViewsMut<$t:ident>) => { &mut $a };
    ($a:ident: Ref<$t:ident>) => { &$a };
    ($a:ident: $t:ident) => { $a };
}

/// The CUDA implementations of the declared ops: every argument converted first (so a
/// bad view is reported before anything is queued), then the [`ModelOps`] method named by
/// the declaration, its error wrapped with the op's name.
macro_rules! cuda_ops {
    ($(
        $(#[$meta:meta])*
        fn $name:ident($($arg:ident: $kind:ident $(<$dt:ident>)?),* $(,)?)
            cpu $cpu:path, cuda $cuda:ident;
    )*) => {
        $(
            #[allow(clippy::too_many_arguments)]
            fn $name(&self, $($arg: op_arg_type!($kind $(<$dt>)?)),*) -> Result<()> {
                let _timer = OpTimer::start(self, stringify!($name));
                $(
                    #[allow(unused_mut)]
                    let mut $arg = cuda_arg!($name, $arg: $kind $(<$dt>)?);
                )*
                self.ops
                    .$cuda($(cuda_pass!($arg: $kind $(<$dt>)?)),*)
                    .map_err(op(stringify!($name)))
            }
        )*
    };
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Ids = CudaIds;
    type Half = CudaHalf;
    type Bytes = CudaBytes;
    type Graph = ares_cuda::DecodeGraph;

    fn packs_sequences(&self) -> bool {
        true
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn memory_info(&self) -> Option<(u64, u64)> {
        let (free, total) = self.ops.context().mem_get_info().ok()?;
        Some((free as u64, total as u64))
    }

    fn op_profile(&self) -> Result<Option<String>> {
        let Some(profile) = &self.profile else {
            return Ok(None);
        };
        let mut p = profile.lock().unwrap_or_else(|e| e.into_inner());
        p.resolve()?;
        Ok(Some(p.times.table(&self.name)))
    }

    fn begin_capture(&self) -> Result<bool> {
        if self.profile.is_some() {
            // a replayed graph would hide its ops from the timing
            return Ok(false);
        }
        self.ops.begin_capture().map_err(op("begin_capture"))?;
        Ok(true)
    }

    fn end_capture(&self) -> Result<Option<Self::Graph>> {
        Ok(self.ops.end_capture())
    }

    fn replay(&self, graph: &Self::Graph) -> Result<()> {
        self.ops.replay(graph).map_err(op("replay"))
    }

    /// cuBLAS multiplies by the training weights `[out, in]` as fast as by a transposed
    /// copy: the f32 decode weights are the training weights (no copy).
    fn decodes_from_training_weights(&self) -> bool {
        true
    }

    fn keeps_bf16_weights(&self) -> bool {
        true
    }

    fn alloc(&self, len: usize) -> Result<CudaBuffer> {
        let slice = self.ops.alloc(len.max(1)).map_err(op("alloc"))?;
        Ok(CudaBuffer { slice, len })
    }

    fn alloc_ids(&self, len: usize) -> Result<CudaIds> {
        let slice = self.ops.alloc_ids(len.max(1)).map_err(op("alloc_ids"))?;
        Ok(CudaIds { slice, len })
    }

    fn alloc_half(&self, len: usize, dtype: DType) -> Result<CudaHalf> {
        check_half("alloc_half", dtype)?;
        let slice = self.ops.alloc_half(len.max(1)).map_err(op("alloc_half"))?;
        Ok(CudaHalf { slice, len, dtype })
    }

    fn alloc_bytes(&self, len: usize) -> Result<CudaBytes> {
        let slice = self
            .ops
            .alloc_bytes(len.max(1))
            .map_err(op("alloc_bytes"))?;
        Ok(CudaBytes { slice, len })
    }

    fn upload_bytes(&self, src: &[u8], dst: ViewMut<'_, CudaBytes>) -> Result<()> {
        let _timer = OpTimer::start(self, "upload_bytes");
        BackendError::check_len("upload_bytes destination", src.len(), dst.len())?;
        let mut dst = bytes_view_mut(dst)?;
        self.ops.upload(src, &mut dst).map_err(op("upload_bytes"))
    }

    fn download_bytes(&self, src: View<'_, CudaBytes>, dst: &mut [u8]) -> Result<()> {
        let _timer = OpTimer::start(self, "download_bytes");
        BackendError::check_len("download_bytes destination", src.len(), dst.len())?;
        let src = bytes_view(src)?;
        self.ops
            .download_bytes(&src, dst)
            .map_err(op("download_bytes"))
    }

    fn upload(&self, src: &[f32], dst: TensorMut<'_, Self>) -> Result<()> {
        let _timer = OpTimer::start(self, "upload");
        BackendError::check_len("upload destination", src.len(), dst.len())?;
        self.ops
            .upload(src, &mut view_mut(dst)?)
            .map_err(op("upload"))
    }

    fn upload_ids(&self, src: &[u32], dst: &mut CudaIds) -> Result<()> {
        let _timer = OpTimer::start(self, "upload_ids");
        BackendError::check_len("upload_ids destination", src.len(), dst.len)?;
        self.ops
            .upload(src, &mut ids_mut(dst)?)
            .map_err(op("upload_ids"))
    }

    fn download(&self, src: Tensor<'_, Self>, dst: &mut [f32]) -> Result<()> {
        let _timer = OpTimer::start(self, "download");
        BackendError::check_len("download destination", src.len(), dst.len())?;
        self.ops.download(&view(src)?, dst).map_err(op("download"))
    }

    fn upload_half(&self, src: &[u16], dst: ViewMut<'_, CudaHalf>) -> Result<()> {
        let _timer = OpTimer::start(self, "upload_half");
        BackendError::check_len("upload_half destination", src.len(), dst.len())?;
        let dtype = dst.as_view().buffer().dtype;
        let mut dst = half_view_mut("upload_half", "dst", dst, dtype)?;
        self.ops.upload(src, &mut dst).map_err(op("upload_half"))
    }

    fn download_half(&self, src: View<'_, CudaHalf>, dst: &mut [u16]) -> Result<()> {
        let _timer = OpTimer::start(self, "download_half");
        BackendError::check_len("download_half destination", src.len(), dst.len())?;
        let src = half_view("download_half", "src", src, src.buffer().dtype)?;
        self.ops
            .download_half(&src, dst)
            .map_err(op("download_half"))
    }

    fn synchronize(&self) -> Result<()> {
        self.ops.synchronize().map_err(op("synchronize"))
    }

    declared_ops!(cuda_ops);

    fn add(
        &self,
        a: Tensor<'_, Self>,
        b: Tensor<'_, Self>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "add");
        BackendError::check_len("add b", a.len(), b.len())?;
        BackendError::check_len("add out", a.len(), out.len())?;
        self.ops
            .add(&view(a)?, &view(b)?, &mut view_mut(out)?)
            .map_err(op("add"))
    }

    fn greedy_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        ids_buf: &mut CudaIds,
        host: &mut [u32],
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "greedy_tokens");
        BackendError::check_len("greedy_tokens host", ids_buf.len, host.len())?;
        self.ops
            .argmax_rows(&view(logits)?, vocab, &mut ids_mut(ids_buf)?)
            .map_err(op("greedy_tokens"))?;
        self.ops
            .download_ids(&ids(ids_buf)?, host)
            .map_err(op("greedy_tokens"))
    }

    fn sample_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        sampler: &Sampler,
        keys: &[SampleKey],
        ids_buf: &mut CudaIds,
        host: &mut [u32],
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "sample_tokens");
        BackendError::check_len("sample_tokens host", ids_buf.len, host.len())?;
        BackendError::check_len("sample_tokens keys", ids_buf.len, keys.len())?;
        let words: Vec<u32> = keys.iter().flat_map(SampleKey::words).collect();
        let words = self.ops.upload_new(&words).map_err(op("sample_tokens"))?;
        self.race(
            "sample_tokens",
            logits,
            vocab,
            sampler,
            &words.as_view(),
            ids_buf,
        )?;
        self.ops
            .download_ids(&ids(ids_buf)?, host)
            .map_err(op("sample_tokens"))
    }

    /// The pick, its log-prob and entropy in one kernel (greedy or the race into
    /// `bufs.targets`), then one transfer of ids, values and the status word
    /// ([`ModelOps::pick_rows`]); the keys go up into the persistent `bufs.keys`.
    fn pick_tokens(
        &self,
        logits: Tensor<'_, Self>,
        vocab: usize,
        rule: PickRule<'_>,
        temperature: f32,
        bufs: &mut PickBuffersOf<Self>,
        host: &mut [u32],
    ) -> Result<()> {
        const OP: &str = "pick_tokens";
        let rows = bufs.rows();
        BackendError::check_len(
            "pick_tokens host",
            PickBuffersOf::<Self>::host_len(rows),
            host.len(),
        )?;
        let inv_t = 1.0 / temperature;
        let sampler = match rule {
            PickRule::Greedy => None,
            PickRule::Sample { sampler, keys } => {
                sampler.check().map_err(|e| BackendError::Op {
                    op: OP,
                    source: e.into(),
                })?;
                BackendError::check_len("pick_tokens keys", rows, keys.len())?;
                let words: Vec<u32> = keys.iter().flat_map(SampleKey::words).collect();
                self.upload_ids(&words, &mut bufs.keys)?;
                Some(sampler)
            }
        };
        let _timer = OpTimer::start(self, "pick_tokens: pick and download");
        let keys = ids(&bufs.keys)?;
        let race = sampler.map(|s| ares_cuda::model_ops::RacePick {
            inv_t: 1.0 / s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            keys: &keys,
        });
        self.ops
            .pick_rows(
                &view(logits)?,
                vocab,
                inv_t,
                race,
                &mut ids_mut(&mut bufs.targets)?,
                &mut ids_mut(&mut bufs.packed)?,
                host,
            )
            .map_err(op(OP))
    }

    fn sums_of_squares(&self, xs: &[Stored<'_, Self>], out: &mut [f64]) -> Result<()> {
        const OP: &str = "sums_of_squares";
        let _timer = OpTimer::start(self, OP);
        // the device views first (they must outlive the table that borrows them)
        let views = (xs.iter())
            .map(|&x| stored_view(OP, "xs", x))
            .collect::<Result<Vec<_>>>()?;
        let table: Vec<StoredView<'_, '_>> = views.iter().map(|v| v.as_view()).collect();
        self.ops.sums_of_squares_of(&table, out).map_err(op(OP))
    }

    fn kv_cache_append(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: KvCacheViewMut<'_, CudaBuffer>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "kv_cache_append");
        let (max_len, len) = (cache.max_len, cache.len);
        let (mut k, mut v) = (view_mut(cache.k)?, view_mut(cache.v)?);
        self.ops
            .kv_cache_append(
                shape(dims),
                &view(k_new)?,
                &view(v_new)?,
                KvCacheMut {
                    k: &mut k,
                    v: &mut v,
                    max_len,
                    len,
                },
            )
            .map_err(op("kv_cache_append"))
    }

    fn attention_decode(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: KvCacheView<'_, CudaBuffer>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "attention_decode");
        let (k, v) = (view(cache.k)?, view(cache.v)?);
        let mask = view_opt(cache.key_mask)?;
        self.ops
            .attention_decode(
                shape(dims),
                &view(q)?,
                KvCache {
                    k: &k,
                    v: &v,
                    max_len: cache.max_len,
                    len: cache.len,
                    key_mask: mask.as_ref(),
                },
                &mut view_mut(out)?,
            )
            .map_err(op("attention_decode"))
    }

    fn paged_kv_cache_append(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: PagedKvViewMut<'_, CudaBuffer, CudaIds>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "paged_kv_cache_append");
        let b = cache.blocks;
        let (tables, lens) = (ids(b.tables)?, ids(b.len)?);
        let (mut k, mut v) = (view_mut(cache.k)?, view_mut(cache.v)?);
        self.ops
            .paged_kv_cache_append(
                shape(dims),
                &view(k_new)?,
                &view(v_new)?,
                PagedKvCacheMut {
                    k: &mut k,
                    v: &mut v,
                    blocks: block_tables(&b, &tables, &lens),
                },
            )
            .map_err(op("paged_kv_cache_append"))
    }

    fn paged_attention_decode(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, CudaBuffer, CudaIds>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "paged_attention_decode");
        let b = cache.blocks;
        let (tables, lens) = (ids(b.tables)?, ids(b.len)?);
        let (k, v) = (view(cache.k)?, view(cache.v)?);
        self.ops
            .paged_attention_decode(
                shape(dims),
                &view(q)?,
                PagedKvCache {
                    k: &k,
                    v: &v,
                    blocks: block_tables(&b, &tables, &lens),
                },
                &mut view_mut(out)?,
            )
            .map_err(op("paged_attention_decode"))
    }

    fn paged_kv_cache_append_bf16(
        &self,
        dims: AttentionDims,
        k_new: Tensor<'_, Self>,
        v_new: Tensor<'_, Self>,
        cache: PagedKvViewMut<'_, CudaHalf, CudaIds>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "paged_kv_cache_append_bf16");
        const OP: &str = "paged_kv_cache_append_bf16";
        let b = cache.blocks;
        let (tables, lens) = (ids(b.tables)?, ids(b.len)?);
        let mut k = half_view_mut(OP, "k_cache", cache.k, DType::Bf16)?;
        let mut v = half_view_mut(OP, "v_cache", cache.v, DType::Bf16)?;
        self.ops
            .paged_kv_cache_append_bf16(
                shape(dims),
                &view(k_new)?,
                &view(v_new)?,
                PagedKvCacheMut {
                    k: &mut k,
                    v: &mut v,
                    blocks: block_tables(&b, &tables, &lens),
                },
            )
            .map_err(op(OP))
    }

    fn paged_attention_decode_bf16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, CudaHalf, CudaIds>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "paged_attention_decode_bf16");
        const OP: &str = "paged_attention_decode_bf16";
        let b = cache.blocks;
        let (tables, lens) = (ids(b.tables)?, ids(b.len)?);
        let k = half_view(OP, "k_cache", cache.k, DType::Bf16)?;
        let v = half_view(OP, "v_cache", cache.v, DType::Bf16)?;
        self.ops
            .paged_attention_decode_bf16(
                shape(dims),
                &view(q)?,
                PagedKvCache {
                    k: &k,
                    v: &v,
                    blocks: block_tables(&b, &tables, &lens),
                },
                &mut view_mut(out)?,
            )
            .map_err(op(OP))
    }

    fn paged_attention_prefill_bf16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, CudaBuffer, CudaIds>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "paged_attention_prefill_bf16");
        let b = cache.blocks;
        let (tables, lens) = (ids(b.tables)?, ids(b.len)?);
        let (k, v) = (view(cache.k)?, view(cache.v)?);
        self.ops
            .paged_attention_prefill_bf16(
                shape(dims),
                &view(q)?,
                PagedKvCache {
                    k: &k,
                    v: &v,
                    blocks: block_tables(&b, &tables, &lens),
                },
                &mut view_mut(out)?,
            )
            .map_err(op("paged_attention_prefill_bf16"))
    }

    fn paged_attention_prefill_bf16_kv16(
        &self,
        dims: AttentionDims,
        q: Tensor<'_, Self>,
        cache: PagedKvView<'_, CudaHalf, CudaIds>,
        out: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "paged_attention_prefill_bf16_kv16");
        const OP: &str = "paged_attention_prefill_bf16_kv16";
        let b = cache.blocks;
        let (tables, lens) = (ids(b.tables)?, ids(b.len)?);
        let k = half_view(OP, "k_cache", cache.k, DType::Bf16)?;
        let v = half_view(OP, "v_cache", cache.v, DType::Bf16)?;
        self.ops
            .paged_attention_prefill_bf16_kv16(
                shape(dims),
                &view(q)?,
                PagedKvCache {
                    k: &k,
                    v: &v,
                    blocks: block_tables(&b, &tables, &lens),
                },
                &mut view_mut(out)?,
            )
            .map_err(op(OP))
    }

    fn entropy_windows(
        &self,
        entropy: Tensor<'_, Self>,
        mask: Tensor<'_, Self>,
        spec: WindowSpec,
        hwe: Option<HweViews<'_, CudaBuffer>>,
        means: TensorMut<'_, Self>,
        valid: TensorMut<'_, Self>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "entropy_windows");
        let hwe = match hwe {
            Some(h) => Some(ares_cuda::HweOutputs {
                tau: h.tau,
                trigger: view_opt(h.trigger)?,
                hwe_mask: view_mut(h.hwe_mask)?,
                counts: view_mut(h.counts)?,
                soft_cost: view_mut(h.soft_cost)?,
            }),
            None => None,
        };
        let spec = ares_cuda::WindowSpec {
            cols: spec.cols,
            window_size: spec.window_size,
            includes_self: spec.includes_self,
        };
        let (entropy, mask) = (view(entropy)?, view(mask)?);
        let (mut means, mut valid) = (view_mut(means)?, view_mut(valid)?);
        self.ops
            .with_token_ops(|mut t, _| {
                t.entropy_windows(&entropy, &mask, spec, hwe, &mut means, &mut valid)
            })
            .map_err(op("entropy_windows"))
    }

    fn masked_dynamic_kl(
        &self,
        inputs: KlViews<'_, CudaBuffer>,
        outputs: KlSumViews<'_, CudaBuffer>,
    ) -> Result<()> {
        let _timer = OpTimer::start(self, "masked_dynamic_kl");
        let inputs = ares_cuda::MaskedKlInputs {
            logp: view(inputs.logp)?,
            ref_logp: view(inputs.ref_logp)?,
            mask: view(inputs.mask)?,
            hwe_mask: view_opt(inputs.hwe_mask)?,
            beta_rows: view(inputs.beta_rows)?,
            low_ratio: inputs.low_ratio,
            estimator: inputs.estimator,
            cols: inputs.cols,
        };
        let (weighted, row_weighted_sum, row_mean_kl) = (
            view_mut_opt(outputs.weighted)?,
            view_mut(outputs.row_weighted_sum)?,
            view_mut(outputs.row_mean_kl)?,
        );
        self.ops
            .with_token_ops(|mut t, total| {
                let outputs = ares_cuda::MaskedKlOutputs {
                    kl: None,
                    weighted,
                    row_weighted_sum,
                    row_mean_kl,
                    total,
                };
                t.masked_dynamic_kl(inputs, outputs)
            })
            .map_err(op("masked_dynamic_kl"))
    }

    fn actor_loss(
        &self,
        spec: &ActorLossSpec,
        inputs: ActorLossViews<'_, CudaBuffer>,
        grads: ActorLossGrads<'_, CudaBuffer>,
        report: TensorMut<'_, Self>,
    ) -> Result<std::result::Result<(), ares_core::Error>> {
        use ares_core::loss::Objective;
        use ares_cuda::{LOSS_STATS, LossInputs, LossKind, LossOutputs, LossSpec};
        const K: &str = "actor_loss";
        let _timer = OpTimer::start(self, K);
        let kind = match spec.objective {
            Objective::Ppo => LossKind::Ppo,
            Objective::Gspo(level) => LossKind::Gspo(level),
            Objective::Cispo => LossKind::Cispo,
            Objective::ClipCov(p) => LossKind::ClipCov(p),
            Objective::KlCov(p) => LossKind::KlCov(p),
        };
        let cuda_spec = LossSpec {
            kind,
            config: spec.config,
            kl: spec.kl.map(|(estimator, low_ratio)| ares_cuda::KlLossSpec {
                estimator,
                low_ratio,
            }),
            entropy_coef: spec.entropy_coef,
            scale: spec.scale,
        };
        let n = inputs.logp.len();
        let rows = n / inputs.cols.max(1);
        BackendError::check_len("actor_loss: report", ACTOR_LOSS_REPORT, report.len())?;
        let mut counts = self.alloc(rows)?;
        let mut stats = self.alloc(rows * LOSS_STATS)?;
        let mut status = self.alloc_ids(2)?;
        let mut selected = if kind.selects_tokens() {
            Some(self.alloc(n)?)
        } else {
            None
        };
        let cuda_inputs = LossInputs {
            logp: view(inputs.logp)?,
            logp_old: view(inputs.logp_old)?,
            advantages: view(inputs.advantages)?,
            mask: view(inputs.mask)?,
            logp_rollout: view_opt(inputs.logp_rollout)?,
            keep: view_opt(inputs.keep)?,
            logp_ref: view_opt(inputs.logp_ref)?,
            beta_rows: view_opt(inputs.beta_rows)?,
            hwe: view_opt(inputs.hwe_mask)?,
            entropy: view_opt(inputs.entropy)?,
            cols: inputs.cols,
        };
        let (grad, entropy_grad) = (view_mut(grads.grad)?, view_mut_opt(grads.entropy_grad)?);
        // the report is the kernel's totals with its status words after them
        let (row_counts, row_stats, total_view) = (
            view_mut(ViewMut::whole(&mut counts))?,
            view_mut(ViewMut::whole(&mut stats))?,
            view_mut(report)?,
        );
        let status_view = ids_mut(&mut status)?;
        let selected_view = selected
            .as_mut()
            .map(|b| view_mut(ViewMut::whole(b)))
            .transpose()?;
        self.ops
            .with_token_ops(|mut t, _| {
                t.policy_loss(
                    &cuda_spec,
                    cuda_inputs,
                    LossOutputs {
                        grad,
                        entropy_grad,
                        row_counts,
                        row_stats,
                        totals: total_view,
                        status: status_view,
                        selected: selected_view,
                    },
                )
            })
            .map_err(op(K))?;
        Ok(Ok(()))
    }

    fn actor_loss_output(
        &self,
        report: &[f32; ACTOR_LOSS_REPORT],
    ) -> std::result::Result<ares_core::loss::ActorLossOutput<f32>, ares_core::Error> {
        ares_cuda::LossReport::from_report(report).map(|r| ares_core::loss::ActorLossOutput {
            policy: r.policy,
            kl_loss: r.kl_loss,
            entropy: r.entropy,
        })
    }
}

/// The `ares-cuda` activation of a backend one.
fn cuda_activation(kind: Activation) -> ares_cuda::model_ops::Activation {
    use ares_cuda::model_ops::Activation as A;
    match kind {
        Activation::GeluErf => A::GeluErf,
        Activation::QuickGelu => A::QuickGelu,
        Activation::GeluTanh => A::GeluTanh,
    }
}

/// The `ares-cuda` shape of a segment attention call.
fn segment_shape(dims: SegmentAttentionDims) -> ares_cuda::model_ops::SegmentAttentionShape {
    ares_cuda::model_ops::SegmentAttentionShape {
        tokens: dims.tokens,
        segments: dims.segments,
        heads: dims.heads,
        head_dim: dims.head_dim,
        scale: dims.scale,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_new_is_a_clear_error() {
        if ares_cuda::cuda_available() {
            return; // a machine with a driver: the GPU tests cover `new`
        }
        let err = CudaBackend::new(0).err().map(|e| e.to_string());
        let msg = err.unwrap_or_default();
        assert!(
            msg.starts_with("cuda device: ") && msg.contains("libcuda"),
            "{msg}"
        );
    }

    /// The backend and its buffers may move between and be shared by threads (the trainer
    /// scores rewards on other threads while the model lives on the GPU).
    #[test]
    fn backend_and_buffers_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<CudaBackend>();
        check::<CudaBuffer>();
        check::<CudaIds>();
    }

    #[test]
    fn argument_errors_name_the_op_once() {
        let e = op("linear")(ares_cuda::Error::BadArgument {
            kernel: "linear",
            message: "`x` has 3 elements, expected 4".into(),
        });
        assert_eq!(e.to_string(), "linear: `x` has 3 elements, expected 4");
        let e = op("download")(ares_cuda::Error::DeviceStatus {
            bits: 4,
            what: "a token id is >= the table's rows".into(),
        });
        assert!(
            e.to_string()
                .starts_with("download: a device op met bad values")
        );
    }
}
