"""Compiles layout kernel variants to sm_90 cubins with NVRTC (as pyep's jit does: -std=c++17, defines)."""
import ctypes, glob, os, sys
lib = ctypes.CDLL(glob.glob("/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so.13")[0])
here = os.path.dirname(os.path.abspath(__file__)); kern = os.path.join(here, "..", "kernels")
VARIANTS = {
    "head512": ("../kernels/layout.cu", {"PYEP_LAYOUT_THREADS": 512}),
    "head256": ("../kernels/layout.cu", {"PYEP_LAYOUT_THREADS": 256}),
    "head128": ("../kernels/layout.cu", {"PYEP_LAYOUT_THREADS": 128}),
    "empty": ("layout_x.cu", {"X_MODE": 1}),
}
for th in (512, 256, 128):
    for name, d in (("vec", {"Y_LOAD": 1}), ("vecl1", {"Y_LOAD": 2}), ("l1", {"Y_LOAD": 3}), ("stage", {"Y_LOAD": 4}),
                    ("spec", {"Y_SPEC": 1}), ("vecl1_spec", {"Y_LOAD": 2, "Y_SPEC": 1}), ("stage_spec", {"Y_LOAD": 4, "Y_SPEC": 1})):
        VARIANTS[f"y_{name}_{th}"] = ("layout_y.cu", dict(d, PYEP_LAYOUT_THREADS=th))
os.makedirs(os.path.join(here, "cubin"), exist_ok=True)
for name, (path, defs) in VARIANTS.items():
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
        continue
    src = open(os.path.join(here, path), "rb").read()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, path.encode(), 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"-std=c++17", b"-I" + kern.encode()] + [f"-D{k}={v}".encode() for k, v in defs.items()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n)); log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        print(name, "FAILED", log.value.decode()); sys.exit(1)
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)); buf = ctypes.create_string_buffer(n.value); lib.nvrtcGetCUBIN(prog, buf)
    open(os.path.join(here, "cubin", name + ".cubin"), "wb").write(buf.raw)
    print(name, n.value, "bytes", log.value.decode().strip()[:200])
