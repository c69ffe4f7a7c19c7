//! Sizes: parsing `-b`/`-e`/`-i` values, generating the sweep, and the nccl-tests buffer
//! geometry and bus-bandwidth factor of every collective.

use oxccl_comm::Collective;

/// How the sweep goes from one size to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Multiply by this factor (`-f`, at least 2).
    Factor(u64),
    /// Add this many bytes (`-i`, at least 1).
    Bytes(u64),
}

/// Parses a byte count the way nccl-tests does: a number, optionally fractional, with an
/// optional `K`, `M` or `G` suffix (powers of 1024), e.g. `8`, `64K`, `1.5M`.
///
/// # Errors
/// A message naming the value when it does not parse.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => {
                    return Err(format!(
                        "invalid size {s:?}: unknown suffix {c:?} (use K, M or G)"
                    ))
                }
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let v: f64 = num.trim().parse().map_err(|_| {
        format!("invalid size {s:?}: expected a number with an optional K/M/G suffix")
    })?;
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("invalid size {s:?}"));
    }
    Ok(bytes as u64)
}

/// Chooses the step from `-f` and `-i` like nccl-tests: a factor above 1 multiplies; `-i` given
/// without `-f` adds; `-f 1` adds `-i` (1 MiB when `-i` is not given, nccl-tests' default).
///
/// # Errors
/// For `-f 0` or `-i 0`.
pub fn step_from(factor: Option<u64>, step_bytes: Option<u64>) -> Result<Step, String> {
    match (factor, step_bytes) {
        (Some(0), _) => Err("-f/--stepfactor must be at least 1".into()),
        (_, Some(0)) => Err("-i/--stepbytes must be at least 1".into()),
        (Some(f), _) if f > 1 => Ok(Step::Factor(f)),
        (Some(_), b) => Ok(Step::Bytes(b.unwrap_or(1 << 20))),
        (None, Some(b)) => Ok(Step::Bytes(b)),
        (None, None) => Ok(Step::Factor(2)),
    }
}

/// The most sizes one sweep may have (each is measured, so more would take days anyway).
pub const MAX_SWEEP_SIZES: u64 = 10_000;

/// The sizes of a sweep, `min` to `max` inclusive (as nccl-tests: `max` itself appears only if
/// the steps land on it).
///
/// # Errors
/// When `min > max`, `min == 0` with a multiplicative step (it would never grow), or the sweep
/// would have more than [`MAX_SWEEP_SIZES`] sizes.
pub fn sweep(min: u64, max: u64, step: Step) -> Result<Vec<u64>, String> {
    if min > max {
        return Err(format!(
            "invalid sizes: -b/--minbytes {min} is larger than -e/--maxbytes {max}"
        ));
    }
    if min == 0 && matches!(step, Step::Factor(_)) {
        return Err("-b/--minbytes must be at least 1 with a step factor".into());
    }
    if let Step::Bytes(b) = step {
        // A multiplicative step has at most 64 sizes; an additive one can have billions.
        let count = ((max - min) / b.max(1)).saturating_add(1);
        if count > MAX_SWEEP_SIZES {
            return Err(format!(
                "-b/--minbytes {min} to -e/--maxbytes {max} in steps of -i/--stepbytes {b} is \
                 {count} sizes, more than the {MAX_SWEEP_SIZES} a sweep may have: use a larger \
                 -i/--stepbytes, a -f/--stepfactor above 1, or a narrower -b/-e range"
            ));
        }
    }
    let mut out = Vec::new();
    let mut s = min;
    while s <= max {
        out.push(s);
        let next = match step {
            Step::Factor(f) => s.checked_mul(f),
            Step::Bytes(b) => s.checked_add(b),
        };
        match next {
            Some(n) => s = n,
            None => break,
        }
    }
    Ok(out)
}

/// Buffer geometry of one row, in elements, as nccl-tests computes it from the nominal size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// The `size` column: the full buffer in bytes (rounded down).
    pub bytes: usize,
    /// The `count` column: the count passed to the call (per-rank count for reduce-scatter,
    /// all-gather, gather, scatter, all-to-all).
    pub count: usize,
    /// Elements of the full buffer (`bytes / type size`).
    pub full: usize,
    /// Elements of this rank's input (out of place).
    pub input: usize,
    /// Elements of this rank's output (out of place).
    pub output: usize,
}

/// Whether oxccl has an in-place form of the collective (else the in-place columns are N/A).
pub fn has_in_place(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllReduce
            | Collective::ReduceScatter
            | Collective::AllGather
            | Collective::Broadcast
            | Collective::Reduce
    )
}

/// Whether `oxccl perf` can run the collective (everything but the barrier; the `-v` forms on
/// host buffers, with the block sizes `--skew` gives, see `bench::skewed_counts`).
pub fn supported(c: Collective) -> bool {
    !matches!(c, Collective::Barrier)
}

/// The geometry of a row of nominal size `size` bytes for elements of `ts` bytes on `n` ranks.
pub fn geometry(c: Collective, size: u64, ts: usize, n: usize) -> Geometry {
    let count = usize::try_from(size).unwrap_or(usize::MAX) / ts;
    let per = count / n.max(1);
    let (param, full, input, output) = match c {
        Collective::ReduceScatter => (per, per * n, per * n, per),
        Collective::AllGather | Collective::Gather => (per, per * n, per, per * n),
        Collective::Scatter => (per, per * n, per * n, per),
        Collective::AllToAll | Collective::AllToAllV => (per, per * n, per * n, per * n),
        // Shards of `bench::skewed_counts(per, n, skew)` elements: at most 2 x per each, so the
        // full buffer bounds both sides.
        Collective::AllGatherV
        | Collective::ReduceScatterV
        | Collective::GatherV
        | Collective::ScatterV => (per, per * n, per * n, per * n),
        _ => (count, count, count, count),
    };
    Geometry {
        bytes: full * ts,
        count: param,
        full,
        input,
        output,
    }
}

/// nccl-tests' bus-bandwidth factor: busbw = algbw x factor.
pub fn busbw_factor(c: Collective, n: usize) -> f64 {
    let n = n.max(1) as f64;
    match c {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::ReduceScatter
        | Collective::AllGather
        | Collective::AllToAll
        | Collective::AllToAllV
        | Collective::AllGatherV
        | Collective::ReduceScatterV
        | Collective::GatherV
        | Collective::ScatterV
        | Collective::Gather
        | Collective::Scatter => (n - 1.0) / n,
        _ => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_nccl_tests() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("64m").unwrap(), 64 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1.5K").unwrap(), 1536);
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1").is_err());
    }

    #[test]
    fn sweeps_multiply_or_add() {
        let s = sweep(8, 64 << 10, step_from(Some(4), None).unwrap()).unwrap();
        assert_eq!(s, vec![8, 32, 128, 512, 2048, 8192, 32768]);
        let s = sweep(8, 64, step_from(None, None).unwrap()).unwrap();
        assert_eq!(s, vec![8, 16, 32, 64]);
        let s = sweep(100, 400, step_from(None, Some(100)).unwrap()).unwrap();
        assert_eq!(s, vec![100, 200, 300, 400]);
        assert_eq!(step_from(Some(1), None).unwrap(), Step::Bytes(1 << 20));
        assert_eq!(step_from(Some(3), Some(5)).unwrap(), Step::Factor(3));
        assert_eq!(sweep(5, 5, Step::Factor(2)).unwrap(), vec![5]);
        assert!(sweep(9, 8, Step::Factor(2)).is_err());
        assert!(sweep(0, 8, Step::Factor(2)).is_err());
        assert!(step_from(Some(0), None).is_err());
        assert!(step_from(None, Some(0)).is_err());
        let s = sweep(u64::MAX / 2, u64::MAX, Step::Factor(4)).unwrap();
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn sweeps_with_too_many_sizes_are_refused() {
        // -b 1 -e 4G -i 1: four billion sizes.
        let e = sweep(1, 4 << 30, Step::Bytes(1)).unwrap_err();
        for flag in ["-b/", "-e/", "-i/", "-f/", "10000"] {
            assert!(e.contains(flag), "{flag} not in {e:?}");
        }
        assert!(sweep(0, u64::MAX, Step::Bytes(1)).is_err());
        let n = MAX_SWEEP_SIZES;
        assert_eq!(sweep(1, n, Step::Bytes(1)).unwrap().len() as u64, n);
        assert!(sweep(1, n + 1, Step::Bytes(1)).is_err());
        assert_eq!(sweep(1, u64::MAX, Step::Factor(2)).unwrap().len(), 64);
    }

    #[test]
    fn busbw_factors_are_nccl_tests() {
        let n = 4;
        assert_eq!(busbw_factor(Collective::AllReduce, n), 1.5);
        for c in [
            Collective::ReduceScatter,
            Collective::AllGather,
            Collective::AllToAll,
            Collective::AllToAllV,
            Collective::AllGatherV,
            Collective::ReduceScatterV,
            Collective::GatherV,
            Collective::ScatterV,
            Collective::Gather,
            Collective::Scatter,
        ] {
            assert_eq!(busbw_factor(c, n), 0.75, "{c}");
        }
        for c in [
            Collective::Broadcast,
            Collective::Reduce,
            Collective::SendRecv,
        ] {
            assert_eq!(busbw_factor(c, n), 1.0, "{c}");
        }
        assert_eq!(busbw_factor(Collective::AllReduce, 2), 1.0);
    }

    #[test]
    fn geometry_rounds_down_like_nccl_tests() {
        // 3 ranks, float: 100 B = 25 floats; 8 per rank.
        let g = geometry(Collective::ReduceScatter, 100, 4, 3);
        assert_eq!((g.bytes, g.count, g.input, g.output), (96, 8, 24, 8));
        let g = geometry(Collective::AllGather, 100, 4, 3);
        assert_eq!((g.bytes, g.count, g.input, g.output), (96, 8, 8, 24));
        let g = geometry(Collective::AllReduce, 100, 8, 3);
        assert_eq!((g.bytes, g.count, g.input, g.output), (96, 12, 12, 12));
        let g = geometry(Collective::AllToAll, 64, 4, 3);
        assert_eq!((g.bytes, g.count, g.input, g.output), (60, 5, 15, 15));
        let g = geometry(Collective::Scatter, 8, 4, 3);
        assert_eq!((g.bytes, g.count), (0, 0));
        let g = geometry(Collective::SendRecv, 10, 4, 3);
        assert_eq!((g.bytes, g.count, g.full), (8, 2, 2));
    }
}
