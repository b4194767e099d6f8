// SPDX-License-Identifier: GPL-2.0

//! The copy engines behind `TDRV_IOC_SUBMIT`.
//!
//! Each device has one engine, which runs the device's jobs in FIFO order
//! and ends every job through [`crate::job::Job::complete`]:
//! - [`SoftEngine`]: a work item that copies with the CPU (no hardware);
//! - the edu engine (`edu.rs`): QEMU edu's DMA engine, advanced one chunk
//!   per MSI completion interrupt.

use kernel::{
    bindings,
    new_mutex,
    prelude::*,
    sync::{
        atomic::Relaxed,
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
    edu::EduEngine,
    job::Job, //
};

/// The workqueue every tdrv work item runs on: the unbound default queue
/// (`system_dfl_wq`). 7.2's Rust API only names the per-CPU `system_wq`,
/// which distribution kernels flag as deprecated at run time.
pub(crate) fn queue() -> &'static workqueue::Queue {
    // SAFETY: `system_dfl_wq` is a C global, set up before any module loads
    // and never destroyed.
    unsafe { workqueue::Queue::from_raw(bindings::system_dfl_wq) }
}

/// The engine of one device.
pub(crate) enum Engine {
    Soft(Arc<SoftEngine>),
    Edu(Arc<EduEngine>),
}

impl Engine {
    /// Queues `job`; ENODEV once the engine is shut down.
    pub(crate) fn submit(&self, job: Arc<Job>) -> Result {
        match self {
            Engine::Soft(e) => e.submit(job),
            Engine::Edu(e) => e.submit(job),
        }
    }

    /// Interrupts taken and spurious interrupts (zero for the software
    /// engine, which has none).
    pub(crate) fn irq_counts(&self) -> (u64, u64) {
        match self {
            Engine::Soft(_) => (0, 0),
            Engine::Edu(e) => (e.irqs.load(Relaxed), e.spurious_irqs.load(Relaxed)),
        }
    }

    /// Jobs failed by the engine's watchdog.
    pub(crate) fn watchdog_timeouts(&self) -> u64 {
        match self {
            Engine::Soft(_) => 0,
            Engine::Edu(e) => e.watchdog_timeouts.load(Relaxed),
        }
    }
}

struct SoftQueue {
    jobs: KVec<Arc<Job>>,
    stopped: bool,
}

/// CPU copy engine: a work item drains the queue in FIFO order.
#[pin_data]
pub(crate) struct SoftEngine {
    #[pin]
    queue: Mutex<SoftQueue>,
    #[pin]
    work: Work<SoftEngine>,
}

impl_has_work! {
    impl HasWork<Self> for SoftEngine { self.work }
}

impl WorkItem for SoftEngine {
    type Pointer = Arc<SoftEngine>;

    fn run(this: Arc<SoftEngine>) {
        let mut batch = KVec::new();
        loop {
            // Take the whole queue at once: submitters are not blocked while
            // jobs run, and order is kept because batches run in turn. The
            // swap hands the drained vector (and its capacity) back to the
            // queue, so steady-state submission does not reallocate it.
            core::mem::swap(&mut this.queue.lock().jobs, &mut batch);
            if batch.is_empty() {
                return;
            }
            for job in batch.drain_all() {
                for t in &job.transfers {
                    t.run_on_cpu();
                }
                job.complete(Ok(()));
            }
        }
    }
}

impl SoftEngine {
    pub(crate) fn new() -> Result<Arc<Self>> {
        Arc::pin_init(
            pin_init!(Self {
                queue <- new_mutex!(
                    SoftQueue {
                        jobs: KVec::new(),
                        stopped: false,
                    },
                    "SoftEngine::queue"
                ),
                work <- new_work!("SoftEngine::work"),
            }),
            GFP_KERNEL,
        )
    }

    fn submit(self: &Arc<Self>, job: Arc<Job>) -> Result {
        let mut q = self.queue.lock();
        if q.stopped {
            return Err(ENODEV);
        }
        q.jobs.push(job, GFP_KERNEL)?;
        // Queue the work while still holding the lock, so `shutdown` (which
        // sets `stopped` under it, then flushes) cannot miss this job. This
        // fails only if the work is already pending, and that run will see
        // the job.
        let _ = queue().enqueue(self.clone());
        Ok(())
    }

    /// Refuses new jobs and returns once every queued job has completed.
    pub(crate) fn shutdown(&self) {
        self.queue.lock().stopped = true;
        // SAFETY: `self.work` is an initialised, pinned `Work` that lives as
        // long as `self`. After `stopped` is set nothing queues it again, so
        // once `flush_work` returns the work item is idle and the queue is
        // empty.
        unsafe { bindings::flush_work(Work::raw_get(&raw const self.work)) };
    }
}
