//! Documented errnos that no other program provokes: SUBMIT's
//! TDRV_MAX_JOB_BYTES limit, its EMFILE for the out-fence and its EFAULT
//! writing the result back (after which the job still runs); FENCE_WAIT's
//! and JOB_WAIT's ETIMEDOUT and EINTR on a job held by an unsignalled
//! in-fence, and the restart of an unbounded wait after an SA_RESTART
//! handler; negative timeouts other than -1 (they wait without limit);
//! COPY's EIO from a source a failed job left undefined; EXPORT's EINVAL
//! for each non-zero input field and its EMFILE.
//!
//! Waits are ordered by events (the waiting thread asleep in the call,
//! the handler having run), never by elapsed time.
//!
//! usage: errnos /dev/tdrvN

use std::{
    fs,
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, AtomicU32, Ordering::SeqCst},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use tdrv_guest_tests::{
    channel_usage, desc, expect_eq, expect_err, failure_injection, ok, open_device_or_skip,
    raw::{errno, page_size, Dev, Errno},
    sync::Timeline,
    wait_usage, HangGuard, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

/// Bound that only turns a hang into a failure.
const HANG: Duration = Duration::from_secs(60);

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

/// Two buffers of `size` bytes on channel 0, the source filled with a
/// pattern, the destination zero.
fn pair(dev: &Dev, size: u64, seed: u8) -> Result<(tdrv_alloc, tdrv_alloc, Vec<u8>), String> {
    let a = ok("alloc", dev.alloc(size, 0))?;
    let b = ok("alloc", dev.alloc(size, 0))?;
    let data = pattern(size as usize, seed);
    ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
    Ok((a, b, data))
}

fn contents(dev: &Dev, handle: u64, len: usize) -> Result<Vec<u8>, String> {
    let mut out = vec![0u8; len];
    ok("copy_out", dev.copy_out(handle, 0, &mut out))?;
    Ok(out)
}

/// (pending_reads, pending_writes, completion_count) of a buffer.
fn state(dev: &Dev, handle: u64) -> Result<(u64, u64, u64), String> {
    let i = ok("buf_info", dev.buf_info(handle))?;
    Ok((i.pending_reads, i.pending_writes, i.completion_count))
}

/// Open descriptors of this process.
fn open_fds() -> Result<usize, String> {
    Ok(fs::read_dir("/proc/self/fd")
        .map_err(|e| format!("/proc/self/fd: {e}"))?
        .count())
}

fn gettid() -> libc::pid_t {
    // SAFETY: gettid(2) has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// The scheduler state letter of thread `tid` of this process.
fn thread_state(tid: libc::pid_t) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    stat.rsplit(')')
        .next()?
        .split_whitespace()
        .next()?
        .chars()
        .next()
}

/// Waits until thread `tid` sleeps interruptibly ('S'). The caller knows
/// the only such sleep the thread can be in is the wait under test.
fn wait_asleep(tid: libc::pid_t, done: &AtomicBool) -> R {
    let start = Instant::now();
    loop {
        if done.load(SeqCst) {
            return Err("the wait returned before it was woken".into());
        }
        if thread_state(tid) == Some('S') {
            return Ok(());
        }
        if start.elapsed() > HANG {
            return Err(format!("thread {tid} never went to sleep in the wait"));
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// Runs `f` with no free descriptor: the soft RLIMIT_NOFILE lowered a
/// little above the open ones and the table filled up to it with dups.
/// The dups are closed and the limit restored before returning.
fn with_no_free_fd<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: out-pointer to a local rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) } != 0 {
        return Err(format!("getrlimit: errno {}", errno()));
    }
    let limit = (open_fds()? + 16) as u64;
    let low = libc::rlimit {
        rlim_cur: limit,
        rlim_max: old.rlim_max,
    };
    // SAFETY: a valid rlimit; only the soft limit is lowered.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) } != 0 {
        return Err(format!("setrlimit: errno {}", errno()));
    }
    // Fill the table up to the limit.
    let mut filler = Vec::new();
    loop {
        // SAFETY: dup of stdin; the copies are closed below.
        let fd = unsafe { libc::dup(0) };
        if fd < 0 {
            break;
        }
        filler.push(fd);
    }
    let filled = errno();
    let r = f();
    for fd in &filler {
        // SAFETY: our own dups.
        unsafe { libc::close(*fd) };
    }
    // SAFETY: restores the limits read above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) };
    expect_eq("dup stopped at", filled, libc::EMFILE)?;
    Ok(r)
}

static HANDLED: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_usr1(_: libc::c_int) {
    HANDLED.fetch_add(1, SeqCst);
}

/// Installs the SIGUSR1 handler, with or without SA_RESTART.
fn set_handler(restart: bool) {
    // SAFETY: the handler only touches an atomic.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as *const () as usize;
        sa.sa_flags = if restart { libc::SA_RESTART } else { 0 };
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
    }
}

fn tgkill(tid: libc::pid_t) -> R {
    // SAFETY: plain syscall with integer arguments, to a thread of ours.
    let r = unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, libc::SIGUSR1) };
    if r == 0 {
        Ok(())
    } else {
        Err(format!("tgkill: errno {}", errno()))
    }
}

/// A wait running in its own thread: its tid, whether it returned, and its
/// result once joined.
struct Waiter {
    tid: libc::pid_t,
    done: Arc<AtomicBool>,
    handle: thread::JoinHandle<Result<(), Errno>>,
}

impl Waiter {
    /// Starts `wait` in a new thread and returns once that thread is about
    /// to make the call.
    fn start(wait: impl FnOnce() -> Result<(), Errno> + Send + 'static) -> Waiter {
        let (tx, rx) = std::sync::mpsc::channel();
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let handle = thread::spawn(move || {
            tx.send(gettid()).unwrap();
            let r = wait();
            d.store(true, SeqCst);
            r
        });
        let tid = rx.recv().unwrap();
        Waiter { tid, done, handle }
    }

    /// Waits until the thread is asleep inside the call.
    fn asleep(&self) -> R {
        wait_asleep(self.tid, &self.done)
    }

    fn join(self) -> Result<Result<(), Errno>, String> {
        let _guard = HangGuard::arm("joining a waiting thread", HANG.as_secs());
        self.handle
            .join()
            .map_err(|_| "waiter panicked".to_string())
    }
}

/// A job copying `a` to `b` held by an unsignalled sw_sync fence: until
/// `release`, `b` has a pending write that cannot end.
struct Held {
    timeline: Timeline,
    job: u64,
}

impl Held {
    fn submit(dev: &Dev, a: &tdrv_alloc, b: &tdrv_alloc, size: u64) -> Result<Held, String> {
        let timeline = ok("sw_sync timeline", Timeline::new())?;
        let fence = ok("sw_sync fence", timeline.fence(1))?;
        let (job, out) = ok(
            "submit held by an in-fence",
            dev.submit_fences(
                &[desc(a.handle, 0, b.handle, 0, size)],
                &[fence.as_raw_fd()],
                false,
            ),
        )?;
        expect_eq("out_fence without the flag", out, -1)?;
        expect_eq("held job's write", state(dev, b.handle)?.1, 1)?;
        Ok(Held { timeline, job })
    }

    fn release(&self) -> R {
        ok("sw_sync inc", self.timeline.inc(1))
    }
}

fn inject(node: &str, cmd: &str) -> Result<bool, String> {
    let path = format!(
        "/sys/kernel/debug/tdrv/{}/inject",
        node.trim_start_matches("/dev/")
    );
    if !std::path::Path::new(&path).exists() {
        return Ok(false);
    }
    fs::write(&path, cmd).map_err(|e| format!("inject {cmd}: {e}"))?;
    Ok(true)
}

fn main() {
    let (dev, node, version) = open_device_or_skip("/dev/tdrv0", None);
    let edu = version.device_kind == TDRV_DEVICE_EDU;
    let fence_fds = version.features & u64::from(TDRV_FEAT_FENCE_FD) != 0;
    let held = fence_fds && Timeline::available();
    let no_fence_fd = "no TDRV_FEAT_FENCE_FD (kernel without CONFIG_SYNC_FILE)";
    let no_hold = if fence_fds {
        "no sw_sync timeline (CONFIG_SW_SYNC, debugfs) to hold a job"
    } else {
        no_fence_fd
    };
    let pg = page_size() as u64;
    let mut t = Tap::new(16);

    t.run(
        "SUBMIT moving more than TDRV_MAX_JOB_BYTES is EINVAL and queues nothing",
        || -> R {
            // 513 copies of 8 MiB: each descriptor and the count are valid,
            // only the sum (4 GiB + 8 MiB) is over.
            let size = 8u64 << 20;
            let a = ok("alloc", dev.alloc(size, 0))?;
            let b = ok("alloc", dev.alloc(size, 0))?;
            let n = (TDRV_MAX_JOB_BYTES / size + 1) as usize;
            if n > TDRV_MAX_JOB_DESCS as usize {
                return Err(format!("{n} descriptors needed"));
            }
            let descs = vec![desc(a.handle, 0, b.handle, 0, size); n];
            expect_err("submit", dev.submit(&descs), libc::EINVAL)?;
            expect_eq("source", state(&dev, a.handle)?, (0, 0, 0))?;
            expect_eq("destination", state(&dev, b.handle)?, (0, 0, 0))?;
            // A job is identified by the next id as if nothing happened.
            let id = ok("submit", dev.submit(&[desc(a.handle, 0, b.handle, 0, pg)]))?;
            expect_eq(
                "next job",
                ok("job_wait", dev.job_wait(id, -1))?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_eq("destination's completions", state(&dev, b.handle)?.2, 1)?;
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    if fence_fds {
        t.run(
            "SUBMIT with an out-fence and no free fd is EMFILE and queues nothing",
            || -> R {
                let (a, b, data) = pair(&dev, pg, 1)?;
                let d = [desc(a.handle, 0, b.handle, 0, pg)];
                let r = with_no_free_fd(|| dev.submit_fences(&d, &[], true))?;
                expect_err("submit", r, libc::EMFILE)?;
                // Had it been queued, it would have run by the time every
                // device access of the destination ended.
                ok("fence_wait", dev.fence_wait(b.handle, TDRV_FENCE_ALL, -1))?;
                expect_eq("destination", state(&dev, b.handle)?, (0, 0, 0))?;
                expect_eq("source", state(&dev, a.handle)?, (0, 0, 0))?;
                expect_eq(
                    "destination untouched",
                    contents(&dev, b.handle, pg as usize)?
                        .iter()
                        .all(|x| *x == 0),
                    true,
                )?;
                // With a free fd the same call works.
                let (id, fd) = ok("submit", dev.submit_fences(&d, &[], true))?;
                if fd < 0 {
                    return Err(format!("out_fence {fd}"));
                }
                // SAFETY: the driver installed this fd for us.
                unsafe { libc::close(fd) };
                expect_eq(
                    "job",
                    ok("job_wait", dev.job_wait(id, -1))?,
                    (TDRV_JOB_DONE, 0),
                )?;
                expect_eq(
                    "copied",
                    contents(&dev, b.handle, pg as usize)? == data,
                    true,
                )
            },
        );
    } else {
        t.skip(
            "SUBMIT with an out-fence and no free fd is EMFILE and queues nothing",
            no_fence_fd,
        );
    }

    // SUBMIT's argument in a read-only page: the driver reads it, queues
    // the job, and cannot write job_id back.
    let submit_read_only = |flags: u32, seed: u8| -> R {
        let (a, b, data) = pair(&dev, pg, seed)?;
        let d = [desc(a.handle, 0, b.handle, 0, pg)];
        let fds = open_fds()?;
        let len = page_size();
        // SAFETY: a fresh anonymous mapping; no Rust object lives there.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!("mmap: errno {}", errno()));
        }
        let arg = tdrv_submit {
            descs: d.as_ptr() as u64,
            desc_count: 1,
            desc_size: std::mem::size_of::<tdrv_copy_desc>() as u32,
            flags,
            ..Default::default()
        };
        // SAFETY: the page is writable and large enough; then it is made
        // read-only, and the ioctl may only fail to write it.
        let r = unsafe {
            std::ptr::write(p.cast::<tdrv_submit>(), arg);
            libc::mprotect(p, len, libc::PROT_READ);
            dev.ioctl_addr(TDRV_IOC_SUBMIT, p as usize)
        };
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, len) };
        expect_err("submit", r, libc::EFAULT)?;
        expect_eq("fds after the call", open_fds()?, fds)?;
        // The job was queued: it runs and completes.
        let count = dev
            .completion_wait(b.handle, 1, -1)
            .map_err(|(e, c)| format!("completion_wait: errno {e}, count {c}"))?;
        expect_eq("destination's completions", count, 1)?;
        expect_eq(
            "copied",
            contents(&dev, b.handle, pg as usize)? == data,
            true,
        )?;
        ok("fence_wait", dev.fence_wait(a.handle, TDRV_FENCE_ALL, -1))?;
        expect_eq("source after the job", state(&dev, a.handle)?, (0, 0, 0))
    };
    t.run(
        "SUBMIT that cannot write its result back is EFAULT, and the job still runs",
        || submit_read_only(0, 2),
    );
    if fence_fds {
        t.run(
            "SUBMIT with an out-fence that cannot write back is EFAULT, installs no fd, runs the job",
            || submit_read_only(TDRV_SUBMIT_OUT_FENCE, 3),
        );
    } else {
        t.skip(
            "SUBMIT with an out-fence that cannot write back is EFAULT, installs no fd, runs the job",
            no_fence_fd,
        );
    }

    // The waits below need a job that cannot end until the test says so.
    let held_test = |t: &mut Tap, name: &str, body: &dyn Fn() -> R| {
        if held {
            t.run(name, body);
        } else {
            t.skip(name, no_hold);
        }
    };

    held_test(
        &mut t,
        "FENCE_WAIT on a write that does not end is ETIMEDOUT (timed and poll), then succeeds",
        &|| -> R {
            let (a, b, data) = pair(&dev, pg, 4)?;
            let h = Held::submit(&dev, &a, &b, pg)?;
            expect_err(
                "1 ms wait",
                dev.fence_wait(b.handle, TDRV_FENCE_WRITES, 1000),
                libc::ETIMEDOUT,
            )?;
            expect_err(
                "poll",
                dev.fence_wait(b.handle, TDRV_FENCE_ALL, 0),
                libc::ETIMEDOUT,
            )?;
            expect_err(
                "source's reads",
                dev.fence_wait(a.handle, TDRV_FENCE_READS, 1000),
                libc::ETIMEDOUT,
            )?;
            // The source has no pending write: that wait is satisfied.
            ok(
                "source's writes",
                dev.fence_wait(a.handle, TDRV_FENCE_WRITES, 1000),
            )?;
            expect_eq("job still pending", state(&dev, b.handle)?.1, 1)?;
            h.release()?;
            ok("fence_wait", dev.fence_wait(b.handle, TDRV_FENCE_ALL, -1))?;
            expect_eq(
                "job",
                ok("job_wait", dev.job_wait(h.job, -1))?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_eq(
                "copied",
                contents(&dev, b.handle, pg as usize)? == data,
                true,
            )
        },
    );

    // One wait interrupted by SIGUSR1 while asleep in the call.
    let interrupted = |restart: bool, timeout_us: i64, seed: u8| -> R {
        // A file of its own, shared with the waiting thread.
        let dev = Arc::new(ok("open", Dev::open(&node))?);
        let (a, b, data) = pair(&dev, pg, seed)?;
        let h = Held::submit(&dev, &a, &b, pg)?;
        set_handler(restart);
        let before = HANDLED.load(SeqCst);
        let d = dev.clone();
        let hb = b.handle;
        let w = Waiter::start(move || d.fence_wait(hb, TDRV_FENCE_WRITES, timeout_us));
        w.asleep()?;
        tgkill(w.tid)?;
        let r = w.join()?;
        expect_eq("handler ran", HANDLED.load(SeqCst) - before, 1)?;
        expect_err("fence_wait", r, libc::EINTR)?;
        expect_eq("job still pending", state(&dev, b.handle)?.1, 1)?;
        h.release()?;
        ok("fence_wait", dev.fence_wait(b.handle, TDRV_FENCE_ALL, -1))?;
        expect_eq(
            "copied",
            contents(&dev, b.handle, pg as usize)? == data,
            true,
        )
    };
    held_test(
        &mut t,
        "FENCE_WAIT without a limit, interrupted by a handler without SA_RESTART, is EINTR",
        &|| interrupted(false, -1, 5),
    );
    held_test(
        &mut t,
        "a timed FENCE_WAIT interrupted by a signal is EINTR even with SA_RESTART",
        &|| interrupted(true, 60_000_000, 6),
    );

    held_test(
        &mut t,
        "FENCE_WAIT without a limit restarts after an SA_RESTART handler and ends with the job",
        &|| -> R {
            let dev = Arc::new(ok("open", Dev::open(&node))?);
            let (a, b, data) = pair(&dev, pg, 7)?;
            let h = Held::submit(&dev, &a, &b, pg)?;
            set_handler(true);
            let before = HANDLED.load(SeqCst);
            let d = dev.clone();
            let hb = b.handle;
            let w = Waiter::start(move || d.fence_wait(hb, TDRV_FENCE_WRITES, -1));
            w.asleep()?;
            tgkill(w.tid)?;
            // The handler runs, then the call goes back to sleep.
            let start = Instant::now();
            while HANDLED.load(SeqCst) == before {
                if start.elapsed() > HANG {
                    return Err("the handler never ran".into());
                }
                thread::sleep(Duration::from_millis(1));
            }
            w.asleep()?;
            h.release()?;
            let r = w.join()?;
            expect_eq("handler ran", HANDLED.load(SeqCst) - before, 1)?;
            expect_eq("fence_wait", r, Ok(()))?;
            expect_eq(
                "copied",
                contents(&dev, b.handle, pg as usize)? == data,
                true,
            )
        },
    );

    held_test(
        &mut t,
        "JOB_WAIT on a held job: a timed wait is ETIMEDOUT, a poll PENDING; released, it is DONE",
        &|| -> R {
            let (a, b, data) = pair(&dev, pg, 11)?;
            let h = Held::submit(&dev, &a, &b, pg)?;
            // The short timeout is the outcome under test: the job cannot
            // end before the release below.
            expect_err("1 ms wait", dev.job_wait(h.job, 1000), libc::ETIMEDOUT)?;
            expect_eq(
                "poll",
                ok("poll", dev.job_wait(h.job, 0))?,
                (TDRV_JOB_PENDING, 0),
            )?;
            h.release()?;
            expect_eq(
                "wait after the release",
                ok("job_wait", dev.job_wait(h.job, HANG.as_micros() as i64))?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_eq(
                "copied",
                contents(&dev, b.handle, pg as usize)? == data,
                true,
            )
        },
    );

    // One JOB_WAIT interrupted by SIGUSR1 while asleep in the call.
    let job_interrupted = |restart: bool, timeout_us: i64, seed: u8| -> R {
        let dev = Arc::new(ok("open", Dev::open(&node))?);
        let (a, b, data) = pair(&dev, pg, seed)?;
        let h = Held::submit(&dev, &a, &b, pg)?;
        set_handler(restart);
        let before = HANDLED.load(SeqCst);
        let d = dev.clone();
        let job = h.job;
        // -1: the wait returned a state instead of an error.
        let w = Waiter::start(move || d.job_wait(job, timeout_us).and(Err(-1)));
        w.asleep()?;
        tgkill(w.tid)?;
        let r = w.join()?;
        expect_eq("handler ran", HANDLED.load(SeqCst) - before, 1)?;
        expect_err("job_wait", r, libc::EINTR)?;
        expect_eq(
            "job still pending",
            ok("poll", dev.job_wait(job, 0))?,
            (TDRV_JOB_PENDING, 0),
        )?;
        h.release()?;
        expect_eq(
            "job after the release",
            ok("job_wait", dev.job_wait(job, HANG.as_micros() as i64))?,
            (TDRV_JOB_DONE, 0),
        )?;
        expect_eq(
            "copied",
            contents(&dev, b.handle, pg as usize)? == data,
            true,
        )
    };
    held_test(
        &mut t,
        "JOB_WAIT without a limit, interrupted by a handler without SA_RESTART, is EINTR",
        &|| job_interrupted(false, -1, 12),
    );
    held_test(
        &mut t,
        "a timed JOB_WAIT interrupted by a signal is EINTR even with SA_RESTART",
        &|| job_interrupted(true, HANG.as_micros() as i64, 13),
    );

    held_test(
        &mut t,
        "JOB_WAIT without a limit restarts after an SA_RESTART handler and ends with the job",
        &|| -> R {
            let dev = Arc::new(ok("open", Dev::open(&node))?);
            let (a, b, data) = pair(&dev, pg, 14)?;
            let h = Held::submit(&dev, &a, &b, pg)?;
            set_handler(true);
            let before = HANDLED.load(SeqCst);
            let d = dev.clone();
            let job = h.job;
            // -1: the wait ended with another state or status.
            let w = Waiter::start(move || {
                d.job_wait(job, -1).and_then(|s| {
                    if s == (TDRV_JOB_DONE, 0) {
                        Ok(())
                    } else {
                        Err(-1)
                    }
                })
            });
            w.asleep()?;
            tgkill(w.tid)?;
            // The handler runs, then the call goes back to sleep.
            let start = Instant::now();
            while HANDLED.load(SeqCst) == before {
                if start.elapsed() > HANG {
                    return Err("the handler never ran".into());
                }
                thread::sleep(Duration::from_millis(1));
            }
            w.asleep()?;
            expect_eq(
                "job still pending after the handler",
                ok("poll", dev.job_wait(job, 0))?,
                (TDRV_JOB_PENDING, 0),
            )?;
            h.release()?;
            let r = w.join()?;
            expect_eq("handler ran", HANDLED.load(SeqCst) - before, 1)?;
            expect_eq("restarted job_wait", r, Ok(()))?;
            expect_eq(
                "copied",
                contents(&dev, b.handle, pg as usize)? == data,
                true,
            )
        },
    );

    held_test(
        &mut t,
        "negative timeouts other than -1 wait without limit (FENCE_WAIT, JOB_WAIT, COMPLETION_WAIT)",
        &|| -> R {
            let dev = Arc::new(ok("open", Dev::open(&node))?);
            let (a, b, data) = pair(&dev, pg, 8)?;
            let h = Held::submit(&dev, &a, &b, pg)?;
            let (job, hb) = (h.job, b.handle);
            let (d1, d2, d3) = (dev.clone(), dev.clone(), dev.clone());
            let waiters = [
                (
                    "FENCE_WAIT with -2",
                    Waiter::start(move || d1.fence_wait(hb, TDRV_FENCE_ALL, -2)),
                ),
                (
                    "COMPLETION_WAIT with i64::MIN",
                    Waiter::start(move || {
                        d2.completion_wait(hb, 1, i64::MIN)
                            .map_err(|(e, _)| e)
                            .and_then(|c| if c == 1 { Ok(()) } else { Err(-1) })
                    }),
                ),
                (
                    "JOB_WAIT with -1000000",
                    Waiter::start(move || {
                        d3.job_wait(job, -1_000_000).and_then(|s| {
                            if s == (TDRV_JOB_DONE, 0) {
                                Ok(())
                            } else {
                                Err(-1)
                            }
                        })
                    }),
                ),
            ];
            // All three sleep (a poll would have returned) until the job
            // can run.
            for (_, w) in &waiters {
                w.asleep()?;
            }
            h.release()?;
            for (what, w) in waiters {
                // -1: the wait succeeded with the wrong count or status.
                expect_eq(what, w.join()?, Ok(()))?;
            }
            expect_eq("copied", contents(&dev, hb, pg as usize)? == data, true)
        },
    );

    t.run(
        "COPY from a buffer a failed job left undefined is EIO and leaves the destination",
        || -> R {
            let (cmd, want) = failure_injection(edu);
            let (a, b, _) = pair(&dev, pg, 9)?;
            let (c, _, data_c) = pair(&dev, pg, 10)?;
            if !inject(&node, cmd)? {
                return Err("no debugfs inject file".into());
            }
            let id = ok("submit", dev.submit(&[desc(a.handle, 0, b.handle, 0, pg)]))?;
            expect_eq(
                "failed job",
                ok("job_wait", dev.job_wait(id, -1))?,
                (TDRV_JOB_DONE, -want),
            )?;
            // Waiters learn that the bytes are undefined (edu: once the
            // device let go of the buffer).
            expect_err(
                "fence_wait on the failed output",
                dev.fence_wait(b.handle, TDRV_FENCE_ALL, -1),
                libc::EIO,
            )?;
            expect_eq(
                "latch",
                ok("buf_info", dev.buf_info(b.handle))?.error,
                -want,
            )?;
            expect_err(
                "copy from the failed buffer",
                dev.copy(desc(b.handle, 0, c.handle, 0, pg)),
                libc::EIO,
            )?;
            let info = ok("buf_info", dev.buf_info(c.handle))?;
            expect_eq("destination's latch", info.error, 0)?;
            expect_eq("destination's completions", info.completion_count, 0)?;
            expect_eq(
                "destination kept its bytes",
                contents(&dev, c.handle, pg as usize)? == data_c,
                true,
            )?;
            // Once the latch is cleared, the same COPY works.
            ok("completion_reset", dev.completion_reset(b.handle))?;
            ok("copy", dev.copy(desc(b.handle, 0, c.handle, 0, pg)))
        },
    );

    t.run(
        "EXPORT with flags, fd, pad, pad2 or a reserved word non-zero is EINVAL and makes no fd",
        || -> R {
            let a = ok("alloc", dev.alloc(pg, 0))?;
            let fds = open_fds()?;
            let base = tdrv_export {
                handle: a.handle,
                ..Default::default()
            };
            let cases = [
                ("flags", tdrv_export { flags: 1, ..base }),
                ("fd", tdrv_export { fd: 3, ..base }),
                ("fd -1", tdrv_export { fd: -1, ..base }),
                ("pad", tdrv_export { pad: 1, ..base }),
                (
                    "pad2",
                    tdrv_export {
                        pad2: 1 << 31,
                        ..base
                    },
                ),
                (
                    "reserved[0]",
                    tdrv_export {
                        reserved: [1, 0],
                        ..base
                    },
                ),
                (
                    "reserved[1]",
                    tdrv_export {
                        reserved: [0, 1 << 63],
                        ..base
                    },
                ),
            ];
            for (what, mut e) in cases {
                expect_err(what, dev.ioctl(TDRV_IOC_EXPORT, &mut e), libc::EINVAL)?;
            }
            expect_eq("fds after the refused exports", open_fds()?, fds)?;
            let fd = ok("export", dev.export(a.handle))?;
            expect_eq("fds after an export", open_fds()?, fds + 1)?;
            drop(fd);
            ok("free", dev.free(a.handle))
        },
    );

    t.run(
        "EXPORT with no free fd is EMFILE and leaves no dma-buf behind",
        || -> R {
            let base = channel_usage(&dev, 1)?;
            let a = ok("alloc", dev.alloc(pg, 0))?;
            let fds = open_fds()?;
            let r = with_no_free_fd(|| dev.export(a.handle))?;
            expect_err("export", r.map(drop), libc::EMFILE)?;
            expect_eq("fds after the refused export", open_fds()?, fds)?;
            // A dma-buf made and then lost would keep the buffer charged
            // to its channel after FREE (struct tdrv_export).
            ok("free", dev.free(a.handle))?;
            wait_usage(&dev, &base, HANG)?;
            // With a free fd the same call works.
            let b = ok("alloc", dev.alloc(pg, 0))?;
            let fd = ok("export", dev.export(b.handle))?;
            expect_eq("fds after an export", open_fds()?, fds + 1)?;
            drop(fd);
            ok("free", dev.free(b.handle))
        },
    );

    t.finish()
}
