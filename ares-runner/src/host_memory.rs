//! The memory this machine lets a run use: what the trainer's memory check and the data
//! loader compare their needs with.

use std::path::Path;

/// The memory this process may use, and where that figure comes from: the smaller of
/// `/proc/meminfo`'s `MemAvailable` and the cgroup's limit less its usage (a container's
/// limit is not in `MemAvailable`), or `ARES_MEMORY_LIMIT` (bytes, or with a `G`/`M`
/// suffix) when set. `None` where neither is known (not Linux).
///
/// # Errors
/// An `ARES_MEMORY_LIMIT` that is not a size.
pub fn available_host_memory() -> Result<Option<(u64, String)>, String> {
    if let Ok(text) = std::env::var("ARES_MEMORY_LIMIT") {
        return parse_size(&text)
            .map(|b| Some((b, "ARES_MEMORY_LIMIT".to_string())))
            .ok_or_else(|| {
                format!("ARES_MEMORY_LIMIT={text:?} is not a size (bytes, or a number with G or M)")
            });
    }
    let mut best: Option<(u64, String)> = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| meminfo_kib(&m, "MemAvailable"))
        .map(|kib| {
            (
                kib.saturating_mul(1024),
                "MemAvailable in /proc/meminfo".into(),
            )
        });
    let cgroup = Path::new("/sys/fs/cgroup");
    let read = |name: &str| std::fs::read_to_string(cgroup.join(name)).ok();
    if let (Some(max), Some(current)) = (read("memory.max"), read("memory.current"))
        && let (Ok(max), Ok(current)) = (max.trim().parse::<u64>(), current.trim().parse::<u64>())
    {
        let left = max.saturating_sub(current);
        if best.as_ref().is_none_or(|(b, _)| left < *b) {
            best = Some((left, "the cgroup's memory.max less memory.current".into()));
        }
    }
    Ok(best)
}

fn meminfo_kib(meminfo: &str, field: &str) -> Option<u64> {
    meminfo.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.trim().strip_suffix("kB")?.trim().parse().ok()
    })
}

/// `123`, `64G`, `512M` (binary units).
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let (digits, shift) = match t.as_bytes().last()? {
        b'G' | b'g' => (&t[..t.len() - 1], 30),
        b'M' | b'm' => (&t[..t.len() - 1], 20),
        _ => (t, 0),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// `bytes` for a message, in the largest binary unit that keeps it at least 1 (one
/// decimal): `512 B`, `3.5 KiB`, `1.2 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Big buffers go back to the system when freed. glibc's malloc raises its mmap threshold
/// (up to 32 MiB) after a large free, so later multi-MiB buffers — a layer's decode
/// weights, an arena's tensors — come from the heap and stay resident after they are
/// freed: one phase's memory would stay with the next. A fixed 1 MiB threshold keeps each
/// in its own mapping, released with it, so the process holds what the memory plan counts.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn release_big_buffers() {
    unsafe extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    const M_MMAP_THRESHOLD: i32 = -3;
    // SAFETY: mallopt only sets an allocator parameter; called before any thread starts.
    unsafe {
        mallopt(M_MMAP_THRESHOLD, 1 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_big_buffers() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3584), "3.5 KiB");
        assert_eq!(human_bytes(5 << 30), "5.0 GiB");
        assert_eq!(human_bytes(3 << 40), "3.0 TiB");
        assert_eq!(human_bytes(5000 << 40), "5000.0 TiB");
    }

    #[test]
    fn sizes_parse_in_binary_units() {
        assert_eq!(parse_size("1024"), Some(1024));
        assert_eq!(parse_size("64G"), Some(64 << 30));
        assert_eq!(parse_size(" 512m "), Some(512 << 20));
        assert_eq!(parse_size("G"), None);
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("99999999999999999999G"), None);
        assert_eq!(parse_size(&format!("{}G", u64::MAX >> 10)), None);
    }

    #[test]
    fn meminfo_reads_its_field() {
        let m = "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_kib(m, "MemAvailable"), Some(20_000_000));
        assert_eq!(meminfo_kib(m, "SwapFree"), None);
    }
}
