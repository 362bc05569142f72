// Launchers of token_kernels.cu for its CPU emulation (ares-cuda/tests/emulated.rs): one
// C function per kernel, taking the launch shape first and then the kernel's own arguments in
// its order. Compiled after the kernel source, with cuda_on_cpu.h in front.

extern "C" void emu_log_prob_entropy_f32(unsigned grid, unsigned block, const float* logits,
                                         long long vocab, float inv_t, const unsigned* targets,
                                         float* out_log_prob, float* out_entropy,
                                         unsigned* status) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        log_prob_entropy_f32(logits, vocab, inv_t, targets, out_log_prob, out_entropy, status);
    });
}

extern "C" void emu_masked_dynamic_kl(unsigned grid, unsigned block, const float* logp,
                                      const float* ref, const float* mask, const float* hwe,
                                      const float* beta_rows, float low_ratio, int estimator,
                                      long long cols, float* out_kl, float* out_weighted,
                                      float* row_weighted_sum, float* row_mean_kl, float* total,
                                      unsigned* blocks_done) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        masked_dynamic_kl(logp, ref, mask, hwe, beta_rows, low_ratio, estimator, cols, out_kl,
                          out_weighted, row_weighted_sum, row_mean_kl, total, blocks_done);
    });
}

extern "C" void emu_mask_row_counts(unsigned grid, unsigned block, const float* mask,
                                    long long cols, float* counts, unsigned* status) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { mask_row_counts(mask, cols, counts, status); });
}

// The policy loss's scalars, in the kernel's order (a struct keeps the C signature short).
struct EmuLossScalars {
    long long rows, cols;
    int kind;
    float clip_lo, clip_hi, clip_c;
    int is_mode;
    float is_low, is_high;
    int agg, kl_est;
    float low_ratio, entropy_coef, scale, cov_coef;
};

// The policy loss's tensors, in the kernel's order.
struct EmuLossTensors {
    const float *logp, *logp_old, *advantages, *mask, *rollout, *keep, *ref, *hwe, *beta_rows,
        *entropy, *selected, *row_counts;
    float *grad, *entropy_grad, *row_stats, *totals;
    unsigned *status, *blocks_done;
};

// `totals` holds LOSS_STATS + 2 words (the kernel's `report`: the status words after them).
extern "C" void emu_policy_loss(unsigned grid, unsigned block, const EmuLossScalars* s,
                                const EmuLossTensors* t) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        policy_loss(t->logp, t->logp_old, t->advantages, t->mask, t->rollout, t->keep, t->ref,
                    t->hwe, t->beta_rows, t->entropy, t->selected, t->row_counts, s->rows,
                    s->cols, s->kind, s->clip_lo, s->clip_hi, s->clip_c, s->is_mode, s->is_low,
                    s->is_high, s->agg, s->kl_est, s->low_ratio, s->entropy_coef, s->scale,
                    s->cov_coef, t->grad, t->entropy_grad, t->row_stats, t->totals, 1, t->status,
                    t->blocks_done);
    });
}

// `cov_select`'s scalars, in the kernel's order (ares_cuda::CovScalars).
struct EmuCovScalars {
    long long n;
    int kind;
    float clip_lo, clip_hi, lb, ub;
    unsigned long long seed;
    double ratio;
};

extern "C" void emu_cov_select(unsigned grid, unsigned block, const EmuCovScalars* s,
                               const float* logp, const float* logp_old,
                               const float* advantages, const float* mask, float* selected) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        cov_select(logp, logp_old, advantages, mask, s->n, s->kind, s->clip_lo, s->clip_hi,
                   s->lb, s->ub, s->seed, s->ratio, selected);
    });
}

// The advantage estimators' kernels.
extern "C" void emu_group_scores(unsigned grid, unsigned block, const float* rewards,
                                 const int* group_rows, const int* offsets, int groups, int kind,
                                 float eps, float uniform_std, float* scores,
                                 unsigned char* uniform, unsigned* status) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        group_scores(rewards, group_rows, offsets, groups, kind, eps, uniform_std, scores, uniform,
                     status);
    });
}

extern "C" void emu_token_returns(unsigned grid, unsigned block, const float* scores,
                                  const float* mask, const float* kl, long long cols, float gamma,
                                  int mode, int check_scores, float* out, float* moments,
                                  unsigned* status) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        token_returns(scores, mask, kl, cols, gamma, mode, check_scores, out, moments, status);
    });
}

extern "C" void emu_masked_row_moments(unsigned grid, unsigned block, const float* values,
                                       const float* mask, long long cols, float* moments,
                                       unsigned* status) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { masked_row_moments(values, mask, cols, moments, status); });
}

extern "C" void emu_whiten_stats(unsigned grid, unsigned block, const float* moments,
                                 long long rows, float var_floor, float* stats,
                                 unsigned* status) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { whiten_stats(moments, rows, var_floor, stats, status); });
}

extern "C" void emu_whiten_apply(unsigned grid, unsigned block, float* values, const float* mask,
                                 long long n, const float* stats) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0,
                [&] { whiten_apply(values, mask, n, stats); });
}

extern "C" void emu_pro_max_normalize(unsigned grid, unsigned block, float* values,
                                      long long cols, const int* group_rows, const int* offsets,
                                      const unsigned char* skip, float eps, float max_scale,
                                      float product_cap) {
    emu::launch(dim3{grid, 1, 1}, dim3{block, 1, 1}, 0, [&] {
        pro_max_normalize(values, cols, group_rows, offsets, skip, eps, max_scale, product_cap);
    });
}
