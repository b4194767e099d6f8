//! The edu PCI backend: interrupt accounting, spurious interrupts, and
//! unbind/rebind while files are open and jobs are in flight.
//!
//! usage: edu /dev/tdrvN   (an edu device; other kinds are skipped)
//!
//! Run it last: it unbinds and rebinds the device.

use std::{fs, thread, time::Duration};

use tdrv_guest_tests::{
    expect_eq, expect_err, ok, open_device_or_skip,
    raw::Dev,
    stat,
    wait::{until, until_asleep_in},
    MappedChild, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

const DRIVER_DIR: &str = "/sys/bus/pci/drivers/tdrv";

fn desc(src: u64, dst: u64, size: u64) -> tdrv_copy_desc {
    tdrv_copy_desc {
        src_handle: src,
        src_offset: 0,
        dst_handle: dst,
        dst_offset: 0,
        size,
    }
}

/// The PCI address of the (single) edu device bound to tdrv.
fn bound_pci_address() -> Result<String, String> {
    tdrv_guest_tests::bound_pci_address(DRIVER_DIR)
}

/// The edu device nodes that exist now.
fn edu_nodes() -> Vec<String> {
    tdrv_guest_tests::device_nodes(TDRV_DEVICE_EDU)
}

/// Makes the device send an interrupt that is not a DMA completion: the
/// driver's fault injection writes `IRQ_RAISE` with a source it never
/// uses. (Writing the BAR through sysfs `resource0` would also do, but
/// stock kernels with IO_STRICT_DEVMEM refuse to map a claimed BAR.)
fn raise_foreign_irq(node: &str) -> R {
    let name = node.trim_start_matches("/dev/");
    fs::write(
        format!("/sys/kernel/debug/tdrv/{name}/inject"),
        "foreign_irq",
    )
    .map_err(|e| format!("inject foreign_irq: {e}"))
}

fn main() {
    let (dev, path, _) = open_device_or_skip("/dev/tdrv1", Some(TDRV_DEVICE_EDU));
    let mut t = Tap::new(10);

    t.run("the interrupt counter grows with jobs", || -> R {
        let before = stat(&path, "irqs")?;
        let a = ok("alloc", dev.alloc(3 * 4096, 0))?;
        let b = ok("alloc", dev.alloc(3 * 4096, 0))?;
        let id = ok("submit", dev.submit(&[desc(a.handle, b.handle, 3 * 4096)]))?;
        expect_eq("job", ok("wait", dev.job_wait(id, -1))?, (TDRV_JOB_DONE, 0))?;
        let after = stat(&path, "irqs")?;
        // 12 KiB move in at least 3 chunks, each going in and out: 6 DMAs.
        if after < before + 6 {
            return Err(format!("irqs went from {before} to {after}"));
        }
        ok("free", dev.free(a.handle))?;
        ok("free", dev.free(b.handle))
    });

    t.run(
        "a foreign interrupt is counted as spurious and ignored",
        || -> R {
            let before = stat(&path, "spurious_irqs")?;
            raise_foreign_irq(&path)?;
            // The interrupt arrives asynchronously: wait for its count.
            until("spurious_irqs counted", || {
                Ok(stat(&path, "spurious_irqs")? > before)
            })?;
            // The engine still works afterwards.
            let a = ok("alloc", dev.alloc(100, 0))?;
            let b = ok("alloc", dev.alloc(100, 0))?;
            ok("copy_in", dev.copy_in(a.handle, 0, &[7; 100]))?;
            let id = ok("submit", dev.submit(&[desc(a.handle, b.handle, 100)]))?;
            expect_eq("job", ok("wait", dev.job_wait(id, -1))?, (TDRV_JOB_DONE, 0))?;
            let mut out = [0u8; 100];
            ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
            expect_eq("data", out, [7; 100])?;
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    // Unbind with a job in flight, waiters asleep and a buffer mapped.
    let pci = bound_pci_address();
    let size = 256u64 << 10;
    let setup = (|| -> Result<_, String> {
        let a = ok("alloc", dev.alloc(size, 0))?;
        let b = ok("alloc", dev.alloc(size, 0))?;
        let mut m = ok("mmap", dev.map(&a))?;
        m.as_mut_slice().fill(0x3C);
        let child = MappedChild::spawn(&dev, &a)?;
        let id = ok("submit", dev.submit(&[desc(a.handle, b.handle, size)]))?;
        Ok((a, b, m, id, child))
    })();
    t.run(
        "unbind fails in-flight jobs and wakes every waiter with ENODEV",
        || -> R {
            let pci = pci.clone()?;
            let (_, b, _, id, _) = setup.as_ref().map_err(|e| e.clone())?;
            let (b, id) = (b.handle, *id);
            let dev = &dev;
            let (job, completion, asleep, unbind) = thread::scope(|s| {
                let (tx, rx) = std::sync::mpsc::channel();
                let tx2 = tx.clone();
                let job = s.spawn(move || {
                    let _ = tx.send(gettid());
                    dev.job_wait(id, -1)
                });
                let completion = s.spawn(move || {
                    let _ = tx2.send(gettid());
                    dev.completion_wait(b, 1, -1).map_err(|(e, _)| e)
                });
                // Both waiters asleep in their ioctls, then pull the device.
                let asleep = (0..2).try_for_each(|_| {
                    let tid = rx.recv().map_err(|_| "a waiter died".to_string())?;
                    until_asleep_in(tid, libc::SYS_ioctl)
                });
                let unbind = fs::write(format!("{DRIVER_DIR}/unbind"), &pci);
                (job.join(), completion.join(), asleep, unbind)
            });
            unbind.map_err(|e| format!("unbind {pci}: {e}"))?;
            asleep?;
            let job = job.map_err(|_| "job waiter panicked".to_string())?;
            expect_eq("job waiter", job, Ok((TDRV_JOB_DONE, -libc::ENODEV)))?;
            let completion = completion.map_err(|_| "completion waiter panicked".to_string())?;
            expect_eq("completion waiter", completion, Err(libc::ENODEV))
        },
    );

    t.run(
        "after unbind: ioctls fail with ENODEV, VERSION still answers",
        || -> R {
            let (a, _, _, _, _) = setup.as_ref().map_err(|e| e.clone())?;
            let r = dev.buf_info(a.handle).map(drop);
            expect_eq("buf_info", r, Err(libc::ENODEV))?;
            expect_eq("alloc", dev.alloc(4096, 0).map(drop), Err(libc::ENODEV))?;
            expect_eq(
                "submit",
                dev.submit(&[desc(a.handle, a.handle, 1)]).map(drop),
                Err(libc::ENODEV),
            )?;
            expect_eq("mmap", dev.map(a).map(drop), Err(libc::ENODEV))?;
            ok("version", dev.version()).map(drop)
        },
    );

    t.run(
        "after unbind: mappings lose their pages (SIGBUS), munmap works",
        || -> R {
            let (_, _, _, _, child) = setup.as_ref().map_err(|e| e.clone())?;
            let status = child.touch_and_wait()?;
            if !(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS) {
                return Err(format!(
                    "child touching its mapping ended with status {status:#x}, want SIGBUS"
                ));
            }
            Ok(())
        },
    );
    // Unmaps the parent's mapping of the revoked buffer.
    drop(setup);
    drop(dev);

    t.run("rebind creates a working device again", || -> R {
        let pci = pci.clone()?;
        fs::write(format!("{DRIVER_DIR}/bind"), &pci).map_err(|e| format!("bind: {e}"))?;
        // The bind probes synchronously, and devtmpfs creates the node
        // before the probe returns: no wait is needed.
        let nodes = edu_nodes();
        let node = nodes.first().ok_or("no edu device node after rebind")?;
        let dev = ok("open", Dev::open(node))?;
        let a = ok("alloc", dev.alloc(5000, 0))?;
        let b = ok("alloc", dev.alloc(5000, 0))?;
        ok("copy_in", dev.copy_in(a.handle, 0, &[9; 5000]))?;
        let id = ok("submit", dev.submit(&[desc(a.handle, b.handle, 5000)]))?;
        expect_eq("job", ok("wait", dev.job_wait(id, -1))?, (TDRV_JOB_DONE, 0))?;
        let mut out = vec![0u8; 5000];
        ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
        expect_eq("data", out.iter().all(|b| *b == 9), true)?;
        if stat(node, "irqs")? < 4 {
            return Err("no interrupts counted on the rebound device".into());
        }
        Ok(())
    });

    t.run(
        "unbind is not held up by a COPY_IN stalled on a user page fault",
        unbind_during_stalled_copy,
    );

    t.run(
        "unbind ends a held job (hold_job) and the one behind it with ENODEV",
        unbind_while_held,
    );

    tdrv_guest_tests::unbind::checks(&mut t, TDRV_DEVICE_EDU, DRIVER_DIR);

    t.finish();
}

/// Unbind while the engine holds a job (debugfs `hold_job`, never
/// released) with another queued behind it: both end with ENODEV, a
/// waiter wakes, and the rebound device runs jobs.
fn unbind_while_held() -> R {
    let pci = bound_pci_address()?;
    let node = edu_nodes().first().cloned().ok_or("no edu device")?;
    let dev = std::sync::Arc::new(ok("open", Dev::open(&node))?);
    let a = ok("alloc", dev.alloc(4096, 0))?;
    let b = ok("alloc", dev.alloc(4096, 0))?;
    let inject = format!(
        "/sys/kernel/debug/tdrv/{}/inject",
        node.trim_start_matches("/dev/")
    );
    fs::write(&inject, "hold_job").map_err(|e| format!("inject hold_job: {e}"))?;
    let held = ok("submit", dev.submit(&[desc(a.handle, b.handle, 4096)]))?;
    let behind = ok("submit", dev.submit(&[desc(b.handle, a.handle, 4096)]))?;
    thread::sleep(Duration::from_millis(100));
    expect_eq(
        "held job",
        ok("poll", dev.job_wait(held, 0))?,
        (TDRV_JOB_PENDING, 0),
    )?;
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let waiter = {
        let dev = dev.clone();
        thread::spawn(move || {
            let _ = tid_tx.send(gettid());
            dev.job_wait(behind, -1)
        })
    };
    // The unbind must find the waiter asleep in JOB_WAIT.
    let tid = tid_rx.recv().map_err(|_| "waiter died")?;
    until_asleep_in(tid, libc::SYS_ioctl)?;
    let unbound =
        fs::write(format!("{DRIVER_DIR}/unbind"), &pci).map_err(|e| format!("unbind: {e}"));
    let waited = waiter.join().map_err(|_| "waiter panicked".to_string());
    let rebind = fs::write(format!("{DRIVER_DIR}/bind"), &pci).map_err(|e| format!("bind: {e}"));
    unbound?;
    let waited = waited?;
    if !matches!(waited, Ok((TDRV_JOB_DONE, st)) if st == -libc::ENODEV)
        && waited != Err(libc::ENODEV)
    {
        return Err(format!(
            "the job behind the held one: {waited:?}, want ENODEV"
        ));
    }
    drop(dev);
    rebind?;
    let node = edu_nodes()
        .first()
        .cloned()
        .ok_or("no edu device after rebind")?;
    let dev = ok("open", Dev::open(&node))?;
    let a = ok("alloc", dev.alloc(4096, 0))?;
    let b = ok("alloc", dev.alloc(4096, 0))?;
    let id = ok("submit", dev.submit(&[desc(a.handle, b.handle, 4096)]))?;
    expect_eq(
        "a job on the rebound device",
        ok("wait", dev.job_wait(id, -1))?,
        (TDRV_JOB_DONE, 0),
    )
}

/// The calling thread's id.
fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

/// A COPY_IN whose source is a userfaultfd-registered page that nobody
/// serves blocks in the kernel's page fault. Other files must still work,
/// and unbind must complete; once the fault is resolved (the userfaultfd
/// closed) the copy ends with ENODEV.
fn unbind_during_stalled_copy() -> R {
    let pci = bound_pci_address()?;
    let node = edu_nodes().first().cloned().ok_or("no edu device")?;
    let dev = ok("open", Dev::open(&node))?;
    let a = ok("alloc", dev.alloc(8192, 0))?;
    let mut region = tdrv_guest_tests::uffd::Unserved::new(0, 8192)?;
    let user_ptr = region.base() as u64;
    let dev = std::sync::Arc::new(dev);
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let copier = {
        let dev = dev.clone();
        thread::spawn(move || {
            let _ = tid_tx.send(gettid());
            let mut x = tdrv_xfer {
                handle: a.handle,
                offset: 0,
                size: 8192,
                user_ptr,
                ..Default::default()
            };
            dev.ioctl(TDRV_IOC_COPY_IN, &mut x)
        })
    };
    // The copy must be stuck in the page fault (asleep in its ioctl)
    // before the rest runs.
    let tid = tid_rx.recv().map_err(|_| "copier died")?;
    until_asleep_in(tid, libc::SYS_ioctl)?;
    if copier.is_finished() {
        return Err("COPY_IN did not block on the unserved page".into());
    }
    // Bounded waits: a hang here would otherwise hang the whole suite.
    let bounded = |what: &'static str, f: Box<dyn FnOnce() -> R + Send>| -> R {
        let (tx, rx) = std::sync::mpsc::channel();
        thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(30))
            .map_err(|_| format!("{what} blocked behind the stalled copy"))?
    };
    let node2 = node.clone();
    bounded(
        "another file",
        Box::new(move || {
            let other = ok("open", Dev::open(&node2))?;
            let b = ok("alloc", other.alloc(4096, 0))?;
            ok("free", other.free(b.handle))
        }),
    )?;
    let pci2 = pci.clone();
    bounded(
        "unbind",
        Box::new(move || {
            fs::write(format!("{DRIVER_DIR}/unbind"), &pci2).map_err(|e| format!("unbind: {e}"))
        }),
    )?;
    // Resolve the fault: without its userfaultfd the page is an ordinary
    // anonymous page again.
    region.serve();
    let copied = copier.join().map_err(|_| "copier panicked")?;
    let rebind = fs::write(format!("{DRIVER_DIR}/bind"), &pci).map_err(|e| format!("bind: {e}"));
    drop(region);
    expect_err("the stalled COPY_IN", copied, libc::ENODEV)?;
    rebind?;
    if edu_nodes().is_empty() {
        return Err("no edu device after rebind".into());
    }
    Ok(())
}
