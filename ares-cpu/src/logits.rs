//! Logit element types and the typed view of a `[rows, V]` logits buffer.

use half::{bf16, f16};

/// Which element type a [`Logit`] is (lets SIMD kernels pick the load instruction at
/// compile time).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitKind {
    /// f32
    F32,
    /// bf16
    Bf16,
    /// f16
    F16,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// An element type logits can be stored in: f32, bf16 or f16 (sealed). Loading converts a
/// block to f32.
pub trait Logit: Copy + Send + Sync + 'static + sealed::Sealed {
    /// The element type, for kernels that load it with their own instructions.
    #[doc(hidden)]
    const KIND: LogitKind;
    /// Converts `src` into `dst` (same length), multiplied by `scale`.
    fn load_scaled(src: &[Self], dst: &mut [f32], scale: f32);
    /// One element as f32.
    fn to_f32(self) -> f32;
}

impl Logit for f32 {
    const KIND: LogitKind = LogitKind::F32;
    #[inline(always)]
    fn load_scaled(src: &[f32], dst: &mut [f32], scale: f32) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = *s * scale;
        }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Logit for bf16 {
    const KIND: LogitKind = LogitKind::Bf16;
    #[inline(always)]
    fn load_scaled(src: &[bf16], dst: &mut [f32], scale: f32) {
        // bf16 is the upper half of an f32: a shift, which vectorises.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16) * scale;
        }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

impl Logit for f16 {
    const KIND: LogitKind = LogitKind::F16;
    #[inline(always)]
    fn load_scaled(src: &[f16], dst: &mut [f32], scale: f32) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
        for d in dst.iter_mut() {
            *d *= scale;
        }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// A row-major `[rows, vocab]` logits buffer in one of the supported element types.
#[derive(Debug, Clone, Copy)]
pub enum Logits<'a> {
    /// f32 logits.
    F32(&'a [f32]),
    /// bf16 logits (what bf16 models produce).
    Bf16(&'a [bf16]),
    /// f16 logits.
    F16(&'a [f16]),
}

impl Logits<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Logits::F32(x) => x.len(),
            Logits::Bf16(x) => x.len(),
            Logits::F16(x) => x.len(),
        }
    }

    /// True when there is no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the buffer (for bandwidth reports).
    pub fn bytes(&self) -> usize {
        match self {
            Logits::F32(x) => std::mem::size_of_val(*x),
            Logits::Bf16(x) => std::mem::size_of_val(*x),
            Logits::F16(x) => std::mem::size_of_val(*x),
        }
    }
}
