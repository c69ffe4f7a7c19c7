//! Byte strings of any length between ranks, like torch's `all_gather_object` and
//! `broadcast_object_list` without the pickling: the caller serializes (serde, bincode, JSON...)
//! and gets bytes back. Each call is two collectives: the lengths first, then the bytes.

use crate::api::communicator::Communicator;
use crate::base::error::Result;

impl Communicator {
    /// Every rank's `mine`, in rank order, whatever their lengths (dataset shard lists, metadata,
    /// checksums of a checkpoint): an all-gather of the lengths, then an
    /// [`all_gather_v_into`](Self::all_gather_v_into) of the bytes.
    ///
    /// ```no_run
    /// # fn f(comm: &oxccl_comm::Communicator) -> oxccl_comm::Result<()> {
    /// let mine = format!("rank {} read 1200 samples", comm.rank());
    /// for (r, b) in comm.all_gather_bytes(mine.as_bytes())?.iter().enumerate() {
    ///     println!("{r}: {}", String::from_utf8_lossy(b));
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// Those of the two collectives; `InvalidArgument` if the lengths add up to more than this
    /// process can address or allocate (the communicator is then aborted, so the other ranks
    /// fail at once). The bytes are received in one buffer and copied out: the peak memory is
    /// twice the total.
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut lens = vec![0u64; self.size()];
        self.all_gather_into(&[mine.len() as u64], &mut lens)?;
        let counts = lens
            .iter()
            .map(|&l| usize::try_from(l))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .ok()
            .filter(|c| {
                c.iter()
                    .try_fold(0usize, |a, &b| a.checked_add(b))
                    .is_some()
            })
            .ok_or_else(|| {
                self.give_up(
                    "all_gather_bytes",
                    format!(
                        "the ranks' lengths {lens:?} add up to more than this process can address"
                    ),
                )
            })?;
        let mut all = self.zeroed("all_gather_bytes", counts.iter().sum())?;
        self.all_gather_v_into(mine, &mut all, &counts)?;
        let mut out = Vec::with_capacity(counts.len());
        let mut at = 0;
        for &c in &counts {
            let mut piece = Vec::new();
            piece.try_reserve_exact(c).map_err(|e| {
                self.invalid(
                    "all_gather_bytes",
                    format!("cannot allocate {c} bytes: {e}"),
                )
            })?;
            piece.extend_from_slice(&all[at..at + c]);
            out.push(piece);
            at += c;
        }
        Ok(out)
    }

    /// The root's `data` on every rank, whatever its length (a configuration, a run id, a
    /// tokenizer's vocabulary): a broadcast of the length, then of the bytes. `data` is read on
    /// the root only; other ranks may pass `&[]`.
    ///
    /// # Errors
    /// `InvalidArgument` for a root outside the communicator, or on a rank that cannot address
    /// or allocate the root's length (the communicator is then aborted, so the other ranks fail
    /// at once); those of the two broadcasts.
    pub fn broadcast_bytes(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        if root >= self.size() {
            return Err(self.invalid(
                "broadcast_bytes",
                format!(
                    "root {root} is not a rank of this communicator (size {})",
                    self.size()
                ),
            ));
        }
        let mut len = [data.len() as u64];
        self.broadcast(&mut len, root)?;
        let n = usize::try_from(len[0]).map_err(|_| {
            self.give_up(
                "broadcast_bytes",
                format!(
                    "the root's {} bytes are more than this process can address",
                    len[0]
                ),
            )
        })?;
        let mut out = self.zeroed("broadcast_bytes", n)?;
        let input = if self.rank() == root { data } else { &[] };
        self.broadcast_into(input, &mut out, root)?;
        Ok(out)
    }

    /// `n` zero bytes, or `InvalidArgument` (for `op`) when they cannot be allocated.
    fn zeroed(&self, op: &str, n: usize) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        v.try_reserve_exact(n)
            .map_err(|e| self.give_up(op, format!("cannot allocate {n} bytes: {e}")))?;
        v.resize(n, 0);
        Ok(v)
    }

    /// The error of a rank that cannot take part in its call's second collective: the
    /// communicator is aborted, so the peers learn at once instead of waiting for it until their
    /// time-out (and this rank's later calls fail instead of being paired with the wrong ones).
    fn give_up(&self, op: &str, msg: String) -> crate::Error {
        self.abort();
        self.invalid(op, msg)
    }
}
