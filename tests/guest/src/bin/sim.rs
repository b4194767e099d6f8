//! The tdrv sim device (QEMU ivshmem-doorbell + tdrv-sim): device memory
//! (HBM), DMA between user pages and HBM, several queues with per-buffer
//! order, injected faults (descriptor error, stalled queue, lost
//! interrupt), HBM exhaustion and fragmentation, and unbind/rebind under
//! load.
//!
//! usage: sim /dev/tdrvN   (a sim device; other kinds are skipped)
//!
//! Run it last on its device: it unbinds and rebinds it.

use std::{
    fs,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use tdrv_guest_tests::{
    desc, expect_eq, expect_err, inject,
    inject::inject_file,
    kmsg::{dma_api_errors, kernel_log, new_reports},
    ok, open_device_or_skip,
    raw::Dev,
    stat, sync,
    wait::{until_asleep_in, HANG},
    MappedChild, Rng, SimWatchdog, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

/// Timeout of job waits (µs): only turns a hang into a failure.
const HANG_US: i64 = HANG.as_micros() as i64;

const DRIVER_DIR: &str = "/sys/bus/pci/drivers/tdrv-sim";

/// The debugfs directory of a node.
fn debugfs(node: &str) -> String {
    format!(
        "/sys/kernel/debug/tdrv/{}",
        node.trim_start_matches("/dev/")
    )
}

/// One number per queue from the debugfs `queueN: ...` lines: the value
/// after the word `key` (`irqs`, `outstanding`).
fn queue_field(node: &str, key: &str) -> Result<Vec<u64>, String> {
    let text = fs::read_to_string(format!("{}/stats", debugfs(node)))
        .map_err(|e| format!("stats: {e}"))?;
    let mut v = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("queue")) {
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            if w == key {
                let n = words
                    .next()
                    .and_then(|n| n.parse().ok())
                    .ok_or("bad queue line")?;
                v.push(n);
            }
        }
    }
    if v.is_empty() {
        return Err("no queue lines in stats".into());
    }
    Ok(v)
}

/// Interrupts counted per queue (debugfs `queueN: ... irqs K` lines).
fn queue_irqs(node: &str) -> Result<Vec<u64>, String> {
    queue_field(node, "irqs")
}

/// The interrupt threads of the sim device (`irq/N-tdrv-sim`).
fn sim_irq_threads() -> Result<Vec<u32>, String> {
    let mut pids = Vec::new();
    for e in fs::read_dir("/proc").map_err(|e| format!("/proc: {e}"))? {
        let Ok(e) = e else { continue };
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.starts_with("irq/") && comm.contains("tdrv-s") {
            pids.push(pid);
        }
    }
    Ok(pids)
}

/// Settings of `/sys/kernel/debug/failslab` that fail every slab
/// allocation (sleeping ones too) of the tasks marked `make-it-fail`,
/// silently, for as many times as it takes.
const FAILSLAB: &[(&str, &str)] = &[
    ("task-filter", "Y"),
    ("ignore-gfp-wait", "N"),
    ("verbose", "0"),
    ("space", "0"),
    ("interval", "1"),
    ("times", "1000000"),
    ("probability", "100"),
];

/// Jobs that wait behind others are dispatched by the completion path (the
/// queues' interrupt threads), which must allocate nothing (out-fences wait
/// for it; dma-fence signalling rules): with every slab allocation of
/// those threads failing, the jobs still run, and no fault fires.
fn completion_path_allocates_nothing(dev: &Dev) -> R {
    let dir = "/sys/kernel/debug/failslab";
    let threads = sim_irq_threads()?;
    if threads.is_empty() {
        return Err("no irq/*-tdrv-sim thread".into());
    }
    let mut saved = Vec::new();
    let mut r = (|| -> R {
        for (file, value) in FAILSLAB {
            let path = format!("{dir}/{file}");
            let old = fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
            saved.push((path.clone(), old.trim().to_string()));
            fs::write(&path, value).map_err(|e| format!("{path} = {value}: {e}"))?;
        }
        let a = ok("alloc", dev.alloc(64 << 10, 0))?;
        let b = ok("alloc", dev.alloc(64 << 10, 0))?;
        ok("copy_in", dev.copy_in(a.handle, 0, &[0x3C; 64 << 10]))?;
        for pid in &threads {
            fs::write(format!("/proc/{pid}/make-it-fail"), "1")
                .map_err(|e| format!("make-it-fail of {pid}: {e}"))?;
        }
        // Each job reads what the one before wrote: one queue, at most 4
        // dispatched at SUBMIT, the rest when earlier ones complete.
        let mut ids = Vec::new();
        for i in 0..16 {
            let (s, d) = if i % 2 == 0 {
                (a.handle, b.handle)
            } else {
                (b.handle, a.handle)
            };
            ids.push(ok("submit", dev.submit(&[desc(s, 0, d, 0, 64 << 10)]))?);
        }
        for id in ids {
            expect_eq(
                "job",
                ok("wait", dev.job_wait(id, HANG_US))?,
                (TDRV_JOB_DONE, 0),
            )?;
        }
        let left = fs::read_to_string(format!("{dir}/times")).map_err(|e| format!("times: {e}"))?;
        expect_eq("failslab faults left (none fired)", left.trim(), "1000000")?;
        expect_eq(
            "data",
            read_all(dev, a.handle, 64 << 10)?,
            vec![0x3C; 64 << 10],
        )?;
        ok("free", dev.free(a.handle))?;
        ok("free", dev.free(b.handle))
    })();
    for pid in &threads {
        let _ = fs::write(format!("/proc/{pid}/make-it-fail"), "0");
    }
    // Probability first: nothing fails while the rest is restored.
    for (path, old) in saved.iter().rev() {
        if let Err(e) = fs::write(path, old) {
            r = r.and(Err(format!("restore {path}: {e}")));
        }
    }
    r
}

/// An anonymous private mapping of `len` bytes ([`Anon::new`] touches
/// every page); unmapped on drop.
struct Anon {
    ptr: *mut u8,
    len: usize,
}

impl Anon {
    /// Every page touched, with `fill`.
    fn new(len: usize, fill: u8) -> Result<Anon, String> {
        let mut a = Anon::reserve(len)?;
        a.slice_mut().fill(fill);
        Ok(a)
    }

    /// A mapping of `len` bytes whose pages are not touched yet (so that
    /// madvise can still choose their size).
    fn reserve(len: usize) -> Result<Anon, String> {
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
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
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        Ok(Anon { ptr: p.cast(), len })
    }

    /// madvise(2) of `[at, at + len)` of the mapping.
    fn advise(&self, at: usize, len: usize, advice: libc::c_int) -> R {
        assert!(at + len <= self.len);
        // SAFETY: advises part of our own mapping; the advice used here
        // changes page sizes only, never contents.
        if unsafe { libc::madvise(self.ptr.add(at).cast(), len, advice) } != 0 {
            return Err(format!("madvise: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    fn slice(&self) -> &[u8] {
        // SAFETY: our mapping of `len` bytes, used by one thread; the
        // device writes it only during an ioctl on it, or (the bug this
        // guards against) when it no longer belongs to this mapping.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn slice_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `slice`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Page frame numbers of the mapping (root: /proc/self/pagemap).
    fn pfns(&self) -> Result<Vec<u64>, String> {
        use std::os::fd::AsRawFd;
        let page = 4096;
        let f = fs::File::open("/proc/self/pagemap").map_err(|e| format!("pagemap: {e}"))?;
        let mut v = Vec::new();
        for i in 0..self.len / page {
            let mut e = [0u8; 8];
            let off = ((self.ptr as usize + i * page) / page * 8) as i64;
            // SAFETY: reads 8 bytes into a live local buffer.
            if unsafe { libc::pread(f.as_raw_fd(), e.as_mut_ptr().cast(), 8, off) } != 8 {
                return Err("pagemap read failed".into());
            }
            let e = u64::from_le_bytes(e);
            let pfn = e & ((1 << 55) - 1);
            if e >> 63 == 0 || pfn == 0 {
                return Err(format!("page {i} not present or PFN hidden"));
            }
            v.push(pfn);
        }
        Ok(v)
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly our mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// 10 MiB of anonymous memory whose 6 MiB from the returned offset (2 MiB
/// aligned) are three huge pages and whose 2 MiB on either side are 4 KiB
/// pages; or why the kernel gave none.
fn huge_page_layout() -> Result<(Anon, usize), String> {
    const MIB: usize = 1 << 20;
    const HUGE: usize = 2 * MIB;
    if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
        return Err("kernel without transparent huge pages".into());
    }
    let user = Anon::reserve(12 * MIB)?;
    let huge_at = (user.ptr as usize).next_multiple_of(HUGE) - user.ptr as usize + HUGE;
    user.advise(0, huge_at, libc::MADV_NOHUGEPAGE)?;
    user.advise(huge_at, 3 * HUGE, libc::MADV_HUGEPAGE)?;
    let tail = huge_at + 3 * HUGE;
    user.advise(tail, user.len - tail, libc::MADV_NOHUGEPAGE)?;
    let mut user = user;
    user.slice_mut().fill(1);
    let pfns = user.pfns()?;
    let page = |at: usize| pfns[at / 4096];
    for h in 0..3 {
        let first = huge_at + h * HUGE;
        let contiguous = (0..HUGE / 4096).all(|i| page(first + i * 4096) == page(first) + i as u64);
        if !contiguous || page(first) % 512 != 0 {
            return Err(format!(
                "the kernel gave 4 KiB pages where MADV_HUGEPAGE asked (huge page {h}): no free 2 MiB block"
            ));
        }
    }
    Ok((user, huge_at))
}

/// 4 KiB pages in physically consecutive runs of 1 to 17 pages, a break
/// between each two: the blocks are faulted in from the last to the first,
/// each from its first page on, so that a page allocator handing out free
/// pages in ascending order (as Linux's does from a fresh free block) puts
/// every block below the one faulted before it (once a primer has taken
/// the pages freed last, which come first). Returns the mapping and
/// its runs of more than one page (each at least two folios).
fn page_run_layout() -> Result<(Anon, usize), String> {
    const PAGE: usize = 4096;
    const PAGES: usize = 1024;
    let mut user = Anon::reserve(PAGES * PAGE)?;
    if std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
        user.advise(0, user.len, libc::MADV_NOHUGEPAGE)?;
    }
    let mut blocks = Vec::new();
    let mut at = 0;
    while at < PAGES {
        let n = (blocks.len() % 17 + 1).min(PAGES - at);
        blocks.push(at..at + n);
        at += n;
    }
    // The pages freed last come first, in the order their frees left
    // them: a primer takes those, and what is left comes from free blocks.
    let _primer = Anon::new(8 << 20, 0)?;
    for b in blocks.iter().rev() {
        for page in b.clone() {
            user.slice_mut()[page * PAGE] = 1;
        }
    }
    let pfns = user.pfns()?;
    let mut runs = 0;
    let mut breaks = 0;
    let mut len = 1;
    for i in 1..PAGES {
        if pfns[i] == pfns[i - 1] + 1 {
            len += 1;
            continue;
        }
        breaks += 1;
        runs += usize::from(len > 1);
        len = 1;
    }
    runs += usize::from(len > 1);
    if runs < 16 || breaks < 16 {
        return Err(format!(
            "the page allocator did not lay the pages out in runs ({runs} runs of several pages, {breaks} breaks)"
        ));
    }
    Ok((user, runs))
}

/// COPY_IN from and COPY_OUT into `user` at each `(start, len, dev_off)`
/// through a buffer of `dev_size` bytes: byte-exact, the bytes around
/// each range untouched.
fn copy_both_ways(
    dev: &Dev,
    user: &mut Anon,
    dev_size: usize,
    ranges: &[(usize, usize, u64)],
) -> R {
    let a = ok("alloc", dev.alloc(dev_size as u64, 0))?;
    let data = pattern(user.len, 11);
    user.slice_mut().copy_from_slice(&data);
    for &(start, len, dev_off) in ranges {
        let range = start..start + len;
        ok(
            "copy_in",
            dev.copy_in(a.handle, dev_off, &user.slice()[range.clone()]),
        )?;
        let back = read_all(dev, a.handle, dev_size)?;
        let got = &back[dev_off as usize..][..len];
        same_bytes(
            &format!("COPY_IN of {len} at +{start:#x}"),
            got,
            &data[range.clone()],
        )?;
        let other = pattern(len, 12);
        ok("copy_in", dev.copy_in(a.handle, dev_off, &other))?;
        ok(
            "copy_out",
            dev.copy_out(a.handle, dev_off, &mut user.slice_mut()[range.clone()]),
        )?;
        let mine = user.slice();
        same_bytes(
            &format!("COPY_OUT of {len} at +{start:#x}"),
            &mine[range.clone()],
            &other,
        )?;
        expect_eq(
            "bytes around the range untouched",
            mine[..start] == data[..start] && mine[start + len..] == data[start + len..],
            true,
        )?;
        user.slice_mut().copy_from_slice(&data);
    }
    ok("free", dev.free(a.handle))
}

/// Fails with `what` and the first byte where `got` and `want` differ
/// (or their lengths) unless they are equal.
fn same_bytes(what: &str, got: &[u8], want: &[u8]) -> R {
    if got == want {
        return Ok(());
    }
    match got.iter().zip(want).position(|(x, y)| x != y) {
        Some(first) => Err(format!("{what}: first difference at byte {first}")),
        None => Err(format!("{what}: {} bytes, want {}", got.len(), want.len())),
    }
}

/// Waits (30 s at most) until no queue is dead and none keeps orphans.
fn wait_queues_alive(node: &str) -> R {
    let t0 = Instant::now();
    loop {
        let text = fs::read_to_string(format!("{}/stats", debugfs(node)))
            .map_err(|e| format!("stats: {e}"))?;
        let bad: Vec<&str> = text
            .lines()
            .filter(|l| {
                l.starts_with("queue") && (l.contains(" dead") || !l.ends_with("orphans 0"))
            })
            .collect();
        if bad.is_empty() {
            return Ok(());
        }
        if t0.elapsed() > HANG {
            return Err(format!("after {HANG:?}: {bad:?}"));
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// A queue that hangs and ignores its reset: COPY_OUT fails with
/// ETIMEDOUT, but the caller's pages stay pinned (never handed out again)
/// until the device lets go; when it wakes up and writes them, no freed
/// memory changes, and the queue serves work again.
fn hung_queue_writes_no_freed_page(dev: &Dev, path: &str) -> R {
    let len = 256 << 10;
    let a = ok("alloc", dev.alloc(len as u64, 0))?;
    ok("copy_in", dev.copy_in(a.handle, 0, &vec![0xA5; len]))?;
    let mut u = Anon::new(len, 0x11)?;
    let u_pfns = u.pfns()?;
    // The product's 2 s watchdog for the hung COPY_OUT only.
    let watchdog = SimWatchdog::set(path, SimWatchdog::DEFAULT_MS)?;
    inject(path, "hang")?;
    expect_err(
        "COPY_OUT on a queue that ignores its reset",
        dev.copy_out(a.handle, 0, u.slice_mut()),
        libc::ETIMEDOUT,
    )?;
    drop(watchdog);
    drop(u);
    // Fresh memory, likely made of the pages just freed (if they were).
    let v = Anon::new(64 << 20, 0x22)?;
    let v_pfns: std::collections::HashSet<u64> = v.pfns()?.into_iter().collect();
    let reused = u_pfns.iter().filter(|p| v_pfns.contains(p)).count();
    let stats = fs::read_to_string(format!("{}/stats", debugfs(path))).unwrap_or_default();
    if !stats
        .lines()
        .any(|l| l.starts_with("queue") && l.contains(" dead"))
    {
        inject(path, "resume")?;
        return Err("no queue is dead after a reset the device ignored".into());
    }
    inject(path, "resume")?;
    wait_queues_alive(path)?;
    if reused > 0 {
        return Err(format!(
            "{reused} of the {} pages the device could still write were handed out again",
            u_pfns.len()
        ));
    }
    if let Some(i) = v.slice().iter().position(|b| *b != 0x22) {
        return Err(format!("byte {i} of fresh memory changed by the late DMA"));
    }
    expect_eq(
        "data after the queue came back",
        read_all(dev, a.handle, len)?,
        vec![0xA5; len],
    )?;
    ok("free", dev.free(a.handle))
}

/// A job whose queue hangs and ignores its reset fails (JOB_WAIT:
/// ETIMEDOUT); the device may still write its destination, which stays
/// quarantined, but every wait that only the abandoned job holds up ends
/// with EIO instead of sleeping until the device lets go: COMPLETION_WAIT
/// and FENCE_WAIT without a timeout on the destination and the source,
/// and COPY_IN into the destination. (Like a SIGKILLed tdrv-sim.)
fn hung_queue_job_wakes_every_waiter(dev: &Dev, path: &str) -> R {
    let len = 256 << 10;
    let s = ok("alloc", dev.alloc(len as u64, 0))?;
    let d = ok("alloc", dev.alloc(len as u64, 0))?;
    ok("completion_reset", dev.completion_reset(d.handle))?;
    let watchdog = SimWatchdog::set(path, SimWatchdog::DEFAULT_MS)?;
    inject(path, "hang")?;
    let id = ok(
        "submit",
        dev.submit(&[desc(s.handle, 0, d.handle, 0, len as u64)]),
    )?;
    let (tx, rx) = std::sync::mpsc::channel::<(&str, Result<(), String>)>();
    let r = thread::scope(|sc| -> R {
        let t1 = tx.clone();
        sc.spawn(move || {
            let r = expect_err(
                "COMPLETION_WAIT without a timeout on the abandoned job's destination",
                dev.completion_wait(d.handle, 1, -1).map_err(|(e, _)| e),
                libc::EIO,
            );
            let _ = t1.send(("completion_wait", r));
        });
        let t2 = tx.clone();
        sc.spawn(move || {
            let r = expect_err(
                "FENCE_WAIT (writes) without a timeout on the destination",
                dev.fence_wait(d.handle, TDRV_FENCE_WRITES, -1),
                libc::EIO,
            );
            let _ = t2.send(("fence_wait writes", r));
        });
        let t3 = tx.clone();
        sc.spawn(move || {
            let r = expect_err(
                "FENCE_WAIT (reads) without a timeout on the source",
                dev.fence_wait(s.handle, TDRV_FENCE_READS, -1),
                libc::EIO,
            );
            let _ = t3.send(("fence_wait reads", r));
        });
        let mut errs = Vec::new();
        if let Err(e) = expect_eq(
            "the job on the queue that ignores its reset",
            ok("job_wait", dev.job_wait(id, HANG_US))?,
            (TDRV_JOB_DONE, -libc::ETIMEDOUT),
        ) {
            errs.push(e);
        }
        let t0 = Instant::now();
        for _ in 0..3 {
            let left = HANG.saturating_sub(t0.elapsed());
            match rx.recv_timeout(left) {
                Ok((_, Ok(()))) => {}
                Ok((what, Err(e))) => errs.push(format!("{what}: {e}")),
                Err(_) => {
                    errs.push(format!(
                        "a waiter still blocked {HANG:?} after the job failed"
                    ));
                    // Let the device go: the blocked waiters end, the
                    // scope can join them.
                    let _ = inject(path, "resume");
                    break;
                }
            }
        }
        if let Err(e) = expect_err(
            "COPY_IN into the abandoned job's destination",
            dev.copy_in(d.handle, 0, &[1; 4096]),
            libc::EIO,
        ) {
            errs.push(e);
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs.join("; "))
        }
    });
    inject(path, "resume")?;
    wait_queues_alive(path)?;
    drop(watchdog);
    ok("free", dev.free(s.handle))?;
    ok("free", dev.free(d.handle))?;
    r
}

/// A job the device gave up on (its queue hangs and ignores its reset)
/// ends at once, for JOB_WAIT and for its completion event, with
/// ETIMEDOUT; but until the queue lets go, its source and destination
/// still count it (pending_reads, pending_writes) and its out-fence is not
/// signalled (tdrv.h, struct tdrv_job_wait). Once the queue resumes, the
/// marks go and the out-fence signals with the job's error.
fn gave_up_job_ends_but_holds_its_buffers(dev: &Dev, path: &str, fence_fd: bool) -> R {
    let len = 64 << 10;
    let s = ok("alloc", dev.alloc(len as u64, 0))?;
    let d = ok("alloc", dev.alloc(len as u64, 0))?;
    let watchdog = SimWatchdog::set(path, SimWatchdog::DEFAULT_MS)?;
    inject(path, "hang")?;
    let descs = [desc(s.handle, 0, d.handle, 0, len as u64)];
    let (id, fence) = if fence_fd {
        ok("submit", dev.submit_fences(&descs, &[], true))?
    } else {
        (ok("submit", dev.submit(&descs))?, -1)
    };
    // SAFETY: SUBMIT gave us the fd (or -1: none).
    let fence = (fence >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fence) });
    let checks = (|| -> R {
        ok("job_notify", dev.job_notify(id, 0x5eed))?;
        expect_eq(
            "JOB_WAIT of the job the queue ignores",
            ok("job_wait", dev.job_wait(id, HANG_US))?,
            (TDRV_JOB_DONE, -libc::ETIMEDOUT),
        )?;
        let mut ev = [tdrv_event::default(); 2];
        let n = ok("read of events", dev.read_events(&mut ev))?;
        expect_eq(
            "its event (type, job, status, user data)",
            (n, ev[0].type_, ev[0].job_id, ev[0].status, ev[0].user_data),
            (1, TDRV_EVENT_JOB_DONE, id, -libc::ETIMEDOUT, 0x5eed),
        )?;
        let si = ok("buf_info", dev.buf_info(s.handle))?;
        let di = ok("buf_info", dev.buf_info(d.handle))?;
        expect_eq(
            "source's pending reads and destination's pending writes after it ended",
            (si.pending_reads, di.pending_writes),
            (1, 1),
        )?;
        if let Some(f) = &fence {
            expect_eq(
                "out-fence signalled while the queue holds the job",
                ok("poll", sync::poll_in(f.as_raw_fd(), 0))?,
                false,
            )?;
        }
        Ok(())
    })();
    inject(path, "resume")?;
    wait_queues_alive(path)?;
    checks?;
    if let Some(f) = &fence {
        expect_eq(
            "out-fence signalled once the queue let go",
            ok(
                "poll",
                sync::poll_in(f.as_raw_fd(), HANG.as_millis() as i32),
            )?,
            true,
        )?;
        expect_eq(
            "out-fence status",
            ok("SYNC_IOC_FILE_INFO", sync::file_info(f.as_raw_fd()))?.status,
            -libc::ETIMEDOUT,
        )?;
    }
    let t0 = Instant::now();
    loop {
        let si = ok("buf_info", dev.buf_info(s.handle))?;
        let di = ok("buf_info", dev.buf_info(d.handle))?;
        if (si.pending_reads, di.pending_writes) == (0, 0) {
            break;
        }
        if t0.elapsed() > HANG {
            return Err(format!(
                "marks still there {HANG:?} after the queue resumed: {} reads, {} writes",
                si.pending_reads, di.pending_writes
            ));
        }
        thread::sleep(Duration::from_millis(10));
    }
    drop(watchdog);
    ok("free", dev.free(s.handle))?;
    ok("free", dev.free(d.handle))
}

/// A synchronous MEMSET whose queue hangs and ignores its reset times out,
/// and its buffer is freed; the device runs the fill when it resumes. The
/// freed HBM must not have gone to a new buffer meanwhile: the new one
/// reads as zero after the late fill.
fn hung_queue_fills_no_freed_hbm(dev: &Dev, path: &str) -> R {
    let len = 256 << 10;
    // An empty channel: best fit gives a freed range back first, at the
    // channel's start.
    let ch = 1;
    let used = ok("channel_info", dev.channel_info(ch))?.used_bytes;
    expect_eq("bytes used in channel 1 before", used, 0)?;
    let a = ok("alloc", dev.alloc(len as u64, ch))?;
    // The product's 2 s watchdog for the hung MEMSET only.
    let watchdog = SimWatchdog::set(path, SimWatchdog::DEFAULT_MS)?;
    inject(path, "hang")?;
    expect_err(
        "MEMSET on a queue that ignores its reset",
        dev.memset(a.handle, 0, len as u64, 0xC3),
        libc::ETIMEDOUT,
    )?;
    drop(watchdog);
    ok("free", dev.free(a.handle))?;
    let b = ok("alloc", dev.alloc(len as u64, ch));
    inject(path, "resume")?;
    wait_queues_alive(path)?;
    let b = b?;
    if b.dma_addr == a.dma_addr {
        let _ = dev.free(b.handle);
        return Err(format!(
            "the new buffer got the HBM at {:#x} that the timed-out MEMSET could still write",
            a.dma_addr
        ));
    }
    let data = read_all(dev, b.handle, len)?;
    let changed = data.iter().filter(|x| **x != 0).count();
    expect_eq(
        "bytes of the new buffer changed by the late fill",
        changed,
        0,
    )?;
    ok("free", dev.free(b.handle))
}

/// The PCI address bound to the sim driver.
fn bound_pci_address() -> Result<String, String> {
    tdrv_guest_tests::bound_pci_address(DRIVER_DIR)
}

/// The sim device nodes that exist now.
fn sim_nodes() -> Vec<String> {
    tdrv_guest_tests::device_nodes(TDRV_DEVICE_SIM)
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

fn job_ok(dev: &Dev, descs: &[tdrv_copy_desc]) -> R {
    let id = ok("submit", dev.submit(descs))?;
    expect_eq(
        "job",
        ok("wait", dev.job_wait(id, HANG_US))?,
        (TDRV_JOB_DONE, 0),
    )
}

/// Two buffers of `len` bytes, the first holding `pattern(len, seed)`:
/// their handles and the pattern.
fn source_and_destination(dev: &Dev, len: usize, seed: u64) -> Result<(u64, u64, Vec<u8>), String> {
    let data = pattern(len, seed);
    let a = ok("alloc", dev.alloc(len as u64, 0))?.handle;
    let b = ok("alloc", dev.alloc(len as u64, 0))?.handle;
    ok("copy_in", dev.copy_in(a, 0, &data))?;
    Ok((a, b, data))
}

fn read_all(dev: &Dev, handle: u64, len: usize) -> Result<Vec<u8>, String> {
    let mut v = vec![0u8; len];
    ok("copy_out", dev.copy_out(handle, 0, &mut v))?;
    Ok(v)
}

fn main() {
    let (dev, path, v) = open_device_or_skip("/dev/tdrv2", Some(TDRV_DEVICE_SIM));
    let mut t = Tap::new(35);

    t.run(
        "buffers live in HBM: dma_addr is a device address in its channel",
        || -> R {
            if v.features & u64::from(TDRV_FEAT_IRQ) == 0 {
                return Err("sim device without TDRV_FEAT_IRQ".into());
            }
            let mut addrs = Vec::new();
            for ch in 0..v.num_channels {
                let info = ok("channel_info", dev.channel_info(ch))?;
                let a = ok("alloc", dev.alloc(8192, ch))?;
                // Channel c spans [c * size, (c + 1) * size); the driver's
                // limit is at most the channel's size.
                if a.dma_addr < u64::from(ch) * info.limit_bytes {
                    return Err(format!("channel {ch}: dma_addr {:#x} below it", a.dma_addr));
                }
                addrs.push(a);
            }
            let b = ok("alloc", dev.alloc(8192, 0))?;
            if b.dma_addr == addrs[0].dma_addr {
                return Err("two live buffers at one device address".into());
            }
            for a in addrs.iter().chain([&b]) {
                ok("free", dev.free(a.handle))?;
            }
            Ok(())
        },
    );

    t.run(
        "new buffers read as zero even where an old one left bytes",
        || -> R {
            let a = ok("alloc", dev.alloc(1 << 20, 0))?;
            ok("memset", dev.memset(a.handle, 0, 1 << 20, 0xA5))?;
            ok("free", dev.free(a.handle))?;
            let b = ok("alloc", dev.alloc(1 << 20, 0))?;
            let data = read_all(&dev, b.handle, 1 << 20)?;
            expect_eq("zeroed", data.iter().all(|x| *x == 0), true)?;
            ok("free", dev.free(b.handle))
        },
    );

    t.run(
        "COPY_IN/COPY_OUT by DMA from user pages: byte-exact, unaligned, spanning pages",
        || -> R {
            let size = 3 << 20;
            let a = ok("alloc", dev.alloc(size as u64, 0))?;
            let src = pattern(size + 64, 1);
            let mut rng = Rng::new(7);
            for (off, len, skew) in [
                (0usize, size, 0usize),
                (1, 4095, 3),
                (4095, 2, 1),
                (4093, 8192 + 7, 17),
                (12345, 1 << 20, 4001),
                (size - 5000, 5000, 63),
            ]
            .into_iter()
            .chain((0..20).map(|_| {
                let off = rng.below(size as u64 - 1) as usize;
                let len = 1 + rng.below((size - off) as u64) as usize;
                (off, len, rng.below(64) as usize)
            })) {
                let data = &src[skew..skew + len];
                ok("copy_in", dev.copy_in(a.handle, off as u64, data))?;
                let mut back = vec![0u8; len + 128];
                let out = &mut back[(skew + 5) % 64..][..len];
                ok("copy_out", dev.copy_out(a.handle, off as u64, out))?;
                same_bytes(&format!("offset {off} len {len} skew {skew}"), out, data)?;
            }
            ok("free", dev.free(a.handle))
        },
    );

    // COPY_IN and COPY_OUT pin and start up to 8 MiB of the caller's
    // memory at a time; a page that cannot be pinned (another buffer's
    // mapping) ends a window early and goes through the bounce path.
    t.run(
        "COPY_IN/COPY_OUT of 20 MiB of anonymous pages with another buffer's mapping inside: byte-exact",
        || -> R {
            const MIB: usize = 1 << 20;
            let len = 20 * MIB;
            let a = ok("alloc", dev.alloc(len as u64, 0))?;
            let hole = ok("alloc", dev.alloc(MIB as u64, 0))?;
            let mut user = Anon::new(len + 4096, 0)?;
            // The mapping covers [9.5, 10.5) MiB of the range: inside the
            // second window, across a chunk boundary, while the first
            // runs.
            let at = 9 * MIB + MIB / 2;
            // SAFETY: MAP_FIXED over pages of `user`, which no Rust
            // reference points into now; `user`'s drop unmaps both.
            let p = unsafe {
                libc::mmap(
                    user.ptr.add(at).cast(),
                    MIB,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    dev.fd(),
                    hole.mmap_offset as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(format!("mmap: {}", std::io::Error::last_os_error()));
            }
            let data = pattern(len + 4096, 9);
            user.slice_mut().copy_from_slice(&data);
            // Starting 5 bytes into a page: no chunk is page-aligned.
            let skew = 5;
            ok("copy_in", dev.copy_in(a.handle, 0, &user.slice()[skew..skew + len]))?;
            let back = read_all(&dev, a.handle, len)?;
            same_bytes("COPY_IN", &back, &data[skew..skew + len])?;
            let other = pattern(len, 10);
            ok("copy_in", dev.copy_in(a.handle, 0, &other))?;
            ok("copy_out", dev.copy_out(a.handle, 0, &mut user.slice_mut()[skew..skew + len]))?;
            let got = user.slice();
            same_bytes("COPY_OUT", &got[skew..skew + len], &other)?;
            expect_eq(
                "bytes around the range untouched",
                got[..skew] == data[..skew] && got[skew + len..] == data[skew + len..],
                true,
            )?;
            drop(user);
            ok("free", dev.free(hole.handle))?;
            ok("free", dev.free(a.handle))
        },
    );

    // While a window runs, the next is pinned without faulting pages in
    // (it holds the device section); memory never touched needs a fault
    // for every page, so each window after the first waits for the one
    // before and is pinned again with faults allowed.
    t.run(
        "COPY_OUT into 36 MiB never touched and COPY_IN from 36 MiB never touched: byte-exact",
        || -> R {
            const MIB: usize = 1 << 20;
            let len = 36 * MIB;
            let a = ok("alloc", dev.alloc(len as u64, 1))?;
            let data = pattern(len, 13);
            ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
            let mut out = Anon::reserve(len)?;
            ok("copy_out", dev.copy_out(a.handle, 0, out.slice_mut()))?;
            same_bytes("COPY_OUT", out.slice(), &data)?;
            let fresh = Anon::reserve(len)?;
            ok("copy_in", dev.copy_in(a.handle, 0, fresh.slice()))?;
            let back = read_all(&dev, a.handle, len)?;
            expect_eq(
                "untouched memory read as zero",
                back.iter().position(|&b| b != 0),
                None,
            )?;
            ok("free", dev.free(a.handle))
        },
    );

    // COPY_IN and COPY_OUT map each run of consecutive pages of one folio
    // with one DMA mapping: a huge page is a run of 512. A range that
    // starts in 4 KiB pages, crosses three huge pages and ends in 4 KiB
    // pages again, at odd offsets, puts run ends, chunk ends and page
    // ends in every combination.
    {
        let name = "COPY_IN/COPY_OUT through huge pages between 4 KiB pages: byte-exact";
        match huge_page_layout() {
            Err(why) => t.skip(name, &why),
            Ok((mut user, huge_at)) => t.run(name, || -> R {
                const MIB: usize = 1 << 20;
                // 4 KiB pages, three huge pages, 4 KiB pages; then the
                // huge pages alone, exactly.
                copy_both_ways(
                    &dev,
                    &mut user,
                    8 * MIB,
                    &[
                        (huge_at - MIB + 123, 7 * MIB + 4444, 4096 + 7),
                        (huge_at, 6 * MIB, 0),
                    ],
                )
            }),
        }
    }

    // 4 KiB pages that happen to be physically consecutive are mapped as
    // one run too, across folios; a run ends where the next page is
    // elsewhere, at any page of a chunk.
    {
        let name =
            "COPY_IN/COPY_OUT through 4 KiB pages in physically consecutive runs: byte-exact";
        match page_run_layout() {
            Err(why) => t.skip(name, &why),
            Ok((mut user, runs)) => t.run(name, || -> R {
                let len = user.len;
                copy_both_ways(
                    &dev,
                    &mut user,
                    len + 8192,
                    &[(123, len - 4444, 4096 + 7), (0, len, 0)],
                )
                .map_err(|e| format!("{e} ({runs} runs of several pages)"))
            }),
        }
    }

    t.run(
        "mmap maps device memory: the CPU, DMA and jobs see the same bytes",
        || -> R {
            let size = 256 << 10;
            let a = ok("alloc", dev.alloc(size as u64, 1))?;
            let b = ok("alloc", dev.alloc(size as u64, 1))?;
            let data = pattern(size, 2);
            let mut m = ok("mmap", dev.map(&a))?;
            m.as_mut_slice()[..size].copy_from_slice(&data);
            job_ok(&dev, &[desc(a.handle, 0, b.handle, 0, size as u64)])?;
            expect_eq(
                "job copy of mapped bytes",
                read_all(&dev, b.handle, size)? == data,
                true,
            )?;
            ok("copy_in", dev.copy_in(a.handle, 100, &[0xEE; 300]))?;
            expect_eq(
                "mapping shows DMA",
                m.as_slice()[100..400].iter().all(|x| *x == 0xEE),
                true,
            )?;
            ok("memset", dev.memset(b.handle, 4000, 200, 0x11))?;
            let mb = ok("mmap", dev.map(&b))?;
            expect_eq(
                "memset by DMA",
                mb.as_slice()[4000..4200].iter().all(|x| *x == 0x11),
                true,
            )?;
            expect_eq("memset bounds", mb.as_slice()[3999] == data[3999], true)?;
            ok("copy", dev.copy(desc(a.handle, 0, b.handle, 8192, 4096)))?;
            expect_eq(
                "COPY by DMA",
                mb.as_slice()[8192..12288] == m.as_slice()[..4096],
                true,
            )?;
            drop(m);
            drop(mb);
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    t.run(
        "jobs on the same buffers run in submission order across queues",
        || -> R {
            let size = 8u64 << 20;
            let bufs: Vec<tdrv_alloc> = (0..4)
                .map(|_| ok("alloc", dev.alloc(size, 0)))
                .collect::<Result<_, _>>()?;
            let data = pattern(size as usize, 3);
            ok("copy_in", dev.copy_in(bufs[0].handle, 0, &data))?;
            // A chain (each job reads what the one before wrote), then a
            // write of a buffer an earlier job reads (0 is overwritten only
            // after job 1 read it).
            let ids = [
                ok(
                    "submit",
                    dev.submit(&[desc(bufs[0].handle, 0, bufs[1].handle, 0, size)]),
                )?,
                ok(
                    "submit",
                    dev.submit(&[desc(bufs[1].handle, 0, bufs[2].handle, 0, size)]),
                )?,
                ok(
                    "submit",
                    dev.submit(&[desc(bufs[2].handle, 0, bufs[3].handle, 0, size)]),
                )?,
                ok(
                    "submit",
                    dev.submit(&[desc(bufs[3].handle, 0, bufs[0].handle, 0, 4096)]),
                )?,
            ];
            for id in ids {
                expect_eq(
                    "job",
                    ok("wait", dev.job_wait(id, HANG_US))?,
                    (TDRV_JOB_DONE, 0),
                )?;
            }
            for b in &bufs[1..] {
                expect_eq(
                    "chained copy",
                    read_all(&dev, b.handle, size as usize)? == data,
                    true,
                )?;
            }
            for b in bufs {
                ok("free", dev.free(b.handle))?;
            }
            Ok(())
        },
    );

    t.run(
        "a job on other buffers runs on another queue and completes past a stalled one",
        || -> R {
            let irqs0 = queue_irqs(&path)?;
            if irqs0.len() < 2 {
                return Err(format!("{} queue(s): need 2", irqs0.len()));
            }
            let a = ok("alloc", dev.alloc(1 << 20, 0))?;
            let b = ok("alloc", dev.alloc(1 << 20, 0))?;
            let c = ok("alloc", dev.alloc(4096, 0))?;
            let d = ok("alloc", dev.alloc(4096, 0))?;
            ok("copy_in", dev.copy_in(c.handle, 0, &[0x5A; 4096]))?;
            // The next op's queue stalls: the first job is stuck there,
            // the second (other buffers) goes to another queue and ends
            // first; the watchdog then fails the first. The outcomes prove
            // the order, whatever the clocks: a job queued behind the
            // stalled one would have been failed with it (EIO) by the
            // reset, and the first never completed its copy (ETIMEDOUT).
            // The watchdog is the loaded, long one while the second job
            // must succeed, the product's 2 s only once it has: the
            // stalled job alone meets the short one (it is read at each
            // watchdog pass, and the stalled queue has made no progress
            // since the stall).
            inject(&path, "stall")?;
            let slow = ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, 1 << 20)]),
            )?;
            let fast = ok(
                "submit",
                dev.submit(&[desc(c.handle, 0, d.handle, 0, 4096)]),
            )?;
            expect_eq(
                "second job",
                ok("wait", dev.job_wait(fast, HANG_US))?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_eq("data", read_all(&dev, d.handle, 4096)?, vec![0x5A; 4096])?;
            let _watchdog = SimWatchdog::set(&path, SimWatchdog::DEFAULT_MS)?;
            expect_eq(
                "stalled job",
                ok("wait", dev.job_wait(slow, HANG_US))?,
                (TDRV_JOB_DONE, -libc::ETIMEDOUT),
            )?;
            // The second job's queue took its interrupt (the stalled one
            // ended by the watchdog's reset, without one).
            let irqs1 = queue_irqs(&path)?;
            let used = irqs0.iter().zip(&irqs1).filter(|(x, y)| y > x).count();
            if used < 1 {
                return Err(format!("irqs per queue {irqs0:?} -> {irqs1:?}"));
            }
            for x in [a, b, c, d] {
                ok("free", dev.free(x.handle))?;
            }
            Ok(())
        },
    );

    t.run(
        "a job that depends on jobs on two queues waits for both",
        || -> R {
            let bufs: Vec<tdrv_alloc> = (0..4)
                .map(|_| ok("alloc", dev.alloc(64 << 10, 0)))
                .collect::<Result<_, _>>()?;
            let [a, b, c, d] = [0, 1, 2, 3].map(|i| bufs[i].handle);
            ok("copy_in", dev.copy_in(c, 0, &[0x77; 64 << 10]))?;
            // First: a -> b, stuck on a stalled queue. Second: c -> d on
            // another queue. Third: b -> d reads what the first writes and
            // writes what the second writes: it is held back while both
            // run, on different queues.
            // The watchdog is off (600 s) until the second has ended, so
            // the first is still stuck then and the third still held back
            // behind both; then the product's 2 s ends the first.
            let long = SimWatchdog::set(&path, 600_000)?;
            inject(&path, "stall")?;
            let first = ok("submit", dev.submit(&[desc(a, 0, b, 0, 64 << 10)]))?;
            let second = ok("submit", dev.submit(&[desc(c, 0, d, 0, 64 << 10)]))?;
            let third = ok("submit", dev.submit(&[desc(b, 0, d, 0, 4096)]))?;
            expect_eq(
                "second",
                ok("wait", dev.job_wait(second, HANG_US))?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_eq(
                "third still pending behind the stalled first",
                ok("poll", dev.job_wait(third, 0))?.0,
                TDRV_JOB_PENDING,
            )?;
            drop(long);
            let _watchdog = SimWatchdog::set(&path, SimWatchdog::DEFAULT_MS)?;
            expect_eq(
                "first",
                ok("wait", dev.job_wait(first, HANG_US))?,
                (TDRV_JOB_DONE, -libc::ETIMEDOUT),
            )?;
            // Once only the first was left it went behind it, on its queue,
            // and the reset failed it with the rest of that queue (EIO)
            // before it ran: d still holds the second's bytes.
            expect_eq(
                "third",
                ok("wait", dev.job_wait(third, HANG_US))?,
                (TDRV_JOB_DONE, -libc::EIO),
            )?;
            let m = ok("mmap", dev.map(&bufs[3]))?;
            expect_eq(
                "d untouched by the third",
                m.as_slice().iter().all(|x| *x == 0x77),
                true,
            )?;
            drop(m);
            for h in [a, b, c, d] {
                ok("free", dev.free(h))?;
            }
            Ok(())
        },
    );

    t.run(
        "independent jobs released together spread over several queues; all complete",
        || -> R {
            let irqs0 = queue_irqs(&path)?;
            let n = irqs0.len() * 2;
            let bufs: Vec<(tdrv_alloc, tdrv_alloc)> = (0..n)
                .map(|_| {
                    Ok((
                        ok("alloc", dev.alloc(2 << 20, 1))?,
                        ok("alloc", dev.alloc(2 << 20, 1))?,
                    ))
                })
                .collect::<Result<_, String>>()?;
            // Held back by the engine until all are queued, then released
            // together: each goes to the least loaded queue, whatever the
            // speed of this guest's submissions. Each copies its 2 MiB 32
            // times (64 MiB), so none ends while the others are dispatched.
            inject(&path, "hold_job")?;
            let ids: Result<Vec<u64>, String> = bufs
                .iter()
                .map(|(s, d)| {
                    let descs = vec![desc(s.handle, 0, d.handle, 0, 2 << 20); 32];
                    ok("submit", dev.submit(&descs))
                })
                .collect();
            inject(&path, "release")?;
            let ids = ids?;
            for id in ids {
                expect_eq(
                    "job",
                    ok("wait", dev.job_wait(id, HANG_US))?,
                    (TDRV_JOB_DONE, 0),
                )?;
            }
            let irqs1 = queue_irqs(&path)?;
            // Free before judging, so that a failure here leaves the
            // channel empty for the next check.
            for (s, d) in bufs {
                ok("free", dev.free(s.handle))?;
                ok("free", dev.free(d.handle))?;
            }
            // Released together, the held jobs reached 2 of 4 queues in a
            // guest run: the release does not spread them over every
            // queue, so the claim is "several": at least two must serve.
            let used = irqs0.iter().zip(&irqs1).filter(|(x, y)| y > x).count();
            if used < 2 {
                return Err(format!(
                    "only {used} of {} queues took interrupts: {irqs0:?} -> {irqs1:?}",
                    irqs0.len()
                ));
            }
            Ok(())
        },
    );

    t.run(
        "independent jobs released together go one to each queue",
        || -> R {
            let q = queue_irqs(&path)?.len();
            if q < 2 {
                return Err(format!("{q} queue(s): need 2"));
            }
            let bufs: Vec<(tdrv_alloc, tdrv_alloc)> = (0..q)
                .map(|_| {
                    Ok((
                        ok("alloc", dev.alloc(4096, 0))?,
                        ok("alloc", dev.alloc(4096, 0))?,
                    ))
                })
                .collect::<Result<_, String>>()?;
            // Held, the jobs all wait in the scheduler; `release`
            // dispatches them in one pass, which must count the jobs it
            // has just placed when it picks the least loaded queue.
            inject(&path, "hold_job")?;
            let ids: Vec<u64> = bufs
                .iter()
                .map(|(s, d)| {
                    ok(
                        "submit",
                        dev.submit(&[desc(s.handle, 0, d.handle, 0, 4096)]),
                    )
                })
                .collect::<Result<_, _>>()?;
            for &id in &ids {
                expect_eq(
                    "held job",
                    ok("poll", dev.job_wait(id, 0))?.0,
                    TDRV_JOB_PENDING,
                )?;
            }
            let irqs0 = queue_irqs(&path)?;
            inject(&path, "release")?;
            for id in ids {
                expect_eq(
                    "job",
                    ok("wait", dev.job_wait(id, HANG_US))?,
                    (TDRV_JOB_DONE, 0),
                )?;
            }
            let irqs1 = queue_irqs(&path)?;
            let per_queue: Vec<u64> = irqs0.iter().zip(&irqs1).map(|(x, y)| y - x).collect();
            // One single-descriptor job, one interrupt, on every queue.
            expect_eq("interrupts per queue", per_queue, vec![1; q])?;
            for (s, d) in bufs {
                ok("free", dev.free(s.handle))?;
                ok("free", dev.free(d.handle))?;
            }
            Ok(())
        },
    );

    t.run(
        "fail_desc: the job or COPY_IN fails with EIO, its output is latched, the next works",
        || -> R {
            let a = ok("alloc", dev.alloc(64 << 10, 0))?;
            let b = ok("alloc", dev.alloc(64 << 10, 0))?;
            inject(&path, "fail_desc")?;
            let id = ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, 64 << 10)]),
            )?;
            expect_eq(
                "job",
                ok("wait", dev.job_wait(id, HANG_US))?,
                (TDRV_JOB_DONE, -libc::EIO),
            )?;
            expect_eq(
                "error latch",
                ok("buf_info", dev.buf_info(b.handle))?.error,
                -libc::EIO,
            )?;
            inject(&path, "fail_desc")?;
            expect_err(
                "COPY_IN with a failed descriptor",
                dev.copy_in(a.handle, 0, &[1; 9000]),
                libc::EIO,
            )?;
            expect_eq(
                "latch after the failed COPY_IN",
                ok("buf_info", dev.buf_info(a.handle))?.error,
                -libc::EIO,
            )?;
            ok("copy_in", dev.copy_in(a.handle, 0, &[2; 9000]))?;
            expect_eq(
                "latch after a good COPY_IN",
                ok("buf_info", dev.buf_info(a.handle))?.error,
                0,
            )?;
            job_ok(&dev, &[desc(a.handle, 0, b.handle, 0, 9000)])?;
            expect_eq("data", read_all(&dev, b.handle, 9000)?, vec![2; 9000])?;
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    t.run(
        "memcpy_probe is no fault: accepted with or without a queue, the job after it moves its bytes; a bad queue or word is EINVAL",
        || -> R {
            let len = 64 << 10;
            let (a, b, data) = source_and_destination(&dev, len, 33)?;
            inject(&path, "memcpy_probe")?;
            job_ok(&dev, &[desc(a, 0, b, 0, len as u64)])?;
            expect_eq("data after a probe", read_all(&dev, b, len)?, data)?;
            inject(&path, "memcpy_probe 0")?;
            ok("copy_out", dev.copy_out(b, 0, &mut vec![0; len]))?;
            expect_eq("latch after probes", ok("buf_info", dev.buf_info(b))?.error, 0)?;
            for bad in ["memcpy_probe 64", "memcpy_probe 0 0", "memcpy_probes"] {
                let r = std::fs::write(inject_file(&path), bad);
                expect_eq(
                    &format!("inject {bad:?}"),
                    r.map_err(|e| e.raw_os_error()),
                    Err(Some(libc::EINVAL)),
                )?;
            }
            ok("free", dev.free(a))?;
            ok("free", dev.free(b))
        },
    );

    t.run(
        "fail_desc on COPY_OUT: EIO, no latch, the buffer keeps its bytes",
        || -> R {
            let len = 64 << 10;
            let data = pattern(len, 21);
            let a = ok("alloc", dev.alloc(len as u64, 0))?;
            ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
            inject(&path, "fail_desc")?;
            let mut out = vec![0u8; len];
            expect_err(
                "COPY_OUT with a failed descriptor",
                dev.copy_out(a.handle, 0, &mut out),
                libc::EIO,
            )?;
            // Only the caller's memory was being written: the buffer's
            // bytes are what they were, and nothing is latched.
            expect_eq("latch", ok("buf_info", dev.buf_info(a.handle))?.error, 0)?;
            expect_eq(
                "data read again",
                read_all(&dev, a.handle, len)? == data,
                true,
            )?;
            ok("free", dev.free(a.handle))
        },
    );

    t.run(
        "fail_desc on MEMSET: EIO, the buffer's error latched (COPY_OUT EIO) until a good MEMSET",
        || -> R {
            let len = 64 << 10;
            let a = ok("alloc", dev.alloc(len as u64, 0))?;
            ok("copy_in", dev.copy_in(a.handle, 0, &pattern(len, 22)))?;
            inject(&path, "fail_desc")?;
            expect_err(
                "MEMSET with a failed descriptor",
                dev.memset(a.handle, 0, len as u64, 0x77),
                libc::EIO,
            )?;
            expect_eq(
                "latch",
                ok("buf_info", dev.buf_info(a.handle))?.error,
                -libc::EIO,
            )?;
            let mut out = vec![0u8; len];
            expect_err(
                "COPY_OUT of the undefined bytes",
                dev.copy_out(a.handle, 0, &mut out),
                libc::EIO,
            )?;
            ok("memset", dev.memset(a.handle, 0, len as u64, 0x77))?;
            expect_eq(
                "latch after a good MEMSET",
                ok("buf_info", dev.buf_info(a.handle))?.error,
                0,
            )?;
            expect_eq("data", read_all(&dev, a.handle, len)?, vec![0x77; len])?;
            ok("free", dev.free(a.handle))
        },
    );

    t.run(
        "fail_desc on COPY: EIO, the destination's error latched, the source's not; a good COPY clears it",
        || -> R {
            let len = 64 << 10;
            let (a, b, data) = source_and_destination(&dev, len, 23)?;
            inject(&path, "fail_desc")?;
            expect_err(
                "COPY with a failed descriptor",
                dev.copy(desc(a, 0, b, 0, len as u64)),
                libc::EIO,
            )?;
            expect_eq("destination's latch", ok("buf_info", dev.buf_info(b))?.error, -libc::EIO)?;
            expect_eq("source's latch", ok("buf_info", dev.buf_info(a))?.error, 0)?;
            let mut out = vec![0u8; len];
            expect_err(
                "COPY_OUT of the undefined destination",
                dev.copy_out(b, 0, &mut out),
                libc::EIO,
            )?;
            ok("copy", dev.copy(desc(a, 0, b, 0, len as u64)))?;
            expect_eq("latch after a good COPY", ok("buf_info", dev.buf_info(b))?.error, 0)?;
            expect_eq("data", read_all(&dev, b, len)? == data, true)?;
            ok("free", dev.free(a))?;
            ok("free", dev.free(b))
        },
    );

    t.run(
        "stall: the watchdog resets the queue, fails its jobs (ETIMEDOUT, then EIO), the queue works again",
        || -> R {
            let resets = stat(&path, "resets")?;
            let a = ok("alloc", dev.alloc(4096, 0))?;
            let b = ok("alloc", dev.alloc(4096, 0))?;
            let c = ok("alloc", dev.alloc(4096, 0))?;
            ok("copy_in", dev.copy_in(a.handle, 0, &[3; 4096]))?;
            // The product's 2 s watchdog only around the jobs meant to
            // time out; the jobs that must succeed after it have the
            // loaded, long one.
            let watchdog = SimWatchdog::set(&path, SimWatchdog::DEFAULT_MS)?;
            inject(&path, "stall 0")?;
            // Queue 0 is the least loaded (all idle): the first job goes
            // there; the second reads its output, so it queues behind it.
            let first = ok("submit", dev.submit(&[desc(a.handle, 0, b.handle, 0, 4096)]))?;
            let second = ok("submit", dev.submit(&[desc(b.handle, 0, c.handle, 0, 4096)]))?;
            expect_eq("first", ok("wait", dev.job_wait(first, HANG_US))?, (TDRV_JOB_DONE, -libc::ETIMEDOUT))?;
            expect_eq("second", ok("wait", dev.job_wait(second, HANG_US))?, (TDRV_JOB_DONE, -libc::EIO))?;
            drop(watchdog);
            if stat(&path, "resets")? <= resets {
                return Err("no reset counted".into());
            }
            // Every queue (queue 0 included) serves jobs again.
            let irqs0 = queue_irqs(&path)?;
            for _ in 0..irqs0.len() * 2 {
                job_ok(&dev, &[desc(a.handle, 0, c.handle, 0, 4096)])?;
            }
            let irqs1 = queue_irqs(&path)?;
            if irqs1[0] <= irqs0[0] {
                return Err(format!("queue 0 took no interrupt after its reset: {irqs0:?} -> {irqs1:?}"));
            }
            expect_eq("data", read_all(&dev, c.handle, 4096)?, vec![3; 4096])?;
            // A synchronous transfer on a stalled queue times out too.
            let watchdog = SimWatchdog::set(&path, SimWatchdog::DEFAULT_MS)?;
            inject(&path, "stall")?;
            expect_err("COPY_IN on a stalled queue", dev.copy_in(a.handle, 0, &[4; 4096]), libc::ETIMEDOUT)?;
            drop(watchdog);
            ok("copy_in after reset", dev.copy_in(a.handle, 0, &[5; 4096]))?;
            expect_eq("data", read_all(&dev, a.handle, 4096)?, vec![5; 4096])?;
            for x in [a, b, c] {
                ok("free", dev.free(x.handle))?;
            }
            Ok(())
        },
    );

    t.run(
        "lose_irq: the watchdog finds the completion of a lost interrupt",
        || -> R {
            let polled = stat(&path, "polled_completions")?;
            let a = ok("alloc", dev.alloc(4096, 0))?;
            let b = ok("alloc", dev.alloc(4096, 0))?;
            ok("copy_in", dev.copy_in(a.handle, 0, &[6; 4096]))?;
            inject(&path, "lose_irq")?;
            job_ok(&dev, &[desc(a.handle, 0, b.handle, 0, 4096)])?;
            expect_eq("data", read_all(&dev, b.handle, 4096)?, vec![6; 4096])?;
            if stat(&path, "polled_completions")? <= polled {
                return Err("no completion found by polling".into());
            }
            inject(&path, "lose_irq")?;
            ok(
                "copy_in with a lost interrupt",
                dev.copy_in(b.handle, 0, &[8; 4096]),
            )?;
            expect_eq("data", read_all(&dev, b.handle, 4096)?, vec![8; 4096])?;
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    t.run(
        "a job is at most 64 MiB ahead on its queue: closing its file stops it after that chunk",
        || -> R {
            // The job's queue stalls: whatever the driver posts stays
            // posted (debugfs `outstanding`) until the watchdog resets it.
            let resets = stat(&path, "resets")?;
            let other = ok("open", Dev::open(&path))?;
            let mb = 1u64 << 20;
            let a = ok("alloc", other.alloc(16 * mb, 0))?;
            let b = ok("alloc", other.alloc(16 * mb, 0))?;
            let _watchdog = SimWatchdog::set(&path, SimWatchdog::DEFAULT_MS)?;
            inject(&path, "stall")?;
            // 512 MiB in 32 descriptors of 16 MiB (the device's largest):
            // with ring room for all of them, only 4 may be handed over.
            let descs: Vec<tdrv_copy_desc> = (0..32)
                .map(|_| desc(a.handle, 0, b.handle, 0, 16 * mb))
                .collect();
            ok("submit", other.submit(&descs))?;
            let posted: u64 = queue_field(&path, "outstanding")?.iter().sum();
            if !(1..=4).contains(&posted) {
                return Err(format!(
                    "{posted} descriptors of 16 MiB posted for one job: want 1..=4 (64 MiB)"
                ));
            }
            // Closing the file cancels the rest; the watchdog resets the
            // stalled queues and the queue drains.
            drop(other);
            let t0 = Instant::now();
            loop {
                let left: u64 = queue_field(&path, "outstanding")?.iter().sum();
                if left == 0 && stat(&path, "resets")? > resets {
                    break;
                }
                if t0.elapsed() > HANG {
                    return Err(format!(
                        "{left} descriptors still outstanding after {HANG:?}"
                    ));
                }
                thread::sleep(Duration::from_millis(20));
            }
            Ok(())
        },
    );

    let name = "the completion path allocates nothing: failslab in the interrupt threads fails no job and fires no fault";
    if std::path::Path::new("/sys/kernel/debug/failslab").exists() {
        t.run(name, || completion_path_allocates_nothing(&dev));
    } else {
        t.skip(name, "kernel without CONFIG_FAILSLAB debugfs");
    }

    t.run(
        "a queue that ignores its reset keeps the pages of a timed-out COPY_OUT until it lets go",
        || hung_queue_writes_no_freed_page(&dev, &path),
    );

    t.run(
        "a queue that ignores its reset keeps the HBM of a timed-out MEMSET until it lets go",
        || hung_queue_fills_no_freed_hbm(&dev, &path),
    );

    t.run(
        "a queue that ignores its reset: every waiter on its abandoned job's buffers ends with EIO",
        || hung_queue_job_wakes_every_waiter(&dev, &path),
    );

    t.run(
        "a job the queue gave up on ends at once but holds its buffers until the queue lets go",
        || {
            let fence_fd = v.features & u64::from(TDRV_FEAT_FENCE_FD) != 0;
            gave_up_job_ends_but_holds_its_buffers(&dev, &path, fence_fd)
        },
    );

    t.run("inject rejects unknown commands and queues", || -> R {
        for bad in [
            "fail_jobs",
            "stall 99",
            "lose_irq x",
            "stall 0 1",
            "\n",
            "hold_job 0",
            "release 0",
        ] {
            if inject(&path, bad).is_ok() {
                return Err(format!("inject {bad:?} accepted"));
            }
        }
        Ok(())
    });

    t.run(
        "watchdog_ms: the stats show the loaded sim_timeout_ms; inject sets 100..=600000 and refuses the rest",
        || -> R {
            // (The test guests load tdrv with sim_timeout_ms in
            // /etc/tdrv-params; elsewhere it is the default.)
            let loaded = fs::read_to_string("/etc/tdrv-params")
                .unwrap_or_default()
                .split_whitespace()
                .find_map(|w| w.strip_prefix("sim_timeout_ms=")?.parse::<u64>().ok())
                .unwrap_or(SimWatchdog::DEFAULT_MS.into());
            expect_eq("watchdog_ms as loaded", stat(&path, "watchdog_ms")?, loaded)?;
            {
                let _short = SimWatchdog::set(&path, 100)?;
                let _long = SimWatchdog::set(&path, 600_000)?;
                for bad in [
                    "watchdog_ms 99",
                    "watchdog_ms 600001",
                    "watchdog_ms 4294967296",
                    "watchdog_ms -1",
                    "watchdog_ms",
                    "watchdog_ms x",
                    "watchdog_ms 2000 1",
                ] {
                    if inject(&path, bad).is_ok() {
                        return Err(format!("inject {bad:?} accepted"));
                    }
                }
                expect_eq("watchdog_ms after refused values", stat(&path, "watchdog_ms")?, 600_000)?;
            }
            expect_eq("watchdog_ms restored", stat(&path, "watchdog_ms")?, loaded)
        },
    );

    t.run(
        "HBM: exhaustion, then fragmentation (ENOMEM) and coalescing",
        || -> R {
            let ch = 1;
            let info = ok("channel_info", dev.channel_info(ch))?;
            if info.used_bytes != 0 {
                return Err(format!("channel {ch} not empty: {} bytes", info.used_bytes));
            }
            let page = 4096;
            let piece = info.limit_bytes / 8 / page * page;
            let bufs: Vec<tdrv_alloc> = (0..8)
                .map(|_| ok("alloc", dev.alloc(piece, ch)))
                .collect::<Result<_, _>>()?;
            let rest = info.limit_bytes - 8 * piece;
            expect_err(
                "alloc past the channel's limit",
                dev.alloc(rest + page, ch),
                libc::ENOSPC,
            )?;
            // Every other piece back: half the channel is free, in holes of
            // one piece, so two pieces do not fit anywhere.
            for b in bufs.iter().step_by(2) {
                ok("free", dev.free(b.handle))?;
            }
            let failed = ok("channel_info", dev.channel_info(ch))?.failed_allocs;
            expect_err("alloc across holes", dev.alloc(2 * piece, ch), libc::ENOMEM)?;
            expect_eq(
                "failed_allocs",
                ok("channel_info", dev.channel_info(ch))?.failed_allocs,
                failed + 1,
            )?;
            // One piece still fits a hole.
            let one = ok("alloc one piece", dev.alloc(piece, ch))?;
            ok("free", dev.free(one.handle))?;
            // Freeing a neighbour merges three holes into one.
            ok("free", dev.free(bufs[1].handle))?;
            let two = ok("alloc after coalescing", dev.alloc(3 * piece, ch))?;
            ok("free", dev.free(two.handle))?;
            for b in bufs.iter().skip(3).step_by(2) {
                ok("free", dev.free(b.handle))?;
            }
            let whole = ok("alloc the whole channel", dev.alloc(info.limit_bytes, ch))?;
            ok("free", dev.free(whole.handle))?;
            expect_eq(
                "used",
                ok("channel_info", dev.channel_info(ch))?.used_bytes,
                0,
            )
        },
    );

    drop(dev);
    t.run(
        "unbind under load fails work with ENODEV and revokes mappings",
        || unbind_under_load(&path),
    );
    t.run("rebind creates a working sim device again", rebind);
    t.run(
        "after a rebind, new buffers read as zero where the previous binding left bytes",
        rebind_zeroes,
    );
    t.run(
        "unbind with a dead queue releases its orphans' mappings, pages and buffers (no DMA-API report), and the queue writes nothing after it",
        unbind_with_a_dead_queue,
    );
    tdrv_guest_tests::unbind::checks(&mut t, TDRV_DEVICE_SIM, DRIVER_DIR);
    t.finish();
}

/// The header page of the sim device's BAR2 through sysfs, for a device
/// no driver is bound to.
struct RawHeader(*mut u32);

impl RawHeader {
    fn map(pci: &str) -> Result<RawHeader, String> {
        let path = format!("/sys/bus/pci/devices/{pci}/resource2");
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("{path}: {e}"))?;
        // SAFETY: a new shared mapping of one page chosen by the kernel;
        // checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!("mmap {path}: {}", std::io::Error::last_os_error()));
        }
        Ok(RawHeader(p.cast()))
    }

    fn word(&self, off: usize) -> *mut u32 {
        assert!(off.is_multiple_of(4) && off < 4096);
        // SAFETY: in the mapped page (asserted).
        unsafe { self.0.add(off / 4) }
    }

    fn read(&self, off: usize) -> u32 {
        // SAFETY: a mapped, aligned word (`word`); device memory, so
        // volatile.
        unsafe { self.word(off).read_volatile() }
    }

    fn write(&self, off: usize, v: u32) {
        // SAFETY: as in `read`.
        unsafe { self.word(off).write_volatile(v) }
    }
}

impl Drop for RawHeader {
    fn drop(&mut self) {
        // SAFETY: the page `map` mapped, unmapped once.
        unsafe { libc::munmap(self.0.cast(), 4096) };
    }
}

/// Unbind while a queue ignores its reset (as a killed tdrv-sim's does):
/// what its abandoned COPY_OUT and job hold (the caller's pinned pages and
/// their DMA mappings, the job's buffers) must be released by the unbind,
/// with no DMA-API report of allocations left behind, and the queue must
/// write none of it when it wakes up afterwards.
fn unbind_with_a_dead_queue() -> R {
    let node = sim_nodes().first().cloned().ok_or("no sim device node")?;
    let pci = bound_pci_address()?;
    let dev = ok("open", Dev::open(&node))?;
    let len = 256 << 10;
    let a = ok("alloc", dev.alloc(len as u64, 0))?;
    let d = ok("alloc", dev.alloc(len as u64, 0))?;
    ok("copy_in", dev.copy_in(a.handle, 0, &vec![0xA5; len]))?;
    let mut u = Anon::new(len, 0x11)?;
    let u_pfns = u.pfns()?;
    // Until the unbind, a failed check resumes the hung queues, so that
    // the checks after this one find a device that binds again.
    struct Resume<'a>(Option<&'a str>);
    impl Drop for Resume<'_> {
        fn drop(&mut self) {
            if let Some(node) = self.0 {
                if let Err(e) = inject(node, "resume") {
                    println!("# {e}");
                }
            }
        }
    }
    let mut resume = Resume(Some(&node));
    {
        let _watchdog = SimWatchdog::set(&node, SimWatchdog::DEFAULT_MS)?;
        inject(&node, "hang")?;
        expect_err(
            "COPY_OUT on a queue that ignores its reset",
            dev.copy_out(a.handle, 0, u.slice_mut()),
            libc::ETIMEDOUT,
        )?;
        inject(&node, "hang")?;
        let id = ok(
            "submit",
            dev.submit(&[desc(a.handle, 0, d.handle, 0, len as u64)]),
        )?;
        expect_eq(
            "the job on a queue that ignores its reset",
            ok("job_wait", dev.job_wait(id, HANG_US))?,
            (TDRV_JOB_DONE, -libc::ETIMEDOUT),
        )?;
    }
    let orphans: u64 = queue_field(&node, "orphans")?.iter().sum();
    if orphans < 2 {
        return Err(format!("{orphans} orphaned ops before the unbind, want 2"));
    }
    let errors = dma_api_errors();
    let log = kernel_log()?;
    // From here the queues stay hung through the unbind (what this checks)
    // and are resumed below, with no driver bound.
    resume.0 = None;
    fs::write(format!("{DRIVER_DIR}/unbind"), &pci).map_err(|e| format!("unbind {pci}: {e}"))?;
    let reports = new_reports(&log, &kernel_log()?);
    let errors_after = dma_api_errors();
    drop(dev);
    // The pages are the kernel's again: fresh memory may reuse them.
    drop(u);
    let v = Anon::new(64 << 20, 0x22)?;
    let v_pfns: std::collections::HashSet<u64> = v.pfns()?.into_iter().collect();
    let reused = u_pfns.iter().filter(|p| v_pfns.contains(p)).count();
    // The hung queues wake up with no driver bound: each takes its RESUME
    // (the word reads 0 again) while nothing may move bytes any more.
    // (Memory decoding is off without a driver: enable the device for the
    // writes, and disable it again for the bind.)
    let enable = format!("/sys/bus/pci/devices/{pci}/enable");
    fs::write(&enable, "1").map_err(|e| format!("{enable}: {e}"))?;
    let header = RawHeader::map(&pci)?;
    let queues = header.read(0x0c) as usize;
    for q in 0..queues {
        header.write(0x100 + 4 * q, 5);
    }
    let t0 = Instant::now();
    while (0..queues).any(|q| header.read(0x100 + 4 * q) != 0) {
        if t0.elapsed() > HANG {
            return Err(format!("RESUME not taken after {HANG:?}"));
        }
        thread::sleep(Duration::from_millis(10));
    }
    drop(header);
    fs::write(&enable, "0").map_err(|e| format!("{enable}: {e}"))?;
    // Bound again: the probe resets every queue, which a queue answers
    // only after it ran (or dropped) what it had when it resumed.
    let node = tdrv_guest_tests::unbind::rebind(DRIVER_DIR, &pci, TDRV_DEVICE_SIM)?;
    let mut errs = Vec::new();
    if !reports.is_empty() {
        errs.push(format!("the unbind logged {reports:?}"));
    }
    if let (Some(b), Some(a)) = (errors, errors_after) {
        if a != b {
            errs.push(format!(
                "the unbind raised the DMA-API error count from {b} to {a}"
            ));
        }
    }
    if let Some(i) = v.slice().iter().position(|b| *b != 0x22) {
        errs.push(format!(
            "byte {i} of fresh memory ({reused} of its pages were the COPY_OUT's) changed by a late DMA"
        ));
    }
    let dev = ok("open", Dev::open(&node))?;
    let b = ok("alloc", dev.alloc(len as u64, 0))?;
    ok("copy_in", dev.copy_in(b.handle, 0, &vec![0x3C; len]))?;
    if read_all(&dev, b.handle, len)? != vec![0x3C; len] {
        errs.push("the device bound again moves the wrong bytes".into());
    }
    ok("free", dev.free(b.handle))?;
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("; "))
    }
}

fn unbind_under_load(path: &str) -> R {
    let pci = bound_pci_address()?;
    let dev = Arc::new(ok("open", Dev::open(path))?);
    let a = ok("alloc", dev.alloc(4 << 20, 0))?;
    let b = ok("alloc", dev.alloc(4 << 20, 0))?;
    let mut m = ok("mmap", dev.map(&a))?;
    m.as_mut_slice()[0] = 1;
    let child = MappedChild::spawn(&dev, &a)?;
    let stop = Arc::new(AtomicBool::new(false));
    let unbinding = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..3 {
        let dev = dev.clone();
        let stop = stop.clone();
        let unbinding = unbinding.clone();
        workers.push(thread::spawn(move || -> Result<(i32, bool), String> {
            let data = vec![w as u8; 1 << 20];
            let mut out = vec![0u8; 1 << 20];
            loop {
                let r = match w {
                    0 => dev.copy_in(a.handle, 0, &data),
                    1 => dev.copy_out(b.handle, 0, &mut out),
                    _ => dev
                        .submit(&[desc(a.handle, 0, b.handle, 0, 4 << 20)])
                        .and_then(|id| dev.job_wait(id, -1))
                        .and_then(|(_, st)| if st == 0 { Ok(()) } else { Err(-st) }),
                };
                // (Whether the unbind had begun: an error before it is
                // the device's or the driver's, not the unbind's.)
                match r {
                    Ok(()) if !stop.load(Ordering::Relaxed) => continue,
                    Ok(()) => return Ok((0, true)),
                    Err(e) => return Ok((e, unbinding.load(Ordering::Relaxed))),
                }
            }
        }));
    }
    thread::sleep(Duration::from_millis(300));
    // Then the engine holds the next job (debugfs `hold_job`, never
    // released) and dispatches none after it: unbind must end the held and
    // pending jobs too, this other file's among them.
    let other = Arc::new(ok("open", Dev::open(path))?);
    let c = ok("alloc", other.alloc(4096, 0))?;
    let d = ok("alloc", other.alloc(4096, 0))?;
    inject(path, "hold_job")?;
    let held = ok(
        "submit",
        other.submit(&[desc(c.handle, 0, d.handle, 0, 4096)]),
    )?;
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let waiter = {
        let other = other.clone();
        thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            let _ = tid_tx.send(unsafe { libc::gettid() });
            other.job_wait(held, -1)
        })
    };
    // The unbind must find the waiter asleep in JOB_WAIT.
    let tid = tid_rx.recv().map_err(|_| "waiter died")?;
    until_asleep_in(tid, libc::SYS_ioctl)?;
    // And a COPY_OUT of the held job's destination asleep until that
    // write ends: the unbind fails the write (ENODEV latched) before it
    // kills the fences, and the copy it wakes must say ENODEV, not the
    // EIO of a failed write.
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let copier = {
        let other = other.clone();
        thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            let _ = tid_tx.send(unsafe { libc::gettid() });
            let mut out = vec![0u8; 4096];
            other.copy_out(d.handle, 0, &mut out)
        })
    };
    let tid = tid_rx.recv().map_err(|_| "copier died")?;
    until_asleep_in(tid, libc::SYS_ioctl)?;
    unbinding.store(true, Ordering::Relaxed);
    let unbound = fs::write(format!("{DRIVER_DIR}/unbind"), &pci);
    stop.store(true, Ordering::Relaxed);
    unbound.map_err(|e| format!("unbind {pci}: {e}"))?;
    // Unbound: the rebind check after this one binds it again whatever
    // this check finds below.
    fs::write("/tmp/tdrv-sim-pci", &pci).map_err(|e| e.to_string())?;
    let held = waiter.join().map_err(|_| "waiter panicked")?;
    if !matches!(held, Ok((TDRV_JOB_DONE, st)) if st == -libc::ENODEV) && held != Err(libc::ENODEV)
    {
        return Err(format!("the job behind the hold: {held:?}, want ENODEV"));
    }
    let copied = copier.join().map_err(|_| "copier panicked")?;
    if copied != Err(libc::ENODEV) {
        return Err(format!(
            "COPY_OUT waiting for the held job's write: {copied:?}, want ENODEV"
        ));
    }
    for (i, w) in workers.into_iter().enumerate() {
        let (e, during) = w.join().map_err(|_| "worker panicked")??;
        if e != libc::ENODEV {
            let when = if during {
                "once the unbind began"
            } else {
                "before the unbind"
            };
            return Err(format!(
                "worker {i} ended with errno {e} {when}, want ENODEV"
            ));
        }
    }
    expect_eq(
        "alloc after unbind",
        dev.alloc(4096, 0).map(drop),
        Err(libc::ENODEV),
    )?;
    // The mapping's pages are gone: touching it raises SIGBUS (in a
    // child with its own mapping, so that we survive).
    let status = child.touch_and_wait()?;
    if !(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS) {
        return Err(format!(
            "touching a revoked mapping: status {status:#x}, want SIGBUS"
        ));
    }
    drop(m);
    Ok(())
}

fn rebind() -> R {
    let pci =
        fs::read_to_string("/tmp/tdrv-sim-pci").map_err(|e| format!("no unbound device: {e}"))?;
    fs::write(format!("{DRIVER_DIR}/bind"), &pci).map_err(|e| format!("bind {pci}: {e}"))?;
    // The bind probes synchronously, and devtmpfs creates the node before
    // the probe returns: no wait is needed.
    let node = sim_nodes()
        .first()
        .cloned()
        .ok_or("no sim device node after rebind")?;
    let dev = ok("open", Dev::open(&node))?;
    let data = pattern(100_000, 9);
    let a = ok("alloc", dev.alloc(100_000, 0))?;
    let b = ok("alloc", dev.alloc(100_000, 0))?;
    ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
    job_ok(&dev, &[desc(a.handle, 0, b.handle, 0, 100_000)])?;
    expect_eq("data", read_all(&dev, b.handle, 100_000)? == data, true)?;
    ok("free", dev.free(a.handle))?;
    ok("free", dev.free(b.handle))
}

/// The probe zeroes HBM once and new buffers skip zeroing memory nobody
/// used since (`hbm.rs`): bytes left by the previous binding must not show
/// through.
fn rebind_zeroes() -> R {
    let node = sim_nodes().first().cloned().ok_or("no sim device node")?;
    let dev = ok("open", Dev::open(&node))?;
    let channels = ok("version", dev.version())?.num_channels;
    let size = 4 << 20;
    for ch in 0..channels {
        let a = ok("alloc", dev.alloc(size as u64, ch))?;
        ok("memset", dev.memset(a.handle, 0, size as u64, 0x5A))?;
        ok("free", dev.free(a.handle))?;
    }
    drop(dev);
    let pci = bound_pci_address()?;
    fs::write(format!("{DRIVER_DIR}/unbind"), &pci).map_err(|e| format!("unbind {pci}: {e}"))?;
    fs::write(format!("{DRIVER_DIR}/bind"), &pci).map_err(|e| format!("bind {pci}: {e}"))?;
    let node = sim_nodes()
        .first()
        .cloned()
        .ok_or("no sim device node after rebind")?;
    let dev = ok("open", Dev::open(&node))?;
    for ch in 0..channels {
        let a = ok("alloc", dev.alloc(size as u64, ch))?;
        let data = read_all(&dev, a.handle, size)?;
        let left = data.iter().filter(|b| **b != 0).count();
        expect_eq(&format!("non-zero bytes on channel {ch}"), left, 0)?;
        ok("free", dev.free(a.handle))?;
    }
    Ok(())
}
