//! The ivshmem server side (QEMU's docs/specs/ivshmem-spec.rst): the
//! simulator listens on a Unix socket, QEMU's `ivshmem-doorbell` connects
//! as its client, and the simulator sends, one message per `sendmsg`, each
//! a little-endian int64 with at most one fd (SCM_RIGHTS):
//!
//! 1. the protocol version, 0, without fd;
//! 2. QEMU's own peer id, without fd;
//! 3. -1 with the shared memory fd (BAR2);
//! 4. the simulator's peer id once per vector, each with one of the
//!    simulator's eventfds (QEMU's doorbell for (id, q) signals the q-th);
//! 5. QEMU's peer id once per vector, each with one of QEMU's own eventfds
//!    (the simulator writes the q-th to raise MSI-X vector q).
//!
//! QEMU 7.2 reads messages 1-3 synchronously while the device realizes
//! (the id must come second, the shared memory before anything that sets
//! up its own interrupts), then the rest from its main loop; the n-th
//! message naming a peer carries that peer's eventfd for vector n.

use crate::queue::Doorbell;
use crate::queue::Irq;
use std::io;
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::os::fd::BorrowedFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::time::Duration;

/// The protocol version QEMU expects first.
pub const PROTOCOL_VERSION: i64 = 0;

/// An eventfd (a doorbell of the simulator, or an interrupt of QEMU's).
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A new non-blocking eventfd with counter 0.
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new fd that nothing else owns.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Wraps an eventfd received from the peer.
    pub fn from_fd(fd: OwnedFd) -> EventFd {
        EventFd(fd)
    }

    /// Adds 1 to the counter (wakes the reader).
    pub fn signal(&self) -> io::Result<()> {
        let one = 1u64.to_ne_bytes();
        loop {
            // SAFETY: writes 8 bytes from a live local buffer.
            let n = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
            if n == 8 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Reads and clears the counter; 0 if it was 0.
    pub fn take(&self) -> u64 {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local buffer.
        let n = unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
        if n == 8 {
            u64::from_ne_bytes(buf)
        } else {
            0
        }
    }

    /// Waits until the counter is non-zero or `timeout` passes; true if it
    /// became readable.
    pub fn poll(&self, timeout: Duration) -> bool {
        poll_in(self.0.as_fd(), timeout)
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl Doorbell for EventFd {
    fn wait(&self, timeout: Duration) -> bool {
        // A ring that raced with the last take is still in the counter.
        self.poll(timeout) && self.take() > 0
    }
    fn ring(&self) {
        let _ = self.signal();
    }
}

/// QEMU's interrupt eventfds, one per vector.
pub struct Vectors(pub Vec<EventFd>);

impl Irq for Vectors {
    fn raise(&self, q: u32) {
        if let Some(e) = self.0.get(q as usize) {
            if let Err(err) = e.signal() {
                crate::log::stderr().line(format_args!("tdrv-sim: raising vector {q}: {err}"));
            }
        }
    }
}

/// Whether `fd` becomes readable (or hung up) within `timeout`.
pub fn poll_in(fd: BorrowedFd<'_>, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0
}

/// Sends one protocol message: `value` as a little-endian int64, with `fd`
/// as SCM_RIGHTS ancillary data if given.
pub fn send_msg(sock: BorrowedFd<'_>, value: i64, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let bytes = value.to_le_bytes();
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // u64 elements keep the control buffer aligned for cmsghdr.
    let mut cbuf = [0u64; 4];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    assert!(space <= std::mem::size_of_val(&cbuf));
    // SAFETY: msghdr is plain data; all-zero is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at `space` zeroed, aligned bytes, so
        // CMSG_FIRSTHDR is non-null and the header and its int fit.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
            libc::CMSG_DATA(c)
                .cast::<libc::c_int>()
                .write_unaligned(fd.as_raw_fd());
        }
    }
    loop {
        // SAFETY: msg and everything it points to (iov, bytes, cbuf) live
        // across the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n == bytes.len() as isize {
            return Ok(());
        }
        if n >= 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short sendmsg"));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives one protocol message (the client's side; tests and tools):
/// the int64 and the fd that came with it. `Ok(None)` at end of stream.
pub fn recv_msg(sock: BorrowedFd<'_>) -> io::Result<Option<(i64, Option<OwnedFd>)>> {
    let mut bytes = [0u8; 8];
    let mut got = 0usize;
    let mut fd = None;
    while got < 8 {
        let mut iov = libc::iovec {
            // SAFETY: got < 8, inside `bytes`.
            iov_base: unsafe { bytes.as_mut_ptr().add(got) }.cast(),
            iov_len: 8 - got,
        };
        let mut cbuf = [0u64; 8];
        // SAFETY: msghdr is plain data; all-zero is its empty value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
        // SAFETY: msg points at live buffers of the sizes it states.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "partial message",
            ));
        }
        got += n as usize;
        // SAFETY: recvmsg filled msg_control/msg_controllen; the CMSG_*
        // macros walk only within it.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                    let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                        / std::mem::size_of::<libc::c_int>();
                    for i in 0..count {
                        let raw = data.add(i).read_unaligned();
                        // Each received fd is new and ours; keep the last.
                        fd = Some(OwnedFd::from_raw_fd(raw));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
    }
    Ok(Some((i64::from_le_bytes(bytes), fd)))
}

/// The fds the simulator hands to its client.
pub struct Handshake<'a> {
    /// QEMU's peer id.
    pub client_id: u16,
    /// The simulator's peer id.
    pub sim_id: u16,
    /// BAR2.
    pub shm: BorrowedFd<'a>,
    /// The simulator's doorbells, one per vector.
    pub doorbells: &'a [EventFd],
    /// QEMU's interrupt eventfds, one per vector.
    pub vectors: &'a [EventFd],
}

impl Handshake<'_> {
    /// Sends the whole setup to a connected client, in QEMU 7.2's order.
    pub fn send(&self, sock: BorrowedFd<'_>) -> io::Result<()> {
        send_msg(sock, PROTOCOL_VERSION, None)?;
        send_msg(sock, i64::from(self.client_id), None)?;
        send_msg(sock, -1, Some(self.shm))?;
        for e in self.doorbells {
            send_msg(sock, i64::from(self.sim_id), Some(e.as_fd()))?;
        }
        for e in self.vectors {
            send_msg(sock, i64::from(self.client_id), Some(e.as_fd()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    #[cfg_attr(miri, ignore = "sendmsg/recvmsg and eventfd are not supported by Miri")]
    fn messages_carry_values_and_fds() {
        let (a, b) = UnixStream::pair().unwrap();
        let e = EventFd::new().unwrap();
        send_msg(a.as_fd(), -1, Some(e.as_fd())).unwrap();
        send_msg(a.as_fd(), 0x1234_5678_9abc, None).unwrap();
        let (v, fd) = recv_msg(b.as_fd()).unwrap().unwrap();
        assert_eq!(v, -1);
        // The received fd is the same eventfd: a signal through it is seen.
        let got = EventFd::from_fd(fd.unwrap());
        got.signal().unwrap();
        assert_eq!(e.take(), 1);
        let (v, fd) = recv_msg(b.as_fd()).unwrap().unwrap();
        assert_eq!((v, fd.is_none()), (0x1234_5678_9abc, true));
        drop(a);
        assert!(recv_msg(b.as_fd()).unwrap().is_none());
    }

    #[test]
    #[cfg_attr(miri, ignore = "eventfd and poll are not supported by Miri")]
    fn eventfd_doorbell_counts_and_times_out() {
        let e = EventFd::new().unwrap();
        assert!(!e.wait(Duration::from_millis(1)));
        e.ring();
        e.ring();
        assert!(e.wait(Duration::from_millis(1)));
        assert!(!e.wait(Duration::from_millis(1)));
    }
}
