//! The memory-traffic floor of a shared-memory all-gather and broadcast on this machine: the
//! data movement any implementation must do, done in the most favourable way there is. N
//! threads of one process stand for the ranks and write straight into each other's output
//! buffers: no staging, no slots, no synchronisation inside the timed copy. What this takes
//! is the best any algorithm could reach here, the floor against which to read the all-gather
//! and broadcast rows of docs/PERF.md and OpenMPI's figure for the same size in the same run.
//!
//! All-gather (`--bytes` is the whole output per rank, nccl-tests' convention): thread j reads
//! its input once, block by block, and writes each block into chunk j of every rank's output;
//! in place, rank j's own chunk is its input and is not written. Broadcast: the bytes every
//! destination needs (each non-root rank's output, and out of place the root's own) are split
//! evenly over the threads, each copying its share of the root's (rank 0's) buffer into every
//! destination; in place, the root's output is the source. Each iteration is timed on thread 0
//! from one barrier to the next; busbw is nccl-tests' (from the median), and every output is
//! checked after the timed iterations. Every copy is `oxccl_kernels::copy_streaming`, the copy
//! the shared-memory collectives use for large blocks (non-temporal stores: a destination line
//! is written without being read first), so the floor moves no more bytes through memory than
//! they do.
//!
//! ```sh
//! cargo run --release -p oxccl-comm --example copy_floor -- --np 2 --bytes 64M --iters 20
//! ```
use std::process::exit;
use std::sync::Barrier;
use std::thread;
use std::time::Instant;

use oxccl_kernels::copy_streaming;

/// Bytes of an all-gather input copied into every destination before the next block is read.
const BLOCK: usize = 256 << 10;

const USAGE: &str = "usage: copy_floor [--np N] [--bytes SIZE] [--iters K] [--warmup W]\n  \
    defaults: N=2, SIZE=64M (suffixes K, M, G are powers of 1024), K=20, W=3";

struct Opts {
    np: usize,
    bytes: usize,
    iters: usize,
    warmup: usize,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (digits, unit) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&s[..i], c.to_ascii_uppercase()),
        _ => (s, ' '),
    };
    let shift = match unit {
        ' ' => 0,
        'K' => 10,
        'M' => 20,
        'G' => 30,
        _ => return Err(format!("unknown size suffix in {s:?} (use K, M or G)")),
    };
    let n: usize = digits
        .parse()
        .map_err(|_| format!("not a size: {s:?} (e.g. 4096, 64K, 16M, 1G)"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("size too large: {s:?}"))
}

fn parse_args() -> Result<Opts, String> {
    let mut o = Opts {
        np: 2,
        bytes: 64 << 20,
        iters: 20,
        warmup: 3,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            exit(0);
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let count = || {
            value
                .parse::<usize>()
                .map_err(|_| format!("{flag}: not a whole number: {value:?}"))
        };
        match flag.as_str() {
            "--np" => o.np = count()?,
            "--bytes" => o.bytes = parse_size(&value)?,
            "--iters" => o.iters = count()?,
            "--warmup" => o.warmup = count()?,
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    if o.np == 0 || o.iters == 0 {
        return Err("--np and --iters must be at least 1".into());
    }
    if o.bytes == 0 || !o.bytes.is_multiple_of(o.np) {
        return Err(format!(
            "--bytes ({}) must be a positive multiple of --np ({})",
            o.bytes, o.np
        ));
    }
    Ok(o)
}

/// Byte `k` of rank `rank`'s data; its complement marks a byte not yet written.
fn pattern(rank: usize, k: usize) -> u8 {
    ((k % 251) as u8) ^ (rank as u8).wrapping_mul(37)
}

/// One buffer per rank, each allocated and first touched by a thread of its own.
fn per_rank(n: usize, make: impl Fn(usize) -> Vec<u8> + Sync) -> Vec<Vec<u8>> {
    let make = &make;
    thread::scope(|s| join_all((0..n).map(|r| s.spawn(move || make(r))).collect()))
}

/// Joins scoped threads in order, passing a thread's panic on.
fn join_all<T>(handles: Vec<thread::ScopedJoinHandle<'_, T>>) -> Vec<T> {
    let join = |h: thread::ScopedJoinHandle<'_, T>| {
        h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
    };
    handles.into_iter().map(join).collect()
}

/// Runs `work[i]` on thread i, `warmup + iters` times between barriers; returns thread 0's
/// timed iterations in microseconds.
fn time_threads<F: FnMut() + Send>(work: Vec<F>, warmup: usize, iters: usize) -> Vec<f64> {
    let barrier = &Barrier::new(work.len());
    thread::scope(|s| {
        let handles: Vec<_> = work
            .into_iter()
            .map(|mut w| {
                s.spawn(move || {
                    let mut us = Vec::with_capacity(iters);
                    for it in 0..warmup + iters {
                        barrier.wait();
                        let t0 = Instant::now();
                        w();
                        barrier.wait();
                        if it >= warmup {
                            us.push(t0.elapsed().as_secs_f64() * 1e6);
                        }
                    }
                    us
                })
            })
            .collect();
        join_all(handles).into_iter().next().unwrap_or_default()
    })
}

/// Reads `src` once, writing each block into every destination before reading the next.
fn copy_blocks(src: &[u8], dests: &mut [&mut [u8]]) {
    for (b, block) in src.chunks(BLOCK).enumerate() {
        let at = b * BLOCK;
        for d in dests.iter_mut() {
            copy_streaming(&mut d[at..at + block.len()], block);
        }
    }
}

/// Timed iterations (us) and wrong output bytes of an all-gather.
fn all_gather(o: &Opts, in_place: bool) -> (Vec<f64>, usize) {
    let (n, chunk) = (o.np, o.bytes / o.np);
    let inputs = per_rank(n, |r| match in_place {
        true => Vec::new(),
        false => (0..chunk).map(|k| pattern(r, k)).collect(),
    });
    let mut outputs = per_rank(n, |r| {
        let byte = |k: usize| match (k / chunk, k % chunk) {
            (j, at) if in_place && j == r => pattern(j, at),
            (j, at) => !pattern(j, at),
        };
        (0..o.bytes).map(byte).collect()
    });
    // Thread j's source and destinations: its input and chunk j of every rank's output.
    let mut srcs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
    let mut dests: Vec<Vec<&mut [u8]>> = (0..n).map(|_| Vec::with_capacity(n)).collect();
    for (i, out) in outputs.iter_mut().enumerate() {
        for (j, c) in out.chunks_mut(chunk).enumerate() {
            match in_place && i == j {
                true => srcs[j] = c,
                false => dests[j].push(c),
            }
        }
    }
    let work = srcs
        .into_iter()
        .zip(dests)
        .map(|(src, mut ds)| move || copy_blocks(src, &mut ds))
        .collect();
    let us = time_threads(work, o.warmup, o.iters);
    let wrong = outputs
        .iter()
        .flat_map(|out| out.iter().enumerate())
        .filter(|&(k, &b)| b != pattern(k / chunk, k % chunk))
        .count();
    (us, wrong)
}

/// Timed iterations (us) and wrong output bytes of a broadcast from rank 0.
fn broadcast(o: &Opts, in_place: bool) -> (Vec<f64>, usize) {
    let inputs = per_rank(o.np, |r| match r == 0 && !in_place {
        true => (0..o.bytes).map(|k| pattern(0, k)).collect(),
        false => Vec::new(),
    });
    let mut outputs = per_rank(o.np, |r| {
        let flip = if r == 0 && in_place { 0 } else { 0xff };
        (0..o.bytes).map(|k| pattern(0, k) ^ flip).collect()
    });
    let (out0, rest) = outputs.split_first_mut().expect("--np is at least 1");
    let (src, dest0): (&[u8], Option<&mut [u8]>) = match in_place {
        true => (out0, None),
        false => (&inputs[0], Some(out0)),
    };
    let dests = std::iter::once(dest0).chain(rest.iter_mut().map(|v| Some(v.as_mut_slice())));
    // Every thread copies its share of the root's buffer into every destination, so that all
    // cores copy (one thread per destination would leave the root's core idle in place).
    let part = o.bytes.div_ceil(o.np).max(1);
    let mut jobs: Vec<Vec<(&[u8], &mut [u8])>> = (0..o.np).map(|_| Vec::new()).collect();
    for d in dests.flatten() {
        for (t, (dc, sc)) in d.chunks_mut(part).zip(src.chunks(part)).enumerate() {
            jobs[t].push((sc, dc));
        }
    }
    let work = jobs
        .into_iter()
        .map(|mut js| {
            move || {
                for (s, d) in js.iter_mut() {
                    copy_streaming(d, s);
                }
            }
        })
        .collect();
    let us = time_threads(work, o.warmup, o.iters);
    let wrong = outputs
        .iter()
        .flat_map(|out| out.iter().enumerate())
        .filter(|&(k, &b)| b != pattern(0, k))
        .count();
    (us, wrong)
}

fn main() {
    let o = parse_args().unwrap_or_else(|e| {
        eprintln!("copy_floor: {e}\n{USAGE}");
        exit(2);
    });
    let mut any_wrong = false;
    for coll in ["all-gather", "broadcast"] {
        for in_place in [false, true] {
            let (mut us, wrong) = match coll {
                "all-gather" => all_gather(&o, in_place),
                _ => broadcast(&o, in_place),
            };
            us.sort_by(f64::total_cmp);
            let k = us.len();
            let median = (us[(k - 1) / 2] + us[k / 2]) / 2.0;
            let algbw = o.bytes as f64 / median / 1e3; // bytes/us -> GB/s
            let busbw = match coll {
                "all-gather" => algbw * (o.np - 1) as f64 / o.np as f64,
                _ => algbw,
            };
            let place = if in_place { "in-place" } else { "out-of-place" };
            println!(
                "copy_floor {coll} np={} bytes={} {place} median_us={median:.1} min_us={:.1} \
                 busbw_GBps={busbw:.2} wrong={wrong}",
                o.np, o.bytes, us[0]
            );
            any_wrong |= wrong > 0;
        }
    }
    if any_wrong {
        exit(1);
    }
}
