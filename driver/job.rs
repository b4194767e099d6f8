// SPDX-License-Identifier: GPL-2.0

//! Asynchronous copy jobs and the one completion path every engine calls.
//!
//! Life of a job:
//! 1. `TDRV_IOC_SUBMIT` resolves the descriptors into [`Transfer`]s, which
//!    hold references to their buffers, and [`Job::new`] marks a pending
//!    device read on every source and a pending device write on every
//!    destination (the seed's `tensor_async_update(.., release = false)`).
//! 2. The device's engine runs the transfers: the software engine with CPU
//!    copies in a work item, the edu engine with its DMA engine, one chunk per
//!    completion interrupt.
//! 3. The engine calls [`Job::complete`] exactly once, with the result. That
//!    drops the pending marks (waking fence waiters when a count reaches
//!    zero), bumps the completion count of each destination if the job
//!    succeeded, and records the outcome in the submitting file's
//!    [`JobTracker`], waking `TDRV_IOC_JOB_WAIT` waiters.
//!
//! A failed job still releases its fences: waiters are never left hanging.

use kernel::{
    new_condvar,
    new_mutex,
    prelude::*,
    sync::{
        atomic::Relaxed,
        Arc,
        CondVar,
        CondVarTimeoutResult,
        Mutex, //
    }, //
};

use crate::{
    buffer::Buffer,
    device::TdrvDevice,
    fence::Timeout,
    range::ByteRange, //
};

/// One buffer-to-buffer copy of a job.
pub(crate) struct Transfer {
    pub(crate) src: Arc<Buffer>,
    pub(crate) src_range: ByteRange,
    pub(crate) dst: Arc<Buffer>,
    pub(crate) dst_offset: usize,
}

impl Transfer {
    /// Runs the transfer with the CPU (software engine).
    pub(crate) fn run_on_cpu(&self) {
        self.dst
            .copy_from(self.dst_offset, &self.src, self.src_range);
    }
}

/// A submitted job.
pub(crate) struct Job {
    id: u64,
    pub(crate) transfers: KVec<Transfer>,
    tracker: Arc<JobTracker>,
    device: Arc<TdrvDevice>,
}

impl Job {
    /// Builds the job and marks its fences (pending reads on sources,
    /// pending writes on destinations). The id comes from
    /// [`JobTracker::submit`].
    fn new(
        id: u64,
        transfers: KVec<Transfer>,
        tracker: Arc<JobTracker>,
        device: Arc<TdrvDevice>,
    ) -> Result<Arc<Self>> {
        let job = Arc::new(
            Job {
                id,
                transfers,
                tracker,
                device,
            },
            GFP_KERNEL,
        )?;
        for t in &job.transfers {
            t.src.fence.begin(false);
            t.dst.fence.begin(true);
        }
        Ok(job)
    }

    /// The completion path, shared by every engine. Call exactly once.
    pub(crate) fn complete(&self, result: Result) {
        let ok = result.is_ok();
        for (i, t) in self.transfers.iter().enumerate() {
            t.src.fence.end(false, false);
            // A job counts one completion per distinct destination buffer,
            // however many of its descriptors write there.
            let last_for_dst = !self.transfers[i + 1..]
                .iter()
                .any(|later| Arc::ptr_eq(&later.dst, &t.dst));
            t.dst.fence.end(true, ok && last_for_dst);
        }
        let stats = &self.device.stats;
        if ok {
            stats.jobs_completed.add(1, Relaxed);
        } else {
            stats.jobs_failed.add(1, Relaxed);
        }
        self.tracker.finish(self.id, result);
    }
}

/// Failed jobs whose status a file keeps for `TDRV_IOC_JOB_WAIT`; older
/// failures are forgotten (their jobs then report plain success).
const MAX_FAILED_KEPT: usize = 4096;

struct TrackerState {
    /// Id of the next job to submit; ids start at 1.
    next_id: u64,
    /// Every job with an id up to this one has finished. Engines run a
    /// device's jobs in FIFO order and a file submits in id order (under the
    /// tracker lock), so completions arrive in id order.
    done_upto: u64,
    /// (id, errno) of recent failed jobs.
    failed: KVec<(u64, i32)>,
}

/// The jobs of one open file: id allocation, outcomes and their waiters.
#[pin_data]
pub(crate) struct JobTracker {
    #[pin]
    state: Mutex<TrackerState>,
    #[pin]
    cv: CondVar,
}

/// What `TDRV_IOC_JOB_WAIT` reports.
pub(crate) enum JobStatus {
    Pending,
    Done(i32),
}

impl JobTracker {
    pub(crate) fn new() -> Result<Arc<Self>> {
        Arc::pin_init(
            pin_init!(Self {
                state <- new_mutex!(
                    TrackerState {
                        next_id: 1,
                        done_upto: 0,
                        failed: KVec::new(),
                    },
                    "JobTracker::state"
                ),
                cv <- new_condvar!("JobTracker::cv"),
            }),
            GFP_KERNEL,
        )
    }

    /// Creates a job from `transfers` and hands it to `device`'s engine.
    /// The tracker lock is held across id allocation and queueing, so one
    /// file's jobs reach the engine in id order. Returns the job id.
    pub(crate) fn submit(
        self: &Arc<Self>,
        device: &Arc<TdrvDevice>,
        transfers: KVec<Transfer>,
    ) -> Result<u64> {
        let mut state = self.state.lock();
        let id = state.next_id;
        // Keep room to record a failure, so `finish` never allocates.
        state.failed.reserve(1, GFP_KERNEL)?;
        let job = Job::new(id, transfers, self.clone(), device.clone())?;
        if let Err(e) = device.engine().submit(job.clone()) {
            // Never queued: undo the fence marks without counting anything.
            for t in &job.transfers {
                t.src.fence.end(false, false);
                t.dst.fence.end(true, false);
            }
            return Err(e);
        }
        state.next_id += 1;
        device.stats.jobs_submitted.add(1, Relaxed);
        Ok(id)
    }

    fn finish(&self, id: u64, result: Result) {
        let mut state = self.state.lock();
        state.done_upto = state.done_upto.max(id);
        if let Err(e) = result {
            if state.failed.len() >= MAX_FAILED_KEPT {
                state.failed.remove(0).ok();
            }
            // Cannot fail: `submit` reserved a slot and at most one entry is
            // added per job.
            let _ = state.failed.push((id, e.to_errno()), GFP_ATOMIC);
        }
        self.cv.notify_all();
    }

    fn status_locked(state: &TrackerState, id: u64) -> JobStatus {
        if id > state.done_upto {
            return JobStatus::Pending;
        }
        let errno = state
            .failed
            .iter()
            .find(|(fid, _)| *fid == id)
            .map_or(0, |(_, e)| *e);
        JobStatus::Done(errno)
    }

    /// Waits for job `id`: EINVAL for an id this file never issued,
    /// ETIMEDOUT if a timed wait expires, EINTR on a signal. A poll reports
    /// `Pending` instead of failing.
    pub(crate) fn wait(&self, id: u64, timeout: Timeout) -> Result<JobStatus> {
        let mut state = self.state.lock();
        if id == 0 || id >= state.next_id {
            return Err(EINVAL);
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
                        return Err(EINTR);
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
