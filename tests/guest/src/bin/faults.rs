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

/// Timeout of the waits under injection (µs): long enough for a tiny edu
/// job (~0.1 s of virtual time), short enough that a lost job fails the test
/// instead of hanging it.
const WAIT_US: i64 = 5_000_000;
/// Bytes of the synchronous transfers: more than two pages, so that user
/// copies cross page boundaries.
const XFER: usize = 8200;
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

/// Fails injection points 1, 2, 3, ... of one operation until it completes
/// without reaching the fault. Returns the summary for the TAP line.
fn sweep(mut attempt: impl FnMut(u32) -> Result<Shot, String>) -> Result<String, String> {
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
                let hist: Vec<String> = failed
                    .iter()
                    .map(|(e, k)| format!("{} x{k}", errno_name(*e)))
                    .collect();
                return Ok(format!(
                    "{} injection points: failed with [{}], {absorbed} absorbed",
                    n - 1,
                    hist.join(", ")
                ));
            }
            (Ok(()), true) => absorbed += 1,
            (Err(e), true) if ALLOWED.contains(&e) => *failed.entry(e).or_default() += 1,
            (Err(e), true) => {
                return Err(format!(
                    "injection point {n}: failed with {}, not one of ENOMEM, EFAULT, ENOSPC, EAGAIN, EINTR",
                    errno_name(e)
                ))
            }
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
    let mut t = Tap::new(28);
    t.note(format!(
        "device {path}: kind {}, every ioctl, open, mmap and mapping touch with its 1st, 2nd, ... fault-injectable call failing",
        version.device_kind
    ));
    let start = match channel_usage(dev, version.num_channels) {
        Ok(u) => u,
        Err(e) => {
            t.check("channel usage at start", Err::<(), _>(e));
            t.finish()
        }
    };
    let files_at_start = device_stat(&path, "open_files");

    let mut saved = Vec::new();
    let setup = configure()
        .map(|s| saved = s)
        .and_then(|()| FailNth::open());
    let fail = match setup {
        Ok(f) => {
            t.check(
                "fault injection configured (sleeping allocations, order 0 pages, silent)",
                true,
            );
            f
        }
        Err(e) => {
            // The remaining tests are reported missing, so they count as
            // failures: the test kernel must have fault injection.
            t.check("fault injection configured", Err::<(), _>(e));
            t.finish()
        }
    };
    let fail = &fail;

    // Standing buffers for the transfer and job ioctls.
    let (a, b) = match (dev.alloc(XFER as u64, 0), dev.alloc(XFER as u64, 0)) {
        (Ok(a), Ok(b)) => (a.handle, b.handle),
        (a, b) => {
            t.check(
                "standing buffers",
                Err::<(), _>(format!("alloc: {a:?} {b:?}")),
            );
            t.finish()
        }
    };

    let report = |t: &mut Tap, name: &str, r: Result<String, String>| match r {
        Ok(summary) => t.check(&format!("{name}: {summary}"), true),
        Err(e) => t.check(name, Err::<(), _>(e)),
    };

    report(
        &mut t,
        "VERSION",
        sweep(|n| {
            let (r, inj) = inject(fail, n, || dev.version())?;
            if let Ok(v) = &r {
                expect_eq("abi_major", v.abi_major, TDRV_ABI_MAJOR)?;
            }
            Ok((r.map(drop), inj))
        }),
    );

    report(
        &mut t,
        "CHANNEL_INFO",
        sweep(|n| {
            let before = usage0(dev)?;
            let (r, inj) = inject(fail, n, || dev.channel_info(0))?;
            if let Ok(c) = &r {
                expect_eq("used_bytes, buffers", (c.used_bytes, c.buffers), before)?;
            }
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
            sweep(|n| {
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
        sweep(|n| {
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
        "BUF_INFO",
        sweep(|n| {
            let (r, inj) = inject(fail, n, || dev.buf_info(a))?;
            match &r {
                Ok(i) => expect_eq("size", i.size, XFER as u64)?,
                Err(_) => {
                    ok("BUF_INFO after failed BUF_INFO", dev.buf_info(a))?;
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
        sweep(|n| {
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
        sweep(|n| {
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
        sweep(|n| {
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
            Ok(()) => sweep(|n| {
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
            Ok((_, map)) => sweep(|n| {
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
            (Ok((_, map)), Ok(())) => sweep(|n| {
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
        sweep(|n| {
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
        sweep(|n| {
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
        sweep(|n| {
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
            sweep(|n| {
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
        sweep(|n| {
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
        sweep(|n| {
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
        "COMPLETION_WAIT",
        sweep(|n| {
            let c0 = ok("buf_info", dev.buf_info(b))?.completion_count;
            let id = ok("submit", dev.submit(&[desc(a, 0, b, 0, JOB)]))?;
            let (r, inj) = inject(fail, n, || dev.completion_wait(b, c0 + 1, WAIT_US))?;
            if let Ok(count) = r {
                if count < c0 + 1 {
                    return Err(format!("count {count} < expected {}", c0 + 1));
                }
            }
            wait_done(dev, id)?;
            Ok((r.map(drop).map_err(|(e, _)| e), inj))
        }),
    );

    report(
        &mut t,
        "COMPLETION_RESET",
        sweep(|n| {
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
        sweep(|n| {
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
        sweep(|n| {
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
        "first touch of a mapping",
        sweep(|n| {
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
        }),
    );

    report(
        &mut t,
        "munmap splitting a mapping",
        sweep(|n| {
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
        "close with buffers, a mapping and a queued job",
        sweep(|n| {
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
            wait_usage(dev, &[before], Duration::from_secs(5))?;
            Ok((r, inj))
        }),
    );

    for (p, old) in &saved {
        if let Err(e) = std::fs::write(p, old) {
            t.note(format!("could not restore {p} to {old}: {e}"));
        }
    }

    let freed = (dev.free(a), dev.free(b));
    drop(dev_owned);
    t.run(
        "with every file closed, channel usage equals the start",
        || {
            ok("free standing buffer", freed.0)?;
            ok("free standing buffer", freed.1)?;
            // A new file reads the counters (the first one is closed).
            let d = ok("open", Dev::open(&path))?;
            wait_usage(&d, &start, Duration::from_secs(5))?;
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
