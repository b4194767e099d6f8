//! Diagnostics go to the [`log`] crate (target `tdrv`), where the
//! application's logger (env_logger, tracing-log, ...) picks them up; a
//! library prints nothing by itself. [`set_logger`] replaces that with a
//! function of the caller's (the C library uses it to print to stderr as
//! the runtime it reimplements did).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::Duration;

/// Severity of a log message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Errors.
    Error,
    /// Warnings.
    Warn,
    /// Information.
    Info,
    /// Debugging detail.
    Debug,
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Level::Error => "error",
            Level::Warn => "warning",
            Level::Info => "info",
            Level::Debug => "debug",
        })
    }
}

impl From<Level> for ::log::Level {
    fn from(l: Level) -> Self {
        match l {
            Level::Error => ::log::Level::Error,
            Level::Warn => ::log::Level::Warn,
            Level::Info => ::log::Level::Info,
            Level::Debug => ::log::Level::Debug,
        }
    }
}

/// A function that receives every log message.
pub type Logger = Box<dyn Fn(Level, &str) + Send + Sync>;

static LOGGER: RwLock<Option<Logger>> = RwLock::new(None);

/// Installs a function that receives every message instead of the `log`
/// crate (or, with `None`, sends them to the `log` crate again).
pub fn set_logger(logger: Option<Logger>) {
    *LOGGER.write().unwrap_or_else(|e| e.into_inner()) = logger;
}

pub(crate) fn log(level: Level, args: fmt::Arguments<'_>) {
    let guard = LOGGER.read().unwrap_or_else(|e| e.into_inner());
    match guard.as_ref() {
        Some(logger) => logger(level, &args.to_string()),
        None => ::log::log!(target: "tdrv", level.into(), "{args}"),
    }
}

macro_rules! log_warn {
    ($($arg:tt)*) => {
        $crate::log::log($crate::log::Level::Warn, format_args!($($arg)*))
    };
}
pub(crate) use log_warn;

const DEFAULT_HEARTBEAT_MS: u64 = 30_000;
static HEARTBEAT_MS: AtomicU64 = AtomicU64::new(DEFAULT_HEARTBEAT_MS);

/// Sets how often an unbounded wait logs that it is still waiting (30 s by
/// default, as in the original runtime). Meant for tests and tools.
pub fn set_heartbeat_interval(interval: Duration) {
    let ms = u64::try_from(interval.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    HEARTBEAT_MS.store(ms, Ordering::Relaxed);
}

pub(crate) fn heartbeat_interval() -> Duration {
    Duration::from_millis(HEARTBEAT_MS.load(Ordering::Relaxed))
}
