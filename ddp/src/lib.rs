//! oxccl-ddp: data-parallel training on oxccl. Every rank holds a full replica of the model;
//! [`Ddp`] averages the gradients across ranks, in buckets whose all-reduces overlap the backward
//! pass, so each rank applies the same update and the replicas stay bit-identical.
//!
//! # Quick start
//!
//! ```no_run
//! use oxccl_comm::Communicator;
//! use oxccl_ddp::{Ddp, DdpConfig, Param};
//!
//! # fn backward_layer(_l: usize) -> Vec<f32> { vec![0.0; 4] }
//! let comm = Communicator::from_env()?;          // under `oxccl launch -n 4 -- trainer`
//! let (mut w0, mut w1) = (vec![0.5f32; 4], vec![0.25f32; 4]);
//! let mut ddp = Ddp::new(
//!     comm,
//!     &mut [Param::new("w0", &mut w0), Param::new("w1", &mut w1)], // rank 0's values win
//!     DdpConfig::default(),
//! )?;
//! for _step in 0..10 {
//!     // Backward produces the last layer's gradient first: hand each over as it is done,
//!     // and full buckets start their all-reduce while the next layers are computed.
//!     for layer in [1usize, 0] {
//!         ddp.grad_ready(layer, &backward_layer(layer))?;
//!     }
//!     ddp.finish()?; // waits for every bucket
//!     for (w, p) in [(&mut w0, 0), (&mut w1, 1)] {
//!         for (x, g) in w.iter_mut().zip(ddp.grad::<f32>(p)?) {
//!             *x -= 0.1 * g; // the averaged gradient, identical on every rank
//!         }
//!     }
//! }
//! # Ok::<(), oxccl_ddp::DdpError>(())
//! ```
//!
//! A backward pass that can write its results anywhere computes each gradient in its bucket
//! slot instead of handing over a copy (PyTorch's `gradient_as_bucket_view`):
//! [`Ddp::grad_slot`] gives the slot (and whether to overwrite or add to it, in accumulation),
//! [`Ddp::grad_ready_in_place`] declares it done. Skipping the copy also leaves backward less
//! slowed by the all-reduces beside it: where overlap pays (CPUs to spare), the slots make it pay
//! more (docs/PERF.md, "H100 session (2026-11-27)").
//!
//! Frameworks that return all gradients at once (candle, burn) call [`Ddp::sync`] with them
//! instead: it packs bucket by bucket, launching each as soon as it is packed, and writes the
//! averages back.
//!
//! # On the GPU
//!
//! With the `cuda` feature (or `cuda-core`, where the application picks cudarc's link mode),
//! `DeviceDdp` is the same reducer over device gradients (cudarc buffers of f32, f64, f16, bf16):
//! buckets in device memory, copies on the trainer's stream, each full bucket all-reduced on a
//! communication stream after an event, and `finish` making the trainer's stream wait for an
//! event instead of the host waiting. Same calls (`grad_ready`, `grad_slot` /
//! `grad_ready_in_place`, `finish`, `sync`, `accumulate`, `no_sync`, `set_comm_hook` with
//! `AllReduceAvg` or `CompressHook`); no uneven inputs; host-only hooks (PowerSGD, post-local SGD)
//! are refused by name ([`CommHook::on_device`]). Its plan is tested without a GPU, and its GPU
//! tests passed on an H200 (docs/GUIDE.md, "DDP on device gradients").
//!
//! # What it does, as PyTorch's DDP does
//!
//! - **Buckets**: gradients are laid out in flat buffers of one dtype, in reverse parameter
//!   order (the order backward produces them), `bucket_cap_bytes` each (25 MiB), the first
//!   `first_bucket_bytes` (1 MiB). A bucket launches when its last gradient arrives and every
//!   bucket before it has launched, so all ranks launch in the same order whatever order their
//!   gradients arrive in.
//! - **Rebuilt order**: after the first step the buckets are rebuilt from the order in which
//!   gradients arrived on rank 0 (broadcast, so every rank agrees; with uneven inputs, on the
//!   lowest rank that trained in the first step).
//! - **Accumulation**: [`Ddp::accumulate`]`(k)` or the [`Ddp::no_sync`] guard: micro-batches
//!   before the last only add into the buckets; the last one's backward reduces.
//! - **Unused parameters**: a parameter that gets no gradient in a step is named in
//!   [`DdpError::UnusedParameters`], or reduced as zeros with `find_unused_parameters`, which
//!   also lists those no rank used ([`Ddp::unused_on_every_rank`]).
//! - **Comm hooks**: [`CommHook`] replaces the all-reduce of each bucket; [`CompressHook`] sends
//!   f16 or bf16 on the wire; [`PowerSgd`] sends a low-rank approximation of each weight
//!   matrix, with error feedback (PyTorch's `powerSGD_hook`); [`PostLocalSgd`] averages within
//!   a group of ranks (a node) after a warm-up, with [`ModelAverager`] averaging the parameters
//!   over every rank every few steps (PyTorch's `post_localSGD_hook` and
//!   `PeriodicModelAverager`: post-local SGD), or [`HierarchicalAverager`] averaging nested
//!   groups at periods of their own (`HierarchicalModelAverager`).
//! - **Buffers**: [`Ddp::broadcast_buffers`] copies rank 0's (e.g. batch-norm statistics; with
//!   uneven inputs, the lowest rank's that trained in the last step).
//! - **Uneven inputs** (PyTorch's `Join`): with [`DdpConfig::uneven_inputs`] set, a rank that
//!   runs out of data calls [`Ddp::join_step`] in a loop; each call stands in for one step of
//!   the ranks still training (their collectives, with zero gradients) and gives the same
//!   averaged gradients, so a joined rank that applies them keeps an identical replica, optimizer
//!   state included (PyTorch instead broadcasts the final parameters). The loop ends, on every
//!   rank at once, when the last rank joins. The sum is divided by the world size
//!   ([`UnevenInputs::DivideByWorldSize`], PyTorch's default) or by the ranks still training
//!   ([`UnevenInputs::DivideByActiveRanks`]); [`Ddp::active_ranks`] says how many trained.
//!   It costs one all-reduce of a byte per rank in each synchronised step, issued at the first
//!   gradient of its synchronising micro-batch. The trainer's own per-step collectives (a loss
//!   all-reduce, [`Ddp::broadcast_buffers`], which then broadcasts from a rank still training)
//!   go after each step's synchronising `finish()`/`sync()`, and on a joined rank after each
//!   `join_step`.
//!
//! A rank with uneven data, fed through `sync`:
//!
//! ```no_run
//! # use oxccl_ddp::Ddp;
//! # fn backward(_w: &[f32], _batch: &[f32]) -> Vec<f32> { vec![0.0; 4] }
//! # fn sgd(w: &mut [f32], g: &[f32]) { w.iter_mut().zip(g).for_each(|(x, g)| *x -= 0.1 * g) }
//! # fn f(mut ddp: Ddp, my_batches: Vec<Vec<f32>>, w: &mut [f32]) -> oxccl_ddp::Result<()> {
//! // Every rank built `ddp` with DdpConfig { uneven_inputs: UnevenInputs::DivideByActiveRanks, .. }.
//! for batch in &my_batches {        // this rank's own data: as many steps as it has
//!     let mut grads = [backward(w, batch)];
//!     ddp.sync(&mut grads)?;
//!     sgd(w, &grads[0]);
//! }
//! while ddp.join_step()?.is_some() { // then stand in until the last rank is done
//!     sgd(w, ddp.grad::<f32>(0)?);   // the same update as the ranks still training
//! }
//! # Ok(()) }
//! ```
//!
//! # Where overlap does not pay
//!
//! The all-reduce of host memory is CPU work. Where the node has fewer than 2 CPUs per rank,
//! the progress thread can only take turns with the backward pass, and overlapping makes the
//! step slower than backward followed by the all-reduce. [`DdpConfig::overlap`] defaults to
//! [`Overlap::Auto`], which overlaps only where there are 2 CPUs or more per rank and otherwise
//! all-reduces the buckets one after another in `finish()`; [`Ddp::overlaps`] says which.
//! Every rank decides `Auto` alike. [`Ddp::sync`] is not affected: it launches each bucket as
//! soon as it is packed.
//!
//! Gradients are averaged (`ReduceOp::Avg`); with equal local batch sizes the result is the
//! gradient of the global batch's mean loss.
//!
//! Every rank must feed a step the same way (`grad_ready` + `finish`, or `sync`), and no other
//! collective may run on the communicator between a step's first gradient and its `finish()`:
//! buckets launch when each rank's gradients arrive, so another collective could land at a
//! different place in each rank's sequence. `Ddp::new` checks that every rank has the same
//! parameters and `DdpConfig`.
//!
//! Settings that must be alike on every rank are compared in a small all-reduce that takes
//! every value's largest and smallest. The error names each one that differs, with its range
//! across the ranks (`bucket_cap_bytes differs between ranks: 4096 here, from 4096 to 8192
//! across the ranks`), on every rank alike. Compared are:
//! - the `DdpConfig` and parameter list, at [`Ddp::new`];
//! - a comm hook's name and [`CommHook::settings`] (PowerSGD's; post-local SGD's start and
//!   resumed step count), before the first bucket after [`Ddp::set_comm_hook`] (a second
//!   all-reduce names the settings when only their values differ); the step's call reports it,
//!   and every later step fails alike until every rank calls `set_comm_hook` again with hooks
//!   alike;
//! - a [`ModelAverager`]'s period, warm-up, call count, bucket cap and parameter list, at its
//!   first average on each communicator (again after `with_steps` or `with_bucket_cap_bytes`);
//! - a [`HierarchicalAverager`]'s levels, in [`HierarchicalAverager::by_group_sizes`].
//!
//! Without it a rank set up differently would average other steps' values or against other
//! random matrices with no error, or leave the others waiting. The comparison can only name
//! what it meets: a hook set on some ranks only meets another rank's first bucket, and
//! averagers whose first averages fall on different calls meet other collectives; the
//! communicator reports those as a collective mismatch (or a time-out).

//!
//! # After a lost rank
//!
//! A rank that dies makes the step fail on the others with [`DdpError::Comm`] holding a
//! `PeerLost` (`e.lost_peer()`), from `sync`, `finish` or `join_step` (`grad_ready` only
//! launches buckets; what their all-reduces meet is reported by the `finish` that waits for
//! them). The `Ddp` is then done
//! with: drop it, shrink the lost rank away (`ddp.comm().shrink(&[lost])`, and `grow` back with a
//! replacement if one comes), agree on the step to redo (e.g. rank 0's), and build a new `Ddp` on
//! the new communicator. [`Ddp::new`] broadcasts rank 0's parameters, so a replacement starts
//! with the same replica as everyone. `ddp/tests/ddp/elastic.rs` does this, on 3 ranks with one lost
//! and, in a second test, a replacement joining.
//!
//! With [`PostLocalSgd`], a lost rank fails at once only in its own group; the other groups
//! learn of it at the next collective on DDP's communicator: the next [`ModelAverager`]
//! average, up to `period` steps later (or the rebuild of the buckets after step 0). The
//! hook's errors name ranks of DDP's communicator, so `lost_peer()` is the rank to shrink away.
//! So do the errors of a [`HierarchicalAverager`] made by
//! [`HierarchicalAverager::by_group_sizes`]: ranks of the communicator given to it (one made
//! with [`HierarchicalAverager::new`] over groups of the trainer's own names their ranks).

#![forbid(unsafe_code)]

mod agree;
mod config;
// The plan is compiled (and tested) without the feature; it only has a user with it.
#[cfg(any(test, feature = "cuda-core"))]
mod device;
mod error;
mod flat;
pub mod hooks;
mod layout;
mod local_sgd;
mod powersgd;
mod reducer;

pub use config::{DdpConfig, Overlap, Param, Step, UnevenInputs};
#[cfg(feature = "cuda-core")]
pub use device::{DevGrad, DevGradMut, DeviceDdp, DeviceElement, DeviceNoSync, DeviceParam};
pub use error::{DdpError, Result};
pub use flat::{FlatBuffer, GradBuf, TensorMut, Typed};
pub use hooks::{
    AllReduceAvg, BucketEntry, CommHook, CompressHook, DeviceHook, GradBucket, HookWork,
};
pub use local_sgd::{HierarchicalAverager, ModelAverager, PostLocalSgd};
pub use powersgd::{PowerSgd, PowerSgdConfig};
pub use reducer::{Ddp, NoSync};
