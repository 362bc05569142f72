// Vision tower kernels of ares (Qwen2-VL / Qwen2.5-VL): LayerNorm, the GELU-family
// activations, non-causal attention within cu_seqlens segments, and the row scatter that
// places image embeddings among a sequence's token embeddings; forward and backward.
// Compiled at run time by NVRTC (no CUDA headers). Each kernel has a CPU twin in ares-cpu
// (ops::layer_norm, ops::activation, ops::segment_attention, ops::scatter) with the same
// semantics; ares-cuda/src/model_ops/vision.rs checks the arguments before launch.
//
// Bad values are OR-ed into the status word of model_ops.cu (same bit values): an index
// >= rows in scatter_rows (ST_BAD_ID), offsets that are not valid cu_seqlens
// (ST_BAD_SEGMENTS).
//
// Block sizes are multiples of 32 (warp shuffles use full masks).

// Dynamic shared memory; a CPU emulation of the kernels (ares-cuda/tests/emulate) defines
// its own.
#ifndef ARES_DYNAMIC_SHARED
#define ARES_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)
#define NAN_F __int_as_float(0x7fffffff)
#define FULL 0xffffffffu

#define ST_BAD_ID 4u          // a scatter_rows index >= rows
#define ST_BAD_SEGMENTS 64u   // cu_seqlens not 0 first, decreasing, or not ending at tokens

typedef long long i64;

__device__ __forceinline__ bool is_finite(float x) { return fabsf(x) < POS_INF; }

__device__ __forceinline__ float warp_sum(float x) {
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(FULL, x, off);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL, x, off));
    return x;
}

__device__ __forceinline__ double warp_sum_d(double x) {
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(FULL, x, off);
    return x;
}

// Block-wide sum, returned to every thread; deterministic (fixed tree). `sh` holds 32
// doubles; the leading barrier protects it from a previous call's readers.
__device__ __forceinline__ double block_sum_d(double x, double* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    x = warp_sum_d(x);
    __syncthreads();
    if (lane == 0) sh[warp] = x;
    __syncthreads();
    return warp_sum_d(lane < nw ? sh[lane] : 0.0);
}

// ---------------------------------------------------------------------------------------
// LayerNorm: y = x̂·w + b, x̂ = fl32((x − μ)·r) in f64, μ = Σx/d and σ² = Σ(x − μ)²/d two
// f64 passes, r = 1/sqrt(σ² + eps) in f64; mean and rstd saved rounded to f32 (the CPU
// twin's numerics). One block per row (grid-stride).

extern "C" __global__ void layer_norm_fwd(const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ b, float eps, i64 rows,
                                          i64 dim, float* __restrict__ out,
                                          float* __restrict__ mean, float* __restrict__ rstd) {
    __shared__ double sh[32];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = x + row * dim;
        double acc = 0.0;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x) acc += (double)xr[c];
        const double mu = block_sum_d(acc, sh) / (double)dim;
        acc = 0.0;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x) {
            const double dv = (double)xr[c] - mu;
            acc += dv * dv;
        }
        const double var = block_sum_d(acc, sh) / (double)dim;
        const double r = 1.0 / sqrt(var + (double)eps);
        float* o = out + row * dim;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x) {
            const float xh = (float)(((double)xr[c] - mu) * r);
            o[c] = __fadd_rn(__fmul_rn(xh, w[c]), b[c]);
        }
        if (threadIdx.x == 0) {
            mean[row] = (float)mu;
            rstd[row] = (float)r;
        }
    }
}

// x̂ from the saved f32 mean and rstd, in f64, rounded once (the CPU twin's backward).
__device__ __forceinline__ float ln_xhat(float x, float mu, float r) {
    return (float)(((double)x - (double)mu) * (double)r);
}

// dx[t, i] += fl32(r·(g_i − mean(g) − x̂_i·mean(g·x̂))), g = fl32(dout·w), means in f64.
extern "C" __global__ void layer_norm_bwd_dx(const float* __restrict__ dout,
                                             const float* __restrict__ x,
                                             const float* __restrict__ w,
                                             const float* __restrict__ mean,
                                             const float* __restrict__ rstd, i64 rows, i64 dim,
                                             float* __restrict__ dx) {
    __shared__ double sh[32];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* dy = dout + row * dim;
        const float* xr = x + row * dim;
        const float mu = mean[row], r = rstd[row];
        double sg = 0.0, sgx = 0.0;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x) {
            const double g = (double)__fmul_rn(dy[c], w[c]);
            sg += g;
            sgx += g * (double)ln_xhat(xr[c], mu, r);
        }
        const double mg = block_sum_d(sg, sh) / (double)dim;
        const double mgx = block_sum_d(sgx, sh) / (double)dim;
        const double rd = (double)r;
        float* o = dx + row * dim;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x) {
            const double g = (double)__fmul_rn(dy[c], w[c]);
            const double v = rd * (g - mg - (double)ln_xhat(xr[c], mu, r) * mgx);
            o[c] = __fadd_rn(o[c], (float)v);
        }
    }
}

// Column partial sums of the weight and bias gradients over chunks of rows (the first
// stage of a deterministic column reduction; model_ops.cu's col_reduce is the second):
// partial_w[k, c] = Σ_{rows r of chunk k, in order} dout[r, c]·x̂[r, c],
// partial_b[k, c] = Σ dout[r, c]. Grid: x over column blocks, y over chunks (grid-stride).
extern "C" __global__ void layer_norm_col_partials(const float* __restrict__ dout,
                                                   const float* __restrict__ x,
                                                   const float* __restrict__ mean,
                                                   const float* __restrict__ rstd, i64 rows,
                                                   i64 cols, i64 chunk_rows, i64 chunks,
                                                   float* __restrict__ partial_w,
                                                   float* __restrict__ partial_b) {
    const i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    for (i64 k = blockIdx.y; k < chunks; k += gridDim.y) {
        const i64 r0 = k * chunk_rows;
        const i64 r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
        float aw = 0.0f, ab = 0.0f;
        for (i64 r = r0; r < r1; r++) {
            const float g = dout[r * cols + c];
            aw = __fadd_rn(aw, __fmul_rn(g, ln_xhat(x[r * cols + c], mean[r], rstd[r])));
            ab = __fadd_rn(ab, g);
        }
        partial_w[k * cols + c] = aw;
        partial_b[k * cols + c] = ab;
    }
}

// ---------------------------------------------------------------------------------------
// Activations, element-wise (grid-stride), in f32 with the CPU twin's cancellation-free
// forms: GELU (erf) x·½·erfc(−x/√2); QuickGELU x·σ(1.702x); GELU (tanh) x·σ(2u),
// u = √(2/π)(x + 0.044715x³). kind: 0 GeluErf, 1 QuickGelu, 2 GeluTanh.

#define ACT_GELU_ERF 0
#define ACT_QUICK_GELU 1
#define ACT_GELU_TANH 2

// (σ(z), σ(−z)) without cancellation or overflow.
__device__ __forceinline__ void sigmoid_pair(float z, float& s, float& sm) {
    if (z >= 0.0f) {
        const float e = expf(-z), inv = 1.0f / (1.0f + e);
        s = inv;
        sm = e * inv;
    } else {
        const float e = expf(z), inv = 1.0f / (1.0f + e);
        s = e * inv;
        sm = inv;
    }
}

__device__ __forceinline__ float tanh_arg(float x) {
    return 0.7978845608028654f * (x + 0.044715f * x * x * x);
}

__device__ __forceinline__ float act_value(int kind, float x) {
    float s, sm;
    switch (kind) {
        case ACT_GELU_ERF:
            return x * 0.5f * erfcf(-x * 0.7071067811865476f);
        case ACT_QUICK_GELU:
            sigmoid_pair(1.702f * x, s, sm);
            return x * s;
        default:
            sigmoid_pair(2.0f * tanh_arg(x), s, sm);
            return x * s;
    }
}

// act'(x); the product terms that vanish in the tails are formed as x·(tiny) so a huge x
// gives 0, not ∞·0.
__device__ __forceinline__ float act_derivative(int kind, float x) {
    float s, sm;
    switch (kind) {
        case ACT_GELU_ERF: {
            const float cdf = 0.5f * erfcf(-x * 0.7071067811865476f);
            return cdf + x * (0.3989422804014327f * expf(-0.5f * x * x));
        }
        case ACT_QUICK_GELU:
            sigmoid_pair(1.702f * x, s, sm);
            return s + x * (s * sm) * 1.702f;
        default: {
            sigmoid_pair(2.0f * tanh_arg(x), s, sm);
            const float t = s * sm;
            if (t == 0.0f) return s;
            const float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
            return s + x * t * 2.0f * du;
        }
    }
}

extern "C" __global__ void activation_fwd(const float* __restrict__ x, float* __restrict__ out,
                                          i64 n, int kind) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = act_value(kind, x[i]);
}

extern "C" __global__ void activation_bwd(const float* __restrict__ dout,
                                          const float* __restrict__ x, float* __restrict__ dx,
                                          i64 n, int kind) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dx[i] = __fmul_rn(dout[i], act_derivative(kind, x[i]));
}

// ---------------------------------------------------------------------------------------
// Row scatter: dst[index[i], :] = src[i, :]; an index >= rows writes nothing (status
// ST_BAD_ID). Repeated indices are not detected (one of the rows wins). One block per
// source row (grid-stride).

extern "C" __global__ void scatter_rows(const float* __restrict__ src,
                                        const unsigned* __restrict__ index, i64 n, i64 rows,
                                        i64 dim, float* __restrict__ dst,
                                        unsigned* __restrict__ status) {
    for (i64 i = blockIdx.x; i < n; i += gridDim.x) {
        const i64 id = index[i];
        if (id >= rows) {
            if (threadIdx.x == 0) atomicOr(status, ST_BAD_ID);
            continue;
        }
        const float* s = src + i * dim;
        float* d = dst + id * dim;
        for (i64 c = threadIdx.x; c < dim; c += blockDim.x) d[c] = s[c];
    }
}

// ---------------------------------------------------------------------------------------
// Segment attention (non-causal, within cu_seqlens segments), FlashAttention-style as the
// causal kernels of model_ops.cu: a block takes ROWS = NW·RW consecutive tokens of one
// head, stages their query rows in shared memory and walks the keys of the segments they
// belong to in tiles of KT through shared memory; within a warp lane j holds key j of the
// tile (its dot product over the head dims), the warp reduces max and sum with shuffles,
// and each lane adds p_j·v_j for its dims. Key s is visible to query t iff both lie in
// the same segment. Layouts: q, k, v, out [tokens, heads, d]; lse [tokens, heads].
//
// Offsets are read as given (the host checks only their count): entries are clamped to
// [0, tokens], so bad offsets give wrong rows but never an access out of bounds, and the
// first block of each launch reports them (ST_BAD_SEGMENTS).

#define NW 8
#define KT 32

struct SegArgs {
    const float* q;
    const float* k;
    const float* v;
    const unsigned* cu;
    int segments;
    int tokens;
    int heads;
    int d;
    float scale;
};

__device__ __forceinline__ int clamp_tok(unsigned v, int tokens) {
    return v < (unsigned)tokens ? (int)v : tokens;
}

// The segment [lo, hi) holding token t: the last i < segments with cu[i] ≤ t.
__device__ __forceinline__ void segment_of(const SegArgs& a, int t, int& lo, int& hi) {
    int l = 0, h = a.segments;
    while (h - l > 1) {
        const int m = (l + h) >> 1;
        if (a.cu[m] <= (unsigned)t) l = m; else h = m;
    }
    lo = clamp_tok(a.cu[l], a.tokens);
    hi = clamp_tok(a.cu[l + 1], a.tokens);
    if (hi < lo) hi = lo;
}

// Block 0 checks the offsets (run by every kernel of the op, so a backward alone reports too).
__device__ __forceinline__ void check_offsets(const SegArgs& a, unsigned* status) {
    if (blockIdx.x != 0) return;
    bool bad = false;
    for (int i = threadIdx.x; i <= a.segments; i += blockDim.x) {
        const unsigned c = a.cu[i];
        if (i == 0 && c != 0u) bad = true;
        if (i > 0 && c < a.cu[i - 1]) bad = true;
        if (i == a.segments && c != (unsigned)a.tokens) bad = true;
    }
    if (bad) atomicOr(status, ST_BAD_SEGMENTS);
}

// Each row's segment into seg_lo/seg_hi (threads < rows), then a barrier.
__device__ __forceinline__ void stage_segments(const SegArgs& a, int t0, int rows, int* seg_lo,
                                               int* seg_hi) {
    if (threadIdx.x < rows) {
        const int t = t0 + (int)threadIdx.x;
        int lo = 0, hi = 0;
        if (t < a.tokens) segment_of(a, t, lo, hi);
        seg_lo[threadIdx.x] = lo;
        seg_hi[threadIdx.x] = hi;
    }
    __syncthreads();
}

// Stages rows r0 .. r0 + KT − 1 of head h of `x` and `y` (zeros at or past `end`) into
// shared [KT][d + 1] tiles, between two block barriers.
__device__ __forceinline__ void stage_pair(const float* x, const float* y, int heads, int d,
                                           int h, int r0, int end, float* xs, float* ys) {
    const int dp = d + 1;
    __syncthreads();
    for (int i = threadIdx.x; i < KT * d; i += blockDim.x) {
        const int j = i / d, c = i - j * d;
        const int r = r0 + j;
        float xv = 0.0f, yv = 0.0f;
        if (r < end) {
            const i64 idx = ((i64)r * heads + h) * d + c;
            xv = x[idx];
            yv = y[idx];
        }
        xs[j * dp + c] = xv;
        ys[j * dp + c] = yv;
    }
    __syncthreads();
}

template <int DPL, int RW>
__device__ __forceinline__ void segment_attention_fwd_impl(SegArgs a, float* __restrict__ out,
                                                           float* __restrict__ lse,
                                                           unsigned* __restrict__ status) {
    const int ROWS = NW * RW;
    ARES_DYNAMIC_SHARED(float, smem);
    const int d = a.d, dp = a.d + 1;
    float* Ks = smem;          // [KT][d + 1]
    float* Vs = Ks + KT * dp;  // [KT][d + 1]
    float* Qs = Vs + KT * dp;  // [ROWS][d]
    __shared__ int seg_lo[NW * RW], seg_hi[NW * RW];
    const int tiles = (a.tokens + ROWS - 1) / ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    check_offsets(a, status);

    for (i64 blk = blockIdx.x; blk < (i64)a.heads * tiles; blk += gridDim.x) {
        const int tile = (int)(blk % tiles);
        const int h = (int)(blk / tiles);
        const int t0 = tile * ROWS;
        __syncthreads();
        for (int i = threadIdx.x; i < ROWS * d; i += blockDim.x) {
            const int t = t0 + i / d;
            Qs[i] = t < a.tokens ? a.q[((i64)t * a.heads + h) * d + i % d] : 0.0f;
        }
        stage_segments(a, t0, ROWS, seg_lo, seg_hi);
        const int last = (a.tokens - t0 < ROWS ? a.tokens - t0 : ROWS) - 1;
        const int k_lo = seg_lo[0], k_hi = seg_hi[last];
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
        for (int kb = k_lo; kb < k_hi; kb += KT) {
            stage_pair(a.k, a.v, a.heads, d, h, kb, k_hi, Ks, Vs);
#pragma unroll
            for (int rr = 0; rr < RW; rr++) {
                const int lr = warp * RW + rr;
                if (t0 + lr >= a.tokens) continue;
                const int s = kb + lane;
                const bool visible = s >= seg_lo[lr] && s < seg_hi[lr];
                float score = NEG_INF;
                if (visible) {
                    const float* qr = Qs + lr * d;
                    const float* kr = Ks + lane * dp;
                    float dot = 0.0f;
                    for (int c = 0; c < d; c++) dot = fmaf(qr[c], kr[c], dot);
                    score = a.scale * dot;
                    bad[rr] |= !is_finite(score);
                }
                const bool use = visible && is_finite(score);
                const float tile_max = warp_max(use ? score : NEG_INF);
                if (tile_max == NEG_INF) continue;
                const float m_new = fmaxf(m[rr], tile_max);
                const float alpha = expf(m[rr] - m_new);
                const float p = use ? expf(score - m_new) : 0.0f;
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
            const int t = t0 + warp * RW + rr;
            if (t >= a.tokens) continue;
            const i64 orow = (i64)t * a.heads + h;
            const bool any_bad = __any_sync(FULL, bad[rr]);
            const bool empty = m[rr] == NEG_INF;
            const float inv = empty || any_bad ? 0.0f : 1.0f / l[rr];
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const int c = lane + 32 * i;
                if (c < d) out[orow * d + c] = any_bad ? NAN_F : acc[rr][i] * inv;
            }
            if (lane == 0) lse[orow] = any_bad ? NAN_F : empty ? NEG_INF : m[rr] + logf(l[rr]);
        }
    }
}

#define SEG_FWD(NAME, DPL, RW)                                                                 \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                      \
        NAME(const float* q, const float* k, const float* v, const unsigned* cu, int segments, \
             int tokens, int heads, int d, float scale, float* out, float* lse,                \
             unsigned* status) {                                                               \
        SegArgs a = {q, k, v, cu, segments, tokens, heads, d, scale};                          \
        segment_attention_fwd_impl<DPL, RW>(a, out, lse, status);                              \
    }

SEG_FWD(segment_attention_fwd_d64, 2, 2)
SEG_FWD(segment_attention_fwd_d128, 4, 2)

// The probability of a visible key from its score and the row's saved lse: exp(x − lse)
// (x ≤ lse up to rounding, so clamped at 0); 0 for a row without a key (lse −inf), NaN
// for a row whose forward was NaN.
__device__ __forceinline__ float prob_from_lse(float score, float row_lse) {
    if (row_lse != row_lse) return NAN_F;
    if (row_lse == NEG_INF) return 0.0f;
    const float x = score - row_lse;
    return expf(x < 0.0f ? x : 0.0f);
}

// Backward pass 1, over query rows (the forward's tiling), with δ = Σ dout·out per row
// (model_ops.cu's attention_bwd_delta): p = exp(scale·q·k − lse), dp = dout·v,
// ds = p·(dp − δ), dq = scale·Σ ds·k. Overwrites dq.
template <int DPL, int RW>
__device__ __forceinline__ void segment_attention_bwd_dq_impl(SegArgs a,
                                                              const float* __restrict__ lse,
                                                              const float* __restrict__ delta,
                                                              const float* __restrict__ dout,
                                                              float* __restrict__ dq,
                                                              unsigned* __restrict__ status) {
    const int ROWS = NW * RW;
    ARES_DYNAMIC_SHARED(float, smem);
    const int d = a.d, dp = a.d + 1;
    float* Ks = smem;          // [KT][d + 1]
    float* Vs = Ks + KT * dp;  // [KT][d + 1]
    float* Qs = Vs + KT * dp;  // [ROWS][d]
    float* Ds = Qs + ROWS * d; // [ROWS][d] (dout rows)
    __shared__ int seg_lo[NW * RW], seg_hi[NW * RW];
    const int tiles = (a.tokens + ROWS - 1) / ROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    check_offsets(a, status);

    for (i64 blk = blockIdx.x; blk < (i64)a.heads * tiles; blk += gridDim.x) {
        const int tile = (int)(blk % tiles);
        const int h = (int)(blk / tiles);
        const int t0 = tile * ROWS;
        __syncthreads();
        for (int i = threadIdx.x; i < ROWS * d; i += blockDim.x) {
            const int t = t0 + i / d;
            float qv = 0.0f, gv = 0.0f;
            if (t < a.tokens) {
                const i64 idx = ((i64)t * a.heads + h) * d + i % d;
                qv = a.q[idx];
                gv = dout[idx];
            }
            Qs[i] = qv;
            Ds[i] = gv;
        }
        stage_segments(a, t0, ROWS, seg_lo, seg_hi);
        const int last = (a.tokens - t0 < ROWS ? a.tokens - t0 : ROWS) - 1;
        const int k_lo = seg_lo[0], k_hi = seg_hi[last];
        float acc[RW][DPL], row_lse[RW], row_delta[RW];
#pragma unroll
        for (int rr = 0; rr < RW; rr++) {
            const int t = t0 + warp * RW + rr;
            row_lse[rr] = NEG_INF;
            row_delta[rr] = 0.0f;
            if (t < a.tokens) {
                const i64 orow = (i64)t * a.heads + h;
                row_lse[rr] = lse[orow];
                row_delta[rr] = delta[orow];
            }
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[rr][i] = 0.0f;
        }
        for (int kb = k_lo; kb < k_hi; kb += KT) {
            stage_pair(a.k, a.v, a.heads, d, h, kb, k_hi, Ks, Vs);
#pragma unroll
            for (int rr = 0; rr < RW; rr++) {
                const int lr = warp * RW + rr;
                if (t0 + lr >= a.tokens || row_lse[rr] == NEG_INF) continue;
                const int s = kb + lane;
                float ds = 0.0f;
                if (s >= seg_lo[lr] && s < seg_hi[lr]) {
                    const float* qr = Qs + lr * d;
                    const float* gr = Ds + lr * d;
                    const float* kr = Ks + lane * dp;
                    const float* vr = Vs + lane * dp;
                    float qk = 0.0f, gvv = 0.0f;
                    for (int c = 0; c < d; c++) {
                        qk = fmaf(qr[c], kr[c], qk);
                        gvv = fmaf(gr[c], vr[c], gvv);
                    }
                    const float p = prob_from_lse(a.scale * qk, row_lse[rr]);
                    ds = p * (gvv - row_delta[rr]);
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
            const int t = t0 + warp * RW + rr;
            if (t >= a.tokens) continue;
            const i64 orow = (i64)t * a.heads + h;
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const int c = lane + 32 * i;
                if (c < d) dq[orow * d + c] = a.scale * acc[rr][i];
            }
        }
    }
}

#define SEG_BWD_DQ(NAME, DPL, RW)                                                              \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                      \
        NAME(const float* q, const float* k, const float* v, const unsigned* cu, int segments, \
             int tokens, int heads, int d, float scale, const float* lse, const float* delta,  \
             const float* dout, float* dq, unsigned* status) {                                 \
        SegArgs a = {q, k, v, cu, segments, tokens, heads, d, scale};                          \
        segment_attention_bwd_dq_impl<DPL, RW>(a, lse, delta, dout, dq, status);               \
    }

SEG_BWD_DQ(segment_attention_bwd_dq_d64, 2, 1)
SEG_BWD_DQ(segment_attention_bwd_dq_d128, 4, 1)

// Backward pass 2, over key rows: a block takes KROWS = NW·RW consecutive keys of one head,
// each warp RW of them, and walks the queries of their segments in tiles of 32 (lane j ↔
// query j of the tile): dv_s = Σ_t p·dout_t, dk_s = scale·Σ_t p·(dout_t·v_s − δ_t)·q_t,
// summed over the queries in a fixed order (deterministic). Overwrites dk and dv.
template <int DPL, int RW>
__device__ __forceinline__ void segment_attention_bwd_dkv_impl(
    SegArgs a, const float* __restrict__ lse, const float* __restrict__ delta,
    const float* __restrict__ dout, float* __restrict__ dk, float* __restrict__ dv,
    unsigned* __restrict__ status) {
    const int KROWS = NW * RW;
    ARES_DYNAMIC_SHARED(float, smem);
    const int d = a.d, dp = a.d + 1;
    float* Qs = smem;             // [32][d + 1]
    float* Ds = Qs + 32 * dp;     // [32][d + 1]
    float* Kw = Ds + 32 * dp;     // [KROWS][d]
    float* Vw = Kw + KROWS * d;   // [KROWS][d]
    __shared__ float lse_s[32], delta_s[32];
    __shared__ int seg_lo[NW * RW], seg_hi[NW * RW];
    const int tiles = (a.tokens + KROWS - 1) / KROWS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    check_offsets(a, status);

    for (i64 blk = blockIdx.x; blk < (i64)a.heads * tiles; blk += gridDim.x) {
        const int tile = (int)(blk % tiles);
        const int h = (int)(blk / tiles);
        const int s0 = tile * KROWS;
        __syncthreads();
        for (int i = threadIdx.x; i < KROWS * d; i += blockDim.x) {
            const int s = s0 + i / d;
            float kv = 0.0f, vv = 0.0f;
            if (s < a.tokens) {
                const i64 idx = ((i64)s * a.heads + h) * d + i % d;
                kv = a.k[idx];
                vv = a.v[idx];
            }
            Kw[i] = kv;
            Vw[i] = vv;
        }
        stage_segments(a, s0, KROWS, seg_lo, seg_hi);
        const int last = (a.tokens - s0 < KROWS ? a.tokens - s0 : KROWS) - 1;
        const int q_lo = seg_lo[0], q_hi = seg_hi[last];
        float gk[RW][DPL], gv[RW][DPL];
#pragma unroll
        for (int rr = 0; rr < RW; rr++)
#pragma unroll
            for (int i = 0; i < DPL; i++) gk[rr][i] = gv[rr][i] = 0.0f;

        for (int qt = q_lo; qt < q_hi; qt += 32) {
            stage_pair(a.q, dout, a.heads, d, h, qt, q_hi, Qs, Ds);
            if (threadIdx.x < 32) {
                const int t = qt + (int)threadIdx.x;
                float l = NEG_INF, de = 0.0f;
                if (t < q_hi) {
                    const i64 orow = (i64)t * a.heads + h;
                    l = lse[orow];
                    de = delta[orow];
                }
                lse_s[threadIdx.x] = l;
                delta_s[threadIdx.x] = de;
            }
            __syncthreads();
            const int t = qt + lane;
#pragma unroll
            for (int rr = 0; rr < RW; rr++) {
                const int kr_i = warp * RW + rr;
                if (s0 + kr_i >= a.tokens) continue;
                float p = 0.0f, ds = 0.0f;
                if (t >= seg_lo[kr_i] && t < seg_hi[kr_i]) {
                    const float* qr = Qs + lane * dp;
                    const float* gr = Ds + lane * dp;
                    const float* kr = Kw + kr_i * d;
                    const float* vr = Vw + kr_i * d;
                    float qk = 0.0f, gvv = 0.0f;
                    for (int c = 0; c < d; c++) {
                        qk = fmaf(qr[c], kr[c], qk);
                        gvv = fmaf(gr[c], vr[c], gvv);
                    }
                    p = prob_from_lse(a.scale * qk, lse_s[lane]);
                    ds = p * (gvv - delta_s[lane]);
                }
                for (int j = 0; j < 32; j++) {
                    const float pj = __shfl_sync(FULL, p, j);
                    const float dsj = __shfl_sync(FULL, ds, j);
                    if (pj == 0.0f && dsj == 0.0f) continue;
                    const float* qr = Qs + j * dp;
                    const float* gr = Ds + j * dp;
#pragma unroll
                    for (int i = 0; i < DPL; i++) {
                        const int c = lane + 32 * i;
                        if (c < d) {
                            gv[rr][i] = fmaf(pj, gr[c], gv[rr][i]);
                            gk[rr][i] = fmaf(dsj, qr[c], gk[rr][i]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < RW; rr++) {
            const int s = s0 + warp * RW + rr;
            if (s >= a.tokens) continue;
            const i64 base = ((i64)s * a.heads + h) * d;
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

#define SEG_BWD_DKV(NAME, DPL, RW)                                                             \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                      \
        NAME(const float* q, const float* k, const float* v, const unsigned* cu, int segments, \
             int tokens, int heads, int d, float scale, const float* lse, const float* delta,  \
             const float* dout, float* dk, float* dv, unsigned* status) {                      \
        SegArgs a = {q, k, v, cu, segments, tokens, heads, d, scale};                          \
        segment_attention_bwd_dkv_impl<DPL, RW>(a, lse, delta, dout, dk, dv, status);          \
    }

SEG_BWD_DKV(segment_attention_bwd_dkv_d64, 2, 1)
SEG_BWD_DKV(segment_attention_bwd_dkv_d128, 4, 1)
