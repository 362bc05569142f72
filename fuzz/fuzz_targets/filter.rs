#![no_main]
//! Fuzzes `ares_core::filter`: group means, the keep filter, row expansion and the
//! `drop_solved` streaks with arbitrary layouts, lengths and parameters.

use ares_core::Groups;
use ares_core::filter::{
    FilterParams, expand_keep, filter_groups, group_means, is_solved, solved_streak,
};
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
    let index: Vec<usize> = (0..batch)
        .map(|i| {
            if b.u8() % 8 == 0 {
                b.size(batch + 1)
            } else {
                batch - 1 - i
            }
        })
        .collect();
    let mut inverse = vec![0usize; len_near(&mut b, batch)];
    let mut ragged = Ragged::new(&mut b, batch);
    let groups = match b.size(3) {
        0 => Groups::permuted(&index, n, &mut inverse),
        1 => Groups::contiguous(len_near(&mut b, batch), n),
        k => ragged.groups(k == 2),
    };
    let Ok(groups) = groups else { return };

    let mut values = vec![0.0; len_near(&mut b, batch)];
    for v in &mut values {
        *v = if b.bool() {
            f64::from(b.u8() & 1)
        } else {
            b.f64()
        };
    }
    let params = if b.bool() {
        FilterParams::default()
    } else {
        FilterParams {
            filter_low: b.f64(),
            filter_high: b.f64(),
        }
    };
    let mut means = vec![0.0; len_near(&mut b, count)];
    let _ = group_means(&groups, &values, &mut means);
    let mut keep = vec![false; len_near(&mut b, count)];
    let _ = filter_groups(&groups, &values, &params, &mut keep);
    let mut rows = vec![false; len_near(&mut b, batch)];
    let _ = expand_keep(&groups, &keep, &mut rows);
    let _ = params.keeps(b.f64());
    let _ = params.validate();

    let values32: Vec<f32> = values.iter().map(|&x| x as f32).collect();
    let params32 = FilterParams {
        filter_low: params.filter_low as f32,
        filter_high: params.filter_high as f32,
    };
    let mut means32 = vec![0f32; means.len()];
    let _ = group_means(&groups, &values32, &mut means32);
    let _ = filter_groups(&groups, &values32, &params32, &mut keep);

    let streak = if b.bool() {
        u32::MAX - b.size(2) as u32
    } else {
        b.u32()
    };
    if let Ok(s) = solved_streak(streak, b.bool(), b.f64(), b.f64()) {
        let _ = is_solved(s, b.u32());
    }
    let _ = solved_streak(b.u32(), b.bool(), b.f32(), b.f32());
});
