//! `make bench`, guest part (issue 7): the figures that need the real
//! module, each measured next to its baseline in the same run.
//!
//! usage: bench [--only fig1,fig2,...] [--profile] [DEVICE]
//!        (default /dev/tdrv0, the software device; figures fig1 to fig8)
//!        bench --only sim|simq [DEVICE]
//!        (figure 9, the sim device: default the first /dev/tdrvN of kind
//!        sim; run in a guest on the host clock, see figure 9; `simq`
//!        runs its queue scaling only; TDRV_BENCH_SIM_QUEUES names the
//!        simulator's queue count in the scaling rows)
//!
//! Peers (issue 12): vgem, udmabuf and sw_sync are measured next to tdrv
//! when the kernel has them (the bench kernel, scripts/kernel.bench.config);
//! on a kernel without one, a `BENCH {"fig":"peer",...}` line says it is not
//! available and the figure goes on without it.
//!
//! Every measurement prints one line `BENCH {json}` on stdout; the host's
//! scripts/bench-report parses them from the console log and computes the
//! ratios. Progress goes to `# ...` lines. With `--profile`, the figures
//! that usually miss their target are also sampled with a cpu-clock
//! perf event (kernel and user instruction pointers), and the hottest
//! symbols are printed as `BENCH` lines of figure "profile".
//!
//! Clocks: the guest runs under QEMU `-icount shift=0,sleep=off`, so
//! CLOCK_MONOTONIC advances one nanosecond per guest instruction and jumps
//! over idle time. Times are instruction counts, not host time: only the
//! ratios between a tdrv figure and its baseline mean something.
//!
//! Method: every timed case runs `warm` rounds that are thrown away, then
//! `reps` rounds; within a round the cases of one figure run one after the
//! other (interleaved), so drift hits all of them alike. Each round gives
//! one sample (time per operation); a line reports the median, quartiles,
//! minimum and maximum of the samples.

use std::ffi::CString;
use std::hint::black_box;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tdrv::{Device, DeviceKind, Job, JobState, Tensor, TensorOps, VIEW_HEAP_SIZE};
use tdrv_guest_tests::raw;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

// ---------------------------------------------------------------------
// Statistics and output

/// Summary of the samples of one case.
#[derive(Clone, Copy, Debug)]
struct Summary {
    median: f64,
    p25: f64,
    p75: f64,
    p99: f64,
    min: f64,
    max: f64,
    n: usize,
}

impl Summary {
    /// A summary of one value (`n` says how many things it stands for).
    fn single(x: f64, n: usize) -> Summary {
        Summary {
            median: x,
            p25: x,
            p75: x,
            p99: x,
            min: x,
            max: x,
            n,
        }
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn summarize(mut v: Vec<f64>) -> Summary {
    assert!(!v.is_empty(), "no samples");
    v.sort_by(f64::total_cmp);
    Summary {
        median: quantile(&v, 0.5),
        p25: quantile(&v, 0.25),
        p75: quantile(&v, 0.75),
        p99: quantile(&v, 0.99),
        min: v[0],
        max: v[v.len() - 1],
        n: v.len(),
    }
}

/// A JSON string literal (the names printed here are plain ASCII).
fn js(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON number (non-finite values become null).
fn jn(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.6}")
    } else {
        "null".into()
    }
}

/// Prints one measurement. `case` is the size in bytes for sized figures.
fn emit(fig: &str, case: &str, method: &str, unit: &str, s: &Summary, extra: &[(&str, f64)]) {
    let mut line = format!(
        "BENCH {{\"fig\":{},\"case\":{},\"method\":{},\"unit\":{},\"median\":{},\"p25\":{},\"p75\":{},\"p99\":{},\"min\":{},\"max\":{},\"n\":{}",
        js(fig),
        js(case),
        js(method),
        js(unit),
        jn(s.median),
        jn(s.p25),
        jn(s.p75),
        jn(s.p99),
        jn(s.min),
        jn(s.max),
        s.n
    );
    for (k, v) in extra {
        line.push_str(&format!(",{}:{}", js(k), jn(*v)));
    }
    line.push('}');
    println!("{line}");
}

/// Prints the raw samples of one case (for the distribution plots), as
/// figure `{fig}_samples`.
fn emit_samples(fig: &str, case: &str, method: &str, unit: &str, v: &[f64]) {
    let body: Vec<String> = v.iter().map(|x| jn(*x)).collect();
    println!(
        "BENCH {{\"fig\":{},\"case\":{},\"method\":{},\"unit\":{},\"samples\":[{}]}}",
        js(&format!("{fig}_samples")),
        js(case),
        js(method),
        js(unit),
        body.join(",")
    );
}

/// Prints one record of free-form string fields.
fn emit_info(fig: &str, fields: &[(&str, String)]) {
    let body: Vec<String> = std::iter::once(format!("\"fig\":{}", js(fig)))
        .chain(fields.iter().map(|(k, v)| format!("{}:{}", js(k), js(v))))
        .collect();
    println!("BENCH {{{}}}", body.join(","));
}

fn note(msg: impl std::fmt::Display) {
    println!("# {msg}");
}

// ---------------------------------------------------------------------
// Timing

/// One timed case of a figure: runs the operation `iters` times.
type Case<'a> = (&'a str, Box<dyn FnMut() + 'a>);

/// Runs the cases interleaved: `warm` discarded rounds, then `reps` rounds
/// of `iters` calls each. Returns the per-call nanoseconds of every round,
/// per case.
fn interleave(warm: usize, reps: usize, iters: usize, cases: &mut [Case<'_>]) -> Vec<Vec<f64>> {
    interleave_between(warm, reps, iters, cases, &mut || {})
}

/// [`interleave`], with `between` run (untimed) before each case of every
/// round: a baseline measured elsewhere, at the same time as the cases.
fn interleave_between(
    warm: usize,
    reps: usize,
    iters: usize,
    cases: &mut [Case<'_>],
    between: &mut dyn FnMut(),
) -> Vec<Vec<f64>> {
    let mut samples = vec![Vec::with_capacity(reps); cases.len()];
    for round in 0..warm + reps {
        for (i, (_, f)) in cases.iter_mut().enumerate() {
            between();
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            let ns = t.elapsed().as_nanos() as f64 / iters as f64;
            if round >= warm {
                samples[i].push(ns);
            }
        }
    }
    samples
}

/// Times the cases and prints one line per case, in ns per operation.
fn time_cases(
    fig: &str,
    case: &str,
    (warm, reps, iters): (usize, usize, usize),
    cases: &mut [Case<'_>],
) -> Vec<Summary> {
    let samples = interleave(warm, reps, iters, cases);
    let mut out = Vec::new();
    for ((name, _), s) in cases.iter().zip(samples) {
        let s = summarize(s);
        emit(fig, case, name, "ns", &s, &[("iters", iters as f64)]);
        out.push(s);
    }
    out
}

/// Times copy-like cases of `bytes` each and prints throughput in GB/s
/// (bytes per nanosecond).
fn throughput_cases(fig: &str, bytes: usize, reps: usize, cases: &mut [Case<'_>]) {
    throughput_cases_between(fig, bytes, reps, cases, &mut || {})
}

/// [`throughput_cases`], with `between` run before each case of every
/// round (see [`interleave_between`]).
fn throughput_cases_between(
    fig: &str,
    bytes: usize,
    reps: usize,
    cases: &mut [Case<'_>],
    between: &mut dyn FnMut(),
) {
    let iters = (16 * MIB / bytes).clamp(1, 4096);
    let samples = interleave_between(1, reps, iters, cases, between);
    for ((name, _), s) in cases.iter().zip(samples) {
        // Faster rounds give higher throughput: convert every sample.
        let gbs: Vec<f64> = s.iter().map(|ns| bytes as f64 / ns).collect();
        emit(
            fig,
            &bytes.to_string(),
            name,
            "GB/s",
            &summarize(gbs),
            &[("bytes", bytes as f64), ("iters", iters as f64)],
        );
    }
}

/// 4 KiB, 16 KiB, ... up to `max`.
fn sizes(max: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(4 * KIB), |s| Some(s * 4)).take_while(move |s| *s <= max)
}

fn ok<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

fn errno_str() -> String {
    std::io::Error::last_os_error().to_string()
}

// ---------------------------------------------------------------------
// System helpers

/// An anonymous private mapping, faulted in, unmapped on drop.
struct Anon {
    ptr: *mut u8,
    len: usize,
}

impl Anon {
    /// Pages as the kernel chooses: on the bench kernel, as on Debian's,
    /// large mappings get transparent huge pages.
    fn new(len: usize, fill: u8) -> Anon {
        Self::with_pages(len, fill, true)
    }

    /// 4 KiB pages only (MADV_NOHUGEPAGE before any is faulted in): the
    /// memory of a kernel without transparent huge pages.
    fn small_pages(len: usize, fill: u8) -> Anon {
        Self::with_pages(len, fill, false)
    }

    fn with_pages(len: usize, fill: u8, huge: bool) -> Anon {
        let populate = if huge { libc::MAP_POPULATE } else { 0 };
        // SAFETY: a fresh private anonymous mapping chosen by the kernel
        // cannot alias any Rust object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | populate,
                -1,
                0,
            )
        };
        assert!(p != libc::MAP_FAILED, "mmap {len}: {}", errno_str());
        if !huge {
            // SAFETY: advice on the mapping just made, before any page of
            // it exists; it changes page sizes, not contents.
            let r = unsafe { libc::madvise(p, len, libc::MADV_NOHUGEPAGE) };
            assert!(r == 0, "madvise: {}", errno_str());
        }
        let ptr = p.cast::<u8>();
        // Touch every page so that no fault lands in a timed loop.
        // SAFETY: the mapping is `len` writable bytes and nothing else
        // refers to it yet.
        unsafe { std::ptr::write_bytes(ptr, fill, len) };
        Anon { ptr, len }
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: exactly the range mmap returned, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Copies with `rep movsb`, as the kernel's user copies do on this CPU: a
/// reference for the icount artefact (one instruction per byte).
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes, and the two
/// ranges must not overlap.
unsafe fn rep_movsb(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: forwarded to the caller; the instruction touches only those
    // ranges, RCX/RSI/RDI, and the direction flag is clear per the ABI.
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") len => _,
            inout("rsi") src => _,
            inout("rdi") dst => _,
            options(nostack, preserves_flags)
        )
    }
}

/// Opens a file read-write (close-on-exec).
fn open_rw(path: &str) -> OwnedFd {
    let c = CString::new(path).expect("path");
    // SAFETY: `c` is a valid NUL-terminated string for the whole call.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    assert!(fd >= 0, "open {path}: {}", errno_str());
    // SAFETY: open(2) just returned this descriptor; nobody else owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Bytes the C allocator hands out now (arena plus mmapped chunks).
fn heap_in_use() -> usize {
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    let m = unsafe { libc::mallinfo2() };
    m.uordblks + m.hblkhd
}

/// A field of /proc/meminfo, in bytes.
fn meminfo(field: &str) -> usize {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix(field)?.strip_prefix(':')?;
            let kb: usize = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            Some(kb * 1024)
        })
        .unwrap_or(0)
}

fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|e| format!("({e})"))
}

/// The uapi of the dma-buf heaps (linux/dma-heap.h), defined here.
mod dma_heap {
    /// `struct dma_heap_allocation_data`.
    #[repr(C)]
    #[derive(Default)]
    pub struct AllocationData {
        pub len: u64,
        pub fd: u32,
        pub fd_flags: u32,
        pub heap_flags: u64,
    }

    /// `_IOWR('H', 0x0, struct dma_heap_allocation_data)`.
    pub const IOCTL_ALLOC: u64 =
        (3 << 30) | ((std::mem::size_of::<AllocationData>() as u64) << 16) | ((b'H' as u64) << 8);

    pub const SYSTEM: &str = "/dev/dma_heap/system";
}

/// A dma-buf from a heap.
fn heap_alloc(heap: &OwnedFd, len: usize) -> OwnedFd {
    let mut a = dma_heap::AllocationData {
        len: len as u64,
        fd_flags: (libc::O_RDWR | libc::O_CLOEXEC) as u32,
        ..Default::default()
    };
    // SAFETY: `a` is a live, exclusively borrowed struct of exactly the
    // size encoded in the request number.
    let r = unsafe {
        libc::ioctl(
            heap.as_raw_fd(),
            dma_heap::IOCTL_ALLOC as _,
            &mut a as *mut dma_heap::AllocationData,
        )
    };
    assert!(r >= 0, "DMA_HEAP_IOCTL_ALLOC {len}: {}", errno_str());
    // SAFETY: the kernel just created this descriptor for us.
    unsafe { OwnedFd::from_raw_fd(a.fd as i32) }
}

/// A shared read-write mapping of `len` bytes of `fd`.
fn map_shared(fd: &OwnedFd, len: usize) -> *mut libc::c_void {
    // SAFETY: a fresh shared mapping chosen by the kernel cannot alias any
    // Rust object.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert!(p != libc::MAP_FAILED, "mmap dma-buf {len}: {}", errno_str());
    p
}

fn unmap(p: *mut libc::c_void, len: usize) {
    // SAFETY: `p`/`len` is a mapping made by `map_shared` that nothing
    // refers to any more.
    unsafe { libc::munmap(p, len) };
}

/// `_IOC(dir, type, nr, size)` of the generic ioctl encoding (asm-generic/
/// ioctl.h): dir 1 = write (to the kernel), 2 = read, 3 = both.
const fn ioc(dir: u64, ty: u8, nr: u8, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | ((ty as u64) << 8) | nr as u64
}

/// ioctl(2) on `fd` with a pointer to `arg`; the errno on failure.
///
/// # Safety
/// `req` must encode an argument of exactly `T`'s size and layout, so that
/// the kernel reads and writes only within `*arg`.
unsafe fn ioctl_ptr<T>(fd: i32, req: u64, arg: &mut T) -> Result<i32, String> {
    // SAFETY: forwarded to the caller; `arg` is live and exclusively
    // borrowed for the call.
    let r = unsafe { libc::ioctl(fd, req as _, arg as *mut T) };
    if r < 0 {
        Err(errno_str())
    } else {
        Ok(r)
    }
}

/// Blocks in poll(2) until `fd` is readable (a signalled fence).
fn poll_in(fd: i32) {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: `p` is one live pollfd.
        let r = unsafe { libc::poll(&mut p, 1, -1) };
        if r > 0 {
            return;
        }
        assert!(
            r == 0 || std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted,
            "poll: {}",
            errno_str()
        );
    }
}

/// Touches one byte per page of a fresh mapping, so that every case of
/// figure 5 has its memory allocated and mapped, whether the exporter maps
/// at mmap time (dma-heap, tdrv) or at the first fault (vgem, udmabuf).
fn touch_pages(p: *mut u8, len: usize) {
    let page = raw::page_size();
    let mut off = 0;
    while off < len {
        // SAFETY: `p` is a writable mapping of `len` bytes that only this
        // thread uses.
        unsafe { std::ptr::write_volatile(p.add(off), 1) };
        off += page;
    }
}

/// The peer drivers of issue 12, each behind raw ioctls whose structs are
/// defined here from the kernel's uapi headers (drm/drm.h, drm/drm_mode.h,
/// drm/vgem_drm.h, linux/udmabuf.h, and sw_sync's ioctls from
/// drivers/dma-buf/sw_sync.c). A kernel without a peer (the debug test
/// kernel) makes `open` fail, and the figure reports it "not available".
mod peer {
    use super::{errno_str, ioc, ioctl_ptr};
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// `struct drm_mode_create_dumb`.
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

    /// `struct drm_mode_map_dumb`.
    #[repr(C)]
    #[derive(Default)]
    struct MapDumb {
        handle: u32,
        pad: u32,
        offset: u64,
    }

    /// `struct drm_gem_close`.
    #[repr(C)]
    #[derive(Default)]
    struct GemClose {
        handle: u32,
        pad: u32,
    }

    /// `struct drm_prime_handle`.
    #[repr(C)]
    #[derive(Default)]
    struct PrimeHandle {
        handle: u32,
        flags: u32,
        fd: i32,
    }

    /// `struct drm_vgem_fence_attach`.
    #[repr(C)]
    #[derive(Default)]
    struct FenceAttach {
        handle: u32,
        flags: u32,
        out_fence: u32,
        pad: u32,
    }

    /// `struct drm_vgem_fence_signal`.
    #[repr(C)]
    #[derive(Default)]
    struct FenceSignal {
        fence: u32,
        flags: u32,
    }

    const DRM: u8 = b'd';
    const DRM_COMMAND_BASE: u8 = 0x40;
    const GEM_CLOSE: u64 = ioc(1, DRM, 0x09, size_of::<GemClose>());
    const PRIME_HANDLE_TO_FD: u64 = ioc(3, DRM, 0x2d, size_of::<PrimeHandle>());
    const MODE_CREATE_DUMB: u64 = ioc(3, DRM, 0xb2, size_of::<CreateDumb>());
    const MODE_MAP_DUMB: u64 = ioc(3, DRM, 0xb3, size_of::<MapDumb>());
    const VGEM_FENCE_ATTACH: u64 = ioc(3, DRM, DRM_COMMAND_BASE + 1, size_of::<FenceAttach>());
    const VGEM_FENCE_SIGNAL: u64 = ioc(1, DRM, DRM_COMMAND_BASE + 2, size_of::<FenceSignal>());
    const VGEM_FENCE_WRITE: u32 = 1;

    fn open(path: &str) -> Result<OwnedFd, String> {
        let c = CString::new(path).expect("path");
        // SAFETY: `c` is a valid NUL-terminated string for the call.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(format!("{path}: {}", errno_str()));
        }
        // SAFETY: open(2) just returned this descriptor; nobody else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// An open vgem device (its primary node).
    pub struct Vgem {
        fd: OwnedFd,
    }

    impl Vgem {
        /// The DRM card of vgem: its device (a faux device since 6.15)
        /// or its driver is named "vgem".
        pub fn open() -> Result<Vgem, String> {
            for n in 0..16 {
                let named_vgem = |link: String| {
                    std::fs::read_link(link)
                        .is_ok_and(|t| t.file_name().is_some_and(|f| f == "vgem"))
                };
                if named_vgem(format!("/sys/class/drm/card{n}/device"))
                    || named_vgem(format!("/sys/class/drm/card{n}/device/driver"))
                {
                    return Ok(Vgem {
                        fd: open(&format!("/dev/dri/card{n}"))?,
                    });
                }
            }
            Err("no DRM card driven by vgem (CONFIG_DRM_VGEM)".into())
        }

        /// A GEM object of `size` bytes (a multiple of 4 KiB): its handle.
        pub fn create(&self, size: usize) -> Result<u32, String> {
            let mut a = CreateDumb {
                height: (size / 4096) as u32,
                width: 1024,
                bpp: 32,
                ..Default::default()
            };
            // SAFETY: the request encodes `CreateDumb`.
            unsafe { ioctl_ptr(self.fd.as_raw_fd(), MODE_CREATE_DUMB, &mut a) }
                .map_err(|e| format!("DRM_IOCTL_MODE_CREATE_DUMB: {e}"))?;
            Ok(a.handle)
        }

        /// The mmap offset of GEM object `handle` on the device fd.
        pub fn map_offset(&self, handle: u32) -> Result<u64, String> {
            let mut a = MapDumb {
                handle,
                ..Default::default()
            };
            // SAFETY: the request encodes `MapDumb`.
            unsafe { ioctl_ptr(self.fd.as_raw_fd(), MODE_MAP_DUMB, &mut a) }
                .map_err(|e| format!("DRM_IOCTL_MODE_MAP_DUMB: {e}"))?;
            Ok(a.offset)
        }

        /// A shared mapping of `len` bytes at `offset` of the device fd.
        pub fn mmap(&self, offset: u64, len: usize) -> Result<*mut u8, String> {
            // SAFETY: a fresh shared mapping chosen by the kernel cannot
            // alias any Rust object.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    self.fd.as_raw_fd(),
                    offset as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(format!("mmap vgem: {}", errno_str()));
            }
            Ok(p.cast())
        }

        pub fn close(&self, handle: u32) -> Result<(), String> {
            let mut a = GemClose { handle, pad: 0 };
            // SAFETY: the request encodes `GemClose`.
            unsafe { ioctl_ptr(self.fd.as_raw_fd(), GEM_CLOSE, &mut a) }
                .map_err(|e| format!("DRM_IOCTL_GEM_CLOSE: {e}"))?;
            Ok(())
        }

        /// A dma-buf of GEM object `handle`.
        pub fn export(&self, handle: u32) -> Result<OwnedFd, String> {
            let mut a = PrimeHandle {
                handle,
                flags: (libc::O_CLOEXEC | libc::O_RDWR) as u32,
                fd: -1,
            };
            // SAFETY: the request encodes `PrimeHandle`.
            unsafe { ioctl_ptr(self.fd.as_raw_fd(), PRIME_HANDLE_TO_FD, &mut a) }
                .map_err(|e| format!("DRM_IOCTL_PRIME_HANDLE_TO_FD: {e}"))?;
            // SAFETY: the kernel just created this descriptor for us.
            Ok(unsafe { OwnedFd::from_raw_fd(a.fd) })
        }

        /// Attaches an unsignalled write fence to `handle`: its id.
        pub fn fence_attach(&self, handle: u32) -> Result<u32, String> {
            let mut a = FenceAttach {
                handle,
                flags: VGEM_FENCE_WRITE,
                ..Default::default()
            };
            // SAFETY: the request encodes `FenceAttach`.
            unsafe { ioctl_ptr(self.fd.as_raw_fd(), VGEM_FENCE_ATTACH, &mut a) }
                .map_err(|e| format!("DRM_IOCTL_VGEM_FENCE_ATTACH: {e}"))?;
            Ok(a.out_fence)
        }

        pub fn fence_signal(&self, fence: u32) -> Result<(), String> {
            let mut a = FenceSignal { fence, flags: 0 };
            // SAFETY: the request encodes `FenceSignal`.
            unsafe { ioctl_ptr(self.fd.as_raw_fd(), VGEM_FENCE_SIGNAL, &mut a) }
                .map_err(|e| format!("DRM_IOCTL_VGEM_FENCE_SIGNAL: {e}"))?;
            Ok(())
        }
    }

    /// `struct udmabuf_create`.
    #[repr(C)]
    struct UdmabufCreate {
        memfd: u32,
        flags: u32,
        offset: u64,
        size: u64,
    }

    const UDMABUF_CREATE: u64 = ioc(1, b'u', 0x42, size_of::<UdmabufCreate>());
    const UDMABUF_FLAGS_CLOEXEC: u32 = 1;

    /// /dev/udmabuf.
    pub struct Udmabuf {
        fd: OwnedFd,
    }

    impl Udmabuf {
        pub fn open() -> Result<Udmabuf, String> {
            Ok(Udmabuf {
                fd: open("/dev/udmabuf").map_err(|e| format!("{e} (CONFIG_UDMABUF)"))?,
            })
        }

        /// A dma-buf of `size` bytes over a fresh sealed memfd; the memfd
        /// is closed (the dma-buf keeps its pages pinned).
        pub fn create(&self, size: usize) -> Result<OwnedFd, String> {
            // SAFETY: the name is a NUL-terminated literal.
            let m = unsafe {
                libc::memfd_create(
                    c"udmabuf".as_ptr(),
                    libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC,
                )
            };
            if m < 0 {
                return Err(format!("memfd_create: {}", errno_str()));
            }
            // SAFETY: memfd_create just returned this descriptor.
            let memfd = unsafe { OwnedFd::from_raw_fd(m) };
            // SAFETY: plain calls on our own descriptor.
            if unsafe { libc::ftruncate(m, size as libc::off_t) } != 0
                || unsafe { libc::fcntl(m, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0
            {
                return Err(format!("memfd setup: {}", errno_str()));
            }
            let mut a = UdmabufCreate {
                memfd: memfd.as_raw_fd() as u32,
                flags: UDMABUF_FLAGS_CLOEXEC,
                offset: 0,
                size: size as u64,
            };
            // SAFETY: the request encodes `UdmabufCreate`.
            let fd = unsafe { ioctl_ptr(self.fd.as_raw_fd(), UDMABUF_CREATE, &mut a) }
                .map_err(|e| format!("UDMABUF_CREATE: {e}"))?;
            // SAFETY: the kernel just created this descriptor for us.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
    }

    /// `struct sw_sync_create_fence_data`.
    #[repr(C)]
    struct CreateFence {
        value: u32,
        name: [u8; 32],
        fence: i32,
    }

    const SW_SYNC_CREATE_FENCE: u64 = ioc(3, b'W', 0, size_of::<CreateFence>());
    const SW_SYNC_INC: u64 = ioc(1, b'W', 1, size_of::<u32>());
    const SW_SYNC: &str = "/sys/kernel/debug/sync/sw_sync";

    /// One sw_sync timeline.
    pub struct SwSync {
        fd: OwnedFd,
    }

    impl SwSync {
        pub fn open() -> Result<SwSync, String> {
            Ok(SwSync {
                fd: open(SW_SYNC).map_err(|e| format!("{e} (CONFIG_SW_SYNC)"))?,
            })
        }

        /// A sync_file fd that signals when the timeline reaches `value`.
        pub fn fence(&self, value: u32) -> Result<OwnedFd, String> {
            let mut a = CreateFence {
                value,
                name: [0; 32],
                fence: -1,
            };
            a.name[..5].copy_from_slice(b"bench");
            // SAFETY: the request encodes `CreateFence`.
            unsafe { ioctl_ptr(self.fd.as_raw_fd(), SW_SYNC_CREATE_FENCE, &mut a) }
                .map_err(|e| format!("SW_SYNC_IOC_CREATE_FENCE: {e}"))?;
            // SAFETY: the kernel just created this descriptor for us.
            Ok(unsafe { OwnedFd::from_raw_fd(a.fence) })
        }

        /// Advances the timeline by one, signalling the fences it reaches.
        pub fn inc(&self) -> Result<(), String> {
            let mut one = 1u32;
            // SAFETY: the request encodes a u32.
            unsafe { ioctl_ptr(self.fd.as_raw_fd(), SW_SYNC_INC, &mut one) }
                .map_err(|e| format!("SW_SYNC_IOC_INC: {e}"))?;
            Ok(())
        }
    }
}

/// Reports a peer that this kernel lacks; the figure goes on without it.
fn peer_missing(peer: &str, why: &str) {
    note(format!("{peer}: not available ({why})"));
    emit_info(
        "peer",
        &[
            ("peer", peer.to_owned()),
            ("status", "not available".to_owned()),
            ("why", why.to_owned()),
        ],
    );
}

/// Opens a peer, or reports it missing.
fn peer_open<T>(peer: &str, r: Result<T, String>) -> Option<T> {
    match r {
        Ok(p) => {
            emit_info(
                "peer",
                &[
                    ("peer", peer.to_owned()),
                    ("status", "available".to_owned()),
                ],
            );
            Some(p)
        }
        Err(e) => {
            peer_missing(peer, &e);
            None
        }
    }
}

/// Raises the open-file limit (the dma-heap baseline keeps 10,000 fds).
fn raise_nofile(n: u64) {
    let lim = libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    };
    // SAFETY: `lim` is a valid rlimit for the duration of the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        note(format!("setrlimit(NOFILE, {n}): {}", errno_str()));
    }
}

// ---------------------------------------------------------------------
// A small sampling profiler (perf cpu-clock events, kernel and user IPs)

mod profile {
    use std::collections::HashMap;

    // perf_event_attr, the fields this profiler sets (layout of
    // PERF_ATTR_SIZE_VER5, 112 bytes).
    #[repr(C)]
    #[derive(Default)]
    struct Attr {
        type_: u32,
        size: u32,
        config: u64,
        sample_period: u64,
        sample_type: u64,
        read_format: u64,
        flags: u64,
        wakeup_events: u32,
        bp_type: u32,
        bp_addr: u64,
        bp_len: u64,
        branch_sample_type: u64,
        sample_regs_user: u64,
        sample_stack_user: u32,
        clockid: i32,
        sample_regs_intr: u64,
        aux_watermark: u32,
        sample_max_stack: u16,
        reserved: u16,
    }

    const PERF_TYPE_SOFTWARE: u32 = 1;
    const PERF_COUNT_SW_CPU_CLOCK: u64 = 0;
    const PERF_SAMPLE_IP: u64 = 1;
    const PERF_SAMPLE_CALLCHAIN: u64 = 1 << 5;
    /// Callchain entries at or above this are context markers.
    const PERF_CONTEXT_MAX: u64 = (-4095i64) as u64;
    const FLAG_DISABLED: u64 = 1;
    const PERF_RECORD_SAMPLE: u32 = 9;
    const IOC_ENABLE: u64 = 0x2400;
    const IOC_DISABLE: u64 = 0x2401;
    /// Data pages of the ring buffer (a power of two).
    const DATA_PAGES: usize = 256;

    /// The first page of the ring buffer (`struct perf_event_mmap_page`):
    /// only `data_head`/`data_tail` (at byte 1024 and 1032) are used.
    const DATA_HEAD: usize = 1024;
    const DATA_TAIL: usize = 1032;

    pub struct Sampler {
        fd: i32,
        base: *mut u8,
        len: usize,
        page: usize,
        /// One chain per sample: the sampled IP, then its callers.
        pub chains: Vec<Vec<u64>>,
        pub lost: u64,
    }

    impl Sampler {
        /// A disabled sampler of this thread, one sample per `period_ns`.
        /// With `cpu_wide`, samples every task on CPU 0 (the kernel's
        /// workers included), else only this thread.
        pub fn new(period_ns: u64, cpu_wide: bool) -> Result<Sampler, String> {
            // Under TCG every sample interrupt "takes too long", and the
            // kernel would throttle the rate to almost nothing.
            let _ = std::fs::write("/proc/sys/kernel/perf_cpu_time_max_percent", "0");
            let (pid, cpu) = if cpu_wide { (-1, 0) } else { (0, -1) };
            let attr = Attr {
                type_: PERF_TYPE_SOFTWARE,
                size: std::mem::size_of::<Attr>() as u32,
                config: PERF_COUNT_SW_CPU_CLOCK,
                sample_period: period_ns,
                sample_type: PERF_SAMPLE_IP | PERF_SAMPLE_CALLCHAIN,
                flags: FLAG_DISABLED,
                ..Default::default()
            };
            // SAFETY: `attr` is a valid perf_event_attr of the size it
            // declares; pid 0 / cpu -1 measures this thread on any CPU,
            // pid -1 / cpu 0 every task on CPU 0.
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_perf_event_open,
                    &attr as *const Attr,
                    pid,
                    cpu,
                    -1,
                    0u64,
                )
            } as i32;
            if fd < 0 {
                return Err(format!("perf_event_open: {}", super::errno_str()));
            }
            let page = tdrv_guest_tests::raw::page_size();
            let len = page * (1 + DATA_PAGES);
            // SAFETY: maps the event's ring buffer; a fresh mapping chosen
            // by the kernel aliases no Rust object.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                let e = super::errno_str();
                // SAFETY: `fd` is ours and closed once.
                unsafe { libc::close(fd) };
                return Err(format!("mmap perf ring: {e}"));
            }
            Ok(Sampler {
                fd,
                base: p.cast(),
                len,
                page,
                chains: Vec::new(),
                lost: 0,
            })
        }

        fn ioctl(&self, req: u64) {
            // SAFETY: ENABLE/DISABLE take no argument.
            unsafe { libc::ioctl(self.fd, req as _, 0) };
        }

        /// Runs `f` with sampling on, draining the ring between calls.
        pub fn run(&mut self, mut f: impl FnMut(), calls: usize) {
            for _ in 0..calls {
                self.ioctl(IOC_ENABLE);
                f();
                self.ioctl(IOC_DISABLE);
                self.drain();
            }
        }

        fn drain(&mut self) {
            let size = DATA_PAGES * self.page;
            // SAFETY: the control page is mapped for the sampler's
            // lifetime; data_head is written by the kernel, so it is read
            // volatile, and the fence orders the data reads after it.
            let head = unsafe { std::ptr::read_volatile(self.base.add(DATA_HEAD).cast::<u64>()) };
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            // SAFETY: as above; data_tail is only written by us.
            let mut tail =
                unsafe { std::ptr::read_volatile(self.base.add(DATA_TAIL).cast::<u64>()) };
            let data = self.page;
            let byte = |off: u64| -> u8 {
                // SAFETY: the data area is `size` bytes after the control
                // page; offsets are taken modulo `size`.
                unsafe { *self.base.add(data + (off as usize % size)) }
            };
            let read_u64 = |off: u64| -> u64 {
                let mut b = [0u8; 8];
                for (i, x) in b.iter_mut().enumerate() {
                    *x = byte(off + i as u64);
                }
                u64::from_ne_bytes(b)
            };
            while tail < head {
                let hdr = read_u64(tail);
                let type_ = hdr as u32;
                let rsize = (hdr >> 48) as u16 as u64;
                if rsize == 0 {
                    break;
                }
                if type_ == PERF_RECORD_SAMPLE {
                    let mut chain = vec![read_u64(tail + 8)];
                    let nr = read_u64(tail + 16).min(512);
                    for k in 0..nr {
                        let ip = read_u64(tail + 24 + 8 * k);
                        if ip < PERF_CONTEXT_MAX {
                            chain.push(ip);
                        }
                    }
                    self.chains.push(chain);
                } else if type_ == 2 {
                    // PERF_RECORD_LOST: id, lost
                    self.lost += read_u64(tail + 16);
                }
                tail += rsize;
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            // SAFETY: tells the kernel the records up to `tail` are read.
            unsafe { std::ptr::write_volatile(self.base.add(DATA_TAIL).cast::<u64>(), tail) };
        }
    }

    impl Drop for Sampler {
        fn drop(&mut self) {
            // SAFETY: the ring mapping and the fd are ours, released once.
            unsafe {
                libc::munmap(self.base.cast(), self.len);
                libc::close(self.fd);
            }
        }
    }

    /// Kernel (and module) text symbols, sorted by address.
    pub fn kallsyms() -> Vec<(u64, String)> {
        let text = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        let mut v: Vec<(u64, String)> = text
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                let addr = u64::from_str_radix(it.next()?, 16).ok()?;
                let kind = it.next()?;
                let name = it.next()?;
                let module = it.next().unwrap_or("");
                if addr == 0 || !matches!(kind, "t" | "T" | "w" | "W") {
                    return None;
                }
                Some((
                    addr,
                    format!("{name}{}", if module.is_empty() { "" } else { " " }) + module,
                ))
            })
            .collect();
        v.sort();
        v
    }

    fn symbol(ip: u64, syms: &[(u64, String)]) -> String {
        if ip < 0xffff_8000_0000_0000 {
            return "[user]".to_owned();
        }
        match syms.partition_point(|(a, _)| *a <= ip) {
            0 => "[kernel ?]".to_owned(),
            i => syms[i - 1].1.clone(),
        }
    }

    /// Counts the samples that hit each kernel instruction, named
    /// `symbol+0xoffset`, hottest first.
    pub fn hot_ips(chains: &[Vec<u64>], syms: &[(u64, String)]) -> Vec<(String, usize)> {
        let mut h: HashMap<u64, usize> = HashMap::new();
        for chain in chains {
            if let Some(&ip) = chain.first().filter(|&&ip| ip >= 0xffff_8000_0000_0000) {
                *h.entry(ip).or_default() += 1;
            }
        }
        let mut v: Vec<(String, usize)> = h
            .into_iter()
            .map(|(ip, n)| match syms.partition_point(|(a, _)| *a <= ip) {
                0 => (format!("{ip:#x}"), n),
                i => (format!("{}+{:#x}", syms[i - 1].1, ip - syms[i - 1].0), n),
            })
            .collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }

    /// Counts samples per symbol, kernel addresses through kallsyms and
    /// user addresses as one "[user]" bucket: `inclusive` counts a sample
    /// for every distinct function on its call chain, else only for the
    /// function it hit.
    pub fn histogram(
        chains: &[Vec<u64>],
        syms: &[(u64, String)],
        inclusive: bool,
    ) -> Vec<(String, usize)> {
        let mut h: HashMap<String, usize> = HashMap::new();
        for chain in chains {
            let frames = if inclusive { &chain[..] } else { &chain[..1] };
            let mut names: Vec<String> = frames.iter().map(|&ip| symbol(ip, syms)).collect();
            names.sort();
            names.dedup();
            for n in names {
                *h.entry(n).or_default() += 1;
            }
        }
        let mut v: Vec<_> = h.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }
}

/// Samples `f` (called `calls` times) and prints the hottest symbols.
fn profile_case(name: &str, cpu_wide: bool, calls: usize, f: impl FnMut()) {
    profile_case_every(10_000, name, cpu_wide, calls, f);
}

/// [`profile_case`] with a sample every `period_ns`.
fn profile_case_every(period_ns: u64, name: &str, cpu_wide: bool, calls: usize, f: impl FnMut()) {
    let mut s = match profile::Sampler::new(period_ns, cpu_wide) {
        Ok(s) => s,
        Err(e) => {
            note(format!("profile {name}: {e}"));
            return;
        }
    };
    s.run(f, calls);
    let syms = profile::kallsyms();
    let total = s.chains.len();
    note(format!(
        "profile {name}: {total} samples, {} lost, {} symbols",
        s.lost,
        syms.len()
    ));
    // The hottest kernel instructions, as symbol+offset (for addr2line).
    for (ip, count) in profile::hot_ips(&s.chains, &syms).into_iter().take(40) {
        note(format!("profile {name}: ip {ip} {count}"));
    }
    // "profile": where the samples hit (self); "profile_incl": functions
    // on the samples' call chains (inclusive).
    for (fig, inclusive, top) in [("profile", false, 60), ("profile_incl", true, 30)] {
        for (sym, count) in profile::histogram(&s.chains, &syms, inclusive)
            .into_iter()
            .take(top)
        {
            let share = 100.0 * count as f64 / total.max(1) as f64;
            emit(
                fig,
                name,
                &sym,
                "%",
                &Summary::single(share, total),
                &[("samples", count as f64)],
            );
        }
    }
}

// ---------------------------------------------------------------------
// The figures

/// A figure's name (for `--only`) and its function.
type Figure = (&'static str, fn(&Ctx));

struct Ctx {
    path: String,
    dev: Arc<Device>,
    profile: bool,
    /// `--only simq`: figure 9's queue scaling only.
    only_scaling: bool,
}

fn alloc(c: &Ctx, size: usize, name: &str) -> Tensor {
    ok(
        "allocate_on",
        Tensor::allocate_on(&c.dev, 0, size, Some(name)),
    )
}

/// Figure 1: slice create + drop against `Arc::clone` + drop and a `Box` of a
/// view's size, on a Dma tensor.
fn fig1(c: &Ctx) {
    let t = alloc(c, 4096, "fig1");
    let arc = Arc::new([0u8; 64]);
    let mut cases: Vec<Case> = vec![
        (
            "slice",
            Box::new(|| {
                black_box(t.slice(black_box(64), 128, None).expect("slice"));
            }),
        ),
        (
            "arc_clone",
            Box::new(|| {
                black_box(Arc::clone(black_box(&arc)));
            }),
        ),
        (
            "box",
            Box::new(|| {
                black_box(Box::new([0u8; VIEW_HEAP_SIZE]));
            }),
        ),
    ];
    time_cases("1", "guest", (2, 9, 20_000), &mut cases);
}

/// Figures 2 and 3: host to device and device to host through the mapping
/// (`Tensor::write`/`read`, fenced), the raw mapping (no fence) and
/// COPY_IN/COPY_OUT, against memcpy between two anonymous buffers.
fn fig23(c: &Ctx) {
    for size in sizes(64 * MIB) {
        let t = alloc(c, size, "fig23");
        let handle = t.dma_handle().expect("Dma handle");
        let map = t.va().expect("mapped").as_ptr();
        let src = Anon::new(size, 0x5a);
        let dst = Anon::new(size, 0xa5);
        let (sp, dp) = (src.ptr, dst.ptr);
        let dev = &c.dev;
        let src_slice = || {
            // SAFETY: `src` is `size` readable bytes for the whole figure
            // and only read.
            unsafe { std::slice::from_raw_parts(sp, size) }
        };
        let dst_slice = || {
            // SAFETY: `dst` is `size` writable bytes; the cases run one at
            // a time, so this is the only live reference to it.
            unsafe { std::slice::from_raw_parts_mut(dp, size) }
        };
        let reps = 7;
        {
            let mut cases: Vec<Case> = vec![
                (
                    "memcpy",
                    Box::new(|| {
                        // SAFETY: both ranges are `size` valid bytes of two
                        // distinct anonymous mappings.
                        unsafe { std::ptr::copy_nonoverlapping(sp, dp, size) }
                    }),
                ),
                (
                    "tensor_write",
                    Box::new(|| t.write(0, src_slice()).expect("write")),
                ),
                (
                    "mapping_raw",
                    Box::new(|| {
                        // SAFETY: the tensor's mapping is `size` writable
                        // bytes that no job touches; `src` is `size` bytes.
                        unsafe { std::ptr::copy_nonoverlapping(sp, map, size) }
                    }),
                ),
                (
                    "rep_movsb",
                    Box::new(|| {
                        // SAFETY: two distinct anonymous mappings of `size`
                        // bytes.
                        unsafe { rep_movsb(sp, dp, size) }
                    }),
                ),
                (
                    "copy_in",
                    Box::new(|| dev.copy_in(handle, 0, src_slice()).expect("COPY_IN")),
                ),
            ];
            throughput_cases("2", size, reps, &mut cases);
        }
        {
            let mut cases: Vec<Case> = vec![
                (
                    "memcpy",
                    Box::new(|| {
                        // SAFETY: both ranges are `size` valid bytes of two
                        // distinct anonymous mappings.
                        unsafe { std::ptr::copy_nonoverlapping(sp, dp, size) }
                    }),
                ),
                (
                    "tensor_read",
                    Box::new(|| t.read(0, dst_slice()).expect("read")),
                ),
                (
                    "mapping_raw",
                    Box::new(|| {
                        // SAFETY: the tensor's mapping is `size` readable
                        // bytes that no job touches; `dst` is `size` bytes.
                        unsafe { std::ptr::copy_nonoverlapping(map, dp, size) }
                    }),
                ),
                (
                    "rep_movsb",
                    Box::new(|| {
                        // SAFETY: two distinct anonymous mappings of `size`
                        // bytes.
                        unsafe { rep_movsb(sp, dp, size) }
                    }),
                ),
                (
                    "copy_out",
                    Box::new(|| dev.copy_out(handle, 0, dst_slice()).expect("COPY_OUT")),
                ),
            ];
            throughput_cases("3", size, reps, &mut cases);
        }
        if c.profile && size == 64 * KIB {
            profile_case("fig2 tensor_write 64 KiB", false, 1, || {
                for _ in 0..4000 {
                    t.write(0, src_slice()).expect("write");
                }
            });
        }
        note(format!("fig2/3: {size} bytes done"));
    }
}

/// Figure 4: BUF_INFO against getppid, with the steps in between: an ioctl the
/// VFS refuses (/dev/null), one tdrv refuses (unknown number), VERSION.
fn fig4(c: &Ctx) {
    let t = alloc(c, 4096, "fig4");
    let handle = t.dma_handle().expect("Dma handle");
    let rawdev = ok("open", raw::Dev::open(&c.path));
    let null = open_rw("/dev/null");
    // The closest peer: vgem's MAP_DUMB, a handle lookup that returns a
    // GEM object's mmap offset.
    let vgem = peer_open("vgem", peer::Vgem::open());
    let vgem_handle = vgem.as_ref().and_then(|v| {
        v.create(4096)
            .map_err(|e| peer_missing("vgem MAP_DUMB", &e))
            .ok()
    });
    let unknown = (3u64 << 30) | (88 << 16) | (0xD7 << 8) | 0x7f;
    let dev = &c.dev;
    let enotty = |fd: i32| {
        let mut buf = [0u8; 88];
        // SAFETY: `buf` is as large as the size encoded in the request; the
        // call fails with ENOTTY before touching it anyway.
        let r = unsafe { libc::ioctl(fd, unknown as _, buf.as_mut_ptr()) };
        assert!(r < 0);
    };
    let mut cases: Vec<Case> = vec![
        (
            "getppid",
            Box::new(|| {
                // SAFETY: getppid has no arguments and cannot fail.
                black_box(unsafe { libc::syscall(libc::SYS_getppid) });
            }),
        ),
        (
            "buf_info",
            Box::new(|| {
                black_box(dev.buf_info(handle).expect("BUF_INFO"));
            }),
        ),
        (
            "ioctl_devnull_enotty",
            Box::new(|| enotty(null.as_raw_fd())),
        ),
        ("ioctl_tdrv_enotty", Box::new(|| enotty(rawdev.fd()))),
        (
            "ioctl_version",
            Box::new(|| {
                black_box(rawdev.version().expect("VERSION"));
            }),
        ),
    ];
    if let (Some(v), Some(h)) = (&vgem, vgem_handle) {
        cases.push((
            "vgem_map_dumb",
            Box::new(move || {
                black_box(v.map_offset(h).expect("vgem MAP_DUMB"));
            }),
        ));
    }
    time_cases("4", "small ioctl", (2, 9, 20_000), &mut cases);
    drop(cases);
    if let (Some(v), Some(h)) = (&vgem, vgem_handle) {
        v.close(h).expect("vgem close");
    }
    if c.profile {
        profile_case("fig4 buf_info", false, 200, || {
            for _ in 0..2000 {
                black_box(dev.buf_info(handle).expect("BUF_INFO"));
            }
        });
        profile_case("fig4 getppid", false, 200, || {
            for _ in 0..2000 {
                // SAFETY: as above.
                black_box(unsafe { libc::syscall(libc::SYS_getppid) });
            }
        });
    }
}

/// Figure 5: alloc + mmap + free of a Dma buffer against the peers a user
/// would pick instead, each allocating, mapping, writing one byte per page
/// (so that lazily faulting exporters pay for their memory too) and
/// freeing: vgem (dumb GEM object: CREATE_DUMB, MAP_DUMB, mmap, munmap,
/// GEM_CLOSE), udmabuf (memfd, seal, UDMABUF_CREATE, mmap, munmap, close)
/// and the dma-heap system heap (allocate, mmap, munmap, close).
fn fig5(c: &Ctx) {
    let heap = open_rw(dma_heap::SYSTEM);
    let vgem = peer_open("vgem", peer::Vgem::open());
    let udmabuf = peer_open("udmabuf", peer::Udmabuf::open());
    let dev = &c.dev;
    for size in sizes(16 * MIB) {
        let iters = (16 * MIB / size).clamp(4, 200);
        let tensor = || {
            let t = Tensor::allocate_on(dev, 0, size, None).expect("alloc");
            touch_pages(t.va().expect("mapped").as_ptr(), size);
            drop(t);
        };
        let dma_heap = || {
            let fd = heap_alloc(&heap, size);
            let p = map_shared(&fd, size);
            touch_pages(p.cast(), size);
            unmap(p, size);
            drop(fd);
        };
        let mut cases: Vec<Case> = vec![
            ("tensor", Box::new(tensor)),
            ("dma_heap", Box::new(dma_heap)),
            (
                "raw_ioctls",
                Box::new(|| {
                    let a = dev.alloc(size as u64, 0).expect("ALLOC");
                    let m = dev.map(a.mmap_offset, size as u64).expect("mmap");
                    touch_pages(m.as_ptr(), size);
                    drop(m);
                    dev.free(a.handle).expect("FREE");
                }),
            ),
        ];
        if let Some(v) = &vgem {
            cases.push((
                "vgem",
                Box::new(move || {
                    let h = v.create(size).expect("vgem create");
                    let off = v.map_offset(h).expect("vgem map offset");
                    let p = v.mmap(off, size).expect("vgem mmap");
                    touch_pages(p, size);
                    unmap(p.cast(), size);
                    v.close(h).expect("vgem close");
                }),
            ));
        }
        if let Some(u) = &udmabuf {
            cases.push((
                "udmabuf",
                Box::new(move || {
                    let fd = u.create(size).expect("udmabuf create");
                    let p = map_shared(&fd, size);
                    touch_pages(p.cast(), size);
                    unmap(p, size);
                    drop(fd);
                }),
            ));
        }
        time_cases("5", &size.to_string(), (1, 7, iters), &mut cases);
        if c.profile && (size == 4 * KIB || size == 64 * KIB) {
            profile_case(&format!("fig5 tensor {size}"), false, 3, || {
                for _ in 0..iters {
                    tensor();
                }
            });
            profile_case(&format!("fig5 dma_heap {size}"), false, 3, || {
                for _ in 0..iters {
                    dma_heap();
                }
            });
        }
        note(format!("fig5: {size} bytes done"));
    }
}

/// Figure 6: fence wake latency: a thread blocked in the Dma view's
/// completion wait, woken by a software-engine job, against a thread
/// blocked in read(2) of an eventfd woken by write(2). Each sample is the
/// time from the trigger (SUBMIT, or the eventfd write) until the blocked
/// thread runs again, in microseconds.
fn fig6(c: &Ctx) {
    const WARM: usize = 20;
    const N: usize = 400;
    let src = alloc(c, 4096, "fig6_src");
    let dst = alloc(c, 4096, "fig6_dst");
    let mut done = 0;
    let (fence, submit, after) = fence_wakes(&src, &dst, 64, &mut done, WARM, N);
    let polled = polled_jobs(&src, &dst, WARM, N, true);
    let event = eventfd_wakes(WARM, N);
    let mut wakes = vec![("fence", fence), ("eventfd", event)];
    if let Some(sw) = peer_open("sw_sync", peer::SwSync::open()) {
        wakes.push(("sw_sync", sw_sync_wakes(&sw, WARM, N)));
    }
    if let Some(v) = peer_open("vgem", peer::Vgem::open()) {
        wakes.push(("vgem_fence", vgem_fence_wakes(&v, WARM, N)));
    }
    // SUBMIT with nobody to wake: the ioctl alone (userlib's sys layer),
    // and a `Job` built and dropped, or built and submitted, in ns.
    let desc = tdrv_uapi::tdrv_copy_desc {
        src_handle: src.dma_handle().expect("Dma handle"),
        dst_handle: dst.dma_handle().expect("Dma handle"),
        size: 64,
        ..Default::default()
    };
    let mut cases: Vec<Case> = vec![
        (
            "sys_submit",
            Box::new(|| {
                black_box(c.dev.submit(&[desc]).expect("SUBMIT"));
            }),
        ),
        (
            "job_build",
            Box::new(|| {
                let mut job = Job::new();
                job.copy(&src, 0, &dst, 0, 64).expect("job copy");
                black_box(job);
            }),
        ),
        (
            "job_submit",
            Box::new(|| {
                let mut job = Job::new();
                job.copy(&src, 0, &dst, 0, 64).expect("job copy");
                drop(black_box(job.submit().expect("submit")));
            }),
        ),
    ];
    time_cases("6", "submit", (2, 9, 2000), &mut cases);
    drop(cases);
    for (method, w) in wakes {
        emit_samples("6", "wake", method, "us", &w);
        emit("6", "wake", method, "us", &summarize(w), &[]);
    }
    emit(
        "6",
        "wake",
        "fence_after_submit",
        "us",
        &summarize(after),
        &[],
    );
    emit("6", "wake", "submit_ioctl", "us", &summarize(submit), &[]);
    emit(
        "6",
        "wake",
        "submit_to_done_polled",
        "us",
        &summarize(polled),
        &[],
    );
    if c.profile {
        // Every task of the CPU (the kworker running the jobs too), on a
        // loop with no idle time: the sampling timer only fires at ticks.
        profile_case("fig6 submit+poll (whole CPU)", true, 1, || {
            polled_jobs(&src, &dst, 0, 3000, false);
        });
        // The submitting task alone: with two CPUs the whole-CPU profile
        // may sample the other one, and a job the software device runs
        // in SUBMIT is all in this task.
        profile_case("fig6 submit+poll (task)", false, 1, || {
            polled_jobs(&src, &dst, 0, 3000, false);
        });
        // SUBMIT alone (its job runs inside it), with nobody to wake.
        let desc = tdrv_uapi::tdrv_copy_desc {
            src_handle: src.dma_handle().expect("Dma handle"),
            dst_handle: dst.dma_handle().expect("Dma handle"),
            size: 64,
            ..Default::default()
        };
        profile_case("fig6 sys submit (task)", false, 1, || {
            for _ in 0..20_000 {
                black_box(c.dev.submit(&[desc]).expect("SUBMIT"));
            }
        });
    }
}

/// How long the trigger waits before firing, so that the waiter is asleep
/// in the kernel (one CPU: it runs while we sleep).
const WAKE_PAUSE: Duration = Duration::from_millis(1);

/// The calling thread's CPU affinity while it lives; restored on drop.
///
/// The wake-up figures run the signalling thread on CPU 0 and the waiter
/// on CPU 1, for every method alike: left to the scheduler, a waiter
/// sometimes sleeps on the signaller's CPU, where its wake-up is a
/// different path (no IPI, a preemption at the signaller's return), and
/// a method's samples split between the two.
struct Pinned(Option<libc::cpu_set_t>);

impl Pinned {
    /// Pins the calling thread to `cpu` (nothing if the guest lacks it).
    fn to(cpu: usize) -> Self {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cpu >= n {
            return Self(None);
        }
        // SAFETY: `cpu_set_t` is plain data for which all-zero is the
        // empty set; the calls get its size and a valid pointer.
        unsafe {
            let mut old: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut old) != 0 {
                return Self(None);
            }
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Self(None);
            }
            Self(Some(old))
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            // SAFETY: `old` is the set `sched_getaffinity` returned.
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), old) };
        }
    }
}

/// Fence wake samples (µs): from SUBMIT until the waiter runs, the SUBMIT
/// call's own time, and from SUBMIT's return until the waiter runs (the
/// engine picking the job up, the copy, the completion and the wake-up).
/// `done` counts the jobs that completed on `dst` so far.
fn fence_wakes(
    src: &Tensor,
    dst: &Tensor,
    len: usize,
    done: &mut u64,
    warm: usize,
    n: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    // The waiter blocks in COMPLETION_WAIT for the k-th completion.
    let (go_tx, go_rx) = mpsc::channel::<u64>();
    let (done_tx, done_rx) = mpsc::channel::<Instant>();
    let waiter_view = dst.clone();
    let _pin = Pinned::to(0);
    let waiter = std::thread::spawn(move || {
        let _pin = Pinned::to(1);
        while let Ok(k) = go_rx.recv() {
            waiter_view
                .completion()
                .wait(k, None)
                .expect("completion wait");
            done_tx.send(Instant::now()).expect("send");
        }
    });
    let mut wake = Vec::with_capacity(n);
    let mut submit = Vec::with_capacity(n);
    let mut after = Vec::with_capacity(n);
    // Every other round reads the clock when SUBMIT returns, for the
    // split; the wake samples come from the rounds without that read,
    // which the other methods' rounds do not have either.
    for i in 0..warm + 2 * n {
        let split = i % 2 == 1;
        let mut job = Job::new();
        job.copy(src, 0, dst, 0, len).expect("job copy");
        *done += 1;
        go_tx.send(*done).expect("send");
        std::thread::sleep(WAKE_PAUSE);
        let t0 = Instant::now();
        let handle = job.submit().expect("submit");
        let ts = split.then(Instant::now);
        let t1 = done_rx.recv().expect("recv");
        if i >= warm {
            match ts {
                Some(ts) => {
                    submit.push((ts - t0).as_nanos() as f64 / 1000.0);
                    after.push((t1 - ts).as_nanos() as f64 / 1000.0);
                }
                None => wake.push((t1 - t0).as_nanos() as f64 / 1000.0),
            }
        }
        drop(handle);
    }
    drop(go_tx);
    waiter.join().expect("waiter");
    (wake, submit, after)
}

/// Diagnostic: SUBMIT until the job is seen done by a poller that yields
/// the CPU between polls (no thread blocked), in µs.
fn polled_jobs(src: &Tensor, dst: &Tensor, warm: usize, n: usize, pause: bool) -> Vec<f64> {
    let mut polled = Vec::with_capacity(n);
    for i in 0..warm + n {
        let mut job = Job::new();
        job.copy(src, 0, dst, 0, 64).expect("job copy");
        if pause {
            std::thread::sleep(WAKE_PAUSE);
        }
        let t0 = Instant::now();
        let handle = job.submit().expect("submit");
        while handle.poll().expect("poll") != JobState::Done {
            std::thread::yield_now();
        }
        if i >= warm {
            polled.push(t0.elapsed().as_nanos() as f64 / 1000.0);
        }
    }
    polled
}

/// The baseline: write(2) to an eventfd until the thread blocked in its
/// read(2) runs, in µs.
fn eventfd_wakes(warm: usize, n: usize) -> Vec<f64> {
    // SAFETY: eventfd has no memory-safety preconditions.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(efd >= 0, "eventfd: {}", errno_str());
    // SAFETY: the descriptor was just created and is owned by nobody else.
    let efd = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<Instant>();
    let reader_fd = efd.clone();
    let _pin = Pinned::to(0);
    let reader = std::thread::spawn(move || {
        let _pin = Pinned::to(1);
        while go_rx.recv().is_ok() {
            let mut v = 0u64;
            // SAFETY: reads 8 bytes into `v`, a live u64.
            let r = unsafe {
                libc::read(
                    reader_fd.as_raw_fd(),
                    (&mut v as *mut u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
            assert_eq!(r, 8, "eventfd read: {}", errno_str());
            done_tx.send(Instant::now()).expect("send");
        }
    });
    let mut event = Vec::with_capacity(n);
    for i in 0..warm + n {
        go_tx.send(()).expect("send");
        std::thread::sleep(WAKE_PAUSE);
        let one = 1u64;
        let t0 = Instant::now();
        // SAFETY: writes the 8 bytes of `one`.
        let r = unsafe {
            libc::write(
                efd.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        assert_eq!(r, 8, "eventfd write: {}", errno_str());
        let t1 = done_rx.recv().expect("recv");
        if i >= warm {
            event.push((t1 - t0).as_nanos() as f64 / 1000.0);
        }
    }
    drop(go_tx);
    reader.join().expect("reader");
    event
}

/// Wake-up latency of a peer, in µs: for each of `warm + n` rounds, `arm`
/// makes the thing to wait on (given to the waiter, which blocks in
/// `wait`), and after a pause `fire` signals it; a sample is the time from
/// `fire` until the waiter runs.
fn peer_wakes<W: Send>(
    warm: usize,
    n: usize,
    mut arm: impl FnMut(u32) -> W,
    wait: impl Fn(W) + Sync,
    mut fire: impl FnMut(),
) -> Vec<f64> {
    let (go_tx, go_rx) = mpsc::channel::<W>();
    let (done_tx, done_rx) = mpsc::channel::<Instant>();
    let mut out = Vec::with_capacity(n);
    let _pin = Pinned::to(0);
    std::thread::scope(|s| {
        let wait = &wait;
        s.spawn(move || {
            let _pin = Pinned::to(1);
            while let Ok(w) = go_rx.recv() {
                wait(w);
                done_tx.send(Instant::now()).expect("send");
            }
        });
        for i in 0..warm + n {
            go_tx.send(arm(i as u32 + 1)).expect("send");
            std::thread::sleep(WAKE_PAUSE);
            let t0 = Instant::now();
            fire();
            let t1 = done_rx.recv().expect("recv");
            if i >= warm {
                out.push((t1 - t0).as_nanos() as f64 / 1000.0);
            }
        }
        drop(go_tx);
    });
    out
}

/// sw_sync: SW_SYNC_IOC_INC until the thread blocked in poll(2) on the
/// sync_file of the fence it signalled runs, in µs.
fn sw_sync_wakes(sw: &peer::SwSync, warm: usize, n: usize) -> Vec<f64> {
    peer_wakes(
        warm,
        n,
        |k| sw.fence(k).expect("sw_sync fence"),
        |fd: OwnedFd| poll_in(fd.as_raw_fd()),
        || sw.inc().expect("sw_sync inc"),
    )
}

/// vgem: DRM_IOCTL_VGEM_FENCE_SIGNAL of a write fence attached to a GEM
/// object until the thread blocked in poll(2) on the object's dma-buf (which
/// waits for its write fences) runs, in µs.
fn vgem_fence_wakes(v: &peer::Vgem, warm: usize, n: usize) -> Vec<f64> {
    let h = v.create(4096).expect("vgem create");
    let buf = v.export(h).expect("vgem export");
    let fence = std::cell::Cell::new(0);
    let w = peer_wakes(
        warm,
        n,
        |_| fence.set(v.fence_attach(h).expect("vgem fence attach")),
        |()| poll_in(buf.as_raw_fd()),
        || v.fence_signal(fence.get()).expect("vgem fence signal"),
    );
    drop(buf);
    v.close(h).expect("vgem close");
    w
}

/// Figure 7, scale: heap bytes per view with 1M slices (against a Box of a view's
/// size); bytes per storage, user and kernel, with 10,000 live 4 KiB Dma
/// tensors (against 10,000 dma-heap buffers); alloc/free time per buffer
/// with 10 and with 10,000 live buffers in the file.
fn fig7(c: &Ctx) {
    const VIEWS: usize = 1_000_000;
    let t = alloc(c, 4096, "fig7");
    let mut per_view = Vec::new();
    let mut per_box = Vec::new();
    let mut slice_ns = Vec::new();
    for _ in 0..3 {
        let mut v: Vec<Tensor> = Vec::with_capacity(VIEWS);
        let before = heap_in_use();
        let t0 = Instant::now();
        for i in 0..VIEWS {
            v.push(t.slice((i % 64) * 64, 64, None).expect("slice"));
        }
        slice_ns.push(t0.elapsed().as_nanos() as f64 / VIEWS as f64);
        per_view.push((heap_in_use() - before) as f64 / VIEWS as f64);
        drop(v);
        let mut b: Vec<Box<[u8; VIEW_HEAP_SIZE]>> = Vec::with_capacity(VIEWS);
        let before = heap_in_use();
        for _ in 0..VIEWS {
            b.push(black_box(Box::new([0u8; VIEW_HEAP_SIZE])));
        }
        per_box.push((heap_in_use() - before) as f64 / VIEWS as f64);
    }
    let layout = [("view_heap_size", VIEW_HEAP_SIZE as f64)];
    emit(
        "7",
        "view",
        "tensor_slice",
        "B",
        &summarize(per_view),
        &layout,
    );
    emit("7", "view", "box", "B", &summarize(per_box), &layout);
    emit(
        "7",
        "view",
        "slice_keep_time",
        "ns",
        &summarize(slice_ns),
        &[],
    );
    drop(t);
    note("fig7: 1M views done");

    // Alloc/free time with few and with many live buffers.
    const FEW: usize = 10;
    const MANY: usize = 10_000;
    const HUGE: usize = 100_000;
    let dev = &c.dev;
    let measure = |label: &str| {
        // Let deferred frees (RCU callbacks, workers) of earlier steps run
        // before timing: idle guest time costs no host time.
        std::thread::sleep(Duration::from_secs(2));
        let mut cases: Vec<Case> = vec![
            (
                "tensor",
                Box::new(|| drop(Tensor::allocate_on(dev, 0, 4096, None).expect("alloc"))),
            ),
            (
                "raw_ioctls",
                Box::new(|| {
                    let a = dev.alloc(4096, 0).expect("ALLOC");
                    dev.free(a.handle).expect("FREE");
                }),
            ),
        ];
        time_cases("7", label, (1, 7, 500), &mut cases);
    };
    let mut live: Vec<Tensor> = Vec::with_capacity(MANY);
    for _ in 0..FEW {
        live.push(alloc(c, 4096, "live"));
    }
    measure("live_10");
    let heap0 = heap_in_use();
    let free0 = meminfo("MemFree");
    let slab0 = meminfo("Slab");
    for _ in FEW..MANY {
        live.push(alloc(c, 4096, "live"));
    }
    let added = (MANY - FEW) as f64;
    let user = (heap_in_use() - heap0) as f64 / added;
    let kernel = (free0 as f64 - meminfo("MemFree") as f64) / added - 4096.0;
    let slab = (meminfo("Slab") as f64 - slab0 as f64) / added;
    measure("live_10000");
    // 100,000 live: the rest are bare buffers (ALLOC without a mapping or
    // a Tensor: 100,000 mappings would exceed vm.max_map_count, and only
    // the file's handle count matters here).
    let mut bare = Vec::with_capacity(HUGE - MANY);
    for _ in MANY..HUGE {
        match dev.alloc(4096, 0) {
            Ok(a) => bare.push(a.handle),
            Err(e) => {
                note(format!("fig7: ALLOC #{} failed: {e}", MANY + bare.len()));
                break;
            }
        }
    }
    if bare.len() == HUGE - MANY {
        measure("live_100000");
    }
    for h in bare {
        dev.free(h).expect("FREE");
    }
    live.truncate(FEW);
    measure("live_10_after");
    drop(live);

    // The dma-heap baseline of the per-buffer kernel memory. The frees
    // above return memory in the background (RCU, workers): let them
    // finish first, or MemFree rises during the measurement.
    std::thread::sleep(Duration::from_secs(2));
    raise_nofile(16_384);
    let heap = open_rw(dma_heap::SYSTEM);
    let mut bufs = Vec::with_capacity(MANY);
    let hfree0 = meminfo("MemFree");
    let hslab0 = meminfo("Slab");
    for _ in FEW..MANY {
        let fd = heap_alloc(&heap, 4096);
        let p = map_shared(&fd, 4096);
        bufs.push((fd, p));
    }
    let hkernel = (hfree0 as f64 - meminfo("MemFree") as f64) / added - 4096.0;
    let hslab = (meminfo("Slab") as f64 - hslab0 as f64) / added;
    for (fd, p) in bufs {
        unmap(p, 4096);
        drop(fd);
    }
    let one = |x: f64| Summary::single(x, MANY - FEW);
    emit("7", "storage", "tensor_user_heap", "B", &one(user), &[]);
    emit(
        "7",
        "storage",
        "tensor_kernel",
        "B",
        &one(kernel),
        &[("slab", slab)],
    );
    emit(
        "7",
        "storage",
        "dma_heap_kernel",
        "B",
        &one(hkernel),
        &[("slab", hslab)],
    );
}

/// Figure 8, submit throughput: 1-descriptor 4 KiB copy jobs submitted
/// from 1, 2 and 4 threads sharing the device file, each thread with its
/// own buffers and up to `WINDOW` jobs in flight. Reports jobs per second
/// of guest time for each thread count, per round.
fn fig8(c: &Ctx) {
    const JOBS: usize = 400;
    const WINDOW: usize = 8;
    const REPS: usize = 5;
    let threads = [1usize, 2, 4];
    let bufs: Vec<(Tensor, Tensor)> = (0..4)
        .map(|_| (alloc(c, 4096, "fig8_src"), alloc(c, 4096, "fig8_dst")))
        .collect();
    let run = |k: usize| -> f64 {
        let barrier = std::sync::Barrier::new(k + 1);
        std::thread::scope(|s| {
            for (src, dst) in &bufs[..k] {
                let barrier = &barrier;
                s.spawn(move || {
                    let mut inflight = std::collections::VecDeque::with_capacity(WINDOW);
                    barrier.wait();
                    for _ in 0..JOBS {
                        if inflight.len() == WINDOW {
                            let h: tdrv::JobHandle = inflight.pop_front().expect("job");
                            h.wait().expect("job wait");
                        }
                        let mut job = Job::new();
                        job.copy(src, 0, dst, 0, 4096).expect("job copy");
                        inflight.push_back(job.submit().expect("submit"));
                    }
                    for h in inflight {
                        h.wait().expect("job wait");
                    }
                    barrier.wait();
                });
            }
            barrier.wait();
            let t0 = Instant::now();
            barrier.wait();
            (k * JOBS) as f64 / t0.elapsed().as_secs_f64()
        })
    };
    let mut samples = vec![Vec::with_capacity(REPS); threads.len()];
    for round in 0..REPS + 1 {
        for (i, &k) in threads.iter().enumerate() {
            let rate = run(k);
            if round > 0 {
                samples[i].push(rate);
            }
        }
    }
    for (k, s) in threads.iter().zip(samples) {
        emit(
            "8",
            "submit",
            &format!("threads_{k}"),
            "jobs/s",
            &summarize(s),
            &[("threads", *k as f64), ("jobs_per_thread", JOBS as f64)],
        );
    }
}

// ---------------------------------------------------------------------
// Figures 10-12: the completion plane (issue 36)

/// The descriptors of a 4 KiB copy from `src` to `dst` that the device
/// queues rather than running inside SUBMIT: on the software device, 17
/// descriptors (it runs a job of at most 16 inline when idle, see
/// driver/backends/soft.rs); other devices never run jobs inline, so one.
fn queued_4k(kind: DeviceKind, src: u64, dst: u64) -> Vec<tdrv_uapi::tdrv_copy_desc> {
    let pieces: u64 = if kind == DeviceKind::Soft { 17 } else { 1 };
    let total = 4 * KIB as u64;
    let step = total / pieces;
    (0..pieces)
        .map(|i| {
            let off = i * step;
            let size = if i + 1 == pieces { total - off } else { step };
            tdrv_uapi::tdrv_copy_desc {
                src_handle: src,
                src_offset: off,
                dst_handle: dst,
                dst_offset: off,
                size,
            }
        })
        .collect()
}

/// A `Job` copying 4 KiB from `src` to `dst` in the shape of [`queued_4k`].
fn queued_job(kind: DeviceKind, src: &Tensor, dst: &Tensor) -> Job {
    let mut job = Job::new();
    let pieces = if kind == DeviceKind::Soft { 17 } else { 1 };
    let step = 4 * KIB / pieces;
    for i in 0..pieces {
        let off = i * step;
        let len = if i + 1 == pieces { 4 * KIB - off } else { step };
        job.copy(src, off, dst, off, len).expect("job copy");
    }
    job
}

/// One method of an interleaved wake-up measurement: `arm` prepares a
/// round and returns the token the waiter waits with; the waiter blocks in
/// `wait(token)` on a thread of its own (CPU 1); after a pause `fire(token)`
/// wakes it (CPU 0). A sample is the time from `fire` until the waiter runs.
struct WakeMethod<'a> {
    name: &'static str,
    arm: Box<dyn FnMut() -> u64 + 'a>,
    wait: Box<dyn Fn(u64) + Send + Sync + 'a>,
    fire: Box<dyn FnMut(u64) + 'a>,
}

/// Runs the methods round by round (each round one wake-up of every
/// method, in turn), `warm` rounds discarded; the µs samples per method.
fn interleaved_wakes(warm: usize, n: usize, methods: Vec<WakeMethod<'_>>) -> Vec<Vec<f64>> {
    let mut out = vec![Vec::with_capacity(n); methods.len()];
    let mut arms = Vec::new();
    let mut waits = Vec::new();
    let mut fires = Vec::new();
    for m in methods {
        arms.push(m.arm);
        waits.push(m.wait);
        fires.push(m.fire);
    }
    let _pin = Pinned::to(0);
    std::thread::scope(|s| {
        let mut chans = Vec::new();
        for wait in &waits {
            let (go_tx, go_rx) = mpsc::channel::<u64>();
            let (done_tx, done_rx) = mpsc::channel::<Instant>();
            s.spawn(move || {
                let _pin = Pinned::to(1);
                while let Ok(t) = go_rx.recv() {
                    wait(t);
                    done_tx.send(Instant::now()).expect("send");
                }
            });
            chans.push((go_tx, done_rx));
        }
        for round in 0..warm + n {
            for (i, (arm, fire)) in arms.iter_mut().zip(fires.iter_mut()).enumerate() {
                let token = arm();
                chans[i].0.send(token).expect("send");
                std::thread::sleep(WAKE_PAUSE);
                let t0 = Instant::now();
                fire(token);
                let t1 = chans[i].1.recv().expect("recv");
                if round >= warm {
                    out[i].push((t1 - t0).as_nanos() as f64 / 1000.0);
                }
            }
        }
        drop(chans);
    });
    out
}

/// Blocks in read(2) of `dev`'s completion events until at least one comes.
fn read_one_event(dev: &raw::Dev) {
    let mut evs = [tdrv_uapi::tdrv_event::default(); 4];
    loop {
        match dev.read_events(&mut evs) {
            Ok(n) => {
                assert!(n >= 1);
                for e in &evs[..n] {
                    assert_eq!(e.status, 0, "job {} failed", e.job_id);
                }
                return;
            }
            Err(libc::EINTR) => continue,
            Err(e) => panic!("read of events: errno {e}"),
        }
    }
}

/// An eventfd for the baseline methods.
fn new_eventfd() -> Arc<OwnedFd> {
    // SAFETY: eventfd has no memory-safety preconditions.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(efd >= 0, "eventfd: {}", errno_str());
    // SAFETY: the descriptor was just created and is owned by nobody else.
    Arc::new(unsafe { OwnedFd::from_raw_fd(efd) })
}

/// Figure 10 (issue 36 item 1): event wake latency. A thread blocked in
/// read(2) of the file's completion events, woken by a queued 4 KiB job,
/// against the same job waited with JOB_WAIT, an eventfd write → read and
/// sw_sync → poll. Two triggers:
///
/// - from SUBMIT (`event_submit_notify`): SUBMIT asking for the job's
///   event itself (`TDRV_SUBMIT_NOTIFY`, ABI 1.6) until the reader runs;
///   the baseline is `eventfd`. `event_submit` is the same with a
///   JOB_NOTIFY after SUBMIT (the way before ABI 1.6). JOB_WAIT cannot be
///   timed so: it needs the job's id, which exists only once SUBMIT
///   returned.
/// - from a gate (`event_gated`, `job_wait_gated`): the job is submitted
///   behind an sw_sync in-fence and (for the event) JOB_NOTIFY'd, the
///   waiter blocks, and the sample runs from the gate's SW_SYNC_IOC_INC
///   until the waiter runs: the engine starting the job, the copy, the
///   completion and the wake-up, the same for both waits. `sw_sync` alone
///   (the gate's own wake of a poll(2)er) is its floor.
///
/// Runs on the software device (icount guest) and on sim (`--only sim`).
fn fig10(c: &Ctx) {
    const WARM: usize = 20;
    let n: usize = if c.dev.kind() == DeviceKind::Sim {
        200
    } else {
        300
    };
    let kind = c.dev.kind();
    let case = kind.to_string();
    let dev = ok("open", raw::Dev::open(&c.path));
    let src = ok("alloc", dev.alloc(4 * KIB as u64, 0)).handle;
    let dst = ok("alloc", dev.alloc(4 * KIB as u64, 0)).handle;
    let descs = queued_4k(kind, src, dst);
    let efd = new_eventfd();
    let sw = peer_open("sw_sync", peer::SwSync::open());
    let timeline = std::cell::Cell::new(0u32);
    let dev = &dev;
    let descs = &descs;
    let mut methods: Vec<WakeMethod> = vec![
        WakeMethod {
            name: "event_submit",
            arm: Box::new(|| 0),
            wait: Box::new(move |_| read_one_event(dev)),
            fire: Box::new(move |_| {
                let id = dev.submit(descs).expect("SUBMIT");
                dev.job_notify(id, id).expect("JOB_NOTIFY");
            }),
        },
        WakeMethod {
            name: "event_submit_notify",
            arm: Box::new(|| 0),
            wait: Box::new(move |_| read_one_event(dev)),
            fire: Box::new(move |_| {
                dev.submit_notify(descs, 1)
                    .expect("SUBMIT with TDRV_SUBMIT_NOTIFY");
            }),
        },
        WakeMethod {
            name: "eventfd",
            arm: Box::new(|| 0),
            wait: {
                let efd = efd.clone();
                Box::new(move |_| {
                    let mut v = 0u64;
                    // SAFETY: reads 8 bytes into `v`, a live u64.
                    let r = unsafe { libc::read(efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
                    assert_eq!(r, 8, "eventfd read: {}", errno_str());
                })
            },
            fire: Box::new(|_| {
                let one = 1u64;
                // SAFETY: writes the 8 bytes of `one`.
                let r = unsafe { libc::write(efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
                assert_eq!(r, 8, "eventfd write: {}", errno_str());
            }),
        },
    ];
    if let Some(sw) = &sw {
        let tl = &timeline;
        // A gated job: submitted behind the next value of the timeline.
        let gated = move |notify: bool| -> u64 {
            tl.set(tl.get() + 1);
            let fence = sw.fence(tl.get()).expect("sw_sync fence");
            let (id, _) = dev
                .submit_fences(descs, &[fence.as_raw_fd()], false)
                .expect("SUBMIT with an in-fence");
            if notify {
                dev.job_notify(id, id).expect("JOB_NOTIFY");
            }
            id
        };
        methods.push(WakeMethod {
            name: "event_gated",
            arm: Box::new(move || gated(true)),
            wait: Box::new(move |_| read_one_event(dev)),
            fire: Box::new(move |_| sw.inc().expect("sw_sync inc")),
        });
        methods.push(WakeMethod {
            name: "job_wait_gated",
            arm: Box::new(move || gated(false)),
            wait: Box::new(move |id| {
                let (state, status) = dev.job_wait(id, -1).expect("JOB_WAIT");
                assert_eq!((state, status), (tdrv_uapi::TDRV_JOB_DONE, 0));
            }),
            fire: Box::new(move |_| sw.inc().expect("sw_sync inc")),
        });
        methods.push(WakeMethod {
            name: "sw_sync",
            arm: Box::new(move || {
                tl.set(tl.get() + 1);
                sw.fence(tl.get()).expect("sw_sync fence").into_raw_fd() as u64
            }),
            wait: Box::new(|fd| {
                // SAFETY: `arm` gave up this descriptor to the waiter.
                let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
                poll_in(fd.as_raw_fd());
            }),
            fire: Box::new(move |_| sw.inc().expect("sw_sync inc")),
        });
    }
    let names: Vec<&str> = methods.iter().map(|m| m.name).collect();
    let samples = interleaved_wakes(WARM, n, methods);
    for (name, v) in names.into_iter().zip(samples) {
        emit_samples("10", &case, name, "us", &v);
        emit(
            "10",
            &case,
            name,
            "us",
            &summarize(v),
            &[("descs", descs.len() as f64)],
        );
    }
    if c.profile {
        profile_case("fig10 submit+notify+read (task)", false, 1, || {
            for _ in 0..2000 {
                let id = dev.submit(descs).expect("SUBMIT");
                dev.job_notify(id, id).expect("JOB_NOTIFY");
                read_one_event(dev);
            }
        });
    }
    for h in [src, dst] {
        dev.free(h).expect("FREE");
    }
}

/// Jobs and files of figure 11.
const EV_FILES: usize = 10;
const EV_JOBS: usize = 10_000;

/// Figure 11 (issue 36 item 2): event throughput. 10,000 queued 4 KiB
/// jobs spread over 10 files, all submitted, then awaited through one
/// epoll set with reads of up to 64 events, each asked for with JOB_NOTIFY
/// (`events_epoll`) or in SUBMIT itself (`events_submit_notify`, ABI 1.6),
/// against the
/// same jobs each waited with JOB_WAIT (`job_wait_each`) and the floor:
/// SUBMIT alone (`submit_only`, then one JOB_WAIT per file for the last
/// job, so the round ends with the engine idle) and one refused ioctl
/// (`ioctl_enotty`). In ns per job.
fn fig11(c: &Ctx) {
    let kind = c.dev.kind();
    let per = EV_JOBS / EV_FILES;
    let files: Vec<(raw::Dev, Vec<tdrv_uapi::tdrv_copy_desc>)> = (0..EV_FILES)
        .map(|_| {
            let d = ok("open", raw::Dev::open(&c.path));
            let s = ok("alloc", d.alloc(4 * KIB as u64, 0)).handle;
            let t = ok("alloc", d.alloc(4 * KIB as u64, 0)).handle;
            let descs = queued_4k(kind, s, t);
            (d, descs)
        })
        .collect();
    // SAFETY: epoll_create1 has no memory-safety preconditions.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(ep >= 0, "epoll_create1: {}", errno_str());
    // SAFETY: just created, owned here.
    let ep = unsafe { OwnedFd::from_raw_fd(ep) };
    for (i, (d, _)) in files.iter().enumerate() {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: i as u64,
        };
        // SAFETY: a live epoll_event; both fds are open.
        let r = unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, d.fd(), &mut ev) };
        assert_eq!(r, 0, "epoll_ctl: {}", errno_str());
    }
    let files = &files;
    let ep_fd = ep.as_raw_fd();
    // How each job asks for its event: not at all, with JOB_NOTIFY after
    // SUBMIT, or in SUBMIT itself (TDRV_SUBMIT_NOTIFY, ABI 1.6).
    #[derive(Clone, Copy, PartialEq)]
    enum Ask {
        Nothing,
        JobNotify,
        InSubmit,
    }
    let submit_all = |ask: Ask| -> Vec<Vec<u64>> {
        let mut ids: Vec<Vec<u64>> = (0..EV_FILES).map(|_| Vec::with_capacity(per)).collect();
        // Round-robin over the files, as a server with many clients would.
        for _ in 0..per {
            for (f, (d, descs)) in files.iter().enumerate() {
                let id = if ask == Ask::InSubmit {
                    let next = ids[f].last().map_or(1, |l| l + 1);
                    d.submit_notify(descs, next).expect("SUBMIT_NOTIFY")
                } else {
                    d.submit(descs).expect("SUBMIT")
                };
                if ask == Ask::JobNotify {
                    d.job_notify(id, id).expect("JOB_NOTIFY");
                }
                ids[f].push(id);
            }
        }
        ids
    };
    // Every event of EV_JOBS jobs, through the epoll set, read up to 64
    // at a time.
    let reap_all = move || {
        let mut got = 0;
        let mut ready = [libc::epoll_event { events: 0, u64: 0 }; EV_FILES];
        let mut evs = [tdrv_uapi::tdrv_event::default(); 64];
        while got < EV_JOBS {
            // SAFETY: `ready` has room for EV_FILES entries.
            let n = unsafe { libc::epoll_wait(ep_fd, ready.as_mut_ptr(), EV_FILES as i32, -1) };
            if n < 0 {
                assert_eq!(raw::errno(), libc::EINTR, "epoll_wait");
                continue;
            }
            for r in &ready[..n as usize] {
                let (d, _) = &files[r.u64 as usize];
                match d.read_events(&mut evs) {
                    Ok(k) => got += k,
                    Err(libc::EAGAIN) => {}
                    Err(e) => panic!("read of events: errno {e}"),
                }
            }
        }
    };
    let null = open_rw("/dev/null");
    let unknown = (3u64 << 30) | (88 << 16) | (0xD7 << 8) | 0x7f;
    let mut cases: Vec<Case> = vec![
        (
            "submit_only",
            Box::new(|| {
                let ids = submit_all(Ask::Nothing);
                for (f, (d, _)) in files.iter().enumerate() {
                    d.job_wait(*ids[f].last().expect("a job"), -1)
                        .expect("JOB_WAIT");
                }
            }),
        ),
        (
            "ioctl_enotty",
            Box::new(|| {
                let mut buf = [0u8; 88];
                for (d, _) in files.iter().cycle().take(EV_JOBS) {
                    // SAFETY: `buf` is as large as the size the request
                    // encodes; tdrv refuses it before touching it.
                    let r = unsafe { libc::ioctl(d.fd(), unknown as _, buf.as_mut_ptr()) };
                    assert!(r < 0);
                }
                let _ = &null;
            }),
        ),
        (
            "job_wait_each",
            Box::new(|| {
                let ids = submit_all(Ask::Nothing);
                for (f, (d, _)) in files.iter().enumerate() {
                    for &id in &ids[f] {
                        d.job_wait(id, -1).expect("JOB_WAIT");
                    }
                }
            }),
        ),
        (
            "events_epoll",
            Box::new(|| {
                submit_all(Ask::JobNotify);
                reap_all();
            }),
        ),
        (
            "events_submit_notify",
            Box::new(|| {
                submit_all(Ask::InSubmit);
                reap_all();
            }),
        ),
    ];
    // The reads must not block once epoll said ready, but another read
    // may have taken the events: non-blocking files.
    for (d, _) in files.iter() {
        d.set_nonblock(true).expect("O_NONBLOCK");
    }
    let samples = interleave(1, 7, 1, &mut cases);
    for ((name, _), s) in cases.iter().zip(samples) {
        let per_job: Vec<f64> = s.iter().map(|ns| ns / EV_JOBS as f64).collect();
        emit(
            "11",
            &kind.to_string(),
            name,
            "ns",
            &summarize(per_job),
            &[("jobs", EV_JOBS as f64), ("files", EV_FILES as f64)],
        );
    }
    drop(cases);
    if c.profile {
        let (d, descs) = &files[0];
        // `rounds` batches of 64 jobs, each submitted by `submit` (given
        // the batch's previous id), the last waited for with JOB_WAIT, and
        // with `read` their 64 events read, each read after an epoll_wait
        // with `epoll`.
        let batches = |rounds: usize, submit: &dyn Fn(u64) -> u64, read: bool, epoll: bool| {
            let mut evs = [tdrv_uapi::tdrv_event::default(); 64];
            let mut ready = [libc::epoll_event { events: 0, u64: 0 }; EV_FILES];
            for _ in 0..rounds {
                let mut last = 0;
                for _ in 0..64 {
                    last = submit(last);
                }
                d.job_wait(last, -1).expect("JOB_WAIT");
                let mut got = 0;
                while read && got < 64 {
                    if epoll {
                        // SAFETY: `ready` has room for EV_FILES entries.
                        let _ = unsafe {
                            libc::epoll_wait(ep_fd, ready.as_mut_ptr(), EV_FILES as i32, -1)
                        };
                    }
                    got += d.read_events(&mut evs).unwrap_or(0);
                }
            }
        };
        // JOB_NOTIFY + the reads, with nobody blocked: what the event
        // path adds to SUBMIT.
        profile_case("fig11 submit+notify+read (task)", false, 1, || {
            let submit = |_| {
                let id = d.submit(descs).expect("SUBMIT");
                d.job_notify(id, id).expect("JOB_NOTIFY");
                id
            };
            batches(50, &submit, true, false);
        });
        // What the event path adds, as the difference of two profiles:
        // 64,000 one-piece jobs (run inside SUBMIT) without events, and
        // the same with SUBMIT_NOTIFY, the file in the epoll set, and the
        // events read 64 at a time. Sampled every 2 us.
        let one = [descs[0]];
        profile_case_every(2_000, "fig11 inline SUBMIT (task)", false, 1, || {
            batches(1000, &|_| d.submit(&one).expect("SUBMIT"), false, false);
        });
        profile_case_every(
            2_000,
            "fig11 inline SUBMIT_NOTIFY+epoll+read (task)",
            false,
            1,
            || {
                let submit = |last| d.submit_notify(&one, last).expect("SUBMIT_NOTIFY");
                batches(1000, &submit, true, true);
            },
        );
        // The same with the event asked for in SUBMIT (ABI 1.6).
        profile_case("fig11 submit_notify+read (task)", false, 1, || {
            let submit = |last| d.submit_notify(descs, last).expect("SUBMIT_NOTIFY");
            batches(50, &submit, true, false);
        });
    }
}

/// Threads of this process now.
fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// Figure 12 (issue 36 item 3, Rust): 10,000 `JobHandle`s of queued 4 KiB
/// jobs awaited on a tokio current-thread runtime, each in a task of its
/// own, in 10 batches of 1,000 submitted together, against blocking
/// `wait()`s of the same jobs. ns per job; the threads the process has
/// while the tasks wait are recorded (`threads_during`, against
/// `threads_before`): the library's one reactor thread, not one per wait.
fn fig12(c: &Ctx) {
    const BATCH: usize = 1000;
    const BATCHES: usize = 10;
    let kind = c.dev.kind();
    // A Device of its own: the reactor reads the events of a Device whose
    // handles are awaited, and the other figures' Device is not one.
    let dev = ok("open", Device::open(&c.path));
    let src = ok(
        "allocate_on",
        Tensor::allocate_on(&dev, 0, 4 * KIB, Some("fig12s")),
    );
    let dst = ok(
        "allocate_on",
        Tensor::allocate_on(&dev, 0, 4 * KIB, Some("fig12d")),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio runtime");
    let before = thread_count();
    let during = std::cell::Cell::new(0usize);
    let (src, dst) = (&src, &dst);
    let local = tokio::task::LocalSet::new();
    let mut cases: Vec<Case> = vec![
        (
            "blocking_wait",
            Box::new(|| {
                for _ in 0..BATCHES {
                    let hs: Vec<_> = (0..BATCH)
                        .map(|_| queued_job(kind, src, dst).submit().expect("submit"))
                        .collect();
                    for h in hs {
                        h.wait().expect("wait");
                    }
                }
            }),
        ),
        (
            "tokio_await",
            Box::new(|| {
                local.block_on(&rt, async {
                    for _ in 0..BATCHES {
                        let tasks: Vec<_> = (0..BATCH)
                            .map(|_| {
                                let h = queued_job(kind, src, dst).submit().expect("submit");
                                tokio::task::spawn_local(async move { h.await.expect("await") })
                            })
                            .collect();
                        // Let every task poll once (and register) before
                        // counting the threads.
                        tokio::task::yield_now().await;
                        during.set(during.get().max(thread_count()));
                        for t in tasks {
                            t.await.expect("task");
                        }
                    }
                });
            }),
        ),
    ];
    let samples = interleave(1, 7, 1, &mut cases);
    for ((name, _), s) in cases.iter().zip(samples) {
        let per_job: Vec<f64> = s.iter().map(|ns| ns / (BATCH * BATCHES) as f64).collect();
        emit(
            "12",
            &kind.to_string(),
            name,
            "ns",
            &summarize(per_job),
            &[
                ("jobs", (BATCH * BATCHES) as f64),
                ("threads_before", before as f64),
                ("threads_during", during.get() as f64),
            ],
        );
    }
}

// ---------------------------------------------------------------------
// Figure 13: cross-device jobs (issue 36 item 5, issue 33's bench row)

/// Bytes of figure 13's job: 16 MiB, as issue 33 asks.
const XDEV_BYTES: usize = 16 * MIB;

/// Bytes of figure 13's job when edu runs it: edu's DMA engine moves 4 KiB
/// per step, twice per chunk (into its buffer and out), each after 100 ms
/// of virtual time, so a 16 MiB job on it takes minutes of host time per
/// round even under -icount. The ratio does not depend on the size there
/// (8,192 timer waits per 16 MiB against two CPU copies), so 1 MiB says
/// the same in a sixteenth of the time.
const XDEV_BYTES_EDU: usize = MIB;

/// Every tdrv device of the guest, in node order.
fn tdrv_devices() -> Vec<(String, Arc<Device>)> {
    (0..16)
        .filter_map(|i| {
            let p = format!("/dev/tdrv{i}");
            let d = Device::open(&p).ok()?;
            Some((p, d))
        })
        .collect()
}

/// Figure 13 (issue 36 item 5): a 16 MiB copy job (1 MiB on edu: see
/// `XDEV_BYTES_EDU`) on device B whose source is device A's buffer,
/// imported zero-copy (`Tensor::share_to`: EXPORT on A, IMPORT on B),
/// against the same bytes bounced through host memory
/// (COPY_OUT from A into an anonymous buffer, then COPY_IN into B), and
/// B's own copy job between two of its buffers (what the job costs
/// without the import), and the bounce's two halves alone. MB/s; the
/// report's ratio, zero-copy over bounce, is the bounce's time over the
/// zero-copy job's.
///
/// Pairs (exporter > importer): two software devices (`soft_devices=2`)
/// and both directions of soft and edu in the `-icount` guest; soft > sim
/// and sim > soft in the host-clock sim guest. The pair the driver
/// documents as refused (sim memory into a software device, which has no
/// peer-to-peer path to it: EOPNOTSUPP) is reported as such
/// (`13_unsupported`) instead of a number; any other refusal fails the
/// run. (sim > edu works peer-to-peer, but a job on edu in a host-clock
/// guest waits 100 ms of real time per DMA step: the sim guest has no
/// edu.)
fn fig13(c: &Ctx) {
    let devs = tdrv_devices();
    let of = |k: DeviceKind| -> Vec<&(String, Arc<Device>)> {
        devs.iter().filter(|(_, d)| d.kind() == k).collect()
    };
    let (softs, edus, sims) = (
        of(DeviceKind::Soft),
        of(DeviceKind::Edu),
        of(DeviceKind::Sim),
    );
    let mut pairs = Vec::new();
    if let [a, b, ..] = softs[..] {
        pairs.push((a, b));
    } else {
        note(format!(
            "fig13: {} software device(s): soft > soft needs two (soft_devices=2)",
            softs.len()
        ));
    }
    if let (Some(&s), Some(&e)) = (softs.first(), edus.first()) {
        pairs.push((e, s));
        pairs.push((s, e));
    }
    if let (Some(&s), Some(&m)) = (softs.first(), sims.first()) {
        pairs.push((s, m));
        pairs.push((m, s));
    }
    if pairs.is_empty() {
        note(format!(
            "fig13: no pair of tdrv devices in {} ({} found): skipped",
            c.path,
            devs.len()
        ));
    }
    for ((pa, a), (pb, b)) in pairs {
        let case = format!("{}>{}", a.kind(), b.kind());
        let size = if b.kind() == DeviceKind::Edu {
            XDEV_BYTES_EDU
        } else {
            XDEV_BYTES
        };
        fig13_pair(&case, (pa.as_str(), a), (pb.as_str(), b), size);
    }
}

/// One pair of figure 13: `a` exports, `b` imports and runs the job.
fn fig13_pair(
    case: &str,
    (pa, a): (&str, &Arc<Device>),
    (pb, b): (&str, &Arc<Device>),
    size: usize,
) {
    let src = ok(
        "allocate_on A",
        Tensor::allocate_on(a, 0, size, Some("fig13a")),
    );
    let shared = match src.share_to(b, 0) {
        Ok(t) => t,
        // The one documented refusal (docs/sharing.md): a software device
        // has no peer-to-peer path to sim memory. Any other error is a
        // broken pair, not a row to report.
        Err(e)
            if a.kind() == DeviceKind::Sim
                && b.kind() == DeviceKind::Soft
                && e.raw_os_error() == Some(libc::EOPNOTSUPP) =>
        {
            // (The library words its EOPNOTSUPP for fence fds; the errno
            // is what the driver documents for this pair.)
            note(format!(
                "fig13 {case} ({pa} > {pb}): IMPORT refused: EOPNOTSUPP ({e})"
            ));
            emit_info(
                "13_unsupported",
                &[
                    ("case", case.to_owned()),
                    ("errno", "EOPNOTSUPP".to_owned()),
                    (
                        "why",
                        "the software device has no peer-to-peer path to sim device \
                         memory (docs/sharing.md)"
                            .to_owned(),
                    ),
                    ("exporter", pa.to_owned()),
                    ("importer", pb.to_owned()),
                ],
            );
            return;
        }
        Err(e) => panic!("fig13 {case} ({pa} > {pb}): share_to: {e}"),
    };
    let dst = ok(
        "allocate_on B",
        Tensor::allocate_on(b, 0, size, Some("fig13b")),
    );
    let dst2 = ok(
        "allocate_on B",
        Tensor::allocate_on(b, 0, size, Some("fig13c")),
    );
    let (ha, hb) = (
        src.dma_handle().expect("Dma handle"),
        dst.dma_handle().expect("Dma handle"),
    );
    // The bounce's host buffer starts 17 pages past a 2 MiB boundary.
    // Where the kernel placed it on one (as it does a 16 MiB mapping),
    // the software device's COPY_OUT into it, a CPU copy from the
    // buffer's kernel mapping, ran at 34 MB/s instead of 200-450: most
    // likely source and destination pages sharing entries of the
    // emulator's direct-mapped TLB page after page, a cost of TCG, not of
    // the bounce (docs/benchmarks.md).
    let host = Anon::new(size + (2 << 20), 0);
    let hp = host.ptr.wrapping_add(17 * 4096);
    let pattern: Vec<u8> = (0..size)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8)
        .collect();
    ok("COPY_IN A", a.copy_in(ha, 0, &pattern));
    // The bytes arrive through each path before any is timed: a broken
    // path must not be measured as a fast one.
    let check = |what: &str| {
        let mut got = vec![0u8; size];
        ok("COPY_OUT B", b.copy_out(hb, 0, &mut got));
        assert!(
            got == pattern,
            "fig13 {case}: {what} did not deliver A's bytes to B"
        );
        ok("clear B", b.copy_in(hb, 0, &vec![0u8; size]));
    };
    job_copy(&shared, &dst, size);
    check("the zero-copy job");
    let bounce = || {
        // SAFETY: `hp` starts `size` writable bytes of `host` (17 pages in,
        // 2 MiB more than `size`), alive for the whole figure; the cases
        // run one at a time, so this is its only reference.
        let h = unsafe { std::slice::from_raw_parts_mut(hp, size) };
        a.copy_out(ha, 0, h).expect("COPY_OUT A");
        b.copy_in(hb, 0, h).expect("COPY_IN B");
    };
    bounce();
    check("the bounce");
    note(format!("fig13 {case} ({pa} > {pb}): bytes checked, timing"));
    let mut cases: Vec<Case> = vec![
        ("zero_copy", Box::new(|| job_copy(&shared, &dst, size))),
        ("bounce", Box::new(bounce)),
        ("job_local", Box::new(|| job_copy(&dst2, &dst, size))),
        // The bounce's two halves alone: where its time goes.
        (
            "bounce_out",
            Box::new(|| {
                // SAFETY: as in `bounce`.
                let h = unsafe { std::slice::from_raw_parts_mut(hp, size) };
                a.copy_out(ha, 0, h).expect("COPY_OUT A");
            }),
        ),
        (
            "bounce_in",
            Box::new(|| {
                // SAFETY: as in `bounce`; only read here.
                let h = unsafe { std::slice::from_raw_parts(hp, size) };
                b.copy_in(hb, 0, h).expect("COPY_IN B");
            }),
        ),
    ];
    let samples = interleave(1, 7, 1, &mut cases);
    for ((name, _), s) in cases.iter().zip(samples) {
        // MB/s, not GB/s: a job on edu runs at about 0.01 MB/s, which the
        // six decimals of a BENCH line would round away in GB/s.
        let mbs: Vec<f64> = s.iter().map(|ns| size as f64 * 1e3 / ns).collect();
        emit(
            "13",
            case,
            name,
            "MB/s",
            &summarize(mbs),
            &[("bytes", size as f64)],
        );
    }
    drop(cases);
    job_copy(&shared, &dst, size);
    check("the zero-copy job after the timed rounds");
    note(format!("fig13 {case}: done"));
}

// ---------------------------------------------------------------------
// Figure 9: the sim device (issue 14)

/// Opens the first /dev/tdrvN whose kind is the sim device.
fn find_sim() -> Option<(String, Arc<Device>)> {
    (0..16).find_map(|i| {
        let p = format!("/dev/tdrv{i}");
        let d = Device::open(&p).ok()?;
        (d.kind() == DeviceKind::Sim).then_some((p, d))
    })
}

/// Copies `len` bytes from `src` to `dst` as one job and waits for it.
fn job_copy(src: &Tensor, dst: &Tensor, len: usize) {
    let mut job = Job::new();
    job.copy(src, 0, dst, 0, len).expect("job copy");
    job.submit().expect("submit").wait().expect("job wait");
}

/// Figure 9 (sim device only; run in a guest on the host clock): DMA
/// throughput host to device (COPY_IN), device to host (COPY_OUT) and device
/// to device (a copy job between two sim buffers) against guest memcpy;
/// 1, 2 and 4 independent copy jobs submitted together; and the submit to
/// wake latency of a 4 KiB job against an eventfd wake.
fn fig9(c: &Ctx) {
    if c.dev.kind() != DeviceKind::Sim {
        note(format!("fig9: {} is not the sim device: skipped", c.path));
        return;
    }
    // The simulator's queue count, as scripts/bench started it (the
    // scaling rows are named after it).
    let queues = std::env::var("TDRV_BENCH_SIM_QUEUES").unwrap_or_else(|_| "unknown".into());
    if !c.only_scaling {
        fig9_dma(c);
    }
    fig9_scaling(c, &queues);
    if !c.only_scaling {
        fig9_latency(c);
    }
}

/// Figure 9, DMA throughput against guest memcpy.
fn fig9_dma(c: &Ctx) {
    // Without debugfs (or with a module that predates the probe) the
    // report falls back to the memcpy the simulator times at its exit.
    let probes_ok = match tdrv_guest_tests::inject(&c.path, "memcpy_probe") {
        Ok(()) => true,
        Err(e) => {
            note(format!(
                "fig9: no memcpy probes ({e}): 9s uses the exit memcpy"
            ));
            false
        }
    };
    for size in [64 * KIB, MIB, 16 * MIB] {
        let a = alloc(c, size, "fig9a");
        let b = alloc(c, size, "fig9b");
        let handle = a.dma_handle().expect("Dma handle");
        let src = Anon::new(size, 0x5a);
        let dst = Anon::new(size, 0xa5);
        let (sp, dp) = (src.ptr, dst.ptr);
        let dev = &c.dev;
        let mut cases: Vec<Case> = vec![
            (
                "memcpy",
                Box::new(|| {
                    // SAFETY: both ranges are `size` valid bytes of two
                    // distinct anonymous mappings.
                    unsafe { std::ptr::copy_nonoverlapping(sp, dp, size) }
                }),
            ),
            (
                "copy_in",
                Box::new(|| {
                    // SAFETY: `src` is `size` readable bytes for the whole
                    // figure and only read.
                    let s = unsafe { std::slice::from_raw_parts(sp, size) };
                    dev.copy_in(handle, 0, s).expect("COPY_IN");
                }),
            ),
            (
                "copy_out",
                Box::new(|| {
                    // SAFETY: `dst` is `size` writable bytes; the cases run
                    // one at a time, so this is the only live reference.
                    let d = unsafe { std::slice::from_raw_parts_mut(dp, size) };
                    dev.copy_out(handle, 0, d).expect("COPY_OUT");
                }),
            ),
            ("job_d2d", Box::new(|| job_copy(&a, &b, size))),
        ];
        // The same copies from and to 4 KiB pages, for sizes of several
        // pages: a mapping per run of physically consecutive pages instead
        // of one per huge page.
        let src4k = (size >= MIB).then(|| Anon::small_pages(size, 0x5a));
        let dst4k = (size >= MIB).then(|| Anon::small_pages(size, 0xa5));
        if let (Some(s4), Some(d4)) = (&src4k, &dst4k) {
            let (sp4, dp4) = (s4.ptr, d4.ptr);
            cases.push((
                "copy_in_4k",
                Box::new(move || {
                    // SAFETY: `src4k` is `size` readable bytes for the
                    // whole figure and only read.
                    let s = unsafe { std::slice::from_raw_parts(sp4, size) };
                    dev.copy_in(handle, 0, s).expect("COPY_IN");
                }),
            ));
            cases.push((
                "copy_out_4k",
                Box::new(move || {
                    // SAFETY: `dst4k` is `size` writable bytes; the cases
                    // run one at a time, so this is the only live
                    // reference.
                    let d = unsafe { std::slice::from_raw_parts_mut(dp4, size) };
                    dev.copy_out(handle, 0, d).expect("COPY_OUT");
                }),
            ));
        }
        // Figure 9s's baseline, a host memcpy timed by the simulator,
        // before every case of every round of the rows it is the baseline
        // of (those of 1 MiB and more): debugfs `inject memcpy_probe`
        // arms it for the next op's queue, and a 4 KiB job is that op, so
        // the probe has run when the job is done. The simulator prints the
        // probes at its exit (`tdrv-sim: memcpy probes`), where
        // `scripts/bench-report` reads them.
        let probe = size >= MIB && probes_ok;
        let mut between = || {
            if probe {
                tdrv_guest_tests::inject(&c.path, "memcpy_probe").expect("inject memcpy_probe");
                job_copy(&a, &b, 4 * KIB);
            }
        };
        throughput_cases_between("9", size, 5, &mut cases, &mut between);
        note(format!("fig9: {size} bytes done"));
    }
}

/// Figure 9, queue scaling: k independent jobs on distinct buffers,
/// submitted together, then all waited for; throughput is all bytes moved.
fn fig9_scaling(c: &Ctx, queues: &str) {
    const JOB: usize = 4 * MIB;
    let pairs: Vec<(Tensor, Tensor)> = (0..4)
        .map(|_| (alloc(c, JOB, "fig9s"), alloc(c, JOB, "fig9d")))
        .collect();
    let pairs = &pairs;
    let batch = move |k: usize| {
        let handles: Vec<_> = pairs[..k]
            .iter()
            .map(|(s, d)| {
                let mut job = Job::new();
                job.copy(s, 0, d, 0, JOB).expect("job copy");
                job.submit().expect("submit")
            })
            .collect();
        for h in handles {
            h.wait().expect("job wait");
        }
    };
    let mut cases: Vec<Case> = vec![
        ("jobs_1", Box::new(move || batch(1))),
        ("jobs_2", Box::new(move || batch(2))),
        ("jobs_4", Box::new(move || batch(4))),
    ];
    let samples = interleave(1, 7, 4, &mut cases);
    for (k, ((name, _), s)) in [1usize, 2, 4].into_iter().zip(cases.iter().zip(samples)) {
        let bytes = k * JOB;
        let gbs: Vec<f64> = s.iter().map(|ns| bytes as f64 / ns).collect();
        emit(
            "9q",
            &format!("queues_{queues}"),
            name,
            "GB/s",
            &summarize(gbs),
            &[("bytes", bytes as f64), ("jobs", k as f64)],
        );
    }
    note("fig9: queue scaling done");
    drop(cases);
}

/// Figure 9, small-job latency: a 4 KiB job from SUBMIT until the waiter
/// runs, against an eventfd wake.
fn fig9_latency(c: &Ctx) {
    let src = alloc(c, 4 * KIB, "fig9ls");
    let dst = alloc(c, 4 * KIB, "fig9ld");
    let mut done = 0;
    let (wake, submit, _) = fence_wakes(&src, &dst, 4 * KIB, &mut done, 20, 300);
    let efd = eventfd_wakes(20, 300);
    for (name, v) in [("job_4k", wake), ("submit_ioctl", submit), ("eventfd", efd)] {
        emit("9l", "wake", name, "us", &summarize(v), &[]);
    }
    note("fig9: latency done");
}

/// The kernel debugging options this kernel shows signs of (the debug test
/// kernel has all of them, the bench kernel none).
fn debug_options() -> String {
    let checks = [
        ("lockdep", "/proc/lockdep"),
        ("kmemleak", "/sys/kernel/debug/kmemleak"),
        ("slub_debug", "/sys/kernel/slab/kmalloc-64/sanity_checks"),
        ("dma_api_debug", "/sys/kernel/debug/dma-api"),
        ("fault_injection", "/sys/kernel/debug/failslab"),
    ];
    let on: Vec<&str> = checks
        .iter()
        .filter(|(_, p)| std::path::Path::new(p).exists())
        .map(|(n, _)| *n)
        .collect();
    if on.is_empty() {
        "none".into()
    } else {
        on.join(",")
    }
}

fn main() {
    let mut only: Option<Vec<String>> = None;
    let mut path: Option<String> = None;
    let mut profile = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--only" => {
                let list = args.next().unwrap_or_default();
                only = Some(list.split(',').map(str::to_owned).collect());
            }
            "--profile" => profile = true,
            p => path = Some(p.to_owned()),
        }
    }
    // `--only sim` without a device: the first sim device node.
    let sim_only = only
        .as_ref()
        .is_some_and(|l| l.iter().all(|x| x == "sim" || x == "simq" || x == "fig9"));
    let only_scaling = only.as_ref().is_some_and(|l| l.iter().all(|x| x == "simq"));
    let (path, dev) = match path {
        Some(p) => {
            let d = ok("open", Device::open(&p));
            (p, d)
        }
        None if sim_only => find_sim().expect("no sim device (/dev/tdrvN of kind sim)"),
        None => {
            let p = "/dev/tdrv0".to_owned();
            let d = ok("open", Device::open(&p));
            (p, d)
        }
    };
    emit_info(
        "env",
        &[
            ("device", path.clone()),
            ("device_kind", dev.kind().to_string()),
            ("kernel", read_trim("/proc/sys/kernel/osrelease")),
            (
                "cpus",
                std::thread::available_parallelism()
                    .map_or(0, |n| n.get())
                    .to_string(),
            ),
            (
                "clocksource",
                read_trim("/sys/devices/system/clocksource/clocksource0/current_clocksource"),
            ),
            (
                "channel0_limit_mib",
                dev.channel_info(0)
                    .map(|i| (i.limit_bytes >> 20).to_string())
                    .unwrap_or_else(|e| e.to_string()),
            ),
            ("cmdline", read_trim("/proc/cmdline")),
            ("debug_options", debug_options()),
        ],
    );
    let c = Ctx {
        path,
        dev,
        profile,
        only_scaling,
    };
    let figs: [Figure; 12] = [
        ("fig4", fig4),
        ("fig1", fig1),
        ("fig6", fig6),
        ("fig5", fig5),
        ("fig2", fig23),
        ("fig7", fig7),
        ("fig8", fig8),
        ("fig9", fig9),
        ("fig10", fig10),
        ("fig11", fig11),
        ("fig12", fig12),
        ("fig13", fig13),
    ];
    let start = Instant::now();
    for (name, f) in figs {
        // Figure 9 needs the sim device and a host-clock guest: it runs
        // only when asked for (`--only sim`, which runs figure 10 on the
        // sim device too).
        let wanted = match &only {
            None => name != "fig9",
            Some(l) => l.iter().any(|x| {
                x == name
                    || (name == "fig2" && x == "fig3")
                    || (name == "fig9" && (x == "sim" || x == "simq"))
                    || (name == "fig10" && x == "sim")
                    || (name == "fig13" && x == "sim")
            }),
        };
        if !wanted {
            continue;
        }
        let t = Instant::now();
        note(format!("{name}: start"));
        f(&c);
        note(format!(
            "{name}: done in {:.3} s guest time",
            t.elapsed().as_secs_f64()
        ));
    }
    emit_info(
        "done",
        &[(
            "guest_seconds",
            format!("{:.3}", start.elapsed().as_secs_f64()),
        )],
    );
}
