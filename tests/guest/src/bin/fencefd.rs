//! Fence fds of jobs (ABI 1.2, `TDRV_FEAT_FENCE_FD`): out-fences as
//! `sync_file` fds, poll/epoll on them, in-fences (sw_sync and tdrv's own)
//! gating jobs without stalling other files, error propagation, close,
//! SIGKILL, unbind and rmmod with fences outstanding.
//!
//! On a kernel without `CONFIG_SYNC_FILE` it checks that fence fds are
//! refused with EOPNOTSUPP and skips the rest.
//!
//! usage: fencefd /dev/tdrvN
//!
//! It ends by unbinding and rebinding an edu device, and (in the QEMU
//! guest, where `/lib/modules/tdrv.ko` and `/etc/tdrv-params` exist) by
//! unloading and reloading the module.

use std::{
    fs,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    thread,
    time::{Duration, Instant},
};

use tdrv_guest_tests::{
    channel_usage, desc, expect_eq, expect_err, failure_injection, inject, ok, open_device_or_skip,
    raw::{errno, Dev},
    sync::{file_info, poll_in, Timeline},
    wait_usage, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

const PCI_DRIVER_DIR: &str = "/sys/bus/pci/drivers/tdrv";
const SIM_DRIVER_DIR: &str = "/sys/bus/pci/drivers/tdrv-sim";
const TESTS: usize = 16;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed)
        .collect()
}

/// Takes ownership of an fd the driver returned.
fn owned(fd: i32) -> Result<OwnedFd, String> {
    if fd < 0 {
        return Err(format!("no out-fence fd (got {fd})"));
    }
    // SAFETY: the driver just installed this descriptor for us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The status SYNC_IOC_FILE_INFO reports (1 signalled, 0 pending, < 0
/// error).
fn status(fd: RawFd) -> Result<i32, String> {
    ok("SYNC_IOC_FILE_INFO", file_info(fd)).map(|s| s.status)
}

/// Waits (poll) for the fence to signal, at most 60 s, and returns its
/// status.
fn wait_fence(fd: RawFd) -> Result<i32, String> {
    if !ok("poll", poll_in(fd, 60_000))? {
        return Err("fence did not signal within 60 s".into());
    }
    status(fd)
}

fn job_state(dev: &Dev, id: u64) -> Result<(u32, i32), String> {
    ok("job_wait (poll)", dev.job_wait(id, 0))
}

/// Two buffers of `size` bytes, the source filled with a pattern.
fn pair(dev: &Dev, size: u64, seed: u8) -> Result<(tdrv_alloc, tdrv_alloc, Vec<u8>), String> {
    let a = ok("alloc", dev.alloc(size, 0))?;
    let b = ok("alloc", dev.alloc(size, 0))?;
    let data = pattern(size as usize, seed);
    ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
    Ok((a, b, data))
}

fn check_copied(dev: &Dev, b: &tdrv_alloc, data: &[u8]) -> R {
    let mut out = vec![0u8; data.len()];
    ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
    expect_eq("destination holds the source", out == data, true)
}

/// SUBMIT until the engine takes jobs again (edu after a watchdog
/// recovery refuses them with EIO for a while).
fn submit_when_ready(dev: &Dev, d: &[tdrv_copy_desc]) -> Result<u64, String> {
    for _ in 0..60 {
        match dev.submit(d) {
            Ok(id) => return Ok(id),
            Err(e) if e == libc::EIO => thread::sleep(Duration::from_millis(500)),
            Err(e) => return Err(format!("submit: errno {e}")),
        }
    }
    Err("engine still recovering after 30 s".into())
}

/// The number of open fds of this process.
fn open_fds() -> Result<usize, String> {
    fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .map_err(|e| format!("/proc/self/fd: {e}"))
}

/// `delete_module("tdrv", O_NONBLOCK)`.
fn unload() -> Result<(), i32> {
    // SAFETY: a NUL-terminated name and flags.
    let r = unsafe { libc::syscall(libc::SYS_delete_module, c"tdrv".as_ptr(), libc::O_NONBLOCK) };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

/// The tests that need no fence support: what a kernel without
/// `CONFIG_SYNC_FILE` answers.
fn unsupported(t: &mut Tap, dev: &Dev, path: &str) {
    t.run(
        "without sync_file: TDRV_SUBMIT_OUT_FENCE is EOPNOTSUPP",
        || -> R {
            let (a, b, _) = pair(dev, 4096, 1)?;
            let d = [desc(a.handle, 0, b.handle, 0, 4096)];
            expect_err("submit", dev.submit_fences(&d, &[], true), libc::EOPNOTSUPP)
        },
    );
    t.run("without sync_file: in-fences are EOPNOTSUPP", || -> R {
        let (a, b, _) = pair(dev, 4096, 2)?;
        let d = [desc(a.handle, 0, b.handle, 0, 4096)];
        expect_err(
            "submit",
            dev.submit_fences(&d, &[0], false),
            libc::EOPNOTSUPP,
        )
    });
    t.run(
        "without sync_file: a job through the 1.2 struct runs and reports out_fence -1",
        || -> R {
            let (a, b, data) = pair(dev, 4096, 3)?;
            let d = [desc(a.handle, 0, b.handle, 0, 4096)];
            let (id, fd) = ok("submit", dev.submit_fences(&d, &[], false))?;
            expect_eq("out_fence", fd, -1)?;
            expect_eq("job", ok("wait", dev.job_wait(id, -1))?, (TDRV_JOB_DONE, 0))?;
            check_copied(dev, &b, &data)
        },
    );
    t.run(
        "without sync_file: the tdrv crate says FenceFdsUnsupported",
        || -> R {
            use tdrv::{Device, Job, Tensor};
            let d = Device::open(path).map_err(|err| format!("open: {err}"))?;
            expect_eq("supports_fence_fds", d.supports_fence_fds(), false)?;
            let a =
                Tensor::allocate_on(&d, 0, 4096, None).map_err(|err| format!("alloc: {err}"))?;
            let b =
                Tensor::allocate_on(&d, 0, 4096, None).map_err(|err| format!("alloc: {err}"))?;
            match Job::new()
                .copy_all(&a, &b)
                .map(|j| j.with_out_fence())
                .and_then(|j| j.submit())
            {
                Err(tdrv::Error::Sys(tdrv::SysError::FenceFdsUnsupported { .. })) => Ok(()),
                r => Err(format!("submit: {r:?}, want FenceFdsUnsupported")),
            }
        },
    );
    for i in 4..TESTS {
        t.skip(
            &format!("fence fd test {}", i + 1),
            "kernel without CONFIG_SYNC_FILE (TDRV_FEAT_FENCE_FD unset)",
        );
    }
}

fn main() {
    let (dev, path, version) = open_device_or_skip("/dev/tdrv0", None);
    let edu = version.device_kind == TDRV_DEVICE_EDU;
    let mut t = Tap::new(TESTS);
    if version.features & TDRV_FEAT_FENCE_FD as u64 == 0 {
        t.note("TDRV_FEAT_FENCE_FD is not set: fence fds must be refused");
        unsupported(&mut t, &dev, &path);
        t.finish();
    }
    if !Timeline::available() {
        t.note("no /sys/kernel/debug/sync/sw_sync (CONFIG_SW_SYNC): in-fence tests skip");
    }
    // The edu engine moves ~4 KiB per 0.2 s of guest time.
    let size: u64 = if edu { 4096 } else { 1 << 20 };

    t.run(
        "an out-fence is an O_CLOEXEC sync_file fd that signals when its job ends",
        || -> R {
            let (a, b, data) = pair(&dev, size, 4)?;
            let d = [desc(a.handle, 0, b.handle, 0, size)];
            let (id, fd) = ok("submit", dev.submit_fences(&d, &[], true))?;
            let fence = owned(fd)?;
            // SAFETY: fcntl on a descriptor we own.
            let flags = unsafe { libc::fcntl(fence.as_raw_fd(), libc::F_GETFD) };
            expect_eq("FD_CLOEXEC", flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC)?;
            expect_eq("fence status", wait_fence(fence.as_raw_fd())?, 1)?;
            // Signalled after JOB_WAIT learnt the outcome.
            expect_eq(
                "job after the fence",
                job_state(&dev, id)?,
                (TDRV_JOB_DONE, 0),
            )?;
            check_copied(&dev, &b, &data)?;
            let info = ok("file_info", file_info(fence.as_raw_fd()))?;
            expect_eq("fences in the sync_file", info.num_fences, 1)
        },
    );

    let sw_sync = |t: &mut Tap, name: &str, body: &dyn Fn(&Timeline) -> R| match Timeline::new() {
        Ok(tl) => t.run(name, || body(&tl)),
        Err(e) => t.skip(name, &format!("no sw_sync timeline (errno {e})")),
    };

    sw_sync(
        &mut t,
        "a job gated by a sw_sync fence waits for it; its out-fence names tdrv until signalled",
        &|tl| -> R {
            let (a, b, data) = pair(&dev, size, 5)?;
            let gate = ok("sw_sync fence", tl.fence(1))?;
            let d = [desc(a.handle, 0, b.handle, 0, size)];
            let (id, fd) = ok("submit", dev.submit_fences(&d, &[gate.as_raw_fd()], true))?;
            let fence = owned(fd)?;
            thread::sleep(Duration::from_millis(300));
            expect_eq(
                "job while gated",
                job_state(&dev, id)?,
                (TDRV_JOB_PENDING, 0),
            )?;
            let info = ok("buf_info", dev.buf_info(b.handle))?;
            expect_eq("pending write on the destination", info.pending_writes, 1)?;
            expect_eq("completions while gated", info.completion_count, 0)?;
            let s = ok("file_info", file_info(fence.as_raw_fd()))?;
            expect_eq("pending fence status", s.status, 0)?;
            expect_eq("driver name", s.driver.as_str(), "tdrv")?;
            expect_eq("timeline name", s.timeline.as_str(), "tdrv-job")?;
            ok("sw_sync inc", tl.inc(1))?;
            expect_eq("fence status", wait_fence(fence.as_raw_fd())?, 1)?;
            expect_eq("job", job_state(&dev, id)?, (TDRV_JOB_DONE, 0))?;
            check_copied(&dev, &b, &data)?;
            // Signalled fences no longer call into the module (their ops
            // are detached): the core names them itself.
            let s = ok("file_info", file_info(fence.as_raw_fd()))?;
            expect_eq(
                "driver name after signalling",
                s.driver.as_str(),
                "detached-driver",
            )
        },
    );

    sw_sync(
        &mut t,
        "soft: a small job's out-fence has signalled when SUBMIT returns; a gated one waits",
        &|tl| -> R {
            // The software device runs a small job on an idle engine in
            // SUBMIT itself (issue 12), but never one gated by in-fences.
            let soft = version.device_kind == TDRV_DEVICE_SOFT;
            let (a, b, data) = pair(&dev, 4096, 7)?;
            let d = [desc(a.handle, 0, b.handle, 0, 4096)];
            let (id, fd) = ok("submit", dev.submit_fences(&d, &[], true))?;
            let fence = owned(fd)?;
            if soft {
                expect_eq("fence status at return", status(fence.as_raw_fd())?, 1)?;
                expect_eq("job at return", job_state(&dev, id)?, (TDRV_JOB_DONE, 0))?;
            }
            expect_eq("fence status", wait_fence(fence.as_raw_fd())?, 1)?;
            check_copied(&dev, &b, &data)?;
            let gate = ok("sw_sync fence", tl.fence(1))?;
            let (id, fd) = ok(
                "submit gated",
                dev.submit_fences(&d, &[gate.as_raw_fd()], true),
            )?;
            let fence = owned(fd)?;
            expect_eq(
                "gated job at return",
                job_state(&dev, id)?,
                (TDRV_JOB_PENDING, 0),
            )?;
            expect_eq("gated fence at return", status(fence.as_raw_fd())?, 0)?;
            // Behind the gated job: held by the file, so not run either.
            let id2 = ok("submit behind", dev.submit(&d))?;
            expect_eq(
                "job behind at return",
                job_state(&dev, id2)?,
                (TDRV_JOB_PENDING, 0),
            )?;
            ok("sw_sync inc", tl.inc(1))?;
            expect_eq("gated fence status", wait_fence(fence.as_raw_fd())?, 1)?;
            let (state, status) = ok("job_wait", dev.job_wait(id2, -1))?;
            expect_eq("job behind", (state, status), (TDRV_JOB_DONE, 0))?;
            expect_eq(
                "completions",
                ok("buf_info", dev.buf_info(b.handle))?.completion_count,
                3,
            )
        },
    );

    sw_sync(
        &mut t,
        "epoll: an out-fence becomes readable when its job ends, not before",
        &|tl| -> R {
            let (a, b, _) = pair(&dev, size, 6)?;
            let gate = ok("sw_sync fence", tl.fence(1))?;
            let d = [desc(a.handle, 0, b.handle, 0, size)];
            let (_, fd) = ok("submit", dev.submit_fences(&d, &[gate.as_raw_fd()], true))?;
            let fence = owned(fd)?;
            // SAFETY: epoll calls on descriptors we own, with live buffers.
            unsafe {
                let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
                if ep < 0 {
                    return Err(format!("epoll_create1: errno {}", errno()));
                }
                let ep = OwnedFd::from_raw_fd(ep);
                let mut ev = libc::epoll_event {
                    events: libc::EPOLLIN as u32,
                    u64: 0x7d7d,
                };
                if libc::epoll_ctl(
                    ep.as_raw_fd(),
                    libc::EPOLL_CTL_ADD,
                    fence.as_raw_fd(),
                    &mut ev,
                ) < 0
                {
                    return Err(format!("epoll_ctl: errno {}", errno()));
                }
                let mut out = [libc::epoll_event { events: 0, u64: 0 }; 2];
                let n = libc::epoll_wait(ep.as_raw_fd(), out.as_mut_ptr(), 2, 300);
                expect_eq("ready events while the job is gated", n, 0)?;
                ok("sw_sync inc", tl.inc(1))?;
                let n = libc::epoll_wait(ep.as_raw_fd(), out.as_mut_ptr(), 2, 60_000);
                expect_eq("ready events after the job", n, 1)?;
                let (events, token) = (out[0].events, out[0].u64);
                expect_eq("token", token, 0x7d7d)?;
                expect_eq("EPOLLIN", events & libc::EPOLLIN as u32 != 0, true)?;
            }
            expect_eq("fence status", status(fence.as_raw_fd())?, 1)
        },
    );

    sw_sync(
        &mut t,
        "a gated job stalls neither other files nor the engine; later jobs of its file wait",
        &|tl| -> R {
            let (a, b, data) = pair(&dev, size, 7)?;
            let (c, e, _) = pair(&dev, size, 8)?;
            let gate = ok("sw_sync fence", tl.fence(1))?;
            let (gated, _) = ok(
                "submit gated",
                dev.submit_fences(
                    &[desc(a.handle, 0, b.handle, 0, size)],
                    &[gate.as_raw_fd()],
                    false,
                ),
            )?;
            // Same file, no in-fence: still behind the gated job.
            let behind = ok(
                "submit behind",
                dev.submit(&[desc(c.handle, 0, e.handle, 0, size)]),
            )?;
            // Another file's job runs meanwhile.
            let other = ok("open", Dev::open(&path))?;
            let (x, y, xdata) = pair(&other, size, 9)?;
            let id = ok(
                "submit other",
                other.submit(&[desc(x.handle, 0, y.handle, 0, size)]),
            )?;
            expect_eq(
                "other file's job",
                ok("wait", other.job_wait(id, 60_000_000))?,
                (TDRV_JOB_DONE, 0),
            )?;
            check_copied(&other, &y, &xdata)?;
            expect_eq("gated job", job_state(&dev, gated)?, (TDRV_JOB_PENDING, 0))?;
            expect_eq(
                "job behind it",
                job_state(&dev, behind)?,
                (TDRV_JOB_PENDING, 0),
            )?;
            ok("sw_sync inc", tl.inc(1))?;
            expect_eq(
                "gated job",
                ok("wait", dev.job_wait(gated, -1))?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_eq(
                "job behind",
                ok("wait", dev.job_wait(behind, -1))?,
                (TDRV_JOB_DONE, 0),
            )?;
            check_copied(&dev, &b, &data)
        },
    );

    t.run(
        "a job gated on another file's out-fence starts after that job ended",
        || -> R {
            let first = ok("open", Dev::open(&path))?;
            let (a, b, _) = pair(&first, size, 10)?;
            let passes = if edu { 2 } else { 8 };
            let d: Vec<_> = (0..passes)
                .map(|_| desc(a.handle, 0, b.handle, 0, size))
                .collect();
            let (id1, fd1) = ok("submit first", first.submit_fences(&d, &[], true))?;
            let f1 = owned(fd1)?;
            let (c, e, data) = pair(&dev, size, 11)?;
            let (id2, fd2) = ok(
                "submit second",
                dev.submit_fences(
                    &[desc(c.handle, 0, e.handle, 0, size)],
                    &[f1.as_raw_fd()],
                    true,
                ),
            )?;
            let f2 = owned(fd2)?;
            expect_eq("second fence", wait_fence(f2.as_raw_fd())?, 1)?;
            expect_eq("second job", job_state(&dev, id2)?, (TDRV_JOB_DONE, 0))?;
            expect_eq(
                "first job when the second ended",
                job_state(&first, id1)?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_eq("first fence", status(f1.as_raw_fd())?, 1)?;
            check_copied(&dev, &e, &data)
        },
    );

    t.run(
        "a failed job's errno is its fence error, and a job gated on it fails with it unrun",
        || -> R {
            let (cmd, want) = failure_injection(edu);
            let (a, b, _) = pair(&dev, 4096, 12)?;
            let (c, e, _) = pair(&dev, 4096, 13)?;
            ok("memset", dev.memset(e.handle, 0, 4096, 0x5a))?;
            inject(&path, cmd)?;
            let (id1, fd1) = ok(
                "submit failing",
                dev.submit_fences(&[desc(a.handle, 0, b.handle, 0, 4096)], &[], true),
            )?;
            let f1 = owned(fd1)?;
            let (id2, fd2) = ok(
                "submit gated on it",
                dev.submit_fences(
                    &[desc(c.handle, 0, e.handle, 0, 4096)],
                    &[f1.as_raw_fd()],
                    true,
                ),
            )?;
            let f2 = owned(fd2)?;
            expect_eq("failed job's fence", wait_fence(f1.as_raw_fd())?, -want)?;
            expect_eq(
                "failed job",
                ok("wait", dev.job_wait(id1, -1))?,
                (TDRV_JOB_DONE, -want),
            )?;
            expect_eq("gated job's fence", wait_fence(f2.as_raw_fd())?, -want)?;
            expect_eq(
                "gated job",
                ok("wait", dev.job_wait(id2, -1))?,
                (TDRV_JOB_DONE, -want),
            )?;
            // It did not run: its destination kept its bytes (and latched
            // the error, as every failed job does).
            let info = ok("buf_info", dev.buf_info(e.handle))?;
            expect_eq("gated destination's latch", info.error, -want)?;
            ok("completion_reset", dev.completion_reset(e.handle))?;
            let mut out = vec![0u8; 4096];
            ok("copy_out", dev.copy_out(e.handle, 0, &mut out))?;
            expect_eq(
                "gated destination untouched",
                out.iter().all(|x| *x == 0x5a),
                true,
            )?;
            // The engine serves jobs again (edu: once it let go).
            let id = submit_when_ready(&dev, &[desc(c.handle, 0, e.handle, 0, 4096)])?;
            expect_eq(
                "next job",
                ok("wait", dev.job_wait(id, -1))?,
                (TDRV_JOB_DONE, 0),
            )
        },
    );

    t.run(
        "bad fence arguments get clean errors and queue nothing",
        || -> R {
            let (a, b, _) = pair(&dev, 4096, 14)?;
            let d = [desc(a.handle, 0, b.handle, 0, 4096)];
            let before = ok("channel", dev.channel_info(0))?;
            expect_err(
                "in-fence -1",
                dev.submit_fences(&d, &[-1], false),
                libc::EBADF,
            )?;
            expect_err(
                "in-fence not open",
                dev.submit_fences(&d, &[4000], false),
                libc::EBADF,
            )?;
            // The device file itself is not a sync_file.
            expect_err(
                "in-fence not a sync_file",
                dev.submit_fences(&d, &[dev.fd()], false),
                libc::EINVAL,
            )?;
            let many = vec![dev.fd(); TDRV_MAX_IN_FENCES as usize + 1];
            expect_err(
                "too many in-fences",
                dev.submit_fences(&d, &many, false),
                libc::EINVAL,
            )?;
            let base = tdrv_submit {
                descs: d.as_ptr() as u64,
                desc_count: 1,
                desc_size: std::mem::size_of::<tdrv_copy_desc>() as u32,
                ..Default::default()
            };
            for (what, s, want) in [
                (
                    "unknown flag",
                    tdrv_submit {
                        flags: 1 << 7,
                        ..base
                    },
                    libc::EINVAL,
                ),
                (
                    "in_fences without a count",
                    tdrv_submit {
                        in_fences: 8,
                        ..base
                    },
                    libc::EINVAL,
                ),
                (
                    "unreadable in_fences",
                    tdrv_submit {
                        in_fences: 8,
                        in_fence_count: 1,
                        ..base
                    },
                    libc::EFAULT,
                ),
            ] {
                let mut s = s;
                expect_err(what, dev.ioctl(TDRV_IOC_SUBMIT, &mut s), want)?;
            }
            // Nothing was queued: the buffers carry no marks.
            let i = ok("buf_info", dev.buf_info(a.handle))?;
            expect_eq("marks", (i.pending_reads, i.pending_writes), (0, 0))?;
            let after = ok("channel", dev.channel_info(0))?;
            expect_eq("channel usage", after.used_bytes, before.used_bytes)?;
            // out_fence is output only: a reused struct's value is ignored.
            let mut s = tdrv_submit {
                out_fence: 3,
                ..base
            };
            ok(
                "submit with a stale out_fence",
                dev.ioctl(TDRV_IOC_SUBMIT, &mut s),
            )?;
            expect_eq("out_fence without the flag", s.out_fence, -1)?;
            expect_eq(
                "job",
                ok("wait", dev.job_wait(s.job_id, -1))?,
                (TDRV_JOB_DONE, 0),
            )?;
            // A 1.0 caller (48-byte struct) still submits.
            let mut old = [0u8; 48];
            // SAFETY: the first 48 bytes of a tdrv_submit, as an old binary sends.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (&base as *const tdrv_submit).cast::<u8>(),
                    old.as_mut_ptr(),
                    48,
                )
            };
            let req = (TDRV_IOC_SUBMIT & !(0x3fff << 16)) | (48 << 16);
            ok("submit with the 1.0 size", dev.ioctl(req, &mut old))?;
            let id = u64::from_ne_bytes(old[24..32].try_into().unwrap());
            expect_eq(
                "1.0 job",
                ok("wait", dev.job_wait(id, -1))?,
                (TDRV_JOB_DONE, 0),
            )
        },
    );

    t.run(
        "TDRV_SUBMIT_OUT_FENCE in a 48-byte (1.0/1.1) struct is EINVAL: no fd, no job",
        || -> R {
            let (a, b, _) = pair(&dev, 4096, 16)?;
            let d = [desc(a.handle, 0, b.handle, 0, 4096)];
            let base = tdrv_submit {
                descs: d.as_ptr() as u64,
                desc_count: 1,
                desc_size: std::mem::size_of::<tdrv_copy_desc>() as u32,
                flags: TDRV_SUBMIT_OUT_FENCE,
                ..Default::default()
            };
            let mut old = [0u8; 48];
            // SAFETY: the first 48 bytes of a tdrv_submit, as an old binary sends.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (&base as *const tdrv_submit).cast::<u8>(),
                    old.as_mut_ptr(),
                    48,
                )
            };
            let req = (TDRV_IOC_SUBMIT & !(0x3fff << 16)) | (48 << 16);
            let prev = ok("submit", dev.submit(&d))?;
            expect_eq(
                "job",
                ok("wait", dev.job_wait(prev, -1))?,
                (TDRV_JOB_DONE, 0),
            )?;
            let fds = open_fds()?;
            expect_err("submit", dev.ioctl(req, &mut old), libc::EINVAL)?;
            // The out-fence fd it could not report would be a new open fd.
            expect_eq("open fds", open_fds()?, fds)?;
            expect_eq("job_id left alone", &old[24..32], &[0u8; 8][..])?;
            let i = ok("buf_info", dev.buf_info(a.handle))?;
            expect_eq("marks", (i.pending_reads, i.pending_writes), (0, 0))?;
            // No job took an id: the next one gets the id after the last.
            let id = ok("submit", dev.submit(&d))?;
            expect_eq("next job id", id, prev + 1)?;
            expect_eq(
                "next job",
                ok("wait", dev.job_wait(id, -1))?,
                (TDRV_JOB_DONE, 0),
            )
        },
    );

    sw_sync(
        &mut t,
        "closing a file ends its gated jobs: ECANCELED fences, memory back, later signals harmless",
        &|tl| -> R {
            let base = channel_usage(&dev, version.num_channels)?;
            let victim = ok("open", Dev::open(&path))?;
            let (a, b, _) = pair(&victim, size, 15)?;
            let gate = ok("sw_sync fence", tl.fence(1))?;
            let mut fences = Vec::new();
            for _ in 0..4 {
                let (_, fd) = ok(
                    "submit gated",
                    victim.submit_fences(
                        &[desc(a.handle, 0, b.handle, 0, size)],
                        &[gate.as_raw_fd()],
                        true,
                    ),
                )?;
                fences.push(owned(fd)?);
            }
            drop(victim);
            for f in &fences {
                expect_eq(
                    "fence of a cancelled job",
                    wait_fence(f.as_raw_fd())?,
                    -libc::ECANCELED,
                )?;
            }
            wait_usage(&dev, &base, Duration::from_secs(60))?;
            // The callbacks on the sw_sync fence are gone with the jobs.
            ok("sw_sync inc", tl.inc(1))?;
            expect_eq(
                "still cancelled",
                status(fences[0].as_raw_fd())?,
                -libc::ECANCELED,
            )
        },
    );

    sw_sync(
        &mut t,
        "SIGKILL of a process with gated jobs frees everything",
        &|tl| -> R {
            let base = channel_usage(&dev, version.num_channels)?;
            let gate = ok("sw_sync fence", tl.fence(1))?;
            let mut pipe = [0; 2];
            // SAFETY: pipe(2) into a local array.
            if unsafe { libc::pipe(pipe.as_mut_ptr()) } < 0 {
                return Err("pipe".into());
            }
            // SAFETY: the child only makes raw system calls and exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let r = (|| -> Result<(), i32> {
                    let d = Dev::open(&path)?;
                    let a = d.alloc(size, 0)?;
                    let b = d.alloc(size, 0)?;
                    for _ in 0..8 {
                        d.submit_fences(
                            &[desc(a.handle, 0, b.handle, 0, size)],
                            &[gate.as_raw_fd()],
                            true,
                        )?;
                    }
                    // SAFETY: one byte to the pipe, then wait to be killed.
                    unsafe {
                        libc::write(pipe[1], b"r".as_ptr().cast(), 1);
                        loop {
                            libc::pause();
                        }
                    }
                })();
                // SAFETY: leaving the child without running the parent's
                // destructors.
                unsafe { libc::_exit(if r.is_ok() { 0 } else { 3 }) };
            }
            // SAFETY: closing our copy of the write end; reading one byte.
            let got = unsafe {
                libc::close(pipe[1]);
                let mut c = 0u8;
                let n = libc::read(pipe[0], (&mut c as *mut u8).cast(), 1);
                libc::close(pipe[0]);
                n
            };
            // SAFETY: killing and reaping our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            expect_eq("child ready", got, 1)?;
            wait_usage(&dev, &base, Duration::from_secs(60))?;
            ok("sw_sync inc", tl.inc(1))
        },
    );

    sw_sync(
        &mut t,
        "userlib: in_fence, fence_fd and awaiting a JobHandle without a runtime",
        &|tl| userlib_test(&path, size as usize, tl),
    );
    sw_sync(
        &mut t,
        "userlib (feature tokio): wait_async on tokio's reactor, with and without a fence",
        &|tl| tokio_test(&path, tl),
    );
    sw_sync(
        &mut t,
        "userlib: awaiting a failed job is JobFailed; a handle without a fence awaits too",
        &|tl| userlib_errors(&path, tl),
    );

    // The last tests remove the device or the module: no file of ours may
    // stay open.
    drop(dev);

    let sim = version.device_kind == TDRV_DEVICE_SIM;
    if edu {
        t.run(
            "unbind ends gated and running jobs with ENODEV on their fences",
            || unbind_test(&path, PCI_DRIVER_DIR, false),
        );
    } else if sim {
        // The sim device finishes a job in microseconds: the engine holds
        // it (debugfs hold_job) so that unbind finds it queued.
        t.run(
            "unbind ends gated and queued jobs with ENODEV on their fences",
            || unbind_test(&path, SIM_DRIVER_DIR, true),
        );
    } else {
        t.skip(
            "unbind ends gated and running jobs with ENODEV on their fences",
            "the software device is not on a bus (edu runs it)",
        );
    }

    let guest =
        fs::metadata("/lib/modules/tdrv.ko").is_ok() && fs::metadata("/etc/tdrv-params").is_ok();
    if guest {
        t.run(
            "out-fence fds outlive rmmod: FILE_INFO, poll and close after the module is gone",
            || rmmod_test(&path),
        );
    } else {
        t.skip(
            "out-fence fds outlive rmmod: FILE_INFO, poll and close after the module is gone",
            "needs the QEMU guest's /lib/modules/tdrv.ko to reload the module",
        );
    }
    t.finish();
}

/// A minimal executor: polls `fut` on this thread, parking between
/// wake-ups, for at most `limit`.
fn block_on<F: std::future::Future>(fut: F, limit: Duration) -> Result<F::Output, String> {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(thread::Thread, std::sync::atomic::AtomicUsize);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.0.unpark();
        }
    }
    let unpark = Arc::new(Unpark(thread::current(), 0.into()));
    let waker = Waker::from(unpark.clone());
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    let start = Instant::now();
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return Ok(v);
        }
        if start.elapsed() > limit {
            return Err(format!("future not ready after {limit:?}"));
        }
        thread::park_timeout(Duration::from_millis(500));
    }
}

/// The tdrv crate's side: a job waits for a sw_sync fence (`in_fence`),
/// hands out its out-fence (`fence_fd`), a second job waits for that, and
/// both handles are awaited by a plain executor whose only wake-ups come
/// from the library.
fn userlib_test(path: &str, size: usize, tl: &Timeline) -> R {
    use tdrv::{Device, Job, Tensor};
    let e = |what: &str, r: tdrv::Result<()>| r.map_err(|err| format!("{what}: {err}"));
    let dev = Device::open(path).map_err(|err| format!("open: {err}"))?;
    expect_eq("supports_fence_fds", dev.supports_fence_fds(), true)?;
    let t = |name: &str| {
        Tensor::allocate_on(&dev, 0, size, Some(name)).map_err(|err| format!("alloc: {err}"))
    };
    let (a, b, c) = (t("a")?, t("b")?, t("c")?);
    let data = pattern(size, 21);
    e("write", a.write(0, &data))?;
    let gate = ok("sw_sync fence", tl.fence(1))?;
    let first = Job::new()
        .copy_all(&a, &b)
        .and_then(|j| j.in_fence(&gate))
        .map(|j| j.with_out_fence())
        .and_then(|j| j.submit())
        .map_err(|err| format!("submit first: {err}"))?;
    drop(gate);
    let fence = first.fence_fd().ok_or("no fence_fd with with_out_fence")?;
    expect_eq("fence pending", status(fence.as_raw_fd())?, 0)?;
    let second = Job::new()
        .copy_all(&b, &c)
        .and_then(|j| j.in_fence(fence))
        .and_then(|j| j.submit())
        .map_err(|err| format!("submit second: {err}"))?;
    expect_eq("second has no fence", second.fence_fd().is_none(), true)?;
    // Signal from another thread after a while: the executor sleeps until
    // the library wakes it.
    let signaller = thread::scope(|s| {
        let h = s.spawn(|| {
            thread::sleep(Duration::from_millis(300));
            tl.inc(1)
        });
        let r = block_on(first, Duration::from_secs(60));
        (h.join(), r)
    });
    ok(
        "sw_sync inc",
        signaller.0.map_err(|_| libc::EIO).and_then(|r| r),
    )?;
    e("await first", signaller.1?)?;
    e("await second", block_on(second, Duration::from_secs(60))?)?;
    let out = c.to_vec().map_err(|err| format!("read: {err}"))?;
    expect_eq("data through both jobs", out == data, true)
}

fn tokio_test(path: &str, tl: &Timeline) -> R {
    use tdrv::{Device, Job, Tensor};
    let dev = Device::open(path).map_err(|err| format!("open: {err}"))?;
    let t = |name: &str| {
        Tensor::allocate_on(&dev, 0, 4096, Some(name)).map_err(|err| format!("alloc: {err}"))
    };
    let (a, b, c) = (t("a")?, t("b")?, t("c")?);
    let data = pattern(4096, 23);
    a.write(0, &data).map_err(|err| format!("write: {err}"))?;
    let gate = ok("sw_sync fence", tl.fence(1))?;
    let mut fenced = Job::new()
        .copy_all(&a, &b)
        .and_then(|j| j.in_fence(&gate))
        .map(|j| j.with_out_fence())
        .and_then(|j| j.submit())
        .map_err(|err| format!("submit: {err}"))?;
    let mut plain = Job::new()
        .copy_all(&b, &c)
        .and_then(|j| j.submit())
        .map_err(|err| format!("submit: {err}"))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|err| format!("runtime: {err}"))?;
    let r = thread::scope(|s| {
        let h = s.spawn(|| {
            thread::sleep(Duration::from_millis(300));
            tl.inc(1)
        });
        let r = rt.block_on(async {
            fenced.wait_async().await?;
            plain.wait_async().await
        });
        (h.join(), r)
    });
    ok("sw_sync inc", r.0.map_err(|_| libc::EIO).and_then(|r| r))?;
    r.1.map_err(|err| format!("wait_async: {err}"))?;
    let out = c.to_vec().map_err(|err| format!("read: {err}"))?;
    expect_eq("data through both jobs", out == data, true)
}

fn userlib_errors(path: &str, tl: &Timeline) -> R {
    use tdrv::{Device, Job, Tensor};
    let dev = Device::open(path).map_err(|err| format!("open: {err}"))?;
    let t = |name: &str| {
        Tensor::allocate_on(&dev, 0, 4096, Some(name)).map_err(|err| format!("alloc: {err}"))
    };
    let (a, b) = (t("a")?, t("b")?);
    // A job whose file goes away while it is gated fails with ECANCELED;
    // its out-fence says so; a job gated on that fence fails with it.
    let other = Dev::open(path).map_err(|err| format!("open: errno {err}"))?;
    let (x, y, _) = pair(&other, 4096, 22)?;
    let gate = ok("sw_sync fence", tl.fence(1))?;
    let (_, fd) = ok(
        "submit gated",
        other.submit_fences(
            &[desc(x.handle, 0, y.handle, 0, 4096)],
            &[gate.as_raw_fd()],
            true,
        ),
    )?;
    let cancelled = owned(fd)?;
    let gated = Job::new()
        .copy_all(&a, &b)
        .and_then(|j| j.in_fence(&cancelled))
        .map(|j| j.with_out_fence())
        .and_then(|j| j.submit())
        .map_err(|err| format!("submit: {err}"))?;
    drop(other);
    match block_on(gated, Duration::from_secs(60))? {
        Err(tdrv::Error::JobFailed { errno, .. }) if errno == libc::ECANCELED => {}
        r => return Err(format!("await: {r:?}, want JobFailed(ECANCELED)")),
    }
    ok("sw_sync inc", tl.inc(1))?;
    // Without an out-fence, awaiting still works (a JOB_WAIT thread).
    let plain = Job::new()
        .copy_all(&a, &b)
        .and_then(|j| j.submit())
        .map_err(|err| format!("submit: {err}"))?;
    block_on(plain, Duration::from_secs(60))?.map_err(|err| format!("await plain: {err}"))
}

/// The PCI address of the edu device bound to tdrv.
fn bound_pci_address(driver_dir: &str) -> Result<String, String> {
    fs::read_dir(driver_dir)
        .map_err(|e| format!("{driver_dir}: {e}"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.contains(':') && n.contains('.'))
        .ok_or_else(|| "no PCI device bound to tdrv".into())
}

/// Waits until `path` opens again (after a rebind or reload).
fn wait_node(path: &str) -> R {
    let start = Instant::now();
    while Dev::open(path).is_err() {
        if start.elapsed() > Duration::from_secs(60) {
            return Err(format!("{path} did not come back"));
        }
        thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Unbinds the device at `path` (bound to `driver_dir`) with one job on the
/// engine and one waiting for an in-fence; with `hold`, the engine holds
/// the first (debugfs `hold_job`) instead of running it.
fn unbind_test(path: &str, driver_dir: &str, hold: bool) -> R {
    let pci = bound_pci_address(driver_dir)?;
    let tl = ok("sw_sync timeline", Timeline::new())?;
    let r = (|| -> R {
        let dev = ok("open", Dev::open(path))?;
        let (a, b, _) = pair(&dev, 16384, 16)?;
        let gate = ok("sw_sync fence", tl.fence(1))?;
        if hold {
            inject(path, "hold_job")?;
        }
        // One job on the engine (on edu running: 4 chunks of ~0.2 s
        // each; held on sim), one gated.
        let (id1, fd1) = ok(
            "submit running",
            dev.submit_fences(&[desc(a.handle, 0, b.handle, 0, 16384)], &[], true),
        )?;
        let running = owned(fd1)?;
        if hold {
            expect_eq(
                "held job pending",
                ok("poll", dev.job_wait(id1, 0))?.0,
                TDRV_JOB_PENDING,
            )?;
        }
        let (_, fd2) = ok(
            "submit gated",
            dev.submit_fences(
                &[desc(b.handle, 0, a.handle, 0, 4096)],
                &[gate.as_raw_fd()],
                true,
            ),
        )?;
        let gated = owned(fd2)?;
        fs::write(format!("{driver_dir}/unbind"), &pci).map_err(|e| format!("unbind: {e}"))?;
        expect_eq(
            "running job's fence",
            wait_fence(running.as_raw_fd())?,
            -libc::ENODEV,
        )?;
        expect_eq(
            "gated job's fence",
            wait_fence(gated.as_raw_fd())?,
            -libc::ENODEV,
        )?;
        expect_err(
            "submit after unbind",
            dev.submit_fences(&[desc(a.handle, 0, b.handle, 0, 8)], &[], true),
            libc::ENODEV,
        )?;
        drop(dev);
        ok("sw_sync inc", tl.inc(1))
    })();
    let rebind = fs::write(format!("{driver_dir}/bind"), &pci).map_err(|e| format!("bind: {e}"));
    r?;
    rebind?;
    wait_node(path)
}

fn rmmod_test(path: &str) -> R {
    let tl = ok("sw_sync timeline", Timeline::new())?;
    let (done, cancelled) = {
        let dev = ok("open", Dev::open(path))?;
        let (a, b, _) = pair(&dev, 4096, 17)?;
        let gate = ok("sw_sync fence", tl.fence(1))?;
        let d = [desc(a.handle, 0, b.handle, 0, 4096)];
        let (_, fd1) = ok("submit", dev.submit_fences(&d, &[], true))?;
        let done = owned(fd1)?;
        expect_eq("done fence", wait_fence(done.as_raw_fd())?, 1)?;
        let (_, fd2) = ok(
            "submit gated",
            dev.submit_fences(&d, &[gate.as_raw_fd()], true),
        )?;
        (done, owned(fd2)?)
    };
    expect_eq(
        "cancelled fence",
        wait_fence(cancelled.as_raw_fd())?,
        -libc::ECANCELED,
    )?;
    // Signalled fences do not pin the module.
    let unloaded = unload();
    let r = (|| -> R {
        unloaded.map_err(|e| format!("rmmod with only signalled fences open: errno {e}"))?;
        let s = ok("file_info after rmmod", file_info(done.as_raw_fd()))?;
        expect_eq("status", s.status, 1)?;
        expect_eq("driver", s.driver.as_str(), "detached-driver")?;
        let s = ok("file_info after rmmod", file_info(cancelled.as_raw_fd()))?;
        expect_eq("status", s.status, -libc::ECANCELED)?;
        expect_eq(
            "poll after rmmod",
            ok("poll", poll_in(done.as_raw_fd(), 0))?,
            true,
        )?;
        drop(done);
        drop(cancelled);
        // The gated job's callback went with it; signalling now reaches
        // nothing of the unloaded module.
        ok("sw_sync inc", tl.inc(1))
    })();
    let params = fs::read_to_string("/etc/tdrv-params").unwrap_or_default();
    let reload = std::process::Command::new("insmod")
        .arg("/lib/modules/tdrv.ko")
        .args(params.split_whitespace())
        .status()
        .map_err(|e| format!("insmod: {e}"))
        .and_then(|s| {
            if s.success() {
                Ok(())
            } else {
                Err(format!("insmod: {s}"))
            }
        });
    r?;
    reload?;
    wait_node(path)
}
