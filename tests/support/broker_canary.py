"""A canary beside reapers under test: how long the broker and the machine take to acknowledge a
tiny record, measured by a process that is not the reaper.

A reaper fences when none of its heartbeats is acknowledged within `heartbeat_timeout`; that is
the election working when the broker or the machine stalls for that long, and a fault of the
reaper when they do not. The canary tells the two apart: it produces one record (acks=all) every
CANARY_EVERY seconds from its own process and connection and writes a JSON line per record with
its wall-clock send and acknowledgement times, so a test can ask whether the broker was slow for
everyone at the moment a reaper fenced.

Run as a script: `python broker_canary.py <bootstrap> <topic> <out.jsonl>`; it stops on SIGTERM.
`Canary` starts and stops it, and reads its lines back.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CANARY_EVERY = 0.1


@dataclass(frozen=True)
class Probe:
    sent: float  # unix time
    acked: float | None  # unix time; None if never acknowledged


def _run(bootstrap: str, topic: str, out_path: str) -> None:
    from confluent_kafka import Producer

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0, "enable.idempotence": False})
    out = open(out_path, "a", buffering=1)
    pending: dict[int, float] = {}

    def acked(err, msg, seq: int) -> None:  # noqa: ANN001 - confluent_kafka's callback shape
        sent = pending.pop(seq, None)
        if sent is not None:
            out.write(json.dumps({"sent": sent, "acked": time.time() if err is None else None}) + "\n")

    seq = 0
    while not stop.is_set():
        seq += 1
        pending[seq] = time.time()
        try:
            producer.produce(topic, b"canary", on_delivery=lambda e, m, s=seq: acked(e, m, s))
        except BufferError:
            pass
        producer.poll(CANARY_EVERY)
    producer.flush(5)
    for sent in pending.values():  # never acknowledged while the canary ran
        out.write(json.dumps({"sent": sent, "acked": None}) + "\n")
    out.close()


class Canary:
    def __init__(self, bootstrap: str, topic: str, out_path: Path) -> None:
        self.out_path = out_path
        self._proc = subprocess.Popen([sys.executable, __file__, bootstrap, topic, str(out_path)])

    def stop(self) -> list[Probe]:
        self._proc.send_signal(signal.SIGTERM)
        self._proc.wait(30)
        probes = []
        for line in self.out_path.read_text().splitlines():
            row = json.loads(line)
            probes.append(Probe(row["sent"], row["acked"]))
        return sorted(probes, key=lambda p: p.sent)


def slow_for_everyone(probes: list[Probe], fenced_at: float, heartbeat_timeout: float) -> bool:
    """Whether the canary saw the broker or the machine stall around a fence at `fenced_at`.

    A fence at F means no heartbeat sent in the last `heartbeat_timeout` before F had been
    acknowledged by F. It is explained when a canary record sent in that window (and a little
    before, for clocks read by different processes) took more than half of `heartbeat_timeout` to be
    acknowledged or never was, or when the canary itself sent nothing for that long (its process
    starved as well)."""
    start, end = fenced_at - heartbeat_timeout - 1.0, fenced_at + 0.5
    window = [p for p in probes if start <= p.sent <= end]
    if any(p.acked is None or p.acked - p.sent > heartbeat_timeout / 2 for p in window):
        return True
    sends = [start] + [p.sent for p in window] + [end]
    return any(b - a > heartbeat_timeout / 2 for a, b in zip(sends, sends[1:], strict=False))


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2], sys.argv[3])
