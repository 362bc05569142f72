//! Fuzzes every public function of `ares_core::kl` with arbitrary sizes and values
//! (mismatched lengths, bad masks, NaN/∞, out-of-range parameters): nothing may panic.
#![no_main]

use ares_core::Shape;
use ares_core::kl::{
    AdaptiveKlController, KlCoefficient, KlController, KlEstimator, TokenKlConfig, TokenKlOutputs,
    dynamic_kl_weight, kl_penalty, kl_penalty_and_grad, masked_kl, token_kl,
};
use ares_fuzz::Bytes;

const NAMES: [&str; 12] = [
    "k1+",
    "k3+",
    "k2+",
    "k1",
    "kl",
    "abs",
    "k2",
    "mse",
    "k3",
    "low_var_kl",
    "full",
    "",
];

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

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let est = KlEstimator::ALL[b.size(KlEstimator::ALL.len() - 1)];

    // scalar estimators
    let _ = kl_penalty(b.f64(), b.f64(), est);
    let _ = kl_penalty_and_grad(b.f64(), b.f64(), est);
    let _ = kl_penalty_and_grad(b.f32(), b.f32(), est);
    let _ = est.penalty(b.f32(), b.f32());
    let _ = dynamic_kl_weight(b.f64(), b.bool(), b.f64());
    let _ = KlEstimator::from_name(NAMES[b.size(NAMES.len() - 1)]);
    let _ = est.name();

    // the fused token pass
    let rows = b.size(6);
    let cols = b.size(40);
    let shape = if b.u8() == 255 {
        Shape::new(usize::MAX / 2, 3)
    } else {
        Shape::new(rows, cols)
    };
    let n = rows * cols;
    let lp = values(&mut b, n);
    let lr = values(&mut b, n);
    let m = mask(&mut b, n);
    let hwe = if b.bool() {
        Some(mask(&mut b, n))
    } else {
        None
    };
    let betas = values(&mut b, rows);
    let coefficient = if b.bool() {
        KlCoefficient::Uniform(b.f64())
    } else {
        KlCoefficient::PerRow(&betas)
    };
    let mut cfg = TokenKlConfig::new(est, coefficient);
    if let Some(h) = &hwe {
        cfg = cfg.with_hwe(h, b.f64());
    }
    let mut kl = vec![0.0; len(&mut b, n)];
    let mut weighted = vec![0.0; len(&mut b, n)];
    let mut grad = vec![0.0; len(&mut b, n)];
    let mut row_sum = vec![0.0; len(&mut b, rows)];
    let mut row_mean = vec![0.0; len(&mut b, rows)];
    let outs = TokenKlOutputs {
        kl: b.bool().then_some(&mut kl[..]),
        weighted: b.bool().then_some(&mut weighted[..]),
        grad: b.bool().then_some(&mut grad[..]),
        row_weighted_sum: b.bool().then_some(&mut row_sum[..]),
        row_mean_kl: b.bool().then_some(&mut row_mean[..]),
    };
    let _ = token_kl(shape, &lp, &lr, &m, &cfg, outs);
    let _ = masked_kl(shape, &lp, &lr, &m, est, &mut kl);

    // f32
    let (lp32, lr32, m32, b32) = (to32(&lp), to32(&lr), to32(&m), to32(&betas));
    let h32 = hwe.as_deref().map(to32);
    let mut cfg32 = TokenKlConfig::new(est, KlCoefficient::PerRow(&b32));
    if let Some(h) = &h32 {
        cfg32 = cfg32.with_hwe(h, b.f32());
    }
    let mut w32 = vec![0.0f32; len(&mut b, n)];
    let _ = token_kl(
        shape,
        &lp32,
        &lr32,
        &m32,
        &cfg32,
        TokenKlOutputs {
            weighted: Some(&mut w32),
            ..TokenKlOutputs::default()
        },
    );

    // controllers
    if let Ok(mut c) = AdaptiveKlController::new(b.f64(), b.f64(), b.f64()) {
        for _ in 0..b.size(8) {
            let _ = c.update(b.f64(), b.u32() as usize * b.size(255));
        }
        let _ = (c.value(), c.target(), c.horizon());
    }
    for mut c in [
        KlController::fixed(b.f32()),
        KlController::adaptive(b.f32(), b.f32(), b.f32()),
    ]
    .into_iter()
    .flatten()
    {
        let _ = c.update(b.f32(), b.size(255));
        let _ = c.value();
    }
});
