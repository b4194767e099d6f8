//! Memory whose page faults nobody serves (userfaultfd): a kernel copy to
//! or from it sleeps in the fault, at a point the test chooses, until the
//! test ends the stall.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::raw::errno;

/// `struct uffdio_api` (linux/userfaultfd.h).
#[repr(C)]
struct UffdApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `struct uffdio_register`.
#[repr(C)]
struct UffdRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

/// `struct uffdio_range`.
#[repr(C)]
struct UffdRange {
    start: u64,
    len: u64,
}

const UFFD_API: u64 = 0xAA;
const UFFDIO_API: u64 = 0xC018_AA3F;
const UFFDIO_REGISTER: u64 = 0xC020_AA00;
const UFFDIO_WAKE: u64 = 0x8010_AA02;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

/// An anonymous mapping whose first `served` bytes are ordinary memory and
/// the rest a userfaultfd-registered range nobody serves.
pub struct Unserved {
    uffd: Option<OwnedFd>,
    base: *mut libc::c_void,
    len: usize,
    served: usize,
}

// SAFETY: the mapping belongs to this value alone; the kernel, not Rust
// code, touches the unserved part.
unsafe impl Send for Unserved {}
// SAFETY: as for Send; &self methods only issue syscalls.
unsafe impl Sync for Unserved {}

impl Unserved {
    /// `served` bytes of ordinary memory followed by `unserved` bytes whose
    /// faults stall (both whole pages).
    pub fn new(served: usize, unserved: usize) -> Result<Unserved, String> {
        let len = served + unserved;
        // SAFETY: plain syscalls on a fresh descriptor and a fresh
        // anonymous mapping no Rust object refers to.
        unsafe {
            let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) as i32;
            if fd < 0 {
                return Err(format!("userfaultfd: errno {}", errno()));
            }
            let uffd = OwnedFd::from_raw_fd(fd);
            let mut api = UffdApi {
                api: UFFD_API,
                features: 0,
                ioctls: 0,
            };
            if libc::ioctl(fd, UFFDIO_API as _, &mut api) != 0 {
                return Err(format!("UFFDIO_API: errno {}", errno()));
            }
            let base = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(format!("mmap: errno {}", errno()));
            }
            let me = Unserved {
                uffd: Some(uffd),
                base,
                len,
                served,
            };
            // Populate the served part before the rest is registered.
            std::ptr::write_bytes(base.cast::<u8>(), 0, served);
            let mut reg = UffdRegister {
                start: base as u64 + served as u64,
                len: unserved as u64,
                mode: UFFDIO_REGISTER_MODE_MISSING,
                ioctls: 0,
            };
            if libc::ioctl(fd, UFFDIO_REGISTER as _, &mut reg) != 0 {
                return Err(format!("UFFDIO_REGISTER: errno {}", errno()));
            }
            Ok(me)
        }
    }

    /// The start of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base.cast()
    }

    /// Waits (at most `ms`) until a thread faults on the unserved range:
    /// from then on it sleeps there until [`Unserved::fail`] or
    /// [`Unserved::serve`].
    pub fn wait_fault(&self, ms: i32) -> Result<(), String> {
        let fd = self.uffd.as_ref().ok_or("already served")?.as_raw_fd();
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        match unsafe { libc::poll(&mut p, 1, ms) } {
            1 => {}
            0 => return Err(format!("no fault on the unserved range within {ms} ms")),
            _ => return Err(format!("poll of the userfaultfd: errno {}", errno())),
        }
        let mut msg = [0u8; 32];
        // SAFETY: reads one message into a local array of its length.
        let n = unsafe { libc::read(fd, msg.as_mut_ptr().cast(), msg.len()) };
        if n != 32 {
            return Err(format!("read of the userfaultfd: {n}, errno {}", errno()));
        }
        Ok(())
    }

    /// Ends the stall with a fault: the unserved range is unmapped and its
    /// sleepers woken, so their copies stop short (EFAULT).
    pub fn fail(&self) -> Result<(), String> {
        let start = self.base as u64 + self.served as u64;
        let len = (self.len - self.served) as u64;
        // SAFETY: unmaps the unserved part of our own mapping, which no
        // Rust object refers to.
        if unsafe { libc::munmap(start as *mut _, len as usize) } != 0 {
            return Err(format!("munmap: errno {}", errno()));
        }
        let mut range = UffdRange { start, len };
        let fd = self.uffd.as_ref().ok_or("already served")?.as_raw_fd();
        // SAFETY: a valid userfaultfd and range struct.
        if unsafe { libc::ioctl(fd, UFFDIO_WAKE as _, &mut range) } != 0 {
            return Err(format!("UFFDIO_WAKE: errno {}", errno()));
        }
        Ok(())
    }

    /// Ends the stall by closing the userfaultfd: the range becomes
    /// ordinary anonymous memory and the sleepers' copies complete.
    pub fn serve(&mut self) {
        self.uffd = None;
    }
}

impl Drop for Unserved {
    fn drop(&mut self) {
        self.uffd = None;
        // SAFETY: our own mapping (a part already unmapped by `fail` is
        // no error for munmap).
        unsafe { libc::munmap(self.base, self.len) };
    }
}
