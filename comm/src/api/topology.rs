//! Process-group placement for mixed parallelism: data, tensor, pipeline (and any other) groups
//! from one ordered list, as TorchDistPackage's `setup_process_groups` places them.
//!
//! ```no_run
//! use oxccl_comm::{Communicator, Topology};
//! use oxccl_kernels::ReduceOp;
//!
//! let world = Communicator::from_env()?; // 16 ranks, 8 per node
//! let topo = Topology::setup(&world, &[("pipe", 2), ("tensor", 2), ("data", 4)])?;
//! let mut grads = vec![0.0f32; 1024];
//! topo.group("data")?.all_reduce(&mut grads, ReduceOp::Avg)?; // inside a node: shared memory
//! let next_stage = topo.next_rank("pipe")?;                    // across nodes: TCP
//! # let _ = next_stage;
//! # Ok::<(), oxccl_comm::Error>(())
//! ```
//!
//! # Placement
//!
//! The list goes from the outermost dimension to the innermost; the last one gets consecutive
//! ranks (so it stays inside a node when the launcher numbers ranks node by node). For entry `i`
//! of size `s` with stride `S` (the product of the sizes after it), the groups are
//! `[chunk*s*S + t*S + ind for t in 0..s]`, for `ind in 0..S` (outer loop) and
//! `chunk in 0..world/(s*S)` (inner loop), created in that order. When `tensor` or `pipe` is in
//! the list, a `model` group is added for every position `g` of a data group:
//! `[d[g] for d in data_groups]` (the ranks that compute on the same data). World 16 with
//! `[("pipe", 2), ("tensor", 2), ("data", 4)]` gives
//!
//! ```text
//! group pipe, ranks: [0, 8]      ... [7, 15]            (8 groups)
//! group tensor, ranks: [0, 4]  [8, 12]  [1, 5]  [9, 13]  ... [11, 15]
//! group data, ranks: [0, 1, 2, 3]  [4, 5, 6, 7]  [8, 9, 10, 11]  [12, 13, 14, 15]
//! group model, ranks: [0, 4, 8, 12]  [1, 5, 9, 13]  [2, 6, 10, 14]  [3, 7, 11, 15]
//! ```
//!
//! [`plan_groups`] computes this without a communicator (`oxccl topo` prints it);
//! [`Topology::setup`] builds this rank's communicator of every dimension with one
//! [`Communicator::split`] per dimension (not one rendezvous per group). Each group connects its
//! members like any communicator: shared memory between members on one node, TCP across nodes.
//!
//! # Mixture of experts
//!
//! [`Topology::setup_moe`] splits every data group into expert-parallel groups (`moe_ep`:
//! consecutive runs of `ep` members) and expert-data-parallel groups (`moe_dp`: members strided
//! by `ep`), like TorchDistPackage's `build_moe_groups`. Data group `[0..8]` with `ep = 4` gives
//! `moe_ep` `[0, 1, 2, 3]` `[4, 5, 6, 7]` and `moe_dp` `[0, 4]` `[1, 5]` `[2, 6]` `[3, 7]`.

use std::fmt::Write as _;

use crate::api::communicator::Communicator;
use crate::base::error::{Error, Result};

/// Name of the group added when `tensor` or `pipe` is present.
pub const MODEL: &str = "model";
/// Name of the expert-parallel groups made by [`Topology::setup_moe`].
pub const MOE_EP: &str = "moe_ep";
/// Name of the expert-data-parallel groups made by [`Topology::setup_moe`].
pub const MOE_DP: &str = "moe_dp";

/// Every group of one dimension, in creation order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPlan {
    /// The dimension's name (`data`, `tensor`, `model`, ...).
    pub name: String,
    /// Its groups, each a list of global ranks in group-rank order.
    pub groups: Vec<Vec<usize>>,
}

impl GroupPlan {
    /// The group that contains `rank`, as (group index, position of `rank` in it).
    pub fn find(&self, rank: usize) -> Option<(usize, usize)> {
        self.groups
            .iter()
            .enumerate()
            .find_map(|(g, m)| m.iter().position(|&r| r == rank).map(|p| (g, p)))
    }
}

fn invalid(rank: usize, msg: String) -> Error {
    Error::InvalidArgument {
        rank,
        op: "topology".into(),
        msg,
    }
}

/// Every group of every dimension for a world of `world` ranks, in creation order (the list's
/// entries, then `model` when `tensor` or `pipe` is present). `rank` only labels errors.
///
/// # Errors
/// `InvalidArgument` when the list is empty, a size is 0, a name is empty, repeated or reserved
/// (`model`, `moe_ep`, `moe_dp`), the sizes do not multiply to `world`, or `tensor`/`pipe` is
/// present without `data` (the model groups are made from the data groups).
pub fn plan_groups(rank: usize, world: usize, dims: &[(&str, usize)]) -> Result<Vec<GroupPlan>> {
    if dims.is_empty() {
        return Err(invalid(rank, "the dimension list is empty".into()));
    }
    for (i, (name, size)) in dims.iter().enumerate() {
        if name.trim().is_empty() {
            return Err(invalid(rank, format!("dimension {i} has an empty name")));
        }
        if *size == 0 {
            return Err(invalid(rank, format!("dimension {name:?} has size 0")));
        }
        if [MODEL, MOE_EP, MOE_DP].contains(name) {
            return Err(invalid(
                rank,
                format!("{name:?} is made by oxccl itself and cannot be a dimension"),
            ));
        }
        if dims[..i].iter().any(|(n, _)| n == name) {
            return Err(invalid(rank, format!("dimension {name:?} appears twice")));
        }
    }
    let product = dims
        .iter()
        .try_fold(1usize, |p, (_, s)| p.checked_mul(*s))
        .unwrap_or(usize::MAX);
    if product != world {
        let list: Vec<String> = dims.iter().map(|(n, s)| format!("{n}:{s}")).collect();
        return Err(invalid(
            rank,
            format!(
                "sizes {} multiply to {product}, but the world has {world} ranks",
                list.join(" x ")
            ),
        ));
    }
    let mut plans = Vec::with_capacity(dims.len() + 1);
    for (i, (name, s)) in dims.iter().enumerate() {
        let stride: usize = dims[i + 1..].iter().map(|(_, s)| s).product();
        let chunks = world / (s * stride);
        let mut groups = Vec::with_capacity(stride * chunks);
        for ind in 0..stride {
            for chunk in 0..chunks {
                groups.push(
                    (0..*s)
                        .map(|t| chunk * s * stride + t * stride + ind)
                        .collect(),
                );
            }
        }
        plans.push(GroupPlan {
            name: (*name).to_owned(),
            groups,
        });
    }
    let has = |n: &str| dims.iter().any(|(d, _)| *d == n);
    if has("tensor") || has("pipe") {
        let Some(data) = plans.iter().find(|p| p.name == "data") else {
            return Err(invalid(
                rank,
                "a 'model' group (made when 'tensor' or 'pipe' is present) needs a 'data' entry"
                    .into(),
            ));
        };
        let width = data.groups[0].len();
        let groups = (0..width)
            .map(|g| data.groups.iter().map(|d| d[g]).collect())
            .collect();
        plans.push(GroupPlan {
            name: MODEL.into(),
            groups,
        });
    }
    Ok(plans)
}

/// The expert-parallel (`moe_ep`) and expert-data-parallel (`moe_dp`) groups of a list of data
/// groups: each data group is cut into runs of `ep` consecutive members, and strided by `ep`.
///
/// # Errors
/// `InvalidArgument` when `ep` is 0 or does not divide the data group size.
pub fn plan_moe(rank: usize, data: &GroupPlan, ep: usize) -> Result<[GroupPlan; 2]> {
    let width = data.groups.first().map_or(0, Vec::len);
    if ep == 0 || !width.is_multiple_of(ep) {
        return Err(invalid(
            rank,
            format!(
                "expert-parallel size {ep} must divide the {:?} group size {width}",
                data.name
            ),
        ));
    }
    let mut ep_groups = Vec::new();
    let mut dp_groups = Vec::new();
    for d in &data.groups {
        ep_groups.extend(d.chunks(ep).map(<[usize]>::to_vec));
        dp_groups.extend((0..ep).map(|i| d.iter().skip(i).step_by(ep).copied().collect()));
    }
    Ok([
        GroupPlan {
            name: MOE_EP.into(),
            groups: ep_groups,
        },
        GroupPlan {
            name: MOE_DP.into(),
            groups: dp_groups,
        },
    ])
}

/// Renders plans the way TorchDistPackage logs them: one `group NAME, ranks: [a, b]` line per
/// group in creation order. With `ranks_per_node` (ranks numbered node by node, as launchers do),
/// each line ends with the nodes the group touches: `  # node 0` for a group inside one node,
/// `  # nodes 0,1 (crosses nodes)` otherwise.
pub fn render(plans: &[GroupPlan], ranks_per_node: Option<usize>) -> String {
    let mut out = String::new();
    for p in plans {
        for g in &p.groups {
            let ranks: Vec<String> = g.iter().map(ToString::to_string).collect();
            let _ = write!(out, "group {}, ranks: [{}]", p.name, ranks.join(", "));
            if let Some(rpn) = ranks_per_node.filter(|&r| r > 0) {
                let mut nodes: Vec<usize> = g.iter().map(|r| r / rpn).collect();
                nodes.sort_unstable();
                nodes.dedup();
                let list: Vec<String> = nodes.iter().map(ToString::to_string).collect();
                if nodes.len() == 1 {
                    let _ = write!(out, "  # node {}", list[0]);
                } else {
                    let _ = write!(out, "  # nodes {} (crosses nodes)", list.join(","));
                }
            }
            out.push('\n');
        }
    }
    out
}

/// Parses `name:size` words (`pipe:2 tensor:2 data:4`), the form `oxccl topo` takes.
///
/// # Errors
/// `Error::Config` naming the bad word.
pub fn parse_dims(words: &[String]) -> Result<Vec<(String, usize)>> {
    words
        .iter()
        .map(|w| {
            let (n, s) = w
                .split_once([':', '='])
                .ok_or_else(|| Error::Config(format!("{w:?}: expected NAME:SIZE, e.g. data:4")))?;
            let size = s
                .trim()
                .parse()
                .map_err(|_| Error::Config(format!("{w:?}: {s:?} is not a group size")))?;
            Ok((n.trim().to_owned(), size))
        })
        .collect()
}

/// One dimension of a [`Topology`] on this rank.
#[derive(Debug)]
struct Dim {
    plan: GroupPlan,
    /// Index of this rank's group in `plan.groups`.
    index: usize,
    comm: Communicator,
}

/// This rank's communicator in every group of a placement (see the [module docs](self)).
#[derive(Debug)]
pub struct Topology {
    rank: usize,
    world: usize,
    dims: Vec<Dim>,
}

impl Topology {
    /// Builds the groups of `dims` (outermost first) over `comm`: one
    /// [`split`](Communicator::split) per dimension (and one for `model`). Collective: every rank
    /// of `comm` calls it with the same list.
    ///
    /// # Errors
    /// The errors of [`plan_groups`] (before anything is sent), and those of the splits.
    pub fn setup(comm: &Communicator, dims: &[(&str, usize)]) -> Result<Topology> {
        let plans = plan_groups(comm.rank(), comm.size(), dims)?;
        let mut topo = Topology {
            rank: comm.rank(),
            world: comm.size(),
            dims: Vec::with_capacity(plans.len()),
        };
        for plan in plans {
            topo.add(comm, plan)?;
        }
        tracing::debug!(rank = comm.rank(), groups = ?topo.names(), "topology ready");
        Ok(topo)
    }

    /// Adds the mixture-of-experts groups (`moe_ep`, `moe_dp`) split from every `data` group with
    /// expert-parallel size `ep` (see the [module docs](self)). Collective over `comm`, the
    /// communicator passed to [`Topology::setup`].
    ///
    /// # Errors
    /// `InvalidArgument` without a `data` dimension, with MoE groups already made, with `comm` not
    /// the setup's world, or when `ep` does not divide the data group size; split errors.
    pub fn setup_moe(&mut self, comm: &Communicator, ep: usize) -> Result<()> {
        if comm.size() != self.world || comm.rank() != self.rank {
            return Err(invalid(
                comm.rank(),
                format!(
                    "setup_moe needs the communicator the topology was set up on ({} ranks), got one of {}",
                    self.world,
                    comm.size()
                ),
            ));
        }
        if self.dims.iter().any(|d| d.plan.name == MOE_EP) {
            return Err(invalid(self.rank, "MoE groups already exist".into()));
        }
        let data = self
            .dims
            .iter()
            .find(|d| d.plan.name == "data")
            .ok_or_else(|| {
                invalid(
                    self.rank,
                    "MoE groups are split from a 'data' group; the topology has none".into(),
                )
            })?;
        let [ep_plan, dp_plan] = plan_moe(self.rank, &data.plan, ep)?;
        self.add(comm, ep_plan)?;
        self.add(comm, dp_plan)
    }

    fn add(&mut self, comm: &Communicator, plan: GroupPlan) -> Result<()> {
        let (index, pos) = plan
            .find(comm.rank())
            .ok_or_else(|| invalid(comm.rank(), format!("rank is in no {:?} group", plan.name)))?;
        let color = u32::try_from(index)
            .map_err(|_| invalid(comm.rank(), format!("too many {:?} groups", plan.name)))?;
        let sub = comm.split(Some(color), pos as i64)?.ok_or_else(|| {
            invalid(
                comm.rank(),
                format!("split left this rank out of {:?}", plan.name),
            )
        })?;
        self.dims.push(Dim {
            plan,
            index,
            comm: sub,
        });
        Ok(())
    }

    fn dim(&self, name: &str) -> Result<&Dim> {
        self.dims
            .iter()
            .find(|d| d.plan.name == name)
            .ok_or_else(|| {
                invalid(
                    self.rank,
                    format!(
                        "no group named {name:?}; this topology has {:?}",
                        self.names()
                    ),
                )
            })
    }

    /// The group names, in creation order.
    pub fn names(&self) -> Vec<&str> {
        self.dims.iter().map(|d| d.plan.name.as_str()).collect()
    }

    /// This rank's communicator in group `name`.
    ///
    /// # Errors
    /// `InvalidArgument` for a name the topology does not have (as for every accessor).
    pub fn group(&self, name: &str) -> Result<&Communicator> {
        self.dim(name).map(|d| &d.comm)
    }

    /// This rank's rank inside its group `name`.
    ///
    /// # Errors
    /// See [`Topology::group`].
    pub fn group_rank(&self, name: &str) -> Result<usize> {
        self.dim(name).map(|d| d.comm.rank())
    }

    /// The size of this rank's group `name`.
    ///
    /// # Errors
    /// See [`Topology::group`].
    pub fn group_size(&self, name: &str) -> Result<usize> {
        self.dim(name).map(|d| d.comm.size())
    }

    /// The global ranks of this rank's group `name`, in group-rank order.
    ///
    /// # Errors
    /// See [`Topology::group`].
    pub fn ranks_in_group(&self, name: &str) -> Result<&[usize]> {
        self.dim(name).map(|d| d.plan.groups[d.index].as_slice())
    }

    /// Every group of dimension `name` (global ranks), in creation order.
    ///
    /// # Errors
    /// See [`Topology::group`].
    pub fn all_groups(&self, name: &str) -> Result<&[Vec<usize>]> {
        self.dim(name).map(|d| d.plan.groups.as_slice())
    }

    /// Whether this rank is the first of its group `name` (e.g. the first pipeline stage).
    ///
    /// # Errors
    /// See [`Topology::group`].
    pub fn is_first(&self, name: &str) -> Result<bool> {
        Ok(self.group_rank(name)? == 0)
    }

    /// Whether this rank is the last of its group `name`.
    ///
    /// # Errors
    /// See [`Topology::group`].
    pub fn is_last(&self, name: &str) -> Result<bool> {
        let d = self.dim(name)?;
        Ok(d.comm.rank() + 1 == d.comm.size())
    }

    /// Global rank of the next member of this rank's group `name` (wrapping to the first).
    ///
    /// # Errors
    /// See [`Topology::group`].
    pub fn next_rank(&self, name: &str) -> Result<usize> {
        let g = self.ranks_in_group(name)?;
        let me = self.group_rank(name)?;
        Ok(g[(me + 1) % g.len()])
    }

    /// Global rank of the previous member of this rank's group `name` (wrapping to the last).
    ///
    /// # Errors
    /// See [`Topology::group`].
    pub fn prev_rank(&self, name: &str) -> Result<usize> {
        let g = self.ranks_in_group(name)?;
        let me = self.group_rank(name)?;
        Ok(g[(me + g.len() - 1) % g.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn groups(plans: &[GroupPlan], name: &str) -> Vec<Vec<usize>> {
        plans
            .iter()
            .find(|p| p.name == name)
            .unwrap()
            .groups
            .clone()
    }

    #[test]
    fn the_issue_example_exactly() {
        let p = plan_groups(0, 16, &[("pipe", 2), ("tensor", 2), ("data", 4)]).unwrap();
        let names: Vec<&str> = p.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["pipe", "tensor", "data", "model"]);
        let v = |x: &[&[usize]]| x.iter().map(|g| g.to_vec()).collect::<Vec<_>>();
        assert_eq!(
            groups(&p, "pipe"),
            v(&[
                &[0, 8],
                &[1, 9],
                &[2, 10],
                &[3, 11],
                &[4, 12],
                &[5, 13],
                &[6, 14],
                &[7, 15]
            ])
        );
        assert_eq!(
            groups(&p, "tensor"),
            v(&[
                &[0, 4],
                &[8, 12],
                &[1, 5],
                &[9, 13],
                &[2, 6],
                &[10, 14],
                &[3, 7],
                &[11, 15]
            ])
        );
        assert_eq!(
            groups(&p, "data"),
            v(&[
                &[0, 1, 2, 3],
                &[4, 5, 6, 7],
                &[8, 9, 10, 11],
                &[12, 13, 14, 15]
            ])
        );
        assert_eq!(
            groups(&p, "model"),
            v(&[
                &[0, 4, 8, 12],
                &[1, 5, 9, 13],
                &[2, 6, 10, 14],
                &[3, 7, 11, 15]
            ])
        );
        let text = render(&p, None);
        assert!(text.starts_with("group pipe, ranks: [0, 8]\ngroup pipe, ranks: [1, 9]\n"));
        assert!(text.ends_with("group model, ranks: [3, 7, 11, 15]\n"));
        assert_eq!(text.lines().count(), 8 + 8 + 4 + 4);
    }

    #[test]
    fn node_marks() {
        let p = plan_groups(0, 16, &[("pipe", 2), ("tensor", 2), ("data", 4)]).unwrap();
        let text = render(&p, Some(8));
        assert!(text.contains("group pipe, ranks: [0, 8]  # nodes 0,1 (crosses nodes)\n"));
        assert!(text.contains("group data, ranks: [4, 5, 6, 7]  # node 0\n"));
        assert!(text.contains("group tensor, ranks: [8, 12]  # node 1\n"));
    }

    #[test]
    fn data_outermost() {
        // TorchDistPackage's other example: data across nodes, tensor innermost.
        let p = plan_groups(0, 8, &[("data", 2), ("pipe", 2), ("tensor", 2)]).unwrap();
        assert_eq!(groups(&p, "data"), [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert_eq!(groups(&p, "tensor"), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(groups(&p, "pipe"), [[0, 2], [4, 6], [1, 3], [5, 7]]);
        assert_eq!(groups(&p, "model"), [[0, 1, 2, 3], [4, 5, 6, 7]]);
    }

    #[test]
    fn other_names_and_no_model_without_tensor_or_pipe() {
        let p = plan_groups(0, 8, &[("expert", 2), ("context", 2), ("data", 2)]).unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(groups(&p, "context"), [[0, 2], [4, 6], [1, 3], [5, 7]]);
    }

    #[test]
    fn bad_lists_are_clear_errors() {
        let err =
            |dims: &[(&str, usize)], world| plan_groups(3, world, dims).unwrap_err().to_string();
        let e = err(&[("tensor", 2), ("data", 4)], 16);
        assert!(
            e.contains("rank 3") && e.contains("multiply to 8") && e.contains("16 ranks"),
            "{e}"
        );
        let e = err(&[("tensor", 2), ("pipe", 2)], 4);
        assert!(e.contains("needs a 'data' entry"), "{e}");
        assert!(err(&[], 1).contains("empty"));
        assert!(err(&[("data", 0)], 0).contains("size 0"));
        assert!(err(&[("data", 2), ("data", 2)], 4).contains("twice"));
        assert!(err(&[("model", 2)], 2).contains("cannot be a dimension"));
        assert!(err(&[("", 2)], 2).contains("empty name"));
        assert!(err(&[("a", usize::MAX), ("b", 2)], 4).contains("multiply"));
    }

    #[test]
    fn moe_groups() {
        let p = plan_groups(0, 8, &[("data", 8)]).unwrap();
        let [ep, dp] = plan_moe(0, &p[0], 4).unwrap();
        assert_eq!(ep.groups, [[0, 1, 2, 3], [4, 5, 6, 7]]);
        assert_eq!(dp.groups, [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert!(plan_moe(0, &p[0], 3).is_err());
        assert!(plan_moe(0, &p[0], 0).is_err());
    }

    #[test]
    fn parse_words() {
        let w: Vec<String> = ["pipe:2", "data=4"].iter().map(|s| s.to_string()).collect();
        assert_eq!(
            parse_dims(&w).unwrap(),
            [("pipe".to_string(), 2), ("data".to_string(), 4)]
        );
        assert!(parse_dims(&["pipe".to_string()]).is_err());
        assert!(parse_dims(&["pipe:x".to_string()]).is_err());
    }

    proptest! {
        /// Every dimension partitions the world: each rank in exactly one group, groups of the
        /// dimension's size; the last dimension's groups are consecutive ranks; groups of
        /// different dimensions meet in at most one rank.
        #[test]
        fn every_dimension_partitions_the_world(sizes in proptest::collection::vec(1usize..4, 1..4)) {
            let names = ["pipe", "tensor", "data", "context"];
            let dims: Vec<(&str, usize)> = sizes.iter().enumerate().map(|(i, &s)| (names[i], s)).collect();
            let world: usize = sizes.iter().product();
            let has_model = dims.iter().any(|(n, _)| *n == "tensor" || *n == "pipe");
            let has_data = dims.iter().any(|(n, _)| *n == "data");
            let plans = match plan_groups(0, world, &dims) {
                Ok(p) => p,
                Err(_) => { prop_assert!(has_model && !has_data); return Ok(()); }
            };
            for (i, p) in plans.iter().enumerate() {
                let mut seen = vec![0; world];
                for g in &p.groups {
                    if i < dims.len() { prop_assert_eq!(g.len(), dims[i].1); }
                    for &r in g { seen[r] += 1; }
                }
                prop_assert!(seen.iter().all(|&c| c == 1));
            }
            let last = &plans[dims.len() - 1];
            for g in &last.groups {
                prop_assert!(g.windows(2).all(|w| w[1] == w[0] + 1));
            }
            for a in 0..dims.len() {
                for b in a + 1..dims.len() {
                    for ga in &plans[a].groups {
                        for gb in &plans[b].groups {
                            prop_assert!(ga.iter().filter(|r| gb.contains(r)).count() <= 1);
                        }
                    }
                }
            }
        }
    }
}
