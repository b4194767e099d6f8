//! The allocation builder and the typed constructors of [`Tensor`].

use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys::Device;
use crate::tensor::{Placement, Tensor};
use crate::typed::TypedTensor;

/// Where a [`TensorBuilder`] allocates.
#[derive(Debug, Clone)]
enum Target {
    Host,
    Default,
    Device(Arc<Device>),
}

/// Builds a tensor: where (host memory, a device, the process-wide
/// device), which HBM channel, which name; then its contents ([`zeroed`],
/// [`from_slice`]). Made by [`Tensor::builder`]; host memory unless told
/// otherwise.
///
/// ```
/// use tdrv::Tensor;
///
/// let t = Tensor::builder().name("weights").from_slice(&[0.5f32; 256])?;
/// assert_eq!(t.len(), 256); // a TypedTensor<f32>: 256 elements
/// let t = t.into_tensor(); // the untyped view: bytes
/// assert_eq!((t.name(), t.size()), ("weights", 1024));
/// let z = Tensor::builder().zeroed(64)?;
/// assert_eq!(z.to_vec()?, [0; 64]);
/// # Ok::<(), tdrv::Error>(())
/// ```
///
/// [`zeroed`]: TensorBuilder::zeroed
/// [`from_slice`]: TensorBuilder::from_slice
#[derive(Debug, Clone)]
#[must_use = "a builder allocates nothing until zeroed or from_slice"]
pub struct TensorBuilder {
    target: Target,
    channel: u32,
    name: Option<String>,
}

impl TensorBuilder {
    /// Allocate on `device` (`Dma` storage, HBM channel 0 unless
    /// [`TensorBuilder::channel`] says otherwise).
    pub fn on(mut self, device: &Arc<Device>) -> Self {
        self.target = Target::Device(device.clone());
        self
    }

    /// Allocate as nrt's placements do: `Device` on the process-wide device
    /// ([`crate::default_device`]), `Host` and `Virtual` in host memory.
    pub fn placement(mut self, placement: Placement) -> Self {
        self.target = match placement {
            Placement::Device => Target::Default,
            Placement::Host | Placement::Virtual => Target::Host,
        };
        self
    }

    /// The HBM channel of a device allocation (ignored for host memory).
    pub fn channel(mut self, channel: u32) -> Self {
        self.channel = channel;
        self
    }

    /// The tensor's name (default `"_unknown_"`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Allocates `size` zeroed **bytes**. For a number of elements, use
    /// [`TensorBuilder::zeros`].
    pub fn zeroed(self, size: usize) -> Result<Tensor> {
        let name = self.name.as_deref();
        match &self.target {
            Target::Host => Tensor::allocate_host(size, name),
            Target::Default => Tensor::allocate_placed(Placement::Device, self.channel, size, name),
            Target::Device(d) => Tensor::allocate_on(d, self.channel, size, name),
        }
    }

    /// Allocates `len` zeroed **elements** of `T`, as a [`TypedTensor`]:
    /// `zeros::<f32>(1 << 20)` is a million floats, 4 MiB. A byte size
    /// that overflows `usize` is [`Error::InvalidArgument`].
    ///
    /// ```
    /// let w = tdrv::Tensor::builder().name("w").zeros::<f32>(1 << 20)?;
    /// assert_eq!((w.len(), w.tensor().size()), (1 << 20, 4 << 20));
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn zeros<T: bytemuck::Pod>(self, len: usize) -> Result<TypedTensor<T>> {
        let each = std::mem::size_of::<T>();
        let size = len.checked_mul(each).ok_or_else(|| {
            Error::invalid(format!(
                "{len} elements of {each}-byte {} do not fit in memory",
                std::any::type_name::<T>()
            ))
        })?;
        self.zeroed(size)?.typed()
    }

    /// Allocates room for `data` and writes it, as a [`TypedTensor`] of
    /// `data.len()` elements (like [`TensorBuilder::zeros`]);
    /// [`TypedTensor::tensor`] or [`TypedTensor::into_tensor`] gives the
    /// untyped [`Tensor`].
    pub fn from_slice<T: bytemuck::Pod>(self, data: &[T]) -> Result<TypedTensor<T>> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let t = self.zeroed(bytes.len())?;
        t.write(0, bytes)?;
        t.typed()
    }
}

impl Tensor {
    /// A [`TensorBuilder`]: host memory, channel 0, the default name.
    pub fn builder() -> TensorBuilder {
        TensorBuilder {
            target: Target::Host,
            channel: 0,
            name: None,
        }
    }

    /// `len` zeroed elements of `T` on `device` (HBM channel 0; a
    /// [`TensorBuilder`] picks another channel or a name).
    ///
    /// ```
    /// use tdrv::{Device, Tensor};
    ///
    /// if let Ok(dev) = Device::open("/dev/tdrv0") {
    ///     let x = Tensor::zeros::<f32>(&dev, 1024)?;
    ///     x.set(3, 2.5)?;
    ///     assert_eq!((x.len(), x.get(3)?), (1024, 2.5));
    /// }
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn zeros<T: bytemuck::Pod>(device: &Arc<Device>, len: usize) -> Result<TypedTensor<T>> {
        Self::builder().on(device).zeros(len)
    }

    /// A host tensor holding a copy of `data` (`Malloc` storage, aligned to
    /// [`crate::HOST_ALIGN`]), as a [`TypedTensor`] of `data.len()`
    /// elements, like [`Tensor::zeros`]. [`TypedTensor::tensor`] borrows
    /// the untyped [`Tensor`], [`TypedTensor::into_tensor`] (or `.into()`)
    /// gives it.
    ///
    /// ```
    /// let t = tdrv::Tensor::from_slice(&[1u16, 2, 3])?;
    /// assert_eq!((t.len(), t.to_vec()?), (3, vec![1, 2, 3]));
    /// let bytes: tdrv::Tensor = t.into_tensor();
    /// assert_eq!(bytes.size(), 6);
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn from_slice<T: bytemuck::Pod>(data: &[T]) -> Result<TypedTensor<T>> {
        Self::builder().from_slice(data)
    }

    /// A host tensor holding the elements of `data`, as a [`TypedTensor`]
    /// ([`Tensor::from_slice`]). They are copied into aligned storage,
    /// which the tensor layer's fences and accessors manage (a `Vec`'s own
    /// allocation cannot be adopted: its alignment and allocator are the
    /// vector's).
    pub fn from_vec<T: bytemuck::Pod>(data: Vec<T>) -> Result<TypedTensor<T>> {
        Self::from_slice(&data)
    }

    /// A sub-view over a byte range of this view: `t.slice_range(16..32)`,
    /// `t.slice_range(..8)`, `t.slice_range(4..)`. See [`Tensor::slice`];
    /// an empty or inverted range past the end is an error, not a panic.
    ///
    /// ```
    /// let t = tdrv::Tensor::from_slice(&[0u8, 1, 2, 3, 4, 5, 6, 7])?.into_tensor();
    /// assert_eq!(t.slice_range(2..5)?.to_vec()?, [2, 3, 4]);
    /// assert_eq!(t.slice_range(6..)?.to_vec()?, [6, 7]);
    /// assert!(t.slice_range(4..9).is_err());
    /// # Ok::<(), tdrv::Error>(())
    /// ```
    pub fn slice_range(&self, range: impl RangeBounds<usize>) -> Result<Tensor> {
        let (offset, size) = byte_range("slice_range", range, self.size())?;
        self.slice(offset, size, None)
    }
}

/// `(offset, size)` of `range` within `len` bytes, checked.
pub(crate) fn byte_range(
    op: &'static str,
    range: impl RangeBounds<usize>,
    len: usize,
) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    let (Some(start), Some(end)) = (start, end) else {
        return Err(Error::Overflow {
            op,
            offset: usize::MAX,
            size: 1,
        });
    };
    if start > end {
        return Err(Error::invalid(format!(
            "{op}: range starts at {start} after its end {end}"
        )));
    }
    if end > len {
        return Err(Error::OutOfBounds {
            op,
            offset: start,
            size: end - start,
            len,
        });
    }
    Ok((start, end - start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_ranges_are_checked_not_panicking() {
        assert_eq!(byte_range("x", .., 10).unwrap(), (0, 10));
        assert_eq!(byte_range("x", 2..=3, 10).unwrap(), (2, 2));
        assert_eq!(byte_range("x", 10.., 10).unwrap(), (10, 0));
        assert!(matches!(
            byte_range("x", 5..11, 10),
            Err(Error::OutOfBounds { .. })
        ));
        #[allow(clippy::reversed_empty_ranges)]
        let inverted = byte_range("x", 6..5, 10);
        assert!(matches!(inverted, Err(Error::InvalidArgument(_))));
        assert!(matches!(
            byte_range("x", ..=usize::MAX, 10),
            Err(Error::Overflow { .. })
        ));
        assert!(matches!(
            byte_range("x", (Bound::Excluded(usize::MAX), Bound::Unbounded), 10),
            Err(Error::Overflow { .. })
        ));
    }

    #[test]
    fn typed_io_round_trips_and_refuses_partial_elements() {
        let t = Tensor::from_vec(vec![1u32, 2, 3]).unwrap().into_tensor();
        assert_eq!(t.size(), 12);
        assert_eq!(t.to_vec_of::<u32>().unwrap(), [1, 2, 3]);
        let h = [half::bf16::from_f32(1.0), half::bf16::from_f32(-2.0)];
        t.write_from(4, &h).unwrap();
        let mut back = [half::bf16::ZERO; 2];
        t.read_into(4, &mut back).unwrap();
        assert_eq!(back, h);
        // 12 bytes are not a whole number of u64 or [u8; 5].
        assert!(matches!(
            t.to_vec_of::<u64>(),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            t.to_vec_of::<()>(),
            Err(Error::InvalidArgument(_))
        ));
        // Unaligned offsets are fine; past the end is an error.
        t.write_from(1, &[0xABu16]).unwrap();
        assert!(matches!(
            t.write_from(8, &[0u32; 2]),
            Err(Error::OutOfBounds { .. })
        ));
        let b = Tensor::builder()
            .placement(Placement::Host)
            .channel(3)
            .name("b")
            .from_slice(&[[1u8, 2]; 3])
            .unwrap();
        assert_eq!(b.len(), 3, "three [u8; 2] elements");
        let b = b.into_tensor();
        assert_eq!(
            (b.name(), b.to_vec().unwrap()),
            ("b", vec![1, 2, 1, 2, 1, 2])
        );
    }
}
