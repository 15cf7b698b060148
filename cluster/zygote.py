"""A fork server for the local cluster's workers: JAX and the worker's modules imported once.

A worker's start is mostly its imports (JAX ~0.9 s of CPU of ~1.5 s, ``bench/startup.py``), paid by
every worker of a cluster at once on the same cores, and again by each fresh incarnation that replaces
a lost one. The local cluster starts one zygote first (``python -m rallypoint.cluster.zygote SOCKET``):
it imports the worker daemon's modules and JAX (no backend: nothing has started a thread or asked for
a device) and forks a worker for each request on its Unix socket, in a folder only this user can enter.
The child sets up what ``subprocess.Popen`` would (its own session, stdin from /dev/null, its output
appended to its log, the working directory and the whole environment of the request) and runs the
daemon command of its argv; the zygote answers its pid, and the launcher records it as any process
(pid and start time: :class:`~rallypoint.cluster.processes.ProcessRecord`).

Only where a fork gives the worker what a fresh process would: the CPU platform (a GPU worker's
device share is in its environment, read by JAX at import) and a worker on the loopback network (the
netns and proxy workers start under a command prefix). Anything else, or a zygote that does not answer,
starts the worker the usual way. The zygote reaps its children (SIGCHLD ignored); a worker killed or
ended is seen gone by its pid and start time, as before. The launcher's side (the socket's folder, a
request) is :mod:`rallypoint.cluster.zygote_client`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

_MAX_REQUEST_BYTES = 1 << 20


def _child(listener: socket.socket, request: dict[str, object]) -> None:
    """In the forked child: become the worker of ``request``; never returns."""
    code = 1
    try:
        listener.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the worker waits on its own children
        os.setsid()
        out = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        nul = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nul, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(nul)
        os.chdir(str(request["cwd"]))
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in dict(request["env"]).items()})  # type: ignore[call-overload]
        from rallypoint.cluster import daemons

        sys.argv = [daemons.__file__, *[str(a) for a in list(request["argv"])]]  # type: ignore[call-overload]
        try:
            daemons.main()
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            if done.code not in (None, 0) and not isinstance(done.code, int):
                print(done.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - whatever it is, it is the worker's error, in its log
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve(sock: Path) -> None:
    """The zygote: import, then fork a worker for each request on ``sock`` until killed."""
    from rallypoint.cluster import daemons  # noqa: F401 - the command, its options
    from rallypoint.workers import daemon  # noqa: F401 - the worker's modules
    import jax  # noqa: F401 - imported only: no backend, no thread

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    listener = socket.socket(socket.AF_UNIX)
    tmp = sock.with_name(sock.name + ".tmp")
    listener.bind(str(tmp))
    os.chmod(tmp, 0o600)
    listener.listen(64)
    os.replace(tmp, sock)  # ready once it is there
    print(json.dumps({"event": "zygote.ready", "socket": str(sock), "pid": os.getpid()}), flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                conn.settimeout(10.0)
                request = json.loads(conn.makefile("rb").readline(_MAX_REQUEST_BYTES))
                pid = os.fork()
                if pid == 0:
                    _child(listener, request)
                conn.sendall(f"{pid}\n".encode())
            except Exception as exc:  # noqa: BLE001 - one bad request must not end the zygote
                print(json.dumps({"event": "zygote.refused", "error": repr(exc)}), flush=True)
                try:
                    conn.sendall(b"error\n")
                except OSError:
                    pass


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
