//! tdrv: the userspace tensor object layer of the tdrv accelerator driver.
//!
//! Allocate on the device, fill, copy with a job, wait, read back:
//!
//! ```
//! use tdrv::{Device, Job, Tensor};
//!
//! # fn main() -> Result<(), tdrv::Error> {
//! # let Ok(dev) = Device::open("/dev/tdrv0") else { return Ok(()) }; // no device here
//! # /*
//! let dev = Device::open("/dev/tdrv0")?;
//! # */
//! let src = Tensor::builder().on(&dev).from_slice(&[1.5f32; 1024])?.into_tensor();
//! let dst = Tensor::builder().on(&dev).zeroed(src.size())?;
//! Job::new().copy_all(&src, &dst)?.submit()?.wait()?;
//! let out: Vec<f32> = dst.to_vec_of()?;
//! assert_eq!(out, [1.5; 1024]);
//! # Ok(())
//! # }
//! ```
//!
//! A failed job cannot be missed: `wait` returns [`Error::JobFailed`], and
//! reads, fences and completion waits on the buffers it wrote return
//! [`Error::DeviceWriteFailed`] (never stale bytes, never an endless wait)
//! until they are written again.
//!
//! Memory and operations are apart: [`Tensor`] is typed memory (allocation,
//! views, storage, host reads and writes, mappings); [`TensorOps`] (in
//! [`ops`]) is what runs on it: fills, copies, the fences of in-flight
//! device accesses and the output-completion count; [`Job`] is the
//! asynchronous device work. nrt's and the seed's names are in [`compat`].
//!
//! A [`Tensor`] is a cheap view (name, offset, size) over refcounted
//! storage: host memory ([`StorageKind::Malloc`]), a tdrv device buffer
//! ([`StorageKind::Dma`]), a size-only placeholder ([`StorageKind::Fake`])
//! or a caller's buffer ([`StorageKind::User`]). Slices share storage
//! without copying. I/O checks every range and returns errors, and is fenced
//! against in-flight device work. The device is reached through the thin
//! [`sys`] layer, one safe method per ioctl of `uapi/tdrv.h`. Data is typed
//! through [`bytemuck::Pod`] ([`Tensor::read_into`], [`Tensor::write_from`],
//! [`Tensor::to_vec_of`]; `f16`/`bf16` from [`half`]).
//!
//! # Fences and completions
//!
//! - A host read of a tensor waits until no device job writes its buffer;
//!   a host write until no job reads or writes it. [`Fencing::Skip`] (batch
//!   calls) skips the wait, not the error check.
//! - A job counts one *output completion* on each buffer it writes when it
//!   succeeds; [`TensorOps::completion`] counts and waits for a view's count
//!   ([`Completion::wait`]).
//!   A failed job counts none, and latches its error on those buffers
//!   instead: waits and reads end with [`Error::DeviceWriteFailed`].
//! - Time-outs are `Option<Duration>`: `None` waits without limit,
//!   `Some(Duration::ZERO)` polls. The C library's microseconds are in
//!   [`compat`].
//!
//! Modules: [`sys`] (device and ioctls), [`ops`] (operations on tensors),
//! [`job`] (asynchronous copy jobs),
//! [`trace`], [`dump`] (input dump), [`handles`] (the C ABI's table of live
//! handles), [`accessor`] and [`coherency`] (typed accessors and their
//! enforcer), [`memcpy`] (staging copies), [`compat`] (the seed's and nrt's
//! names and conventions).
//!
//! Errors: every failure is an [`Error`]; [`Error::raw_os_error`] gives
//! its errno and `std::io::Error::from` converts it. Diagnostics go
//! through the [`log`](https://docs.rs/log) crate (target `tdrv`).
//!
//! Soundness: no safe call can cause undefined behaviour, whatever the
//! threads do; every host access to a storage's bytes takes part in one
//! byte-range exclusion (see `userlib/DESIGN.md`).

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

mod builder;
pub mod compat;
mod completion;
pub mod dump;
mod error;
#[cfg(test)]
mod fakedev;
mod fence;
mod few;
pub mod handles;
mod io;
pub mod job;
mod log;
mod map;
pub mod ops;
mod reactor;
mod set;
mod storage;
pub mod sys;
mod tensor;
pub mod trace;
mod typed;
mod wait;

// Accessors, their coherency enforcer and the staging memcpy (seed 003).
pub mod accessor;
pub mod coherency;
pub mod memcpy;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub use builder::TensorBuilder;
pub use bytemuck;
pub use completion::{Access, Completion, PendingAccess};
pub use error::{Error, Result};
pub use half;
pub use io::{Fencing, RawReadOp, RawWriteOp, ReadOp, WriteOp};
pub use job::{Job, JobHandle, JobState};
pub use log::{set_heartbeat_interval, set_logger, Level, Logger};
pub use map::{MappedBytes, MappedBytesMut, OwnedMappedBytes, OwnedMappedBytesMut};
pub use ops::TensorOps;
pub use set::TensorSet;
pub use storage::{StorageKind, HOST_ALIGN};
pub use sys::{Device, DeviceKind, SysError};
pub use tensor::{Placement, Tensor, DEFAULT_NAME, VIEW_HEAP_SIZE};
pub use typed::TypedTensor;

/// The node [`default_device`] opens unless [`set_default_device_path`]
/// names another.
pub const DEFAULT_DEVICE_PATH: &str = "/dev/tdrv0";

static DEFAULT_PATH: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Sets the node [`default_device`] opens (`None`: [`DEFAULT_DEVICE_PATH`]).
/// It takes effect at the next open: a device already opened stays the
/// default. `libnrt.so.1` sets it from `TDRV_DEVICE`; the crate reads no
/// environment variable.
pub fn set_default_device_path(path: Option<PathBuf>) {
    *DEFAULT_PATH.lock().unwrap_or_else(|e| e.into_inner()) = path;
}

/// The process-wide device `Placement::Device` allocates on: opened on
/// first use from the path [`set_default_device_path`] set, or
/// `/dev/tdrv0`. A failed open is not remembered; the next call tries
/// again.
pub fn default_device() -> Result<Arc<Device>> {
    static DEVICE: Mutex<Option<Arc<Device>>> = Mutex::new(None);
    let mut dev = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = dev.as_ref() {
        return Ok(d.clone());
    }
    let path = DEFAULT_PATH
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DEVICE_PATH));
    let d = Device::open(path)?;
    *dev = Some(d.clone());
    Ok(d)
}
