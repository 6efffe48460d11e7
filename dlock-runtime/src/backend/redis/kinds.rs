//! Semaphores and read-write locks on Redis: the rule of
//! [`backend`](crate::backend#semaphores-and-read-write-locks) in three Lua scripts.
//!
//! Key layout of one semaphore or read-write lock named `N` (`<p>:{<k>}:sem`, `<p>:{<k>}:rw`;
//! all keys share the hash tag `{<k>}`, so one cluster slot):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `N` | sorted set | holders: member = owner token (`x:<token>` for a writer), score = lease end (server ms); `PEXPIRE` ≥ the longest lease |
//! | `N:q` | sorted set | waiters in arrival order: member as above, score = arrival number |
//! | `N:qe` | sorted set | waiter entries: member → entry deadline (server ms) |
//! | `<p>:fence` | string | the namespace's fencing counter, shared with the locks (per slot on a cluster) |
//! | `N:ch` | channel | `<token>`: this waiter is in the ready prefix now, try again; `""`: a holder left and nobody is in line (wakes a barging waiter) |
//!
//! A writer holds alone, so "a writer holds" is "one holder, and its member starts with
//! `x:`". Expired holders and waiter entries are pruned by every script that reads them
//! (`ZREMRANGEBYSCORE`). An uncontended acquire is a handful of commands on `N` and the
//! fencing counter; a release `ZREM`s and, when waiters are queued, walks the ready prefix and
//! publishes to each waiter in it (one for a freed permit, every leading reader after a
//! writer); with none queued it publishes `""`, which wakes a barging waiter (one publish to
//! a channel nobody may listen on: kinds have no flag of their own saying one waits).

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

use super::conn::ScriptCall;
use super::scripts::{publishing, script, script_for, NEXT_FENCE};
use super::{millis, RedisBackend};
use crate::backend::{AcquireArgs, Attempt, OwnerToken, WaitMode};
use crate::key::ResourceName;
use crate::LockError;

/// The suffixes of a kind's queue keys, `N:<suffix>`.
const QUEUE_SUFFIXES: [&str; 2] = ["q", "qe"];

/// Lua: `now` (server ms), the key names, pruning of expired holders and entries, the holders'
/// count `held` and writer flag `writer`, `fits(held, writer, x)` and
/// `walk(target) -> admitted, held, writer, reached` over the queue's ready prefix. Needs
/// `cap` (a number).
const PRELUDE: &str = concat!(
    slot_guard!(),
    r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h, q, qe = KEYS[1], KEYS[1] .. ':q', KEYS[1] .. ':qe'
redis.call('ZREMRANGEBYSCORE', h, '-inf', now)
for _, m in ipairs(redis.call('ZRANGEBYSCORE', qe, '-inf', now, 'LIMIT', 0, 256)) do
  redis.call('ZREM', qe, m)
  redis.call('ZREM', q, m)
end
local function is_writer(m) return string.sub(m, 1, 2) == 'x:' end
local held, writer = redis.call('ZCARD', h), false
if held == 1 then writer = is_writer(redis.call('ZRANGE', h, 0, 0)[1]) end
local function fits(n, w, x)
  if x then return n == 0 end
  return (not w) and n < cap
end
local function walk(target)
  local n, w, i = held, writer, 0
  while true do
    local batch = redis.call('ZRANGE', q, i, i + 63)
    if #batch == 0 then return i, n, w, false end
    for _, m in ipairs(batch) do
      local x = is_writer(m)
      if not fits(n, w, x) then return i, n, w, false end
      if m == target then return i, n, w, true end
      n = n + 1
      if x then w = true end
      i = i + 1
    end
  end
end
"#
);

/// One acquire attempt of a permit or a read or write hold.
///
/// KEYS: 1 `N` (on a cluster also the fencing counter, `N:q`, `N:qe`, for routing). ARGV:
/// 1 owner token, 2 `1` for a writer else `0`, 3 capacity, 4 mode (`0` try, `1` queue,
/// `2` barge), 5 lease ms, 6 waiter entry ttl ms, 7 the fencing counter's key, 8 the client's
/// fencing floor. Returns the fencing token (> 0) when granted (also when the token already
/// holds: a fresh grant), else `-(ms until the first holder's lease or queue entry ends) - 1`
/// (the line may move then: a waiter ahead that died blocks it until its entry ends), `0` when
/// there is neither.
static ACQUIRE: LazyLock<[Script; 2]> = LazyLock::new(|| {
    [false, true].map(|cluster| {
        script_for(
            &format!(
        r#"
local token, excl, cap, mode = ARGV[1], ARGV[2] == '1', tonumber(ARGV[3]), ARGV[4]
local lease, wttl, fence_key, fence_floor = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
{PRELUDE}
local member = token
if excl then member = 'x:' .. token end
local function grant()
  redis.call('ZREM', q, member)
  redis.call('ZREM', qe, member)
  local fence
  {NEXT_FENCE}
  redis.call('ZADD', h, now + lease, member)
  if redis.call('PTTL', h) < lease then redis.call('PEXPIRE', h, lease) end
  return fence
end
if redis.call('ZSCORE', h, member) then return grant() end
local ok = false
if mode == '2' then
  ok = fits(held, writer, excl)
elseif mode == '0' then
  local i, n, w = walk(false)
  ok = i == redis.call('ZCARD', q) and fits(n, w, excl)
else
  if not redis.call('ZSCORE', q, member) then
    local last = redis.call('ZRANGE', q, -1, -1, 'WITHSCORES')
    local seq = 1
    if last[2] then seq = tonumber(last[2]) + 1 end
    redis.call('ZADD', q, seq, member)
  end
  redis.call('ZADD', qe, now + wttl, member)
  for _, k in ipairs({{q, qe}}) do
    if redis.call('PTTL', k) < wttl then redis.call('PEXPIRE', k, wttl) end
  end
  local _, _, _, reached = walk(member)
  ok = reached
end
if ok then return grant() end
local soonest = false
for _, k in ipairs({{h, qe}}) do
  local first = redis.call('ZRANGE', k, 0, 0, 'WITHSCORES')
  if first[2] and (not soonest or tonumber(first[2]) < soonest) then soonest = tonumber(first[2]) end
end
if soonest then return -math.max(soonest - now, 1) - 1 end
return 0
"#
            ),
            cluster,
        )
    })
});

/// Owner-checked release (with ARGV[3] = `1`, the undo of an acquire: also leaves the queue);
/// when that made room, publishes `<token>` on `N:ch` to every waiter of the new ready prefix —
/// or, with nobody in line, `""` (a barging waiter, not in the line, tries again).
///
/// KEYS: 1 `N` (on a cluster also the fencing counter, `N:q`, `N:qe`). ARGV: 1 owner token,
/// 2 capacity, 3 `1` to abandon else `0`. Returns 1 when the token held a live lease, else 0.
static RELEASE: LazyLock<[Script; 2]> = LazyLock::new(|| {
    [false, true].map(|cluster| {
        publishing(
            &format!(
                r#"
local token, cap = ARGV[1], tonumber(ARGV[2])
{PRELUDE}
local gone = redis.call('ZREM', h, token, 'x:' .. token)
local left = 0
if ARGV[3] == '1' then
  left = redis.call('ZREM', q, token, 'x:' .. token)
  redis.call('ZREM', qe, token, 'x:' .. token)
end
if gone + left == 0 then return gone end
if redis.call('EXISTS', q) == 0 then
  if gone == 1 then redis.call('PUBLISH', h .. ':ch', '') end
  return gone
end
held = redis.call('ZCARD', h)
writer = held == 1 and is_writer(redis.call('ZRANGE', h, 0, 0)[1])
local n = walk(false)
if n > 0 then
  for _, m in ipairs(redis.call('ZRANGE', q, 0, n - 1)) do
    if is_writer(m) then m = string.sub(m, 3) end
    redis.call('PUBLISH', h .. ':ch', m)
  end
end
return gone
"#
            ),
            cluster,
        )
    })
});

/// Owner-checked lease extension.
///
/// KEYS: 1 `N`. ARGV: 1 owner token, 2 lease ms. Returns 1 when extended, 0 otherwise.
static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local m = ARGV[1]
local s = redis.call('ZSCORE', KEYS[1], m)
if not s then
  m = 'x:' .. ARGV[1]
  s = redis.call('ZSCORE', KEYS[1], m)
end
if not s or tonumber(s) <= now then return 0 end
local lease = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + lease, m)
if redis.call('PTTL', KEYS[1]) < lease then redis.call('PEXPIRE', KEYS[1], lease) end
return 1
"#,
    )
});

/// The extend script (for the watchdog's pipelined batches).
pub(super) fn extend_script() -> &'static Script {
    &EXTEND
}

impl RedisBackend {
    /// A call of a kind's `script`: the lock's key, then, on a cluster, the keys the kinds'
    /// scripts derive from it ([`lock_call_with`](RedisBackend::lock_call_with)).
    fn kind_call<'s>(&self, script: &'s Script, resource: &ResourceName) -> ScriptCall<'s> {
        self.lock_call_with(script, resource, None, &QUEUE_SUFFIXES)
    }

    pub(super) async fn acquire_kind_once(
        &self,
        args: AcquireArgs<'_>,
    ) -> Result<Attempt, LockError> {
        let kind = args.resource.kind();
        let mode = match args.mode {
            WaitMode::Try => "0",
            WaitMode::Queue => "1",
            _ => "2",
        };
        self.issuer().await?;
        let mut call = self.kind_call(&ACQUIRE[usize::from(self.is_cluster())], args.resource);
        call.arg(args.token.as_str())
            .arg(if kind.is_exclusive() { "1" } else { "0" })
            .arg(kind.capacity())
            .arg(mode)
            .arg(millis(args.ttl))
            .arg(millis(args.waiter_ttl))
            .arg(self.fence_key(args.resource))
            .arg(self.floor());
        let (reply, issuer): (i64, _) = self.run_granting("acquire", &call).await?;
        Ok(match reply {
            1.. => Attempt::Acquired {
                fencing_token: self.granted(reply as u64, issuer)?,
            },
            0 => Attempt::Held { remaining: None },
            _ => Attempt::Held {
                remaining: Some(Duration::from_millis((-(reply + 1)) as u64)),
            },
        })
    }

    /// Release (`abandon`: also leave the queue). Answers whether the token held a live lease.
    pub(super) async fn release_kind(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        abandon: bool,
    ) -> Result<bool, LockError> {
        let mut call = self.kind_call(&RELEASE[usize::from(self.is_cluster())], resource);
        call.arg(token.as_str())
            .arg(resource.kind().capacity())
            .arg(if abandon { "1" } else { "0" });
        let what = if abandon { "abandon" } else { "release" };
        let n: i64 = self.run_script(what, &call).await?;
        Ok(n == 1)
    }

    pub(super) async fn extend_kind(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        ttl: Duration,
    ) -> Result<bool, LockError> {
        let mut call = ScriptCall::new(&EXTEND, 1);
        call.key(resource.as_str())
            .arg(token.as_str())
            .arg(millis(ttl));
        let n: i64 = self.run_script("extend", &call).await?;
        Ok(n == 1)
    }
}
