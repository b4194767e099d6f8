//! Asynchronous copy jobs on `Dma` tensors (`TDRV_IOC_SUBMIT`).
//!
//! A job is a list of buffer-to-buffer copies between `Dma` tensors of one
//! device and one HBM channel. The device runs it in the background: its
//! sources get pending reads and its destinations pending writes until it
//! ends, and each destination buffer's completion count goes up by one when
//! it succeeds, which is what [`Tensor::check_output_completion`] waits for.
//!
//! With an input dump directory set ([`crate::dump`]), submitting first
//! writes the bytes of every source tensor of the job to that directory.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sys::{tdrv_copy_desc, Device, JobStatus, SysError};
use crate::tensor::Tensor;
use crate::trace::{self, TraceOp};
use crate::wait::Deadline;

/// Most copies one job may carry.
pub const MAX_JOB_COPIES: usize = tdrv_uapi::TDRV_MAX_JOB_DESCS as usize;

/// A job being built. See the module documentation.
///
/// ```
/// use std::time::Duration;
/// use tdrv::{Device, Job, Tensor};
///
/// // Runs anywhere: without the module loaded there is nothing to do.
/// if let Ok(dev) = Device::open("/dev/tdrv0") {
///     let src = Tensor::allocate_on(&dev, 0, 4096, Some("in"))?;
///     let dst = Tensor::allocate_on(&dev, 0, 4096, Some("out"))?;
///     src.write(0, &[42; 4096])?;
///     let mut job = Job::new();
///     job.copy(&src, 0, &dst, 0, 2048)?.copy(&src, 2048, &dst, 2048, 2048)?;
///     let handle = job.submit()?;
///     handle.wait()?; // the job's own outcome
///     // One job wrote `dst`: its completion count is 1 (a failed job
///     // would make this an error, not a hang).
///     dst.check_output_completion(Some(Duration::from_secs(1)), 1)?;
///     assert_eq!(dst.to_vec()?, vec![42; 4096]);
/// }
/// # Ok::<(), tdrv::Error>(())
/// ```
#[derive(Default)]
pub struct Job {
    device: Option<Arc<Device>>,
    descs: Vec<tdrv_copy_desc>,
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
}

/// State of a submitted job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    /// Queued or running.
    Pending,
    /// Finished successfully.
    Done,
}

/// A submitted job. Dropping it does not cancel the job (it runs to its
/// end; the driver keeps its buffers until then), but its outcome is
/// then only visible through the destinations' error latch: wait for it.
///
/// Dropping it unused is a warning (`unused_must_use`):
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// fn fire_and_forget(job: &mut tdrv::Job) -> tdrv::Result<()> {
///     job.submit()?; // the job's failure would go unseen
///     Ok(())
/// }
/// ```
#[must_use = "a job's failure is reported only by waiting for it (wait, wait_timeout, try_wait)"]
pub struct JobHandle {
    device: Arc<Device>,
    id: u64,
    _tensors: Vec<Tensor>,
}

impl Job {
    /// An empty job.
    pub fn new() -> Job {
        Job::default()
    }

    /// Number of copies in the job.
    pub fn len(&self) -> usize {
        self.descs.len()
    }

    /// Whether the job has no copies yet.
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    /// Adds a copy of `size` (> 0) bytes from `src` at `src_offset` to
    /// `dst` at `dst_offset`. Both must be `Dma` tensors of the job's device
    /// on one HBM channel.
    pub fn copy(
        &mut self,
        src: &Tensor,
        src_offset: usize,
        dst: &Tensor,
        dst_offset: usize,
        size: usize,
    ) -> Result<&mut Self> {
        if size == 0 {
            return Err(Error::invalid("a job copy needs a non-zero size"));
        }
        if self.descs.len() >= MAX_JOB_COPIES {
            return Err(Error::invalid(format!(
                "a job carries at most {MAX_JOB_COPIES} copies"
            )));
        }
        let (ss, sa) = src.locate("job copy (source)", src_offset, size)?;
        let (ds, da) = dst.locate("job copy (destination)", dst_offset, size)?;
        let (Some(a), Some(b)) = (ss.dma(), ds.dma()) else {
            let kind = if ss.dma().is_none() {
                ss.kind()
            } else {
                ds.kind()
            };
            return Err(Error::Unsupported {
                op: "job copy",
                kind,
            });
        };
        if !Arc::ptr_eq(&a.device, &b.device) {
            return Err(Error::invalid("a job's tensors must be on one device"));
        }
        if let Some(d) = &self.device {
            if !Arc::ptr_eq(d, &a.device) {
                return Err(Error::invalid("a job's tensors must be on one device"));
            }
        }
        if a.channel != b.channel {
            return Err(Error::CrossChannel {
                src: a.channel,
                dst: b.channel,
            });
        }
        self.device = Some(a.device.clone());
        self.descs.push(tdrv_copy_desc {
            src_handle: a.handle,
            src_offset: sa as u64,
            dst_handle: b.handle,
            dst_offset: da as u64,
            size: size as u64,
        });
        if !self.inputs.iter().any(|t| t.same_view(src)) {
            self.inputs.push(src.clone_quiet());
        }
        if !self.outputs.iter().any(|t| t.same_view(dst)) {
            self.outputs.push(dst.clone_quiet());
        }
        Ok(self)
    }

    /// The tensors the job reads, each once.
    pub fn inputs(&self) -> &[Tensor] {
        &self.inputs
    }

    /// The tensors the job writes, each once.
    pub fn outputs(&self) -> &[Tensor] {
        &self.outputs
    }

    /// Adds a copy of the whole of `src` to the whole of `dst`, which
    /// must be of the same size.
    pub fn copy_all(&mut self, src: &Tensor, dst: &Tensor) -> Result<&mut Self> {
        if src.size() != dst.size() {
            return Err(Error::invalid(format!(
                "job copy_all: source {:?} has {} bytes, destination {:?} has {}; \
                 use Job::copy with an explicit size",
                src.name(),
                src.size(),
                dst.name(),
                dst.size()
            )));
        }
        self.copy(src, 0, dst, 0, src.size())
    }

    /// Queues the job on the device and returns at once. The job's copies
    /// move into the handle, leaving this builder empty, so a job can be
    /// built and submitted in one expression:
    /// `Job::new().copy_all(&a, &b)?.submit()?.wait()?`.
    pub fn submit(&mut self) -> Result<JobHandle> {
        let Some(device) = self.device.clone() else {
            return Err(Error::invalid("an empty job cannot be submitted"));
        };
        let id = {
            let name = self.outputs.first().map_or("", |t| t.name());
            let _t = trace::scope(TraceOp::Submit, name, self.descs.len());
            crate::dump::dump_job_inputs(&self.inputs);
            for t in &self.outputs {
                // Before the job can bump the count: see DmaBuffer::counted.
                if let Some(b) = t.storage_for("submit")?.dma() {
                    b.counted.store(true, Ordering::Release);
                }
            }
            device.submit(&self.descs)?
        };
        let mut tensors = std::mem::take(&mut self.inputs);
        tensors.append(&mut self.outputs);
        *self = Job::default();
        Ok(JobHandle {
            device,
            id,
            _tensors: tensors,
        })
    }
}

impl JobHandle {
    /// The driver's id of the job (per open file, increasing from 1).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The job's state now; a failed job is [`Error::JobFailed`].
    pub fn poll(&self) -> Result<JobState> {
        match self.device.job_wait(self.id, 0) {
            Ok(s) => self.state(s),
            Err(SysError::TimedOut { .. }) => Ok(JobState::Pending),
            Err(e) => Err(self.wait_error(e)),
        }
    }

    fn state(&self, s: JobStatus) -> Result<JobState> {
        match s {
            JobStatus::Pending => Ok(JobState::Pending),
            JobStatus::Done => Ok(JobState::Done),
            JobStatus::Failed(errno) => {
                log::debug!("job {} failed with errno {errno}", self.id);
                Err(Error::JobFailed {
                    job_id: self.id,
                    errno,
                })
            }
        }
    }

    /// A failed JOB_WAIT (ESTALE says what to do: `SysError::StaleJob`).
    fn wait_error(&self, e: SysError) -> Error {
        e.into()
    }

    /// Whether the job has ended successfully, without waiting: `Ok(false)`
    /// while it runs, [`Error::JobFailed`] when it failed.
    pub fn try_wait(&self) -> Result<bool> {
        Ok(self.poll()? == JobState::Done)
    }

    /// Waits for the job to end: `Ok` when it succeeded,
    /// [`Error::JobFailed`] when it failed.
    pub fn wait(&self) -> Result<()> {
        self.wait_for(None)
    }

    /// [`JobHandle::wait`] for at most `timeout`: [`Error::Timeout`] when
    /// the job is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        self.wait_for(Some(timeout))
    }

    /// Waits for at most `timeout` (`None`: without limit, `Some(ZERO)`:
    /// poll). See [`JobHandle::wait`].
    pub fn wait_for(&self, timeout: Option<Duration>) -> Result<()> {
        let start = Instant::now();
        let deadline = Deadline::from_timeout(timeout);
        let timed_out = || Error::Timeout {
            op: "job wait",
            name: format!("job {}", self.id),
            waited: start.elapsed(),
        };
        loop {
            let r = self.device.job_wait(self.id, deadline.remaining_us(None));
            match r {
                Ok(s) => match self.state(s)? {
                    JobState::Done => return Ok(()),
                    JobState::Pending if deadline.expired() => return Err(timed_out()),
                    JobState::Pending => {}
                },
                Err(SysError::TimedOut { .. } | SysError::Interrupted { .. })
                    if deadline.expired() =>
                {
                    return Err(timed_out())
                }
                Err(SysError::TimedOut { .. } | SysError::Interrupted { .. }) => {}
                Err(e) => return Err(self.wait_error(e)),
            }
        }
    }
}

impl std::fmt::Debug for JobHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobHandle")
            .field("device", &self.device.path())
            .field("id", &self.id)
            .finish()
    }
}
