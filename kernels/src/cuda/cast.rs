//! The launches DDP on device gradients uses on [`CudaKernels`]: the conversions
//! `dst = (D)(src * factor)` between the dtype pairs of [`CAST_PAIRS`], and the in-place sum
//! `dst += src`.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use super::source::cast_kernel_name;
use super::{check_same, cuda_err, CudaKernels, CAST_PAIRS};
use crate::{Element, KernelError};

impl CudaKernels {
    /// `dst[i] = (D)(src[i] * factor)`, computed in `S`'s arithmetic (`f32` for `f16`/`bf16`)
    /// and rounded to nearest even into `D`, as the host's `half` conversions do; launched on
    /// `stream`.
    ///
    /// # Errors
    /// [`KernelError::Unsupported`] for a pair outside [`CAST_PAIRS`],
    /// [`KernelError::LengthMismatch`] for different lengths, [`KernelError::Cuda`] if the launch
    /// fails.
    pub fn cast<S: Element, D: Element>(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut impl DevicePtrMut<D>,
        src: &impl DevicePtr<S>,
        factor: f64,
    ) -> Result<(), KernelError> {
        if !CAST_PAIRS.contains(&(S::DTYPE, D::DTYPE)) {
            return Err(KernelError::Unsupported {
                dtype: S::DTYPE,
                what: "conversion to this dtype on the device",
            });
        }
        let n = dst.len();
        check_same(n, src.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(&cast_kernel_name(S::DTYPE, D::DTYPE))?;
        let (s, sg) = src.device_ptr(stream);
        let (d, dg) = dst.device_ptr_mut(stream);
        let count = n as u64;
        let mut b = stream.launch_builder(f);
        b.arg(&d).arg(&s).arg(&factor).arg(&count);
        // SAFETY: the kernel is (D* dst, const S* src, double f, usize n) for exactly this pair
        // (checked above); both buffers are live and `n` elements long, ordered on `stream` by
        // their guards until after the launch.
        unsafe { b.launch(self.config(n * D::DTYPE.size())) }
            .map_err(|e| cuda_err("cast launch", e))?;
        drop((sg, dg));
        Ok(())
    }
}

impl CudaKernels {
    /// `dst += src` (element-wise sum in place: gradient accumulation), launched on `stream`.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] for different lengths, [`KernelError::Cuda`] if the launch
    /// fails.
    pub fn add_into<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut impl DevicePtrMut<T>,
        src: &impl DevicePtr<T>,
    ) -> Result<(), KernelError> {
        let n = dst.len();
        check_same(n, src.len())?;
        let (s, sg) = src.device_ptr(stream);
        let (d, dg) = dst.device_ptr_mut(stream);
        // SAFETY: `dst` and `src` are live device buffers of `n` elements of `T`, ordered on
        // `stream` by their guards until after the launch; `dst` is also the first input, which
        // `reduce_raw` allows (each element is read before it is written, by one thread), and a
        // `&mut` and a `&` buffer cannot otherwise overlap.
        unsafe {
            self.reduce_raw(
                stream,
                T::DTYPE,
                crate::ReduceOp::Sum,
                d,
                &[d, s],
                n * T::DTYPE.size(),
            )
        }?;
        drop((sg, dg));
        Ok(())
    }
}
