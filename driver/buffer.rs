// SPDX-License-Identifier: GPL-2.0

//! A device buffer: memory in pieces, channel accounting and its fence.
//!
//! # Memory
//!
//! What holds a buffer's memory is its [`Backing`]; the rest of the driver
//! sees only the pieces' CPU and bus addresses and, for mmap, page frames.
//! Three kinds exist: tdrv's own DMA-coherent allocation in host memory;
//! an imported foreign dma-buf (see `dmabuf.rs`): its kernel mapping, in
//! pieces of one page each with their bus addresses; and device memory
//! (HBM behind a PCI BAR) that a backend allocated, see [`DeviceMemory`].
//!
//! # Device memory
//!
//! A device-memory buffer is one piece: a contiguous range of device
//! addresses (`dma_addr` is the device address of byte 0). The CPU never
//! touches it through the kernel: COPY_IN, COPY_OUT, MEMSET and COPY hand
//! the bytes to the device's engine ([`crate::engine::Engine`]'s `dma_*`
//! methods), which moves them by DMA straight from and to the caller's
//! pages, and mmap maps the BAR pages write-combined.
//!
//! A buffer is one or more *pieces* of `1 << shift` bytes (the last one
//! may be shorter). Up to [`MAX_PIECE`] a buffer is a single piece; larger
//! buffers, and smaller ones when memory is fragmented, are split, so that
//! no allocation needs more than the page allocator's largest block and no
//! CMA area is needed (stock kernels have none). For a device whose engine
//! does DMA the pieces are DMA-coherent allocations; for one that does not
//! (the software device) they are plain system pages, which need no DMA
//! mapping and never come from CMA, where `dma_alloc_coherent` takes
//! multi-page blocks from when the kernel has an area (slow to allocate
//! and free). `dma_addr` (ALLOC, BUF_INFO) is the bus address of byte 0
//! (for system pages, the physical address, as a direct DMA mapping would
//! give); only the first piece is contiguous behind it. The engines walk
//! the pieces.
//!
//! # Lifetime
//!
//! Buffers are reference counted (`Arc`). The owning file's handle table,
//! every mapping (see `mmap.rs`) and every job hold a reference, so FREE
//! only drops the handle: the memory goes back when the last user goes,
//! or earlier, when the device is unbound ([`Buffer::detach`] and
//! [`Buffer::release_memory`]): DMA memory must not outlive the device's
//! binding.
//!
//! # Access
//!
//! The CPU touches buffer memory only through raw copies, never through
//! Rust references, because a device may access the same bytes
//! concurrently. Ioctls reach the memory only while they hold an
//! [`ActiveGuard`] of the device, and only briefly: user memory is never
//! faulted in while a guard is held (a page fault may block for ever, on
//! userfaultfd or FUSE, and unbind waits for every guard).

use core::ffi::c_void;

use kernel::{
    alloc::KVVec,
    bindings,
    device::{
        Bound,
        Device, //
    },
    dma::Coherent,
    new_mutex,
    page::PAGE_SIZE,
    prelude::*,
    sync::{
        atomic::{
            Acquire,
            Atomic,
            Full, //
        },
        Arc,
        Mutex, //
    },
    uaccess::UserPtr, //
};

use crate::{
    dmabuf::{
        Import,
        ImportRef, //
    },
    device::{
        ActiveGuard,
        TdrvDevice, //
    },
    fence::Fence,
    glue::{
        self,
        Pages, //
    },
    range::ByteRange,
    resv,
    uapi::MAX_BUFFER_SIZE, //
};

/// Largest piece: 4 MiB, the x86 page allocator's largest block.
pub(crate) const MAX_PIECE: usize = 4 << 20;

/// Bytes an ioctl copies per active-guard section, and between checks for
/// rescheduling.
const CHUNK: usize = 64 << 10;

/// Bytes the software engine copies between cancellation checks.
pub(crate) const ENGINE_PIECE: usize = 1 << 20;

/// The CPU and bus addresses of one piece.
#[derive(Clone, Copy)]
struct PieceAddr {
    cpu: *mut u8,
    dma: u64,
}

// SAFETY: The CPU address is only dereferenced through the raw copies of
// `Buffer`, whose callers guarantee the memory is live (see `Buffer`'s
// invariant); the address itself may be shared and sent freely.
unsafe impl Send for PieceAddr {}
// SAFETY: As above.
unsafe impl Sync for PieceAddr {}

/// What holds a buffer's memory; dropping it gives the memory back.
///
/// Each kind provides the pieces' addresses when the buffer is built (see
/// [`Buffer::from_backing`]) and the page frames that mmap inserts.
enum Backing {
    /// DMA-coherent pieces tdrv allocated for the device (held to be freed
    /// on drop; the pieces' addresses are in [`Buffer`]).
    Coherent { _pieces: OwnedPieces<Coherent<[u8]>> },
    /// System pages, for a device whose engine does no DMA (see
    /// [`Buffer::new`]).
    System { _pieces: OwnedPieces<Pages> },
    /// A foreign dma-buf, mapped for the CPU and (for a DMA engine) for the
    /// device. With `peer`, it is another tdrv device's device memory,
    /// mapped peer-to-peer for this device only (no CPU address): that
    /// device's buffer moves the bytes for the CPU paths (COPY_IN/OUT,
    /// MEMSET) and gives the page frames mmap inserts.
    Imported {
        _import: Import,
        peer: Option<Arc<Buffer>>,
    },
    /// Device memory allocated by the backend; the piece's `dma` is its
    /// device address, its `cpu` address is null.
    Device(KBox<dyn DeviceMemory>),
}

impl Backing {
    /// Gives the memory back like dropping does, except that a foreign
    /// dma-buf is released later, by the module's release queue: releasing
    /// takes its reservation lock, which a job's completion (a dma-fence
    /// signalling path, where a buffer's last reference may go) must not
    /// take, nor any lock the completion takes (the registry's sweep lock,
    /// which both callers hold). Unbind waits for those releases
    /// ([`Import::flush_releases`]).
    fn release(self) {
        match self {
            Self::Imported { _import, peer } => {
                _import.release_later();
                // Never the peer's last reference here: the imported
                // dma-buf holds one until the queued release puts it.
                drop(peer);
            }
            other => drop(other),
        }
    }
}

/// tdrv's own allocations for one buffer: a buffer of one piece keeps it
/// inline, so a small buffer costs no extra allocation.
enum OwnedPieces<T> {
    One(T),
    Many(KVec<T>),
}

/// The pieces' addresses, in order. As for [`OwnedPieces`], one piece is
/// kept inline: most buffers have one, and an allocation per buffer costs
/// more kernel memory (slab object, debug tracking) than the address.
enum Pieces {
    One(PieceAddr),
    Many(KVVec<PieceAddr>),
}

impl Pieces {
    /// Pieces from a list of addresses; a single one is moved inline.
    fn from_vec(v: KVVec<PieceAddr>) -> Self {
        match v.first() {
            Some(&p) if v.len() == 1 => Self::One(p),
            _ => Self::Many(v),
        }
    }

    fn first(&self) -> Option<PieceAddr> {
        match self {
            Self::One(p) => Some(*p),
            Self::Many(v) => v.first().copied(),
        }
    }

    /// The address of piece `i`, which exists.
    fn get(&self, i: usize) -> PieceAddr {
        match self {
            Self::One(p) => {
                debug_assert_eq!(i, 0);
                *p
            }
            Self::Many(v) => v[i],
        }
    }
}

/// A range of device memory that a backend allocated for a buffer; given
/// back to the backend's allocator when dropped.
pub(crate) trait DeviceMemory: Send + Sync {
    /// The device address of byte 0.
    fn dev_addr(&self) -> u64;

    /// The CPU page frame (in the device's BAR) of the page at device
    /// address `dev_addr`, which lies inside the range.
    fn pfn(&self, dev_addr: u64) -> usize;

    /// The range as other devices may reach it, peer-to-peer.
    fn p2p(&self) -> P2pRange;
}

/// Device memory as a peer-to-peer importer reaches it (see `dmabuf.c`).
#[derive(Clone, Copy)]
pub(crate) struct P2pRange {
    /// The `struct p2pdma_provider` of the BAR the memory is in, or null
    /// if the device is none. Valid while the device is bound.
    pub(crate) provider: *mut core::ffi::c_void,
    /// The CPU physical address of byte 0 (in the BAR).
    pub(crate) phys: u64,
}

impl Backing {
    /// The page frame of a page of this memory, given its piece address,
    /// or `None` if it cannot be mapped into userspace.
    ///
    /// # Safety
    ///
    /// The memory is live, and `page.cpu` is a page-aligned address inside
    /// it.
    unsafe fn pfn(&self, page: PieceAddr) -> Option<usize> {
        match self {
            // SAFETY: Coherent memory is in the kernel's direct map (see
            // `glue::kaddr_to_pfn`), live by the caller's guarantee.
            Self::Coherent { .. } => Some(unsafe { glue::kaddr_to_pfn(page.cpu) }),
            // SAFETY: System pages are in the direct map, live by the
            // caller's guarantee.
            Self::System { .. } => Some(unsafe { glue::kaddr_to_pfn(page.cpu) }),
            // SAFETY: The import's kernel mapping is a vmap of system
            // memory (`dmabuf.c` refuses I/O memory), live by the caller's
            // guarantee.
            Self::Imported { peer: None, .. } => Some(unsafe { glue::kaddr_to_pfn(page.cpu) }),
            // Not reached: `Buffer::page_pfns` asks the peer.
            Self::Imported { peer: Some(_), .. } => None,
            Self::Device(mem) => Some(mem.pfn(page.dma)),
        }
    }
}

/// Where a buffer's memory is.
enum MemState {
    /// Allocated and reachable.
    Live(Backing),
    /// Unbind in progress: still allocated, but the fault handler maps no
    /// more of it; freed once user mappings have been zapped.
    Detached(Backing),
    /// Freed at unbind.
    Gone,
}

/// One device buffer.
///
/// # Invariants
///
/// `pieces[i]` describes the `i`-th piece of the memory held by `mem` for
/// as long as `mem` is `Live` or `Detached`. `mem` leaves those states only in
/// [`Buffer::release_memory`], whose caller guarantees that the device is
/// unbound, its engine stopped, no active guard exists and no user mapping
/// maps the memory. So code holding an [`ActiveGuard`] of the device, and
/// a running engine, see live memory.
#[pin_data(PinnedDrop)]
pub(crate) struct Buffer {
    #[pin]
    mem: Mutex<MemState>,
    pieces: Pieces,
    /// Every piece but the last is `1 << shift` bytes.
    shift: u8,
    size: usize,
    /// Bytes of the pieces: the size rounded up to pages. What the channel
    /// is charged is `span` for tdrv's own memory, 0 for imports (see
    /// [`Buffer::charged`]; not stored, to keep the buffer small).
    span: usize,
    channel: u16,
    device: Arc<TdrvDevice>,
    /// This buffer's key in the device's buffer registry; also its
    /// `tdrv_buf_info.buf_id` (unique among the device's live buffers,
    /// never 0).
    registry_key: u64,
    /// The memory is device memory: bytes move by the engine's DMA.
    on_device: bool,
    /// Imported from a foreign dma-buf: counted in the device's imports.
    foreign: bool,
    /// Pending device reads/writes and the completion count.
    #[pin]
    pub(crate) fence: Fence,
    /// Implicit synchronisation (`resv.rs`): for tdrv's own memory, the
    /// buffer's reservation object, made at its first export (null
    /// before) and freed on drop; for a foreign import, an [`ImportRef`]
    /// (the imported dma-buf, whose object it is, and the import's access
    /// gate; dropped on drop).
    resv: Atomic<*mut c_void>,
}

// Every buffer is one `Arc` allocation: a refcount, padded to 8 bytes,
// then the buffer. Without lock debugging (which grows every lock) that
// must fit kmalloc's 256-byte class, or each buffer pays for the next
// class, 512 bytes; per-buffer state that few buffers use (dma-buf
// exports) lives elsewhere for this reason.
#[cfg(not(any(CONFIG_DEBUG_LOCK_ALLOC, CONFIG_DEBUG_MUTEXES, CONFIG_DEBUG_SPINLOCK)))]
const _: () = assert!(
    core::mem::size_of::<u64>() + core::mem::size_of::<Buffer>() <= 256,
    "Buffer no longer fits the 256-byte kmalloc class"
);

/// A section touching a buffer's memory ([`Buffer::enter`]).
pub(crate) struct MemGuard<'a> {
    active: ActiveGuard<'a>,
    buf: &'a Buffer,
}

impl Drop for MemGuard<'_> {
    fn drop(&mut self) {
        self.buf.end_access();
    }
}

/// How a backing's memory is laid out, for [`Buffer::from_backing`].
struct Layout {
    /// The pieces' addresses, in order.
    pieces: Pieces,
    /// Every piece but the last is `1 << shift` bytes.
    shift: u32,
    /// The buffer's size in bytes.
    size: usize,
    /// Bytes of the pieces (the size rounded up to pages).
    span: usize,
    /// Bytes charged to `channel`.
    charged: u64,
    channel: u32,
}

/// The piece shift for an import whose pages have the bus addresses
/// `dma`: the largest piece size, at most [`MAX_PIECE`] and at least a
/// page, such that every piece is one contiguous bus range (pieces are
/// equal and aligned to the buffer's start, so a discontinuity before
/// page `i` allows pieces of at most the largest power of two dividing
/// `i` pages).
fn import_shift(dma: &[u64]) -> u32 {
    let page_shift = PAGE_SIZE.trailing_zeros();
    let max = (dma.len() * PAGE_SIZE).next_power_of_two().min(MAX_PIECE).trailing_zeros();
    let mut shift = max.max(page_shift);
    for i in 1..dma.len() {
        if dma[i] != dma[i - 1].wrapping_add(PAGE_SIZE as u64) {
            shift = shift.min(i.trailing_zeros() + page_shift);
            if shift == page_shift {
                break;
            }
        }
    }
    shift
}

/// Allocates `size` bytes (a multiple of pages) as pieces of `1 << shift`
/// bytes, each from `alloc(len)`.
fn alloc_pieces<T>(
    size: usize,
    shift: u32,
    alloc: impl Fn(usize) -> Result<T>,
) -> Result<OwnedPieces<T>> {
    let piece = 1usize << shift;
    let count = size.div_ceil(piece);
    if count == 1 {
        return Ok(OwnedPieces::One(alloc(size)?));
    }
    let mut mem = KVec::with_capacity(count, GFP_KERNEL_ACCOUNT)?;
    for i in 0..count {
        let len = (size - i * piece).min(piece);
        mem.push(alloc(len)?, GFP_KERNEL_ACCOUNT)?;
    }
    Ok(OwnedPieces::Many(mem))
}

/// Allocates `size` bytes (a multiple of pages) in as few pieces as the
/// allocator can give: one piece if it can (up to [`MAX_PIECE`]), else
/// pieces of half the size, until pages do not come at all. Returns the
/// pieces, their addresses and the shift of their size.
fn alloc_split<T>(
    size: usize,
    alloc: impl Fn(usize) -> Result<T>,
    addr: impl Fn(&T) -> PieceAddr,
) -> Result<(OwnedPieces<T>, Pieces, u32)> {
    let mut shift = size.next_power_of_two().min(MAX_PIECE).trailing_zeros();
    let mem = loop {
        match alloc_pieces(size, shift, &alloc) {
            Ok(mem) => break mem,
            Err(e) if e == ENOMEM && (1usize << shift) > PAGE_SIZE => shift -= 1,
            Err(e) => return Err(e),
        }
    };
    let pieces = match &mem {
        OwnedPieces::One(m) => Pieces::One(addr(m)),
        OwnedPieces::Many(many) => {
            let mut pieces = KVVec::with_capacity(many.len(), GFP_KERNEL_ACCOUNT)?;
            for m in many.iter() {
                pieces.push(addr(m), GFP_KERNEL_ACCOUNT)?;
            }
            Pieces::Many(pieces)
        }
    };
    Ok((mem, pieces, shift))
}

impl Buffer {
    /// Allocates `size` zeroed bytes on `channel` of `device`, charging the
    /// channel first (page-rounded).
    pub(crate) fn new(
        device: &Arc<TdrvDevice>,
        bound: &Device<Bound>,
        size: usize,
        channel: u32,
    ) -> Result<Arc<Self>> {
        let rounded = size.next_multiple_of(PAGE_SIZE);
        let charged = rounded as u64;
        device.channels.reserve(channel, charged)?;
        if let Some(mem) = device.engine().alloc_memory(device, rounded, channel) {
            return Self::new_on_device(device, mem, size, channel);
        }
        // System pages for an engine without DMA (see the module doc).
        let allocated = if device.engine().does_dma() {
            let flags = GFP_KERNEL_ACCOUNT | __GFP_NOWARN;
            alloc_split(
                rounded,
                |len| Coherent::<u8>::zeroed_slice(bound, len, flags),
                |m| PieceAddr {
                    cpu: m.as_mut_ptr().cast(),
                    dma: m.dma_handle(),
                },
            )
            .map(|(mem, pieces, shift)| (Backing::Coherent { _pieces: mem }, pieces, shift))
        } else {
            alloc_split(
                rounded,
                Pages::alloc,
                |m| PieceAddr {
                    cpu: m.as_ptr().cast(),
                    dma: m.phys(),
                },
            )
            .map(|(mem, pieces, shift)| (Backing::System { _pieces: mem }, pieces, shift))
        };
        let (backing, pieces, shift) = match allocated {
            Ok(a) => a,
            Err(e) => {
                device.channels.release(channel, charged);
                device.channels.note_failure(channel);
                return Err(e);
            }
        };
        let layout = Layout {
            pieces,
            shift,
            size,
            span: rounded,
            charged,
            channel,
        };
        Self::from_backing(device, backing, layout)
    }

    /// Builds a buffer in device memory the engine allocated (`mem`, zeroed,
    /// `size` rounded up to pages, already charged to `channel`).
    fn new_on_device(
        device: &Arc<TdrvDevice>,
        mem: Result<KBox<dyn DeviceMemory>>,
        size: usize,
        channel: u32,
    ) -> Result<Arc<Self>> {
        let charged = size.next_multiple_of(PAGE_SIZE) as u64;
        let built = mem.map(|mem| {
            let pieces = Pieces::One(PieceAddr {
                cpu: core::ptr::null_mut(),
                dma: mem.dev_addr(),
            });
            (mem, pieces)
        });
        let (mem, pieces) = match built {
            Ok(ok) => ok,
            Err(e) => {
                device.channels.release(channel, charged);
                device.channels.note_failure(channel);
                return Err(e);
            }
        };
        let layout = Layout {
            pieces,
            // One piece covers the whole buffer.
            shift: (charged as usize).next_power_of_two().trailing_zeros(),
            size,
            span: charged as usize,
            charged,
            channel,
        };
        Self::from_backing(device, Backing::Device(mem), layout)
    }

    /// True if the buffer lives in device memory (see the module docs).
    pub(crate) fn on_device(&self) -> bool {
        self.on_device
    }

    /// Builds a buffer around `backing`, whose `charged` bytes are already
    /// charged to `channel`: on failure the charge is given back and the
    /// memory dropped.
    fn from_backing(device: &Arc<TdrvDevice>, backing: Backing, layout: Layout) -> Result<Arc<Self>> {
        let Layout {
            pieces,
            shift,
            size,
            span,
            charged,
            channel,
        } = layout;
        let on_device = matches!(backing, Backing::Device(_));
        let foreign = matches!(backing, Backing::Imported { .. });
        // Stored narrow (see the size assertion below the struct).
        let (Ok(narrow_shift), Ok(narrow_channel)) = (u8::try_from(shift), u16::try_from(channel))
        else {
            device.channels.release(channel, charged);
            return Err(EINVAL);
        };
        // `Buffer::charged` derives the charge from these two.
        if charged != if foreign { 0 } else { span as u64 } {
            device.channels.release(channel, charged);
            return Err(EINVAL);
        }
        let registry_key = match device.register_buffer() {
            Ok(key) => key,
            Err(e) => {
                device.channels.release(channel, charged);
                return Err(e);
            }
        };
        let resv = match &backing {
            // Held from here: a failure below drops it again.
            Backing::Imported { _import, .. } => _import.get_ref().into_raw(),
            _ => core::ptr::null_mut(),
        };
        let buf = Arc::pin_init(
            try_pin_init!(Self {
                mem <- new_mutex!(MemState::Live(backing), "Buffer::mem"),
                pieces,
                shift: narrow_shift,
                size,
                span,
                channel: narrow_channel,
                device: device.clone(),
                registry_key,
                on_device,
                foreign,
                fence <- Fence::new(),
                resv: Atomic::new(resv),
            }),
            GFP_KERNEL_ACCOUNT,
        );
        match buf {
            Ok(buf) => {
                device.publish_buffer(registry_key, &buf);
                Ok(buf)
            }
            Err(e) => {
                // The backing was dropped by the initializer, but
                // `PinnedDrop` never runs for an unbuilt value: undo the
                // rest by hand.
                if !resv.is_null() {
                    // SAFETY: The reference taken above, dropped once.
                    drop(unsafe { ImportRef::from_raw(resv) });
                }
                device.unregister_buffer(registry_key);
                device.channels.release(channel, charged);
                Err(e)
            }
        }
    }

    /// Wraps an imported foreign dma-buf, placed on `channel` but not
    /// charged to it. The caller holds an active guard of `device` (so
    /// that unbind finds the buffer registered and releases the import).
    pub(crate) fn import(
        device: &Arc<TdrvDevice>,
        _active: &ActiveGuard<'_>,
        import: Import,
        channel: u32,
        peer: Option<Arc<Buffer>>,
    ) -> Result<Arc<Self>> {
        let size = import.size();
        if size == 0 || size as u64 > MAX_BUFFER_SIZE {
            return Err(EINVAL);
        }
        let pages = size / PAGE_SIZE;
        let mut dma = KVVec::<u64>::new();
        dma.resize(pages, 0, GFP_KERNEL_ACCOUNT)?;
        import.dma_pages(&mut dma);
        // The exporter's memory comes in contiguous runs (its own pieces,
        // a BAR range), so the pieces are as large as the runs allow: an
        // engine then moves a run with one descriptor or one chunk
        // sequence, as on the device's own buffers, instead of one per
        // page.
        let shift = import_shift(&dma);
        let per_piece = 1usize << (shift - PAGE_SIZE.trailing_zeros());
        let count = pages.div_ceil(per_piece);
        let mut pieces = KVVec::with_capacity(count, GFP_KERNEL_ACCOUNT)?;
        // Null for a peer-to-peer import: its pieces have no CPU address
        // (which `Buffer::p2p_peer` tells by). The kernel mapping is one
        // contiguous range, so every piece's CPU address is base + offset.
        let base = import.vaddr();
        for i in 0..count {
            let offset = i << shift;
            pieces.push(
                PieceAddr {
                    cpu: if base.is_null() { base } else { base.wrapping_add(offset) },
                    dma: dma[i * per_piece],
                },
                GFP_KERNEL_ACCOUNT,
            )?;
        }
        drop(dma);
        device.channels.reserve(channel, 0)?;
        let layout = Layout {
            pieces: Pieces::from_vec(pieces),
            shift,
            size,
            span: size,
            charged: 0,
            channel,
        };
        Self::from_backing(device, Backing::Imported { _import: import, peer }, layout)
    }

    /// The reservation object jobs of this buffer use (see `resv.rs`), or
    /// null if the buffer takes no part in implicit synchronisation (tdrv
    /// memory never exported). Lives as long as the buffer.
    pub(crate) fn resv(&self) -> *mut c_void {
        match self.import_ref() {
            Some(imp) => imp.resv(),
            None => self.resv.load(Acquire),
        }
    }

    /// For a foreign import, its object (see [`ImportRef`]), borrowed.
    fn import_ref(&self) -> Option<core::mem::ManuallyDrop<ImportRef>> {
        if !self.foreign {
            return None;
        }
        let p = self.resv.load(Acquire);
        // SAFETY: A foreign buffer's `resv` holds its `ImportRef` from
        // construction until drop; the borrow is never dropped.
        Some(core::mem::ManuallyDrop::new(unsafe { ImportRef::from_raw(p) }))
    }

    /// Starts an access to the buffer's memory by a job of its device
    /// (see [`Buffer::end_access`]): ENODEV once a foreign import was
    /// revoked by its exporter. Other memory is reachable while the
    /// device is bound.
    pub(crate) fn begin_access(&self) -> Result {
        match self.import_ref() {
            Some(imp) => imp.begin_access(),
            None => Ok(()),
        }
    }

    /// True once the exporter of a foreign import revoked it.
    pub(crate) fn revoked(&self) -> bool {
        self.import_ref().is_some_and(|imp| imp.revoked())
    }

    /// Ends an access from [`Buffer::begin_access`]; no lock, no memory.
    pub(crate) fn end_access(&self) {
        if let Some(imp) = self.import_ref() {
            imp.end_access();
        }
    }

    /// Enters a section that touches the buffer's memory from an ioctl
    /// or a fault: an active guard of the device, and for a foreign
    /// import an access, so that its revocation waits for the section
    /// (ENODEV after unbind or revocation).
    pub(crate) fn enter(&self) -> Result<MemGuard<'_>> {
        let active = self.device.enter()?;
        self.begin_access()?;
        Ok(MemGuard { active, buf: self })
    }

    /// For an import of another tdrv device's device memory (peer-to-peer,
    /// no CPU address): that device's buffer, which moves the bytes for
    /// the CPU paths; ENODEV once this device's unbind released it.
    fn p2p_peer(&self) -> Option<Result<Arc<Buffer>>> {
        if !self.is_p2p() {
            return None;
        }
        Some(match &*self.mem.lock() {
            MemState::Live(Backing::Imported { peer: Some(p), .. }) => Ok(p.clone()),
            _ => Err(ENODEV),
        })
    }

    /// True for an import of another device's memory peer-to-peer (see
    /// [`Buffer::p2p_peer`]): user mappings of it are write-combined.
    pub(crate) fn is_p2p(&self) -> bool {
        self.foreign && self.pieces.first().is_some_and(|p| p.cpu.is_null())
    }

    /// The reservation object for an export of the buffer: made at the
    /// first export of tdrv memory (ENOMEM), the imported dma-buf's for a
    /// foreign import.
    pub(crate) fn export_resv(&self) -> Result<*mut c_void> {
        let cur = self.resv();
        if !cur.is_null() || self.foreign {
            return Ok(cur);
        }
        let new = resv::new_own()?;
        match self.resv.cmpxchg(core::ptr::null_mut(), new, Full) {
            Ok(_) => Ok(new),
            Err(won) => {
                // Another export made one first.
                // SAFETY: `new` was never published.
                unsafe { resv::free_own(new) };
                Ok(won)
            }
        }
    }

    /// The device the buffer belongs to.
    pub(crate) fn device(&self) -> &Arc<TdrvDevice> {
        &self.device
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn channel(&self) -> u32 {
        u32::from(self.channel)
    }

    /// The buffer's identity on its device (`tdrv_buf_info.buf_id`).
    pub(crate) fn id(&self) -> u64 {
        self.registry_key
    }

    /// Bus address of byte 0.
    pub(crate) fn dma_addr(&self) -> u64 {
        self.pieces.first().map_or(0, |p| p.dma)
    }

    /// True for a buffer imported from a foreign dma-buf.
    pub(crate) fn is_foreign(&self) -> bool {
        self.foreign
    }

    /// Drops a reference from process context, with no lock held (FREE,
    /// a file's close). When it is the last one and the buffer is an
    /// import, the import is released here rather than by the release
    /// queue ([`Backing::release`]): the dma-buf is unmapped and put
    /// before FREE or close returns, so its exporter has its memory back
    /// by then (a tdrv exporter's usage, fdinfo and debugfs show it). Sleeps.
    pub(crate) fn drop_unlocked(this: Arc<Self>) {
        if !this.foreign {
            return;
        }
        let Some(me) = Arc::into_unique_or_drop(this) else {
            // Not the last: a job, a mapping or a lookup still holds it.
            return;
        };
        // Under an active guard: the import is mapped for the device, which
        // unbind cannot take away until the guard goes. Without one, unbind
        // is under way and releases the import itself.
        let Ok(_active) = me.device.enter() else {
            return;
        };
        let old = core::mem::replace(&mut *me.mem.lock(), MemState::Gone);
        if let MemState::Live(backing) | MemState::Detached(backing) = old {
            // Dropped, not `release`d: this is not a signalling path.
            drop(backing);
        }
    }

    /// What the buffer's channel is charged for it.
    pub(crate) fn charged(&self) -> u64 {
        if self.foreign {
            0
        } else {
            self.span as u64
        }
    }

    /// The piece holding `offset` and the bytes left in it from there.
    fn locate(&self, offset: usize) -> (PieceAddr, usize) {
        let i = offset >> self.shift;
        let within = offset & ((1 << self.shift) - 1);
        let piece = self.pieces.get(i);
        let piece_len = (self.span - (i << self.shift)).min(1 << self.shift);
        let cpu = piece.cpu.wrapping_add(within);
        let dma = piece.dma + within as u64;
        (PieceAddr { cpu, dma }, piece_len - within)
    }

    /// Bus address of `offset` and how many bytes are contiguous from it
    /// (within the buffer's size).
    pub(crate) fn dma_span(&self, offset: usize) -> (u64, usize) {
        let (p, left) = self.locate(offset);
        (p.dma, left.min(self.size - offset))
    }

    /// The contiguous CPU span at `offset`, at most `max` bytes.
    fn cpu_span(&self, offset: usize, max: usize) -> (*mut u8, usize) {
        let (p, left) = self.locate(offset);
        (p.cpu, left.min(max))
    }

    /// Fills `out` with the page frames of the buffer's pages from page
    /// `first` (fewer at its end or before a piece without page frames)
    /// and returns how many it wrote, at least one; `None` if the memory is
    /// not live or page `first` has no frame. Read under the memory lock,
    /// which is released before returning: the caller inserts the frames
    /// into page tables (which allocates) with no tdrv lock held, while an
    /// active guard of the device keeps the memory from being freed (see
    /// `mmap.rs`).
    pub(crate) fn page_pfns(&self, first: usize, out: &mut [usize]) -> Option<usize> {
        if let Some(peer) = self.p2p_peer() {
            // Peer-to-peer: the exporter's BAR pages (None once its unbind
            // detached them; revoking the import zaps ours first). Asked
            // without our lock held: both are `Buffer::mem` locks.
            return peer.ok()?.page_pfns(first, out);
        }
        let mem = self.mem.lock();
        let pages = self.span / PAGE_SIZE;
        let MemState::Live(backing) = &*mem else {
            return None;
        };
        let mut n = 0;
        for (index, slot) in (first..pages).zip(out.iter_mut()) {
            let (p, _) = self.locate(index * PAGE_SIZE);
            // SAFETY: The memory is live (checked under the lock that
            // `detach` and `release_memory` take, held until we return)
            // and `p.cpu` lies inside it, page-aligned.
            let Some(pfn) = (unsafe { backing.pfn(p) }) else {
                break;
            };
            *slot = pfn;
            n += 1;
        }
        (n > 0).then_some(n)
    }

    /// Device memory's range for peer-to-peer importers; `None` once
    /// unbind detached it (or for host memory).
    pub(crate) fn p2p_range(&self) -> Option<P2pRange> {
        match &*self.mem.lock() {
            MemState::Live(Backing::Device(mem)) => Some(mem.p2p()),
            _ => None,
        }
    }

    /// True while the buffer still holds its memory (live or detached), for
    /// KUnit tests of unbind.
    #[cfg(CONFIG_KUNIT)]
    pub(crate) fn holds_memory(&self) -> bool {
        !matches!(*self.mem.lock(), MemState::Gone)
    }

    /// First step of unbind's memory release: [`Buffer::page_pfns`] finds
    /// no more page frames of the buffer. Pages mapped before are zapped by
    /// the caller next.
    pub(crate) fn detach(&self) {
        let mut mem = self.mem.lock();
        if let MemState::Live(m) = core::mem::replace(&mut *mem, MemState::Gone) {
            *mem = MemState::Detached(m);
        }
    }

    /// Frees the DMA memory now, although references to the buffer remain.
    ///
    /// # Safety
    ///
    /// The buffer was detached, the device is unbound, its engine has
    /// stopped, no active guard exists or can be taken, and every user
    /// mapping's pages were zapped after the detach: nothing can touch the
    /// memory afterwards.
    pub(crate) unsafe fn release_memory(&self) {
        let old = core::mem::replace(&mut *self.mem.lock(), MemState::Gone);
        if let MemState::Live(pieces) | MemState::Detached(pieces) = old {
            // Freed outside the memory lock; an import by the release queue
            // (unbind holds the registry's sweep lock here, which a job's
            // completion takes), which unbind flushes before it returns.
            pieces.release();
        }
    }

    /// Runs `f` on consecutive CPU spans of `range`, each at most `CHUNK`
    /// bytes and within one piece, each under its own active guard.
    /// ENODEV once the device is unbound.
    fn for_each_span(
        &self,
        range: ByteRange,
        mut f: impl FnMut(&ActiveGuard<'_>, *mut u8, usize, usize) -> Result,
    ) -> Result {
        let mut done = 0;
        while done < range.len {
            let (cpu, n) = self.cpu_span(range.start + done, (range.len - done).min(CHUNK));
            {
                let guard = self.enter()?;
                f(&guard.active, cpu, done, n)?;
            }
            done += n;
            if done < range.len {
                glue::cond_resched();
            }
        }
        Ok(())
    }

    /// Copies `range.len` bytes from user memory at `src` into the buffer.
    /// EFAULT if any byte cannot be read (the buffer may be partly written).
    pub(crate) fn copy_from_user(self: &Arc<Self>, range: ByteRange, src: UserPtr) -> Result {
        if self.on_device {
            return self.device.engine().dma_from_user(&self.device, self, range, src);
        }
        if let Some(peer) = self.p2p_peer() {
            // Held across the peer's copy: revoking the import waits for it.
            let _access = self.enter()?;
            return peer?.copy_from_user(range, src);
        }
        let mut bounce = KVec::<u8>::new();
        let mut done = 0;
        while done < range.len {
            let (_, n) = self.cpu_span(range.start + done, (range.len - done).min(CHUNK));
            let user = src.wrapping_byte_add(done);
            // Fast path: copy straight in under a guard, without page
            // faults (resident user pages, the common case).
            let fast = {
                let _guard = self.enter()?;
                let (cpu, _) = self.cpu_span(range.start + done, n);
                // SAFETY: The guard keeps the memory live (type invariant)
                // and the span lies inside it; `copy_from_user_nofault`
                // checks the user range and never sleeps.
                unsafe { bindings::copy_from_user_nofault(cpu.cast(), user.as_const_ptr(), n) == 0 }
            };
            if !fast {
                // Slow path: fault the user pages in with no guard held,
                // through a bounce buffer, a page at a time.
                if bounce.is_empty() {
                    bounce.resize(PAGE_SIZE, 0, GFP_KERNEL)?;
                }
                let mut off = 0;
                while off < n {
                    let m = (n - off).min(PAGE_SIZE);
                    // SAFETY: `bounce` has `PAGE_SIZE >= m` bytes;
                    // `copy_from_user` checks the user range itself.
                    let left = unsafe {
                        bindings::copy_from_user(
                            bounce.as_mut_ptr().cast(),
                            user.wrapping_byte_add(off).as_const_ptr(),
                            m,
                        )
                    };
                    if left != 0 {
                        return Err(EFAULT);
                    }
                    let _guard = self.enter()?;
                    let (cpu, _) = self.cpu_span(range.start + done + off, m);
                    // SAFETY: As in the fast path; `bounce` is ours.
                    unsafe { core::ptr::copy_nonoverlapping(bounce.as_ptr(), cpu, m) };
                    off += m;
                }
            }
            done += n;
            glue::cond_resched();
        }
        Ok(())
    }

    /// Copies `range` of the buffer to user memory at `dst`.
    pub(crate) fn copy_to_user(self: &Arc<Self>, range: ByteRange, dst: UserPtr) -> Result {
        if self.on_device {
            return self.device.engine().dma_to_user(&self.device, self, range, dst);
        }
        if let Some(peer) = self.p2p_peer() {
            let _access = self.enter()?;
            return peer?.copy_to_user(range, dst);
        }
        let mut bounce = KVec::<u8>::new();
        let mut done = 0;
        while done < range.len {
            let (_, n) = self.cpu_span(range.start + done, (range.len - done).min(CHUNK));
            let user = dst.wrapping_byte_add(done);
            let fast = {
                let _guard = self.enter()?;
                let (cpu, _) = self.cpu_span(range.start + done, n);
                // SAFETY: As in `copy_from_user`, with the directions
                // swapped.
                unsafe { bindings::copy_to_user_nofault(user.as_mut_ptr(), cpu.cast(), n) == 0 }
            };
            if !fast {
                if bounce.is_empty() {
                    bounce.resize(PAGE_SIZE, 0, GFP_KERNEL)?;
                }
                let mut off = 0;
                while off < n {
                    let m = (n - off).min(PAGE_SIZE);
                    {
                        let _guard = self.enter()?;
                        let (cpu, _) = self.cpu_span(range.start + done + off, m);
                        // SAFETY: The guard keeps the memory live and the
                        // span lies inside it; `bounce` holds `m` bytes.
                        unsafe { core::ptr::copy_nonoverlapping(cpu, bounce.as_mut_ptr(), m) };
                    }
                    // SAFETY: `bounce` has `m` initialised bytes;
                    // `copy_to_user` checks the user range itself.
                    let left = unsafe {
                        bindings::copy_to_user(
                            user.wrapping_byte_add(off).as_mut_ptr(),
                            bounce.as_ptr().cast(),
                            m,
                        )
                    };
                    if left != 0 {
                        return Err(EFAULT);
                    }
                    off += m;
                }
            }
            done += n;
            glue::cond_resched();
        }
        Ok(())
    }

    /// Fills `range` with `value`. ENODEV if the device went away.
    pub(crate) fn fill(self: &Arc<Self>, range: ByteRange, value: u8) -> Result {
        if self.on_device {
            return self.device.engine().dma_fill(&self.device, self, range, value);
        }
        if let Some(peer) = self.p2p_peer() {
            let _access = self.enter()?;
            return peer?.fill(range, value);
        }
        self.for_each_span(range, |_guard, cpu, _, n| {
            // SAFETY: `for_each_span` holds a guard (memory live) and gives
            // a span inside the allocation.
            unsafe { core::ptr::write_bytes(cpu, value, n) };
            Ok(())
        })
    }

    /// Copies `src_range` of `src` to `dst_offset` of `self` from an ioctl,
    /// under active guards. The ranges do not overlap (checked by SUBMIT
    /// and COPY).
    pub(crate) fn copy_from_ioctl(
        self: &Arc<Self>,
        dst_offset: usize,
        src: &Arc<Buffer>,
        src_range: ByteRange,
    ) -> Result {
        if self.is_p2p() || src.is_p2p() {
            // Another device's memory, reached only by this device's
            // jobs (see TDRV_IOC_COPY in tdrv.h).
            return Err(crate::uapi::eopnotsupp());
        }
        if self.on_device || src.on_device {
            // Device memory is moved by the device.
            return self
                .device
                .engine()
                .dma_copy(&self.device, self, dst_offset, src, src_range);
        }
        let mut done = 0;
        while done < src_range.len {
            let n = (src_range.len - done).min(CHUNK);
            {
                let _guard = self.enter()?;
                let _src = src.enter()?;
                // SAFETY: The guards keep both buffers' memory live: both
                // belong to this device (same file, same channel), and a
                // foreign import is not unmapped while they last.
                unsafe { self.copy_span(dst_offset + done, src, src_range.start + done, n) };
            }
            done += n;
            glue::cond_resched();
        }
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_offset` to `self` at
    /// `dst_offset`, across pieces.
    ///
    /// # Safety
    ///
    /// Both buffers' memory is live for the call (an active guard of their
    /// device is held, or a running engine's job references them), and
    /// both ranges are inside the buffers.
    pub(crate) unsafe fn copy_span(&self, dst_offset: usize, src: &Buffer, src_offset: usize, len: usize) {
        let mut done = 0;
        while done < len {
            let (s, sn) = src.cpu_span(src_offset + done, len - done);
            let (d, dn) = self.cpu_span(dst_offset + done, len - done);
            let n = sn.min(dn);
            // SAFETY: Both spans lie inside live allocations (the caller's
            // guarantee); `copy_bytes` permits overlap.
            unsafe { copy_bytes(s, d, n) };
            done += n;
        }
    }
}

/// `core::ptr::copy` (overlap permitted), with copies of at most 64 bytes
/// that do not overlap done in register moves.
///
/// A one-descriptor job usually moves a few bytes to a few hundred, and
/// `memmove` of 32 bytes or more is a `rep movsb` on CPUs with fast short
/// moves, whose start-up costs about as much as the moves themselves at
/// this size (and, under QEMU's TCG, one instruction per byte).
///
/// # Safety
///
/// `s` is valid for reads and `d` for writes of `n` bytes.
#[inline]
unsafe fn copy_bytes(s: *const u8, d: *mut u8, n: usize) {
    /// Copies `K` bytes, unaligned.
    ///
    /// # Safety
    ///
    /// As for `copy_bytes`, with `K` bytes.
    #[inline(always)]
    unsafe fn mv<const K: usize>(s: *const u8, d: *mut u8) {
        // SAFETY: The caller's guarantee; `[u8; K]` has alignment 1.
        unsafe { d.cast::<[u8; K]>().write(s.cast::<[u8; K]>().read()) }
    }
    let apart = (s as usize).abs_diff(d as usize) >= n;
    // The head and tail moves may cover some bytes twice, which is right
    // only if the spans do not overlap (`apart`): otherwise the tail
    // could read bytes the head wrote.
    // SAFETY: Every move lies within the first `n` bytes at `s` and `d`,
    // which are valid (the caller's guarantee); each reads into a
    // temporary before it writes.
    unsafe {
        match n {
            32..=64 if apart => {
                mv::<32>(s, d);
                mv::<32>(s.add(n - 32), d.add(n - 32));
            }
            16..=31 if apart => {
                mv::<16>(s, d);
                mv::<16>(s.add(n - 16), d.add(n - 16));
            }
            8..=15 if apart => {
                mv::<8>(s, d);
                mv::<8>(s.add(n - 8), d.add(n - 8));
            }
            _ => core::ptr::copy(s, d, n),
        }
    }
}

#[pinned_drop]
impl PinnedDrop for Buffer {
    fn drop(self: Pin<&mut Self>) {
        // The memory goes under the registry lock, so that it is never
        // freed after an unbind that no longer sees this buffer returned.
        self.device.unregister_buffer_with(self.registry_key, || {
            let old = core::mem::replace(&mut *self.mem.lock(), MemState::Gone);
            if let MemState::Live(backing) | MemState::Detached(backing) = old {
                backing.release();
            }
        });
        self.device.channels.release(self.channel(), self.charged());
        // Last: every dma-buf exported from the buffer, and every job
        // that used it, held a reference, so nothing uses the object now.
        // (This may run on a job's completion path: neither puts a lock
        // or memory the signalling rules forbid, see `resv.rs`.)
        let resv = self.resv.load(Acquire);
        if !resv.is_null() {
            if self.foreign {
                // SAFETY: Our import reference, dropped once.
                drop(unsafe { ImportRef::from_raw(resv) });
            } else {
                // SAFETY: Made by `export_resv`, freed once, unused now.
                unsafe { resv::free_own(resv) };
            }
        }
    }
}

#[kunit_tests(tdrv_import_pieces)]
mod import_tests {
    use super::{import_shift, MAX_PIECE};
    use kernel::page::PAGE_SIZE;

    const P: u64 = PAGE_SIZE as u64;
    const PAGE: u32 = PAGE_SIZE.trailing_zeros();

    /// Bus addresses of `n` pages in runs of `run` pages, the runs apart.
    fn runs(n: usize, run: usize) -> [u64; 64] {
        let mut a = [0u64; 64];
        for (i, d) in a.iter_mut().enumerate().take(n) {
            *d = 0x1000_0000 + (i / run) as u64 * 0x10_0000 + (i % run) as u64 * P;
        }
        a
    }

    #[test]
    fn a_contiguous_import_is_one_piece_up_to_max_piece() {
        let a = runs(64, 64);
        assert_eq!(import_shift(&a[..1]), PAGE);
        assert_eq!(import_shift(&a[..3]), PAGE + 2);
        assert_eq!(import_shift(&a[..64]), (64 * PAGE_SIZE).min(MAX_PIECE).trailing_zeros());
    }

    #[test]
    fn pieces_never_span_a_discontinuity() {
        // Runs of 16 pages: pieces of 16 pages.
        assert_eq!(import_shift(&runs(64, 16)[..64]), PAGE + 4);
        // Runs of 12 pages (breaks at 12, 24, 36...): 4 pages.
        assert_eq!(import_shift(&runs(64, 12)[..64]), PAGE + 2);
        // Every page apart: one page each.
        assert_eq!(import_shift(&runs(64, 1)[..64]), PAGE);
        // A run that goes backwards is a discontinuity too.
        let mut a = runs(8, 8);
        a[5] = a[4] - P;
        assert_eq!(import_shift(&a[..8]), PAGE);
    }
}

#[kunit_tests(tdrv_copy)]
mod tests {
    use super::copy_bytes;

    /// A pattern no shifted copy of itself matches.
    fn pattern(a: &mut [u8]) {
        for (i, b) in a.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(11);
        }
    }

    #[test]
    fn apart_spans_at_every_size_and_alignment() {
        let mut src = [0u8; 96];
        pattern(&mut src);
        for n in 0..=80 {
            for off in 0..8 {
                let mut dst = [0xa5u8; 96];
                // SAFETY: `off + n <= 88` bytes of both arrays.
                unsafe { copy_bytes(src.as_ptr().add(off), dst.as_mut_ptr().add(off), n) };
                assert_eq!(dst[off..off + n], src[off..off + n]);
                assert!(dst[..off].iter().all(|b| *b == 0xa5));
                assert!(dst[off + n..].iter().all(|b| *b == 0xa5));
            }
        }
    }

    #[test]
    fn overlapping_spans_move_like_memmove() {
        for n in 0..=80 {
            for shift in 1..=n.min(40) {
                for forward in [false, true] {
                    let mut a = [0u8; 128];
                    pattern(&mut a);
                    let before = a;
                    let (s, d) = if forward { (0, shift) } else { (shift, 0) };
                    let p = a.as_mut_ptr();
                    // SAFETY: `shift + n <= 120` bytes of `a`.
                    unsafe { copy_bytes(p.add(s), p.add(d), n) };
                    assert_eq!(a[d..d + n], before[s..s + n]);
                }
            }
        }
    }
}
