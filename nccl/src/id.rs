//! `ncclUniqueId`: where the ranks meet. `ncclGetUniqueId` starts an oxccl TCP store in the
//! calling process (it lives as long as the process) that admits only clients presenting a
//! random job nonce, and writes the store's address and the nonce into the id's 128 bytes:
//!
//! ```text
//! [0..8)   "OXCCLID1"
//! [8]      4 or 6 (address family)
//! [9..11)  port, big-endian
//! [11..27) address (IPv4 in the first 4 bytes)
//! [27..59) nonce, 32 hexadecimal digits
//! ```
//!
//! The address is the one `OXCCL_SOCKET_IFNAME` picks where it is set, else the first
//! non-loopback IPv4 address this host's name resolves to, else 127.0.0.1 (ranks of one node).

use std::ffi::c_char;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::sync::Mutex;

use oxccl_comm::bootstrap::TcpStoreServer;
use oxccl_comm::Config;

use crate::abi::{UniqueId, UNIQUE_ID_BYTES};
use crate::status::{fail, Failure};

const MAGIC: &[u8; 8] = b"OXCCLID1";
const NONCE_HEX: usize = 32;

/// What an id holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Root {
    /// The store's address.
    pub addr: SocketAddr,
    /// The job nonce the store requires (`OXCCL_JOB_TOKEN`'s role).
    pub nonce: String,
}

/// Stores started by `ncclGetUniqueId`, kept for the life of the process (ranks may meet
/// through one long after it was made, and a split or a later init may use it again).
static SERVERS: Mutex<Vec<TcpStoreServer>> = Mutex::new(Vec::new());

/// A fresh nonce: 16 random bytes in hexadecimal.
fn nonce() -> Result<String, Failure> {
    let mut b = [0u8; NONCE_HEX / 2];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| {
            fail(
                crate::abi::SYSTEM_ERROR,
                format!("reading /dev/urandom: {e}"),
            )
        })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// The address other ranks reach this host by (see the module docs).
fn root_ip() -> Result<IpAddr, Failure> {
    let cfg = Config::from_env()?;
    if let Some(ifname) = cfg.socket_ifname.as_deref() {
        return Ok(oxccl_comm::internal::tcp::choose_local_ip(
            Some(ifname),
            cfg.socket_family,
            None,
        )?);
    }
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let named = (host.as_str(), 0)
        .to_socket_addrs()
        .ok()
        .into_iter()
        .flatten()
        .map(|a| a.ip())
        .find(|ip| ip.is_ipv4() && !ip.is_loopback());
    Ok(named.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

/// `ncclGetUniqueId`: starts a store and names it (see the module docs).
pub fn new_id() -> Result<UniqueId, Failure> {
    let ip = root_ip()?;
    let nonce = nonce()?;
    let any: IpAddr = if ip.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    };
    let server = TcpStoreServer::bind_with_token(SocketAddr::new(any, 0), Some(&nonce))?;
    let addr = SocketAddr::new(ip, server.local_addr().port());
    SERVERS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(server);
    Ok(encode(&Root { addr, nonce }))
}

/// The id's bytes for `root`.
pub fn encode(root: &Root) -> UniqueId {
    let mut b = [0u8; UNIQUE_ID_BYTES];
    b[..8].copy_from_slice(MAGIC);
    match root.addr.ip() {
        IpAddr::V4(v4) => {
            b[8] = 4;
            b[11..15].copy_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            b[8] = 6;
            b[11..27].copy_from_slice(&v6.octets());
        }
    }
    b[9..11].copy_from_slice(&root.addr.port().to_be_bytes());
    let n = root.nonce.as_bytes();
    let k = n.len().min(NONCE_HEX);
    b[27..27 + k].copy_from_slice(&n[..k]);
    UniqueId {
        internal: b.map(|x| x as c_char),
    }
}

/// What `id` names.
///
/// # Errors
/// A text saying why these bytes are no id of oxccl's (say, one made by another NCCL).
pub fn decode(id: &UniqueId) -> Result<Root, String> {
    let b = id.internal.map(|x| x as u8);
    if &b[..8] != MAGIC {
        return Err("the ncclUniqueId was not made by oxccl's ncclGetUniqueId \
                    (was it made by another NCCL library, or not copied whole?)"
            .into());
    }
    let port = u16::from_be_bytes([b[9], b[10]]);
    let ip: IpAddr = match b[8] {
        4 => Ipv4Addr::new(b[11], b[12], b[13], b[14]).into(),
        6 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[11..27]);
            Ipv6Addr::from(o).into()
        }
        f => {
            return Err(format!(
                "the ncclUniqueId has an unknown address family {f}"
            ))
        }
    };
    let nonce = &b[27..27 + NONCE_HEX];
    if port == 0 || !nonce.iter().all(u8::is_ascii_hexdigit) {
        return Err("the ncclUniqueId is damaged (no port or no nonce)".into());
    }
    Ok(Root {
        addr: SocketAddr::new(ip, port),
        nonce: String::from_utf8_lossy(nonce).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_foreign_ones_are_refused() {
        for addr in ["10.1.2.3:29500", "[fd00::7]:1234"] {
            let root = Root {
                addr: addr.parse().unwrap(),
                nonce: "0123456789abcdef0123456789abcdef".into(),
            };
            assert_eq!(decode(&encode(&root)).unwrap(), root);
        }
        let foreign = UniqueId {
            internal: [7; UNIQUE_ID_BYTES],
        };
        assert!(decode(&foreign).unwrap_err().contains("not made by oxccl"));
    }
}
