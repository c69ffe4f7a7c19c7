//! [`Registered`]: a host buffer that transports may send straight from.

use std::ops::{Deref, DerefMut};

use oxccl_kernels::Element;

use crate::base::error::{Error, Result};
use crate::transport::registry::{Entry, Registry};

/// A host buffer registered for sending straight from its memory and receiving straight into
/// it, like NCCL's `ncclCommRegister`: over RDMA, large messages leave by RDMA write from the
/// buffer itself instead of being copied into the connection's registered slots first, and a
/// large message copied into it as it arrives is offered to its sender, which writes it there
/// instead of into a slot (the memory region is made at the first such use on each device, and
/// dropped at the next one after the buffer goes, or with the communicator; a buffer the device
/// refuses goes through the slots). Other transports treat it as any buffer.
///
/// It owns its memory (a `Vec` that cannot grow or move while registered) and derefs to a
/// slice, so it goes wherever a buffer goes: `comm.all_reduce(&mut reg, op)`, or by value into
/// the async calls.
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
    buf: Vec<T>,
    entry: Option<Entry>,
}

impl<T: Element> Registered<T> {
    /// Registers `buf`'s elements (an empty buffer registers nothing).
    ///
    /// # Errors
    /// `InvalidArgument` if its memory overlaps a registered buffer's (it cannot, for buffers
    /// made here: each owns its memory).
    pub fn new(buf: Vec<T>) -> Result<Registered<T>> {
        let bytes = std::mem::size_of_val(buf.as_slice());
        let entry = Registry::global()
            .add(buf.as_ptr() as usize, bytes)
            .map_err(|msg| Error::InvalidArgument {
                rank: usize::MAX,
                op: "register".into(),
                msg,
            })?;
        Ok(Registered { buf, entry })
    }

    /// Deregisters the buffer and gives it back.
    pub fn into_inner(mut self) -> Vec<T> {
        self.deregister();
        std::mem::take(&mut self.buf)
    }

    fn deregister(&mut self) {
        if let Some(e) = self.entry.take() {
            Registry::global().remove(&e);
        }
    }
}

impl<T: Element> Drop for Registered<T> {
    fn drop(&mut self) {
        self.deregister();
    }
}

impl<T: Element> Deref for Registered<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf
    }
}

impl<T: Element> DerefMut for Registered<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf
    }
}

impl<T: Element> AsRef<[T]> for Registered<T> {
    fn as_ref(&self) -> &[T] {
        &self.buf
    }
}

impl<T: Element> AsMut<[T]> for Registered<T> {
    fn as_mut(&mut self) -> &mut [T] {
        &mut self.buf
    }
}

impl<T: Element + std::fmt::Debug> std::fmt::Debug for Registered<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("len", &self.buf.len())
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
        let v = r.into_inner();
        assert_eq!(v.as_ptr() as usize, p, "the same memory comes back");
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
}
