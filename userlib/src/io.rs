//! Host I/O on tensors: read, write, their batch forms; and the code of
//! the fill and copy operations ([`crate::ops::TensorOps`]).
//!
//! Every operation checks its ranges (with overflow checks) against the view
//! and returns an error instead of asserting like the original. Fake
//! storage has no bytes: after the checks, reads from it (and copies from
//! it) fill the destination with zeros, and writes, memsets and copies into
//! it discard their bytes. (The seed's read left the caller's buffer as it
//! was, so a caller saw whatever it held before: zeros are defined.)
//!
//! Fences, as in the seed: a read waits for in-flight device writes of the
//! storage, a write or memset for every in-flight device access. For host
//! storages those are the async marks ([`crate::Access`]); for `Dma`
//! storage the kernel's counters (`TDRV_IOC_FENCE_WAIT` before touching the
//! mapping; the COPY/MEMSET ioctls fence themselves).

use std::ptr::{self, NonNull};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::fence::{HostAccess, Span};
use crate::storage::{DmaBuffer, Memory, Storage};
use crate::sys::{tdrv_copy_desc, FenceKind, SysError};
use crate::tensor::Tensor;
use crate::trace::{self, TraceOp};
use crate::wait::Deadline;

/// Whether an operation waits for in-flight device accesses first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fencing {
    /// Wait, as the single-op calls always do.
    #[default]
    Wait,
    /// Skip the wait: the caller knows no device access is in flight (nrt's
    /// `unsafe` batch flag). Overlapping host accesses still exclude each
    /// other.
    Skip,
}

/// One read of a batch: `buf.len()` bytes at `offset` into `buf`.
#[derive(Debug)]
pub struct ReadOp<'a> {
    /// Offset in the view.
    pub offset: usize,
    /// Where the bytes go.
    pub buf: &'a mut [u8],
}

/// One write of a batch: `buf` to `offset`.
#[derive(Debug, Clone, Copy)]
pub struct WriteOp<'a> {
    /// Offset in the view.
    pub offset: usize,
    /// The bytes.
    pub buf: &'a [u8],
}

/// One read of a batch into memory given by address, for callers (the C
/// ABI) that must not make Rust references out of their callers' buffers.
#[derive(Debug, Clone, Copy)]
pub struct RawReadOp {
    /// Offset in the view.
    pub offset: usize,
    /// Destination address.
    pub dst: *mut u8,
    /// Bytes to read.
    pub len: usize,
}

/// One write of a batch from memory given by address.
#[derive(Debug, Clone, Copy)]
pub struct RawWriteOp {
    /// Offset in the view.
    pub offset: usize,
    /// Source address.
    pub src: *const u8,
    /// Bytes to write.
    pub len: usize,
}

/// Host address of absolute offset `abs` of a storage.
///
/// # Safety
/// `abs` must be at most the storage size.
unsafe fn at(base: NonNull<u8>, abs: usize) -> *mut u8 {
    // SAFETY: forwarded: stays within the allocation.
    unsafe { base.as_ptr().add(abs) }
}

/// Kernel fence of a Dma storage before host access through the mapping,
/// and its error latch (see [`Error::DeviceWriteFailed`]).
///
/// `Ok(false)`: the bytes may be accessed through the mapping. A read
/// (`FenceKind::Writes` of a source) of a latched buffer is
/// `DeviceWriteFailed`: its bytes are stale. A write (`FenceKind::All`) of
/// a latched buffer is `Ok(true)`: the caller must write through the kernel
/// (COPY_IN), which waits for the device itself and clears the latch, as a
/// write through the mapping would leave the latch set. With
/// `Fencing::Skip` the latch is read with BUF_INFO, so skipping the fence
/// never skips the check.
fn dma_fence(
    st: &Storage,
    name: &str,
    op: &'static str,
    kind: FenceKind,
    fencing: Fencing,
) -> Result<bool> {
    dma_fence_until(st, name, op, kind, fencing, Deadline::Never).map(|l| l.unwrap_or(false))
}

/// [`dma_fence`] that gives up at `deadline`: `Ok(None)`.
fn dma_fence_until(
    st: &Storage,
    name: &str,
    op: &'static str,
    kind: FenceKind,
    fencing: Fencing,
    deadline: Deadline,
) -> Result<Option<bool>> {
    let Some(b) = st.dma() else {
        return Ok(Some(false));
    };
    let r = match fencing {
        Fencing::Wait => match b.fence_until(kind, deadline) {
            Ok(true) => Ok(()),
            Ok(false) => return Ok(None),
            Err(e) => Err(e),
        },
        Fencing::Skip => match b.device.buf_info(b.handle) {
            Ok(info) if info.error != 0 => Err(Error::Sys(SysError::from_errno(op, libc::EIO))),
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        },
    };
    match r {
        Ok(()) => Ok(Some(false)),
        Err(Error::Sys(e)) if e.errno() == libc::EIO && kind == FenceKind::All => Ok(Some(true)),
        Err(Error::Sys(e)) => Err(latch_error(op, name, b, e)),
        Err(e) => Err(e),
    }
}

/// The error of a failed ioctl on buffer `b` of tensor `name`: EIO from a
/// read, fence or completion wait is the buffer's error latch, reported
/// with the errno the failed job ended with ([`Error::DeviceWriteFailed`]).
pub(crate) fn latch_error(op: &'static str, name: &str, b: &DmaBuffer, e: SysError) -> Error {
    if e.errno() != libc::EIO {
        return e.into();
    }
    let errno = match b.device.buf_info(b.handle) {
        Ok(info) if info.error < 0 => -info.error,
        _ => libc::EIO,
    };
    log::debug!(
        "{op}: tensor {name:?}: buffer {} holds a failed job's error {errno}",
        b.handle
    );
    Error::DeviceWriteFailed {
        op,
        name: name.to_owned(),
        errno,
    }
}

/// COPY_IN of `len` bytes at `src` to `abs` of a mapped buffer `b` whose
/// mapping starts at `base` (`size` bytes): the write path of a latched
/// buffer. A source inside the mapping itself is bounced through the heap,
/// so the kernel never faults the buffer's own pages during its copy.
///
/// # Safety
/// `src` is valid for reads of `len` bytes and not written meanwhile.
unsafe fn copy_in_latched(
    b: &DmaBuffer,
    base: NonNull<u8>,
    size: usize,
    abs: usize,
    src: *const u8,
    len: usize,
) -> Result<()> {
    let start = base.as_ptr().addr();
    let overlaps =
        src.addr() < start.saturating_add(size) && start < src.addr().saturating_add(len);
    if !overlaps {
        // SAFETY: forwarded from our caller.
        return Ok(unsafe { b.device.copy_in_raw(b.handle, abs as u64, src, len) }?);
    }
    let mut tmp: Vec<u8> = try_vec(len)?;
    // SAFETY: `src` is valid for `len` bytes (our contract) and `tmp` has
    // that capacity; `ptr::copy` allows the source to be anywhere.
    unsafe {
        ptr::copy(src, tmp.as_mut_ptr(), len);
        tmp.set_len(len);
    }
    b.device.copy_in(b.handle, abs as u64, &tmp)
}

/// Holds host spans (`hold`) once the device accesses that `quiet` waits
/// for have ended, both until `deadline` (`Ok(None)` when it passes, with
/// nothing held). The spans are not held while the device is waited for:
/// a plain copy that held them meanwhile would keep every overlapping host
/// access (a mapping guard, a bounded wait) waiting as long as the device,
/// without limit. Once they are held, `quiet` is asked again without
/// waiting; a device access that started in between lets them go and
/// starts over.
pub(crate) fn hold_when_quiet<G>(
    deadline: Deadline,
    mut quiet: impl FnMut(Deadline) -> Result<bool>,
    mut hold: impl FnMut(Deadline) -> Result<Option<G>>,
) -> Result<Option<G>> {
    loop {
        if !quiet(deadline)? {
            return Ok(None);
        }
        let Some(g) = hold(deadline)? else {
            return Ok(None);
        };
        if quiet(Deadline::Poll)? {
            return Ok(Some(g));
        }
        drop(g);
    }
}

/// Waits (without limit, with heartbeats) for the kernel fence `kind` of a
/// `Dma` storage before host spans are held: `quiet` of
/// [`hold_when_quiet`]. A latched buffer (EIO) counts as quiet: the
/// operation that follows reports or clears the latch itself.
fn device_quiet(st: &Storage, kind: FenceKind, d: Deadline) -> Result<bool> {
    let Some(b) = st.dma() else { return Ok(true) };
    match b.fence_until(kind, d) {
        Err(Error::Sys(e)) if e.errno() == libc::EIO => Ok(true),
        r => r,
    }
}

/// Direction of a host transfer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// Tensor to caller memory.
    Read,
    /// Caller memory to tensor.
    Write,
}

/// One checked op: absolute offset in the storage, caller address, length.
type Checked = (usize, *mut u8, usize);

fn try_vec<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| Error::OutOfMemory(n.saturating_mul(std::mem::size_of::<T>())))?;
    Ok(v)
}

impl Tensor {
    /// The one host transfer path of read, write and their batch forms.
    /// Checks every op first, then holds every span at once (so a conflict
    /// with an open accessor fails the whole call before any byte moves),
    /// fences once and copies through raw pointers.
    ///
    /// # Safety
    /// Each op's caller address is valid for `len` bytes in the direction
    /// of `dir` (reads of the source, writes of the destination), and no
    /// other thread writes (or, for `Dir::Read`, accesses) that memory
    /// during the call. Caller memory may overlap itself or the tensor.
    unsafe fn transfer(
        &self,
        op: &'static str,
        dir: Dir,
        ops: &mut dyn ExactSizeIterator<Item = (usize, *mut u8, usize)>,
        fencing: Fencing,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let deadline = Deadline::from_timeout(timeout);
        let timed_out = || Error::Timeout {
            op,
            name: self.name().to_owned(),
            waited: timeout.unwrap_or_default(),
        };
        // One op (read, write) needs no heap: the arrays below; a batch
        // gets vectors.
        let many = ops.len() > 1;
        let mut one: ([Checked; 1], [Span; 1]) = ([(0, ptr::null_mut(), 0)], [Span::read(0, 0)]);
        let (mut checked, mut spans): (Vec<Checked>, Vec<Span>) = if many {
            (try_vec(ops.len())?, try_vec(ops.len())?)
        } else {
            (Vec::new(), Vec::new())
        };
        let mut st = None;
        for (offset, ptr, len) in ops {
            let (s, abs) = self.locate(op, offset, len)?;
            if len == 0 {
                continue;
            }
            if ptr.is_null() {
                return Err(Error::invalid(format!("{op}: NULL buffer of {len} bytes")));
            }
            let span = match dir {
                Dir::Read => Span::read(abs, len),
                Dir::Write => Span::write(abs, len),
            };
            if many {
                checked.push((abs, ptr, len));
                spans.push(span);
            } else {
                one = ([(abs, ptr, len)], [span]);
            }
            st = Some(s);
        }
        let Some(st) = st else { return Ok(()) };
        let (checked, spans): (&[Checked], &[Span]) = if many {
            (&checked, &spans)
        } else {
            (&one.0, &one.1)
        };
        match (&st.mem, st.host_base()) {
            (Memory::Fake, _) => {
                if dir == Dir::Read {
                    for &(_, ptr, len) in checked {
                        // SAFETY: `ptr` is valid for writes of `len` bytes
                        // and not accessed by others (our contract).
                        unsafe { ptr::write_bytes(ptr, 0, len) };
                    }
                }
                Ok(())
            }
            (Memory::Dma(b), None) => {
                // Unmapped: the kernel copies, and fences itself, without
                // a limit or a heartbeat: wait for the fence here first.
                if fencing == Fencing::Wait {
                    let kind = match dir {
                        Dir::Read => FenceKind::Writes,
                        Dir::Write => FenceKind::All,
                    };
                    match b.fence_until(kind, deadline) {
                        Ok(true) => {}
                        Ok(false) => return Err(timed_out()),
                        Err(Error::Sys(e)) if dir == Dir::Read => {
                            return Err(latch_error(op, self.name(), b, e))
                        }
                        // A latched buffer is written by COPY_IN below.
                        Err(Error::Sys(e)) if e.errno() == libc::EIO => {}
                        Err(e) => return Err(e),
                    }
                }
                // A failing op stops the batch (see DESIGN.md, batches).
                for &(abs, ptr, len) in checked {
                    // SAFETY: `ptr` is valid for `len` bytes per our
                    // contract; the kernel accesses it with copy_*_user.
                    unsafe {
                        match dir {
                            Dir::Read => b
                                .device
                                .copy_out_raw(b.handle, abs as u64, ptr, len)
                                .map_err(|e| latch_error(op, self.name(), b, e))?,
                            Dir::Write => b.device.copy_in_raw(b.handle, abs as u64, ptr, len)?,
                        }
                    }
                }
                Ok(())
            }
            (_, None) => Ok(()),
            (_, Some(base)) => {
                let kind = match dir {
                    Dir::Read => FenceKind::Writes,
                    Dir::Write => FenceKind::All,
                };
                let mut latched = false;
                let Some(_g) = hold_when_quiet(
                    deadline,
                    |d| {
                        Ok(dma_fence_until(st, self.name(), op, kind, fencing, d)?
                            .map(|l| latched = l)
                            .is_some())
                    },
                    |d| {
                        st.sync
                            .acquire_until(op, spans, fencing == Fencing::Wait, d)
                    },
                )?
                else {
                    return Err(timed_out());
                };
                if latched {
                    // A latched buffer is written through the kernel.
                    let Some(b) = st.dma() else { return Ok(()) };
                    for &(abs, ptr, len) in checked {
                        // SAFETY: `ptr` is valid for reads of `len` bytes
                        // per our contract (this is `Dir::Write`: only
                        // `FenceKind::All` reports a latched buffer).
                        unsafe { copy_in_latched(b, base, st.size, abs, ptr, len)? };
                    }
                    return Ok(());
                }
                for &(abs, ptr, len) in checked {
                    // SAFETY: `abs + len` is inside the storage (`locate`);
                    // the spans held exclude every other host access that
                    // conflicts (plain copies and accessors alike); the
                    // caller's memory is valid per our contract; `ptr::copy`
                    // is a memmove, so caller memory may overlap the tensor.
                    unsafe {
                        match dir {
                            Dir::Read => ptr::copy(at(base, abs), ptr, len),
                            Dir::Write => ptr::copy(ptr, at(base, abs), len),
                        }
                    }
                }
                Ok(())
            }
        }
    }

    /// Reads `dst.len()` bytes at `offset` of the view into `dst`, after
    /// in-flight device writes.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        // SAFETY: `dst` is an exclusive borrow of `dst.len()` bytes.
        unsafe { self.read_raw(offset, dst.as_mut_ptr(), dst.len()) }
    }

    /// [`Tensor::read`] into memory given by address.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes (it may be null when
    /// `len` is 0) and no other thread may access those bytes during the
    /// call. They may overlap the tensor's own memory.
    pub unsafe fn read_raw(&self, offset: usize, dst: *mut u8, len: usize) -> Result<()> {
        let _t = trace::scope(TraceOp::Read, self.name(), len);
        let mut ops = std::iter::once((offset, dst, len));
        // SAFETY: forwarded to our caller.
        unsafe { self.transfer("read", Dir::Read, &mut ops, Fencing::Wait, None) }
    }

    /// Writes `src` at `offset` of the view, after every in-flight device
    /// access.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        // SAFETY: `src` is a shared borrow: valid and unchanged meanwhile.
        unsafe { self.write_raw(offset, src.as_ptr(), src.len()) }
    }

    /// [`Tensor::write`] from memory given by address.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes (it may be null when
    /// `len` is 0) and no other thread may write those bytes during the
    /// call. They may overlap the tensor's own memory.
    pub unsafe fn write_raw(&self, offset: usize, src: *const u8, len: usize) -> Result<()> {
        let _t = trace::scope(TraceOp::Write, self.name(), len);
        let mut ops = std::iter::once((offset, src.cast_mut(), len));
        // SAFETY: forwarded to our caller; the memory is only read.
        unsafe { self.transfer("write", Dir::Write, &mut ops, Fencing::Wait, None) }
    }

    /// [`Tensor::read`] that waits at most `timeout` for the in-flight
    /// device writes and overlapping host copies it must wait for
    /// ([`Error::Timeout`] then, with nothing read). `read` itself waits
    /// without limit and logs a warning every heartbeat interval
    /// ([`crate::set_heartbeat_interval`], 30 s by default) while it does.
    pub fn read_timeout(&self, offset: usize, dst: &mut [u8], timeout: Duration) -> Result<()> {
        let _t = trace::scope(TraceOp::Read, self.name(), dst.len());
        let mut ops = std::iter::once((offset, dst.as_mut_ptr(), dst.len()));
        // SAFETY: `dst` is an exclusive borrow of `dst.len()` bytes.
        unsafe { self.transfer("read", Dir::Read, &mut ops, Fencing::Wait, Some(timeout)) }
    }

    /// [`Tensor::write`] that waits at most `timeout` for every in-flight
    /// device access and overlapping host copy ([`Error::Timeout`] then,
    /// with nothing written). See [`Tensor::read_timeout`].
    pub fn write_timeout(&self, offset: usize, src: &[u8], timeout: Duration) -> Result<()> {
        let _t = trace::scope(TraceOp::Write, self.name(), src.len());
        let mut ops = std::iter::once((offset, src.as_ptr().cast_mut(), src.len()));
        // SAFETY: `src` is a shared borrow: valid and unchanged meanwhile;
        // it is only read.
        unsafe { self.transfer("write", Dir::Write, &mut ops, Fencing::Wait, Some(timeout)) }
    }

    /// The whole view as a vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = try_vec(self.size())?;
        v.resize(self.size(), 0);
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// Reads `dst.len()` elements of type `T` at byte `offset` of the view
    /// (any alignment), after in-flight device writes. `T` is any
    /// [`bytemuck::Pod`] type: numbers, [`half::f16`], [`half::bf16`],
    /// arrays and `Pod` structs.
    ///
    /// ```
    /// use tdrv::Tensor;
    ///
    /// let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0])?.into_tensor();
    /// let mut two = [0f32; 2];
    /// t.read_into(8, &mut two)?; // bytes 8..16: elements 2 and 3
    /// assert_eq!(two, [3.0, 4.0]);
    /// t.write_from(0, &[half::f16::from_f32(0.5); 2])?;
    /// assert_eq!(t.to_vec_of::<half::f16>()?[..2], [half::f16::from_f32(0.5); 2]);
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn read_into<T: bytemuck::Pod>(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        self.read(offset, bytemuck::cast_slice_mut(dst))
    }

    /// Writes the elements of `src` at byte `offset` of the view, after
    /// every in-flight device access. See [`Tensor::read_into`].
    pub fn write_from<T: bytemuck::Pod>(&self, offset: usize, src: &[T]) -> Result<()> {
        self.write(offset, bytemuck::cast_slice(src))
    }

    /// The whole view as a vector of `T`; its size must be a multiple of
    /// `size_of::<T>()` ([`Error::InvalidArgument`] otherwise, and for
    /// zero-sized `T`).
    pub fn to_vec_of<T: bytemuck::Pod>(&self) -> Result<Vec<T>> {
        let each = std::mem::size_of::<T>();
        if each == 0 || self.size() % each != 0 {
            return Err(Error::invalid(format!(
                "to_vec_of: tensor {:?} has {} bytes, not a whole number of {}-byte {}",
                self.name(),
                self.size(),
                each,
                std::any::type_name::<T>()
            )));
        }
        let n = self.size() / each;
        let mut v: Vec<T> = try_vec(n)?;
        v.resize(n, T::zeroed());
        self.read_into(0, &mut v)?;
        Ok(v)
    }

    /// Several reads of this tensor, fenced once. Every range is checked,
    /// and every byte range held, before any byte moves.
    pub fn read_batch(&self, ops: &mut [ReadOp<'_>], fencing: Fencing) -> Result<()> {
        let total = ops
            .iter()
            .fold(0usize, |a, o| a.saturating_add(o.buf.len()));
        let _t = trace::scope(TraceOp::ReadBatch, self.name(), total);
        let mut it = ops
            .iter_mut()
            .map(|o| (o.offset, o.buf.as_mut_ptr(), o.buf.len()));
        // SAFETY: every buffer is an exclusive borrow of its length.
        unsafe { self.transfer("read_batch", Dir::Read, &mut it, fencing, None) }
    }

    /// [`Tensor::read_batch`] into memory given by address.
    ///
    /// # Safety
    /// Every `dst` must be valid for writes of its `len` bytes, and no other
    /// thread may access them during the call. Destinations may overlap
    /// each other (later ops win) and the tensor.
    pub unsafe fn read_batch_raw(&self, ops: &[RawReadOp], fencing: Fencing) -> Result<()> {
        let total = ops.iter().fold(0usize, |a, o| a.saturating_add(o.len));
        let _t = trace::scope(TraceOp::ReadBatch, self.name(), total);
        let mut it = ops.iter().map(|o| (o.offset, o.dst, o.len));
        // SAFETY: forwarded to our caller.
        unsafe { self.transfer("read_batch", Dir::Read, &mut it, fencing, None) }
    }

    /// Several writes to this tensor, fenced once, applied in order. Every
    /// range is checked, and every byte range held, before any byte moves.
    pub fn write_batch(&self, ops: &[WriteOp<'_>], fencing: Fencing) -> Result<()> {
        let total = ops
            .iter()
            .fold(0usize, |a, o| a.saturating_add(o.buf.len()));
        let _t = trace::scope(TraceOp::WriteBatch, self.name(), total);
        let mut it = ops
            .iter()
            .map(|o| (o.offset, o.buf.as_ptr().cast_mut(), o.buf.len()));
        // SAFETY: every buffer is a shared borrow, only read.
        unsafe { self.transfer("write_batch", Dir::Write, &mut it, fencing, None) }
    }

    /// [`Tensor::write_batch`] from memory given by address.
    ///
    /// # Safety
    /// Every `src` must be valid for reads of its `len` bytes, and no other
    /// thread may write them during the call. Sources may overlap each
    /// other and the tensor.
    pub unsafe fn write_batch_raw(&self, ops: &[RawWriteOp], fencing: Fencing) -> Result<()> {
        let total = ops.iter().fold(0usize, |a, o| a.saturating_add(o.len));
        let _t = trace::scope(TraceOp::WriteBatch, self.name(), total);
        let mut it = ops.iter().map(|o| (o.offset, o.src.cast_mut(), o.len));
        // SAFETY: forwarded to our caller; sources are only read.
        unsafe { self.transfer("write_batch", Dir::Write, &mut it, fencing, None) }
    }

    /// [`crate::ops::TensorOps::memset`].
    pub(crate) fn fill(&self, offset: usize, value: u8, size: usize) -> Result<()> {
        let _t = trace::scope(TraceOp::Memset, self.name(), size);
        let (st, abs) = self.locate("memset", offset, size)?;
        if size == 0 {
            return Ok(());
        }
        match (&st.mem, st.host_base()) {
            (Memory::Dma(b), _) => {
                // The kernel fences the device side; the span keeps host
                // copies through the mapping from overlapping it. It is
                // taken once the device is done with the buffer, so that
                // it is not held while MEMSET waits for the device.
                let spans = [Span::write(abs, size)];
                let _g = hold_when_quiet(
                    Deadline::Never,
                    |d| device_quiet(st, FenceKind::All, d),
                    |d| st.sync.acquire_until("memset", &spans, true, d),
                )?;
                Ok(b.device.memset(b.handle, abs as u64, size as u64, value)?)
            }
            (Memory::Fake, _) | (_, None) => Ok(()),
            (_, Some(base)) => {
                let spans = [Span::write(abs, size)];
                let _g = st.sync.acquire("memset", &spans, true)?;
                // SAFETY: checked by `locate`; the write span is held.
                unsafe { ptr::write_bytes(at(base, abs), value, size) };
                Ok(())
            }
        }
    }

    /// [`crate::ops::TensorOps::copy`].
    pub(crate) fn copy_bytes(
        src: &Tensor,
        src_offset: usize,
        dst: &Tensor,
        dst_offset: usize,
        size: usize,
    ) -> Result<()> {
        let _t = trace::scope(TraceOp::Copy, dst.name(), size);
        let (ss, sa) = src.locate("copy (source)", src_offset, size)?;
        let (ds, da) = dst.locate("copy (destination)", dst_offset, size)?;
        if size == 0 {
            return Ok(());
        }
        match (&ss.mem, &ds.mem) {
            (_, Memory::Fake) => Ok(()),
            (Memory::Fake, _) => dst.fill(dst_offset, 0, size),
            (Memory::Dma(a), Memory::Dma(b)) if std::sync::Arc::ptr_eq(&a.device, &b.device) => {
                if a.channel != b.channel {
                    return Err(Error::CrossChannel {
                        src: a.channel,
                        dst: b.channel,
                    });
                }
                let overlap = a.handle == b.handle && sa < da + size && da < sa + size;
                if overlap {
                    // The kernel's copy makes no promise for overlapping
                    // ranges of one buffer: use memmove semantics here.
                    return host_copy((src, ss, sa), (dst, ds, da), size);
                }
                let src_span = [Span::read(sa, size)];
                let dst_span = [Span::write(da, size)];
                let both = [src_span[0], dst_span[0]];
                // As in `memset`: the spans are taken once the device is
                // done with both buffers, not held while COPY waits.
                let _g = hold_when_quiet(
                    Deadline::Never,
                    |d| {
                        Ok(device_quiet(ss, FenceKind::Writes, d)?
                            && device_quiet(ds, FenceKind::All, d)?)
                    },
                    |_| acquire_pair(ss, &src_span, ds, &dst_span, &both).map(Some),
                )?;
                a.device
                    .copy_sys(&tdrv_copy_desc {
                        src_handle: a.handle,
                        src_offset: sa as u64,
                        dst_handle: b.handle,
                        dst_offset: da as u64,
                        size: size as u64,
                    })
                    .map_err(|e| latch_error("copy", src.name(), a, e))
            }
            _ => host_copy((src, ss, sa), (dst, ds, da), size),
        }
    }
}

/// Holds the source read span and the destination write span, taking them
/// in one step for one storage and in address order for two (so that two
/// opposite copies cannot deadlock).
fn acquire_pair<'a>(
    ss: &'a Storage,
    src: &'a [Span; 1],
    ds: &'a Storage,
    dst: &'a [Span; 1],
    both: &'a [Span; 2],
) -> Result<(HostAccess<'a>, Option<HostAccess<'a>>)> {
    const OP: &str = "copy";
    if ptr::eq(ss, ds) {
        return Ok((ss.sync.acquire(OP, both, true)?, None));
    }
    if (ss as *const Storage) < (ds as *const Storage) {
        let g1 = ss.sync.acquire(OP, src, true)?;
        Ok((g1, Some(ds.sync.acquire(OP, dst, true)?)))
    } else {
        let g1 = ds.sync.acquire(OP, dst, true)?;
        Ok((g1, Some(ss.sync.acquire(OP, src, true)?)))
    }
}

fn host_copy(
    (src, ss, sa): (&Tensor, &Storage, usize),
    (dst, ds, da): (&Tensor, &Storage, usize),
    size: usize,
) -> Result<()> {
    const OP: &str = "copy";
    let src_span = [Span::read(sa, size)];
    let dst_span = [Span::write(da, size)];
    let both = [src_span[0], dst_span[0]];
    match (ss.host_base(), ds.host_base()) {
        (Some(sp), Some(dp)) => {
            let _g = hold_when_quiet(
                Deadline::Never,
                |d| {
                    Ok(device_quiet(ss, FenceKind::Writes, d)?
                        && device_quiet(ds, FenceKind::All, d)?)
                },
                |_| acquire_pair(ss, &src_span, ds, &dst_span, &both).map(Some),
            )?;
            // One storage: a latched buffer fails as the source first.
            dma_fence(ss, src.name(), OP, FenceKind::Writes, Fencing::Wait)?;
            if dma_fence(ds, dst.name(), OP, FenceKind::All, Fencing::Wait)? {
                if let Some(b) = ds.dma() {
                    // SAFETY: the source range was checked by `locate` and
                    // its read span is held: valid and unchanged.
                    return unsafe { copy_in_latched(b, dp, ds.size, da, at(sp, sa), size) };
                }
            }
            // SAFETY: both ranges were checked by `locate`; the source read
            // span and destination write span are held; `ptr::copy` allows
            // the ranges to overlap (one storage).
            unsafe { ptr::copy(at(sp, sa), at(dp, da), size) };
            Ok(())
        }
        (Some(sp), None) => {
            // Host memory into an unmapped device buffer.
            let Some(b) = ds.dma() else { return Ok(()) };
            let _g = hold_when_quiet(
                Deadline::Never,
                |d| device_quiet(ss, FenceKind::Writes, d),
                |d| ss.sync.acquire_until(OP, &src_span, true, d),
            )?;
            dma_fence(ss, src.name(), OP, FenceKind::Writes, Fencing::Wait)?;
            // SAFETY: in bounds (checked); the read span is held, so no host
            // write changes the bytes during the call.
            Ok(unsafe { b.device.copy_in_raw(b.handle, da as u64, at(sp, sa), size) }?)
        }
        (None, Some(dp)) => {
            // An unmapped device buffer into host memory.
            let Some(a) = ss.dma() else { return Ok(()) };
            let _g = hold_when_quiet(
                Deadline::Never,
                |d| device_quiet(ds, FenceKind::All, d),
                |d| ds.sync.acquire_until(OP, &dst_span, true, d),
            )?;
            // Host storage: never latched.
            dma_fence(ds, dst.name(), OP, FenceKind::All, Fencing::Wait)?;
            // SAFETY: in bounds (checked); the write span is held, so no
            // other host access touches the bytes during the call.
            unsafe { a.device.copy_out_raw(a.handle, sa as u64, at(dp, da), size) }
                .map_err(|e| latch_error(OP, src.name(), a, e))
        }
        (None, None) => {
            // Two unmapped device buffers (different devices or overlap):
            // bounce through a host buffer.
            let (Some(a), Some(b)) = (ss.dma(), ds.dma()) else {
                return Ok(());
            };
            let mut tmp = try_vec(size)?;
            tmp.resize(size, 0);
            a.device
                .copy_out_sys(a.handle, sa as u64, &mut tmp)
                .map_err(|e| latch_error(OP, src.name(), a, e))?;
            Ok(b.device.copy_in(b.handle, da as u64, &tmp)?)
        }
    }
}
