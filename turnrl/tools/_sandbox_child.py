"""The sandbox's child program (turnrl.tools.sandbox runs it as `python -I -B -u _sandbox_child.py config.json`).

It starts as the *supervisor*: it applies the limits (inherited by everything it starts), makes itself the
subreaper of the run, and forks the *worker*, which confines itself (`_sandbox_kernel.py`: mounts, privilege drop,
Landlock, seccomp), reports the active layers and then either runs the Python code (mode "python": the audit hook
goes on last) or, as the init process of a PID namespace of its own, starts the command (mode "command") and
reaps whatever it leaves. The supervisor keeps its privileges only to enforce the wall-clock timeout, to relay
the loopback ports a command may reach, and to kill and reap every process of the run afterwards.

Standard library only, nothing from turnrl: it runs under `python -I` (its own folder is not on sys.path) and
maybe under another interpreter than the parent's (`SandboxLimits.python`), which need not have turnrl installed.
"""

import contextlib
import importlib.util
import json
import linecache
import os
import resource
import select
import signal
import socket
import stat
import sys
import sysconfig
import threading
import time
import traceback


def _load_kernel():
    """The sibling `_sandbox_kernel.py`, by path (under -I this folder is not on sys.path, on purpose)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_kernel.py")
    spec = importlib.util.spec_from_file_location("_sandbox_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


try:
    kernel = _load_kernel()
except ImportError:  # an interpreter built without ctypes: no namespaces, no privilege drop, no Landlock
    kernel = None
LINUX = sys.platform.startswith("linux") and kernel is not None


def _report(fd, **message):
    os.write(fd, (json.dumps(message) + "\n").encode())


def _optional(layer, *args):
    """A kernel layer the host may refuse (a container's own seccomp policy, an old kernel): reported as
    absent (False) in `layers`, never a failed setup."""
    try:
        return layer(*args)
    except OSError:
        return False


def _try(layer, *args):
    """Run `layer`; True if it held, False if the kernel refused it."""
    return _optional(lambda: layer(*args) or True)


# ---- the supervisor ----------------------------------------------------------------------------------
def _setup_supervisor(cfg):
    for name, (soft, hard) in cfg["rlimits"].items():
        current_hard = resource.getrlimit(getattr(resource, name))[1]
        if current_hard != resource.RLIM_INFINITY:  # a non-root parent cannot raise its hard limits
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(getattr(resource, name), (soft, hard))
    layers = {"rlimits": True, "netns": False, "mountns": False, "no_new_privs": False, "subreaper": False}
    if LINUX:
        libc = kernel._libc()
        if cfg["mode"] == "python" and cfg["network_namespace"]:  # a command's worker makes its own
            user = 0 if os.geteuid() == 0 else kernel.CLONE_NEWUSER
            layers["netns"] = _try(kernel.unshare, kernel.CLONE_NEWNET | user)
        layers["no_new_privs"] = libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
        layers["subreaper"] = libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
        _optional(kernel.die_with_parent)  # the thread that started us waits for us: it dies only with turnrl
    return layers


# ---- what the run may read and write ------------------------------------------------------------------
def _interpreter_paths():
    """What this interpreter reads after start-up: its binary, its library directory (libpython, the standard
    library) and every sys.path entry (lib-dynload, site-packages, paths added by .pth files)."""
    paths = [os.path.realpath(sys.executable)]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        paths.append(sysconfig.get_config_var("LIBDIR"))
    paths += [entry for entry in sys.path if entry and os.path.isdir(entry)]
    return paths


def _existing(paths):
    """Resolved, existing, without repeats, in order."""
    out = []
    for path in paths:
        real = os.path.realpath(path)
        if os.path.exists(real) and real not in out:
            out.append(real)
    return out


def _readable_by_others(path):
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))


def _blocked(paths):
    """{directory others cannot search (e.g. /root, mode 0700): the allow-listed paths beneath it}."""
    groups = {}
    for path in paths:
        blocker = kernel.first_blocker(path)
        if blocker is not None:
            groups.setdefault(blocker, []).append(path)
    return groups


PRIVATE_DIRS = ("/tmp", "/var/tmp", "/run", "/dev/shm")
"""Where anyone may leave things (files, FIFOs, world-writable Unix sockets such as D-Bus's): in its mount
namespace the run gets fresh, empty ones, so it neither reaches nor leaves anything there on the host."""


def _private_dirs(paths, size_mb=None):
    """Replace PRIVATE_DIRS with empty tmpfs (allow-listed paths beneath them bound back): writable /tmp and
    /dev/shm of `size_mb` for a command, else empty and read-only to the run (the Python tool writes only its
    work dir)."""
    for directory in PRIVATE_DIRS:
        if os.path.isdir(directory) and not os.path.islink(directory) and directory not in paths:
            writable = size_mb is not None and directory in ("/tmp", "/dev/shm")
            options = f"mode=1777,size={size_mb}m" if writable else "mode=0755,size=1m"
            kernel.cover(directory, [p for p in paths if p.startswith(directory + "/")], options)


def _make_reachable(paths):
    """The sandbox's uid must reach paths beneath directories it cannot search (a pyenv under /root). In the
    run's mount namespace each such directory becomes an empty tmpfs holding only those paths, bound back in
    place: nothing else of it is even there."""
    for directory, keep in sorted(_blocked(paths).items()):
        kernel.cover(directory, keep, "mode=0755,size=1m")


# ---- mode "python": the worker runs the code ------------------------------------------------------------
def _confine_python(cfg, layers):
    """Everything between fork and the code: reachability, privilege drop, Landlock, seccomp, audit hook."""
    root = os.path.realpath(cfg["cwd"])
    writes = _existing([root, "/dev/null"])
    reads = _existing(cfg["reads"] + _interpreter_paths()) if LINUX else []
    keep_cap = blocked = False
    if cfg["uid"] is not None:
        blocked = bool(_blocked(reads + writes))
        layers["mountns"] = LINUX and _try(kernel.private_mounts)
        if layers["mountns"]:
            _private_dirs(reads + writes)
            _make_reachable(reads + writes)
        interpreter_unreadable = not all(_readable_by_others(p) for p in _existing(_interpreter_paths()))
        keep_cap = interpreter_unreadable or (blocked and not layers["mountns"])
        kernel.drop_privileges(cfg["uid"], keep_cap)
        _optional(kernel.die_with_parent)
    os.chdir(root)
    layers["landlock"] = False
    if LINUX and cfg["landlock"]:
        layers["landlock"] = _optional(lambda: kernel.landlock(reads, writes, deny_tcp=not layers["netns"]))
    restrict_reads = bool(layers["landlock"])
    denied = ([] if cfg["allow_subprocess"] else ["execve", "execveat"]) + (["open_by_handle_at"] if keep_cap else [])
    filtered = LINUX and bool(denied) and _optional(kernel.seccomp_deny, denied)
    layers.update(
        uid=cfg["uid"],
        reach="capability" if keep_cap else "mounts" if blocked else None,
        read_paths=sorted(set(reads + writes)) if restrict_reads else None,
        read_anywhere=not restrict_reads and (keep_cap or os.geteuid() == 0),
        no_exec=bool(filtered) and not cfg["allow_subprocess"],
    )
    block_network = not layers["netns"]
    _install_audit_hook(root, block_network, cfg["allow_subprocess"])
    layers.update(audit_hook=True, network_hook=block_network)


def _python_worker(cfg, layers):
    try:
        _confine_python(cfg, layers)
    except BaseException as e:
        _report(cfg["report_fd"], setup_error=f"{type(e).__name__}: {e}")
        os._exit(125)
    _report(cfg["report_fd"], layers=layers)
    os.close(cfg["report_fd"])
    _run(cfg.pop("code"))


# ---- the audit hook ----------------------------------------------------------------------------------
def _resolver():
    """os.path.realpath (non-strict) built from primitives bound now, before any user code runs (see
    _install_audit_hook): symlinks followed at most 40 times."""
    lstat, readlink, getcwd, is_link = os.lstat, os.readlink, os.getcwd, stat.S_ISLNK
    startswith, split, rfind = str.startswith, str.split, str.rfind

    def resolve(path, follow_last):
        pending = split(path if startswith(path, "/") else getcwd() + "/" + path, "/")[::-1]
        out, hops = "", 0
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                out = out[: rfind(out, "/")] if out else ""
                continue
            candidate = out + "/" + part
            if not pending and not follow_last:
                return candidate
            try:
                mode = lstat(candidate).st_mode
            except OSError:
                out = candidate  # does not exist (yet): taken as written
                continue
            if not is_link(mode):
                out = candidate
                continue
            hops += 1
            if hops > 40:
                return candidate
            target = readlink(candidate)
            out = "" if startswith(target, "/") else out
            pending += split(target, "/")[::-1]
        return out or "/"

    return resolve


def _install_audit_hook(root, block_network, allow_subprocess):
    # Everything the hook calls is bound here, never looked up when it runs: code that replaces
    # builtins.isinstance, os.path.abspath, os.lstat... cannot change its answers. Paths are resolved with the
    # C functions and str's own methods (a str subclass cannot lie through overridden methods either).
    is_instance, is_int, str_type, bytes_type = isinstance, int, str, bytes
    fspath, startswith, decode = os.fspath, str.startswith, bytes.decode
    denied = PermissionError
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    follow = {"os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,)}
    no_follow = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
                 "os.link": (0, 1), "os.symlink": (1,), "shutil.rmtree": (0,)}
    spawn = frozenset({"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen"})
    introspection = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})  # would reach the hook
    net = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"})
    unix = getattr(socket, "AF_UNIX", None)

    resolve = _resolver()

    def inside(path, follow_last=True):
        if is_instance(path, is_int):
            return True  # an already open file descriptor
        path = fspath(path)  # once: what a PathLike returns the second time is not what was opened
        if is_instance(path, bytes_type):
            path = decode(path, "utf-8", "surrogateescape")
        if not is_instance(path, str_type):
            return False
        path = resolve(path, follow_last)
        return path == root or startswith(path, root + "/") or path == "/dev/null"

    def hook(event, args):
        if event == "open":
            flags = args[2] if isinstance(args[2], int) else 0
            if flags & write_flags and not inside(args[0]):
                raise denied(f"sandbox: writing outside the working directory is not allowed: {args[0]!r}")
        elif event in follow or event in no_follow:
            for i in follow.get(event) or no_follow[event]:
                if not inside(args[i], event in follow):
                    raise denied(f"sandbox: {event} outside the working directory is not allowed: {args[i]!r}")
        elif event in spawn and not allow_subprocess:
            raise denied(f"sandbox: starting programs ({event}) is not allowed")
        elif event in introspection:
            raise denied(f"sandbox: {event} is not allowed")
        elif block_network and (event == "socket.getaddrinfo"
                                or (event == "socket.__new__" and args[1] != unix)
                                or (event in net and is_instance(args[1], tuple))):
            raise denied(f"sandbox: network access ({event}) is not allowed")

    sys.addaudithook(hook)


def _run(code):
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    sys.argv = ["<code>"]
    sys.path.insert(0, os.getcwd())
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:
        try:
            report = traceback.TracebackException(type(e), e, e.__traceback__)
            report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != __file__])
            sys.stderr.write("".join(report.format()))  # the traceback without this program's frames
        except BaseException:  # the code broke what formatting needs (it replaced builtins.isinstance...)
            sys.stderr.write(f"{type(e).__name__}: {e}\n")
        sys.exit(1)


# ---- mode "command": the worker is the init process of the run ----------------------------------------
STRICT_LAYERS = ("pidns", "mountns", "netns", "landlock")
"""What a command's sandbox must have unless it is weak (the separate uid is checked by the parent)."""


def _isolate_command(cfg, layers, channel):
    """As root, before the drop: a mount namespace (its own root when directories are mounted at new paths,
    fresh /proc and /tmp, blocked directories made reachable, a passwd naming the run's user) and a network
    namespace (loopback only; its listeners go to the supervisor, which relays them to the host's loopback
    ports)."""
    layers["mountns"] = _try(kernel.private_mounts)
    if cfg["mounts"] and not layers["mountns"]:
        raise OSError(f"the directories to mount at {', '.join(sorted(cfg['mounts']))} need a mount namespace, "
                      f"which this machine refuses ({_MISSING_WHY})")
    if layers["mountns"]:
        if cfg["mounts"]:
            kernel.new_root(cfg["scratch"], cfg["mounts"])
            layers["mounts"] = sorted(cfg["mounts"])
        if layers["pidns"]:
            kernel.mount_proc()
        for name, path in cfg["identity"].items():  # before /tmp is covered: the files are in the control dir
            kernel.bind_file(path, f"/etc/{name}")
            cfg["reads"].append(f"/etc/{name}")
        paths = _existing(cfg["reads"] + cfg["writes"])
        _private_dirs(paths, cfg["tmp_mb"])
        _make_reachable(paths)
    else:  # no private /tmp: temporary files go to HOME
        cfg["env"]["TMPDIR"] = os.path.join(cfg["home"], ".tmp")
        os.makedirs(cfg["env"]["TMPDIR"], exist_ok=True)
        if cfg["uid"] is not None:
            os.chown(cfg["env"]["TMPDIR"], cfg["uid"], cfg["uid"])
    layers["netns"] = _try(kernel.unshare, kernel.CLONE_NEWNET)
    if layers["netns"] and cfg["network"] == "loopback":
        kernel.loopback_up()
        listeners = [socket.create_server(("127.0.0.1", port)) for port in cfg["ports"]]
        socket.send_fds(channel, [json.dumps(cfg["ports"]).encode()], [s.fileno() for s in listeners])
        for listener in listeners:
            listener.close()
    channel.close()


def _confine_command(cfg, layers, channel):
    _isolate_command(cfg, layers, channel)
    writes = cfg["writes"] + (["/tmp"] if layers["mountns"] else [])
    reads = cfg["reads"] + (["/proc"] if layers["pidns"] and layers["mountns"] else [])
    if cfg["uid"] is not None:
        kernel.drop_privileges(cfg["uid"])
        _optional(kernel.die_with_parent)
    os.chdir(cfg["cwd"])
    deny_tcp = cfg["network"] == "none" and not layers["netns"]
    layers["landlock"] = _optional(lambda: kernel.landlock(_existing(reads), _existing(writes), deny_tcp=deny_tcp))
    layers.update(uid=cfg["uid"], read_paths=sorted(_existing(reads + writes)) if layers["landlock"] else None)
    missing = [name for name in STRICT_LAYERS if not layers[name]]
    if cfg["strict"] and missing:
        raise OSError(f"this machine cannot enforce the command sandbox: no {', no '.join(missing)} "
                      f"({_MISSING_WHY}); set `weak` to run it with what is available")


_MISSING_WHY = ("namespaces need root or unprivileged user namespaces; Landlock needs Linux 5.13+ with `landlock` "
                "in the kernel's lsm= list")


def _command_worker(cfg, layers, channel):
    """PID 1 of the run's PID namespace: confine itself, start the command, reap everything until the command
    ends, then exit, which makes the kernel kill whatever the command left behind."""
    try:
        _confine_command(cfg, layers, channel)
    except BaseException as e:
        _report(cfg["report_fd"], setup_error=f"{type(e).__name__}: {e}")
        os._exit(125)
    _report(cfg["report_fd"], layers=layers)
    command = os.fork()
    if command == 0:
        os.close(cfg["report_fd"])
        _exec(cfg["argv"], cfg["env"])
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(125)
        if pid == command:
            _report(cfg["report_fd"], command_exit=os.waitstatus_to_exitcode(status))
            os._exit(0)


def _exec(argv, env):
    for sig in (signal.SIGINT, signal.SIGPIPE):  # Python changed these; a program expects the defaults
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        os.write(2, f"sandbox: cannot start {argv[0]!r}: {e}\n".encode())
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


# ---- the supervisor's side: loopback relay, waiting, killing -------------------------------------------
_MAX_CONNECTIONS = 64


def _relay(channel, timeout_s):
    """Receive the worker's listening sockets (bound to 127.0.0.1 inside the run's network namespace) and relay
    each accepted connection to the same port on the host's loopback, where turnrl serves: the only way out."""
    channel.settimeout(timeout_s)
    try:
        message, fds, _flags, _addr = socket.recv_fds(channel, 4096, 64)
    except OSError:
        return
    finally:
        channel.close()
    if not fds:
        return
    slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
    for port, fd in zip(json.loads(message), fds, strict=True):
        listener = socket.socket(fileno=fd)
        threading.Thread(target=_accept, args=(listener, port, slots), daemon=True).start()


def _accept(listener, port, slots):
    while True:
        conn, _ = listener.accept()
        if not slots.acquire(blocking=False):
            conn.close()  # the run holds too many connections already
            continue
        try:
            upstream = socket.create_connection(("127.0.0.1", port), timeout=10)
            upstream.settimeout(None)
        except OSError:
            conn.close()
            slots.release()
            continue
        ends = []
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_pump, args=(src, dst, ends, slots), daemon=True).start()


def _pump(src, dst, ends, slots):
    """Copy src to dst until EOF; the second pump of a pair to finish closes both sockets."""
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
    ends.append(src)  # list.append is atomic
    if len(ends) == 2:
        src.close()
        dst.close()
        slots.release()


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


def _supervise(cfg, worker, pidns):
    status = _wait(worker, cfg["timeout_s"])
    if status is None:
        with contextlib.suppress(OSError):
            os.kill(worker, signal.SIGKILL)  # in a PID namespace, init's death kills every process in it
    _kill_all(None if pidns else cfg["uid"])
    if status is None:
        exit_code = -9
    elif os.WIFSIGNALED(status):
        exit_code = -os.WTERMSIG(status)
    else:
        exit_code = os.WEXITSTATUS(status)
    _report(cfg["report_fd"], exit_code=exit_code, timed_out=status is None)
    os._exit(exit_code if exit_code >= 0 else 128 - exit_code)


def _fork_into_pid_namespace(layers):
    """Fork the worker as PID 1 of a new PID namespace where possible (then only restore this process's own
    namespace for its later threads: the kernel refuses threads while they would differ)."""
    own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC) if LINUX else -1
    layers["pidns"] = LINUX and _try(kernel.unshare, kernel.CLONE_NEWPID)
    worker = os.fork()
    if worker and layers["pidns"]:
        kernel._check(kernel._libc().setns(own, kernel.CLONE_NEWPID), "setns")
    if own >= 0:
        os.close(own)
    return worker


def _main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    try:
        layers = _setup_supervisor(cfg)
        channel, worker_end = socket.socketpair() if cfg["mode"] == "command" else (None, None)
        worker = _fork_into_pid_namespace(layers) if cfg["mode"] == "command" else os.fork()
    except BaseException as e:
        _report(cfg["report_fd"], setup_error=f"{type(e).__name__}: {e}")
        os._exit(125)
    if worker == 0:
        if cfg["mode"] == "command":
            channel.close()
            _command_worker(cfg, layers, worker_end)
        _python_worker(cfg, layers)
        sys.exit(0)
    if cfg["mode"] == "command":
        worker_end.close()
        threading.Thread(target=_relay, args=(channel, cfg["timeout_s"]), daemon=True).start()
    _supervise(cfg, worker, layers.get("pidns", False))


if __name__ == "__main__":
    _main()
