//! One declaration per op. Each op the two backends implement alike — its name, its
//! arguments with their kinds and dtypes, the `ares-cpu` function and the `ares-cuda`
//! [`ModelOps`](ares_cuda::ModelOps) method that run it — is written once, below, and the
//! [`Backend`](super::Backend) method, the CPU implementation and the CUDA implementation
//! follow from it: [`declared_ops!`] hands the list to a macro of each (`declare_ops!` in
//! `mod.rs`, `cpu_ops!` in `cpu.rs`, `cuda_ops!` in `cuda/mod.rs`).
//!
//! Argument kinds:
//! - `In<f32>` / `Out<f32>`: a tensor read / written ([`Tensor`](super::Tensor) /
//!   [`TensorMut`](super::TensorMut)); `InOpt<f32>` / `OutOpt<f32>`: the same, optional;
//! - `In<u32>`: token ids, positions or row indices (`&Self::Ids`); `InOpt<u32>`: the same,
//!   optional (packed sequences' offsets);
//! - `Out<u8>`: a view of a [`Backend::Bytes`](super::Backend::Bytes) buffer written (8-bit
//!   codes);
//! - `In<bf16>` / `Out<bf16>`: a view of a [`Backend::Half`](super::Backend::Half) buffer
//!   that must hold bf16 (checked before the kernel runs:
//!   [`BackendError::DType`](super::BackendError::DType) names the op, the argument and the
//!   dtype given);
//! - `In<stored>`: a tensor read as it is stored, f32 values or bf16 bits
//!   ([`Stored`](super::Stored); a bf16 view's dtype checked as above) — a gradient kept in
//!   bf16 among f32 ones;
//! - `Views<T>` / `ViewsMut<T>`: a struct of views read / written (`AttentionInputs`,
//!   `AttentionGrads`), converted field by field;
//! - `Ref<T>`: a `&T` of host parameters;
//! - any other type: a host scalar or shape, passed by value (each backend converts it to
//!   its kernel's form).
//!
//! The kernels are called with the arguments in the declared order; a kernel whose own
//! order or types differ gets a small adapter next to its backend (`cpu.rs`, `mod kernels`).
//! A dtype is declared per argument: f32 and u32 are separate buffer types, so passing the
//! wrong one is a compile error; the 16-bit floats share
//! [`Backend::Half`](super::Backend::Half) and are checked at run time. A new dtype is a kind
//! here and an arm in each backend. The KV-cache ops, the ARES token ops, the samplers, `add`
//! and `sum_of_squares` are written out in each backend.

/// Calls `$then! { … }` with the declarations of the ops both backends implement alike.
macro_rules! declared_ops {
    ($then:ident) => {
        $then! {
            /// Row gather: `out[t, :] = table[ids[t], :]`, with `table` `[rows, dim]` and `out`
            /// `[ids.len(), dim]`. Token embedding, and the per-token RoPE cos/sin from a table
            /// indexed by position.
            ///
            /// # Errors
            /// Lengths that do not match, or (where checked) an id `>= rows`.
            fn embedding(
                ids: In<u32>,
                table: In<f32>,
                rows: usize,
                dim: usize,
                out: Out<f32>,
            ) cpu ares_cpu::ops::embedding::embedding_forward, cuda embedding;

            /// [`Backend::embedding`] from a table stored in bf16: each gathered row widened
            /// to f32 (exact) — the embedding of a model whose weights are stored in bf16.
            ///
            /// # Errors
            /// As [`Backend::embedding`]; `table` not bf16.
            fn embedding_bf16(
                ids: In<u32>,
                table: In<bf16>,
                rows: usize,
                dim: usize,
                out: Out<f32>,
            ) cpu ares_cpu::ops::embedding::embedding_forward_bf16, cuda embedding_bf16;

            /// Linear layer `out = x · wᵀ (+ bias)`, shapes in [`LinearDims`]. `out` is
            /// overwritten. The LM head is this op with the head (or tied embedding) as `w`.
            ///
            /// # Errors
            /// Lengths that do not match `dims`.
            fn linear(
                x: In<f32>,
                w: In<f32>,
                bias: InOpt<f32>,
                dims: LinearDims,
                out: Out<f32>,
            ) cpu kernels::linear, cuda linear;

            /// Linear layer with the weight stored transposed: `out = x · wt (+ bias)`, `wt`
            /// `[in_features, out_features]` (a [`Backend::transpose`]d copy of a Hugging Face
            /// `[out, in]` weight). The same layer as [`Backend::linear`] up to summation order;
            /// generation keeps such copies because a CPU GEMM multiplies a few rows by this layout
            /// without first repacking the whole weight. `out` is overwritten.
            ///
            /// # Errors
            /// Lengths that do not match `dims`.
            fn linear_transposed(
                x: In<f32>,
                wt: In<f32>,
                bias: InOpt<f32>,
                dims: LinearDims,
                out: Out<f32>,
            ) cpu kernels::linear_transposed, cuda linear_transposed;

            /// `dst[cols, rows] = src[rows, cols]ᵀ` (row-major both).
            ///
            /// # Errors
            /// `src` or `dst` not `rows · cols` long.
            fn transpose(
                src: In<f32>,
                rows: usize,
                cols: usize,
                dst: Out<f32>,
            ) cpu ares_cpu::ops::matmul::transpose, cuda transpose;

            /// RMSNorm over rows of `dim`: `out = weight · x / sqrt(mean(x²) + eps)`; `x`, `out`
            /// `[rows, dim]`, `weight` `[dim]`, and `rstd` `[rows]` receives `1/sqrt(mean(x²) + eps)`
            /// for the backward pass.
            ///
            /// # Errors
            /// `dim == 0`, lengths that do not match, `eps` not finite and > 0.
            fn rmsnorm(
                x: In<f32>,
                weight: In<f32>,
                eps: f32,
                dim: usize,
                out: Out<f32>,
                rstd: Out<f32>,
            ) cpu ares_cpu::ops::rmsnorm::rmsnorm_forward, cuda rmsnorm;

            /// The residual add fused with the next RMSNorm: `sum = a + b`, then
            /// [`Backend::rmsnorm`] of `sum` into `out` and `rstd` — the bits of
            /// [`Backend::add`] followed by [`Backend::rmsnorm`], in one pass (one kernel).
            ///
            /// # Errors
            /// As [`Backend::rmsnorm`]; `b` or `sum` not the length of `a`.
            fn add_rmsnorm(
                a: In<f32>,
                b: In<f32>,
                weight: In<f32>,
                eps: f32,
                dim: usize,
                sum: Out<f32>,
                out: Out<f32>,
                rstd: Out<f32>,
            ) cpu ares_cpu::ops::rmsnorm::add_rmsnorm_forward, cuda add_rmsnorm;

            /// [`Backend::add_rmsnorm`] with the norm's output stored in bf16: `sum` and
            /// `rstd` the bits of [`Backend::add_rmsnorm`], each element of `out` rounded to
            /// the nearest bf16 (ties to even) — the MLP's input as an activation stored in
            /// bf16.
            ///
            /// # Errors
            /// As [`Backend::add_rmsnorm`]; `out` not bf16.
            fn add_rmsnorm_bf16(
                a: In<f32>,
                b: In<f32>,
                weight: In<f32>,
                eps: f32,
                dim: usize,
                sum: Out<f32>,
                out: Out<bf16>,
                rstd: Out<f32>,
            ) cpu ares_cpu::ops::rmsnorm::add_rmsnorm_forward_bf16, cuda add_rmsnorm_bf16;

            /// Rotary position embedding in place ("rotate_half" layout of Hugging Face) on `x`
            /// `[tokens, heads, head_dim]`, with per-token `cos`, `sin` `[tokens, head_dim/2]`.
            ///
            /// # Errors
            /// `head_dim` odd or 0, `heads == 0`, lengths that do not match.
            fn rope(
                x: Out<f32>,
                cos: In<f32>,
                sin: In<f32>,
                heads: usize,
                head_dim: usize,
            ) cpu ares_cpu::ops::rope::rope_forward, cuda rope;

            /// [`Backend::rope`] of `x` into `out`, rounded to bf16 (nearest even): q and k
            /// stored in bf16 (activations kept in bf16) — the rotation and the rounding in
            /// one pass, the bits of [`Backend::rope`] then [`Backend::round_bf16`].
            ///
            /// # Errors
            /// As [`Backend::rope`]; `out` not as long as `x` or not bf16.
            fn rope_bf16(
                x: In<f32>,
                cos: In<f32>,
                sin: In<f32>,
                heads: usize,
                head_dim: usize,
                out: Out<bf16>,
            ) cpu ares_cpu::ops::rope::rope_forward_bf16, cuda rope_bf16;

            /// SwiGLU, element-wise: `out = silu(gate) · up`.
            ///
            /// # Errors
            /// Lengths that differ.
            fn swiglu(
                gate: In<f32>,
                up: In<f32>,
                out: Out<f32>,
            ) cpu ares_cpu::ops::swiglu::swiglu_forward, cuda swiglu;

            /// [`Backend::swiglu`] over `gate`, `up` stored in bf16 (widened, exact), each
            /// output rounded to the nearest bf16 into `out`.
            ///
            /// # Errors
            /// Lengths that differ; an argument not bf16.
            fn swiglu_bf16(
                gate: In<bf16>,
                up: In<bf16>,
                out: Out<bf16>,
            ) cpu ares_cpu::ops::swiglu::swiglu_forward_bf16, cuda swiglu_bf16;

            /// Backward of [`Backend::embedding`]: `dtable[ids[t], :] += dout[t, :]`, with `dout`
            /// `[ids.len(), dim]` and `dtable` `[rows, dim]`. **Accumulates** (tied embeddings add
            /// the LM head's gradient into the same table).
            ///
            /// # Errors
            /// Lengths that do not match, or (where checked) an id `>= rows`.
            fn embedding_backward(
                ids: In<u32>,
                dout: In<f32>,
                rows: usize,
                dim: usize,
                dtable: Out<f32>,
            ) cpu ares_cpu::ops::embedding::embedding_backward, cuda embedding_backward;

            /// Backward of [`Backend::linear`] given `dout` `[rows, out_features]`:
            /// `dx[rows, in] = dout · w` or `+=` as `writes.dx` says (skipped if `None`),
            /// `dw[out, in] = doutᵀ · x` or `+=` as `writes.dw` says (skipped if `None`: a
            /// frozen weight, as under LoRA), and `dbias[out] += Σ_rows dout` (skipped if
            /// `None`). [`GradWrite::Overwrite`] gives the bits of a zero fill followed by
            /// [`GradWrite::Accumulate`] (up to the sign of a zero) without reading the
            /// buffer.
            ///
            /// # Errors
            /// Lengths that do not match `dims`.
            fn linear_backward(
                dout: In<f32>,
                x: In<f32>,
                w: In<f32>,
                dims: LinearDims,
                writes: GradWrites,
                dx: OutOpt<f32>,
                dw: OutOpt<f32>,
                dbias: OutOpt<f32>,
            ) cpu kernels::linear_backward, cuda linear_backward;

            /// [`Backend::linear`] in bf16 with the weight `w` `[out, in]` stored in bf16 (a
            /// model's bf16 copy of its f32 weights, rounded once per optimizer step): `x` is
            /// rounded to bf16, products and sums in f32 — on a GPU bf16 tensor cores reading
            /// `w` as it is, with no conversion of the weight per product. Always bf16,
            /// whatever `dims.rows` (`dims.precision` is not used); from `BF16_MIN_ROWS` rows
            /// on, the bits of [`Backend::linear`] in bf16 over any f32 weight that rounds to
            /// `w` (on the CPU; a GPU may sum in another order). `out` is overwritten.
            ///
            /// # Errors
            /// As [`Backend::linear`]; `w` not bf16.
            fn linear_bf16(
                x: In<f32>,
                w: In<bf16>,
                bias: InOpt<f32>,
                dims: LinearDims,
                out: Out<f32>,
            ) cpu kernels::linear_bf16, cuda linear_bf16;

            /// Backward of [`Backend::linear_bf16`]: [`Backend::linear_backward`] with `dout`
            /// and `x` rounded to bf16 and the bf16 weight `w` as it is; the three gradients
            /// (f32) are written as there (`dx` and `dw` by `writes`, the bias gradient added).
            ///
            /// # Errors
            /// As [`Backend::linear_backward`]; `w` not bf16.
            fn linear_backward_bf16(
                dout: In<f32>,
                x: In<f32>,
                w: In<bf16>,
                dims: LinearDims,
                writes: GradWrites,
                dx: OutOpt<f32>,
                dw: OutOpt<f32>,
                dbias: OutOpt<f32>,
            ) cpu kernels::linear_backward_bf16, cuda linear_backward_bf16;

            /// [`Backend::linear_bf16`] with `x` stored in bf16 as well (an activation kept
            /// in bf16), read as it is: the bits of [`Backend::linear_bf16`] over the widened
            /// `x` (on the CPU). `out` (f32) is overwritten.
            ///
            /// # Errors
            /// As [`Backend::linear`]; `x` or `w` not bf16.
            fn linear_bf16_x(
                x: In<bf16>,
                w: In<bf16>,
                bias: InOpt<f32>,
                dims: LinearDims,
                out: Out<f32>,
            ) cpu kernels::linear_bf16_x, cuda linear_bf16_x;

            /// [`Backend::linear_bf16_x`] with the output stored in bf16 too: each f32 sum,
            /// with its bias, rounded once to the nearest bf16 (ties to even) — a projection
            /// whose output is an activation kept in bf16 (on a GPU the GEMM writes bf16).
            ///
            /// # Errors
            /// As [`Backend::linear`]; an argument not bf16.
            fn linear_bf16_io(
                x: In<bf16>,
                w: In<bf16>,
                bias: InOpt<f32>,
                dims: LinearDims,
                out: Out<bf16>,
            ) cpu kernels::linear_bf16_io, cuda linear_bf16_io;

            /// Backward of [`Backend::linear_bf16_x`] (and of [`Backend::linear_bf16_io`],
            /// whose output gradient is f32 like any other): [`Backend::linear_backward_bf16`]
            /// with the saved `x` read as stored in bf16; `dout` rounded to bf16 for the
            /// products, the gradients f32, written as there.
            ///
            /// # Errors
            /// As [`Backend::linear_backward`]; `x` or `w` not bf16.
            fn linear_backward_bf16_x(
                dout: In<f32>,
                x: In<bf16>,
                w: In<bf16>,
                dims: LinearDims,
                writes: GradWrites,
                dx: OutOpt<f32>,
                dw: OutOpt<f32>,
                dbias: OutOpt<f32>,
            ) cpu kernels::linear_backward_bf16_x, cuda linear_backward_bf16_x;

            /// `y += alpha · x`, element-wise, the product rounded before the sum (a LoRA pair's
            /// scaled output added to its frozen layer's, and its gradient scaled back).
            ///
            /// # Errors
            /// `x` and `y` of different lengths.
            fn axpy(
                alpha: f32,
                x: In<f32>,
                y: Out<f32>,
            ) cpu ares_cpu::ops::axpy::axpy, cuda axpy;

            /// Backward of [`Backend::rmsnorm`] from `dout` `[rows, dim]`, the forward's input `x`,
            /// `weight` and saved `rstd`. Both `dx` `[rows, dim]` and `dweight` `[dim]`
            /// **accumulate** (`dx` is the residual stream's gradient; a q/k norm weight is shared
            /// by every head); `dweight` is skipped if `None` (a frozen weight).
            ///
            /// # Errors
            /// `dim == 0`, lengths that do not match.
            fn rmsnorm_backward(
                dout: In<f32>,
                x: In<f32>,
                weight: In<f32>,
                rstd: In<f32>,
                dim: usize,
                dx: Out<f32>,
                dweight: OutOpt<f32>,
            ) cpu ares_cpu::ops::rmsnorm::rmsnorm_backward, cuda rmsnorm_backward;

            /// Backward of [`Backend::rope`], **in place**: `dx` `[tokens, heads, head_dim]` holds
            /// the gradient w.r.t. the rotated tensor and is replaced by the gradient w.r.t. its
            /// input (the inverse rotation).
            ///
            /// # Errors
            /// As [`Backend::rope`].
            fn rope_backward(
                dx: Out<f32>,
                cos: In<f32>,
                sin: In<f32>,
                heads: usize,
                head_dim: usize,
            ) cpu ares_cpu::ops::rope::rope_backward, cuda rope_backward;

            /// Backward of [`Backend::swiglu`] from `dout`: **overwrites** `dgate` and `dup`
            /// (gate and up feed the SwiGLU only).
            ///
            /// # Errors
            /// Lengths that differ.
            fn swiglu_backward(
                dout: In<f32>,
                gate: In<f32>,
                up: In<f32>,
                dgate: Out<f32>,
                dup: Out<f32>,
            ) cpu ares_cpu::ops::swiglu::swiglu_backward, cuda swiglu_backward;

            /// [`Backend::swiglu_backward`] with the forward's `gate`, `up` stored in bf16
            /// (the inputs of [`Backend::swiglu_bf16`]): the bits of
            /// [`Backend::swiglu_backward`] over the widened values; the gradients f32,
            /// overwritten.
            ///
            /// # Errors
            /// Lengths that differ; `gate` or `up` not bf16.
            fn swiglu_backward_bf16(
                dout: In<f32>,
                gate: In<bf16>,
                up: In<bf16>,
                dgate: Out<f32>,
                dup: Out<f32>,
            ) cpu ares_cpu::ops::swiglu::swiglu_backward_bf16, cuda swiglu_backward_bf16;

            /// Per row of `logits` `[rows, vocab]`, with `z = logits / temperature`: writes the
            /// entropy of `softmax(z)` to `entropy[row]` and `log softmax(z)[targets[row]]` to
            /// `log_prob[row]`, without a `[rows, vocab]` temporary (rows = `targets.len()`).
            ///
            /// # Errors
            /// Lengths that do not match, `vocab == 0`, a temperature not finite and > 0, and
            /// (where checked) a target `>= vocab` or a row holding NaN/+∞.
            fn log_prob_entropy(
                logits: In<f32>,
                vocab: usize,
                temperature: f32,
                targets: In<u32>,
                log_prob: Out<f32>,
                entropy: Out<f32>,
            ) cpu kernels::log_prob_entropy, cuda log_prob_entropy;

            /// Backward of the per-token log-prob of [`Backend::log_prob_entropy`]: per row of
            /// `logits` `[rows, vocab]` (rows = `targets.len()`), with `z = logits / temperature`
            /// and `g = coeffs[row]` (∂L/∂logπ of that token),
            /// `dlogits[row, :] = g/temperature · (onehot(targets[row]) − softmax(z))`, without a
            /// `[rows, vocab]` temporary. **Overwrites** `dlogits`; rows with `g = 0` are zero and
            /// their logits are not read.
            ///
            /// # Errors
            /// Lengths that do not match, `vocab == 0`, a temperature not finite and > 0, a
            /// non-finite coefficient, and (where checked) for rows with `g ≠ 0` a target `>= vocab`
            /// or a row holding NaN/+∞.
            fn log_prob_backward(
                logits: In<f32>,
                vocab: usize,
                temperature: f32,
                targets: In<u32>,
                coeffs: In<f32>,
                dlogits: Out<f32>,
            ) cpu ares_cpu::ops::log_prob_backward::log_prob_backward, cuda log_prob_backward;

            /// Backward of the per-token entropy of [`Backend::log_prob_entropy`]: per row of
            /// `logits` `[rows, vocab]` (rows = `coeffs.len()`), with `z = logits / temperature`,
            /// `p = softmax(z)`, `H = −Σ p ln p` and `c = coeffs[row]` (∂L/∂H of that token),
            /// `dlogits[row, :] += c · ∂H/∂logits = −c · p · (ln p + H) / temperature`, without a
            /// `[rows, vocab]` temporary (`ares_core::entropy_bonus::entropy_grad_logits` is the
            /// formula). **Accumulates** into `dlogits` (it runs after
            /// [`Backend::log_prob_backward`], which overwrites it); a −∞ logit gets 0; rows with
            /// `c = 0` are untouched and their logits are not read.
            ///
            /// # Errors
            /// Lengths that do not match, `vocab == 0`, a temperature not finite and > 0, a
            /// non-finite coefficient, and (where checked) for rows with `c ≠ 0` a row holding
            /// NaN/+∞ or only −∞, or a coefficient so large against the temperature that the
            /// gradient overflows f32.
            fn entropy_backward(
                logits: In<f32>,
                vocab: usize,
                temperature: f32,
                coeffs: In<f32>,
                dlogits: Out<f32>,
            ) cpu ares_cpu::ops::entropy_backward::entropy_backward, cuda entropy_backward;

            /// One AdamW update of one parameter tensor, in place: `param`, `exp_avg` (first
            /// moment) and `exp_avg_sq` (second moment) are updated from `grad · grad_scale` as
            /// [`AdamWUpdate`] says. All four have the same length; `copy` (bf16, as long)
            /// receives the updated parameter rounded to the nearest bf16, ties to even — the
            /// model's bf16 weight copy written by the update itself (the bits of
            /// [`Backend::round_bf16`] after it). `grad` is read as stored: a gradient kept in
            /// bf16 is widened (exact) element by element as the update reads it — the update
            /// of its widened values, bit for bit, without an f32 copy of them.
            ///
            /// # Errors
            /// Lengths that differ, `update.step == 0`, a learning rate, scale or config field out
            /// of range, and (where checked) a non-finite gradient; then nothing is written.
            fn adamw_step(
                param: Out<f32>,
                grad: In<stored>,
                exp_avg: Out<f32>,
                exp_avg_sq: Out<f32>,
                update: Ref<AdamWUpdate>,
                copy: OutOpt<bf16>,
            ) cpu kernels::adamw_step, cuda adamw_step;

            /// [`Backend::adamw_step`] with both moments stored in bf16: each widened, updated
            /// in f32 as there (the parameter from the f32 values), rounded back to bf16
            /// **stochastically** under `key` — element `i` of each moment with
            /// `rounding_bits(moment_keys(key).0 / .1, i)` (`ares_cpu::ops::precision`), so
            /// a change under half an ulp (a second moment's 0.001 a step at β₂ = 0.999)
            /// still moves it on average (`worker.actor.optim.state_dtype: bf16`, half the
            /// moments' memory).
            ///
            /// # Errors
            /// As [`Backend::adamw_step`]; moments that are not bf16.
            fn adamw_step_bf16(
                param: Out<f32>,
                key: u64,
                grad: In<stored>,
                exp_avg: Out<bf16>,
                exp_avg_sq: Out<bf16>,
                update: Ref<AdamWUpdate>,
                copy: OutOpt<bf16>,
            ) cpu kernels::adamw_step_keyed, cuda adamw_step_bf16;

            /// [`Backend::adamw_step`] with both moments stored in 8 bits, block-wise
            /// (`worker.actor.optim.state_dtype: int8`; `ares_cpu::ops::optim_int8`):
            /// `exp_avg`/`exp_avg_sq` hold one code per element, `exp_avg_absmax` and
            /// `exp_avg_sq_absmax` one f32 scale per block of 2 048 elements (`⌈len /
            /// 2048⌉`), `maps` the signed then the unsigned dynamic map (512 values). Per
            /// block: read back, the f32 update of [`Backend::adamw_step`], quantise with the
            /// block's new scale.
            ///
            /// # Errors
            /// As [`Backend::adamw_step`]; scale or map lengths that do not match, a map not
            /// ascending (the CPU checks it; a device reads the map as given).
            fn adamw_step_int8(
                param: Out<f32>,
                grad: In<stored>,
                exp_avg: Out<u8>,
                exp_avg_sq: Out<u8>,
                exp_avg_absmax: Out<f32>,
                exp_avg_sq_absmax: Out<f32>,
                maps: In<f32>,
                update: Ref<AdamWUpdate>,
                copy: OutOpt<bf16>,
            ) cpu kernels::adamw_step_int8, cuda adamw_step_int8;

            /// [`Backend::adamw_step`] of a weight **stored in bf16** (`weight`, the
            /// parameter itself, `trainer.weight_dtype: bf16`): each element widened, the f32
            /// update, the result rounded back **stochastically** under `key` — the bits of
            /// [`Backend::widen_bf16`], [`Backend::adamw_step`] and
            /// [`Backend::round_bf16_stochastic`] in turn (what the CPU runs, through a
            /// scratch of its own); CUDA does it in one pass over the weight, without an f32
            /// copy of it.
            ///
            /// # Errors
            /// As [`Backend::adamw_step`]; `weight` not bf16.
            fn adamw_step_bf16_weight(
                weight: Out<bf16>,
                key: u64,
                grad: In<stored>,
                exp_avg: Out<f32>,
                exp_avg_sq: Out<f32>,
                update: Ref<AdamWUpdate>,
            ) cpu kernels::adamw_step_bf16_weight, cuda adamw_step_bf16_weight;

            /// [`Backend::adamw_step_bf16_weight`] with moments stored in bf16 (as
            /// [`Backend::adamw_step_bf16`]).
            ///
            /// # Errors
            /// As [`Backend::adamw_step_bf16_weight`]; moments that are not bf16.
            fn adamw_step_bf16_weight_bf16(
                weight: Out<bf16>,
                key: u64,
                grad: In<stored>,
                exp_avg: Out<bf16>,
                exp_avg_sq: Out<bf16>,
                update: Ref<AdamWUpdate>,
            ) cpu kernels::adamw_step_bf16_weight, cuda adamw_step_bf16_weight_bf16;

            /// [`Backend::adamw_step_bf16_weight`] with moments stored in 8 bits (as
            /// [`Backend::adamw_step_int8`]).
            ///
            /// # Errors
            /// As [`Backend::adamw_step_bf16_weight`] and [`Backend::adamw_step_int8`].
            fn adamw_step_bf16_weight_int8(
                weight: Out<bf16>,
                key: u64,
                grad: In<stored>,
                exp_avg: Out<u8>,
                exp_avg_sq: Out<u8>,
                exp_avg_absmax: Out<f32>,
                exp_avg_sq_absmax: Out<f32>,
                maps: In<f32>,
                update: Ref<AdamWUpdate>,
            ) cpu kernels::adamw_step_bf16_weight_int8, cuda adamw_step_bf16_weight_int8;

            /// Causal grouped-query attention (shapes in [`AttentionDims`]): query `t` of sequence
            /// `b` attends to keys `s <= t` with `key_mask[b, s] = 1` (`None`: all keys valid). Writes
            /// `out` `[batch, seq, q_heads, head_dim]` and the softmax log-sum-exp `lse` `[batch,
            /// seq, q_heads]` for the backward pass. A query without a valid key gets `out = 0`.
            /// With `segments` (packed sequences, flash-attn's `cu_seqlens`: batch 1, offsets
            /// from 0 to `seq`, non-decreasing) query `t` of segment `i` sees only the keys
            /// `cu[i] <= s <= t`: each segment is a sequence of its own and padding costs
            /// nothing (`ares_cpu::ops::attention::AttentionInputs::segments`).
            ///
            /// # Errors
            /// Invalid head counts or scale, lengths that do not match, a mask value not 0 or 1,
            /// segments with a batch other than 1 or offsets out of order (on CUDA flagged on
            /// the device: the attention kernels read the offsets there).
            fn attention(
                dims: AttentionDims,
                inputs: Views<AttentionInputs>,
                segments: InOpt<u32>,
                out: Out<f32>,
                lse: Out<f32>,
            ) cpu kernels::attention, cuda attention;

            /// [`Backend::attention`] with bf16 operands (tensor cores on a GPU): q, k, v and
            /// each 64-key tile's probabilities rounded to bf16, f32 sums and softmax state — on
            /// the CPU the kernel's twin (`ares_cpu::ops::attention::attention_forward_bf16`).
            /// Head sizes of `ares_cpu::ops::attention::BF16_HEAD_DIMS`; its backward is
            /// [`Backend::attention_backward_bf16`].
            ///
            /// # Errors
            /// As [`Backend::attention`]; on CUDA another head size or a device older than
            /// compute capability 8.0.
            fn attention_bf16(
                dims: AttentionDims,
                inputs: Views<AttentionInputs>,
                segments: InOpt<u32>,
                out: Out<f32>,
                lse: Out<f32>,
            ) cpu kernels::attention_bf16, cuda attention_bf16;

            /// Backward of [`Backend::attention`] from `dout` `[batch, seq, q_heads, head_dim]`,
            /// the forward's `inputs`, `out` and `lse`. **Overwrites** `grads` (q, k and v feed
            /// attention only); queries without a valid key and masked keys get zero gradients.
            ///
            /// # Errors
            /// As [`Backend::attention`], and lengths of `out`, `lse`, `dout` and `grads`.
            fn attention_backward(
                dims: AttentionDims,
                inputs: Views<AttentionInputs>,
                segments: InOpt<u32>,
                out: In<f32>,
                lse: In<f32>,
                dout: In<f32>,
                grads: ViewsMut<AttentionGrads>,
            ) cpu kernels::attention_backward, cuda attention_backward;

            /// Backward of [`Backend::attention_bf16`] (tensor cores on a GPU; on the CPU the
            /// kernels' twin `ares_cpu::ops::attention::attention_backward_bf16`): q, k, v and
            /// `dout` rounded to bf16, the probabilities and `dS` rounded for the products
            /// that take them, f32 sums. **Overwrites** `grads`, as
            /// [`Backend::attention_backward`].
            ///
            /// # Errors
            /// As [`Backend::attention_backward`]; on CUDA as [`Backend::attention_bf16`].
            fn attention_backward_bf16(
                dims: AttentionDims,
                inputs: Views<AttentionInputs>,
                segments: InOpt<u32>,
                out: In<f32>,
                lse: In<f32>,
                dout: In<f32>,
                grads: ViewsMut<AttentionGrads>,
            ) cpu kernels::attention_backward_bf16, cuda attention_backward_bf16;

            /// [`Backend::attention_bf16`] over q, k, v stored in bf16 (activations kept in
            /// bf16, `Model::set_activation_dtype`): the kernels read the bits as stored where
            /// [`Backend::attention_bf16`] rounds f32 values as they load them — the same bits
            /// for the same values (on the CPU the bits are widened and run through the same
            /// twin). The output is written to exactly one of `out` (f32) and `out16` (bf16,
            /// rounded once to nearest even). Its backward is
            /// [`Backend::attention_backward_bf16_stored`].
            ///
            /// # Errors
            /// As [`Backend::attention_bf16`]; q, k, v or `out16` not bf16; both outputs or
            /// neither.
            fn attention_bf16_stored(
                dims: AttentionDims,
                q: In<bf16>,
                k: In<bf16>,
                v: In<bf16>,
                key_mask: InOpt<f32>,
                segments: InOpt<u32>,
                out: OutOpt<f32>,
                out16: OutOpt<bf16>,
                lse: Out<f32>,
            ) cpu kernels::attention_bf16_stored, cuda attention_bf16_stored;

            /// [`Backend::attention_backward_bf16`] over q, k, v stored in bf16, read as
            /// stored, and the forward's output from exactly one of `out` (f32) and `out16`
            /// (bf16, widened): the same bits as from those values in f32. **Overwrites**
            /// `grads` (f32).
            ///
            /// # Errors
            /// As [`Backend::attention_backward_bf16`]; q, k, v or `out16` not bf16; both
            /// outputs or neither.
            fn attention_backward_bf16_stored(
                dims: AttentionDims,
                q: In<bf16>,
                k: In<bf16>,
                v: In<bf16>,
                key_mask: InOpt<f32>,
                segments: InOpt<u32>,
                out: InOpt<f32>,
                out16: InOpt<bf16>,
                lse: In<f32>,
                dout: In<f32>,
                grads: ViewsMut<AttentionGrads>,
            ) cpu kernels::attention_backward_bf16_stored, cuda attention_backward_bf16_stored;

            /// `dst = src` (views of equal length, possibly of one buffer but never overlapping,
            /// which the borrow rules already forbid). On a GPU a device-to-device copy.
            ///
            /// # Errors
            /// Lengths that differ.
            fn copy(
                src: In<f32>,
                dst: Out<f32>,
            ) cpu kernels::copy, cuda copy;

            /// Rounds each element of `src` to the nearest bf16 (ties to even, as
            /// `torch.Tensor.bfloat16`) into `dst`, same length and layout: a prefill's f32
            /// keys and values into a bf16 KV pool.
            ///
            /// # Errors
            /// Lengths that differ; `dst` not bf16.
            fn round_bf16(
                src: In<f32>,
                dst: Out<bf16>,
            ) cpu kernels::round_bf16, cuda to_bf16;

            /// Rounds each element `i` of `src` to bf16 **stochastically** into `dst`: up or
            /// down with the probabilities that make the rounding unbiased, from 16 random
            /// bits that depend on `(key, i)` alone
            /// (`ares_cpu::ops::precision::round_to_bf16_stochastic`): a weight stored in bf16
            /// written back by its optimizer step, where rounding to nearest would drop every
            /// update below half an ulp.
            ///
            /// # Errors
            /// Lengths that differ; `dst` not bf16.
            fn round_bf16_stochastic(
                src: In<f32>,
                key: u64,
                dst: Out<bf16>,
            ) cpu ares_cpu::ops::precision::round_to_bf16_stochastic, cuda to_bf16_stochastic;

            /// `dst[i] ← SR(widen(dst[i]) + src[i])`: an f32 contribution added to a tensor
            /// stored in bf16, each sum rounded **stochastically** with the bits of `(key, i)`
            /// as [`Backend::round_bf16_stochastic`]
            /// (`ares_cpu::ops::precision::accumulate_bf16_stochastic`): a decoder layer's
            /// weight gradients folded into gradients stored in bf16
            /// (`trainer.grad_dtype: bf16`), unbiased where rounding to nearest would stall a
            /// long accumulation.
            ///
            /// # Errors
            /// Lengths that differ; `dst` not bf16.
            fn accumulate_bf16_stochastic(
                src: In<f32>,
                key: u64,
                dst: Out<bf16>,
            ) cpu ares_cpu::ops::precision::accumulate_bf16_stochastic, cuda accumulate_bf16_stochastic;

            /// Sets every element of `dst` to `value` rounded to the nearest bf16 (`0.0`
            /// zeroes a gradient stored in bf16).
            ///
            /// # Errors
            /// `dst` not bf16; a device failure where the backend reports one.
            fn fill_bf16(
                dst: Out<bf16>,
                value: f32,
            ) cpu kernels::fill_bf16, cuda fill_bf16;

            /// Widens each bf16 element of `src` to f32 into `dst` (exact; same length): a
            /// weight stored in bf16 read by its optimizer step or saved.
            ///
            /// # Errors
            /// Lengths that differ; `src` not bf16.
            fn widen_bf16(
                src: In<bf16>,
                dst: Out<f32>,
            ) cpu ares_cpu::ops::precision::widen_bf16, cuda from_bf16;

            /// Copies the bf16 elements `src` into `dst` (same length): blocks of a bf16 KV
            /// pool.
            ///
            /// # Errors
            /// Lengths that differ; either not bf16.
            fn copy_bf16(
                src: In<bf16>,
                dst: Out<bf16>,
            ) cpu kernels::copy, cuda copy_bf16;

            // ----- Generation: decode weights. -----

            /// Sets every element of `dst` to `value` (`0.0` zeroes a gradient before an
            /// accumulating op).
            ///
            /// # Errors
            /// None on the CPU; a device failure where the backend reports one.
            fn fill(
                dst: Out<f32>,
                value: f32,
            ) cpu kernels::fill, cuda fill;

            /// Copies the `[rows, cols]` weight matrix `src` (an `[in, out]` transposed weight) into
            /// `dst` (same length) in the layout this backend's [`Backend::linear_decode_f32`]
            /// reads: the CPU's column tiles (`ares_cpu::ops::matmul_tiles::pack_f32_tiles`), the
            /// same row-major matrix on the GPU (a checked copy). The storage of f32 decode weights.
            ///
            /// # Errors
            /// `src` not `rows · cols` long, `dst` of another length.
            fn pack_decode_f32(
                src: In<f32>,
                rows: usize,
                cols: usize,
                dst: Out<f32>,
            ) cpu ares_cpu::ops::matmul_tiles::pack_f32_tiles, cuda copy_matrix;

            /// [`Backend::linear_transposed`] with the weight `wt` `[in, out]` as
            /// [`Backend::pack_decode_f32`] stored it: `out = x · wt (+ bias)` in `dims.precision`.
            /// The CPU's column-tile product sums every output in order whatever the batch (a row's
            /// result does not depend on the other rows); on the GPU
            /// [`Backend::linear_transposed`].
            ///
            /// # Errors
            /// As [`Backend::linear_transposed`].
            fn linear_decode_f32(
                x: In<f32>,
                wt: In<f32>,
                bias: InOpt<f32>,
                dims: LinearDims,
                out: Out<f32>,
            ) cpu kernels::linear_decode_f32, cuda linear_transposed;

            /// Rounds the `[rows, cols]` weight matrix `src` to bf16 (nearest even, as
            /// `torch.Tensor.bfloat16`) into `dst` (`rows · cols` bf16 elements), in the
            /// layout this backend's [`Backend::linear_transposed_bf16`] reads: the CPU's column
            /// tiles (`ares_cpu::ops::matmul_tiles::pack_bf16_tiles`), CUDA's row-major. The
            /// storage of bf16 decode weights.
            ///
            /// # Errors
            /// `src` or `dst` not `rows · cols` long, `dst` not bf16.
            fn pack_bf16(
                src: In<f32>,
                rows: usize,
                cols: usize,
                dst: Out<bf16>,
            ) cpu ares_cpu::ops::matmul_tiles::pack_bf16_tiles, cuda pack_bf16;

            /// [`Backend::linear_transposed`] with the weight `wt` `[in, out]` in bf16 as
            /// [`Backend::pack_bf16`] stored it: `out = x · wt (+ bias)`, half the weight bytes
            /// of the f32 product. CPU: the weights widened to f32, `x`, products and sums in
            /// f32. CUDA: `x` rounded to bf16 as well, bf16 tensor cores with f32 sums.
            /// `dims.precision` is not used.
            ///
            /// # Errors
            /// As [`Backend::linear_transposed`]; `wt` not bf16.
            fn linear_transposed_bf16(
                x: In<f32>,
                wt: In<bf16>,
                bias: InOpt<f32>,
                dims: LinearDims,
                out: Out<f32>,
            ) cpu kernels::linear_transposed_bf16, cuda linear_transposed_bf16;

            // ----- ARES token ops (docs/algorithms.md §1, §4). -----

            /// Per row of `[rows, cols]` window means, the `q`-th percentile (numpy's linear
            /// interpolation) of those whose `valid` is 1, written to `threshold[row]` with
            /// `has[row] = 1`; a row without a complete window gets 0 and 0.
            ///
            /// # Errors
            /// Lengths that do not match, `cols` 0, `q` outside [0, 100], and on a GPU a row too
            /// long for one block's shared memory.
            fn row_percentile(
                means: In<f32>,
                valid: In<f32>,
                cols: usize,
                q: f32,
                threshold: Out<f32>,
                has: Out<f32>,
            ) cpu ares_cpu::row_percentile, cuda row_percentile;

            // ----- Vision tower ops (Qwen2-VL / Qwen2.5-VL). -----
            /// LayerNorm over rows of `dim` (torch.nn.LayerNorm): `out = (x − mean)·rstd·weight +
            /// bias`, `rstd = 1/sqrt(var + eps)` with the biased variance; `x`, `out` `[rows, dim]`;
            /// `weight`, `bias` `[dim]`; saves `mean` `[rows]` and `rstd` `[rows]` for the backward.
            ///
            /// # Errors
            /// `dim == 0`, lengths that do not match, `eps` not finite and > 0.
            fn layer_norm(
                x: In<f32>,
                weight: In<f32>,
                bias: In<f32>,
                eps: f32,
                dim: usize,
                out: Out<f32>,
                mean: Out<f32>,
                rstd: Out<f32>,
            ) cpu ares_cpu::ops::layer_norm::layer_norm_forward, cuda layer_norm;

            /// Backward of [`Backend::layer_norm`] from `dout` `[rows, dim]`, the forward's `x`,
            /// `weight` and saved `mean`, `rstd`: `dx` `[rows, dim]`, `dweight` `[dim]` and `dbias`
            /// `[dim]` all **accumulate** (`+=`).
            ///
            /// # Errors
            /// `dim == 0`, lengths that do not match.
            fn layer_norm_backward(
                dout: In<f32>,
                x: In<f32>,
                weight: In<f32>,
                mean: In<f32>,
                rstd: In<f32>,
                dim: usize,
                dx: Out<f32>,
                dweight: Out<f32>,
                dbias: Out<f32>,
            ) cpu ares_cpu::ops::layer_norm::layer_norm_backward, cuda layer_norm_backward;

            /// Element-wise activation `out = act(x)` ([`Activation`] for the formulas).
            ///
            /// # Errors
            /// Lengths that differ.
            fn activation(
                kind: Activation,
                x: In<f32>,
                out: Out<f32>,
            ) cpu kernels::activation, cuda activation;

            /// Backward of [`Backend::activation`]: `dx = dout · act'(x)`, **overwrites** `dx`.
            ///
            /// # Errors
            /// Lengths that differ.
            fn activation_backward(
                kind: Activation,
                dout: In<f32>,
                x: In<f32>,
                dx: Out<f32>,
            ) cpu kernels::activation_backward, cuda activation_backward;

            /// Non-causal multi-head attention restricted to segments (flash-attn's
            /// `cu_seqlens`): `q`, `k`, `v`, `out` `[tokens, heads, head_dim]`; `cu_seqlens` (length
            /// `segments + 1`) starts at 0, is non-decreasing and ends at `tokens` (empty segments
            /// allowed); a query in segment `i` attends to every key in `[cu[i], cu[i+1])`. Writes
            /// `out` and `lse` `[tokens, heads]` (log-sum-exp of the scaled logits). A non-finite
            /// score makes its query's row NaN.
            ///
            /// # Errors
            /// `heads` or `head_dim` 0, a scale not finite and > 0, lengths that do not match
            /// (`cu_seqlens` included), and (where checked: the CPU) offsets that do not start at 0,
            /// decrease or do not end at `tokens`. A GPU may limit `head_dim`.
            fn segment_attention(
                dims: SegmentAttentionDims,
                cu_seqlens: In<u32>,
                q: In<f32>,
                k: In<f32>,
                v: In<f32>,
                out: Out<f32>,
                lse: Out<f32>,
            ) cpu kernels::segment_attention, cuda segment_attention;

            /// Row scatter, **overwriting** the named rows: `dst[index[i], :] = src[i, :]`; `src`
            /// `[index.len(), dim]`, `dst` `[rows, dim]`; other rows of `dst` untouched. Places
            /// image embeddings at the `<|image_pad|>` positions; its backward is the
            /// [`Backend::embedding`] gather with the same `index`.
            ///
            /// # Errors
            /// `dim == 0`, lengths that do not match, and (where checked: the CPU) an index `>=
            /// rows` or an index repeated. A GPU reports an index `>= rows` at the next waiting
            /// call (that row is not written) and does not detect repeats (one of the rows wins).
            fn scatter_rows(
                src: In<f32>,
                index: In<u32>,
                rows: usize,
                dim: usize,
                dst: Out<f32>,
            ) cpu ares_cpu::ops::scatter::scatter_rows, cuda scatter_rows;

            /// Backward of [`Backend::segment_attention`] from `dout` `[tokens, heads, head_dim]`,
            /// the forward's inputs, `out` and `lse`; **overwrites** `dq`, `dk`, `dv`.
            ///
            /// # Errors
            /// As [`Backend::segment_attention`], and lengths of `out`, `lse`, `dout` and the
            /// gradients.
            fn segment_attention_backward(
                dims: SegmentAttentionDims,
                cu_seqlens: In<u32>,
                q: In<f32>,
                k: In<f32>,
                v: In<f32>,
                out: In<f32>,
                lse: In<f32>,
                dout: In<f32>,
                dq: Out<f32>,
                dk: Out<f32>,
                dv: Out<f32>,
            ) cpu kernels::segment_attention_backward, cuda segment_attention_backward;

            /// [`Backend::segment_attention`] on tensor cores (bf16 operands, f32 sums and
            /// softmax state; on the CPU the kernels' twin
            /// `ares_cpu::ops::segment_attention::segment_attention_forward_bf16`), as
            /// [`Backend::attention_bf16`] over segments; keys in tiles at multiples of 64.
            /// Head sizes of `ares_cpu::ops::attention::BF16_HEAD_DIMS`.
            ///
            /// # Errors
            /// As [`Backend::segment_attention`]; on CUDA as [`Backend::attention_bf16`].
            fn segment_attention_bf16(
                dims: SegmentAttentionDims,
                cu_seqlens: In<u32>,
                q: In<f32>,
                k: In<f32>,
                v: In<f32>,
                out: Out<f32>,
                lse: Out<f32>,
            ) cpu kernels::segment_attention_bf16, cuda segment_attention_bf16;

            /// Backward of [`Backend::segment_attention_bf16`] (on the CPU the twin
            /// `segment_attention_backward_bf16`), as [`Backend::attention_backward_bf16`];
            /// **overwrites** `dq`, `dk`, `dv`.
            ///
            /// # Errors
            /// As [`Backend::segment_attention_backward`]; on CUDA as
            /// [`Backend::attention_bf16`].
            fn segment_attention_backward_bf16(
                dims: SegmentAttentionDims,
                cu_seqlens: In<u32>,
                q: In<f32>,
                k: In<f32>,
                v: In<f32>,
                out: In<f32>,
                lse: In<f32>,
                dout: In<f32>,
                dq: Out<f32>,
                dk: Out<f32>,
                dv: Out<f32>,
            ) cpu kernels::segment_attention_backward_bf16, cuda segment_attention_backward_bf16;

            /// [`Backend::segment_attention_bf16`] over q, k, v stored in bf16 (the vision
            /// tower's activations kept in bf16): the kernels read the bits as stored where
            /// [`Backend::segment_attention_bf16`] rounds f32 values as they load them — the
            /// same bits for the same values (on the CPU the bits are widened and run through
            /// the same twin). The output is written to exactly one of `out` (f32) and
            /// `out16` (bf16, rounded once to nearest even). Its backward is
            /// [`Backend::segment_attention_backward_bf16_stored`].
            ///
            /// # Errors
            /// As [`Backend::segment_attention_bf16`]; q, k, v or `out16` not bf16; both
            /// outputs or neither.
            fn segment_attention_bf16_stored(
                dims: SegmentAttentionDims,
                cu_seqlens: In<u32>,
                q: In<bf16>,
                k: In<bf16>,
                v: In<bf16>,
                out: OutOpt<f32>,
                out16: OutOpt<bf16>,
                lse: Out<f32>,
            ) cpu kernels::segment_attention_bf16_stored, cuda segment_attention_bf16_stored;

            /// [`Backend::segment_attention_backward_bf16`] over q, k, v stored in bf16, read
            /// as stored, and the forward's output from exactly one of `out` (f32) and
            /// `out16` (bf16, widened): the same bits as from those values in f32.
            /// **Overwrites** `dq`, `dk`, `dv` (f32).
            ///
            /// # Errors
            /// As [`Backend::segment_attention_backward_bf16`]; q, k, v or `out16` not bf16;
            /// both outputs or neither.
            fn segment_attention_backward_bf16_stored(
                dims: SegmentAttentionDims,
                cu_seqlens: In<u32>,
                q: In<bf16>,
                k: In<bf16>,
                v: In<bf16>,
                out: InOpt<f32>,
                out16: InOpt<bf16>,
                lse: In<f32>,
                dout: In<f32>,
                dq: Out<f32>,
                dk: Out<f32>,
                dv: Out<f32>,
            ) cpu kernels::segment_attention_backward_bf16_stored,
              cuda segment_attention_backward_bf16_stored;
        }
    };
}
pub(crate) use declared_ops;

/// The Rust type of an argument of kind `$kind` in a [`Backend`](super::Backend) method.
#[rustfmt::skip]
macro_rules! op_arg_type {
    (In<f32>) => { $crate::backend::Tensor<'_, Self> };
    (Out<f32>) => { $crate::backend::TensorMut<'_, Self> };
    (InOpt<f32>) => { Option<$crate::backend::Tensor<'_, Self>> };
    (OutOpt<f32>) => { Option<$crate::backend::TensorMut<'_, Self>> };
    (In<u32>) => { &Self::Ids };
    (InOpt<u32>) => { Option<&Self::Ids> };
    (In<bf16>) => { $crate::backend::View<'_, Self::Half> };
    (Out<bf16>) => { $crate::backend::ViewMut<'_, Self::Half> };
    (OutOpt<bf16>) => { Option<$crate::backend::ViewMut<'_, Self::Half>> };
    (InOpt<bf16>) => { Option<$crate::backend::View<'_, Self::Half>> };
    (In<stored>) => { $crate::backend::Stored<'_, Self> };
    (Out<u8>) => { $crate::backend::ViewMut<'_, Self::Bytes> };
    (Views<$t:ident>) => { $crate::backend::$t<'_, Self::Buffer> };
    (ViewsMut<$t:ident>) => { $crate::backend::$t<'_, Self::Buffer> };
    (Ref<$t:ident>) => { &$t };
    ($t:ident) => { $t };
}
pub(crate) use op_arg_type;

/// The [`Backend`](super::Backend) methods of the declared ops (their docs are the
/// declarations').
macro_rules! declare_ops {
    ($(
        $(#[$meta:meta])*
        fn $name:ident($($arg:ident: $kind:ident $(<$dt:ident>)?),* $(,)?)
            cpu $cpu:path, cuda $cuda:ident;
    )*) => {
        $(
            $(#[$meta])*
            #[allow(clippy::too_many_arguments)]
            fn $name(
                &self,
                $($arg: $crate::backend::ops::op_arg_type!($kind $(<$dt>)?)),*
            ) -> $crate::backend::Result<()>;
        )*
    };
}
pub(crate) use declare_ops;
