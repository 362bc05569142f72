//! Which x86-64 instruction set the CPU kernels run with, and the `ARES_CPU_ISA` switch that
//! forces one.
//!
//! Every kernel that has more than one code path asks [`Isa::active`] and runs:
//! - [`Isa::Avx512`]: AVX-512F intrinsics where a kernel has them, else its portable loop
//!   compiled for AVX-512 + FMA; the `gemm` crate's AVX-512 kernels;
//! - [`Isa::Avx2`]: AVX2 intrinsics where a kernel has them, else the portable loop compiled
//!   for AVX2 + FMA; `gemm`'s AVX2 + FMA kernels;
//! - [`Isa::Portable`]: the portable loops for the base x86-64 target (SSE2, no FMA: a fused
//!   multiply-add that a kernel needs for its bits is a library call); `gemm`'s scalar kernels;
//! - [`Isa::Amx`]: the AVX-512 path, with the bf16 matrix products (linear layers and the LM
//!   head in [`MatmulPrecision::Bf16`]) on AMX tiles (`crate::ops::matmul_amx`): the same
//!   operands and f32 sums, in another order. f32 products are the AVX-512 path's.
//!
//! By default the widest path the CPU has is used. `ARES_CPU_ISA=amx|avx512|avx2|portable` forces
//! a path (`native` or empty: the default) so that one machine can run the tests and the
//! benchmarks of every path; a narrower path on a wider CPU runs the same instructions an
//! older CPU would (not its cache sizes or clock). A path the CPU lacks, or an unknown value,
//! is an error from [`Isa::setting`] (the runner and the tests refuse to start on it); the
//! kernels themselves then keep to the CPU's own path and print one warning.
//!
//! The setting is read once per process.
//!
//! [`MatmulPrecision::Bf16`]: crate::ops::precision::MatmulPrecision::Bf16

use std::sync::OnceLock;

/// The environment variable that forces a path.
pub const ENV: &str = "ARES_CPU_ISA";

/// An instruction-set path of the CPU kernels, ordered from narrowest to widest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// The base x86-64 target (or any other architecture): no SIMD beyond what the compiler
    /// emits by default, no FMA.
    Portable,
    /// AVX2 and FMA (x86-64-v3: Intel Haswell and later, AMD Zen 1–3).
    Avx2,
    /// AVX-512F besides AVX2 and FMA (Intel Skylake-SP and later servers, AMD Zen 4 and later).
    Avx512,
    /// AVX-512 and AMX-BF16 tiles, granted to the process by the OS (Intel Xeon Sapphire
    /// Rapids and later, on Linux 5.16 and later).
    Amx,
}

/// What is wrong with an `ARES_CPU_ISA` setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsaError {
    /// Not one of the path names.
    #[error("{ENV}={value:?} is not a CPU path: use amx, avx512, avx2, portable or native")]
    Unknown {
        /// The value as set.
        value: String,
    },
    /// A path this CPU cannot run.
    #[error("{ENV}={requested} asks for a path this CPU lacks (the widest it has is {detected})")]
    Unsupported {
        /// The path asked for.
        requested: Isa,
        /// The widest path the CPU has.
        detected: Isa,
    },
}

impl Isa {
    /// Every path, narrowest first.
    pub const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Amx];

    /// The name `ARES_CPU_ISA` takes: `portable`, `avx2`, `avx512` or `amx`.
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
        }
    }

    /// The path named `s` (as [`Isa::name`] spells it, any case, surrounding blanks ignored);
    /// `None` for another name.
    pub fn parse(s: &str) -> Option<Isa> {
        let s = s.trim();
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name().eq_ignore_ascii_case(s))
    }

    /// The widest path this CPU has (detected once).
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma");
                if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                    if amx_available() {
                        return Isa::Amx;
                    }
                    return Isa::Avx512;
                }
                if avx2 {
                    return Isa::Avx2;
                }
            }
            Isa::Portable
        })
    }

    /// Whether this CPU can run the path (every narrower path than the detected one can).
    pub fn supported(self) -> bool {
        self <= Isa::detected()
    }

    /// The path `ARES_CPU_ISA` asks for: `None` when it is unset, empty or `native`.
    ///
    /// # Errors
    /// An unknown name, or a path this CPU lacks.
    pub fn setting() -> Result<Option<Isa>, IsaError> {
        let value = std::env::var_os(ENV).unwrap_or_default();
        let value = value.to_string_lossy();
        Isa::from_setting(&value)
    }

    /// [`Isa::setting`] of a given value.
    ///
    /// # Errors
    /// As [`Isa::setting`].
    pub fn from_setting(value: &str) -> Result<Option<Isa>, IsaError> {
        let v = value.trim();
        if v.is_empty() || v.eq_ignore_ascii_case("native") {
            return Ok(None);
        }
        let requested = Isa::parse(v).ok_or_else(|| IsaError::Unknown {
            value: value.to_owned(),
        })?;
        if !requested.supported() {
            return Err(IsaError::Unsupported {
                requested,
                detected: Isa::detected(),
            });
        }
        Ok(Some(requested))
    }

    /// The path the kernels run with: `ARES_CPU_ISA`'s if it is valid, else the widest the
    /// CPU has (with one warning on stderr for an invalid setting). Always a path the CPU
    /// supports — the kernels' `unsafe` calls of `target_feature` code rest on this.
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| match Isa::setting() {
            Ok(forced) => forced.unwrap_or_else(Isa::detected),
            Err(e) => {
                let detected = Isa::detected();
                eprintln!("warning: {e}; the CPU kernels use {detected}");
                detected
            }
        })
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether this process can run AMX bf16 tile instructions: the CPU reports AMX-TILE and
/// AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) besides AVX-512F, and Linux granted the tile
/// data state. Asked once per process; `false` elsewhere than x86-64 Linux.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the path is x86-64's only
pub fn amx_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(detect_amx)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect_amx() -> bool {
    // leaf 7 is asked only when the maximum leaf (leaf 0's EAX) reaches it
    if std::arch::x86_64::__cpuid(0).eax < 7 {
        return false;
    }
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    let (amx_bf16, amx_tile) = ((leaf7.edx >> 22) & 1 == 1, (leaf7.edx >> 24) & 1 == 1);
    let avx512 = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw");
    if !(amx_bf16 && amx_tile && avx512) {
        return false;
    }
    // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): 0 when granted (also when it
    // was already); an error when the kernel predates AMX (5.16) or refuses.
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain system call; the kernel clobbers rcx and r11 and nothing else.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
#[allow(dead_code)] // through `amx_available`, on x86-64 only
fn detect_amx() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ARES_CPU_ISA=avx2x cargo test` must fail here rather than test the native path
    /// under a name it did not ask for.
    #[test]
    fn the_setting_of_this_run_is_valid() {
        let setting = Isa::setting();
        assert!(setting.is_ok(), "{}", setting.unwrap_err());
        assert_eq!(
            Isa::active(),
            setting.unwrap().unwrap_or_else(Isa::detected)
        );
        assert!(Isa::active().supported());
        eprintln!(
            "CPU kernels on {} (CPU: {})",
            Isa::active(),
            Isa::detected()
        );
    }

    #[test]
    fn names_round_trip_and_order_by_width() {
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
            assert_eq!(
                Isa::parse(&format!(" {} ", isa.name().to_uppercase())),
                Some(isa)
            );
            assert_eq!(isa.to_string(), isa.name());
        }
        assert!(Isa::Portable < Isa::Avx2 && Isa::Avx2 < Isa::Avx512 && Isa::Avx512 < Isa::Amx);
        assert_eq!(Isa::parse("avx-512"), None);
        assert!(Isa::Portable.supported());
    }

    #[test]
    fn settings_are_checked() {
        assert_eq!(Isa::from_setting(""), Ok(None));
        assert_eq!(Isa::from_setting("native"), Ok(None));
        assert_eq!(Isa::from_setting("portable"), Ok(Some(Isa::Portable)));
        let e = Isa::from_setting("sse9").unwrap_err();
        assert_eq!(
            e.to_string(),
            "ARES_CPU_ISA=\"sse9\" is not a CPU path: use amx, avx512, avx2, portable or native"
        );
        for isa in Isa::ALL {
            match Isa::from_setting(isa.name()) {
                Ok(got) => assert!(isa.supported() && got == Some(isa)),
                Err(IsaError::Unsupported {
                    requested,
                    detected,
                }) => {
                    assert!(!isa.supported() && requested == isa && detected < isa);
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}
