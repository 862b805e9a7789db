"""Builds fp8a2a._C: CPU kernels always, CUDA kernels too when torch has CUDA (sm_90 by default).
The package's metadata is in pyproject.toml."""
import glob
import os
import sys
import tempfile

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit("fp8a2a: install torch first (CPU machines: `pip install torch==2.13.0`), then "
             "`pip install --no-build-isolation -e .` so the build sees that torch.")

HERE = os.path.dirname(os.path.abspath(__file__))


def cuda_toolkit():
    """The CUDA toolkit to build with: torch's CUDA_HOME, or /usr/local/cuda when CUDA_HOME has no
    runtime library (torch takes the folder above the nvcc on PATH, which may be a wrapper script
    elsewhere); None without one."""
    for home in (CUDA_HOME, "/usr/local/cuda"):
        if home and any(glob.glob(os.path.join(home, lib, "libcudart.so*")) for lib in ("lib64", "lib")):
            return home
    return None


# CUDA kernels need a CUDA torch and the CUDA toolkit; without either, the CPU kernels alone.
with_cuda = torch.cuda._is_compiled() and os.environ.get("FP8A2A_FORCE_CPU", "0") != "1"
if with_cuda and cuda_toolkit() is None:
    print("fp8a2a: torch has CUDA but no CUDA toolkit was found (set CUDA_HOME): building the CPU kernels only")
    with_cuda = False
elif with_cuda and cuda_toolkit() != CUDA_HOME:
    torch.utils.cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = cuda_toolkit()
# csrc/*.cpp: the op registrations; csrc/cpu: the CPU kernels; csrc/cuda: the CUDA kernels, one file a stage.
sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/**/*.cpp", recursive=True))
# C++17, the standard the kernels are checked in, where torch's headers allow it; from torch 2.14 on
# they need C++20, which torch's build then passes.
std = [] if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14) else ["-std=c++17"]
# No FMA contraction: the CPU kernels must round like the CUDA ones (aarch64 GCC fuses by default).
cxx = ["-O3", *std, "-ffp-contract=off"]


def cublaslt_link_args():
    """How to link cuBLASLt (csrc/cuda/expert_gemms.cu calls it): the toolkit's, else the nvidia wheels'
    of torch's CUDA major version (same soname: at run time the library torch loaded serves both),
    else the linker's own search (-lcublasLt)."""
    major = (torch.version.cuda or "").split(".")[0]
    found = [f for lib in ("lib64", "lib") for f in glob.glob(os.path.join(cuda_toolkit(), lib, "libcublasLt.so*"))]
    for p in sys.path:
        found += glob.glob(os.path.join(p, "nvidia", "**", f"libcublasLt.so.{major}*"), recursive=True)
    return [min(found, key=len)] if found else ["-lcublasLt"]


if with_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    ext = CUDAExtension("fp8a2a._C", sources + sorted(glob.glob("csrc/cuda/**/*.cu", recursive=True)),
                        define_macros=[("FP8A2A_WITH_CUDA", None)],  # ops.cpp registers the CUDA kernels
                        extra_compile_args={"cxx": cxx, "nvcc": ["-O3", *std, "--expt-relaxed-constexpr"]},
                        extra_link_args=cublaslt_link_args())
else:
    ext = CppExtension("fp8a2a._C", sources, extra_compile_args=cxx)


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """Compiles in a folder kept across builds (pip gives each build a new temporary one), so ninja
    recompiles only the sources that changed since the last build, and nothing when none did. Not in
    an isolated build (`pip install .`), whose torch lives in a temporary folder of its own."""

    def finalize_options(self):
        super().finalize_options()
        tmp = os.path.realpath(tempfile.gettempdir())
        if os.path.commonpath([os.path.realpath(torch.__file__), tmp]) != tmp:
            kind = "cuda" if with_cuda else "cpu"
            self.build_temp = os.path.join(HERE, "build", f"objects-{sys.implementation.cache_tag}-{kind}")


setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
