"""The console's pages with real data: thousands separators and keyset pages, any query text
answered, dead-lettered acks newest first with their reasons, and the overview's acker lag for
every schema's ack topic."""

from __future__ import annotations

import re
import uuid

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.console_server import VIEWER, cfg, client, server, state_of, viewer  # noqa: F401  (fixtures)
from support.harness import wait_until
from support.http_server import TOKEN

import tracker


def test_pages_show_real_data_with_thousands_separators_and_keyset_pages(server, cfg, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".outbox (topic, value) SELECT %s, %s FROM generate_series(1, 1234)', ["t", b"v"]
        )
        parent = tracker.open_batch(conn, user_key="catalog-7", schema=schema)
        tracker.add_items(conn, parent, 12345, schema=schema)
        tracker.ack(conn, [f"{parent.id}:0:0-99"], schema=schema, claims=False)
        tracker.fail(conn, [f"{parent.id}:0:100"], "image missing", schema=schema)
        child = tracker.open_batch(conn, parent=parent, schema=schema)
        done = tracker.open_batch(conn, user_key="done-1", schema=schema)
        tracker.close_batch(conn, done, schema=schema)
        more = [tracker.open_batch(conn, schema=schema).id for _ in range(4)]
    c = client(server, TOKEN)
    overview = c.get("/console/")
    assert overview.status_code == 200
    # 1,234 rows and the completion event of `done`
    assert re.search(r'data-figure="backlog">1,235 rows', overview.text), overview.text
    assert "default" in overview.text and "Acker lag" in overview.text
    fragment = c.get("/console/fragments/overview")
    assert fragment.status_code == 200 and "<html" not in fragment.text and "1,235" in fragment.text

    found = c.get("/console/batches", params={"q": "catalog-7"}).text
    assert f'data-batch="{parent.id}"' in found and "100 acked, 1 failed, 12,244 pending of 12,345" in found
    assert f'data-batch="{done.id}"' in c.get("/console/batches", params={"q": str(done.id)}).text
    assert f'data-batch="{done.id}"' in c.get("/console/batches", params={"view": "finished"}).text

    page = c.get(f"/console/batches/{parent.id}").text
    assert "image missing" in page and f"{parent.id}:0:101-" in page and f"/console/batches/{child.id}" in page
    assert "12,345" in page and "Not yet" in page
    assert "Written to the outbox" in c.get(f"/console/batches/{done.id}").text

    # Keyset pages (3 rows each) walk every unfinished batch exactly once, newest first.
    seen, url = [], "/console/batches?view=unfinished"
    while url:
        r = c.get(url)
        seen += [int(x) for x in re.findall(r'data-batch="(\d+)"', r.text)]
        nxt = re.search(r'rel="next" href="([^"]+)"', r.text)
        url = nxt.group(1).replace("&amp;", "&") if nxt else ""
    assert seen == sorted([parent.id, child.id, *more], reverse=True)
    for bad in ("/console/batches?view=nope", "/console/batches?before=1;drop", "/console/batches/1?after=x"):
        assert c.get(bad).status_code == 400, bad
    assert c.get("/console/batches/987654321").status_code == 404


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(max_size=40),
    where=st.sampled_from(
        [
            ("/console/batches", "q"),
            ("/console/dead", "reason"),
            ("/console/batches", "before"),
            ("/console/dead", "after"),
        ]
    ),
)
def test_any_query_text_is_answered_not_crashed(viewer, where, text):
    path, name = where
    r = viewer.get(path, params={name: text})
    assert r.status_code in (200, 400), (text, r.status_code, r.text[:300])


def test_dead_lettered_acks_are_listed_newest_first_with_their_reasons(server, cfg, pg_dsn, schema, kafka_bootstrap):
    from support.acking import make_acker, produce_raw
    from support.acking import running as acker_running

    with psycopg.connect(pg_dsn) as conn:
        b = tracker.open_batch(conn, schema=schema)
        tracker.add_items(conn, b, 2, schema=schema)
    a = cfg.acker
    produce_raw(kafka_bootstrap, a.topic, [(b"1", b"not-an-id"), (str(b.id).encode(), f"{b.id}:0:9".encode())])
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, a.topic, a.dead_letter_topic)
    with acker_running(acker):
        assert wait_until(lambda: acker.stats["dead_lettered"] == 2, 60), acker.stats
    c = client(server, TOKEN)
    page = c.get("/console/dead-acks")
    assert page.status_code == 200 and "not-an-id" in page.text and f"{b.id}:0:9" in page.text, page.text
    assert page.text.count("data-dead-ack=") == 2 and 'class="hint">2 in <code>' in page.text
    reasons = re.findall(r"<td>([^<]*)</td>", page.text)
    assert reasons[0] == "index out of range (group size 2)" and reasons[1].startswith("malformed"), reasons
    assert client(server, VIEWER).get("/console/dead-acks").status_code == 200
    assert client(server, cfg.tenant_token).get("/console/dead-acks").status_code == 403


def test_the_overviews_acker_lag_covers_every_schemas_ack_topic(kafka_bootstrap, topics, pg_dsn, schema):
    from confluent_kafka import Producer

    from harvester import config as config_mod
    from harvester.services.console.overview import acker_lag

    main_acks, other_acks = topics("acks-main"), topics("acks-other")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for topic, n in ((main_acks, 3), (other_acks, 2)):
        for i in range(n):
            producer.produce(topic, value=f"1:0:{i}".encode())
    assert producer.flush(30) == 0
    cfg = config_mod.load(
        None,
        environ={},
        overrides={
            "database": {"dsn": pg_dsn, "schema": schema},
            "kafka": {"bootstrap_servers": kafka_bootstrap},
            "acker": {"topic": main_acks, "group": f"acker-{uuid.uuid4().hex[:8]}"},
            "harvester": {
                "outboxes": [{"name": "main"}, {"name": "other", "schema": "other", "ack_topic": other_acks}]
            },
        },
    )
    assert acker_lag(cfg, 10) == 5  # nothing committed by either acker group yet
    # retention deleted the first two of main's: the acker group starts from the earliest left
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for f in admin.delete_records([TopicPartition(main_acks, 0, 2)]).values():
        f.result(30)
    assert acker_lag(cfg, 10) == 1 + 2
    # a committed offset past the end (the topic made anew under the same name): from the earliest
    from confluent_kafka import Consumer

    from harvester.config_outboxes import acker_group

    group = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": acker_group(cfg, other_acks)})
    group.commit(offsets=[TopicPartition(other_acks, 0, 50)], asynchronous=False)
    group.close()
    assert acker_lag(cfg, 10) == 1 + 2
