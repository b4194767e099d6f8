//! dma-buf helpers of the guest tests: DMA_BUF_IOCTL_SYNC, the system
//! dma-heap, fd passing over UNIX sockets and child processes.

use std::{
    fs,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use crate::{
    ok,
    raw::{errno, Dev, Errno},
};

type R = Result<(), String>;

/// `struct dma_buf_sync` flags (linux/dma-buf.h).
pub const SYNC_READ: u64 = 1;
pub const SYNC_WRITE: u64 = 2;
pub const SYNC_END: u64 = 4;
/// `DMA_BUF_IOCTL_SYNC` = `_IOW('b', 0, struct dma_buf_sync)`.
const DMA_BUF_IOCTL_SYNC: u64 = 0x4008_6200;
/// `DMA_HEAP_IOCTL_ALLOC` = `_IOWR('H', 0, struct dma_heap_allocation_data)`.
const DMA_HEAP_IOCTL_ALLOC: u64 = 0xC018_4800;
pub const HEAP: &str = "/dev/dma_heap/system";

/// `struct dma_heap_allocation_data`.
#[repr(C)]
#[derive(Default)]
struct HeapAlloc {
    len: u64,
    fd: u32,
    fd_flags: u32,
    heap_flags: u64,
}

pub fn sync(fd: i32, flags: u64) -> Result<(), Errno> {
    let mut f = flags;
    // SAFETY: `f` is the 8-byte argument the request encodes.
    let r = unsafe { libc::ioctl(fd, DMA_BUF_IOCTL_SYNC as _, &mut f) };
    if r < 0 {
        Err(errno())
    } else {
        Ok(())
    }
}

/// A dma-buf of `len` bytes from the system heap; None if there is no heap.
pub fn heap_alloc(len: usize) -> Result<Option<OwnedFd>, String> {
    let heap = match fs::OpenOptions::new().read(true).open(HEAP) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{HEAP}: {e}")),
    };
    let mut a = HeapAlloc {
        len: len as u64,
        fd_flags: (libc::O_RDWR | libc::O_CLOEXEC) as u32,
        ..Default::default()
    };
    // SAFETY: `a` is the 24-byte argument the request encodes.
    let r = unsafe { libc::ioctl(heap.as_raw_fd(), DMA_HEAP_IOCTL_ALLOC as _, &mut a) };
    if r < 0 {
        return Err(format!("DMA_HEAP_IOCTL_ALLOC: errno {}", errno()));
    }
    // SAFETY: the heap installed a new fd for us.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(a.fd as i32) }))
}

/// A UNIX socket pair for passing fds; the errno if there is none.
pub fn socket_pair() -> Result<(OwnedFd, OwnedFd), Errno> {
    let mut sv = [0i32; 2];
    // SAFETY: `sv` has room for the two fds.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            sv.as_mut_ptr(),
        )
    } < 0
    {
        return Err(errno());
    }
    // SAFETY: both fds were just created and are ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) })
}

/// Sends `fd` over `sock` with SCM_RIGHTS (one data byte).
pub fn send_fd(sock: i32, fd: i32) -> Result<(), Errno> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // u64 storage keeps the control buffer aligned for `cmsghdr`.
    let mut cbuf = [0u64; 4];
    // SAFETY: plain C struct, zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a size.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as _;
    // SAFETY: `msg` has a control buffer of CMSG_SPACE(4) <= 32 bytes, so
    // the first header and its 4 data bytes are inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), fd);
    }
    // SAFETY: `msg` points at live buffers for the call.
    if unsafe { libc::sendmsg(sock, &msg, 0) } < 0 {
        return Err(errno());
    }
    Ok(())
}

/// Receives one fd sent by [`send_fd`].
pub fn recv_fd(sock: i32) -> Result<OwnedFd, Errno> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; 4];
    // SAFETY: plain C struct, zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    // SAFETY: `msg` points at live buffers for the call.
    if unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) } <= 0 {
        return Err(errno());
    }
    // SAFETY: the kernel filled the control buffer; the header, if any,
    // lies inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() || (*c).cmsg_type != libc::SCM_RIGHTS {
            return Err(libc::EPROTO);
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<i32>());
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// Passes fds between a parent and a child process: over a UNIX socket
/// with SCM_RIGHTS, or, on a kernel without AF_UNIX (the project's test
/// kernel has no networking), by `pidfd_getfd` from the sender, which
/// puts the same open file into the receiver's table just as SCM_RIGHTS
/// does. Create it before forking; both processes use the same value.
pub struct FdLink {
    socket: Option<(OwnedFd, OwnedFd)>,
    /// Pipes for the pidfd path: fd numbers one way, acks the other.
    data: (i32, i32),
    ack: (i32, i32),
}

fn pipe() -> Result<(i32, i32), String> {
    let mut p = [0i32; 2];
    // SAFETY: `p` has room for two fds.
    if unsafe { libc::pipe(p.as_mut_ptr()) } < 0 {
        return Err(format!("pipe: errno {}", errno()));
    }
    Ok((p[0], p[1]))
}

impl FdLink {
    pub fn new() -> Result<FdLink, String> {
        let socket = match socket_pair() {
            Ok(s) => Some(s),
            Err(e) if e == libc::ENOSYS || e == libc::EAFNOSUPPORT => None,
            Err(e) => return Err(format!("socketpair: errno {e}")),
        };
        Ok(FdLink {
            socket,
            data: pipe()?,
            ack: pipe()?,
        })
    }

    /// How fds travel: "SCM_RIGHTS" or "pidfd_getfd".
    pub fn method(&self) -> &'static str {
        if self.socket.is_some() {
            "SCM_RIGHTS"
        } else {
            "pidfd_getfd"
        }
    }

    /// Sends `fd`; returns once the peer has it.
    pub fn send(&self, fd: i32) -> Result<(), String> {
        if let Some((a, _)) = &self.socket {
            return send_fd(a.as_raw_fd(), fd).map_err(|e| format!("sendmsg: errno {e}"));
        }
        let n = fd.to_ne_bytes();
        let mut b = [0u8; 1];
        // SAFETY: our own pipe fds and buffers of the given sizes.
        let ok = unsafe {
            libc::write(self.data.1, n.as_ptr().cast(), 4) == 4
                && libc::read(self.ack.0, b.as_mut_ptr().cast(), 1) == 1
        };
        if ok {
            Ok(())
        } else {
            Err(format!("fd pipe: errno {}", errno()))
        }
    }

    /// Receives an fd sent by process `from` with [`FdLink::send`].
    pub fn recv(&self, from: libc::pid_t) -> Result<OwnedFd, String> {
        if let Some((_, b)) = &self.socket {
            return recv_fd(b.as_raw_fd()).map_err(|e| format!("recvmsg: errno {e}"));
        }
        let mut n = [0u8; 4];
        // SAFETY: our own pipe fd and a 4-byte buffer.
        if unsafe { libc::read(self.data.0, n.as_mut_ptr().cast(), 4) } != 4 {
            return Err(format!("fd pipe: errno {}", errno()));
        }
        // SAFETY: plain syscalls with integer arguments.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, from, 0) } as i32;
        if pidfd < 0 {
            return Err(format!("pidfd_open: errno {}", errno()));
        }
        // SAFETY: as above.
        let fd =
            unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, i32::from_ne_bytes(n), 0) } as i32;
        let e = errno();
        // SAFETY: our own fds and a 1-byte buffer.
        unsafe {
            libc::close(pidfd);
            libc::write(self.ack.1, [1u8].as_ptr().cast(), 1);
        }
        if fd < 0 {
            return Err(format!("pidfd_getfd: errno {e}"));
        }
        // SAFETY: pidfd_getfd installed a new fd for us (close-on-exec).
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// Runs `f` in a child process; returns its exit status (its R as 0 or 1;
/// the child prints its error).
pub fn in_child(f: impl FnOnce() -> R) -> Result<libc::pid_t, String> {
    // SAFETY: the test is single-threaded; the child only runs `f` and
    // exits without unwinding into the parent's state.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: errno {}", errno()));
    }
    if pid == 0 {
        let code = match f() {
            Ok(()) => 0,
            Err(e) => {
                println!("# child: {e}");
                1
            }
        };
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    Ok(pid)
}

pub fn wait_child(pid: libc::pid_t) -> Result<i32, String> {
    let mut status = 0;
    // SAFETY: `status` is a valid out-pointer.
    if unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
        return Err(format!("waitpid: errno {}", errno()));
    }
    Ok(status)
}

pub fn child_ok(pid: libc::pid_t) -> R {
    let status = wait_child(pid)?;
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Ok(())
    } else {
        Err(format!("child failed (status {status:#x})"))
    }
}

/// Bytes that tell every page and position of a shared buffer apart, with
/// `seed` telling one write from the next.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

/// The first `len` bytes of buffer `handle` (COPY_OUT).
pub fn read_buf(dev: &Dev, handle: u64, len: usize) -> Result<Vec<u8>, String> {
    ok("copy_out", dev.read_vec(handle, len))
}
