//! Names and conventions of the C runtime this crate reimplements (nrt and
//! its seeds), for code ported from it and for `libnrt.so.1`. The main API
//! reads as Rust; these are the same operations under the seed's names.
//!
//! - time-outs in microseconds (0 polls, negative waits without limit):
//!   [`timeout_from_us`] and the `*_us` methods of [`TensorCompat`];
//! - `tensor_get_reference`: [`TensorCompat::get_reference`] (a `clone`);
//! - the seed's asynchronous-access marks of host storage
//!   (`tensor_async_update`): [`TensorCompat::mark_async_start`] and
//!   [`TensorCompat::mark_async_finish`] (the main API has jobs, which the
//!   kernel tracks, and [`Tensor::pending_async`] to ask);
//! - the seed's accessor-era names: [`TensorBase32`], the `neuron_memcpy`
//!   family ([`neuron_memcpy_from_tensor`], ...).

use std::time::Duration;

pub use crate::coherency::TensorBase32;
pub use crate::memcpy::*;
pub use crate::wait::timeout_from_us;

use crate::completion::Access;
use crate::error::Result;
use crate::tensor::Tensor;

/// The seed's spellings of [`Tensor`] operations.
pub trait TensorCompat {
    /// Another handle to the same view (the seed's `tensor_get_reference`):
    /// [`Clone::clone`].
    fn get_reference(&self) -> Tensor;

    /// [`Tensor::check_output_completion`] with nrt's time-out in
    /// microseconds (0 polls, negative waits without limit).
    fn check_output_completion_us(&self, timeout_us: i64, expected: u64) -> Result<()>;

    /// [`Tensor::wait_device_idle`] with a time-out in microseconds.
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
    fn get_reference(&self) -> Tensor {
        self.clone()
    }

    fn check_output_completion_us(&self, timeout_us: i64, expected: u64) -> Result<()> {
        self.check_output_completion(timeout_from_us(timeout_us), expected)
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
