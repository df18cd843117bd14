"""The code sandbox: each attack of issue 19 is contained, honest programs are scored as before.

Every test runs real untrusted-style code through ``run_sandboxed`` on this machine's kernel and
checks the effect from the host side (files, processes, sockets), not the program's word.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import titan_rl
from titan_rl import (
    SandboxLimits,
    code_reward,
    run_sandboxed,
    sandbox,
)

LIMITS = SandboxLimits(wall_time_s=3.0)
SANDBOX_SOURCE = Path(sandbox.__file__)
# First lines of every attack that could harm the host if the sandbox were broken (kill(-1) as
# root, writes to real files, fork bombs): a program that sees more than its own few processes
# stops there, so a broken sandbox fails these tests instead of hurting the machine.
ONLY_IF_ISOLATED = (
    "import os as _os\n"
    "if len([p for p in _os.listdir('/proc') if p.isdigit()]) > 8:\n"
    "    raise SystemExit('NOT ISOLATED: this attack would hit the host')\n"
)


def _host_processes_with_args(args: list[str]) -> list[int]:
    """Pids of host processes whose command line is exactly ``args``."""
    found, want = [], "\0".join(args) + "\0"
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/cmdline").read_text() == want:
                    found.append(int(entry))
            except OSError:
                continue
    return found


# ---------------------------------------------------------------------------------------------
# honest programs


def test_honest_programs_are_scored_from_stdin_stdout_and_exit_status():
    cases = {
        "double": ("print(int(input()) * 2)", "21\n"),
        "exit3": ("import sys; sys.exit(3)", ""),
        "raise": ("def f():\n    raise KeyError('k')\nf()\n", ""),
        "abort": ("import os; os.abort()", ""),
        "thread": (
            "import threading, time\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
            "print('main')\n",
            "",
        ),
        "subprocess": (
            "import subprocess, sys\n"
            "print(subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True,"
            " text=True).stdout.strip())\n",
            "",
        ),
        "tmp_file": (
            "open('scratch', 'w').write('x' * 10)\nprint(open('/tmp/scratch').read())",
            "",
        ),
    }
    r = {
        name: run_sandboxed(code, stdin=stdin, limits=LIMITS)
        for name, (code, stdin) in cases.items()
    }
    assert (r["double"].status, r["double"].returncode, r["double"].stdout) == ("ok", 0, "42\n")
    assert (r["exit3"].status, r["exit3"].returncode) == ("error", 3)
    assert (r["raise"].status, r["raise"].returncode) == ("error", 1)
    # The traceback reads as from a plain ``python main.py``: no supervisor frames.
    assert r["raise"].stderr.splitlines()[1] == '  File "/tmp/main.py", line 3, in <module>'
    assert "KeyError: 'k'" in r["raise"].stderr and "supervisor" not in r["raise"].stderr
    assert (r["abort"].status, r["abort"].returncode) == ("crashed", -signal.SIGABRT)
    assert r["thread"].stdout == "main\nthread\n"  # non-daemon threads are joined at exit
    assert r["subprocess"].stdout == "7\n"
    assert r["tmp_file"].stdout == "x" * 10 + "\n"
    assert {x.isolation for x in r.values()} == {"namespaces"}


def test_limits_end_a_run_with_the_matching_status():
    start = time.perf_counter()
    spin = run_sandboxed("while True:\n    pass\n", limits=SandboxLimits(wall_time_s=1.0))
    assert time.perf_counter() - start < 1.0 + 3.0
    assert (spin.status, spin.returncode) == ("timeout", None)
    big = run_sandboxed("print('x' * 3_000_000)", limits=LIMITS)  # output_bytes is 1 MiB
    assert (big.status, big.returncode) == ("output_limit", -signal.SIGXFSZ)
    assert len(big.stdout) <= LIMITS.output_bytes
    bomb = run_sandboxed(
        "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))\n", limits=LIMITS
    )
    assert bomb.status == "memory"


def test_code_reward_counts_passing_tests_and_reports_sandbox_statuses():
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert code_reward(code, [("1 2", "3"), ("5 5", "10")], limits=LIMITS).status == "correct"
    partial = code_reward(code, [("1 2", "3"), ("5 5", "11")], limits=LIMITS)
    assert (partial.score, partial.status) == (0.5, "wrong")
    crash = code_reward("raise SystemExit(3)", [("", "")], limits=LIMITS)
    assert (crash.score, crash.status) == (0.0, "error")
    with pytest.raises(ValueError, match="at least one"):
        code_reward(code, [])


# ---------------------------------------------------------------------------------------------
# the attacks of issue 19, each checked from the host


def test_program_runs_unprivileged_with_no_capabilities():
    code = (
        "import ctypes, os\n"
        "status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines()"
        " if ':\\t' in l)\n"
        "print(status['CapEff'], status['CapBnd'], status['NoNewPrivs'])\n"
        "print(*open('/proc/self/uid_map').read().split())\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('nested userns', libc.unshare(0x10000000), ctypes.get_errno())\n"
    )
    result = run_sandboxed(code, limits=LIMITS)
    caps, uid_map, nested = result.stdout.splitlines()
    assert caps == "0000000000000000 0000000000000000 1"
    inside, host_uid, count = uid_map.split()
    assert (inside, count) == ("0", "1")
    if os.geteuid() == 0:  # started as root: the run is nobody on the host
        assert host_uid == "65534"
    assert nested == "nested userns -1 28"  # ENOSPC: no user namespaces below the sandbox


def test_trainer_environment_and_processes_are_invisible(monkeypatch):
    secret = f"titan-secret-{secrets.token_hex(8)}"
    monkeypatch.setenv("TITAN_RL_TEST_SECRET", secret)
    code = (
        "import os\n"
        "pids = sorted(p for p in os.listdir('/proc') if p.isdigit())\n"
        "print('pids', pids, 'ppid', os.getppid())\n"
        "for p in pids + [str(os.getppid())]:\n"
        "    for name in ('environ', 'cmdline'):\n"
        "        try:\n"
        "            print(open(f'/proc/{p}/{name}', 'rb').read())\n"
        "        except OSError as e:\n"
        "            print(p, name, type(e).__name__)\n"
        "print(dict(os.environ))\n"
    )
    result = run_sandboxed(code, limits=LIMITS)
    assert result.status == "ok", result.stderr
    assert secret not in result.stdout and "TITAN_RL_TEST_SECRET" not in result.stdout
    # Only init (PID 1, not readable) and the program itself exist in its /proc.
    assert result.stdout.splitlines()[0] == "pids ['1', '2'] ppid 1"
    assert "1 environ PermissionError" in result.stdout


def test_no_file_outside_the_sandbox_can_be_written(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    sources = [SANDBOX_SOURCE, Path(titan_rl.__file__)]
    before = [hashlib.sha256(p.read_bytes()).hexdigest() for p in sources]
    marker = f"titan_rl_sandbox_{secrets.token_hex(6)}"
    targets = [*map(str, sources), str(victim), str(tmp_path / "new.txt"), "/etc/" + marker]
    targets += ["/usr/" + marker, "/" + marker, "/dev/" + marker]
    code = ONLY_IF_ISOLATED + (
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'a').write('pwned')\n"
        "        print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__, path)\n"
        f"open('/tmp/{marker}', 'w').write('inside only')\n"
    )
    result = run_sandboxed(code, limits=LIMITS)
    assert result.status == "ok", result.stderr
    assert "WROTE" not in result.stdout
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in sources] == before
    assert victim.read_text() == "original" and not (tmp_path / "new.txt").exists()
    for folder in ("/etc", "/usr", "/", "/dev", "/tmp"):
        assert not Path(folder, marker).exists()  # the sandbox's /tmp is its own tmpfs


def test_trainer_session_keyring_is_not_inherited():
    """A key in the caller's session keyring (as a login or kerberos session would hold)."""
    add_key, keyctl = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
    secret = secrets.token_hex(8)
    reader = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "buf = ctypes.create_string_buffer(64)\n"
        f"n = libc.syscall({keyctl}, 11, KEY, buf, 64)\n"  # KEYCTL_READ
        "print(n, ctypes.get_errno(), buf.raw[:max(n, 0)])\n"
    )
    script = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"assert libc.syscall({keyctl}, 1, None) > 0\n"  # KEYCTL_JOIN_SESSION_KEYRING
        f"key = libc.syscall({add_key}, b'user', b'titan_rl_test', {secret.encode()!r}, 16, -3)\n"
        "assert key > 0\n"
        f"print(sb.run_sandboxed({reader!r}.replace('KEY', str(key))).stdout)\n"
    )
    out = _with_sandbox_module(["sh", "-c", 'exec "$0" -c "$SCRIPT"'], script)
    assert out.returncode == 0, out.stderr
    assert secret not in out.stdout
    assert out.stdout.split()[:2] == ["-1", "13"]  # EACCES: not possessed, not its uid


def test_host_processes_cannot_be_signalled():
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        code = ONLY_IF_ISOLATED + (
            "import os, signal\n"
            f"for target in ({bystander.pid}, -1):\n"
            "    try:\n"
            "        os.kill(target, signal.SIGKILL)\n"
            "        print('sent', target)\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__, target)\n"
        )
        result = run_sandboxed(code, limits=LIMITS)
        assert result.status == "ok", result.stderr
        assert f"ProcessLookupError {bystander.pid}" in result.stdout
        time.sleep(0.05)
        assert bystander.poll() is None  # still alive after kill(pid) and kill(-1)
    finally:
        bystander.kill()
        bystander.wait()


def test_host_sysv_ipc_is_unreachable():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x7174_0000 + secrets.randbelow(1 << 16)
    segment = libc.shmget(key, 4096, 0o1000 | 0o666)  # IPC_CREAT, readable by anyone
    assert segment >= 0
    try:
        code = (
            "import ctypes\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.shmget({key}, 0, 0), ctypes.get_errno())\n"
        )
        result = run_sandboxed(code, limits=LIMITS)
        assert result.stdout == "-1 2\n"  # ENOENT: another IPC namespace
    finally:
        libc.shmctl(segment, 0, None)  # IPC_RMID


def test_host_sockets_and_network_are_unreachable(tmp_path):
    path_server = socket.socket(socket.AF_UNIX)
    path_server.bind(str(tmp_path / "trainer.sock"))
    abstract_name = f"\0titan_rl_test_{secrets.token_hex(6)}"
    abstract_server = socket.socket(socket.AF_UNIX)
    abstract_server.bind(abstract_name)
    tcp_server = socket.socket()
    tcp_server.bind(("127.0.0.1", 0))
    servers = [path_server, abstract_server, tcp_server]
    for server in servers:
        server.listen()
        server.setblocking(False)
    os.chmod(tmp_path, 0o777)
    os.chmod(tmp_path / "trainer.sock", 0o777)
    addresses = [
        ("AF_UNIX", str(tmp_path / "trainer.sock")),
        ("AF_UNIX", abstract_name),
        ("AF_INET", ("127.0.0.1", tcp_server.getsockname()[1])),
        ("AF_INET", ("1.1.1.1", 80)),
    ]
    code = (
        "import socket\n"
        f"for family, address in {addresses!r}:\n"
        "    s = socket.socket(getattr(socket, family))\n"
        "    s.settimeout(2)\n"
        "    try:\n"
        "        s.connect(address)\n"
        "        s.send(b'hello')\n"
        "        print('CONNECTED', address)\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n"
    )
    try:
        result = run_sandboxed(code, limits=LIMITS)
        assert result.status == "ok", result.stderr
        assert "CONNECTED" not in result.stdout
        assert len(result.stdout.splitlines()) == 4
        for server in servers:
            with pytest.raises(BlockingIOError):  # nothing ever knocked
                server.accept()
    finally:
        for server in servers:
            server.close()


def test_every_process_of_a_run_dies_with_it():
    token = f"600.{secrets.randbelow(10**6):06d}"
    code = ONLY_IF_ISOLATED + (
        "import subprocess\n"
        f"children = [subprocess.Popen(['sleep', '{token}']) for _ in range(20)]\n"
        "print('started', len(children))\n"
    )
    result = run_sandboxed(code, limits=SandboxLimits(wall_time_s=3.0, max_processes=32))
    assert result.stdout == "started 20\n"
    assert _host_processes_with_args(["sleep", token]) == []  # normal exit: all 20 gone
    daemon_token = f"601.{secrets.randbelow(10**6):06d}"
    code = ONLY_IF_ISOLATED + (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', '{daemon_token}'])\n"
        "    os._exit(0)\n"
        "while True:\n"
        "    time.sleep(0.1)\n"
    )
    result = run_sandboxed(code, limits=SandboxLimits(wall_time_s=1.0))
    assert result.status == "timeout", result.stderr
    assert _host_processes_with_args(["sleep", daemon_token]) == []  # setsid did not save it


def test_process_count_is_limited():
    code = ONLY_IF_ISOLATED + (
        "import os, time\n"
        "count = 0\n"
        "try:\n"
        "    while count < 1000:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        count += 1\n"
        "except OSError as e:\n"
        "    print(type(e).__name__)\n"
        "print(count)\n"
    )
    result = run_sandboxed(code, limits=SandboxLimits(wall_time_s=3.0, max_processes=6))
    assert result.status == "ok", result.stderr
    refusal, count = result.stdout.split()
    assert refusal == "BlockingIOError" and 1 <= int(count) < 6  # the program is one of the 6


def test_memory_limit_holds_for_the_whole_run():
    """Four children of 64 MiB each against a 128 MiB limit for the run."""
    limits = SandboxLimits(wall_time_s=5.0, memory_bytes=128 * 2**20)
    code = ONLY_IF_ISOLATED + (
        "import os, time\n"
        "for i in range(4):\n"
        "    if os.fork() == 0:\n"
        "        held = bytearray(64 * 2**20)\n"
        "        print('held', i, flush=True)\n"
        "        time.sleep(1)\n"
        "        os._exit(0)\n"
        "for _ in range(4):\n"
        "    os.wait()\n"
    )
    result = run_sandboxed(code, limits=limits)
    if result.memory_limit == "rlimit":
        pytest.skip("no writable cgroup on this machine: memory is limited per process only")
    assert result.status == "memory"
    assert result.stdout.count("held") < 4
    assert result.peak_memory_bytes <= limits.memory_bytes


def test_disk_writes_are_bounded():
    limits = SandboxLimits(wall_time_s=3.0, disk_bytes=4 * 2**20)
    code = ONLY_IF_ISOLATED + (
        "written = 0\n"
        "try:\n"
        "    for i in range(100):\n"
        "        folder = '/tmp' if i % 2 else '/dev/shm'\n"
        "        with open(f'{folder}/f{i}', 'wb') as f:\n"
        "            f.write(b'x' * 2**18)\n"
        "        written += 2**18\n"
        "except OSError as e:\n"
        "    print(e.strerror)\n"
        "print(written)\n"
    )
    result = run_sandboxed(code, limits=limits)
    assert result.status == "ok", result.stderr
    error, written = result.stdout.splitlines()
    assert error == "No space left on device"
    assert int(written) <= limits.disk_bytes


def test_status_comes_from_the_supervisor_not_the_program():
    honest_but_noisy = (
        "import sys\n"
        "print(int(input()) + 1)\n"
        "print('Traceback (most recent call last):\\nMemoryError', file=sys.stderr)\n"
        "print('timeout output_limit crashed', file=sys.stderr)\n"
    )
    result = run_sandboxed(honest_but_noisy, stdin="41\n", limits=LIMITS)
    assert (result.status, result.stdout) == ("ok", "42\n")
    assert code_reward(honest_but_noisy, [("41", "42")], limits=LIMITS).status == "correct"
    forger = (
        "import marshal, os\n"
        "fake = marshal.dumps({'timed_out': False, 'wait_status': 0, 'setup_error': None})\n"
        "for fd in range(3, 256):\n"
        "    try:\n"
        "        os.write(fd, fake)\n"
        "        print('wrote', fd)\n"
        "    except OSError:\n"
        "        pass\n"
        "for name in os.listdir('/proc/1/fd') if os.access('/proc/1/fd', os.R_OK) else []:\n"
        "    print('init fd', name)\n"
        "raise SystemExit(5)\n"
    )
    result = run_sandboxed(forger, limits=LIMITS)
    assert (result.status, result.returncode, result.stdout) == ("error", 5, "")


def test_runs_are_independent_when_concurrent():
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda i: run_sandboxed(f"print({i} * 3)", limits=LIMITS), range(4))
        )
    assert [(r.status, r.stdout) for r in results] == [("ok", f"{i * 3}\n") for i in range(4)]


# ---------------------------------------------------------------------------------------------
# where the kernel gives less


def _with_sandbox_module(command: list[str], script: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter with the sandbox module loaded (no torch) as ``sb``.

    ``command`` is a shell line that runs ``"$0" -c "$SCRIPT"``; ``$0`` is the interpreter.
    """
    loader = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sb', {str(SANDBOX_SOURCE)!r})\n"
        "sb = importlib.util.module_from_spec(spec)\n"
        "sys.modules['sb'] = sb\n"
        "spec.loader.exec_module(sb)\n"
    )
    return subprocess.run(
        [*command, os.path.realpath(sys.executable)],
        env={"PATH": os.environ["PATH"], "SCRIPT": loader + script},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _in_user_namespace(shell_prefix: str, script: str) -> subprocess.CompletedProcess:
    """Run ``script`` with ``sb`` in an outer user namespace, after ``shell_prefix``."""
    command = f'{shell_prefix} "$0" -c "$SCRIPT"'
    return _with_sandbox_module(
        ["unshare", "--user", "--map-root-user", "sh", "-c", command], script
    )


def test_non_root_caller_gets_the_same_isolation():
    script = (
        "r = sb.run_sandboxed(\"import os\\nprint(os.listdir('/proc'))\\nopen('/etc/x', 'w')\")\n"
        "print(r.status, r.isolation)\n"
        "print(r.stderr.splitlines()[-1])\n"
    )
    out = _in_user_namespace("exec unshare --user --map-user=1000 --map-group=1000", script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2:] == [
        "error namespaces",
        "OSError: [Errno 30] Read-only file system: '/etc/x'",
    ]


def test_no_isolation_fails_closed_unless_asked_for():
    # One user namespace allowed below the outer one, and the caller already uses it: the
    # sandbox's own unshare(CLONE_NEWUSER) is refused, as on a kernel with them turned off.
    script = (
        "try:\n"
        '    sb.run_sandboxed(\'open("/tmp/ran", "w")\')\n'
        "    print('RAN')\n"
        "except sb.SandboxUnavailableError as e:\n"
        "    print('refused:', e)\n"
        "r = sb.run_sandboxed('print(6 * 7)', isolation='none')\n"
        "print(r.status, r.isolation, r.stdout.strip())\n"
    )
    prefix = (
        "echo 1 > /proc/sys/user/max_user_namespaces && "
        "exec unshare --user --map-user=1000 --map-group=1000"
    )
    out = _in_user_namespace(prefix, script)
    assert out.returncode == 0, out.stderr
    refused, unisolated = out.stdout.splitlines()
    assert refused.startswith("refused: run_sandboxed(isolation='namespaces') could not isolate")
    assert "No space left on device" in refused and "isolation='none'" in refused
    assert unisolated == "ok none 42"


def test_without_a_cgroup_memory_and_processes_are_limited_per_process(monkeypatch):
    # As on a host where no cgroup is writable.
    monkeypatch.setattr(sandbox, "_writable_cgroup_parents", lambda: None)
    limits = SandboxLimits(wall_time_s=3.0, memory_bytes=64 * 2**20, max_processes=4)
    big = run_sandboxed("x = bytearray(128 * 2**20)", limits=limits)
    assert (big.memory_limit, big.status, big.peak_memory_bytes) == ("rlimit", "error", None)
    assert big.stderr.splitlines()[-1] == "MemoryError"  # RLIMIT_AS: the program sees it
    forks = run_sandboxed(
        ONLY_IF_ISOLATED + "import os, time\nn = 0\ntry:\n    while n < 100:\n"
        "        if os.fork() == 0:\n            time.sleep(10)\n            os._exit(0)\n"
        "        n += 1\nexcept OSError:\n    pass\nprint(n)\n",
        limits=limits,
    )
    assert 1 <= int(forks.stdout) < 4


def test_bad_sandbox_arguments_are_refused_before_any_process():
    with pytest.raises(ValueError, match="isolation='nsjail' must be one of"):
        run_sandboxed("print(1)", isolation="nsjail")
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxLimits(memory_bytes=1024)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=0)
    with pytest.raises(ValueError, match="disk_bytes"):
        SandboxLimits(disk_bytes=10)
    none = run_sandboxed("import os; print(os.getcwd() != '/tmp')", limits=LIMITS, isolation="none")
    assert (none.status, none.isolation, none.stdout) == ("ok", "none", "True\n")
