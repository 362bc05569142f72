//! The Python functions: thin wrappers that check arguments, allocate the output and call
//! ares-core with the GIL released.

use crate::args::by_dtype;
use crate::args::{
    GroupSpec, Input, Output, Real, cast, core_err, float_dtype, token_input, value_error,
};
use ares_core::advantage::{self, GRPO_EPSILON, GrpoConfig, ProMaxConfig, ResponseTokens};
use ares_core::{Error, Groups, Shape};
use pyo3::prelude::*;

/// Registers every function of this file in the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(grpo_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(dr_grpo_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(rloo_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(reinforce_baseline_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(grpo_token_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(rloo_token_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(reinforce_pp_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(reinforce_pp_baseline_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(reinforce_pro_max, m)?)?;
    m.add_function(wrap_pyfunction!(masked_whiten, m)?)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Per-sample advantages.

/// `rewards` [B] → advantages [B] by `f` over the groups.
fn per_sample<'py, F: Real>(
    py: Python<'py>,
    func: &str,
    rewards: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
    f: impl FnOnce(&Groups<'_>, &[F], &mut [F]) -> Result<(), Error> + Send,
) -> PyResult<Bound<'py, PyAny>> {
    let r = Input::<F>::new(func, "rewards", rewards, 1)?;
    let batch = r.shape()[0];
    let spec = GroupSpec::new(func, n, uid, batch)?;
    let out = Output::<F>::new(py, &[batch]);
    {
        let mut w = out.write()?;
        let o = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let rs = r.slice();
        spec.run(py, func, batch, move |g| f(g, rs, o))?;
    }
    Ok(out.array.into_any())
}

/// GRPO advantages, one per sample: `A_i = (r_i − mean_g)/(std_g + epsilon)` with the
/// unbiased (n − 1) std of the sample's group; with `norm_adv_by_std=False` (Dr.GRPO)
/// `A_i = r_i − mean_g`. A group of equal rewards gets exactly 0.
///
/// rewards: float32/float64 [B]; groups by `n` (consecutive groups of n rows) or `uid`
/// (one key per row). Returns [B], the dtype of `rewards`. Spec vector: r = (1, 0, 0, 1),
/// n = 4 → (0.8660239, −0.8660239, −0.8660239, 0.8660239).
#[pyfunction]
#[pyo3(signature = (rewards, n=None, uid=None, *, epsilon=GRPO_EPSILON, norm_adv_by_std=true))]
fn grpo_advantages<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
    epsilon: f64,
    norm_adv_by_std: bool,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "grpo_advantages";
    by_dtype!(float_dtype(FUNC, "rewards", rewards)?, F => {
        let cfg = GrpoConfig::<F> { norm_adv_by_std, epsilon: cast(epsilon) };
        per_sample::<F>(py, FUNC, rewards, n, uid, move |g, r, o| {
            advantage::grpo_advantages(g, r, &cfg, o)
        })
    })
}

/// Dr.GRPO advantages `A_i = r_i − mean_g` (GRPO without the division by the std).
///
/// rewards: float32/float64 [B]; groups by `n` or `uid`. Returns [B].
#[pyfunction]
#[pyo3(signature = (rewards, n=None, uid=None))]
fn dr_grpo_advantages<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "dr_grpo_advantages";
    by_dtype!(float_dtype(FUNC, "rewards", rewards)?, F => {
        per_sample::<F>(py, FUNC, rewards, n, uid, advantage::dr_grpo_advantages)
    })
}

/// RLOO advantages `A_i = r_i − (Σ_g r − r_i)/(n − 1)`: the reward minus the mean of the
/// other samples of its group (sums to 0 per group).
///
/// rewards: float32/float64 [B]; groups by `n` or `uid`. Returns [B]. Spec vector:
/// r = (1, 0, 0, 0), n = 4 → (1, −1/3, −1/3, −1/3).
#[pyfunction]
#[pyo3(signature = (rewards, n=None, uid=None))]
fn rloo_advantages<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "rloo_advantages";
    by_dtype!(float_dtype(FUNC, "rewards", rewards)?, F => {
        per_sample::<F>(py, FUNC, rewards, n, uid, advantage::rloo_advantages)
    })
}

/// REINFORCE++-baseline scalar advantages `A_i = r_i − mean_g` (before the token steps of
/// `reinforce_pp_baseline_advantages`).
///
/// rewards: float32/float64 [B]; groups by `n` or `uid`. Returns [B].
#[pyfunction]
#[pyo3(signature = (rewards, n=None, uid=None))]
fn reinforce_baseline_advantages<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "reinforce_baseline_advantages";
    by_dtype!(float_dtype(FUNC, "rewards", rewards)?, F => {
        per_sample::<F>(py, FUNC, rewards, n, uid, advantage::reinforce_baseline_advantages)
    })
}

// ---------------------------------------------------------------------------------------------
// Token advantages.

/// The checked token side of a call: rewards [B], mask [B, T], optional weighted KL [B, T].
struct TokenArgs<'py, F: Real> {
    rewards: Input<'py, F>,
    mask: Input<'py, F>,
    weighted_kl: Option<Input<'py, F>>,
    shape: Shape,
}

impl<'py, F: Real> TokenArgs<'py, F> {
    fn new(
        func: &str,
        rewards: &Bound<'py, PyAny>,
        mask: &Bound<'py, PyAny>,
        weighted_kl: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        let rewards = Input::<F>::new(func, "rewards", rewards, 1)?;
        let (mask, shape) = token_input::<F>(func, "mask", mask, None)?;
        if shape.rows != rewards.shape()[0] {
            return Err(value_error(format!(
                "{func}: `mask` has {} rows, expected {} (one per element of `rewards`)",
                shape.rows,
                rewards.shape()[0]
            )));
        }
        let weighted_kl = match weighted_kl {
            None => None,
            Some(k) => Some(token_input::<F>(func, "weighted_kl", k, Some(shape))?.0),
        };
        Ok(TokenArgs {
            rewards,
            mask,
            weighted_kl,
            shape,
        })
    }

    fn tokens(&self) -> ResponseTokens<'_, F> {
        let t = ResponseTokens::new(self.shape, self.mask.slice());
        match &self.weighted_kl {
            Some(k) => t.with_kl(k.slice()),
            None => t,
        }
    }
}

/// Token advantages [B, T] by `f` over the groups.
#[allow(clippy::too_many_arguments)]
fn grouped_tokens<'py, F: Real>(
    py: Python<'py>,
    func: &str,
    rewards: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    weighted_kl: Option<&Bound<'py, PyAny>>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
    f: impl FnOnce(&Groups<'_>, &[F], ResponseTokens<'_, F>, &mut [F]) -> Result<(), Error> + Send,
) -> PyResult<Bound<'py, PyAny>> {
    let args = TokenArgs::<F>::new(func, rewards, mask, weighted_kl)?;
    let spec = GroupSpec::new(func, n, uid, args.shape.rows)?;
    let out = Output::<F>::new(py, &[args.shape.rows, args.shape.cols]);
    {
        let mut w = out.write()?;
        let o = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
        let (rs, tokens) = (args.rewards.slice(), args.tokens());
        spec.run(py, func, args.shape.rows, move |g| f(g, rs, tokens, o))?;
    }
    Ok(out.array.into_any())
}

/// GRPO / Dr.GRPO token advantages: the per-sample advantage of `grpo_advantages`
/// broadcast over the row's response, `A_{r,t} = A_r · m_{r,t}`.
///
/// rewards [B], mask 0/1 [B, T] (same float dtype); groups by `n` or `uid`. Returns [B, T].
#[pyfunction]
#[pyo3(signature = (rewards, mask, n=None, uid=None, *, epsilon=GRPO_EPSILON, norm_adv_by_std=true))]
fn grpo_token_advantages<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
    epsilon: f64,
    norm_adv_by_std: bool,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "grpo_token_advantages";
    by_dtype!(float_dtype(FUNC, "rewards", rewards)?, F => {
        let cfg = GrpoConfig::<F> { norm_adv_by_std, epsilon: cast(epsilon) };
        grouped_tokens::<F>(py, FUNC, rewards, mask, None, n, uid, move |g, r, t, o| {
            advantage::grpo_token_advantages(g, r, t.shape, t.mask, &cfg, o)
        })
    })
}

/// RLOO token advantages (OpenRLHF): the RLOO advantage r̃ of each sample, with the optional
/// weighted KL `β_t·k_t` folded in, as returns-to-go with γ = 1:
/// `A_t = m_t·(r̃ + Σ_{u ≥ t} −β_u·k_u·m_u)`; without KL, r̃ on every valid token.
///
/// rewards [B], mask [B, T], weighted_kl [B, T] or None; groups by `n` or `uid`.
/// Returns [B, T]. Every row needs at least one valid token.
#[pyfunction]
#[pyo3(signature = (rewards, mask, n=None, uid=None, *, weighted_kl=None))]
fn rloo_token_advantages<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
    weighted_kl: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "rloo_token_advantages";
    by_dtype!(float_dtype(FUNC, "rewards", rewards)?, F => {
        grouped_tokens::<F>(py, FUNC, rewards, mask, weighted_kl, n, uid, advantage::rloo_token_advantages)
    })
}

/// REINFORCE++ token advantages: token rewards `R_t = −β_t·k_t + [t = last valid]·r`,
/// returns-to-go `G_t = R_t + γ·G_{t+1}`, then batch whitening over valid tokens
/// `(G − μ)/√max(var, 1e−8)` (population variance).
///
/// rewards [B], mask [B, T], weighted_kl [B, T] or None, gamma in [0, 1]. Returns [B, T].
#[pyfunction]
#[pyo3(signature = (rewards, mask, *, weighted_kl=None, gamma=1.0))]
fn reinforce_pp_advantages<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    weighted_kl: Option<&Bound<'py, PyAny>>,
    gamma: f64,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "reinforce_pp_advantages";
    by_dtype!(float_dtype(FUNC, "rewards", rewards)?, F => {
        let args = TokenArgs::<F>::new(FUNC, rewards, mask, weighted_kl)?;
        let out = Output::<F>::new(py, &[args.shape.rows, args.shape.cols]);
        {
            let mut w = out.write()?;
            let o = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let (rs, tokens, gamma) = (args.rewards.slice(), args.tokens(), cast::<F>(gamma));
            py.detach(move || advantage::reinforce_pp_advantages(rs, tokens, gamma, o))
                .map_err(|e| core_err(FUNC, e))?;
        }
        Ok(out.array.into_any())
    })
}

/// REINFORCE++-baseline token advantages: `r − mean_g` per sample, then the REINFORCE++
/// steps (KL folding, returns-to-go with γ, batch whitening).
///
/// rewards [B], mask [B, T], weighted_kl [B, T] or None; groups by `n` or `uid`.
/// Returns [B, T].
#[pyfunction]
#[pyo3(signature = (rewards, mask, n=None, uid=None, *, weighted_kl=None, gamma=1.0))]
#[allow(clippy::too_many_arguments)]
fn reinforce_pp_baseline_advantages<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
    weighted_kl: Option<&Bound<'py, PyAny>>,
    gamma: f64,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "reinforce_pp_baseline_advantages";
    by_dtype!(float_dtype(FUNC, "rewards", rewards)?, F => {
        let gamma = cast::<F>(gamma);
        grouped_tokens::<F>(py, FUNC, rewards, mask, weighted_kl, n, uid, move |g, r, t, o| {
            advantage::reinforce_pp_baseline_advantages(g, r, t, gamma, o).map(|_| ())
        })
    })
}

/// REINFORCE Pro Max token advantages: RLOO shaped rewards r̃ (or r/n for uniform groups
/// with `uniform_scale`), KL folded in, then per group the adaptive scaling of positive
/// tokens by α and negative ones by β so that the group's tokens have mean 0 and variance 1
/// (α, β clamped to `max_scale`, with fallbacks for one-signed groups).
///
/// rewards [B], mask [B, T], weighted_kl [B, T] or None; groups by `n` or `uid`.
/// Returns [B, T]. Spec vector: r = (1, 0, 0, 0), n = 4, one valid token each →
/// (√3, −√3/3, −√3/3, −√3/3) = (1.7320508, −0.5773503, …).
#[pyfunction]
#[pyo3(signature = (rewards, mask, n=None, uid=None, *, weighted_kl=None, uniform_scale=false,
    eps=1e-8, max_scale=10.0, product_cap=1e8, uniform_std=1e-8))]
#[allow(clippy::too_many_arguments)]
fn reinforce_pro_max<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    n: Option<i64>,
    uid: Option<&Bound<'py, PyAny>>,
    weighted_kl: Option<&Bound<'py, PyAny>>,
    uniform_scale: bool,
    eps: f64,
    max_scale: f64,
    product_cap: f64,
    uniform_std: f64,
) -> PyResult<Bound<'py, PyAny>> {
    const FUNC: &str = "reinforce_pro_max";
    by_dtype!(float_dtype(FUNC, "rewards", rewards)?, F => {
        let cfg = ProMaxConfig::<F> {
            uniform_scale,
            eps: cast(eps),
            max_scale: cast(max_scale),
            product_cap: cast(product_cap),
            uniform_std: cast(uniform_std),
        };
        grouped_tokens::<F>(py, FUNC, rewards, mask, weighted_kl, n, uid, move |g, r, t, o| {
            advantage::reinforce_pro_max(g, r, t, &cfg, None, o).map(|_| ())
        })
    })
}

/// Batch whitening over valid tokens: `m·(x − μ)/√max(var, 1e−8)` with the masked mean μ
/// and population variance var. Returns `(whitened [B, T], mean, var)`; padding is 0.
#[pyfunction]
#[pyo3(signature = (values, mask))]
fn masked_whiten<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyAny>, f64, f64)> {
    const FUNC: &str = "masked_whiten";
    by_dtype!(float_dtype(FUNC, "values", values)?, F => {
        let (v, shape) = token_input::<F>(FUNC, "values", values, None)?;
        let (m, _) = token_input::<F>(FUNC, "mask", mask, Some(shape))?;
        let out = Output::<F>::new(py, &[shape.rows, shape.cols]);
        let stats = {
            let mut w = out.write()?;
            let o = w.as_slice_mut().map_err(|e| value_error(e.to_string()))?;
            let (vs, ms) = (v.slice(), m.slice());
            py.detach(move || {
                o.copy_from_slice(vs);
                advantage::masked_whiten(shape, o, ms)
            })
            .map_err(|e| core_err(FUNC, e))?
        };
        Ok((out.array.into_any(), crate::args::f64_of(stats.mean), crate::args::f64_of(stats.var)))
    })
}
