"""`verl-mega --version` prints the installed package's version (setup.py's, through its metadata)."""
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from verl_mega import cli

ROOT = Path(__file__).resolve().parent.parent


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"verl-mega {version('verl_mega')}\n"


def test_the_installed_version_is_setup_pys():
    declared = re.search(r'version="([^"]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert version("verl_mega") == declared
