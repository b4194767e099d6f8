//! The edu watchdog, driven by the engine's fault injection (debugfs
//! `inject`): a lost completion interrupt is recovered without failing the
//! job, a stuck chunk fails its job with ETIMEDOUT and the queued jobs with
//! EIO, and the engine then serves jobs again.
//!
//! usage: watchdog /dev/tdrvN   (an edu device; others are skipped)
//!
//! The watchdog fires after `edu_timeout_ms` (default 5 s) of guest time;
//! under `-icount sleep=off` an idle guest skips to it at once.

use std::{fs, thread, time::Duration};

use tdrv_guest_tests::{expect_eq, expect_err, ok, open_device_or_skip, raw::Dev, Tap};
use tdrv_uapi::*;

type R = Result<(), String>;

fn desc(src: u64, dst: u64, size: u64) -> tdrv_copy_desc {
    tdrv_copy_desc {
        src_handle: src,
        dst_handle: dst,
        size,
        ..Default::default()
    }
}

fn main() {
    let (dev, path, _) = open_device_or_skip("/dev/tdrv1", Some(TDRV_DEVICE_EDU));
    let name = path.trim_start_matches("/dev/").to_string();
    let stat = |key: &str| -> Result<u64, String> {
        let text = fs::read_to_string(format!("/sys/kernel/debug/tdrv/{name}/stats"))
            .map_err(|e| e.to_string())?;
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':')?.trim().parse().ok())
            .ok_or_else(|| format!("no {key} in stats"))
    };
    let inject = |cmd: &str| -> std::io::Result<()> {
        fs::write(format!("/sys/kernel/debug/tdrv/{name}/inject"), cmd)
    };
    let mut t = Tap::new(5);

    let a = dev.alloc(8192, 0).expect("alloc");
    let b = dev.alloc(8192, 0).expect("alloc");
    dev.copy_in(a.handle, 0, &[0xAB; 8192]).expect("copy_in");

    t.run(
        "a lost completion interrupt is recovered: the job succeeds",
        || -> R {
            let spurious = stat("spurious_irqs")?;
            let timeouts = stat("watchdog_timeouts")?;
            inject("lose_irq").map_err(|e| format!("inject: {e}"))?;
            let id = ok("submit", dev.submit(&[desc(a.handle, b.handle, 100)]))?;
            expect_eq("job", ok("wait", dev.job_wait(id, -1))?, (TDRV_JOB_DONE, 0))?;
            let mut out = [0u8; 100];
            ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
            expect_eq("data", out.iter().all(|x| *x == 0xAB), true)?;
            expect_eq("no timeout counted", stat("watchdog_timeouts")?, timeouts)?;
            if stat("spurious_irqs")? <= spurious {
                return Err("the lost interrupt was not noticed".into());
            }
            Ok(())
        },
    );

    t.run(
        "a stuck chunk fails its job with ETIMEDOUT and the queued ones with EIO",
        || -> R {
            let timeouts = stat("watchdog_timeouts")?;
            let resets = stat("resets")?;
            let completions = ok("buf_info", dev.buf_info(b.handle))?.completion_count;
            inject("stall").map_err(|e| format!("inject: {e}"))?;
            let stuck = ok("submit", dev.submit(&[desc(a.handle, b.handle, 8192)]))?;
            ok("job_notify", dev.job_notify(stuck, 7))?;
            let queued: Vec<u64> = (0..3)
                .map(|_| ok("submit", dev.submit(&[desc(a.handle, b.handle, 64)])))
                .collect::<Result<_, _>>()?;
            expect_eq(
                "stuck job",
                ok("wait", dev.job_wait(stuck, -1))?,
                (TDRV_JOB_DONE, -libc::ETIMEDOUT),
            )?;
            for id in queued {
                expect_eq(
                    "queued job",
                    ok("wait", dev.job_wait(id, -1))?,
                    (TDRV_JOB_DONE, -libc::EIO),
                )?;
            }
            expect_eq(
                "watchdog_timeouts",
                stat("watchdog_timeouts")?,
                timeouts + 1,
            )?;
            expect_eq("resets", stat("resets")?, resets + 1)?;
            // The stuck transfer may still land: its destination stays
            // marked busy until the device lets go, and the wait for it then
            // learns (EIO) that the bytes are not what the job promised.
            let i = ok("buf_info", dev.buf_info(b.handle))?;
            expect_eq("write still pending", i.pending_writes, 1)?;
            // Its event came with the same status, also before the device
            // let go (tdrv.h, struct tdrv_job_wait).
            let mut ev = [tdrv_event::default(); 2];
            let n = ok("read of events", dev.read_events(&mut ev))?;
            expect_eq(
                "the stuck job's event (type, job, status, user data)",
                (n, ev[0].type_, ev[0].job_id, ev[0].status, ev[0].user_data),
                (1, TDRV_EVENT_JOB_DONE, stuck, -libc::ETIMEDOUT, 7),
            )?;
            expect_err(
                "fence wait",
                dev.fence_wait(b.handle, TDRV_FENCE_ALL, -1),
                libc::EIO,
            )?;
            let i = ok("buf_info", dev.buf_info(b.handle))?;
            expect_eq("pending", (i.pending_reads, i.pending_writes), (0, 0))?;
            expect_eq("completions", i.completion_count, completions)?;
            // The failure is latched on the destination: readers and waiters
            // learn it instead of stale bytes or an endless wait.
            expect_eq("error latch", i.error, -libc::ETIMEDOUT)?;
            let mut out = [0u8; 16];
            expect_err(
                "copy_out of the failed output",
                dev.copy_out(b.handle, 0, &mut out),
                libc::EIO,
            )?;
            expect_err(
                "completion wait for the failed job",
                dev.completion_wait(b.handle, completions + 1, -1)
                    .map_err(|(e, _)| e),
                libc::EIO,
            )?;
            // COMPLETION_RESET clears the latch (and the count).
            ok("completion_reset", dev.completion_reset(b.handle))?;
            expect_eq(
                "latch after reset",
                ok("buf_info", dev.buf_info(b.handle))?.error,
                0,
            )
        },
    );

    t.run("after recovery the engine serves jobs again", || -> R {
        let mut tries = 0;
        let id = loop {
            match dev.submit(&[desc(a.handle, b.handle, 4096)]) {
                Ok(id) => break id,
                // Still letting go of the stuck transfer.
                Err(e) if e == libc::EIO && tries < 120 => {
                    tries += 1;
                    thread::sleep(Duration::from_millis(500));
                }
                Err(e) => return Err(format!("submit after recovery: errno {e}")),
            }
        };
        expect_eq("job", ok("wait", dev.job_wait(id, -1))?, (TDRV_JOB_DONE, 0))?;
        let mut out = vec![0u8; 4096];
        ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
        expect_eq("data", out.iter().all(|x| *x == 0xAB), true)
    });

    t.run(
        "synchronous work and other files are unaffected",
        || -> R {
            let other = ok("open", Dev::open(&path))?;
            let c = ok("alloc", other.alloc(100, 0))?;
            ok("copy_in", other.copy_in(c.handle, 0, &[1, 2, 3]))?;
            let mut out = [0u8; 3];
            ok("copy_out", other.copy_out(c.handle, 0, &mut out))?;
            expect_eq("data", out, [1, 2, 3])
        },
    );

    t.run("unknown injection commands are refused", || -> R {
        match inject("melt") {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
            other => Err(format!("inject melt: {other:?}")),
        }?;
        // Nothing was armed by it: the next job ends well, with no lost
        // interrupt noticed and no watchdog timeout.
        let spurious = stat("spurious_irqs")?;
        let timeouts = stat("watchdog_timeouts")?;
        let id = ok("submit", dev.submit(&[desc(a.handle, b.handle, 100)]))?;
        expect_eq(
            "a job after the refused command",
            ok("wait", dev.job_wait(id, -1))?,
            (TDRV_JOB_DONE, 0),
        )?;
        expect_eq("spurious_irqs", stat("spurious_irqs")?, spurious)?;
        expect_eq("watchdog_timeouts", stat("watchdog_timeouts")?, timeouts)
    });

    t.finish();
}
