//! Names and conventions of the C runtime this crate reimplements (nrt and
//! its seeds), for code ported from it and for `libnrt.so.1`. The main API
//! reads as Rust; these are the same operations under the seed's names.
//!
//! - time-outs in microseconds (0 polls, negative waits without limit):
//!   [`timeout_from_us`] and the `*_us` methods of [`TensorCompat`];
//! - nrt's constructors: [`TensorCompat::allocate`] (`nrt_tensor_allocate`
//!   with its placements; the main API has [`Tensor::builder`] with
//!   [`crate::TensorBuilder::placement`]), [`TensorCompat::allocate_empty`]
//!   and [`TensorCompat::attach_buffer`] (the main API has
//!   [`Tensor::from_user_buffer`]);
//! - `nrt_tensor_get_device_allocation_info`:
//!   [`TensorCompat::device_allocation_info`] ([`DeviceAllocationInfo`]; the
//!   main API has [`Tensor::pa`], [`Tensor::size`] and [`Tensor::channel`]);
//! - `tensor_get_reference`: [`TensorCompat::get_reference`] (a `clone`);
//! - nrt's output-completion calls (`nrt_tensor_check_output_completion`,
//!   ...): [`TensorCompat::check_output_completion`] and its family, which
//!   the main API spells [`TensorOps::completion`] ([`crate::Completion`]);
//! - the seed's asynchronous-access marks of host storage
//!   (`tensor_async_update`): [`TensorCompat::mark_async_start`] and
//!   [`TensorCompat::mark_async_finish`] (the main API has jobs, which the
//!   kernel tracks, and [`TensorOps::pending_async`] to ask);
//! - the seed's accessor-era names: [`TensorAccessors`] (the accessor
//!   factories and `get_`/`set_accessor_coherence_policy`, from
//!   [`crate::accessor`]), [`TensorBase32`], the `neuron_memcpy`
//!   family ([`neuron_memcpy_from_tensor`], ...).

use std::time::Duration;

pub use crate::accessor::TensorAccessors;
pub use crate::coherency::TensorBase32;
pub use crate::memcpy::*;
pub use crate::wait::timeout_from_us;

use crate::completion::Access;
use crate::error::Result;
use crate::ops::TensorOps;
use crate::tensor::{Placement, Tensor};

/// Physical placement of a device tensor (nrt's device allocation info),
/// from [`TensorCompat::device_allocation_info`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAllocationInfo {
    /// Device (bus) address of the view's first byte.
    pub physical_address: u64,
    /// Size of the view in bytes.
    pub size: usize,
    /// HBM channel of the buffer.
    pub hbm_index: u32,
}

/// The seed's and nrt's spellings of [`Tensor`] operations. Bring it into
/// scope (`use tdrv::compat::TensorCompat`) to call them as methods and
/// associated functions of [`Tensor`] (`Tensor::allocate(..)`).
pub trait TensorCompat {
    /// Allocates a tensor of `size` bytes (nrt's `nrt_tensor_allocate`).
    /// `Device` placement allocates on HBM `channel` of the process-wide
    /// device ([`crate::default_device`]); `Host` and `Virtual` allocate
    /// zeroed host memory and ignore `channel`. The name defaults to
    /// `"_unknown_"`. The same as
    /// `Tensor::builder().placement(p).channel(c).name(n).zeroed(size)`.
    fn allocate(
        placement: Placement,
        channel: u32,
        size: usize,
        name: Option<&str>,
    ) -> Result<Tensor>;

    /// A tensor with no storage and size 0 (nrt's
    /// `nrt_tensor_allocate_empty`), to be given a buffer with
    /// [`TensorCompat::attach_buffer`].
    fn allocate_empty(name: Option<&str>) -> Result<Tensor>;

    /// Drops the storage this view had (if it was the last user) and makes
    /// the view cover the caller's buffer, which the library never frees
    /// (nrt's `nrt_tensor_attach_buffer`). Fails with
    /// [`crate::Error::SharedView`] when other handles share the view
    /// (clones, tensor sets): attach before sharing.
    /// [`Tensor::from_user_buffer`] does both steps in one.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `size` bytes for as long
    /// as any view of the new storage lives (slices included), and must not
    /// be accessed by other means while a tensor operation on it runs. A
    /// null `ptr` is allowed only with `size == 0`.
    unsafe fn attach_buffer(&mut self, ptr: *mut u8, size: usize) -> Result<()>;

    /// Physical address, size and HBM channel of a `Dma` tensor: its
    /// [`Tensor::pa`], [`Tensor::size`] and [`Tensor::channel`].
    fn device_allocation_info(&self) -> Result<DeviceAllocationInfo>;

    /// Another handle to the same view (the seed's `tensor_get_reference`):
    /// [`Clone::clone`].
    fn get_reference(&self) -> Tensor;

    /// Waits until this view's output-completion count reaches `expected`
    /// (nrt's `nrt_tensor_check_output_completion`, with its argument
    /// order): [`Completion::wait`](crate::Completion::wait) via
    /// [`TensorOps::completion`].
    fn check_output_completion(&self, timeout: Option<Duration>, expected: u64) -> Result<()>;

    /// [`TensorCompat::check_output_completion`] with nrt's time-out in
    /// microseconds (0 polls, negative waits without limit).
    fn check_output_completion_us(&self, timeout_us: i64, expected: u64) -> Result<()>;

    /// This view's output-completion count:
    /// [`Completion::count`](crate::Completion::count).
    fn output_completion_count(&self) -> Result<u64>;

    /// Sets this view's output-completion count to 0 (nrt's
    /// `nrt_tensor_reset_output_completion`):
    /// [`Completion::reset`](crate::Completion::reset).
    fn reset_output_completion(&self) -> Result<()>;

    /// Counts one output completion of a host view and wakes its waiters:
    /// [`Completion::record`](crate::Completion::record).
    fn record_output_completion(&self) -> Result<()>;

    /// [`TensorOps::wait_device_idle`] with a time-out in microseconds.
    fn wait_device_idle_us(&self, access: Access, timeout_us: i64) -> Result<()>;

    /// Marks a device access of the storage as started (the seed's
    /// `tensor_async_update(.., release = false)`). Host storages only: the
    /// kernel tracks `Dma` buffers itself (`Unsupported` on one).
    fn mark_async_start(&self, access: Access) -> Result<()>;

    /// Marks a device access as finished (`tensor_async_update(..,
    /// release = true)`); waiters wake when the counter reaches zero.
    /// Finishing more accesses than were started is `InvalidArgument`
    /// (the counter never wraps).
    fn mark_async_finish(&self, access: Access) -> Result<()>;
}

impl TensorCompat for Tensor {
    fn allocate(
        placement: Placement,
        channel: u32,
        size: usize,
        name: Option<&str>,
    ) -> Result<Tensor> {
        Tensor::allocate_placed(placement, channel, size, name)
    }

    fn allocate_empty(name: Option<&str>) -> Result<Tensor> {
        Tensor::empty(name)
    }

    unsafe fn attach_buffer(&mut self, ptr: *mut u8, size: usize) -> Result<()> {
        // SAFETY: forwarded to our caller.
        unsafe { self.attach_user_buffer(ptr, size) }
    }

    fn device_allocation_info(&self) -> Result<DeviceAllocationInfo> {
        let physical_address = self.pa()?;
        Ok(DeviceAllocationInfo {
            physical_address,
            size: self.size(),
            hbm_index: self.channel().unwrap_or(u32::MAX),
        })
    }

    fn get_reference(&self) -> Tensor {
        self.clone()
    }

    fn check_output_completion(&self, timeout: Option<Duration>, expected: u64) -> Result<()> {
        self.completion().wait(expected, timeout)
    }

    fn check_output_completion_us(&self, timeout_us: i64, expected: u64) -> Result<()> {
        self.completion()
            .wait(expected, timeout_from_us(timeout_us))
    }

    fn output_completion_count(&self) -> Result<u64> {
        self.completion().count()
    }

    fn reset_output_completion(&self) -> Result<()> {
        self.completion().reset()
    }

    fn record_output_completion(&self) -> Result<()> {
        self.completion().record()
    }

    fn wait_device_idle_us(&self, access: Access, timeout_us: i64) -> Result<()> {
        self.wait_device_idle(access, timeout_from_us(timeout_us))
    }

    fn mark_async_start(&self, access: Access) -> Result<()> {
        self.async_mark_start(access)
    }

    fn mark_async_finish(&self, access: Access) -> Result<()> {
        self.async_mark_finish(access)
    }
}

/// A time-out in microseconds for a `Duration` (saturating), the inverse
/// of [`timeout_from_us`]: `None` is -1.
pub fn timeout_to_us(timeout: Option<Duration>) -> i64 {
    timeout.map_or(-1, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}
