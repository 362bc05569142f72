//! `y += α·x`, element-wise: how a LoRA pair's scaled product `s·(x·Aᵀ)·Bᵀ` joins the
//! frozen layer's output, and how its gradient is scaled going back.

use crate::Result;
use crate::error::check_len;
use rayon::prelude::*;

/// Element counts below this run on one thread.
const PAR_MIN_ELEMS: usize = 1 << 16;
/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// `y[i] += alpha · x[i]`, the product rounded to f32 before the sum (no fused
/// multiply-add, so the CUDA twin's `__fmul_rn` / `__fadd_rn` give the same bits). A NaN
/// or infinite `x[i]` or `alpha` propagates as IEEE arithmetic says (`0 · ∞` is NaN).
///
/// # Errors
/// `LengthMismatch` when `y` is not as long as `x`; nothing is written then.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) -> Result<()> {
    check_len("y", x.len(), y.len())?;
    let add = |(x, y): (&[f32], &mut [f32])| {
        for (y, &x) in y.iter_mut().zip(x) {
            *y += alpha * x;
        }
    };
    if x.len() >= PAR_MIN_ELEMS {
        x.par_chunks(CHUNK)
            .zip(y.par_chunks_mut(CHUNK))
            .for_each(add);
    } else {
        add((x, y));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_the_scaled_vector() {
        let mut y = [1.0, -2.0, 0.5];
        axpy(2.0, &[0.25, 1.0, -0.25], &mut y).unwrap();
        assert_eq!(y, [1.5, 0.0, 0.0]);
        axpy(0.0, &[3.0, 4.0, 5.0], &mut y).unwrap();
        assert_eq!(y, [1.5, 0.0, 0.0]);
    }

    #[test]
    fn product_is_rounded_before_the_sum() {
        // 1/3 · 3 rounds to 1 exactly in f32; a fused a·b + c would keep the residue.
        let third = 1.0f32 / 3.0;
        let mut y = [-1.0f32];
        axpy(third, &[3.0], &mut y).unwrap();
        assert_eq!(y[0], (third * 3.0) - 1.0);
    }

    #[test]
    fn long_vectors_equal_the_serial_loop() {
        let n = PAR_MIN_ELEMS + 77;
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: Vec<f32> = y.iter().zip(&x).map(|(&y, &x)| y + 0.3 * x).collect();
        axpy(0.3, &x, &mut y).unwrap();
        assert_eq!(y, want);
    }

    #[test]
    fn mismatched_lengths_write_nothing() {
        let mut y = [1.0, 2.0];
        let err = axpy(1.0, &[1.0, 2.0, 3.0], &mut y).unwrap_err();
        assert!(err.to_string().contains('y'), "{err}");
        assert_eq!(y, [1.0, 2.0]);
    }
}
