//! Launcher detection: works out rank, world size, local rank/size, the rendezvous store address
//! and a job id from the environment set by `oxccl launch`, torchrun, Slurm (`srun`) or Open MPI
//! (`mpirun`).
//!
//! [`detect`] takes a variable lookup function, so it is testable without touching the real
//! environment; [`detect_from_env`] uses the process environment. Variables set to an empty (or
//! all-blank) string count as unset.
//!
//! Families are tried in this order; the first whose rank and size variables are both set wins:
//!
//! | launcher | rank / size | local rank / size | store |
//! |----------|-------------|-------------------|-------|
//! | oxccl    | `OXCCL_RANK`, `OXCCL_WORLD_SIZE` | `OXCCL_LOCAL_RANK` (default: rank), `OXCCL_LOCAL_WORLD_SIZE` (default: world) | `OXCCL_STORE` |
//! | torchrun | `RANK`, `WORLD_SIZE` | `LOCAL_RANK` (default: rank), `LOCAL_WORLD_SIZE` (default: world) | `MASTER_ADDR`, `MASTER_PORT` |
//! | Slurm    | `SLURM_PROCID`, `SLURM_NTASKS` | `SLURM_LOCALID` (default 0), `SLURM_STEP_TASKS_PER_NODE`, else `SLURM_TASKS_PER_NODE` (both at `SLURM_NODEID`), else `SLURM_NTASKS_PER_NODE`, else 1 | `MASTER_ADDR`/`MASTER_PORT`, else first node of the node list and a port derived from the job id |
//! | Open MPI | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` (default: rank), `OMPI_COMM_WORLD_LOCAL_SIZE` (default: world) | `OXCCL_STORE`, else `MASTER_ADDR`/`MASTER_PORT` |
//!
//! **Slurm local size:** `srun` sets the step's own task counts (`SLURM_STEP_TASKS_PER_NODE`,
//! and overwrites `SLURM_TASKS_PER_NODE` with them), while `SLURM_NTASKS_PER_NODE` is the job's
//! `--ntasks-per-node`, inherited by every step (`sbatch --ntasks-per-node=8` then `srun -n 2`),
//! so it comes last. The communicator works out local ranks from node ids anyway and only warns
//! when the launcher disagrees, so under Slurm a local rank or size that does not fit (local
//! size above the world size, local rank not below it, `SLURM_NODEID` past the list) is a
//! warning, not an error: the values are clamped into range (local size at least local rank + 1,
//! at most the world size). Malformed values are still errors.
//!
//! `OXCCL_STORE` is `host:port`, `[ipv6]:port` or `file:///absolute/dir`; when set it also
//! overrides the store of torchrun and Slurm jobs. Under oxccl's and Open MPI's variables, a
//! single-process job (world size 1) without any store variable gets `127.0.0.1` port 0, hosted
//! by itself (torchrun's always need `MASTER_ADDR`/`MASTER_PORT`; Slurm's fall back to the node
//! list).
//!
//! `host_store` is true for rank 0 of a TCP store unless `OXCCL_STORE_HOSTED=1` (set by
//! `oxccl launch` and by anything else that hosts the server itself); it is always false for a
//! file store.
//!
//! **torchrun agent store:** when `TORCHELASTIC_USE_AGENT_STORE` is `True`/`1`, torchrun's
//! agent already listens on `MASTER_PORT` with torch's own `TCPStore`, whose protocol is not
//! ours, so oxccl uses port `MASTER_PORT + 1` instead.
//!
//! **Slurm default port:** without `MASTER_PORT`, the port is `29500 + (SLURM_JOB_ID % 1000)`
//! (`29500` when there is no job id), so that concurrent jobs sharing a first node are unlikely to
//! collide. The host is `MASTER_ADDR`, else the first host of `SLURM_STEP_NODELIST`, else of
//! `SLURM_NODELIST` (or `SLURM_JOB_NODELIST`).
//!
//! Job ids (`OXCCL_JOB_ID`, `TORCHELASTIC_RUN_ID`, `slurm-` + `SLURM_JOB_ID`,
//! `OMPI_MCA_ess_base_jobid`) have every character outside `[A-Za-z0-9_.-]` replaced by `_` so
//! they can be used in store keys and shared-memory names.

use std::path::PathBuf;

use super::nodelist::{expand_nodelist, expand_tasks_per_node_of};
use crate::base::error::{Error, Result};

/// Which launcher started this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launcher {
    /// `oxccl launch` (or hand-set `OXCCL_*` variables).
    Oxccl,
    /// PyTorch's torchrun / torch.distributed.run.
    Torchrun,
    /// Slurm's `srun`.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
}

/// Where the rendezvous store lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreAddr {
    /// A [`TcpStoreServer`](super::TcpStoreServer) at `host:port` (`host` without brackets).
    Tcp {
        /// Host name or IP literal (IPv6 without brackets).
        host: String,
        /// TCP port (0 only for a self-hosted single-process job).
        port: u16,
    },
    /// A [`FileStore`](super::FileStore) directory.
    File(PathBuf),
}

/// What the launcher told this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchInfo {
    /// The launcher detected.
    pub launcher: Launcher,
    /// Global rank.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank among the processes on this node.
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Rendezvous store address.
    pub store: StoreAddr,
    /// true when this process must host the TCP store server (rank 0 when no launcher hosts one).
    pub host_store: bool,
    /// job id used to namespace store keys and shm segment names.
    pub job_id: String,
}

/// Environment lookup function.
type Get<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Looks up `name`, treating empty or blank values as unset.
fn var(get: Get<'_>, name: &str) -> Option<String> {
    get(name)
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// A number together with where it came from, for error messages.
struct Num {
    value: usize,
    source: String,
}

fn parse_num(name: &str, value: &str) -> Result<Num> {
    let v = value
        .parse::<usize>()
        .map_err(|_| Error::Config(format!("{name}='{value}' is not a non-negative integer")))?;
    Ok(Num {
        value: v,
        source: format!("{name}={value}"),
    })
}

/// Parses `name` if set, else returns `default` (described by `default_src`).
fn num_or(get: Get<'_>, name: &str, default: &Num, default_src: &str) -> Result<Num> {
    match var(get, name) {
        Some(v) => parse_num(name, &v),
        None => Ok(Num {
            value: default.value,
            source: format!(
                "{name} (unset, defaulting to {default_src} = {})",
                default.value
            ),
        }),
    }
}

fn validate(rank: &Num, world: &Num, local_rank: &Num, local_world: &Num) -> Result<()> {
    if world.value == 0 {
        return Err(Error::Config(format!(
            "{}: the world size must be at least 1",
            world.source
        )));
    }
    if rank.value >= world.value {
        return Err(Error::Config(format!(
            "{} is out of range: it must be below {}",
            rank.source, world.source
        )));
    }
    validate_local(world, local_rank, local_world).map_err(Error::Config)
}

/// Checks the local rank and size against each other and the world size.
fn validate_local(
    world: &Num,
    local_rank: &Num,
    local_world: &Num,
) -> std::result::Result<(), String> {
    if local_world.value == 0 {
        return Err(format!(
            "{}: the local world size must be at least 1",
            local_world.source
        ));
    }
    if local_rank.value >= local_world.value {
        return Err(format!(
            "{} is out of range: it must be below {}",
            local_rank.source, local_world.source
        ));
    }
    if local_world.value > world.value {
        return Err(format!("{} exceeds {}", local_world.source, world.source));
    }
    Ok(())
}

fn parse_port(name: &str, value: &str) -> Result<u16> {
    match value.parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(Error::Config(format!(
            "{name}='{value}' is not a valid TCP port (1..=65535)"
        ))),
    }
}

/// Parses an `OXCCL_STORE`-style spec: `host:port`, `[v6addr]:port` or `file:///abs/path`.
fn parse_store_spec(name: &str, spec: &str) -> Result<StoreAddr> {
    let bad = |why: &str| Error::Config(format!("{name}='{spec}' is invalid: {why}"));
    if let Some(path) = spec.strip_prefix("file://") {
        let p = PathBuf::from(path);
        if !p.is_absolute() {
            return Err(bad("a file store needs an absolute path (file:///abs/dir)"));
        }
        return Ok(StoreAddr::File(p));
    }
    let (host, port) = if let Some(rest) = spec.strip_prefix('[') {
        let (h, p) = rest
            .split_once("]:")
            .ok_or_else(|| bad("expected [ipv6-address]:port"))?;
        (h, p)
    } else {
        let (h, p) = spec
            .rsplit_once(':')
            .ok_or_else(|| bad("expected host:port, [ipv6-address]:port or file:///dir"))?;
        if h.contains(':') {
            return Err(bad(
                "IPv6 addresses must be written in brackets: [addr]:port",
            ));
        }
        (h, p)
    };
    if host.is_empty() {
        return Err(bad("empty host"));
    }
    let port = match port.parse::<u16>() {
        Ok(p) if p != 0 => p,
        _ => {
            return Err(bad(&format!(
                "'{port}' is not a valid TCP port (1..=65535)"
            )))
        }
    };
    Ok(StoreAddr::Tcp {
        host: host.to_owned(),
        port,
    })
}

/// Replaces characters unsafe in keys and shm names by `_`.
fn sanitize_job_id(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn hosted_externally(get: Get<'_>) -> bool {
    var(get, "OXCCL_STORE_HOSTED").as_deref() == Some("1")
}

/// `MASTER_ADDR`/`MASTER_PORT` as a store address, or the names of the missing variables.
fn master_addr(get: Get<'_>) -> Result<std::result::Result<StoreAddr, Vec<&'static str>>> {
    let addr = var(get, "MASTER_ADDR");
    let port = var(get, "MASTER_PORT");
    match (addr, port) {
        (Some(a), Some(p)) => Ok(Ok(StoreAddr::Tcp {
            host: a
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .unwrap_or(&a)
                .to_owned(),
            port: parse_port("MASTER_PORT", &p)?,
        })),
        (a, p) => {
            let mut missing = Vec::new();
            if a.is_none() {
                missing.push("MASTER_ADDR");
            }
            if p.is_none() {
                missing.push("MASTER_PORT");
            }
            Ok(Err(missing))
        }
    }
}

/// Builds the result; `host_store` applies only to TCP stores.
#[allow(clippy::too_many_arguments)]
fn finish(
    launcher: Launcher,
    rank: Num,
    world: Num,
    local_rank: Num,
    local_world: Num,
    store: StoreAddr,
    host_if_tcp: bool,
    job_id: &str,
) -> Result<LaunchInfo> {
    validate(&rank, &world, &local_rank, &local_world)?;
    let host_store = matches!(store, StoreAddr::Tcp { .. }) && host_if_tcp;
    Ok(LaunchInfo {
        launcher,
        rank: rank.value,
        world_size: world.value,
        local_rank: local_rank.value,
        local_world_size: local_world.value,
        store,
        host_store,
        job_id: sanitize_job_id(job_id),
    })
}

/// The store of a single-process job with no store configured.
fn self_hosted() -> StoreAddr {
    StoreAddr::Tcp {
        host: "127.0.0.1".to_owned(),
        port: 0,
    }
}

fn detect_oxccl(get: Get<'_>, r: &str, w: &str) -> Result<LaunchInfo> {
    let rank = parse_num("OXCCL_RANK", r)?;
    let world = parse_num("OXCCL_WORLD_SIZE", w)?;
    let local_rank = num_or(get, "OXCCL_LOCAL_RANK", &rank, "OXCCL_RANK")?;
    let local_world = num_or(get, "OXCCL_LOCAL_WORLD_SIZE", &world, "OXCCL_WORLD_SIZE")?;
    let (store, host) = match var(get, "OXCCL_STORE") {
        Some(spec) => (
            parse_store_spec("OXCCL_STORE", &spec)?,
            rank.value == 0 && !hosted_externally(get),
        ),
        None if world.value == 1 => (self_hosted(), true),
        None => {
            return Err(Error::Config(format!(
                "oxccl launch environment ({}, {}) has no OXCCL_STORE; set it to host:port, \
                 [ipv6]:port or file:///shared/dir",
                rank.source, world.source
            )))
        }
    };
    let job = var(get, "OXCCL_JOB_ID").unwrap_or_else(|| "oxccl".to_owned());
    finish(
        Launcher::Oxccl,
        rank,
        world,
        local_rank,
        local_world,
        store,
        host,
        &job,
    )
}

/// `OXCCL_STORE` as an override for the other launchers.
fn store_override(get: Get<'_>, rank: usize) -> Result<Option<(StoreAddr, bool)>> {
    match var(get, "OXCCL_STORE") {
        Some(spec) => Ok(Some((
            parse_store_spec("OXCCL_STORE", &spec)?,
            rank == 0 && !hosted_externally(get),
        ))),
        None => Ok(None),
    }
}

fn detect_torchrun(get: Get<'_>, r: &str, w: &str) -> Result<LaunchInfo> {
    let rank = parse_num("RANK", r)?;
    let world = parse_num("WORLD_SIZE", w)?;
    let local_rank = num_or(get, "LOCAL_RANK", &rank, "RANK")?;
    let local_world = num_or(get, "LOCAL_WORLD_SIZE", &world, "WORLD_SIZE")?;
    let (store, host) = match store_override(get, rank.value)? {
        Some(s) => s,
        None => {
            let addr = master_addr(get)?.map_err(|missing| {
                Error::Config(format!(
                    "torchrun environment ({}, {}) but {} not set",
                    rank.source,
                    world.source,
                    missing.join(" and ")
                ))
            })?;
            let agent = var(get, "TORCHELASTIC_USE_AGENT_STORE")
                .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
            let addr = match addr {
                StoreAddr::Tcp { host, port } if agent => {
                    let port = port.checked_add(1).ok_or_else(|| {
                        Error::Config(
                            "MASTER_PORT=65535 leaves no room for the oxccl store on \
                             MASTER_PORT+1 (TORCHELASTIC_USE_AGENT_STORE is set, so torchrun's \
                             agent store holds MASTER_PORT)"
                                .to_owned(),
                        )
                    })?;
                    StoreAddr::Tcp { host, port }
                }
                other => other,
            };
            (addr, rank.value == 0 && !hosted_externally(get))
        }
    };
    let job = var(get, "TORCHELASTIC_RUN_ID").unwrap_or_else(|| "torchrun".to_owned());
    finish(
        Launcher::Torchrun,
        rank,
        world,
        local_rank,
        local_world,
        store,
        host,
        &job,
    )
}

fn detect_slurm(get: Get<'_>, r: &str, w: &str) -> Result<LaunchInfo> {
    let rank = parse_num("SLURM_PROCID", r)?;
    let world = parse_num("SLURM_NTASKS", w)?;
    let zero = Num {
        value: 0,
        source: String::new(),
    };
    let mut local_rank = num_or(get, "SLURM_LOCALID", &zero, "0")?;
    let mut local_world = slurm_local_world(get)?;
    // Advisory only (see the module docs): a misfit is a warning, and the values are clamped.
    if world.value > 0 && rank.value < world.value {
        if let Err(why) = validate_local(&world, &local_rank, &local_world) {
            let lw = local_world
                .value
                .max(local_rank.value.saturating_add(1))
                .min(world.value);
            let lr = local_rank.value.min(lw - 1);
            tracing::warn!(
                "Slurm local rank/size do not fit: {why}; using local rank {lr} of {lw} \
                 (the communicator takes local ranks from node ids)"
            );
            local_world.value = lw;
            local_rank.value = lr;
        }
    }
    // The job number only matters for the default port; a non-numeric id is an error only then.
    let job_num = match var(get, "SLURM_JOB_ID") {
        Some(v) => match v.parse::<u64>() {
            Ok(n) => Some(n),
            Err(_) if var(get, "MASTER_PORT").is_some() => None,
            Err(_) => {
                return Err(Error::Config(format!(
                    "SLURM_JOB_ID='{v}' is not a non-negative integer (needed for the default store port; set MASTER_PORT)"
                )))
            }
        },
        None => None,
    };
    let (store, host) = match store_override(get, rank.value)? {
        Some(s) => s,
        None => {
            let host = match var(get, "MASTER_ADDR") {
                Some(a) => a,
                None => slurm_first_host(get)?,
            };
            let port = match var(get, "MASTER_PORT") {
                Some(p) => parse_port("MASTER_PORT", &p)?,
                // Both terms are small: 29500 + 999 fits in a u16.
                None => 29500 + job_num.map_or(0, |j| (j % 1000) as u16),
            };
            let host = host
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .unwrap_or(&host)
                .to_owned();
            (
                StoreAddr::Tcp { host, port },
                rank.value == 0 && !hosted_externally(get),
            )
        }
    };
    let job = match var(get, "SLURM_JOB_ID") {
        Some(j) => format!("slurm-{j}"),
        None => "slurm".to_owned(),
    };
    finish(
        Launcher::Slurm,
        rank,
        world,
        local_rank,
        local_world,
        store,
        host,
        &job,
    )
}

/// The number of tasks on this node of a Slurm step: the step's per-node list, else the
/// (step-overwritten) job list, both at `SLURM_NODEID`, else the job's `SLURM_NTASKS_PER_NODE`,
/// else 1. A node id past a list is a warning (the next source is tried).
fn slurm_local_world(get: Get<'_>) -> Result<Num> {
    for name in ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"] {
        let Some(tpn) = var(get, name) else { continue };
        let counts = expand_tasks_per_node_of(name, &tpn)?;
        let node = match var(get, "SLURM_NODEID") {
            Some(v) => parse_num("SLURM_NODEID", &v)?,
            None => zero_num("SLURM_NODEID (unset, defaulting to 0)"),
        };
        match counts.get(node.value) {
            Some(&value) => {
                return Ok(Num {
                    value,
                    source: format!("{name}='{tpn}' at {}", node.source),
                })
            }
            None => tracing::warn!(
                "{} is out of range for {name}='{tpn}' ({} nodes); ignoring {name}",
                node.source,
                counts.len()
            ),
        }
    }
    if let Some(v) = var(get, "SLURM_NTASKS_PER_NODE") {
        return parse_num("SLURM_NTASKS_PER_NODE", &v);
    }
    Ok(Num {
        value: 1,
        source: "local world size (no usable SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE \
                 or SLURM_NTASKS_PER_NODE; defaulting to 1)"
            .to_owned(),
    })
}

fn zero_num(source: &str) -> Num {
    Num {
        value: 0,
        source: source.to_owned(),
    }
}

fn slurm_first_host(get: Get<'_>) -> Result<String> {
    for name in [
        "SLURM_STEP_NODELIST",
        "SLURM_NODELIST",
        "SLURM_JOB_NODELIST",
    ] {
        if let Some(list) = var(get, name) {
            let hosts =
                expand_nodelist(&list).map_err(|e| Error::Config(format!("{name}: {e}")))?;
            if let Some(h) = hosts.into_iter().next() {
                return Ok(h);
            }
        }
    }
    Err(Error::Config(
        "Slurm environment without a store host: set MASTER_ADDR (and optionally MASTER_PORT) \
         or OXCCL_STORE; SLURM_STEP_NODELIST, SLURM_NODELIST and SLURM_JOB_NODELIST are all unset"
            .to_owned(),
    ))
}

fn detect_ompi(get: Get<'_>, r: &str, w: &str) -> Result<LaunchInfo> {
    let rank = parse_num("OMPI_COMM_WORLD_RANK", r)?;
    let world = parse_num("OMPI_COMM_WORLD_SIZE", w)?;
    let local_rank = num_or(
        get,
        "OMPI_COMM_WORLD_LOCAL_RANK",
        &rank,
        "OMPI_COMM_WORLD_RANK",
    )?;
    let local_world = num_or(
        get,
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        &world,
        "OMPI_COMM_WORLD_SIZE",
    )?;
    let (store, host) = match store_override(get, rank.value)? {
        Some(s) => s,
        None => match master_addr(get)? {
            Ok(addr) => (addr, rank.value == 0 && !hosted_externally(get)),
            Err(_) if world.value == 1 => (self_hosted(), true),
            Err(missing) => {
                return Err(Error::Config(format!(
                    "Open MPI environment ({}, {}) without a store: set OXCCL_STORE \
                     (host:port or file:///shared/dir) or MASTER_ADDR and MASTER_PORT \
                     (missing: {})",
                    rank.source,
                    world.source,
                    missing.join(", ")
                )))
            }
        },
    };
    let job = var(get, "OMPI_MCA_ess_base_jobid").unwrap_or_else(|| "ompi".to_owned());
    finish(
        Launcher::OpenMpi,
        rank,
        world,
        local_rank,
        local_world,
        store,
        host,
        &job,
    )
}

/// The rank/size variable pairs that identify each launcher family, in detection order.
const FAMILIES: [(&str, &str, &str); 4] = [
    ("oxccl", "OXCCL_RANK", "OXCCL_WORLD_SIZE"),
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
];

/// Detects the launcher from variables looked up with `get` (see the module docs for the
/// variables and rules).
///
/// # Errors
/// [`Error::Config`] when no launcher's rank and size variables are set (the message lists the
/// variables looked for), when a value is not a number, when rank >= world size, local rank >=
/// local world size or a size is 0 (naming the variable and its value), or when a required store
/// variable is missing or malformed.
pub fn detect(get: &dyn Fn(&str) -> Option<String>) -> Result<LaunchInfo> {
    for (i, (_, rank_var, size_var)) in FAMILIES.iter().enumerate() {
        if let (Some(r), Some(w)) = (var(get, rank_var), var(get, size_var)) {
            return match i {
                0 => detect_oxccl(get, &r, &w),
                1 => detect_torchrun(get, &r, &w),
                2 => detect_slurm(get, &r, &w),
                _ => detect_ompi(get, &r, &w),
            };
        }
    }
    let looked: Vec<String> = FAMILIES
        .iter()
        .map(|(name, r, w)| format!("{name} ({r} and {w})"))
        .collect();
    let mut msg = format!(
        "no launcher environment detected; looked for {}",
        looked.join(", ")
    );
    for (name, r, w) in FAMILIES {
        match (var(get, r).is_some(), var(get, w).is_some()) {
            (true, false) => msg.push_str(&format!("; {r} is set but {w} is not ({name})")),
            (false, true) => msg.push_str(&format!("; {w} is set but {r} is not ({name})")),
            _ => {}
        }
    }
    Err(Error::Config(msg))
}

/// [`detect`] on the process environment.
///
/// # Errors
/// As [`detect`].
pub fn detect_from_env() -> Result<LaunchInfo> {
    detect(&|k| std::env::var(k).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_spec_forms() {
        assert_eq!(
            parse_store_spec("X", "h:1").unwrap(),
            StoreAddr::Tcp {
                host: "h".into(),
                port: 1
            }
        );
        assert_eq!(
            parse_store_spec("X", "[fe80::1]:29500").unwrap(),
            StoreAddr::Tcp {
                host: "fe80::1".into(),
                port: 29500
            }
        );
        assert_eq!(
            parse_store_spec("X", "file:///tmp/x").unwrap(),
            StoreAddr::File("/tmp/x".into())
        );
        for bad in ["h", "::1:5", "h:0", "h:70000", ":5", "file://rel", "[::1]5"] {
            let e = parse_store_spec("X", bad).unwrap_err().to_string();
            assert!(e.contains("X="), "{bad}: {e}");
        }
    }

    #[test]
    fn job_id_sanitized() {
        assert_eq!(sanitize_job_id("a b/c:1"), "a_b_c_1");
    }
}
