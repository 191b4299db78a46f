"""The command sandbox harness agents run in (turnrl.agents.sandbox): real shell scripts and node programs,
run as root like CI. Each run takes well under a second, except the timeout tests."""

from __future__ import annotations

import http.server
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from turnrl.agents import sandbox as command_sandbox
from turnrl.agents.sandbox import CommandLimits, run_sandboxed
from turnrl.tools._sandbox_kernel import landlock_abi
from turnrl.tools.sandbox import SandboxError

IS_ROOT = os.geteuid() == 0
NODE = shutil.which("node")
pytestmark = [
    pytest.mark.skipif(not IS_ROOT, reason="the command sandbox runs commands as their own user: it needs root"),
    pytest.mark.skipif(not landlock_abi(), reason="the kernel has no Landlock"),
]
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed")


@pytest.fixture()
def task() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="turnrl-task-"))
    (path / "README.md").write_text("fix the bug in main.py\n")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def other_home() -> Iterator[Path]:
    """Another user's home in /home (outside /tmp, which the run replaces with its own), world-readable as most
    are: only Landlock keeps it out of reach."""
    home = Path(tempfile.mkdtemp(prefix="turnrl-test-user-", dir="/home" if os.path.isdir("/home") else "/var/tmp"))
    (home / ".netrc").write_text("machine example.com login me password hunter2\n")
    home.chmod(0o755)
    (home / ".netrc").chmod(0o644)
    os.chown(home, 4242, 4242)
    os.chown(home / ".netrc", 4242, 4242)
    yield home
    shutil.rmtree(home, ignore_errors=True)


def processes_of_uid(uid: int) -> list[str]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nUid:\t{uid}\t" in text and "State:\tZ" not in text:
            found.append(status.parent.name)
    return found


def test_an_agent_that_cats_etc_shadow_gets_a_permission_error(task, other_home):
    script = f"""
cat /etc/shadow
ls /root
cat {other_home}/.netrc
ls /home
echo fixed > main.py && cat main.py
echo escaped > {other_home}/planted || echo 'write refused'
echo escaped > /etc/planted || echo 'write refused'
"""
    result = run_sandboxed(["/bin/sh", "-c", script], cwd=task, timeout_s=20)
    lines = result.output.splitlines()
    assert "cat: /etc/shadow: Permission denied" in lines
    assert "ls: cannot open directory '/root': Permission denied" in lines
    assert f"cat: {other_home}/.netrc: Permission denied" in lines
    assert "ls: cannot open directory '/home': Permission denied" in lines
    assert "fixed" in lines and lines.count("write refused") == 2
    assert "hunter2" not in result.output and "root:" not in result.output
    assert not (other_home / "planted").exists() and not Path("/etc/planted").exists()
    assert (task / "main.py").read_text() == "fixed\n"
    layers = result.layers
    assert layers["uid"] >= 100_000 and layers["landlock"] >= 1 and layers["pidns"] and layers["netns"]


def test_runs_as_its_own_user_sees_only_its_processes_and_gets_only_the_given_environment(task, monkeypatch):
    monkeypatch.setenv("TURNRL_SECRET_TOKEN", "hunter2")
    script = "id -u; whoami; ps -e -o pid= | wc -l; env | sort; echo $TURNRL_SECRET_TOKEN"
    result = run_sandboxed(["/bin/sh", "-c", script], cwd=task, env={"TASK_ID": "t-1"}, timeout_s=20)
    uid, user, process_count, *env = result.output.split()
    assert int(uid) == result.layers["uid"] and user == "agent"
    assert int(process_count) <= 5  # init, the shell, ps, wc: nothing of the host's
    assert sorted(name.split("=")[0] for name in env) == ["HOME", "LANG", "LOGNAME", "PATH", "PWD", "SHELL", "TASK_ID",
                                                         "TMPDIR", "USER"]
    assert "hunter2" not in result.output


def test_writes_its_task_dir_home_and_private_tmp_and_gives_ownership_back(task):
    home = Path(tempfile.mkdtemp(prefix="turnrl-home-"))
    try:
        script = "mkdir -p src && echo x > src/new.py && echo y > $HOME/.config && echo z > /tmp/scratch && cat /tmp/scratch"
        result = run_sandboxed(["/bin/sh", "-c", script], cwd=task, home=home, timeout_s=20)
        assert result.output == "z\n" and result.exit_code == 0
        assert (task / "src/new.py").read_text() == "x\n" and (home / ".config").read_text() == "y\n"
        assert all(p.stat().st_uid == 0 for p in [task, *task.rglob("*"), home, *home.rglob("*")])
        assert not Path("/tmp/scratch").exists()  # the run's /tmp was its own
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_home_made_for_the_run_is_removed(task):
    result = run_sandboxed(["/bin/sh", "-c", "echo $HOME; touch $HOME/.state"], cwd=task, timeout_s=20)
    assert result.output.startswith("/") and not Path(result.output.strip()).exists()


@pytest.fixture()
def endpoint() -> Iterator[tuple[int, int]]:
    """Two HTTP servers on the host's loopback: turnrl's endpoint (reachable) and another port (not)."""

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"endpoint says hi")

        def log_message(self, *args: object) -> None:
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield servers[0].server_address[1], servers[1].server_address[1]
    for server in servers:
        server.shutdown()
        server.server_close()


FETCH_JS = """
const tries = [['endpoint', 'http://127.0.0.1:%d/'], ['other-port', 'http://127.0.0.1:%d/'],
               ['internet', 'http://1.1.1.1/'], ['dns', 'http://example.com/']];
(async () => {
  for (const [name, url] of tries) {
    try {
      const response = await fetch(url, {signal: AbortSignal.timeout(3000)});
      console.log(name, 'reached', await response.text());
    } catch (e) {
      console.log(name, 'refused', (e.cause && e.cause.code) || e.name);
    }
  }
})();
"""


@needs_node
def test_a_node_program_reaches_the_endpoint_and_nothing_else(task, endpoint):
    port, other = endpoint
    result = run_sandboxed(["node", "-e", FETCH_JS % (port, other)], cwd=task, ports=[port], timeout_s=30)
    assert result.output.splitlines() == [
        "endpoint reached endpoint says hi",
        "other-port refused ECONNREFUSED",
        "internet refused ENETUNREACH",
        "dns refused EAI_AGAIN",
    ], result.output


@needs_node
def test_network_none_reaches_not_even_the_endpoint(task, endpoint):
    port, other = endpoint
    result = run_sandboxed(["node", "-e", FETCH_JS % (port, other)], cwd=task, network="none", timeout_s=30)
    assert [line.split()[1] for line in result.output.splitlines()] == ["refused"] * 4, result.output


@needs_node
def test_a_node_program_reads_its_task_but_not_secrets(task):
    js = """
const fs = require('fs');
console.log(fs.readFileSync('README.md', 'utf8').trim());
for (const p of ['/etc/shadow', '/root/.bashrc', '/proc/1/environ']) {
  try { fs.readFileSync(p); console.log(p, 'READ'); } catch (e) { console.log(p, e.code); }
}
console.log(require('os').userInfo().username, process.pid);
"""
    result = run_sandboxed(["node", "-e", js], cwd=task, timeout_s=30)
    lines = result.output.splitlines()
    assert lines[0] == "fix the bug in main.py"
    assert lines[1] == "/etc/shadow EACCES"
    assert lines[2] in ("/root/.bashrc EACCES", "/root/.bashrc ENOENT")  # ENOENT where /root is covered
    assert lines[3] == "/proc/1/environ EACCES"  # its own init's, in its own /proc: still refused
    assert lines[4] == "agent 2"  # the command is PID 2 of its namespace, after the sandbox's init


def test_the_timeout_kills_the_whole_tree_and_leaves_no_process(task):
    script = ("sleep 100 & setsid sleep 100 & (trap '' TERM HUP; nohup sleep 100 >/dev/null 2>&1 &); "
              "echo started; while true; do :; done")
    start = time.monotonic()
    result = run_sandboxed(["/bin/sh", "-c", script], cwd=task, timeout_s=1.5)
    assert time.monotonic() - start < 5
    assert result.timed_out and result.exit_code == -9 and result.output == "started\n"
    assert processes_of_uid(result.layers["uid"]) == []


@needs_node
def test_a_node_program_and_its_detached_children_are_killed_at_the_limit(task):
    js = "require('child_process').spawn('sleep', ['100'], {detached: true}); setInterval(() => {}, 1000);"
    result = run_sandboxed(["node", "-e", js], cwd=task, timeout_s=1.5)
    assert result.timed_out and processes_of_uid(result.layers["uid"]) == []


def test_background_processes_die_when_the_command_ends(task):
    result = run_sandboxed(["/bin/sh", "-c", "setsid sleep 100 & echo done"], cwd=task, timeout_s=20)
    assert result.output == "done\n" and not result.timed_out and result.exit_code == 0
    assert processes_of_uid(result.layers["uid"]) == []


def test_exit_codes_and_a_missing_program(task):
    assert run_sandboxed(["/bin/sh", "-c", "exit 3"], cwd=task, timeout_s=20).exit_code == 3
    assert run_sandboxed(["/bin/sh", "-c", "kill -9 $$"], cwd=task, timeout_s=20).exit_code == -9
    missing = run_sandboxed(["no-such-cli", "--help"], cwd=task, timeout_s=20)
    assert missing.exit_code == 127 and "sandbox: cannot start 'no-such-cli'" in missing.output


def test_output_keeps_its_tail(task):
    limits = CommandLimits(max_output_chars=100)
    result = run_sandboxed(["/bin/sh", "-c", "seq 1 100000"], cwd=task, timeout_s=20, limits=limits)
    assert result.truncated and result.output.endswith("99999\n100000\n")
    assert result.output.startswith("...[output truncated: 588895 bytes in total")


def test_refused_without_its_own_user_unless_weak(task, monkeypatch):
    """As a non-root user (simulated: no uid to switch to) the strict sandbox refuses; `weak` runs anyway, and
    Landlock still keeps /etc/shadow out of reach, even of root."""
    monkeypatch.setattr(command_sandbox, "pick_sandbox_id", lambda: None)
    with pytest.raises(SandboxError, match=r"needs turnrl to run as root .* set `sandbox: weak`"):
        run_sandboxed(["/bin/sh", "-c", "true"], cwd=task, timeout_s=20)
    result = run_sandboxed(["/bin/sh", "-c", "id -u; cat /etc/shadow"], cwd=task, timeout_s=20, weak=True)
    assert result.output.splitlines() == ["0", "cat: /etc/shadow: Permission denied"]
    assert result.layers["uid"] is None and result.layers["landlock"] >= 1


def test_a_machine_that_cannot_enforce_it_is_named_and_weak_runs_anyway(task, host_refusing_namespaces):
    with pytest.raises(SandboxError, match="cannot enforce the command sandbox: no pidns, no mountns, no netns"):
        run_sandboxed(["/bin/sh", "-c", "true"], cwd=task, timeout_s=20)
    result = run_sandboxed(["/bin/sh", "-c", "cat /etc/shadow; echo $TMPDIR"], cwd=task, timeout_s=20, weak=True)
    assert result.output.splitlines()[0] == "cat: /etc/shadow: Permission denied"
    assert result.output.splitlines()[1].endswith("/.tmp")  # no private /tmp: temporary files go to HOME
    assert not result.layers["netns"] and result.layers["landlock"] >= 1


def test_mounts_show_host_directories_at_a_tasks_own_paths_and_make_nothing_on_the_host(task, tmp_path):
    """A Harbor task's paths (/app, /logs, /tests) exist only in the run: the task dir and the logs are writable,
    the tests read-only, and the host's / gains no directory."""
    logs, tests = tmp_path / "logs", tmp_path / "tests"
    logs.mkdir()
    tests.mkdir()
    (tests / "test.sh").write_text("pwd; cat /app/README.md; mkdir /logs/verifier && echo 1 > /logs/verifier/reward.txt\n"
                                   "touch /tests/new 2>/dev/null || echo tests-read-only; touch /nowhere 2>/dev/null || echo root-read-only\n")
    result = run_sandboxed(["/bin/sh", "/tests/test.sh"], cwd=task, write_paths=[logs], timeout_s=20,
                           mounts={"/app": task, "/logs": logs, "/tests": tests}, workdir="/app")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["/app", "fix the bug in main.py", "tests-read-only", "root-read-only"]
    assert (logs / "verifier" / "reward.txt").read_text() == "1\n"
    assert (logs / "verifier").stat().st_uid == os.geteuid()  # given back to its owner
    assert result.layers["mounts"] == ["/app", "/logs", "/tests"]
    assert not any(os.path.exists(p) for p in ("/app", "/logs", "/tests"))


def test_a_cancelled_run_is_killed_at_once_with_its_tree(task):
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    start = time.monotonic()
    result = run_sandboxed(["/bin/sh", "-c", "setsid sleep 100 & sleep 100"], cwd=task, timeout_s=60, cancel=cancel)
    assert time.monotonic() - start < 5
    assert result.cancelled and result.exit_code == -9 and not result.timed_out
    assert processes_of_uid(result.layers["uid"]) == []  # the layers came before the cancel


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mounts": {"/usr/local": "."}}, r"mounts: '/usr/local' must be an absolute path outside"),
    ({"mounts": {"app": "."}}, r"mounts: 'app' must be an absolute path"),
    ({"mounts": {"/app": "/no/such"}}, r"mounts\['/app'\]: '/no/such' is not an existing directory"),
    ({"mounts": {"/logs": ".", "/logs/verifier": "."}}, "mounts: '/logs/verifier' is beneath '/logs'"),
    ({"mounts": {"/app": "."}, "workdir": "/srv"}, r"workdir: '/srv' is none of the mounted paths \['/app'\]"),
    ({"argv": "ls -la"}, "argv: expected a non-empty list of strings"),
    ({"argv": []}, "argv: expected a non-empty list of strings"),
    ({"cwd": "/no/such/task"}, "cwd: '/no/such/task' is not an existing directory"),
    ({"cwd": "/tmp"}, "cwd: '/tmp' is shared with every other program; give the run a directory of its own"),
    ({"write_paths": ["/home"]}, "write_paths: '/home' is shared with every other program"),
    ({"network": "internet"}, "network: expected 'none' or 'loopback', got 'internet'"),
    ({"ports": [70000]}, r"ports: expected TCP port numbers \(1-65535\)"),
    ({"ports": [8000], "network": "none"}, "ports: loopback ports can only be reached with network='loopback'"),
    ({"timeout_s": 0}, "timeout_s: expected a positive number of seconds"),
])
def test_bad_arguments_are_named(task, kwargs, message):
    arguments = {"argv": ["true"], "cwd": task, **kwargs}
    with pytest.raises(ValueError, match=message):
        run_sandboxed(arguments.pop("argv"), **arguments)


def test_doctor_prints_each_layer_and_the_allow_list():
    from typer.testing import CliRunner

    from turnrl.cli import app

    result = CliRunner().invoke(app, ["doctor", "--sandbox"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"landlock: ABI {landlock_abi()}: reads and writes by allow-list" in lines[2]
    assert "python tool: network namespace: yes" in lines
    assert "python tool: seccomp exec filter: yes" in lines
    assert "python tool: reads: only beneath:" in lines and "    /usr/lib" in lines and "    /etc/shadow" not in lines
    assert any(line.startswith("without landlock: reads are NOT restricted") for line in lines)
    assert lines[-3:] == ["command: namespaces: pidns yes, mountns yes, netns yes", "command: /etc/shadow: denied",
                          "command: strict policy: enforced"]


@pytest.mark.slow
def test_every_escape_attempt_of_the_bench_fails(capsys, monkeypatch):
    """bench/sandbox_escapes.py: 51 attempts against the Python tool, 39 against a command (about a minute)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / "sandbox_escapes.py"
    spec = importlib.util.spec_from_file_location("sandbox_escapes", path)
    assert spec is not None and spec.loader is not None
    escapes = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sandbox_escapes", escapes)  # dataclasses look their module up there
    spec.loader.exec_module(escapes)
    status = escapes.main([])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "ESCAPED" not in out
    assert "python: " in out and "reads outside the allow-list: 0" in out.splitlines()[-1]
