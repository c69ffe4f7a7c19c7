// oxccl: the stream's wait for a host collective of a staged device operation.
//
// A program of its own (no other kernel, no CUDA headers), so that staged operations, which need
// no other kernel, compile and load only this.
//
// The progress thread stores the number of each finished part into a word of device-mapped,
// page-locked host memory (a release store). `oxccl_wait_flag` (one thread) loads that word at
// system scope until it is at least `value` (compared cyclically, so the numbers may wrap),
// sleeping about a microsecond between loads; the work enqueued behind it (the copy of the
// part's result back to the device) then runs. cuStreamWaitValue32 on the same word waits as
// well, but for ever: this wait has a deadline.
//
// A wait longer than `timeout_ns` (by %globaltimer) gives up: it stores 1 into status[0] and the
// value it waited for into status[1] (host memory the communicator reads at its next call), so a
// stuck progress thread ends in an error, not a stream blocked for ever.

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 wait_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// System-scope acquire (sm_70 and later; CUDA 13's NVRTC targets sm_75 and later only).
__device__ __forceinline__ u32 wait_load(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

extern "C" __global__ void oxccl_wait_flag(const u32* flag, u32 value, u64 timeout_ns,
                                           volatile u32* status) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    u64 start = wait_timer_ns();
    while ((int)(wait_load(flag) - value) < 0) {
        if (wait_timer_ns() - start > timeout_ns) {
            status[1] = value;
            __threadfence_system();
            status[0] = 1u;
            __threadfence_system();
            return;
        }
        __nanosleep(1000);
    }
}
