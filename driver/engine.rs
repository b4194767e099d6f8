// SPDX-License-Identifier: GPL-2.0

//! The seam between the core and the copy engines behind `TDRV_IOC_SUBMIT`.
//!
//! A backend implements [`Engine`]: it runs the device's jobs and ends
//! every job through [`crate::job::Job::complete`]. Jobs that share a
//! buffer, one of them writing it, must run in submission order: a FIFO
//! engine gets that for free, an engine with several queues must hold a
//! job back until the jobs it depends on are done. A backend whose device has memory
//! of its own also allocates buffers there and moves their bytes by DMA
//! (`alloc_memory` and the `dma_*` methods). The core
//! (files, jobs, unbind) only talks to this trait; the backends live in
//! `backends/`.

use core::any::Any;

use kernel::{
    list::{
        List,
        ListArc, //
    },
    prelude::*,
    sync::{
        atomic::{
            Atomic,
            Relaxed, //
        },
        Arc, //
    },
    uaccess::UserPtr,
    workqueue, //
};

use crate::{
    buffer::{
        Buffer,
        DeviceMemory, //
    },
    device::TdrvDevice,
    job::{
        Job,
        JobTracker,
        Transfer, //
    },
    range::ByteRange, //
};

/// The workqueue the engines' work runs on (the soft engine's copies, the
/// sim device's deferred work and watchdog, edu's watchdog): the module's
/// unbound `tdrv-engine` queue with WQ_MEM_RECLAIM. That work signals
/// out-fences that reclaim may wait on, so it must not depend on a new
/// kworker being created (which can wait on reclaim): the queue's rescuer
/// thread runs it then.
pub(crate) fn queue() -> &'static workqueue::Queue {
    crate::fence_fd::engine_queue()
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
    /// Completions the watchdog found before (or instead of) their
    /// interrupt: late or lost interrupts.
    pub(crate) polled: u64,
}

/// What an engine set aside for a job at SUBMIT ([`Engine::prepare`]),
/// kept in the job until the engine takes it back ([`Job::take_prepared`]).
pub(crate) struct Prepared(KBox<dyn Any + Send + Sync>);

impl Prepared {
    pub(crate) fn new<T: Any + Send + Sync>(data: KBox<T>) -> Self {
        Self(data)
    }

    /// The data, if it is a `T`.
    pub(crate) fn downcast<T: Any + Send + Sync>(self) -> Option<KBox<T>> {
        if !self.0.is::<T>() {
            return None;
        }
        let raw = KBox::into_raw(self.0).cast::<T>();
        // SAFETY: The allocation holds a `T` (checked above), allocated by
        // `KBox` and given up by `into_raw`.
        Some(unsafe { KBox::from_raw(raw) })
    }
}

/// A copy engine: what a backend provides to the core.
pub(crate) trait Engine: Send + Sync {
    /// Allocates, for a job of `transfers`, everything the engine will need
    /// to dispatch and complete it: called at SUBMIT, before any lock the
    /// completion path takes, so that neither dispatching nor completing a
    /// job allocates (dma-fence signalling rules: reclaim may wait for the
    /// job's out-fence). ENOMEM fails the SUBMIT, with nothing queued.
    fn prepare(&self, _transfers: &[Transfer]) -> Result<Option<Prepared>> {
        Ok(None)
    }

    /// Queues `job`; ENODEV once the engine is shut down, EIO while it
    /// recovers from a stuck transfer. Called under the submitting file's
    /// tracker lock, which the completion path takes: must not allocate
    /// (see [`Engine::prepare`]).
    fn submit(&self, job: ListArc<Job>) -> Result;

    /// Whether [`Engine::claim`] could take a job of `bytes` bytes in
    /// `descs` transfers, checked before the job exists: the core then
    /// keeps such a job on the submitter's stack (no allocation), and
    /// moves it to the heap if the engine does not take it.
    fn may_claim(&self, _bytes: u64, _descs: usize) -> bool {
        false
    }

    /// Claims the idle engine for `job`, to be run by the submitting
    /// thread itself with [`Engine::run_claimed`] once it has dropped its
    /// locks; false if the job must be queued with [`Engine::submit`]. An
    /// engine claimed this way holds back every later job until the claimed
    /// one completed, as if it were queued first. Only for a job without
    /// in-fences that [`Engine::may_claim`] allowed, called under its
    /// file's tracker lock (so a file's jobs still reach the engine in id
    /// order).
    fn claim(&self, _job: &Job) -> bool {
        false
    }

    /// Runs and completes `job`, for which [`Engine::claim`] returned
    /// true, in the caller's context, then hands the engine to the jobs
    /// queued meanwhile; the caller drops the job afterwards. Never called
    /// unless `claim` can return true.
    fn run_claimed(&self, job: &Job) {
        job.complete(Err(EINVAL));
    }

    /// The file of `tracker` closed: completes its queued jobs with
    /// ECANCELED now; a running one stops at its next piece or chunk.
    fn cancel(&self, tracker: &JobTracker);

    /// Refuses new jobs, ends the queued and running ones (ENODEV), and
    /// returns once the engine no longer touches any buffer. `stopped` is
    /// called once the device has stopped its DMA and before the engine
    /// drops any job (which may free buffer memory): a PCI backend clears
    /// bus mastering there.
    fn shutdown(&self, stopped: &mut dyn FnMut());

    /// True if the engine reaches buffers by DMA (bus addresses), so that
    /// an imported dma-buf must be mapped for the device; false if it
    /// copies with the CPU.
    fn does_dma(&self) -> bool {
        false
    }

    /// True if the engine ends each job's accesses to its buffers in
    /// bounded time and starts them with [`Job::begin_access`]: imports
    /// of foreign dma-bufs are then revocable (the exporter's
    /// `invalidate_mappings` waits for them). Others attach statically,
    /// and the exporter keeps the memory until the import is freed.
    fn revocable_imports(&self) -> bool {
        false
    }

    /// Counters for debugfs.
    fn counters(&self) -> EngineCounters {
        EngineCounters::default()
    }

    /// Extra debugfs `stats` lines of the backend (queues, device memory).
    fn describe(&self, _f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        Ok(())
    }

    /// Allocates `size` bytes (a multiple of pages) of zeroed device memory
    /// on `channel` for a buffer, under an active guard of `device`; `None`
    /// if the device has no memory of its own (buffers are then host
    /// memory). ENOMEM when no free range is large enough.
    fn alloc_memory(
        &self,
        _device: &TdrvDevice,
        _size: usize,
        _channel: u32,
    ) -> Option<Result<KBox<dyn DeviceMemory>>> {
        None
    }

    /// Copies `range.len` bytes from user memory at `src` to `range` of
    /// `dst` by DMA from the caller's pages. The `dma_*` methods are called
    /// only for buffers in device memory (see `buffer.rs`); the defaults
    /// (EINVAL) are never reached. EFAULT if a page cannot be pinned, EIO
    /// if the device fails a transfer, ENODEV once the device is gone.
    ///
    /// The buffers come as `Arc`s: an engine whose device may still run a
    /// transfer that timed out keeps them (and so their memory) until the
    /// device lets go, as it keeps a job's.
    fn dma_from_user(
        &self,
        _device: &TdrvDevice,
        _dst: &Arc<Buffer>,
        _range: ByteRange,
        _src: UserPtr,
    ) -> Result {
        Err(EINVAL)
    }

    /// Copies `range` of `src` to user memory at `dst` by DMA to the
    /// caller's pages; errors as `dma_from_user`.
    fn dma_to_user(
        &self,
        _device: &TdrvDevice,
        _src: &Arc<Buffer>,
        _range: ByteRange,
        _dst: UserPtr,
    ) -> Result {
        Err(EINVAL)
    }

    /// Fills `range` of `dst` with `value` by DMA.
    fn dma_fill(
        &self,
        _device: &TdrvDevice,
        _dst: &Arc<Buffer>,
        _range: ByteRange,
        _value: u8,
    ) -> Result {
        Err(EINVAL)
    }

    /// Copies `src_range` of `src` to `dst_offset` of `dst` by DMA, for
    /// buffers of which at least one is in device memory (the ranges do not
    /// overlap).
    fn dma_copy(
        &self,
        _device: &TdrvDevice,
        _dst: &Arc<Buffer>,
        _dst_offset: usize,
        _src: &Arc<Buffer>,
        _src_range: ByteRange,
    ) -> Result {
        Err(EINVAL)
    }

    /// Applies a fault-injection command written to debugfs `inject`
    /// (tests only); EINVAL for commands the engine does not know.
    fn inject(&self, _cmd: &[u8]) -> Result {
        Err(EINVAL)
    }
}

/// The `hold_job` and `release` fault injection (debugfs `inject`, tests
/// only), kept under an engine's queue lock: `hold_job` makes the engine
/// hold the next job it would start, and start no job at all while it
/// holds one, until `release`. A test thus gets a busy engine with a
/// queue that does not move, on any device and clock, without depending
/// on how long a job takes.
///
/// The held job stays queued, never started: closing its file cancels it
/// like any queued job, which ends the hold (the engine serves the other
/// files again), and a stopped engine ignores the hold, so neither close
/// nor unbind nor `rmmod` ever waits for a `release`.
#[derive(Default)]
pub(crate) struct Hold {
    /// `hold_job` was written and no job has been caught yet.
    armed: bool,
    /// The held job's address: only compared, never dereferenced.
    held: Option<usize>,
}

impl Hold {
    /// `hold_job`: EBUSY while a hold is armed or a job held.
    pub(crate) fn arm(&mut self) -> Result {
        if self.armed || self.held.is_some() {
            return Err(EBUSY);
        }
        self.armed = true;
        Ok(())
    }

    /// Whether the engine must leave `job`, the next job it would start,
    /// queued: it is held (an armed hold catches it), or another is.
    pub(crate) fn holds(&mut self, job: &Job) -> bool {
        if self.armed && self.held.is_none() {
            self.armed = false;
            self.held = Some(core::ptr::from_ref(job) as usize);
        }
        self.held.is_some()
    }

    /// Whether a job is held, or an armed hold would catch the next one.
    pub(crate) fn active(&self) -> bool {
        self.armed || self.held.is_some()
    }

    /// Whether a job is held.
    pub(crate) fn holding(&self) -> bool {
        self.held.is_some()
    }

    /// `release` (or shutdown): ends the hold and disarms it; true if a
    /// job was held.
    pub(crate) fn release(&mut self) -> bool {
        self.armed = false;
        self.held.take().is_some()
    }

    /// The engine took `jobs` out of its queue (their file closed): if the
    /// held job is one of them, the hold ends. True if it did.
    pub(crate) fn taken(&mut self, jobs: &List<Job>) -> bool {
        // The jobs are alive (in `jobs`), so no other job has the held
        // job's address.
        self.taken_if(|held| {
            jobs.iter()
                .any(|j| core::ptr::from_ref::<Job>(&*j) as usize == held)
        })
    }

    /// [`Hold::taken`] for jobs the engine keeps elsewhere: `is_taken`
    /// says whether the job at the held address is among them.
    pub(crate) fn taken_if(&mut self, is_taken: impl FnOnce(usize) -> bool) -> bool {
        let Some(held) = self.held else {
            return false;
        };
        if is_taken(held) {
            self.held = None;
            return true;
        }
        false
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
