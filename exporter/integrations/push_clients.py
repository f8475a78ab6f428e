"""The push clients of one engine hook in one process: one RankClient per rank identity, made and started
on first use, forgotten in a forked child (its pusher threads and sockets are the parent's), and closed
(last snapshot, then bye) when the process exits, whichever way it leaves."""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing.util
import os
import threading
from collections.abc import Callable

from exporter.client import RankClient
from exporter.defaults import DEFAULT_PUSH_INTERVAL, ENV_PUSH_INTERVAL, ENV_SOCKET

log = logging.getLogger("hicache_exporter.integrations")

Identity = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]
MakeClient = Callable[[dict[str, int], dict[str, str]], RankClient]


def set_push_environment(socket_path: str | os.PathLike[str] | None, interval: float | None) -> None:
    """Set the socket and push interval a hook's clients use (`HICACHE_EXPORTER_SOCKET`,
    `HICACHE_EXPORTER_PUSH_INTERVAL`) in this process's environment, which the processes it starts inherit."""
    if socket_path is not None:
        os.environ[ENV_SOCKET] = os.fspath(socket_path)
    if interval is not None:
        if not 0 < interval < math.inf:
            raise ValueError(f"interval must be a positive number of seconds, got {interval}")
        os.environ[ENV_PUSH_INTERVAL] = repr(float(interval))


def push_interval() -> float:
    """`HICACHE_EXPORTER_PUSH_INTERVAL` in seconds; the default (logged once per client) where it is no positive number."""
    text = os.environ.get(ENV_PUSH_INTERVAL)
    if not text:
        return DEFAULT_PUSH_INTERVAL
    try:
        interval = float(text)
    except ValueError:
        interval = math.nan
    if not 0 < interval < math.inf:
        log.warning("%s=%r is not a positive number of seconds; pushing every %s s",
                    ENV_PUSH_INTERVAL, text, DEFAULT_PUSH_INTERVAL)
        return DEFAULT_PUSH_INTERVAL
    return interval


class ProcessPushClients:
    """One hook's push clients in the current process, by rank identity (`make` builds one, unstarted)."""

    def __init__(self, make: MakeClient) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._clients: dict[Identity, RankClient] = {}
        # Rises in a forked child and at close(): metrics that bound push children before bind them again.
        self.generation = 0
        self._exit_hooks_pid: int | None = None  # the process that registered the exit hooks
        self._exiting_pid: int | None = None  # the process whose exit hooks have run
        os.register_at_fork(after_in_child=self._forget_parent)

    @property
    def clients(self) -> dict[Identity, RankClient]:
        """This process's clients (none in a process that has not pushed yet)."""
        return self._clients if self._pid == os.getpid() else {}

    def client(self, rank: dict[str, int], static: dict[str, str]) -> RankClient:
        """The started client of this rank identity; RuntimeError once this process's exit hooks have run."""
        key: Identity = (tuple(sorted(rank.items())), tuple(sorted(static.items())))
        client = self.clients.get(key)
        if client is not None:
            return client
        with self._lock:
            if self._exiting_pid == os.getpid():
                raise RuntimeError("this process has pushed its last snapshot (interpreter exit)")
            client = self._clients.get(key)
            if client is None:
                client = self._make(rank, static)
                self._push_at_exit()
                client.start()
                self._clients[key] = client
                log.info("pushing rank %s %s to %s", rank, static, client.socket_path)
        return client

    def close(self) -> None:
        """Push this process's last snapshots and say bye now; series bound later start new clients (new epochs)."""
        with self._lock:
            if self._pid != os.getpid():
                return
            clients, self._clients = list(self._clients.values()), {}
            self.generation += 1
        for client in clients:
            client.close()

    def _forget_parent(self) -> None:
        self._pid, self._clients = os.getpid(), {}  # the parent's threads do not exist here; its sockets are its own
        self._lock = threading.Lock()  # a fork while another thread held it would leave it held forever
        self.generation += 1

    def _at_exit(self) -> None:
        self._exiting_pid = os.getpid()  # no new clients from here on: what binds now stays prometheus_client's
        self.close()

    def _push_at_exit(self) -> None:
        if self._exit_hooks_pid == os.getpid():
            return
        self._exit_hooks_pid = os.getpid()
        atexit.register(self._at_exit)
        # A child started by multiprocessing's fork or forkserver methods leaves through os._exit,
        # skipping atexit; multiprocessing runs its exit-priority finalizers first.
        multiprocessing.util.Finalize(None, self._at_exit, exitpriority=10)
