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
//!
//! Every host access to a storage's bytes takes part: tensor I/O, the
//! staging copies of the stream and TCM accessors (`neuron_memcpy`), and the
//! indexed accessors, which hold a *direct* span for their whole life. Plain
//! copies wait for each other; a plain copy that overlaps a direct span it
//! conflicts with fails at once with [`Error::Busy`](crate::Error::Busy)
//! (waiting could deadlock the thread that holds the accessor), and a new
//! direct span waits for the plain copies it overlaps. Direct spans never
//! conflict with each other: accessors load and store with atomic byte
//! accesses, which cannot race. See `userlib/DESIGN.md`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::log::{heartbeat_interval, log_warn};
use crate::wait::Deadline;

/// A byte range `[start, end)` of the storage a host access touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub start: usize,
    pub end: usize,
    pub write: bool,
    /// Held by an indexed accessor (atomic byte accesses) rather than a
    /// plain copy.
    pub direct: bool,
    /// Held by a `map_read`/`map_write` guard: plain (non-atomic) access
    /// through a reference, for the guard's whole life.
    pub guard: bool,
}

/// How a requested span set stands against the active spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Readiness {
    Ready,
    Wait,
    /// A plain copy overlaps a conflicting direct span.
    Busy,
}

impl Span {
    pub(crate) fn read(start: usize, len: usize) -> Self {
        Span {
            start,
            end: start + len,
            write: false,
            direct: false,
            guard: false,
        }
    }

    pub(crate) fn write(start: usize, len: usize) -> Self {
        Span {
            start,
            end: start + len,
            write: true,
            direct: false,
            guard: false,
        }
    }

    /// The span of an indexed accessor (`write` for a read-write one).
    pub(crate) fn direct(start: usize, len: usize, write: bool) -> Self {
        Span {
            start,
            end: start + len,
            write,
            direct: true,
            guard: false,
        }
    }

    /// The span of a `map_read` (or, `write`, `map_write`) guard.
    pub(crate) fn guard(start: usize, len: usize, write: bool) -> Self {
        Span {
            start,
            end: start + len,
            write,
            direct: false,
            guard: true,
        }
    }

    /// Held for an object's life (accessor, guard) rather than one copy:
    /// whoever conflicts with it is refused, since waiting could deadlock
    /// the thread that holds it.
    fn long_lived(&self) -> bool {
        self.direct || self.guard
    }

    fn conflicts(&self, other: &Span) -> bool {
        // Two direct spans only ever meet through atomic accesses.
        !(self.direct && other.direct)
            && (self.write || other.write)
            && self.start < other.end
            && other.start < self.end
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

    fn readiness(&self, spans: &[Span], fence: bool) -> Readiness {
        let mut wait = fence && !self.device_quiet(spans.iter().any(|s| s.write));
        for s in spans {
            for a in self.active.iter().filter(|a| s.conflicts(a)) {
                if a.long_lived() {
                    return Readiness::Busy;
                }
                wait = true;
            }
        }
        if wait {
            Readiness::Wait
        } else {
            Readiness::Ready
        }
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
        self.sync.release(self.spans);
    }
}

/// The direct span of an indexed accessor, held for the accessor's life.
pub(crate) struct HeldSpan<'a> {
    sync: &'a HostSync,
    span: [Span; 1],
}

impl Drop for HeldSpan<'_> {
    fn drop(&mut self) {
        self.sync.release(&self.span);
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

    fn release(&self, spans: &[Span]) {
        let mut st = self.lock();
        for s in spans {
            if let Some(i) = st.active.iter().position(|a| a == s) {
                st.active.swap_remove(i);
            }
        }
        if st.waiters > 0 {
            self.cond.notify_all();
        }
    }

    /// Waits until `spans` can be registered, or `deadline` passes
    /// (`Ok(false)`, nothing registered); registers them. A wait without
    /// limit logs a heartbeat every heartbeat interval.
    fn register(
        &self,
        op: &'static str,
        spans: &[Span],
        fence: bool,
        deadline: Deadline,
    ) -> Result<bool> {
        let mut st = self.lock();
        loop {
            match st.readiness(spans, fence) {
                Readiness::Ready => break,
                Readiness::Busy => return Err(Error::Busy { op }),
                Readiness::Wait => {
                    let wait = match deadline.remaining() {
                        Some(left) if left.is_zero() => return Ok(false),
                        Some(left) => left,
                        None => heartbeat_interval(),
                    };
                    st.waiters += 1;
                    let r;
                    (st, r) = self
                        .cond
                        .wait_timeout(st, wait)
                        .unwrap_or_else(|e| e.into_inner());
                    st.waiters -= 1;
                    if r.timed_out()
                        && matches!(deadline, Deadline::Never)
                        && st.readiness(spans, fence) == Readiness::Wait
                    {
                        log_warn!(
                            "{op}: still waiting for overlapping host copies or device \
                             accesses (async marks) of the storage"
                        );
                    }
                }
            }
        }
        st.active.try_reserve(spans.len()).map_err(|_| {
            Error::OutOfMemory(spans.len().saturating_mul(std::mem::size_of::<Span>()))
        })?;
        st.active.extend_from_slice(spans);
        Ok(true)
    }

    /// Registers host access to `spans` once no conflicting host copy is
    /// running and, with `fence`, once in-flight device accesses that
    /// conflict are done (device writes for a read, anything for a write).
    /// Fails with [`Error::Busy`] when a span overlaps the direct span of an
    /// open indexed accessor it conflicts with; then nothing is registered.
    pub(crate) fn acquire<'a>(
        &'a self,
        op: &'static str,
        spans: &'a [Span],
        fence: bool,
    ) -> Result<HostAccess<'a>> {
        self.register(op, spans, fence, Deadline::Never)?;
        Ok(HostAccess { sync: self, spans })
    }

    /// [`HostSync::acquire`] that gives up at `deadline`: `Ok(None)`.
    pub(crate) fn acquire_until<'a>(
        &'a self,
        op: &'static str,
        spans: &'a [Span],
        fence: bool,
        deadline: Deadline,
    ) -> Result<Option<HostAccess<'a>>> {
        Ok(self
            .register(op, spans, fence, deadline)?
            .then_some(HostAccess { sync: self, spans }))
    }

    /// Registers the long-lived span of an indexed accessor or a mapping
    /// guard, once the plain copies it conflicts with are done; `Busy` if
    /// it conflicts with another long-lived span.
    pub(crate) fn hold(&self, op: &'static str, span: Span) -> Result<HeldSpan<'_>> {
        Ok(self
            .hold_until(op, span, Deadline::Never)?
            .expect("a wait without limit ends with the span held"))
    }

    /// [`HostSync::hold`] that gives up at `deadline`: `Ok(None)`, nothing
    /// held. Plain copies do not hold their spans while they wait for the
    /// device (`io::hold_when_quiet`), but one may still take as long as
    /// the device does when its own job is the copy (`neuron_memcpy`'s
    /// DMA), so a bounded caller needs the bound here too.
    pub(crate) fn hold_until(
        &self,
        op: &'static str,
        span: Span,
        deadline: Deadline,
    ) -> Result<Option<HeldSpan<'_>>> {
        debug_assert!(span.long_lived());
        Ok(self
            .register(op, &[span], false, deadline)?
            .then_some(HeldSpan {
                sync: self,
                span: [span],
            }))
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
        let heartbeat = || {
            format!(
                "still waiting for device {} marked on a host storage (mark_async_finish)",
                if write { "accesses" } else { "writes" }
            )
        };
        self.wait_until(st, deadline, Some(&heartbeat), |st| st.device_quiet(write))
            .1
    }

    /// Runs `f` under the storage's lock (for values updated together).
    pub(crate) fn locked<R>(&self, f: impl FnOnce() -> R) -> R {
        let _st = self.lock();
        f()
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
        let d = |a, b, w| Span::direct(a, b, w);
        assert!(!d(0, 10, true).conflicts(&d(0, 10, true)));
        assert!(d(0, 10, true).conflicts(&r(5, 1)));
        assert!(!d(0, 10, false).conflicts(&r(5, 1)));
        assert!(d(0, 10, false).conflicts(&w(5, 1)));
    }

    #[test]
    fn a_copy_over_a_direct_span_is_busy_not_blocked() {
        let s = HostSync::default();
        let held = s.hold("accessor", Span::direct(0, 64, true)).unwrap();
        let spans = [Span::read(60, 8)];
        assert!(matches!(
            s.acquire("read", &spans, true),
            Err(Error::Busy { op: "read" })
        ));
        let other = [Span::read(64, 8)];
        drop(s.acquire("read", &other, true).unwrap());
        drop(held);
        drop(s.acquire("read", &spans, true).unwrap());
        assert!(s.lock().active.is_empty());
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
        let g = s.acquire("t", &spans, true).unwrap();
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            let spans = [Span::write(50, 10)];
            let _g = s2.acquire("t", &spans, true).unwrap();
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished());
        drop(g);
        t.join().unwrap();
    }
}
