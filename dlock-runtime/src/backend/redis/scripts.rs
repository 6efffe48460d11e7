//! The Lua scripts of the Redis backend. Each runs atomically on the server and is invoked by
//! SHA (`EVALSHA`), reloaded on `NOSCRIPT`.
//!
//! Key layout of one lock (the per-lock keys share the hash tag `{<key>}`):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<p>:{<k>}` | string | the owner token, or `<flags>\|<owner token>`; `PX` = lease + [`LINGER`] |
//! | `<p>:{<k>}:q` | list | waiter tokens in arrival order |
//! | `<p>:{<k>}:qw` | hash | waiter token → `<entry deadline ms>\|<lease ms>` |
//! | `<p>:fence` | string | the namespace's fencing counter (no expiry) |
//! | `dlock:issuers` | string | the issuer numbers taken by clients (`INCR` at connect; no expiry) |
//! | `<p>:{<k>}:ch` | channel | `<token>:<fence>` when the lock was handed to that waiter, `""` to wake a barging waiter |
//!
//! **One key per lock.** Its value is the owner token, prefixed by flags once someone waits:
//! `q` (someone joined the fair queue since the lock was granted), `b` (a barging waiter failed
//! against this holder). The lease is the key's `PTTL` minus [`LINGER`]: a lease that ends
//! without a release leaves the key for `LINGER` more, lapsed, so a lock whose holder died still
//! shows its waiters' flag to newcomers. A release with no flag set is a `DEL`: nothing is left
//! behind, nothing is published. An uncontended acquire is `INCR` of the fencing counter and
//! `SET NX PX`, a release `GET` and `DEL` — the commands of a hand-written lock plus the
//! fencing counter. A queue entry
//! lives at most `LINGER`, and joining the queue keeps the lock's key at least as long as the
//! entry, so a lock key that is gone has no queue: the uncontended path never looks for one.
//!
//! **Direct handoff.** A release (or a holder's abandon) with the `q` flag grants the lock to the
//! first live waiter in the same script — a new fencing token, a lease of the waiter's TTL but
//! at most its waiter TTL, and ending no later than the waiter's queue entry would (the
//! waiter's watchdog renews it to its TTL) — and publishes
//! `<token>:<fence>`, so the waiter starts without another round trip. A waiter whose
//! notification was lost finds the lock already its own on its next attempt, and is granted it
//! again with a new fencing token (it never learnt the first).
//!
//! **Fencing.** One counter per namespace (per slot on a cluster), no expiry. An acquire brings
//! the client's floor — above every token that client has seen, at least its clock in ms × 1000
//! — and the counter is `INCR`ed and raised to the floor if below (about once per millisecond
//! per client): tokens are strictly increasing across every key and every expiry, whatever the
//! clocks do, as long as the server keeps its counter. If it loses or rolls it back (a failover
//! to a replica that missed the latest tokens, a restart without persistence), the floors carry
//! the order on: the lost tokens were below the clocks of their moment, and the next ones start
//! from the clocks after the failure, so the order holds unless the clients' clocks disagree by
//! more than the failover took. A release's handoff takes the releasing client's floor the
//! same way (every script that may hand over — release, abandon, idempotency complete and
//! abort, force release — is sent one); an `INCR` that answers 1 found no counter and starts
//! it at the server clock in µs. A Redlock node takes the floor exactly (see `backend::redlock`). The scripts issue
//! counter values (below 2^53: Lua numbers are doubles; the client refuses a larger one as
//! `Misconfigured` and undoes the lock); the client reports
//! `counter × 2^ISSUER_BITS + its issuer number` as the token (`RedisBackend::ISSUER_BITS`), so
//! two masters that issue the same counter value during a split never grant the same token
//! (unless 2^ISSUER_BITS other clients took issuer numbers between theirs).

//! **On a cluster** the scripts declare, after their own `KEYS`, the keys they derive (the
//! slot's fencing counter, the lock's queue list and entries): they still derive the names
//! themselves, the declared keys are for the cluster's routing while the slot is resharded
//! (see `RedisBackend::lock_call_with`). One server saves the extra arguments.

//! Replies are integers where the hot path is concerned (a Lua table or a formatted number
//! costs the server more than the rest of an uncontended acquire).

use std::time::Duration;

use redis::Script;

/// How long a lock's key outlives a lease that ended without a release (the holder died or
/// overran), so newcomers still see that waiters are queued. Waiter entries live at most this
/// long between refreshes.
pub(super) const LINGER: Duration = Duration::from_secs(60);

/// `LINGER` in ms, for the script text.
const LINGER_MS: &str = "60000";

/// Lua: splits the lock's value `v` (non-nil) into `fl` (flags) and `o` (owner token).
macro_rules! parse_lock {
    () => {
        r#"
local fl, o = string.match(v, '^(%l*)|(.+)$')
if not fl then fl, o = '', v end
"#
    };
}

/// Lua: the next fencing token, a number, into `fence` (declared by the caller): the counter
/// `fence_key` plus one, raised to the client's floor `fence_floor` (a number, or nil) if below.
macro_rules! next_fence {
    () => {
        r#"
fence = redis.call('INCR', fence_key)
if fence == 1 then
  local t = redis.call('TIME')
  fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
  redis.call('SET', fence_key, string.format('%.0f', fence))
end
if fence_floor and fence < fence_floor then
  redis.call('SET', fence_key, string.format('%.0f', fence_floor))
  fence = fence_floor
end
"#
    };
}

/// The suffixes of a lock's queue keys, `<lock key>:<suffix>`: the list, the entries (what
/// [`queue_keys`] derives in the scripts).
pub(super) const QUEUE_SUFFIXES: [&str; 2] = ["q", "qw"];

/// Lua: the names of the lock's queue keys, derived from the lock's key (same hash tag, so the
/// same cluster slot): `lq` (the list), `lqw` (the entries).
macro_rules! queue_keys {
    () => {
        "local lq, lqw = KEYS[1] .. ':q', KEYS[1] .. ':qw'\n"
    };
}

/// Lua: the first live waiter in `head` (or `false`), the lease a release hands it in `hlease` and
/// what its entry has left in `hleft` (ms), dropping expired entries. The lease is the one its
/// entry notes, but it ends no later than the entry would have: a waiter that died holds a
/// handed-over lock no longer than its entry would have held up the queue, so a crashed process
/// blocks a lock at most the longer of the TTL and the waiter TTL. A live waiter loses nothing by
/// it: it counts the handed-over lease from its last attempt, which set the entry's deadline (see
/// `locker::request::wait_for`). Needs [`queue_keys`].
macro_rules! queue_head {
    () => {
        r#"
local head, hlease, hleft = false, 0, 0
do
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  head = redis.call('LINDEX', lq, 0)
  while head do
    local e = redis.call('HGET', lqw, head)
    local dl, hl
    if e then dl, hl = string.match(e, '^(%d+)|(%d+)$') end
    if dl and tonumber(dl) > now_ms then
      hleft = tonumber(dl) - now_ms
      hlease = math.min(tonumber(hl), hleft)
      break
    end
    redis.call('LPOP', lq)
    redis.call('HDEL', lqw, head)
    head = redis.call('LINDEX', lq, 0)
  end
end
"#
    };
}

/// Lua: the lock is being given up by its holder (or it lapsed) and its flags are `fl`: hand
/// it to the first live waiter (publishing `<token>:<fence>`), or delete it, publishing `""`
/// when a barging waiter asked to be woken on the lock's channel. Needs [`queue_keys`] and
/// `fence_key`.
macro_rules! pass_on {
    () => {
        concat!(
            r#"
local handed = false
if string.find(fl, 'q', 1, true) then
"#,
            queue_head!(),
            r#"
  if head then
    redis.call('LPOP', lq)
    redis.call('HDEL', lqw, head)
    local nfl = ''
    if redis.call('EXISTS', lq) == 1 then nfl = 'q' end
    if string.find(fl, 'b', 1, true) then nfl = nfl .. 'b' end
    local nv = head
    if nfl ~= '' then nv = nfl .. '|' .. head end
    local fence
"#,
            next_fence!(),
            r#"
    redis.call('SET', KEYS[1], nv, 'PX', string.format('%d', hlease + LINGER))
    redis.call('PUBLISH', KEYS[1] .. ':ch', head .. ':' .. string.format('%.0f', fence))
    handed = true
  end
end
if not handed then
  if string.find(fl, 'b', 1, true) then redis.call('PUBLISH', KEYS[1] .. ':ch', '') end
  redis.call('DEL', KEYS[1])
end
"#
        )
    };
}

/// Lua: puts (or keeps) `token` in the queue with a fresh entry deadline, noting the lease a
/// release hands it: its lease, but no longer than the entry ttl (a waiter that died holds a
/// handed-over lock no longer than its entry would have held up the queue). Keeps the lock's
/// key at least as long as the entry. Needs [`queue_keys`], `token`, `lease` and `wttl` (ms).
macro_rules! enqueue {
    () => {
        r#"
do
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local entry = string.format('%.0f|%d', now_ms + wttl, math.min(lease, wttl))
  if redis.call('HSET', lqw, token, entry) == 1 then redis.call('RPUSH', lq, token) end
  for _, k in ipairs({lq, lqw, KEYS[1]}) do
    if redis.call('PTTL', k) < wttl then redis.call('PEXPIRE', k, wttl) end
  end
end
"#
    };
}

/// Lua shared with the idempotency scripts.
pub(super) const PARSE_LOCK: &str = parse_lock!();
pub(super) const SLOT_GUARD: &str = slot_guard!();
pub(super) const QUEUE_KEYS: &str = queue_keys!();
pub(super) const NEXT_FENCE: &str = next_fence!();
pub(super) const QUEUE_HEAD: &str = queue_head!();
pub(super) const PASS_ON: &str = pass_on!();

/// A script's text with `LINGER` replaced by its value in ms.
pub(super) fn script(text: &str) -> Script {
    super::conn::script(&text.replace("LINGER", LINGER_MS))
}

/// Like [`script`], for a cluster (`cluster`: with its `slot_guard!`s) or one server or
/// Sentinel (without them: see `super::guarded_script`).
pub(super) fn script_for(text: &str, cluster: bool) -> Script {
    super::guarded_script(&text.replace("LINGER", LINGER_MS), cluster)
}

/// Like [`script_for`]; on a cluster (`cluster`), release notifications go out on the lock's
/// sharded channel (`SPUBLISH`, delivered by the slot's own nodes) instead of `PUBLISH`, which
/// a cluster broadcasts to every node.
pub(super) fn publishing(text: &str, cluster: bool) -> Script {
    if cluster {
        script_for(
            &text.replace("redis.call('PUBLISH'", "redis.call('SPUBLISH'"),
            cluster,
        )
    } else {
        script_for(text, cluster)
    }
}

/// `lease + LINGER` in ms: the `PX` of a lock granted or extended for `lease`.
pub(super) fn px(lease: Duration) -> u64 {
    super::millis(lease).saturating_add(super::millis(LINGER))
}

/// One acquire attempt. Uncontended: `INCR` of the fencing counter (and about once per
/// millisecond per client a `SET` raising it to the client's clock) and `SET NX PX`.
///
/// KEYS: 1 lock. ARGV: 1 owner token, 2 [`px`] of the lease, 3 the fencing counter's key, 4 the
/// client's floor for the fencing token: the counter is `INCR`ed and raised to it if below — or,
/// sent negated (`-f`, Redlock), the counter takes `f` itself unless already past it; then,
/// optional together: 5 mode (`0` try — the default, `1` queue, `2` barge), 6 waiter entry ttl
/// ms, 7 lease ms. A plain try sends only the first four, on Redlock too: every argument is a
/// Lua string the server builds for each call (about a thirtieth of the server's cost of an
/// uncontended acquire each, by `valgrind --tool=callgrind` of `redis-server` 7.0).
/// Returns the fencing token (> 0) when granted — also when the lock is already this token's
/// (handed over by a release whose notification was lost: a fresh grant, new token, lease
/// restarted) —, `-(lease left ms) - 1` when someone else holds it, and `-(ms left of its
/// queue entry) - 1` when it is free but another waiter is first in line: the lock is that
/// waiter's to take until then, and a waiter behind an entry left by a process that froze or
/// died wakes when the entry lapses rather than on its next refresh (up to a third of its
/// waiter TTL later). Queued (mode `1`), a held answer is `{that, counter}`: the fencing
/// counter this attempt drew. Every grant a release published before the attempt ran carries
/// a lower one, so the waiter can tell a grant that reaches it late from a fresh one
/// (`ReleaseHub::set_floor`).
pub(super) fn acquire(cluster: bool) -> Script {
    script_for(
        concat!(
            "local token, fence_key = ARGV[1], ARGV[3]\n",
            r#"
local fence
local fence_floor = tonumber(ARGV[4])
if fence_floor < 0 then
  -- Redlock: the counter takes the client's floor (one write), unless it is already past it.
  fence_floor = -fence_floor
  local old = tonumber(redis.call('SET', fence_key, string.sub(ARGV[4], 2), 'GET') or '0')
  fence = fence_floor
  if old >= fence_floor then
    fence = old + 1
    redis.call('SET', fence_key, string.format('%.0f', fence))
  end
else
"#,
            next_fence!(),
            r#"
end
if redis.call('SET', KEYS[1], token, 'NX', 'PX', ARGV[2]) then return fence end
"#,
            slot_guard!(),
            r#"
local mode, wttl, lease = ARGV[5] or '0', tonumber(ARGV[6]), tonumber(ARGV[7])
local v = redis.call('GET', KEYS[1])
"#,
            queue_keys!(),
            parse_lock!(),
            r#"
local left = redis.call('PTTL', KEYS[1]) - LINGER
if left > 0 then
  if o == token then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return fence
  end
  if mode ~= '0' then
    local nfl = fl
    if mode == '1' then
"#,
            enqueue!(),
            r#"
      if not string.find(fl, 'q', 1, true) then nfl = 'q' .. fl end
    elseif not string.find(fl, 'b', 1, true) then
      nfl = fl .. 'b'
    end
    if nfl ~= fl then redis.call('SET', KEYS[1], nfl .. '|' .. o, 'KEEPTTL') end
  end
  if mode == '1' then return {-left - 1, fence} end
  return -left - 1
end
local flags = fl
if string.find(fl, 'q', 1, true) then
"#,
            queue_head!(),
            r#"
  if head and head ~= token and mode ~= '2' then
    if mode == '1' then
"#,
            enqueue!(),
            r#"
      return {-hleft - 1, fence}
    end
    return -hleft - 1
  end
  if head == token then
    redis.call('LPOP', lq)
    redis.call('HDEL', lqw, token)
  end
  if redis.call('EXISTS', lq) == 0 then flags = string.gsub(flags, 'q', '') end
end
local nv = token
if flags ~= '' then nv = flags .. '|' .. token end
redis.call('SET', KEYS[1], nv, 'PX', ARGV[2])
return fence
"#
        ),
        cluster,
    )
}

/// Owner-checked release: hands the lock to the first live waiter, or deletes it. Uncontended:
/// `GET` and `DEL`.
///
/// KEYS: 1 lock. ARGV: 1 owner token, 2 the fencing counter's key, 3 the client's fencing floor
/// (for a handoff's token). Returns 1 when the token held the lock, 0 when it did not. (A lease of this token
/// that lapsed unnoticed, with nobody taking the lock since, counts as held: the locker reports
/// such a release as lost by its own lease clock.)
pub(super) fn release(cluster: bool) -> Script {
    publishing(
        concat!(
            r#"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
if not v then return 0 end
"#,
            slot_guard!(),
            r#"
local fence_key, fence_floor = ARGV[2], tonumber(ARGV[3])
"#,
            parse_lock!(),
            queue_keys!(),
            r#"
if o ~= ARGV[1] then return 0 end
"#,
            pass_on!(),
            r#"
return 1
"#
        ),
        cluster,
    )
}

/// Undo of a cancelled or abandoned acquire: release if owner, leave the queue, and pass a
/// free lock on if that made someone else first.
///
/// KEYS and ARGV as [`release`]. Returns 1 when the token held a live lease, 0 otherwise.
pub(super) fn abandon(cluster: bool) -> Script {
    publishing(
        concat!(
            slot_guard!(),
            r#"
local token, fence_key, fence_floor = ARGV[1], ARGV[2], tonumber(ARGV[3])
"#,
            queue_keys!(),
            r#"
local v = redis.call('GET', KEYS[1])
local held, free, flags = 0, true, ''
if v then
"#,
            parse_lock!(),
            r#"
  flags = fl
  if redis.call('PTTL', KEYS[1]) > LINGER then
    if o == token then held = 1 else free = false end
  elseif o == token then
    held = 2
  end
end
local left = redis.call('HDEL', lqw, token)
if left == 1 then redis.call('LREM', lq, 0, token) end
if held == 0 and (left == 0 or not free or not v) then return 0 end
local fl = flags
"#,
            pass_on!(),
            r#"
if held == 1 then return 1 end
return 0
"#
        ),
        cluster,
    )
}

/// Owner-checked lease extension.
///
/// KEYS: 1 lock. ARGV: 1 owner token, 2 [`px`] of the lease. Returns 1 when extended, 0
/// otherwise.
pub(super) fn extend() -> Script {
    script(concat!(
        r#"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
"#,
        parse_lock!(),
        r#"
if o ~= ARGV[1] or redis.call('PTTL', KEYS[1]) <= LINGER then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"#
    ))
}

/// Raises the namespace's fencing counter to at least the given token (Redlock's majority
/// maximum).
///
/// KEYS: 1 fencing counter. ARGV: 1 token. Returns 1.
pub(super) fn raise_fence() -> Script {
    super::conn::script(
        r#"
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"#,
    )
}
