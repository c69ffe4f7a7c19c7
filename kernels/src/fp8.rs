//! The 8-bit float types of [`DType::F8E4M3`](crate::DType::F8E4M3) and
//! [`DType::F8E5M2`](crate::DType::F8E5M2): [`F8E4M3`] and [`F8E5M2`] (formats, rounding and
//! saturation are documented at [`F8E4M3`]), and the conversions the kernels run.

use std::fmt;

/// Fields of one fp8 format.
struct Format {
    /// Mantissa (fraction) bits.
    man: u32,
    /// Exponent bias.
    bias: i32,
    /// Bits of the largest finite value (positive).
    max_bits: u8,
    /// The largest finite value.
    max: f64,
}

const E4M3: Format = Format {
    man: 3,
    bias: 7,
    max_bits: 0x7e,
    max: 448.0,
};

const E5M2: Format = Format {
    man: 2,
    bias: 15,
    max_bits: 0x7b,
    max: 57344.0,
};

/// The NaN every conversion of a NaN produces (with the input's sign bit).
const NAN_BITS: u8 = 0x7f;

/// Round to nearest even and saturate, from the bits of an IEEE float with `fbits` fraction bits
/// and exponent bias `ebias` (`f32`: 23 / 127, `f64`: 52 / 1023). `abs` is the value's magnitude
/// as that float, converted to `f64` exactly.
fn encode(bits: u64, total: u32, fbits: u32, ebias: i32, abs: f64, f: &Format) -> u8 {
    let sign = ((bits >> (total - 1)) as u8) << 7;
    if abs.is_nan() {
        return sign | NAN_BITS;
    }
    // Every value at or beyond the largest finite one rounds to it or beyond it, and beyond
    // saturates: infinities included.
    if abs >= f.max {
        return sign | f.max_bits;
    }
    let min_normal = exp2(1 - f.bias);
    if abs < min_normal {
        // Subnormal (or zero): k ulps of 2^(1 - bias - man). The scaling by a power of two is
        // exact, and `round_ties_even` is the rounding the format wants.
        let k = (abs * exp2(f.bias - 1 + f.man as i32)).round_ties_even();
        return sign | k as u8;
    }
    let abs_bits = bits & ((1u64 << (total - 1)) - 1);
    let exp = (abs_bits >> fbits) as i32 - ebias + f.bias;
    let drop = fbits - f.man;
    let frac = (abs_bits >> drop) & ((1u64 << f.man) - 1);
    let mut res = ((exp as u64) << f.man) | frac;
    let rem = abs_bits & ((1u64 << drop) - 1);
    let half = 1u64 << (drop - 1);
    if rem > half || (rem == half && res & 1 == 1) {
        // A carry out of the fraction moves to the next binade, as it should; `abs < max`
        // keeps the result at most `max_bits`.
        res += 1;
    }
    sign | res as u8
}

/// The fast form of [`encode`] for `f32` (what every reduction step rounds with: the operation
/// tables, the averaging division, the scalar reference): the same rounding and saturation,
/// without branches, so loops over it vectorize. Normal results round
/// the mantissa with the usual add-half-minus-one-plus-the-lowest-kept-bit trick and rebias the
/// exponent; subnormal results let the float adder round `|x| * 2^(bias - 1 + man)` to an
/// integer (adding 2^23 leaves no fraction bits; ties to even); too large values, infinities
/// included, clamp to `max_bits`; NaN becomes `0x7f`. The tests check it against the `float8`
/// crate and against [`encode`] on every tie of both formats.
// Signed 32-bit arithmetic throughout: x86-64's baseline (SSE2) has signed 32-bit compares and
// int -> float conversions, not unsigned ones, so this form is what the loops vectorize on.
#[inline(always)]
fn narrow_f32(x: f32, man: i32, bias: i32, max_bits: i32) -> u8 {
    let bits = x.to_bits() as i32;
    let sign = (bits >> 24) & 0x80;
    let ax = bits & 0x7fff_ffff;
    let drop = 23 - man;
    // For NaN patterns the sum passes 2^31: it wraps as i32 and is exact read back as u32
    // (at most 0x7fff_ffff + 2^20 < 2^32); NaN is selected below anyway.
    let rounded = (ax.wrapping_add((1 << (drop - 1)) - 1 + ((ax >> drop) & 1))) as u32 >> drop;
    let normal = rounded as i32 - ((127 - bias) << man);
    let normal = if normal > max_bits { max_bits } else { normal };
    let scaled = f32::from_bits(ax as u32) * f32::from_bits(((127 + bias - 1 + man) << 23) as u32);
    let sub = ((scaled + 8_388_608.0).to_bits() as i32).wrapping_sub(0x4b00_0000);
    let min_normal = (127 + 1 - bias) << 23;
    let v = if ax < min_normal { sub } else { normal };
    let v = if ax > 0x7f80_0000 {
        i32::from(NAN_BITS)
    } else {
        v
    };
    (sign | v) as u8
}

/// E4M3 -> `f32`, exact: the exponent and mantissa bits move into an `f32` whose exponent is
/// rebiased by 120, subnormals are `m x 2^-9`, `0x7f` is NaN. Selects instead of branches, so
/// loops over it vectorize. The tests check every pattern against the `float8` crate.
#[inline(always)]
fn widen_e4m3(b: u8) -> f32 {
    let b = i32::from(b);
    let sign = (b & 0x80) << 24;
    let em = b & 0x7f;
    let sub = (em as f32 * (1.0 / 512.0)).to_bits() as i32;
    let normal = (em + (120 << 3)) << 20;
    let v = if em < 8 { sub } else { normal };
    let v = if em == 0x7f { 0x7fc0_0000 } else { v };
    f32::from_bits((sign | v) as u32)
}

/// E5M2 -> `f32`, exact, as [`widen_e4m3`] (rebias 112, subnormals `m x 2^-16`); the all-ones
/// exponent maps to the `f32` all-ones exponent (infinity, or NaN with the fraction bits kept).
#[inline(always)]
fn widen_e5m2(b: u8) -> f32 {
    let b = i32::from(b);
    let sign = (b & 0x80) << 24;
    let em = b & 0x7f;
    let sub = (em as f32 * (1.0 / 65536.0)).to_bits() as i32;
    let normal = (em + (112 << 2)) << 21;
    let special = (em + ((255 - 31) << 2)) << 21;
    let v = if em < 4 { sub } else { normal };
    let v = if em >= 0x7c { special } else { v };
    f32::from_bits((sign | v) as u32)
}

/// 2^e for the small exponents the formats use (|e| < 32).
fn exp2(e: i32) -> f64 {
    f64::from_bits(((1023 + e) as u64) << 52)
}

macro_rules! fp8_type {
    ($(#[$doc:meta])* $t:ident, $fmt:ident, $widen:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
        #[repr(transparent)]
        pub struct $t(u8);

        impl $t {
            /// The value with these bits.
            pub const fn from_bits(bits: u8) -> Self {
                $t(bits)
            }

            /// The bits of this value.
            pub const fn to_bits(self) -> u8 {
                self.0
            }

            /// Rounds to nearest even, saturating to the largest finite value (see [`F8E4M3`]);
            /// NaN stays NaN.
            #[inline]
            pub fn from_f32(x: f32) -> Self {
                $t(narrow_f32(x, $fmt.man as i32, $fmt.bias, i32::from($fmt.max_bits)))
            }

            /// As [`Self::from_f32`], rounding once from the `f64` value (no double rounding
            /// through `f32`).
            pub fn from_f64(x: f64) -> Self {
                $t(encode(x.to_bits(), 64, 52, 1023, x.abs(), &$fmt))
            }

            /// The exact value.
            #[inline]
            pub fn to_f32(self) -> f32 {
                $widen(self.0)
            }

            /// The exact value.
            pub fn to_f64(self) -> f64 {
                f64::from(self.to_f32())
            }

            /// Whether this is a NaN.
            pub fn is_nan(self) -> bool {
                self.to_f32().is_nan()
            }
        }

        /// Float equality: NaN equals nothing, `-0` equals `+0`.
        impl PartialEq for $t {
            fn eq(&self, other: &Self) -> bool {
                self.to_f32() == other.to_f32()
            }
        }

        impl PartialOrd for $t {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                self.to_f32().partial_cmp(&other.to_f32())
            }
        }

        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.to_f32(), f)
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.to_f32(), f)
            }
        }

        impl From<$t> for f32 {
            fn from(v: $t) -> f32 {
                v.to_f32()
            }
        }

        impl From<$t> for f64 {
            fn from(v: $t) -> f64 {
                v.to_f64()
            }
        }
    };
}

fp8_type!(
    /// 8-bit float with 4 exponent and 3 mantissa bits, no infinities (`float8_e4m3fn`): the
    /// element type of [`DType::F8E4M3`](crate::DType::F8E4M3).
    ///
    /// Both fp8 types follow the OCP 8-bit floating point specification as NVIDIA implements it
    /// (`__nv_fp8_e4m3` and `__nv_fp8_e5m2`, `torch.float8_e4m3fn` and `torch.float8_e5m2`):
    ///
    /// | type | exponent / mantissa bits | bias | largest finite | infinity | NaN |
    /// |---|---|---|---|---|---|
    /// | [`F8E4M3`] | 4 / 3 | 7 | 448 (`0x7e`) | none | `0x7f`, `0xff` |
    /// | [`F8E5M2`] | 5 / 2 | 15 | 57344 (`0x7b`) | `0x7c`, `0xfc` | `0x7d..=0x7f`, `0xfd..=0xff` |
    ///
    /// Conversions from `f32` and `f64` round to nearest, ties to even, and **saturate**: a finite
    /// value beyond the largest finite one, and an infinity, become the largest finite value of its
    /// sign, as the CUDA conversions with `__NV_SATFINITE` (the `__nv_fp8_*` constructors, and the
    /// `cvt.rn.satfinite` instructions of sm_89 and later) do. NaN stays NaN (`0x7f` with the sign
    /// of the input). Conversions to `f32` and `f64` are exact.
    ///
    /// Reductions combine fp8 values in `f32` and round back after every step (see the crate docs).
    ///
    /// Why not the `float8` crate: its conversions are the same CUDA algorithm (it is this crate's
    /// test reference), but its `F8E5M2::is_nan` misses `0x7d`/`0x7f` and its `is_infinite` of both
    /// types flags the largest finite values, and its `PartialEq` is built on them; a reduction
    /// library needs the classification right. The types are `#[repr(transparent)]` over `u8`, so
    /// buffers of either crate's types cast to each other with `bytemuck` (`float8`'s `bytemuck`
    /// feature).
    F8E4M3,
    E4M3,
    widen_e4m3
);

fp8_type!(
    /// 8-bit float with 5 exponent and 2 mantissa bits, IEEE-like (`float8_e5m2`): the element
    /// type of [`DType::F8E5M2`](crate::DType::F8E5M2). The formats, rounding and saturation are
    /// described at [`F8E4M3`].
    F8E5M2,
    E5M2,
    widen_e5m2
);

/// Widens fp8 values to `f32` (exact) and rounds back.
pub(crate) trait Fp8: Copy {
    /// 0 for E4M3, 1 for E5M2 (an index into per-type tables).
    const KIND: usize;
    fn widen(self) -> f32;
    fn narrow(v: f32) -> Self;
    fn from_bits(b: u8) -> Self;
    fn to_bits(self) -> u8;
}

macro_rules! fp8_impl {
    ($($t:ident => $kind:expr);*) => {$(
        impl Fp8 for $t {
            const KIND: usize = $kind;
            fn from_bits(b: u8) -> Self {
                $t(b)
            }
            fn to_bits(self) -> u8 {
                self.0
            }
            #[inline(always)]
            fn widen(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn narrow(v: f32) -> Self {
                $t::from_f32(v)
            }
        }
    )*};
}

fp8_impl!(F8E4M3 => 0; F8E5M2 => 1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert_eq!(F8E4M3::from_bits(0x7e).to_f32(), 448.0);
        assert_eq!(F8E4M3::from_bits(0x01).to_f32(), 2f32.powi(-9));
        assert_eq!(F8E4M3::from_bits(0x08).to_f32(), 2f32.powi(-6));
        assert_eq!(F8E4M3::from_bits(0x38).to_f32(), 1.0);
        assert_eq!(F8E4M3::from_bits(0xb8).to_f32(), -1.0);
        assert!(F8E4M3::from_bits(0x7f).is_nan());
        assert!(F8E4M3::from_bits(0xff).is_nan());
        assert_eq!(F8E5M2::from_bits(0x7b).to_f32(), 57344.0);
        assert_eq!(F8E5M2::from_bits(0x7c).to_f32(), f32::INFINITY);
        assert_eq!(F8E5M2::from_bits(0xfc).to_f32(), f32::NEG_INFINITY);
        assert_eq!(F8E5M2::from_bits(0x01).to_f32(), 2f32.powi(-16));
        assert_eq!(F8E5M2::from_bits(0x3c).to_f32(), 1.0);
        for b in [0x7d, 0x7e, 0x7f, 0xfd, 0xfe, 0xff] {
            assert!(F8E5M2::from_bits(b).is_nan(), "{b:#x}");
        }
        assert!(!F8E5M2::from_bits(0x7b).is_nan());
        assert_eq!(F8E4M3::from_bits(0x80), F8E4M3::from_bits(0));
        assert_ne!(F8E4M3::from_bits(0x7f), F8E4M3::from_bits(0x7f));
    }

    #[test]
    fn rounding_and_saturation() {
        let e4 = |x: f32| F8E4M3::from_f32(x).to_bits();
        let e5 = |x: f32| F8E5M2::from_f32(x).to_bits();
        // Ties to even: 1 + 1/16 lies halfway between 1 (even) and 1.125.
        assert_eq!(e4(1.0625), 0x38);
        assert_eq!(e4(1.0625f32.next_up()), 0x39);
        assert_eq!(e4(1.1875), 0x3a); // halfway between 1.125 (odd) and 1.25
        assert_eq!(e4(1000.0), 0x7e);
        assert_eq!(e4(-1e30), 0xfe);
        assert_eq!(e4(f32::INFINITY), 0x7e);
        assert_eq!(e4(f32::NAN), 0x7f);
        assert_eq!(e4(2f32.powi(-10)), 0x00); // half the smallest subnormal: to even (0)
        assert_eq!(e4(2f32.powi(-10).next_up()), 0x01);
        assert_eq!(e4(-2f32.powi(-12)), 0x80);
        assert_eq!(e5(f32::INFINITY), 0x7b);
        assert_eq!(e5(61440.0), 0x7b);
        assert_eq!(e5(-f32::INFINITY), 0xfb);
        // 1.5 ulps of the subnormals: to even.
        assert_eq!(e5(3.0 * 2f32.powi(-17)), 0x02);
        // Double rounding through f32 is avoided: this f64 is just above a tie of E4M3.
        let above_tie = 1.0625f64 + 2f64.powi(-40);
        assert_eq!(F8E4M3::from_f64(above_tie).to_bits(), 0x39);
        assert_eq!(F8E4M3::from_f32(above_tie as f32).to_bits(), 0x38);
    }

    #[test]
    fn every_value_round_trips() {
        for b in 0..=255u8 {
            for (v, back) in [
                (
                    F8E4M3::from_bits(b).to_f32(),
                    F8E4M3::from_f32(F8E4M3::from_bits(b).to_f32()).0,
                ),
                (
                    F8E5M2::from_bits(b).to_f32(),
                    F8E5M2::from_f32(F8E5M2::from_bits(b).to_f32()).0,
                ),
            ] {
                if v.is_nan() {
                    assert_eq!(back & 0x7f, NAN_BITS);
                } else if v.is_infinite() {
                    assert_eq!(back & 0x7f, E5M2.max_bits);
                } else {
                    assert_eq!(back, b, "{b:#x} = {v}");
                }
            }
        }
    }
}
