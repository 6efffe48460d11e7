-- dlock: the Postgres backend's schema, version 8 (schema "dlock", table prefix "dlock_").
--
-- The backend runs exactly this on first use (PostgresOptions::create_schema, on by default).
-- Teams that run their own migrations apply this file instead and turn create_schema off; the
-- backend then needs only USAGE on the schema, EXECUTE on the functions and SELECT, INSERT,
-- UPDATE, DELETE on the tables and USAGE on the sequence. Another schema or prefix:
-- PostgresOptions::ddl() prints the file rendered for them.
BEGIN;
SELECT pg_advisory_xact_lock(1684824939, 0);
CREATE SCHEMA IF NOT EXISTS dlock;

-- A client that finds a newer schema never puts older functions over it.
DO $$
BEGIN
  IF to_regprocedure('dlock.dlock_schema_version()') IS NOT NULL THEN
    IF dlock.dlock_schema_version() > 8 THEN
      RAISE EXCEPTION 'dlock: schema "dlock" (prefix "dlock_") is at version %, newer than this client''s 8',
        dlock.dlock_schema_version();
    END IF;
  END IF;
END $$;

-- Fencing tokens and waiters' places in line: never reused, also across restarts.
CREATE SEQUENCE IF NOT EXISTS dlock.dlock_fence;

-- The server's WAL timeline (version 3): 1 on a new cluster, one more on each promotion of a
-- standby (and each point-in-time recovery). Where the server does not tell its WAL position
-- (Amazon Aurora, whose failovers lose no committed rows), it is taken as 1: decided here, with
-- the privileges of the role that runs this file.
DO $$
BEGIN
  PERFORM pg_walfile_name(pg_current_wal_lsn());
  CREATE OR REPLACE FUNCTION dlock.dlock_timeline() RETURNS bigint LANGUAGE sql
    AS $f$SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint$f$;
EXCEPTION WHEN OTHERS THEN
  CREATE OR REPLACE FUNCTION dlock.dlock_timeline() RETURNS bigint LANGUAGE sql AS 'SELECT 1::bigint';
END $$;

-- Makes the calling transaction's commit wait for its WAL to be written out on this server
-- (version 6) when the session would not (synchronous_commit = off): a grant, a lease restart
-- or renewal, an idempotency result answered and then lost in a crash gives the lock to a
-- second owner with the same token, or runs the work again. 'local' and every stronger setting
-- are left alone: 'local' is enough for a crash of this server (a promotion raises the fencing
-- epoch), and forcing 'on' would make the lock service wait for a synchronous standby that the
-- operator kept it out of. Transaction-local: nothing leaks to the next user of the connection
-- (PgBouncer).
CREATE OR REPLACE FUNCTION dlock.dlock_durable_commit() RETURNS void
LANGUAGE sql AS $$
  SELECT CASE WHEN current_setting('synchronous_commit') = 'off'
    THEN set_config('synchronous_commit', 'local', true) END;
$$;

-- Refuses a transaction that is not READ COMMITTED (version 8). The functions take a lock's
-- advisory lock, then read what the transactions before them committed; under REPEATABLE READ
-- or SERIALIZABLE their reads come from a snapshot taken before that wait, so a semaphore or a
-- read-write lock was granted beside holders it could not see (a writer beside a reader, two
-- holders of one permit), and every contended exclusive lock failed to serialise. The level is
-- the database's, the role's or the connection's default_transaction_isolation; refused at every
-- grant (next_fence), as SQLSTATE 0A000 (feature_not_supported, which the backend reports as
-- misconfigured: retrying does not change it).
CREATE OR REPLACE FUNCTION dlock.dlock_read_committed() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
    RAISE EXCEPTION 'dlock: the lock functions need READ COMMITTED, and this transaction is %: set default_transaction_isolation to ''read committed'' for the role dlock connects as (ALTER ROLE ... SET) or in its connection options',
      upper(current_setting('transaction_isolation'))
      USING ERRCODE = 'feature_not_supported';
  END IF;
END $$;

-- The high part of fencing tokens (version 4): the timeline last seen and the epoch in use.
-- The epoch goes up by as much as the timeline on a promotion, and by one when the data turns
-- up on a server whose timeline is lower (a promoted server's data restored on a new cluster,
-- which starts at timeline 1), so it never goes down. A copy on the SAME timeline (a dump of a
-- never-promoted server restored, pg_upgrade, a storage snapshot, an Aurora clone) does not
-- raise it: before such a copy serves locks while the original still does, run once on it
--   UPDATE dlock.dlock_fence_epoch SET epoch = epoch + 1;
-- Its row is made below, once the tables exist.
-- (Teams that grant privileges table by table: the backend's role needs SELECT, INSERT and
-- UPDATE on this table too.)
CREATE TABLE IF NOT EXISTS dlock.dlock_fence_epoch (
    one      boolean PRIMARY KEY DEFAULT true CHECK (one),
    timeline bigint NOT NULL,
    epoch    bigint NOT NULL
);

-- A new fencing token: epoch * 2^48 + the sequence's next value. A standby promoted after
-- missing the latest grants (asynchronous replication) draws from a sequence that is behind,
-- but on a later timeline, so its epoch and tokens are larger than any the old primary issued.
-- The epoch row is written only when the timeline moved; of two grants that find it moved, the
-- second waits for the first's update, then finds it done (and takes the row's epoch through a
-- no-op update).
-- Every grant draws its token here, so here its transaction is refused unless it is READ
-- COMMITTED (version 8, read_committed) and made to commit durably
-- (version 6, durable_commit): with synchronous_commit off (server, database, role or
-- connection options), a crash right after the answer would lose the grant and the sequence's
-- advance, and the next grant would go to another owner with the same token.
CREATE OR REPLACE FUNCTION dlock.dlock_next_fence() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE n bigint := nextval('dlock.dlock_fence'); tl bigint := dlock.dlock_timeline(); e bigint;
BEGIN
  PERFORM dlock.dlock_read_committed();
  PERFORM dlock.dlock_durable_commit();
  SELECT epoch INTO e FROM dlock.dlock_fence_epoch WHERE one AND timeline = tl;
  IF NOT FOUND THEN
    UPDATE dlock.dlock_fence_epoch SET epoch = epoch + greatest(tl - timeline, 1), timeline = tl
      WHERE one AND timeline <> tl RETURNING epoch INTO e;
    IF NOT FOUND THEN
      INSERT INTO dlock.dlock_fence_epoch AS f (timeline, epoch) VALUES (tl, tl)
        ON CONFLICT (one) DO UPDATE SET timeline = f.timeline RETURNING f.epoch INTO e;
    END IF;
  END IF;
  IF n >= 281474976710656 OR e >= 32768 THEN
    RAISE EXCEPTION 'dlock: fencing tokens exhausted (epoch %, sequence %)', e, n
      USING ERRCODE = 'program_limit_exceeded';
  END IF;
  RETURN e * 281474976710656 + n;
END $$;

CREATE TABLE IF NOT EXISTS dlock.dlock_locks (
    name       text PRIMARY KEY,
    owner      text NOT NULL,
    fence      bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    barged     boolean NOT NULL DEFAULT false
);

CREATE TABLE IF NOT EXISTS dlock.dlock_waiters (
    name       text NOT NULL,
    token      text NOT NULL,
    seq        bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    lease_ms   bigint NOT NULL,
    PRIMARY KEY (name, token)
);
CREATE INDEX IF NOT EXISTS dlock_waiters_line ON dlock.dlock_waiters (name, seq);

CREATE TABLE IF NOT EXISTS dlock.dlock_idempotency (
    name        text PRIMARY KEY,
    fingerprint text NOT NULL,
    owner       text,
    result      bytea,
    expires_at  timestamptz NOT NULL
);

-- Semaphores and read-write locks (version 2): their holders and their waiters' line.
CREATE TABLE IF NOT EXISTS dlock.dlock_holders (
    name       text NOT NULL,
    owner      text NOT NULL,
    exclusive  boolean NOT NULL,
    fence      bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (name, owner)
);

CREATE TABLE IF NOT EXISTS dlock.dlock_queue (
    name       text NOT NULL,
    token      text NOT NULL,
    exclusive  boolean NOT NULL,
    seq        bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (name, token)
);
CREATE INDEX IF NOT EXISTS dlock_queue_line ON dlock.dlock_queue (name, seq);

-- The epoch row: the timeline now, and an epoch no lower than it nor than the high part of any
-- token the locks and holders hold (version 3 used the timeline; a timeline() that answers 1
-- here (a role that may not read the WAL position) still does not take tokens back).
INSERT INTO dlock.dlock_fence_epoch (timeline, epoch)
  SELECT dlock.dlock_timeline(), greatest(dlock.dlock_timeline(),
    (SELECT coalesce(max(fence), 0) / 281474976710656 FROM dlock.dlock_locks),
    (SELECT coalesce(max(fence), 0) / 281474976710656 FROM dlock.dlock_holders))
  ON CONFLICT DO NOTHING;

CREATE OR REPLACE FUNCTION dlock.dlock_schema_version() RETURNS integer
LANGUAGE sql IMMUTABLE AS 'SELECT 8';

-- Serialises every grant of one lock name (see the module docs).
CREATE OR REPLACE FUNCTION dlock.dlock_serialise(p_name text) RETURNS void
LANGUAGE sql AS 'SELECT pg_advisory_xact_lock(1684824939, hashtext(p_name))';

-- Milliseconds from now until t (at least 0).
CREATE OR REPLACE FUNCTION dlock.dlock_ms_until(t timestamptz) RETURNS bigint
LANGUAGE sql AS 'SELECT greatest(0, ceil(extract(epoch FROM (t - clock_timestamp())) * 1000))::bigint';

-- The first live waiter of a lock (dropping expired entries): its token and handoff lease -
-- the lease its entry notes, but ending no later than the entry would have (version 5): a
-- waiter that died holds a handed-over lock no longer than its entry would have held up the
-- line. A live waiter loses nothing: it asks again within a third of the waiter TTL of its
-- last attempt, which set the entry's expiry, and that grant restarts the lease.
CREATE OR REPLACE FUNCTION dlock.dlock_head(p_name text, OUT token text, OUT lease_ms bigint)
LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM dlock.dlock_waiters w WHERE w.name = p_name AND w.expires_at <= clock_timestamp();
  SELECT w.token, least(w.lease_ms, dlock.dlock_ms_until(w.expires_at)) INTO token, lease_ms
    FROM dlock.dlock_waiters w WHERE w.name = p_name ORDER BY w.seq LIMIT 1;
END $$;

-- Puts (or keeps) a waiter in line with a fresh entry expiry.
CREATE OR REPLACE FUNCTION dlock.dlock_enqueue(p_name text, p_token text, p_lease_ms bigint, p_wttl_ms bigint)
RETURNS void LANGUAGE sql AS $$
  INSERT INTO dlock.dlock_waiters AS w (name, token, seq, expires_at, lease_ms)
  VALUES (p_name, p_token, nextval('dlock.dlock_fence'),
          clock_timestamp() + p_wttl_ms * interval '1 millisecond', least(p_lease_ms, p_wttl_ms))
  ON CONFLICT (name, token) DO UPDATE SET expires_at = EXCLUDED.expires_at, lease_ms = EXCLUDED.lease_ms
$$;

-- The lock is given up (released, abandoned, completed): grant it to the first live waiter
-- with a new fencing token and tell it (direct handoff), or delete it, waking a barging waiter
-- if one asked. Returns '<waiter token>\t<fencing token>' after a handoff, else NULL (the
-- caller may tell a waiter of its own process at once). Needs serialise().
CREATE OR REPLACE FUNCTION dlock.dlock_pass_on(p_name text, p_barged boolean) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE h record; f bigint;
BEGIN
  SELECT * INTO h FROM dlock.dlock_head(p_name);
  IF h.token IS NULL THEN
    DELETE FROM dlock.dlock_locks WHERE name = p_name;
    IF p_barged THEN PERFORM pg_notify('dlock.dlock_release', p_name || E'\t'); END IF;
    RETURN NULL;
  END IF;
  DELETE FROM dlock.dlock_waiters WHERE name = p_name AND token = h.token;
  f := dlock.dlock_next_fence();
  INSERT INTO dlock.dlock_locks AS l (name, owner, fence, expires_at, barged)
  VALUES (p_name, h.token, f, clock_timestamp() + h.lease_ms * interval '1 millisecond', p_barged)
  ON CONFLICT (name) DO UPDATE
    SET owner = EXCLUDED.owner, fence = EXCLUDED.fence, expires_at = EXCLUDED.expires_at, barged = EXCLUDED.barged;
  PERFORM pg_notify('dlock.dlock_release', p_name || E'\t' || h.token || E'\t' || f);
  RETURN h.token || E'\t' || f;
END $$;

-- Deletes a bounded batch of rows that lapsed more than a minute ago.
CREATE OR REPLACE FUNCTION dlock.dlock_sweep() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM dlock.dlock_locks WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM dlock.dlock_locks WHERE expires_at < clock_timestamp() - interval '1 minute'
    LIMIT 100 FOR UPDATE SKIP LOCKED));
  DELETE FROM dlock.dlock_waiters WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM dlock.dlock_waiters WHERE expires_at < clock_timestamp() - interval '1 minute'
    LIMIT 100 FOR UPDATE SKIP LOCKED));
  DELETE FROM dlock.dlock_idempotency WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM dlock.dlock_idempotency WHERE expires_at < clock_timestamp()
    LIMIT 100 FOR UPDATE SKIP LOCKED));
  DELETE FROM dlock.dlock_holders WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM dlock.dlock_holders WHERE expires_at < clock_timestamp() - interval '1 minute'
    LIMIT 100 FOR UPDATE SKIP LOCKED));
  DELETE FROM dlock.dlock_queue WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM dlock.dlock_queue WHERE expires_at < clock_timestamp() - interval '1 minute'
    LIMIT 100 FOR UPDATE SKIP LOCKED));
END $$;

-- One acquire attempt. p_mode: 0 try, 1 queue, 2 barge.
-- Returns the fencing token (> 0) when granted (also when the lock is already this token's:
-- handed over by a release whose notification was lost; same token, lease restarted),
-- -(lease left ms) - 1 when someone else holds it, and -(ms left on the first waiter's entry)
-- - 1 when it is free but another waiter is first in line (version 5; it was 0): a waiter
-- behind one that died asks again when that entry ends, as on Redis, not a backoff step later.
CREATE OR REPLACE FUNCTION dlock.dlock_acquire(p_name text, p_token text, p_ttl_ms bigint, p_mode integer, p_wttl_ms bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE l record; h record; f bigint;
BEGIN
  PERFORM dlock.dlock_serialise(p_name);
  SELECT owner, fence, expires_at INTO l FROM dlock.dlock_locks WHERE name = p_name FOR UPDATE;
  IF FOUND AND l.expires_at > clock_timestamp() THEN
    IF l.owner = p_token THEN
      -- A lease restarted: as durable as a grant (version 6; see next_fence).
      PERFORM dlock.dlock_durable_commit();
      UPDATE dlock.dlock_locks SET expires_at = clock_timestamp() + p_ttl_ms * interval '1 millisecond'
       WHERE name = p_name;
      RETURN l.fence;
    END IF;
    IF p_mode = 1 THEN
      PERFORM dlock.dlock_enqueue(p_name, p_token, p_ttl_ms, p_wttl_ms);
    ELSIF p_mode = 2 THEN
      UPDATE dlock.dlock_locks SET barged = true WHERE name = p_name AND NOT barged;
    END IF;
    RETURN -dlock.dlock_ms_until(l.expires_at) - 1;
  END IF;
  -- Free. The line is looked at only when it has entries (the uncontended path skips it).
  IF EXISTS (SELECT 1 FROM dlock.dlock_waiters WHERE name = p_name) THEN
    SELECT * INTO h FROM dlock.dlock_head(p_name);
    IF h.token IS NOT NULL AND h.token <> p_token AND p_mode <> 2 THEN
      IF p_mode = 1 THEN PERFORM dlock.dlock_enqueue(p_name, p_token, p_ttl_ms, p_wttl_ms); END IF;
      RETURN coalesce(-dlock.dlock_ms_until((SELECT w.expires_at FROM dlock.dlock_waiters w
                                         WHERE w.name = p_name AND w.token = h.token)) - 1, 0);
    END IF;
    IF h.token IS NOT NULL THEN
      DELETE FROM dlock.dlock_waiters WHERE name = p_name AND token = p_token;
    END IF;
  END IF;
  f := dlock.dlock_next_fence();
  INSERT INTO dlock.dlock_locks AS k (name, owner, fence, expires_at)
  VALUES (p_name, p_token, f, clock_timestamp() + p_ttl_ms * interval '1 millisecond')
  ON CONFLICT (name) DO UPDATE
    SET owner = EXCLUDED.owner, fence = EXCLUDED.fence, expires_at = EXCLUDED.expires_at, barged = false;
  IF random() < 0.01 THEN PERFORM dlock.dlock_sweep(); END IF;
  RETURN f;
END $$;

-- Owner-checked release: hands the lock to the next live waiter, or deletes it.
-- Returns NULL when the token did not hold the lock; '' when it did (also a lease of it that
-- lapsed with nobody taking the lock since: the locker reports that as lost by its own lease
-- clock); '<waiter token>\t<fencing token>' when it did and the lock went to that waiter.
CREATE OR REPLACE FUNCTION dlock.dlock_release(p_name text, p_token text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE l record;
BEGIN
  PERFORM dlock.dlock_serialise(p_name);
  SELECT owner, barged INTO l FROM dlock.dlock_locks WHERE name = p_name FOR UPDATE;
  IF NOT FOUND OR l.owner <> p_token THEN RETURN NULL; END IF;
  IF NOT l.barged AND NOT EXISTS (SELECT 1 FROM dlock.dlock_waiters WHERE name = p_name) THEN
    -- Nobody waits (the uncontended path): delete, notify nobody.
    DELETE FROM dlock.dlock_locks WHERE name = p_name;
    RETURN '';
  END IF;
  RETURN coalesce(dlock.dlock_pass_on(p_name, l.barged), '');
END $$;

-- Undo of a cancelled or abandoned acquire: release if owner, leave the line, and pass a free
-- lock on if that made someone else first.
CREATE OR REPLACE FUNCTION dlock.dlock_abandon(p_name text, p_token text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE l record; held boolean; free boolean; left_line boolean;
BEGIN
  PERFORM dlock.dlock_serialise(p_name);
  SELECT owner, expires_at, barged INTO l FROM dlock.dlock_locks WHERE name = p_name FOR UPDATE;
  held := FOUND AND l.owner = p_token;
  free := NOT FOUND OR l.expires_at <= clock_timestamp();
  DELETE FROM dlock.dlock_waiters WHERE name = p_name AND token = p_token;
  left_line := FOUND;
  IF held OR (left_line AND free) THEN
    PERFORM dlock.dlock_pass_on(p_name, coalesce(l.barged, false));
  END IF;
  RETURN held::integer;
END $$;

-- Owner-checked lease extension, for a batch: returns the names whose lease was extended.
-- Durable like a grant (version 6): a holder counts its lease from the answer.
CREATE OR REPLACE FUNCTION dlock.dlock_extend(p_names text[], p_tokens text[], p_ttls_ms bigint[])
RETURNS SETOF text LANGUAGE sql AS $$
  SELECT dlock.dlock_durable_commit();
  UPDATE dlock.dlock_locks k SET expires_at = clock_timestamp() + u.ttl * interval '1 millisecond'
    FROM unnest(p_names, p_tokens, p_ttls_ms) AS u(name, token, ttl)
   WHERE k.name = u.name AND k.owner = u.token AND k.expires_at > clock_timestamp()
  RETURNING k.name
$$;

-- Idempotency, step one. o_code: 1 granted (o_n = fencing token; also when the lock is already
-- this token's: the call run again, its lease restarted), 2 replay (o_result),
-- 3 mismatch, 0 held (o_n = lease left ms, or, free but a waiter first, what that waiter's
-- entry has left (version 5; it was -2, no time); o_same = 1 same fingerprint, 0 different,
-- NULL unknown).
CREATE OR REPLACE FUNCTION dlock.dlock_idem_begin(p_name text, p_token text, p_ttl_ms bigint, p_fp text, p_retention_ms bigint,
  OUT o_code integer, OUT o_n bigint, OUT o_same integer, OUT o_result bytea)
LANGUAGE plpgsql AS $$
DECLARE r record; l record; h record;
BEGIN
  PERFORM dlock.dlock_serialise(p_name);
  SELECT fingerprint, owner, result AS res INTO r FROM dlock.dlock_idempotency
   WHERE name = p_name AND expires_at > clock_timestamp();
  IF FOUND AND r.res IS NOT NULL THEN
    IF r.fingerprint = p_fp THEN o_code := 2; o_result := r.res; ELSE o_code := 3; END IF;
    RETURN;
  END IF;
  SELECT owner, fence, expires_at INTO l FROM dlock.dlock_locks WHERE name = p_name FOR UPDATE;
  IF FOUND AND l.expires_at > clock_timestamp() AND l.owner = p_token THEN
    -- This attempt's own lock (its begin run again; version 7): its lease restarts, as
    -- durable as a grant.
    PERFORM dlock.dlock_durable_commit();
    UPDATE dlock.dlock_locks SET expires_at = clock_timestamp() + p_ttl_ms * interval '1 millisecond'
     WHERE name = p_name;
    o_code := 1;
    o_n := l.fence;
    RETURN;
  END IF;
  IF FOUND AND l.expires_at > clock_timestamp() THEN
    o_code := 0;
    o_n := dlock.dlock_ms_until(l.expires_at);
    IF r.owner IS NOT NULL AND r.owner = l.owner THEN o_same := (r.fingerprint = p_fp)::integer; END IF;
    RETURN;
  END IF;
  SELECT * INTO h FROM dlock.dlock_head(p_name);
  IF h.token IS NOT NULL THEN
    o_code := 0;
    o_n := coalesce(dlock.dlock_ms_until((SELECT w.expires_at FROM dlock.dlock_waiters w
                                     WHERE w.name = p_name AND w.token = h.token)), -2);
    RETURN;
  END IF;
  o_n := dlock.dlock_next_fence();
  INSERT INTO dlock.dlock_locks AS k (name, owner, fence, expires_at)
  VALUES (p_name, p_token, o_n, clock_timestamp() + p_ttl_ms * interval '1 millisecond')
  ON CONFLICT (name) DO UPDATE
    SET owner = EXCLUDED.owner, fence = EXCLUDED.fence, expires_at = EXCLUDED.expires_at, barged = false;
  INSERT INTO dlock.dlock_idempotency AS i (name, fingerprint, owner, result, expires_at)
  VALUES (p_name, p_fp, p_token, NULL, clock_timestamp() + p_retention_ms * interval '1 millisecond')
  ON CONFLICT (name) DO UPDATE
    SET fingerprint = EXCLUDED.fingerprint, owner = EXCLUDED.owner, result = NULL, expires_at = EXCLUDED.expires_at;
  -- Records that lapsed go here too (version 7): a locker used only for idempotency never
  -- acquires, and its table grew by a record per key for ever. Twice acquire's rate: up to
  -- 100 rows a sweep, so it removes more than the one record each begin may add.
  IF random() < 0.02 THEN PERFORM dlock.dlock_sweep(); END IF;
  o_code := 1;
END $$;

-- Idempotency, last step: owner-checked; stores the result and releases the lock together,
-- handing it to the next live waiter if any. Returns 1 when stored, 0 when the token did not
-- hold a live lease (nothing changed). The record is durable (version 6): lost in a crash
-- after the answer, the work it records would run again.
CREATE OR REPLACE FUNCTION dlock.dlock_idem_complete(p_name text, p_token text, p_fp text, p_result bytea, p_retention_ms bigint)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE l record;
BEGIN
  PERFORM dlock.dlock_serialise(p_name);
  SELECT owner, expires_at, barged INTO l FROM dlock.dlock_locks WHERE name = p_name FOR UPDATE;
  IF NOT FOUND OR l.owner <> p_token OR l.expires_at <= clock_timestamp() THEN RETURN 0; END IF;
  PERFORM dlock.dlock_durable_commit();
  INSERT INTO dlock.dlock_idempotency AS i (name, fingerprint, owner, result, expires_at)
  VALUES (p_name, p_fp, NULL, p_result, clock_timestamp() + p_retention_ms * interval '1 millisecond')
  ON CONFLICT (name) DO UPDATE
    SET fingerprint = EXCLUDED.fingerprint, owner = NULL, result = EXCLUDED.result, expires_at = EXCLUDED.expires_at;
  PERFORM dlock.dlock_pass_on(p_name, l.barged);
  RETURN 1;
END $$;

-- Idempotency, abort: owner-checked release without a record (drops the running attempt's
-- note). Returns 1 when released, 0 when the token did not hold a live lease.
CREATE OR REPLACE FUNCTION dlock.dlock_idem_abort(p_name text, p_token text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE l record;
BEGIN
  PERFORM dlock.dlock_serialise(p_name);
  SELECT owner, expires_at, barged INTO l FROM dlock.dlock_locks WHERE name = p_name FOR UPDATE;
  IF NOT FOUND OR l.owner <> p_token OR l.expires_at <= clock_timestamp() THEN RETURN 0; END IF;
  DELETE FROM dlock.dlock_idempotency WHERE name = p_name AND owner = p_token AND result IS NULL;
  PERFORM dlock.dlock_pass_on(p_name, l.barged);
  RETURN 1;
END $$;
-- Semaphores and read-write locks. Drops the lapsed holders and queue entries of one name.
CREATE OR REPLACE FUNCTION dlock.dlock_kind_prune(p_name text) RETURNS void
LANGUAGE sql AS $$
  DELETE FROM dlock.dlock_holders WHERE name = p_name AND expires_at <= clock_timestamp();
  DELETE FROM dlock.dlock_queue WHERE name = p_name AND expires_at <= clock_timestamp();
$$;

-- The ready prefix of a name (after kind_prune): the queued tokens, in line order, each of
-- which fits beside the live holders and the waiters before it (exclusive: no holder at all;
-- shared: no exclusive holder and fewer than p_cap). When the whole line fits and
-- p_tail_excl is not NULL, one more row '' says that a newcomer (exclusive if p_tail_excl)
-- would fit after it. Needs serialise().
CREATE OR REPLACE FUNCTION dlock.dlock_kind_ready(p_name text, p_cap bigint, p_tail_excl boolean)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE n bigint; w boolean; q record;
BEGIN
  SELECT count(*), coalesce(bool_or(exclusive), false) INTO n, w
    FROM dlock.dlock_holders WHERE name = p_name;
  FOR q IN SELECT token, exclusive FROM dlock.dlock_queue WHERE name = p_name ORDER BY seq LOOP
    IF (q.exclusive AND n > 0) OR (NOT q.exclusive AND (w OR n >= p_cap)) THEN RETURN; END IF;
    n := n + 1;
    w := w OR q.exclusive;
    RETURN NEXT q.token;
  END LOOP;
  IF p_tail_excl IS NOT NULL AND ((p_tail_excl AND n = 0) OR (NOT p_tail_excl AND NOT w AND n < p_cap)) THEN
    RETURN NEXT '';
  END IF;
END $$;

-- One acquire attempt of a semaphore permit or a read or write hold (p_excl: a writer;
-- p_cap: the permits, or the largest bigint for a read-write lock). p_mode: 0 try (granted
-- when it would be admitted after the whole line), 1 queue (join or refresh the line; granted
-- when in the ready prefix), 2 barge (granted when it fits beside the holders). Returns the
-- fencing token (> 0) when granted (also when the token already holds: a fresh grant), else
-- -(ms until the first holder's lease or queue entry ends) - 1 (the line may move then: a
-- waiter ahead that died blocks it until its entry ends; version 5), 0 when there is neither.
CREATE OR REPLACE FUNCTION dlock.dlock_kind_acquire(p_name text, p_token text, p_excl boolean, p_cap bigint,
  p_mode integer, p_ttl_ms bigint, p_wttl_ms bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE ok boolean; n bigint; w boolean; f bigint; first_end timestamptz;
BEGIN
  PERFORM dlock.dlock_serialise(p_name);
  PERFORM dlock.dlock_kind_prune(p_name);
  IF EXISTS (SELECT 1 FROM dlock.dlock_holders WHERE name = p_name AND owner = p_token) THEN
    ok := true;
  ELSIF p_mode = 2 THEN
    SELECT count(*), coalesce(bool_or(exclusive), false) INTO n, w
      FROM dlock.dlock_holders WHERE name = p_name;
    ok := (p_excl AND n = 0) OR (NOT p_excl AND NOT w AND n < p_cap);
  ELSIF p_mode = 0 THEN
    ok := '' IN (SELECT dlock.dlock_kind_ready(p_name, p_cap, p_excl));
  ELSE
    INSERT INTO dlock.dlock_queue AS q (name, token, exclusive, seq, expires_at)
    VALUES (p_name, p_token, p_excl, nextval('dlock.dlock_fence'),
            clock_timestamp() + p_wttl_ms * interval '1 millisecond')
    ON CONFLICT (name, token) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    ok := p_token IN (SELECT dlock.dlock_kind_ready(p_name, p_cap, NULL));
  END IF;
  IF NOT ok THEN
    SELECT least((SELECT min(expires_at) FROM dlock.dlock_holders WHERE name = p_name),
                 (SELECT min(expires_at) FROM dlock.dlock_queue WHERE name = p_name)) INTO first_end;
    IF first_end IS NULL THEN RETURN 0; END IF;
    RETURN -greatest(dlock.dlock_ms_until(first_end), 1) - 1;
  END IF;
  DELETE FROM dlock.dlock_queue WHERE name = p_name AND token = p_token;
  f := dlock.dlock_next_fence();
  INSERT INTO dlock.dlock_holders AS h (name, owner, exclusive, fence, expires_at)
  VALUES (p_name, p_token, p_excl, f, clock_timestamp() + p_ttl_ms * interval '1 millisecond')
  ON CONFLICT (name, owner) DO UPDATE SET fence = EXCLUDED.fence, expires_at = EXCLUDED.expires_at;
  IF random() < 0.01 THEN PERFORM dlock.dlock_sweep(); END IF;
  RETURN f;
END $$;

-- Owner-checked release of a permit or a read or write hold; with p_abandon (the undo of an
-- acquire) also leaves the line. When that made room, notifies each waiter of the new ready
-- prefix ('<name>\t<token>') and answers their tokens in o_woken. o_held: whether the token
-- held a live lease.
CREATE OR REPLACE FUNCTION dlock.dlock_kind_release(p_name text, p_token text, p_cap bigint, p_abandon boolean,
  OUT o_held boolean, OUT o_woken text[])
LANGUAGE plpgsql AS $$
DECLARE left_line boolean := false;
BEGIN
  PERFORM dlock.dlock_serialise(p_name);
  PERFORM dlock.dlock_kind_prune(p_name);
  DELETE FROM dlock.dlock_holders WHERE name = p_name AND owner = p_token;
  o_held := FOUND;
  IF p_abandon THEN
    DELETE FROM dlock.dlock_queue WHERE name = p_name AND token = p_token;
    left_line := FOUND;
  END IF;
  o_woken := '{}';
  IF (o_held OR left_line) AND EXISTS (SELECT 1 FROM dlock.dlock_queue WHERE name = p_name) THEN
    o_woken := ARRAY(SELECT dlock.dlock_kind_ready(p_name, p_cap, NULL));
    PERFORM pg_notify('dlock.dlock_release', p_name || E'\t' || t) FROM unnest(o_woken) AS t;
  END IF;
END $$;

-- Owner-checked lease extension of permits and read or write holds, for a batch: returns the
-- owner tokens whose lease was extended. Durable like a grant (version 6).
CREATE OR REPLACE FUNCTION dlock.dlock_kind_extend(p_names text[], p_tokens text[], p_ttls_ms bigint[])
RETURNS SETOF text LANGUAGE sql AS $$
  SELECT dlock.dlock_durable_commit();
  UPDATE dlock.dlock_holders h SET expires_at = clock_timestamp() + u.ttl * interval '1 millisecond'
    FROM unnest(p_names, p_tokens, p_ttls_ms) AS u(name, token, ttl)
   WHERE h.name = u.name AND h.owner = u.token AND h.expires_at > clock_timestamp()
  RETURNING h.owner
$$;
COMMIT;
