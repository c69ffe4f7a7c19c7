//! Running point-to-point operations on the execution state: per-pair sequence numbers (ranks
//! that are not involved never see them) in every message's tag, and batches in waves.

use oxccl_kernels::{DType, ReduceOp};

use super::{ExecState, Shared};
use crate::algorithm::prims::{Ctx, RecvMode, RecvPart, SendPart};
use crate::base::error::Result;
use crate::base::op::{Collective, OpDesc, Tag};
use crate::base::trace::What;
use crate::transport::Links;

/// The tag of a point-to-point message: per-pair sequence number, dtype and element count.
fn p2p_tag(dtype: DType, count: usize, seq: u64) -> Tag {
    OpDesc {
        coll: Collective::SendRecv,
        dtype,
        op: ReduceOp::Sum,
        root: 0,
        count,
    }
    .tag(seq)
}

/// Runs a batch (its turn has come) in waves: wave k holds the k-th send to each peer and the
/// k-th receive from each peer, so no two parts of one wave share a connection and direction;
/// each wave's parts progress together. The peer's matching operation is in its wave k too (or
/// in a plain call of its own), so waves cannot wait on each other in a cycle.
pub(crate) fn exec_batch(
    shared: &Shared,
    st: &mut ExecState,
    sends: Vec<(usize, &[u8])>,
    recvs: Vec<(usize, &mut [u8])>,
    dtype: DType,
    es: usize,
) -> Result<()> {
    let sent: usize = sends.iter().map(|(_, d)| d.len()).sum();
    let recvd: usize = recvs.iter().map(|(_, b)| b.len()).sum();
    let what = What::P2p {
        dtype,
        send_to: None,
        recv_from: None,
        sends: sends.len(),
        recvs: recvs.len(),
        count: if sent > 0 { sent } else { recvd } / es,
        bytes: sent + recvd,
    };
    // Tags in batch order, then the wave of each part: its index among the parts to its peer.
    let n = shared.size;
    let mut waves: Vec<(Vec<SendPart<'_>>, Vec<RecvPart<'_>>)> = Vec::new();
    let mut wave_of = vec![0usize; n];
    for (p, d) in sends {
        st.p2p_sent[p] += 1;
        shared.trace.note_message(p, true, st.p2p_sent[p]);
        let tag = p2p_tag(dtype, d.len() / es, st.p2p_sent[p]);
        let w = wave_of[p];
        wave_of[p] += 1;
        if waves.len() <= w {
            waves.resize_with(w + 1, Default::default);
        }
        waves[w].0.push(SendPart::new(p, d, tag));
    }
    wave_of.iter_mut().for_each(|w| *w = 0);
    for (p, b) in recvs {
        st.p2p_recvd[p] += 1;
        shared.trace.note_message(p, false, st.p2p_recvd[p]);
        let tag = p2p_tag(dtype, b.len() / es, st.p2p_recvd[p]);
        let w = wave_of[p];
        wave_of[p] += 1;
        if waves.len() <= w {
            waves.resize_with(w + 1, Default::default);
        }
        waves[w].1.push(RecvPart::new(p, b, RecvMode::Copy, tag));
    }
    tracing::debug!(rank = shared.rank, waves = waves.len(), "batch-p2p");
    shared.trace.record(what, || {
        let mut ctx = p2p_ctx(shared, &mut st.links, "batch-p2p");
        for (mut s, mut r) in waves {
            ctx.exchange_many(&mut s, &mut r)?;
        }
        ctx.flush()
    })
}

/// Runs one point-to-point exchange on the execution state (its turn has come).
pub(crate) fn exec_p2p(
    shared: &Shared,
    st: &mut ExecState,
    send: Option<(usize, &[u8])>,
    recv: Option<(usize, &mut [u8])>,
    dtype: DType,
    es: usize,
) -> Result<()> {
    let tag_for = |count: usize, seq: u64| p2p_tag(dtype, count, seq);
    let send = send.map(|(p, d)| {
        st.p2p_sent[p] += 1;
        shared.trace.note_message(p, true, st.p2p_sent[p]);
        (p, d, tag_for(d.len() / es, st.p2p_sent[p]))
    });
    let recv = recv.map(|(p, b)| {
        st.p2p_recvd[p] += 1;
        shared.trace.note_message(p, false, st.p2p_recvd[p]);
        let tag = tag_for(b.len() / es, st.p2p_recvd[p]);
        (p, b, RecvMode::Copy, tag)
    });
    tracing::debug!(rank = shared.rank, send_to = ?send.as_ref().map(|s| s.0), recv_from = ?recv.as_ref().map(|r| r.0), "send-recv");
    let (sent, recvd) = (
        send.as_ref().map_or(0, |s| s.1.len()),
        recv.as_ref().map_or(0, |r| r.1.len()),
    );
    let what = What::P2p {
        dtype,
        send_to: send.as_ref().map(|s| (s.0, s.2.seq)),
        recv_from: recv.as_ref().map(|r| (r.0, r.3.seq)),
        sends: usize::from(send.is_some()),
        recvs: usize::from(recv.is_some()),
        count: if send.is_some() { sent } else { recvd } / es,
        bytes: sent + recvd,
    };
    shared.trace.record(what, || {
        let mut ctx = p2p_ctx(shared, &mut st.links, "send-recv");
        ctx.exchange_tagged(send, recv)?;
        ctx.flush()
    })
}

/// The context of a point-to-point operation: no collective tag (every message carries its
/// own), the communicator's time-out, abort flag and spinning policy.
fn p2p_ctx<'a>(shared: &'a Shared, links: &'a mut Links, name: &'static str) -> Ctx<'a> {
    let mut ctx = Ctx::new(
        shared.rank,
        shared.size,
        links,
        Default::default(),
        name,
        shared.timeout,
        &shared.abort,
    );
    ctx.spin = shared.spin;
    ctx.send_thread = shared.send_thread.as_ref();
    ctx.stalls = Some(&shared.stalls);
    ctx.trace = Some(&shared.trace);
    ctx
}
