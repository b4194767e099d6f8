//! Unbind with live dma-buf exports and imports: an exported fd's mappings
//! fault with SIGBUS, its SYNC and mmap fail with ENODEV, an imported
//! dma-heap buffer is detached from the device (and stays usable by its
//! owner), IMPORT on the unbound file fails with ENODEV, and the device
//! works again after rebind. With a software device in the guest, its
//! import of an edu export is revoked by the unbind while its jobs on it
//! run (see docs/sharing.md, "Revocation"). The guest run's dmesg check
//! covers the rest (no WARN, no leak, no use after free).
//!
//! usage: dmabuf_unbind /dev/tdrvN   (an edu device; other kinds are
//! skipped). Run it last: it unbinds and rebinds the device.

use std::{
    fs,
    io::Read,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::atomic::{AtomicBool, Ordering},
};

use tdrv_guest_tests::{
    bail::require,
    desc,
    dmabuf::{heap_alloc, in_child, sync, wait_child, SYNC_READ},
    expect_eq, expect_err, ok, open_device_or_skip,
    raw::{errno, map_fd, page_size, Dev},
    Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

const DRIVER_DIR: &str = "/sys/bus/pci/drivers/tdrv";
const BUFINFO: &str = "/sys/kernel/debug/dma_buf/bufinfo";

/// The PCI address of the (single) edu device bound to tdrv.
fn bound_pci_address() -> Result<String, String> {
    fs::read_dir(DRIVER_DIR)
        .map_err(|e| format!("{DRIVER_DIR}: {e}"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.contains(':') && n.contains('.'))
        .ok_or_else(|| "no PCI device bound to tdrv".into())
}

/// How many dma-buf attachments the device `pci` has (debugfs bufinfo
/// lists each attached device by name).
fn attachments_of(pci: &str) -> Result<usize, String> {
    let text = fs::read_to_string(BUFINFO).map_err(|e| format!("{BUFINFO}: {e}"))?;
    Ok(text.lines().filter(|l| l.trim() == pci).count())
}

/// An edu device node that exists now.
fn edu_node() -> Option<String> {
    let mut nodes: Vec<String> = fs::read_dir("/dev")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
        .filter(|p| p.starts_with("/dev/tdrv"))
        .collect();
    nodes.sort();
    nodes.into_iter().find(|p| {
        Dev::open(p)
            .and_then(|d| d.version())
            .is_ok_and(|v| v.device_kind == TDRV_DEVICE_EDU)
    })
}

/// The first software device's node, if the guest has one.
fn soft_node() -> Option<String> {
    let mut nodes: Vec<String> = fs::read_dir("/dev")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
        .filter(|p| p.starts_with("/dev/tdrv"))
        .collect();
    nodes.sort();
    nodes.into_iter().find(|p| {
        Dev::open(p)
            .and_then(|d| d.version())
            .is_ok_and(|v| v.device_kind == TDRV_DEVICE_SOFT)
    })
}

/// Bytes of the edu buffer the software device imports: jobs on it take a
/// while on the software engine, so the unbind likely meets one running.
const REVOKE_LEN: usize = 4 << 20;

/// The software device's side of the revocation checks, set up before the
/// unbind.
struct Revoke {
    soft: Dev,
    /// The edu export the software device imported (kept open).
    _fd: OwnedFd,
    import: tdrv_import,
    dst: tdrv_alloc,
    /// A child mapping the import through the software device's file: it
    /// reads once more when told to (after the unbind), which must fault.
    child: libc::pid_t,
    go_w: i32,
}

/// How the software device's job loop on the import ended.
#[derive(Debug)]
enum LoopEnd {
    /// A job ended with this status (negative errno).
    Status(i32),
    /// SUBMIT failed with this errno.
    Submit(i32),
    /// Stopped from outside after the unbind, every job done.
    Stopped,
}

/// Jobs back and forth between the import and `dst` until one fails or
/// `stop`; `first` is told after the first one is done. Returns how many
/// were done and how the loop ended.
fn job_loop(r: &Revoke, stop: &AtomicBool, first: std::sync::mpsc::Sender<()>) -> (u64, LoopEnd) {
    let len = REVOKE_LEN as u64;
    let mut done = 0u64;
    loop {
        let d = if done.is_multiple_of(2) {
            desc(r.import.handle, 0, r.dst.handle, 0, len)
        } else {
            desc(r.dst.handle, 0, r.import.handle, 0, len)
        };
        let id = match r.soft.submit(&[d]) {
            Ok(id) => id,
            Err(e) => return (done, LoopEnd::Submit(e)),
        };
        match r.soft.job_wait(id, -1) {
            Ok((TDRV_JOB_DONE, 0)) => done += 1,
            Ok((_, status)) => return (done, LoopEnd::Status(status)),
            Err(e) => return (done, LoopEnd::Submit(e)),
        }
        if done == 1 {
            let _ = first.send(());
        }
        if stop.load(Ordering::Acquire) {
            return (done, LoopEnd::Stopped);
        }
    }
}

/// /dev/kmsg opened at its end: what the kernel logs from now on.
fn kmsg_from_now() -> Result<OwnedFd, String> {
    let path = c"/dev/kmsg";
    // SAFETY: a valid path; the fd is ours.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(format!("/dev/kmsg: errno {}", errno()));
    }
    // SAFETY: just opened, ours.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: our fd.
    if unsafe { libc::lseek(fd.as_raw_fd(), 0, libc::SEEK_END) } < 0 {
        return Err(format!("/dev/kmsg seek: errno {}", errno()));
    }
    Ok(fd)
}

/// The kernel log records written since `kmsg_from_now`.
fn kmsg_since(fd: OwnedFd) -> String {
    let mut f = fs::File::from(fd);
    let mut out = String::new();
    let mut rec = vec![0u8; 8192];
    // One record per read; EAGAIN at the end (EPIPE if records were
    // overwritten meanwhile: skip on).
    loop {
        match f.read(&mut rec) {
            Ok(0) => break,
            Ok(n) => out.push_str(&String::from_utf8_lossy(&rec[..n])),
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    out
}

fn pipe() -> Result<(i32, i32), String> {
    let mut p = [0i32; 2];
    // SAFETY: `p` has room for two fds.
    if unsafe { libc::pipe(p.as_mut_ptr()) } < 0 {
        return Err(format!("pipe: errno {}", errno()));
    }
    Ok((p[0], p[1]))
}

/// A TAP comment line.
fn t_note(msg: &str) {
    println!("# {msg}");
}

fn main() {
    let (dev, node, _) = open_device_or_skip("/dev/tdrv0", Some(TDRV_DEVICE_EDU));
    let pg = page_size();
    // Preconditions, not checks (a failure bails out): live state across
    // the unbind, an export (mapped by a child process) and an import of a
    // heap dma-buf, then the unbind itself.
    let pci = require("finding the bound edu device", bound_pci_address());
    let setup = (|| -> Result<_, String> {
        let pci = pci.clone();
        let a = ok("alloc", dev.alloc(2 * pg as u64, 0))?;
        ok("memset", dev.memset(a.handle, 0, 2 * pg as u64, 0x42))?;
        let exported = ok("export", dev.export(a.handle))?;
        let heap = heap_alloc(pg)?;
        let imported = match &heap {
            Some(fd) => Some(ok("import", dev.import(fd.as_raw_fd(), 0))?),
            None => None,
        };
        if heap.is_some() && attachments_of(&pci)? == 0 {
            return Err("the import is not attached to the device".into());
        }
        let (ready_r, ready_w) = pipe()?;
        let (go_r, go_w) = pipe()?;
        let efd = exported.as_raw_fd();
        let child = in_child(move || {
            let m = ok("mmap", map_fd(efd, 0, 2 * pg))?;
            expect_eq("bytes", m.as_slice()[0], 0x42)?;
            let mut b = [0u8; 1];
            // SAFETY: our own pipe fds and a 1-byte buffer.
            unsafe {
                libc::write(ready_w, b.as_ptr().cast(), 1);
                libc::read(go_r, b.as_mut_ptr().cast(), 1);
            }
            // After unbind this must fault with SIGBUS.
            // SAFETY: reads our own mapping.
            let v = unsafe { std::ptr::read_volatile(m.as_slice().as_ptr().add(pg)) };
            Err(format!("read {v:#x} from a revoked mapping"))
        })?;
        let mut b = [0u8; 1];
        // SAFETY: our own pipe fd and a 1-byte buffer.
        unsafe { libc::read(ready_r, b.as_mut_ptr().cast(), 1) };
        Ok((pci, a, exported, heap, imported, child, go_w))
    })();
    let setup = Ok::<_, String>(require("live exports and imports", setup));
    // A software device imports an edu export and maps it in a child
    // (before any thread exists: the child is forked).
    let soft = soft_node();
    let revoke = soft.as_ref().map(|node| {
        require(
            "a software device's import of an edu export",
            (|| -> Result<Revoke, String> {
                let soft = ok("open the software device", Dev::open(node))?;
                let a = ok("alloc", dev.alloc(REVOKE_LEN as u64, 0))?;
                ok("memset", dev.memset(a.handle, 0, REVOKE_LEN as u64, 0x5a))?;
                let fd = ok("export", dev.export(a.handle))?;
                let import = ok(
                    "import into the software device",
                    soft.import(fd.as_raw_fd(), 0),
                )?;
                let dst = ok(
                    "alloc on the software device",
                    soft.alloc(REVOKE_LEN as u64, 0),
                )?;
                let (ready_r, ready_w) = pipe()?;
                let (go_r, go_w) = pipe()?;
                let (mmap_offset, sfd) = (import.mmap_offset, soft.fd());
                let child = in_child(move || {
                    let m = ok("mmap of the import", map_fd(sfd, mmap_offset, pg))?;
                    expect_eq("bytes through the import", m.as_slice()[0], 0x5a)?;
                    let mut b = [0u8; 1];
                    // SAFETY: our own pipe fds and a 1-byte buffer.
                    unsafe {
                        libc::write(ready_w, b.as_ptr().cast(), 1);
                        libc::read(go_r, b.as_mut_ptr().cast(), 1);
                    }
                    // SAFETY: reads our own mapping; after the revocation
                    // this must fault with SIGBUS.
                    let v = unsafe { std::ptr::read_volatile(m.as_slice().as_ptr()) };
                    Err(format!("read {v:#x} from a revoked import's mapping"))
                })?;
                let mut b = [0u8; 1];
                // SAFETY: our own pipe fd and a 1-byte buffer.
                unsafe { libc::read(ready_r, b.as_mut_ptr().cast(), 1) };
                Ok(Revoke {
                    soft,
                    _fd: fd,
                    import,
                    dst,
                    child,
                    go_w,
                })
            })(),
        )
    });
    let kmsg = kmsg_from_now();
    // The unbind, with the software device's jobs on the import running.
    let stop = AtomicBool::new(false);
    let loop_end = std::thread::scope(|s| {
        let jobs = revoke.as_ref().map(|r| {
            let (tx, rx) = std::sync::mpsc::channel();
            let h = s.spawn(|| job_loop(r, &stop, tx));
            // Unbind once a job is done (or the loop ended early, which
            // the check below reports).
            let _ = rx.recv();
            h
        });
        require(
            "unbind with live exports and imports",
            fs::write(format!("{DRIVER_DIR}/unbind"), &pci),
        );
        stop.store(true, Ordering::Release);
        jobs.map(|h| h.join().expect("the job thread panicked"))
    });
    let mut t = Tap::new(10);

    t.run(
        "after unbind: the export's mappings fault with SIGBUS",
        || -> R {
            let (.., child, go_w) = setup.as_ref().map_err(|e| e.clone())?;
            let b = [1u8; 1];
            // SAFETY: our own pipe fd and a 1-byte buffer.
            unsafe { libc::write(*go_w, b.as_ptr().cast(), 1) };
            let status = wait_child(*child)?;
            if !(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS) {
                return Err(format!("child ended with status {status:#x}, want SIGBUS"));
            }
            Ok(())
        },
    );

    t.run(
        "after unbind: SYNC and mmap of the export fail with ENODEV",
        || -> R {
            let (_, _, exported, ..) = setup.as_ref().map_err(|e| e.clone())?;
            expect_err(
                "SYNC_START",
                sync(exported.as_raw_fd(), SYNC_READ),
                libc::ENODEV,
            )?;
            expect_err(
                "mmap",
                map_fd(exported.as_raw_fd(), 0, pg).map(drop),
                libc::ENODEV,
            )
        },
    );

    t.run(
        "after unbind: IMPORT of the export and EXPORT fail with ENODEV",
        || -> R {
            let (_, a, exported, ..) = setup.as_ref().map_err(|e| e.clone())?;
            expect_err(
                "IMPORT of the export",
                dev.import(exported.as_raw_fd(), 0).map(drop),
                libc::ENODEV,
            )?;
            expect_eq("EXPORT", dev.export(a.handle).map(drop), Err(libc::ENODEV))
        },
    );

    let name = "after unbind: a dma-heap import is detached, IMPORT of a heap fd fails with ENODEV";
    match &setup {
        Ok((_, _, _, None, ..)) => t.skip(name, "no /dev/dma_heap/system: nothing was imported"),
        _ => t.run(name, || -> R {
            let (pci, _, _, heap, imported, ..) = setup.as_ref().map_err(|e| e.clone())?;
            let (Some(heap), Some(_)) = (heap, imported) else {
                return Err("the heap buffer was not imported".into());
            };
            expect_err(
                "IMPORT of a heap fd",
                dev.import(heap.as_raw_fd(), 0).map(drop),
                libc::ENODEV,
            )?;
            expect_eq("attachments left", attachments_of(pci)?, 0)?;
            // The heap buffer itself is intact and still its owner's.
            let mut m = ok("heap mmap", map_fd(heap.as_raw_fd(), 0, pg))?;
            m.as_mut_slice()[0] = 7;
            expect_eq("heap byte", m.as_slice()[0], 7)
        }),
    }

    let no_soft = "no software device in this guest (scripts/guest -S has one)";
    let name = "during the unbind: the software device's jobs on its import of an edu export end done or with ENODEV, and stop with ENODEV";
    match &loop_end {
        None => t.skip(name, no_soft),
        Some(end) => t.run(name, || -> R {
            match end {
                (n, LoopEnd::Status(s)) if *s == -libc::ENODEV => {
                    t_note(&format!("{n} jobs done, then a job ended with ENODEV"));
                    Ok(())
                }
                (n, LoopEnd::Submit(libc::ENODEV)) => {
                    t_note(&format!("{n} jobs done, then SUBMIT failed with ENODEV"));
                    Ok(())
                }
                other => Err(format!(
                    "job loop ended with {other:?}, want a job or SUBMIT ending with ENODEV"
                )),
            }
        }),
    }

    let name = "after the unbind: SUBMIT, COPY_IN, COPY_OUT, MEMSET and COPY with the software device's import fail with ENODEV; FREE works";
    match &revoke {
        None => t.skip(name, no_soft),
        Some(r) => t.run(name, || -> R {
            let (h, d) = (r.import.handle, r.dst.handle);
            expect_err(
                "SUBMIT",
                r.soft.submit(&[desc(d, 0, h, 0, pg as u64)]),
                libc::ENODEV,
            )?;
            expect_err("COPY_IN", r.soft.copy_in(h, 0, &[1u8; 16]), libc::ENODEV)?;
            let mut out = [0u8; 16];
            expect_err("COPY_OUT", r.soft.copy_out(h, 0, &mut out), libc::ENODEV)?;
            expect_err("MEMSET", r.soft.memset(h, 0, 16, 3), libc::ENODEV)?;
            expect_err("COPY", r.soft.copy(desc(h, 0, d, 0, 16)), libc::ENODEV)?;
            // The software device itself is fine: a job on its own buffer.
            let id = ok(
                "SUBMIT on the software device's own buffer",
                r.soft.submit(&[desc(d, 0, d, pg as u64, 16)]),
            )?;
            expect_eq(
                "its job",
                ok("JOB_WAIT", r.soft.job_wait(id, -1))?,
                (TDRV_JOB_DONE, 0),
            )?;
            ok("FREE of the revoked import", r.soft.free(h))
        }),
    }

    let name = "after the unbind: a mapping of the software device's import faults with SIGBUS";
    match &revoke {
        None => t.skip(name, no_soft),
        Some(r) => t.run(name, || -> R {
            let b = [1u8; 1];
            // SAFETY: our own pipe fd and a 1-byte buffer.
            unsafe { libc::write(r.go_w, b.as_ptr().cast(), 1) };
            let status = wait_child(r.child)?;
            if !(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS) {
                return Err(format!("child ended with status {status:#x}, want SIGBUS"));
            }
            Ok(())
        }),
    }

    let name = "the unbind left no edu DMA allocation behind (DMA-API debug reports none pending)";
    if revoke.is_none() {
        t.skip(name, no_soft);
    } else if fs::metadata("/sys/kernel/debug/dma-api").is_err() {
        t.skip(name, "this kernel has no CONFIG_DMA_API_DEBUG");
    } else {
        t.run(name, || -> R {
            let log = kmsg_since(kmsg.map_err(|e| e.clone())?);
            match log.lines().find(|l| l.contains("pending DMA allocations")) {
                Some(l) => Err(format!("kernel log: {l}")),
                None => Ok(()),
            }
        });
    }

    // Everything goes before the rebind: closing revoked exports and
    // imports must be clean too.
    drop(revoke);
    drop(setup);
    drop(dev);

    t.run(
        "rebind: export and import work on the new device",
        || -> R {
            fs::write(format!("{DRIVER_DIR}/bind"), &pci).map_err(|e| format!("bind: {e}"))?;
            // The bind probes synchronously, and devtmpfs creates the node
            // before the probe returns: no wait is needed.
            let node = edu_node().unwrap_or_else(|| node.clone());
            let dev = ok("open", Dev::open(&node))?;
            let a = ok("alloc", dev.alloc(pg as u64, 0))?;
            ok("memset", dev.memset(a.handle, 0, pg as u64, 9))?;
            let fd = ok("export", dev.export(a.handle))?;
            let i = ok("import", dev.import(fd.as_raw_fd(), 0))?;
            let mut out = vec![0u8; pg];
            ok("copy_out", dev.copy_out(i.handle, 0, &mut out))?;
            expect_eq("bytes", out.iter().all(|b| *b == 9), true)
        },
    );

    t.run(
        "with everything closed, nothing pins the module",
        || -> R {
            // Nothing of the revoked exports may still pin the module.
            let refcnt: u64 = fs::read_to_string("/sys/module/tdrv/refcnt")
                .map_err(|e| e.to_string())?
                .trim()
                .parse()
                .map_err(|e| format!("{e}"))?;
            expect_eq("module refcnt with nothing open", refcnt, 0)
        },
    );

    t.finish();
}
