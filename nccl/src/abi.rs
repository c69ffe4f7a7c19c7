//! NCCL's C types and values (its `nccl.h` of 2.30), written out for Rust. Enums arrive as C
//! `int`s and are checked here, never transmuted: a value out of range is an error, not
//! undefined behaviour.

use std::ffi::{c_char, c_int, c_uint};

use oxccl_comm::{DType, ReduceOp};

/// `ncclResult_t`.
pub type NcclResult = c_int;
/// `ncclSuccess`.
pub const SUCCESS: NcclResult = 0;
/// `ncclUnhandledCudaError`.
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
/// `ncclSystemError`.
pub const SYSTEM_ERROR: NcclResult = 2;
/// `ncclInternalError`.
pub const INTERNAL_ERROR: NcclResult = 3;
/// `ncclInvalidArgument`.
pub const INVALID_ARGUMENT: NcclResult = 4;
/// `ncclInvalidUsage`.
pub const INVALID_USAGE: NcclResult = 5;
/// `ncclRemoteError`.
pub const REMOTE_ERROR: NcclResult = 6;
/// `ncclInProgress`.
pub const IN_PROGRESS: NcclResult = 7;
/// `ncclTimeout`.
pub const TIMEOUT: NcclResult = 8;

/// The NCCL version this library implements, as `ncclGetVersion` reports it (2.30.0): callers
/// such as nccl-tests turn features on by it (bf16 and avg from 2.10, pre-multiplied sums from
/// 2.11, fp8 from 2.24).
pub const VERSION_CODE: c_int = 23000;

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: opaque bytes that callers copy by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    /// The bytes (see `crate::id` for what oxccl puts there).
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// `NCCL_API_MAGIC`: the `magic` of an initialised `ncclConfig_t`.
pub const API_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`.
pub const UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_SPLIT_NOCOLOR`.
pub const SPLIT_NOCOLOR: c_int = -1;

/// `ncclConfig_t` as of NCCL 2.30 (`ncclConfig_v23000`). Callers built against an older
/// header pass a smaller `size`: only that many bytes are read ([`Config::read`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)] // NCCL's field names, documented by NCCL
pub struct Config {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const c_char,
    pub split_share: c_int,
    pub traffic_class: c_int,
    pub comm_name: *const c_char,
    pub collnet_enable: c_int,
    pub cta_policy: c_int,
    pub shrink_share: c_int,
    pub nvls_ctas: c_int,
    pub n_channels_per_net_peer: c_int,
    pub nvlink_centric_sched: c_int,
    pub graph_usage_mode: c_int,
    pub num_rma_ctx: c_int,
    pub max_p2p_peers: c_int,
    pub graph_stream_ordering: c_int,
}

impl Default for Config {
    /// `NCCL_CONFIG_INITIALIZER`: every attribute undefined.
    fn default() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: API_MAGIC,
            version: VERSION_CODE as c_uint,
            blocking: UNDEF_INT,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
            traffic_class: UNDEF_INT,
            comm_name: std::ptr::null(),
            collnet_enable: UNDEF_INT,
            cta_policy: UNDEF_INT,
            shrink_share: UNDEF_INT,
            nvls_ctas: UNDEF_INT,
            n_channels_per_net_peer: UNDEF_INT,
            nvlink_centric_sched: UNDEF_INT,
            graph_usage_mode: UNDEF_INT,
            num_rma_ctx: UNDEF_INT,
            max_p2p_peers: UNDEF_INT,
            graph_stream_ordering: UNDEF_INT,
        }
    }
}

/// Bytes of `size`, `magic` and `version`: the least a config can hold.
const CONFIG_HEADER: usize = std::mem::size_of::<usize>() + 2 * std::mem::size_of::<c_uint>();

impl Config {
    /// The caller's config, read only up to its declared `size` (the rest stays undefined, as
    /// for a caller built against an older header); `None` (a null pointer) is the default.
    ///
    /// # Errors
    /// A text naming what is wrong: a `size` smaller than its own header, a wrong `magic`.
    ///
    /// # Safety
    /// `ptr` is null or points to at least `size_of::<usize>()` readable bytes, and to as many
    /// as the `size` written there.
    pub unsafe fn read(ptr: *const Config) -> Result<Config, String> {
        let mut cfg = Config::default();
        if ptr.is_null() {
            return Ok(cfg);
        }
        // SAFETY: the caller promises the first word is readable (`size` is a field of every
        // version of the struct); read unaligned, as C callers may pack it anywhere.
        let size = unsafe { std::ptr::read_unaligned(ptr.cast::<usize>()) };
        if size < CONFIG_HEADER {
            return Err(format!(
                "ncclConfig_t.size = {size} is smaller than its header ({CONFIG_HEADER} bytes): \
                 initialise it with NCCL_CONFIG_INITIALIZER"
            ));
        }
        let n = size.min(std::mem::size_of::<Config>());
        // SAFETY: the caller's struct holds `size` >= `n` readable bytes, `cfg` holds
        // `size_of::<Config>()` >= `n`; they do not overlap (`cfg` is a local). Every bit
        // pattern is a valid `Config` (integers and raw pointers).
        unsafe {
            std::ptr::copy_nonoverlapping(
                ptr.cast::<u8>(),
                (&mut cfg as *mut Config).cast::<u8>(),
                n,
            );
        }
        if cfg.magic != API_MAGIC {
            return Err(format!(
                "ncclConfig_t.magic = {:#x}, expected {API_MAGIC:#x}: initialise it with \
                 NCCL_CONFIG_INITIALIZER",
                cfg.magic
            ));
        }
        Ok(cfg)
    }

    /// `blocking` as given: `true` unless the caller set 0 (non-blocking).
    pub fn blocking(&self) -> bool {
        self.blocking != 0
    }

    /// `blocking` if the caller set it (not `NCCL_CONFIG_UNDEF_INT`).
    pub fn blocking_set(&self) -> Option<bool> {
        (self.blocking != UNDEF_INT).then(|| self.blocking())
    }
}

/// `ncclDataType_t` as oxccl's [`DType`].
pub fn dtype(v: c_int) -> Option<DType> {
    Some(match v {
        0 => DType::I8,
        1 => DType::U8,
        2 => DType::I32,
        3 => DType::U32,
        4 => DType::I64,
        5 => DType::U64,
        6 => DType::F16,
        7 => DType::F32,
        8 => DType::F64,
        9 => DType::BF16,
        10 => DType::F8E4M3,
        11 => DType::F8E5M2,
        _ => return None,
    })
}

/// `ncclNumOps`: the first value of an operation made by `ncclRedOpCreatePreMulSum`.
pub const NUM_OPS: c_int = 5;

/// A built-in `ncclRedOp_t` as oxccl's [`ReduceOp`] (`None` for a created one or a value out of
/// range).
pub fn builtin_op(v: c_int) -> Option<ReduceOp> {
    Some(match v {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Prod,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        4 => ReduceOp::Avg,
        _ => return None,
    })
}

/// `ncclScalarHostImmediate`.
pub const SCALAR_HOST_IMMEDIATE: c_int = 1;

/// How many operations `ncclRedOpCreatePreMulSum` may make on one communicator.
pub const NCCL_OPS_LIMIT: usize = 1 << 16;
