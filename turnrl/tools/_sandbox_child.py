"""The sandbox's child program (turnrl.tools.sandbox runs it as `python -I -B -u _sandbox_child.py config.json`).

It starts as the *supervisor*: it applies the limits and namespaces (inherited by everything it starts), makes
itself the subreaper of the run, and forks the *worker*, which drops privileges, reports the active layers,
installs the audit hook and runs the code. The supervisor keeps its privileges only to enforce the wall-clock
timeout and to kill and reap every process of the run afterwards (orphans are reparented to it, so none is left
as a zombie either).

Standard library only, nothing from turnrl: it runs under `python -I` (its own folder is not on sys.path) and
maybe under another interpreter than the parent's (`SandboxLimits.python`), which need not have turnrl installed.
"""

import contextlib
import json
import linecache
import os
import resource
import select
import socket
import sys
import time
import traceback

try:
    import ctypes
except ImportError:  # an interpreter built without ctypes: no namespaces, no privilege drop
    ctypes = None


def _report(fd, **message):
    os.write(fd, (json.dumps(message) + "\n").encode())


def _setup_supervisor(cfg):
    for name, (soft, hard) in cfg["rlimits"].items():
        current_hard = resource.getrlimit(getattr(resource, name))[1]
        if current_hard != resource.RLIM_INFINITY:  # a non-root parent cannot raise its hard limits
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(getattr(resource, name), (soft, hard))
    layers = {"rlimits": True, "netns": False, "no_new_privs": False, "subreaper": False}
    if sys.platform.startswith("linux") and ctypes is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        flags = 0x40000000 if os.geteuid() == 0 else 0x40000000 | 0x10000000  # NEWNET (| NEWUSER)
        layers["netns"] = cfg["network_namespace"] and libc.unshare(flags) == 0
        layers["no_new_privs"] = libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
        layers["subreaper"] = libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    return layers


def _drop_privileges(uid, keep_dac_read_search):
    libc = ctypes.CDLL(None, use_errno=True)
    if keep_dac_read_search and libc.prctl(8, 1, 0, 0, 0) != 0:  # PR_SET_KEEPCAPS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if keep_dac_read_search:  # permitted = effective = {CAP_DAC_READ_SEARCH}, nothing else
        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
        data = (Data * 2)()
        data[0].effective = data[0].permitted = 1 << 2
        if libc.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:
            raise OSError(ctypes.get_errno(), "capset(CAP_DAC_READ_SEARCH)")


def _install_audit_hook(root, block_network, allow_subprocess):
    realpath, dirname, basename, sep = os.path.realpath, os.path.dirname, os.path.basename, os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    follow = {"os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,)}
    no_follow = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
                 "os.link": (0, 1), "os.symlink": (1,), "shutil.rmtree": (0,)}
    spawn = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen"}
    net = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
    unix = getattr(socket, "AF_UNIX", None)

    def inside(path, follow_last=True):
        if isinstance(path, int):
            return True  # an already open file descriptor
        path = os.path.abspath(os.fsdecode(os.fspath(path)))
        path = realpath(path) if follow_last else os.path.join(realpath(dirname(path)), basename(path))
        return path == root or path.startswith(root + sep) or path == "/dev/null"

    def hook(event, args):
        if event == "open":
            flags = args[2] if isinstance(args[2], int) else 0
            if flags & write_flags and not inside(args[0]):
                raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {args[0]}")
        elif event in follow or event in no_follow:
            for i in follow.get(event) or no_follow[event]:
                if not inside(args[i], event in follow):
                    raise PermissionError(f"sandbox: {event} outside the working directory is not allowed: {args[i]}")
        elif event in spawn and not allow_subprocess:
            raise PermissionError(f"sandbox: starting programs ({event}) is not allowed")
        elif block_network and (event == "socket.getaddrinfo"
                                or (event == "socket.__new__" and args[1] != unix)
                                or (event in net and isinstance(args[1], tuple))):
            raise PermissionError(f"sandbox: network access ({event}) is not allowed")

    sys.addaudithook(hook)


def _worker(cfg, layers):
    try:
        if cfg["uid"] is not None:
            _drop_privileges(cfg["uid"], cfg["keep_dac_read_search"])
            layers.update(uid=cfg["uid"], read_anywhere=cfg["keep_dac_read_search"])
        else:
            layers.update(uid=None, read_anywhere=os.geteuid() == 0)
        os.chdir(cfg["cwd"])
        block_network = not layers["netns"]
        _install_audit_hook(os.path.realpath(cfg["cwd"]), block_network, cfg["allow_subprocess"])
        layers.update(audit_hook=True, network_hook=block_network)
    except BaseException as e:
        _report(cfg["report_fd"], setup_error=f"{type(e).__name__}: {e}")
        os._exit(125)
    _report(cfg["report_fd"], layers=layers)
    os.close(cfg["report_fd"])
    _run(cfg.pop("code"))


def _run(code):
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    sys.argv = ["<code>"]
    sys.path.insert(0, os.getcwd())
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:
        report = traceback.TracebackException(type(e), e, e.__traceback__)
        report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != __file__])
        sys.stderr.write("".join(report.format()))  # the traceback without this program's frames
        sys.exit(1)


def _wait(pid, timeout_s):
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        if pidfd is not None:
            select.select([pidfd], [], [], remaining)
        else:
            time.sleep(min(remaining, 0.005))


def _children():
    me = str(os.getpid())
    try:
        with open(f"/proc/self/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        pass
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and f.read().rsplit(")", 1)[1].split()[1] == me:
                    pids.append(int(entry))
        except (OSError, IndexError):
            pass
    return pids


def _kill_all(uid):
    if uid is not None:  # kill(-1) as the run's uid reaches its every process, wherever it is
        killer = os.fork()
        if killer == 0:
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, 9)
            finally:
                os._exit(0)
        os.waitpid(killer, 0)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # orphans are reparented here: kill and reap until none is left
        for pid in _children():
            with contextlib.suppress(OSError):  # already gone
                os.kill(pid, 9)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.001)
        except ChildProcessError:
            return


def _supervise(cfg, worker):
    status = _wait(worker, cfg["timeout_s"])
    _kill_all(cfg["uid"])
    if status is None:
        exit_code = -9
    elif os.WIFSIGNALED(status):
        exit_code = -os.WTERMSIG(status)
    else:
        exit_code = os.WEXITSTATUS(status)
    _report(cfg["report_fd"], exit_code=exit_code, timed_out=status is None)
    os._exit(exit_code if exit_code >= 0 else 128 - exit_code)


def _main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    try:
        layers = _setup_supervisor(cfg)
    except BaseException as e:
        _report(cfg["report_fd"], setup_error=f"{type(e).__name__}: {e}")
        os._exit(125)
    worker = os.fork()
    if worker == 0:
        _worker(cfg, layers)
        sys.exit(0)
    _supervise(cfg, worker)


if __name__ == "__main__":
    _main()
