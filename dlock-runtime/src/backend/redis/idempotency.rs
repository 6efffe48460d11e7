//! Idempotency records of the Redis backend: three Lua scripts, each one atomic step.
//!
//! Key layout of one idempotency key: the lock's keys (see the lock scripts) plus one record,
//! which shares the hash tag `{<k>}`:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<p>:{<k>}`, `:q`, `:qw`, `<p>:fence`, `:ch` | | the key's lock, as for any lock |
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

// Lua shared with the lock scripts: parsing the lock's value, the next fencing token, the live
// head of the waiter queue, passing a given-up lock on.
use super::conn::ScriptCall;
use super::scripts::{
    publishing, script_for, NEXT_FENCE, PARSE_LOCK, PASS_ON, QUEUE_HEAD, QUEUE_KEYS,
    QUEUE_SUFFIXES, SLOT_GUARD,
};
use super::{millis, RedisBackend};
use crate::backend::idempotency::{BeginArgs, BeginReply, CompleteArgs, IdempotencyStore};
use crate::backend::{BoxFuture, OwnerToken};
use crate::key::ResourceName;
use crate::LockError;

const RECORD_SUFFIX: &str = "idem";

/// One `begin` step.
///
/// KEYS: 1 lock, 2 record. ARGV: 1 owner token, 2 the lock's `PX` (`scripts::px` of the
/// lease), 3 fingerprint, 4 retention ms, 5 the fencing counter's key, 6 the client's fencing
/// floor.
/// Returns `{code, data, extra}`:
/// * `{1, "<fencing token>", ""}` — granted: the lock is set and the fingerprint noted (also
///   when the lock is already this token's: the begin sent again; its lease restarts);
/// * `{2, <stored result>, ""}` — a completed record with the same fingerprint;
/// * `{3, "", ""}` — a completed record with a different fingerprint;
/// * `{0, "<ms left>", m}` — held: the holder's lease left, or, when the lock is free but a
///   waiter is first in line, what that waiter's queue entry has left; `m` = `"1"` same
///   fingerprint, `"0"` different, `""` unknown.
static BEGIN: LazyLock<[Script; 2]> = LazyLock::new(|| {
    [false, true].map(|cluster| {
        script_for(
            &format!(
                r#"
{SLOT_GUARD}
local token, fence_key, fence_floor = ARGV[1], ARGV[5], tonumber(ARGV[6])
{QUEUE_KEYS}
local rec = redis.call('HMGET', KEYS[2], 'fp', 'res', 'tok')
if rec[2] then
  if rec[1] == ARGV[3] then return {{2, rec[2], ''}} end
  return {{3, '', ''}}
end
local v = redis.call('GET', KEYS[1])
local flags = ''
if v then
  {PARSE_LOCK}
  local left = redis.call('PTTL', KEYS[1]) - LINGER
  if left > 0 then
    if o == token then
      -- This attempt's own lock (its begin sent again after a lost answer): granted again,
      -- with its lease restarted and a new fencing token, as an acquire is.
      local fence
      {NEXT_FENCE}
      redis.call('PEXPIRE', KEYS[1], ARGV[2])
      redis.call('HSET', KEYS[2], 'fp', ARGV[3], 'tok', token)
      redis.call('PEXPIRE', KEYS[2], ARGV[4])
      return {{1, string.format('%.0f', fence), ''}}
    end
    local m = ''
    if rec[3] and rec[3] == o then
      if rec[1] == ARGV[3] then m = '1' else m = '0' end
    end
    return {{0, tostring(left), m}}
  end
  flags = fl
  if string.find(fl, 'q', 1, true) then
    {QUEUE_HEAD}
    if head then return {{0, tostring(hleft), ''}} end
    flags = string.gsub(flags, 'q', '')
  end
end
local fence
{NEXT_FENCE}
local nv = token
if flags ~= '' then nv = flags .. '|' .. token end
redis.call('SET', KEYS[1], nv, 'PX', ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'fp', ARGV[3], 'tok', token)
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {{1, string.format('%.0f', fence), ''}}
"#
            ),
            cluster,
        )
    })
});

/// Lua: the owner check of `complete` and `abort`: returns 0 unless ARGV[1] holds a live lease;
/// leaves the lock's flags in `fl`.
static OWNER_CHECK: LazyLock<String> = LazyLock::new(|| {
    format!(
        r#"
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
{PARSE_LOCK}
if o ~= ARGV[1] or redis.call('PTTL', KEYS[1]) <= LINGER then return 0 end
{QUEUE_KEYS}
"#
    )
});

/// One `complete` step: owner-checked; stores the record and releases the lock together,
/// handing it to the next live waiter if any.
///
/// KEYS: 1 lock, 2 record. ARGV: 1 owner token, 2 the fencing counter's key, 3 fingerprint,
/// 4 result, 5 retention ms, 6 the client's fencing floor (for a handoff's token).
/// Returns 1 when stored, 0 when the token did not own the lock (nothing changed).
static COMPLETE: LazyLock<[Script; 2]> = LazyLock::new(|| {
    [false, true].map(|cluster| {
        publishing(
            &format!(
                r#"
{owner_check}
{SLOT_GUARD}
local fence_key, fence_floor = ARGV[2], tonumber(ARGV[6])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'fp', ARGV[3], 'res', ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
{PASS_ON}
return 1
"#,
                owner_check = *OWNER_CHECK
            ),
            cluster,
        )
    })
});

/// One `abort` step: owner-checked release without a record; drops this owner's note of its
/// fingerprint; hands the lock to the next live waiter if any.
///
/// KEYS as `complete`. ARGV: 1 owner token, 2 the fencing counter's key, 3 the client's fencing
/// floor.
/// Returns 1 when released, 0 when the token did not own the lock.
static ABORT: LazyLock<[Script; 2]> = LazyLock::new(|| {
    [false, true].map(|cluster| {
        publishing(
            &format!(
                r#"
{owner_check}
{SLOT_GUARD}
local fence_key, fence_floor = ARGV[2], tonumber(ARGV[3])
if redis.call('HGET', KEYS[2], 'tok') == ARGV[1] then redis.call('DEL', KEYS[2]) end
{PASS_ON}
return 1
"#,
                owner_check = *OWNER_CHECK
            ),
            cluster,
        )
    })
});

/// A call of an idempotency script: its KEYS are the lock, the record and, on a cluster, the
/// keys the scripts derive (see [`RedisBackend::lock_call_with`]).
fn lock_call<'s>(
    backend: &RedisBackend,
    script: &'s Script,
    resource: &ResourceName,
) -> ScriptCall<'s> {
    let record = resource.with_suffix(RECORD_SUFFIX);
    backend.lock_call_with(script, resource, Some(&record), &QUEUE_SUFFIXES)
}

fn malformed() -> LockError {
    LockError::unavailable("redis idempotency begin: malformed script reply", None)
}

impl IdempotencyStore for RedisBackend {
    fn begin<'a>(&'a self, args: BeginArgs<'a>) -> BoxFuture<'a, Result<BeginReply, LockError>> {
        Box::pin(async move {
            self.issuer().await?;
            let mut call = lock_call(self, &BEGIN[usize::from(self.is_cluster())], args.resource);
            call.arg(args.token.as_str())
                .arg(super::scripts::px(args.ttl))
                .arg(args.fingerprint.to_hex())
                .arg(millis(args.retention))
                .arg(self.fence_key(args.resource))
                .arg(self.floor());
            let ((code, data, extra), issuer): ((i64, Vec<u8>, String), _) =
                self.run_granting("idempotency begin", &call).await?;
            let text = || std::str::from_utf8(&data).map_err(|_| malformed());
            match code {
                1 => {
                    let counter = text()?.parse::<u64>().map_err(|_| malformed())?;
                    Ok(BeginReply::Acquired {
                        fencing_token: self.granted(counter, issuer)?,
                    })
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
            let mut call = lock_call(
                self,
                &COMPLETE[usize::from(self.is_cluster())],
                args.resource,
            );
            call.arg(args.token.as_str())
                .arg(self.fence_key(args.resource))
                .arg(args.fingerprint.to_hex())
                .arg(args.record)
                .arg(millis(args.retention))
                .arg(self.floor());
            if args.replicas == 0 {
                let n: i64 = self.run_script("idempotency complete", &call).await?;
                return Ok(n == 1);
            }
            let (n, acked): (i64, u32) = self
                .run_acknowledged("idempotency complete", &call, args.replicas)
                .await?;
            if n == 1 && acked < args.replicas {
                return Err(LockError::unavailable(
                    format!(
                        "idempotency record of `{}` stored, but {acked} of the {} replicas asked \
                         for acknowledged it in time: a failover may lose it",
                        args.resource.key(),
                        args.replicas
                    ),
                    None,
                ));
            }
            Ok(n == 1)
        })
    }

    fn abort<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let mut call = lock_call(self, &ABORT[usize::from(self.is_cluster())], resource);
            call.arg(token.as_str())
                .arg(self.fence_key(resource))
                .arg(self.floor());
            let n: i64 = self.run_script("idempotency abort", &call).await?;
            Ok(n == 1)
        })
    }
}
