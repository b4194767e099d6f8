//! `neuron_memcpy`: how the staging accessors move bytes between a tensor
//! and local memory (seed 003, §6).
//!
//! Three methods, as in the original's dispatch table, chosen process-wide
//! at run time with [`neuron_set_memcpy_method`]:
//!
//! - [`NeuronMemcpyMethod::CMemcpy`]: a plain `memcpy` through the tensor's
//!   host mapping;
//! - [`NeuronMemcpyMethod::VecMemcpy`]: an explicitly vectorised copy
//!   through the mapping (AVX2 when the CPU has it, else SSE2; 16-byte
//!   words off x86_64);
//! - [`NeuronMemcpyMethod::Dma`] (the default): the device's copy engine.
//!   The transfer is one `TDRV_IOC_SUBMIT` copy descriptor between the
//!   tensor's tdrv buffer and a device-side staging buffer, then
//!   `TDRV_IOC_JOB_WAIT` for its end (the original built an SDMA ring).
//!
//! DMA needs both ends to be tdrv buffers of one device and one HBM channel:
//! a `Dma` tensor, and local memory made by [`LocalBuffer::staging_for`]
//! (the analogue of the original's TCM, which its DMA engine could reach).
//! Whenever that does not hold (a `Malloc` tensor, host local memory, a
//! device without asynchronous jobs) the copy falls back to `VecMemcpy`;
//! every call returns the method it really used.
//!
//! All methods keep the tensor layer's fences: a copy out of a tensor waits
//! for in-flight device writes of it, a copy into a tensor for every
//! in-flight device access, and the host byte ranges are held as in
//! [`Tensor::read`]/[`Tensor::write`]. A DMA write into a tensor counts as a
//! job completion of its buffer, like any job
//! ([`crate::TensorOps::completion`]).

mod kernels;

use std::alloc::Layout;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::fence::{HostAccess, Span};
use crate::io::hold_when_quiet;
use crate::log::{heartbeat_interval, log_warn};
use crate::storage::{DmaBuffer, Memory, Storage, HOST_ALIGN};
use crate::sys::{tdrv_copy_desc, Device, FenceKind, JobStatus, OwnedPin, SysError};
use crate::tensor::Tensor;
use crate::wait::Deadline;

/// How [`neuron_memcpy_from_tensor`] and [`neuron_memcpy_to_tensor`] move
/// bytes; the values are the seed's `NeuronMemcpyMethod`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NeuronMemcpyMethod {
    /// A plain copy through the mapping.
    CMemcpy = 0,
    /// A wide, vectorised copy through the mapping.
    VecMemcpy = 1,
    /// The device's copy engine (SUBMIT, then a wait), for `Dma` tensors.
    Dma = 2,
}

impl NeuronMemcpyMethod {
    /// The seed's enumerator names.
    pub const C_MEMCPY: Self = Self::CMemcpy;
    /// The seed's `VEC_MEMCPY`.
    pub const VEC_MEMCPY: Self = Self::VecMemcpy;
    /// The seed's `DMA`.
    pub const DMA: Self = Self::Dma;

    /// Every method, in value order.
    pub const ALL: [Self; 3] = [Self::CMemcpy, Self::VecMemcpy, Self::Dma];

    /// Decodes a raw value; `MAX_METHODS` and above give `None`.
    pub const fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            0 => Some(Self::CMemcpy),
            1 => Some(Self::VecMemcpy),
            2 => Some(Self::Dma),
            _ => None,
        }
    }
}

/// Number of methods (the seed's `MAX_METHODS`).
pub const MAX_METHODS: u32 = 3;
/// The method in force until [`neuron_set_memcpy_method`] is called.
pub const DEFAULT_METHOD: NeuronMemcpyMethod = NeuronMemcpyMethod::Dma;

static ACTIVE_METHOD: AtomicU32 = AtomicU32::new(DEFAULT_METHOD as u32);

/// Selects the method of every later staging copy in the process (the
/// seed's `active_neuron_memcpy_method`). Copies already running finish
/// with the method they started with.
pub fn neuron_set_memcpy_method(method: NeuronMemcpyMethod) {
    ACTIVE_METHOD.store(method as u32, Ordering::Relaxed);
}

/// The method in force.
pub fn neuron_get_memcpy_method() -> NeuronMemcpyMethod {
    NeuronMemcpyMethod::from_raw(ACTIVE_METHOD.load(Ordering::Relaxed)).unwrap_or(DEFAULT_METHOD)
}

/// Which CPU kernel `VecMemcpy` runs here (`"avx2"`, `"sse2"` or `"u128"`).
pub fn vec_memcpy_kernel() -> &'static str {
    kernels::vec_kernel_name()
}

/// Local memory a staging copy fills or drains: the original's TCM
/// scratch. Either aligned host memory, or a mapped tdrv buffer that the
/// device's copy engine can reach.
///
/// A device-backed buffer is pinned in its [`Device`] for its whole life,
/// as a [`Tensor::map_write`] guard pins its buffer: the raw calls that
/// write a buffer's bytes ([`Device::copy_in`], [`Device::memset`],
/// [`Device::copy`], [`Device::submit`]) refuse its handle with
/// [`SysError::Pinned`], even a handle found by probing
/// [`Device::buf_info`], and it cannot be exported. So the bytes that
/// [`LocalBuffer::as_slice`] lends change only through this buffer's own
/// `&mut self` copies.
pub struct LocalBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

enum Backing {
    /// `alloc_zeroed` memory with this layout (none for `len == 0`).
    Host(Option<Layout>),
    /// A private `Dma` tensor; `ptr` is its mapping. The pin is dropped
    /// first (fields drop in order), before the tensor frees the handle,
    /// so it never outlives the handle's buffer.
    Device { pin: OwnedPin, tensor: Tensor },
}

// SAFETY: the buffer owns its memory (a host allocation or a private,
// mapped tdrv buffer whose `Tensor` is Send + Sync, pinned against every
// other writer); the pointer is only dereferenced through `&self`/`&mut
// self` borrows of the buffer.
unsafe impl Send for LocalBuffer {}
// SAFETY: as above; shared borrows only read.
unsafe impl Sync for LocalBuffer {}

impl LocalBuffer {
    /// `len` zeroed bytes of host memory, aligned to [`HOST_ALIGN`].
    pub fn host(len: usize) -> Result<LocalBuffer> {
        if len == 0 {
            return Ok(LocalBuffer {
                ptr: NonNull::<[u8; HOST_ALIGN]>::dangling().cast(),
                len,
                backing: Backing::Host(None),
            });
        }
        let layout =
            Layout::from_size_align(len, HOST_ALIGN).map_err(|_| Error::OutOfMemory(len))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
            .ok_or(Error::OutOfMemory(len))?;
        Ok(LocalBuffer {
            ptr,
            len,
            backing: Backing::Host(Some(layout)),
        })
    }

    /// `len` (> 0) zeroed bytes in a mapped tdrv buffer on HBM `channel` of
    /// `device`, reachable by the device's copy engine, and pinned (see
    /// [`LocalBuffer`]). A write of the buffer that some other call of this
    /// file started (with a probed handle) before the pin is waited for;
    /// the bytes are then whatever it wrote.
    pub fn device(device: &Arc<Device>, channel: u32, len: usize) -> Result<LocalBuffer> {
        const OP: &str = "device staging buffer";
        let tensor = Tensor::allocate_internal(device, channel, len, "neuron_memcpy staging")?;
        let (st, _) = tensor.locate(OP, 0, len)?;
        let b = st.dma().ok_or(Error::Unsupported {
            op: OP,
            kind: st.kind(),
        })?;
        // From here on no raw call can start a write of the buffer, nor
        // export it ...
        let pin = device.pin_owned(b.handle)?;
        // ... one exported meanwhile could be written by another process ...
        if device.is_shared(b.handle) {
            return Err(Error::SharedBuffer { op: OP });
        }
        // ... and device accesses already in flight are waited for.
        b.fence(FenceKind::All)?;
        let ptr = tensor.va().ok_or(Error::Unsupported {
            op: "device staging buffer without a mapping",
            kind: crate::StorageKind::Dma,
        })?;
        Ok(LocalBuffer {
            ptr,
            len,
            backing: Backing::Device { pin, tensor },
        })
    }

    /// Staging memory for copies to and from `tensor`: a device buffer next
    /// to it when the active method is DMA and the engine can reach the
    /// tensor, host memory otherwise (also when the device buffer cannot be
    /// had: DMA then falls back to a CPU copy).
    pub fn staging_for(tensor: &Tensor, len: usize) -> Result<LocalBuffer> {
        if len > 0 && neuron_get_memcpy_method() == NeuronMemcpyMethod::Dma {
            if let (Some(dev), Some(ch)) = (dma_engine(tensor), tensor.channel()) {
                if let Ok(b) = LocalBuffer::device(dev, ch, len) {
                    return Ok(b);
                }
            }
        }
        LocalBuffer::host(len)
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the buffer is device memory the copy engine can reach.
    pub fn is_device(&self) -> bool {
        matches!(self.backing, Backing::Device { .. })
    }

    /// Address of byte 0.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Address of byte 0, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid, initialised (zeroed at allocation, or
        // written by a device write waited for in `device`) memory of `len`
        // bytes owned by `self`. Host memory is reached by no one else. A
        // device buffer is pinned for `self`'s life, so no raw call of any
        // thread can write it (COPY_IN, MEMSET, COPY and SUBMIT refuse a
        // pinned destination, EXPORT a pinned buffer; the tensor is private,
        // so no other view, guard or accessor exists); the only writes are
        // this buffer's own copies, which take `&mut self` and wait for
        // their job to end before returning.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn device_parts(&self) -> Option<(&Tensor, &OwnedPin)> {
        match &self.backing {
            Backing::Device { pin, tensor } => Some((tensor, pin)),
            Backing::Host(_) => None,
        }
    }
}

impl Drop for LocalBuffer {
    fn drop(&mut self) {
        if let Backing::Host(Some(layout)) = self.backing {
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` and is freed
            // only here. (Device buffers are freed by their tensor.)
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl std::fmt::Debug for LocalBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBuffer")
            .field("len", &self.len)
            .field("device", &self.is_device())
            .finish()
    }
}

/// The device whose copy engine can serve `tensor`: a mapped `Dma` tensor
/// on a device that runs asynchronous jobs.
fn dma_engine(tensor: &Tensor) -> Option<&Arc<Device>> {
    let dev = tensor.device()?;
    let feats = u64::from(tdrv_uapi::TDRV_FEAT_SUBMIT) | u64::from(tdrv_uapi::TDRV_FEAT_MMAP);
    dev.has_features(feats).then_some(dev)
}

/// Direction of a staging copy.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// Tensor (HBM) to local: the seed's `neuron_memcpy(void*, uint64_t, n)`.
    FromTensor,
    /// Local to tensor: `neuron_memcpy(uint64_t, void*, n)`.
    ToTensor,
}

/// The local end of a copy: `len` bytes at `ptr`, and the device buffer
/// they live in, if any (with its pin and the offset of `ptr` in it).
struct Local<'a> {
    ptr: *mut u8,
    len: usize,
    device: Option<(&'a Tensor, &'a OwnedPin, usize)>,
}

/// Copies `len` bytes at `src_offset` of `src` into `dst` at `dst_offset`
/// with the active method (HBM to local). Returns the method used.
pub fn neuron_memcpy_from_tensor(
    dst: &mut LocalBuffer,
    dst_offset: usize,
    src: &Tensor,
    src_offset: usize,
    len: usize,
) -> Result<NeuronMemcpyMethod> {
    neuron_memcpy_from_tensor_with(
        neuron_get_memcpy_method(),
        dst,
        dst_offset,
        src,
        src_offset,
        len,
    )
}

/// [`neuron_memcpy_from_tensor`] with an explicit method.
pub fn neuron_memcpy_from_tensor_with(
    method: NeuronMemcpyMethod,
    dst: &mut LocalBuffer,
    dst_offset: usize,
    src: &Tensor,
    src_offset: usize,
    len: usize,
) -> Result<NeuronMemcpyMethod> {
    let local = local_range(dst, dst_offset, len, "neuron_memcpy (destination)")?;
    transfer(method, Dir::FromTensor, src, src_offset, local)
}

/// Copies `len` bytes at `src_offset` of `src` into `dst` at `dst_offset`
/// with the active method (local to HBM). Returns the method used.
pub fn neuron_memcpy_to_tensor(
    dst: &Tensor,
    dst_offset: usize,
    src: &LocalBuffer,
    src_offset: usize,
    len: usize,
) -> Result<NeuronMemcpyMethod> {
    neuron_memcpy_to_tensor_with(
        neuron_get_memcpy_method(),
        dst,
        dst_offset,
        src,
        src_offset,
        len,
    )
}

/// [`neuron_memcpy_to_tensor`] with an explicit method.
pub fn neuron_memcpy_to_tensor_with(
    method: NeuronMemcpyMethod,
    dst: &Tensor,
    dst_offset: usize,
    src: &LocalBuffer,
    src_offset: usize,
    len: usize,
) -> Result<NeuronMemcpyMethod> {
    // The local side is only read: `local_range` takes `&LocalBuffer` and
    // the pointer is used as a source.
    let local = local_range(src, src_offset, len, "neuron_memcpy (source)")?;
    transfer(method, Dir::ToTensor, dst, dst_offset, local)
}

/// Reads `dst.len()` bytes at `src_offset` of `src` into host memory with
/// the active method (DMA falls back: host memory is out of its reach).
pub fn neuron_memcpy_read(
    dst: &mut [u8],
    src: &Tensor,
    src_offset: usize,
) -> Result<NeuronMemcpyMethod> {
    neuron_memcpy_read_with(neuron_get_memcpy_method(), dst, src, src_offset)
}

/// [`neuron_memcpy_read`] with an explicit method.
pub fn neuron_memcpy_read_with(
    method: NeuronMemcpyMethod,
    dst: &mut [u8],
    src: &Tensor,
    src_offset: usize,
) -> Result<NeuronMemcpyMethod> {
    let local = Local {
        ptr: dst.as_mut_ptr(),
        len: dst.len(),
        device: None,
    };
    transfer(method, Dir::FromTensor, src, src_offset, local)
}

/// Writes `src` at `dst_offset` of `dst` with the active method (DMA falls
/// back: host memory is out of its reach).
pub fn neuron_memcpy_write(
    dst: &Tensor,
    dst_offset: usize,
    src: &[u8],
) -> Result<NeuronMemcpyMethod> {
    neuron_memcpy_write_with(neuron_get_memcpy_method(), dst, dst_offset, src)
}

/// [`neuron_memcpy_write`] with an explicit method.
pub fn neuron_memcpy_write_with(
    method: NeuronMemcpyMethod,
    dst: &Tensor,
    dst_offset: usize,
    src: &[u8],
) -> Result<NeuronMemcpyMethod> {
    let local = Local {
        // Only read from in the ToTensor direction.
        ptr: src.as_ptr().cast_mut(),
        len: src.len(),
        device: None,
    };
    transfer(method, Dir::ToTensor, dst, dst_offset, local)
}

fn local_range<'a>(
    buf: &'a LocalBuffer,
    offset: usize,
    len: usize,
    op: &'static str,
) -> Result<Local<'a>> {
    let end = offset.checked_add(len).ok_or(Error::Overflow {
        op,
        offset,
        size: len,
    })?;
    if end > buf.len {
        return Err(Error::OutOfBounds {
            op,
            offset,
            size: len,
            len: buf.len,
        });
    }
    Ok(Local {
        // SAFETY: offset <= len of the allocation (checked above).
        ptr: unsafe { buf.ptr.as_ptr().add(offset) },
        len,
        device: buf.device_parts().map(|(t, pin)| (t, pin, offset)),
    })
}

/// Moves `local.len` bytes between `tensor` at `offset` and `local`.
fn transfer(
    method: NeuronMemcpyMethod,
    dir: Dir,
    tensor: &Tensor,
    offset: usize,
    local: Local<'_>,
) -> Result<NeuronMemcpyMethod> {
    let op = match dir {
        Dir::FromTensor => "neuron_memcpy (source)",
        Dir::ToTensor => "neuron_memcpy (destination)",
    };
    let (st, abs) = tensor.locate(op, offset, local.len)?;
    if method == NeuronMemcpyMethod::Dma {
        if let (Some(buf), Some((staging, pin, soff))) = (st.dma(), local.device) {
            if dma_engine(tensor).is_some() {
                let (ls, labs) = staging.locate(op, soff, local.len)?;
                if let Some(lbuf) = ls.dma() {
                    if Arc::ptr_eq(&buf.device, &lbuf.device) && buf.channel == lbuf.channel {
                        if local.len > 0 {
                            dma_copy(dir, (st, buf, abs), (ls, lbuf, labs), pin, local.len)?;
                        }
                        return Ok(NeuronMemcpyMethod::Dma);
                    }
                }
            }
        }
    }
    let method = match method {
        NeuronMemcpyMethod::Dma => NeuronMemcpyMethod::VecMemcpy,
        m => m,
    };
    if local.len > 0 {
        cpu_copy(method, dir, st, abs, &local)?;
    }
    Ok(method)
}

/// A CPU copy through the tensor's host mapping, fenced like
/// `Tensor::read`/`Tensor::write`.
fn cpu_copy(
    method: NeuronMemcpyMethod,
    dir: Dir,
    st: &Storage,
    abs: usize,
    local: &Local<'_>,
) -> Result<()> {
    let len = local.len;
    let base = match (&st.mem, st.host_base()) {
        // Size-only storage: it reads as zeros and discards writes (as the
        // tensor I/O does).
        (Memory::Fake, _) => {
            if dir == Dir::FromTensor {
                // SAFETY: `local` is `len` writable bytes (a checked range
                // of a LocalBuffer or an exclusive slice) that no one else
                // touches during the call.
                unsafe { std::ptr::write_bytes(local.ptr, 0, len) };
            }
            return Ok(());
        }
        (Memory::Dma(b), None) => {
            // Not mappable: only the driver can reach the bytes.
            match dir {
                // SAFETY: `local` is `len` writable bytes (a checked range of
                // a LocalBuffer or an exclusive slice) that no one else
                // touches during the call.
                Dir::FromTensor => unsafe {
                    b.device
                        .copy_out_raw(b.handle, abs as u64, local.ptr, len)?
                },
                // SAFETY: `local` is `len` readable bytes, borrowed shared.
                Dir::ToTensor => unsafe {
                    b.device.copy_in_raw(b.handle, abs as u64, local.ptr, len)?
                },
            }
            return Ok(());
        }
        (_, Some(base)) => base,
        (_, None) => return Ok(()),
    };
    let span = match dir {
        Dir::FromTensor => [Span::read(abs, len)],
        Dir::ToTensor => [Span::write(abs, len)],
    };
    let kind = match dir {
        Dir::FromTensor => FenceKind::Writes,
        Dir::ToTensor => FenceKind::All,
    };
    // The span is taken once the device is done, not held while waiting.
    let _held = hold_when_quiet(
        Deadline::Never,
        |d| st.dma().map_or(Ok(true), |b| b.fence_until(kind, d)),
        |d| st.sync.acquire_until("neuron_memcpy", &span, true, d),
    )?;
    // SAFETY: `abs + len` is inside the storage (checked by `locate`).
    let hbm = unsafe { base.as_ptr().add(abs) };
    let (dst, src) = match dir {
        Dir::FromTensor => (local.ptr, hbm.cast_const()),
        Dir::ToTensor => (hbm, local.ptr.cast_const()),
    };
    // SAFETY: both ranges are `len` bytes and valid (checked above / by
    // the caller). They do not overlap: the local side is a LocalBuffer or
    // a borrowed slice, distinct from the storage unless a caller aliased
    // the mapping itself, which `&mut`/`&` borrows of the mapping plus the
    // held span rule out for safe code.
    unsafe {
        match method {
            NeuronMemcpyMethod::CMemcpy => kernels::c_memcpy(dst, src, len),
            _ => kernels::vec_memcpy(dst, src, len),
        }
    }
    Ok(())
}

/// One DMA transfer between the tensor's buffer and a staging buffer of the
/// same device and channel: SUBMIT a single copy descriptor and wait for
/// the job. The host ranges of both are held meanwhile, so host copies
/// through the mappings do not overlap the engine's. `pin` is the staging
/// buffer's: a copy into it (`FromTensor`, called with the `LocalBuffer`
/// borrowed `&mut`) is its owner's write, which the pin lets through.
fn dma_copy(
    dir: Dir,
    (ts, tbuf, tabs): (&Storage, &DmaBuffer, usize),
    (ls, lbuf, labs): (&Storage, &DmaBuffer, usize),
    pin: &OwnedPin,
    len: usize,
) -> Result<()> {
    let (tspan, lspan, fence, desc) = match dir {
        Dir::FromTensor => (
            [Span::read(tabs, len)],
            [Span::write(labs, len)],
            FenceKind::Writes,
            tdrv_copy_desc {
                src_handle: tbuf.handle,
                src_offset: tabs as u64,
                dst_handle: lbuf.handle,
                dst_offset: labs as u64,
                size: len as u64,
            },
        ),
        Dir::ToTensor => (
            [Span::write(tabs, len)],
            [Span::read(labs, len)],
            FenceKind::All,
            tdrv_copy_desc {
                src_handle: lbuf.handle,
                src_offset: labs as u64,
                dst_handle: tbuf.handle,
                dst_offset: tabs as u64,
                size: len as u64,
            },
        ),
    };
    // A job makes no promise of ordering against jobs queued before it, so
    // wait out the tensor's conflicting in-flight accesses first, as a host
    // copy would; before the spans are taken, which are then held only
    // while this copy's own job runs.
    let _held = hold_when_quiet(
        Deadline::Never,
        |d| tbuf.fence_until(fence, d),
        |_| hold_both(ts, &tspan, ls, &lspan).map(Some),
    )?;
    // The job will bump the destination's completion count: tell the view
    // layer, which otherwise assumes a never-counted buffer is at 0.
    let dst = if dir == Dir::ToTensor { ts } else { ls };
    dst.set_counted();
    debug_assert_eq!(pin.handle(), lbuf.handle);
    let id = tbuf.device.submit_as_owner(&[desc], pin)?;
    // Waited for to the end, whatever it takes: the job may write the
    // staging buffer, whose bytes are lent as references again once this
    // returns.
    wait_job(&tbuf.device, id)
}

/// Holds two span sets, in address order of the storages so that two
/// opposite transfers cannot deadlock (the order `Tensor::copy` uses).
fn hold_both<'a>(
    a: &'a Storage,
    sa: &'a [Span],
    b: &'a Storage,
    sb: &'a [Span],
) -> Result<(HostAccess<'a>, HostAccess<'a>)> {
    const OP: &str = "neuron_memcpy";
    if ptr::from_ref(a) <= ptr::from_ref(b) {
        let first = a.sync.acquire(OP, sa, true)?;
        Ok((first, b.sync.acquire(OP, sb, true)?))
    } else {
        let first = b.sync.acquire(OP, sb, true)?;
        Ok((first, a.sync.acquire(OP, sa, true)?))
    }
}

/// Waits without limit for a job of this file to end, logging a heartbeat
/// every heartbeat interval while it runs.
fn wait_job(device: &Device, id: u64) -> Result<()> {
    loop {
        match device.job_wait_sys(id, Deadline::Never.remaining_us(Some(heartbeat_interval()))) {
            Ok(JobStatus::Done) => return Ok(()),
            Ok(JobStatus::Failed(errno)) => return Err(Error::JobFailed { job_id: id, errno }),
            Ok(JobStatus::Pending) | Err(SysError::TimedOut { .. }) => {
                log_warn!("neuron_memcpy: still waiting for DMA job {id}");
            }
            Err(SysError::Interrupted { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests;
