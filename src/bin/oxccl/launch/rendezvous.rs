//! The rendezvous store the launcher hosts on node 0 (or reaches on another node), the job id,
//! and the variables that tell every rank its place in the job.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::{SystemTime, UNIX_EPOCH};

use oxccl_comm::bootstrap::TcpStoreServer;

use super::proc::RankSpec;
use super::{LaunchConfig, LaunchError};

/// The store as the ranks see it; keeps the server (node 0) alive.
pub(crate) struct HostedStore {
    _server: Option<TcpStoreServer>,
    /// `host:port` given to the ranks as `OXCCL_STORE`.
    pub(super) rank_addr: String,
    /// The host part of `rank_addr`, without brackets (the launchers' own connections).
    pub(super) client_host: String,
    /// The store's port (`MASTER_PORT`).
    pub(super) port: u16,
}

/// `addr` without the brackets around an IPv6 literal.
pub(super) fn strip_brackets(addr: &str) -> &str {
    addr.strip_prefix('[')
        .and_then(|a| a.strip_suffix(']'))
        .unwrap_or(addr)
}

/// `host:port`, with IPv6 literals in brackets.
fn join_host_port(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => format!("[{host}]:{port}"),
        _ => format!("{host}:{port}"),
    }
}

/// The job token every rank and launcher presents to the store (`OXCCL_JOB_TOKEN`): the
/// launcher's own `OXCCL_JOB_TOKEN` if set; else, on one node, a random one, so that a process
/// of another job cannot join this one by mistake; else none (the launchers of a multi-node
/// job share no secret: set `OXCCL_JOB_TOKEN` alike on every node to get one).
pub(super) fn job_token(cfg: &LaunchConfig) -> Option<String> {
    if let Some(t) = std::env::var("OXCCL_JOB_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        return Some(t);
    }
    (cfg.nnodes == 1).then(random_token)
}

/// 128 random bits in hex (std's per-process random hash keys, the time and the pid).
fn random_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    (0..2u8)
        .map(|i| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(nanos);
            h.write_u32(std::process::id());
            h.write_u8(i);
            format!("{:016x}", h.finish())
        })
        .collect()
}

pub(super) fn host_store(
    cfg: &LaunchConfig,
    token: Option<&str>,
) -> Result<HostedStore, LaunchError> {
    let host = strip_brackets(&cfg.master_addr);
    if cfg.node_rank != 0 {
        return Ok(HostedStore {
            _server: None,
            rank_addr: join_host_port(host, cfg.master_port),
            client_host: host.to_owned(),
            port: cfg.master_port,
        });
    }
    let shown = join_host_port(host, cfg.master_port);
    let store_err = |message: String| LaunchError::Store {
        addr: shown.clone(),
        message,
    };
    let addrs: Vec<SocketAddr> = (host, cfg.master_port)
        .to_socket_addrs()
        .map_err(|e| store_err(format!("cannot resolve --master-addr '{host}': {e}")))?
        .collect();
    let addr = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| store_err(format!("--master-addr '{host}' resolves to no address")))?;
    let server =
        TcpStoreServer::bind_with_token(addr, token).map_err(|e| store_err(e.to_string()))?;
    let mut bound = server.local_addr();
    if bound.ip().is_unspecified() {
        let loopback: IpAddr = if bound.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        };
        bound.set_ip(loopback);
    }
    Ok(HostedStore {
        _server: Some(server),
        rank_addr: bound.to_string(),
        client_host: bound.ip().to_string(),
        port: bound.port(),
    })
}

pub(super) fn job_id_base(cfg: &LaunchConfig, port: u16) -> String {
    if let Some(id) = &cfg.job_id {
        return id.clone();
    }
    if let Some(id) = std::env::var_os("OXCCL_JOB_ID").filter(|v| !v.is_empty()) {
        return id.to_string_lossy().into_owned();
    }
    if cfg.nnodes > 1 {
        return format!("mn-{port}");
    }
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("{}-{secs}", std::process::id())
}

pub(super) fn rank_specs(
    cfg: &LaunchConfig,
    store: &HostedStore,
    job_id: &str,
    attempt: u32,
    token: Option<&str>,
) -> Vec<RankSpec> {
    let n = cfg.nproc_per_node;
    let world = cfg.world_size();
    (0..n)
        .map(|local| {
            let rank = cfg.node_rank * n + local;
            let env: Vec<(&str, String)> = vec![
                ("OXCCL_RANK", rank.to_string()),
                ("OXCCL_WORLD_SIZE", world.to_string()),
                ("OXCCL_LOCAL_RANK", local.to_string()),
                ("OXCCL_LOCAL_WORLD_SIZE", n.to_string()),
                ("OXCCL_NNODES", cfg.nnodes.to_string()),
                ("OXCCL_NODE_RANK", cfg.node_rank.to_string()),
                ("OXCCL_STORE", store.rank_addr.clone()),
                ("OXCCL_STORE_HOSTED", "1".to_owned()),
                ("OXCCL_JOB_ID", job_id.to_owned()),
                ("OXCCL_RESTART_COUNT", attempt.to_string()),
                ("OXCCL_JOB_TOKEN", token.unwrap_or_default().to_owned()),
                ("OXCCL_MAX_RESTARTS", cfg.max_restarts.to_string()),
                ("OXCCL_RESPAWN", cfg.respawn.to_string()),
                // A replacement gets "1" instead; "0" keeps a value from the launcher's own
                // environment from making every rank join.
                ("OXCCL_JOIN", "0".to_owned()),
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", world.to_string()),
                ("LOCAL_RANK", local.to_string()),
                ("LOCAL_WORLD_SIZE", n.to_string()),
                ("MASTER_ADDR", strip_brackets(&cfg.master_addr).to_owned()),
                ("MASTER_PORT", store.port.to_string()),
            ];
            RankSpec {
                rank,
                local_rank: local,
                env,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_addresses_bracket_ipv6() {
        assert_eq!(join_host_port(strip_brackets("[::1]"), 5), "[::1]:5");
        assert_eq!(join_host_port(strip_brackets("fe80::1"), 5), "[fe80::1]:5");
        assert_eq!(join_host_port("10.0.0.1", 5), "10.0.0.1:5");
        assert_eq!(join_host_port("node-3", 5), "node-3:5");
    }
}
