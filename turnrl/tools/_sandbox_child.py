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
import stat
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


# ---- kernel layers: Landlock (writes) and seccomp (exec) ---------------------------------------------
_LANDLOCK_WRITES = (1 << 1) | sum(1 << bit for bit in range(4, 13))  # WRITE_FILE, REMOVE_*, MAKE_* (ABI 1)
_SYSCALLS = {"x86_64": (0xC000003E, 59, 322), "aarch64": (0xC00000B7, 221, 281)}  # arch, execve, execveat


def _restrict_writes(root):
    """Landlock: from now on this process and its children may create, write, remove or rename only beneath
    `root` (and write /dev/null), whatever they call (native code included). Returns the ABI version, or
    False where the kernel lacks Landlock."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # landlock_create_ruleset: ABI version
    if abi < 1:
        return False
    handled = _LANDLOCK_WRITES | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)  # REFER, TRUNCATE
    file_rights = (1 << 1) | (1 << 14 if abi >= 3 else 0)
    ruleset = ctypes.c_uint64(handled)  # struct landlock_ruleset_attr {u64 handled_access_fs} (extensible)
    ruleset_fd = libc.syscall(444, ctypes.byref(ruleset), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset_fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    try:
        for path, rights in ((root, handled), ("/dev/null", file_rights)):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = PathBeneath(rights, fd)
                if libc.syscall(445, ruleset_fd, 1, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        if libc.syscall(446, ruleset_fd, ctypes.c_uint32(0)) != 0:  # landlock_restrict_self
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset_fd)
    return abi


def _deny_exec():
    """seccomp: execve and execveat fail with EPERM for this process and its children, so no other program
    starts, however it is asked for (subprocess internals, ctypes `system`, posix_spawn). Syscalls of another ABI
    (i386, x32) are refused outright. Returns False on an architecture this filter does not know."""
    arch, execve, execveat = _SYSCALLS.get(os.uname().machine, (None, None, None))
    if arch is None:
        return False
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, refuse = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, refuse), (load, 0, 0, 0)]
    if arch == 0xC000003E:
        program += [(jge, 0, 1, 0x40000000), (ret, 0, 0, refuse)]  # x32 syscalls on x86_64
    program += [(jeq, 0, 1, execve), (ret, 0, 0, refuse), (jeq, 0, 1, execveat), (ret, 0, 0, refuse),
                (ret, 0, 0, allow)]

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Instruction))]

    instructions = (Instruction * len(program))(*program)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(22, 2, ctypes.byref(Program(len(program), instructions)), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
    return True


def _optional(layer, *args):
    """A kernel layer the host may refuse (a container's own seccomp policy, an old kernel): reported as
    absent (False) in `layers`, never a failed setup."""
    try:
        return layer(*args)
    except OSError:
        return False


# ---- the audit hook ----------------------------------------------------------------------------------
def _install_audit_hook(root, block_network, allow_subprocess):
    # Everything the hook calls is bound here, never looked up when it runs: code that replaces
    # builtins.isinstance, os.path.abspath, os.lstat... cannot change its answers. Paths are resolved with the
    # C functions and str's own methods (a str subclass cannot lie through overridden methods either).
    is_instance, is_int, str_type, bytes_type = isinstance, int, str, bytes
    fspath, lstat, readlink, getcwd, is_link = os.fspath, os.lstat, os.readlink, os.getcwd, stat.S_ISLNK
    startswith, split, rfind, decode = str.startswith, str.split, str.rfind, bytes.decode
    denied = PermissionError
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    follow = {"os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,)}
    no_follow = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
                 "os.link": (0, 1), "os.symlink": (1,), "shutil.rmtree": (0,)}
    spawn = frozenset({"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen"})
    introspection = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})  # would reach the hook
    net = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"})
    unix = getattr(socket, "AF_UNIX", None)

    def resolve(path, follow_last):
        """os.path.realpath (non-strict) from the bound primitives; symlinks followed at most 40 times."""
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


def _worker(cfg, layers):
    try:
        if cfg["uid"] is not None:
            _drop_privileges(cfg["uid"], cfg["keep_dac_read_search"])
            layers.update(uid=cfg["uid"], read_anywhere=cfg["keep_dac_read_search"])
        else:
            layers.update(uid=None, read_anywhere=os.geteuid() == 0)
        os.chdir(cfg["cwd"])
        root = os.path.realpath(cfg["cwd"])
        kernel = sys.platform.startswith("linux") and ctypes is not None
        layers["landlock"] = _optional(_restrict_writes, root) if kernel else False
        layers["no_exec"] = _optional(_deny_exec) if kernel and not cfg["allow_subprocess"] else False
        block_network = not layers["netns"]
        _install_audit_hook(root, block_network, cfg["allow_subprocess"])
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
        try:
            report = traceback.TracebackException(type(e), e, e.__traceback__)
            report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != __file__])
            sys.stderr.write("".join(report.format()))  # the traceback without this program's frames
        except BaseException:  # the code broke what formatting needs (it replaced builtins.isinstance...)
            sys.stderr.write(f"{type(e).__name__}: {e}\n")
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
