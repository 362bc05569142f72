#![no_main]
//! Fuzzes `ares_core::length` (GRPO-λ): contiguous and permuted layouts (valid or not),
//! mismatched lengths, short scratch, NaN/negative lengths, out-of-range λ and α.

use ares_core::Groups;
use ares_core::length::{GrpoLambda, grpo_lambda_rewards, top_group_count};
use ares_fuzz::{Bytes, Ragged};

fn len_near(b: &mut Bytes, len: usize) -> usize {
    if b.u8() % 16 == 0 {
        b.size(len + 2)
    } else {
        len
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let n = b.size(6);
    let count = b.size(12);
    let batch = n * count;
    let permuted = b.bool();
    let index: Vec<usize> = (0..batch)
        .map(|i| {
            if b.u8() % 8 == 0 {
                b.size(batch + 1)
            } else {
                i
            }
        })
        .collect();
    // a rotation keeps it a permutation unless the bytes broke it above
    let shift = b.size(batch);
    let index: Vec<usize> = (0..batch)
        .map(|i| index[(i + shift) % batch.max(1)])
        .collect();
    let mut inverse = vec![0usize; len_near(&mut b, batch)];
    let mut ragged = Ragged::new(&mut b, batch);
    let groups = match (permuted, b.size(2)) {
        (true, _) => Groups::permuted(&index, n, &mut inverse),
        (false, 0) => Groups::contiguous(len_near(&mut b, batch), n),
        (false, k) => ragged.groups(k == 1),
    };
    let Ok(groups) = groups else { return };

    let correct: Vec<bool> = (0..len_near(&mut b, batch)).map(|_| b.bool()).collect();
    let mut lengths = vec![0.0; len_near(&mut b, batch)];
    for l in &mut lengths {
        *l = if b.bool() {
            f64::from(b.u8()) * 16.0
        } else {
            b.f64()
        };
    }
    let params = if b.bool() {
        GrpoLambda::default()
    } else {
        GrpoLambda {
            lambda_: b.f64(),
            alpha: b.f64(),
        }
    };
    let mut order = vec![0usize; len_near(&mut b, count)];
    let mut top = vec![false; len_near(&mut b, count)];
    let mut rewards = vec![0.0; len_near(&mut b, batch)];
    let _ = grpo_lambda_rewards(
        &groups,
        &correct,
        &lengths,
        &params,
        &mut order,
        &mut top,
        &mut rewards,
    );

    let lengths32: Vec<f32> = lengths.iter().map(|&x| x as f32).collect();
    let params32 = GrpoLambda {
        lambda_: params.lambda_ as f32,
        alpha: params.alpha as f32,
    };
    let mut rewards32 = vec![0f32; rewards.len()];
    let _ = grpo_lambda_rewards(
        &groups,
        &correct,
        &lengths32,
        &params32,
        &mut order,
        &mut top,
        &mut rewards32,
    );

    let _ = top_group_count(b.f64(), b.size(255) * b.size(255));
    let _ = top_group_count(b.f32(), usize::MAX);
    let _ = params.validate();
});
