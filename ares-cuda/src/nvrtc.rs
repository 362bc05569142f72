//! Kernel compilation with NVRTC, which needs no GPU: CUBIN for the device's exact
//! architecture (no driver JIT, so no "PTX newer than the driver" trap), PTX as the fallback
//! for architectures this NVRTC cannot assemble for. Results are cached on disk by a hash
//! of the source, the options and the NVRTC version.

use crate::error::{Error, Result};
use cudarc::nvrtc::{result, sys};
use std::ffi::{CString, c_int};
use std::path::PathBuf;

/// A compiled kernel image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Image {
    /// Machine code for one architecture (`sm_XY`).
    Cubin(Vec<u8>),
    /// PTX text for the driver to JIT (`compute_XY`).
    Ptx(String),
}

/// Output of one NVRTC compilation.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The image.
    pub image: Image,
    /// NVRTC's log (with `--ptxas-options=-v` for CUBIN: registers, spills per kernel).
    pub log: String,
}

/// True when `libnvrtc` can be loaded (it is looked up on `LD_LIBRARY_PATH`).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library; no NVRTC function is called.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid.
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if status != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Compile {
            source_name: "nvrtcVersion",
            target: String::new(),
            log: format!("{status:?}"),
        });
    }
    Ok((major, minor))
}

fn require_nvrtc() -> Result<()> {
    if nvrtc_available() {
        Ok(())
    } else {
        Err(Error::LibraryMissing {
            library: "libnvrtc.so (NVRTC)",
        })
    }
}

/// Options every kernel is compiled with (no fast-math: precision is part of the contract;
/// kernels ask for approximate instructions explicitly where they are accurate enough).
const BASE_OPTIONS: [&str; 2] = ["-std=c++17", "--restrict"];

/// Compiles `source` to a CUBIN for `sm_{arch}` (e.g. `arch = 90`).
pub fn compile_cubin(source_name: &'static str, source: &str, arch: u32) -> Result<Compiled> {
    compile(source_name, source, &format!("sm_{arch}"), true)
}

/// Compiles `source` to PTX for `compute_{arch}`.
pub fn compile_ptx(source_name: &'static str, source: &str, arch: u32) -> Result<Compiled> {
    compile(source_name, source, &format!("compute_{arch}"), false)
}

fn compile(source_name: &'static str, source: &str, target: &str, cubin: bool) -> Result<Compiled> {
    require_nvrtc()?;
    let fail = |log: String| Error::Compile {
        source_name,
        target: target.to_string(),
        log,
    };
    let src = CString::new(source).map_err(|_| fail("source holds a NUL byte".into()))?;
    let name = CString::new(source_name).map_err(|_| fail("name holds a NUL byte".into()))?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let mut options: Vec<String> = BASE_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={target}"));
    if cubin {
        options.push("--ptxas-options=-v".into());
    }
    // SAFETY: `prog` was created above and is destroyed exactly once below; `src` and
    // `name` outlive it.
    unsafe {
        let compiled = result::compile_program(prog, &options);
        let log = result::get_program_log(prog)
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_default();
        let image = match compiled {
            Err(e) => Err(fail(if log.trim().is_empty() {
                format!("{e:?}")
            } else {
                log.clone()
            })),
            Ok(()) if cubin => get_cubin(prog).map(Image::Cubin).map_err(fail),
            Ok(()) => result::get_ptx(prog)
                .map(|p| Image::Ptx(c_chars_to_string(&p)))
                .map_err(|e| fail(format!("{e:?}"))),
        };
        let _ = result::destroy_program(prog);
        image.map(|image| Compiled { image, log })
    }
}

/// # Safety
/// `prog` must be a successfully compiled, live program.
unsafe fn get_cubin(prog: sys::nvrtcProgram) -> std::result::Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: per the function's contract; `size` is a valid out pointer.
    let status = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) };
    if status != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return Err(format!("nvrtcGetCUBINSize: {status:?}, size {size}"));
    }
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds `size` bytes as NVRTC requires.
    let status = unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) };
    if status != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcGetCUBIN: {status:?}"));
    }
    Ok(buf)
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Register and spill figures ptxas reported for one kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's (mangled or `extern "C"`) name.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores + spill loads.
    pub spill_bytes: u32,
}

/// Parses the `--ptxas-options=-v` part of a CUBIN compilation log.
pub fn kernel_resources(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let mut current: Option<String> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest.split('\'').next().map(str::to_string);
        } else if let Some(name) = &current {
            let number_before = |key: &str| -> Option<u32> {
                let i = line.find(key)?;
                line[..i].split_whitespace().last()?.parse().ok()
            };
            if line.contains("bytes spill stores") {
                let spill = number_before("bytes spill stores").unwrap_or(0)
                    + number_before("bytes spill loads").unwrap_or(0);
                match out.iter_mut().find(|k| &k.kernel == name) {
                    Some(k) => k.spill_bytes = spill,
                    None => out.push(KernelResources {
                        kernel: name.clone(),
                        registers: 0,
                        spill_bytes: spill,
                    }),
                }
            }
            if let Some(regs) = number_before("registers") {
                match out.iter_mut().find(|k| &k.kernel == name) {
                    Some(k) => k.registers = regs,
                    None => out.push(KernelResources {
                        kernel: name.clone(),
                        registers: regs,
                        spill_bytes: 0,
                    }),
                }
            }
        }
    }
    out
}

/// Registers and stack frame of one function as its CUBIN records them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CubinFunction {
    /// The function's symbol (a kernel's `extern "C"` name).
    pub name: String,
    /// Registers per thread (`EIATTR_REGCOUNT`).
    pub registers: u32,
    /// Bytes of stack frame per thread (`EIATTR_FRAME_SIZE`): where register spills and
    /// local arrays live, so 0 means neither.
    pub stack_frame: u32,
}

/// Reads every function's register count and stack frame from a CUBIN (an ELF64 image):
/// the `.nv.info` section holds attribute records `[format u8][attribute u8]` followed by a
/// `u16` value, or for format 4 a `u16` size and that many bytes; `EIATTR_REGCOUNT` (0x2f)
/// and `EIATTR_FRAME_SIZE` (0x11) carry `[symbol index u32][value u32]`, named through
/// `.symtab`. This does not depend on NVRTC's log, which one NVRTC install left empty for
/// `--ptxas-options=-v` (an H100 machine, benches/RESULTS.md); where the log is there the
/// two agree (`tests/nvrtc.rs`).
///
/// # Errors
/// A message naming what is missing or out of bounds when `cubin` is not such an image.
pub fn cubin_functions(cubin: &[u8]) -> std::result::Result<Vec<CubinFunction>, String> {
    const EIATTR_FRAME_SIZE: u8 = 0x11;
    const EIATTR_REGCOUNT: u8 = 0x2f;
    let bytes = |at: usize, n: usize| {
        cubin
            .get(at..at.checked_add(n).ok_or("offset overflow")?)
            .ok_or_else(|| format!("CUBIN truncated: {n} bytes at {at} of {}", cubin.len()))
    };
    let u16_at = |at: usize| bytes(at, 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |at: usize| bytes(at, 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    let usize_at = |at: usize| {
        bytes(at, 8).and_then(|b| {
            usize::try_from(u64::from_le_bytes(b.try_into().unwrap()))
                .map_err(|_| format!("offset at {at} too large"))
        })
    };
    if cubin.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        return Err("not a little-endian ELF64 image".into());
    }
    let shoff = usize_at(0x28)?;
    let shentsize = usize::from(u16_at(0x3a)?);
    let shnum = usize::from(u16_at(0x3c)?);
    let shstrndx = usize::from(u16_at(0x3e)?);
    if shentsize < 64 {
        return Err(format!("section header size {shentsize} < 64"));
    }
    // (name offset, type, file offset, size, link) of section `i`.
    let section = |i: usize| -> std::result::Result<(usize, u32, usize, usize, usize), String> {
        let h = shoff.saturating_add(i * shentsize);
        Ok((
            u32_at(h)? as usize,
            u32_at(h + 4)?,
            usize_at(h + 24)?,
            usize_at(h + 32)?,
            u32_at(h + 40)? as usize,
        ))
    };
    let c_str = |at: usize| -> std::result::Result<&str, String> {
        let tail = cubin.get(at..).ok_or("string offset out of bounds")?;
        let end = tail
            .iter()
            .position(|&c| c == 0)
            .ok_or("unterminated string")?;
        std::str::from_utf8(&tail[..end]).map_err(|_| "string is not UTF-8".to_string())
    };
    let names_at = section(shstrndx)?.2;
    let (mut info, mut symtab) = (None, None);
    for i in 0..shnum {
        let s = section(i)?;
        const SHT_SYMTAB: u32 = 2;
        if s.1 == SHT_SYMTAB {
            symtab = Some(s);
        } else if c_str(names_at.saturating_add(s.0))? == ".nv.info" {
            info = Some(s);
        }
    }
    let (_, _, info_at, info_size, _) = info.ok_or("no .nv.info section")?;
    let (_, _, sym_at, sym_size, strtab) = symtab.ok_or("no .symtab section")?;
    let strings_at = section(strtab)?.2;
    let symbol = |index: u32| -> std::result::Result<String, String> {
        const SYM_SIZE: usize = 24;
        let at = index as usize * SYM_SIZE;
        if at.saturating_add(SYM_SIZE) > sym_size {
            return Err(format!("symbol {index} outside .symtab"));
        }
        c_str(strings_at.saturating_add(u32_at(sym_at.saturating_add(at))? as usize))
            .map(str::to_string)
    };
    let mut out: Vec<CubinFunction> = Vec::new();
    let end = info_at.saturating_add(info_size);
    let mut p = info_at;
    while p.saturating_add(4) <= end {
        let (format, attribute) = (bytes(p, 1)?[0], bytes(p + 1, 1)?[0]);
        const EIFMT_SVAL: u8 = 4;
        if format != EIFMT_SVAL {
            p += 4;
            continue;
        }
        let size = usize::from(u16_at(p + 2)?);
        if size == 8 && (attribute == EIATTR_REGCOUNT || attribute == EIATTR_FRAME_SIZE) {
            let name = symbol(u32_at(p + 4)?)?;
            let value = u32_at(p + 8)?;
            let at = match out.iter().position(|f| f.name == name) {
                Some(at) => at,
                None => {
                    out.push(CubinFunction {
                        name,
                        registers: 0,
                        stack_frame: 0,
                    });
                    out.len() - 1
                }
            };
            if attribute == EIATTR_REGCOUNT {
                out[at].registers = value;
            } else {
                out[at].stack_frame = value;
            }
        }
        p += 4 + size;
    }
    Ok(out)
}

/// The on-disk cache directory: `$ARES_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ares/kernels`,
/// else `$HOME/.cache/ares/kernels`; `None` when none is set.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("ARES_KERNEL_CACHE") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("ares").join("kernels"))
}

/// 64-bit FNV-1a: a stable hash (unlike std's `DefaultHasher`) for cache keys.
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff; // separator, so ("ab","c") ≠ ("a","bc")
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Compiles for a device of compute capability `arch` (e.g. 90), preferring a CUBIN and
/// falling back to PTX, through the disk cache. Cache write failures are not fatal.
pub fn compile_cached(source_name: &'static str, source: &str, arch: u32) -> Result<Image> {
    let (major, minor) = nvrtc_version()?;
    let key = fnv1a(&[
        source.as_bytes(),
        BASE_OPTIONS.join(" ").as_bytes(),
        format!("nvrtc {major}.{minor} arch {arch}").as_bytes(),
    ]);
    let dir = cache_dir();
    for (ext, is_cubin) in [("cubin", true), ("ptx", false)] {
        if let Some(dir) = &dir {
            let path = dir.join(format!("{source_name}-{key:016x}.{ext}"));
            if let Ok(bytes) = std::fs::read(&path) {
                return Ok(if is_cubin {
                    Image::Cubin(bytes)
                } else {
                    Image::Ptx(String::from_utf8_lossy(&bytes).into_owned())
                });
            }
        }
    }
    let image = match compile_cubin(source_name, source, arch) {
        Ok(c) => c.image,
        Err(cubin_err) => match compile_ptx(source_name, source, arch) {
            Ok(c) => c.image,
            Err(_) => return Err(cubin_err),
        },
    };
    if let Some(dir) = dir {
        let (ext, bytes) = match &image {
            Image::Cubin(b) => ("cubin", b.as_slice()),
            Image::Ptx(p) => ("ptx", p.as_bytes()),
        };
        let path = dir.join(format!("{source_name}-{key:016x}.{ext}"));
        if let Err(e) = write_atomically(&path, bytes) {
            eprintln!("ares-cuda: warning: {}", Error::Cache { path, source: e });
        }
    }
    Ok(image)
}

fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_verbose_log() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'masked_dynamic_kl' for 'sm_90'\n\
ptxas info    : Function properties for masked_dynamic_kl\n\
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
ptxas info    : Used 30 registers, used 1 barriers, 129 bytes smem\n";
        assert_eq!(
            kernel_resources(log),
            vec![KernelResources {
                kernel: "masked_dynamic_kl".into(),
                registers: 30,
                spill_bytes: 8
            }]
        );
    }

    #[test]
    fn cubin_functions_refuses_what_is_not_a_cubin() {
        assert!(cubin_functions(b"").unwrap_err().contains("ELF64"));
        assert!(cubin_functions(b"PK\x03\x04 not an elf").is_err());
        // An ELF64 header cut short: an error naming the truncation, not a panic.
        let mut head = b"\x7fELF\x02\x01".to_vec();
        head.resize(0x30, 0);
        assert!(cubin_functions(&head).unwrap_err().contains("truncated"));
    }

    #[test]
    fn fnv_is_stable_and_separates_parts() {
        assert_eq!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"ab", b"c"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }
}
