//! Asynchronous copy jobs on `Dma` tensors (`TDRV_IOC_SUBMIT`).
//!
//! A job is a list of buffer-to-buffer copies between `Dma` tensors of one
//! device and one HBM channel. The device runs it in the background: its
//! sources get pending reads and its destinations pending writes until it
//! ends, and each destination buffer's completion count goes up by one when
//! it succeeds, which is what [`TensorOps::completion`] waits for.
//!
//! [`TensorOps::completion`]: crate::TensorOps::completion
//!
//! With an input dump directory set ([`crate::dump`]), submitting first
//! writes the bytes of every source tensor of the job to that directory.

use std::future::Future;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::few::Few;
use crate::log::{heartbeat_interval, log_warn};
use crate::reactor;
use crate::sys::{tdrv_copy_desc, Device, JobStatus, SysError};
use crate::tensor::Tensor;
use crate::trace::{self, TraceOp};
use crate::wait::Deadline;

/// Most copies one job may carry.
pub const MAX_JOB_COPIES: usize = tdrv_uapi::TDRV_MAX_JOB_DESCS as usize;

/// Most in-fences one job may wait for.
pub const MAX_IN_FENCES: usize = tdrv_uapi::TDRV_MAX_IN_FENCES as usize;

/// A job being built. See the module documentation.
///
/// ```
/// use std::time::Duration;
/// use tdrv::{Device, Job, Tensor, TensorOps};
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
///     dst.completion().wait(1, Some(Duration::from_secs(1)))?;
///     assert_eq!(dst.to_vec()?, vec![42; 4096]);
/// }
/// # Ok::<(), tdrv::Error>(())
/// ```
#[derive(Default)]
pub struct Job {
    device: Option<Arc<Device>>,
    // A one-copy job, the common one, keeps these inline.
    descs: Few<tdrv_copy_desc>,
    inputs: Few<Tensor>,
    outputs: Few<Tensor>,
    /// Duplicates of the `sync_file`s the job waits for.
    in_fences: Vec<OwnedFd>,
    /// Whether to ask for an out-fence.
    out_fence: bool,
    /// The `user_data` of the completion event SUBMIT asks for, if any.
    event: Option<u64>,
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
    /// The job's inputs and outputs, kept alive until it is dropped.
    _tensors: (Few<Tensor>, Few<Tensor>),
    /// The job's out-fence, if it asked for one.
    fence: Option<Arc<OwnedFd>>,
    /// Its key in the reactor while awaited (through the fence or a
    /// completion event; also the event's `user_data`).
    reactor_key: u64,
    /// Whether it was registered with the reactor (to deregister on drop).
    registered: bool,
    /// The task to wake when awaited without a fence (see `poll`).
    fallback: Option<Arc<Mutex<Option<Waker>>>>,
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

    /// Makes the job wait for `fence`, a `sync_file` fd (another job's
    /// [`JobHandle::fence_fd`], another driver's fence, a sw_sync point):
    /// the driver starts it only once every such fence has signalled, and
    /// a fence that signals with an error fails the job with that error,
    /// unrun. The job keeps a duplicate of the fd, so the caller may close
    /// its own. Needs a kernel with fence fds
    /// ([`Device::supports_fence_fds`]): `submit` says
    /// [`SysError::FenceFdsUnsupported`] otherwise.
    pub fn in_fence(&mut self, fence: impl AsFd) -> Result<&mut Self> {
        if self.in_fences.len() >= MAX_IN_FENCES {
            return Err(Error::invalid(format!(
                "a job waits for at most {MAX_IN_FENCES} fences"
            )));
        }
        let fd = fence
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| SysError::from_errno("dup", e.raw_os_error().unwrap_or(libc::EBADF)))?;
        self.in_fences.push(fd);
        Ok(self)
    }

    /// Asks for an out-fence: the submitted job's [`JobHandle::fence_fd`]
    /// is then a `sync_file` fd that becomes readable (poll, epoll) when
    /// the job ends, and awaiting the handle needs no thread of its own.
    /// It costs one fd per live handle. Needs a kernel with fence fds
    /// ([`Device::supports_fence_fds`]).
    pub fn with_out_fence(&mut self) -> &mut Self {
        self.out_fence = true;
        self
    }

    /// Asks, in the SUBMIT itself, for the job's completion event carrying
    /// `user_data` on its device's file (`TDRV_SUBMIT_NOTIFY`, ABI 1.6):
    /// what [`Device::job_notify`] of the submitted job would do, without
    /// the second ioctl, and without the window in which the job is queued
    /// but its event not yet asked for. Read the event with
    /// [`Device::read_events`] (or poll the device's fd), as for
    /// `job_notify`. `submit` then fails, queueing nothing, with
    /// [`SysError::NoSpace`] when the file's or the device's events are
    /// used up, [`SysError::EventsBusy`] when this process's reactor reads
    /// the device's events, and [`SysError::NotSupported`] on a driver
    /// before ABI 1.6 ([`Device::supports_submit_notify`]).
    pub fn with_event(&mut self, user_data: u64) -> &mut Self {
        self.event = Some(user_data);
        self
    }

    /// Drops what [`Job::with_event`] asked for.
    pub fn without_event(&mut self) -> &mut Self {
        self.event = None;
        self
    }

    /// Queues the job on the device and returns at once. The job's copies
    /// move into the handle, leaving this builder empty, so a job can be
    /// built and submitted in one expression:
    /// `Job::new().copy_all(&a, &b)?.submit()?.wait()?`.
    pub fn submit(&mut self) -> Result<JobHandle> {
        let Some(device) = self.device.clone() else {
            return Err(Error::invalid("an empty job cannot be submitted"));
        };
        let fenced = self.out_fence || !self.in_fences.is_empty();
        if fenced && !device.supports_fence_fds() {
            return Err(SysError::FenceFdsUnsupported { op: "SUBMIT" }.into());
        }
        let (id, fence) = {
            let name = self.outputs.first().map_or("", |t| t.name());
            let _t = trace::scope(TraceOp::Submit, name, self.descs.len());
            crate::dump::dump_job_inputs(&self.inputs);
            for t in &self.outputs {
                // Before the job can bump the count: see Storage::counted.
                let st = t.storage_for("submit")?;
                if st.dma().is_some() {
                    st.set_counted();
                }
            }
            let in_fences: Vec<BorrowedFd<'_>> = self.in_fences.iter().map(|f| f.as_fd()).collect();
            device.submit_job_sys(&self.descs, &in_fences, self.out_fence, self.event)?
        };
        let tensors = (
            std::mem::take(&mut self.inputs),
            std::mem::take(&mut self.outputs),
        );
        // Empty again; a descriptor vector (a job of several copies) keeps
        // its room for the next job built in it.
        self.device = None;
        self.descs.clear();
        self.in_fences.clear();
        self.out_fence = false;
        self.event = None;
        Ok(JobHandle {
            device,
            id,
            _tensors: tensors,
            fence: fence.map(Arc::new),
            reactor_key: reactor::new_key(),
            registered: false,
            fallback: None,
        })
    }
}

impl JobHandle {
    /// The driver's id of the job (per open file, increasing from 1).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The device the job was submitted on. Awaiting the handle reads
    /// that file's completion events for you; a `Device` has one event
    /// reader in the process, so once a handle of it was awaited, your own
    /// [`Device::job_notify`] and [`Device::read_events`] on it get
    /// [`SysError::EventsBusy`], and once you read its events yourself,
    /// awaits use the out-fence or a thread instead
    /// ([`Device::claim_events`]). Open the device again for a stream of
    /// your own.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The job's out-fence (submitted [`Job::with_out_fence`]): a
    /// `sync_file` fd that becomes readable (POLLIN) when the job has
    /// ended, with the job's errno as its error (SYNC_IOC_FILE_INFO).
    /// Give it to [`Job::in_fence`] of another job, to another driver, or
    /// to an event loop; duplicate it to keep it past the handle.
    pub fn fence_fd(&self) -> Option<BorrowedFd<'_>> {
        self.fence.as_deref().map(|f| f.as_fd())
    }

    /// The job's state now; a failed job is [`Error::JobFailed`].
    pub fn poll(&self) -> Result<JobState> {
        match self.device.job_wait_sys(self.id, 0) {
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
        // Without a limit, each JOB_WAIT still ends after a heartbeat
        // interval, so a job that never ends is logged rather than silent.
        let cap = matches!(deadline, Deadline::Never).then(heartbeat_interval);
        loop {
            let r = self
                .device
                .job_wait_sys(self.id, deadline.remaining_us(cap));
            match r {
                Ok(s) => match self.state(s)? {
                    JobState::Done => return Ok(()),
                    JobState::Pending if deadline.expired() => return Err(timed_out()),
                    JobState::Pending if cap.is_some() => {
                        log_warn!("still waiting for job {}", self.id);
                    }
                    JobState::Pending => {}
                },
                Err(SysError::TimedOut { .. }) if cap.is_some() => {
                    log_warn!("still waiting for job {}", self.id);
                }
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

/// Awaiting a handle waits for the job without blocking the executor:
/// `Ok(())` when it succeeded, [`Error::JobFailed`] when it failed. It
/// needs no async runtime, and no thread per wait: the process's reactor
/// thread (one for all awaited jobs, started on first use) polls the
/// handle's out-fence ([`Job::with_out_fence`]) if it has one, else its
/// device file for a completion event (`TDRV_IOC_JOB_NOTIFY`, on every
/// kernel, also without `sync_file`). Only a driver older than ABI 1.4
/// makes a handle fall back to a thread of its own that blocks in
/// JOB_WAIT. See `userlib/DESIGN.md`.
impl Future for JobHandle {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().poll_wait(cx)
    }
}

impl JobHandle {
    /// The `Future` implementation, also behind `wait_async`.
    fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self;
        match this.poll() {
            Ok(JobState::Done) => return Poll::Ready(Ok(())),
            Err(e) => return Poll::Ready(Err(e)),
            Ok(JobState::Pending) => {}
        }
        let key = this.reactor_key;
        match (&this.fence, reactor::get()) {
            (Some(fence), Some(r)) => {
                r.register(key, fence.clone(), cx.waker());
                this.registered = true;
            }
            (None, Some(r)) if this.device.supports_events() => {
                match r.register_event(key, &this.device, cx.waker()) {
                    // A new registration asks for the event: the first
                    // time, and again when the task was woken (its event
                    // read, or the device file failed) yet finds its job
                    // pending, so that no wake-up is owed by an event that
                    // will never come. Registered first: an event read
                    // before the registration would be dropped as unknown.
                    Ok(new) => {
                        this.registered = true;
                        if new {
                            if let Err(e) = this.device.notify_unclaimed(this.id, key) {
                                r.deregister(key);
                                return Poll::Ready(Err(this.wait_error(e)));
                            }
                        }
                    }
                    // The caller reads this file's events itself, or this
                    // is a child after fork sharing its parent's stream:
                    // not ours to read.
                    Err(_) => this.wake_from_thread(cx.waker()),
                }
            }
            _ => this.wake_from_thread(cx.waker()),
        }
        // The job may have ended before the registration: look again, so
        // that no wake-up is lost.
        match this.poll() {
            Ok(JobState::Done) => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(e)),
            Ok(JobState::Pending) => Poll::Pending,
        }
    }

    /// Waits for the job inside a tokio runtime (feature `tokio`), or any
    /// other: this is awaiting the handle itself (see `impl Future for
    /// JobHandle`), through the crate's reactor, which polls the
    /// out-fence ([`Job::with_out_fence`]) or the device file's completion
    /// events. `Ok(())` when the job succeeded, [`Error::JobFailed`] when
    /// it failed. It does not use tokio's `AsyncFd`: tokio offers no way
    /// to learn whether a runtime was built with `enable_io` short of
    /// registering, which panics in one without it, and catching that
    /// panic does not work in a program built with `panic = "abort"`.
    #[cfg(feature = "tokio")]
    pub async fn wait_async(&mut self) -> Result<()> {
        std::future::poll_fn(|cx| self.poll_wait(cx)).await
    }

    /// Without a fence: one thread per handle blocks in JOB_WAIT and wakes
    /// the latest waker when the job ends.
    fn wake_from_thread(&mut self, waker: &Waker) {
        if let Some(slot) = &self.fallback {
            let mut w = slot.lock().unwrap_or_else(|e| e.into_inner());
            match w.as_mut() {
                Some(w) => w.clone_from(waker),
                None => *w = Some(waker.clone()),
            }
            return;
        }
        let slot = Arc::new(Mutex::new(Some(waker.clone())));
        let (device, id, s) = (self.device.clone(), self.id, slot.clone());
        let spawned = std::thread::Builder::new()
            .name("tdrv-job-wait".into())
            .spawn(move || {
                // Ends when the job does (or the device goes: ENODEV).
                while let Err(SysError::Interrupted { .. }) = device.job_wait_sys(id, -1) {}
                let waker = s.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(w) = waker {
                    w.wake();
                }
            });
        match spawned {
            Ok(_) => self.fallback = Some(slot),
            // No thread: have the task poll again soon rather than never.
            Err(_) => waker.wake_by_ref(),
        }
    }
}

impl Drop for JobHandle {
    fn drop(&mut self) {
        if self.registered {
            if let Some(r) = reactor::running() {
                r.deregister(self.reactor_key);
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
