"""Run a program the model wrote (HumanEval's) in a sandboxed child process, as
nanochat's execution.py does: `run_program(code) -> (passed, error, stdout)`.

The child is this file run as a script, in a fresh temporary directory. Before the
program runs it
- limits itself: the parent's wall-clock timeout kills its whole process group;
  RLIMIT_AS and RLIMIT_DATA make runaway allocation a MemoryError; RLIMIT_FSIZE caps
  every file at 16 MB (the captured output included); CPU time is capped too;
- enters a new, empty network namespace where the kernel allows one;
- installs an audit hook (PEP 578: it cannot be removed) that refuses sockets, new
  processes, signals, ctypes, and every change to a path outside the temporary
  directory. Reads stay allowed: imports need them.
It stops accidents and naive attempts, not adversarial code (docs/evaluations.md lists
the paths it leaves open): for that, use a container.
"""

import math
import os
import signal
import subprocess
import sys
import tempfile

# bytes per file the program may write, its captured output included
FILE_LIMIT = 16 << 20
BANNED = (  # prefixes of the audit events refused
    "socket.", "ctypes.", "subprocess.", "os.system", "os.exec", "os.spawn",
    "os.posix_spawn", "os.fork", "pty.spawn", "os.kill", "resource.setrlimit",
    "resource.prlimit")
CHANGED_PATHS = {  # audit event -> which of its arguments are paths it changes
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,),
    "os.chown": (0,), "os.chflags": (0,), "os.truncate": (0,), "os.utime": (0,),
    "os.setxattr": (0,), "os.removexattr": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (1,)}
# modules the program may not import
NO_IMPORT = ("ctypes", "_ctypes", "_posixsubprocess")


def _tail(f, n=10_000):
    """The last n bytes of a captured output file: a program printing forever cannot
    flood us."""
    end = f.seek(0, os.SEEK_END)
    f.seek(max(0, end - n))
    return f.read().decode(errors="replace")


def run_program(code, timeout=5.0, memory_mb=256, network_namespace=True):
    """Run a Python program in the sandbox: (passed: it exited 0 in time, a one-line
    error or None, the last 10 KB of its stdout). network_namespace=False: no new
    namespace, the audit hook alone keeps the program off the network (what it gets
    where the kernel refuses one)."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        # 1. the program in a fresh directory, and the child that will run it
        tmp = os.path.realpath(tmp)
        with open(os.path.join(tmp, "program.py"), "w") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin",
               "HOME": tmp,
               "TMPDIR": tmp,
               "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1"}
        cpu_seconds = math.ceil(timeout) + 1
        child = [str(memory_mb), str(cpu_seconds), str(int(network_namespace))]
        cmd = [sys.executable, "-I", os.path.abspath(__file__), *child]
        # 2. run it; outputs go to files (capped by RLIMIT_FSIZE), not pipes: no reader
        # threads, no buffers
        stdout_path = os.path.join(tmp, "stdout.txt")
        stderr_path = os.path.join(tmp, "stderr.txt")
        with open(stdout_path, "w+b") as out, open(stderr_path, "w+b") as err:
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True)
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                try:  # the whole process group: whatever the program left behind too
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait()
            stdout = _tail(out)
            stderr = _tail(err)
    # 3. the verdict, and the error's last line
    if rc is None:
        return False, f"timed out after {timeout:g} s", stdout
    if rc == 0:
        return True, None, stdout
    if rc < 0:
        return False, f"killed by signal {-rc}", stdout
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return False, lines[-1] if lines else f"exit status {rc}", stdout

# ------------------------------------------------------------------ in the child process


def isolate(memory_mb, cpu_seconds, network_namespace=True):
    """The child's limits: a new network namespace (if asked and allowed), no new
    processes, resource caps."""
    import resource
    import shutil
    import _posixsubprocess
    import _thread
    # 1. new user and network namespaces: no interface but a loopback that is down
    netns = False
    try:
        import ctypes
        CLONE_NEWUSER = 0x10000000
        CLONE_NEWNET = 0x40000000
        if network_namespace:
            libc = ctypes.CDLL(None, use_errno=True)
            netns = libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
    except Exception:
        pass
    # 2. ctypes forgotten, so that the program's own `import ctypes` is audited (and
    # refused)
    for m in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[m]

    # 3. no new processes: subprocess and multiprocessing call fork_exec without an
    # audit event
    def fork_exec(*args):
        raise PermissionError("sandbox: _posixsubprocess.fork_exec is not allowed")
    _posixsubprocess.fork_exec = fork_exec
    shutil._use_fd_functions = False  # rmtree by path: directory fds are refused below
    # not 8 MB a thread, which RLIMIT_AS would count against ~10 threads
    _thread.stack_size(2 << 20)
    # 4. the resource caps, hard = soft: the program cannot raise them again
    limits = [(resource.RLIMIT_AS, memory_mb << 20),
              (resource.RLIMIT_DATA, memory_mb << 20),
              (resource.RLIMIT_FSIZE, FILE_LIMIT),
              (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_CPU, cpu_seconds)]
    # counted per user namespace (Linux >= 5.14): it caps the program's own processes
    if netns:
        limits.append((resource.RLIMIT_NPROC, 64))
    for kind, value in limits:
        hard = resource.getrlimit(kind)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))


def audit_hook(tmp):
    """The hook that refuses the banned events and changes to paths outside `tmp`."""
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def outside(path):
        # an fd: the file it is open on (a pipe is not a path)
        if isinstance(path, int):
            path = os.readlink(f"/proc/self/fd/{path}")
            if not path.startswith("/"):
                return False
        # from the cwd, links followed
        path = os.path.realpath(os.fsdecode(os.fspath(path)))
        inside = path == tmp or path.startswith(tmp + "/")
        return not (inside or path == "/dev/null")

    def hook(event, args):
        # 1. the banned events, and the imports that would reach around the hook
        if event.startswith(BANNED):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in NO_IMPORT:
            # an ImportError, as for a missing optional dependency
            raise ImportError(f"sandbox: import {args[0]} is not allowed")
        # 2. files opened for writing outside tmp, and directory fds
        if event == "open":
            path, mode, flags = args
            writes = flags & WRITE or any(c in (mode or "") for c in "wax+")
            if writes and outside(path):
                raise PermissionError(f"sandbox: write outside its temp dir: {path}")
            # os.open hides dir_fd: no directory fds
            if mode is None and os.path.isdir(path):
                raise PermissionError("sandbox: os.open of a directory is not allowed: "
                                      f"{path}")
        # 3. paths changed outside tmp
        for i in CHANGED_PATHS.get(event, ()):
            if outside(args[i]):
                raise PermissionError(f"sandbox: {event} outside its temp dir: "
                                      f"{args[i]}")
    return hook


# the child: argv memory_mb, cpu_seconds, network namespace; cwd: tmp
if __name__ == "__main__":
    isolate(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
    # only now: the imports above are not audited
    sys.addaudithook(audit_hook(os.getcwd()))
    sys.argv = ["program.py"]
    sys.dont_write_bytecode = True
    with open("program.py") as f:
        program = compile(f.read(), "program.py", "exec")
    exec(program, {"__name__": "__main__", "__builtins__": __builtins__})
