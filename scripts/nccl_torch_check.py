"""PyTorch on oxccl's libnccl.so.2 (docs/NCCL.md): run under torchrun, every rank on GPU 0.

    torchrun --nproc_per_node 2 scripts/nccl_torch_check.py collectives
    torchrun --nproc_per_node 2 scripts/nccl_torch_check.py ddp [--backend gloo]
    torchrun --nproc_per_node 2 scripts/nccl_torch_check.py timeout

`collectives`: all_reduce (sum, avg, max, premul-sum through ReduceOp.PREMUL_SUM where torch
has it), all_gather_into_tensor, reduce_scatter_tensor, broadcast and reduce from every root,
all_to_all_single, batch_isend_irecv in a ring both ways (4 MiB), a new_group of ranks 0 and 1,
in float32, bfloat16, float16 and int32, each result checked exactly (inputs are small integers).
`ddp`: 10 steps of DDP on a small MLP (fixed seed, each rank its own batch); rank 0 prints
`PARAMS <sum> <sum of squares>` for comparison with the same run on gloo (CPU).
`timeout`: rank 1 skips an all_reduce; rank 0 must fail within the 10 s process-group time-out
(torch's watchdog aborts the communicator), not hang.
Prints `OK <mode>` on every rank that passed.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def collectives(dev):
    r, n = dist.get_rank(), dist.get_world_size()
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
        x = torch.arange(64, device=dev).to(dt) + r
        dist.all_reduce(x)
        want = (torch.arange(64, device=dev) * n + n * (n - 1) // 2).to(dt)
        check(torch.equal(x, want), f"all_reduce sum {dt}")
        x = torch.full((8,), r, device=dev).to(dt)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        check(torch.equal(x, torch.full((8,), n - 1, device=dev).to(dt)), f"max {dt}")
        if dt != torch.int32:
            x = torch.full((8,), 2 * r, device=dev).to(dt)
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
            check(torch.equal(x, torch.full((8,), n - 1, device=dev).to(dt)), f"avg {dt}")
        out = torch.empty(n * 16, device=dev).to(dt)
        dist.all_gather_into_tensor(out, torch.full((16,), r, device=dev).to(dt))
        want = torch.arange(n, device=dev).repeat_interleave(16).to(dt)
        check(torch.equal(out, want), f"all_gather {dt}")
        inp = torch.arange(n * 4, device=dev).to(dt)
        out = torch.empty(4, device=dev).to(dt)
        dist.reduce_scatter_tensor(out, inp)
        check(torch.equal(out, (torch.arange(4, device=dev) + 4 * r).to(dt) * n), f"rs {dt}")
        for root in range(n):
            x = torch.full((1000,), r, device=dev).to(dt)
            dist.broadcast(x, src=root)
            check(torch.equal(x, torch.full((1000,), root, device=dev).to(dt)), f"bcast {dt}")
            x = torch.ones(10, device=dev).to(dt)
            dist.reduce(x, dst=root)
            if r == root:
                check(torch.equal(x, torch.full((10,), n, device=dev).to(dt)), f"reduce {dt}")
        inp = (torch.arange(n, device=dev) + 10 * r).to(dt)
        out = torch.empty(n, device=dev).to(dt)
        dist.all_to_all_single(out, inp)
        check(torch.equal(out, (torch.arange(n, device=dev) * 10 + r).to(dt)), f"a2a {dt}")
    nxt, prv = (r + 1) % n, (r - 1) % n
    big = 1 << 20
    a, b = torch.full((big,), float(r), device=dev), torch.full((big,), float(r + 100), device=dev)
    ra, rb = torch.empty(big, device=dev), torch.empty(big, device=dev)
    ops = [dist.P2POp(dist.isend, a, nxt), dist.P2POp(dist.isend, b, prv),
           dist.P2POp(dist.irecv, ra, prv), dist.P2POp(dist.irecv, rb, nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check(ra[0].item() == prv and rb[-1].item() == nxt + 100, "batch_isend_irecv ring")
    g = dist.new_group([0, 1])
    if r < 2:
        x = torch.ones(4, device=dev)
        dist.all_reduce(x, group=g)
        check(torch.equal(x, torch.full((4,), 2.0, device=dev)), "new_group")
    torch.cuda.synchronize()


def ddp(dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model = model.to(dev)
    ids = [0] if dev.type == "cuda" else None
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    for _ in range(10):
        x = torch.randn(16, 32, generator=gen).to(dev)
        y = torch.randn(16, 4, generator=gen).to(dev)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().double().flatten().cpu() for p in net.parameters()])
    if dist.get_rank() == 0:
        print(f"PARAMS {flat.sum().item():.9f} {(flat * flat).sum().item():.9f}", flush=True)


def timeout(dev):
    x = torch.ones(4, device=dev)
    if dist.get_rank() == 1:
        return "skipped"
    dist.all_reduce(x)
    torch.cuda.synchronize()
    raise AssertionError("the all_reduce without rank 1 finished")


def main():
    mode = sys.argv[1]
    backend = "gloo" if "--backend" in sys.argv and sys.argv[-1] == "gloo" else "nccl"
    dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(0)
    secs = 10 if mode == "timeout" else 120
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=secs))
    {"collectives": collectives, "ddp": ddp, "timeout": timeout}[mode](dev)
    if mode != "timeout":
        dist.barrier()
    print(f"OK {mode} rank {dist.get_rank()}", flush=True)
    if mode == "timeout":
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
