//! Model check (loom) of the shared-memory ring's head/tail protocol (`transport/shm.rs`).
//!
//! The ring itself lives in a file mapping that loom cannot instrument, so this is a model of
//! it with the same memory orderings, explored over every interleaving loom allows:
//!
//! - sender: `tail.load(Acquire)`; if `head - tail < nslots`, write the slot and its meta (meta
//!   words are `Relaxed` atomics), then `head.store(head + 1, Release)`;
//! - receiver: `head.load(Acquire)`; if `head != tail`, read meta and slot, then
//!   `tail.store(tail + 1, Release)`.
//!
//! Slot payloads are loom `UnsafeCell`s, so a write that could overlap a read of the same slot
//! (a wrong ordering, or an off-by-one in the full/empty test) fails the model as a data race;
//! the receiver also checks that every message arrives once, in order, with its tag. Changing
//! either `Release` or `Acquire` in the model to `Relaxed` makes it fail.

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

const NSLOTS: u64 = 2;
const MESSAGES: u64 = 3;

struct Ring {
    head: AtomicU64,
    tail: AtomicU64,
    /// Per-slot meta (the tag), written `Relaxed` before the head is published.
    meta: [AtomicU64; NSLOTS as usize],
    slots: [UnsafeCell<u64>; NSLOTS as usize],
}

// SAFETY: (model) slot ownership is handed over by the head/tail protocol under test; loom
// reports any access that the protocol fails to order.
unsafe impl Sync for Ring {}

fn model(release: Ordering, acquire: Ordering) {
    loom::model(move || {
        let ring = Arc::new(Ring {
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            meta: [AtomicU64::new(0), AtomicU64::new(0)],
            slots: [UnsafeCell::new(0), UnsafeCell::new(0)],
        });
        let tx = ring.clone();
        let sender = thread::spawn(move || {
            let mut head = 0u64;
            while head < MESSAGES {
                let tail = tx.tail.load(acquire);
                if head - tail >= NSLOTS {
                    thread::yield_now();
                    continue;
                }
                let i = (head % NSLOTS) as usize;
                // SAFETY: (model) the slot is free (tail acquired past it).
                tx.slots[i].with_mut(|p| unsafe { *p = 100 + head });
                tx.meta[i].store(head, Ordering::Relaxed);
                head += 1;
                tx.head.store(head, release);
            }
        });
        let mut tail = 0u64;
        while tail < MESSAGES {
            let head = ring.head.load(acquire);
            if head == tail {
                thread::yield_now();
                continue;
            }
            let i = (tail % NSLOTS) as usize;
            let tag = ring.meta[i].load(Ordering::Relaxed);
            // SAFETY: (model) the slot is published (head acquired past it).
            let v = ring.slots[i].with(|p| unsafe { *p });
            assert_eq!((tag, v), (tail, 100 + tail), "message {tail} out of order");
            tail += 1;
            ring.tail.store(tail, release);
        }
        sender.join().unwrap();
    });
}

#[test]
fn head_tail_protocol_has_no_race_and_keeps_order() {
    model(Ordering::Release, Ordering::Acquire);
}

#[test]
#[should_panic]
fn relaxed_publication_is_caught() {
    // The model is sharp: without release/acquire the slot accesses race.
    model(Ordering::Relaxed, Ordering::Relaxed);
}
