"""Builds fp8a2a._C: CPU kernels always, CUDA kernels too when torch has CUDA (sm_90 by default)."""
import glob
import os
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit("fp8a2a: install torch first (CPU machines: `pip install torch==2.13.0`), then "
             "`pip install --no-build-isolation -e .` so the build sees that torch.")

with_cuda = torch.cuda._is_compiled() and os.environ.get("FP8A2A_FORCE_CPU", "0") != "1"
# csrc/*.cpp: the op registrations; csrc/cpu: the CPU kernels; csrc/cuda: the CUDA kernels, one file a stage.
sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/**/*.cpp", recursive=True))
# No FMA contraction: the CPU kernels must round like the CUDA ones (aarch64 GCC fuses by default).
cxx = ["-O3", "-std=c++17", "-ffp-contract=off"]
if with_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    ext = CUDAExtension("fp8a2a._C", sources + sorted(glob.glob("csrc/cuda/**/*.cu", recursive=True)),
                        define_macros=[("FP8A2A_WITH_CUDA", None)],  # ops.cpp registers the CUDA kernels
                        extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]})
else:
    ext = CppExtension("fp8a2a._C", sources, extra_compile_args=cxx)

setup(
    name="fp8a2a",
    version="0.1.0",
    description="FP8 all-to-all for Mixture-of-Experts dispatch and combine",
    packages=find_packages(include=["fp8a2a", "fp8a2a.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "packaging"],
)
