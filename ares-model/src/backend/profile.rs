//! `ARES_PROFILE=1`: the time of every backend op, summed per op and printed as a table at
//! the end of a command (`Backend::op_profile`), so one run shows where a step's time goes
//! without a profiler installed. On the CPU each op runs to its end before it returns, so a
//! clock around the call is its time; on CUDA a pair of events on the backend's stream
//! brackets each op (read back in batches, so the device is not waited on after every op).
//! Profiling adds a little work per op (two clock reads, or two events), and on CUDA it turns
//! graph capture off (a replayed graph would hide its ops).

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Whether `ARES_PROFILE` asks for op times (`1`, `true` or `yes`), read once.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("ARES_PROFILE")
            .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
    })
}

/// Calls and seconds per op.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpTimes {
    by_op: BTreeMap<&'static str, (u64, f64)>,
}

impl OpTimes {
    /// Adds one call of `op` that took `seconds`.
    pub fn add(&mut self, op: &'static str, seconds: f64) {
        let e = self.by_op.entry(op).or_insert((0, 0.0));
        e.0 += 1;
        e.1 += seconds;
    }

    /// Calls and seconds of `op` so far.
    pub fn get(&self, op: &str) -> Option<(u64, f64)> {
        self.by_op.get(op).copied()
    }

    /// Whether nothing was timed.
    pub fn is_empty(&self) -> bool {
        self.by_op.is_empty()
    }

    /// The ops by total time, longest first: calls, total, mean per call and share of the
    /// sum of all ops' times (`where`: the device, for the heading).
    pub fn table(&self, place: &str) -> String {
        let total: f64 = self.by_op.values().map(|v| v.1).sum();
        let mut rows: Vec<_> = self.by_op.iter().collect();
        rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1).then(a.0.cmp(b.0)));
        let mut out = format!(
            "op times ({place}, ARES_PROFILE): {total:.3} s in {} calls\n  {:<32} {:>9} {:>11} {:>11} {:>6}\n",
            self.by_op.values().map(|v| v.0).sum::<u64>(),
            "op",
            "calls",
            "total ms",
            "mean µs",
            "share"
        );
        for (op, &(calls, secs)) in rows {
            out.push_str(&format!(
                "  {op:<32} {calls:>9} {:>11.1} {:>11.1} {:>5.1}%\n",
                secs * 1e3,
                secs * 1e6 / calls.max(1) as f64,
                if total > 0.0 {
                    100.0 * secs / total
                } else {
                    0.0
                }
            ));
        }
        out
    }
}

/// The CPU backend's times (it has no state of its own: one table a process).
static CPU_TIMES: Mutex<OpTimes> = Mutex::new(OpTimes {
    by_op: BTreeMap::new(),
});

/// Times one CPU op from its creation to its drop, when profiling is on.
pub(crate) struct CpuTimer {
    op: &'static str,
    start: Instant,
}

impl CpuTimer {
    /// A timer for `op`, or `None` when profiling is off.
    pub(crate) fn start(op: &'static str) -> Option<Self> {
        enabled().then(|| Self {
            op,
            start: Instant::now(),
        })
    }
}

impl Drop for CpuTimer {
    fn drop(&mut self) {
        let secs = self.start.elapsed().as_secs_f64();
        CPU_TIMES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(self.op, secs);
    }
}

/// The CPU's table, if profiling is on.
pub(crate) fn cpu_table() -> Option<String> {
    enabled().then(|| {
        CPU_TIMES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .table("CPU")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sums per op, rows longest first, shares of the whole.
    #[test]
    fn times_add_up_per_op_and_sort_by_total() {
        let mut t = OpTimes::default();
        assert!(t.is_empty());
        t.add("linear", 0.002);
        t.add("attention", 0.001);
        t.add("linear", 0.004);
        assert_eq!(t.get("linear"), Some((2, 0.006)));
        let table = t.table("CPU");
        assert!(
            table.starts_with("op times (CPU, ARES_PROFILE): 0.007 s in 3 calls"),
            "{table}"
        );
        let lines: Vec<&str> = table.lines().collect();
        assert!(
            lines[2].contains("linear") && lines[2].contains("85.7%"),
            "{table}"
        );
        assert!(lines[2].contains("3000.0"), "mean µs: {table}");
        assert!(
            lines[3].contains("attention") && lines[3].contains("14.3%"),
            "{table}"
        );
    }
}
