"""The package's import graph (read with ast, nothing executed) keeps its layering and has no cycles.

The layering, written down once: a package may import its own modules and packages of lower layers only.

    0  files                            files on disk: the write-then-rename protocol, a file's sha256,
                                        a saved JSON state read back and checked
    1  config, ops, parallel, data      leaves: the config schema, kernels, process groups, datasets
    2  tools, hub                       the tools a multi-turn rollout calls and the python tool's sandbox; Hub
                                        ids resolved through huggingface_hub's cache, a folder pushed back
    3  algorithms, models, rewards      PPO math (pure tensor functions); model families and the builder;
                                        reward functions and the worker process that runs them under a limit
                                        (code rewards run their tests in the python sandbox)
    4  checkpoint                       model formats on disk: shards, manifests, dist checkpoints, HF assets
    5  roles, rollout                   actor / critic / reference / reward; rollout engines, HybridEngine
    6  run, planning                    the run folder: its names (RunFolder), step checkpoints, final weights,
                                        the mirror, provenance, the lock; above checkpoint, whose
                                        formats it saves in (it imports no role); the memory planner: the
                                        config and the HF config.json, with the rollout planner's and vLLM
                                        engine's byte counts
    7  converters                       HF <-> Megatron conversion, parity check, export of a run's weights
    8  trainer                          the job loops and their pre-flight check
    9  launch                           torchrun / Slurm launchers
    10 cli, api                         the command line; the Python API (`verl_mega.Trainer`, `load_policy`)
    11 demo                             `make demo`, through the command line
    12 demo_agent                       `make demo-agent`, on the demo's helpers
    13 demo_agent_http                  `make demo-agent-http`: demo-agent's run through the rollout endpoint

Project modules are imported at the top of a file; inside a function only optional heavy dependencies
(vLLM, transformer-engine, wandb, megatron internals) are imported, so the graph below is the real one. The one
deferred project import is `verl_mega/__init__.py`'s re-export of the API on first attribute access, so that
`import verl_mega` does not load torch and megatron for the launchers.
"""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    {"files"},
    {"config", "ops", "parallel", "data"},
    {"tools", "hub"},
    {"algorithms", "models", "rewards"},
    {"checkpoint"},
    {"roles", "rollout"},
    {"run", "planning"},
    {"converters"},
    {"trainer"},
    {"launch"},
    {"cli", "api"},
    {"demo"},
    {"demo_agent"},
    {"demo_agent_http"},
]
LAYER_OF = {package: level for level, packages in enumerate(LAYERS) for package in packages}
# Installed as verl_mega.converters / verl_mega.launch (setup.py's package_dir).
SOURCE_DIRS = {"verl_mega": ROOT / "verl_mega", "verl_mega.converters": ROOT / "converters",
               "verl_mega.launch": ROOT / "launch"}


def package_modules() -> dict[str, Path]:
    modules = {}
    for prefix, folder in SOURCE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = path
    return modules


def project_imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported verl_mega module, line, inside a function) for every import statement of `module`."""
    is_package = path.name == "__init__.py"
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")[: len(module.split(".")) - child.level + (1 if is_package else 0)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module
                # `from package import name`: a submodule when one is called so, else an attribute of package.
                found.extend((f"{target}.{alias.name}", child.lineno, in_function) for alias in child.names)
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return [(target, line, inside) for target, line, inside in found if target.split(".")[0] == "verl_mega"]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The module an imported name lives in (the longest known module prefix)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    graph = {module: set() for module in modules}
    for module, path in modules.items():
        for target, _, _ in project_imports(module, path):
            resolved = resolve(target, modules)
            if resolved and resolved != module and resolved != "verl_mega":
                graph[module].add(resolved)
    return graph


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in graph.items():
        source = package_of(module)
        for target in targets:
            imported = package_of(target)
            if source == imported or source not in LAYER_OF or imported not in LAYER_OF:
                continue
            if LAYER_OF[imported] >= LAYER_OF[source]:
                problems.append(f"{module} imports {target}: layer {LAYER_OF[source]} ({source}) may only import "
                                f"lower layers, {imported} is layer {LAYER_OF[imported]}")
    return sorted(problems)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def strongconnect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                strongconnect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return found


def test_every_package_is_placed_in_a_layer():
    packages = {package_of(module) for module in package_modules()} - {""}
    assert packages <= set(LAYER_OF), f"packages missing from LAYERS: {sorted(packages - set(LAYER_OF))}"


def test_imports_run_down_the_layers():
    assert layering_violations(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_project_modules_are_imported_at_the_top():
    inside = [f"{module}:{line} imports {target}" for module, path in package_modules().items()
              for target, line, in_function in project_imports(module, path) if in_function]
    assert inside == []


@pytest.mark.parametrize("edge, expected", [
    ({"verl_mega.config.schema": {"verl_mega.roles.actor"}, "verl_mega.roles.actor": set()}, "layer 1 (config)"),
    ({"verl_mega.checkpoint.model_io": {"verl_mega.converters.torch_dist"},
      "verl_mega.converters.torch_dist": {"verl_mega.checkpoint.model_io"}}, "layer 4 (checkpoint)"),
    ({"verl_mega.files.atomic": {"verl_mega.config.errors"}, "verl_mega.config.errors": set()}, "layer 0 (files)"),
    ({"verl_mega.run.folder": {"verl_mega.converters.export"}, "verl_mega.converters.export": set()},
     "layer 6 (run)"),
])
def test_the_checks_catch_an_upward_import_and_a_cycle(edge, expected):
    assert any(expected in problem for problem in layering_violations(edge))
    graph = {module: set(targets) for module, targets in edge.items()}
    if len(edge) == 2 and all(edge.values()):
        assert cycles(graph) == [sorted(edge)]


# Inside `trainer`: the RL job's parts (trainer.rl) build on the modules every job shares (the base job, metrics,
# the rollout batch); those never import the RL package, and of the rest only the entry point (main) builds the
# job, while the pre-flight check asks the config's needs and the schedule's names, never the job.
RL_PACKAGE = "verl_mega.trainer.rl"
RL_IMPORTERS = {"verl_mega.trainer.main": None, "verl_mega.trainer.preflight": {"verl_mega.trainer.rl.needs",
                                                                                  "verl_mega.trainer.rl.schedule"},
                "verl_mega.trainer.plan": {"verl_mega.trainer.rl.needs"}}


def test_the_rl_package_sits_above_the_jobs_shared_modules():
    problems = []
    for module, targets in import_graph().items():
        if module.startswith(RL_PACKAGE) or not module.startswith("verl_mega.trainer"):
            continue
        into_rl = {target for target in targets if target == RL_PACKAGE or target.startswith(RL_PACKAGE + ".")}
        allowed = RL_IMPORTERS.get(module, set())
        if into_rl and allowed is not None and not into_rl <= allowed:
            problems.append(f"{module} imports {sorted(into_rl - allowed)}")
    assert not problems, problems


# The layout records and their arithmetic (`parallel/layout.py`) are what the pre-flight check, the planner and the
# converters' refusals ask before any process group exists: the module imports the standard library alone, so
# none of them starts torch.distributed, and its records stay data (the process groups live in `parallel/state.py`).
def test_the_layout_module_imports_the_standard_library_alone():
    tree = ast.parse((ROOT / "verl_mega" / "parallel" / "layout.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {"." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name for name in imported if name.split(".")[0] not in sys.stdlib_module_names} == set()
