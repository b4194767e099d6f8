//! The tensor view: a name and a `(offset, size)` window over shared,
//! refcounted storage.
//!
//! Two refcounts, as in the seed: a [`Tensor`] handle is an `Arc` of the
//! view (cloning it is `get_reference`: the view refcount), and the view
//! holds an `Arc` of the storage (the storage refcount, shared by slices).
//! Atomic `Arc` counting gives the release/acquire ordering the seed's bare
//! `lock add`/`lock sub` only had on x86.
//!
//! Tensors are byte-untyped: there is no dtype or shape, only bytes.

use std::ffi::c_void;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::storage::{Storage, StorageKind};
use crate::sys::Device;
use crate::trace::{self, TraceOp};

/// Name given to tensors created without one.
pub const DEFAULT_NAME: &str = "_unknown_";

const VIEW_MAGIC: u32 = 0x7456_6965; // "tVie"

/// Where [`Tensor::allocate`] puts the bytes (nrt's placements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// A tdrv device buffer (`Dma` storage) on the process-wide device.
    Device,
    /// Host memory (`Malloc` storage). Upstream, DMA-able host memory.
    Host,
    /// Plain host memory (`Malloc` storage).
    Virtual,
}

/// Physical placement of a device tensor (nrt's device allocation info).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAllocationInfo {
    /// Device (bus) address of the view's first byte.
    pub physical_address: u64,
    /// Size of the view in bytes.
    pub size: usize,
    /// HBM channel of the buffer.
    pub hbm_index: u32,
}

/// The view behind a [`Tensor`] handle. `repr(C)` keeps `magic` first, so
/// that checking a foreign pointer reads only its first bytes.
#[repr(C)]
pub(crate) struct View {
    /// Checked by the C ABI to reject pointers that are not tensors.
    magic: u32,
    /// `None` stands for [`DEFAULT_NAME`] (no allocation).
    name: Option<Box<str>>,
    pub(crate) storage: Option<Arc<Storage>>,
    /// Offset of the view in the storage.
    pub(crate) offset: usize,
    pub(crate) size: usize,
    /// Host storages: this view's output-completion count. Dma storage: the
    /// buffer's kernel completion count at which this view's count was 0.
    pub(crate) completion: AtomicU64,
    /// Accessors open on this view (see `crate::coherency`): shared by the
    /// view's handles, fresh for each slice, like the seed's per-TensorBase
    /// enforcer.
    pub(crate) coherency: crate::coherency::CoherencyEnforcer,
}

impl Drop for View {
    fn drop(&mut self) {
        self.magic = 0;
    }
}

/// A tensor: a cheap, thread-safe handle to a view over shared storage.
///
/// `Clone` is the seed's `tensor_get_reference`: both handles name the same
/// view (same name, window and completion count).
pub struct Tensor {
    view: ManuallyDrop<Arc<View>>,
}

/// A raw tensor handle, as the C ABI passes it around.
pub type RawTensor = *const c_void;

fn check_range(op: &'static str, offset: usize, size: usize, len: usize) -> Result<usize> {
    let end = offset
        .checked_add(size)
        .ok_or(Error::Overflow { op, offset, size })?;
    if end > len {
        return Err(Error::OutOfBounds {
            op,
            offset,
            size,
            len,
        });
    }
    Ok(end)
}

fn owned_name(name: Option<&str>) -> Option<Box<str>> {
    name.filter(|n| *n != DEFAULT_NAME).map(Box::from)
}

impl Tensor {
    fn from_view(view: View) -> Tensor {
        Tensor {
            view: ManuallyDrop::new(Arc::new(view)),
        }
    }

    fn with_storage(name: Option<&str>, storage: Arc<Storage>) -> Tensor {
        let size = storage.size;
        Self::from_view(View {
            magic: VIEW_MAGIC,
            name: owned_name(name),
            storage: Some(storage),
            offset: 0,
            size,
            completion: AtomicU64::new(0),
            coherency: Default::default(),
        })
    }

    /// Allocates a tensor of `size` bytes. `Device` placement allocates on
    /// HBM `channel` of the process-wide device ([`crate::default_device`]);
    /// `Host` and `Virtual` allocate zeroed host memory and ignore
    /// `channel`. The name defaults to `"_unknown_"`.
    pub fn allocate(
        placement: Placement,
        channel: u32,
        size: usize,
        name: Option<&str>,
    ) -> Result<Tensor> {
        match placement {
            Placement::Device => Self::allocate_on(&crate::default_device()?, channel, size, name),
            Placement::Host | Placement::Virtual => Self::allocate_host(size, name),
        }
    }

    /// Allocates a device buffer of `size` bytes on HBM `channel` of
    /// `device` (`Dma` storage).
    pub fn allocate_on(
        device: &Arc<Device>,
        channel: u32,
        size: usize,
        name: Option<&str>,
    ) -> Result<Tensor> {
        let _t = trace::scope(TraceOp::Alloc, name.unwrap_or(DEFAULT_NAME), size);
        Ok(Self::with_storage(
            name,
            Storage::new_dma(device, channel, size)?,
        ))
    }

    /// Allocates `size` zeroed bytes of aligned host memory (`Malloc`).
    pub fn allocate_host(size: usize, name: Option<&str>) -> Result<Tensor> {
        let _t = trace::scope(TraceOp::Alloc, name.unwrap_or(DEFAULT_NAME), size);
        Ok(Self::with_storage(name, Storage::new_malloc(size)?))
    }

    /// A size-only tensor (`Fake`): no bytes exist and I/O is a no-op.
    pub fn allocate_fake(size: usize, name: Option<&str>) -> Tensor {
        let _t = trace::scope(TraceOp::Alloc, name.unwrap_or(DEFAULT_NAME), size);
        Self::with_storage(name, Storage::new_fake(size))
    }

    /// A tensor with no storage and size 0, to be given a buffer with
    /// [`Tensor::attach_buffer`].
    pub fn allocate_empty(name: Option<&str>) -> Tensor {
        Self::from_view(View {
            magic: VIEW_MAGIC,
            name: owned_name(name),
            storage: None,
            offset: 0,
            size: 0,
            completion: AtomicU64::new(0),
            coherency: Default::default(),
        })
    }

    /// A tensor over a caller's buffer (`User` storage), never freed by the
    /// library.
    ///
    /// # Safety
    /// See [`Tensor::attach_buffer`].
    pub unsafe fn from_user_buffer(
        ptr: *mut u8,
        size: usize,
        name: Option<&str>,
    ) -> Result<Tensor> {
        let mut t = Self::allocate_empty(name);
        // SAFETY: forwarded to our caller.
        unsafe { t.attach_buffer(ptr, size)? };
        Ok(t)
    }

    /// Drops the storage this view had (if it was the last user) and makes
    /// the view cover the caller's buffer, which the library never frees.
    /// Fails with [`Error::SharedView`] when other handles share the view
    /// (clones, tensor sets): attach before sharing.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `size` bytes for as long
    /// as any view of the new storage lives (slices included), and must not
    /// be accessed by other means while a tensor operation on it runs. A
    /// null `ptr` is allowed only with `size == 0`.
    pub unsafe fn attach_buffer(&mut self, ptr: *mut u8, size: usize) -> Result<()> {
        let name = self.name().to_owned();
        let view = Arc::get_mut(&mut self.view).ok_or(Error::SharedView(name))?;
        // SAFETY: forwarded to our caller.
        let storage = unsafe { Storage::new_user(ptr, size)? };
        view.storage = Some(storage);
        view.offset = 0;
        view.size = size;
        *view.completion.get_mut() = 0;
        Ok(())
    }

    /// A sub-view of `size` bytes at `offset` of this view, sharing its
    /// storage: one allocation (two with a name other than the default) and
    /// one atomic increment, no copy, no syscall. Offsets
    /// compose (a slice of a slice addresses the storage directly) and the
    /// range is checked against this view, not the storage. The slice's
    /// output-completion count starts at 0. This view may be dropped before
    /// the slice.
    ///
    /// For a `Dma` storage some job has written, learning the kernel's
    /// completion count for the new view's baseline costs one ioctl.
    pub fn slice(&self, offset: usize, size: usize, name: Option<&str>) -> Result<Tensor> {
        let storage = self.storage_for("slice")?;
        check_range("slice", offset, size, self.view.size)?;
        let baseline = match storage.dma() {
            Some(b) if b.counted.load(Ordering::Acquire) => {
                b.device.buf_info(b.handle)?.completion_count
            }
            _ => 0,
        };
        Ok(Self::from_view(View {
            magic: VIEW_MAGIC,
            name: owned_name(name),
            storage: Some(storage.clone()),
            offset: self.view.offset + offset,
            size,
            completion: AtomicU64::new(baseline),
            coherency: Default::default(),
        }))
    }

    /// Another handle to the same view (the seed's `tensor_get_reference`).
    pub fn get_reference(&self) -> Tensor {
        self.clone()
    }

    /// The tensor's name.
    pub fn name(&self) -> &str {
        self.view.name.as_deref().unwrap_or(DEFAULT_NAME)
    }

    /// Size of the view in bytes.
    pub fn size(&self) -> usize {
        self.view.size
    }

    /// Offset of the view in its storage.
    pub fn offset(&self) -> usize {
        self.view.offset
    }

    /// The kind of storage, `None` for an empty tensor.
    pub fn kind(&self) -> Option<StorageKind> {
        self.view.storage.as_ref().map(|s| s.kind())
    }

    /// Size of the whole storage, `None` for an empty tensor.
    pub fn storage_size(&self) -> Option<usize> {
        self.view.storage.as_ref().map(|s| s.size)
    }

    /// Whether both tensors are views of the same storage.
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        match (&self.view.storage, &other.view.storage) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Whether both handles name the same view.
    pub fn same_view(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.view, &other.view)
    }

    /// Handles to this view (the view refcount).
    pub fn view_ref_count(&self) -> usize {
        Arc::strong_count(&self.view)
    }

    /// Views of this storage (the storage refcount); 0 for an empty tensor.
    pub fn storage_ref_count(&self) -> usize {
        self.view.storage.as_ref().map_or(0, Arc::strong_count)
    }

    /// Host address of the view's first byte: the host allocation (Malloc,
    /// User) or the buffer's mapping (Dma) plus the offset. `None` for Fake
    /// and empty tensors, and for Dma buffers the driver cannot map.
    ///
    /// Writing through it bypasses the fences: see
    /// [`Tensor::wait_device_idle`].
    pub fn va(&self) -> Option<NonNull<u8>> {
        let base = self.view.storage.as_ref()?.host_base()?;
        // SAFETY: offset <= storage size (checked when the view was made),
        // so the result stays inside (or one past) the same allocation.
        Some(unsafe { base.add(self.view.offset) })
    }

    /// Device (bus) address of the view's first byte; `Dma` only.
    pub fn pa(&self) -> Result<u64> {
        let storage = self.storage_for("pa")?;
        let b = storage.dma().ok_or(Error::Unsupported {
            op: "pa",
            kind: storage.kind(),
        })?;
        Ok(b.dma_addr + self.view.offset as u64)
    }

    /// HBM channel of a `Dma` tensor.
    pub fn channel(&self) -> Option<u32> {
        Some(self.view.storage.as_ref()?.dma()?.channel)
    }

    /// The device of a `Dma` tensor.
    pub fn device(&self) -> Option<&Arc<Device>> {
        Some(&self.view.storage.as_ref()?.dma()?.device)
    }

    /// The tdrv buffer handle of a `Dma` tensor, for callers that use the
    /// [`Device`] ioctls directly. Completion baselines stay right even if
    /// they submit jobs with it.
    pub fn dma_handle(&self) -> Option<u64> {
        let b = self.view.storage.as_ref()?.dma()?;
        b.counted.store(true, Ordering::Release);
        Some(b.handle)
    }

    /// Physical address, size and HBM channel of a `Dma` tensor.
    pub fn device_allocation_info(&self) -> Result<DeviceAllocationInfo> {
        let physical_address = self.pa()?;
        Ok(DeviceAllocationInfo {
            physical_address,
            size: self.view.size,
            hbm_index: self.channel().unwrap_or(u32::MAX),
        })
    }

    pub(crate) fn storage_for(&self, op: &'static str) -> Result<&Arc<Storage>> {
        self.view.storage.as_ref().ok_or_else(|| Error::NoStorage {
            op,
            name: self.name().to_owned(),
        })
    }

    /// Checks `[offset, offset + size)` against the view; returns the
    /// storage and the absolute offset in it.
    pub(crate) fn locate(
        &self,
        op: &'static str,
        offset: usize,
        size: usize,
    ) -> Result<(&Storage, usize)> {
        let storage = self.storage_for(op)?;
        check_range(op, offset, size, self.view.size)?;
        // Cannot overflow: view.offset + view.size <= storage.size.
        Ok((storage, self.view.offset + offset))
    }

    pub(crate) fn completion_cell(&self) -> &AtomicU64 {
        &self.view.completion
    }

    /// The accessor coherency enforcer of this view (`crate::accessor`).
    pub fn coherency_enforcer(&self) -> &crate::coherency::CoherencyEnforcer {
        &self.view.coherency
    }

    /// Gives up the handle as a raw pointer (for the C ABI). Reclaim it with
    /// [`Tensor::from_raw`].
    pub fn into_raw(self) -> RawTensor {
        let this = ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again, so the Arc is moved
        // out exactly once.
        let view = unsafe { std::ptr::read(&*this.view) };
        Arc::into_raw(view).cast()
    }

    /// The raw pointer of this handle's view (not counted).
    pub fn as_raw(&self) -> RawTensor {
        Arc::as_ptr(&self.view).cast()
    }

    /// Takes back a handle given up by [`Tensor::into_raw`].
    ///
    /// # Safety
    /// `raw` must come from `into_raw` and not have been reclaimed yet.
    pub unsafe fn from_raw(raw: RawTensor) -> Tensor {
        Tensor {
            // SAFETY: forwarded to our caller.
            view: ManuallyDrop::new(unsafe { Arc::from_raw(raw.cast::<View>()) }),
        }
    }

    /// Borrows the tensor behind a raw handle without taking ownership.
    /// Returns `None` for null pointers and for pointers that do not point
    /// at a live view (best effort: the check reads the memory).
    ///
    /// # Safety
    /// A non-null `raw` must be readable as a view (a handle from
    /// `into_raw`/`as_raw` of a live tensor), and must stay valid while the
    /// result is used.
    pub unsafe fn borrow_raw(raw: RawTensor) -> Option<ManuallyDrop<Tensor>> {
        if raw.is_null() {
            return None;
        }
        // SAFETY: per the contract the pointer is readable as a View.
        if unsafe { (*raw.cast::<View>()).magic } != VIEW_MAGIC {
            return None;
        }
        // SAFETY: the ManuallyDrop never decrements the count we did not
        // increment.
        Some(ManuallyDrop::new(unsafe { Self::from_raw(raw) }))
    }
}

impl Clone for Tensor {
    fn clone(&self) -> Self {
        Tensor {
            view: ManuallyDrop::new(Arc::clone(&self.view)),
        }
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        // The seed's tensor_free: event 28 around dropping one view
        // reference (and, if it was the last, the storage reference).
        if trace::enabled() {
            let name = self.name().to_owned();
            let _t = trace::scope(TraceOp::Free, &name, self.view.size);
            // SAFETY: dropped exactly once, here; `self.view` is not used
            // afterwards.
            unsafe { ManuallyDrop::drop(&mut self.view) };
        } else {
            // SAFETY: as above.
            unsafe { ManuallyDrop::drop(&mut self.view) };
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("name", &self.name())
            .field("kind", &self.kind())
            .field("offset", &self.offset())
            .field("size", &self.size())
            .finish()
    }
}

/// Bytes one view costs on the heap: the `Arc` counts plus the view.
pub const VIEW_HEAP_SIZE: usize = 2 * std::mem::size_of::<usize>() + std::mem::size_of::<View>();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_takes_at_most_128_bytes() {
        // Handle, Arc header and view together; the seed's view is 192 B.
        assert_eq!(std::mem::size_of::<Tensor>(), std::mem::size_of::<usize>());
        const { assert!(VIEW_HEAP_SIZE <= 128) };
    }

    #[test]
    fn tensors_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tensor>();
    }

    #[test]
    fn range_checks() {
        assert_eq!(check_range("x", 0, 10, 10).unwrap(), 10);
        assert!(matches!(
            check_range("x", 1, 10, 10),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            check_range("x", usize::MAX, 1, 10),
            Err(Error::Overflow { .. })
        ));
    }
}
