// CUDA C kernels on the CPU, for tests: the kernel sources of ares-cuda compile as C++20 with
// this header in front (g++ -DARES_EMULATE -include cuda_on_cpu.h) and run with one fiber
// per CUDA thread, so a kernel's indexing, barriers, warp shuffles, shared memory and
// last-block reductions execute as written, without a GPU.
//
// What it models, and what not:
// - one launch at a time (a process-wide lock); its blocks run one after another; a block's
//   threads are fibers on one OS thread that switch only at barriers: `__syncthreads` (the
//   whole block) and the warp ops;
// - `__shared__` is a function-level `static`: one copy, which is one per block because blocks
//   never overlap; dynamic shared memory (`ARES_DYNAMIC_SHARED`) is the launch's buffer;
// - warps are 32 consecutive linear thread ids; a `*_sync` warp op is a barrier of the warp
//   (every lane of the warp must reach it, as full-mask code on a GPU does);
// - atomics are `std::atomic_ref` (one OS thread: plain read-modify-writes would do);
//   `__threadfence` is a fence;
// - arithmetic is the host's IEEE single precision without contraction (-ffp-contract=off):
//   a GPU may fuse a·b + c into one FMA where the source does not forbid it, and its `expf`
//   and `logf` differ from glibc's in the last ulp, so results agree to rounding, not bits;
// - inline PTX is not understood: sources guard theirs with `#ifdef ARES_EMULATE`.
#pragma once

#include <ucontext.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct float4 {
    float x, y, z, w;
};
struct uint4 {
    unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace emu {

// A CUDA thread: a fiber with its own stack, switched to and from the scheduler.
struct Fiber {
    ucontext_t context;
    dim3 idx;
    bool done = false;
};

// A barrier: `expected` fibers arrive, the last one ends the phase.
struct Meeting {
    int expected = 0;
    int arrived = 0;
    unsigned long phase = 0;
};

inline dim3 grid_dim, block_dim, block_index;
inline std::vector<unsigned char> dynamic_shared;
inline ucontext_t scheduler;
inline Fiber* current = nullptr;
inline int current_linear = 0;
inline Meeting block_meeting;
inline std::vector<Meeting> warp_meetings;
// One slot per thread of the block for warp exchanges, and six words per thread for
// `mma.sync`'s fragments (sized by the launch: a fiber holds pointers into them across a
// switch, so they never reallocate mid-block).
inline std::vector<std::uint64_t> lane_slots;
inline std::vector<std::uint32_t> mma_words;
// `__syncthreads_count`'s tallies, one per barrier phase mod 3 (cleared at each block's
// start): the last fiber to arrive clears the slot of the phase after next, which every
// fiber finished reading a barrier ago.
inline int votes[3] = {0, 0, 0};
// Held by a launch: the state above is the process's (tests run in parallel).
inline std::mutex one_launch;
inline void (*fiber_body)(void*) = nullptr;
inline void* fiber_arg = nullptr;

inline void yield() { swapcontext(&current->context, &scheduler); }

// Waits until every member of `m` has arrived (the last to arrive goes straight on).
inline void meet(Meeting& m) {
    const unsigned long mine = m.phase;
    if (++m.arrived == m.expected) {
        m.arrived = 0;
        m.phase++;
        return;
    }
    while (m.phase == mine) yield();
}

inline void fiber_entry() {
    fiber_body(fiber_arg);
    current->done = true;
}

// Runs `body` as a launch of `grid` blocks of `threads` threads with `shared` bytes of
// dynamic shared memory. A block's threads run as fibers on the calling thread, switched at
// barriers only, in ascending order on even rounds and descending on odd ones, so a read
// that a missing barrier leaves racing its write sees the wrong order one way or the other.
template <class F> void launch(dim3 grid, dim3 threads, std::size_t shared, F body) {
    std::lock_guard<std::mutex> hold(one_launch);
    grid_dim = grid;
    block_dim = threads;
    dynamic_shared.assign(shared, 0);
    const int n = (int)(threads.x * threads.y * threads.z);
    constexpr std::size_t STACK = 128 * 1024;
    std::vector<Fiber> team(n);
    std::unique_ptr<char[]> stacks(new char[STACK * n]);
    lane_slots.assign(n, 0);
    mma_words.assign((std::size_t)n * 6, 0);
    fiber_body = [](void* f) { (*static_cast<F*>(f))(); };
    fiber_arg = &body;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                block_index = dim3{bx, by, bz};
                block_meeting = Meeting{n, 0, 0};
                votes[0] = votes[1] = votes[2] = 0;
                warp_meetings.clear();
                for (int first = 0; first < n; first += 32)
                    warp_meetings.push_back(Meeting{n - first < 32 ? n - first : 32, 0, 0});
                for (int t = 0; t < n; t++) {
                    Fiber& f = team[t];
                    f.idx = dim3{t % threads.x, (t / threads.x) % threads.y,
                                 t / (threads.x * threads.y)};
                    f.done = false;
                    getcontext(&f.context);
                    f.context.uc_stack.ss_sp = stacks.get() + STACK * t;
                    f.context.uc_stack.ss_size = STACK;
                    f.context.uc_link = &scheduler;
                    makecontext(&f.context, fiber_entry, 0);
                }
                for (int round = 0, alive = n; alive > 0; round++) {
                    alive = 0;
                    for (int k = 0; k < n; k++) {
                        const int t = round % 2 == 0 ? k : n - 1 - k;
                        if (team[t].done) continue;
                        current = &team[t];
                        current_linear = t;
                        swapcontext(&scheduler, &current->context);
                        alive += !team[t].done;
                    }
                }
                current = nullptr;
            }
}

// Every lane of the calling warp publishes `v`; returns what `read` makes of the warp's
// values (lane `l`'s at `slots[l]`).
template <class T, class R> T exchange(T v, R read) {
    static_assert(sizeof(T) <= 8, "warp exchange of at most 8 bytes");
    const int tid = current_linear;
    Meeting& w = warp_meetings[tid / 32];
    std::uint64_t* slots = lane_slots.data() + (tid / 32) * 32;
    std::memcpy(&slots[tid % 32], &v, sizeof(T));
    meet(w);
    T out = read(slots, w.expected, tid % 32);
    meet(w);
    return out;
}

template <class T> T lane_value(const std::uint64_t* slots, int lane) {
    T r;
    std::memcpy(&r, &slots[lane], sizeof(T));
    return r;
}

}  // namespace emu

#define threadIdx (emu::current->idx)
#define blockIdx (emu::block_index)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define ARES_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu::dynamic_shared.data())

inline void __syncthreads() { emu::meet(emu::block_meeting); }

namespace emu {
inline int block_vote(int pred) {
    Meeting& m = block_meeting;
    const unsigned long mine = m.phase;
    votes[mine % 3] += pred != 0;
    if (++m.arrived == m.expected) {
        votes[(mine + 1) % 3] = 0;
        m.arrived = 0;
        m.phase++;
    } else {
        while (m.phase == mine) yield();
    }
    return votes[mine % 3];
}
}  // namespace emu

inline int __syncthreads_count(int pred) { return emu::block_vote(pred); }
inline int __syncthreads_or(int pred) { return emu::block_vote(pred) > 0; }
inline int __syncthreads_and(int pred) {
    return emu::block_vote(pred) == emu::block_meeting.expected;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <class T> T __shfl_xor_sync(unsigned, T v, int mask) {
    return emu::exchange(v, [&](const std::uint64_t* slots, int lanes, int lane) {
        const int src = lane ^ mask;
        return src < lanes ? emu::lane_value<T>(slots, src) : v;
    });
}
template <class T> T __shfl_down_sync(unsigned, T v, unsigned delta) {
    return emu::exchange(v, [&](const std::uint64_t* slots, int lanes, int lane) {
        const int src = lane + (int)delta;
        return src < lanes ? emu::lane_value<T>(slots, src) : v;
    });
}
template <class T> T __shfl_sync(unsigned, T v, int src) {
    return emu::exchange(v, [&](const std::uint64_t* slots, int, int) {
        return emu::lane_value<T>(slots, src % 32);
    });
}
inline unsigned __ballot_sync(unsigned, int pred) {
    return emu::exchange((unsigned)(pred != 0), [](const std::uint64_t* slots, int lanes, int) {
        unsigned bits = 0;
        for (int l = 0; l < lanes; l++) bits |= emu::lane_value<unsigned>(slots, l) << l;
        return bits;
    });
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) {
    const int lanes = emu::warp_meetings[emu::current_linear / 32].expected;
    const unsigned full = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
    return __ballot_sync(m, pred) == full;
}

template <class T> T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T> T atomicOr(T* p, T v) { return std::atomic_ref<T>(*p).fetch_or(v); }
template <class T> T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <class T> T atomicCAS(T* p, T expected, T v) {
    std::atomic_ref<T>(*p).compare_exchange_strong(expected, v);
    return expected;
}
template <class T> T atomicMin(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (v < old && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}
template <class T> T atomicMax(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (v > old && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}

template <class T> T __ldcs(const T* p) { return *p; }
template <class T> T __ldg(const T* p) { return *p; }

template <class To, class From> To emu_bits(From x) {
    To y;
    std::memcpy(&y, &x, sizeof(To));
    return y;
}
inline float __uint_as_float(unsigned x) { return emu_bits<float>(x); }
inline float __int_as_float(int x) { return emu_bits<float>(x); }
inline unsigned __float_as_uint(float x) { return emu_bits<unsigned>(x); }
inline int __float_as_int(float x) { return emu_bits<int>(x); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline float __int2float_rn(int a) { return (float)a; }
inline float __uint2float_rn(unsigned a) { return (float)a; }
inline unsigned long long __float2ull_rz(float a) { return (unsigned long long)a; }
inline double __ull2double_rn(unsigned long long a) { return (double)a; }
inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
inline int __ffs(int x) { return __builtin_ffs(x); }
[[noreturn]] inline void __trap() { std::abort(); }

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 of one warp: every lane gives its A
// (4 registers of two bf16), B (2) and C (4 f32) fragments and gets its D fragment, with the
// PTX ISA's maps (lane = 4·gid + tig):
//   A 16×16: register i holds row gid + 8·(i % 2), columns 8·(i / 2) + 2·tig + {0, 1}
//   B 16×8:  register i holds k = 8·i + 2·tig + {0, 1}, column n = gid
//   C, D 16×8: element e is row gid + 8·(e / 2), column 2·tig + e % 2
// Products of bf16 are exact in f32; the sum runs over k in order from C (the hardware's
// order is unspecified: results agree with a GPU to rounding).
inline void emu_mma_bf16_16816(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    const int tid = emu::current_linear;
    const int warp = tid / 32, lane = tid % 32;
    std::uint32_t* w = emu::mma_words.data() + (std::size_t)warp * 32 * 6;
    for (int i = 0; i < 4; i++) w[lane * 6 + i] = a[i];
    w[lane * 6 + 4] = b0;
    w[lane * 6 + 5] = b1;
    emu::Meeting& m = emu::warp_meetings[warp];
    emu::meet(m);
    auto half = [](std::uint32_t reg, int hi) {
        const std::uint32_t bits = hi ? (reg & 0xffff0000u) : (reg << 16);
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    };
    const int gid = lane / 4, tig = lane % 4;
    float d[4];
    for (int e = 0; e < 4; e++) {
        const int r = gid + 8 * (e / 2), n = 2 * tig + e % 2;
        float acc = c[e];
        for (int k = 0; k < 16; k++) {
            const int lane_a = 4 * (r % 8) + (k % 8) / 2, reg_a = 2 * (k / 8) + r / 8;
            const int lane_b = 4 * n + (k % 8) / 2, reg_b = 4 + k / 8;
            acc += half(w[lane_a * 6 + reg_a], k % 2) * half(w[lane_b * 6 + reg_b], k % 2);
        }
        d[e] = acc;
    }
    emu::meet(m);
    for (int e = 0; e < 4; e++) c[e] = d[e];
}
