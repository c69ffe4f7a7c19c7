//! What a verbs connection needs before it exists, as pure functions: the address a rank
//! publishes per queue pair (with a magic and a version, so that ends of different versions fail
//! at once instead of hanging), the choice of device and port from `OXCCL_IB_HCA` (NCCL's
//! `NCCL_IB_HCA` syntax) and of the GID from the port's table or `OXCCL_IB_GID_INDEX` (a RoCE v2
//! IPv4 GID unless told otherwise: the wrong GID is the most common RoCE failure), and the
//! checks of a pair's addresses (an InfiniBand LID of 0 connects and then fails every transfer).

/// The link layer of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinkLayer {
    /// InfiniBand: addressed by LID.
    InfiniBand,
    /// RoCE: addressed by GID.
    Ethernet,
}

/// What a rank publishes for one queue pair: enough for the peer to bring its own to
/// ready-to-send and to write into this rank's ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct QpAddress {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number.
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The GID used (RoCE; may be zero on InfiniBand).
    pub gid: [u8; 16],
    /// The port's active MTU in bytes (256 to 4096).
    pub mtu: u32,
    /// Address, key and length of this rank's receive ring.
    pub ring_addr: u64,
    /// Remote key of the ring's region.
    pub ring_rkey: u32,
    /// Bytes of the ring.
    pub ring_len: u64,
}

const MAGIC: &[u8; 4] = b"OXIB";
const VERSION: u16 = 1;
const ENCODED: usize = 4 + 2 + 4 + 4 + 2 + 16 + 4 + 8 + 4 + 8;

impl QpAddress {
    /// The bytes published through the store.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(ENCODED);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&self.qpn.to_le_bytes());
        b.extend_from_slice(&self.psn.to_le_bytes());
        b.extend_from_slice(&self.lid.to_le_bytes());
        b.extend_from_slice(&self.gid);
        b.extend_from_slice(&self.mtu.to_le_bytes());
        b.extend_from_slice(&self.ring_addr.to_le_bytes());
        b.extend_from_slice(&self.ring_rkey.to_le_bytes());
        b.extend_from_slice(&self.ring_len.to_le_bytes());
        b
    }

    /// The address back from [`QpAddress::encode`]'s bytes, or what is wrong with them.
    pub(crate) fn decode(b: &[u8]) -> Result<QpAddress, String> {
        if b.len() < 6 || &b[..4] != MAGIC {
            return Err(format!(
                "not an oxccl RDMA address ({} bytes, magic {:?})",
                b.len(),
                &b[..b.len().min(4)]
            ));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(format!(
                "RDMA address of protocol version {version}; this rank speaks version {VERSION}"
            ));
        }
        if b.len() != ENCODED {
            return Err(format!(
                "RDMA address of {} bytes, expected {ENCODED}",
                b.len()
            ));
        }
        let mut at = 6;
        let mut take = |n: usize| {
            let s = &b[at..at + n];
            at += n;
            s
        };
        let u32_ = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes"));
        let u64_ = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes"));
        Ok(QpAddress {
            qpn: u32_(take(4)),
            psn: u32_(take(4)),
            lid: u16::from_le_bytes(take(2).try_into().expect("2 bytes")),
            gid: take(16).try_into().expect("16 bytes"),
            mtu: u32_(take(4)),
            ring_addr: u64_(take(8)),
            ring_rkey: u32_(take(4)),
            ring_len: u64_(take(8)),
        })
    }
}

/// The MTU a pair uses (the smaller of the two), after the checks that catch addresses which
/// would connect and then fail every transfer.
pub(crate) fn pair_mtu(
    mine: &QpAddress,
    theirs: &QpAddress,
    link: LinkLayer,
) -> Result<u32, String> {
    match link {
        LinkLayer::InfiniBand if theirs.lid == 0 => {
            return Err(
                "the peer's InfiniBand port has LID 0 (not initialised by a subnet manager?)"
                    .into(),
            )
        }
        LinkLayer::Ethernet if theirs.gid == [0; 16] => {
            return Err("the peer's RoCE GID is all zeros (wrong OXCCL_IB_GID_INDEX?)".into())
        }
        _ => {}
    }
    let ok = |m: u32| [256, 512, 1024, 2048, 4096].contains(&m);
    if !ok(mine.mtu) || !ok(theirs.mtu) {
        return Err(format!(
            "MTUs {} and {}: each must be 256, 512, 1024, 2048 or 4096",
            mine.mtu, theirs.mtu
        ));
    }
    Ok(mine.mtu.min(theirs.mtu))
}

/// One entry of a port's GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GidEntry {
    /// Its index.
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// RoCE v2 (routable, UDP) rather than InfiniBand or RoCE v1.
    pub roce_v2: bool,
}

fn ipv4_mapped(g: &[u8; 16]) -> bool {
    g[..10] == [0; 10] && g[10] == 0xff && g[11] == 0xff
}

/// The GID index to use: `wanted` (`OXCCL_IB_GID_INDEX`) if the table has it; otherwise the
/// first RoCE v2 GID with an IPv4-mapped address, then the first RoCE v2 one, then the first
/// non-zero one (InfiniBand's index 0).
pub(crate) fn choose_gid(table: &[GidEntry], wanted: Option<u32>) -> Result<u32, String> {
    if let Some(w) = wanted {
        return match table.iter().find(|e| e.index == w) {
            Some(e) if e.gid != [0; 16] => Ok(w),
            Some(_) => Err(format!("OXCCL_IB_GID_INDEX={w}: that GID is all zeros")),
            None => Err(format!(
                "OXCCL_IB_GID_INDEX={w}: the port has GIDs {:?}",
                table.iter().map(|e| e.index).collect::<Vec<_>>()
            )),
        };
    }
    let live = || table.iter().filter(|e| e.gid != [0; 16]);
    live()
        .find(|e| e.roce_v2 && ipv4_mapped(&e.gid))
        .or_else(|| live().find(|e| e.roce_v2))
        .or_else(|| live().next())
        .map(|e| e.index)
        .ok_or_else(|| "the port has no GID that is not all zeros".into())
}

/// A device as the provider lists it: its name and each port with whether it is active.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Device {
    /// `mlx5_0`, ...
    pub name: String,
    /// (port number, active).
    pub ports: Vec<(u8, bool)>,
}

/// The (device, port) pairs to use, from `OXCCL_IB_HCA` in NCCL's syntax: a comma-separated
/// list of `name[:port]` entries, the whole list prefixed by `^` to exclude them instead and
/// then by `=` to match names exactly (otherwise an entry matches every name it starts, as
/// `mlx5_1` matches `mlx5_10`); no spec: every active port. Only active ports are taken.
pub(crate) fn choose_hcas(
    devices: &[Device],
    spec: Option<&str>,
) -> Result<Vec<(String, u8)>, String> {
    let spec = spec.map(str::trim).filter(|s| !s.is_empty());
    let (exclude, exact, list) = match spec {
        None => (true, false, ""),
        Some(s) => {
            let (exclude, s) = s.strip_prefix('^').map_or((false, s), |r| (true, r));
            let (exact, s) = s.strip_prefix('=').map_or((false, s), |r| (true, r));
            (exclude, exact, s)
        }
    };
    let entries: Vec<(&str, Option<u8>)> = list
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| match e.split_once(':') {
            Some((n, p)) => p
                .parse()
                .map(|p| (n, Some(p)))
                .map_err(|_| format!("OXCCL_IB_HCA: bad port in {e:?}")),
            None => Ok((e, None)),
        })
        .collect::<Result<_, _>>()?;
    let named = |dev: &str, port: u8| {
        entries.iter().any(|(n, p)| {
            let name_ok = if exact { dev == *n } else { dev.starts_with(n) };
            name_ok && p.is_none_or(|p| p == port)
        })
    };
    let out: Vec<(String, u8)> = devices
        .iter()
        .flat_map(|d| d.ports.iter().map(move |&(p, active)| (d, p, active)))
        .filter(|&(d, p, active)| active && named(&d.name, p) != exclude)
        .map(|(d, p, _)| (d.name.clone(), p))
        .collect();
    if out.is_empty() {
        let have: Vec<String> = devices
            .iter()
            .flat_map(|d| {
                d.ports
                    .iter()
                    .map(move |(p, a)| format!("{}:{p}{}", d.name, if *a { "" } else { " (down)" }))
            })
            .collect();
        return Err(format!(
            "no active verbs port matches OXCCL_IB_HCA={}; ports: {}",
            spec.unwrap_or("(all)"),
            if have.is_empty() {
                "none".into()
            } else {
                have.join(", ")
            }
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr() -> QpAddress {
        QpAddress {
            qpn: 0x1234,
            psn: 77,
            lid: 5,
            gid: [7; 16],
            mtu: 4096,
            ring_addr: 0xdead_beef_0000,
            ring_rkey: 99,
            ring_len: 1 << 22,
        }
    }

    #[test]
    fn addresses_round_trip_and_other_versions_are_named() {
        let a = addr();
        assert_eq!(QpAddress::decode(&a.encode()).unwrap(), a);
        let mut b = a.encode();
        b[4] = 2;
        let e = QpAddress::decode(&b).unwrap_err();
        assert!(
            e.contains("protocol version 2; this rank speaks version 1"),
            "{e}"
        );
        assert!(QpAddress::decode(b"garbage")
            .unwrap_err()
            .contains("not an oxccl"));
        assert!(QpAddress::decode(&a.encode()[..20]).is_err());
    }

    #[test]
    fn pairs_that_would_fail_every_transfer_are_refused() {
        let (a, mut b) = (addr(), addr());
        b.mtu = 1024;
        assert_eq!(pair_mtu(&a, &b, LinkLayer::InfiniBand), Ok(1024));
        b.lid = 0;
        assert!(pair_mtu(&a, &b, LinkLayer::InfiniBand)
            .unwrap_err()
            .contains("LID 0"));
        assert_eq!(pair_mtu(&a, &b, LinkLayer::Ethernet), Ok(1024));
        b.gid = [0; 16];
        assert!(pair_mtu(&a, &b, LinkLayer::Ethernet)
            .unwrap_err()
            .contains("all zeros"));
        b = addr();
        b.mtu = 1500;
        assert!(pair_mtu(&a, &b, LinkLayer::Ethernet).is_err());
    }

    #[test]
    fn roce_v2_ipv4_gids_are_chosen_unless_an_index_is_named() {
        let v4 = {
            let mut g = [0u8; 16];
            g[10] = 0xff;
            g[11] = 0xff;
            g[12..].copy_from_slice(&[10, 0, 0, 7]);
            g
        };
        let table = vec![
            GidEntry {
                index: 0,
                gid: [0xfe; 16],
                roce_v2: false,
            },
            GidEntry {
                index: 1,
                gid: [0xfe; 16],
                roce_v2: true,
            },
            GidEntry {
                index: 2,
                gid: v4,
                roce_v2: false,
            },
            GidEntry {
                index: 3,
                gid: v4,
                roce_v2: true,
            },
            GidEntry {
                index: 4,
                gid: [0; 16],
                roce_v2: true,
            },
        ];
        assert_eq!(choose_gid(&table, None), Ok(3));
        assert_eq!(choose_gid(&table[..3], None), Ok(1));
        assert_eq!(choose_gid(&table[..1], None), Ok(0));
        assert_eq!(choose_gid(&table, Some(2)), Ok(2));
        assert!(choose_gid(&table, Some(4))
            .unwrap_err()
            .contains("all zeros"));
        assert!(choose_gid(&table, Some(9))
            .unwrap_err()
            .contains("GIDs [0, 1, 2, 3, 4]"));
        assert!(choose_gid(&table[4..], None).is_err());
    }

    #[test]
    fn hca_specs_follow_nccl() {
        let devs = vec![
            Device {
                name: "mlx5_0".into(),
                ports: vec![(1, true)],
            },
            Device {
                name: "mlx5_1".into(),
                ports: vec![(1, true), (2, false)],
            },
            Device {
                name: "mlx5_10".into(),
                ports: vec![(1, true)],
            },
            Device {
                name: "irdma0".into(),
                ports: vec![(1, false)],
            },
        ];
        let names = |v: Vec<(String, u8)>| {
            v.into_iter()
                .map(|(n, p)| format!("{n}:{p}"))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(choose_hcas(&devs, None).unwrap()),
            ["mlx5_0:1", "mlx5_1:1", "mlx5_10:1"]
        );
        assert_eq!(
            names(choose_hcas(&devs, Some("mlx5_1")).unwrap()),
            ["mlx5_1:1", "mlx5_10:1"]
        );
        assert_eq!(
            names(choose_hcas(&devs, Some("=mlx5_1")).unwrap()),
            ["mlx5_1:1"]
        );
        assert_eq!(
            names(choose_hcas(&devs, Some("^mlx5_1")).unwrap()),
            ["mlx5_0:1"]
        );
        assert_eq!(
            names(choose_hcas(&devs, Some("^=mlx5_1")).unwrap()),
            ["mlx5_0:1", "mlx5_10:1"]
        );
        assert_eq!(
            names(choose_hcas(&devs, Some("mlx5_0:1,mlx5_10")).unwrap()),
            ["mlx5_0:1", "mlx5_10:1"]
        );
        let e = choose_hcas(&devs, Some("=mlx5_1:2")).unwrap_err();
        assert!(
            e.contains("mlx5_1:2 (down)") && e.contains("irdma0:1 (down)"),
            "{e}"
        );
        assert!(choose_hcas(&devs, Some("mlx5_0:x"))
            .unwrap_err()
            .contains("bad port"));
        assert!(choose_hcas(&[], None).unwrap_err().contains("ports: none"));
    }
}
