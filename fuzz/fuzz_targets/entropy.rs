//! Fuzzes the `entropy` family: token entropy / log-prob, window means, percentiles,
//! medians, thresholds, the τ EMA and HWE, with arbitrary sizes, parameters and values
//! (mismatched lengths, NaN/∞, invalid masks, short scratch). Nothing may panic.
#![no_main]

use ares_core::{Shape, entropy};
use ares_fuzz::Bytes;
use libfuzzer_sys::fuzz_target;

/// A length near `want`: usually exact, sometimes off by a little (to hit length checks).
fn len_near(b: &mut Bytes, want: usize) -> usize {
    match b.u8() % 8 {
        0 => want.saturating_sub(1),
        1 => want + 1,
        2 => b.size(8),
        _ => want,
    }
}

fn vec_f64(b: &mut Bytes, len: usize) -> Vec<f64> {
    let mut v = vec![0.0; len];
    b.fill_f64(&mut v);
    v
}

fn mask_f64(b: &mut Bytes, len: usize) -> Vec<f64> {
    let mut v = vec![0.0; len];
    b.fill_mask(&mut v);
    v
}

/// Values of a length near `want`.
fn values_near(b: &mut Bytes, want: usize) -> Vec<f64> {
    let n = len_near(b, want);
    vec_f64(b, n)
}

/// A 0/1 mask (occasionally invalid) of a length near `want`.
fn mask_near(b: &mut Bytes, want: usize) -> Vec<f64> {
    let n = len_near(b, want);
    mask_f64(b, n)
}

/// A zeroed buffer of a length near `want`.
fn zeros_near<T: Clone + Default>(b: &mut Bytes, want: usize) -> Vec<T> {
    vec![T::default(); len_near(b, want)]
}

fn logits(b: &mut Bytes) {
    let n = b.size(40);
    let l = vec_f64(b, n);
    let t = b.f64();
    let target = b.size(48);
    let _ = entropy::token_entropy(&l, t);
    let _ = entropy::token_log_prob_and_entropy(&l, target, t);
    let l32: Vec<f32> = l.iter().map(|&x| x as f32).collect();
    let _ = entropy::token_entropy(&l32, t as f32);
    let _ = entropy::token_log_prob_and_entropy(&l32, target, t as f32);
}

fn windows(b: &mut Bytes) {
    let rows = b.size(5);
    let cols = b.size(24);
    let n = rows * cols;
    let shape = Shape::new(rows, cols);
    let h = values_near(b, n);
    let m = mask_near(b, n);
    let window_size = match b.u8() % 6 {
        0 => usize::MAX,
        1 => b.size(40),
        _ => b.size(10),
    };
    let includes_self = b.bool();
    let mut means: Vec<f64> = zeros_near(b, n);
    let mut valid: Vec<f64> = zeros_near(b, n);
    let _ = entropy::window_means(
        shape,
        &h,
        &m,
        window_size,
        includes_self,
        &mut means,
        &mut valid,
    );
    // sometimes feed the outputs of a successful pass, sometimes garbage
    if b.bool() {
        let n = valid.len();
        valid = mask_f64(b, n);
    }
    let q = b.f64() * 100.0;
    let mut scratch: Vec<f64> = zeros_near(b, cols);
    let mut thr: Vec<f64> = zeros_near(b, rows);
    let mut has: Vec<f64> = zeros_near(b, rows);
    let _ =
        entropy::response_thresholds(shape, &means, &valid, q, &mut scratch, &mut thr, &mut has);
    let mut scratch2: Vec<f64> = zeros_near(b, thr.len());
    let m_batch = entropy::batch_median_threshold(&thr, &has, &mut scratch2);
    let mut ema = entropy::ThresholdEma::new(b.f64()).unwrap_or_default();
    let tau = match m_batch {
        Ok(Some(m)) => ema.update(m).unwrap_or(0.5),
        _ => b.f64(),
    };
    let _ = ema.update(b.f64());
    let _ = ema.restore(Some(b.f64()));
    let trigger = if b.bool() {
        Some(mask_near(b, n))
    } else {
        None
    };
    let mut out: Vec<f64> = zeros_near(b, n);
    let mut counts: Vec<usize> = zeros_near(b, rows);
    let mut cost: Vec<f64> = zeros_near(b, rows);
    let _ = entropy::hwe(
        shape,
        &means,
        &valid,
        tau,
        trigger.as_deref(),
        &mut out,
        &mut counts,
        &mut cost,
    );

    // f32, exact lengths
    let h32: Vec<f32> = vec_f64(b, n).iter().map(|&x| x as f32).collect();
    let m32: Vec<f32> = mask_f64(b, n).iter().map(|&x| x as f32).collect();
    let (mut a, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let ws = b.size(12);
    let _ = entropy::window_means(shape, &h32, &m32, ws, b.bool(), &mut a, &mut v);
    let (mut o, mut c, mut s) = (vec![0.0f32; n], vec![0usize; rows], vec![0.0f32; rows]);
    let _ = entropy::hwe(shape, &a, &v, b.f32(), None, &mut o, &mut c, &mut s);
    let (mut t, mut hs, mut sc) = (vec![0.0f32; rows], vec![0.0f32; rows], vec![0.0f32; cols]);
    let _ = entropy::response_thresholds(shape, &a, &v, b.f32(), &mut sc, &mut t, &mut hs);
}

fn order_stats(b: &mut Bytes) {
    let n = b.size(30);
    let v = vec_f64(b, n);
    let mut scratch: Vec<f64> = zeros_near(b, n);
    let _ = entropy::percentile(&v, b.f64(), &mut scratch);
    let _ = entropy::median(&v, &mut scratch);
    let v32: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    let mut s32 = vec![0.0f32; n];
    let _ = entropy::percentile(&v32, b.f32(), &mut s32);
    let _ = entropy::median(&v32, &mut s32);
    let _ = entropy::ThresholdEma::with_tau(b.f32(), b.f32()).map(|mut e| e.update(b.f32()));
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    match b.u8() % 3 {
        0 => logits(&mut b),
        1 => windows(&mut b),
        _ => order_stats(&mut b),
    }
});
