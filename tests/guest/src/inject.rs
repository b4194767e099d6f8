//! The driver's fault injection, debugfs `/sys/kernel/debug/tdrv/<node>/inject`
//! (docs/kernels.md): the commands, the engine hold, each engine's
//! injectable job failure and the sim watchdog's timeout.

use crate::{expect_eq, stat};

/// The fault-injection file of the device at `node` (`/dev/tdrvN` or
/// `tdrvN`).
pub fn inject_file(node: &str) -> String {
    format!(
        "/sys/kernel/debug/tdrv/{}/inject",
        node.rsplit('/').next().unwrap_or(node)
    )
}

/// Writes the fault-injection command `cmd` for the device at `node`.
pub fn inject(node: &str, cmd: &str) -> Result<(), String> {
    std::fs::write(inject_file(node), cmd).map_err(|e| format!("inject {cmd}: {e}"))
}

/// The device's engine holding jobs (`hold_job`): the next job it would
/// start stays queued, and so does every later one, until this is dropped
/// (`release`).
pub struct Hold<'a>(&'a str);

impl<'a> Hold<'a> {
    /// Holds the engine of the device at `node`.
    pub fn new(node: &'a str) -> Result<Self, String> {
        inject(node, "hold_job")?;
        Ok(Hold(node))
    }

    /// Why the engine of `node` cannot be held here, if it cannot.
    pub fn unavailable(node: &str) -> Option<String> {
        let file = inject_file(node);
        (!std::path::Path::new(&file).exists()).then(|| format!("no {file} (debugfs)"))
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        if let Err(e) = inject(self.0, "release") {
            println!("# {e}");
        }
    }
}

/// Each engine's injectable job failure and the errno it ends the job
/// with: the software and sim engines fail the next job with EIO
/// (`fail_job`), edu's stuck chunk ends it with ETIMEDOUT after its
/// watchdog (`stall`).
pub fn failure_injection(edu: bool) -> (&'static str, i32) {
    if edu {
        ("stall", libc::ETIMEDOUT)
    } else {
        ("fail_job", libc::EIO)
    }
}

/// The sim device's watchdog timeout set for as long as this lives, then
/// back to what it was (debugfs `inject`: `watchdog_ms N`; the value is
/// the `watchdog_ms` line of the stats).
///
/// The test guests load tdrv with a long `sim_timeout_ms` (30 s,
/// `scripts/guest`): a host too busy to run `tdrv-sim` for a while then
/// slows a check down instead of failing it through a reset. The checks
/// that make the watchdog fire (stalls, hangs) take the product's
/// default, 2 s, with this.
pub struct SimWatchdog {
    node: String,
    restore: u64,
}

impl SimWatchdog {
    /// The product's default timeout, `sim_timeout_ms`.
    pub const DEFAULT_MS: u32 = 2000;

    /// Sets the watchdog of the sim device at `node` to `ms`.
    pub fn set(node: &str, ms: u32) -> Result<Self, String> {
        let restore = stat(node, "watchdog_ms")?;
        inject(node, &format!("watchdog_ms {ms}"))?;
        expect_eq(
            "watchdog_ms after setting it",
            stat(node, "watchdog_ms")?,
            u64::from(ms),
        )?;
        Ok(SimWatchdog {
            node: node.to_owned(),
            restore,
        })
    }
}

impl Drop for SimWatchdog {
    fn drop(&mut self) {
        if let Err(e) = inject(&self.node, &format!("watchdog_ms {}", self.restore)) {
            println!("# could not restore the watchdog: {e}");
        }
    }
}
