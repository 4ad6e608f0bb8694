"""A warm torchrun for the tests: real torchrun, ranks forked from a process that has
already imported torch and torchtitan.

Why: a CPU launch costs about 9 s before its first step (torchrun imports torch, then
every rank imports torch and torchtitan: ``-X importtime`` is dominated by
``torch._inductor``/``torch._dynamo`` through torchtitan's float8 and Flex modules),
and the suite launches training some 70 times. One server process (``serve``) pays
the imports once; each launch forks it, and the fork runs torchrun's own ``main``
(rendezvous, the elastic agent: unchanged) with ``--start-method
fork --run-path`` so that its ranks are forks too. What a rank runs is
``titan_ledger.train.main`` with the launch's argv, environment and working
directory, as under a cold torchrun. One difference: torchrun's fork start method reports
ONE failed rank (the first its poll finds), its subprocess one every rank that failed; a
test of which rank the launcher names when two die close together launches cold
(``child_env(warm=False)``).

``python tests/warm_launch.py train SOCKET <train args>`` is the same for one process
without torchrun (``python -m titan_ledger.train``: the GPU configs' dry runs on the fake
backend, each otherwise ~10 s of imports).

The client (``python tests/warm_launch.py client SOCKET <torchrun args>``) is what a
test or a tool starts instead of ``python -m torch.distributed.run``: it hands its
stdout/stderr, environment, cwd and argv to the server and exits with torchrun's exit
code. Killing the client kills the launch: the forked torchrun watches the client's
socket and SIGKILLs its process group (itself and every rank) when the client is gone,
so ``kill9_tree(client pid)`` behaves as on a cold launch. If the server cannot be
reached the client runs the cold torchrun itself (``os.execv``).

The tools' own launches (``replay drill``, ``rerun``, ``diagnose --rerun``) take it
through ``TITAN_LEDGER_TORCHRUN`` (``titan_ledger/tools/runs.py``), set by
``tests/helpers.child_env``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading

ENTRY = os.path.abspath(__file__)


def _torchrun_argv(argv: list[str]) -> list[str]:
    """``[opts..., -m, titan_ledger.train, args...]`` -> torchrun argv whose ranks are
    forks running this file's ``rank_main``."""
    if "-m" not in argv or argv[argv.index("-m") + 1] != "titan_ledger.train":
        raise ValueError(f"warm_launch: only `-m titan_ledger.train` launches, got {argv}")
    i = argv.index("-m")
    return [*argv[:i], "--start-method", "fork", "--run-path", ENTRY, "rank", *argv[i + 2:]]


def _agent(conn: socket.socket, req: dict) -> None:
    """In the fork: become the launch (its env, cwd, fds), run torchrun, report its code."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # one process group: the launch and its ranks, killed together

    def watch() -> None:  # the client is gone (killed, timed out): so is the launch
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    code = 1
    try:
        if req.get("train"):  # one process, no torchrun (a dry run on the fake backend)
            from titan_ledger.train import main

            sys.argv = ["titan_ledger.train", *req["argv"]]
            main(req["argv"])
            code = 0
        else:
            import torch.distributed.run as run

            sys.argv = ["torchrun", *_torchrun_argv(req["argv"])]
            run.main(sys.argv[1:])
            code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # torchrun's failure (ChildFailedError): its traceback, exit 1 as torchrun
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        conn.sendall(code.to_bytes(4, "little", signed=True))
    except OSError:
        pass
    os._exit(code)


def serve(path: str) -> None:
    """Import what a rank imports, then fork one launch per connection (single-threaded:
    a fork must not copy another thread's held locks)."""
    from titan_ledger.rehearsal import backend

    backend.ensure_installed()
    from titan_ledger import train

    train.quiet_imports()
    import torch.distributed.run  # noqa: F401
    import torchtitan.train  # noqa: F401

    import titan_ledger.trainer  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launches are reaped by the kernel
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # clients see the socket only once it listens
    srv.listen(64)
    srv.settimeout(5)
    parent = os.getppid()
    while True:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test session is gone (killed): so is its server
                os._exit(0)
            continue
        conn.settimeout(None)
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
            while not msg.endswith(b"\n"):
                msg += conn.recv(1 << 22)
            req = json.loads(msg)
        except (OSError, ValueError):
            conn.close()
            continue
        if os.fork() == 0:
            srv.close()
            for target, fd in zip((0, 1, 2), fds):
                os.dup2(fd, target)
                os.close(fd)
            _agent(conn, req)
        for fd in fds:
            os.close(fd)
        conn.close()


def client(path: str, argv: list[str], train: bool = False) -> int:
    """``train``: ``python -m titan_ledger.train ARGV`` in one process (no torchrun)."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
    except OSError:  # no server: the cold launch
        cold = ["-m", "titan_ledger.train"] if train else ["-m", "torch.distributed.run"]
        os.execv(sys.executable, [sys.executable, *cold, *argv])
    req = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                      "train": train}).encode() + b"\n"
    socket.send_fds(conn, [req], [0, 1, 2])
    got = b""
    while len(got) < 4:
        part = conn.recv(4 - len(got))
        if not part:  # the launch died without a code (the server was killed)
            return 1
        got += part
    return int.from_bytes(got, "little", signed=True)


def rank_main() -> None:
    """A rank (under ``--run-path``): ``titan_ledger.train``'s entry with the launch's argv.
    Returning (not ``os._exit``) lets torch's worker wrapper report it; the fork then
    leaves through ``os._exit`` without interpreter finalization."""
    from titan_ledger.train import main

    main(sys.argv[2:])


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "client":
        sys.exit(client(sys.argv[2], sys.argv[3:]))
    elif sys.argv[1] == "train":
        sys.exit(client(sys.argv[2], sys.argv[3:], train=True))
    elif sys.argv[1] == "rank":
        rank_main()
