// SPDX-License-Identifier: GPL-2.0

//! Asynchronous copy jobs and the one completion path every engine calls.
//!
//! Life of a job:
//! 1. `TDRV_IOC_SUBMIT` resolves the descriptors into [`Transfer`]s, which
//!    hold references to their buffers, and [`JobTracker::submit`] marks a
//!    pending device read on every source and a pending device write on
//!    every destination (the seed's `tensor_async_update(.., release = false)`),
//!    waiting first for synchronous CPU copies of those buffers to end.
//! 2. [`JobTracker::submit`] gives it the file's next id and hands it to
//!    the device's engine (`engine.rs`), within the file's limits. A job
//!    with in-fences, and any later job of its file, is held by the file
//!    until they signal, then handed over by the file's dispatch work
//!    (see `fence_fd.rs`).
//!    An idle engine may instead let the submitting thread run a small
//!    job itself, after the tracker lock is dropped
//!    ([`Engine::claim`](crate::engine::Engine::claim);
//!    the software device does, see `backends/soft.rs`): the job is then
//!    complete, and its waiters woken (its out-fence signalled), before
//!    SUBMIT returns. Such a job without fences lives on the submitter's
//!    stack, so it allocates nothing.
//! 3. The engine runs the transfers and calls [`Job::complete`] exactly
//!    once, with the result. That drops the pending marks (waking fence
//!    waiters when a count reaches zero), bumps the completion count of
//!    each destination if the job succeeded, and records the outcome in
//!    the submitting file's [`JobTracker`], waking `TDRV_IOC_JOB_WAIT`.
//!
//! 4. When the job is dropped (after its buffers), its out-fence, if it
//!    has one, is signalled with the outcome.
//!
//! A failed or cancelled job still releases its fences: waiters are never
//! left hanging. When its file closes, a job that has not started is
//! cancelled (ECANCELED) and a running one stops after the piece in
//! flight.

use kernel::{
    bindings,
    iov::IovIterDest,
    list::{
        impl_list_arc_safe,
        impl_list_item,
        List,
        ListArc,
        ListLinks, //
    },
    new_condvar,
    new_mutex,
    new_spinlock,
    prelude::*,
    sync::{
        atomic::{
            Acquire,
            Atomic,
            Full,
            Relaxed,
            Release, //
        },
        Arc,
        CondVarTimeoutResult,
        Mutex,
        SpinLock, //
    },
    transmute::AsBytes,
    workqueue::{
        impl_has_work,
        new_work,
        Work,
        WorkItem, //
    }, //
};

use crate::{
    buffer::Buffer,
    event::{
        EventBudget,
        EventQueue,
        EventRing,
        EventRoom,
        EventTable,
        JobEvent,
        NoRoom, //
    },
    device::{
        Limits,
        TdrvDevice, //
    },
    engine::{
        fail_all,
        Prepared, //
    },
    fence::Timeout,
    fence_fd::{
        dispatch_queue,
        InFences,
        OutFence,
        Signalling, //
    },
    glue::{
        self,
        PollQueue,
        ReadWait, //
    },
    range::ByteRange,
    resv::ResvUses,
    uapi::{
        self,
        ecanceled,
        estale, //
    },
    waitqueue::{
        Sleepers,
        WaitQueue, //
    }, //
};

pub(crate) use crate::uapi::JOB_WINDOW;

/// The monotonic clock in nanoseconds.
fn now_ns() -> i64 {
    // SAFETY: `ktime_get` reads the monotonic clock; callable from any
    // context.
    unsafe { kernel::bindings::ktime_get() }
}

/// `Job::outcome` before the job completed.
const NO_OUTCOME: i32 = 1;

/// Events `read(2)` copies out per copy call (24 bytes each, on the
/// stack).
const READ_BATCH: usize = 16;

/// Status of a job that has not finished, in its [`StatusRing`] slot.
const PENDING: i32 = 1;

/// One slot of a [`StatusRing`]: the job that last took it, and its status.
#[derive(Clone, Copy, Default)]
struct Slot {
    /// Job id; 0 (no job has it) until the first job takes the slot.
    id: u64,
    /// `PENDING`, 0, or a negative errno.
    status: i32,
}

/// The outcome of a file's last `JOB_WINDOW` jobs, at `id % JOB_WINDOW`.
///
/// Each slot keeps the id of the job it belongs to: job N can still be
/// running when job N + `JOB_WINDOW` takes its slot (the jobs in between
/// ended), and must then neither report that job's status as its own nor,
/// when it ends, overwrite it.
struct StatusRing {
    slots: KVVec<Slot>,
}

impl StatusRing {
    fn new() -> Result<Self> {
        let mut slots = KVVec::with_capacity(JOB_WINDOW as usize, GFP_KERNEL_ACCOUNT)?;
        slots.resize(JOB_WINDOW as usize, Slot::default(), GFP_KERNEL_ACCOUNT)?;
        Ok(Self { slots })
    }

    fn slot(&mut self, id: u64) -> &mut Slot {
        &mut self.slots[(id % JOB_WINDOW) as usize]
    }

    /// Job `id` is submitted: it takes its slot, pending.
    fn issue(&mut self, id: u64) {
        *self.slot(id) = Slot {
            id,
            status: PENDING,
        };
    }

    /// Job `id` ended with `status` (0 or a negative errno). Dropped if a
    /// later job took the slot meanwhile.
    fn finish(&mut self, id: u64, status: i32) {
        let slot = self.slot(id);
        if slot.id == id {
            slot.status = status;
        }
    }

    /// The status of job `id`; `None` if the slot is not (or no longer)
    /// job `id`'s.
    fn status(&self, id: u64) -> Option<JobStatus> {
        let slot = self.slots[(id % JOB_WINDOW) as usize];
        (slot.id == id).then_some(match slot.status {
            PENDING => JobStatus::Pending,
            errno => JobStatus::Done(errno),
        })
    }
}

/// One buffer-to-buffer copy of a job.
pub(crate) struct Transfer {
    pub(crate) src: Arc<Buffer>,
    pub(crate) src_range: ByteRange,
    pub(crate) dst: Arc<Buffer>,
    pub(crate) dst_offset: usize,
}

/// The transfers of a job. A single one, the common case, is stored in
/// the job itself, so that submitting it allocates nothing but the job.
#[derive(Default)]
pub(crate) enum Transfers {
    #[default]
    Empty,
    One(Transfer),
    Many(KVec<Transfer>),
}

impl Transfers {
    /// Room for `count` transfers: allocates only for more than one.
    #[inline]
    pub(crate) fn with_capacity(count: usize, flags: kernel::alloc::Flags) -> Result<Self> {
        Ok(if count <= 1 {
            Self::Empty
        } else {
            Self::Many(KVec::with_capacity(count, flags)?)
        })
    }

    /// Appends `t`; allocates only past the capacity asked for.
    #[inline]
    pub(crate) fn push(&mut self, t: Transfer, flags: kernel::alloc::Flags) -> Result {
        match self {
            Self::Empty => *self = Self::One(t),
            Self::Many(v) => v.push(t, flags)?,
            Self::One(_) => {
                let mut v = KVec::with_capacity(2, flags)?;
                if let Self::One(first) = core::mem::take(self) {
                    v.push(first, flags)?;
                }
                v.push(t, flags)?;
                *self = Self::Many(v);
            }
        }
        Ok(())
    }
}

impl core::ops::Deref for Transfers {
    type Target = [Transfer];

    #[inline]
    fn deref(&self) -> &[Transfer] {
        match self {
            Self::Empty => &[],
            Self::One(t) => core::slice::from_ref(t),
            Self::Many(v) => v,
        }
    }
}

impl<'a> IntoIterator for &'a Transfers {
    type Item = &'a Transfer;
    type IntoIter = core::slice::Iter<'a, Transfer>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// A submitted job.
#[pin_data(PinnedDrop)]
pub(crate) struct Job {
    /// Set under the tracker lock before the job is queued.
    id: Atomic<u64>,
    pub(crate) transfers: Transfers,
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
    /// Set by [`Job::abandon`]: its fence marks are abandoned ones.
    abandoned: Atomic<bool>,
    /// Set by [`Job::begin_access`]: the job holds an access to each of
    /// its buffers, which [`Job::release_fences`] ends.
    accessing: Atomic<bool>,
    /// The `sync_file`s the job waits for before it may reach the engine.
    in_fences: Option<InFences>,
    /// Set once every in-fence signalled (at once without in-fences).
    deps_ready: Atomic<bool>,
    /// Signalled with the outcome when the job is dropped.
    out_fence: Option<OutFence>,
    /// The user data of the completion event asked for in SUBMIT
    /// (`TDRV_SUBMIT_NOTIFY`), whose room in its file's ring is taken.
    notify: Option<u64>,
    /// What the engine set aside at SUBMIT, until it takes it back.
    #[pin]
    prepared: SpinLock<Option<Prepared>>,
    /// Links of the engine's queue, or of its file's held jobs.
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
    /// A job of `tracker`'s file on `device`, not yet submitted.
    #[allow(clippy::too_many_arguments)]
    fn new(
        tracker: &Arc<JobTracker>,
        device: &Arc<TdrvDevice>,
        transfers: Transfers,
        bytes: u64,
        in_fences: Option<InFences>,
        out_fence: Option<OutFence>,
        prepared: Option<Prepared>,
        notify: Option<u64>,
    ) -> impl PinInit<Self, Error> {
        let ready = in_fences.is_none();
        let tracker = tracker.clone();
        let device = device.clone();
        try_pin_init!(Job {
            id: Atomic::new(0),
            transfers,
            bytes,
            tracker,
            device,
            started_ns: Atomic::new(0),
            outcome: Atomic::new(NO_OUTCOME),
            reported: Atomic::new(false),
            abandoned: Atomic::new(false),
            accessing: Atomic::new(false),
            in_fences,
            deps_ready: Atomic::new(ready),
            out_fence,
            notify,
            prepared <- new_spinlock!(prepared, "Job::prepared"),
            links <- ListLinks::new(),
        }? Error)
    }

    /// Takes what the engine set aside for the job at SUBMIT
    /// ([`Engine::prepare`](crate::engine::Engine::prepare)).
    pub(crate) fn take_prepared(&self) -> Option<Prepared> {
        self.prepared.lock().take()
    }

    /// The bytes `transfers` move.
    #[inline]
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

    /// Before the engine touches the job's buffers: starts an access to
    /// each (see [`Buffer::begin_access`](crate::buffer::Buffer::begin_access)),
    /// which [`Job::release_fences`] ends. ENODEV, with none held, if a
    /// foreign import among them was revoked by its exporter: the engine
    /// then completes the job with it without running it. No lock (but a
    /// wait queue's on failure), no memory: engines call it on their
    /// dispatch paths. An engine whose imports are revocable
    /// ([`Engine::revocable_imports`](crate::engine::Engine::revocable_imports))
    /// must call it.
    pub(crate) fn begin_access(&self) -> Result {
        let bufs = self.transfers.iter().flat_map(|t| [&t.src, &t.dst]);
        for (i, b) in bufs.clone().enumerate() {
            if let Err(e) = b.begin_access() {
                for held in bufs.take(i) {
                    held.end_access();
                }
                return Err(e);
            }
        }
        self.accessing.store(true, Relaxed);
        Ok(())
    }

    /// True once a foreign import among the job's buffers was revoked by
    /// its exporter: an engine stops at its next piece or chunk (ENODEV).
    pub(crate) fn revoked(&self) -> bool {
        self.transfers.iter().any(|t| t.src.revoked() || t.dst.revoked())
    }

    /// Ends the accesses of [`Job::begin_access`], if any.
    fn end_access(&self) {
        if self.accessing.xchg(false, Relaxed) {
            for t in self.transfers.iter() {
                t.src.end_access();
                t.dst.end_access();
            }
        }
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
        // The engine no longer touches the buffers: a revocation waiting
        // for them may unmap them.
        self.end_access();
        if self.abandoned.load(Relaxed) {
            let errno = match result {
                Ok(()) => EIO.to_errno(),
                Err(e) => e.to_errno(),
            };
            for t in self.transfers.iter() {
                t.src.fence.end_abandoned(false, 0);
                t.dst.fence.end_abandoned(true, errno);
            }
            return;
        }
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
        // Kept for the out-fence, signalled when the job is dropped.
        self.outcome.store(
            match result {
                Ok(()) => 0,
                Err(e) => e.to_errno(),
            },
            Relaxed,
        );
        self.report_now(result);
    }

    /// The job failed with `result` but the device may still run it (a
    /// dead queue keeps it): reports the outcome now, and marks its fence
    /// marks abandoned, so that waits only they would hold up fail
    /// instead of sleeping until the device lets go (see
    /// `Fence::abandon`). [`Job::release_fences`] ends them later.
    pub(crate) fn abandon(&self, result: Result) {
        self.report(result);
        if self.abandoned.xchg(true, Relaxed) {
            return;
        }
        let errno = match result {
            Ok(()) => EIO.to_errno(),
            Err(e) => e.to_errno(),
        };
        for t in self.transfers.iter() {
            t.src.fence.abandon(false, 0);
            t.dst.fence.abandon(true, errno);
        }
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
        self.tracker
            .finish(self.id.load(Relaxed), self.bytes, result, self.notify);
    }
}

#[pinned_drop]
impl PinnedDrop for Job {
    fn drop(mut self: Pin<&mut Self>) {
        // In-fence callbacks first: this waits for one that is running,
        // which may still look at the job.
        drop(self.as_mut().project().in_fences.take());
        // An engine that began accesses ended them with `release_fences`;
        // this only guards against one that did not.
        self.end_access();
        // Buffers next (this may free their memory and give back their
        // channel bytes), then the outcome, then the out-fence.
        drop(core::mem::take(self.as_mut().project().transfers));
        let errno = self.outcome.load(Relaxed);
        if errno != NO_OUTCOME && !self.reported.load(Relaxed) {
            self.report_now(if errno == 0 {
                Ok(())
            } else {
                Err(Error::from_errno(errno))
            });
        }
        if let Some(fence) = self.as_mut().project().out_fence.take() {
            // A job that never ran (SUBMIT failed) counts as cancelled.
            fence.signal(if errno == NO_OUTCOME {
                ecanceled().to_errno()
            } else {
                errno
            });
        }
    }
}

impl Job {
    /// The job is in its engine's queue (or claimed by it): see `resv.rs`.
    fn reached_engine(&self) {
        if let Some(f) = &self.out_fence {
            f.set_queued();
        }
    }

    /// Whether every in-fence of the job has signalled.
    fn deps_ready(&self) -> bool {
        self.deps_ready.load(Acquire)
    }

    /// The error of a failed in-fence, once all signalled.
    fn deps_error(&self) -> Result {
        self.in_fences.as_ref().map_or(Ok(()), InFences::error)
    }
}

/// The last in-fence of the job at `ctx` signalled (called by
/// `fence_fd.c`, from any context): queue its file's dispatch work.
///
/// # Safety
///
/// `ctx` is the address of a live [`Job`] that armed its in-fences with it
/// (see `JobTracker::submit`). The job stays alive during the call: its
/// drop removes the callbacks first, which waits for this call.
#[no_mangle]
unsafe extern "C" fn tdrv_deps_ready(ctx: *mut core::ffi::c_void) {
    // SAFETY: See above.
    let job = unsafe { &*ctx.cast::<Job>() };
    job.deps_ready.store(true, Release);
    // Fails only if the work is already queued, and that run will see the
    // job ready.
    let _ = dispatch_queue().enqueue(job.tracker.clone());
}

struct TrackerState {
    /// Id of the next job to submit; ids start at 1.
    next_id: u64,
    /// Outcome of the last `JOB_WINDOW` jobs.
    ring: StatusRing,
    /// Jobs submitted and not finished.
    queued: u32,
    /// Bytes those jobs move.
    inflight_bytes: u64,
    /// Jobs submitted and not yet handed to the engine, in id order: those
    /// waiting for in-fences, and every later job of the file (a file's
    /// jobs reach the engine in id order).
    held: List<Job>,
    /// Threads in `TDRV_IOC_JOB_WAIT` or in `read(2)` of events, asleep
    /// or about to be.
    sleepers: u32,
    /// Completion events asked for and not yet read.
    events: EventQueue,
}

/// Room taken for one event ([`JobTracker::take_event_room`]), given back
/// on drop unless kept: by the job or the queue that now holds the event.
struct RoomGuard<'a>(Option<&'a EventRoom>);

impl RoomGuard<'_> {
    /// The event holds the room now.
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for RoomGuard<'_> {
    fn drop(&mut self) {
        if let Some(room) = self.0 {
            room.give_back(1);
        }
    }
}

impl Sleepers for TrackerState {
    fn sleepers(&mut self) -> &mut u32 {
        &mut self.sleepers
    }
}

/// The jobs of one open file: ids, limits, outcomes and their waiters.
#[pin_data]
pub(crate) struct JobTracker {
    #[pin]
    state: Mutex<TrackerState>,
    #[pin]
    wq: WaitQueue,
    /// Set when the file is released.
    closed: Atomic<bool>,
    /// `TrackerState::queued`, copied there under the lock: SUBMIT refuses
    /// a file at its job cap early without taking the lock.
    queued_hint: Atomic<u32>,
    /// Nanoseconds the engine spent on this file's jobs.
    pub(crate) busy_ns: Atomic<u64>,
    /// Hands held jobs to the engine once their in-fences signalled.
    #[pin]
    dispatch: Work<JobTracker>,
    /// Held by SUBMIT from a job's implicit synchronisation until it has
    /// its id (see `resv.rs`). Never taken on a completion path.
    #[pin]
    submit_lock: Mutex<()>,
    /// `poll(2)` and epoll of the file's completion events.
    #[pin]
    poll: PollQueue,
    /// How many completion events the file has, and may have.
    room: EventRoom,
    /// Whether an event is ready, copied under the lock: `poll` reads it
    /// without taking the lock.
    events_ready: Atomic<bool>,
    /// Set, under the lock, once the file has its table of parked events:
    /// a request for an event then takes the lock once, not twice.
    events_table: Atomic<bool>,
    /// Whether someone may have looked at the file's readiness (`poll`, a
    /// read) since pollers were last woken. A ready event wakes pollers
    /// only then: a poller woken before has not looked yet, so another
    /// wake would tell it nothing (epoll's callback for it is most of an
    /// event's cost), while every event after a look still wakes them,
    /// the edge an EPOLLET waiter needs.
    poll_armed: Atomic<bool>,
}

impl_has_work! {
    impl HasWork<Self> for JobTracker { self.dispatch }
}

impl WorkItem for JobTracker {
    type Pointer = Arc<JobTracker>;

    fn run(this: Arc<JobTracker>) {
        this.dispatch_ready();
    }
}

/// What `TDRV_IOC_JOB_WAIT` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum JobStatus {
    Pending,
    Done(i32),
}

impl JobTracker {
    /// The tracker of a new file, which may have `max_events` events
    /// queued, from the device's `budget`.
    pub(crate) fn new(max_events: u32, budget: Arc<EventBudget>) -> Result<Arc<Self>> {
        let ring = StatusRing::new()?;
        Arc::pin_init(
            pin_init!(Self {
                state <- new_mutex!(
                    TrackerState {
                        next_id: 1,
                        ring,
                        queued: 0,
                        inflight_bytes: 0,
                        held: List::new(),
                        sleepers: 0,
                        events: EventQueue::new(),
                    },
                    "JobTracker::state"
                ),
                wq <- WaitQueue::new(new_condvar!("JobTracker::cv")),
                closed: Atomic::new(false),
                queued_hint: Atomic::new(0),
                busy_ns: Atomic::new(0),
                dispatch <- new_work!("JobTracker::dispatch"),
                submit_lock <- new_mutex!((), "JobTracker::submit_lock"),
                poll <- PollQueue::new(),
                room: EventRoom::new(max_events, budget),
                events_ready: Atomic::new(false),
                events_table: Atomic::new(false),
                poll_armed: Atomic::new(true),
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

    /// Creates a job from `transfers` and hands it to `device`'s engine,
    /// or holds it until `in_fences` have signalled (and so every job of
    /// the file submitted after a held one). The job signals `out_fence`
    /// when it ends. EAGAIN if the file has `limits.jobs` jobs queued, or
    /// if the job's bytes would pass `limits.inflight_bytes` (a lone job
    /// always fits). The tracker lock is held across id allocation and
    /// queueing, so one file's jobs reach the engine in id order. Returns
    /// the job id.
    pub(crate) fn submit(
        self: &Arc<Self>,
        device: &Arc<TdrvDevice>,
        mut transfers: Transfers,
        limits: &Limits,
        in_fences: Option<InFences>,
        out_fence: Option<OutFence>,
        notify: Option<u64>,
    ) -> Result<u64> {
        let bytes = Job::total_bytes(&transfers);
        // Cheap early refusal, before any allocation or waiting; checked
        // again under the lock.
        if self.queued_hint.load(Relaxed) >= limits.jobs {
            return Err(EAGAIN);
        }
        // `TDRV_SUBMIT_NOTIFY`: room for the event in the file's ring is
        // taken here, before the lock, which the completion path takes (a
        // full ring grows here); the job carries the event, and its end
        // writes it into that room. Nothing is allocated per event.
        let room = match notify {
            Some(_) => {
                self.take_event_room()?;
                RoomGuard(Some(&self.room))
            }
            None => RoomGuard(None),
        };
        // A revoked import has no memory behind it. (One revoked from here
        // on makes the job end with ENODEV instead, see `begin_access`.)
        if transfers.iter().any(|t| t.src.revoked() || t.dst.revoked()) {
            return Err(ENODEV);
        }
        // Implicit synchronisation (see `resv.rs`): a job whose buffers
        // have reservation objects gets a fence there and waits for the
        // fences it finds, before it takes its id.
        let uses = ResvUses::of(&transfers)?;
        let mut in_fences = in_fences;
        let mut out_fence = out_fence;
        let mut order = None;
        if let Some(uses) = uses {
            let engine = Arc::as_ptr(device).cast::<core::ffi::c_void>();
            let fence = match out_fence.take() {
                Some(f) => f,
                None => OutFence::new(engine)?,
            };
            // Held until the job has its id: see `resv.rs`.
            order = Some(self.submit_lock.lock());
            in_fences = uses.attach(&fence, engine, in_fences)?;
            out_fence = Some(fence);
        }
        if in_fences.is_none()
            && out_fence.is_none()
            && device.engine().may_claim(bytes, transfers.len())
        {
            // A job the engine may let this thread run lives on the stack:
            // nothing outlives SUBMIT that could hold a reference to it.
            pin_init::stack_try_pin_init!(let job: Job =? Job::new(self, device, transfers, bytes, None, None, None, notify));
            mark(&job.transfers)?;
            let mut state = self.state.lock();
            if let Err(e) = self.check_limits(&state, bytes, limits) {
                unmark(&job.transfers, job.transfers.len(), false);
                drop(state);
                return Err(e);
            }
            if state.held.is_empty() && device.engine().claim(&job) {
                let id = state.next_id;
                job.id.store(id, Relaxed);
                // Issued: the job's end writes its event.
                room.keep();
                self.issue(&mut state, bytes, device);
                drop(state);
                device.engine().run_claimed(&job);
                // Dropping the job reports it (taking the tracker lock)
                // before SUBMIT returns.
                return Ok(id);
            }
            drop(state);
            // Queued after all, as a job on the heap, which marks its
            // buffers again. The one left here was never submitted: its
            // drop reports nothing.
            unmark(&job.transfers, job.transfers.len(), false);
            transfers = core::mem::take(job.as_mut().project().transfers);
        }
        // Before the tracker lock, which the completion path takes: the
        // engine's dispatch and completion then allocate nothing.
        let prepared = device.engine().prepare(&transfers)?;
        let job = ListArc::pin_init(
            Job::new(
                self, device, transfers, bytes, in_fences, out_fence, prepared, notify,
            ),
            GFP_KERNEL_ACCOUNT,
        )?;
        mark(&job.transfers)?;
        let undo = job.clone_arc();
        let mut failed = None;
        // The job, when the engine let this thread run it after all (a
        // job with an out-fence, or one the stack path could not place).
        let mut claimed = None;
        let mut state = self.state.lock();
        let id = state.next_id;
        job.id.store(id, Relaxed);
        let queued = self.check_limits(&state, bytes, limits).and_then(|()| {
            if let Some(deps) = &job.in_fences {
                if !device.is_bound() {
                    // Unbind has swept (or is sweeping) the held jobs.
                    return Err(ENODEV);
                }
                // SAFETY: Armed once, here. The job (an `Arc`, so at a
                // fixed address) outlives its `InFences`, which its drop
                // frees first.
                if unsafe { deps.arm(core::ptr::from_ref::<Job>(&*job).cast()) } {
                    job.deps_ready.store(true, Release);
                }
            }
            if !state.held.is_empty() || !job.deps_ready() {
                if !state.held.is_empty() && job.deps_ready() {
                    // Behind a held job: the dispatch work takes it along.
                    let _ = dispatch_queue().enqueue(self.clone());
                }
                state.held.push_back(job);
                return Ok(());
            }
            if let Err(e) = job.deps_error() {
                // An in-fence failed already: so does the job, unrun.
                failed = Some(e);
                return Ok(());
            }
            if job.in_fences.is_none()
                && device.engine().may_claim(bytes, job.transfers.len())
                && device.engine().claim(&job)
            {
                job.reached_engine();
                claimed = Some(job);
                return Ok(());
            }
            device.engine().submit(job)?;
            undo.reached_engine();
            Ok(())
        });
        if let Err(e) = queued {
            // Never queued: undo the marks without counting anything (the
            // event's room goes back with `room`).
            unmark(&undo.transfers, undo.transfers.len(), false);
            drop(state);
            return Err(e);
        }
        // Issued: the job's end, wherever it runs, writes its event.
        room.keep();
        self.issue(&mut state, bytes, device);
        drop(state);
        drop(order);
        if let Some(e) = failed {
            undo.complete(Err(e));
        }
        if let Some(job) = claimed {
            device.engine().run_claimed(&job);
        }
        // The last reference of a job that ended here: reports it (taking
        // the tracker lock) and signals its out-fence before SUBMIT returns.
        drop(undo);
        Ok(id)
    }

    /// Counts the job with the file's next id (already stored in it)
    /// submitted, under the tracker lock, so that the job's completion
    /// (which takes it) comes after this.
    fn issue(&self, state: &mut TrackerState, bytes: u64, device: &TdrvDevice) {
        let id = state.next_id;
        state.ring.issue(id);
        state.next_id += 1;
        state.queued += 1;
        self.queued_hint.store(state.queued, Relaxed);
        state.inflight_bytes += bytes;
        device.stats.jobs_submitted.add(1, Relaxed);
    }

    /// The dispatch work: hands the held jobs whose in-fences signalled to
    /// the engine, oldest first, stopping at the first that still waits.
    /// A job with a failed in-fence ends with its error; one the engine
    /// refuses (unbound: ENODEV, recovering: EIO) with the engine's.
    fn dispatch_ready(&self) {
        // Held jobs' out-fences wait for this: no allocation here.
        let _signalling = Signalling::begin();
        loop {
            // Jobs that ended here, and the last one handed to the engine
            // (which may already have finished it): dropped (which reports
            // them, taking the lock) after the lock is released.
            let mut ended = List::<Job>::new();
            let mut handed = None;
            {
                let mut state = self.state.lock();
                loop {
                    let mut cursor = state.held.cursor_front();
                    let Some(front) = cursor.peek_next() else {
                        break;
                    };
                    if !front.arc().deps_ready() {
                        break;
                    }
                    let job = front.remove();
                    let result = if self.closed.load(Acquire) {
                        Err(ecanceled())
                    } else {
                        job.deps_error()
                    };
                    if let Err(e) = result {
                        job.complete(Err(e));
                        ended.push_back(job);
                        continue;
                    }
                    let keep = job.clone_arc();
                    let r = keep.device.engine().submit(job);
                    if r.is_ok() {
                        keep.reached_engine();
                    }
                    handed = Some((keep, r));
                    break;
                }
            }
            drop(ended);
            match handed {
                None => return,
                Some((job, Ok(()))) => drop(job),
                Some((job, Err(e))) => {
                    job.complete(Err(e));
                    drop(job);
                }
            }
        }
    }

    /// Ends every held job with `err` (ECANCELED when the file closes,
    /// ENODEV at unbind), removing their in-fence callbacks.
    pub(crate) fn cancel_held(&self, err: Error) {
        let held = core::mem::take(&mut self.state.lock().held);
        fail_all(held, err);
    }

    /// Waits until the dispatch work is idle. After `close` and
    /// `cancel_held` nothing queues it again, so none of this module's
    /// work is pending once the file is released.
    pub(crate) fn flush_dispatch(&self) {
        // SAFETY: `dispatch` is an initialised, pinned `Work` that lives
        // as long as `self`.
        unsafe { bindings::flush_work(Work::raw_get(&raw const self.dispatch)) };
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

    /// Job `id`, which moved `bytes`, ended with `result`; `notify` is the
    /// user data of the event asked for in SUBMIT.
    fn finish(&self, id: u64, bytes: u64, result: Result, notify: Option<u64>) {
        let errno = match result {
            Ok(()) => 0,
            Err(e) => e.to_errno(),
        };
        // JOB_NOTIFY events that waited for the job: freed after the lock.
        let mut spent = List::new();
        let mut state = self.state.lock();
        state.ring.finish(id, errno);
        state.queued = state.queued.saturating_sub(1);
        self.queued_hint.store(state.queued, Relaxed);
        state.inflight_bytes = state.inflight_bytes.saturating_sub(bytes);
        // After the status: a reader of the event finds JOB_WAIT agreeing.
        let mut delivered = state.events.deliver(id, errno, &mut spent);
        if let Some(user_data) = notify {
            state.events.ready_now(id, errno, user_data);
            delivered = true;
        }
        if delivered {
            self.events_ready.store(true, Release);
        }
        self.wq.wake_all(state);
        if delivered {
            self.wake_pollers();
        }
        drop(spent);
    }

    /// Wakes pollers if someone looked since they were last woken (see
    /// `poll_armed`). Call after `events_ready` was set.
    fn wake_pollers(&self) {
        // Full: after the store of `events_ready`, as `poll` arms before it
        // loads that flag, so either `poll` sees the event or this sees
        // the arm.
        if self.poll_armed.xchg(false, Full) {
            self.poll.wake();
        }
    }

    /// `TDRV_IOC_JOB_NOTIFY`: queues an event for job `id` when it ends
    /// (now if it has). EINVAL for an id this file never issued, ESTALE
    /// for one older than the last `JOB_WINDOW`, ENOSPC past the file's
    /// `file_max_events` or the device's `device_max_events`.
    pub(crate) fn notify(&self, id: u64, user_data: u64) -> Result {
        // Before the lock, which the completion path takes: the event's
        // room (growing the ring if full), the event, in case it must wait
        // for its job, and at the first, the table where it waits.
        if let Err(e) = self.take_event_room() {
            // A bad id is EINVAL or ESTALE whatever the room: checked under
            // the lock on this path only.
            Self::check_id(&self.state.lock(), id)?;
            return Err(e);
        }
        let room = RoomGuard(Some(&self.room));
        let ev = JobEvent::new(id, user_data)?;
        let table = self.new_event_table()?;
        let mut state = self.state.lock();
        let spare = self.install_event_table(&mut state, table);
        let (r, unused) = match Self::queue_event(&mut state, id, ev) {
            Ok(unused) => {
                room.keep();
                (Ok(()), unused)
            }
            Err((e, unused)) => (Err(e), unused),
        };
        let ready = state.events.has_ready();
        self.events_ready.store(ready, Release);
        self.wq.wake_all(state);
        if ready {
            self.wake_pollers();
        }
        drop(spare);
        drop(unused);
        r
    }

    /// Takes room for one event in the file's ring (see [`EventRoom`]),
    /// growing the ring first if it is full: ENOSPC past the file's
    /// `file_max_events` or the device's `device_max_events`. Allocates,
    /// so call without the tracker lock.
    fn take_event_room(&self) -> Result {
        loop {
            match self.room.take() {
                Ok(()) => return Ok(()),
                Err(NoRoom::Full) => return Err(ENOSPC),
                Err(NoRoom::Grow(size)) => {
                    let ring = EventRing::new(self.room.next_ring_size(size))?;
                    let unused = self.state.lock().events.install_ring(ring, &self.room);
                    drop(unused);
                }
            }
        }
    }

    /// The file's table of parked events, allocated (without the lock,
    /// which the completion path takes) unless it has one.
    fn new_event_table(&self) -> Result<Option<EventTable>> {
        if self.events_table.load(Acquire) {
            return Ok(None);
        }
        Ok(Some(EventQueue::new_table()?))
    }

    /// Installs `table` (see [`EventQueue::install_table`]); returns the
    /// one not used, to be freed after the lock.
    fn install_event_table(
        &self,
        state: &mut TrackerState,
        table: Option<EventTable>,
    ) -> Option<EventTable> {
        let spare = state.events.install_table(table);
        if !state.events.needs_table() {
            self.events_table.store(true, Release);
        }
        spare
    }

    /// Queues JOB_NOTIFY's event `ev` for job `id` (its room taken):
    /// parked if the job has not ended, else ready at once. Returns the
    /// event if it was not kept (to be freed after the lock), and on error
    /// the errno.
    #[allow(clippy::type_complexity)]
    fn queue_event(
        state: &mut TrackerState,
        id: u64,
        ev: ListArc<JobEvent>,
    ) -> core::result::Result<Option<ListArc<JobEvent>>, (Error, Option<ListArc<JobEvent>>)> {
        if let Err(e) = Self::check_id(state, id) {
            return Err((e, Some(ev)));
        }
        let status = match Self::status_locked(state, id) {
            Ok(JobStatus::Pending) => None,
            Ok(JobStatus::Done(errno)) => Some(errno),
            Err(e) => return Err((e, Some(ev))),
        };
        state
            .events
            .queue(id, ev, status)
            .map_err(|ev| (EINVAL, Some(ev)))
    }

    /// EINVAL for an id this file never issued, ESTALE for one older than
    /// the last `JOB_WINDOW`.
    fn check_id(state: &TrackerState, id: u64) -> Result {
        if id == 0 || id >= state.next_id {
            return Err(EINVAL);
        }
        if state.next_id - id > JOB_WINDOW {
            return Err(estale());
        }
        Ok(())
    }

    /// `read(2)` of the file: copies whole ready events to `out`, oldest
    /// first, sleeping until one is ready unless `wait` forbids it
    /// (EAGAIN). EINVAL if `out` cannot hold one; EFAULT (losing nothing)
    /// if none could be copied; a signal ends the sleep (ERESTARTSYS).
    ///
    /// One reader at a time copies (the others wait, interruptibly): the
    /// copy runs unlocked and may fault, and what it could not copy stays
    /// at the front, so a second reader must not take later events
    /// meanwhile. Whatever the copy left, and whatever completed during
    /// it, wakes the sleepers and poll() again.
    pub(crate) fn read_events(&self, out: &mut IovIterDest<'_>, wait: ReadWait) -> Result<usize> {
        const SIZE: usize = core::mem::size_of::<uapi::Event>();
        let max = out.len() / SIZE;
        if max == 0 {
            return Err(EINVAL);
        }
        let mut state = match wait {
            ReadWait::NoWait => self.state.try_lock().ok_or(EAGAIN)?,
            ReadWait::Block | ReadWait::NonBlock => self.state.lock(),
        };
        while !state.events.readable() {
            if wait != ReadWait::Block {
                return Err(EAGAIN);
            }
            if self.wq.wait_interruptible(&mut state) {
                return Err(ERESTARTSYS);
            }
        }
        state.events.begin_read();
        // A batch at a time: copied from the ring under the lock, then out
        // without it (user memory may fault, and the completion path takes
        // the lock). The events stay in the ring until consumed below, so
        // what a fault keeps from userspace stays, in order.
        let mut copied = 0usize;
        let mut batch = [uapi::Event::default(); READ_BATCH];
        loop {
            let want = (max - copied).min(READ_BATCH);
            let n = state.events.peek(copied, &mut batch[..want]);
            if n == 0 {
                break;
            }
            drop(state);
            // Whole events only: a partly copied one stays (its bytes are
            // past what the read returns).
            let whole = out.copy_to_iter(batch[..n].as_bytes()) / SIZE;
            copied += whole;
            state = self.state.lock();
            if whole < n {
                break;
            }
        }
        state.events.end_read(copied);
        self.room.give_back(copied as u32);
        let ready = state.events.has_ready();
        self.events_ready.store(ready, Release);
        if !ready {
            // A read is a look: the next event wakes pollers. (Under the
            // lock, which the completion path takes to deliver.)
            self.poll_armed.store(true, Relaxed);
        }
        // Readers that waited for this one, and ready events: the ones a
        // fault left and the ones delivered during the copy, which another
        // reader could not take then (an EPOLLET waiter needs a new edge).
        self.wq.wake_all(state);
        if ready {
            self.poll.wake();
        }
        if copied == 0 {
            return Err(EFAULT);
        }
        Ok(copied * SIZE)
    }

    /// The `poll` file operation: readable while an event is ready.
    ///
    /// # Safety
    ///
    /// As for [`PollQueue::register`]: `file` and `pt` are those `poll`
    /// was called with, for the file this tracker belongs to.
    pub(crate) unsafe fn poll(
        &self,
        file: *mut bindings::file,
        pt: *mut bindings::poll_table_struct,
    ) -> bindings::__poll_t {
        // SAFETY: The caller's guarantee; the tracker outlives its file.
        unsafe { self.poll.register(file, pt) };
        // A look: the next event wakes pollers again. Full: before the load
        // of `events_ready` (see `wake_pollers`).
        self.poll_armed.xchg(true, Full);
        if self.events_ready.load(Acquire) {
            glue::poll_readable()
        } else {
            0
        }
    }

    /// ESTALE once job `id`'s slot went to a later job.
    fn status_locked(state: &TrackerState, id: u64) -> Result<JobStatus> {
        state.ring.status(id).ok_or_else(estale)
    }

    /// Waits for job `id`: EINVAL for an id this file never issued, ESTALE
    /// for one older than the last `JOB_WINDOW`, ETIMEDOUT if a timed wait
    /// expires; a signal ends it as in `Fence::wait_until`. A poll reports
    /// `Pending` instead of failing.
    pub(crate) fn wait(&self, id: u64, timeout: Timeout) -> Result<JobStatus> {
        let mut state = self.state.lock();
        Self::check_id(&state, id)?;
        let mut left = match timeout {
            Timeout::Jiffies(j) => j,
            _ => 0,
        };
        loop {
            let status = Self::status_locked(&state, id)?;
            if matches!(status, JobStatus::Done(_)) {
                return Ok(status);
            }
            match timeout {
                Timeout::Poll => return Ok(status),
                Timeout::Forever => {
                    if self.wq.wait_interruptible(&mut state) {
                        return Err(ERESTARTSYS);
                    }
                }
                Timeout::Jiffies(_) => match self.wq.wait_interruptible_timeout(&mut state, left) {
                    CondVarTimeoutResult::Woken { jiffies } => left = jiffies,
                    CondVarTimeoutResult::Timeout => {
                        return match Self::status_locked(&state, id)? {
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

#[kunit_tests(tdrv_job_status)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_reused_by_a_later_job_keeps_that_jobs_status() -> Result {
        let mut ring = StatusRing::new()?;
        assert_eq!(ring.status(1), None);
        // Job 1 runs long; jobs 2..=4096 end; job 4097 takes job 1's slot.
        for id in 1..=JOB_WINDOW {
            ring.issue(id);
        }
        for id in 2..=JOB_WINDOW {
            ring.finish(id, 0);
        }
        assert_eq!(ring.status(1), Some(JobStatus::Pending));
        ring.issue(JOB_WINDOW + 1);
        // Job 1 no longer has a status here (JOB_WAIT: ESTALE) ...
        assert_eq!(ring.status(1), None);
        assert_eq!(ring.status(JOB_WINDOW + 1), Some(JobStatus::Pending));
        // ... and its end does not pass for job 4097's.
        ring.finish(1, 0);
        assert_eq!(ring.status(JOB_WINDOW + 1), Some(JobStatus::Pending));
        ring.finish(1, -5);
        assert_eq!(ring.status(JOB_WINDOW + 1), Some(JobStatus::Pending));
        ring.finish(JOB_WINDOW + 1, -110);
        assert_eq!(ring.status(JOB_WINDOW + 1), Some(JobStatus::Done(-110)));
        // Job 4097's neighbours are untouched.
        assert_eq!(ring.status(2), Some(JobStatus::Done(0)));
        Ok(())
    }
}
