"""Launching other processes from a test, bounded: every launch runs in a process group of its
own with a deadline, and whatever happens (a pass, a failure, a timeout, an interrupt) the
whole group is killed before the test goes on, so no rank a launcher left behind keeps a GPU,
a port or the output pipes (on which a plain subprocess.run would then wait forever). A test
that runs out of time fails with the tail of what the processes printed."""
import contextlib
import os
import signal
import subprocess
import time

import pytest

TAIL = 4000


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def launched(argv, *, env=None, **kw):
    """Popen(argv) in a new session (stdout and stderr piped, text); its process group is
    killed when the block ends."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **kw)
    try:
        yield proc
    finally:
        kill_group(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)


def finish(proc: subprocess.Popen, argv, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of a launched process that must end within timeout seconds; on a
    timeout the group is killed and the test fails with the tail of its stderr."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate(timeout=30)       # the pipes close with the group
        pytest.fail(f"{' '.join(map(str, argv[:8]))} ... did not end within {timeout:.0f} s; "
                    f"the end of its stderr:\n{(err or '')[-TAIL:]}")


def run_bounded(argv, *, env=None, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True), bounded (see the module)."""
    with launched(argv, env=env) as proc:
        out, err = finish(proc, argv, timeout)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def spawn_bounded(fn, args, nprocs: int, timeout: float = 240.0) -> None:
    """torch.multiprocessing's spawn of fn(rank, *args) on nprocs processes, bounded: each
    is killed at the deadline or when another fails; a rank's exception is raised here."""
    import torch.multiprocessing as mp
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                pytest.fail(f"rank(s) {', '.join(map(str, alive))} of {nprocs} still running "
                            f"after {timeout:.0f} s (killed; what they printed is in the "
                            f"captured output above)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
