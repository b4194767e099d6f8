//! Time-outs in the ABI's convention: microseconds, 0 polls, negative waits
//! without limit.

use std::time::{Duration, Instant};

/// When a wait gives up.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Deadline {
    /// Check once, do not wait.
    Poll,
    /// Wait until this instant.
    At(Instant),
    /// Wait without limit.
    Never,
}

impl Deadline {
    pub(crate) fn from_timeout_us(timeout_us: i64) -> Self {
        match timeout_us {
            t if t < 0 => Deadline::Never,
            0 => Deadline::Poll,
            t => Instant::now()
                .checked_add(Duration::from_micros(t.unsigned_abs()))
                .map_or(Deadline::Never, Deadline::At),
        }
    }

    /// Time left: `None` without limit, `Some(ZERO)` when expired.
    pub(crate) fn remaining(&self) -> Option<Duration> {
        match self {
            Deadline::Poll => Some(Duration::ZERO),
            Deadline::At(t) => Some(t.saturating_duration_since(Instant::now())),
            Deadline::Never => None,
        }
    }

    /// The time left as an ABI time-out, at most `cap` when given.
    pub(crate) fn remaining_us(&self, cap: Option<Duration>) -> i64 {
        let left = match (self.remaining(), cap) {
            (None, None) => return -1,
            (None, Some(c)) => c,
            (Some(r), None) => r,
            (Some(r), Some(c)) => r.min(c),
        };
        // A non-zero remainder below 1 µs still waits a little.
        let us = left.as_micros().max(u128::from(!left.is_zero()));
        i64::try_from(us).unwrap_or(i64::MAX)
    }

    pub(crate) fn expired(&self) -> bool {
        self.remaining().is_some_and(|r| r.is_zero())
    }
}
