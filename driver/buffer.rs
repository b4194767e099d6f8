// SPDX-License-Identifier: GPL-2.0

//! A DMA-coherent device buffer: memory, channel accounting and its fence.
//!
//! Buffers are reference counted (`Arc`). The owning file's handle table,
//! every mapping (see `mmap.rs`) and every in-flight job hold a reference, so
//! FREE only drops the handle: the memory goes back when the last user goes.
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
    prelude::*,
    sync::Arc,
    uaccess::{
        UserPtr,
        UserSliceWriter, //
    },
};

use crate::{
    device::TdrvDevice,
    fence::Fence,
    range::ByteRange, //
};

/// One device buffer.
#[pin_data(PinnedDrop)]
pub(crate) struct Buffer {
    mem: Coherent<[u8]>,
    channel: u32,
    device: Arc<TdrvDevice>,
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
        // If building the `Arc` fails, `mem` is dropped by the initializer
        // but `PinnedDrop` never runs: give the reservation back by hand.
        Arc::pin_init(
            try_pin_init!(Self {
                mem,
                channel,
                device: device.clone(),
                fence <- Fence::new(),
            }),
            GFP_KERNEL,
        )
        .inspect_err(|_| device.channels.release(channel, size as u64))
    }

    pub(crate) fn size(&self) -> usize {
        self.mem.size()
    }

    pub(crate) fn channel(&self) -> u32 {
        self.channel
    }

    pub(crate) fn dma_addr(&self) -> u64 {
        self.mem.dma_handle()
    }

    pub(crate) fn device(&self) -> &Arc<TdrvDevice> {
        &self.device
    }

    /// The CPU address of `offset`. Callers have bounds-checked `offset`.
    fn cpu_ptr(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.size());
        // SAFETY: `offset <= size`, so the result is inside the allocation
        // or one past its end.
        unsafe { self.mem.as_mut_ptr().cast::<u8>().add(offset) }
    }

    pub(crate) fn coherent(&self) -> &Coherent<[u8]> {
        &self.mem
    }

    /// Copies `range.len` bytes from user memory at `src` into the buffer.
    /// EFAULT if any byte cannot be read (the buffer may be partly written).
    pub(crate) fn copy_from_user(&self, range: ByteRange, src: UserPtr) -> Result {
        let mut done = 0;
        while done < range.len {
            let n = (range.len - done).min(CHUNK);
            // SAFETY: `range` lies inside the allocation (checked by the
            // caller with `checked_range`), so the destination is valid for
            // `n` bytes; `copy_from_user` validates the user range itself.
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

    /// Copies `range` of the buffer to user memory.
    pub(crate) fn copy_to_user(&self, range: ByteRange, dst: &mut UserSliceWriter) -> Result {
        let mut done = 0;
        while done < range.len {
            let n = (range.len - done).min(CHUNK);
            dst.write_dma(&self.mem, range.start + done, n)?;
            done += n;
        }
        Ok(())
    }

    /// Fills `range` with `value`.
    pub(crate) fn fill(&self, range: ByteRange, value: u8) {
        // SAFETY: `range` lies inside the allocation (checked by caller).
        unsafe { core::ptr::write_bytes(self.cpu_ptr(range.start), value, range.len) };
    }

    /// Copies `src_range` of `src` to `dst_offset` of `self` with the CPU.
    /// Overlapping ranges of one buffer behave like `memmove`.
    pub(crate) fn copy_from(&self, dst_offset: usize, src: &Buffer, src_range: ByteRange) {
        // SAFETY: both ranges were bounds-checked by the caller; `copy`
        // permits overlap.
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
        self.device
            .channels
            .release(self.channel, self.mem.size() as u64);
    }
}
