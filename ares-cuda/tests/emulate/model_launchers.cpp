// Launchers of model_ops.cu for its CPU emulation (ares-cuda/tests/emulated.rs): one C
// function per kernel, taking the launch shape first and then the kernel's own arguments in
// its order. Compiled after the kernel source, with cuda_on_cpu.h in front.

extern "C" void emu_f32_to_bf16_stochastic(unsigned grid, unsigned block, const float* x,
                                           unsigned short* y, i64 n, unsigned long long key) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { f32_to_bf16_stochastic(x, y, n, key); });
}

extern "C" void emu_bf16_to_f32(unsigned grid, unsigned block, const unsigned short* x, float* y,
                                i64 n) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] { bf16_to_f32(x, y, n); });
}

// The tensor-core forward at head size d (64, 80 or 128): its arguments after the launch
// shape, in the kernel's order.
extern "C" void emu_attention_fwd_mma(unsigned grid, int d, const float* q, const float* k,
                                      const float* v, const float* mask, i64 batch, i64 q_seq,
                                      i64 kv_seq, i64 pos0, int hq, int hkv, float scale,
                                      float* out, float* lse, unsigned* status) {
    const dim3 block{MMA_WARPS * 32, 1, 1};
    auto run = [&](auto kernel) {
        emu::launch(dim3{grid, 1, 1}, block, 0, [&] {
            kernel(q, k, v, mask, batch, q_seq, kv_seq, pos0, hq, hkv, scale, out, lse, status);
        });
    };
    if (d == 64) run(attention_fwd_mma_d64);
    else if (d == 80) run(attention_fwd_mma_d80);
    else run(attention_fwd_mma_d128);
}
