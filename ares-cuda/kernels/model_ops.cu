// Model kernels of ares (the decoder's forward and backward ops, the optimizer, the KV
// cache), compiled at run time by NVRTC after online_softmax.cuh; no CUDA headers needed.
// Storage and math are f32 (f64 where a long sum must stay exact to f32), indices are 64-bit. Each kernel has a CPU
// twin in ares-cpu with the same semantics; ares-cuda/src/model_ops/*.rs documents the
// arguments and checks them before launch.
//
// Bad values a kernel meets (an id out of range, a mask value not 0/1, NaN logits, a
// non-finite gradient) are OR-ed into a status word as the bits below; the host reads it
// at the next synchronisation. The affected outputs are NaN (never silently wrong) unless
// a kernel says otherwise.
//
// Block sizes are multiples of 32 (warp shuffles use full masks).

#define NAN_F __int_as_float(0x7fffffff)
#define FULL 0xffffffffu

#define ST_BAD_ROW 1u       // a logits row holds NaN/+inf or only -inf
#define ST_BAD_TARGET 2u    // a target id >= vocab or with logit -inf
#define ST_BAD_ID 4u        // an embedding id >= rows
#define ST_BAD_MASK 8u      // a key mask value other than 0 and 1
#define ST_BAD_COEFF 16u    // a non-finite log-prob or entropy coefficient (or one overflowing)
#define ST_BAD_GRAD 32u     // a non-finite gradient given to AdamW (the step was skipped)
#define ST_BAD_SEGMENTS 64u // cu_seqlens not 0 first, decreasing, or not ending at tokens (as vision_ops.cu)

typedef long long i64;


__device__ __forceinline__ float warp_sum(float x) {
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(FULL, x, off);
    return x;
}

__device__ __forceinline__ double warp_sum_d(double x) {
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(FULL, x, off);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL, x, off));
    return x;
}

// Block-wide sum, returned to every thread. The butterfly gives every lane the same value
// and the tree is fixed by the block size, so the result is deterministic. `sh` holds 32
// doubles; the leading barrier protects it from a previous call's readers.
__device__ __forceinline__ double block_sum_d(double x, double* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    x = warp_sum_d(x);
    __syncthreads();
    if (lane == 0) sh[warp] = x;
    __syncthreads();
    return warp_sum_d(lane < nw ? sh[lane] : 0.0);
}

// Block-wide max and "any" flag, returned to every thread.
__device__ __forceinline__ float block_max(float x, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    x = warp_max(x);
    __syncthreads();
    if (lane == 0) sh[warp] = x;
    __syncthreads();
    return warp_max(lane < nw ? sh[lane] : NEG_INF);
}

// ---------------------------------------------------------------------------------------
// Element-wise ops (grid-stride loops).

extern "C" __global__ void fill_f32(float* __restrict__ dst, i64 n, float value) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dst[i] = value;
}

extern "C" __global__ void add_f32(const float* __restrict__ a, const float* __restrict__ b,
                                   float* __restrict__ out, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}

// f32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN (twin of
// ares_cpu::ops::precision::MatmulPrecision::Bf16.round and half::bf16::from_f32).
__device__ __forceinline__ unsigned short bf16_rne(float x) {
    unsigned int b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b | 0x00400000u) >> 16);
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// Values as stored: f32, or bf16 bits widened exactly and rounded to nearest even (AdamW
// moments: twin of ares_cpu::ops::optim::Moment; KV pages: of ares_cpu::ops::stored).
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(unsigned short b) {
    return __uint_as_float((unsigned int)b << 16);
}
__device__ __forceinline__ void store_narrow(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_narrow(unsigned short* p, float x) { *p = bf16_rne(x); }

// The operands of bf16 GEMMs.
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, unsigned short* __restrict__ y,
                                       i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = bf16_rne(x[i]);
}

// Stochastic rounding's 16 random bits for element i under key: SplitMix64's output
// function of key ^ i·φ, low 16 bits (twin of ares_cpu::ops::precision::rounding_bits).
__device__ __forceinline__ unsigned int rounding_bits(unsigned long long key, unsigned long long i) {
    unsigned long long z = key ^ (i * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (unsigned int)((z ^ (z >> 31)) & 0xffffull);
}

// f32 -> bf16 bits rounded stochastically with r (twin of ares_cpu::ops::precision::
// bf16_stochastic): the magnitude plus r/2^16 of an ulp, truncated; NaN stays a quiet NaN.
__device__ __forceinline__ unsigned short bf16_stochastic(float x, unsigned int r) {
    unsigned int b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b | 0x00400000u) >> 16);
    return (unsigned short)((b + (r & 0xffffu)) >> 16);
}

// Weights stored in bf16, written back by their optimizer step (element i draws
// rounding_bits(key, i) whatever the launch shape).
extern "C" __global__ void f32_to_bf16_stochastic(const float* __restrict__ x,
                                                  unsigned short* __restrict__ y, i64 n,
                                                  unsigned long long key) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = bf16_stochastic(x[i], rounding_bits(key, (unsigned long long)i));
}

// A gradient stored in bf16 taking an f32 contribution: y = SR(widen(y) + x) with
// rounding_bits(key, i) (twin of ares_cpu::ops::precision::accumulate_bf16_stochastic).
extern "C" __global__ void accumulate_bf16_stochastic(const float* __restrict__ x,
                                                      unsigned short* __restrict__ y, i64 n,
                                                      unsigned long long key) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = bf16_stochastic(widen(y[i]) + x[i], rounding_bits(key, (unsigned long long)i));
}

// Every element set to the bf16 bits `bits` (a gradient stored in bf16 zeroed).
extern "C" __global__ void fill_bf16(unsigned short* __restrict__ y, i64 n, unsigned short bits) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = bits;
}

// bf16 bits -> f32, exact (weights stored in bf16, read by their optimizer step).
extern "C" __global__ void bf16_to_f32(const unsigned short* __restrict__ x, float* __restrict__ y,
                                       i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = widen(x[i]);
}

extern "C" __global__ void scale_f32(float* __restrict__ x, i64 n, float s) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        x[i] = x[i] * s;
}

// y += alpha·x; the product rounded before the sum, as ares_cpu::ops::axpy::axpy (no FMA).
extern "C" __global__ void axpy_f32(float alpha, const float* __restrict__ x,
                                    float* __restrict__ y, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], __fmul_rn(alpha, x[i]));
}

// out[r, c] += bias[c], one block per row (grid-stride over rows).
extern "C" __global__ void bias_add(float* __restrict__ out, const float* __restrict__ bias,
                                   i64 rows, i64 cols) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x)
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) out[r * cols + c] += bias[c];
}

// ---------------------------------------------------------------------------------------
// Embedding.

// out[t, :] = table[ids[t], :] (a bf16 table's bits widened, exact); a row whose id is
// >= rows is NaN (status ST_BAD_ID).
template <typename T>
__device__ __forceinline__ void embedding_rows(const unsigned* __restrict__ ids,
                                               const T* __restrict__ table, i64 rows, i64 dim,
                                               i64 tokens, float* __restrict__ out,
                                               unsigned* __restrict__ status) {
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        const i64 id = ids[t];
        float* o = out + t * dim;
        if (id >= rows) {
            for (i64 c = threadIdx.x; c < dim; c += blockDim.x) o[c] = NAN_F;
            if (threadIdx.x == 0) atomicOr(status, ST_BAD_ID);
            continue;
        }
        const T* src = table + id * dim;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x) o[c] = widen(src[c]);
    }
}

extern "C" __global__ void embedding_fwd(const unsigned* __restrict__ ids,
                                         const float* __restrict__ table, i64 rows, i64 dim,
                                         i64 tokens, float* __restrict__ out,
                                         unsigned* __restrict__ status) {
    embedding_rows(ids, table, rows, dim, tokens, out, status);
}

// An embedding stored in bf16 (a model's weights stored in bf16).
extern "C" __global__ void embedding_fwd_bf16(const unsigned* __restrict__ ids,
                                              const unsigned short* __restrict__ table, i64 rows,
                                              i64 dim, i64 tokens, float* __restrict__ out,
                                              unsigned* __restrict__ status) {
    embedding_rows(ids, table, rows, dim, tokens, out, status);
}

// dtable[ids[t], :] += dout[t, :], deterministic without atomics: the block of the first
// token carrying an id owns that table row and adds the gradients of every token with the
// id in token order (the CPU's order, so the sums agree bit for bit). Finding the owner
// and the duplicates scans the ids: O(tokens²) comparisons from cache, cheap next to the
// row adds for the token counts of a training micro-batch. Ids >= rows are skipped
// (status ST_BAD_ID).
extern "C" __global__ void embedding_bwd(const unsigned* __restrict__ ids,
                                         const float* __restrict__ dout, i64 rows, i64 dim,
                                         i64 tokens, float* __restrict__ dtable,
                                         unsigned* __restrict__ status) {
    __shared__ unsigned match_bits[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        const unsigned id = ids[t];
        if ((i64)id >= rows) {
            if (threadIdx.x == 0) atomicOr(status, ST_BAD_ID);
            continue;
        }
        // Owner: no earlier token has this id.
        bool earlier = false;
        for (i64 base = 0; base < t; base += blockDim.x) {
            const i64 s = base + threadIdx.x;
            if (__syncthreads_or(s < t && ids[s] == id)) {
                earlier = true;
                break;
            }
        }
        if (earlier) continue;
        float* dst = dtable + (i64)id * dim;
        for (i64 base = t; base < tokens; base += blockDim.x) {
            const i64 s = base + threadIdx.x;
            const unsigned bits = __ballot_sync(FULL, s < tokens && ids[s] == id);
            if (lane == 0) match_bits[warp] = bits;
            __syncthreads();
            for (int w = 0; w < nw; w++) {
                unsigned m = match_bits[w];
                while (m) {
                    const int l = __ffs(m) - 1;
                    m &= m - 1;
                    const float* src = dout + (base + w * 32 + l) * dim;
                    for (i64 c = threadIdx.x; c < dim; c += blockDim.x) dst[c] += src[c];
                }
            }
            __syncthreads();
        }
    }
}

// ---------------------------------------------------------------------------------------
// RMSNorm: y = w·(x·r), r = 1/sqrt(fl32(Σ fl32(x²)) / d + eps), the sum in f64 (the CPU's
// numerics: squares rounded to f32, their sum exact to f32). One block per row.

extern "C" __global__ void rmsnorm_fwd(const float* __restrict__ x, const float* __restrict__ w,
                                       float eps, i64 rows, i64 dim, float* __restrict__ out,
                                       float* __restrict__ rstd) {
    __shared__ double sh[32];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = x + row * dim;
        double acc = 0.0;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x) {
            float v = xr[c];
            acc += (double)__fmul_rn(v, v);
        }
        const double sum = block_sum_d(acc, sh);
        const float mean_sq = __fdiv_rn((float)sum, (float)dim);
        const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_sq, eps)));
        float* o = out + row * dim;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x) o[c] = __fmul_rn(w[c], __fmul_rn(xr[c], r));
        if (threadIdx.x == 0) rstd[row] = r;
    }
}

// The residual add fused with the next RMSNorm: sum = a + b, then rmsnorm_fwd of sum — its
// bits (each thread reads back only the sums it wrote), the output stored as O (f32, or
// bf16 rounded to nearest even: add_rmsnorm_fwd_bf16). One block per row.
template <class O>
__device__ __forceinline__ void add_rmsnorm_rows(const float* __restrict__ a,
                                                 const float* __restrict__ b,
                                                 const float* __restrict__ w, float eps, i64 rows,
                                                 i64 dim, float* __restrict__ sum,
                                                 O* __restrict__ out, float* __restrict__ rstd) {
    __shared__ double sh[32];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        float* sr = sum + row * dim;
        double acc = 0.0;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x) {
            const float v = __fadd_rn(a[row * dim + c], b[row * dim + c]);
            sr[c] = v;
            acc += (double)__fmul_rn(v, v);
        }
        const double total = block_sum_d(acc, sh);
        const float mean_sq = __fdiv_rn((float)total, (float)dim);
        const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_sq, eps)));
        O* o = out + row * dim;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x)
            store_narrow(o + c, __fmul_rn(w[c], __fmul_rn(sr[c], r)));
        if (threadIdx.x == 0) rstd[row] = r;
    }
}

extern "C" __global__ void add_rmsnorm_fwd(const float* __restrict__ a, const float* __restrict__ b,
                                           const float* __restrict__ w, float eps, i64 rows,
                                           i64 dim, float* __restrict__ sum,
                                           float* __restrict__ out, float* __restrict__ rstd) {
    add_rmsnorm_rows(a, b, w, eps, rows, dim, sum, out, rstd);
}

extern "C" __global__ void add_rmsnorm_fwd_bf16(const float* __restrict__ a,
                                                const float* __restrict__ b,
                                                const float* __restrict__ w, float eps, i64 rows,
                                                i64 dim, float* __restrict__ sum,
                                                unsigned short* __restrict__ out,
                                                float* __restrict__ rstd) {
    add_rmsnorm_rows(a, b, w, eps, rows, dim, sum, out, rstd);
}

// dx[t, i] += r·(dy·w)[i] − c·x[t, i] with c = r³·Σⱼ fl32(dy·w)ⱼ·xⱼ / d (f64), per row.
extern "C" __global__ void rmsnorm_bwd_dx(const float* __restrict__ dout, const float* __restrict__ x,
                                          const float* __restrict__ w, const float* __restrict__ rstd,
                                          i64 rows, i64 dim, float* __restrict__ dx) {
    __shared__ double sh[32];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* dy = dout + row * dim;
        const float* xr = x + row * dim;
        double acc = 0.0;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x)
            acc += (double)__fmul_rn(dy[c], w[c]) * (double)xr[c];
        const double gx = block_sum_d(acc, sh);
        const float r = rstd[row];
        const double rd = (double)r;
        const float coef = (float)(rd * rd * rd * gx * (1.0 / (double)dim));
        float* o = dx + row * dim;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x)
            o[c] = __fadd_rn(o[c], __fsub_rn(__fmul_rn(r, __fmul_rn(dy[c], w[c])), __fmul_rn(coef, xr[c])));
    }
}

// Column partial sums over chunks of rows, the first stage of a deterministic column
// reduction: partial[k, c] = Σ_{rows r of chunk k, in order} a[r, c]·(b ? b[r, c]·s[r] : 1).
// Grid: x over column blocks, y over chunks (grid-stride).
extern "C" __global__ void col_partials(const float* __restrict__ a, const float* __restrict__ b,
                                        const float* __restrict__ s, i64 rows, i64 cols,
                                        i64 chunk_rows, i64 chunks, float* __restrict__ partial) {
    const i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    for (i64 k = blockIdx.y; k < chunks; k += gridDim.y) {
        const i64 r0 = k * chunk_rows;
        const i64 r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
        float acc = 0.0f;
        if (b) {
            for (i64 r = r0; r < r1; r++)
                acc = __fadd_rn(acc, __fmul_rn(a[r * cols + c], __fmul_rn(b[r * cols + c], s[r])));
        } else {
            for (i64 r = r0; r < r1; r++) acc = __fadd_rn(acc, a[r * cols + c]);
        }
        partial[k * cols + c] = acc;
    }
}

// Second stage: out[c] += partial[0, c] + partial[1, c] + … in chunk order.
extern "C" __global__ void col_reduce(const float* __restrict__ partial, i64 chunks, i64 cols,
                                      float* __restrict__ out) {
    for (i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += (i64)gridDim.x * blockDim.x) {
        float acc = out[c];
        for (i64 k = 0; k < chunks; k++) acc = __fadd_rn(acc, partial[k * cols + c]);
        out[c] = acc;
    }
}

// ---------------------------------------------------------------------------------------
// RoPE, "rotate_half" layout, in place on x [tokens, heads, head_dim] with cos/sin
// [tokens, head_dim/2]. Forward: (x1·c − x2·s, x2·c + x1·s); inverse (the backward):
// (x1·c + x2·s, x2·c − x1·s). Separately rounded products, as torch (and the CPU twin).
// One block per token (grid-stride).
// The rotation of x's rows into out (in place: out = x, f32), stored as O (f32, or bf16
// rounded to nearest even: q and k kept in bf16, rope_fwd_bf16).
template <class O>
__device__ __forceinline__ void rope_rows(const float* x, O* out, const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, i64 tokens, int heads,
                                          int head_dim, int inverse) {
    const int half = head_dim / 2;
    const int pairs = heads * half;
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x) {
        const float* xt = x + t * (i64)heads * head_dim;
        O* ot = out + t * (i64)heads * head_dim;
        const float* ct = cos_t + t * half;
        const float* st = sin_t + t * half;
        for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
            const int h = i / half, j = i - h * half;
            const float* p = xt + (i64)h * head_dim;
            O* o = ot + (i64)h * head_dim;
            const float u = p[j], v = p[j + half], c = ct[j], s = st[j];
            if (inverse) {
                store_narrow(o + j, __fadd_rn(__fmul_rn(u, c), __fmul_rn(v, s)));
                store_narrow(o + j + half, __fsub_rn(__fmul_rn(v, c), __fmul_rn(u, s)));
            } else {
                store_narrow(o + j, __fsub_rn(__fmul_rn(u, c), __fmul_rn(v, s)));
                store_narrow(o + j + half, __fadd_rn(__fmul_rn(v, c), __fmul_rn(u, s)));
            }
        }
    }
}

extern "C" __global__ void rope(float* x, const float* __restrict__ cos_t,
                                const float* __restrict__ sin_t, i64 tokens, int heads,
                                int head_dim, int inverse) {
    rope_rows(x, x, cos_t, sin_t, tokens, heads, head_dim, inverse);
}

extern "C" __global__ void rope_fwd_bf16(const float* __restrict__ x,
                                         const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, i64 tokens, int heads,
                                         int head_dim, unsigned short* __restrict__ out) {
    rope_rows(x, out, cos_t, sin_t, tokens, heads, head_dim, 0);
}

// ---------------------------------------------------------------------------------------
// dst[cols, rows] = src[rows, cols]ᵀ through 32×32 shared tiles (coalesced both ways).
// Block 32×8; grid x over column tiles, y over row tiles (grid-stride).
extern "C" __global__ void transpose_f32(const float* __restrict__ src, i64 rows, i64 cols,
                                         float* __restrict__ dst) {
    __shared__ float tile[32][33];
    const i64 row_tiles = (rows + 31) / 32;
    for (i64 ty = blockIdx.y; ty < row_tiles; ty += gridDim.y) {
        const i64 r0 = ty * 32, c0 = (i64)blockIdx.x * 32;
        for (int k = threadIdx.y; k < 32; k += blockDim.y) {
            const i64 r = r0 + k, c = c0 + threadIdx.x;
            if (r < rows && c < cols) tile[k][threadIdx.x] = src[r * cols + c];
        }
        __syncthreads();
        for (int k = threadIdx.y; k < 32; k += blockDim.y) {
            const i64 c = c0 + k, r = r0 + threadIdx.x;
            if (r < rows && c < cols) dst[c * rows + r] = tile[threadIdx.x][k];
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------
// Log-prob backward: per row, with z = x/T, g = coeff/T,
// dlogits = g·(onehot(target) − softmax(z)); rows with coeff 0 are zero and not read.
// One block per row: the max (and a NaN/+inf check), then e = 2^(y − max) written into
// the output while summing (f64 across threads), then the scaling, in place: the CPU's
// algorithm. A bad row is NaN (status bits as named).
extern "C" __global__ void log_prob_bwd(const float* __restrict__ logits, i64 vocab, float inv_t,
                                        const unsigned* __restrict__ targets,
                                        const float* __restrict__ coeffs, i64 rows,
                                        float* __restrict__ dlogits, unsigned* __restrict__ status) {
    __shared__ double shd[32];
    __shared__ float shf[32];
    const float scale = inv_t * LOG2E;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* x = logits + row * vocab;
        float* out = dlogits + row * vocab;
        const float c = coeffs[row];
        const unsigned id = targets[row];
        unsigned bad_bit = 0;
        if (!is_finite(c)) bad_bit = ST_BAD_COEFF;
        else if (c == 0.0f) {
            for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) out[i] = 0.0f;
            continue;
        } else if ((i64)id >= vocab) bad_bit = ST_BAD_TARGET;
        if (bad_bit == 0) {
            float m = NEG_INF;
            int bad = 0;
            for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float y = x[i] * scale;
                bad |= !(y < POS_INF);
                m = fmaxf(m, y);
            }
            bad = __syncthreads_or(bad);
            m = block_max(m, shf);
            if (bad || m == NEG_INF) bad_bit = ST_BAD_ROW;
            else if (x[id] == NEG_INF) bad_bit = ST_BAD_TARGET;
            if (bad_bit == 0) {
                float acc = 0.0f;
                for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
                    const float e = exp2f(x[i] * scale - m);
                    out[i] = e;
                    acc += e;
                }
                const double total = block_sum_d((double)acc, shd);
                const float g = c * inv_t;
                const float k = (float)(-(double)g / total);
                for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
                    float v = out[i] * k;
                    if (i == (i64)id) v += g;
                    out[i] = v;
                }
                continue;
            }
        }
        for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) out[i] = NAN_F;
        if (threadIdx.x == 0) atomicOr(status, bad_bit);
    }
}

// ---------------------------------------------------------------------------------------
// Entropy backward: per row with c = coeffs[row] != 0, z = x/T, p = softmax(z) and
// H = -sum p ln p, dlogits += c * dH/dx = -c * p * (ln p + H) / T, ACCUMULATED (it runs
// after log_prob_bwd overwrote the buffer); rows with c = 0 are neither read nor written.
// In base 2, with d = y - max y (y = x*log2e/T) and S = sum 2^d, ln p + H = ln2*(d - dbar)
// where dbar = sum 2^d*d / S, so one block per row: the max (and a NaN/+inf check), then S
// and sum 2^d*d (f64 across threads), then the update recomputing 2^d: the CPU's algorithm
// (ares_cpu::ops::entropy_backward). d is clamped at -127 and 2^d below -126 is 0, so a
// -inf logit gets exactly 0. A bad row (NaN/+inf or only -inf: ST_BAD_ROW) or a
// non-finite c, or one so large against T that the gradient overflows (ST_BAD_COEFF),
// makes the row NaN.
__device__ __forceinline__ float entropy_bwd_d(float x, float scale, float m) {
    return fmaxf(x * scale - m, -127.0f);
}
__device__ __forceinline__ float entropy_bwd_e(float d) {
    return d < -126.0f ? 0.0f : exp2f(d);
}

extern "C" __global__ void entropy_bwd(const float* __restrict__ logits, i64 vocab, float inv_t,
                                       const float* __restrict__ coeffs, i64 rows,
                                       float* __restrict__ dlogits,
                                       unsigned* __restrict__ status) {
    __shared__ double shd[32];
    __shared__ float shf[32];
    const float scale = inv_t * LOG2E;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float c = coeffs[row];
        if (c == 0.0f) continue;
        const float* x = logits + row * vocab;
        float* out = dlogits + row * vocab;
        unsigned bad_bit = 0;
        if (!is_finite(c)) bad_bit = ST_BAD_COEFF;
        if (bad_bit == 0) {
            float m = NEG_INF;
            int bad = 0;
            for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float y = x[i] * scale;
                bad |= !(y < POS_INF);
                m = fmaxf(m, y);
            }
            bad = __syncthreads_or(bad);
            m = block_max(m, shf);
            if (bad || m == NEG_INF) bad_bit = ST_BAD_ROW;
            if (bad_bit == 0) {
                float s = 0.0f, u = 0.0f;
                for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
                    const float d = entropy_bwd_d(x[i], scale, m);
                    const float e = entropy_bwd_e(d);
                    s += e;
                    u += e * d;
                }
                const double s_total = block_sum_d((double)s, shd);
                const double u_total = block_sum_d((double)u, shd);
                const float mean_d = (float)(u_total / s_total);
                // |2^d * (d - dbar)| <= 127: a factor above FLT_MAX/128 could overflow.
                const double k = -(double)c * 0.6931471805599453 * (double)inv_t / s_total;
                if (fabs(k) * 128.0 <= 3.4028234663852886e38) {
                    const float kf = (float)k;
                    for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
                        const float d = entropy_bwd_d(x[i], scale, m);
                        out[i] += kf * entropy_bwd_e(d) * (d - mean_d);
                    }
                    continue;
                }
                bad_bit = ST_BAD_COEFF;
            }
        }
        for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) out[i] = NAN_F;
        if (threadIdx.x == 0) atomicOr(status, bad_bit);
    }
}

// ---------------------------------------------------------------------------------------
// Greedy decoding on the device: per row the index of the largest logit, the lowest index
// among equal maxima (ares-runner's host `pick`). A row holding NaN/+inf, or only -inf,
// gives 0xffffffff (no token; the caller reports it). One block per row; a thread walks
// its elements in increasing order, so `>` keeps the first of equal values.

__device__ __forceinline__ void argmax_merge(float& v, i64& i, float ov, i64 oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// Block-wide reduction of each thread's (value, index) by MERGE (argmax_merge, race_merge):
// the winner on warp 0, whose lanes start from (none_v, none_i) past the block's warps.
// `shv`, `shi`: 32 shared entries each; the closing barrier frees them for reuse.
template <typename I, void (*MERGE)(float&, I&, float, I)>
__device__ __forceinline__ void block_merge(float& best, I& best_i, float none_v, I none_i,
                                            float* shv, I* shi) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int off = 16; off > 0; off >>= 1)
        MERGE(best, best_i, __shfl_xor_sync(FULL, best, off), __shfl_xor_sync(FULL, best_i, off));
    __syncthreads();
    if (lane == 0) {
        shv[warp] = best;
        shi[warp] = best_i;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < warps ? shv[lane] : none_v;
        best_i = lane < warps ? shi[lane] : none_i;
        for (int off = 16; off > 0; off >>= 1)
            MERGE(best, best_i, __shfl_xor_sync(FULL, best, off), __shfl_xor_sync(FULL, best_i, off));
    }
    __syncthreads();
}

// What a pick adds to its first read of a row (pick_rows): the online softmax state at
// scale = inv_t·log2(e), for the pick's log-prob and the row's entropy, and whether a scaled
// logit left the finite range — log_prob_entropy_row's per-element steps. Nothing when LP is
// false (argmax_rows, sample_race), which then compile to what they were alone.
template <bool LP>
__device__ __forceinline__ void pick_accumulate(Online& st, int& ybad, float v, float scale) {
    if (LP) {
        const float y = v * scale;
        ybad |= !(y < POS_INF);
        online_rescale(st, y);
        online_add(st, y);
    }
}

// The greedy token of row x, on thread 0 (the whole block calls it; `shv`, `shi` 32 shared
// entries each).
template <bool LP>
__device__ unsigned argmax_row(const float* __restrict__ x, i64 vocab, float scale, Online& st,
                               int& ybad, float* shv, i64* shi) {
    float best = NEG_INF;
    i64 best_i = vocab;  // none yet: -inf entries are never picked
    int bad = 0;
    for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        bad |= !(v < POS_INF);
        pick_accumulate<LP>(st, ybad, v, scale);
        if (v > best) {
            best = v;
            best_i = i;
        }
    }
    bad = __syncthreads_or(bad);
    block_merge<i64, argmax_merge>(best, best_i, NEG_INF, vocab, shv, shi);
    return !bad && best_i < vocab ? (unsigned)best_i : 0xffffffffu;
}

extern "C" __global__ void argmax_rows(const float* __restrict__ logits, i64 vocab, i64 rows,
                                       unsigned* __restrict__ out) {
    __shared__ float shv[32];
    __shared__ i64 shi[32];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        Online none = {NEG_INF, 0.0f, 0.0f};
        int ybad = 0;
        const unsigned id = argmax_row<false>(logits + row * vocab, vocab, 0.0f, none, ybad, shv, shi);
        if (threadIdx.x == 0) out[row] = id;
    }
}

// ---------------------------------------------------------------------------------------
// Sampling on the device: the race sampler, twin of ares_cpu::sampler bit for bit (its
// module docs state the arithmetic). Token i of a row keyed by (seed, sequence, step) gets
// word i%4 of Philox4x32-10(counter = (i/4, step, seq lo, seq hi), key = (seed lo, seed
// hi)); the token is argmax_i x_i·inv_t + g_i over the candidates (lowest index among equal
// scores), g_i = -ln(-log1p(-V_i)) a Gumbel draw. ln/log1p/exp2 are spelled with __f*_rn
// intrinsics so no multiply-add is fused: the bits are the CPU's. Filters cut a prefix of
// the rows in key order (descending logit, ascending id) where an integer count or a
// fixed-point mass floor(w·2^32) reaches a threshold; integer sums (shared-memory
// atomics) are the same in any order, so the cut is the CPU's. Without filters: one pass
// over the row. A row holding NaN/+inf, or only -inf, gives 0xffffffff. One block a row.

typedef unsigned long long u64;

__device__ __forceinline__ u64 descending_key(float x, i64 i) {
    const unsigned b = x == 0.0f ? 0u : __float_as_uint(x);
    const unsigned ascending = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)(~ascending) << 32) | (u64)(unsigned)i;
}

__device__ __forceinline__ void philox4x32_10(unsigned c[4], unsigned k0, unsigned k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        const unsigned n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

// ln x for a positive normal x: x = 2^e·m, m in [√½, √2), s = (m-1)/(m+1), the atanh
// series (ares_cpu::sampler::ln)
__device__ __forceinline__ float ln_rn(float x) {
    const unsigned bits = __float_as_uint(x);
    int e = (int)((bits >> 23) & 0xffu) - 127;
    float m = __uint_as_float((bits & 0x007fffffu) | 0x3f800000u);
    if (m > __uint_as_float(0x3fb504f3u)) {  // √2
        m = __fmul_rn(m, 0.5f);
        e += 1;
    }
    const float f = __fsub_rn(m, 1.0f);
    const float s = __fdiv_rn(f, __fadd_rn(2.0f, f));
    const float s2 = __fmul_rn(s, s);
    float r = __fmul_rn(s2, __uint_as_float(0x3e3a2e8cu));                // 2/11
    r = __fmul_rn(s2, __fadd_rn(__uint_as_float(0x3e638e39u), r));        // 2/9
    r = __fmul_rn(s2, __fadd_rn(__uint_as_float(0x3e924925u), r));        // 2/7
    r = __fmul_rn(s2, __fadd_rn(__uint_as_float(0x3ecccccdu), r));        // 2/5
    r = __fmul_rn(s2, __fadd_rn(__uint_as_float(0x3f2aaaabu), r));        // 2/3
    const float ef = __int2float_rn(e);
    const float lo = __fadd_rn(__fmul_rn(s, r), __fmul_rn(ef, __uint_as_float(0x35bfbe8eu)));
    return __fadd_rn(__fmul_rn(ef, __uint_as_float(0x3f317200u)), __fadd_rn(__fadd_rn(s, s), lo));
}

// ln(1 + y) for y in [-1 + 2^-24, 0] (ares_cpu::sampler::log1p)
__device__ __forceinline__ float log1p_rn(float y) {
    if (y < -0.5f) return ln_rn(__fadd_rn(1.0f, y));
    const float u = __fadd_rn(1.0f, y);
    if (u == 1.0f) return y;
    return __fmul_rn(ln_rn(u), __fdiv_rn(y, __fsub_rn(u, 1.0f)));
}

// the Gumbel draw of 32 random bits (ares_cpu::sampler::gumbel)
__device__ __forceinline__ float gumbel_rn(unsigned bits) {
    const float v = fminf(__fadd_rn(__fmul_rn(__uint2float_rn(bits), __uint_as_float(0x2f800000u)),
                                    __uint_as_float(0x2f000000u)),
                          __uint_as_float(0x3f7fffffu));
    return -ln_rn(-log1p_rn(-v));
}

// 2^x for x <= 0 without FMA (ares_cpu's exp2_nonpositive::<false>)
__device__ __forceinline__ float exp2_nonpositive_rn(float x) {
    const float magic = __uint_as_float(0x4b400000u);
    const float xc = fmaxf(x, -126.0f);
    const float k = __fadd_rn(xc, magic);
    const float n = __fsub_rn(k, magic);
    const int n_int = (int)(__float_as_uint(k) - __float_as_uint(magic));
    const float r = __fsub_rn(xc, n);
    float p = __uint_as_float(0x39218489u);
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3aaec3ffu));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3c1d955bu));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3d635847u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3e75fdf0u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3f317218u));
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    const float scale = __uint_as_float((unsigned)(n_int + 127) << 23);
    return x < -126.0f ? 0.0f : __fmul_rn(p, scale);
}

// SwiGLU (twin of ares_cpu::ops::swiglu): from t = e^(−|g|) ≤ 1, σ = 1/(1+t) and
// silu = g/(1+t) for g ≥ 0, σ = t/(1+t) and silu = g·t/(1+t) below; e^y = 2^(y·log₂e) by
// exp2_nonpositive_rn. The _rn intrinsics keep the compiler from fusing into FMAs, so every
// operation is the CPU's: the same bits.
__device__ __forceinline__ void sigmoid_silu_rn(float g, float& s, float& silu) {
    const float t = exp2_nonpositive_rn(__fmul_rn(-fabsf(g), __uint_as_float(0x3fb8aa3bu)));
    const float d = __fadd_rn(1.0f, t);
    const bool pos = g >= 0.0f;
    s = __fdiv_rn(pos ? 1.0f : t, d);
    silu = __fdiv_rn(pos ? g : __fmul_rn(g, t), d);
}

// out = silu(g)·u, the inputs and output stored as T (f32, or bf16 widened exactly and the
// output rounded to nearest even: swiglu_fwd_bf16).
template <class T>
__device__ __forceinline__ void swiglu_elements(const T* __restrict__ gate, const T* __restrict__ up,
                                                T* __restrict__ out, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float s, silu;
        sigmoid_silu_rn(widen(gate[i]), s, silu);
        store_narrow(out + i, __fmul_rn(silu, widen(up[i])));
    }
}

extern "C" __global__ void swiglu_fwd(const float* __restrict__ gate, const float* __restrict__ up,
                                      float* __restrict__ out, i64 n) {
    swiglu_elements(gate, up, out, n);
}

extern "C" __global__ void swiglu_fwd_bf16(const unsigned short* __restrict__ gate,
                                           const unsigned short* __restrict__ up,
                                           unsigned short* __restrict__ out, i64 n) {
    swiglu_elements(gate, up, out, n);
}

// dgate = ((dy·u)·σ)·(1 + g·(1 − σ)), dup = dy·silu(g); overwrites both (f32), gate and up
// stored as T.
template <class T>
__device__ __forceinline__ void swiglu_grad_elements(const float* __restrict__ dout,
                                                     const T* __restrict__ gate,
                                                     const T* __restrict__ up,
                                                     float* __restrict__ dgate,
                                                     float* __restrict__ dup, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float g = widen(gate[i]), u = widen(up[i]), dy = dout[i];
        float s, silu;
        sigmoid_silu_rn(g, s, silu);
        float one_plus = __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s)));
        dgate[i] = __fmul_rn(__fmul_rn(__fmul_rn(dy, u), s), one_plus);
        dup[i] = __fmul_rn(dy, silu);
    }
}

extern "C" __global__ void swiglu_bwd(const float* __restrict__ dout, const float* __restrict__ gate,
                                      const float* __restrict__ up, float* __restrict__ dgate,
                                      float* __restrict__ dup, i64 n) {
    swiglu_grad_elements(dout, gate, up, dgate, dup, n);
}

extern "C" __global__ void swiglu_bwd_bf16(const float* __restrict__ dout,
                                           const unsigned short* __restrict__ gate,
                                           const unsigned short* __restrict__ up,
                                           float* __restrict__ dgate, float* __restrict__ dup,
                                           i64 n) {
    swiglu_grad_elements(dout, gate, up, dgate, dup, n);
}

// w = e^{(x - max)·inv_t} (ares_cpu::sampler::relative_weight)
__device__ __forceinline__ float relative_weight(float x, float max, float inv_t) {
    return exp2_nonpositive_rn(__fmul_rn(__fmul_rn(__fsub_rn(x, max), inv_t), __uint_as_float(0x3fb8aa3bu)));
}

__device__ __forceinline__ u64 fixed_weight(float w) {
    return __float2ull_rz(__fmul_rn(w, 4294967296.0f));
}

// Radix select (ares_cpu::sampler::radix_select): the smallest key K with the count
// (mass = false) or the fixed-point mass of the tokens with key <= min(K, limit) reaching
// need (>= 1); false when the whole sum falls short. 8 bits a pass; `hist` 256 shared u64,
// `sh` 2 shared u64.
__device__ bool radix_select(const float* x, i64 vocab, bool mass, u64 limit, float max, float inv_t,
                             u64 need, u64* hist, u64* sh, u64* key_out) {
    u64 prefix = 0, before = 0;
    for (int pass = 0; pass < 8; ++pass) {
        const int shift = 56 - 8 * pass;
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = x[i];
            if (!(v > NEG_INF)) continue;
            const u64 key = descending_key(v, i);
            if (key > limit || (pass > 0 && ((key ^ prefix) >> (shift + 8)) != 0)) continue;
            const u64 w = mass ? fixed_weight(relative_weight(v, max, inv_t)) : 1ull;
            if (w) atomicAdd(&hist[(key >> shift) & 0xffu], w);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 byte = 256;
            for (int b = 0; b < 256; ++b) {
                if (before + hist[b] >= need) {
                    byte = (u64)b;
                    break;
                }
                before += hist[b];
            }
            sh[0] = byte;
            sh[1] = before;
        }
        __syncthreads();
        const u64 byte = sh[0];
        before = sh[1];
        __syncthreads();  // sh and hist are rewritten by the next pass
        if (byte == 256) return false;
        prefix |= byte << shift;
    }
    *key_out = prefix;
    return true;
}

// the race's merge: the larger score, the lower index among equal ones; `none` loses
__device__ __forceinline__ void race_merge(float& s, unsigned& i, float os, unsigned oi) {
    if (oi != 0xffffffffu && (i == 0xffffffffu || os > s || (os == s && oi < i))) {
        s = os;
        i = oi;
    }
}

// The Gumbel draws of tokens 0..n of one key (5 words), for checking the twin bit for bit.
extern "C" __global__ void race_draws(const unsigned* __restrict__ key, i64 n, float* __restrict__ out) {
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; 4 * q < n; q += (i64)gridDim.x * blockDim.x) {
        unsigned c[4] = {(unsigned)q, key[4], key[2], key[3]};
        philox4x32_10(c, key[0], key[1]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (4 * q + j < n) out[4 * q + j] = gumbel_rn(c[j]);
    }
}

#define GUMBEL_MIN (-3.0f)
#define GUMBEL_MAX 23.0f

// The race's token of row x keyed by `key` (5 words: seed lo, seed hi, sequence lo, sequence
// hi, step), on thread 0 (the whole block calls it). Shared scratch: shf and shi 32 entries,
// hist 256, sh 2, total 1.
template <bool LP>
__device__ unsigned race_row(const float* __restrict__ x, i64 vocab, float inv_t, unsigned top_k,
                             float top_p, float min_p, const unsigned* __restrict__ key, float scale,
                             Online& st, int& ybad, float* shf, unsigned* shi, u64* hist, u64* sh,
                             u64* total_sh) {
    const u64 ALL = ~0ull;
    const bool filtered = top_k != 0 || top_p < 1.0f || min_p > 0.0f;
    // the row's max: first, when the filters need it; else alongside the race, each
    // thread's own max bounding what can win
    float m = NEG_INF;
    int bad = 0;
    if (filtered) {
        for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = x[i];
            bad |= !(v < POS_INF);
            pick_accumulate<LP>(st, ybad, v, scale);
            m = fmaxf(m, v);
        }
        bad = __syncthreads_or(bad);
        m = block_max(m, shf);
        if (bad || m == NEG_INF) return 0xffffffffu;
    }
    u64 cut = ALL;
    if (top_k != 0) {
        u64 k;
        if (radix_select(x, vocab, false, ALL, m, inv_t, (u64)top_k, hist, sh, &k)) cut = k;
    }
    if (top_p < 1.0f) {
        if (threadIdx.x == 0) *total_sh = 0;
        __syncthreads();
        u64 part = 0;
        for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = x[i];
            if (v > NEG_INF && descending_key(v, i) <= cut)
                part += fixed_weight(relative_weight(v, m, inv_t));
        }
        atomicAdd(total_sh, part);
        __syncthreads();
        const u64 total = *total_sh;
        const u64 need = (u64)ceil(__dmul_rn((double)top_p, __ull2double_rn(total)));
        u64 k;
        if (radix_select(x, vocab, true, cut, m, inv_t, need, hist, sh, &k)) cut = k < cut ? k : cut;
    }
    // the race
    float floor = __fadd_rn(__fmul_rn(m, inv_t), GUMBEL_MIN);
    float mine = NEG_INF;  // this thread's max, without filters
    float best = NEG_INF;
    unsigned best_i = 0xffffffffu;
    const i64 quads = (vocab + 3) >> 2;
    for (i64 q = threadIdx.x; q < quads; q += blockDim.x) {
        unsigned c[4] = {0u, 0u, 0u, 0u};
        bool drawn = false;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const i64 i = 4 * q + j;
            if (i >= vocab) break;
            const float v = x[i];
            if (!filtered) {
                bad |= !(v < POS_INF);
                pick_accumulate<LP>(st, ybad, v, scale);
                if (v > mine) {
                    mine = v;
                    floor = __fadd_rn(__fmul_rn(mine, inv_t), GUMBEL_MIN);
                }
            }
            const float z = __fmul_rn(v, inv_t);
            if (!(v > NEG_INF && __fadd_rn(z, GUMBEL_MAX) >= floor)) continue;
            if (filtered) {
                if (cut != ALL && descending_key(v, i) > cut) continue;
                if (min_p > 0.0f && relative_weight(v, m, inv_t) < min_p) continue;
            }
            if (!drawn) {
                c[0] = (unsigned)q;
                c[1] = key[4];
                c[2] = key[2];
                c[3] = key[3];
                philox4x32_10(c, key[0], key[1]);
                drawn = true;
            }
            const float s = __fadd_rn(z, gumbel_rn(c[j]));
            race_merge(best, best_i, s, (unsigned)i);
        }
    }
    if (!filtered) {
        bad = __syncthreads_or(bad);
        m = block_max(mine, shf);
        if (bad || m == NEG_INF) return 0xffffffffu;
    }
    block_merge<unsigned, race_merge>(best, best_i, NEG_INF, 0xffffffffu, shf, shi);
    return best_i;
}

// keys: 5 words a row (seed lo, seed hi, sequence lo, sequence hi, step)
extern "C" __global__ void sample_race(const float* __restrict__ logits, i64 vocab, i64 rows,
                                       float inv_t, unsigned top_k, float top_p, float min_p,
                                       const unsigned* __restrict__ keys, unsigned* __restrict__ out) {
    __shared__ float shf[32];
    __shared__ unsigned shi[32];
    __shared__ u64 hist[256];
    __shared__ u64 sh[2];
    __shared__ u64 total_sh;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        Online none = {NEG_INF, 0.0f, 0.0f};
        int ybad = 0;
        const unsigned id = race_row<false>(logits + row * vocab, vocab, inv_t, top_k, top_p, min_p,
                                            keys + row * 5, 0.0f, none, ybad, shf, shi, hist, sh,
                                            &total_sh);
        if (threadIdx.x == 0) out[row] = id;
    }
}

// ---------------------------------------------------------------------------------------
// A decode step's pick in one launch (Backend::pick_tokens on CUDA): each row's token —
// greedy (argmax_rows) or drawn (sample_race), the same device code and so the same ids —
// with its log-prob and the entropy of softmax(x·lp_inv_t), from the online softmax state
// gathered while the pick reads the row: one read of the logits from memory where the three
// kernels it replaces (pick, log_prob_entropy_f32, pack_picks) made two. The formulas and the
// NaN outputs / status bits of bad rows are log_prob_entropy_row's; its thread mapping is
// the pick's, so the sums' order (not the arithmetic) differs from that kernel's.
//
// Writes the ids to `ids` (the next step's input) and the words that cross to the host to
// `packed` (ids, log-prob bits, entropy bits, then the status word); the last block to finish
// moves the status word there and clears it, every kernel that can set it having run before
// (this one's blocks included: each fences its writes before counting itself done).
extern "C" __global__ void pick_rows(const float* __restrict__ logits, i64 vocab, i64 rows,
                                     int sample, float inv_t, unsigned top_k, float top_p,
                                     float min_p, const unsigned* __restrict__ keys, float lp_inv_t,
                                     unsigned* __restrict__ ids, unsigned* status,
                                     unsigned* blocks_done, unsigned* __restrict__ packed) {
    __shared__ float shf[32];
    __shared__ unsigned shi[32];
    __shared__ i64 shl[32];
    __shared__ u64 hist[256];
    __shared__ u64 sh[2];
    __shared__ u64 total_sh;
    __shared__ Online shs[32];
    __shared__ bool is_last;
    const float scale = lp_inv_t * LOG2E;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* x = logits + row * vocab;
        Online st = {NEG_INF, 0.0f, 0.0f};
        int ybad = 0;
        const unsigned id =
            sample ? race_row<true>(x, vocab, inv_t, top_k, top_p, min_p, keys + row * 5, scale, st,
                                    ybad, shf, shi, hist, sh, &total_sh)
                   : argmax_row<true>(x, vocab, scale, st, ybad, shf, shl);
        // the block's state (log_prob_entropy_row's merge)
        st = warp_merge(st);
        ybad = __syncthreads_or(ybad);
        if (lane == 0) shs[warp] = st;
        __syncthreads();
        if (warp == 0) {
            Online w = lane < warps ? shs[lane] : Online{NEG_INF, 0.0f, 0.0f};
            w = warp_merge(w);
            if (lane == 0) {  // thread 0, which holds the id
                unsigned lp_bits = 0x7fffffffu, h_bits = 0x7fffffffu;
                if (ybad || w.m == NEG_INF) {
                    atomicOr(status, ST_BAD_ROW);
                } else {
                    const float log2_s = log2_approx(w.s);
                    const float h = LN2 * (log2_s - w.u / w.s);
                    h_bits = __float_as_uint(h > 0.0f ? h : 0.0f);
                    const float yt = id < vocab ? x[id] * scale : NEG_INF;
                    if (yt == NEG_INF) atomicOr(status, ST_BAD_TARGET);
                    else lp_bits = __float_as_uint(LN2 * ((yt - w.m) - log2_s));
                }
                ids[row] = id;
                packed[row] = id;
                packed[rows + row] = lp_bits;
                packed[2 * rows + row] = h_bits;
            }
        }
        __syncthreads();  // shs is reused by the next row
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(blocks_done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (is_last && threadIdx.x == 0) {
        __threadfence();
        packed[3 * rows] = atomicExch(status, 0u);
        *blocks_done = 0u;
    }
}

// ---------------------------------------------------------------------------------------
// Log-prob and entropy backward from 16-bit logits (bf16, or IEEE half bits), fused, the
// gradient in the logits' dtype: per row the f32 gradient of both outputs is formed from the
// widened logits by the operations of log_prob_bwd then entropy_bwd, in their order, and
// rounded to nearest once (so it is the f32 kernels' result on the widened logits, rounded).
// `targets` or `lp_coeffs` NULL: no log-prob part; `ent_coeffs` NULL: no entropy part. A row
// whose coefficients are both 0 is zero and not read; a bad row is NaN, with the status bits
// the two f32 kernels would set.
__device__ __forceinline__ float half_bits_to_f32(unsigned short x, bool bf16) {
    return bf16 ? __uint_as_float((unsigned int)x << 16) : f16_bits_to_f32(x);
}

__device__ __forceinline__ unsigned short f32_to_half_bits(float x, bool bf16) {
    if (bf16) return bf16_rne(x);
#ifdef ARES_EMULATE
    const _Float16 h = (_Float16)x;
    unsigned short y;
    memcpy(&y, &h, 2);
    return y;
#else
    unsigned short y;
    asm("{ .reg .f16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(y) : "f"(x));
    return y;
#endif
}

template <bool BF16>
__device__ __forceinline__ void log_prob_entropy_bwd_16(
    const unsigned short* __restrict__ logits, i64 vocab, float inv_t,
    const unsigned* __restrict__ targets, const float* __restrict__ lp_coeffs,
    const float* __restrict__ ent_coeffs, i64 rows, unsigned short* __restrict__ dlogits,
    unsigned* __restrict__ status) {
    __shared__ double shd[32];
    __shared__ float shf[32];
    const float scale = inv_t * LOG2E;
    const unsigned short nan16 = f32_to_half_bits(NAN_F, BF16);
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const unsigned short* x = logits + row * vocab;
        unsigned short* out = dlogits + row * vocab;
        const float c = (targets && lp_coeffs) ? lp_coeffs[row] : 0.0f;
        const float ce = ent_coeffs ? ent_coeffs[row] : 0.0f;
        const unsigned id = c != 0.0f ? targets[row] : 0u;
        if (c == 0.0f && ce == 0.0f) {
            for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) out[i] = 0;
            continue;
        }
        // each part's own checks, as its f32 kernel makes them (block-uniform)
        unsigned lp_bad = 0, ent_bad = 0;
        if (c != 0.0f) {
            if (!is_finite(c)) lp_bad = ST_BAD_COEFF;
            else if ((i64)id >= vocab) lp_bad = ST_BAD_TARGET;
        }
        if (ce != 0.0f && !is_finite(ce)) ent_bad = ST_BAD_COEFF;
        const bool lp_on = c != 0.0f && lp_bad == 0, ent_on = ce != 0.0f && ent_bad == 0;
        float m = NEG_INF;
        if (lp_on || ent_on) {
            int bad = 0;
            for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float y = half_bits_to_f32(x[i], BF16) * scale;
                bad |= !(y < POS_INF);
                m = fmaxf(m, y);
            }
            bad = __syncthreads_or(bad);
            m = block_max(m, shf);
            if (bad || m == NEG_INF) {
                if (lp_on) lp_bad = ST_BAD_ROW;
                if (ent_on) ent_bad = ST_BAD_ROW;
            } else if (lp_on && half_bits_to_f32(x[id], BF16) == NEG_INF) {
                lp_bad = ST_BAD_TARGET;
            }
        }
        const bool lp_go = lp_on && lp_bad == 0, ent_go = ent_on && ent_bad == 0;
        float k = 0.0f, g = 0.0f, kf = 0.0f, mean_d = 0.0f;
        if (lp_go || ent_go) {
            float acc = 0.0f, s = 0.0f, u = 0.0f;
            for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float xi = half_bits_to_f32(x[i], BF16);
                if (lp_go) acc += exp2f(xi * scale - m);
                if (ent_go) {
                    const float d = entropy_bwd_d(xi, scale, m);
                    const float e = entropy_bwd_e(d);
                    s += e;
                    u += e * d;
                }
            }
            if (lp_go) {
                const double total = block_sum_d((double)acc, shd);
                g = c * inv_t;
                k = (float)(-(double)g / total);
            }
            if (ent_go) {
                const double s_total = block_sum_d((double)s, shd);
                const double u_total = block_sum_d((double)u, shd);
                mean_d = (float)(u_total / s_total);
                const double kd = -(double)ce * 0.6931471805599453 * (double)inv_t / s_total;
                if (fabs(kd) * 128.0 <= 3.4028234663852886e38) kf = (float)kd;
                else ent_bad = ST_BAD_COEFF;
            }
        }
        if ((lp_bad | ent_bad) == 0) {
            for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float xi = half_bits_to_f32(x[i], BF16);
                float v = 0.0f;
                if (lp_go) {
                    v = exp2f(xi * scale - m) * k;
                    if (i == (i64)id) v += g;
                }
                if (ent_go) {
                    const float d = entropy_bwd_d(xi, scale, m);
                    v += kf * entropy_bwd_e(d) * (d - mean_d);
                }
                out[i] = f32_to_half_bits(v, BF16);
            }
            continue;
        }
        for (i64 i = threadIdx.x; i < vocab; i += blockDim.x) out[i] = nan16;
        if (threadIdx.x == 0) atomicOr(status, lp_bad | ent_bad);
    }
}

extern "C" __global__ void log_prob_entropy_bwd_bf16(
    const unsigned short* __restrict__ logits, i64 vocab, float inv_t,
    const unsigned* __restrict__ targets, const float* __restrict__ lp_coeffs,
    const float* __restrict__ ent_coeffs, i64 rows, unsigned short* __restrict__ dlogits,
    unsigned* __restrict__ status) {
    log_prob_entropy_bwd_16<true>(logits, vocab, inv_t, targets, lp_coeffs, ent_coeffs, rows,
                                  dlogits, status);
}

extern "C" __global__ void log_prob_entropy_bwd_f16(
    const unsigned short* __restrict__ logits, i64 vocab, float inv_t,
    const unsigned* __restrict__ targets, const float* __restrict__ lp_coeffs,
    const float* __restrict__ ent_coeffs, i64 rows, unsigned short* __restrict__ dlogits,
    unsigned* __restrict__ status) {
    log_prob_entropy_bwd_16<false>(logits, vocab, inv_t, targets, lp_coeffs, ent_coeffs, rows,
                                   dlogits, status);
}

// ---------------------------------------------------------------------------------------
// Σ x² in f64 of several tensors at once, deterministic: stage 1 sums fixed chunks (a
// tensor's block b: its elements [b·chunk, (b+1)·chunk)) with a fixed thread mapping and
// tree; stage 2 adds each tensor's partials in one block. A tensor's partition depends only
// on its own length, so its sum depends neither on the GPU nor on the other tensors. Stage 2
// also hands the status word to the host in the same read (and clears it), so the gradient
// norm of a whole model costs one wait.
struct SumSqTensor {
    const void* x;  // f32 values, or bf16 bits (a gradient stored in bf16)
    i64 n;          // elements, >= 1
    i64 chunk;      // elements per block of stage 1
    i64 first;      // its first partial (and block of stage 1); ascending over the table
    i64 bf16;       // 1: x holds bf16 bits, widened exactly
};

extern "C" __global__ void sum_sq_multi_partial(const SumSqTensor* __restrict__ tensors,
                                                int count, double* __restrict__ partials) {
    __shared__ double sh[32];
    // the block's tensor: the last whose first partial is at most blockIdx.x
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tensors[mid].first <= (i64)blockIdx.x) lo = mid;
        else hi = mid - 1;
    }
    const SumSqTensor t = tensors[lo];
    const i64 start = ((i64)blockIdx.x - t.first) * t.chunk;
    const i64 end = start + t.chunk < t.n ? start + t.chunk : t.n;
    double acc = 0.0;
    if (t.bf16) {
        const unsigned short* x = (const unsigned short*)t.x;
        for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
            const double v = (double)widen(x[i]);
            acc += v * v;
        }
    } else {
        const float* x = (const float*)t.x;
        for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
            const double v = (double)x[i];
            acc += v * v;
        }
    }
    const double s = block_sum_d(acc, sh);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// One block per tensor: out[t] = its partials' sum; out[count] = the status word (cleared).
extern "C" __global__ void sum_sq_multi_final(const SumSqTensor* __restrict__ tensors,
                                              int count, const double* __restrict__ partials,
                                              unsigned* __restrict__ status,
                                              double* __restrict__ out) {
    __shared__ double sh[32];
    const SumSqTensor t = tensors[blockIdx.x];
    const i64 blocks = (t.n + t.chunk - 1) / t.chunk;
    double acc = 0.0;
    for (i64 i = threadIdx.x; i < blocks; i += blockDim.x) acc += partials[t.first + i];
    const double s = block_sum_d(acc, sh);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = s;
        if (blockIdx.x == 0) out[count] = (double)atomicExch(status, 0u);
    }
}

// ---------------------------------------------------------------------------------------
// AdamW (torch.optim.AdamW, single-tensor path), in place, in two launches: adamw_check
// sets *guard when a gradient is NaN/±inf (and ST_BAD_GRAD), then adamw_update does
// nothing if *guard is set, so a bad gradient changes nothing (as on the CPU). Per element,
// the CPU's order with separately rounded operations:
//   g ← g·scale;  θ ← θ·decay;  m ← m + w1·(g − m)  (or g − (g − m)·(1 − w1) for w1 ≥ ½)
//   v ← v·β2 + (w2·g)·g;  θ ← θ + step·(m / (√v / bc2 + ε))
// With `copy` (not NULL) the update also writes θ rounded to the nearest bf16 (the model's bf16
// weight copy: the bits of f32_to_bf16 after the step, without its pass over θ).
// With `param_bf16` (not NULL; `param` is then NULL) the weight is stored in bf16: θ is read
// widened and written back rounded stochastically with rounding_bits(key, i) — the bits of
// bf16_to_f32, the f32 update and f32_to_bf16_stochastic in one pass instead of three.
// With `grad_bf16` (not NULL; `grad` is then NULL) the gradient is stored in bf16 and read
// widened (exact): the update of its widened values without an f32 copy of them.
__device__ __forceinline__ float grad_load(const float* grad, const unsigned short* grad_bf16,
                                           i64 i) {
    return grad_bf16 ? widen(grad_bf16[i]) : grad[i];
}

extern "C" __global__ void adamw_check(const float* __restrict__ grad, i64 n,
                                       unsigned* __restrict__ guard, unsigned* __restrict__ status,
                                       const unsigned short* __restrict__ grad_bf16) {
    int bad = 0;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        bad |= !is_finite(grad_load(grad, grad_bf16, i));
    bad = __syncthreads_or(bad);
    if (bad && threadIdx.x == 0) {
        atomicOr(guard, 1u);
        atomicOr(status, ST_BAD_GRAD);
    }
}

// One element's update (the order above). `m` and `v` are the stored moments read as f32;
// they come back updated.
struct AdamConsts {
    float grad_scale, decay, w1, one_minus_w1, b2, w2, neg_step_size, bc2_sqrt, eps;
    int apply_decay;
};

__device__ __forceinline__ float adamw_element(float p, float g, float& m, float& v, const AdamConsts& k) {
    if (k.grad_scale != 1.0f) g = __fmul_rn(g, k.grad_scale);
    if (k.apply_decay) p = __fmul_rn(p, k.decay);
    m = k.w1 < 0.5f ? __fadd_rn(m, __fmul_rn(k.w1, __fsub_rn(g, m)))
                    : __fsub_rn(g, __fmul_rn(__fsub_rn(g, m), k.one_minus_w1));
    v = __fadd_rn(__fmul_rn(v, k.b2), __fmul_rn(__fmul_rn(k.w2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bc2_sqrt), k.eps);
    return __fadd_rn(p, __fmul_rn(k.neg_step_size, __fdiv_rn(m, denom)));
}

// A moment as stored: f32, or bf16 bits rounded stochastically, element i drawing
// rounding_bits(key, i) of its stream's key (twin of ares_cpu's Moment::store).
__device__ __forceinline__ void moment_store(float* p, unsigned long long, i64, float x) { *p = x; }
__device__ __forceinline__ void moment_store(unsigned short* p, unsigned long long key, i64 i, float x) {
    *p = bf16_stochastic(x, rounding_bits(key, (unsigned long long)i));
}
// The moments' streams of an update keyed `key` (ares_cpu::ops::precision::moment_keys).
#define MOMENT_M_STREAM 0x6D5F6D6F6D656E74ull
#define MOMENT_V_STREAM 0x765F6D6F6D656E74ull

// The parameter as stored: f32, or bf16 bits (read widened, written back with stochastic
// rounding under `key`, element i drawing rounding_bits(key, i)).
__device__ __forceinline__ float param_load(const float* param, const unsigned short* param_bf16,
                                            i64 i) {
    return param_bf16 ? widen(param_bf16[i]) : param[i];
}
__device__ __forceinline__ void param_store(float* param, unsigned short* param_bf16,
                                            unsigned long long key, i64 i, float p) {
    if (param_bf16) param_bf16[i] = bf16_stochastic(p, rounding_bits(key, (unsigned long long)i));
    else param[i] = p;
}

template <typename M>
__device__ __forceinline__ void adamw_update_impl(float* __restrict__ param, const float* __restrict__ grad,
                                                  M* __restrict__ exp_avg, M* __restrict__ exp_avg_sq,
                                                  i64 n, float grad_scale, float decay, int apply_decay,
                                                  float w1, float one_minus_w1, float b2, float w2,
                                                  float neg_step_size, float bc2_sqrt, float eps,
                                                  const unsigned* __restrict__ guard,
                                                  unsigned short* __restrict__ copy,
                                                  unsigned short* __restrict__ param_bf16,
                                                  unsigned long long key,
                                                  const unsigned short* __restrict__ grad_bf16) {
    if (*guard) return;
    const AdamConsts k = {grad_scale, decay, w1, one_minus_w1, b2, w2, neg_step_size, bc2_sqrt, eps, apply_decay};
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float m = widen(exp_avg[i]);
        float v = widen(exp_avg_sq[i]);
        const float g = grad_load(grad, grad_bf16, i);
        const float p = adamw_element(param_load(param, param_bf16, i), g, m, v, k);
        param_store(param, param_bf16, key, i, p);
        if (copy) copy[i] = bf16_rne(p);  // the model's bf16 copy, written with the update
        moment_store(&exp_avg[i], key ^ MOMENT_M_STREAM, i, m);
        moment_store(&exp_avg_sq[i], key ^ MOMENT_V_STREAM, i, v);
    }
}

extern "C" __global__ void adamw_update(float* __restrict__ param, const float* __restrict__ grad,
                                        float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                                        i64 n, float grad_scale, float decay, int apply_decay,
                                        float w1, float one_minus_w1, float b2, float w2,
                                        float neg_step_size, float bc2_sqrt, float eps,
                                        const unsigned* __restrict__ guard,
                                        unsigned short* __restrict__ copy,
                                        unsigned short* __restrict__ param_bf16,
                                        unsigned long long key,
                                        const unsigned short* __restrict__ grad_bf16) {
    adamw_update_impl(param, grad, exp_avg, exp_avg_sq, n, grad_scale, decay, apply_decay, w1,
                      one_minus_w1, b2, w2, neg_step_size, bc2_sqrt, eps, guard, copy,
                      param_bf16, key, grad_bf16);
}

// AdamW with bf16 moments: the same update, the moments rounded back after it
// stochastically under `key`'s moment streams (also the key of a bf16 `param_bf16`).
extern "C" __global__ void adamw_update_bf16(float* __restrict__ param, const float* __restrict__ grad,
                                             unsigned short* __restrict__ exp_avg,
                                             unsigned short* __restrict__ exp_avg_sq, i64 n,
                                             float grad_scale, float decay, int apply_decay, float w1,
                                             float one_minus_w1, float b2, float w2,
                                             float neg_step_size, float bc2_sqrt, float eps,
                                             const unsigned* __restrict__ guard,
                                             unsigned short* __restrict__ copy,
                                             unsigned short* __restrict__ param_bf16,
                                             unsigned long long key,
                                             const unsigned short* __restrict__ grad_bf16) {
    adamw_update_impl(param, grad, exp_avg, exp_avg_sq, n, grad_scale, decay, apply_decay, w1,
                      one_minus_w1, b2, w2, neg_step_size, bc2_sqrt, eps, guard, copy,
                      param_bf16, key, grad_bf16);
}

// AdamW with 8-bit moments (twin of ares_cpu::ops::optim_int8::adamw_step_int8): one block
// of Q8_THREADS threads per quantisation block of Q8_BLOCK elements. Each element's moments
// are read back (map[code]·absmax), updated as adamw_element does, and quantised again with
// the block's new absmax: s = clamp(x·(1/max(absmax, 1e-38)), −1, 1), code = the number of
// map midpoints below s (nearest value, ties low). `maps` holds the signed map (first
// moment) then the unsigned one (second), 256 ascending values each.
#define Q8_BLOCK 2048
#define Q8_THREADS 256
#define Q8_PER_THREAD (Q8_BLOCK / Q8_THREADS)

__device__ __forceinline__ unsigned char q8_code(const float* mids, float s) {
    int lo = 0, hi = 255;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (mids[mid] < s) lo = mid + 1;
        else hi = mid;
    }
    return (unsigned char)lo;
}

extern "C" __global__ void __launch_bounds__(Q8_THREADS)
adamw_update_int8(float* __restrict__ param, const float* __restrict__ grad,
                  unsigned char* __restrict__ m_codes, unsigned char* __restrict__ v_codes,
                  float* __restrict__ m_absmax, float* __restrict__ v_absmax,
                  const float* __restrict__ maps, i64 n, float grad_scale, float decay,
                  int apply_decay, float w1, float one_minus_w1, float b2, float w2,
                  float neg_step_size, float bc2_sqrt, float eps,
                  const unsigned* __restrict__ guard, unsigned short* __restrict__ copy,
                  unsigned short* __restrict__ param_bf16, unsigned long long key,
                  const unsigned short* __restrict__ grad_bf16) {
    __shared__ float map_m[256], map_v[256], mid_m[255], mid_v[255], sh[32];
    if (*guard) return;
    const AdamConsts k = {grad_scale, decay, w1, one_minus_w1, b2, w2, neg_step_size, bc2_sqrt, eps, apply_decay};
    const int t = threadIdx.x;
    map_m[t] = maps[t];
    map_v[t] = maps[256 + t];
    __syncthreads();
    if (t < 255) {
        mid_m[t] = __fmul_rn(__fadd_rn(map_m[t], map_m[t + 1]), 0.5f);
        mid_v[t] = __fmul_rn(__fadd_rn(map_v[t], map_v[t + 1]), 0.5f);
    }
    const i64 base = (i64)blockIdx.x * Q8_BLOCK;
    const float am = m_absmax[blockIdx.x], av = v_absmax[blockIdx.x];
    float ms[Q8_PER_THREAD], vs[Q8_PER_THREAD];
    float m_max = 0.0f, v_max = 0.0f;
#pragma unroll
    for (int j = 0; j < Q8_PER_THREAD; ++j) {
        const i64 i = base + (i64)j * Q8_THREADS + t;
        ms[j] = 0.0f;
        vs[j] = 0.0f;
        if (i < n) {
            float m = __fmul_rn(map_m[m_codes[i]], am);
            float v = __fmul_rn(map_v[v_codes[i]], av);
            const float g = grad_load(grad, grad_bf16, i);
            const float p = adamw_element(param_load(param, param_bf16, i), g, m, v, k);
            param_store(param, param_bf16, key, i, p);
            if (copy) copy[i] = bf16_rne(p);
            ms[j] = m;
            vs[j] = v;
            m_max = fmaxf(m_max, fabsf(m));
            v_max = fmaxf(v_max, fabsf(v));
        }
    }
    // block_max's barriers also publish the midpoints
    const float new_am = block_max(m_max, sh);
    const float new_av = block_max(v_max, sh);
    const float inv_m = __fdiv_rn(1.0f, fmaxf(new_am, 1e-38f));
    const float inv_v = __fdiv_rn(1.0f, fmaxf(new_av, 1e-38f));
#pragma unroll
    for (int j = 0; j < Q8_PER_THREAD; ++j) {
        const i64 i = base + (i64)j * Q8_THREADS + t;
        if (i < n) {
            m_codes[i] = q8_code(mid_m, fminf(fmaxf(__fmul_rn(ms[j], inv_m), -1.0f), 1.0f));
            v_codes[i] = q8_code(mid_v, fminf(fmaxf(__fmul_rn(vs[j], inv_v), -1.0f), 1.0f));
        }
    }
    if (t == 0) {
        m_absmax[blockIdx.x] = new_am;
        v_absmax[blockIdx.x] = new_av;
    }
}

// ---------------------------------------------------------------------------------------
// KV cache append: cache[b, len + i, :] = new[b, i, :] for keys and values, with `tok` =
// kv_heads·head_dim elements per token slot.
extern "C" __global__ void kv_append(const float* __restrict__ k_new, const float* __restrict__ v_new,
                                     i64 batch, i64 seq, i64 tok, i64 max_len, i64 len,
                                     float* __restrict__ k_cache, float* __restrict__ v_cache) {
    const i64 per_seq = seq * tok;
    const i64 n = batch * per_seq;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 b = i / per_seq, rem = i - b * per_seq;
        const i64 dst = b * max_len * tok + len * tok + rem;
        k_cache[dst] = k_new[i];
        v_cache[dst] = v_new[i];
    }
}

// Paged KV cache append: token i of sequence b goes to slot s = lens[b] + i, pool row
// tables[b, s / block_size] · block_size + s % block_size (`tok` elements per row), stored as
// the pool's type (f32, or bf16 rounded to nearest even). A block id past the pool is skipped
// and reported (ST_BAD_ID).
template <typename KV>
__device__ __forceinline__ void paged_kv_append_impl(const float* __restrict__ k_new,
                                                     const float* __restrict__ v_new, i64 batch,
                                                     i64 seq, i64 tok,
                                                     const unsigned* __restrict__ tables,
                                                     const unsigned* __restrict__ lens,
                                                     i64 block_size, i64 max_blocks,
                                                     i64 pool_blocks, KV* __restrict__ k_cache,
                                                     KV* __restrict__ v_cache,
                                                     unsigned* __restrict__ status) {
    const i64 per_seq = seq * tok;
    const i64 n = batch * per_seq;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 b = i / per_seq, rem = i - b * per_seq;
        const i64 t = rem / tok, c = rem - t * tok;
        const i64 s = (i64)lens[b] + t;
        const unsigned id = tables[b * max_blocks + s / block_size];
        if ((i64)id >= pool_blocks) {
            atomicOr(status, ST_BAD_ID);
            continue;
        }
        const i64 dst = ((i64)id * block_size + s % block_size) * tok + c;
        store_narrow(k_cache + dst, k_new[i]);
        store_narrow(v_cache + dst, v_new[i]);
    }
}

#define PAGED_KV_APPEND(NAME, KV)                                                              \
    extern "C" __global__ void NAME(const float* __restrict__ k_new,                           \
                                    const float* __restrict__ v_new, i64 batch, i64 seq,       \
                                    i64 tok, const unsigned* __restrict__ tables,              \
                                    const unsigned* __restrict__ lens, i64 block_size,         \
                                    i64 max_blocks, i64 pool_blocks, KV* __restrict__ k_cache, \
                                    KV* __restrict__ v_cache, unsigned* __restrict__ status) { \
        paged_kv_append_impl<KV>(k_new, v_new, batch, seq, tok, tables, lens, block_size,      \
                                 max_blocks, pool_blocks, k_cache, v_cache, status);           \
    }

PAGED_KV_APPEND(paged_kv_append, float)
PAGED_KV_APPEND(paged_kv_append_bf16, unsigned short)

// ---------------------------------------------------------------------------------------
// Attention: causal GQA with a key mask, FlashAttention-style online softmax, f32.
//
// Rows are (query token t, query head h); the rows of one sequence b and kv head g are
// numbered r = t·group + (h − g·group), so consecutive rows share a query token. A block
// (NW warps) takes ROWS = NW·RW consecutive rows of one (b, g); each warp keeps RW rows'
// softmax state in registers, lane ℓ holding dims ℓ, ℓ+32, … (DPL = dims per lane). Keys
// come in tiles of 32 through shared memory: lane j scores key j of the tile (its
// q·k over the head dims), the warp reduces max and sum with shuffles, and each lane adds
// p_j·v_j for its dims. Key s is visible to the row of query t iff s ≤ pos0 + t and
// mask[b, s] = 1 (pos0 = 0 in training; the query's cache slot offset in decoding).
//
// Layouts: q/out [B, q_seq, Hq, D], k/v [B, kv_seq, Hkv, D] (kv_seq = q_seq in training,
// the cache's max_len in decoding), mask [B, kv_seq], lse [B, q_seq, Hq]. Rows without a
// visible key: out 0, lse −inf. A visible non-finite score: out and lse NaN.
//
// Paged decoding (`tables` not NULL): k/v are a pool [blocks, block_size, Hkv, D], key s of
// sequence b is pool row tables[b, s / block_size] · block_size + s % block_size, the first
// query of sequence b sits at slot lens[b] (its own pos0), and there is no mask.

#define NW 8
#define KT 32

struct AttnArgs {
    const float* q;
    const float* k;
    const float* v;
    const float* mask;
    i64 batch, q_seq, kv_seq, pos0;
    int hq, hkv, d;
    float scale;
    const unsigned* tables;  // paged: [batch, max_blocks] block ids; NULL: contiguous k/v
    const unsigned* lens;    // paged: [batch] slots before the new queries
    i64 block_size, max_blocks, pool_blocks;
    const unsigned short* k16;  // paged in bf16: the pools as bf16 bits (k, v unused); else NULL
    const unsigned short* v16;
    const unsigned* cu;         // segment attention (tensor-core kernels): [segments + 1] offsets
    int segments;
    float* split_ws;            // split-K paged decoding (q_seq = 1): partial states; else NULL
    const unsigned short* q16;  // tensor-core training kernels over activations stored in
                                // bf16: q as bf16 bits (q unused; k16/v16 then hold k and v,
                                // contiguous); else NULL
};

// Split-K (flash-decoding) for paged decoding: a sequence's keys are cut into split_count
// chunks of whole key tiles, each attended by its own block — so a few long sequences still
// fill the GPU — and attention_split_combine merges the chunks' softmax states. The plan is a
// function of the sequence's own length, never of the batch: a sequence's output bits do not
// depend on which sequences share its step. One chunk (up to SPLIT_MIN_KEYS keys) is the
// unsplit kernel, writing its output directly, to the bit.
#define SPLIT_MIN_KEYS 512
#define SPLIT_MAX 16

__device__ __forceinline__ int split_count(i64 key_end) {
    const i64 n = (key_end + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS;
    return n < 1 ? 1 : n > SPLIT_MAX ? SPLIT_MAX : (int)n;
}

// Keys a chunk covers: ⌈key_end / n⌉ rounded up to whole tiles, so the chunks' tiles are the
// unsplit kernel's. In 32 bits (lengths are u32 slots; a 64-bit division is a called
// routine whose frame would spill).
__device__ __forceinline__ i64 split_chunk(i64 key_end, int n) {
    const unsigned c = ((unsigned)key_end + (unsigned)n - 1u) / (unsigned)n;
    return (i64)((c + KT - 1u) / KT * KT);
}

// Segment attention on the tensor-core kernels (SEG): batch 1, q_seq = kv_seq = tokens,
// hq = hkv = heads, and token t sees the keys of its segment [lo, hi) — vision_ops.cu's
// segment_of and check_offsets over the same offsets.
__device__ __forceinline__ void seg_bounds(const AttnArgs& a, i64 t, i64& lo, i64& hi) {
    int l = 0, h = a.segments;
    while (h - l > 1) {
        const int m = (l + h) >> 1;
        if ((i64)a.cu[m] <= t) l = m; else h = m;
    }
    lo = (i64)a.cu[l] < a.q_seq ? (i64)a.cu[l] : a.q_seq;
    hi = (i64)a.cu[l + 1] < a.q_seq ? (i64)a.cu[l + 1] : a.q_seq;
    if (hi < lo) hi = lo;
}

__device__ __forceinline__ void seg_check_offsets(const AttnArgs& a, unsigned* status) {
    if (blockIdx.x != 0) return;
    bool bad = false;
    for (int i = threadIdx.x; i <= a.segments; i += blockDim.x) {
        const unsigned c = a.cu[i];
        if (i == 0 && c != 0u) bad = true;
        if (i > 0 && c < a.cu[i - 1]) bad = true;
        if (i == a.segments && (i64)c != a.q_seq) bad = true;
    }
    if (bad) atomicOr(status, ST_BAD_SEGMENTS);
}

// Packed sequences in the decoder's causal tensor-core kernels (`cu` set in a kernel that is
// not SEG's: batch 1 of q_seq tokens cut by cu_seqlens): sequence b is segment b, attended as a
// sequence of its own — rows from its first token, positions and key tiles from 0, as the
// CPU's spans (the CPU twin's tiling) — so a segment's numbers are those of the same
// sequence alone. The blocks walk segments × kv heads × the longest segment's tiles; a
// tile past its segment's end is skipped. Offsets out of order raise ST_BAD_SEGMENTS and
// are clamped, so no access leaves the tokens.
struct SeqSpan {
    i64 qb, kvb, len;  // first query row and first key row in q/k/v; tokens
};

__device__ __forceinline__ SeqSpan seq_span(const AttnArgs& a, i64 b, bool packed) {
    if (!packed) return {b * a.q_seq, b * a.kv_seq, a.q_seq};
    const i64 lo = (i64)a.cu[b] < a.q_seq ? (i64)a.cu[b] : a.q_seq;
    const i64 hi = (i64)a.cu[b + 1] < a.q_seq ? (i64)a.cu[b + 1] : a.q_seq;
    return {lo, lo, hi > lo ? hi - lo : 0};
}

// Sequences, and the tokens of the longest (packed: a scan of the offsets).
__device__ __forceinline__ i64 seq_count(const AttnArgs& a, bool packed) {
    return packed ? a.segments : a.batch;
}
__device__ __forceinline__ i64 longest_seq(const AttnArgs& a, bool packed) {
    if (!packed) return a.q_seq;
    i64 longest = 0;
    for (int i = 0; i < a.segments; i++) {
        const SeqSpan sp = seq_span(a, i, true);
        longest = sp.len > longest ? sp.len : longest;
    }
    return longest;
}

// Slot of sequence b's first query.
__device__ __forceinline__ i64 seq_pos0(const AttnArgs& a, i64 b) {
    return a.tables ? (i64)a.lens[b] : a.pos0;
}

// Row of key s of sequence b in k/v (-1 and ST_BAD_ID for a block id past the pool).
// `kvb`: the sequence's first key row in contiguous k/v (seq_span).
__device__ __forceinline__ i64 key_row(const AttnArgs& a, i64 b, i64 kvb, i64 s, unsigned* status) {
    if (!a.tables) return kvb + s;
    const unsigned id = a.tables[b * a.max_blocks + s / a.block_size];
    if ((i64)id >= a.pool_blocks) {
        atomicOr(status, ST_BAD_ID);
        return -1;
    }
    return (i64)id * a.block_size + s % a.block_size;
}

__device__ __forceinline__ float key_valid(const float* mask, i64 idx, unsigned* status) {
    if (!mask) return 1.0f;
    const float m = mask[idx];
    if (m != 0.0f && m != 1.0f) atomicOr(status, ST_BAD_MASK);
    return m == 1.0f ? 1.0f : 0.0f;
}

// One past the last key a tile of query rows sees: the keys up to the position of its last
// valid row (`last_row` clamped to the `rows_bg` rows of the (batch, kv-head) group).
__device__ __forceinline__ i64 causal_key_end(i64 pos0, i64 last_row, i64 rows_bg, int group) {
    if (last_row >= rows_bg) last_row = rows_bg - 1;
    return pos0 + last_row / group + 1;
}

// Stages keys and values kb .. kb + KT - 1 of sequence b, kv head g in shared memory (rows of
// d + 1 floats, zeros past key_end) and each key's mask validity, between two block barriers.
__device__ __forceinline__ void stage_kv_tile(const AttnArgs& a, i64 b, i64 kvb, int g, i64 kb,
                                              i64 key_end, float* Ks, float* Vs, float* kvalid,
                                              unsigned* status) {
    const int d = a.d, dp = a.d + 1;
    __syncthreads();
    for (int i = threadIdx.x; i < KT * d; i += blockDim.x) {
        const int j = i / d, c = i - j * d;
        const i64 s = kb + j;
        float kv = 0.0f, vv = 0.0f;
        const i64 row = s < key_end ? key_row(a, b, kvb, s, status) : -1;
        if (row >= 0) {
            const i64 idx = (row * a.hkv + g) * d + c;
            if (a.k16) {
                kv = widen(a.k16[idx]);
                vv = widen(a.v16[idx]);
            } else {
                kv = a.k[idx];
                vv = a.v[idx];
            }
        }
        Ks[j * dp + c] = kv;
        Vs[j * dp + c] = vv;
    }
    if (threadIdx.x < KT) {
        const i64 s = kb + threadIdx.x;
        const bool inside = s < key_end && (!a.tables || a.tables[b * a.max_blocks + s / a.block_size] < a.pool_blocks);
        kvalid[threadIdx.x] = inside ? key_valid(a.mask, kvb + s, status) : 0.0f;
    }
    __syncthreads();
}

template <int DPL, int RW, bool PACKED>
__device__ __forceinline__ void attention_fwd_impl(AttnArgs a, float* __restrict__ out,
                                                   float* __restrict__ lse,
                                                   unsigned* __restrict__ status) {
    const int ROWS = NW * RW;
    ARES_DYNAMIC_SHARED(float, smem);
    const int d = a.d, dp = a.d + 1;
    float* Ks = smem;                 // [KT][d + 1]
    float* Vs = Ks + KT * dp;         // [KT][d + 1]
    float* Qs = Vs + KT * dp;         // [ROWS][d]
    __shared__ float kvalid[KT];
    const int group = a.hq / a.hkv;
    if (PACKED) seg_check_offsets(a, status);
    const i64 tiles = (longest_seq(a, PACKED) * group + ROWS - 1) / ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int splits = a.split_ws ? SPLIT_MAX : 1;

    for (i64 blk = blockIdx.x; blk < seq_count(a, PACKED) * a.hkv * tiles * splits; blk += gridDim.x) {
        // split fastest (a constant power of two: no division routine)
        const int split = a.split_ws ? (int)(blk % SPLIT_MAX) : 0;
        const i64 rest = a.split_ws ? blk / SPLIT_MAX : blk;
        // 32-bit: the host keeps batch · kv heads · tiles below 2^32 (a 64-bit division is
        // a called routine, whose frame spilled)
        const unsigned tile = (unsigned)rest % (unsigned)tiles;
        const unsigned bg = (unsigned)rest / (unsigned)tiles;
        const int g = (int)(bg % (unsigned)a.hkv);
        const i64 b = bg / (unsigned)a.hkv;
        const i64 row0 = (i64)tile * ROWS;
        const SeqSpan sp = seq_span(a, b, PACKED);
        const i64 rows_bg = sp.len * group;
        if (PACKED && row0 >= rows_bg) continue;  // past a segment's end (uniform)
        const i64 pos0 = seq_pos0(a, b);
        const i64 key_end = causal_key_end(pos0, row0 + ROWS - 1, rows_bg, group);
        // this block's keys: all of them, or its chunk under split-K
        i64 key_lo = 0, key_hi = key_end;
        int nsplit = 1;
        if (a.split_ws) {
            nsplit = split_count(key_end);
            if (split >= nsplit) continue;  // the whole block: b and split are uniform
            const i64 chunk = split_chunk(key_end, nsplit);
            key_lo = split * chunk;
            key_hi = key_lo + chunk < key_end ? key_lo + chunk : key_end;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < ROWS * d; i += blockDim.x) {
            const i64 r = row0 + i / d;
            float val = 0.0f;
            if (r < rows_bg) {
                const i64 t = r / group;
                const int h = g * group + (int)(r % group);
                val = a.q[((sp.qb + t) * a.hq + h) * d + i % d];
            }
            Qs[i] = val;
        }
        float m[RW], l[RW], acc[RW][DPL];
        int bad[RW];
#pragma unroll
        for (int rr = 0; rr < RW; rr++) {
            m[rr] = NEG_INF;
            l[rr] = 0.0f;
            bad[rr] = 0;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[rr][i] = 0.0f;
        }
        for (i64 kb = key_lo; kb < key_hi; kb += KT) {
            stage_kv_tile(a, b, sp.kvb, g, kb, key_hi, Ks, Vs, kvalid, status);
#pragma unroll
            for (int rr = 0; rr < RW; rr++) {
                const int lr = warp * RW + rr;
                const i64 r = row0 + lr;
                if (r >= rows_bg) continue;
                const i64 qpos = pos0 + r / group;
                const i64 s = kb + lane;
                const bool visible = s <= qpos && kvalid[lane] != 0.0f;
                float score = NEG_INF;
                if (visible) {
                    const float* qr = Qs + lr * d;
                    const float* kr = Ks + lane * dp;
                    float dot = 0.0f;
                    for (int c = 0; c < d; c++) dot = fmaf(qr[c], kr[c], dot);
                    score = a.scale * dot;
                    bad[rr] |= !is_finite(score);
                }
                const float tile_max = warp_max(visible && is_finite(score) ? score : NEG_INF);
                if (tile_max == NEG_INF) continue;
                const float m_new = fmaxf(m[rr], tile_max);
                const float alpha = expf(m[rr] - m_new);
                const float p = visible && is_finite(score) ? expf(score - m_new) : 0.0f;
                l[rr] = l[rr] * alpha + warp_sum(p);
#pragma unroll
                for (int i = 0; i < DPL; i++) acc[rr][i] *= alpha;
                for (int j = 0; j < KT; j++) {
                    const float pj = __shfl_sync(FULL, p, j);
                    if (pj == 0.0f) continue;
                    const float* vr = Vs + j * dp;
#pragma unroll
                    for (int i = 0; i < DPL; i++) {
                        const int c = lane + 32 * i;
                        if (c < d) acc[rr][i] = fmaf(pj, vr[c], acc[rr][i]);
                    }
                }
                m[rr] = m_new;
            }
        }
#pragma unroll
        for (int rr = 0; rr < RW; rr++) {
            const i64 r = row0 + warp * RW + rr;
            if (r >= rows_bg) continue;
            const i64 t = r / group;
            const int h = g * group + (int)(r % group);
            const i64 orow = (sp.qb + t) * a.hq + h;
            const bool any_bad = __any_sync(FULL, bad[rr]);
            if (nsplit > 1) {
                // the chunk's state for attention_split_combine: [m, l] per (split, row),
                // then the unnormalised sums; m NaN marks a non-finite score
                const i64 rows_all = a.batch * a.q_seq * a.hq;
                float* ml = a.split_ws + 2 * (split * rows_all + orow);
                float* sums = a.split_ws + 2 * SPLIT_MAX * rows_all + (split * rows_all + orow) * d;
                if (lane == 0) {
                    ml[0] = any_bad ? NAN_F : m[rr];
                    ml[1] = l[rr];
                }
#pragma unroll
                for (int i = 0; i < DPL; i++) {
                    const int c = lane + 32 * i;
                    if (c < d) sums[c] = acc[rr][i];
                }
                continue;
            }
            const bool empty = m[rr] == NEG_INF;
            const float inv = empty || any_bad ? 0.0f : 1.0f / l[rr];
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const int c = lane + 32 * i;
                if (c < d) out[orow * d + c] = any_bad ? NAN_F : acc[rr][i] * inv;
            }
            if (lse && lane == 0) lse[orow] = any_bad ? NAN_F : empty ? NEG_INF : m[rr] + logf(l[rr]);
        }
    }
}

#define ATTN_FWD(NAME, DPL, RW)                                                               \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                     \
        NAME(const float* q, const float* k, const float* v, const float* mask, i64 batch,    \
             i64 q_seq, i64 kv_seq, i64 pos0, int hq, int hkv, int d, float scale,             \
             const unsigned* tables, const unsigned* lens, i64 block_size, i64 max_blocks,      \
             i64 pool_blocks, float* out, float* lse, unsigned* status, float* split_ws) {      \
        AttnArgs a = {q, k, v, mask, batch, q_seq, kv_seq, pos0, hq, hkv, d, scale,           \
                      tables, lens, block_size, max_blocks, pool_blocks,                       \
                      nullptr, nullptr, nullptr, 0, split_ws};                                 \
        attention_fwd_impl<DPL, RW, false>(a, out, lse, status);                               \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(NW * 32, 2)                                  \
        packed_##NAME(const float* q, const float* k, const float* v, const float* mask,      \
                      i64 seq, int hq, int hkv, int d, float scale, float* out, float* lse,   \
                      unsigned* status, const unsigned* cu, int segments) {                   \
        AttnArgs a = {q, k, v, mask, 1, seq, seq, 0, hq, hkv, d, scale, nullptr, nullptr,    \
                      0, 0, 0, nullptr, nullptr, cu, segments, nullptr};                      \
        attention_fwd_impl<DPL, RW, true>(a, out, lse, status);                               \
    }

ATTN_FWD(attention_fwd_d64, 2, 2)
ATTN_FWD(attention_fwd_d128, 4, 2)
ATTN_FWD(attention_fwd_d256, 8, 1)

// Paged decoding over bf16 pools: the forward above with each key and value widened as it is
// staged (exact), so the output is the f32 kernel's over the rounded values; no mask, no lse.
#define ATTN_FWD_KV16(NAME, DPL, RW)                                                          \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                     \
        NAME(const float* q, const unsigned short* k16, const unsigned short* v16, i64 batch, \
             i64 q_seq, int hq, int hkv, int d, float scale, const unsigned* tables,          \
             const unsigned* lens, i64 block_size, i64 max_blocks, i64 pool_blocks,           \
             float* out, unsigned* status, float* split_ws) {                                 \
        AttnArgs a = {q, nullptr, nullptr, nullptr, batch, q_seq, pool_blocks, 0,             \
                      hq, hkv, d, scale, tables, lens, block_size, max_blocks,                \
                      pool_blocks, k16, v16, nullptr, 0, split_ws};                           \
        attention_fwd_impl<DPL, RW, false>(a, out, nullptr, status);                          \
    }

// Merges split-K chunks (attention_fwd_impl under split_ws) into the output of the paged
// decoding rows [batch, 1, hq, d] whose sequence has more than one chunk: with M the
// chunks' largest max, out = Σ e^(m_i − M)·sums_i / Σ e^(m_i − M)·l_i, chunks in order (so
// deterministic). No visible key: 0; a chunk's non-finite score: NaN. One warp a row.
extern "C" __global__ void attention_split_combine(const float* __restrict__ ws,
                                                   const unsigned* __restrict__ lens, i64 batch,
                                                   int hq, int d, float* __restrict__ out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const i64 rows_all = batch * hq;
    for (i64 row = (i64)blockIdx.x * warps + warp; row < rows_all; row += (i64)gridDim.x * warps) {
        const i64 b = row / hq;
        const int n = split_count((i64)lens[b] + 1);
        if (n == 1) continue;  // written by the forward itself
        float big = NEG_INF;
        bool bad = false;
        for (int i = 0; i < n; i++) {
            const float m = ws[2 * (i * rows_all + row)];
            bad |= m != m;
            big = fmaxf(big, m);
        }
        float total = 0.0f;
        float acc[8];  // head_dim <= 256: 8 dims a lane
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] = 0.0f;
        if (!bad && big != NEG_INF) {
            for (int i = 0; i < n; i++) {
                const float m = ws[2 * (i * rows_all + row)];
                if (m == NEG_INF) continue;
                const float w = expf(m - big);
                total = fmaf(w, ws[2 * (i * rows_all + row) + 1], total);
                const float* sums = ws + 2 * SPLIT_MAX * rows_all + (i * rows_all + row) * d;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const int c = lane + 32 * j;
                    if (c < d) acc[j] = fmaf(w, sums[c], acc[j]);
                }
            }
        }
        const float inv = bad || big == NEG_INF ? 0.0f : 1.0f / total;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int c = lane + 32 * j;
            if (c < d) out[row * d + c] = bad ? NAN_F : acc[j] * inv;
        }
    }
}

ATTN_FWD_KV16(attention_fwd_kv16_d64, 2, 2)
ATTN_FWD_KV16(attention_fwd_kv16_d128, 4, 2)
ATTN_FWD_KV16(attention_fwd_kv16_d256, 8, 1)

// ---- Tensor-core training forward: bf16 operands, f32 sums and softmax state ----
// Twin: ares_cpu::ops::attention::attention_forward_bf16 (its `tensor_core` module states
// the arithmetic). q, k, v are rounded to bf16 as they are loaded; a block of four warps
// takes MMA_ROWS query rows of one (sequence, kv head) group, 16 a warp, and walks the keys
// in tiles of MMA_KEYS from key 0 (causal: up to its last row's position). Per tile a warp
// forms its 16 × 64 scores with mma.sync m16n8k16 (f32 accumulators), updates each row's
// running max and sum, rounds the probabilities to bf16 straight from the score registers
// into the A operand of P·V (no shared memory) and accumulates its 16 × D output in f32.
// e^x is 2^(x·log₂e) by exp2_nonpositive_rn, the twin's exp to the bit.
//
// Fragments of mma.m16n8k16 (PTX ISA), lane = 4·gid + tig:
//   A 16×16: register i holds row gid + 8·(i % 2), columns 8·(i / 2) + 2·tig + {0, 1}
//   B 16×8:  register i holds k = 8·i + 2·tig + {0, 1}, column n = gid
//   C 16×8:  element e is row gid + 8·(e / 2), column 2·tig + e % 2
// (ares-cuda/src/mma.rs holds the same maps and emulates this kernel's indexing with them.)
// Shared memory: keys [MMA_KEYS][D + 8] and values transposed [D][MMA_KEYS + 8] as bf16
// bits; the 8 halves of padding put the eight row groups of a fragment load on distinct
// banks.

#define MMA_WARPS 4
#define MMA_ROWS 64
#define MMA_KEYS 64

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return (unsigned)bf16_rne(lo) | ((unsigned)bf16_rne(hi) << 16);
}

// Element idx of a tensor as bf16 bits: stored in bf16 (h, as they are), else f32 (f, rounded
// to nearest even) — one rounding either way, so both give the same bits for the same values.
__device__ __forceinline__ unsigned short bf16_at(const float* f, const unsigned short* h, i64 idx) {
    return h ? h[idx] : bf16_rne(f[idx]);
}

// Elements idx and idx + 1 of such a tensor, packed as an mma operand pair.
__device__ __forceinline__ unsigned bf16x2_at(const float* f, const unsigned short* h, i64 idx) {
    return (unsigned)bf16_at(f, h, idx) | ((unsigned)bf16_at(f, h, idx + 1) << 16);
}

// c += a·b on the tensor cores (sm_80 and later; the host refuses older devices).
__device__ __forceinline__ void mma_bf16_16816(float c[4], const unsigned a[4], unsigned b0,
                                               unsigned b1) {
#if defined(ARES_EMULATE)
    emu_mma_bf16_16816(c, a, b0, b1);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// acc[nd] += rnd(C)·B over the 16-column k-steps of a score tile held as NB 8-column C
// fragments (the next product's A operand: blocks 2·kk and 2·kk + 1 are k-step kk, rounded
// to bf16), B read from a [n][k] bf16 array `bt` of row pitch `pitch` (n = 8·nd + gid).
template <int NB, int ND>
__device__ __forceinline__ void mma_from_scores(float (&acc)[ND][4], const float (&c)[NB][4],
                                                const unsigned short* bt, int pitch, int gid,
                                                int tig) {
#pragma unroll
    for (int kk = 0; kk < NB / 2; kk++) {
        unsigned pa[4];
        pa[0] = pack_bf16x2(c[2 * kk][0], c[2 * kk][1]);
        pa[1] = pack_bf16x2(c[2 * kk][2], c[2 * kk][3]);
        pa[2] = pack_bf16x2(c[2 * kk + 1][0], c[2 * kk + 1][1]);
        pa[3] = pack_bf16x2(c[2 * kk + 1][2], c[2 * kk + 1][3]);
#pragma unroll
        for (int nd = 0; nd < ND; nd++) {
            const unsigned short* bp = bt + (8 * nd + gid) * pitch + 16 * kk + 2 * tig;
            mma_bf16_16816(acc[nd], pa, *(const unsigned*)bp, *(const unsigned*)(bp + 8));
        }
    }
}

// The two rows of a thread in a block of 64 query rows (gid and gid + 8 of its warp's 16):
// live, output row, position (causal) and segment (SEG).
struct MmaRows {
    bool live[2];
    i64 qpos[2], orow[2], seg_lo[2], seg_hi[2];
};

template <bool SEG>
__device__ __forceinline__ MmaRows mma_rows(const AttnArgs& a, const SeqSpan& sp, int g, i64 row0,
                                            i64 pos0, int warp, int gid) {
    const int group = a.hq / a.hkv;
    const i64 rows_bg = sp.len * group;
    MmaRows m;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const i64 r = row0 + 16 * warp + gid + 8 * i;
        m.live[i] = r < rows_bg;
        const i64 t = m.live[i] ? r / group : 0;
        const int h = g * group + (int)(m.live[i] ? r % group : 0);
        m.orow[i] = (sp.qb + t) * a.hq + h;
        m.qpos[i] = pos0 + t;
        i64 lo = 0, hi = 0;
        if (SEG && m.live[i]) seg_bounds(a, t, lo, hi);
        m.seg_lo[i] = lo;
        m.seg_hi[i] = hi;
    }
    return m;
}

// Whether row i of `m` sees key s (valid in the key tile's mask).
template <bool SEG>
__device__ __forceinline__ bool mma_visible(const MmaRows& m, int i, i64 s, float valid) {
    return m.live[i] && valid != 0.0f && (SEG ? s >= m.seg_lo[i] && s < m.seg_hi[i] : s <= m.qpos[i]);
}

// The keys a block of query rows from row0 walks, in tiles of TILE at multiples of TILE:
// causal from 0 to its last row's position; SEG from its first row's segment start to its
// last row's segment end.
template <bool SEG, int TILE>
__device__ __forceinline__ void mma_key_range(const AttnArgs& a, i64 rows_bg, i64 row0, i64 pos0,
                                              i64& begin, i64& end) {
    const int group = a.hq / a.hkv;
    if (SEG) {
        i64 lo, hi, lo2, hi2;
        seg_bounds(a, row0, lo, hi);
        seg_bounds(a, (row0 + MMA_ROWS < rows_bg ? row0 + MMA_ROWS : rows_bg) - 1, lo2, hi2);
        begin = lo / TILE * TILE;
        end = hi2;
    } else {
        begin = 0;
        end = causal_key_end(pos0, row0 + MMA_ROWS - 1, rows_bg, group);
    }
}

template <int D, bool SEG>
__device__ __forceinline__ void attention_fwd_mma_impl(AttnArgs a, float* __restrict__ out,
                                                       float* __restrict__ lse,
                                                       unsigned* __restrict__ status,
                                                       unsigned short* __restrict__ out16 = nullptr) {
    constexpr int KS = D / 16;             // k-steps of q·kᵀ over the head dims
    constexpr int ND = D / 8;              // 8-column blocks of the output
    constexpr int NB = MMA_KEYS / 8;       // 8-key blocks of a score tile
    constexpr int KP = D + 8;              // key row pitch (bf16)
    constexpr int VP = MMA_KEYS + 8;       // transposed value row pitch (bf16)
    __shared__ __align__(16) unsigned short Ks[MMA_KEYS * KP];
    __shared__ __align__(16) unsigned short Vt[D * VP];
    __shared__ float kvalid[MMA_KEYS];
    const int group = a.hq / a.hkv;
    const bool packed = !SEG && a.cu != nullptr;
    const i64 tiles = (longest_seq(a, packed) * group + MMA_ROWS - 1) / MMA_ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    if (a.cu) seg_check_offsets(a, status);

    for (i64 blk = blockIdx.x; blk < seq_count(a, packed) * a.hkv * tiles; blk += gridDim.x) {
        const i64 tile = blk % tiles;
        const i64 bg = blk / tiles;
        const int g = (int)(bg % a.hkv);
        const i64 b = bg / a.hkv;
        const i64 row0 = tile * MMA_ROWS;
        const SeqSpan sp = seq_span(a, b, packed);
        if (row0 >= sp.len * group) continue;  // past a packed segment's end (uniform)
        const i64 pos0 = seq_pos0(a, b);
        const MmaRows rw = mma_rows<SEG>(a, sp, g, row0, pos0, warp, gid);
        // q as the A operand of q·kᵀ, k-step ks covering dims 16·ks .. 16·ks + 15.
        unsigned qa[KS][4];
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = i % 2, col = 16 * ks + 8 * (i / 2) + 2 * tig;
                qa[ks][i] = rw.live[row] ? bf16x2_at(a.q, a.q16, rw.orow[row] * D + col) : 0u;
            }
        }
        float o[ND][4];
#pragma unroll
        for (int nd = 0; nd < ND; nd++) {
#pragma unroll
            for (int e = 0; e < 4; e++) o[nd][e] = 0.0f;
        }
        float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
        int bad[2] = {0, 0};
        i64 key_begin, key_end;
        mma_key_range<SEG, MMA_KEYS>(a, sp.len * group, row0, pos0, key_begin, key_end);
        for (i64 kb = key_begin; kb < key_end; kb += MMA_KEYS) {
            __syncthreads();
            for (int i = threadIdx.x; i < MMA_KEYS * D; i += blockDim.x) {
                const int j = i / D, c = i - j * D;
                const i64 s = kb + j;
                unsigned short kv = 0, vv = 0;
                const i64 row = s < key_end ? key_row(a, b, sp.kvb, s, status) : -1;
                if (row >= 0) {
                    const i64 idx = (row * a.hkv + g) * D + c;
                    // a bf16 pool's (or stored activation's) values are the rounded ones
                    kv = bf16_at(a.k, a.k16, idx);
                    vv = bf16_at(a.v, a.v16, idx);
                }
                Ks[j * KP + c] = kv;
                Vt[c * VP + j] = vv;
            }
            if (threadIdx.x < MMA_KEYS) {
                const i64 s = kb + threadIdx.x;
                kvalid[threadIdx.x] = s < key_end ? key_valid(a.mask, sp.kvb + s, status) : 0.0f;
            }
            __syncthreads();

            float s[NB][4];
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) s[nb][e] = 0.0f;
            }
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
#pragma unroll
                for (int nb = 0; nb < NB; nb++) {
                    const unsigned short* kp = Ks + (8 * nb + gid) * KP + 16 * ks + 2 * tig;
                    mma_bf16_16816(s[nb], qa[ks], *(const unsigned*)kp, *(const unsigned*)(kp + 8));
                }
            }
            // Visibility and each row's tile max (the quad of a row holds its 64 scores).
            float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int i = e / 2, j = 8 * nb + 2 * tig + e % 2;
                    const bool vis = mma_visible<SEG>(rw, i, kb + j, kvalid[j]);
                    const float x = __fmul_rn(a.scale, s[nb][e]);
                    const bool fin = is_finite(x);
                    bad[i] |= vis && !fin;
                    s[nb][e] = vis && fin ? x : NEG_INF;
                    tmax[i] = fmaxf(tmax[i], s[nb][e]);
                }
            }
            float alpha[2], mnew[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(FULL, tmax[i], 1));
                tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(FULL, tmax[i], 2));
                const bool none = tmax[i] == NEG_INF;
                mnew[i] = none ? m[i] : fmaxf(m[i], tmax[i]);
                alpha[i] = none ? 1.0f : exp2_nonpositive_rn(__fmul_rn(__fsub_rn(m[i], mnew[i]), LOG2E));
                m[i] = mnew[i];
                l[i] = __fmul_rn(l[i], alpha[i]);
            }
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int i = e / 2;
                    const float x = s[nb][e];
                    const float p = x == NEG_INF ? 0.0f : exp2_nonpositive_rn(__fmul_rn(__fsub_rn(x, mnew[i]), LOG2E));
                    l[i] = __fadd_rn(l[i], p);
                    s[nb][e] = p;
                }
            }
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
#pragma unroll
                for (int e = 0; e < 4; e++) o[nd][e] = __fmul_rn(o[nd][e], alpha[e / 2]);
            }
            // P·V, the probabilities straight from the score registers.
            mma_from_scores<NB, ND>(o, s, Vt, VP, gid, tig);
        }
        // A row's sum and flag are spread over its quad.
#pragma unroll
        for (int i = 0; i < 2; i++) {
            l[i] = __fadd_rn(l[i], __shfl_xor_sync(FULL, l[i], 1));
            l[i] = __fadd_rn(l[i], __shfl_xor_sync(FULL, l[i], 2));
            bad[i] |= __shfl_xor_sync(FULL, bad[i], 1);
            bad[i] |= __shfl_xor_sync(FULL, bad[i], 2);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if (!rw.live[i]) continue;
            const bool empty = m[i] == NEG_INF;
            const float inv = empty || bad[i] ? 0.0f : __fdiv_rn(1.0f, l[i]);
            const i64 row = rw.orow[i] * D;
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float val = bad[i] ? NAN_F : __fmul_rn(o[nd][2 * i + e], inv);
                    // stored in bf16 (activations kept in bf16): rounded once, to nearest even
                    if (out16) out16[row + 8 * nd + 2 * tig + e] = bf16_rne(val);
                    else out[row + 8 * nd + 2 * tig + e] = val;
                }
            }
            if (lse && tig == 0) lse[rw.orow[i]] = bad[i] ? NAN_F : empty ? NEG_INF : m[i] + logf(l[i]);
        }
    }
}

// The forward's instances: training (NAME), the vision tower's segments (segment_NAME) and a
// prefill chunk over a paged cache (paged_NAME: `tables` set, so query i of sequence b sits at
// slot lens[b] + i and sees every slot up to its own, keys from the f32 pools rounded as
// they are staged or from bf16 pools (k16/v16) as they are; no mask, no lse).
#define ATTN_FWD_MMA(NAME, D)                                                                 \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, 1)                           \
        NAME(const float* q, const float* k, const float* v, const float* mask, i64 batch,    \
             i64 q_seq, i64 kv_seq, i64 pos0, int hq, int hkv, float scale, float* out,        \
             float* lse, unsigned* status, const unsigned* cu, int segments,                  \
             const unsigned short* q16, const unsigned short* k16,                            \
             const unsigned short* v16, unsigned short* out16) {                              \
        AttnArgs a = {q, k, v, mask, batch, q_seq, kv_seq, pos0, hq, hkv, D, scale,           \
                      nullptr, nullptr, 0, 0, 0, k16, v16, cu, segments, nullptr, q16};       \
        attention_fwd_mma_impl<D, false>(a, out, lse, status, out16);                         \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, 1)                           \
        segment_##NAME(const float* q, const float* k, const float* v, const unsigned* cu,    \
                       int segments, i64 tokens, int heads, float scale, float* out,          \
                       float* lse, unsigned* status, const unsigned short* q16,               \
                       const unsigned short* k16, const unsigned short* v16,                  \
                       unsigned short* out16) {                                               \
        AttnArgs a = {q, k, v, nullptr, 1, tokens, tokens, 0, heads, heads, D, scale,         \
                      nullptr, nullptr, 0, 0, 0, k16, v16, cu, segments, nullptr, q16};       \
        attention_fwd_mma_impl<D, true>(a, out, lse, status, out16);                          \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, 1)                           \
        paged_##NAME(const float* q, const float* k, const float* v, const unsigned short* k16, \
                     const unsigned short* v16, i64 batch, i64 q_seq, int hq, int hkv,          \
                     float scale, const unsigned* tables, const unsigned* lens,                \
                     i64 block_size, i64 max_blocks, i64 pool_blocks, float* out,              \
                     unsigned* status) {                                                      \
        AttnArgs a = {q, k, v, nullptr, batch, q_seq, pool_blocks, 0, hq, hkv, D, scale,      \
                      tables, lens, block_size, max_blocks, pool_blocks, k16, v16, nullptr, 0}; \
        attention_fwd_mma_impl<D, false>(a, out, nullptr, status);                            \
    }

ATTN_FWD_MMA(attention_fwd_mma_d64, 64)
ATTN_FWD_MMA(attention_fwd_mma_d80, 80)
ATTN_FWD_MMA(attention_fwd_mma_d128, 128)

// δ[row] = Σ_c dout[row, c]·out[row, c] per (token, head) row; one warp per row.
extern "C" __global__ void attention_bwd_delta(const float* __restrict__ dout,
                                               const float* __restrict__ out, i64 rows, int d,
                                               float* __restrict__ delta) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        float acc = 0.0f;
        for (int c = lane; c < d; c += 32) acc = fmaf(dout[r * d + c], out[r * d + c], acc);
        acc = warp_sum(acc);
        if (lane == 0) delta[r] = acc;
    }
}

// The probability of a visible key from its score and the row's saved lse: exp(x − lse)
// (x ≤ lse up to rounding, so clamped at 0); 0 for a row without a key (lse −inf), NaN
// for a row whose forward was NaN.
__device__ __forceinline__ float prob_from_lse(float score, float row_lse) {
    if (row_lse != row_lse) return NAN_F;
    if (row_lse == NEG_INF) return 0.0f;
    const float x = score - row_lse;
    return expf(x < 0.0f ? x : 0.0f);
}

// Backward pass 1, over query rows (same tiling as the forward):
//   p = exp(scale·q·k − lse), dp = dout·v, ds = p·(dp − δ), dq = scale·Σ ds·k.
template <int DPL, int RW, bool PACKED>
__device__ __forceinline__ void attention_bwd_dq_impl(AttnArgs a, const float* __restrict__ lse,
                                                      const float* __restrict__ delta,
                                                      const float* __restrict__ dout,
                                                      float* __restrict__ dq,
                                                      unsigned* __restrict__ status) {
    const int ROWS = NW * RW;
    ARES_DYNAMIC_SHARED(float, smem);
    const int d = a.d, dp = a.d + 1;
    float* Ks = smem;                 // [KT][d + 1]
    float* Vs = Ks + KT * dp;         // [KT][d + 1]
    float* Qs = Vs + KT * dp;         // [ROWS][d]
    float* Ds = Qs + ROWS * d;        // [ROWS][d] (dout rows)
    __shared__ float kvalid[KT];
    const int group = a.hq / a.hkv;
    if (PACKED) seg_check_offsets(a, status);
    const i64 tiles = (longest_seq(a, PACKED) * group + ROWS - 1) / ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    for (i64 blk = blockIdx.x; blk < seq_count(a, PACKED) * a.hkv * tiles; blk += gridDim.x) {
        const i64 tile = blk % tiles;
        const i64 bg = blk / tiles;
        const int g = (int)(bg % a.hkv);
        const i64 b = bg / a.hkv;
        const i64 row0 = tile * ROWS;
        const SeqSpan sp = seq_span(a, b, PACKED);
        const i64 rows_bg = sp.len * group;
        if (PACKED && row0 >= rows_bg) continue;  // past a segment's end (uniform)
        __syncthreads();
        for (int i = threadIdx.x; i < ROWS * d; i += blockDim.x) {
            const i64 r = row0 + i / d;
            float qv = 0.0f, dv = 0.0f;
            if (r < rows_bg) {
                const i64 t = r / group;
                const int h = g * group + (int)(r % group);
                const i64 idx = ((sp.qb + t) * a.hq + h) * d + i % d;
                qv = a.q[idx];
                dv = dout[idx];
            }
            Qs[i] = qv;
            Ds[i] = dv;
        }
        float acc[RW][DPL], row_lse[RW], row_delta[RW];
#pragma unroll
        for (int rr = 0; rr < RW; rr++) {
            const i64 r = row0 + warp * RW + rr;
            row_lse[rr] = NEG_INF;
            row_delta[rr] = 0.0f;
            if (r < rows_bg) {
                const i64 t = r / group;
                const int h = g * group + (int)(r % group);
                const i64 orow = (sp.qb + t) * a.hq + h;
                row_lse[rr] = lse[orow];
                row_delta[rr] = delta[orow];
            }
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[rr][i] = 0.0f;
        }
        const i64 pos0 = seq_pos0(a, b);
        const i64 key_end = causal_key_end(pos0, row0 + ROWS - 1, rows_bg, group);
        for (i64 kb = 0; kb < key_end; kb += KT) {
            stage_kv_tile(a, b, sp.kvb, g, kb, key_end, Ks, Vs, kvalid, status);
#pragma unroll
            for (int rr = 0; rr < RW; rr++) {
                const int lr = warp * RW + rr;
                const i64 r = row0 + lr;
                if (r >= rows_bg || row_lse[rr] == NEG_INF) continue;
                const i64 qpos = pos0 + r / group;
                const i64 s = kb + lane;
                float ds = 0.0f;
                if (s <= qpos && kvalid[lane] != 0.0f) {
                    const float* qr = Qs + lr * d;
                    const float* dr = Ds + lr * d;
                    const float* kr = Ks + lane * dp;
                    const float* vr = Vs + lane * dp;
                    float qk = 0.0f, dv = 0.0f;
                    for (int c = 0; c < d; c++) {
                        qk = fmaf(qr[c], kr[c], qk);
                        dv = fmaf(dr[c], vr[c], dv);
                    }
                    const float p = prob_from_lse(a.scale * qk, row_lse[rr]);
                    ds = p * (dv - row_delta[rr]);
                }
                for (int j = 0; j < KT; j++) {
                    const float dsj = __shfl_sync(FULL, ds, j);
                    if (dsj == 0.0f) continue;
                    const float* kr = Ks + j * dp;
#pragma unroll
                    for (int i = 0; i < DPL; i++) {
                        const int c = lane + 32 * i;
                        if (c < d) acc[rr][i] = fmaf(dsj, kr[c], acc[rr][i]);
                    }
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < RW; rr++) {
            const i64 r = row0 + warp * RW + rr;
            if (r >= rows_bg) continue;
            const i64 t = r / group;
            const int h = g * group + (int)(r % group);
            const i64 orow = (sp.qb + t) * a.hq + h;
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const int c = lane + 32 * i;
                if (c < d) dq[orow * d + c] = a.scale * acc[rr][i];
            }
        }
    }
}

#define ATTN_BWD_DQ(NAME, DPL, RW)                                                             \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                      \
        NAME(const float* q, const float* k, const float* v, const float* mask, i64 batch,     \
             i64 seq, int hq, int hkv, int d, float scale, const float* lse, const float* delta, \
             const float* dout, float* dq, unsigned* status) {                                  \
        AttnArgs a = {q, k, v, mask, batch, seq, seq, 0, hq, hkv, d, scale};                    \
        attention_bwd_dq_impl<DPL, RW, false>(a, lse, delta, dout, dq, status);                 \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NW * 32, 2)                                   \
        packed_##NAME(const float* q, const float* k, const float* v, const float* mask,       \
                      i64 batch, i64 seq, int hq, int hkv, int d, float scale,                 \
                      const float* lse, const float* delta, const float* dout, float* dq,      \
                      unsigned* status, const unsigned* cu, int segments) {                    \
        AttnArgs a = {q, k, v, mask, batch, seq, seq, 0, hq, hkv, d, scale,                     \
                      nullptr, nullptr, 0, 0, 0, nullptr, nullptr, cu, segments};               \
        attention_bwd_dq_impl<DPL, RW, true>(a, lse, delta, dout, dq, status);                  \
    }

ATTN_BWD_DQ(attention_bwd_dq_d64, 2, 1)
ATTN_BWD_DQ(attention_bwd_dq_d128, 4, 2)
ATTN_BWD_DQ(attention_bwd_dq_d256, 8, 1)

// Backward pass 2, over key rows: a block takes KROWS = NW·RW consecutive key slots of one
// (b, g), each warp RW of them, and walks the query rows (t, h in g's group) with t ≥ the
// block's first key in tiles of 32 (lane j ↔ query row j of the tile):
//   dv_s = Σ p·dout,  dk_s = scale·Σ p·(dout·v_s − δ)·q,
// summed over the group's heads and the queries in a fixed order (deterministic). Masked
// keys get zero gradients.
template <int DPL, int RW, bool PACKED>
__device__ __forceinline__ void attention_bwd_dkv_impl(AttnArgs a, const float* __restrict__ lse,
                                                       const float* __restrict__ delta,
                                                       const float* __restrict__ dout,
                                                       float* __restrict__ dk,
                                                       float* __restrict__ dv,
                                                       unsigned* __restrict__ status) {
    const int KROWS = NW * RW;
    ARES_DYNAMIC_SHARED(float, smem);
    const int d = a.d, dp = a.d + 1;
    float* Qs = smem;                 // [32][d + 1]
    float* Ds = Qs + 32 * dp;         // [32][d + 1]
    float* Kw = Ds + 32 * dp;         // [KROWS][d]
    float* Vw = Kw + KROWS * d;       // [KROWS][d]
    __shared__ float lse_s[32], delta_s[32];
    __shared__ float key_ok[NW * 8];
    const int group = a.hq / a.hkv;
    if (PACKED) seg_check_offsets(a, status);
    const i64 tiles = (longest_seq(a, PACKED) + KROWS - 1) / KROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    for (i64 blk = blockIdx.x; blk < seq_count(a, PACKED) * a.hkv * tiles; blk += gridDim.x) {
        const i64 tile = blk % tiles;
        const i64 bg = blk / tiles;
        const int g = (int)(bg % a.hkv);
        const i64 b = bg / a.hkv;
        const i64 s0 = tile * KROWS;
        const SeqSpan sp = seq_span(a, b, PACKED);
        const i64 seq = sp.len, rows_bg = sp.len * group;
        if (PACKED && s0 >= seq) continue;  // past a segment's end (uniform)
        __syncthreads();
        for (int i = threadIdx.x; i < KROWS * d; i += blockDim.x) {
            const i64 s = s0 + i / d;
            float kv = 0.0f, vv = 0.0f;
            if (s < seq) {
                const i64 idx = ((sp.kvb + s) * a.hkv + g) * d + i % d;
                kv = a.k[idx];
                vv = a.v[idx];
            }
            Kw[i] = kv;
            Vw[i] = vv;
        }
        if (threadIdx.x < KROWS) {
            const i64 s = s0 + threadIdx.x;
            key_ok[threadIdx.x] = s < seq ? key_valid(a.mask, sp.kvb + s, status) : 0.0f;
        }
        float gk[RW][DPL], gv[RW][DPL];
#pragma unroll
        for (int rr = 0; rr < RW; rr++)
#pragma unroll
            for (int i = 0; i < DPL; i++) gk[rr][i] = gv[rr][i] = 0.0f;

        for (i64 rt = s0 * group; rt < rows_bg; rt += 32) {
            __syncthreads();
            for (int i = threadIdx.x; i < 32 * d; i += blockDim.x) {
                const int j = i / d, c = i - j * d;
                const i64 r = rt + j;
                float qv = 0.0f, dv2 = 0.0f;
                if (r < rows_bg) {
                    const i64 t = r / group;
                    const int h = g * group + (int)(r % group);
                    const i64 idx = ((sp.qb + t) * a.hq + h) * d + c;
                    qv = a.q[idx];
                    dv2 = dout[idx];
                }
                Qs[j * dp + c] = qv;
                Ds[j * dp + c] = dv2;
            }
            if (threadIdx.x < 32) {
                const i64 r = rt + threadIdx.x;
                float l = NEG_INF, de = 0.0f;
                if (r < rows_bg) {
                    const i64 t = r / group;
                    const int h = g * group + (int)(r % group);
                    const i64 orow = (sp.qb + t) * a.hq + h;
                    l = lse[orow];
                    de = delta[orow];
                }
                lse_s[threadIdx.x] = l;
                delta_s[threadIdx.x] = de;
            }
            __syncthreads();
            const i64 r = rt + lane;
            const i64 t = r / group;
#pragma unroll
            for (int rr = 0; rr < RW; rr++) {
                const int kr_i = warp * RW + rr;
                const i64 s = s0 + kr_i;
                if (s >= seq || key_ok[kr_i] == 0.0f) continue;
                float p = 0.0f, ds = 0.0f;
                if (r < rows_bg && t >= s) {
                    const float* qr = Qs + lane * dp;
                    const float* dr = Ds + lane * dp;
                    const float* kr = Kw + kr_i * d;
                    const float* vr = Vw + kr_i * d;
                    float qk = 0.0f, dov = 0.0f;
                    for (int c = 0; c < d; c++) {
                        qk = fmaf(qr[c], kr[c], qk);
                        dov = fmaf(dr[c], vr[c], dov);
                    }
                    p = prob_from_lse(a.scale * qk, lse_s[lane]);
                    ds = p * (dov - delta_s[lane]);
                }
                for (int j = 0; j < 32; j++) {
                    const float pj = __shfl_sync(FULL, p, j);
                    const float dsj = __shfl_sync(FULL, ds, j);
                    if (pj == 0.0f && dsj == 0.0f) continue;
                    const float* qr = Qs + j * dp;
                    const float* dr = Ds + j * dp;
#pragma unroll
                    for (int i = 0; i < DPL; i++) {
                        const int c = lane + 32 * i;
                        if (c < d) {
                            gv[rr][i] = fmaf(pj, dr[c], gv[rr][i]);
                            gk[rr][i] = fmaf(dsj, qr[c], gk[rr][i]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < RW; rr++) {
            const i64 s = s0 + warp * RW + rr;
            if (s >= seq) continue;
            const i64 base = ((sp.kvb + s) * a.hkv + g) * d;
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const int c = lane + 32 * i;
                if (c < d) {
                    dk[base + c] = a.scale * gk[rr][i];
                    dv[base + c] = gv[rr][i];
                }
            }
        }
    }
}

#define ATTN_BWD_DKV(NAME, DPL, RW)                                                            \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                      \
        NAME(const float* q, const float* k, const float* v, const float* mask, i64 batch,     \
             i64 seq, int hq, int hkv, int d, float scale, const float* lse, const float* delta, \
             const float* dout, float* dk, float* dv, unsigned* status) {                       \
        AttnArgs a = {q, k, v, mask, batch, seq, seq, 0, hq, hkv, d, scale};                    \
        attention_bwd_dkv_impl<DPL, RW, false>(a, lse, delta, dout, dk, dv, status);            \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NW * 32, 2)                                   \
        packed_##NAME(const float* q, const float* k, const float* v, const float* mask,       \
                      i64 batch, i64 seq, int hq, int hkv, int d, float scale,                 \
                      const float* lse, const float* delta, const float* dout, float* dk,      \
                      float* dv, unsigned* status, const unsigned* cu, int segments) {         \
        AttnArgs a = {q, k, v, mask, batch, seq, seq, 0, hq, hkv, d, scale,                     \
                      nullptr, nullptr, 0, 0, 0, nullptr, nullptr, cu, segments};               \
        attention_bwd_dkv_impl<DPL, RW, true>(a, lse, delta, dout, dk, dv, status);             \
    }

ATTN_BWD_DKV(attention_bwd_dkv_d64, 2, 1)
ATTN_BWD_DKV(attention_bwd_dkv_d128, 4, 1)
ATTN_BWD_DKV(attention_bwd_dkv_d256, 8, 1)

// ---- Tensor-core backward: bf16 operands, f32 sums ----
// Twin: ares_cpu::ops::attention::attention_backward_bf16. q, k, v and dout are rounded to
// bf16 as they are loaded (δ = Σ bf16(dout)·out: attention_bwd_delta_bf16), the scores
// s = scale·q·kᵀ are recomputed on tensor cores, p = e^(min(s − lse, 0)) by the twin's exp,
// dS = p·(dP − δ) with dP = dout·vᵀ, and p and dS are rounded to bf16 from the score
// registers into the A operand of the products that take them (fragment maps as for the
// forward above; ares-cuda/src/mma.rs). Two passes, no atomics, as the f32 backward:
// - dq: a block takes MMA_ROWS query rows of a (sequence, kv head) group, 16 a warp, q and
//   dout fragments in registers, and walks the visible keys in tiles of MMA_BWD_TILE
//   (keys and values as [key][D + 8], keys again as [D][MMA_BWD_TILE + 8]);
//   dQ = scale·dS·k.
// - dk, dv: a block takes MMA_ROWS keys, 16 a warp, and walks the group's query rows that
//   see them in tiles of MMA_BWD_TILE (q and dout as [row][D + 8] and [D][tile + 8]), with
//   the transposed scores sᵀ = k·qᵀ and dPᵀ = v·doutᵀ: dV = Σ pᵀ·dout, dK = scale·Σ dSᵀ·q
//   over every query head of the kv head.

#define MMA_BWD_TILE 32

// The twin's probs_row_portable::<false> for a visible key: 0 in a row without a key
// (lse −inf), NaN in a NaN row.
__device__ __forceinline__ float prob_bf16(float score, float row_lse) {
    if (row_lse == NEG_INF) return 0.0f;
    if (row_lse != row_lse) return NAN_F;
    return exp2_nonpositive_rn(__fmul_rn(fminf(__fsub_rn(score, row_lse), 0.0f), LOG2E));
}

// δ[row] = Σ_c bf16(dout[row, c])·out[row, c]: attention_bwd_delta over the rounded dout
// (out stored in bf16: out16's bits widened; else NULL).
extern "C" __global__ void attention_bwd_delta_bf16(const float* __restrict__ dout,
                                                    const float* __restrict__ out, i64 rows,
                                                    int d, float* __restrict__ delta,
                                                    const unsigned short* __restrict__ out16) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 r = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        float acc = 0.0f;
        for (int c = lane; c < d; c += 32) {
            const float o = out16 ? widen(out16[r * d + c]) : out[r * d + c];
            acc = fmaf(widen(bf16_rne(dout[r * d + c])), o, acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) delta[r] = acc;
    }
}

template <int D, bool SEG>
__device__ __forceinline__ void attention_bwd_dq_mma_impl(AttnArgs a, const float* __restrict__ lse,
                                                          const float* __restrict__ delta,
                                                          const float* __restrict__ dout,
                                                          float* __restrict__ dq,
                                                          unsigned* __restrict__ status) {
    constexpr int KS = D / 16, ND = D / 8, NB = MMA_BWD_TILE / 8;
    constexpr int KP = D + 8, TP = MMA_BWD_TILE + 8;
    __shared__ __align__(16) unsigned short Ks[MMA_BWD_TILE * KP];
    __shared__ __align__(16) unsigned short Vs[MMA_BWD_TILE * KP];
    __shared__ __align__(16) unsigned short Kt[D * TP];
    __shared__ float kvalid[MMA_BWD_TILE];
    const int group = a.hq / a.hkv;
    const bool packed = !SEG && a.cu != nullptr;
    const i64 tiles = (longest_seq(a, packed) * group + MMA_ROWS - 1) / MMA_ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;

    if (a.cu) seg_check_offsets(a, status);
    for (i64 blk = blockIdx.x; blk < seq_count(a, packed) * a.hkv * tiles; blk += gridDim.x) {
        const i64 tile = blk % tiles;
        const i64 bg = blk / tiles;
        const int g = (int)(bg % a.hkv);
        const i64 b = bg / a.hkv;
        const i64 row0 = tile * MMA_ROWS;
        const SeqSpan sp = seq_span(a, b, packed);
        if (row0 >= sp.len * group) continue;  // past a packed segment's end (uniform)
        const MmaRows rw = mma_rows<SEG>(a, sp, g, row0, 0, warp, gid);
        float row_lse[2], row_delta[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            row_lse[i] = rw.live[i] ? lse[rw.orow[i]] : NEG_INF;
            row_delta[i] = rw.live[i] ? delta[rw.orow[i]] : 0.0f;
        }
        // q and dout as A operands, k-step ks covering dims 16·ks .. 16·ks + 15.
        unsigned qa[KS][4], da[KS][4];
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = i % 2, col = 16 * ks + 8 * (i / 2) + 2 * tig;
                const i64 at = rw.orow[row] * D + col;
                qa[ks][i] = rw.live[row] ? bf16x2_at(a.q, a.q16, at) : 0u;
                da[ks][i] = rw.live[row] ? pack_bf16x2(dout[at], dout[at + 1]) : 0u;
            }
        }
        float acc[ND][4];
#pragma unroll
        for (int nd = 0; nd < ND; nd++) {
#pragma unroll
            for (int e = 0; e < 4; e++) acc[nd][e] = 0.0f;
        }
        i64 key_begin, key_end;
        mma_key_range<SEG, MMA_BWD_TILE>(a, sp.len * group, row0, 0, key_begin, key_end);
        for (i64 kb = key_begin; kb < key_end; kb += MMA_BWD_TILE) {
            __syncthreads();
            for (int i = threadIdx.x; i < MMA_BWD_TILE * D; i += blockDim.x) {
                const int j = i / D, c = i - j * D;
                const i64 s = kb + j;
                unsigned short kv = 0, vv = 0;
                if (s < key_end) {
                    const i64 idx = ((sp.kvb + s) * a.hkv + g) * D + c;
                    kv = bf16_at(a.k, a.k16, idx);
                    vv = bf16_at(a.v, a.v16, idx);
                }
                Ks[j * KP + c] = kv;
                Vs[j * KP + c] = vv;
                Kt[c * TP + j] = kv;
            }
            if (threadIdx.x < MMA_BWD_TILE) {
                const i64 s = kb + threadIdx.x;
                kvalid[threadIdx.x] = s < key_end ? key_valid(a.mask, sp.kvb + s, status) : 0.0f;
            }
            __syncthreads();
            float s[NB][4], dp[NB][4];
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) s[nb][e] = dp[nb][e] = 0.0f;
            }
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
#pragma unroll
                for (int nb = 0; nb < NB; nb++) {
                    const unsigned short* kp = Ks + (8 * nb + gid) * KP + 16 * ks + 2 * tig;
                    mma_bf16_16816(s[nb], qa[ks], *(const unsigned*)kp, *(const unsigned*)(kp + 8));
                    const unsigned short* vp = Vs + (8 * nb + gid) * KP + 16 * ks + 2 * tig;
                    mma_bf16_16816(dp[nb], da[ks], *(const unsigned*)vp, *(const unsigned*)(vp + 8));
                }
            }
            // dS = p·(dP − δ) into the score registers.
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int i = e / 2, j = 8 * nb + 2 * tig + e % 2;
                    const bool vis = mma_visible<SEG>(rw, i, kb + j, kvalid[j]);
                    const float p = vis ? prob_bf16(__fmul_rn(a.scale, s[nb][e]), row_lse[i]) : 0.0f;
                    s[nb][e] = __fmul_rn(p, __fsub_rn(dp[nb][e], row_delta[i]));
                }
            }
            // dQ += dS·k, dS straight from the score registers.
            mma_from_scores<NB, ND>(acc, s, Kt, TP, gid, tig);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if (!rw.live[i]) continue;
            float* dst = dq + rw.orow[i] * D;
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
#pragma unroll
                for (int e = 0; e < 2; e++) dst[8 * nd + 2 * tig + e] = __fmul_rn(a.scale, acc[nd][2 * i + e]);
            }
        }
    }
}

// Dynamic shared memory of the dk/dv kernel at head size D (bf16 elements × 2 bytes):
// keys and values of the block [MMA_ROWS][D + 8], q and dout of a row tile [tile][D + 8]
// and transposed [D][tile + 8]. The host computes the same (`dkv_mma_smem`).
template <int D, bool SEG>
__device__ __forceinline__ void attention_bwd_dkv_mma_impl(AttnArgs a, const float* __restrict__ lse,
                                                           const float* __restrict__ delta,
                                                           const float* __restrict__ dout,
                                                           float* __restrict__ dk,
                                                           float* __restrict__ dv,
                                                           unsigned* __restrict__ status) {
    constexpr int KS = D / 16, ND = D / 8, NB = MMA_BWD_TILE / 8;
    constexpr int KP = D + 8, RP = MMA_BWD_TILE + 8;
    ARES_DYNAMIC_SHARED(unsigned short, smem16);
    unsigned short* Kb = smem16;                  // [MMA_ROWS][KP]
    unsigned short* Vb = Kb + MMA_ROWS * KP;      // [MMA_ROWS][KP]
    unsigned short* Qs = Vb + MMA_ROWS * KP;      // [MMA_BWD_TILE][KP]
    unsigned short* Os = Qs + MMA_BWD_TILE * KP;  // [MMA_BWD_TILE][KP]
    unsigned short* Qt = Os + MMA_BWD_TILE * KP;  // [D][RP]
    unsigned short* Ot = Qt + D * RP;             // [D][RP]
    __shared__ float kvalid[MMA_ROWS];
    __shared__ float row_lse[MMA_BWD_TILE], row_delta[MMA_BWD_TILE];
    // A row sees key s iff s ≤ row_a (causal; −1 for no row) or row_a ≤ s < row_b (SEG).
    __shared__ i64 row_a[MMA_BWD_TILE], row_b[MMA_BWD_TILE];
    const int group = a.hq / a.hkv;
    const bool packed = !SEG && a.cu != nullptr;
    const i64 tiles = (longest_seq(a, packed) + MMA_ROWS - 1) / MMA_ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    if (a.cu) seg_check_offsets(a, status);

    for (i64 blk = blockIdx.x; blk < seq_count(a, packed) * a.hkv * tiles; blk += gridDim.x) {
        const i64 tile = blk % tiles;
        const i64 bg = blk / tiles;
        const int g = (int)(bg % a.hkv);
        const i64 b = bg / a.hkv;
        const i64 kb0 = tile * MMA_ROWS;
        const SeqSpan sp = seq_span(a, b, packed);
        const i64 seq = sp.len, rows_bg = sp.len * group;
        if (kb0 >= seq) continue;  // past a packed segment's end (uniform)
        __syncthreads();
        for (int i = threadIdx.x; i < MMA_ROWS * D; i += blockDim.x) {
            const int j = i / D, c = i - j * D;
            const i64 s = kb0 + j;
            unsigned short kv = 0, vv = 0;
            if (s < seq) {
                const i64 idx = ((sp.kvb + s) * a.hkv + g) * D + c;
                kv = bf16_at(a.k, a.k16, idx);
                vv = bf16_at(a.v, a.v16, idx);
            }
            Kb[j * KP + c] = kv;
            Vb[j * KP + c] = vv;
        }
        if (threadIdx.x < MMA_ROWS) {
            const i64 s = kb0 + threadIdx.x;
            kvalid[threadIdx.x] = s < seq ? key_valid(a.mask, sp.kvb + s, status) : 0.0f;
        }
        float adk[ND][4], adv[ND][4];
#pragma unroll
        for (int nd = 0; nd < ND; nd++) {
#pragma unroll
            for (int e = 0; e < 4; e++) adk[nd][e] = adv[nd][e] = 0.0f;
        }
        // Causal: only queries at or after the block's first key see it; SEG: the queries of
        // the segments of the block's keys.
        i64 row_begin = kb0 * group, row_end = rows_bg;
        if (SEG) {
            i64 lo, hi, lo2, hi2;
            seg_bounds(a, kb0, lo, hi);
            seg_bounds(a, (kb0 + MMA_ROWS < seq ? kb0 + MMA_ROWS : seq) - 1, lo2, hi2);
            row_begin = lo;
            row_end = hi2;
        }
        for (i64 rb = row_begin / MMA_BWD_TILE * MMA_BWD_TILE; rb < row_end; rb += MMA_BWD_TILE) {
            __syncthreads();
            for (int i = threadIdx.x; i < MMA_BWD_TILE * D; i += blockDim.x) {
                const int rr = i / D, c = i - rr * D;
                const i64 r = rb + rr;
                unsigned short q16 = 0, o16 = 0;
                if (r < rows_bg) {
                    const i64 at = ((sp.qb + r / group) * a.hq + g * group + r % group) * D + c;
                    q16 = bf16_at(a.q, a.q16, at);
                    o16 = bf16_rne(dout[at]);
                }
                Qs[rr * KP + c] = q16;
                Os[rr * KP + c] = o16;
                Qt[c * RP + rr] = q16;
                Ot[c * RP + rr] = o16;
            }
            if (threadIdx.x < MMA_BWD_TILE) {
                const i64 r = rb + threadIdx.x;
                const bool in = r < rows_bg;
                const i64 at = in ? (sp.qb + r / group) * a.hq + g * group + r % group : 0;
                row_lse[threadIdx.x] = in ? lse[at] : NEG_INF;
                row_delta[threadIdx.x] = in ? delta[at] : 0.0f;
                i64 ra = in ? r / group : -1, rbnd = 0;
                if (SEG) {
                    if (in) seg_bounds(a, r, ra, rbnd);
                    else ra = 1;  // [1, 0): sees nothing
                }
                row_a[threadIdx.x] = ra;
                row_b[threadIdx.x] = rbnd;
            }
            __syncthreads();
            float st[NB][4], dpt[NB][4];
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) st[nb][e] = dpt[nb][e] = 0.0f;
            }
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                // this warp's 16 keys as the A operand: register i is key row i % 2, dims 8·(i / 2)
                unsigned ka[4], va[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int at = (16 * warp + gid + 8 * (i % 2)) * KP + 16 * ks + 8 * (i / 2) + 2 * tig;
                    ka[i] = *(const unsigned*)(Kb + at);
                    va[i] = *(const unsigned*)(Vb + at);
                }
#pragma unroll
                for (int nb = 0; nb < NB; nb++) {
                    const unsigned short* qp = Qs + (8 * nb + gid) * KP + 16 * ks + 2 * tig;
                    mma_bf16_16816(st[nb], ka, *(const unsigned*)qp, *(const unsigned*)(qp + 8));
                    const unsigned short* op = Os + (8 * nb + gid) * KP + 16 * ks + 2 * tig;
                    mma_bf16_16816(dpt[nb], va, *(const unsigned*)op, *(const unsigned*)(op + 8));
                }
            }
            // Element e of row block nb: key 16·warp + gid + 8·(e / 2), row 8·nb + 2·tig + e % 2.
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int kl = 16 * warp + gid + 8 * (e / 2), rr = 8 * nb + 2 * tig + e % 2;
                    const i64 s_key = kb0 + kl, ra = row_a[rr];
                    const bool vis = kvalid[kl] != 0.0f &&
                                     (SEG ? s_key >= ra && s_key < row_b[rr] : ra >= 0 && s_key <= ra);
                    const float p = vis ? prob_bf16(__fmul_rn(a.scale, st[nb][e]), row_lse[rr]) : 0.0f;
                    dpt[nb][e] = __fmul_rn(p, __fsub_rn(dpt[nb][e], row_delta[rr]));
                    st[nb][e] = p;
                }
            }
            // dV += pᵀ·dout and dK += dSᵀ·q, both straight from the score registers.
            mma_from_scores<NB, ND>(adv, st, Ot, RP, gid, tig);
            mma_from_scores<NB, ND>(adk, dpt, Qt, RP, gid, tig);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const i64 s = kb0 + 16 * warp + gid + 8 * i;
            if (s >= seq) continue;
            const i64 at = ((sp.kvb + s) * a.hkv + g) * D;
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    dk[at + 8 * nd + 2 * tig + e] = __fmul_rn(a.scale, adk[nd][2 * i + e]);
                    dv[at + 8 * nd + 2 * tig + e] = adv[nd][2 * i + e];
                }
            }
        }
    }
}

#define ATTN_BWD_MMA(D)                                                                        \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                               \
        attention_bwd_dq_mma_d##D(const float* q, const float* k, const float* v,              \
                                  const float* mask, i64 batch, i64 seq, int hq, int hkv, int d, \
                                  float scale, const float* lse, const float* delta,           \
                                  const float* dout, float* dq, unsigned* status,              \
                                  const unsigned* cu, int segments, const unsigned short* q16, \
                                  const unsigned short* k16, const unsigned short* v16) {      \
        AttnArgs a = {q, k, v, mask, batch, seq, seq, 0, hq, hkv, D, scale,                    \
                      nullptr, nullptr, 0, 0, 0, k16, v16, cu, segments, nullptr, q16};        \
        attention_bwd_dq_mma_impl<D, false>(a, lse, delta, dout, dq, status);                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                               \
        attention_bwd_dkv_mma_d##D(const float* q, const float* k, const float* v,             \
                                   const float* mask, i64 batch, i64 seq, int hq, int hkv,     \
                                   int d, float scale, const float* lse, const float* delta,   \
                                   const float* dout, float* dk, float* dv, unsigned* status,  \
                                   const unsigned* cu, int segments,                           \
                                   const unsigned short* q16, const unsigned short* k16,       \
                                   const unsigned short* v16) {                                \
        AttnArgs a = {q, k, v, mask, batch, seq, seq, 0, hq, hkv, D, scale,                    \
                      nullptr, nullptr, 0, 0, 0, k16, v16, cu, segments, nullptr, q16};        \
        attention_bwd_dkv_mma_impl<D, false>(a, lse, delta, dout, dk, dv, status);             \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                               \
        segment_attention_bwd_dq_mma_d##D(const float* q, const float* k, const float* v,      \
                                          const unsigned* cu, int segments, i64 tokens,        \
                                          int heads, float scale, const float* lse,            \
                                          const float* delta, const float* dout, float* dq,    \
                                          unsigned* status, const unsigned short* q16,         \
                                          const unsigned short* k16,                           \
                                          const unsigned short* v16) {                         \
        AttnArgs a = {q, k, v, nullptr, 1, tokens, tokens, 0, heads, heads, D, scale,          \
                      nullptr, nullptr, 0, 0, 0, k16, v16, cu, segments, nullptr, q16};        \
        attention_bwd_dq_mma_impl<D, true>(a, lse, delta, dout, dq, status);                   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                               \
        segment_attention_bwd_dkv_mma_d##D(const float* q, const float* k, const float* v,     \
                                           const unsigned* cu, int segments, i64 tokens,       \
                                           int heads, float scale, const float* lse,           \
                                           const float* delta, const float* dout, float* dk,   \
                                           float* dv, unsigned* status,                        \
                                           const unsigned short* q16,                          \
                                           const unsigned short* k16,                          \
                                           const unsigned short* v16) {                        \
        AttnArgs a = {q, k, v, nullptr, 1, tokens, tokens, 0, heads, heads, D, scale,          \
                      nullptr, nullptr, 0, 0, 0, k16, v16, cu, segments, nullptr, q16};        \
        attention_bwd_dkv_mma_impl<D, true>(a, lse, delta, dout, dk, dv, status);              \
    }

ATTN_BWD_MMA(64)
ATTN_BWD_MMA(80)
ATTN_BWD_MMA(128)
