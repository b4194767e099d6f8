//! Asynchronous jobs, fences and completion counts on one device.
//!
//! The same program runs against the software device and the edu device
//! (the device is the first argument), so both engines are held to the
//! same results.
//!
//! usage: jobs [/dev/tdrvN]

use std::{
    mem::size_of,
    time::{Duration, Instant},
};

use tdrv_guest_tests::{
    channel_usage, desc, expect_eq, expect_err, ok, open_device_or_skip, raw::Dev,
    wait::until_asleep_in, wait_usage, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| ((i * 7 + i / 251) as u8) ^ seed).collect()
}

/// Waits for a job and checks that it succeeded. The wait has no limit:
/// the edu device needs ~0.2 s of (virtual) time per 4 KiB, and a hang is
/// caught by the guest runner's timeout.
fn wait_done(dev: &Dev, id: u64) -> R {
    let (state, status) = ok("job_wait", dev.job_wait(id, -1))?;
    expect_eq("job state", state, TDRV_JOB_DONE)?;
    expect_eq("job status", status, 0)
}

/// Copies `size` bytes through a job from a fresh source to a fresh
/// destination at odd offsets and compares everything.
fn roundtrip(dev: &Dev, size: usize) -> R {
    let (so, dof) = (3usize, 5usize);
    let src = ok("alloc src", dev.alloc((size + so) as u64, 0))?;
    let dst = ok("alloc dst", dev.alloc((size + dof + 1) as u64, 0))?;
    let data = pattern(size, size as u8);
    ok("copy_in", dev.copy_in(src.handle, so as u64, &data))?;
    ok(
        "memset dst",
        dev.memset(dst.handle, 0, (size + dof + 1) as u64, 0xEE),
    )?;
    let id = ok(
        "submit",
        dev.submit(&[desc(
            src.handle,
            so as u64,
            dst.handle,
            dof as u64,
            size as u64,
        )]),
    )?;
    wait_done(dev, id)?;
    let mut out = vec![0u8; size + dof + 1];
    ok("copy_out", dev.copy_out(dst.handle, 0, &mut out))?;
    let r = if out[dof..dof + size] != data[..] {
        let first = out[dof..]
            .iter()
            .zip(&data)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        Err(format!("size {size}: first difference at byte {first}"))
    } else if out[..dof].iter().any(|b| *b != 0xEE) || out[dof + size] != 0xEE {
        Err(format!(
            "size {size}: bytes outside the destination range changed"
        ))
    } else {
        Ok(())
    };
    ok("free", dev.free(src.handle))?;
    ok("free", dev.free(dst.handle))?;
    r
}

extern "C" fn on_alarm(_: libc::c_int) {}

/// Arms SIGALRM after `us` microseconds with a handler that does not
/// restart system calls.
/// Sends SIGALRM (a handler without SA_RESTART) to the calling thread
/// once it sleeps in an ioctl: the signal lands inside the wait, however
/// slow the guest, never before it. Join the handle after the wait.
fn interrupt_next_wait() -> std::thread::JoinHandle<Result<(), String>> {
    // SAFETY: installs a handler that does nothing (async-signal-safe).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_alarm as *const () as usize;
        sa.sa_flags = 0;
        libc::sigaction(libc::SIGALRM, &sa, std::ptr::null_mut());
    }
    // SAFETY: gettid and getpid have no preconditions.
    let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
    std::thread::spawn(move || {
        until_asleep_in(tid, libc::SYS_ioctl)?;
        // SAFETY: signals a thread of this process.
        unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGALRM) };
        Ok(())
    })
}

fn main() {
    let (dev, path, version) = open_device_or_skip("/dev/tdrv0", None);
    let mut t = Tap::new(21);
    t.note(format!("device {path}: kind {}", version.device_kind));
    // The edu engine moves ~4 KiB per 0.2 s of virtual time: "large" jobs
    // are smaller there, so the suite stays quick without losing coverage
    // (every job still spans many DMA chunks).
    let edu = version.device_kind == TDRV_DEVICE_EDU;
    let large: u64 = if edu { 256 << 10 } else { 8 << 20 };

    t.run("a job copies bytes and counts one completion", || -> R {
        let a = ok("alloc", dev.alloc(4096, 0))?;
        let b = ok("alloc", dev.alloc(4096, 0))?;
        let data = pattern(4096, 1);
        ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
        let id = ok(
            "submit",
            dev.submit(&[desc(a.handle, 0, b.handle, 0, 4096)]),
        )?;
        if id == 0 {
            return Err("job id 0".into());
        }
        wait_done(&dev, id)?;
        let mut out = vec![0u8; 4096];
        ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
        expect_eq("data", out == data, true)?;
        let ib = ok("buf_info", dev.buf_info(b.handle))?;
        expect_eq("dst completions", ib.completion_count, 1)?;
        expect_eq("dst pending", (ib.pending_reads, ib.pending_writes), (0, 0))?;
        expect_eq(
            "src completions",
            ok("buf_info", dev.buf_info(a.handle))?.completion_count,
            0,
        )?;
        ok("free", dev.free(a.handle))?;
        ok("free", dev.free(b.handle))
    });

    t.run("byte-exact for sizes from 1 B to 1 MiB", || -> R {
        for size in [
            1,
            2,
            3,
            64,
            4095,
            4096,
            4097,
            8191,
            65_536 + 7,
            300_001,
            1 << 20,
        ] {
            roundtrip(&dev, size)?;
        }
        Ok(())
    });

    t.run(
        "a multi-descriptor job counts one completion per destination",
        || -> R {
            let s = ok("alloc", dev.alloc(3000, 0))?;
            let d1 = ok("alloc", dev.alloc(3000, 0))?;
            let d2 = ok("alloc", dev.alloc(3000, 0))?;
            let data = pattern(3000, 2);
            ok("copy_in", dev.copy_in(s.handle, 0, &data))?;
            let id = ok(
                "submit",
                dev.submit(&[
                    desc(s.handle, 0, d1.handle, 0, 1000),
                    desc(s.handle, 1000, d1.handle, 1000, 2000),
                    desc(s.handle, 0, d2.handle, 0, 3000),
                ]),
            )?;
            wait_done(&dev, id)?;
            let mut out = vec![0u8; 3000];
            ok("copy_out", dev.copy_out(d1.handle, 0, &mut out))?;
            expect_eq("d1 data", out == data, true)?;
            ok("copy_out", dev.copy_out(d2.handle, 0, &mut out))?;
            expect_eq("d2 data", out == data, true)?;
            expect_eq(
                "d1 completions",
                ok("info", dev.buf_info(d1.handle))?.completion_count,
                1,
            )?;
            expect_eq(
                "d2 completions",
                ok("info", dev.buf_info(d2.handle))?.completion_count,
                1,
            )?;
            for h in [s.handle, d1.handle, d2.handle] {
                ok("free", dev.free(h))?;
            }
            Ok(())
        },
    );

    t.run("completion wait: poll, reach, timeout, reset", || -> R {
        let a = ok("alloc", dev.alloc(256, 0))?;
        let b = ok("alloc", dev.alloc(256, 0))?;
        expect_err(
            "poll before any job",
            dev.completion_wait(b.handle, 1, 0).map_err(|(e, _)| e),
            libc::ETIMEDOUT,
        )?;
        for _ in 0..3 {
            ok("submit", dev.submit(&[desc(a.handle, 0, b.handle, 0, 256)]))?;
        }
        let n = ok(
            "wait for 3",
            dev.completion_wait(b.handle, 3, -1).map_err(|(e, _)| e),
        )?;
        if n < 3 {
            return Err(format!("count {n} < 3"));
        }
        let start = Instant::now();
        expect_err(
            "wait for 4 with 50 ms",
            dev.completion_wait(b.handle, 4, 50_000).map_err(|(e, _)| e),
            libc::ETIMEDOUT,
        )?;
        if start.elapsed() < Duration::from_millis(40) {
            return Err(format!("timed out after only {:?}", start.elapsed()));
        }
        ok("reset", dev.completion_reset(b.handle))?;
        expect_eq(
            "count after reset",
            ok("info", dev.buf_info(b.handle))?.completion_count,
            0,
        )?;
        let id = ok("submit", dev.submit(&[desc(a.handle, 0, b.handle, 0, 256)]))?;
        wait_done(&dev, id)?;
        expect_eq(
            "count after one more",
            ok(
                "wait",
                dev.completion_wait(b.handle, 1, 0).map_err(|(e, _)| e),
            )?,
            1,
        )?;
        ok("free", dev.free(a.handle))?;
        ok("free", dev.free(b.handle))
    });

    t.run("reads fence against an in-flight job's writes", || -> R {
        // A large job; COPY_OUT right after SUBMIT must see its result,
        // because reads wait for pending device writes.
        let size = large;
        let a = ok("alloc", dev.alloc(size, 0))?;
        let b = ok("alloc", dev.alloc(size, 0))?;
        let data = pattern(size as usize, 4);
        ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
        for round in 0..3u8 {
            ok("memset", dev.memset(b.handle, 0, size, round.into()))?;
            ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, size)]),
            )?;
            let mut out = vec![0u8; size as usize];
            ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
            if out != data {
                return Err(format!("round {round}: COPY_OUT saw unfinished data"));
            }
        }
        ok("free", dev.free(a.handle))?;
        ok("free", dev.free(b.handle))
    });

    t.run("fence wait: idle, after a job, bad kinds", || -> R {
        let a = ok("alloc", dev.alloc(large, 0))?;
        let b = ok("alloc", dev.alloc(large, 0))?;
        ok("idle poll", dev.fence_wait(a.handle, TDRV_FENCE_ALL, 0))?;
        ok(
            "submit",
            dev.submit(&[desc(a.handle, 0, b.handle, 0, large)]),
        )?;
        ok(
            "wait writes",
            dev.fence_wait(b.handle, TDRV_FENCE_WRITES, -1),
        )?;
        ok("wait reads", dev.fence_wait(a.handle, TDRV_FENCE_READS, -1))?;
        let i = ok("info", dev.buf_info(b.handle))?;
        expect_eq("no pending writes", i.pending_writes, 0)?;
        expect_err("kind 0", dev.fence_wait(a.handle, 0, 0), libc::EINVAL)?;
        expect_err("kind 4", dev.fence_wait(a.handle, 4, 0), libc::EINVAL)?;
        expect_err(
            "bad handle",
            dev.fence_wait(12345, TDRV_FENCE_ALL, 0),
            libc::ENOENT,
        )?;
        ok("free", dev.free(a.handle))?;
        ok("free", dev.free(b.handle))
    });

    t.run("malformed submissions are refused", || -> R {
        let a = ok("alloc", dev.alloc(4096, 0))?;
        let b = ok("alloc", dev.alloc(4096, 0))?;
        let good = desc(a.handle, 0, b.handle, 0, 16);
        expect_err("no descriptors", dev.submit(&[]), libc::EINVAL)?;
        let many = vec![good; TDRV_MAX_JOB_DESCS as usize + 1];
        expect_err("too many descriptors", dev.submit(&many), libc::EINVAL)?;
        expect_err(
            "size 0",
            dev.submit(&[desc(a.handle, 0, b.handle, 0, 0)]),
            libc::EINVAL,
        )?;
        expect_err(
            "bad source",
            dev.submit(&[desc(999, 0, b.handle, 0, 16)]),
            libc::ENOENT,
        )?;
        expect_err(
            "bad destination",
            dev.submit(&[desc(a.handle, 0, 999, 0, 16)]),
            libc::ENOENT,
        )?;
        expect_err(
            "source range",
            dev.submit(&[desc(a.handle, 4090, b.handle, 0, 16)]),
            libc::ERANGE,
        )?;
        expect_err(
            "overflow",
            dev.submit(&[desc(a.handle, u64::MAX, b.handle, 0, 16)]),
            libc::ERANGE,
        )?;
        if version.num_channels > 1 {
            let c = ok("alloc ch1", dev.alloc(4096, 1))?;
            expect_err(
                "cross-channel",
                dev.submit(&[desc(a.handle, 0, c.handle, 0, 16)]),
                libc::EXDEV,
            )?;
        }
        let descs = [good];
        for (what, desc_size, want) in [
            ("stride 39", 39u32, libc::EINVAL),
            ("stride 4096", 4096, libc::EINVAL),
        ] {
            let mut s = tdrv_submit {
                descs: descs.as_ptr() as u64,
                desc_count: 1,
                desc_size,
                ..Default::default()
            };
            expect_err(what, dev.ioctl(TDRV_IOC_SUBMIT, &mut s), want)?;
        }
        // A larger descriptor stride with a zero tail is accepted; a
        // non-zero tail is not.
        let mut wide = [0u8; 48];
        // SAFETY: tdrv_copy_desc is plain data; copying its bytes is fine.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&good as *const tdrv_copy_desc).cast::<u8>(),
                size_of::<tdrv_copy_desc>(),
            )
        };
        wide[..40].copy_from_slice(bytes);
        let mut s = tdrv_submit {
            descs: wide.as_ptr() as u64,
            desc_count: 1,
            desc_size: 48,
            ..Default::default()
        };
        let id =
            ok("stride 48, zero tail", dev.ioctl(TDRV_IOC_SUBMIT, &mut s)).map(|_| s.job_id)?;
        wait_done(&dev, id)?;
        wide[47] = 1;
        let mut s = tdrv_submit {
            descs: wide.as_ptr() as u64,
            desc_count: 1,
            desc_size: 48,
            ..Default::default()
        };
        expect_err(
            "stride 48, non-zero tail",
            dev.ioctl(TDRV_IOC_SUBMIT, &mut s),
            libc::E2BIG,
        )?;
        let mut s = tdrv_submit {
            descs: 8,
            desc_count: 1,
            desc_size: 40,
            ..Default::default()
        };
        expect_err(
            "unmapped descriptors",
            dev.ioctl(TDRV_IOC_SUBMIT, &mut s),
            libc::EFAULT,
        )?;
        // Nothing was left pending by the refused submissions.
        let i = ok("info", dev.buf_info(b.handle))?;
        expect_eq(
            "pending after refusals",
            (i.pending_reads, i.pending_writes),
            (0, 0),
        )?;
        ok("free", dev.free(a.handle))?;
        ok("free", dev.free(b.handle))
    });

    t.run("job wait: unknown ids, poll, ids increase", || -> R {
        expect_err("id 0", dev.job_wait(0, 0), libc::EINVAL)?;
        expect_err("future id", dev.job_wait(1 << 40, 0), libc::EINVAL)?;
        let a = ok("alloc", dev.alloc(4096, 0))?;
        let b = ok("alloc", dev.alloc(4096, 0))?;
        let mut last = 0;
        for _ in 0..50 {
            let id = ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, 4096)]),
            )?;
            if id <= last {
                return Err(format!("job id {id} after {last}"));
            }
            let (state, _) = ok("poll", dev.job_wait(id, 0))?;
            if state != TDRV_JOB_PENDING && state != TDRV_JOB_DONE {
                return Err(format!("bad state {state}"));
            }
            last = id;
        }
        wait_done(&dev, last)?;
        // Every earlier job (all write `b`) is done, and counted, once the
        // last one is: also on a device with several queues, where a job
        // may start on another queue the moment the one before it ends.
        let count = ok("info", dev.buf_info(b.handle))?.completion_count;
        for id in last - 49..=last {
            let (state, status) = ok("poll", dev.job_wait(id, 0))?;
            expect_eq(
                &format!("job {}", id + 50 - last),
                (state, status),
                (TDRV_JOB_DONE, 0),
            )?;
        }
        expect_eq("completions", count, 50)?;
        ok("free", dev.free(a.handle))?;
        ok("free", dev.free(b.handle))
    });

    t.run("a signal interrupts a wait with EINTR", || -> R {
        let a = ok("alloc", dev.alloc(64, 0))?;
        // The EINTR itself shows that the signal ended each wait.
        let signaller = interrupt_next_wait();
        let r = dev.completion_wait(a.handle, 1, -1).map_err(|(e, _)| e);
        signaller.join().map_err(|_| "signaller panicked")??;
        expect_err("completion_wait forever", r, libc::EINTR)?;
        let signaller = interrupt_next_wait();
        let r = dev
            .completion_wait(a.handle, 1, 60_000_000)
            .map_err(|(e, _)| e);
        signaller.join().map_err(|_| "signaller panicked")??;
        expect_err("completion_wait 60 s", r, libc::EINTR)?;
        ok("free", dev.free(a.handle))
    });

    t.run(
        "FREE of buffers in flight: the job still completes",
        || -> R {
            let base = ok("ch", dev.channel_info(0))?.used_bytes;
            let a = ok("alloc", dev.alloc(large, 0))?;
            let b = ok("alloc", dev.alloc(large, 0))?;
            let id = ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, large)]),
            )?;
            ok("free src", dev.free(a.handle))?;
            ok("free dst", dev.free(b.handle))?;
            wait_done(&dev, id)?;
            expect_eq(
                "released after the job",
                ok("ch", dev.channel_info(0))?.used_bytes,
                base,
            )
        },
    );

    t.run("closing a file with a job in flight is clean", || -> R {
        let base = ok("ch", dev.channel_info(0))?.used_bytes;
        {
            let other = ok("open", Dev::open(&path))?;
            let a = ok("alloc", other.alloc(large, 0))?;
            let b = ok("alloc", other.alloc(large, 0))?;
            for _ in 0..4 {
                ok(
                    "submit",
                    other.submit(&[desc(a.handle, 0, b.handle, 0, large)]),
                )?;
            }
        }
        // The jobs finish on their own and release the memory.
        let deadline = Instant::now() + Duration::from_secs(600);
        while ok("ch", dev.channel_info(0))?.used_bytes != base {
            if Instant::now() > deadline {
                return Err("memory of the closed file was never released".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    });

    t.run("two processes are isolated from each other", || -> R {
        let a = ok("alloc", dev.alloc(4096, 0))?;
        // One pipe each way: with one pipe for both, the child could read
        // back its own handle instead of the parent's go-ahead.
        let (mut up, mut down) = ([0; 2], [0; 2]);
        // SAFETY: creates two pipes into local arrays.
        if unsafe { libc::pipe(up.as_mut_ptr()) } != 0
            || unsafe { libc::pipe(down.as_mut_ptr()) } != 0
        {
            return Err("pipe".into());
        }
        // SAFETY: the child only runs code below and exits with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // Child: its own open file cannot see the parent's handle.
            let code = match Dev::open(&path) {
                Ok(own) => {
                    let mine = own.alloc(4096, 0).map(|x| x.handle).unwrap_or(0);
                    let foreign_ok = own.buf_info(a.handle).is_ok() || own.free(a.handle).is_ok();
                    // SAFETY: writes 8 bytes from a local to the pipe.
                    let sent = unsafe { libc::write(up[1], (&mine as *const u64).cast(), 8) };
                    // Wait for the parent to try our handle before exiting.
                    let mut byte = 0u8;
                    // SAFETY: reads one byte into a local.
                    let got = unsafe { libc::read(down[0], (&mut byte as *mut u8).cast(), 1) };
                    if foreign_ok || mine == 0 {
                        1
                    } else if sent != 8 || got != 1 || byte != b'x' {
                        3
                    } else {
                        0
                    }
                }
                Err(_) => 2,
            };
            // SAFETY: ends the child without running the parent's atexit.
            unsafe { libc::_exit(code) };
        }
        let mut theirs = 0u64;
        // SAFETY: reads 8 bytes into a local.
        let got = unsafe { libc::read(up[0], (&mut theirs as *mut u64).cast(), 8) };
        let parent_view = dev.buf_info(theirs);
        // SAFETY: one byte to let the child go on.
        unsafe { libc::write(down[1], b"x".as_ptr().cast(), 1) };
        let mut status = 0;
        // SAFETY: waits for our own child.
        let reaped = unsafe { libc::waitpid(pid, &mut status, 0) };
        // SAFETY: closing our pipe ends.
        unsafe {
            for fd in up.into_iter().chain(down) {
                libc::close(fd);
            }
        }
        expect_eq("bytes of the child's handle read", got, 8)?;
        expect_eq("waitpid", reaped, pid)?;
        expect_err("child's handle in the parent", parent_view, libc::ENOENT)?;
        expect_eq(
            "child saw only its own buffers (exit code; 1: it saw ours, 3: a pipe failed)",
            tdrv_guest_tests::exit_code(status)?,
            0,
        )?;
        ok("free", dev.free(a.handle))
    });

    t.run("jobs from several threads all complete", || -> R {
        let a = ok("alloc", dev.alloc(65_536, 0))?;
        let b = ok("alloc", dev.alloc(65_536, 0))?;
        let data = pattern(65_536, 5);
        ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
        let dev = &dev;
        std::thread::scope(|s| -> R {
            let workers: Vec<_> = (0..4u64)
                .map(|i| {
                    s.spawn(move || -> R {
                        for _ in 0..25 {
                            let off = i * 16_384;
                            let id = ok(
                                "submit",
                                dev.submit(&[desc(a.handle, off, b.handle, off, 16_384)]),
                            )?;
                            wait_done(dev, id)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            for w in workers {
                w.join().map_err(|_| "thread panicked".to_string())??;
            }
            Ok(())
        })?;
        let mut out = vec![0u8; 65_536];
        ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
        expect_eq("data", out == data, true)?;
        expect_eq(
            "completions",
            ok("info", dev.buf_info(b.handle))?.completion_count,
            100,
        )?;
        ok("free", dev.free(a.handle))?;
        ok("free", dev.free(b.handle))
    });

    t.run(
        "writes fence against in-flight reads (COPY_IN after SUBMIT)",
        || -> R {
            // COPY_IN to a job's source waits until the job has read it, so the
            // destination receives the old contents, never a mix.
            let size = large;
            let a = ok("alloc", dev.alloc(size, 0))?;
            let b = ok("alloc", dev.alloc(size, 0))?;
            let old = pattern(size as usize, 6);
            let new = pattern(size as usize, 7);
            ok("copy_in old", dev.copy_in(a.handle, 0, &old))?;
            let id = ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, size)]),
            )?;
            ok("copy_in new", dev.copy_in(a.handle, 0, &new))?;
            wait_done(&dev, id)?;
            let mut out = vec![0u8; size as usize];
            ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
            expect_eq("destination holds the old source", out == old, true)?;
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    t.run(
        "mapped buffers work as job sources and destinations",
        || -> R {
            let a = ok("alloc", dev.alloc(3 * 4096, 0))?;
            let b = ok("alloc", dev.alloc(3 * 4096, 0))?;
            let mut ma = ok("mmap a", dev.map(&a))?;
            let mb = ok("mmap b", dev.map(&b))?;
            let data = pattern(3 * 4096, 8);
            ma.as_mut_slice().copy_from_slice(&data);
            let id = ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, 3 * 4096)]),
            )?;
            wait_done(&dev, id)?;
            expect_eq(
                "seen through the destination mapping",
                mb.as_slice() == &data[..],
                true,
            )?;
            drop((ma, mb));
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    let soft = version.device_kind == TDRV_DEVICE_SOFT;
    let stat = |key: &str| -> Result<Option<u64>, String> {
        let name = path.trim_start_matches("/dev/");
        let stats = std::fs::read_to_string(format!("/sys/kernel/debug/tdrv/{name}/stats"))
            .map_err(|e| format!("read stats: {e}"))?;
        Ok(stats
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':')?.trim().parse().ok()))
    };

    t.run(
        "soft: a small job on an idle engine is done when SUBMIT returns",
        || -> R {
            // Issue 12: the software device runs a job of at most 256 KiB
            // in SUBMIT itself when nothing else is queued or running, so
            // its completion (and its waiters' wake-up) happens there.
            let a = ok("alloc", dev.alloc(512 << 10, 0))?;
            let b = ok("alloc", dev.alloc(512 << 10, 0))?;
            let data = pattern(256 << 10, 9);
            ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
            let before = stat("inline_jobs")?;
            let mut done = 0;
            // Other engines take their time (edu: 0.2 s per 4 KiB): fewer,
            // smaller jobs there, which must just complete.
            let sizes: &[u64] = if soft {
                &[64, 4096, 65_536, 256 << 10]
            } else {
                &[64, 4096]
            };
            let n = if soft { 20 } else { 4 };
            let last = sizes[(n - 1) % sizes.len()] as usize;
            for (i, len) in sizes.iter().cycle().take(n).enumerate() {
                let id = ok(
                    "submit",
                    dev.submit(&[desc(a.handle, 0, b.handle, 0, *len)]),
                )?;
                let (state, status) = ok("poll", dev.job_wait(id, 0))?;
                if soft {
                    expect_eq(
                        &format!("job {i} ({len} B) state at return"),
                        state,
                        TDRV_JOB_DONE,
                    )?;
                    expect_eq("status", status, 0)?;
                    let info = ok("info", dev.buf_info(b.handle))?;
                    expect_eq("completions at return", info.completion_count, i as u64 + 1)?;
                    expect_eq(
                        "pending at return",
                        (info.pending_reads, info.pending_writes),
                        (0, 0),
                    )?;
                }
                done = id;
            }
            wait_done(&dev, done)?;
            let mut out = vec![0u8; last];
            ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
            expect_eq("data", out[..] == data[..last], true)?;
            if soft {
                let before = before.ok_or("no inline_jobs line in debugfs stats")?;
                expect_eq(
                    "inline_jobs counted",
                    stat("inline_jobs")?,
                    Some(before + 20),
                )?;
                // Larger than the limit: queued for the work item.
                let id = ok(
                    "submit",
                    dev.submit(&[desc(a.handle, 0, b.handle, 0, 512 << 10)]),
                )?;
                wait_done(&dev, id)?;
                expect_eq(
                    "a 512 KiB job is not run inline",
                    stat("inline_jobs")?,
                    Some(before + 20),
                )?;
            } else {
                expect_eq("no inline_jobs on this device", before, None)?;
            }
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    t.run(
        "a small job queued behind a conflicting one runs after it",
        || -> R {
            // A large job writes B; a small one right after reads B. The small
            // one finds the engine busy and must not overtake: its destination
            // gets what the large one wrote, never B's old contents. (Large
            // is past what runs inline on the software device; a few DMA
            // chunks on edu.)
            let large = if edu { 16 << 10 } else { large };
            let a = ok("alloc", dev.alloc(large, 0))?;
            let b = ok("alloc", dev.alloc(large, 0))?;
            let c = ok("alloc", dev.alloc(4096, 0))?;
            let d = ok("alloc", dev.alloc(4096, 0))?;
            for round in 0..3u8 {
                let new = pattern(large as usize, 10 + round);
                ok("copy_in", dev.copy_in(a.handle, 0, &new))?;
                ok("memset b", dev.memset(b.handle, 0, large, 0x5A))?;
                ok("memset c", dev.memset(c.handle, 0, 4096, 0))?;
                let big = ok(
                    "submit big",
                    dev.submit(&[desc(a.handle, 0, b.handle, 0, large)]),
                )?;
                let small = ok(
                    "submit small",
                    dev.submit(&[desc(b.handle, large - 4096, c.handle, 0, 4096)]),
                )?;
                // Unrelated buffers, same engine: queued too, in order.
                let other = ok(
                    "submit other",
                    dev.submit(&[desc(c.handle, 0, d.handle, 0, 4096)]),
                )?;
                wait_done(&dev, other)?;
                for id in [big, small] {
                    let (state, status) = ok("poll", dev.job_wait(id, 0))?;
                    expect_eq(
                        "earlier job done with the last",
                        (state, status),
                        (TDRV_JOB_DONE, 0),
                    )?;
                }
                let mut out = vec![0u8; 4096];
                ok("copy_out c", dev.copy_out(c.handle, 0, &mut out))?;
                if out[..] != new[large as usize - 4096..] {
                    return Err(format!(
                        "round {round}: the small job ran before the large one"
                    ));
                }
                ok("copy_out d", dev.copy_out(d.handle, 0, &mut out))?;
                if out[..] != new[large as usize - 4096..] {
                    return Err(format!("round {round}: the third job ran out of order"));
                }
            }
            for h in [a.handle, b.handle, c.handle, d.handle] {
                ok("free", dev.free(h))?;
            }
            Ok(())
        },
    );

    t.run(
        "two threads' conflicting jobs keep each thread's order",
        || -> R {
            // Both threads write and read the same buffer S (each its own
            // half), so every job conflicts with the other thread's: some run
            // inline, some queue behind the other thread's. Each thread
            // copies source k % 4 into its half of S, then its half of S into
            // slot k of its own output; a job that overtook its predecessor
            // leaves a wrong slot.
            const SLOT: usize = 4096;
            let rounds: usize = if edu { 6 } else { 150 };
            let s_buf = ok("alloc S", dev.alloc(2 * SLOT as u64, 0))?;
            let mut srcs = Vec::new();
            let mut outs = Vec::new();
            for th in 0..2u8 {
                let mut mine = Vec::new();
                for k in 0..4u8 {
                    let h = ok("alloc src", dev.alloc(SLOT as u64, 0))?;
                    ok(
                        "copy_in",
                        dev.copy_in(h.handle, 0, &pattern(SLOT, 20 + th * 4 + k)),
                    )?;
                    mine.push(h.handle);
                }
                srcs.push(mine);
                outs.push(ok("alloc out", dev.alloc((rounds * SLOT) as u64, 0))?.handle);
            }
            let dev = &dev;
            std::thread::scope(|sc| -> R {
                let workers: Vec<_> = (0..2usize)
                    .map(|th| {
                        let srcs = &srcs[th];
                        let out = outs[th];
                        let s = s_buf.handle;
                        sc.spawn(move || -> R {
                            let half = (th * SLOT) as u64;
                            let mut last = 0;
                            for k in 0..rounds {
                                ok(
                                    "submit fill",
                                    dev.submit(&[desc(srcs[k % 4], 0, s, half, SLOT as u64)]),
                                )?;
                                last = ok(
                                    "submit read",
                                    dev.submit(&[desc(
                                        s,
                                        half,
                                        out,
                                        (k * SLOT) as u64,
                                        SLOT as u64,
                                    )]),
                                )?;
                            }
                            wait_done(dev, last)
                        })
                    })
                    .collect();
                for w in workers {
                    w.join().map_err(|_| "thread panicked".to_string())??;
                }
                Ok(())
            })?;
            for (th, h) in outs.iter().enumerate() {
                let mut out = vec![0u8; rounds * SLOT];
                ok("copy_out", dev.copy_out(*h, 0, &mut out))?;
                for k in 0..rounds {
                    if out[k * SLOT..(k + 1) * SLOT]
                        != pattern(SLOT, 20 + th as u8 * 4 + (k % 4) as u8)[..]
                    {
                        return Err(format!(
                            "thread {th}, round {k}: wrong contents (jobs out of order)"
                        ));
                    }
                }
            }
            expect_eq(
                "S completions",
                ok("info", dev.buf_info(s_buf.handle))?.completion_count,
                2 * rounds as u64,
            )?;
            for h in srcs.iter().flatten().chain(outs.iter()) {
                ok("free", dev.free(*h))?;
            }
            ok("free", dev.free(s_buf.handle))
        },
    );

    t.run(
        "a job never reads a buffer while another thread's job writes it",
        || -> R {
            // Thread A keeps rewriting X (256 KiB, small enough to run in
            // SUBMIT) from one of two uniform sources; thread B copies X to
            // Y and reads Y back. A copy of X that overlapped a write of it
            // would leave Y mixed; jobs on disjoint buffers may overlap,
            // these must not.
            const LEN: usize = 256 << 10;
            let rounds: usize = if edu { 3 } else { 120 };
            let x = ok("alloc X", dev.alloc(LEN as u64, 0))?.handle;
            let y = ok("alloc Y", dev.alloc(LEN as u64, 0))?.handle;
            let mut srcs = Vec::new();
            for v in [0x11u8, 0x22] {
                let h = ok("alloc src", dev.alloc(LEN as u64, 0))?.handle;
                ok("copy_in", dev.copy_in(h, 0, &vec![v; LEN]))?;
                srcs.push(h);
            }
            let dev = &dev;
            std::thread::scope(|sc| -> R {
                let writer = sc.spawn(|| -> R {
                    let mut last = 0;
                    for k in 0..rounds {
                        last = ok(
                            "submit write",
                            dev.submit(&[desc(srcs[k % 2], 0, x, 0, LEN as u64)]),
                        )?;
                    }
                    wait_done(dev, last)
                });
                let mut got = vec![0u8; LEN];
                for k in 0..rounds {
                    let id = ok("submit read", dev.submit(&[desc(x, 0, y, 0, LEN as u64)]))?;
                    wait_done(dev, id)?;
                    ok("copy_out", dev.copy_out(y, 0, &mut got))?;
                    let first = got[0];
                    if ![0, 0x11, 0x22].contains(&first) || got.iter().any(|&b| b != first) {
                        let other = got.iter().position(|&b| b != first).unwrap_or(0);
                        return Err(format!(
                            "round {k}: Y mixes {first:#x} and {:#x} at byte {other}",
                            got[other]
                        ));
                    }
                }
                writer.join().map_err(|_| "writer panicked".to_string())?
            })?;
            for h in srcs.into_iter().chain([x, y]) {
                ok("free", dev.free(h))?;
            }
            Ok(())
        },
    );

    t.run(
        "a job holding the last references to its buffers frees them when it ends",
        || -> R {
            // The engine's completion path (an interrupt thread on edu and
            // sim) then releases the memory: the debug kernel's lockdep
            // checks that path against the dma-fence rules.
            let channels = version.num_channels;
            let before = channel_usage(&dev, channels)?;
            let node = path.trim_start_matches("/dev/");
            let inject = format!("/sys/kernel/debug/tdrv/{node}/inject");
            let a = ok("alloc", dev.alloc(4096, 0))?;
            let b = ok("alloc", dev.alloc(4096, 0))?;
            std::fs::write(&inject, "hold_job").map_err(|e| format!("hold_job: {e}"))?;
            let id = dev.submit(&[desc(a.handle, 0, b.handle, 0, 4096)]);
            let freed = dev.free(a.handle).and_then(|()| dev.free(b.handle));
            std::fs::write(&inject, "release").map_err(|e| format!("release: {e}"))?;
            let id = ok("submit", id)?;
            ok("free while the job is held", freed)?;
            wait_done(&dev, id)?;
            // JOB_WAIT reports a job after it let go of its buffers.
            wait_usage(&dev, &before, std::time::Duration::ZERO).map(drop)
        },
    );

    t.run("debugfs counts this device's jobs", || -> R {
        let name = path.trim_start_matches("/dev/");
        let stats = std::fs::read_to_string(format!("/sys/kernel/debug/tdrv/{name}/stats"))
            .map_err(|e| format!("read stats: {e}"))?;
        let field = |key: &str| -> u64 {
            stats
                .lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
                .unwrap_or(0)
        };
        if field("jobs_submitted:") < 100 || field("jobs_completed:") < 100 {
            return Err(format!("unexpected stats:\n{stats}"));
        }
        if field("waits:") == 0 || field("wait_timeouts:") == 0 {
            return Err(format!("waits not counted:\n{stats}"));
        }
        Ok(())
    });

    t.finish();
}
