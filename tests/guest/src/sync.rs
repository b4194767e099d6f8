//! `sync_file` fds from userspace: the kernel's sync_file ioctls
//! (`linux/sync_file.h`), sw_sync timelines (debugfs `sync/sw_sync`, the
//! kernel's test-only fence driver) and poll.

use std::{
    ffi::CStr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
};

use crate::raw::{errno, Errno};

const SW_SYNC_PATH: &str = "/sys/kernel/debug/sync/sw_sync";

/// `struct sync_fence_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FenceInfo {
    pub obj_name: [u8; 32],
    pub driver_name: [u8; 32],
    pub status: i32,
    pub flags: u32,
    pub timestamp_ns: u64,
}

/// `struct sync_file_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FileInfo {
    pub name: [u8; 32],
    pub status: i32,
    pub flags: u32,
    pub num_fences: u32,
    pub pad: u32,
    pub sync_fence_info: u64,
}

#[repr(C)]
struct CreateFence {
    value: u32,
    name: [u8; 32],
    fence: i32,
}

const fn ioc(dir: u64, ty: u8, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | ((ty as u64) << 8) | nr
}
const SYNC_IOC_FILE_INFO: u64 = ioc(3, b'>', 4, std::mem::size_of::<FileInfo>());
const SW_SYNC_IOC_CREATE_FENCE: u64 = ioc(3, b'W', 0, std::mem::size_of::<CreateFence>());
const SW_SYNC_IOC_INC: u64 = ioc(1, b'W', 1, 4);

fn name_of(bytes: &[u8; 32]) -> String {
    CStr::from_bytes_until_nul(bytes)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// What SYNC_IOC_FILE_INFO says about a sync_file: its status (1
/// signalled, 0 active, < 0 the error) and its first fence's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub status: i32,
    pub num_fences: u32,
    pub driver: String,
    pub timeline: String,
}

/// SYNC_IOC_FILE_INFO on `fd`, with the first fence's details.
pub fn file_info(fd: RawFd) -> Result<Status, Errno> {
    let mut fences = [FenceInfo {
        obj_name: [0; 32],
        driver_name: [0; 32],
        status: 0,
        flags: 0,
        timestamp_ns: 0,
    }; 4];
    let mut info = FileInfo {
        num_fences: fences.len() as u32,
        sync_fence_info: fences.as_mut_ptr() as u64,
        ..Default::default()
    };
    // SAFETY: `info` is a live sync_file_info whose array pointer covers
    // `num_fences` entries the kernel may write.
    if unsafe { libc::ioctl(fd, SYNC_IOC_FILE_INFO as _, &mut info) } < 0 {
        return Err(errno());
    }
    Ok(Status {
        status: info.status,
        num_fences: info.num_fences,
        driver: name_of(&fences[0].driver_name),
        timeline: name_of(&fences[0].obj_name),
    })
}

/// poll(2) for POLLIN on `fd` for at most `timeout_ms` (-1: no limit):
/// whether it became readable (the fence signalled).
pub fn poll_in(fd: RawFd, timeout_ms: i32) -> Result<bool, Errno> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    match unsafe { libc::poll(&mut p, 1, timeout_ms) } {
        r if r < 0 => Err(errno()),
        0 => Ok(false),
        _ => Ok(p.revents & libc::POLLIN != 0),
    }
}

/// A sw_sync timeline: fences on it signal when the timeline's counter
/// reaches their value. Closing it signals the rest (with an error on
/// kernels that set one).
pub struct Timeline {
    fd: OwnedFd,
}

impl Timeline {
    /// Opens a new timeline; ENOENT without CONFIG_SW_SYNC or debugfs.
    pub fn new() -> Result<Timeline, Errno> {
        // SAFETY: a NUL-terminated path literal.
        let fd = unsafe {
            libc::open(
                c"/sys/kernel/debug/sync/sw_sync".as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(errno());
        }
        // SAFETY: a descriptor open(2) just returned.
        Ok(Timeline {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Whether sw_sync is available here.
    pub fn available() -> bool {
        std::path::Path::new(SW_SYNC_PATH).exists()
    }

    /// A sync_file that signals when the counter reaches `value`.
    pub fn fence(&self, value: u32) -> Result<OwnedFd, Errno> {
        let mut c = CreateFence {
            value,
            name: *b"tdrv-test\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0",
            fence: -1,
        };
        // SAFETY: a live create_fence_data the kernel reads and writes.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), SW_SYNC_IOC_CREATE_FENCE as _, &mut c) } < 0 {
            return Err(errno());
        }
        // SAFETY: the kernel just installed this descriptor for us.
        Ok(unsafe { OwnedFd::from_raw_fd(c.fence) })
    }

    /// Advances the counter by `n`, signalling the fences it reaches.
    pub fn inc(&self, n: u32) -> Result<(), Errno> {
        let mut n = n;
        // SAFETY: a u32 the kernel reads.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), SW_SYNC_IOC_INC as _, &mut n) } < 0 {
            return Err(errno());
        }
        Ok(())
    }
}
