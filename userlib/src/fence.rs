//! Host-side synchronisation of one storage: the seed's async-exec fence
//! counters, the per-view output-completion counters, and the byte ranges
//! that host copies are touching right now.
//!
//! One mutex and one condition variable per storage guard all three. That
//! differs from the original in two ways, both deliberate:
//!
//! - the completion plane used one process-global lock/cond pair for every
//!   tensor, so unrelated output waiters woke (and serialised) each other;
//!   here a waiter only shares its condvar with views of the same storage;
//! - host copies register the range they touch, so two overlapping host
//!   accesses where one writes never run at once (the original let them race
//!   and tear). Accesses to disjoint ranges still run in parallel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::log::{heartbeat_interval, log_warn};
use crate::wait::Deadline;

/// A byte range `[start, end)` of the storage a host copy touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub start: usize,
    pub end: usize,
    pub write: bool,
}

impl Span {
    pub(crate) fn read(start: usize, len: usize) -> Self {
        Span {
            start,
            end: start + len,
            write: false,
        }
    }

    pub(crate) fn write(start: usize, len: usize) -> Self {
        Span {
            start,
            end: start + len,
            write: true,
        }
    }

    fn conflicts(&self, other: &Span) -> bool {
        (self.write || other.write) && self.start < other.end && other.start < self.end
    }
}

/// In-flight device accesses of a storage, as counted by the async marks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PendingAccess {
    /// Device reads in flight (`pending_exec_count_read`).
    pub reads: u64,
    /// Device writes in flight (`pending_exec_count_write`).
    pub writes: u64,
}

#[derive(Default)]
struct State {
    pending: PendingAccess,
    active: Vec<Span>,
    waiters: usize,
}

impl State {
    /// The seed's fence predicate: readers wait for device writers, writers
    /// wait for every device access.
    fn device_quiet(&self, write: bool) -> bool {
        self.pending.writes == 0 && (!write || self.pending.reads == 0)
    }

    fn ready(&self, spans: &[Span], fence: bool) -> bool {
        if fence && !self.device_quiet(spans.iter().any(|s| s.write)) {
            return false;
        }
        spans
            .iter()
            .all(|s| self.active.iter().all(|a| !s.conflicts(a)))
    }
}

/// See the module documentation.
#[derive(Default)]
pub(crate) struct HostSync {
    state: Mutex<State>,
    cond: Condvar,
}

/// Host access to some ranges of a storage; released on drop.
pub(crate) struct HostAccess<'a> {
    sync: &'a HostSync,
    spans: &'a [Span],
}

impl Drop for HostAccess<'_> {
    fn drop(&mut self) {
        let mut st = self.sync.lock();
        for s in self.spans {
            if let Some(i) = st.active.iter().position(|a| a == s) {
                st.active.swap_remove(i);
            }
        }
        if st.waiters > 0 {
            self.sync.cond.notify_all();
        }
    }
}

impl HostSync {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding this lock; recover anyway.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `ready` holds or the deadline passes; returns whether it
    /// holds. With `heartbeat`, an unbounded wait logs that message every
    /// heartbeat interval.
    fn wait_until<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        deadline: Deadline,
        heartbeat: Option<&dyn Fn() -> String>,
        mut ready: impl FnMut(&State) -> bool,
    ) -> (MutexGuard<'a, State>, bool) {
        while !ready(&st) {
            let wait = match (deadline.remaining(), heartbeat) {
                (Some(left), _) if left.is_zero() => return (st, false),
                (Some(left), _) => Some(left),
                (None, Some(_)) => Some(heartbeat_interval()),
                (None, None) => None,
            };
            st.waiters += 1;
            let timed_out;
            (st, timed_out) = match wait {
                Some(d) => {
                    let (g, r) = self
                        .cond
                        .wait_timeout(st, d)
                        .unwrap_or_else(|e| e.into_inner());
                    (g, r.timed_out())
                }
                None => (self.cond.wait(st).unwrap_or_else(|e| e.into_inner()), false),
            };
            st.waiters -= 1;
            if let (true, Deadline::Never, Some(msg)) = (timed_out, deadline, heartbeat) {
                if !ready(&st) {
                    log_warn!("{}", msg());
                }
            }
        }
        (st, true)
    }

    /// Registers host access to `spans` once no conflicting host access is
    /// running and, with `fence`, once in-flight device accesses that
    /// conflict are done (device writes for a read, anything for a write).
    pub(crate) fn acquire<'a>(&'a self, spans: &'a [Span], fence: bool) -> HostAccess<'a> {
        let st = self.lock();
        let (mut st, _) = self.wait_until(st, Deadline::Never, None, |st| st.ready(spans, fence));
        st.active.extend_from_slice(spans);
        HostAccess { sync: self, spans }
    }

    /// Marks a device access as started (`write` selects the counter).
    pub(crate) fn mark_start(&self, write: bool) {
        let mut st = self.lock();
        let c = if write {
            &mut st.pending.writes
        } else {
            &mut st.pending.reads
        };
        *c = c.saturating_add(1);
    }

    /// Marks a device access as finished; wakes the waiters when that
    /// counter reaches zero. `false` (and no change) if none was pending.
    pub(crate) fn mark_finish(&self, write: bool) -> bool {
        let mut st = self.lock();
        let c = if write {
            &mut st.pending.writes
        } else {
            &mut st.pending.reads
        };
        if *c == 0 {
            return false;
        }
        *c -= 1;
        if *c == 0 && st.waiters > 0 {
            self.cond.notify_all();
        }
        true
    }

    pub(crate) fn pending(&self) -> PendingAccess {
        self.lock().pending
    }

    /// Waits until no device access conflicting with a host read (or, with
    /// `write`, a host write) is in flight.
    pub(crate) fn wait_device(&self, write: bool, deadline: Deadline) -> bool {
        let st = self.lock();
        self.wait_until(st, deadline, None, |st| st.device_quiet(write))
            .1
    }

    /// Bumps a view's completion counter and wakes its waiters.
    pub(crate) fn complete(&self, counter: &AtomicU64) {
        let st = self.lock();
        counter.fetch_add(1, Ordering::Relaxed);
        if st.waiters > 0 {
            self.cond.notify_all();
        }
    }

    /// Sets a view's completion counter to zero.
    pub(crate) fn reset(&self, counter: &AtomicU64) {
        let _st = self.lock();
        counter.store(0, Ordering::Relaxed);
    }

    /// Waits until a view's completion counter reaches `expected`.
    pub(crate) fn wait_count(
        &self,
        counter: &AtomicU64,
        expected: u64,
        deadline: Deadline,
        heartbeat: &dyn Fn() -> String,
    ) -> bool {
        let st = self.lock();
        self.wait_until(st, deadline, Some(heartbeat), |_| {
            counter.load(Ordering::Relaxed) >= expected
        })
        .1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn spans_conflict_only_when_overlapping_and_writing() {
        let r = |a, b| Span::read(a, b);
        let w = |a, b| Span::write(a, b);
        assert!(!r(0, 10).conflicts(&r(5, 10)));
        assert!(w(0, 10).conflicts(&r(5, 10)));
        assert!(r(0, 10).conflicts(&w(9, 1)));
        assert!(!w(0, 10).conflicts(&w(10, 10)));
        assert!(!w(0, 0).conflicts(&w(0, 10)));
    }

    #[test]
    fn finish_without_start_is_refused() {
        let s = HostSync::default();
        assert!(!s.mark_finish(true));
        s.mark_start(true);
        assert!(s.mark_finish(true));
        assert_eq!(s.pending(), PendingAccess::default());
    }

    #[test]
    fn writer_waits_for_overlapping_host_access() {
        let s = Arc::new(HostSync::default());
        let spans = [Span::read(0, 100)];
        let g = s.acquire(&spans, true);
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            let spans = [Span::write(50, 10)];
            let _g = s2.acquire(&spans, true);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished());
        drop(g);
        t.join().unwrap();
    }
}
