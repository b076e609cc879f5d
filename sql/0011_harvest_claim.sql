-- Which reaper configuration harvests each outbox table (harvester/publishing/ownership.py).
--
-- A configuration's layout is its leader group and topic, the outbox entry's name and its lane
-- count. Two layouts harvesting one table at once (a lane change started before the old reapers
-- stopped, two deployments pointed at one database) would mark each other's rows: a key harvested
-- by two units, out of order. Before a mark, a unit holds its table's row here for its layout up
-- to the mark's deadline; a row held by another layout is taken over only once its `held_until`
-- has passed, and every mark under the old layout was refused after its own deadline, so the two
-- never mark at once. `reaper run` creates this table itself in an outbox's schema that has none.
-- Only comments changed since this file was first applied; the checksum it had then:
-- replaces 0011_harvest_claim.sql sha256:319c64d7ab07197efb4a046e40c508bf49177164557e921f76906e50f666312c
CREATE TABLE IF NOT EXISTS harvest_claim (
    outbox      text        PRIMARY KEY,  -- the outbox table's name in this schema
    layout      text        NOT NULL,     -- the configuration harvesting it (see harvester/claim.py)
    held_until  timestamptz NOT NULL,     -- no other layout marks before this (the server's clock)
    holder      text        NOT NULL,     -- host, pid and unit of the reaper that held it last
    since       timestamptz NOT NULL DEFAULT clock_timestamp()  -- when `layout` took the table
);
