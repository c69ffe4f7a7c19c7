//! Prints the PTX of oxccl's CUDA kernels for one architecture (default `compute_90`), or the
//! generated CUDA source with `--source`: for reading what NVRTC makes of the kernels.
//!
//! `LD_LIBRARY_PATH=<nvrtc lib dir> cargo run -p oxccl-kernels --features cuda --example cuda_ptx -- compute_90`

fn main() {
    let arg = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "compute_90".into());
    if arg == "--source" {
        print!("{}", oxccl_kernels::cuda::source());
        return;
    }
    match oxccl_kernels::cuda::compile_ptx(&arg) {
        Ok(ptx) => print!("{ptx}"),
        Err(e) => {
            eprintln!("cuda_ptx: {e}");
            std::process::exit(1);
        }
    }
}
