//! dma-buf export and import (TDRV_IOC_EXPORT, TDRV_IOC_IMPORT): sharing
//! with a second file and a second process (SCM_RIGHTS), mmap and
//! DMA_BUF_IOCTL_SYNC on the exported fd, foreign dma-bufs from
//! /dev/dma_heap/system with jobs on them, lifetime past FREE, close and
//! exit, bad fds, and the module pin of an export (rmmod fails).
//!
//! usage: dmabuf /dev/tdrvN

use std::{
    fs,
    os::fd::{AsRawFd, OwnedFd},
};

use tdrv_guest_tests::{
    desc,
    dmabuf::{child_ok, heap_alloc, in_child, sync, FdLink, SYNC_END, SYNC_READ, SYNC_WRITE},
    expect_eq, expect_err, ok, open_device_or_skip,
    raw::{errno, map_fd, page_size, Dev},
    wait::until,
    Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

/// A TAP diagnostic line.
fn t_note(msg: &str) {
    println!("# {msg}");
}

/// A test on an imported dma-heap buffer of the given length.
type HeapTest = fn(&Dev, OwnedFd, usize) -> R;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn read_buf(dev: &Dev, handle: u64, len: usize) -> Result<Vec<u8>, String> {
    ok("copy_out", dev.read_vec(handle, len))
}

fn run_job(dev: &Dev, src: u64, dst: u64, size: u64) -> R {
    let id = ok("submit", dev.submit(&[desc(src, 0, dst, 0, size)]))?;
    expect_eq(
        "job",
        ok("job_wait", dev.job_wait(id, -1))?,
        (TDRV_JOB_DONE, 0),
    )
}

fn module_refcnt() -> Result<u64, String> {
    let text = fs::read_to_string("/sys/module/tdrv/refcnt").map_err(|e| e.to_string())?;
    text.trim()
        .parse()
        .map_err(|e| format!("refcnt {text:?}: {e}"))
}

fn fd_flags(fd: i32) -> (i32, i32) {
    // SAFETY: fcntl on our own fd, no pointers.
    unsafe {
        (
            libc::fcntl(fd, libc::F_GETFD),
            libc::fcntl(fd, libc::F_GETFL),
        )
    }
}

fn main() {
    let (dev, node, version) = open_device_or_skip("/dev/tdrv0", None);
    let edu = version.device_kind == TDRV_DEVICE_EDU;
    let pg = page_size();
    // Edu moves ~4 KiB per 0.2 s of virtual time: keep its jobs small.
    let job_len = if edu { 2 * pg } else { 256 << 10 };
    let mut t = Tap::new(17);

    t.run("export gives an O_RDWR, O_CLOEXEC dma-buf fd", || -> R {
        let a = ok("alloc", dev.alloc(5000, 0))?;
        let fd = ok("export", dev.export(a.handle))?;
        let (fdf, fl) = fd_flags(fd.as_raw_fd());
        expect_eq("FD_CLOEXEC", fdf & libc::FD_CLOEXEC, libc::FD_CLOEXEC)?;
        expect_eq("O_ACCMODE", fl & libc::O_ACCMODE, libc::O_RDWR)?;
        let info = fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))
            .map_err(|e| e.to_string())?;
        if !info.contains("exp_name:\ttdrv") {
            return Err(format!("fdinfo does not name tdrv: {info}"));
        }
        if !info.contains("size:\t8192") {
            return Err(format!("fdinfo size is not the page-rounded 8192: {info}"));
        }
        ok("free", dev.free(a.handle))
    });

    t.run("export and import reject bad arguments", || -> R {
        let a = ok("alloc", dev.alloc(4096, 0))?;
        expect_err(
            "unknown handle",
            dev.export(a.handle + 1000).map(drop),
            libc::ENOENT,
        )?;
        let mut e = tdrv_export {
            handle: a.handle,
            flags: 1,
            ..Default::default()
        };
        expect_err(
            "export flags",
            dev.ioctl(TDRV_IOC_EXPORT, &mut e),
            libc::EINVAL,
        )?;
        let fd = ok("export", dev.export(a.handle))?;
        let mut i = tdrv_import {
            fd: fd.as_raw_fd(),
            flags: 1,
            ..Default::default()
        };
        expect_err(
            "import flags",
            dev.ioctl(TDRV_IOC_IMPORT, &mut i),
            libc::EINVAL,
        )?;
        let null = fs::File::open("/dev/null").map_err(|e| e.to_string())?;
        expect_err("/dev/null", dev.import(null.as_raw_fd(), 0), libc::EINVAL)?;
        expect_err("fd -1", dev.import(-1, 0), libc::EBADF)?;
        expect_err("closed fd", dev.import(999, 0), libc::EBADF)?;
        ok("free", dev.free(a.handle))
    });

    t.run("mmap of the dma-buf fd is the buffer's memory", || -> R {
        let len = 3 * pg;
        let a = ok("alloc", dev.alloc(len as u64, 0))?;
        let p = pattern(len, 7);
        ok("copy_in", dev.copy_in(a.handle, 0, &p))?;
        let fd = ok("export", dev.export(a.handle))?;
        let mut m = ok("mmap", map_fd(fd.as_raw_fd(), 0, len))?;
        expect_eq("mapped bytes", m.as_slice() == &p[..], true)?;
        m.as_mut_slice()[..pg].fill(0xA5);
        let out = read_buf(&dev, a.handle, len)?;
        expect_eq(
            "write through the mapping",
            out[..pg].iter().all(|b| *b == 0xA5),
            true,
        )?;
        // A mapping at a page offset sees the bytes from there.
        let m2 = ok("mmap at page 1", map_fd(fd.as_raw_fd(), pg as u64, pg))?;
        expect_eq("offset mapping", m2.as_slice() == &p[pg..2 * pg], true)?;
        expect_err(
            "past the end",
            map_fd(fd.as_raw_fd(), 0, len + pg).map(drop),
            libc::EINVAL,
        )?;
        drop((m, m2));
        ok("free", dev.free(a.handle))
    });

    t.run(
        "DMA_BUF_IOCTL_SYNC waits for the device's pending writes",
        || -> R {
            let a = ok("alloc", dev.alloc(job_len as u64, 0))?;
            let b = ok("alloc", dev.alloc(job_len as u64, 0))?;
            let p = pattern(job_len, 3);
            ok("copy_in", dev.copy_in(a.handle, 0, &p))?;
            let fd = ok("export", dev.export(b.handle))?;
            let m = ok("mmap", map_fd(fd.as_raw_fd(), 0, job_len))?;
            let id = ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, job_len as u64)]),
            )?;
            ok("SYNC_START read", sync(fd.as_raw_fd(), SYNC_READ))?;
            let info = ok("buf_info", dev.buf_info(b.handle))?;
            expect_eq("pending writes after SYNC_START", info.pending_writes, 0)?;
            expect_eq("bytes after SYNC_START", m.as_slice() == &p[..], true)?;
            ok("SYNC_END", sync(fd.as_raw_fd(), SYNC_READ | SYNC_END))?;
            // A write sync waits for pending reads too.
            let id2 = ok(
                "submit",
                dev.submit(&[desc(b.handle, 0, a.handle, 0, job_len as u64)]),
            )?;
            ok(
                "SYNC_START write",
                sync(fd.as_raw_fd(), SYNC_READ | SYNC_WRITE),
            )?;
            let info = ok("buf_info", dev.buf_info(b.handle))?;
            expect_eq("pending reads after SYNC_START", info.pending_reads, 0)?;
            ok(
                "SYNC_END",
                sync(fd.as_raw_fd(), SYNC_READ | SYNC_WRITE | SYNC_END),
            )?;
            expect_err("bad sync flags", sync(fd.as_raw_fd(), 0x100), libc::EINVAL)?;
            ok("job_wait", dev.job_wait(id, -1))?;
            ok("job_wait", dev.job_wait(id2, -1))?;
            drop(m);
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    t.run(
        "import into a second file: same memory, fence and completion count",
        || -> R {
            let dev2 = ok("open", Dev::open(&node))?;
            let len = job_len;
            let a = ok(
                "alloc",
                dev.alloc(len as u64, 1.min(version.num_channels - 1)),
            )?;
            let fd = ok("export", dev.export(a.handle))?;
            let i = ok("import", dev2.import(fd.as_raw_fd(), 0))?;
            expect_eq("size", i.size, len as u64)?;
            expect_eq("channel", i.channel, a.channel)?;
            let p = pattern(len, 11);
            ok("copy_in", dev.copy_in(a.handle, 0, &p))?;
            expect_eq("seen by file 2", read_buf(&dev2, i.handle, len)? == p, true)?;
            // A job of file 2 writing the import counts on file 1's handle.
            let src = ok("alloc", dev2.alloc(len as u64, a.channel))?;
            let q = pattern(len, 12);
            ok("copy_in", dev2.copy_in(src.handle, 0, &q))?;
            let before = ok("buf_info", dev.buf_info(a.handle))?.completion_count;
            run_job(&dev2, src.handle, i.handle, len as u64)?;
            let after = ok("buf_info", dev.buf_info(a.handle))?.completion_count;
            expect_eq("completions seen by file 1", after, before + 1)?;
            expect_eq(
                "bytes seen by file 1",
                read_buf(&dev, a.handle, len)? == q,
                true,
            )?;
            // The import survives FREE of the exporter's handle and the fd.
            ok("free", dev.free(a.handle))?;
            drop(fd);
            ok("copy_in", dev2.copy_in(i.handle, 0, &p))?;
            expect_eq("after FREE", read_buf(&dev2, i.handle, len)? == p, true)?;
            // The same fd imported twice in one file is one buffer.
            let fd2 = ok("export again", dev2.export(i.handle))?;
            let j = ok("import", dev2.import(fd2.as_raw_fd(), 0))?;
            ok("memset", dev2.memset(j.handle, 0, 1, 0x5A))?;
            expect_eq("aliases", read_buf(&dev2, i.handle, 1)?, vec![0x5A])
        },
    );

    t.run(
        "export to a second process (SCM_RIGHTS, else pidfd_getfd): writes both ways",
        || -> R {
            let len = 2 * pg;
            let a = ok("alloc", dev.alloc(len as u64, 0))?;
            ok("copy_in", dev.copy_in(a.handle, 0, &pattern(len, 21)))?;
            let link = FdLink::new()?;
            t_note(&format!("fds travel by {}", link.method()));
            // SAFETY: getpid has no preconditions.
            let parent = unsafe { libc::getpid() };
            let node2 = node.clone();
            // Forked before the export: the child can only get it from us.
            let pid = in_child(|| {
                let fd = link.recv(parent)?;
                let d = ok("open", Dev::open(&node2))?;
                let i = ok("import", d.import(fd.as_raw_fd(), 0))?;
                expect_eq(
                    "parent's bytes",
                    read_buf(&d, i.handle, len)? == pattern(len, 21),
                    true,
                )?;
                ok("copy_in", d.copy_in(i.handle, 0, &pattern(len, 22)))?;
                // The dma-buf's own mapping works in this process too.
                let mut m = ok("mmap", map_fd(fd.as_raw_fd(), 0, len))?;
                m.as_mut_slice()[len - 1] = 0xEE;
                Ok(())
            })?;
            let fd = ok("export", dev.export(a.handle))?;
            link.send(fd.as_raw_fd())?;
            child_ok(pid)?;
            let mut want = pattern(len, 22);
            want[len - 1] = 0xEE;
            expect_eq(
                "child's bytes",
                read_buf(&dev, a.handle, len)? == want,
                true,
            )?;
            ok("free", dev.free(a.handle))
        },
    );

    t.run(
        "an export outlives the exporter's FREE, close and exit",
        || -> R {
            let len = 2 * pg;
            let link = FdLink::new()?;
            let node2 = node.clone();
            let pid = in_child(|| {
                let d = ok("open", Dev::open(&node2))?;
                let a = ok("alloc", d.alloc(len as u64, 0))?;
                ok("copy_in", d.copy_in(a.handle, 0, &pattern(len, 31)))?;
                let fd = ok("export", d.export(a.handle))?;
                ok("free", d.free(a.handle))?;
                drop(d);
                link.send(fd.as_raw_fd())
            })?;
            let fd = link.recv(pid)?;
            child_ok(pid)?;
            let m = ok("mmap", map_fd(fd.as_raw_fd(), 0, len))?;
            expect_eq("mapped bytes", m.as_slice() == &pattern(len, 31)[..], true)?;
            let i = ok("import", dev.import(fd.as_raw_fd(), 0))?;
            drop(fd);
            expect_eq(
                "imported bytes",
                read_buf(&dev, i.handle, len)? == pattern(len, 31),
                true,
            )?;
            drop(m);
            ok("free", dev.free(i.handle))
        },
    );

    // Foreign dma-bufs from the system heap.
    let heap_tests: [(&str, HeapTest); 2] = [
        (
            "import from the system dma-heap: CPU access, BUF_INFO and mmap",
            heap_cpu,
        ),
        ("jobs read and write an imported dma-heap buffer", heap_jobs),
    ];
    for (name, f) in heap_tests {
        match heap_alloc(job_len) {
            Ok(Some(fd)) => t.run(name, || f(&dev, fd, job_len)),
            Ok(None) => t.skip(name, "no /dev/dma_heap/system"),
            Err(e) => t.check(name, Err::<(), String>(e)),
        }
    }

    let name = "a file holds at most file_max_imports foreign imports (ENOSPC); other files are unaffected";
    match heap_alloc(pg) {
        Ok(Some(fd)) => t.run(name, || import_limit(&node, fd)),
        Ok(None) => t.skip(name, "no /dev/dma_heap/system"),
        Err(e) => t.check(name, Err::<(), String>(e)),
    }

    let other_node = fs::read_dir("/dev").ok().and_then(|d| {
        d.filter_map(|e| e.ok())
            .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
            .filter(|p| p.starts_with("/dev/tdrv") && *p != node)
            .find(|p| Dev::open(p).and_then(|d| d.version()).is_ok())
    });
    let name = "a tdrv export of another device imports as a new buffer (host memory) or EOPNOTSUPP (device memory)";
    match &other_node {
        None => t.skip(name, "one tdrv device"),
        Some(other) => t.run(name, || -> R {
            let d = ok("open other", Dev::open(other))?;
            let on_device = ok("version", d.version())?.device_kind == TDRV_DEVICE_SIM;
            let a = ok("alloc", d.alloc(4096, 0))?;
            let fd = ok("export", d.export(a.handle))?;
            let got = dev.import(fd.as_raw_fd(), 0);
            if on_device {
                expect_err("import", got.map(drop), libc::EOPNOTSUPP)
            } else {
                let i = ok("import", got)?;
                expect_eq("size", i.size, 4096)?;
                ok("free", dev.free(i.handle))
            }
        }),
    }

    // Foreign imports need a foreign exporter: the system dma-heap. A
    // kernel without one skips them; a heap that is there and fails to
    // allocate fails them (heap_fd below reports why).
    let no_heap = match heap_alloc(pg) {
        Ok(None) => Some("no /dev/dma_heap/system: no foreign dma-buf to import".to_string()),
        Ok(Some(_)) | Err(_) => None,
    };
    let heap_fd = || -> Result<OwnedFd, String> {
        heap_alloc(pg)?.ok_or_else(|| "/dev/dma_heap/system went away".to_string())
    };
    let name = "a foreign import needs a valid channel";
    match &no_heap {
        Some(why) => t.skip(name, why),
        None => t.run(name, || -> R {
            let fd = heap_fd()?;
            expect_err(
                "channel",
                dev.import(fd.as_raw_fd(), version.num_channels),
                libc::EINVAL,
            )
        }),
    }

    let name = "a foreign import outlives the dma-buf fd and is released on FREE";
    match &no_heap {
        Some(why) => t.skip(name, why),
        None => t.run(name, || -> R {
            let fd = heap_fd()?;
            let i = ok("import", dev.import(fd.as_raw_fd(), 0))?;
            drop(fd);
            ok("memset", dev.memset(i.handle, 0, pg as u64, 0x33))?;
            expect_eq(
                "bytes",
                read_buf(&dev, i.handle, pg)?.iter().all(|b| *b == 0x33),
                true,
            )?;
            ok("free", dev.free(i.handle))?;
            expect_err("freed", dev.buf_info(i.handle).map(drop), libc::ENOENT)
        }),
    }

    t.run(
        "userlib: Tensor::export_dmabuf and Tensor::from_dmabuf share one buffer",
        || -> R {
            let d1 = tdrv::Device::open(&node).map_err(|e| e.to_string())?;
            let d2 = tdrv::Device::open(&node).map_err(|e| e.to_string())?;
            let t1 = tdrv::Tensor::allocate_on(&d1, 0, 3 * pg, Some("exported"))
                .map_err(|e| e.to_string())?;
            t1.write(0, &pattern(3 * pg, 61))
                .map_err(|e| e.to_string())?;
            let slice = t1.slice(pg, pg, None).map_err(|e| e.to_string())?;
            let fd = slice.export_dmabuf().map_err(|e| e.to_string())?;
            let t2 = tdrv::Tensor::from_dmabuf(&d2, &fd).map_err(|e| e.to_string())?;
            drop(fd);
            expect_eq("size (whole storage)", t2.size(), 3 * pg)?;
            let mut got = vec![0u8; 3 * pg];
            t2.read(0, &mut got).map_err(|e| e.to_string())?;
            expect_eq("bytes", got == pattern(3 * pg, 61), true)?;
            t2.write(pg, &[0xC3; 8]).map_err(|e| e.to_string())?;
            let mut back = [0u8; 8];
            slice.read(0, &mut back).map_err(|e| e.to_string())?;
            expect_eq("written through the import", back, [0xC3; 8])?;
            if let Some(heap) = heap_alloc(pg)? {
                let h = tdrv::Tensor::from_dmabuf_on(&d1, 0, &heap, Some("heap"))
                    .map_err(|e| e.to_string())?;
                h.write(0, b"heap").map_err(|e| e.to_string())?;
                let m = ok("heap mmap", map_fd(heap.as_raw_fd(), 0, pg))?;
                expect_eq("heap bytes", &m.as_slice()[..4], b"heap")?;
            }
            let host = tdrv::Tensor::allocate_host(16, None).map_err(|e| e.to_string())?;
            match host.export_dmabuf() {
                Err(tdrv::Error::Unsupported { .. }) => Ok(()),
                other => Err(format!("export of host memory: {other:?}")),
            }
        },
    );

    // The module pin: no tdrv file may be open for this one.
    drop(dev);
    t.run(
        "an exported fd keeps the module loaded: rmmod fails while it lives",
        || -> R {
            let d = ok("open", Dev::open(&node))?;
            let a = ok("alloc", d.alloc(4096, 0))?;
            let fd = ok("export", d.export(a.handle))?;
            drop(d);
            let pinned = module_refcnt()?;
            drop(fd);
            // The dma-buf's release (and module_put) may trail the close:
            // wait for it.
            let mut free = pinned;
            until("the export's module reference dropped", || {
                free = module_refcnt()?;
                Ok(free < pinned)
            })?;
            expect_eq("refcnt taken by the export", pinned, free + 1)?;
            // Only now that the pin is known to exist is unloading tried.
            let d = ok("open", Dev::open(&node))?;
            let a = ok("alloc", d.alloc(4096, 0))?;
            let fd = ok("export", d.export(a.handle))?;
            drop(d);
            // SAFETY: a NUL-terminated name and flags; no memory is passed back.
            let r = unsafe {
                libc::syscall(libc::SYS_delete_module, c"tdrv".as_ptr(), libc::O_NONBLOCK)
            };
            let e = errno();
            if r == 0 {
                return Err("rmmod succeeded with an export alive".into());
            }
            if e != libc::EWOULDBLOCK && e != libc::EBUSY {
                return Err(format!("rmmod: errno {e}, want EWOULDBLOCK or EBUSY"));
            }
            // The export still works.
            let m = ok("mmap", map_fd(fd.as_raw_fd(), 0, 4096))?;
            expect_eq("zeroed", m.as_slice().iter().all(|b| *b == 0), true)
        },
    );

    t.run("the export's buffer is freed with its last fd", || -> R {
        // Channel 0's usage goes back once every export above is closed.
        let d = ok("open", Dev::open(&node))?;
        let base = ok("channel_info", d.channel_info(0))?;
        let a = ok("alloc", d.alloc(1 << 20, 0))?;
        let fd = ok("export", d.export(a.handle))?;
        ok("free", d.free(a.handle))?;
        let held = ok("channel_info", d.channel_info(0))?;
        expect_eq(
            "held by the export",
            held.used_bytes,
            base.used_bytes + (1 << 20),
        )?;
        drop(fd);
        let after = ok("channel_info", d.channel_info(0))?;
        expect_eq("released", after.used_bytes, base.used_bytes)
    });

    let name = "ALLOC, EXPORT, FREE in a loop stays charged to the file: ENOSPC at its byte limit, not the channel's";
    if version.num_channels < 2 {
        t.skip(
            name,
            "needs two channels (one to fill the file's limit, one for the loop)",
        );
    } else {
        t.run(name, || charge_outlives_free(&node));
    }

    t.finish();
}

/// The bytes this file is charged on `channel`, from its fdinfo.
fn charged(d: &Dev, channel: u32) -> Result<u64, String> {
    let info = fs::read_to_string(format!("/proc/self/fdinfo/{}", d.fd()))
        .map_err(|e| format!("fdinfo: {e}"))?;
    let key = format!("drm-total-hbm{channel}:");
    info.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("no {key} in fdinfo"))
}

/// A file at its byte limit (file_max_mib) through imports of one export
/// (which cost no channel bytes), less one 16 MiB import: ALLOC, EXPORT,
/// FREE of 1 MiB buffers on channel 1, keeping the dma-buf fds, must stop
/// with ENOSPC once that room is used, while channel 1 still has room;
/// closing the fds gives the charge back.
fn charge_outlives_free(node: &str) -> R {
    const MIB: u64 = 1 << 20;
    let d = ok("open", Dev::open(node))?;
    let big = ok("alloc", d.alloc(16 * MIB, 0))?;
    let shared = ok("export", d.export(big.handle))?;
    let mut imports = Vec::new();
    let err = loop {
        match d.import(shared.as_raw_fd(), 0) {
            Ok(i) => imports.push(i.handle),
            Err(e) => break e,
        }
        if imports.len() > 1 << 16 {
            return Err("65536 imports of 16 MiB and no ENOSPC".into());
        }
    };
    expect_eq("import past the file's byte limit", err, libc::ENOSPC)?;
    ok("free", d.free(imports.pop().unwrap()))?;
    let room = ok("channel_info", d.channel_info(1))?;
    let mut fds = Vec::new();
    let err = loop {
        let a = match d.alloc(MIB, 1) {
            Ok(a) => a,
            Err(e) => break e,
        };
        fds.push(ok("export", d.export(a.handle))?);
        ok("free", d.free(a.handle))?;
        expect_eq(
            "charge on channel 1",
            charged(&d, 1)?,
            fds.len() as u64 * MIB,
        )?;
        if fds.len() > 4096 {
            return Err("4096 loops and no ENOSPC".into());
        }
    };
    expect_eq("ALLOC once the file's room is used", err, libc::ENOSPC)?;
    // The room: the freed 16 MiB import, plus what was left under the
    // limit (less than one more import).
    if fds.len() < 16 || fds.len() >= 32 {
        return Err(format!(
            "{} loops of 1 MiB in a room of 16 to 32 MiB",
            fds.len()
        ));
    }
    // The channel did not refuse: it has room, and another file gets it.
    let c = ok("channel_info", d.channel_info(1))?;
    expect_eq(
        "channel 1 used",
        c.used_bytes,
        room.used_bytes + fds.len() as u64 * MIB,
    )?;
    if c.used_bytes + MIB > c.limit_bytes {
        return Err(format!(
            "channel 1 full ({} of {})",
            c.used_bytes, c.limit_bytes
        ));
    }
    let other = ok("open", Dev::open(node))?;
    let o = ok("alloc in another file", other.alloc(MIB, 1))?;
    ok("free", other.free(o.handle))?;
    // Closing the dma-bufs frees their memory and gives the charge back.
    fds.clear();
    expect_eq("charge on channel 1 after close", charged(&d, 1)?, 0)?;
    let a = ok("alloc after the exports closed", d.alloc(MIB, 1))?;
    ok("free", d.free(a.handle))?;
    for h in imports {
        ok("free", d.free(h))?;
    }
    ok("free", d.free(big.handle))
}

/// CPU access to an imported heap buffer: through tdrv (COPY_IN/OUT,
/// MEMSET), the heap's own mapping, and tdrv's mmap of the handle.
fn heap_cpu(dev: &Dev, fd: OwnedFd, len: usize) -> R {
    let mut hm = ok("heap mmap", map_fd(fd.as_raw_fd(), 0, len))?;
    let p = pattern(len, 41);
    hm.as_mut_slice().copy_from_slice(&p);
    let i = ok("import", dev.import(fd.as_raw_fd(), 0))?;
    expect_eq("size", i.size, len as u64)?;
    expect_eq("channel", i.channel, 0)?;
    expect_eq(
        "heap bytes via COPY_OUT",
        read_buf(dev, i.handle, len)? == p,
        true,
    )?;
    ok("memset", dev.memset(i.handle, 0, 16, 0x77))?;
    ok("SYNC_START", sync(fd.as_raw_fd(), SYNC_READ))?;
    expect_eq(
        "MEMSET seen by the heap mapping",
        hm.as_slice()[..16].iter().all(|b| *b == 0x77),
        true,
    )?;
    ok("SYNC_END", sync(fd.as_raw_fd(), SYNC_READ | SYNC_END))?;
    let info = ok("buf_info", dev.buf_info(i.handle))?;
    expect_eq("buf_info size", info.size, len as u64)?;
    let mut tm = ok("tdrv mmap of the import", dev.map_len(i.mmap_offset, len))?;
    expect_eq("tdrv mapping", tm.as_slice()[16..] == p[16..], true)?;
    tm.as_mut_slice()[len - 1] = 0x99;
    expect_eq("seen by the heap mapping", hm.as_slice()[len - 1], 0x99)?;
    drop(tm);
    ok("free", dev.free(i.handle))
}

/// Jobs with an imported heap buffer as source and as destination.
fn heap_jobs(dev: &Dev, fd: OwnedFd, len: usize) -> R {
    let mut hm = ok("heap mmap", map_fd(fd.as_raw_fd(), 0, len))?;
    let p = pattern(len, 51);
    hm.as_mut_slice().copy_from_slice(&p);
    let i = ok("import", dev.import(fd.as_raw_fd(), 0))?;
    let a = ok("alloc", dev.alloc(len as u64, 0))?;
    run_job(dev, i.handle, a.handle, len as u64)?;
    expect_eq(
        "job read the heap buffer",
        read_buf(dev, a.handle, len)? == p,
        true,
    )?;
    let q = pattern(len, 52);
    ok("copy_in", dev.copy_in(a.handle, 0, &q))?;
    run_job(dev, a.handle, i.handle, len as u64)?;
    ok("SYNC_START", sync(fd.as_raw_fd(), SYNC_READ))?;
    let seen = hm.as_slice() == &q[..];
    ok("SYNC_END", sync(fd.as_raw_fd(), SYNC_READ | SYNC_END))?;
    expect_eq("job wrote the heap buffer", seen, true)?;
    let info = ok("buf_info", dev.buf_info(i.handle))?;
    expect_eq("completion count", info.completion_count, 1)?;
    ok("free", dev.free(a.handle))?;
    ok("free", dev.free(i.handle))
}

/// The default of the module parameter `file_max_imports` (uapi/tdrv.h).
const FILE_MAX_IMPORTS: usize = 4096;

/// A fresh one-page dma-buf from the system heap.
fn heap_page() -> Result<OwnedFd, String> {
    heap_alloc(page_size())?.ok_or_else(|| "no /dev/dma_heap/system".to_string())
}

/// Every IMPORT of a foreign dma-buf makes a buffer the channel does not
/// pay for: a file gets `FILE_MAX_IMPORTS` handles of them, then ENOSPC,
/// while its own buffers and other files' imports still work. Each import
/// is of its own dma-buf (one page each): a device that maps them for DMA
/// maps every page once.
fn import_limit(node: &str, fd: OwnedFd) -> R {
    let full = ok("open", Dev::open(node))?;
    let mut handles = Vec::with_capacity(FILE_MAX_IMPORTS);
    handles.push(ok("import", full.import(fd.as_raw_fd(), 0))?.handle);
    for i in 1..FILE_MAX_IMPORTS {
        let page = heap_page()?;
        let h = full
            .import(page.as_raw_fd(), 0)
            .map_err(|e| format!("import {i}: errno {e}"))?;
        handles.push(h.handle);
    }
    let extra = heap_page()?;
    expect_err(
        "one import past file_max_imports",
        full.import(extra.as_raw_fd(), 0),
        libc::ENOSPC,
    )?;
    // Not an import: the file's buffer limit is elsewhere.
    let own = ok("alloc in the full file", full.alloc(4096, 0))?;
    ok("free", full.free(own.handle))?;
    let other = ok("open", Dev::open(node))?;
    let i = ok("import in another file", other.import(extra.as_raw_fd(), 0))?;
    ok("free", other.free(i.handle))?;
    // A freed import makes room for one more.
    ok("free", full.free(handles[0]))?;
    ok("import after a free", full.import(extra.as_raw_fd(), 0))?;
    let again = heap_page()?;
    expect_err(
        "and then the limit again",
        full.import(again.as_raw_fd(), 0),
        libc::ENOSPC,
    )
}
