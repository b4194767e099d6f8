//! ABI checks of every ioctl: version, request numbers, struct sizes,
//! growth rule, reserved fields and bad argument pointers.
//!
//! usage: abi [/dev/tdrvN]

use std::mem::size_of;

use tdrv_guest_tests::{
    errno_name, expect_eq, expect_err, open_device_or_skip,
    raw::{Dev, Errno},
    Tap,
};
use tdrv_uapi::*;

/// Sends `request` with a buffer of `size` bytes (zeroed unless `fill`).
fn send_sized(
    dev: &Dev,
    request: u64,
    size: usize,
    fill: impl Fn(&mut [u8]),
) -> Result<i32, Errno> {
    let mut buf = vec![0u8; size.max(1) + 64];
    fill(&mut buf[..size]);
    // SAFETY: `buf` is a live heap buffer larger than `size`, the size
    // encoded in the request, so the kernel cannot write past it.
    unsafe { dev.ioctl_addr(request_with_size(request, size), buf.as_mut_ptr() as usize) }
}

/// Whether the running kernel has CONFIG_SYNC_FILE: its
/// `sync_file_create` is in /proc/kallsyms (both test kernels have
/// KALLSYMS; without it the answer is unknown, an error).
fn kernel_has_sync_file() -> Result<bool, String> {
    let syms =
        std::fs::read_to_string("/proc/kallsyms").map_err(|e| format!("/proc/kallsyms: {e}"))?;
    if syms.is_empty() {
        return Err("/proc/kallsyms is empty: cannot tell whether the kernel has SYNC_FILE".into());
    }
    Ok(syms
        .lines()
        .any(|l| l.split_whitespace().nth(2) == Some("sync_file_create")))
}

/// Size of the argument struct of each request.
fn arg_size(request: u64) -> usize {
    ((request >> 16) & 0x3fff) as usize
}

fn main() {
    let (dev, _, _) = open_device_or_skip("/dev/tdrv0", None);
    let mut t = Tap::new(14);

    // Every feature bit this module, device and kernel support, and no
    // other: a feature that silently disappears would turn its checks
    // elsewhere into skips. scripts/test compares the "# features:" line
    // with what it expects of each kernel (docs/testing.md).
    t.run(
        "features: exactly those of this module, device kind and kernel",
        || -> Result<(), String> {
            let v = dev.version().map_err(|e| format!("errno {e}"))?;
            let sync_file = kernel_has_sync_file()?;
            let names = [
                (TDRV_FEAT_MMAP, "MMAP", true),
                (TDRV_FEAT_SUBMIT, "SUBMIT", true),
                (TDRV_FEAT_COMPLETION, "COMPLETION", true),
                // The software device completes on the CPU, without an
                // interrupt; edu and sim complete by MSI.
                (TDRV_FEAT_IRQ, "IRQ", v.device_kind != TDRV_DEVICE_SOFT),
                (TDRV_FEAT_ERROR_LATCH, "ERROR_LATCH", true),
                (TDRV_FEAT_DMABUF, "DMABUF", true),
                // uapi/tdrv.h: absent only on kernels without SYNC_FILE.
                (TDRV_FEAT_FENCE_FD, "FENCE_FD", sync_file),
                (TDRV_FEAT_BUF_ID, "BUF_ID", true),
                (TDRV_FEAT_EVENTS, "EVENTS", true),
                // Reservation objects need no SYNC_FILE: every kernel.
                (TDRV_FEAT_IMPLICIT_SYNC, "IMPLICIT_SYNC", true),
                (TDRV_FEAT_SUBMIT_NOTIFY, "SUBMIT_NOTIFY", true),
            ];
            let reported: Vec<&str> = names
                .iter()
                .filter(|(bit, _, _)| v.features & *bit as u64 != 0)
                .map(|(_, n, _)| *n)
                .collect();
            println!("# features: {}", reported.join(" "));
            let mut wrong = Vec::new();
            for (bit, name, want) in names {
                let has = v.features & bit as u64 != 0;
                if has != want {
                    wrong.push(format!(
                        "TDRV_FEAT_{name} {} but should {}",
                        if has { "reported" } else { "missing" },
                        if want { "be there" } else { "not" }
                    ));
                }
            }
            let known = names.iter().fold(0u64, |a, (bit, _, _)| a | *bit as u64);
            if v.features & !known != 0 {
                wrong.push(format!("unknown bits {:#x}", v.features & !known));
            }
            if wrong.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "{} (kernel {} SYNC_FILE)",
                    wrong.join("; "),
                    if sync_file { "with" } else { "without" }
                ))
            }
        },
    );

    t.run(
        "version reports ABI 1, the buffer limit, channels and a known device kind",
        || -> Result<(), String> {
            let v = dev.version().map_err(|e| format!("errno {e}"))?;
            expect_eq("abi_major", v.abi_major, TDRV_ABI_MAJOR)?;
            expect_eq("abi_minor", v.abi_minor, TDRV_ABI_MINOR)?;
            expect_eq(
                "max_buffer_size",
                v.max_buffer_size,
                TDRV_MAX_BUFFER_SIZE as u64,
            )?;
            if v.num_channels == 0 {
                return Err("no channels".into());
            }
            if ![TDRV_DEVICE_SOFT, TDRV_DEVICE_EDU, TDRV_DEVICE_SIM].contains(&v.device_kind) {
                return Err(format!("unknown device kind {}", v.device_kind));
            }
            expect_eq("reserved", v.reserved, [0; 4])
        },
    );

    t.run(
        "every pinned request number is served: a zeroed argument gets its documented answer",
        || -> Result<(), String> {
            // A zeroed argument is valid for the queries and names handle 0,
            // job 0 or fd 0 elsewhere: each request must reach its own
            // argument checks and answer as uapi/tdrv.h says.
            let want: &[(u64, Result<i32, Errno>)] = &[
                (TDRV_IOC_VERSION, Ok(0)),
                // Channel 0 exists on every device.
                (TDRV_IOC_CHANNEL_INFO, Ok(0)),
                // Zero size.
                (TDRV_IOC_ALLOC, Err(libc::EINVAL)),
                // Handle 0 is never a buffer.
                (TDRV_IOC_FREE, Err(libc::ENOENT)),
                (TDRV_IOC_BUF_INFO, Err(libc::ENOENT)),
                // The handle is looked up before the zero size is judged.
                (TDRV_IOC_COPY_IN, Err(libc::ENOENT)),
                (TDRV_IOC_COPY_OUT, Err(libc::ENOENT)),
                (TDRV_IOC_MEMSET, Err(libc::ENOENT)),
                (TDRV_IOC_COPY, Err(libc::EINVAL)),
                // No descriptors.
                (TDRV_IOC_SUBMIT, Err(libc::EINVAL)),
                // Job 0 was never issued.
                (TDRV_IOC_JOB_WAIT, Err(libc::EINVAL)),
                (TDRV_IOC_FENCE_WAIT, Err(libc::EINVAL)),
                (TDRV_IOC_COMPLETION_WAIT, Err(libc::ENOENT)),
                (TDRV_IOC_COMPLETION_RESET, Err(libc::ENOENT)),
                (TDRV_IOC_EXPORT, Err(libc::ENOENT)),
                // fd 0 (the console) is not a dma-buf.
                (TDRV_IOC_IMPORT, Err(libc::EINVAL)),
                // Job 0 was never issued.
                (TDRV_IOC_JOB_NOTIFY, Err(libc::EINVAL)),
            ];
            expect_eq("requests covered", want.len(), ALL_REQUESTS.len())?;
            let mut wrong = Vec::new();
            let mut table = Vec::new();
            for (name, req) in ALL_REQUESTS {
                let got = send_sized(&dev, *req, arg_size(*req), |_| {});
                let expected = want
                    .iter()
                    .find(|(r, _)| r == req)
                    .map(|(_, w)| *w)
                    .ok_or_else(|| format!("{name}: no expected answer"))?;
                let show = |r: Result<i32, Errno>| r.map_or_else(errno_name, |v| format!("ok {v}"));
                table.push(format!("{name}: {}", show(got)));
                if got != expected {
                    wrong.push(format!(
                        "{name}: got {}, want {}",
                        show(got),
                        show(expected)
                    ));
                }
            }
            if wrong.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "{}\nall answers:\n{}",
                    wrong.join("\n"),
                    table.join("\n")
                ))
            }
        },
    );

    t.run(
        "unknown number, magic or direction gives ENOTTY",
        || -> Result<(), String> {
            let alloc = TDRV_IOC_ALLOC;
            expect_err(
                "nr 0x7f",
                send_sized(&dev, (alloc & !0xff) | 0x7f, 56, |_| {}),
                libc::ENOTTY,
            )?;
            expect_err(
                "magic",
                send_sized(&dev, (alloc & !0xff00) | (0x42 << 8), 56, |_| {}),
                libc::ENOTTY,
            )?;
            // ALLOC as _IOW instead of _IOWR.
            let wrong_dir = (alloc & !(3 << 30)) | (1 << 30);
            expect_err(
                "direction",
                send_sized(&dev, wrong_dir, 56, |_| {}),
                libc::ENOTTY,
            )
        },
    );

    t.run(
        "a struct smaller than the ABI's gives EINVAL",
        || -> Result<(), String> {
            for (name, req) in ALL_REQUESTS {
                let r = send_sized(&dev, *req, arg_size(*req) - 1, |_| {});
                expect_err(name, r, libc::EINVAL)?;
            }
            Ok(())
        },
    );

    t.run(
        "a larger struct with a zero tail works like the ABI's and its tail is untouched",
        || -> Result<(), String> {
            // ALLOC: the input is read, the output written, the tail kept.
            let ours = size_of::<tdrv_alloc>();
            let mut buf = vec![0u8; ours + 16];
            buf[..8].copy_from_slice(&4096u64.to_ne_bytes());
            // SAFETY: `buf` is a live heap buffer of the size encoded in the
            // request.
            unsafe {
                dev.ioctl_addr(
                    request_with_size(TDRV_IOC_ALLOC, buf.len()),
                    buf.as_mut_ptr() as usize,
                )
            }
            .map_err(|e| format!("ALLOC with zero tail: errno {e}"))?;
            // SAFETY: `buf` holds at least a `tdrv_alloc`; any bytes are one.
            let a: tdrv_alloc = unsafe { std::ptr::read_unaligned(buf.as_ptr().cast()) };
            expect_eq("tail after ALLOC", &buf[ours..], &[0u8; 16][..])?;
            let info = dev
                .buf_info(a.handle)
                .map_err(|e| format!("BUF_INFO of the new handle: errno {e}"))?;
            expect_eq("size of the buffer", info.size, 4096)?;
            expect_eq("mmap_offset", info.mmap_offset, a.mmap_offset)?;
            dev.free(a.handle).map_err(|e| format!("free: errno {e}"))?;
            // VERSION: the same answer as with the ABI's size, tail kept.
            let ours = size_of::<tdrv_version>();
            let mut buf = vec![0u8; ours + 8];
            // SAFETY: as above.
            unsafe {
                dev.ioctl_addr(
                    request_with_size(TDRV_IOC_VERSION, buf.len()),
                    buf.as_mut_ptr() as usize,
                )
            }
            .map_err(|e| format!("VERSION with zero tail: errno {e}"))?;
            let v = dev.version().map_err(|e| format!("version: errno {e}"))?;
            // SAFETY: `tdrv_version` is plain old data of `ours` bytes.
            let want = unsafe {
                std::slice::from_raw_parts((&v as *const tdrv_version).cast::<u8>(), ours)
            };
            expect_eq("VERSION answer", &buf[..ours], want)?;
            expect_eq("tail after VERSION", &buf[ours..], &[0u8; 8][..])
        },
    );

    // BUF_INFO reads and writes single fields for a struct of this ABI's
    // size, and the whole struct otherwise: the answers must agree, and
    // every out field must be overwritten, whatever it held.
    t.run(
        "BUF_INFO answers alike for this ABI's struct and a larger one",
        || -> Result<(), String> {
            let a = dev
                .alloc(5000, 0)
                .map_err(|e| format!("alloc: errno {e}"))?;
            let ours = size_of::<tdrv_buf_info>();
            let ask = |size: usize| -> Result<Vec<u8>, String> {
                let mut buf = vec![0x5au8; size];
                buf[..8].copy_from_slice(&a.handle.to_ne_bytes());
                // pad, pad2 and reserved must be zero; the rest is output.
                for f in [60..64, 68..ours, ours..size] {
                    buf[f].fill(0);
                }
                // SAFETY: `buf` is a live heap buffer of the size encoded in
                // the request.
                unsafe {
                    dev.ioctl_addr(
                        request_with_size(TDRV_IOC_BUF_INFO, size),
                        buf.as_mut_ptr() as usize,
                    )
                }
                .map_err(|e| format!("BUF_INFO of {size} bytes: errno {e}"))?;
                Ok(buf)
            };
            let exact = ask(ours)?;
            let larger = ask(ours + 16)?;
            expect_eq("same answer", &exact[..], &larger[..ours])?;
            expect_eq("tail untouched", &larger[ours..], &[0u8; 16][..])?;
            let want = dev
                .buf_info(a.handle)
                .map_err(|e| format!("buf_info: errno {e}"))?;
            expect_eq("size", want.size, 5000)?;
            // SAFETY: `tdrv_buf_info` is plain old data of `ours` bytes.
            let want = unsafe {
                std::slice::from_raw_parts((&want as *const tdrv_buf_info).cast::<u8>(), ours)
            };
            expect_eq("as BUF_INFO of a zeroed struct", &exact[..], want)?;
            dev.free(a.handle).map_err(|e| format!("free: errno {e}"))
        },
    );

    t.run(
        "a non-zero unknown tail gives E2BIG",
        || -> Result<(), String> {
            let size = size_of::<tdrv_alloc>() + 16;
            let r = send_sized(&dev, TDRV_IOC_ALLOC, size, |b| {
                b[..8].copy_from_slice(&4096u64.to_ne_bytes());
                b[size - 1] = 1;
            });
            expect_err("ALLOC", r, libc::E2BIG)
        },
    );

    t.run(
        "an absurd struct size gives EINVAL",
        || -> Result<(), String> {
            expect_err(
                "ALLOC 16000 bytes",
                send_sized(&dev, TDRV_IOC_ALLOC, 16000, |_| {}),
                libc::EINVAL,
            )
        },
    );

    t.run(
        "non-zero reserved or padding fields give EINVAL",
        || -> Result<(), String> {
            let a = dev
                .alloc(4096, 0)
                .map_err(|e| format!("alloc: errno {e}"))?;
            let h = a.handle;
            let mut alloc = tdrv_alloc {
                size: 4096,
                flags: 1,
                ..Default::default()
            };
            expect_err(
                "alloc.flags",
                dev.ioctl(TDRV_IOC_ALLOC, &mut alloc),
                libc::EINVAL,
            )?;
            let mut alloc = tdrv_alloc {
                size: 4096,
                reserved: [0, 1],
                ..Default::default()
            };
            expect_err(
                "alloc.reserved",
                dev.ioctl(TDRV_IOC_ALLOC, &mut alloc),
                libc::EINVAL,
            )?;
            let mut alloc = tdrv_alloc {
                size: 4096,
                handle: 5,
                ..Default::default()
            };
            expect_err(
                "alloc.handle (out field)",
                dev.ioctl(TDRV_IOC_ALLOC, &mut alloc),
                libc::EINVAL,
            )?;
            let mut ci = tdrv_channel_info {
                pad: 1,
                ..Default::default()
            };
            expect_err(
                "channel_info.pad",
                dev.ioctl(TDRV_IOC_CHANNEL_INFO, &mut ci),
                libc::EINVAL,
            )?;
            let mut f = tdrv_free {
                handle: h,
                reserved: 1,
            };
            expect_err(
                "free.reserved",
                dev.ioctl(TDRV_IOC_FREE, &mut f),
                libc::EINVAL,
            )?;
            let mut bi = tdrv_buf_info {
                handle: h,
                pad: 1,
                ..Default::default()
            };
            expect_err(
                "buf_info.pad",
                dev.ioctl(TDRV_IOC_BUF_INFO, &mut bi),
                libc::EINVAL,
            )?;
            // `buf_id` (ABI 1.3, was `reserved`) is output only: a stale
            // one on input is ignored and replaced by the buffer's id.
            let mut fresh = tdrv_buf_info {
                handle: h,
                ..Default::default()
            };
            dev.ioctl(TDRV_IOC_BUF_INFO, &mut fresh)
                .map_err(|e| format!("buf_info: errno {e}"))?;
            if fresh.buf_id == 0 {
                return Err("buf_info.buf_id is 0".into());
            }
            let mut bi = tdrv_buf_info {
                handle: h,
                buf_id: 1 << 63,
                ..Default::default()
            };
            dev.ioctl(TDRV_IOC_BUF_INFO, &mut bi)
                .map_err(|e| format!("buf_info with a stale buf_id: errno {e}"))?;
            expect_eq("buf_id with a stale one on input", bi.buf_id, fresh.buf_id)?;
            let mut bi = tdrv_buf_info {
                handle: h,
                pad2: 1,
                ..Default::default()
            };
            expect_err(
                "buf_info.pad2",
                dev.ioctl(TDRV_IOC_BUF_INFO, &mut bi),
                libc::EINVAL,
            )?;
            // `error` is output only: a reused struct may carry one.
            let mut bi = tdrv_buf_info {
                handle: h,
                error: -5,
                ..Default::default()
            };
            dev.ioctl(TDRV_IOC_BUF_INFO, &mut bi)
                .map_err(|e| format!("buf_info with a stale error: errno {e}"))?;
            expect_eq("error latch of a fresh buffer", bi.error, 0)?;
            let data = [0u8; 8];
            let mut x = tdrv_xfer {
                handle: h,
                size: 8,
                user_ptr: data.as_ptr() as u64,
                reserved: [0, 1],
                ..Default::default()
            };
            expect_err(
                "copy_in.reserved",
                dev.ioctl(TDRV_IOC_COPY_IN, &mut x),
                libc::EINVAL,
            )?;
            expect_err(
                "copy_out.reserved",
                dev.ioctl(TDRV_IOC_COPY_OUT, &mut x),
                libc::EINVAL,
            )?;
            let mut m = tdrv_memset {
                handle: h,
                size: 8,
                pad: 1,
                ..Default::default()
            };
            expect_err(
                "memset.pad",
                dev.ioctl(TDRV_IOC_MEMSET, &mut m),
                libc::EINVAL,
            )?;
            let mut m = tdrv_memset {
                handle: h,
                size: 8,
                value: 256,
                ..Default::default()
            };
            expect_err(
                "memset.value 256",
                dev.ioctl(TDRV_IOC_MEMSET, &mut m),
                libc::EINVAL,
            )?;
            let desc = tdrv_copy_desc {
                src_handle: h,
                dst_handle: h,
                size: 8,
                dst_offset: 8,
                ..Default::default()
            };
            let mut c = tdrv_copy {
                desc,
                reserved: [1, 0],
            };
            expect_err(
                "copy.reserved",
                dev.ioctl(TDRV_IOC_COPY, &mut c),
                libc::EINVAL,
            )?;
            let descs = [desc];
            let base = tdrv_submit {
                descs: descs.as_ptr() as u64,
                desc_count: 1,
                desc_size: size_of::<tdrv_copy_desc>() as u32,
                ..Default::default()
            };
            for (field, s) in [
                (
                    "flags",
                    tdrv_submit {
                        flags: 1 << 7,
                        ..base
                    },
                ),
                ("pad", tdrv_submit { pad: 1, ..base }),
                ("job_id (out field)", tdrv_submit { job_id: 1, ..base }),
                (
                    "reserved",
                    tdrv_submit {
                        reserved: [0, 1],
                        ..base
                    },
                ),
            ] {
                let mut s = s;
                expect_err(
                    &format!("submit.{field}"),
                    dev.ioctl(TDRV_IOC_SUBMIT, &mut s),
                    libc::EINVAL,
                )?;
            }
            let mut jw = tdrv_job_wait {
                job_id: 1,
                reserved: [1, 0],
                ..Default::default()
            };
            expect_err(
                "job_wait.reserved",
                dev.ioctl(TDRV_IOC_JOB_WAIT, &mut jw),
                libc::EINVAL,
            )?;
            let mut fw = tdrv_fence_wait {
                handle: h,
                kind: TDRV_FENCE_ALL,
                pad: 1,
                ..Default::default()
            };
            expect_err(
                "fence_wait.pad",
                dev.ioctl(TDRV_IOC_FENCE_WAIT, &mut fw),
                libc::EINVAL,
            )?;
            let mut cw = tdrv_completion_wait {
                handle: h,
                reserved: [0, 1],
                ..Default::default()
            };
            expect_err(
                "completion_wait.reserved",
                dev.ioctl(TDRV_IOC_COMPLETION_WAIT, &mut cw),
                libc::EINVAL,
            )?;
            let mut cr = tdrv_completion_reset {
                handle: h,
                reserved: 1,
            };
            expect_err(
                "completion_reset.reserved",
                dev.ioctl(TDRV_IOC_COMPLETION_RESET, &mut cr),
                libc::EINVAL,
            )?;
            dev.free(h).map_err(|e| format!("free: errno {e}"))
        },
    );

    t.run(
        "an unreadable argument pointer gives EFAULT",
        || -> Result<(), String> {
            for (name, req) in ALL_REQUESTS {
                // SAFETY: address 8 is never mapped; nothing of ours is there.
                let r = unsafe { dev.ioctl_addr(*req, 8) };
                expect_err(name, r, libc::EFAULT)?;
            }
            Ok(())
        },
    );

    t.run(
        "a read-only argument gives EFAULT for output requests",
        || -> Result<(), String> {
            // VERSION writes its result: a read-only page must fail cleanly.
            let page = tdrv_guest_tests::raw::page_size();
            // SAFETY: a fresh private read-only anonymous mapping.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    page,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err("mmap failed".into());
            }
            // SAFETY: the page is ours; the kernel may only fail to write it.
            let r = unsafe { dev.ioctl_addr(TDRV_IOC_VERSION, p as usize) };
            // SAFETY: unmapping the mapping made above.
            unsafe { libc::munmap(p, page) };
            expect_err("VERSION into read-only page", r, libc::EFAULT)
        },
    );

    t.run(
        "channel info describes every channel",
        || -> Result<(), String> {
            let v = dev.version().map_err(|e| format!("errno {e}"))?;
            for ch in 0..v.num_channels {
                let c = dev
                    .channel_info(ch)
                    .map_err(|e| format!("channel {ch}: errno {e}"))?;
                if c.limit_bytes == 0 || c.used_bytes > c.limit_bytes || c.peak_bytes < c.used_bytes
                {
                    return Err(format!("channel {ch}: inconsistent {c:?}"));
                }
            }
            expect_err(
                "channel past the last",
                dev.channel_info(v.num_channels).map(|_| 0),
                libc::EINVAL,
            )
        },
    );

    t.run(
        "an ioctl on a non-tdrv request type is refused",
        || -> Result<(), String> {
            // TCGETS on our node: a tty ioctl must not be misread as ours.
            let mut buf = [0u8; 64];
            // SAFETY: `buf` is larger than struct termios.
            let r = unsafe { dev.ioctl_addr(libc::TCGETS, buf.as_mut_ptr() as usize) };
            expect_err("TCGETS", r, libc::ENOTTY)
        },
    );

    t.finish();
}
