//! Async-exec fences and the output-completion plane of a tensor.
//!
//! Host storages (Malloc, User, Fake) keep the seed's counters in user
//! space: [`crate::compat::TensorCompat::mark_async_start`] and
//! [`crate::compat::TensorCompat::mark_async_finish`] are the producer side
//! of the fence the I/O operations wait on, and [`Completion::record`] is
//! the producer of the completion count. `Dma` storage uses the kernel's
//! counters, driven by jobs ([`crate::Job`]).
//!
//! The count is reached through one small view,
//! [`TensorOps::completion`](crate::ops::TensorOps::completion)
//! ([`Completion`]: `count`, `wait`, `reset`, `record`); nrt's names for
//! the same operations (`check_output_completion`, ...) are in
//! [`crate::compat::TensorCompat`].
//!
//! Completion counts are per view, as in the seed: a new slice starts at 0.
//! Unlike the seed, which guarded every tensor's count with one global
//! lock/condvar, a host view's count is guarded by its storage's lock, and a
//! `Dma` view's count is the buffer's kernel count minus a per-view
//! baseline (the kernel counts once per job per buffer, so a job writing any
//! part of the buffer counts for every view of it).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
pub use crate::fence::PendingAccess;
use crate::log::{heartbeat_interval, log_warn};
use crate::sys::{FenceKind, SysError};
use crate::tensor::Tensor;
use crate::wait::Deadline;

/// A direction of device access, for the async marks and fences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The device (or host) reads the bytes.
    Read,
    /// The device (or host) writes the bytes.
    Write,
}

/// A `Dma` view's baseline in the kernel's count: the count at which the
/// view's count was 0, unless the buffer's count was reset through
/// [`crate::Device::completion_reset`] since (`seen` is the reset epoch
/// the baseline was taken at, `now` the current one); then the view counts
/// from that reset, like every view of the buffer.
fn effective_baseline(base: u64, seen: u64, now: u64) -> u64 {
    if seen == now {
        base
    } else {
        0
    }
}

impl Tensor {
    /// The baseline of a `Dma` view now (see [`effective_baseline`]).
    fn dma_baseline(&self, st: &crate::storage::Storage, b: &crate::storage::DmaBuffer) -> u64 {
        let now = b.device.completion_epoch(b.handle);
        st.sync.locked(|| {
            effective_baseline(
                self.completion_cell().load(Ordering::Relaxed),
                self.completion_epoch_cell().load(Ordering::Relaxed),
                now,
            )
        })
    }
}

impl Tensor {
    /// The error of a failed ioctl on this view's buffer `b`: EIO from a
    /// read, fence or completion wait is the buffer's error latch, reported
    /// with the errno the job ended with ([`Error::DeviceWriteFailed`]).
    pub(crate) fn dma_error(
        &self,
        op: &'static str,
        b: &crate::storage::DmaBuffer,
        e: SysError,
    ) -> Error {
        crate::io::latch_error(op, self.name(), b, e)
    }

    /// [`crate::compat::TensorCompat::mark_async_start`].
    pub(crate) fn async_mark_start(&self, access: Access) -> Result<()> {
        let st = self.storage_for("mark_async_start")?;
        if st.dma().is_some() {
            return Err(Error::Unsupported {
                op: "mark_async_start",
                kind: st.kind(),
            });
        }
        st.sync.mark_start(access == Access::Write);
        Ok(())
    }

    /// [`crate::compat::TensorCompat::mark_async_finish`].
    pub(crate) fn async_mark_finish(&self, access: Access) -> Result<()> {
        let st = self.storage_for("mark_async_finish")?;
        if st.dma().is_some() {
            return Err(Error::Unsupported {
                op: "mark_async_finish",
                kind: st.kind(),
            });
        }
        if !st.sync.mark_finish(access == Access::Write) {
            return Err(Error::invalid(format!(
                "no pending async {access:?} on tensor {:?}",
                self.name()
            )));
        }
        Ok(())
    }

    /// [`crate::ops::TensorOps::pending_async`].
    pub(crate) fn pending_accesses(&self) -> Result<PendingAccess> {
        let st = self.storage_for("pending_async")?;
        match st.dma() {
            Some(b) => {
                let info = b.device.buf_info(b.handle)?;
                Ok(PendingAccess {
                    reads: info.pending_reads,
                    writes: info.pending_writes,
                })
            }
            None => Ok(st.sync.pending()),
        }
    }

    /// [`crate::ops::TensorOps::wait_device_idle`].
    pub(crate) fn device_idle_wait(&self, access: Access, timeout: Option<Duration>) -> Result<()> {
        let st = self.storage_for("wait_device_idle")?;
        let write = access == Access::Write;
        let start = Instant::now();
        let deadline = Deadline::from_timeout(timeout);
        let timed_out = || Error::Timeout {
            op: "wait_device_idle",
            name: self.name().to_owned(),
            waited: start.elapsed(),
        };
        match st.dma() {
            Some(b) => {
                let kind = if write {
                    FenceKind::All
                } else {
                    FenceKind::Writes
                };
                loop {
                    match b
                        .device
                        .fence_wait_sys(b.handle, kind, deadline.remaining_us(None))
                    {
                        Ok(()) => return Ok(()),
                        Err(SysError::Interrupted { .. }) if !deadline.expired() => continue,
                        Err(SysError::TimedOut { .. } | SysError::Interrupted { .. }) => {
                            return Err(timed_out())
                        }
                        Err(e) => return Err(self.dma_error("wait_device_idle", b, e)),
                    }
                }
            }
            None if st.sync.wait_device(write, deadline) => Ok(()),
            None => Err(timed_out()),
        }
    }
}

/// The output-completion count of one view of a tensor, from
/// [`TensorOps::completion`](crate::ops::TensorOps::completion).
///
/// A job counts one completion on each buffer it writes when it succeeds.
/// Counts are per view: a new slice starts at 0, and [`Completion::reset`]
/// zeroes this view's count only. A failed job counts none, and latches
/// its error instead ([`Error::DeviceWriteFailed`]).
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    tensor: &'a Tensor,
}

impl<'a> Completion<'a> {
    /// The count of `tensor`'s view.
    pub(crate) fn new(tensor: &'a Tensor) -> Self {
        Completion { tensor }
    }

    /// The view whose count this is.
    pub fn tensor(&self) -> &'a Tensor {
        self.tensor
    }

    /// Waits until the view's count reaches `expected`.
    /// `timeout`: `None` waits without limit (logging a warning every
    /// 30 s), `Some(ZERO)` polls. Fails with [`Error::Timeout`] when time
    /// runs out.
    ///
    /// A job that fails writing a `Dma` tensor counts no completion, so
    /// the count it was waited for would never come: the wait ends with
    /// [`Error::DeviceWriteFailed`] instead, as soon as no other write that
    /// could still complete the buffer is in flight (the driver's error
    /// latch, ABI 1.1; on an older driver only the time-out ends it).
    pub fn wait(&self, expected: u64, timeout: Option<Duration>) -> Result<()> {
        let t = self.tensor;
        let st = t.storage_for("check_output_completion")?;
        let start = Instant::now();
        let deadline = Deadline::from_timeout(timeout);
        let timed_out = || Error::Timeout {
            op: "check_output_completion",
            name: t.name().to_owned(),
            waited: start.elapsed(),
        };
        let heartbeat = || {
            format!(
                "still waiting for output tensor {:?} to reach completion count {expected}",
                t.name()
            )
        };
        let Some(b) = st.dma() else {
            return if st
                .sync
                .wait_count(t.completion_cell(), expected, deadline, &heartbeat)
            {
                Ok(())
            } else {
                Err(timed_out())
            };
        };
        let target = t.dma_baseline(st, b).saturating_add(expected);
        let cap = matches!(deadline, Deadline::Never).then(heartbeat_interval);
        loop {
            match b
                .device
                .completion_wait_sys(b.handle, target, deadline.remaining_us(cap))
            {
                Ok(_) => return Ok(()),
                Err(SysError::TimedOut { .. }) if matches!(deadline, Deadline::Never) => {
                    log_warn!("{}", heartbeat());
                }
                Err(SysError::TimedOut { .. } | SysError::Interrupted { .. })
                    if deadline.expired() =>
                {
                    return Err(timed_out())
                }
                Err(SysError::TimedOut { .. } | SysError::Interrupted { .. }) => {}
                Err(e) => return Err(t.dma_error("check_output_completion", b, e)),
            }
        }
    }

    /// The view's count now.
    pub fn count(&self) -> Result<u64> {
        let t = self.tensor;
        let st = t.storage_for("output_completion_count")?;
        let cell = t.completion_cell();
        match st.dma() {
            Some(b) => {
                let base = t.dma_baseline(st, b);
                let now = b.device.buf_info(b.handle)?.completion_count;
                Ok(now.saturating_sub(base))
            }
            None => Ok(cell.load(Ordering::Relaxed)),
        }
    }

    /// Sets the view's count to 0. Other views of the storage keep theirs
    /// (for `Dma`, the kernel's count is not reset: the view's baseline
    /// moves).
    pub fn reset(&self) -> Result<()> {
        let t = self.tensor;
        let st = t.storage_for("reset_output_completion")?;
        let cell = t.completion_cell();
        match st.dma() {
            Some(b) => {
                st.set_counted();
                // Epoch first (see `Tensor::slice`).
                let epoch = b.device.completion_epoch(b.handle);
                let now = b.device.buf_info(b.handle)?.completion_count;
                st.sync.locked(|| {
                    cell.store(now, Ordering::Relaxed);
                    t.completion_epoch_cell().store(epoch, Ordering::Relaxed);
                });
            }
            None => st.sync.reset(cell),
        }
        Ok(())
    }

    /// Counts one completion of the view and wakes its waiters: the
    /// producer side for host storages, where no device counts for us.
    /// [`Error::Unsupported`] on a `Dma` tensor (its jobs count).
    pub fn record(&self) -> Result<()> {
        let t = self.tensor;
        let st = t.storage_for("record_output_completion")?;
        if st.dma().is_some() {
            return Err(Error::Unsupported {
                op: "record_output_completion",
                kind: st.kind(),
            });
        }
        st.sync.complete(t.completion_cell());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::effective_baseline;
    use crate::compat::TensorCompat;
    use crate::storage::{DmaBuffer, Memory, Storage};
    use crate::sys::Device;
    use crate::Tensor;
    use std::sync::atomic::Ordering;

    /// A `Dma` tensor over a fake buffer of a `/dev/null` device: enough
    /// for the logic above the ioctls.
    pub(crate) fn fake_dma_tensor(dma_addr: u64) -> (std::sync::Arc<Device>, Tensor) {
        let dev = Device::fake_for_tests();
        let buf = DmaBuffer::new(dev.clone(), 7, 0, dma_addr, None);
        let t =
            Tensor::__from_storage_for_tests(Storage::__new_for_tests(64, Memory::Dma(buf), true));
        (dev, t)
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "opens /dev/null and frees the fake buffer with an ioctl"
    )]
    fn view_baselines_follow_a_raw_reset_of_their_buffer() {
        let (dev, t) = fake_dma_tensor(0x1000);
        let st = t.storage_for("t").unwrap();
        let b = st.dma().unwrap();
        // As after reset_output_completion at kernel count 5.
        t.completion_cell().store(5, Ordering::Relaxed);
        assert_eq!(t.dma_baseline(st, b), 5);
        // Device::completion_reset(7) puts the kernel count back to 0.
        dev.fake_reset(7);
        assert_eq!(t.dma_baseline(st, b), 0);
        // A reset of another buffer changes nothing.
        let (dev2, t2) = fake_dma_tensor(0x1000);
        t2.completion_cell().store(3, Ordering::Relaxed);
        dev2.fake_reset(8);
        let st2 = t2.storage_for("t").unwrap();
        assert_eq!(t2.dma_baseline(st2, st2.dma().unwrap()), 3);
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "opens /dev/null and frees the fake buffer with an ioctl"
    )]
    fn pa_refuses_a_withheld_dma_address() {
        let (_dev, t) = fake_dma_tensor(0);
        assert!(matches!(
            t.pa(),
            Err(crate::Error::NoDmaAddress { op: "pa" })
        ));
        assert!(matches!(
            t.device_allocation_info(),
            Err(crate::Error::NoDmaAddress { .. })
        ));
        let (_dev, t) = fake_dma_tensor(0x1000);
        // Never counted: slicing needs no BUF_INFO.
        let st = t.storage_for("t").unwrap();
        st.counted.store(false, Ordering::Relaxed);
        assert_eq!(t.slice(16, 16, None).unwrap().pa().unwrap(), 0x1010);
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "opens /dev/null and frees the fake buffer with an ioctl"
    )]
    fn eio_of_a_read_or_wait_is_the_error_latch() {
        use crate::sys::SysError;
        use crate::Error;
        let (_dev, t) = fake_dma_tensor(0x1000);
        let b = t.storage_for("t").unwrap().dma().unwrap();
        // EIO from COPY_OUT, FENCE_WAIT or COMPLETION_WAIT names the tensor
        // and the failed job's errno (BUF_INFO cannot tell it here: EIO).
        match t.dma_error("read", b, SysError::from_errno("COPY_OUT", libc::EIO)) {
            Error::DeviceWriteFailed { op, name, errno } => {
                assert_eq!((op, name.as_str(), errno), ("read", "_unknown_", libc::EIO));
            }
            other => panic!("{other:?}"),
        }
        // Other errors pass through.
        assert!(matches!(
            t.dma_error("read", b, SysError::from_errno("COPY_OUT", libc::ENODEV)),
            Error::Sys(SysError::DeviceRemoved { .. })
        ));
    }

    #[test]
    fn a_raw_completion_reset_zeroes_view_baselines() {
        // A view reset at kernel count 5 (epoch 0) counts from 5 ...
        assert_eq!(effective_baseline(5, 0, 0), 5);
        // ... until Device::completion_reset puts the kernel count back to
        // 0 (epoch 1): from then on it counts from 0, so one completion
        // after the reset satisfies `expected = 1` instead of waiting for
        // count 6.
        assert_eq!(effective_baseline(5, 0, 1), 0);
        // A view reset again after the raw reset counts from its own
        // baseline.
        assert_eq!(effective_baseline(2, 1, 1), 2);
    }
}
