//! A test re-run in a child process whose address space is capped (`ulimit -v`) and whose
//! peak resident memory is measured: a limit that refuses a hostile input "before any large
//! allocation" is then checked, not trusted. A refused 100 GB tensor or 30 GB image must not
//! even be reserved; a capped template output must not be resident past its cap.
//!
//! Use it as a test's first statement:
//! ```ignore
//! #[test]
//! fn huge_images_are_refused() {
//!     let Some(_peak) = ares_tests::bounded::rerun(
//!         "huge_images_are_refused",
//!         Bounds { address_space_mib: 4096, peak_rss_mib: 64 },
//!     ) else {
//!         return; // the parent: the child ran the body under the bounds, and passed
//!     };
//!     // the body
//! }
//! ```
//! Linux only (it reads `/proc/self/status`); elsewhere the body runs in-process, unchecked.

use std::process::Command;

/// Set in the child, where the body runs.
const CHILD: &str = "ARES_BOUNDED_CHILD";
const REPORT: &str = "ares-bounded:";

/// What the child may use.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// The whole process's virtual address space (the test harness and its threads take
    /// a few hundred MiB of it): an allocation past it fails, and the child aborts.
    pub address_space_mib: u64,
    /// Resident memory the body may add to what the process held when it began.
    pub peak_rss_mib: u64,
}

/// Runs `test` (this test binary's test of that exact name) again in a child under
/// `bounds` and returns `None` once it passed; in that child, or where the platform cannot
/// measure, returns the guard under which the test's body runs.
///
/// # Panics
/// When the child fails, or stays past the bounds.
#[must_use]
pub fn rerun(test: &str, bounds: Bounds) -> Option<Peak> {
    if std::env::var_os(CHILD).is_some() || !cfg!(target_os = "linux") {
        return Some(Peak::start());
    }
    if status_kib("VmHWM").is_none() {
        return Some(Peak::start());
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new("sh")
        .args(["-c", r#"ulimit -v "$1" && shift && exec "$@""#, "sh"])
        .arg((bounds.address_space_mib << 10).to_string())
        .arg(&exe)
        .args([test, "--exact", "--test-threads=1", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .expect("running the test binary again");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "`{test}` failed in a child limited to {} MiB of address space ({}):\n{text}",
        bounds.address_space_mib,
        out.status
    );
    assert!(
        text.contains("1 passed"),
        "the child ran no test named `{test}`:\n{text}"
    );
    let added_kib: u64 = text
        .lines()
        .find_map(|l| l.split_once(REPORT))
        .and_then(|(_, n)| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("`{test}`'s child printed no peak:\n{text}"));
    eprintln!(
        "{test}: peak resident memory {:.1} MiB over the start (bound {} MiB), address \
         space under {} MiB",
        added_kib as f64 / 1024.0,
        bounds.peak_rss_mib,
        bounds.address_space_mib
    );
    assert!(
        added_kib <= bounds.peak_rss_mib << 10,
        "`{test}` took {added_kib} KiB of resident memory over its start, more than {} MiB",
        bounds.peak_rss_mib
    );
    None
}

/// Measures the child's peak resident memory from its creation to its drop, and prints it
/// for the parent.
pub struct Peak {
    start_kib: Option<u64>,
}

impl Peak {
    fn start() -> Self {
        let mut peak = Self { start_kib: None };
        peak.restart();
        peak
    }

    /// The peak resident memory since the start (or [`Peak::restart`]), in KiB: `None` where
    /// it cannot be measured (not Linux, or the parent process).
    pub fn added_kib(&self) -> Option<u64> {
        let start = self.start_kib?;
        Some(status_kib("VmHWM")?.saturating_sub(start))
    }

    /// Counts from here: what the test built before (its inputs) is not the body's peak.
    pub fn restart(&mut self) {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        // "5" resets the peak (VmHWM) to the present resident size (Linux ≥ 4.0); where that
        // is not allowed, the peak counts from the process's start, which only overstates.
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        self.start_kib = status_kib("VmRSS");
    }
}

impl Drop for Peak {
    fn drop(&mut self) {
        if let (Some(start), Some(peak)) = (self.start_kib, status_kib("VmHWM")) {
            println!("{REPORT} {}", peak.saturating_sub(start));
        }
    }
}

/// A `kB` field of `/proc/self/status`.
fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.trim().strip_suffix("kB")?.trim().parse().ok()
    })
}
