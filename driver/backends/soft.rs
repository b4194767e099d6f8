// SPDX-License-Identifier: GPL-2.0

//! The software device: a faux bus device with DMA-coherent memory and a
//! CPU copy engine, so that tdrv works on any machine.
//!
//! # Jobs run by their submitter
//!
//! The engine is one FIFO queue drained by a work item. Going through it
//! costs a small job two context switches before its waiter runs: SUBMIT
//! queues the work, a kworker is switched in, copies and completes the job,
//! and the waiter is woken from there. So when the engine is idle (no job
//! queued or running) and a job is small, SUBMIT runs the job itself,
//! after its file's locks are dropped, and the completion wakes the waiter
//! from the submitting thread, as sw_sync or an eventfd do (issue 12):
//!
//! - *Idle* means no other job is queued or running, so every earlier job
//!   has completed: the job cannot overtake one it conflicts with. While
//!   it runs the engine counts as busy, and later jobs (of any file) queue
//!   behind it; when it ends, the submitter hands the engine to the work
//!   item if any did. Jobs with in-fences, and those held behind them,
//!   reach the engine from the dispatch work and always queue.
//! - *Small* means at most [`INLINE_MAX_BYTES`] (256 KiB): tens of
//!   microseconds of copying (at the CPU's memcpy rate), which the
//!   submitter pays in its own time slice, with `cond_resched` between
//!   pieces as in the work item. Other files' jobs wait at most that long
//!   behind it, no longer than behind a queued job of the same size, so
//!   no file can starve another this way; larger jobs go through the work
//!   item as before.
//! - Everything else is the queued path's: the job is started, completed
//!   and reported through `Job`, so fences, completion counts, the error
//!   latch, out-fences, statistics and fault injection (`fail_job`) behave
//!   the same; `cancel` has nothing queued to take back from it, and a
//!   closing file cannot close under a running SUBMIT anyway; `shutdown`
//!   waits for a running one like it waits for the work item.
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
        CondVar,
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
        Engine, //
    },
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

struct SoftQueue {
    jobs: List<Job>,
    stopped: bool,
    /// A job is running, by the work item or by its submitter; later jobs
    /// queue. Whoever set it drains `jobs` or hands them to the work item,
    /// so that jobs run one at a time, in queue order.
    busy: bool,
    /// The running job is run by its submitter (`shutdown` waits for it).
    inline: bool,
}

/// CPU copy engine: a work item drains the queue in FIFO order; an idle
/// engine lets SUBMIT run a small job itself.
///
/// Fault injection for tests (debugfs `inject`): `fail_job` makes the next
/// job the engine runs fail with EIO, copying nothing.
#[pin_data]
struct SoftEngine {
    #[pin]
    queue: Mutex<SoftQueue>,
    /// Notified when a job run by its submitter ends.
    #[pin]
    inline_done: CondVar,
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
        // One job at a time, so that a closing file can take its queued
        // jobs back while this one runs.
        let mut next = this.next_job();
        while let Some(job) = next {
            this.run_one(&job);
            // The next job (or idleness) before this one is dropped, which
            // reports it: whoever sees it done and submits again finds
            // the engine idle unless other jobs are queued.
            next = this.next_job();
            drop(job);
        }
    }
}

impl SoftEngine {
    fn new() -> Result<Arc<Self>> {
        Arc::pin_init(
            pin_init!(Self {
                queue <- new_mutex!(
                    SoftQueue {
                        jobs: List::new(),
                        stopped: false,
                        busy: false,
                        inline: false,
                    },
                    "SoftEngine::queue"
                ),
                inline_done <- new_condvar!("SoftEngine::inline_done"),
                work <- new_work!("SoftEngine::work"),
                inject_fail: Atomic::new(0),
                inline_jobs: Atomic::new(0),
            }),
            GFP_KERNEL,
        )
    }

    /// Takes the first queued job for the work item, which owns the busy
    /// engine; with none left, the engine goes idle.
    fn next_job(&self) -> Option<ListArc<Job>> {
        let mut q = self.queue.lock();
        let job = q.jobs.pop_front();
        if job.is_none() {
            q.busy = false;
        }
        job
    }

    /// Runs and completes one job (the engine is busy for it).
    fn run_one(&self, job: &Job) {
        job.start();
        let result = if take_one(&self.inject_fail) {
            Err(EIO)
        } else {
            run_on_cpu(job)
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

    fn claim(&self, job: &Job) -> bool {
        if job.bytes() > INLINE_MAX_BYTES {
            return false;
        }
        let mut q = self.0.queue.lock();
        // Not busy: nothing is queued either (a job is queued only while
        // the engine is busy), so every earlier job has completed.
        if q.stopped || q.busy {
            return false;
        }
        q.busy = true;
        q.inline = true;
        true
    }

    fn run_claimed(&self, job: ListArc<Job>) {
        self.0.inline_jobs.add(1, Relaxed);
        self.0.run_one(&job);
        {
            let mut q = self.0.queue.lock();
            if q.jobs.is_empty() {
                q.busy = false;
            } else {
                // Jobs queued behind this one: the work item owns the
                // engine now (`busy` stays set). Queued under the lock, as
                // in `submit`, so `shutdown` flushes it.
                let _ = queue().enqueue(self.0.clone());
            }
            q.inline = false;
            self.0.inline_done.notify_all();
        }
        // Not under the queue lock, and after the engine was handed on:
        // the job's last reference reports it, taking its file's tracker
        // lock (in `JobTracker::submit`, which holds one more).
        drop(job);
    }

    fn cancel(&self, tracker: &JobTracker) {
        let taken = take_jobs_of(&mut self.0.queue.lock().jobs, tracker);
        fail_all(taken, ecanceled());
    }

    fn describe(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        writeln!(f, "inline_jobs: {}", self.0.inline_jobs.load(Relaxed))
    }

    fn inject(&self, cmd: &[u8]) -> Result {
        match cmd {
            b"fail_job" => self.0.inject_fail.add(1, Relaxed),
            _ => return Err(EINVAL),
        }
        Ok(())
    }

    fn shutdown(&self, stopped: &mut dyn FnMut()) {
        {
            let mut q = self.0.queue.lock();
            q.stopped = true;
            // A job run by its submitter: wait until it completed (and
            // handed any queued jobs to the work item, flushed below).
            while q.inline {
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
