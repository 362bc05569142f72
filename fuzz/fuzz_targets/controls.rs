//! Fuzzes the entropy and length controls: the forking-token mask and its gradient mask, the
//! entropy-coefficient controller (updates, snapshot / restore) and the entropy gradient, and
//! DAPO's overlong penalty with and without the only-correct switch. Arbitrary sizes,
//! parameters and values (mismatched lengths, NaN/∞, invalid masks, short scratch). Nothing
//! may panic, and every successful result keeps the documented invariants.
#![no_main]

use ares_core::entropy_bonus::{EntropyCoefController, EntropyCoefState, entropy_grad_logits};
use ares_core::forking::{forking_token_count, forking_token_mask, mask_token_gradient};
use ares_core::overlong::{overlong_penalties, overlong_penalty};
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

fn forking(b: &mut Bytes) {
    let n = b.size(60);
    let mut h = vec![0.0; n];
    let mut m = vec![0.0; len_near(b, n)];
    for x in &mut h {
        // few distinct values so ties are common
        *x = if b.bool() {
            f64::from(b.u8() % 4)
        } else {
            b.f64()
        };
    }
    b.fill_mask(&mut m);
    let rho = if b.bool() {
        f64::from(b.u8()) / 255.0
    } else {
        b.f64()
    };
    let mut scratch = vec![0.0; len_near(b, n)];
    let mut out = vec![0.0; len_near(b, n)];
    if let Ok(s) = forking_token_mask(&h, &m, rho, &mut scratch, &mut out) {
        assert_eq!(out.iter().filter(|&&o| o == 1.0).count(), s.kept);
        assert!(out.iter().all(|&o| o == 0.0 || o == 1.0));
        assert_eq!(
            s.kept,
            forking_token_count(rho, s.valid).unwrap_or(usize::MAX)
        );
        match s.threshold {
            None => assert_eq!((s.kept, s.valid), (0, 0)),
            Some(tau) => {
                assert!(s.kept >= 1 && s.kept <= s.valid);
                for i in 0..n {
                    if out[i] == 1.0 {
                        assert!(m[i] == 1.0 && h[i] >= tau);
                    } else if m[i] == 1.0 {
                        assert!(h[i] <= tau);
                    }
                }
            }
        }
        let mut grad: Vec<f64> = (0..n).map(|_| b.f64()).collect();
        if mask_token_gradient(&mut grad, &out).is_ok() {
            assert!(grad.iter().zip(&out).all(|(&g, &k)| k == 1.0 || g == 0.0));
        }
    }
    let h32: Vec<f32> = h.iter().map(|&x| x as f32).collect();
    let m32: Vec<f32> = m.iter().map(|&x| x as f32).collect();
    let (mut s32, mut o32) = (vec![0f32; scratch.len()], vec![0f32; out.len()]);
    let _ = forking_token_mask(&h32, &m32, rho as f32, &mut s32, &mut o32);
    let _ = forking_token_count(b.f32(), b.size(255) * b.size(255));
}

fn entropy_bonus(b: &mut Bytes) {
    let mut ctl = EntropyCoefController {
        coef: b.f64(),
        target: b.f64(),
        lr: b.f64(),
        min: b.f64(),
        max: b.f64(),
    };
    if b.bool() {
        ctl = EntropyCoefController::default();
    }
    let valid = ctl.validate().is_ok();
    for _ in 0..b.size(8) {
        let before = ctl;
        match ctl.update(b.f64()) {
            Ok(c) => {
                assert!(valid && ctl.min <= c && c <= ctl.max && c == ctl.coef);
            }
            // bit-identical (the fields may hold NaN, which `==` would call unequal)
            Err(_) => assert_eq!(ctl.coef.to_bits(), before.coef.to_bits()),
        }
    }
    let saved = ctl.snapshot();
    let _ = ctl.restore(EntropyCoefState { coef: b.f64() });
    let _ = ctl.restore(saved);

    let v = b.size(40);
    let mut logits = vec![0.0; v];
    b.fill_f64(&mut logits);
    let t = b.f64();
    let mut out = vec![0.0; len_near(b, v)];
    if let Ok(h) = entropy_grad_logits(&logits, t, &mut out) {
        assert!(h >= 0.0 && h.is_finite());
        assert!(out.iter().all(|g| g.is_finite()));
    }
    let l32: Vec<f32> = logits.iter().map(|&x| x as f32).collect();
    let mut o32 = vec![0f32; out.len()];
    let _ = entropy_grad_logits(&l32, t as f32, &mut o32);
}

fn overlong(b: &mut Bytes) {
    let size = |b: &mut Bytes| match b.u8() % 4 {
        0 => usize::MAX - b.size(3),
        1 => b.size(3),
        _ => b.u32() as usize % 40_000,
    };
    let (max_len, buffer_len) = (size(b), size(b));
    let f = b.f64();
    let n = b.size(24);
    let lengths: Vec<usize> = (0..n).map(|_| size(b)).collect();
    let correct: Vec<bool> = (0..len_near(b, n)).map(|_| b.bool()).collect();
    let mut out = vec![0.0; len_near(b, n)];
    if let Ok(p) = overlong_penalty(
        lengths.first().copied().unwrap_or(0),
        max_len,
        buffer_len,
        f,
    ) {
        assert!(-f <= p && p <= 0.0);
    }
    let only = if b.bool() { Some(&correct[..]) } else { None };
    if let Ok(k) = overlong_penalties(&lengths, max_len, buffer_len, f, only, &mut out) {
        assert_eq!(k, out.iter().filter(|&&x| x < 0.0).count());
        assert!(out.iter().all(|&x| -f <= x && x <= 0.0));
    }
    let mut o32 = vec![0f32; out.len()];
    let _ = overlong_penalties(&lengths, max_len, buffer_len, f as f32, only, &mut o32);
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    match b.u8() % 3 {
        0 => forking(&mut b),
        1 => entropy_bonus(&mut b),
        _ => overlong(&mut b),
    }
});
