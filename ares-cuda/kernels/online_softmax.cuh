// Shared by token_kernels.cu and model_ops.cu (ares-cuda/src/kernels.rs puts it in front of
// each): the constants both use, `is_finite`, and the online softmax state of the fused log-prob +
// entropy, which the log-prob kernels and the decode step's pick both accumulate.

#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ bool is_finite(float x) { return fabsf(x) < POS_INF; }

// Dynamic shared memory; a CPU emulation of the kernels (ares-cuda/tests/emulate) defines
// its own, as it does for the inline PTX below.
#ifndef ARES_DYNAMIC_SHARED
#define ARES_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// 2^x with the hardware unit (max rel. error ~2^-22); 2^-inf = 0.
__device__ __forceinline__ float exp2_approx(float x) {
#ifdef ARES_EMULATE
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

__device__ __forceinline__ float log2_approx(float x) {
#ifdef ARES_EMULATE
    return log2f(x);
#else
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// IEEE half bits -> f32, exact (16-bit logits of both files' kernels).
__device__ __forceinline__ float f16_bits_to_f32(unsigned short x) {
#ifdef ARES_EMULATE
    _Float16 h;
    memcpy(&h, &x, 2);
    return (float)h;
#else
    float y;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(y) : "h"(x));
    return y;
#endif
}

// Online softmax state in base-2 units, y = z·log2(e):
//   s = Σ 2^(y−m),  u = Σ 2^(y−m)·(y−m),  m = running max.
struct Online {
    float m, s, u;
};

__device__ __forceinline__ void online_rescale(Online& st, float new_max) {
    if (new_max > st.m) {
        if (st.m != NEG_INF) {
            float shift = st.m - new_max;
            float c = exp2_approx(shift);
            st.u = c * (st.u + shift * st.s);
            st.s *= c;
        }
        st.m = new_max;
    }
}

__device__ __forceinline__ void online_add(Online& st, float y) {
    // clamping keeps 0·d finite for −∞ entries (and for m = −∞)
    float d = fmaxf(y - st.m, -1000.0f);
    float e = exp2_approx(d);
    st.s += e;
    st.u = fmaf(e, d, st.u);
}

__device__ __forceinline__ Online online_merge(Online a, Online b) {
    if (b.m == NEG_INF) return a;
    if (a.m == NEG_INF) return b;
    float m = fmaxf(a.m, b.m);
    float sa = a.m - m, sb = b.m - m;
    float ca = exp2_approx(sa), cb = exp2_approx(sb);
    Online r;
    r.m = m;
    r.s = ca * a.s + cb * b.s;
    r.u = ca * (a.u + sa * a.s) + cb * (b.u + sb * b.s);
    return r;
}

__device__ __forceinline__ Online warp_merge(Online st) {
    for (int off = 16; off > 0; off >>= 1) {
        Online o;
        o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
        o.s = __shfl_xor_sync(0xffffffffu, st.s, off);
        o.u = __shfl_xor_sync(0xffffffffu, st.u, off);
        st = online_merge(st, o);
    }
    return st;
}

