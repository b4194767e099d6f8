//! Memory shared with the guest: BAR2 (a memfd that QEMU maps too) and the
//! guest's RAM (the file behind QEMU's memory-backend-file).
//!
//! Another process writes this memory at any time, so it is never Rust
//! memory: no `&`/`&mut` to its bytes is ever formed. A [`Region`] hands
//! out only
//! - atomic accesses to naturally aligned u32 fields (the ring indices,
//!   `reset`, `status`, `inject[]`), through `AtomicU32::from_ptr`; the
//!   guest's plain aligned 32-bit stores and loads are single-copy atomic
//!   on x86, so both sides see whole values;
//! - volatile reads and writes of descriptor and completion fields, whose
//!   ordering against the guest comes from the acquire load of `sq_tail`
//!   before reading descriptors and the release store of `cq_tail` after
//!   writing completions (the protocol of docs/sim-device.md);
//! - bulk copies: from 64 KiB on x86-64, streaming stores (`asm!` whose
//!   memory accesses are those of a loop of relaxed atomic byte copies);
//!   otherwise relaxed atomic loads and stores, a u64 at a time where
//!   source and destination are equally aligned (a byte at a time
//!   otherwise, or through the kernel: `pwrite(2)` from one mapping into
//!   the file behind the other). The guest may write the same bytes at the
//!   same moment, as it may under a real device's DMA: it then reads
//!   whatever mix of old and new bytes results, never anything that
//!   matters to the simulator, which does not look at payload. Atomics
//!   keep that a race of values, not a data race: within this process every
//!   access to payload bytes is atomic (two queues may copy into the same
//!   bytes), and the guest's accesses are another process's. A plain
//!   `memcpy` through references would not be sound here; `pwrite` was
//!   (the kernel does the copy) but runs through the page cache a page at
//!   a time, at a third of memcpy's rate (`make bench`, figure 9s).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::AtomicU8;
use std::sync::atomic::Ordering::Relaxed;

/// What owns a region's memory.
enum Backing {
    /// A `MAP_SHARED` mapping of `fd` from file offset 0.
    Mapped { fd: OwnedFd },
    /// A zeroed heap allocation with this layout (tests, Miri).
    Heap { layout: std::alloc::Layout },
}

/// A range of shared memory, accessed only through raw pointers, atomics,
/// volatile accesses and the kernel (see the module documentation).
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: a Region is a raw pointer to memory that lives as long as the
// Region (a mapping unmapped in Drop, or a heap block freed in Drop) plus
// the fd it maps. Every access method is safe to call from any thread at
// the same time: u32 fields are accessed atomically, other fields through
// volatile accesses ordered by the ring protocol, and nothing hands out
// references to the bytes.
unsafe impl Send for Region {}
// SAFETY: see Send above; shared access is what the methods are for.
unsafe impl Sync for Region {}

impl Region {
    /// Maps the first `len` bytes of `fd` shared and writable.
    pub fn map(fd: OwnedFd, len: usize) -> io::Result<Region> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty region"));
        }
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL), so it
        // replaces nothing of ours; the result is checked below.
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
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Region {
            ptr: NonNull::new(p.cast()).expect("mmap returned NULL"),
            len,
            backing: Backing::Mapped { fd },
        })
    }

    /// A zeroed, page-aligned heap region of `len` bytes, for tests.
    pub fn heap(len: usize) -> Region {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).expect("region size");
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Region {
            ptr,
            len,
            backing: Backing::Heap { layout },
        }
    }

    /// A region backed by a new memfd of `len` bytes (zeroed, sparse).
    pub fn memfd(name: &str, len: usize) -> io::Result<Region> {
        let cname = std::ffi::CString::new(name).map_err(io::Error::other)?;
        // SAFETY: cname is a valid C string; the fd is checked below.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a new fd that nothing else owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let file = File::from(fd);
        file.set_len(len as u64)?;
        Region::map(file.into(), len)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: regions have a length).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The fd behind a mapped region.
    pub fn fd(&self) -> Option<&OwnedFd> {
        match &self.backing {
            Backing::Mapped { fd } => Some(fd),
            Backing::Heap { .. } => None,
        }
    }

    /// Whether `[off, off + len)` lies inside the region.
    pub fn contains(&self, off: u64, len: u64) -> bool {
        off.checked_add(len)
            .is_some_and(|end| end <= self.len as u64)
    }

    fn field<T>(&self, off: usize) -> *mut T {
        let size = std::mem::size_of::<T>();
        assert!(
            off % size == 0 && off.checked_add(size).is_some_and(|e| e <= self.len),
            "field at {off:#x} (size {size}) outside the region or unaligned"
        );
        // SAFETY: off + size <= len, so the result stays inside the
        // allocation or mapping.
        unsafe { self.ptr.as_ptr().add(off) }.cast()
    }

    /// The u32 at `off` (4-aligned, inside the region) as an atomic.
    pub fn u32(&self, off: usize) -> &AtomicU32 {
        let p = self.field::<u32>(off);
        // SAFETY: p is in bounds and 4-aligned (checked by field()), and
        // valid for as long as &self. Within this process every access to
        // the u32 fields goes through these atomics; the other side (the
        // guest) uses aligned 32-bit accesses, which are single-copy atomic.
        unsafe { AtomicU32::from_ptr(p) }
    }

    /// Volatile read of the u64 at `off` (8-aligned).
    pub fn read_u64(&self, off: usize) -> u64 {
        let p = self.field::<u64>(off);
        // SAFETY: in bounds and aligned (field()); volatile because the
        // other side may write it: the value is read once, as it is, and
        // never through a reference.
        unsafe { p.read_volatile() }
    }

    /// Volatile read of the u32 at `off` (4-aligned), for descriptor and
    /// completion fields (not for the atomically accessed indices).
    pub fn read_u32(&self, off: usize) -> u32 {
        let p = self.field::<u32>(off);
        // SAFETY: as in read_u64.
        unsafe { p.read_volatile() }
    }

    /// Volatile write of the u64 at `off` (8-aligned).
    pub fn write_u64(&self, off: usize, v: u64) {
        let p = self.field::<u64>(off);
        // SAFETY: in bounds and aligned (field()); no reference exists to
        // these bytes, and the other side reads them only after the
        // release store that publishes them.
        unsafe { p.write_volatile(v) }
    }

    /// Volatile write of the u32 at `off` (4-aligned).
    pub fn write_u32(&self, off: usize, v: u32) {
        let p = self.field::<u32>(off);
        // SAFETY: as in write_u64.
        unsafe { p.write_volatile(v) }
    }

    /// Copies `len` bytes from `src[src_off..]` to `self[dst_off..]`.
    /// Both ranges must lie inside their regions (checked: panics
    /// otherwise, the callers validate first). Overlapping ranges (the same
    /// region) give unspecified contents in the overlap, as on hardware.
    pub fn copy_from(&self, dst_off: u64, src: &Region, src_off: u64, len: u64) -> io::Result<()> {
        assert!(
            self.contains(dst_off, len) && src.contains(src_off, len),
            "copy outside its region"
        );
        // SAFETY: src_off + len <= src.len, checked above.
        let sp = unsafe { src.ptr.as_ptr().add(src_off as usize) };
        // SAFETY: dst_off + len <= self.len, checked above.
        let dp = unsafe { self.ptr.as_ptr().add(dst_off as usize) };
        let len = len as usize;
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if len >= STREAM_MIN {
            // SAFETY: both ranges are in bounds of live mappings or
            // allocations (checked above), which outlive this call.
            unsafe { copy_streaming(sp, dp, len) };
            return Ok(());
        }
        let words = (sp as usize ^ dp as usize) % 8 == 0;
        if let (false, Backing::Mapped { fd }) = (words, &self.backing) {
            // Not equally aligned: a byte at a time would be slow, the
            // kernel copies any alignment.
            return pwrite_all(fd, sp, len, dst_off);
        }
        // SAFETY: both ranges are in bounds of live mappings or
        // allocations (checked above), which outlive this call.
        unsafe { copy_atomic(sp, dp, len) };
        Ok(())
    }

    /// Writes `data` at `off` (tests and setup; atomic byte stores, as
    /// copies use).
    pub fn write_bytes(&self, off: u64, data: &[u8]) {
        assert!(
            self.contains(off, data.len() as u64),
            "write outside the region"
        );
        for (i, b) in data.iter().enumerate() {
            // SAFETY: off + i < len, checked above; a byte is always
            // aligned; the memory lives as long as `self`.
            unsafe { AtomicU8::from_ptr(self.ptr.as_ptr().add(off as usize + i)) }
                .store(*b, Relaxed);
        }
    }

    /// Reads `len` bytes at `off` (tests and diagnostics; atomic loads).
    pub fn read_bytes(&self, off: u64, len: usize) -> Vec<u8> {
        assert!(self.contains(off, len as u64), "read outside the region");
        (0..len)
            .map(|i| {
                // SAFETY: as in write_bytes.
                let b = unsafe { AtomicU8::from_ptr(self.ptr.as_ptr().add(off as usize + i)) };
                b.load(Relaxed)
            })
            .collect()
    }
}

/// Copies of at least this many bytes stream (see [`copy_streaming`]).
#[cfg(all(target_arch = "x86_64", not(miri)))]
const STREAM_MIN: usize = 64 << 10;

/// Copies `len` bytes from `s` to `d` the way a DMA engine writes memory:
/// 64 bytes at a time with unaligned 16-byte loads and non-temporal
/// (streaming) 16-byte stores, which go to memory without first reading
/// each destination line into the cache, then a store fence. Bytes before
/// the first 16-byte-aligned destination address, and after the last
/// whole 64, go through [`copy_atomic`]. Measured on this project's
/// machines with data not in the cache: 17-19 GB/s, against 11-12 for
/// memcpy and 12-13 for the u64 loop of `copy_atomic`.
///
/// An `asm!` block may do to memory only what some Rust code could do.
/// The loop loads each source byte and stores each destination byte once,
/// in an order the program cannot observe apart from a race: what a loop
/// of relaxed atomic byte loads and stores does (`copy_atomic` with bytes).
/// So, as there, the guest's concurrent writes and another queue's copy
/// into the same bytes make a race of values, not a data race (see the
/// module documentation). The fence orders the streaming stores before
/// anything this thread stores next, such as the completion record that
/// tells the guest the bytes are there.
///
/// # Safety
///
/// As for [`copy_atomic`].
#[cfg(all(target_arch = "x86_64", not(miri)))]
unsafe fn copy_streaming(s: *const u8, d: *mut u8, len: usize) {
    let head = (d as usize).wrapping_neg() % 16;
    let head = head.min(len);
    // SAFETY: the first `head <= len` bytes of both ranges (the caller's
    // guarantee).
    unsafe { copy_atomic(s, d, head) };
    let blocks = (len - head) / 64;
    if blocks > 0 {
        // SAFETY: the loop reads [s + head, + 64 * blocks) and writes
        // [d + head, + 64 * blocks), inside the ranges the caller keeps
        // live; `d + head` is 16-byte aligned, as MOVNTDQ needs. It
        // clobbers only the declared registers and the flags, and uses no
        // stack.
        unsafe {
            std::arch::asm!(
                "2:",
                "movdqu xmm0, [rsi]",
                "movdqu xmm1, [rsi + 16]",
                "movdqu xmm2, [rsi + 32]",
                "movdqu xmm3, [rsi + 48]",
                "movntdq [rdi], xmm0",
                "movntdq [rdi + 16], xmm1",
                "movntdq [rdi + 32], xmm2",
                "movntdq [rdi + 48], xmm3",
                "add rsi, 64",
                "add rdi, 64",
                "dec rcx",
                "jnz 2b",
                "sfence",
                inout("rcx") blocks => _,
                inout("rsi") s.add(head) => _,
                inout("rdi") d.add(head) => _,
                out("xmm0") _,
                out("xmm1") _,
                out("xmm2") _,
                out("xmm3") _,
                options(nostack),
            );
        }
    }
    let done = head + blocks * 64;
    // SAFETY: the last `len - done` bytes of both ranges.
    unsafe { copy_atomic(s.add(done), d.add(done), len - done) };
}

/// Copies `len` bytes from `s` to `d` with relaxed atomic accesses: u64s
/// where both are equally aligned (after the bytes up to the first aligned
/// address), bytes elsewhere. Forward, so overlapping ranges get some mix
/// of old and new bytes in the overlap, never undefined behaviour.
///
/// # Safety
///
/// `[s, s + len)` and `[d, d + len)` lie inside live mappings or
/// allocations for the whole call, accessed in this process only through
/// atomics (see the module documentation).
unsafe fn copy_atomic(s: *const u8, d: *mut u8, len: usize) {
    let byte = |i: usize| {
        // SAFETY: i < len, so both addresses are in their ranges (the
        // caller's guarantee); a byte is always aligned.
        unsafe {
            let v = AtomicU8::from_ptr(s.add(i).cast_mut()).load(Relaxed);
            AtomicU8::from_ptr(d.add(i)).store(v, Relaxed);
        }
    };
    let mut i = 0;
    if (s as usize ^ d as usize) % 8 == 0 {
        while i < len && (s as usize + i) % 8 != 0 {
            byte(i);
            i += 1;
        }
        while i + 8 <= len {
            // SAFETY: i + 8 <= len keeps both words in their ranges; `s + i`
            // is 8-aligned (the loop above), and so is `d + i` (equal
            // alignment).
            unsafe {
                let v = AtomicU64::from_ptr(s.add(i).cast::<u64>().cast_mut()).load(Relaxed);
                AtomicU64::from_ptr(d.add(i).cast::<u64>()).store(v, Relaxed);
            }
            i += 8;
        }
    }
    while i < len {
        byte(i);
        i += 1;
    }
}

/// Writes `len` bytes from `sp` (in this process) at `off` of the file
/// `fd`, in chunks of at most 1 GiB.
fn pwrite_all(fd: &OwnedFd, sp: *const u8, len: usize, off: u64) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let chunk = (len - done).min(1 << 30);
        // SAFETY: the kernel reads [sp + done, + chunk) from our address
        // space, which the caller keeps inside a live mapping or
        // allocation; it writes the file behind the destination, not Rust
        // memory. A concurrent guest write to either range changes bytes,
        // never memory safety.
        let n = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                sp.add(done).cast(),
                chunk,
                (off + done as u64) as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwrite wrote nothing",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

impl Drop for Region {
    fn drop(&mut self) {
        match &self.backing {
            Backing::Mapped { .. } => {
                // SAFETY: ptr/len are exactly the mapping made in map(),
                // and no access outlives &self.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
            }
            Backing::Heap { layout } => {
                // SAFETY: allocated in heap() with this layout.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn heap_fields_and_copy() {
        let r = Region::heap(8192);
        r.u32(4).store(7, Ordering::Release);
        assert_eq!(r.read_u32(4), 7);
        r.write_u64(8, 0x1122_3344_5566_7788);
        assert_eq!(r.read_u64(8), 0x1122_3344_5566_7788);
        r.write_bytes(100, b"hello");
        r.copy_from(4000, &r, 100, 5).unwrap();
        assert_eq!(r.read_bytes(4000, 5), b"hello");
        assert!(r.contains(8191, 1));
        assert!(!r.contains(8191, 2));
        assert!(!r.contains(u64::MAX, 2));
    }

    #[test]
    fn copies_of_any_alignment_and_length_move_exactly_their_bytes() {
        let src = Region::heap(256);
        let data: Vec<u8> = (0..256u32).map(|i| (i * 13 + 1) as u8).collect();
        src.write_bytes(0, &data);
        // Equally aligned pairs (0/8, 1/1, 5/5) and unequal ones, around
        // the word size.
        for s_off in [0u64, 1, 5, 8] {
            for d_off in [0u64, 1, 5, 8] {
                for (len, atomics) in [0u64, 1, 7, 8, 9, 17, 64, 65]
                    .into_iter()
                    .flat_map(|l| [(l, false), (l, true)])
                {
                    let dst = Region::heap(256);
                    if atomics {
                        // The portable path directly, whatever this
                        // target's `copy_from` uses.
                        // SAFETY: both ranges lie inside their regions
                        // (offsets + lengths <= 73 of 256 bytes).
                        unsafe {
                            copy_atomic(
                                src.ptr.as_ptr().add(s_off as usize),
                                dst.ptr.as_ptr().add(d_off as usize),
                                len as usize,
                            )
                        };
                    } else {
                        dst.copy_from(d_off, &src, s_off, len).unwrap();
                    }
                    let got = dst.read_bytes(0, 256);
                    let (d, l, s) = (d_off as usize, len as usize, s_off as usize);
                    assert!(
                        got[..d].iter().all(|&b| b == 0),
                        "before {s_off}->{d_off} x{len}"
                    );
                    assert_eq!(&got[d..d + l], &data[s..s + l], "{s_off}->{d_off} x{len}");
                    assert!(
                        got[d + l..].iter().all(|&b| b == 0),
                        "after {s_off}->{d_off} x{len}"
                    );
                }
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfd_create and mmap are not supported by Miri")]
    fn memfd_copies_of_equal_alignment_move_exactly_their_bytes() {
        let a = Region::memfd("a", 1 << 20).unwrap();
        let b = Region::memfd("b", 1 << 20).unwrap();
        let data: Vec<u8> = (0..70_003u32).map(|i| (i * 11) as u8).collect();
        // Equal alignment (both 3 mod 8): where atomics copy, bytes then
        // words.
        a.write_bytes(8 * 1000 + 3, &data);
        b.copy_from(8 * 20_000 + 3, &a, 8 * 1000 + 3, data.len() as u64)
            .unwrap();
        assert_eq!(b.read_bytes(8 * 20_000 + 3, data.len()), data);
        assert_eq!(b.read_bytes(8 * 20_000 + 2, 1), [0]);
        assert_eq!(b.read_bytes(8 * 20_000 + 3 + data.len() as u64, 1), [0]);
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "the streaming copy is x86-64 asm; Miri runs the atomic path"
    )]
    fn large_copies_of_any_alignment_move_exactly_their_bytes() {
        const LEN: usize = (64 << 10) + 100;
        let src = Region::heap(LEN + 64);
        let data: Vec<u8> = (0..LEN as u32 + 64).map(|i| (i * 31 + 7) as u8).collect();
        src.write_bytes(0, &data);
        // Every destination misalignment against 16 (the head before the
        // streaming loop), two source ones, and lengths whose tails after
        // the last 64 bytes differ.
        for d_off in 0..17usize {
            for s_off in [0usize, 3] {
                for len in [64 << 10, (64 << 10) + 1, (64 << 10) + 63, LEN - 17] {
                    let dst = Region::heap(LEN + 64);
                    dst.copy_from(d_off as u64, &src, s_off as u64, len as u64)
                        .unwrap();
                    let got = dst.read_bytes(0, LEN + 64);
                    assert!(
                        got[..d_off].iter().all(|&b| b == 0),
                        "before {s_off}->{d_off} x{len}"
                    );
                    assert!(
                        got[d_off..d_off + len] == data[s_off..s_off + len],
                        "{s_off}->{d_off} x{len}"
                    );
                    assert!(
                        got[d_off + len..].iter().all(|&b| b == 0),
                        "after {s_off}->{d_off} x{len}"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "unaligned")]
    fn unaligned_field_panics() {
        let r = Region::heap(64);
        r.u32(2);
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfd_create and mmap are not supported by Miri")]
    fn memfd_copies_of_unequal_alignment_move_exactly_their_bytes() {
        let a = Region::memfd("a", 1 << 20).unwrap();
        let b = Region::memfd("b", 1 << 20).unwrap();
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 7) as u8).collect();
        a.write_bytes(12_345, &data);
        b.copy_from(500_000, &a, 12_345, data.len() as u64).unwrap();
        assert_eq!(b.read_bytes(500_000, data.len()), data);
        // Within one region (through its own file where atomics copy).
        a.copy_from(0, &a, 12_345, 100).unwrap();
        assert_eq!(a.read_bytes(0, 100), &data[..100]);
        assert!(a.fd().is_some());
    }
}
