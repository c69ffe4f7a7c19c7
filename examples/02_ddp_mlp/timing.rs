//! Timing for 02_ddp_mlp: `--balance` (the batch at which backward takes as long as the
//! all-reduce) and `--mode all` (every mode timed, interleaved, and the ratios between them).

use std::time::Duration;

use oxccl::comm::{Communicator, ReduceOp};
use oxccl::ddp::{DdpConfig, Overlap};

use crate::mlp::{self, Mode, Shape};
use crate::{Args, Setup};

fn median_ms(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// The slowest rank's median of `what` over `steps` steps of `mode` (step 0 left out).
fn timed(
    comm: &Communicator,
    shape: &Shape,
    cfg: &DdpConfig,
    mode: Mode,
    what: fn(&mlp::StepReport) -> Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    let mut v = Vec::new();
    mlp::train_ddp(comm, shape, 6, mode, cfg.clone(), |step, _, _, r| {
        if step > 0 {
            v.push(what(&r));
        }
        Ok(())
    })?;
    let mut ms = [median_ms(v)];
    comm.all_reduce(&mut ms, ReduceOp::Max)?;
    Ok(ms[0])
}

/// `--balance`: the batch at which backward takes about as long as the all-reduce of the
/// gradients. Backward's time is fitted as a line in the batch (it has a part that does not
/// grow with it: reading every weight) from `--batch` and twice that. Every rank computes it
/// from the same maxima, so every rank gets the same.
pub(crate) fn balance(
    comm: &Communicator,
    shape: &Shape,
    cfg: &DdpConfig,
) -> Result<usize, Box<dyn std::error::Error>> {
    let comm_ms = timed(comm, shape, cfg, Mode::CommOnly, |r| r.time)?;
    let b0 = shape.batch.max(1);
    let at = |batch: usize| {
        let s = Shape {
            batch,
            ..shape.clone()
        };
        timed(comm, &s, cfg, Mode::ComputeOnly, |r| r.backward)
    };
    let (t0, t1) = (at(b0)?, at(2 * b0)?);
    let per_sample = (t1 - t0) / b0 as f64;
    let batch = if per_sample > 0.0 {
        let fixed = t0 - per_sample * b0 as f64;
        // At most 16 times --batch: a slope lost in noise would otherwise ask for thousands.
        let most = (16 * b0).min(4096) as f64;
        ((comm_ms - fixed) / per_sample).round().clamp(1.0, most) as usize
    } else {
        b0
    };
    if comm.rank() == 0 {
        println!(
            "# balance: comm only {comm_ms:.2} ms; backward {t0:.2} ms at batch {b0}, {t1:.2} ms at \
             batch {}: batch {batch}",
            2 * b0
        );
    }
    Ok(batch)
}
/// `--mode all`'s modes, in the order they are timed and printed: name, how gradients are
/// communicated, and `DdpConfig::overlap`.
const ALL_MODES: [(&str, Mode, Overlap); 7] = [
    ("compute only", Mode::ComputeOnly, Overlap::Auto),
    ("comm only", Mode::CommOnly, Overlap::Auto),
    ("backward then all-reduce", Mode::After, Overlap::Auto),
    ("ddp overlap", Mode::Overlap, Overlap::On),
    ("ddp, overlap off", Mode::Overlap, Overlap::Off),
    ("ddp in place", Mode::InPlace, Overlap::On),
    ("ddp in place, overlap off", Mode::InPlace, Overlap::Off),
];

/// `--mode all`: times every mode of [`ALL_MODES`], interleaved, and rank 0 prints them and the
/// ratios between them.
pub(crate) fn run_every_mode(
    setup: &Setup<'_>,
    shape: &Shape,
    cfg: &DdpConfig,
) -> Result<(), Box<dyn std::error::Error>> {
    let comm = setup.comm;
    // What Overlap::Auto picks for these ranks (agreed across ranks, as `Ddp::new` does).
    let mut auto = [u8::from(comm.stats().node_holds(2))];
    comm.all_reduce(&mut auto, ReduceOp::Min)?;
    let med = time_every_mode(setup, shape, cfg)?;
    if comm.rank() == 0 {
        print_every_mode(setup.args, comm, &med, auto[0] == 1);
    }
    Ok(())
}

/// The medians of [`ALL_MODES`] over `--rounds` rounds of `--steps` steps each (step 0 left
/// out), the maximum over ranks: step times, then backward passes, then the waits in
/// `finish()` or `sync()`, then the rest of the step, each in the order of [`ALL_MODES`].
fn time_every_mode(
    setup: &Setup<'_>,
    shape: &Shape,
    cfg: &DdpConfig,
) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
    let n = ALL_MODES.len();
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); 4 * n];
    for _ in 0..setup.args.rounds {
        for (k, &(_, mode, overlap)) in ALL_MODES.iter().enumerate() {
            let cfg = DdpConfig {
                overlap,
                ..cfg.clone()
            };
            let steps = setup.args.steps;
            let run = mlp::Run {
                steps,
                join: false,
                mode,
                cfg,
                hook: setup.hook()?,
                average: setup.averager()?,
            };
            mlp::train_ddp_run(setup.comm, shape, run, |step, _, _, r| {
                if step > 0 {
                    // Step 0 warms up.
                    times[k].push(r.time);
                    times[n + k].push(r.backward);
                    times[2 * n + k].push(r.exposed);
                    times[3 * n + k].push(r.time.saturating_sub(r.backward + r.exposed));
                }
                Ok(())
            })?;
        }
    }
    // The slowest rank sets the pace: report the maximum of every rank's median.
    let mut med: Vec<f64> = times.into_iter().map(median_ms).collect();
    setup.comm.all_reduce(&mut med, ReduceOp::Max)?;
    Ok(med)
}

/// Prints the medians of [`time_every_mode`], then the ratios of [`print_ratios`]. `auto_on`:
/// what `Overlap::Auto` picks for these ranks.
fn print_every_mode(args: &Args, comm: &Communicator, med: &[f64], auto_on: bool) {
    let n = ALL_MODES.len();
    println!(
        "# median step time over {} rounds x {} steps (max over ranks); of it, backward, \
         the wait in finish() or sync() (what backward did not hide), and the rest \
         (forward, update)",
        args.rounds,
        args.steps.saturating_sub(1)
    );
    for (k, (name, mode, _)) in ALL_MODES.iter().enumerate() {
        print!("{name:>26}: {:8.2} ms", med[k]);
        if *mode != Mode::CommOnly {
            print!("   backward {:7.2} ms", med[n + k]);
        }
        if *mode != Mode::ComputeOnly {
            print!("   finish/sync {:7.2} ms", med[2 * n + k]);
        }
        if *mode != Mode::CommOnly {
            print!("   rest {:7.2} ms", med[3 * n + k]); // forward, update
        }
        println!();
    }
    print_ratios(comm, med, auto_on);
}

/// The step times of [`time_every_mode`]'s medians as ratios to backward then all-reduce: with
/// overlap on and off, in place, what `Overlap::Auto` picks, the best overlap could reach, and
/// what is left to wait for after backward.
fn print_ratios(comm: &Communicator, med: &[f64], auto_on: bool) {
    let n = ALL_MODES.len();
    let (comm_ms, after, overlap, off, bwd) = (med[1], med[2], med[3], med[4], med[n]);
    let (in_place, in_place_off) = (med[5], med[6]);
    // Overlap can hide at most the shorter of backward and the all-reduce.
    let hideable = bwd.min(comm_ms);
    if after <= 0.0 || hideable <= 0.0 {
        println!("# no ratios: no step was timed (--steps 2 or more, --rounds 1 or more)");
        return;
    }
    println!(
        "# overlap / (backward then all-reduce) = {:.3}",
        overlap / after
    );
    let node = comm.stats().node;
    let (pick, picked, picked_in_place) = if auto_on {
        ("on", overlap, in_place)
    } else {
        ("off", off, in_place_off)
    };
    println!(
        "# overlap off / (backward then all-reduce) = {:.3}; in place: on {:.3}, off \
         {:.3}",
        off / after,
        in_place / after,
        in_place_off / after
    );
    println!(
        "# Overlap::Auto picks {pick} here ({} CPUs for {} ranks on rank 0's node): \
         {:.3}, in place {:.3}",
        node.cpus.map_or("unknown".into(), |c| c.to_string()),
        node.ranks,
        picked / after,
        picked_in_place / after
    );
    println!(
        "# at best (min(backward, comm only) hidden) = {:.3}; hidden: {:.0} % of that",
        (after - hideable) / after,
        100.0 * (after - overlap) / hideable
    );
    // What each step still waits for after backward: the whole all-reduce after `sync`, what
    // overlap left of it in `finish()` (the backward column says what overlapping cost
    // backward instead).
    let (sync_ms, fin, fin_in_place) = (med[2 * n + 2], med[2 * n + 3], med[2 * n + 5]);
    if sync_ms > 0.0 {
        println!(
            "# left after backward: sync {sync_ms:.2} ms; overlapping, finish() {fin:.2} \
             ms ({:.0} % of sync), in place {fin_in_place:.2} ms ({:.0} %)",
            100.0 * fin / sync_ms,
            100.0 * fin_in_place / sync_ms
        );
    }
}
