//! The optimizer launches of sharded optimizers (oxccl-zero) on [`CudaKernels`]: one AdamW or
//! SGD step over f32 master weights, with the per-step scalars the host computed, so that the
//! device does each element's arithmetic exactly as the host's loop does.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use super::{check_same, cuda_err, CudaKernels, ADAMW_KERNEL, SGD_KERNEL};
use crate::KernelError;

/// The scalars of one AdamW step: `decay = 1 - lr * weight_decay`, `omb1 = 1 - beta1`,
/// `omb2 = 1 - beta2`, `c1` and `c2` the bias corrections `1 - beta^t`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    /// Learning rate.
    pub lr: f32,
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// `1 - beta1`.
    pub omb1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// `1 - beta2`.
    pub omb2: f32,
    /// Added to the root of the second moment.
    pub eps: f32,
    /// `1 - beta1^t`.
    pub c1: f32,
    /// `1 - beta2^t`.
    pub c2: f32,
}

/// The scalars of one SGD step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdScalars {
    /// Learning rate.
    pub lr: f32,
    /// L2 weight decay.
    pub weight_decay: f32,
    /// Momentum factor (0: no buffer).
    pub momentum: f32,
    /// `1 - dampening`.
    pub omd: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// The first step (the buffer takes the gradient as it is).
    pub first: bool,
}

impl CudaKernels {
    /// One AdamW step on `master` with `grad` and the moments `m`, `v` (all `n` long), launched
    /// on `stream`.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] for different lengths, [`KernelError::Cuda`] if the launch
    /// fails.
    pub fn adamw_f32(
        &self,
        stream: &Arc<CudaStream>,
        master: &mut impl DevicePtrMut<f32>,
        grad: &impl DevicePtr<f32>,
        (m, v): (&mut impl DevicePtrMut<f32>, &mut impl DevicePtrMut<f32>),
        s: AdamWScalars,
    ) -> Result<(), KernelError> {
        let n = master.len();
        for len in [grad.len(), m.len(), v.len()] {
            check_same(n, len)?;
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.func(ADAMW_KERNEL)?;
        let (g, gg) = grad.device_ptr(stream);
        let (p, pg) = master.device_ptr_mut(stream);
        let (mp, mg) = m.device_ptr_mut(stream);
        let (vp, vg) = v.device_ptr_mut(stream);
        let count = n as u64;
        let mut b = stream.launch_builder(f);
        b.arg(&p).arg(&g).arg(&mp).arg(&vp).arg(&count);
        b.arg(&s.lr).arg(&s.decay).arg(&s.beta1).arg(&s.omb1);
        b.arg(&s.beta2)
            .arg(&s.omb2)
            .arg(&s.eps)
            .arg(&s.c1)
            .arg(&s.c2);
        // SAFETY: the kernel is (float* p, const float* g, float* m, float* v, usize n, then
        // nine floats), pushed in that order; the four buffers are live and `n` elements long,
        // ordered on `stream` by their guards until after the launch.
        unsafe { b.launch(self.config(n * 4)) }.map_err(|e| cuda_err("adamw launch", e))?;
        drop((gg, pg, mg, vg));
        Ok(())
    }

    /// One SGD step on `master` with `grad` and the momentum buffer `buf` (`None` without
    /// momentum), launched on `stream`.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] for different lengths or a missing buffer with momentum,
    /// [`KernelError::Cuda`] if the launch fails.
    pub fn sgd_f32<B: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        master: &mut impl DevicePtrMut<f32>,
        grad: &impl DevicePtr<f32>,
        buf: Option<&mut B>,
        s: SgdScalars,
    ) -> Result<(), KernelError> {
        let n = master.len();
        check_same(n, grad.len())?;
        let momentum = s.momentum != 0.0;
        check_same(
            if momentum { n } else { 0 },
            buf.as_ref().map_or(0, |b| b.len()),
        )?;
        if n == 0 {
            return Ok(());
        }
        let f = self.func(SGD_KERNEL)?;
        let (g, gg) = grad.device_ptr(stream);
        let (p, pg) = master.device_ptr_mut(stream);
        let (bp, bg) = match buf.filter(|_| momentum) {
            Some(b) => {
                let (ptr, guard) = b.device_ptr_mut(stream);
                (ptr, Some(guard))
            }
            None => (0, None),
        };
        let count = n as u64;
        let (nesterov, first) = (i32::from(s.nesterov), i32::from(s.first));
        let mut b = stream.launch_builder(f);
        b.arg(&p).arg(&g).arg(&bp).arg(&count);
        b.arg(&s.lr)
            .arg(&s.weight_decay)
            .arg(&s.momentum)
            .arg(&s.omd);
        b.arg(&nesterov).arg(&first);
        // SAFETY: the kernel is (float* p, const float* g, float* buf, usize n, four floats, two
        // ints), pushed in that order; the buffers are live and `n` elements long (the momentum
        // buffer null only without momentum, where the kernel does not read it), ordered on
        // `stream` by their guards until after the launch.
        unsafe { b.launch(self.config(n * 4)) }.map_err(|e| cuda_err("sgd launch", e))?;
        drop((gg, pg, bg));
        Ok(())
    }
}

impl CudaKernels {
    /// `buf[i] /= n` in f32 (the average's division, as the host's `g / n as f32`), launched on
    /// `stream`.
    ///
    /// # Errors
    /// [`KernelError::ZeroCount`] for `n == 0`, [`KernelError::Cuda`] if the launch fails.
    pub fn div_f32(
        &self,
        stream: &Arc<CudaStream>,
        buf: &mut impl DevicePtrMut<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        let len = buf.len();
        let (p, guard) = buf.device_ptr_mut(stream);
        // SAFETY: `p` is a live device buffer of `len` f32 from `stream`'s context, ordered on
        // `stream` by its guard until after the launch.
        let r = unsafe { self.finish_avg_raw(stream, crate::DType::F32, p, len * 4, n) };
        drop(guard);
        r
    }
}
