//! Time-outs. The Rust API takes `Option<Duration>` (`None` waits without
//! limit, `Some(Duration::ZERO)` polls); the ABI and the C library take
//! microseconds (0 polls, negative waits without limit).

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
    /// From the Rust API's time-out: `None` waits without limit,
    /// `Some(ZERO)` polls.
    pub(crate) fn from_timeout(timeout: Option<Duration>) -> Self {
        match timeout {
            None => Deadline::Never,
            Some(d) if d.is_zero() => Deadline::Poll,
            Some(d) => Instant::now()
                .checked_add(d)
                .map_or(Deadline::Never, Deadline::At),
        }
    }

    #[cfg(test)]
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

/// The Rust API's time-out for an ABI (and nrt) time-out in microseconds:
/// negative waits without limit (`None`), 0 polls (`Some(ZERO)`).
pub fn timeout_from_us(timeout_us: i64) -> Option<Duration> {
    (timeout_us >= 0).then(|| Duration::from_micros(timeout_us.unsigned_abs()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn microsecond_time_outs_map_to_durations() {
        assert_eq!(timeout_from_us(-1), None);
        assert_eq!(timeout_from_us(i64::MIN), None);
        assert_eq!(timeout_from_us(0), Some(Duration::ZERO));
        assert_eq!(timeout_from_us(1500), Some(Duration::from_micros(1500)));
        assert!(matches!(Deadline::from_timeout(None), Deadline::Never));
        assert!(matches!(
            Deadline::from_timeout(Some(Duration::ZERO)),
            Deadline::Poll
        ));
        assert!(matches!(
            Deadline::from_timeout(Some(Duration::MAX)),
            Deadline::Never
        ));
        assert!(matches!(Deadline::from_timeout_us(0), Deadline::Poll));
    }
}
