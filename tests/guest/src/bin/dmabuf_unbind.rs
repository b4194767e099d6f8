//! Unbind with live dma-buf exports and imports: an exported fd's mappings
//! fault with SIGBUS, its SYNC and mmap fail with ENODEV, an imported
//! dma-heap buffer is detached from the device (and stays usable by its
//! owner), IMPORT on the unbound file fails with ENODEV, and the device
//! works again after rebind. The guest run's dmesg check covers the rest
//! (no WARN, no leak, no use after free).
//!
//! usage: dmabuf_unbind /dev/tdrvN   (an edu device; other kinds are
//! skipped). Run it last: it unbinds and rebinds the device.

use std::{fs, os::fd::AsRawFd};

use tdrv_guest_tests::{
    bail::require,
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

fn pipe() -> Result<(i32, i32), String> {
    let mut p = [0i32; 2];
    // SAFETY: `p` has room for two fds.
    if unsafe { libc::pipe(p.as_mut_ptr()) } < 0 {
        return Err(format!("pipe: errno {}", errno()));
    }
    Ok((p[0], p[1]))
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
    require(
        "unbind with live exports and imports",
        fs::write(format!("{DRIVER_DIR}/unbind"), &pci),
    );
    let mut t = Tap::new(6);

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

    // Everything goes before the rebind: closing revoked exports and
    // imports must be clean too.
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
