//! Stored number formats of the kernels that read 16-bit storage (bf16 decode weights,
//! bf16 KV pages): [`Widen`] says how one stored element becomes the f32 it is computed
//! with, one element at a time or 8 / 16 at once in a vector register. Widening bf16 is
//! exact, so a kernel over bf16 storage gives the bits of the same kernel in f32 over the
//! rounded values.

/// A stored number format: how one stored element becomes the f32 it is computed with.
pub(crate) trait Widen: Send + Sync {
    type Elem: Copy + Send + Sync;
    fn widen(e: Self::Elem) -> f32;
    /// The stored element nearest `x` (ties to even; NaN stays NaN): what a kernel that
    /// writes this format stores.
    fn narrow(x: f32) -> Self::Elem;
    /// 16 consecutive weights from `p`, widened.
    ///
    /// # Safety
    /// The CPU supports AVX-512F; `p` points at 16 readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self::Elem) -> std::arch::x86_64::__m512;
    /// 8 consecutive weights from `p`, widened.
    ///
    /// # Safety
    /// The CPU supports AVX2; `p` points at 8 readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self::Elem) -> std::arch::x86_64::__m256;
}

/// bf16 bits: the 16 bits become the high half of the f32 (exact).
pub(crate) struct Bf16Bits;
/// f32 as it is.
pub(crate) struct F32Exact;

impl Widen for Bf16Bits {
    type Elem = u16;
    #[inline(always)]
    fn widen(e: u16) -> f32 {
        f32::from_bits(u32::from(e) << 16)
    }
    #[inline(always)]
    fn narrow(x: f32) -> u16 {
        half::bf16::from_f32(x).to_bits()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    unsafe fn load16(p: *const u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::{
            __m256i, _mm256_loadu_si256, _mm512_castsi512_ps, _mm512_cvtepu16_epi32,
            _mm512_slli_epi32,
        };
        // SAFETY: the caller guarantees 16 readable u16 (32 bytes) at `p`.
        let bits = unsafe { _mm256_loadu_si256(p.cast::<__m256i>()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::{
            __m128i, _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_slli_epi32,
        };
        // SAFETY: the caller guarantees 8 readable u16 (16 bytes) at `p`.
        let bits = unsafe { _mm_loadu_si128(p.cast::<__m128i>()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
    }
}

impl Widen for F32Exact {
    type Elem = f32;
    #[inline(always)]
    fn widen(e: f32) -> f32 {
        e
    }
    #[inline(always)]
    fn narrow(x: f32) -> f32 {
        x
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller guarantees 16 readable f32 at `p`.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller guarantees 8 readable f32 at `p`.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}
