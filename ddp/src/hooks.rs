//! Comm hooks: how a full bucket is averaged across ranks.
//!
//! A hook takes a bucket's flat gradients, starts whatever communication it needs, and returns a
//! [`HookWork`] that DDP waits on in `finish()`; the buffer it hands back must hold the average
//! over ranks. [`AllReduceAvg`] (the default) is one async all-reduce with `ReduceOp::Avg`.
//! [`CompressHook`] halves the bytes on the wire: f32/f64 buckets are pre-divided by the world
//! size, rounded to f16 or bf16, summed, and widened back (PyTorch's `fp16_compress_hook` and
//! `bf16_compress_hook`, which round first and divide in 16 bits: here each value is rounded
//! once, not twice, and a gradient up to the world size times the format's largest finite value
//! (f16: 65504) stays finite as long as the average does, where PyTorch's becomes infinite).
//! Buckets of other dtypes go through the plain all-reduce.
//! [`PowerSgd`](crate::PowerSgd) sends a low-rank approximation of each weight matrix instead
//! (PyTorch's `powerSGD_hook`): two small all-reduces per bucket with a matrix to compress, the
//! second issued while DDP waits on the bucket ([`CommHook::communicates_in_wait`]).
//! [`PostLocalSgd`](crate::PostLocalSgd) averages over a group of ranks (a node) once its
//! warm-up is over (its [`CommHook::averages_every_rank`] is false).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use oxccl_comm::{Communicator, DType, Element, ReduceOp};

use crate::error::Result;
use crate::flat::FlatBuffer;

/// A full bucket handed to a hook.
#[derive(Debug)]
pub struct GradBucket {
    /// The bucket's position in launch order (the same on every rank).
    pub index: usize,
    /// The bucket's gradients, summed over this rank's micro-batches.
    pub buffer: FlatBuffer,
    /// The parameters whose gradients the buffer holds, in buffer order.
    pub params: Vec<BucketEntry>,
}

/// Where one parameter's gradient lies in a [`GradBucket`]'s buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketEntry {
    /// The parameter's index (its position in the list given to [`Ddp::new`](crate::Ddp::new)).
    pub param: usize,
    /// Its first element in the buffer.
    pub offset: usize,
    /// Its number of elements.
    pub len: usize,
}

/// What waiting on a hook runs: it may use the communicator again (a second round).
type Finish = Box<dyn FnOnce(&Communicator) -> Result<FlatBuffer> + Send>;

/// The pending result of a hook: waiting gives back the averaged bucket.
#[must_use = "a bucket's gradients come back only through wait()"]
pub struct HookWork(Finish);

impl HookWork {
    /// Work that completes by running `f` (which waits on the hook's collectives).
    pub fn new(f: impl FnOnce() -> Result<FlatBuffer> + Send + 'static) -> HookWork {
        HookWork(Box::new(move |_: &Communicator| f()))
    }

    /// Work that completes by running `f` with the bucket's communicator: for hooks that issue
    /// more collectives once the first ones are done (their [`CommHook::communicates_in_wait`]
    /// must then say so).
    pub fn with_comm(
        f: impl FnOnce(&Communicator) -> Result<FlatBuffer> + Send + 'static,
    ) -> HookWork {
        HookWork(Box::new(f))
    }

    /// Work that is already complete.
    pub fn ready(buffer: FlatBuffer) -> HookWork {
        HookWork::new(move || Ok(buffer))
    }

    /// Waits for the hook's communication; returns the averaged bucket. `comm` is the
    /// communicator the hook was started on.
    ///
    /// # Errors
    /// The hook's error, usually a collective's (`PeerLost`, `Timeout`, ...).
    pub fn wait(self, comm: &Communicator) -> Result<FlatBuffer> {
        (self.0)(comm)
    }
}

/// A communication hook: replaces the all-reduce of every bucket (see the module docs).
pub trait CommHook: Send {
    /// A short name for logs.
    fn name(&self) -> &str;

    /// Starts averaging `bucket` across the ranks of `comm`. Called on every rank for every bucket
    /// in the same order; it must issue the same collectives on every rank.
    fn start(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork;

    /// Whether waiting on this hook's work issues collectives ([`HookWork::with_comm`]).
    /// DDP then starts every bucket of a step before waiting on the first, whatever each rank's
    /// [`Overlap`](crate::Overlap), so that every rank issues the second rounds at the same
    /// place in its sequence of collectives: every bucket's first round, then the second
    /// rounds in bucket order. Default `false`.
    fn communicates_in_wait(&self) -> bool {
        false
    }

    /// Whether the buffer [`HookWork::wait`] gives back is an average over every rank of DDP's
    /// communicator, which [`UnevenInputs::DivideByActiveRanks`](crate::UnevenInputs) rescales
    /// by world size / ranks training. A hook that averages over fewer ranks (e.g.
    /// [`PostLocalSgd`](crate::PostLocalSgd), over a group) returns `false`, and
    /// `Ddp::set_comm_hook` refuses it with that setting. Default `true`.
    fn averages_every_rank(&self) -> bool {
        true
    }

    /// Settings that must be alike on every rank, by name and value (a float as its bits). DDP
    /// compares them and the hook's [`CommHook::name`] between the ranks in one small
    /// all-reduce (a second one names the settings when only their values differ), before the
    /// first bucket of the first step after [`Ddp::set_comm_hook`](crate::Ddp::set_comm_hook),
    /// and when they differ fails that step and every later one on every rank alike, naming
    /// them, without starting the hook. A setting that differs could otherwise go unnoticed:
    /// PowerSGD's seed, say, gives each rank other random matrices, and the averages are wrong
    /// with no error. The comparison blocks: with overlap, the `grad_ready` that fills the
    /// first bucket waits there for every rank to reach its first bucket (a rank with overlap
    /// off reaches it in `finish()`), once per `set_comm_hook`. Default: none (the name is
    /// still compared).
    fn settings(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }

    /// What this hook does on device buckets (the `cuda` feature's `DeviceDdp`): `None`, the
    /// default, for a hook that works on host memory only (PowerSGD, post-local SGD): `DeviceDdp`
    /// then refuses it with an error that says so.
    fn on_device(&self) -> Option<DeviceHook> {
        None
    }
}

/// A comm hook as device buckets run it: on the reducer's communication stream, with device
/// collectives and the kernels crate's conversion kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceHook {
    /// [`AllReduceAvg`]: the bucket all-reduced with `ReduceOp::Avg`.
    Avg,
    /// [`CompressHook`]: `f32` buckets scaled by 1/world and converted to this dtype (`f16` or
    /// `bf16`), summed, and converted back, as on the host; other dtypes averaged as they are.
    Compress(DType),
}

/// A boxed hook is a hook: for a hook chosen at run time (`Box<dyn CommHook>`).
impl<H: CommHook + ?Sized> CommHook for Box<H> {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn start(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork {
        (**self).start(comm, bucket)
    }

    fn communicates_in_wait(&self) -> bool {
        (**self).communicates_in_wait()
    }

    fn averages_every_rank(&self) -> bool {
        (**self).averages_every_rank()
    }

    fn settings(&self) -> Vec<(&'static str, u64)> {
        (**self).settings()
    }

    fn on_device(&self) -> Option<DeviceHook> {
        (**self).on_device()
    }
}

/// The default hook: one async all-reduce with `ReduceOp::Avg` per bucket, in place.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllReduceAvg;

impl CommHook for AllReduceAvg {
    fn name(&self) -> &str {
        "all_reduce_avg"
    }

    fn on_device(&self) -> Option<DeviceHook> {
        Some(DeviceHook::Avg)
    }

    /// The bucket's flat buffer goes to the communicator as it is (an untyped view of its
    /// dtype): no typed copy on the way.
    fn start(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork {
        let work = comm
            .buffers()
            .all_reduce_async(bucket.buffer, ReduceOp::Avg);
        HookWork::new(move || Ok(work.wait()?))
    }
}

/// Compression to a 16-bit float on the wire (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct CompressHook {
    wire: DType,
}

impl CompressHook {
    /// f16 on the wire (PyTorch's `fp16_compress_hook`).
    pub fn fp16() -> CompressHook {
        CompressHook { wire: DType::F16 }
    }

    /// bf16 on the wire (PyTorch's `bf16_compress_hook`).
    pub fn bf16() -> CompressHook {
        CompressHook { wire: DType::BF16 }
    }

    /// The dtype sent.
    pub fn wire(&self) -> DType {
        self.wire
    }
}

/// A wide float that packs into and unpacks from a 16-bit float slice.
trait Wide: Element + Copy + std::ops::Mul<Output = Self> {
    fn inv(n: usize) -> Self;
    fn pack<H>(dst: &mut [H], src: &[Self])
    where
        [H]: HalfFloatSliceExt;
    fn unpack<H>(src: &[H], dst: &mut [Self])
    where
        [H]: HalfFloatSliceExt;
}

impl Wide for f32 {
    fn inv(n: usize) -> f32 {
        1.0 / n as f32
    }
    fn pack<H>(dst: &mut [H], src: &[f32])
    where
        [H]: HalfFloatSliceExt,
    {
        dst.convert_from_f32_slice(src);
    }
    fn unpack<H>(src: &[H], dst: &mut [f32])
    where
        [H]: HalfFloatSliceExt,
    {
        src.convert_to_f32_slice(dst);
    }
}

impl Wide for f64 {
    fn inv(n: usize) -> f64 {
        1.0 / n as f64
    }
    fn pack<H>(dst: &mut [H], src: &[f64])
    where
        [H]: HalfFloatSliceExt,
    {
        dst.convert_from_f64_slice(src);
    }
    fn unpack<H>(src: &[H], dst: &mut [f64])
    where
        [H]: HalfFloatSliceExt,
    {
        src.convert_to_f64_slice(dst);
    }
}

/// Pre-divides by the world size, rounds to `H`, and sums `H`s across ranks; waiting widens the
/// sum back into the bucket.
fn compressed<W: Wide, H: Element + Default>(comm: &Communicator, mut buf: FlatBuffer) -> HookWork
where
    [H]: HalfFloatSliceExt,
{
    let inv = W::inv(comm.size());
    let mut wire = vec![H::default(); buf.len()];
    if let Some(src) = buf.as_slice::<W>() {
        let mut tmp = [W::from_f64(0.0); 1024];
        for (d, s) in wire.chunks_mut(1024).zip(src.chunks(1024)) {
            for (t, &x) in tmp.iter_mut().zip(s) {
                *t = x * inv;
            }
            W::pack(d, &tmp[..s.len()]);
        }
    }
    let work = comm.all_reduce_async(wire, ReduceOp::Sum);
    HookWork::new(move || {
        let wire = work.wait()?;
        if let Some(dst) = buf.as_mut_slice::<W>() {
            W::unpack(&wire, dst);
        }
        Ok(buf)
    })
}

impl CommHook for CompressHook {
    fn name(&self) -> &str {
        match self.wire {
            DType::F16 => "fp16_compress",
            _ => "bf16_compress",
        }
    }

    fn on_device(&self) -> Option<DeviceHook> {
        Some(DeviceHook::Compress(self.wire))
    }

    fn start(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork {
        let buf = bucket.buffer;
        match (buf.dtype(), self.wire) {
            (DType::F32, DType::F16) => compressed::<f32, f16>(comm, buf),
            (DType::F32, DType::BF16) => compressed::<f32, bf16>(comm, buf),
            (DType::F64, DType::F16) => compressed::<f64, f16>(comm, buf),
            (DType::F64, DType::BF16) => compressed::<f64, bf16>(comm, buf),
            _ => AllReduceAvg.start(
                comm,
                GradBucket {
                    buffer: buf,
                    ..bucket
                },
            ),
        }
    }
}
