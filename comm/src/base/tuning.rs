//! The tuner: a pure function from (collective, bytes, ranks) to (algorithm, chunk size).
//!
//! It compares alpha-beta costs (`steps * alpha + bytes_on_the_busiest_link * beta`) of the
//! algorithms that implement a collective and picks the cheapest; `OXCCL_ALGO` overrides it.
//! The constants are for TCP between processes: `alpha` = 15 us per message round, `beta` =
//! 1 / (1.5 GB/s), first estimates of the order of what loopback TCP gives on the development
//! machine (about 33 us for an 8-byte all-reduce of 2 ranks, about 1.1 GB/s bus bandwidth at
//! 64 MiB); they will be measured per transport once `oxccl perf` exists.
//!
//! With this model halving-doubling all-reduce never costs more than the binomial-tree one (same
//! number of steps, fewer bytes), so the tree all-reduce is reachable only through
//! `OXCCL_ALGO=all-reduce=tree`; trees are the tuner's choice for small broadcasts and reduces.
//!
//! **Ranks that all share memory** (the communicator has a shared-memory window) run all-reduce
//! through the window by measured thresholds instead of the model:
//!
//! | condition | algorithm |
//! |---|---|
//! | `bytes x (n - 1) <= ONE_SHOT_MAX` (64 KiB) | one-shot |
//! | otherwise, `n >= TWO_SHOT_MIN_RANKS` (3) | two-shot |
//! | otherwise (2 ranks) | ring through the slots (the model's choice) |
//! | single-copy | only through `OXCCL_ALGO` |
//!
//! Measured 2026-11-23 on the development machine (2 cores), medians of 5 interleaved runs of
//! `OXCCL_ALGO=all-reduce=A oxccl perf all-reduce --np N -b S -e S -z 1 -n 100 -w 10`, out-of-place /
//! in-place times, after the ring learnt to read an out-of-place input where it is and copies
//! into large user buffers became streaming stores:
//! - 2 ranks: 32 KiB: ring 7.0/5.4 us, one-shot 7.0/5.5, two-shot 7.3/5.6; 256 KiB: ring
//!   52/34 us, one-shot 54/50, two-shot 60/43; 1 MiB: ring 227/162 us, one-shot 218/189,
//!   two-shot 244/181; 4 MiB: ring 795/657 us, two-shot 805/794, one-shot 822/792; 16 MiB:
//!   ring 3.60/2.98 ms, two-shot 3.23/3.22, one-shot 3.42/3.14; 64 MiB: ring 14.5/11.9 ms,
//!   two-shot 14.6/14.5, one-shot 21.5/21.7. The ring leads or ties from 256 KiB on.
//! - 4 ranks on 2 cores (3 rounds): 64 KiB: two-shot 72/66 us, ring 82/76, one-shot 85/77;
//!   1 MiB: two-shot 770/720 us, ring 850/662, one-shot 1064/980; 16 MiB: two-shot 8.3/8.4 ms,
//!   one-shot 11.4/10.0, ring 13.3/11.5; 64 MiB: two-shot 32.0/30.3 ms, one-shot 44.8/38.6,
//!   ring 45.7/38.6. With ranks waiting for cores, the ring's `2 (n - 1)` hand-offs cost more
//!   than two-shot's two. Whether the ring would win at 4 ranks with a core each is unmeasured.
//! - Hierarchical against the flat ring, 2 nodes x 2 ranks in network namespaces
//!   (`scripts/netns.sh run --nodes 2 --nproc 2 -- oxccl perf all-reduce -b 256K -e 64M -f 4 -z 1`,
//!   `OXCCL_ALGO=all-reduce=hierarchical|ring`, 3 interleaved rounds, out-of-place algbw GB/s):
//!   256 KiB 0.44-0.51 vs 0.27-0.29; 1 MiB 0.53-0.59 vs 0.40-0.44; 4 MiB 0.57-0.61 vs 0.43-0.59;
//!   16 MiB 0.63-0.72 vs 0.53-0.55; 64 MiB 0.59-0.69 vs 0.52-0.57. Hierarchical leads from the
//!   smallest size measured, so `HIERARCHICAL_MIN` is 256 KiB (below it rd/hd/ring by the model).
//! - Single-copy (`process_vm_readv`) lost at every size in the earlier round (64 MiB, 2 ranks:
//!   18.7 ms against the ring's 12.5): the kernel's copy (`_copy_to_iter`, 30 % of its profile)
//!   plus page pinning is slower than a user-space copy through cache-resident staging here.
//! - Single-copy since each rank writes its reduced piece straight into the peers' outputs
//!   (`process_vm_writev`, 2026-11-29; nothing read back), against the tuner's choice before,
//!   medians of 3 interleaved runs of `oxccl perf all-reduce --np N -b 32K -e 64M -f 4
//!   --rotate 0 -z 1`, out-of-place / in-place time ratio single-copy / before: 2 ranks 32 KiB
//!   0.88/0.68, 128 KiB 0.82/0.81, 512 KiB 0.51/0.57, 1 MiB 0.60/0.49, 2 MiB 0.57/0.29, 8 MiB
//!   0.44/0.33, 16 MiB 0.83/0.50, 64 MiB 1.17/0.96; 3 ranks 128 KiB 0.98/0.89, 512 KiB-8 MiB
//!   0.80-0.86/0.48-0.62; 4 ranks 128 KiB 0.97/1.13, 512 KiB 0.68/0.98, 1-4 MiB 0.71-0.85/
//!   0.50-0.67, 8 MiB 1.06/0.54, 16 MiB 1.45/0.69; 8 ranks (on 2 cores) 512 KiB 0.92/0.84, 2 MiB
//!   1.13/0.98, 8 MiB 1.53/0.79. That is with one buffer set reused (`--rotate 0`, data in
//!   cache, as OpenMPI's bench runs). With perf's default rotation over 64 MiB of buffers (data
//!   not in cache) it loses (3 rounds, `-b 128K -e 16M -f 2`): 2 ranks against the ring
//!   1.10-1.41x the time out of place at every size, 1.11-1.30x in place up to 1 MiB and
//!   0.52-0.87x from 2 MiB; 4 ranks against two-shot 1.24-2.16x out of place, 0.93-2.12x in
//!   place. No size wins out of place in both cases and the choice must not depend on a rank's
//!   in-place-ness (it must be the same on every rank), so it stays opt-in.

use crate::base::error::{Error, Result};
use crate::base::op::Collective;

/// The algorithms oxccl implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring (all-reduce, reduce-scatter, all-gather).
    Ring,
    /// Binomial tree (all-reduce, broadcast, reduce).
    Tree,
    /// Recursive halving-doubling (all-reduce).
    HalvingDoubling,
    /// Recursive doubling: whole buffers at every step (small all-reduces).
    RecursiveDoubling,
    /// Rings inside each node and across nodes (all-reduce on communicators spanning nodes of at
    /// least two ranks; reduce-scatter and all-gather when the nodes are of equal size).
    Hierarchical,
    /// Pipelined chain (broadcast, reduce).
    Chain,
    /// Root talks to every rank directly (gather, scatter).
    Linear,
    /// Pairwise exchange (all-to-all).
    Pairwise,
    /// Dissemination (barrier).
    Dissemination,
    /// Direct point-to-point (send/recv).
    Direct,
    /// One-shot all-reduce through the shared-memory window (every rank reads every input).
    OneShot,
    /// Two-shot all-reduce through the shared-memory window (reduce-scatter + all-gather).
    TwoShot,
    /// Two-shot all-reduce reading peers' buffers with `process_vm_readv` (no staging).
    SingleCopy,
    /// All-gather writing each rank's block straight into every peer's output, and all-reduce
    /// reducing each rank's piece of every peer's buffer and writing it back into every one,
    /// mapped where every rank's buffer is a shared-memory [`crate::Registered`] buffer; the
    /// tuner's other choice where one is not.
    Mapped,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 14] = [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::HalvingDoubling,
        Algorithm::RecursiveDoubling,
        Algorithm::Hierarchical,
        Algorithm::Chain,
        Algorithm::Linear,
        Algorithm::Pairwise,
        Algorithm::Dissemination,
        Algorithm::Direct,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::SingleCopy,
        Algorithm::Mapped,
    ];

    /// Its place in [`Algorithm::ALL`] (the declaration order, which `ALL` follows).
    pub(crate) const fn index(self) -> usize {
        self as usize
    }

    /// Name used in logs and `OXCCL_ALGO`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::HalvingDoubling => "hd",
            Algorithm::RecursiveDoubling => "rd",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::Chain => "chain",
            Algorithm::Linear => "linear",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Dissemination => "dissemination",
            Algorithm::Direct => "direct",
            Algorithm::OneShot => "one-shot",
            Algorithm::TwoShot => "two-shot",
            Algorithm::SingleCopy => "single-copy",
            Algorithm::Mapped => "mapped",
        }
    }

    /// Whether the algorithm needs the shared-memory window (every rank on one node, shm).
    pub const fn needs_window(self) -> bool {
        matches!(
            self,
            Algorithm::OneShot | Algorithm::TwoShot | Algorithm::SingleCopy | Algorithm::Mapped
        )
    }

    /// Whether the algorithm needs a communicator spanning at least two nodes with the same
    /// number (at least two) of ranks each.
    pub const fn needs_nodes(self) -> bool {
        matches!(self, Algorithm::Hierarchical)
    }

    /// Whether its all-reduce reads an out-of-place input where it is (the others start from a
    /// copy of the input in the output).
    pub const fn reads_input(self) -> bool {
        matches!(
            self,
            Algorithm::Ring | Algorithm::Hierarchical | Algorithm::RecursiveDoubling
        ) || self.needs_window()
    }

    /// Parses a name (`halving-doubling` is accepted for `hd`).
    ///
    /// # Errors
    /// `Error::Config` listing valid names.
    pub fn parse(s: &str) -> Result<Algorithm> {
        let s = s.trim().to_ascii_lowercase();
        if s == "halving-doubling" || s == "halving_doubling" || s == "rhd" {
            return Ok(Algorithm::HalvingDoubling);
        }
        if s == "recursive-doubling" || s == "recursive_doubling" {
            return Ok(Algorithm::RecursiveDoubling);
        }
        let s = s.replace('_', "-");
        Algorithm::ALL
            .iter()
            .copied()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
                Error::Config(format!(
                    "unknown algorithm {s:?}; expected one of {}",
                    names.join(", ")
                ))
            })
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The algorithms that implement `coll`, in the tuner's order of preference on ties.
pub fn algorithms_for(coll: Collective) -> &'static [Algorithm] {
    match coll {
        Collective::AllReduce => &[
            Algorithm::Tree,
            Algorithm::HalvingDoubling,
            Algorithm::RecursiveDoubling,
            Algorithm::Ring,
            Algorithm::Hierarchical,
            Algorithm::OneShot,
            Algorithm::TwoShot,
            Algorithm::SingleCopy,
            Algorithm::Mapped,
        ],
        Collective::ReduceScatter => &[Algorithm::Ring, Algorithm::Hierarchical],
        Collective::AllGather => &[
            Algorithm::Ring,
            Algorithm::Hierarchical,
            Algorithm::SingleCopy,
            Algorithm::Mapped,
        ],
        Collective::ReduceScatterV | Collective::AllGatherV => &[Algorithm::Ring],
        Collective::Broadcast => &[Algorithm::Tree, Algorithm::Chain, Algorithm::SingleCopy],
        Collective::Reduce => &[Algorithm::Tree, Algorithm::Chain],
        Collective::Gather | Collective::Scatter | Collective::GatherV | Collective::ScatterV => {
            &[Algorithm::Linear]
        }
        Collective::AllToAll | Collective::AllToAllV => &[Algorithm::Pairwise],
        Collective::Barrier => &[Algorithm::Dissemination],
        Collective::SendRecv => &[Algorithm::Direct],
    }
}

/// What the tuner decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choice {
    /// Algorithm to run.
    pub algo: Algorithm,
    /// Pipelining unit in bytes (ring block per rank, tree piece).
    pub chunk_bytes: usize,
    /// What runs where `algo` declines: for [`Algorithm::Mapped`], which runs only where every
    /// rank's buffer is registered, what the tuner picks without it; otherwise `algo` itself.
    pub fallback: Algorithm,
}

/// `OXCCL_ALGO`: either one algorithm for every collective that has it (`ring`), or a list of
/// `collective=algorithm` pairs (`all-reduce=tree,broadcast=chain`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AlgoOverride {
    rules: Vec<(Option<Collective>, Algorithm)>,
}

impl AlgoOverride {
    /// Parses the variable's value.
    ///
    /// # Errors
    /// `Error::Config` naming `OXCCL_ALGO` and the bad part.
    pub fn parse(s: &str) -> Result<AlgoOverride> {
        let mut rules = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let rule = match part.split_once('=') {
                Some((c, a)) => {
                    let coll = Collective::parse(c.trim())
                        .map_err(|e| Error::Config(format!("OXCCL_ALGO={s:?}: {e}")))?;
                    let algo = Algorithm::parse(a)
                        .map_err(|e| Error::Config(format!("OXCCL_ALGO={s:?}: {e}")))?;
                    if !algorithms_for(coll).contains(&algo) {
                        return Err(Error::Config(format!(
                            "OXCCL_ALGO={s:?}: {coll} has no {algo} algorithm (it has {:?})",
                            algorithms_for(coll)
                                .iter()
                                .map(|a| a.name())
                                .collect::<Vec<_>>()
                        )));
                    }
                    (Some(coll), algo)
                }
                None => (
                    None,
                    Algorithm::parse(part)
                        .map_err(|e| Error::Config(format!("OXCCL_ALGO={s:?}: {e}")))?,
                ),
            };
            rules.push(rule);
        }
        Ok(AlgoOverride { rules })
    }

    /// The forced algorithm for `coll`, if any rule applies to it.
    pub fn get(&self, coll: Collective) -> Option<Algorithm> {
        // A rule naming the collective wins over a global one; later rules win over earlier.
        let named = self
            .rules
            .iter()
            .rev()
            .find(|(c, _)| *c == Some(coll))
            .map(|(_, a)| *a);
        named.or_else(|| {
            self.rules
                .iter()
                .rev()
                .find(|(c, a)| c.is_none() && algorithms_for(coll).contains(a))
                .map(|(_, a)| *a)
        })
    }

    /// True when no rule is set.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The effective rules as `coll=algo` pairs in [`Collective::ALL`] order, comma-separated
    /// (empty when nothing is forced): equal for overrides that force the same algorithms.
    pub(crate) fn canonical(&self) -> String {
        Collective::ALL
            .iter()
            .filter_map(|&c| self.get(c).map(|a| format!("{}={}", c.name(), a.name())))
            .collect::<Vec<_>>()
            .join(",")
    }
}

const ALPHA_US: f64 = 15.0;
const BETA_US_PER_BYTE: f64 = 1.0 / 1500.0;
/// Recursive doubling's per-step copy of the buffer, per byte, relative to the wire's cost. Fitted
/// to where recursive doubling stops beating the ring at 2 ranks over loopback TCP (between 1 and
/// 4 MiB): 5 interleaved rounds of `OXCCL_ALGO=all-reduce=rd|ring oxccl perf all-reduce --np 2
/// --transport tcp -b 64K -e 4M -f 4 -z 1 --rotate 0`, median out-of-place / in-place us:
/// 64 KiB rd 52/46 ring 62/87; 256 KiB 172/152 vs 168/170; 1 MiB 479/418 vs 625/603; 4 MiB
/// 3722/3087 vs 2556/2466. (A step's real cost at these sizes is more than `ALPHA_US`: the
/// ring's second step waits for the first's last frame.)
const COPY_BETA_RATIO: f64 = 0.01;
/// Hierarchical all-reduce, reduce-scatter and all-gather from this many bytes on, when the
/// layout allows them (see [`Caps`]; the module documentation has the measurement, made on nodes
/// of equal size).
pub const HIERARCHICAL_MIN: usize = 256 << 10;
/// One-shot all-reduce while each rank reads at most this many bytes of peers' inputs
/// (`bytes x (n - 1)`); measured, see the module documentation.
pub const ONE_SHOT_MAX: usize = 64 << 10;
/// Two-shot (staged) all-reduce beyond one-shot's range from this many ranks on (measured, see
/// the module documentation: at 2 ranks the ring wins or ties from 256 KiB on).
pub const TWO_SHOT_MIN_RANKS: usize = 3;
/// Single-copy all-reduce from this size on (when every rank can read and write every other);
/// `None`: never by default (faster with data in cache, slower without, see the module
/// documentation).
pub const SINGLE_COPY_MIN: Option<usize> = None;
/// Collectives on at least this many bytes copy into the user's buffer with streaming
/// (non-temporal) stores (`oxccl_kernels::copy_streaming`): such a buffer does not stay in cache
/// anyway, and skipping the read-for-ownership of every line saves a third of the copy's memory
/// traffic. Measured with `oxccl perf broadcast|all-gather --np 2` (see docs/PERF.md).
pub const STREAM_MIN: usize = 4 << 20;
/// The `mapped` all-gather from this many output bytes on (when every rank can map every
/// other's registered buffers, [`Caps::mapped`]). Where every output is registered it is 3-4x
/// faster than the ring from 32 KiB on (2 ranks, `oxccl perf all-gather -R 1 --rotate 0`, three
/// interleaved runs: 32 KiB 1.1-1.3 us against 3.9-4.2, 64 KiB 2.0-2.4 against 7.3-7.9, 4 MiB
/// 121-126 against 359-393). Where one is not, the epoch it opens to learn so is paid on top of
/// the ring's time: about 1.2 us at 64 KiB (0.82x the ring's busbw, 5 interleaved rounds), within
/// the noise from [`MAPPED_SURE`] on; below that, a try that fell back makes the next
/// [`MAPPED_RETRY`] such all-gathers skip it.
pub const MAPPED_MIN: usize = 64 << 10;
/// All-gathers of this many output bytes or more try the mapped path every time: the try costs
/// less than the noise of the ring's time (256 KiB: 1.01x and 1.06x the ring's busbw out of
/// place and in place with private outputs; 1 MiB 1.02x and 1.00x; 64 MiB 1.04x and 1.10x).
pub const MAPPED_SURE: usize = 256 << 10;
/// The `mapped` all-reduce (in place, or out of place through a copy into the output) from this
/// many bytes on, where every rank can map every other's registered buffers. Registered, 2
/// ranks, against the tuner's other choice (the ring) on plain buffers in the same run (7
/// interleaved rounds, `REGISTER=1 scripts/side_by_side.sh`): 1 MiB 1.26x the busbw out of
/// place, 2.27x in place; 64 MiB 1.10x and 1.47x.
pub const MAPPED_AR_MIN: usize = 256 << 10;
/// All-reduces of this many bytes or more try the mapped path every time; below, as for the
/// all-gather ([`MAPPED_RETRY`]). With private buffers against the build before it (5
/// interleaved rounds): 256 KiB 1.00x the busbw out of place, 0.93x in place (the try, about a
/// microsecond); 1 MiB 0.99x and 1.00x; 64 MiB 0.99x and 1.00x.
pub const MAPPED_AR_SURE: usize = 1 << 20;
/// All-gathers between [`MAPPED_MIN`] and [`MAPPED_SURE`] (all-reduces between
/// [`MAPPED_AR_MIN`] and [`MAPPED_AR_SURE`]) that skip the mapped path after a try found a buffer
/// that was not registered (the same on every rank); then one tries again.
pub const MAPPED_RETRY: u32 = 64;

/// Ring and hierarchical block per rank, where every rank reaches every other through shared
/// memory.
const CHUNK_BYTES: usize = 4 << 20;
/// The same where some ranks talk over TCP ([`Caps::sockets`]). Smaller blocks keep what a
/// rank has just reduced in cache for the all-gather's send and the kernel's copy out of it:
/// 2 ranks over loopback TCP, 64 MiB all-reduce, 12 interleaved rounds of 1, 2 and 4 MiB, median
/// busbw out of place / in place 2.55 / 2.78, 2.75 / 3.11 and 2.47 / 2.77 GB/s (2 MiB: 1.13x /
/// 1.14x the 4 MiB figure, the median of per-round ratios); 16 and 256 MiB, all-gather and
/// reduce-scatter alike (1.04-1.18x). Over shared memory the same sweep gave 0.93-1.06x (all-gather
/// of 2 ranks 0.93x, 3-rank all-reduce 0.95-0.99x), so it keeps 4 MiB. docs/PERF.md, "Ring block
/// size over TCP".
const CHUNK_BYTES_TCP: usize = 2 << 20;
/// The default of `OXCCL_HIERARCHICAL_BLOCK` ([`Caps::hierarchical_block`]): the hierarchical
/// all-reduce's block per local rank (a block is this times the smallest node's ranks).
///
/// Each rank's piece of a block goes from the node ring's reduce-scatter straight to its cross
/// ring over TCP, and back from the cross ring into the node ring's all-gather: a piece that
/// fits the core's L2 with room to spare is still in cache for the next phase. 2 namespaces x
/// 2 ranks on the 2-core development machine (1 MiB of L2 per core), 64 MiB, time in ms out of
/// place / in place over 3-9 rounds: 512 KiB 40.8-52.0 / 38.7-44.7, 2 MiB (the ring's block over
/// TCP, used before) 47.4-55.9 / 46.1-54.4; 128 KiB, 256 KiB, 1 MiB and 4 MiB slower than
/// 512 KiB; faster from 1 MiB to 256 MiB too. The hierarchical reduce-scatter and all-gather
/// (node and cross phases one after the other in each block, not overlapped) showed no
/// difference and keep the ring's block. docs/PERF.md, "Hierarchical block".
pub const HIERARCHICAL_AR_BLOCK: usize = 512 << 10;
/// Tree piece.
const TREE_PIECE: usize = 512 << 10;

fn log2_ceil(n: usize) -> f64 {
    (usize::BITS - (n.max(1) - 1).leading_zeros()) as f64
}

/// Modelled time in microseconds of `algo` for `coll` on `bytes` (the full buffer) over `n` ranks.
pub fn cost_us(coll: Collective, algo: Algorithm, bytes: usize, n: usize) -> f64 {
    let b = bytes as f64;
    let nf = n as f64;
    let lg = log2_ceil(n);
    let p2 = 1usize << (usize::BITS - 1 - n.max(1).leading_zeros());
    let fold = if p2 == n { 0.0 } else { 2.0 };
    let (steps, wire) = match (coll, algo) {
        (Collective::AllReduce, Algorithm::Ring) => (2.0 * (nf - 1.0), 2.0 * (nf - 1.0) / nf * b),
        (Collective::AllReduce, Algorithm::Tree) => (2.0 * lg, 2.0 * lg * b),
        // Halving-doubling partners get further apart at every step; on a real network the later
        // steps cross more links than the ring's neighbour hops (15% penalty).
        (Collective::AllReduce, Algorithm::HalvingDoubling) => (
            2.0 * log2_ceil(p2) + fold,
            (2.0 * (p2 as f64 - 1.0) / p2 as f64 + fold) * b * 1.15,
        ),
        // Whole buffers at every step, plus a copy of the buffer per step (what is sent must not
        // change while the partner's data is reduced in).
        (Collective::AllReduce, Algorithm::RecursiveDoubling) => {
            let steps = log2_ceil(p2) + fold;
            (
                steps,
                (log2_ceil(p2) + fold) * b + steps * b * COPY_BETA_RATIO,
            )
        }
        (Collective::Broadcast | Collective::Reduce, Algorithm::Tree) => (lg, lg * b),
        (Collective::Broadcast | Collective::Reduce, Algorithm::Chain) => {
            let slots = (bytes / (512 << 10)).max(1) as f64;
            (nf - 1.0 + slots, b)
        }
        (
            Collective::ReduceScatter
            | Collective::AllGather
            | Collective::ReduceScatterV
            | Collective::AllGatherV,
            _,
        ) => (nf - 1.0, (nf - 1.0) / nf * b),
        (Collective::AllToAll | Collective::AllToAllV, _) => (nf - 1.0, (nf - 1.0) / nf * b),
        (
            Collective::Gather | Collective::Scatter | Collective::GatherV | Collective::ScatterV,
            _,
        ) => (nf - 1.0, (nf - 1.0) / nf * b),
        (Collective::Barrier, _) => (lg, 0.0),
        _ => (1.0, b),
    };
    steps * ALPHA_US + wire * BETA_US_PER_BYTE
}

/// What the communicator offers beyond slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    /// Every rank shares memory with every other and has staging halves of this many bytes
    /// (0: no window, or `OXCCL_SHM_DIRECT_BYTES=0`).
    pub staging: usize,
    /// Every rank can read every other's memory with `process_vm_readv`.
    pub single_copy: bool,
    /// Every rank can map every other's registered buffers (the `mapped` all-gather).
    pub mapped: bool,
    /// The communicator spans at least two nodes with at least two ranks each, no node more
    /// than one rank larger than the smallest: the hierarchical all-reduce pays off.
    pub nodes: bool,
    /// ... and every node has the same number of ranks: the hierarchical reduce-scatter and
    /// all-gather can run too.
    pub even_nodes: bool,
    /// Some of the communicator's ranks reach each other over TCP (the same on every rank:
    /// decided from the transport setting and the ranks' node ids): ring blocks (and those of
    /// the hierarchical reduce-scatter and all-gather) are 2 MiB instead of 4 MiB per rank.
    pub sockets: bool,
    /// The hierarchical all-reduce's block per local rank (`OXCCL_HIERARCHICAL_BLOCK`; 0:
    /// [`HIERARCHICAL_AR_BLOCK`]).
    pub hierarchical_block: usize,
}

/// All-reduce through the shared-memory window, when it beats slots (`None` otherwise).
fn direct_all_reduce(bytes: usize, n: usize, caps: Caps) -> Option<Algorithm> {
    let staged = caps.staging > 0;
    if staged && bytes.saturating_mul(n - 1) <= ONE_SHOT_MAX {
        Some(Algorithm::OneShot)
    } else if caps.single_copy && SINGLE_COPY_MIN.is_some_and(|m| bytes >= m) {
        Some(Algorithm::SingleCopy)
    } else if staged && n >= TWO_SHOT_MIN_RANKS {
        Some(Algorithm::TwoShot)
    } else {
        None
    }
}

/// Broadcast between two ranks: the chain, which is the tree's pattern there (the root streams
/// to the other rank) but copies the root's input into its output piece by piece as it goes out,
/// where the tree copies the whole buffer first. Out of place at 64 MiB over shared memory on the
/// development machine: 12.4-12.5 ms against 17.2-17.6 (in place 7.4-7.5 against 7.1-7.5); at
/// 8 MiB 1.31x faster; at 1 MiB 0.95-0.98x (within the noise, over shared memory and TCP), so
/// only from [`PAIR_CHAIN_MIN`] on.
fn pair_broadcast(coll: Collective, bytes: usize, n: usize) -> Option<Algorithm> {
    (coll == Collective::Broadcast && n == 2 && bytes >= PAIR_CHAIN_MIN).then_some(Algorithm::Chain)
}

/// Two-rank broadcasts take the chain from this size on (between the 1 MiB and 8 MiB measured).
pub const PAIR_CHAIN_MIN: usize = 4 << 20;

/// Picks the algorithm and chunk size for `coll` on `bytes` over `n` ranks.
pub fn choose(coll: Collective, bytes: usize, n: usize, over: &AlgoOverride, caps: Caps) -> Choice {
    let forced = over.get(coll);
    let plain = |over: &AlgoOverride| choose_plain(coll, bytes, n, over, caps);
    let min = match coll {
        Collective::AllGather => MAPPED_MIN,
        Collective::AllReduce => MAPPED_AR_MIN,
        _ => usize::MAX,
    };
    let tuned = forced.is_none() && caps.mapped && n > 1 && bytes >= min;
    if forced == Some(Algorithm::Mapped) || tuned {
        let under = plain(&AlgoOverride::default());
        return Choice {
            algo: Algorithm::Mapped,
            ..under
        };
    }
    plain(over)
}

/// [`choose`] without the mapped algorithms.
fn choose_plain(
    coll: Collective,
    bytes: usize,
    n: usize,
    over: &AlgoOverride,
    caps: Caps,
) -> Choice {
    let hierarchical = caps.nodes
        && bytes >= HIERARCHICAL_MIN
        && match coll {
            Collective::AllReduce => true,
            Collective::ReduceScatter | Collective::AllGather => caps.even_nodes,
            _ => false,
        };
    let direct = match coll {
        Collective::AllReduce if n > 1 => direct_all_reduce(bytes, n, caps),
        _ => None,
    }
    .or(hierarchical.then_some(Algorithm::Hierarchical))
    .or(pair_broadcast(coll, bytes, n));
    let algo = over.get(coll).or(direct).unwrap_or_else(|| {
        // The cheapest candidate, the first listed on a tie (no allocation: a small message
        // without a window asks on every call).
        let (mut best, mut best_cost) = (None, f64::INFINITY);
        for &a in algorithms_for(coll)
            .iter()
            .filter(|a| !a.needs_window() && !a.needs_nodes())
            // On the window the thresholds above are measured; recursive doubling was not
            // measured against them, so only the slot algorithms they were measured with compete.
            .filter(|a| caps.staging == 0 || **a != Algorithm::RecursiveDoubling)
        {
            let c = cost_us(coll, a, bytes, n);
            if best.is_none() || c < best_cost {
                (best, best_cost) = (Some(a), c);
            }
        }
        best.unwrap_or(algorithms_for(coll)[0])
    });
    let chunk_bytes = match algo {
        Algorithm::Tree => TREE_PIECE,
        Algorithm::Hierarchical if coll == Collective::AllReduce => match caps.hierarchical_block {
            0 => HIERARCHICAL_AR_BLOCK,
            b => b,
        },
        _ if caps.sockets => CHUNK_BYTES_TCP,
        _ => CHUNK_BYTES,
    };
    Choice {
        algo,
        chunk_bytes,
        fallback: algo,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_algorithm_sits_at_its_index() {
        for (i, a) in Algorithm::ALL.into_iter().enumerate() {
            assert_eq!(a.index(), i, "{a}: ALL follows the declaration order");
        }
    }

    #[test]
    fn mapped_runs_from_its_thresholds_and_falls_back_to_the_usual_choice() {
        let none = AlgoOverride::default();
        let caps = Caps {
            staging: 1 << 20,
            mapped: true,
            ..Caps::default()
        };
        for (coll, min) in [
            (Collective::AllGather, MAPPED_MIN),
            (Collective::AllReduce, MAPPED_AR_MIN),
        ] {
            for n in [2, 3, 8] {
                let c = choose(coll, min, n, &none, caps);
                assert_eq!(c.algo, Algorithm::Mapped, "{coll} n={n}");
                let plain = Caps {
                    mapped: false,
                    ..caps
                };
                assert_eq!(c.fallback, choose(coll, min, n, &none, plain).algo);
                assert_ne!(c.fallback, Algorithm::Mapped);
                assert_ne!(
                    choose(coll, min - 8, n, &none, caps).algo,
                    Algorithm::Mapped
                );
            }
        }
        let forced = AlgoOverride::parse("mapped").unwrap();
        let c = choose(Collective::AllGather, 8, 2, &forced, Caps::default());
        assert_eq!((c.algo, c.fallback), (Algorithm::Mapped, Algorithm::Ring));
        let c = choose(Collective::Broadcast, 64 << 20, 2, &forced, caps);
        assert_ne!(
            c.algo,
            Algorithm::Mapped,
            "broadcast has no mapped algorithm"
        );
    }

    #[test]
    fn two_ranks_broadcast_large_buffers_on_the_chain() {
        let none = AlgoOverride::default();
        let pick = |bytes| choose(Collective::Broadcast, bytes, 2, &none, Caps::default()).algo;
        assert_eq!(pick(PAIR_CHAIN_MIN), Algorithm::Chain);
        assert_eq!(pick(64 << 20), Algorithm::Chain);
        assert_eq!(pick(PAIR_CHAIN_MIN - 64), Algorithm::Tree);
        let reduce = choose(Collective::Reduce, 64 << 20, 2, &none, Caps::default()).algo;
        assert_eq!(reduce, Algorithm::Tree, "reduce keeps the tree");
        let tree = AlgoOverride::parse("broadcast=tree").unwrap();
        let forced = choose(Collective::Broadcast, 64 << 20, 2, &tree, Caps::default()).algo;
        assert_eq!(forced, Algorithm::Tree, "an override wins");
    }

    #[test]
    fn small_all_reduce_uses_a_latency_algorithm_large_a_bandwidth_one() {
        let none = AlgoOverride::default();
        for n in [8, 16, 32] {
            let small = choose(Collective::AllReduce, 8, n, &none, Caps::default()).algo;
            assert!(
                matches!(
                    small,
                    Algorithm::Tree | Algorithm::HalvingDoubling | Algorithm::RecursiveDoubling
                ),
                "{small}"
            );
        }
        let big = choose(Collective::AllReduce, 256 << 20, 8, &none, Caps::default()).algo;
        assert!(
            matches!(big, Algorithm::Ring | Algorithm::HalvingDoubling),
            "{big}"
        );
        assert_eq!(
            choose(Collective::AllReduce, 256 << 20, 6, &none, Caps::default()).algo,
            Algorithm::Ring
        );
        assert_eq!(
            choose(Collective::Broadcast, 64 << 20, 8, &none, Caps::default()).algo,
            Algorithm::Chain
        );
        assert_eq!(
            choose(Collective::Broadcast, 64, 8, &none, Caps::default()).algo,
            Algorithm::Tree
        );
    }

    #[test]
    fn recursive_doubling_for_small_messages_hierarchical_for_large_across_nodes() {
        let none = AlgoOverride::default();
        let tcp = Caps::default();
        let pick = |coll, bytes, n, caps| choose(coll, bytes, n, &none, caps).algo;
        // 2 ranks: one exchange instead of two rounds.
        assert_eq!(
            pick(Collective::AllReduce, 8, 2, tcp),
            Algorithm::RecursiveDoubling
        );
        assert_eq!(
            pick(Collective::AllReduce, 8, 8, tcp),
            Algorithm::RecursiveDoubling
        );
        // Large messages: the copy per step and log2 n whole buffers lose to the ring.
        assert_eq!(
            pick(Collective::AllReduce, 64 << 20, 2, tcp),
            Algorithm::Ring
        );
        let nodes = Caps {
            nodes: true,
            even_nodes: true,
            ..Caps::default()
        };
        let uneven = Caps {
            nodes: true,
            ..Caps::default()
        };
        assert_eq!(
            pick(Collective::AllReduce, 64 << 20, 5, uneven),
            Algorithm::Hierarchical
        );
        for coll in [Collective::ReduceScatter, Collective::AllGather] {
            assert_ne!(pick(coll, 64 << 20, 5, uneven), Algorithm::Hierarchical);
        }
        for coll in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
        ] {
            assert_eq!(pick(coll, 64 << 20, 4, nodes), Algorithm::Hierarchical);
            assert_ne!(pick(coll, 1024, 4, nodes), Algorithm::Hierarchical);
            assert_eq!(
                pick(coll, HIERARCHICAL_MIN, 4, nodes),
                Algorithm::Hierarchical
            );
            assert_ne!(pick(coll, 64 << 20, 4, tcp), Algorithm::Hierarchical);
        }
        assert_eq!(
            pick(Collective::Broadcast, 64 << 20, 4, nodes),
            Algorithm::Chain
        );
    }

    #[test]
    fn ring_blocks_are_smaller_where_ranks_talk_over_tcp() {
        let none = AlgoOverride::default();
        let shm = Caps::default();
        let tcp = Caps {
            sockets: true,
            ..Caps::default()
        };
        let nodes = Caps {
            nodes: true,
            even_nodes: true,
            sockets: true,
            ..Caps::default()
        };
        let ring = |coll, caps| {
            let c = choose(coll, 64 << 20, 2, &none, caps);
            assert_eq!(c.algo, Algorithm::Ring);
            c.chunk_bytes
        };
        for coll in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
        ] {
            assert_eq!(ring(coll, shm), CHUNK_BYTES);
            assert_eq!(ring(coll, tcp), CHUNK_BYTES_TCP);
            let h = choose(coll, 64 << 20, 4, &none, nodes);
            let block = if coll == Collective::AllReduce {
                HIERARCHICAL_AR_BLOCK
            } else {
                CHUNK_BYTES_TCP
            };
            assert_eq!((h.algo, h.chunk_bytes), (Algorithm::Hierarchical, block));
            // OXCCL_HIERARCHICAL_BLOCK sets the all-reduce's block only.
            let set = Caps {
                hierarchical_block: 4 << 20,
                ..nodes
            };
            let want = if coll == Collective::AllReduce {
                4 << 20
            } else {
                CHUNK_BYTES_TCP
            };
            assert_eq!(choose(coll, 64 << 20, 4, &none, set).chunk_bytes, want);
        }
        let tree = AlgoOverride::parse("all-reduce=tree").unwrap();
        for caps in [shm, tcp] {
            assert_eq!(
                choose(Collective::AllReduce, 64 << 20, 4, &tree, caps).chunk_bytes,
                TREE_PIECE
            );
        }
    }

    /// The all-reduce table of docs/ARCHITECTURE.md ("What the alpha-beta model picks"): the
    /// algorithm from each power of two of bytes on, over TCP.
    #[test]
    fn the_documented_all_reduce_table_holds() {
        use Algorithm::{HalvingDoubling as Hd, RecursiveDoubling as Rd, Ring};
        let none = AlgoOverride::default();
        let tcp = Caps {
            sockets: true,
            ..Caps::default()
        };
        // (rank counts, [(algorithm, from this many bytes on)])
        type Row = (&'static [usize], &'static [(Algorithm, usize)]);
        let table: &[Row] = &[
            (&[2], &[(Rd, 8), (Ring, 4 << 20)]),
            (&[3], &[(Rd, 8), (Ring, 16 << 10)]),
            (&[4], &[(Rd, 8), (Ring, 256 << 10)]),
            (&[5, 6], &[(Rd, 8), (Ring, 64 << 10)]),
            (&[7, 9, 10, 11, 12], &[(Rd, 8), (Ring, 128 << 10)]),
            (&[8], &[(Rd, 8), (Hd, 128 << 10), (Ring, 1 << 20)]),
            (
                &[13, 14, 15],
                &[(Rd, 8), (Hd, 128 << 10), (Ring, 256 << 10)],
            ),
            (&[16], &[(Rd, 8), (Hd, 64 << 10), (Ring, 2 << 20)]),
        ];
        for &(ranks, rows) in table {
            for &n in ranks {
                let mut seen = Vec::new();
                for p in 3..=28 {
                    let a = choose(Collective::AllReduce, 1 << p, n, &none, tcp).algo;
                    if seen.last().is_none_or(|&(b, _)| b != a) {
                        seen.push((a, 1usize << p));
                    }
                }
                assert_eq!(seen, rows, "{n} ranks");
            }
        }
    }

    #[test]
    fn window_thresholds() {
        let none = AlgoOverride::default();
        let shm = Caps {
            staging: 1 << 20,
            single_copy: true,
            ..Caps::default()
        };
        let pick = |bytes, n, caps| choose(Collective::AllReduce, bytes, n, &none, caps).algo;
        assert_eq!(pick(8, 2, shm), Algorithm::OneShot);
        assert_eq!(pick(ONE_SHOT_MAX, 2, shm), Algorithm::OneShot);
        assert_eq!(pick(ONE_SHOT_MAX + 4, 2, shm), Algorithm::Ring);
        assert_eq!(pick(1 << 20, 2, shm), Algorithm::Ring);
        assert_eq!(pick(64 << 20, 2, shm), Algorithm::Ring);
        assert_eq!(pick(ONE_SHOT_MAX / 2 + 4, 3, shm), Algorithm::TwoShot);
        assert_eq!(pick(ONE_SHOT_MAX / 3, 4, shm), Algorithm::OneShot);
        assert_eq!(pick(ONE_SHOT_MAX, 4, shm), Algorithm::TwoShot);
        assert_eq!(pick(64 << 20, 4, shm), Algorithm::TwoShot);
        // No window (TCP, or peers on other nodes), or staging off: the model decides.
        assert!(!pick(8, 2, Caps::default()).needs_window());
        let off = Caps::default();
        assert!(!pick(1 << 20, 4, off).needs_window());
        // Other collectives never go through the window.
        assert!(!choose(Collective::Broadcast, 8, 4, &none, shm)
            .algo
            .needs_window());
        // An override wins.
        let o = AlgoOverride::parse("all-reduce=single-copy").unwrap();
        assert_eq!(
            choose(Collective::AllReduce, 8, 2, &o, shm).algo,
            Algorithm::SingleCopy
        );
    }

    #[test]
    fn every_choice_is_an_algorithm_of_the_collective() {
        let none = AlgoOverride::default();
        for coll in Collective::ALL {
            for n in 1..=16 {
                for shift in 0..32 {
                    let c = choose(coll, 1 << shift, n, &none, Caps::default());
                    assert!(algorithms_for(coll).contains(&c.algo));
                    assert!(c.chunk_bytes > 0);
                }
            }
        }
    }

    #[test]
    fn override_rules() {
        let o = AlgoOverride::parse("ring").unwrap();
        assert_eq!(o.get(Collective::AllReduce), Some(Algorithm::Ring));
        assert_eq!(o.get(Collective::Broadcast), None);
        let o = AlgoOverride::parse("tree, all-reduce=hd").unwrap();
        assert_eq!(
            o.get(Collective::AllReduce),
            Some(Algorithm::HalvingDoubling)
        );
        assert_eq!(o.get(Collective::Reduce), Some(Algorithm::Tree));
        assert!(AlgoOverride::parse("broadcast=ring").is_err());
        assert!(AlgoOverride::parse("warp").is_err());
    }
}
