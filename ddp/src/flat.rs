//! Flat gradient buffers: one dtype, stored in 8-byte words so that every element type is
//! aligned, viewed as typed slices through `bytemuck` (no `unsafe`).

use std::marker::PhantomData;

use oxccl_comm::{DType, Element};

/// A flat buffer of `len` elements of one [`DType`]: a bucket's gradients.
#[derive(Clone, Debug, PartialEq)]
pub struct FlatBuffer {
    dtype: DType,
    len: usize,
    words: Vec<u64>,
}

impl FlatBuffer {
    /// `len` zero elements of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> FlatBuffer {
        FlatBuffer {
            dtype,
            len,
            words: vec![0; (len * dtype.size()).div_ceil(8)],
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements as bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len * self.dtype.size()]
    }

    /// The elements as mutable bytes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.len * self.dtype.size();
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice<T: Element>(data: &[T]) -> FlatBuffer {
        let mut b = FlatBuffer::zeros(T::DTYPE, data.len());
        b.bytes_mut().copy_from_slice(bytemuck::cast_slice(data));
        b
    }

    /// The elements as `&[T]`, or `None` when `T` is not the buffer's dtype.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        (T::DTYPE == self.dtype).then(|| &bytemuck::cast_slice::<u64, T>(&self.words)[..self.len])
    }

    /// The elements as `&mut [T]`, or `None` when `T` is not the buffer's dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        if T::DTYPE != self.dtype {
            return None;
        }
        Some(&mut bytemuck::cast_slice_mut::<u64, T>(&mut self.words)[..self.len])
    }

    /// The buffer as a typed owner (for calls that need one; the communicator's untyped calls
    /// take the buffer itself, see [`oxccl_comm::BufOwner`]), or the buffer back when
    /// `T` is not its dtype.
    ///
    /// # Errors
    /// `Err(self)` when `T::DTYPE` differs from the buffer's dtype.
    pub fn into_typed<T: Element>(self) -> std::result::Result<Typed<T>, FlatBuffer> {
        if T::DTYPE == self.dtype {
            Ok(Typed {
                buf: self,
                _t: PhantomData,
            })
        } else {
            Err(self)
        }
    }
}

/// A [`FlatBuffer`] known to hold `T`s: implements `AsMut<[T]>`, which the communicator's async
/// collectives take as an owned buffer.
#[derive(Debug)]
pub struct Typed<T> {
    buf: FlatBuffer,
    _t: PhantomData<fn() -> T>,
}

impl<T: Element> Typed<T> {
    /// The untyped buffer back.
    pub fn into_inner(self) -> FlatBuffer {
        self.buf
    }
}

impl<T: Element> AsMut<[T]> for Typed<T> {
    fn as_mut(&mut self) -> &mut [T] {
        let len = self.buf.len;
        &mut bytemuck::cast_slice_mut::<u64, T>(&mut self.buf.words)[..len]
    }
}

/// A caller's gradient or parameter storage as seen by DDP: a dtype and its bytes. Implemented
/// for `Vec<T>`, `&mut Vec<T>`, `&mut [T]`, [`TensorMut`] and [`FlatBuffer`] (mixed dtypes in
/// one list).
/// `bytes` and `bytes_mut` must be the same bytes, aligned for the dtype (a misaligned one is
/// reduced through a copy).
pub trait GradBuf {
    /// The element type.
    fn dtype(&self) -> DType;
    /// The elements as bytes.
    fn bytes(&self) -> &[u8];
    /// The elements as mutable bytes.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Number of elements.
    fn elems(&self) -> usize {
        self.bytes().len() / self.dtype().size()
    }
}

/// `GradBuf` for containers that deref to `[T]`.
macro_rules! typed_grad_buf {
    ($($ty:ty),*) => {$(
        impl<T: Element> GradBuf for $ty {
            fn dtype(&self) -> DType {
                T::DTYPE
            }
            fn bytes(&self) -> &[u8] {
                bytemuck::cast_slice(self)
            }
            fn bytes_mut(&mut self) -> &mut [u8] {
                bytemuck::cast_slice_mut(self)
            }
        }
    )*};
}

typed_grad_buf!(Vec<T>, &mut Vec<T>, &mut [T]);

impl GradBuf for FlatBuffer {
    fn dtype(&self) -> DType {
        FlatBuffer::dtype(self)
    }
    fn bytes(&self) -> &[u8] {
        FlatBuffer::bytes(self)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        FlatBuffer::bytes_mut(self)
    }
}

/// A mutable slice of any element type with its dtype: lets one list hold parameters or
/// gradients of several dtypes.
#[derive(Debug)]
pub struct TensorMut<'a> {
    dtype: DType,
    bytes: &'a mut [u8],
}

impl<'a> TensorMut<'a> {
    /// Wraps a typed slice.
    pub fn new<T: Element>(data: &'a mut [T]) -> TensorMut<'a> {
        TensorMut {
            dtype: T::DTYPE,
            bytes: bytemuck::cast_slice_mut(data),
        }
    }
}

/// A flat buffer as a tensor of its dtype (an untyped parameter or gradient, e.g. one copied out
/// of a framework's tensor).
impl<'a> From<&'a mut FlatBuffer> for TensorMut<'a> {
    fn from(buf: &'a mut FlatBuffer) -> TensorMut<'a> {
        TensorMut {
            dtype: buf.dtype,
            bytes: buf.bytes_mut(),
        }
    }
}

impl<'a, T: Element> From<&'a mut [T]> for TensorMut<'a> {
    fn from(data: &'a mut [T]) -> TensorMut<'a> {
        TensorMut::new(data)
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for TensorMut<'a> {
    fn from(data: &'a mut Vec<T>) -> TensorMut<'a> {
        TensorMut::new(data.as_mut_slice())
    }
}

impl GradBuf for TensorMut<'_> {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn bytes(&self) -> &[u8] {
        self.bytes
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

/// A flat buffer goes to the communicator's untyped calls as it is
/// ([`oxccl_comm::Buffers::all_reduce_async`]).
impl oxccl_comm::BufOwner for FlatBuffer {
    fn view(&mut self) -> oxccl_comm::BufMut<'_> {
        let dtype = self.dtype;
        let whole = self.len * dtype.size();
        let bytes = &mut bytemuck::cast_slice_mut(&mut self.words)[..whole];
        // `len` elements of `dtype` are a whole number of them: the view cannot be refused.
        oxccl_comm::BufMut::host(bytes, dtype).expect("len * size bytes are whole elements")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxccl_comm::DType;

    #[test]
    fn typed_views_match_dtype_only() {
        let mut b = FlatBuffer::zeros(DType::BF16, 5);
        assert_eq!(b.bytes().len(), 10);
        assert!(b.as_slice::<f32>().is_none());
        b.as_mut_slice::<half::bf16>().unwrap()[4] = half::bf16::from_f32(2.0);
        assert_eq!(b.bytes()[8..], half::bf16::from_f32(2.0).to_le_bytes());
        let b = b.into_typed::<f32>().unwrap_err();
        let mut t = b.into_typed::<half::bf16>().unwrap();
        assert_eq!(t.as_mut().len(), 5);
        assert_eq!(t.into_inner().len(), 5);
    }

    #[test]
    fn grad_bufs_report_dtype_and_length() {
        let mut v = vec![1.0f64; 3];
        let mut w = vec![1u8; 7];
        let list: Vec<TensorMut> = vec![(&mut v).into(), (&mut w).into()];
        assert_eq!(list[0].dtype(), DType::F64);
        assert_eq!(list[0].elems(), 3);
        assert_eq!(list[1].elems(), 7);
    }
}
