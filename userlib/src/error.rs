//! The tensor layer's error type.

use crate::storage::StorageKind;
use crate::sys::SysError;

/// Result of the tensor layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the tensor layer. A caller's mistake
/// (bad range, wrong storage kind, ...) is always one of these, never a
/// panic.
///
/// [`Error::raw_os_error`] gives the errno an error stands for, and
/// `std::io::Error::from(e)` turns it into an I/O error of the matching
/// kind (with this error as its source).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A system call on the device failed.
    #[error(transparent)]
    Sys(#[from] SysError),
    /// `offset + size` reaches past the end of the view.
    #[error("{op}: bytes [{offset}, {offset}+{size}) are outside the {len}-byte tensor")]
    OutOfBounds {
        /// The operation.
        op: &'static str,
        /// Start of the range.
        offset: usize,
        /// Size in bytes.
        size: usize,
        /// Length available.
        len: usize,
    },
    /// `offset + size` overflows.
    #[error("{op}: offset {offset} + size {size} overflows")]
    Overflow {
        /// The operation.
        op: &'static str,
        /// Start of the range.
        offset: usize,
        /// Size in bytes.
        size: usize,
    },
    /// The tensor has no storage (made by `allocate_empty`, never attached).
    #[error("{op}: tensor {name:?} has no storage")]
    NoStorage {
        /// The operation.
        op: &'static str,
        /// Name of the tensor.
        name: String,
    },
    /// The operation does not exist for this kind of storage.
    #[error("{op} is not supported on {kind:?} storage")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// Kind of storage.
        kind: StorageKind,
    },
    /// The driver had no room for a buffer: out of memory (`ENOMEM`), or
    /// the channel's or this file's byte or buffer limit (`ENOSPC`).
    /// Other refusals (a zero size, ...) are [`Error::Sys`].
    #[error(
        "allocating {size} bytes on HBM channel {channel} of {}: {source}{}",
        device.display(),
        alloc_hint(source)
    )]
    DeviceAlloc {
        /// The device node.
        device: std::path::PathBuf,
        /// The HBM channel asked for.
        channel: u32,
        /// The size asked for.
        size: usize,
        /// The driver's error.
        #[source]
        source: SysError,
    },
    /// A device-to-device copy between two HBM channels of one device.
    #[error(
        "Tensors must be allocated on same HBM (SRC: {src}) (DST: {dst}): \
         allocate both on one channel, or copy through a host tensor"
    )]
    CrossChannel {
        /// HBM channel of the source.
        src: u32,
        /// HBM channel of the destination.
        dst: u32,
    },
    /// A malformed argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A wait ran out of time.
    #[error("{op}: tensor {name:?}: timed out after {waited:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The tensor waited on (empty for a job wait).
        name: String,
        /// How long the call waited.
        waited: std::time::Duration,
    },
    /// A host allocation failed.
    #[error("cannot allocate {0} bytes of host memory")]
    OutOfMemory(usize),
    /// `attach_buffer` on a view other handles share.
    #[error("tensor {0:?} is shared by other references; attach before sharing it")]
    SharedView(String),
    /// An asynchronous job ended with an error: the device failed (`EIO`,
    /// `ETIMEDOUT`), its file was closed (`ECANCELED`) or the device was
    /// removed (`ENODEV`). Its destinations' bytes are undefined, and the
    /// driver latched the error on them (see [`Error::DeviceWriteFailed`]).
    #[error("job {job_id} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    JobFailed {
        /// Id of the job.
        job_id: u64,
        /// The errno value.
        errno: i32,
    },
    /// The tensor's device buffer holds the error of a job that failed
    /// writing it (the driver's error latch, ABI 1.1): its bytes are
    /// undefined, so reads and completion or fence waits fail with this
    /// instead of returning stale bytes or waiting for ever. A successful
    /// write (a job, [`Tensor::write`], [`TensorOps::memset`],
    /// [`TensorOps::copy`] into it) or [`Device::completion_reset`] of the
    /// buffer clears it.
    ///
    /// [`Tensor::write`]: crate::Tensor::write
    /// [`TensorOps::memset`]: crate::TensorOps::memset
    /// [`TensorOps::copy`]: crate::TensorOps::copy
    /// [`Device::completion_reset`]: crate::Device::completion_reset
    #[error(
        "{op}: tensor {name:?}: a job that wrote it failed ({}); its bytes are \
         undefined until it is written again",
        std::io::Error::from_raw_os_error(*errno)
    )]
    DeviceWriteFailed {
        /// The operation refused.
        op: &'static str,
        /// The tensor.
        name: String,
        /// The errno the failed job ended with (`EIO` when unknown).
        errno: i32,
    },
    /// The safe mapping guards ([`crate::Tensor::map_read`], `map_write`)
    /// refuse a buffer shared through a dma-buf (exported, imported, or
    /// whose raw handle was exported with [`crate::Device::export`]):
    /// another process may write it, so its bytes cannot be lent as a
    /// Rust reference. Copy them ([`crate::Tensor::read`]), or use the
    /// `unsafe` [`crate::Tensor::map_read_shared`] / `map_write_shared`.
    #[error(
        "{op}: the buffer is shared through a dma-buf (another process may write it); \
         copy with read/write, or use the unsafe map_*_shared"
    )]
    SharedBuffer {
        /// The operation refused.
        op: &'static str,
    },
    /// A host access overlaps bytes an open indexed accessor
    /// ([`crate::accessor::TensorAccessor`]) or mapping guard
    /// ([`crate::Tensor::map_read`], `map_write`), on any view of the same
    /// storage, holds in a conflicting way: a write while one is open, or a
    /// read while a read-write one is open. Drop the accessor or guard
    /// first.
    #[error("{op}: the bytes are held by an open accessor or mapping of the same storage")]
    Busy {
        /// The operation refused.
        op: &'static str,
    },
    /// The driver reported no DMA address for the buffer: it hands bus
    /// addresses only to openers with `CAP_SYS_RAWIO`.
    #[error("{op}: the driver does not give DMA addresses to this process (needs CAP_SYS_RAWIO)")]
    NoDmaAddress {
        /// The operation refused.
        op: &'static str,
    },
    /// A file operation (input dump, trace file) failed.
    #[error("{op}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An accessor could not be made or used: its shape, element type,
    /// alignment, index or stream state ([`crate::accessor`]).
    #[error(transparent)]
    Accessor(#[from] crate::accessor::AccessorError),
    /// The tensor's coherency enforcer refused an accessor's slot (policy
    /// COHERENT), or a release had nothing to release
    /// ([`crate::coherency`]).
    #[error(transparent)]
    Coherence(#[from] crate::coherency::CoherenceError),
}

impl Error {
    /// The errno value this error stands for, when it has one: the
    /// driver's for [`Error::Sys`], the job's for [`Error::JobFailed`] and
    /// [`Error::DeviceWriteFailed`], and the natural one for the library's
    /// own checks (`ERANGE` out of bounds, `EINVAL` bad arguments,
    /// `ETIMEDOUT`, `ENOMEM`, `EBUSY`, `EXDEV`, ...).
    pub fn raw_os_error(&self) -> Option<i32> {
        Some(match self {
            Error::Sys(e) | Error::DeviceAlloc { source: e, .. } => e.errno(),
            Error::OutOfBounds { .. } => libc::ERANGE,
            Error::Overflow { .. } => libc::EOVERFLOW,
            Error::NoStorage { .. } => libc::ENXIO,
            Error::Unsupported { .. } | Error::SharedBuffer { .. } => libc::EOPNOTSUPP,
            Error::CrossChannel { .. } => libc::EXDEV,
            Error::InvalidArgument(_) => libc::EINVAL,
            Error::Timeout { .. } => libc::ETIMEDOUT,
            Error::OutOfMemory(_) => libc::ENOMEM,
            Error::SharedView(_) | Error::Busy { .. } => libc::EBUSY,
            Error::JobFailed { errno, .. } | Error::DeviceWriteFailed { errno, .. } => *errno,
            Error::NoDmaAddress { .. } => libc::EPERM,
            Error::Io { source, .. } => return source.raw_os_error(),
            Error::Accessor(e) => e.errno(),
            Error::Coherence(_) => libc::EBUSY,
        })
    }

    /// Whether this is a time-out (of the library or of the driver).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. } | Error::Sys(SysError::TimedOut { .. })
        )
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}

/// What to do about a refused allocation.
fn alloc_hint(e: &SysError) -> &'static str {
    match e {
        SysError::NoSpace { .. } => {
            " (free buffers, use another channel, or raise the module's \
             channel_mib / file_max_mib / file_max_buffers)"
        }
        SysError::NoMemory { .. } => " (the kernel is out of memory)",
        _ => "",
    }
}

impl From<Error> for std::io::Error {
    /// An I/O error of the kind of [`Error::raw_os_error`] that keeps the
    /// tdrv error (and its message) as its payload; an [`Error::Io`]
    /// gives back its own I/O error.
    fn from(e: Error) -> Self {
        match e {
            Error::Io { source, .. } => source,
            e => {
                let kind = e.raw_os_error().map_or(std::io::ErrorKind::Other, |n| {
                    std::io::Error::from_raw_os_error(n).kind()
                });
                std::io::Error::new(kind, e)
            }
        }
    }
}

impl From<SysError> for std::io::Error {
    /// An I/O error of the errno's kind with the message of `e`.
    fn from(e: SysError) -> Self {
        let kind = std::io::Error::from_raw_os_error(e.errno()).kind();
        std::io::Error::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_convert_to_io_errors_with_their_errno_kind() {
        let e = Error::OutOfBounds {
            op: "read",
            offset: 8,
            size: 16,
            len: 16,
        };
        assert_eq!(e.raw_os_error(), Some(libc::ERANGE));
        let msg = e.to_string();
        let io: std::io::Error = e.into();
        assert_eq!(io.to_string(), msg);
        assert!(io.get_ref().is_some_and(|s| s.is::<Error>()));
        let t = Error::Timeout {
            op: "job wait",
            name: String::new(),
            waited: std::time::Duration::from_millis(5),
        };
        assert_eq!(t.raw_os_error(), Some(libc::ETIMEDOUT));
        assert_eq!(std::io::Error::from(t).kind(), std::io::ErrorKind::TimedOut);
        let s = Error::Sys(SysError::NoSpace { op: "ALLOC" });
        assert_eq!(s.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(
            std::io::Error::from(s).kind(),
            std::io::ErrorKind::StorageFull
        );
        let a = Error::DeviceAlloc {
            device: "/dev/tdrv0".into(),
            channel: 1,
            size: 4096,
            source: SysError::NoSpace { op: "ALLOC" },
        };
        assert_eq!(a.raw_os_error(), Some(libc::ENOSPC));
        let m = a.to_string();
        assert!(
            m.contains("4096 bytes on HBM channel 1 of /dev/tdrv0") && m.contains("channel_mib"),
            "{m}"
        );
        let f = Error::DeviceWriteFailed {
            op: "read",
            name: "out".into(),
            errno: libc::ETIMEDOUT,
        };
        assert_eq!(f.raw_os_error(), Some(libc::ETIMEDOUT));
        assert!(f.to_string().contains("\"out\""), "{f}");
    }
}
