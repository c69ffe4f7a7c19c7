//! The device buffers of [`DeviceDdp`](super::DeviceDdp): gradients and parameters as the
//! caller hands them over ([`DevGrad`], [`DevGradMut`], [`DeviceParam`]), the buckets, and the
//! element types ([`DeviceElement`]).

use oxccl_comm::cuda::cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits,
};
use oxccl_comm::DType;
use oxccl_kernels::{bf16, f16, Element};

/// A gradient in device memory, of one of the dtypes [`DeviceDdp`](crate::DeviceDdp) takes.
#[derive(Debug)]
pub enum DevGrad<'a> {
    /// `f32` elements.
    F32(CudaView<'a, f32>),
    /// `f64` elements.
    F64(CudaView<'a, f64>),
    /// `f16` elements.
    F16(CudaView<'a, f16>),
    /// `bf16` elements.
    BF16(CudaView<'a, bf16>),
}

/// A writable device buffer of one of the dtypes [`DeviceDdp`](crate::DeviceDdp) takes (a
/// gradient `sync` writes the average into, or a parameter `new` broadcasts).
#[derive(Debug)]
pub enum DevGradMut<'a> {
    /// `f32` elements.
    F32(CudaViewMut<'a, f32>),
    /// `f64` elements.
    F64(CudaViewMut<'a, f64>),
    /// `f16` elements.
    F16(CudaViewMut<'a, f16>),
    /// `bf16` elements.
    BF16(CudaViewMut<'a, bf16>),
}

/// A bucket: one device buffer of one dtype.
#[derive(Debug)]
pub(crate) enum DevBucket {
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
    F16(CudaSlice<f16>),
    BF16(CudaSlice<bf16>),
}

/// The element types of device gradients: `f32`, `f64`, `f16`, `bf16`.
pub trait DeviceElement: Element + DeviceRepr + ValidAsZeroBits {
    #[doc(hidden)]
    fn grad(v: CudaView<'_, Self>) -> DevGrad<'_>;
    #[doc(hidden)]
    fn grad_mut(v: CudaViewMut<'_, Self>) -> DevGradMut<'_>;
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn bucket(b: &DevBucket) -> Option<&CudaSlice<Self>>;
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn bucket_mut(b: &mut DevBucket) -> Option<&mut CudaSlice<Self>>;
}

macro_rules! element {
    ($t:ty, $v:ident) => {
        impl DeviceElement for $t {
            fn grad(v: CudaView<'_, Self>) -> DevGrad<'_> {
                DevGrad::$v(v)
            }
            fn grad_mut(v: CudaViewMut<'_, Self>) -> DevGradMut<'_> {
                DevGradMut::$v(v)
            }
            #[allow(private_interfaces)]
            fn bucket(b: &DevBucket) -> Option<&CudaSlice<Self>> {
                match b {
                    DevBucket::$v(s) => Some(s),
                    _ => None,
                }
            }
            #[allow(private_interfaces)]
            fn bucket_mut(b: &mut DevBucket) -> Option<&mut CudaSlice<Self>> {
                match b {
                    DevBucket::$v(s) => Some(s),
                    _ => None,
                }
            }
        }
    };
}
element!(f32, F32);
element!(f64, F64);
element!(f16, F16);
element!(bf16, BF16);

impl<'a, T: DeviceElement> From<&'a CudaSlice<T>> for DevGrad<'a> {
    fn from(s: &'a CudaSlice<T>) -> Self {
        T::grad(s.as_view())
    }
}

impl<'a, T: DeviceElement> From<CudaView<'a, T>> for DevGrad<'a> {
    fn from(v: CudaView<'a, T>) -> Self {
        T::grad(v)
    }
}

impl<'a, T: DeviceElement> From<&'a mut CudaSlice<T>> for DevGradMut<'a> {
    fn from(s: &'a mut CudaSlice<T>) -> Self {
        T::grad_mut(s.as_view_mut())
    }
}

impl<'a, T: DeviceElement> From<CudaViewMut<'a, T>> for DevGradMut<'a> {
    fn from(v: CudaViewMut<'a, T>) -> Self {
        T::grad_mut(v)
    }
}

impl DevGrad<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            DevGrad::F32(_) => DType::F32,
            DevGrad::F64(_) => DType::F64,
            DevGrad::F16(_) => DType::F16,
            DevGrad::BF16(_) => DType::BF16,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        each!(DevGrad, self, v => v.len())
    }

    /// No elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DevGradMut<'_> {
    /// The buffer, read only.
    pub fn as_grad(&self) -> DevGrad<'_> {
        match self {
            DevGradMut::F32(v) => DevGrad::F32(v.as_view()),
            DevGradMut::F64(v) => DevGrad::F64(v.as_view()),
            DevGradMut::F16(v) => DevGrad::F16(v.as_view()),
            DevGradMut::BF16(v) => DevGrad::BF16(v.as_view()),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            DevGradMut::F32(_) => DType::F32,
            DevGradMut::F64(_) => DType::F64,
            DevGradMut::F16(_) => DType::F16,
            DevGradMut::BF16(_) => DType::BF16,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        each!(DevGradMut, self, v => v.len())
    }

    /// No elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A named parameter in device memory, for [`DeviceDdp::new`](crate::DeviceDdp::new) (which
/// broadcasts rank 0's values).
#[derive(Debug)]
pub struct DeviceParam<'a> {
    pub(super) name: String,
    pub(super) values: DevGradMut<'a>,
}

impl<'a> DeviceParam<'a> {
    /// A parameter: a `&mut CudaSlice<T>` or a `CudaViewMut<T>` of a [`DeviceElement`].
    pub fn new(name: impl Into<String>, values: impl Into<DevGradMut<'a>>) -> DeviceParam<'a> {
        DeviceParam {
            name: name.into(),
            values: values.into(),
        }
    }
}
