"""A rank's start and exit: megatron-core's torch.compile decorations deferred to each function's first call
(`parallel/deferred_compile.py`)."""
import subprocess
import sys
import textwrap

import pytest
import torch

from verl_mega.parallel import megatron_versions
from verl_mega.parallel.deferred_compile import compile_on_first_call


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow  # a fresh interpreter importing torch, transformers and megatron-core: ~3 CPU-s
@pytest.mark.skipif(megatron_versions.since("router_compiles_at_import"),
                    reason="megatron-core's router applies torch.compile at import itself")
def test_importing_the_trainer_and_megatron_leaves_the_compiler_stack_unimported():
    result = run_python("""
        import sys
        import verl_mega.trainer.main, megatron.core
        from megatron.core import jit
        print(sorted(name for name in ("torch._dynamo", "torch._inductor", "torch._inductor.compile_fx")
                     if name in sys.modules))
        print(jit.jit_fuser.__module__, jit.jit_fuser.__name__)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "verl_mega.parallel.deferred_compile compile_on_first_call"]


def test_a_deferred_function_compiles_at_its_first_call_with_its_options():
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def gated(x):
        return torch.nn.functional.silu(x) * x

    deferred = compile_on_first_call(backend=backend)(gated)
    assert graphs == []
    x = torch.randn(4, 8)
    assert torch.equal(deferred(x), gated(x))
    assert len(graphs) == 1
    deferred(x)
    assert len(graphs) == 1  # compiled once, as torch.compile's own wrapper does


def test_inside_a_compiled_region_the_deferred_function_is_traced_inline():
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    inner = compile_on_first_call(lambda x: x * 2)
    outer = torch.compile(lambda x: inner(x) + 1, backend=backend, fullgraph=True)
    x = torch.randn(3)
    assert torch.equal(outer(x), x * 2 + 1)
    assert len(graphs) == 1  # one graph: no break at the deferred function


def test_exit_process_keeps_what_a_normal_exit_does(tmp_path):
    """Threads joined, Python's and the C library's atexit handlers run (native libraries free shared memory in
    the latter's turn: os._exit would skip it), open files and the standard streams flushed, the code kept."""
    result = run_python("""
        import atexit, ctypes, sys, threading, time
        from pathlib import Path
        from verl_mega.parallel.process_exit import exit_process

        folder = Path(sys.argv[1])
        atexit.register(lambda: (folder / "atexit").write_text("ran"))
        threading.Thread(target=lambda: (time.sleep(0.2), (folder / "thread").write_text("ran"))).start()
        at_c_exit = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p)(
            lambda status, arg: (folder / "c_atexit").write_text(f"ran with {status}"))
        ctypes.CDLL(None).on_exit(at_c_exit, None)  # glibc's; what the C library runs at exit
        never_closed = open(folder / "never_closed", "w")
        never_closed.write("buffered")
        print("buffered, no newline", end="")
        print("to stderr", end="", file=sys.stderr)
        exit_process(3)
    """, str(tmp_path))
    assert result.returncode == 3, result.stderr
    assert (result.stdout, result.stderr) == ("buffered, no newline", "to stderr")
    assert (tmp_path / "atexit").read_text() == (tmp_path / "thread").read_text() == "ran"
    assert (tmp_path / "c_atexit").read_text() == "ran with 3"
    assert (tmp_path / "never_closed").read_text() == "buffered"


@pytest.mark.parametrize("kept", [False, True])
def test_exit_process_runs_the_objects_finalizers_only_when_a_library_asked(tmp_path, kept):
    """The fast exit skips finalizers (what it saves); `keep_finalizers_at_exit` (vLLM's engine calls it) brings
    them back, with the code kept either way."""
    result = run_python(f"""
        import sys
        from pathlib import Path
        from verl_mega.parallel import process_exit

        class Resource:
            # Bound now: when the interpreter finalizes __main__, its globals and builtins are gone.
            def __del__(self, mark=Path(sys.argv[1], "finalized")):
                mark.write_text("ran")

        held = Resource()
        if {kept}:
            process_exit.keep_finalizers_at_exit("a test resource freed by its finalizer")
        process_exit.exit_process(4)
    """, str(tmp_path))
    assert result.returncode == 4, result.stderr
    assert (tmp_path / "finalized").exists() is kept


def test_under_a_profiler_exit_process_is_a_normal_exit(tmp_path):
    """cProfile writes its file after the program returns: there exit_process must not cut the process short."""
    script = tmp_path / "rank.py"
    script.write_text("from verl_mega.parallel.process_exit import exit_process\nexit_process(0)\n")
    stats = tmp_path / "rank.prof"
    result = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(stats), str(script)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert stats.stat().st_size > 0
