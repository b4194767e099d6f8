//! Implicit synchronisation (docs/sharing.md, "Implicit
//! synchronisation"): tdrv jobs in the reservation objects of their
//! buffers' dma-bufs. poll(2) of a tdrv export waits for the jobs that use
//! it (on every kernel); a vgem write fence holds a tdrv job reading the
//! vgem buffer (test kernel: DRM_VGEM); DMA_BUF_IOCTL_EXPORT_SYNC_FILE and
//! IMPORT_SYNC_FILE order tdrv jobs with other drivers (CONFIG_SYNC_FILE;
//! Debian's cloud kernel has none and skips them with that reason).
//!
//! Jobs are held where a check needs one in flight: by the engine hold of
//! debugfs `inject` (tdrv's own jobs) or by a foreign fence (the job
//! under test). "Not run yet" is checked by the job's state and by data
//! written after submission, never by time.
//!
//! usage: isync /dev/tdrvN

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use tdrv_guest_tests::{
    desc, dmabuf, expect_eq, ok, open_device_or_skip,
    raw::{errno, map_fd, Dev, Errno},
    sync::{file_info, poll_in, Timeline},
    Hold, Tap,
};
use tdrv_uapi::*;

type R = Result<(), String>;

const TESTS: usize = 11;
const SIZE: u64 = 4096;
/// Generous bound that only turns a hang into a failure.
const WAIT_MS: i32 = 60_000;

/// `DMA_BUF_IOCTL_EXPORT_SYNC_FILE` = `_IOWR('b', 2, struct dma_buf_export_sync_file)`.
const DMA_BUF_IOCTL_EXPORT_SYNC_FILE: u64 = 0xC008_6202;
/// `DMA_BUF_IOCTL_IMPORT_SYNC_FILE` = `_IOW('b', 3, struct dma_buf_import_sync_file)`.
const DMA_BUF_IOCTL_IMPORT_SYNC_FILE: u64 = 0x4008_6203;
const DMA_BUF_SYNC_READ: u32 = 1;
const DMA_BUF_SYNC_WRITE: u32 = 2;

/// `struct dma_buf_export_sync_file` and `struct dma_buf_import_sync_file`.
#[repr(C)]
struct SyncFileArg {
    flags: u32,
    fd: i32,
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ seed)
        .collect()
}

/// The events among POLLIN and POLLOUT that `fd` reports within
/// `timeout_ms`.
fn poll_events(fd: RawFd, events: i16, timeout_ms: i32) -> Result<i16, String> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if r < 0 {
        return Err(format!("poll: errno {}", errno()));
    }
    Ok(p.revents & (libc::POLLIN | libc::POLLOUT | libc::POLLERR))
}

/// Waits until `fd` reports all of `events` (at most `WAIT_MS`).
fn poll_until(fd: RawFd, events: i16) -> R {
    // Each poll returns once any one requested event is there.
    for want in [libc::POLLIN, libc::POLLOUT] {
        if events & want != 0 {
            let got = poll_events(fd, want, WAIT_MS)?;
            if got & want == 0 {
                return Err(format!(
                    "event {want:#x} not reported within {WAIT_MS} ms (got {got:#x})"
                ));
            }
        }
    }
    Ok(())
}

fn job_state(dev: &Dev, id: u64) -> Result<(u32, i32), String> {
    ok("job_wait (poll)", dev.job_wait(id, 0))
}

fn job_end(dev: &Dev, id: u64) -> Result<(u32, i32), String> {
    ok("job_wait", dev.job_wait(id, i64::from(WAIT_MS) * 1000))
}

fn read_all(dev: &Dev, handle: u64) -> Result<Vec<u8>, String> {
    let mut out = vec![0u8; SIZE as usize];
    ok("copy_out", dev.copy_out(handle, 0, &mut out))?;
    Ok(out)
}

fn export_sync_file(dmabuf: RawFd, flags: u32) -> Result<OwnedFd, Errno> {
    let mut a = SyncFileArg { flags, fd: -1 };
    // SAFETY: `a` is the 8-byte argument the request encodes.
    if unsafe { libc::ioctl(dmabuf, DMA_BUF_IOCTL_EXPORT_SYNC_FILE as _, &mut a) } < 0 {
        return Err(errno());
    }
    // SAFETY: the dma-buf core installed this descriptor for us.
    Ok(unsafe { OwnedFd::from_raw_fd(a.fd) })
}

fn import_sync_file(dmabuf: RawFd, flags: u32, fence: RawFd) -> Result<(), Errno> {
    let mut a = SyncFileArg { flags, fd: fence };
    // SAFETY: `a` is the 8-byte argument the request encodes.
    if unsafe { libc::ioctl(dmabuf, DMA_BUF_IOCTL_IMPORT_SYNC_FILE as _, &mut a) } < 0 {
        return Err(errno());
    }
    Ok(())
}

/// Why DMA_BUF_IOCTL_{EXPORT,IMPORT}_SYNC_FILE cannot be used here, if
/// they cannot: they exist only with CONFIG_SYNC_FILE (ENOTTY without).
fn sync_file_missing(dmabuf: RawFd) -> Option<String> {
    match export_sync_file(dmabuf, DMA_BUF_SYNC_READ) {
        Ok(_) => None,
        Err(libc::ENOTTY) => Some(
            "no CONFIG_SYNC_FILE: DMA_BUF_IOCTL_EXPORT_SYNC_FILE is ENOTTY on this kernel".into(),
        ),
        Err(e) => Some(format!("DMA_BUF_IOCTL_EXPORT_SYNC_FILE: errno {e}")),
    }
}

/// vgem (DRM_VGEM): a dumb buffer, its dma-buf, and fences on it.
mod vgem {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use tdrv_guest_tests::raw::{errno, Errno};

    const DRM_IOCTL_VERSION: u64 = 0xC040_6400;
    const DRM_IOCTL_MODE_CREATE_DUMB: u64 = 0xC020_64B2;
    const DRM_IOCTL_PRIME_HANDLE_TO_FD: u64 = 0xC00C_642D;
    const DRM_IOCTL_VGEM_FENCE_ATTACH: u64 = 0xC010_6441;
    const DRM_IOCTL_VGEM_FENCE_SIGNAL: u64 = 0x4008_6442;
    const VGEM_FENCE_WRITE: u32 = 1;
    const DRM_RDWR: u32 = libc::O_RDWR as u32;

    #[repr(C)]
    struct Version {
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
    struct CreateDumb {
        height: u32,
        width: u32,
        bpp: u32,
        flags: u32,
        handle: u32,
        pitch: u32,
        size: u64,
    }

    #[repr(C)]
    #[derive(Default)]
    struct PrimeHandle {
        handle: u32,
        flags: u32,
        fd: i32,
    }

    #[repr(C)]
    #[derive(Default)]
    struct FenceAttach {
        handle: u32,
        flags: u32,
        out_fence: u32,
        pad: u32,
    }

    #[repr(C)]
    #[derive(Default)]
    struct FenceSignal {
        fence: u32,
        flags: u32,
    }

    fn ioctl<T>(fd: i32, req: u64, arg: &mut T) -> Result<(), Errno> {
        // SAFETY: `arg` is the struct the request encodes.
        if unsafe { libc::ioctl(fd, req as _, arg as *mut T) } < 0 {
            Err(errno())
        } else {
            Ok(())
        }
    }

    /// The vgem device: the DRM card whose driver is "vgem".
    pub struct Card(OwnedFd);

    impl Card {
        /// Opens vgem's card; the reason if there is none.
        pub fn open() -> Result<Card, String> {
            let dir = std::fs::read_dir("/dev/dri")
                .map_err(|e| format!("no /dev/dri ({e}): the kernel has no DRM (DRM_VGEM)"))?;
            for ent in dir.flatten() {
                let name = ent.file_name().to_string_lossy().into_owned();
                if !name.starts_with("card") {
                    continue;
                }
                let path = std::ffi::CString::new(format!("/dev/dri/{name}")).unwrap_or_default();
                // SAFETY: a NUL-terminated path.
                let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
                if fd < 0 {
                    continue;
                }
                // SAFETY: a descriptor open(2) just returned.
                let card = Card(unsafe { OwnedFd::from_raw_fd(fd) });
                let mut buf = [0u8; 32];
                let mut v = Version {
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
                if ioctl(fd, DRM_IOCTL_VERSION, &mut v).is_ok()
                    && &buf[..v.name_len.min(buf.len())] == b"vgem"
                {
                    return Ok(card);
                }
            }
            Err("no vgem card in /dev/dri (the kernel has no DRM_VGEM)".into())
        }

        /// A dumb buffer of `size` bytes (a multiple of 4 KiB): its handle.
        pub fn create(&self, size: u64) -> Result<u32, Errno> {
            let mut c = CreateDumb {
                height: (size / 4096) as u32,
                width: 1024,
                bpp: 32,
                ..Default::default()
            };
            ioctl(self.0.as_raw_fd(), DRM_IOCTL_MODE_CREATE_DUMB, &mut c)?;
            Ok(c.handle)
        }

        /// The buffer as a dma-buf fd (read-write).
        pub fn export(&self, handle: u32) -> Result<OwnedFd, Errno> {
            let mut p = PrimeHandle {
                handle,
                flags: DRM_RDWR | libc::O_CLOEXEC as u32,
                fd: -1,
            };
            ioctl(self.0.as_raw_fd(), DRM_IOCTL_PRIME_HANDLE_TO_FD, &mut p)?;
            // SAFETY: the driver installed this descriptor for us.
            Ok(unsafe { OwnedFd::from_raw_fd(p.fd) })
        }

        /// Attaches an unsignalled write fence to the buffer's reservation
        /// object; its id. (vgem signals it by itself after 10 s.)
        pub fn attach_write_fence(&self, handle: u32) -> Result<u32, Errno> {
            let mut a = FenceAttach {
                handle,
                flags: VGEM_FENCE_WRITE,
                ..Default::default()
            };
            ioctl(self.0.as_raw_fd(), DRM_IOCTL_VGEM_FENCE_ATTACH, &mut a)?;
            Ok(a.out_fence)
        }

        pub fn signal(&self, fence: u32) -> Result<(), Errno> {
            let mut s = FenceSignal { fence, flags: 0 };
            ioctl(self.0.as_raw_fd(), DRM_IOCTL_VGEM_FENCE_SIGNAL, &mut s)
        }
    }
}

fn main() {
    let (dev, path, version) = open_device_or_skip("/dev/tdrv0", None);
    let edu = version.device_kind == TDRV_DEVICE_EDU;
    if version.features & u64::from(TDRV_FEAT_IMPLICIT_SYNC) == 0 {
        tdrv_guest_tests::skip_all(
            "the driver does not report TDRV_FEAT_IMPLICIT_SYNC (ABI < 1.5)",
        );
    }
    let mut t = Tap::new(TESTS);
    let hold_missing = Hold::unavailable(&path);

    // 1. poll(2) of an export that a held job writes.
    let name = "poll of a tdrv export reports POLLIN/POLLOUT only after the job writing it ends";
    match &hold_missing {
        Some(why) => t.skip(name, &format!("cannot hold the engine: {why}")),
        None => t.run(name, || -> R {
            let a = ok("alloc", dev.alloc(SIZE, 0))?;
            let b = ok("alloc", dev.alloc(SIZE, 0))?;
            let data = pattern(SIZE as usize, 1);
            ok("copy_in", dev.copy_in(a.handle, 0, &data))?;
            let fd = ok("export", dev.export(b.handle))?;
            let both = libc::POLLIN | libc::POLLOUT;
            expect_eq("idle export", poll_events(fd.as_raw_fd(), both, 0)?, both)?;
            let id = {
                let _hold = Hold::new(&path)?;
                let id = ok(
                    "submit",
                    dev.submit(&[desc(a.handle, 0, b.handle, 0, SIZE)]),
                )?;
                expect_eq(
                    "job while held",
                    job_state(&dev, id)?,
                    (TDRV_JOB_PENDING, 0),
                )?;
                expect_eq(
                    "poll while the job writes",
                    poll_events(fd.as_raw_fd(), both, 0)?,
                    0,
                )?;
                id
            };
            poll_until(fd.as_raw_fd(), both)?;
            // The fence signals after the outcome reached JOB_WAIT.
            expect_eq(
                "job when poll reports",
                job_state(&dev, id)?,
                (TDRV_JOB_DONE, 0),
            )?;
            expect_eq("bytes written", read_all(&dev, b.handle)? == data, true)
        }),
    }

    // 2. A job that only reads the export: readers may go on.
    let name = "poll of a tdrv export a held job reads: POLLIN at once, POLLOUT after the job";
    match &hold_missing {
        Some(why) => t.skip(name, &format!("cannot hold the engine: {why}")),
        None => t.run(name, || -> R {
            let a = ok("alloc", dev.alloc(SIZE, 0))?;
            let b = ok("alloc", dev.alloc(SIZE, 0))?;
            let fd = ok("export", dev.export(a.handle))?;
            let id = {
                let _hold = Hold::new(&path)?;
                let id = ok(
                    "submit",
                    dev.submit(&[desc(a.handle, 0, b.handle, 0, SIZE)]),
                )?;
                expect_eq(
                    "poll while the job reads",
                    poll_events(fd.as_raw_fd(), libc::POLLIN | libc::POLLOUT, 0)?,
                    libc::POLLIN,
                )?;
                id
            };
            poll_until(fd.as_raw_fd(), libc::POLLOUT)?;
            expect_eq(
                "job when poll reports",
                job_state(&dev, id)?,
                (TDRV_JOB_DONE, 0),
            )
        }),
    }

    // 3. Two files of this device chain jobs through one export: no wait
    //    on a queued job of the same engine, bytes in submission order.
    t.run(
        "jobs of two files through one export run in submission order",
        || -> R {
            let other = ok("open", Dev::open(&path))?;
            let a = ok("alloc", dev.alloc(SIZE, 0))?;
            let b = ok("alloc", dev.alloc(SIZE, 0))?;
            let first = pattern(SIZE as usize, 3);
            ok("copy_in", dev.copy_in(a.handle, 0, &first))?;
            let fd = ok("export", dev.export(b.handle))?;
            let imp = ok("import", other.import(fd.as_raw_fd(), 0))?;
            let c = ok("alloc", other.alloc(SIZE, 0))?;
            let id1 = ok(
                "submit a -> b",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, SIZE)]),
            )?;
            let id2 = ok(
                "submit b -> c",
                other.submit(&[desc(imp.handle, 0, c.handle, 0, SIZE)]),
            )?;
            expect_eq("second job", job_end(&other, id2)?, (TDRV_JOB_DONE, 0))?;
            expect_eq("first job", job_end(&dev, id1)?, (TDRV_JOB_DONE, 0))?;
            expect_eq(
                "c holds what the first job wrote",
                read_all(&other, c.handle)? == first,
                true,
            )?;
            poll_until(fd.as_raw_fd(), libc::POLLIN | libc::POLLOUT)
        },
    );

    // 4. vgem's write fence holds a tdrv job that reads the vgem buffer.
    let name =
        "a vgem write fence holds a tdrv job reading the vgem buffer until VGEM_FENCE_SIGNAL";
    match vgem::Card::open() {
        Err(why) => t.skip(name, &why),
        Ok(card) => {
            let r = (|| -> Result<Option<String>, String> {
                let bo = ok("vgem create", card.create(SIZE))?;
                let dmabuf = ok("vgem export", card.export(bo))?;
                let mut map = ok(
                    "mmap of the vgem dma-buf",
                    map_fd(dmabuf.as_raw_fd(), 0, SIZE as usize),
                )?;
                let before = pattern(SIZE as usize, 4);
                map.as_mut_slice().copy_from_slice(&before);
                let imp = match dev.import(dmabuf.as_raw_fd(), 0) {
                    Ok(i) => i,
                    // edu maps the pages for its DMA: beyond its mask the
                    // import fails (EIO), as documented for IMPORT.
                    Err(libc::EIO) if edu => {
                        return Ok(Some(
                            "vgem's pages are beyond edu's DMA mask (IMPORT: EIO)".into(),
                        ))
                    }
                    Err(e) => return Err(format!("import of the vgem buffer: errno {e}")),
                };
                let dst = ok("alloc", dev.alloc(SIZE, 0))?;
                let fence = ok("VGEM_FENCE_ATTACH", card.attach_write_fence(bo))?;
                let id = ok(
                    "submit",
                    dev.submit(&[desc(imp.handle, 0, dst.handle, 0, SIZE)]),
                )?;
                // Neither sleep nor poll until the signal: vgem signals by
                // itself after 10 s, and an idle -icount guest skips to it.
                let state = job_state(&dev, id)?;
                let after = pattern(SIZE as usize, 5);
                map.as_mut_slice().copy_from_slice(&after);
                ok("VGEM_FENCE_SIGNAL", card.signal(fence))?;
                expect_eq("job before the signal", state, (TDRV_JOB_PENDING, 0))?;
                expect_eq(
                    "job after the signal",
                    job_end(&dev, id)?,
                    (TDRV_JOB_DONE, 0),
                )?;
                // The job read the bytes written before the signal, not
                // those there at SUBMIT.
                expect_eq(
                    "bytes the job copied",
                    read_all(&dev, dst.handle)? == after,
                    true,
                )?;
                Ok(None)
            })();
            match r {
                Ok(None) => t.check(name, true),
                Ok(Some(why)) => t.skip(name, &why),
                Err(e) => t.check(name, Err::<(), _>(e)),
            }
        }
    }

    // 5-7: the sync_file ioctls of the dma-buf core.
    let probe_buf =
        ok("alloc", dev.alloc(SIZE, 0)).and_then(|p| ok("export", dev.export(p.handle)));
    let missing = match &probe_buf {
        Ok(fd) => sync_file_missing(fd.as_raw_fd()),
        Err(e) => Some(e.clone()),
    };

    let name = "EXPORT_SYNC_FILE of an export a held job writes signals when the job ends";
    match (&missing, &hold_missing) {
        (Some(why), _) | (None, Some(why)) => t.skip(name, why),
        (None, None) => t.run(name, || -> R {
            let a = ok("alloc", dev.alloc(SIZE, 0))?;
            let b = ok("alloc", dev.alloc(SIZE, 0))?;
            let fd = ok("export", dev.export(b.handle))?;
            let (id, sync) = {
                let _hold = Hold::new(&path)?;
                let id = ok(
                    "submit",
                    dev.submit(&[desc(a.handle, 0, b.handle, 0, SIZE)]),
                )?;
                let sync = ok(
                    "EXPORT_SYNC_FILE",
                    export_sync_file(fd.as_raw_fd(), DMA_BUF_SYNC_READ),
                )?;
                let st = ok("SYNC_IOC_FILE_INFO", file_info(sync.as_raw_fd()))?;
                expect_eq("sync_file status while the job is held", st.status, 0)?;
                expect_eq(
                    "job while held",
                    job_state(&dev, id)?,
                    (TDRV_JOB_PENDING, 0),
                )?;
                (id, sync)
            };
            expect_eq(
                "sync_file signals",
                ok("poll", poll_in(sync.as_raw_fd(), WAIT_MS))?,
                true,
            )?;
            let st = ok("SYNC_IOC_FILE_INFO", file_info(sync.as_raw_fd()))?;
            expect_eq("sync_file status", st.status, 1)?;
            expect_eq(
                "job when the sync_file signalled",
                job_state(&dev, id)?,
                (TDRV_JOB_DONE, 0),
            )
        }),
    }

    let sw = |t: &mut Tap, name: &str, body: &dyn Fn(&Timeline) -> R| match (
        &missing,
        Timeline::new(),
    ) {
        (Some(why), _) => t.skip(name, why),
        (None, Ok(tl)) => t.run(name, || body(&tl)),
        (None, Err(e)) => t.skip(
            name,
            &format!("no sw_sync timeline (CONFIG_SW_SYNC, debugfs): errno {e}"),
        ),
    };

    sw(
        &mut t,
        "IMPORT_SYNC_FILE of an unsignalled sw_sync fence holds the next tdrv job",
        &|tl| -> R {
            let a = ok("alloc", dev.alloc(SIZE, 0))?;
            let b = ok("alloc", dev.alloc(SIZE, 0))?;
            let fd = ok("export", dev.export(a.handle))?;
            let mut map = ok(
                "mmap of the export",
                map_fd(fd.as_raw_fd(), 0, SIZE as usize),
            )?;
            map.as_mut_slice()
                .copy_from_slice(&pattern(SIZE as usize, 6));
            let gate = ok("sw_sync fence", tl.fence(1))?;
            ok(
                "IMPORT_SYNC_FILE",
                import_sync_file(fd.as_raw_fd(), DMA_BUF_SYNC_WRITE, gate.as_raw_fd()),
            )?;
            let id = ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, SIZE)]),
            )?;
            let state = job_state(&dev, id)?;
            let after = pattern(SIZE as usize, 7);
            map.as_mut_slice().copy_from_slice(&after);
            ok("sw_sync inc", tl.inc(1))?;
            expect_eq(
                "job before the fence signalled",
                state,
                (TDRV_JOB_PENDING, 0),
            )?;
            expect_eq("job after", job_end(&dev, id)?, (TDRV_JOB_DONE, 0))?;
            expect_eq(
                "bytes the job copied",
                read_all(&dev, b.handle)? == after,
                true,
            )
        },
    );

    sw(
        &mut t,
        "an implicit fence that fails orders the job but does not fail it",
        &|_tl| -> R {
            let a = ok("alloc", dev.alloc(SIZE, 0))?;
            let b = ok("alloc", dev.alloc(SIZE, 0))?;
            let fd = ok("export", dev.export(b.handle))?;
            // A timeline of its own: closing it signals its fence with
            // ENOENT.
            let tl2 = ok("sw_sync timeline", Timeline::new())?;
            let gate = ok("sw_sync fence", tl2.fence(1))?;
            ok(
                "IMPORT_SYNC_FILE",
                import_sync_file(fd.as_raw_fd(), DMA_BUF_SYNC_READ, gate.as_raw_fd()),
            )?;
            let id = ok(
                "submit",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, SIZE)]),
            )?;
            expect_eq(
                "job while the fence is pending",
                job_state(&dev, id)?,
                (TDRV_JOB_PENDING, 0),
            )?;
            drop(tl2);
            let st = ok("SYNC_IOC_FILE_INFO", file_info(gate.as_raw_fd()))?;
            expect_eq("the fence failed", st.status, -libc::ENOENT)?;
            expect_eq(
                "job after the fence ended",
                job_end(&dev, id)?,
                (TDRV_JOB_DONE, 0),
            )
        },
    );

    sw(
        &mut t,
        "a job waiting for a foreign fence holds another file's job that reads what it writes",
        &|tl| -> R {
            let other = ok("open", Dev::open(&path))?;
            let a = ok("alloc", dev.alloc(SIZE, 0))?;
            let b = ok("alloc", dev.alloc(SIZE, 0))?;
            let fd_a = ok("export a", dev.export(a.handle))?;
            let fd_b = ok("export b", dev.export(b.handle))?;
            let mut map = ok("mmap of a", map_fd(fd_a.as_raw_fd(), 0, SIZE as usize))?;
            map.as_mut_slice()
                .copy_from_slice(&pattern(SIZE as usize, 8));
            let gate = ok("sw_sync fence", tl.fence(1))?;
            ok(
                "IMPORT_SYNC_FILE",
                import_sync_file(fd_a.as_raw_fd(), DMA_BUF_SYNC_WRITE, gate.as_raw_fd()),
            )?;
            let imp = ok("import b", other.import(fd_b.as_raw_fd(), 0))?;
            let c = ok("alloc", other.alloc(SIZE, 0))?;
            let id1 = ok(
                "submit a -> b",
                dev.submit(&[desc(a.handle, 0, b.handle, 0, SIZE)]),
            )?;
            let id2 = ok(
                "submit b -> c",
                other.submit(&[desc(imp.handle, 0, c.handle, 0, SIZE)]),
            )?;
            let states = (job_state(&dev, id1)?, job_state(&other, id2)?);
            let after = pattern(SIZE as usize, 9);
            map.as_mut_slice().copy_from_slice(&after);
            ok("sw_sync inc", tl.inc(1))?;
            expect_eq(
                "both jobs before the fence signalled",
                states,
                ((TDRV_JOB_PENDING, 0), (TDRV_JOB_PENDING, 0)),
            )?;
            expect_eq("second job", job_end(&other, id2)?, (TDRV_JOB_DONE, 0))?;
            expect_eq("first job", job_end(&dev, id1)?, (TDRV_JOB_DONE, 0))?;
            expect_eq(
                "c holds what the first job wrote",
                read_all(&other, c.handle)? == after,
                true,
            )
        },
    );

    sw(
        &mut t,
        "closing a file ends its job held by an implicit fence: ECANCELED on the job's fence",
        &|tl| -> R {
            let other = ok("open", Dev::open(&path))?;
            let a = ok("alloc", other.alloc(SIZE, 0))?;
            let b = ok("alloc", other.alloc(SIZE, 0))?;
            let fd = ok("export", other.export(b.handle))?;
            let gate = ok("sw_sync fence", tl.fence(1))?;
            ok(
                "IMPORT_SYNC_FILE",
                import_sync_file(fd.as_raw_fd(), DMA_BUF_SYNC_WRITE, gate.as_raw_fd()),
            )?;
            let (id, out) = ok(
                "submit with an out-fence",
                other.submit_fences(&[desc(a.handle, 0, b.handle, 0, SIZE)], &[], true),
            )?;
            if out < 0 {
                return Err(format!("no out-fence fd (got {out})"));
            }
            // SAFETY: the driver just installed this descriptor for us.
            let out = unsafe { OwnedFd::from_raw_fd(out) };
            expect_eq(
                "job while the fence is pending",
                job_state(&other, id)?,
                (TDRV_JOB_PENDING, 0),
            )?;
            drop(other);
            expect_eq(
                "the job's fence signals",
                ok("poll", poll_in(out.as_raw_fd(), WAIT_MS))?,
                true,
            )?;
            let st = ok("SYNC_IOC_FILE_INFO", file_info(out.as_raw_fd()))?;
            expect_eq("the job's fence error", st.status, -libc::ECANCELED)?;
            // The export (alive through its fd) still has the foreign
            // fence: not writable until it signals.
            expect_eq(
                "poll with the foreign fence pending",
                poll_events(fd.as_raw_fd(), libc::POLLOUT, 0)?,
                0,
            )?;
            ok("sw_sync inc", tl.inc(1))?;
            poll_until(fd.as_raw_fd(), libc::POLLIN | libc::POLLOUT)
        },
    );

    // Two threads lock the same two reservation objects in opposite
    // orders (a -> b and b -> a) over and over: the ww mutex backoff must
    // neither deadlock nor lose a job (lockdep watches the test kernel).
    t.run(
        "concurrent jobs on two exports in opposite directions all complete",
        || -> R {
            let _guard = tdrv_guest_tests::HangGuard::arm("opposite-order jobs", 300);
            let a = ok("alloc", dev.alloc(SIZE, 0))?;
            let b = ok("alloc", dev.alloc(SIZE, 0))?;
            let fd_a = ok("export a", dev.export(a.handle))?;
            let fd_b = ok("export b", dev.export(b.handle))?;
            let rounds = if edu { 10 } else { 200 };
            let run = |from_a: bool| -> R {
                let f = ok("open", Dev::open(&path))?;
                let ia = ok("import a", f.import(fd_a.as_raw_fd(), 0))?.handle;
                let ib = ok("import b", f.import(fd_b.as_raw_fd(), 0))?.handle;
                let (src, dst) = if from_a { (ia, ib) } else { (ib, ia) };
                for i in 0..rounds {
                    let id = ok("submit", f.submit(&[desc(src, 0, dst, 0, SIZE)]))?;
                    let st = job_end(&f, id)?;
                    if st != (TDRV_JOB_DONE, 0) {
                        return Err(format!("round {i}: job ended {st:?}"));
                    }
                }
                Ok(())
            };
            let (r1, r2) = std::thread::scope(|sc| {
                let h1 = sc.spawn(|| run(true));
                let h2 = sc.spawn(|| run(false));
                (h1.join(), h2.join())
            });
            r1.map_err(|_| "thread a -> b panicked".to_string())??;
            r2.map_err(|_| "thread b -> a panicked".to_string())??;
            poll_until(fd_a.as_raw_fd(), libc::POLLIN | libc::POLLOUT)?;
            poll_until(fd_b.as_raw_fd(), libc::POLLIN | libc::POLLOUT)
        },
    );

    // The last check unloads the module: no file of it may stay open.
    drop(probe_buf);
    drop(dev);
    let name =
        "tdrv fences in a foreign dma-buf's reservation object outlive rmmod: poll and close after";
    let guest = std::path::Path::new("/lib/modules/tdrv.ko").exists()
        && std::path::Path::new("/etc/tdrv-params").exists();
    match dmabuf::heap_alloc(SIZE as usize) {
        Err(e) => t.check(name, Err::<(), _>(e)),
        Ok(None) => t.skip(
            name,
            &format!("no {} (the kernel has no system dma-heap)", dmabuf::HEAP),
        ),
        Ok(Some(_)) if !guest => t.skip(
            name,
            "needs the QEMU guest's /lib/modules/tdrv.ko to reload the module",
        ),
        Ok(Some(heap)) => t.run(name, || rmmod_test(&path, heap)),
    }

    t.finish();
}

/// `delete_module("tdrv", O_NONBLOCK)`.
fn unload() -> Result<(), i32> {
    // SAFETY: a NUL-terminated name and flags.
    let r = unsafe { libc::syscall(libc::SYS_delete_module, c"tdrv".as_ptr(), libc::O_NONBLOCK) };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

/// A tdrv file imports `heap` (a system dma-heap buffer) and runs a job
/// that reads it and one that writes it, so that both fences sit in the
/// heap buffer's reservation object; the file closes, the module goes,
/// and the heap buffer (holding those fences) is polled and closed after
/// that. Then the module is loaded again.
fn rmmod_test(path: &str, heap: OwnedFd) -> R {
    {
        let dev = ok("open", Dev::open(path))?;
        let imp = ok("import of the heap buffer", dev.import(heap.as_raw_fd(), 0))?;
        let c = ok("alloc", dev.alloc(SIZE, 0))?;
        let id = ok(
            "submit heap -> c",
            dev.submit(&[desc(imp.handle, 0, c.handle, 0, SIZE)]),
        )?;
        expect_eq(
            "job reading the heap buffer",
            job_end(&dev, id)?,
            (TDRV_JOB_DONE, 0),
        )?;
        let id = ok(
            "submit c -> heap",
            dev.submit(&[desc(c.handle, 0, imp.handle, 0, SIZE)]),
        )?;
        expect_eq(
            "job writing the heap buffer",
            job_end(&dev, id)?,
            (TDRV_JOB_DONE, 0),
        )?;
    }
    let unloaded = unload();
    let r = (|| -> R {
        unloaded.map_err(|e| {
            format!("rmmod with tdrv fences in a foreign reservation object: errno {e}")
        })?;
        let both = libc::POLLIN | libc::POLLOUT;
        expect_eq(
            "poll of the heap buffer after rmmod",
            poll_events(heap.as_raw_fd(), both, 0)?,
            both,
        )?;
        // Its last reference: the reservation object puts tdrv's fences.
        drop(heap);
        Ok(())
    })();
    let params = std::fs::read_to_string("/etc/tdrv-params").unwrap_or_default();
    let reload = std::process::Command::new("insmod")
        .arg("/lib/modules/tdrv.ko")
        .args(params.split_whitespace())
        .status()
        .map_err(|e| format!("insmod: {e}"))
        .and_then(|s| {
            if s.success() {
                Ok(())
            } else {
                Err(format!("insmod: {s}"))
            }
        });
    r?;
    reload?;
    let start = std::time::Instant::now();
    while Dev::open(path).is_err() {
        if start.elapsed() > std::time::Duration::from_secs(60) {
            return Err(format!("{path} did not come back"));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Ok(())
}
