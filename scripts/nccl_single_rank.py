"""NCCL's single-rank all-reduce time on this GPU, for scale next to `oxccl perf --device cuda`
(issue 6). Uses PyTorch's NCCL backend with world size 1; prints size, time per call and the
algorithm bandwidth, nccl-tests style. Run by scripts/gpu_run.sh."""
import os
import time

import torch
import torch.distributed as dist

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
dist.init_process_group("nccl", rank=0, world_size=1)
dev = torch.device("cuda", 0)
print(f"# torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {torch.cuda.get_device_name(0)}")
print(f"# {'size(B)':>12} {'time(us)':>10} {'algbw(GB/s)':>12}")
size = 8
while size <= 1 << 30:
    x = torch.ones(size // 4, dtype=torch.float32, device=dev)
    for _ in range(5):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    iters = 20
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    us = (time.perf_counter() - t0) / iters * 1e6
    print(f"  {size:>12} {us:>10.2f} {size / us / 1e3:>12.2f}")
    size *= 4
dist.destroy_process_group()
