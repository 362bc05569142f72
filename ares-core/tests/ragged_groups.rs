//! Groups of different sizes keyed by uid (verl's `index`): every group estimator and the
//! filter give, on a shuffled batch laid out by [`Groups::by_uid`], exactly what they give
//! on each group alone, and a group of one is an error naming its uid.

use ares_core::advantage::{
    GrpoConfig, ProMaxConfig, ResponseTokens, dr_grpo_advantages, grpo_advantages,
    reinforce_baseline_advantages, reinforce_pp_baseline_advantages, reinforce_pro_max,
    rloo_advantages,
};
use ares_core::filter::{FilterParams, filter_groups, group_means};
use ares_core::{Error, Groups, Shape};
use proptest::prelude::*;

/// A shuffled batch: `uids[row]`, `rewards[row]`, and each group's rows (in batch order).
#[derive(Debug, Clone)]
struct Batch {
    uids: Vec<u64>,
    rewards: Vec<f64>,
    members: Vec<Vec<usize>>,
}

fn batch() -> impl Strategy<Value = Batch> {
    (
        proptest::collection::vec(2usize..6, 1..6),
        any::<u64>(),
        any::<bool>(),
    )
        .prop_flat_map(|(sizes, salt, binary)| {
            let rows: usize = sizes.iter().sum();
            let reward = if binary {
                prop_oneof![Just(0.0), Just(1.0)].boxed()
            } else {
                (-2.0f64..2.0).boxed()
            };
            (
                Just(sizes),
                Just(salt),
                proptest::collection::vec(reward, rows),
                Just((0..rows).collect::<Vec<usize>>()).prop_shuffle(),
            )
        })
        .prop_map(|(sizes, salt, rewards, perm)| {
            // group g's samples go to the rows perm[start..start + size]
            let rows = rewards.len();
            let mut uids = vec![0; rows];
            let mut members = Vec::new();
            let mut start = 0;
            for (g, &n) in sizes.iter().enumerate() {
                let mut rows_g: Vec<usize> = perm[start..start + n].to_vec();
                rows_g.sort_unstable();
                for &r in &rows_g {
                    uids[r] = salt.wrapping_add(g as u64 * 0x9E37_79B9);
                }
                members.push(rows_g);
                start += n;
            }
            members.sort_by_key(|m| m[0]);
            Batch {
                uids,
                rewards,
                members,
            }
        })
}

type Scalar = fn(&Groups<'_>, &[f64], &mut [f64]) -> Result<(), Error>;

fn grpo(g: &Groups<'_>, r: &[f64], out: &mut [f64]) -> Result<(), Error> {
    grpo_advantages(g, r, &GrpoConfig::default(), out)
}

const SCALAR: [(&str, Scalar); 4] = [
    ("grpo", grpo),
    ("dr_grpo", dr_grpo_advantages),
    ("rloo", rloo_advantages),
    ("reinforce_pp_baseline", reinforce_baseline_advantages),
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn by_uid_equals_each_group_alone(b in batch()) {
        let rows = b.rewards.len();
        let mut scratch = vec![0usize; 2 * rows + 1];
        let groups = Groups::by_uid(&b.uids, &mut scratch).unwrap();
        prop_assert_eq!(groups.count(), b.members.len());
        for (g, m) in b.members.iter().enumerate() {
            prop_assert_eq!(&groups.rows_of(g).collect::<Vec<_>>(), m);
        }
        for (name, f) in SCALAR {
            let mut out = vec![f64::NAN; rows];
            f(&groups, &b.rewards, &mut out).unwrap();
            for m in &b.members {
                let r: Vec<f64> = m.iter().map(|&i| b.rewards[i]).collect();
                let mut want = vec![0.0; r.len()];
                f(&Groups::contiguous(r.len(), r.len()).unwrap(), &r, &mut want).unwrap();
                for (&row, w) in m.iter().zip(&want) {
                    prop_assert_eq!(out[row], *w, "{} row {}", name, row);
                }
            }
        }
        // the filter's means and decisions
        let mut means = vec![0.0; groups.count()];
        group_means(&groups, &b.rewards, &mut means).unwrap();
        let mut keep = vec![false; groups.count()];
        filter_groups(&groups, &b.rewards, &FilterParams::default(), &mut keep).unwrap();
        for (g, m) in b.members.iter().enumerate() {
            let mean = m.iter().map(|&i| b.rewards[i]).sum::<f64>() / m.len() as f64;
            prop_assert!((means[g] - mean).abs() < 1e-12);
            prop_assert_eq!(keep[g], 0.01 < mean && mean < 0.99);
        }
    }

    /// Token estimators: Pro Max per group equals Pro Max of the group alone; the
    /// ++-baseline (whitened over the whole batch) equals the offsets layout of the same
    /// rows sorted into group order.
    #[test]
    fn token_estimators_on_ragged_groups(b in batch(), cols in 1usize..5, lens in proptest::collection::vec(1usize..5, 32)) {
        let rows = b.rewards.len();
        let shape = Shape::new(rows, cols);
        let mask: Vec<f64> = (0..rows * cols)
            .map(|i| f64::from(u8::from(i % cols < lens[i / cols].min(cols))))
            .collect();
        let mut scratch = vec![0usize; 2 * rows + 1];
        let groups = Groups::by_uid(&b.uids, &mut scratch).unwrap();
        let cfg = ProMaxConfig::default();
        let mut out = vec![0.0; rows * cols];
        reinforce_pro_max(&groups, &b.rewards, ResponseTokens::new(shape, &mask), &cfg, None, &mut out).unwrap();
        let gather = |m: &[usize], x: &[f64]| -> Vec<f64> {
            m.iter().flat_map(|&r| x[r * cols..(r + 1) * cols].iter().copied()).collect()
        };
        for m in &b.members {
            let r: Vec<f64> = m.iter().map(|&i| b.rewards[i]).collect();
            let sub_mask = gather(m, &mask);
            let mut want = vec![0.0; m.len() * cols];
            reinforce_pro_max(
                &Groups::contiguous(m.len(), m.len()).unwrap(),
                &r,
                ResponseTokens::new(Shape::new(m.len(), cols), &sub_mask),
                &cfg,
                None,
                &mut want,
            ).unwrap();
            prop_assert_eq!(gather(m, &out), want);
        }
        // ++-baseline: batch order vs group order
        let mut base = vec![0.0; rows * cols];
        reinforce_pp_baseline_advantages(&groups, &b.rewards, ResponseTokens::new(shape, &mask), 1.0, &mut base).unwrap();
        let order: Vec<usize> = b.members.iter().flatten().copied().collect();
        let mut offsets = vec![0];
        for m in &b.members {
            offsets.push(offsets.last().unwrap() + m.len());
        }
        let sorted_r: Vec<f64> = order.iter().map(|&i| b.rewards[i]).collect();
        let sorted_mask = gather(&order, &mask);
        let mut want = vec![0.0; rows * cols];
        reinforce_pp_baseline_advantages(
            &Groups::from_offsets(&offsets).unwrap(),
            &sorted_r,
            ResponseTokens::new(shape, &sorted_mask),
            1.0,
            &mut want,
        ).unwrap();
        let got = gather(&order, &base);
        for (x, y) in got.iter().zip(&want) {
            // the whitening sums in a different order
            prop_assert!((x - y).abs() < 1e-12 * (1.0 + y.abs()));
        }
    }
}

#[test]
fn a_group_of_one_names_its_uid() {
    // uid 42 has two rows, uid 7 one
    let uids = [42, 7, 42];
    let rewards = [1.0, 0.0, 0.0];
    let mut scratch = [0usize; 7];
    let groups = Groups::by_uid(&uids, &mut scratch).unwrap();
    for (name, f) in SCALAR {
        let mut out = [0.0; 3];
        let err = f(&groups, &rewards, &mut out).unwrap_err();
        let estimator = match err {
            Error::RaggedGroupTooSmall {
                estimator,
                group: 1,
                uid: Some(7),
                n: 1,
            } => estimator,
            other => panic!("{name}: {other:?}"),
        };
        assert!(err.to_string().contains("(uid 7) has 1"), "{err}");
        assert!(!estimator.is_empty());
    }
    let mask = [1.0; 3];
    let mut out = [0.0; 3];
    let err = reinforce_pro_max(
        &groups,
        &rewards,
        ResponseTokens::new(Shape::new(3, 1), &mask),
        &ProMaxConfig::default(),
        None,
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(
        err,
        Error::RaggedGroupTooSmall { uid: Some(7), .. }
    ));
    // the filter needs no pair: a group of one has its own mean
    let mut means = [0.0; 2];
    group_means(&groups, &rewards, &mut means).unwrap();
    assert_eq!(means, [0.5, 0.0]);
}
