// SPDX-License-Identifier: GPL-2.0

//! A DMA-coherent device buffer: memory, channel accounting and its fence.
//!
//! Buffers are reference counted (`Arc`). The owning file's handle table,
//! every mapping (see `mmap.rs`) and every in-flight job hold a reference, so
//! FREE only drops the handle: the memory goes back when the last user goes,
//! or earlier, when the device is unbound ([`Buffer::revoke`]): DMA memory
//! must not outlive the device's binding.
//!
//! The CPU touches buffer memory only through raw copies (`copy_from_user`,
//! `copy_to_user`, `memmove`, `memset`), never through Rust references,
//! because a device may access the same bytes concurrently.

use kernel::{
    bindings,
    device::{
        Bound,
        Device, //
    },
    dma::Coherent,
    new_mutex,
    prelude::*,
    sync::{
        Arc,
        Mutex, //
    },
    uaccess::UserPtr, //
};

use crate::{
    device::TdrvDevice,
    fence::Fence,
    range::ByteRange, //
};

/// The CPU address of a buffer's memory.
#[derive(Clone, Copy)]
struct CpuAddr(*mut u8);

// SAFETY: The address is only dereferenced through the raw copies of
// `Buffer`, whose callers guarantee the memory is live (see `Buffer`'s
// invariant); the pointer itself may be shared and sent freely.
unsafe impl Send for CpuAddr {}
// SAFETY: As above.
unsafe impl Sync for CpuAddr {}

/// One device buffer.
///
/// # Invariants
///
/// `cpu`, `dma_addr` and `size` describe the allocation in `mem` for as long
/// as `mem` holds it. `mem` is emptied only by [`Buffer::revoke`], whose
/// caller guarantees that no ioctl, mapping or job can reach the memory any
/// more; so every accessor that runs from an ioctl (under the device's
/// active-user guard) or from a job sees live memory.
#[pin_data(PinnedDrop)]
pub(crate) struct Buffer {
    #[pin]
    mem: Mutex<Option<Coherent<[u8]>>>,
    cpu: CpuAddr,
    dma_addr: u64,
    size: usize,
    channel: u32,
    device: Arc<TdrvDevice>,
    /// This buffer's key in the device's buffer registry.
    registry_key: u64,
    /// Pending device reads/writes and the completion count.
    #[pin]
    pub(crate) fence: Fence,
}

impl Buffer {
    /// Allocates `size` zeroed bytes on `channel` of `device`, charging the
    /// channel's accounting first.
    pub(crate) fn new(
        device: &Arc<TdrvDevice>,
        bound: &Device<Bound>,
        size: usize,
        channel: u32,
    ) -> Result<Arc<Self>> {
        device.channels.reserve(channel, size as u64)?;
        let mem = match Coherent::<u8>::zeroed_slice(bound, size, GFP_KERNEL | __GFP_NOWARN) {
            Ok(mem) => mem,
            Err(e) => {
                device.channels.release(channel, size as u64);
                device.channels.note_failure(channel);
                return Err(e);
            }
        };
        let cpu = CpuAddr(mem.as_mut_ptr().cast());
        let dma_addr = mem.dma_handle();
        let registry_key = match device.register_buffer() {
            Ok(key) => key,
            Err(e) => {
                device.channels.release(channel, size as u64);
                return Err(e);
            }
        };
        let buf = Arc::pin_init(
            try_pin_init!(Self {
                mem <- new_mutex!(Some(mem), "Buffer::mem"),
                cpu,
                dma_addr,
                size,
                channel,
                device: device.clone(),
                registry_key,
                fence <- Fence::new(),
            }),
            GFP_KERNEL,
        );
        match buf {
            Ok(buf) => {
                device.publish_buffer(registry_key, &buf);
                Ok(buf)
            }
            Err(e) => {
                // `mem` was dropped by the initializer, but `PinnedDrop`
                // never runs for an unbuilt value: undo the rest by hand.
                device.unregister_buffer(registry_key);
                device.channels.release(channel, size as u64);
                Err(e)
            }
        }
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn channel(&self) -> u32 {
        self.channel
    }

    pub(crate) fn dma_addr(&self) -> u64 {
        self.dma_addr
    }

    /// The CPU address of `offset`. Callers have bounds-checked `offset`.
    fn cpu_ptr(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.size);
        // SAFETY: `offset <= size`, so the result is inside the allocation
        // or one past its end.
        unsafe { self.cpu.0.add(offset) }
    }

    /// Frees the DMA memory now, although references to the buffer remain.
    ///
    /// # Safety
    ///
    /// The device is unbound, its engine has stopped, no ioctl or mmap of
    /// the device is running or can start, and no user mapping still has
    /// the pages mapped: nothing can touch the memory afterwards.
    pub(crate) unsafe fn revoke(&self) {
        let mem = self.mem.lock().take();
        drop(mem);
    }

    /// Maps the whole buffer into `vma` with `dma_mmap_attrs`.
    ///
    /// # Safety
    ///
    /// `vma` is a VMA under set-up (mmap write lock held) with `vm_pgoff`
    /// 0, and the caller keeps the buffer alive while the VMA exists.
    pub(crate) unsafe fn dma_mmap(&self, vma: *mut bindings::vm_area_struct) -> Result {
        let mem = self.mem.lock();
        let mem = mem.as_ref().ok_or(ENODEV)?;
        // SAFETY: The device, CPU address, DMA handle and size describe one
        // live coherent allocation of that device (held by the lock guard);
        // the caller's guarantees cover `vma` and the lifetime.
        kernel::error::to_result(unsafe {
            bindings::dma_mmap_attrs(
                crate::device::raw_device(self.device.bus_device()),
                vma,
                mem.as_mut_ptr().cast(),
                mem.dma_handle(),
                mem.size(),
                0,
            )
        })
    }

    /// Copies `range.len` bytes from user memory at `src` into the buffer.
    /// EFAULT if any byte cannot be read (the buffer may be partly written).
    pub(crate) fn copy_from_user(&self, range: ByteRange, src: UserPtr) -> Result {
        let mut done = 0;
        while done < range.len {
            let n = (range.len - done).min(CHUNK);
            // SAFETY: `range` lies inside the allocation (checked by the
            // caller with `checked_range`), which is live (type invariant),
            // so the destination is valid for `n` bytes; `copy_from_user`
            // validates the user range itself.
            let left = unsafe {
                bindings::copy_from_user(
                    self.cpu_ptr(range.start + done).cast(),
                    src.wrapping_byte_add(done).as_const_ptr(),
                    n,
                )
            };
            if left != 0 {
                return Err(EFAULT);
            }
            done += n;
        }
        Ok(())
    }

    /// Copies `range` of the buffer to user memory at `dst`.
    pub(crate) fn copy_to_user(&self, range: ByteRange, dst: UserPtr) -> Result {
        let mut done = 0;
        while done < range.len {
            let n = (range.len - done).min(CHUNK);
            // SAFETY: As in `copy_from_user`, with the directions swapped.
            let left = unsafe {
                bindings::copy_to_user(
                    dst.wrapping_byte_add(done).as_mut_ptr(),
                    self.cpu_ptr(range.start + done).cast(),
                    n,
                )
            };
            if left != 0 {
                return Err(EFAULT);
            }
            done += n;
        }
        Ok(())
    }

    /// Fills `range` with `value`.
    pub(crate) fn fill(&self, range: ByteRange, value: u8) {
        // SAFETY: `range` lies inside the live allocation (checked by the
        // caller; type invariant).
        unsafe { core::ptr::write_bytes(self.cpu_ptr(range.start), value, range.len) };
    }

    /// Copies `src_range` of `src` to `dst_offset` of `self` with the CPU.
    /// Overlapping ranges of one buffer behave like `memmove`.
    pub(crate) fn copy_from(&self, dst_offset: usize, src: &Buffer, src_range: ByteRange) {
        // SAFETY: Both ranges were bounds-checked by the caller and both
        // allocations are live (type invariant); `copy` permits overlap.
        unsafe {
            core::ptr::copy(
                src.cpu_ptr(src_range.start),
                self.cpu_ptr(dst_offset),
                src_range.len,
            )
        };
    }
}

/// User copies are split into chunks of this size, so a fault is reported
/// after at most one chunk of wasted work.
const CHUNK: usize = 1 << 20;

#[pinned_drop]
impl PinnedDrop for Buffer {
    fn drop(self: Pin<&mut Self>) {
        self.device.unregister_buffer(self.registry_key);
        self.device.channels.release(self.channel, self.size as u64);
    }
}
