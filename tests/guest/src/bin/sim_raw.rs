//! The sim device (docs/sim-device.md) from inside the guest, with no
//! driver bound: BAR2 and BAR0 mapped through sysfs, guest physical
//! addresses from /proc/self/pagemap. Proves the simulator's side of the
//! contract end to end through QEMU: the header, the doorbell of every
//! queue, copies in every direction at real guest physical addresses,
//! BAD_ADDR and BAD_DESC, each injected fault (the interrupt is not
//! observable without a driver, so LOSE_IRQ is not covered here), reset,
//! and that nothing runs without a doorbell.
//!
//! usage: sim_raw   (needs root; skipped without the sim device, or while a
//! driver holds it: run-all runs it while tdrv is unloaded)

use std::fs;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::fence;
use std::sync::atomic::Ordering;
use std::thread;
use std::time::Duration;
use std::time::Instant;

use tdrv_guest_tests::skip_all;
use tdrv_guest_tests::Tap;

type R = Result<(), String>;

const MAGIC: u64 = 0x314D_4953_5652_4454;
const SRC_DEV: u32 = 1;
const DST_DEV: u32 = 2;
const IRQ: u32 = 4;
const PAGE: usize = 4096;

/// A shared mapping of a PCI resource file, accessed with volatile loads
/// and stores only (it is device memory, written by the simulator).
struct Bar {
    ptr: *mut u8,
    len: usize,
}

impl Bar {
    fn map(path: &Path, len: usize) -> Result<Bar, String> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        // SAFETY: a new shared mapping chosen by the kernel; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!(
                "mmap {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            ));
        }
        Ok(Bar { ptr: p.cast(), len })
    }

    fn at<T>(&self, off: usize) -> *mut T {
        assert!(
            off.is_multiple_of(std::mem::size_of::<T>())
                && off + std::mem::size_of::<T>() <= self.len
        );
        // SAFETY: in bounds of the mapping (asserted).
        unsafe { self.ptr.add(off).cast() }
    }

    fn r32(&self, off: usize) -> u32 {
        // SAFETY: in bounds, aligned (at()); the mapping lives as long as self.
        unsafe { self.at::<u32>(off).read_volatile() }
    }

    fn r64(&self, off: usize) -> u64 {
        // SAFETY: as in r32.
        unsafe { self.at::<u64>(off).read_volatile() }
    }

    fn w32(&self, off: usize, v: u32) {
        // SAFETY: as in r32.
        unsafe { self.at::<u32>(off).write_volatile(v) }
    }

    fn w64(&self, off: usize, v: u64) {
        // SAFETY: as in r32.
        unsafe { self.at::<u64>(off).write_volatile(v) }
    }

    fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        (0..len)
            // SAFETY: in bounds (at() checks each byte).
            .map(|i| unsafe { self.at::<u8>(off + i).read_volatile() })
            .collect()
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in map().
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Locked anonymous pages with their guest physical addresses.
struct Pages {
    ptr: *mut u8,
    count: usize,
    pa: Vec<u64>,
}

impl Pages {
    fn new(count: usize) -> Result<Pages, String> {
        let len = count * PAGE;
        // SAFETY: a new private anonymous mapping; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        let ptr: *mut u8 = p.cast();
        // SAFETY: locking our own mapping, so its frames stay put while the
        // device copies to and from them.
        if unsafe { libc::mlock(p, len) } != 0 {
            return Err(format!("mlock: {}", std::io::Error::last_os_error()));
        }
        let f = fs::File::open("/proc/self/pagemap").map_err(|e| format!("pagemap: {e}"))?;
        let mut pa = Vec::new();
        for i in 0..count {
            let va = ptr as usize + i * PAGE;
            let mut e = [0u8; 8];
            let off = (va / PAGE * 8) as i64;
            // SAFETY: reads 8 bytes into a live local buffer.
            let n = unsafe { libc::pread(f.as_raw_fd(), e.as_mut_ptr().cast(), 8, off) };
            if n != 8 {
                return Err("pagemap read failed".into());
            }
            let e = u64::from_le_bytes(e);
            let pfn = e & ((1 << 55) - 1);
            if e >> 63 == 0 || pfn == 0 {
                return Err(format!(
                    "page {i} not present or PFN hidden (pagemap {e:#x})"
                ));
            }
            pa.push(pfn * PAGE as u64);
        }
        Ok(Pages { ptr, count, pa })
    }

    fn fill(&self, page: usize, seed: u8) {
        for i in 0..PAGE {
            // SAFETY: in bounds of our mapping; volatile because the device
            // reads it behind the compiler's back.
            unsafe {
                self.ptr
                    .add(page * PAGE + i)
                    .write_volatile(seed.wrapping_add((i * 7) as u8))
            };
        }
    }

    fn read(&self, page: usize) -> Vec<u8> {
        (0..PAGE)
            // SAFETY: in bounds; volatile because the device writes it.
            .map(|i| unsafe { self.ptr.add(page * PAGE + i).read_volatile() })
            .collect()
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in new().
        unsafe { libc::munmap(self.ptr.cast(), self.count * PAGE) };
    }
}

struct Dev {
    bar2: Bar,
    bar0: Bar,
    queues: u32,
    entries: u32,
    channel_size: u64,
    channels: u32,
    hbm: usize,
    qoff: usize,
    qstride: usize,
    peer: u32,
}

#[derive(Clone, Copy)]
struct Desc {
    src: u64,
    dst: u64,
    id: u64,
    len: u32,
    flags: u32,
}

impl Dev {
    fn block(&self, q: u32) -> usize {
        self.qoff + q as usize * self.qstride
    }

    fn idx(&self, q: u32, field: usize) -> u32 {
        self.bar2.r32(self.block(q) + field)
    }

    fn reset(&self, q: u32) -> R {
        self.bar2.w32(self.block(q) + 0x10, 1);
        let t0 = Instant::now();
        while self.bar2.r32(self.block(q) + 0x10) != 0 {
            if t0.elapsed() > Duration::from_secs(60) {
                return Err(format!("queue {q}: reset not acknowledged in 10 s"));
            }
            thread::sleep(Duration::from_millis(1));
        }
        for (f, name) in [
            (0, "sq_tail"),
            (4, "sq_head"),
            (8, "cq_tail"),
            (12, "cq_head"),
            (0x14, "status"),
        ] {
            if self.idx(q, f) != 0 {
                return Err(format!(
                    "queue {q}: {name} is {} after reset",
                    self.idx(q, f)
                ));
            }
        }
        Ok(())
    }

    fn post(&self, q: u32, d: Desc) {
        let b = self.block(q);
        let tail = self.bar2.r32(b);
        let o = b + 0x1000 + (tail % self.entries) as usize * 32;
        self.bar2.w64(o, d.src);
        self.bar2.w64(o + 8, d.dst);
        self.bar2.w64(o + 16, d.id);
        self.bar2.w32(o + 24, d.len);
        self.bar2.w32(o + 28, d.flags);
        fence(Ordering::Release);
        self.bar2.w32(b, tail.wrapping_add(1));
    }

    fn ring(&self, q: u32) {
        fence(Ordering::SeqCst);
        self.bar0.w32(0x0C, (self.peer << 16) | q);
    }

    /// Waits for `n` completions on queue q and consumes them: (id, status, len_done).
    fn reap(&self, q: u32, n: u32) -> Result<Vec<(u64, u32, u32)>, String> {
        let b = self.block(q);
        let head = self.bar2.r32(b + 12);
        let t0 = Instant::now();
        while self.bar2.r32(b + 8).wrapping_sub(head) < n {
            if t0.elapsed() > Duration::from_secs(60) {
                return Err(format!(
                    "queue {q}: {} of {n} completions in 10 s (status {})",
                    self.bar2.r32(b + 8).wrapping_sub(head),
                    self.idx(q, 0x14)
                ));
            }
            thread::sleep(Duration::from_millis(1));
        }
        fence(Ordering::Acquire);
        let mut v = Vec::new();
        for i in 0..n {
            let o = b + 0x8000 + (head.wrapping_add(i) % self.entries) as usize * 16;
            v.push((
                self.bar2.r64(o),
                self.bar2.r32(o + 8),
                self.bar2.r32(o + 12),
            ));
        }
        self.bar2.w32(b + 12, head.wrapping_add(n));
        Ok(v)
    }

    fn inject(&self, q: u32, cmd: u32) {
        self.bar2.w32(0x100 + 4 * q as usize, cmd);
    }
}

fn find_device() -> Option<PathBuf> {
    let rd = fs::read_dir("/sys/bus/pci/devices").ok()?;
    for e in rd.flatten() {
        let p = e.path();
        let id = |f: &str| {
            fs::read_to_string(p.join(f))
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        if id("vendor") == "0x1af4" && id("device") == "0x1110" {
            return Some(p);
        }
    }
    None
}

fn expect(what: &str, got: Vec<(u64, u32, u32)>, want: &[(u64, u32, u32)]) -> R {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: completions {got:?}, expected {want:?}"))
    }
}

fn main() {
    let Some(pci) = find_device() else {
        skip_all("no ivshmem-doorbell (sim) device");
    };
    if pci.join("driver").exists() {
        let drv = fs::read_link(pci.join("driver")).unwrap_or_default();
        skip_all(&format!("{} is bound to {}", pci.display(), drv.display()));
    }
    let enable = pci.join("enable");
    let _ = fs::write(&enable, "1");
    let bar2_len = fs::metadata(pci.join("resource2"))
        .map(|m| m.len() as usize)
        .unwrap_or(0);
    let (bar2, bar0) = match (
        Bar::map(&pci.join("resource2"), bar2_len),
        Bar::map(&pci.join("resource0"), PAGE),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => skip_all(&format!("cannot map the BARs: {e}")),
    };
    println!("# {}: BAR2 {} MiB", pci.display(), bar2_len >> 20);

    let mut t = Tap::new(10);
    let hdr_ok = bar2.r64(0) == MAGIC && bar2.r32(8) == 1 && bar2.r32(0x3C) == 1;
    t.check(
        "header: magic TDRVSIM1, version 1, ready",
        if hdr_ok {
            Ok(())
        } else {
            Err(format!(
                "magic {:#x} version {} ready {}",
                bar2.r64(0),
                bar2.r32(8),
                bar2.r32(0x3C)
            ))
        },
    );
    if !hdr_ok {
        t.finish();
    }
    let dev = Dev {
        queues: bar2.r32(0x0C),
        entries: bar2.r32(0x10),
        channels: bar2.r32(0x14),
        channel_size: bar2.r64(0x18),
        hbm: bar2.r64(0x20) as usize,
        qoff: bar2.r64(0x28) as usize,
        qstride: bar2.r64(0x30) as usize,
        peer: bar2.r32(0x38),
        bar2,
        bar0,
    };
    println!(
        "# {} queues x {} entries, {} channels x {} MiB, HBM at {:#x}, sim peer {}",
        dev.queues,
        dev.entries,
        dev.channels,
        dev.channel_size >> 20,
        dev.hbm,
        dev.peer
    );
    t.check(
        "header fields within the contract's limits and BAR2",
        (1..=8).contains(&dev.queues)
            && dev.entries.is_power_of_two()
            && (16..=512).contains(&dev.entries)
            && (1..=16).contains(&dev.channels)
            && dev.channel_size.is_multiple_of(2 << 20)
            && dev.hbm as u64 + dev.channels as u64 * dev.channel_size <= bar2_len as u64,
    );
    t.run("every queue resets to zero indices", || {
        (0..dev.queues).try_for_each(|q| dev.reset(q))
    });

    let pages = match Pages::new(4) {
        Ok(p) => p,
        Err(e) => {
            t.check("guest pages with physical addresses", Err(e));
            t.finish();
        }
    };
    let [a, b, c, d] = [pages.pa[0], pages.pa[1], pages.pa[2], pages.pa[3]];
    pages.fill(0, 0x11);
    pages.fill(3, 0xee);
    let want = pages.read(0);
    let untouched = pages.read(3);
    let far = if dev.channels > 1 {
        dev.channel_size
    } else {
        2 * PAGE as u64
    };
    let len = PAGE as u32;
    t.run(
        "host->device, device->device, device->host, host->host at guest physical addresses",
        || {
            let q = 0;
            dev.post(
                q,
                Desc {
                    src: a,
                    dst: 0,
                    id: 1,
                    len,
                    flags: DST_DEV,
                },
            );
            dev.post(
                q,
                Desc {
                    src: 0,
                    dst: far,
                    id: 2,
                    len,
                    flags: SRC_DEV | DST_DEV,
                },
            );
            dev.post(
                q,
                Desc {
                    src: far,
                    dst: b,
                    id: 3,
                    len,
                    flags: SRC_DEV,
                },
            );
            dev.post(
                q,
                Desc {
                    src: a,
                    dst: c,
                    id: 4,
                    len,
                    flags: IRQ,
                },
            );
            dev.ring(q);
            let l = len;
            expect(
                "copies",
                dev.reap(q, 4)?,
                &[(1, 0, l), (2, 0, l), (3, 0, l), (4, 0, l)],
            )?;
            if dev.bar2.bytes(dev.hbm, PAGE) != want
                || dev.bar2.bytes(dev.hbm + far as usize, PAGE) != want
            {
                return Err("HBM (seen through BAR2) differs from the source page".into());
            }
            if pages.read(1) != want || pages.read(2) != want {
                return Err("guest pages written by the device differ from the source".into());
            }
            Ok(())
        },
    );
    t.run(
        "BAD_ADDR beyond guest RAM and HBM, BAD_DESC for flags and length; nothing copied",
        || {
            let q = 0;
            let hbm_end = dev.channels as u64 * dev.channel_size;
            dev.post(
                q,
                Desc {
                    src: 1 << 40,
                    dst: d,
                    id: 5,
                    len,
                    flags: 0,
                },
            );
            dev.post(
                q,
                Desc {
                    src: hbm_end - 8,
                    dst: d,
                    id: 6,
                    len: 16,
                    flags: SRC_DEV,
                },
            );
            dev.post(
                q,
                Desc {
                    src: a,
                    dst: d,
                    id: 7,
                    len,
                    flags: 8,
                },
            );
            dev.post(
                q,
                Desc {
                    src: a,
                    dst: d,
                    id: 8,
                    len: 0,
                    flags: 0,
                },
            );
            dev.post(
                q,
                Desc {
                    src: a,
                    dst: d,
                    id: 9,
                    len: (16 << 20) + 1,
                    flags: 0,
                },
            );
            dev.ring(q);
            expect(
                "errors",
                dev.reap(q, 5)?,
                &[(5, 1, 0), (6, 1, 0), (7, 2, 0), (8, 2, 0), (9, 2, 0)],
            )?;
            if pages.read(3) != untouched {
                return Err("a failed descriptor wrote guest memory".into());
            }
            Ok(())
        },
    );
    t.run("every queue's doorbell runs that queue only", || {
        for q in 0..dev.queues {
            dev.post(
                q,
                Desc {
                    src: a,
                    dst: d,
                    id: 100 + q as u64,
                    len: 64,
                    flags: 0,
                },
            );
        }
        for q in 0..dev.queues {
            dev.ring(q);
            expect(
                &format!("queue {q}"),
                dev.reap(q, 1)?,
                &[(100 + q as u64, 0, 64)],
            )?;
            for other in q + 1..dev.queues {
                if dev.idx(other, 8) != dev.idx(other, 12) {
                    return Err(format!("ringing queue {q} completed on queue {other}"));
                }
            }
        }
        Ok(())
    });
    t.run("nothing runs without a doorbell", || {
        let q = dev.queues - 1;
        dev.post(
            q,
            Desc {
                src: a,
                dst: d,
                id: 200,
                len: 64,
                flags: 0,
            },
        );
        thread::sleep(Duration::from_millis(100));
        if dev.idx(q, 8) != dev.idx(q, 12) {
            return Err("a descriptor completed without a doorbell".into());
        }
        dev.ring(q);
        expect("after the doorbell", dev.reap(q, 1)?, &[(200, 0, 64)])
    });
    t.run(
        "FAIL_NEXT fails one descriptor with FAULT and copies nothing",
        || {
            let q = 0;
            let before = pages.read(3);
            dev.inject(q, 1);
            dev.post(
                q,
                Desc {
                    src: a,
                    dst: d,
                    id: 10,
                    len,
                    flags: 0,
                },
            );
            dev.post(
                q,
                Desc {
                    src: a,
                    dst: c,
                    id: 11,
                    len,
                    flags: 0,
                },
            );
            dev.ring(q);
            expect("fail next", dev.reap(q, 2)?, &[(10, 3, 0), (11, 0, len)])?;
            if pages.read(3) != before {
                return Err("the failed descriptor copied".into());
            }
            if dev.bar2.r32(0x100) != 0 {
                return Err("inject[0] was not taken".into());
            }
            Ok(())
        },
    );
    t.run(
        "STALL keeps descriptors pending (status 2) until reset",
        || {
            let q = 0;
            dev.inject(q, 2);
            dev.post(
                q,
                Desc {
                    src: a,
                    dst: d,
                    id: 12,
                    len,
                    flags: 0,
                },
            );
            dev.ring(q);
            let t0 = Instant::now();
            while dev.idx(q, 0x14) != 2 {
                if t0.elapsed() > Duration::from_secs(60) {
                    return Err(format!("status {} after STALL", dev.idx(q, 0x14)));
                }
                thread::sleep(Duration::from_millis(1));
            }
            thread::sleep(Duration::from_millis(100));
            if dev.idx(q, 8) != dev.idx(q, 12) || dev.idx(q, 4) == dev.idx(q, 0) {
                return Err("a stalled queue consumed or completed a descriptor".into());
            }
            dev.reset(q)?;
            dev.post(
                q,
                Desc {
                    src: a,
                    dst: d,
                    id: 13,
                    len,
                    flags: 0,
                },
            );
            dev.ring(q);
            expect("after reset", dev.reap(q, 1)?, &[(13, 0, len)])
        },
    );
    let name = "tdrv refuses garbage header layouts: probe fails with the reason in dmesg, no oops";
    if Path::new("/lib/modules/tdrv.ko").exists() && Path::new("/etc/tdrv-params").exists() {
        t.run(name, || bad_layouts(&dev, &pci, bar2_len as u64));
    } else {
        t.skip(
            name,
            "needs the QEMU guest's /lib/modules/tdrv.ko to load the module",
        );
    }
    drop(pages);
    let _ = fs::write(&enable, "0");
    t.finish();
}

/// Runs a command; an error unless it exits with 0.
fn command(prog: &str, args: &[&str]) -> R {
    let st = std::process::Command::new(prog)
        .args(args)
        .status()
        .map_err(|e| format!("{prog}: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("{prog} {args:?}: {st}"))
    }
}

/// The kernel log.
fn dmesg() -> Result<String, String> {
    let out = std::process::Command::new("dmesg")
        .output()
        .map_err(|e| format!("dmesg: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The kernel's taint flags.
fn tainted() -> Result<String, String> {
    fs::read_to_string("/proc/sys/kernel/tainted").map_err(|e| format!("tainted: {e}"))
}

/// One header field overwritten with garbage: offset, width, value, and
/// the check the driver must name.
struct BadField {
    off: usize,
    wide: bool,
    value: u64,
    why: &'static str,
}

/// For each garbage layout: writes it into the header (the simulator keeps
/// its own copy of the layout, so only the driver sees it), loads tdrv,
/// expects the sim device unbound and dmesg to name the failed check, and
/// unloads tdrv and restores the field. Nothing may oops or taint the
/// kernel.
fn bad_layouts(dev: &Dev, pci: &Path, bar2_len: u64) -> R {
    let cases = [
        BadField {
            // num_queues (2 or more) * queue_stride overflows 64 bits.
            off: 0x30,
            wide: true,
            value: 1 << 63,
            why: if dev.queues >= 2 {
                "queue_offset + num_queues * queue_stride overflows"
            } else {
                "queue blocks end past hbm_offset"
            },
        },
        BadField {
            off: 0x30,
            wide: true,
            value: 0x10004,
            why: "queue_offset or queue_stride not a multiple of 8",
        },
        BadField {
            off: 0x0C,
            wide: false,
            value: 0,
            why: "num_queues outside 1..=8",
        },
        BadField {
            // num_channels (2 or more) * channel_size overflows 64 bits.
            off: 0x18,
            wide: true,
            value: 1 << 63,
            why: if dev.channels >= 2 {
                "num_channels * channel_size overflows"
            } else {
                "HBM ends past BAR2"
            },
        },
        BadField {
            off: 0x20,
            wide: true,
            value: bar2_len,
            why: "HBM ends past BAR2",
        },
    ];
    let params = fs::read_to_string("/etc/tdrv-params").map_err(|e| format!("params: {e}"))?;
    let mut args = vec!["/lib/modules/tdrv.ko"];
    args.extend(params.split_whitespace());
    let taint0 = tainted()?;
    for c in &cases {
        let line = format!(
            "sim device reports an unusable layout, not binding: {}",
            c.why
        );
        let seen = dmesg()?.matches(&line).count();
        // A fresh mapping of the header for each write: a kernel with
        // IO_STRICT_DEVMEM (Debian's) revokes user mappings of BAR2 when
        // the probe requests the region, and a later access is SIGBUS.
        let header = || Bar::map(&pci.join("resource2"), PAGE);
        let put = |bar: &Bar, v: u64| {
            if c.wide {
                bar.w64(c.off, v)
            } else {
                bar.w32(c.off, v as u32)
            }
        };
        let before = header()?;
        let old = if c.wide {
            before.r64(c.off)
        } else {
            u64::from(before.r32(c.off))
        };
        put(&before, c.value);
        fence(Ordering::SeqCst);
        drop(before);
        let loaded = command("insmod", &args);
        let bound = pci.join("driver").exists();
        let log = dmesg();
        let unloaded = if loaded.is_ok() {
            command("rmmod", &["tdrv"])
        } else {
            Ok(())
        };
        put(&header()?, old);
        fence(Ordering::SeqCst);
        loaded?;
        unloaded?;
        if bound {
            return Err(format!("{}: the driver bound the device", c.why));
        }
        let now = log?.matches(&line).count();
        if now != seen + 1 {
            return Err(format!("dmesg has {now} lines {line:?} (before: {seen})"));
        }
    }
    tdrv_guest_tests::expect_eq("taint flags", tainted()?, taint0)
}
