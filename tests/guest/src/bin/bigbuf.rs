//! Large buffers: 8, 64 and 256 MiB allocate, map, move and read back
//! correctly. Buffers above 4 MiB are made of several DMA-contiguous
//! pieces (a stock kernel has no CMA area), so the checks cross piece
//! boundaries on purpose: mapped writes, COPY_IN/COPY_OUT, and jobs on
//! both engines.
//!
//! usage: bigbuf /dev/tdrvN   (the channel limit must hold two 256 MiB
//! buffers: `run-all` reloads the module with channel_mib=600 for this)

use tdrv_guest_tests::{expect_eq, ok, open_device_or_skip, Tap};
use tdrv_uapi::*;

type R = Result<(), String>;

const MIB: u64 = 1 << 20;
/// The largest piece a buffer is made of.
const PIECE: u64 = 4 * MIB;

/// Fills `buf`, which starts at byte `offset` of a buffer, with a cheap
/// page-granular pattern: every 4 KiB page holds its page index (and
/// `seed`) in its first 8 bytes and a page-dependent byte elsewhere, so a
/// misplaced page or piece shows.
fn fill(buf: &mut [u8], offset: u64, seed: u64) {
    for (i, page) in buf.chunks_mut(4096).enumerate() {
        let index = offset / 4096 + i as u64;
        page.fill((index % 251) as u8 ^ seed as u8);
        let head = (index ^ (seed << 48)).to_le_bytes();
        let n = page.len().min(8);
        page[..n].copy_from_slice(&head[..n]);
    }
}

/// The pattern `fill` writes, for `len` bytes from `offset` (4 KiB aligned).
fn expected(offset: u64, len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, offset, seed);
    v
}

fn main() {
    let (dev, _, version) = open_device_or_skip("/dev/tdrv0", None);
    let edu = version.device_kind == TDRV_DEVICE_EDU;
    let sizes = [8 * MIB, 64 * MIB, 256 * MIB];
    let mut t = Tap::new(sizes.len());
    // The channel's limit decides what runs: not knowing it is a failure
    // of the program, not a reason to skip.
    let limit = tdrv_guest_tests::bail::require(
        "CHANNEL_INFO of channel 0",
        dev.channel_info(0).map_err(|e| format!("errno {e}")),
    )
    .limit_bytes;
    // A sim device's channels are its HBM (tdrv-sim --channel-size), which
    // channel_mib can only lower: sizes that do not fit are skipped there.
    let sim = version.device_kind == TDRV_DEVICE_SIM;
    for size in sizes {
        let name = format!(
            "{} MiB buffers: map, copy in/out, jobs across pieces",
            size / MIB
        );
        if sim && 2 * size > limit {
            t.skip(
                &name,
                &format!("the sim device's channels hold {} MiB", limit / MIB),
            );
            continue;
        }
        t.run(&name, || -> R {
            if 2 * size > limit {
                return Err(format!(
                    "channel limit {} MiB cannot hold two {} MiB buffers: load with channel_mib=600",
                    limit / MIB,
                    size / MIB
                ));
            }
            let a = ok("alloc", dev.alloc(size, 0))?;
            let b = ok("alloc", dev.alloc(size, 0))?;
            // Fill `a` through a mapping (every page faults in once).
            {
                let mut map = ok("mmap", dev.map(&a))?;
                fill(map.as_mut_slice(), 0, 1);
            }
            // Read back around every piece boundary with COPY_OUT.
            let mut window = vec![0u8; 8192];
            let mut boundary = PIECE;
            while boundary < size {
                let at = boundary - 4096;
                ok("copy_out", dev.copy_out(a.handle, at, &mut window))?;
                let good = window == expected(at, window.len(), 1);
                expect_eq(&format!("bytes around {} MiB", boundary / MIB), good, true)?;
                boundary += PIECE;
            }
            // A job from `a` to `b`: many pieces on the CPU engine; on edu
            // (4 KiB per ~200 ms) a span that crosses a piece boundary at
            // different points in source and destination.
            let (src, dst, len) = if edu {
                (PIECE - 8192, PIECE - 12288, 16384)
            } else {
                // 64 MiB at most: enough pieces, and TCG time is precious.
                (PIECE / 2, 0, size.min(64 * MIB) - PIECE)
            };
            let d = tdrv_copy_desc {
                src_handle: a.handle,
                src_offset: src,
                dst_handle: b.handle,
                dst_offset: dst,
                size: len,
            };
            let id = ok("submit", dev.submit(&[d]))?;
            expect_eq("job", ok("wait", dev.job_wait(id, -1))?, (TDRV_JOB_DONE, 0))?;
            let map = ok("mmap b", dev.map(&b))?;
            let got = &map.as_slice()[dst as usize..(dst + len) as usize];
            let want = expected(src, len as usize, 1);
            if got != &want[..] {
                let i = got.iter().zip(&want).position(|(x, y)| x != y).unwrap_or(0);
                return Err(format!("job output differs at byte {i} of {len}"));
            }
            drop(map);
            // COPY_IN across a boundary, checked through the mapping of `b`.
            let data = expected(0, 3 * 4096, 7);
            ok("copy_in", dev.copy_in(b.handle, PIECE - 4096, &data))?;
            let map = ok("mmap b", dev.map(&b))?;
            let at = (PIECE - 4096) as usize;
            expect_eq("copy_in bytes", map.as_slice()[at..at + data.len()] == data[..], true)?;
            drop(map);
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        });
    }
    t.finish();
}
