//! [`TypedTensor`]: a tensor seen as elements of one `Pod` type.

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;

use crate::builder::byte_range;
use crate::error::{Error, Result};
use crate::job::Job;
use crate::tensor::Tensor;

/// A tensor seen as `len()` elements of type `T`: indices and lengths in
/// elements, every range checked (in elements, then in bytes), reads and
/// writes fenced like [`Tensor::read`]/[`Tensor::write`]. Elements need no
/// alignment (they are copied, never referenced in place).
///
/// ```
/// use tdrv::{Tensor, TypedTensor};
///
/// let t: TypedTensor<f32> = Tensor::from_slice(&[0.0f32; 8])?;
/// t.set(3, 1.5)?;
/// assert_eq!(t.get(3)?, 1.5);
/// let tail = t.slice(6..)?; // elements 6 and 7
/// tail.write(0, &[2.0, 3.0])?;
/// assert_eq!(t.to_vec()?[5..], [0.0, 2.0, 3.0]);
/// assert!(t.get(8).is_err()); // past the end: an error
/// # Ok::<(), tdrv::Error>(())
/// ```
pub struct TypedTensor<T> {
    tensor: Tensor,
    _elem: PhantomData<fn() -> T>,
}

impl<T> Clone for TypedTensor<T> {
    fn clone(&self) -> Self {
        TypedTensor {
            tensor: self.tensor.clone(),
            _elem: PhantomData,
        }
    }
}

impl<T> fmt::Debug for TypedTensor<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TypedTensor")
            .field("element", &std::any::type_name::<T>())
            .field(
                "len",
                &(self.tensor.size() / std::mem::size_of::<T>().max(1)),
            )
            .field("tensor", &self.tensor)
            .finish()
    }
}

impl Tensor {
    /// This view as elements of `T` ([`TypedTensor`]); its size must be a
    /// whole number of `T` (and `T` not zero-sized).
    pub fn typed<T: bytemuck::Pod>(&self) -> Result<TypedTensor<T>> {
        let each = std::mem::size_of::<T>();
        if each == 0 || self.size() % each != 0 {
            return Err(Error::invalid(format!(
                "typed: tensor {:?} has {} bytes, not a whole number of {}-byte {}",
                self.name(),
                self.size(),
                each,
                std::any::type_name::<T>()
            )));
        }
        Ok(TypedTensor {
            tensor: self.clone(),
            _elem: PhantomData,
        })
    }
}

impl<T> From<TypedTensor<T>> for Tensor {
    /// The untyped view ([`TypedTensor::into_tensor`]).
    fn from(t: TypedTensor<T>) -> Tensor {
        t.tensor
    }
}

impl<T> TypedTensor<T> {
    /// The untyped view, by value: the same bytes, with sizes and offsets
    /// in bytes ([`TypedTensor::tensor`] borrows it).
    pub fn into_tensor(self) -> Tensor {
        self.tensor
    }
}

impl<T: bytemuck::Pod> TypedTensor<T> {
    const EACH: usize = std::mem::size_of::<T>();

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.tensor.size() / Self::EACH
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The byte tensor underneath.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Byte offset and byte length of `n` elements from element `start`,
    /// checked against the element count.
    fn bytes(&self, op: &'static str, start: usize, n: usize) -> Result<(usize, usize)> {
        let (offset, _) = byte_range(op, start..start.saturating_add(n), self.len())?;
        // Cannot overflow: both are within len() elements of the tensor.
        Ok((offset * Self::EACH, n * Self::EACH))
    }

    /// Element `i`.
    pub fn get(&self, i: usize) -> Result<T> {
        let mut v = [T::zeroed()];
        self.read(i, &mut v)?;
        Ok(v[0])
    }

    /// Sets element `i` to `value`.
    pub fn set(&self, i: usize, value: T) -> Result<()> {
        self.write(i, &[value])
    }

    /// Reads `dst.len()` elements from element `start`.
    pub fn read(&self, start: usize, dst: &mut [T]) -> Result<()> {
        let (offset, _) = self.bytes("typed read", start, dst.len())?;
        self.tensor.read_into(offset, dst)
    }

    /// Writes `src` from element `start`.
    pub fn write(&self, start: usize, src: &[T]) -> Result<()> {
        let (offset, _) = self.bytes("typed write", start, src.len())?;
        self.tensor.write_from(offset, src)
    }

    /// All elements.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.tensor.to_vec_of()
    }

    /// The elements of `range`, as a typed view of a slice of the tensor.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<TypedTensor<T>> {
        let (start, n) = byte_range("typed slice", range, self.len())?;
        let (offset, size) = self.bytes("typed slice", start, n)?;
        Ok(TypedTensor {
            tensor: self.tensor.slice(offset, size, None)?,
            _elem: PhantomData,
        })
    }
}

impl Job {
    /// Adds a copy of `len` elements from `src` at element `src_start` to
    /// `dst` at element `dst_start` ([`Job::copy`] in elements: both
    /// ranges are checked in elements first).
    ///
    /// ```
    /// use tdrv::{Device, Job, Tensor};
    ///
    /// if let Ok(dev) = Device::open("/dev/tdrv0") {
    ///     let a = Tensor::zeros::<u32>(&dev, 64)?;
    ///     let b = Tensor::zeros::<u32>(&dev, 64)?;
    ///     a.write(0, &[7; 64])?;
    ///     Job::new().copy_elems(&a, 0, &b, 32, 32)?.submit()?.wait()?;
    ///     assert_eq!(b.get(31)?, 0);
    ///     assert_eq!(b.get(32)?, 7);
    /// }
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn copy_elems<T: bytemuck::Pod>(
        &mut self,
        src: &TypedTensor<T>,
        src_start: usize,
        dst: &TypedTensor<T>,
        dst_start: usize,
        len: usize,
    ) -> Result<&mut Self> {
        let (so, size) = src.bytes("job copy (source)", src_start, len)?;
        let (dof, _) = dst.bytes("job copy (destination)", dst_start, len)?;
        self.copy(&src.tensor, so, &dst.tensor, dof, size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_counts_elements_not_bytes() {
        let w = Tensor::builder().zeros::<f32>(1 << 20).unwrap();
        assert_eq!((w.len(), w.tensor().size()), (1 << 20, 4 << 20));
        assert_eq!(w.get((1 << 20) - 1).unwrap(), 0.0);
        assert!(matches!(
            Tensor::builder().zeros::<u64>(usize::MAX / 4),
            Err(Error::InvalidArgument(_))
        ));
        let e = Tensor::builder().zeros::<u16>(0).unwrap();
        assert!(e.is_empty());
    }

    #[test]
    fn element_copies_check_ranges_in_elements() {
        let a = Tensor::builder().zeros::<u32>(4).unwrap();
        let b = Tensor::builder().zeros::<u32>(4).unwrap();
        let mut job = Job::new();
        // 3 elements from element 2 end past the source's 4.
        assert!(matches!(
            job.copy_elems(&a, 2, &b, 0, 3),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            job.copy_elems(&a, 0, &b, usize::MAX, 1),
            Err(Error::OutOfBounds { .. })
        ));
        // In range, but host tensors are not a device's: refused by copy.
        assert!(matches!(
            job.copy_elems(&a, 0, &b, 1, 3),
            Err(Error::Unsupported { .. })
        ));
        assert!(job.is_empty());
    }

    #[test]
    fn typed_views_count_and_check_in_elements() {
        let t = Tensor::from_slice(&[0u16; 6]).unwrap().into_tensor();
        let v = t.typed::<u16>().unwrap();
        assert_eq!(v.len(), 6);
        v.write(4, &[7, 8]).unwrap();
        assert_eq!(v.to_vec().unwrap(), [0, 0, 0, 0, 7, 8]);
        assert!(matches!(
            v.write(5, &[1, 2]),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(v.get(usize::MAX), Err(Error::OutOfBounds { .. })));
        let s = v.slice(1..=2).unwrap();
        assert_eq!((s.len(), s.tensor().offset()), (2, 2));
        s.set(1, 9).unwrap();
        assert_eq!(v.get(2).unwrap(), 9);
        // 12 bytes: 3 u32, not a whole number of u64.
        assert_eq!(t.typed::<u32>().unwrap().len(), 3);
        assert!(t.typed::<u64>().is_err());
        assert!(t.typed::<()>().is_err());
        let odd = t.slice(1, 8, None).unwrap().typed::<u32>().unwrap();
        odd.set(0, 0xdead_beef).unwrap(); // unaligned: copied, not referenced
        assert_eq!(odd.get(0).unwrap(), 0xdead_beef);
    }
}
