// oxccl device kernels: reductions, copies and scaling for every (dtype, op).
//
// Compiled at run time by NVRTC (oxccl-kernels' `cuda` feature). This file holds the generic
// code only; the `extern "C"` entry points are generated from the Rust table
// `oxccl_kernels::cuda::TABLE` and appended to this source, so the Rust dispatch and the kernel
// instantiations come from one list and cannot drift apart.
//
// No CUDA headers are needed: f16 / bf16 / fp8 conversions are written out here (PTX `cvt` for
// f16, bit operations for bf16, both for fp8) with the same rounding as the host kernels (round to
// nearest even after every step; fp8 saturates to its largest finite value, as CUDA's
// __NV_SATFINITE conversions do).
//
// Semantics follow the host kernels exactly: integer sum/prod wrap (computed in unsigned
// arithmetic: signed overflow is undefined in C++), float min/max propagate NaN
// (`a` NaN -> a, else `a < b ? a : b`), f16/bf16 are widened to f32, combined and rounded back.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned long long usize;

struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };
struct f8e4m3 { u8 bits; };
struct f8e5m2 { u8 bits; };

// ---- conversions to and from the type computations run in ------------------------------------

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((u32)h) << 16);
}
// Round to nearest even; NaN stays NaN (quiet bit set), as the `half` crate does on the host.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return (unsigned short)((x >> 16) | 0x0040u);
    }
    u32 round_bit = 0x8000u;
    if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) {
        return (unsigned short)((x >> 16) + 1u);
    }
    return (unsigned short)(x >> 16);
}

// OXCCL_FP8_BEGIN (kernels/tests/kernels/fp8.rs compiles this section on the host)
//
// fp8 -> f32 is exact. E4M3 (bias 7, no infinities, 0x7f NaN): the exponent and mantissa bits
// move into an f32 whose exponent is rebiased by 120; subnormals are m * 2^-9. E5M2 is the top
// byte of an f16.
__device__ __forceinline__ float e4m3_to_f32_soft(u32 b) {
    u32 sign = (b & 0x80u) << 24;
    u32 em = b & 0x7fu;
    if (em == 0x7fu) return __uint_as_float(sign | 0x7fc00000u);
    if (em < 8u) return __uint_as_float(sign | __float_as_uint((float)em * 0.001953125f));
    return __uint_as_float(sign | ((em + (120u << 3)) << 20));
}

// f32 -> fp8, round to nearest even, saturating: NaN -> 0x7f (with the sign), |x| >= the largest
// finite value (infinities included) -> the largest finite value, subnormals by rounding
// |x| * 2^(bias - 1 + man) to an integer (exact scaling, ties to even), normals by dropping
// mantissa bits with ties to even. The same algorithm as the host (oxccl-kernels' fp8.rs).
template <u32 MAN, u32 BIAS, u32 MAXBITS>
__device__ __forceinline__ u32 f32_to_fp8_soft(float f, float maxv, float min_normal, float sub_scale) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 24) & 0x80u;
    u32 ax = x & 0x7fffffffu;
    float a = __uint_as_float(ax);
    if (ax > 0x7f800000u) return sign | 0x7fu;
    if (a >= maxv) return sign | MAXBITS;
    if (a < min_normal) return sign | (u32)__float2int_rn(a * sub_scale);
    const u32 drop = 23u - MAN;
    u32 res = ((((ax >> 23) - 127u + BIAS) << MAN) | ((ax >> drop) & ((1u << MAN) - 1u)));
    u32 rem = ax & ((1u << drop) - 1u);
    u32 half = 1u << (drop - 1u);
    if (rem > half || (rem == half && (res & 1u))) res += 1u;
    return sign | res;
}
__device__ __forceinline__ u32 f32_to_e4m3_soft(float f) {
    return f32_to_fp8_soft<3u, 7u, 0x7eu>(f, 448.0f, 0.015625f, 512.0f);
}
__device__ __forceinline__ u32 f32_to_e5m2_soft(float f) {
    return f32_to_fp8_soft<2u, 15u, 0x7bu>(f, 57344.0f, 6.103515625e-05f, 65536.0f);
}
// OXCCL_FP8_END

__device__ __forceinline__ float e5m2_to_f32(u32 b) { return f16_to_f32((unsigned short)(b << 8)); }
// E4M3 -> f32: sm_89 and later widen to f16 in hardware (`cvt.rn.f16x2.e4m3x2`, exact: every E4M3
// value is an f16), then to f32; earlier devices take the bit operations above, which cost
// several times more instructions (on an H200 they held reduce-8 to 29 % of a copy's bandwidth).
__device__ __forceinline__ float e4m3_to_f32(u32 b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u32 h2;
    asm("{ cvt.rn.f16x2.e4m3x2 %0, %1; }" : "=r"(h2) : "h"((unsigned short)(b & 0xffu)));
    return f16_to_f32((unsigned short)(h2 & 0xffffu));
#else
    return e4m3_to_f32_soft(b);
#endif
}

// sm_89 and later convert in hardware (`cvt.rn.satfinite`, the same rounding and saturation);
// earlier devices run the software conversion above.
__device__ __forceinline__ u8 f32_to_e4m3(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("{ cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2; }" : "=h"(r) : "f"(0.0f), "f"(f));
    return (u8)(r & 0xffu);
#else
    return (u8)f32_to_e4m3_soft(f);
#endif
}
__device__ __forceinline__ u8 f32_to_e5m2(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("{ cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2; }" : "=h"(r) : "f"(0.0f), "f"(f));
    return (u8)(r & 0xffu);
#else
    return (u8)f32_to_e5m2_soft(f);
#endif
}

// Traits: the compute type C of each storage type T, and the conversions.
template <typename T> struct Num {
    typedef T C;
    static __device__ __forceinline__ C load(T v) { return v; }
    static __device__ __forceinline__ T store(C v) { return v; }
};
template <> struct Num<f16> {
    typedef float C;
    static __device__ __forceinline__ float load(f16 v) { return f16_to_f32(v.bits); }
    static __device__ __forceinline__ f16 store(float v) { f16 r; r.bits = f32_to_f16(v); return r; }
};
template <> struct Num<bf16> {
    typedef float C;
    static __device__ __forceinline__ float load(bf16 v) { return bf16_to_f32(v.bits); }
    static __device__ __forceinline__ bf16 store(float v) { bf16 r; r.bits = f32_to_bf16(v); return r; }
};
template <> struct Num<f8e4m3> {
    typedef float C;
    static __device__ __forceinline__ float load(f8e4m3 v) { return e4m3_to_f32(v.bits); }
    static __device__ __forceinline__ f8e4m3 store(float v) { f8e4m3 r; r.bits = f32_to_e4m3(v); return r; }
};
template <> struct Num<f8e5m2> {
    typedef float C;
    static __device__ __forceinline__ float load(f8e5m2 v) { return e5m2_to_f32(v.bits); }
    static __device__ __forceinline__ f8e5m2 store(float v) { f8e5m2 r; r.bits = f32_to_e5m2(v); return r; }
};

// ---- operations ------------------------------------------------------------------------------

template <typename C> struct Unsigned { typedef C U; };
template <> struct Unsigned<i8> { typedef u8 U; };
template <> struct Unsigned<i32> { typedef u32 U; };
template <> struct Unsigned<i64> { typedef u64 U; };

template <typename C> __device__ __forceinline__ bool is_nan(C) { return false; }
template <> __device__ __forceinline__ bool is_nan<float>(float v) { return v != v; }
template <> __device__ __forceinline__ bool is_nan<double>(double v) { return v != v; }

template <typename C> __device__ __forceinline__ C wrap_add(C a, C b) {
    typedef typename Unsigned<C>::U U;
    return (C)(U)((U)a + (U)b);
}
template <> __device__ __forceinline__ float wrap_add<float>(float a, float b) { return a + b; }
template <> __device__ __forceinline__ double wrap_add<double>(double a, double b) { return a + b; }

template <typename C> __device__ __forceinline__ C wrap_mul(C a, C b) {
    typedef typename Unsigned<C>::U U;
    return (C)(U)((U)a * (U)b);
}
template <> __device__ __forceinline__ float wrap_mul<float>(float a, float b) { return a * b; }
template <> __device__ __forceinline__ double wrap_mul<double>(double a, double b) { return a * b; }

struct OpSum { template <typename C> static __device__ __forceinline__ C apply(C a, C b) { return wrap_add(a, b); } };
struct OpProd { template <typename C> static __device__ __forceinline__ C apply(C a, C b) { return wrap_mul(a, b); } };
struct OpMin {
    template <typename C> static __device__ __forceinline__ C apply(C a, C b) {
        C m = a < b ? a : b;
        return is_nan(a) ? a : m;
    }
};
struct OpMax {
    template <typename C> static __device__ __forceinline__ C apply(C a, C b) {
        C m = a > b ? a : b;
        return is_nan(a) ? a : m;
    }
};

template <typename T, typename Op> __device__ __forceinline__ T combine(T a, T b) {
    return Num<T>::store(Op::apply(Num<T>::load(a), Num<T>::load(b)));
}

// ---- vectorised element loops ----------------------------------------------------------------
//
// Every kernel is a grid-stride loop. When all its pointers sit at the same offset modulo 16
// bytes, the elements before the first 16-byte boundary (the head) and after the last one (the
// tail) go one by one and the body moves 16-byte vectors (uint4); otherwise every element goes
// one by one.

#define OXCCL_MAX_INPUTS 8

struct Inputs { const void* p[OXCCL_MAX_INPUTS]; };

template <typename T> union Vec16 {
    uint4 raw;
    T v[16 / sizeof(T)];
};

__device__ __forceinline__ usize grid_threads() { return (usize)blockDim.x * gridDim.x; }
__device__ __forceinline__ usize thread_index() { return (usize)blockIdx.x * blockDim.x + threadIdx.x; }

// Head length (elements) so that `p + head` is 16-byte aligned, or `n + 1` when the pointers do
// not share an offset modulo 16 (no vector body possible).
template <typename T> __device__ __forceinline__ usize vector_head(usize mis, usize first, usize n) {
    if (mis & 15) return n + 1;
    usize off = first & 15;
    usize head = off == 0 ? 0 : (16 - off) / sizeof(T);
    if ((16 - off) % sizeof(T) != 0 && off != 0) return n + 1;
    return head < n ? head : n;
}

// dst[i] = in0[i] op in1[i] op ... op in{K-1}[i], combined left to right. K is a template
// parameter so the input loop unrolls and the pointers stay in registers. `dst` may be one of the
// inputs (each element is read, then written, by one thread), so it is not `__restrict__`.
template <typename T, typename Op, int K>
__device__ void reduce_k(T* dst, const Inputs& in, usize n) {
    const T* src[K];
    usize mis = 0;
#pragma unroll
    for (int j = 0; j < K; j++) {
        src[j] = (const T*)in.p[j];
        mis |= ((usize)src[j] ^ (usize)dst);
    }
    usize head = vector_head<T>(mis, (usize)dst, n);
    usize tid = thread_index(), stride = grid_threads();
    usize nvec = 0, tail = 0;
    const usize V = 16 / sizeof(T);
    if (head > n) {
        head = n;  // no vector body: everything goes element by element below
        tail = n;
    } else {
        nvec = (n - head) / V;
        tail = head + nvec * V;
    }
    for (usize i = tid; i < head; i += stride) {
        T acc = src[0][i];
#pragma unroll
        for (int j = 1; j < K; j++) acc = combine<T, Op>(acc, src[j][i]);
        dst[i] = acc;
    }
    for (usize i = tail + tid; i < n; i += stride) {
        T acc = src[0][i];
#pragma unroll
        for (int j = 1; j < K; j++) acc = combine<T, Op>(acc, src[j][i]);
        dst[i] = acc;
    }
    uint4* d4 = (uint4*)(dst + head);
    for (usize i = tid; i < nvec; i += stride) {
        Vec16<T> acc;
        acc.raw = ((const uint4*)(src[0] + head))[i];
#pragma unroll
        for (int j = 1; j < K; j++) {
            Vec16<T> x;
            x.raw = ((const uint4*)(src[j] + head))[i];
#pragma unroll
            for (int e = 0; e < (int)V; e++) acc.v[e] = combine<T, Op>(acc.v[e], x.v[e]);
        }
        d4[i] = acc.raw;
    }
}

// Run-time input count -> compile-time K.
template <typename T, typename Op>
__device__ void reduce_any(T* dst, const Inputs& in, int k, usize n) {
    switch (k) {
        case 1: reduce_k<T, Op, 1>(dst, in, n); break;
        case 2: reduce_k<T, Op, 2>(dst, in, n); break;
        case 3: reduce_k<T, Op, 3>(dst, in, n); break;
        case 4: reduce_k<T, Op, 4>(dst, in, n); break;
        case 5: reduce_k<T, Op, 5>(dst, in, n); break;
        case 6: reduce_k<T, Op, 6>(dst, in, n); break;
        case 7: reduce_k<T, Op, 7>(dst, in, n); break;
        case 8: reduce_k<T, Op, 8>(dst, in, n); break;
        default: break;
    }
}

// Byte copy, 16-byte vectors where source and destination share an offset modulo 16.
__device__ void copy_bytes(u8* dst, const u8* src, usize n) {
    Inputs in;
    in.p[0] = src;
    reduce_k<u8, OpSum, 1>(dst, in, n);
}

// dst[i] = src[i] / d (Avg's last step; truncating for integers, in f32 for f16/bf16).
template <typename T> __device__ void div_elems(T* dst, const T* src, u64 d, usize n) {
    typedef typename Num<T>::C C;
    C dc = (C)d;
    for (usize i = thread_index(); i < n; i += grid_threads()) {
        dst[i] = Num<T>::store(Num<T>::load(src[i]) / dc);
    }
}

// dst[i] = src[i] * f (pre-multiplied sum of a float type, in f32 for f16/bf16/fp8, f64 for f64).
template <typename T> __device__ void scale_elems(T* dst, const T* src, double f, usize n) {
    typedef typename Num<T>::C C;
    C fc = (C)f;
    for (usize i = thread_index(); i < n; i += grid_threads()) {
        dst[i] = Num<T>::store(Num<T>::load(src[i]) * fc);
    }
}

// dst[i] = src[i] * k, wrapping (pre-multiplied sum of an integer type): k is the whole factor
// modulo 2^64, and the product modulo 2^64 cut to T's width is the product modulo 2^bits.
template <typename T> __device__ void scale_int_elems(T* dst, const T* src, u64 k, usize n) {
    for (usize i = thread_index(); i < n; i += grid_threads()) {
        dst[i] = (T)((u64)src[i] * k);
    }
}

// dst[i] = (D)(src[i] * f): a conversion between dtypes (the wire of compressed gradients),
// computed in the source's arithmetic type and rounded to nearest even into the destination's.
template <typename S, typename D> __device__ void cast_elems(D* dst, const S* src, double f, usize n) {
    typedef typename Num<S>::C CS;
    typedef typename Num<D>::C CD;
    CS fc = (CS)f;
    for (usize i = thread_index(); i < n; i += grid_threads()) {
        dst[i] = Num<D>::store((CD)(Num<S>::load(src[i]) * fc));
    }
}

// ---- Optimizers on f32 master weights (sharded optimizers: oxccl-zero) ----------------------
//
// OXCCL_OPTIM_BEGIN
// One element of AdamW and of SGD, in the order and rounding of the host's (oxccl-zero's
// optim.rs): every operation an explicit round-to-nearest intrinsic, so that no multiply-add is
// contracted into an FMA and a device step equals the host's bit for bit. The scalars the
// host computes once per step (1 - lr * wd, the bias corrections, 1 - beta) are arguments.
__device__ __forceinline__ void adamw_elem(float* p, float g, float* m, float* v, float lr,
                                           float decay, float b1, float omb1, float b2,
                                           float omb2, float eps, float c1, float c2) {
    float w = __fmul_rn(*p, decay);
    float mm = __fadd_rn(__fmul_rn(b1, *m), __fmul_rn(omb1, g));
    float vv = __fadd_rn(__fmul_rn(b2, *v), __fmul_rn(__fmul_rn(omb2, g), g));
    float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(vv, c2)), eps);
    *m = mm;
    *v = vv;
    *p = __fsub_rn(w, __fdiv_rn(__fmul_rn(lr, __fdiv_rn(mm, c1)), denom));
}

__device__ __forceinline__ void sgd_elem(float* p, float g0, float* buf, float lr, float wd,
                                         float momentum, float omd, int nesterov, int first) {
    float g = __fadd_rn(g0, __fmul_rn(wd, *p));
    if (momentum != 0.0f) {
        float b = first ? g : __fadd_rn(__fmul_rn(momentum, *buf), __fmul_rn(omd, g));
        *buf = b;
        g = nesterov ? __fadd_rn(g, __fmul_rn(momentum, b)) : b;
    }
    *p = __fsub_rn(*p, __fmul_rn(lr, g));
}
// OXCCL_OPTIM_END

__device__ void adamw_elems(float* p, const float* g, float* m, float* v, usize n, float lr,
                            float decay, float b1, float omb1, float b2, float omb2, float eps,
                            float c1, float c2) {
    for (usize i = thread_index(); i < n; i += grid_threads()) {
        adamw_elem(&p[i], g[i], &m[i], &v[i], lr, decay, b1, omb1, b2, omb2, eps, c1, c2);
    }
}

__device__ void sgd_elems(float* p, const float* g, float* buf, usize n, float lr, float wd,
                          float momentum, float omd, int nesterov, int first) {
    for (usize i = thread_index(); i < n; i += grid_threads()) {
        sgd_elem(&p[i], g[i], momentum != 0.0f ? &buf[i] : 0, lr, wd, momentum, omd, nesterov,
                 first);
    }
}

// ---- CUDA IPC: the barrier of device collectives --------------------------------------------
//
// Every rank of a node-local communicator owns flags in device memory that all ranks map: 2 x 8
// 64-bit words, word (epoch % 2) * 8 + r written by rank r only (see oxccl-comm's
// cuda/ipc_plan.rs for the protocol, and its host model that the tests run). At barrier `epoch`
// rank r stores (sig << 32) | epoch into its word of every rank's flags (system-scope release,
// after a system fence so the slot it filled is visible first), then waits with acquire loads
// until its own flags hold `epoch` from every rank, and checks their `sig` against its own.
// A wait longer than `timeout_ns` (by %globaltimer), a different `sig`, or the poison signature
// of a rank that gave up fails the barrier: code | (peer << 8) goes to the error words (1 =
// time-out, 2 = mismatch, 3 = the peer gave up, 4 = bad arguments; the host word's successor
// gets the epoch), and this rank poisons its own words for `epoch` and `epoch + 1` in every
// rank's flags, so peers that have not passed them fail too instead of reading a slot this rank
// goes on to overwrite. A barrier that finds its rank's device error word set returns at once, so
// a failed communicator never hangs a stream. Launch: one block of 32 threads. Needs sm_70 or
// later (release/acquire); older devices get error 4 at the first barrier.

#define OXCCL_MAX_RANKS 8
#define OXCCL_POISON_SIG 0xFFFFFFFFull

struct Flags { u64* p[OXCCL_MAX_RANKS]; };

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
__device__ __forceinline__ void store_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 load_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
#define OXCCL_HAVE_ACQUIRE 1
#else
#define OXCCL_HAVE_ACQUIRE 0
#endif
__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void oxccl_ipc_barrier(Flags f, u32 rank, u32 n, u32 epoch, u32 sig,
                                             u64 timeout_ns, volatile u32* dev_error,
                                             volatile u32* host_error) {
    __shared__ u32 failed;
    __shared__ u32 code;
    u32 t = threadIdx.x;
    if (t == 0) {
        failed = dev_error[0];
        code = (n == 0 || n > OXCCL_MAX_RANKS || rank >= n || !OXCCL_HAVE_ACQUIRE) ? 4u : 0u;
    }
    __syncthreads();
    if (failed != 0) return;
#if OXCCL_HAVE_ACQUIRE
    u32 word = (epoch & 1u) * OXCCL_MAX_RANKS;
    if (code == 0 && t < n) {
        __threadfence_system();
        store_release_sys(f.p[t] + word + rank, ((u64)sig << 32) | (u64)epoch);
        const u64* mine = f.p[rank] + word + t;
        u64 start = global_timer_ns();
        u32 mine_code = 0;
        for (;;) {
            u64 v = load_acquire_sys(mine);
            if ((u32)v == epoch) {
                u32 s = (u32)(v >> 32);
                if (s == (u32)OXCCL_POISON_SIG) mine_code = 3u | (t << 8);
                else if (s != sig) mine_code = 2u | (t << 8);
                break;
            }
            if (global_timer_ns() - start > timeout_ns) {
                mine_code = 1u | (t << 8);
                break;
            }
        }
        if (mine_code != 0) atomicCAS(&code, 0u, mine_code);
    }
    __syncthreads();
    if (code != 0 && code != 4u && t < n) {
        u32 next = ((epoch + 1u) & 1u) * OXCCL_MAX_RANKS;
        store_release_sys(f.p[t] + word + rank, (OXCCL_POISON_SIG << 32) | (u64)epoch);
        store_release_sys(f.p[t] + next + rank, (OXCCL_POISON_SIG << 32) | (u64)(epoch + 1u));
    }
#endif
    if (code != 0 && t == 0) {
        host_error[1] = epoch;
        __threadfence_system();
        dev_error[0] = code;
        host_error[0] = code;
    }
    __syncthreads();
    __threadfence_system();
}

// ---- CUDA IPC: point-to-point between ranks that map each other's scratch -------------------
//
// oxccl-comm's cuda_ipc/p2p.rs gives the protocol (inboxes of two halves per sender, `ready` and
// `ack` words, chunks numbered per ordered pair). A stream runs, per chunk, copies and these two
// one-thread kernels:
//
// oxccl_ipc_p2p_wait: waits with system-scope acquire loads until `word` says chunk `k` is there.
// A `ready` wait (`ack` 0) waits until the word's low half is `k`, then checks its high half (the
// chunk's tag: its length, bit 31 on a message's last chunk) against `tag`: another tag fails
// with 6, the poison tag of a sender that gave up with 7, and no chunk within `timeout_ns` with 5.
// An `ack` wait waits until the low half has reached `k` (wrapping compare), else fails with 8.
// The first failure's `code | peer << 8` goes to both error words, and `k` to the host word's
// successor; later failures keep it. Once the device error word is set, `ready` waits return at
// once (what they guard is this rank's own data, undefined now); `ack` waits still wait, since
// the copy after them overwrites a half of the peer's inbox that the peer may still be copying
// out, except for a peer whose acknowledgement already timed out (bit `peer` of
// `dev_error[1]`): it takes nothing any more.
//
// oxccl_ipc_p2p_post: a system fence (the copy before it is visible first), then a system-scope
// release store of `value` into `word`; with the device error word set and `poison` given (a
// `ready` word), the value's high half becomes the poison tag, so the peer fails instead of
// taking what follows.

#define OXCCL_P2P_POISON_TAG 0xFFFFFFFFu

extern "C" __global__ void oxccl_ipc_p2p_wait(const u64* word, u32 k, u32 tag, u32 ack, u32 peer,
                                              u64 timeout_ns, volatile u32* dev_error,
                                              volatile u32* host_error) {
    if (threadIdx.x != 0) return;
    if (ack == 0 && dev_error[0] != 0) return;
    if (ack != 0 && (dev_error[1] >> (peer & 31u) & 1u) != 0) return;
    u32 code = 0;
#if OXCCL_HAVE_ACQUIRE
    u64 start = global_timer_ns();
    for (;;) {
        u64 v = load_acquire_sys(word);
        if (ack != 0) {
            if ((int)((u32)v - k) >= 0) break;
        } else if ((u32)v == k) {
            u32 got = (u32)(v >> 32);
            if (got == OXCCL_P2P_POISON_TAG) code = 7u | (peer << 8);
            else if (got != tag) code = 6u | (peer << 8);
            break;
        }
        if (global_timer_ns() - start > timeout_ns) {
            code = (ack != 0 ? 8u : 5u) | (peer << 8);
            break;
        }
    }
#else
    code = 4u;
#endif
    if (code != 0) {
        if ((code & 0xffu) == 8u) dev_error[1] = dev_error[1] | (1u << (peer & 31u));
        if (dev_error[0] == 0) {
            host_error[1] = k;
            __threadfence_system();
            dev_error[0] = code;
            host_error[0] = code;
        }
    }
    __threadfence_system();
}

extern "C" __global__ void oxccl_ipc_p2p_post(u64* word, u64 value, u32 poison,
                                              volatile u32* dev_error) {
    if (threadIdx.x != 0) return;
    if (poison != 0 && dev_error[0] != 0) {
        value = ((u64)OXCCL_P2P_POISON_TAG << 32) | (value & 0xFFFFFFFFull);
    }
    __threadfence_system();
#if OXCCL_HAVE_ACQUIRE
    store_release_sys(word, value);
#else
    *(volatile u64*)word = value;
#endif
}

// ---- generated entry points follow -----------------------------------------------------------
