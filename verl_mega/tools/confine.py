"""The python tool's sandbox from the inside: run by verl_mega.tools.sandbox as a fresh interpreter
(`python -I -S -u confine.py SPEC`, cwd a fresh folder holding main.py, an emptied environment), it confines
itself, then runs the model's code. Standard library only, and nothing of the package: it runs by path (the
parent imports only UID_BASE from it).

    this process (B)      unshares a network, a process and a mount namespace (a user namespace too when not
                          root), or runs on without them where the spec allows it; dies with its parent
    R, pid 1 of the new   dies with B (PR_SET_PDEATHSIG) and takes every process of the namespace with it
    process namespace
    U, the code           a tmpfs over its folder; capabilities dropped, a real uid of its own when started as
                          root (so that RLIMIT_NPROC counts), resource limits, Landlock (files: the standard
                          library and system libraries read-only, its folder read-write; TCP; signals and
                          abstract sockets scoped to itself) where the kernel has it, then the code

Progress goes to the status pipe, one line each ("reaper PID", "namespaces ...", "folder ...", "uid ...",
"landlock ...", "ready"), so the parent tells a sandbox that could not be set up from code that failed."""
import ctypes
import json
import os
import resource
import signal
import sys
import traceback

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_V1 = (1 << 13) - 1
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_ALL, SCOPE_ALL = 0b11, 0b11  # TCP bind and connect (ABI 4); abstract unix sockets and signals (ABI 6)
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
READ_RIGHTS = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
SYSTEM_LIBRARIES = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/etc/ld.so.cache")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
UID_BASE = 1_000_000  # + B's pid: a uid no account uses, one per live sandbox

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def main() -> None:
    spec = json.loads(sys.argv[1])
    status = os.fdopen(spec["status_fd"], "w", buffering=1)
    stdlib = [path for path in sys.path[1:] if os.path.exists(path)]  # [0]: this file's folder
    spec["uid"] = UID_BASE + os.getpid()  # B's pid, before the code is in a namespace where it reads 1
    with open(spec["code_path"]) as handle:  # before the folder's tmpfs hides the file
        source = handle.read()
    namespaced = enter_namespaces(status, spec["allow_network"])
    die_with_parent(spec["parent_pid"])
    if namespaced:
        become_namespace_init(status)
    confine(spec, status, stdlib, namespaced, source)
    run_code(source, stdlib)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process (and so its namespace) when the thread that started it ends: a scoring worker killed
    mid-test, a trainer killed mid-call. Set after the namespaces, whose credentials change may clear it."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent was gone before the request took effect
        os._exit(1)


def become_namespace_init(status) -> None:
    """Fork R, pid 1 of the new process namespace, which forks U and reaps; B waits for R and exits with its
    status. Returns in U only."""
    alive_read, alive_write = os.pipe()  # B holds the write end: EOF on it means B is gone
    reaper = os.fork()
    if reaper:
        status.write(f"reaper {reaper}\n")
        os._exit(exit_status(os.waitpid(reaper, 0)[1]))
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.close(alive_write)
    os.set_blocking(alive_read, False)
    try:
        os.read(alive_read, 1)
    except BlockingIOError:  # B still lives, so the death signal is armed in time
        pass
    else:  # EOF: B died before PR_SET_PDEATHSIG was set
        os._exit(1)
    os.close(alive_read)
    code = os.fork()
    if code:
        status.close()
        os._exit(reap_until(code))


def enter_namespaces(status, allow_network: bool) -> bool:
    """Whether this process now has a network, a process and a mount namespace of its own."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | (0 if uid == 0 else CLONE_NEWUSER)
    if libc.unshare(flags) != 0:
        reason = os.strerror(ctypes.get_errno())
        if not allow_network:
            status.write(f"refused no network namespace can be made here ({reason})\n")
            sys.exit(1)
        status.write(f"namespaces none ({reason})\n")
        return False
    if uid != 0:
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    status.write("namespaces net pid mount" + ("" if uid == 0 else " user") + "\n")
    return True


def reap_until(pid: int) -> int:
    """As pid 1: reap every process of the namespace until `pid` ends; its exit status."""
    while True:
        child, wait_status = os.wait()
        if child == pid:
            return exit_status(wait_status)


def exit_status(wait_status: int) -> int:
    """An exit code that carries a signal's death through processes that exit normally: 128 + the signal."""
    return 128 + os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def confine(spec: dict, status, stdlib: list[str], namespaced: bool, source: str) -> None:
    folder = os.getcwd()
    if namespaced:
        mount_folder(folder, spec["folder_mb"])
        write_file("main.py", source)  # again, into the tmpfs: tracebacks quote its lines
        status.write(f"folder tmpfs {spec['folder_mb']} MiB\n")
    else:
        status.write("folder disk\n")
    status.write(f"uid {drop_privileges(spec['uid'])}\n")
    limits = spec["limits"]
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
    abi = landlock([*stdlib, *SYSTEM_LIBRARIES], DEVICES, folder, restrict_network=namespaced)
    status.write(f"landlock {abi}\n")
    status.write("ready\n")
    status.close()


def mount_folder(folder: str, size_mb: int) -> None:
    """A tmpfs of `size_mb` over the code's folder, in this mount namespace only (mounts made private first,
    so nothing propagates to the host's), so the code cannot fill the host's disk; it ends with the namespace."""
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    options = f"size={size_mb}m,mode=0700".encode()
    if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
        raise OSError(ctypes.get_errno(), f"mount tmpfs {folder}")
    os.chdir(folder)  # the working folder was the one beneath the mount


def drop_privileges(uid: int) -> str:
    """No capabilities, none to regain by exec (empty bounding set), no new privileges; as root also a real
    uid of its own, since RLIMIT_NPROC does not count for a real uid 0. The effective uid stays: the
    interpreter's files may sit under a folder only root reads. Which real uid the code runs as: "own",
    "user" (not root: RLIMIT_NPROC counts the user's processes of this namespace) or "root" (a root without
    CAP_SETUID: RLIMIT_NPROC does not count)."""
    with open("/proc/sys/kernel/cap_last_cap") as handle:
        last = int(handle.read())
    for capability in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)  # fails without CAP_SETPCAP: nothing to drop then
    real_uid = "user"
    if os.getuid() == 0:
        try:
            os.setgroups([])
            os.setresuid(uid, 0, 0)
            real_uid = "own"
        except PermissionError:
            real_uid = "root"
    header, data = CapHeader(0x20080522, 0), (CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    return real_uid


def landlock(read_paths, device_paths, folder: str, restrict_network: bool) -> int:
    """Restrict this process and its children to reading `read_paths`, reading and writing `device_paths`
    and everything under `folder`; TCP and signals too where the kernel's Landlock ABI has them. The ABI
    version, 0 where there is no Landlock."""
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        return 0
    handled = FS_ALL_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    handled |= FS_IOCTL_DEV if abi >= 5 else 0
    attr = RulesetAttr(handled, NET_ALL if abi >= 4 and restrict_network else 0, SCOPE_ALL if abi >= 6 else 0)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), 8 if abi < 4 else 16 if abi < 6 else 24,
                           0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    rules = [(path, READ_RIGHTS) for path in read_paths]
    rules += [(path, FS_READ_FILE | FS_WRITE_FILE) for path in device_paths] + [(folder, handled)]
    for path, access in rules:
        allow(ruleset, path, access & handled)
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)
    return abi


def allow(ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:  # not on this system
        return
    try:
        if not os.path.isdir(path):
            access &= FILE_RIGHTS
        rule = PathBeneathAttr(access, fd)
        if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
    finally:
        os.close(fd)


def run_code(source: str, stdlib: list[str]) -> None:
    sys.path[:] = stdlib
    sys.argv[:] = ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as error:
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.exit(1)


def write_file(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


if __name__ == "__main__":
    main()
