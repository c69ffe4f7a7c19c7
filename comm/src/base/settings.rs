//! Configuration in code: [`Settings`] names values for `OXCCL_*` settings in Rust, and
//! [`Settings::config`] reads the environment for every one it leaves unset (then the default).
//! What the code says wins over the environment, like a `timeout=` given to torch's
//! `init_process_group`; the environment still fills in the rest, so `OXCCL_ALGO` or
//! `OXCCL_SOCKET_IFNAME` set by an operator keep working.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use super::config::{Config, TransportChoice};
use super::error::{Error, Result};

/// Settings given in code (see the module docs). Each setter takes the typed value; [`Settings::set`]
/// takes any other `OXCCL_*` setting as its variable would, checked by [`Settings::config`].
///
/// ```no_run
/// use std::time::Duration;
/// use oxccl_comm::config::{Settings, TransportChoice};
/// use oxccl_comm::Communicator;
///
/// let settings = Settings::new()
///     .timeout(Duration::from_secs(30))
///     .transport(TransportChoice::Auto)
///     .set("OXCCL_ALGO", "all-reduce=ring");
/// let comm = Communicator::from_env_with(settings)?; // launcher variables from the environment
/// # Ok::<(), oxccl_comm::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Settings {
    vars: BTreeMap<String, String>,
}

impl Settings {
    /// No settings: [`Settings::config`] is then [`Config::from_env`].
    pub fn new() -> Settings {
        Settings::default()
    }

    /// The deadline of every wait (`OXCCL_TIMEOUT`), 1 ms to a year.
    #[must_use]
    pub fn timeout(self, t: Duration) -> Settings {
        self.set("OXCCL_TIMEOUT", t.as_secs_f64())
    }

    /// Which backend carries host memory between ranks (`OXCCL_TRANSPORT`).
    #[must_use]
    pub fn transport(self, t: TransportChoice) -> Settings {
        self.set("OXCCL_TRANSPORT", t.name())
    }

    /// Algorithm overrides in `OXCCL_ALGO`'s syntax (`all-reduce=ring,broadcast=tree`).
    #[must_use]
    pub fn algo(self, spec: &str) -> Settings {
        self.set("OXCCL_ALGO", spec)
    }

    /// Bytes per transport slot (`OXCCL_SLOT_BYTES`, a multiple of 64).
    #[must_use]
    pub fn slot_bytes(self, bytes: usize) -> Settings {
        self.set("OXCCL_SLOT_BYTES", bytes)
    }

    /// Slots per connection direction (`OXCCL_NSLOTS`).
    #[must_use]
    pub fn nslots(self, n: usize) -> Settings {
        self.set("OXCCL_NSLOTS", n)
    }

    /// Bytes all of a rank's shared-memory rings may take together (`OXCCL_SHM_RING_BYTES`;
    /// 0 = no limit, every ring `nslots` x `slot_bytes`).
    #[must_use]
    pub fn shm_ring_bytes(self, bytes: usize) -> Settings {
        self.set("OXCCL_SHM_RING_BYTES", bytes)
    }

    /// Bytes of each shared-memory staging half (`OXCCL_SHM_DIRECT_BYTES`; 0 turns the staging
    /// algorithms off).
    #[must_use]
    pub fn shm_direct_bytes(self, bytes: usize) -> Settings {
        self.set("OXCCL_SHM_DIRECT_BYTES", bytes)
    }

    /// Any `OXCCL_*` setting of [`Config`] as its variable's text (docs/ENV.md lists them);
    /// [`Settings::config`] rejects a variable no setting reads and a value that does not parse.
    #[must_use]
    pub fn set(mut self, var: &str, value: impl ToString) -> Settings {
        self.vars.insert(var.to_string(), value.to_string());
        self
    }

    /// The configuration: these settings, then the environment for the rest, then the
    /// defaults.
    ///
    /// # Errors
    /// `Error::Config` naming the variable when a value does not parse or is out of range
    /// (saying whether it came from the code or the environment), or when a variable given here
    /// is not a communicator setting.
    pub fn config(&self) -> Result<Config> {
        self.config_over(&|k| std::env::var(k).ok())
    }

    /// [`Settings::config`] over any lookup for the variables left unset (tests).
    pub(crate) fn config_over(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<Config> {
        let asked = Mutex::new(Vec::<String>::new());
        let lookup = |k: &str| {
            asked
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(k.to_string());
            self.vars.get(k).cloned().or_else(|| env(k))
        };
        let cfg = Config::from_lookup(&lookup).map_err(|e| match e {
            Error::Config(msg) => {
                let from_code = self.vars.keys().any(|k| msg.contains(k.as_str()));
                Error::Config(if from_code {
                    format!("{msg} (given in code through Settings)")
                } else {
                    msg
                })
            }
            other => other,
        })?;
        let asked = asked
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(k) = self.vars.keys().find(|k| !asked.contains(k)) {
            return Err(Error::Config(format!(
                "Settings: {k} is not a communicator setting (docs/ENV.md lists them)"
            )));
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_wins_and_the_environment_fills_the_rest() {
        let env = |k: &str| match k {
            "OXCCL_TIMEOUT" => Some("900".to_string()),
            "OXCCL_NSLOTS" => Some("8".to_string()),
            _ => None,
        };
        let s = Settings::new()
            .timeout(Duration::from_millis(2500))
            .transport(TransportChoice::Tcp);
        let c = s.config_over(&env).unwrap();
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.transport, TransportChoice::Tcp);
        assert_eq!(c.nslots, 8, "left unset in code: from the environment");
        assert_eq!(c.slot_bytes, Config::default().slot_bytes);
    }

    #[test]
    fn bad_values_and_unknown_variables_are_named() {
        let none = |_: &str| None;
        let e = Settings::new()
            .set("OXCCL_NSLOTS", "many")
            .config_over(&none)
            .unwrap_err()
            .to_string();
        assert!(e.contains("OXCCL_NSLOTS") && e.contains("in code"), "{e}");
        let e = Settings::new()
            .set("OXCCL_TIMEOUTS", 3)
            .config_over(&none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("OXCCL_TIMEOUTS") && e.contains("not a communicator setting"),
            "{e}"
        );
        let bad_env = |k: &str| (k == "OXCCL_NSLOTS").then(|| "x".to_string());
        let e = Settings::new()
            .config_over(&bad_env)
            .unwrap_err()
            .to_string();
        assert!(e.contains("OXCCL_NSLOTS") && !e.contains("in code"), "{e}");
    }
}
