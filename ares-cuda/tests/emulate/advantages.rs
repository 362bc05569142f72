// The advantage estimators' kernels of `token_kernels.cu`, composed as
// `ares-cuda/src/advantage_ops.rs` composes them, against ares-core's functions (a module of
// `emulated.rs`: it shares its build of the kernels).

use super::kernels;
use crate::advantage_batch::Case;
use crate::loss_reference::Rng;
use ares_core::advantage::{self as adv, GrpoConfig, ProMaxConfig, ResponseTokens};
use ares_core::{Groups, Shape};
use ares_cuda::TokenEstimator;

type Scores = unsafe extern "C" fn(
    u32,
    u32,
    *const f32,
    *const i32,
    *const i32,
    i32,
    i32,
    f32,
    f32,
    *mut f32,
    *mut u8,
    *mut u32,
);
type Returns = unsafe extern "C" fn(
    u32,
    u32,
    *const f32,
    *const f32,
    *const f32,
    i64,
    f32,
    i32,
    i32,
    *mut f32,
    *mut f32,
    *mut u32,
);
type RowMoments = unsafe extern "C" fn(u32, u32, *const f32, *const f32, i64, *mut f32, *mut u32);
type Stats = unsafe extern "C" fn(u32, u32, *const f32, i64, f32, *mut f32, *mut u32);
type Apply = unsafe extern "C" fn(u32, u32, *mut f32, *const f32, i64, *const f32);
type Normalize =
    unsafe extern "C" fn(u32, u32, *mut f32, i64, *const i32, *const i32, *const u8, f32, f32, f32);

/// Threads per block, as `advantage_ops.rs` launches them.
const GROUP_BLOCK: u32 = 128;
const ROW_BLOCK: u32 = 256;

/// The row lists of `groups`, as `advantage_ops.rs` uploads them.
fn layout(groups: &Groups<'_>) -> (Vec<i32>, Vec<i32>) {
    let mut rows = Vec::new();
    let mut offsets = vec![0i32];
    for g in 0..groups.count() {
        rows.extend(groups.rows_of(g).map(|r| r as i32));
        offsets.push(rows.len() as i32);
    }
    (rows, offsets)
}

/// `whiten_stats` then `whiten_apply` over `values` (`[rows, cols]`, rows = moments / 3), as
/// `advantage_ops.rs` queues them; returns the stats.
fn whiten_launches(
    lib: &libloading::Library,
    moments: &[f32],
    values: &mut [f32],
    mask: &[f32],
    status: &mut [u32; 3],
) -> [f32; 4] {
    let stats_k = launcher!(lib, "emu_whiten_stats", Stats);
    let apply_k = launcher!(lib, "emu_whiten_apply", Apply);
    let mut stats = [f32::NAN; 4];
    // SAFETY: [rows, 3] moments, four stats, `values` and `mask` of one length.
    unsafe {
        stats_k(
            1,
            256,
            moments.as_ptr(),
            (moments.len() / 3) as i64,
            adv::WHITEN_VAR_FLOOR as f32,
            stats.as_mut_ptr(),
            status.as_mut_ptr(),
        );
        apply_k(
            values.len().div_ceil(ROW_BLOCK as usize) as u32,
            ROW_BLOCK,
            values.as_mut_ptr(),
            mask.as_ptr(),
            values.len() as i64,
            stats.as_ptr(),
        );
    }
    stats
}

/// What the device pipeline returns: token values, status words, whitening stats.
struct Device {
    out: Vec<f32>,
    status: [u32; 3],
    stats: [f32; 4],
}

/// `Cuda::token_advantages` on the emulated kernels (the same launches, in the same order).
fn device_tokens(
    lib: &libloading::Library,
    est: TokenEstimator,
    groups: &Groups<'_>,
    rewards: &[f32],
    mask: &[f32],
    kl: Option<&[f32]>,
    cols: usize,
) -> Device {
    let scores_k = launcher!(lib, "emu_group_scores", Scores);
    let returns_k = launcher!(lib, "emu_token_returns", Returns);
    let normalize_k = launcher!(lib, "emu_pro_max_normalize", Normalize);
    let rows = rewards.len();
    let (group_rows, offsets) = layout(groups);
    let count = groups.count();
    let (kind, eps, uniform_std, gamma, mode) = match est {
        TokenEstimator::Grpo(c) => (i32::from(!c.norm_adv_by_std), c.epsilon, 0.0, 1.0, 0),
        TokenEstimator::Rloo => (2, 0.0, 0.0, 1.0, 1),
        TokenEstimator::ReinforcePp { gamma } | TokenEstimator::ReinforcePpBaseline { gamma } => {
            (1, 0.0, 0.0, gamma, 1)
        }
        TokenEstimator::ProMax(c) => (
            if c.uniform_scale { 3 } else { 2 },
            0.0,
            c.uniform_std,
            1.0,
            1,
        ),
    };
    let mut status = [u32::MAX, 0, u32::MAX];
    let mut scores = vec![f32::NAN; rows];
    let mut uniform = vec![7u8; count];
    let pro_max = matches!(est, TokenEstimator::ProMax(_));
    // SAFETY (every launch below): the pointers cover the lengths the kernels index —
    // [rows] rewards/scores, [rows, cols] tokens, the layout's rows and count + 1 offsets.
    if let TokenEstimator::ReinforcePp { .. } = est {
        scores.copy_from_slice(rewards);
    } else {
        unsafe {
            scores_k(
                (count as u32).div_ceil(GROUP_BLOCK),
                GROUP_BLOCK,
                rewards.as_ptr(),
                group_rows.as_ptr(),
                offsets.as_ptr(),
                count as i32,
                kind,
                eps,
                uniform_std,
                scores.as_mut_ptr(),
                uniform.as_mut_ptr(),
                status.as_mut_ptr(),
            )
        };
    }
    let whiten = matches!(
        est,
        TokenEstimator::ReinforcePp { .. } | TokenEstimator::ReinforcePpBaseline { .. }
    );
    let mut out = vec![f32::NAN; rows * cols];
    let mut moments = vec![f32::NAN; 3 * rows];
    let moments_ptr = if whiten {
        moments.as_mut_ptr()
    } else {
        std::ptr::null_mut()
    };
    unsafe {
        returns_k(
            rows as u32,
            ROW_BLOCK,
            scores.as_ptr(),
            mask.as_ptr(),
            kl.map_or(std::ptr::null(), <[f32]>::as_ptr),
            cols as i64,
            gamma,
            mode,
            i32::from(matches!(est, TokenEstimator::ReinforcePp { .. })),
            out.as_mut_ptr(),
            moments_ptr,
            status.as_mut_ptr(),
        )
    };
    let stats = if whiten {
        whiten_launches(lib, &moments, &mut out, mask, &mut status)
    } else {
        [f32::NAN; 4]
    };
    if let TokenEstimator::ProMax(c) = est {
        assert!(pro_max);
        let skip = if c.uniform_scale {
            uniform.as_ptr()
        } else {
            std::ptr::null()
        };
        unsafe {
            normalize_k(
                count as u32,
                ROW_BLOCK,
                out.as_mut_ptr(),
                cols as i64,
                group_rows.as_ptr(),
                offsets.as_ptr(),
                skip,
                c.eps,
                c.max_scale,
                c.product_cap,
            )
        };
    }
    Device { out, status, stats }
}

/// Core's token advantages for `est`, and its whitening statistics.
fn core_tokens(
    est: TokenEstimator,
    groups: &Groups<'_>,
    rewards: &[f32],
    tokens: ResponseTokens<'_, f32>,
) -> (Vec<f32>, Option<adv::WhitenStats<f32>>) {
    let mut out = vec![0.0f32; tokens.mask.len()];
    let stats = match est {
        TokenEstimator::Grpo(c) => {
            adv::grpo_token_advantages(groups, rewards, tokens.shape, tokens.mask, &c, &mut out)
                .expect("core grpo");
            None
        }
        TokenEstimator::Rloo => {
            adv::rloo_token_advantages(groups, rewards, tokens, &mut out).expect("core rloo");
            None
        }
        TokenEstimator::ReinforcePp { gamma } => {
            Some(adv::reinforce_pp_advantages(rewards, tokens, gamma, &mut out).expect("core"))
        }
        TokenEstimator::ReinforcePpBaseline { gamma } => Some(
            adv::reinforce_pp_baseline_advantages(groups, rewards, tokens, gamma, &mut out)
                .expect("core"),
        ),
        TokenEstimator::ProMax(c) => {
            adv::reinforce_pro_max(groups, rewards, tokens, &c, None, &mut out).expect("core");
            None
        }
    };
    (out, stats)
}

#[test]
fn kernel_on_cpu_group_scores_equal_cores_bit_for_bit() {
    let Some(lib) = kernels() else { return };
    let scores_k = launcher!(lib, "emu_group_scores", Scores);
    let mut rng = Rng(0xADA);
    for groups_n in [1usize, 3, 40, 300] {
        let case = Case::new(&mut rng, groups_n, 1);
        let rows = case.rows();
        let mut scratch = vec![0usize; 2 * rows + 1];
        let groups = Groups::by_uid(&case.uids, &mut scratch).expect("layout");
        let (group_rows, offsets) = layout(&groups);
        let grpo = GrpoConfig::<f32>::default();
        let pro_max = ProMaxConfig::<f32> {
            uniform_std: 0.3,
            ..ProMaxConfig::uniform_scale()
        };
        let r = &case.rewards;
        for kind in 0..4 {
            let mut want = vec![0.0f32; rows];
            let mut want_uniform = vec![false; groups.count()];
            match kind {
                0 => adv::grpo_advantages(&groups, r, &grpo, &mut want),
                1 => adv::dr_grpo_advantages(&groups, r, &mut want),
                2 => adv::rloo_advantages(&groups, r, &mut want),
                _ => adv::pro_max_shaped_rewards(
                    &groups,
                    r,
                    &pro_max,
                    &mut want,
                    Some(&mut want_uniform),
                )
                .map(|_| ()),
            }
            .expect("core");
            let (mut got, mut uniform, mut status) = (
                vec![f32::NAN; rows],
                vec![9u8; groups.count()],
                [u32::MAX, 0, u32::MAX],
            );
            let (eps, ustd) = match kind {
                0 => (grpo.epsilon, 0.0),
                3 => (0.0, pro_max.uniform_std),
                _ => (0.0, 0.0),
            };
            // SAFETY: [rows] rewards and scores, the layout's rows and count + 1 offsets.
            unsafe {
                scores_k(
                    (groups.count() as u32).div_ceil(GROUP_BLOCK),
                    GROUP_BLOCK,
                    r.as_ptr(),
                    group_rows.as_ptr(),
                    offsets.as_ptr(),
                    groups.count() as i32,
                    kind,
                    eps,
                    ustd,
                    got.as_mut_ptr(),
                    uniform.as_mut_ptr(),
                    status.as_mut_ptr(),
                )
            };
            assert_eq!(
                status,
                [u32::MAX, 0, u32::MAX],
                "kind {kind}: nothing flagged"
            );
            for i in 0..rows {
                assert_eq!(
                    got[i].to_bits(),
                    want[i].to_bits(),
                    "{groups_n} groups, kind {kind}, row {i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
            if kind == 3 {
                let flags: Vec<bool> = uniform.iter().map(|&u| u == 1).collect();
                assert_eq!(flags, want_uniform, "uniform groups");
                assert!(
                    flags.iter().any(|&f| f) || groups_n < 4,
                    "a uniform group is tried"
                );
            }
        }
        // a NaN reward is flagged at its row
        let mut bad = case.rewards.clone();
        let at = rows / 2;
        bad[at] = f32::NAN;
        let (mut got, mut status) = (vec![0.0f32; rows], [u32::MAX, 0, u32::MAX]);
        // SAFETY: as above (no uniform flags: null).
        unsafe {
            scores_k(
                (groups.count() as u32).div_ceil(GROUP_BLOCK),
                GROUP_BLOCK,
                bad.as_ptr(),
                group_rows.as_ptr(),
                offsets.as_ptr(),
                groups.count() as i32,
                0,
                1e-6,
                0.0,
                got.as_mut_ptr(),
                std::ptr::null_mut(),
                status.as_mut_ptr(),
            )
        };
        assert_eq!(status, [u32::MAX, 1, at as u32], "NaN reward at row {at}");
    }
}

#[test]
fn kernel_on_cpu_token_advantages_match_core() {
    let Some(lib) = kernels() else { return };
    let mut rng = Rng(0x70C);
    let estimators = [
        TokenEstimator::Grpo(GrpoConfig::default()),
        TokenEstimator::Grpo(GrpoConfig::dr_grpo()),
        TokenEstimator::Rloo,
        TokenEstimator::ReinforcePp { gamma: 1.0 },
        TokenEstimator::ReinforcePp { gamma: 0.97 },
        TokenEstimator::ReinforcePpBaseline { gamma: 1.0 },
        TokenEstimator::ReinforcePpBaseline { gamma: 0.9 },
        TokenEstimator::ProMax(ProMaxConfig::default()),
        TokenEstimator::ProMax(ProMaxConfig {
            uniform_std: 0.05,
            ..ProMaxConfig::uniform_scale()
        }),
    ];
    let mut compared = 0;
    for (groups_n, cols) in [(2usize, 1usize), (5, 7), (12, 300), (24, 700)] {
        let case = Case::new(&mut rng, groups_n, cols);
        let rows = case.rows();
        let mut scratch = vec![0usize; 2 * rows + 1];
        let groups = Groups::by_uid(&case.uids, &mut scratch).expect("layout");
        let shape = Shape { rows, cols };
        for est in estimators {
            for with_kl in [false, true] {
                if with_kl && matches!(est, TokenEstimator::Grpo(_)) {
                    continue; // GRPO keeps KL out of the reward
                }
                let kl = with_kl.then_some(case.kl.as_slice());
                let tokens = match kl {
                    Some(k) => ResponseTokens::new(shape, &case.mask).with_kl(k),
                    None => ResponseTokens::new(shape, &case.mask),
                };
                let (want, want_stats) = core_tokens(est, &groups, &case.rewards, tokens);
                let dev = device_tokens(lib, est, &groups, &case.rewards, &case.mask, kl, cols);
                let what = format!("{rows}×{cols} {est:?} kl={with_kl}");
                assert_eq!(
                    dev.status,
                    [u32::MAX, 0, u32::MAX],
                    "{what}: nothing flagged"
                );
                // broadcast scores are core's values; sums in another order are within a few
                // ulps of the row's scale (whitened values: of 1)
                let exact =
                    kl.is_none() && matches!(est, TokenEstimator::Grpo(_) | TokenEstimator::Rloo);
                for (i, (&g, &w)) in dev.out.iter().zip(&want).enumerate() {
                    if exact {
                        // equal values (padding may be +0 where core's m·a is −0)
                        assert!(g == w, "{what}: token {i}: {g} vs {w}");
                    } else {
                        let tol = 2e-5 * w.abs().max(1.0);
                        assert!((g - w).abs() <= tol, "{what}: token {i}: {g} vs {w}");
                    }
                }
                if let Some(s) = want_stats {
                    assert_eq!(
                        dev.stats[3] as usize, s.valid_tokens,
                        "{what}: valid tokens"
                    );
                    assert!((dev.stats[0] - s.mean).abs() <= 1e-5 * s.mean.abs().max(1.0));
                    assert!((dev.stats[1] - s.var).abs() <= 1e-5 * s.var.abs().max(1.0));
                }
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 4 * 16);
}

#[test]
fn kernel_on_cpu_advantage_kernels_flag_what_core_rejects() {
    let Some(lib) = kernels() else { return };
    let mut rng = Rng(0xBAD);
    let case = Case::new(&mut rng, 6, 40);
    let (rows, cols) = (case.rows(), case.cols);
    let mut scratch = vec![0usize; 2 * rows + 1];
    let groups = Groups::by_uid(&case.uids, &mut scratch).expect("layout");
    let rloo = TokenEstimator::Rloo;
    // a mask entry that is not 0/1, at its flat index
    let mut mask = case.mask.clone();
    mask[3 * cols + 1] = 0.5;
    let dev = device_tokens(lib, rloo, &groups, &case.rewards, &mask, None, cols);
    assert_eq!(dev.status, [(3 * cols + 1) as u32, 2, u32::MAX], "mask 0.5");
    // a NaN reward in a group with an earlier row: the group's tokens overflow from the row
    // before it, yet the reward's own row is what is named (kept apart from token indices)
    let g = (0..groups.count())
        .find(|&g| groups.rows_of(g).max() > groups.rows_of(g).min())
        .expect("a group of two rows or more");
    let at = groups.rows_of(g).max().expect("rows");
    let mut rewards = case.rewards.clone();
    rewards[at] = f32::NAN;
    let dev = device_tokens(lib, rloo, &groups, &rewards, &case.mask, None, cols);
    assert_eq!(
        (dev.status[1] & 1, dev.status[2]),
        (1, at as u32),
        "NaN reward at row {at}"
    );
    // a non-finite KL value (padding included)
    let mut kl = case.kl.clone();
    kl[rows * cols - 1] = f32::INFINITY;
    let dev = device_tokens(
        lib,
        rloo,
        &groups,
        &case.rewards,
        &case.mask,
        Some(&kl),
        cols,
    );
    assert_eq!(dev.status[1] & 4, 4, "inf KL");
    // a row without valid token: RLOO's reward has nowhere to sit; GRPO broadcasts zeros
    let mut mask = case.mask.clone();
    mask[2 * cols..3 * cols].iter_mut().for_each(|m| *m = 0.0);
    let dev = device_tokens(lib, rloo, &groups, &case.rewards, &mask, None, cols);
    assert_eq!(dev.status, [(2 * cols) as u32, 8, u32::MAX], "empty row");
    let grpo = TokenEstimator::Grpo(GrpoConfig::default());
    let dev = device_tokens(lib, grpo, &groups, &case.rewards, &mask, None, cols);
    assert_eq!(
        dev.status,
        [u32::MAX, 0, u32::MAX],
        "GRPO takes an empty row"
    );
    assert!(dev.out[2 * cols..3 * cols].iter().all(|&v| v == 0.0));
    // REINFORCE++ reads the rewards as they are: a NaN is flagged at its row
    let mut rewards = case.rewards.clone();
    rewards[4] = f32::NAN;
    let pp = TokenEstimator::ReinforcePp { gamma: 1.0 };
    let dev = device_tokens(lib, pp, &groups, &rewards, &case.mask, None, cols);
    assert_eq!((dev.status[1] & 1, dev.status[2]), (1, 4), "NaN reward");
    // no valid token at all: the whitening has no statistics and applies nothing
    let zeros = vec![0.0f32; rows * cols];
    let dev = device_tokens(lib, pp, &groups, &case.rewards, &zeros, None, cols);
    assert_eq!(dev.status[1] & (8 | 64), 8 | 64, "empty batch");
}

#[test]
fn kernel_on_cpu_masked_whiten_matches_core() {
    let Some(lib) = kernels() else { return };
    let moments_k = launcher!(lib, "emu_masked_row_moments", RowMoments);
    let mut rng = Rng(0x3417);
    for (groups_n, cols, offset) in [(1usize, 3usize, 0.0f32), (20, 500, 1e3), (50, 64, -7.0)] {
        let case = Case::new(&mut rng, groups_n, cols);
        let rows = case.rows();
        let values: Vec<f32> = case.kl.iter().map(|k| offset + 40.0 * k).collect();
        let mut want = values.clone();
        let s = adv::masked_whiten(Shape { rows, cols }, &mut want, &case.mask).expect("core");
        let mut got = values.clone();
        let (mut moments, mut status) = (vec![0.0f32; 3 * rows], [u32::MAX, 0, u32::MAX]);
        // SAFETY: [rows, cols] values and mask, [rows, 3] moments, four stats.
        unsafe {
            moments_k(
                rows as u32,
                ROW_BLOCK,
                got.as_ptr(),
                case.mask.as_ptr(),
                cols as i64,
                moments.as_mut_ptr(),
                status.as_mut_ptr(),
            );
        }
        let stats = whiten_launches(lib, &moments, &mut got, &case.mask, &mut status);
        let what = format!("{rows}×{cols} offset {offset}");
        assert_eq!(status, [u32::MAX, 0, u32::MAX], "{what}");
        assert_eq!(stats[3] as usize, s.valid_tokens, "{what}");
        assert!(
            (stats[0] - s.mean).abs() <= 1e-6 * s.mean.abs().max(1.0),
            "{what}: mean"
        );
        assert!(
            (stats[1] - s.var).abs() <= 1e-4 * s.var,
            "{what}: var {} vs {}",
            stats[1],
            s.var
        );
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                "{what}: token {i}: {g} vs {w}"
            );
        }
        // a non-finite value is flagged and nothing is applied (core leaves `values` as given)
        let mut bad = values.clone();
        bad[rows * cols / 2] = f32::INFINITY;
        let (mut moments, mut status) = (vec![0.0f32; 3 * rows], [u32::MAX, 0, u32::MAX]);
        // SAFETY: as above.
        unsafe {
            moments_k(
                rows as u32,
                ROW_BLOCK,
                bad.as_ptr(),
                case.mask.as_ptr(),
                cols as i64,
                moments.as_mut_ptr(),
                status.as_mut_ptr(),
            )
        };
        let before = bad.clone();
        let stats = whiten_launches(lib, &moments, &mut bad, &case.mask, &mut status);
        assert_eq!(
            status[..2],
            [(rows * cols / 2) as u32, 16],
            "{what}: inf flagged"
        );
        assert_eq!(stats[3], 0.0, "{what}: nothing to apply");
        assert!(
            bad.iter()
                .zip(&before)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}"
        );
    }
}
