//! A sim device whose simulator dies under its driver: the host SIGKILLs
//! tdrv-sim while a job is on a queue, a COPY_IN loop runs and waiters
//! sleep (issue 32 item 8), with the product's default watchdog (2 s).
//! The job ends with ETIMEDOUT (tdrv.h: a job the device gave up on), its
//! completion event arrives, every waiter wakes with a documented error,
//! later work fails with EIO once no queue answers, and unbinding the
//! device releases everything with no DMA-API report.
//!
//! usage: simkill /dev/tdrvN   (a sim device; other kinds are skipped)
//!
//! The host kills the simulator when this program prints
//! `tdrv-guest: SIGKILL tdrv-sim now` (scripts/guest, which says so with
//! `tdrv_sim_killable=1` on the kernel command line). Run it last: the sim
//! device is dead afterwards.

use std::{
    fs,
    io::Write,
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use tdrv_guest_tests::{
    desc, expect_eq, inject,
    kmsg::{dma_api_errors, kernel_log, new_reports},
    ok, open_device_or_skip, skip_all,
    wait::HANG,
    SimWatchdog, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

const DRIVER_DIR: &str = "/sys/bus/pci/drivers/tdrv-sim";
const HANG_US: i64 = HANG.as_micros() as i64;

fn main() {
    let cmdline = fs::read_to_string("/proc/cmdline").unwrap_or_default();
    if !cmdline
        .split_whitespace()
        .any(|w| w == "tdrv_sim_killable=1")
    {
        skip_all("no host listens for the kill request (tdrv_sim_killable=1 is not on the kernel command line: scripts/guest with a sim device sets it)");
    }
    let (dev, path, _) = open_device_or_skip("/dev/tdrv2", Some(TDRV_DEVICE_SIM));
    let mut t = Tap::new(8);
    let len = 1 << 20;
    let setup = || -> Result<_, String> {
        let a = ok("alloc", dev.alloc(len as u64, 0))?;
        let d = ok("alloc", dev.alloc(len as u64, 0))?;
        let c = ok("alloc", dev.alloc(len as u64, 0))?;
        ok("copy_in", dev.copy_in(a.handle, 0, &vec![0x5A; len]))?;
        ok("completion_reset", dev.completion_reset(d.handle))?;
        Ok((a, d, c))
    };
    let (a, d, c) = match setup() {
        Ok(v) => v,
        Err(e) => {
            t.check("setup", Err::<(), _>(e));
            t.finish();
        }
    };
    // The product's default watchdog from here on (never restored: the
    // device does not come back).
    let watchdog = SimWatchdog::set(&path, SimWatchdog::DEFAULT_MS);
    if let Err(e) = &watchdog {
        println!("# {e}");
    }
    std::mem::forget(watchdog);
    // The job's queue stops executing (a live simulator would answer the
    // reset after the watchdog's timeout; a dead one does not), so the
    // job is surely on the device when the simulator dies.
    let _ = inject(&path, "stall");
    let id = dev.submit(&[desc(a.handle, 0, d.handle, 0, len as u64)]);
    let id = match id {
        Ok(id) => id,
        Err(e) => {
            t.check("submit", Err::<(), _>(format!("errno {e}")));
            t.finish();
        }
    };
    let notified = dev.job_notify(id, 77);

    let (tx, rx) = mpsc::channel::<(&str, R)>();
    let results = thread::scope(|sc| {
        let t1 = tx.clone();
        let devr = &dev;
        sc.spawn(move || {
            let r = match devr.completion_wait(d.handle, 1, -1) {
                Err((e, _)) if e == libc::EIO => Ok(()),
                other => Err(format!("{other:?}, want EIO")),
            };
            let _ = t1.send(("completion_wait", r));
        });
        let t2 = tx.clone();
        sc.spawn(move || {
            let mut ev = [tdrv_event::default(); 4];
            let r = match devr.read_events(&mut ev) {
                Ok(1) => expect_eq(
                    "the event",
                    (ev[0].type_, ev[0].job_id, ev[0].user_data, ev[0].status),
                    (TDRV_EVENT_JOB_DONE, id, 77, -libc::ETIMEDOUT),
                ),
                other => Err(format!("read: {other:?}, want one event")),
            };
            let _ = t2.send(("event", r));
        });
        let t3 = tx.clone();
        sc.spawn(move || {
            let data = vec![0x33; len];
            let mut n = 0u64;
            let r = loop {
                match devr.copy_in(c.handle, 0, &data) {
                    Ok(()) => n += 1,
                    Err(e) if e == libc::ETIMEDOUT || e == libc::EIO => break Ok(()),
                    Err(e) => {
                        break Err(format!(
                            "after {n} copies: errno {e}, want ETIMEDOUT or EIO"
                        ))
                    }
                }
            };
            let _ = t3.send(("copy_in loop", r));
        });
        drop(tx);
        // Let the loop and the waiters get going, then ask the host.
        thread::sleep(Duration::from_millis(200));
        println!("tdrv-guest: SIGKILL tdrv-sim now");
        let _ = std::io::stdout().flush();
        let job = dev.job_wait(id, HANG_US);
        let mut got = Vec::new();
        let t0 = Instant::now();
        while got.len() < 3 {
            match rx.recv_timeout(HANG.saturating_sub(t0.elapsed())) {
                Ok(v) => got.push(v),
                Err(_) => break,
            }
        }
        (job, got)
    });
    let (job, got) = results;
    t.check(
        "JOB_NOTIFY before the kill",
        notified.map_err(|e| format!("errno {e}")),
    );
    t.check(
        "the job on the device when tdrv-sim died ends with ETIMEDOUT",
        expect_eq("job_wait", job, Ok((TDRV_JOB_DONE, -libc::ETIMEDOUT))),
    );
    for (name, what) in [
        (
            "its completion event arrives with ETIMEDOUT and its user data",
            "event",
        ),
        (
            "COMPLETION_WAIT without a timeout on its destination wakes with EIO",
            "completion_wait",
        ),
        ("a COPY_IN loop ends with ETIMEDOUT or EIO", "copy_in loop"),
    ] {
        let r = match got.iter().find(|(w, _)| *w == what) {
            Some((_, r)) => r.clone(),
            None => Err(format!("still blocked {HANG:?} after the kill")),
        };
        t.check(name, r);
    }

    // Later work: each queue dies when it gets work nobody runs; once all
    // are dead, SUBMIT and the synchronous transfers fail with EIO. Fresh
    // buffers (small ones are zeroed by the CPU, without the device): the
    // ones above hold the abandoned work's error, which fails a job or a
    // copy before it reaches a queue.
    let fresh = || -> Result<(u64, u64), String> {
        let e = ok("alloc", dev.alloc(4096, 0))?;
        let f = ok("alloc", dev.alloc(4096, 0))?;
        Ok((e.handle, f.handle))
    };
    t.check(
        "later SUBMITs end with ETIMEDOUT or EIO until SUBMIT itself fails with EIO",
        (|| -> R {
            for _ in 0..64 {
                let (e, f) = fresh()?;
                match dev.submit(&[desc(e, 0, f, 0, 4096)]) {
                    Err(e) if e == libc::EIO => return Ok(()),
                    Err(e) => return Err(format!("SUBMIT: errno {e}, want EIO")),
                    Ok(id) => match dev.job_wait(id, HANG_US) {
                        Ok((TDRV_JOB_DONE, st)) if st == -libc::ETIMEDOUT || st == -libc::EIO => {}
                        other => return Err(format!("a later job: {other:?}")),
                    },
                }
            }
            Err("SUBMIT still accepted after 64 jobs on a dead device".into())
        })(),
    );
    t.check(
        "then COPY_IN and MEMSET fail with EIO",
        (|| -> R {
            let (e, _) = fresh()?;
            expect_eq("copy_in", dev.copy_in(e, 0, &[1; 4096]), Err(libc::EIO))?;
            expect_eq("memset", dev.memset(e, 0, 4096, 0), Err(libc::EIO))
        })(),
    );
    t.check(
        "unbinding the dead device releases everything: no DMA-API report, no warning",
        (|| -> R {
            let pci = tdrv_guest_tests::bound_pci_address(DRIVER_DIR)?;
            let errors = dma_api_errors();
            let before = kernel_log()?;
            fs::write(format!("{DRIVER_DIR}/unbind"), &pci)
                .map_err(|e| format!("unbind {pci}: {e}"))?;
            let after = kernel_log()?;
            let bad = new_reports(&before, &after);
            if !bad.is_empty() {
                return Err(format!("the unbind logged {bad:?}"));
            }
            if let (Some(b), Some(a)) = (errors, dma_api_errors()) {
                expect_eq("DMA-API error count", a, b)?;
            }
            Ok(())
        })(),
    );
    t.finish();
}
