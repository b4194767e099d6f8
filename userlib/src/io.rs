//! Host I/O on tensors: read, write, their batch forms, memset and copy.
//!
//! Every operation checks its ranges (with overflow checks) against the view
//! and returns an error instead of asserting like the original. Fake
//! storage makes them no-ops (after the checks).
//!
//! Fences, as in the seed: a read waits for in-flight device writes of the
//! storage, a write or memset for every in-flight device access. For host
//! storages those are the async marks ([`crate::Access`]); for `Dma`
//! storage the kernel's counters (`TDRV_IOC_FENCE_WAIT` before touching the
//! mapping; the COPY/MEMSET ioctls fence themselves).

use std::ptr::{self, NonNull};

use crate::error::{Error, Result};
use crate::fence::{HostAccess, Span};
use crate::storage::{Memory, Storage};
use crate::sys::{tdrv_copy_desc, FenceKind};
use crate::tensor::Tensor;
use crate::trace::{self, TraceOp};

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
    pub offset: usize,
    pub buf: &'a mut [u8],
}

/// One write of a batch: `buf` to `offset`.
#[derive(Debug, Clone, Copy)]
pub struct WriteOp<'a> {
    pub offset: usize,
    pub buf: &'a [u8],
}

/// Raw-pointer copy with the host side of the fences held.
///
/// # Safety
/// `src` and `dst` must be valid for `len` bytes; ranges inside storages
/// must be covered by a held [`HostAccess`] of the right direction.
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: forwarded; `ptr::copy` tolerates overlap (same storage).
    unsafe { ptr::copy(src, dst, len) }
}

/// Host address of absolute offset `abs` of a storage.
///
/// # Safety
/// `abs` must be at most the storage size.
unsafe fn at(base: NonNull<u8>, abs: usize) -> *mut u8 {
    // SAFETY: forwarded: stays within the allocation.
    unsafe { base.as_ptr().add(abs) }
}

/// Kernel fence of a Dma storage before host access through the mapping.
fn dma_fence(st: &Storage, kind: FenceKind, fencing: Fencing) -> Result<()> {
    match (st.dma(), fencing) {
        (Some(b), Fencing::Wait) => b.fence(kind),
        _ => Ok(()),
    }
}

fn host_read(st: &Storage, abs: usize, dst: &mut [u8], fencing: Fencing) -> Result<()> {
    match (&st.mem, st.host_base()) {
        (Memory::Fake, _) => Ok(()),
        (Memory::Dma(b), None) => Ok(b.device.copy_out(b.handle, abs as u64, dst)?),
        (_, Some(base)) => {
            let spans = [Span::read(abs, dst.len())];
            let _g = st.sync.acquire(&spans, fencing == Fencing::Wait);
            dma_fence(st, FenceKind::Writes, fencing)?;
            // SAFETY: abs + len <= storage size (checked by `locate`); the
            // read span is held, so no host write overlaps; `dst` is an
            // exclusive borrow outside any storage.
            unsafe { copy_bytes(at(base, abs), dst.as_mut_ptr(), dst.len()) };
            Ok(())
        }
        (_, None) => Ok(()),
    }
}

fn host_write(st: &Storage, abs: usize, src: &[u8], fencing: Fencing) -> Result<()> {
    match (&st.mem, st.host_base()) {
        (Memory::Fake, _) => Ok(()),
        (Memory::Dma(b), None) => Ok(b.device.copy_in(b.handle, abs as u64, src)?),
        (_, Some(base)) => {
            let spans = [Span::write(abs, src.len())];
            let _g = st.sync.acquire(&spans, fencing == Fencing::Wait);
            dma_fence(st, FenceKind::All, fencing)?;
            // SAFETY: in bounds (checked by `locate`); the write span is
            // held, so no other host access overlaps.
            unsafe { copy_bytes(src.as_ptr(), at(base, abs), src.len()) };
            Ok(())
        }
        (_, None) => Ok(()),
    }
}

impl Tensor {
    /// Reads `dst.len()` bytes at `offset` of the view into `dst`, after
    /// in-flight device writes.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let _t = trace::scope(TraceOp::Read, self.name(), dst.len());
        let (st, abs) = self.locate("read", offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        host_read(st, abs, dst, Fencing::Wait)
    }

    /// Writes `src` at `offset` of the view, after every in-flight device
    /// access.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        let _t = trace::scope(TraceOp::Write, self.name(), src.len());
        let (st, abs) = self.locate("write", offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        host_write(st, abs, src, Fencing::Wait)
    }

    /// The whole view as a vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        v.try_reserve_exact(self.size())
            .map_err(|_| Error::OutOfMemory(self.size()))?;
        v.resize(self.size(), 0);
        self.read(0, &mut v)?;
        Ok(v)
    }

    /// Several reads of this tensor, fenced once. Every range is checked
    /// before any byte moves.
    pub fn read_batch(&self, ops: &mut [ReadOp<'_>], fencing: Fencing) -> Result<()> {
        let total = ops
            .iter()
            .fold(0usize, |a, o| a.saturating_add(o.buf.len()));
        let _t = trace::scope(TraceOp::ReadBatch, self.name(), total);
        let mut spans = Vec::with_capacity(ops.len());
        let mut st = None;
        for o in ops.iter() {
            let (s, abs) = self.locate("read_batch", o.offset, o.buf.len())?;
            spans.push(Span::read(abs, o.buf.len()));
            st = Some(s);
        }
        let Some(st) = st else { return Ok(()) };
        match (&st.mem, st.host_base()) {
            (Memory::Dma(b), None) => {
                for (o, s) in ops.iter_mut().zip(&spans) {
                    b.device.copy_out(b.handle, s.start as u64, o.buf)?;
                }
                Ok(())
            }
            (Memory::Fake, _) | (_, None) => Ok(()),
            (_, Some(base)) => {
                let _g = st.sync.acquire(&spans, fencing == Fencing::Wait);
                dma_fence(st, FenceKind::Writes, fencing)?;
                for (o, s) in ops.iter_mut().zip(&spans) {
                    // SAFETY: each range was checked by `locate` and is
                    // covered by the held read spans.
                    unsafe { copy_bytes(at(base, s.start), o.buf.as_mut_ptr(), o.buf.len()) };
                }
                Ok(())
            }
        }
    }

    /// Several writes to this tensor, fenced once, applied in order. Every
    /// range is checked before any byte moves.
    pub fn write_batch(&self, ops: &[WriteOp<'_>], fencing: Fencing) -> Result<()> {
        let total = ops
            .iter()
            .fold(0usize, |a, o| a.saturating_add(o.buf.len()));
        let _t = trace::scope(TraceOp::WriteBatch, self.name(), total);
        let mut spans = Vec::with_capacity(ops.len());
        let mut st = None;
        for o in ops {
            let (s, abs) = self.locate("write_batch", o.offset, o.buf.len())?;
            spans.push(Span::write(abs, o.buf.len()));
            st = Some(s);
        }
        let Some(st) = st else { return Ok(()) };
        match (&st.mem, st.host_base()) {
            (Memory::Dma(b), None) => {
                for (o, s) in ops.iter().zip(&spans) {
                    b.device.copy_in(b.handle, s.start as u64, o.buf)?;
                }
                Ok(())
            }
            (Memory::Fake, _) | (_, None) => Ok(()),
            (_, Some(base)) => {
                let _g = st.sync.acquire(&spans, fencing == Fencing::Wait);
                dma_fence(st, FenceKind::All, fencing)?;
                for (o, s) in ops.iter().zip(&spans) {
                    // SAFETY: checked by `locate`, covered by the held write
                    // spans; `o.buf` is a borrow outside the storage (or, if
                    // the caller aliased the mapping, `ptr::copy` copes).
                    unsafe { copy_bytes(o.buf.as_ptr(), at(base, s.start), o.buf.len()) };
                }
                Ok(())
            }
        }
    }

    /// Fills `size` bytes at `offset` with `value`, after every in-flight
    /// device access (Dma: `TDRV_IOC_MEMSET`, fenced by the kernel).
    pub fn memset(&self, offset: usize, value: u8, size: usize) -> Result<()> {
        let _t = trace::scope(TraceOp::Memset, self.name(), size);
        let (st, abs) = self.locate("memset", offset, size)?;
        if size == 0 {
            return Ok(());
        }
        match (&st.mem, st.host_base()) {
            (Memory::Dma(b), _) => {
                // The kernel fences the device side; the span keeps host
                // copies through the mapping from overlapping it.
                let spans = [Span::write(abs, size)];
                let _g = st.sync.acquire(&spans, true);
                Ok(b.device.memset(b.handle, abs as u64, size as u64, value)?)
            }
            (Memory::Fake, _) | (_, None) => Ok(()),
            (_, Some(base)) => {
                let spans = [Span::write(abs, size)];
                let _g = st.sync.acquire(&spans, true);
                // SAFETY: checked by `locate`; the write span is held.
                unsafe { ptr::write_bytes(at(base, abs), value, size) };
                Ok(())
            }
        }
    }

    /// Copies `size` bytes from `src` at `src_offset` to `dst` at
    /// `dst_offset`.
    ///
    /// Two `Dma` tensors of one device use the device's copy
    /// (`TDRV_IOC_COPY`), and must be on the same HBM channel
    /// ([`Error::CrossChannel`] otherwise). Every other combination does the
    /// host round trip: a host-side memmove through the host addresses, or
    /// `COPY_IN`/`COPY_OUT` for unmapped buffers. Overlapping ranges of one
    /// storage are copied as by memmove. Fake on either side is a no-op.
    pub fn copy(
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
            (Memory::Fake, _) | (_, Memory::Fake) => Ok(()),
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
                    return host_copy(ss, sa, ds, da, size);
                }
                let src_span = [Span::read(sa, size)];
                let dst_span = [Span::write(da, size)];
                let both = [src_span[0], dst_span[0]];
                let _g = acquire_pair(ss, &src_span, ds, &dst_span, &both);
                Ok(a.device.copy(&tdrv_copy_desc {
                    src_handle: a.handle,
                    src_offset: sa as u64,
                    dst_handle: b.handle,
                    dst_offset: da as u64,
                    size: size as u64,
                })?)
            }
            _ => host_copy(ss, sa, ds, da, size),
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
) -> (HostAccess<'a>, Option<HostAccess<'a>>) {
    if ptr::eq(ss, ds) {
        return (ss.sync.acquire(both, true), None);
    }
    if (ss as *const Storage) < (ds as *const Storage) {
        let g1 = ss.sync.acquire(src, true);
        (g1, Some(ds.sync.acquire(dst, true)))
    } else {
        let g1 = ds.sync.acquire(dst, true);
        (g1, Some(ss.sync.acquire(src, true)))
    }
}

fn host_copy(ss: &Storage, sa: usize, ds: &Storage, da: usize, size: usize) -> Result<()> {
    let src_span = [Span::read(sa, size)];
    let dst_span = [Span::write(da, size)];
    let both = [src_span[0], dst_span[0]];
    match (ss.host_base(), ds.host_base()) {
        (Some(sp), Some(dp)) => {
            let _g = acquire_pair(ss, &src_span, ds, &dst_span, &both);
            let same = ptr::eq(ss, ds);
            dma_fence(
                ss,
                if same {
                    FenceKind::All
                } else {
                    FenceKind::Writes
                },
                Fencing::Wait,
            )?;
            if !same {
                dma_fence(ds, FenceKind::All, Fencing::Wait)?;
            }
            // SAFETY: both ranges were checked by `locate`; the source read
            // span and destination write span are held; `ptr::copy` allows
            // the ranges to overlap (one storage).
            unsafe { copy_bytes(at(sp, sa), at(dp, da), size) };
            Ok(())
        }
        (Some(sp), None) => {
            // Host memory into an unmapped device buffer.
            let Some(b) = ds.dma() else { return Ok(()) };
            let _g = ss.sync.acquire(&src_span, true);
            dma_fence(ss, FenceKind::Writes, Fencing::Wait)?;
            // SAFETY: in bounds (checked); the read span is held, so no host
            // write changes the bytes while the slice lives.
            let src = unsafe { std::slice::from_raw_parts(at(sp, sa), size) };
            Ok(b.device.copy_in(b.handle, da as u64, src)?)
        }
        (None, Some(dp)) => {
            // An unmapped device buffer into host memory.
            let Some(a) = ss.dma() else { return Ok(()) };
            let _g = ds.sync.acquire(&dst_span, true);
            dma_fence(ds, FenceKind::All, Fencing::Wait)?;
            // SAFETY: in bounds (checked); the write span is held, so no
            // other host access touches the bytes while the slice lives.
            let dst = unsafe { std::slice::from_raw_parts_mut(at(dp, da), size) };
            Ok(a.device.copy_out(a.handle, sa as u64, dst)?)
        }
        (None, None) => {
            // Two unmapped device buffers (different devices or overlap):
            // bounce through a host buffer.
            let (Some(a), Some(b)) = (ss.dma(), ds.dma()) else {
                return Ok(());
            };
            let mut tmp = Vec::new();
            tmp.try_reserve_exact(size)
                .map_err(|_| Error::OutOfMemory(size))?;
            tmp.resize(size, 0);
            a.device.copy_out(a.handle, sa as u64, &mut tmp)?;
            Ok(b.device.copy_in(b.handle, da as u64, &tmp)?)
        }
    }
}
