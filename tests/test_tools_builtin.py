"""Built-in tools: the ast calculator and the sandboxed Python interpreter (real subprocesses)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from turnrl.tools import (
    SandboxLimits,
    ToolResult,
    calculator,
    evaluate_expression,
    make_python_tool,
    python_exec,
    run_python_sandboxed,
)

# ---- calculator ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("2 ** 3 ** 2", "512"),  # right-associative
        ("-2 ** 2", "-4"),  # unary minus binds looser than **
        ("7 // 2 + 7 % 2", "4"),
        ("6 / 3", "2"),  # integral float printed without .0
        ("1 / 4", "0.25"),
        ("0.1 + 0.2", "0.3"),  # 12 significant digits
        ("sqrt(16) + abs(-3) + round(2.6) + min(4, 2) + max(1, 5)", "17"),
        ("floor(2.7) + ceil(2.1)", "5"),
        ("round(pi, 2)", "3.14"),
        ("2 ** 100", "1267650600228229401496703205376"),
        ("  3  ", "3"),
    ],
)
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("1 / 0", "Error: division by zero"),
        ("5 % 0", "Error: division by zero"),
        ("2 ** 10001", "Error: exponent 10001 too large (at most 1000)"),
        ("(10 ** 1000) ** 2", "Error: result too large"),
        ("99 ** 1000", "Error: result too large"),
        ("10.0 ** 400", "Error: result too large"),
        ("sqrt(-1)", "Error: math domain error"),
        ("2 ^ 3", "Error: unsupported operator ^ (use ** for powers)"),
        ("__import__('os')", "Error: unsupported function '__import__'"),
        ("().__class__", "Error: unsupported syntax: Attribute"),
        ("x + 1", "Error: unknown name 'x'"),
        ("'a' * 3", "Error: unsupported literal 'a'"),
        ("1 +", "Error: invalid expression"),
        ("1 < 2", "Error: unsupported syntax: Compare"),
        ("1" * 1001, "Error: expression longer than 1000 characters"),
    ],
)
def test_calculator_errors_are_text_for_the_model(expression, error):
    assert calculator(expression).startswith(error)


def test_calculator_is_a_function_tool_and_evaluate_returns_numbers():
    assert calculator.name == "calculator"
    assert calculator.schema["function"]["parameters"]["required"] == ["expression"]
    assert evaluate_expression("3 * 4") == 12 and isinstance(evaluate_expression("3 * 4"), int)


# ---- sandbox ---------------------------------------------------------------------------------------

FAST = SandboxLimits(timeout_s=5, memory_mb=512, max_processes=16)
IS_ROOT = os.geteuid() == 0


def run(code: str, limits: SandboxLimits = FAST):
    return run_python_sandboxed(code, limits)


def processes_of_uid(uid: int) -> list[str]:
    """Live (non-zombie) processes owned by `uid`."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nUid:\t{uid}\t" in text and "State:\tZ" not in text:
            found.append(status.parent.name)
    return found


def test_runs_code_in_a_fresh_directory_that_is_deleted_afterwards():
    result = run("import os\nprint(os.getcwd())\nopen('f.txt', 'w').write('kept')\nprint(open('f.txt').read())")
    workdir, content = result.stdout.split()
    assert result.exit_code == 0 and not result.timed_out and content == "kept"
    assert Path(workdir).name.startswith("turnrl-sbx-") and not Path(workdir).exists()
    assert result.to_text(FAST) == f"{workdir}\nkept"
    assert result.layers["rlimits"] and result.layers["audit_hook"]


@pytest.mark.skipif(not IS_ROOT, reason="the privilege drop needs root")
def test_as_root_code_runs_as_a_fresh_unprivileged_uid():
    result = run("import os; print(os.getuid(), os.getgid(), os.getgroups())")
    uid = result.layers["uid"]
    assert uid is not None and uid >= 100_000
    assert result.stdout.split() == [str(uid), str(uid), "[]"]


def test_errors_show_a_traceback_of_the_code_only():
    result = run("x = 1\nraise ValueError('bad value')")
    assert result.exit_code == 1
    assert 'File "<code>", line 2, in <module>' in result.stderr
    assert "ValueError: bad value" in result.stderr
    assert "_run" not in result.stderr and "<string>" not in result.stderr
    assert "_sandbox_child" not in result.stderr  # the child program's own frames are cut
    assert result.to_text(FAST).endswith("ValueError: bad value\n[exit code 1]")


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("TURNRL_SECRET_TOKEN", "hunter2")
    result = run("import os; print(os.environ.get('TURNRL_SECRET_TOKEN'), os.environ['HOME'] == os.getcwd())")
    assert result.stdout.split() == ["None", "True"]


NETWORK_CODE = """
import socket
for host in ("127.0.0.1", "8.8.8.8"):
    try:
        socket.create_connection((host, 53), timeout=2).close()
        print(host, "connected")
    except OSError as e:
        print(host, "refused", type(e).__name__)
"""


def test_network_is_refused():
    result = run(NETWORK_CODE)
    assert result.stdout.split("\n")[:2] == [
        f"127.0.0.1 refused {'OSError' if result.layers['netns'] else 'PermissionError'}",
        f"8.8.8.8 refused {'OSError' if result.layers['netns'] else 'PermissionError'}",
    ]
    if IS_ROOT:
        assert result.layers["netns"] and not result.layers["network_hook"]


def test_network_is_refused_by_the_audit_hook_without_a_namespace():
    result = run(NETWORK_CODE, SandboxLimits(timeout_s=5, network_namespace=False))
    assert not result.layers["netns"] and result.layers["network_hook"]
    assert result.stdout.split("\n")[:2] == ["127.0.0.1 refused PermissionError", "8.8.8.8 refused PermissionError"]


def test_writes_outside_the_directory_fail(tmp_path):
    target = tmp_path / "escaped.txt"
    code = f"""
import os
for attempt in (lambda: open({str(target)!r}, 'w'), lambda: os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY),
                lambda: os.remove({str(tmp_path)!r}), lambda: os.symlink('/etc', 'link') or open('link/x', 'w')):
    try:
        attempt()
        print('wrote')
    except PermissionError as e:
        print('refused')
"""
    result = run(code)
    assert result.stdout.split() == ["refused"] * 4
    assert not target.exists() and tmp_path.exists()


@pytest.mark.skipif(not IS_ROOT, reason="the kernel-level write protection comes with the privilege drop")
def test_native_writes_bypassing_the_audit_hook_are_refused_by_the_kernel(tmp_path):
    target = tmp_path / "native.txt"
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.open({str(target).encode()!r}, 0o101, 0o644), ctypes.get_errno())
"""
    result = run(code)
    assert result.stdout.split() in (["-1", "13"], ["-1", "2"])  # EACCES; ENOENT where the run's /tmp is its own
    assert not target.exists()


def test_starting_programs_is_refused():
    result = run("import os, subprocess\nfor f in (lambda: os.system('true'), lambda: subprocess.run(['true'])):\n"
                 "    try:\n        f(); print('ran')\n    except PermissionError:\n        print('refused')")
    assert result.stdout.split() == ["refused", "refused"]


def test_timeout_kills_an_infinite_loop():
    limits = SandboxLimits(timeout_s=1)
    start = time.monotonic()
    result = run("print('started', flush=True)\nwhile True:\n    pass", limits)
    assert time.monotonic() - start < 3
    assert result.timed_out and result.exit_code == -signal.SIGKILL
    assert result.to_text(limits) == "started\n[timed out after 1 s; the process was killed]"


def test_cpu_limit_stops_a_busy_process():
    limits = SandboxLimits(timeout_s=10, cpu_s=1)
    start = time.monotonic()
    result = run("while True:\n    pass", limits)
    assert time.monotonic() - start < 5
    assert not result.timed_out and result.exit_code == -signal.SIGXCPU
    assert "CPU time limit of 1 s exceeded" in result.to_text(limits)


def test_memory_bomb_is_contained():
    result = run("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 * 1024))")
    assert result.exit_code == 1 and result.stderr.rstrip().endswith("MemoryError")


@pytest.mark.skipif(not IS_ROOT, reason="RLIMIT_NPROC is per uid; the exact bound needs the privilege drop")
def test_fork_bomb_is_bounded_and_leaves_no_process_behind():
    code = """
import os, time
forked = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forked += 1
except OSError as e:
    print("refused after", forked, type(e).__name__)
"""
    start = time.monotonic()
    result = run(code)
    assert time.monotonic() - start < 3
    assert result.stdout.split() == ["refused", "after", str(FAST.max_processes - 1), "BlockingIOError"]
    assert processes_of_uid(result.layers["uid"]) == []


def test_endless_fork_bomb_ends_at_the_timeout_and_leaves_no_process_behind():
    limits = SandboxLimits(timeout_s=1, max_processes=16)
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    result = run(code, limits)
    assert time.monotonic() - start < 4
    assert result.timed_out
    if result.layers["uid"] is not None:
        assert processes_of_uid(result.layers["uid"]) == []


def test_escaped_background_process_is_killed():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(os.getpid())"
    result = run(code)
    assert result.exit_code == 0 and not result.timed_out
    if result.layers["uid"] is not None:
        assert processes_of_uid(result.layers["uid"]) == []


def test_output_is_capped_keeping_head_and_tail():
    limits = SandboxLimits(timeout_s=5, max_output_chars=100)
    result = run("print('A' * 60 + 'B' * 100000 + 'C' * 60)", limits)
    assert result.truncated
    assert result.stdout.startswith("A" * 50 + "\n...[output truncated: 100121 bytes in total")
    assert result.stdout.endswith("\n" + "C" * 49 + "\n")  # the last 50 characters: 49 C and print's newline
    assert len(result.stdout) < 200


async def test_python_exec_is_a_function_tool_with_metrics():
    assert python_exec.name == "python_exec"
    assert python_exec.schema["function"]["parameters"]["required"] == ["code"]
    assert "10 s wall time, 1024 MB memory, no network" in python_exec.schema["function"]["description"]
    result = await python_exec.call({"code": "print(6 * 7)"})
    assert isinstance(result, ToolResult) and result.text == "42"
    assert result.metrics["exit_code"] == 0 and result.metrics["timed_out"] is False


async def test_make_python_tool_applies_its_limits():
    tool = make_python_tool(name="py", timeout_s=1, memory_mb=256)
    assert tool.name == "py"
    assert "1 s wall time, 256 MB memory" in tool.schema["function"]["description"]
    result = await tool.call({"code": "x = bytearray(300 * 1024 * 1024)"})
    assert "MemoryError" in result.text and result.metrics["exit_code"] == 1


def test_file_size_limit_applies_to_files_and_output():
    limits = SandboxLimits(timeout_s=5, max_file_mb=1)
    result = run("open('big', 'wb').write(b'x' * 2 * 1024 * 1024)", limits)
    assert result.stderr.rstrip().endswith("OSError: [Errno 27] File too large")
    result = run("while True:\n    print('x' * 100_000)", limits)
    assert result.exit_code == 1 and result.stderr.rstrip().endswith("OSError: [Errno 27] File too large")


# ---- the audit hook's known bypasses, and the kernel layers that contain them ------------------------


def _landlock_abi() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)), 0)


KERNEL = os.uname().sysname == "Linux" and os.uname().machine in ("x86_64", "aarch64")
needs_landlock = pytest.mark.skipif(not KERNEL or not _landlock_abi(), reason="the kernel has no Landlock")


@pytest.fixture()
def world_writable():
    """A directory anyone may write to, like /tmp: the privilege drop does not protect it, Landlock does."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="turnrl-ww-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


EXEC_BYPASSES = {
    # neither raises an audit event: both started /bin/sh before (the marker appeared)
    "_posixsubprocess.fork_exec": """
import _posixsubprocess, os
pid = _posixsubprocess.fork_exec([b'/bin/sh', b'-c', b'echo ran > marker'], [b'/bin/sh'], True, (), None, None,
    -1, -1, -1, -1, -1, -1, *os.pipe(), True, False, 0, None, None, None, -1, None, False)
os.waitpid(pid, 0)
""",
    "ctypes system": "import ctypes\nctypes.CDLL(None).system(b'echo ran > marker')\n",
}


@pytest.mark.skipif(not KERNEL, reason="the exec filter is for Linux x86_64 / aarch64")
@pytest.mark.parametrize("name", list(EXEC_BYPASSES))
def test_programs_started_below_the_audit_hook_do_not_run(name):
    result = run(EXEC_BYPASSES[name] + "import os\nprint('ran' if os.path.exists('marker') else 'did not run')\n")
    assert result.layers["no_exec"] is True
    assert result.stdout.strip() == "did not run", (result.stdout, result.stderr)


@pytest.mark.parametrize("patch", [
    "import builtins\nbuiltins.isinstance = lambda obj, cls: True",  # every path looked like an open fd
    "import os.path\nos.path.abspath = lambda p: os.getcwd() + '/x'",  # every path looked inside the work dir
    "import os\nos.lstat = lambda p: os.stat(os.getcwd())",
    "import os.path\nos.path.realpath = lambda p, **kw: os.getcwd() + '/x'",
])
def test_monkeypatching_cannot_turn_off_the_write_check(world_writable, patch):
    target = world_writable / "escaped.txt"
    result = run(f"{patch}\nopen({str(target)!r}, 'w').write('x')\nprint('wrote')")
    assert "sandbox: writing outside the working directory is not allowed" in result.stderr  # the hook itself
    assert result.stdout == "" and not target.exists()


def test_the_hook_cannot_be_found_through_the_garbage_collector():
    result = run("import gc\ntry:\n    gc.get_objects()\nexcept PermissionError as e:\n    print(e)")
    assert result.stdout.strip() == "sandbox: gc.get_objects is not allowed"


@needs_landlock
def test_writes_that_get_past_the_hook_are_refused_by_landlock(world_writable):
    """Native code, and a `dir_fd=` relative open (the hook sees a name inside the work dir), both wrote into
    world-writable directories before."""
    native, relative = world_writable / "native.txt", world_writable / "relative.txt"
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print(libc.open({str(native).encode()!r}, 0o101, 0o644), ctypes.get_errno())
outside = os.open({str(world_writable)!r}, os.O_RDONLY)
try:
    os.open({relative.name!r}, os.O_CREAT | os.O_WRONLY, dir_fd=outside)
    print('wrote')
except PermissionError as e:
    print(e.errno)
open('inside.txt', 'w').write('fine')  # the work dir stays writable
print(open('inside.txt').read())
"""
    result = run(code, SandboxLimits(timeout_s=5, read_paths=(str(world_writable),)))  # readable, not writable
    assert result.layers["landlock"] >= 1
    assert result.stdout.split() == ["-1", "13", "13", "fine"], result.stderr  # EACCES from the kernel
    assert not native.exists() and not relative.exists()


@needs_landlock
def test_allow_subprocess_starts_programs_that_still_cannot_write_outside(world_writable):
    target = world_writable / "from_shell.txt"
    code = ("import subprocess\n"
            "print(subprocess.run(['echo', 'hi'], capture_output=True, text=True).stdout.strip())\n"
            f"print(subprocess.run(['sh', '-c', 'echo x > {target}']).returncode != 0)\n")
    result = run(code, SandboxLimits(timeout_s=5, allow_subprocess=True))
    assert result.layers["no_exec"] is False
    assert result.stdout.split() == ["hi", "True"] and not target.exists()


# ---- reads by allow-list (issue 29) ------------------------------------------------------------------


@pytest.fixture()
def other_users_home():
    """A home directory of another user, world-readable like most homes: only Landlock keeps it out of reach."""
    import shutil
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="turnrl-home-other-", dir="/tmp"))
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    (home / ".netrc").write_text("machine example.com login me password hunter2\n")
    for path in (home, home / ".ssh", home / ".ssh" / "id_ed25519", home / ".netrc"):
        path.chmod(0o755 if path.is_dir() else 0o644)
        if IS_ROOT:
            os.chown(path, 4242, 4242)
    yield home
    shutil.rmtree(home, ignore_errors=True)


READ_ATTEMPTS = """
import os, sys
def attempt(what, f):
    try:
        f()
        print(what, "READ")
    except OSError as e:
        print(what, "denied", type(e).__name__)
for path in sys.argv[1:] if len(sys.argv) > 1 else TARGETS:
    attempt(path, (lambda p=path: os.listdir(p)) if os.path.isdir(path) else (lambda p=path: open(p, "rb").read(1)))
"""


def read_attempts(targets: list[str], limits: SandboxLimits = FAST) -> dict[str, str]:
    result = run(f"TARGETS = {targets!r}\n" + READ_ATTEMPTS, limits)
    assert result.exit_code == 0, result.stderr
    return dict(line.rsplit(" ", 2)[:2] for line in result.stdout.splitlines())


@needs_landlock
def test_code_cannot_read_secrets_other_homes_or_anything_outside_its_allow_list(other_users_home, world_writable):
    """Before, the sandbox kept CAP_DAC_READ_SEARCH (the interpreter lives under /root here): /etc/shadow came back."""
    (world_writable / "notes.txt").write_text("world-readable, outside the allow-list")
    (world_writable / "notes.txt").chmod(0o644)
    targets = ["/etc/shadow", "/root", str(other_users_home), str(other_users_home / ".ssh/id_ed25519"),
               str(other_users_home / ".netrc"), str(world_writable / "notes.txt"), "/etc/passwd", "/etc/hostname",
               "/proc/1/cmdline", "/proc/1/environ", "/proc/self/environ", "/home", "/var/log", "/usr/bin/env"]
    seen = read_attempts([t for t in targets if os.path.lexists(t)])
    assert seen and all(state == "denied" for state in seen.values()), seen
    layers = run("pass").layers
    assert layers["landlock"] >= 1 and layers["read_paths"] and not layers["read_anywhere"]


@needs_landlock
def test_code_still_imports_numpy_and_the_standard_library_and_reads_its_directory():
    code = """
import json, decimal, sqlite3, ssl, hashlib, zoneinfo, datetime, locale, random, os
import numpy, sympy
open('data.txt', 'w').write('mine')
print(numpy.linalg.inv(numpy.eye(2)).sum(), sympy.factor('x**2 - 1'), open('data.txt').read(), os.listdir('.'),
      zoneinfo.ZoneInfo('Europe/Paris').key, len(os.urandom(8)), os.cpu_count() > 0)
"""
    result = run(code)
    assert result.stdout.split() == ["2.0", "(x", "-", "1)*(x", "+", "1)", "mine", "['data.txt']", "Europe/Paris",
                                     "8", "True"], result.stderr


@needs_landlock
def test_read_paths_are_readable_and_nothing_beside_them(world_writable):
    (world_writable / "allowed").mkdir()
    (world_writable / "allowed" / "table.csv").write_text("a,b\n")
    (world_writable / "beside.csv").write_text("c,d\n")
    for path in world_writable.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    limits = SandboxLimits(timeout_s=5, read_paths=(str(world_writable / "allowed"),))
    seen = read_attempts([str(world_writable / "allowed/table.csv"), str(world_writable / "beside.csv")], limits)
    assert seen == {str(world_writable / "allowed/table.csv"): "READ", str(world_writable / "beside.csv"): "denied"}


@pytest.mark.skipif(not IS_ROOT, reason="the privilege drop needs root")
@needs_landlock
def test_as_root_no_capability_is_kept_even_when_the_interpreter_lives_under_root():
    code = """
import ctypes, struct
header, data = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0)), ctypes.create_string_buffer(24)
assert ctypes.CDLL(None).capget(header, data) == 0
effective, permitted = struct.unpack("6I", data.raw)[:2]
print(effective, permitted)
"""
    result = run(code)
    assert result.stdout.split() == ["0", "0"], result.stderr
    assert result.layers["reach"] in ("mounts", None)


def test_without_landlock_the_first_run_warns_what_stays_readable(monkeypatch, caplog):
    """A kernel without Landlock, simulated: today's behaviour, and a warning naming what code can read."""
    from turnrl.tools import sandbox

    original = sandbox._python_config
    monkeypatch.setattr(sandbox, "_python_config", lambda *a: {**original(*a), "landlock": False})
    monkeypatch.setattr(sandbox, "_warned", set())
    with caplog.at_level("WARNING", logger="turnrl.tools.sandbox"):
        first, second = run("print('ran')"), run("print('ran')")
    assert first.stdout == second.stdout == "ran\n"
    assert first.layers["landlock"] is False and first.layers["read_paths"] is None
    warnings = [r.getMessage() for r in caplog.records if "reads are NOT restricted" in r.getMessage()]
    assert len(warnings) == 1  # once per process
    assert ("every file that other users may read" in warnings[0]) or ("EVERY file on this machine" in warnings[0])
    assert (first.layers["read_anywhere"]) == ("EVERY file" in warnings[0])


@pytest.mark.skipif(not IS_ROOT or not KERNEL, reason="the privilege drop needs root; the filter Linux x86_64/aarch64")
@needs_landlock
def test_where_mounts_are_refused_a_kept_capability_is_confined_to_the_allow_list(host_refusing_namespaces,
                                                                                   other_users_home):
    """A host refusing namespaces (a container's seccomp policy): an interpreter under /root is reached by
    keeping CAP_DAC_READ_SEARCH, which Landlock confines to the allow-list; open_by_handle_at (the way around
    paths that the capability allows) is refused."""
    code = """
import ctypes, os, numpy
libc = ctypes.CDLL(None, use_errno=True)
handle = ctypes.create_string_buffer(136)
ctypes.memmove(handle, (128).to_bytes(4, "little"), 4)
mount_id = ctypes.c_int()
named = libc.name_to_handle_at(-100, b"/etc/shadow", handle, ctypes.byref(mount_id), 0)
opened = libc.open_by_handle_at(os.open(".", os.O_RDONLY), handle, os.O_RDONLY) if named == 0 else -2
print("open_by_handle_at", opened, ctypes.get_errno())
"""
    result = run(code + READ_ATTEMPTS.replace("TARGETS", repr(["/etc/shadow", str(other_users_home / ".netrc")])))
    assert not result.layers["netns"] and not result.layers.get("mountns")
    lines = result.stdout.splitlines()
    assert lines[1:] == ["/etc/shadow denied PermissionError", f"{other_users_home / '.netrc'} denied PermissionError"]
    if result.layers["reach"] == "capability":  # the interpreter is not reachable by others (a pyenv under /root)
        assert lines[0] == "open_by_handle_at -1 1"  # EPERM from the filter
    assert not result.layers["read_anywhere"] and result.layers["read_paths"]


@pytest.mark.skipif(not IS_ROOT, reason="the run's private /tmp needs a mount namespace (root)")
def test_a_world_writable_unix_socket_in_the_hosts_tmp_is_out_of_reach(world_writable):
    """Landlock does not govern connecting to a Unix socket by path: before, a 0777 socket in /tmp was reachable.
    The run's /tmp, /var/tmp, /run and /dev/shm are now its own, empty."""
    import socket

    path = world_writable / "service.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen()
        path.chmod(0o777)
        code = f"import socket\ntry:\n    socket.socket(socket.AF_UNIX).connect({str(path)!r})\n    print('connected')\n" \
               "except OSError as e:\n    print(type(e).__name__)"
        result = run(code)
    assert result.stdout.strip() == "FileNotFoundError", result.stderr


SYSTEM_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else None


@pytest.mark.skipif(not IS_ROOT or SYSTEM_PYTHON is None, reason="needs root to become another user, /usr/bin/python3")
@needs_landlock
def test_a_non_root_parent_gets_reads_by_allow_list_too(world_writable):
    """The child program started by an unprivileged user (nobody, with the system's python): no uid to drop to,
    but Landlock needs no privileges: /etc/shadow's permissions would refuse anyway, /etc/passwd's would not;
    and (ABI 6+) the code cannot signal its supervisor, which runs as the same user."""
    import json
    import subprocess

    from turnrl.tools import sandbox

    for name in ("_sandbox_child.py", "_sandbox_kernel.py"):  # where nobody can read them
        (world_writable / name).write_text(Path(sandbox._CHILD_PROGRAM).with_name(name).read_text())
    work = world_writable / "work"
    work.mkdir()
    os.chown(work, 65534, 65534)
    code = ("import os\nfor p in ['/etc/passwd', '/etc/group', '.']:\n    try:\n        open(p) if p != '.' else "
            "os.listdir(p)\n        print(p, 'READ')\n    except OSError as e:\n        print(p, e.errno)\n"
            "try:\n    os.kill(os.getppid(), 0)\n    print('signal sent')\nexcept OSError as e:\n    print('signal', e.errno)")
    report_r, report_w = os.pipe()
    config = {**sandbox._python_config(code, FAST, str(work), None), "report_fd": report_w}
    (world_writable / "config.json").write_text(json.dumps(config))
    done = subprocess.run([SYSTEM_PYTHON, "-I", "-B", "-u", str(world_writable / "_sandbox_child.py"),
                           str(world_writable / "config.json")], cwd=work, user=65534, group=65534, extra_groups=[],
                          pass_fds=(report_w,), capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin"})
    os.close(report_w)
    with os.fdopen(report_r) as report:
        layers = json.loads(report.readline())["layers"]
    assert layers["uid"] is None and layers["landlock"] >= 1 and layers["read_paths"], done.stderr
    assert done.stdout.split("\n")[:3] == ["/etc/passwd 13", "/etc/group 13", ". READ"], done.stderr
    if layers["landlock"] >= 6:
        assert done.stdout.split("\n")[3] == "signal 1"
