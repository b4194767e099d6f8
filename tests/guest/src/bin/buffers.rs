//! Buffers: allocation and accounting, handles, synchronous transfers with
//! their bounds, and mmap.
//!
//! usage: buffers [/dev/tdrvN]

use tdrv_guest_tests::{
    expect_eq, expect_err, ok, open_device_or_skip,
    raw::{page_size, Dev},
    HangGuard, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// An address that is certainly not mapped.
fn unmapped_addr() -> u64 {
    let page = page_size();
    // SAFETY: reserve then release a page; nothing maps it in between
    // (single-threaded test).
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        libc::munmap(p, page);
        p as u64
    }
}

/// A field of /proc/meminfo in KiB, if the kernel has it.
fn meminfo_kib(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
}

fn used(dev: &Dev, ch: u32) -> Result<u64, String> {
    ok("channel_info", dev.channel_info(ch)).map(|c| c.used_bytes)
}

fn main() {
    let (dev, path, version) = open_device_or_skip("/dev/tdrv0", None);
    let mut t = Tap::new(22);

    t.run(
        "alloc returns a handle, DMA address and mmap offset",
        || -> R {
            let a = ok("alloc", dev.alloc(10_000, 0))?;
            if a.handle == 0
                || a.dma_addr == 0
                || a.mmap_offset == 0
                || a.mmap_offset % page_size() as u64 != 0
            {
                return Err(format!("bad alloc result {a:?}"));
            }
            let i = ok("buf_info", dev.buf_info(a.handle))?;
            expect_eq("size", i.size, 10_000)?;
            expect_eq("channel", i.channel, 0)?;
            expect_eq("dma_addr", i.dma_addr, a.dma_addr)?;
            expect_eq("mmap_offset", i.mmap_offset, a.mmap_offset)?;
            expect_eq(
                "pending",
                (i.pending_reads, i.pending_writes, i.completion_count),
                (0, 0, 0),
            )?;
            ok("free", dev.free(a.handle))
        },
    );

    t.run(
        "size 0, absurd sizes and bad channels are refused",
        || -> R {
            expect_err("size 0", dev.alloc(0, 0), libc::EINVAL)?;
            expect_err(
                "size max+1",
                dev.alloc(TDRV_MAX_BUFFER_SIZE as u64 + 1, 0),
                libc::EINVAL,
            )?;
            expect_err("size u64::MAX", dev.alloc(u64::MAX, 0), libc::EINVAL)?;
            expect_err(
                "channel past the last",
                dev.alloc(4096, version.num_channels),
                libc::EINVAL,
            )?;
            expect_err("channel u32::MAX", dev.alloc(4096, u32::MAX), libc::EINVAL)
        },
    );

    t.run(
        "channel accounting: used, peak, limit, refusals",
        || -> R {
            let before = ok("channel_info", dev.channel_info(0))?;
            let a = ok("alloc", dev.alloc(1 << 20, 0))?;
            let mid = ok("channel_info", dev.channel_info(0))?;
            expect_eq(
                "used after alloc",
                mid.used_bytes,
                before.used_bytes + (1 << 20),
            )?;
            expect_eq("buffers after alloc", mid.buffers, before.buffers + 1)?;
            if mid.peak_bytes < mid.used_bytes {
                return Err("peak below used".into());
            }
            // More than what is left on the channel: ENOSPC, counted.
            let too_big = mid.limit_bytes - mid.used_bytes + 1;
            if too_big <= TDRV_MAX_BUFFER_SIZE as u64 {
                expect_err("over the limit", dev.alloc(too_big, 0), libc::ENOSPC)?;
                let after = ok("channel_info", dev.channel_info(0))?;
                expect_eq("failed_allocs", after.failed_allocs, mid.failed_allocs + 1)?;
            }
            ok("free", dev.free(a.handle))?;
            expect_eq("used after free", used(&dev, 0)?, before.used_bytes)
        },
    );

    t.run("a new buffer reads as zeroes", || -> R {
        let a = ok("alloc", dev.alloc(8192, 0))?;
        let mut out = vec![0xAAu8; 8192];
        ok("copy_out", dev.copy_out(a.handle, 0, &mut out))?;
        let r = if out.iter().all(|b| *b == 0) {
            Ok(())
        } else {
            Err("non-zero bytes".into())
        };
        ok("free", dev.free(a.handle))?;
        r
    });

    t.run("copy_in then copy_out is byte-exact at offsets", || -> R {
        let a = ok("alloc", dev.alloc(3 * 4096 + 5, 0))?;
        let data = pattern(5000, 7);
        ok("copy_in", dev.copy_in(a.handle, 4093, &data))?;
        let mut back = vec![0u8; 5000];
        ok("copy_out", dev.copy_out(a.handle, 4093, &mut back))?;
        expect_eq("data", back == data, true)?;
        let mut edge = [0u8; 3];
        ok("copy_out edge", dev.copy_out(a.handle, 4090, &mut edge))?;
        expect_eq("bytes before the write", edge, [0, 0, 0])?;
        ok(
            "zero-size copy_in",
            dev.copy_in(a.handle, 3 * 4096 + 5, &[]),
        )?;
        ok("free", dev.free(a.handle))
    });

    t.run(
        "out-of-range and overflowing ranges give ERANGE",
        || -> R {
            let a = ok("alloc", dev.alloc(4096, 0))?;
            let h = a.handle;
            let mut buf = [0u8; 16];
            expect_err("copy_in past end", dev.copy_in(h, 4090, &buf), libc::ERANGE)?;
            expect_err(
                "copy_out past end",
                dev.copy_out(h, 4095, &mut buf[..2]),
                libc::ERANGE,
            )?;
            expect_err(
                "copy_in offset past end",
                dev.copy_in(h, 4097, &[]),
                libc::ERANGE,
            )?;
            expect_err(
                "memset overflow",
                dev.memset(h, u64::MAX, 2, 0),
                libc::ERANGE,
            )?;
            expect_err("memset huge", dev.memset(h, 1, u64::MAX, 0), libc::ERANGE)?;
            let mut x = tdrv_xfer {
                handle: h,
                offset: u64::MAX - 7,
                size: 16,
                user_ptr: buf.as_mut_ptr() as u64,
                ..Default::default()
            };
            expect_err(
                "copy_out offset+size overflow",
                dev.ioctl(TDRV_IOC_COPY_OUT, &mut x),
                libc::ERANGE,
            )?;
            let desc = tdrv_copy_desc {
                src_handle: h,
                dst_handle: h,
                src_offset: u64::MAX,
                size: 2,
                ..Default::default()
            };
            expect_err("copy overflow", dev.copy(desc), libc::ERANGE)?;
            ok("free", dev.free(h))
        },
    );

    t.run(
        "unmapped or read-only user pointers give EFAULT",
        || -> R {
            let a = ok("alloc", dev.alloc(8192, 0))?;
            let h = a.handle;
            let bad = unmapped_addr();
            let mut x = tdrv_xfer {
                handle: h,
                size: 4096,
                user_ptr: bad,
                ..Default::default()
            };
            expect_err(
                "copy_in from unmapped",
                dev.ioctl(TDRV_IOC_COPY_IN, &mut x),
                libc::EFAULT,
            )?;
            expect_err(
                "copy_out to unmapped",
                dev.ioctl(TDRV_IOC_COPY_OUT, &mut x),
                libc::EFAULT,
            )?;
            let mut x = tdrv_xfer {
                handle: h,
                size: 16,
                user_ptr: main as *const () as u64,
                ..Default::default()
            };
            expect_err(
                "copy_out into read-only text",
                dev.ioctl(TDRV_IOC_COPY_OUT, &mut x),
                libc::EFAULT,
            )?;
            // A kernel address is never a valid user pointer.
            let mut x = tdrv_xfer {
                handle: h,
                size: 16,
                user_ptr: 0xffff_ffff_8100_0000,
                ..Default::default()
            };
            expect_err(
                "copy_in from kernel address",
                dev.ioctl(TDRV_IOC_COPY_IN, &mut x),
                libc::EFAULT,
            )?;
            expect_err(
                "copy_out to kernel address",
                dev.ioctl(TDRV_IOC_COPY_OUT, &mut x),
                libc::EFAULT,
            )?;
            ok("free", dev.free(h))
        },
    );

    t.run("memset fills exactly its range", || -> R {
        let a = ok("alloc", dev.alloc(1000, 0))?;
        ok("memset", dev.memset(a.handle, 100, 800, 0x5A))?;
        let mut out = vec![0u8; 1000];
        ok("copy_out", dev.copy_out(a.handle, 0, &mut out))?;
        let good = out
            .iter()
            .enumerate()
            .all(|(i, b)| *b == if (100..900).contains(&i) { 0x5A } else { 0 });
        ok("free", dev.free(a.handle))?;
        expect_eq("memset pattern", good, true)
    });

    t.run(
        "synchronous copy: byte-exact, overlap EINVAL, cross-channel EXDEV",
        || -> R {
            let a = ok("alloc", dev.alloc(10_000, 0))?;
            let b = ok("alloc", dev.alloc(10_000, 0))?;
            let data = pattern(10_000, 3);
            ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
            let desc = tdrv_copy_desc {
                src_handle: a.handle,
                src_offset: 17,
                dst_handle: b.handle,
                dst_offset: 1,
                size: 9000,
            };
            ok("copy", dev.copy(desc))?;
            let mut out = vec![0u8; 9000];
            ok("copy_out", dev.copy_out(b.handle, 1, &mut out))?;
            expect_eq("copied bytes", out[..] == data[17..9017], true)?;
            // Overlapping ranges of one buffer are refused (the edu engine
            // could not give memmove results), for COPY and SUBMIT alike;
            // adjacent ranges are fine.
            let desc = tdrv_copy_desc {
                src_handle: a.handle,
                src_offset: 0,
                dst_handle: a.handle,
                dst_offset: 10,
                size: 100,
            };
            expect_err("overlapping copy", dev.copy(desc), libc::EINVAL)?;
            expect_err("overlapping job", dev.submit(&[desc]), libc::EINVAL)?;
            let mut out = vec![0u8; 100];
            ok("copy_out", dev.copy_out(a.handle, 10, &mut out))?;
            expect_eq("buffer untouched", out[..] == data[10..110], true)?;
            let adjacent = tdrv_copy_desc {
                dst_offset: 100,
                ..desc
            };
            ok("adjacent copy", dev.copy(adjacent))?;
            ok("copy_out", dev.copy_out(a.handle, 100, &mut out))?;
            expect_eq("adjacent copy bytes", out[..] == data[..100], true)?;
            let desc0 = tdrv_copy_desc {
                src_handle: a.handle,
                dst_handle: b.handle,
                size: 0,
                ..Default::default()
            };
            expect_err("size 0", dev.copy(desc0), libc::EINVAL)?;
            if version.num_channels > 1 {
                let c = ok("alloc ch1", dev.alloc(10_000, 1))?;
                let desc = tdrv_copy_desc {
                    src_handle: a.handle,
                    dst_handle: c.handle,
                    size: 10,
                    ..Default::default()
                };
                expect_err("cross-channel copy", dev.copy(desc), libc::EXDEV)?;
                ok("free", dev.free(c.handle))?;
            }
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    t.run("bad handles give ENOENT; double free too", || -> R {
        for h in [0u64, 1, 0xdead_beef, u64::MAX, 1 << 24] {
            expect_err(&format!("buf_info({h:#x})"), dev.buf_info(h), libc::ENOENT)?;
            expect_err(&format!("free({h:#x})"), dev.free(h), libc::ENOENT)?;
        }
        let a = ok("alloc", dev.alloc(4096, 0))?;
        ok("free", dev.free(a.handle))?;
        expect_err("double free", dev.free(a.handle), libc::ENOENT)?;
        expect_err(
            "copy_in freed",
            dev.copy_in(a.handle, 0, &[1]),
            libc::ENOENT,
        )
    });

    t.run(
        "a freed handle stays dead after its slot is reused",
        || -> R {
            let a = ok("alloc", dev.alloc(4096, 0))?;
            ok("free", dev.free(a.handle))?;
            let b = ok("alloc", dev.alloc(4096, 0))?;
            if a.handle == b.handle {
                return Err("handle value reused".into());
            }
            expect_err("stale handle", dev.buf_info(a.handle), libc::ENOENT)?;
            expect_err("stale memset", dev.memset(a.handle, 0, 1, 1), libc::ENOENT)?;
            ok("new handle works", dev.buf_info(b.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    t.run("a handle of another open file is invalid here", || -> R {
        let other = ok("open", Dev::open(&path))?;
        let a = ok("alloc in other file", other.alloc(4096, 0))?;
        expect_err("buf_info", dev.buf_info(a.handle), libc::ENOENT)?;
        expect_err("free", dev.free(a.handle), libc::ENOENT)?;
        expect_err(
            "copy_out",
            dev.copy_out(a.handle, 0, &mut [0u8; 4]),
            libc::ENOENT,
        )?;
        expect_err("mmap", dev.map(&a).map(drop), libc::ENOENT)?;
        ok("other file still owns it", other.buf_info(a.handle)).map(drop)
    });

    t.run("mmap shares bytes with copy_in/copy_out", || -> R {
        let a = ok("alloc", dev.alloc(3 * 4096, 0))?;
        let mut m = ok("mmap", dev.map(&a))?;
        m.as_mut_slice()[5000..5004].copy_from_slice(b"tdrv");
        let mut out = [0u8; 4];
        ok("copy_out", dev.copy_out(a.handle, 5000, &mut out))?;
        expect_eq("written through mapping", &out, b"tdrv")?;
        ok("copy_in", dev.copy_in(a.handle, 100, b"abc"))?;
        expect_eq("visible in mapping", &m.as_slice()[100..103], b"abc")?;
        drop(m);
        ok("free", dev.free(a.handle))
    });

    // A tensor's bytes written from, or read into, another tensor's
    // mapping: the user range is a PFN mapping that cannot be pinned, which
    // a device that DMAs to user pages must work around.
    t.run(
        "COPY_IN from and COPY_OUT into a buffer mapping move the bytes",
        || -> R {
            let size = 3 * 4096;
            let a = ok("alloc", dev.alloc(size, 0))?;
            let b = ok("alloc", dev.alloc(size, 0))?;
            let mut ma = ok("mmap", dev.map(&a))?;
            for (i, x) in ma.as_mut_slice().iter_mut().enumerate() {
                *x = (i * 7 + 3) as u8;
            }
            let want = ma.as_slice()[50..9050].to_vec();
            // Unaligned, across page boundaries of both.
            ok(
                "copy_in from a mapping",
                dev.copy_in(b.handle, 100, &ma.as_slice()[50..9050]),
            )?;
            let mut out = vec![0u8; 9000];
            ok("copy_out", dev.copy_out(b.handle, 100, &mut out))?;
            expect_eq("bytes copied in from the mapping", out == want, true)?;
            ma.as_mut_slice().fill(0);
            ok(
                "copy_out into a mapping",
                dev.copy_out(b.handle, 100, &mut ma.as_mut_slice()[1000..10000]),
            )?;
            expect_eq(
                "bytes copied out into the mapping",
                ma.as_slice()[1000..10000] == want[..],
                true,
            )?;
            expect_eq(
                "bytes around them untouched",
                ma.as_slice()[..1000]
                    .iter()
                    .chain(&ma.as_slice()[10000..])
                    .all(|x| *x == 0),
                true,
            )?;
            // A buffer's own mapping as the source of a copy into it.
            let mut mb = ok("mmap", dev.map(&b))?;
            mb.as_mut_slice()[8192..].fill(0x5a);
            ok(
                "copy_in from its own mapping",
                dev.copy_in(b.handle, 0, &mb.as_slice()[8192..]),
            )?;
            expect_eq(
                "own bytes copied",
                mb.as_slice()[..4096].iter().all(|x| *x == 0x5a),
                true,
            )?;
            drop((ma, mb));
            ok("free", dev.free(a.handle))?;
            ok("free", dev.free(b.handle))
        },
    );

    t.run("mmap checks length, sharing and offset", || -> R {
        let a = ok("alloc", dev.alloc(4096, 0))?;
        expect_err(
            "two pages of a one-page buffer",
            dev.map_len(a.mmap_offset, 2 * page_size()).map(drop),
            libc::EINVAL,
        )?;
        // SAFETY: a private mapping request; it must fail, nothing is mapped.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                dev.fd(),
                a.mmap_offset as libc::off_t,
            )
        };
        if p != libc::MAP_FAILED {
            // SAFETY: unmapping what was just (wrongly) mapped.
            unsafe { libc::munmap(p, 4096) };
            return Err("MAP_PRIVATE was accepted".into());
        }
        expect_eq(
            "MAP_PRIVATE errno",
            tdrv_guest_tests::raw::errno(),
            libc::EINVAL,
        )?;
        expect_err(
            "unknown offset",
            dev.map_len(a.mmap_offset + (1 << 40), 4096).map(drop),
            libc::ENOENT,
        )?;
        expect_err("offset 0", dev.map_len(0, 4096).map(drop), libc::ENOENT)?;
        ok("free", dev.free(a.handle))
    });

    t.run(
        "FREE while mapped keeps the memory until munmap",
        || -> R {
            let base = used(&dev, 0)?;
            let a = ok("alloc", dev.alloc(2 * 4096, 0))?;
            let mut m = ok("mmap", dev.map(&a))?;
            let data = pattern(8192, 9);
            m.as_mut_slice().copy_from_slice(&data);
            ok("free", dev.free(a.handle))?;
            expect_err("handle gone", dev.buf_info(a.handle), libc::ENOENT)?;
            expect_eq("data intact after free", m.as_slice() == &data[..], true)?;
            m.as_mut_slice()[0] = 1;
            expect_eq("still charged while mapped", used(&dev, 0)?, base + 8192)?;
            drop(m);
            expect_eq("released after munmap", used(&dev, 0)?, base)
        },
    );

    t.run(
        "a split mapping keeps the buffer until its last piece goes",
        || -> R {
            let base = used(&dev, 0)?;
            let a = ok("alloc", dev.alloc(3 * 4096, 0))?;
            let mut m = ok("mmap", dev.map(&a))?;
            m.as_mut_slice()[2 * 4096] = 0x77;
            ok("free", dev.free(a.handle))?;
            let ptr = m.as_slice().as_ptr() as *mut libc::c_void;
            // SAFETY: unmap the first page of our own mapping; `m` is forgotten
            // below and the rest is unmapped by hand.
            let r = unsafe { libc::munmap(ptr, 4096) };
            expect_eq("munmap first page", r, 0)?;
            std::mem::forget(m);
            // SAFETY: pages 1 and 2 are still mapped.
            let byte = unsafe { *(ptr as *const u8).add(2 * 4096) };
            expect_eq("rest still readable", byte, 0x77)?;
            expect_eq("still charged", used(&dev, 0)?, base + 3 * 4096)?;
            // SAFETY: unmap the remaining two pages.
            unsafe { libc::munmap((ptr as *mut u8).add(4096).cast(), 2 * 4096) };
            expect_eq("released after the last piece", used(&dev, 0)?, base)
        },
    );

    t.run("closing a file frees its buffers", || -> R {
        let base = used(&dev, 0)?;
        let other = ok("open", Dev::open(&path))?;
        for _ in 0..8 {
            ok("alloc", other.alloc(64 * 1024, 0))?;
        }
        expect_eq("charged", used(&dev, 0)?, base + 8 * 64 * 1024)?;
        drop(other);
        expect_eq("released on close", used(&dev, 0)?, base)
    });

    t.run("a mapping outlives close of its file", || -> R {
        let base = used(&dev, 0)?;
        let other = ok("open", Dev::open(&path))?;
        let a = ok("alloc", other.alloc(4096, 0))?;
        let mut m = ok("mmap", other.map(&a))?;
        drop(other);
        m.as_mut_slice()[0] = 42;
        expect_eq("readable", m.as_slice()[0], 42)?;
        drop(m);
        expect_eq("released", used(&dev, 0)?, base)
    });

    t.run("10000 buffers: unique handles, all freed", || -> R {
        let base = used(&dev, 0)?;
        let mut handles = Vec::with_capacity(10_000);
        for _ in 0..10_000 {
            handles.push(ok("alloc", dev.alloc(64, 0))?.handle);
        }
        let mut sorted = handles.clone();
        sorted.sort_unstable();
        sorted.dedup();
        expect_eq("unique", sorted.len(), 10_000)?;
        for h in handles {
            ok("free", dev.free(h))?;
        }
        expect_eq("released", used(&dev, 0)?, base)
    });

    // Handle lookups take no lock (driver/handle.rs): a lookup racing FREE
    // of the same handle must see the whole buffer or ENOENT, never freed
    // memory. The debug test kernel poisons freed objects (slub_debug), so
    // a use-after-free shows as a wrong size here or a poison report in the
    // dmesg check. The guest has two CPUs.
    t.run("lookups racing FREE see the buffer or ENOENT", || -> R {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
        const ROUNDS: usize = 3000;
        const SIZE: u64 = 4096 + 8;
        let edu = version.device_kind == TDRV_DEVICE_EDU;
        let base = used(&dev, 0)?;
        let dst = ok("alloc", dev.alloc(SIZE, 0))?.handle;
        let current = AtomicU64::new(0);
        let done = AtomicBool::new(false);
        // What the reader saw so far: the main thread goes on until both
        // outcomes happened (the reader may get few turns: under -icount
        // the vCPUs take turns by time slice).
        let (seen_hit, seen_miss) = (AtomicBool::new(false), AtomicBool::new(false));
        // Seconds normally; a hang shows where each thread waits.
        let _hang = HangGuard::arm("lookups racing FREE", 120);
        let (hits, misses) = std::thread::scope(|s| -> Result<(u64, u64), String> {
            let reader = s.spawn(|| -> Result<(u64, u64), String> {
                let (mut hits, mut misses) = (0u64, 0u64);
                let mut byte = [0u8; 1];
                let mut n = 0u64;
                while !done.load(Relaxed) {
                    let h = current.load(Relaxed);
                    n += 1;
                    let seen = match n % 4 {
                        0 => dev.buf_info(h).and_then(|i| {
                            if (i.size, i.channel) != (SIZE, 0) {
                                return Err(-1);
                            }
                            Ok(())
                        }),
                        1 => dev.copy_out(h, SIZE - 1, &mut byte),
                        2 => dev.fence_wait(h, TDRV_FENCE_ALL, 0),
                        // SUBMIT looks up both handles of each descriptor
                        // (edu DMAs take ~0.1 s each: BUF_INFO there).
                        _ if edu => dev.buf_info(h).map(drop),
                        _ => dev
                            .submit(&[tdrv_copy_desc {
                                src_handle: h,
                                dst_handle: dst,
                                size: 8,
                                src_offset: SIZE - 8,
                                ..Default::default()
                            }])
                            .and_then(|job| dev.job_wait(job, 60_000_000))
                            .and_then(|(_, status)| match status {
                                0 => Ok(()),
                                e => Err(-e.abs()),
                            }),
                    };
                    match seen {
                        Ok(()) => {
                            hits += 1;
                            seen_hit.store(true, Relaxed);
                        }
                        Err(libc::ENOENT) => {
                            misses += 1;
                            seen_miss.store(true, Relaxed);
                        }
                        Err(-1) => return Err(format!("lookup {n} saw a bad buffer")),
                        Err(e) => return Err(format!("lookup {n} (kind {}): errno {e}", n % 4)),
                    }
                }
                Ok((hits, misses))
            });
            let mut r = Ok(());
            for round in 0.. {
                if round >= ROUNDS && seen_hit.load(Relaxed) && seen_miss.load(Relaxed)
                    || round >= 100 * ROUNDS
                {
                    break;
                }
                let a = match dev.alloc(SIZE, 0) {
                    Ok(a) => a,
                    Err(e) => {
                        r = Err(format!("alloc: errno {e}"));
                        break;
                    }
                };
                current.store(a.handle, Relaxed);
                // Give the reader a moment with the live handle. Not a
                // PAUSE spin: under -icount the vCPUs take turns, and each
                // PAUSE hands the turn to the other vCPU, for a whole
                // time slice.
                std::thread::yield_now();
                if let Err(e) = dev.free(a.handle) {
                    r = Err(format!("free: errno {e}"));
                    break;
                }
            }
            done.store(true, Relaxed);
            let counts = reader.join().map_err(|_| "reader panicked")??;
            r.map(|()| counts)
        })?;
        ok("free", dev.free(dst))?;
        expect_eq("released", used(&dev, 0)?, base)?;
        // Both outcomes must have happened, or the race was not exercised.
        if hits == 0 || misses == 0 {
            return Err(format!("{hits} hits, {misses} misses: no race"));
        }
        println!("# {hits} lookups hit, {misses} missed");
        Ok(())
    });

    // A device whose engine does no DMA gets system pages: multi-page
    // buffers must not come from the CMA area (as `dma_alloc_coherent`
    // would take them), which is slower and absent from stock kernels.
    let cma = meminfo_kib("CmaTotal").filter(|&k| k > 0);
    if version.device_kind != TDRV_DEVICE_SOFT {
        t.skip("multi-page buffers do not come from CMA", "DMA device");
    } else if cma.is_none() {
        t.skip(
            "multi-page buffers do not come from CMA",
            "kernel has no CMA",
        );
    } else {
        t.run("multi-page buffers do not come from CMA", || -> R {
            let free0 = meminfo_kib("CmaFree").ok_or("no CmaFree")?;
            let mut handles = Vec::new();
            for size in [16 << 10, 64 << 10, 256 << 10, 1 << 20, 1 << 20] {
                let a = ok("alloc", dev.alloc(size, 0))?;
                // The pages are usable through the mapping.
                let mut m = ok("mmap", dev.map(&a))?;
                let s = m.as_mut_slice();
                expect_eq("zeroed", (s[0], s[s.len() - 1]), (0, 0))?;
                s[s.len() - 1] = 7;
                handles.push(a.handle);
            }
            let taken = free0.saturating_sub(meminfo_kib("CmaFree").ok_or("no CmaFree")?);
            for h in handles {
                ok("free", dev.free(h))?;
            }
            // 2.3 MiB allocated; allow for unrelated CMA users.
            if taken >= 512 {
                return Err(format!("CMA went down by {taken} KiB"));
            }
            Ok(())
        });
    }

    t.finish();
}
