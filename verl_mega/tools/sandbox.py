"""The built-in `python` tool: the model's code runs in a fresh interpreter confined by `confine.py` (its
own network and process namespaces, resource limits, Landlock, no capabilities), in a fresh temporary folder
that is also its HOME, with an emptied environment, under the wall-clock limit; its output is read up to the
output limit and no further, and the folder is removed afterwards. docs/tools.md states the threat model."""
from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verl_mega.config.schema import ConfigError, PythonSandboxConfig, ToolsConfig

from .confine import UID_BASE
from .registry import tool_schema
from .results import ToolResult, failure, success

CONFINE = str(Path(__file__).with_name("confine.py"))
MIB = 1 << 20
REAPER_GONE_S = 2.0  # the namespace's processes are killed by the kernel once its pid 1 is: at most this long
SIGNAL_ERRORS = {signal.SIGXCPU: "cpu_limit", signal.SIGXFSZ: "file_size_limit"}


def python(code: str) -> str:
    """Run a Python 3 program in a sandbox and return what it prints (stdout and stderr).

    Args:
        code: A complete Python program (standard library only, no network, no files outside its own
            folder); print the values you need.
    """
    raise NotImplementedError("the schema's function: PythonTool runs the code")


class PythonTool:
    """The `python` tool of a ToolSet. Built once per ToolSet: it runs a first, empty program to find what the
    kernel gives, and refuses (ConfigError) where there is no network namespace unless
    tools.python.allow_network is true."""

    name = "python"

    def __init__(self, config: ToolsConfig):
        self.sandbox = PythonSandbox(config.python, config.timeout_s, config.max_output_chars)
        self.schema = tool_schema(self.name, python)
        self.features = self.sandbox.probe()

    def run(self, arguments: dict) -> ToolResult:
        return self.sandbox.run(arguments["code"])


class PythonSandbox:
    """Runs programs under `config`'s limits, `timeout_s` of wall clock each, output cut at `max_output_chars`.
    `scratch_dir`: where the fresh folders are made (default: the system's temporary folder)."""

    def __init__(self, config: PythonSandboxConfig, timeout_s: float, max_output_chars: int,
                 scratch_dir: str | None = None):
        self.config, self.timeout_s, self.max_output_chars = config, timeout_s, max_output_chars
        self.scratch_dir = scratch_dir

    def probe(self) -> dict[str, str]:
        """What the kernel gives the sandbox here ({"namespaces", "folder", "uid", "landlock": ABI version}), from
        an empty program; a ConfigError where it cannot start."""
        result, status = self._run("")
        refused = [line for line in status if line.startswith("refused")]
        if refused:
            raise ConfigError(f"tools.python: {refused[0].removeprefix('refused ')}; the python tool runs only "
                              "without network access unless tools.python.allow_network=true")
        if not result.ok:
            raise ConfigError(f"tools.python: the sandbox does not start here: {result.text[:300]}")
        features = ("namespaces", "folder", "uid", "landlock")
        return dict(line.split(" ", 1) for line in status if line.startswith(features))

    def run(self, code: str, stdin: str = "", with_stderr: bool = True) -> ToolResult:
        """The result of `code` reading `stdin`; its stderr goes with its stdout unless `with_stderr` is False
        (then only stdout is read: a test case's output)."""
        return self._run(code, stdin, with_stderr)[0]

    def _run(self, code: str, stdin: str = "", with_stderr: bool = True) -> tuple[ToolResult, list[str]]:
        start = time.monotonic()
        folder = tempfile.mkdtemp(prefix="verl_mega_python_", dir=self.scratch_dir)
        try:
            Path(folder, "main.py").write_text(code)
            # An unlinked file, opened before the folder's tmpfs hides the folder: the program reads it at its pace.
            with tempfile.TemporaryFile(dir=folder) as stdin_file:
                stdin_file.write(stdin.encode("utf-8", errors="surrogateescape"))
                stdin_file.seek(0)
                output, outcome, status, returncode = self._execute(folder, stdin_file, with_stderr)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return self._result(output, outcome, status, returncode, time.monotonic() - start), status

    def _execute(self, folder: str, stdin_file, with_stderr: bool) -> tuple[str, str | None, list[str], int]:
        """(output, "timeout" / "output_truncated" / None, status lines, exit code) of one program. Unbuffered
        (-u): stdout and stderr share the pipe, and the model reads them in the order they were written."""
        status_read, status_write = os.pipe()
        spec = {"limits": self._limits(), "allow_network": self.config.allow_network,
                "folder_mb": self.config.folder_mb, "status_fd": status_write, "parent_pid": os.getpid(),
                "code_path": os.path.join(folder, "main.py")}
        env = {"HOME": folder, "TMPDIR": folder, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        try:
            process = subprocess.Popen([sys.executable, "-I", "-S", "-u", CONFINE, json.dumps(spec)], cwd=folder,
                                       env=env, stdin=stdin_file, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT if with_stderr else subprocess.DEVNULL,
                                       start_new_session=True, pass_fds=(status_write,))
        finally:
            os.close(status_write)
        with os.fdopen(status_read) as status_pipe:
            try:
                output, outcome = read_bounded(process, time.monotonic() + self.timeout_s, self.max_output_chars)
            finally:
                kill_group(process)
            status = status_pipe.read().splitlines()
        wait_gone(reaper_pid(status))
        if "uid own" in status and not reaper_pid(status):  # no namespaces: the sandbox's uid finds the rest
            kill_uid(UID_BASE + process.pid)
        return output, outcome, status, process.returncode

    def _limits(self) -> dict[str, int]:
        config = self.config
        return {"RLIMIT_CPU": config.cpu_seconds, "RLIMIT_AS": config.memory_mb * MIB,
                "RLIMIT_FSIZE": config.file_size_mb * MIB, "RLIMIT_NOFILE": config.open_files,
                "RLIMIT_NPROC": config.processes, "RLIMIT_CORE": 0}

    def _result(self, output: str, outcome: str | None, status: list[str], returncode: int,
                seconds: float) -> ToolResult:
        if outcome == "output_truncated":
            return ToolResult(text=output[: self.max_output_chars], ok=True, error="output_truncated",
                              seconds=seconds)
        if outcome == "timeout":
            return self._failure("timeout", output, f"the program ran past {self.timeout_s:g} s and was stopped",
                                 seconds)
        if "ready" not in status:
            reason = next((line for line in status if line.startswith("refused")), output.strip()[-300:])
            return failure("sandbox", f"error: the sandbox could not be set up: {reason}", seconds)
        died_of = signal_of(returncode)
        if died_of:
            category = SIGNAL_ERRORS.get(died_of, "killed")
            return self._failure(category, output, f"the program was killed by {died_of.name} "
                                                   f"({category.replace('_', ' ')})", seconds)
        if returncode != 0:
            return self._failure("raised", output, f"the program exited with status {returncode}", seconds)
        return success(output, self.max_output_chars, seconds)

    def _failure(self, category: str, output: str, note: str, seconds: float) -> ToolResult:
        """The output, its start kept, and an `error:` line after it, within max_output_chars together (the
        traceback alone when the code raised: it says it all)."""
        if category == "raised" and output:
            return failure(category, output[: self.max_output_chars], seconds)
        note = f"error: {note}"
        kept = output[: max(self.max_output_chars - len(note) - 1, 0)]
        return failure(category, (f"{kept}\n{note}" if kept else note)[: self.max_output_chars], seconds)


def read_bounded(process: subprocess.Popen, deadline: float, max_chars: int) -> tuple[str, str | None]:
    """The program's output until its first process exits (what it wrote by then), the deadline passes
    ("timeout") or there are more than max_chars characters ("output_truncated"); at most 4 bytes a character
    are ever held. The exit is watched through a pidfd, so a descendant holding the pipe open does not keep
    the call waiting."""
    cap = 4 * max_chars + 4
    output = bytearray()
    fd = process.stdout.fileno()
    os.set_blocking(fd, False)
    exited = os.pidfd_open(process.pid)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            selector.register(exited, selectors.EVENT_READ)
            while len(output) < cap:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return decoded(output), "timeout"
                ready = {key.fd for key, _ in selector.select(remaining)}
                if fd in ready and read_some(fd, output, cap) == 0:  # end of output: wait for the exit
                    selector.unregister(fd)
                if exited in ready:
                    while len(output) < cap and read_some(fd, output, cap):  # what it wrote before it ended
                        pass
                    break
    finally:
        os.close(exited)
    text = decoded(output)
    if len(text) > max_chars:
        return text[:max_chars], "output_truncated"
    return text, None


def read_some(fd: int, output: bytearray, cap: int) -> int | None:
    """Append what `fd` has (up to `cap` bytes in all) to `output`: the bytes read, 0 at its end, None when
    nothing is there yet."""
    try:
        chunk = os.read(fd, min(65536, cap - len(output)))
    except BlockingIOError:
        return None
    output += chunk
    return len(chunk)


def decoded(output: bytes) -> str:
    return bytes(output).decode("utf-8", errors="replace")


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the program's process group (its first process leads it) and reap the first process; with the
    namespaces, its pid 1 then dies of PR_SET_PDEATHSIG and the kernel kills the rest."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    process.stdout.close()


def kill_uid(uid: int) -> None:
    """SIGKILL every live process of real uid `uid` (the sandbox's own, one per call) until none is left:
    without the namespaces, descendants that left the process group (setsid) end here."""
    for _ in range(1000):  # each round kills all it sees; at most tools.python.processes can be forking
        alive = processes_of(uid)
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def processes_of(uid: int) -> list[int]:
    """The live (not zombie) processes whose real uid is `uid`, read from /proc."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
        except (OSError, ValueError):  # not a process, or gone meanwhile
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            found.append(int(name))
    return found


def reaper_pid(status: list[str]) -> int | None:
    line = next((line for line in status if line.startswith("reaper ")), None)
    return int(line.split()[1]) if line else None


def wait_gone(pid: int | None) -> None:
    """Wait (bounded) until `pid` has exited: the namespace's pid 1, whose end is the end of all its processes."""
    deadline = time.monotonic() + REAPER_GONE_S
    while pid is not None and running(pid) and time.monotonic() < deadline:
        time.sleep(0.005)


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def signal_of(returncode: int) -> signal.Signals | None:
    """The signal that ended the program: negative from Popen, 128 + the signal through the namespace's pid 1."""
    number = -returncode if returncode < 0 else returncode - 128
    try:
        return signal.Signals(number) if number > 0 else None
    except ValueError:  # an exit status above 128 that is no signal's: the code's own sys.exit
        return None
