"""cuLaunchKernel's host cost on this host, through ctypes: an empty kernel with 8 bytes and with 672 bytes of
parameters (pyep's queued dispatch passes one 672-byte struct), grid 1 and 49 blocks; beside a ctypes call of
cuCtxGetCurrent (ctypes' own cost) and torch's empty kernel launch (x.zero_() of 1 element). Then the 672-byte launch
on each kind of stream: the legacy default stream (torch's default, 0), the per-thread default stream, a
torch.cuda.Stream (blocking: ordered after the legacy stream's work) and a non-blocking stream."""
import ctypes, time, statistics, torch
torch.cuda.set_device(0); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
cu = ctypes.CDLL("libcuda.so.1")
ptx = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry small(.param .u64 a) { ret; }
.visible .entry big(.param .align 8 .b8 p[672]) { ret; }
"""
mod = ctypes.c_void_p(); assert cu.cuModuleLoadData(ctypes.byref(mod), ptx) == 0
funcs = {}
for n in (b"small", b"big"):
    f = ctypes.c_void_p(); assert cu.cuModuleGetFunction(ctypes.byref(f), mod, n) == 0; funcs[n] = f
stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
small_arg = ctypes.c_uint64(0); big_arg = (ctypes.c_uint8 * 672)()
args_small = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(small_arg), ctypes.c_void_p))
args_big = (ctypes.c_void_p * 1)(ctypes.cast(big_arg, ctypes.c_void_p))
launch = cu.cuLaunchKernel
launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
ctx = ctypes.c_void_p()
def t(name, fn, n=3000, sync_each=True):
    xs = []
    for i in range(n):
        if sync_each or i % 100 == 0: torch.cuda.synchronize()
        t0 = time.perf_counter_ns(); fn(); xs.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    print(f"{name:46s} median {statistics.median(xs)/1e3:6.2f} us ({'synced before each' if sync_each else 'back to back'})")
for sync in (True, False):
    t("ctypes cuCtxGetCurrent", lambda: cu.cuCtxGetCurrent(ctypes.byref(ctx)), sync_each=sync)
    t("cuLaunchKernel 8 B params, 1 block", lambda: launch(funcs[b"small"], 1, 1, 1, 32, 1, 1, 0, stream, args_small, None), sync_each=sync)
    t("cuLaunchKernel 672 B params, 1 block", lambda: launch(funcs[b"big"], 1, 1, 1, 32, 1, 1, 0, stream, args_big, None), sync_each=sync)
    t("cuLaunchKernel 672 B params, 49x768", lambda: launch(funcs[b"big"], 49, 1, 1, 768, 1, 1, 0, stream, args_big, None), sync_each=sync)
    z = torch.zeros(1, device="cuda")
    t("torch x.zero_() (dispatcher + launch)", lambda: z.zero_(), sync_each=sync)

streams = {"legacy default (0)": ctypes.c_void_p(0), "per-thread default": ctypes.c_void_p(2),
           "torch.cuda.Stream()": ctypes.c_void_p(torch.cuda.Stream().cuda_stream)}
nb = ctypes.c_void_p()
assert cu.cuStreamCreate(ctypes.byref(nb), 1) == 0
streams["non-blocking (cuStreamCreate 1)"] = nb
for sync in (True, False):
    for name, s in streams.items():
        t(f"672 B, 49x768 on {name}", lambda: launch(funcs[b"big"], 49, 1, 1, 768, 1, 1, 0, s, args_big, None),
          sync_each=sync)
