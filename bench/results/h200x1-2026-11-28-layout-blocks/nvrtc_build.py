"""Compiles one round's layout kernel variants to sm_90 cubins (cubin/NAME.cubin) with NVRTC, as pyep's jit does
(-std=c++17, the defines named). Usage: nvrtc_build.py ROUND [NAME...]. Run from a folder beside the checkout's
kernels/ (the rounds ran it from exp/) holding layout_head.cu (`git show c768048:kernels/layout.cu`) and layout_x.cu,
layout_y.cu (layout_head.cu with layout_x.patch, layout_y.patch applied), and layout_bench.py takes them from cubin/. "../kernels/layout.cu" in round 1 and 2 was
c768048's, in round 4 the commit after it (this folder's)."""
import ctypes, os, sys

KERNEL = "../kernels/layout.cu"


def threads(n):
    return {"PYEP_LAYOUT_THREADS": n}


def round2():
    v = {"head512": (KERNEL, threads(512)), "head256": (KERNEL, threads(256)), "head128": (KERNEL, threads(128)),
         "empty": ("layout_x.cu", {"X_MODE": 1})}
    for th in (512, 256, 128):
        for name, d in (("vec", {"Y_LOAD": 1}), ("vecl1", {"Y_LOAD": 2}), ("l1", {"Y_LOAD": 3}), ("stage", {"Y_LOAD": 4}),
                        ("spec", {"Y_SPEC": 1}), ("vecl1_spec", {"Y_LOAD": 2, "Y_SPEC": 1}),
                        ("stage_spec", {"Y_LOAD": 4, "Y_SPEC": 1})):
            v[f"y_{name}_{th}"] = ("layout_y.cu", dict(d, **threads(th)))
    return v


def round3():
    best = {"Y_LOAD": 2, "Y_SPEC": 1}
    v = {"head512": (KERNEL, threads(512)), "head256": (KERNEL, threads(256)), "head128": (KERNEL, threads(128)),
         "empty": ("layout_x.cu", {"X_MODE": 1})}
    for th in (128, 256, 64):
        v[f"y_vecl1_spec_{th}"] = ("layout_y.cu", dict(best, **threads(th)))
    v["y_skipx_128"] = ("layout_y.cu", dict(best, Y_SKIPX=1, **threads(128)))
    v["y_nocount_128"] = ("layout_y.cu", dict(best, Y_NOCOUNT=1, **threads(128)))
    v["y_skipx_nocount_128"] = ("layout_y.cu", dict(best, Y_SKIPX=1, Y_NOCOUNT=1, **threads(128)))
    return v


ROUNDS = {
    1: lambda: {
        "head512": (KERNEL, threads(512)), "head256": (KERNEL, threads(256)),
        "empty": ("layout_x.cu", {"X_MODE": 1}), "loadrow": ("layout_x.cu", {"X_MODE": 2}),
        "loadrow_vec_early": ("layout_x.cu", {"X_MODE": 2, "X_VEC": 1, "X_EARLY": 1}),
        "u32": ("layout_x.cu", {"X_U32": 1}), "vec_u32": ("layout_x.cu", {"X_U32": 1, "X_VEC": 1}),
        "early": ("layout_x.cu", {"X_EARLY": 1}), "early_vec_u32": ("layout_x.cu", {"X_U32": 1, "X_VEC": 1, "X_EARLY": 1}),
        "early_vec_u32_256": ("layout_x.cu", {"X_U32": 1, "X_VEC": 1, "X_EARLY": 1, **threads(256)}),
        "early_vec_u32_128": ("layout_x.cu", {"X_U32": 1, "X_VEC": 1, "X_EARLY": 1, **threads(128)}),
    },
    2: round2,
    3: round3,
    4: lambda: {"empty": ("layout_x.cu", {"X_MODE": 1}), "old_512": ("layout_head.cu", threads(512)),
                "old_128": ("layout_head.cu", threads(128)),
                **{f"new_{th}": (KERNEL, threads(th)) for th in (512, 256, 128, 64)}},
}


def main():
    lib = ctypes.CDLL(os.environ.get("NVRTC", "libnvrtc.so.13"))  # NVRTC: its path where the loader does not find it
    here = os.path.dirname(os.path.abspath(__file__))
    kern = os.path.join(here, "..", "kernels")
    os.makedirs(os.path.join(here, "cubin"), exist_ok=True)
    for name, (path, defs) in ROUNDS[int(sys.argv[1])]().items():
        if len(sys.argv) > 2 and name not in sys.argv[2:]:
            continue
        src = open(os.path.join(here, path), "rb").read()
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, path.encode(), 0, None, None) == 0
        opts = [b"--gpu-architecture=sm_90", b"-std=c++17", b"-I" + kern.encode()] + \
               [f"-D{k}={v}".encode() for k, v in defs.items()]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            sys.exit(f"{name}: {log.value.decode()}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, buf)
        open(os.path.join(here, "cubin", name + ".cubin"), "wb").write(buf.raw)
        print(name, n.value, "bytes")


if __name__ == "__main__":
    main()
