"""One tenant's share of the database pool (http.max_connections_per_tenant, all its tokens
together): its requests stuck on a lock hold at most that many connections, the rest wait for one of
theirs (429 at http.request_timeout), and other tenants' requests find a connection meanwhile."""

from __future__ import annotations

import asyncio
import threading

import httpx
import psycopg
import pytest
from support.http_server import RunningServer, http_config
from test_http_tenants import BILLING, SEARCH, _client, _write

from harvester.config import ConfigError, load
from harvester.services.http.backend import StoreUnavailable, TenantBusy, TrackerStore
from harvester.services.http.token_connections import TENANT, ConnectionsPerTenant, tenant_share

BILLING_2 = "billing-second-token-0123456789abcdef"

# backends waiting for a lock, in statements on the test's schema
LOCK_WAITERS = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND position(%s in query) > 0"


def test_a_tenants_calls_past_its_share_wait_for_one_of_its_own():
    async def scenario() -> None:
        share = ConnectionsPerTenant(2)
        inside: dict[str, int] = {"a": 0, "b": 0}
        most: dict[str, int] = {"a": 0, "b": 0}
        go = asyncio.Event()

        async def call(token: str) -> None:
            TENANT.set(token)  # each task its own context, as each request
            async with share.hold():
                inside[token] += 1
                most[token] = max(most[token], inside[token])
                await go.wait()
                inside[token] -= 1

        tasks = [asyncio.create_task(call(t)) for t in ["a"] * 5 + ["b"]]
        await asyncio.sleep(0.05)
        assert inside == {"a": 2, "b": 1}  # b is not held up by a's waiting calls
        assert share.held("a") == 5
        go.set()
        await asyncio.gather(*tasks)
        assert most == {"a": 2, "b": 1} and share.held("a") == 0

        async def anonymous() -> None:  # the server's own calls are not counted
            async with share.hold():
                assert share.held("a") == 0

        await asyncio.create_task(anonymous())

    asyncio.run(scenario())


def test_one_tenants_requests_stuck_on_a_lock_leave_the_pool_to_the_others(pg_dsn, schema, tmp_path):
    tenants_file = tmp_path / "tenants.yaml"
    # billing's two tokens (a producer and a consumer, say) share billing's 4 connections
    _write(tenants_file, {"billing": ([BILLING, BILLING_2], ["billing-done"]), "search": ([SEARCH], None)})
    cfg = http_config(
        pg_dsn, schema, tenants_file=str(tenants_file), request_timeout=3.0, pool_size=8, max_connections_per_tenant=4
    )
    with RunningServer(cfg, []) as s, _client(s, BILLING) as billing, _client(s, SEARCH) as search:
        theirs = billing.post("/v1/batches", json={"completion_topic": "billing-done"}).json()["batch_id"]
        billing.post(f"/v1/batches/{theirs}/items", json={"count": 100})
        mine = search.post("/v1/batches", json={}).json()["batch_id"]
        locker = psycopg.connect(pg_dsn)  # billing's own application, acking in a transaction of its own
        locker.execute(f'SELECT 1 FROM "{schema}".batch WHERE id = %s FOR UPDATE', [theirs])
        released = threading.Event()
        answers: list[httpx.Response] = []
        started = threading.Barrier(9)

        def ack(i: int) -> None:
            with _client(s, BILLING if i % 2 else BILLING_2) as c:
                started.wait()
                answers.append(c.post("/v1/acks", json={"ids": [f"{theirs}:0:{i}"]}))

        threads = [threading.Thread(target=ack, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        started.wait()
        # billing's 8 acks are in: 4 on connections, waiting on the lock, 4 waiting for one of those
        waiting_on_lock = []
        with psycopg.connect(pg_dsn, autocommit=True) as watch:
            for _ in range(40):
                (n,) = watch.execute(LOCK_WAITERS, [schema]).fetchone()
                waiting_on_lock.append(n)
                if n >= 4:
                    break
                threading.Event().wait(0.05)
            for _ in range(20):  # meanwhile another tenant's reads find free connections
                r = search.get(f"/v1/batches/{mine}")
                assert r.status_code == 200, r.text
            (n,) = watch.execute(LOCK_WAITERS, [schema]).fetchone()
            waiting_on_lock.append(n)
        status_while_locked = not released.is_set()
        for t in threads:
            t.join(timeout=60)
        released.set()
        locker.rollback()
        locker.close()
    assert status_while_locked
    assert max(waiting_on_lock) == 4, waiting_on_lock  # billing's share, never more
    # Those on a connection met the lock until the deadline (503); those still waiting for one of
    # billing's connections then are refused as over the token's share (429).
    assert {a.status_code for a in answers} <= {429, 503}, [(a.status_code, a.text[:200]) for a in answers]
    for a in answers:
        assert a.headers["Retry-After"] == "1"
        if a.status_code == 429:
            assert a.json()["type"].endswith(":rate-limited") and a.json()["limit"] == 4


def test_a_call_still_waiting_for_its_tenants_share_at_the_deadline_is_tenant_busy(pg_dsn, schema):
    async def scenario() -> None:
        store = TrackerStore(
            pg_dsn, schema, completion_topic="done", pool_size=4, timeout=1.0, connections_per_tenant=1
        )
        await store.open()
        try:
            TENANT.set("billing")

            async def stubborn(conn: object) -> None:  # as a cancelled psycopg call: ends a while after
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    await asyncio.sleep(3.0)
                    raise

            first = asyncio.create_task(store.within(stubborn))
            await asyncio.sleep(0.2)
            with pytest.raises(TenantBusy) as busy:  # billing's one connection stays held past this deadline
                await store.within(lambda conn: asyncio.sleep(0))
            assert busy.value.limit == 1 and busy.value.tenant == "billing"
            with pytest.raises(StoreUnavailable) as cut:  # the first, cut off at its own deadline
                await first
            assert not isinstance(cut.value, TenantBusy)
            TENANT.set("search")  # another tenant's share is its own
            assert await store.within(lambda conn: asyncio.sleep(0, "free")) == "free"
        finally:
            await store.close()

    asyncio.run(scenario())


def test_the_default_share_leaves_one_connection_and_a_share_of_the_whole_pool_is_refused(tmp_path):
    assert tenant_share(8, 0) == 7 and tenant_share(1, 0) == 1 and tenant_share(8, 3) == 3
    assert load(None, environ={}).http.max_connections_per_tenant == 0  # pool_size - 1
    path = tmp_path / "reaper.yaml"
    path.write_text("http:\n  pool_size: 4\n  max_connections_per_tenant: 4\n")
    with pytest.raises(ConfigError) as err:
        load(str(path), environ={})
    assert err.value.key == "http.max_connections_per_tenant" and "below http.pool_size = 4" in str(err.value)
