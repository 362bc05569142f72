//! Rotary position embedding (RoPE) as in Hugging Face's Llama / Qwen2 / Qwen3: the
//! "rotate_half" layout, where dimension `j` of a head is paired with dimension
//! `j + head_dim/2` (not adjacent pairs as in the original paper / GPT-J):
//!
//! `out = x · cos + rotate_half(x) · sin`, `rotate_half([x₁, x₂]) = [−x₂, x₁]`,
//!
//! with `cos`/`sin` of the angle `position · inv_freq[j]` repeated over both halves, and
//! `inv_freq[j] = 1 / θ^(2j / head_dim)`, possibly rescaled by the config's `rope_scaling`.
//!
//! Usage: build a [`RopeTable`] once from the config, fill `[tokens, head_dim/2]` cos/sin
//! buffers once per batch with [`RopeTable::cos_sin`] (shared by every layer, q and k), then
//! [`rope_forward`] / [`rope_backward`] rotate `[tokens, heads, head_dim]` in place.
//!
//! # Numerics (what transformers does in f32, reproduced step by step)
//! - `inv_freq`: exponent `(2j as f32) / (head_dim as f32)`; `θ` rounded to f32; the power is
//!   evaluated in f64 and rounded once to f32 (torch's f32 `pow` is within an ulp of that);
//!   then `1 / p` in f32. Scaling types then apply their f32 formulas in torch's order.
//! - angle = `(position as f32) · inv_freq[j]`, one f32 product, as HF's f32
//!   `inv_freq @ position_ids`. Keeping this rounding matters: at position 32 000 the f32
//!   angle is off from the exact one by up to ~1e-3 rad, and HF uses the f32 one.
//! - `cos`/`sin` of that f32 angle are computed in f64 and rounded to f32 (torch's f32
//!   `cos`/`sin` are within an ulp of that), then multiplied by `attention_scaling` (1 for
//!   every supported type).
//! - The rotation is `x₁·c − x₂·s`, `x₂·c + x₁·s` with separately rounded products and no FMA,
//!   bit-for-bit torch's `q * cos + rotate_half(q) * sin` given equal cos/sin.
//!
//! Positions are `u32` per token, so left-padded batches (per-sequence positions) work;
//! positions above 2²⁴ round to f32 exactly as torch's `position_ids.float()` does.

use crate::Result;
use crate::error::check_len;
use ares_core::Error as CoreError;
use rayon::prelude::*;

/// Elements per rayon task at least, so small inputs stay on one thread.
const MIN_ELEMS_PER_TASK: usize = 1 << 14;

fn out_of_range(what: &'static str, value: f64, expected: &'static str) -> crate::Error {
    CoreError::OutOfRange {
        what,
        value,
        expected,
    }
    .into()
}

/// Errors unless `v` is finite and > 0.
fn positive(what: &'static str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(out_of_range(what, v, "finite and > 0"))
    }
}

/// The `rope_scaling` entry of a Hugging Face config (`rope_type`, or the older `type`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// No scaling: `rope_scaling` absent/null, or `rope_type: "default"`.
    None,
    /// `rope_type: "linear"`: `inv_freq / factor`, i.e. positions divided by `factor`.
    Linear {
        /// `rope_scaling.factor`.
        factor: f64,
    },
    /// `rope_type: "llama3"` (Llama 3.1+). With wavelength `λ = 2π / inv_freq`,
    /// `λ_lo = original_max_position_embeddings / low_freq_factor` and
    /// `λ_hi = original_max_position_embeddings / high_freq_factor`:
    /// `λ < λ_hi`: unchanged; `λ > λ_lo`: `inv_freq / factor`; otherwise interpolated,
    /// `(1 − s)·inv_freq/factor + s·inv_freq` with
    /// `s = (original_max_position_embeddings / λ − low_freq_factor) / (high_freq_factor − low_freq_factor)`.
    Llama3 {
        /// `rope_scaling.factor` (8 for Llama 3.1).
        factor: f64,
        /// `rope_scaling.low_freq_factor` (1 for Llama 3.1).
        low_freq_factor: f64,
        /// `rope_scaling.high_freq_factor` (4 for Llama 3.1).
        high_freq_factor: f64,
        /// `rope_scaling.original_max_position_embeddings` (8192 for Llama 3.1).
        original_max_position_embeddings: u32,
    },
    /// `rope_type: "dynamic"` (dynamic NTK): recognised, not supported yet ([`RopeTable::new`]
    /// rejects it). Its frequencies depend on the running sequence length and on state kept
    /// between calls in transformers.
    Dynamic,
    /// `rope_type: "yarn"`: recognised, not supported yet ([`RopeTable::new`] rejects it). Its
    /// details (`factor` override, `truncate`, `mscale`) differ between transformers versions.
    Yarn,
    /// `rope_type: "longrope"`: recognised, not supported yet ([`RopeTable::new`] rejects it).
    LongRope,
}

/// What [`RopeTable::new`] needs from a model config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// Rotated dimensions per head (`head_dim`; Qwen2/Llama rotate the whole head).
    pub head_dim: usize,
    /// `rope_theta` (10 000 for Llama 2, 500 000 for Llama 3, 1 000 000 for Qwen2.5).
    pub theta: f64,
    /// `rope_scaling`.
    pub scaling: RopeScaling,
}

/// Inverse frequencies of one model's RoPE: `[head_dim / 2]` f32, as transformers'
/// `inv_freq` buffer, plus the post-scaling of cos/sin (`attention_scaling`).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    head_dim: usize,
    inv_freq: Vec<f32>,
    attention_scaling: f32,
}

impl RopeTable {
    /// Computes `inv_freq` for `config` (see the module docs for the f32 numerics).
    ///
    /// # Errors
    /// `head_dim` odd or 0; `theta` or a scaling factor not finite and > 0; for llama3,
    /// `high_freq_factor ≤ low_freq_factor` or `original_max_position_embeddings == 0`;
    /// a scaling type not supported yet (dynamic, yarn, longrope), reported as an
    /// `OutOfRange` on `rope_scaling.rope_type` that names the type.
    pub fn new(config: &RopeConfig) -> Result<Self> {
        let RopeConfig {
            head_dim,
            theta,
            scaling,
        } = *config;
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(out_of_range("head_dim", head_dim as f64, "even and >= 2"));
        }
        positive("rope_theta", theta)?;
        // transformers rounds θ to f32 before the power.
        if !(theta as f32).is_finite() {
            return Err(out_of_range("rope_theta", theta, "representable in f32"));
        }
        let mut inv_freq = default_inv_freq(head_dim, theta);
        match scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                positive("rope_scaling.factor", factor)?;
                let f = factor as f32;
                for v in &mut inv_freq {
                    *v /= f;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("rope_scaling.factor", factor)?;
                positive("rope_scaling.low_freq_factor", low_freq_factor)?;
                if !(high_freq_factor.is_finite() && high_freq_factor > low_freq_factor) {
                    return Err(out_of_range(
                        "rope_scaling.high_freq_factor",
                        high_freq_factor,
                        "finite and > low_freq_factor",
                    ));
                }
                if original_max_position_embeddings == 0 {
                    return Err(out_of_range(
                        "rope_scaling.original_max_position_embeddings",
                        0.0,
                        ">= 1",
                    ));
                }
                llama3_scale(
                    &mut inv_freq,
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                );
            }
            RopeScaling::Dynamic => return Err(unsupported("rope_scaling.rope_type = dynamic")),
            RopeScaling::Yarn => return Err(unsupported("rope_scaling.rope_type = yarn")),
            RopeScaling::LongRope => {
                return Err(unsupported("rope_scaling.rope_type = longrope"));
            }
        }
        Ok(RopeTable {
            head_dim,
            inv_freq,
            attention_scaling: 1.0,
        })
    }

    /// `head_dim`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// `inv_freq`, `[head_dim / 2]`.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Factor on cos and sin (transformers' `attention_scaling`; 1 for the supported types).
    pub fn attention_scaling(&self) -> f32 {
        self.attention_scaling
    }

    /// Fills `cos[t, j] = cos(a)·attention_scaling`, `sin[t, j] = sin(a)·attention_scaling`
    /// with `a = fl32(positions[t] as f32 · inv_freq[j])`; shapes `[tokens, head_dim / 2]`
    /// (transformers repeats these over both halves of the head; they are equal, so stored
    /// once). Tokens run in parallel.
    ///
    /// # Errors
    /// `cos` or `sin` not `positions.len() · head_dim / 2` long.
    pub fn cos_sin(&self, positions: &[u32], cos: &mut [f32], sin: &mut [f32]) -> Result<()> {
        let half = self.inv_freq.len();
        let n = positions.len() * half;
        check_len("cos", n, cos.len())?;
        check_len("sin", n, sin.len())?;
        let scale = self.attention_scaling;
        cos.par_chunks_exact_mut(half)
            .zip(sin.par_chunks_exact_mut(half))
            .zip(positions.par_iter())
            // A sin/cos costs some 16 element-wise ops: smaller tasks.
            .with_min_len((MIN_ELEMS_PER_TASK / 16 / half).max(1))
            .for_each(|((c, s), &p)| {
                // Rounds to nearest above 2^24, as torch's int64 → float32.
                let p = p as f32;
                for ((c, s), &f) in c.iter_mut().zip(s.iter_mut()).zip(&self.inv_freq) {
                    let (sa, ca) = f64::from(p * f).sin_cos();
                    *c = (ca as f32) * scale;
                    *s = (sa as f32) * scale;
                }
            });
        Ok(())
    }
}

fn unsupported(what: &'static str) -> crate::Error {
    out_of_range(
        what,
        f64::NAN,
        "a supported rope type (default, linear or llama3); this one is not supported yet",
    )
}

/// `1 / θ^(2j/d)` with transformers' f32 roundings (see the module docs).
fn default_inv_freq(head_dim: usize, theta: f64) -> Vec<f32> {
    let base = f64::from(theta as f32);
    let d = head_dim as f32;
    (0..head_dim / 2)
        .map(|j| {
            let e = (2 * j) as f32 / d;
            let p = base.powf(f64::from(e)) as f32;
            1.0 / p
        })
        .collect()
}

/// Llama 3.1 frequency scaling, each f32 operation as torch evaluates transformers'
/// formula: Python scalars are rounded to f32 when they meet the f32 tensor, and
/// `scalar / tensor` is `tensor.reciprocal() * scalar`.
fn llama3_scale(inv_freq: &mut [f32], factor: f64, low: f64, high: f64, old_ctx: u32) {
    let old = f64::from(old_ctx);
    // Python-side (f64) quotients, rounded where they meet the tensor.
    let low_wavelen = (old / low) as f32;
    let high_wavelen = (old / high) as f32;
    let span = (high - low) as f32;
    let two_pi = std::f64::consts::TAU as f32;
    let (factor, low, old) = (factor as f32, low as f32, old as f32);
    for v in inv_freq.iter_mut() {
        let inv = *v;
        let wavelen = (1.0 / inv) * two_pi;
        let scaled = if wavelen > low_wavelen {
            inv / factor
        } else {
            inv
        };
        let smooth = ((1.0 / wavelen) * old - low) / span;
        let smoothed = ((1.0 - smooth) * scaled) / factor + smooth * scaled;
        // torch: `~(wavelen < high) * ~(wavelen > low)`; wavelen is never NaN here.
        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
        *v = if medium { smoothed } else { scaled };
    }
}

/// Checks `x` as `[tokens, n_heads, head_dim]` against `[tokens, head_dim/2]` cos/sin;
/// returns `n_heads · head_dim` (one token's stride).
fn check_rope_shapes(
    what: &'static str,
    x_len: usize,
    cos: &[f32],
    sin: &[f32],
    n_heads: usize,
    head_dim: usize,
) -> Result<usize> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(out_of_range("head_dim", head_dim as f64, "even and >= 2"));
    }
    if n_heads == 0 {
        return Err(out_of_range("n_heads", 0.0, ">= 1"));
    }
    let stride = n_heads.checked_mul(head_dim).ok_or_else(|| {
        out_of_range(
            "n_heads",
            n_heads as f64,
            "n_heads × head_dim to fit in usize",
        )
    })?;
    if !x_len.is_multiple_of(stride) {
        return Err(CoreError::NotDivisible {
            what,
            len: x_len,
            n: stride,
        }
        .into());
    }
    let n = (x_len / stride) * (head_dim / 2);
    check_len("cos", n, cos.len())?;
    check_len("sin", n, sin.len())?;
    Ok(stride)
}

/// Rotates every head of every token by its angles (by minus them when `inverse`).
fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32], stride: usize, head_dim: usize, inverse: bool) {
    let half = head_dim / 2;
    x.par_chunks_exact_mut(stride)
        .zip(cos.par_chunks_exact(half).zip(sin.par_chunks_exact(half)))
        .with_min_len((MIN_ELEMS_PER_TASK / stride).max(1))
        .for_each(|(xt, (c, s))| {
            for head in xt.chunks_exact_mut(head_dim) {
                let (x1, x2) = head.split_at_mut(half);
                if inverse {
                    // Rᵀ: [x₁·c + x₂·s, x₂·c − x₁·s], what autograd gives for torch's formula.
                    for (((a, b), &c), &s) in x1.iter_mut().zip(x2.iter_mut()).zip(c).zip(s) {
                        let (u, v) = (*a, *b);
                        *a = u * c + v * s;
                        *b = v * c - u * s;
                    }
                } else {
                    for (((a, b), &c), &s) in x1.iter_mut().zip(x2.iter_mut()).zip(c).zip(s) {
                        let (u, v) = (*a, *b);
                        *a = u * c - v * s;
                        *b = v * c + u * s;
                    }
                }
            }
        });
}

/// RoPE forward, in place: for each token `t`, head `h` and `j < head_dim/2`, with
/// `c = cos[t, j]`, `s = sin[t, j]`, `x₁ = x[t, h, j]`, `x₂ = x[t, h, j + head_dim/2]`:
/// `x[t, h, j] ← x₁·c − x₂·s` and `x[t, h, j + head_dim/2] ← x₂·c + x₁·s`.
///
/// Shapes: `x`: `[tokens, n_heads, head_dim]` (q with the attention heads, k with the kv
/// heads); `cos`, `sin`: `[tokens, head_dim/2]` from [`RopeTable::cos_sin`]. Tokens run in
/// parallel.
///
/// # Errors
/// `head_dim` odd or 0, `n_heads == 0`, `x` not whole tokens, or `cos`/`sin` not
/// `tokens · head_dim/2` long.
pub fn rope_forward(
    x: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    n_heads: usize,
    head_dim: usize,
) -> Result<()> {
    let stride = check_rope_shapes("x", x.len(), cos, sin, n_heads, head_dim)?;
    rotate(x, cos, sin, stride, head_dim, false);
    Ok(())
}

/// RoPE backward, in place: the gradient w.r.t. the rotated tensor becomes the gradient
/// w.r.t. its input by the transposed (inverse) rotation, i.e. rotation by `−angle`:
/// `d₁ ← g₁·c + g₂·s`, `d₂ ← g₂·c − g₁·s`. Overwrites (`=`): q and k come fresh from their
/// projections. Needs only the angles, not the forward input.
///
/// Shapes and errors as [`rope_forward`], with `dx` in place of `x`.
///
/// # Errors
/// As [`rope_forward`].
pub fn rope_backward(
    dx: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    n_heads: usize,
    head_dim: usize,
) -> Result<()> {
    let stride = check_rope_shapes("dx", dx.len(), cos, sin, n_heads, head_dim)?;
    rotate(dx, cos, sin, stride, head_dim, true);
    Ok(())
}

/// [`rope_forward`] of `x` into `out` rounded to bf16 (nearest even, as bits): q and k
/// stored in bf16 (activations kept in bf16), the f32 rotation rounded once — the bits of
/// [`rope_forward`] then rounding.
///
/// # Errors
/// As [`rope_forward`]; `out` not as long as `x`.
pub fn rope_forward_bf16(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    n_heads: usize,
    head_dim: usize,
    out: &mut [u16],
) -> Result<()> {
    use crate::ops::stored::{Bf16Bits, Widen};
    let stride = check_rope_shapes("x", x.len(), cos, sin, n_heads, head_dim)?;
    check_len("out", x.len(), out.len())?;
    let half = head_dim / 2;
    out.par_chunks_exact_mut(stride)
        .zip(x.par_chunks_exact(stride))
        .zip(cos.par_chunks_exact(half).zip(sin.par_chunks_exact(half)))
        .with_min_len((MIN_ELEMS_PER_TASK / stride).max(1))
        .for_each(|((ot, xt), (c, s))| {
            for (o, head) in ot.chunks_exact_mut(head_dim).zip(xt.chunks_exact(head_dim)) {
                let (x1, x2) = head.split_at(half);
                let (o1, o2) = o.split_at_mut(half);
                for j in 0..half {
                    let (u, v) = (x1[j], x2[j]);
                    o1[j] = Bf16Bits::narrow(u * c[j] - v * s[j]);
                    o2[j] = Bf16Bits::narrow(v * c[j] + u * s[j]);
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_rng::Rng;

    fn table(head_dim: usize, theta: f64, scaling: RopeScaling) -> RopeTable {
        RopeTable::new(&RopeConfig {
            head_dim,
            theta,
            scaling,
        })
        .unwrap()
    }

    fn cos_sin(t: &RopeTable, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let n = positions.len() * t.head_dim() / 2;
        let (mut c, mut s) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        t.cos_sin(positions, &mut c, &mut s).unwrap();
        (c, s)
    }

    fn close(got: f32, want: f64, tol: f64, what: &str) {
        assert!(
            (f64::from(got) - want).abs() <= tol * want.abs().max(1.0),
            "{what}: got {got}, want {want}"
        );
    }

    /// Relative closeness, for values far below 1 such as inverse frequencies.
    fn rel(got: f32, want: f64, tol: f64, what: &str) {
        assert!(
            (f64::from(got) - want).abs() <= tol * want.abs(),
            "{what}: got {got}, want {want}"
        );
    }

    const LLAMA31: RopeScaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };

    /// transformers' formula written out literally in f32: `emb = cat(freqs, freqs)`,
    /// `rotate_half(x) = cat(−x₂, x₁)`, `x·cos(emb) + rotate_half(x)·sin(emb)`.
    fn hf_forward(
        x: &[f32],
        positions: &[u32],
        inv_freq: &[f32],
        n_heads: usize,
        head_dim: usize,
    ) -> Vec<f32> {
        let half = head_dim / 2;
        let mut out = Vec::with_capacity(x.len());
        for (t, &p) in positions.iter().enumerate() {
            let freqs: Vec<f32> = inv_freq.iter().map(|&f| p as f32 * f).collect();
            let emb: Vec<f32> = freqs.iter().chain(&freqs).copied().collect();
            let cos: Vec<f32> = emb.iter().map(|&a| f64::from(a).cos() as f32).collect();
            let sin: Vec<f32> = emb.iter().map(|&a| f64::from(a).sin() as f32).collect();
            for h in 0..n_heads {
                let q = &x[(t * n_heads + h) * head_dim..][..head_dim];
                let rot: Vec<f32> = q[half..]
                    .iter()
                    .map(|v| -v)
                    .chain(q[..half].iter().copied())
                    .collect();
                for k in 0..head_dim {
                    out.push(q[k] * cos[k] + rot[k] * sin[k]);
                }
            }
        }
        out
    }

    #[test]
    fn default_inv_freq_matches_the_formula() {
        // θ = 10 000, head_dim = 8: 10000^(−j/4) = 1, 0.1, 0.01, 0.001.
        let t = table(8, 10_000.0, RopeScaling::None);
        for (&g, w) in t.inv_freq().iter().zip([1.0, 0.1, 0.01, 0.001]) {
            rel(g, w, 6e-8, "inv_freq");
        }
        // Qwen2.5 (θ = 1e6) and Llama 3 (θ = 5e5) at head_dim 128: within f32 rounding.
        for theta in [1e6, 5e5] {
            let t = table(128, theta, RopeScaling::None);
            assert_eq!(t.inv_freq().len(), 64);
            for (j, &g) in t.inv_freq().iter().enumerate() {
                let want = 1.0 / theta.powf(2.0 * j as f64 / 128.0);
                assert!(
                    (f64::from(g) - want).abs() <= 2.5e-7 * want,
                    "j={j}: {g} vs {want}"
                );
            }
        }
        assert_eq!(t.attention_scaling(), 1.0);
    }

    #[test]
    fn linear_scaling_divides_frequencies_and_positions() {
        let plain = table(16, 10_000.0, RopeScaling::None);
        let lin = table(16, 10_000.0, RopeScaling::Linear { factor: 4.0 });
        for (&a, &b) in plain.inv_freq().iter().zip(lin.inv_freq()) {
            assert_eq!(b, a / 4.0);
        }
        // Dividing by a power of two is exact, so position 4·p scaled = position p plain.
        assert_eq!(cos_sin(&lin, &[4, 40, 400]), cos_sin(&plain, &[1, 10, 100]));
    }

    #[test]
    fn llama3_scaling_by_hand() {
        // θ = 10 000, head_dim = 8: inv_freq = 1, 0.1, 0.01, 0.001, wavelengths 2π/inv =
        // 6.28, 62.8, 628.3, 6283. original = 1024, low = 1, high = 4, factor = 8:
        // λ_lo = 1024, λ_hi = 256.
        // - 6.28, 62.8 < 256: unchanged (1, 0.1).
        // - 6283 > 1024: 0.001 / 8 = 0.000125.
        // - 628.3 in between: s = (1024·0.01/(2π) − 1)/(4 − 1) = (1.6297466 − 1)/3 = 0.2099155,
        //   (1 − s)·0.01/8 + s·0.01 = 0.000987606 + 0.002099155 = 0.003086761.
        let t = table(
            8,
            10_000.0,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 1024,
            },
        );
        let want = [1.0, 0.1, 0.003086760967011275, 0.000125];
        for (&g, w) in t.inv_freq().iter().zip(want) {
            rel(g, w, 2e-7, "llama3 inv_freq");
        }
    }

    #[test]
    fn llama31_scaling_matches_an_f64_reading_of_the_formula() {
        let plain = table(128, 500_000.0, RopeScaling::None);
        let t = table(128, 500_000.0, LLAMA31);
        let (mut low, mut mid, mut high) = (0, 0, 0);
        for (j, &g) in t.inv_freq().iter().enumerate() {
            let inv = f64::from(plain.inv_freq()[j]);
            let wavelen = 2.0 * std::f64::consts::PI / inv;
            let want = if wavelen < 8192.0 / 4.0 {
                high += 1;
                inv
            } else if wavelen > 8192.0 {
                low += 1;
                inv / 8.0
            } else {
                mid += 1;
                let s = (8192.0 / wavelen - 1.0) / 3.0;
                (1.0 - s) * inv / 8.0 + s * inv
            };
            rel(g, want, 2e-7, &format!("inv_freq[{j}]"));
        }
        // j ≤ 28 keep their frequency, 29..=34 are interpolated, the rest divided by 8.
        assert_eq!((high, mid, low), (29, 6, 29));
    }

    #[test]
    fn hand_checked_rotation() {
        // head_dim 4, θ = 10 000: inv_freq = [1, 0.01]. x = [1, 2 | 3, 4] at position 1:
        // [1·cos1 − 3·sin1, 2·cos.01 − 4·sin.01, 3·cos1 + 1·sin1, 4·cos.01 + 2·sin.01]
        // = [0.540302 − 2.524413, 1.999900 − 0.039999, 1.620907 + 0.841471, 3.999800 + 0.019999].
        let t = table(4, 10_000.0, RopeScaling::None);
        let (c, s) = cos_sin(&t, &[0, 1]);
        let mut x = [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0];
        rope_forward(&mut x, &c, &s, 1, 4).unwrap();
        // Position 0 is the identity, exactly.
        assert_eq!(&x[..4], &[1.0, 2.0, 3.0, 4.0]);
        let want = [
            -1.9841106485555495,
            1.959900667496664,
            2.4623779024123156,
            4.019799668334994,
        ];
        for (&g, w) in x[4..].iter().zip(want) {
            close(g, w, 1e-6, "rotated");
        }
    }

    #[test]
    fn matches_transformers_formula_bit_for_bit() {
        let mut rng = Rng(21);
        let (n_heads, head_dim) = (3, 64);
        let positions = [
            0u32,
            1,
            7,
            100,
            4095,
            32_000,
            131_071,
            1 << 24,
            (1 << 24) + 1,
        ];
        for scaling in [
            RopeScaling::None,
            RopeScaling::Linear { factor: 2.0 },
            LLAMA31,
        ] {
            let t = table(head_dim, 1e6, scaling);
            let (c, s) = cos_sin(&t, &positions);
            let x = rng.vec(positions.len() * n_heads * head_dim, 2.0);
            let want = hf_forward(&x, &positions, t.inv_freq(), n_heads, head_dim);
            let mut got = x.clone();
            rope_forward(&mut got, &c, &s, n_heads, head_dim).unwrap();
            assert_eq!(got, want, "{scaling:?}");
        }
    }

    #[test]
    fn angles_are_hf_f32_angles_not_exact_ones() {
        let t = table(64, 1e6, RopeScaling::None);
        let (c, s) = cos_sin(&t, &[3, 32_000]);
        let (mut near, mut far) = (0.0f64, 0.0f64);
        for (j, &f) in t.inv_freq().iter().enumerate() {
            for (k, (p, dev)) in [(3.0, &mut near), (32_000.0, &mut far)]
                .into_iter()
                .enumerate()
            {
                let exact = p * 1.0 / 1e6f64.powf(2.0 * j as f64 / 64.0);
                let (ce, se) = (exact.cos(), exact.sin());
                let (cg, sg) = (c[k * 32 + j], s[k * 32 + j]);
                *dev = dev
                    .max((f64::from(cg) - ce).abs())
                    .max((f64::from(sg) - se).abs());
                // Each value is cos/sin of the f32 angle, to within an f32 ulp.
                let a = f64::from(p as f32 * f);
                close(cg, a.cos(), 1.2e-7, "cos");
                close(sg, a.sin(), 1.2e-7, "sin");
            }
        }
        // Near the start the f32 angle is as good as exact; at 32 000 its rounding shows, as in HF.
        assert!(near < 1e-6, "near = {near}");
        assert!(far > 1e-5 && far < 5e-3, "far = {far}");
    }

    #[test]
    fn left_padded_batches_rotate_by_each_tokens_position() {
        // Sequence A at positions 0..4; sequence B left-padded by 2 (pads at position 0,
        // HF fills them with 1), then positions 0..2 holding A's first three token vectors.
        let mut rng = Rng(22);
        let (n_heads, head_dim) = (2, 6);
        let tok = n_heads * head_dim;
        let a = rng.vec(4 * tok, 1.0);
        let pad = rng.vec(2 * tok, 1.0);
        let mut x = a.clone();
        x.extend(&pad);
        x.extend(&a[..3 * tok]);
        let positions = [0, 1, 2, 3, 1, 1, 0, 1, 2];
        let t = table(head_dim, 10_000.0, RopeScaling::None);
        let (c, s) = cos_sin(&t, &positions);
        rope_forward(&mut x, &c, &s, n_heads, head_dim).unwrap();
        assert_eq!(&x[6 * tok..], &x[..3 * tok]);
    }

    #[test]
    fn backward_inverts_forward() {
        let mut rng = Rng(23);
        let (n_heads, head_dim) = (5, 18);
        let positions = [3u32, 0, 32_000, 77, 9];
        let t = table(head_dim, 1e6, LLAMA31);
        let (c, s) = cos_sin(&t, &positions);
        let x = rng.vec(positions.len() * n_heads * head_dim, 3.0);
        let mut y = x.clone();
        rope_forward(&mut y, &c, &s, n_heads, head_dim).unwrap();
        rope_backward(&mut y, &c, &s, n_heads, head_dim).unwrap();
        for (i, (&g, &w)) in y.iter().zip(&x).enumerate() {
            close(g, f64::from(w), 1e-6, &format!("x[{i}]"));
        }
    }

    /// `L = Σ c·rope(x)`: central differences through an f64 evaluation of the rotation (every
    /// coordinate) and through the f32 op (a few), against `rope_backward(c)`.
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = Rng(24);
        let (n_heads, head_dim) = (3, 10);
        let positions = [0u32, 5, 32_000];
        let t = table(head_dim, 10_000.0, RopeScaling::Linear { factor: 2.0 });
        let (cs, sn) = cos_sin(&t, &positions);
        let n = positions.len() * n_heads * head_dim;
        let x = rng.vec(n, 2.0);
        let c = rng.vec(n, 1.0);
        let mut grad = c.clone();
        rope_backward(&mut grad, &cs, &sn, n_heads, head_dim).unwrap();

        let half = head_dim / 2;
        let loss64 = |x: &[f64]| -> f64 {
            let mut l = 0.0;
            for (i, head) in x.chunks(head_dim).enumerate() {
                let tok = i / n_heads;
                for j in 0..half {
                    let (co, si) = (f64::from(cs[tok * half + j]), f64::from(sn[tok * half + j]));
                    let (a, b) = (head[j], head[j + half]);
                    let base = i * head_dim;
                    l += f64::from(c[base + j]) * (a * co - b * si)
                        + f64::from(c[base + j + half]) * (b * co + a * si);
                }
            }
            l
        };
        let x64: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let h = 1e-3;
        for i in 0..n {
            let (mut p, mut m) = (x64.clone(), x64.clone());
            p[i] += h;
            m[i] -= h;
            let want = (loss64(&p) - loss64(&m)) / (2.0 * h);
            close(grad[i], want, 1e-5, &format!("dx[{i}]"));
        }
        let loss32 = |x: &[f32]| -> f64 {
            let mut y = x.to_vec();
            rope_forward(&mut y, &cs, &sn, n_heads, head_dim).unwrap();
            y.iter()
                .zip(&c)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum()
        };
        for i in [0, 13, 47, n - 1] {
            let (mut p, mut m) = (x.clone(), x.clone());
            p[i] += 0.25;
            m[i] -= 0.25;
            let want = (loss32(&p) - loss32(&m)) / f64::from(p[i] - m[i]);
            close(grad[i], want, 1e-5, &format!("f32 dx[{i}]"));
        }
    }

    #[test]
    fn rejects_bad_configs() {
        let cfg = |head_dim, theta, scaling| {
            RopeTable::new(&RopeConfig {
                head_dim,
                theta,
                scaling,
            })
        };
        let oor = |what| {
            move |r: Result<RopeTable>| {
                assert!(
                    matches!(r, Err(crate::Error::Core(CoreError::OutOfRange { what: w, .. })) if w == what),
                    "{what}: {r:?}"
                )
            }
        };
        oor("head_dim")(cfg(0, 1e4, RopeScaling::None));
        oor("head_dim")(cfg(7, 1e4, RopeScaling::None));
        oor("rope_theta")(cfg(8, 0.0, RopeScaling::None));
        oor("rope_theta")(cfg(8, f64::NAN, RopeScaling::None));
        oor("rope_theta")(cfg(8, 1e300, RopeScaling::None));
        oor("rope_scaling.factor")(cfg(8, 1e4, RopeScaling::Linear { factor: -1.0 }));
        let l3 = |factor, low_freq_factor, high_freq_factor, original_max_position_embeddings| {
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }
        };
        oor("rope_scaling.factor")(cfg(8, 1e4, l3(0.0, 1.0, 4.0, 8192)));
        oor("rope_scaling.low_freq_factor")(cfg(8, 1e4, l3(8.0, 0.0, 4.0, 8192)));
        oor("rope_scaling.high_freq_factor")(cfg(8, 1e4, l3(8.0, 4.0, 4.0, 8192)));
        oor("rope_scaling.original_max_position_embeddings")(cfg(8, 1e4, l3(8.0, 1.0, 4.0, 0)));
        oor("rope_scaling.rope_type = yarn")(cfg(8, 1e4, RopeScaling::Yarn));
        oor("rope_scaling.rope_type = dynamic")(cfg(8, 1e4, RopeScaling::Dynamic));
        oor("rope_scaling.rope_type = longrope")(cfg(8, 1e4, RopeScaling::LongRope));
        let msg = cfg(8, 1e4, RopeScaling::Yarn).unwrap_err().to_string();
        assert!(
            msg.contains("yarn") && msg.contains("not supported yet"),
            "{msg}"
        );
    }

    #[test]
    fn rejects_bad_shapes() {
        use CoreError as E;
        let t = table(4, 1e4, RopeScaling::None);
        let (c, s) = cos_sin(&t, &[0, 1]);
        let mut x = [0.0f32; 16]; // 2 tokens × 2 heads × 4
        let err = |e: E| Err::<(), _>(crate::Error::Core(e));
        assert!(rope_forward(&mut x, &c, &s, 2, 4).is_ok());
        assert!(rope_backward(&mut x, &c, &s, 2, 4).is_ok());
        assert_eq!(
            rope_forward(&mut x[..15], &c, &s, 2, 4),
            err(E::NotDivisible {
                what: "x",
                len: 15,
                n: 8
            })
        );
        assert_eq!(
            rope_backward(&mut x, &c[..3], &s, 2, 4),
            err(E::LengthMismatch {
                what: "cos",
                expected: 4,
                actual: 3
            })
        );
        assert_eq!(
            rope_forward(&mut x, &c, &s[..1], 2, 4),
            err(E::LengthMismatch {
                what: "sin",
                expected: 4,
                actual: 1
            })
        );
        assert!(matches!(
            rope_forward(&mut x, &c, &s, 0, 4),
            Err(crate::Error::Core(E::OutOfRange {
                what: "n_heads",
                ..
            }))
        ));
        assert!(matches!(
            rope_forward(&mut x, &c, &s, 2, 3),
            Err(crate::Error::Core(E::OutOfRange {
                what: "head_dim",
                ..
            }))
        ));
        assert!(matches!(
            rope_forward(&mut x, &c, &s, usize::MAX, 4),
            Err(crate::Error::Core(E::OutOfRange {
                what: "n_heads",
                ..
            }))
        ));
        let (mut c3, mut s2) = ([0.0f32; 3], [0.0f32; 2]);
        assert_eq!(
            t.cos_sin(&[5, 6], &mut c3, &mut s2),
            err(E::LengthMismatch {
                what: "cos",
                expected: 4,
                actual: 3
            })
        );
        assert!(rope_forward(&mut [], &[], &[], 2, 4).is_ok());
    }

    /// Into bf16: the f32 rotation rounded to nearest even, bit for bit (NaN stays NaN);
    /// an output of another length is refused.
    #[test]
    fn rope_into_bf16_is_the_f32_rotation_rounded() {
        let mut rng = Rng(91);
        let (tokens, heads, head_dim) = (7, 3, 8);
        let mut x = rng.vec(tokens * heads * head_dim, 3.0);
        x[5] = f32::NAN;
        let (cos, sin) = (rng.vec(tokens * 4, 1.0), rng.vec(tokens * 4, 1.0));
        let mut want = x.clone();
        rope_forward(&mut want, &cos, &sin, heads, head_dim).unwrap();
        let mut got = vec![0u16; x.len()];
        rope_forward_bf16(&x, &cos, &sin, heads, head_dim, &mut got).unwrap();
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let w16 = half::bf16::from_f32(w);
            if w.is_nan() {
                assert!(half::bf16::from_bits(g).is_nan(), "{i}");
            } else {
                assert_eq!(g, w16.to_bits(), "{i}: {w}");
            }
        }
        let mut short = vec![0u16; x.len() - 1];
        assert!(rope_forward_bf16(&x, &cos, &sin, heads, head_dim, &mut short).is_err());
    }
}
