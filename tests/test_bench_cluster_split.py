"""bench.cluster's split of a broker fault's gap: Kafka's failover (metadata), Kafka writable again
(the probe's records read back) and the reaper's share (the rest). Pure arithmetic over recorded
times: no service is contacted."""

from __future__ import annotations

from types import SimpleNamespace

from bench.cluster_gaps import PARTITIONS, gap_after, split


def test_the_reaper_share_is_what_the_gap_adds_to_the_probe():
    watch = SimpleNamespace(at=102.0)
    parts = split(4.5, 100.0, watch, 3.25)
    assert parts == {"gap": 4.5, "kafka_failover": 2.0, "kafka_writable": 3.25, "reaper": 1.25}


def test_without_a_probe_figure_the_reaper_share_is_unknown():
    parts = split(4.5, 100.0, SimpleNamespace(at=None), None)
    assert parts["reaper"] is None and parts["kafka_failover"] is None and parts["gap"] == 4.5


def test_the_probe_gap_counts_only_records_sent_after_the_fault_on_every_partition():
    since = 100.0
    # per partition: one probe record sent before the fault (read back late, not counted) and one after
    sent = {}
    arrived = {}
    for p in range(PARTITIONS):
        sent[b"probe-old-%d" % p] = since - 1
        arrived[b"probe-old-%d" % p] = (since + 0.5, p)
        sent[b"probe-new-%d" % p] = since + 0.1
        arrived[b"probe-new-%d" % p] = (since + 1.0 + p, p)
    got = gap_after(SimpleNamespace(sent=sent), SimpleNamespace(arrived=arrived), since, timeout=1)
    assert got == PARTITIONS  # the last partition's first record sent after the fault: 1 + (PARTITIONS - 1)


def test_the_probe_gap_waits_for_every_partition():
    since = 100.0
    sent = {b"probe-1": since + 0.1}
    arrived = {b"probe-1": (since + 1.0, 0)}
    assert gap_after(SimpleNamespace(sent=sent), SimpleNamespace(arrived=arrived), since, timeout=0.3) is None


def test_the_appended_gap_counts_the_leaders_append_times_not_the_arrivals():
    since = 100.0
    sent = {b"probe-new-%d" % p: since + 0.1 for p in range(PARTITIONS)}
    # appended 1 s after the fault, read back by the bench's consumer only 4 s later
    arrived = {v: (since + 5.0, p) for p, v in enumerate(sent)}
    appended = {v: (since + 1.0 + p / 10, p) for p, v in enumerate(sent)}
    reader = SimpleNamespace(arrived=arrived, appended=appended)
    assert gap_after(SimpleNamespace(sent=sent), reader, since, timeout=1) == 5.0
    assert gap_after(SimpleNamespace(sent=sent), reader, since, timeout=1, appended=True) == round(
        1.0 + (PARTITIONS - 1) / 10, 3
    )


def test_a_record_appended_before_the_fault_is_not_the_first_after_it():
    since = 100.0
    # committed (its commit returned) just after the signal, but appended by the old leader before it
    sent = {b"probe-early-%d" % p: since + 0.01 for p in range(PARTITIONS)}
    sent.update({b"probe-late-%d" % p: since + 0.5 for p in range(PARTITIONS)})
    appended = {b"probe-early-%d" % p: (since - 0.02, p) for p in range(PARTITIONS)}
    appended.update({b"probe-late-%d" % p: (since + 3.0, p) for p in range(PARTITIONS)})
    reader = SimpleNamespace(arrived={}, appended=appended)
    assert gap_after(SimpleNamespace(sent=sent), reader, since, timeout=1, appended=True) == 3.0
