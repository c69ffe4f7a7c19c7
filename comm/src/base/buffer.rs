//! Untyped buffer views: the elements of one data type as bytes, in host memory or (feature
//! `cuda`) device memory. Every collective inside oxccl works on them; the typed calls
//! (`&[T]`, `&mut [T]`, cudarc buffers) are thin wrappers that make one. Layers above (DDP's
//! flat buckets, sharded optimizer state, pipeline activations) hand their flat buffers of any
//! data type to [`crate::Communicator::buffers`] directly, without a typed round trip.
//!
//! ```
//! use oxccl_comm::{Buf, BufMut, DType};
//!
//! let mut grads = vec![0u8; 4 * 1024];
//! let view = BufMut::host(&mut grads, DType::BF16).unwrap(); // 2048 bf16 elements
//! assert_eq!((view.count(), view.dtype()), (2048, DType::BF16));
//! let typed = [1.0f32, 2.0];
//! assert_eq!(Buf::from(&typed[..]).bytes(), Some(&bytemuck::cast_slice(&typed)[..]));
//! ```

use oxccl_kernels::{DType, Element};

/// Why bytes cannot be viewed as elements of a data type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{len} bytes are not a whole number of {dtype} elements ({size} bytes each)")]
pub struct BufError {
    /// The bytes given.
    pub len: usize,
    /// The data type asked for.
    pub dtype: DType,
    /// Its element size.
    pub size: usize,
}

fn whole(len: usize, dtype: DType) -> Result<usize, BufError> {
    let size = dtype.size();
    if len.is_multiple_of(size) {
        Ok(len / size)
    } else {
        Err(BufError { len, dtype, size })
    }
}

/// Device memory as a view sees it: an address, a length in bytes and the stream the call is
/// enqueued on; the guard keeps the buffer's stream order until the call is enqueued.
#[cfg(feature = "cuda-core")]
pub(crate) struct Device<'a> {
    pub ptr: cudarc::driver::sys::CUdeviceptr,
    pub bytes: usize,
    pub stream: &'a std::sync::Arc<cudarc::driver::CudaStream>,
    _guard: Option<cudarc::driver::SyncOnDrop<'a>>,
}

/// Device memory as a view holds it: nothing can be made without the `cuda` feature.
#[cfg(not(feature = "cuda-core"))]
pub(crate) type Dev<'a> = std::convert::Infallible;
#[cfg(feature = "cuda-core")]
pub(crate) type Dev<'a> = Device<'a>;

/// Where a view's bytes are: host memory (`H`, a slice) or device memory.
pub(crate) enum Data<H, D> {
    /// Host memory.
    Host(H),
    /// Device memory.
    #[cfg_attr(not(feature = "cuda-core"), allow(dead_code))]
    Device(D),
}

impl std::fmt::Debug for Buf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buf")
            .field("dtype", &self.dtype)
            .field("count", &self.count)
            .field("device", &self.is_device())
            .finish()
    }
}

impl std::fmt::Debug for BufMut<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufMut")
            .field("dtype", &self.dtype)
            .field("count", &self.count)
            .field("device", &self.is_device())
            .finish()
    }
}

/// A read-only view of `count` elements of `dtype`, in host or device memory: the input of a
/// call.
pub struct Buf<'a> {
    pub(crate) data: Data<&'a [u8], Dev<'a>>,
    dtype: DType,
    count: usize,
}

/// A writable view of `count` elements of `dtype`, in host or device memory: the output (or
/// the in-place buffer) of a call.
pub struct BufMut<'a> {
    pub(crate) data: Data<&'a mut [u8], Dev<'a>>,
    dtype: DType,
    count: usize,
}

#[cfg(feature = "cuda-core")]
impl<'a> Buf<'a> {
    /// The device memory of a device view (`None` for host memory).
    pub(crate) fn data_device(self) -> Option<Device<'a>> {
        match self.data {
            Data::Device(d) => Some(d),
            Data::Host(_) => None,
        }
    }
}

#[cfg(feature = "cuda-core")]
impl<'a> BufMut<'a> {
    /// The device memory of a device view (`None` for host memory).
    pub(crate) fn data_device(self) -> Option<Device<'a>> {
        match self.data {
            Data::Device(d) => Some(d),
            Data::Host(_) => None,
        }
    }
}

impl<'a> Buf<'a> {
    /// Host bytes viewed as elements of `dtype`.
    ///
    /// # Errors
    /// When `bytes` is not a whole number of elements.
    pub fn host(bytes: &'a [u8], dtype: DType) -> Result<Buf<'a>, BufError> {
        Ok(Buf {
            count: whole(bytes.len(), dtype)?,
            data: Data::Host(bytes),
            dtype,
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The bytes of a host view (`None` for device memory).
    pub fn bytes(&self) -> Option<&[u8]> {
        match &self.data {
            Data::Host(b) => Some(b),
            _ => None,
        }
    }

    /// Whether the bytes are in device memory.
    pub fn is_device(&self) -> bool {
        !matches!(self.data, Data::Host(_))
    }

    /// The bytes of a host view, for as long as the view's borrow (`None` for device memory).
    pub fn into_host(self) -> Option<&'a [u8]> {
        match self.data {
            Data::Host(b) => Some(b),
            _ => None,
        }
    }
}

impl<'a> BufMut<'a> {
    /// Host bytes viewed as elements of `dtype`.
    ///
    /// # Errors
    /// When `bytes` is not a whole number of elements.
    pub fn host(bytes: &'a mut [u8], dtype: DType) -> Result<BufMut<'a>, BufError> {
        Ok(BufMut {
            count: whole(bytes.len(), dtype)?,
            data: Data::Host(bytes),
            dtype,
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The bytes of a host view (`None` for device memory).
    pub fn bytes(&self) -> Option<&[u8]> {
        match &self.data {
            Data::Host(b) => Some(b),
            _ => None,
        }
    }

    /// The bytes of a host view, to write (`None` for device memory).
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match &mut self.data {
            Data::Host(b) => Some(b),
            _ => None,
        }
    }

    /// Whether the bytes are in device memory.
    pub fn is_device(&self) -> bool {
        !matches!(self.data, Data::Host(_))
    }

    /// The bytes of a host view, to write, for as long as the view's borrow (`None` for device
    /// memory).
    pub fn into_host(self) -> Option<&'a mut [u8]> {
        match self.data {
            Data::Host(b) => Some(b),
            _ => None,
        }
    }

    /// A shorter-lived view of the same elements (to pass on while keeping this one).
    pub fn reborrow(&mut self) -> BufMut<'_> {
        BufMut {
            data: match &mut self.data {
                Data::Host(b) => Data::Host(&mut **b),
                #[cfg(feature = "cuda-core")]
                Data::Device(d) => Data::Device(Device {
                    ptr: d.ptr,
                    bytes: d.bytes,
                    stream: d.stream,
                    _guard: None,
                }),
                #[cfg(not(feature = "cuda-core"))]
                Data::Device(never) => match *never {},
            },
            dtype: self.dtype,
            count: self.count,
        }
    }
}

impl<'a, T: Element> From<&'a [T]> for Buf<'a> {
    fn from(s: &'a [T]) -> Buf<'a> {
        Buf {
            data: Data::Host(bytemuck::cast_slice(s)),
            dtype: T::DTYPE,
            count: s.len(),
        }
    }
}

impl<'a, T: Element> From<&'a mut [T]> for BufMut<'a> {
    fn from(s: &'a mut [T]) -> BufMut<'a> {
        let count = s.len();
        BufMut {
            data: Data::Host(bytemuck::cast_slice_mut(s)),
            dtype: T::DTYPE,
            count,
        }
    }
}

#[cfg(feature = "cuda-core")]
mod device {
    use std::sync::Arc;

    use cudarc::driver::{sys::CUdeviceptr, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
    use oxccl_kernels::{DType, Element};

    use super::{Buf, BufMut, Data, Device};

    /// The data of a view of `count` elements of `dtype` at `ptr`, enqueued on `stream`
    /// (`guard`: the cudarc buffer's stream order, kept while the view lives).
    fn device_data<'a, H>(
        ptr: CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: &'a Arc<CudaStream>,
        guard: Option<SyncOnDrop<'a>>,
    ) -> Data<H, Device<'a>> {
        Data::Device(Device {
            ptr,
            bytes: count * dtype.size(),
            stream,
            _guard: guard,
        })
    }

    impl<'a> Buf<'a> {
        /// A cudarc device buffer (a `CudaSlice` or a view of one) viewed for a call enqueued
        /// on `stream`; the buffer's stream order is kept until the view is dropped.
        pub fn device<T: Element>(
            buf: &'a impl DevicePtr<T>,
            stream: &'a Arc<CudaStream>,
        ) -> Buf<'a> {
            let count = buf.len();
            let (ptr, guard) = buf.device_ptr(stream);
            let data = device_data(ptr, count, T::DTYPE, stream, Some(guard));
            Buf {
                data,
                dtype: T::DTYPE,
                count,
            }
        }

        /// `count` elements of `dtype` at the device address `ptr`, for a call enqueued on
        /// `stream` (memory that cudarc did not allocate: a C caller's, say).
        ///
        /// # Safety
        /// `ptr` is null with `count` 0, or points to `count` elements of `dtype` in device
        /// memory that `stream`'s context can read, and stays allocated (and unwritten by
        /// others) until the work the call enqueues on `stream` has run.
        pub unsafe fn device_raw(
            ptr: CUdeviceptr,
            count: usize,
            dtype: DType,
            stream: &'a Arc<CudaStream>,
        ) -> Buf<'a> {
            let data = device_data(ptr, count, dtype, stream, None);
            Buf { data, dtype, count }
        }
    }

    impl<'a> BufMut<'a> {
        /// A writable cudarc device buffer viewed for a call enqueued on `stream` (see
        /// [`Buf::device`]).
        pub fn device<T: Element>(
            buf: &'a mut impl DevicePtrMut<T>,
            stream: &'a Arc<CudaStream>,
        ) -> BufMut<'a> {
            let count = buf.len();
            let (ptr, guard) = buf.device_ptr_mut(stream);
            let data = device_data(ptr, count, T::DTYPE, stream, Some(guard));
            BufMut {
                data,
                dtype: T::DTYPE,
                count,
            }
        }

        /// The writable twin of [`Buf::device_raw`].
        ///
        /// # Safety
        /// As [`Buf::device_raw`], and nothing else reads or writes the memory until the
        /// call's work on `stream` has run.
        pub unsafe fn device_raw(
            ptr: CUdeviceptr,
            count: usize,
            dtype: DType,
            stream: &'a Arc<CudaStream>,
        ) -> BufMut<'a> {
            let data = device_data(ptr, count, dtype, stream, None);
            BufMut { data, dtype, count }
        }
    }
}

/// A host buffer that an async call owns while it is in flight and gives back through
/// [`crate::Work::wait`]: `Vec<T>` and boxed slices of an [`Element`] type, and flat buffers of
/// a data type known at run time (implement it for your own, e.g. DDP's flat buckets).
pub trait BufOwner: Send + 'static {
    /// The whole buffer, viewed.
    fn view(&mut self) -> BufMut<'_>;
}

impl<T: Element> BufOwner for Vec<T> {
    fn view(&mut self) -> BufMut<'_> {
        BufMut::from(&mut self[..])
    }
}

impl<T: Element> BufOwner for Box<[T]> {
    fn view(&mut self) -> BufMut<'_> {
        BufMut::from(&mut self[..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_count_whole_elements_and_refuse_the_rest() {
        let mut bytes = [0u8; 12];
        {
            let v = BufMut::host(&mut bytes, DType::F32).unwrap();
            assert_eq!(
                (v.count(), v.dtype(), v.is_device()),
                (3, DType::F32, false)
            );
        }
        let e = Buf::host(&bytes[..7], DType::F16).unwrap_err();
        assert_eq!(
            e.to_string(),
            "7 bytes are not a whole number of half elements (2 bytes each)"
        );
        let mut typed = [1u64, 2, 3];
        {
            let mut v = BufMut::from(&mut typed[..]);
            v.bytes_mut().unwrap()[0] = 9;
            assert_eq!(v.reborrow().count(), 3);
        }
        assert_eq!(typed[0], 9);
        let mut owned = vec![0.5f64; 4];
        assert_eq!(BufOwner::view(&mut owned).bytes().unwrap().len(), 32);
    }
}
