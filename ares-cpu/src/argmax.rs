//! Greedy decoding's pick: the index of a row's largest logit.

use crate::exp::scaled_row_max;
use crate::isa::Isa;

/// The index of the largest entry of `row`, the lowest among equal maxima (−0 equals +0);
/// `None` when an entry is NaN or +∞, every entry is −∞, or the row is empty.
///
/// The maximum comes from a vectorised pass on the [`Isa::active`] path (a max is exact, so
/// every path gives the same index), its first position from a second pass that stops there.
pub fn argmax(row: &[f32]) -> Option<usize> {
    let max = match Isa::active() {
        // SAFETY: `Isa::active` is a path the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { row_max_avx512(row) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { row_max_avx2(row) },
        _ => scaled_row_max(row, 1.0),
    }?;
    row.iter().position(|&x| x == max)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn row_max_avx512(row: &[f32]) -> Option<f32> {
    scaled_row_max(row, 1.0)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_max_avx2(row: &[f32]) -> Option<f32> {
    scaled_row_max(row, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain definition: the first strictly larger finite-or-−∞ entry wins.
    fn reference(row: &[f32]) -> Option<usize> {
        if row.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
            return None;
        }
        let mut best: Option<(usize, f32)> = None;
        for (i, &x) in row.iter().enumerate() {
            if x > f32::NEG_INFINITY && best.is_none_or(|(_, b)| x > b) {
                best = Some((i, x));
            }
        }
        best.map(|(i, _)| i)
    }

    #[test]
    fn hand_checked_rows() {
        let inf = f32::INFINITY;
        assert_eq!(
            argmax(&[1.0, 3.0, 3.0, 2.0]),
            Some(1),
            "tie: the lower index"
        );
        assert_eq!(argmax(&[-0.0, 0.0, -1.0]), Some(0), "-0 = +0");
        assert_eq!(argmax(&[-inf, -inf, -5.0, -inf]), Some(2));
        assert_eq!(argmax(&[-inf, -inf]), None);
        assert_eq!(argmax(&[]), None);
        assert_eq!(argmax(&[0.0, f32::NAN, 1.0]), None);
        assert_eq!(argmax(&[0.0, 1.0, inf]), None);
        assert_eq!(argmax(&[f32::MIN, f32::MIN, -inf]), Some(0));
    }

    #[test]
    fn equals_the_plain_definition_on_long_rows() {
        let mut rng = crate::test_rng::Rng(5);
        for len in [1usize, 15, 16, 17, 100, 8192, 151_936] {
            // whole numbers: many ties
            let mut row: Vec<f32> = rng.vec(len, 20.0).iter().map(|x| x.round()).collect();
            assert_eq!(argmax(&row), reference(&row), "len {len}");
            // the maximum at the end, and a NaN after it
            row[len - 1] = 100.0;
            assert_eq!(argmax(&row), Some(len - 1));
            row.push(f32::NAN);
            assert_eq!(argmax(&row), None);
        }
    }
}
