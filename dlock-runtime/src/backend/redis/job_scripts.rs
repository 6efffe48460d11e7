//! The Lua scripts of the durable job queue (`dlock_runtime::durable::DurableQueue`), beside the
//! lock scripts. Each runs atomically on the server; the storage layout is in the queue's docs.

/// Lua: `now` in ms by the server's clock.
macro_rules! now_ms {
    () => {
        "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
    };
}

/// Enqueue, unless the queue already holds ARGV[4] jobs (due + in flight). A job with id ARGV[1]
/// that is already there (queued, running, dead-lettered) or done (its outcome kept) is not
/// queued again: an enqueue whose answer was lost is sent again with the same id.
/// KEYS: 1 due, 2 inflight, 3 jobs, 4 the job's status key. ARGV: 1 id, 2 payload, 3 delay ms,
/// 4 max queued.
/// Returns 1 when queued (or already there), 0 when full (nothing changed). A job already there
/// is written again unchanged, so that the answer follows a write of this connection's: a
/// `WAIT` after it (`DurableQueue::with_replicas`) counts the replicas that have the job even
/// when the first try came over another connection.
pub(crate) const ENQUEUE: &str = concat!(
    slot_guard!(),
    r#"
local queued = redis.call('HGET', KEYS[3], ARGV[1])
if queued then
  redis.call('HSET', KEYS[3], ARGV[1], queued)
  return 1
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  return 1
end
if redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then
  return 0
end
"#,
    now_ms!(),
    r#"
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return 1
"#
);

/// Claim. First the clean-up: dead letters past their retention (ARGV[4] ms) or beyond the
/// count bound (ARGV[5]) are deleted with their payload and bookkeeping; then expired claims
/// are reaped: dead-lettered when the job used up its attempts, else put back due now (either
/// way its unknown-type note goes: a worker that ran it may have died). Then up
/// to ARGV[2] due jobs move to `inflight` with deadline now + ARGV[1] ms, their attempt count
/// goes up and each gets the claim token ARGV[3] .. ':' .. position; the batch's ids are kept
/// under KEYS[9] for the visibility timeout. A claim sent again with the same ARGV[3] (its
/// answer was lost) finds them there and answers the jobs still claimed by it, claiming no
/// more: a lost answer does not leave a batch claimed by nobody until its claims expire.
/// KEYS: 1 due, 2 inflight, 3 attempts, 4 jobs, 5 claims, 6 dead, 7 reasons, 8 unknown,
/// 9 the batch (`batch:` .. ARGV[3]).
/// Returns a flat list id, payload, attempt, claim token, ….
pub(crate) const CLAIM: &str = concat!(
    slot_guard!(),
    now_ms!(),
    r#"
local kept = redis.call('LRANGE', KEYS[9], 0, -1)
if #kept > 0 then
  local out = {}
  for i, id in ipairs(kept) do
    local token = ARGV[3] .. ':' .. i
    local payload = redis.call('HGET', KEYS[4], id)
    if payload and redis.call('HGET', KEYS[5], id) == token then
      table.insert(out, id)
      table.insert(out, payload)
      table.insert(out, redis.call('HGET', KEYS[3], id) or '1')
      table.insert(out, token)
    end
  end
  return out
end
local function forget(id)
  redis.call('ZREM', KEYS[6], id)
  redis.call('HDEL', KEYS[4], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[7], id)
  redis.call('HDEL', KEYS[8], id)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', now - tonumber(ARGV[4]), 'LIMIT', 0, 1000)) do
  forget(id)
end
local excess = redis.call('ZCARD', KEYS[6]) - tonumber(ARGV[5])
if excess > 0 then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[6], 0, math.min(excess, 1000) - 1)) do
    forget(id)
  end
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1000)
for _, id in ipairs(expired) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[5], id)
  local n = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  local payload = redis.call('HGET', KEYS[4], id)
  local ok, env = pcall(cjson.decode, payload or '')
  local max = ok and type(env) == 'table' and tonumber(env['max_attempts']) or 0
  if n >= max then
    redis.call('HDEL', KEYS[8], id)
    redis.call('ZADD', KEYS[6], now, id)
    redis.call('HSET', KEYS[7], id, 'its claim expired ' .. n .. ' times (a worker died, was killed or stalled past the visibility timeout while running it)')
  else
    redis.call('HDEL', KEYS[8], id)
    redis.call('ZADD', KEYS[1], now, id)
  end
end
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for i, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  local payload = redis.call('HGET', KEYS[4], id)
  if payload then
    local n = redis.call('HINCRBY', KEYS[3], id, 1)
    local token = ARGV[3] .. ':' .. i
    redis.call('HSET', KEYS[5], id, token)
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), id)
    table.insert(out, id)
    table.insert(out, payload)
    table.insert(out, tostring(n))
    table.insert(out, token)
  end
end
if #ids > 0 then
  for j = 1, #ids, 1000 do
    redis.call('RPUSH', KEYS[9], unpack(ids, j, math.min(j + 999, #ids)))
  end
  redis.call('PEXPIRE', KEYS[9], ARGV[1])
end
return out
"#
);

/// Retry, if claim ARGV[2] is still the job's: take it out of `inflight`; dead-letter it with
/// reason ARGV[5] when its attempts reached ARGV[4], else make it due in ARGV[3] ms. ARGV[6]
/// says how the claim counts:
/// * `0`: as an attempt (the job ran, or its lock was busy);
/// * `1`: not at all (the job could not be tried: its lock backend was down): the count goes
///   back down and the job is re-queued;
/// * `2`: not as an attempt, but against a grace period: the worker does not know the job's
///   type, or cannot decode its data (a rolling deploy: a newer instance queued it). The first
///   such claim notes the time in `unknown`; once ARGV[7] ms have passed since, the job is
///   dead-lettered.
///
/// Any other outcome (a worker that could run the job) clears that note.
/// KEYS: 1 inflight, 2 due, 3 dead, 4 attempts, 5 claims, 6 reasons, 7 unknown.
/// ARGV: 1 id, 2 claim token, 3 delay ms, 4 max attempts, 5 reason, 6 how it counts (above),
/// 7 grace ms for an unknown type.
/// Returns 1 when dead-lettered, 0 when re-queued, 2 when re-queued as the first claim that
/// did not know its type, -1 when the claim is not this one.
pub(crate) const RETRY: &str = concat!(
    slot_guard!(),
    r#"
if redis.call('HGET', KEYS[5], ARGV[1]) ~= ARGV[2] then return -1 end
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
"#,
    now_ms!(),
    r#"
local n = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
if ARGV[6] ~= '0' and n > 0 then redis.call('HINCRBY', KEYS[4], ARGV[1], -1) end
local first_unknown = false
if ARGV[6] == '2' then
  local since = tonumber(redis.call('HGET', KEYS[7], ARGV[1]) or '')
  if not since then
    since = now
    first_unknown = true
    redis.call('HSET', KEYS[7], ARGV[1], now)
  end
  if now - since >= tonumber(ARGV[7]) then
    redis.call('HDEL', KEYS[7], ARGV[1])
    redis.call('ZADD', KEYS[3], now, ARGV[1])
    redis.call('HSET', KEYS[6], ARGV[1], ARGV[5])
    return 1
  end
else
  redis.call('HDEL', KEYS[7], ARGV[1])
end
if ARGV[6] == '0' and n >= tonumber(ARGV[4]) then
  redis.call('ZADD', KEYS[3], now, ARGV[1])
  redis.call('HSET', KEYS[6], ARGV[1], ARGV[5])
  return 1
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
if first_unknown then return 2 end
return 0
"#
);

/// Ack, if claim ARGV[4] is still the job's: drop the job and keep its outcome for ARGV[3] ms.
/// KEYS: 1 inflight, 2 jobs, 3 attempts, 4 status key, 5 claims, 6 unknown.
/// ARGV: 1 id, 2 outcome, 3 retention ms, 4 claim token.
/// Returns 1 when acknowledged, 0 when the claim is not this one.
pub(crate) const ACK: &str = concat!(
    slot_guard!(),
    r#"
if redis.call('HGET', KEYS[5], ARGV[1]) ~= ARGV[4] then return 0 end
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('SET', KEYS[4], ARGV[2], 'PX', ARGV[3])
return 1
"#
);

/// Heartbeat, if claim ARGV[3] is still the job's: push its deadline to now + ARGV[1] ms. Only
/// a worker that runs the job sends one, so it clears the job's unknown-type note.
/// KEYS: 1 inflight, 2 claims, 3 unknown. ARGV: 1 visibility ms, 2 id, 3 claim token.
/// Returns 1 if extended, 0 when the claim is not this one.
pub(crate) const HEARTBEAT: &str = concat!(
    slot_guard!(),
    r#"
if redis.call('HGET', KEYS[2], ARGV[2]) ~= ARGV[3] then return 0 end
redis.call('HDEL', KEYS[3], ARGV[2])
"#,
    now_ms!(),
    r#"
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[2])
return 1
"#
);

/// Withdraw job ARGV[1], queued but never claimed (its replicas did not confirm it: see
/// `DurableQueue::with_replicas`). KEYS: 1 due, 2 jobs, 3 attempts.
/// Returns 1 when withdrawn, 0 when the job is not there or was claimed already (nothing
/// changed).
pub(crate) const WITHDRAW: &str = concat!(
    slot_guard!(),
    r#"
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 or redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"#
);

/// Purge a dead letter for good: only if it is one (a job requeued or still queued keeps its
/// payload and bookkeeping).
/// KEYS: 1 dead, 2 jobs, 3 attempts, 4 reasons, 5 unknown. ARGV: 1 id. Returns 1 if it was a
/// dead letter.
pub(crate) const PURGE: &str = concat!(
    slot_guard!(),
    r#"
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return 1
"#
);

/// Requeue a dead letter with a fresh attempt budget (and grace for an unknown type), due now.
/// KEYS: 1 dead, 2 due, 3 attempts, 4 reasons, 5 unknown. ARGV: 1 id. Returns 1 if it was a
/// dead letter.
pub(crate) const REQUEUE: &str = concat!(
    slot_guard!(),
    r#"
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], 0)
"#,
    now_ms!(),
    r#"
redis.call('ZADD', KEYS[2], now, ARGV[1])
return 1
"#
);

/// Describe jobs for a listing: for each id of ARGV[3..] in turn, the first ARGV[1] bytes of its
/// stored copy (the envelope puts the lock key first), its attempt count and its dead-letter
/// reason — `false` for what is missing. A job's copy can be megabytes and only its key is
/// wanted: the copy is never sent whole, and the script stops before copying more than ARGV[2]
/// bytes into Lua (`HSTRLEN` first; at least one job), so one call never holds the server up
/// for long. The caller asks again for the ids after those answered.
/// KEYS: 1 jobs, 2 attempts, 3 reasons. ARGV: 1 prefix bytes, 2 copy budget bytes, 3.. ids.
/// Returns a flat list prefix, attempts, reason, … (three entries per job described).
pub(crate) const DESCRIBE: &str = concat!(
    slot_guard!(),
    r#"
local keep, budget, copied = tonumber(ARGV[1]), tonumber(ARGV[2]), 0
local out = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local size = redis.call('HSTRLEN', KEYS[1], id)
  if i > 3 and copied + size > budget then break end
  copied = copied + size
  local head = false
  if size > 0 then head = string.sub(redis.call('HGET', KEYS[1], id), 1, keep) end
  table.insert(out, head)
  table.insert(out, redis.call('HGET', KEYS[2], id) or false)
  table.insert(out, redis.call('HGET', KEYS[3], id) or false)
end
return out
"#
);
