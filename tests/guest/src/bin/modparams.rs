//! Module parameters, with tdrv.ko unloaded: insmod refuses every
//! out-of-range value with EINVAL and a kernel log line naming the
//! parameter and its range; a parameter given twice (modprobe.d plus the
//! command line) loads and takes its last value; then, loaded with small
//! per-file caps (file_max_buffers=4 file_max_mib=1) and edu_dma_bits=30,
//! ALLOC and IMPORT past the caps are ENOSPC (a foreign dma-buf counts
//! against the buffer cap only), and on edu an IMPORT of a dma-buf whose
//! page lies beyond the DMA mask is EIO. It unloads the module again at the end.
//!
//! usage: modparams [ignored] (run-all runs it while the module is out)

use std::{
    ffi::CString,
    fs,
    io::Read,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use tdrv_guest_tests::{
    dmabuf::heap_alloc,
    expect_eq, expect_err, ok,
    raw::{errno, map_fd, page_size, Dev, Errno},
    skip_all, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

const MODULE: &str = "/lib/modules/tdrv.ko";
/// The caps this program loads the module with.
const MAX_BUFFERS: usize = 4;
const MAX_MIB: u64 = 1;
const DMA_BITS: u32 = 30;
const DEVICE_IMPORTS: usize = 3;

fn loaded() -> bool {
    std::path::Path::new("/sys/module/tdrv").exists()
}

/// finit_module(2) of tdrv.ko with `params`.
fn insmod(params: &str) -> Result<(), Errno> {
    let f = fs::File::open(MODULE).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    let p = CString::new(params).map_err(|_| libc::EINVAL)?;
    // SAFETY: a module fd, a NUL-terminated string and no flags.
    let r = unsafe { libc::syscall(libc::SYS_finit_module, f.as_raw_fd(), p.as_ptr(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

fn rmmod() -> Result<(), Errno> {
    // SAFETY: a NUL-terminated name and flags.
    let r = unsafe { libc::syscall(libc::SYS_delete_module, c"tdrv".as_ptr(), libc::O_NONBLOCK) };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

/// The kernel log from now on: /dev/kmsg positioned at its end.
struct Kmsg(fs::File);

impl Kmsg {
    fn open() -> Result<Kmsg, String> {
        // SAFETY: a NUL-terminated path literal.
        let fd = unsafe {
            libc::open(
                c"/dev/kmsg".as_ptr(),
                libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(format!("/dev/kmsg: errno {}", errno()));
        }
        // SAFETY: a descriptor open(2) just returned.
        let f = fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        // SAFETY: lseek on our own fd.
        unsafe { libc::lseek(fd, 0, libc::SEEK_END) };
        Ok(Kmsg(f))
    }

    /// The messages logged since the last call.
    fn lines(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 8192];
        // One record per read; EAGAIN when there are no more.
        while let Ok(n) = self.0.read(&mut buf) {
            if n == 0 {
                break;
            }
            let rec = String::from_utf8_lossy(&buf[..n]);
            if let Some((_, msg)) = rec.split_once(';') {
                out.push(msg.lines().next().unwrap_or("").to_owned());
            }
        }
        out
    }
}

/// insmod with `params` fails with EINVAL, leaves no module, and logs a
/// line containing each of `want`.
fn refused(kmsg: &mut Kmsg, params: &str, want: &[String]) -> R {
    kmsg.lines();
    let r = insmod(params);
    let log = kmsg.lines();
    if loaded() {
        let _ = rmmod();
        return Err(format!("insmod {params}: the module stayed loaded"));
    }
    expect_err(&format!("insmod {params}"), r, libc::EINVAL)?;
    for w in want {
        if !log.iter().any(|l| l.contains(w.as_str())) {
            return Err(format!(
                "insmod {params}: no log line with {w:?}; the log said:\n{}",
                log.join("\n")
            ));
        }
    }
    Ok(())
}

fn tdrv_nodes() -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir("/dev")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
                .filter(|p| p.starts_with("/dev/tdrv"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The physical address of the page behind a heap dma-buf's first byte
/// (root can read PFNs from /proc/self/pagemap), or None.
fn phys_of(fd: i32) -> Result<Option<u64>, String> {
    let pg = page_size();
    let m = ok("heap mmap", map_fd(fd, 0, pg))?;
    // SAFETY: a volatile read of our own mapping, to fault the page in.
    let _ = unsafe { std::ptr::read_volatile(m.as_slice().as_ptr()) };
    let vaddr = m.as_slice().as_ptr() as u64;
    let f = fs::File::open("/proc/self/pagemap").map_err(|e| format!("pagemap: {e}"))?;
    let mut entry = [0u8; 8];
    // SAFETY: pread into a local 8-byte buffer.
    let n = unsafe {
        libc::pread(
            f.as_raw_fd(),
            entry.as_mut_ptr().cast(),
            8,
            (vaddr / pg as u64 * 8) as libc::off_t,
        )
    };
    if n != 8 {
        return Err(format!("pagemap read: errno {}", errno()));
    }
    let e = u64::from_ne_bytes(entry);
    let pfn = e & ((1 << 55) - 1);
    if e >> 63 == 0 || pfn == 0 {
        return Ok(None);
    }
    Ok(Some(pfn * pg as u64))
}

fn main() {
    if loaded() {
        skip_all("tdrv is loaded: run-all runs this program while the module is out");
    }
    if !std::path::Path::new(MODULE).exists() {
        skip_all(&format!("no {MODULE}"));
    }
    let mut kmsg = match Kmsg::open() {
        Ok(k) => k,
        Err(e) => skip_all(&e),
    };
    // (parameter, a value below its range, one above, the range)
    let bad: [(&str, Option<u64>, Option<u64>, &str); 14] = [
        ("soft_devices", None, Some(5), "0-4"),
        ("channels", Some(0), Some(17), "1-16"),
        ("channel_mib", Some(0), Some(4097), "1-4096"),
        ("edu_dma_bits", Some(23), Some(65), "24-64"),
        ("edu_timeout_ms", Some(199), Some(600_001), "200-600000"),
        ("sim_timeout_ms", Some(99), Some(600_001), "100-600000"),
        ("file_max_buffers", Some(0), Some(16_777_217), "1-16777216"),
        ("file_max_mib", Some(0), Some(1_048_577), "1-1048576"),
        ("file_max_jobs", Some(0), Some(4096), "1-4095"),
        ("file_max_imports", Some(0), Some(16_777_217), "1-16777216"),
        ("file_max_events", Some(0), Some(65_537), "1-65536"),
        ("device_max_events", Some(0), Some(16_777_217), "1-16777216"),
        (
            "device_max_imports",
            Some(0),
            Some(16_777_217),
            "1-16777216",
        ),
        (
            "file_max_inflight_mib",
            Some(0),
            Some(1_048_577),
            "1-1048576",
        ),
    ];
    let mut t = Tap::new(bad.len() + 11);

    for (name, low, high, range) in bad {
        t.run(
            &format!("insmod refuses {name} outside {range} with EINVAL and says why"),
            || -> R {
                for v in [low, high].into_iter().flatten() {
                    let p = format!("{name}={v}");
                    refused(
                        &mut kmsg,
                        &p,
                        &[format!(
                            "invalid module parameter {p}: allowed range is {range}"
                        )],
                    )?;
                }
                Ok(())
            },
        );
    }
    t.run("insmod with two bad parameters names both", || -> R {
        refused(
            &mut kmsg,
            "channels=0 file_max_jobs=0",
            &[
                "invalid module parameter channels=0".into(),
                "invalid module parameter file_max_jobs=0".into(),
            ],
        )
    });
    t.run(
        "insmod refuses a value that is not a number with EINVAL",
        || -> R { refused(&mut kmsg, "channels=two", &["channels".into()]) },
    );

    // An option in /etc/modprobe.d and again on the modprobe command line
    // reaches the module twice: the last value wins (the sysfs value and
    // the devices' channel count), as with C modules. (7.2's Rust
    // parameters failed such a load with EEXIST.)
    t.run(
        "insmod with a parameter given twice loads, and the last value wins",
        || -> R {
            let p = "channels=3 soft_devices=1 channels=2 soft_devices=2";
            ok(&format!("insmod {p}"), insmod(p))?;
            let read = |n: &str| {
                fs::read_to_string(format!("/sys/module/tdrv/parameters/{n}"))
                    .map(|s| s.trim().to_owned())
                    .map_err(|e| format!("/sys/module/tdrv/parameters/{n}: {e}"))
            };
            let r = (|| -> R {
                expect_eq("channels in sysfs", read("channels")?, "2".to_owned())?;
                expect_eq(
                    "soft_devices in sysfs",
                    read("soft_devices")?,
                    "2".to_owned(),
                )?;
                let f = ok("open /dev/tdrv0", Dev::open("/dev/tdrv0"))?;
                ok("channel 1 exists", f.channel_info(1))?;
                expect_err(
                    "channel 2 (only 2 channels)",
                    f.channel_info(2).map(drop),
                    libc::EINVAL,
                )
            })();
            ok("rmmod", rmmod())?;
            r
        },
    );

    // The guest's own parameters, but the caps and mask of this program.
    let mine = [
        "file_max_buffers",
        "file_max_mib",
        "edu_dma_bits",
        "device_max_imports",
    ];
    let base: Vec<String> = fs::read_to_string("/etc/tdrv-params")
        .unwrap_or_default()
        .split_whitespace()
        .filter(|p| !mine.contains(&p.split('=').next().unwrap_or("")))
        .map(str::to_owned)
        .collect();
    let params = format!(
        "{} file_max_buffers={MAX_BUFFERS} file_max_mib={MAX_MIB} edu_dma_bits={DMA_BITS} device_max_imports={DEVICE_IMPORTS}",
        base.join(" ")
    );
    let mut nodes = Vec::new();
    t.run(
        "after the refused ones, insmod with valid caps works",
        || -> R {
            ok(&format!("insmod {params}"), insmod(&params))?;
            nodes = tdrv_nodes();
            if nodes.is_empty() {
                return Err("no /dev/tdrv* after insmod".into());
            }
            t_note(&format!("devices: {nodes:?}"));
            Ok(())
        },
    );

    let pg = page_size() as u64;
    let mib = MAX_MIB << 20;
    // Every device is checked; a check fails if any device fails it.
    let on_all = |f: &dyn Fn(&str) -> R| -> R {
        if nodes.is_empty() {
            return Err("no device".into());
        }
        for n in &nodes {
            f(n).map_err(|e| format!("{n}: {e}"))?;
        }
        Ok(())
    };
    let open = |n: &str| ok("open", Dev::open(n));

    t.run(
        "ALLOC past file_max_buffers is ENOSPC; FREE makes room; other files are not limited",
        || {
            on_all(&|n| {
                let f = open(n)?;
                let mut h = Vec::new();
                for _ in 0..MAX_BUFFERS {
                    h.push(ok("alloc", f.alloc(pg, 0))?.handle);
                }
                let used = ok("channel_info", f.channel_info(0))?.used_bytes;
                expect_err("alloc past the cap", f.alloc(pg, 0).map(drop), libc::ENOSPC)?;
                expect_eq(
                    "channel bytes after the refusal",
                    ok("channel_info", f.channel_info(0))?.used_bytes,
                    used,
                )?;
                let g = open(n)?;
                ok("alloc in another file", g.alloc(pg, 0))?;
                ok("free", f.free(h[0]))?;
                ok("alloc after a free", f.alloc(pg, 0)).map(drop)
            })
        },
    );

    t.run(
        "IMPORT past file_max_buffers is ENOSPC and gives no handle",
        || {
            on_all(&|n| {
                let f = open(n)?;
                let a = ok("alloc", f.alloc(pg, 0))?;
                let dmabuf = ok("export", f.export(a.handle))?;
                let g = open(n)?;
                let mut h = Vec::new();
                for _ in 0..MAX_BUFFERS - 1 {
                    h.push(ok("alloc", g.alloc(pg, 0))?.handle);
                }
                let imp = ok("import up to the cap", g.import(dmabuf.as_raw_fd(), 0))?;
                expect_err(
                    "import past the cap",
                    g.import(dmabuf.as_raw_fd(), 0).map(drop),
                    libc::ENOSPC,
                )?;
                ok("free", g.free(imp.handle))?;
                ok("import after a free", g.import(dmabuf.as_raw_fd(), 0)).map(drop)
            })
        },
    );

    t.run(
        "ALLOC past file_max_mib (page-rounded) is ENOSPC; FREE makes room",
        || {
            on_all(&|n| {
                let f = open(n)?;
                // Rounded up to pages, this is the whole cap.
                let a = ok("alloc", f.alloc(mib - 100, 0))?;
                expect_err("one byte more", f.alloc(1, 0).map(drop), libc::ENOSPC)?;
                ok("alloc in another file", open(n)?.alloc(mib, 0))?;
                ok("free", f.free(a.handle))?;
                ok("alloc after a free", f.alloc(mib, 0)).map(drop)
            })
        },
    );

    t.run(
        "IMPORT of a tdrv buffer past file_max_mib is ENOSPC",
        || {
            on_all(&|n| {
                let f = open(n)?;
                let a = ok("alloc", f.alloc(mib, 0))?;
                let dmabuf = ok("export", f.export(a.handle))?;
                let g = open(n)?;
                let b = ok("alloc", g.alloc(pg, 0))?;
                expect_err(
                    "import of 1 MiB on top of a page",
                    g.import(dmabuf.as_raw_fd(), 0).map(drop),
                    libc::ENOSPC,
                )?;
                ok("free", g.free(b.handle))?;
                let imp = ok("import after a free", g.import(dmabuf.as_raw_fd(), 0))?;
                expect_eq("imported size", imp.size, mib)
            })
        },
    );

    let edu_reach = 1u64 << DMA_BITS;
    // A heap page the device can reach (edu: below its mask), if any.
    let heap_page = |kind: u32, below: bool| -> Result<Option<OwnedFd>, String> {
        for _ in 0..256 {
            let Some(fd) = heap_alloc(pg as usize)? else {
                return Ok(None);
            };
            if kind != TDRV_DEVICE_EDU {
                return Ok(Some(fd));
            }
            if let Some(phys) = phys_of(fd.as_raw_fd())? {
                if (phys + pg <= edu_reach) == below {
                    return Ok(Some(fd));
                }
            }
        }
        Ok(None)
    };

    let is_edu = |n: &String| {
        Dev::open(n)
            .and_then(|d| d.version())
            .is_ok_and(|v| v.device_kind == TDRV_DEVICE_EDU)
    };
    let foreign = "a foreign dma-buf counts against file_max_buffers, not file_max_mib";
    match heap_alloc(pg as usize) {
        Ok(None) => t.skip(foreign, "no /dev/dma_heap/system to import from"),
        Err(e) => t.check(foreign, Err::<(), _>(e)),
        // Which heap pages edu can reach is unknown when pagemap shows no
        // frames: the check would depend on where they landed.
        Ok(Some(_)) if nodes.iter().all(is_edu) && phys_of_heap_known().ok().flatten().is_none() => {
            t.skip(foreign, "only edu devices, and pagemap shows no frame of heap pages (which of them edu reaches is unknown)")
        }
        Ok(Some(_)) => t.run(foreign, || {
            let edu_unknown = phys_of_heap_known()?.is_none();
            on_all(&|n| {
                let f = open(n)?;
                let kind = ok("version", f.version())?.device_kind;
                if kind == TDRV_DEVICE_EDU && edu_unknown {
                    t_note(&format!(
                        "{n}: not checked (pagemap shows no frame of heap pages); the other devices are"
                    ));
                    return Ok(());
                }
                ok("alloc the whole byte cap", f.alloc(mib, 0))?;
                let mut heaps = Vec::new();
                for _ in 0..MAX_BUFFERS {
                    let Some(fd) = heap_page(kind, true)? else {
                        return Err("no heap page within the DMA mask in 256 tries".into());
                    };
                    heaps.push(fd);
                }
                let last = heaps.pop().expect("MAX_BUFFERS > 0");
                for fd in &heaps {
                    ok("import a heap page", f.import(fd.as_raw_fd(), 0))?;
                }
                expect_err(
                    "import past the buffer cap",
                    f.import(last.as_raw_fd(), 0).map(drop),
                    libc::ENOSPC,
                )
            })
        }),
    }

    // The device-wide cap on foreign imports, across files. (Not on edu:
    // which heap pages it can reach depends on where they land.)
    let name = format!(
        "foreign imports past device_max_imports ({DEVICE_IMPORTS}) are ENOSPC in every file of the device; a FREE makes room"
    );
    let not_edu: Vec<String> = nodes
        .iter()
        .filter(|n| {
            Dev::open(n)
                .and_then(|d| d.version())
                .is_ok_and(|v| v.device_kind != TDRV_DEVICE_EDU)
        })
        .cloned()
        .collect();
    match heap_alloc(pg as usize) {
        Ok(None) => t.skip(&name, "no /dev/dma_heap/system to import from"),
        Err(e) => t.check(&name, Err::<(), _>(e)),
        Ok(Some(_)) if not_edu.is_empty() => t.skip(&name, "no software or sim device"),
        Ok(Some(_)) => t.run(&name, || -> R {
            for n in &not_edu {
                let mut pages = Vec::new();
                for _ in 0..=DEVICE_IMPORTS {
                    pages.push(heap_alloc(pg as usize)?.ok_or("no heap page")?);
                }
                let (f, g) = (open(n)?, open(n)?);
                // Two files, each under its own caps, fill the device's.
                let first = ok(
                    "import in the first file",
                    f.import(pages[0].as_raw_fd(), 0),
                )?;
                for p in &pages[1..DEVICE_IMPORTS] {
                    ok("import in the second file", g.import(p.as_raw_fd(), 0))?;
                }
                let last = pages[DEVICE_IMPORTS].as_raw_fd();
                expect_err(
                    &format!("{n}: one import more"),
                    g.import(last, 0).map(drop),
                    libc::ENOSPC,
                )?;
                expect_err(
                    &format!("{n}: one import more, in a third file"),
                    open(n)?.import(last, 0).map(drop),
                    libc::ENOSPC,
                )?;
                // Its own buffers are not imports.
                ok("alloc in the second file", g.alloc(pg, 0))?;
                ok("free an import", f.free(first.handle))?;
                ok("import after the free", g.import(last, 0))?;
            }
            Ok(())
        }),
    }

    let edu_nodes: Vec<String> = nodes
        .iter()
        .filter(|n| {
            Dev::open(n)
                .and_then(|d| d.version())
                .is_ok_and(|v| v.device_kind == TDRV_DEVICE_EDU)
        })
        .cloned()
        .collect();
    let name = format!(
        "edu: IMPORT of a dma-buf page beyond the {DMA_BITS}-bit DMA mask is EIO and loses nothing"
    );
    if edu_nodes.is_empty() {
        t.skip(&name, "no edu device");
    } else {
        match heap_page(TDRV_DEVICE_EDU, false) {
            Ok(None) => t.skip(
                &name,
                "no system-heap page known to lie above the mask in 256 tries (no heap, or pagemap shows no frame of its pages)",
            ),
            Err(e) => t.check(&name, Err::<(), _>(e)),
            Ok(Some(far)) => t.run(&name, || -> R {
                for n in &edu_nodes {
                    let f = open(n)?;
                    let before = ok("channel_info", f.channel_info(0))?;
                    expect_err(
                        &format!("{n}: import"),
                        f.import(far.as_raw_fd(), 0).map(drop),
                        libc::EIO,
                    )?;
                    let after = ok("channel_info", f.channel_info(0))?;
                    expect_eq(
                        "channel (used, buffers)",
                        (after.used_bytes, after.buffers),
                        (before.used_bytes, before.buffers),
                    )?;
                    // The refusal took no handle: the whole cap is free.
                    for _ in 0..MAX_BUFFERS {
                        ok("alloc", f.alloc(pg, 0))?;
                    }
                }
                Ok(())
            }),
        }
    }

    // Leave the module out, as run-all expects; a failure fails the run
    // (it breaks the plan).
    if let Err(e) = rmmod() {
        t.check(
            "rmmod after the capped run",
            Err::<(), _>(format!("errno {e}")),
        );
    }
    drop(kmsg);
    t.finish()
}

/// The physical address of a fresh heap page, if pagemap tells it.
fn phys_of_heap_known() -> Result<Option<u64>, String> {
    match heap_alloc(page_size())? {
        Some(fd) => phys_of(fd.as_raw_fd()),
        None => Ok(None),
    }
}

fn t_note(msg: &str) {
    println!("# {msg}");
}
