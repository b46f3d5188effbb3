# Layout in DeepEP V1's harness loop, one rank, one GPU: events back to back, idle before each, L2 flushed before each.
import os, statistics, sys, time, tempfile
import torch, torch.distributed as dist
torch.cuda.set_device(0)
d = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{d}/s", rank=0, world_size=1)
os.environ["PYEP_BACKEND"] = "cuda"
import pyep
T, K, E = 4096, 8, 256
buf = pyep.Buffer(dist.group.WORLD, int(1e9), 0)
g = torch.Generator().manual_seed(0)
topk = torch.rand(T, E, generator=g).topk(K, dim=1).indices.cuda()
call = lambda: buf.get_dispatch_layout(topk, E)
cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
res = []
for mode in ("back_to_back", "idle", "flushed"):
    best = []
    for rep in range(3):
        torch.cuda.synchronize()
        for _ in range(50): call()
        cache.zero_()
        s = [torch.cuda.Event(enable_timing=True) for _ in range(50)]
        e = [torch.cuda.Event(enable_timing=True) for _ in range(50)]
        for i in range(50):
            if mode == "idle": torch.cuda.synchronize()
            elif mode == "flushed": cache.zero_()
            s[i].record(); call(); e[i].record()
        torch.cuda.synchronize()
        best.append(statistics.mean([a.elapsed_time(b) * 1e3 for a, b in zip(s, e)][1:]))
    res.append(min(best))
print(f"layout threads={os.environ.get('PYEP_DEV_LAYOUT_THREADS','512')}: events {res[0]:.1f} idle {res[1]:.1f} flushed {res[2]:.1f} µs")
dist.destroy_process_group()
