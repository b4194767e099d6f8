//! Shared pieces of the guest test programs: a kselftest-style TAP 13
//! reporter and raw access to a tdrv device node.
//!
//! Exit codes follow kselftest: 0 all passed, 1 something failed, 4 the
//! whole program was skipped (feature absent).

pub mod raw;

use std::fmt::Display;

/// kselftest exit code for a skipped program.
pub const KSFT_SKIP: i32 = 4;

/// A TAP 13 reporter. Every check prints one `ok`/`not ok` line at once, so
/// a guest that dies mid-run still leaves a readable log.
pub struct Tap {
    planned: usize,
    run: usize,
    failed: usize,
}

impl Tap {
    /// Prints the header and the plan.
    pub fn new(planned: usize) -> Self {
        println!("TAP version 13");
        println!("1..{planned}");
        Tap {
            planned,
            run: 0,
            failed: 0,
        }
    }

    /// Records one test: `outcome` is a bool or a `Result` whose error says why.
    pub fn check(&mut self, name: &str, outcome: impl Outcome) {
        self.run += 1;
        match outcome.into_result() {
            Ok(()) => println!("ok {} {name}", self.run),
            Err(why) => {
                self.failed += 1;
                println!("not ok {} {name}", self.run);
                for line in why.lines() {
                    println!("# {line}");
                }
            }
        }
    }

    /// Runs one test body and records its outcome.
    pub fn run(&mut self, name: &str, body: impl FnOnce() -> Result<(), String>) {
        self.check(name, body());
    }

    /// Records a test that cannot run here, with the reason.
    pub fn skip(&mut self, name: &str, reason: &str) {
        self.run += 1;
        println!("ok {} {name} # SKIP {reason}", self.run);
    }

    /// Prints a diagnostic line.
    pub fn note(&self, msg: impl Display) {
        println!("# {msg}");
    }

    /// Prints the totals and exits with the kselftest status. Tests that were
    /// planned but never reported count as failures.
    pub fn finish(self) -> ! {
        let missing = self.planned.saturating_sub(self.run);
        let extra = self.run.saturating_sub(self.planned);
        if missing > 0 || extra > 0 {
            println!("# plan was {} but {} tests ran", self.planned, self.run);
        }
        let failed = self.failed + missing + extra;
        println!("# Totals: pass:{} fail:{failed}", self.run - self.failed);
        std::process::exit(if failed == 0 { 0 } else { 1 })
    }
}

/// What a test check can return.
pub trait Outcome {
    fn into_result(self) -> Result<(), String>;
}

impl Outcome for bool {
    fn into_result(self) -> Result<(), String> {
        if self {
            Ok(())
        } else {
            Err("check was false".into())
        }
    }
}

impl<E: Display> Outcome for Result<(), E> {
    fn into_result(self) -> Result<(), String> {
        self.map_err(|e| e.to_string())
    }
}

/// Turns a raw call's errno into a message naming the step.
pub fn ok<T>(what: &str, r: Result<T, raw::Errno>) -> Result<T, String> {
    r.map_err(|e| {
        format!(
            "{what}: errno {e} ({})",
            std::io::Error::from_raw_os_error(e)
        )
    })
}

/// Passes only if `got` failed with exactly `want`.
pub fn expect_err<T: std::fmt::Debug>(
    what: &str,
    got: Result<T, raw::Errno>,
    want: raw::Errno,
) -> Result<(), String> {
    match got {
        Err(e) if e == want => Ok(()),
        other => Err(format!("{what}: got {other:?}, want Err({want})")),
    }
}

/// Opens the device named by the first argument (default `default`). If it
/// cannot be opened, or `wanted_kind` is given and differs, prints a
/// skipped TAP plan and exits with the kselftest skip code.
pub fn open_device_or_skip(
    default: &str,
    wanted_kind: Option<u32>,
) -> (raw::Dev, String, tdrv_uapi::tdrv_version) {
    let path = std::env::args().nth(1).unwrap_or_else(|| default.into());
    let opened = raw::Dev::open(&path).and_then(|d| d.version().map(|v| (d, v)));
    match opened {
        Ok((dev, v)) if wanted_kind.is_none_or(|k| k == v.device_kind) => (dev, path, v),
        Ok(_) => skip_all(&format!(
            "{path} is not the kind of device this program tests"
        )),
        Err(e) => skip_all(&format!("cannot open {path}: errno {e}")),
    }
}

fn skip_all(reason: &str) -> ! {
    println!("TAP version 13\n1..0 # SKIP {reason}");
    std::process::exit(KSFT_SKIP)
}

/// Fails with a message naming both values when they differ.
pub fn expect_eq<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: T,
    want: T,
) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, want {want:?}"))
    }
}
