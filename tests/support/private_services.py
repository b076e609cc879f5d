"""PRIVATE Postgres / Kafka instances for tests that restart a service (never the shared ones)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from .ports import free_port

SERVICES = Path(__file__).resolve().parents[2] / "deploy" / "local" / "services.py"


class PrivateServices:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="reaper-private-"))
        os.chmod(self.dir, 0o755)  # the postgres server user must reach its data folder
        self.pg_port, self.kafka_port, self.controller_port = free_port(), free_port(), free_port()
        self.pgbouncer_port = free_port()
        self.env = dict(
            os.environ,
            OUTBOX_LOCAL_DIR=str(self.dir),
            OUTBOX_PG_PORT=str(self.pg_port),
            OUTBOX_KAFKA_PORT=str(self.kafka_port),
            OUTBOX_KAFKA_CONTROLLER_PORT=str(self.controller_port),
            OUTBOX_KAFKA_HEAP="384m",
            OUTBOX_PGBOUNCER_PORT=str(self.pgbouncer_port),
            OUTBOX_SPARK="0",
        )  # no Spark cluster of their own

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.pg_port}/outbox"

    @property
    def pgbouncer_dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.pgbouncer_port}/outbox"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    def _run(self, action: str, only: str | None) -> None:
        args = [sys.executable, str(SERVICES), action] + (["--only", only] if only else [])
        r = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"private services {action} {only or ''} failed:\n{r.stdout}\n{r.stderr}")

    def up(self, only: str | None = None) -> PrivateServices:
        self._run("up", only)
        return self

    def down(self, only: str | None = None) -> None:
        self._run("down", only)

    def destroy(self) -> None:
        try:
            self.down()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
