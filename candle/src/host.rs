//! Host tensors to DDP's flat buffers and back.

use candle_core::{Device, Shape, Tensor};
use oxccl_comm::DType;
use oxccl_ddp::FlatBuffer;

use crate::Error;

/// Why a tensor could not be converted; [`ConvError::at`] names the rank, call and variable.
#[derive(Debug)]
pub(crate) struct ConvError(ConvKind);

#[derive(Debug)]
enum ConvKind {
    Dtype(candle_core::DType),
    Candle(candle_core::Error),
}

impl ConvError {
    /// The error of `op` on `rank` for the variable `name`.
    pub(crate) fn at(self, rank: usize, op: &'static str, name: &str) -> Error {
        match self.0 {
            ConvKind::Dtype(dt) => Error::InvalidArgument {
                rank,
                op,
                msg: format!("variable {name} is {dt:?}: DDP averages f32, f64, f16 and bf16"),
            },
            ConvKind::Candle(source) => Error::Candle { rank, op, source },
        }
    }
}

impl From<candle_core::Error> for ConvError {
    fn from(e: candle_core::Error) -> ConvError {
        ConvError(ConvKind::Candle(e))
    }
}

/// oxccl's dtype for a candle dtype DDP reduces.
pub(crate) fn dtype_of(dt: candle_core::DType) -> Result<DType, ConvError> {
    Ok(match dt {
        candle_core::DType::F32 => DType::F32,
        candle_core::DType::F64 => DType::F64,
        candle_core::DType::F16 => DType::F16,
        candle_core::DType::BF16 => DType::BF16,
        other => return Err(ConvError(ConvKind::Dtype(other))),
    })
}

/// A copy of a host tensor's elements (in row-major order) in a flat buffer of its dtype.
///
/// # Errors
/// A dtype DDP does not reduce, or a failed candle call.
pub(crate) fn to_flat(t: &Tensor) -> Result<FlatBuffer, ConvError> {
    match dtype_of(t.dtype())? {
        DType::F32 => copy_out::<f32>(t),
        DType::F64 => copy_out::<f64>(t),
        DType::F16 => copy_out::<half::f16>(t),
        _ => copy_out::<half::bf16>(t),
    }
}

/// One copy of a contiguous host tensor's elements, straight from its storage (a strided one
/// is made contiguous first).
fn copy_out<T: candle_core::WithDType + oxccl_comm::Element>(
    t: &Tensor,
) -> Result<FlatBuffer, ConvError> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((from, to))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(FlatBuffer::from_slice(&cpu.as_slice::<T>()?[from..to]));
        }
    }
    Ok(FlatBuffer::from_slice(&t.flatten_all()?.to_vec1::<T>()?))
}

/// A tensor of `shape` on `device` holding a flat buffer's elements.
pub(crate) fn from_flat(
    buf: &FlatBuffer,
    shape: &Shape,
    device: &Device,
) -> Result<Tensor, ConvError> {
    fn make<T: candle_core::WithDType + oxccl_comm::Element>(
        buf: &FlatBuffer,
        shape: &Shape,
        device: &Device,
    ) -> Result<Tensor, ConvError> {
        match buf.as_slice::<T>() {
            Some(s) => Ok(Tensor::from_slice(s, shape, device)?),
            None => Err(ConvError(ConvKind::Dtype(
                <T as candle_core::WithDType>::DTYPE,
            ))),
        }
    }
    match buf.dtype() {
        DType::F32 => make::<f32>(buf, shape, device),
        DType::F64 => make::<f64>(buf, shape, device),
        DType::F16 => make::<half::f16>(buf, shape, device),
        _ => make::<half::bf16>(buf, shape, device),
    }
}
