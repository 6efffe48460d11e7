//! The Lua scripts of the Redis backend. Each runs atomically on the server and is invoked by
//! SHA (`EVALSHA`), reloaded on `NOSCRIPT`.
//!
//! Key layout of one lock (all share the hash tag `{<key>}`):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<p>:{<k>}` | string | owner token, `PX` = lease |
//! | `<p>:{<k>}:q` | list | waiter tokens in arrival order |
//! | `<p>:{<k>}:qt` | zset | waiter token → entry deadline (ms, server clock) |
//! | `<p>:{<k>}:fence` | string | last fencing token issued for this key (single server) |
//! | `<p>:fence` | string | last fencing token issued in the namespace (a Redlock node; no TTL) |
//! | `<p>:{<k>}:ch` | channel | release notifications; payload = next waiter's token or `""` |
//!
//! Fencing: `token = max(last + 1, server TIME in µs)`. On a single server the counter is per
//! key, stored with a retention of [`FENCE_RETENTION`](super::FENCE_RETENTION) beyond the lease
//! (so a key's counter costs nothing once it is idle): tokens increase strictly per key while
//! the counter lives, and keep increasing after it expired as long as the server clock has not
//! stepped back by more than the retention period. A Redlock node keeps one counter per
//! namespace instead, with no expiry (retention `0`), so no clock enters its tokens' order.

use redis::Script;

/// Lua that leaves the live head of the waiter queue (or `false`) in `head`, dropping expired
/// entries first. When no queue exists (the uncontended case) it costs one `EXISTS`.
/// Expects KEYS[2] = queue list, KEYS[3] = queue deadlines.
macro_rules! queue_head {
    () => {
        r#"
local head = false
if redis.call('EXISTS', KEYS[2]) == 1 then
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  head = redis.call('LINDEX', KEYS[2], 0)
  while head do
    local dl = redis.call('ZSCORE', KEYS[3], head)
    if dl and tonumber(dl) > now_ms then break end
    redis.call('LPOP', KEYS[2])
    redis.call('ZREM', KEYS[3], head)
    head = redis.call('LINDEX', KEYS[2], 0)
  end
end
"#
    };
}

/// The live head of the waiter queue (`head`, or `false`), for scripts built elsewhere (the
/// idempotency scripts). KEYS 2 and 3 must be the queue keys.
pub(super) const QUEUE_HEAD: &str = queue_head!();

/// One acquire attempt. The uncontended path is `EXISTS` (no queue), `SET NX PX`, `TIME` and
/// the fencing counter's `GET`/`SET`.
///
/// KEYS: 1 lock, 2 queue list, 3 queue deadlines, 4 fence.
/// ARGV: 1 owner token, 2 lease ms, 3 mode (`0` try, `1` queue, `2` barge), 4 waiter entry
/// ttl ms, 5 fence retention ms beyond the lease (`0`: the counter never expires).
/// Returns `{1, "<fencing token>"}` when granted, `{0, "<pttl>"}` otherwise (`pttl` = -2 when the
/// lock is free but another waiter is first in line).
pub(super) fn acquire() -> Script {
    Script::new(concat!(
        queue_head!(),
        r#"
local token = ARGV[1]
local mode = ARGV[3]
if ((not head) or head == token or mode == '2')
    and redis.call('SET', KEYS[1], token, 'NX', 'PX', ARGV[2]) then
  if head == token then
    redis.call('LPOP', KEYS[2])
    redis.call('ZREM', KEYS[3], token)
  end
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local fence = tonumber(redis.call('GET', KEYS[4]) or '0') + 1
  if us > fence then fence = us end
  local f = string.format('%.0f', fence)
  if ARGV[5] == '0' then
    redis.call('SET', KEYS[4], f)
  else
    redis.call('SET', KEYS[4], f, 'PX', tonumber(ARGV[2]) + tonumber(ARGV[5]))
  end
  return {1, f}
end
if mode == '1' then
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local wttl = tonumber(ARGV[4])
  if not redis.call('ZSCORE', KEYS[3], token) then
    redis.call('RPUSH', KEYS[2], token)
  end
  redis.call('ZADD', KEYS[3], now_ms + wttl, token)
  if redis.call('PTTL', KEYS[2]) < wttl then redis.call('PEXPIRE', KEYS[2], wttl) end
  if redis.call('PTTL', KEYS[3]) < wttl then redis.call('PEXPIRE', KEYS[3], wttl) end
end
return {0, tostring(redis.call('PTTL', KEYS[1]))}
"#
    ))
}

/// Owner-checked release; publishes the next live waiter's token (or `""`) on the channel.
///
/// KEYS: 1 lock, 2 queue list, 3 queue deadlines. ARGV: 1 owner token, 2 channel.
/// Returns 1 when released, 0 when the token did not own the lock.
pub(super) fn release() -> Script {
    Script::new(concat!(
        r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
"#,
        queue_head!(),
        r#"
redis.call('PUBLISH', ARGV[2], head or '')
return 1
"#
    ))
}

/// Undo of a cancelled or abandoned acquire: release if owner, leave the queue, notify the
/// next waiter when that freed the way.
///
/// KEYS: 1 lock, 2 queue list, 3 queue deadlines. ARGV: 1 owner token, 2 channel.
/// Returns 1 when the token held the lock, 0 otherwise.
pub(super) fn abandon() -> Script {
    Script::new(concat!(
        r#"
local held = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  held = 1
end
local removed = redis.call('LREM', KEYS[2], 0, ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if held == 0 and (removed == 0 or redis.call('EXISTS', KEYS[1]) == 1) then
  return 0
end
"#,
        queue_head!(),
        r#"
redis.call('PUBLISH', ARGV[2], head or '')
return held
"#
    ))
}

/// Owner-checked lease extension.
///
/// KEYS: 1 lock. ARGV: 1 owner token, 2 lease ms. Returns 1 when extended, 0 otherwise.
pub(super) fn extend() -> Script {
    Script::new(
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"#,
    )
}

/// Raises the fencing counter to at least the given token (Redlock's majority maximum).
///
/// KEYS: 1 fence. ARGV: 1 token, 2 retention ms (`0`: no expiry). Returns 1.
pub(super) fn raise_fence() -> Script {
    Script::new(
        r#"
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur < tonumber(ARGV[1]) then
  if ARGV[2] == '0' then
    redis.call('SET', KEYS[1], ARGV[1])
  else
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  end
end
return 1
"#,
    )
}
