//! Idempotency records of the Redis backend: three Lua scripts, each one atomic step.
//!
//! Key layout of one idempotency key (the lock's keys plus one; all share the hash tag
//! `{<k>}`, so the scripts also run on Redis Cluster):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<p>:{<k>}` | string | owner token, `PX` = lease (the key's lock, as for any lock) |
//! | `<p>:{<k>}:q`, `:qt` | list, zset | the lock's fair waiter queue (see the lock scripts) |
//! | `<p>:{<k>}:fence` | string | last fencing token issued |
//! | `<p>:{<k>}:ch` | channel | release notifications; payload = next waiter's token or `""` |
//! | `<p>:{<k>}:idem` | hash | `fp` = fingerprint (hex); then either `tok` = the running attempt's owner token, or `res` = the stored result; `PX` = retention |
//!
//! A hash with `res` is a completed record. A hash with `tok` only notes the running attempt's
//! fingerprint; it is read only while the lock holds that same token, and replaced by the next
//! holder, so one left behind by a crashed or cancelled holder is inert.
//!
//! The scripts are compiled once per process (`LazyLock`) and invoked by SHA (`EVALSHA`),
//! reloaded on `NOSCRIPT`.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

// Lua: the live head of the waiter queue (`head`), shared with the lock scripts.
use super::scripts::QUEUE_HEAD;
use super::{millis, RedisBackend, CHANNEL_SUFFIX, FENCE_RETENTION};
use crate::backend::idempotency::{BeginArgs, BeginReply, CompleteArgs, IdempotencyStore};
use crate::backend::{BoxFuture, OwnerToken};
use crate::key::ResourceName;
use crate::LockError;

const RECORD_SUFFIX: &str = "idem";

/// One `begin` step.
///
/// KEYS: 1 lock, 2 queue list, 3 queue deadlines, 4 fence, 5 record.
/// ARGV: 1 owner token, 2 lease ms, 3 fingerprint, 4 fence retention ms, 5 retention ms.
/// Returns `{code, data, extra}`:
/// * `{1, "<fencing token>", ""}` — granted: the lock is set and the fingerprint noted;
/// * `{2, <stored result>, ""}` — a completed record with the same fingerprint;
/// * `{3, "", ""}` — a completed record with a different fingerprint;
/// * `{0, "<pttl>", m}` — held (`pttl` = -2 when the lock is free but a waiter is first in
///   line); `m` = `"1"` same fingerprint, `"0"` different, `""` unknown.
static BEGIN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r#"
local rec = redis.call('HMGET', KEYS[5], 'fp', 'res', 'tok')
if rec[2] then
  if rec[1] == ARGV[3] then return {{2, rec[2], ''}} end
  return {{3, '', ''}}
end
local holder = redis.call('GET', KEYS[1])
if holder then
  local m = ''
  if rec[3] and rec[3] == holder then
    if rec[1] == ARGV[3] then m = '1' else m = '0' end
  end
  return {{0, tostring(redis.call('PTTL', KEYS[1])), m}}
end
{QUEUE_HEAD}
if head then return {{0, '-2', ''}} end
local t = redis.call('TIME')
local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local fence = tonumber(redis.call('GET', KEYS[4]) or '0') + 1
if us > fence then fence = us end
local f = string.format('%.0f', fence)
redis.call('SET', KEYS[4], f, 'PX', tonumber(ARGV[2]) + tonumber(ARGV[4]))
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[5])
redis.call('HSET', KEYS[5], 'fp', ARGV[3], 'tok', ARGV[1])
redis.call('PEXPIRE', KEYS[5], ARGV[5])
return {{1, f, ''}}
"#
    ))
});

/// One `complete` step: owner-checked; stores the record and releases the lock together, then
/// publishes the next live waiter's token (or `""`) on the channel.
///
/// KEYS: 1 lock, 2 queue list, 3 queue deadlines, 4 record.
/// ARGV: 1 owner token, 2 channel, 3 fingerprint, 4 result, 5 retention ms.
/// Returns 1 when stored, 0 when the token did not own the lock (nothing changed).
static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[4])
redis.call('HSET', KEYS[4], 'fp', ARGV[3], 'res', ARGV[4])
redis.call('PEXPIRE', KEYS[4], ARGV[5])
{QUEUE_HEAD}
redis.call('PUBLISH', ARGV[2], head or '')
return 1
"#
    ))
});

/// One `abort` step: owner-checked release without a record; drops this owner's note of its
/// fingerprint; publishes the next live waiter's token (or `""`).
///
/// KEYS: 1 lock, 2 queue list, 3 queue deadlines, 4 record. ARGV: 1 owner token, 2 channel.
/// Returns 1 when released, 0 when the token did not own the lock.
static ABORT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if redis.call('HGET', KEYS[4], 'tok') == ARGV[1] then redis.call('DEL', KEYS[4]) end
{QUEUE_HEAD}
redis.call('PUBLISH', ARGV[2], head or '')
return 1
"#
    ))
});

fn malformed() -> LockError {
    LockError::unavailable("redis idempotency begin: malformed script reply", None)
}

impl IdempotencyStore for RedisBackend {
    fn begin<'a>(&'a self, args: BeginArgs<'a>) -> BoxFuture<'a, Result<BeginReply, LockError>> {
        Box::pin(async move {
            let mut conn = self.inner.conn.clone();
            let mut inv = BEGIN.prepare_invoke();
            inv.key(args.resource.as_str())
                .key(args.resource.with_suffix("q"))
                .key(args.resource.with_suffix("qt"))
                .key(args.resource.with_suffix("fence"))
                .key(args.resource.with_suffix(RECORD_SUFFIX))
                .arg(args.token.as_str())
                .arg(millis(args.ttl))
                .arg(args.fingerprint.to_hex())
                .arg(millis(FENCE_RETENTION))
                .arg(millis(args.retention));
            let (code, data, extra): (i64, Vec<u8>, String) = self
                .deadline("idempotency begin", inv.invoke_async(&mut conn))
                .await?;
            let text = || std::str::from_utf8(&data).map_err(|_| malformed());
            match code {
                1 => {
                    let fencing_token = text()?.parse::<u64>().map_err(|_| malformed())?;
                    Ok(BeginReply::Acquired { fencing_token })
                }
                2 => Ok(BeginReply::Replay { record: data }),
                3 => Ok(BeginReply::Mismatch),
                0 => {
                    let pttl = text()?.parse::<i64>().map_err(|_| malformed())?;
                    let remaining = (pttl >= 0).then(|| Duration::from_millis(pttl as u64));
                    let same_fingerprint = match extra.as_str() {
                        "1" => Some(true),
                        "0" => Some(false),
                        _ => None,
                    };
                    Ok(BeginReply::Held {
                        remaining,
                        same_fingerprint,
                    })
                }
                _ => Err(malformed()),
            }
        })
    }

    fn complete<'a>(&'a self, args: CompleteArgs<'a>) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let mut conn = self.inner.conn.clone();
            let mut inv = COMPLETE.prepare_invoke();
            inv.key(args.resource.as_str())
                .key(args.resource.with_suffix("q"))
                .key(args.resource.with_suffix("qt"))
                .key(args.resource.with_suffix(RECORD_SUFFIX))
                .arg(args.token.as_str())
                .arg(args.resource.with_suffix(CHANNEL_SUFFIX))
                .arg(args.fingerprint.to_hex())
                .arg(args.record)
                .arg(millis(args.retention));
            let n: i64 = self
                .deadline("idempotency complete", inv.invoke_async(&mut conn))
                .await?;
            Ok(n == 1)
        })
    }

    fn abort<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let mut conn = self.inner.conn.clone();
            let mut inv = ABORT.prepare_invoke();
            inv.key(resource.as_str())
                .key(resource.with_suffix("q"))
                .key(resource.with_suffix("qt"))
                .key(resource.with_suffix(RECORD_SUFFIX))
                .arg(token.as_str())
                .arg(resource.with_suffix(CHANNEL_SUFFIX));
            let n: i64 = self
                .deadline("idempotency abort", inv.invoke_async(&mut conn))
                .await?;
            Ok(n == 1)
        })
    }
}
