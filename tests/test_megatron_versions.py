"""The supported megatron-core range: the import check's refusals, the places that state the range, and the
table of what differs inside it checked against the release installed (CI runs this file on the lowest and on
the newest supported release, so a wrong entry fails on one of them)."""
import re
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest

from verl_mega.parallel import megatron_versions

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("found", ["0.16.1", "0.17.0", "0.18.2", "0.19.2", "0.19.0rc1+nv25.10"])
def test_releases_inside_the_range_import(monkeypatch, found):
    monkeypatch.setattr(megatron_versions, "version", lambda name: found)
    megatron_versions.check_installed()


@pytest.mark.parametrize("found", ["0.16.0", "0.15.3", "0.20.0", "0.20.0rc1", "1.0.0", "nightly", None])
def test_releases_outside_the_range_are_refused_in_one_line_naming_it(monkeypatch, found):
    def installed(name):
        if found is None:
            raise PackageNotFoundError(name)
        return found

    monkeypatch.setattr(megatron_versions, "version", installed)
    with pytest.raises(ImportError) as refusal:
        megatron_versions.check_installed()
    message = str(refusal.value)
    assert "\n" not in message
    assert "megatron-core >=0.16.1,<0.20" in message and f"(found {found or 'none'})" in message


def test_release_numbers_are_read_from_the_start_of_a_version():
    assert megatron_versions.release_of("0.19.0rc1+nv25.10") == (0, 19, 0)
    assert megatron_versions.release_of("0.17") == (0, 17, 0)
    assert megatron_versions.release_of("v0.17") is None


def test_setup_py_states_the_range_and_the_requirements_pin_inside_it():
    setup_py = (ROOT / "setup.py").read_text()
    assert f'"megatron-core{megatron_versions.supported_range()}"' in setup_py
    lowest, first_unsupported = megatron_versions.SUPPORTED
    pins = {}
    for name in ("requirements.txt", "requirements-mcore-newest.txt"):
        pinned = re.search(r"^megatron-core==(\S+)", (ROOT / name).read_text(), re.MULTILINE).group(1)
        pins[name] = megatron_versions.release_of(pinned)
        assert lowest <= pins[name] < first_unsupported, name
    assert pins["requirements.txt"] == lowest == megatron_versions.release_of(megatron_versions.PINNED)
    assert pins["requirements-mcore-newest.txt"][:2] == (first_unsupported[0], first_unsupported[1] - 1)


@pytest.mark.parametrize("change", sorted(megatron_versions.CHANGES))
def test_each_change_is_where_the_table_says_in_the_installed_release(change):
    assert megatron_versions.CHANGES[change].probe() == megatron_versions.since(change), (
        f"megatron-core {megatron_versions.installed_release()}: {megatron_versions.CHANGES[change].what}")
