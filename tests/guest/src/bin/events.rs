//! Completion events (ABI 1.4, `TDRV_FEAT_EVENTS`): `TDRV_IOC_JOB_NOTIFY`,
//! `read(2)` and `poll(2)`/epoll of the device file, on every kernel (also
//! without `CONFIG_SYNC_FILE`), its errnos (ESTALE past the job window);
//! SUBMIT asking for the event itself (ABI 1.6, `TDRV_SUBMIT_NOTIFY`);
//! and the library's futures awaiting thousands of jobs with them, on one
//! thread.
//!
//! usage: events /dev/tdrvN

use std::{
    fs,
    future::Future,
    os::fd::AsRawFd,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    task::{Context, Poll, Wake, Waker},
    thread,
    time::{Duration, Instant},
};

use tdrv_guest_tests::{
    all_jobs_ended, desc, expect_eq, expect_err, failure_injection, inject, ok,
    open_device_or_skip,
    raw::{errno, Dev},
    sync::poll_in,
    uffd::Unserved,
    wait::until_asleep_in,
    Hold, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

const TESTS: usize = 22;
/// Bound of every wait: only turns a hang into a failure.
const HANG: Duration = Duration::from_secs(120);
/// Jobs per file in the many-jobs checks (the default `file_max_jobs` is
/// 1024), and files: 10,000 outstanding jobs.
const JOBS_PER_FILE: usize = 1000;
const FILES: usize = 10;

/// Waits (at most `HANG`) until the file has an event ready.
fn wait_readable(dev: &Dev) -> R {
    if ok("poll", poll_in(dev.fd(), HANG.as_millis() as i32))? {
        Ok(())
    } else {
        Err(format!("no event within {HANG:?}"))
    }
}

/// Returns once the engine takes and runs a job again: edu's refuses jobs
/// (EIO) while it recovers from an injected stall.
fn engine_ready(dev: &Dev) -> R {
    let probe = pair(dev)?;
    let t0 = Instant::now();
    let id = loop {
        match dev.submit(&probe) {
            Ok(id) => break id,
            Err(e) if e == libc::EIO && t0.elapsed() < HANG => {
                thread::sleep(Duration::from_millis(500))
            }
            Err(e) => return Err(format!("submit: errno {e}")),
        }
    };
    wait_done(dev, id).map(drop)
}

/// Two one-page buffers: a job copies the first to the second.
fn pair(dev: &Dev) -> Result<[tdrv_copy_desc; 1], String> {
    let a = ok("alloc", dev.alloc(4096, 0))?;
    let b = ok("alloc", dev.alloc(4096, 0))?;
    ok("copy_in", dev.copy_in(a.handle, 0, &[0x5a; 4096]))?;
    Ok([desc(a.handle, 0, b.handle, 0, 4096)])
}

fn wait_done(dev: &Dev, id: u64) -> Result<(u32, i32), String> {
    ok("job_wait", dev.job_wait(id, HANG.as_micros() as i64))
}

/// Reads exactly one event (the file must have one ready).
fn read_one(dev: &Dev) -> Result<tdrv_event, String> {
    let mut ev = [tdrv_event::default(); 4];
    let n = ok("read", dev.read_events(&mut ev))?;
    expect_eq("events read", n, 1)?;
    Ok(ev[0])
}

fn expect_event(ev: &tdrv_event, job_id: u64, user_data: u64, status: i32) -> R {
    expect_eq(
        "event (type, status, job_id, user_data)",
        (ev.type_, ev.status, ev.job_id, ev.user_data),
        (TDRV_EVENT_JOB_DONE, status, job_id, user_data),
    )
}

/// An epoll instance watching `fds` for input, each with its index.
struct Epoll(std::os::fd::OwnedFd);

impl Epoll {
    fn new(fds: &[i32]) -> Result<Self, String> {
        Self::with_flags(fds, 0)
    }

    /// As [`Epoll::new`], edge-triggered: a wait reports a file once per
    /// wake-up of it, not while it stays readable.
    fn edge(fds: &[i32]) -> Result<Self, String> {
        Self::with_flags(fds, libc::EPOLLET as u32)
    }

    fn with_flags(fds: &[i32], flags: u32) -> Result<Self, String> {
        // SAFETY: plain syscall.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(format!("epoll_create1: errno {}", errno()));
        }
        // SAFETY: we own the new descriptor.
        let ep = Epoll(unsafe { std::os::fd::FromRawFd::from_raw_fd(ep) });
        for (i, fd) in fds.iter().enumerate() {
            let mut e = libc::epoll_event {
                events: libc::EPOLLIN as u32 | flags,
                u64: i as u64,
            };
            // SAFETY: a valid epoll fd, fd and event.
            if unsafe { libc::epoll_ctl(ep.0.as_raw_fd(), libc::EPOLL_CTL_ADD, *fd, &mut e) } < 0 {
                return Err(format!("epoll_ctl: errno {}", errno()));
            }
        }
        Ok(ep)
    }

    /// The indices of the ready fds, waiting at most `ms`.
    fn wait(&self, ms: i32) -> Result<Vec<usize>, String> {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 32];
        // SAFETY: a live array of its length.
        let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), evs.as_mut_ptr(), 32, ms) };
        if n < 0 {
            return Err(format!("epoll_wait: errno {}", errno()));
        }
        Ok(evs[..n as usize].iter().map(|e| e.u64 as usize).collect())
    }
}

/// Counts of this process's threads (`/proc/self/status`).
fn threads() -> Result<usize, String> {
    let s = fs::read_to_string("/proc/self/status").map_err(|e| format!("status: {e}"))?;
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| "no Threads: line".into())
}

/// A waker that marks its future ready and unparks the polling thread.
struct Flag {
    ready: AtomicBool,
    thread: thread::Thread,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.ready.store(true, Ordering::SeqCst);
        self.thread.unpark();
    }
}

/// Polls every future on this thread until all are ready (or `HANG`
/// passes); returns their outputs in order.
fn block_on_all<F: Future + Unpin>(mut futs: Vec<F>) -> Result<Vec<F::Output>, String> {
    let flags: Vec<Arc<Flag>> = (0..futs.len())
        .map(|_| {
            Arc::new(Flag {
                ready: AtomicBool::new(true),
                thread: thread::current(),
            })
        })
        .collect();
    let wakers: Vec<Waker> = flags.iter().map(|f| Waker::from(f.clone())).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    let mut left = futs.len();
    let t0 = Instant::now();
    while left > 0 {
        for (i, f) in futs.iter_mut().enumerate() {
            if out[i].is_some() || !flags[i].ready.swap(false, Ordering::SeqCst) {
                continue;
            }
            if let Poll::Ready(v) = Pin::new(f).poll(&mut Context::from_waker(&wakers[i])) {
                out[i] = Some(v);
                left -= 1;
            }
        }
        if t0.elapsed() > HANG {
            return Err(format!("{left} futures still pending after {HANG:?}"));
        }
        if left > 0 {
            thread::park_timeout(Duration::from_millis(100));
        }
    }
    Ok(out.into_iter().map(Option::unwrap).collect())
}

/// `RLIMIT_NOFILE` lowered to `soft` until dropped.
struct FdLimit(libc::rlimit);

impl FdLimit {
    fn lower(soft: u64) -> Result<Self, String> {
        let mut old = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: writes a local.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) } != 0 {
            return Err(format!("getrlimit: errno {}", errno()));
        }
        let new = libc::rlimit {
            rlim_cur: soft,
            rlim_max: old.rlim_max,
        };
        // SAFETY: reads a local.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } != 0 {
            return Err(format!("setrlimit: errno {}", errno()));
        }
        Ok(FdLimit(old))
    }
}

impl Drop for FdLimit {
    fn drop(&mut self) {
        // SAFETY: reads a field.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &self.0) };
    }
}

fn open_fds() -> Result<u64, String> {
    fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as u64)
        .map_err(|e| format!("/proc/self/fd: {e}"))
}

/// A forked child that runs `body` and exits with its return code.
fn fork_child(body: impl FnOnce() -> i32) -> Result<libc::pid_t, String> {
    // SAFETY: the child only makes system calls and exits.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: errno {}", errno())),
        0 => {
            let code = body();
            // SAFETY: ends the child without running the parent's atexit.
            unsafe { libc::_exit(code) }
        }
        pid => Ok(pid),
    }
}

/// Waits for `pid` (bounded by `HANG`); returns its wait status.
fn reap(pid: libc::pid_t) -> Result<i32, String> {
    let t0 = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child.
        match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
            0 if t0.elapsed() < HANG => thread::sleep(Duration::from_millis(10)),
            0 => {
                // SAFETY: our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                return Err(format!("child {pid} still running after {HANG:?}"));
            }
            r if r == pid => return Ok(status),
            _ => return Err(format!("waitpid: errno {}", errno())),
        }
    }
}

/// Polls `h` once (it must be pending: `Err` otherwise), calls
/// `registered`, then polls it again only when woken, until it is ready
/// (or `HANG` passes): a lost wake-up is a hang, never hidden by a poll
/// that comes late enough to find the job done.
fn woken_wait(
    mut h: tdrv::JobHandle,
    registered: impl FnOnce(),
) -> Result<tdrv::Result<()>, String> {
    let flag = Arc::new(Flag {
        ready: AtomicBool::new(false),
        thread: thread::current(),
    });
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    if Pin::new(&mut h).poll(&mut cx).is_ready() {
        return Err("a held job was ready".into());
    }
    registered();
    let t0 = Instant::now();
    loop {
        while !flag.ready.swap(false, Ordering::SeqCst) {
            if t0.elapsed() > HANG {
                return Err(format!("not woken within {HANG:?}"));
            }
            thread::park_timeout(Duration::from_millis(100));
        }
        if let Poll::Ready(r) = Pin::new(&mut h).poll(&mut cx) {
            return Ok(r);
        }
    }
}

/// Waits until the child's main thread sleeps in `read` of a tdrv file
/// (its wait channel names the event wait).
fn wait_until_reading(pid: libc::pid_t) -> R {
    let t0 = Instant::now();
    loop {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let syscall = fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
        // State S (sleeping) in read(2) (syscall 0 on x86-64).
        let state = stat.rsplit(") ").next().and_then(|s| s.chars().next());
        if state == Some('S') && syscall.split_whitespace().next() == Some("0") {
            return Ok(());
        }
        if t0.elapsed() > HANG {
            return Err(format!("child never slept in read(2): {stat}"));
        }
        thread::sleep(Duration::from_millis(10));
    }
}

extern "C" fn on_usr1(_: libc::c_int) {}

const EVENT_SIZE: usize = std::mem::size_of::<tdrv_event>();

/// A new file of `path` with two ended jobs whose events (user data 1
/// and 2) are ready; returns it and the jobs' ids.
fn two_ready_events(path: &str) -> Result<(Arc<Dev>, u64, u64), String> {
    let own = Arc::new(ok("open", Dev::open(path))?);
    let d = pair(&own)?;
    let j1 = ok("submit", own.submit(&d))?;
    let j2 = ok("submit", own.submit(&d))?;
    wait_done(&own, j1)?;
    wait_done(&own, j2)?;
    ok("notify", own.job_notify(j1, 1))?;
    ok("notify", own.job_notify(j2, 2))?;
    Ok((own, j1, j2))
}

/// A read of two events by another thread, into a buffer whose second
/// event lies in a page nobody serves: the thread has taken both events
/// and sleeps in the copy of the second when this returns.
struct StalledRead {
    mem: Arc<Unserved>,
    reader: thread::JoinHandle<(isize, i32)>,
}

impl StalledRead {
    fn start(own: &Arc<Dev>) -> Result<StalledRead, String> {
        let mem = Arc::new(Unserved::new(4096, 4096)?);
        let at = mem.base() as usize + 4096 - EVENT_SIZE;
        let fd = own.fd();
        let keep = own.clone();
        let reader = thread::spawn(move || {
            // SAFETY: reads into our mapping; the kernel checks the
            // addresses (the second event's may fault).
            let r = unsafe { libc::read(fd, at as *mut libc::c_void, 2 * EVENT_SIZE) };
            drop(keep);
            (r, errno())
        });
        mem.wait_fault(HANG.as_millis() as i32)?;
        Ok(StalledRead { mem, reader })
    }

    /// Ends the stall with a fault; returns the first event, the one the
    /// read copied before it (the read must have returned just that one).
    fn fail(self) -> Result<tdrv_event, String> {
        self.mem.fail()?;
        let (r, e) = self.reader.join().map_err(|_| "reader panicked")?;
        expect_eq("the faulting read's result", r, EVENT_SIZE as isize)
            .map_err(|m| format!("{m} (errno {e})"))?;
        // SAFETY: the served page, written by the kernel's copy.
        Ok(unsafe {
            std::ptr::read_unaligned(self.mem.base().add(4096 - EVENT_SIZE).cast::<tdrv_event>())
        })
    }
}

/// A thread asleep in a blocking read of one event of `own`; its result
/// comes through the receiver.
fn sleeping_reader(
    own: &Arc<Dev>,
) -> Result<std::sync::mpsc::Receiver<Result<tdrv_event, String>>, String> {
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let (tx, rx) = std::sync::mpsc::channel();
    let own = own.clone();
    thread::spawn(move || {
        // SAFETY: plain syscall.
        let _ = tid_tx.send(unsafe { libc::gettid() });
        let mut ev = [tdrv_event::default(); 1];
        let r = ok("read", own.read_events(&mut ev)).map(|_| ev[0]);
        let _ = tx.send(r);
    });
    let tid = tid_rx.recv().map_err(|_| "reader died")?;
    until_asleep_in(tid, libc::SYS_read)?;
    Ok(rx)
}

/// The defaults of module parameters `file_max_events` and
/// `device_max_events` (the guests load tdrv without them; 7.2's Rust
/// module parameters have no sysfs files to read them from).
const FILE_MAX_EVENTS: u64 = 4096;
const DEVICE_MAX_EVENTS: u64 = 65536;

/// Unreclaimable slab memory, in KiB (`/proc/meminfo`).
fn sunreclaim_kib() -> Result<u64, String> {
    let m = fs::read_to_string("/proc/meminfo").map_err(|e| format!("meminfo: {e}"))?;
    m.lines()
        .find_map(|l| l.strip_prefix("SUnreclaim:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| "no SUnreclaim in /proc/meminfo".into())
}

/// Queues events for one ended job of `f` until ENOSPC (at most
/// `limit` + 1 tries); returns how many were queued.
fn notify_until_enospc(f: &Dev, limit: u64) -> Result<u64, String> {
    let id = ok("submit", f.submit(&pair(f)?))?;
    wait_done(f, id)?;
    for n in 0..=limit {
        match f.job_notify(id, n) {
            Ok(()) => {}
            Err(libc::ENOSPC) => return Ok(n),
            Err(e) => return Err(format!("JOB_NOTIFY {n}: errno {e}")),
        }
    }
    Err(format!("no ENOSPC after {limit} + 1 events of one file"))
}

/// In a child that drops root after opening `files` files of `path`:
/// every file queues events until ENOSPC. Each gets at most
/// `file_max_events`, all together `device_max_events`, and slab memory
/// grows by about what that many events cost.
fn many_files_child(path: &str, files: usize, file_max: u64, dev_max: u64) -> Result<(), String> {
    let mut all = Vec::with_capacity(files);
    for _ in 0..files {
        all.push(ok("open", Dev::open(path))?);
    }
    // SAFETY: plain syscalls; the child is single-threaded.
    if unsafe { libc::setgid(65534) } != 0 || unsafe { libc::setuid(65534) } != 0 {
        return Err(format!("dropping root: errno {}", errno()));
    }
    let before = sunreclaim_kib()?;
    let mut total = 0;
    for (i, f) in all.iter().enumerate() {
        let n = notify_until_enospc(f, file_max)?;
        if i == 0 && n != file_max {
            return Err(format!(
                "the first file queued {n} events, not file_max_events = {file_max}"
            ));
        }
        total += n;
    }
    if total > dev_max || total + file_max < dev_max {
        return Err(format!(
            "{files} files queued {total} events in all, device_max_events = {dev_max}"
        ));
    }
    // A generous bound: 1 KiB per event (slab debugging and kmemleak's
    // metadata included) and 16 KiB per file, against the 65,536 events
    // per file that used to fit.
    let grew = sunreclaim_kib()?.saturating_sub(before);
    let bound = dev_max + 16 * files as u64;
    if grew > bound {
        return Err(format!("SUnreclaim grew by {grew} KiB (bound {bound} KiB)"));
    }
    Ok(())
}

/// Waits (at most `HANG`) for a sleeping reader's event.
fn reader_result(
    rx: std::sync::mpsc::Receiver<Result<tdrv_event, String>>,
) -> Result<tdrv_event, String> {
    rx.recv_timeout(HANG)
        .map_err(|_| format!("the sleeping reader got nothing within {HANG:?}"))?
}

fn main() {
    let (dev, path, version) = open_device_or_skip("/dev/tdrv0", None);
    let kind = version.device_kind;
    let mut t = Tap::new(TESTS);
    if version.features & TDRV_FEAT_EVENTS as u64 == 0 {
        tdrv_guest_tests::skip_all("the driver does not report TDRV_FEAT_EVENTS (ABI < 1.4)");
    }

    t.run(
        "JOB_NOTIFY and read refuse bad arguments with their errnos",
        || -> R {
            expect_err("job 0", dev.job_notify(0, 1), libc::EINVAL)?;
            let id = ok("submit", dev.submit(&pair(&dev)?))?;
            expect_err(
                "a job not yet issued",
                dev.job_notify(id + 1, 1),
                libc::EINVAL,
            )?;
            let mut n = tdrv_job_notify {
                job_id: id,
                reserved: [0, 7],
                ..Default::default()
            };
            expect_err(
                "reserved",
                dev.ioctl(TDRV_IOC_JOB_NOTIFY, &mut n),
                libc::EINVAL,
            )?;
            wait_done(&dev, id)?;
            ok("notify", dev.job_notify(id, 1))?;
            // A buffer smaller than one event: the event stays.
            let mut small = [0u8; 23];
            // SAFETY: reads into a local array of its length.
            let r = unsafe { libc::read(dev.fd(), small.as_mut_ptr().cast(), small.len()) };
            expect_eq("read of 23 bytes", (r, errno()), (-1, libc::EINVAL))?;
            // An unmapped buffer: EFAULT, and the event stays.
            // SAFETY: the kernel checks the address; nothing here is touched.
            let r = unsafe { libc::read(dev.fd(), 8usize as *mut libc::c_void, 24) };
            expect_eq(
                "read into an unmapped page",
                (r, errno()),
                (-1, libc::EFAULT),
            )?;
            expect_event(&read_one(&dev)?, id, 1, 0)?;
            ok("O_NONBLOCK", dev.set_nonblock(true))?;
            let mut ev = [tdrv_event::default(); 1];
            let r = dev.read_events(&mut ev);
            ok("O_NONBLOCK off", dev.set_nonblock(false))?;
            expect_err("read with nothing ready (O_NONBLOCK)", r, libc::EAGAIN)
        },
    );

    t.run(
        "a job that already ended gives its event at once: id, status, user_data; then nothing",
        || -> R {
            let id = ok("submit", dev.submit(&pair(&dev)?))?;
            expect_eq("job", wait_done(&dev, id)?, (TDRV_JOB_DONE, 0))?;
            expect_eq("readable before", ok("poll", poll_in(dev.fd(), 0))?, false)?;
            ok("notify", dev.job_notify(id, 0xfeed_0000_0000_0001))?;
            ok("notify again", dev.job_notify(id, 2))?;
            expect_eq("readable after", ok("poll", poll_in(dev.fd(), 0))?, true)?;
            let mut ev = [tdrv_event::default(); 4];
            expect_eq("events read", ok("read", dev.read_events(&mut ev))?, 2)?;
            expect_event(&ev[0], id, 0xfeed_0000_0000_0001, 0)?;
            expect_event(&ev[1], id, 2, 0)?;
            expect_eq(
                "readable once read",
                ok("poll", poll_in(dev.fd(), 0))?,
                false,
            )
        },
    );

    t.run(
        "epoll reports the file when a held job ends, not before; JOB_WAIT agrees",
        || -> R {
            let d = pair(&dev)?;
            let ep = Epoll::new(&[dev.fd()])?;
            let id = {
                let _hold = Hold::new(&path)?;
                let id = ok("submit", dev.submit(&d))?;
                ok("notify", dev.job_notify(id, 7))?;
                thread::sleep(Duration::from_millis(100));
                expect_eq("ready while held", ep.wait(0)?, Vec::<usize>::new())?;
                expect_eq(
                    "job while held",
                    ok("job_wait", dev.job_wait(id, 0))?.0,
                    TDRV_JOB_PENDING,
                )?;
                id
            };
            expect_eq(
                "ready after release",
                ep.wait(HANG.as_millis() as i32)?,
                vec![0],
            )?;
            expect_eq(
                "job",
                ok("job_wait", dev.job_wait(id, 0))?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_event(&read_one(&dev)?, id, 7, 0)
        },
    );

    let name = "a job cancelled through its in-fence (its gate's file closed) reports ECANCELED";
    if version.features & TDRV_FEAT_FENCE_FD as u64 == 0 {
        t.skip(
            name,
            "needs sync_file in-fences (TDRV_FEAT_FENCE_FD; no CONFIG_SYNC_FILE)",
        );
    } else {
        t.run(name, || -> R {
            // The gate: a job of another file, held, with an out-fence;
            // closing that file cancels it, and so the job gated on it.
            let other = ok("open", Dev::open(&path))?;
            let d = pair(&dev)?;
            let od = pair(&other)?;
            let (gated, fence) = {
                let _hold = Hold::new(&path)?;
                let (_, fd) = ok("submit the gate", other.submit_fences(&od, &[], true))?;
                // SAFETY: the driver installed this fd for us.
                let fence: std::os::fd::OwnedFd =
                    unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
                let (gated, _) = ok(
                    "submit gated",
                    dev.submit_fences(&d, &[fence.as_raw_fd()], false),
                )?;
                ok("notify", dev.job_notify(gated, 4))?;
                drop(other);
                (gated, fence)
            };
            wait_readable(&dev)?;
            drop(fence);
            expect_event(&read_one(&dev)?, gated, 4, -libc::ECANCELED)
        });
    }

    t.run(
        "a read whose copy faults puts the rest back and wakes a reader that slept meanwhile",
        || -> R {
            let (own, j1, j2) = two_ready_events(&path)?;
            let stalled = StalledRead::start(&own)?;
            // Both events are taken: a second reader sleeps.
            let second = sleeping_reader(&own)?;
            expect_event(&stalled.fail()?, j1, 1, 0)?;
            expect_event(&reader_result(second)?, j2, 2, 0)
        },
    );

    t.run(
        "while a read's copy stalls, other readers (RWF_NOWAIT, O_NONBLOCK, blocking) take no later event before the put-back one",
        || -> R {
            let (own, j1, j2) = two_ready_events(&path)?;
            let d = pair(&own)?;
            let stalled = StalledRead::start(&own)?;
            // A third job ends during the stalled copy.
            let j3 = ok("submit", own.submit(&d))?;
            wait_done(&own, j3)?;
            ok("notify", own.job_notify(j3, 3))?;
            let mut ev = [tdrv_event::default(); 1];
            let iov = libc::iovec {
                iov_base: ev.as_mut_ptr().cast(),
                iov_len: EVENT_SIZE,
            };
            // SAFETY: one iovec over a local array of its length.
            let r = unsafe { libc::preadv2(own.fd(), &iov, 1, -1, libc::RWF_NOWAIT) };
            expect_eq("RWF_NOWAIT read during the copy", (r, errno()), (-1, libc::EAGAIN))?;
            ok("O_NONBLOCK", own.set_nonblock(true))?;
            let r = own.read_events(&mut ev);
            ok("O_NONBLOCK off", own.set_nonblock(false))?;
            expect_err("O_NONBLOCK read during the copy", r, libc::EAGAIN)?;
            let second = sleeping_reader(&own)?;
            expect_event(&stalled.fail()?, j1, 1, 0)?;
            expect_event(&reader_result(second)?, j2, 2, 0)?;
            expect_event(&read_one(&own)?, j3, 3, 0)
        },
    );

    t.run(
        "an edge-triggered epoll waiter gets a new edge when a faulting read puts events back",
        || -> R {
            let (own, j1, j2) = two_ready_events(&path)?;
            let ep = Epoll::edge(&[own.fd()])?;
            expect_eq("the first edge", ep.wait(HANG.as_millis() as i32)?, vec![0])?;
            expect_eq("no second edge", ep.wait(0)?, Vec::<usize>::new())?;
            let stalled = StalledRead::start(&own)?;
            expect_event(&stalled.fail()?, j1, 1, 0)?;
            expect_eq(
                "an edge after the put-back",
                ep.wait(HANG.as_millis() as i32)?,
                vec![0],
            )?;
            expect_event(&read_one(&own)?, j2, 2, 0)
        },
    );

    // Pollers are woken for a ready event only if someone looked since
    // the last wake (`driver/job.rs`, `poll_armed`): an edge-triggered
    // waiter must still get an edge for every event that ends after it
    // looked, whether it read the earlier ones or not.
    t.run(
        "an edge-triggered epoll waiter gets an edge for each event that ends after it looked, read or not",
        || -> R {
            let own = ok("open", Dev::open(&path))?;
            let d = pair(&own)?;
            let ep = Epoll::edge(&[own.fd()])?;
            let hang = HANG.as_millis() as i32;
            let end = |n: u64| -> Result<(u64, u64), String> {
                let j = ok("submit_notify", own.submit_notify(&d, n))?;
                wait_done(&own, j)?;
                Ok((j, n))
            };
            let mut jobs = vec![end(1)?];
            expect_eq("the edge of the first event", ep.wait(hang)?, vec![0])?;
            // Not read: a new event is still an edge, as new data in a pipe.
            jobs.push(end(2)?);
            expect_eq("an edge with an event unread", ep.wait(hang)?, vec![0])?;
            // Two events with no look between them: an edge for them.
            jobs.push(end(3)?);
            jobs.push(end(4)?);
            expect_eq("an edge for two events", ep.wait(hang)?, vec![0])?;
            let mut ev = [tdrv_event::default(); 8];
            let n = ok("read", own.read_events(&mut ev))?;
            expect_eq(
                "the four events, in order",
                ev[..n]
                    .iter()
                    .map(|e| (e.job_id, e.user_data))
                    .collect::<Vec<_>>(),
                jobs.clone(),
            )?;
            jobs.push(end(5)?);
            expect_eq(
                "an edge after the read emptied the queue",
                ep.wait(hang)?,
                vec![0],
            )?;
            let (j5, _) = jobs[4];
            expect_event(&read_one(&own)?, j5, 5, 0)
        },
    );

    t.run(
        "a read that faults in its second batch of events returns the 17 whole ones before the fault and keeps the rest, in order",
        || -> R {
            // The driver copies events out 16 at a time: 20 ready events
            // into a buffer whose 18th event straddles an unmapped page.
            let own = ok("open", Dev::open(&path))?;
            let d = pair(&own)?;
            let mut ids = Vec::new();
            for i in 0..20u64 {
                let id = ok("submit", own.submit(&d))?;
                wait_done(&own, id)?;
                ok("notify", own.job_notify(id, 100 + i))?;
                ids.push(id);
            }
            let page = 4096usize;
            // SAFETY: a fresh private mapping of two pages; the second is
            // unmapped again at once, so that it faults.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    2 * page,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return Err(format!("mmap: errno {}", errno()));
            }
            // SAFETY: the second page of the mapping just made.
            unsafe { libc::munmap(base.cast::<u8>().add(page).cast(), page) };
            let at = base as usize + page - 17 * EVENT_SIZE - EVENT_SIZE / 2;
            // SAFETY: reads into our mapping; the kernel checks the
            // addresses (the 18th event's second half faults).
            let r = unsafe { libc::read(own.fd(), at as *mut libc::c_void, 20 * EVENT_SIZE) };
            let e = errno();
            let mut got = Vec::new();
            for k in 0..17 {
                // SAFETY: within the mapped page, written by the kernel's
                // copy (read_unaligned: `at` is not 8-byte aligned).
                got.push(unsafe {
                    std::ptr::read_unaligned((at + k * EVENT_SIZE) as *const tdrv_event)
                });
            }
            // SAFETY: the first page of the mapping made above.
            unsafe { libc::munmap(base, page) };
            expect_eq("the faulting read's result", r, 17 * EVENT_SIZE as isize)
                .map_err(|m| format!("{m} (errno {e})"))?;
            for (k, ev) in got.iter().enumerate() {
                expect_event(ev, ids[k], 100 + k as u64, 0)?;
            }
            let mut rest = [tdrv_event::default(); 8];
            let n = ok("read", own.read_events(&mut rest))?;
            expect_eq("events left", n, 3)?;
            for (k, ev) in rest[..3].iter().enumerate() {
                expect_event(ev, ids[17 + k], 117 + k as u64, 0)?;
            }
            Ok(())
        },
    );

    let many = "an unprivileged process with 1,000 files gets ENOSPC at file_max_events per file and device_max_events in all; the budget comes back at close";
    if kind != TDRV_DEVICE_SOFT {
        // The budget is the driver's, the same for every backend; 1,000
        // files and 65,536 events take half a minute of a TCG guest.
        t.skip(
            many,
            "the event budget is backend-independent: checked on the software device",
        );
    } else {
        t.run(many, || -> R {
            let (file_max, dev_max) = (FILE_MAX_EVENTS, DEVICE_MAX_EVENTS);
            let mut fds = [0; 2];
            // SAFETY: a fresh pipe.
            if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
                return Err(format!("pipe: errno {}", errno()));
            }
            let p = path.clone();
            let child = fork_child(move || {
                let r = many_files_child(&p, 1000, file_max, dev_max);
                let msg = r.as_ref().err().cloned().unwrap_or_default();
                // SAFETY: writes a local string to our pipe.
                unsafe { libc::write(fds[1], msg.as_ptr().cast(), msg.len()) };
                i32::from(r.is_err())
            })?;
            // SAFETY: our copy of the write end.
            unsafe { libc::close(fds[1]) };
            let status = reap(child)?;
            let mut msg = vec![0u8; 4096];
            // SAFETY: reads into a local buffer of its length.
            let n = unsafe { libc::read(fds[0], msg.as_mut_ptr().cast(), msg.len()) };
            // SAFETY: our read end.
            unsafe { libc::close(fds[0]) };
            msg.truncate(n.max(0) as usize);
            if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
                return Err(format!(
                    "child (wait status {status:#x}): {}",
                    String::from_utf8_lossy(&msg)
                ));
            }
            // The child's files are closed: a new file gets its full share.
            let own = ok("open", Dev::open(&path))?;
            expect_eq(
                "events of a new file after the others closed",
                notify_until_enospc(&own, file_max)?,
                file_max,
            )
        });
    }

    t.run(
        "a signal ends a blocking read with EINTR; the event comes later all the same",
        || -> R {
            let d = pair(&dev)?;
            let hold = Hold::new(&path)?;
            let id = ok("submit", dev.submit(&d))?;
            ok("notify", dev.job_notify(id, 5))?;
            let fd = dev.fd();
            let child = fork_child(|| {
                // SAFETY: installs a handler without SA_RESTART.
                let installed = unsafe {
                    let mut sa: libc::sigaction = std::mem::zeroed();
                    sa.sa_sigaction = on_usr1 as *const () as usize;
                    libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut())
                };
                if installed != 0 {
                    return 2;
                }
                let mut ev = [0u8; 24];
                // SAFETY: reads into a local array.
                let r = unsafe { libc::read(fd, ev.as_mut_ptr().cast(), 24) };
                if r == -1 && errno() == libc::EINTR {
                    0
                } else {
                    1
                }
            })?;
            wait_until_reading(child)?;
            // SAFETY: our own child.
            unsafe { libc::kill(child, libc::SIGUSR1) };
            let status = reap(child)?;
            expect_eq(
                "child's read ended with EINTR (1: another end, 2: sigaction failed)",
                tdrv_guest_tests::exit_code(status)?,
                0,
            )?;
            drop(hold);
            wait_readable(&dev)?;
            expect_event(&read_one(&dev)?, id, 5, 0)
        },
    );

    t.run(
        "SIGKILL of a process asleep in read, and close with events asked for, cancel its jobs",
        || -> R {
            let before = tdrv_guest_tests::stat(&path, "jobs_cancelled")?;
            let hold = Hold::new(&path)?;
            let p = path.clone();
            let child = fork_child(move || {
                let Ok(own) = Dev::open(&p) else { return 2 };
                let Ok(d) = pair(&own) else { return 3 };
                for i in 0..3 {
                    let Ok(id) = own.submit(&d) else { return 4 };
                    if own.job_notify(id, i).is_err() {
                        return 5;
                    }
                }
                let mut ev = [tdrv_event::default(); 1];
                let _ = own.read_events(&mut ev);
                6
            })?;
            wait_until_reading(child)?;
            // SAFETY: our own child.
            unsafe { libc::kill(child, libc::SIGKILL) };
            let status = reap(child)?;
            expect_eq(
                "killed",
                libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL,
                true,
            )?;
            // Cancelling the held job ended the hold: hold again.
            drop(hold);
            all_jobs_ended(&path, HANG)?;
            let hold = Hold::new(&path)?;
            // And a plain close with events asked for, while held.
            let own = ok("open", Dev::open(&path))?;
            let d = pair(&own)?;
            for i in 0..3 {
                let id = ok("submit", own.submit(&d))?;
                ok("notify", own.job_notify(id, i))?;
            }
            drop(own);
            drop(hold);
            expect_eq(
                "jobs cancelled",
                tdrv_guest_tests::stat(&path, "jobs_cancelled")? - before,
                6,
            )
        },
    );

    t.run(
        "file_max_events unread events, then ENOSPC (a bad id still EINVAL); reading one makes room",
        || -> R {
            let own = ok("open", Dev::open(&path))?;
            let id = ok("submit", own.submit(&pair(&own)?))?;
            wait_done(&own, id)?;
            for i in 0..FILE_MAX_EVENTS {
                if let Err(e) = own.job_notify(id, i) {
                    return Err(format!("notify {i}: errno {e}"));
                }
            }
            expect_err("one more", own.job_notify(id, 0), libc::ENOSPC)?;
            // A bad id is still a bad id when there is no room.
            expect_err("an id never issued", own.job_notify(id + 1, 0), libc::EINVAL)?;
            expect_err("id 0", own.job_notify(0, 0), libc::EINVAL)?;
            let mut one = [tdrv_event::default(); 1];
            expect_eq("read", ok("read", own.read_events(&mut one))?, 1)?;
            expect_event(&one[0], id, 0, 0)?;
            ok("after a read", own.job_notify(id, 1))?;
            // Oldest first: the second event asked for comes next.
            expect_eq("read", ok("read", own.read_events(&mut one))?, 1)?;
            expect_event(&one[0], id, 1, 0)
        },
    );

    let notify = version.features & TDRV_FEAT_SUBMIT_NOTIFY as u64 != 0;
    let no_feature = || -> R {
        Err(format!(
            "ABI {}.{} without TDRV_FEAT_SUBMIT_NOTIFY (1.6 reports it on every kernel)",
            version.abi_major, version.abi_minor
        ))
    };

    t.run(
        "SUBMIT_NOTIFY: a held job's event comes when it ends, not before; one that ended in the call has it at once",
        || -> R {
            if !notify {
                return no_feature();
            }
            let d = pair(&dev)?;
            let id = {
                let _hold = Hold::new(&path)?;
                let id = ok("submit_notify", dev.submit_notify(&d, 0xfeed_0001))?;
                expect_eq(
                    "readable while the job is held",
                    ok("poll", poll_in(dev.fd(), 0))?,
                    false,
                )?;
                id
            };
            wait_readable(&dev)?;
            expect_event(&read_one(&dev)?, id, 0xfeed_0001, 0)?;
            expect_eq("JOB_WAIT", wait_done(&dev, id)?, (TDRV_JOB_DONE, 0))?;
            // Done (and so its event queued) by the time JOB_WAIT says so.
            let id = ok("submit_notify", dev.submit_notify(&d, 2))?;
            expect_eq("JOB_WAIT", wait_done(&dev, id)?, (TDRV_JOB_DONE, 0))?;
            expect_eq("readable", ok("poll", poll_in(dev.fd(), 0))?, true)?;
            expect_event(&read_one(&dev)?, id, 2, 0)?;
            expect_eq("readable once read", ok("poll", poll_in(dev.fd(), 0))?, false)
        },
    );

    t.run(
        "SUBMIT refuses user_data without TDRV_SUBMIT_NOTIFY, and the flag in a struct without user_data (EINVAL), queueing nothing",
        || -> R {
            if !notify {
                return no_feature();
            }
            let d = pair(&dev)?;
            let before = ok("submit", dev.submit(&d))?;
            let mut s = tdrv_submit {
                descs: d.as_ptr() as u64,
                desc_count: 1,
                desc_size: std::mem::size_of::<tdrv_copy_desc>() as u32,
                user_data: 5,
                ..Default::default()
            };
            expect_err(
                "user_data without the flag",
                dev.ioctl(TDRV_IOC_SUBMIT, &mut s),
                libc::EINVAL,
            )?;
            // The 64 bytes of ABI 1.2-1.5, with the flag: no room for
            // user_data.
            let mut short = tdrv_submit {
                flags: TDRV_SUBMIT_NOTIFY,
                user_data: 0,
                ..s
            };
            // SAFETY: `short` is a live struct larger than the 64 bytes
            // the request names.
            let r = unsafe {
                dev.ioctl_addr(
                    request_with_size(TDRV_IOC_SUBMIT, 64),
                    (&raw mut short) as usize,
                )
            };
            expect_err("the flag in a 64-byte struct", r, libc::EINVAL)?;
            // Nothing was queued: no job took an id, no event is there.
            let after = ok("submit", dev.submit(&d))?;
            expect_eq("the next job's id", after, before + 1)?;
            wait_done(&dev, after)?;
            expect_eq("readable", ok("poll", poll_in(dev.fd(), 0))?, false)
        },
    );

    t.run(
        "SUBMIT_NOTIFY past file_max_events is ENOSPC and queues no job; reading one makes room",
        || -> R {
            if !notify {
                return no_feature();
            }
            let own = ok("open", Dev::open(&path))?;
            let d = pair(&own)?;
            let id = ok("submit", own.submit(&d))?;
            wait_done(&own, id)?;
            for i in 0..FILE_MAX_EVENTS {
                if let Err(e) = own.job_notify(id, i) {
                    return Err(format!("notify {i}: errno {e}"));
                }
            }
            expect_err("SUBMIT_NOTIFY", own.submit_notify(&d, 9), libc::ENOSPC)?;
            // No job took an id.
            let next = ok("submit", own.submit(&d))?;
            expect_eq("the next job's id", next, id + 1)?;
            wait_done(&own, next)?;
            let mut one = [tdrv_event::default(); 1];
            expect_eq("read", ok("read", own.read_events(&mut one))?, 1)?;
            expect_event(&one[0], id, 0, 0)?;
            let last = ok("submit_notify after a read", own.submit_notify(&d, 9))?;
            wait_done(&own, last)?;
            // Its event comes after the 4,095 still queued.
            let mut all = vec![tdrv_event::default(); FILE_MAX_EVENTS as usize];
            let mut got = Vec::new();
            while got.len() < FILE_MAX_EVENTS as usize {
                let n = ok("read", own.read_events(&mut all))?;
                got.extend_from_slice(&all[..n]);
            }
            expect_event(&got[FILE_MAX_EVENTS as usize - 1], last, 9, 0)
        },
    );

    let big =
        "10,000 jobs of 10 files end as 10,000 events through one epoll set, with fds capped at 64";
    let futures =
        "10,000 awaited job handles are woken by events on one thread, without a thread each";
    if kind == TDRV_DEVICE_EDU {
        // Not a gap: every other check runs on edu, and these two run on
        // the software and sim devices, whose engines finish 10,000 jobs
        // in seconds.
        let why =
            "edu's DMA engine takes ~0.2 s of guest time per job: 10,000 jobs run on soft and sim";
        t.skip(big, why);
        t.skip(futures, why);
    } else {
        t.run(big, || -> R {
            let files: Vec<Dev> = (0..FILES)
                .map(|_| ok("open", Dev::open(&path)))
                .collect::<Result<_, _>>()?;
            let descs: Vec<_> = files.iter().map(pair).collect::<Result<_, _>>()?;
            let ep = Epoll::new(&files.iter().map(Dev::fd).collect::<Vec<_>>())?;
            let mut ids = vec![Vec::new(); FILES];
            {
                let _hold = Hold::new(&path)?;
                // No fd per job: 64 fds is plenty for 10,000 of them.
                let _cap = FdLimit::lower(open_fds()? + 8)?;
                for (f, dev) in files.iter().enumerate() {
                    for i in 0..JOBS_PER_FILE {
                        let id = ok("submit", dev.submit(&descs[f]))?;
                        ok("notify", dev.job_notify(id, ((f as u64) << 32) | i as u64))?;
                        ids[f].push(id);
                    }
                }
                expect_eq("ready while held", ep.wait(0)?, Vec::<usize>::new())?;
            }
            let mut seen = vec![vec![false; JOBS_PER_FILE]; FILES];
            let mut left = FILES * JOBS_PER_FILE;
            let mut buf = vec![tdrv_event::default(); 256];
            let t0 = Instant::now();
            while left > 0 {
                if t0.elapsed() > HANG {
                    return Err(format!("{left} events missing after {HANG:?}"));
                }
                for f in ep.wait(1000)? {
                    let n = ok("read", files[f].read_events(&mut buf))?;
                    for ev in &buf[..n] {
                        let (file, i) = (
                            (ev.user_data >> 32) as usize,
                            (ev.user_data & 0xffff_ffff) as usize,
                        );
                        if file != f
                            || i >= JOBS_PER_FILE
                            || ev.job_id != ids[f][i]
                            || ev.status != 0
                        {
                            return Err(format!("unexpected event on file {f}: {ev:?}"));
                        }
                        if seen[f][i] {
                            return Err(format!("event for job {} twice", ev.job_id));
                        }
                        seen[f][i] = true;
                        left -= 1;
                    }
                }
            }
            expect_eq("still readable", ep.wait(0)?, Vec::<usize>::new())
        });

        t.run(futures, || -> R {
            let e = |what: &str, r: tdrv::Result<()>| r.map_err(|err| format!("{what}: {err}"));
            let devs: Vec<Arc<tdrv::Device>> = (0..FILES)
                .map(|_| tdrv::Device::open(&path).map_err(|err| format!("open: {err}")))
                .collect::<Result<_, _>>()?;
            let mut tensors = Vec::new();
            for d in &devs {
                let a = tdrv::Tensor::allocate_on(d, 0, 4096, None)
                    .map_err(|err| format!("alloc: {err}"))?;
                let b = tdrv::Tensor::allocate_on(d, 0, 4096, None)
                    .map_err(|err| format!("alloc: {err}"))?;
                tensors.push((a, b));
            }
            // The reactor thread is started by the first await of a job
            // still running, before counting: the point is that no thread
            // comes per job.
            let mut first = tdrv::Job::new();
            first
                .copy_all(&tensors[0].0, &tensors[0].1)
                .map_err(|err| format!("copy: {err}"))?;
            let mut h = {
                let _hold = Hold::new(&path)?;
                let mut h = first.submit().map_err(|err| format!("submit: {err}"))?;
                let flag = Arc::new(Flag {
                    ready: AtomicBool::new(false),
                    thread: thread::current(),
                });
                if Pin::new(&mut h)
                    .poll(&mut Context::from_waker(&Waker::from(flag)))
                    .is_ready()
                {
                    return Err("the held first job's handle was ready".into());
                }
                h
            };
            e(
                "first await",
                block_on_all(vec![std::future::poll_fn(move |cx| {
                    Pin::new(&mut h).poll(cx)
                })])?
                .remove(0),
            )?;
            all_jobs_ended(&path, HANG)?;
            let before = threads()?;
            let mut handles = Vec::new();
            {
                let _hold = Hold::new(&path)?;
                for (a, b) in &tensors {
                    for _ in 0..JOBS_PER_FILE {
                        let mut j = tdrv::Job::new();
                        j.copy_all(a, b).map_err(|err| format!("copy: {err}"))?;
                        handles.push(j.submit().map_err(|err| format!("submit: {err}"))?);
                    }
                }
                // Every handle registered while all jobs are held.
                let flag = Arc::new(Flag {
                    ready: AtomicBool::new(false),
                    thread: thread::current(),
                });
                let waker = Waker::from(flag);
                for h in &mut handles {
                    if Pin::new(h)
                        .poll(&mut Context::from_waker(&waker))
                        .is_ready()
                    {
                        return Err("a held job's handle was ready".into());
                    }
                }
                expect_eq("threads with 10,000 handles awaited", threads()?, before)?;
            }
            let n = handles.len();
            let results = block_on_all(handles)?;
            expect_eq("handles", n, FILES * JOBS_PER_FILE)?;
            for (i, r) in results.into_iter().enumerate() {
                e(&format!("job {i}"), r)?;
            }
            expect_eq("threads after", threads()?, before)
        });
    }

    let name = "JOB_NOTIFY on an id older than TDRV_JOB_WINDOW is ESTALE and queues nothing";
    if kind == TDRV_DEVICE_EDU {
        t.skip(
            name,
            "the window is engine-independent (run on the other devices): 4096 edu jobs take minutes",
        );
    } else {
        t.run(name, || -> R {
            let f = ok("open", Dev::open(&path))?;
            let d = pair(&f)?;
            let first = ok("submit", f.submit(&d))?;
            let mut last = first;
            for i in 0..TDRV_JOB_WINDOW as u64 {
                last = ok("submit", f.submit(&d))?;
                // Below file_max_jobs unfinished jobs.
                if i % 512 == 0 {
                    wait_done(&f, last)?;
                }
            }
            wait_done(&f, last)?;
            expect_eq("ids", last - first, TDRV_JOB_WINDOW as u64)?;
            expect_err("oldest id", f.job_notify(first, 1), libc::ESTALE)?;
            expect_eq(
                "readable after the refusal",
                ok("poll", poll_in(f.fd(), 0))?,
                false,
            )?;
            ok("notify the oldest kept id", f.job_notify(first + 1, 2))?;
            expect_event(&read_one(&f)?, first + 1, 2, 0)?;
            expect_err("never issued", f.job_notify(last + 1, 3), libc::EINVAL)
        });
    }

    t.run("a failed job's event carries its errno", || -> R {
        let (cmd, want) = failure_injection(kind == TDRV_DEVICE_EDU);
        let d = pair(&dev)?;
        all_jobs_ended(&path, HANG)?;
        inject(&path, cmd)?;
        let id = ok("submit", dev.submit(&d))?;
        ok("notify", dev.job_notify(id, 3))?;
        wait_readable(&dev)?;
        expect_event(&read_one(&dev)?, id, 3, -want)?;
        expect_eq(
            "job",
            ok("job_wait", dev.job_wait(id, 0))?,
            (TDRV_JOB_DONE, -want),
        )
    });

    t.run(
        "awaited handles own their file's events: a second reader is EventsBusy; a fork child awaits a job of the inherited file without its events",
        || -> R {
            let e = |what: &str, r: tdrv::Result<()>| r.map_err(|err| format!("{what}: {err}"));
            let d = tdrv::Device::open(&path).map_err(|err| format!("open: {err}"))?;
            let t = || {
                tdrv::Tensor::allocate_on(&d, 0, 4096, None).map_err(|err| format!("alloc: {err}"))
            };
            let (a, b, c) = (t()?, t()?, t()?);
            engine_ready(&dev)?;
            let hold = Hold::new(&path)?;
            let submit = |dst: &tdrv::Tensor| {
                let mut j = tdrv::Job::new();
                j.copy_all(&a, dst).map_err(|err| format!("copy: {err}"))?;
                j.submit().map_err(|err| format!("submit: {err}"))
            };
            // The parent awaits a held job: the reactor reads d's events.
            let h1 = submit(&b)?;
            let (tx, rx) = std::sync::mpsc::channel();
            let parent = thread::spawn(move || woken_wait(h1, || {
                let _ = tx.send(());
            }));
            rx.recv_timeout(HANG)
                .map_err(|_| "the parent's waiter never registered".to_string())?;
            let mut evs = Vec::new();
            match d.read_events(&mut evs) {
                Err(tdrv::Error::Sys(tdrv::SysError::EventsBusy { .. })) => {}
                r => return Err(format!("a second reader: {r:?}, want EventsBusy")),
            }
            let mut fds = [0; 2];
            // SAFETY: a fresh pipe.
            if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
                return Err(format!("pipe: errno {}", errno()));
            }
            let child = fork_child(|| {
                // A job of the file inherited from the parent, awaited.
                let Ok(h2) = submit(&c) else { return 2 };
                let r = woken_wait(h2, || {
                    // SAFETY: one byte from a local into our pipe.
                    unsafe { libc::write(fds[1], [1u8].as_ptr().cast(), 1) };
                });
                match r {
                    Ok(Ok(())) => {}
                    Err(_) => return 3,
                    Ok(Err(_)) => return 4,
                }
                let mut evs = Vec::new();
                match d.read_events(&mut evs) {
                    Err(tdrv::Error::Sys(tdrv::SysError::EventsBusy { .. })) => 0,
                    _ => 5,
                }
            })?;
            // SAFETY: our copy of the write end.
            unsafe { libc::close(fds[1]) };
            let mut byte = [0u8; 1];
            // SAFETY: reads one byte into a local; EOF if the child died.
            let n = unsafe { libc::read(fds[0], byte.as_mut_ptr().cast(), 1) };
            // SAFETY: our read end.
            unsafe { libc::close(fds[0]) };
            // Both jobs run once the engine goes on.
            drop(hold);
            let status = reap(child)?;
            expect_eq(
                "child (2: submit failed, 3: its await hung (or was ready while held), 4: its job failed, 5: it could read the parent's events)",
                tdrv_guest_tests::exit_code(status)?,
                0,
            )?;
            expect_eq("the child submitted", n, 1)?;
            let r = parent
                .join()
                .map_err(|_| "the parent's waiter panicked".to_string())??;
            e("the parent's await", r)
        },
    );

    t.run(
        "a failed job's awaited handle is JobFailed with its errno",
        || -> R {
            let (cmd, want) = failure_injection(kind == TDRV_DEVICE_EDU);
            let d = tdrv::Device::open(&path).map_err(|err| format!("open: {err}"))?;
            let a = tdrv::Tensor::allocate_on(&d, 0, 4096, None)
                .map_err(|err| format!("alloc: {err}"))?;
            let b = tdrv::Tensor::allocate_on(&d, 0, 4096, None)
                .map_err(|err| format!("alloc: {err}"))?;
            engine_ready(&dev)?;
            all_jobs_ended(&path, HANG)?;
            let mut j = tdrv::Job::new();
            j.copy_all(&a, &b).map_err(|err| format!("copy: {err}"))?;
            inject(&path, cmd)?;
            let h = j.submit().map_err(|err| format!("submit: {err}"))?;
            match block_on_all(vec![h])?.remove(0) {
                Err(tdrv::Error::JobFailed { errno, .. }) => expect_eq("errno", errno, want),
                other => Err(format!("awaited: {other:?}")),
            }
        },
    );

    // The programs after this one find the engine as it was.
    if let Err(e) = engine_ready(&dev) {
        t.note(format!("the engine did not take jobs again: {e}"));
    }
    t.finish();
}
