"""verl_mega: Megatron-backed RL post-training.

The top-level `converters/` and `launch/` folders install as `verl_mega.converters` and `verl_mega.launch`,
so no generic module names land in site-packages.
"""
from setuptools import find_packages, setup

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
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.12",
        "transformers>=4.45",
        "safetensors",
        "psutil",
        "pyyaml",
        "omegaconf",
    ],
    extras_require={"gpu": ["vllm", "transformer-engine"]},
    entry_points={"console_scripts": ["verl-mega=verl_mega.cli:main"]},
)
