//! Progress of the long phases of training (bootstrap, rollout, update, eval) on stderr.
//!
//! On a terminal each phase gets an `indicatif` bar: phase name, `pos/len`, rate and ETA,
//! cleared when the phase ends. When stderr is not a terminal (CI logs, `2> file`) a bar
//! would be invisible or a mess of carriage returns, so a phase prints one plain line when
//! it ends (`[rollout] done 128/128 in 8.0s (16/s)`), and one more every 30 s while a long
//! phase runs. `ARES_NO_PROGRESS=1` silences both.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Environment variable that turns progress off when set to anything but `""` or `"0"`.
pub const NO_PROGRESS_ENV: &str = "ARES_NO_PROGRESS";

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// Live bars on stderr (stderr is a terminal).
    Bar,
    /// A line per phase, and one per 30 s of a long phase, on stderr (stderr is not a
    /// terminal).
    Log,
    /// Nothing.
    Off,
}

impl ProgressMode {
    /// The mode for this process: `Off` when [`NO_PROGRESS_ENV`] is set (and not `""` or
    /// `"0"`), else `Bar` on a terminal and `Log` otherwise.
    pub fn from_env() -> Self {
        let no_progress = std::env::var(NO_PROGRESS_ENV).ok();
        Self::choose(no_progress.as_deref(), std::io::stderr().is_terminal())
    }

    fn choose(no_progress: Option<&str>, stderr_is_terminal: bool) -> Self {
        match no_progress.map(str::trim) {
            Some(v) if !v.is_empty() && v != "0" => ProgressMode::Off,
            _ if stderr_is_terminal => ProgressMode::Bar,
            _ => ProgressMode::Log,
        }
    }
}

/// Makes one progress display per phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    mode: ProgressMode,
}

impl Progress {
    /// Progress in the mode of [`ProgressMode::from_env`].
    pub fn from_env() -> Self {
        Self::new(ProgressMode::from_env())
    }

    /// Progress in a given mode.
    pub fn new(mode: ProgressMode) -> Self {
        Self { mode }
    }

    /// The mode in use.
    pub fn mode(&self) -> ProgressMode {
        self.mode
    }

    /// Starts the display of a phase of `len` units (prompts, samples, micro-batches...).
    pub fn bar(&self, len: u64, phase: &str) -> PhaseBar {
        let display = match self.mode {
            ProgressMode::Bar => {
                Display::Bar(terminal_bar(len, phase, ProgressDrawTarget::stderr()))
            }
            ProgressMode::Log => Display::Log(Mutex::new(LogState::new(phase, len, Sink::Stderr))),
            ProgressMode::Off => Display::Off,
        };
        PhaseBar { display }
    }
}

/// The progress of one phase; advance it with [`PhaseBar::inc`] or
/// [`PhaseBar::set_position`] (from any thread), end it with [`PhaseBar::finish`] (or by
/// dropping it: a phase left early says where it stopped).
#[derive(Debug)]
pub struct PhaseBar {
    display: Display,
}

#[derive(Debug)]
enum Display {
    Bar(ProgressBar),
    Log(Mutex<LogState>),
    Off,
}

impl PhaseBar {
    /// Advances by `n` units.
    pub fn inc(&self, n: u64) {
        match &self.display {
            Display::Bar(bar) => bar.inc(n),
            Display::Log(state) => with(state, |s| s.update(s.pos.saturating_add(n))),
            Display::Off => {}
        }
    }

    /// Sets the number of units done.
    pub fn set_position(&self, pos: u64) {
        match &self.display {
            Display::Bar(bar) => bar.set_position(pos),
            Display::Log(state) => with(state, |s| s.update(pos)),
            Display::Off => {}
        }
    }

    /// Ends the phase: a bar is cleared; a log prints its closing line (once).
    pub fn finish(&self) {
        match &self.display {
            Display::Bar(bar) => bar.finish_and_clear(),
            Display::Log(state) => with(state, LogState::finish),
            Display::Off => {}
        }
    }
}

impl Drop for PhaseBar {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Runs `f` on the log state; a poisoned lock (a panic elsewhere mid-print) still prints.
fn with(state: &Mutex<LogState>, f: impl FnOnce(&mut LogState)) {
    let mut guard = state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    f(&mut guard);
}

/// A bar showing `phase [=====>    ] pos/len rate eta`.
fn terminal_bar(len: u64, phase: &str, target: ProgressDrawTarget) -> ProgressBar {
    const TEMPLATE: &str = "{prefix:>12} [{bar:30}] {pos}/{len} {per_sec:1} eta {eta} {msg}";
    // The template is a constant known to parse; the default style is only a fallback.
    let style = ProgressStyle::with_template(TEMPLATE)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    ProgressBar::with_draw_target(Some(len), target)
        .with_style(style)
        .with_prefix(phase.to_string())
}

/// Where log lines go.
#[derive(Debug)]
enum Sink {
    Stderr,
    #[cfg(test)]
    Memory(std::sync::Arc<Mutex<Vec<String>>>),
}

impl Sink {
    fn line(&self, text: &str) {
        match self {
            // Progress is best effort: a closed stderr must not stop training.
            Sink::Stderr => {
                let _ = writeln!(std::io::stderr().lock(), "{text}");
            }
            #[cfg(test)]
            Sink::Memory(lines) => {
                if let Ok(mut lines) = lines.lock() {
                    lines.push(text.to_string());
                }
            }
        }
    }
}

/// How often a long phase reports while it runs, off a terminal.
const LOG_INTERVAL: Duration = Duration::from_secs(30);

/// The non-terminal display: a closing line, and a progress line per `interval`.
#[derive(Debug)]
struct LogState {
    phase: String,
    len: u64,
    pos: u64,
    finished: bool,
    start: Instant,
    /// When the last line was printed (the start before the first).
    last_line: Instant,
    interval: Duration,
    sink: Sink,
}

impl LogState {
    fn new(phase: &str, len: u64, sink: Sink) -> Self {
        Self::with_interval(phase, len, sink, LOG_INTERVAL)
    }

    fn with_interval(phase: &str, len: u64, sink: Sink, interval: Duration) -> Self {
        let now = Instant::now();
        Self {
            phase: phase.to_string(),
            len,
            pos: 0,
            finished: false,
            start: now,
            last_line: now,
            interval,
            sink,
        }
    }

    fn update(&mut self, pos: u64) {
        self.pos = pos;
        if self.finished {
            return;
        }
        if pos >= self.len {
            self.finish();
            return;
        }
        if self.last_line.elapsed() >= self.interval {
            self.last_line = Instant::now();
            let line = progress_line(&self.phase, pos, self.len, self.start.elapsed());
            self.sink.line(&line);
        }
    }

    fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let line = closing_line(&self.phase, self.pos, self.len, self.start.elapsed());
        self.sink.line(&line);
    }
}

/// `[rollout] 30/100 (30%) 12.5/s eta 6s`.
fn progress_line(phase: &str, pos: u64, len: u64, elapsed: Duration) -> String {
    let seconds = elapsed.as_secs_f64();
    let percent = u128::from(pos.min(len)) * 100 / u128::from(len.max(1));
    let mut line = format!("[{phase}] {pos}/{len} ({percent}%)");
    if seconds > 0.0 && pos > 0 {
        let rate = pos as f64 / seconds;
        let eta = len.saturating_sub(pos) as f64 / rate;
        line.push_str(&format!(" {} eta {}", rate_text(rate), duration_text(eta)));
    }
    line
}

/// `[rollout] done 100/100 in 8.0s (12.5/s)`, or `[rollout] stopped at 37/100 after 3.0s`.
fn closing_line(phase: &str, pos: u64, len: u64, elapsed: Duration) -> String {
    let seconds = elapsed.as_secs_f64();
    if pos >= len {
        let mut line = format!("[{phase}] done {pos}/{len} in {}", duration_text(seconds));
        if seconds > 0.0 && pos > 0 {
            line.push_str(&format!(" ({})", rate_text(pos as f64 / seconds)));
        }
        line
    } else {
        format!(
            "[{phase}] stopped at {pos}/{len} after {}",
            duration_text(seconds)
        )
    }
}

/// `12.5/s`, `0.25/s`, `1234/s`.
fn rate_text(per_second: f64) -> String {
    if per_second >= 100.0 {
        format!("{per_second:.0}/s")
    } else if per_second >= 1.0 {
        format!("{per_second:.1}/s")
    } else {
        format!("{per_second:.2}/s")
    }
}

/// `8.0s`, `1m05s`, `2h03m`.
fn duration_text(seconds: f64) -> String {
    if !seconds.is_finite() {
        return "?".to_string();
    }
    if seconds < 60.0 {
        return format!("{seconds:.1}s");
    }
    let whole = seconds.round() as u64;
    if whole < 3600 {
        format!("{}m{:02}s", whole / 60, whole % 60)
    } else {
        format!("{}h{:02}m", whole / 3600, whole % 3600 / 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn log_bar(len: u64, phase: &str) -> (PhaseBar, Arc<Mutex<Vec<String>>>) {
        log_bar_every(len, phase, LOG_INTERVAL)
    }

    fn log_bar_every(
        len: u64,
        phase: &str,
        interval: Duration,
    ) -> (PhaseBar, Arc<Mutex<Vec<String>>>) {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let state = LogState::with_interval(phase, len, Sink::Memory(Arc::clone(&lines)), interval);
        let bar = PhaseBar {
            display: Display::Log(Mutex::new(state)),
        };
        (bar, lines)
    }

    fn taken(lines: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
        std::mem::take(&mut *lines.lock().unwrap())
    }

    #[test]
    fn mode_from_environment_values() {
        assert_eq!(ProgressMode::choose(None, true), ProgressMode::Bar);
        assert_eq!(ProgressMode::choose(None, false), ProgressMode::Log);
        assert_eq!(ProgressMode::choose(Some("1"), true), ProgressMode::Off);
        assert_eq!(ProgressMode::choose(Some("1"), false), ProgressMode::Off);
        assert_eq!(ProgressMode::choose(Some("0"), true), ProgressMode::Bar);
        assert_eq!(ProgressMode::choose(Some(""), false), ProgressMode::Log);
    }

    #[test]
    fn a_phase_prints_one_line_when_done() {
        let (bar, lines) = log_bar(25, "rollout");
        for _ in 0..25 {
            bar.inc(1);
        }
        let got = taken(&lines);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].starts_with("[rollout] done 25/25 in "), "{got:?}");
        // Finishing (and dropping) after done prints nothing more.
        bar.finish();
        drop(bar);
        assert!(taken(&lines).is_empty());
    }

    #[test]
    fn a_long_phase_reports_each_interval_and_early_end_says_stopped() {
        // an interval of 0: every update of a running phase is a report
        let (bar, lines) = log_bar_every(100, "update", Duration::ZERO);
        bar.set_position(45);
        bar.set_position(46);
        let got = taken(&lines);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].starts_with("[update] 45/100 (45%)"), "{got:?}");
        drop(bar);
        let got = taken(&lines);
        assert_eq!(got.len(), 1);
        assert!(
            got[0].starts_with("[update] stopped at 46/100 after "),
            "{got:?}"
        );
        // the default interval: nothing until the end
        let (bar, lines) = log_bar(100, "update");
        bar.set_position(99);
        assert!(taken(&lines).is_empty());
    }

    #[test]
    fn empty_phase_prints_only_done() {
        let (bar, lines) = log_bar(0, "eval");
        bar.inc(0);
        bar.finish();
        let got = taken(&lines);
        assert_eq!(got.len(), 1);
        assert!(got[0].starts_with("[eval] done 0/0 in "), "{got:?}");
    }

    #[test]
    fn line_texts() {
        let line = progress_line("rollout", 30, 100, Duration::from_secs(12));
        assert_eq!(line, "[rollout] 30/100 (30%) 2.5/s eta 28.0s");
        assert_eq!(
            closing_line("rollout", 100, 100, Duration::from_secs(8)),
            "[rollout] done 100/100 in 8.0s (12.5/s)"
        );
        assert_eq!(duration_text(65.0), "1m05s");
        assert_eq!(duration_text(7380.0), "2h03m");
        assert_eq!(rate_text(1234.4), "1234/s");
        assert_eq!(rate_text(0.25), "0.25/s");
    }

    /// A terminal that keeps what is written to it.
    #[derive(Debug, Default)]
    struct Screen(Mutex<String>);

    impl indicatif::TermLike for Screen {
        fn width(&self) -> u16 {
            120
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            if let Ok(mut text) = self.0.lock() {
                text.push_str(s);
                text.push('\n');
            }
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[derive(Debug, Clone, Default)]
    struct SharedScreen(Arc<Screen>);

    impl indicatif::TermLike for SharedScreen {
        fn width(&self) -> u16 {
            self.0.width()
        }
        fn move_cursor_up(&self, n: usize) -> std::io::Result<()> {
            self.0.move_cursor_up(n)
        }
        fn move_cursor_down(&self, n: usize) -> std::io::Result<()> {
            self.0.move_cursor_down(n)
        }
        fn move_cursor_right(&self, n: usize) -> std::io::Result<()> {
            self.0.move_cursor_right(n)
        }
        fn move_cursor_left(&self, n: usize) -> std::io::Result<()> {
            self.0.move_cursor_left(n)
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.0.write_line(s)
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            self.0.write_str(s)
        }
        fn clear_line(&self) -> std::io::Result<()> {
            self.0.clear_line()
        }
        fn flush(&self) -> std::io::Result<()> {
            self.0.flush()
        }
    }

    #[test]
    fn terminal_bar_shows_phase_position_rate_and_eta() {
        let screen = SharedScreen::default();
        let bar = terminal_bar(
            10,
            "bootstrap",
            ProgressDrawTarget::term_like(Box::new(screen.clone())),
        );
        bar.set_position(3);
        bar.force_draw();
        let text = screen.0.0.lock().unwrap().clone();
        assert!(text.contains("bootstrap"), "{text}");
        assert!(text.contains("3/10"), "{text}");
        assert!(text.contains("/s") && text.contains("eta"), "{text}");
    }
}
