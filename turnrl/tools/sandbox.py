"""A sandboxed Python interpreter for tools, and the launcher that the command sandbox (turnrl.agents.sandbox)
shares with it.

`python_exec` (or `make_python_tool(...)` for other limits) runs model-written code in a child process.
What protects the host, from strongest to weakest (`SandboxResult.layers` says which were active; `turnrl doctor
--sandbox` prints them for this machine; docs/sandbox.md):

1. Kernel resource limits (`setrlimit`): CPU seconds, address space (memory), file size (also bounds
   the captured stdout/stderr), open files, processes/threads, no core dumps. A supervisor process
   enforces the wall-clock timeout; it is the run's subreaper, so when the code finishes or times out it
   kills and reaps every process the code started (no background process outlives the call, no zombie
   is left). Output is truncated to `max_output_chars`.
2. Network namespace (Linux, `unshare(CLONE_NEWNET)`): the process sees only a loopback interface
   that is down, so no connection of any kind leaves it, even from native code. Needs root (or
   unprivileged user namespaces, tried for non-root users). When unavailable, Landlock (ABI 4+) refuses every
   TCP bind and connect, and layer 6 blocks sockets.
3. Privilege drop (when run as root): the code runs as a fresh random unprivileged uid/gid with no
   supplementary groups, no capabilities and `no_new_privs`. The kernel then refuses writes to files it does
   not own, enforces the process limit (root ignores RLIMIT_NPROC, so a fork bomb is only contained with this
   layer), the code cannot signal its supervisor, and after the run every process of that uid is killed. When
   the Python installation sits beneath a directory other users cannot search (a pyenv under /root), the run
   gets a mount namespace in which that directory is an empty tmpfs holding only the paths it needs, bound back
   in place (`layers["reach"] == "mounts"`). Only where the host refuses mounts does it keep
   CAP_DAC_READ_SEARCH instead (`"capability"`), which Landlock then confines to the allow-list (and seccomp
   refuses `open_by_handle_at`, the one way around paths).
4. Landlock (Linux 5.13+ with Landlock enabled; `layers["landlock"]` is its ABI version, else False): the
   code and everything it starts may open, list or execute only beneath the read allow-list
   (`layers["read_paths"]`): the interpreter (its binary, libpython and standard library, every sys.path entry
   such as site-packages), `SYSTEM_READ_PATHS` (the dynamic loader's cache, shared libraries, locales, time
   zones, /dev/null and the random devices, the CPU topology), `SandboxLimits.read_paths`, and the work dir.
   It may write, create, remove, rename or link only beneath the work dir (and write /dev/null). From ABI 6
   it can neither signal nor reach the abstract Unix sockets of processes outside the run. Without Landlock,
   reads are not restricted, and the first run logs a warning saying what stays readable.
5. An exec filter (seccomp; Linux x86_64 / aarch64; `layers["no_exec"]`): `execve` / `execveat` fail with
   EPERM, so no other program starts by any route (subprocess, os.system, `_posixsubprocess.fork_exec`,
   ctypes `system`, posix_spawn). `allow_subprocess` leaves it off.
6. A fresh temporary work dir (deleted afterwards), HOME/TMPDIR pointing into it, a scrubbed
   environment (no tokens or keys from the parent's env), stdin closed, `python -I` (no PYTHONPATH,
   no user site-packages).
7. A Python audit hook (`sys.addaudithook`): refuses writes, deletes, renames, chmods and links outside
   the work dir, starting other programs (os.system, subprocess, exec*, posix_spawn; `allow_subprocess`
   lifts this), the garbage collector's object walks (they would reach the hook), and, when layer 2 is
   missing, non-Unix sockets, connect/bind/sendto and DNS lookups. Everything it calls is bound when it is
   installed, so code that replaces `builtins.isinstance`, `os.path.abspath`, `os.lstat`... does not change
   its answers. It is still NOT a security boundary; what gets past it and which layer contains it:
   - `_posixsubprocess.fork_exec` and ctypes `system` raise no audit event: layer 5 (without it they run).
   - native code (ctypes, extensions) and `dir_fd=` relative opens write where the hook does not look:
     layer 4, and as root layer 3 (but for world-writable places such as /tmp).
   - ctypes can rewrite the interpreter's memory, the hook included: the same kernel layers.

What this does NOT protect against:
- Metadata: `stat`, `os.path.exists` and `readlink` work on any path (existence, size, owner, times of a file
  outside the allow-list); Landlock governs opening, not looking up.
- Without Landlock: reading world-readable files (other users' homes, logs in /tmp, the host's processes and
  their command lines in /proc), and every file when running as root without layer 3 or when layer 3 had to keep
  CAP_DAC_READ_SEARCH.
- Connecting to a Unix socket by path when its permissions let the sandbox's uid write it (a world-writable
  socket): neither the network namespace nor Landlock (up to ABI 7) covers those.
- Without Landlock: writes into world-writable directories (/tmp, /dev/shm) by native code (such files
  outlive the run), and without layer 3 as well any write native code can make as the parent's user.
- Without layer 5 (or with `allow_subprocess`): programs started below the audit hook.
- Filling the disk with many files that are each under the size limit; a CPU-heavy run slowing its
  neighbours (no cgroups); kernel exploits and side channels.
- Without layer 3 (a non-root parent) and below Landlock ABI 6: code that kills its supervisor (same uid) can
  leave processes running after the call, each still bounded by its CPU limit. Without layer 2 as well (no user
  namespaces): UDP from native code.
For untrusted code at scale, run it inside a container or VM (gVisor, Firecracker, SandboxFusion) and
use these limits on top.
"""

from __future__ import annotations

import contextlib
import grp
import json
import logging
import math
import os
import pwd
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.tools.function_tool import FunctionTool, ToolResult, function_tool

log = logging.getLogger(__name__)


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (a host problem, not the code's)."""


SYSTEM_READ_PATHS: tuple[str, ...] = (
    "/usr/lib", "/usr/lib64", "/usr/local/lib", "/lib", "/lib64",  # shared libraries, the loader, locales
    "/etc/ld.so.cache", "/etc/localtime", "/usr/share/zoneinfo", "/usr/share/locale/locale.alias",
    "/etc/ssl/openssl.cnf", "/etc/ssl/certs",  # what `import ssl` and `hashlib` open
    "/sys/devices/system/cpu",  # os.cpu_count(), BLAS thread pools
    "/dev/null", "/dev/zero", "/dev/random", "/dev/urandom",
)
"""What every sandboxed process may read besides its own installation and directories: found by tracing the
files CPython, numpy, sympy, ssl, sqlite3, zoneinfo and locale open (strace), and the same for node. Nothing
here holds secrets: /etc/shadow, /root, /home, /proc, /tmp and the rest of /etc are outside."""
PROGRAM_PATHS: tuple[str, ...] = ("/usr/local/bin", "/usr/bin", "/bin")
"""Where the programs are: readable (and executable) too when a run may start programs (`allow_subprocess`)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout_s: float = 10.0
    """Wall-clock limit; then every process of the run is killed."""
    cpu_s: int | None = None
    """CPU seconds per process (RLIMIT_CPU); None means ceil(timeout_s) + 1."""
    memory_mb: int = 1024
    """Address-space limit per process (RLIMIT_AS). Allocations beyond it raise MemoryError."""
    max_processes: int = 64
    """Processes and threads of the run (RLIMIT_NPROC; enforced only when the privilege drop is active,
    or for a non-root parent, where it is added to the user's current count)."""
    max_file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE); captured stdout/stderr are files too."""
    max_open_files: int = 256
    max_output_chars: int = 8192
    """Characters kept from each of stdout and stderr (head and tail; the middle is elided)."""
    allow_subprocess: bool = False
    """Let the audit hook allow os.system / subprocess / exec (the kernel limits still apply)."""
    network_namespace: bool = True
    """Isolate the network with a namespace where possible; False leaves only the audit hook's blocking."""
    python: str = sys.executable
    """The interpreter; by default the current one, so installed packages (numpy, sympy) are importable."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the code (the parent's environment is never passed on)."""
    base_dir: str | None = None
    """Where the temporary work dirs are created (default: the system temp dir)."""
    read_paths: tuple[str, ...] = ()
    """Files and directories the code may read besides the interpreter, SYSTEM_READ_PATHS (and PROGRAM_PATHS with
    `allow_subprocess`) and its work dir: data the tool serves, a model's files, other programs' installations."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int
    """The process's exit status; negative: killed by that signal."""
    timed_out: bool
    wall_s: float
    truncated: bool
    """Whether stdout or stderr was cut to `max_output_chars`."""
    layers: dict[str, Any]
    """Which protections were active: rlimits, netns, no_new_privs, subreaper, uid (None: no privilege
    drop), mountns and reach (how the uid reaches an installation beneath a directory it cannot search: "mounts",
    "capability" or None), landlock (ABI version or False), read_paths (the read allow-list; None: reads are not
    restricted), read_anywhere (every file on the host is readable), no_exec, audit_hook, network_hook (sockets
    blocked by the hook: no netns)."""

    def to_text(self, limits: SandboxLimits) -> str:
        """What the model sees: stdout, then stderr under a `[stderr]` line, then a status line."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr.rstrip("\n"))
        status = _status_line(self, limits)
        if status:
            parts.append(status)
        return "\n".join(parts) if parts else "(no output)"


def _status_line(result: SandboxResult, limits: SandboxLimits) -> str:
    if result.timed_out:
        return f"[timed out after {limits.timeout_s:g} s; the process was killed]"
    if result.exit_code >= 0:
        return f"[exit code {result.exit_code}]" if result.exit_code else ""
    sig = -result.exit_code
    reasons: dict[int, str] = {
        signal.SIGXCPU: f": CPU time limit of {_cpu_seconds(limits)} s exceeded",
        signal.SIGXFSZ: f": file size limit of {limits.max_file_mb} MB exceeded",
    }
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    return f"[terminated by {name}{reasons.get(sig, '')}]"


def _cpu_seconds(limits: SandboxLimits) -> int:
    return limits.cpu_s if limits.cpu_s is not None else math.ceil(limits.timeout_s) + 1


def run_python_sandboxed(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python program in a sandbox (see the module docstring for what that means).

    Blocking; `python_exec` runs it in a worker thread. Raises `SandboxError` when the sandbox could not
    be set up; everything the code does (errors, timeouts, limits) is reported in the result.
    """
    limits = limits or SandboxLimits()
    sandbox_id = pick_sandbox_id()
    with (
        tempfile.TemporaryDirectory(prefix="turnrl-sbx-ctl-", ignore_cleanup_errors=True) as control,
        tempfile.TemporaryDirectory(prefix="turnrl-sbx-", dir=limits.base_dir, ignore_cleanup_errors=True) as workdir,
    ):
        if sandbox_id is not None:
            os.chown(workdir, sandbox_id, sandbox_id)
        config = _python_config(code, limits, workdir, sandbox_id)
        run = launch(config, Launch(limits.python, control, workdir, _sandbox_env(workdir, limits),
                                    limits.timeout_s, sandbox_id))
        stdout, out_cut = read_capped(Path(control, "stdout"), limits.max_output_chars)
        stderr, err_cut = read_capped(Path(control, "stderr"), limits.max_output_chars)
    report = run.report
    if "setup_error" in report or "layers" not in report:
        detail = report.get("setup_error") or stderr[-2000:] or f"exit status {run.returncode}"
        raise SandboxError(f"the Python sandbox could not be set up: {detail}")
    _warn_if_reads_unrestricted(report["layers"], limits.python)
    exit_code = report.get("exit_code", run.returncode)
    timed_out = run.backstop_fired or bool(report.get("timed_out"))
    return SandboxResult(stdout, stderr, exit_code, timed_out, run.wall_s, out_cut or err_cut, report["layers"])


_warned: set[str] = set()


def _warn_if_reads_unrestricted(layers: dict[str, Any], python: str) -> None:
    """Once per process and interpreter: say what sandboxed code can read when Landlock is missing."""
    if layers.get("read_paths") is not None or python in _warned:
        return
    _warned.add(python)
    log.warning("sandbox: %s", unrestricted_reads_note(layers))


def unrestricted_reads_note(layers: dict[str, Any]) -> str:
    """What stays readable when reads are not restricted (no Landlock), for warnings and `turnrl doctor`."""
    if layers.get("read_anywhere"):
        why = ("it keeps CAP_DAC_READ_SEARCH to reach the Python installation" if layers.get("reach") == "capability"
               else "it runs as root")
        return ("reads are NOT restricted (the kernel has no Landlock) and " + why + ": sandboxed code can read "
                "EVERY file on this machine (/etc/shadow, /root, SSH keys, tokens in dotfiles)")
    return ("reads are NOT restricted (the kernel has no Landlock): sandboxed code can read every file that other "
            "users may read (world-readable files in /home, /etc and /proc, including other processes' command lines, "
            "and in /tmp unless the run has its own); /etc/shadow and private files stay unreadable")


# ---- launching the supervisor (shared with turnrl.agents.sandbox) ---------------------------------------

_CHILD_PROGRAM = str(Path(__file__).with_name("_sandbox_child.py"))
"""Run by path, not `-m`: under `python -I` (and maybe another interpreter) turnrl need not be importable."""
_BACKSTOP_GRACE_S = 5.0  # the in-sandbox supervisor enforces timeout_s; this catches a dead supervisor


@dataclass(frozen=True)
class Launch:
    """How to start one supervisor (`_sandbox_child.py`)."""

    python: str
    control: str
    """A directory only the parent can read: the config, and stdout/stderr (or one `output` file)."""
    cwd: str
    env: dict[str, str]
    """The supervisor's environment (in mode "python", also the code's)."""
    timeout_s: float
    sandbox_id: int | None
    merge_output: bool = False
    """stdout and stderr into one file, `output` (mode "command"), else `stdout` and `stderr`."""
    cancel: threading.Event | None = None
    """Set from another thread to stop the run at once (its whole tree is killed, as at the timeout)."""


@dataclass
class Launched:
    report: dict[str, Any]
    """What the supervisor and the worker reported: layers, setup_error, exit_code, timed_out, command_exit."""
    returncode: int
    backstop_fired: bool
    wall_s: float
    cancelled: bool = False
    """`Launch.cancel` was set while it ran: the run was killed."""


def launch(config: dict[str, Any], how: Launch) -> Launched:
    """Write `config` for the child program, run it, wait, and clean up after a supervisor that died."""
    report_r, report_w = os.pipe()
    try:
        Path(how.control, "config.json").write_text(json.dumps({**config, "report_fd": report_w}))
        returncode, backstop_fired, wall_s = _spawn_and_wait(how, report_w)
    finally:
        os.close(report_w)
        report = _read_report(report_r)
    if backstop_fired or "exit_code" not in report:  # the supervisor itself died (or was killed): clean up for it
        _kill_leftovers(how.sandbox_id, how.python)
    cancelled = how.cancel is not None and how.cancel.is_set() and "exit_code" not in report
    return Launched(report, returncode, backstop_fired and not cancelled, wall_s, cancelled)


def _spawn_and_wait(how: Launch, report_w: int) -> tuple[int, bool, float]:
    """Start the supervisor and wait for it; SIGKILL its process group if it overstays."""
    argv = [how.python, "-I", "-B", "-u", _CHILD_PROGRAM, str(Path(how.control, "config.json"))]
    start = time.monotonic()
    with contextlib.ExitStack() as files:
        out = files.enter_context(open(Path(how.control, "output" if how.merge_output else "stdout"), "wb"))
        err = out if how.merge_output else files.enter_context(open(Path(how.control, "stderr"), "wb"))
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd=how.cwd,
            env=how.env,
            start_new_session=True,  # its own process group, killed as a whole by the backstop
            pass_fds=(report_w,),
        )
        returncode = _wait_or_cancel(proc, how.timeout_s + _BACKSTOP_GRACE_S, how.cancel)
        backstop_fired = returncode is None
        # Normally the supervisor has already killed everything; this matters when it died early (or was
        # cancelled: killing the supervisor kills the command's PID namespace with it).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait() if returncode is None else returncode, backstop_fired, time.monotonic() - start


def _wait_or_cancel(proc: subprocess.Popen, timeout_s: float, cancel: threading.Event | None) -> int | None:
    """The supervisor's exit status, or None when it overstays `timeout_s` or `cancel` is set first."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            return proc.wait(timeout=max(remaining, 0) if cancel is None else min(max(remaining, 0), 0.1))
        except subprocess.TimeoutExpired:
            if remaining <= 0 or (cancel is not None and cancel.is_set()):
                return None


def _sandbox_env(workdir: str, limits: SandboxLimits) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1",  # BLAS thread pools would count against max_processes and memory
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    return {**env, **limits.env}


def _python_config(code: str, limits: SandboxLimits, workdir: str, sandbox_id: int | None) -> dict[str, Any]:
    mb = 1024 * 1024
    return {
        "mode": "python",
        "code": code,
        "cwd": workdir,
        "timeout_s": limits.timeout_s,
        "uid": sandbox_id,
        "reads": [*SYSTEM_READ_PATHS, *(PROGRAM_PATHS if limits.allow_subprocess else ()), *limits.read_paths],
        "landlock": True,
        "allow_subprocess": limits.allow_subprocess,
        "network_namespace": limits.network_namespace,
        "rlimits": {
            "RLIMIT_CPU": [_cpu_seconds(limits), _cpu_seconds(limits) + 1],
            "RLIMIT_AS": [limits.memory_mb * mb] * 2,
            "RLIMIT_FSIZE": [limits.max_file_mb * mb] * 2,
            "RLIMIT_NOFILE": [limits.max_open_files] * 2,
            "RLIMIT_NPROC": [nproc_limit(limits.max_processes)] * 2,
            "RLIMIT_CORE": [0, 0],
        },
    }


def nproc_limit(max_processes: int) -> int:
    """RLIMIT_NPROC for a run: a non-root parent's limit counts every process of its user, not just the run's."""
    return max_processes + (_user_task_count(os.getuid()) if os.geteuid() != 0 else 0)


_KILL_AS_UID = "import os, sys; u = int(sys.argv[1]); os.setgroups([]); os.setgid(u); os.setuid(u); os.kill(-1, 9)"


def _kill_leftovers(sandbox_id: int | None, python: str) -> None:
    """Kill every process of the run's uid (kill(-1) after setuid(u) reaches exactly uid u's processes,
    also those that left the process group). Only needed when the supervisor could not do it."""
    if sandbox_id is not None:
        subprocess.run(
            [python, "-I", "-S", "-c", _KILL_AS_UID, str(sandbox_id)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={},
            check=False,
            timeout=30,
        )


def _read_report(fd: int) -> dict[str, Any]:
    """Merge the JSON lines the sandbox wrote on the report pipe (layers, exit status, setup errors).
    Non-blocking: a writer that is somehow still alive cannot hang the caller."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    report: dict[str, Any] = {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            message = json.loads(line)
            if isinstance(message, dict):
                report.update(message)
    return report


def read_capped(path: Path, limit: int) -> tuple[str, bool]:
    """The file's text, or its head and tail around a truncation note when longer than `limit` chars."""
    size = path.stat().st_size
    window = 4 * limit  # bytes that surely hold `limit` characters of UTF-8
    half = limit // 2
    with open(path, "rb") as f:
        if size <= 2 * window:
            text = f.read().decode(errors="replace")
            if len(text) <= limit:
                return text, False
            head, tail = text[:half], text[len(text) - half :]
        else:
            head = f.read(window).decode(errors="replace")[:half]
            f.seek(size - window)
            tail = f.read().decode(errors="replace")[-half:]
    note = f"\n...[output truncated: {size} bytes in total; showing the first and last {half} characters]...\n"
    return head + note + tail, True


# ---- host probing ----------------------------------------------------------------------------------

_ID_FLOOR = 100_000  # keep clear of real accounts and container user ranges below it
_ID_CEILING = 2**31 - 2


def pick_sandbox_id() -> int | None:
    """A random unused uid (also used as gid) for one run, or None when not root (no drop possible).

    Drawn from the OS's entropy, not `random`'s seeded state: trainers seed `random` identically in every
    worker, and two concurrent runs must not share a uid."""
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        return None
    spans = _intersect(_id_spans("/proc/self/uid_map"), _id_spans("/proc/self/gid_map"))
    if not spans:
        return None
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    rng = random.SystemRandom()
    for _ in range(20):
        candidate = rng.randrange(lo, hi)
        if not _id_in_use(candidate):
            return candidate
    return None


def _id_spans(path: str) -> list[tuple[int, int]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    spans = []
    for line in lines:
        inside, _outside, count = (int(x) for x in line.split())
        lo, hi = max(inside, _ID_FLOOR), min(inside + count, _ID_CEILING)
        if hi - lo > 1000:
            spans.append((lo, hi))
    return spans


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    spans = [(max(a0, b0), min(a1, b1)) for a0, a1 in a for b0, b1 in b]
    return [(lo, hi) for lo, hi in spans if hi - lo > 1000]


def _id_in_use(candidate: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(candidate)
            return True
        except KeyError:
            pass
    return False


def _user_task_count(uid: int) -> int:
    """Threads of every process of `uid` (what RLIMIT_NPROC counts)."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total



def make_python_tool(
    *,
    name: str = "python_exec",
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    cpu_s: int | None = None,
    max_processes: int = 64,
    max_file_mb: int = 16,
    max_output_chars: int = 8192,
    allow_subprocess: bool = False,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    read_paths: Sequence[str] = (),
) -> FunctionTool:
    """A `FunctionTool` `name(code: str)` running code with these `SandboxLimits`. Its result carries
    metrics exit_code, timed_out, wall_s, truncated. `read_paths` are what the code may read besides the
    interpreter, the system libraries and its work dir."""
    limits = SandboxLimits(
        timeout_s=timeout_s,
        cpu_s=cpu_s,
        memory_mb=memory_mb,
        max_processes=max_processes,
        max_file_mb=max_file_mb,
        max_output_chars=max_output_chars,
        allow_subprocess=allow_subprocess,
        python=python,
        env=dict(env or {}),
        read_paths=tuple(str(p) for p in read_paths),
    )

    def python_exec(code: str) -> ToolResult:
        result = run_python_sandboxed(code, limits)
        metrics = {
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "wall_s": result.wall_s,
            "truncated": result.truncated,
        }
        return ToolResult(text=result.to_text(limits), metrics=metrics)

    python_exec.__doc__ = f"""Run a Python 3 program and return what it prints (stdout, then stderr).

    Each call starts a fresh interpreter in an empty directory: print() the values you need. Limits:
    {timeout_s:g} s wall time, {memory_mb} MB memory, no network.

    Args:
        code: The complete program.
    """
    return function_tool(python_exec, name=name)


python_exec = make_python_tool()
