"""megatron-core's `torch.compile` decorations, applied at each function's first call instead of at import.

megatron-core decorates its fusions (bias-SwiGLU, bias-GeLU, GeGLU, the MoE and norm helpers: about twenty
functions) with `megatron.core.jit.jit_fuser`, which is `torch.compile` on torch >= 2.2. Decorating builds
inductor's backend object, and that imports torch's whole compiler stack (dynamo, inductor, sympy): about 1.1
CPU-s in every process that imports megatron-core (each rank, each test worker), whether or not it ever calls one
of those functions. A CPU run calls none (`models.builder` keeps the fusions off).

`install()` (from `import verl_mega`, before megatron-core is imported) makes `megatron.core.jit.jit_fuser` this
module's `compile_on_first_call`: the same `torch.compile`, with the same options, of the same function, run at
that function's first call. torch.compile compiles at the first call anyway; only building the backend moves
there, so a GPU run that uses the fusions compiles exactly what it compiled before. Inside a region that is being
compiled (a user's `torch.compile` of a whole layer) the wrapper calls the plain function, which dynamo then
traces inline, as it inlines a nested torch.compile'd function. megatron's own `disable_jit_fuser()` and
`enable_jit_fuser()` keep working: they rebind the same name.

From megatron-core 0.17 on, the MoE router also applies `torch.compile` to one method directly
(`megatron_versions.CHANGES["router_compiles_at_import"]`); there the compiler stack still loads at import.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

MEGATRON_JIT = "megatron.core.jit"


def compile_on_first_call(function=None, **options):
    """`torch.compile(function, **options)`, built when `function` is first called; usable bare or with options."""
    if function is None:
        return functools.partial(compile_on_first_call, **options)
    compiled = None

    @functools.wraps(function)
    def call(*args, **kwargs):
        import torch  # imported by the caller already; `import verl_mega` itself stays without torch

        nonlocal compiled
        if torch.compiler.is_compiling():
            return function(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(function, **options)
        return compiled(*args, **kwargs)

    return call


class _DeferMegatronCompile(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` with the other finders and rebinds its `jit_fuser` right after it executes,
    before any megatron module reads that name to decorate its functions."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MEGATRON_JIT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RebindJitFuser(spec.loader)
        return spec


class _RebindJitFuser(importlib.abc.Loader):
    """megatron's own loader, which still answers everything else (`get_source`, `get_filename`, ...)."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        import torch  # megatron.core.jit has just imported it

        self.loader.exec_module(module)
        if module.jit_fuser is torch.compile:  # not on a torch too old for megatron to choose it
            module.jit_fuser = compile_on_first_call


def install() -> None:
    """Idempotent. Does nothing where megatron-core is already imported (its functions are decorated)."""
    if MEGATRON_JIT in sys.modules or any(isinstance(finder, _DeferMegatronCompile) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferMegatronCompile())
