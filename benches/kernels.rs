//! Host reduction kernels: throughput per dtype and op against `memcpy` of the same bytes.
//!
//! `cargo bench --bench kernels`. Two working-set sizes: 1 MiB (in cache) and 64 MiB (beyond
//! L3: the memory-bandwidth case the "reduce at >= 80% of memcpy" target is about).
//! Throughput counts the bytes of the destination buffer (one read + one write for memcpy; two
//! reads + one write for a reduce).

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use oxccl::kernels::{bf16, f16, reduce, Element, ReduceOp, F8E4M3, F8E5M2};

fn bench_type<T: Element>(c: &mut Criterion, bytes: usize, ops: &[ReduceOp]) {
    let n = bytes / std::mem::size_of::<T>();
    let src: Vec<T> = (0..n).map(|i| T::from_f64((i % 7) as f64)).collect();
    let mut dst: Vec<T> = (0..n).map(|i| T::from_f64((i % 5) as f64)).collect();
    let mut g = c.benchmark_group(format!("kernels/{}B", bytes));
    g.throughput(Throughput::Bytes(bytes as u64));
    g.sample_size(10);
    for &op in ops {
        g.bench_with_input(
            BenchmarkId::new(format!("{}", T::DTYPE), op),
            &op,
            |b, &op| b.iter(|| reduce(black_box(&mut dst), black_box(&src), op).unwrap()),
        );
    }
    g.finish();
}

fn kernels(c: &mut Criterion) {
    for bytes in [1 << 20, 64 << 20] {
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        let mut g = c.benchmark_group(format!("kernels/{}B", bytes));
        g.throughput(Throughput::Bytes(bytes as u64));
        g.sample_size(10);
        g.bench_function("memcpy", |b| {
            b.iter(|| black_box(&mut dst).copy_from_slice(black_box(&src)))
        });
        g.finish();
        bench_type::<f32>(c, bytes, &ReduceOp::ALL);
        if bytes == 1 << 20 {
            bench_type::<f64>(c, bytes, &[ReduceOp::Sum, ReduceOp::Max]);
            bench_type::<f16>(c, bytes, &[ReduceOp::Sum, ReduceOp::Max]);
            bench_type::<bf16>(c, bytes, &[ReduceOp::Sum, ReduceOp::Max]);
            bench_type::<i8>(c, bytes, &[ReduceOp::Sum, ReduceOp::Max]);
            bench_type::<u8>(c, bytes, &[ReduceOp::Sum, ReduceOp::Max]);
            bench_type::<i32>(c, bytes, &[ReduceOp::Sum, ReduceOp::Prod]);
            bench_type::<u32>(c, bytes, &[ReduceOp::Sum, ReduceOp::Min]);
            bench_type::<i64>(c, bytes, &[ReduceOp::Sum, ReduceOp::Prod]);
            bench_type::<u64>(c, bytes, &[ReduceOp::Sum, ReduceOp::Min]);
            bench_type::<F8E4M3>(c, bytes, &[ReduceOp::Sum, ReduceOp::Max]);
            bench_type::<F8E5M2>(c, bytes, &[ReduceOp::Sum, ReduceOp::Max]);
        }
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
