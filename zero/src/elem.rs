//! The element types of parameters: f32, and f16 / bf16 with f32 master weights.

use oxccl_comm::Element;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A parameter element type: `f32`, `half::f16` or `half::bf16`. The optimizer steps f32 master
/// weights of each shard; parameters of 16 bits get the masters rounded to nearest even after
/// every step, and their gradients are widened to f32 before they are reduced.
pub trait ParamElement: Element + Copy + sealed::Sealed {
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (to nearest even).
    fn from_f32(v: f32) -> Self;
}

impl ParamElement for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl ParamElement for half::f16 {
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

impl ParamElement for half::bf16 {
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}
