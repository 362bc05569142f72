//! Fuzzes every public function of `ares_core::advantage` with arbitrary group layouts
//! (bad permutations, n = 0/1, sizes that do not divide), lengths, masks, NaN/∞ and
//! parameters: nothing may panic.
#![no_main]

use ares_core::advantage::{
    GrpoConfig, ProMaxConfig, ProMaxGroupReport, ResponseTokens, broadcast_to_tokens,
    dr_grpo_advantages, grpo_advantages, grpo_token_advantages, masked_whiten, pro_max_normalize,
    pro_max_shaped_rewards, reinforce_baseline_advantages, reinforce_pp_advantages,
    reinforce_pp_baseline_advantages, reinforce_pro_max, returns_to_go, returns_to_go_in_place,
    rloo_advantages, rloo_token_advantages, token_level_rewards,
};
use ares_core::{Groups, Shape};
use ares_fuzz::{Bytes, Ragged};

/// A length: usually `n`, sometimes anything near it.
fn len(b: &mut Bytes, n: usize) -> usize {
    if b.u8() % 8 == 0 { b.size(n + 2) } else { n }
}

fn values(b: &mut Bytes, n: usize) -> Vec<f64> {
    let mut v = vec![0.0; len(b, n)];
    b.fill_f64(&mut v);
    v
}

fn mask(b: &mut Bytes, n: usize) -> Vec<f64> {
    let mut v = vec![0.0; len(b, n)];
    b.fill_mask(&mut v);
    v
}

fn to32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn pro_max_cfg<'d, F: ares_core::Float>(
    b: &mut Bytes<'d>,
    pick: impl Fn(&mut Bytes<'d>) -> F,
) -> ProMaxConfig<F> {
    let mut cfg = if b.bool() {
        ProMaxConfig::uniform_scale()
    } else {
        ProMaxConfig::default()
    };
    if b.u8() % 4 == 0 {
        cfg.eps = pick(b);
        cfg.max_scale = pick(b);
        cfg.product_cap = pick(b);
        cfg.uniform_std = pick(b);
    }
    cfg
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let batch = b.size(12);
    let n = b.size(5);
    let cols = b.size(24);

    // a contiguous or permuted layout (the permutation may be invalid)
    let mut index: Vec<usize> = (0..batch).collect();
    for i in 0..batch {
        let j = b.size(batch.saturating_sub(1));
        index.swap(i, j);
        if b.u8() % 16 == 0 {
            index[i] = b.size(batch + 1);
        }
    }
    let mut inverse = vec![0usize; len(&mut b, batch)];
    let mut ragged = Ragged::new(&mut b, batch);
    let groups = match b.size(3) {
        0 => Groups::permuted(&index, n, &mut inverse),
        1 => Groups::contiguous(batch, n),
        k => ragged.groups(k == 2),
    };
    let Ok(groups) = groups else {
        return;
    };
    let _ = groups.check_same_prompt(&index);

    let rows = if b.u8() % 8 == 0 { b.size(14) } else { batch };
    let shape = Shape::new(rows, cols);
    let t = rows * cols;
    let rewards = values(&mut b, batch);
    let m = mask(&mut b, t);
    let wk = values(&mut b, t);
    let vals = values(&mut b, t);
    let gamma = if b.bool() { 1.0 } else { b.f64() };
    let tokens = ResponseTokens::new(shape, &m);
    let tokens_kl = tokens.with_kl(&wk);
    let mut out_b = vec![0.0; len(&mut b, batch)];
    let mut out_t = vec![0.0; len(&mut b, t)];

    // scalar estimators
    let grpo = GrpoConfig {
        norm_adv_by_std: b.bool(),
        epsilon: if b.bool() { 1e-6 } else { b.f64() },
    };
    let _ = grpo_advantages(&groups, &rewards, &grpo, &mut out_b);
    let _ = dr_grpo_advantages(&groups, &rewards, &mut out_b);
    let _ = rloo_advantages(&groups, &rewards, &mut out_b);
    let _ = reinforce_baseline_advantages(&groups, &rewards, &mut out_b);

    // token steps
    let _ = broadcast_to_tokens(shape, &rewards, &m, &mut out_t);
    let _ = token_level_rewards(shape, &rewards, &m, b.bool().then_some(&wk[..]), &mut out_t);
    let _ = returns_to_go(shape, &vals, &m, gamma, &mut out_t);
    let mut v = vals.clone();
    let _ = returns_to_go_in_place(shape, &mut v, &m, gamma);
    let mut v = vals.clone();
    let _ = masked_whiten(shape, &mut v, &m);

    // composed estimators
    let _ = grpo_token_advantages(&groups, &rewards, shape, &m, &grpo, &mut out_t);
    for toks in [tokens, tokens_kl] {
        let _ = rloo_token_advantages(&groups, &rewards, toks, &mut out_t);
        let _ = reinforce_pp_advantages(&rewards, toks, gamma, &mut out_t);
        let _ = reinforce_pp_baseline_advantages(&groups, &rewards, toks, gamma, &mut out_t);
    }

    // Pro Max
    let cfg = pro_max_cfg(&mut b, Bytes::f64);
    let mut uniform = vec![false; len(&mut b, groups.count())];
    let mut report = vec![ProMaxGroupReport::default(); len(&mut b, groups.count())];
    let _ = pro_max_shaped_rewards(
        &groups,
        &rewards,
        &cfg,
        &mut out_b,
        b.bool().then_some(&mut uniform[..]),
    );
    let mut v = vals.clone();
    let _ = pro_max_normalize(
        shape,
        &groups,
        &mut v,
        &m,
        b.bool().then_some(&uniform[..]),
        &cfg,
        b.bool().then_some(&mut report[..]),
    );
    let toks = if b.bool() { tokens_kl } else { tokens };
    let _ = reinforce_pro_max(
        &groups,
        &rewards,
        toks,
        &cfg,
        b.bool().then_some(&mut report[..]),
        &mut out_t,
    );

    // f32
    let (r32, m32, k32, v32) = (to32(&rewards), to32(&m), to32(&wk), to32(&vals));
    let cfg32 = pro_max_cfg(&mut b, Bytes::f32);
    let mut o32 = vec![0.0f32; len(&mut b, t)];
    let toks32 = ResponseTokens::new(shape, &m32).with_kl(&k32);
    let _ = reinforce_pro_max(&groups, &r32, toks32, &cfg32, None, &mut o32);
    let _ = reinforce_pp_baseline_advantages(&groups, &r32, toks32, gamma as f32, &mut o32);
    let mut w32 = v32.clone();
    let _ = masked_whiten(shape, &mut w32, &m32);
    let mut w32 = v32;
    let _ = returns_to_go_in_place(shape, &mut w32, &m32, gamma as f32);
    let _ = grpo_advantages(&groups, &r32, &GrpoConfig::default(), &mut o32);
});
