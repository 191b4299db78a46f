"""Run a program (a coding-agent CLI, a task's test script) per episode without Docker, confined the way
the Python tool is: the sandbox harness agents run in.

`run_sandboxed(argv, cwd=task_dir, ports=[endpoint_port])` starts the command as a fresh unprivileged user
and returns its exit code, the tail of its output, and whether it timed out. The command:

- runs as its own uid/gid (no groups, no capabilities, `no_new_privs`), as PID 1's child in a PID namespace
  of its own (it sees only its own processes in a fresh /proc), with `PR_SET_PDEATHSIG`;
- reads only beneath the allow-list (Landlock): `COMMAND_READ_PATHS` (shared libraries, the programs in
  /usr/bin, /usr/share, name resolution), its executable, `read_paths` (the CLI's installation, e.g. its npm
  folder), its HOME, the task directory and a private /tmp; /etc/shadow, /root, /home, the host's /tmp and
  every other file are unreadable, whatever their permissions;
- writes only the task directory, its HOME, `write_paths` and its private /tmp (a tmpfs of `tmp_mb`);
- reaches only the host's loopback ports in `ports` (turnrl's endpoint), relayed into a network namespace
  whose loopback is otherwise its own: nothing else, no DNS, no other host (network="none": not even those);
- gets only the environment given (PATH, HOME, TMPDIR, LANG, USER and `env`): no secret of the parent's;
- is killed with every process it started at `timeout_s` (the PID namespace dies with its init), and its
  HOME (when created here), ownership changes and processes are cleaned up whatever happened.

Where the machine cannot enforce this (not root, no Landlock, no namespaces), `run_sandboxed` refuses with a
message naming what is missing, unless `weak=True` (a harness config's `sandbox: weak`): then it runs with the
layers available, reported in `CommandResult.layers` and logged. `turnrl doctor --sandbox` prints what this
machine enforces; docs/sandbox.md says what each layer covers and what it does not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from turnrl.tools.sandbox import (
    PROGRAM_PATHS,
    SYSTEM_READ_PATHS,
    Launch,
    SandboxError,
    launch,
    nproc_limit,
    pick_sandbox_id,
)

log = logging.getLogger(__name__)

Network = Literal["none", "loopback"]

COMMAND_READ_PATHS: tuple[str, ...] = (
    *SYSTEM_READ_PATHS,
    *PROGRAM_PATHS,
    "/usr/share",  # terminfo, git templates, ICU and timezone data, man pages: public data
    "/etc/hosts", "/etc/nsswitch.conf", "/etc/host.conf", "/etc/gai.conf",  # resolving "localhost"
)
"""What every command may read besides its executable, `read_paths`, its HOME, the task directory and /tmp
(also a generated /etc/passwd and /etc/group naming only root and the run's user)."""


@dataclass(frozen=True)
class CommandLimits:
    """Resource limits of one command run (per process unless said otherwise)."""

    max_processes: int = 512
    """Processes and threads of the run's user (RLIMIT_NPROC): a node process has about a dozen threads."""
    max_file_mb: int = 1024
    """Largest file (RLIMIT_FSIZE); the captured output is one too."""
    max_open_files: int = 4096
    memory_mb: int | None = None
    """Address-space limit (RLIMIT_AS); None by default: V8 and the JVM reserve far more than they use."""
    cpu_s: int | None = None
    """CPU seconds per process; None means the wall-clock limit + 1."""
    tmp_mb: int = 1024
    """Size of the private /tmp (memory-backed)."""
    max_output_chars: int = 16384
    """Characters kept from the end of the output."""


@dataclass
class CommandResult:
    exit_code: int
    """The command's exit status; negative: killed by that signal (-9 at the timeout)."""
    output: str
    """The tail of stdout and stderr, interleaved as written."""
    timed_out: bool
    wall_s: float
    truncated: bool
    """Whether the output was longer than `max_output_chars` (its beginning is cut)."""
    layers: dict[str, Any] = field(default_factory=dict)
    """The layers in force: uid, pidns, mountns, netns, landlock (ABI version or False), read_paths (None: reads
    not restricted), rlimits, no_new_privs, subreaper, mounts (the paths mounted)."""
    cancelled: bool = False
    """Stopped from outside (`cancel` was set): killed with its whole tree, `exit_code` -9."""


def run_sandboxed(
    argv: Sequence[str],
    *,
    cwd: str | Path,
    home: str | Path | None = None,
    read_paths: Sequence[str | Path] = (),
    write_paths: Sequence[str | Path] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    network: Network = "loopback",
    ports: Sequence[int] = (),
    weak: bool = False,
    limits: CommandLimits | None = None,
    base_dir: str | None = None,
    mounts: Mapping[str, str | Path] | None = None,
    workdir: str | None = None,
    cancel: threading.Event | None = None,
) -> CommandResult:
    """Run `argv` in the task directory `cwd` under the sandbox described in the module docstring.

    `home`: its HOME (created empty, and removed afterwards, when None). `ports`: loopback ports of the host
    it may connect to (at 127.0.0.1, as on the host). `mounts`: host directories the command sees at other
    paths, `{"/app": task_dir, "/logs": logs_dir}` (a task's own paths; each writable when it is `cwd`, `home` or
    in `write_paths`, else read-only; needs the mount namespace); `workdir`: where it starts, as it sees it
    (default `cwd`). `cancel`: an Event another thread sets to kill the run now. Blocking. Raises ValueError for
    bad arguments and SandboxError when the sandbox cannot be set up or enforced (see `weak`)."""
    limits = limits or CommandLimits()
    task = _checked_dir(cwd, "cwd")
    _check_arguments(argv, network, ports, timeout_s)
    binds = _checked_mounts(mounts or {}, workdir)
    sandbox_id = _sandbox_user(weak)
    with ExitStack() as stack:
        control = stack.enter_context(_temp_dir("turnrl-cmd-ctl-", None))
        home_dir = _checked_dir(home, "home") if home is not None else stack.enter_context(_temp_dir("turnrl-home-",
                                                                                                     base_dir))
        writable = [task, home_dir, *(_checked_dir(p, "write_paths") for p in write_paths)]
        if sandbox_id is not None:
            stack.enter_context(_owned_by(writable, sandbox_id))
        full_env = _command_env(home_dir, env)
        executable = shutil.which(argv[0], path=full_env["PATH"])
        readable = [*map(str, read_paths), *(s for s in binds.values() if Path(s) not in writable)]
        config = {
            "mode": "command", "argv": list(argv), "env": full_env, "cwd": workdir or str(task), "home": str(home_dir),
            "uid": sandbox_id, "strict": not weak, "timeout_s": timeout_s, "tmp_mb": limits.tmp_mb,
            "reads": [*COMMAND_READ_PATHS, *readable, *([os.path.realpath(executable)] if executable else [])],
            "writes": [*map(str, writable), "/dev/null"],
            "network": network, "ports": list(ports), "mounts": binds, "scratch": _scratch(control, binds),
            "identity": _identity_files(control, sandbox_id, home_dir) if sandbox_id is not None else {},
            "rlimits": _rlimits(limits, timeout_s),
        }
        how = Launch(sys.executable, str(control), str(control), {"PATH": full_env["PATH"]}, timeout_s, sandbox_id,
                     merge_output=True, cancel=cancel)
        run = launch(config, how)
        output, truncated = read_tail(Path(control, "output"), limits.max_output_chars)
    if run.cancelled:
        return CommandResult(-9, output, False, run.wall_s, truncated, run.report.get("layers", {}), cancelled=True)
    return _result(run.report, run.returncode, run.backstop_fired, run.wall_s, output, truncated, argv, weak)


_SYSTEM_TOPS = frozenset({"bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin", "sys",
                          "tmp", "usr", "var"})
"""Top-level directories a mount may not replace: the command needs them as they are."""


def _checked_mounts(mounts: Mapping[str, str | Path], workdir: str | None) -> dict[str, str]:
    """{path inside: resolved host directory}, each path absolute, outside the system directories and not
    beneath another; `workdir` must be one of them or beneath one."""
    binds: dict[str, str] = {}
    for inside, source in mounts.items():
        path = os.path.normpath(inside) if isinstance(inside, str) else ""
        if not path.startswith("/") or path == "/" or path.strip("/").split("/")[0] in _SYSTEM_TOPS:
            raise ValueError(f"mounts: {inside!r} must be an absolute path outside {sorted(_SYSTEM_TOPS)} (a task's own "
                             "directory such as /app, /logs, /tests)")
        binds[path] = str(_checked_dir(source, f"mounts[{inside!r}]"))
    nested = [(a, b) for a in binds for b in binds if a != b and b.startswith(a + "/")]
    if nested:
        raise ValueError(f"mounts: {nested[0][1]!r} is beneath {nested[0][0]!r}; mount directories side by side")
    if workdir is not None and not any(workdir == p or workdir.startswith(p + "/") for p in binds):
        raise ValueError(f"workdir: {workdir!r} is none of the mounted paths {sorted(binds)} nor beneath one")
    return binds


def _scratch(control: Path, binds: dict[str, str]) -> str | None:
    """The directory that becomes the run's root when it has mounts (inside the control directory)."""
    if not binds:
        return None
    path = Path(control, "root")
    path.mkdir()
    return str(path)


def _sandbox_user(weak: bool) -> int | None:
    sandbox_id = pick_sandbox_id()
    if sandbox_id is None and not weak:
        raise SandboxError(
            "the command sandbox runs the command as its own user, which needs turnrl to run as root on Linux "
            f"(running as uid {os.geteuid()} on {sys.platform}); set `sandbox: weak` (weak=True) to run it as "
            "this user with the other layers"
        )
    return sandbox_id


@contextmanager
def _temp_dir(prefix: str, base_dir: str | None) -> Iterator[Path]:
    """A fresh directory only its creator can enter (mode 0700), removed with everything in it afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir=base_dir, ignore_cleanup_errors=True) as path:
        yield Path(path)


def _rlimits(limits: CommandLimits, timeout_s: float) -> dict[str, list[int]]:
    mb, cpu = 1024 * 1024, limits.cpu_s or int(timeout_s) + 1
    return {
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_FSIZE": [limits.max_file_mb * mb] * 2,
        "RLIMIT_NOFILE": [limits.max_open_files] * 2,
        "RLIMIT_NPROC": [nproc_limit(limits.max_processes)] * 2,
        "RLIMIT_CORE": [0, 0],
        **({"RLIMIT_AS": [limits.memory_mb * mb] * 2} if limits.memory_mb else {}),
    }


def _check_arguments(argv: Sequence[str], network: str, ports: Sequence[int], timeout_s: float) -> None:
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv: expected a non-empty list of strings (the program and its arguments), got {argv!r}")
    if network not in ("none", "loopback"):
        raise ValueError(f"network: expected 'none' or 'loopback', got {network!r}")
    if any(not isinstance(p, int) or not 0 < p < 65536 for p in ports):
        raise ValueError(f"ports: expected TCP port numbers (1-65535), got {list(ports)!r}")
    if ports and network != "loopback":
        raise ValueError("ports: loopback ports can only be reached with network='loopback'")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")


def _checked_dir(path: str | Path, name: str) -> Path:
    """An existing directory of the run's own: not one every program shares (/, /tmp, /home...)."""
    resolved = Path(path).resolve()
    if not resolved.is_dir():
        raise ValueError(f"{name}: {str(path)!r} is not an existing directory")
    if str(resolved) in _SHARED_DIRS:
        raise ValueError(f"{name}: {str(resolved)!r} is shared with every other program; give the run a directory "
                         "of its own (e.g. a fresh one beneath it)")
    return resolved


_SHARED_DIRS = frozenset({"/", "/tmp", "/var/tmp", "/run", "/dev/shm", "/home", "/root", "/etc", "/usr", "/var"})


def _command_env(home: Path, env: dict[str, str] | None) -> dict[str, str]:
    base = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "USER": "agent",
        "LOGNAME": "agent",
        "SHELL": "/bin/sh",
    }
    return {**base, **(env or {})}


def _identity_files(control: Path, uid: int, home: Path) -> dict[str, str]:
    """/etc/passwd and /etc/group for the run: root and the run's user `agent` (so `whoami`, `id`, git and
    node's os.userInfo() work), bound over the host's, which stay unreadable."""
    files = {
        "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\nagent:x:{uid}:{uid}:turnrl sandbox:{home}:/bin/sh\n",
        "group": f"root:x:0:\nagent:x:{uid}:\n",
    }
    out = {}
    for name, text in files.items():
        path = Path(control, name)
        path.write_text(text)
        path.chmod(0o644)
        out[name] = str(path)
    return out


@contextmanager
def _owned_by(paths: list[Path], uid: int) -> Iterator[None]:
    """Give the run's user the directories it writes (recursively), and give them back to their owners
    afterwards, whatever happened, including what the run created there. Symlinks are never followed."""
    owners = [(path, path.stat().st_uid, path.stat().st_gid) for path in paths]
    try:
        for path, _, _ in owners:
            _chown_tree(path, uid, uid)
        yield
    finally:
        for path, owner, group in owners:
            _chown_tree(path, owner, group)


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid, follow_symlinks=False)
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            with contextlib.suppress(FileNotFoundError):  # removed while we walked
                os.chown(os.path.join(folder, name), uid, gid, follow_symlinks=False)


def read_tail(path: Path, limit: int) -> tuple[str, bool]:
    """The last `limit` characters of the file, after a note saying how much was cut when it is longer."""
    if not path.exists():
        return "", False
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(size - 4 * limit, 0))  # bytes that surely hold `limit` characters of UTF-8
        text = f.read().decode(errors="replace")
    if len(text) <= limit and size <= 4 * limit:
        return text, False
    return f"...[output truncated: {size} bytes in total; the last {limit} characters follow]...\n" + text[-limit:], True


def _result(report: dict[str, Any], returncode: int, backstop_fired: bool, wall_s: float, output: str,
            truncated: bool, argv: Sequence[str], weak: bool) -> CommandResult:
    if "setup_error" in report or "layers" not in report:
        detail = report.get("setup_error") or output[-2000:] or f"exit status {returncode}"
        raise SandboxError(f"the command sandbox could not be set up for {argv[0]!r}: {detail}")
    layers = report["layers"]
    if weak:
        missing = [name for name in ("uid", "pidns", "mountns", "netns", "landlock") if layers.get(name) in (None, False)]
        if missing:
            log.warning("sandbox (weak): %r ran without %s", argv[0], ", ".join(missing))
    timed_out = backstop_fired or bool(report.get("timed_out"))
    exit_code = -9 if timed_out else report.get("command_exit", report.get("exit_code", returncode))
    return CommandResult(exit_code, output, timed_out, wall_s, truncated, layers)


# ---- `turnrl doctor --sandbox` ----------------------------------------------------------------------------


def doctor_rows() -> list[tuple[str, str]]:
    """Each layer's state on this machine, as (layer, state) rows: the kernel's features, then what a real run
    of each sandbox got (both are started once, which takes about a second)."""
    from turnrl.tools._sandbox_kernel import landlock_abi
    from turnrl.tools.sandbox import SandboxLimits, run_python_sandboxed, unrestricted_reads_note

    abi, system = landlock_abi(), os.uname()
    landlock = "absent: reads are NOT restricted (Linux 5.13+ with landlock in the kernel's lsm= list)"
    if abi:
        landlock = (f"ABI {abi}: reads and writes by allow-list" + (", TCP bind/connect" if abi >= 4 else "")
                    + (", signals and abstract Unix sockets scoped to the run" if abi >= 6 else ""))
    rows = [
        ("kernel", f"{system.sysname} {system.release} {system.machine}"),
        ("user", "root: each run gets a fresh uid" if os.geteuid() == 0 else
         f"uid {os.geteuid()}: no separate uid (commands need `sandbox: weak`)"),
        ("landlock", landlock),
        ("user namespaces", _userns_state()),
    ]
    tool = run_python_sandboxed("pass", SandboxLimits(timeout_s=30)).layers
    rows += [
        ("python tool: network namespace", _yes(tool["netns"], "Landlock refuses TCP, the audit hook sockets")),
        ("python tool: uid", f"{tool['uid']} (a fresh one each run)" if tool["uid"] is not None
         else "the parent's (no privilege drop)"),
        ("python tool: reach", {"mounts": "mount namespace (no capability kept)", None: "nothing to reach",
                                "capability": "CAP_DAC_READ_SEARCH, confined by Landlock"}[tool.get("reach")]),
        ("python tool: seccomp exec filter", _yes(tool["no_exec"], "programs can start below the audit hook")),
        ("python tool: reads", "\n".join(["only beneath:", *tool["read_paths"]]) if tool["read_paths"] is not None
         else unrestricted_reads_note(tool)),
        ("without landlock", unrestricted_reads_note(
            {"read_anywhere": tool.get("reach") == "capability" or (tool["uid"] is None and os.geteuid() == 0),
             "reach": tool.get("reach")})),
    ]
    return rows + _command_rows()


def _command_rows() -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="turnrl-doctor-") as task:
        shadow = "cat /etc/shadow >/dev/null 2>&1 && echo READ || echo denied"
        result = run_sandboxed(["/bin/sh", "-c", shadow], cwd=task, timeout_s=30, network="none", weak=True)
    layers = result.layers
    missing = [name for name in ("uid", "pidns", "mountns", "netns", "landlock") if layers.get(name) in (None, False)]
    return [
        ("command: namespaces", ", ".join(f"{n} {_yes(layers.get(n), 'no')}" for n in ("pidns", "mountns", "netns"))),
        ("command: /etc/shadow", result.output.strip()),
        ("command: strict policy", "enforced" if not missing else f"refused here (no {', no '.join(missing)}): "
                                                                   "only `sandbox: weak` runs commands"),
    ]


def _yes(value: Any, otherwise: str) -> str:
    return "yes" if value else f"no ({otherwise})"


def _userns_state() -> str:
    knobs = {"max_user_namespaces": "/proc/sys/user/max_user_namespaces",
             "unprivileged_userns_clone": "/proc/sys/kernel/unprivileged_userns_clone",
             "apparmor_restrict_unprivileged_userns": "/proc/sys/kernel/apparmor_restrict_unprivileged_userns"}
    found = {name: Path(path).read_text().strip() for name, path in knobs.items() if Path(path).exists()}
    return ", ".join(f"{name}={value}" for name, value in found.items()) or "unknown"
