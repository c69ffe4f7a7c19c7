//! Choosing the local address TCP listens on: `OXCCL_SOCKET_IFNAME` (NCCL_SOCKET_IFNAME's syntax),
//! else the address that routes to the store host, else loopback.
//!
//! Syntax: a comma-separated list of interface-name prefixes (`eth,ib`); a leading `^` turns it
//! into an exclude list (`^docker,lo`); a leading `=` makes the names exact (`=eth0`), and `^=`
//! excludes exact names.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, UdpSocket};

use crate::base::config::SocketFamily;
use crate::base::error::{Error, Result};

/// A parsed interface filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfFilter {
    exclude: bool,
    exact: bool,
    names: Vec<String>,
}

impl IfFilter {
    /// Parses NCCL_SOCKET_IFNAME syntax.
    pub fn parse(spec: &str) -> IfFilter {
        let mut s = spec.trim();
        let exclude = s.starts_with('^');
        if exclude {
            s = &s[1..];
        }
        let exact = s.starts_with('=');
        if exact {
            s = &s[1..];
        }
        let names = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        IfFilter {
            exclude,
            exact,
            names,
        }
    }

    /// Whether interface `name` passes the filter.
    pub fn matches(&self, name: &str) -> bool {
        let hit = self.names.iter().any(|n| {
            if self.exact {
                name == n
            } else {
                name.starts_with(n.as_str())
            }
        });
        hit != self.exclude
    }
}

fn family_ok(ip: &IpAddr, family: Option<SocketFamily>) -> bool {
    match family {
        None => true,
        Some(SocketFamily::V4) => ip.is_ipv4(),
        Some(SocketFamily::V6) => ip.is_ipv6(),
    }
}

/// Picks the address to listen on.
///
/// # Errors
/// `Error::Config` when `ifname` matches no interface (naming the interfaces present).
pub fn choose_local_ip(
    ifname: Option<&str>,
    family: Option<SocketFamily>,
    store_host: Option<IpAddr>,
) -> Result<IpAddr> {
    if let Some(spec) = ifname {
        let filter = IfFilter::parse(spec);
        let ifs = if_addrs::get_if_addrs()
            .map_err(|e| Error::Config(format!("listing interfaces: {e}")))?;
        let mut cands: Vec<(String, IpAddr)> = ifs
            .iter()
            .filter(|i| filter.matches(&i.name) && family_ok(&i.ip(), family))
            // IPv6 link-local addresses need a scope id to be usable; skip them.
            .filter(|i| !matches!(i.ip(), IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80))
            .map(|i| (i.name.clone(), i.ip()))
            .collect();
        // Prefer IPv4 unless the family says otherwise, then the order the kernel lists them.
        cands.sort_by_key(|(_, ip)| ip.is_ipv6());
        return cands.first().map(|(_, ip)| *ip).ok_or_else(|| {
            let present: Vec<String> = ifs
                .iter()
                .map(|i| format!("{} ({})", i.name, i.ip()))
                .collect();
            Error::Config(format!(
                "OXCCL_SOCKET_IFNAME={spec:?} matches no interface{}; present: {}",
                match family {
                    Some(SocketFamily::V4) => " with an IPv4 address",
                    Some(SocketFamily::V6) => " with an IPv6 address",
                    None => "",
                },
                present.join(", ")
            ))
        });
    }
    if let Some(host) = store_host.filter(|h| !h.is_loopback() && !h.is_unspecified()) {
        if family_ok(&host, family) {
            // The source address the kernel would use to reach the store: connecting a UDP socket
            // sends nothing, it only resolves the route.
            let bind: IpAddr = if host.is_ipv4() {
                Ipv4Addr::UNSPECIFIED.into()
            } else {
                Ipv6Addr::UNSPECIFIED.into()
            };
            if let Ok(sock) = UdpSocket::bind((bind, 0)) {
                if sock.connect((host, 9)).is_ok() {
                    if let Ok(local) = sock.local_addr() {
                        return Ok(local.ip());
                    }
                }
            }
        }
    }
    Ok(match family {
        Some(SocketFamily::V6) => Ipv6Addr::LOCALHOST.into(),
        _ => Ipv4Addr::LOCALHOST.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_syntax() {
        let f = IfFilter::parse("eth,ib");
        assert!(f.matches("eth0") && f.matches("ib1") && !f.matches("lo"));
        let f = IfFilter::parse("^docker,lo");
        assert!(!f.matches("docker0") && !f.matches("lo") && f.matches("eth0"));
        let f = IfFilter::parse("=eth0");
        assert!(f.matches("eth0") && !f.matches("eth01"));
        let f = IfFilter::parse("^=lo");
        assert!(!f.matches("lo") && f.matches("lo2"));
    }

    #[test]
    fn loopback_by_name_and_default() {
        let ip = choose_local_ip(Some("=lo"), Some(SocketFamily::V4), None).unwrap();
        assert_eq!(ip, IpAddr::from(Ipv4Addr::LOCALHOST));
        assert!(choose_local_ip(None, None, None).unwrap().is_loopback());
        let e = choose_local_ip(Some("=nosuchif0"), None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("nosuchif0") && e.contains("present"), "{e}");
    }
}
