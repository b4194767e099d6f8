//! Backing storage of tensors: the bytes and their lifetime.
//!
//! A storage is shared by every view (slice) over it through an `Arc`; the
//! `Arc`'s strong count is the seed's storage refcount, and the backing is
//! released when the last view goes. Unlike the seed, whose storage struct
//! was leaked for user-attached buffers (`mem_owned_by_tensor == 0`), the
//! storage object itself is always freed; only the user's bytes are left
//! alone.

use std::alloc::Layout;
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::ptr::NonNull;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use crate::error::{Error, Result};
use crate::fence::HostSync;
use crate::log::{heartbeat_interval, log_warn};
use crate::sys::{Device, FenceKind, Mapping, SysError};
use crate::wait::Deadline;

/// Alignment of host (`Malloc`) allocations: a cache line.
pub const HOST_ALIGN: usize = 64;

/// The kind of memory behind a tensor (the seed's `nrt_tensor_mem_type_t`,
/// plus the user-attached case the seed flagged with `mem_owned_by_tensor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageKind {
    /// Host memory allocated and owned by the storage.
    Malloc,
    /// A tdrv device buffer (and its mapping), freed with `TDRV_IOC_FREE`.
    Dma,
    /// Size only: no bytes exist. Reads (and copies from it) give zeros;
    /// writes, memsets and copies into it discard their bytes.
    Fake,
    /// A caller's buffer; never freed by the library.
    User,
}

pub(crate) struct HostAlloc {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        if self.layout.size() != 0 {
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` with this very
            // layout and is freed only here.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
        }
    }
}

/// A tdrv buffer owned by a storage.
pub(crate) struct DmaBuffer {
    pub device: Arc<Device>,
    pub handle: u64,
    pub channel: u32,
    pub dma_addr: u64,
    /// The buffer's mmap offset, when the driver supports mmap (the
    /// driver never hands out offset 0).
    pub mmap_offset: Option<NonZeroU64>,
    /// The host mapping, made at the first host access (see DESIGN.md,
    /// "Mapping on first host access").
    pub mapping: OnceLock<Mapping>,
    /// The buffer's `buf_id`, once the storage is in the process's
    /// registry of shareable buffers ([`Storage::share`]).
    registered: OnceLock<u64>,
}

/// The process's storages whose buffer may come back through a dma-buf
/// import, by (device number, `buf_id`): an import of one of them resolves
/// to that storage, so one buffer has one host exclusion (`HostSync`) in
/// the process. An entry's storage keeps its buffer alive, so its
/// `buf_id` cannot name another buffer meanwhile.
type Registry = HashMap<(u64, u64), Weak<Storage>>;

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY
        .get_or_init(Default::default)
        .lock()
        // Nothing panics while holding it; a poisoned map is still whole.
        .unwrap_or_else(|e| e.into_inner())
}

/// Whether the driver reports `tdrv_buf_info.buf_id`.
fn has_buf_id(device: &Device) -> bool {
    device.has_features(tdrv_uapi::TDRV_FEAT_BUF_ID.into())
}

impl DmaBuffer {
    /// A buffer record for `handle`, not mapped yet.
    pub(crate) fn new(
        device: Arc<Device>,
        handle: u64,
        channel: u32,
        dma_addr: u64,
        mmap_offset: Option<NonZeroU64>,
    ) -> Self {
        Self {
            device,
            handle,
            channel,
            dma_addr,
            mmap_offset,
            mapping: OnceLock::new(),
            registered: OnceLock::new(),
        }
    }

    /// The host mapping of the buffer's `size` bytes, made now if this is
    /// the first host access. `None`
    /// if the driver has no mmap or mapping fails (for example at the
    /// process's `vm.max_map_count`): callers then move the bytes with
    /// COPY_IN/COPY_OUT, and a later access tries to map again.
    pub(crate) fn mapping(&self, size: usize) -> Option<&Mapping> {
        if let Some(m) = self.mapping.get() {
            return Some(m);
        }
        let offset = self.mmap_offset?.get();
        match self.device.map(offset, size as u64) {
            // Two threads may map at once: one mapping is kept, the other
            // (returned by `set`) is unmapped at once.
            Ok(m) => drop(self.mapping.set(m)),
            Err(e) => {
                log_warn!("mapping tdrv buffer {}: {e}; using copies", self.handle);
                return None;
            }
        }
        self.mapping.get()
    }

    /// Waits (without limit, through signals) for the kernel fence `kind`,
    /// logging a heartbeat every [`crate::set_heartbeat_interval`].
    pub(crate) fn fence(&self, kind: FenceKind) -> Result<()> {
        self.fence_until(kind, Deadline::Never).map(drop)
    }

    /// Waits for the kernel fence `kind` until `deadline`: `Ok(false)` if
    /// it passed first. A wait without limit logs a heartbeat every
    /// heartbeat interval, so a device that never finishes is visible.
    pub(crate) fn fence_until(&self, kind: FenceKind, deadline: Deadline) -> Result<bool> {
        let cap = matches!(deadline, Deadline::Never).then(heartbeat_interval);
        loop {
            match self
                .device
                .fence_wait_sys(self.handle, kind, deadline.remaining_us(cap))
            {
                Ok(()) => return Ok(true),
                Err(SysError::TimedOut { .. }) if matches!(deadline, Deadline::Never) => {
                    log_warn!(
                        "still waiting for device {} of tdrv buffer {}",
                        match kind {
                            FenceKind::Reads => "reads",
                            FenceKind::Writes => "writes",
                            FenceKind::All => "accesses",
                        },
                        self.handle
                    );
                }
                Err(SysError::TimedOut { .. } | SysError::Interrupted { .. })
                    if deadline.expired() =>
                {
                    return Ok(false)
                }
                Err(SysError::TimedOut { .. } | SysError::Interrupted { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

impl Drop for DmaBuffer {
    fn drop(&mut self) {
        // Unmap first, then drop the handle; the kernel frees the memory
        // once no mapping and no in-flight job use it.
        drop(self.mapping.take());
        if let Some(&id) = self.registered.get() {
            let key = (self.device.rdev(), id);
            let mut reg = registry();
            // Only this storage's entry (now dead), not a newer one.
            if reg.get(&key).is_some_and(|w| w.strong_count() == 0) {
                reg.remove(&key);
            }
        }
        if let Err(e) = self.device.free(self.handle) {
            log_warn!("freeing tdrv buffer {}: {e}", self.handle);
        }
    }
}

pub(crate) enum Memory {
    Malloc(HostAlloc),
    Dma(DmaBuffer),
    Fake,
    User(NonNull<u8>),
}

/// See the module documentation.
pub(crate) struct Storage {
    pub size: usize,
    pub mem: Memory,
    pub sync: HostSync,
    /// `Dma`: set before anything can make the kernel's completion count
    /// of the buffer non-zero (a job writing it, handing out the raw handle
    /// or a dma-buf, importing one). While clear, a new view's completion
    /// baseline is 0 without asking the kernel, so slicing stays
    /// syscall-free. Never set for host storage, whose counts are the
    /// views' own. A field of the storage rather than of the `Dma` variant
    /// so that `Tensor::slice` tests it with one load.
    pub counted: AtomicBool,
}

// SAFETY: the raw pointers in `Memory` are addresses of memory the storage
// owns (Malloc, Dma mapping) or that the caller of the unsafe user
// constructor promised stays valid. Every host access to the bytes holds
// a span of `sync` that excludes the conflicting ones (see fence.rs): a
// raw-pointer copy or an atomic byte access for the span of one call, or
// a reference lent for a long-lived span, by a mapping guard (map.rs)
// or a staging buffer (memcpy.rs, whose storage is private to it), which
// also pin a `Dma` buffer against device writes for as long as the
// reference lives. So sharing the storage across threads cannot race.
unsafe impl Send for Storage {}
// SAFETY: as above.
unsafe impl Sync for Storage {}

impl Storage {
    fn new(size: usize, mem: Memory) -> Arc<Storage> {
        Self::with_count(size, mem, false)
    }

    fn with_count(size: usize, mem: Memory, counted: bool) -> Arc<Storage> {
        Arc::new(Storage {
            size,
            mem,
            sync: HostSync::default(),
            counted: AtomicBool::new(counted),
        })
    }

    #[cfg(test)]
    pub(crate) fn __new_for_tests(size: usize, mem: Memory, counted: bool) -> Arc<Storage> {
        Self::with_count(size, mem, counted)
    }

    /// Zeroed, aligned host memory.
    pub(crate) fn new_malloc(size: usize) -> Result<Arc<Storage>> {
        let layout =
            Layout::from_size_align(size, HOST_ALIGN).map_err(|_| Error::OutOfMemory(size))?;
        let ptr = if size == 0 {
            // A dangling, aligned, non-null pointer: never dereferenced for
            // more than 0 bytes and never freed.
            NonNull::dangling()
        } else {
            // SAFETY: the layout has a non-zero size.
            NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
                .ok_or(Error::OutOfMemory(size))?
        };
        Ok(Self::new(size, Memory::Malloc(HostAlloc { ptr, layout })))
    }

    pub(crate) fn new_fake(size: usize) -> Arc<Storage> {
        Self::new(size, Memory::Fake)
    }

    /// # Safety
    /// `ptr` must be valid for reads and writes of `size` bytes for as long
    /// as the storage lives, and not accessed otherwise while the library
    /// copies to or from it. A null `ptr` is allowed only with `size == 0`.
    pub(crate) unsafe fn new_user(ptr: *mut u8, size: usize) -> Result<Arc<Storage>> {
        let ptr = match NonNull::new(ptr) {
            Some(p) => p,
            None if size == 0 => NonNull::dangling(),
            None => return Err(Error::invalid("null buffer with a non-zero size")),
        };
        Ok(Self::new(size, Memory::User(ptr)))
    }

    /// A device buffer on `channel`, mapped at the first host access.
    pub(crate) fn new_dma(device: &Arc<Device>, channel: u32, size: usize) -> Result<Arc<Storage>> {
        if channel >= device.num_channels() {
            return Err(Error::invalid(format!(
                "HBM channel {channel} does not exist ({} has {})",
                device.path().display(),
                device.num_channels()
            )));
        }
        let a = device
            .alloc_sys(size as u64, channel)
            .map_err(|source| match source {
                // Out of room: say where and how much (other errors are
                // argument errors, reported as the driver's).
                SysError::NoMemory { .. } | SysError::NoSpace { .. } => Error::DeviceAlloc {
                    device: device.path().to_owned(),
                    channel,
                    size,
                    source,
                },
                e => e.into(),
            })?;
        let map = NonZeroU64::new(a.mmap_offset)
            .filter(|_| device.has_features(tdrv_uapi::TDRV_FEAT_MMAP.into()));
        let buf = DmaBuffer::new(device.clone(), a.handle, channel, a.dma_addr, map);
        Ok(Self::new(size, Memory::Dma(buf)))
    }

    /// A device buffer for the dma-buf `fd` (`TDRV_IOC_IMPORT`), mapped
    /// at the first host access. Its completion count may already be
    /// non-zero (another owner's jobs), so it is always asked for.
    pub(crate) fn from_dmabuf(
        device: &Arc<Device>,
        channel: u32,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<Arc<Storage>> {
        if !device.has_features(tdrv_uapi::TDRV_FEAT_DMABUF.into()) {
            return Err(Error::invalid(format!(
                "{} does not support dma-buf import (ABI 1.2)",
                device.path().display()
            )));
        }
        // Without buffer identities an import of a buffer this process
        // holds would get a second storage, whose host exclusion does not
        // see the first one's guards (DESIGN.md, "One buffer, one storage").
        if !has_buf_id(device) {
            return Err(Error::invalid(format!(
                "{} does not report buffer identities (ABI 1.3, TDRV_FEAT_BUF_ID), \
                 which dma-buf import needs",
                device.path().display()
            )));
        }
        let i = device.import(fd, channel)?;
        let size = usize::try_from(i.size).map_err(|_| Error::OutOfMemory(usize::MAX))?;
        let map = NonZeroU64::new(i.mmap_offset)
            .filter(|_| device.has_features(tdrv_uapi::TDRV_FEAT_MMAP.into()));
        let mut buf = DmaBuffer::new(device.clone(), i.handle, i.channel, 0, map);
        // On failure `buf` is dropped, which frees the handle.
        let info = device.buf_info(i.handle)?;
        buf.dma_addr = info.dma_addr;
        let key = (device.rdev(), info.buf_id);
        // Lookup and insertion under one lock: two threads importing one
        // buffer get one storage.
        let mut reg = registry();
        if let Some(same) = reg.get(&key).and_then(Weak::upgrade) {
            drop(reg);
            // The buffer is already a storage here: the new handle goes
            // (dropping `buf` frees it; it is not in the registry).
            drop(buf);
            return Ok(same);
        }
        let _ = buf.registered.set(info.buf_id);
        reg.try_reserve(1).map_err(|_| Error::OutOfMemory(64))?;
        let st = Self::with_count(size, Memory::Dma(buf), true);
        reg.insert(key, Arc::downgrade(&st));
        Ok(st)
    }

    /// Puts a `Dma` storage in the process's registry of shareable buffers
    /// (before its buffer can leave as a dma-buf: `export_dmabuf`, or the
    /// raw handle), so that an import of it in this process resolves to
    /// this storage. Once per storage; a no-op for host storage and on a
    /// driver without buffer identities (whose imports are refused).
    pub(crate) fn share(self: &Arc<Storage>) -> Result<()> {
        let Some(b) = self.dma() else { return Ok(()) };
        if b.registered.get().is_some() || !has_buf_id(&b.device) {
            return Ok(());
        }
        let id = b.device.buf_info(b.handle)?.buf_id;
        let mut reg = registry();
        if b.registered.get().is_some() {
            return Ok(());
        }
        reg.try_reserve(1).map_err(|_| Error::OutOfMemory(64))?;
        reg.insert((b.device.rdev(), id), Arc::downgrade(self));
        let _ = b.registered.set(id);
        Ok(())
    }

    pub(crate) fn kind(&self) -> StorageKind {
        match self.mem {
            Memory::Malloc(_) => StorageKind::Malloc,
            Memory::Dma(_) => StorageKind::Dma,
            Memory::Fake => StorageKind::Fake,
            Memory::User(_) => StorageKind::User,
        }
    }

    /// The host address of byte 0, when the bytes are host-addressable.
    pub(crate) fn host_base(&self) -> Option<NonNull<u8>> {
        match &self.mem {
            Memory::Malloc(h) => Some(h.ptr),
            Memory::User(p) => Some(*p),
            Memory::Dma(b) => b.mapping(self.size).and_then(|m| NonNull::new(m.as_ptr())),
            Memory::Fake => None,
        }
    }

    /// Whether a new view's completion baseline is 0 without asking the
    /// kernel: always for host storage, and for a `Dma` buffer nothing can
    /// have counted yet (see [`Storage::counted`]).
    #[inline(always)]
    pub(crate) fn zero_baseline(&self) -> bool {
        !self.counted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Marks a `Dma` buffer as counted (see [`Storage::counted`]).
    pub(crate) fn set_counted(&self) {
        self.counted
            .store(true, std::sync::atomic::Ordering::Release);
    }

    pub(crate) fn dma(&self) -> Option<&DmaBuffer> {
        match &self.mem {
            Memory::Dma(b) => Some(b),
            _ => None,
        }
    }
}
