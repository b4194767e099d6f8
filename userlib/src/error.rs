//! The tensor layer's error type.

use crate::storage::StorageKind;
use crate::sys::SysError;

/// Result of the tensor layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the tensor layer. A caller's mistake
/// (bad range, wrong storage kind, ...) is always one of these, never a
/// panic.
#[derive(Debug, thiserror::Error)]
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
    /// A device-to-device copy between two HBM channels of one device.
    #[error("Tensors must be allocated on same HBM (SRC: {src}) (DST: {dst})")]
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
    #[error("{op}: timed out")]
    Timeout {
        /// The operation.
        op: &'static str,
    },
    /// A host allocation failed.
    #[error("cannot allocate {0} bytes of host memory")]
    OutOfMemory(usize),
    /// `attach_buffer` on a view other handles share.
    #[error("tensor {0:?} is shared by other references; attach before sharing it")]
    SharedView(String),
    /// An asynchronous job ended with an error.
    #[error("job {job_id} failed: {}", std::io::Error::from_raw_os_error(*errno))]
    JobFailed {
        /// Id of the job.
        job_id: u64,
        /// The errno value.
        errno: i32,
    },
    /// A host access overlaps bytes an open indexed accessor
    /// ([`crate::accessor::TensorAccessor`], on any view of the same
    /// storage) holds in a conflicting way: a write while one is open, or a
    /// read while a read-write one is open. Drop the accessor first.
    #[error("{op}: the bytes are held by an open accessor of the same storage")]
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
}

impl Error {
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
