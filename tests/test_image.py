"""docker/Dockerfile's pins and bench/gpu_kit.sh's wheels, resolved against PyPI for the Python and torch they
are for, so that a conflict (a package wanting another torch, or holding transformers below what setup.py needs)
fails here instead of on a user's cluster or the lent GPU machine. The resolving tests need PyPI: they skip
where it cannot be reached (CI has it) and are slow (minutes of metadata)."""
import ast
import functools
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
IMAGE_REQUIREMENTS = ROOT / "docker" / "requirements-image.txt"
PYPI = "https://pypi.org/simple/pip/"
KIT_LIMIT_BYTES = 64 * 2**20
# pip matches manylinux tags exactly: every glibc 2.17 .. 2.39 tag an x86-64 Linux with Python 3.12 accepts.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64"]


@functools.cache
def pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen(PYPI, timeout=10):
            return True
    except OSError:
        return False


# The condition is a string, evaluated when a marked test is set up: collecting the tests touches no network.
needs_pypi = pytest.mark.skipif("not pypi_reachable()", reason="PyPI cannot be reached")


def dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, f"docker/Dockerfile has no ARG {name}=..."
    return match.group(1)


def pins(path: Path) -> dict[str, str]:
    """NAME (normalised) -> version of a requirements file's NAME==VERSION lines."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            found[normalise(requirement.name)] = str(requirement.specifier).removeprefix("==")
    return found


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def setup_keyword(name: str):
    """A literal keyword argument of setup.py's setup() call."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    return ast.literal_eval(next(keyword.value for keyword in call.keywords if keyword.arg == name))


def torch_range() -> SpecifierSet:
    return next(Requirement(r).specifier for r in setup_keyword("install_requires") if Requirement(r).name == "torch")


def test_the_base_is_an_ngc_pytorch_container_whose_torch_and_python_the_package_supports():
    base = dockerfile_arg("BASE_IMAGE")
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), base
    assert dockerfile_arg("BASE_TORCH") in torch_range(), (dockerfile_arg("BASE_TORCH"), str(torch_range()))
    assert dockerfile_arg("BASE_PYTHON") + ".0" in SpecifierSet(setup_keyword("python_requires"))


def run_instructions() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if line.startswith("RUN ")]


def test_the_image_installs_requirements_txt_versions_and_no_vllm():
    image, tested = pins(IMAGE_REQUIREMENTS), pins(ROOT / "requirements.txt")
    assert image and "torch" not in image, "the base's torch must stay"
    assert {name: version for name, version in image.items() if tested.get(name) != version} == {}
    installs = [run for run in run_instructions() if "pip install" in run]
    assert installs and not any("vllm" in run.lower() or "torch==" in run for run in installs), installs


def resolve(*requirements: str, python: str, target: Path) -> dict[str, str]:
    """pip's resolution of `requirements` for CPython `python` on x86-64 Linux from PyPI, wheels only, ignoring
    what is installed here: NAME (normalised) -> version. Fails with pip's message on a conflict. `target` is a
    folder pip is told it would install into (the platform options need one; a dry run writes nothing)."""
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--report", "-",
         "--target", str(target), "--python-version", python, "--implementation", "cp", "--only-binary=:all:",
         *platforms, *requirements], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    return {normalise(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


@pytest.mark.slow
@needs_pypi
def test_the_image_pins_resolve_with_its_torch_and_python(tmp_path):
    torch = dockerfile_arg("BASE_TORCH")
    resolved = resolve("-r", str(IMAGE_REQUIREMENTS), f"torch=={torch}", *setup_keyword("install_requires"),
                       python=dockerfile_arg("BASE_PYTHON"), target=tmp_path / "site")
    assert resolved["torch"] == torch
    assert {name: resolved.get(name) for name in pins(IMAGE_REQUIREMENTS)} == pins(IMAGE_REQUIREMENTS)


@pytest.mark.slow
@needs_pypi
def test_the_gpu_kit_downloads_under_64_mib(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_kit.sh")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "GPU_KIT_DIR": str(tmp_path / "kit")})
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = sorted((tmp_path / "kit").glob("*.whl"))
    listed = subprocess.run(["bash", str(ROOT / "bench" / "gpu_kit.sh"), "--list"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert len(wheels) == len(listed), (wheels, listed)
    assert sum(wheel.stat().st_size for wheel in wheels) <= KIT_LIMIT_BYTES
