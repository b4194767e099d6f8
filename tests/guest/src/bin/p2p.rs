//! Device memory shared peer-to-peer (issue 33 items 1-3): an edu device
//! below the same PCI bridge as the sim device imports a buffer in the sim
//! device's HBM zero-copy. Its jobs read and write the HBM by DMA through
//! the bridge, COPY_IN/OUT, MEMSET and mmap of the import reach the same
//! bytes, COPY with the import is EOPNOTSUPP, and a software device (no
//! PCI path) gets EOPNOTSUPP. Then the sim device is unbound while an edu
//! job on the import runs: the job ends with ENODEV, the import's calls
//! fail with ENODEV, its mapping faults with SIGBUS, and the kernel
//! reports nothing. The sim device is bound again at the end.
//!
//! usage: p2p /dev/tdrvN (a sim device; other kinds are skipped). Needs an
//! edu device in the guest (scripts/guest puts the two below one bridge).

use std::{
    fs,
    os::fd::{AsRawFd, OwnedFd},
};

use tdrv_guest_tests::{
    bail::require,
    desc, device_nodes,
    dmabuf::{in_child, pattern, read_buf, wait_child},
    expect_eq, expect_err,
    kmsg::{dma_api_errors, kernel_log, new_reports},
    ok, open_device_or_skip,
    raw::{map_fd, page_size, Dev},
    skip_all, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

const SIM_DRIVER: &str = "/sys/bus/pci/drivers/tdrv-sim";

/// A bound that only turns a hang into a failure (µs).
const HANG_US: i64 = 120_000_000;

/// The job running while the sim device is unbound: 64 edu chunks of
/// 4 KiB, each ~200 ms on the host clock, so it is still running when the
/// unbind (issued right after SUBMIT) revokes the import.
const REVOKE_LEN: usize = 256 << 10;

fn job(dev: &Dev, src: u64, dst: u64, len: usize) -> R {
    let id = ok("submit", dev.submit(&[desc(src, 0, dst, 0, len as u64)]))?;
    expect_eq(
        "job",
        ok("job_wait", dev.job_wait(id, HANG_US))?,
        (TDRV_JOB_DONE, 0),
    )
}

/// A sim buffer of `len` bytes holding `p`, exported and imported by
/// `importer`: (sim handle, dma-buf, import).
fn share(sim: &Dev, importer: &Dev, p: &[u8]) -> Result<(u64, OwnedFd, tdrv_import), String> {
    let b = ok("alloc on sim", sim.alloc(p.len() as u64, 0))?;
    ok("copy_in on sim", sim.copy_in(b.handle, 0, p))?;
    let fd = ok("export", sim.export(b.handle))?;
    let i = ok("IMPORT by edu", importer.import(fd.as_raw_fd(), 0))?;
    expect_eq("import size", i.size, p.len() as u64)?;
    Ok((b.handle, fd, i))
}

fn main() {
    let (sim, node, _) = open_device_or_skip("/dev/tdrv0", Some(TDRV_DEVICE_SIM));
    let Some(edu_node) = device_nodes(TDRV_DEVICE_EDU).first().cloned() else {
        skip_all(
            "no edu device in this guest (scripts/guest adds one below the sim device's bridge)",
        )
    };
    let edu = require("opening the edu device", Dev::open(&edu_node));
    let soft = device_nodes(TDRV_DEVICE_SOFT).first().cloned();
    let pg = page_size();
    let len = 4 * pg;
    let mut t = Tap::new(12);

    t.run(
        &format!("{edu_node} (edu) IMPORTs a buffer of {node} (sim, device memory) and COPY_OUT of the import reads its bytes"),
        || -> R {
            let p = pattern(len, 1);
            let (_, _fd, i) = share(&sim, &edu, &p)?;
            expect_eq("bytes", read_buf(&edu, i.handle, len)? == p, true)
        },
    );

    t.run("an edu job reads the sim buffer peer-to-peer", || -> R {
        let p = pattern(len, 2);
        let (_, _fd, i) = share(&sim, &edu, &p)?;
        let dst = ok("alloc on edu", edu.alloc(len as u64, 0))?;
        job(&edu, i.handle, dst.handle, len)?;
        expect_eq(
            "bytes the job read",
            read_buf(&edu, dst.handle, len)? == p,
            true,
        )
    });

    t.run(
        "an edu job writes the sim buffer peer-to-peer and the sim device reads the bytes",
        || -> R {
            let (sh, _fd, i) = share(&sim, &edu, &vec![0u8; len])?;
            let q = pattern(len, 3);
            let src = ok("alloc on edu", edu.alloc(len as u64, 0))?;
            ok("copy_in on edu", edu.copy_in(src.handle, 0, &q))?;
            job(&edu, src.handle, i.handle, len)?;
            expect_eq(
                "bytes on the sim device",
                read_buf(&sim, sh, len)? == q,
                true,
            )
        },
    );

    t.run(
        "COPY_IN and MEMSET on edu's import reach the sim device's memory",
        || -> R {
            let (sh, _fd, i) = share(&sim, &edu, &vec![0u8; len])?;
            ok("memset", edu.memset(i.handle, 0, pg as u64, 0xa5))?;
            let q = pattern(pg, 4);
            ok("copy_in", edu.copy_in(i.handle, pg as u64, &q))?;
            let seen = read_buf(&sim, sh, len)?;
            expect_eq("MEMSET bytes", seen[..pg].iter().all(|&x| x == 0xa5), true)?;
            expect_eq("COPY_IN bytes", seen[pg..2 * pg] == q[..], true)?;
            expect_eq("bytes after", seen[2 * pg..].iter().all(|&x| x == 0), true)
        },
    );

    t.run(
        "mmap of edu's import shows the sim device's bytes",
        || -> R {
            let p = pattern(len, 5);
            let (sh, _fd, i) = share(&sim, &edu, &p)?;
            let m = ok("mmap of the import", edu.map_len(i.mmap_offset, len))?;
            expect_eq("bytes through the mapping", m.as_slice() == &p[..], true)?;
            let q = pattern(len, 6);
            ok("copy_in on sim", sim.copy_in(sh, 0, &q))?;
            expect_eq(
                "the sim device's new bytes through the mapping",
                m.as_slice() == &q[..],
                true,
            )
        },
    );

    t.run(
        "COPY between an edu buffer and the import is EOPNOTSUPP (jobs move peer-to-peer memory)",
        || -> R {
            let (_, _fd, i) = share(&sim, &edu, &pattern(len, 7))?;
            let b = ok("alloc on edu", edu.alloc(len as u64, 0))?;
            expect_err(
                "COPY import -> edu buffer",
                edu.copy(desc(i.handle, 0, b.handle, 0, len as u64)),
                libc::EOPNOTSUPP,
            )?;
            expect_err(
                "COPY edu buffer -> import",
                edu.copy(desc(b.handle, 0, i.handle, 0, len as u64)),
                libc::EOPNOTSUPP,
            )
        },
    );

    let name = "a software device's IMPORT of sim device memory is EOPNOTSUPP (no PCI path)";
    match &soft {
        None => t.skip(name, "no software device in this guest"),
        Some(s) => t.run(name, || -> R {
            let soft = ok("open the software device", Dev::open(s))?;
            let b = ok("alloc on sim", sim.alloc(len as u64, 0))?;
            let fd = ok("export", sim.export(b.handle))?;
            expect_err(
                "import",
                soft.import(fd.as_raw_fd(), 0).map(drop),
                libc::EOPNOTSUPP,
            )
        }),
    }

    // The unbind with an edu job on the import running, and a child
    // process mapping the import (forked before any thread exists).
    let pci = require(
        "finding the bound sim device",
        tdrv_guest_tests::bound_pci_address(SIM_DRIVER),
    );
    let (_sh, _fd, import) = require(
        "sharing the revoked buffer",
        share(&sim, &edu, &pattern(REVOKE_LEN, 8)),
    );
    let dst = require("alloc on edu", edu.alloc(REVOKE_LEN as u64, 0));
    let (edu_fd, mmap_offset) = (edu.fd(), import.mmap_offset);
    let (ready_r, ready_w) = require("pipe", pipe());
    let (go_r, go_w) = require("pipe", pipe());
    let child = require(
        "a child mapping the import",
        in_child(move || {
            // Mapped in the child: tdrv mappings are not inherited
            // (VM_DONTCOPY).
            let mapping = ok("mmap of the import", map_fd(edu_fd, mmap_offset, pg))?;
            expect_eq(
                "bytes through the mapping",
                mapping.as_slice()[0],
                pattern(1, 8)[0],
            )?;
            let mut b = [0u8; 1];
            // SAFETY: our own pipe fds and a 1-byte buffer.
            unsafe {
                libc::write(ready_w, b.as_ptr().cast(), 1);
                libc::read(go_r, b.as_mut_ptr().cast(), 1);
            }
            // SAFETY: reads our own mapping; after the revocation this
            // must fault with SIGBUS.
            let v = unsafe { std::ptr::read_volatile(mapping.as_slice().as_ptr()) };
            Err(format!("read {v:#x} from a revoked import's mapping"))
        }),
    );
    let mut b = [0u8; 1];
    // SAFETY: our own pipe fd and a 1-byte buffer.
    unsafe { libc::read(ready_r, b.as_mut_ptr().cast(), 1) };
    let log_before = require("reading the kernel log", kernel_log());
    let dma_before = dma_api_errors();
    let id = require(
        "submitting the job on the import",
        edu.submit(&[desc(import.handle, 0, dst.handle, 0, REVOKE_LEN as u64)]),
    );
    require(
        "unbinding the sim device",
        fs::write(format!("{SIM_DRIVER}/unbind"), &pci),
    );

    t.run(
        "unbinding the sim device ends edu's running job on the import with ENODEV",
        || -> R {
            expect_eq(
                "job",
                ok("job_wait", edu.job_wait(id, HANG_US))?,
                (TDRV_JOB_DONE, -libc::ENODEV),
            )
        },
    );

    t.run(
        "after the unbind: COPY_OUT, COPY_IN, MEMSET and SUBMIT with the import fail with ENODEV",
        || -> R {
            let mut out = vec![0u8; pg];
            expect_err(
                "copy_out",
                edu.copy_out(import.handle, 0, &mut out),
                libc::ENODEV,
            )?;
            expect_err("copy_in", edu.copy_in(import.handle, 0, &out), libc::ENODEV)?;
            expect_err(
                "memset",
                edu.memset(import.handle, 0, pg as u64, 1),
                libc::ENODEV,
            )?;
            expect_err(
                "submit",
                edu.submit(&[desc(import.handle, 0, dst.handle, 0, pg as u64)])
                    .map(drop),
                libc::ENODEV,
            )
        },
    );

    t.run(
        "after the unbind: a mapping of the import faults with SIGBUS",
        || -> R {
            let b = [1u8; 1];
            // SAFETY: our own pipe fd and a 1-byte buffer.
            unsafe { libc::write(go_w, b.as_ptr().cast(), 1) };
            let status = wait_child(child)?;
            if !(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS) {
                return Err(format!("child ended with status {status:#x}, want SIGBUS"));
            }
            Ok(())
        },
    );

    t.run(
        "the unbind with a live peer-to-peer import left no kernel warning and no DMA-API error",
        || -> R {
            let after = kernel_log()?;
            let reports = new_reports(&log_before, &after);
            if !reports.is_empty() {
                return Err(format!("new kernel reports:\n{}", reports.join("\n")));
            }
            expect_eq("DMA-API error count", dma_api_errors(), dma_before)
        },
    );

    t.run(
        "after rebinding the sim device, edu imports a new buffer of it and a job reads it",
        || -> R {
            fs::write(format!("{SIM_DRIVER}/bind"), &pci)
                .map_err(|e| format!("bind {pci}: {e}"))?;
            // The bind probes synchronously; devtmpfs made the node.
            let n = device_nodes(TDRV_DEVICE_SIM)
                .first()
                .cloned()
                .ok_or("no sim device node after rebind")?;
            let sim = ok("open", Dev::open(&n))?;
            let p = pattern(len, 9);
            let (_, _fd, i) = share(&sim, &edu, &p)?;
            let d = ok("alloc on edu", edu.alloc(len as u64, 0))?;
            job(&edu, i.handle, d.handle, len)?;
            expect_eq("bytes", read_buf(&edu, d.handle, len)? == p, true)
        },
    );
    drop(sim);
    t.finish()
}

fn pipe() -> Result<(i32, i32), String> {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err("pipe failed".into());
    }
    Ok((fds[0], fds[1]))
}
