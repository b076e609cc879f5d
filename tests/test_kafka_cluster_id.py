"""The KRaft cluster ids the local-services scripts mint (deploy/local/services_kafka.py, cluster_kafka.py).

Kafka's storage tool reads an id that starts with '-' as an option and refuses to format; one in 64
URL-safe base64 ids does. The ids are drawn from uuid4, so the draws are replaced here by chosen
bytes to reach that case every time rather than once in 64 runs.
"""

from __future__ import annotations

import base64
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

LOCAL = Path(__file__).resolve().parents[1] / "deploy" / "local"
sys.path.insert(0, str(LOCAL))
import cluster_kafka  # noqa: E402
import services_kafka  # noqa: E402

# 0xF8 as the first byte puts index 62 of the URL-safe alphabet, '-', first
DASHED = uuid.UUID(bytes=b"\xf8" + bytes(15))


def _draws(monkeypatch: pytest.MonkeyPatch, ids: list[uuid.UUID]) -> list[uuid.UUID]:
    queue = list(ids)
    monkeypatch.setattr(services_kafka.uuid, "uuid4", lambda: queue.pop(0))
    return queue


def _decoded(cid: str) -> bytes:
    return base64.urlsafe_b64decode(cid + "==")


def test_a_dashed_draw_is_redrawn(monkeypatch: pytest.MonkeyPatch) -> None:
    good = uuid.UUID(bytes=b"\x00" + bytes(range(1, 16)))
    left = _draws(monkeypatch, [DASHED, DASHED, good])
    cid = services_kafka.new_kafka_cluster_id()
    assert not left
    assert _decoded(cid) == good.bytes
    assert base64.urlsafe_b64encode(DASHED.bytes).decode().startswith("-")


@given(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=8))
def test_the_id_is_the_first_draw_the_storage_tool_accepts(draws: list[bytes]) -> None:
    ids = [uuid.UUID(bytes=b) for b in draws] + [uuid.UUID(bytes=b"\x00" * 16)]
    queue = list(ids)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(services_kafka.uuid, "uuid4", lambda: queue.pop(0))
        cid = services_kafka.new_kafka_cluster_id()
    expected = next(u for u in ids if not base64.urlsafe_b64encode(u.bytes).decode().startswith("-"))
    assert _decoded(cid) == expected.bytes
    assert len(cid) == 22 and "=" not in cid and not cid.startswith("-")


def test_the_cluster_keeps_its_id_and_replaces_a_dashed_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cluster_kafka, "DIR", tmp_path)
    first = cluster_kafka.cluster_id()
    assert cluster_kafka.cluster_id() == first  # stable across calls: every broker formats with it
    (tmp_path / "kafka-cluster-id").write_text("-" + first[1:] + "\n")  # left by an older script
    replaced = cluster_kafka.cluster_id()
    assert not replaced.startswith("-") and len(replaced) == 22
    assert cluster_kafka.cluster_id() == replaced
