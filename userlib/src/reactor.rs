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
//! pipe to interrupt its poll when a registration arrives or goes, and
//! one poll(2) over the fence fds and device files per wake-up.
//!
//! Ownership of the events: the reactor is the only reader of a device
//! file it watches ([`Device::claim_events_for`]); the caller's own
//! `job_notify`/`read_events` on that `Device` get `EventsBusy`, and a
//! `Device` whose events the caller reads itself is never watched (its
//! handles wait on their out-fence or a thread of their own).
//!
//! Fork: a child has none of its parent's threads, so the reactor is per
//! process: one whose pid is not ours is never used (nor its lock
//! touched: a thread that does not exist in the child may hold it), and
//! the child starts its own. Its `Device`s inherited from the parent
//! share the parent's event stream, which the child does not read
//! (`EventsBusy`); their handles wait on fences or threads.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;

use crate::sys::{Device, JobEvent, SysError, EVENTS_REACTOR};
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
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

/// The reactor's thread is being started.
const STARTING: u8 = 0;
/// The reactor's thread runs.
const RUNNING: u8 = 1;
/// The reactor's thread could not be started: handles fall back.
const DEAD: u8 = 2;

/// A process's reactor.
pub(crate) struct Reactor {
    /// The process it serves: its thread exists there only.
    pid: u32,
    /// `STARTING`, `RUNNING` or `DEAD`.
    state: AtomicU8,
    entries: Mutex<Registry>,
    /// Write end of the pipe that interrupts the thread's poll.
    notify: OwnedFd,
}

/// The reactor of this process (or, in a child after `fork`, possibly
/// its parent's copy, which is left alone): leaked, never freed.
static REACTOR: AtomicPtr<Reactor> = AtomicPtr::new(ptr::null_mut());
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// A key for [`Reactor::register`], unique in the process.
pub(crate) fn new_key() -> u64 {
    NEXT_KEY.fetch_add(1, Ordering::Relaxed)
}

/// The value in `slot` if `mine` accepts it, else one `make` builds,
/// installed in place of the one there (which is leaked, not freed: in
/// a child after `fork` it is the parent's, in use by threads that do
/// not exist here). With `true` when this call installed it. `None`
/// only when `make` fails.
fn get_or_install<T>(
    slot: &AtomicPtr<T>,
    mine: impl Fn(&T) -> bool,
    mut make: impl FnMut() -> Option<T>,
) -> Option<(&'static T, bool)> {
    loop {
        let cur = slot.load(Ordering::Acquire);
        // SAFETY: a non-null pointer in the slot came from `Box::leak`
        // below and is never freed, so it is valid for 'static; the
        // Acquire load pairs with the Release of its installation.
        if let Some(v) = unsafe { cur.as_ref() } {
            if mine(v) {
                return Some((v, false));
            }
        }
        let new = Box::leak(Box::new(make()?));
        match slot.compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some((new, true)),
            Err(_) => {
                // SAFETY: `new` came from `Box::leak` just above and was
                // never published: ours alone, freed once.
                drop(unsafe { Box::from_raw(new as *mut T) });
            }
        }
    }
}

/// This process's reactor, started on first use (also in a child after
/// `fork`); `None` if its pipe or thread could not be created (the
/// caller falls back to a waiting thread of its own).
pub(crate) fn get() -> Option<&'static Reactor> {
    let pid = std::process::id();
    let mut rx = None;
    let (r, installed) = get_or_install(
        &REACTOR,
        |r: &Reactor| r.pid == pid,
        || {
            let (read, tx) = pipe()?;
            rx = Some(read);
            Some(Reactor {
                pid,
                state: AtomicU8::new(STARTING),
                entries: Mutex::new(Registry::default()),
                notify: tx,
            })
        },
    )?;
    if installed {
        let rx = rx.take()?;
        let started = std::thread::Builder::new()
            .name("tdrv-reactor".into())
            .spawn(move || r.run(rx))
            .is_ok();
        r.state
            .store(if started { RUNNING } else { DEAD }, Ordering::Release);
    }
    loop {
        match r.state.load(Ordering::Acquire) {
            RUNNING => return Some(r),
            DEAD => return None,
            // Another thread of ours is starting it: a moment.
            _ => std::thread::yield_now(),
        }
    }
}

/// This process's reactor if it runs, without starting it.
pub(crate) fn running() -> Option<&'static Reactor> {
    // SAFETY: as in `get_or_install`: leaked, never freed.
    let r = unsafe { REACTOR.load(Ordering::Acquire).as_ref() }?;
    (r.pid == std::process::id() && r.state.load(Ordering::Acquire) == RUNNING).then_some(r)
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
    /// `device`, whose events the reactor reads from then on. `Ok(true)`
    /// for a new registration, for which the caller asks for the event
    /// (JOB_NOTIFY under `key`); `Ok(false)` if one under `key` waits
    /// already (its waker replaced). `EventsBusy` if the reactor may not
    /// read the device's events (the caller reads them itself, or this
    /// is a child after `fork`).
    pub(crate) fn register_event(
        &self,
        key: u64,
        device: &Arc<Device>,
        waker: &Waker,
    ) -> Result<bool, SysError> {
        device.claim_events_for("await", EVENTS_REACTOR)?;
        {
            let mut r = self.lock();
            if let Some(w) = r.events.get_mut(&key) {
                if !w.waker.will_wake(waker) {
                    w.waker.clone_from(waker);
                }
                return Ok(false);
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
        Ok(true)
    }

    /// Forgets the registrations under `key`, if any (a fence fd is closed
    /// unless its owner still holds it; an event that comes later is
    /// dropped). The thread is interrupted so that it stops polling what
    /// nobody waits for: its round's copy would keep a device file open
    /// until something else woke it.
    pub(crate) fn deregister(&self, key: u64) {
        let (fd, ev) = {
            let mut r = self.lock();
            (r.fds.remove(&key), r.remove_event(key))
        };
        if fd.is_some() || ev.is_some() {
            drop((fd, ev));
            self.interrupt();
        }
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
                if pfd.revents & libc::POLLIN == 0
                    || device
                        .read_events_unclaimed(&mut events, usize::MAX)
                        .is_err()
                {
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
mod await_tests;

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

    /// The per-process slot behind [`get`], with pids given: one value
    /// per process however many threads race to make it, and a process
    /// that finds another's value (a child after fork) installs its own
    /// and leaves that one untouched. Runs under Miri.
    #[test]
    fn one_value_per_process_and_a_new_one_in_a_child() {
        struct V {
            pid: u32,
            n: usize,
        }
        static SLOT: AtomicPtr<V> = AtomicPtr::new(ptr::null_mut());
        let made = AtomicUsize::new(0);
        let got: Vec<(&'static V, bool)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        get_or_install(
                            &SLOT,
                            |v: &V| v.pid == 1,
                            || {
                                Some(V {
                                    pid: 1,
                                    n: made.fetch_add(1, Ordering::SeqCst),
                                })
                            },
                        )
                        .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            got.iter().all(|g| ptr::eq(g.0, got[0].0)),
            "two values in one process"
        );
        assert_eq!(got.iter().filter(|g| g.1).count(), 1, "installed twice");
        let parent = got[0].0;
        let parent_ptr = SLOT.load(Ordering::Acquire);
        assert!(ptr::eq(parent_ptr, parent));
        // Another process: its own value; the other is left as it was.
        let (child, installed) =
            get_or_install(&SLOT, |v: &V| v.pid == 2, || Some(V { pid: 2, n: 99 })).unwrap();
        assert!(installed);
        assert_eq!((child.pid, child.n), (2, 99));
        assert_eq!(parent.pid, 1);
        assert!(parent.n < made.load(Ordering::SeqCst));
        // A value that cannot be made: none.
        assert!(get_or_install(&SLOT, |v: &V| v.pid == 3, || None).is_none());
        // SAFETY: the replaced value was leaked by design (a parent's);
        // this test alone knew it, and nothing uses it any more.
        drop(unsafe { Box::from_raw(parent_ptr) });
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
