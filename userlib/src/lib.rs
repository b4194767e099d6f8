//! tdrv: the userspace tensor object layer of the tdrv accelerator driver.
//!
//! A [`Tensor`] is a cheap view (name, offset, size) over refcounted
//! storage: host memory ([`StorageKind::Malloc`]), a tdrv device buffer
//! ([`StorageKind::Dma`]), a size-only placeholder ([`StorageKind::Fake`])
//! or a caller's buffer ([`StorageKind::User`]). Slices share storage
//! without copying. I/O checks every range and returns errors, and is fenced
//! against in-flight device work. The device is reached through the thin
//! [`sys`] layer, one safe method per ioctl of `uapi/tdrv.h`.
//!
//! Modules: [`sys`] (device and ioctls), `storage`, `tensor` (views and
//! lifecycle), `io` (read/write/memset/copy), `completion` (async fences and
//! output-completion counts), [`job`] (asynchronous copy jobs), [`trace`],
//! [`dump`] (input dump), `set` (tensor sets), [`handles`] (the C ABI's
//! table of live handles), [`accessor`] and [`coherency`] (typed accessors
//! and their enforcer), [`memcpy`] (staging copies).
//!
//! Soundness: no safe call can cause undefined behaviour, whatever the
//! threads do; every host access to a storage's bytes takes part in one
//! byte-range exclusion (see `userlib/DESIGN.md`).

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod compat;
mod completion;
pub mod dump;
mod error;
mod fence;
pub mod handles;
mod io;
pub mod job;
mod log;
mod set;
mod storage;
pub mod sys;
mod tensor;
pub mod trace;
mod wait;

// Accessors, their coherency enforcer and the staging memcpy (seed 003).
pub mod accessor;
pub mod coherency;
pub mod memcpy;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub use completion::{Access, PendingAccess};
pub use error::{Error, Result};
pub use io::{Fencing, RawReadOp, RawWriteOp, ReadOp, WriteOp};
pub use job::{Job, JobHandle, JobState};
pub use log::{set_heartbeat_interval, set_logger, Level, Logger};
pub use set::TensorSet;
pub use storage::{StorageKind, HOST_ALIGN};
pub use sys::{Device, DeviceKind, SysError};
pub use tensor::{DeviceAllocationInfo, Placement, Tensor, DEFAULT_NAME, VIEW_HEAP_SIZE};

/// Environment variable naming the device node of [`default_device`].
pub const DEVICE_ENV: &str = "TDRV_DEVICE";
/// The node [`default_device`] opens when [`DEVICE_ENV`] is not set.
pub const DEFAULT_DEVICE_PATH: &str = "/dev/tdrv0";

/// The process-wide device `Placement::Device` allocates on: opened on
/// first use from `$TDRV_DEVICE`, or `/dev/tdrv0`. A failed open is not
/// remembered; the next call tries again.
pub fn default_device() -> Result<Arc<Device>> {
    static DEVICE: Mutex<Option<Arc<Device>>> = Mutex::new(None);
    let mut dev = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = dev.as_ref() {
        return Ok(d.clone());
    }
    let path = std::env::var_os(DEVICE_ENV)
        .filter(|p| !p.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_DEVICE_PATH), PathBuf::from);
    let d = Device::open(path)?;
    *dev = Some(d.clone());
    Ok(d)
}
