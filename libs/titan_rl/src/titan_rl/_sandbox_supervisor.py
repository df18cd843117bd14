"""The sandbox supervisor: the ``python -I -S`` process that ``run_sandboxed`` starts.

It imports nothing of titan_rl and only small standard-library modules (its start-up is most
of the sandbox's overhead). Three processes, each with one job:

- **supervisor** (host namespaces; invisible to the program, which lives in a PID namespace
  below it): waits until the trainer has put it in the run's cgroup; as root, builds the
  program's view of the file system in a private mount namespace, then becomes ``nobody``;
  creates the user, mount, PID, network, IPC, UTS and cgroup namespaces (its uid is root
  inside) and a new session keyring; forks init; enforces the wall-clock limit; writes the one report the trainer reads,
  on a pipe nothing else holds.
- **init** (PID 1 of the new PID namespace): mounts that namespace's ``/proc`` in the view,
  pivots into it, forks the program, reaps orphans and sends the program's wait status to the
  supervisor. When init exits, the kernel kills everything left in the namespace.
- **program**: sets the rlimits, drops every capability, sets ``no_new_privs``, and runs the
  code in this same interpreter (a fork of it: no second interpreter start), which then exits
  the normal way (``SystemExit``, uncaught exception, threads joined, atexit).

With ``isolation="none"`` there are no namespaces and no init: the program is a child of the
supervisor in its own session, with the same rlimits and cgroup.
"""

import _signal as signal  # not ``signal``: it imports enum, which doubles this process's start
import ctypes
import marshal
import os
import resource
import select
import sys
import types  # already loaded by ctypes: no start-up cost

_CLONE_NEWNS = 0x00020000
_NAMESPACES = (
    0x10000000  # CLONE_NEWUSER
    | _CLONE_NEWNS
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
    | 0x08000000  # CLONE_NEWIPC
    | 0x04000000  # CLONE_NEWUTS
    | 0x02000000  # CLONE_NEWCGROUP
)
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_MNT_DETACH = 2
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID = 0x1, 0x2
_SYS_MOUNT_SETATTR = 442  # one number on every architecture (added after the syscall unification)
# (pivot_root, keyctl) by machine: glibc wraps neither.
_SYSCALLS = {"x86_64": (155, 250), "aarch64": (41, 219), "riscv64": (41, 219)}
_KEYCTL_JOIN_SESSION_KEYRING = 1
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP = 1, 4, 24
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
_NOBODY = 65534
_DEVICES = ("null", "zero", "full", "random", "urandom")
_ROOT = "/tmp"  # where the view is assembled (in our own mount namespace): /tmp always exists
_MAIN = "/tmp/main.py"  # the program's path inside the view

_libc = ctypes.CDLL(None, use_errno=True)


class _SetupError(Exception):
    """The kernel refused a step of the isolation; none of the program's code has run."""


class _RunProgram(BaseException):
    """Raised in the forked program process to leave every supervisor frame before the code runs."""


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise _SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _prctl(option: int, arg: int, what: str) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), what)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    ret = _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3])
    _check(ret, f"mount({src!r} on {target!r}, {fstype})")


class _MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns")]


def _make_read_only(path: str) -> None:
    """Read-only and nosuid for ``path`` and every mount below it (``mount_setattr``, 5.12+)."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0, 0, 0)
    ret = _libc.syscall(
        ctypes.c_long(_SYS_MOUNT_SETATTR),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(path.encode()),
        ctypes.c_uint(_AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(ret, f"mount_setattr({path!r}, read-only, recursive)")


def _syscall_numbers() -> tuple[int, int]:
    """``(pivot_root, keyctl)`` syscall numbers of this machine."""
    machine = os.uname().machine
    if machine not in _SYSCALLS:
        raise _SetupError(f"no pivot_root/keyctl syscall numbers known for {machine}")
    return _SYSCALLS[machine]


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# supervisor


def _supervise(cfg: dict) -> dict:
    if os.read(cfg["go_fd"], 1) != b"g":  # the trainer has moved us into the run's cgroup
        raise SystemExit(1)
    os.close(cfg["go_fd"])
    with open(cfg["code_path"], "rb") as f:
        code = f.read()
    namespaces = cfg["isolation"] == "namespaces"
    if namespaces and os.geteuid() == 0:
        # Build the view as root (the interpreter may live in /root), then leave root: the user
        # namespace's copy of this mount namespace locks every mount and its read-only flag.
        _check(_libc.unshare(ctypes.c_int(_CLONE_NEWNS)), "unshare(mount)")
        _build_root(cfg, code)
        _drop_root()
        _enter_namespaces()
    elif namespaces:
        _enter_namespaces()
        _build_root(cfg, code)
    # The trainer's backstop kill of this process takes everything below with it.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != cfg["parent_pid"]:
        raise SystemExit(1)
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(status_r)
        if namespaces:
            _init(cfg, status_w)
        _become_program(cfg, cfg["workdir"])
    os.close(status_w)
    # The child is init (when it has exited, so has every process of the namespace) or, with
    # isolation="none", the program itself.
    pidfd = os.pidfd_open(pid)
    timed_out = not select.select([pidfd], [], [], cfg["wall_time_s"])[0]
    if timed_out:
        if namespaces:
            os.kill(pid, signal.SIGKILL)  # init: the kernel then kills the whole namespace
        else:
            try:  # noqa: SIM105 - contextlib would cost this process's start-up
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _, own_status = os.waitpid(pid, 0)
    message = b"" if namespaces else f"S{own_status}\n".encode()
    while namespaces and (chunk := os.read(status_r, 4096)):
        message += chunk
    report: dict[str, object] = {"timed_out": timed_out, "wait_status": None, "setup_error": None}
    if message.startswith(b"E"):
        report["setup_error"] = message[1:].decode(errors="replace").strip()
    elif message.startswith(b"S") and not timed_out:
        report["wait_status"] = int(message[1:])
    elif not timed_out:
        report["setup_error"] = f"sandbox init ended without a report (wait status {own_status})"
    return report


def _drop_root() -> None:
    """Become ``nobody`` on the host: the namespaces' root then maps to an unprivileged uid."""
    os.setgroups([])
    os.setresgid(_NOBODY, _NOBODY, _NOBODY)
    os.setresuid(_NOBODY, _NOBODY, _NOBODY)


def _enter_namespaces() -> None:
    """New namespaces in which this process's uid (``nobody`` when started as root) is root."""
    uid, gid = os.geteuid(), os.getegid()
    # Changing uid made us non-dumpable, which would keep our own /proc/self files from us.
    _prctl(_PR_SET_DUMPABLE, 1, "prctl(PR_SET_DUMPABLE)")
    try:
        _check(_libc.unshare(ctypes.c_int(_NAMESPACES)), "unshare(user, mount, pid, net, ipc)")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
    except OSError as e:
        raise _SetupError(f"user namespace set-up: {e}") from None
    _prctl(_PR_SET_DUMPABLE, 0, "prctl(PR_SET_DUMPABLE)")  # no other process may ptrace us
    # A new, empty session keyring: the trainer's (if it has one) would be the program's too.
    keyctl = ctypes.c_long(_syscall_numbers()[1])
    joined = _libc.syscall(keyctl, _KEYCTL_JOIN_SESSION_KEYRING, None)
    if joined < 0 and ctypes.get_errno() != 38:  # ENOSYS: no keyrings in the kernel, none to leak
        _check(joined, "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")


def _build_root(cfg: dict, code: bytes) -> None:
    """Assemble the program's file system on a tmpfs at ``_ROOT``, the code in its ``/tmp``."""
    root = _ROOT
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)  # nothing propagates to the host
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for src, dst in cfg["binds"]:
        os.makedirs(root + dst, exist_ok=True)
        _mount(src, root + dst, None, _MS_BIND | _MS_REC, None)
    for link, points_to in cfg["symlinks"]:
        os.symlink(points_to, root + link)
    os.mkdir(f"{root}/dev")
    _mount("tmpfs", f"{root}/dev", "tmpfs", _MS_NOSUID, "size=64k,mode=0755")
    for name in _DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, _MS_BIND, None)
    for name, fd in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
        os.symlink(f"/proc/self/fd{fd}", f"{root}/dev/{name}")
    for folder in ("proc", "tmp", "dev/shm"):
        os.mkdir(f"{root}/{folder}")
    _make_read_only(root)
    disk = cfg["disk_bytes"]
    options = f"size={disk},nr_inodes={max(256, disk // 4096)},mode=1777"
    _mount("tmpfs", f"{root}/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    _mount(f"{root}/tmp", f"{root}/dev/shm", None, _MS_BIND, None)  # the same size limit
    with open(root + _MAIN, "wb") as f:
        f.write(code)


# ---------------------------------------------------------------------------------------------
# init (PID 1 of the new PID namespace)


def _init(cfg: dict, status_w: int) -> None:
    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
        # Not dumpable: the program (same uid, no capabilities) can neither open /proc/1/fd
        # nor /proc/1/mem, so it cannot reach the status pipe.
        _prctl(_PR_SET_DUMPABLE, 0, "prctl(PR_SET_DUMPABLE)")
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 ignores signals it does not handle
        _enter_root()
        program = os.fork()
    except Exception as e:  # any failure here means no isolation: report it
        os.write(status_w, f"E{type(e).__name__}: {e}\n".encode())
        os._exit(1)
    if program == 0:
        _become_program(cfg, os.path.dirname(_MAIN))
    while True:  # PID 1 reaps orphans until the program itself ends
        pid, status = os.waitpid(-1, 0)
        if pid == program:
            os.write(status_w, f"S{status}\n".encode())
            os._exit(0)


def _enter_root() -> None:
    """Mount this PID namespace's ``/proc`` in the view and make the view ``/``."""
    root = _ROOT
    # pivot_root refuses a locked mount (a view built by root is one); a fresh bind is not.
    _mount(root, root, None, _MS_BIND | _MS_REC, None)
    _mount("proc", f"{root}/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
    os.chdir(root)
    _check(_libc.syscall(ctypes.c_long(_syscall_numbers()[0]), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "umount2(old root)")  # the host tree is gone
    os.chdir("/")
    # No nested user namespaces: they would give the program capabilities over new mounts.
    _write("/proc/sys/user/max_user_namespaces", "0")


# ---------------------------------------------------------------------------------------------
# the program


def _become_program(cfg: dict, workdir: str) -> None:
    """In the forked program process: limits, no capabilities, then unwind to run the code."""
    try:
        # Keep stdin, stdout, stderr and nothing else (the report pipe above all).
        max_fd = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        os.closerange(3, 1 << 20 if max_fd == resource.RLIM_INFINITY else max_fd)
        if cfg["isolation"] == "none":
            os.setsid()
        os.chdir(workdir)
        os.environ.clear()
        os.environ.update(cfg["env"])
        for name, value in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
        _prctl(_PR_SET_DUMPABLE, 1, "prctl(PR_SET_DUMPABLE)")  # our own /proc/self again
        _write("/proc/self/oom_score_adj", "1000")  # the OOM killer takes the program first
        if cfg["isolation"] == "namespaces":
            _drop_capabilities()
        _prctl(_PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")
        # Python ignores SIGXFSZ; the default makes the output limit a fact the supervisor sees.
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except BaseException as e:  # never run the code half-limited
        os.write(2, f"sandbox: could not limit the program: {type(e).__name__}: {e}\n".encode())
        os._exit(126)
    raise _RunProgram


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]


def _drop_capabilities() -> None:
    """Empty bounding, ambient, effective, permitted and inheritable capability sets."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(_PR_CAPBSET_DROP, cap, f"prctl(PR_CAPBSET_DROP, {cap})")
    _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    _check(_libc.capset(ctypes.byref(header), (_CapData * 2)()), "capset")


def _run_program(path: str) -> None:
    """Run the code at ``path`` as ``__main__`` of this interpreter, as ``python path`` would."""
    module = type(sys)("__main__")
    module.__file__ = path
    sys.modules["__main__"], sys.argv = module, [path]

    def excepthook(kind: type, value: BaseException, tb: types.TracebackType | None) -> None:
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next  # the supervisor's frames: a plain ``python path`` has none
        sys.__excepthook__(kind, value.with_traceback(tb), tb)

    sys.excepthook = excepthook
    with open(path, "rb") as f:
        code = f.read()
    exec(compile(code, path, "exec"), module.__dict__)  # exceptions propagate: normal exit


def main() -> None:
    """Supervise one run (``run_sandboxed`` passes the configuration as ``sys.argv[1]``)."""
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    program = None
    report: dict | None = None
    try:
        report = _supervise(cfg)
    except _RunProgram:  # only in the forked program process, every limit in place
        program = _MAIN if cfg["isolation"] == "namespaces" else cfg["code_path"]
    except (_SetupError, OSError) as e:
        report = {"timed_out": False, "wait_status": None, "setup_error": str(e)}
    if program is not None:
        _run_program(program)  # outside the except block: no exception context to chain
    else:
        assert report is not None  # set by _supervise or by the setup error
        os.write(cfg["report_fd"], marshal.dumps(report))
