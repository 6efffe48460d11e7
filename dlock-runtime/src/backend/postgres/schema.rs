//! The Postgres backend's schema: tables, one sequence and the PL/pgSQL functions every lock
//! operation calls (each one statement, so one transaction and one round trip), rendered for a
//! schema name and a table prefix.
//!
//! The same DDL, rendered for the defaults (schema `dlock`, prefix `dlock_`), is the file
//! `dlock-runtime/sql/postgres.sql` for teams that run their own migrations; a test keeps the
//! two equal. The DDL is idempotent (`IF NOT EXISTS`, `CREATE OR REPLACE`) and runs in one
//! transaction under a transaction-level advisory lock, so lockers starting together do not
//! trip over each other.
//!
//! | object | holds |
//! |---|---|
//! | `<s>.<p>fence` | sequence: every fencing token's count and every waiter's place in line |
//! | `<s>.<p>timeline`, `next_fence` | the server's WAL timeline; a new fencing token, `epoch × 2^48 + nextval` |
//! | `<s>.<p>fence_epoch` | one row: the timeline last seen and the epoch, the tokens' high part |
//! | `<s>.<p>locks` | one row per held (or lapsed, not yet swept) lock: owner token, fencing token, expiry (`timestamptz`, the database's clock), whether a barging waiter asked to be woken |
//! | `<s>.<p>waiters` | one row per queued waiter: its place (`seq`), entry expiry, the lease a handoff grants it |
//! | `<s>.<p>idempotency` | one row per idempotency key: fingerprint, the running attempt's owner token or the stored result, expiry |
//! | `<s>.<p>holders` | one row per holder of a semaphore permit or a read or write hold: name (`…:sem`, `…:rw`), owner token, exclusive (a writer), fencing token, lease expiry |
//! | `<s>.<p>queue` | one row per queued waiter of a semaphore or read-write lock: its place (`seq`), exclusive, entry expiry |
//! | `<s>.<p>acquire`, `release`, `extend`, `abandon`, `idem_begin`, `idem_complete`, `idem_abort`, `kind_acquire`, `kind_release`, `kind_extend` | the operations, each atomic |
//!
//! **Serialisation.** Every function that may grant or pass on a lock first takes
//! `pg_advisory_xact_lock(1684825963, hashtext(<lock name>))` — the two-`int4` form, whose key
//! space never meets the one-`bigint` form of the transaction-scoped mode or of the
//! application's own advisory locks — and reads the lock's row `FOR UPDATE`. A fencing token is
//! drawn (`next_fence`) only under that lock, after the previous grant of the key committed, so
//! tokens of one key are strictly increasing (two names with the same 32-bit hash only take
//! turns). `extend` is a single owner-checked `UPDATE` (the row lock suffices). All of it
//! relies on `READ COMMITTED`, where each statement sees what committed before it, also after
//! waiting for the advisory lock: `next_fence` refuses a grant in any other transaction
//! (`read_committed`, version 8).
//!
//! **Fencing across a failover.** A token is an epoch × 2^48 plus the sequence's next value;
//! the epoch follows the server's WAL timeline. With asynchronous replication a standby can be
//! promoted without the latest grants, and its sequence is then behind the old primary's; but
//! promotion starts a new timeline, and the epoch goes up with it, so every token the new
//! primary issues is larger than every token of the old one — also while the old one, not yet
//! fenced off, still takes writes. Where the server hides its WAL position
//! (`pg_current_wal_lsn` refused, as on Amazon Aurora, whose failovers lose no committed rows),
//! the DDL makes `timeline()` answer 1 — decided when the DDL runs, with the privileges of
//! whoever runs it: apply it as a role that may call `pg_current_wal_lsn`.
//!
//! **Fencing across a copy.** The epoch is kept in `fence_epoch` with the timeline it was
//! last seen on, and `next_fence` raises it only when the server it runs on reports another
//! timeline than that row: by the difference on a promotion, by one when the timeline is lower
//! (a copy of data from a promoted server restored on a new cluster, whose timeline is 1).
//! **A copy on the same timeline as its original does not raise it**: a dump of a server
//! that was never promoted restored on a new cluster, `pg_upgrade` (which starts the new
//! cluster on timeline 1), a storage snapshot or volume clone, an Amazon Aurora clone (whose
//! `timeline()` is always 1). Such a copy goes on from the sequence value it was made with, so
//! while the original also serves, the two issue the same tokens. Before a copy serves locks
//! next to the original (or after the original issued tokens the copy did not see), raise its
//! epoch by hand, once, on the copy: `UPDATE <s>.<p>fence_epoch SET epoch = epoch + 1` — every
//! token it issues then is above every token the original issues while the original stays on
//! its epoch. There is no API for it: [`AdminStore::force_release`](crate::backend::AdminStore)
//! raises the sequence by one draw, which the original's sequence matches. (A copy made by
//! logical replication has no sequence values: set the sequence as for every other one.)
//!
//! **Durability of a grant.** A grant is answered after its transaction committed, and a
//! commit with `synchronous_commit = off` — set for the server, a database, a role, or a
//! connection's `options=-c synchronous_commit=off` — returns before its WAL is flushed: a
//! crash (or `kill -9` of the server) up to three `wal_writer_delay`s later loses the grant and
//! the sequence's advance, so the lock is granted again to another owner with the very fencing
//! token the first was given. Every function whose commit must outlive a crash therefore raises
//! `synchronous_commit` from `off` to `local` for its own transaction (`durable_commit`:
//! `set_config(…, true)`, transaction-local, so it never leaks to the next client of a PgBouncer
//! server connection; version 6) — `local` and stronger settings are left as they are, so a
//! role kept out of a synchronous standby's wait (`synchronous_commit = local`) stays out:
//! `next_fence`, which every grant and handoff calls (`acquire`, `pass_on`, `kind_acquire`,
//! `idem_begin`, the admin's force-release), and the writes of a lease that a holder counts
//! on — `acquire` finding the lock already the caller's, `extend`, `kind_extend` — and of an
//! idempotency result (`idem_complete`). Releases, abandons and queue entries keep the
//! session's setting: losing one is what a crash just before it would have done (a lock held
//! until its lease ends, a waiter that asks again), and a later forced commit flushes them
//! too (the WAL is flushed in order).
//!
//! **Semaphores and read-write locks** keep the rule of the
//! [`backend`](crate::backend#semaphores-and-read-write-locks) module docs in `holders` and
//! `queue`: `kind_acquire` and `kind_release` take the same advisory lock on the name, prune
//! the lapsed holders and entries of that name, and walk the queue in `seq` order
//! (`kind_ready`: the ready prefix). A grant draws its fencing token from the same sequence as
//! locks; a release or abandon that made room `NOTIFY`s each waiter of the new ready prefix
//! (`<name>\t<token>`, no handoff) and answers their tokens. `kind_extend` is one
//! owner-checked `UPDATE` for a batch, like `extend`.
//!
//! **Upgrades.** Version 2 added the last two tables and the `kind_*` functions; the DDL only
//! creates what is missing, so running it over version 1 upgrades in place. Version 3 added
//! `timeline` and `next_fence`: its tokens start at 2^48, above every token of an older
//! version, so a resource keeps accepting them. Version 4 added `fence_epoch`, made equal to
//! the timeline, so its tokens go on from version 3's. Version 5 changed four function
//! bodies: a lock handed to a waiter is leased no longer than the waiter's queue entry has
//! left (`head`, as the Redis scripts do), so a dead waiter first in line blocks a lock at most
//! the waiter TTL after its last attempt (version 4 leased it the full waiter TTL from the
//! handoff); `acquire`, finding the lock free but another waiter first, answers how long that
//! waiter's entry has left (so does `idem_begin`), and `kind_acquire` the time until the
//! first holder's lease or queue entry ends (version 4 answered no time, or only the holders',
//! so a waiter behind a dead one asked again only on its next backoff step). Version 6 changed
//! five function bodies: `next_fence`, `acquire`, `extend`, `kind_extend` and `idem_complete`
//! raise `synchronous_commit` from `off` to `local` for their transaction (`durable_commit`, new;
//! see *Durability of a grant*), and
//! `next_fence` raises an exhausted token space as SQLSTATE `54000` (`program_limit_exceeded`,
//! which the backend reports as [`LockError::Misconfigured`](crate::LockError::Misconfigured):
//! retrying does not change it) rather than the generic `P0001`. Version 7 changed one function
//! body: `idem_begin` grants again a lock its own token holds (its call run again: its lease
//! restarts, as `acquire`'s does) instead of answering it held, and sweeps lapsed rows as
//! `acquire` does (at twice the rate), so a locker used only for idempotency no longer keeps
//! every record it ever stored. Version 8 added `read_committed` and changed `next_fence`,
//! which calls it: a grant in a transaction that is not `READ COMMITTED` (a database's, role's
//! or connection's `default_transaction_isolation`) is refused as SQLSTATE `0A000`
//! ([`LockError::Misconfigured`](crate::LockError::Misconfigured)) instead of reading from a
//! snapshot taken before the lock's advisory lock was granted. The DDL refuses to run over a
//! newer schema; a client of an older version uses a newer schema as it is.

/// Version of the schema below; [`render`] records it in `<s>.<p>schema_version()`.
pub(crate) const VERSION: i32 = 8;

/// The class id of the backend's internal advisory locks (`'dlck'`), the first `int4`.
pub(crate) const ADVISORY_CLASS: i32 = 0x646c_636b;

/// The default schema.
pub(crate) const DEFAULT_SCHEMA: &str = "dlock";
/// The default table prefix.
pub(crate) const DEFAULT_PREFIX: &str = "dlock_";

/// The DDL with `@s@` (schema), `@p@` (table prefix), `@ch@` (notification channel),
/// `@v@` (version) and `@k@` (advisory class) to fill in.
const TEMPLATE: &str = r#"-- dlock: the Postgres backend's schema, version @v@ (schema "@s@", table prefix "@p@").
--
-- The backend runs exactly this on first use (PostgresOptions::create_schema, on by default).
-- Teams that run their own migrations apply this file instead and turn create_schema off; the
-- backend then needs only USAGE on the schema, EXECUTE on the functions and SELECT, INSERT,
-- UPDATE, DELETE on the tables and USAGE on the sequence. Another schema or prefix:
-- PostgresOptions::ddl() prints the file rendered for them.
BEGIN;
SELECT pg_advisory_xact_lock(@k@, 0);
CREATE SCHEMA IF NOT EXISTS @s@;

-- A client that finds a newer schema never puts older functions over it.
DO $$
BEGIN
  IF to_regprocedure('@s@.@p@schema_version()') IS NOT NULL THEN
    IF @s@.@p@schema_version() > @v@ THEN
      RAISE EXCEPTION 'dlock: schema "@s@" (prefix "@p@") is at version %, newer than this client''s @v@',
        @s@.@p@schema_version();
    END IF;
  END IF;
END $$;

-- Fencing tokens and waiters' places in line: never reused, also across restarts.
CREATE SEQUENCE IF NOT EXISTS @s@.@p@fence;

-- The server's WAL timeline (version 3): 1 on a new cluster, one more on each promotion of a
-- standby (and each point-in-time recovery). Where the server does not tell its WAL position
-- (Amazon Aurora, whose failovers lose no committed rows), it is taken as 1: decided here, with
-- the privileges of the role that runs this file.
DO $$
BEGIN
  PERFORM pg_walfile_name(pg_current_wal_lsn());
  CREATE OR REPLACE FUNCTION @s@.@p@timeline() RETURNS bigint LANGUAGE sql
    AS $f$SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint$f$;
EXCEPTION WHEN OTHERS THEN
  CREATE OR REPLACE FUNCTION @s@.@p@timeline() RETURNS bigint LANGUAGE sql AS 'SELECT 1::bigint';
END $$;

-- Makes the calling transaction's commit wait for its WAL to be written out on this server
-- (version 6) when the session would not (synchronous_commit = off): a grant, a lease restart
-- or renewal, an idempotency result answered and then lost in a crash gives the lock to a
-- second owner with the same token, or runs the work again. 'local' and every stronger setting
-- are left alone: 'local' is enough for a crash of this server (a promotion raises the fencing
-- epoch), and forcing 'on' would make the lock service wait for a synchronous standby that the
-- operator kept it out of. Transaction-local: nothing leaks to the next user of the connection
-- (PgBouncer).
CREATE OR REPLACE FUNCTION @s@.@p@durable_commit() RETURNS void
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
CREATE OR REPLACE FUNCTION @s@.@p@read_committed() RETURNS void
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
--   UPDATE @s@.@p@fence_epoch SET epoch = epoch + 1;
-- Its row is made below, once the tables exist.
-- (Teams that grant privileges table by table: the backend's role needs SELECT, INSERT and
-- UPDATE on this table too.)
CREATE TABLE IF NOT EXISTS @s@.@p@fence_epoch (
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
CREATE OR REPLACE FUNCTION @s@.@p@next_fence() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE n bigint := nextval('@s@.@p@fence'); tl bigint := @s@.@p@timeline(); e bigint;
BEGIN
  PERFORM @s@.@p@read_committed();
  PERFORM @s@.@p@durable_commit();
  SELECT epoch INTO e FROM @s@.@p@fence_epoch WHERE one AND timeline = tl;
  IF NOT FOUND THEN
    UPDATE @s@.@p@fence_epoch SET epoch = epoch + greatest(tl - timeline, 1), timeline = tl
      WHERE one AND timeline <> tl RETURNING epoch INTO e;
    IF NOT FOUND THEN
      INSERT INTO @s@.@p@fence_epoch AS f (timeline, epoch) VALUES (tl, tl)
        ON CONFLICT (one) DO UPDATE SET timeline = f.timeline RETURNING f.epoch INTO e;
    END IF;
  END IF;
  IF n >= 281474976710656 OR e >= 32768 THEN
    RAISE EXCEPTION 'dlock: fencing tokens exhausted (epoch %, sequence %)', e, n
      USING ERRCODE = 'program_limit_exceeded';
  END IF;
  RETURN e * 281474976710656 + n;
END $$;

CREATE TABLE IF NOT EXISTS @s@.@p@locks (
    name       text PRIMARY KEY,
    owner      text NOT NULL,
    fence      bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    barged     boolean NOT NULL DEFAULT false
);

CREATE TABLE IF NOT EXISTS @s@.@p@waiters (
    name       text NOT NULL,
    token      text NOT NULL,
    seq        bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    lease_ms   bigint NOT NULL,
    PRIMARY KEY (name, token)
);
CREATE INDEX IF NOT EXISTS @p@waiters_line ON @s@.@p@waiters (name, seq);

CREATE TABLE IF NOT EXISTS @s@.@p@idempotency (
    name        text PRIMARY KEY,
    fingerprint text NOT NULL,
    owner       text,
    result      bytea,
    expires_at  timestamptz NOT NULL
);

-- Semaphores and read-write locks (version 2): their holders and their waiters' line.
CREATE TABLE IF NOT EXISTS @s@.@p@holders (
    name       text NOT NULL,
    owner      text NOT NULL,
    exclusive  boolean NOT NULL,
    fence      bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (name, owner)
);

CREATE TABLE IF NOT EXISTS @s@.@p@queue (
    name       text NOT NULL,
    token      text NOT NULL,
    exclusive  boolean NOT NULL,
    seq        bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (name, token)
);
CREATE INDEX IF NOT EXISTS @p@queue_line ON @s@.@p@queue (name, seq);

-- The epoch row: the timeline now, and an epoch no lower than it nor than the high part of any
-- token the locks and holders hold (version 3 used the timeline; a timeline() that answers 1
-- here (a role that may not read the WAL position) still does not take tokens back).
INSERT INTO @s@.@p@fence_epoch (timeline, epoch)
  SELECT @s@.@p@timeline(), greatest(@s@.@p@timeline(),
    (SELECT coalesce(max(fence), 0) / 281474976710656 FROM @s@.@p@locks),
    (SELECT coalesce(max(fence), 0) / 281474976710656 FROM @s@.@p@holders))
  ON CONFLICT DO NOTHING;

CREATE OR REPLACE FUNCTION @s@.@p@schema_version() RETURNS integer
LANGUAGE sql IMMUTABLE AS 'SELECT @v@';

-- Serialises every grant of one lock name (see the module docs).
CREATE OR REPLACE FUNCTION @s@.@p@serialise(p_name text) RETURNS void
LANGUAGE sql AS 'SELECT pg_advisory_xact_lock(@k@, hashtext(p_name))';

-- Milliseconds from now until t (at least 0).
CREATE OR REPLACE FUNCTION @s@.@p@ms_until(t timestamptz) RETURNS bigint
LANGUAGE sql AS 'SELECT greatest(0, ceil(extract(epoch FROM (t - clock_timestamp())) * 1000))::bigint';

-- The first live waiter of a lock (dropping expired entries): its token and handoff lease -
-- the lease its entry notes, but ending no later than the entry would have (version 5): a
-- waiter that died holds a handed-over lock no longer than its entry would have held up the
-- line. A live waiter loses nothing: it asks again within a third of the waiter TTL of its
-- last attempt, which set the entry's expiry, and that grant restarts the lease.
CREATE OR REPLACE FUNCTION @s@.@p@head(p_name text, OUT token text, OUT lease_ms bigint)
LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM @s@.@p@waiters w WHERE w.name = p_name AND w.expires_at <= clock_timestamp();
  SELECT w.token, least(w.lease_ms, @s@.@p@ms_until(w.expires_at)) INTO token, lease_ms
    FROM @s@.@p@waiters w WHERE w.name = p_name ORDER BY w.seq LIMIT 1;
END $$;

-- Puts (or keeps) a waiter in line with a fresh entry expiry.
CREATE OR REPLACE FUNCTION @s@.@p@enqueue(p_name text, p_token text, p_lease_ms bigint, p_wttl_ms bigint)
RETURNS void LANGUAGE sql AS $$
  INSERT INTO @s@.@p@waiters AS w (name, token, seq, expires_at, lease_ms)
  VALUES (p_name, p_token, nextval('@s@.@p@fence'),
          clock_timestamp() + p_wttl_ms * interval '1 millisecond', least(p_lease_ms, p_wttl_ms))
  ON CONFLICT (name, token) DO UPDATE SET expires_at = EXCLUDED.expires_at, lease_ms = EXCLUDED.lease_ms
$$;

-- The lock is given up (released, abandoned, completed): grant it to the first live waiter
-- with a new fencing token and tell it (direct handoff), or delete it, waking a barging waiter
-- if one asked. Returns '<waiter token>\t<fencing token>' after a handoff, else NULL (the
-- caller may tell a waiter of its own process at once). Needs serialise().
CREATE OR REPLACE FUNCTION @s@.@p@pass_on(p_name text, p_barged boolean) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE h record; f bigint;
BEGIN
  SELECT * INTO h FROM @s@.@p@head(p_name);
  IF h.token IS NULL THEN
    DELETE FROM @s@.@p@locks WHERE name = p_name;
    IF p_barged THEN PERFORM pg_notify('@ch@', p_name || E'\t'); END IF;
    RETURN NULL;
  END IF;
  DELETE FROM @s@.@p@waiters WHERE name = p_name AND token = h.token;
  f := @s@.@p@next_fence();
  INSERT INTO @s@.@p@locks AS l (name, owner, fence, expires_at, barged)
  VALUES (p_name, h.token, f, clock_timestamp() + h.lease_ms * interval '1 millisecond', p_barged)
  ON CONFLICT (name) DO UPDATE
    SET owner = EXCLUDED.owner, fence = EXCLUDED.fence, expires_at = EXCLUDED.expires_at, barged = EXCLUDED.barged;
  PERFORM pg_notify('@ch@', p_name || E'\t' || h.token || E'\t' || f);
  RETURN h.token || E'\t' || f;
END $$;

-- Deletes a bounded batch of rows that lapsed more than a minute ago.
CREATE OR REPLACE FUNCTION @s@.@p@sweep() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM @s@.@p@locks WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM @s@.@p@locks WHERE expires_at < clock_timestamp() - interval '1 minute'
    LIMIT 100 FOR UPDATE SKIP LOCKED));
  DELETE FROM @s@.@p@waiters WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM @s@.@p@waiters WHERE expires_at < clock_timestamp() - interval '1 minute'
    LIMIT 100 FOR UPDATE SKIP LOCKED));
  DELETE FROM @s@.@p@idempotency WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM @s@.@p@idempotency WHERE expires_at < clock_timestamp()
    LIMIT 100 FOR UPDATE SKIP LOCKED));
  DELETE FROM @s@.@p@holders WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM @s@.@p@holders WHERE expires_at < clock_timestamp() - interval '1 minute'
    LIMIT 100 FOR UPDATE SKIP LOCKED));
  DELETE FROM @s@.@p@queue WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM @s@.@p@queue WHERE expires_at < clock_timestamp() - interval '1 minute'
    LIMIT 100 FOR UPDATE SKIP LOCKED));
END $$;

-- One acquire attempt. p_mode: 0 try, 1 queue, 2 barge.
-- Returns the fencing token (> 0) when granted (also when the lock is already this token's:
-- handed over by a release whose notification was lost; same token, lease restarted),
-- -(lease left ms) - 1 when someone else holds it, and -(ms left on the first waiter's entry)
-- - 1 when it is free but another waiter is first in line (version 5; it was 0): a waiter
-- behind one that died asks again when that entry ends, as on Redis, not a backoff step later.
CREATE OR REPLACE FUNCTION @s@.@p@acquire(p_name text, p_token text, p_ttl_ms bigint, p_mode integer, p_wttl_ms bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE l record; h record; f bigint;
BEGIN
  PERFORM @s@.@p@serialise(p_name);
  SELECT owner, fence, expires_at INTO l FROM @s@.@p@locks WHERE name = p_name FOR UPDATE;
  IF FOUND AND l.expires_at > clock_timestamp() THEN
    IF l.owner = p_token THEN
      -- A lease restarted: as durable as a grant (version 6; see next_fence).
      PERFORM @s@.@p@durable_commit();
      UPDATE @s@.@p@locks SET expires_at = clock_timestamp() + p_ttl_ms * interval '1 millisecond'
       WHERE name = p_name;
      RETURN l.fence;
    END IF;
    IF p_mode = 1 THEN
      PERFORM @s@.@p@enqueue(p_name, p_token, p_ttl_ms, p_wttl_ms);
    ELSIF p_mode = 2 THEN
      UPDATE @s@.@p@locks SET barged = true WHERE name = p_name AND NOT barged;
    END IF;
    RETURN -@s@.@p@ms_until(l.expires_at) - 1;
  END IF;
  -- Free. The line is looked at only when it has entries (the uncontended path skips it).
  IF EXISTS (SELECT 1 FROM @s@.@p@waiters WHERE name = p_name) THEN
    SELECT * INTO h FROM @s@.@p@head(p_name);
    IF h.token IS NOT NULL AND h.token <> p_token AND p_mode <> 2 THEN
      IF p_mode = 1 THEN PERFORM @s@.@p@enqueue(p_name, p_token, p_ttl_ms, p_wttl_ms); END IF;
      RETURN coalesce(-@s@.@p@ms_until((SELECT w.expires_at FROM @s@.@p@waiters w
                                         WHERE w.name = p_name AND w.token = h.token)) - 1, 0);
    END IF;
    IF h.token IS NOT NULL THEN
      DELETE FROM @s@.@p@waiters WHERE name = p_name AND token = p_token;
    END IF;
  END IF;
  f := @s@.@p@next_fence();
  INSERT INTO @s@.@p@locks AS k (name, owner, fence, expires_at)
  VALUES (p_name, p_token, f, clock_timestamp() + p_ttl_ms * interval '1 millisecond')
  ON CONFLICT (name) DO UPDATE
    SET owner = EXCLUDED.owner, fence = EXCLUDED.fence, expires_at = EXCLUDED.expires_at, barged = false;
  IF random() < 0.01 THEN PERFORM @s@.@p@sweep(); END IF;
  RETURN f;
END $$;

-- Owner-checked release: hands the lock to the next live waiter, or deletes it.
-- Returns NULL when the token did not hold the lock; '' when it did (also a lease of it that
-- lapsed with nobody taking the lock since: the locker reports that as lost by its own lease
-- clock); '<waiter token>\t<fencing token>' when it did and the lock went to that waiter.
CREATE OR REPLACE FUNCTION @s@.@p@release(p_name text, p_token text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE l record;
BEGIN
  PERFORM @s@.@p@serialise(p_name);
  SELECT owner, barged INTO l FROM @s@.@p@locks WHERE name = p_name FOR UPDATE;
  IF NOT FOUND OR l.owner <> p_token THEN RETURN NULL; END IF;
  IF NOT l.barged AND NOT EXISTS (SELECT 1 FROM @s@.@p@waiters WHERE name = p_name) THEN
    -- Nobody waits (the uncontended path): delete, notify nobody.
    DELETE FROM @s@.@p@locks WHERE name = p_name;
    RETURN '';
  END IF;
  RETURN coalesce(@s@.@p@pass_on(p_name, l.barged), '');
END $$;

-- Undo of a cancelled or abandoned acquire: release if owner, leave the line, and pass a free
-- lock on if that made someone else first.
CREATE OR REPLACE FUNCTION @s@.@p@abandon(p_name text, p_token text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE l record; held boolean; free boolean; left_line boolean;
BEGIN
  PERFORM @s@.@p@serialise(p_name);
  SELECT owner, expires_at, barged INTO l FROM @s@.@p@locks WHERE name = p_name FOR UPDATE;
  held := FOUND AND l.owner = p_token;
  free := NOT FOUND OR l.expires_at <= clock_timestamp();
  DELETE FROM @s@.@p@waiters WHERE name = p_name AND token = p_token;
  left_line := FOUND;
  IF held OR (left_line AND free) THEN
    PERFORM @s@.@p@pass_on(p_name, coalesce(l.barged, false));
  END IF;
  RETURN held::integer;
END $$;

-- Owner-checked lease extension, for a batch: returns the names whose lease was extended.
-- Durable like a grant (version 6): a holder counts its lease from the answer.
CREATE OR REPLACE FUNCTION @s@.@p@extend(p_names text[], p_tokens text[], p_ttls_ms bigint[])
RETURNS SETOF text LANGUAGE sql AS $$
  SELECT @s@.@p@durable_commit();
  UPDATE @s@.@p@locks k SET expires_at = clock_timestamp() + u.ttl * interval '1 millisecond'
    FROM unnest(p_names, p_tokens, p_ttls_ms) AS u(name, token, ttl)
   WHERE k.name = u.name AND k.owner = u.token AND k.expires_at > clock_timestamp()
  RETURNING k.name
$$;

-- Idempotency, step one. o_code: 1 granted (o_n = fencing token; also when the lock is already
-- this token's: the call run again, its lease restarted), 2 replay (o_result),
-- 3 mismatch, 0 held (o_n = lease left ms, or, free but a waiter first, what that waiter's
-- entry has left (version 5; it was -2, no time); o_same = 1 same fingerprint, 0 different,
-- NULL unknown).
CREATE OR REPLACE FUNCTION @s@.@p@idem_begin(p_name text, p_token text, p_ttl_ms bigint, p_fp text, p_retention_ms bigint,
  OUT o_code integer, OUT o_n bigint, OUT o_same integer, OUT o_result bytea)
LANGUAGE plpgsql AS $$
DECLARE r record; l record; h record;
BEGIN
  PERFORM @s@.@p@serialise(p_name);
  SELECT fingerprint, owner, result AS res INTO r FROM @s@.@p@idempotency
   WHERE name = p_name AND expires_at > clock_timestamp();
  IF FOUND AND r.res IS NOT NULL THEN
    IF r.fingerprint = p_fp THEN o_code := 2; o_result := r.res; ELSE o_code := 3; END IF;
    RETURN;
  END IF;
  SELECT owner, fence, expires_at INTO l FROM @s@.@p@locks WHERE name = p_name FOR UPDATE;
  IF FOUND AND l.expires_at > clock_timestamp() AND l.owner = p_token THEN
    -- This attempt's own lock (its begin run again; version 7): its lease restarts, as
    -- durable as a grant.
    PERFORM @s@.@p@durable_commit();
    UPDATE @s@.@p@locks SET expires_at = clock_timestamp() + p_ttl_ms * interval '1 millisecond'
     WHERE name = p_name;
    o_code := 1;
    o_n := l.fence;
    RETURN;
  END IF;
  IF FOUND AND l.expires_at > clock_timestamp() THEN
    o_code := 0;
    o_n := @s@.@p@ms_until(l.expires_at);
    IF r.owner IS NOT NULL AND r.owner = l.owner THEN o_same := (r.fingerprint = p_fp)::integer; END IF;
    RETURN;
  END IF;
  SELECT * INTO h FROM @s@.@p@head(p_name);
  IF h.token IS NOT NULL THEN
    o_code := 0;
    o_n := coalesce(@s@.@p@ms_until((SELECT w.expires_at FROM @s@.@p@waiters w
                                     WHERE w.name = p_name AND w.token = h.token)), -2);
    RETURN;
  END IF;
  o_n := @s@.@p@next_fence();
  INSERT INTO @s@.@p@locks AS k (name, owner, fence, expires_at)
  VALUES (p_name, p_token, o_n, clock_timestamp() + p_ttl_ms * interval '1 millisecond')
  ON CONFLICT (name) DO UPDATE
    SET owner = EXCLUDED.owner, fence = EXCLUDED.fence, expires_at = EXCLUDED.expires_at, barged = false;
  INSERT INTO @s@.@p@idempotency AS i (name, fingerprint, owner, result, expires_at)
  VALUES (p_name, p_fp, p_token, NULL, clock_timestamp() + p_retention_ms * interval '1 millisecond')
  ON CONFLICT (name) DO UPDATE
    SET fingerprint = EXCLUDED.fingerprint, owner = EXCLUDED.owner, result = NULL, expires_at = EXCLUDED.expires_at;
  -- Records that lapsed go here too (version 7): a locker used only for idempotency never
  -- acquires, and its table grew by a record per key for ever. Twice acquire's rate: up to
  -- 100 rows a sweep, so it removes more than the one record each begin may add.
  IF random() < 0.02 THEN PERFORM @s@.@p@sweep(); END IF;
  o_code := 1;
END $$;

-- Idempotency, last step: owner-checked; stores the result and releases the lock together,
-- handing it to the next live waiter if any. Returns 1 when stored, 0 when the token did not
-- hold a live lease (nothing changed). The record is durable (version 6): lost in a crash
-- after the answer, the work it records would run again.
CREATE OR REPLACE FUNCTION @s@.@p@idem_complete(p_name text, p_token text, p_fp text, p_result bytea, p_retention_ms bigint)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE l record;
BEGIN
  PERFORM @s@.@p@serialise(p_name);
  SELECT owner, expires_at, barged INTO l FROM @s@.@p@locks WHERE name = p_name FOR UPDATE;
  IF NOT FOUND OR l.owner <> p_token OR l.expires_at <= clock_timestamp() THEN RETURN 0; END IF;
  PERFORM @s@.@p@durable_commit();
  INSERT INTO @s@.@p@idempotency AS i (name, fingerprint, owner, result, expires_at)
  VALUES (p_name, p_fp, NULL, p_result, clock_timestamp() + p_retention_ms * interval '1 millisecond')
  ON CONFLICT (name) DO UPDATE
    SET fingerprint = EXCLUDED.fingerprint, owner = NULL, result = EXCLUDED.result, expires_at = EXCLUDED.expires_at;
  PERFORM @s@.@p@pass_on(p_name, l.barged);
  RETURN 1;
END $$;

-- Idempotency, abort: owner-checked release without a record (drops the running attempt's
-- note). Returns 1 when released, 0 when the token did not hold a live lease.
CREATE OR REPLACE FUNCTION @s@.@p@idem_abort(p_name text, p_token text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE l record;
BEGIN
  PERFORM @s@.@p@serialise(p_name);
  SELECT owner, expires_at, barged INTO l FROM @s@.@p@locks WHERE name = p_name FOR UPDATE;
  IF NOT FOUND OR l.owner <> p_token OR l.expires_at <= clock_timestamp() THEN RETURN 0; END IF;
  DELETE FROM @s@.@p@idempotency WHERE name = p_name AND owner = p_token AND result IS NULL;
  PERFORM @s@.@p@pass_on(p_name, l.barged);
  RETURN 1;
END $$;
-- Semaphores and read-write locks. Drops the lapsed holders and queue entries of one name.
CREATE OR REPLACE FUNCTION @s@.@p@kind_prune(p_name text) RETURNS void
LANGUAGE sql AS $$
  DELETE FROM @s@.@p@holders WHERE name = p_name AND expires_at <= clock_timestamp();
  DELETE FROM @s@.@p@queue WHERE name = p_name AND expires_at <= clock_timestamp();
$$;

-- The ready prefix of a name (after kind_prune): the queued tokens, in line order, each of
-- which fits beside the live holders and the waiters before it (exclusive: no holder at all;
-- shared: no exclusive holder and fewer than p_cap). When the whole line fits and
-- p_tail_excl is not NULL, one more row '' says that a newcomer (exclusive if p_tail_excl)
-- would fit after it. Needs serialise().
CREATE OR REPLACE FUNCTION @s@.@p@kind_ready(p_name text, p_cap bigint, p_tail_excl boolean)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE n bigint; w boolean; q record;
BEGIN
  SELECT count(*), coalesce(bool_or(exclusive), false) INTO n, w
    FROM @s@.@p@holders WHERE name = p_name;
  FOR q IN SELECT token, exclusive FROM @s@.@p@queue WHERE name = p_name ORDER BY seq LOOP
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
CREATE OR REPLACE FUNCTION @s@.@p@kind_acquire(p_name text, p_token text, p_excl boolean, p_cap bigint,
  p_mode integer, p_ttl_ms bigint, p_wttl_ms bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE ok boolean; n bigint; w boolean; f bigint; first_end timestamptz;
BEGIN
  PERFORM @s@.@p@serialise(p_name);
  PERFORM @s@.@p@kind_prune(p_name);
  IF EXISTS (SELECT 1 FROM @s@.@p@holders WHERE name = p_name AND owner = p_token) THEN
    ok := true;
  ELSIF p_mode = 2 THEN
    SELECT count(*), coalesce(bool_or(exclusive), false) INTO n, w
      FROM @s@.@p@holders WHERE name = p_name;
    ok := (p_excl AND n = 0) OR (NOT p_excl AND NOT w AND n < p_cap);
  ELSIF p_mode = 0 THEN
    ok := '' IN (SELECT @s@.@p@kind_ready(p_name, p_cap, p_excl));
  ELSE
    INSERT INTO @s@.@p@queue AS q (name, token, exclusive, seq, expires_at)
    VALUES (p_name, p_token, p_excl, nextval('@s@.@p@fence'),
            clock_timestamp() + p_wttl_ms * interval '1 millisecond')
    ON CONFLICT (name, token) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    ok := p_token IN (SELECT @s@.@p@kind_ready(p_name, p_cap, NULL));
  END IF;
  IF NOT ok THEN
    SELECT least((SELECT min(expires_at) FROM @s@.@p@holders WHERE name = p_name),
                 (SELECT min(expires_at) FROM @s@.@p@queue WHERE name = p_name)) INTO first_end;
    IF first_end IS NULL THEN RETURN 0; END IF;
    RETURN -greatest(@s@.@p@ms_until(first_end), 1) - 1;
  END IF;
  DELETE FROM @s@.@p@queue WHERE name = p_name AND token = p_token;
  f := @s@.@p@next_fence();
  INSERT INTO @s@.@p@holders AS h (name, owner, exclusive, fence, expires_at)
  VALUES (p_name, p_token, p_excl, f, clock_timestamp() + p_ttl_ms * interval '1 millisecond')
  ON CONFLICT (name, owner) DO UPDATE SET fence = EXCLUDED.fence, expires_at = EXCLUDED.expires_at;
  IF random() < 0.01 THEN PERFORM @s@.@p@sweep(); END IF;
  RETURN f;
END $$;

-- Owner-checked release of a permit or a read or write hold; with p_abandon (the undo of an
-- acquire) also leaves the line. When that made room, notifies each waiter of the new ready
-- prefix ('<name>\t<token>') and answers their tokens in o_woken. o_held: whether the token
-- held a live lease.
CREATE OR REPLACE FUNCTION @s@.@p@kind_release(p_name text, p_token text, p_cap bigint, p_abandon boolean,
  OUT o_held boolean, OUT o_woken text[])
LANGUAGE plpgsql AS $$
DECLARE left_line boolean := false;
BEGIN
  PERFORM @s@.@p@serialise(p_name);
  PERFORM @s@.@p@kind_prune(p_name);
  DELETE FROM @s@.@p@holders WHERE name = p_name AND owner = p_token;
  o_held := FOUND;
  IF p_abandon THEN
    DELETE FROM @s@.@p@queue WHERE name = p_name AND token = p_token;
    left_line := FOUND;
  END IF;
  o_woken := '{}';
  IF (o_held OR left_line) AND EXISTS (SELECT 1 FROM @s@.@p@queue WHERE name = p_name) THEN
    o_woken := ARRAY(SELECT @s@.@p@kind_ready(p_name, p_cap, NULL));
    PERFORM pg_notify('@ch@', p_name || E'\t' || t) FROM unnest(o_woken) AS t;
  END IF;
END $$;

-- Owner-checked lease extension of permits and read or write holds, for a batch: returns the
-- owner tokens whose lease was extended. Durable like a grant (version 6).
CREATE OR REPLACE FUNCTION @s@.@p@kind_extend(p_names text[], p_tokens text[], p_ttls_ms bigint[])
RETURNS SETOF text LANGUAGE sql AS $$
  SELECT @s@.@p@durable_commit();
  UPDATE @s@.@p@holders h SET expires_at = clock_timestamp() + u.ttl * interval '1 millisecond'
    FROM unnest(p_names, p_tokens, p_ttls_ms) AS u(name, token, ttl)
   WHERE h.name = u.name AND h.owner = u.token AND h.expires_at > clock_timestamp()
  RETURNING h.owner
$$;
COMMIT;
"#;

/// Whether `name` may be a schema or table prefix: `[a-z_][a-z0-9_]*`, at most `max` bytes
/// (every object name stays within Postgres's 63 bytes, unquoted and case-stable).
pub(crate) fn valid_identifier(name: &str, max: usize, may_be_empty: bool) -> bool {
    if name.is_empty() {
        return may_be_empty;
    }
    name.len() <= max
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// The longest channel name `pg_notify` takes (`NAMEDATALEN - 1`; `LISTEN` would truncate a
/// longer one, `pg_notify` refuses it).
const MAX_CHANNEL: usize = 63;

/// The notification channel of a schema and prefix: `<schema>.<prefix>release` when that fits
/// in [`MAX_CHANNEL`] bytes (every schema and prefix up to 55 bytes together), else its first
/// 46 bytes, `~` and a 64-bit FNV-1a digest of the whole name in hex — 63 bytes, the same on
/// every machine and release.
pub(crate) fn channel(schema: &str, prefix: &str) -> String {
    let full = format!("{schema}.{prefix}release");
    if full.len() <= MAX_CHANNEL {
        return full;
    }
    // Identifiers are ASCII (see `valid_identifier`): any byte offset is a char boundary.
    let digest = full.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{}~{digest:016x}", &full[..MAX_CHANNEL - 17])
}

/// Whether [`channel`] is a digest for these names: functions rendered before the digest
/// existed (the whole name, which `pg_notify` refuses) must be replaced.
pub(crate) fn channel_is_digest(schema: &str, prefix: &str) -> bool {
    channel(schema, prefix) != format!("{schema}.{prefix}release")
}

/// The DDL for `schema` and `prefix` (both checked with [`valid_identifier`]).
pub(crate) fn render(schema: &str, prefix: &str) -> String {
    TEMPLATE
        .replace("@ch@", &channel(schema, prefix))
        .replace("@s@", schema)
        .replace("@p@", prefix)
        .replace("@v@", &VERSION.to_string())
        .replace("@k@", &ADVISORY_CLASS.to_string())
}

/// The statements the backend sends, for one schema and prefix. Each is one function call with
/// typed parameters (sent as one Parse/Bind/Execute/Sync with the unnamed statement).
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) version: String,
    pub(crate) acquire: String,
    pub(crate) release: String,
    pub(crate) abandon: String,
    pub(crate) extend: String,
    pub(crate) idem_begin: String,
    pub(crate) idem_complete: String,
    pub(crate) idem_abort: String,
    pub(crate) kind_acquire: String,
    pub(crate) kind_release: String,
    pub(crate) kind_extend: String,
    pub(crate) delete: String,
}

impl Statements {
    pub(crate) fn new(schema: &str, prefix: &str) -> Self {
        let f = |name: &str, args: &str| format!("SELECT {schema}.{prefix}{name}({args})");
        Statements {
            version: f("schema_version", ""),
            acquire: f("acquire", "$1, $2, $3, $4, $5"),
            release: f("release", "$1, $2"),
            abandon: f("abandon", "$1, $2"),
            extend: format!("SELECT * FROM {schema}.{prefix}extend($1, $2, $3)"),
            idem_begin: format!(
                "SELECT o_code, o_n, o_same, o_result FROM {schema}.{prefix}idem_begin($1, $2, $3, $4, $5)"
            ),
            idem_complete: f("idem_complete", "$1, $2, $3, $4, $5"),
            idem_abort: f("idem_abort", "$1, $2"),
            kind_acquire: f("kind_acquire", "$1, $2, $3, $4, $5, $6, $7"),
            kind_release: format!(
                "SELECT o_held, o_woken FROM {schema}.{prefix}kind_release($1, $2, $3, $4)"
            ),
            kind_extend: format!("SELECT * FROM {schema}.{prefix}kind_extend($1, $2, $3)"),
            // A lock's row, or every holder of a semaphore or read-write lock.
            delete: format!(
                "WITH l AS (DELETE FROM {schema}.{prefix}locks WHERE name = $1 RETURNING name), \
                 h AS (DELETE FROM {schema}.{prefix}holders WHERE name = $1 RETURNING name) \
                 SELECT name FROM l UNION ALL SELECT name FROM h"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dlock-runtime/sql/postgres.sql` is exactly what the backend runs with the defaults.
    /// `DLOCK_BLESS=1` rewrites the file.
    #[test]
    fn sql_file_matches_the_ddl() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/sql/postgres.sql");
        let ddl = render(DEFAULT_SCHEMA, DEFAULT_PREFIX);
        if std::env::var_os("DLOCK_BLESS").is_some() {
            std::fs::write(path, &ddl).unwrap();
        }
        let file = std::fs::read_to_string(path).unwrap();
        assert!(
            file == ddl,
            "sql/postgres.sql differs from the DDL the backend runs; DLOCK_BLESS=1 rewrites it"
        );
    }

    /// The DDL is sent as one query, comments included, converted to the database's
    /// encoding: a character a `LATIN1` database has no place for (an em dash in a comment)
    /// failed the schema's creation there (`22P05`).
    #[test]
    fn the_ddl_is_ascii_so_it_installs_in_any_encoding() {
        let ddl = render(DEFAULT_SCHEMA, DEFAULT_PREFIX);
        let odd: Vec<&str> = ddl.lines().filter(|l| !l.is_ascii()).collect();
        assert!(odd.is_empty(), "{odd:#?}");
    }

    #[test]
    fn channels_fit_in_a_postgres_name() {
        assert_eq!(channel("dlock", "dlock_"), "dlock.dlock_release");
        let (s40, p15) = ("s".repeat(40), "p".repeat(15));
        assert_eq!(channel(&s40, &p15), format!("{s40}.{p15}release"));
        assert!(!channel_is_digest(&s40, &p15));
        let (s40, p16) = ("s".repeat(40), "p".repeat(16));
        let long = channel(&s40, &p16);
        assert_eq!(long.len(), MAX_CHANNEL);
        assert!(long.starts_with(&format!("{s40}.p")), "{long}");
        assert!(channel_is_digest(&s40, &p16));
        // Names that share the first 46 bytes still get their own channel.
        assert_ne!(long, channel(&s40, &"q".repeat(16)));
    }

    #[test]
    fn identifiers() {
        assert!(valid_identifier("dlock", 40, false));
        assert!(valid_identifier("", 20, true));
        assert!(!valid_identifier("", 40, false));
        for bad in ["Dlock", "1a", "a-b", "a b", "a\"b", "a;drop"] {
            assert!(!valid_identifier(bad, 40, false), "{bad}");
        }
        assert!(!valid_identifier(&"a".repeat(41), 40, false));
    }
}
