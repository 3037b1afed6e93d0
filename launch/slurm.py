"""`verl-mega launch slurm`: render the sbatch script into the run folder, then submit it (or print it).

One torchrun agent per node (srun --ntasks-per-node=1) starts the ranks of that node; the agents meet
through a c10d rendezvous on the first node of the allocation. See templates/sbatch.sh for the
warning-signal / requeue protocol the trainer follows.
"""
from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from verl_mega.files.atomic import atomic_write_text

from .payload import (
    Payload, add_payload_arguments, add_rollout_ranks, check_trainer_config, parse_env, payload_from_args,
    split_passthrough,
)

TEMPLATE = Path(__file__).parent / "templates" / "sbatch.sh"
SCRIPT_NAME = "sbatch.sh"
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
# sbatch reads #SBATCH lines itself, not through a shell, so their values cannot be quoted.
_UNQUOTABLE = re.compile(r"[\s'\"\\]")
# Slurm keeps the warning offset in 16 bits.
_MAX_SIGNAL_SECONDS = 65535


_UNLIMITED_TIMES = ("0", "unlimited", "infinite")
_TIME_FORMS = (re.compile(r"(?P<m>\d+)(?::(?P<s>\d+))?"), re.compile(r"(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)"),
               re.compile(r"(?P<d>\d+)-(?P<h>\d+)(?::(?P<m>\d+)(?::(?P<s>\d+))?)?"))


def slurm_time_seconds(value: str) -> int | None:
    """Seconds in a Slurm time limit (M, M:S, H:M:S, D-H, D-H:M or D-H:M:S); None for no limit
    (0, UNLIMITED, infinite). Raises ValueError naming --time for anything else."""
    if value.lower() in _UNLIMITED_TIMES:
        return None
    for form in _TIME_FORMS:
        match = form.fullmatch(value)
        if match:
            fields = {unit: int(number or 0) for unit, number in match.groupdict().items()}
            return fields.get("d", 0) * 86400 + fields.get("h", 0) * 3600 + fields["m"] * 60 + fields["s"]
    raise ValueError(f"--time {value!r} is not a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S "
                     "(non-negative numbers), or 0 / UNLIMITED for none")


@dataclass(frozen=True)
class SlurmOptions:
    payload: Payload
    run_dir: Path
    nodes: int = 1
    gpus_per_node: int = 0
    procs_per_node: int | None = None
    cpus_per_task: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str = "verl-mega"
    container_image: str | None = None
    container_mounts: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    signal_seconds: int = 300
    singleton: bool = False
    python: str | None = None
    rollout_nodes: int = 0

    def __post_init__(self):
        for name in ("nodes", "procs_per_node", "cpus_per_task"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if not 0 <= self.rollout_nodes < self.nodes:
            raise ValueError(f"--rollout-nodes {self.rollout_nodes} must be >= 0 and leave at least one training "
                             f"node of --nodes {self.nodes}")
        if not 1 <= self.signal_seconds <= _MAX_SIGNAL_SECONDS:
            raise ValueError(f"--signal-seconds must be within 1..{_MAX_SIGNAL_SECONDS}, got {self.signal_seconds}")
        directives = {"--job-name": self.job_name, "--partition": self.partition, "--time": self.time,
                      "--account": self.account, "--qos": self.qos, "--run-dir": str(self.run_dir)}
        for flag, value in directives.items():
            if value is not None and _UNQUOTABLE.search(value):
                raise ValueError(f"{flag} {value!r} must not contain spaces, quotes or backslashes "
                                 "(it goes on an #SBATCH line)")
        limit = slurm_time_seconds(self.time) if self.time is not None else None
        if limit is not None and limit <= self.signal_seconds:
            raise ValueError(f"--signal-seconds {self.signal_seconds} must be shorter than --time {self.time} "
                             f"({limit} s): Slurm would send the warning at once")
        if self.container_mounts and not self.container_image:
            raise ValueError("--mounts needs --container-image (mounts are passed to pyxis with the image)")

    @property
    def ranks_per_node(self) -> int:
        return ranks_per_node(self.procs_per_node, self.gpus_per_node)

    @property
    def interpreter(self) -> str:
        # Outside a container the job runs the submitting interpreter (an absolute path, same venv on
        # a shared filesystem); inside one, the image's own python.
        if self.python:
            return self.python
        return "python" if self.container_image else sys.executable


def ranks_per_node(procs_per_node: int | None, gpus_per_node: int) -> int:
    """--procs-per-node, else one rank per GPU, else one."""
    return procs_per_node or gpus_per_node or 1


def render_sbatch(options: SlurmOptions) -> str:
    """The sbatch script for `options`; a template line with a placeholder whose value is None is dropped."""
    quote = shlex.quote
    values = {
        "job_name": options.job_name,
        "nodes": str(options.nodes),
        "cpus_per_task": _maybe(options.cpus_per_task),
        # CPU-only partitions reject any GPU request, so no line at all rather than =0.
        "gpus_per_node": _maybe(options.gpus_per_node or None),
        "partition": options.partition,
        "time": options.time,
        "account": options.account,
        "qos": options.qos,
        "output": str(options.run_dir / "slurm-%j.out"),
        "signal_seconds": str(options.signal_seconds),
        "dependency": "singleton" if options.singleton else None,
        "env_exports": "\n".join(f"export {name}={quote(value)}" for name, value in options.env.items()) or None,
        "container_image": _maybe(options.container_image, quote),
        "container_mounts": _maybe(options.container_mounts, quote),
        "python": quote(options.interpreter),
        "procs_per_node": str(options.ranks_per_node),
        "payload": shlex.join([options.payload.module, *options.payload.args]),
    }
    lines = []
    for line in TEMPLATE.read_text().splitlines():
        names = _PLACEHOLDER.findall(line)
        unknown = [name for name in names if name not in values]
        if unknown:
            raise KeyError(f"{TEMPLATE} uses unknown placeholder(s) {unknown}")
        if any(values[name] is None for name in names):
            continue
        lines.append(_PLACEHOLDER.sub(lambda match: values[match.group(1)], line))
    return "\n".join(lines) + "\n"


def _maybe(value, convert=str):
    return None if value is None else convert(value)


def write_script(text: str, run_dir: Path) -> Path:
    """Write the script into run_dir whole or not at all (a crashed write never leaves half a script)."""
    return atomic_write_text(run_dir / SCRIPT_NAME, text, mode=0o755)


def submit(script_path: str | Path) -> str:
    """sbatch the script and return the job id; raises RuntimeError with sbatch's own message on failure."""
    if shutil.which("sbatch") is None:
        raise RuntimeError("sbatch not found on PATH; submit from a Slurm login node (or install slurm-client)")
    result = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"sbatch {script_path} failed: {result.stderr.strip() or result.stdout.strip()}")
    # --parsable prints "jobid" or "jobid;cluster".
    return result.stdout.strip().split(";")[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-mega launch slurm",
        description="Render an sbatch script into the run folder and submit it. "
                    "Arguments after -- go to --module verbatim.",
    )
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True, help="0 for CPU nodes (no GPU request)")
    parser.add_argument("--procs-per-node", type=int, help="ranks per node (default: --gpus-per-node, or 1)")
    parser.add_argument("--cpus-per-task", type=int, help="CPUs for each node's ranks together")
    parser.add_argument("--partition")
    parser.add_argument("--time", help="Slurm time limit, e.g. 04:00:00 or 2-00 (0 or UNLIMITED: none)")
    parser.add_argument("--account")
    parser.add_argument("--qos")
    parser.add_argument("--job-name", help="default: verl-mega-<config name>, or the module's last part")
    parser.add_argument("--container-image", help="run every rank in this image (pyxis/enroot)")
    parser.add_argument("--mounts", help="pyxis --container-mounts, e.g. /data:/data,/ckpt:/ckpt")
    parser.add_argument("--signal-seconds", type=int, default=300,
                        help="send USR1 this many seconds before the time limit so the trainer can save")
    parser.add_argument("--singleton", action="store_true",
                        help="start only after every other job of this name and user has ended")
    parser.add_argument("--python", help="interpreter on the nodes (default: this one; python in a container)")
    parser.add_argument("--run-dir", help="folder for the script and logs (default: runs/<job-name>-<time>)")
    parser.add_argument("--dry-run", action="store_true", help="write and print the script, do not submit")
    parser.add_argument("--rollout-nodes", type=int, default=0,
                        help="nodes (the last ones) whose ranks only generate: parallel.rollout_ranks = this x "
                             "ranks per node")
    add_payload_arguments(parser)
    return parser


def options_from_args(args: argparse.Namespace, passthrough: list[str]) -> SlurmOptions:
    # torchrun numbers each node's ranks consecutively, so the last nodes' ranks are the last global ranks.
    add_rollout_ranks(args, args.rollout_nodes * ranks_per_node(args.procs_per_node, args.gpus_per_node),
                      "--rollout-nodes")
    payload = payload_from_args(args, passthrough)
    job_name = args.job_name or _default_job_name(args)
    run_dir = Path(args.run_dir or Path("runs") / f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    return SlurmOptions(
        payload=payload, run_dir=run_dir, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        procs_per_node=args.procs_per_node, cpus_per_task=args.cpus_per_task, partition=args.partition,
        time=args.time, account=args.account, qos=args.qos, job_name=job_name,
        container_image=args.container_image, container_mounts=args.mounts, env=parse_env(args.env),
        signal_seconds=args.signal_seconds, singleton=args.singleton, python=args.python,
        rollout_nodes=args.rollout_nodes,
    )


def _default_job_name(args: argparse.Namespace) -> str:
    if args.config:
        return f"verl-mega-{Path(args.config).stem}"
    return f"verl-mega-{args.module.rsplit('.', 1)[-1]}"


def main(argv: list[str] | None = None) -> int:
    own, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        options = options_from_args(args, passthrough)
        # A dry run checks what a submission checks: it shows the script only of a job that would be queued.
        check_trainer_config(args, passthrough, options.nodes * options.ranks_per_node)
    except ValueError as error:
        parser.error(str(error))
    created = not options.run_dir.exists()
    try:
        script = write_script(render_sbatch(options), options.run_dir)
    except OSError as error:  # a file where the folder goes, a read-only or full disk: no traceback, no folder
        if created:
            shutil.rmtree(options.run_dir, ignore_errors=True)
        parser.error(f"--run-dir {options.run_dir}: cannot write {SCRIPT_NAME} there ({error.strerror or error})")
    if args.dry_run:
        print(script.read_text(), end="")
        print(f"# written to {script}; not submitted (--dry-run)", file=sys.stderr)
        return 0
    try:
        job_id = submit(script)
    except RuntimeError as error:
        # Nothing was submitted, so nothing of this attempt stays: the folder if it made it, else the script.
        if created:
            shutil.rmtree(options.run_dir, ignore_errors=True)
        else:
            script.unlink(missing_ok=True)
        print(f"verl-mega launch slurm: error: {error}; nothing was submitted", file=sys.stderr)
        return 2
    print(job_id)
    print(f"# submitted {script}; log: {options.run_dir}/slurm-{job_id}.out", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
