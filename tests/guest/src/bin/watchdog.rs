//! The edu watchdog: with `edu_timeout_ms` below the device's ~100 ms DMA
//! time, every job must fail with ETIMEDOUT and still release its fences,
//! and the device must stay usable for synchronous work.
//!
//! usage: watchdog /dev/tdrvN   (an edu device; load tdrv with
//! edu_timeout_ms=20)

use std::fs;

use tdrv_guest_tests::{expect_eq, ok, open_device_or_skip, Tap};
use tdrv_uapi::*;

type R = Result<(), String>;

fn main() {
    let (dev, path, _) = open_device_or_skip("/dev/tdrv1", Some(TDRV_DEVICE_EDU));
    let name = path.trim_start_matches("/dev/").to_string();
    let timeouts = || -> Result<u64, String> {
        let text = fs::read_to_string(format!("/sys/kernel/debug/tdrv/{name}/stats"))
            .map_err(|e| e.to_string())?;
        text.lines()
            .find_map(|l| l.strip_prefix("watchdog_timeouts:")?.trim().parse().ok())
            .ok_or_else(|| "no watchdog_timeouts in stats".into())
    };
    let mut t = Tap::new(3);

    let a = dev.alloc(8192, 0).expect("alloc");
    let b = dev.alloc(8192, 0).expect("alloc");
    t.run(
        "a job the device does not finish in time fails with ETIMEDOUT",
        || -> R {
            let before = timeouts()?;
            let d = tdrv_copy_desc {
                src_handle: a.handle,
                dst_handle: b.handle,
                size: 8192,
                ..Default::default()
            };
            let id = ok("submit", dev.submit(&[d]))?;
            expect_eq(
                "job",
                ok("wait", dev.job_wait(id, -1))?,
                (TDRV_JOB_DONE, -libc::ETIMEDOUT),
            )?;
            if timeouts()? <= before {
                return Err("watchdog_timeouts did not grow".into());
            }
            Ok(())
        },
    );

    t.run(
        "the failed job released its fences and counted no completion",
        || -> R {
            let i = ok("buf_info", dev.buf_info(b.handle))?;
            expect_eq("pending", (i.pending_reads, i.pending_writes), (0, 0))?;
            expect_eq("completions", i.completion_count, 0)?;
            ok("fence wait", dev.fence_wait(b.handle, TDRV_FENCE_ALL, 0))
        },
    );

    t.run(
        "later jobs time out too, and synchronous work still runs",
        || -> R {
            let d = tdrv_copy_desc {
                src_handle: a.handle,
                dst_handle: b.handle,
                size: 100,
                ..Default::default()
            };
            let ids: Vec<u64> = (0..3)
                .map(|_| ok("submit", dev.submit(&[d])))
                .collect::<Result<_, _>>()?;
            for id in ids {
                expect_eq(
                    "job",
                    ok("wait", dev.job_wait(id, -1))?,
                    (TDRV_JOB_DONE, -libc::ETIMEDOUT),
                )?;
            }
            ok("copy_in", dev.copy_in(b.handle, 0, &[1, 2, 3]))?;
            let mut out = [0u8; 3];
            ok("copy_out", dev.copy_out(b.handle, 0, &mut out))?;
            expect_eq("data", out, [1, 2, 3])
        },
    );
    t.finish();
}
