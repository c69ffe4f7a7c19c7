//! The byte-copy kernel's launch on [`CudaKernels`].

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, PushKernelArg};

use super::{check_same, cuda_err, CudaKernels, COPY_KERNEL};
use crate::KernelError;

impl CudaKernels {
    /// `dst = src` (bytes), 16-byte vectors where the offsets allow.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`], or [`KernelError::Cuda`] if the launch fails.
    pub fn copy_bytes(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, u8>,
        src: &CudaView<'_, u8>,
    ) -> Result<(), KernelError> {
        let len = dst.len();
        check_same(len, src.len())?;
        if len == 0 {
            return Ok(());
        }
        let f = self.func(COPY_KERNEL)?;
        let (s, sg) = src.device_ptr(stream);
        let (d, dg) = dst.device_ptr_mut(stream);
        let n = len as u64;
        let mut b = stream.launch_builder(f);
        b.arg(&d).arg(&s).arg(&n);
        // SAFETY: the kernel is (u8* dst, const u8* src, usize n); both buffers are live and
        // `n` bytes long (checked above).
        unsafe { b.launch(self.config(len)) }.map_err(|e| cuda_err("copy launch", e))?;
        drop((sg, dg));
        Ok(())
    }
}
