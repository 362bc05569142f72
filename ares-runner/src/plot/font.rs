//! The font plot text is drawn with, embedded in the binary.
//!
//! plotters is built with `ab_glyph` instead of its system-font lookup (which links
//! fontconfig and freetype). ab_glyph only knows fonts registered at run time: without one,
//! drawing text on a bitmap panics and on SVG fails with `FontUnavailable`. So the plots carry
//! their own font and register it before the first drawing.

use std::sync::OnceLock;

use plotters::style::{FontStyle, register_font};

/// DejaVu Sans 2.37, unmodified (Bitstream Vera licence; `assets/fonts/DejaVuSans-LICENSE.txt`).
static DEJAVU_SANS: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// The family every plot text asks for; plotters' default text style asks for it too, and
/// other styles (bold, italic) fall back to the registered normal face.
pub(super) const FAMILY: &str = "sans-serif";

/// Registers the embedded font once per process; false when the font data does not parse.
pub(super) fn ensure_registered() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| register_font(FAMILY, FontStyle::Normal, DEJAVU_SANS).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_font_registers() {
        assert!(ensure_registered());
        // Twice is fine (the second call does nothing).
        assert!(ensure_registered());
    }
}
