//! The simulator's log, rate-limited: the guest decides how often the
//! device meets something worth a line (an unknown fault command, a
//! `sq_tail` beyond the ring, a failing copy), so an unlimited log lets a
//! guest write megabytes a second into the host's file. Like the kernel's
//! `printk_ratelimited`, at most `burst` lines pass per `interval`; the
//! rest are counted, and the count is printed with the next line that
//! passes (and by [`Log::flush`] at exit).

use std::fmt;
use std::io::Write;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::OnceLock;
use std::time::Duration;
use std::time::Instant;

/// Lines per interval that pass by default.
pub const BURST: u32 = 10;
/// The default interval.
pub const INTERVAL: Duration = Duration::from_secs(5);

struct State {
    out: Box<dyn Write + Send>,
    /// Start of the current window (None before the first line).
    window: Option<Instant>,
    /// Lines printed in the current window.
    printed: u32,
    /// Lines dropped since the last report.
    suppressed: u64,
    /// Lines dropped in all.
    suppressed_total: u64,
}

/// A rate-limited line log.
pub struct Log {
    state: Mutex<State>,
    interval: Duration,
    burst: u32,
}

impl Log {
    /// A log writing to `out`, letting `burst` lines through per `interval`.
    pub fn new(out: Box<dyn Write + Send>, interval: Duration, burst: u32) -> Log {
        Log {
            state: Mutex::new(State {
                out,
                window: None,
                printed: 0,
                suppressed: 0,
                suppressed_total: 0,
            }),
            interval,
            burst,
        }
    }

    /// Logs one line (without its newline), unless the rate is exceeded.
    pub fn line(&self, args: fmt::Arguments<'_>) {
        self.line_at(Instant::now(), args);
    }

    /// [`line`](Self::line) at time `now` (for tests).
    pub fn line_at(&self, now: Instant, args: fmt::Arguments<'_>) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = s
            .window
            .is_none_or(|w| now.saturating_duration_since(w) >= self.interval);
        if fresh {
            s.window = Some(now);
            s.printed = 0;
            Self::report(&mut s);
        }
        if s.printed >= self.burst {
            s.suppressed += 1;
            s.suppressed_total += 1;
            return;
        }
        s.printed += 1;
        let _ = writeln!(s.out, "{args}");
    }

    fn report(s: &mut State) {
        if s.suppressed > 0 {
            let n = std::mem::take(&mut s.suppressed);
            let _ = writeln!(s.out, "tdrv-sim: {n} log lines suppressed (rate limit)");
        }
    }

    /// Reports lines suppressed since the last report (call at exit).
    pub fn flush(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        Self::report(&mut s);
        let _ = s.out.flush();
    }

    /// Lines dropped since the log was created.
    pub fn suppressed_total(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .suppressed_total
    }
}

/// The process's log: stderr, [`BURST`] lines per [`INTERVAL`], shared by
/// every queue.
pub fn stderr() -> Arc<Log> {
    static LOG: OnceLock<Arc<Log>> = OnceLock::new();
    LOG.get_or_init(|| Arc::new(Log::new(Box::new(Stderr), INTERVAL, BURST)))
        .clone()
}

/// Standard error. In the crate's unit tests it goes through `eprint!`,
/// which libtest captures per test: written straight to the file, a line
/// of a queue thread could land inside the harness's own `test ... ok`
/// line when both streams go to one log, which then no longer counts.
/// (`eprint!` panics where a write fails, so the binary keeps the plain
/// writer, whose errors the log ignores.)
struct Stderr;

impl Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if cfg!(test) {
            eprint!("{}", String::from_utf8_lossy(buf));
            Ok(buf.len())
        } else {
            std::io::stderr().write(buf)
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// A sink for tests: what was written, shared with the test.
#[derive(Clone, Default)]
pub struct Captured(pub Arc<Mutex<Vec<u8>>>);

impl Captured {
    /// What was written so far, as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_lines_are_counted_and_reported() {
        let cap = Captured::default();
        let log = Log::new(Box::new(cap.clone()), Duration::from_secs(5), 3);
        let t0 = Instant::now();
        for i in 0..1000 {
            log.line_at(t0, format_args!("line {i}"));
        }
        assert_eq!(cap.text(), "line 0\nline 1\nline 2\n");
        assert_eq!(log.suppressed_total(), 997);
        // Still inside the window: nothing more.
        log.line_at(t0 + Duration::from_millis(4999), format_args!("late"));
        assert_eq!(cap.text().lines().count(), 3);
        // A new window: the count of dropped lines, then the line.
        log.line_at(t0 + Duration::from_secs(5), format_args!("next"));
        assert_eq!(
            cap.text(),
            "line 0\nline 1\nline 2\n\
             tdrv-sim: 998 log lines suppressed (rate limit)\nnext\n"
        );
        assert_eq!(log.suppressed_total(), 998);
    }

    #[test]
    fn flush_reports_what_was_dropped_once() {
        let cap = Captured::default();
        let log = Log::new(Box::new(cap.clone()), Duration::from_secs(5), 1);
        let t0 = Instant::now();
        log.line_at(t0, format_args!("a"));
        log.line_at(t0, format_args!("b"));
        log.line_at(t0, format_args!("c"));
        log.flush();
        log.flush();
        assert_eq!(
            cap.text(),
            "a\ntdrv-sim: 2 log lines suppressed (rate limit)\n"
        );
    }

    /// The child process of `lines_of_the_process_log_stay_inside_their_test`
    /// (which runs it with `--ignored`): logs one line through the
    /// process's log.
    #[test]
    #[ignore = "a child process of lines_of_the_process_log_stay_inside_their_test, not a check"]
    fn child_logs_a_line() {
        stderr().line(format_args!("tdrv-sim: a line from inside a test"));
    }

    /// A line of the process's log written during a passing test is
    /// captured with the test's output, not written to the process's
    /// standard error between the harness's lines.
    #[test]
    #[cfg_attr(miri, ignore = "Miri does not start processes")]
    fn lines_of_the_process_log_stay_inside_their_test() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "log::tests::child_logs_a_line",
                "--ignored",
                "--test-threads=1",
            ])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "child: {stdout} {stderr}");
        assert!(stdout.contains("1 passed"), "child ran nothing: {stdout}");
        assert!(
            !stderr.contains("a line from inside a test"),
            "stderr: {stderr}"
        );
        assert!(
            !stdout.contains("a line from inside a test"),
            "stdout: {stdout}"
        );
    }
}
