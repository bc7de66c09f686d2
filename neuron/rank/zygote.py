"""The warm parent of a leader's ranks: a process that has imported torch once and forks a rank
for each order the leader sends, so that a rank starts without the 1.5-2 s of CPU that importing
torch takes (and a group of N ranks without N of them). It never runs a torch operation itself
(no thread pool, no CUDA context to inherit). Orders and reports are JSON lines on two pipes the
leader passes (``neuron/rank_forks.py``): ``{"args", "env"}`` in; ``{"pid"}`` after each fork and
``{"exit", "code"}`` when a rank exits out. It dies with the leader, and its ranks with it."""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import sys
import traceback


def _die_with_parent(parent: int) -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before we asked
        os._exit(1)


def _child(order: dict, closing: list[int]) -> None:
    """The forked rank: the leader's environment for it, a seed of its own, then the rank's main."""
    code = 1
    try:
        for fd in closing:
            os.close(fd)
        os.environ.clear()
        os.environ.update(order["env"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        import torch

        torch.seed()  # not the zygote's generator state, shared by every fork
        if os.environ.get("OMP_NUM_THREADS"):  # OpenMP read the zygote's environment when torch loaded
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        from neuron.rank.process import main

        sys.argv = ["python -m neuron.rank", *order["args"]]
        main(order["args"])  # exits the process itself
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    orders, reports = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent(int(sys.argv[3]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the leader decides when ranks stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    importlib.import_module("torch")  # the point of this process: every fork starts with it imported
    importlib.import_module("gguf")  # the GGUF reader's (numpy only): a tenth of a second a rank saves

    sel = selectors.DefaultSelector()
    sel.register(orders, selectors.EVENT_READ, None)
    me, buf = os.getpid(), b""

    def report(msg: dict) -> None:
        os.write(reports, json.dumps(msg).encode() + b"\n")

    while True:
        for key, _ in sel.select():
            if key.data is None:
                chunk = os.read(orders, 1 << 16)
                if not chunk:  # the leader is gone
                    os._exit(0)
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    order = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        sel_fds = [k.fd for k in sel.get_map().values()]
                        sel.close()
                        _die_with_parent(me)
                        _child(order, sorted({orders, reports, *sel_fds}))
                    sel.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
                    report({"pid": pid})
            else:
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(key.data, 0)
                report({"exit": key.data, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
