//! What one GEMM for q/k/v (or gate|up) would save, measured with the products ares has: the
//! layer's separate products over row blocks of one weight (as a fused weight's rows would
//! lie) beside one product of the whole width, forward and backward, bf16 weights and
//! activations as bf16 training runs them (`linear_bf16_x`, `linear_backward_bf16_x`). The
//! fused form writes one `[rows, Σ out]` output and reads one `[rows, Σ out]` gradient; the
//! layout a fused layer would need around it is not timed, so the difference is what the
//! products alone could gain (`bench-model_cuda fuse`; docs/kernels.md says why the fusion
//! waits for this figure).

use std::time::Duration;

use ares_model::backend::{
    Backend, BackendError, DType, GradWrite, GradWrites, LinearDims, MatmulPrecision, View, ViewMut,
};

use crate::SplitMix;
use crate::model::try_best_and_median;

/// Best and median times of the separate products and of the fused one.
#[derive(Debug, Clone, Copy)]
pub struct FusedFigures {
    /// The separate products' forward.
    pub separate_forward: (Duration, Duration),
    /// One product of the whole width, forward.
    pub fused_forward: (Duration, Duration),
    /// The separate products' backward (input gradients added up, weight gradients).
    pub separate_backward: (Duration, Duration),
    /// One product's backward.
    pub fused_backward: (Duration, Duration),
    /// The largest difference between the fused forward's outputs and the separate ones'
    /// (the same products: a check that both forms do the same work).
    pub forward_difference: f32,
}

/// The buffers of [`products`]: x, the weight of every part's rows, the biases, the outputs
/// and the output gradients, whole (`[rows, Σ out]`) and by part.
struct Operands<B: Backend> {
    x: B::Half,
    w: B::Half,
    bias: B::Buffer,
    out: B::Buffer,
    dout: B::Buffer,
    dx: B::Buffer,
    dw: B::Buffer,
    dbias: B::Buffer,
}

/// Times the products of `rows` tokens of `in_features` into parts of `outs` features
/// (q, k, v: `[q_dim, kv_dim, kv_dim]`; gate|up: `[i, i]`), each with a bias when `bias`:
/// separately, part after part, and as one product of `Σ outs` features. Each timed call
/// ends with a synchronisation.
///
/// # Errors
/// The backend's.
pub fn products<B: Backend>(
    be: &B,
    (rows, in_features): (usize, usize),
    outs: &[usize],
    bias: bool,
    runs: usize,
) -> Result<FusedFigures, BackendError> {
    let total: usize = outs.iter().sum();
    let o = operands(be, rows, in_features, total)?;
    let mut o = o;
    let dims = |out_features| LinearDims {
        rows,
        in_features,
        out_features,
        precision: MatmulPrecision::Bf16,
    };
    // each part's first row in the fused weight, and its columns in the fused output
    let starts: Vec<usize> = outs
        .iter()
        .scan(0, |at, &n| {
            let s = *at;
            *at += n;
            Some(s)
        })
        .collect();
    let separate_forward = try_best_and_median(runs, || {
        for (&n, &s) in outs.iter().zip(&starts) {
            let w = View::new(&o.w, s * in_features, n * in_features)?;
            let b = bias.then(|| View::new(&o.bias, s, n)).transpose()?;
            // part p's output: the next n·rows of the output buffer (its own tensor)
            let out = ViewMut::new(&mut o.out, s * rows, n * rows)?;
            be.linear_bf16_x(View::whole(&o.x), w, b, dims(n), out)?;
        }
        be.synchronize()
    })?;
    // the separate outputs, laid out as the fused one's columns
    let mut separate = vec![0.0f32; rows * total];
    for (&n, &s) in outs.iter().zip(&starts) {
        let mut part = vec![0.0f32; rows * n];
        be.download(View::new(&o.out, s * rows, n * rows)?, &mut part)?;
        for r in 0..rows {
            separate[r * total + s..r * total + s + n].copy_from_slice(&part[r * n..(r + 1) * n]);
        }
    }
    let fused_forward = try_best_and_median(runs, || {
        let b = bias.then(|| View::whole(&o.bias));
        let (x, w) = (View::whole(&o.x), View::whole(&o.w));
        be.linear_bf16_x(x, w, b, dims(total), ViewMut::whole(&mut o.out))?;
        be.synchronize()
    })?;
    let mut fused = vec![0.0f32; rows * total];
    be.download(View::whole(&o.out), &mut fused)?;
    let forward_difference = fused
        .iter()
        .zip(&separate)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    let separate_backward = try_best_and_median(runs, || {
        for (p, (&n, &s)) in outs.iter().zip(&starts).enumerate() {
            let w = View::new(&o.w, s * in_features, n * in_features)?;
            let dout = View::new(&o.dout, s * rows, n * rows)?;
            let dw = ViewMut::new(&mut o.dw, s * in_features, n * in_features)?;
            let db = bias.then(|| ViewMut::new(&mut o.dbias, s, n)).transpose()?;
            // the first part writes dx, the others add to it; weight gradients written
            let first = if p == 0 {
                GradWrite::Overwrite
            } else {
                GradWrite::Accumulate
            };
            let writes = GradWrites {
                dx: first,
                dw: GradWrite::Overwrite,
            };
            let x = View::whole(&o.x);
            let dx = Some(ViewMut::whole(&mut o.dx));
            be.linear_backward_bf16_x(dout, x, w, dims(n), writes, dx, Some(dw), db)?;
        }
        be.synchronize()
    })?;
    let fused_backward = try_best_and_median(runs, || {
        let writes = GradWrites {
            dx: GradWrite::Overwrite,
            dw: GradWrite::Overwrite,
        };
        let (dout, x, w) = (View::whole(&o.dout), View::whole(&o.x), View::whole(&o.w));
        let dx = Some(ViewMut::whole(&mut o.dx));
        let dw = Some(ViewMut::whole(&mut o.dw));
        let db = bias.then(|| ViewMut::whole(&mut o.dbias));
        be.linear_backward_bf16_x(dout, x, w, dims(total), writes, dx, dw, db)?;
        be.synchronize()
    })?;
    Ok(FusedFigures {
        separate_forward,
        fused_forward,
        separate_backward,
        fused_backward,
        forward_difference,
    })
}

/// Random operands (bf16 x and weight, f32 bias and output gradient) and zeroed outputs.
fn operands<B: Backend>(
    be: &B,
    rows: usize,
    in_features: usize,
    total: usize,
) -> Result<Operands<B>, BackendError> {
    let mut rng = SplitMix::new(17);
    let mut values = |n: usize, scale: f32| -> Vec<f32> {
        (0..n).map(|_| scale * (2.0 * rng.unit() - 1.0)).collect()
    };
    let half = |v: &[f32]| -> Result<B::Half, BackendError> {
        let bits: Vec<u16> = v.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
        let mut h = be.alloc_half(v.len(), DType::Bf16)?;
        be.upload_half(&bits, ViewMut::whole(&mut h))?;
        Ok(h)
    };
    let full = |v: &[f32]| -> Result<B::Buffer, BackendError> {
        let mut b = be.alloc(v.len())?;
        be.upload(v, ViewMut::whole(&mut b))?;
        Ok(b)
    };
    Ok(Operands {
        x: half(&values(rows * in_features, 1.0))?,
        w: half(&values(total * in_features, 0.05))?,
        bias: full(&values(total, 0.1))?,
        out: be.alloc(rows * total)?,
        dout: full(&values(rows * total, 1e-3))?,
        dx: be.alloc(rows * in_features)?,
        dw: be.alloc(total * in_features)?,
        dbias: be.alloc(total)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ares_model::backend::cpu::CpuBackend;

    #[test]
    fn both_forms_run_at_a_small_shape() {
        // q, k, v of a grouped-query layer, with biases; gate|up without
        for (outs, bias) in [(&[64usize, 16, 16][..], true), (&[48, 48][..], false)] {
            let f = products(&CpuBackend, (32, 24), outs, bias, 1).unwrap();
            assert!(f.fused_forward.0 > Duration::ZERO && f.separate_backward.0 > Duration::ZERO);
            // the same products: the fused output's column blocks are the parts' outputs
            assert!(f.forward_difference < 1e-5, "{}", f.forward_difference);
        }
    }
}
