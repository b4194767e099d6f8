// SPDX-License-Identifier: GPL-2.0

//! Asynchronous copy jobs and the one completion path every engine calls.
//!
//! Life of a job:
//! 1. `TDRV_IOC_SUBMIT` resolves the descriptors into [`Transfer`]s, which
//!    hold references to their buffers, and [`Job::new`] marks a pending
//!    device read on every source and a pending device write on every
//!    destination (the seed's `tensor_async_update(.., release = false)`),
//!    waiting first for synchronous CPU copies of those buffers to end.
//! 2. [`JobTracker::submit`] gives it the file's next id and hands it to
//!    the device's engine (`engine.rs`), within the file's limits.
//! 3. The engine runs the transfers and calls [`Job::complete`] exactly
//!    once, with the result. That drops the pending marks (waking fence
//!    waiters when a count reaches zero), bumps the completion count of
//!    each destination if the job succeeded, and records the outcome in
//!    the submitting file's [`JobTracker`], waking `TDRV_IOC_JOB_WAIT`.
//!
//! A failed or cancelled job still releases its fences: waiters are never
//! left hanging. When its file closes, a job that has not started is
//! cancelled (ECANCELED) and a running one stops after the piece in
//! flight.

use kernel::{
    list::{
        impl_list_arc_safe,
        impl_list_item,
        ListArc,
        ListLinks, //
    },
    new_condvar,
    new_mutex,
    prelude::*,
    sync::{
        atomic::{
            Acquire,
            Atomic,
            Relaxed,
            Release, //
        },
        Arc,
        CondVar,
        CondVarTimeoutResult,
        Mutex, //
    }, //
};

use crate::{
    buffer::Buffer,
    device::{
        Limits,
        TdrvDevice, //
    },
    fence::Timeout,
    range::ByteRange,
    uapi::{
        ecanceled,
        estale, //
    }, //
};

/// Jobs of a file whose outcome `TDRV_IOC_JOB_WAIT` can still report:
/// `TDRV_JOB_WINDOW` in the uapi. Older ids get ESTALE.
pub(crate) const JOB_WINDOW: u64 = 4096;

/// The monotonic clock in nanoseconds.
fn now_ns() -> i64 {
    // SAFETY: `ktime_get` reads the monotonic clock; callable from any
    // context.
    unsafe { kernel::bindings::ktime_get() }
}

/// `Job::outcome` before the job completed.
const NO_OUTCOME: i32 = 1;

/// Ring entry of a job that has not finished.
const PENDING: i32 = 1;

/// One buffer-to-buffer copy of a job.
pub(crate) struct Transfer {
    pub(crate) src: Arc<Buffer>,
    pub(crate) src_range: ByteRange,
    pub(crate) dst: Arc<Buffer>,
    pub(crate) dst_offset: usize,
}

/// A submitted job.
#[pin_data(PinnedDrop)]
pub(crate) struct Job {
    /// Set under the tracker lock before the job is queued.
    id: Atomic<u64>,
    pub(crate) transfers: KVec<Transfer>,
    /// Bytes the job moves (sum of its transfers).
    bytes: u64,
    tracker: Arc<JobTracker>,
    device: Arc<TdrvDevice>,
    /// When the engine started running the job (`ktime_get` ns), or 0.
    started_ns: Atomic<i64>,
    /// The outcome set by [`Job::complete`] (`NO_OUTCOME`, 0 or a negative
    /// errno), reported when the job is dropped, after its buffers.
    outcome: Atomic<i32>,
    /// Set once the outcome was reported (early, for a timed-out job).
    reported: Atomic<bool>,
    /// Links of the engine's queue.
    #[pin]
    links: ListLinks,
}

impl_list_arc_safe! {
    impl ListArcSafe<0> for Job { untracked; }
}
impl_list_item! {
    impl ListItem<0> for Job { using ListLinks { self.links }; }
}

/// Undoes the fence marks of the first `n` transfers (and, when `src_only`,
/// the source mark of transfer `n`), counting nothing.
fn unmark(transfers: &[Transfer], n: usize, src_only: bool) {
    for t in &transfers[..n] {
        t.src.fence.end(false, false);
        t.dst.fence.end(true, false);
    }
    if src_only {
        transfers[n].src.fence.end(false, false);
    }
}

/// Marks pending reads and writes for `transfers`. A synchronous CPU copy
/// of one of the buffers makes it undo what it marked, wait for that copy
/// and start again, so that it never holds marks while waiting (a CPU copy
/// may be waiting for those very marks to clear).
fn mark(transfers: &[Transfer]) -> Result {
    'again: loop {
        for (i, t) in transfers.iter().enumerate() {
            if t.src.fence.try_begin(false).is_err() {
                unmark(transfers, i, false);
                t.src.fence.wait_cpu_idle()?;
                continue 'again;
            }
            if t.dst.fence.try_begin(true).is_err() {
                unmark(transfers, i, true);
                t.dst.fence.wait_cpu_idle()?;
                continue 'again;
            }
        }
        return Ok(());
    }
}

impl Job {
    /// The bytes `transfers` move.
    pub(crate) fn total_bytes(transfers: &[Transfer]) -> u64 {
        transfers.iter().map(|t| t.src_range.len as u64).sum()
    }

    /// True once the submitting file has closed: the engine drops the job
    /// (or the rest of it) with ECANCELED.
    pub(crate) fn cancelled(&self) -> bool {
        self.tracker.closed.load(Acquire)
    }

    /// True if `tracker` submitted the job.
    pub(crate) fn submitted_by(&self, tracker: &JobTracker) -> bool {
        core::ptr::eq(&*self.tracker, tracker)
    }

    /// The engine starts running the job (for busy-time accounting).
    pub(crate) fn start(&self) {
        self.started_ns.store(now_ns().max(1), Relaxed);
    }

    /// The completion path, shared by every engine. Call exactly once (or
    /// [`Job::report`] and then [`Job::release_fences`], once each).
    ///
    /// The fences go now; the outcome reaches `TDRV_IOC_JOB_WAIT` when the
    /// job is dropped, after it let go of its buffers, so that a caller who
    /// sees the job done also sees the memory of buffers it freed released.
    pub(crate) fn complete(&self, result: Result) {
        self.release_fences(result);
        let errno = match result {
            Ok(()) => 0,
            Err(e) => e.to_errno(),
        };
        self.outcome.store(errno, Relaxed);
    }

    /// Drops the job's fence marks. A failed job latches its errno on
    /// every destination (see `Fence::end_failed_write`). Separate from
    /// [`Job::report`] for a job whose DMA may still run after it failed:
    /// its destinations stay marked busy until the device lets go.
    pub(crate) fn release_fences(&self, result: Result) {
        for (i, t) in self.transfers.iter().enumerate() {
            t.src.fence.end(false, false);
            // A job counts one completion per distinct destination buffer,
            // however many of its descriptors write there.
            let last_for_dst = !self.transfers[i + 1..]
                .iter()
                .any(|later| Arc::ptr_eq(&later.dst, &t.dst));
            match result {
                Ok(()) => t.dst.fence.end(true, last_for_dst),
                Err(e) => t.dst.fence.end_failed_write(e.to_errno()),
            }
        }
    }

    /// Records the outcome for `TDRV_IOC_JOB_WAIT` and the statistics now,
    /// for a job whose buffers stay busy after it failed (see `edu.rs`).
    pub(crate) fn report(&self, result: Result) {
        if self.reported.xchg(true, Relaxed) {
            return;
        }
        self.report_now(result);
    }

    fn report_now(&self, result: Result) {
        let stats = &self.device.stats;
        let started = self.started_ns.load(Relaxed);
        if started != 0 {
            // At least 1 ns: a job that ran took time, even if a coarse
            // clock (a guest without a stable TSC) shows none.
            let busy = now_ns().saturating_sub(started).max(1) as u64;
            stats.busy_ns.add(busy, Relaxed);
            self.tracker.busy_ns.add(busy, Relaxed);
        }
        match result {
            Ok(()) => stats.jobs_completed.add(1, Relaxed),
            Err(e) if e == ecanceled() => stats.jobs_cancelled.add(1, Relaxed),
            Err(_) => stats.jobs_failed.add(1, Relaxed),
        }
        self.tracker.finish(self.id.load(Relaxed), self.bytes, result);
    }
}

#[pinned_drop]
impl PinnedDrop for Job {
    fn drop(mut self: Pin<&mut Self>) {
        // Buffers first (this may free their memory and give back their
        // channel bytes), then the outcome.
        drop(core::mem::take(self.as_mut().project().transfers));
        let errno = self.outcome.load(Relaxed);
        if errno != NO_OUTCOME && !self.reported.load(Relaxed) {
            self.report_now(if errno == 0 {
                Ok(())
            } else {
                Err(Error::from_errno(errno))
            });
        }
    }
}

struct TrackerState {
    /// Id of the next job to submit; ids start at 1.
    next_id: u64,
    /// Outcome of the last `JOB_WINDOW` jobs, at `id % JOB_WINDOW`:
    /// `PENDING`, 0, or a negative errno.
    ring: KVec<i32>,
    /// Jobs submitted and not finished.
    queued: u32,
    /// Bytes those jobs move.
    inflight_bytes: u64,
}

/// The jobs of one open file: ids, limits, outcomes and their waiters.
#[pin_data]
pub(crate) struct JobTracker {
    #[pin]
    state: Mutex<TrackerState>,
    #[pin]
    cv: CondVar,
    /// Set when the file is released.
    closed: Atomic<bool>,
    /// Nanoseconds the engine spent on this file's jobs.
    pub(crate) busy_ns: Atomic<u64>,
}

/// What `TDRV_IOC_JOB_WAIT` reports.
pub(crate) enum JobStatus {
    Pending,
    Done(i32),
}

impl JobTracker {
    pub(crate) fn new() -> Result<Arc<Self>> {
        let mut ring = KVec::with_capacity(JOB_WINDOW as usize, GFP_KERNEL_ACCOUNT)?;
        ring.resize(JOB_WINDOW as usize, 0, GFP_KERNEL_ACCOUNT)?;
        Arc::pin_init(
            pin_init!(Self {
                state <- new_mutex!(
                    TrackerState {
                        next_id: 1,
                        ring,
                        queued: 0,
                        inflight_bytes: 0,
                    },
                    "JobTracker::state"
                ),
                cv <- new_condvar!("JobTracker::cv"),
                closed: Atomic::new(false),
                busy_ns: Atomic::new(0),
            }),
            GFP_KERNEL_ACCOUNT,
        )
    }

    /// Jobs submitted and not finished.
    pub(crate) fn queued(&self) -> u32 {
        self.state.lock().queued
    }

    /// Marks the file closed: its jobs are cancelled from now on.
    pub(crate) fn close(&self) {
        self.closed.store(true, Release);
    }

    /// Creates a job from `transfers` and hands it to `device`'s engine.
    /// EAGAIN if the file has `limits.jobs` jobs queued, or if the job's
    /// bytes would pass `limits.inflight_bytes` (a lone job always fits).
    /// The tracker lock is held across id allocation and queueing, so one
    /// file's jobs reach the engine in id order. Returns the job id.
    pub(crate) fn submit(
        self: &Arc<Self>,
        device: &Arc<TdrvDevice>,
        transfers: KVec<Transfer>,
        limits: &Limits,
    ) -> Result<u64> {
        let bytes = Job::total_bytes(&transfers);
        // Cheap early refusal, before any allocation or waiting.
        self.check_limits(&self.state.lock(), bytes, limits)?;
        let job = ListArc::pin_init(
            try_pin_init!(Job {
                id: Atomic::new(0),
                transfers,
                bytes,
                tracker: self.clone(),
                device: device.clone(),
                started_ns: Atomic::new(0),
                outcome: Atomic::new(NO_OUTCOME),
                reported: Atomic::new(false),
                links <- ListLinks::new(),
            }),
            GFP_KERNEL_ACCOUNT,
        )?;
        mark(&job.transfers)?;
        let undo = job.clone_arc();
        let mut state = self.state.lock();
        let id = state.next_id;
        job.id.store(id, Relaxed);
        let queued = self
            .check_limits(&state, bytes, limits)
            .and_then(|()| device.engine().submit(job));
        if let Err(e) = queued {
            // Never queued: undo the marks without counting anything.
            unmark(&undo.transfers, undo.transfers.len(), false);
            return Err(e);
        }
        // Still under the lock, so the job's completion (which takes it)
        // comes after this.
        state.ring[(id % JOB_WINDOW) as usize] = PENDING;
        state.next_id += 1;
        state.queued += 1;
        state.inflight_bytes += bytes;
        device.stats.jobs_submitted.add(1, Relaxed);
        Ok(id)
    }

    fn check_limits(&self, state: &TrackerState, bytes: u64, limits: &Limits) -> Result {
        if state.queued >= limits.jobs {
            return Err(EAGAIN);
        }
        if state.queued > 0 && state.inflight_bytes + bytes > limits.inflight_bytes {
            return Err(EAGAIN);
        }
        Ok(())
    }

    fn finish(&self, id: u64, bytes: u64, result: Result) {
        let mut state = self.state.lock();
        state.ring[(id % JOB_WINDOW) as usize] = match result {
            Ok(()) => 0,
            Err(e) => e.to_errno(),
        };
        state.queued = state.queued.saturating_sub(1);
        state.inflight_bytes = state.inflight_bytes.saturating_sub(bytes);
        self.cv.notify_all();
    }

    fn status_locked(state: &TrackerState, id: u64) -> JobStatus {
        match state.ring[(id % JOB_WINDOW) as usize] {
            PENDING => JobStatus::Pending,
            errno => JobStatus::Done(errno),
        }
    }

    /// Waits for job `id`: EINVAL for an id this file never issued, ESTALE
    /// for one older than the last `JOB_WINDOW`, ETIMEDOUT if a timed wait
    /// expires; a signal ends it as in `Fence::wait_until`. A poll reports
    /// `Pending` instead of failing.
    pub(crate) fn wait(&self, id: u64, timeout: Timeout) -> Result<JobStatus> {
        let mut state = self.state.lock();
        if id == 0 || id >= state.next_id {
            return Err(EINVAL);
        }
        if state.next_id - id > JOB_WINDOW {
            return Err(estale());
        }
        let mut left = match timeout {
            Timeout::Jiffies(j) => j,
            _ => 0,
        };
        loop {
            let status = Self::status_locked(&state, id);
            if matches!(status, JobStatus::Done(_)) {
                return Ok(status);
            }
            match timeout {
                Timeout::Poll => return Ok(status),
                Timeout::Forever => {
                    if self.cv.wait_interruptible(&mut state) {
                        return Err(ERESTARTSYS);
                    }
                }
                Timeout::Jiffies(_) => match self.cv.wait_interruptible_timeout(&mut state, left) {
                    CondVarTimeoutResult::Woken { jiffies } => left = jiffies,
                    CondVarTimeoutResult::Timeout => {
                        return match Self::status_locked(&state, id) {
                            JobStatus::Pending => Err(ETIMEDOUT),
                            done => Ok(done),
                        };
                    }
                    CondVarTimeoutResult::Signal { .. } => return Err(EINTR),
                },
            }
        }
    }
}
