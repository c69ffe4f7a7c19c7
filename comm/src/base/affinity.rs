//! CPU affinity: which cores a process may run on, and binding a process to one.
//!
//! Communicators exchange every rank's allowed CPUs when they connect: a rank busy-polls while it
//! waits only when the ranks of its node, together, may use at least as many CPUs as there are
//! ranks on it (see `Config::spin`; the ranks and CPUs counted include those the communicator
//! it was made from counted on the node, [`NodeShare`]). Counting the union instead of this process's own CPUs keeps
//! spinning on for ranks a launcher bound one core each (`oxccl launch --bind core`) and turns it
//! off for ranks squeezed onto fewer cores than ranks.

/// The CPUs this process may run on (its `sched_getaffinity` mask), ascending; empty if the
/// mask cannot be read.
pub fn allowed_cpus() -> Vec<usize> {
    crate::base::sys::allowed_cpus()
}

/// The CPUs this process may use as its peers should count them: [`allowed_cpus`], cut to its
/// first [`std::thread::available_parallelism`] where that is fewer (a container's CPU quota
/// limits how many run at once, not which: ranks of one container then share those first
/// CPUs, so the union of their lists is the quota).
pub fn usable_cpus() -> Vec<usize> {
    let mut cpus = allowed_cpus();
    if let Ok(n) = std::thread::available_parallelism() {
        cpus.truncate(n.get().max(1));
    }
    cpus
}

/// `[0, 1, 2, 5]` -> `"0-2,5"` (the kernel's cpulist format).
pub fn encode_cpus(cpus: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// Inverse of [`encode_cpus`] (ascending, duplicates removed); `None` if malformed. The empty
/// string is the empty list.
pub fn decode_cpus(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse().ok()?, b.parse().ok()?),
            None => {
                let v: usize = part.parse().ok()?;
                (v, v)
            }
        };
        if b < a || b >= 1 << 16 {
            return None;
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Some(out)
}

/// Most channels `OXCCL_SOCKET_CHANNELS=auto` picks.
pub const AUTO_CHANNELS_MAX: usize = 4;

/// TCP peers times channels one rank may have for a communicator under
/// `OXCCL_SOCKET_CHANNELS=auto`: each channel holds its own sockets to every TCP peer (both
/// directions, `OXCCL_NSOCKS` each: 256 at the default of 2), and a process's descriptors are
/// often limited to 1024.
pub const AUTO_CHANNEL_PEERS: usize = 64;

/// CPUs each rank needs per channel `OXCCL_SOCKET_CHANNELS=auto` gives it: one for the channel's
/// thread and one for the kernel's work on its sockets beside it.
pub const CPUS_PER_CHANNEL: usize = 2;

/// One node of a communicator, as [`auto_channels`] and the spin and send-thread rules see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeShare {
    /// CPUs the node's ranks may use together: the union of their allowed-CPU lists, or more
    /// where the communicator this one was made from counted more (bound ranks of a group hold
    /// only their own cores, and share the node with the others); `None` when a list is unknown.
    pub cpus: Option<usize>,
    /// Ranks that share those CPUs: the communicator's ranks on the node, or more where the
    /// communicator this one was made from counted more (a group with one rank per node still
    /// shares the node with the job's other ranks).
    pub ranks: usize,
}

impl NodeShare {
    /// Whether the node's CPUs hold `per_rank` for each of its ranks (`OXCCL_SPIN=auto`: 1,
    /// `OXCCL_SOCKET_SEND_THREAD=auto`: 2); `fallback` (this process's CPU count) stands in
    /// for unknown CPUs.
    pub fn holds(&self, per_rank: usize, fallback: usize) -> bool {
        self.cpus.unwrap_or(fallback) >= per_rank.saturating_mul(self.ranks)
    }
}

/// A rank as [`node_share`] counts it: its allowed CPUs, and the ranks and CPUs the
/// communicator it was made from counted on its node (0: none, e.g. a world communicator).
#[derive(Debug, Clone, Copy)]
pub struct NodeMember<'a> {
    /// The rank's allowed CPUs (empty: unknown).
    pub cpus: &'a [usize],
    /// Ranks its parent communicator counted on the node.
    pub node_ranks: usize,
    /// CPUs its parent communicator counted on the node.
    pub node_cpus: usize,
}

/// The node of `members`: the union of their lists (or the largest CPU count they carry, if
/// larger) and the larger of their number and the rank counts they carry.
pub fn node_share(members: &[NodeMember<'_>]) -> NodeShare {
    let ranks = members
        .iter()
        .map(|m| m.node_ranks)
        .max()
        .unwrap_or(0)
        .max(members.len());
    let cpus = if members.iter().any(|m| m.cpus.is_empty()) {
        None
    } else {
        let mut all: Vec<usize> = members
            .iter()
            .flat_map(|m| m.cpus.iter().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        let carried = members.iter().map(|m| m.node_cpus).max().unwrap_or(0);
        Some(all.len().max(carried))
    };
    NodeShare { cpus, ranks }
}

/// The channels `OXCCL_SOCKET_CHANNELS=auto` gives a communicator with TCP peers: on its most
/// crowded node, [`CPUS_PER_CHANNEL`] CPUs per channel for each rank, from 1 to
/// [`AUTO_CHANNELS_MAX`], and no more than keep `tcp_peers` (the most TCP peers a rank has)
/// times the channels within [`AUTO_CHANNEL_PEERS`]; 1 when a node's CPUs are unknown. Every
/// rank computes it from the same exchanged records, so every rank gets the same number.
pub fn auto_channels(nodes: &[NodeShare], tcp_peers: usize) -> usize {
    let per_rank = nodes
        .iter()
        .map(|n| n.cpus.map_or(0, |c| c / n.ranks.max(1)))
        .min()
        .unwrap_or(0);
    let by_peers = AUTO_CHANNEL_PEERS / tcp_peers.max(1);
    (per_rank / CPUS_PER_CHANNEL)
        .min(by_peers)
        .clamp(1, AUTO_CHANNELS_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_round_trip() {
        for v in [vec![], vec![0], vec![0, 1, 2, 5], vec![3, 4, 7, 8, 9, 63]] {
            assert_eq!(decode_cpus(&encode_cpus(&v)), Some(v.clone()), "{v:?}");
        }
        assert_eq!(encode_cpus(&[0, 1, 2, 5]), "0-2,5");
        assert_eq!(decode_cpus("0-1, 1,4"), Some(vec![0, 1, 4]));
        assert_eq!(decode_cpus("3-1"), None);
        assert_eq!(decode_cpus("x"), None);
    }

    #[test]
    fn this_process_has_cpus() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty());
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(cpus.len(), n, "{cpus:?}");
    }

    /// Members with these lists, each carrying `node_ranks` ranks and `node_cpus` CPUs.
    fn share(lists: &[&[usize]], node_ranks: usize, node_cpus: usize) -> NodeShare {
        let m: Vec<NodeMember<'_>> = lists
            .iter()
            .map(|&cpus| NodeMember {
                cpus,
                node_ranks,
                node_cpus,
            })
            .collect();
        node_share(&m)
    }

    #[test]
    fn spinning_needs_a_cpu_per_rank_and_a_send_thread_two() {
        let (both, four): (&[usize], &[usize]) = (&[0, 1], &[0, 1, 2, 3]);
        // Two ranks bound to a core each spin; two squeezed onto one core do not; four unbound
        // ranks on two cores do not.
        assert!(share(&[&[0], &[1]], 0, 0).holds(1, 1));
        assert!(!share(&[&[0], &[0]], 0, 0).holds(1, 8));
        assert!(share(&[both, both], 0, 0).holds(1, 1));
        assert!(!share(&[both, both, both, both], 0, 0).holds(1, 8));
        // A group of 2 of those 4 (its parent counted 4 ranks on 2 CPUs) does not either; a
        // pair of 4 ranks bound a core each on 4 cores (2 CPUs of its own, 4 counted) does.
        assert!(!share(&[both, both], 4, 2).holds(1, 8));
        assert!(share(&[&[0], &[1]], 4, 4).holds(1, 1));
        // Unknown lists: this process's CPUs decide.
        assert!(share(&[both, &[]], 0, 0).holds(1, 2));
        assert!(!share(&[both, &[]], 0, 0).holds(1, 1));
        // A send thread: two unbound ranks on 2 cores no, on 4 yes; bound a core each no.
        assert!(!share(&[both, both], 0, 0).holds(2, 8));
        assert!(share(&[four, four], 0, 0).holds(2, 1));
        assert!(!share(&[&[0], &[1]], 0, 0).holds(2, 8));
        // Absurd counts do not overflow.
        assert!(!share(&[both], usize::MAX, 0).holds(2, 8));
    }

    #[test]
    fn auto_channels_give_each_channel_two_cpus_per_rank() {
        let node = |cpus: usize, ranks: usize| NodeShare {
            cpus: Some(cpus),
            ranks,
        };
        // 2 ranks on this 2-core machine, or bound a core each anywhere: 1.
        assert_eq!(auto_channels(&[node(2, 2)], 1), 1);
        // 2 ranks unbound on 16 cores (8 each), 2 nodes x 2 ranks of 16 cores: 4.
        assert_eq!(auto_channels(&[node(16, 2)], 1), 4);
        assert_eq!(auto_channels(&[node(16, 2), node(16, 2)], 2), 4);
        // Blocks of 4: 2; of 6: 3; the most crowded node decides.
        assert_eq!(auto_channels(&[node(8, 2)], 1), 2);
        assert_eq!(auto_channels(&[node(12, 2)], 1), 3);
        assert_eq!(auto_channels(&[node(16, 2), node(4, 2)], 2), 1);
        // Never above 4; unknown CPUs or no nodes: 1.
        assert_eq!(auto_channels(&[node(128, 1)], 1), 4);
        let unknown = NodeShare {
            cpus: None,
            ranks: 1,
        };
        assert_eq!(auto_channels(&[node(16, 1), unknown], 1), 1);
        assert_eq!(auto_channels(&[], 1), 1);
        // 8 nodes x 8 ranks: 56 TCP peers, so 1; 4 nodes x 1 rank: 3, so the CPUs decide; 30: 2.
        assert_eq!(auto_channels(&[node(96, 8)], 56), 1);
        assert_eq!(auto_channels(&[node(16, 1)], 3), 4);
        assert_eq!(auto_channels(&[node(16, 1)], 30), 2);
    }

    #[test]
    fn a_node_counts_what_the_parent_counted() {
        let all: Vec<usize> = (0..16).collect();
        // A group with one rank per node, unbound on 16 cores, whose parent ran 8 ranks a node:
        // 2 CPUs each, not 16, so one channel.
        let s = share(&[&all], 8, 16);
        assert_eq!(
            s,
            NodeShare {
                cpus: Some(16),
                ranks: 8
            }
        );
        assert_eq!(auto_channels(&[s], 1), 1);
        // Nothing carried (0) leaves the group's own ranks and lists, united.
        let s = share(&[&[0, 1], &[1, 2, 3]], 0, 0);
        assert_eq!(
            s,
            NodeShare {
                cpus: Some(4),
                ranks: 2
            }
        );
        assert_eq!(share(&[&[], &[1]], 0, 0).cpus, None);
    }
}
