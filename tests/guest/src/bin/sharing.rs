//! Buffers shared between devices (issue 33 items 1 and 3): another tdrv
//! device's export imported zero-copy (jobs, COPY_IN/OUT, MEMSET and mmap
//! on the import reach the exporter's memory, both ways; the sim device's
//! memory peer-to-peer into an edu device below the same PCI bridge, and
//! refused with EOPNOTSUPP where there is no such path), and a DRM driver (vgem) attaching to a tdrv
//! export through PRIME.
//!
//! usage: sharing /dev/tdrvN: pairs that device with every other tdrv
//! device of the guest (none: those checks are skipped).

use std::{
    fs,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use tdrv_guest_tests::{
    dmabuf::{pattern, read_buf},
    expect_eq, expect_err, ok, open_device_or_skip,
    raw::{errno, map_fd, page_size, Dev, Errno},
    Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

const BUFINFO: &str = "/sys/kernel/debug/dma_buf/bufinfo";

fn run_job(dev: &Dev, src: u64, dst: u64, size: u64) -> R {
    let d = tdrv_copy_desc {
        src_handle: src,
        src_offset: 0,
        dst_handle: dst,
        dst_offset: 0,
        size,
    };
    let id = ok("submit", dev.submit(&[d]))?;
    expect_eq(
        "job",
        ok("job_wait", dev.job_wait(id, -1))?,
        (TDRV_JOB_DONE, 0),
    )
}

fn kind_name(k: u32) -> &'static str {
    match k {
        TDRV_DEVICE_SOFT => "soft",
        TDRV_DEVICE_EDU => "edu",
        TDRV_DEVICE_SIM => "sim",
        _ => "?",
    }
}

/// A device under test: its node, an open file and its kind.
struct Side {
    node: String,
    dev: Dev,
    kind: u32,
}

impl Side {
    fn open(node: &str) -> Result<Side, Errno> {
        let dev = Dev::open(node)?;
        let kind = dev.version()?.device_kind;
        Ok(Side {
            node: node.into(),
            dev,
            kind,
        })
    }

    fn name(&self) -> String {
        format!("{} ({})", self.node, kind_name(self.kind))
    }
}

/// `a`'s buffer of `len` bytes holding `p`, exported and imported into
/// `b`: (a's handle, the dma-buf, b's import).
fn share(a: &Side, b: &Side, len: usize, p: &[u8]) -> Result<(u64, OwnedFd, tdrv_import), String> {
    let buf = ok("alloc", a.dev.alloc(len as u64, 0))?;
    ok("copy_in", a.dev.copy_in(buf.handle, 0, p))?;
    let fd = ok("export", a.dev.export(buf.handle))?;
    let i = ok("import", b.dev.import(fd.as_raw_fd(), 0))?;
    expect_eq("import size", i.size, len as u64)?;
    Ok((buf.handle, fd, i))
}

/// A job on `b` copies from `a`'s buffer and into it.
fn jobs_across(a: &Side, b: &Side, len: usize) -> R {
    let p = pattern(len, 3);
    let (ah, _fd, i) = share(a, b, len, &p)?;
    let dst = ok("alloc on the importer", b.dev.alloc(len as u64, 0))?;
    run_job(&b.dev, i.handle, dst.handle, len as u64)?;
    expect_eq(
        "bytes the importer's job read",
        read_buf(&b.dev, dst.handle, len)? == p,
        true,
    )?;
    let q = pattern(len, 101);
    ok("copy_in", b.dev.copy_in(dst.handle, 0, &q))?;
    run_job(&b.dev, dst.handle, i.handle, len as u64)?;
    ok("fence_wait", b.dev.fence_wait(i.handle, TDRV_FENCE_ALL, -1))?;
    expect_eq(
        "bytes the exporter sees",
        read_buf(&a.dev, ah, len)? == q,
        true,
    )
}

/// COPY_IN/OUT, MEMSET and mmap on `b`'s import of `a`'s buffer.
fn cpu_across(a: &Side, b: &Side, len: usize) -> R {
    let pg = page_size();
    let p = pattern(len, 7);
    let (ah, _fd, i) = share(a, b, len, &p)?;
    expect_eq(
        "COPY_OUT of the import",
        read_buf(&b.dev, i.handle, len)? == p,
        true,
    )?;
    ok("memset", b.dev.memset(i.handle, 0, pg as u64, 0x5a))?;
    let q = pattern(pg, 77);
    ok("copy_in", b.dev.copy_in(i.handle, pg as u64, &q))?;
    let seen = read_buf(&a.dev, ah, len)?;
    expect_eq(
        "MEMSET reached the exporter",
        seen[..pg].iter().all(|&x| x == 0x5a),
        true,
    )?;
    expect_eq(
        "COPY_IN reached the exporter",
        seen[pg..2 * pg] == q[..],
        true,
    )?;
    let s = pattern(len, 201);
    ok("exporter copy_in", a.dev.copy_in(ah, 0, &s))?;
    let m = ok("mmap of the import", b.dev.map_len(i.mmap_offset, len))?;
    expect_eq(
        "mmap shows the exporter's bytes",
        m.as_slice() == &s[..],
        true,
    )
}

/// How a pair (exporter `a`, importer `b`) shares memory.
enum Pair {
    /// Zero-copy: host memory, or sim device memory peer-to-peer.
    Shared,
    /// Sim device memory with no peer-to-peer path: EOPNOTSUPP.
    NoPath,
    /// Host memory into the sim device: not part of this program.
    HostIntoSim,
}

fn sim_pair(a: &Side, b: &Side) -> Pair {
    if a.kind == TDRV_DEVICE_SIM {
        if !below_one_bridge(b) {
            return Pair::NoPath;
        }
        return Pair::Shared;
    }
    if b.kind == TDRV_DEVICE_SIM {
        return Pair::HostIntoSim;
    }
    Pair::Shared
}

/// True if the sim device and the edu device (`b`'s kind; a software
/// device is no PCI device) sit below one PCI-PCI bridge: the kernel's
/// peer-to-peer DMA routes between them (scripts/guest places them so).
/// Found through the devices bound to each driver (one of each here).
fn below_one_bridge(b: &Side) -> bool {
    if b.kind != TDRV_DEVICE_EDU {
        return false;
    }
    let bridge = |driver: &str| -> Option<std::path::PathBuf> {
        let dir = format!("/sys/bus/pci/drivers/{driver}");
        let addr = tdrv_guest_tests::bound_pci_address(&dir).ok()?;
        let dev = fs::canonicalize(format!("{dir}/{addr}")).ok()?;
        let parent = dev.parent()?.to_path_buf();
        // The root bus's directory is "pci0000:00"; a bridge's is a PCI
        // function (dddd:bb:dd.f).
        let name = parent.file_name()?.to_string_lossy().into_owned();
        (!name.starts_with("pci")).then_some(parent)
    };
    matches!((bridge("tdrv-sim"), bridge("tdrv")), (Some(x), Some(y)) if x == y)
}

/// `side`'s channel 0: (bytes used, buffers).
fn usage(side: &Side) -> Result<(u64, u64), String> {
    let i = ok("CHANNEL_INFO", side.dev.channel_info(0))?;
    Ok((i.used_bytes, i.buffers))
}

/// When `b` lets go of its import of `a`'s buffer, by FREE and by closing
/// the file, `a` has the memory back as the call returns (the exporter's
/// dma-buf was its last holder). The exporter's own handle and fd go
/// first, so that only the import holds the buffer.
fn release_across(a: &Side, b: &Side, len: usize) -> R {
    let before = usage(a)?;
    let imports = tdrv_guest_tests::stat(&b.node, "imports")?;
    let p = pattern(len, 9);
    let (ah, fd, i) = share(a, b, len, &p)?;
    ok("exporter's FREE", a.dev.free(ah))?;
    drop(fd);
    expect_eq(
        "exporter's usage while imported",
        usage(a)?,
        (before.0 + len as u64, before.1 + 1),
    )?;
    expect_eq(
        "importer's count of imports (debugfs) while imported",
        tdrv_guest_tests::stat(&b.node, "imports")?,
        imports + 1,
    )?;
    ok("importer's FREE", b.dev.free(i.handle))?;
    expect_eq(
        "exporter's usage after the importer's FREE",
        usage(a)?,
        before,
    )?;
    expect_eq(
        "importer's count of imports (debugfs) after its FREE",
        tdrv_guest_tests::stat(&b.node, "imports")?,
        imports,
    )?;

    let b2 = ok("second file", Side::open(&b.node))?;
    let (ah, fd, _) = share(a, &b2, len, &p)?;
    ok("exporter's FREE", a.dev.free(ah))?;
    drop(fd);
    drop(b2);
    expect_eq(
        "exporter's usage after the importer's close",
        usage(a)?,
        before,
    )?;
    expect_eq(
        "importer's count of imports (debugfs) after its close",
        tdrv_guest_tests::stat(&b.node, "imports")?,
        imports,
    )
}

/// DRM ioctls for vgem.
const DRM_IOCTL_VERSION: u64 = 0xC040_6400;
const DRM_IOCTL_GEM_CLOSE: u64 = 0x4008_6409;
const DRM_IOCTL_PRIME_HANDLE_TO_FD: u64 = 0xC00C_642D;
const DRM_IOCTL_PRIME_FD_TO_HANDLE: u64 = 0xC00C_642E;

#[repr(C)]
struct DrmVersion {
    major: i32,
    minor: i32,
    patch: i32,
    name_len: usize,
    name: *mut u8,
    date_len: usize,
    date: *mut u8,
    desc_len: usize,
    desc: *mut u8,
}

#[repr(C)]
#[derive(Default)]
struct DrmPrimeHandle {
    handle: u32,
    flags: u32,
    fd: i32,
}

/// An open vgem card, if the kernel has one.
fn open_vgem() -> Option<OwnedFd> {
    let dir = fs::read_dir("/dev/dri").ok()?;
    for e in dir.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("card") {
            continue;
        }
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(e.path())
            .ok()?;
        let mut buf = [0u8; 32];
        let mut v = DrmVersion {
            major: 0,
            minor: 0,
            patch: 0,
            name_len: buf.len(),
            name: buf.as_mut_ptr(),
            date_len: 0,
            date: std::ptr::null_mut(),
            desc_len: 0,
            desc: std::ptr::null_mut(),
        };
        // SAFETY: `v` is the 64-byte argument; `name` has `name_len` bytes.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), DRM_IOCTL_VERSION as _, &mut v) };
        if r == 0 && buf.starts_with(b"vgem") {
            return Some(f.into());
        }
    }
    None
}

fn drm_ioctl<T>(fd: i32, req: u64, arg: &mut T) -> Result<(), Errno> {
    // SAFETY: `arg` is the argument struct `req` encodes.
    if unsafe { libc::ioctl(fd, req as _, arg as *mut T) } < 0 {
        Err(errno())
    } else {
        Ok(())
    }
}

/// Lines of bufinfo naming an attached device `name`.
fn attached(name: &str) -> Result<usize, String> {
    let text = fs::read_to_string(BUFINFO).map_err(|e| format!("{BUFINFO}: {e}"))?;
    Ok(text.lines().filter(|l| l.trim() == name).count())
}

/// vgem imports `side`'s export (attach and map for vgem's device); its
/// PRIME re-export reads the bytes.
fn vgem_import(side: &Side, vgem: &OwnedFd, len: usize) -> R {
    let p = pattern(len, 55);
    let buf = ok("alloc", side.dev.alloc(len as u64, 0))?;
    ok("copy_in", side.dev.copy_in(buf.handle, 0, &p))?;
    let fd = ok("export", side.dev.export(buf.handle))?;
    let before = attached("vgem")?;
    let mut h = DrmPrimeHandle {
        fd: fd.as_raw_fd(),
        ..Default::default()
    };
    let got = drm_ioctl(vgem.as_raw_fd(), DRM_IOCTL_PRIME_FD_TO_HANDLE, &mut h);
    if side.kind == TDRV_DEVICE_SIM {
        return expect_err("PRIME_FD_TO_HANDLE of device memory", got, libc::EOPNOTSUPP);
    }
    ok("PRIME_FD_TO_HANDLE", got)?;
    expect_eq("vgem attachments in bufinfo", attached("vgem")?, before + 1)?;
    let mut back = DrmPrimeHandle {
        handle: h.handle,
        flags: (libc::O_RDWR | libc::O_CLOEXEC) as u32,
        fd: -1,
    };
    ok(
        "PRIME_HANDLE_TO_FD",
        drm_ioctl(vgem.as_raw_fd(), DRM_IOCTL_PRIME_HANDLE_TO_FD, &mut back),
    )?;
    // SAFETY: vgem installed a new fd for us.
    let back_fd = unsafe { OwnedFd::from_raw_fd(back.fd) };
    let m = ok(
        "mmap of vgem's re-export",
        map_fd(back_fd.as_raw_fd(), 0, len),
    )?;
    expect_eq(
        "bytes through vgem's re-export",
        m.as_slice() == &p[..],
        true,
    )?;
    drop(m);
    let mut close = [h.handle, 0u32];
    ok(
        "GEM_CLOSE",
        drm_ioctl(vgem.as_raw_fd(), DRM_IOCTL_GEM_CLOSE, &mut close),
    )?;
    drop(back_fd);
    expect_eq("vgem detached after GEM_CLOSE", attached("vgem")?, before)
}

fn main() {
    let (_, node, _) = open_device_or_skip("/dev/tdrv0", None);
    let me = match Side::open(&node) {
        Ok(s) => s,
        Err(e) => tdrv_guest_tests::skip_all(&format!("{node}: errno {e}")),
    };
    let mut others: Vec<String> = fs::read_dir("/dev")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
                .filter(|p| {
                    p.strip_prefix("/dev/tdrv")
                        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                        && *p != node
                })
                .collect()
        })
        .unwrap_or_default();
    others.sort();
    let pg = page_size();
    // Several pages; the edu engine moves 4 KiB per 100 ms of virtual time.
    let len = 4 * pg;
    let mut t = Tap::new(1 + 5 * others.len().max(1));

    let name = format!(
        "vgem PRIME-imports an export of {} and reads it back",
        me.name()
    );
    match open_vgem() {
        Some(v) => t.run(&name, || vgem_import(&me, &v, len)),
        None => t.skip(&name, "no vgem card (CONFIG_DRM_VGEM off)"),
    }

    if others.is_empty() {
        for what in [
            "a job on another device uses this device's buffer",
            "a job here uses another device's buffer",
            "CPU access to another device's buffer",
            "FREE and close of an import give its exporter the memory back",
            "FREE and close of an import give its exporter the memory back (other way)",
        ] {
            t.skip(what, "only one tdrv device in this guest");
        }
    }
    for o in &others {
        let other = match Side::open(o) {
            Ok(s) => s,
            Err(e) => {
                for _ in 0..5 {
                    t.check(
                        &format!("open {o}"),
                        Err::<(), String>(format!("errno {e}")),
                    );
                }
                continue;
            }
        };
        for (a, b) in [(&me, &other), (&other, &me)] {
            let name = format!(
                "a job on {} copies from and into a buffer of {}",
                b.name(),
                a.name()
            );
            match sim_pair(a, b) {
                Pair::HostIntoSim => {
                    t.skip(&name, "host memory into the sim device: not tested here")
                }
                Pair::NoPath => t.run(
                    &format!(
                        "IMPORT of {}'s device memory into {} is EOPNOTSUPP (no peer-to-peer path)",
                        a.name(),
                        b.name()
                    ),
                    || {
                        let buf = ok("alloc", a.dev.alloc(len as u64, 0))?;
                        let fd = ok("export", a.dev.export(buf.handle))?;
                        expect_err(
                            "import",
                            b.dev.import(fd.as_raw_fd(), 0).map(drop),
                            libc::EOPNOTSUPP,
                        )
                    },
                ),
                Pair::Shared => t.run(&name, || jobs_across(a, b, len)),
            }
        }
        for (a, b) in [(&me, &other), (&other, &me)] {
            let name = format!(
                "FREE and close of {}'s import give {} its memory back at once",
                b.name(),
                a.name()
            );
            match sim_pair(a, b) {
                Pair::Shared => t.run(&name, || release_across(a, b, len)),
                _ => t.skip(
                    &name,
                    "not shared: sim device memory without a peer-to-peer path (EOPNOTSUPP above), or host memory into the sim device",
                ),
            }
        }
        let (a, b) = (&other, &me);
        let name = format!(
            "COPY_IN/OUT, MEMSET and mmap on {}'s import of {}'s buffer reach its memory",
            b.name(),
            a.name()
        );
        match sim_pair(a, b) {
            Pair::Shared => t.run(&name, || cpu_across(a, b, len)),
            _ => t.skip(
                &name,
                "not shared: sim device memory without a peer-to-peer path (EOPNOTSUPP above), or host memory into the sim device",
            ),
        }
    }
    t.finish()
}
