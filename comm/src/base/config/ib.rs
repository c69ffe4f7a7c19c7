//! RDMA verbs settings, NCCL's `NCCL_IB_*` under oxccl's names: which provider, port and GID,
//! and how the queue pairs time out and which traffic class and service level they use.

use super::parse_num;
use crate::base::error::{Error, Result};

/// Where RDMA queue pairs come from (`OXCCL_IB_PROVIDER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IbProvider {
    /// The host's verbs devices through ibverbs (feature `rdma`; default).
    Verbs,
    /// In-process queue pairs with RC semantics: ranks that are threads of one process, as in
    /// the tests (simulated nodes of the threaded harness).
    Sim,
}

impl IbProvider {
    /// The `OXCCL_IB_PROVIDER` name (`verbs`, `sim`).
    pub fn name(self) -> &'static str {
        match self {
            IbProvider::Verbs => "verbs",
            IbProvider::Sim => "sim",
        }
    }
}

/// The verbs port and the queue pairs' settings (read only by the verbs provider).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IbConfig {
    /// Which verbs devices and ports to use (`OXCCL_IB_HCA`, NCCL's `NCCL_IB_HCA` syntax:
    /// `mlx5_0:1,mlx5_1`, `^mlx5_2` to exclude, `=` for exact names; default: every active
    /// port). A rank takes the first port allowed.
    pub hca: Option<String>,
    /// The GID index of the port (`OXCCL_IB_GID_INDEX`; default: the first RoCE v2 GID with an
    /// IPv4 address, then the first RoCE v2 one, then the first non-zero one).
    pub gid_index: Option<u32>,
    /// The local ACK time-out, as the exponent of 4.096 us x 2^t (`OXCCL_IB_TIMEOUT`, 1-31,
    /// default 18: about 1 s), like `NCCL_IB_TIMEOUT`.
    pub timeout: u8,
    /// Retries before a silent peer puts the queue pair in error (`OXCCL_IB_RETRY_CNT`, 0-7,
    /// default 7), like `NCCL_IB_RETRY_CNT`.
    pub retry_cnt: u8,
    /// The traffic class of the global route header (`OXCCL_IB_TC`, 0-255, default 0; on RoCE the
    /// DSCP and ECN bits that switches queue by), like `NCCL_IB_TC`.
    pub traffic_class: u8,
    /// The service level (`OXCCL_IB_SL`, 0-15, default 0), like `NCCL_IB_SL`.
    pub service_level: u8,
}

impl Default for IbConfig {
    fn default() -> Self {
        IbConfig {
            hca: None,
            gid_index: None,
            timeout: 18,
            retry_cnt: 7,
            traffic_class: 0,
            service_level: 0,
        }
    }
}

/// `name`'s value in `lo..=hi`, or a `Config` error saying the range.
fn in_range(name: &str, v: &str, (lo, hi): (u8, u8)) -> Result<u8> {
    let n: u32 = parse_num(name, v)?;
    u8::try_from(n)
        .ok()
        .filter(|n| (lo..=hi).contains(n))
        .ok_or_else(|| Error::Config(format!("{name}={v:?} must be between {lo} and {hi}")))
}

/// `OXCCL_IB_PROVIDER`'s value.
pub(super) fn provider(v: &str) -> Result<IbProvider> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "verbs" => Ok(IbProvider::Verbs),
        "sim" => Ok(IbProvider::Sim),
        _ => Err(Error::Config(format!(
            "OXCCL_IB_PROVIDER={v:?}: expected verbs or sim"
        ))),
    }
}

impl IbConfig {
    /// Reads the `OXCCL_IB_*` variables of the port and the queue pairs through `get` (unset or
    /// empty ones keep their defaults).
    ///
    /// # Errors
    /// `Error::Config` naming the variable whose value does not parse or is out of range.
    pub(super) fn read(get: &dyn Fn(&str) -> Option<String>) -> Result<IbConfig> {
        let get = |k: &str| get(k).filter(|s| !s.trim().is_empty());
        let mut c = IbConfig {
            hca: get("OXCCL_IB_HCA"),
            ..IbConfig::default()
        };
        if let Some(v) = get("OXCCL_IB_GID_INDEX") {
            c.gid_index = Some(parse_num("OXCCL_IB_GID_INDEX", &v)?);
        }
        if let Some(v) = get("OXCCL_IB_TIMEOUT") {
            c.timeout = in_range("OXCCL_IB_TIMEOUT", &v, (1, 31))?;
        }
        if let Some(v) = get("OXCCL_IB_RETRY_CNT") {
            c.retry_cnt = in_range("OXCCL_IB_RETRY_CNT", &v, (0, 7))?;
        }
        if let Some(v) = get("OXCCL_IB_TC") {
            c.traffic_class = in_range("OXCCL_IB_TC", &v, (0, 255))?;
        }
        if let Some(v) = get("OXCCL_IB_SL") {
            c.service_level = in_range("OXCCL_IB_SL", &v, (0, 15))?;
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(vars: &[(&str, &str)]) -> Result<IbConfig> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        IbConfig::read(&|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn the_queue_pair_settings_read_like_nccls_and_refuse_what_verbs_cannot_take() {
        assert_eq!(read(&[]).unwrap(), IbConfig::default());
        let c = read(&[
            ("OXCCL_IB_HCA", "mlx5_0:1"),
            ("OXCCL_IB_GID_INDEX", "3"),
            ("OXCCL_IB_TIMEOUT", "22"),
            ("OXCCL_IB_RETRY_CNT", "0"),
            ("OXCCL_IB_TC", "106"),
            ("OXCCL_IB_SL", " 5 "),
        ])
        .unwrap();
        let want = IbConfig {
            hca: Some("mlx5_0:1".into()),
            gid_index: Some(3),
            timeout: 22,
            retry_cnt: 0,
            traffic_class: 106,
            service_level: 5,
        };
        assert_eq!(c, want);
        assert_eq!(
            read(&[("OXCCL_IB_TC", ""), ("OXCCL_IB_HCA", " ")]).unwrap(),
            IbConfig::default()
        );
        for (k, v, says) in [
            ("OXCCL_IB_TIMEOUT", "0", "between 1 and 31"),
            ("OXCCL_IB_TIMEOUT", "32", "between 1 and 31"),
            ("OXCCL_IB_RETRY_CNT", "8", "between 0 and 7"),
            ("OXCCL_IB_TC", "256", "between 0 and 255"),
            ("OXCCL_IB_SL", "16", "between 0 and 15"),
            ("OXCCL_IB_SL", "-1", "not a valid number"),
            ("OXCCL_IB_GID_INDEX", "x", "not a valid number"),
        ] {
            let e = read(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(says), "{k}={v}: {e}");
        }
        assert_eq!(provider(" SIM").unwrap(), IbProvider::Sim);
        assert!(provider("rxe")
            .unwrap_err()
            .to_string()
            .contains("expected verbs or sim"));
    }
}
