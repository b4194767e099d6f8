// SPDX-License-Identifier: GPL-2.0

//! The software device: a faux bus device with DMA-coherent memory and a
//! CPU copy engine, so that tdrv works on any machine.
//!
//! # Jobs run by their submitter
//!
//! The engine is one FIFO queue drained by a work item. Going through it
//! costs a small job two context switches before its waiter runs: SUBMIT
//! queues the work, a kworker is switched in, copies and completes the job,
//! and the waiter is woken from there. So when nothing is queued and a job
//! is small and conflicts with no running job, SUBMIT runs the job itself,
//! after its file's locks are dropped, and the completion wakes the waiter
//! from the submitting thread, as sw_sync or an eventfd do (issue 12).
//! Submitters on several CPUs thus copy in parallel, which one work item
//! could not:
//!
//! - *Nothing queued* means every earlier job has completed or is running;
//!   *no conflict* (no buffer shared with a running job where either
//!   writes) means it cannot overtake a job it must follow. While any job
//!   is queued, new jobs queue behind it, and the work item waits before
//!   starting a queued job until no job run by its submitter conflicts
//!   with it. So jobs that share a buffer one of them writes run one after
//!   the other in submission order, and others may overlap. Jobs with
//!   in-fences, and those held behind them, reach the engine from the
//!   dispatch work and always queue.
//! - *Small* means at most [`INLINE_MAX_BYTES`] (256 KiB) in at most
//!   `INLINE_MAX_DESCS` descriptors: tens of microseconds of copying (at
//!   the CPU's memcpy rate), which the submitter pays in its own time
//!   slice, with `cond_resched` between pieces as in the work item. A
//!   queued job waits at most for the jobs running when it was queued (no
//!   new one starts while it waits), each that short, so no file can
//!   starve another this way; larger jobs go through the work item as
//!   before.
//! - Everything else is the queued path's: the job is started, completed
//!   and reported through `Job`, so fences, completion counts, the error
//!   latch, out-fences, statistics and fault injection (`fail_job`) behave
//!   the same; `cancel` has nothing queued to take back from it, and a
//!   closing file cannot close under a running SUBMIT anyway; `shutdown`
//!   waits for the running ones like it waits for the work item.
//!
//! The uapi says so on `struct tdrv_submit`: a job may be done when SUBMIT
//! returns. debugfs `stats` counts these jobs (`inline_jobs`).

use kernel::{
    bindings,
    device,
    error::to_result,
    faux,
    list::{
        List,
        ListArc, //
    },
    new_condvar,
    new_mutex,
    prelude::*,
    str::CString,
    sync::{
        atomic::{
            Atomic,
            Relaxed, //
        },
        Arc,
        Mutex, //
    },
    workqueue::{
        impl_has_work,
        new_work,
        Work,
        WorkItem, //
    }, //
};

use crate::{
    buffer::ENGINE_PIECE,
    device::{
        raw_device,
        DeviceIndex,
        TdrvDevice, //
    },
    engine::{
        fail_all,
        queue,
        take_jobs_of,
        take_one,
        Engine,
        Hold, //
    },
    fence_fd::Signalling,
    glue,
    job::{
        Job,
        JobTracker, //
    },
    node::DeviceNode,
    stats::DeviceDebugfs,
    uapi::{
        ecanceled,
        DEVICE_SOFT, //
    },
    waitqueue::{
        Sleepers,
        WaitQueue, //
    },
    Params, //
};

/// Sets the coherent DMA mask of a faux device, which 7.2 cannot do safely
/// (`dma::Device` is implemented for PCI and platform devices only).
fn set_coherent_mask_all(dev: &device::Device) -> Result {
    // SAFETY: `dev` is a valid, registered device, and no DMA allocation
    // exists for it yet. A faux device has no `dma_mask` (so
    // `dma_set_mask` would fail), but the coherent mask is all that
    // `dma_alloc_coherent` and `dma_mmap_attrs` consult.
    to_result(unsafe { bindings::dma_set_coherent_mask(raw_device(dev), u64::MAX) })
}

/// One software device and its `/dev/tdrv<N>` node.
#[pin_data(PinnedDrop)]
pub(crate) struct SoftDevice {
    #[pin]
    node: DeviceNode,
    _debugfs: DeviceDebugfs,
    // Dropped last: the faux device backs every buffer's DMA memory.
    _faux: faux::Registration,
}

impl SoftDevice {
    /// The device (for KUnit tests that drive one directly).
    #[cfg(CONFIG_KUNIT)]
    pub(crate) fn device(&self) -> &Arc<TdrvDevice> {
        &self.node.device
    }

    pub(crate) fn new(params: &Params) -> impl PinInit<Self, Error> + '_ {
        pin_init::pin_init_scope(move || {
            let index = DeviceIndex::take()?;
            let name = CString::try_from_fmt(fmt!("tdrv-soft{}", index.get()))?;
            let faux = faux::Registration::new(&name, None)?;
            set_coherent_mask_all(faux.as_ref())?;
            let engine: KBox<dyn Engine> = KBox::new(SoftBackend(SoftEngine::new()?), GFP_KERNEL)?;
            let device: Arc<TdrvDevice> =
                TdrvDevice::new(faux.as_ref(), DEVICE_SOFT, index, params, engine)?;
            let debugfs = DeviceDebugfs::new(&device)?;
            Ok(try_pin_init!(SoftDevice {
                node <- DeviceNode::new(device),
                _debugfs: debugfs,
                _faux: faux,
            }))
        })
    }
}

#[pinned_drop]
impl PinnedDrop for SoftDevice {
    fn drop(self: Pin<&mut Self>) {
        // No file is open (the module is going away, and files pin it), and
        // closed files' jobs were cancelled; stop the engine and free every
        // buffer's memory before the faux device goes away.
        self.node.device.unbind(|| {});
    }
}

/// Largest job (in bytes) that SUBMIT runs itself on an idle engine (see
/// the module documentation).
pub(crate) const INLINE_MAX_BYTES: u64 = 256 * 1024;

/// Most descriptors of a job that SUBMIT runs itself: the conflict checks
/// against the running jobs, under the queue lock, stay short.
const INLINE_MAX_DESCS: usize = 16;

/// A job being run now, by the work item or by its submitter.
///
/// # Invariants
///
/// Points to a live job: whoever runs the job adds the entry before it
/// starts and removes it, under the queue lock, before dropping its
/// reference.
#[derive(Clone, Copy)]
struct RunningJob(*const Job);

// SAFETY: Only dereferenced under the queue lock while the job is alive
// (the type invariant), and `Job` is `Sync`.
unsafe impl Send for RunningJob {}

struct SoftQueue {
    jobs: List<Job>,
    stopped: bool,
    /// The work item owns `jobs`: it is queued or running, and drains
    /// them in order, one at a time.
    busy: bool,
    /// The job the work item runs now, if any.
    worker: Option<RunningJob>,
    /// The jobs their submitters run now (`shutdown` waits for none). No
    /// two running jobs conflict.
    running: KVec<RunningJob>,
    /// Threads waiting for a running job to end, or for a held job.
    sleepers: u32,
    /// `hold_job`: the work item leaves the held job at the front of
    /// `jobs`, so every later job queues behind it.
    hold: Hold,
}

impl Sleepers for SoftQueue {
    fn sleepers(&mut self) -> &mut u32 {
        &mut self.sleepers
    }
}

impl SoftQueue {
    /// Whether `job` conflicts with a running job (see [`conflict`]).
    fn conflicts_with_running(&self, job: &Job) -> bool {
        Iterator::chain(self.running.iter(), self.worker.iter()).any(|r| {
            // SAFETY: By the type invariant the job is alive while it is
            // in `running` or `worker`, which we hold the lock of.
            conflict(unsafe { &*r.0 }, job)
        })
    }
}

/// Whether two jobs touch a common buffer that one of them writes: such
/// jobs must run one after the other, in submission order.
fn conflict(a: &Job, b: &Job) -> bool {
    let writes = |w: &Arc<crate::buffer::Buffer>, other: &Job| {
        other
            .transfers
            .iter()
            .any(|t| Arc::ptr_eq(w, &t.src) || Arc::ptr_eq(w, &t.dst))
    };
    a.transfers.iter().any(|t| writes(&t.dst, b)) || b.transfers.iter().any(|t| writes(&t.dst, a))
}

/// Most jobs submitting threads run at once (see [`SoftQueue::running`]);
/// more submitters queue their jobs.
const CLAIMED_MAX: usize = 16;

/// CPU copy engine: a work item drains the queue in FIFO order; with
/// nothing queued, SUBMIT runs a small job that conflicts with no running
/// one itself.
///
/// Fault injection for tests (debugfs `inject`): `fail_job` makes the next
/// job the engine runs fail with EIO, copying nothing; `hold_job` holds the
/// next job (SUBMIT then runs none itself: it queues) and every later one
/// until `release` (see [`Hold`]).
#[pin_data]
struct SoftEngine {
    #[pin]
    queue: Mutex<SoftQueue>,
    /// Notified when a running job ends.
    #[pin]
    inline_done: WaitQueue,
    #[pin]
    work: Work<SoftEngine>,
    /// Injected failures still to apply.
    inject_fail: Atomic<u32>,
    /// Jobs run by their submitter.
    inline_jobs: Atomic<u64>,
}

impl_has_work! {
    impl HasWork<Self> for SoftEngine { self.work }
}

/// Runs one job with the CPU, a piece at a time, stopping early if its
/// file closes.
fn run_on_cpu(job: &Job) -> Result {
    for t in &job.transfers {
        let mut done = 0;
        while done < t.src_range.len {
            if job.cancelled() {
                return Err(ecanceled());
            }
            if job.revoked() {
                // Its exporter waits for this job to let go.
                return Err(ENODEV);
            }
            let n = (t.src_range.len - done).min(ENGINE_PIECE);
            // SAFETY: The job holds both buffers, and their memory stays
            // live while the engine runs: unbind frees it only after
            // `shutdown`, which waits for the work item and for a
            // submitter running a claimed job. SUBMIT checked both ranges.
            unsafe {
                t.dst
                    .copy_span(t.dst_offset + done, &t.src, t.src_range.start + done, n)
            };
            done += n;
            glue::cond_resched();
        }
    }
    Ok(())
}

impl WorkItem for SoftEngine {
    type Pointer = Arc<SoftEngine>;

    fn run(this: Arc<SoftEngine>) {
        let _signalling = Signalling::begin();
        // One job at a time, so that a closing file can take its queued
        // jobs back while this one runs.
        let mut next = this.next_job(None);
        while let Some(job) = next {
            this.run_one(&job);
            // The next job (or idleness) before this one is dropped, which
            // reports it: whoever sees it done and submits again finds
            // the engine idle unless other jobs are queued.
            next = this.next_job(Some(&job));
            drop(job);
        }
    }
}

impl SoftEngine {
    fn new() -> Result<Arc<Self>> {
        let running = KVec::with_capacity(CLAIMED_MAX, GFP_KERNEL)?;
        Arc::pin_init(
            pin_init!(Self {
                queue <- new_mutex!(
                    SoftQueue {
                        jobs: List::new(),
                        stopped: false,
                        busy: false,
                        worker: None,
                        running,
                        sleepers: 0,
                        hold: Hold::default(),
                    },
                    "SoftEngine::queue"
                ),
                inline_done <- WaitQueue::new(new_condvar!("SoftEngine::inline_done")),
                work <- new_work!("SoftEngine::work"),
                inject_fail: Atomic::new(0),
                inline_jobs: Atomic::new(0),
            }),
            GFP_KERNEL,
        )
    }

    /// For the work item, which owns `jobs`: ends `done`, the job it ran
    /// (if any), and takes the first queued job once no job run by its
    /// submitter conflicts with it; with none left, the work item lets go.
    fn next_job(&self, done: Option<&Job>) -> Option<ListArc<Job>> {
        let mut q = self.queue.lock();
        if done.is_some() {
            q.worker = None;
        }
        loop {
            let Some(job) = q.jobs.pop_front() else {
                q.busy = false;
                return None;
            };
            if !q.stopped && q.hold.holds(&job) {
                // Held at the front until `release`, its file's `cancel` or
                // `shutdown` wakes us. Interruptible, as a hold may last
                // longer than the hung-task timeout; a kworker gets no
                // signals, so this never returns early for one.
                q.jobs.push_front(job);
                let _ = self.inline_done.wait_interruptible(&mut q);
                continue;
            }
            if !q.conflicts_with_running(&job) {
                // INVARIANT: The work item holds the job until it asks for
                // the next one, which clears this first.
                q.worker = Some(RunningJob(&*job));
                return Some(job);
            }
            // Back to the front (no job can claim the engine while one is
            // queued) until the running job it conflicts with, run by its
            // submitter, ends.
            q.jobs.push_front(job);
            self.inline_done.wait(&mut q);
        }
    }

    /// Runs and completes one job (the engine is busy for it).
    fn run_one(&self, job: &Job) {
        job.start();
        let result = if take_one(&self.inject_fail) {
            Err(EIO)
        } else {
            // ENODEV, without touching them, if an imported buffer was
            // revoked by its exporter.
            job.begin_access().and_then(|()| run_on_cpu(job))
        };
        job.complete(result);
    }
}

/// The software engine as the core sees it.
struct SoftBackend(Arc<SoftEngine>);

impl Engine for SoftBackend {
    fn submit(&self, job: ListArc<Job>) -> Result {
        let mut q = self.0.queue.lock();
        if q.stopped {
            return Err(ENODEV);
        }
        q.jobs.push_back(job);
        if !q.busy {
            q.busy = true;
            // Queue the work while still holding the lock, so `shutdown`
            // (which sets `stopped` under it, then flushes) cannot miss this
            // job. The work is not pending (nothing is while the engine is
            // idle); if its last run is still returning, it runs again.
            let _ = queue().enqueue(self.0.clone());
        }
        Ok(())
    }

    fn revocable_imports(&self) -> bool {
        true
    }

    fn may_claim(&self, bytes: u64, descs: usize) -> bool {
        bytes <= INLINE_MAX_BYTES && descs <= INLINE_MAX_DESCS
    }

    fn claim(&self, job: &Job) -> bool {
        let mut q = self.0.queue.lock();
        // Nothing queued: every earlier job has completed or is running,
        // and it may start now unless it conflicts with a running one.
        if q.stopped || !q.jobs.is_empty() || q.hold.active() || q.conflicts_with_running(job) {
            return false;
        }
        // INVARIANT: The submitter holds the job until `run_claimed`
        // removed the entry. Never grown here: the work item takes this
        // lock in a dma-fence signalling section, so nothing may allocate
        // under it. A submitter that finds every entry taken queues.
        q.running.push_within_capacity(RunningJob(job)).is_ok()
    }

    fn run_claimed(&self, job: &Job) {
        self.0.inline_jobs.add(1, Relaxed);
        self.0.run_one(job);
        let mut q = self.0.queue.lock();
        let me: *const Job = job;
        if let Some(i) = q.running.iter().position(|r| core::ptr::eq(r.0, me)) {
            // The entries' order does not matter: the last takes its place.
            let last = q.running.len() - 1;
            q.running.swap(i, last);
            q.running.pop();
        }
        // The work item, if it waits for this job to end, and `shutdown`.
        // The caller then drops the job, not under the queue lock and
        // after the engine was handed on: that reports it, taking its
        // file's tracker lock.
        self.0.inline_done.wake_all(q);
    }

    fn cancel(&self, tracker: &JobTracker) {
        let taken = {
            let mut q = self.0.queue.lock();
            let taken = take_jobs_of(&mut q.jobs, tracker);
            if q.hold.taken(&taken) {
                // The work item waits on the held job, now gone.
                self.0.inline_done.wake_all(q);
            }
            taken
        };
        fail_all(taken, ecanceled());
    }

    fn describe(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        writeln!(f, "inline_jobs: {}", self.0.inline_jobs.load(Relaxed))
    }

    fn inject(&self, cmd: &[u8]) -> Result {
        match cmd {
            b"fail_job" => self.0.inject_fail.add(1, Relaxed),
            b"hold_job" => self.0.queue.lock().hold.arm()?,
            b"release" => {
                let mut q = self.0.queue.lock();
                if q.hold.release() {
                    self.0.inline_done.wake_all(q);
                }
            }
            _ => return Err(EINVAL),
        }
        Ok(())
    }

    fn shutdown(&self, stopped: &mut dyn FnMut()) {
        {
            let mut q = self.0.queue.lock();
            q.stopped = true;
            // A held job goes on: the work item ignores the hold once
            // stopped.
            q.hold.release();
            self.0.inline_done.wake_all(q);
        }
        {
            let mut q = self.0.queue.lock();
            // Jobs run by their submitters: wait until they completed.
            while !q.running.is_empty() {
                self.0.inline_done.wait(&mut q);
            }
        }
        // SAFETY: `work` is an initialised, pinned `Work` that lives as long
        // as the engine. After `stopped` is set and no submitter runs a job,
        // nothing queues it again, so once `flush_work` returns the work
        // item is idle and the queue is empty.
        unsafe { bindings::flush_work(Work::raw_get(&raw const self.0.work)) };
        stopped();
    }
}
