"""Escape attempts against both sandboxes: the Python tool's (`run_python_sandboxed`) and the command sandbox harness
agents run in (`turnrl.agents.sandbox.run_sandboxed`), grouped as read, write, exec, network, process, environment
and /proc. Each attempt is a real program that tries to do the harm and prints `OK ...` when it succeeded or
`NO <error>` when it was refused; some are then checked from the host (a planted file, a process left behind).

Verdicts: blocked (refused), contained (it ran, but its effect stayed inside the run: a private /tmp, a bounded
fork bomb, processes killed at the end), allowed (by design: a command may start programs), ESCAPED (the harm
happened). The host gets bait first: another user's world-readable home in /home, a world-readable file and a
world-writable directory in /tmp, a secret in the environment, a TCP port on loopback, an abstract and a
world-writable pathname Unix socket. Exits 1 if anything escaped or any read outside the allow-list succeeded.

    sudo python bench/sandbox_escapes.py          # as root (as CI): both sandboxes at full strength
    python bench/sandbox_escapes.py --only python # one sandbox
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.agents.sandbox import run_sandboxed
from turnrl.tools.sandbox import SandboxLimits, run_python_sandboxed

SECRET = "turnrl-escape-secret-4f1c"


@dataclass
class Bait:
    home: Path  # another user's home (0755, files 0644 and a 0600 key)
    note: Path  # a world-readable file in the host's /tmp
    drop: Path  # a world-writable directory in the host's /tmp
    port: int  # a TCP listener on the host's 127.0.0.1
    abstract: str  # an abstract Unix socket name
    unix_path: Path  # a world-writable pathname Unix socket in the host's /tmp
    sleeper: subprocess.Popen  # a host process (of uid 4242 as root, else of this user)


@dataclass
class Attempt:
    category: str
    name: str
    python: str | None  # Python code for the tool (prints OK/NO last)
    shell: str | None  # a /bin/sh script for the command sandbox (prints OK/NO last); "node:" prefix: a node script
    read: bool = False  # a read outside the allow-list (counted separately)
    contained: Callable[[Bait, dict[str, Any]], bool] | None = None  # an OK that the host sees contained (layers)


PY = """
import ctypes, os, socket, subprocess, sys, time
def attempt(f):
    try:
        r = f()
        print("OK", repr(r)[:60] if r is not None else "")
    except BaseException as e:
        print("NO", type(e).__name__, getattr(e, "errno", "") or "")
def check(f):
    try:
        r = f()
        print("OK" if r else "NO", r)
    except BaseException as e:
        print("NO", type(e).__name__, getattr(e, "errno", "") or "")
"""
SH = """try() { if out=$(eval "$1" 2>&1); then echo "OK $(echo $out | head -c 60)"; else echo "NO $(echo $out | head -c 100)"; fi; }
"""


def planted(path: str) -> Callable[[Bait, dict[str, Any]], bool]:
    """Contained when the write happened in the run's own view only: nothing at `path` on the host."""
    return lambda bait, _layers: not Path(re.sub(r"\{bait\.(\w+)\}", lambda m: str(getattr(bait, m.group(1))),
                                                     path)).exists()


def no_process_left(_bait: Bait, layers: dict[str, Any]) -> bool:
    return layers.get("uid") is not None and not processes_of_uid(layers["uid"])


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


NODE_NET = "node:" + """
const net = require('net'), dgram = require('dgram');
const [kind, host, port] = process.argv.slice(1);
const done = (ok, what) => { console.log(ok ? 'OK' : 'NO', what); process.exit(0); };
if (kind === 'udp') { const s = dgram.createSocket('udp4');
  s.send('x', +port, host, e => done(!e, e ? e.code : 'sent')); }
else if (kind === 'dns') { require('dns').lookup(host, (e, a) => done(!e, e ? e.code : a)); }
else { const c = net.connect({host, port: +port, path: kind === 'unix' ? host : undefined});
  c.on('connect', () => done(true, 'connected')); c.on('error', e => done(false, e.code));
  setTimeout(() => done(false, 'timeout'), 3000); }
"""

ATTEMPTS: list[Attempt] = [
    # ---- read ----
    Attempt("read", "/etc/shadow", "attempt(lambda: open('/etc/shadow').read(5))", "try 'head -c 5 /etc/shadow'", True),
    Attempt("read", "list /root", "attempt(lambda: os.listdir('/root'))", "try 'ls /root'", True),
    Attempt("read", "/root/.bashrc", "attempt(lambda: open('/root/.bashrc').read(5))", "try 'head -c 5 /root/.bashrc'", True),
    Attempt("read", "another user's ~/.netrc (0644)", "attempt(lambda: open('{bait.home}/.netrc').read())",
            "try 'cat {bait.home}/.netrc'", True),
    Attempt("read", "another user's ssh key (0600)", "attempt(lambda: open('{bait.home}/.ssh/id_ed25519').read())",
            "try 'cat {bait.home}/.ssh/id_ed25519'", True),
    Attempt("read", "list /home", "attempt(lambda: os.listdir('/home'))", "try 'ls /home'", True),
    Attempt("read", "world-readable file in host /tmp", "attempt(lambda: open('{bait.note}').read())",
            "try 'cat {bait.note}'", True),
    Attempt("read", "/etc/hostname (world-readable)", "attempt(lambda: open('/etc/hostname').read())",
            "try 'cat /etc/hostname'", True),
    Attempt("read", "symlink in the work dir to /etc/shadow",
            "os.symlink('/etc/shadow', 'link')\nattempt(lambda: open('link').read(5))",
            "ln -s /etc/shadow link\ntry 'head -c 5 link'", True),
    Attempt("read", "hard link of /etc/shadow into the work dir",
            "attempt(lambda: os.link('/etc/shadow', 'hard') or open('hard').read(5))",
            "try 'ln /etc/shadow hard && head -c 5 hard'", True),
    Attempt("read", "/proc/self/root/etc/shadow", "attempt(lambda: open('/proc/self/root/etc/shadow').read(5))",
            "try 'head -c 5 /proc/self/root/etc/shadow'", True),
    Attempt("read", "native open() of /etc/shadow (ctypes)",
            "libc = ctypes.CDLL(None, use_errno=True)\nfd = libc.open(b'/etc/shadow', 0)\n"
            "print('OK' if fd >= 0 else 'NO', ctypes.get_errno())", None, True),
    Attempt("read", "dir_fd-relative open of shadow",
            "attempt(lambda: os.read(os.open('shadow', os.O_RDONLY, dir_fd=os.open('/etc', os.O_PATH)), 5))",
            None, True),
    Attempt("read", "open_by_handle_at(/etc/shadow)",
            "libc = ctypes.CDLL(None, use_errno=True)\nh = ctypes.create_string_buffer(136)\n"
            "ctypes.memmove(h, (128).to_bytes(4, 'little'), 4)\nm = ctypes.c_int()\n"
            "libc.name_to_handle_at(-100, b'/etc/shadow', h, ctypes.byref(m), 0)\n"
            "fd = libc.open_by_handle_at(os.open('.', os.O_RDONLY), h, 0)\n"
            "print('OK' if fd >= 0 else 'NO', ctypes.get_errno())", None, True),

    # ---- write ----
    Attempt("write", "world-writable dir in host /tmp", "attempt(lambda: open('{bait.drop}/planted', 'w').write('x'))",
            "try 'echo x > {bait.drop}/planted'", contained=planted("{bait.drop}/planted")),
    Attempt("write", "/tmp", "attempt(lambda: open('/tmp/turnrl-planted', 'w').write('x'))",
            "try 'echo x > /tmp/turnrl-planted'", contained=planted("/tmp/turnrl-planted")),
    Attempt("write", "another user's home", "attempt(lambda: open('{bait.home}/planted', 'w').write('x'))",
            "try 'echo x > {bait.home}/planted'"),
    Attempt("write", "/etc/cron.d", "attempt(lambda: open('/etc/cron.d/planted', 'w').write('x'))",
            "try 'echo x > /etc/cron.d/planted'"),
    Attempt("write", "native write into host /tmp (ctypes)",
            "libc = ctypes.CDLL(None, use_errno=True)\nfd = libc.open(b'{bait.drop}/native', 0o101, 0o644)\n"
            "print('OK' if fd >= 0 else 'NO', ctypes.get_errno())", None),
    Attempt("write", "/dev/shm", "attempt(lambda: open('/dev/shm/turnrl-planted', 'w').write('x'))",
            "try 'echo x > /dev/shm/turnrl-planted'", contained=planted("/dev/shm/turnrl-planted")),
    Attempt("write", "rename a work-dir file into host /tmp",
            "open('f', 'w').write('x')\nattempt(lambda: os.rename('f', '{bait.drop}/renamed'))",
            "echo x > f\ntry 'mv f {bait.drop}/renamed'", contained=planted("{bait.drop}/renamed")),
    Attempt("write", "chmod a host file", "attempt(lambda: os.chmod('{bait.note}', 0o777))",
            "try 'chmod 777 {bait.note}'"),
    Attempt("write", "/proc/sys/kernel/hostname", "attempt(lambda: open('/proc/sys/kernel/hostname', 'w').write('x'))",
            "try 'echo x > /proc/sys/kernel/hostname'"),
    # ---- exec ----
    Attempt("exec", "subprocess.run(['id'])", "attempt(lambda: subprocess.run(['id'], check=True))",
            None),
    Attempt("exec", "os.system", "check(lambda: os.system('id') == 0)", None),
    Attempt("exec", "ctypes system()", "check(lambda: ctypes.CDLL(None).system(b'true') == 0)", None),
    Attempt("exec", "_posixsubprocess.fork_exec",
            "import _posixsubprocess\npid = _posixsubprocess.fork_exec([b'/bin/true'], [b'/bin/true'], True, (), None,"
            " None, -1, -1, -1, -1, -1, -1, *os.pipe(), True, False, 0, None, None, None, -1, None, False)\n"
            "print('OK' if os.waitpid(pid, 0)[1] == 0 else 'NO')", None),
    Attempt("exec", "os.execv('/bin/sh')", "attempt(lambda: os.execv('/bin/sh', ['sh', '-c', 'echo OK']))", None),
    Attempt("exec", "a program outside the allow-list (this python)", None,
            f"try '{os.path.realpath(sys.executable)} -c 1'"),
    Attempt("exec", "a setuid-root program (su)", None, "try 'su -c id root </dev/null'"),
    Attempt("exec", "programs of the allow-list (/usr/bin/id)", None, "try 'id -u'",
            contained=lambda _b, _layers: True),  # allowed by design: a coding agent runs programs
    # ---- network ----
    Attempt("network", "TCP to 1.1.1.1:53", "attempt(lambda: socket.create_connection(('1.1.1.1', 53), 3))",
            NODE_NET + " tcp 1.1.1.1 53"),
    Attempt("network", "UDP to 8.8.8.8:53", "attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
            ".sendto(b'x', ('8.8.8.8', 53)))", NODE_NET + " udp 8.8.8.8 53"),
    Attempt("network", "DNS lookup", "attempt(lambda: socket.getaddrinfo('example.com', 80))",
            NODE_NET + " dns example.com 0"),
    Attempt("network", "host loopback port not given", "attempt(lambda: socket.create_connection(('127.0.0.1', "
            "{bait.port}), 3))", NODE_NET + " tcp 127.0.0.1 {bait.port}"),
    Attempt("network", "abstract Unix socket of the host",
            "s = socket.socket(socket.AF_UNIX)\nattempt(lambda: s.connect('\\0{bait.abstract}'))", None),
    Attempt("network", "world-writable Unix socket in host /tmp",
            "s = socket.socket(socket.AF_UNIX)\nattempt(lambda: s.connect('{bait.unix_path}'))",
            NODE_NET + " unix {bait.unix_path} 0"),
    # ---- process ----
    Attempt("process", "kill the supervisor", "attempt(lambda: os.kill(os.getppid(), 9))",
            "kill -9 $PPID 2>/dev/null; sleep 0.2; echo 'NO its init ignores it; the supervisor is not in sight'"),
    Attempt("process", "kill the host's PID 1", "attempt(lambda: os.kill(1, 0) or os.kill(1, 9))", None),
    Attempt("process", "kill every process it may (-1)", "attempt(lambda: os.kill(-1, 9))", "try 'kill -9 -1'",
            contained=lambda bait, _layers: bait.sleeper.poll() is None),  # the host's bait process lives
    Attempt("process", "ptrace the parent",
            "libc = ctypes.CDLL(None, use_errno=True)\nr = libc.ptrace(16, os.getppid(), 0, 0)\n"
            "print('OK' if r == 0 else 'NO', ctypes.get_errno())", None),
    Attempt("process", "setuid(0)", "attempt(lambda: os.setuid(0))", None),
    Attempt("process", "new user namespace, then read /etc/shadow as its root",
            "libc = ctypes.CDLL(None, use_errno=True)\nmade = libc.unshare(0x10000000) == 0\n"
            "attempt(lambda: (made, open('/etc/shadow').read(5)))", "try 'unshare -U -r head -c 5 /etc/shadow'",
            True),
    Attempt("process", "see the host's processes", "attempt(lambda: len(os.listdir('/proc')))",
            "n=$(ls /proc | grep -c '^[0-9]'); [ $n -gt 20 ] && echo OK $n || echo NO only its own $n"),
    Attempt("process", "outlive the run (setsid + sleep)",
            "pid = os.fork()\nif pid == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\nprint('OK', pid)",
            "setsid sleep 60 &\necho OK", contained=no_process_left),
    Attempt("process", "fork bomb", "n = 0\ntry:\n    while n < 100000:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        n += 1\n    print('OK', n)\n"
            "except OSError as e:\n    print('NO bounded after', n)",
            "i=0; while [ $i -lt 3000 ]; do (sleep 30 &) 2>/dev/null || { echo NO bounded after $i; exit; }; "
            "i=$((i+1)); done; echo OK $i"),
    # ---- environment ----
    Attempt("environment", "secret in the environment",
            f"print('OK' if '{SECRET}' in str(os.environ) else 'NO', len(os.environ))",
            f"env | grep -q {SECRET} && echo OK || echo NO"),
    Attempt("environment", "the parent's environment (/proc/PPID/environ)",
            "attempt(lambda: open(f'/proc/{os.getppid()}/environ').read())", "try 'cat /proc/$PPID/environ'", True),
    Attempt("environment", "init's environment (/proc/1/environ)", "attempt(lambda: open('/proc/1/environ').read())",
            "try 'cat /proc/1/environ'", True),
    # ---- /proc ----
    Attempt("/proc", "/proc/1/cmdline", "attempt(lambda: open('/proc/1/cmdline').read())", None, True),
    Attempt("/proc", "/proc/self/mountinfo", "attempt(lambda: open('/proc/self/mountinfo').read())", None, True),
    Attempt("/proc", "/proc/kcore", "attempt(lambda: open('/proc/kcore', 'rb').read(4))",
            "try 'head -c 4 /proc/kcore'", True),
    Attempt("/proc", "/proc/kallsyms addresses", "attempt(lambda: open('/proc/kallsyms').readline())",
            "try 'head -1 /proc/kallsyms | grep -v ^0000000000000000'", True),
    Attempt("/proc", "/sys/class/net", "attempt(lambda: os.listdir('/sys/class/net'))", "try 'ls /sys/class/net'",
            True),
]


# ---- running them ----------------------------------------------------------------------------------------


@contextmanager
def baited_host() -> Iterator[Bait]:
    """Put the bait in place (and take it away afterwards)."""
    with ExitStack() as stack:
        home = Path(tempfile.mkdtemp(prefix="turnrl-escape-user-", dir="/home" if os.path.isdir("/home") else None))
        drop = Path(tempfile.mkdtemp(prefix="turnrl-escape-drop-", dir="/tmp"))
        note = drop.with_suffix(".txt")
        stack.callback(shutil.rmtree, home, True)
        stack.callback(shutil.rmtree, drop, True)
        stack.callback(note.unlink, True)
        (home / ".ssh").mkdir()
        (home / ".ssh/id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
        (home / ".netrc").write_text("machine example.com login me password hunter2\n")
        note.write_text("a note anyone may read\n")
        for path, mode in ((home, 0o755), (home / ".ssh", 0o700), (home / ".ssh/id_ed25519", 0o600),
                           (home / ".netrc", 0o644), (note, 0o644), (drop, 0o1777)):
            path.chmod(mode)
            if path != drop and path != note and os.geteuid() == 0:
                os.chown(path, 4242, 4242)
        listeners = [_listen(socket.AF_INET, ("127.0.0.1", 0)), _listen(socket.AF_UNIX, "\0" + drop.name),
                     _listen(socket.AF_UNIX, str(drop / "bait.sock"))]
        (drop / "bait.sock").chmod(0o777)
        for listener in listeners:
            stack.callback(listener.close)
        os.environ["TURNRL_ESCAPE_SECRET"] = SECRET
        stack.callback(os.environ.pop, "TURNRL_ESCAPE_SECRET", None)
        sleeper = subprocess.Popen(["sleep", "3600"], user=4242 if os.geteuid() == 0 else None)
        stack.callback(sleeper.kill)
        yield Bait(home, note, drop, listeners[0].getsockname()[1], drop.name, drop / "bait.sock", sleeper)


def _listen(family: int, address: Any) -> socket.socket:
    listener = socket.socket(family)
    listener.bind(address)
    listener.listen()

    def accept() -> None:
        while True:
            try:
                listener.accept()[0].close()
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return listener


def run_attempt(attempt: Attempt, sandbox: str, bait: Bait, task: Path) -> tuple[str, str]:
    """(verdict, what the program printed last)."""
    program = attempt.python if sandbox == "python" else attempt.shell
    if program is None:
        return "", ""
    program = re.sub(r"\{bait\.(\w+)\}", lambda m: str(getattr(bait, m.group(1))), program)
    if sandbox == "python":
        result = run_python_sandboxed(PY + program, SandboxLimits(timeout_s=10, max_processes=32))
        out, layers = result.stdout, result.layers
    else:
        argv = ["/bin/sh", "-c", SH + program]
        if program.startswith("node:"):  # the script, then its arguments on the last line
            script, _, args = program[5:].rpartition("\n")
            argv = ["node", "-e", script, *args.split()]
        command = run_sandboxed(argv, cwd=task, timeout_s=15)
        out, layers = command.output, command.layers
    last = (out.strip().splitlines() or [""])[-1]
    return _verdict(attempt, bait, last, layers), last


def _verdict(attempt: Attempt, bait: Bait, last: str, layers: dict[str, Any]) -> str:
    if oct(bait.note.stat().st_mode)[-3:] != "644" or (bait.home / "planted").exists():
        return "ESCAPED"  # checked from the host, whatever the program printed
    if last.startswith("NO"):
        return "blocked"
    if not last:
        return "contained"  # the program ended itself (killed every process it could, its own included)
    if attempt.contained is not None and attempt.contained(bait, layers):
        return "allowed" if attempt.category == "exec" and "allow-list" in attempt.name else "contained"
    return "ESCAPED"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["python", "command"], help="run one sandbox's attempts")
    args = parser.parse_args(argv)
    sandboxes = [args.only] if args.only else ["python", "command"]
    rows, counts = [], {name: Counter() for name in sandboxes}
    reads_outside = Counter()
    with baited_host() as bait, tempfile.TemporaryDirectory(prefix="turnrl-escape-task-") as task:
        for attempt in ATTEMPTS:
            row = [attempt.category, attempt.name]
            for sandbox in sandboxes:
                verdict, last = run_attempt(attempt, sandbox, bait, Path(task))
                counts[sandbox][verdict or "n/a"] += 1
                reads_outside[sandbox] += attempt.read and verdict == "ESCAPED"
                row.append(f"{verdict} {last[3:40] if verdict else ''}".strip() or "-")
            rows.append(row)
    _print_table(["category", "attempt", *sandboxes], rows)
    for sandbox in sandboxes:
        summary = ", ".join(f"{n} {v}" for v, n in sorted(counts[sandbox].items()) if v != "n/a")
        print(f"{sandbox}: {summary}; reads outside the allow-list: {reads_outside[sandbox]}")
    return 1 if any(c["ESCAPED"] for c in counts.values()) else 0


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))


if __name__ == "__main__":
    sys.exit(main())
