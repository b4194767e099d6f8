//! The wake-up source behind `impl Future for JobHandle`, with no async
//! runtime: one background thread per process that poll(2)s what awaited
//! jobs wait on and wakes their tasks:
//!
//! - a job's fence fd, readable when the fence signalled;
//! - or its device file, readable when completion events are ready
//!   (`TDRV_IOC_JOB_NOTIFY`, on every kernel): the thread reads them and
//!   wakes the tasks whose keys they carry (`user_data`). One fd serves
//!   every job of a device.
//!
//! See `userlib/DESIGN.md` ("Fence fds and futures", "Completion events").
//!
//! Cost: the thread (started at the first registration, then kept), a
//! pipe to interrupt its poll when a registration arrives, and one
//! poll(2) over the fence fds and device files per wake-up.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::sys::{Device, JobEvent};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::Waker;

/// A registration: the fd to watch (kept open by the registration) and
/// the task to wake.
struct Entry {
    fd: Arc<OwnedFd>,
    waker: Waker,
}

/// A task waiting for a completion event with its key as `user_data`.
struct EventWait {
    device: RawFd,
    waker: Waker,
}

/// A device file polled for events, and how many registrations wait on it.
struct Watched {
    device: Arc<Device>,
    waiting: usize,
}

/// Everything registered.
#[derive(Default)]
struct Registry {
    fds: HashMap<u64, Entry>,
    events: HashMap<u64, EventWait>,
    devices: HashMap<RawFd, Watched>,
}

impl Registry {
    /// Removes the event registration under `key`, if any.
    fn remove_event(&mut self, key: u64) -> Option<EventWait> {
        let w = self.events.remove(&key)?;
        if let Some(d) = self.devices.get_mut(&w.device) {
            d.waiting -= 1;
            if d.waiting == 0 {
                self.devices.remove(&w.device);
            }
        }
        Some(w)
    }
}

/// The process's reactor.
pub(crate) struct Reactor {
    entries: Mutex<Registry>,
    /// Write end of the pipe that interrupts the thread's poll.
    notify: OwnedFd,
}

static REACTOR: OnceLock<Option<Arc<Reactor>>> = OnceLock::new();
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// A key for [`Reactor::register`], unique in the process.
pub(crate) fn new_key() -> u64 {
    NEXT_KEY.fetch_add(1, Ordering::Relaxed)
}

/// The process's reactor, started on first use; `None` if its pipe or
/// thread could not be created (the caller falls back to a waiting
/// thread of its own).
pub(crate) fn get() -> Option<&'static Arc<Reactor>> {
    REACTOR.get_or_init(Reactor::start).as_ref()
}

/// The reactor if it was started, without starting it.
pub(crate) fn running() -> Option<&'static Arc<Reactor>> {
    REACTOR.get().and_then(Option::as_ref)
}

fn pipe() -> Option<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2(2) writes two descriptors into the local array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
        return None;
    }
    // SAFETY: pipe2 just returned these descriptors; nothing else owns them.
    Some(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

impl Reactor {
    fn start() -> Option<Arc<Reactor>> {
        let (rx, tx) = pipe()?;
        let reactor = Arc::new(Reactor {
            entries: Mutex::new(Registry::default()),
            notify: tx,
        });
        let r = reactor.clone();
        std::thread::Builder::new()
            .name("tdrv-reactor".into())
            .spawn(move || r.run(rx))
            .ok()?;
        Some(reactor)
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        // Nothing panics while holding it; a poisoned map is still whole.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes `waker` once `fd` is readable (or in error). A second
    /// registration under the same key replaces the first.
    pub(crate) fn register(&self, key: u64, fd: Arc<OwnedFd>, waker: &Waker) {
        {
            let mut registry = self.lock();
            let entries = &mut registry.fds;
            match entries.get_mut(&key) {
                Some(e) if e.waker.will_wake(waker) => return,
                Some(e) => e.waker.clone_from(waker),
                None => {
                    entries.insert(
                        key,
                        Entry {
                            fd,
                            waker: waker.clone(),
                        },
                    );
                }
            }
        }
        self.interrupt();
    }

    /// Wakes `waker` once a completion event carrying `key` is read from
    /// `device` (which the caller asks for with `job_notify` after this).
    /// A second registration under the same key replaces the waker.
    pub(crate) fn register_event(&self, key: u64, device: &Arc<Device>, waker: &Waker) {
        {
            let mut r = self.lock();
            if let Some(w) = r.events.get_mut(&key) {
                if !w.waker.will_wake(waker) {
                    w.waker.clone_from(waker);
                }
                return;
            }
            let fd = device.as_fd().as_raw_fd();
            r.events.insert(
                key,
                EventWait {
                    device: fd,
                    waker: waker.clone(),
                },
            );
            r.devices
                .entry(fd)
                .or_insert_with(|| Watched {
                    device: device.clone(),
                    waiting: 0,
                })
                .waiting += 1;
        }
        self.interrupt();
    }

    /// Forgets the registrations under `key`, if any (a fence fd is closed
    /// unless its owner still holds it; an event that comes later is
    /// dropped).
    pub(crate) fn deregister(&self, key: u64) {
        let (fd, ev) = {
            let mut r = self.lock();
            (r.fds.remove(&key), r.remove_event(key))
        };
        drop((fd, ev));
    }

    fn interrupt(&self) {
        // A full pipe already has the thread's attention: EAGAIN is fine.
        // SAFETY: writes one byte from a local to our own pipe.
        unsafe { libc::write(self.notify.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    }

    fn run(&self, rx: OwnedFd) {
        let mut pfds: Vec<libc::pollfd> = Vec::new();
        let mut keys: Vec<u64> = Vec::new();
        let mut devices: Vec<Arc<Device>> = Vec::new();
        let mut events: Vec<JobEvent> = Vec::new();
        loop {
            pfds.clear();
            keys.clear();
            devices.clear();
            pfds.push(pollfd(rx.as_raw_fd()));
            {
                let r = self.lock();
                for (key, e) in r.fds.iter() {
                    pfds.push(pollfd(e.fd.as_raw_fd()));
                    keys.push(*key);
                }
                // The `Arc`s keep these files open until the next round.
                for w in r.devices.values() {
                    pfds.push(pollfd(w.device.as_fd().as_raw_fd()));
                    devices.push(w.device.clone());
                }
            }
            // SAFETY: `pfds` is a live array of its length, which poll only
            // reads and writes. Any fd number is allowed: one closed since
            // the snapshot reports POLLNVAL, a reused one at worst a
            // spurious wake-up (its entry, if still there, is removed and
            // its task polls the job again).
            let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, -1) };
            if n <= 0 {
                continue;
            }
            if pfds[0].revents != 0 {
                let mut buf = [0u8; 64];
                // SAFETY: reads into a local buffer from our own pipe.
                while unsafe { libc::read(rx.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0
                {
                }
            }
            // Events are read without the lock (a system call each).
            events.clear();
            let mut failed = Vec::new();
            for (pfd, device) in pfds[1 + keys.len()..].iter().zip(&devices) {
                if pfd.revents == 0 {
                    continue;
                }
                if pfd.revents & libc::POLLIN == 0 || device.read_events(&mut events).is_err() {
                    // Gone (POLLNVAL, ENODEV after unbind with nothing to
                    // read): wake its tasks, which then learn why from
                    // JOB_WAIT, rather than polling it for ever.
                    failed.push(device.as_fd().as_raw_fd());
                }
            }
            let mut ready = Vec::new();
            {
                let mut r = self.lock();
                for (pfd, key) in pfds[1..].iter().zip(&keys) {
                    if pfd.revents != 0 {
                        if let Some(e) = r.fds.remove(key) {
                            ready.push(e.waker);
                        }
                    }
                }
                for ev in &events {
                    // Unknown keys: handles dropped since they asked.
                    if let Some(w) = r.remove_event(ev.user_data) {
                        ready.push(w.waker);
                    }
                }
                for fd in failed {
                    let keys: Vec<u64> = r
                        .events
                        .iter()
                        .filter(|(_, w)| w.device == fd)
                        .map(|(k, _)| *k)
                        .collect();
                    for k in keys {
                        if let Some(w) = r.remove_event(k) {
                            ready.push(w.waker);
                        }
                    }
                }
            }
            // Woken outside the lock: a waker may register again at once.
            for w in ready {
                w.wake();
            }
        }
    }
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;
    use std::time::{Duration, Instant};

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn wait_for(what: &str, f: impl Fn() -> bool) {
        let start = Instant::now();
        while !f() {
            assert!(start.elapsed() < Duration::from_secs(10), "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "poll(2) and threads on real fds")]
    fn a_readable_fd_wakes_its_task_once_and_is_forgotten() {
        let reactor = get().expect("reactor");
        let (rx, tx) = pipe().unwrap();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let key = new_key();
        reactor.register(key, Arc::new(rx), &waker);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            0,
            "woken before the fd was readable"
        );
        // SAFETY: one byte from a local into our pipe.
        unsafe { libc::write(tx.as_raw_fd(), [7u8].as_ptr().cast(), 1) };
        wait_for("not woken", || count.0.load(Ordering::SeqCst) == 1);
        wait_for("entry kept", || !reactor.lock().fds.contains_key(&key));
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken twice");
    }

    #[test]
    #[cfg_attr(miri, ignore = "poll(2) and threads on real fds")]
    fn deregistered_tasks_are_not_woken() {
        let reactor = get().expect("reactor");
        let (rx, tx) = pipe().unwrap();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let key = new_key();
        reactor.register(key, Arc::new(rx), &Waker::from(count.clone()));
        reactor.deregister(key);
        // SAFETY: one byte from a local into our pipe.
        unsafe { libc::write(tx.as_raw_fd(), [7u8].as_ptr().cast(), 1) };
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        assert!(!reactor.lock().fds.contains_key(&key));
    }
}
