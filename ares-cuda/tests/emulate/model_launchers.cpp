// Launchers of model_ops.cu for its CPU emulation (ares-cuda/tests/emulated.rs): one C
// function per kernel, taking the launch shape first and then the kernel's own arguments in
// its order. Compiled after the kernel source, with cuda_on_cpu.h in front.

extern "C" void emu_f32_to_bf16_stochastic(unsigned grid, unsigned block, const float* x,
                                           unsigned short* y, i64 n, unsigned long long key) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { f32_to_bf16_stochastic(x, y, n, key); });
}

extern "C" void emu_accumulate_bf16_stochastic(unsigned grid, unsigned block, const float* x,
                                               unsigned short* y, i64 n,
                                               unsigned long long key) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { accumulate_bf16_stochastic(x, y, n, key); });
}

extern "C" void emu_fill_bf16(unsigned grid, unsigned block, unsigned short* y, i64 n,
                              unsigned short bits) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] { fill_bf16(y, n, bits); });
}

extern "C" void emu_swiglu_fwd_bf16(unsigned grid, unsigned block, const unsigned short* gate,
                                    const unsigned short* up, unsigned short* out, i64 n) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] { swiglu_fwd_bf16(gate, up, out, n); });
}

extern "C" void emu_swiglu_bwd_bf16(unsigned grid, unsigned block, const float* dout,
                                    const unsigned short* gate, const unsigned short* up,
                                    float* dgate, float* dup, i64 n) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { swiglu_bwd_bf16(dout, gate, up, dgate, dup, n); });
}

extern "C" void emu_add_rmsnorm_fwd_bf16(unsigned grid, unsigned block, const float* a,
                                         const float* b, const float* w, float eps, i64 rows,
                                         i64 dim, float* sum, unsigned short* out, float* rstd) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { add_rmsnorm_fwd_bf16(a, b, w, eps, rows, dim, sum, out, rstd); });
}

extern "C" void emu_rope_fwd_bf16(unsigned grid, unsigned block, const float* x,
                                  const float* cos_t, const float* sin_t, i64 tokens, int heads,
                                  int head_dim, unsigned short* out) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { rope_fwd_bf16(x, cos_t, sin_t, tokens, heads, head_dim, out); });
}

extern "C" void emu_bf16_to_f32(unsigned grid, unsigned block, const unsigned short* x, float* y,
                                i64 n) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] { bf16_to_f32(x, y, n); });
}

extern "C" void emu_embedding_fwd_bf16(unsigned grid, unsigned block, const unsigned* ids,
                                       const unsigned short* table, i64 rows, i64 dim,
                                       i64 tokens, float* out, unsigned* status) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { embedding_fwd_bf16(ids, table, rows, dim, tokens, out, status); });
}

// The tensor-core forward at head size d (64, 80 or 128): its arguments after the launch
// shape, in the kernel's order (packed segments: `cu` and their count; else NULL and 0; q, k,
// v stored in bf16: q16, k16, v16 with q, k, v NULL; else NULL).
extern "C" void emu_attention_fwd_mma(unsigned grid, int d, const float* q, const float* k,
                                      const float* v, const float* mask, i64 batch, i64 q_seq,
                                      i64 kv_seq, i64 pos0, int hq, int hkv, float scale,
                                      float* out, float* lse, unsigned* status,
                                      const unsigned* cu, int segments,
                                      const unsigned short* q16, const unsigned short* k16,
                                      const unsigned short* v16, unsigned short* out16) {
    const dim3 block{MMA_WARPS * 32, 1, 1};
    auto run = [&](auto kernel) {
        emu::launch(dim3{grid, 1, 1}, block, 0, [&] {
            kernel(q, k, v, mask, batch, q_seq, kv_seq, pos0, hq, hkv, scale, out, lse, status,
                   cu, segments, q16, k16, v16, out16);
        });
    };
    if (d == 64) run(attention_fwd_mma_d64);
    else if (d == 80) run(attention_fwd_mma_d80);
    else run(attention_fwd_mma_d128);
}

// The tensor-core forward of a prefill chunk over a paged cache at head size d (f32 pools
// k/v, or bf16 pools k16/v16; the others null).
extern "C" void emu_paged_attention_fwd_mma(unsigned grid, int d, const float* q, const float* k,
                                            const float* v, const unsigned short* k16,
                                            const unsigned short* v16, i64 batch, i64 q_seq,
                                            int hq, int hkv, float scale, const unsigned* tables,
                                            const unsigned* lens, i64 block_size,
                                            i64 max_blocks, i64 pool_blocks, float* out,
                                            unsigned* status) {
    const dim3 block{MMA_WARPS * 32, 1, 1};
    auto run = [&](auto kernel) {
        emu::launch(dim3{grid, 1, 1}, block, 0, [&] {
            kernel(q, k, v, k16, v16, batch, q_seq, hq, hkv, scale, tables, lens, block_size,
                   max_blocks, pool_blocks, out, status);
        });
    };
    if (d == 64) run(paged_attention_fwd_mma_d64);
    else if (d == 80) run(paged_attention_fwd_mma_d80);
    else run(paged_attention_fwd_mma_d128);
}

// The tensor-core backward at head size d: δ over the rounded dout, then dq, then dk and dv
// (dynamic shared memory as ares-cuda's `dkv_mma_smem`), as `attention_backward_bf16` runs
// them.
extern "C" void emu_attention_bwd_mma(unsigned grid, int d, const float* q, const float* k,
                                      const float* v, const float* mask, i64 batch, i64 seq,
                                      int hq, int hkv, float scale, const float* out,
                                      const float* lse, const float* dout, float* delta,
                                      float* dq, float* dk, float* dv, unsigned* status,
                                      const unsigned* cu, int segments,
                                      const unsigned short* q16, const unsigned short* k16,
                                      const unsigned short* v16, const unsigned short* out16) {
    const i64 rows = batch * seq * hq;
    emu::launch(dim3{4, 1, 1}, dim3{128, 1, 1}, 0,
                [&] { attention_bwd_delta_bf16(dout, out, rows, d, delta, out16); });
    const dim3 block{MMA_WARPS * 32, 1, 1};
    const std::size_t smem = 2 * (2 * MMA_ROWS * (d + 8) + 2 * 32 * (d + 8) + 2 * d * (32 + 8));
    auto run = [&](auto dq_kernel, auto dkv_kernel) {
        emu::launch(dim3{grid, 1, 1}, block, 0, [&] {
            dq_kernel(q, k, v, mask, batch, seq, hq, hkv, d, scale, lse, delta, dout, dq, status, cu,
                      segments, q16, k16, v16);
        });
        emu::launch(dim3{grid, 1, 1}, block, smem, [&] {
            dkv_kernel(q, k, v, mask, batch, seq, hq, hkv, d, scale, lse, delta, dout, dk, dv,
                       status, cu, segments, q16, k16, v16);
        });
    };
    if (d == 64) run(attention_bwd_dq_mma_d64, attention_bwd_dkv_mma_d64);
    else if (d == 80) run(attention_bwd_dq_mma_d80, attention_bwd_dkv_mma_d80);
    else run(attention_bwd_dq_mma_d128, attention_bwd_dkv_mma_d128);
}

// The f32 attention over packed segments as ares-cuda launches it: forward, then δ, dq, and
// dk with dv — NW warps a block, RW rows a warp per head-size class (FWD / DQ / DKV rows per
// warp in ares-cuda's attention.rs), dynamic shared memory as its `rows_smem`.
extern "C" void emu_packed_attention(unsigned grid, const float* q, const float* k, const float* v,
                                     const float* mask, const unsigned* cu, int segments,
                                     i64 seq, int hq, int hkv, int d, float scale, float* out,
                                     float* lse, const float* dout, float* delta, float* dq,
                                     float* dk, float* dv, unsigned* status) {
    const int cls = d <= 64 ? 0 : d <= 128 ? 1 : 2;
    const int fwd_rw[3] = {2, 2, 1}, dq_rw[3] = {1, 2, 1};
    const dim3 block{NW * 32, 1, 1};
    const std::size_t fwd_smem = 4 * (2 * KT * (d + 1) + NW * fwd_rw[cls] * d);
    const std::size_t dq_smem = 4 * (2 * KT * (d + 1) + 2 * NW * dq_rw[cls] * d);
    const std::size_t dkv_smem = 4 * (2 * 32 * (d + 1) + 2 * NW * d);
    auto run = [&](auto fwd, auto dq_kernel, auto dkv_kernel) {
        emu::launch(dim3{grid, 1, 1}, block, fwd_smem, [&] {
            fwd(q, k, v, mask, seq, hq, hkv, d, scale, out, lse, status, cu, segments);
        });
        emu::launch(dim3{4, 1, 1}, dim3{128, 1, 1}, 0,
                    [&] { attention_bwd_delta(dout, out, seq * hq, d, delta); });
        emu::launch(dim3{grid, 1, 1}, block, dq_smem, [&] {
            dq_kernel(q, k, v, mask, 1, seq, hq, hkv, d, scale, lse, delta, dout, dq, status, cu,
                      segments);
        });
        emu::launch(dim3{grid, 1, 1}, block, dkv_smem, [&] {
            dkv_kernel(q, k, v, mask, 1, seq, hq, hkv, d, scale, lse, delta, dout, dk, dv, status,
                       cu, segments);
        });
    };
    if (cls == 0)
        run(packed_attention_fwd_d64, packed_attention_bwd_dq_d64, packed_attention_bwd_dkv_d64);
    else if (cls == 1)
        run(packed_attention_fwd_d128, packed_attention_bwd_dq_d128,
            packed_attention_bwd_dkv_d128);
    else
        run(packed_attention_fwd_d256, packed_attention_bwd_dq_d256,
            packed_attention_bwd_dkv_d256);
}

// The tensor-core segment attention of the vision tower at head size d (non-causal within
// each cu_seqlens segment): forward, then δ, dq, and dk with dv, as ares-cuda runs them (q,
// k, v stored in bf16: q16, k16, v16 with q, k, v NULL; the output in bf16: out16 with out
// NULL; else NULL).
extern "C" void emu_segment_attention_mma(unsigned grid, int d, const float* q, const float* k,
                                          const float* v, const unsigned* cu, int segments,
                                          i64 tokens, int heads, float scale, float* out,
                                          float* lse, const float* dout, float* delta,
                                          float* dq, float* dk, float* dv, unsigned* status,
                                          const unsigned short* q16, const unsigned short* k16,
                                          const unsigned short* v16, unsigned short* out16) {
    const dim3 block{MMA_WARPS * 32, 1, 1};
    const std::size_t smem = 2 * (2 * MMA_ROWS * (d + 8) + 2 * 32 * (d + 8) + 2 * d * (32 + 8));
    auto run = [&](auto fwd, auto dq_kernel, auto dkv_kernel) {
        emu::launch(dim3{grid, 1, 1}, block, 0, [&] {
            fwd(q, k, v, cu, segments, tokens, heads, scale, out, lse, status, q16, k16, v16,
                out16);
        });
        emu::launch(dim3{4, 1, 1}, dim3{128, 1, 1}, 0,
                    [&] { attention_bwd_delta_bf16(dout, out, tokens * heads, d, delta, out16); });
        emu::launch(dim3{grid, 1, 1}, block, 0, [&] {
            dq_kernel(q, k, v, cu, segments, tokens, heads, scale, lse, delta, dout, dq, status,
                      q16, k16, v16);
        });
        emu::launch(dim3{grid, 1, 1}, block, smem, [&] {
            dkv_kernel(q, k, v, cu, segments, tokens, heads, scale, lse, delta, dout, dk, dv,
                       status, q16, k16, v16);
        });
    };
    if (d == 64)
        run(segment_attention_fwd_mma_d64, segment_attention_bwd_dq_mma_d64,
            segment_attention_bwd_dkv_mma_d64);
    else if (d == 80)
        run(segment_attention_fwd_mma_d80, segment_attention_bwd_dq_mma_d80,
            segment_attention_bwd_dkv_mma_d80);
    else
        run(segment_attention_fwd_mma_d128, segment_attention_bwd_dq_mma_d128,
            segment_attention_bwd_dkv_mma_d128);
}

// The AdamW kernels' per-step factors (ares-cuda's `AdamWScalars`, in its order).
struct EmuAdamW {
    float decay;
    int apply_decay;
    float w1, one_minus_w1, b2, w2, neg_step_size, bc2_sqrt, eps;
};

// AdamW with bf16 moments over n elements (rounded under `key`'s moment streams), with the
// bf16 weight copy.
extern "C" void emu_adamw_update_bf16(unsigned grid, unsigned block, unsigned long long key,
                                      float* param, const float* grad, unsigned short* m,
                                      unsigned short* v, i64 n, float grad_scale,
                                      const EmuAdamW* c, const unsigned* guard,
                                      unsigned short* copy) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        adamw_update_bf16(param, grad, m, v, n, grad_scale, c->decay, c->apply_decay, c->w1,
                          c->one_minus_w1, c->b2, c->w2, c->neg_step_size, c->bc2_sqrt, c->eps,
                          guard, copy, nullptr, key, nullptr);
    });
}

// AdamW with 8-bit moments: one block of Q8_THREADS a quantisation block.
extern "C" void emu_adamw_update_int8(float* param, const float* grad, unsigned char* m_codes,
                                      unsigned char* v_codes, float* m_absmax, float* v_absmax,
                                      const float* maps, i64 n, float grad_scale,
                                      const EmuAdamW* c, const unsigned* guard,
                                      unsigned short* copy) {
    const unsigned blocks = (unsigned)((n + Q8_BLOCK - 1) / Q8_BLOCK);
    emu::launch(dim3{blocks, 1, 1}, dim3{Q8_THREADS, 1, 1}, 0, [&] {
        adamw_update_int8(param, grad, m_codes, v_codes, m_absmax, v_absmax, maps, n, grad_scale,
                          c->decay, c->apply_decay, c->w1, c->one_minus_w1, c->b2, c->w2,
                          c->neg_step_size, c->bc2_sqrt, c->eps, guard, copy, nullptr, 0ull,
                          nullptr);
    });
}

// AdamW as the device runs it: adamw_check over the gradient, then the update of the kind
// `moments` names (0 f32 moments, 1 bf16 bits, 2 8-bit codes with their scales and the
// maps). The parameter is `param` (f32, with its bf16 `copy` where not NULL) or `weight`
// (bf16, written back rounded stochastically under `key`); the gradient `grad` (f32) or
// `grad16` (bf16 bits), the other NULL. `status` receives the check's flags.
extern "C" void emu_adamw_step(unsigned grid, unsigned block, int moments, float* param,
                               unsigned short* weight, unsigned long long key, const float* grad,
                               const unsigned short* grad16, void* m, void* v, float* m_absmax,
                               float* v_absmax, const float* maps, i64 n, float grad_scale,
                               const EmuAdamW* c, unsigned short* copy, unsigned* status) {
    unsigned guard = 0;
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { adamw_check(grad, n, &guard, status, grad16); });
    if (moments == 2) {
        const unsigned blocks = (unsigned)((n + Q8_BLOCK - 1) / Q8_BLOCK);
        emu::launch(dim3{blocks, 1, 1}, dim3{Q8_THREADS, 1, 1}, 0, [&] {
            adamw_update_int8(param, grad, (unsigned char*)m, (unsigned char*)v, m_absmax,
                              v_absmax, maps, n, grad_scale, c->decay, c->apply_decay, c->w1,
                              c->one_minus_w1, c->b2, c->w2, c->neg_step_size, c->bc2_sqrt,
                              c->eps, &guard, copy, weight, key, grad16);
        });
        return;
    }
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        if (moments == 0)
            adamw_update(param, grad, (float*)m, (float*)v, n, grad_scale, c->decay,
                         c->apply_decay, c->w1, c->one_minus_w1, c->b2, c->w2, c->neg_step_size,
                         c->bc2_sqrt, c->eps, &guard, copy, weight, key, grad16);
        else
            adamw_update_bf16(param, grad, (unsigned short*)m, (unsigned short*)v, n,
                              grad_scale, c->decay, c->apply_decay, c->w1, c->one_minus_w1,
                              c->b2, c->w2, c->neg_step_size, c->bc2_sqrt, c->eps, &guard, copy,
                              weight, key, grad16);
    });
}

// The race sampler, one block of `block` threads a row.
extern "C" void emu_sample_race(unsigned block, const float* logits, i64 vocab, i64 rows,
                                float inv_t, unsigned top_k, float top_p, float min_p,
                                const unsigned* keys, unsigned* out) {
    emu::launch(dim3{(unsigned)rows, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        sample_race(logits, vocab, rows, inv_t, top_k, top_p, min_p, keys, out);
    });
}

// A decode step's pick in one launch (ids, log-prob and entropy bits, status word).
extern "C" void emu_pick_rows(unsigned block, const float* logits, i64 vocab, i64 rows,
                              int sample, float inv_t, unsigned top_k, float top_p, float min_p,
                              const unsigned* keys, float lp_inv_t, unsigned* ids,
                              unsigned* status, unsigned* blocks_done, unsigned* packed) {
    emu::launch(dim3{(unsigned)rows, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        pick_rows(logits, vocab, rows, sample, inv_t, top_k, top_p, min_p, keys, lp_inv_t, ids,
                  status, blocks_done, packed);
    });
}

// Appends `seq` new tokens per sequence to bf16 pools (paged_kv_append_bf16).
extern "C" void emu_paged_kv_append_bf16(const float* k_new, const float* v_new, i64 batch,
                                         i64 seq, i64 tok, const unsigned* tables,
                                         const unsigned* lens, i64 block_size, i64 max_blocks,
                                         i64 pool_blocks, unsigned short* k_cache,
                                         unsigned short* v_cache, unsigned* status) {
    emu::launch(dim3{3, 1, 1}, dim3{64, 1, 1}, 0, [&] {
        paged_kv_append_bf16(k_new, v_new, batch, seq, tok, tables, lens, block_size, max_blocks,
                             pool_blocks, k_cache, v_cache, status);
    });
}

// Paged decoding over bf16 pools as ares-cuda's `paged_decode` launches it: NW warps and
// NW·RW query rows a block (RW by head-size class), shared memory `rows_smem`, and for a
// step of one query a sequence whose table holds more than SPLIT_MIN_KEYS slots, split-K:
// SPLIT_MAX chunk blocks a tile and `attention_split_combine` (8 warps a block) after.
extern "C" void emu_paged_decode_kv16(const float* q, const unsigned short* k16,
                                      const unsigned short* v16, i64 batch, i64 q_seq, int hq,
                                      int hkv, int d, float scale, const unsigned* tables,
                                      const unsigned* lens, i64 block_size, i64 max_blocks,
                                      i64 pool_blocks, float* out, unsigned* status,
                                      float* split_ws) {
    const int rw = d <= 128 ? 2 : 1;
    const i64 rows = NW * rw, group = hq / hkv;
    const i64 tiles = (q_seq * group + rows - 1) / rows;
    const bool split = q_seq == 1 && max_blocks * block_size > SPLIT_MIN_KEYS;
    const unsigned grid = (unsigned)(batch * hkv * tiles * (split ? SPLIT_MAX : 1));
    const std::size_t smem = 4 * (2 * KT * (d + 1) + rows * d);
    float* ws = split ? split_ws : nullptr;
    auto run = [&](auto kernel) {
        emu::launch(dim3{grid, 1, 1}, dim3{NW * 32, 1, 1}, smem, [&] {
            kernel(q, k16, v16, batch, q_seq, hq, hkv, d, scale, tables, lens, block_size,
                   max_blocks, pool_blocks, out, status, ws);
        });
    };
    if (d <= 64) run(attention_fwd_kv16_d64);
    else if (d <= 128) run(attention_fwd_kv16_d128);
    else run(attention_fwd_kv16_d256);
    if (split) {
        const unsigned combine = (unsigned)((batch * hq + 7) / 8);
        emu::launch(dim3{combine, 1, 1}, dim3{256, 1, 1}, 0,
                    [&] { attention_split_combine(split_ws, lens, batch, hq, d, out); });
    }
}

// The gradient norm's sums as ares-cuda's `sums_of_squares` launches them: one block of 256
// threads per partial, then one per tensor.
extern "C" void emu_sums_of_squares(unsigned blocks, const SumSqTensor* tensors, int count,
                                    double* partials, unsigned* status, double* out) {
    emu::launch(dim3{blocks, 1, 1}, dim3{256, 1, 1}, 0,
                [&] { sum_sq_multi_partial(tensors, count, partials); });
    emu::launch(dim3{(unsigned)count, 1, 1}, dim3{256, 1, 1}, 0,
                [&] { sum_sq_multi_final(tensors, count, partials, status, out); });
}

// The f32 loss-head backward as ares-py's CUDA path runs it (log_prob_bwd, or zeros without
// a log-prob part, then entropy_bwd), and the fused 16-bit one: one block of 512 threads a
// row.
extern "C" void emu_log_prob_entropy_bwd_f32(unsigned rows, const float* logits, i64 vocab,
                                             float inv_t, const unsigned* targets,
                                             const float* lp, const float* ent, float* dlogits,
                                             unsigned* status) {
    if (targets && lp) {
        emu::launch(dim3{rows, 1, 1}, dim3{512, 1, 1}, 0, [&] {
            log_prob_bwd(logits, vocab, inv_t, targets, lp, (i64)rows, dlogits, status);
        });
    } else {
        for (i64 i = 0; i < (i64)rows * vocab; ++i) dlogits[i] = 0.0f;
    }
    if (ent) {
        emu::launch(dim3{rows, 1, 1}, dim3{512, 1, 1}, 0,
                    [&] { entropy_bwd(logits, vocab, inv_t, ent, (i64)rows, dlogits, status); });
    }
}

extern "C" void emu_log_prob_entropy_bwd_16(int bf16, unsigned rows, const unsigned short* logits,
                                            i64 vocab, float inv_t, const unsigned* targets,
                                            const float* lp, const float* ent,
                                            unsigned short* dlogits, unsigned* status) {
    emu::launch(dim3{rows, 1, 1}, dim3{512, 1, 1}, 0, [&] {
        if (bf16) {
            log_prob_entropy_bwd_bf16(logits, vocab, inv_t, targets, lp, ent, (i64)rows, dlogits,
                                      status);
        } else {
            log_prob_entropy_bwd_f16(logits, vocab, inv_t, targets, lp, ent, (i64)rows, dlogits,
                                     status);
        }
    });
}
