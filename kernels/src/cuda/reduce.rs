//! The reduce kernels' launches on [`CudaKernels`]: `dst = in[0] op ... op in[k-1]`, and the
//! divide and scale kernels that finish an average or pre-multiply a sum.

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, PushKernelArg};

use super::source::{div_kernel_name, reduce_kernel_name, scale_kernel_name};
use super::{check_same, check_whole, cuda_err, CudaKernels, MAX_INPUTS};
use crate::{DType, Element, KernelError, ReduceOp};

impl CudaKernels {
    /// `dst = inputs[0] op inputs[1] op ... op inputs[k-1]` on byte buffers of `dt` elements,
    /// launched on `stream` (`Avg` sums; finish with [`CudaKernels::finish_avg_bytes`]).
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] / [`KernelError::NotMultiple`] for bad lengths,
    /// [`KernelError::Inputs`] for no inputs or more than [`MAX_INPUTS`], [`KernelError::Cuda`]
    /// if the launch fails.
    pub fn reduce_bytes(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        op: ReduceOp,
        dst: &mut CudaViewMut<'_, u8>,
        inputs: &[&CudaView<'_, u8>],
    ) -> Result<(), KernelError> {
        if inputs.is_empty() || inputs.len() > MAX_INPUTS {
            return Err(KernelError::Inputs(inputs.len()));
        }
        let len = dst.len();
        for i in inputs {
            check_same(len, i.len())?;
        }
        check_whole(dt, len)?;
        if len == 0 {
            return Ok(());
        }
        let mut ptrs = [0u64; MAX_INPUTS];
        let mut guards = Vec::with_capacity(inputs.len());
        for (slot, i) in ptrs.iter_mut().zip(inputs) {
            let (p, g) = i.device_ptr(stream);
            *slot = p;
            guards.push(g);
        }
        let (d, dg) = dst.device_ptr_mut(stream);
        // SAFETY: `dst` and the inputs are live device buffers of `len` bytes each (checked
        // above); cudarc's guards keep their use ordered on `stream` until they drop after the
        // launch.
        unsafe { self.reduce_raw(stream, dt, op, d, &ptrs[..inputs.len()], len) }?;
        drop((guards, dg));
        Ok(())
    }

    /// [`CudaKernels::reduce_bytes`] on raw device addresses (peers' memory mapped through CUDA
    /// IPC, for instance): `dst = inputs[0] op ... op inputs[k-1]`, `bytes` bytes each. `dst`
    /// may be one of the inputs (each element is read before it is written, by one thread).
    ///
    /// # Safety
    /// `dst` and every input must be device addresses usable from `stream`'s context, each the
    /// start of `bytes` bytes that stay allocated (and, for `dst`, are not otherwise written)
    /// until the kernel has run; the ranges must not overlap except where `dst` equals an input.
    ///
    /// # Errors
    /// As [`CudaKernels::reduce_bytes`].
    pub unsafe fn reduce_raw(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        op: ReduceOp,
        dst: u64,
        inputs: &[u64],
        bytes: usize,
    ) -> Result<(), KernelError> {
        if inputs.is_empty() || inputs.len() > MAX_INPUTS {
            return Err(KernelError::Inputs(inputs.len()));
        }
        check_whole(dt, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        let f = self.func(&reduce_kernel_name(dt, op))?;
        let mut ptrs = [0u64; MAX_INPUTS];
        ptrs[..inputs.len()].copy_from_slice(inputs);
        let (k, n) = (inputs.len() as i32, (bytes / dt.size()) as u64);
        let mut b = stream.launch_builder(f);
        b.arg(&dst).arg(&ptrs).arg(&k).arg(&n);
        // SAFETY: the kernel's parameters are (T* dst, Inputs in, int k, usize n) with Inputs a
        // struct of 8 pointers (64 bytes, like `[u64; 8]`); the caller guarantees `dst` and the
        // first `k` inputs are `n` elements of `dt` each, so the kernel stays inside them.
        unsafe { b.launch(self.config(bytes)) }.map_err(|e| cuda_err("reduce launch", e))?;
        Ok(())
    }

    /// Typed form of [`CudaKernels::reduce_bytes`].
    ///
    /// # Errors
    /// As [`CudaKernels::reduce_bytes`].
    pub fn reduce<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, T>,
        inputs: &[&CudaView<'_, T>],
        op: ReduceOp,
    ) -> Result<(), KernelError> {
        // SAFETY: `T: Element` is a plain-old-data type (bytemuck::Pod), so viewing its buffer
        // as bytes of the same total length is valid.
        let mut d = unsafe { dst.transmute_mut::<u8>(dst.len() * T::DTYPE.size()) }
            .ok_or_else(|| KernelError::Cuda("cannot view the destination as bytes".into()))?;
        let views: Vec<CudaView<'_, u8>> = inputs
            .iter()
            // SAFETY: as above, for each input.
            .map(|i| unsafe { i.transmute::<u8>(i.len() * T::DTYPE.size()) })
            .collect::<Option<_>>()
            .ok_or_else(|| KernelError::Cuda("cannot view an input as bytes".into()))?;
        let refs: Vec<&CudaView<'_, u8>> = views.iter().collect();
        self.reduce_bytes(stream, T::DTYPE, op, &mut d, &refs)
    }

    /// `buf = buf / n` for `dt` elements: the last step of [`ReduceOp::Avg`] (truncating for
    /// integers, in `f32` for `f16`/`bf16`, as the host's `finish_avg`).
    ///
    /// # Errors
    /// [`KernelError::ZeroCount`] for `n == 0`, [`KernelError::NotMultiple`],
    /// [`KernelError::Cuda`] if the launch fails.
    pub fn finish_avg_bytes(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        buf: &mut CudaViewMut<'_, u8>,
        n: usize,
    ) -> Result<(), KernelError> {
        if n == 0 {
            return Err(KernelError::ZeroCount);
        }
        self.unary(
            stream,
            dt,
            &div_kernel_name(dt),
            buf,
            UnaryArg::Div(n as u64),
        )
    }

    /// `buf = buf * factor` (pre-multiplied sum): `f32` arithmetic for `f16`/`bf16`/fp8, `f64`
    /// for `f64`; integers multiply by a whole factor, wrapping, as the host's
    /// [`scale`](crate::scale).
    ///
    /// # Errors
    /// [`KernelError::BadFactor`] for an integer type and a factor that is not a whole number
    /// from -2^63 up to 2^64, [`KernelError::NotMultiple`], [`KernelError::Cuda`] if the launch
    /// fails.
    pub fn scale_bytes(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        buf: &mut CudaViewMut<'_, u8>,
        factor: f64,
    ) -> Result<(), KernelError> {
        let arg = scale_arg(dt, factor)?;
        self.unary(stream, dt, &scale_kernel_name(dt), buf, arg)
    }

    /// `dst = src * factor` on raw device addresses, rounded as in [`CudaKernels::scale_bytes`]
    /// (`dst` may equal `src`).
    ///
    /// # Safety
    /// `dst` and `src` are device addresses of `bytes` bytes each, usable from `stream`'s
    /// context and allocated until the kernel has run; `dst` is not otherwise written
    /// meanwhile, and the two ranges are equal or do not overlap.
    ///
    /// # Errors
    /// As [`CudaKernels::scale_bytes`].
    pub unsafe fn scale_raw(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        dst: u64,
        src: u64,
        bytes: usize,
        factor: f64,
    ) -> Result<(), KernelError> {
        let arg = scale_arg(dt, factor)?;
        // SAFETY: the caller's guarantee.
        unsafe { self.unary_raw(stream, dt, &scale_kernel_name(dt), dst, src, bytes, arg) }
    }

    fn unary(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        name: &str,
        buf: &mut CudaViewMut<'_, u8>,
        arg: UnaryArg,
    ) -> Result<(), KernelError> {
        let len = buf.len();
        let (d, dg) = buf.device_ptr_mut(stream);
        // SAFETY: `buf` is a live device buffer of `len` bytes, ordered on `stream` by its guard
        // until after the launch.
        unsafe { self.unary_raw(stream, dt, name, d, d, len, arg) }?;
        drop(dg);
        Ok(())
    }

    /// # Safety
    /// `dst` and `src` are device addresses of `len` bytes each, usable from `stream`'s context
    /// and allocated until the kernel has run; the ranges are equal or do not overlap.
    #[allow(clippy::too_many_arguments)]
    unsafe fn unary_raw(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        name: &str,
        dst: u64,
        src: u64,
        len: usize,
        arg: UnaryArg,
    ) -> Result<(), KernelError> {
        check_whole(dt, len)?;
        if len == 0 {
            return Ok(());
        }
        let f = self.func(name)?;
        let n = (len / dt.size()) as u64;
        let mut b = stream.launch_builder(f);
        b.arg(&dst).arg(&src);
        match &arg {
            UnaryArg::Div(v) | UnaryArg::ScaleInt(v) => b.arg(v),
            UnaryArg::Scale(v) => b.arg(v),
        };
        b.arg(&n);
        // SAFETY: the kernel is (T* dst, const T* src, u64 d | double f | u64 k, usize n) with
        // `n` elements of `dt` at `dst` and `src` (the caller's guarantee); every thread reads
        // and writes only its own elements, so dst == src is fine.
        unsafe { b.launch(self.config(len)) }.map_err(|e| cuda_err("launch", e))?;
        Ok(())
    }

    /// [`CudaKernels::finish_avg_bytes`] on a raw device address.
    ///
    /// # Safety
    /// `buf` must be the device address of `bytes` bytes usable from `stream`'s context, not
    /// otherwise written and allocated until the kernel has run.
    ///
    /// # Errors
    /// As [`CudaKernels::finish_avg_bytes`].
    pub unsafe fn finish_avg_raw(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        buf: u64,
        bytes: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        if n == 0 {
            return Err(KernelError::ZeroCount);
        }
        // SAFETY: the caller's guarantee.
        unsafe {
            self.unary_raw(
                stream,
                dt,
                &div_kernel_name(dt),
                buf,
                buf,
                bytes,
                UnaryArg::Div(n as u64),
            )
        }
    }
}

enum UnaryArg {
    Div(u64),
    Scale(f64),
    /// A whole factor modulo 2^64, for the integer types.
    ScaleInt(u64),
}

/// The scale kernel's argument for `factor` on `dt`, once it is checked.
fn scale_arg(dt: DType, factor: f64) -> Result<UnaryArg, KernelError> {
    crate::check_factor(dt, factor)?;
    Ok(if dt.is_float() {
        UnaryArg::Scale(factor)
    } else {
        UnaryArg::ScaleInt(crate::host::int_factor(factor))
    })
}
