//! [`Registered`]: a host buffer that transports may send straight from.

use std::ops::{Deref, DerefMut};

use oxccl_kernels::Element;

use crate::base::error::{Error, Result};
use crate::base::shared_mem::SharedMem;
use crate::transport::registry::{Entry, Registry};

/// A host buffer registered for sending straight from its memory and receiving straight into
/// it, like NCCL's `ncclCommRegister`:
///
/// - **Shared memory.** Its memory is an anonymous shared file (`memfd_create`) that the other
///   processes of the node map, so ranks write straight into each other's registered buffers:
///   an all-gather whose every rank's output is registered copies each block once, from its
///   input into every output (the `mapped` algorithm), instead of into a slot and out again; an
///   all-reduce whose every rank's buffer is registered reduces each piece straight from every
///   buffer and writes it into each.
///   Where the file cannot be made, the memory is private and the slots carry everything.
/// - **RDMA.** Large messages leave by RDMA write from the buffer itself instead of being
///   copied into the connection's registered slots first, and a large message copied into it as
///   it arrives is offered to its sender, which writes it there instead of into a slot (the
///   memory region is made at the first such use on each device, and dropped at the next one
///   after the buffer goes, or with the communicator; a buffer the device refuses goes through
///   the slots).
///
/// Other transports treat it as any buffer. It owns its memory, which cannot grow or move while
/// registered, and derefs to a slice, so it goes wherever a buffer goes:
/// `comm.all_reduce(&mut reg, op)`, or by value into the async calls. A peer keeps its mapping
/// of a dropped buffer (and so its pages) until that peer maps a newer one in its place or its
/// communicator goes: register long-lived buffers, not one per step.
///
/// ```
/// # use oxccl_comm::{Communicator, Config, Registered, ReduceOp, Result};
/// fn step(comm: &Communicator) -> Result<Vec<f32>> {
///     let mut grads = Registered::new(vec![1.0f32; 1 << 20])?;
///     comm.all_reduce(&mut grads, ReduceOp::Sum)?;
///     Ok(grads.into_inner())
/// }
/// # for r in oxccl_comm::harness::spawn_world(2, Config::default(), |c| step(&c)) {
/// #     assert!(r?.iter().all(|&x| x == 2.0));
/// # }
/// # Ok::<(), oxccl_comm::Error>(())
/// ```
pub struct Registered<T: Element> {
    mem: Memory<T>,
    entry: Option<Entry>,
}

/// Where a [`Registered`] buffer's elements live.
enum Memory<T> {
    /// `len` elements at the start of a shared file's mapping.
    Shared(SharedMem, usize),
    /// Private memory (empty buffers, or no shared file could be made).
    Private(Vec<T>),
}

impl<T: Element> Registered<T> {
    /// Registers `buf`'s elements, moved into shared memory (an empty buffer registers
    /// nothing; where no shared file can be made, `buf` itself is registered).
    ///
    /// # Errors
    /// `InvalidArgument` if its memory overlaps a registered buffer's (it cannot, for buffers
    /// made here: each owns its memory).
    pub fn new(buf: Vec<T>) -> Result<Registered<T>> {
        let mem = match shared::<T>(buf.len()) {
            Some(mut m) => {
                m.bytes_mut()[..std::mem::size_of_val(buf.as_slice())]
                    .copy_from_slice(bytemuck::cast_slice(&buf));
                Memory::Shared(m, buf.len())
            }
            None => Memory::Private(buf),
        };
        Registered::register(mem)
    }

    /// `len` zeroed elements, registered (in shared memory, as [`Registered::new`] puts them,
    /// without a copy).
    ///
    /// # Errors
    /// As [`Registered::new`].
    pub fn zeroed(len: usize) -> Result<Registered<T>> {
        let mem = match shared::<T>(len) {
            Some(m) => Memory::Shared(m, len),
            None => Memory::Private(vec![T::zeroed(); len]),
        };
        Registered::register(mem)
    }

    fn register(mem: Memory<T>) -> Result<Registered<T>> {
        let mut r = Registered { mem, entry: None };
        let fd = match &r.mem {
            Memory::Shared(m, _) => Some(m.fd()),
            Memory::Private(_) => None,
        };
        let bytes = std::mem::size_of_val(&*r);
        r.entry = Registry::global()
            .add(r.as_ptr() as usize, bytes, fd)
            .map_err(|msg| Error::InvalidArgument {
                rank: usize::MAX,
                op: "register".into(),
                msg,
            })?;
        Ok(r)
    }

    /// Whether peers on the node can map the buffer (it lives in a shared file).
    pub fn is_shared(&self) -> bool {
        matches!(self.mem, Memory::Shared(..))
    }

    /// Deregisters the buffer and gives its elements back (copied out of shared memory).
    pub fn into_inner(mut self) -> Vec<T> {
        self.deregister();
        match std::mem::replace(&mut self.mem, Memory::Private(Vec::new())) {
            Memory::Shared(m, len) => {
                bytemuck::cast_slice(&m.bytes()[..len * std::mem::size_of::<T>()]).to_vec()
            }
            Memory::Private(v) => v,
        }
    }

    fn deregister(&mut self) {
        if let Some(e) = self.entry.take() {
            Registry::global().remove(&e);
        }
    }
}

/// A shared file for `len` elements of `T`, or `None` (nothing to share, or the file could not
/// be made: logged, and the caller keeps private memory).
fn shared<T: Element>(len: usize) -> Option<SharedMem> {
    if len == 0 {
        return None;
    }
    let bytes = len.checked_mul(std::mem::size_of::<T>())?;
    SharedMem::new("oxccl-registered", bytes)
        .inspect_err(|e| {
            tracing::debug!(bytes, error = %e, "registered buffer in private memory: no shared file");
        })
        .ok()
}

impl<T: Element> Drop for Registered<T> {
    fn drop(&mut self) {
        self.deregister();
    }
}

impl<T: Element> Deref for Registered<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.mem {
            Memory::Shared(m, len) => {
                bytemuck::cast_slice(&m.bytes()[..len * std::mem::size_of::<T>()])
            }
            Memory::Private(v) => v,
        }
    }
}

impl<T: Element> DerefMut for Registered<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.mem {
            Memory::Shared(m, len) => {
                bytemuck::cast_slice_mut(&mut m.bytes_mut()[..*len * std::mem::size_of::<T>()])
            }
            Memory::Private(v) => v,
        }
    }
}

impl<T: Element> AsRef<[T]> for Registered<T> {
    fn as_ref(&self) -> &[T] {
        self
    }
}

impl<T: Element> AsMut<[T]> for Registered<T> {
    fn as_mut(&mut self) -> &mut [T] {
        self
    }
}

impl<T: Element + std::fmt::Debug> std::fmt::Debug for Registered<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("len", &self.len())
            .field("shared", &self.is_shared())
            .field("entry", &self.entry.map(|e| e.id))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registered_buffer_is_found_until_it_is_given_back() {
        let r = Registered::new(vec![0u64; 512]).unwrap();
        let (p, n) = (r.as_ptr() as usize, 512 * 8);
        let e = Registry::global().find(p, n).expect("registered");
        assert!(Registry::global().find(p + 8, 64).is_some());
        assert!(r.is_shared(), "in a shared file");
        let Memory::Shared(m, _) = &r.mem else {
            unreachable!("is_shared")
        };
        assert_eq!(e.fd, Some(m.fd()), "its entry names the file");
        let v = r.into_inner();
        assert_eq!(v, vec![0u64; 512], "the elements come back");
        assert!(
            Registry::global().find(p, 8).is_none(),
            "given back: {e:?} is gone"
        );
        let empty = Registered::<f32>::new(Vec::new()).unwrap();
        assert!(empty.is_empty());
        drop(empty);
        let d = Registered::new(vec![1.0f32; 4]).unwrap();
        let q = d.as_ptr() as usize;
        let id = Registry::global().find(q, 16).map(|x| x.id);
        assert!(id.is_some());
        drop(d);
        // (Another test's buffer may take the freed memory at once: compare ids.)
        assert_ne!(
            Registry::global().find(q, 16).map(|x| x.id),
            id,
            "dropping deregisters"
        );
    }

    #[test]
    fn shared_memory_keeps_the_elements_and_peers_see_writes() {
        let vals: Vec<f32> = (0..3000).map(|i| i as f32).collect();
        let mut r = Registered::new(vals.clone()).unwrap();
        assert!(r.is_shared());
        assert_eq!(&r[..], &vals[..], "moved in whole");
        r[2999] = -1.0;
        let Memory::Shared(m, _) = &r.mem else {
            unreachable!("is_shared")
        };
        let peer = crate::base::shared_mem::map_peer_file(std::process::id(), m.fd()).unwrap();
        let seen: &[f32] = bytemuck::cast_slice(&peer[..3000 * 4]);
        assert_eq!(seen[2999], -1.0, "a peer's mapping sees this rank's write");
        assert_eq!(seen[5], 5.0);
        let z = Registered::<f64>::zeroed(7).unwrap();
        assert_eq!(&z[..], &[0.0f64; 7]);
        assert!(Registry::global().find(z.as_ptr() as usize, 56).is_some());
    }
}
