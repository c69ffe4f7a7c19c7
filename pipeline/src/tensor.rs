//! Tensors a stage hands over: a dtype, a shape and the elements, on the host (stored in 8-byte
//! words so that every element type is aligned and viewed through `bytemuck`, no `unsafe`) or,
//! with the `cuda` feature, on a GPU (the bytes in a cudarc buffer).

use std::fmt;
#[cfg(feature = "cuda-core")]
use std::sync::Arc;

#[cfg(feature = "cuda-core")]
use cudarc::driver::{CudaSlice, CudaStream, DriverError};
use oxccl_comm::{DType, Element};

/// The dtype and shape of a tensor: what the receiving stage is told once, and again only when
/// it changes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Meta {
    /// The element type.
    pub dtype: DType,
    /// The dimensions (empty for a scalar).
    pub shape: Vec<usize>,
}

impl Meta {
    /// Elements: the product of the dimensions.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of the elements.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

impl fmt::Display for Meta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}", self.dtype.short_name(), self.shape)
    }
}

/// Shows a list of metas as `[f32 [4, 64], bf16 [4]]`.
pub(crate) fn show(metas: &[Meta]) -> String {
    let parts: Vec<String> = metas.iter().map(ToString::to_string).collect();
    format!("[{}]", parts.join(", "))
}

/// A tensor: host memory, or (feature `cuda`) device memory.
#[derive(Clone)]
pub struct Tensor {
    meta: Meta,
    store: Store,
}

/// Where a tensor's elements are.
#[derive(Clone)]
enum Store {
    Host(Vec<u64>),
    /// Exactly the tensor's bytes.
    #[cfg(feature = "cuda-core")]
    Device(CudaSlice<u8>),
}

/// Host tensors are equal when their dtypes, shapes and bytes are; a device tensor equals
/// nothing but itself (compare their `to_host` copies).
impl PartialEq for Tensor {
    fn eq(&self, other: &Tensor) -> bool {
        if std::ptr::eq(self, other) {
            return true;
        }
        match (self.bytes(), other.bytes()) {
            (Some(a), Some(b)) => self.meta == other.meta && a == b,
            _ => false,
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let place = if self.is_device() { ", device" } else { "" };
        write!(f, "Tensor({}{place})", self.meta)
    }
}

impl Tensor {
    /// Zeros of `dtype` and `shape`.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Tensor {
        let meta = Meta {
            dtype,
            shape: shape.to_vec(),
        };
        let words = vec![0; meta.nbytes().div_ceil(8)];
        Tensor {
            meta,
            store: Store::Host(words),
        }
    }

    /// A tensor of `meta` on `words` (at least its bytes, rounded up to words), whatever
    /// they hold.
    pub(crate) fn from_words(meta: Meta, mut words: Vec<u64>) -> Tensor {
        words.resize(meta.nbytes().div_ceil(8), 0);
        Tensor {
            meta,
            store: Store::Host(words),
        }
    }

    /// The storage, for reuse.
    pub(crate) fn into_store(self) -> Storage {
        match self.store {
            Store::Host(w) => Storage::Host(w),
            #[cfg(feature = "cuda-core")]
            Store::Device(d) => Storage::Device(d),
        }
    }

    /// A tensor of `shape` holding `data`, or `None` when their sizes differ.
    pub fn new<T: Element>(shape: &[usize], data: &[T]) -> Option<Tensor> {
        let mut t = Tensor::zeros(T::DTYPE, shape);
        if t.meta.numel() != data.len() {
            return None;
        }
        t.bytes_mut()?.copy_from_slice(bytemuck::cast_slice(data));
        Some(t)
    }

    /// A one-dimensional tensor holding `data`.
    pub fn from_slice<T: Element>(data: &[T]) -> Tensor {
        Tensor::new(&[data.len()], data).expect("one dimension of the data's length")
    }

    /// Its dtype and shape.
    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.meta.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.meta.numel()
    }

    /// Bytes of the elements.
    pub fn nbytes(&self) -> usize {
        self.meta.nbytes()
    }

    /// Whether the elements are in device memory.
    pub fn is_device(&self) -> bool {
        !matches!(self.store, Store::Host(_))
    }

    /// The elements as bytes: `None` for a device tensor.
    pub fn bytes(&self) -> Option<&[u8]> {
        match &self.store {
            Store::Host(w) => Some(&bytemuck::cast_slice(w)[..self.meta.nbytes()]),
            #[cfg(feature = "cuda-core")]
            Store::Device(_) => None,
        }
    }

    /// The elements as mutable bytes: `None` for a device tensor.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        let n = self.meta.nbytes();
        match &mut self.store {
            Store::Host(w) => Some(&mut bytemuck::cast_slice_mut(w)[..n]),
            #[cfg(feature = "cuda-core")]
            Store::Device(_) => None,
        }
    }

    /// The elements as `&[T]`: `None` when `T` is not the tensor's dtype, or for a device
    /// tensor.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        let n = self.meta.numel();
        match &self.store {
            Store::Host(w) if T::DTYPE == self.meta.dtype => {
                Some(&bytemuck::cast_slice::<u64, T>(w)[..n])
            }
            _ => None,
        }
    }

    /// The elements as `&mut [T]`: `None` when `T` is not the tensor's dtype, or for a device
    /// tensor.
    pub fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        let n = self.meta.numel();
        match &mut self.store {
            Store::Host(w) if T::DTYPE == self.meta.dtype => {
                Some(&mut bytemuck::cast_slice_mut::<u64, T>(w)[..n])
            }
            _ => None,
        }
    }
}

/// A tensor's storage, taken back for reuse.
pub(crate) enum Storage {
    Host(Vec<u64>),
    #[cfg(feature = "cuda-core")]
    Device(CudaSlice<u8>),
}

/// Device tensors (feature `cuda`): the elements' bytes in a cudarc buffer of `u8`, which a
/// kernel reads as the dtype's elements. Copies and allocations are enqueued on the stream
/// given; cudarc orders each buffer's use across streams (its event tracking, on by default).
#[cfg(feature = "cuda-core")]
impl Tensor {
    /// Zeros of `dtype` and `shape` in device memory, allocated on `stream`.
    ///
    /// # Errors
    /// The allocation's.
    pub fn device_zeros(
        dtype: DType,
        shape: &[usize],
        stream: &Arc<CudaStream>,
    ) -> Result<Tensor, DriverError> {
        let meta = Meta {
            dtype,
            shape: shape.to_vec(),
        };
        let buf = stream.alloc_zeros::<u8>(meta.nbytes())?;
        Ok(Tensor {
            meta,
            store: Store::Device(buf),
        })
    }

    /// A device tensor of `dtype` and `shape` on `buf`, or `None` when `buf`'s length is not
    /// the tensor's bytes.
    pub fn from_device(dtype: DType, shape: &[usize], buf: CudaSlice<u8>) -> Option<Tensor> {
        let meta = Meta {
            dtype,
            shape: shape.to_vec(),
        };
        (buf.len() == meta.nbytes()).then_some(Tensor {
            meta,
            store: Store::Device(buf),
        })
    }

    /// A device tensor of `meta` on `buf` (exactly its bytes).
    pub(crate) fn on_device(meta: Meta, buf: CudaSlice<u8>) -> Tensor {
        debug_assert_eq!(buf.len(), meta.nbytes());
        Tensor {
            meta,
            store: Store::Device(buf),
        }
    }

    /// The device bytes: `None` for a host tensor.
    pub fn device(&self) -> Option<&CudaSlice<u8>> {
        match &self.store {
            Store::Device(d) => Some(d),
            Store::Host(_) => None,
        }
    }

    /// The device bytes, to write: `None` for a host tensor.
    pub fn device_mut(&mut self) -> Option<&mut CudaSlice<u8>> {
        match &mut self.store {
            Store::Device(d) => Some(d),
            Store::Host(_) => None,
        }
    }

    /// A copy in device memory, made on `stream` (a device tensor is copied device to device).
    ///
    /// # Errors
    /// The allocation's or the copy's.
    pub fn to_device(&self, stream: &Arc<CudaStream>) -> Result<Tensor, DriverError> {
        let buf = match &self.store {
            Store::Host(w) => {
                stream.clone_htod(&bytemuck::cast_slice::<u64, u8>(w)[..self.nbytes()])?
            }
            Store::Device(d) => stream.clone_dtod(d)?,
        };
        Ok(Tensor::on_device(self.meta.clone(), buf))
    }

    /// A copy in host memory, made on `stream` (which it waits for).
    ///
    /// # Errors
    /// The copy's.
    pub fn to_host(&self, stream: &Arc<CudaStream>) -> Result<Tensor, DriverError> {
        match &self.store {
            Store::Host(_) => Ok(self.clone()),
            Store::Device(d) => {
                let mut t = Tensor::zeros(self.meta.dtype, &self.meta.shape);
                if let Some(b) = t.bytes_mut() {
                    stream.memcpy_dtoh(d, b)?;
                    stream.synchronize()?;
                }
                Ok(t)
            }
        }
    }
}

/// The metas as words: count, then per tensor its dtype code, rank and dimensions.
fn words(metas: &[Meta]) -> impl Iterator<Item = u64> + '_ {
    std::iter::once(metas.len() as u64).chain(metas.iter().flat_map(|m| {
        [u64::from(m.dtype.to_u8()), m.shape.len() as u64]
            .into_iter()
            .chain(m.shape.iter().map(|&d| d as u64))
    }))
}

/// [`words`], collected: what a link sends when its shapes change.
pub(crate) fn encode(metas: &[Meta]) -> Vec<u64> {
    words(metas).collect()
}

/// How many words [`encode`] gives, without encoding.
pub(crate) fn encoded_len(metas: &[Meta]) -> usize {
    1 + metas.iter().map(|m| 2 + m.shape.len()).sum::<usize>()
}

/// The metas back from [`encode`]'s words, or what is wrong with them.
pub(crate) fn decode(words: &[u64]) -> Result<Vec<Meta>, String> {
    let mut it = words.iter().copied();
    let mut next = |what: &str| {
        it.next()
            .ok_or_else(|| format!("shapes cut short at {what}"))
    };
    let n = next("the count")?;
    let mut out = Vec::new();
    for _ in 0..n {
        let code = next("a dtype")?;
        let dtype = u8::try_from(code)
            .ok()
            .and_then(DType::from_u8)
            .ok_or_else(|| format!("unknown dtype code {code}"))?;
        let rank = next("a rank")?;
        let shape = (0..rank)
            .map(|_| next("a dimension").map(|d| d as usize))
            .collect::<Result<Vec<_>, _>>()?;
        out.push(Meta { dtype, shape });
    }
    Ok(out)
}

/// A fingerprint of the metas (FNV-1a over their words), never 0.
pub(crate) fn fingerprint(metas: &[Meta]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words(metas) {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metas_round_trip_and_fingerprints_differ() {
        let a = vec![
            Meta {
                dtype: DType::F32,
                shape: vec![4, 64],
            },
            Meta {
                dtype: DType::BF16,
                shape: vec![],
            },
        ];
        assert_eq!(decode(&encode(&a)).unwrap(), a);
        assert_eq!(encoded_len(&a), encode(&a).len());
        let mut b = a.clone();
        b[0].shape[0] = 5;
        assert_ne!(fingerprint(&a), fingerprint(&b));
        assert!(decode(&[2, 0, 1]).is_err());
        assert!(decode(&[1, 99, 0]).is_err());
    }

    #[test]
    fn tensors_view_their_own_dtype_only() {
        let mut t = Tensor::new(&[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        assert_eq!(t.as_slice::<f32>().unwrap()[5], 6.0);
        assert!(t.as_slice::<f64>().is_none());
        t.as_mut_slice::<f32>().unwrap()[0] = 9.0;
        assert_eq!(&t.bytes().unwrap()[..4], &9.0f32.to_le_bytes());
        assert!(Tensor::new(&[2, 2], &[1u8; 3]).is_none());
        let h = Tensor::from_slice(&[half::bf16::ONE; 3]);
        assert_eq!(h.bytes().unwrap().len(), 6);
        assert_eq!(h.nbytes(), 6);
        assert!(!h.is_device());
    }
}
