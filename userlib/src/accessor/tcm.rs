//! [`TensorTcmAccessor`]: explicit staging between a tensor and a scratch
//! ("TCM") buffer (the seed's `TensorTcmAccessor.h`).

use std::marker::PhantomData;
use std::mem::{align_of, size_of};
use std::ops::{Deref, DerefMut};

use super::{staged_kind, AccessorError, Element, Mode, ReadOnly, ReadWrite, Result};
use crate::coherency::{AccessorKind, Admission, CoherenceSlot};
use crate::memcpy::{
    neuron_memcpy_from_tensor, neuron_memcpy_read, neuron_memcpy_to_tensor, neuron_memcpy_write,
    LocalBuffer,
};
use crate::storage::HOST_ALIGN;
use crate::tensor::Tensor;

/// Copies between a tensor and caller-owned scratch memory, at element
/// offsets the caller picks; every copy is done when the call returns.
///
/// **Tracked as an unbuffered accessor, unlike the original.** The shipped
/// `tcm_accessor()` passes no enforcer, so a TCM accessor is invisible to
/// the coherence checks, although `Coherence.h` itself names it as an
/// unbuffered accessor. We count it, as an unbuffered one, because that is
/// what it is:
/// - it keeps no hidden copy of the tensor: each transfer finishes inside
///   the call, so the tensor's memory is up to date whenever the caller has
///   control, which is the unbuffered contract (the scratch buffer is the
///   caller's own data, like a value loaded through [`super::TensorAccessor`]);
/// - it touches the tensor's memory directly, at moments only the caller
///   knows, so it is incoherent with the buffered streams: a buffered
///   reader would go on serving staged bytes that a `tcm_to_tensor` just
///   replaced, and a buffered writer's later flush would silently overwrite
///   them (or a `tensor_to_tcm` would miss its unflushed data). Left
///   untracked, those lost updates would pass even under COHERENT, which is
///   the very thing the enforcer exists to catch.
///
/// So it coexists with other unbuffered accessors (TCM or indexed) and is
/// refused next to any stream.
///
/// Offsets and counts are in elements of `T`, from the view's first byte.
///
/// ```
/// use tdrv::accessor::TensorAccessors;
/// use tdrv::Tensor;
///
/// let mut t = Tensor::allocate_host(64, None)?;
/// let mut tcm = t.tcm_accessor_mut()?;
/// let mut scratch = tcm.alloc_tcm::<u32>(4)?;
/// scratch.copy_from_slice(&[1, 2, 3, 4]);
/// tcm.tcm_to_tensor(&scratch, 8, 4)?; // elements 8..12 of the tensor
/// let mut back = [0u32; 2];
/// tcm.tensor_to_slice(&mut back, 9)?;
/// assert_eq!(back, [2, 3]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct TensorTcmAccessor<'a, M: Mode = ReadOnly> {
    slot: CoherenceSlot<'a>,
    tensor: &'a Tensor,
    _m: PhantomData<M>,
}

/// Scratch memory for a [`TensorTcmAccessor`] (the seed's `tcm_malloc`):
/// `len` zeroed elements of `T`, in device memory next to the tensor when
/// DMA can serve it, in host memory otherwise.
pub struct TcmBuffer<T: Element> {
    buf: LocalBuffer,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> TcmBuffer<T> {
    /// Whether the scratch is device memory the DMA engine can reach.
    pub fn is_device(&self) -> bool {
        self.buf.is_device()
    }
}

impl<T: Element> Deref for TcmBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: the buffer holds `len * size_of::<T>()` initialised bytes
        // (zeroed when allocated), aligned to HOST_ALIGN or a page, which is
        // at least `align_of::<T>()` (checked at allocation); any bytes are a
        // valid `T`. Nothing else writes it while `&self` is borrowed: a
        // device scratch is pinned for its life (`LocalBuffer::as_slice`
        // says how), and the accessor's copies into it take `&mut`.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Element> DerefMut for TcmBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr().cast::<T>(), self.len) }
    }
}

/// The bytes of a slice of elements.
fn bytes_of<T: Element>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// The bytes of a slice of elements, for writing.
fn bytes_of_mut<T: Element>(v: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

impl<'a> TensorTcmAccessor<'a, ReadOnly> {
    /// A read-only TCM accessor.
    pub fn new(tensor: &'a Tensor) -> Result<Self> {
        Self::make(tensor)
    }
}

impl<'a> TensorTcmAccessor<'a, ReadWrite> {
    /// A read-write TCM accessor.
    pub fn new_mut(tensor: &'a mut Tensor) -> Result<Self> {
        Self::make(tensor)
    }

    /// Copies `n` elements from the start of `tcm` to the tensor at element
    /// `offset` (the seed's `tcm_to_tensor`, TCM to HBM).
    pub fn tcm_to_tensor<T: Element>(
        &mut self,
        tcm: &TcmBuffer<T>,
        offset: usize,
        n: usize,
    ) -> Result<()> {
        let (at, bytes) = self.range::<T>("tcm_to_tensor", offset, n, tcm.len)?;
        neuron_memcpy_to_tensor(self.tensor, at, &tcm.buf, 0, bytes)?;
        Ok(())
    }

    /// Copies `src` to the tensor at element `offset`, from plain host
    /// memory (no DMA: the engine cannot reach it).
    pub fn slice_to_tensor<T: Element>(&mut self, src: &[T], offset: usize) -> Result<()> {
        let (at, _) = self.range::<T>("slice_to_tensor", offset, src.len(), src.len())?;
        neuron_memcpy_write(self.tensor, at, bytes_of(src))?;
        Ok(())
    }
}

impl<'a, M: Mode> TensorTcmAccessor<'a, M> {
    fn make(tensor: &'a Tensor) -> Result<Self> {
        staged_kind(tensor, "tcm_accessor")?;
        let slot = tensor.enforcer().slot(AccessorKind::Unbuffered)?;
        Ok(TensorTcmAccessor {
            slot,
            tensor,
            _m: PhantomData,
        })
    }

    /// Allocates scratch for `n` elements of `T` (the seed's `tcm_malloc`).
    pub fn alloc_tcm<T: Element>(&self, n: usize) -> Result<TcmBuffer<T>> {
        let size = size_of::<T>();
        if size == 0 || align_of::<T>() > HOST_ALIGN {
            return Err(AccessorError::BadElement {
                op: "alloc_tcm",
                size,
            }
            .into());
        }
        let bytes = n
            .checked_mul(size)
            .ok_or(crate::Error::OutOfMemory(usize::MAX))?;
        Ok(TcmBuffer {
            buf: LocalBuffer::staging_for(self.tensor, bytes)?,
            len: n,
            _t: PhantomData,
        })
    }

    /// Byte offset and length of elements `[offset, offset + n)` of the
    /// tensor, checked against it and against `avail` scratch elements.
    fn range<T: Element>(
        &self,
        op: &'static str,
        offset: usize,
        n: usize,
        avail: usize,
    ) -> Result<(usize, usize)> {
        let size = size_of::<T>();
        if size == 0 {
            return Err(AccessorError::BadElement { op, size }.into());
        }
        let len = self.tensor.size() / size;
        let out = |len| AccessorError::RangeOutOfBounds {
            op,
            offset,
            count: n,
            len,
        };
        if n > avail {
            return Err(out(avail).into());
        }
        match offset.checked_add(n) {
            Some(end) if end <= len => Ok((offset * size, n * size)),
            _ => Err(out(len).into()),
        }
    }

    /// Copies `n` elements of the tensor at element `offset` to the start of
    /// `tcm` (the seed's `tensor_to_tcm`, HBM to TCM).
    pub fn tensor_to_tcm<T: Element>(
        &self,
        tcm: &mut TcmBuffer<T>,
        offset: usize,
        n: usize,
    ) -> Result<()> {
        let (at, bytes) = self.range::<T>("tensor_to_tcm", offset, n, tcm.len)?;
        neuron_memcpy_from_tensor(&mut tcm.buf, 0, self.tensor, at, bytes)?;
        Ok(())
    }

    /// Copies `dst.len()` elements of the tensor at element `offset` into
    /// plain host memory (no DMA: the engine cannot reach it).
    pub fn tensor_to_slice<T: Element>(&self, dst: &mut [T], offset: usize) -> Result<()> {
        let (at, _) = self.range::<T>("tensor_to_slice", offset, dst.len(), dst.len())?;
        neuron_memcpy_read(bytes_of_mut(dst), self.tensor, at)?;
        Ok(())
    }

    /// Whether the slot was opened coherently.
    pub fn admission(&self) -> Admission {
        self.slot.admission()
    }
}
