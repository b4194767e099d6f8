//! [`TensorAccessor`]: unbuffered, multi-dimensional element access
//! straight through the tensor's host mapping (the seed's
//! `TensorAccessorBase`/`operator[]` indexer).

use std::marker::PhantomData;
use std::mem::{size_of, MaybeUninit};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};

use super::{direct_base, AccessorError, Element, Mode, ReadOnly, ReadWrite, Result};
use crate::coherency::{AccessorKind, Admission, CoherenceSlot};
use crate::completion::Access;
use crate::fence::{HeldSpan, Span};
use crate::tensor::Tensor;

/// Loads a `T` with one relaxed atomic load per byte.
///
/// # Safety
/// `p` must be valid for reads of `size_of::<T>()` bytes, and every access
/// to those bytes that may run at the same time must be atomic and
/// byte-sized: the accessor's direct span guarantees that (plain copies of
/// the library conflicting with it fail with `Busy`; other accessors use
/// this function and [`store`]).
unsafe fn load<T: Element>(p: *const T) -> T {
    let mut out = MaybeUninit::<T>::uninit();
    let dst = out.as_mut_ptr().cast::<u8>();
    let src = p.cast::<u8>().cast_mut();
    for i in 0..size_of::<T>() {
        // SAFETY: byte `i` of the element is valid and only accessed
        // atomically meanwhile (our contract); `AtomicU8` has alignment 1.
        let a = unsafe { AtomicU8::from_ptr(src.add(i)) };
        // SAFETY: byte `i` of `out`, a local of `size_of::<T>()` bytes.
        unsafe { dst.add(i).write(a.load(Ordering::Relaxed)) };
    }
    // SAFETY: every byte was written above, and any bytes are a valid
    // `T: Element` (no padding, no invalid bit patterns).
    unsafe { out.assume_init() }
}

/// Stores a `T` with one relaxed atomic store per byte.
///
/// # Safety
/// As for [`load`], with `p` valid for writes.
unsafe fn store<T: Element>(p: *mut T, value: T) {
    let src = (&raw const value).cast::<u8>();
    let dst = p.cast::<u8>();
    for i in 0..size_of::<T>() {
        // SAFETY: as in `load`.
        let a = unsafe { AtomicU8::from_ptr(dst.add(i)) };
        // SAFETY: byte `i` of `value`, which has no padding (`Element`).
        a.store(unsafe { src.add(i).read() }, Ordering::Relaxed);
    }
}

/// An unbuffered accessor of rank `N` over a tensor: element `index` lives
/// at element offset `sum(index[d] * strides[d])` from the view's first
/// byte. Holds one unbuffered slot of the tensor's enforcer for its whole
/// life; [`select`](Self::select) descends a rank without acquiring again.
///
/// Loads and stores are relaxed atomic byte accesses, so accessors open at
/// once on one storage (clones, slices, `INCOHERENT_*` policies) never race
/// each other. Made with the tensor's fences waited out (device writes for
/// a read-only accessor, any device access for a read-write one). For its
/// whole life it holds the bytes it can reach against the library's plain
/// copies on every view of the storage: while a read-write accessor is
/// open, `read`/`write`/`memset`/`copy` and the stream and TCM accessors
/// overlapping it fail with [`crate::Error::Busy`] (writes only, for a
/// read-only accessor).
///
/// ```
/// use tdrv::accessor::TensorAccessors;
/// use tdrv::Tensor;
///
/// let mut t = Tensor::allocate_host(6 * 4, Some("m"))?;
/// let mut a = t.accessor_mut::<f32, 2>([2, 3])?;
/// a.set([1, 0], 2.5)?;
/// assert_eq!(a.get([1, 0])?, 2.5);
/// assert_eq!(a.select(1)?.get(&[0])?, 2.5);
/// drop(a);
/// assert_eq!(t.to_vec()?[12..16], 2.5f32.to_ne_bytes());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct TensorAccessor<'a, T: Element, const N: usize, M: Mode = ReadOnly> {
    slot: CoherenceSlot<'a>,
    _span: HeldSpan<'a>,
    base: NonNull<T>,
    sizes: [usize; N],
    strides: [usize; N],
    _marker: PhantomData<(&'a Tensor, M)>,
}

// SAFETY: the accessor points into storage kept alive by the borrowed
// tensor (which is Send + Sync); every load and store is an atomic byte
// access inside the direct span it holds, which no plain copy overlaps, so
// using it from any thread cannot race.
unsafe impl<T: Element, const N: usize, M: Mode> Send for TensorAccessor<'_, T, N, M> {}
// SAFETY: as above: `&self` methods only load, atomically.
unsafe impl<T: Element, const N: usize, M: Mode> Sync for TensorAccessor<'_, T, N, M> {}

/// Row-major strides of `sizes`, in elements.
fn contiguous_strides<const N: usize>(sizes: [usize; N]) -> Result<[usize; N]> {
    let mut strides = [0; N];
    let mut step: usize = 1;
    for d in (0..N).rev() {
        strides[d] = step;
        step = step
            .checked_mul(sizes[d])
            .ok_or_else(|| too_big(&sizes, &strides, 0))?;
    }
    Ok(strides)
}

fn too_big(sizes: &[usize], strides: &[usize], len: usize) -> AccessorError {
    AccessorError::ShapeOutOfBounds {
        sizes: sizes.to_vec(),
        strides: strides.to_vec(),
        needed: u128::MAX,
        len,
    }
}

/// Bytes the furthest element needs: `(sum((size - 1) * stride) + 1) *
/// size_of::<T>()`, or 0 when some size is 0 (nothing is addressable).
fn bytes_needed<T>(sizes: &[usize], strides: &[usize]) -> Option<u128> {
    if sizes.contains(&0) {
        return Some(0);
    }
    let mut last: u128 = 0;
    for (&n, &s) in sizes.iter().zip(strides) {
        last = last.checked_add((n as u128 - 1).checked_mul(s as u128)?)?;
    }
    last.checked_add(1)?.checked_mul(size_of::<T>() as u128)
}

/// Element offset of `index`, after checking it against `sizes`.
fn element_offset(index: &[usize], sizes: &[usize], strides: &[usize]) -> Result<usize> {
    if index.len() != sizes.len() || index.iter().zip(sizes).any(|(i, n)| i >= n) {
        return Err(AccessorError::IndexOutOfBounds {
            index: index.to_vec(),
            sizes: sizes.to_vec(),
        }
        .into());
    }
    // Cannot overflow: every in-range index addresses at most the furthest
    // element, whose offset was checked to fit in the tensor.
    Ok(index.iter().zip(strides).map(|(i, s)| i * s).sum())
}

impl<'a, T: Element, const N: usize> TensorAccessor<'a, T, N, ReadOnly> {
    /// A read-only accessor over `sizes` with row-major strides.
    pub fn new(tensor: &'a Tensor, sizes: [usize; N]) -> Result<Self> {
        Self::with_strides(tensor, sizes, contiguous_strides(sizes)?)
    }

    /// A read-only accessor with explicit strides (in elements; 0
    /// broadcasts a dimension).
    pub fn with_strides(
        tensor: &'a Tensor,
        sizes: [usize; N],
        strides: [usize; N],
    ) -> Result<Self> {
        Self::make(tensor, sizes, strides, Access::Read)
    }
}

impl<'a, T: Element, const N: usize> TensorAccessor<'a, T, N, ReadWrite> {
    /// A read-write accessor over `sizes` with row-major strides.
    pub fn new_mut(tensor: &'a mut Tensor, sizes: [usize; N]) -> Result<Self> {
        Self::with_strides_mut(tensor, sizes, contiguous_strides(sizes)?)
    }

    /// A read-write accessor with explicit strides (in elements).
    pub fn with_strides_mut(
        tensor: &'a mut Tensor,
        sizes: [usize; N],
        strides: [usize; N],
    ) -> Result<Self> {
        Self::make(tensor, sizes, strides, Access::Write)
    }

    /// Stores `value` at `index`.
    pub fn set(&mut self, index: [usize; N], value: T) -> Result<()> {
        let off = element_offset(&index, &self.sizes, &self.strides)?;
        // SAFETY: `off` addresses an element inside the tensor (shape checked
        // at construction, index just now) and inside the held direct span;
        // the storage lives as long as the borrowed tensor.
        unsafe { store(self.base.as_ptr().add(off), value) };
        Ok(())
    }

    /// Descends one rank for writing, at `i` of the first dimension.
    pub fn select_mut(&mut self, i: usize) -> Result<TensorSubAccessor<'_, T, ReadWrite>> {
        let base = self.select_base(i)?;
        Ok(TensorSubAccessor::new(
            base,
            &self.sizes[1..],
            &self.strides[1..],
        ))
    }
}

impl<'a, T: Element, const N: usize, M: Mode> TensorAccessor<'a, T, N, M> {
    fn make(
        tensor: &'a Tensor,
        sizes: [usize; N],
        strides: [usize; N],
        access: Access,
    ) -> Result<Self> {
        let base = direct_base::<T>(tensor, "accessor")?;
        match bytes_needed::<T>(&sizes, &strides) {
            Some(needed) if needed <= tensor.size() as u128 => {}
            needed => {
                return Err(AccessorError::ShapeOutOfBounds {
                    sizes: sizes.to_vec(),
                    strides: strides.to_vec(),
                    needed: needed.unwrap_or(u128::MAX),
                    len: tensor.size(),
                }
                .into())
            }
        }
        let slot = tensor.enforcer().slot(AccessorKind::Unbuffered)?;
        // Every element lies in the first `needed` bytes of the view.
        let needed = bytes_needed::<T>(&sizes, &strides).unwrap_or(0) as usize;
        let (storage, abs) = tensor.locate("accessor", 0, needed)?;
        let span = storage.sync.hold(
            "accessor",
            Span::direct(abs, needed, access == Access::Write),
        )?;
        // The slot and span are released by their guards if the wait fails.
        tensor.device_idle_wait(access, None)?;
        Ok(TensorAccessor {
            slot,
            _span: span,
            base,
            sizes,
            strides,
            _marker: PhantomData,
        })
    }

    /// Loads the element at `index`.
    pub fn get(&self, index: [usize; N]) -> Result<T> {
        let off = element_offset(&index, &self.sizes, &self.strides)?;
        // SAFETY: as in `set`; a load only.
        Ok(unsafe { load(self.base.as_ptr().add(off)) })
    }

    /// Descends one rank, at `i` of the first dimension (read-only).
    pub fn select(&self, i: usize) -> Result<TensorSubAccessor<'_, T, ReadOnly>> {
        let base = self.select_base(i)?;
        Ok(TensorSubAccessor::new(
            base,
            &self.sizes[1..],
            &self.strides[1..],
        ))
    }

    fn select_base(&self, i: usize) -> Result<NonNull<T>> {
        if N == 0 || i >= self.sizes[0] {
            return Err(AccessorError::IndexOutOfBounds {
                index: vec![i],
                sizes: self.sizes.to_vec(),
            }
            .into());
        }
        // SAFETY: `i < sizes[0]`, so `i * strides[0]` is at most the
        // furthest element's offset, inside the tensor.
        Ok(unsafe { self.base.add(i * self.strides[0]) })
    }

    /// Sizes of every dimension.
    pub fn sizes(&self) -> &[usize; N] {
        &self.sizes
    }

    /// Strides of every dimension, in elements.
    pub fn strides(&self) -> &[usize; N] {
        &self.strides
    }

    /// Number of addressable indices (the product of the sizes).
    pub fn numel(&self) -> usize {
        // Cannot overflow: checked against the tensor size when made,
        // unless a stride is 0 (broadcast), where it saturates.
        self.sizes.iter().fold(1usize, |a, &n| a.saturating_mul(n))
    }

    /// Whether the slot was opened coherently.
    pub fn admission(&self) -> Admission {
        self.slot.admission()
    }
}

/// A lower-rank view into a [`TensorAccessor`], made by `select`: shares the
/// parent's slot (the seed forwards the enforcer reference without a new
/// acquire). Its rank is dynamic.
pub struct TensorSubAccessor<'b, T: Element, M: Mode> {
    base: NonNull<T>,
    sizes: &'b [usize],
    strides: &'b [usize],
    _marker: PhantomData<(&'b mut (), M)>,
}

// SAFETY: as for TensorAccessor: a borrow of it, atomic accesses only.
unsafe impl<T: Element, M: Mode> Send for TensorSubAccessor<'_, T, M> {}
// SAFETY: as for TensorAccessor.
unsafe impl<T: Element, M: Mode> Sync for TensorSubAccessor<'_, T, M> {}

impl<'b, T: Element, M: Mode> TensorSubAccessor<'b, T, M> {
    fn new(base: NonNull<T>, sizes: &'b [usize], strides: &'b [usize]) -> Self {
        TensorSubAccessor {
            base,
            sizes,
            strides,
            _marker: PhantomData,
        }
    }

    /// Remaining rank.
    pub fn rank(&self) -> usize {
        self.sizes.len()
    }

    /// Sizes of the remaining dimensions.
    pub fn sizes(&self) -> &[usize] {
        self.sizes
    }

    /// Loads the element at `index` (one entry per remaining dimension).
    pub fn get(&self, index: &[usize]) -> Result<T> {
        let off = element_offset(index, self.sizes, self.strides)?;
        // SAFETY: the base is an in-bounds element of the parent and every
        // in-range index below it stays inside the tensor and the parent's
        // direct span (the parent's shape check covers all of them).
        Ok(unsafe { load(self.base.as_ptr().add(off)) })
    }

    /// The element of a rank-0 sub-accessor.
    pub fn value(&self) -> Result<T> {
        self.get(&[])
    }

    /// Descends one more rank (read-only).
    pub fn select(&self, i: usize) -> Result<TensorSubAccessor<'_, T, ReadOnly>> {
        let base = self.select_base(i)?;
        Ok(TensorSubAccessor::new(
            base,
            &self.sizes[1..],
            &self.strides[1..],
        ))
    }

    fn select_base(&self, i: usize) -> Result<NonNull<T>> {
        if self.sizes.first().is_none_or(|&n| i >= n) {
            return Err(AccessorError::IndexOutOfBounds {
                index: vec![i],
                sizes: self.sizes.to_vec(),
            }
            .into());
        }
        // SAFETY: `i < sizes[0]`: still inside the parent's checked shape.
        Ok(unsafe { self.base.add(i * self.strides[0]) })
    }
}

impl<T: Element> TensorSubAccessor<'_, T, ReadWrite> {
    /// Stores `value` at `index`.
    pub fn set(&mut self, index: &[usize], value: T) -> Result<()> {
        let off = element_offset(index, self.sizes, self.strides)?;
        // SAFETY: as in `get`; the parent was made from an exclusive tensor
        // and holds a read-write direct span.
        unsafe { store(self.base.as_ptr().add(off), value) };
        Ok(())
    }

    /// Stores into a rank-0 sub-accessor.
    pub fn set_value(&mut self, value: T) -> Result<()> {
        self.set(&[], value)
    }

    /// Descends one more rank for writing.
    pub fn select_mut(&mut self, i: usize) -> Result<TensorSubAccessor<'_, T, ReadWrite>> {
        let base = self.select_base(i)?;
        Ok(TensorSubAccessor::new(
            base,
            &self.sizes[1..],
            &self.strides[1..],
        ))
    }
}
