"""Layout kernel variants (cubin/*.cubin, built by nvrtc_build.py) on one GPU, through the driver with ctypes: results
checked against torch's; timed with events around each launch, the device busy before it (warm: L2 holds topk) and
after a 256 MB memset (flushed); HOWS picks the modes, default "warm flushed". The block size is the number that ends a
variant's name (512 where none). Usage: layout_bench.py [bench|ncu] [R] [variants...] (ncu: five launches of each)"""
import ctypes, os, statistics, sys
import torch
mode = sys.argv[1] if len(sys.argv) > 1 else "bench"
R = int(sys.argv[2]) if len(sys.argv) > 2 else 2
here = os.path.dirname(os.path.abspath(__file__))
names = sys.argv[3:] or sorted(f[:-6] for f in os.listdir(os.path.join(here, "cubin")))
torch.cuda.set_device(0); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
cu = ctypes.CDLL("libcuda.so.1")
T, K, E = 4096, 8, 256
g = torch.Generator().manual_seed(1)
topk = torch.rand(T, E, generator=g).topk(K, dim=1).indices.cuda()
topk[::7, 3] = -1  # some dropped choices
valid = topk >= 0
rank_of = torch.where(valid, topk // (E // R), 0)
ref_in = torch.zeros(T, R, dtype=torch.int32, device="cuda").scatter_add_(1, rank_of, valid.int()) > 0
ref_per_rank = ref_in.int().sum(0)
ref_per_expert = torch.bincount(topk[valid], minlength=E).int()

class P(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("topk", "per_rank", "per_expert", "in_rank", "result", "tag", "work", "timeout_ns")] + \
               [(n, ctypes.c_int32) for n in ("T", "K", "E", "R")]
assert ctypes.sizeof(P) == 80
funcs = {}
for n in names:
    mod = ctypes.c_void_p(); data = open(os.path.join(here, "cubin", n + ".cubin"), "rb").read()
    assert cu.cuModuleLoadData(ctypes.byref(mod), data) == 0, n
    f = ctypes.c_void_p(); assert cu.cuModuleGetFunction(ctypes.byref(f), mod, b"pyep_layout") == 0, n
    funcs[n] = f
launch = cu.cuLaunchKernel
launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
blocks = {n: int(n.rsplit("_", 1)[1]) if n.rsplit("_", 1)[-1].isdigit() else 512 for n in names}
blocks.update({n: int(n[4:]) for n in names if n.startswith("head")})
assert ctypes.sizeof(P) == 80
per_rank = torch.zeros(R, dtype=torch.int32, device="cuda"); per_expert = torch.zeros(E, dtype=torch.int32, device="cuda")
in_rank = torch.zeros(T, R, dtype=torch.bool, device="cuda"); work = torch.zeros(2, dtype=torch.int64, device="cuda")
result = torch.zeros(4, dtype=torch.int64, device="cuda")
p = P(topk.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr(), result.data_ptr(), 1, work.data_ptr(),
      int(5e9), T, K, E, R)
args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(p), ctypes.c_void_p))
stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
def run(n):
    p.tag += 1
    th = blocks[n]
    assert launch(funcs[n], (T + th - 1) // th, 1, 1, th, 1, 1, 0, stream, args, None) == 0
cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
if mode == "ncu":
    for n in names:
        for _ in range(5): run(n)
        torch.cuda.synchronize(); print("ncu variant", n, flush=True)
    sys.exit(0)
for n in names:
    per_rank.fill_(-5); per_expert.fill_(-5); in_rank.fill_(True); run(n); torch.cuda.synchronize()
    ok = torch.equal(per_rank, ref_per_rank) and torch.equal(per_expert, ref_per_expert) and torch.equal(in_rank, ref_in)
    print(f"check {n}: {'ok' if ok else 'WRONG (expected for empty/loadrow)'}")
def timed(n, how, iters=100):
    torch.cuda.synchronize()
    for _ in range(20): run(n)
    if how == "b2b":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters): run(n)
        e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) * 1e3 / iters
    ss = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]; es = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if how == "flushed": cache.zero_()
        elif how == "warm": torch.cuda._sleep(200000)
        elif how == "idle": torch.cuda.synchronize()
        ss[i].record(); run(n); es[i].record()
    torch.cuda.synchronize()
    xs = [a.elapsed_time(b) * 1e3 for a, b in zip(ss, es)][1:]
    return statistics.median(xs)
HOWS = os.environ.get("HOWS", "warm flushed").split()
res = {n: {h: [] for h in HOWS} for n in names}
for rnd in range(3):
    for n in names:
        for h in res[n]:
            res[n][h].append(timed(n, h))
print(f"R={R}: µs, three rounds each (b2b: mean of 100 back to back; harness/idle/flushed: median of events around each launch)")
print(f"{'variant':22s} " + " ".join(f"{h:>18s}" for h in HOWS))
for n in names:
    print(f"{n:22s} " + " ".join(f"{' '.join(f'{x:5.2f}' for x in res[n][h]):>18s}" for h in res[n]))
