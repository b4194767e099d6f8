//! Raw ioctls on a tdrv device node, for tests that must send what a normal
//! client never would (wrong sizes, reserved bits, foreign handles). Errors
//! are the bare errno so tests can assert the exact code.

use std::{
    ffi::CString,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use tdrv_uapi::*;

/// An errno value returned by a failed call.
pub type Errno = i32;

/// Returns the calling thread's errno.
pub fn errno() -> Errno {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// One open file of a tdrv device.
pub struct Dev {
    fd: OwnedFd,
}

impl Dev {
    pub fn open(path: &str) -> Result<Dev, Errno> {
        let c = CString::new(path).map_err(|_| libc::EINVAL)?;
        // SAFETY: `c` is a valid NUL-terminated path.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(errno());
        }
        // SAFETY: `fd` was just returned by open(2) and is owned by nobody else.
        Ok(Dev {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Wraps a file of a tdrv device opened by other means.
    pub fn from_fd(fd: OwnedFd) -> Dev {
        Dev { fd }
    }

    /// Gives up the descriptor (e.g. to close it by hand).
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Issues `request` with `arg` as its argument buffer. The kernel reads
    /// and writes at most the size encoded in `request`, which callers keep
    /// within `size_of::<T>()`.
    pub fn ioctl<T>(&self, request: u64, arg: &mut T) -> Result<i32, Errno> {
        assert!(((request >> 16) & 0x3fff) as usize <= std::mem::size_of::<T>());
        // SAFETY: `arg` is a live, exclusively borrowed buffer at least as
        // large as the size encoded in `request` (asserted above).
        let r = unsafe { libc::ioctl(self.fd(), request as _, arg as *mut T) };
        if r < 0 {
            Err(errno())
        } else {
            Ok(r)
        }
    }

    /// Issues `request` with an arbitrary address (e.g. unmapped memory).
    ///
    /// # Safety
    /// The kernel may write through `addr` up to the size in `request`: the
    /// caller guarantees that this cannot corrupt live Rust objects.
    pub unsafe fn ioctl_addr(&self, request: u64, addr: usize) -> Result<i32, Errno> {
        // SAFETY: delegated to the caller.
        let r = unsafe { libc::ioctl(self.fd(), request as _, addr) };
        if r < 0 {
            Err(errno())
        } else {
            Ok(r)
        }
    }

    pub fn version(&self) -> Result<tdrv_version, Errno> {
        let mut v = tdrv_version::default();
        self.ioctl(TDRV_IOC_VERSION, &mut v).map(|_| v)
    }

    pub fn channel_info(&self, channel: u32) -> Result<tdrv_channel_info, Errno> {
        let mut c = tdrv_channel_info {
            channel,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_CHANNEL_INFO, &mut c).map(|_| c)
    }

    pub fn alloc(&self, size: u64, channel: u32) -> Result<tdrv_alloc, Errno> {
        let mut a = tdrv_alloc {
            size,
            channel,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_ALLOC, &mut a).map(|_| a)
    }

    pub fn free(&self, handle: u64) -> Result<(), Errno> {
        let mut f = tdrv_free {
            handle,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_FREE, &mut f).map(drop)
    }

    pub fn buf_info(&self, handle: u64) -> Result<tdrv_buf_info, Errno> {
        let mut b = tdrv_buf_info {
            handle,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_BUF_INFO, &mut b).map(|_| b)
    }

    pub fn copy_in(&self, handle: u64, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let mut x = tdrv_xfer {
            handle,
            offset,
            size: data.len() as u64,
            user_ptr: data.as_ptr() as u64,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_COPY_IN, &mut x).map(drop)
    }

    pub fn copy_out(&self, handle: u64, offset: u64, data: &mut [u8]) -> Result<(), Errno> {
        let mut x = tdrv_xfer {
            handle,
            offset,
            size: data.len() as u64,
            user_ptr: data.as_mut_ptr() as u64,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_COPY_OUT, &mut x).map(drop)
    }

    /// The first `len` bytes of a buffer (COPY_OUT into a new vector).
    pub fn read_vec(&self, handle: u64, len: usize) -> Result<Vec<u8>, Errno> {
        let mut out = vec![0u8; len];
        self.copy_out(handle, 0, &mut out)?;
        Ok(out)
    }

    pub fn memset(&self, handle: u64, offset: u64, size: u64, value: u32) -> Result<(), Errno> {
        let mut m = tdrv_memset {
            handle,
            offset,
            size,
            value,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_MEMSET, &mut m).map(drop)
    }

    pub fn copy(&self, desc: tdrv_copy_desc) -> Result<(), Errno> {
        let mut c = tdrv_copy {
            desc,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_COPY, &mut c).map(drop)
    }

    pub fn submit(&self, descs: &[tdrv_copy_desc]) -> Result<u64, Errno> {
        let mut s = tdrv_submit {
            descs: descs.as_ptr() as u64,
            desc_count: descs.len() as u32,
            desc_size: std::mem::size_of::<tdrv_copy_desc>() as u32,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_SUBMIT, &mut s).map(|_| s.job_id)
    }

    /// SUBMIT with fence fds: waits for `in_fences` before the job starts,
    /// and returns (job id, out-fence fd) with `out_fence` (the fd is -1
    /// without). The caller owns the returned fd.
    pub fn submit_fences(
        &self,
        descs: &[tdrv_copy_desc],
        in_fences: &[i32],
        out_fence: bool,
    ) -> Result<(u64, i32), Errno> {
        let mut s = tdrv_submit {
            descs: descs.as_ptr() as u64,
            desc_count: descs.len() as u32,
            desc_size: std::mem::size_of::<tdrv_copy_desc>() as u32,
            flags: if out_fence { TDRV_SUBMIT_OUT_FENCE } else { 0 },
            in_fences: if in_fences.is_empty() {
                0
            } else {
                in_fences.as_ptr() as u64
            },
            in_fence_count: in_fences.len() as u32,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_SUBMIT, &mut s)
            .map(|_| (s.job_id, s.out_fence))
    }

    /// SUBMIT with `TDRV_SUBMIT_NOTIFY` (ABI 1.6): the job's completion
    /// event, carrying `user_data`, is asked for in the same call.
    pub fn submit_notify(&self, descs: &[tdrv_copy_desc], user_data: u64) -> Result<u64, Errno> {
        let mut s = tdrv_submit {
            descs: descs.as_ptr() as u64,
            desc_count: descs.len() as u32,
            desc_size: std::mem::size_of::<tdrv_copy_desc>() as u32,
            flags: TDRV_SUBMIT_NOTIFY,
            user_data,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_SUBMIT, &mut s).map(|_| s.job_id)
    }

    /// TDRV_IOC_JOB_NOTIFY: one completion event for `job_id`.
    pub fn job_notify(&self, job_id: u64, user_data: u64) -> Result<(), Errno> {
        let mut n = tdrv_job_notify {
            job_id,
            user_data,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_JOB_NOTIFY, &mut n).map(drop)
    }

    /// read(2) of completion events into `out` (as many as fit); returns
    /// how many were read. Blocks unless the file is O_NONBLOCK.
    pub fn read_events(&self, out: &mut [tdrv_event]) -> Result<usize, Errno> {
        // SAFETY: `out` is a live array of plain integers the kernel fills.
        let n = unsafe {
            libc::read(
                self.fd(),
                out.as_mut_ptr().cast(),
                std::mem::size_of_val(out),
            )
        };
        if n < 0 {
            Err(errno())
        } else {
            Ok(n as usize / std::mem::size_of::<tdrv_event>())
        }
    }

    /// Sets or clears O_NONBLOCK on the file.
    pub fn set_nonblock(&self, on: bool) -> Result<(), Errno> {
        // SAFETY: fcntl on our own fd.
        let flags = unsafe { libc::fcntl(self.fd(), libc::F_GETFL) };
        if flags < 0 {
            return Err(errno());
        }
        let flags = if on {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        // SAFETY: as above.
        if unsafe { libc::fcntl(self.fd(), libc::F_SETFL, flags) } < 0 {
            return Err(errno());
        }
        Ok(())
    }

    /// Waits for a job; returns (state, status).
    pub fn job_wait(&self, job_id: u64, timeout_us: i64) -> Result<(u32, i32), Errno> {
        let mut w = tdrv_job_wait {
            job_id,
            timeout_us,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_JOB_WAIT, &mut w)
            .map(|_| (w.state, w.status))
    }

    pub fn fence_wait(&self, handle: u64, kind: u32, timeout_us: i64) -> Result<(), Errno> {
        let mut f = tdrv_fence_wait {
            handle,
            kind,
            timeout_us,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_FENCE_WAIT, &mut f).map(drop)
    }

    /// Waits for `expected` completions; returns the count seen.
    pub fn completion_wait(
        &self,
        handle: u64,
        expected: u64,
        timeout_us: i64,
    ) -> Result<u64, (Errno, u64)> {
        let mut c = tdrv_completion_wait {
            handle,
            expected,
            timeout_us,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_COMPLETION_WAIT, &mut c)
            .map(|_| c.count)
            .map_err(|e| (e, c.count))
    }

    pub fn completion_reset(&self, handle: u64) -> Result<(), Errno> {
        let mut c = tdrv_completion_reset {
            handle,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_COMPLETION_RESET, &mut c).map(drop)
    }

    /// TDRV_IOC_EXPORT: the buffer as a dma-buf fd.
    pub fn export(&self, handle: u64) -> Result<OwnedFd, Errno> {
        let mut e = tdrv_export {
            handle,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_EXPORT, &mut e)?;
        // SAFETY: the driver installed a new fd for us.
        Ok(unsafe { OwnedFd::from_raw_fd(e.fd) })
    }

    /// TDRV_IOC_IMPORT: a handle for the dma-buf `fd` (a foreign one on
    /// `channel`).
    pub fn import(&self, fd: i32, channel: u32) -> Result<tdrv_import, Errno> {
        let mut i = tdrv_import {
            fd,
            channel,
            ..Default::default()
        };
        self.ioctl(TDRV_IOC_IMPORT, &mut i).map(|_| i)
    }

    /// Maps a whole buffer read-write, shared.
    pub fn map(&self, a: &tdrv_alloc) -> Result<Mapping, Errno> {
        let len = (a.size as usize).next_multiple_of(page_size());
        self.map_len(a.mmap_offset, len)
    }

    pub fn map_len(&self, offset: u64, len: usize) -> Result<Mapping, Errno> {
        // SAFETY: a fresh shared mapping chosen by the kernel; no Rust object
        // lives there.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(errno());
        }
        Ok(Mapping { ptr: p.cast(), len })
    }
}

/// Maps `len` bytes of any file `fd` from `offset`, read-write, shared.
pub fn map_fd(fd: i32, offset: u64, len: usize) -> Result<Mapping, Errno> {
    // SAFETY: a fresh shared mapping chosen by the kernel; no Rust object
    // lives there.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(errno());
    }
    Ok(Mapping { ptr: p.cast(), len })
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// A mapping of a buffer, unmapped on drop.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` writable bytes while `self` lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping made by `map_len`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
