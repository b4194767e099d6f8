// SPDX-License-Identifier: GPL-2.0

//! Per-buffer fence counters and the completion count, with their waiters.
//!
//! This is the kernel home of the seed's `tensor_async_update` (producer)
//! and `tensor_block_while_exec` (waiter): submitting a job marks a pending
//! device read on each source and a pending device write on each
//! destination; the completion path undoes the marks and bumps the
//! destinations' completion counts.
//!
//! Unlike the original, which serialised every output-completion waiter of
//! the process behind one global mutex/condvar pair, each buffer has its own
//! lock and wait queue: waiters on different buffers never wake each other.
//! Wake-ups happen only when a watched quantity changes in a way a waiter
//! can care about (a counter reaching zero, a completion), and only if a
//! waiter sleeps (see `waitqueue.rs`, which also says why none is lost).

use kernel::{
    new_condvar,
    new_mutex,
    prelude::*,
    sync::{
        CondVarTimeoutResult,
        Mutex, //
    },
    time::{
        msecs_to_jiffies,
        Jiffies, //
    }, //
};

use crate::waitqueue::{
    Sleepers,
    WaitQueue, //
};

use crate::uapi::{
    FENCE_READS,
    FENCE_WRITES, //
};

/// How long a wait may block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Timeout {
    /// Check once, never sleep.
    Poll,
    /// Sleep until the condition holds or a signal arrives.
    Forever,
    /// Sleep at most this many jiffies.
    Jiffies(Jiffies),
}

impl Timeout {
    /// Converts the ABI's microseconds: 0 polls, negative waits forever.
    pub(crate) fn from_us(us: i64) -> Self {
        match us {
            0 => Timeout::Poll,
            us if us < 0 => Timeout::Forever,
            us => {
                // Round up, so a 1 us wait still sleeps; clamp absurd values.
                let ms = (us as u64).div_ceil(1000).min(u64::from(u32::MAX - 1));
                Timeout::Jiffies(msecs_to_jiffies(ms as u32).max(1))
            }
        }
    }
}

/// The counters one buffer's fence lock protects.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(crate) struct FenceCounts {
    /// In-flight device reads of the buffer.
    pub(crate) reads: u64,
    /// In-flight device writes to the buffer.
    pub(crate) writes: u64,
    /// Synchronous CPU accesses (COPY_IN, COPY_OUT, MEMSET, COPY) in
    /// progress: jobs are not queued on the buffer while any is.
    pub(crate) cpu: u32,
    /// Threads asleep on the fence's wait queue, or about to be: a change
    /// wakes the queue only if there are any.
    waiters: u32,
    /// Jobs that finished writing the buffer since the last reset.
    pub(crate) completions: u64,
    /// Error latch: the negative errno of the last job that failed while
    /// writing the buffer (its bytes are not what the job promised), or of
    /// a synchronous write the device failed ([`Fence::latch_error`]), or
    /// 0. Cleared by the next successful write (job or CPU) or by
    /// COMPLETION_RESET.
    pub(crate) error: i32,
    /// Set when the device is gone: waits end with ENODEV.
    pub(crate) dead: bool,
    /// Of `reads` and `writes`, those of jobs the device abandoned: they
    /// failed, but stay marked because the device may still run them
    /// (the sim device's dead queue). None of them ends before the device
    /// lets go, so a wait that only they keep from ending fails (EIO).
    /// (16 bits: bounded by the descriptors a device's rings hold.)
    lost_reads: u16,
    lost_writes: u16,
}

impl Sleepers for FenceCounts {
    fn sleepers(&mut self) -> &mut u32 {
        &mut self.waiters
    }
}

impl FenceCounts {
    /// True when none of the counters selected by `kind` is pending.
    pub(crate) fn idle(&self, kind: u32) -> bool {
        (kind & FENCE_READS == 0 || self.reads == 0)
            && (kind & FENCE_WRITES == 0 || self.writes == 0)
    }

    /// True when something selected by `kind` is pending and all of it
    /// belongs to abandoned jobs: it will not end while the device is
    /// dead.
    fn stuck(&self, kind: u32) -> bool {
        let r = kind & FENCE_READS != 0 && self.reads != 0;
        let w = kind & FENCE_WRITES != 0 && self.writes != 0;
        (r || w)
            && (!r || self.reads == u64::from(self.lost_reads))
            && (!w || self.writes == u64::from(self.lost_writes))
    }
}

/// A buffer's fence: counters plus the wait queue of their waiters.
#[pin_data]
pub(crate) struct Fence {
    #[pin]
    counts: Mutex<FenceCounts>,
    #[pin]
    wq: WaitQueue,
}

impl Fence {
    pub(crate) fn new() -> impl PinInit<Self> {
        pin_init!(Self {
            counts <- new_mutex!(FenceCounts::default(), "Fence::counts"),
            wq <- WaitQueue::new(new_condvar!("Fence::cv")),
        })
    }

    /// A snapshot of the counters.
    pub(crate) fn counts(&self) -> FenceCounts {
        *self.counts.lock()
    }

    /// Producer: a job that will read (`write == false`) or write the
    /// buffer is being queued. Fails with EBUSY, changing nothing, while a
    /// synchronous CPU access of the buffer is in progress: the caller
    /// undoes its other marks, waits with [`Fence::wait_cpu_idle`] and
    /// tries again, so a job never overlaps a CPU copy.
    pub(crate) fn try_begin(&self, write: bool) -> Result {
        let mut c = self.counts.lock();
        if c.cpu > 0 {
            return Err(EBUSY);
        }
        if write {
            c.writes += 1;
        } else {
            c.reads += 1;
        }
        Ok(())
    }

    /// Waits until no synchronous CPU access of the buffer is in progress
    /// (the error latch does not matter here: a job may overwrite a buffer
    /// with undefined bytes). ENODEV if the device went away.
    pub(crate) fn wait_cpu_idle(&self) -> Result {
        let mut c = self.counts.lock();
        while c.cpu > 0 {
            if c.dead {
                return Err(ENODEV);
            }
            if self.wq.wait_interruptible(&mut c) {
                return Err(ERESTARTSYS);
            }
        }
        Ok(())
    }

    /// Starts a synchronous CPU access: waits until the device accesses
    /// selected by `kind` are done, then marks the access in the same
    /// critical section, so that no job can be queued on the buffer until
    /// [`Fence::cpu_end`].
    pub(crate) fn cpu_begin(&self, kind: u32) -> Result {
        let mut c = self.counts.lock();
        loop {
            if c.dead {
                return Err(ENODEV);
            }
            if c.idle(kind) {
                c.cpu += 1;
                return Ok(());
            }
            if c.stuck(kind) {
                // The device abandoned the access it would wait for.
                return Err(EIO);
            }
            if self.wq.wait_interruptible(&mut c) {
                return Err(ERESTARTSYS);
            }
        }
    }

    /// Ends a [`Fence::cpu_begin`].
    pub(crate) fn cpu_end(&self) {
        let mut c = self.counts.lock();
        c.cpu = c.cpu.saturating_sub(1);
        if c.cpu == 0 {
            self.wq.wake_all(c);
        }
    }

    /// Completion path: undoes one [`Fence::try_begin`]; wakes the waiters
    /// when that counter reaches zero (the seed's "broadcast on the 0
    /// transition", evaluated under the lock). A finished write also counts
    /// a completion when `completed` is set.
    pub(crate) fn end(&self, write: bool, completed: bool) {
        self.end_write_with(write, completed, 0);
    }

    /// Completion path of a job that wrote the buffer and failed with
    /// `errno`: undoes its write mark and latches the error (in the same
    /// critical section, so a waiter woken by the drain sees it).
    pub(crate) fn end_failed_write(&self, errno: i32) {
        self.end_write_with(true, false, errno);
    }

    /// A job that reads (`write == false`) or writes the buffer failed
    /// with `errno`, but the device may still run it: its mark stays
    /// until [`Fence::end_abandoned`], a write latches `errno` now, and
    /// waits that only abandoned accesses keep from ending fail (see
    /// [`FenceCounts::lost_writes`]).
    pub(crate) fn abandon(&self, write: bool, errno: i32) {
        let mut c = self.counts.lock();
        if write {
            c.lost_writes = c.lost_writes.saturating_add(1);
            c.error = errno;
        } else {
            c.lost_reads = c.lost_reads.saturating_add(1);
        }
        self.wq.wake_all(c);
    }

    /// The device let go of an access [`Fence::abandon`]ed: ends it as a
    /// failed one.
    pub(crate) fn end_abandoned(&self, write: bool, errno: i32) {
        {
            let mut c = self.counts.lock();
            if write {
                c.lost_writes = c.lost_writes.saturating_sub(1);
            } else {
                c.lost_reads = c.lost_reads.saturating_sub(1);
            }
        }
        self.end_write_with(write, false, if write { errno } else { 0 });
    }

    fn end_write_with(&self, write: bool, completed: bool, errno: i32) {
        let mut c = self.counts.lock();
        let counter = if write { &mut c.writes } else { &mut c.reads };
        // An unbalanced end would be a driver bug; never wrap.
        *counter = counter.saturating_sub(1);
        let drained = *counter == 0;
        if write && completed {
            c.completions += 1;
            c.error = 0;
        }
        if errno != 0 {
            c.error = errno;
        }
        if drained || (write && completed) || errno != 0 {
            self.wq.wake_all(c);
        }
    }

    /// Sets the completion count to 0 and clears the error latch.
    pub(crate) fn reset_completions(&self) {
        let mut c = self.counts.lock();
        c.completions = 0;
        c.error = 0;
    }

    /// A synchronous CPU write of the buffer succeeded: clears the latch.
    pub(crate) fn clear_error(&self) {
        self.counts.lock().error = 0;
    }

    /// A synchronous write of the buffer (COPY_IN, MEMSET, COPY) that the
    /// device's DMA failed part-way: its bytes are undefined, as after a
    /// failed job, so the latch takes `errno` (negative) and waiters that
    /// the latch ends are woken.
    pub(crate) fn latch_error(&self, errno: i32) {
        let mut c = self.counts.lock();
        c.error = errno;
        self.wq.wake_all(c);
    }

    /// EIO if a failed job left the buffer's bytes undefined (see
    /// [`FenceCounts::error`]); ENODEV instead once the device is gone, or
    /// if the write failed because it went: unbind fails the jobs in
    /// flight before it kills the fences, and a caller between the two
    /// must get the ENODEV of every call after a removal, not the EIO of a
    /// device fault.
    pub(crate) fn check_error(&self) -> Result {
        let c = self.counts.lock();
        if c.dead || c.error == ENODEV.to_errno() {
            return Err(ENODEV);
        }
        if c.error != 0 {
            return Err(EIO);
        }
        Ok(())
    }

    /// Marks the fence dead (device removed) and wakes every waiter.
    pub(crate) fn kill(&self) {
        let mut c = self.counts.lock();
        c.dead = true;
        self.wq.wake_all(c);
    }

    /// Waits until `done` holds for the counters; returns the counters it
    /// saw last. ETIMEDOUT on timeout (or a failed poll), ENODEV if the
    /// device went away, EIO (or ENODEV) once the error latch is set and
    /// no write is pending: for a condition only a write can bring about
    /// (a completion count). A signal ends an unbounded wait with
    /// ERESTARTSYS (the call restarts after a handler installed with
    /// SA_RESTART) and a timed one with EINTR (its deadline would not
    /// survive a restart).
    pub(crate) fn wait_until(
        &self,
        timeout: Timeout,
        done: impl Fn(&FenceCounts) -> bool,
    ) -> core::result::Result<FenceCounts, (Error, FenceCounts)> {
        self.wait_for(timeout, done, true, 0)
    }

    /// [`Fence::wait_until`]; `latch` selects whether a set error latch
    /// with no write pending (other than abandoned ones) ends the wait;
    /// `stuck` selects the counters whose abandoned accesses end it (see
    /// [`FenceCounts::stuck`]).
    fn wait_for(
        &self,
        timeout: Timeout,
        done: impl Fn(&FenceCounts) -> bool,
        latch: bool,
        stuck: u32,
    ) -> core::result::Result<FenceCounts, (Error, FenceCounts)> {
        let mut c = self.counts.lock();
        let mut left = match timeout {
            Timeout::Jiffies(j) => j,
            _ => 0,
        };
        loop {
            if done(&c) {
                return Ok(*c);
            }
            if c.dead {
                return Err((ENODEV, *c));
            }
            if latch && c.error != 0 && c.writes == u64::from(c.lost_writes) {
                // What the caller waits for depends on a write that failed
                // and none is pending that could still deliver it. A write
                // that failed because the device went away says so, as
                // the fence's death (which unbind sets a moment later)
                // would.
                let e = if c.error == ENODEV.to_errno() { ENODEV } else { EIO };
                return Err((e, *c));
            }
            if c.stuck(stuck) {
                return Err((EIO, *c));
            }
            match timeout {
                Timeout::Poll => return Err((ETIMEDOUT, *c)),
                Timeout::Forever => {
                    if self.wq.wait_interruptible(&mut c) {
                        return Err((ERESTARTSYS, *c));
                    }
                }
                Timeout::Jiffies(_) => match self.wq.wait_interruptible_timeout(&mut c, left) {
                    CondVarTimeoutResult::Woken { jiffies } => left = jiffies,
                    CondVarTimeoutResult::Timeout => {
                        return if done(&c) {
                            Ok(*c)
                        } else {
                            Err((ETIMEDOUT, *c))
                        };
                    }
                    CondVarTimeoutResult::Signal { .. } => return Err((EINTR, *c)),
                },
            }
        }
    }

    /// Waits until the counters selected by `kind` are zero, whatever the
    /// error latch says: pending device reads end by themselves, and a
    /// caller about to overwrite the buffer must not race them because an
    /// earlier write failed. (The caller checks the latch afterwards if
    /// it cares.)
    pub(crate) fn wait_idle(&self, kind: u32, timeout: Timeout) -> Result {
        self.wait_for(timeout, |c| c.idle(kind), false, kind)
            .map(drop)
            .map_err(|(e, _)| e)
    }
}

#[kunit_tests(tdrv_fence)]
mod tests {
    use super::*;
    use crate::uapi::FENCE_ALL;
    use kernel::sync::Arc;

    fn fence() -> Result<Pin<KBox<Fence>>> {
        KBox::pin_init(Fence::new(), GFP_KERNEL)
    }

    #[test]
    fn counters_balance() -> Result {
        let f = fence()?;
        f.try_begin(false)?;
        f.try_begin(true)?;
        f.try_begin(true)?;
        let c = f.counts();
        assert_eq!((c.reads, c.writes, c.completions), (1, 2, 0));
        assert!(!c.idle(FENCE_READS));
        assert!(!c.idle(FENCE_WRITES));
        f.end(true, true);
        f.end(false, false);
        let c = f.counts();
        assert_eq!((c.reads, c.writes, c.completions), (0, 1, 1));
        assert!(c.idle(FENCE_READS));
        assert!(!c.idle(FENCE_ALL));
        f.end(true, true);
        assert!(f.counts().idle(FENCE_ALL));
        assert_eq!(f.counts().completions, 2);
        // An unbalanced end saturates instead of wrapping.
        f.end(true, false);
        assert_eq!(f.counts().writes, 0);
        f.reset_completions();
        assert_eq!(f.counts().completions, 0);
        Ok(())
    }

    #[test]
    fn poll_and_timeout() -> Result {
        let f = fence()?;
        assert_eq!(f.wait_idle(FENCE_ALL, Timeout::Poll), Ok(()));
        f.try_begin(true)?;
        assert_eq!(f.wait_idle(FENCE_WRITES, Timeout::Poll), Err(ETIMEDOUT));
        // Reads are idle even while a write is pending.
        assert_eq!(f.wait_idle(FENCE_READS, Timeout::Poll), Ok(()));
        assert_eq!(
            f.wait_idle(FENCE_WRITES, Timeout::from_us(2000)),
            Err(ETIMEDOUT)
        );
        f.end(true, true);
        assert_eq!(f.wait_idle(FENCE_WRITES, Timeout::from_us(2000)), Ok(()));
        let r = f.wait_until(Timeout::Poll, |c| c.completions >= 2);
        assert!(matches!(r, Err((e, c)) if e == ETIMEDOUT && c.completions == 1));
        Ok(())
    }

    #[test]
    fn latch_of_a_removed_device_reads_as_enodev() -> Result {
        // A job that unbind failed latched ENODEV before the fence died.
        let f = fence()?;
        f.try_begin(true)?;
        f.end_failed_write(ENODEV.to_errno());
        assert_eq!(f.check_error(), Err(ENODEV));
        // A fault latched before the removal: ENODEV once the fence died.
        let g = fence()?;
        g.try_begin(true)?;
        g.end_failed_write(EIO.to_errno());
        assert_eq!(g.check_error(), Err(EIO));
        g.kill();
        assert_eq!(g.check_error(), Err(ENODEV));
        // A dead fence with no latch: nothing to report.
        let h = fence()?;
        h.kill();
        assert_eq!(h.check_error(), Err(ENODEV));
        Ok(())
    }

    #[test]
    fn dead_fence_fails_waits() -> Result {
        let f = fence()?;
        f.try_begin(false)?;
        f.kill();
        assert_eq!(f.wait_idle(FENCE_ALL, Timeout::Forever), Err(ENODEV));
        Ok(())
    }

    #[test]
    fn cpu_access_excludes_jobs() -> Result {
        let f = fence()?;
        f.cpu_begin(FENCE_ALL)?;
        assert_eq!(f.try_begin(true), Err(EBUSY));
        assert_eq!(f.counts().writes, 0);
        f.cpu_end();
        f.try_begin(true)?;
        // A CPU write waits for the job; a poll shows it is not idle.
        assert_eq!(f.wait_idle(FENCE_WRITES, Timeout::Poll), Err(ETIMEDOUT));
        f.end(true, true);
        f.cpu_begin(FENCE_ALL)?;
        assert_eq!(f.counts().cpu, 1);
        f.cpu_end();
        assert_eq!(f.wait_cpu_idle(), Ok(()));
        Ok(())
    }

    #[test]
    fn failed_write_latches_until_a_good_one() -> Result {
        let f = fence()?;
        f.try_begin(true)?;
        f.end_failed_write(-5);
        assert_eq!(f.counts().error, -5);
        assert_eq!(f.check_error(), Err(EIO));
        // A wait for a completion that the failed job would have given
        // ends with EIO instead of sleeping for ever.
        assert_eq!(
            f.wait_until(Timeout::Forever, |c| c.completions >= 1).map_err(|(e, _)| e),
            Err(EIO)
        );
        f.try_begin(true)?;
        f.end(true, true);
        assert_eq!(f.counts().error, 0);
        assert_eq!(f.check_error(), Ok(()));
        f.try_begin(true)?;
        f.end_failed_write(-110);
        f.reset_completions();
        assert_eq!((f.counts().error, f.counts().completions), (0, 0));
        Ok(())
    }

    #[test]
    fn latch_does_not_end_a_wait_for_pending_reads() -> Result {
        // A job that wrote the buffer failed; a later job still reads it.
        // A wait for the reads (FENCE_WAIT(READS), a CPU write's
        // DMA_BUF_IOCTL_SYNC) must see them pending, not the latch.
        let f = fence()?;
        f.try_begin(true)?;
        f.end_failed_write(-5);
        f.try_begin(false)?;
        assert_eq!(f.wait_idle(FENCE_READS, Timeout::Poll), Err(ETIMEDOUT));
        assert_eq!(f.wait_idle(FENCE_ALL, Timeout::from_us(2000)), Err(ETIMEDOUT));
        assert_eq!(f.wait_idle(FENCE_WRITES, Timeout::Poll), Ok(()));
        f.end(false, false);
        assert_eq!(f.wait_idle(FENCE_ALL, Timeout::Poll), Ok(()));
        // The latch is still there for whoever asks.
        assert_eq!(f.check_error(), Err(EIO));
        Ok(())
    }

    #[test]
    fn write_failed_by_unbind_ends_waits_with_enodev() -> Result {
        // Unbind fails the job in flight with ENODEV before it marks the
        // fence dead; a waiter woken in between must see ENODEV too.
        let f = fence()?;
        f.try_begin(true)?;
        f.end_failed_write(ENODEV.to_errno());
        assert_eq!(
            f.wait_until(Timeout::Forever, |c| c.completions >= 1).map_err(|(e, _)| e),
            Err(ENODEV)
        );
        Ok(())
    }

    #[test]
    fn timeout_conversion() {
        assert_eq!(Timeout::from_us(0), Timeout::Poll);
        assert_eq!(Timeout::from_us(-1), Timeout::Forever);
        assert!(matches!(Timeout::from_us(1), Timeout::Jiffies(j) if j >= 1));
        assert!(matches!(Timeout::from_us(i64::MAX), Timeout::Jiffies(j) if j >= 1));
    }

    #[test]
    fn arc_fence_is_shareable() -> Result {
        let f = Arc::pin_init(Fence::new(), GFP_KERNEL)?;
        let g = f.clone();
        g.try_begin(true)?;
        assert_eq!(f.counts().writes, 1);
        Ok(())
    }
}
