//! The actor's loss as `ares_core` computes it — the one definition the `policy_loss`
//! kernel is the twin of — and random micro-batches that reach every branch: clipped and
//! dual-clipped tokens, importance weights truncated and masked, KL estimators past their
//! clamps, empty rows, forking tokens. Shared by `emulated.rs` (the kernel source run on the
//! CPU) and `gpu.rs`.

use ares_core::Shape;
use ares_core::kl::KlEstimator;
use ares_core::loss::{
    ActorLoss, ClipCovParams, EntropyTerm, GspoLevel, IsMode, KlCovParams, KlTerm, LossAggMode,
    Objective, PolicyLossConfig, PolicyLossInput, PolicyLossOutput, actor_loss,
};
use ares_cuda::{LossKind, LossSpec};

/// A tiny deterministic generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }
}

/// One micro-batch's token tensors, `[rows, cols]` (β per row).
#[derive(Clone)]
pub struct Batch {
    pub rows: usize,
    pub cols: usize,
    pub logp: Vec<f32>,
    pub old: Vec<f32>,
    pub adv: Vec<f32>,
    pub mask: Vec<f32>,
    pub rollout: Vec<f32>,
    pub keep: Vec<f32>,
    pub refp: Vec<f32>,
    pub beta: Vec<f32>,
    pub hwe: Vec<f32>,
    pub entropy: Vec<f32>,
}

impl Batch {
    /// Random tensors; row 1 (when there is one) is empty, padding holds 7.5, each row's
    /// mask is a prefix of valid tokens with a few holes.
    pub fn random(rng: &mut Rng, rows: usize, cols: usize) -> Self {
        let n = rows * cols;
        let mut b = Batch {
            rows,
            cols,
            logp: vec![0.0; n],
            old: vec![0.0; n],
            adv: vec![0.0; n],
            mask: vec![0.0; n],
            rollout: vec![0.0; n],
            keep: vec![0.0; n],
            refp: vec![0.0; n],
            beta: (0..rows).map(|_| rng.range(0.0, 0.1)).collect(),
            hwe: vec![0.0; n],
            entropy: vec![0.0; n],
        };
        for r in 0..rows {
            let len = if r == 1 {
                0
            } else {
                1 + (rng.unit() * cols as f32) as usize % cols
            };
            // a row-constant advantage on even rows (GSPO's case), per token on odd ones
            let row_adv = rng.range(-2.0, 2.0);
            for t in 0..cols {
                let i = r * cols + t;
                let valid = t < len && rng.unit() > 0.1;
                b.mask[i] = f32::from(u8::from(valid));
                if !valid {
                    // impossible values (logπ > 0), finite because core's KL refuses
                    // non-finite padding: a kernel that read them would be caught
                    for v in [
                        &mut b.logp,
                        &mut b.old,
                        &mut b.adv,
                        &mut b.refp,
                        &mut b.rollout,
                        &mut b.entropy,
                    ] {
                        v[i] = 7.5;
                    }
                    continue;
                }
                b.logp[i] = rng.range(-4.0, 0.0);
                // log-ratios to ±0.6 clip often; a few far outside reach the ±20 clamp
                let shift = if rng.unit() < 0.03 {
                    rng.range(-30.0, 30.0)
                } else {
                    rng.range(-0.6, 0.6)
                };
                b.old[i] = b.logp[i] - shift;
                b.rollout[i] = b.old[i] + rng.range(-1.5, 1.5);
                b.adv[i] = if r % 2 == 0 {
                    row_adv
                } else {
                    rng.range(-2.0, 2.0)
                };
                // δ = logπ − logπ_ref over [−4, 14]: past both of k3's clamps
                b.refp[i] = b.logp[i] - rng.range(-4.0, 14.0);
                b.entropy[i] = rng.range(0.0, 3.0);
            }
            for t in 0..cols {
                let i = r * cols + t;
                b.keep[i] = f32::from(u8::from(rng.unit() < 0.7));
                b.hwe[i] = f32::from(u8::from(rng.unit() < 0.3));
            }
        }
        b
    }

    pub fn shape(&self) -> Shape {
        Shape {
            rows: self.rows,
            cols: self.cols,
        }
    }
}

/// What the loss gives: the policy loss's output, the KL term, `agg(H)`,
/// `scale·∂L/∂logπ` and `scale·∂L/∂H`.
pub struct Expected {
    pub policy: PolicyLossOutput<f32>,
    pub kl_loss: f32,
    pub entropy: f32,
    pub grad: Vec<f32>,
    pub entropy_grad: Vec<f32>,
}

/// The specs the tests sweep: every loss, aggregation, correction and estimator, with and
/// without the forking mask, the KL term, HWE tokens and the entropy bonus; Clip-Cov with
/// its candidates in a band of covariances (few chosen) and with every unclipped token a
/// candidate (a budget of a third, so the radix selection decides), KL-Cov at budgets of 1
/// and of half the tokens. Each entry is `(spec, forking, hwe)`.
pub fn specs() -> Vec<(LossSpec, bool, bool)> {
    let kinds = [
        LossKind::Ppo,
        LossKind::Cispo,
        LossKind::Gspo(GspoLevel::Sequence),
        LossKind::Gspo(GspoLevel::Token),
        LossKind::ClipCov(ClipCovParams {
            ratio: 0.05,
            lb: 0.25,
            ub: 2.0,
            seed: 3,
        }),
        LossKind::ClipCov(ClipCovParams {
            ratio: 0.3,
            lb: -100.0,
            ub: 100.0,
            seed: 0xDEAD_BEEF_0000_0001,
        }),
        LossKind::KlCov(KlCovParams {
            ratio: 1e-6,
            coef: 1.0,
        }),
        LossKind::KlCov(KlCovParams {
            ratio: 0.5,
            coef: 0.3,
        }),
    ];
    let corrections = [
        IsMode::None,
        IsMode::Tis,
        IsMode::Icepop,
        IsMode::ReinforcePro,
    ];
    let mut out = Vec::new();
    for (k, kind) in kinds.into_iter().enumerate() {
        for (a, agg) in LossAggMode::ALL.into_iter().enumerate() {
            let mut config = PolicyLossConfig {
                agg,
                ..PolicyLossConfig::default()
            };
            config.is_correction.mode = corrections[(k + a) % 4];
            if a == 1 {
                config.clip.clip_ratio_c = 0.0;
            }
            let estimator = KlEstimator::ALL[(k * 5 + a) % 6];
            let with_kl = (k + a) % 3 != 0;
            out.push((
                LossSpec {
                    kind,
                    config,
                    kl: with_kl.then_some(ares_cuda::KlLossSpec {
                        estimator,
                        low_ratio: 0.5,
                    }),
                    entropy_coef: (a % 2 == 0).then_some(0.01),
                    scale: 0.75,
                },
                (k + a) % 2 == 1,
                a % 3 == 1,
            ));
        }
    }
    // every estimator once more, on PPO with everything on
    for estimator in KlEstimator::ALL {
        out.push((
            LossSpec {
                kind: LossKind::Ppo,
                config: PolicyLossConfig::default(),
                kl: Some(ares_cuda::KlLossSpec {
                    estimator,
                    low_ratio: 0.25,
                }),
                entropy_coef: Some(0.02),
                scale: 1.0,
            },
            true,
            true,
        ));
    }
    out
}

/// Core's loss of `b` under `spec` ([`actor_loss`], the composition the runner trains with),
/// with the forking mask and HWE tokens when asked.
pub fn expected(
    spec: &LossSpec,
    b: &Batch,
    forking: bool,
    hwe: bool,
) -> Result<Expected, ares_core::Error> {
    let n = b.logp.len();
    let input = PolicyLossInput {
        shape: b.shape(),
        logp: &b.logp,
        logp_old: &b.old,
        advantages: &b.adv,
        mask: &b.mask,
        logp_rollout: Some(&b.rollout),
    };
    let loss = ActorLoss {
        objective: match spec.kind {
            LossKind::Ppo => Objective::Ppo,
            LossKind::Cispo => Objective::Cispo,
            LossKind::Gspo(level) => Objective::Gspo(level),
            LossKind::ClipCov(p) => Objective::ClipCov(p),
            LossKind::KlCov(p) => Objective::KlCov(p),
        },
        config: spec.config,
        keep: forking.then_some(&b.keep[..]),
        kl: spec.kl.map(|kl| KlTerm {
            estimator: kl.estimator,
            beta: &b.beta,
            hwe_mask: hwe.then_some(&b.hwe[..]),
            low_ratio: kl.low_ratio,
            logp_ref: &b.refp,
        }),
        entropy: spec.entropy_coef.map(|coef| EntropyTerm {
            coef,
            entropy: &b.entropy,
        }),
        scale: spec.scale,
    };
    let (mut grad, mut entropy_grad) = (vec![0.0f32; n], vec![0.0f32; n]);
    let out = actor_loss(
        &input,
        &loss,
        &mut grad,
        Some(&mut entropy_grad),
        &mut vec![0.0; 2 * n],
        &mut vec![0; n],
    )?;
    Ok(Expected {
        policy: out.policy,
        kl_loss: out.kl_loss,
        entropy: out.entropy,
        grad,
        entropy_grad,
    })
}

/// Whether `got` is within `rel` of `want` (relative to `max(|want|, 1e-3)`).
pub fn close(got: f32, want: f32, rel: f32) -> bool {
    (got - want).abs() <= rel * want.abs().max(1e-3)
}

/// The loss's values and metrics in `report` against core's `want`, each within `rel`
/// ([`close`]), and the same count of valid tokens.
pub fn assert_values(what: &str, report: &ares_cuda::LossReport, want: &Expected, rel: f32) {
    let (p, e) = (&report.policy, &want.policy);
    assert_eq!(p.valid_tokens, e.valid_tokens, "{what}");
    for (name, g, w) in [
        ("loss", p.loss, e.loss),
        ("clipfrac", p.clipfrac, e.clipfrac),
        ("clipfrac_lower", p.clipfrac_lower, e.clipfrac_lower),
        ("approx_kl", p.approx_kl, e.approx_kl),
        ("is_weight_mean", p.is_weight_mean, e.is_weight_mean),
        ("is_changed_frac", p.is_changed_frac, e.is_changed_frac),
        ("selected_frac", p.selected_frac, e.selected_frac),
        ("kl_loss", report.kl_loss, want.kl_loss),
        ("entropy", report.entropy, want.entropy),
    ] {
        assert!(close(g, w, rel), "{what}: {name} {g} vs core {w}");
    }
}
