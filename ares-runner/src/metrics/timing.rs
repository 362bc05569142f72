//! Wall-clock time per phase of a training step.

use std::time::{Duration, Instant};

use super::Record;

/// Seconds spent in each named phase of one step ("bootstrap", "rollout", "reward",
/// "old_log_prob", "ref", "update", ...), in the order the phases first ran.
///
/// A phase timed twice in a step (re-generation while filtering, several PPO epochs) adds
/// up. [`PhaseTimes::write_to`] puts each phase into a record as `time/<phase>`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PhaseTimes {
    phases: Vec<(String, f64)>,
}

impl PhaseTimes {
    /// No phase timed yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `elapsed` to `phase`.
    pub fn add(&mut self, phase: &str, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        match self.phases.iter_mut().find(|(name, _)| name == phase) {
            Some((_, total)) => *total += seconds,
            None => self.phases.push((phase.to_string(), seconds)),
        }
    }

    /// Runs `f`, adds its wall-clock time to `phase`, and returns its result (also when the
    /// result is an error: the time was spent).
    pub fn time<T>(&mut self, phase: &str, f: impl FnOnce() -> T) -> T {
        let timer = Timer::start();
        let out = f();
        timer.stop(self, phase);
        out
    }

    /// Seconds recorded for `phase`.
    pub fn get(&self, phase: &str) -> Option<f64> {
        self.phases
            .iter()
            .find(|(name, _)| name == phase)
            .map(|&(_, s)| s)
    }

    /// Seconds over all phases.
    pub fn total(&self) -> f64 {
        self.phases.iter().map(|&(_, s)| s).sum()
    }

    /// `(phase, seconds)` in first-run order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, f64)> {
        self.phases.iter().map(|(name, s)| (name.as_str(), *s))
    }

    /// Sets `time/<phase>` in `record` for every phase.
    pub fn write_to(&self, record: &mut Record) {
        for (name, seconds) in &self.phases {
            record.insert(format!("time/{name}"), *seconds);
        }
    }

    /// Forgets all phases (for the next step).
    pub fn clear(&mut self) {
        self.phases.clear();
    }
}

/// A started stopwatch.
#[derive(Debug, Clone, Copy)]
pub struct Timer {
    start: Instant,
}

impl Timer {
    /// Starts now.
    pub fn start() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    /// Time since [`Timer::start`].
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Adds the elapsed time to `phase` of `times`; returns it in seconds.
    pub fn stop(self, times: &mut PhaseTimes, phase: &str) -> f64 {
        let elapsed = self.elapsed();
        times.add(phase, elapsed);
        elapsed.as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_phases_add_up_and_keep_first_order() {
        let mut t = PhaseTimes::new();
        t.add("rollout", Duration::from_millis(1500));
        t.add("update", Duration::from_millis(250));
        t.add("rollout", Duration::from_millis(500));
        assert_eq!(t.get("rollout"), Some(2.0));
        assert_eq!(t.get("update"), Some(0.25));
        assert_eq!(t.get("ref"), None);
        assert_eq!(t.total(), 2.25);
        let names: Vec<&str> = t.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["rollout", "update"]);

        let mut r = Record::with_step(1);
        t.write_to(&mut r);
        let text = serde_json::to_string(r.as_map()).unwrap();
        assert_eq!(text, r#"{"step":1,"time/rollout":2.0,"time/update":0.25}"#);

        t.clear();
        assert_eq!(t.total(), 0.0);
    }

    #[test]
    fn time_returns_the_result_and_measures_at_least_the_sleep() {
        let mut t = PhaseTimes::new();
        let out: Result<u32, String> = t.time("reward", || {
            std::thread::sleep(Duration::from_millis(20));
            Err("grader failed".into())
        });
        assert_eq!(out, Err("grader failed".to_string()));
        let s = t.get("reward").unwrap();
        assert!((0.02..5.0).contains(&s), "{s}");
    }
}
