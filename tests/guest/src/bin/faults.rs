//! Fault injection: fails the 1st, 2nd, 3rd, ... fault-injectable call
//! (slab allocation, page allocation, user copy) of every ioctl, of open(2),
//! of mmap(2) and of the first touch of a mapping in turn, through
//! `/proc/thread-self/fail-nth`, until the call completes without reaching
//! the injected fault.
//!
//! Every failure must be a clean errno from a small allowed set and must
//! lose nothing: channel usage is unchanged after a failed ALLOC, a handle
//! survives a failed FREE, a failed SUBMIT leaves no fence stuck, a failed
//! open leaves no file behind, a failed mmap holds no buffer reference. At
//! the end, with every file closed, the channels' usage equals the start.
//! (kmemleak after rmmod and the dmesg check of the guest cover the rest.)
//!
//! A sweep counts only if it tested something: for a call that can fail,
//! at least one injected fault must fail it (with an allowed errno; the
//! calls that allocate nothing get their argument in an untouched mapping,
//! so that the kernel's first touch of it, through tdrv's fault handler,
//! is the injection point and must give EFAULT); a user-space touch of a
//! mapping cannot fail, so there every injected fault must be absorbed (the
//! fault is retried); close(2) cannot report a failure, so its release
//! must reach no injection point at all.
//!
//! fail-nth semantics: writing N makes the N-th fault-injectable call of
//! this thread fail; reading back 0 means the fault was injected, non-zero
//! means the calls in between did not reach the N-th site.
//!
//! usage: faults [/dev/tdrvN]

use std::{
    collections::BTreeMap,
    ffi::CString,
    fs,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::Duration,
};

use tdrv_guest_tests::{
    bail::require,
    channel_usage, desc, device_stat, errno_name, expect_eq, expect_err, install_fatal_handlers,
    ok, open_device_or_skip,
    raw::{errno, page_size, Dev, Errno},
    skip_all, wait_usage, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

/// Number of open descriptors of this process.
fn open_fds() -> Result<usize, String> {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .map_err(|e| format!("/proc/self/fd: {e}"))
}

/// Injection points tried per operation before giving up: no tdrv call
/// comes near this many allocations, so reaching it means the call keeps
/// failing (or the counting is broken) and must not loop forever.
const MAX_POINTS: u32 = 500;

/// Timeout of the waits under injection (µs). It only turns a lost job
/// into a failure instead of a hang: every wait returns at its job's end,
/// so the bound is generous (the sim device's jobs run on the host's
/// clock, which a busy host stretches), and ETIMEDOUT, never an allowed
/// outcome, means a job that did not end.
const WAIT_US: i64 = 120_000_000;
/// Bytes of the synchronous transfers: more than two pages, so that user
/// copies cross page boundaries.
const XFER: usize = 8200;
/// Bound of the waits for released memory: only turns a hang into a
/// failure (the release is asynchronous, never timed).
const HANG: Duration = Duration::from_secs(60);
/// Bytes of each job: tiny, because the edu device needs ~0.1 s per chunk.
const JOB: u64 = 64;

/// Debugfs settings so that injection reaches the driver's allocations
/// (sleeping ones, order 0 pages) and prints nothing: with `verbose` > 1
/// every injected fault dumps a stack, and the guest's dmesg check fails the
/// run on any `Call Trace`.
const SETTINGS: &[(&str, &str)] = &[
    ("failslab/ignore-gfp-wait", "N"),
    ("failslab/verbose", "0"),
    ("fail_page_alloc/ignore-gfp-wait", "N"),
    ("fail_page_alloc/ignore-gfp-highmem", "N"),
    ("fail_page_alloc/min-order", "0"),
    ("fail_page_alloc/verbose", "0"),
    ("fail_usercopy/verbose", "0"),
];

/// This thread's `/proc/thread-self/fail-nth`.
struct FailNth {
    fd: OwnedFd,
}

impl FailNth {
    fn open() -> Result<Self, String> {
        let path = c"/proc/thread-self/fail-nth";
        // SAFETY: a valid NUL-terminated path.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(format!(
                "open /proc/thread-self/fail-nth: {} (kernel without CONFIG_FAULT_INJECTION?)",
                errno_name(errno())
            ));
        }
        // SAFETY: `fd` was just opened and is owned by nobody else.
        Ok(FailNth {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    fn raw(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.fd.as_raw_fd()
    }

    /// Writes `n`. Formats on the stack: nothing may allocate (and so
    /// possibly call into the kernel) between arming and the call under test.
    fn write(&self, n: u32) -> isize {
        let mut buf = [0u8; 12];
        let mut i = buf.len();
        let mut v = n;
        loop {
            i -= 1;
            buf[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        let digits = &buf[i..];
        // SAFETY: `digits` is a live buffer of that length.
        unsafe { libc::write(self.raw(), digits.as_ptr().cast(), digits.len()) }
    }

    /// Makes the `n`-th fault-injectable call of this thread from now fail.
    fn arm(&self, n: u32) -> R {
        if self.write(n) < 0 {
            return Err(format!("arming fail-nth: {}", errno_name(errno())));
        }
        Ok(())
    }

    /// Whether the armed fault was injected; disarms in any case.
    fn take(&self) -> bool {
        let mut buf = [0u8; 16];
        // The value is formatted before the read's own user copy, which is
        // itself a fault site: if the count was 1 that copy consumes it and
        // the read fails with EFAULT. Either way the call under test did not
        // reach the fault.
        // SAFETY: `buf` is a live buffer of that length.
        let n = unsafe { libc::pread(self.raw(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        let injected = n > 0
            && std::str::from_utf8(&buf[..n as usize])
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                == Some(0);
        // Writing 0 disarms. Its user copy is a fault site too: if the count
        // was 1 the write fails with EFAULT, having disarmed by consuming it.
        self.write(0);
        injected
    }
}

/// Runs `call` with its `n`-th fault-injectable call failing; returns its
/// result and whether the fault was injected.
fn inject<T>(fail: &FailNth, n: u32, call: impl FnOnce() -> T) -> Result<(T, bool), String> {
    fail.arm(n)?;
    let r = call();
    let injected = fail.take();
    Ok((r, injected))
}

/// One attempt at injection point `n`: the call's result (errno only) and
/// whether the fault was injected.
type Shot = (Result<(), Errno>, bool);

/// How the injected faults of a sweep must end.
#[derive(Clone, Copy)]
enum Expect {
    /// At least one injection point fails the call, and every failure is
    /// one of these errnos. A sweep where every injected fault was
    /// absorbed exercised no error path and fails.
    Fails(&'static [Errno]),
    /// The call cannot fail (the reason says why): every injected fault
    /// must be absorbed, and the sweep checks that nothing was lost. At
    /// least one fault must have been injected.
    Absorbs(&'static str),
    /// The call must reach no injection point at all (the reason says
    /// why): a path that cannot report an error must not allocate.
    NoPoints(&'static str),
}

/// Fails injection points 1, 2, 3, ... of one operation until it completes
/// without reaching the fault. Returns the summary for the TAP line. A
/// sweep that reached no injection point, or (with [`Expect::Fails`]) one
/// where no injected fault failed the call, tested nothing and is an error.
fn sweep(
    expect: Expect,
    mut attempt: impl FnMut(u32) -> Result<Shot, String>,
) -> Result<String, String> {
    let mut failed: BTreeMap<Errno, u32> = BTreeMap::new();
    // Injected faults the call survived (a fallback, a retry, or a fault in
    // a debugging allocator's own bookkeeping).
    let mut absorbed = 0u32;
    // TDRV_FAULTS_VERBOSE=1 lists every point, to reproduce one by hand.
    let verbose = std::env::var_os("TDRV_FAULTS_VERBOSE").is_some();
    for n in 1..=MAX_POINTS {
        let (r, injected) = attempt(n).map_err(|e| format!("injection point {n}: {e}"))?;
        if verbose {
            println!(
                "# point {n}: {}, fault {}",
                r.map_or_else(errno_name, |()| "ok".into()),
                if injected { "injected" } else { "not reached" }
            );
        }
        match (r, injected) {
            (Ok(()), false) => {
                let points = n - 1;
                let hist: Vec<String> = failed
                    .iter()
                    .map(|(e, k)| format!("{} x{k}", errno_name(*e)))
                    .collect();
                let summary = format!(
                    "{points} injection points: failed with [{}], {absorbed} absorbed",
                    hist.join(", ")
                );
                if let Expect::NoPoints(why) = expect {
                    if points > 0 {
                        return Err(format!("{summary}, although {why}"));
                    }
                    return Ok(format!("no injection point: {why}"));
                }
                if points == 0 {
                    return Err(
                        "no injection point: the call completed without reaching any fault-injectable step".into(),
                    );
                }
                if let Expect::Fails(_) = expect {
                    if failed.is_empty() {
                        return Err(format!(
                            "{summary}: no injected fault failed the call, so no error path was tested"
                        ));
                    }
                }
                return Ok(summary);
            }
            (Ok(()), true) => {
                if let Expect::NoPoints(why) = expect {
                    return Err(format!(
                        "injection point {n} was reached (and absorbed), although {why}"
                    ));
                }
                absorbed += 1
            }
            (Err(e), true) => match expect {
                Expect::Fails(allowed) if allowed.contains(&e) => {
                    *failed.entry(e).or_default() += 1
                }
                Expect::Fails(allowed) => {
                    let names: Vec<String> = allowed.iter().map(|e| errno_name(*e)).collect();
                    return Err(format!(
                        "injection point {n}: failed with {}, not one of {}",
                        errno_name(e),
                        names.join(", ")
                    ));
                }
                Expect::Absorbs(why) | Expect::NoPoints(why) => {
                    return Err(format!(
                        "injection point {n}: failed with {} although {why}",
                        errno_name(e)
                    ))
                }
            },
            (Err(e), false) => {
                return Err(format!(
                "injection point {n}: failed with {} although the injected fault was never reached",
                errno_name(e)
            ))
            }
        }
    }
    Err(format!(
        "still reaching injected faults after {MAX_POINTS} points: not converging"
    ))
}

/// Issues `request` with its argument `arg` in a fresh, never touched
/// mapping of the one-page buffer `argbuf`, with the `n`-th fault-injectable
/// call failing. The kernel's own first touch of the argument runs tdrv's
/// fault handler, whose page-table allocation is an injection point: a
/// failure there is a kernel-mode fault, which the ioctl must turn into
/// EFAULT. (The driver reads and writes small arguments with get_user and
/// put_user, which fail_usercopy does not cover: with the argument on the
/// stack those ioctls reach no injection point at all.) Returns the
/// argument as the kernel left it, and whether the fault was injected.
fn ioctl_untouched_arg<T: Copy>(
    dev: &Dev,
    fail: &FailNth,
    n: u32,
    argbuf: &tdrv_alloc,
    request: u64,
    arg: T,
) -> Result<(Result<T, Errno>, bool), String> {
    assert!(std::mem::size_of::<T>() <= page_size());
    // SAFETY: `arg` is a plain-old-data uapi struct, readable as bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            std::ptr::from_ref(&arg).cast::<u8>(),
            std::mem::size_of::<T>(),
        )
    };
    ok(
        "copy_in of the argument",
        dev.copy_in(argbuf.handle, 0, bytes),
    )?;
    let p = ok(
        "mmap of the argument",
        mmap_fresh(dev.fd(), argbuf.mmap_offset, page_size(), n),
    )?;
    // SAFETY: `p` maps a whole page that holds no Rust object; the kernel
    // writes at most the size encoded in `request`, within that page.
    let (r, inj) = inject(fail, n, || unsafe { dev.ioctl_addr(request, p as usize) })?;
    // SAFETY: `p` maps a page of `argbuf`, at least `size_of::<T>()` bytes.
    let out = unsafe { std::ptr::read_unaligned(p.cast::<T>()) };
    // SAFETY: unmaps exactly that mapping.
    unsafe { libc::munmap(p.cast(), page_size()) };
    Ok((r.map(|_| out), inj))
}

/// What a call may fail with when one of its allocations or user copies
/// fails. ENOSPC and EAGAIN are the per-file and per-channel limits; EINTR
/// covers waits that treat a failed step as an interruption.
const ALLOWED: &[Errno] = &[
    libc::ENOMEM,
    libc::EFAULT,
    libc::ENOSPC,
    libc::EAGAIN,
    libc::EINTR,
];
/// The expectation of most sweeps.
const FAILS: Expect = Expect::Fails(ALLOWED);
/// A call whose only injection points are the first touch of its argument.
const EFAULT_ONLY: Expect = Expect::Fails(&[libc::EFAULT]);

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// `(used_bytes, buffers)` of channel 0, where every buffer of this test lives.
fn usage0(dev: &Dev) -> Result<(u64, u64), String> {
    ok("channel_info", dev.channel_info(0)).map(|c| (c.used_bytes, c.buffers))
}

/// Waits (bounded) for a job that must succeed.
fn wait_done(dev: &Dev, id: u64) -> R {
    let (state, status) = ok("job_wait", dev.job_wait(id, WAIT_US))?;
    expect_eq("job state", state, TDRV_JOB_DONE)?;
    expect_eq("job status", status, 0)
}

fn read_bytes(dev: &Dev, h: u64, offset: u64, len: usize) -> Result<Vec<u8>, String> {
    let mut out = vec![0xA5u8; len];
    ok("copy_out", dev.copy_out(h, offset, &mut out))?;
    Ok(out)
}

fn mmap_raw(fd: i32, offset: u64, len: usize) -> Result<*mut u8, Errno> {
    // SAFETY: a fresh shared mapping chosen by the kernel; no Rust object
    // lives there.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        Err(errno())
    } else {
        Ok(p.cast())
    }
}

/// Maps `len` bytes at `offset` at an address of its own 1 GiB region, so
/// that the first touch must allocate page-table pages as well (injection
/// points in the fault path); falls back to any address if that is taken.
fn mmap_fresh(fd: i32, offset: u64, len: usize, n: u32) -> Result<*mut u8, Errno> {
    let hint = 0x5000_0000_0000usize + (n as usize % 4096) * (1 << 30);
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping: it
    // fails with EEXIST instead.
    let p = unsafe {
        libc::mmap(
            hint as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE,
            fd,
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return mmap_raw(fd, offset, len);
    }
    Ok(p.cast())
}

/// Applies [`SETTINGS`]; returns the previous values to restore.
fn configure() -> Result<Vec<(String, String)>, String> {
    let mut saved = Vec::new();
    for (file, value) in SETTINGS {
        let path = format!("/sys/kernel/debug/{file}");
        let old = std::fs::read_to_string(&path).map_err(|e| format!("read {path}: {e}"))?;
        std::fs::write(&path, value).map_err(|e| format!("write {value} to {path}: {e}"))?;
        let now = std::fs::read_to_string(&path).map_err(|e| format!("read {path}: {e}"))?;
        expect_eq(&path, now.trim(), *value)?;
        saved.push((path, old.trim().to_string()));
    }
    Ok(saved)
}

fn main() {
    let (dev_owned, path, version) = open_device_or_skip("/dev/tdrv0", None);
    // A kernel built without fault injection (a distro kernel) cannot run
    // this program. The test kernel always has it: scripts/kernel fails the
    // build if any option of its fragment is dropped.
    if !std::path::Path::new("/proc/thread-self/fail-nth").exists() {
        skip_all("kernel without CONFIG_FAULT_INJECTION (no /proc/thread-self/fail-nth)");
    }
    let dev = &dev_owned;
    // A touch of a mapping that dies of SIGBUS says where.
    install_fatal_handlers();
    let mut t = Tap::new(27);
    t.note(format!(
        "device {path}: kind {}, every ioctl, open, mmap and mapping touch with its 1st, 2nd, ... fault-injectable call failing",
        version.device_kind
    ));
    // Preconditions, not checks: without them no sweep can run, and the
    // test kernel must have fault injection (a failure bails out).
    let start = require(
        "channel usage at start",
        channel_usage(dev, version.num_channels),
    );
    let files_at_start = device_stat(&path, "open_files");
    // Sleeping allocations, order 0 pages, silent.
    let saved = require("configuring fault injection", configure());
    let fail = &require("opening fail-nth", FailNth::open());

    // Standing buffers for the transfer and job ioctls, and the page that
    // carries the arguments of the sweeps with an untouched argument.
    let a = require("alloc", dev.alloc(XFER as u64, 0)).handle;
    let b = require("alloc", dev.alloc(XFER as u64, 0)).handle;
    let argbuf = require("alloc", dev.alloc(page_size() as u64, 0));
    let argbuf = &argbuf;

    let report = |t: &mut Tap, name: &str, r: Result<String, String>| match r {
        Ok(summary) => t.check(&format!("{name}: {summary}"), true),
        Err(e) => t.check(name, Err::<(), _>(e)),
    };

    // VERSION, CHANNEL_INFO, BUF_INFO and COMPLETION_WAIT allocate
    // nothing: their injection points are the first touch of an argument
    // that lives in an untouched mapping, and each must fail with EFAULT.
    report(
        &mut t,
        "VERSION, argument in an untouched mapping",
        sweep(EFAULT_ONLY, |n| {
            let (r, inj) = ioctl_untouched_arg(
                dev,
                fail,
                n,
                argbuf,
                TDRV_IOC_VERSION,
                tdrv_version::default(),
            )?;
            if let Ok(v) = &r {
                expect_eq("abi_major", v.abi_major, TDRV_ABI_MAJOR)?;
                expect_eq("num_channels", v.num_channels, version.num_channels)?;
            }
            Ok((r.map(drop), inj))
        }),
    );

    report(
        &mut t,
        "CHANNEL_INFO, argument in an untouched mapping",
        sweep(EFAULT_ONLY, |n| {
            let before = usage0(dev)?;
            let arg = tdrv_channel_info {
                channel: 0,
                ..Default::default()
            };
            let (r, inj) = ioctl_untouched_arg(dev, fail, n, argbuf, TDRV_IOC_CHANNEL_INFO, arg)?;
            if let Ok(c) = &r {
                expect_eq("used_bytes, buffers", (c.used_bytes, c.buffers), before)?;
            }
            expect_eq("usage", usage0(dev)?, before)?;
            Ok((r.map(drop), inj))
        }),
    );

    // One page; one multi-page piece; more than one piece can hold.
    for (name, size) in [
        ("ALLOC 4 KiB", 4096u64),
        ("ALLOC 64 KiB + 1", (64 << 10) + 1),
        ("ALLOC 4 MiB + 4 KiB", (4 << 20) + 4096),
    ] {
        report(
            &mut t,
            name,
            sweep(FAILS, |n| {
                let before = usage0(dev)?;
                let (r, inj) = inject(fail, n, || dev.alloc(size, 0))?;
                match &r {
                    Ok(x) => {
                        let (used, bufs) = usage0(dev)?;
                        if bufs != before.1 + 1 || used < before.0 + size {
                            return Err(format!(
                                "usage {:?} after ALLOC of {size} from {before:?}",
                                (used, bufs)
                            ));
                        }
                        expect_eq(
                            "zeroed",
                            read_bytes(dev, x.handle, size - 16, 16)?,
                            vec![0; 16],
                        )?;
                        ok("free", dev.free(x.handle))?;
                        expect_eq("usage after FREE", usage0(dev)?, before)?;
                    }
                    Err(e) => expect_eq(
                        &format!("usage after ALLOC failed with {}", errno_name(*e)),
                        usage0(dev)?,
                        before,
                    )?,
                }
                Ok((r.map(drop), inj))
            }),
        );
    }

    report(
        &mut t,
        "FREE",
        sweep(FAILS, |n| {
            let before = usage0(dev)?;
            let x = ok("alloc", dev.alloc(4096, 0))?.handle;
            let (r, inj) = inject(fail, n, || dev.free(x))?;
            match r {
                Ok(()) => expect_err("BUF_INFO after FREE", dev.buf_info(x), libc::ENOENT)?,
                Err(_) => {
                    // The handle must have survived the failed FREE.
                    ok("BUF_INFO after failed FREE", dev.buf_info(x))?;
                    ok(
                        "COPY_IN after failed FREE",
                        dev.copy_in(x, 1, b"still here"),
                    )?;
                    expect_eq("data", read_bytes(dev, x, 1, 10)?, b"still here".to_vec())?;
                    ok("FREE after failed FREE", dev.free(x))?;
                }
            }
            expect_eq("usage", usage0(dev)?, before)?;
            Ok((r, inj))
        }),
    );

    report(
        &mut t,
        "BUF_INFO, argument in an untouched mapping",
        sweep(EFAULT_ONLY, |n| {
            let arg = tdrv_buf_info {
                handle: a,
                ..Default::default()
            };
            let (r, inj) = ioctl_untouched_arg(dev, fail, n, argbuf, TDRV_IOC_BUF_INFO, arg)?;
            match &r {
                Ok(i) => expect_eq("size", i.size, XFER as u64)?,
                Err(_) => {
                    let i = ok("BUF_INFO after failed BUF_INFO", dev.buf_info(a))?;
                    expect_eq("size", i.size, XFER as u64)?;
                }
            }
            Ok((r.map(drop), inj))
        }),
    );

    // dma-buf export and import: a failure leaves no fd, handle or
    // channel byte behind, and the call works again.
    let fds = || {
        fs::read_dir("/proc/self/fd")
            .map(|d| d.count())
            .unwrap_or(0)
    };
    report(
        &mut t,
        "EXPORT",
        sweep(FAILS, |n| {
            let before = (usage0(dev)?, fds());
            let (r, inj) = inject(fail, n, || dev.export(a))?;
            let failed = r.is_err();
            // Closes an exported fd: its buffer reference goes with it.
            let r = r.map(drop);
            expect_eq("usage and fds", (usage0(dev)?, fds()), before)?;
            if failed {
                ok("EXPORT after failed EXPORT", dev.export(a))?;
            }
            Ok((r, inj))
        }),
    );

    report(
        &mut t,
        "IMPORT of an export",
        sweep(FAILS, |n| {
            let fd = ok("export", dev.export(a))?;
            let (r, inj) = inject(fail, n, || dev.import(fd.as_raw_fd(), 0))?;
            match &r {
                Ok(i) => {
                    expect_eq("size", i.size, XFER as u64)?;
                    ok("free", dev.free(i.handle))?;
                }
                Err(_) => {
                    let i = ok("IMPORT after failed IMPORT", dev.import(fd.as_raw_fd(), 0))?;
                    ok("free", dev.free(i.handle))?;
                }
            }
            Ok((r.map(drop), inj))
        }),
    );

    // (IMPORT of a foreign dma-buf is not swept: when the exporter's
    // kernel mapping fails for lack of memory, the dma-buf core itself
    // WARNs (dma_buf_vmap's WARN_ON_ONCE), which the dmesg check would
    // count against tdrv. tdrv's own error path there is the one IMPORT of
    // an export takes after the lookup, plus the import's release.)

    report(
        &mut t,
        "COPY_IN",
        sweep(FAILS, |n| {
            let data = pattern(XFER, n as u8);
            let (r, inj) = inject(fail, n, || dev.copy_in(a, 0, &data))?;
            if r.is_err() {
                // A partial copy is allowed; the buffer must still work.
                ok("COPY_IN after failed COPY_IN", dev.copy_in(a, 0, &data))?;
            }
            expect_eq("data", read_bytes(dev, a, 0, XFER)? == data, true)?;
            Ok((r, inj))
        }),
    );

    report(&mut t, "COPY_OUT", {
        let data = pattern(XFER, 0x5c);
        match ok("copy_in", dev.copy_in(a, 0, &data)) {
            Err(e) => Err(e),
            Ok(()) => sweep(FAILS, |n| {
                // Filled (so touched) before arming: a first touch inside
                // the copy would spend injection points on page faults.
                let mut out = vec![0xA5u8; XFER];
                let (r, inj) = inject(fail, n, || dev.copy_out(a, 0, &mut out))?;
                if r.is_ok() {
                    expect_eq("data", out == data, true)?;
                }
                Ok((r, inj))
            }),
        }
    });

    // A buffer mapping as the user side of COPY_IN and COPY_OUT: pages that
    // cannot be pinned, which a DMA engine copies through a bounce buffer.
    // Touched before arming, so that no fault of the mapping spends an
    // injection point.
    let mut mapped = dev
        .alloc(XFER as u64, 0)
        .and_then(|m| Ok((m, dev.map(&m)?)));
    report(&mut t, "COPY_IN from a buffer mapping", {
        match &mut mapped {
            Err(e) => Err(format!("alloc and mmap: {}", errno_name(*e))),
            Ok((_, map)) => sweep(FAILS, |n| {
                let data = pattern(XFER, n as u8 ^ 0x33);
                map.as_mut_slice()[..XFER].copy_from_slice(&data);
                let src = &map.as_slice()[..XFER];
                let (r, inj) = inject(fail, n, || dev.copy_in(a, 0, src))?;
                if r.is_err() {
                    ok("COPY_IN after failed COPY_IN", dev.copy_in(a, 0, src))?;
                }
                expect_eq("data", read_bytes(dev, a, 0, XFER)? == data, true)?;
                Ok((r, inj))
            }),
        }
    });
    report(&mut t, "COPY_OUT into a buffer mapping", {
        let data = pattern(XFER, 0x6d);
        match (&mut mapped, dev.copy_in(a, 0, &data)) {
            (Err(e), _) => Err(format!("alloc and mmap: {}", errno_name(*e))),
            (_, Err(e)) => Err(format!("copy_in: {}", errno_name(e))),
            (Ok((_, map)), Ok(())) => sweep(FAILS, |n| {
                let out = &mut map.as_mut_slice()[..XFER];
                out.fill(0xA5);
                let (r, inj) = inject(fail, n, || dev.copy_out(a, 0, out))?;
                if r.is_ok() {
                    expect_eq("data", out == &data[..], true)?;
                }
                Ok((r, inj))
            }),
        }
    });
    if let Ok((m, map)) = mapped {
        drop(map);
        let _ = dev.free(m.handle);
    }

    report(
        &mut t,
        "MEMSET",
        sweep(FAILS, |n| {
            let v = n & 0xff;
            ok("memset", dev.memset(a, 0, XFER as u64, 0xEE))?;
            let (r, inj) = inject(fail, n, || dev.memset(a, 1, XFER as u64 - 2, v))?;
            if r.is_ok() {
                let out = read_bytes(dev, a, 0, XFER)?;
                let good = out[0] == 0xEE
                    && out[XFER - 1] == 0xEE
                    && out[1..XFER - 1].iter().all(|x| u32::from(*x) == v);
                expect_eq("memset range", good, true)?;
            }
            Ok((r, inj))
        }),
    );

    report(
        &mut t,
        "COPY",
        sweep(FAILS, |n| {
            let data = pattern(XFER, n as u8);
            ok("copy_in", dev.copy_in(a, 0, &data))?;
            ok("memset", dev.memset(b, 0, XFER as u64, 0))?;
            let (r, inj) = inject(fail, n, || dev.copy(desc(a, 3, b, 5, 8000)))?;
            if r.is_ok() {
                expect_eq(
                    "copied bytes",
                    read_bytes(dev, b, 5, 8000)? == data[3..8003],
                    true,
                )?;
            }
            Ok((r, inj))
        }),
    );

    report(
        &mut t,
        "SUBMIT",
        sweep(FAILS, |n| {
            let data = pattern(JOB as usize, n as u8);
            ok("copy_in", dev.copy_in(a, 0, &data))?;
            ok("memset", dev.memset(b, 0, JOB, 0))?;
            // Two descriptors: per-descriptor work is injected too.
            let half = JOB / 2;
            let descs = [desc(a, 0, b, 0, half), desc(a, half, b, half, half)];
            let (r, inj) = inject(fail, n, || dev.submit(&descs))?;
            match r {
                Ok(id) => {
                    wait_done(dev, id)?;
                    expect_eq("job result", read_bytes(dev, b, 0, JOB as usize)?, data)?;
                }
                Err(_) => {
                    // Whatever was queued must drain: no fence stays held.
                    ok("FENCE_WAIT src", dev.fence_wait(a, TDRV_FENCE_ALL, WAIT_US))?;
                    ok("FENCE_WAIT dst", dev.fence_wait(b, TDRV_FENCE_ALL, WAIT_US))?;
                }
            }
            Ok((r.map(drop), inj))
        }),
    );

    if version.features & u64::from(TDRV_FEAT_FENCE_FD) != 0 {
        report(
            &mut t,
            "SUBMIT with an in-fence and an out-fence",
            sweep(FAILS, |n| {
                let data = pattern(JOB as usize, n as u8);
                ok("copy_in", dev.copy_in(a, 0, &data))?;
                ok("memset", dev.memset(b, 0, JOB, 0))?;
                // A signalled in-fence: an earlier job's out-fence.
                let (id0, fd0) = ok(
                    "submit (in-fence)",
                    dev.submit_fences(&[desc(a, 0, b, 0, 8)], &[], true),
                )?;
                // SAFETY: the driver just installed this descriptor for us.
                let gate = unsafe { OwnedFd::from_raw_fd(fd0) };
                wait_done(dev, id0)?;
                let fds = open_fds()?;
                let descs = [desc(a, 0, b, 0, JOB)];
                let (r, inj) = inject(fail, n, || {
                    dev.submit_fences(&descs, &[gate.as_raw_fd()], true)
                })?;
                match r {
                    Ok((id, fd)) => {
                        // SAFETY: as above.
                        let out = unsafe { OwnedFd::from_raw_fd(fd) };
                        wait_done(dev, id)?;
                        expect_eq("job result", read_bytes(dev, b, 0, JOB as usize)?, data)?;
                        expect_eq("fds after", open_fds()?, fds + 1)?;
                        drop(out);
                    }
                    Err(_) => {
                        // Nothing queued or leaked: no mark, no fd.
                        ok("FENCE_WAIT src", dev.fence_wait(a, TDRV_FENCE_ALL, WAIT_US))?;
                        ok("FENCE_WAIT dst", dev.fence_wait(b, TDRV_FENCE_ALL, WAIT_US))?;
                        expect_eq("fds after a failure", open_fds()?, fds)?;
                    }
                }
                Ok((r.map(drop), inj))
            }),
        );
    } else {
        t.skip(
            "SUBMIT with an in-fence and an out-fence",
            "kernel without CONFIG_SYNC_FILE (TDRV_FEAT_FENCE_FD unset)",
        );
    }

    report(
        &mut t,
        "JOB_WAIT",
        sweep(FAILS, |n| {
            let id = ok("submit", dev.submit(&[desc(a, 0, b, 0, JOB)]))?;
            let (r, inj) = inject(fail, n, || dev.job_wait(id, WAIT_US))?;
            match r {
                Ok((state, status)) => {
                    expect_eq("state", state, TDRV_JOB_DONE)?;
                    expect_eq("status", status, 0)?;
                }
                // The job is not lost by a failed wait.
                Err(_) => wait_done(dev, id)?,
            }
            Ok((r.map(drop), inj))
        }),
    );

    report(
        &mut t,
        "FENCE_WAIT",
        sweep(FAILS, |n| {
            let id = ok("submit", dev.submit(&[desc(a, 0, b, 0, JOB)]))?;
            let (r, inj) = inject(fail, n, || dev.fence_wait(b, TDRV_FENCE_ALL, WAIT_US))?;
            if r.is_ok() {
                let i = ok("buf_info", dev.buf_info(b))?;
                expect_eq(
                    "pending after FENCE_WAIT",
                    (i.pending_reads, i.pending_writes),
                    (0, 0),
                )?;
            }
            wait_done(dev, id)?;
            Ok((r, inj))
        }),
    );

    report(
        &mut t,
        "COMPLETION_WAIT, argument in an untouched mapping",
        sweep(EFAULT_ONLY, |n| {
            let c0 = ok("buf_info", dev.buf_info(b))?.completion_count;
            let id = ok("submit", dev.submit(&[desc(a, 0, b, 0, JOB)]))?;
            let arg = tdrv_completion_wait {
                handle: b,
                expected: c0 + 1,
                timeout_us: WAIT_US,
                ..Default::default()
            };
            let (r, inj) =
                ioctl_untouched_arg(dev, fail, n, argbuf, TDRV_IOC_COMPLETION_WAIT, arg)?;
            if let Ok(c) = &r {
                if c.count < c0 + 1 {
                    return Err(format!("count {} < expected {}", c.count, c0 + 1));
                }
            }
            // A failed wait loses no completion.
            wait_done(dev, id)?;
            let c1 = ok("buf_info", dev.buf_info(b))?.completion_count;
            expect_eq("completion_count after the job", c1, c0 + 1)?;
            Ok((r.map(drop), inj))
        }),
    );

    report(
        &mut t,
        "COMPLETION_RESET",
        sweep(FAILS, |n| {
            let id = ok("submit", dev.submit(&[desc(a, 0, b, 0, JOB)]))?;
            wait_done(dev, id)?;
            let c0 = ok("buf_info", dev.buf_info(b))?.completion_count;
            let (r, inj) = inject(fail, n, || dev.completion_reset(b))?;
            let c1 = ok("buf_info", dev.buf_info(b))?.completion_count;
            let want = if r.is_ok() { 0 } else { c0 };
            expect_eq("completion_count", c1, want)?;
            Ok((r, inj))
        }),
    );

    report(&mut t, "open", {
        let cpath = CString::new(path.as_str()).expect("device path has no NUL");
        sweep(FAILS, |n| {
            let before = usage0(dev)?;
            let (r, inj) = inject(fail, n, || {
                // SAFETY: a valid NUL-terminated path.
                let fd = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
                if fd < 0 {
                    Err(errno())
                } else {
                    // SAFETY: `fd` was just opened and is owned by nobody else.
                    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
                }
            })?;
            if let Ok(fd) = &r {
                let other = Dev::from_fd(fd.try_clone().map_err(|e| e.to_string())?);
                let x = ok("alloc in the new file", other.alloc(4096, 0))?;
                ok("buf_info in the new file", other.buf_info(x.handle))?;
            }
            let r = r.map(drop);
            // The new file (if any) is closed by now: its buffer went with it,
            // and a failed open left no file registered.
            expect_eq("usage", usage0(dev)?, before)?;
            if let Some(files) = files_at_start {
                expect_eq("open_files", device_stat(&path, "open_files"), Some(files))?;
            }
            Ok((r, inj))
        })
    });

    let page = page_size();
    report(
        &mut t,
        "mmap",
        sweep(FAILS, |n| {
            let before = usage0(dev)?;
            let x = ok("alloc", dev.alloc(2 * page as u64, 0))?;
            let data = pattern(2 * page, n as u8);
            ok("copy_in", dev.copy_in(x.handle, 0, &data))?;
            let (r, inj) = inject(fail, n, || mmap_raw(dev.fd(), x.mmap_offset, 2 * page))?;
            if let Ok(p) = r {
                // SAFETY: `p` maps the two pages of `x`.
                let seen = unsafe { [p.read_volatile(), p.add(page + 7).read_volatile()] };
                // SAFETY: unmaps exactly that mapping.
                unsafe { libc::munmap(p.cast(), 2 * page) };
                expect_eq("mapped bytes", seen, [data[0], data[page + 7]])?;
            }
            ok("free", dev.free(x.handle))?;
            // A failed mmap must not keep a buffer reference: with the
            // handle freed and nothing mapped, the memory is released now.
            expect_eq("usage after FREE", usage0(dev)?, before)?;
            Ok((r.map(drop), inj))
        }),
    );

    report(
        &mut t,
        "first touch of a mapping from user space is retried",
        sweep(
            Expect::Absorbs(
                "a user-space page fault that cannot allocate returns VM_FAULT_OOM and is retried",
            ),
            |n| {
                let before = usage0(dev)?;
                let x = ok("alloc", dev.alloc(2 * page as u64, 0))?;
                let data = pattern(2 * page, n as u8);
                ok("copy_in", dev.copy_in(x.handle, 0, &data))?;
                let p = ok("mmap", mmap_fresh(dev.fd(), x.mmap_offset, 2 * page, n))?;
                let v = (n as u8) ^ 0xFF;
                // A fault handler that cannot allocate retries or fails the
                // access: a SIGBUS here would kill the program (and be a bug).
                let (seen, inj) = inject(fail, n, || {
                    // SAFETY: `p` maps the two pages of `x`.
                    unsafe {
                        let seen = [p.read_volatile(), p.add(page).read_volatile()];
                        p.add(1).write_volatile(v);
                        p.add(page + 1).write_volatile(v);
                        seen
                    }
                })?;
                // SAFETY: unmaps exactly that mapping.
                unsafe { libc::munmap(p.cast(), 2 * page) };
                expect_eq("bytes read", seen, [data[0], data[page]])?;
                expect_eq(
                    "bytes written",
                    [
                        read_bytes(dev, x.handle, 1, 1)?[0],
                        read_bytes(dev, x.handle, page as u64 + 1, 1)?[0],
                    ],
                    [v, v],
                )?;
                ok("free", dev.free(x.handle))?;
                expect_eq("usage after FREE", usage0(dev)?, before)?;
                Ok((Ok(()), inj))
            },
        ),
    );

    report(
        &mut t,
        "munmap splitting a mapping",
        sweep(FAILS, |n| {
            let before = usage0(dev)?;
            let x = ok("alloc", dev.alloc(3 * page as u64, 0))?;
            let p = ok("mmap", mmap_raw(dev.fd(), x.mmap_offset, 3 * page))?;
            ok("free", dev.free(x.handle))?;
            // Unmapping the middle page splits the VMA: the kernel allocates
            // for the split and the driver's VMA callbacks run for the pieces.
            let (r, inj) = inject(fail, n, || {
                // SAFETY: unmaps the middle page of our own mapping.
                if unsafe { libc::munmap(p.add(page).cast(), page) } < 0 {
                    Err(errno())
                } else {
                    Ok(())
                }
            })?;
            // Whatever happened, the outer pages still map the buffer.
            // SAFETY: pages 0 and 2 of the mapping are mapped either way.
            unsafe {
                p.write_volatile(1);
                p.add(2 * page).write_volatile(2);
            }
            let (used, bufs) = usage0(dev)?;
            if bufs != before.1 + 1 || used <= before.0 {
                return Err(format!(
                    "usage {:?} while mapped, from {before:?}",
                    (used, bufs)
                ));
            }
            // SAFETY: unmaps what is left of the range (holes are fine).
            unsafe { libc::munmap(p.cast(), 3 * page) };
            expect_eq(
                "usage after the last piece is unmapped",
                usage0(dev)?,
                before,
            )?;
            Ok((r, inj))
        }),
    );

    report(
        &mut t,
        "close with buffers, a mapping and a queued job loses nothing",
        sweep(
            Expect::NoPoints("close(2) cannot report a failure, so the release allocates nothing"),
            |n| {
                let before = usage0(dev)?;
                let other = ok("open", Dev::open(&path))?;
                let s = ok("alloc", other.alloc(4096, 0))?;
                let d = ok("alloc", other.alloc(4096, 0))?;
                let m = ok("mmap", other.map(&d))?;
                ok(
                    "submit",
                    other.submit(&[desc(s.handle, 0, d.handle, 0, JOB)]),
                )?;
                use std::os::fd::IntoRawFd;
                let fd = other.into_fd().into_raw_fd();
                // The release runs inside close(2) (task work on the way out).
                let (r, inj) = inject(fail, n, || {
                    // SAFETY: closes the descriptor taken out of `other` above.
                    if unsafe { libc::close(fd) } < 0 {
                        Err(errno())
                    } else {
                        Ok(())
                    }
                })?;
                // The mapping outlives the file; its buffer goes with it.
                drop(m);
                wait_usage(dev, &[before], HANG)?;
                Ok((r, inj))
            },
        ),
    );

    for (p, old) in &saved {
        if let Err(e) = std::fs::write(p, old) {
            t.note(format!("could not restore {p} to {old}: {e}"));
        }
    }

    let freed = (dev.free(a), dev.free(b), dev.free(argbuf.handle));
    drop(dev_owned);
    t.run(
        "with every file closed, channel usage equals the start",
        || {
            ok("free standing buffer", freed.0)?;
            ok("free standing buffer", freed.1)?;
            ok("free argument buffer", freed.2)?;
            // A new file reads the counters (the first one is closed).
            let d = ok("open", Dev::open(&path))?;
            wait_usage(&d, &start, HANG)?;
            // `files_at_start` counted the first file, which `d` replaces.
            expect_eq(
                "open_files",
                device_stat(&path, "open_files"),
                files_at_start,
            )
        },
    );
    t.finish();
}
