//! Device bandwidth of oxccl's reduce kernels against a device-to-device copy, same run.
//!
//! For f32, bf16, f8e4m3 and f8e5m2 (or the comma-separated dtypes given) at 256 MiB per buffer: `cuMemcpyDtoD` (the reference), oxccl's copy kernel,
//! and reduce with 2, 4 and 8 inputs. Bandwidth counts every byte read and written (copy: 2 x
//! buffer, k-input reduce: (k + 1) x buffer); the last column is that bandwidth as a fraction of
//! the copy's. Times are medians of 20 launches (CUDA events) after 3 warm-ups.
//!
//! `cargo run --release -p oxccl-kernels --features cuda --example cuda_bench [-- MiB [DTYPES]]`

use std::sync::Arc;

use cudarc::driver::{sys::CUevent_flags, CudaContext, CudaSlice, CudaStream};
use oxccl_kernels::cuda::CudaKernels;
use oxccl_kernels::{DType, ReduceOp};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn time_ms(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    mut f: impl FnMut() -> Res<()>,
) -> Res<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut t = Vec::new();
    for _ in 0..20 {
        let a = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let b = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        a.record(stream)?;
        f()?;
        b.record(stream)?;
        t.push(f64::from(a.elapsed_ms(&b)?));
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn main() -> Res<()> {
    let mib: usize = std::env::args().nth(1).map_or(Ok(256), |s| s.parse())?;
    let bytes = mib << 20;
    let dtypes: Vec<DType> = std::env::args()
        .nth(2)
        .unwrap_or_else(|| "f32,bf16,f8e4m3,f8e5m2".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    if !oxccl_kernels::cuda::driver_available() {
        return Err("no CUDA driver or device".into());
    }
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let k = CudaKernels::new(&ctx)?;
    println!("# device: {}, buffers of {mib} MiB", ctx.name()?);
    println!(
        "# {:<6} {:<14} {:>10} {:>10} {:>9}",
        "dtype", "kernel", "time ms", "GB/s", "vs copy"
    );
    let inputs: Vec<CudaSlice<u8>> = (0..8)
        .map(|_| stream.alloc_zeros::<u8>(bytes))
        .collect::<Result<_, _>>()?;
    let mut out = stream.alloc_zeros::<u8>(bytes)?;
    for dt in dtypes {
        let copy = time_ms(&ctx, &stream, || {
            stream.memcpy_dtod(&inputs[0], &mut out)?;
            Ok(())
        })?;
        let copy_bw = 2.0 * bytes as f64 / copy / 1e6;
        let row = |name: &str, ms: f64, traffic: f64| {
            let bw = traffic * bytes as f64 / ms / 1e6;
            println!(
                "  {:<6} {:<14} {:>10.3} {:>10.1} {:>8.1}%",
                dt.short_name(),
                name,
                ms,
                bw,
                100.0 * bw / copy_bw
            );
        };
        row("memcpy-dtod", copy, 2.0);
        let t = time_ms(&ctx, &stream, || {
            k.copy_bytes(&stream, &mut out.as_view_mut(), &inputs[0].as_view())?;
            Ok(())
        })?;
        row("oxccl-copy", t, 2.0);
        for n in [2usize, 4, 8] {
            let views: Vec<_> = inputs[..n].iter().map(|s| s.as_view()).collect();
            let refs: Vec<_> = views.iter().collect();
            let t = time_ms(&ctx, &stream, || {
                k.reduce_bytes(&stream, dt, ReduceOp::Sum, &mut out.as_view_mut(), &refs)?;
                Ok(())
            })?;
            row(&format!("reduce-{n}"), t, (n + 1) as f64);
        }
    }
    Ok(())
}
