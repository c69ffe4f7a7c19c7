//! Host tensors a stage hands over: a dtype, a shape and the elements, stored in 8-byte words so
//! that every element type is aligned and viewed through `bytemuck` (no `unsafe`).

use std::fmt;

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

/// A host tensor.
#[derive(Clone)]
pub struct Tensor {
    meta: Meta,
    words: Vec<u64>,
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Tensor) -> bool {
        self.meta == other.meta && self.bytes() == other.bytes()
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({})", self.meta)
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
        Tensor { meta, words }
    }

    /// A tensor of `meta` on `words` (at least its bytes, rounded up to words), whatever
    /// they hold.
    pub(crate) fn from_words(meta: Meta, mut words: Vec<u64>) -> Tensor {
        words.resize(meta.nbytes().div_ceil(8), 0);
        Tensor { meta, words }
    }

    /// The storage, for reuse.
    pub(crate) fn into_words(self) -> Vec<u64> {
        self.words
    }

    /// A tensor of `shape` holding `data`, or `None` when their sizes differ.
    pub fn new<T: Element>(shape: &[usize], data: &[T]) -> Option<Tensor> {
        let mut t = Tensor::zeros(T::DTYPE, shape);
        if t.meta.numel() != data.len() {
            return None;
        }
        t.bytes_mut().copy_from_slice(bytemuck::cast_slice(data));
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

    /// The elements as bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.meta.nbytes()]
    }

    /// The elements as mutable bytes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.meta.nbytes();
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }

    /// The elements as `&[T]`, or `None` when `T` is not the tensor's dtype.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        (T::DTYPE == self.meta.dtype)
            .then(|| &bytemuck::cast_slice::<u64, T>(&self.words)[..self.meta.numel()])
    }

    /// The elements as `&mut [T]`, or `None` when `T` is not the tensor's dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        if T::DTYPE != self.meta.dtype {
            return None;
        }
        let n = self.meta.numel();
        Some(&mut bytemuck::cast_slice_mut::<u64, T>(&mut self.words)[..n])
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
        assert_eq!(&t.bytes()[..4], &9.0f32.to_le_bytes());
        assert!(Tensor::new(&[2, 2], &[1u8; 3]).is_none());
        let h = Tensor::from_slice(&[half::bf16::ONE; 3]);
        assert_eq!(h.bytes().len(), 6);
    }
}
