//! Byte-level kernels for transports and algorithms that move untyped buffers.
//!
//! When every slice is aligned for the element type, the bytes are reinterpreted in place with
//! `bytemuck` and the typed kernel runs directly (the fast path). Otherwise (for example a slot
//! at an odd offset inside a receive buffer) the data is copied block by block through aligned
//! stack buffers of [`UNALIGNED_BLOCK`] elements, reduced there, and copied back. Both paths
//! perform the same element operations, so their results are bit-identical.

use crate::host::{check_factor, check_len};
use crate::{DType, Element, KernelError, ReduceOp};

/// Elements per aligned stack block on the unaligned path.
const UNALIGNED_BLOCK: usize = 256;

/// Checks that `bytes` is a whole number of `dtype` elements.
fn check_multiple(dtype: DType, bytes: usize) -> Result<(), KernelError> {
    let elem = dtype.size();
    if bytes.is_multiple_of(elem) {
        Ok(())
    } else {
        Err(KernelError::NotMultiple { bytes, elem })
    }
}

/// Byte form of [`reduce`](crate::reduce): `dst[i] = dst[i] (op) src[i]` with elements of type
/// `dtype`. The slices need not be aligned for the element type.
///
/// # Errors
///
/// [`KernelError::LengthMismatch`] (in bytes) if the lengths differ, or
/// [`KernelError::NotMultiple`] if they are not a multiple of `dtype.size()`.
pub fn reduce_bytes(
    dtype: DType,
    op: ReduceOp,
    dst: &mut [u8],
    src: &[u8],
) -> Result<(), KernelError> {
    check_len(dst.len(), src.len())?;
    check_multiple(dtype, dst.len())?;
    crate::with_dtype!(dtype, reduce_typed(dst, src, op));
    Ok(())
}

/// Byte form of [`reduce_into`](crate::reduce_into): `dst[i] = a[i] (op) b[i]`. The slices need
/// not be aligned for the element type.
///
/// # Errors
///
/// [`KernelError::LengthMismatch`] (in bytes) if `a` or `b` is not as long as `dst`, or
/// [`KernelError::NotMultiple`] if the length is not a multiple of `dtype.size()`.
pub fn reduce_into_bytes(
    dtype: DType,
    op: ReduceOp,
    dst: &mut [u8],
    a: &[u8],
    b: &[u8],
) -> Result<(), KernelError> {
    check_len(dst.len(), a.len())?;
    check_len(dst.len(), b.len())?;
    check_multiple(dtype, dst.len())?;
    crate::with_dtype!(dtype, reduce_into_typed(dst, a, b, op));
    Ok(())
}

/// Byte form of [`finish_avg`](crate::finish_avg): divide every `dtype` element of `dst` by
/// `n`. The slice need not be aligned for the element type.
///
/// # Errors
///
/// [`KernelError::ZeroCount`] if `n == 0`, or [`KernelError::NotMultiple`] if the length is not a
/// multiple of `dtype.size()`.
pub fn finish_avg_bytes(dtype: DType, dst: &mut [u8], n: usize) -> Result<(), KernelError> {
    if n == 0 {
        return Err(KernelError::ZeroCount);
    }
    check_multiple(dtype, dst.len())?;
    crate::with_dtype!(dtype, finish_avg_typed(dst, n));
    Ok(())
}

/// Byte form of [`scale`](crate::scale): `dst[i] = dst[i] * factor` with elements of type
/// `dtype` (the first step of a [`ReduceOp::PreMulSum`]). The slice need not be aligned for the
/// element type.
///
/// # Errors
///
/// [`KernelError::NotMultiple`] if the length is not a multiple of `dtype.size()`, or
/// [`KernelError::BadFactor`] for an integer type and a factor it cannot take.
pub fn scale_bytes(dtype: DType, dst: &mut [u8], factor: f64) -> Result<(), KernelError> {
    check_multiple(dtype, dst.len())?;
    check_factor(dtype, factor)?;
    crate::with_dtype!(dtype, scale_typed(dst, None, factor));
    Ok(())
}

/// Byte form of [`scale_into`](crate::scale_into): `dst[i] = src[i] * factor`. The slices need
/// not be aligned for the element type.
///
/// # Errors
///
/// [`KernelError::LengthMismatch`] (in bytes) if the lengths differ, and as [`scale_bytes`].
pub fn scale_into_bytes(
    dtype: DType,
    dst: &mut [u8],
    src: &[u8],
    factor: f64,
) -> Result<(), KernelError> {
    check_len(dst.len(), src.len())?;
    check_multiple(dtype, dst.len())?;
    check_factor(dtype, factor)?;
    crate::with_dtype!(dtype, scale_typed(dst, Some(src), factor));
    Ok(())
}

/// `dst = src * factor`, or `dst *= factor` without `src`.
fn scale_typed<T: Element>(dst: &mut [u8], src: Option<&[u8]>, factor: f64) {
    let typed = (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        src.map(bytemuck::try_cast_slice::<u8, T>),
    );
    match typed {
        (Ok(d), None) => return T::scale_slice(d, factor),
        (Ok(d), Some(Ok(s))) => return T::scale_into_slice(d, s, factor),
        _ => {}
    }
    let mut da = [T::zeroed(); UNALIGNED_BLOCK];
    let step = UNALIGNED_BLOCK * size_of::<T>();
    for (k, dc) in dst.chunks_mut(step).enumerate() {
        let d = &mut da[..dc.len() / size_of::<T>()];
        let from = src.map_or(&*dc, |s| &s[k * step..k * step + dc.len()]);
        bytemuck::cast_slice_mut::<T, u8>(d).copy_from_slice(from);
        T::scale_slice(d, factor);
        dc.copy_from_slice(bytemuck::cast_slice::<T, u8>(d));
    }
}

fn reduce_typed<T: Element>(dst: &mut [u8], src: &[u8], op: ReduceOp) {
    if let (Ok(d), Ok(s)) = (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        return T::reduce_slice(d, s, op);
    }
    let mut da = [T::zeroed(); UNALIGNED_BLOCK];
    let mut sa = [T::zeroed(); UNALIGNED_BLOCK];
    let step = UNALIGNED_BLOCK * size_of::<T>();
    for (dc, sc) in dst.chunks_mut(step).zip(src.chunks(step)) {
        let n = dc.len() / size_of::<T>();
        let (d, s) = (&mut da[..n], &mut sa[..n]);
        bytemuck::cast_slice_mut::<T, u8>(d).copy_from_slice(dc);
        bytemuck::cast_slice_mut::<T, u8>(s).copy_from_slice(sc);
        T::reduce_slice(d, s, op);
        dc.copy_from_slice(bytemuck::cast_slice::<T, u8>(d));
    }
}

fn reduce_into_typed<T: Element>(dst: &mut [u8], a: &[u8], b: &[u8], op: ReduceOp) {
    if let (Ok(d), Ok(x), Ok(y)) = (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(a),
        bytemuck::try_cast_slice::<u8, T>(b),
    ) {
        return T::reduce_into_slice(d, x, y, op);
    }
    let mut xa = [T::zeroed(); UNALIGNED_BLOCK];
    let mut ya = [T::zeroed(); UNALIGNED_BLOCK];
    let step = UNALIGNED_BLOCK * size_of::<T>();
    let blocks = dst.chunks_mut(step).zip(a.chunks(step).zip(b.chunks(step)));
    for (dc, (ac, bc)) in blocks {
        let n = dc.len() / size_of::<T>();
        let (x, y) = (&mut xa[..n], &mut ya[..n]);
        bytemuck::cast_slice_mut::<T, u8>(x).copy_from_slice(ac);
        bytemuck::cast_slice_mut::<T, u8>(y).copy_from_slice(bc);
        // `x op= y` is the same element operation as `dst = x op y`.
        T::reduce_slice(x, y, op);
        dc.copy_from_slice(bytemuck::cast_slice::<T, u8>(x));
    }
}

fn finish_avg_typed<T: Element>(dst: &mut [u8], n: usize) {
    if let Ok(d) = bytemuck::try_cast_slice_mut::<u8, T>(dst) {
        return T::div_slice(d, n);
    }
    let mut da = [T::zeroed(); UNALIGNED_BLOCK];
    let step = UNALIGNED_BLOCK * size_of::<T>();
    for dc in dst.chunks_mut(step) {
        let d = &mut da[..dc.len() / size_of::<T>()];
        bytemuck::cast_slice_mut::<T, u8>(d).copy_from_slice(dc);
        T::div_slice(d, n);
        dc.copy_from_slice(bytemuck::cast_slice::<T, u8>(d));
    }
}
