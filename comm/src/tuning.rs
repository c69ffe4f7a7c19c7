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

use crate::error::{Error, Result};
use crate::op::Collective;

/// The algorithms oxccl implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring (all-reduce, reduce-scatter, all-gather).
    Ring,
    /// Binomial tree (all-reduce, broadcast, reduce).
    Tree,
    /// Recursive halving-doubling (all-reduce).
    HalvingDoubling,
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
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 8] = [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::HalvingDoubling,
        Algorithm::Chain,
        Algorithm::Linear,
        Algorithm::Pairwise,
        Algorithm::Dissemination,
        Algorithm::Direct,
    ];

    /// Name used in logs and `OXCCL_ALGO`.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::HalvingDoubling => "hd",
            Algorithm::Chain => "chain",
            Algorithm::Linear => "linear",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Dissemination => "dissemination",
            Algorithm::Direct => "direct",
        }
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
        Collective::AllReduce => &[Algorithm::Tree, Algorithm::HalvingDoubling, Algorithm::Ring],
        Collective::ReduceScatter | Collective::AllGather => &[Algorithm::Ring],
        Collective::Broadcast | Collective::Reduce => &[Algorithm::Tree, Algorithm::Chain],
        Collective::Gather | Collective::Scatter => &[Algorithm::Linear],
        Collective::AllToAll => &[Algorithm::Pairwise],
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
}

const ALPHA_US: f64 = 15.0;
const BETA_US_PER_BYTE: f64 = 1.0 / 1500.0;
/// Ring block per rank and tree piece.
const CHUNK_BYTES: usize = 4 << 20;

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
        (Collective::Broadcast | Collective::Reduce, Algorithm::Tree) => (lg, lg * b),
        (Collective::Broadcast | Collective::Reduce, Algorithm::Chain) => {
            let slots = (bytes / (512 << 10)).max(1) as f64;
            (nf - 1.0 + slots, b)
        }
        (Collective::ReduceScatter | Collective::AllGather, _) => (nf - 1.0, (nf - 1.0) / nf * b),
        (Collective::AllToAll, _) => (nf - 1.0, (nf - 1.0) / nf * b),
        (Collective::Gather | Collective::Scatter, _) => (nf - 1.0, (nf - 1.0) / nf * b),
        (Collective::Barrier, _) => (lg, 0.0),
        _ => (1.0, b),
    };
    steps * ALPHA_US + wire * BETA_US_PER_BYTE
}

/// Picks the algorithm and chunk size for `coll` on `bytes` over `n` ranks.
pub fn choose(coll: Collective, bytes: usize, n: usize, over: &AlgoOverride) -> Choice {
    let algo = over.get(coll).unwrap_or_else(|| {
        let cands = algorithms_for(coll);
        let mut best = cands[0];
        let mut best_cost = cost_us(coll, best, bytes, n);
        for &a in &cands[1..] {
            let c = cost_us(coll, a, bytes, n);
            if c < best_cost {
                (best, best_cost) = (a, c);
            }
        }
        best
    });
    let chunk_bytes = match algo {
        Algorithm::Tree => 512 << 10,
        _ => CHUNK_BYTES,
    };
    Choice { algo, chunk_bytes }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_all_reduce_uses_a_latency_algorithm_large_a_bandwidth_one() {
        let none = AlgoOverride::default();
        for n in [8, 16, 32] {
            let small = choose(Collective::AllReduce, 8, n, &none).algo;
            assert!(
                matches!(small, Algorithm::Tree | Algorithm::HalvingDoubling),
                "{small}"
            );
        }
        let big = choose(Collective::AllReduce, 256 << 20, 8, &none).algo;
        assert!(
            matches!(big, Algorithm::Ring | Algorithm::HalvingDoubling),
            "{big}"
        );
        assert_eq!(
            choose(Collective::AllReduce, 256 << 20, 6, &none).algo,
            Algorithm::Ring
        );
        assert_eq!(
            choose(Collective::Broadcast, 64 << 20, 8, &none).algo,
            Algorithm::Chain
        );
        assert_eq!(
            choose(Collective::Broadcast, 64, 8, &none).algo,
            Algorithm::Tree
        );
    }

    #[test]
    fn every_choice_is_an_algorithm_of_the_collective() {
        let none = AlgoOverride::default();
        for coll in Collective::ALL {
            for n in 1..=16 {
                for shift in 0..32 {
                    let c = choose(coll, 1 << shift, n, &none);
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
