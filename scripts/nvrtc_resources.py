"""Compile kernel sources with NVRTC for sm_90 and print ptxas's resource report (registers,
shared memory, spills) per kernel, without a GPU. Usage:
  python3 scripts/nvrtc_resources.py crates/qem-cuda/src/kernels/rans.cu [more.cu ...]
(the files are concatenated, as products.rs does; NVRTC_DEFINES="A=1 B=2" adds defines;
CUBIN_OUT=k.cubin also writes the CUBIN, for nvdisasm). Needs libnvrtc (pip nvidia-cuda-nvrtc)."""
import ctypes, glob, os, sys

def find_nvrtc():
    import nvidia
    for p in nvidia.__path__:
        for f in glob.glob(os.path.join(p, "cu*", "lib", "libnvrtc.so*")):
            if "builtins" not in f:
                return f
    return "libnvrtc.so"

lib = ctypes.CDLL(find_nvrtc())
src = "\n".join(open(f).read() for f in sys.argv[1:]).encode()
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"k.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=sm_90", b"-std=c++17", b"--ptxas-options=-v"]
# Extra defines, e.g. NVRTC_DEFINES="PROD_NBIN=2 PROD_MOM=1 PROD_SUM=1 PROD_WARPS=32".
opts += [("-D" + d).encode() for d in os.environ.get("NVRTC_DEFINES", "").split()]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
print("rc", rc)
print(log.value.decode())
# CUBIN_OUT=path writes the CUBIN too (for nvdisasm / cuobjdump -sass: static instruction counts).
if rc == 0 and os.environ.get("CUBIN_OUT"):
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    open(os.environ["CUBIN_OUT"], "wb").write(cubin.raw)
