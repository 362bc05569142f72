//! ares-core against verl 0.9.1's own outputs, for every function the two libraries share.
//!
//! `tests/fixtures/verl_0_9_1.json` was written by `scripts/make_verl_fixtures.py` (torch on
//! the CPU, float64, verl's `core_algos` and `torch_functional` called as they are); this test
//! needs no Python. Where ares-core differs from verl on purpose, the test checks the
//! documented relation instead of equality and says so (docs/algorithms.md §15):
//!
//! - whitening uses the population variance with a floor, `(x − μ)/√max(var, 1e−8)`; verl uses
//!   the unbiased variance inside `rsqrt(var + 1e−8)`;
//! - returns-to-go discount the return through a mask gap (OpenRLHF's convention); verl
//!   carries it across undiscounted, so the two differ at gaps when γ < 1;
//! - the REINFORCE++-baseline subtracts the group mean of the scalar reward, then folds KL into
//!   token rewards and takes returns-to-go with γ; verl subtracts the group mean of the summed
//!   token rewards and broadcasts it (no γ);
//! - a group of one and a row without a response token are errors (verl: mean 0 / std 1, and a
//!   silently empty row); the fixture holds none;
//! - Clip-Cov draws its tokens with a seed instead of `torch.randperm`: the fixture holds only
//!   cases where verl's draw is forced (no more candidates than the budget).

use std::path::Path;

use ares_core::advantage::{
    GrpoConfig, ResponseTokens, dr_grpo_advantages, grpo_advantages, masked_whiten,
    reinforce_pp_advantages, rloo_advantages,
};
use ares_core::entropy::token_entropy;
use ares_core::kl::{AdaptiveKlController, KlEstimator, kl_penalty_and_grad};
use ares_core::loss::{
    ClipCovParams, ClipParams, GspoLevel, KlCovParams, LossAggMode, PolicyLossConfig,
    PolicyLossInput, PolicyLossOutput, aggregate, cispo_loss, clip_cov_loss, gspo_loss,
    kl_cov_loss, policy_loss,
};
use ares_core::{Groups, Shape};
use serde_json::Value;

/// Agreement wanted everywhere (float64 on both sides; the formulas are the same, only the
/// summation order differs).
const TOL: f64 = 1e-9;
/// Where verl adds `1e-8` to a token count (`masked_mean`'s metrics, the per-row division of
/// `seq-mean-token-mean`): a relative difference of at most `1e-8 / count`.
const TOL_COUNT_EPS: f64 = 2e-8;

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/verl_0_9_1.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn cases<'a>(fx: &'a Value, section: &str) -> &'a [Value] {
    let list = fx[section]
        .as_array()
        .unwrap_or_else(|| panic!("fixture section {section:?} missing"));
    assert!(!list.is_empty(), "fixture section {section:?} is empty");
    list
}

fn f64s(v: &Value, key: &str) -> Vec<f64> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no array {key:?} in {v}"))
        .iter()
        .map(|x| {
            x.as_f64()
                .unwrap_or_else(|| panic!("{key}: not a number: {x}"))
        })
        .collect()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("no number {key:?} in {v}"))
}

fn usize_of(v: &Value, key: &str) -> usize {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no integer {key:?} in {v}")) as usize
}

fn text<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("no string {key:?} in {v}"))
}

fn shape(v: &Value) -> Shape {
    Shape::new(usize_of(v, "rows"), usize_of(v, "cols"))
}

fn close(got: f64, want: f64, what: &str) {
    close_tol(got, want, TOL, what);
}

fn close_tol(got: f64, want: f64, tol: f64, what: &str) {
    assert!(
        (got - want).abs() <= tol * (1.0 + want.abs()),
        "{what}: ares {got}, verl {want} (Δ {:e})",
        got - want
    );
}

fn close_all(got: &[f64], want: &[f64], what: &str) {
    close_all_tol(got, want, TOL, what);
}

fn close_all_tol(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        close_tol(*g, *w, tol, &format!("{what}[{i}]"));
    }
}

fn agg_mode(name: &str) -> LossAggMode {
    LossAggMode::from_name(name).unwrap_or_else(|| panic!("unknown mode {name:?}"))
}

#[test]
fn agg_loss() {
    let fx = fixture();
    for (i, c) in cases(&fx, "agg_loss").iter().enumerate() {
        let mode = agg_mode(text(c, "mode"));
        let got = aggregate(shape(c), &f64s(c, "values"), &f64s(c, "mask"), mode).unwrap();
        let tol = if mode == LossAggMode::SeqMeanTokenMean {
            TOL_COUNT_EPS
        } else {
            TOL
        };
        close_tol(
            got,
            num(c, "loss"),
            tol,
            &format!("agg_loss #{i} {}", mode.name()),
        );
    }
}

#[test]
fn kl_penalty() {
    let fx = fixture();
    for (i, c) in cases(&fx, "kl_penalty").iter().enumerate() {
        let name = text(c, "estimator");
        let est = KlEstimator::from_name(name).unwrap_or_else(|| panic!("estimator {name}"));
        let (lp, lr) = (f64s(c, "logp"), f64s(c, "logp_ref"));
        let (value, grad): (Vec<f64>, Vec<f64>) = lp
            .iter()
            .zip(&lr)
            .map(|(&a, &b)| kl_penalty_and_grad(a, b, est))
            .unzip();
        let what = format!("kl_penalty #{i} {name}");
        close_all(&value, &f64s(c, "value"), &format!("{what} value"));
        close_all(&grad, &f64s(c, "grad"), &format!("{what} grad"));
    }
}

/// Runs one policy-loss case through the ares-core function of its name.
fn run_policy_loss(c: &Value) -> (PolicyLossOutput<f64>, Vec<f64>) {
    let p = &c["params"];
    let (logp, old, adv, mask) = (
        f64s(c, "logp"),
        f64s(c, "logp_old"),
        f64s(c, "advantages"),
        f64s(c, "mask"),
    );
    let input = PolicyLossInput {
        shape: shape(c),
        logp: &logp,
        logp_old: &old,
        advantages: &adv,
        mask: &mask,
        logp_rollout: None,
    };
    let name = text(c, "loss");
    // verl's GSPO, CISPO and Clip-Cov have no dual clip; its vanilla loss always has one
    let dual = if name == "vanilla" {
        num(p, "clip_ratio_c")
    } else {
        0.0
    };
    let config = PolicyLossConfig {
        clip: ClipParams::new(num(p, "clip_ratio_low"), num(p, "clip_ratio_high"), dual).unwrap(),
        agg: agg_mode(text(c, "agg")),
        ..PolicyLossConfig::default()
    };
    let mut grad = vec![0.0; logp.len()];
    let mut scratch = vec![0usize; logp.len()];
    let out = match name {
        "vanilla" => policy_loss(&input, &config, &mut grad),
        // verl's `gspo` is GSPO-token
        "gspo" => gspo_loss(&input, &config, GspoLevel::Token, &mut grad),
        "cispo" => cispo_loss(&input, &config, &mut grad),
        "clip_cov" => {
            let params = ClipCovParams {
                ratio: num(p, "clip_cov_ratio"),
                lb: num(p, "clip_cov_lb"),
                ub: num(p, "clip_cov_ub"),
                seed: 0,
            };
            clip_cov_loss(&input, &config, &params, &mut scratch, &mut grad)
        }
        "kl_cov" => {
            let params = KlCovParams {
                ratio: num(p, "kl_cov_ratio"),
                coef: num(p, "ppo_kl_coef"),
            };
            kl_cov_loss(&input, &config, &params, &mut scratch, &mut grad)
        }
        other => panic!("unknown policy loss {other:?}"),
    };
    (out.unwrap_or_else(|e| panic!("{name}: {e}")), grad)
}

#[test]
fn policy_losses() {
    let fx = fixture();
    let mut seen = std::collections::BTreeSet::new();
    for (i, c) in cases(&fx, "policy_loss").iter().enumerate() {
        let name = text(c, "loss");
        seen.insert(name.to_string());
        let what = format!("policy_loss #{i} {name} {}", text(c, "agg"));
        let (out, grad) = run_policy_loss(c);
        let tol = if text(c, "agg") == "seq-mean-token-mean" {
            TOL_COUNT_EPS
        } else {
            TOL
        };
        close_tol(out.loss, num(c, "out"), tol, &format!("{what} loss"));
        close_all_tol(&grad, &f64s(c, "grad"), tol, &format!("{what} dL/dlogπ"));
        let metrics = &c["metrics"];
        let metric = |key: &str| metrics[key].as_f64();
        let close = |got: f64, want: f64, what: &str| close_tol(got, want, TOL_COUNT_EPS, what);
        match name {
            "clip_cov" => {
                // verl logs the selected fraction as pg_clipfrac
                if let Some(f) = metric("actor/pg_clipfrac") {
                    close(out.selected_frac, f, &format!("{what} selected_frac"));
                }
                let selected = c["selected"].as_array().map_or(0, Vec::len);
                close(
                    out.selected_frac * out.valid_tokens as f64,
                    selected as f64,
                    &format!("{what} selected count"),
                );
            }
            "kl_cov" => {
                let selected = c["selected"].as_array().map_or(0, Vec::len);
                close(
                    out.selected_frac * out.valid_tokens as f64,
                    selected as f64,
                    &format!("{what} selected count"),
                );
            }
            _ => {
                if let Some(f) = metric("actor/pg_clipfrac") {
                    close(out.clipfrac, f, &format!("{what} clipfrac"));
                }
                if let Some(f) = metric("actor/pg_clipfrac_lower") {
                    close(out.clipfrac_lower, f, &format!("{what} clipfrac_lower"));
                }
                if let Some(f) = metric("actor/ppo_kl") {
                    close(out.approx_kl, f, &format!("{what} ppo_kl"));
                }
            }
        }
    }
    for name in ["vanilla", "gspo", "cispo", "clip_cov", "kl_cov"] {
        assert!(seen.contains(name), "no {name} case in the fixture");
    }
}

#[test]
fn advantages() {
    let fx = fixture();
    let mut seen = std::collections::BTreeSet::new();
    for (i, c) in cases(&fx, "advantage").iter().enumerate() {
        let name = text(c, "estimator");
        seen.insert(name.to_string());
        let what = format!("advantage #{i} {name}");
        let sh = shape(c);
        let mask = f64s(c, "mask");
        let scores = f64s(c, "scores");
        let uids: Vec<u64> = c["uid"]
            .as_array()
            .expect("uid")
            .iter()
            .map(|u| u.as_u64().expect("uid is an integer"))
            .collect();
        let mut scratch = vec![0usize; 2 * uids.len() + 1];
        let groups = Groups::by_uid(&uids, &mut scratch).expect("uid layout");
        let want = f64s(c, "advantages");
        let mut per_row = vec![0.0; sh.rows];
        let mut got = vec![0.0; sh.rows * sh.cols];
        let broadcast = |per_row: &[f64], got: &mut [f64]| {
            for (i, g) in got.iter_mut().enumerate() {
                *g = per_row[i / sh.cols] * mask[i];
            }
        };
        match name {
            "grpo" => {
                grpo_advantages(&groups, &scores, &GrpoConfig::default(), &mut per_row).unwrap();
                broadcast(&per_row, &mut got);
            }
            "dr_grpo" => {
                dr_grpo_advantages(&groups, &scores, &mut per_row).unwrap();
                broadcast(&per_row, &mut got);
            }
            "rloo" => {
                rloo_advantages(&groups, &scores, &mut per_row).unwrap();
                broadcast(&per_row, &mut got);
            }
            "reinforce_plus_plus_baseline" => {
                // verl: (r − mean_g) broadcast, whitened with the unbiased variance; ours is
                // the same before the whitening, whose variance rule differs on purpose
                ares_core::advantage::reinforce_baseline_advantages(&groups, &scores, &mut per_row)
                    .unwrap();
                broadcast(&per_row, &mut got);
                rewhiten_unbiased(&mut got, &mask);
            }
            "reinforce_plus_plus" => {
                let gamma = num(c, "gamma");
                if gaps_differ(c) {
                    continue; // the return conventions differ on purpose (module docs)
                }
                reinforce_pp_advantages(&scores, ResponseTokens::new(sh, &mask), gamma, &mut got)
                    .unwrap();
                unwhiten_population(sh, &mut got, &mask, &f64s(c, "returns"));
                rewhiten_unbiased(&mut got, &mask);
            }
            other => panic!("unknown estimator {other:?}"),
        }
        close_all(&got, &want, &what);
    }
    for name in [
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus_baseline",
        "reinforce_plus_plus",
    ] {
        assert!(seen.contains(name), "no {name} case in the fixture");
    }
}

/// Whitens `values` by verl's rule (`verl.utils.torch_functional.masked_whiten`, restated
/// here to map ares' output onto it): masked means divide by `count + 1e−8`, the variance is
/// unbiased, `(x − μ)·rsqrt(var_u + 1e−8)`; padding is left 0.
fn rewhiten_unbiased(values: &mut [f64], mask: &[f64]) {
    let n: f64 = mask.iter().sum();
    let masked_mean = |x: &mut dyn Iterator<Item = f64>| x.sum::<f64>() / (n + 1e-8);
    let mean = masked_mean(&mut values.iter().zip(mask).map(|(v, m)| v * m));
    let var = masked_mean(
        &mut values
            .iter()
            .zip(mask)
            .map(|(v, m)| m * (v - mean) * (v - mean)),
    ) * (n / (n - 1.0));
    for (v, m) in values.iter_mut().zip(mask) {
        *v = m * (*v - mean) / (var + 1e-8).sqrt();
    }
}

/// Replaces ares' whitened returns by the returns themselves after checking that ares
/// whitened exactly those returns (population variance, floor 1e−8).
fn unwhiten_population(sh: Shape, whitened: &mut [f64], mask: &[f64], returns: &[f64]) {
    let mut want = returns.to_vec();
    for (w, m) in want.iter_mut().zip(mask) {
        *w *= m;
    }
    let mut ours = want.clone();
    masked_whiten(sh, &mut ours, mask).unwrap();
    close_all(whitened, &ours, "whitened returns-to-go");
    whitened.copy_from_slice(&want);
}

#[test]
fn returns_to_go_without_gaps() {
    let fx = fixture();
    let mut checked = 0;
    for (i, c) in cases(&fx, "advantage").iter().enumerate() {
        if text(c, "estimator") != "reinforce_plus_plus" {
            continue;
        }
        let sh = shape(c);
        let mask = f64s(c, "mask");
        let mut got = vec![0.0; sh.rows * sh.cols];
        ares_core::advantage::returns_to_go(
            sh,
            &f64s(c, "token_level_rewards"),
            &mask,
            num(c, "gamma"),
            &mut got,
        )
        .unwrap();
        let want: Vec<f64> = f64s(c, "returns")
            .iter()
            .zip(&mask)
            .map(|(r, m)| r * m)
            .collect();
        if gaps_differ(c) {
            continue;
        }
        close_all(&got, &want, &format!("returns #{i}"));
        checked += 1;
    }
    assert!(checked > 0, "no comparable REINFORCE++ case");
}

/// A mask gap at γ < 1: ares discounts the return through the gap (OpenRLHF's convention),
/// verl carries it across undiscounted (γ counts valid tokens only). At γ = 1, or without a
/// gap, the two agree.
fn gaps_differ(c: &Value) -> bool {
    c["mask_has_gaps"].as_bool().unwrap_or(true) && num(c, "gamma") != 1.0
}

#[test]
fn masked_whiten_by_the_documented_variance_rule() {
    let fx = fixture();
    for (i, c) in cases(&fx, "masked_whiten").iter().enumerate() {
        let sh = shape(c);
        let mask = f64s(c, "mask");
        let values = f64s(c, "values");
        let mut ours = values.clone();
        masked_whiten(sh, &mut ours, &mask).unwrap();
        let mut theirs = values.clone();
        rewhiten_unbiased(&mut theirs, &mask);
        // Map verl's output onto ares' rule: undo its scale and its mean (both by verl's
        // rule, with the count eps), then apply ares' population variance with the floor.
        let valid: Vec<usize> = (0..mask.len()).filter(|&t| mask[t] != 0.0).collect();
        let pick = |x: &[f64]| valid.iter().map(|&t| x[t]).collect::<Vec<f64>>();
        close_all(
            &pick(&theirs),
            &pick(&f64s(c, "out")),
            &format!("masked_whiten #{i} (verl rule)"),
        );
        let n = valid.len() as f64;
        let mean = valid.iter().map(|&t| values[t]).sum::<f64>() / n;
        let var_p = valid
            .iter()
            .map(|&t| (values[t] - mean).powi(2))
            .sum::<f64>()
            / n;
        let mean_v = mean * n / (n + 1e-8);
        let var_v = valid
            .iter()
            .map(|&t| (values[t] - mean_v).powi(2))
            .sum::<f64>()
            / (n + 1e-8)
            * (n / (n - 1.0));
        let scaled: Vec<f64> = pick(&f64s(c, "out"))
            .iter()
            .map(|w| (w * (var_v + 1e-8).sqrt() + mean_v - mean) / var_p.max(1e-8).sqrt())
            .collect();
        close_all_tol(
            &pick(&ours),
            &scaled,
            TOL_COUNT_EPS,
            &format!("masked_whiten #{i} (ares rule)"),
        );
    }
}

#[test]
fn entropy_from_logits() {
    let fx = fixture();
    for (i, c) in cases(&fx, "entropy_from_logits").iter().enumerate() {
        let v = usize_of(c, "vocab");
        let logits = f64s(c, "logits");
        let got: Vec<f64> = logits
            .chunks_exact(v)
            .map(|row| token_entropy(row, 1.0).unwrap())
            .collect();
        close_all(&got, &f64s(c, "entropy"), &format!("entropy #{i}"));
    }
}

#[test]
fn adaptive_kl_controller() {
    let fx = fixture();
    for (i, c) in cases(&fx, "adaptive_kl").iter().enumerate() {
        let mut ctl = AdaptiveKlController::new(
            num(c, "init_kl_coef"),
            num(c, "target_kl"),
            num(c, "horizon"),
        )
        .unwrap();
        let want = f64s(c, "values");
        let steps = c["steps"].as_array().expect("steps");
        for (k, (step, w)) in steps.iter().zip(&want).enumerate() {
            let kl = step[0].as_f64().expect("current_kl");
            let n = step[1].as_u64().expect("n_steps") as usize;
            let got = ctl.update(kl, n).unwrap();
            close(got, *w, &format!("adaptive_kl #{i} step {k}"));
        }
    }
}
