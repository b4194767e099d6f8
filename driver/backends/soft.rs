// SPDX-License-Identifier: GPL-2.0

//! The software device: a faux bus device with DMA-coherent memory and a
//! CPU copy engine, so that tdrv works on any machine.

use kernel::{
    bindings,
    device,
    error::to_result,
    faux,
    list::{
        List,
        ListArc, //
    },
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

struct SoftQueue {
    jobs: List<Job>,
    stopped: bool,
}

/// CPU copy engine: a work item drains the queue in FIFO order.
///
/// Fault injection for tests (debugfs `inject`): `fail_job` makes the next
/// job the engine runs fail with EIO, copying nothing.
#[pin_data]
struct SoftEngine {
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
    fn new() -> Result<Arc<Self>> {
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
struct SoftBackend(Arc<SoftEngine>);

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
