//! Where a communicator's ranks sit across nodes: what the hierarchical algorithms need.

/// The communicator's ranks by node, when it spans at least two nodes of at least two ranks
/// each: what the hierarchical algorithms need (all three when every node has the same number of
/// ranks, all-reduce alone otherwise).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct NodeLayout {
    /// `ranks[k][l]`: the communicator rank of local rank `l` on node `k` (nodes in order of first
    /// appearance, local ranks in rank order).
    pub ranks: Vec<Vec<usize>>,
    /// This rank's node.
    pub node: usize,
    /// This rank's local rank.
    pub local: usize,
    /// The ranks of this node (`ranks[node]`).
    pub local_group: Vec<usize>,
    /// The number of ranks of the smallest node: the hierarchical all-reduce's pieces per
    /// block (local ranks `0..pieces` of every node carry one each across nodes).
    pub pieces: usize,
    /// Every node has the same number of ranks (hierarchical reduce-scatter and all-gather).
    pub even: bool,
    /// The ranks with this local rank on every node (`ranks[k][local]` for every `k`); empty
    /// when this local rank is `pieces` or more (a larger node's extra ranks carry no piece).
    pub cross_group: Vec<usize>,
}

impl NodeLayout {
    /// Whether the tuner may pick the hierarchical all-reduce by itself: every node's local
    /// ring has at most `pieces` steps per phase (its size at most `pieces + 1`), as on nodes of
    /// equal size. Each local step moves a piece of `B / pieces` bytes, so a node much larger
    /// than the smallest would make the local rings slower than the flat ring.
    pub fn balanced(&self) -> bool {
        self.ranks.iter().all(|g| g.len() <= self.pieces + 1)
    }
}

impl NodeLayout {
    /// The layout of ranks whose node ids are `nodes` (indexed by rank), seen from `rank`;
    /// `None` unless there are at least two nodes, each with at least two ranks.
    pub fn new(nodes: &[&str], rank: usize) -> Option<NodeLayout> {
        let mut ids: Vec<&str> = Vec::new();
        let mut ranks: Vec<Vec<usize>> = Vec::new();
        for (r, n) in nodes.iter().enumerate() {
            match ids.iter().position(|i| i == n) {
                Some(k) => ranks[k].push(r),
                None => {
                    ids.push(n);
                    ranks.push(vec![r]);
                }
            }
        }
        let pieces = ranks.iter().map(Vec::len).min()?;
        if ranks.len() < 2 || pieces < 2 {
            return None;
        }
        let even = ranks.iter().all(|g| g.len() == pieces);
        let (node, local) = ranks
            .iter()
            .enumerate()
            .find_map(|(k, g)| g.iter().position(|&r| r == rank).map(|l| (k, l)))?;
        let cross_group = if local < pieces {
            ranks.iter().map(|g| g[local]).collect()
        } else {
            Vec::new()
        };
        Some(NodeLayout {
            local_group: ranks[node].clone(),
            cross_group,
            pieces,
            even,
            ranks,
            node,
            local,
        })
    }
}
