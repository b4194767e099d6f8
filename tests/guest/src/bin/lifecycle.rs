//! Lifecycle and limits of the module (issue 10): module pinning, job
//! cancellation on close and SIGKILL, honest accounting, per-file caps
//! (exact under concurrent submitters), the job status window, SA_RESTART,
//! exec-free mappings, CAP_SYS_RAWIO and the exclusion of synchronous copies
//! and jobs. Where jobs must stay queued, the engine holds them (debugfs
//! `inject`: `hold_job`, `release`) rather than racing a long job.
//!
//! usage: lifecycle /dev/tdrvN

use std::{
    fs,
    os::fd::AsRawFd,
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    thread,
    time::{Duration, Instant},
};

use tdrv_guest_tests::{
    all_jobs_ended, desc, expect_eq, expect_err,
    inject::inject_file,
    ok, open_device_or_skip,
    raw::{page_size, Dev},
    stat,
    sync::Timeline,
    wait::{until, until_asleep_in, HANG},
    Hold, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

/// The module's reference count, as sysfs shows it.
fn module_refcnt() -> Result<u64, String> {
    let text = fs::read_to_string("/sys/module/tdrv/refcnt").map_err(|e| e.to_string())?;
    text.trim()
        .parse()
        .map_err(|e| format!("refcnt {text:?}: {e}"))
}

/// `delete_module("tdrv", O_NONBLOCK)`: what `rmmod` does.
fn try_unload() -> Result<(), i32> {
    // SAFETY: a NUL-terminated name and flags; no memory is passed back.
    let r = unsafe { libc::syscall(libc::SYS_delete_module, c"tdrv".as_ptr(), libc::O_NONBLOCK) };
    if r == 0 {
        Ok(())
    } else {
        Err(tdrv_guest_tests::raw::errno())
    }
}

/// Polls channel 0's usage until it is back to `base` bytes and buffers,
/// returning how long that took, or an error after `limit`.
fn wait_usage(dev: &Dev, base: &tdrv_channel_info, limit: Duration) -> Result<Duration, String> {
    let t0 = Instant::now();
    loop {
        let c = ok("channel_info", dev.channel_info(0))?;
        if (c.used_bytes, c.buffers) == (base.used_bytes, base.buffers) {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > limit {
            return Err(format!(
                "channel 0 still holds {} bytes in {} buffers after {limit:?} (start: {} in {})",
                c.used_bytes, c.buffers, base.used_bytes, base.buffers
            ));
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// Fills one file with a long queue: `jobs` jobs each copying `size`
/// bytes between two fresh buffers of channel 0. Returns the job ids.
fn queue_jobs(dev: &Dev, size: u64, jobs: usize, stall: Option<&str>) -> Result<Vec<u64>, String> {
    let a = ok("alloc", dev.alloc(size, 0))?;
    let b = ok("alloc", dev.alloc(size, 0))?;
    if let Some(path) = stall {
        stall_next(path)?;
    }
    (0..jobs)
        .map(|_| {
            ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, size)]),
            )
        })
        .collect()
}

mod sig {
    //! Signal handling for the SA_RESTART test.
    use std::sync::atomic::{AtomicUsize, Ordering};

    pub static HITS: AtomicUsize = AtomicUsize::new(0);

    pub extern "C" fn on_signal(_: libc::c_int) {
        HITS.fetch_add(1, Ordering::SeqCst);
    }

    /// Installs `on_signal` for SIGUSR1, with or without SA_RESTART.
    pub fn install(restart: bool) {
        // SAFETY: a zeroed sigaction is valid; the handler only touches an
        // atomic, which is async-signal-safe.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = if restart { libc::SA_RESTART } else { 0 };
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
        }
    }
}

fn main() {
    let (dev, path, version) = open_device_or_skip("/dev/tdrv0", None);
    let edu = version.device_kind == TDRV_DEVICE_EDU;
    // The sim device's DMA runs in host threads, faster than any job the
    // tests can queue: where a test needs a busy engine, its queues are
    // stalled (fault injection) until the watchdog resets them.
    let sim = version.device_kind == TDRV_DEVICE_SIM;
    let page = page_size() as u64;
    // Where a test needs jobs to stay queued, the engine holds them (debugfs
    // `inject` hold_job) however fast the device and however slow the
    // guest: every device and kernel has it, where debugfs is mounted.
    let hold_reason = Hold::unavailable(&path);
    let mut t = Tap::new(19);

    t.run(
        "an open file or a mapping pins the module (rmmod fails)",
        || -> R {
            let base = module_refcnt()?;
            let extra = ok("open", Dev::open(&path))?;
            expect_eq("refcnt with one more file", module_refcnt()?, base + 1)?;
            expect_err("unload with a file open", try_unload(), libc::EWOULDBLOCK)?;
            let a = ok("alloc", extra.alloc(page, 0))?;
            let mut map = ok("mmap", extra.map(&a))?;
            drop(extra);
            // The mapping keeps its file (and so the module).
            expect_eq("refcnt with a mapping only", module_refcnt()?, base + 1)?;
            expect_err("unload with a mapping", try_unload(), libc::EWOULDBLOCK)?;
            map.as_mut_slice()[0] = 7;
            expect_eq("mapping still works", map.as_slice()[0], 7)?;
            drop(map);
            expect_eq("refcnt after munmap", module_refcnt()?, base)
        },
    );

    t.run(
        "the dispatch and engine queues have rescuer threads (WQ_MEM_RECLAIM)",
        || -> R {
            // Work that signals out-fences must run under memory pressure
            // without a new kworker: a queue with WQ_MEM_RECLAIM has a
            // rescuer, which /proc shows as kworker/R-<queue>.
            let mut names = vec![];
            for e in fs::read_dir("/proc").map_err(|e| format!("/proc: {e}"))? {
                let e = e.map_err(|e| format!("/proc: {e}"))?;
                // Tasks may end while we look.
                if let Ok(c) = fs::read_to_string(e.path().join("comm")) {
                    names.push(c.trim().to_string());
                }
            }
            for q in ["tdrv-dispatch", "tdrv-engine"] {
                let want = format!("kworker/R-{q}");
                if !names.contains(&want) {
                    return Err(format!("no {want} thread among {} tasks", names.len()));
                }
            }
            Ok(())
        },
    );

    t.run(
        "closing a file cancels its queued jobs and frees its memory",
        || -> R {
            let base = ok("channel_info", dev.channel_info(0))?;
            let cancelled = stat(&path, "jobs_cancelled")?;
            let victim = ok("open", Dev::open(&path))?;
            // Soft: 32 x 4 MiB; edu: 4 x 64 KiB (a chunk is ~200 ms there).
            let (size, jobs) = if edu { (64 << 10, 4) } else { (4 << 20, 32) };
            // Held by the engine, so that all are still queued at close.
            // Without debugfs, sim: the jobs' queue is stalled (all 32 go to
            // one queue: they write the same buffer); the running ones end
            // at the watchdog's reset (sim_timeout_ms).
            let hold = match hold_reason {
                None => Some(Hold::new(&path)?),
                Some(_) => None,
            };
            let stall = (sim && hold.is_none()).then_some(path.as_str());
            let ids = queue_jobs(&victim, size, jobs, stall)?;
            drop(victim);
            // Every job, the held one too, was cancelled: nothing to release.
            let all = hold.is_some();
            drop(hold);
            // Cancelled jobs are the proof that nothing ran to completion;
            // the wait for the memory only bounds a hang.
            let took = wait_usage(&dev, &base, HANG)?;
            let now = stat(&path, "jobs_cancelled")?;
            let want = if all { ids.len() } else { ids.len() / 2 } as u64;
            if now < cancelled + want {
                return Err(format!(
                    "only {} of {} jobs cancelled",
                    now - cancelled,
                    ids.len()
                ));
            }
            println!(
                "# memory back {took:?} after close, {} jobs cancelled",
                now - cancelled
            );
            Ok(())
        },
    );

    t.run(
        "a SIGKILLed process's jobs are cancelled and its memory freed",
        || -> R {
            let base = ok("channel_info", dev.channel_info(0))?;
            let cancelled = stat(&path, "jobs_cancelled")?;
            let (size, jobs) = if edu { (64 << 10, 8) } else { (2 << 20, 64) };
            // Held by the engine (where debugfs has the knob), so that every
            // job is still queued at the kill and must be cancelled.
            let hold = match hold_reason {
                None => Some(Hold::new(&path)?),
                Some(_) => None,
            };
            let mut fds = [0; 2];
            // SAFETY: `fds` has room for two descriptors.
            if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
                return Err("pipe".into());
            }
            // SAFETY: the child only makes syscalls and exits without unwinding.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let run = || -> Result<(), String> {
                    let d = ok("open", Dev::open(&path))?;
                    queue_jobs(&d, size, jobs, None)?;
                    // SAFETY: writes one byte from a live buffer.
                    unsafe { libc::write(fds[1], [1u8].as_ptr().cast(), 1) };
                    loop {
                        thread::sleep(Duration::from_secs(10));
                    }
                };
                let _ = run();
                // SAFETY: leaves the child without running the parent's cleanup.
                unsafe { libc::_exit(1) };
            }
            let mut byte = [0u8];
            // SAFETY: reads one byte into a live buffer.
            let n = unsafe { libc::read(fds[0], byte.as_mut_ptr().cast(), 1) };
            // SAFETY: `pid` is our child; the fds are ours.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
                libc::close(fds[0]);
                libc::close(fds[1]);
            }
            let held = hold.is_some();
            drop(hold);
            if n != 1 {
                return Err("child failed to queue its jobs".into());
            }
            let took = wait_usage(&dev, &base, HANG)?;
            let now = stat(&path, "jobs_cancelled")?;
            println!(
                "# memory back {took:?} after SIGKILL, {} jobs cancelled",
                now - cancelled
            );
            if held {
                expect_eq("jobs cancelled", now - cancelled, jobs as u64)?;
            }
            Ok(())
        },
    );

    t.run(
        "buffers are charged page-rounded; tiny buffers cannot bypass the limit",
        || -> R {
            let d = ok("open", Dev::open(&path))?;
            let base = ok("channel_info", d.channel_info(0))?;
            let a = ok("alloc 1 byte", d.alloc(1, 0))?;
            let c = ok("channel_info", d.channel_info(0))?;
            expect_eq("charge of 1 byte", c.used_bytes - base.used_bytes, page)?;
            ok("free", d.free(a.handle))?;
            let room = (base.limit_bytes - base.used_bytes) / page;
            let mut n = 0u64;
            let err = loop {
                match d.alloc(1, 0) {
                    Ok(_) => n += 1,
                    Err(e) => break e,
                }
                if n > 40_000 {
                    return Err("40,000 one-byte buffers fitted in the channel".into());
                }
            };
            expect_eq("errno at the limit", err, libc::ENOSPC)?;
            if n > room {
                return Err(format!(
                    "{n} one-byte buffers fitted, room for {room} pages"
                ));
            }
            let full = ok("channel_info", d.channel_info(0))?;
            if full.used_bytes > full.limit_bytes {
                return Err(format!(
                    "used {} over limit {}",
                    full.used_bytes, full.limit_bytes
                ));
            }
            drop(d);
            wait_usage(&dev, &base, HANG).map(drop)
        },
    );

    let name = "the per-file job cap answers EAGAIN and nothing is lost";
    if let Some(why) = &hold_reason {
        t.skip(name, why);
    } else {
        t.run(name, || -> R {
            let d = ok("open", Dev::open(&path))?;
            let a = ok("alloc", d.alloc(page, 0))?;
            let b = ok("alloc", d.alloc(page, 0))?;
            let c = ok("alloc", d.alloc(page, 0))?;
            let data: Vec<u8> = (0..page).map(|i| (i * 7 + 1) as u8).collect();
            ok("copy_in", d.copy_in(a.handle, 0, &data))?;
            let hold = Hold::new(&path)?;
            let mut ids = Vec::new();
            let err = loop {
                match d.submit(&[desc(a.handle, 0, b.handle, 0, page)]) {
                    Ok(id) => ids.push(id),
                    Err(e) => break e,
                }
                if ids.len() > 5000 {
                    return Err("5000 jobs queued without EAGAIN".into());
                }
            };
            expect_eq("errno at the cap", err, libc::EAGAIN)?;
            expect_eq("jobs queued at the cap (file_max_jobs)", ids.len(), 1024)?;
            expect_err(
                "a job to another buffer at the cap",
                d.submit(&[desc(a.handle, 0, c.handle, 0, page)]),
                libc::EAGAIN,
            )?;
            expect_eq(
                "the first job while the engine holds it",
                ok("poll", d.job_wait(ids[0], 0))?,
                (TDRV_JOB_PENDING, 0),
            )?;
            drop(hold);
            // Every accepted job runs and succeeds. The edu device takes
            // ~0.2 s of its clock per job: there, the first few, then the
            // rest are cancelled by the close.
            let check = if edu { &ids[..4] } else { &ids[..] };
            for &id in check {
                let r = ok("wait", d.job_wait(id, 60_000_000))?;
                expect_eq(&format!("job {id}"), r, (TDRV_JOB_DONE, 0))?;
            }
            if !edu {
                let count = d.completion_wait(b.handle, 1024, 0).map_err(|(e, n)| {
                    format!("completion count of the destination: errno {e}, count {n}")
                })?;
                expect_eq("completions of the destination", count, 1024)?;
                let mut out = vec![0u8; page as usize];
                ok("copy_out", d.copy_out(b.handle, 0, &mut out))?;
                expect_eq("destination holds the source", out == data, true)?;
            }
            // The refused job left no trace, and the file submits again.
            let mut out = vec![1u8; page as usize];
            ok("copy_out", d.copy_out(c.handle, 0, &mut out))?;
            expect_eq(
                "the refused job's destination is untouched",
                out.iter().all(|&x| x == 0),
                true,
            )?;
            let count = d
                .completion_wait(c.handle, 0, 0)
                .map_err(|(e, _)| format!("count: {e}"))?;
            expect_eq("completions of the refused job's destination", count, 0)?;
            let id = ok(
                "submit after the queue drained",
                d.submit(&[desc(a.handle, 0, c.handle, 0, 8)]),
            )?;
            if !edu {
                expect_eq(
                    "that job",
                    ok("wait", d.job_wait(id, 60_000_000))?,
                    (TDRV_JOB_DONE, 0),
                )?;
            }
            Ok(())
        });
    }

    let name = "the job cap holds with four threads submitting on one file";
    if let Some(why) = &hold_reason {
        t.skip(name, why);
    } else {
        t.run(name, || -> R {
            // Four rounds: the threads reach the cap together each time.
            for round in 1..=4 {
                let d = ok("open", Dev::open(&path))?;
                let a = ok("alloc", d.alloc(page, 0))?;
                let b = ok("alloc", d.alloc(page, 0))?;
                let hold = Hold::new(&path)?;
                let go = AtomicBool::new(false);
                let results: Vec<Result<(usize, i32), String>> = thread::scope(|s| {
                    let workers: Vec<_> = (0..4)
                        .map(|_| {
                            s.spawn(|| {
                                // Yielding, not a PAUSE spin (see
                                // `buffers`: under -icount each PAUSE
                                // hands the other vCPU a time slice).
                                while !go.load(Ordering::Acquire) {
                                    std::thread::yield_now();
                                }
                                let mut n = 0;
                                loop {
                                    match d.submit(&[desc(a.handle, 0, b.handle, 0, 8)]) {
                                        Ok(_) => n += 1,
                                        Err(e) => return (n, e),
                                    }
                                }
                            })
                        })
                        .collect();
                    go.store(true, Ordering::Release);
                    workers
                        .into_iter()
                        .map(|w| w.join().map_err(|_| "submitter panicked".to_string()))
                        .collect()
                });
                let mut total = 0;
                for r in results {
                    let (n, e) = r?;
                    expect_eq("errno that stopped a submitter", e, libc::EAGAIN)?;
                    total += n;
                }
                expect_eq(
                    &format!("round {round}: jobs accepted from four threads (file_max_jobs)"),
                    total,
                    1024,
                )?;
                expect_eq("tdrv-jobs-queued", fdinfo_jobs(&d)?, 1024)?;
                // Closed while held: every job ends at once (cancelled),
                // the held one too, which ends the hold.
                drop(d);
                drop(hold);
            }
            Ok(())
        });
    }

    let name = "a held job ends when its file closes, and the engine serves the others";
    if let Some(why) = &hold_reason {
        t.skip(name, why);
    } else {
        t.run(name, || -> R {
            // A job of an earlier test may still be ending (a running edu
            // job stops at its next chunk).
            all_jobs_ended(&path, HANG)?;
            let base = ok("channel_info", dev.channel_info(0))?;
            let cancelled = stat(&path, "jobs_cancelled")?;
            let f1 = ok("open", Dev::open(&path))?;
            let f2 = ok("open", Dev::open(&path))?;
            let (a1, b1) = (
                ok("alloc", f1.alloc(page, 0))?,
                ok("alloc", f1.alloc(page, 0))?,
            );
            let (a2, b2) = (
                ok("alloc", f2.alloc(page, 0))?,
                ok("alloc", f2.alloc(page, 0))?,
            );
            let hold = Hold::new(&path)?;
            expect_err(
                "hold_job while one is armed",
                inject(&path, "hold_job"),
                libc::EBUSY,
            )?;
            // On an idle engine: the software device would run it in
            // SUBMIT, were it not held.
            let held = ok("submit", f1.submit(&[desc(a1.handle, 0, b1.handle, 0, 8)]))?;
            let other = ok("submit", f2.submit(&[desc(a2.handle, 0, b2.handle, 0, 8)]))?;
            thread::sleep(Duration::from_millis(50));
            expect_eq(
                "held job",
                ok("poll", f1.job_wait(held, 0))?,
                (TDRV_JOB_PENDING, 0),
            )?;
            expect_eq(
                "job behind it",
                ok("poll", f2.job_wait(other, 0))?,
                (TDRV_JOB_PENDING, 0),
            )?;
            expect_err(
                "hold_job while one is held",
                inject(&path, "hold_job"),
                libc::EBUSY,
            )?;
            drop(f1);
            // No release: the close ended the hold.
            expect_eq(
                "the other file's job",
                ok("wait", f2.job_wait(other, 60_000_000))?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_eq(
                "jobs cancelled",
                stat(&path, "jobs_cancelled")?,
                cancelled + 1,
            )?;
            // The hold is over: a new one can be armed.
            std::mem::forget(hold);
            let hold = Hold::new(&path)?;
            drop(hold);
            drop(f2);
            wait_usage(&dev, &base, HANG).map(drop)
        });
    }

    let name = "the job cap counts jobs held for in-fences";
    if !Timeline::available() {
        t.skip(name, "no sw_sync (CONFIG_SW_SYNC and debugfs)");
    } else {
        t.run(name, || -> R {
            // A first job gated on a sw_sync fence holds every later job of
            // the file in the file, not in the engine.
            let d = ok("open", Dev::open(&path))?;
            let a = ok("alloc", d.alloc(page, 0))?;
            let b = ok("alloc", d.alloc(page, 0))?;
            let tl = ok("sw_sync timeline", Timeline::new())?;
            let fence = ok("sw_sync fence", tl.fence(1))?;
            ok(
                "submit gated job",
                d.submit_fences(
                    &[desc(a.handle, 0, b.handle, 0, 8)],
                    &[fence.as_raw_fd()],
                    false,
                ),
            )?;
            let mut queued = 1; // the gated job
            let err = loop {
                match d.submit(&[desc(a.handle, 0, b.handle, 0, 8)]) {
                    Ok(_) => queued += 1,
                    Err(e) => break e,
                }
                if queued > 5000 {
                    return Err("5000 jobs queued without EAGAIN".into());
                }
            };
            expect_eq("errno at the cap", err, libc::EAGAIN)?;
            expect_eq("jobs queued at the cap (file_max_jobs)", queued, 1024)?;
            drop(d);
            drop(tl);
            Ok(())
        });
    }

    let name = "a job that would take a busy file past its byte cap answers EAGAIN";
    if let Some(why) = &hold_reason {
        t.skip(name, why);
    } else {
        t.run(name, || -> R {
            // The in-flight byte cap (file_max_inflight_mib, 1 GiB) refuses
            // a job of a file that has one queued; alone, it would run.
            let base = ok("channel_info", dev.channel_info(0))?;
            let d = ok("open", Dev::open(&path))?;
            let big = ok("alloc", d.alloc(8 << 20, 0))?;
            let big2 = ok("alloc", d.alloc(8 << 20, 0))?;
            let lone = ok("open", Dev::open(&path))?;
            let c = ok("alloc", lone.alloc(8 << 20, 0))?;
            let e = ok("alloc", lone.alloc(8 << 20, 0))?;
            let hold = Hold::new(&path)?;
            ok(
                "submit held job",
                d.submit(&[desc(big.handle, 0, big2.handle, 0, 8)]),
            )?;
            let many: Vec<_> = (0..200)
                .map(|_| desc(big.handle, 0, big2.handle, 0, 8 << 20))
                .collect();
            expect_err("job over the byte cap", d.submit(&many), libc::EAGAIN)?;
            let many: Vec<_> = (0..200)
                .map(|_| desc(c.handle, 0, e.handle, 0, 8 << 20))
                .collect();
            ok("the same job alone", lone.submit(&many))?;
            // Its file closes first: the big job is cancelled, still queued
            // behind the held one; then the held job's file.
            drop(lone);
            drop(d);
            drop(hold);
            wait_usage(&dev, &base, HANG).map(drop)
        });
    }

    let name = "JOB_WAIT on an id older than TDRV_JOB_WINDOW is ESTALE";
    if edu {
        t.skip(
            name,
            "the window is engine-independent (run on the software device): 4096 edu jobs take minutes",
        );
    } else {
        t.run(name, || -> R {
            let d = ok("open", Dev::open(&path))?;
            let a = ok("alloc", d.alloc(page, 0))?;
            let b = ok("alloc", d.alloc(page, 0))?;
            let first = ok("submit", d.submit(&[desc(a.handle, 0, b.handle, 0, 8)]))?;
            let mut last = first;
            for i in 0..TDRV_JOB_WINDOW as u64 {
                last = ok("submit", d.submit(&[desc(a.handle, 0, b.handle, 0, 8)]))?;
                if i % 512 == 0 {
                    ok("wait", d.job_wait(last, -1))?;
                }
            }
            ok("wait", d.job_wait(last, -1))?;
            expect_eq("ids", last - first, TDRV_JOB_WINDOW as u64)?;
            expect_err("oldest id", d.job_wait(first, 0), libc::ESTALE)?;
            expect_eq(
                "next oldest",
                ok("wait", d.job_wait(first + 1, 0))?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_err("never issued", d.job_wait(last + 1, 0), libc::EINVAL)
        });
    }

    t.run(
        "untimed waits restart after SA_RESTART handlers; timed ones get EINTR",
        || -> R {
            let d = ok("open", Dev::open(&path))?;
            let a = ok("alloc", d.alloc(page, 0))?;
            let b = ok("alloc", d.alloc(page, 0))?;
            let waiter_tid = AtomicUsize::new(0);
            let done = AtomicBool::new(false);
            sig::install(true);
            let r = thread::scope(|s| {
                let w = s.spawn(|| {
                    // SAFETY: gettid has no preconditions.
                    waiter_tid.store(unsafe { libc::gettid() } as usize, Ordering::SeqCst);
                    let r = d.completion_wait(b.handle, 1, -1).map_err(|(e, _)| e);
                    done.store(true, Ordering::SeqCst);
                    r
                });
                while waiter_tid.load(Ordering::SeqCst) == 0 {
                    thread::yield_now();
                }
                // The signal must land inside the wait, not before it.
                let asleep =
                    until_asleep_in(waiter_tid.load(Ordering::SeqCst) as i32, libc::SYS_ioctl);
                let before = sig::HITS.load(Ordering::SeqCst);
                // SAFETY: signals a thread of this process.
                unsafe {
                    libc::syscall(
                        libc::SYS_tgkill,
                        libc::getpid(),
                        waiter_tid.load(Ordering::SeqCst) as libc::pid_t,
                        libc::SIGUSR1,
                    )
                };
                let handled = until("the SIGUSR1 handler ran", || {
                    Ok(sig::HITS.load(Ordering::SeqCst) != before)
                });
                // After the handler, the restarted wait sleeps again in the
                // ioctl: it cannot end before the job below completes.
                let asleep_again = handled.and_then(|()| {
                    until_asleep_in(waiter_tid.load(Ordering::SeqCst) as i32, libc::SYS_ioctl)
                });
                let still_waiting = !done.load(Ordering::SeqCst);
                let id = d.submit(&[desc(a.handle, 0, b.handle, 0, 8)]);
                (asleep.and(asleep_again), still_waiting, id, w.join())
            });
            let (asleep, still_waiting, id, waited) = r;
            ok("submit", id)?;
            let waited = waited.map_err(|_| "waiter panicked")?;
            asleep?;
            expect_eq("wait survived the handler", still_waiting, true)?;
            ok("restarted wait", waited)?;
            // A timed wait is not restarted.
            sig::install(false);
            let tid = AtomicUsize::new(0);
            let timed = thread::scope(|s| {
                let w = s.spawn(|| {
                    // SAFETY: gettid has no preconditions.
                    tid.store(unsafe { libc::gettid() } as usize, Ordering::SeqCst);
                    // Its timeout only bounds a hang: the signal ends it.
                    d.completion_wait(b.handle, 100, HANG.as_micros() as i64)
                        .map_err(|(e, _)| e)
                });
                while tid.load(Ordering::SeqCst) == 0 {
                    thread::yield_now();
                }
                let asleep = until_asleep_in(tid.load(Ordering::SeqCst) as i32, libc::SYS_ioctl);
                // SAFETY: signals a thread of this process.
                unsafe {
                    libc::syscall(
                        libc::SYS_tgkill,
                        libc::getpid(),
                        tid.load(Ordering::SeqCst) as libc::pid_t,
                        libc::SIGUSR1,
                    )
                };
                (asleep, w.join())
            });
            let (asleep, timed) = timed;
            asleep?;
            expect_err(
                "timed wait",
                timed.map_err(|_| "waiter panicked")?,
                libc::EINTR,
            )
        },
    );

    t.run("mappings are never executable", || -> R {
        let a = ok("alloc", dev.alloc(page, 0))?;
        // SAFETY: a fresh mapping chosen by the kernel; nothing lives there.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                page as usize,
                libc::PROT_READ | libc::PROT_EXEC,
                libc::MAP_SHARED,
                dev.fd(),
                a.mmap_offset as libc::off_t,
            )
        };
        if p != libc::MAP_FAILED {
            // SAFETY: unmaps what was just mapped.
            unsafe { libc::munmap(p, page as usize) };
            return Err("PROT_EXEC mapping succeeded".into());
        }
        let map = ok("mmap rw", dev.map(&a))?;
        // SAFETY: changes the protection of our own mapping.
        let r = unsafe {
            libc::mprotect(
                map.as_slice().as_ptr() as *mut _,
                page as usize,
                libc::PROT_READ | libc::PROT_EXEC,
            )
        };
        let e = tdrv_guest_tests::raw::errno();
        drop(map);
        ok("free", dev.free(a.handle))?;
        if r == 0 {
            return Err("mprotect(PROT_EXEC) succeeded".into());
        }
        expect_eq("mprotect errno", e, libc::EACCES)
    });

    t.run("bus addresses only for CAP_SYS_RAWIO", || -> R {
        let a = ok("alloc", dev.alloc(page, 0))?;
        if a.dma_addr == 0 {
            return Err("root (CAP_SYS_RAWIO) got dma_addr 0".into());
        }
        ok("free", dev.free(a.handle))?;
        // SAFETY: the child drops a capability, makes syscalls and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            #[repr(C)]
            struct Header {
                version: u32,
                pid: i32,
            }
            #[repr(C)]
            #[derive(Default, Clone, Copy)]
            struct Data {
                effective: u32,
                permitted: u32,
                inheritable: u32,
            }
            let mut h = Header {
                version: 0x2008_0522,
                pid: 0,
            };
            let mut d = [Data::default(); 2];
            // SAFETY: valid header and two data words (capability v3).
            let code = unsafe {
                libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr());
                d[0].effective &= !(1 << 17); // CAP_SYS_RAWIO
                libc::syscall(libc::SYS_capset, &mut h, d.as_ptr());
                match Dev::open(&path).and_then(|x| {
                    let a = x.alloc(page, 0)?;
                    let i = x.buf_info(a.handle)?;
                    Ok((a.dma_addr, i.dma_addr))
                }) {
                    Ok((0, 0)) => 0,
                    Ok(_) => 1,
                    Err(_) => 2,
                }
            };
            // SAFETY: leaves the child without running the parent's cleanup.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our child.
        if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
            return Err(format!("waitpid: errno {}", tdrv_guest_tests::raw::errno()));
        }
        match tdrv_guest_tests::exit_code(status)? {
            0 => Ok(()),
            1 => Err("an opener without CAP_SYS_RAWIO saw a bus address".into()),
            _ => Err("child without CAP_SYS_RAWIO could not allocate".into()),
        }
    });

    t.run(
        "a synchronous COPY_IN and a job on its buffer never interleave",
        || -> R {
            let d = ok("open", Dev::open(&path))?;
            let size: u64 = if edu { 8064 } else { 4 << 20 };
            let x = ok("alloc", d.alloc(size, 0))?;
            let y = ok("alloc", d.alloc(size, 0))?;
            let rounds = if edu { 2 } else { 40 };
            let stop = AtomicBool::new(false);
            thread::scope(|s| {
                let writer = s.spawn(|| -> R {
                    let mut v = 1u8;
                    while !stop.load(Ordering::SeqCst) {
                        ok("copy_in", d.copy_in(x.handle, 0, &vec![v; size as usize]))?;
                        v = v.wrapping_add(1).max(1);
                        if edu {
                            // Idle time lets the icount clock run the DMA timer.
                            thread::sleep(Duration::from_millis(1));
                        }
                    }
                    Ok(())
                });
                let checker = s.spawn(|| -> R {
                    let mut out = vec![0u8; size as usize];
                    for _ in 0..rounds {
                        let id = ok("submit", d.submit(&[desc(x.handle, 0, y.handle, 0, size)]))?;
                        // Bounded: a job that never ends fails the check
                        // (seen once as a hang of the whole guest).
                        let bound = HANG.as_micros() as i64;
                        expect_eq(
                            "job",
                            ok("wait", d.job_wait(id, bound))?,
                            (TDRV_JOB_DONE, 0),
                        )?;
                        ok("copy_out", d.copy_out(y.handle, 0, &mut out))?;
                        let first = out[0];
                        if let Some(i) = out.iter().position(|b| *b != first) {
                            return Err(format!(
                                "job saw a half-written buffer: byte 0 = {first}, byte {i} = {}",
                                out[i]
                            ));
                        }
                    }
                    Ok(())
                });
                let r = checker.join().map_err(|_| "checker panicked".to_string());
                stop.store(true, Ordering::SeqCst);
                let w = writer.join().map_err(|_| "writer panicked".to_string());
                r.and_then(|r| r).and(w.and_then(|w| w))
            })
        },
    );

    t.run(
        "ABI growth: older-or-equal sizes accepted, output-only VERSION ignores its input",
        || -> R {
            // VERSION with a larger struct whose tail is garbage: output only.
            let mut big = [0xFFu8; 128];
            let req = request_with_size(TDRV_IOC_VERSION, 128);
            ok("version, 128-byte garbage struct", dev.ioctl(req, &mut big))?;
            let v: tdrv_version = unsafe_read(&big);
            expect_eq("abi major", v.abi_major, TDRV_ABI_MAJOR)?;
            expect_eq("untouched tail", big[100], 0xFF)?;
            // Smaller than the first published size: EINVAL.
            let mut small = [0u8; 8];
            expect_err(
                "version, 8 bytes",
                dev.ioctl(request_with_size(TDRV_IOC_VERSION, 8), &mut small),
                libc::EINVAL,
            )?;
            // An input struct larger than ours with a zero tail works.
            let a = ok("alloc", dev.alloc(page, 0))?;
            let mut free = [0u64; 4];
            free[0] = a.handle;
            ok(
                "free, 32-byte struct",
                dev.ioctl(request_with_size(TDRV_IOC_FREE, 32), &mut free),
            )?;
            expect_err("freed", dev.buf_info(a.handle), libc::ENOENT)
        },
    );

    t.run(
        "fdinfo, debugfs clients and sysfs busy_ns describe usage",
        || -> R {
            let d = ok("open", Dev::open(&path))?;
            let other = ok("open", Dev::open(&path))?;
            let a = ok("alloc", d.alloc(5000, 0))?;
            let b = ok("alloc", d.alloc(5000, 0))?;
            let two = version.num_channels > 1;
            if two {
                ok("alloc ch1", d.alloc(3 * page, 1))?;
            }
            let id = ok("submit", d.submit(&[desc(a.handle, 0, b.handle, 0, 5000)]))?;
            expect_eq("job", ok("wait", d.job_wait(id, -1))?, (TDRV_JOB_DONE, 0))?;
            let fdinfo = |fd: i32| -> Result<Vec<(String, String)>, String> {
                let text = fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
                    .map_err(|e| format!("fdinfo: {e}"))?;
                Ok(text
                    .lines()
                    .filter_map(|l| l.split_once(':'))
                    .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                    .collect())
            };
            let get = |kv: &[(String, String)], k: &str| -> Result<String, String> {
                kv.iter()
                    .find(|(key, _)| key == k)
                    .map(|(_, v)| v.clone())
                    .ok_or_else(|| format!("fdinfo has no {k}"))
            };
            let info = fdinfo(d.fd())?;
            expect_eq("drm-driver", get(&info, "drm-driver")?, "tdrv".to_string())?;
            expect_eq(
                "drm-total-hbm0",
                get(&info, "drm-total-hbm0")?,
                (2 * 8192).to_string(),
            )?;
            expect_eq(
                "drm-resident-hbm0",
                get(&info, "drm-resident-hbm0")?,
                (2 * 8192).to_string(),
            )?;
            if two {
                expect_eq(
                    "drm-total-hbm1",
                    get(&info, "drm-total-hbm1")?,
                    (3 * page).to_string(),
                )?;
            }
            expect_eq(
                "tdrv-buffers",
                get(&info, "tdrv-buffers")?,
                if two { "3" } else { "2" }.to_string(),
            )?;
            expect_eq(
                "tdrv-jobs-queued",
                get(&info, "tdrv-jobs-queued")?,
                "0".to_string(),
            )?;
            let busy: u64 = get(&info, "drm-engine-copy")?
                .strip_suffix(" ns")
                .and_then(|v| v.parse().ok())
                .ok_or("drm-engine-copy is not '<n> ns'")?;
            if busy == 0 {
                return Err("drm-engine-copy is 0 after a job".into());
            }
            let id_d = get(&info, "drm-client-id")?;
            let id_o = get(&fdinfo(other.fd())?, "drm-client-id")?;
            if id_d == id_o {
                return Err(format!("two files share drm-client-id {id_d}"));
            }
            let name = path.trim_start_matches("/dev/");
            let clients = fs::read_to_string(format!("/sys/kernel/debug/tdrv/{name}/clients"))
                .map_err(|e| format!("clients: {e}"))?;
            // SAFETY: getpid has no preconditions.
            let me = format!("client {id_d} pid {} buffers", unsafe { libc::getpid() });
            if !clients.lines().any(|l| l.starts_with(&me)) {
                return Err(format!("debugfs clients lacks {me:?}: {clients}"));
            }
            let sys: u64 = fs::read_to_string(format!("/sys/class/misc/{name}/busy_ns"))
                .map_err(|e| format!("busy_ns: {e}"))?
                .trim()
                .parse()
                .map_err(|e| format!("busy_ns: {e}"))?;
            if sys < busy {
                return Err(format!("device busy_ns {sys} < this file's {busy}"));
            }
            expect_eq("debugfs busy_ns", stat(&path, "busy_ns")? >= busy, true)
        },
    );

    let name = "a failed write's latch ends neither FENCE_WAIT(READS) nor a dma-buf SYNC(START|WRITE) while a read is pending";
    if let Some(why) = &hold_reason {
        t.skip(name, why);
    } else {
        t.run(name, || -> R {
            let base = ok("channel_info", dev.channel_info(0))?;
            let b = ok("alloc", dev.alloc(4096, 0))?;
            let c = ok("alloc", dev.alloc(4096, 0))?;
            let exported = ok("export", dev.export(b.handle))?;
            // A second file writes b (the same buffer, imported).
            let writer = ok("open", Dev::open(&path))?;
            let wb = ok("import", writer.import(exported.as_raw_fd(), 0))?;
            let wa = ok("alloc", writer.alloc(4096, 0))?;
            let hold = Hold::new(&path)?;
            // The reader is the job the engine holds; the writer queues
            // behind it (it writes what the reader reads) and fails when
            // its file closes: b's latch says ECANCELED, no write pending,
            // the read still pending.
            let reader = ok(
                "submit reader",
                dev.submit(&[desc(b.handle, 0, c.handle, 0, 4096)]),
            )?;
            let w = ok(
                "submit writer",
                writer.submit(&[desc(wa.handle, 0, wb.handle, 0, 4096)]),
            )?;
            expect_eq(
                "writer",
                ok("poll", writer.job_wait(w, 0))?.0,
                TDRV_JOB_PENDING,
            )?;
            drop(writer);
            let i = ok("buf_info", dev.buf_info(b.handle))?;
            expect_eq("latch", i.error, -libc::ECANCELED)?;
            expect_eq("marks", (i.pending_reads, i.pending_writes), (1, 0))?;
            expect_err(
                "FENCE_WAIT(READS) poll with the read pending",
                dev.fence_wait(b.handle, TDRV_FENCE_READS, 0),
                libc::ETIMEDOUT,
            )?;
            expect_err(
                "FENCE_WAIT(ALL) poll with the read pending",
                dev.fence_wait(b.handle, TDRV_FENCE_ALL, 0),
                libc::ETIMEDOUT,
            )?;
            // Each waiter notes the reads still pending on b when its wait
            // returned; the engine lets the reader run only after both
            // started.
            let ended = |dev: &Dev| dev.buf_info(b.handle).map(|i| i.pending_reads);
            let (sync_r, wait_r) = thread::scope(|sc| {
                let sync = sc.spawn(|| {
                    let r = tdrv_guest_tests::dmabuf::sync(
                        exported.as_raw_fd(),
                        tdrv_guest_tests::dmabuf::SYNC_WRITE,
                    );
                    (r, ended(&dev))
                });
                let wait = sc.spawn(|| {
                    let r = dev.fence_wait(b.handle, TDRV_FENCE_READS, 30_000_000);
                    (r, ended(&dev))
                });
                // Room for a wait that wrongly returns at once to do so
                // before the release (not a timing condition of the test:
                // a correct wait returns only after it either way).
                thread::sleep(Duration::from_millis(300));
                drop(hold);
                (sync.join().unwrap(), wait.join().unwrap())
            });
            expect_eq(
                "SYNC(START|WRITE) returned after the read ended (result, reads pending)",
                sync_r,
                (Ok(()), Ok(0)),
            )?;
            // The read ended; the latch is still set, so the wait reports it.
            expect_eq(
                "FENCE_WAIT(READS) returned after the read ended (result, reads pending)",
                wait_r,
                (Err(libc::EIO), Ok(0)),
            )?;
            expect_eq(
                "reader",
                ok("wait", dev.job_wait(reader, -1))?,
                (TDRV_JOB_DONE, 0),
            )?;
            drop(exported);
            ok("free", dev.free(b.handle))?;
            ok("free", dev.free(c.handle))?;
            wait_usage(&dev, &base, Duration::from_secs(30)).map(drop)
        });
    }

    t.run(
        "the channel is back to its start after every test",
        || -> R {
            // This file's own buffers from the tests above were freed; usage
            // must equal what other files hold (none in this run).
            let c = ok("channel_info", dev.channel_info(0))?;
            expect_eq("buffers on channel 0", c.buffers, 0)?;
            expect_eq("bytes on channel 0", c.used_bytes, 0)
        },
    );

    t.finish();
}

/// Stalls the queue of the next job of a sim device (its watchdog resets
/// the queue once it has waited `sim_timeout_ms`).
fn stall_next(path: &str) -> R {
    ok("inject stall", inject(path, "stall"))
}

/// Writes a fault-injection command for the device at `path`; the errno
/// if it is refused.
fn inject(path: &str, cmd: &str) -> Result<(), i32> {
    fs::write(inject_file(path), cmd).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))
}

/// The jobs the file of `dev` has queued, as its fdinfo says.
fn fdinfo_jobs(dev: &Dev) -> Result<u64, String> {
    let info = fs::read_to_string(format!("/proc/self/fdinfo/{}", dev.fd()))
        .map_err(|e| format!("fdinfo: {e}"))?;
    info.lines()
        .find_map(|l| l.strip_prefix("tdrv-jobs-queued:"))
        .ok_or_else(|| format!("no tdrv-jobs-queued in fdinfo: {info}"))?
        .trim()
        .parse()
        .map_err(|e| format!("tdrv-jobs-queued: {e}"))
}

/// `request` with its size field replaced.
fn request_with_size(request: u64, size: u64) -> u64 {
    (request & !(0x3fff << 16)) | (size << 16)
}

/// Reads a plain-old-data struct from the start of `bytes`.
fn unsafe_read<T: Copy>(bytes: &[u8]) -> T {
    assert!(bytes.len() >= std::mem::size_of::<T>());
    // SAFETY: `bytes` holds at least `size_of::<T>()` bytes and `T` is a
    // plain-old-data uapi struct (every bit pattern valid).
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) }
}
