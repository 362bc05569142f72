// Token kernels of ares, compiled at run time by NVRTC (no CUDA headers needed) after
// online_softmax.cuh (NEG_INF, POS_INF, LOG2E, LN2 and the online softmax state).
// Each kernel has a CPU twin in ares-cpu / ares-core with the same semantics; the Rust side
// (ares-cuda/src/ops.rs) documents the arguments.

typedef unsigned short bf16_t;
// IEEE half as its own type, so templates can tell it from bf16 (both are 16-bit words)
struct half_t {
    unsigned short bits;
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16_t x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ float f16_bits_to_f32(unsigned short x) {
    float y;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(y) : "h"(x));
    return y;
}
__device__ __forceinline__ float to_f32(half_t x) { return f16_bits_to_f32(x.bits); }

// Loads VEC consecutive logits as f32 with one 16-byte load.
template <typename T> struct Vec16;
template <> struct Vec16<float> {
    static const int N = 4;
    __device__ __forceinline__ static void load(const float* p, float* out) {
        float4 v = __ldcs(reinterpret_cast<const float4*>(p));
        out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    }
};
template <> struct Vec16<bf16_t> {
    static const int N = 8;
    __device__ __forceinline__ static void load(const bf16_t* p, float* out) {
        uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
        unsigned w[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            out[2 * i] = __uint_as_float(w[i] << 16);
            out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
};

template <> struct Vec16<half_t> {
    static const int N = 8;
    __device__ __forceinline__ static void load(const half_t* p, float* out) {
        uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
        unsigned w[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            out[2 * i] = f16_bits_to_f32((unsigned short)(w[i] & 0xffffu));
            out[2 * i + 1] = f16_bits_to_f32((unsigned short)(w[i] >> 16));
        }
    }
};

// One block per row. Status bit 1: a row held NaN/+inf or only −inf; bit 2: target out of
// range or with logit −inf. Such rows get NaN outputs.
template <typename T>
__device__ void log_prob_entropy_row(const T* __restrict__ logits, long long vocab,
                                     float inv_t, const unsigned* __restrict__ targets,
                                     float* __restrict__ out_log_prob,
                                     float* __restrict__ out_entropy,
                                     unsigned* __restrict__ status) {
    const long long row = blockIdx.x;
    const T* x = logits + row * vocab;
    const float scale = inv_t * LOG2E;
    const int VEC = Vec16<T>::N;

    Online st = {NEG_INF, 0.0f, 0.0f};
    int bad = 0;

    // scalar head until 16-byte aligned, vector body, scalar tail
    long long head = (long long)(((16 - ((unsigned long long)x & 15)) & 15) / sizeof(T));
    if (head > vocab) head = vocab;
    long long body = ((vocab - head) / VEC) * VEC;
    for (long long i = threadIdx.x; i < head; i += blockDim.x) {
        float y = to_f32(x[i]) * scale;
        bad |= !(y < POS_INF);
        online_rescale(st, y);
        online_add(st, y);
    }
    const T* xb = x + head;
    for (long long i = (long long)threadIdx.x * VEC; i < body; i += (long long)blockDim.x * VEC) {
        float y[Vec16<T>::N];
        Vec16<T>::load(xb + i, y);
        float bm = NEG_INF;
        #pragma unroll
        for (int k = 0; k < VEC; k++) {
            y[k] *= scale;
            bad |= !(y[k] < POS_INF);
            bm = fmaxf(bm, y[k]);
        }
        online_rescale(st, bm);
        #pragma unroll
        for (int k = 0; k < VEC; k++) online_add(st, y[k]);
    }
    for (long long i = head + body + threadIdx.x; i < vocab; i += blockDim.x) {
        float y = to_f32(x[i]) * scale;
        bad |= !(y < POS_INF);
        online_rescale(st, y);
        online_add(st, y);
    }

    st = warp_merge(st);
    bad = __any_sync(0xffffffffu, bad);
    __shared__ Online warp_states[32];
    __shared__ int warp_bad[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { warp_states[warp] = st; warp_bad[warp] = bad; }
    __syncthreads();
    if (warp == 0) {
        const int nwarps = (blockDim.x + 31) >> 5;
        Online w = lane < nwarps ? warp_states[lane] : Online{NEG_INF, 0.0f, 0.0f};
        int b = lane < nwarps ? warp_bad[lane] : 0;
        w = warp_merge(w);
        b = __any_sync(0xffffffffu, b);
        if (lane == 0) {
            float nan = __int_as_float(0x7fffffff);
            if (b || w.m == NEG_INF) {
                out_entropy[row] = nan;
                if (out_log_prob) out_log_prob[row] = nan;
                atomicOr(status, 1u);
                return;
            }
            float log2_s = log2_approx(w.s);
            float h = LN2 * (log2_s - w.u / w.s);
            out_entropy[row] = h > 0.0f ? h : 0.0f;
            if (out_log_prob) {
                unsigned id = targets[row];
                float yt = id < vocab ? to_f32(x[id]) * scale : NEG_INF;
                if (yt == NEG_INF) {
                    out_log_prob[row] = nan;
                    atomicOr(status, 2u);
                } else {
                    out_log_prob[row] = LN2 * ((yt - w.m) - log2_s);
                }
            }
        }
    }
}

extern "C" __global__ void log_prob_entropy_f32(const float* logits, long long vocab, float inv_t,
                                                const unsigned* targets, float* out_log_prob,
                                                float* out_entropy, unsigned* status) {
    log_prob_entropy_row<float>(logits, vocab, inv_t, targets, out_log_prob, out_entropy, status);
}

extern "C" __global__ void log_prob_entropy_bf16(const bf16_t* logits, long long vocab, float inv_t,
                                                 const unsigned* targets, float* out_log_prob,
                                                 float* out_entropy, unsigned* status) {
    log_prob_entropy_row<bf16_t>(logits, vocab, inv_t, targets, out_log_prob, out_entropy, status);
}

extern "C" __global__ void log_prob_entropy_f16(const half_t* logits, long long vocab, float inv_t,
                                                const unsigned* targets, float* out_log_prob,
                                                float* out_entropy, unsigned* status) {
    log_prob_entropy_row<half_t>(logits, vocab, inv_t, targets, out_log_prob, out_entropy, status);
}

// ---------------------------------------------------------------------------------------
// Entropy windows + HWE (docs/algorithms.md §1). One thread per token; grid x = rows, y = column blocks.
// W_t = mean of H over the window (t+1..t+w, or t..t+w−1 with includes_self); complete iff
// every window position is inside the row with mask 1 and mask[t] = 1. HWE iff complete,
// W_t ≥ tau and (trigger == null or trigger[t] = 1). Per row: HWE count and soft cost
// Σ_HWE (W_t − tau). tau is ignored (no HWE outputs written) when hwe_mask == null.
extern "C" __global__ void entropy_windows(const float* __restrict__ entropy,
                                           const float* __restrict__ mask, long long cols,
                                           int window, int includes_self, float tau,
                                           const float* __restrict__ trigger,
                                           float* __restrict__ out_means,
                                           float* __restrict__ out_valid,
                                           float* __restrict__ hwe_mask,
                                           float* __restrict__ row_counts,
                                           float* __restrict__ row_soft_cost) {
    const long long row = blockIdx.x;
    const long long t = (long long)blockIdx.y * blockDim.x + threadIdx.x;
    const float* h = entropy + row * cols;
    const float* m = mask + row * cols;
    float count = 0.0f, cost = 0.0f;
    if (t < cols) {
        const long long start = includes_self ? t : t + 1;
        bool complete = m[t] == 1.0f && start + window <= cols;
        float sum = 0.0f;
        if (complete) {
            for (int k = 0; k < window; k++) {
                complete = complete && m[start + k] == 1.0f;
                sum += h[start + k];
            }
        }
        const float w = complete ? sum / (float)window : 0.0f;
        out_means[row * cols + t] = w;
        out_valid[row * cols + t] = complete ? 1.0f : 0.0f;
        if (hwe_mask) {
            const bool cand = complete && (trigger == 0 || trigger[row * cols + t] == 1.0f);
            const bool hwe = cand && w >= tau;
            hwe_mask[row * cols + t] = hwe ? 1.0f : 0.0f;
            count = hwe ? 1.0f : 0.0f;
            cost = hwe ? w - tau : 0.0f;
        }
    }
    if (hwe_mask) {
        for (int off = 16; off > 0; off >>= 1) {
            count += __shfl_xor_sync(0xffffffffu, count, off);
            cost += __shfl_xor_sync(0xffffffffu, cost, off);
        }
        if ((threadIdx.x & 31) == 0 && count > 0.0f) {
            atomicAdd(row_counts + row, count);
            atomicAdd(row_soft_cost + row, cost);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Per-row percentile of the complete-window means (numpy linear interpolation), one block
// per row: valid values are gathered into shared memory, bitonic-sorted, interpolated.
// Rows without a complete window get has = 0 and threshold 0. Shared memory: next power of
// two ≥ cols floats (set by the launcher).
extern "C" __global__ void row_percentile(const float* __restrict__ means,
                                          const float* __restrict__ valid, long long cols,
                                          int padded, float q, float* __restrict__ out_threshold,
                                          float* __restrict__ out_has) {
    extern __shared__ float buf[];
    __shared__ int n_valid;
    const long long row = blockIdx.x;
    if (threadIdx.x == 0) n_valid = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < padded; i += blockDim.x) buf[i] = POS_INF;
    __syncthreads();
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) {
        if (valid[row * cols + i] == 1.0f) {
            int slot = atomicAdd(&n_valid, 1);
            buf[slot] = means[row * cols + i];
        }
    }
    __syncthreads();
    for (int k = 2; k <= padded; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < padded; i += blockDim.x) {
                int p = i ^ j;
                if (p > i) {
                    float a = buf[i], b = buf[p];
                    bool up = (i & k) == 0;
                    if ((a > b) == up) { buf[i] = b; buf[p] = a; }
                }
            }
            __syncthreads();
        }
    }
    if (threadIdx.x == 0) {
        int n = n_valid;
        if (n == 0) {
            out_threshold[row] = 0.0f;
            out_has[row] = 0.0f;
        } else {
            double hpos = (double)(n - 1) * (double)q / 100.0;
            int lo = (int)floor(hpos);
            int hi = lo + 1 < n ? lo + 1 : n - 1;
            double frac = hpos - (double)lo;
            double a = buf[lo], b = buf[hi];
            out_threshold[row] = (float)(a + (b - a) * frac);
            out_has[row] = 1.0f;
        }
    }
}

// ---------------------------------------------------------------------------------------
// Masked dynamic KL (docs/algorithms.md §4), one block per row. δ = logp − ref; k by estimator
// (0 k1, 1 abs, 2 k2, 3 k3 with clamps); weight β_row·(hwe ? low_ratio : 1)·mask.
// Outputs: optional per-token k (out_kl) and β_t·k_t (out_weighted); per row Σ β_t·k_t and
// mean of k over valid tokens (0 for an empty row); total Σ over rows of the weighted sums,
// reduced in row order by the last block to finish (deterministic).
__device__ __forceinline__ float kl_estimate(float logp, float ref, int est) {
    float d = logp - ref;
    if (est == 0) return d;
    if (est == 1) return fabsf(d);
    if (est == 2) return 0.5f * d * d;
    float x = fminf(fmaxf(-d, -20.0f), 20.0f);
    float k = expf(x) - x - 1.0f;
    return fminf(fmaxf(k, -10.0f), 10.0f);
}

// One token: k (0 on padding), the weighted value β_t·k_t, and the row accumulators.
__device__ __forceinline__ void kl_token(float logp, float ref, float m, float h, float beta,
                                         float low_ratio, int est, float& k, float& weighted,
                                         float& wsum, float& ksum, float& n) {
    k = m != 0.0f ? kl_estimate(logp, ref, est) : 0.0f;
    const float w = beta * (h == 1.0f ? low_ratio : 1.0f) * m;
    weighted = w * k;
    wsum += weighted;
    ksum += k;
    n += m;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nwarps = (blockDim.x + 31) >> 5;
    v = threadIdx.x < nwarps ? scratch[threadIdx.x] : 0.0f;
    if (warp == 0)
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;  // valid in thread 0
}

extern "C" __global__ void masked_dynamic_kl(const float* __restrict__ logp,
                                             const float* __restrict__ ref,
                                             const float* __restrict__ mask,
                                             const float* __restrict__ hwe,
                                             const float* __restrict__ beta_rows,
                                             float low_ratio, int estimator, long long cols,
                                             float* __restrict__ out_kl,
                                             float* __restrict__ out_weighted,
                                             float* __restrict__ row_weighted_sum,
                                             float* __restrict__ row_mean_kl,
                                             float* __restrict__ total,
                                             unsigned* __restrict__ blocks_done) {
    __shared__ float scratch[32];
    __shared__ bool is_last;
    const long long row = blockIdx.x;
    const long long base = row * cols;
    const float beta = beta_rows[row];
    float wsum = 0.0f, ksum = 0.0f, n = 0.0f;
    // Callers pass views at any offset: the vector path needs every stream 16-byte aligned.
    const unsigned long long addr_bits =
        (unsigned long long)logp | (unsigned long long)ref | (unsigned long long)mask |
        (unsigned long long)hwe | (unsigned long long)out_kl | (unsigned long long)out_weighted;
    if ((cols & 3) == 0 && (addr_bits & 15) == 0) {
        // rows start 16-byte aligned: four tokens per 16-byte load of each stream
        const long long base4 = base >> 2, cols4 = cols >> 2;
        const float4* lp4 = reinterpret_cast<const float4*>(logp) + base4;
        const float4* rf4 = reinterpret_cast<const float4*>(ref) + base4;
        const float4* m4 = reinterpret_cast<const float4*>(mask) + base4;
        const float4* h4 = hwe != 0 ? reinterpret_cast<const float4*>(hwe) + base4 : 0;
        for (long long i = threadIdx.x; i < cols4; i += blockDim.x) {
            const float4 a = __ldcs(lp4 + i), b = __ldcs(rf4 + i), m = __ldcs(m4 + i);
            const float4 h = h4 != 0 ? __ldcs(h4 + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            float4 k, w;
            kl_token(a.x, b.x, m.x, h.x, beta, low_ratio, estimator, k.x, w.x, wsum, ksum, n);
            kl_token(a.y, b.y, m.y, h.y, beta, low_ratio, estimator, k.y, w.y, wsum, ksum, n);
            kl_token(a.z, b.z, m.z, h.z, beta, low_ratio, estimator, k.z, w.z, wsum, ksum, n);
            kl_token(a.w, b.w, m.w, h.w, beta, low_ratio, estimator, k.w, w.w, wsum, ksum, n);
            if (out_kl) reinterpret_cast<float4*>(out_kl)[base4 + i] = k;
            if (out_weighted) reinterpret_cast<float4*>(out_weighted)[base4 + i] = w;
        }
    } else {
        for (long long t = threadIdx.x; t < cols; t += blockDim.x) {
            const float h = hwe != 0 ? hwe[base + t] : 0.0f;
            float k, w;
            kl_token(logp[base + t], ref[base + t], mask[base + t], h, beta, low_ratio, estimator,
                     k, w, wsum, ksum, n);
            if (out_kl) out_kl[base + t] = k;
            if (out_weighted) out_weighted[base + t] = w;
        }
    }
    wsum = block_sum(wsum, scratch);
    ksum = block_sum(ksum, scratch);
    n = block_sum(n, scratch);
    if (threadIdx.x == 0) {
        row_weighted_sum[row] = wsum;
        row_mean_kl[row] = n > 0.0f ? ksum / n : 0.0f;
        __threadfence();
        unsigned done = atomicAdd(blocks_done, 1u);
        is_last = done == gridDim.x - 1;
    }
    __syncthreads();
    if (is_last) {
        // last block: deterministic total in row order, then reset the counter for reuse
        float acc = 0.0f;
        for (long long r = threadIdx.x; r < gridDim.x; r += blockDim.x)
            acc += ((volatile float*)row_weighted_sum)[r];
        acc = block_sum(acc, scratch);
        if (threadIdx.x == 0) {
            *total = acc;
            *blocks_done = 0u;
        }
    }
}
