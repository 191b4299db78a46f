"""The sandbox's kernel layers: Landlock (what may be read, written, executed; signals and abstract sockets),
seccomp filters, the privilege drop, and the namespaces (mounts that make the allow-list reachable, a private
/tmp and /proc, an isolated network whose loopback can be brought up).

Standard library only: `_sandbox_child.py` loads this file by path under `python -I` (maybe another interpreter,
without turnrl), and turnrl imports it to report the host's layers (`turnrl doctor --sandbox`). Every function
raises OSError when the kernel refuses; the caller decides whether that layer was optional.
"""

import contextlib
import ctypes
import fcntl
import os
import socket
import stat
import struct

# ---- Landlock ------------------------------------------------------------------------------------------
# Filesystem rights (include/uapi/linux/landlock.h): ABI 1 has bits 0-12, ABI 2 adds REFER, ABI 3 TRUNCATE.
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_CHANGES = sum(1 << bit for bit in range(4, 13))  # REMOVE_DIR/FILE, MAKE_CHAR/DIR/REG/SOCK/FIFO/BLOCK/SYM
REFER, TRUNCATE = 1 << 13, 1 << 14
READ = EXECUTE | READ_FILE | READ_DIR
"""What a read rule grants: open and list, and start programs (the loader maps what it can read anyway)."""
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE  # the rights that apply to a file (not a directory)
_BIND_TCP, _CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
_RULE_PATH_BENEATH = 1


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _check(result, what):
    if result < 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")
    return result


def landlock_abi():
    """The kernel's Landlock ABI version; 0 where it has none (older than 5.13, or not enabled at boot)."""
    try:
        return max(_libc().syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)), 0)
    except (OSError, AttributeError):
        return 0


def landlock(reads, writes, *, restrict_reads=True, deny_tcp=False):
    """Restrict this process and everything it starts, for good: it may write, create, remove, rename or link
    only beneath `writes`; with `restrict_reads`, open, list or execute only beneath `reads` and `writes`;
    with `deny_tcp` (ABI 4+), bind or connect no TCP socket; and (ABI 6+) signal no process and reach no
    abstract Unix socket outside the sandbox. Paths that do not exist are skipped. Returns the ABI version."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError(38, "the kernel has no Landlock")  # ENOSYS
    writing = WRITE_FILE | _CHANGES | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    handled = writing | (READ if restrict_reads else 0)
    attr = [handled]
    if abi >= 4:
        attr.append(_BIND_TCP | _CONNECT_TCP if deny_tcp else 0)
    if abi >= 6:
        attr.append(_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL)
    libc = _libc()
    packed = struct.pack(f"{len(attr)}Q", *attr)
    ruleset = _check(libc.syscall(_CREATE_RULESET, packed, ctypes.c_size_t(len(packed)), ctypes.c_uint32(0)),
                     "landlock_create_ruleset")
    try:
        rules = [(path, handled) for path in writes] + [(path, READ & handled) for path in reads]
        for path, rights in rules:
            _add_path_rule(libc, ruleset, path, rights)
        _check(libc.syscall(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


def _add_path_rule(libc, ruleset, path, rights):
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= _FILE_RIGHTS  # a directory right on a file is EINVAL
        if rights:
            rule = _PathBeneath(rights, fd)
            _check(libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)),
                   f"landlock_add_rule({path})")
    finally:
        os.close(fd)


# ---- seccomp ---------------------------------------------------------------------------------------------
_ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {
    "x86_64": {"execve": 59, "execveat": 322, "open_by_handle_at": 304, "unshare": 272},
    "aarch64": {"execve": 221, "execveat": 281, "open_by_handle_at": 265, "unshare": 97},
}


def seccomp_deny(names):
    """seccomp: the named syscalls fail with EPERM for this process and its children, for good; syscalls of
    another ABI (i386, x32) are refused outright. Returns False on an architecture this filter does not know."""
    machine = os.uname().machine
    arch, numbers = _ARCHES.get(machine), SYSCALLS.get(machine, {})
    if arch is None:
        return False
    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, refuse = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, refuse), (load, 0, 0, 0)]
    if machine == "x86_64":
        program += [(jge, 0, 1, 0x40000000), (ret, 0, 0, refuse)]  # x32 syscalls on x86_64
    for name in names:
        program += [(jeq, 0, 1, numbers[name]), (ret, 0, 0, refuse)]
    program.append((ret, 0, 0, allow))

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Instruction))]

    instructions = (Instruction * len(program))(*program)
    _check(_libc().prctl(22, 2, ctypes.byref(Program(len(program), instructions)), 0, 0), "prctl(PR_SET_SECCOMP)")
    return True


# ---- privileges --------------------------------------------------------------------------------------------
_CAP_DAC_READ_SEARCH = 2


def drop_privileges(uid, keep_dac_read_search=False):
    """Become `uid` (also the gid) with no supplementary groups and no capabilities, or with only
    CAP_DAC_READ_SEARCH (the last resort when the interpreter's installation cannot be reached otherwise)."""
    libc = _libc()
    if keep_dac_read_search:
        _check(libc.prctl(8, 1, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if keep_dac_read_search:  # permitted = effective = {CAP_DAC_READ_SEARCH}, nothing else
        header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = struct.pack("6I", 1 << _CAP_DAC_READ_SEARCH, 1 << _CAP_DAC_READ_SEARCH, 0, 0, 0, 0)
        _check(libc.capset(header, data), "capset(CAP_DAC_READ_SEARCH)")


def die_with_parent():
    """PR_SET_PDEATHSIG: SIGKILL this process when the one that started it dies (set after any uid change,
    which clears it)."""
    _check(_libc().prctl(1, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


# ---- namespaces and mounts ---------------------------------------------------------------------------------
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18


def unshare(flags):
    _check(_libc().unshare(flags), "unshare")


def _mount(source, target, fstype, flags, data=None):
    source, target_b, fstype, data = (None if s is None else s.encode() for s in (source, target, fstype, data))
    _check(_libc().mount(source, target_b, fstype, ctypes.c_ulong(flags), data), f"mount({target})")


def private_mounts():
    """A mount namespace of this process's own, whose changes never propagate to the host."""
    unshare(CLONE_NEWNS)
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)


def traversable_by_others(path):
    """Whether a uid without privileges can walk to `path`: every directory above it searchable by others."""
    parent = os.path.dirname(path)
    while parent != path:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        path, parent = parent, os.path.dirname(parent)
    return True


def first_blocker(path):
    """The topmost directory above `path` that others cannot search (e.g. /root, mode 0700), or None."""
    parts = path.strip("/").split("/")[:-1]
    for i in range(len(parts)):
        ancestor = "/" + "/".join(parts[: i + 1])
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def cover(directory, keep, options):
    """Mount a fresh tmpfs (mount `options`, e.g. mode=0755) over `directory`, then bind every path of `keep`
    (beneath `directory`) back at its own place: what `directory` held is gone for this mount namespace, but
    those paths, through new directories anyone may search. Call within `private_mounts()`."""
    keep = sorted(p for p in set(keep) if not any(p.startswith(other + "/") for other in keep))  # topmost only
    handles = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in keep if os.path.lexists(path)}
    try:
        _mount("tmpfs", directory, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
        for path, fd in handles.items():
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.mkdir(path, 0o755)
            else:
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
    finally:
        for fd in handles.values():
            os.close(fd)


def new_root(scratch, binds):
    """Make `scratch` (an existing directory) this mount namespace's root, holding what the current root holds
    and the directories of `binds` ({path inside: host directory}) at their paths, then chroot there (the task's
    /app, /logs, /tests, where no such directory exists on the host). The new root is a small tmpfs: each entry
    of / is bound there recursively (a symlink is copied), except a top-level directory that holds a bind
    target: it is a fresh, empty directory (the host's is not seen), so no directory is ever made on the host.
    Call within `private_mounts()`, before anything else is mounted."""
    tops = {target.strip("/").split("/")[0] for target in binds}
    _mount("tmpfs", scratch, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
    for name in os.listdir("/"):
        source, target = "/" + name, os.path.join(scratch, name)
        if name in tops:
            continue
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            os.mkdir(target, 0o755)
            _mount(source, target, None, _MS_BIND | _MS_REC)
        else:  # a file at the root (/.dockerenv)
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
            _mount(source, target, None, _MS_BIND)
    for inside, source in sorted(binds.items()):
        target = scratch + inside
        os.makedirs(target, 0o755, exist_ok=True)  # in the tmpfs: no target is beneath another (checked)
        _mount(source, target, None, _MS_BIND | _MS_REC)
    os.chdir(scratch)
    os.chroot(".")
    os.chdir("/")


def bind_file(source, target):
    """Bind one file over another (e.g. a generated /etc/passwd naming the sandbox's user)."""
    _mount(source, target, None, _MS_BIND)


def mount_proc():
    """A procfs of this PID namespace on /proc: it lists only the sandbox's own processes."""
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)


def loopback_up():
    """Bring up `lo` in this (fresh) network namespace: 127.0.0.1 answers, nothing else is reachable."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def can_unshare(flags):
    """Whether this process could create these namespaces (tried in a throwaway child)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        with contextlib.suppress(BaseException):
            unshare(flags)
            code = 0
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
