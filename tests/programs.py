"""The tests' program runner: run(argv, ...) runs `python ARGV` (a script path, or "-m", module) as a
user would and returns a subprocess.CompletedProcess (returncode, stdout, stderr).

A fresh interpreter spends seconds on 2 cores importing torch, fp8a2a and megatron-core before a
program does anything, and the suite runs dozens of programs. So each run is forked from a warm
process instead (multiprocessing's forkserver, which imported those modules once and has run
nothing else): the program still runs as `__main__` with its own argv, working folder and
environment, in a process of its own, with its output and exit status captured as
subprocess.run would capture them, and anything it starts (spawned ranks, torchrun) is started
as usual. The timeout is hard: a run still going after it is killed and raises
subprocess.TimeoutExpired."""
import atexit
import importlib.util
import multiprocessing as mp
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PRELOAD = ["torch", "fp8a2a", "fp8a2a.bench.cli", "matplotlib.pyplot", "megatron.core"]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload([m for m in PRELOAD if importlib.util.find_spec(m.split(".")[0])])
    return _ctx


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)  # sys.exit("message"), as the interpreter does
    return 1


def _main(argv, cwd, env, out_path, err_path):
    """In the forked process: become `python ARGV` and exit with its status."""
    os.setpgid(0, 0)  # a group of its own: a timeout kills what it started too
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read when torch loaded, in the warm process: apply it again
        import torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.stdin = open(os.devnull)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)  # as `python -m` does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT` does
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # the program's own exit handlers, as at interpreter exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def default_env(**extra):
    """This environment with the checkout on PYTHONPATH, and extra."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **extra)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a program's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*argv, cwd=ROOT, env=None, timeout=600, check=False):
    """`python ARGV` in cwd (default: the checkout) with env (default: default_env()); a
    CompletedProcess with text stdout and stderr. check: assert it exited 0, with its output's tail."""
    argv = [str(a) for a in argv]
    env = default_env() if env is None else env
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "w").close()
        p = _context().Process(target=_main, args=(argv, str(cwd), dict(env), out, err))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, _read(out), _read(err))
        done = subprocess.CompletedProcess([sys.executable, *argv], p.exitcode, _read(out), _read(err))
    if check:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def _read(path):
    with open(path, errors="replace") as f:
        return f.read()
