"""A throwaway ``redis-server`` on 127.0.0.1, for tests and ``fsm-cache bench storage``.

It listens on a free loopback port, keeps its files in a directory of its own,
and is killed when the ``with`` block ends. ``make test`` installs
``redis-server`` (``.ci/system-deps``); elsewhere :func:`redis_server_path` is None
and the tests that need one skip. Options reproduce what the shared-store tests
need: a ``maxmemory`` cap with an eviction policy, and an append-only file
synced on every write so a restarted server holds everything it acknowledged.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


STARTUP_SECONDS = 10.0
PORT_TRIES = 5
"""How many free ports a first start tries: another process may take one before the server binds it."""


def redis_server_path() -> str | None:
    """Return the ``redis-server`` executable on PATH, or None."""
    return shutil.which("redis-server")


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1.

    Args:
        directory: Where the server keeps its files (the append-only file).
        maxmemory: The server's memory cap in bytes, or None for none.
        policy: What the server evicts at the cap (``allkeys-lru``,
            ``noeviction``, ...).
        durable: Keep an append-only file, synced on every write, so a server
            killed and started again holds every page it acknowledged.
    """

    def __init__(
        self,
        directory: Path,
        *,
        maxmemory: int | None = None,
        policy: str = "allkeys-lru",
        durable: bool = False,
    ) -> None:
        executable = redis_server_path()
        if executable is None:
            raise FileNotFoundError("redis-server is not installed (make test installs it)")
        self.executable = executable
        self.directory = directory
        self.maxmemory = maxmemory
        self.policy = policy
        self.durable = durable
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None
        self._clients: list[redis.Redis] = []
        self._started = False

    @property
    def url(self) -> str:
        """The server's address for :meth:`RedisStore.connect`."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """Return a new client of this server (its own connections, closed when the ``with`` ends).

        It retries a failed connection once, without waiting: a test that kills
        the server wants the failure, not redis-py's default backoff.
        """
        client = redis.Redis(host="127.0.0.1", port=self.port, retry=Retry(NoBackoff(), 1))
        self._clients.append(client)
        return client

    def start(self) -> None:
        """Start the server (again, on the same port and files) and wait until it answers.

        The port was free when it was chosen, and another process (a server of
        a test running alongside, a connection's own port) may take it before
        this server binds it: the server then exits, and a first start tries a
        new port (a restart keeps its port, which its clients hold).

        Raises:
            RuntimeError: The server did not answer within ``STARTUP_SECONDS``,
                or exited on each port tried; with its log's tail.
        """
        first = not self._started
        for _ in range(PORT_TRIES if first else 1):
            if self._launch():
                self._started = True
                return
            if first:
                self.port = free_port()
        tail = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server did not start:\n{tail}")

    def _launch(self) -> bool:
        """Run the server on ``port``; return whether it answers, or False once it ended.

        Only its own answer counts (INFO's ``process_id``): on a port another
        server took first, that server would answer the ping while this one exits.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        log = (self.directory / "redis.log").open("ab")
        self._process = process = subprocess.Popen(self._command(), stdout=log, stderr=log)
        log.close()
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=STARTUP_SECONDS)
        deadline = time.monotonic() + STARTUP_SECONDS
        try:
            while process.poll() is None and time.monotonic() <= deadline:
                try:
                    if probe.info("server")["process_id"] == process.pid:
                        return True
                except redis.exceptions.RedisError:  # not listening yet, or not a redis server
                    pass
                time.sleep(0.02)
        finally:
            probe.close()
        self.kill()
        return False

    def kill(self) -> None:
        """Kill the server at once (SIGKILL) and reap it; its pages in memory are lost."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.kill()
        for client in self._clients:
            client.close()

    def _command(self) -> list[str]:
        command = [self.executable, "--bind", "127.0.0.1", "--port", str(self.port)]
        command += ["--dir", str(self.directory), "--save", "", "--daemonize", "no"]
        command += ["--loglevel", "warning", "--maxmemory-policy", self.policy]
        if self.maxmemory is not None:
            command += ["--maxmemory", str(self.maxmemory)]
        if self.durable:
            command += ["--appendonly", "yes", "--appendfsync", "always"]
        return command


class KillsServer:
    """A client that kills ``server`` just before its ``kill_at``-th pipeline (1-based).

    Everything else is the wrapped client's; ``kill_at`` 0 never kills, and a
    test may set it later (``pipelines`` counts the pipelines opened so far).
    """

    def __init__(self, client: redis.Redis, server: RedisServer, kill_at: int = 0) -> None:
        self.client = client
        self.server = server
        self.kill_at = kill_at
        self.pipelines = 0

    def pipeline(self, transaction: bool) -> Any:
        """Open a pipeline, first killing the server if this is the ``kill_at``-th."""
        self.pipelines += 1
        if self.pipelines == self.kill_at:
            self.server.kill()
        return self.client.pipeline(transaction=transaction)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def free_port() -> int:
    """Return a loopback port nothing listens on now (it may be taken before it is bound)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
