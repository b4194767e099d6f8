//! The tensor view: a name and a `(offset, size)` window over shared,
//! refcounted storage.
//!
//! Two refcounts, as in the seed: a [`Tensor`] handle is a counted pointer
//! to the view (cloning it is `get_reference`: the view refcount), and the
//! view holds an `Arc` of the storage (the storage refcount, shared by
//! slices). The view's count is our own small `Arc` (`ViewInner`): the
//! standard one cannot report a failed allocation, and a view must be
//! refused with [`Error::OutOfMemory`], not abort the process. Counting
//! uses the release/acquire ordering the seed's bare `lock add`/`lock sub`
//! only had on x86.
//!
//! Tensors are byte-untyped: there is no dtype or shape, only bytes.

use std::alloc::Layout;
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::log::log_warn;
use crate::storage::{Storage, StorageKind};
use crate::sys::Device;
use crate::trace::{self, TraceOp};

/// Name given to tensors created without one.
pub const DEFAULT_NAME: &str = "_unknown_";

/// Where nrt's placements put the bytes: [`crate::TensorBuilder::placement`]
/// and [`crate::compat::TensorCompat::allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// A tdrv device buffer (`Dma` storage) on the process-wide device.
    Device,
    /// Host memory (`Malloc` storage). Upstream, DMA-able host memory.
    Host,
    /// Plain host memory (`Malloc` storage).
    Virtual,
}

/// The view behind a [`Tensor`] handle.
pub(crate) struct View {
    /// `None` stands for [`DEFAULT_NAME`] (no allocation).
    name: Option<Box<str>>,
    pub(crate) storage: Option<Arc<Storage>>,
    /// Offset of the view in the storage.
    pub(crate) offset: usize,
    pub(crate) size: usize,
    /// Host storages: this view's output-completion count. Dma storage: the
    /// buffer's kernel completion count at which this view's count was 0.
    pub(crate) completion: AtomicU64,
    /// Dma storage: the device's raw-reset epoch of the buffer when
    /// `completion` was taken ([`Device::completion_epoch`]); a later epoch
    /// means the kernel count restarted from 0 since.
    pub(crate) completion_epoch: AtomicU64,
    /// Accessors open on this view (see `crate::coherency`): shared by the
    /// view's handles, fresh for each slice, like the seed's per-TensorBase
    /// enforcer.
    pub(crate) coherency: crate::coherency::CoherencyEnforcer,
}

/// The heap block of a view: its handle count and the view.
struct ViewInner {
    /// Handles to the view in the low bits ([`COUNT`]), plus the flags
    /// [`NAMED`] and [`NO_STORAGE`], which never change while a second
    /// handle exists: a drop learns "last handle of an unnamed view with a
    /// storage" from one load (`refs == 1`).
    refs: AtomicUsize,
    view: View,
}

/// In `ViewInner::refs`: the view has a name of its own.
const NAMED: usize = 1 << (usize::BITS - 1);
/// In `ViewInner::refs`: the view has no storage.
const NO_STORAGE: usize = 1 << (usize::BITS - 2);
/// In `ViewInner::refs`: the bits of the handle count.
const COUNT: usize = NO_STORAGE - 1;
/// Handle counts above this abort (as `Arc` does above `isize::MAX`): a
/// count this high means leaked handles, and the margin up to `COUNT`
/// covers the increments racing threads make before one aborts.
const MAX_REFS: usize = COUNT >> 1;

/// The flags of `view` in `ViewInner::refs`.
fn flags_of(view: &View) -> usize {
    (if view.name.is_some() { NAMED } else { 0 })
        | (if view.storage.is_none() {
            NO_STORAGE
        } else {
            0
        })
}

/// Set in a handle's pointer for internal handles, whose drop is not a user
/// action and emits no trace event. `ViewInner` is 8-byte aligned, so the
/// low bit of a real address is always clear.
const QUIET: usize = 1;

/// A tensor: a cheap, thread-safe handle to a view over shared storage.
///
/// `Clone` is the seed's `tensor_get_reference`: both handles name the same
/// view (same name, window and completion count). [`Tensor::slice`] makes a
/// new view of the same storage.
///
/// ```
/// use tdrv::Tensor;
///
/// let t = Tensor::allocate_host(16, Some("input"))?;
/// t.write(4, &[1, 2, 3, 4])?;
/// let again = t.clone(); // the same view
/// assert_eq!(again.to_vec()?[4..8], [1, 2, 3, 4]);
/// assert!(t.write(15, &[0, 0]).is_err()); // past the end: an error
/// # Ok::<(), tdrv::Error>(())
/// ```
pub struct Tensor {
    /// A `ViewInner` with one count held by this handle; the low bit is
    /// the `QUIET` tag.
    ptr: NonNull<ViewInner>,
}

// SAFETY: a `Tensor` is a counted shared pointer to a `View`, exactly like
// `Arc<View>`: the count is atomic, the view is only reached through `&`
// (or `&mut` when the count is 1, see `view_mut`), and `View` is Send +
// Sync (checked below).
unsafe impl Send for Tensor {}
// SAFETY: as above.
unsafe impl Sync for Tensor {}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<View>();
    assert!(std::mem::align_of::<ViewInner>() > QUIET);
};

#[inline]
fn check_range(op: &'static str, offset: usize, size: usize, len: usize) -> Result<usize> {
    let Some(end) = offset.checked_add(size) else {
        return Err(Error::Overflow { op, offset, size });
    };
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

/// The view's copy of its name, allocated fallibly.
#[inline]
fn owned_name(name: Option<&str>) -> Result<Option<Box<str>>> {
    match name {
        None => Ok(None),
        Some(n) => copy_name(n),
    }
}

fn copy_name(n: &str) -> Result<Option<Box<str>>> {
    if n == DEFAULT_NAME {
        return Ok(None);
    }
    let mut s = String::new();
    s.try_reserve_exact(n.len())
        .map_err(|_| Error::OutOfMemory(n.len()))?;
    s.push_str(n);
    // Length equals capacity: no reallocation.
    Ok(Some(s.into_boxed_str()))
}

/// The raw-reset epoch of a storage's buffer now (0 for host storage).
fn epoch_of(storage: &Storage) -> u64 {
    storage
        .dma()
        .map_or(0, |b| b.device.completion_epoch(b.handle))
}

/// Freed view blocks kept for reuse, per thread (DESIGN.md, "Slicing
/// without an allocation", says why this shape): up to [`pool::CAPACITY`]
/// blocks, one in a slot that `slice` and `drop` reach inline, the others
/// in a list threaded through the blocks themselves. `POOL` has no
/// destructor; `GUARD`, registered when the thread first keeps a block,
/// frees the blocks when the thread exits. A block moves freely between
/// threads (it is plain memory of `ViewInner`'s layout).
mod pool {
    use super::ViewInner;
    use std::alloc::Layout;
    use std::cell::Cell;
    use std::ptr::{self, NonNull};
    use std::sync::atomic::AtomicUsize;

    /// Blocks a thread keeps at most (the slot and the list): enough for
    /// the views a loop makes and drops, small enough
    /// (`CAPACITY * size_of::<ViewInner>()`, under 4 KiB) not to matter as
    /// idle memory.
    pub(super) const CAPACITY: usize = 32;

    /// The slot of a thread that keeps no block: before `GUARD` is
    /// registered, and after it ran. Not null, so `give`'s test sends such
    /// threads to `give_slow`; not a block, so `take`'s test ignores it.
    const CLOSED: *mut ViewInner = ptr::without_provenance_mut(1);

    struct Pool {
        /// A spare block, null when empty, or `CLOSED`. A block here has
        /// its `refs` (1, no flag) and `view.name` (`None`) written: what
        /// they are after the drop of an unnamed view's last handle, so
        /// that `drop` leaves them and `slice` does not write them.
        slot: Cell<*mut ViewInner>,
        /// More spare blocks (null if none); each block's first word holds
        /// the next one.
        head: Cell<*mut ViewInner>,
        /// Blocks in `head`'s list.
        len: Cell<usize>,
        /// Whether `GUARD` ran (or could not be registered): the thread
        /// keeps no block any more.
        gone: Cell<bool>,
    }

    thread_local! {
        static POOL: Pool = const {
            Pool {
                slot: Cell::new(CLOSED),
                head: Cell::new(ptr::null_mut()),
                len: Cell::new(0),
                gone: Cell::new(false),
            }
        };
        static GUARD: Guard = const { Guard };
    }

    struct Guard;

    impl Drop for Guard {
        fn drop(&mut self) {
            POOL.with(|p| {
                p.gone.set(true);
                let spare = p.slot.replace(CLOSED);
                if spare != CLOSED {
                    if let Some(b) = NonNull::new(spare) {
                        free(b);
                    }
                }
                let mut b = p.head.replace(ptr::null_mut());
                p.len.set(0);
                while let Some(block) = NonNull::new(b) {
                    // SAFETY: a block in the list holds the next one in its
                    // first word.
                    b = unsafe { block.cast::<*mut ViewInner>().read() };
                    free(block);
                }
            });
        }
    }

    /// Returns an unused block to the allocator.
    fn free(block: NonNull<ViewInner>) {
        // SAFETY: every block came from the global allocator with this
        // layout (directly, or through some thread's pool), and its owner
        // gives it up here.
        unsafe { std::alloc::dealloc(block.as_ptr().cast(), Layout::new::<ViewInner>()) };
    }

    /// This thread's spare block, if its slot holds one: its `refs` is 1
    /// and its `view.name` `None`, the other fields are not initialised.
    #[inline(always)]
    pub(super) fn take() -> Option<NonNull<ViewInner>> {
        POOL.with(|p| {
            let block = p.slot.get();
            // Neither null nor `CLOSED`: a block (addresses of blocks are
            // above both).
            if block.addr() <= CLOSED.addr() {
                return None;
            }
            p.slot.set(ptr::null_mut());
            // SAFETY: just checked non-null.
            Some(unsafe { NonNull::new_unchecked(block) })
        })
    }

    /// An unused block from this thread's list, if it has one (after
    /// [`take`] found the slot empty).
    #[inline(never)]
    pub(super) fn take_listed() -> Option<NonNull<ViewInner>> {
        POOL.with(|p| {
            let block = NonNull::new(p.head.get())?;
            // SAFETY: a block in the list holds the next one in its first
            // word (see `give_slow`); taking it out makes it ours.
            p.head.set(unsafe { block.cast::<*mut ViewInner>().read() });
            p.len.set(p.len.get() - 1);
            Some(block)
        })
    }

    /// Puts `block` in this thread's slot if the slot is empty, and says
    /// whether it did. Its `refs` must be 1 and its `view.name` `None`.
    #[inline(always)]
    pub(super) fn give_to_slot(block: NonNull<ViewInner>) -> bool {
        POOL.with(|p| {
            let empty = p.slot.get().is_null();
            if empty {
                p.slot.set(block.as_ptr());
            }
            empty
        })
    }

    /// Keeps `block`, which no handle uses any more, for reuse; frees it if
    /// this thread's pool is full or gone.
    #[inline(always)]
    pub(super) fn give(block: NonNull<ViewInner>) {
        POOL.with(|p| {
            if p.slot.get().is_null() {
                into_slot(p, block);
            } else {
                give_slow(p, block);
            }
        })
    }

    /// Puts an unused block in the (empty) slot, with the fields a block
    /// there has written.
    fn into_slot(p: &Pool, block: NonNull<ViewInner>) {
        let b = block.as_ptr();
        // SAFETY: the block is unused memory of `ViewInner`'s layout, ours
        // to write.
        unsafe {
            ptr::addr_of_mut!((*b).refs).write(AtomicUsize::new(1));
            ptr::addr_of_mut!((*b).view.name).write(None);
        }
        p.slot.set(b);
    }

    #[inline(never)]
    fn give_slow(p: &Pool, block: NonNull<ViewInner>) {
        if p.slot.get() == CLOSED {
            // The first block this thread keeps: make sure the pool is
            // freed at exit. `try_with` fails once the thread's destructors
            // have run; `gone` says `GUARD` has run.
            if !p.gone.get() && GUARD.try_with(|_| ()).is_ok() {
                into_slot(p, block);
            } else {
                p.gone.set(true);
                free(block);
            }
            return;
        }
        let n = p.len.get();
        if n + 1 < CAPACITY {
            // SAFETY: the block is unused memory of `ViewInner`'s layout
            // (8-byte aligned, more than a pointer), ours to write.
            unsafe { block.cast::<*mut ViewInner>().write(p.head.get()) };
            p.head.set(block.as_ptr());
            p.len.set(n + 1);
        } else {
            free(block);
        }
    }

    /// Blocks this thread keeps now (tests).
    #[cfg(test)]
    pub(super) fn kept() -> usize {
        POOL.with(|p| {
            let slot = p.slot.get();
            usize::from(!slot.is_null() && slot != CLOSED) + p.len.get()
        })
    }
}

impl Tensor {
    /// Puts `view` in a block with one handle (from this thread's pool, or
    /// the heap), or fails cleanly.
    fn from_view(view: View) -> Result<Tensor> {
        let ptr = match pool::take().or_else(pool::take_listed) {
            Some(block) => block,
            None => {
                let layout = Layout::new::<ViewInner>();
                // SAFETY: `ViewInner` is not zero-sized.
                let raw = unsafe { std::alloc::alloc(layout) }.cast::<ViewInner>();
                NonNull::new(raw).ok_or_else(|| Error::OutOfMemory(layout.size()))?
            }
        };
        // SAFETY: `ptr` is an unused block of `ViewInner`'s layout: fresh
        // from the allocator, or taken out of the pool (which holds only
        // blocks no handle points to any more).
        unsafe {
            ptr.as_ptr().write(ViewInner {
                refs: AtomicUsize::new(1 | flags_of(&view)),
                view,
            })
        };
        Ok(Tensor { ptr })
    }

    fn new_view(
        name: Option<&str>,
        storage: Option<Arc<Storage>>,
        offset: usize,
        size: usize,
        baseline: (u64, u64),
    ) -> Result<Tensor> {
        Self::from_view(View {
            name: owned_name(name)?,
            storage,
            offset,
            size,
            completion: AtomicU64::new(baseline.0),
            completion_epoch: AtomicU64::new(baseline.1),
            coherency: Default::default(),
        })
    }

    fn with_storage(name: Option<&str>, storage: Arc<Storage>) -> Result<Tensor> {
        let size = storage.size;
        let epoch = epoch_of(&storage);
        Self::new_view(name, Some(storage), 0, size, (0, epoch))
    }

    #[cfg(test)]
    pub(crate) fn __from_storage_for_tests(storage: Arc<Storage>) -> Tensor {
        Self::with_storage(None, storage).expect("view")
    }

    /// The block's address, without the tag.
    #[inline(always)]
    fn untagged(&self) -> *mut ViewInner {
        let p = self.ptr.as_ptr();
        p.wrapping_byte_sub(p.addr() & QUIET)
    }

    #[inline(always)]
    fn inner(&self) -> &ViewInner {
        // SAFETY: the untagged pointer is a live `ViewInner`: this handle
        // holds one of its counts.
        unsafe { &*self.untagged() }
    }

    #[inline(always)]
    fn view(&self) -> &View {
        &self.inner().view
    }

    /// The view, writable when this is its only handle.
    fn view_mut(&mut self) -> Option<&mut View> {
        // Acquire: see every write other (now dropped) handles made before
        // their Release decrement.
        if self.inner().refs.load(Ordering::Acquire) & COUNT != 1 {
            return None;
        }
        // SAFETY: the count is 1 and we hold it through `&mut self`, so no
        // other handle exists and none can be made meanwhile.
        Some(unsafe { &mut (*self.untagged()).view })
    }

    #[inline(always)]
    fn is_quiet(&self) -> bool {
        self.ptr.as_ptr().addr() & QUIET != 0
    }

    /// Another handle to this view, counted like a clone.
    fn counted(&self, quiet: bool) -> Tensor {
        let old = self.inner().refs.fetch_add(1, Ordering::Relaxed);
        if old & COUNT > MAX_REFS {
            // As `Arc`: a count this high means leaked handles; wrapping
            // would free a live view.
            std::process::abort();
        }
        let ptr = self
            .ptr
            .as_ptr()
            .map_addr(|a| (a & !QUIET) | if quiet { QUIET } else { 0 });
        Tensor {
            // SAFETY: derived from a non-null pointer with only the low tag
            // bit changed; the untagged address is non-null.
            ptr: unsafe { NonNull::new_unchecked(ptr) },
        }
    }

    /// A handle for bookkeeping done on a user's behalf (jobs, the C
    /// ABI's handle table and sets, staging buffers): like a clone, but its
    /// drop is not a user action and emits no trace event. Its clones are
    /// ordinary handles.
    pub fn clone_quiet(&self) -> Tensor {
        self.counted(true)
    }

    /// Turns this handle into a quiet one (see [`Tensor::clone_quiet`]).
    pub(crate) fn into_quiet(self) -> Tensor {
        let q = self.counted(true);
        let mut this = std::mem::ManuallyDrop::new(self);
        this.release();
        q
    }

    /// Drops this handle's count, freeing the view at the last one.
    fn release(&mut self) {
        if self.inner().refs.fetch_sub(1, Ordering::Release) & COUNT != 1 {
            return;
        }
        // Pairs with the Release decrements of the other handles.
        fence(Ordering::Acquire);
        let raw = self.untagged();
        // SAFETY: the count reached 0: this was the last handle, so nothing
        // else can reach the block, and the view in it is dropped once, here.
        unsafe { std::ptr::drop_in_place(raw) };
        // SAFETY: `raw` is non-null (it came from a `NonNull`); the block is
        // unused from now on.
        pool::give(unsafe { NonNull::new_unchecked(raw) });
    }

    /// The common drop, inlined: no tracing, the view's last handle, no
    /// name to free, a storage, and room in this thread's pool slot. Then
    /// the view needs no atomic read-modify-write of its own (a count of 1
    /// is this handle's alone: no other handle exists to clone or drop
    /// concurrently) and its block goes to the slot as it is. Returns
    /// `false`, having changed nothing, in every other case.
    #[inline(always)]
    fn drop_fast(&mut self) -> bool {
        let raw = self.untagged();
        // SAFETY: as in `inner`.
        let inner = unsafe { &*raw };
        // Exactly 1 with tracing off (and never while it is on): the last
        // handle, and no flag, so no name and a storage. Acquire: see every
        // write other (now dropped) handles made before their Release
        // decrement.
        if inner.refs.load(Ordering::Acquire) != trace::untraced_last() {
            return false;
        }
        // SAFETY: `NO_STORAGE` is clear.
        let storage = unsafe { inner.view.storage.as_ref().unwrap_unchecked() };
        let storage: *const Storage = Arc::as_ptr(storage);
        // SAFETY: `raw` came from a `NonNull`.
        if !pool::give_to_slot(unsafe { NonNull::new_unchecked(raw) }) {
            return false;
        }
        // The view is gone: its name was `None`, its storage reference is
        // released below, and its other fields (counts, the coherency
        // enforcer) own nothing.
        // SAFETY: the view held one strong count of its storage, which is
        // ours to release now that the view is gone.
        unsafe { Arc::decrement_strong_count(storage) };
        true
    }

    /// Every other drop (see [`Tensor::drop_fast`]).
    #[cold]
    #[inline(never)]
    fn drop_general(&mut self) {
        // Only users' handles are traced.
        if trace::enabled() && !self.is_quiet() {
            self.release_traced();
        } else {
            self.release();
        }
    }

    /// [`crate::compat::TensorCompat::allocate`]: nrt's placements.
    pub(crate) fn allocate_placed(
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
        Self::with_storage(name, Storage::new_dma(device, channel, size)?)
    }

    /// [`Tensor::allocate_on`] for the library's own use: no trace events.
    pub(crate) fn allocate_internal(
        device: &Arc<Device>,
        channel: u32,
        size: usize,
        name: &str,
    ) -> Result<Tensor> {
        Ok(Self::with_storage(Some(name), Storage::new_dma(device, channel, size)?)?.into_quiet())
    }

    /// Allocates `size` zeroed bytes of aligned host memory (`Malloc`).
    pub fn allocate_host(size: usize, name: Option<&str>) -> Result<Tensor> {
        let _t = trace::scope(TraceOp::Alloc, name.unwrap_or(DEFAULT_NAME), size);
        Self::with_storage(name, Storage::new_malloc(size)?)
    }

    /// A size-only tensor (`Fake`): no bytes exist. Reads give zeros,
    /// writes are discarded, and it has no host address.
    pub fn allocate_fake(size: usize, name: Option<&str>) -> Result<Tensor> {
        let _t = trace::scope(TraceOp::Alloc, name.unwrap_or(DEFAULT_NAME), size);
        Self::with_storage(name, Storage::new_fake(size))
    }

    /// [`crate::compat::TensorCompat::allocate_empty`]: a tensor with no
    /// storage and size 0.
    pub(crate) fn empty(name: Option<&str>) -> Result<Tensor> {
        Self::new_view(name, None, 0, 0, (0, 0))
    }

    /// A tensor over a caller's buffer (`User` storage), never freed by the
    /// library.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `size` bytes for as long
    /// as any view of the new storage lives (slices included), and must not
    /// be accessed by other means while a tensor operation on it runs. A
    /// null `ptr` is allowed only with `size == 0`.
    pub unsafe fn from_user_buffer(
        ptr: *mut u8,
        size: usize,
        name: Option<&str>,
    ) -> Result<Tensor> {
        let mut t = Self::empty(name)?;
        // SAFETY: forwarded to our caller.
        unsafe { t.attach_user_buffer(ptr, size)? };
        Ok(t)
    }

    /// [`crate::compat::TensorCompat::attach_buffer`].
    ///
    /// # Safety
    /// As [`Tensor::from_user_buffer`].
    pub(crate) unsafe fn attach_user_buffer(&mut self, ptr: *mut u8, size: usize) -> Result<()> {
        if self.view_mut().is_none() {
            return Err(Error::SharedView(self.name().to_owned()));
        }
        // SAFETY: forwarded to our caller.
        let storage = unsafe { Storage::new_user(ptr, size)? };
        let view = self
            .view_mut()
            .ok_or_else(|| Error::SharedView(String::new()))?;
        view.storage = Some(storage);
        view.offset = 0;
        view.size = size;
        *view.completion.get_mut() = 0;
        *view.completion_epoch.get_mut() = 0;
        // The only handle: no one else reads the flags now.
        self.inner().refs.fetch_and(!NO_STORAGE, Ordering::Relaxed);
        Ok(())
    }

    /// A sub-view of `size` bytes at `offset` of this view, sharing its
    /// storage: a view block (reused from this thread's recently dropped
    /// views, so usually no allocation; one more for a name other than the
    /// default) and one atomic increment, no copy, no syscall. Offsets
    /// compose (a slice of a slice addresses the storage directly) and the
    /// range is checked against this view, not the storage. The slice's
    /// output-completion count starts at 0. This view may be dropped before
    /// the slice.
    ///
    /// For a `Dma` storage some job has written, learning the kernel's
    /// completion count for the new view's baseline costs one ioctl.
    ///
    /// ```
    /// use tdrv::Tensor;
    ///
    /// let whole = Tensor::allocate_host(1024, Some("whole"))?;
    /// let half = whole.slice(512, 512, Some("second half"))?;
    /// let quarter = half.slice(256, 256, None)?; // offsets compose
    /// assert_eq!(quarter.offset(), 768);
    /// quarter.write(0, &[7; 4])?;
    /// assert_eq!(whole.to_vec()?[768..772], [7; 4]);
    /// assert!(half.slice(256, 512, None).is_err()); // past the parent view
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    #[inline]
    pub fn slice(&self, offset: usize, size: usize, name: Option<&str>) -> Result<Tensor> {
        // The common case (a user's handle, no name, a storage no job has
        // counted, a block in this thread's pool slot) is inlined, where
        // the handle's tag is known to be clear; everything else, errors
        // included, takes the general path, which checks again in the
        // documented order.
        if name.is_none() && !self.is_quiet() {
            if let Some(t) = self.slice_fast(offset, size) {
                return Ok(t);
            }
        }
        self.slice_general(offset, size, name)
    }

    /// [`Tensor::slice`] without a name, when it needs neither an ioctl nor
    /// an allocation; `None` sends the caller to the general path.
    #[inline(always)]
    fn slice_fast(&self, offset: usize, size: usize) -> Option<Tensor> {
        let view = self.view();
        // `offset + size <= view.size`, without an overflow check.
        let room = view.size.checked_sub(size)?;
        if offset > room {
            return None;
        }
        let storage = view.storage.as_ref()?;
        if !storage.zero_baseline() {
            return None;
        }
        let block = pool::take()?;
        let b = block.as_ptr();
        // SAFETY: `block` is an unused block of `ViewInner`'s layout taken
        // out of the pool slot (which holds only blocks no handle points to
        // any more), with `refs` (1, no flag: unnamed, with a storage) and
        // `view.name` (`None`) written; this writes every other field.
        unsafe {
            ptr::addr_of_mut!((*b).view.storage).write(Some(Arc::clone(storage)));
            // Cannot overflow: offset + size <= view.size, and
            // view.offset + view.size <= storage.size.
            ptr::addr_of_mut!((*b).view.offset).write(view.offset + offset);
            ptr::addr_of_mut!((*b).view.size).write(size);
            // Baseline 0: a baseline of 0 is 0 at every reset epoch (see
            // `completion::effective_baseline`), so the epoch is not needed
            // either.
            ptr::addr_of_mut!((*b).view.completion).write(AtomicU64::new(0));
            ptr::addr_of_mut!((*b).view.completion_epoch).write(AtomicU64::new(0));
            ptr::addr_of_mut!((*b).view.coherency)
                .write(crate::coherency::CoherencyEnforcer::new());
        }
        Some(Tensor { ptr: block })
    }

    // Cold for the fast path's sake: the caller lays out the fast path as
    // the straight line.
    #[cold]
    #[inline(never)]
    fn slice_general(&self, offset: usize, size: usize, name: Option<&str>) -> Result<Tensor> {
        if name.is_none() && self.is_quiet() {
            // The library's own handles (the C ABI's lookups) slice often.
            if let Some(t) = self.slice_fast(offset, size) {
                return Ok(t);
            }
        }
        let storage = self.storage_for("slice")?;
        check_range("slice", offset, size, self.view().size)?;
        let baseline = match storage.dma() {
            Some(b) if !storage.zero_baseline() => {
                // Epoch first: a raw reset between the two reads then
                // shows as a newer epoch, which zeroes the baseline.
                let epoch = b.device.completion_epoch(b.handle);
                (b.device.buf_info(b.handle)?.completion_count, epoch)
            }
            _ => (0, epoch_of(storage)),
        };
        Self::new_view(
            name,
            Some(storage.clone()),
            self.view().offset + offset,
            size,
            baseline,
        )
    }

    /// The tensor's name.
    pub fn name(&self) -> &str {
        self.view().name.as_deref().unwrap_or(DEFAULT_NAME)
    }

    /// Size of the view in bytes.
    pub fn size(&self) -> usize {
        self.view().size
    }

    /// Offset of the view in its storage.
    pub fn offset(&self) -> usize {
        self.view().offset
    }

    /// The kind of storage, `None` for an empty tensor.
    pub fn kind(&self) -> Option<StorageKind> {
        self.view().storage.as_ref().map(|s| s.kind())
    }

    /// Size of the whole storage, `None` for an empty tensor.
    pub fn storage_size(&self) -> Option<usize> {
        self.view().storage.as_ref().map(|s| s.size)
    }

    /// Whether both tensors are views of the same storage.
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        match (&self.view().storage, &other.view().storage) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Whether both handles name the same view.
    pub fn same_view(&self, other: &Tensor) -> bool {
        std::ptr::eq(self.inner(), other.inner())
    }

    /// Handles to this view (the view refcount), the library's own
    /// included.
    pub fn view_ref_count(&self) -> usize {
        self.inner().refs.load(Ordering::Acquire) & COUNT
    }

    /// Views of this storage (the storage refcount); 0 for an empty tensor.
    pub fn storage_ref_count(&self) -> usize {
        self.view().storage.as_ref().map_or(0, Arc::strong_count)
    }

    /// Host address of the view's first byte: the host allocation (Malloc,
    /// User) or the buffer's mapping (Dma) plus the offset. `None` for Fake
    /// and empty tensors, and for Dma buffers the driver cannot map.
    ///
    /// Writing through it bypasses the fences: see
    /// [`TensorOps::wait_device_idle`](crate::ops::TensorOps::wait_device_idle).
    pub fn va(&self) -> Option<NonNull<u8>> {
        let base = self.view().storage.as_ref()?.host_base()?;
        // SAFETY: offset <= storage size (checked when the view was made),
        // so the result stays inside (or one past) the same allocation.
        Some(unsafe { base.add(self.view().offset) })
    }

    /// [`Tensor::va`] without mapping anything: also `None` for a `Dma`
    /// buffer that has no host mapping yet. For finding the tensor of an
    /// address among many (libnrt's `nrt_get_dmabuf_fd`): an address a
    /// caller holds came from a mapping that exists, and mapping every
    /// other buffer to compare would cost a mapping each.
    pub fn mapped_va(&self) -> Option<NonNull<u8>> {
        let st = self.view().storage.as_ref()?;
        let base = match st.dma() {
            Some(b) => NonNull::new(b.mapping.get()?.as_ptr())?,
            None => st.host_base()?,
        };
        // SAFETY: as in `va`: the offset stays inside the allocation.
        Some(unsafe { base.add(self.view().offset) })
    }

    /// Device (bus) address of the view's first byte; `Dma` only.
    /// [`Error::NoDmaAddress`] when the driver withholds bus addresses from
    /// this process (it reports them only to openers with
    /// `CAP_SYS_RAWIO`, and 0 to others).
    pub fn pa(&self) -> Result<u64> {
        let storage = self.storage_for("pa")?;
        let b = storage.dma().ok_or(Error::Unsupported {
            op: "pa",
            kind: storage.kind(),
        })?;
        if b.dma_addr == 0 {
            return Err(Error::NoDmaAddress { op: "pa" });
        }
        Ok(b.dma_addr + self.view().offset as u64)
    }

    /// HBM channel of a `Dma` tensor.
    pub fn channel(&self) -> Option<u32> {
        Some(self.view().storage.as_ref()?.dma()?.channel)
    }

    /// The device of a `Dma` tensor.
    pub fn device(&self) -> Option<&Arc<Device>> {
        Some(&self.view().storage.as_ref()?.dma()?.device)
    }

    /// The tdrv buffer handle of a `Dma` tensor, for callers that use the
    /// [`Device`] ioctls directly. Completion baselines stay right even if
    /// they submit jobs with it.
    pub fn dma_handle(&self) -> Option<u64> {
        let st = self.view().storage.as_ref()?;
        let b = st.dma()?;
        st.set_counted();
        // The handle may leave as a dma-buf (`Device::export`): an import
        // of it in this process must find this storage.
        if let Err(e) = st.share() {
            log_warn!("dma_handle: registering buffer {}: {e}", b.handle);
        }
        Some(b.handle)
    }

    /// Shares the tensor's device buffer as a dma-buf: a new fd (O_RDWR,
    /// close-on-exec) for the whole storage, whatever part of it this view
    /// covers (the view starts at [`Tensor::offset`] in it). The dma-buf is
    /// the same memory, fences and completion count, and outlives this
    /// tensor; pass it to another process (e.g. over a UNIX socket) and
    /// open it there with [`Tensor::from_dmabuf`], or give it to any
    /// dma-buf user that maps it with the CPU. [`Error::Unsupported`] for
    /// tensors that are not on a device.
    ///
    /// Others may write an exported buffer at any time, so from now on the
    /// safe [`Tensor::map_read`]/[`Tensor::map_write`] refuse it
    /// ([`Error::SharedBuffer`]; copies still work), and an export while a
    /// mapping guard lends the buffer is refused
    /// ([`crate::SysError::Pinned`]).
    ///
    /// ```no_run
    /// use tdrv::{Device, Tensor};
    ///
    /// let device = Device::open("/dev/tdrv0")?;
    /// let t = Tensor::allocate_on(&device, 0, 4096, Some("shared"))?;
    /// t.write(0, b"hello")?;
    /// let fd = t.export_dmabuf()?;
    /// // Here the same process; another one would receive `fd` first.
    /// let same = Tensor::from_dmabuf(&device, &fd)?;
    /// let mut buf = [0u8; 5];
    /// same.read(0, &mut buf)?;
    /// assert_eq!(&buf, b"hello");
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn export_dmabuf(&self) -> Result<std::os::fd::OwnedFd> {
        let storage = self.storage_for("export_dmabuf")?;
        let b = storage.dma().ok_or(Error::Unsupported {
            op: "export_dmabuf",
            kind: storage.kind(),
        })?;
        // Others may write the buffer from now on: completion baselines
        // must be asked for.
        storage.set_counted();
        // An import in this process resolves to this storage.
        storage.share()?;
        b.device.export(b.handle)
    }

    /// A tensor over the dma-buf `fd` on `device` (`Dma` storage, the
    /// whole dma-buf): a tdrv export of this device is the same buffer as
    /// the exporter's (no copy); a foreign dma-buf (e.g. from
    /// `/dev/dma_heap/system`) is placed on HBM channel 0. `fd` may be
    /// closed afterwards. See [`Tensor::from_dmabuf_on`] for the channel
    /// and name, and [`Tensor::export_dmabuf`] for an example.
    ///
    /// A buffer this process already holds (its own export, through any
    /// [`Device`] opened on the node) is not a second storage: the new
    /// tensor is a view of the existing one, so host accesses through both
    /// exclude each other as through two views of one tensor. Needs a
    /// driver that reports buffer identities (ABI 1.3,
    /// `TDRV_FEAT_BUF_ID`); older ones are [`Error::InvalidArgument`].
    pub fn from_dmabuf(device: &Arc<Device>, fd: impl std::os::fd::AsFd) -> Result<Tensor> {
        Self::from_dmabuf_on(device, 0, fd, None)
    }

    /// [`Tensor::from_dmabuf`] placing a foreign dma-buf on HBM `channel`
    /// (jobs need both tensors on one channel); a tdrv export keeps its
    /// own channel.
    ///
    /// ```no_run
    /// use tdrv::{Device, Tensor};
    ///
    /// let device = Device::open("/dev/tdrv0")?;
    /// let src = Tensor::allocate_on(&device, 1, 4096, None)?;
    /// let fd = src.export_dmabuf()?;
    /// let t = Tensor::from_dmabuf_on(&device, 1, &fd, Some("imported"))?;
    /// assert_eq!(t.channel(), Some(1));
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn from_dmabuf_on(
        device: &Arc<Device>,
        channel: u32,
        fd: impl std::os::fd::AsFd,
        name: Option<&str>,
    ) -> Result<Tensor> {
        let _t = trace::scope(TraceOp::Alloc, name.unwrap_or(DEFAULT_NAME), 0);
        let storage = Storage::from_dmabuf(device, channel, fd.as_fd())?;
        // Its completion count may be non-zero already: start the view's
        // baseline there, as a slice does.
        let baseline = match storage.dma() {
            Some(b) => {
                // Epoch first, as in `slice`.
                let epoch = b.device.completion_epoch(b.handle);
                (b.device.buf_info(b.handle)?.completion_count, epoch)
            }
            None => (0, 0),
        };
        let size = storage.size;
        Self::new_view(name, Some(storage), 0, size, baseline)
    }

    /// This view on another device without a copy: the tensor's buffer is
    /// exported as a dma-buf ([`Tensor::export_dmabuf`]) and imported on
    /// `device`, placed on its HBM `channel` (jobs there need both tensors
    /// on one channel), and the result views the same bytes (this view's
    /// offset and size in the import). Jobs on `device` read and write
    /// this tensor's memory, ordered with this device's jobs on it through
    /// the dma-buf's reservation object (ABI 1.5).
    ///
    /// On this tensor's own device the result is a view of the same
    /// storage (`channel` is ignored). From the first share on, both sides
    /// may be written by others: [`Tensor::map_read`] and
    /// [`Tensor::map_write`] refuse them ([`Error::SharedBuffer`]), while
    /// copies and jobs work.
    ///
    /// Errors: [`Error::Unsupported`] for a tensor not on a device;
    /// [`Error::Sys`] with `EOPNOTSUPP` for device memory that `device`
    /// cannot reach (the sim device's HBM, except peer-to-peer from an edu
    /// device below the same PCI bridge), `EINVAL` for a
    /// `channel` `device` does not have, or the driver's error (see
    /// `docs/sharing.md` for which devices share with which).
    ///
    /// ```no_run
    /// use tdrv::{Device, Tensor};
    ///
    /// let a = Device::open("/dev/tdrv0")?;
    /// let b = Device::open("/dev/tdrv1")?;
    /// let t = Tensor::allocate_on(&a, 0, 4096, Some("weights"))?;
    /// t.write(0, b"hello")?;
    /// let on_b = t.share_to(&b, 0)?;
    /// let mut buf = [0u8; 5];
    /// on_b.read(0, &mut buf)?;
    /// assert_eq!(&buf, b"hello");
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn share_to(&self, device: &Arc<Device>, channel: u32) -> Result<Tensor> {
        let fd = self.export_dmabuf()?;
        let whole = Tensor::from_dmabuf_on(device, channel, &fd, Some(self.name()))?;
        whole.slice(self.offset(), self.size(), Some(self.name()))
    }

    pub(crate) fn storage_for(&self, op: &'static str) -> Result<&Arc<Storage>> {
        self.view()
            .storage
            .as_ref()
            .ok_or_else(|| Error::NoStorage {
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
        check_range(op, offset, size, self.view().size)?;
        // Cannot overflow: view.offset + view.size <= storage.size.
        Ok((storage, self.view().offset + offset))
    }

    pub(crate) fn completion_cell(&self) -> &AtomicU64 {
        &self.view().completion
    }

    pub(crate) fn completion_epoch_cell(&self) -> &AtomicU64 {
        &self.view().completion_epoch
    }

    /// [`crate::accessor::TensorAccessors::coherency_enforcer`].
    pub(crate) fn enforcer(&self) -> &crate::coherency::CoherencyEnforcer {
        &self.view().coherency
    }
}

impl Clone for Tensor {
    /// Another handle to the same view; a user's handle (its drop is
    /// traced) even when cloned from one of the library's own.
    fn clone(&self) -> Self {
        self.counted(false)
    }
}

impl Tensor {
    /// A user's handle dropped while tracing: the seed's tensor_free, event
    /// 28 around dropping one view reference (and, if it was the last, the
    /// storage reference), with the seed's payload: the count before and
    /// the HBM index.
    #[cold]
    #[inline(never)]
    fn release_traced(&mut self) {
        let name = self.name().to_owned();
        let refs = (self.inner().refs.load(Ordering::Relaxed) & COUNT) as u64;
        let hbm = self.channel().map_or(-1, i64::from);
        let _t = trace::scope_with(TraceOp::Free, &name, self.view().size, refs, hbm);
        self.release();
    }
}

impl Drop for Tensor {
    #[inline(always)]
    fn drop(&mut self) {
        if !self.drop_fast() {
            self.drop_general();
        }
    }
}

const _: () = {
    // `drop_fast` drops a view by hand: these fields must own nothing.
    assert!(!std::mem::needs_drop::<AtomicU64>());
    assert!(!std::mem::needs_drop::<crate::coherency::CoherencyEnforcer>());
};

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

/// Bytes one view costs on the heap: the handle count plus the view.
pub const VIEW_HEAP_SIZE: usize = std::mem::size_of::<ViewInner>();

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compat::TensorCompat;
    use crate::ops::TensorOps;

    #[test]
    fn a_view_takes_at_most_96_bytes() {
        // Count and view together (issue 12: at most 96 B, with no heap
        // allocation per slice); the seed's view is 192 B.
        assert_eq!(std::mem::size_of::<Tensor>(), std::mem::size_of::<usize>());
        const { assert!(VIEW_HEAP_SIZE <= 96) };
    }

    #[test]
    fn slices_keep_every_semantic_on_the_fast_and_general_paths() {
        // The fast path takes user handles' unnamed slices with a block in
        // the pool slot; quiet parents, names, an empty slot, a counted
        // storage and errors take the general one. All must agree.
        let t = Tensor::allocate_host(256, Some("parent")).unwrap();
        let parent = t.slice(16, 128, Some("window")).unwrap();
        for quiet in [false, true] {
            let p = if quiet {
                parent.clone_quiet()
            } else {
                parent.clone()
            };
            for name in [None, Some("named"), Some(DEFAULT_NAME)] {
                for _ in 0..3 {
                    let s = p.slice(8, 64, name).unwrap();
                    assert_eq!((s.offset(), s.size()), (24, 64));
                    assert_eq!(s.name(), name.unwrap_or(DEFAULT_NAME));
                    assert_eq!(s.view_ref_count(), 1);
                    assert!(s.shares_storage_with(&t) && !s.same_view(&p));
                    assert_eq!(s.completion().count().unwrap(), 0);
                    let c = s.clone();
                    assert_eq!((s.view_ref_count(), c.view_ref_count()), (2, 2));
                    drop(s);
                    assert_eq!(
                        (c.view_ref_count(), c.name()),
                        (1, name.unwrap_or(DEFAULT_NAME))
                    );
                    // `t`, `parent` (whose clone `p` is) and `c`.
                    assert_eq!(t.storage_ref_count(), 3);
                }
                assert_eq!(t.storage_ref_count(), 2, "slices release the storage");
                // Errors, checked against the parent view, in order.
                assert!(matches!(
                    p.slice(65, 64, name),
                    Err(Error::OutOfBounds {
                        op: "slice",
                        offset: 65,
                        size: 64,
                        len: 128
                    })
                ));
                assert!(matches!(
                    p.slice(usize::MAX, 2, name),
                    Err(Error::Overflow {
                        op: "slice",
                        offset: usize::MAX,
                        size: 2
                    })
                ));
                assert!(matches!(
                    p.slice(0, usize::MAX, name),
                    Err(Error::OutOfBounds { .. })
                ));
                let empty = p.slice(128, 0, name).unwrap();
                assert_eq!((empty.offset(), empty.size()), (144, 0));
            }
        }
        let mut e = Tensor::allocate_empty(None).unwrap();
        assert_eq!(e.view_ref_count(), 1);
        assert!(matches!(
            e.slice(0, 0, None),
            Err(Error::NoStorage { op: "slice", .. })
        ));
        let mut buf = [0u8; 32];
        // SAFETY: `buf` outlives `e` and its slices and is not touched
        // otherwise meanwhile.
        unsafe { e.attach_buffer(buf.as_mut_ptr(), buf.len()).unwrap() };
        let s = e.slice(4, 4, None).unwrap();
        s.write(0, &[9; 4]).unwrap();
        assert_eq!((e.view_ref_count(), e.storage_ref_count()), (1, 2));
        drop((s, e));
        assert_eq!(buf[4..8], [9; 4]);
    }

    #[test]
    fn a_counted_storage_slices_with_its_kernel_baseline() {
        // Once a storage is counted, a slice asks the kernel for its
        // baseline (here a fake device: the ioctl fails, and says so)
        // instead of taking the fast path's 0.
        let t = Tensor::allocate_host(64, None).unwrap();
        let st = t.storage_for("t").unwrap();
        assert!(st.zero_baseline());
        st.set_counted();
        assert!(!st.zero_baseline());
        // Host storage: counted or not, the view's own count starts at 0.
        let s = t.slice(0, 8, None).unwrap();
        assert_eq!(s.completion().count().unwrap(), 0);
    }

    #[test]
    fn the_pool_keeps_at_most_its_capacity_and_frees_it_at_thread_exit() {
        let t = Tensor::allocate_host(4096, None).unwrap();
        std::thread::scope(|sc| {
            sc.spawn(|| {
                assert_eq!(pool::kept(), 0);
                let views: Vec<Tensor> = (0..3 * pool::CAPACITY)
                    .map(|i| t.slice(i, 1, None).unwrap())
                    .collect();
                drop(views);
                assert_eq!(pool::kept(), pool::CAPACITY);
                let again: Vec<Tensor> = (0..pool::CAPACITY - 1)
                    .map(|i| t.slice(i, 2, Some("n")).unwrap())
                    .collect();
                assert_eq!(pool::kept(), 1, "new views take kept blocks");
                drop(again);
                assert_eq!(pool::kept(), pool::CAPACITY);
                // Exiting frees them (Miri reports a leak otherwise).
            });
        });
        assert_eq!(t.storage_ref_count(), 1);
    }

    #[test]
    fn a_dropped_view_block_serves_the_next_view() {
        let t = Tensor::allocate_host(256, None).unwrap();
        let a = t.slice(0, 16, None).unwrap();
        let addr = a.inner() as *const ViewInner;
        drop(a);
        let b = t.slice(16, 16, None).unwrap();
        assert!(std::ptr::eq(b.inner(), addr), "the freed block is reused");
        assert_eq!((b.offset(), b.size()), (16, 16));
    }

    #[test]
    fn view_blocks_cross_threads_and_overflow_the_pool() {
        // Views made on one thread and dropped on others, more than a pool
        // holds: every block is reused or freed exactly once (Miri checks
        // for leaks, double frees and races).
        let t = Tensor::allocate_host(4096, None).unwrap();
        let views: Vec<Tensor> = (0..3 * pool::CAPACITY)
            .map(|i| t.slice(i, 1, None).unwrap())
            .collect();
        let mut it = views.into_iter();
        let halves: [Vec<Tensor>; 2] =
            [it.by_ref().take(pool::CAPACITY + 3).collect(), it.collect()];
        std::thread::scope(|s| {
            for half in halves {
                let t = &t;
                s.spawn(move || {
                    drop(half);
                    for i in 0..pool::CAPACITY {
                        let v = t.slice(i, 2, None).unwrap();
                        assert_eq!(v.offset(), i);
                    }
                });
            }
        });
        assert_eq!(t.storage_ref_count(), 1);
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
