// SPDX-License-Identifier: GPL-2.0

//! The seam between the core and the copy engines behind `TDRV_IOC_SUBMIT`.
//!
//! A backend implements [`Engine`]: it runs the device's jobs in FIFO
//! order and ends every job through [`crate::job::Job::complete`]. The core
//! (files, jobs, unbind) only talks to this trait:
//! - [`SoftEngine`] (here): a work item that copies with the CPU;
//! - the edu engine (`edu.rs`): QEMU edu's DMA engine, advanced one chunk
//!   per MSI completion interrupt.

use kernel::{
    bindings,
    list::{
        List,
        ListArc, //
    },
    new_mutex,
    prelude::*,
    sync::{
        atomic::{
            Atomic,
            Relaxed, //
        },
        Arc,
        Mutex, //
    },
    workqueue::{
        self,
        impl_has_work,
        new_work,
        Work,
        WorkItem, //
    }, //
};

use crate::{
    uapi::ecanceled,
    buffer::ENGINE_PIECE,
    glue,
    job::{
        Job,
        JobTracker, //
    },
};

/// The workqueue every tdrv work item runs on: the unbound default queue
/// (`system_dfl_wq`). 7.2's Rust API only names the per-CPU `system_wq`,
/// which distribution kernels flag as deprecated at run time.
pub(crate) fn queue() -> &'static workqueue::Queue {
    // SAFETY: `system_dfl_wq` is a C global, set up before any module loads
    // and never destroyed.
    unsafe { workqueue::Queue::from_raw(bindings::system_dfl_wq) }
}

/// Counters an engine reports in debugfs.
#[derive(Default)]
pub(crate) struct EngineCounters {
    /// Interrupts taken.
    pub(crate) irqs: u64,
    /// Interrupts that completed nothing.
    pub(crate) spurious_irqs: u64,
    /// Chunks the watchdog found stuck.
    pub(crate) watchdog_timeouts: u64,
    /// Recoveries after a stuck chunk (queued jobs failed with EIO).
    pub(crate) resets: u64,
}

/// A copy engine: what a backend provides to the core.
pub(crate) trait Engine: Send + Sync {
    /// Queues `job`; ENODEV once the engine is shut down, EIO while it
    /// recovers from a stuck transfer.
    fn submit(&self, job: ListArc<Job>) -> Result;

    /// The file of `tracker` closed: completes its queued jobs with
    /// ECANCELED now; a running one stops at its next piece or chunk.
    fn cancel(&self, tracker: &JobTracker);

    /// Refuses new jobs, ends the queued and running ones (ENODEV), and
    /// returns once the engine no longer touches any buffer. `stopped` is
    /// called once the device has stopped its DMA and before the engine
    /// drops any job (which may free buffer memory): a PCI backend clears
    /// bus mastering there.
    fn shutdown(&self, stopped: &mut dyn FnMut());

    /// Counters for debugfs.
    fn counters(&self) -> EngineCounters {
        EngineCounters::default()
    }

    /// Applies a fault-injection command written to debugfs `inject`
    /// (tests only); EINVAL for commands the engine does not know.
    fn inject(&self, _cmd: &[u8]) -> Result {
        Err(EINVAL)
    }
}

/// Decrements a pending fault-injection count; false if it was zero.
pub(crate) fn take_one(count: &Atomic<u32>) -> bool {
    let mut v = count.load(Relaxed);
    while v > 0 {
        match count.cmpxchg(v, v - 1, Relaxed) {
            Ok(_) => return true,
            Err(now) => v = now,
        }
    }
    false
}

/// Removes from `queue` the jobs `tracker` submitted, in order.
pub(crate) fn take_jobs_of(queue: &mut List<Job>, tracker: &JobTracker) -> List<Job> {
    let mut taken = List::new();
    let mut cursor = queue.cursor_front();
    while let Some(next) = cursor.peek_next() {
        if next.arc().submitted_by(tracker) {
            taken.push_back(next.remove());
        } else {
            cursor.move_next();
        }
    }
    taken
}

/// Completes every job of `jobs` with `err`.
pub(crate) fn fail_all(mut jobs: List<Job>, err: Error) {
    while let Some(job) = jobs.pop_front() {
        job.complete(Err(err));
    }
}

struct SoftQueue {
    jobs: List<Job>,
    stopped: bool,
}

/// CPU copy engine: a work item drains the queue in FIFO order.
///
/// Fault injection for tests (debugfs `inject`): `fail_job` makes the next
/// job the engine runs fail with EIO, copying nothing.
#[pin_data]
pub(crate) struct SoftEngine {
    #[pin]
    queue: Mutex<SoftQueue>,
    #[pin]
    work: Work<SoftEngine>,
    /// Injected failures still to apply.
    inject_fail: Atomic<u32>,
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
            // `shutdown`, which waits for this work item. SUBMIT checked
            // both ranges.
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
        loop {
            // (A `let` statement: the lock is dropped before the job runs.)
            let job = this.queue.lock().jobs.pop_front();
            let Some(job) = job else {
                return;
            };
            job.start();
            let result = if take_one(&this.inject_fail) {
                Err(EIO)
            } else {
                run_on_cpu(&job)
            };
            job.complete(result);
        }
    }
}

impl SoftEngine {
    pub(crate) fn new() -> Result<Arc<Self>> {
        Arc::pin_init(
            pin_init!(Self {
                queue <- new_mutex!(
                    SoftQueue {
                        jobs: List::new(),
                        stopped: false,
                    },
                    "SoftEngine::queue"
                ),
                work <- new_work!("SoftEngine::work"),
                inject_fail: Atomic::new(0),
            }),
            GFP_KERNEL,
        )
    }
}

/// The software engine as the core sees it.
pub(crate) struct SoftBackend(pub(crate) Arc<SoftEngine>);

impl Engine for SoftBackend {
    fn submit(&self, job: ListArc<Job>) -> Result {
        let mut q = self.0.queue.lock();
        if q.stopped {
            return Err(ENODEV);
        }
        q.jobs.push_back(job);
        // Queue the work while still holding the lock, so `shutdown` (which
        // sets `stopped` under it, then flushes) cannot miss this job. This
        // fails only if the work is already pending, and that run will see
        // the job.
        let _ = queue().enqueue(self.0.clone());
        Ok(())
    }

    fn cancel(&self, tracker: &JobTracker) {
        let taken = take_jobs_of(&mut self.0.queue.lock().jobs, tracker);
        fail_all(taken, ecanceled());
    }

    fn inject(&self, cmd: &[u8]) -> Result {
        match cmd {
            b"fail_job" => self.0.inject_fail.add(1, Relaxed),
            _ => return Err(EINVAL),
        }
        Ok(())
    }

    fn shutdown(&self, stopped: &mut dyn FnMut()) {
        self.0.queue.lock().stopped = true;
        // SAFETY: `work` is an initialised, pinned `Work` that lives as long
        // as the engine. After `stopped` is set nothing queues it again, so
        // once `flush_work` returns the work item is idle and the queue is
        // empty.
        unsafe { bindings::flush_work(Work::raw_get(&raw const self.0.work)) };
        stopped();
    }
}
