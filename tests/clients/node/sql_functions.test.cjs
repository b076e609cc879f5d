// The tracker's SQL functions driven from Node with node-postgres (run by tests/test_sql_node.py).
// Env: OUTBOX_TEST_DSN (Postgres), TRACKER_SCHEMA (a schema migrated by `reaper migrate`).
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { Client } = require('pg');

const dsn = process.env.OUTBOX_TEST_DSN;
const schemaName = process.env.TRACKER_SCHEMA;

async function connect() {
  const client = new Client({ connectionString: dsn });
  await client.connect();
  return client;
}

// The schema is quoted as an identifier, never pasted in raw.
function fn(client, name) {
  return `${client.escapeIdentifier(schemaName)}.${name}`;
}

async function counts(client) {
  const s = client.escapeIdentifier(schemaName);
  const r = await client.query(
    `SELECT (SELECT count(*) FROM ${s}.batch)::int AS batches, (SELECT count(*) FROM ${s}.batch_group)::int AS groups,
            (SELECT count(*) FROM ${s}.outbox)::int AS messages`);
  return r.rows[0];
}

// Clients expand {group, start, upto} handles into item ids themselves.
function expand(handles) {
  const ids = [];
  for (const h of handles) {
    for (let i = h.start; i < h.upto; i++) ids.push(`${h.batch_id}:${h.group_id}:${i}`);
  }
  return ids;
}

test('fan-out in one transaction, bulk ack in another, exactly one completion event', async () => {
  const c = await connect();
  try {
    await c.query('BEGIN');
    const b = (await c.query(`SELECT ${fn(c, 'open_batch')}($1, $2) AS id`, ['node-catalog', 'node-done'])).rows[0].id;
    const payloads = Array.from({ length: 9000 }, (_, i) => Buffer.from(JSON.stringify({ item: i })));
    const handles = (await c.query(`SELECT * FROM ${fn(c, 'enqueue')}($1, $2, $3::bytea[])`, [b, 'node-items', payloads])).rows;
    assert.deepEqual(handles.map(h => [h.group_id, h.start, h.upto]), [['0', 0, 8192], ['1', 0, 808]]);
    const more = (await c.query(`SELECT * FROM ${fn(c, 'add_items')}($1, $2)`, [b, 10])).rows;
    assert.deepEqual(more.map(h => [h.group_id, h.start, h.upto]), [['1', 808, 818]]);
    const closed = (await c.query(`SELECT ${fn(c, 'close_batch')}($1) AS complete`, [b])).rows[0].complete;
    assert.equal(closed, false);
    await c.query('COMMIT');

    const ids = expand(handles.concat(more));
    assert.equal(ids.length, 9010);
    await c.query('BEGIN');
    const first = (await c.query(`SELECT * FROM ${fn(c, 'ack')}($1::text[])`, [ids.slice(0, 5000)])).rows[0];
    assert.equal(first.acked, '5000');
    assert.deepEqual(first.completed, []);
    // the rest as runs, plus a duplicate
    const rest = [`${b}:0:5000-8191`, `${b}:1:0-817`, `${b}:0:0`];
    const second = (await c.query(`SELECT * FROM ${fn(c, 'ack')}($1::text[])`, [rest])).rows[0];
    assert.equal(second.acked, '4010');
    assert.equal(second.duplicates, '1');
    assert.deepEqual(second.completed, [b]);
    await c.query('COMMIT');

    const status = (await c.query(`SELECT * FROM ${fn(c, 'batch_status')}($1)`, [b])).rows[0];
    assert.equal(status.state, 'complete');
    assert.equal(status.pending, '0');
    const s = c.escapeIdentifier(schemaName);
    const events = (await c.query(`SELECT convert_from(value, 'UTF8')::json AS v FROM ${s}.outbox WHERE topic = 'node-done'`)).rows;
    assert.equal(events.length, 1);
    assert.equal(events[0].v.user_key, 'node-catalog');
    assert.equal(events[0].v.total, 9010);
    const again = (await c.query(`SELECT * FROM ${fn(c, 'ack')}($1::text[])`, [[`${b}:1:3`]])).rows[0];
    assert.equal(again.acked, '0');
    assert.equal(again.duplicates, '1');
  } finally {
    await c.end();
  }
});

test('a rolled-back transaction leaves nothing', async () => {
  const c = await connect();
  try {
    const before = await counts(c);
    await c.query('BEGIN');
    const b = (await c.query(`SELECT ${fn(c, 'open_batch')}() AS id`)).rows[0].id;
    await c.query(`SELECT * FROM ${fn(c, 'enqueue')}($1, 'node-items', $2::bytea[])`, [b, [Buffer.from('a'), null]]);
    await c.query(`SELECT ${fn(c, 'close_batch')}($1)`, [b]);
    await c.query(`SELECT * FROM ${fn(c, 'ack')}($1::text[])`, [[`${b}:0:0-1`]]);
    // the ack's claims are settled, and the batch completed, at the commit
    assert.equal((await c.query(`SELECT state FROM ${fn(c, 'batch_status')}($1)`, [b])).rows[0].state, 'closed');
    await c.query('ROLLBACK');
    assert.deepEqual(await counts(c), before);
  } finally {
    await c.end();
  }
});

test('errors are typed SQLSTATEs naming the bad value, and change nothing', async () => {
  const c = await connect();
  try {
    const b = (await c.query(`SELECT ${fn(c, 'open_batch')}() AS id`)).rows[0].id;
    await c.query(`SELECT * FROM ${fn(c, 'add_items')}($1, 3)`, [b]);
    await c.query(`SELECT ${fn(c, 'close_batch')}($1)`, [b]);
    const before = await counts(c);
    const cases = [
      [`SELECT * FROM ${fn(c, 'ack')}($1::text[])`, [[`${b}:0:0`, `${b}:0:zz`]], 'RT001', `${b}:0:zz`],
      [`SELECT * FROM ${fn(c, 'ack')}($1::text[])`, [[`${Number(b) + 1000}:0:1`]], 'RT002', `${Number(b) + 1000}:0:1`],
      [`SELECT * FROM ${fn(c, 'ack')}($1::text[])`, [[`${b}:0:0`, `${b}:4:1`]], 'RT003', `${b}:4:1`],
      [`SELECT * FROM ${fn(c, 'ack')}($1::text[])`, [[`${b}:0:0`, `${b}:0:3`]], 'RT004', `${b}:0:3`],
      [`SELECT * FROM ${fn(c, 'add_items')}($1, 2)`, [b], 'RT005', String(b)],
    ];
    for (const [text, params, code, detail] of cases) {
      await c.query('BEGIN');
      await assert.rejects(c.query(text, params), (err) => {
        assert.equal(err.code, code, err.message);
        assert.equal(err.detail, detail);
        assert.ok(err.message.includes(detail), err.message);
        return true;
      });
      await c.query('ROLLBACK');
      assert.deepEqual(await counts(c), before);
    }
    const status = (await c.query(`SELECT * FROM ${fn(c, 'batch_status')}($1)`, [b])).rows[0];
    assert.equal(status.pending, '3');
  } finally {
    await c.end();
  }
});

test('outcomes: a threshold and a child, fail and fail_masks, failures paged, one completion event each', async () => {
  const c = await connect();
  try {
    const s = c.escapeIdentifier(schemaName);
    await c.query('BEGIN');
    const p = (await c.query(`SELECT ${fn(c, 'open_batch')}(user_key => $1, completion_topic => $2, tolerated_failures => $3) AS id`,
      ['node-parent', 'node-outcomes', 1])).rows[0].id;
    const k = (await c.query(`SELECT ${fn(c, 'open_batch')}(user_key => $1, completion_topic => $2, parent => $3) AS id`,
      ['node-child', 'node-outcomes', p])).rows[0].id;
    await c.query(`SELECT * FROM ${fn(c, 'add_items')}($1, 10)`, [p]);
    await c.query(`SELECT * FROM ${fn(c, 'add_items')}($1, 3)`, [k]);
    await c.query(`SELECT ${fn(c, 'close_batch')}($1, 'node-outcomes')`, [k]);
    await c.query('COMMIT');

    // the child: item 1 fails by id, items 0 and 2 by a pre-folded mask (bits 0 and 2: 1010 0000)
    const one = (await c.query(`SELECT * FROM ${fn(c, 'fail')}($1::text[], $2, 'node-outcomes')`, [[`${k}:0:1`], 'no stock'])).rows[0];
    assert.deepEqual([one.failed, one.duplicates, one.completed], ['1', '0', []]);
    const masked = (await c.query(`SELECT * FROM ${fn(c, 'fail_masks')}($1::int8[], $2::int8[], $3::text[], $4, 'node-outcomes')`,
      [[k], [0], ['E0'], 'bad row'])).rows[0];
    assert.deepEqual([masked.failed, masked.completed], ['2', [k]]);  // item 1 already failed: not counted again
    const child = (await c.query(`SELECT * FROM ${fn(c, 'batch_status')}($1)`, [k])).rows[0];
    assert.deepEqual([child.state, child.outcome, child.failed, child.succeeded, child.parent_id], ['complete', 'failed', '3', '0', p]);

    // the parent, still open, folds in its finished child at its next write: with the child's 3
    // failed items rolled up, its own first failure is past its threshold (1 tolerated): it finishes early
    const first = (await c.query(`SELECT * FROM ${fn(c, 'fail')}($1::text[], $2, 'node-outcomes')`, [[`${p}:0:0`], 'timeout'])).rows[0];
    assert.deepEqual([first.failed, first.completed], ['1', [p]]);
    const parent = (await c.query(`SELECT * FROM ${fn(c, 'batch_status')}($1)`, [p])).rows[0];
    assert.deepEqual([parent.state, parent.outcome, parent.failed, parent.pending, parent.children_open], ['complete', 'failed', '1', '9', 0]);
    // an ack after it finished is counted late and changes no outcome
    const late = (await c.query(`SELECT * FROM ${fn(c, 'ack')}($1::text[], 'node-outcomes')`, [[`${p}:0:1`]])).rows[0];
    assert.deepEqual([late.acked, late.completed], ['1', []]);
    assert.equal((await c.query(`SELECT late FROM ${fn(c, 'batch_status')}($1)`, [p])).rows[0].late, '1');

    // failures, a page at a time: after = the last item id of the previous page
    const pages = [];
    let after = null;
    for (;;) {
      const rows = (await c.query(`SELECT item_id, reason FROM ${fn(c, 'failures')}($1, $2, 2)`, [k, after])).rows;
      pages.push(rows.map(r => `${r.item_id}=${r.reason}`));
      if (rows.length < 2) break;
      after = rows[rows.length - 1].item_id;
    }
    assert.deepEqual(pages, [[`${k}:0:0=bad row`, `${k}:0:1=no stock`], [`${k}:0:2=bad row`]]);
    await assert.rejects(c.query(`SELECT * FROM ${fn(c, 'failures')}($1, $2, 2)`, [k, 'nope']), (err) => {
      assert.equal(err.code, 'RT007', err.message);
      assert.equal(err.detail, 'nope');
      return true;
    });
    await assert.rejects(c.query(`SELECT * FROM ${fn(c, 'fail')}($1::text[], $2)`, [[`${p}:0:9`], '']), (err) => {
      assert.equal(err.code, 'RT007', err.message);
      return true;
    });

    const events = (await c.query(
      `SELECT convert_from(value, 'UTF8')::json AS v FROM ${s}.outbox WHERE topic = 'node-outcomes' ORDER BY id`)).rows;
    assert.deepEqual(events.map(e => [e.v.batch_id, e.v.outcome, e.v.failed, e.v.parent_id]),
      [[Number(k), 'failed', 3, Number(p)], [Number(p), 'failed', 1, null]]);
  } finally {
    await c.end();
  }
});

test('inbox: a message id claimed once per consumer, in the caller\'s transaction', async () => {
  const c = await connect();
  const other = await connect();
  try {
    const claim = `SELECT ${fn(c, 'inbox_claim')}($1, $2) AS first`;
    await c.query('BEGIN');
    assert.equal((await c.query(claim, ['billing', 'order-1'])).rows[0].first, true);
    assert.equal((await c.query(claim, ['billing', 'order-1'])).rows[0].first, false);
    await c.query('ROLLBACK'); // nothing recorded: the message is still unprocessed
    await c.query('BEGIN');
    assert.equal((await c.query(claim, ['billing', 'order-1'])).rows[0].first, true);
    await c.query('COMMIT');
    assert.equal((await other.query(claim, ['billing', 'order-1'])).rows[0].first, false);
    assert.equal((await other.query(claim, ['shipping', 'order-1'])).rows[0].first, true);
    const shown = await c.query(`SELECT consumer_name FROM ${fn(c, 'inbox_show')}($1) ORDER BY 1`, ['order-1']);
    assert.deepEqual(shown.rows.map((r) => r.consumer_name), ['billing', 'shipping']);
    await assert.rejects(c.query(claim, ['billing', 'x'.repeat(201)]), (err) => err.code === 'RT007');
  } finally {
    await c.end();
    await other.end();
  }
});
