//! Unit tests of CUDA IPC set-up: the records ranks publish, the shape check, the host barrier
//! state the ranks of one world share, and the registration cache.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};

use super::exec::join_in;
use super::registration::RegCache;
use super::setup::{first_refusal, process_nonce, shape_reason, Record};

#[test]
fn cuda_ipc_records_round_trip_and_bad_ones_are_errors() {
    let mut handle = [0u8; 64];
    for (i, h) in handle.iter_mut().enumerate() {
        *h = (i * 37) as u8;
    }
    let with_barrier = |host_barrier| Record::Ready {
        nonce: 0xfeed_f00d_1234_5678,
        ordinal: 3,
        ptr: 0x7f00_dead_beef,
        slot: 4 << 20,
        one_shot: 256 << 10,
        host_barrier,
        handle,
    };
    let r = with_barrier(None);
    for b in [None, Some(true), Some(false)] {
        let r = with_barrier(b);
        assert_eq!(Record::decode(&r.encode()), Ok(r));
    }
    let no = Record::No("no CUDA driver (libcuda.so)".into());
    assert_eq!(Record::decode(&no.encode()), Ok(no.clone()));
    for bad in ["", "ready 1 2 3", "ready x 0 0 00", "maybe"] {
        assert!(Record::decode(bad.as_bytes()).is_err(), "{bad:?}");
    }
    // Refusals and disagreements are found, naming the rank.
    let other = Record::Ready {
        nonce: 1,
        ordinal: 0,
        ptr: 0x1000,
        slot: 1 << 20,
        one_shot: 256 << 10,
        host_barrier: None,
        handle,
    };
    let recs = |v: &[&Record]| v.iter().map(|r| r.encode()).collect::<Vec<_>>();
    assert_eq!(first_refusal(&recs(&[&r, &r])), None);
    let why = first_refusal(&recs(&[&r, &no])).unwrap();
    assert!(why.starts_with("rank 1: no CUDA driver"), "{why}");
    let why = first_refusal(&recs(&[&r, &r, &other])).unwrap();
    assert!(
        why.contains("rank 2") && why.contains("OXCCL_CUDA_IPC_SLOT=1048576"),
        "{why}"
    );
    let device = with_barrier(Some(false));
    let why = first_refusal(&recs(&[&r, &device])).unwrap();
    assert!(
        why.contains("rank 1") && why.contains("OXCCL_CUDA_IPC_BARRIER=device"),
        "{why}"
    );
}

#[test]
fn cuda_ipc_host_barrier_state_is_shared_by_one_world_only() {
    // Each rank of a world takes its slot; the ranks of a world meet in one state, and a
    // world whose key is still held by a full old one gets its own.
    type Slots = Vec<OnceLock<()>>;
    let mut map: HashMap<String, Weak<Slots>> = HashMap::new();
    let take = |map: &mut HashMap<String, Weak<Slots>>, key: &str, rank: usize| {
        let t = join_in(
            map,
            key.into(),
            |t: &Slots| t.len() == 2 && t[rank].get().is_none(),
            || vec![OnceLock::new(), OnceLock::new()],
        );
        t[rank].set(()).unwrap();
        t
    };
    let a0 = take(&mut map, "w", 0);
    let a1 = take(&mut map, "w", 1);
    assert!(Arc::ptr_eq(&a0, &a1));
    let b0 = take(&mut map, "w", 0);
    assert!(!Arc::ptr_eq(&a0, &b0));
    assert!(Arc::ptr_eq(&b0, &take(&mut map, "w", 1)));
    assert!(!Arc::ptr_eq(&a0, &take(&mut map, "v", 0)));
    drop((a0, a1, b0));
    let _ = take(&mut map, "u", 0);
    assert_eq!(map.len(), 1, "entries of dropped worlds go");
}

#[test]
fn cuda_ipc_process_nonce_is_stable_within_a_process() {
    assert_eq!(process_nonce(), process_nonce());
}

#[test]
fn cuda_ipc_shape_is_decided_from_facts_every_rank_shares() {
    let nodes = |ids: &'static [&'static str]| move |a: usize, b: usize| ids[a] == ids[b];
    assert!(shape_reason(1, nodes(&["a"])).is_some());
    assert!(shape_reason(3, nodes(&["a", "a", "b"]))
        .unwrap()
        .contains("more than one node"));
    assert!(shape_reason(9, nodes(&["a"; 9]))
        .unwrap()
        .contains("at most 8"));
    assert_eq!(shape_reason(8, nodes(&["a"; 8])), None);
}

#[test]
fn cuda_ipc_registration_cache_maps_once_and_unmaps_after_the_last_user() {
    let cache: RegCache<u32, u64> = RegCache::new();
    let opens = std::cell::Cell::new(0);
    let open = || -> std::result::Result<u64, ()> {
        opens.set(opens.get() + 1);
        Ok(0x1000)
    };
    assert_eq!(cache.acquire(&7, open), Ok(0x1000));
    assert_eq!(cache.acquire(&7, open), Ok(0x1000));
    assert_eq!((opens.get(), cache.holders(&7)), (1, 2));
    let closed = std::cell::Cell::new(0);
    cache.release(&7, |_| closed.set(closed.get() + 1));
    assert_eq!((closed.get(), cache.holders(&7)), (0, 1));
    cache.release(&7, |v| {
        assert_eq!(v, 0x1000);
        closed.set(closed.get() + 1);
    });
    assert_eq!((closed.get(), cache.holders(&7)), (1, 0));
    // A failed open is not cached; releasing an unknown key does nothing.
    assert_eq!(cache.acquire(&8, || Err::<u64, ()>(())), Err(()));
    cache.release(&8, |_| panic!("nothing to close"));
    assert_eq!(cache.acquire(&7, open), Ok(0x1000));
    assert_eq!(opens.get(), 2);
}
