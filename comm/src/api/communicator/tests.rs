//! Unit tests of communicator creation: settings refused or compared at init, store failures.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::api::harness::spawn_world_with;
use crate::base::bootstrap::MemStore;
use crate::base::bootstrap::{hash_id, Store};
use crate::base::config::{Config, TransportChoice};
use crate::base::error::Error;

#[test]
fn hash_id_is_fnv1a_64() {
    assert_eq!(hash_id(""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(hash_id("a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(hash_id("oxccl/world0"), 0x6216_7b10_47cb_0e55);
}

/// Every numeric field of a hand-built `Config` out of its range fails init with the field
/// and its variable named (zero sockets or slots used to divide by zero later).
#[test]
fn hand_built_fields_out_of_range_are_refused_at_init() {
    type Tweak = fn(&mut Config);
    let cases: [(&str, Tweak); 12] = [
        ("nsocks", |c| c.nsocks = 0),
        ("nsocks", |c| c.nsocks = 17),
        ("socket_buffer", |c| c.socket_buffer = 4 << 30),
        ("slot_bytes", |c| c.slot_bytes = 100),
        ("nslots", |c| c.nslots = 0),
        ("direct_bytes", |c| c.direct_bytes = 1000),
        ("shm_ring_bytes", |c| c.shm_ring_bytes = 4096),
        ("shm_ring_bytes", |c| c.shm_ring_bytes = (1 << 20) + 64),
        ("cuda_ipc_slot", |c| c.cuda_ipc_slot = 0),
        ("hierarchical_block", |c| c.hierarchical_block = 0),
        ("trace_buffer", |c| c.trace_buffer = usize::MAX),
        ("timeout", |c| c.timeout = Duration::ZERO),
    ];
    for (field, tweak) in cases {
        let mut cfg = Config::default();
        tweak(&mut cfg);
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        match Communicator::init_with_config(0, 1, store, cfg) {
            Err(e @ Error::InvalidArgument { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("rank 0") && msg.contains("init"), "{msg}");
                assert!(msg.contains(&format!("Config::{field}")), "{msg}");
            }
            other => panic!("{field}: expected InvalidArgument, got {other:?}"),
        }
    }
    assert!(Config::default().check().is_ok());
}

#[test]
fn hand_built_timeout_out_of_range_is_refused_at_init() {
    for t in [Duration::ZERO, Duration::from_secs(u64::MAX), Duration::MAX] {
        let cfg = Config {
            timeout: t,
            ..Config::default()
        };
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        match Communicator::init_with_config(0, 1, store, cfg) {
            Err(e @ Error::InvalidArgument { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("rank 0") && msg.contains("init"), "{msg}");
                assert!(msg.contains("timeout") && msg.contains("31536000"), "{msg}");
            }
            other => panic!("timeout {t:?}: expected InvalidArgument, got {other:?}"),
        }
    }
}

/// Ranks with different shared settings fail at init with a `Config` error naming the
/// variable and both values (not later with a time-out).
#[test]
fn ranks_with_different_shared_settings_fail_at_init() {
    type Tweak = fn(&mut Config);
    let cases: [(&str, Tweak, &str, &str); 4] = [
        (
            "OXCCL_TRANSPORT",
            |c| c.transport = TransportChoice::Tcp,
            "\"tcp\"",
            "\"auto\"",
        ),
        (
            "OXCCL_ALGO",
            |c| c.algo = crate::base::tuning::AlgoOverride::parse("all-reduce=ring").unwrap(),
            "\"all-reduce=ring\"",
            "\"\"",
        ),
        (
            "OXCCL_CUDA_STAGE_CHUNK",
            |c| c.cuda_stage_chunk = 1 << 20,
            "\"1048576\"",
            "\"4194304\"",
        ),
        (
            "OXCCL_HIERARCHICAL_BLOCK",
            |c| c.hierarchical_block = 2 << 20,
            "\"2097152\"",
            "\"524288\"",
        ),
    ];
    for (var, tweak, odd_value, usual_value) in cases {
        let results = spawn_world_with(
            3,
            |rank| {
                let mut c = Config {
                    timeout: Duration::from_secs(20),
                    ..Config::default()
                };
                if rank == 2 {
                    tweak(&mut c);
                }
                c
            },
            |_| Ok(()),
        );
        for (rank, r) in results.into_iter().enumerate() {
            let msg = match r {
                Err(Error::Config(msg)) => msg,
                other => panic!("{var}: rank {rank}: expected Error::Config, got {other:?}"),
            };
            let (other, theirs, mine) = if rank == 2 {
                (0, usual_value, odd_value)
            } else {
                (2, odd_value, usual_value)
            };
            for needle in [
                format!("rank {rank}: init"),
                format!("rank {other} has {var}={theirs}"),
                format!("this rank has {var}={mine}"),
                "every rank".to_owned(),
            ] {
                assert!(msg.contains(&needle), "{var}: {msg:?} lacks {needle:?}");
            }
        }
    }
}

#[test]
fn equivalent_algo_overrides_compare_equal() {
    let canon = |s: &str| {
        crate::base::tuning::AlgoOverride::parse(s)
            .unwrap()
            .canonical()
    };
    assert_eq!(
        canon("all-reduce=tree,all-reduce=ring"),
        canon(" all-reduce=ring ")
    );
    assert_ne!(canon("all-reduce=ring"), canon(""));
    assert!(!canon("ring").contains('\n'));
}

/// A store whose waits fail the way a store whose host died does.
#[derive(Debug)]
struct DeadGets(MemStore);

impl Store for DeadGets {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.0.set(key, value)
    }
    fn get(&self, key: &str, _timeout: Duration) -> Result<Vec<u8>> {
        Err(Error::Store(format!(
            "get on key '{key}' at store 127.0.0.1:1: Connection refused (os error 111)"
        )))
    }
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.0.try_get(key)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.0.add(key, delta)
    }
    fn compare_set(&self, key: &str, exp: Option<&[u8]>, des: &[u8]) -> Result<Vec<u8>> {
        self.0.compare_set(key, exp, des)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.0.delete(key)
    }
}

fn short() -> Config {
    Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    }
}

#[test]
fn store_failure_at_init_keeps_its_cause() {
    let store: Arc<dyn Store> = Arc::new(DeadGets(MemStore::new()));
    match Communicator::init_with_config(1, 2, store, short()) {
        Err(Error::Store(msg)) => {
            for needle in ["rank 1: init", "Connection refused", "peer/0"] {
                assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
            }
        }
        other => panic!("expected Error::Store, got {other:?}"),
    }
}

#[test]
fn missing_peer_at_init_is_a_timeout() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let cfg = Config {
        timeout: Duration::from_millis(50),
        ..Config::default()
    };
    match Communicator::init_with_config(0, 2, store, cfg) {
        Err(Error::Timeout {
            rank, op, detail, ..
        }) => {
            assert_eq!((rank, op.as_str()), (0, "init"));
            assert!(detail.contains("rank 1 never published"), "{detail}");
        }
        other => panic!("expected Error::Timeout, got {other:?}"),
    }
}

#[test]
fn bad_peer_records_name_this_rank_and_the_key() {
    for (record, needle) in [
        (&b"garbage"[..], "malformed peer record"),
        (&b"5\nnode\n1\n127.0.0.1:1\n\n0\n0\n"[..], "names rank 5"),
    ] {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        // Rank 0's first init on this store uses id `oxccl/world1`.
        store.set("oxccl/world1/peer/1", record).unwrap();
        match Communicator::init_with_config(0, 2, store, short()) {
            Err(Error::Store(msg)) => {
                for n in ["rank 0: init", "oxccl/world1/peer/1", needle] {
                    assert!(msg.contains(n), "{msg:?} lacks {n:?}");
                }
            }
            other => panic!("expected Error::Store, got {other:?}"),
        }
    }
}
