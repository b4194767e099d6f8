//! Structure-aware fuzzer of one tdrv device.
//!
//! Several threads share several open files (some with dup'd descriptors)
//! and issue the real ioctls with fields drawn from live handles, freed
//! handles, other files' handles and garbage; boundary offsets and sizes;
//! stray bits in reserved, pad and flags fields; argument structs re-encoded
//! with smaller and larger sizes; random request numbers of the 0xD7 type;
//! SUBMIT with random descriptor counts and strides; waits with timeouts of
//! at most a few milliseconds; JOB_NOTIFY on live, old and made-up job ids,
//! and the completion events read back (RWF_NOWAIT, lengths around the
//! event size, bad buffers) and polled. They also mmap and munmap at random offsets,
//! lengths and protections and touch what was mapped, close files while
//! other threads are in calls on them, and the main thread forks children
//! that fuzz the same way and are SIGKILLed mid-flight.
//!
//! What must hold: no crash (a SIGBUS on a live mapping kills the program),
//! every ioctl errno is one that `uapi/tdrv.h` documents for that ioctl
//! (`ioctl_errnos`; a random request number: any it documents; read and poll:
//! the ones it gives them), reads return whole, well-formed events, outputs agree with
//! each other (BUF_INFO with ALLOC, no handle reused in a file, truncated or
//! junk-tailed structs refused), every child ends by our SIGKILL, and once
//! all files are closed and the children reaped every channel's used_bytes
//! and buffers return to their start value. The kernel side
//! (oops, WARN, lockdep, kmemleak) is checked by the guest after the run.
//!
//! usage: fuzz [/dev/tdrvN [CALLS [SEED]]]
//! Defaults: 50000 calls on the software device, 10000 on edu; seed 1.
//! The seed fixes every thread's and child's choices; thread interleaving
//! still varies from run to run.

use std::{
    collections::{BTreeMap, HashSet},
    ffi::CString,
    mem::size_of,
    sync::{
        atomic::{AtomicU32, AtomicU64, Ordering::Relaxed},
        Arc, Mutex, RwLock,
    },
    time::{Duration, Instant},
};

use tdrv_guest_tests::{
    channel_usage, device_stat, errno_name, expect_eq, install_fatal_handlers, ok,
    open_device_or_skip,
    raw::{errno, page_size, Dev, Errno},
    wait_usage, Rng, Tap,
};
use tdrv_uapi::*;

/// The ABI header: its error list is what the ioctls may return.
const HEADER: &str = include_str!("../../../../uapi/tdrv.h");

/// Size of each thread's argument buffer: the largest size an ioctl number
/// can encode (14 bits), so that no re-encoded request can make the kernel
/// read or write past it.
const ARG_WORDS: usize = (1 << 14) / 8 + 8;

/// The run goes on until its call count, however long that takes. Only a
/// run that makes no progress for this long (every worker stuck in the
/// driver, or a SIGKILLed child that never goes away) fails: the bound
/// turns a hang into a failure and never measures speed.
const STALL: Duration = Duration::from_secs(60);

/// Most files, handles per file and mappings one process keeps.
const MAX_FILES: usize = 4;
const MAX_FDS_PER_FILE: usize = 3;
const MAX_HANDLES: usize = 48;
const MAX_MAPS: usize = 24;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(usize)]
enum Op {
    Version,
    ChannelInfo,
    Alloc,
    Free,
    BufInfo,
    CopyIn,
    CopyOut,
    Memset,
    Copy,
    Submit,
    JobWait,
    FenceWait,
    CompletionWait,
    CompletionReset,
    JobNotify,
    ReadEvents,
    PollEvents,
    RandomNr,
    Mmap,
    Munmap,
    Touch,
    Open,
    Close,
    Dup,
}

const OPS: [Op; 24] = [
    Op::Version,
    Op::ChannelInfo,
    Op::Alloc,
    Op::Free,
    Op::BufInfo,
    Op::CopyIn,
    Op::CopyOut,
    Op::Memset,
    Op::Copy,
    Op::Submit,
    Op::JobWait,
    Op::FenceWait,
    Op::CompletionWait,
    Op::CompletionReset,
    Op::JobNotify,
    Op::ReadEvents,
    Op::PollEvents,
    Op::RandomNr,
    Op::Mmap,
    Op::Munmap,
    Op::Touch,
    Op::Open,
    Op::Close,
    Op::Dup,
];

/// Whether `fd` is /dev/null: what a worker's descriptor refers to once
/// another worker closed its file (see `close_file`).
fn is_dev_null(fd: i32) -> bool {
    // SAFETY: fstat writes one stat struct, a live local.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::fstat(fd, &mut st) };
    rc == 0 && st.st_rdev == libc::makedev(1, 3)
}

/// Errno slots of the histogram (index 0 counts successes).
const ERRNOS: usize = 160;
const EXAMPLES: usize = 6;
const EXAMPLE_LEN: usize = 240;

/// Counters shared by the threads and the forked children: they live in a
/// MAP_SHARED anonymous mapping, so children (which are SIGKILLed, never
/// joined) report into the same histogram.
#[repr(C)]
struct Shared {
    /// Calls made (the run may pass its target by one per worker).
    calls: AtomicU64,
    hist: [[AtomicU64; ERRNOS]; OPS.len()],
    /// Errnos that the header does not document.
    unexpected: AtomicU64,
    /// Outputs that contradict each other or the ABI rules.
    violations: AtomicU64,
    /// The operation each of the parent's workers is in (OPS index + 1).
    current: [AtomicU64; 8],
    /// Descriptors of successful SUBMITs (edu budget).
    descs: AtomicU64,
    /// Examples of unexpected errnos and violations, claimed in order.
    claims: AtomicU32,
    examples: [[AtomicU64; EXAMPLE_LEN / 8]; EXAMPLES],
}

impl Shared {
    fn new() -> &'static Shared {
        // SAFETY: an anonymous shared mapping, zero-filled: all-zero is a
        // valid `Shared` (atomics only). It is never unmapped, so the
        // reference is valid for the rest of the program (and of children).
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                size_of::<Shared>(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert!(p != libc::MAP_FAILED, "mmap of the shared counters");
            &*(p as *const Shared)
        }
    }

    fn record(&self, op: Op, r: Result<(), Errno>) {
        let slot = match r {
            Ok(()) => 0,
            Err(e) => (e as usize).min(ERRNOS - 1),
        };
        self.hist[op as usize][slot].fetch_add(1, Relaxed);
    }

    /// Keeps the first few problem descriptions (one writer per slot).
    fn example(&self, text: &str) {
        let i = self.claims.fetch_add(1, Relaxed) as usize;
        if i >= EXAMPLES {
            return;
        }
        let mut bytes = [0u8; EXAMPLE_LEN];
        let n = text.len().min(EXAMPLE_LEN);
        bytes[..n].copy_from_slice(&text.as_bytes()[..n]);
        for (w, chunk) in self.examples[i].iter().zip(bytes.chunks(8)) {
            w.store(u64::from_le_bytes(chunk.try_into().unwrap()), Relaxed);
        }
    }

    fn examples(&self) -> Vec<String> {
        let n = (self.claims.load(Relaxed) as usize).min(EXAMPLES);
        self.examples[..n]
            .iter()
            .map(|words| {
                let bytes: Vec<u8> = words
                    .iter()
                    .flat_map(|w| w.load(Relaxed).to_le_bytes())
                    .take_while(|b| *b != 0)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .collect()
    }
}

/// Per-device parameters.
struct Profile {
    edu: bool,
    threads: usize,
    children: u32,
    /// Largest buffer this fuzzer allocates successfully.
    max_alloc: u64,
    /// Descriptors of successful SUBMITs allowed over the whole run (the edu
    /// engine needs ~0.2 s of virtual time per descriptor, and what is
    /// queued at the end must drain within the 5 s of the final check).
    desc_budget: u64,
}

/// A buffer this fuzzer allocated in one file.
#[derive(Clone, Copy)]
struct Buf {
    handle: u64,
    size: u64,
    channel: u32,
    mmap_offset: u64,
}

#[derive(Default)]
struct FileState {
    live: Vec<Buf>,
    freed: Vec<u64>,
    jobs: Vec<u64>,
    /// Every handle ALLOC returned in this file: none may come back.
    seen: HashSet<u64>,
}

/// One open file of the device, reachable through one or more dup'd
/// descriptors.
struct FileSlot {
    fds: Mutex<Vec<i32>>,
    st: Mutex<FileState>,
}

impl FileSlot {
    fn fd(&self, rng: &mut Rng) -> i32 {
        let fds = self.fds.lock().unwrap();
        *rng.pick(&fds)
    }
}

impl Drop for FileSlot {
    fn drop(&mut self) {
        for fd in self.fds.get_mut().unwrap().drain(..) {
            // SAFETY: the slot owns its descriptors; nobody uses them once
            // the last reference to the slot is gone.
            unsafe { libc::close(fd) };
        }
    }
}

/// A live user mapping made by this process.
#[derive(Clone, Copy)]
struct Map {
    addr: usize,
    len: usize,
    prot: i32,
}

/// What the workers of one process share.
struct Pool {
    files: Mutex<Vec<Arc<FileSlot>>>,
    /// Touches hold the read lock, mmap/munmap the write lock: a page is
    /// touched only while its mapping certainly exists.
    maps: RwLock<Vec<Map>>,
}

impl Pool {
    fn new() -> Pool {
        Pool {
            files: Mutex::new(Vec::new()),
            maps: RwLock::new(Vec::new()),
        }
    }

    fn add_fd(&self, fd: i32) {
        self.files.lock().unwrap().push(Arc::new(FileSlot {
            fds: Mutex::new(vec![fd]),
            st: Mutex::new(FileState::default()),
        }));
    }
}

/// What every worker of every process knows about the run.
struct Ctx {
    path: CString,
    channels: u32,
    limit: u64,
    prof: Profile,
    shared: &'static Shared,
    documented: Vec<Errno>,
    /// An open /dev/null: closing a file mid-flight dup2()s it over the
    /// file's descriptors, so their numbers stay taken (and cannot reach an
    /// unrelated file) until no worker can still be using them.
    null_fd: i32,
    target: u64,
    page: u64,
}

/// An errno that no tdrv call should return unless the header says so.
fn documented_errnos() -> Vec<Errno> {
    let mut set: Vec<Errno> = HEADER
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| w.len() >= 4 && w.starts_with('E'))
        .filter_map(|w| (1..ERRNOS as i32).find(|e| errno_name(*e) == w))
        .collect();
    // Standard for an unknown request number, and what a descriptor
    // replaced by /dev/null answers.
    set.push(libc::ENOTTY);
    set.sort_unstable();
    set.dedup();
    set
}

/// What any ioctl may fail with (uapi/tdrv.h's list): a malformed or
/// unreadable argument (EINVAL, EFAULT), unknown trailing bytes (E2BIG), a
/// removed device (ENODEV), and ENOTTY from a descriptor that a closing
/// file's /dev/null replaced mid-flight.
const ANY_IOCTL: &[Errno] = &[
    libc::EINVAL,
    libc::E2BIG,
    libc::EFAULT,
    libc::ENODEV,
    libc::ENOTTY,
];

/// What one ioctl may fail with besides `ANY_IOCTL`, from uapi/tdrv.h:
/// a handle (ENOENT) and a range (ERANGE) where it names them; memory
/// (ENOMEM) and limits (ENOSPC, EAGAIN) where it takes them; EIO where the
/// header says the device or a buffer's error latch fails it; the waits'
/// ETIMEDOUT, EINTR and ESTALE; SUBMIT's fence fds (EBADF, EOPNOTSUPP,
/// EMFILE) and channels (EXDEV). None for the other operations: their
/// calls check their own lists.
fn ioctl_errnos(op: Op) -> &'static [Errno] {
    use libc::*;
    match op {
        Op::Version | Op::ChannelInfo => &[],
        Op::Alloc => &[ENOMEM, ENOSPC],
        Op::Free | Op::BufInfo | Op::CompletionReset => &[ENOENT],
        // (sim: a DMA failure, the latch of COPY_OUT's buffer; a kill
        // between two DMA chunks)
        Op::CopyIn | Op::CopyOut => &[ENOENT, ERANGE, ENOMEM, EIO, EINTR],
        Op::Memset => &[ENOENT, ERANGE, ENOMEM, EIO],
        Op::Copy => &[ENOENT, ERANGE, EXDEV, ENOMEM, EIO],
        Op::Submit => &[
            // (EINTR: a signal while it takes a dma-buf's reservation
            // lock; ENOSPC: TDRV_SUBMIT_NOTIFY with the file's events
            // used up)
            ENOENT, ERANGE, EXDEV, ENOMEM, EAGAIN, EBADF, EOPNOTSUPP, EMFILE, EIO, EINTR, ENOSPC,
        ],
        Op::JobWait => &[ETIMEDOUT, EINTR, ESTALE],
        Op::FenceWait | Op::CompletionWait => &[ENOENT, ETIMEDOUT, EINTR, EIO],
        Op::JobNotify => &[ESTALE, ENOSPC, ENOMEM],
        _ => &[],
    }
}

struct Worker<'a> {
    ctx: &'a Ctx,
    pool: &'a Pool,
    rng: Rng,
    arg: Vec<u64>,
    /// User memory for COPY_IN/COPY_OUT: larger than any buffer this
    /// fuzzer can allocate, so no accepted range can write past it.
    scratch: Vec<u8>,
    /// Descriptor arrays for SUBMIT.
    descs: Vec<u64>,
    /// This worker's index in `Shared::current` (parent workers only).
    slot: Option<usize>,
}

/// Handle choices: live ones of the file (mostly), freed ones, other
/// files', and garbage. Returns the handle and the size to build ranges on.
#[derive(Clone, Copy)]
struct Pick {
    handle: u64,
    size: u64,
    /// Freed in this very file: every call naming it must fail (handle
    /// values are never reused within a file).
    stale: bool,
}

impl<'a> Worker<'a> {
    fn new(ctx: &'a Ctx, pool: &'a Pool, rng: Rng) -> Self {
        Worker {
            ctx,
            pool,
            rng,
            arg: vec![0; ARG_WORDS],
            scratch: vec![0x5A; (ctx.prof.max_alloc + 2 * ctx.page) as usize],
            descs: vec![0; 1025 * 512 / 8],
            slot: None,
        }
    }

    fn violation(&self, text: String) {
        self.ctx.shared.violations.fetch_add(1, Relaxed);
        self.ctx.shared.example(&format!("violation: {text}"));
    }

    /// Picks a file of this process, opening one if there is none.
    fn file(&mut self) -> Option<Arc<FileSlot>> {
        let mut files = self.pool.files.lock().unwrap();
        if files.is_empty() {
            drop(files);
            let _ = self.open_file();
            files = self.pool.files.lock().unwrap();
        }
        if files.is_empty() {
            return None;
        }
        Some(files[self.rng.below(files.len() as u64) as usize].clone())
    }

    fn open_file(&mut self) -> Result<(), Errno> {
        // SAFETY: a valid NUL-terminated path.
        let fd = unsafe { libc::open(self.ctx.path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        let r = if fd < 0 { Err(errno()) } else { Ok(()) };
        self.ctx.shared.record(Op::Open, r);
        if let Err(e) = r {
            self.check_errno(
                Op::Open,
                0,
                e,
                &[
                    libc::ENOMEM,
                    libc::ENODEV,
                    libc::EMFILE,
                    libc::ENFILE,
                    libc::EAGAIN,
                    libc::EINTR,
                ],
            );
            return Err(e);
        }
        let mut files = self.pool.files.lock().unwrap();
        if files.len() >= MAX_FILES {
            // SAFETY: closing the descriptor just opened (never shared).
            unsafe { libc::close(fd) };
        } else {
            files.push(Arc::new(FileSlot {
                fds: Mutex::new(vec![fd]),
                st: Mutex::new(FileState::default()),
            }));
        }
        Ok(())
    }

    fn check_errno(&self, op: Op, req: u64, e: Errno, allowed: &[Errno]) {
        if !allowed.contains(&e) {
            self.ctx.shared.unexpected.fetch_add(1, Relaxed);
            self.ctx.shared.example(&format!(
                "{op:?} (request {req:#x}) failed with {}, which uapi/tdrv.h does not document for it",
                errno_name(e)
            ));
        }
    }

    fn pick(&mut self, file: &FileSlot) -> Pick {
        let roll = self.rng.below(100);
        if roll < 65 {
            let st = file.st.lock().unwrap();
            if !st.live.is_empty() {
                let b = *self.rng.pick(&st.live);
                return Pick {
                    handle: b.handle,
                    size: b.size,
                    stale: false,
                };
            }
        } else if roll < 75 {
            let st = file.st.lock().unwrap();
            if !st.freed.is_empty() {
                let handle = *self.rng.pick(&st.freed);
                return Pick {
                    handle,
                    size: self.ctx.page,
                    stale: true,
                };
            }
        } else if roll < 85 {
            let other = {
                let files = self.pool.files.lock().unwrap();
                (!files.is_empty())
                    .then(|| files[self.rng.below(files.len() as u64) as usize].clone())
            };
            if let Some(o) = other {
                let st = o.st.lock().unwrap();
                if !st.live.is_empty() {
                    let b = *self.rng.pick(&st.live);
                    return Pick {
                        handle: b.handle,
                        size: b.size,
                        stale: false,
                    };
                }
            }
        }
        let near = {
            let st = file.st.lock().unwrap();
            st.live.first().map_or(1 << 24, |b| b.handle)
        };
        let handle = match self.rng.below(10) {
            0 => 0,
            1 => 1,
            2 => u64::MAX,
            3 => 1 << 24,
            4 => near ^ 1,
            5 => near + (1 << 24),
            6 => near | (1 << 51),
            7 => 1 << 63,
            8 => self.rng.below(1 << 30),
            _ => self.rng.next_u64(),
        };
        let size = *self.rng.pick(&[1, self.ctx.page, self.ctx.prof.max_alloc]);
        Pick {
            handle,
            size,
            stale: false,
        }
    }

    /// Reports a call that succeeded on a handle freed in its file.
    fn stale_ok(&self, op: Op, picks: &[Pick]) {
        if let Some(p) = picks.iter().find(|p| p.stale) {
            self.violation(format!(
                "{op:?} succeeded on handle {:#x}, freed earlier in the same file",
                p.handle
            ));
        }
    }

    /// An offset or size around the edges of a buffer of `s` bytes.
    fn edge(&mut self, s: u64) -> u64 {
        let page = self.ctx.page;
        match self.rng.below(16) {
            0 => 0,
            1 => 1,
            2 => s.saturating_sub(1),
            3 => s,
            4 => s + 1,
            5 => page * self.rng.below(4),
            6 => (page * (1 + self.rng.below(3))).min(s + 1) - 1,
            7..=9 => self.rng.below(s + 1),
            10 => self.rng.below(64),
            11 => u64::MAX,
            12 => 1 << 63,
            13 => u64::MAX - self.rng.below(8),
            14 => self.rng.next_u64() | (1 << 62),
            _ => 1 + self.rng.below(s.max(1)),
        }
    }

    /// An `(offset, size)` pair in a buffer of `s` bytes: mostly valid,
    /// else edges and pairs whose sum overflows 64 bits.
    fn range(&mut self, s: u64) -> (u64, u64) {
        match self.rng.below(10) {
            0..=5 => {
                let off = self.rng.below(s + 1);
                (off, self.rng.below(s - off + 1))
            }
            6 => {
                let k = self.rng.below(16);
                (u64::MAX - k, k + 2)
            }
            7 => (s, u64::MAX - s + 1),
            _ => (self.edge(s), self.edge(s)),
        }
    }

    /// With small probability sets a stray bit in one word of one of
    /// `groups` (reserved words, or inputs that must be zero).
    fn stray64(&mut self, groups: &mut [&mut [u64]]) {
        if groups.is_empty() || !self.rng.chance(1, 25) {
            return;
        }
        let g = self.rng.below(groups.len() as u64) as usize;
        let words = &mut *groups[g];
        if !words.is_empty() {
            let i = self.rng.below(words.len() as u64) as usize;
            words[i] |= 1 << self.rng.below(64);
        }
    }

    fn stray32(&mut self, field: &mut u32) {
        if self.rng.chance(1, 25) {
            *field |= 1 << self.rng.below(32);
        }
    }

    /// A user pointer for COPY_IN/COPY_OUT of `size` bytes: the scratch
    /// buffer, else addresses that must give EFAULT.
    fn user_ptr(&mut self, size: u64) -> u64 {
        let scratch = self.scratch.as_mut_ptr() as u64;
        match self.rng.below(100) {
            0..=89 => {
                // Sizes past the scratch buffer are larger than any buffer,
                // so the range check must refuse them before any copy.
                if size <= self.scratch.len() as u64 {
                    let slack = self.scratch.len() as u64 - size;
                    scratch + self.rng.below(slack.min(64) + 1)
                } else {
                    scratch
                }
            }
            90..=92 => 0,
            93..=95 => 0xffff_ffff_8100_0000,
            96..=97 => 1 << 47,
            _ => scratch ^ (1 << 46),
        }
    }

    /// Issues `req` with `val` as its argument, sometimes re-encoded with
    /// another struct size. Records the outcome and checks the errno.
    fn send<T: Copy>(&mut self, fd: i32, op: Op, req: u64, val: &mut T) -> Result<(), Errno> {
        let ours = size_of::<T>();
        let roll = self.rng.below(100);
        let (size, junk) = if roll < 85 {
            (ours, false)
        } else if roll < 90 {
            (self.rng.below(ours as u64) as usize, false)
        } else {
            let extra = *self
                .rng
                .pick(&[8usize, 16, 64, 4096 - ours, 4097 - ours, 0x3fff - ours]);
            (ours + extra, roll >= 95)
        };
        // SAFETY: `arg` is a live buffer of ARG_WORDS words; viewing it as
        // bytes is always valid.
        let buf = unsafe {
            std::slice::from_raw_parts_mut(self.arg.as_mut_ptr().cast::<u8>(), ARG_WORDS * 8)
        };
        buf[..size.max(ours)].fill(0);
        // SAFETY: `T` is a plain-old-data uapi struct of `ours` bytes.
        let bytes = unsafe { std::slice::from_raw_parts((val as *const T).cast::<u8>(), ours) };
        buf[..ours].copy_from_slice(bytes);
        if junk {
            let i = ours + self.rng.below((size - ours) as u64) as usize;
            buf[i] = 1 + self.rng.below(255) as u8;
        }
        let request = request_with_size(req, size);
        // SAFETY: the kernel reads and writes at most `size` < ARG_WORDS * 8
        // bytes of `buf`.
        let rc = unsafe { libc::ioctl(fd, request as _, buf.as_mut_ptr()) };
        let r = if rc < 0 { Err(errno()) } else { Ok(()) };
        // SAFETY: as above; copies the (possibly updated) struct back.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), (val as *mut T).cast::<u8>(), ours) };
        self.ctx.shared.record(op, r);
        if let Err(e) = r {
            if !ioctl_errnos(op).contains(&e) {
                self.check_errno(op, request, e, ANY_IOCTL);
            }
        }
        // The first published size of each struct: its size now, except
        // SUBMIT's, which grew in ABI 1.2 (48 -> 64 bytes) and 1.6 (72).
        let first = if op == Op::Submit { 48 } else { ours };
        if r.is_ok() && size < first {
            self.violation(format!(
                "{op:?} accepted a {size}-byte argument (struct is {ours} bytes, first {first})"
            ));
        }
        // VERSION is output-only: its trailing bytes may be ignored.
        if r.is_ok() && junk && op != Op::Version {
            self.violation(format!(
                "{op:?} accepted a {size}-byte argument with non-zero bytes past its {ours}"
            ));
        }
        r
    }

    fn one(&mut self) {
        let edu = self.ctx.prof.edu;
        // Weights per operation (edu: fewer jobs; see Profile::desc_budget).
        let weights: [(Op, u64); 24] = [
            (Op::Version, 1),
            (Op::ChannelInfo, 2),
            (Op::Alloc, 12),
            (Op::Free, 8),
            (Op::BufInfo, 6),
            (Op::CopyIn, 7),
            (Op::CopyOut, 7),
            (Op::Memset, 5),
            (Op::Copy, 5),
            (Op::Submit, if edu { 3 } else { 10 }),
            (Op::JobWait, 6),
            (Op::FenceWait, 5),
            (Op::CompletionWait, 5),
            (Op::CompletionReset, 2),
            (Op::JobNotify, 4),
            (Op::ReadEvents, 3),
            (Op::PollEvents, 2),
            (Op::RandomNr, 4),
            (Op::Mmap, 5),
            (Op::Munmap, 3),
            (Op::Touch, 6),
            (Op::Open, 1),
            (Op::Close, 1),
            (Op::Dup, 1),
        ];
        let total: u64 = weights.iter().map(|w| w.1).sum();
        let mut roll = self.rng.below(total);
        let op = weights
            .iter()
            .find(|(_, w)| {
                if roll < *w {
                    true
                } else {
                    roll -= w;
                    false
                }
            })
            .map(|w| w.0)
            .unwrap_or(Op::Version);
        if let Some(i) = self.slot {
            self.ctx.shared.current[i].store(op as u64 + 1, Relaxed);
        }
        match op {
            Op::Open => {
                let _ = self.open_file();
            }
            Op::Close => self.close_file(),
            Op::Dup => self.dup_fd(),
            Op::Mmap => self.mmap(),
            Op::Munmap => self.munmap(),
            Op::Touch => self.touch(),
            _ => {
                let Some(file) = self.file() else { return };
                self.ioctl(op, &file);
            }
        }
        self.ctx.shared.calls.fetch_add(1, Relaxed);
    }

    fn close_file(&mut self) {
        let victim = {
            let mut files = self.pool.files.lock().unwrap();
            if files.is_empty() {
                return;
            }
            let i = self.rng.below(files.len() as u64) as usize;
            files.swap_remove(i)
        };
        // Other workers may be inside a call on these descriptors: the file
        // is released when the last of those calls returns. The numbers
        // now refer to /dev/null until the slot is dropped.
        let fds = victim.fds.lock().unwrap().clone();
        let mut r = Ok(());
        for fd in fds {
            // SAFETY: replaces a descriptor this process owns.
            if unsafe { libc::dup2(self.ctx.null_fd, fd) } < 0 {
                r = Err(errno());
            }
        }
        self.ctx.shared.record(Op::Close, r);
        if let Err(e) = r {
            self.check_errno(Op::Close, 0, e, &[]);
        }
    }

    fn dup_fd(&mut self) {
        let Some(file) = self.file() else { return };
        let mut fds = file.fds.lock().unwrap();
        if fds.len() >= MAX_FDS_PER_FILE {
            return;
        }
        let src = *self.rng.pick(&fds);
        // SAFETY: duplicates a descriptor this process owns.
        let fd = unsafe { libc::fcntl(src, libc::F_DUPFD_CLOEXEC, 0) };
        let r = if fd < 0 { Err(errno()) } else { Ok(()) };
        self.ctx.shared.record(Op::Dup, r);
        match r {
            Ok(()) => fds.push(fd),
            Err(e) => self.check_errno(Op::Dup, 0, e, &[libc::EMFILE]),
        }
    }

    fn mmap(&mut self) {
        let Some(file) = self.file() else { return };
        let page = self.ctx.page;
        let p = self.pick(&file);
        let cookie = {
            let st = file.st.lock().unwrap();
            st.live
                .iter()
                .find(|b| b.handle == p.handle)
                .map_or(p.handle << 12, |b| b.mmap_offset)
        };
        let offset = match self.rng.below(20) {
            0..=13 => cookie,
            14 => cookie.wrapping_add(page * (1 + self.rng.below(3))),
            15 => cookie.wrapping_add(1 + self.rng.below(page - 1)),
            16 => 0,
            17 => 1 << 40,
            18 => (self.rng.next_u64() >> 16) & !(page - 1),
            _ => !(page - 1),
        };
        let rounded = p.size.div_ceil(page).max(1) * page;
        let len = match self.rng.below(20) {
            0..=11 => rounded,
            12..=14 => page,
            15..=16 => rounded + page,
            17 => 0,
            18 => page * (1 + self.rng.below(8)),
            _ => 1 << 40,
        };
        let prot = *self.rng.pick(&[
            libc::PROT_READ | libc::PROT_WRITE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::PROT_READ,
            libc::PROT_WRITE,
            libc::PROT_NONE,
            libc::PROT_READ | libc::PROT_EXEC,
            libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
        ]);
        let flags = match self.rng.below(20) {
            0..=16 => libc::MAP_SHARED,
            17..=18 => libc::MAP_PRIVATE,
            _ => libc::MAP_SHARED | libc::MAP_POPULATE,
        };
        let fd = file.fd(&mut self.rng);
        let mut maps = self.pool.maps.write().unwrap();
        if maps.len() >= MAX_MAPS {
            return;
        }
        // SAFETY: never MAP_FIXED: the kernel picks an unused range, so no
        // existing Rust object can be replaced.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                prot,
                flags,
                fd,
                offset as libc::off_t,
            )
        };
        let r = if addr == libc::MAP_FAILED {
            Err(errno())
        } else {
            Ok(())
        };
        self.ctx.shared.record(Op::Mmap, r);
        match r {
            Ok(()) => maps.push(Map {
                addr: addr as usize,
                len: len as usize,
                prot,
            }),
            Err(e) => self.check_errno(
                Op::Mmap,
                0,
                e,
                &[
                    libc::EINVAL,
                    libc::ENOENT,
                    libc::ENOMEM,
                    libc::EACCES,
                    libc::EPERM,
                    libc::ENODEV,
                    libc::EOVERFLOW,
                    libc::EAGAIN,
                    libc::ENXIO,
                ],
            ),
        }
    }

    fn munmap(&mut self) {
        let page = self.ctx.page as usize;
        let mut maps = self.pool.maps.write().unwrap();
        if maps.is_empty() {
            return;
        }
        let i = self.rng.below(maps.len() as u64) as usize;
        let m = maps.swap_remove(i);
        let pages = m.len / page;
        // A whole mapping, or a page range that splits it.
        let (first, count) = if pages <= 1 || self.rng.chance(1, 2) {
            (0, pages)
        } else {
            let first = self.rng.below(pages as u64) as usize;
            (first, 1 + self.rng.below((pages - first) as u64) as usize)
        };
        // SAFETY: unmaps pages of a mapping this process made and no longer
        // lists (the write lock keeps touches out).
        let rc = unsafe { libc::munmap((m.addr + first * page) as *mut _, count * page) };
        let r = if rc < 0 { Err(errno()) } else { Ok(()) };
        self.ctx.shared.record(Op::Munmap, r);
        if let Err(e) = r {
            self.check_errno(Op::Munmap, 0, e, &[]);
        }
        if first > 0 {
            maps.push(Map {
                len: first * page,
                ..m
            });
        }
        if first + count < pages {
            maps.push(Map {
                addr: m.addr + (first + count) * page,
                len: (pages - first - count) * page,
                prot: m.prot,
            });
        }
    }

    fn touch(&mut self) {
        let page = self.ctx.page as usize;
        let maps = self.pool.maps.read().unwrap();
        if maps.is_empty() {
            return;
        }
        let m = *self.rng.pick(&maps);
        for _ in 0..1 + self.rng.below(4) {
            let at = m.addr
                + self.rng.below((m.len / page) as u64) as usize * page
                + self.rng.below(page as u64) as usize;
            let p = at as *mut u8;
            // SAFETY: `p` is inside a mapping that the kernel accepted and
            // that stays mapped while we hold the read lock, accessed only
            // as its protection allows. A fault here is a driver bug.
            unsafe {
                if m.prot & libc::PROT_READ != 0 {
                    let v = p.read_volatile();
                    if m.prot & libc::PROT_WRITE != 0 {
                        p.write_volatile(v.wrapping_add(1));
                    }
                } else if m.prot & libc::PROT_WRITE != 0 {
                    p.write_volatile(0x42);
                }
            }
        }
        self.ctx.shared.record(Op::Touch, Ok(()));
    }

    /// read(2) of completion events, RWF_NOWAIT (a fuzzer never blocks
    /// without a bound): whole events or EAGAIN; lengths around the event
    /// size and bad buffers.
    fn read_events(&mut self, fd: i32) {
        let ev = size_of::<tdrv_event>();
        let len = match self.rng.below(8) {
            0 => self.rng.below(ev as u64) as usize,
            1 => ev + 1 + self.rng.below(ev as u64 - 1) as usize,
            2 => self.scratch.len(),
            _ => ev * (1 + self.rng.below(8) as usize),
        }
        .min(self.scratch.len());
        let base = match self.rng.below(20) {
            0 => 0,
            1 => 0xffff_ffff_8100_0000,
            _ => self.scratch.as_mut_ptr() as u64,
        };
        let iov = libc::iovec {
            iov_base: base as *mut libc::c_void,
            iov_len: len,
        };
        // SAFETY: the kernel writes at most `len` bytes at `base`, which is
        // the scratch buffer (of at least `len` bytes) or an address it
        // must refuse with EFAULT.
        let rc = unsafe { libc::preadv2(fd, &iov, 1, -1, libc::RWF_NOWAIT) };
        let r = if rc < 0 { Err(errno()) } else { Ok(()) };
        self.ctx.shared.record(Op::ReadEvents, r);
        match r {
            // (/dev/null, standing in for a closed file, has no RWF_NOWAIT.)
            Err(libc::EOPNOTSUPP) if is_dev_null(fd) => {}
            Err(e) => self.check_errno(
                Op::ReadEvents,
                0,
                e,
                &[libc::EAGAIN, libc::EINVAL, libc::EFAULT, libc::EINTR],
            ),
            // (0: a descriptor whose file was closed meanwhile, /dev/null.)
            Ok(()) if rc == 0 => {}
            Ok(()) => {
                let n = rc as usize;
                if len < ev || !n.is_multiple_of(ev) || n > len / ev * ev {
                    self.violation(format!(
                        "read of {len} bytes returned {n} (events are {ev})"
                    ));
                    return;
                }
                for chunk in self.scratch[..n].chunks_exact(ev) {
                    let kind = u32::from_ne_bytes(chunk[0..4].try_into().unwrap());
                    let status = i32::from_ne_bytes(chunk[4..8].try_into().unwrap());
                    let job = u64::from_ne_bytes(chunk[8..16].try_into().unwrap());
                    if kind != TDRV_EVENT_JOB_DONE
                        || job == 0
                        || status > 0
                        || (status < 0 && !self.ctx.documented.contains(&-status))
                    {
                        self.violation(format!(
                            "event read: type {kind} status {status} job {job}"
                        ));
                    }
                }
            }
        }
    }

    fn remember_job(&self, file: &FileSlot, id: u64) {
        let mut st = file.st.lock().unwrap();
        if st.jobs.len() >= 32 {
            st.jobs.remove(0);
        }
        st.jobs.push(id);
    }

    fn job_id(&mut self, file: &FileSlot) -> u64 {
        let known = {
            let st = file.st.lock().unwrap();
            (!st.jobs.is_empty()).then(|| *self.rng.pick(&st.jobs))
        };
        match (self.rng.below(10), known) {
            (0..=6, Some(id)) => id,
            (7, Some(id)) => id + 1 + self.rng.below(100),
            (8, _) => 0,
            _ => *self.rng.pick(&[1, 2, u64::MAX, 1 << 63, 100_000]),
        }
    }

    /// A wait timeout: never negative (no unbounded waits), at most 3 ms.
    fn timeout(&mut self) -> i64 {
        if self.rng.chance(1, 2) {
            0
        } else {
            1 + self.rng.below(3000) as i64
        }
    }

    fn ioctl(&mut self, op: Op, file: &FileSlot) {
        let fd = file.fd(&mut self.rng);
        match op {
            Op::Version => {
                let mut v = tdrv_version::default();
                if self.send(fd, op, TDRV_IOC_VERSION, &mut v).is_ok()
                    && v.abi_major != TDRV_ABI_MAJOR
                {
                    self.violation(format!("VERSION abi_major {}", v.abi_major));
                }
            }
            Op::ChannelInfo => {
                let mut c = tdrv_channel_info {
                    channel: match self.rng.below(10) {
                        0 => self.ctx.channels,
                        1 => u32::MAX,
                        _ => self.rng.below(self.ctx.channels.into()) as u32,
                    },
                    ..Default::default()
                };
                let channel = c.channel;
                self.stray32(&mut c.pad);
                self.stray64(&mut [&mut c.reserved[..]]);
                if self.send(fd, op, TDRV_IOC_CHANNEL_INFO, &mut c).is_ok()
                    && (c.channel != channel
                        || c.limit_bytes != self.ctx.limit
                        || c.used_bytes > c.limit_bytes)
                {
                    self.violation(format!(
                        "CHANNEL_INFO of channel {channel}: channel {} limit {} used {}",
                        c.channel, c.limit_bytes, c.used_bytes
                    ));
                }
            }
            Op::Alloc => self.alloc(fd, file),
            Op::Free => {
                let p = self.pick(file);
                let mut f = tdrv_free {
                    handle: p.handle,
                    ..Default::default()
                };
                self.stray64(&mut [std::slice::from_mut(&mut f.reserved)]);
                if self.send(fd, op, TDRV_IOC_FREE, &mut f).is_ok() {
                    self.stale_ok(op, &[p]);
                    let mut st = file.st.lock().unwrap();
                    st.live.retain(|b| b.handle != p.handle);
                    if st.freed.len() >= 64 {
                        st.freed.remove(0);
                    }
                    st.freed.push(p.handle);
                }
            }
            Op::BufInfo => {
                let p = self.pick(file);
                let mut b = tdrv_buf_info {
                    handle: p.handle,
                    ..Default::default()
                };
                self.stray32(&mut b.pad);
                self.stray32(&mut b.pad2);
                // Output fields (`buf_id` was `reserved` before ABI 1.3):
                // ignored on input.
                if self.rng.chance(1, 25) {
                    b.error = -libc::EIO;
                }
                if self.rng.chance(1, 25) {
                    b.buf_id = 1 << self.rng.below(64);
                }
                if self.send(fd, op, TDRV_IOC_BUF_INFO, &mut b).is_ok() {
                    self.stale_ok(op, &[p]);
                    if b.buf_id == 0 {
                        self.violation(format!("BUF_INFO {:#x}: buf_id 0", p.handle));
                    }
                    if b.error > 0 || (b.error < 0 && !self.ctx.documented.contains(&-b.error)) {
                        self.violation(format!(
                            "BUF_INFO {:#x}: error latch {}",
                            p.handle, b.error
                        ));
                    }
                    let known = file
                        .st
                        .lock()
                        .unwrap()
                        .live
                        .iter()
                        .find(|x| x.handle == p.handle)
                        .copied();
                    if let Some(k) = known {
                        if (b.size, b.channel, b.mmap_offset) != (k.size, k.channel, k.mmap_offset)
                        {
                            self.violation(format!(
                                "BUF_INFO {:#x}: size {} channel {} mmap_offset {:#x}, ALLOC gave {} {} {:#x}",
                                p.handle, b.size, b.channel, b.mmap_offset, k.size, k.channel, k.mmap_offset
                            ));
                        }
                    }
                }
            }
            Op::CopyIn | Op::CopyOut => {
                let p = self.pick(file);
                let (offset, size) = self.range(p.size);
                // Sometimes the user memory is a tdrv mapping: the copy then
                // runs on the driver's own pages (and any fault on them)
                // inside the ioctl. The read lock keeps the mapping for the
                // call.
                let need = if op == Op::CopyIn {
                    libc::PROT_READ
                } else {
                    libc::PROT_WRITE
                };
                let pool = self.pool;
                let maps = self.rng.chance(1, 10).then(|| pool.maps.read().unwrap());
                let fits: Vec<Map> = maps
                    .iter()
                    .flat_map(|m| m.iter())
                    .filter(|m| m.prot & need != 0 && m.len as u64 >= size)
                    .copied()
                    .collect();
                let user_ptr = if fits.is_empty() {
                    self.user_ptr(size)
                } else {
                    let m = *self.rng.pick(&fits);
                    m.addr as u64 + self.rng.below(m.len as u64 - size + 1)
                };
                let mut x = tdrv_xfer {
                    handle: p.handle,
                    offset,
                    size,
                    user_ptr,
                    ..Default::default()
                };
                self.stray64(&mut [&mut x.reserved[..]]);
                let req = if op == Op::CopyIn {
                    TDRV_IOC_COPY_IN
                } else {
                    TDRV_IOC_COPY_OUT
                };
                if self.send(fd, op, req, &mut x).is_ok() {
                    self.stale_ok(op, &[p]);
                }
                drop(maps);
            }
            Op::Memset => {
                let p = self.pick(file);
                let (offset, size) = self.range(p.size);
                let mut m = tdrv_memset {
                    handle: p.handle,
                    offset,
                    size,
                    value: match self.rng.below(20) {
                        0 => 256,
                        1 => u32::MAX,
                        _ => self.rng.below(256) as u32,
                    },
                    ..Default::default()
                };
                self.stray32(&mut m.pad);
                self.stray64(&mut [&mut m.reserved[..]]);
                if self.send(fd, op, TDRV_IOC_MEMSET, &mut m).is_ok() {
                    self.stale_ok(op, &[p]);
                }
            }
            Op::Copy => {
                let src = self.pick(file);
                let dst = if self.rng.chance(1, 5) {
                    src
                } else {
                    self.pick(file)
                };
                let s = src.size.min(dst.size);
                let (src_offset, size) = self.range(s);
                let dst_offset = if self.rng.chance(3, 4) {
                    self.rng.below(s.saturating_sub(size.min(s)) + 1)
                } else {
                    self.edge(dst.size)
                };
                let mut c = tdrv_copy {
                    desc: tdrv_copy_desc {
                        src_handle: src.handle,
                        src_offset,
                        dst_handle: dst.handle,
                        dst_offset,
                        size,
                    },
                    ..Default::default()
                };
                self.stray64(&mut [&mut c.reserved[..]]);
                if self.send(fd, op, TDRV_IOC_COPY, &mut c).is_ok() {
                    self.stale_ok(op, &[src, dst]);
                }
            }
            Op::Submit => self.submit(fd, file),
            Op::JobNotify => {
                let mut n = tdrv_job_notify {
                    job_id: self.job_id(file),
                    user_data: self.rng.next_u64(),
                    ..Default::default()
                };
                self.stray64(&mut [&mut n.reserved[..]]);
                let _ = self.send(fd, op, TDRV_IOC_JOB_NOTIFY, &mut n);
            }
            Op::ReadEvents => self.read_events(fd),
            Op::PollEvents => {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLIN | libc::POLLRDNORM | libc::POLLOUT,
                    revents: 0,
                };
                let ms = self.rng.below(4) as i32;
                // SAFETY: one live pollfd.
                let rc = unsafe { libc::poll(&mut p, 1, ms) };
                let r = if rc < 0 { Err(errno()) } else { Ok(()) };
                self.ctx.shared.record(op, r);
                if let Err(e) = r {
                    self.check_errno(op, 0, e, &[libc::EINTR]);
                }
                // Only readiness for events (a descriptor whose file was
                // closed meanwhile is /dev/null, ready for anything).
                let ours = libc::POLLIN | libc::POLLRDNORM;
                if rc > 0 && p.revents & !ours != 0 && !is_dev_null(fd) {
                    self.violation(format!("poll of a tdrv file: revents {:#x}", p.revents));
                }
            }
            Op::JobWait => {
                let mut w = tdrv_job_wait {
                    job_id: self.job_id(file),
                    timeout_us: self.timeout(),
                    ..Default::default()
                };
                if self.rng.chance(1, 30) {
                    w.state = 1;
                }
                if self.rng.chance(1, 30) {
                    w.status = -1;
                }
                self.stray64(&mut [&mut w.reserved[..]]);
                if self.send(fd, op, TDRV_IOC_JOB_WAIT, &mut w).is_ok() {
                    let ok_state = w.state == TDRV_JOB_PENDING && w.status == 0
                        || w.state == TDRV_JOB_DONE
                            && (w.status == 0 || self.ctx.documented.contains(&-w.status));
                    if !ok_state {
                        self.violation(format!(
                            "JOB_WAIT {}: state {} status {}",
                            w.job_id, w.state, w.status
                        ));
                    }
                }
            }
            Op::FenceWait => {
                let p = self.pick(file);
                let mut f = tdrv_fence_wait {
                    handle: p.handle,
                    timeout_us: self.timeout(),
                    kind: match self.rng.below(10) {
                        0 => 0,
                        1 => 4 | self.rng.below(4) as u32,
                        _ => 1 + self.rng.below(3) as u32,
                    },
                    ..Default::default()
                };
                self.stray32(&mut f.pad);
                self.stray64(&mut [&mut f.reserved[..]]);
                if self.send(fd, op, TDRV_IOC_FENCE_WAIT, &mut f).is_ok() {
                    self.stale_ok(op, &[p]);
                }
            }
            Op::CompletionWait => {
                let p = self.pick(file);
                let mut c = tdrv_completion_wait {
                    handle: p.handle,
                    expected: match self.rng.below(10) {
                        0 => u64::MAX,
                        1 => 1 << 63,
                        _ => self.rng.below(4),
                    },
                    timeout_us: self.timeout(),
                    ..Default::default()
                };
                self.stray64(&mut [std::slice::from_mut(&mut c.count), &mut c.reserved[..]]);
                let expected = c.expected;
                if self.send(fd, op, TDRV_IOC_COMPLETION_WAIT, &mut c).is_ok() {
                    self.stale_ok(op, &[p]);
                    if c.count < expected {
                        self.violation(format!(
                            "COMPLETION_WAIT for {expected} succeeded with count {}",
                            c.count
                        ));
                    }
                }
            }
            Op::CompletionReset => {
                let p = self.pick(file);
                let mut c = tdrv_completion_reset {
                    handle: p.handle,
                    ..Default::default()
                };
                self.stray64(&mut [std::slice::from_mut(&mut c.reserved)]);
                if self.send(fd, op, TDRV_IOC_COMPLETION_RESET, &mut c).is_ok() {
                    self.stale_ok(op, &[p]);
                }
            }
            Op::RandomNr => {
                // Any number of the 0xD7 type: known and unknown `nr`, any
                // direction and size, an argument of zeroes or noise.
                let nr = if self.rng.chance(3, 4) {
                    self.rng.below(0x20)
                } else {
                    self.rng.below(256)
                };
                let dir = self.rng.below(4);
                let size = if self.rng.chance(1, 2) {
                    self.rng.below(128)
                } else {
                    self.rng.below(1 << 14)
                };
                let request = (dir << 30) | (size << 16) | (u64::from(TDRV_IOC_MAGIC) << 8) | nr;
                let noise = self.rng.chance(1, 3);
                for w in self.arg.iter_mut() {
                    *w = 0;
                }
                if noise {
                    for i in 0..(size as usize).div_ceil(8) {
                        self.arg[i] = self.rng.next_u64();
                    }
                }
                // SAFETY: the kernel reads and writes at most `size` (< 16 KiB)
                // bytes of `arg`, which is larger.
                let rc = unsafe { libc::ioctl(fd, request as _, self.arg.as_mut_ptr()) };
                let r = if rc < 0 { Err(errno()) } else { Ok(()) };
                self.ctx.shared.record(op, r);
                if let Err(e) = r {
                    let ctx = self.ctx;
                    self.check_errno(op, request, e, &ctx.documented);
                } else if nr == 2 {
                    // A random ALLOC that succeeded: free it again (it is
                    // not tracked), so that the file does not fill up.
                    let mut f = tdrv_free {
                        handle: self.arg[2],
                        ..Default::default()
                    };
                    // SAFETY: `f` is a live tdrv_free, the size encoded.
                    unsafe { libc::ioctl(fd, TDRV_IOC_FREE as _, &mut f) };
                }
            }
            _ => unreachable!(),
        }
    }

    fn alloc(&mut self, fd: i32, file: &FileSlot) {
        let page = self.ctx.page;
        let max = self.ctx.prof.max_alloc;
        if file.st.lock().unwrap().live.len() >= MAX_HANDLES {
            return;
        }
        let size = match self.rng.below(20) {
            0..=7 => 1 + self.rng.below(page),
            8..=11 => page * (1 + self.rng.below(max / page)),
            // A page multiple plus or minus one byte.
            12..=13 => (page * (1 + self.rng.below(max / page - 1)))
                .wrapping_add(*self.rng.pick(&[1, u64::MAX])),
            14..=16 => 1 + self.rng.below(max),
            17 => 0,
            18 => *self
                .rng
                .pick(&[TDRV_MAX_BUFFER_SIZE as u64 + 1, u64::MAX, 1 << 63]),
            // Past the channel limit: ENOSPC, never an allocation.
            _ => self.ctx.limit + 1 + self.rng.below(page),
        };
        let mut a = tdrv_alloc {
            size,
            channel: match self.rng.below(20) {
                0 => self.ctx.channels,
                1 => u32::MAX,
                _ => self.rng.below(self.ctx.channels.into()) as u32,
            },
            ..Default::default()
        };
        self.stray32(&mut a.flags);
        self.stray64(&mut [
            std::slice::from_mut(&mut a.handle),
            std::slice::from_mut(&mut a.dma_addr),
            std::slice::from_mut(&mut a.mmap_offset),
            &mut a.reserved[..],
        ]);
        let channel = a.channel;
        if self.send(fd, Op::Alloc, TDRV_IOC_ALLOC, &mut a).is_err() {
            return;
        }
        if size > max {
            self.violation(format!(
                "ALLOC of {size} bytes succeeded (limit {})",
                self.ctx.limit
            ));
        }
        let mut st = file.st.lock().unwrap();
        if a.handle == 0 || !a.mmap_offset.is_multiple_of(page) || !st.seen.insert(a.handle) {
            drop(st);
            self.violation(format!(
                "ALLOC returned handle {:#x} mmap_offset {:#x} (zero, unaligned or reused)",
                a.handle, a.mmap_offset
            ));
            return;
        }
        st.live.push(Buf {
            handle: a.handle,
            size,
            channel,
            mmap_offset: a.mmap_offset,
        });
    }

    fn submit(&mut self, fd: i32, file: &FileSlot) {
        let edu = self.ctx.prof.edu;
        let page = self.ctx.page;
        let over_budget = self.ctx.shared.descs.load(Relaxed) >= self.ctx.prof.desc_budget;
        let ours = size_of::<tdrv_copy_desc>() as u64;
        // Half of the jobs are well-formed (live buffers of this file on one
        // channel, ranges inside them), so that jobs really run, overlap
        // with everything else and get cancelled by closes and kills; the
        // other half fuzz every field.
        let live = file.st.lock().unwrap().live.clone();
        let clean = !over_budget && !live.is_empty() && self.rng.chance(1, 2);
        let count: u64 = if clean {
            1 + self.rng.below(if edu { 1 } else { 4 })
        } else {
            match self.rng.below(40) {
                0..=27 => 1 + self.rng.below(if edu { 2 } else { 4 }),
                28..=33 => 1 + self.rng.below(16),
                34 => 0,
                35 => 1025,
                36 => u64::from(u32::MAX),
                _ => 1024,
            }
        };
        let stride: u64 = match (clean, self.rng.below(20)) {
            (true, _) | (false, 0..=13) => ours,
            (false, 14) => ours + 8,
            (false, 15) => 256,
            (false, 16) => *self.rng.pick(&[0, ours - 8, 257, 4096]),
            _ => ours + 8 * (1 + self.rng.below(27)),
        };
        let well_laid = stride.is_multiple_of(8) && stride >= ours;
        let junk_tail = !clean && stride > ours && self.rng.chance(1, 4);
        let filled = count.min(1025) as usize;
        let words = (stride / 8).max(1) as usize;
        if filled * words.max(5) > self.descs.len() {
            return;
        }
        for i in 0..filled {
            let (src, src_offset, dst, dst_offset, size) = if clean {
                let src = *self.rng.pick(&live);
                let same: Vec<&Buf> = live.iter().filter(|b| b.channel == src.channel).collect();
                let dst = **self.rng.pick(&same);
                let s = src.size.min(dst.size);
                // One DMA chunk at most on edu; small pieces in long jobs.
                let cap = if edu {
                    256
                } else if count > 1 {
                    page
                } else {
                    64 << 10
                };
                let size = 1 + self.rng.below(s.min(cap));
                let src_offset = self.rng.below(src.size - size + 1);
                let dst_offset = self.rng.below(dst.size - size + 1);
                (src.handle, src_offset, dst.handle, dst_offset, size)
            } else {
                let src = self.pick(file);
                let dst = self.pick(file);
                let s = src.size.min(dst.size);
                let (src_offset, size) = if edu {
                    let size = match self.rng.below(10) {
                        0 => 0,
                        1 => u64::MAX,
                        _ => 1 + self.rng.below(256.min(s.max(1))),
                    };
                    (self.rng.below(s.saturating_sub(size.min(s)) + 1), size)
                } else if count > 4 {
                    // Many descriptors: small ones, so a job stays cheap.
                    let size = 1 + self.rng.below(page.min(s.max(1)));
                    (self.rng.below(s.saturating_sub(size.min(s)) + 1), size)
                } else {
                    self.range(s)
                };
                let dst_offset = if self.rng.chance(4, 5) {
                    self.rng.below(s.saturating_sub(size.min(s)) + 1)
                } else {
                    self.edge(dst.size)
                };
                (src.handle, src_offset, dst.handle, dst_offset, size)
            };
            if well_laid {
                let d = &mut self.descs[i * words..(i + 1) * words];
                d[..5].copy_from_slice(&[src, src_offset, dst, dst_offset, size]);
                d[5..].fill(0);
                if junk_tail {
                    d[5 + self.rng.below(words as u64 - 5) as usize] = 1;
                }
            }
        }
        // Jobs of many descriptors would take minutes on edu, and beyond the
        // budget no job may start: one zero-sized descriptor makes the
        // whole SUBMIT fail.
        if well_laid && filled > 0 && ((edu && count > 2) || over_budget) {
            let i = self.rng.below(filled as u64) as usize;
            self.descs[i * words + 4] = 0;
        }
        let descs_ptr = match (clean, self.rng.below(30)) {
            (false, 0) => 0,
            (false, 1) => 0xffff_ffff_8100_0000,
            // Misaligned: the fields shift, so this is garbage (but the
            // zero-size descriptor above still refuses edu's long jobs).
            (false, 2) if !edu && !over_budget => self.descs.as_ptr() as u64 + 4,
            _ => self.descs.as_ptr() as u64,
        };
        let mut s = tdrv_submit {
            descs: descs_ptr,
            desc_count: count as u32,
            desc_size: stride as u32,
            ..Default::default()
        };
        if !clean {
            self.stray32(&mut s.flags);
            self.stray32(&mut s.pad);
            self.stray64(&mut [
                std::slice::from_mut(&mut s.job_id),
                &mut s.reserved[..],
                std::slice::from_mut(&mut s.user_data),
            ]);
        }
        // Now and then a burst of the same well-formed job on the soft
        // device: a deep queue for a close or kill to cancel.
        let repeat = if clean && !edu && self.rng.chance(1, 16) {
            16
        } else {
            1
        };
        for i in 0..repeat {
            s.job_id = 0;
            if self.send(fd, Op::Submit, TDRV_IOC_SUBMIT, &mut s).is_err() {
                break;
            }
            self.ctx.shared.descs.fetch_add(count, Relaxed);
            if s.job_id == 0 {
                self.violation("SUBMIT returned job id 0".into());
            }
            self.remember_job(file, s.job_id);
            if i > 0 {
                self.ctx.shared.calls.fetch_add(1, Relaxed);
            }
        }
    }

    /// Runs calls until the run's target.
    fn run(&mut self) {
        let shared = self.ctx.shared;
        while shared.calls.load(Relaxed) < self.ctx.target {
            self.one();
        }
    }
}

/// The body of a forked child: two workers fuzz with files of its own (and
/// one inherited from the parent) until SIGKILLed, so that the kill lands
/// while calls are in flight. Never returns.
fn child(ctx: &'static Ctx, inherited: Option<i32>, mut rng: Rng) -> ! {
    let pool = Pool::new();
    if let Some(fd) = inherited {
        // SAFETY: duplicates a descriptor inherited over fork.
        let fd = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if fd >= 0 {
            pool.add_fd(fd);
        }
    }
    let mut w = Worker::new(ctx, &pool, rng.fork());
    let _ = w.open_file();
    std::thread::scope(|s| {
        let pool = &pool;
        s.spawn(move || Worker::new(ctx, pool, rng).run());
        w.run();
    });
    // SAFETY: leaves without running the parent's exit handlers.
    unsafe { libc::_exit(0) }
}

fn main() {
    let (dev, path, version) = open_device_or_skip("/dev/tdrv0", None);
    let edu = version.device_kind == TDRV_DEVICE_EDU;
    let args: Vec<String> = std::env::args().collect();
    let target: u64 =
        args.get(2)
            .and_then(|a| a.parse().ok())
            .unwrap_or(if edu { 10_000 } else { 50_000 });
    let seed: u64 = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(1);
    let prof = Profile {
        edu,
        threads: 4,
        children: if edu { 3 } else { 8 },
        max_alloc: if edu { 16 << 10 } else { 256 << 10 },
        desc_budget: if edu { 12 } else { u64::MAX },
    };
    let mut t = Tap::new(5);
    t.note(format!(
        "device {path} ({}): {target} calls, seed {seed}, {} threads, {} children (replay: fuzz {path} {target} {seed})",
        if edu { "edu" } else { "soft" },
        prof.threads,
        prof.children
    ));
    install_fatal_handlers();

    let channels = version.num_channels;
    let start = channel_usage(&dev, channels);
    let limit = dev.channel_info(0).map(|c| c.limit_bytes);
    let files_at_start = device_stat(&path, "open_files");
    let (start, limit) = match (start, limit) {
        (Ok(s), Ok(l)) => (s, l),
        (s, l) => {
            t.check(
                "channel usage at start",
                Err::<(), _>(format!("{s:?} {l:?}")),
            );
            t.finish()
        }
    };
    // SAFETY: a valid NUL-terminated path.
    let null_fd = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    let ctx = Ctx {
        path: CString::new(path.as_str()).expect("device path has no NUL"),
        channels,
        limit,
        prof,
        shared: Shared::new(),
        documented: documented_errnos(),
        null_fd,
        target,
        page: page_size() as u64,
    };
    t.note(format!(
        "documented errnos: {}",
        ctx.documented
            .iter()
            .map(|e| errno_name(*e))
            .collect::<Vec<_>>()
            .join(" ")
    ));
    let mut rng = Rng::new(seed);
    let pool = Pool::new();
    for _ in 0..2 {
        if let Ok(d) = Dev::open(&path) {
            pool.add_fd(d.fd());
            std::mem::forget(d);
        }
    }

    // Workers are detached threads (the context lives for the whole
    // program), so that one stuck in the driver can be reported instead of
    // hanging the program at a join.
    let ctx: &'static Ctx = Box::leak(Box::new(ctx));
    let pool: &'static Pool = Box::leak(Box::new(pool));
    let began = Instant::now();
    let mut statuses: Vec<String> = Vec::new();
    let mut bad_children = 0;
    // When the call count last moved: no movement for STALL means stuck.
    let mut progress = (0u64, Instant::now());
    let mut stalled = |calls: u64| {
        if calls != progress.0 {
            progress = (calls, Instant::now());
        }
        progress.1.elapsed() > STALL
    };
    let handles: Vec<_> = (0..ctx.prof.threads)
        .map(|i| {
            let r = rng.fork();
            std::thread::spawn(move || {
                let mut w = Worker::new(ctx, pool, r);
                w.slot = Some(i);
                w.run()
            })
        })
        .collect();
    // The main thread forks the children, evenly over the run, and kills
    // each a few milliseconds into its work.
    for i in 0..ctx.prof.children {
        let due = ctx.target * u64::from(i + 1) / u64::from(ctx.prof.children + 1);
        while ctx.shared.calls.load(Relaxed) < due
            && !stalled(ctx.shared.calls.load(Relaxed))
            && !handles.iter().all(|h| h.is_finished())
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let inherited = {
            let files = pool.files.lock().unwrap();
            files.first().map(|f| f.fds.lock().unwrap()[0])
        };
        let child_rng = rng.fork();
        let lifetime = Duration::from_millis(5 + rng.below(60));
        // SAFETY: the child only uses its own fresh state, the shared
        // counters and the inherited descriptors, and leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            child(ctx, inherited, child_rng);
        }
        if pid < 0 {
            statuses.push(format!("fork: {}", errno_name(errno())));
            bad_children += 1;
            continue;
        }
        std::thread::sleep(lifetime);
        // SAFETY: signals our own child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        // A SIGKILLed process that does not go away is stuck in the
        // driver (an uninterruptible wait in release or a call).
        let killed_at = Instant::now();
        let mut status = 0;
        let reaped = loop {
            // SAFETY: reaps our own child, without blocking.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break true;
            }
            if killed_at.elapsed() > STALL {
                break false;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let killed = libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL;
        let finished = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
        if !reaped {
            bad_children += 1;
            statuses.push(format!("child {pid} still alive {STALL:?} after SIGKILL"));
        } else if !killed && !finished {
            bad_children += 1;
            statuses.push(format!("child {pid}: wait status {status:#x}"));
        }
    }
    while !handles.iter().all(|h| h.is_finished()) && !stalled(ctx.shared.calls.load(Relaxed)) {
        std::thread::sleep(Duration::from_millis(5));
    }
    if !handles.iter().all(|h| h.is_finished()) {
        let stuck: Vec<String> = handles
            .iter()
            .enumerate()
            .filter(|(_, h)| !h.is_finished())
            .map(|(i, _)| {
                let op = ctx.shared.current[i].load(Relaxed) as usize;
                format!("worker {i} still in {:?}", OPS[op.saturating_sub(1)])
            })
            .collect();
        t.check(
            "fuzzing threads ran every call and ended",
            Err::<(), _>(format!(
                "workers stuck in the driver: no call ended for {STALL:?}:\n{}",
                stuck.join("\n")
            )),
        );
        // The other checks need the workers gone; exiting takes them down
        // (the driver's waits are interruptible).
        t.finish();
    }
    let worker_results: Vec<std::thread::Result<()>> =
        handles.into_iter().map(|h| h.join()).collect();
    let elapsed = began.elapsed();
    let calls = ctx.shared.calls.load(Relaxed);

    // Everything goes: mappings, then files (dup'd descriptors included).
    for m in pool.maps.write().unwrap().drain(..) {
        // SAFETY: unmaps a mapping this process made; no worker is left.
        unsafe { libc::munmap(m.addr as *mut _, m.len) };
    }
    pool.files.lock().unwrap().clear();
    drop(dev);

    t.note(format!(
        "{calls} calls in {:.1} s ({:.0}/s), {} children",
        elapsed.as_secs_f64(),
        calls as f64 / elapsed.as_secs_f64(),
        ctx.prof.children
    ));
    for op in OPS {
        let row = &ctx.shared.hist[op as usize];
        let total: u64 = row.iter().map(|c| c.load(Relaxed)).sum();
        let mut parts: BTreeMap<String, u64> = BTreeMap::new();
        for (e, c) in row.iter().enumerate() {
            let c = c.load(Relaxed);
            if c > 0 {
                let name = if e == 0 {
                    "ok".into()
                } else {
                    errno_name(e as i32)
                };
                parts.insert(name, c);
            }
        }
        let parts: Vec<String> = parts.iter().map(|(k, v)| format!("{k} {v}")).collect();
        t.note(format!("{op:?}: {total}: {}", parts.join(", ")));
    }
    let examples = ctx.shared.examples();

    t.run("fuzzing threads ran every call and ended", || {
        let panicked = worker_results.iter().filter(|r| r.is_err()).count();
        if panicked > 0 {
            return Err(format!("{panicked} worker threads panicked"));
        }
        if calls < target {
            return Err(format!("only {calls} of {target} calls"));
        }
        Ok(())
    });
    t.run("forked fuzzers ended by SIGKILL mid-flight", || {
        if bad_children > 0 {
            return Err(statuses.join("\n"));
        }
        Ok(())
    });
    t.run(
        "every ioctl errno is one uapi/tdrv.h documents for that ioctl",
        || {
            expect_eq(
                "undocumented errnos",
                ctx.shared.unexpected.load(Relaxed),
                0,
            )
            .map_err(|e| format!("{e}\n{}", examples.join("\n")))
        },
    );
    t.run(
        "outputs are consistent (BUF_INFO matches ALLOC, no handle reuse, bad sizes refused)",
        || {
            expect_eq("violations", ctx.shared.violations.load(Relaxed), 0)
                .map_err(|e| format!("{e}\n{}", examples.join("\n")))
        },
    );
    t.run(
        "with files closed and children reaped, every channel's usage returns to the start",
        || {
            let d = ok("open", Dev::open(&path))?;
            let took = wait_usage(&d, &start, STALL)?;
            println!("# usage back at the start after {took:?}");
            // `d` stands in for the file opened at the start.
            if let Some(files) = files_at_start {
                expect_eq("open_files", device_stat(&path, "open_files"), Some(files))?;
            }
            Ok(())
        },
    );
    t.finish();
}
