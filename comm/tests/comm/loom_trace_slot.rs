//! Model check (loom) of the flight recorder's slot protocol (`trace/recorder.rs`, `Slot`): a
//! sequence lock over atomic words, explored over every interleaving loom allows.
//!
//! - writer: `version.store(v + 1, Relaxed)`; `fence(Release)`; every word `store(.., Relaxed)`;
//!   `version.store(v + 2, Release)`;
//! - reader: `v1 = version.load(Acquire)`; if even, every word `load(Relaxed)`;
//!   `fence(Acquire)`; keep the copy only if `version.load(Relaxed) == v1`.
//!
//! The writer writes two records one after the other, every word of record k being k; a copy
//! the reader keeps must hold one record whole (all words equal, and 0, 1 or 2). Weakening the
//! writer's fence or the reader's fence to nothing makes the model fail (see the last test).

use loom::sync::atomic::{fence, AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

const WORDS: usize = 2;

#[derive(Default)]
struct Slot {
    version: AtomicU64,
    words: [AtomicU64; WORDS],
}

impl Slot {
    fn write(&self, x: u64, fenced: bool) {
        let v = self.version.load(Ordering::Relaxed);
        self.version.store(v + 1, Ordering::Relaxed);
        if fenced {
            fence(Ordering::Release);
        }
        for w in &self.words {
            w.store(x, Ordering::Relaxed);
        }
        self.version.store(v + 2, Ordering::Release);
    }

    fn read(&self, fenced: bool) -> Option<[u64; WORDS]> {
        let v1 = self.version.load(Ordering::Acquire);
        if !v1.is_multiple_of(2) {
            return None;
        }
        let w: [u64; WORDS] = std::array::from_fn(|i| self.words[i].load(Ordering::Relaxed));
        if fenced {
            fence(Ordering::Acquire);
        }
        (self.version.load(Ordering::Relaxed) == v1).then_some(w)
    }
}

/// Whether some interleaving lets the reader keep a torn copy.
fn torn(fenced: bool) -> bool {
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = seen.clone();
    loom::model(move || {
        let slot = Arc::new(Slot::default());
        let writer = {
            let slot = slot.clone();
            thread::spawn(move || {
                slot.write(1, fenced);
                slot.write(2, fenced);
            })
        };
        if let Some(w) = slot.read(fenced) {
            if w.iter().any(|&x| x != w[0]) || w[0] > 2 {
                flag.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        writer.join().unwrap();
    });
    seen.load(std::sync::atomic::Ordering::Relaxed)
}

#[test]
fn a_kept_copy_is_never_torn() {
    assert!(!torn(true));
}

#[test]
fn without_the_fences_a_copy_can_be_torn() {
    assert!(torn(false), "the model cannot tell the fences matter");
}
