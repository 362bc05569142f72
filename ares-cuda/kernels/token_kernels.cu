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
    ARES_DYNAMIC_SHARED(float, buf);
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
// Exponentials and KL estimators as ares-core computes them (its polynomial `exp` and
// `exp_m1_minus_x` in f32, no fused multiply-adds), so the KL kernels give core's k_t to the
// bit: `eˣ − 1 − x` from libm's eˣ would cancel to a relative error of 1e-5 where δ is small.
#define LOSS_LOG2E 1.4426950408889634f
#define LOSS_LN2_HI 0.693145751953125f
#define LOSS_LN2_LO 1.4286068203094173e-6f

// core's `exp_bounded` in f32: eˣ by a degree-8 Taylor polynomial of the reduced argument
// times an exact 2ⁿ (|x| ≤ 40).
__device__ __forceinline__ float loss_exp(float x) {
    const float n = rintf(__fmul_rn(x, LOSS_LOG2E));
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, LOSS_LN2_HI)), __fmul_rn(n, LOSS_LN2_LO));
    const float c[9] = {2.48015873015873e-05f, 0.0001984126984126984f, 0.001388888888888889f,
                        0.008333333333333333f, 0.041666666666666664f, 0.16666666666666666f,
                        0.5f, 1.0f, 1.0f};
    float p = 0.0f;
#pragma unroll
    for (int k = 0; k < 9; k++) p = __fadd_rn(__fmul_rn(p, r), c[k]);
    return __fmul_rn(p, ldexpf(1.0f, (int)n));
}

// core's `exp_m1_minus_x` in f32 for x ∈ [−12, 3]: (eˣ − 1 − x, eˣ − 1).
__device__ __forceinline__ void loss_expm1_minus_x(float x, float& k, float& em1) {
    const float n = rintf(__fmul_rn(x, LOSS_LOG2E));
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, LOSS_LN2_HI)), __fmul_rn(n, LOSS_LN2_LO));
    const float c[5] = {(float)(1.0 / 720.0), (float)(1.0 / 120.0), (float)(1.0 / 24.0),
                        (float)(1.0 / 6.0), 0.5f};
    float h = (float)(1.0 / 5040.0);
#pragma unroll
    for (int i = 0; i < 5; i++) h = __fadd_rn(__fmul_rn(h, r), c[i]);
    const float r2h = __fmul_rn(__fmul_rn(r, r), h);
    const float q = __fadd_rn(r, r2h);
    const float s = ldexpf(1.0f, (int)n);
    em1 = __fadd_rn(__fmul_rn(s, q), __fsub_rn(s, 1.0f));
    k = n == 0.0f ? r2h : __fsub_rn(em1, x);
}

// A KL estimator's value and derivative in δ = logπ − logπ_ref (core's `kl_penalty_and_grad`):
// 0 k1, 1 abs, 2 k2, 3 k3, 4 k1+, 5 k3+.
__device__ __forceinline__ void loss_kl(float d, int est, float& k, float& g) {
    if (est == 0) { k = d; g = 1.0f; return; }
    if (est == 1) { k = fabsf(d); g = d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : 0.0f); return; }
    if (est == 2) { k = __fmul_rn(__fmul_rn(d, d), 0.5f); g = d; return; }
    if (est == 4) { k = d; g = d; return; }
    float x = -d;
    x = x > 3.0f ? 3.0f : x;
    x = x < -12.0f ? -12.0f : x;
    float v, em1;
    loss_expm1_minus_x(x, v, em1);
    const bool clamped = v > 10.0f;
    k = clamped ? 10.0f : v;
    g = est == 5 ? d : (clamped ? 0.0f : -em1);
}


// ---------------------------------------------------------------------------------------
// Masked dynamic KL (docs/algorithms.md §4), one block per row. δ = logp − ref; k by estimator
// (0 k1, 1 abs, 2 k2, 3 k3 with clamps); weight β_row·(hwe ? low_ratio : 1)·mask.
// Outputs: optional per-token k (out_kl) and β_t·k_t (out_weighted); per row Σ β_t·k_t and
// mean of k over valid tokens (0 for an empty row); total Σ over rows of the weighted sums,
// reduced in row order by the last block to finish (deterministic).
__device__ __forceinline__ float kl_estimate(float logp, float ref, int est) {
    float k, g;
    loss_kl(logp - ref, est, k, g);
    return k;
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

// ---------------------------------------------------------------------------------------
// The actor's loss on the device (docs/algorithms.md §4, §6, §16): the policy loss of
// `ares_core::loss` (PPO clip / dual clip, CISPO, GSPO, GSPO-token) with the rollout
// importance correction, the forking-token mask, the dynamic token-level KL term and the
// entropy bonus, aggregated by `loss_agg_mode`, with ∂L/∂logπ per token. Two launches:
// `mask_row_counts` (valid tokens per row; resets the status words), for Clip-Cov and KL-Cov
// `cov_select` (their tokens, chosen over the whole micro-batch), then `policy_loss`, one
// block per row. The per-token arithmetic is core's, operation for operation (its
// polynomial `exp`, no fused multiply-adds), so a token's gradient is core's to the bit
// except GSPO's (its sequence ratio sums a row); the sums differ in order only.

// Status word 1 bits (status word 0: the smallest flat index of a bad valid token).
#define LOSS_BAD_LOGP 1u
#define LOSS_BAD_LOGP_OLD 2u
#define LOSS_BAD_ADVANTAGES 4u
#define LOSS_BAD_ROLLOUT 8u
#define LOSS_BAD_REF 16u
#define LOSS_BAD_ENTROPY 32u
#define LOSS_BAD_MASK 64u
#define LOSS_BAD_KEEP 128u
#define LOSS_BAD_HWE 256u
#define LOSS_BAD_BETA 512u
// Per-row statistics, and the totals over rows (same order).
#define LOSS_STATS 10
// 0 policy loss, 1 KL term agg(β_t·k_t), 2 agg(H), 3 clipped tokens, 4 dual-clipped tokens,
// 5 Σ −clamp(logπ − logπ_old), 6 Σ importance weights, 7 tokens whose weight changed,
// 8 tokens chosen by covariance (Clip-Cov, KL-Cov), 9 valid tokens
// Policy losses (`kind`): 0 PPO clip / dual clip, 1 CISPO, 2 GSPO (sequence), 3 GSPO-token,
// 4 Clip-Cov, 5 KL-Cov.
#define LOSS_CLIP_COV 4
#define LOSS_KL_COV 5

// PPO's clipped surrogate for a ratio r > 0: (max(L1, L2), slope, L2 > L1).
__device__ __forceinline__ void loss_surrogate(float ratio, float a, float lo, float hi,
                                               float& loss, float& slope, bool& clipped) {
    const float neg_a = -a;
    const float l1 = __fmul_rn(neg_a, ratio);
    const float l2 = __fmul_rn(neg_a, fminf(fmaxf(ratio, lo), hi));
    clipped = l2 > l1;
    loss = clipped ? l2 : l1;
    slope = clipped ? 0.0f : l1;
}

// The rollout importance weight for d = logπ_old − logπ_rollout: 0 none, 1 tis, 2 icepop,
// 3 reinforce_pro.
__device__ __forceinline__ float loss_is_weight(float d, int mode, float low, float high,
                                                bool& changed) {
    changed = false;
    if (mode == 0) return 1.0f;
    const float w = loss_exp(fminf(fmaxf(d, -20.0f), 20.0f));
    if (mode == 1) {
        changed = w > high;
        return changed ? high : w;
    }
    if (mode == 2) {
        changed = !(w >= low && w <= high);
        return changed ? 0.0f : w;
    }
    if (w < low) { changed = true; return low; }
    if (w > high) { changed = true; return high; }
    return w;
}

// Σ of v over the block, in every thread.
__device__ __forceinline__ float block_sum_all(float v, float* scratch) {
    __shared__ float result;
    v = block_sum(v, scratch);
    if (threadIdx.x == 0) result = v;
    __syncthreads();
    v = result;
    __syncthreads();
    return v;
}

// Valid tokens (mask ≠ 0) of each row, one block per row; block 0 also resets the status
// words that `policy_loss` reports through.
extern "C" __global__ void mask_row_counts(const float* __restrict__ mask, long long cols,
                                           float* __restrict__ counts,
                                           unsigned* __restrict__ status) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * cols;
    float n = 0.0f;
    for (long long t = threadIdx.x; t < cols; t += blockDim.x) n += mask[base + t] != 0.0f;
    n = block_sum(n, scratch);
    if (threadIdx.x == 0) {
        counts[blockIdx.x] = n;
        if (blockIdx.x == 0) {
            status[0] = 0xffffffffu;
            status[1] = 0u;
        }
    }
}

// Marks a bad input at flat index i.
__device__ __forceinline__ void loss_bad(unsigned* status, long long i, unsigned bit) {
    atomicMin(status, (unsigned)i);
    atomicOr(status + 1, bit);
}

// ---------------------------------------------------------------------------------------
// Clip-Cov's and KL-Cov's tokens (docs/algorithms.md §12.3, §12.4; core's `clip_cov_loss` and
// `kl_cov_loss`), one block for the whole micro-batch: a few passes over its tokens, each
// recomputing what it needs (no scratch beyond the output). The means of A and logπ over the
// valid tokens are summed in f64 and rounded once, as core takes them;
// cov_t = (A_t − Ā)·(logπ_t − mean logπ) in f32. Candidates: KL-Cov every valid token;
// Clip-Cov the valid tokens PPO's clip left unclipped with lb < cov_t < ub. Each candidate has
// a 96-bit key — KL-Cov: its covariance descending (IEEE total order, as `total_cmp`), then
// its flat index; Clip-Cov: SplitMix64 of seed + (t + 1)·φ, then its flat index — unique, so
// "the k = max(⌊ratio·N⌋, 1) smallest keys" is one set: all candidates when there are at most
// k, else those up to the k-th smallest key, found 8 bits at a time (12 passes, a shared
// histogram each). `selected` [n] gets 1 there and 0 elsewhere (padding included).

// Σ v over the block in f64, in every thread (a fixed tree: deterministic). `sh`: 32 doubles.
__device__ __forceinline__ double cov_block_sum(double v, double* sh) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    const int nwarps = (blockDim.x + 31) >> 5;
    v = lane < nwarps ? sh[lane] : 0.0;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// core's `selection_key`: the SplitMix64 output for seed + (i + 1)·φ (wrapping).
__device__ __forceinline__ unsigned long long cov_splitmix(unsigned long long seed,
                                                           long long i) {
    unsigned long long z = seed + ((unsigned long long)i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Whether token i is a candidate, and then the high 64 bits of its key (the low 32 are i).
__device__ __forceinline__ bool cov_candidate(const float* __restrict__ logp,
                                              const float* __restrict__ logp_old,
                                              const float* __restrict__ advantages,
                                              const float* __restrict__ mask, long long i,
                                              int kind, float mean_a, float mean_l, float lo,
                                              float hi, float lb, float ub,
                                              unsigned long long seed,
                                              unsigned long long& key) {
    if (mask[i] == 0.0f) return false;
    const float a = advantages[i], lp = logp[i];
    const float cov = __fmul_rn(__fsub_rn(a, mean_a), __fsub_rn(lp, mean_l));
    if (kind == LOSS_KL_COV) {
        // ascending IEEE total order, then complemented: the largest covariance first
        unsigned u = __float_as_uint(cov);
        u ^= (u >> 31) != 0u ? 0xffffffffu : 0x80000000u;
        key = (unsigned long long)(~u);
        return true;
    }
    const float l = fminf(fmaxf(lp - logp_old[i], -20.0f), 20.0f);
    float lc, slope;
    bool clipped;
    loss_surrogate(loss_exp(l), a, lo, hi, lc, slope, clipped);
    if (clipped || !(cov > lb && cov < ub)) return false;
    key = cov_splitmix(seed, i);
    return true;
}

// kind: LOSS_CLIP_COV or LOSS_KL_COV; clip_lo / clip_hi: ε_low, ε_high (Clip-Cov's candidates);
// ratio: the budget's fraction, widened from the loss's f32 (the product ratio·N in f64, as
// core). n < 2^32. Launch: one block (a multiple of 32 threads).
extern "C" __global__ void cov_select(const float* __restrict__ logp,
                                      const float* __restrict__ logp_old,
                                      const float* __restrict__ advantages,
                                      const float* __restrict__ mask, long long n, int kind,
                                      float clip_lo, float clip_hi, float lb, float ub,
                                      unsigned long long seed, double ratio,
                                      float* __restrict__ selected) {
    __shared__ double sh[32];
    __shared__ unsigned hist[256];
    // the k-th smallest key, decided 8 bits at a time: its bits so far, which bits those are,
    // and its rank among the candidates that share them
    __shared__ unsigned long long pre_hi, known_hi, rank;
    __shared__ unsigned pre_lo, known_lo;
    double sa = 0.0, sl = 0.0, valid = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        if (mask[i] == 0.0f) continue;
        sa += (double)advantages[i];
        sl += (double)logp[i];
        valid += 1.0;
    }
    sa = cov_block_sum(sa, sh);
    sl = cov_block_sum(sl, sh);
    valid = cov_block_sum(valid, sh);
    const float mean_a = (float)(sa / valid), mean_l = (float)(sl / valid);
    const float lo = 1.0f - clip_lo, hi = 1.0f + clip_hi;
    double count = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        unsigned long long key;
        count += cov_candidate(logp, logp_old, advantages, mask, i, kind, mean_a, mean_l, lo, hi,
                               lb, ub, seed, key)
                     ? 1.0
                     : 0.0;
    }
    count = cov_block_sum(count, sh);
    long long k = (long long)(ratio * valid);
    if (k < 1) k = 1;
    const bool all = count <= (double)k;
    if (threadIdx.x == 0) {
        pre_hi = known_hi = 0ull;
        pre_lo = known_lo = 0u;
        rank = (unsigned long long)k;
    }
    __syncthreads();
    for (int pass = 0; pass < 12 && !all; pass++) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0u;
        __syncthreads();
        for (long long i = threadIdx.x; i < n; i += blockDim.x) {
            unsigned long long key;
            if (!cov_candidate(logp, logp_old, advantages, mask, i, kind, mean_a, mean_l, lo, hi,
                               lb, ub, seed, key))
                continue;
            if ((key & known_hi) != pre_hi || ((unsigned)i & known_lo) != pre_lo) continue;
            const unsigned digit = pass < 8 ? (unsigned)(key >> (56 - 8 * pass)) & 255u
                                            : ((unsigned)i >> (24 - 8 * (pass - 8))) & 255u;
            atomicAdd(&hist[digit], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // the digit whose bin holds the rank-th key (the bins sum to at least the rank)
            unsigned long long r = rank;
            unsigned digit = 0u;
            while (digit < 255u && hist[digit] < r) r -= hist[digit++];
            rank = r;
            if (pass < 8) {
                pre_hi |= (unsigned long long)digit << (56 - 8 * pass);
                known_hi |= 255ull << (56 - 8 * pass);
            } else {
                pre_lo |= digit << (24 - 8 * (pass - 8));
                known_lo |= 255u << (24 - 8 * (pass - 8));
            }
        }
        __syncthreads();
    }
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        unsigned long long key;
        bool chosen = cov_candidate(logp, logp_old, advantages, mask, i, kind, mean_a, mean_l, lo,
                                    hi, lb, ub, seed, key);
        if (chosen && !all) chosen = key < pre_hi || (key == pre_hi && (unsigned)i <= pre_lo);
        selected[i] = chosen ? 1.0f : 0.0f;
    }
}

// kind: see LOSS_CLIP_COV above; 4 and 5 read `selected` (`cov_select`'s output) and
// `cov_coef` (KL-Cov's coefficient).
// agg: 0 token-mean, 1 token-sum, 2 seq-mean-token-sum, 3 seq-mean-token-mean,
// 4 seq-mean-token-sum-norm. clip_c = 0: no dual clip. `rollout` is read iff is_mode ≠ 0;
// `keep` (forking mask), `ref` (with `beta_rows`; `hwe` optional) and `entropy` (with
// `entropy_grad`) are optional. `grad` = scale · ∂L/∂logπ, `entropy_grad` = scale · ∂L/∂H
// (0 on padding), all 0 when the report is refused (a status bit, a non-finite total);
// `row_stats` [rows, LOSS_STATS] and `totals` [LOSS_STATS] unscaled; `report` ≠ 0: `totals`
// has two more words, where the status words' bits are copied.
extern "C" __global__ void policy_loss(
    const float* __restrict__ logp, const float* __restrict__ logp_old,
    const float* __restrict__ advantages, const float* __restrict__ mask,
    const float* __restrict__ rollout, const float* __restrict__ keep,
    const float* __restrict__ ref, const float* __restrict__ hwe,
    const float* __restrict__ beta_rows, const float* __restrict__ entropy,
    const float* __restrict__ selected, const float* __restrict__ row_counts, long long rows,
    long long cols, int kind, float clip_lo, float clip_hi, float clip_c, int is_mode,
    float is_low, float is_high, int agg, int kl_est, float low_ratio, float entropy_coef,
    float scale, float cov_coef, float* __restrict__ grad, float* __restrict__ entropy_grad,
    float* __restrict__ row_stats, float* __restrict__ totals, int report,
    unsigned* __restrict__ status, unsigned* __restrict__ blocks_done) {
    __shared__ float scratch[32];
    __shared__ bool is_last;
    const long long row = blockIdx.x;
    const long long base = row * cols;

    // the aggregation's normalisers: valid tokens and non-empty rows of the whole batch
    float valid = 0.0f, nonempty = 0.0f;
    for (long long r = threadIdx.x; r < rows; r += blockDim.x) {
        valid += row_counts[r];
        nonempty += row_counts[r] > 0.0f ? 1.0f : 0.0f;
    }
    valid = block_sum_all(valid, scratch);
    nonempty = block_sum_all(nonempty, scratch);
    const float n_r = row_counts[row];
    float weight;
    if (agg == 0) weight = 1.0f / valid;
    else if (agg == 1) weight = 1.0f;
    else if (agg == 2) weight = 1.0f / nonempty;
    else if (agg == 3) weight = (1.0f / nonempty) / fmaxf(n_r, 1.0f);
    else weight = 1.0f / (float)((double)nonempty * (double)cols);

    const float lo = 1.0f - clip_lo, hi = 1.0f + clip_hi;
    const bool dual = clip_c > 0.0f;
    float beta = 0.0f;
    if (ref != 0) {
        beta = beta_rows[row];
        if (!(beta >= 0.0f && beta - beta == 0.0f)) loss_bad(status, base, LOSS_BAD_BETA);
    }

    // GSPO: the row's mean log-ratio and advantage, and W = Σ weight·w over its tokens
    float inv_n = 0.0f, seq_loss = 0.0f, seq_slope = 0.0f, seq_ratio = 1.0f, row_w = 0.0f;
    bool seq_clipped = false, seq_live = false;
    if ((kind == 2 || kind == 3) && n_r > 0.0f) {
        float sum_d = 0.0f, sum_a = 0.0f;
        for (long long t = threadIdx.x; t < cols; t += blockDim.x) {
            const long long i = base + t;
            if (mask[i] == 0.0f) continue;
            sum_d += logp[i] - logp_old[i];
            sum_a += advantages[i];
            bool changed;
            const float w =
                loss_is_weight(is_mode != 0 ? logp_old[i] - rollout[i] : 0.0f, is_mode, is_low,
                               is_high, changed);
            row_w += __fmul_rn(weight, w);
        }
        sum_d = block_sum_all(sum_d, scratch);
        sum_a = block_sum_all(sum_a, scratch);
        row_w = block_sum_all(row_w, scratch);
        inv_n = 1.0f / n_r;
        const float mean = __fmul_rn(sum_d, inv_n);
        seq_live = mean <= 10.0f;
        seq_ratio = expf(fminf(mean, 10.0f));
        loss_surrogate(seq_ratio, __fmul_rn(sum_a, inv_n), lo, hi, seq_loss, seq_slope,
                       seq_clipped);
    }

    float s_loss = 0.0f, s_kl = 0.0f, s_ent = 0.0f, s_clip = 0.0f, s_dual = 0.0f;
    float s_approx = 0.0f, s_w = 0.0f, s_changed = 0.0f, s_selected = 0.0f;
    for (long long t = threadIdx.x; t < cols; t += blockDim.x) {
        const long long i = base + t;
        const float m = mask[i];
        if (!(m == 0.0f || m == 1.0f)) loss_bad(status, i, LOSS_BAD_MASK);
        if (keep != 0 && !(keep[i] == 0.0f || keep[i] == 1.0f)) loss_bad(status, i, LOSS_BAD_KEEP);
        if (hwe != 0 && ref != 0 && !(hwe[i] == 0.0f || hwe[i] == 1.0f))
            loss_bad(status, i, LOSS_BAD_HWE);
        if (m == 0.0f) {
            grad[i] = 0.0f;
            if (entropy_grad != 0) entropy_grad[i] = 0.0f;
            continue;
        }
        const float lp = logp[i], old = logp_old[i], a = advantages[i];
        unsigned bad = 0u;
        if (!(lp - lp == 0.0f)) bad |= LOSS_BAD_LOGP;
        if (!(old - old == 0.0f)) bad |= LOSS_BAD_LOGP_OLD;
        if (!(a - a == 0.0f)) bad |= LOSS_BAD_ADVANTAGES;
        if (is_mode != 0 && !(rollout[i] - rollout[i] == 0.0f)) bad |= LOSS_BAD_ROLLOUT;
        bool changed;
        const float w = loss_is_weight(is_mode != 0 ? old - rollout[i] : 0.0f, is_mode, is_low,
                                       is_high, changed);
        const float d = lp - old;
        const float l = fminf(fmaxf(d, -20.0f), 20.0f);
        float g = 0.0f;
        bool clipped = false, dual_clipped = false;
        if (kind == 0) {
            const bool live = d >= -20.0f && d <= 20.0f;
            float lc, slope;
            loss_surrogate(loss_exp(l), a, lo, hi, lc, slope, clipped);
            const float l3 = __fmul_rn(-a, clip_c);
            dual_clipped = dual && a < 0.0f && l3 < lc;
            const float tok_loss = dual_clipped ? l3 : lc;
            const float tok_grad = dual_clipped ? 0.0f : (live ? slope : 0.0f);
            s_loss = __fadd_rn(s_loss, __fmul_rn(w, tok_loss));
            g = __fmul_rn(weight, __fmul_rn(w, tok_grad));
        } else if (kind == 1) {
            const float ratio = loss_exp(l);
            const float cr = fminf(fmaxf(ratio, lo), hi);
            const float slope = -__fmul_rn(cr, a);
            const float ww = __fmul_rn(weight, w);
            s_loss = __fadd_rn(s_loss, __fmul_rn(__fmul_rn(ww, slope), lp));
            clipped = cr != ratio;
            g = __fmul_rn(ww, slope);
        } else if (kind == LOSS_CLIP_COV) {
            // PPO's surrogate without dual clip; a chosen token keeps neither loss nor
            // gradient (core: weight·w·keep·L)
            const bool live = d >= -20.0f && d <= 20.0f;
            float lc, slope;
            loss_surrogate(loss_exp(l), a, lo, hi, lc, slope, clipped);
            const float keep_t = selected[i] != 0.0f ? 0.0f : 1.0f;
            const float wk = __fmul_rn(__fmul_rn(weight, w), keep_t);
            s_loss = __fadd_rn(s_loss, __fmul_rn(wk, lc));
            g = __fmul_rn(wk, live ? slope : 0.0f);
            s_selected += 1.0f - keep_t;
        } else if (kind == LOSS_KL_COV) {
            // −A·r unclipped; a chosen token adds coef·|ℓ| (slope coef·sign ℓ)
            const bool live = d >= -20.0f && d <= 20.0f;
            const float neg_a_r = __fmul_rn(-a, loss_exp(l));
            float tl = neg_a_r, ts = live ? neg_a_r : 0.0f;
            if (selected[i] != 0.0f) {
                float k, kg;
                loss_kl(l, 1, k, kg);
                tl = __fadd_rn(tl, __fmul_rn(cov_coef, k));
                ts = __fadd_rn(ts, live ? __fmul_rn(cov_coef, kg) : 0.0f);
                s_selected += 1.0f;
            }
            const float ww = __fmul_rn(weight, w);
            s_loss = __fadd_rn(s_loss, __fmul_rn(ww, tl));
            g = __fmul_rn(ww, ts);
        } else {
            float tl = seq_loss, ts = seq_slope;
            clipped = seq_clipped;
            if (kind == 3) loss_surrogate(seq_ratio, a, lo, hi, tl, ts, clipped);
            s_loss = __fadd_rn(s_loss, __fmul_rn(__fmul_rn(weight, w), tl));
            if (seq_live)
                g = kind == 3 ? __fmul_rn(__fmul_rn(weight, w), ts)
                              : __fmul_rn(__fmul_rn(row_w, seq_slope), inv_n);
        }
        s_approx = __fsub_rn(s_approx, l);
        s_w = __fadd_rn(s_w, w);
        s_changed += changed ? 1.0f : 0.0f;
        s_clip += clipped ? 1.0f : 0.0f;
        s_dual += dual_clipped ? 1.0f : 0.0f;
        // forking tokens restrict the policy gradient only (docs/algorithms.md §16.1)
        if (keep != 0 && keep[i] == 0.0f) g = 0.0f;
        if (ref != 0) {
            const float dk = lp - ref[i];
            if (!(dk - dk == 0.0f)) bad |= LOSS_BAD_REF;
            float k, kg;
            loss_kl(dk, kl_est, k, kg);
            const float bt = (hwe != 0 && hwe[i] != 0.0f) ? __fmul_rn(beta, low_ratio) : beta;
            s_kl = __fadd_rn(s_kl, __fmul_rn(bt, k));
            g = __fadd_rn(g, __fmul_rn(__fmul_rn(bt, kg), weight));
        }
        grad[i] = __fmul_rn(g, scale);
        if (entropy != 0) {
            const float h = entropy[i];
            if (!(h - h == 0.0f)) bad |= LOSS_BAD_ENTROPY;
            s_ent = __fadd_rn(s_ent, h);
            entropy_grad[i] = __fmul_rn(__fmul_rn(-entropy_coef, weight), scale);
        }
        if (bad != 0u) loss_bad(status, i, bad);
    }

    float stats[LOSS_STATS] = {s_loss, s_kl,      s_ent,      s_clip, s_dual,
                               s_approx, s_w, s_changed, s_selected, 0.0f};
    for (int k = 0; k < LOSS_STATS - 1; k++) stats[k] = block_sum(stats[k], scratch);
    if (threadIdx.x == 0) {
        // PPO sums w·L and weighs the row once, as core does; the others weigh each token
        const float row_weight = n_r > 0.0f ? weight : 0.0f;
        if (kind == 0) stats[0] = __fmul_rn(stats[0], row_weight);
        stats[1] = __fmul_rn(stats[1], row_weight);
        stats[2] = __fmul_rn(stats[2], row_weight);
        stats[9] = n_r;
        for (int k = 0; k < LOSS_STATS; k++) row_stats[row * LOSS_STATS + k] = stats[k];
        __threadfence();
        const unsigned done = atomicAdd(blocks_done, 1u);
        is_last = done == gridDim.x - 1;
    }
    __syncthreads();
    if (is_last) {
        // the last block: totals in row order, then the counter reset for the next launch
        for (int k = 0; k < LOSS_STATS; k++) {
            float acc = 0.0f;
            for (long long r = threadIdx.x; r < rows; r += blockDim.x)
                acc += ((volatile float*)row_stats)[r * LOSS_STATS + k];
            acc = block_sum(acc, scratch);
            if (threadIdx.x == 0) totals[k] = acc;
        }
        // A report the caller will refuse (a flagged input, a loss, KL or entropy term that
        // is not finite) leaves every gradient 0, so a backward queued before the report is
        // read changes nothing.
        __shared__ int spoiled;
        if (threadIdx.x == 0) {
            __threadfence();
            const unsigned bits = ((volatile unsigned*)status)[1];
            spoiled = bits != 0u || !(fabsf(totals[0]) < POS_INF) ||
                      !(fabsf(totals[1]) < POS_INF) || !(fabsf(totals[2]) < POS_INF);
            if (report) {
                // the status words after the totals, as their bits: one read for both
                totals[LOSS_STATS] = __uint_as_float(((volatile unsigned*)status)[0]);
                totals[LOSS_STATS + 1] = __uint_as_float(bits);
            }
            *blocks_done = 0u;
        }
        __syncthreads();
        if (spoiled) {
            for (long long i = threadIdx.x; i < rows * cols; i += blockDim.x) {
                grad[i] = 0.0f;
                if (entropy_grad) entropy_grad[i] = 0.0f;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Advantage estimators (docs/algorithms.md §5; ares-core's `advantage` module), composed by
// ares-cuda/src/advantage_ops.rs from four steps: per-group scores, the token pass (broadcast,
// or KL folding + returns-to-go, with per-row moments), batch whitening, Pro Max's per-group
// α/β. Groups come from the host as `group_rows` + `offsets`: group g is the rows
// group_rows[offsets[g] .. offsets[g + 1]], in the order core visits them. Bad input is
// flagged in `status`: status[1] the bits below, status[0] the smallest flagged token (flat
// index), status[2] the smallest row with a non-finite reward (kept apart: core reports the
// rewards first, so their row must not mix with a token's index).
#define ADV_BAD_REWARD 1u   // non-finite reward (index: its row)
#define ADV_BAD_MASK 2u     // mask entry not 0/1
#define ADV_BAD_KL 4u       // non-finite weighted KL (any position)
#define ADV_EMPTY_ROW 8u    // a row without valid token where its reward needs one
#define ADV_BAD_VALUE 16u   // non-finite value (whitening input)
#define ADV_OVERFLOW 32u    // finite inputs whose results overflow
#define ADV_EMPTY_MASK 64u  // no valid token in the batch (whitening)

__device__ __forceinline__ void adv_bad_reward(unsigned* status, long long row) {
    atomicMin(status + 2, (unsigned)row);
    atomicOr(status + 1, ADV_BAD_REWARD);
}

// Per-sample scores, one thread per group, summed in core's order (`group_moments`: Σr in row
// order, mean = Σ/n, m2 = Σ(r − mean)² in row order; every step rounded as written, so the
// scores equal core's bit for bit). kind: 0 GRPO (r − mean)/(std + eps); 1 r − mean (Dr.GRPO,
// REINFORCE++-baseline); 2 RLOO (r − mean)·n/(n − 1); 3 Pro Max step 1 with uniform_scale
// (r/n where the unbiased std < uniform_std, else RLOO; `uniform[g]` = 1 there). A group of
// equal rewards gets 0 from kinds 0–2.
extern "C" __global__ void group_scores(const float* __restrict__ rewards,
                                        const int* __restrict__ group_rows,
                                        const int* __restrict__ offsets, int groups, int kind,
                                        float eps, float uniform_std,
                                        float* __restrict__ scores,
                                        unsigned char* __restrict__ uniform,
                                        unsigned* __restrict__ status) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    const int lo = offsets[g], hi = offsets[g + 1];
    const float first = rewards[group_rows[lo]];
    float sum = 0.0f;
    bool all_equal = true;
    for (int i = lo; i < hi; i++) {
        const int row = group_rows[i];
        const float r = rewards[row];
        if (!is_finite(r)) adv_bad_reward(status, row);
        sum = __fadd_rn(sum, r);
        all_equal &= r == first;
    }
    const float n = (float)(hi - lo);
    const float mean = __fdiv_rn(sum, n);
    float m2 = 0.0f;
    for (int i = lo; i < hi; i++) {
        const float d = __fsub_rn(rewards[group_rows[i]], mean);
        m2 = __fadd_rn(m2, __fmul_rn(d, d));
    }
    const float std = __fsqrt_rn(__fdiv_rn(m2, __fsub_rn(n, 1.0f)));
    const bool flat = kind == 3 && std < uniform_std;
    if (uniform != 0) uniform[g] = flat ? 1 : 0;
    const float denom = __fadd_rn(std, eps), loo = __fdiv_rn(n, __fsub_rn(n, 1.0f));
    for (int i = lo; i < hi; i++) {
        const int row = group_rows[i];
        const float r = rewards[row], d = __fsub_rn(r, mean);
        float a;
        if (flat) a = __fdiv_rn(r, n);
        else if (all_equal) a = 0.0f;
        else if (kind == 0) a = __fdiv_rn(d, denom);
        else if (kind == 1) a = d;
        else a = __fmul_rn(d, loo);
        scores[row] = a;
    }
}

// Count, mean and M2 (Σ (x − mean)², two passes) of a row's valid values; thread 0 writes
// them to moments[3·row ..]. Every thread calls it (block reductions).
__device__ void adv_row_moments(const float* __restrict__ v, const float* __restrict__ m,
                                long long cols, float* __restrict__ moments, long long row,
                                float* scratch) {
    float c = 0.0f, s = 0.0f;
    for (long long t = threadIdx.x; t < cols; t += blockDim.x) {
        const bool on = m[t] != 0.0f;
        c += on ? 1.0f : 0.0f;
        s += on ? v[t] : 0.0f;
    }
    c = block_sum_all(c, scratch);
    s = block_sum_all(s, scratch);
    const float mean = c > 0.0f ? s / c : 0.0f;
    float q = 0.0f;
    for (long long t = threadIdx.x; t < cols; t += blockDim.x) {
        const float d = v[t] - mean;
        q += m[t] != 0.0f ? d * d : 0.0f;
    }
    q = block_sum(q, scratch);
    if (threadIdx.x == 0) {
        moments[3 * row] = c;
        moments[3 * row + 1] = mean;
        moments[3 * row + 2] = q;
    }
}

// The token pass, one block per row (blockDim ≤ 1024). mode 0: out = score·m (GRPO's
// broadcast; a row may be empty). mode 1: token rewards R_t = (−k_t + [t = last]·score)·m_t
// (k = weighted KL, 0 when absent; last = the row's last valid token, which must exist) and
// returns-to-go G_t = R_t + γ·G_{t+1}, out = G·m: each thread takes one contiguous chunk of
// the row, its local return is carried across the chunks from the right by thread 0, and the
// chunk is recomputed from its carry. With γ = 1 and no KL every valid token up to the last
// holds exactly the score (core's broadcast). With `moments`, the row's moments of `out`
// (for the whitening of REINFORCE++). `check_scores`: the scores are the rewards as given
// (REINFORCE++), flagged if not finite.
extern "C" __global__ void token_returns(const float* __restrict__ scores,
                                         const float* __restrict__ mask,
                                         const float* __restrict__ kl, long long cols,
                                         float gamma, int mode, int check_scores,
                                         float* __restrict__ out,
                                         float* __restrict__ moments,
                                         unsigned* __restrict__ status) {
    __shared__ float scratch[32];
    __shared__ float carry[1024], chunk_g[1024], chunk_pow[1024];
    __shared__ long long last_valid;
    const long long row = blockIdx.x, base = row * cols;
    const float* m = mask + base;
    float* o = out + base;
    const float score = scores[row];
    // REINFORCE++'s scores are the rewards themselves (group_scores flags the others')
    if (check_scores && threadIdx.x == 0 && !is_finite(score))
        adv_bad_reward(status, row);
    if (threadIdx.x == 0) last_valid = -1;
    __syncthreads();
    long long last = -1;
    for (long long t = threadIdx.x; t < cols; t += blockDim.x) {
        const float w = m[t];
        if (w != 0.0f && w != 1.0f) loss_bad(status, base + t, ADV_BAD_MASK);
        if (kl != 0 && !is_finite(kl[base + t])) loss_bad(status, base + t, ADV_BAD_KL);
        if (w != 0.0f) last = t;
        if (mode == 0) {
            const float v = score * w;
            if (!is_finite(v)) loss_bad(status, base + t, ADV_OVERFLOW);
            o[t] = v;
        }
    }
    if (mode == 1) {
        if (last >= 0) atomicMax(&last_valid, last);
        __syncthreads();
        last = last_valid;
        if (last < 0) {
            if (threadIdx.x == 0) loss_bad(status, base, ADV_EMPTY_ROW);
            for (long long t = threadIdx.x; t < cols; t += blockDim.x) o[t] = 0.0f;
        } else {
            const long long chunk = (cols + blockDim.x - 1) / blockDim.x;
            const long long lo = threadIdx.x * chunk;
            const long long hi = lo + chunk < cols ? lo + chunk : cols;
            float g = 0.0f, pw = 1.0f;
            for (long long t = hi - 1; t >= lo; t--) {
                const float w = m[t];
                const float k = kl != 0 ? kl[base + t] : 0.0f;
                const float r = (t == last ? score - k : -k) * w;
                g = r + gamma * g;
                pw *= gamma;
            }
            chunk_g[threadIdx.x] = g;
            chunk_pow[threadIdx.x] = pw;
            __syncthreads();
            if (threadIdx.x == 0) {
                float c = 0.0f;
                for (int j = blockDim.x - 1; j >= 0; j--) {
                    carry[j] = c;
                    c = chunk_g[j] + chunk_pow[j] * c;
                }
            }
            __syncthreads();
            g = carry[threadIdx.x];
            for (long long t = hi - 1; t >= lo; t--) {
                const float w = m[t];
                const float k = kl != 0 ? kl[base + t] : 0.0f;
                const float r = (t == last ? score - k : -k) * w;
                g = r + gamma * g;
                const float v = g * w;
                if (!is_finite(v)) loss_bad(status, base + t, ADV_OVERFLOW);
                o[t] = v;
            }
        }
    }
    if (moments != 0) {
        __syncthreads();
        adv_row_moments(o, m, cols, moments, row, scratch);
    }
}

// Moments of each row of `values` for `masked_whiten`, one block per row; flags non-finite
// values (any position) and mask entries not 0/1.
extern "C" __global__ void masked_row_moments(const float* __restrict__ values,
                                              const float* __restrict__ mask, long long cols,
                                              float* __restrict__ moments,
                                              unsigned* __restrict__ status) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x, base = row * cols;
    for (long long t = threadIdx.x; t < cols; t += blockDim.x) {
        const float w = mask[base + t];
        if (!is_finite(values[base + t])) loss_bad(status, base + t, ADV_BAD_VALUE);
        if (w != 0.0f && w != 1.0f) loss_bad(status, base + t, ADV_BAD_MASK);
    }
    adv_row_moments(values + base, mask + base, cols, moments, row, scratch);
}

// Chan's merge of (count, mean, M2) in f64.
__device__ __forceinline__ void adv_merge(double& n, double& mean, double& m2, double nb,
                                          double mb, double m2b) {
    if (nb == 0.0) return;
    const double tot = n + nb, d = mb - mean;
    mean += d * (nb / tot);
    m2 += m2b + d * d * (n * nb / tot);
    n = tot;
}

// The whitening statistics of the batch, one block of 256 threads: the rows' moments merged
// in f64 (each thread a strided set of rows, then a fixed tree: deterministic) into
// stats = {μ, var (population), 1/√max(var, var_floor), valid tokens}. No valid token, or
// statistics that are not finite, are flagged; after any flag (an earlier kernel's on this
// stream included) stats[3] = 0 and `whiten_apply` changes nothing.
extern "C" __global__ void whiten_stats(const float* __restrict__ moments, long long rows,
                                        float var_floor, float* __restrict__ stats,
                                        unsigned* __restrict__ status) {
    __shared__ double sn[256], smean[256], sm2[256];
    double n = 0.0, mean = 0.0, m2 = 0.0;
    for (long long r = threadIdx.x; r < rows; r += blockDim.x)
        adv_merge(n, mean, m2, moments[3 * r], moments[3 * r + 1], moments[3 * r + 2]);
    sn[threadIdx.x] = n;
    smean[threadIdx.x] = mean;
    sm2[threadIdx.x] = m2;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            const int j = threadIdx.x + half;
            adv_merge(sn[threadIdx.x], smean[threadIdx.x], sm2[threadIdx.x], sn[j], smean[j],
                      sm2[j]);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const bool flagged = status[1] != 0;  // bad values, mask or rewards before this
        const double count = sn[0];
        const float mu = (float)smean[0];
        const float var = count > 0.0 ? (float)(sm2[0] / count) : 0.0f;
        const bool ok = count > 0.0 && is_finite(mu) && is_finite(var);
        // batch-wide flags carry no index (an earlier flag's stays); non-finite statistics
        // after an earlier flag are that flag's doing
        if (count == 0.0) atomicOr(status + 1, ADV_EMPTY_MASK);
        else if (!ok && !flagged) atomicOr(status + 1, ADV_OVERFLOW);
        stats[0] = mu;
        stats[1] = var;
        stats[2] = 1.0f / sqrtf(var > var_floor ? var : var_floor);
        stats[3] = ok && !flagged ? (float)count : 0.0f;
    }
}

// values = m·(values − μ)·rstd with the stats of `whiten_stats` (unchanged when it flagged).
extern "C" __global__ void whiten_apply(float* __restrict__ values,
                                        const float* __restrict__ mask, long long n,
                                        const float* __restrict__ stats) {
    if (stats[3] == 0.0f) return;
    const float mu = stats[0], rstd = stats[2];
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        values[i] = mask[i] * ((values[i] - mu) * rstd);
}

// Pro Max step 3 (docs/algorithms.md §5; core's `decide`), one block per group over token
// values already masked (the output of `token_returns`): sign sums S±, Q± and counts |P|, |N|,
// then α/β by core's rules (skip, same sign, small sums, ρ²Q⁻ capped, non-finite,
// clamp to [eps, max_scale]); a scaled group gets A ← α·A on P, β·A on N.
extern "C" __global__ void pro_max_normalize(float* __restrict__ values, long long cols,
                                             const int* __restrict__ group_rows,
                                             const int* __restrict__ offsets,
                                             const unsigned char* __restrict__ skip,
                                             float eps, float max_scale, float product_cap) {
    __shared__ float scratch[32];
    __shared__ unsigned long long counts[2];
    __shared__ float scale[3];
    const int g = blockIdx.x, lo = offsets[g], hi = offsets[g + 1];
    if (threadIdx.x == 0) counts[0] = counts[1] = 0;
    __syncthreads();
    float sp = 0.0f, sn = 0.0f, qp = 0.0f, qn = 0.0f;
    unsigned long long np = 0, nn = 0;
    for (int i = lo; i < hi; i++) {
        const float* v = values + (long long)group_rows[i] * cols;
        for (long long t = threadIdx.x; t < cols; t += blockDim.x) {
            const float a = v[t];
            if (a > 0.0f) { sp += a; qp += a * a; np++; }
            if (a < 0.0f) { sn += a; qn += a * a; nn++; }
        }
    }
    atomicAdd(&counts[0], np);
    atomicAdd(&counts[1], nn);
    sp = block_sum(sp, scratch);
    sn = block_sum(sn, scratch);
    qp = block_sum(qp, scratch);
    qn = block_sum(qn, scratch);
    if (threadIdx.x == 0) {
        float alpha = 1.0f, beta = 1.0f;
        bool scaled = false;
        const bool skipped = skip != 0 && skip[g] != 0;
        if (!skipped && counts[0] > 0 && counts[1] > 0 && fabsf(sp) >= eps && fabsf(sn) >= eps) {
            const float rho = sp / sn;
            float prod = rho * rho * qn;
            prod = prod > product_cap ? product_cap : prod;
            const float m = (float)(counts[0] + counts[1]);
            const float a = sqrtf(m / (qp + prod + eps));
            const float b = -a * rho;
            if (is_finite(a) && is_finite(b)) {
                alpha = a < eps ? eps : (a > max_scale ? max_scale : a);
                beta = b < eps ? eps : (b > max_scale ? max_scale : b);
                scaled = true;
            }
        }
        scale[0] = alpha;
        scale[1] = beta;
        scale[2] = scaled ? 1.0f : 0.0f;
    }
    __syncthreads();
    if (scale[2] == 0.0f) return;
    const float alpha = scale[0], beta = scale[1];
    for (int i = lo; i < hi; i++) {
        float* v = values + (long long)group_rows[i] * cols;
        for (long long t = threadIdx.x; t < cols; t += blockDim.x) {
            const float a = v[t];
            v[t] = a * (a > 0.0f ? alpha : beta);
        }
    }
}
