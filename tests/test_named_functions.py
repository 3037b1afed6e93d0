"""`config.named_functions.import_function`: the one reader of "package.module:function" names (reward functions,
tools, agents), each refusal one line naming the thing to fix."""
import pytest

from verl_mega.config.errors import UserError
from verl_mega.config.named_functions import import_function
from verl_mega.config.schema import ConfigError, ToolsConfig
from verl_mega.rewards.registry import get_reward_fn
from verl_mega.rollout.endpoint.rollout import load_agent
from verl_mega.tools import ToolSet


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Importable modules: one that works, one that raises importing, one that exits importing."""
    (tmp_path / "named_ok.py").write_text('def score(*args):\n    """Score."""\n    return 1.0\n\nVALUE = 3\n')
    (tmp_path / "named_raises.py").write_text("raise RuntimeError('the module is broken')\n")
    (tmp_path / "named_exits.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("spec, message", [
    ("named_ok", "must look like 'package.module:function'"),
    ("named_ok:score:x", "must look like"),
    ("os;rm:f", "must look like"),
    ("named_ok:", "must look like"),
    (":score", "must look like"),
    ("named_missing_module:f", "cannot import module 'named_missing_module' for reward function .*ModuleNotFoundError"),
    ("named_raises:f", "cannot import module 'named_raises' .*RuntimeError: the module is broken"),
    ("named_exits:f", "cannot import module 'named_exits' .*SystemExit: 3"),
    ("named_ok:nope", "module 'named_ok' has no function 'nope'"),
    ("named_ok:VALUE", "module 'named_ok' has no function 'VALUE'"),
])
def test_a_bad_name_is_one_line_naming_it(modules, spec, message):
    with pytest.raises(UserError, match=message) as caught:
        import_function(spec, "reward function")
    assert "\n" not in str(caught.value)


def test_rewards_tools_and_agents_read_names_alike(modules):
    assert import_function("named_ok:score", "reward function")() == 1.0
    assert get_reward_fn("named_ok:score") is load_agent("named_ok:score")
    for load in (get_reward_fn, load_agent):
        with pytest.raises(UserError, match="RuntimeError: the module is broken"):
            load("named_raises:f")
    with pytest.raises(ConfigError, match="cannot import module 'named_exits' for tool 'named_exits:f'"):
        ToolSet(["named_exits:f"], ToolsConfig())
