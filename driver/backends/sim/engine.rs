// SPDX-License-Identifier: GPL-2.0

//! The sim device's engine: spreads jobs across the queues while keeping
//! per-buffer order, runs the synchronous transfers of device memory by
//! DMA, and watches the queues.
//!
//! # Ordering
//!
//! The core marks fences when a job is submitted, but does not hold a job
//! back until the jobs before it on the same buffers are done: a FIFO
//! engine gets that order for free, this one has several queues running at
//! once. So the scheduler keeps submitted jobs in a pending list, in
//! submission order, and dispatches a job only when it conflicts (shares a
//! buffer, one of the two writing it) with no earlier pending job and with
//! running jobs on at most one queue; then it goes to that queue (whose
//! FIFO order finishes the earlier job first), or else to the least loaded
//! queue, as long as that queue has fewer than `QUEUE_DEPTH` jobs. Independent jobs thus run on different queues and may complete
//! out of order; dependent ones complete in order.
//!
//! Synchronous transfers (COPY_IN, COPY_OUT, MEMSET, COPY, zeroing) are
//! ordered against jobs by the fences (`Fence::cpu_begin`), and go to the
//! least loaded queue.
//!
//! # Host pages
//!
//! COPY_IN and COPY_OUT pin the caller's pages (`pin_user_pages_fast`, a
//! chunk of up to 1 MiB at a time, with no device section held, since
//! pinning may fault), map them for DMA page by page (merging pages that
//! are contiguous for the device) and post one descriptor per run. The
//! bytes never pass through a kernel buffer. The ioctl waits for the chunk
//! uninterruptibly (the device writes the pages until then); the watchdog
//! bounds that wait. A fatal signal stops the copy between chunks (EINTR).
//! A chunk that cannot be pinned (a PFN mapping, such as another buffer's
//! mmap) goes through a staging buffer and a coherent bounce buffer
//! instead, `BOUNCE` bytes at a time.
//!
//! # Faults
//!
//! A descriptor the device fails fails its op: a job with EIO, a transfer
//! with EIO (a COPY_IN, MEMSET or COPY then latches its destination's
//! error, as a failed job does: `file.rs`). The watchdog (a delayed work item, every `WATCH_MS` while a
//! queue has work) reaps the completion rings, which recovers a lost
//! interrupt, and resets a queue with no progress for `sim_timeout_ms`:
//! its running op fails with ETIMEDOUT, the ops behind it with EIO, and
//! the queue serves new work afterwards. A queue that does not acknowledge
//! the reset is dead until it does (see `queue.rs`: its orphans keep what
//! the device may still write); unbind stops the device's DMA and then
//! releases them. Debugfs `inject` takes `fail_desc`,
//! `stall`, `lose_irq` and `hang` (a stall that ignores resets until
//! `resume`), each optionally followed by a queue number; without one the
//! fault goes to the queue of the next op (job or transfer), and `resume`
//! to every queue. `fail_job` fails the next job's first descriptor.
//! `memcpy_probe` [queue] is no fault: the simulator times a host memcpy
//! before that queue's next descriptor, for `make bench` (figure 9s's
//! baseline, interleaved with the rows it is the baseline of).
//! `hold_job` keeps the next job the scheduler would dispatch pending, and
//! dispatches no job at all, until `release` (see [`engine::Hold`]); unlike
//! `stall`, which the watchdog ends after `sim_timeout_ms`, a hold lasts
//! as long as the test needs, and transfers (allocation, COPY_IN) still
//! run meanwhile.

use core::any::Any;

use kernel::{
    alloc::KVVec,
    bindings,
    device::Bound,
    dma::Coherent,
    io::{
        register::Array,
        Io, //
    },
    list::{
        List,
        ListArc, //
    },
    new_mutex,
    page::PAGE_SIZE,
    prelude::*,
    sync::{
        atomic::{
            Atomic,
            Relaxed, //
        },
        Arc,
        Mutex,
        SetOnce, //
    },
    time::{
        delay::fsleep,
        msecs_to_jiffies,
        Delta, //
    },
    uaccess::UserPtr,
    workqueue::{
        impl_has_delayed_work,
        impl_has_work,
        new_delayed_work,
        new_work,
        DelayedWork,
        Work,
        WorkItem, //
    }, //
};

use super::{
    hbm::Hbm,
    queue::{
        Desc,
        Health,
        Hw,
        Op,
        OpKind,
        Queue, //
    },
    regs::{
        DESC_DST_DEV,
        DESC_MAX_LEN,
        DESC_SRC_DEV,
        HDR_DMA_STOP,
        HDR_INJECT,
        INJECT_FAIL_NEXT,
        INJECT_HANG,
        INJECT_LOSE_IRQ,
        INJECT_MEMCPY_PROBE,
        INJECT_RESUME,
        INJECT_STALL, //
    },
    SimHw,
    SimMemory,
    MAX_TIMEOUT_MS,
    MIN_TIMEOUT_MS, //
};
use crate::{
    buffer::{
        Buffer,
        DeviceMemory, //
    },
    device::{
        raw_device,
        ActiveGuard,
        TdrvDevice, //
    },
    engine::{
        self,
        Engine,
        EngineCounters,
        Hold,
        Prepared, //
    },
    fence_fd::Signalling,
    glue,
    job::{
        Job,
        JobTracker,
        Transfer, //
    },
    range::ByteRange,
    uapi::ecanceled, //
};

/// Watchdog period while a queue has work.
const WATCH_MS: u32 = 20;
/// Bytes of user memory pinned and mapped per DMA chunk, an op of its
/// own: a huge page's one descriptor, or up to 512 of 4 KiB pages (which
/// the queue posts as its ring frees up).
const USER_CHUNK: usize = 2 << 20;
/// Bytes of user memory a COPY_IN or COPY_OUT pins and starts at a time,
/// while the window before runs (`make bench`, figure 9s: 4 and 8 MiB
/// measured alike, both faster than one 16 MiB window at a time).
const USER_WINDOW: usize = 8 << 20;
/// Piece of a COPY_IN or COPY_OUT through a bounce buffer (user memory
/// that cannot be pinned).
const BOUNCE: usize = 64 << 10;
/// Size of the pattern a fill starts from.
const FILL_PATTERN: usize = 64 << 10;

/// New buffers up to this size are zeroed by the CPU through the BAR; a
/// device fill is a round trip of milliseconds, while the CPU zeroes this
/// much in well under one.
const CPU_ZERO_MAX: usize = 256 << 10;
/// Pending jobs the scheduler looks at per pass.
const SCAN_LIMIT: usize = 64;
/// Jobs dispatched to one queue at a time. The rest wait in the pending
/// list, where closing their file cancels them at once (descriptors in a
/// ring can only end by running or by a reset).
const QUEUE_DEPTH: usize = 4;

/// The buffers a job touches, sorted by address, with whether it writes
/// them.
pub(crate) struct BufSet(KVec<(usize, bool)>);

impl BufSet {
    fn of(transfers: &[Transfer]) -> Result<Self> {
        let mut v: KVec<(usize, bool)> = KVec::new();
        let mut add = |buf: &Arc<Buffer>, write: bool| -> Result {
            let key = Arc::as_ptr(buf) as usize;
            // Jobs name few distinct buffers: a linear search, and an
            // insertion that keeps the set sorted.
            match v.iter().position(|e| e.0 >= key) {
                Some(i) if v[i].0 == key => v[i].1 |= write,
                Some(i) => {
                    v.reserve(1, GFP_KERNEL)?;
                    let _ = v.insert_within_capacity(i, (key, write));
                }
                None => v.push((key, write), GFP_KERNEL)?,
            }
            Ok(())
        };
        for t in transfers {
            add(&t.src, false)?;
            add(&t.dst, true)?;
        }
        Ok(Self(v))
    }

    /// Some buffer is in both sets and one of them writes it.
    fn conflicts(&self, other: &BufSet) -> bool {
        let (mut i, mut j) = (0, 0);
        let (a, b) = (&self.0, &other.0);
        while i < a.len() && j < b.len() {
            match a[i].0.cmp(&b[j].0) {
                core::cmp::Ordering::Less => i += 1,
                core::cmp::Ordering::Greater => j += 1,
                core::cmp::Ordering::Equal => {
                    if a[i].1 || b[j].1 {
                        return true;
                    }
                    i += 1;
                    j += 1;
                }
            }
        }
        false
    }
}

/// A dispatched job the scheduler still orders others against.
struct Running {
    /// The job's op (its job and buffer set).
    op: Arc<Op>,
    queue: u32,
}

/// The scheduler's state. Nothing here allocates after the engine was
/// created: the vectors have room for their most entries, and a job's op
/// is built at SUBMIT.
struct Sched {
    /// The ops of submitted jobs not yet dispatched, in submission order.
    pending: List<Op>,
    /// Room for `QUEUE_DEPTH` jobs per queue.
    running: KVec<Running>,
    /// Scratch of `schedule`: pending jobs passed over (room for
    /// `SCAN_LIMIT`).
    earlier: KVec<Arc<Op>>,
    stopped: bool,
    /// `hold_job`: the held job stays in `pending`.
    hold: Hold,
}

/// The engine of one sim device.
#[pin_data]
pub(crate) struct SimEngine {
    pub(crate) hw: SimHw,
    pub(crate) queues: KVec<Pin<KBox<Queue>>>,
    pub(crate) hbm: Arc<Hbm>,
    #[pin]
    sched: Mutex<Sched>,
    /// Ops to end from a work item: failed where they could not be ended
    /// (under a submitter's tracker lock).
    #[pin]
    deferred: Mutex<List<Op>>,
    #[pin]
    defer_work: Work<SimEngine>,
    #[pin]
    watchdog: DelayedWork<SimEngine, 1>,
    /// The watchdog's timeout in milliseconds: `sim_timeout_ms` at probe,
    /// debugfs `inject` `watchdog_ms N` after.
    timeout_ms: Atomic<u32>,
    /// A fault for the queue of the next op (`INJECT_*`), or 0.
    inject_next: Atomic<u32>,
    /// `INJECT_FAIL_NEXT` for the queue of the next job, or 0.
    inject_next_job: Atomic<u32>,
    polled: Atomic<u64>,
    spurious_irqs: Atomic<u64>,
    watchdog_timeouts: Atomic<u64>,
    resets: Atomic<u64>,
}

impl_has_work! {
    impl HasWork<Self> for SimEngine { self.defer_work }
}
impl_has_delayed_work! {
    impl HasDelayedWork<Self, 1> for SimEngine { self.watchdog }
}

impl WorkItem for SimEngine {
    type Pointer = Arc<SimEngine>;

    fn run(this: Arc<SimEngine>) {
        this.end_deferred();
    }
}

/// The watchdog: its own work item (id 1).
impl WorkItem<1> for SimEngine {
    type Pointer = Arc<SimEngine>;

    fn run(this: Arc<SimEngine>) {
        this.watch();
    }
}

impl SimEngine {
    pub(crate) fn new(
        hw: SimHw,
        queues: KVec<Pin<KBox<Queue>>>,
        hbm: Arc<Hbm>,
        timeout_ms: u32,
    ) -> Result<Arc<Self>> {
        let running = KVec::with_capacity(queues.len() * QUEUE_DEPTH, GFP_KERNEL)?;
        let earlier = KVec::with_capacity(SCAN_LIMIT, GFP_KERNEL)?;
        Arc::pin_init(
            try_pin_init!(Self {
                hw,
                queues,
                hbm,
                sched <- new_mutex!(
                    Sched {
                        pending: List::new(),
                        running,
                        earlier,
                        stopped: false,
                        hold: Hold::default(),
                    },
                    "SimEngine::sched"
                ),
                deferred <- new_mutex!(List::new(), "SimEngine::deferred"),
                defer_work <- new_work!("SimEngine::defer_work"),
                watchdog <- new_delayed_work!("SimEngine::watchdog"),
                timeout_ms: Atomic::new(timeout_ms),
                inject_next: Atomic::new(0),
                inject_next_job: Atomic::new(0),
                polled: Atomic::new(0),
                spurious_irqs: Atomic::new(0),
                watchdog_timeouts: Atomic::new(0),
                resets: Atomic::new(0),
            }),
            GFP_KERNEL,
        )
    }

    /// Waits until neither work item is queued or running. Once the
    /// engine is stopped and no ioctl section is left (unbind drained
    /// them), nothing queues them again.
    pub(crate) fn flush(&self) {
        // SAFETY: `watchdog` is an initialised, pinned delayed work that
        // lives as long as the engine; a stopped engine's watchdog does not
        // queue itself again.
        unsafe {
            bindings::flush_delayed_work(
                DelayedWork::<SimEngine, 1>::raw_as_work(&raw const self.watchdog)
                    .cast::<bindings::delayed_work>(),
            )
        };
        // SAFETY: As above, for the deferred-ops work item.
        unsafe { bindings::flush_work(Work::<SimEngine>::raw_get(&raw const self.defer_work)) };
    }

    /// Stops the device's DMA as a whole (`HDR_DMA_STOP`) and waits up to
    /// a second, as for a reset, until every queue acknowledged it; false
    /// if one did not. For unbind only: the queues stay stopped until the
    /// next probe.
    fn stop_dma(&self) -> bool {
        if self
            .hw
            .with_ctrl(|io| io.try_write32(1, HDR_DMA_STOP))
            .and_then(|r| r.ok())
            .is_none()
        {
            return false;
        }
        for _ in 0..1000 {
            if self.queues.iter().all(|q| q.dma_off(&self.hw)) {
                return true;
            }
            fsleep(Delta::from_millis(1));
        }
        false
    }

    fn arm_watchdog(self: &Arc<Self>) {
        let _ = engine::queue().enqueue_delayed::<_, 1>(self.clone(), msecs_to_jiffies(WATCH_MS));
    }

    /// Applies a fault meant for the next op to queue `q`.
    fn apply_next_fault(&self, q: u32) {
        let cmd = self.inject_next.xchg(0, Relaxed);
        if cmd != 0 {
            let _ = self.inject(q, cmd);
        }
    }

    fn inject(&self, q: u32, cmd: u32) -> Result {
        let loc = HDR_INJECT::try_at(q as usize).ok_or(EINVAL)?;
        self.hw
            .with_ctrl(|io| io.try_write(loc, HDR_INJECT::zeroed().with_cmd(cmd)))
            .ok_or(ENODEV)?
    }

    /// Puts `op` on queue `q`; an op the queue refused is ended later.
    fn push(self: &Arc<Self>, q: u32, op: ListArc<Op>) {
        self.apply_next_fault(q);
        if let Err(op) = self.queues[q as usize].push(&self.hw, op) {
            self.defer(op);
        }
        self.arm_watchdog();
    }

    fn defer(self: &Arc<Self>, op: ListArc<Op>) {
        self.deferred.lock().push_back(op);
        let _ = engine::queue().enqueue::<_, 0>(self.clone());
    }

    fn end_deferred(self: &Arc<Self>) {
        let _signalling = Signalling::begin();
        loop {
            let op = self.deferred.lock().pop_front();
            let Some(op) = op else {
                return;
            };
            self.end(op);
        }
    }

    /// Ends an op: a job leaves the scheduler (which may dispatch jobs
    /// that waited for it) and completes; a transfer wakes its waiter.
    /// Call with no lock held.
    fn end(self: &Arc<Self>, op: ListArc<Op>) {
        let Some(job) = op.job().cloned() else {
            return op.signal();
        };
        // The job completes (fences released, its completion counted) and
        // lets go of its buffers (its outcome reaches JOB_WAIT) before it
        // leaves the scheduler: a job that waited for it may then start on
        // another queue at once, and must never be seen done first.
        job.complete(op.result());
        let key = core::ptr::from_ref::<Op>(&op);
        drop(op);
        let entry = {
            let mut s = self.sched.lock();
            let i = s.running.iter().position(|r| core::ptr::eq(&*r.op, key));
            i.and_then(|i| s.running.remove(i).ok())
        };
        // Dropped outside the lock: the last reference ends the job.
        drop((entry, job));
        self.schedule(&mut self.sched.lock());
    }

    fn end_all(self: &Arc<Self>, mut done: List<Op>) {
        while let Some(op) = done.pop_front() {
            self.end(op);
        }
    }

    /// Interrupt thread of queue `q`.
    pub(crate) fn on_irq(self: &Arc<Self>, q: u32) {
        let _signalling = Signalling::begin();
        let queue = &self.queues[q as usize];
        let _ending = queue.ending.lock();
        let mut done = List::new();
        if queue.reap(&self.hw, &mut done) == 0 {
            self.spurious_irqs.add(1, Relaxed);
        }
        self.end_all(done);
    }

    /// Interrupt (hard context): count it.
    pub(crate) fn count_irq(&self, q: u32) {
        self.queues[q as usize].irqs.add(1, Relaxed);
    }

    fn watch(self: &Arc<Self>) {
        let _signalling = Signalling::begin();
        let mut busy = {
            let mut s = self.sched.lock();
            if s.stopped {
                return;
            }
            // Pending jobs get another pass (a completion gives them one
            // too; this covers a queue that was not usable then).
            self.schedule(&mut s);
            // (A held job waits for `release`, which schedules.)
            !s.pending.is_empty() && s.running.is_empty() && !s.hold.holding()
        };
        let timeout_ms = self.timeout_ms.load(Relaxed);
        let timeout = Delta::from_millis(timeout_ms.into());
        for q in self.queues.iter() {
            let _ending = q.ending.lock();
            let mut done = List::new();
            match q.check(&self.hw, timeout, &mut done, &self.polled) {
                Health::Idle => {}
                Health::Busy => busy = true,
                Health::Reset => {
                    self.watchdog_timeouts.add(1, Relaxed);
                    self.resets.add(1, Relaxed);
                    pr_warn!(
                        "tdrv-sim: queue {} made no progress for {} ms: reset, its jobs failed\n",
                        q.index,
                        timeout_ms
                    );
                }
                Health::Dead => {
                    self.watchdog_timeouts.add(1, Relaxed);
                    pr_err!(
                        "tdrv-sim: queue {} made no progress for {} ms and did not acknowledge its reset: dead, its jobs failed; the memory its descriptors name stays allocated until the device acknowledges\n",
                        q.index,
                        timeout_ms
                    );
                    if !self.queues.iter().any(|q| q.usable()) {
                        pr_err!("tdrv-sim: every queue is dead: the device takes no work until one acknowledges its reset\n");
                    }
                    self.report_orphans(q);
                    busy = true;
                }
                Health::StillDead => busy = true,
                Health::Revived => {
                    self.resets.add(1, Relaxed);
                    pr_warn!(
                        "tdrv-sim: queue {} acknowledged its reset late: usable again, its orphaned work released\n",
                        q.index
                    );
                }
            }
            self.end_all(done);
        }
        if busy {
            self.arm_watchdog();
        }
    }

    /// The ops a dead queue keeps have failed: their jobs' outcomes reach
    /// JOB_WAIT now, their transfers' waiters return; what they hold goes
    /// when the device acknowledges (`end`). Call holding `q.ending`.
    fn report_orphans(&self, q: &Queue) {
        let orphans = q.take_orphans();
        for op in orphans.iter() {
            match op.job() {
                Some(job) => job.abandon(op.result()),
                None => op.signal(),
            }
        }
        q.put_orphans(orphans);
    }

    /// The least loaded usable queue that `room` accepts.
    fn least_loaded(&self, room: impl Fn(u32) -> bool) -> Option<u32> {
        let mut best = None;
        let mut best_load = u32::MAX;
        for q in self.queues.iter() {
            let l = q.load.load(Relaxed);
            if l < best_load && room(q.index) && q.usable() {
                best = Some(q.index);
                best_load = l;
            }
        }
        best
    }

    /// The usable queue that `room` accepts with the fewest jobs by
    /// `jobs(q)`, ties going to the least loaded. The scheduler counts
    /// jobs from its own list, which a completion changes only under the
    /// scheduler's lock: jobs dispatched earlier in one pass count even if
    /// the device has finished them meanwhile, so that jobs released
    /// together spread over the queues.
    fn fewest_jobs(&self, room: impl Fn(u32) -> bool, jobs: impl Fn(u32) -> usize) -> Option<u32> {
        let mut best = None;
        let mut best_key = (usize::MAX, u32::MAX);
        for q in self.queues.iter() {
            let key = (jobs(q.index), q.load.load(Relaxed));
            if key < best_key && room(q.index) && q.usable() {
                best = Some(q.index);
                best_key = key;
            }
        }
        best
    }

    /// The queue for a synchronous transfer: the least loaded, so that it
    /// does not wait behind jobs (or behind a stuck queue's work) when
    /// another queue is free.
    fn next_sync_queue(&self) -> u32 {
        self.least_loaded(|_| true).unwrap_or(0)
    }

    /// Dispatches the pending jobs that may run now (see the module docs).
    /// Allocates nothing: it runs on the completion path, which out-fences
    /// wait for (see `Engine::prepare`).
    fn schedule(self: &Arc<Self>, s: &mut Sched) {
        if s.stopped || s.hold.holding() {
            return;
        }
        let Sched {
            pending,
            running,
            earlier,
            hold,
            ..
        } = s;
        earlier.clear();
        let mut cursor = pending.cursor_front();
        let mut scanned = 0;
        while let Some(next) = cursor.peek_next() {
            if scanned == SCAN_LIMIT {
                break;
            }
            scanned += 1;
            let op: Arc<Op> = next.arc().into();
            let (Some(set), Some(job)) = (op.set(), op.job()) else {
                // Only jobs' ops are pending, with their job.
                cursor.move_next();
                continue;
            };
            let queue = {
                let blocked = earlier
                    .iter()
                    .any(|e| e.set().is_some_and(|es| es.conflicts(set)));
                let mut queue = None;
                let mut multi = blocked;
                for r in running
                    .iter()
                    .filter(|r| r.op.set().is_some_and(|rs| rs.conflicts(set)))
                {
                    match queue {
                        None => queue = Some(r.queue),
                        Some(q) if q != r.queue => multi = true,
                        _ => {}
                    }
                }
                // Jobs dispatched in this pass count: they are in `running`
                // and on their queue already.
                let depth = |q: u32| running.iter().filter(|r| r.queue == q).count();
                let queue = match queue {
                    Some(q) if depth(q) < QUEUE_DEPTH => Some(q),
                    Some(_) => None,
                    None => self.fewest_jobs(|q| depth(q) < QUEUE_DEPTH, depth),
                };
                if multi {
                    None
                } else {
                    queue
                }
            };
            let Some(q) = queue else {
                // Later jobs are ordered against it. Within capacity:
                // at most `SCAN_LIMIT` are scanned.
                if earlier.push_within_capacity(op).is_err() {
                    break;
                }
                cursor.move_next();
                continue;
            };
            if hold.holds(job) {
                // It stays pending, and so does every job after it.
                break;
            }
            // Within capacity: `QUEUE_DEPTH` jobs per queue at most.
            let job = job.clone();
            if running
                .push_within_capacity(Running {
                    op: op.clone(),
                    queue: q,
                })
                .is_err()
            {
                break;
            }
            let op = next.remove();
            job.start();
            let cmd = self.inject_next_job.xchg(0, Relaxed);
            if cmd != 0 {
                let _ = self.inject(q, cmd);
            }
            self.push(q, op);
        }
        earlier.clear();
    }

    /// Runs `descs` on a queue and waits for them. `held` is what the
    /// descriptors name in host memory (pinned pages, mappings, bounce
    /// buffers): given back once the op ended, or kept by the op if a
    /// reset the device did not acknowledge failed it (the device may
    /// still write there; see `queue.rs`).
    fn run_sync<T: Any + Send + Sync>(
        self: &Arc<Self>,
        descs: KVec<Desc>,
        held: T,
    ) -> (Result, Option<T>) {
        match self.start_sync(descs, held) {
            Ok(op) => op.finish(),
            Err((e, held)) => (Err(e), held),
        }
    }

    /// The first half of [`Self::run_sync`]: hands `descs` to the least
    /// loaded queue and returns at once, so that a caller can start
    /// several before it waits for any (they then run on several queues,
    /// and a queue's next op is in its ring while the last completes).
    fn start_sync<T: Any + Send + Sync>(
        self: &Arc<Self>,
        descs: KVec<Desc>,
        held: T,
    ) -> core::result::Result<SyncOp<T>, (Error, Option<T>)> {
        if descs.is_empty() {
            return Ok(SyncOp::Empty(held));
        }
        // Boxed first: nothing may fail once the device has the op.
        let boxed = match KBox::new(held, GFP_KERNEL) {
            Ok(held) => held,
            Err(e) => return Err((e.into(), None)),
        };
        let op = match Op::new(OpKind::Sync, descs) {
            Ok(op) => op,
            Err(e) => return Err((e, Some(KBox::into_inner(boxed)))),
        };
        let waiter = op.clone_arc();
        self.push(self.next_sync_queue(), op);
        Ok(SyncOp::Pushed(waiter, boxed))
    }

    /// COPY_IN/COPY_OUT: DMA between device memory at `dev_addr` and the
    /// caller's pages at `user`, a window of up to `USER_WINDOW` bytes at
    /// a time. A window's chunks are pinned, then mapped and started
    /// together inside a device section, each chunk an op of its own on
    /// the least loaded queue: one round trip to the device per window,
    /// with the window's chunks on several queues at once. While a window
    /// runs, the next is pinned and started, so the guest's pinning and
    /// mapping overlap the device's copying; that pinning happens inside
    /// the running window's section, so it must not fault
    /// (`FOLL_NOFAULT`: a fault may block for ever, and unbind waits for
    /// the section). Where it would, the window ends there, the running
    /// one is waited for and its section left, and the pinning goes on
    /// with faults allowed.
    fn user_dma(
        self: &Arc<Self>,
        device: &TdrvDevice,
        buf: &Arc<Buffer>,
        range: ByteRange,
        user: UserPtr,
        to_device: bool,
    ) -> Result {
        let mut running: Option<Started<'_>> = None;
        let r = self.user_windows(device, buf, range, user, to_device, &mut running);
        // Every window started is waited for, also after an error.
        let last = running.map_or(Ok(()), Started::finish);
        r.and(last)
    }

    /// The loop of [`Self::user_dma`]; the window still running when it
    /// returns is left in `running`.
    fn user_windows<'a>(
        self: &Arc<Self>,
        device: &'a TdrvDevice,
        buf: &Arc<Buffer>,
        range: ByteRange,
        user: UserPtr,
        to_device: bool,
        running: &mut Option<Started<'a>>,
    ) -> Result {
        let dev_addr = buf.dma_addr() + range.start as u64;
        let len = range.len;
        let base = user.as_const_ptr() as usize;
        let mut stage = KVVec::<u8>::new();
        let mut done = 0;
        while done < len {
            if glue::fatal_signal_pending() {
                return Err(EINTR);
            }
            let window = pin_window(base, done, len, !to_device, running.is_some())?;
            let Some(&(_, _, n, at)) = window.last() else {
                if let Some(prev) = running.take() {
                    // The next page would fault: wait for the running
                    // window, leave its section, and pin with faults
                    // allowed.
                    prev.finish()?;
                    continue;
                }
                let uaddr = base.checked_add(done).ok_or(EFAULT)?;
                let n = (len - done).min(USER_CHUNK - uaddr % PAGE_SIZE);
                self.bounce_dma(
                    device,
                    buf,
                    ByteRange {
                        start: range.start + done,
                        len: n,
                    },
                    UserPtr::from_addr(uaddr),
                    to_device,
                    &mut stage,
                )?;
                done += n;
                continue;
            };
            let next = self.start_window(device, buf, dev_addr, window, to_device)?;
            // The previous window ends while this one runs.
            let prev = running.replace(next);
            prev.map_or(Ok(()), Started::finish)?;
            done = at + n;
        }
        Ok(())
    }

    /// Maps and starts the pinned chunks of one window inside a device
    /// section, which the result holds until [`Started::finish`]. A chunk
    /// that fails to map or start ends the window there: the ones started
    /// still run, and `finish` reports the error once they ended.
    fn start_window<'a>(
        self: &Arc<Self>,
        device: &'a TdrvDevice,
        buf: &Arc<Buffer>,
        dev_addr: u64,
        window: KVec<(PinnedPages, usize, usize, usize)>,
        to_device: bool,
    ) -> Result<Started<'a>> {
        let active = device.enter()?;
        let dev = raw_device(device.bound_device(&active));
        let dir = if to_device {
            bindings::dma_data_direction_DMA_TO_DEVICE
        } else {
            bindings::dma_data_direction_DMA_FROM_DEVICE
        };
        let mut started = Started {
            ops: KVec::with_capacity(window.len(), GFP_KERNEL)?,
            result: Ok(()),
            _active: active,
        };
        for (pages, off, n, at) in window {
            // SAFETY: `dev` is bound while `started` holds the section,
            // which is until every op started here ended and gave its chunk
            // back (or kept it); the pages are pinned until `pages` drops,
            // after the mapping.
            let chunk = unsafe { MappedPages::map(dev, &pages, off, n, dir) }.and_then(|mapped| {
                let descs = mapped.descs(dev_addr + at as u64, to_device)?;
                Ok((mapped, descs))
            });
            let (mapped, descs) = match chunk {
                Ok(c) => c,
                Err(e) => {
                    started.result = Err(e);
                    break;
                }
            };
            // The mapping ends (drop, the mapping before the pages) only
            // after the op ended: the device no longer touches the pages.
            // An orphaned op keeps both.
            let held = UserChunk {
                _mapped: mapped,
                _pages: pages,
                _buf: buf.clone(),
            };
            match self.start_sync(descs, held) {
                // Within capacity: one entry per chunk of the window.
                Ok(op) => {
                    let _ = started.ops.push_within_capacity(op);
                }
                Err((e, _held)) => {
                    started.result = Err(e);
                    break;
                }
            }
        }
        Ok(started)
    }

    /// [`Self::user_dma`] of `range` of `buf` for user memory that cannot be
    /// pinned, `BOUNCE` bytes at a time: the user copy fills or drains a
    /// staging buffer (`stage`, allocated on first use) with no device
    /// section held, since it may fault (a fault on a tdrv mapping takes
    /// that buffer's memory lock), and the device reads or writes a
    /// coherent copy of it, made and freed inside a section.
    fn bounce_dma(
        self: &Arc<Self>,
        device: &TdrvDevice,
        buf: &Arc<Buffer>,
        range: ByteRange,
        user: UserPtr,
        to_device: bool,
        stage: &mut KVVec<u8>,
    ) -> Result {
        let dev_addr = buf.dma_addr() + range.start as u64;
        let len = range.len;
        if stage.is_empty() {
            stage.resize(BOUNCE, 0, GFP_KERNEL)?;
        }
        let mut done = 0;
        while done < len {
            let n = (len - done).min(BOUNCE);
            let user = user.wrapping_byte_add(done);
            let at = dev_addr + done as u64;
            if to_device {
                // SAFETY: `stage` holds `BOUNCE >= n` bytes; `copy_from_user`
                // checks the user range itself.
                let left = unsafe {
                    bindings::copy_from_user(stage.as_mut_ptr().cast(), user.as_const_ptr(), n)
                };
                if left != 0 {
                    return Err(EFAULT);
                }
            }
            {
                let active = device.enter()?;
                let bound = device.bound_device(&active);
                let (bounce, src, dst, flags) = if to_device {
                    let b = Coherent::<u8>::from_slice(bound, &stage[..n], GFP_KERNEL)?;
                    let host = b.dma_handle();
                    (b, host, at, DESC_DST_DEV)
                } else {
                    let b = Coherent::<u8>::zeroed_slice(bound, n, GFP_KERNEL)?;
                    let host = b.dma_handle();
                    (b, at, host, DESC_SRC_DEV)
                };
                let desc = Desc {
                    src,
                    dst,
                    len: n as u32,
                    flags,
                };
                let mut descs = KVec::new();
                descs.push(desc, GFP_KERNEL)?;
                // The bounce buffer is freed (drop) only after the op
                // ended, and inside the section: the device is bound. An
                // orphaned op keeps it, and the buffer.
                let (r, back) = self.run_sync(descs, (bounce, buf.clone()));
                r?;
                let (bounce, _) = back.ok_or(EIO)?;
                if !to_device {
                    // SAFETY: The op ended, so the device no longer writes
                    // the `n` bytes of the bounce buffer; `stage` has room.
                    unsafe {
                        core::ptr::copy_nonoverlapping(
                            bounce.as_ptr().cast::<u8>(),
                            stage.as_mut_ptr(),
                            n,
                        )
                    };
                }
            }
            if !to_device {
                // SAFETY: `stage` holds `n` initialised bytes;
                // `copy_to_user` checks the user range itself.
                let left =
                    unsafe { bindings::copy_to_user(user.as_mut_ptr(), stage.as_ptr().cast(), n) };
                if left != 0 {
                    return Err(EFAULT);
                }
            }
            done += n;
            glue::cond_resched();
        }
        Ok(())
    }

    /// Zeroes every channel's HBM once, at probe, so that allocations of
    /// memory nobody used since need no zeroing of their own (`hbm.rs`).
    /// On an error, the channels not yet zeroed stay unmarked: their
    /// allocations zero their memory one by one. Returns the first channel
    /// not zeroed and why.
    pub(crate) fn zero_hbm(
        self: &Arc<Self>,
        device: &TdrvDevice,
    ) -> core::result::Result<(), (u32, Error)> {
        for ch in 0..self.hbm.channels() {
            let (addr, len) = self.hbm.channel_span(ch);
            self.fill(device, addr, len as usize, 0, None)
                .map_err(|e| (ch, e))?;
            // Nothing can be allocated yet (the device has no node), so
            // the span is still all free and the mark holds.
            self.hbm.mark_zeroed(ch);
        }
        Ok(())
    }

    /// Fills `len` bytes at `dst` with `value`: one pattern from host
    /// memory, then the device doubles what it wrote (descriptors of one
    /// queue run in order).
    ///
    /// `keep` is the buffer the range belongs to, if any: an orphaned op
    /// keeps it (see [`UserChunk`]).
    fn fill(
        self: &Arc<Self>,
        device: &TdrvDevice,
        dst: u64,
        len: usize,
        value: u8,
        keep: Option<Arc<Buffer>>,
    ) -> Result {
        if len == 0 {
            return Ok(());
        }
        let active = device.enter()?;
        let bound: &kernel::device::Device<Bound> = device.bound_device(&active);
        let first = len.min(FILL_PATTERN);
        let pattern =
            Coherent::<u8>::zeroed_slice(bound, first.next_multiple_of(PAGE_SIZE), GFP_KERNEL)?;
        if value != 0 {
            // SAFETY: The allocation is ours and at least `first` bytes;
            // no device has its address yet.
            unsafe { core::ptr::write_bytes(pattern.as_mut_ptr().cast::<u8>(), value, first) };
        }
        let mut descs = KVec::new();
        descs.push(
            Desc {
                src: pattern.dma_handle(),
                dst,
                len: first as u32,
                flags: DESC_DST_DEV,
            },
            GFP_KERNEL,
        )?;
        let mut filled = first;
        while filled < len {
            let n = filled.min(len - filled).min(DESC_MAX_LEN);
            descs.push(
                Desc {
                    src: dst,
                    dst: dst + filled as u64,
                    len: n as u32,
                    flags: DESC_SRC_DEV | DESC_DST_DEV,
                },
                GFP_KERNEL,
            )?;
            filled += n;
        }
        // `pattern` lives until the op ended (or with the orphaned op).
        let (r, back) = self.run_sync(descs, (pattern, keep));
        drop(back);
        r
    }
}

/// Where byte `offset` of `buf` is for the device, and how many bytes are
/// contiguous from there: HBM for device memory, else the bus address of
/// host memory (a buffer imported from elsewhere).
fn locate(buf: &Buffer, offset: usize) -> (u64, usize, bool) {
    if buf.on_device() {
        (buf.dma_addr() + offset as u64, buf.size() - offset, true)
    } else {
        let (bus, left) = buf.dma_span(offset);
        (bus, left, false)
    }
}

/// Appends the descriptors that copy `src_range` of `src` to `dst` at
/// `dst_offset`.
fn transfer_descs(
    descs: &mut KVec<Desc>,
    dst: &Buffer,
    dst_offset: usize,
    src: &Buffer,
    src_range: ByteRange,
) -> Result {
    let mut done = 0;
    while done < src_range.len {
        let (from, src_left, src_dev) = locate(src, src_range.start + done);
        let (to, dst_left, dst_dev) = locate(dst, dst_offset + done);
        let n = (src_range.len - done)
            .min(src_left)
            .min(dst_left)
            .min(DESC_MAX_LEN);
        let flags = if src_dev { DESC_SRC_DEV } else { 0 } | if dst_dev { DESC_DST_DEV } else { 0 };
        descs.push(
            Desc {
                src: from,
                dst: to,
                len: n as u32,
                flags,
            },
            GFP_KERNEL,
        )?;
        done += n;
    }
    Ok(())
}

/// User pages pinned for DMA; unpinned (and marked dirty if the device
/// wrote them) on drop.
struct PinnedPages {
    pages: KVec<*mut bindings::page>,
    write: bool,
}

// SAFETY: The pointers are pinned pages this object owns; unpinning them
// (drop) works from any task, and nothing else goes through them.
unsafe impl Send for PinnedPages {}
// SAFETY: Shared access only reads the pointers.
unsafe impl Sync for PinnedPages {}

/// One chunk of a COPY_IN or COPY_OUT: the mapping (dropped first) and the
/// pinned pages behind it, held until the device is done with them.
struct UserChunk {
    _mapped: MappedPages,
    _pages: PinnedPages,
    /// The buffer whose device memory the chunk moves: a late write must
    /// not land in memory handed to another buffer.
    _buf: Arc<Buffer>,
}

/// The ops of one COPY_IN/COPY_OUT window, started, and the device
/// section they need: the pages stay mapped and pinned, and the device
/// bound, until [`Started::finish`] waited for every op.
struct Started<'a> {
    ops: KVec<SyncOp<UserChunk>>,
    /// The first error while starting the window.
    result: Result,
    _active: ActiveGuard<'a>,
}

impl Started<'_> {
    /// Waits for every op (unmapping and unpinning each chunk the device
    /// gave back), then leaves the section; the first error.
    fn finish(self) -> Result {
        let mut result = self.result;
        for op in self.ops {
            let (r, back) = op.finish();
            drop(back);
            if result.is_ok() {
                result = r;
            }
        }
        result
    }
}

/// Pins the chunks of the next COPY_IN/COPY_OUT window: from byte `done`
/// of the `len` bytes at user address `base`, up to `USER_WINDOW` bytes
/// in chunks of up to `USER_CHUNK`, each as (pages, offset into the
/// first, bytes, bytes of the range before it). The window ends before
/// memory that cannot be pinned (a PFN mapping, such as another buffer's
/// mmap, or a bad address: the bounce path deals with it) or, with
/// `nofault`, that would need a page fault first. Empty if the first
/// chunk cannot be pinned so.
fn pin_window(
    base: usize,
    done: usize,
    len: usize,
    write: bool,
    nofault: bool,
) -> Result<KVec<(PinnedPages, usize, usize, usize)>> {
    let mut window = KVec::new();
    let mut end = done;
    while end < len && end - done < USER_WINDOW {
        let uaddr = base.checked_add(end).ok_or(EFAULT)?;
        let off = uaddr % PAGE_SIZE;
        let n = (len - end).min(USER_CHUNK - off);
        let npages = (off + n).div_ceil(PAGE_SIZE);
        match PinnedPages::pin(uaddr - off, npages, write, nofault) {
            Ok(pages) => {
                window.push((pages, off, n, end), GFP_KERNEL)?;
                end += n;
            }
            Err(e) if e == EFAULT => break,
            Err(e) => return Err(e),
        }
    }
    Ok(window)
}

/// A synchronous op handed to a queue by [`SimEngine::start_sync`]: what
/// its descriptors name stays here until [`SyncOp::finish`] saw it end.
enum SyncOp<T: Any + Send + Sync> {
    /// No descriptors: nothing was pushed; what it held comes back as is.
    Empty(T),
    /// The op, and what its descriptors name.
    Pushed(Arc<Op>, KBox<T>),
}

impl<T: Any + Send + Sync> SyncOp<T> {
    /// Waits until the op ended; gives back what it held, or leaves it to
    /// an orphaned op (the device may still write there).
    fn finish(self) -> (Result, Option<T>) {
        let (op, boxed) = match self {
            SyncOp::Empty(held) => return (Ok(()), Some(held)),
            SyncOp::Pushed(op, boxed) => (op, boxed),
        };
        op.wait();
        if op.orphaned() {
            op.keep(boxed);
            return (op.result(), None);
        }
        (op.result(), Some(KBox::into_inner(boxed)))
    }
}

impl PinnedPages {
    /// Pins `n` pages from the page-aligned user address `start`; EFAULT
    /// unless all of them can be pinned (writable ones if `write`), and
    /// with `nofault`, unless they can without a page fault.
    fn pin(start: usize, n: usize, write: bool, nofault: bool) -> Result<Self> {
        let mut pages = KVec::with_capacity(n, GFP_KERNEL)?;
        let mut flags = if write { bindings::FOLL_WRITE } else { 0 };
        if nofault {
            flags |= bindings::FOLL_NOFAULT;
        }
        // SAFETY: `pages` has room for `n` entries; the call checks the
        // user range and fills at most `n` entries.
        let got =
            unsafe { bindings::pin_user_pages_fast(start, n as i32, flags, pages.as_mut_ptr()) };
        if got < 0 {
            return Err(Error::from_errno(got));
        }
        // SAFETY: `pin_user_pages_fast` initialised the first `got <= n`
        // entries.
        unsafe { pages.inc_len(got as usize) };
        let pinned = Self { pages, write };
        if (got as usize) < n {
            // Dropping unpins the ones we got.
            return Err(EFAULT);
        }
        Ok(pinned)
    }
}

impl Drop for PinnedPages {
    fn drop(&mut self) {
        if !self.pages.is_empty() {
            // SAFETY: Every entry is a page this object pinned, unpinned
            // exactly once, here.
            unsafe {
                bindings::unpin_user_pages_dirty_lock(
                    self.pages.as_mut_ptr(),
                    self.pages.len(),
                    self.write,
                )
            };
        }
    }
}

/// DMA mappings of pinned pages; unmapped on drop.
struct MappedPages {
    dev: *mut bindings::device,
    dir: bindings::dma_data_direction,
    /// `(bus address, length)` per page.
    maps: KVec<(u64, usize)>,
}

// SAFETY: `dev` is a bound device (the contract of `map`), usable from any
// task; unmapping (drop) has no thread affinity.
unsafe impl Send for MappedPages {}
// SAFETY: Shared access only reads the addresses.
unsafe impl Sync for MappedPages {}

impl MappedPages {
    /// Maps `len` bytes of `pages` from byte `off` of the first page: one
    /// mapping per run of physically consecutive pages (a huge page, or
    /// 4 KiB pages the allocator handed out in order, gives a few long
    /// runs instead of a mapping per page), each at most as long as the
    /// device takes and a descriptor holds.
    ///
    /// # Safety
    ///
    /// `dev` is bound until the result is dropped, and `pages` stay
    /// pinned until then.
    unsafe fn map(
        dev: *mut bindings::device,
        pages: &PinnedPages,
        off: usize,
        len: usize,
        dir: bindings::dma_data_direction,
    ) -> Result<Self> {
        let all = &pages.pages[..];
        let mut m = Self {
            dev,
            dir,
            maps: KVec::with_capacity(all.len(), GFP_KERNEL)?,
        };
        // SAFETY: `dev` is bound (the caller's guarantee).
        let max = unsafe { glue::dma_max_mapping_size(dev) }.min(DESC_MAX_LEN);
        let max_pages = (max / PAGE_SIZE).max(1);
        let mut done = 0;
        let mut i = 0;
        while i < all.len() && done < len {
            // SAFETY: The pages are pinned (the caller's guarantee).
            let run = unsafe { glue::page_run(&all[i..all.len().min(i + max_pages)]) };
            let o = if i == 0 { off } else { 0 };
            let n = (run * PAGE_SIZE - o).min(len - done);
            // SAFETY: The run's pages are pinned and `dev` bound (the
            // caller's guarantee); they are physically consecutive, so
            // `[o, o + n)` from the first is one physical range.
            let addr = unsafe { bindings::dma_map_page_attrs(dev, all[i], o, n, dir, 0) };
            // SAFETY: As above.
            if unsafe { glue::dma_mapping_error(dev, addr) } {
                return Err(ENOMEM);
            }
            // Within capacity: at most one entry per page.
            let _ = m.maps.push_within_capacity((addr, n));
            done += n;
            i += run;
        }
        Ok(m)
    }

    /// One descriptor per run of bus-contiguous pages.
    fn descs(&self, dev_addr: u64, to_device: bool) -> Result<KVec<Desc>> {
        let mut descs: KVec<Desc> = KVec::new();
        let mut at = dev_addr;
        let host = |d: &Desc| if to_device { d.src } else { d.dst };
        let flags = if to_device {
            DESC_DST_DEV
        } else {
            DESC_SRC_DEV
        };
        for &(addr, n) in self.maps.iter() {
            if let Some(last) = descs.last_mut() {
                if host(last) + u64::from(last.len) == addr && last.len as usize + n <= DESC_MAX_LEN
                {
                    last.len += n as u32;
                    at += n as u64;
                    continue;
                }
            }
            let d = if to_device {
                Desc {
                    src: addr,
                    dst: at,
                    len: n as u32,
                    flags,
                }
            } else {
                Desc {
                    src: at,
                    dst: addr,
                    len: n as u32,
                    flags,
                }
            };
            descs.push(d, GFP_KERNEL)?;
            at += n as u64;
        }
        Ok(descs)
    }
}

impl Drop for MappedPages {
    fn drop(&mut self) {
        for &(addr, n) in self.maps.iter() {
            // SAFETY: Mapped by `map` for `self.dev` with this length and
            // direction; the device is still bound (`map`'s contract).
            unsafe { bindings::dma_unmap_page_attrs(self.dev, addr, n, self.dir, 0) };
        }
    }
}

/// The sim engine as the core sees it.
pub(crate) struct SimBackend(pub(crate) Arc<SimEngine>);

/// Ends the jobs of `ops` (never dispatched) with `err`.
fn fail_ops(mut ops: List<Op>, err: Error) {
    while let Some(op) = ops.pop_front() {
        if let Some(job) = op.job() {
            job.complete(Err(err));
        }
    }
}

impl Engine for SimBackend {
    fn prepare(&self, transfers: &[Transfer]) -> Result<Option<Prepared>> {
        let set = BufSet::of(transfers)?;
        let mut descs = KVec::new();
        for t in transfers {
            transfer_descs(&mut descs, &t.dst, t.dst_offset, &t.src, t.src_range)?;
        }
        let op = Op::new(
            OpKind::Job {
                job: SetOnce::new(),
                set,
            },
            descs,
        )?;
        Ok(Some(Prepared::new(KBox::new(op, GFP_KERNEL)?)))
    }

    fn submit(&self, job: ListArc<Job>) -> Result {
        let e = &self.0;
        // Built by `prepare` (the core calls it for every job it submits).
        let op = job
            .take_prepared()
            .and_then(Prepared::downcast::<ListArc<Op>>)
            .ok_or(EINVAL)?;
        let op = KBox::into_inner(op);
        let mut s = e.sched.lock();
        if s.stopped {
            return Err(ENODEV);
        }
        if !e.queues.iter().any(|q| q.usable()) {
            return Err(EIO);
        }
        if let OpKind::Job { job: slot, .. } = &op.kind {
            // The op holds the job from now on; the job no longer holds
            // the op.
            slot.populate(job.into_arc());
        }
        // A job behind other pending ones waits for the next pass, which
        // every completion (and the watchdog) makes; only a job arriving at
        // an empty list is dispatched from here. That keeps SUBMIT O(1)
        // however many jobs wait.
        let was_empty = s.pending.is_empty();
        s.pending.push_back(op);
        if was_empty {
            e.schedule(&mut s);
        }
        Ok(())
    }

    fn cancel(&self, tracker: &JobTracker) {
        let e = &self.0;
        let taken = {
            let mut s = e.sched.lock();
            let mut taken = List::new();
            let mut cursor = s.pending.cursor_front();
            while let Some(next) = cursor.peek_next() {
                if next.arc().job().is_some_and(|j| j.submitted_by(tracker)) {
                    taken.push_back(next.remove());
                } else {
                    cursor.move_next();
                }
            }
            // A held job of the file ends the hold.
            s.hold.taken_if(|held| {
                taken.iter().any(|op| {
                    op.job()
                        .is_some_and(|j| core::ptr::from_ref::<Job>(&**j) as usize == held)
                })
            });
            e.schedule(&mut s);
            taken
        };
        fail_ops(taken, ecanceled());
    }

    fn shutdown(&self, stopped: &mut dyn FnMut()) {
        let e = &self.0;
        let pending = {
            let mut s = e.sched.lock();
            s.stopped = true;
            s.hold.release();
            core::mem::take(&mut s.pending)
        };
        let mut ops = List::new();
        let mut orphans = List::new();
        for q in e.queues.iter() {
            q.stop(&e.hw, &mut ops, &mut orphans);
        }
        if !orphans.is_empty() {
            // Queues that ignored their reset may still run what their
            // rings hold. Stop the device's DMA as a whole, which even a
            // hung queue obeys: then nothing of theirs moves any more, and
            // what their ops name (pinned pages, DMA mappings, bounce
            // buffers, buffers) can be released before the device is
            // released, as the DMA API requires.
            let n = orphans.iter().count();
            if e.stop_dma() {
                pr_warn!(
                    "tdrv-sim: unbind: queues ignored their reset; the device stopped its DMA, the memory of {} abandoned operations is released\n",
                    n
                );
            } else {
                // Nothing answers: a simulator that exited (its socket is
                // gone), which writes nothing more.
                pr_err!(
                    "tdrv-sim: unbind: the device acknowledged neither a reset nor a DMA stop in 1 s: taken as gone, the memory of {} abandoned operations is released\n",
                    n
                );
            }
            // Ended below with the rest, once bus mastering is off too.
            while let Some(op) = orphans.pop_front() {
                ops.push_back(op);
            }
        }
        e.flush();
        // The queues were reset: the device no longer touches memory.
        stopped();
        while let Some(op) = ops.pop_front() {
            op.fail(ENODEV);
            e.end(op);
        }
        e.end_deferred();
        fail_ops(pending, ENODEV);
    }

    fn does_dma(&self) -> bool {
        true
    }

    fn counters(&self) -> EngineCounters {
        let e = &self.0;
        EngineCounters {
            irqs: e.queues.iter().map(|q| q.irqs.load(Relaxed)).sum(),
            spurious_irqs: e.spurious_irqs.load(Relaxed),
            watchdog_timeouts: e.watchdog_timeouts.load(Relaxed),
            resets: e.resets.load(Relaxed),
            polled: e.polled.load(Relaxed),
        }
    }

    fn describe(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let e = &self.0;
        for q in e.queues.iter() {
            q.describe(&e.hw, f)?;
        }
        for ch in 0..e.hbm.channels() {
            let (free, largest, ranges) = e.hbm.usage(ch);
            writeln!(
                f,
                "hbm{ch}: free {free} largest_free {largest} free_ranges {ranges}"
            )?;
        }
        writeln!(f, "watchdog_ms: {}", e.timeout_ms.load(Relaxed))
    }

    fn inject(&self, cmd: &[u8]) -> Result {
        let e = &self.0;
        let mut words = cmd.split(|b| *b == b' ').filter(|w| !w.is_empty());
        let word = words.next();
        if word == Some(b"hold_job".as_slice()) || word == Some(b"release".as_slice()) {
            if words.next().is_some() {
                return Err(EINVAL);
            }
            let mut s = e.sched.lock();
            if word == Some(b"hold_job".as_slice()) {
                return s.hold.arm();
            }
            if s.hold.release() {
                e.schedule(&mut s);
            }
            return Ok(());
        }
        if word == Some(b"watchdog_ms".as_slice()) {
            // The watchdog's timeout from now on, in the range of
            // `sim_timeout_ms`: the test guests load tdrv with a long one,
            // and the checks that make it fire shorten it.
            let ms = words.next().ok_or(EINVAL)?;
            if words.next().is_some() {
                return Err(EINVAL);
            }
            let ms: u32 = core::str::from_utf8(ms)
                .map_err(|_| EINVAL)?
                .parse()
                .map_err(|_| EINVAL)?;
            if !(MIN_TIMEOUT_MS..=MAX_TIMEOUT_MS).contains(&ms) {
                return Err(EINVAL);
            }
            e.timeout_ms.store(ms, Relaxed);
            return Ok(());
        }
        if word == Some(b"fail_job".as_slice()) {
            // The next job fails (EIO), like the software engine's.
            if words.next().is_some() {
                return Err(EINVAL);
            }
            e.inject_next_job.store(INJECT_FAIL_NEXT, Relaxed);
            return Ok(());
        }
        let code = match word {
            Some(b"fail_desc") => INJECT_FAIL_NEXT,
            Some(b"stall") => INJECT_STALL,
            Some(b"lose_irq") => INJECT_LOSE_IRQ,
            Some(b"hang") => INJECT_HANG,
            Some(b"resume") => INJECT_RESUME,
            Some(b"memcpy_probe") => INJECT_MEMCPY_PROBE,
            _ => return Err(EINVAL),
        };
        let queue = match words.next() {
            None => None,
            Some(w) => {
                let s = core::str::from_utf8(w).map_err(|_| EINVAL)?;
                let q: u32 = s.parse().map_err(|_| EINVAL)?;
                if q as usize >= e.queues.len() {
                    return Err(EINVAL);
                }
                Some(q)
            }
        };
        if words.next().is_some() {
            return Err(EINVAL);
        }
        match queue {
            Some(q) => e.inject(q, code),
            // A hung queue takes no next op: `resume` goes to every queue
            // (it does nothing to one that does not hang).
            None if code == INJECT_RESUME => {
                for q in 0..e.queues.len() as u32 {
                    e.inject(q, code)?;
                }
                Ok(())
            }
            None => {
                e.inject_next.store(code, Relaxed);
                Ok(())
            }
        }
    }

    fn alloc_memory(
        &self,
        device: &TdrvDevice,
        size: usize,
        channel: u32,
    ) -> Option<Result<KBox<dyn DeviceMemory>>> {
        let e = &self.0;
        let alloc = || -> Result<KBox<dyn DeviceMemory>> {
            let range = e.hbm.alloc(channel, size as u64)?;
            // New memory must not show what an earlier buffer left there;
            // memory nobody used since the probe zeroed it reads as zero.
            let dirty = (range.dirty_len() as usize).min(size);
            if dirty <= CPU_ZERO_MAX {
                // Nobody can reach the range yet (see `zero_by_cpu`).
                e.hw.zero_by_cpu(range.dev_addr(), dirty)?;
            } else {
                e.fill(device, range.dev_addr(), dirty, 0, None)?;
            }
            let mem: KBox<dyn DeviceMemory> =
                KBox::new(SimMemory::new(range, &e.hw), GFP_KERNEL)?;
            Ok(mem)
        };
        Some(alloc())
    }

    fn dma_from_user(
        &self,
        device: &TdrvDevice,
        dst: &Arc<Buffer>,
        range: ByteRange,
        src: UserPtr,
    ) -> Result {
        self.0.user_dma(device, dst, range, src, true)
    }

    fn dma_to_user(
        &self,
        device: &TdrvDevice,
        src: &Arc<Buffer>,
        range: ByteRange,
        dst: UserPtr,
    ) -> Result {
        self.0.user_dma(device, src, range, dst, false)
    }

    fn dma_fill(
        &self,
        device: &TdrvDevice,
        dst: &Arc<Buffer>,
        range: ByteRange,
        value: u8,
    ) -> Result {
        let at = dst.dma_addr() + range.start as u64;
        self.0.fill(device, at, range.len, value, Some(dst.clone()))
    }

    fn dma_copy(
        &self,
        device: &TdrvDevice,
        dst: &Arc<Buffer>,
        dst_offset: usize,
        src: &Arc<Buffer>,
        src_range: ByteRange,
    ) -> Result {
        let _active = device.enter()?;
        let mut descs = KVec::new();
        transfer_descs(&mut descs, dst, dst_offset, src, src_range)?;
        // An orphaned op keeps both buffers: neither memory may be handed
        // out again (nor an import released) while the device may use it.
        self.0.run_sync(descs, (dst.clone(), src.clone())).0
    }
}

#[kunit_tests(tdrv_sim_sched)]
mod tests {
    use super::*;

    fn set(entries: &[(usize, bool)]) -> Result<BufSet> {
        let mut v = KVec::new();
        for e in entries {
            v.push(*e, GFP_KERNEL)?;
        }
        Ok(BufSet(v))
    }

    #[test]
    fn conflicts_need_a_shared_buffer_and_a_write() -> Result {
        let reads_a = set(&[(0x100, false), (0x300, true)])?;
        let reads_a_too = set(&[(0x100, false), (0x400, true)])?;
        let writes_a = set(&[(0x100, true)])?;
        let elsewhere = set(&[(0x200, true), (0x500, false)])?;
        // Two readers of a buffer run in parallel.
        assert!(!reads_a.conflicts(&reads_a_too));
        // A writer waits for a reader and the other way round.
        assert!(reads_a.conflicts(&writes_a));
        assert!(writes_a.conflicts(&reads_a));
        // Writers of one buffer are ordered.
        assert!(writes_a.conflicts(&writes_a));
        assert!(!writes_a.conflicts(&elsewhere));
        assert!(!set(&[])?.conflicts(&writes_a));
        Ok(())
    }
}
