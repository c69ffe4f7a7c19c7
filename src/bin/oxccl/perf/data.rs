//! Deterministic buffer contents and their expected results, exact for every dtype and op.
//!
//! Rank `r`'s value at buffer index `i` is `table[r][i % PERIOD]`, a small positive integer
//! (1..=m) chosen by a hash of `(r, i % PERIOD)`. `m` keeps every partial sum exactly
//! representable (`n * m <= 256` for bfloat16, `<= 2048` for half, `<= 16` for f8e4m3, `<= 8`
//! for f8e5m2), so the result does not depend on the order in which an algorithm combines ranks
//! (with more ranks than that, the values are 0 or 1 with at most the limit of ones per index); integer sums and products wrap, which is
//! order-independent as well. For `prod` the values are 1 or 2, so products are exact powers of
//! two (or overflow to infinity the same way in any order). The expected reduction of index `i`
//! is the kernels' own scalar reference (`reference_reduce`) over the ranks' values, which also
//! rounds `avg` exactly as the kernels do (integers truncate). For `premul_sum` rank `r` passes
//! factor [`premul_factor`]`(r)` (1 or 2) and the limits above are halved.

use oxccl_comm::{Element, ReduceOp};
use oxccl_kernels::{reference_reduce, scale, DType};

/// Period of the value pattern along a buffer (a prime, so shifted data is caught).
pub const PERIOD: usize = 1021;

/// The value tables of one (dtype, op) run on `n` ranks.
pub struct Pattern<T> {
    /// `tables[r][j]`: rank r's value at indices `j (mod PERIOD)`.
    tables: Vec<Vec<T>>,
    /// The expected reduction over all ranks at indices `j (mod PERIOD)`.
    reduced: Vec<T>,
}

fn mix(r: usize, j: usize) -> u32 {
    let mut h = (j as u32)
        .wrapping_mul(0x9E37_79B1)
        .wrapping_add((r as u32).wrapping_mul(0x85EB_CA77));
    h ^= h >> 15;
    h = h.wrapping_mul(0x2C1B_3C6D);
    h ^ (h >> 13)
}

/// Rank `r`'s factor in a `premul_sum` run: 1 on even ranks, 2 on odd ones (a power of two, so
/// every product is exact, and whole, so every integer type takes it).
pub fn premul_factor(r: usize) -> f64 {
    if r % 2 == 1 {
        2.0
    } else {
        1.0
    }
}

/// The operation rank `r` passes for `op`: a `premul_sum` with the rank's own factor.
pub fn rank_op(op: ReduceOp, r: usize) -> ReduceOp {
    match op {
        ReduceOp::PreMulSum(_) => ReduceOp::premul_sum(premul_factor(r)),
        op => op,
    }
}

/// The largest integer up to which every sum of `dtype` values is exact (for `sum` and `avg`;
/// half of it for `premul_sum`, whose factors double some values).
fn exact_limit(dtype: DType, op: Option<ReduceOp>) -> usize {
    let limit = match dtype {
        DType::BF16 => 256,
        DType::F16 => 2048,
        DType::F8E4M3 => 16,
        DType::F8E5M2 => 8,
        _ => return usize::MAX,
    };
    match op {
        Some(ReduceOp::Sum | ReduceOp::Avg) => limit,
        Some(ReduceOp::PreMulSum(_)) => limit / 2,
        _ => usize::MAX,
    }
}

/// The largest value used so that `n` values sum exactly in `dtype`: 1..=m, or 0 when even `n`
/// ones would not sum exactly (more ranks than the limit).
fn value_range(dtype: DType, op: Option<ReduceOp>, n: usize) -> u32 {
    (exact_limit(dtype, op) / n.max(1)).min(100) as u32
}

impl<T: Element> Pattern<T> {
    /// Tables for `n` ranks; `op` is the reduction (None for data-movement collectives).
    pub fn new(n: usize, op: Option<ReduceOp>) -> Pattern<T> {
        let m = value_range(T::DTYPE, op, n);
        // With more ranks than the type sums exactly, only every k-th rank (shifting along the
        // buffer) contributes a 1, so at most the limit of ones meet at any index.
        let k = n.div_ceil(exact_limit(T::DTYPE, op).min(n).max(1));
        let value = |r: usize, j: usize| -> f64 {
            let h = mix(r, j);
            if m == 0 {
                f64::from(u8::from((r + j).is_multiple_of(k)))
            } else if op == Some(ReduceOp::Prod) {
                if h.is_multiple_of(5) {
                    2.0
                } else {
                    1.0
                }
            } else {
                f64::from(1 + h % m)
            }
        };
        let tables: Vec<Vec<T>> = (0..n)
            .map(|r| (0..PERIOD).map(|j| T::from_f64(value(r, j))).collect())
            .collect();
        let reduced = match op {
            Some(op) => {
                let mut vals = Vec::with_capacity(n);
                (0..PERIOD)
                    .map(|j| {
                        vals.clear();
                        vals.extend(tables.iter().enumerate().map(|(r, t)| premul(op, r, t[j])));
                        reference_reduce(&vals, op.factor().map_or(op, |_| ReduceOp::Sum))
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        Pattern { tables, reduced }
    }

    /// Rank `r`'s values.
    pub fn rank(&self, r: usize) -> &[T] {
        &self.tables[r]
    }

    /// The expected reduction.
    pub fn reduced(&self) -> &[T] {
        &self.reduced
    }
}

/// Rank `r`'s value `v` as it enters the sum of a `premul_sum` (times the rank's factor, rounded
/// as the kernels round); `v` itself for other operations.
fn premul<T: Element>(op: ReduceOp, r: usize, v: T) -> T {
    match rank_op(op, r).factor() {
        Some(f) => {
            let mut out = [v];
            scale(&mut out, f).expect("the perf factors are whole");
            out[0]
        }
        None => v,
    }
}

/// `dst[k] = table[(start + k) % PERIOD]`.
pub fn fill<T: Copy>(dst: &mut [T], table: &[T], start: usize) {
    let mut pos = start % table.len();
    let mut done = 0;
    while done < dst.len() {
        let take = (table.len() - pos).min(dst.len() - done);
        dst[done..done + take].copy_from_slice(&table[pos..pos + take]);
        done += take;
        pos = 0;
    }
}

/// How many `got[k]` differ from `table[(start + k) % PERIOD]`.
pub fn mismatches<T: Copy + PartialEq>(got: &[T], table: &[T], start: usize) -> u64 {
    let mut pos = start % table.len();
    let mut done = 0;
    let mut wrong = 0u64;
    while done < got.len() {
        let take = (table.len() - pos).min(got.len() - done);
        wrong += got[done..done + take]
            .iter()
            .zip(&table[pos..pos + take])
            .filter(|(a, b)| a != b)
            .count() as u64;
        done += take;
        pos = 0;
    }
    wrong
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxccl_kernels::{bf16, f16, F8E4M3, F8E5M2};

    fn sums_exact<T: Element>(n: usize, op: ReduceOp) {
        let p = Pattern::<T>::new(n, Some(op));
        for j in 0..PERIOD {
            // Every order gives the same result: compare forward and reverse folds.
            let vals: Vec<T> = (0..n).map(|r| premul(op, r, p.rank(r)[j])).collect();
            let mut rev = vals.clone();
            rev.reverse();
            let sum = op.factor().map_or(op, |_| ReduceOp::Sum);
            assert_eq!(
                reference_reduce(&rev, sum),
                p.reduced()[j],
                "{:?} {op}",
                T::DTYPE
            );
        }
    }

    #[test]
    fn reductions_are_order_independent() {
        for op in ReduceOp::ALL.into_iter().chain([ReduceOp::premul_sum(1.0)]) {
            for n in [2, 3, 8] {
                sums_exact::<f32>(n, op);
                sums_exact::<f16>(n, op);
                sums_exact::<bf16>(n, op);
                sums_exact::<i8>(n, op);
                sums_exact::<u64>(n, op);
            }
            // fp8 sums are exact only up to 16 / 8: more ranks take the sparse 0/1 pattern.
            for n in [2, 3, 8, 9, 16, 17, 64] {
                sums_exact::<F8E4M3>(n, op);
                sums_exact::<F8E5M2>(n, op);
            }
        }
        // The sparse pattern still differs between ranks and along the buffer.
        let p = Pattern::<F8E5M2>::new(64, Some(ReduceOp::Sum));
        assert_ne!(p.rank(0), p.rank(1));
        assert!(p.rank(0).iter().any(|v| v.to_f32() == 1.0));
    }

    #[test]
    fn fill_and_compare_wrap_around_the_period() {
        let table: Vec<u32> = (0..PERIOD as u32).collect();
        let mut buf = vec![0u32; 3000];
        fill(&mut buf, &table, 1000);
        assert_eq!(buf[0], 1000);
        assert_eq!(buf[21], 0);
        assert_eq!(buf[2999], ((1000 + 2999) % PERIOD) as u32);
        assert_eq!(mismatches(&buf, &table, 1000), 0);
        buf[5] = 7;
        assert_eq!(mismatches(&buf, &table, 1000), 1);
        assert_eq!(mismatches(&buf[..0], &table, 3), 0);
    }
}
