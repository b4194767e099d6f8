//! Thin, safe layer over a tdrv character device (`/dev/tdrv<N>`).
//!
//! [`Device`] owns the open file and offers exactly one safe method per
//! ioctl of `uapi/tdrv.h`, plus [`Device::map`] for mmap(2). Every failure is
//! a [`SysError`], built from errno in one place ([`SysError::from_errno`]).
//! Nothing here knows about tensors: this is the layer the tensor code (and
//! tests that poke the driver directly) are built on.
//!
//! The crate has one error type at its surface: the public methods of
//! [`Device`] return [`crate::Error`], whose [`crate::Error::Sys`] variant
//! carries the `SysError` (match on it, or ask
//! [`crate::Error::raw_os_error`] for the errno). The crate itself calls the
//! `*_sys` twins, which keep the `SysError`, where it branches on the errno
//! (a time-out, an interrupted wait).

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use tdrv_uapi as uapi;

pub use uapi::{
    tdrv_alloc, tdrv_buf_info, tdrv_channel_info, tdrv_copy_desc, tdrv_job_wait, tdrv_version,
};

/// Where device nodes live.
pub const DEV_DIR: &str = "/dev";
/// Prefix of device node names (`tdrv0`, `tdrv1`, ...).
pub const NODE_PREFIX: &str = "tdrv";

/// An error of a system call on a tdrv device.
///
/// `op` names the call (`"ALLOC"`, `"mmap"`, ...). The variants follow the
/// errno values documented in `uapi/tdrv.h`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SysError {
    /// EINVAL: the driver refused an argument.
    #[error("{op}: invalid argument (EINVAL)")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
    },
    /// E2BIG: unknown trailing struct bytes are non-zero.
    #[error("{op}: unknown trailing struct bytes are non-zero (E2BIG)")]
    UnknownFields {
        /// The operation.
        op: &'static str,
    },
    /// ENOENT: no such buffer handle.
    #[error("{op}: no such buffer handle (ENOENT)")]
    NoSuchBuffer {
        /// The operation.
        op: &'static str,
    },
    /// ERANGE: a range outside the buffer.
    #[error("{op}: range outside the buffer (ERANGE)")]
    OutOfRange {
        /// The operation.
        op: &'static str,
    },
    /// EFAULT: a bad user address.
    #[error("{op}: bad user address (EFAULT)")]
    BadAddress {
        /// The operation.
        op: &'static str,
    },
    /// EXDEV: buffers on different HBM channels.
    #[error("{op}: buffers are on different HBM channels (EXDEV)")]
    CrossChannel {
        /// The operation.
        op: &'static str,
    },
    /// ENOMEM: the kernel is out of memory.
    #[error("{op}: out of memory (ENOMEM)")]
    NoMemory {
        /// The operation.
        op: &'static str,
    },
    /// ENOSPC: the channel's byte limit is reached.
    #[error("{op}: channel byte limit reached (ENOSPC)")]
    NoSpace {
        /// The operation.
        op: &'static str,
    },
    /// ETIMEDOUT: a wait timed out.
    #[error("{op}: timed out (ETIMEDOUT)")]
    TimedOut {
        /// The operation.
        op: &'static str,
    },
    /// EINTR: a wait was interrupted by a signal.
    #[error("{op}: interrupted by a signal (EINTR)")]
    Interrupted {
        /// The operation.
        op: &'static str,
    },
    /// ENODEV: the device was removed.
    #[error("{op}: device removed (ENODEV)")]
    DeviceRemoved {
        /// The operation.
        op: &'static str,
    },
    /// ENOTTY: the node is not a tdrv device.
    #[error("{op}: not a tdrv device (ENOTTY)")]
    NotTdrv {
        /// The operation.
        op: &'static str,
    },
    /// EAGAIN: this file has too many unfinished jobs, or they would move
    /// too many bytes (module parameters `file_max_jobs`,
    /// `file_max_inflight_mib`).
    #[error(
        "{op}: too many unfinished jobs or bytes in flight for this file (EAGAIN): \
         wait for some jobs and submit again"
    )]
    TooManyJobs {
        /// The operation.
        op: &'static str,
    },
    /// ESTALE: JOB_WAIT on a job older than the file's last
    /// `TDRV_JOB_WINDOW` (4096) jobs; its status is no longer kept.
    #[error(
        "{op}: the job's status is no longer kept (ESTALE): the driver keeps a \
         file's last 4096 jobs; wait for a job before submitting that many more"
    )]
    StaleJob {
        /// The operation.
        op: &'static str,
    },
    /// EBUSY (from the library, not the driver): the call would write a
    /// buffer that a `Tensor::map_read`/`map_write` guard is lending out.
    /// Drop the guard first.
    #[error("{op}: the buffer is mapped by a live map_read/map_write guard (EBUSY)")]
    Pinned {
        /// The operation.
        op: &'static str,
    },
    /// EBUSY (from the library, not the driver): the device file's
    /// completion events (`job_notify`, `read_events`) have another reader.
    /// A `Device` has one event stream, which one reader in the process
    /// that opened it owns: the library's reactor once a job handle was
    /// awaited on it, else the caller's own `job_notify`/`read_events`
    /// calls. A child after `fork` shares its parent's stream and reads
    /// none of it. Open the device again for a stream of your own.
    #[error("{op}: the device file's completion events are read by {owner} (EBUSY); open the device again for a stream of your own")]
    EventsBusy {
        /// The operation.
        op: &'static str,
        /// Who reads them.
        owner: &'static str,
    },
    /// EOPNOTSUPP from SUBMIT with fence fds: a kernel without
    /// `sync_file` (`CONFIG_SYNC_FILE`); see [`Device::supports_fence_fds`].
    #[error("{op}: fence fds need a kernel with CONFIG_SYNC_FILE (EOPNOTSUPP)")]
    FenceFdsUnsupported {
        /// The operation.
        op: &'static str,
    },
    /// EOPNOTSUPP otherwise: the call does not exist for this buffer or
    /// device pair (for example IMPORT of another device's memory with no
    /// peer-to-peer path to it, or COPY with such an import; see
    /// `uapi/tdrv.h`).
    #[error("{op}: not supported for this buffer or device (EOPNOTSUPP)")]
    NotSupported {
        /// The operation.
        op: &'static str,
    },
    /// Any other errno.
    #[error("{op}: {}", std::io::Error::from_raw_os_error(*errno))]
    Os {
        /// The operation.
        op: &'static str,
        /// The errno value.
        errno: i32,
    },
    /// open(2) of the device node failed.
    #[error("open {}: {}", path.display(), std::io::Error::from_raw_os_error(*errno))]
    Open {
        /// The device node.
        path: PathBuf,
        /// The errno value.
        errno: i32,
    },
    /// The driver speaks an ABI major version this library does not.
    #[error("{}: driver ABI {major}.{minor} is not supported (need {}.x)", path.display(), uapi::TDRV_ABI_MAJOR)]
    AbiMismatch {
        /// The device node.
        path: PathBuf,
        /// Major ABI version the driver reports.
        major: u32,
        /// Minor ABI version the driver reports.
        minor: u32,
    },
}

impl SysError {
    /// The one place errno values become errors.
    pub fn from_errno(op: &'static str, errno: i32) -> Self {
        match errno {
            libc::EINVAL => Self::InvalidArgument { op },
            libc::E2BIG => Self::UnknownFields { op },
            libc::ENOENT => Self::NoSuchBuffer { op },
            libc::ERANGE => Self::OutOfRange { op },
            libc::EFAULT => Self::BadAddress { op },
            libc::EXDEV => Self::CrossChannel { op },
            libc::ENOMEM => Self::NoMemory { op },
            libc::ENOSPC => Self::NoSpace { op },
            libc::ETIMEDOUT => Self::TimedOut { op },
            libc::EINTR => Self::Interrupted { op },
            libc::ENODEV => Self::DeviceRemoved { op },
            libc::ENOTTY => Self::NotTdrv { op },
            libc::EAGAIN => Self::TooManyJobs { op },
            libc::ESTALE => Self::StaleJob { op },
            libc::EOPNOTSUPP => Self::NotSupported { op },
            errno => Self::Os { op, errno },
        }
    }

    fn last(op: &'static str) -> Self {
        Self::from_errno(op, last_errno())
    }

    /// The errno value this error stands for.
    pub fn errno(&self) -> i32 {
        match self {
            Self::InvalidArgument { .. } => libc::EINVAL,
            Self::UnknownFields { .. } => libc::E2BIG,
            Self::NoSuchBuffer { .. } => libc::ENOENT,
            Self::OutOfRange { .. } => libc::ERANGE,
            Self::BadAddress { .. } => libc::EFAULT,
            Self::CrossChannel { .. } => libc::EXDEV,
            Self::NoMemory { .. } => libc::ENOMEM,
            Self::NoSpace { .. } => libc::ENOSPC,
            Self::TimedOut { .. } => libc::ETIMEDOUT,
            Self::Interrupted { .. } => libc::EINTR,
            Self::DeviceRemoved { .. } => libc::ENODEV,
            Self::NotTdrv { .. } => libc::ENOTTY,
            Self::Pinned { .. } | Self::EventsBusy { .. } => libc::EBUSY,
            Self::TooManyJobs { .. } => libc::EAGAIN,
            Self::StaleJob { .. } => libc::ESTALE,
            Self::FenceFdsUnsupported { .. } | Self::NotSupported { .. } => libc::EOPNOTSUPP,
            Self::Os { errno, .. } | Self::Open { errno, .. } => *errno,
            Self::AbiMismatch { .. } => libc::EPROTO,
        }
    }
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// What kind of hardware a device node drives (`tdrv_version.device_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The software device: a CPU copy engine.
    Soft,
    /// QEMU's edu PCI device: its DMA engine and MSI.
    Edu,
    /// The tdrv sim device: buffers in device memory (HBM), several DMA
    /// queues; `get_pa` gives device addresses.
    Sim,
    /// A kind this library does not know.
    Unknown(u32),
}

impl DeviceKind {
    fn from_raw(kind: u32) -> Self {
        match kind {
            uapi::TDRV_DEVICE_SOFT => Self::Soft,
            uapi::TDRV_DEVICE_EDU => Self::Edu,
            uapi::TDRV_DEVICE_SIM => Self::Sim,
            other => Self::Unknown(other),
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Soft => f.write_str("soft"),
            Self::Edu => f.write_str("edu"),
            Self::Sim => f.write_str("sim"),
            Self::Unknown(k) => write!(f, "unknown({k})"),
        }
    }
}

/// Which in-flight device accesses [`Device::fence_wait`] waits out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceKind {
    /// No pending device reads (`TDRV_FENCE_READS`).
    Reads,
    /// No pending device writes (`TDRV_FENCE_WRITES`): before a host read.
    Writes,
    /// Neither (`TDRV_FENCE_ALL`): before a host write.
    All,
}

impl FenceKind {
    fn raw(self) -> u32 {
        match self {
            Self::Reads => uapi::TDRV_FENCE_READS,
            Self::Writes => uapi::TDRV_FENCE_WRITES,
            Self::All => uapi::TDRV_FENCE_ALL,
        }
    }
}

/// Outcome of [`Device::job_wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStatus {
    /// Queued or running.
    Pending,
    /// Finished successfully.
    Done,
    /// Finished with this (positive) errno.
    Failed(i32),
}

/// A completion event read from a device file ([`Device::read_events`]):
/// job `job_id` of this file ended with `status`, and a
/// [`Device::job_notify`] with `user_data` asked for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobEvent {
    /// The job.
    pub job_id: u64,
    /// What [`Device::job_notify`] was given.
    pub user_data: u64,
    /// [`JobStatus::Done`] or [`JobStatus::Failed`], as JOB_WAIT reports.
    pub status: JobStatus,
}

/// An open tdrv device node. Share it with `Arc`: buffers and mappings keep
/// their device alive.
///
/// ```
/// use tdrv::Device;
///
/// // Runs anywhere: without the module loaded, opening fails cleanly.
/// match Device::open("/dev/tdrv0") {
///     Ok(dev) => {
///         let a = dev.alloc(4096, 0)?;
///         dev.copy_in(a.handle, 0, b"hello")?;
///         let mut back = [0u8; 5];
///         dev.copy_out(a.handle, 0, &mut back)?;
///         assert_eq!(&back, b"hello");
///         dev.free(a.handle)?;
///     }
///     Err(e) => eprintln!("no tdrv device here: {e}"),
/// }
/// # Ok::<(), tdrv::Error>(())
/// ```
#[derive(Debug)]
pub struct Device {
    fd: OwnedFd,
    path: PathBuf,
    version: tdrv_version,
    /// Raw `COMPLETION_RESET`s per buffer handle (see
    /// [`Device::completion_epoch`]).
    resets: Mutex<HashMap<u64, u64>>,
    /// Whether `resets` has ever had an entry: keeps the common path a
    /// single atomic load.
    any_reset: AtomicBool,
    /// Buffers with live host references into their mapping
    /// (`Tensor::map_read`/`map_write` guards, device staging buffers), by
    /// handle: the count of pins. Every ioctl that writes a buffer's bytes (COPY_IN, MEMSET,
    /// COPY, SUBMIT) holds the read side for its whole call and refuses a
    /// pinned destination; pinning takes the write side, so it waits for
    /// the writes in progress. See `userlib/DESIGN.md`.
    pins: RwLock<HashMap<u64, usize>>,
    /// Handles of this file whose buffer is shared through a dma-buf
    /// (exported with [`Device::export`], or imported): another process
    /// may write its bytes. Changed under the read side of `pins`, so a
    /// pin and an export of one buffer are ordered.
    shared: Mutex<HashSet<u64>>,
    /// The device number of the node (`st_rdev`): with a `buf_id`, the
    /// process-wide name of a buffer.
    rdev: u64,
    /// The process that opened the file, which alone reads its events
    /// (a child after `fork` shares the file, so its event stream).
    opener: u32,
    /// Who reads the file's completion events in this process (an
    /// `EVENTS_*` value); set once, by the first to read or ask for one.
    /// An atomic, not a lock: a child after `fork` must never find it
    /// held by a thread that does not exist there.
    events_reader: AtomicU8,
    /// An in-process device answering the ioctls (unit tests only, so the
    /// `Dma` paths run under Miri): see `fakedev.rs`.
    #[cfg(test)]
    fake: Option<Arc<crate::fakedev::FakeDevice>>,
}

/// Nobody has asked for an event of the file yet.
const EVENTS_FREE: u8 = 0;
/// The caller's own `job_notify`/`read_events` calls read the events.
const EVENTS_MANUAL: u8 = 1;
/// The library's reactor reads the events (a job handle was awaited).
pub(crate) const EVENTS_REACTOR: u8 = 2;

/// A pin of one buffer (see [`Device`]'s `pins`); unpins on drop.
pub(crate) struct Pin<'a> {
    device: &'a Device,
    handle: u64,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        self.device.unpin(self.handle);
    }
}

/// A pin held for the whole life of a buffer that its owner lends as
/// references (a device staging buffer, `LocalBuffer::device`); unpins on
/// drop. Like [`Pin`], it refuses every write of the buffer's bytes by
/// the raw calls, including with a handle found by probing; the owner's
/// own jobs, made while it holds the buffer exclusively, go through
/// [`Device::submit_as_owner`].
pub(crate) struct OwnedPin {
    device: Arc<Device>,
    handle: u64,
}

impl OwnedPin {
    /// The pinned buffer.
    pub(crate) fn handle(&self) -> u64 {
        self.handle
    }
}

impl Drop for OwnedPin {
    fn drop(&mut self) {
        self.device.unpin(self.handle);
    }
}

impl std::fmt::Debug for OwnedPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedPin")
            .field("handle", &self.handle)
            .finish()
    }
}

impl AsFd for Device {
    /// The device's open file, for `poll`, `fstat`, or passing to another
    /// process; the `Device` keeps owning it.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Device {
    /// Pins buffer `handle`: until the pin drops, ioctls that would write
    /// its bytes fail with [`SysError::Pinned`]. Waits for such ioctls in
    /// progress.
    pub(crate) fn pin(&self, handle: u64) -> Result<Pin<'_>, SysError> {
        let mut pins = self.pins.write().unwrap_or_else(|e| e.into_inner());
        pins.try_reserve(1)
            .map_err(|_| SysError::from_errno("pin", libc::ENOMEM))?;
        *pins.entry(handle).or_insert(0) += 1;
        Ok(Pin {
            device: self,
            handle,
        })
    }

    /// [`Device::pin`] held by the buffer's owner for the buffer's life.
    pub(crate) fn pin_owned(self: &Arc<Self>, handle: u64) -> Result<OwnedPin, SysError> {
        std::mem::forget(self.pin(handle)?);
        Ok(OwnedPin {
            device: self.clone(),
            handle,
        })
    }

    fn unpin(&self, handle: u64) {
        let mut pins = self.pins.write().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = pins.get_mut(&handle) {
            *n -= 1;
            if *n == 0 {
                pins.remove(&handle);
            }
        }
    }

    /// The read side of the pins, held across an ioctl that writes the
    /// bytes of `handles`; [`SysError::Pinned`] if one is pinned.
    fn unpinned(
        &self,
        op: &'static str,
        handles: impl IntoIterator<Item = u64>,
    ) -> Result<RwLockReadGuard<'_, HashMap<u64, usize>>, SysError> {
        self.unpinned_but(op, handles, None)
    }

    /// [`Device::unpinned`], letting through the buffer of `owner` when
    /// that pin is its only one.
    fn unpinned_but(
        &self,
        op: &'static str,
        handles: impl IntoIterator<Item = u64>,
        owner: Option<&OwnedPin>,
    ) -> Result<RwLockReadGuard<'_, HashMap<u64, usize>>, SysError> {
        let pins = self.pins.read().unwrap_or_else(|e| e.into_inner());
        if !pins.is_empty()
            && handles.into_iter().any(|h| match pins.get(&h) {
                None => false,
                Some(&n) => !(n == 1 && owner.is_some_and(|o| o.handle == h)),
            })
        {
            return Err(SysError::Pinned { op });
        }
        Ok(pins)
    }

    /// Opens a device node and checks its ABI version.
    pub fn open(path: impl AsRef<Path>) -> crate::Result<Arc<Device>> {
        Ok(Self::open_sys(path)?)
    }

    /// [`Device::open`] with the sys layer's error.
    pub(crate) fn open_sys(path: impl AsRef<Path>) -> Result<Arc<Device>, SysError> {
        let path = path.as_ref().to_path_buf();
        let cpath = CString::new(path.as_os_str().as_bytes()).map_err(|_| SysError::Open {
            path: path.clone(),
            errno: libc::EINVAL,
        })?;
        // SAFETY: `cpath` is a valid NUL-terminated string that outlives the
        // call; open(2) has no other memory-safety requirement.
        let fd = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(SysError::Open {
                path,
                errno: last_errno(),
            });
        }
        // SAFETY: open(2) just returned this descriptor and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut dev = Device {
            fd,
            path,
            version: tdrv_version::default(),
            resets: Mutex::new(HashMap::new()),
            any_reset: AtomicBool::new(false),
            pins: RwLock::new(HashMap::new()),
            shared: Mutex::new(HashSet::new()),
            rdev: 0,
            opener: std::process::id(),
            events_reader: AtomicU8::new(EVENTS_FREE),
            #[cfg(test)]
            fake: None,
        };
        // SAFETY: an all-zero `stat` is a valid value of the plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: the fd is open and `st` is a live, writable `stat`.
        if unsafe { libc::fstat(dev.fd.as_raw_fd(), &mut st) } != 0 {
            return Err(SysError::last("fstat"));
        }
        dev.rdev = st.st_rdev;
        dev.version = dev.version_sys()?;
        if dev.version.abi_major != uapi::TDRV_ABI_MAJOR {
            return Err(SysError::AbiMismatch {
                path: dev.path,
                major: dev.version.abi_major,
                minor: dev.version.abi_minor,
            });
        }
        Ok(Arc::new(dev))
    }

    /// Paths of the tdrv device nodes in `/dev`, in node-number order.
    pub fn enumerate() -> Vec<PathBuf> {
        Self::enumerate_in(DEV_DIR)
    }

    /// Paths of the `tdrv<N>` nodes in `dir`, in node-number order.
    pub fn enumerate_in(dir: impl AsRef<Path>) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(dir.as_ref()) else {
            return Vec::new();
        };
        let mut nodes: Vec<(u32, PathBuf)> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name();
                let digits = name.to_str()?.strip_prefix(NODE_PREFIX)?;
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                Some((digits.parse().ok()?, e.path()))
            })
            .collect();
        nodes.sort();
        nodes.into_iter().map(|(_, p)| p).collect()
    }

    /// Opens every device node of [`Device::enumerate`].
    pub fn open_all() -> crate::Result<Vec<Arc<Device>>> {
        Ok(Self::open_all_sys()?)
    }

    /// [`Device::open_all`] with the sys layer's error.
    pub(crate) fn open_all_sys() -> Result<Vec<Arc<Device>>, SysError> {
        Self::enumerate().into_iter().map(Self::open_sys).collect()
    }

    /// The node this device was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `TDRV_IOC_VERSION` answer read at open time.
    pub fn info(&self) -> &tdrv_version {
        &self.version
    }

    /// The hardware kind behind this node.
    pub fn kind(&self) -> DeviceKind {
        DeviceKind::from_raw(self.version.device_kind)
    }

    /// Number of HBM channels; valid channels are below it.
    pub fn num_channels(&self) -> u32 {
        self.version.num_channels
    }

    /// Largest size one [`Device::alloc`] accepts.
    pub fn max_buffer_size(&self) -> u64 {
        self.version.max_buffer_size
    }

    /// Whether the driver reports all of the `TDRV_FEAT_*` bits in `bits`.
    pub fn has_features(&self, bits: u64) -> bool {
        self.version.features & bits == bits
    }

    /// Whether SUBMIT takes and returns fence fds (`TDRV_FEAT_FENCE_FD`:
    /// ABI 1.2 on a kernel with `CONFIG_SYNC_FILE`).
    pub fn supports_fence_fds(&self) -> bool {
        self.has_features(uapi::TDRV_FEAT_FENCE_FD as u64)
    }

    /// Whether the file delivers completion events (`TDRV_FEAT_EVENTS`,
    /// ABI 1.4): [`Device::job_notify`] and [`Device::read_events`]. Every
    /// kernel has them, also one without `sync_file`.
    pub fn supports_events(&self) -> bool {
        self.has_features(uapi::TDRV_FEAT_EVENTS as u64)
    }

    /// Whether SUBMIT can ask for its job's completion event itself
    /// (`TDRV_FEAT_SUBMIT_NOTIFY`, ABI 1.6): [`Device::submit_notify`].
    pub fn supports_submit_notify(&self) -> bool {
        self.has_features(uapi::TDRV_FEAT_SUBMIT_NOTIFY as u64)
    }

    /// Makes the caller the reader of this file's completion events: `Ok`
    /// if it is (or now is), [`SysError::EventsBusy`] if the library's
    /// reactor reads them (a job handle of this `Device` was awaited), or
    /// this process is not the one that opened the file (a child after
    /// `fork`: the parent's stream). [`Device::job_notify`] and
    /// [`Device::read_events`] make it themselves; call it to learn
    /// beforehand whether they will work. From then on, awaiting a job
    /// handle of this `Device` uses its out-fence or a thread of its own
    /// instead of the events (it never misses its event, never takes
    /// yours). Events belong to the open file, so two readers would take
    /// each other's: for a stream of your own beside awaited handles, open
    /// the device again.
    pub fn claim_events(&self) -> crate::Result<()> {
        Ok(self.claim_events_sys()?)
    }

    /// [`Device::claim_events`] with the sys layer's error.
    pub(crate) fn claim_events_sys(&self) -> Result<(), SysError> {
        self.claim_events_for("claim events", EVENTS_MANUAL)
    }

    /// Makes `reader` (an `EVENTS_*` value) the reader of the file's
    /// events, if the process may read them and nobody else does.
    pub(crate) fn claim_events_for(&self, op: &'static str, reader: u8) -> Result<(), SysError> {
        let owner = |r| match r {
            EVENTS_REACTOR => "the library's reactor (a job handle of this Device was awaited)",
            _ => "this process's own job_notify/read_events calls",
        };
        if std::process::id() != self.opener {
            return Err(SysError::EventsBusy {
                op,
                owner: "the process that opened the file (this is a child after fork)",
            });
        }
        match self.events_reader.compare_exchange(
            EVENTS_FREE,
            reader,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => Ok(()),
            Err(r) if r == reader => Ok(()),
            Err(r) => Err(SysError::EventsBusy {
                op,
                owner: owner(r),
            }),
        }
    }

    /// `TDRV_IOC_JOB_NOTIFY` (ABI 1.4): queues one completion event on this
    /// file when job `job_id` (of this file) has ended, at once if it has,
    /// carrying `user_data`. The file then polls readable (`poll(2)` or
    /// epoll on [`AsFd::as_fd`]) and [`Device::read_events`] returns the
    /// event. One fd serves any number of jobs. Errors: `InvalidArgument`
    /// (an id this file never issued), `StaleJob` (older than the last
    /// 4096 jobs), `NoSpace` (65,536 events asked for and not yet read),
    /// `EventsBusy` (the library's reactor reads this file's events, or
    /// this is a child after `fork`: see [`Device::claim_events`]).
    pub fn job_notify(&self, job_id: u64, user_data: u64) -> crate::Result<()> {
        Ok(self.job_notify_sys(job_id, user_data)?)
    }

    /// [`Device::job_notify`] with the sys layer's error.
    pub(crate) fn job_notify_sys(&self, job_id: u64, user_data: u64) -> Result<(), SysError> {
        self.claim_events_for("JOB_NOTIFY", EVENTS_MANUAL)?;
        self.notify_unclaimed(job_id, user_data)
    }

    /// JOB_NOTIFY for a caller that has claimed the events.
    pub(crate) fn notify_unclaimed(&self, job_id: u64, user_data: u64) -> Result<(), SysError> {
        let mut n = uapi::tdrv_job_notify {
            job_id,
            user_data,
            ..Default::default()
        };
        self.ioctl("JOB_NOTIFY", uapi::TDRV_IOC_JOB_NOTIFY, &mut n, true)
    }

    /// Appends the completion events ready now to `out`, oldest first,
    /// without waiting (`read(2)` with `RWF_NOWAIT`), and returns how many.
    /// Events belong to the open file: whoever reads one consumes it, so
    /// a `Device` has one reader, the first to ask ([`Device::claim_events`]):
    /// `EventsBusy` when the library's reactor reads them for awaited job
    /// handles, or in a child after `fork`. See `userlib/DESIGN.md`.
    pub fn read_events(&self, out: &mut Vec<JobEvent>) -> crate::Result<usize> {
        Ok(self.read_events_sys(out)?)
    }

    /// [`Device::read_events`] with the sys layer's error.
    pub(crate) fn read_events_sys(&self, out: &mut Vec<JobEvent>) -> Result<usize, SysError> {
        self.read_events_max_sys(out, usize::MAX)
    }

    /// [`Device::read_events`], reading at most `max` events; the others
    /// stay queued for the next call.
    pub fn read_events_max(&self, out: &mut Vec<JobEvent>, max: usize) -> crate::Result<usize> {
        Ok(self.read_events_max_sys(out, max)?)
    }

    /// [`Device::read_events_max`] with the sys layer's error.
    pub(crate) fn read_events_max_sys(
        &self,
        out: &mut Vec<JobEvent>,
        max: usize,
    ) -> Result<usize, SysError> {
        self.claim_events_for("read events", EVENTS_MANUAL)?;
        self.read_events_unclaimed(out, max)
    }

    /// [`Device::read_events_max`] for a caller that has claimed them.
    pub(crate) fn read_events_unclaimed(
        &self,
        out: &mut Vec<JobEvent>,
        max: usize,
    ) -> Result<usize, SysError> {
        #[cfg(test)]
        if let Some(fake) = &self.fake {
            let evs = fake
                .read_events(max)
                .map_err(|e| SysError::from_errno("read events", e))?;
            out.extend(evs.iter().map(|e| JobEvent {
                job_id: e.job_id,
                user_data: e.user_data,
                status: match e.status {
                    0 => JobStatus::Done,
                    s => JobStatus::Failed(s.saturating_neg()),
                },
            }));
            return Ok(evs.len());
        }
        const BATCH: usize = 64;
        let mut buf = [uapi::tdrv_event::default(); BATCH];
        let mut total = 0;
        let mut left = max;
        while left > 0 {
            let batch = left.min(BATCH);
            let iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: batch * std::mem::size_of::<uapi::tdrv_event>(),
            };
            // SAFETY: one iovec over a local array the kernel may fill
            // (`tdrv_event` is plain integers); offset -1 reads at the
            // file position, which a tdrv file ignores.
            let n = unsafe { libc::preadv2(self.fd.as_raw_fd(), &iov, 1, -1, libc::RWF_NOWAIT) };
            if n < 0 {
                return match last_errno() {
                    libc::EAGAIN => Ok(total),
                    libc::EINTR => continue,
                    e => Err(SysError::from_errno("read events", e)),
                };
            }
            let got = n as usize / std::mem::size_of::<uapi::tdrv_event>();
            left -= got;
            for e in &buf[..got] {
                if e.type_ != uapi::TDRV_EVENT_JOB_DONE {
                    // A type of a later ABI: not ours to interpret.
                    continue;
                }
                out.push(JobEvent {
                    job_id: e.job_id,
                    user_data: e.user_data,
                    status: match e.status {
                        0 => JobStatus::Done,
                        s => JobStatus::Failed(s.saturating_neg()),
                    },
                });
                total += 1;
            }
            if got < batch {
                break;
            }
        }
        Ok(total)
    }

    /// Issues one ioctl. Restarts on EINTR when `restart` is set (for calls
    /// that do not wait with a caller-chosen timeout).
    fn ioctl<T>(
        &self,
        op: &'static str,
        request: u64,
        arg: &mut T,
        restart: bool,
    ) -> Result<(), SysError> {
        #[cfg(test)]
        if let Some(fake) = &self.fake {
            // SAFETY: as for the real call below: `arg` is the live,
            // exclusively borrowed struct `request` names.
            return unsafe { fake.ioctl(op, request, (arg as *mut T).cast()) };
        }
        loop {
            // SAFETY: the fd is open for the lifetime of `self`; `request` is
            // a tdrv request number whose size field is `size_of::<T>()` (the
            // tdrv-uapi tests pin each number to its struct); `arg` points to
            // a live, exclusively borrowed `T` the kernel may read and write.
            // User pointers embedded in `arg` are the callers' concern (each
            // caller documents them).
            let rc = unsafe {
                ioctl_sys::ioctl(self.fd.as_raw_fd(), request as libc::c_ulong, arg as *mut T)
            };
            if rc >= 0 {
                return Ok(());
            }
            let err = SysError::last(op);
            if restart && matches!(err, SysError::Interrupted { .. }) {
                continue;
            }
            return Err(err);
        }
    }

    /// `TDRV_IOC_VERSION`: ABI version, features and device description.
    pub fn version(&self) -> crate::Result<tdrv_version> {
        Ok(self.version_sys()?)
    }

    /// [`Device::version`] with the sys layer's error.
    pub(crate) fn version_sys(&self) -> Result<tdrv_version, SysError> {
        let mut v = tdrv_version::default();
        self.ioctl("VERSION", uapi::TDRV_IOC_VERSION, &mut v, true)?;
        Ok(v)
    }

    /// `TDRV_IOC_CHANNEL_INFO`: memory accounting of one HBM channel.
    pub fn channel_info(&self, channel: u32) -> crate::Result<tdrv_channel_info> {
        Ok(self.channel_info_sys(channel)?)
    }

    /// [`Device::channel_info`] with the sys layer's error.
    pub(crate) fn channel_info_sys(&self, channel: u32) -> Result<tdrv_channel_info, SysError> {
        let mut info = tdrv_channel_info {
            channel,
            ..Default::default()
        };
        self.ioctl("CHANNEL_INFO", uapi::TDRV_IOC_CHANNEL_INFO, &mut info, true)?;
        Ok(info)
    }

    /// `TDRV_IOC_ALLOC`: a zeroed buffer of `size` bytes on `channel`.
    pub fn alloc(&self, size: u64, channel: u32) -> crate::Result<tdrv_alloc> {
        Ok(self.alloc_sys(size, channel)?)
    }

    /// [`Device::alloc`] with the sys layer's error.
    pub(crate) fn alloc_sys(&self, size: u64, channel: u32) -> Result<tdrv_alloc, SysError> {
        let mut a = tdrv_alloc {
            size,
            channel,
            ..Default::default()
        };
        self.ioctl("ALLOC", uapi::TDRV_IOC_ALLOC, &mut a, true)?;
        Ok(a)
    }

    /// `TDRV_IOC_FREE`: drops a buffer handle.
    pub fn free(&self, handle: u64) -> crate::Result<()> {
        Ok(self.free_sys(handle)?)
    }

    /// [`Device::free`] with the sys layer's error.
    pub(crate) fn free_sys(&self, handle: u64) -> Result<(), SysError> {
        let mut f = uapi::tdrv_free {
            handle,
            reserved: 0,
        };
        self.ioctl("FREE", uapi::TDRV_IOC_FREE, &mut f, true)?;
        self.lock_shared().remove(&handle);
        if self.any_reset.load(Ordering::Acquire) {
            self.lock_resets().remove(&handle);
        }
        Ok(())
    }

    /// `TDRV_IOC_BUF_INFO`: a buffer's description and fence state.
    ///
    /// Inline: the cheapest query, polled in loops, costs little more than
    /// its system call, so the call frame around it is worth saving.
    #[inline]
    pub fn buf_info(&self, handle: u64) -> crate::Result<tdrv_buf_info> {
        Ok(self.buf_info_sys(handle)?)
    }

    /// [`Device::buf_info`] with the sys layer's error.
    pub(crate) fn buf_info_sys(&self, handle: u64) -> Result<tdrv_buf_info, SysError> {
        let mut info = tdrv_buf_info {
            handle,
            ..Default::default()
        };
        self.ioctl("BUF_INFO", uapi::TDRV_IOC_BUF_INFO, &mut info, true)?;
        Ok(info)
    }

    /// `TDRV_IOC_COPY_IN`: copies `src` into the buffer at `offset`, after
    /// all pending device access to the buffer.
    pub fn copy_in(&self, handle: u64, offset: u64, src: &[u8]) -> crate::Result<()> {
        Ok(self.copy_in_sys(handle, offset, src)?)
    }

    /// [`Device::copy_in`] with the sys layer's error.
    pub(crate) fn copy_in_sys(&self, handle: u64, offset: u64, src: &[u8]) -> Result<(), SysError> {
        // SAFETY: `src` is borrowed, so valid and unchanged, for the call.
        unsafe { self.copy_in_raw(handle, offset, src.as_ptr(), src.len()) }
    }

    /// [`Device::copy_in`] from a raw address: the kernel reads `len` bytes
    /// at `src` with `copy_from_user`.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes, and no thread may write
    /// them during the call. (A bad address is EFAULT, not undefined
    /// behaviour, but the bytes copied are then unspecified.)
    pub unsafe fn copy_in_raw(
        &self,
        handle: u64,
        offset: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), SysError> {
        let mut x = uapi::tdrv_xfer {
            handle,
            offset,
            size: len as u64,
            user_ptr: src as u64,
            reserved: [0; 2],
        };
        let _pins = self.unpinned("COPY_IN", [handle])?;
        self.ioctl("COPY_IN", uapi::TDRV_IOC_COPY_IN, &mut x, true)
    }

    /// `TDRV_IOC_COPY_OUT`: copies the buffer at `offset` into `dst`, after
    /// pending device writes to the buffer.
    pub fn copy_out(&self, handle: u64, offset: u64, dst: &mut [u8]) -> crate::Result<()> {
        Ok(self.copy_out_sys(handle, offset, dst)?)
    }

    /// [`Device::copy_out`] with the sys layer's error.
    pub(crate) fn copy_out_sys(
        &self,
        handle: u64,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), SysError> {
        // SAFETY: `dst` is exclusively borrowed for the whole call, so the
        // kernel's writes race with nothing.
        unsafe { self.copy_out_raw(handle, offset, dst.as_mut_ptr(), dst.len()) }
    }

    /// [`Device::copy_out`] to a raw address: the kernel writes `len` bytes
    /// at `dst` with `copy_to_user`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes, and no other thread
    /// may access them during the call.
    pub unsafe fn copy_out_raw(
        &self,
        handle: u64,
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), SysError> {
        let mut x = uapi::tdrv_xfer {
            handle,
            offset,
            size: len as u64,
            user_ptr: dst as u64,
            reserved: [0; 2],
        };
        self.ioctl("COPY_OUT", uapi::TDRV_IOC_COPY_OUT, &mut x, true)
    }

    /// `TDRV_IOC_MEMSET`: fills `size` bytes at `offset` with `value`.
    pub fn memset(&self, handle: u64, offset: u64, size: u64, value: u8) -> crate::Result<()> {
        Ok(self.memset_sys(handle, offset, size, value)?)
    }

    /// [`Device::memset`] with the sys layer's error.
    pub(crate) fn memset_sys(
        &self,
        handle: u64,
        offset: u64,
        size: u64,
        value: u8,
    ) -> Result<(), SysError> {
        let mut m = uapi::tdrv_memset {
            handle,
            offset,
            size,
            value: value.into(),
            ..Default::default()
        };
        let _pins = self.unpinned("MEMSET", [handle])?;
        self.ioctl("MEMSET", uapi::TDRV_IOC_MEMSET, &mut m, true)
    }

    /// `TDRV_IOC_COPY`: synchronous buffer-to-buffer copy (same channel).
    pub fn copy(&self, desc: &tdrv_copy_desc) -> crate::Result<()> {
        Ok(self.copy_sys(desc)?)
    }

    /// [`Device::copy`] with the sys layer's error.
    pub(crate) fn copy_sys(&self, desc: &tdrv_copy_desc) -> Result<(), SysError> {
        let mut c = uapi::tdrv_copy {
            desc: *desc,
            reserved: [0; 2],
        };
        let _pins = self.unpinned("COPY", [desc.dst_handle])?;
        self.ioctl("COPY", uapi::TDRV_IOC_COPY, &mut c, true)
    }

    /// `TDRV_IOC_SUBMIT`: queues an asynchronous copy job; returns its id.
    pub fn submit(&self, descs: &[tdrv_copy_desc]) -> crate::Result<u64> {
        Ok(self.submit_sys(descs)?)
    }

    /// [`Device::submit`] with the sys layer's error.
    pub(crate) fn submit_sys(&self, descs: &[tdrv_copy_desc]) -> Result<u64, SysError> {
        self.submit_job_sys(descs, &[], false, None)
            .map(|(id, _)| id)
    }

    /// `TDRV_IOC_SUBMIT` with `TDRV_SUBMIT_NOTIFY` (ABI 1.6): submits the
    /// job as [`Device::submit`] does and, in the same call, asks for its
    /// completion event carrying `user_data`, as [`Device::job_notify`] of
    /// the new job would: one ioctl per job instead of two for a caller
    /// that waits through events ([`Device::read_events`], or `poll(2)`
    /// and epoll on [`AsFd::as_fd`]). A job that ends within the call has
    /// its event ready when it returns. Errors: those of
    /// [`Device::submit`]; `NoSpace` when the file's or the device's
    /// events are used up, and then no job is queued; `EventsBusy` as for
    /// [`Device::job_notify`]; `NotSupported` on a driver before ABI 1.6
    /// ([`Device::supports_submit_notify`]).
    pub fn submit_notify(&self, descs: &[tdrv_copy_desc], user_data: u64) -> crate::Result<u64> {
        Ok(self.submit_notify_sys(descs, user_data)?)
    }

    /// [`Device::submit_notify`] with the sys layer's error.
    pub(crate) fn submit_notify_sys(
        &self,
        descs: &[tdrv_copy_desc],
        user_data: u64,
    ) -> Result<u64, SysError> {
        self.submit_job_sys(descs, &[], false, Some(user_data))
            .map(|(id, _)| id)
    }

    /// SUBMIT with everything a [`crate::Job`] may ask for: in-fences, an
    /// out-fence, and (with `event`) its completion event carrying that
    /// `user_data`, for a caller that reads the events itself.
    pub(crate) fn submit_job_sys(
        &self,
        descs: &[tdrv_copy_desc],
        in_fences: &[BorrowedFd<'_>],
        out_fence: bool,
        event: Option<u64>,
    ) -> Result<(u64, Option<OwnedFd>), SysError> {
        if event.is_some() {
            if !self.supports_submit_notify() {
                return Err(SysError::NotSupported {
                    op: "SUBMIT_NOTIFY",
                });
            }
            self.claim_events_for("SUBMIT_NOTIFY", EVENTS_MANUAL)?;
        }
        self.submit_inner(descs, in_fences, out_fence, None, event)
    }

    /// `TDRV_IOC_SUBMIT` with fence fds (ABI 1.2): the job starts only
    /// after every `sync_file` of `in_fences` has signalled (a failed one
    /// fails the job with its error), and with `out_fence` the call also
    /// returns the job's out-fence, a `sync_file` fd that signals when the
    /// job ends (its error is the job's). Fence fds on a kernel without
    /// them are [`SysError::FenceFdsUnsupported`].
    pub fn submit_with_fences(
        &self,
        descs: &[tdrv_copy_desc],
        in_fences: &[BorrowedFd<'_>],
        out_fence: bool,
    ) -> crate::Result<(u64, Option<OwnedFd>)> {
        Ok(self.submit_job_sys(descs, in_fences, out_fence, None)?)
    }

    /// [`Device::submit`] of a job that may write the buffer `owner` pins:
    /// for the owner of a staging buffer, which calls it while it holds
    /// the buffer exclusively (no reference into it is lent) and waits for
    /// the job before lending one again.
    pub(crate) fn submit_as_owner(
        &self,
        descs: &[tdrv_copy_desc],
        owner: &OwnedPin,
    ) -> Result<u64, SysError> {
        if !std::ptr::eq(Arc::as_ptr(&owner.device), self) {
            return Err(SysError::from_errno("SUBMIT", libc::EINVAL));
        }
        self.submit_inner(descs, &[], false, Some(owner), None)
            .map(|(id, _)| id)
    }

    fn submit_inner(
        &self,
        descs: &[tdrv_copy_desc],
        in_fences: &[BorrowedFd<'_>],
        out_fence: bool,
        owner: Option<&OwnedPin>,
        notify: Option<u64>,
    ) -> Result<(u64, Option<OwnedFd>), SysError> {
        let desc_count =
            u32::try_from(descs.len()).map_err(|_| SysError::from_errno("SUBMIT", libc::EINVAL))?;
        let fds: Vec<i32> = in_fences.iter().map(|f| f.as_raw_fd()).collect();
        // `descs` and `fds` are borrowed (valid, unchanged) for the whole
        // call; the kernel copies them before returning, and takes its own
        // references to the in-fences.
        let mut s = uapi::tdrv_submit {
            descs: descs.as_ptr() as u64,
            desc_count,
            desc_size: std::mem::size_of::<tdrv_copy_desc>() as u32,
            flags: if out_fence {
                uapi::TDRV_SUBMIT_OUT_FENCE
            } else {
                0
            } | if notify.is_some() {
                uapi::TDRV_SUBMIT_NOTIFY
            } else {
                0
            },
            user_data: notify.unwrap_or(0),
            in_fences: if fds.is_empty() {
                0
            } else {
                fds.as_ptr() as u64
            },
            in_fence_count: u32::try_from(fds.len())
                .map_err(|_| SysError::from_errno("SUBMIT", libc::EINVAL))?,
            ..Default::default()
        };
        let _pins = self.unpinned_but("SUBMIT", descs.iter().map(|d| d.dst_handle), owner)?;
        self.ioctl("SUBMIT", uapi::TDRV_IOC_SUBMIT, &mut s, true)
            .map_err(|e| match e {
                // SUBMIT's EOPNOTSUPP is about the fence fds (tdrv.h).
                SysError::NotSupported { op } if out_fence || !fds.is_empty() => {
                    SysError::FenceFdsUnsupported { op }
                }
                e => e,
            })?;
        let fence = if out_fence && s.out_fence >= 0 {
            // SAFETY: the driver installed this descriptor for this call
            // and nothing else owns it.
            Some(unsafe { OwnedFd::from_raw_fd(s.out_fence) })
        } else {
            None
        };
        Ok((s.job_id, fence))
    }

    /// `TDRV_IOC_JOB_WAIT`: waits up to `timeout_us` (0 polls, < 0 forever)
    /// for a job of this file. A job still running after a positive timeout
    /// is `Ok(JobStatus::Pending)` or `Err(TimedOut)`, as the driver says.
    pub fn job_wait(&self, job_id: u64, timeout_us: i64) -> crate::Result<JobStatus> {
        Ok(self.job_wait_sys(job_id, timeout_us)?)
    }

    /// [`Device::job_wait`] with the sys layer's error.
    pub(crate) fn job_wait_sys(&self, job_id: u64, timeout_us: i64) -> Result<JobStatus, SysError> {
        let mut w = tdrv_job_wait {
            job_id,
            timeout_us,
            ..Default::default()
        };
        self.ioctl("JOB_WAIT", uapi::TDRV_IOC_JOB_WAIT, &mut w, false)?;
        Ok(match (w.state, w.status) {
            (uapi::TDRV_JOB_DONE, 0) => JobStatus::Done,
            (uapi::TDRV_JOB_DONE, status) => JobStatus::Failed(status.saturating_neg()),
            _ => JobStatus::Pending,
        })
    }

    /// `TDRV_IOC_FENCE_WAIT`: waits until the buffer has no pending device
    /// accesses of `kind`.
    pub fn fence_wait(&self, handle: u64, kind: FenceKind, timeout_us: i64) -> crate::Result<()> {
        Ok(self.fence_wait_sys(handle, kind, timeout_us)?)
    }

    /// [`Device::fence_wait`] with the sys layer's error.
    pub(crate) fn fence_wait_sys(
        &self,
        handle: u64,
        kind: FenceKind,
        timeout_us: i64,
    ) -> Result<(), SysError> {
        let mut f = uapi::tdrv_fence_wait {
            handle,
            timeout_us,
            kind: kind.raw(),
            ..Default::default()
        };
        self.ioctl("FENCE_WAIT", uapi::TDRV_IOC_FENCE_WAIT, &mut f, false)
    }

    /// `TDRV_IOC_COMPLETION_WAIT`: waits until the buffer's completion count
    /// is at least `expected`; returns the count.
    pub fn completion_wait(
        &self,
        handle: u64,
        expected: u64,
        timeout_us: i64,
    ) -> crate::Result<u64> {
        Ok(self.completion_wait_sys(handle, expected, timeout_us)?)
    }

    /// [`Device::completion_wait`] with the sys layer's error.
    pub(crate) fn completion_wait_sys(
        &self,
        handle: u64,
        expected: u64,
        timeout_us: i64,
    ) -> Result<u64, SysError> {
        let mut w = uapi::tdrv_completion_wait {
            handle,
            expected,
            timeout_us,
            ..Default::default()
        };
        self.ioctl(
            "COMPLETION_WAIT",
            uapi::TDRV_IOC_COMPLETION_WAIT,
            &mut w,
            false,
        )?;
        Ok(w.count)
    }

    /// `TDRV_IOC_COMPLETION_RESET`: sets the buffer's completion count to 0.
    /// Every tensor view of the buffer then counts from 0 too (their
    /// baselines follow: see [`Device::completion_epoch`]).
    pub fn completion_reset(&self, handle: u64) -> crate::Result<()> {
        Ok(self.completion_reset_sys(handle)?)
    }

    /// [`Device::completion_reset`] with the sys layer's error.
    pub(crate) fn completion_reset_sys(&self, handle: u64) -> Result<(), SysError> {
        let mut r = uapi::tdrv_completion_reset {
            handle,
            reserved: 0,
        };
        // Under the lock, so that an epoch read after the reset sees it.
        let mut resets = self.lock_resets();
        self.ioctl(
            "COMPLETION_RESET",
            uapi::TDRV_IOC_COMPLETION_RESET,
            &mut r,
            true,
        )?;
        Self::note_reset(&mut resets, &self.any_reset, handle);
        Ok(())
    }

    fn note_reset(resets: &mut HashMap<u64, u64>, any: &AtomicBool, handle: u64) {
        *resets.entry(handle).or_insert(0) += 1;
        any.store(true, Ordering::Release);
    }

    /// A device on `/dev/null` for unit tests of the layers above (every
    /// ioctl fails with ENOTTY); `reset` records a raw reset of `handle`
    /// as a successful `completion_reset` would.
    #[cfg(test)]
    pub(crate) fn fake_for_tests() -> Arc<Device> {
        let fd: OwnedFd = std::fs::File::open("/dev/null").expect("/dev/null").into();
        Arc::new(Device {
            fd,
            path: PathBuf::from("/dev/null"),
            version: tdrv_version::default(),
            resets: Mutex::new(HashMap::new()),
            any_reset: AtomicBool::new(false),
            pins: RwLock::new(HashMap::new()),
            shared: Mutex::new(HashSet::new()),
            rdev: 0,
            opener: std::process::id(),
            events_reader: AtomicU8::new(EVENTS_FREE),
            fake: None,
        })
    }

    /// A device whose ioctls an in-process [`FakeDevice`] answers from heap
    /// memory (see `fakedev.rs`), reporting `features`; returned with the
    /// fake for its test knobs.
    ///
    /// [`FakeDevice`]: crate::fakedev::FakeDevice
    #[cfg(test)]
    pub(crate) fn fake_with(features: u64) -> (Arc<Device>, Arc<crate::fakedev::FakeDevice>) {
        let fake = Arc::new(crate::fakedev::FakeDevice::new(features));
        // With events, the fake's eventfd: readable while one is queued.
        let fd: OwnedFd = fake
            .device_fd()
            .unwrap_or_else(|| std::fs::File::open("/dev/null").expect("/dev/null").into());
        let dev = Arc::new(Device {
            fd,
            path: PathBuf::from("/dev/tdrv-fake"),
            version: fake.version,
            resets: Mutex::new(HashMap::new()),
            any_reset: AtomicBool::new(false),
            pins: RwLock::new(HashMap::new()),
            shared: Mutex::new(HashSet::new()),
            rdev: {
                // A distinct device number per fake device.
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                u64::MAX - NEXT.fetch_add(1, Ordering::Relaxed)
            },
            opener: std::process::id(),
            events_reader: AtomicU8::new(EVENTS_FREE),
            fake: Some(fake.clone()),
        });
        (dev, fake)
    }

    /// [`Device::fake_with`] the features of a soft device.
    #[cfg(test)]
    pub(crate) fn fake() -> (Arc<Device>, Arc<crate::fakedev::FakeDevice>) {
        Self::fake_with(crate::fakedev::FakeDevice::FEATURES)
    }

    #[cfg(test)]
    pub(crate) fn fake_reset(&self, handle: u64) {
        Self::note_reset(&mut self.lock_resets(), &self.any_reset, handle);
    }

    /// How many times [`Device::completion_reset`] reset `handle`'s count
    /// through this device. Tensor views record it with their completion
    /// baseline: a newer epoch means the count restarted from 0 since.
    pub fn completion_epoch(&self, handle: u64) -> u64 {
        if !self.any_reset.load(Ordering::Acquire) {
            return 0;
        }
        self.lock_resets().get(&handle).copied().unwrap_or(0)
    }

    fn lock_resets(&self) -> std::sync::MutexGuard<'_, HashMap<u64, u64>> {
        // Nothing panics while holding it; a poisoned map is still whole.
        self.resets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `TDRV_IOC_EXPORT` (ABI 1.2): the buffer as a dma-buf fd (O_RDWR,
    /// close-on-exec). The dma-buf is the same memory, fences and
    /// completion count as the handle, and outlives it. From now on the
    /// buffer counts as shared ([`Device::is_shared`]); a buffer pinned by
    /// a mapping guard is refused with [`SysError::Pinned`], since whoever
    /// gets the dma-buf could write the bytes the guard lends.
    pub fn export(&self, handle: u64) -> crate::Result<OwnedFd> {
        Ok(self.export_sys(handle)?)
    }

    /// [`Device::export`] with the sys layer's error.
    pub(crate) fn export_sys(&self, handle: u64) -> Result<OwnedFd, SysError> {
        let mut e = uapi::tdrv_export {
            handle,
            ..Default::default()
        };
        let _pins = self.unpinned("EXPORT", [handle])?;
        self.ioctl("EXPORT", uapi::TDRV_IOC_EXPORT, &mut e, true)?;
        self.lock_shared().insert(handle);
        // SAFETY: on success the driver installed a new fd that nothing else
        // owns.
        Ok(unsafe { OwnedFd::from_raw_fd(e.fd) })
    }

    /// `TDRV_IOC_IMPORT` (ABI 1.2): a new handle in this file for the
    /// dma-buf `fd`. A tdrv export of this device resolves to its buffer;
    /// a foreign dma-buf is placed on `channel`.
    pub fn import(&self, fd: BorrowedFd<'_>, channel: u32) -> crate::Result<uapi::tdrv_import> {
        Ok(self.import_sys(fd, channel)?)
    }

    /// [`Device::import`] with the sys layer's error.
    pub(crate) fn import_sys(
        &self,
        fd: BorrowedFd<'_>,
        channel: u32,
    ) -> Result<uapi::tdrv_import, SysError> {
        let mut i = uapi::tdrv_import {
            fd: fd.as_raw_fd(),
            channel,
            ..Default::default()
        };
        self.ioctl("IMPORT", uapi::TDRV_IOC_IMPORT, &mut i, true)?;
        self.lock_shared().insert(i.handle);
        Ok(i)
    }

    /// Whether buffer `handle` is shared through a dma-buf: exported with
    /// [`Device::export`] or made by [`Device::import`]. Another process
    /// may then write its bytes at any time.
    pub fn is_shared(&self, handle: u64) -> bool {
        self.lock_shared().contains(&handle)
    }

    fn lock_shared(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        // Nothing panics while holding it; a poisoned set is still whole.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The node's device number (`st_rdev`), which with a buffer's
    /// `buf_id` names the buffer within the machine.
    pub(crate) fn rdev(&self) -> u64 {
        self.rdev
    }

    /// Maps a whole buffer: `mmap(NULL, round_up(size, page), PROT_READ |
    /// PROT_WRITE, MAP_SHARED, fd, mmap_offset)`.
    pub fn map(&self, mmap_offset: u64, size: u64) -> crate::Result<Mapping> {
        Ok(self.map_sys(mmap_offset, size)?)
    }

    /// [`Device::map`] with the sys layer's error.
    pub(crate) fn map_sys(&self, mmap_offset: u64, size: u64) -> Result<Mapping, SysError> {
        let len = round_up_to_page(size).ok_or(SysError::from_errno("mmap", libc::EINVAL))?;
        #[cfg(test)]
        if let Some(fake) = &self.fake {
            let mem = fake
                .map(mmap_offset, len)
                .map_err(|e| SysError::from_errno("mmap", e))?;
            let ptr = NonNull::new(mem.as_ptr()).ok_or(SysError::from_errno("mmap", libc::EIO))?;
            return Ok(Mapping {
                ptr,
                len,
                fake: Some(mem),
            });
        }
        let offset = libc::off_t::try_from(mmap_offset)
            .map_err(|_| SysError::from_errno("mmap", libc::EINVAL))?;
        // SAFETY: a fresh shared mapping chosen by the kernel (addr NULL)
        // cannot alias any Rust object; the fd is open.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.fd.as_raw_fd(),
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(SysError::last("mmap"));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(SysError::from_errno("mmap", libc::EIO))?;
        Ok(Mapping {
            ptr,
            len,
            #[cfg(test)]
            fake: None,
        })
    }
}

/// `TDRV_FEAT_MMAP` as a feature word (tests of devices without mmap).
#[cfg(test)]
pub(crate) fn feat_mmap() -> u64 {
    uapi::TDRV_FEAT_MMAP.into()
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety requirements.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).unwrap_or(4096).max(1)
}

fn round_up_to_page(size: u64) -> Option<usize> {
    let size = usize::try_from(size).ok()?;
    if size == 0 {
        return None;
    }
    let page = page_size();
    size.checked_add(page - 1).map(|s| s / page * page)
}

/// A shared mapping of a device buffer; unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// A fake device's heap block instead of a mapping: kept, not unmapped.
    #[cfg(test)]
    fake: Option<Arc<crate::fakedev::FakeMem>>,
}

// SAFETY: a Mapping is an address range, not a reference; the bytes are
// shared with the device anyway, and all accesses go through raw pointers
// whose users synchronise them.
unsafe impl Send for Mapping {}
// SAFETY: as above; &Mapping only hands out the raw address.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// First byte of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length of the mapping (the buffer size rounded up to a page).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never true: zero sizes are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        #[cfg(test)]
        if self.fake.is_some() {
            return;
        }
        // SAFETY: (ptr, len) is exactly the range mmap returned, and it is
        // unmapped only here, once.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_round_trips() {
        for e in [
            libc::EINVAL,
            libc::E2BIG,
            libc::ENOENT,
            libc::ERANGE,
            libc::EFAULT,
            libc::EXDEV,
            libc::ENOMEM,
            libc::ENOSPC,
            libc::ETIMEDOUT,
            libc::EINTR,
            libc::ENODEV,
            libc::ENOTTY,
            libc::EPERM,
            libc::EAGAIN,
            libc::ESTALE,
            libc::EIO,
            libc::ECANCELED,
            libc::EOPNOTSUPP,
        ] {
            assert_eq!(SysError::from_errno("X", e).errno(), e);
        }
        // EOPNOTSUPP is the fence-fd error only for SUBMIT with fences
        // (submit_with_fences): an IMPORT without a peer-to-peer path
        // must not blame CONFIG_SYNC_FILE.
        let e = SysError::from_errno("IMPORT", libc::EOPNOTSUPP);
        assert!(matches!(e, SysError::NotSupported { op: "IMPORT" }));
        assert!(!e.to_string().contains("SYNC_FILE"), "{e}");
        assert!(matches!(
            SysError::from_errno("COPY", libc::EXDEV),
            SysError::CrossChannel { op: "COPY" }
        ));
        let e = SysError::from_errno("SUBMIT", libc::EAGAIN);
        assert!(matches!(e, SysError::TooManyJobs { .. }));
        assert!(e.to_string().contains("submit again"), "{e}");
        assert!(matches!(
            SysError::from_errno("JOB_WAIT", libc::ESTALE),
            SysError::StaleJob { .. }
        ));
    }

    #[test]
    fn enumerate_orders_numerically() {
        let dir = std::env::temp_dir().join(format!("tdrv-enum-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for n in ["tdrv10", "tdrv2", "tdrv0", "tdrvx", "tdrv", "other1"] {
            std::fs::write(dir.join(n), b"").unwrap();
        }
        let names: Vec<_> = Device::enumerate_in(&dir)
            .into_iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(names, ["tdrv0", "tdrv2", "tdrv10"]);
    }

    #[test]
    #[cfg_attr(miri, ignore = "ioctl(2) is not available under Miri")]
    fn open_errors_are_reported() {
        let err = Device::open("/nonexistent/tdrv0").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
        // A regular file is not a tdrv device: VERSION fails with ENOTTY.
        let f = std::env::temp_dir().join(format!("tdrv-notdev-{}", std::process::id()));
        std::fs::write(&f, b"").unwrap();
        let err = Device::open(&f).unwrap_err();
        std::fs::remove_file(&f).unwrap();
        assert!(
            matches!(err, crate::Error::Sys(SysError::NotTdrv { op: "VERSION" })),
            "{err}"
        );
    }

    #[test]
    fn page_rounding() {
        let p = page_size();
        assert_eq!(round_up_to_page(1), Some(p));
        assert_eq!(round_up_to_page(p as u64), Some(p));
        assert_eq!(round_up_to_page(p as u64 + 1), Some(2 * p));
        assert_eq!(round_up_to_page(0), None);
        assert_eq!(round_up_to_page(u64::MAX), None);
    }

    #[test]
    #[cfg_attr(miri, ignore = "fstat(2) of a device node")]
    fn a_device_lends_its_file_descriptor() {
        use std::os::fd::AsFd;
        let dev = Device::fake_for_tests();
        let f = std::fs::File::from(dev.as_fd().try_clone_to_owned().unwrap());
        let meta = f.metadata().unwrap();
        use std::os::unix::fs::FileTypeExt;
        assert!(meta.file_type().is_char_device());
        assert_eq!(dev.as_fd().as_raw_fd(), dev.fd.as_raw_fd());
    }
}
