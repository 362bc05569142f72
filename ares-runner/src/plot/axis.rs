//! Axis ranges and tick labels that plotters can always draw.
//!
//! plotters' tick search asserts on NaN and loops forever on an infinite span, and a zero
//! span gives a single tick; so every range handed to it is finite, ordered and non-empty.

/// Largest magnitude shown on a value axis; beyond it values are drawn clipped at the edge
/// (keeps `hi - lo` finite).
const LIMIT: f64 = 1e300;

/// The y range drawn for finite data in `[min, max]`: 5 % margin on each side; a constant
/// series (span below 1e-9 of its magnitude) gets ±5 % of its value, or ±1 around 0.
pub(super) fn value_range(min: f64, max: f64) -> (f64, f64) {
    let (lo, hi) = (min.clamp(-LIMIT, LIMIT), max.clamp(-LIMIT, LIMIT));
    let magnitude = lo.abs().max(hi.abs());
    let span = hi - lo;
    if span <= magnitude * 1e-9 {
        let mid = lo / 2.0 + hi / 2.0;
        let half = if magnitude == 0.0 {
            1.0
        } else {
            magnitude * 0.05
        };
        return (mid - half, mid + half);
    }
    let pad = span * 0.05;
    (lo - pad, hi + pad)
}

/// The x (step) range for steps in `[min, max]`: exactly that, or ±1 around a single step.
pub(super) fn step_range(min: f64, max: f64) -> (f64, f64) {
    let (lo, hi) = (min.clamp(-LIMIT, LIMIT), max.clamp(-LIMIT, LIMIT));
    if hi - lo <= lo.abs().max(hi.abs()) * 1e-9 {
        (lo - 1.0, hi + 1.0)
    } else {
        (lo, hi)
    }
}

/// A tick label: up to 4 significant digits without trailing zeros (`0.25`, `1500`, `12.5`),
/// scientific outside [1e-3, 1e5) (`2.5e-5`), and `0` for values within 1e-6 of the axis span
/// from zero (tick arithmetic leaves `5.6e-17` where 0 was meant).
pub(super) fn format_tick(value: f64, span: f64) -> String {
    let magnitude = value.abs();
    if magnitude <= span.abs() * 1e-6 || magnitude == 0.0 {
        return "0".to_string();
    }
    if !(1e-3..1e5).contains(&magnitude) {
        let text = format!("{value:.2e}");
        return match text.split_once('e') {
            Some((mantissa, exponent)) => format!("{}e{exponent}", trim_zeros(mantissa)),
            None => text,
        };
    }
    let decimals = (3 - magnitude.log10().floor() as i32).max(0) as usize;
    trim_zeros(&format!("{value:.decimals$}")).to_string()
}

/// `"12.500"` → `"12.5"`, `"3.00"` → `"3"`; text without a point is kept.
fn trim_zeros(text: &str) -> &str {
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_pad_and_never_collapse() {
        assert_eq!(value_range(0.0, 10.0), (-0.5, 10.5));
        assert_eq!(value_range(2.0, 2.0), (1.9, 2.1));
        assert_eq!(value_range(-4.0, -4.0), (-4.2, -3.8));
        assert_eq!(value_range(0.0, 0.0), (-1.0, 1.0));
        let (lo, hi) = value_range(-f64::MAX, f64::MAX);
        assert!(
            lo.is_finite() && hi.is_finite() && (hi - lo).is_finite(),
            "{lo} {hi}"
        );
        assert_eq!(step_range(3.0, 3.0), (2.0, 4.0));
        assert_eq!(step_range(1.0, 40.0), (1.0, 40.0));
    }

    #[test]
    fn ticks_read_like_a_person_wrote_them() {
        assert_eq!(format_tick(0.25, 1.0), "0.25");
        assert_eq!(format_tick(1500.0, 1000.0), "1500");
        assert_eq!(format_tick(12.5, 10.0), "12.5");
        assert_eq!(format_tick(0.30000000000000004, 1.0), "0.3");
        assert_eq!(format_tick(-0.001, 0.01), "-0.001");
        assert_eq!(format_tick(2.5e-5, 1e-4), "2.5e-5");
        assert_eq!(format_tick(123456.0, 1e5), "1.23e5");
        assert_eq!(format_tick(5.551115123125783e-17, 1.0), "0");
        assert_eq!(format_tick(0.0, 0.0), "0");
    }
}
