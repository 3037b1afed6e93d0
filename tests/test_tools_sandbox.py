"""The python tool's sandbox against hostile code (issue 28's list): a fork bomb, an infinite loop, a 100 GB
allocation, writing outside its folder, reading the trainer's files and environment, opening sockets,
printing without end. Each is contained within the limits and counted as its failure category, and no
process it started outlives the call (every process of the sandbox has its cwd in the scratch folder)."""
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from verl_mega.config.schema import ConfigError, PythonSandboxConfig, ToolsConfig
from verl_mega.tools import ToolCall, ToolSet
from verl_mega.tools.sandbox import PythonSandbox

LIMIT_S = 1.0  # the wall-clock limit of the programs that never end
ROOMY_S = 20.0  # the limit of the others: they end in a fraction of a second, on a loaded machine in a few
PROCESSES = 8
SECRET = "verl-mega-test-secret-4711"


def namespaces_refused() -> bool:
    """Whether this machine's kernel refuses the sandbox's namespaces (any other failure fails the tests)."""
    try:
        PythonSandbox(PythonSandboxConfig(), timeout_s=30, max_output_chars=100).probe()
    except ConfigError as error:
        return "no network namespace can be made here" in str(error)
    return False


pytestmark = pytest.mark.skipif(namespaces_refused(), reason="the kernel refuses the sandbox's namespaces")


@pytest.fixture
def scratch(tmp_path):
    folder = tmp_path / "scratch"
    folder.mkdir()
    return folder


@pytest.fixture
def sandbox(scratch):
    return limited_sandbox(scratch, ROOMY_S)


@pytest.fixture
def quick_sandbox(scratch):
    return limited_sandbox(scratch, LIMIT_S)


def limited_sandbox(scratch, timeout_s: float, **limits) -> PythonSandbox:
    config = PythonSandboxConfig(**{"cpu_seconds": 5, "memory_mb": 512, "file_size_mb": 1, "open_files": 32,
                                    "processes": PROCESSES, **limits})
    return PythonSandbox(config, timeout_s=timeout_s, max_output_chars=1000, scratch_dir=str(scratch))


def sandbox_processes(scratch) -> list[psutil.Process]:
    """The processes whose working folder is (or was: deleted since) under `scratch`."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.cwd().startswith(str(scratch)):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def run_contained(sandbox, scratch, code: str):
    """The result of `code`, checked to leave no process and no folder behind."""
    start = time.monotonic()
    result = sandbox.run(code)
    assert time.monotonic() - start < sandbox.timeout_s + 1.0
    assert sandbox_processes(scratch) == []
    assert list(scratch.iterdir()) == []
    return result


def test_the_check_for_left_processes_sees_a_running_program(sandbox, scratch):
    """The premise of every `run_contained`: while a program runs, its processes are found by their folder."""
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\ntime.sleep(1.5)"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(sandbox.run, code)
        seen, deadline = [], time.monotonic() + 10
        while len(seen) < 4 and time.monotonic() < deadline:  # the interpreter, pid 1, the code, its child
            seen = sandbox_processes(scratch)
        assert len(seen) == 4 and running.result().ok
    assert sandbox_processes(scratch) == []


def test_plain_code_runs_and_prints(sandbox, scratch):
    result = run_contained(sandbox, scratch, "import math\nprint(math.factorial(10))")
    assert (result.text, result.ok, result.error) == ("3628800\n", True, None)


@pytest.mark.parametrize("code, text", [("import sys\nprint('bye')\nsys.exit(3)", "bye\n"),
                                        ("import sys\nsys.exit(200)", "error: the program exited with status 200")])
def test_code_that_exits_with_an_error_status_is_counted_as_raised(sandbox, scratch, code, text):
    result = run_contained(sandbox, scratch, code)
    assert (result.ok, result.error, result.text) == (False, "raised", text)


def test_a_long_output_with_its_error_stays_within_the_output_limit(quick_sandbox, scratch):
    result = run_contained(quick_sandbox, scratch, "print('y' * 990, flush=True)\nwhile True:\n    pass")
    assert result.error == "timeout" and len(result.text) == 1000
    assert result.text.startswith("yyy") and result.text.endswith("error: the program ran past 1 s and was stopped")


def test_code_that_raises_gives_its_traceback(sandbox, scratch):
    result = run_contained(sandbox, scratch, "def f():\n    raise ValueError('boom')\nf()")
    assert (result.ok, result.error) == (False, "raised")
    assert "ValueError: boom" in result.text and 'File "main.py", line 2' in result.text
    assert "raise ValueError('boom')" in result.text  # the line quoted
    assert "confine" not in result.text  # the sandbox's own frames are not shown


def test_an_infinite_loop_is_stopped_at_the_wall_clock_limit(quick_sandbox, scratch):
    result = run_contained(quick_sandbox, scratch, "print('started', flush=True)\nwhile True:\n    pass")
    assert (result.ok, result.error) == (False, "timeout") and "started" in result.text


def test_a_fork_bomb_stops_at_the_process_limit_and_dies_with_the_call(quick_sandbox, scratch):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_contained(quick_sandbox, scratch, bomb)
    assert result.error == "timeout"


def test_children_left_behind_even_in_their_own_session_die_with_the_call(sandbox, scratch):
    code = ("import os, time\nstarted = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        os.setsid()\n        time.sleep(60)\n"
            "        os._exit(0)\n    started += 1\nprint(started)")
    result = run_contained(sandbox, scratch, code)
    assert result.ok and 0 < int(result.text) < PROCESSES


def test_the_limits_are_set_in_the_code_s_process(sandbox, scratch):
    code = ("import resource\nprint([resource.getrlimit(getattr(resource, name))[0] for name in\n"
            "       ('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE', 'RLIMIT_NPROC', 'RLIMIT_CORE')])")
    result = run_contained(sandbox, scratch, code)
    assert result.text == f"{[5, 512 * 2**20, 2**20, 32, PROCESSES, 0]}\n"


@pytest.mark.parametrize("signal_name, category", [("SIGXCPU", "cpu_limit"), ("SIGXFSZ", "file_size_limit"),
                                                   ("SIGSEGV", "killed")])
def test_a_program_ended_by_a_signal_is_counted_by_it(sandbox, scratch, signal_name, category):
    code = (f"import os, signal\nsignal.signal(signal.{signal_name}, signal.SIG_DFL)\n"
            f"os.kill(os.getpid(), signal.{signal_name})")
    result = run_contained(sandbox, scratch, code)
    assert (result.ok, result.error) == (False, category) and signal_name in result.text


def test_the_code_runs_no_other_program_and_signals_nothing_outside(sandbox, scratch):
    code = ("import os, signal, subprocess\nfor attempt in (lambda: subprocess.run(['echo', 'hi']),\n"
            "                lambda: os.kill(1, signal.SIGKILL), lambda: os.listdir('/proc')):\n"
            "    try:\n        attempt()\n        print('done')\n    except OSError as error:\n"
            "        print('refused', error.errno)")
    result = run_contained(sandbox, scratch, code)
    assert result.ok and "done" not in result.text and result.text.count("refused") == 3


def test_a_100_gb_allocation_is_a_memory_error(sandbox, scratch):
    result = run_contained(sandbox, scratch, "data = bytearray(100 * 2**30)")
    assert result.error == "raised" and "MemoryError" in result.text


def test_printing_a_gigabyte_is_cut_at_the_output_limit_at_once(sandbox, scratch):
    result = run_contained(sandbox, scratch, "import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)")
    assert (result.ok, result.error) == (True, "output_truncated")
    assert len(result.text) == 1000  # and not a timeout: reading stopped at the limit


def test_a_file_past_the_size_limit_is_refused(sandbox, scratch):
    code = "import os\ntry:\n    open('big', 'wb').write(b'x' * 2 * 2**20)\nfinally:\n    print(os.path.getsize('big'))"
    result = run_contained(sandbox, scratch, code)  # Python ignores SIGXFSZ: the write fails with EFBIG
    assert (result.ok, result.error) == (False, "raised") and "File too large" in result.text
    assert result.text.startswith(f"{2**20}\n")


def test_the_files_together_stop_at_the_folder_s_size(scratch):
    sandbox = limited_sandbox(scratch, ROOMY_S, folder_mb=4)
    code = "for index in range(100):\n    open(f'part{index}', 'wb').write(b'x' * 2**20)"
    result = run_contained(sandbox, scratch, code)
    assert result.error == "raised" and "No space left on device" in result.text
    assert str(scratch) not in Path("/proc/self/mountinfo").read_text()  # the tmpfs was the sandbox's only


def test_the_code_writes_only_inside_its_own_folder(sandbox, scratch, tmp_path):
    outside = tmp_path / "escaped.txt"
    code = (f"open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())\n"
            f"open({str(outside)!r}, 'w').write('escaped')")
    result = run_contained(sandbox, scratch, code)
    assert result.error == "raised" and result.text.startswith("ok\n") and "PermissionError" in result.text
    assert not outside.exists()


@pytest.mark.parametrize("target", ["planted file", "trainer environ", "home"])
def test_the_code_reads_neither_the_trainer_s_files_nor_its_environment(sandbox, scratch, tmp_path, monkeypatch,
                                                                         target):
    monkeypatch.setenv("VERL_MEGA_TEST_SECRET", SECRET)
    planted = tmp_path / "secret.txt"
    planted.write_text(SECRET)
    path = {"planted file": str(planted), "trainer environ": f"/proc/{os.getpid()}/environ",
            "home": os.path.expanduser("~/.bashrc")}[target]
    code = f"import os\nprint(sorted(os.environ))\nprint(open({path!r}, errors='replace').read())"
    result = run_contained(sandbox, scratch, code)
    assert SECRET not in result.text and "VERL_MEGA_TEST_SECRET" not in result.text
    assert result.text.startswith("['HOME', 'LANG', 'PATH', 'TMPDIR']\n") and "PermissionError" in result.text


def test_the_code_reaches_no_socket_of_the_host(sandbox, scratch):
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        udp.settimeout(0.2)
        tcp_port, udp_port = server.getsockname()[1], udp.getsockname()[1]
        server.settimeout(0.2)
        code = ("import socket\nudp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for attempt in (lambda: socket.create_connection(('127.0.0.1', {tcp_port}), timeout=0.5),\n"
                f"                lambda: udp.sendto(b'x', ('127.0.0.1', {udp_port}))):\n"
                "    try:\n        attempt()\n        print('reached')\n    except OSError as error:\n"
                "        print('refused', error.errno)")
        result = run_contained(sandbox, scratch, code)
        with pytest.raises(socket.timeout):
            server.accept()
        with pytest.raises(socket.timeout):
            udp.recv(1)
    assert result.ok and "reached" not in result.text and result.text.count("refused") == 2


def test_a_toolset_checks_the_code_argument_before_starting_a_process():
    with ToolSet(["python"], ToolsConfig(timeout_s=ROOMY_S)) as tools:
        assert tools.call(ToolCall("python", {"code": 7})).error == "bad_arguments"
        assert tools.call(ToolCall("python", '{"code": "print(6 * 7)"}')).text == "42\n"
        assert tools.sandbox_features["landlock"].isdigit() and "folder" in tools.sandbox_features


def test_concurrent_programs_each_get_their_own_folder_and_result(scratch):
    calls = [ToolCall("python", {"code": f"import os\nopen('mine', 'w').write('{index}')\n"
                                         f"print(sorted(os.listdir('.')), open('mine').read())"}) for index in range(4)]
    with ToolSet(["python"], ToolsConfig(timeout_s=ROOMY_S, workers=4)) as tools:
        results = tools.call_many(calls)
    assert [result.text for result in results] == [f"['main.py', 'mine'] {index}\n" for index in range(4)]


WITHOUT_NAMESPACES = """
import os, sys, time
from verl_mega.config.schema import ConfigError, PythonSandboxConfig
from verl_mega.tools.sandbox import PythonSandbox
def sandbox(allow_network):
    config = PythonSandboxConfig(allow_network=allow_network, processes=8)
    return PythonSandbox(config, timeout_s=20, max_output_chars=1000, scratch_dir=sys.argv[1])
try:
    sandbox(False).probe()
except ConfigError as error:
    print(error)
allowed = sandbox(True)
print(allowed.probe())
start = time.monotonic()
result = allowed.run(sys.argv[2])
print(result.text.strip(), result.error, time.monotonic() - start < 10)
"""
LEAVE_CHILDREN = ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
                  "        time.sleep(60)\n        os._exit(0)\nprint('left 3')")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="takes the namespaces away by running as a root without CAP_SYS_ADMIN")
def test_without_namespaces_the_python_tool_starts_only_when_allowed_and_still_leaves_no_process(scratch):
    """Run as a root without CAP_SYS_ADMIN (as in a default Docker container): no namespace can be made. The
    python tool refuses; allowed, it runs, and the children it leaves in their own sessions are found by the
    sandbox's uid and killed, the call not waiting for them."""
    run = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-all", sys.executable, "-c",
                          WITHOUT_NAMESPACES, str(scratch), LEAVE_CHILDREN], capture_output=True, text=True, timeout=120)
    refusal, features, outcome = run.stdout.splitlines()
    assert refusal == ("tools.python: no network namespace can be made here (Operation not permitted); the python "
                       "tool runs only without network access unless tools.python.allow_network=true"), run.stderr
    assert features.startswith("{'namespaces': 'none (Operation not permitted)', 'folder': 'disk', 'uid': 'own'")
    assert outcome == "left 3 None True"
    assert sandbox_processes(scratch) == []
