//! The **resource**: what the critical sections protect, with its own state, on a separate
//! `redis-server` that is never faulted and never proxied.
//!
//! Per lock key `k` it holds a counter (`res:k:val`) with a version (`res:k:ver`), and checks
//! fencing tokens the way a careful storage service does (Kleppmann's fencing): it remembers
//! the highest token it has seen for the key (`res:k:max`) and refuses any operation carrying
//! a lower one. Both operations of the read-modify-write are fenced:
//!
//! * `begin(k, token)` — the **read**: refused if `token < max`; otherwise raises `max` to
//!   `token` and returns `(val, ver)`.
//! * `write(k, token, read_ver, val)` — the **write**: refused if `token < max`; otherwise
//!   stores `val` and bumps `ver`.
//!
//! Fencing the read too is what makes the read-modify-write safe: once a newer holder has
//! read, an older holder can no longer write what it computed from an older read.
//!
//! With `--no-fencing` the checks are off (every operation is accepted, `max` is still
//! tracked), which shows what the same overlaps do to the data without the token.
//!
//! Every operation appends one record to the key's append-only log `res:k:log`, stamped with
//! the resource server's clock (µs); the report is computed from these logs afterwards
//! ([`crate::report`]). Record formats (space-separated):
//!
//! | record | meaning |
//! |---|---|
//! | `<t> B <token> <writer> <ver> <dup>` | read accepted; `dup` = 1 if `token` equals the highest seen |
//! | `<t> b <token> <writer>` | read refused by fencing |
//! | `<t> W <token> <writer> <read_ver> <cur_ver>` | write accepted |
//! | `<t> w <token> <writer> <read_ver> <cur_ver>` | write refused by fencing |
//! | `<t> E <token> <writer> <outcome>` | the critical section ended (`ok`, `fenced`, `abort`, `error`) |
//! | `<t> K - <worker>` | the coordinator SIGKILLed that worker process: its sections are over |
//!
//! For the coordinator, `res:inside` maps each key to its latest entrant
//! (`<pid> <writer> <token> <phase>`, phase `work` or `commit`), and `res:last` to the time of
//! the key's latest accepted write; `res:faults` lists the injected faults.

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Script};

/// Keys of one lock key's state on the resource server.
fn k(key: &str, part: &str) -> String {
    format!("res:{key}:{part}")
}

/// Server time in µs as a string (`now`), exact (no float formatting).
const NOW: &str = r#"
local t = redis.call('TIME')
local now = t[1] .. string.format('%06d', tonumber(t[2]))
"#;

/// Tokens compared exactly, as the `u64`s they are. Lua numbers are doubles, exact only below
/// 2^53, and a Redis token is `counter × 2^ISSUER_BITS + issuer` (about 2^61): as numbers, two
/// tokens that differ only in their issuer bits would compare equal. A token is a decimal
/// string without leading zeros, so the shorter one is smaller and equal lengths compare as
/// strings. `cmp(a, b)` is -1, 0 or 1.
const CMP: &str = r#"
local function cmp(a, b)
  if #a ~= #b then return #a < #b and -1 or 1 end
  if a == b then return 0 end
  return a < b and -1 or 1
end
"#;

/// Whether the resource checks tokens (`res:fencing` = `0` turns it off, for the
/// `--no-fencing` demonstration; the log still tells stale writes apart).
const FENCING: &str = r#"
local fencing = redis.call('GET', 'res:fencing') ~= '0'
"#;

/// KEYS: max, val, ver, log, inside. ARGV: key, token, writer, pid.
/// Returns `{1, val, ver}` when accepted, `{0, 0, 0}` when refused.
const BEGIN: &str = r#"
local c = cmp(ARGV[2], redis.call('GET', KEYS[1]) or '0')
if c < 0 and fencing then
  redis.call('RPUSH', KEYS[4], now .. ' b ' .. ARGV[2] .. ' ' .. ARGV[3])
  return {0, 0, 0}
end
local dup = 0
if c == 0 then dup = 1 end
if c > 0 then redis.call('SET', KEYS[1], ARGV[2]) end
local val = redis.call('GET', KEYS[2]) or '0'
local ver = redis.call('GET', KEYS[3]) or '0'
redis.call('RPUSH', KEYS[4], now .. ' B ' .. ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ver .. ' ' .. dup)
redis.call('HSET', KEYS[5], ARGV[1], ARGV[4] .. ' ' .. ARGV[3] .. ' ' .. ARGV[2] .. ' work')
return {1, tonumber(val), tonumber(ver)}
"#;

/// KEYS: max, val, ver, log, last. ARGV: key, token, writer, read_ver, new_val.
/// Returns 1 when accepted, 0 when refused.
const WRITE: &str = r#"
local c = cmp(ARGV[2], redis.call('GET', KEYS[1]) or '0')
local ver = tonumber(redis.call('GET', KEYS[3]) or '0')
if c < 0 and fencing then
  redis.call('RPUSH', KEYS[4], now .. ' w ' .. ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4] .. ' ' .. ver)
  return 0
end
if c > 0 then redis.call('SET', KEYS[1], ARGV[2]) end
redis.call('SET', KEYS[2], ARGV[5])
redis.call('SET', KEYS[3], ver + 1)
redis.call('RPUSH', KEYS[4], now .. ' W ' .. ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4] .. ' ' .. ver)
redis.call('HSET', KEYS[5], ARGV[1], now)
return 1
"#;

/// KEYS: log, inside. ARGV: key, token, writer, outcome.
const END: &str = r#"
redis.call('RPUSH', KEYS[1], now .. ' E ' .. ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4])
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if cur then
  local p = {}
  for w in string.gmatch(cur, '%S+') do p[#p + 1] = w end
  if p[2] == ARGV[3] and p[3] == ARGV[2] then redis.call('HDEL', KEYS[2], ARGV[1]) end
end
return 1
"#;

/// KEYS: inside. ARGV: key, token, writer, pid. Marks the entrant as past its last check.
const COMMIT: &str = r#"
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local p = {}
  for w in string.gmatch(cur, '%S+') do p[#p + 1] = w end
  if p[2] == ARGV[3] and p[3] == ARGV[2] then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[4] .. ' ' .. ARGV[3] .. ' ' .. ARGV[2] .. ' commit')
  end
end
return 1
"#;

/// KEYS: inside, then every key's log. ARGV: worker name, pid.
/// Appends a `K` record to every log and forgets the worker's entries in `inside`.
const KILLED: &str = r#"
for i = 2, #KEYS do
  redis.call('RPUSH', KEYS[i], now .. ' K - ' .. ARGV[1])
end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local p = {}
  for w in string.gmatch(all[i + 1], '%S+') do p[#p + 1] = w end
  if p[1] == ARGV[2] then redis.call('HDEL', KEYS[1], all[i]) end
end
return now
"#;

/// KEYS: faults. ARGV: description. Returns the server time (µs) of the record.
const FAULT: &str = r#"
redis.call('RPUSH', KEYS[1], now .. ' ' .. ARGV[1])
return now
"#;

/// The result of a fenced read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Read {
    /// The counter's value.
    pub(crate) val: i64,
    /// Its version (number of accepted writes so far).
    pub(crate) ver: i64,
}

/// A holder currently inside a critical section, as `res:inside` sees it.
#[derive(Clone, Debug)]
pub(crate) struct Entrant {
    /// The lock key.
    pub(crate) key: String,
    /// Process id of the worker.
    pub(crate) pid: u32,
    /// `w<worker>.<task>`.
    pub(crate) writer: String,
    /// `work` or `commit`.
    pub(crate) phase: String,
}

/// A client of the resource server.
#[derive(Clone)]
pub(crate) struct Resource {
    conn: MultiplexedConnection,
    begin: Script,
    write: Script,
    end: Script,
    commit: Script,
    killed: Script,
    fault: Script,
}

fn script(body: &str) -> Script {
    Script::new(&format!("{NOW}{FENCING}{CMP}{body}"))
}

impl Resource {
    /// Connects to the resource server at `url`. No response timeout: the resource is never
    /// faulted, and a worker frozen mid-request must still get its answer after it wakes.
    pub(crate) async fn connect(url: &str) -> redis::RedisResult<Resource> {
        let client = redis::Client::open(url)?;
        let config = AsyncConnectionConfig::new().set_response_timeout(None);
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        Ok(Resource {
            conn,
            begin: script(BEGIN),
            write: script(WRITE),
            end: script(END),
            commit: script(COMMIT),
            killed: script(KILLED),
            fault: script(FAULT),
        })
    }

    /// The fenced read. `None` when refused (a newer token was seen).
    pub(crate) async fn begin(
        &self,
        key: &str,
        token: u64,
        writer: &str,
        pid: u32,
    ) -> redis::RedisResult<Option<Read>> {
        let mut conn = self.conn.clone();
        let (ok, val, ver): (i64, i64, i64) = self
            .begin
            .key(k(key, "max"))
            .key(k(key, "val"))
            .key(k(key, "ver"))
            .key(k(key, "log"))
            .key("res:inside")
            .arg(key)
            .arg(token.to_string())
            .arg(writer)
            .arg(pid)
            .invoke_async(&mut conn)
            .await?;
        Ok((ok == 1).then_some(Read { val, ver }))
    }

    /// The fenced write. `false` when refused.
    pub(crate) async fn write(
        &self,
        key: &str,
        token: u64,
        writer: &str,
        read: Read,
        val: i64,
    ) -> redis::RedisResult<bool> {
        let mut conn = self.conn.clone();
        let ok: i64 = self
            .write
            .key(k(key, "max"))
            .key(k(key, "val"))
            .key(k(key, "ver"))
            .key(k(key, "log"))
            .key("res:last")
            .arg(key)
            .arg(token.to_string())
            .arg(writer)
            .arg(read.ver)
            .arg(val)
            .invoke_async(&mut conn)
            .await?;
        Ok(ok == 1)
    }

    /// Marks the end of a critical section.
    pub(crate) async fn end(
        &self,
        key: &str,
        token: u64,
        writer: &str,
        outcome: &str,
    ) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
        self.end
            .key(k(key, "log"))
            .key("res:inside")
            .arg(key)
            .arg(token.to_string())
            .arg(writer)
            .arg(outcome)
            .invoke_async::<i64>(&mut conn)
            .await
            .map(|_| ())
    }

    /// Marks the entrant as past its last lock check (the coordinator's preferred pause
    /// victim).
    pub(crate) async fn commit(
        &self,
        key: &str,
        token: u64,
        writer: &str,
        pid: u32,
    ) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
        self.commit
            .key("res:inside")
            .arg(key)
            .arg(token.to_string())
            .arg(writer)
            .arg(pid)
            .invoke_async::<i64>(&mut conn)
            .await
            .map(|_| ())
    }

    /// Records that worker `name` (process `pid`) was SIGKILLed. Returns the server time (µs).
    pub(crate) async fn killed(
        &self,
        keys: &[String],
        name: &str,
        pid: u32,
    ) -> redis::RedisResult<u64> {
        let mut conn = self.conn.clone();
        let mut inv = self.killed.key("res:inside");
        for key in keys {
            inv.key(k(key, "log"));
        }
        let now: String = inv.arg(name).arg(pid).invoke_async(&mut conn).await?;
        Ok(now.parse().unwrap_or(0))
    }

    /// Turns the token check off (`--no-fencing`): every read and write is accepted.
    pub(crate) async fn disable_fencing(&self) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
        redis::cmd("SET")
            .arg("res:fencing")
            .arg("0")
            .query_async(&mut conn)
            .await
    }

    /// Appends `what` to the fault list. Returns the server time (µs) of the record.
    pub(crate) async fn fault(&self, what: &str) -> redis::RedisResult<u64> {
        let mut conn = self.conn.clone();
        let now: String = self
            .fault
            .key("res:faults")
            .arg(what)
            .invoke_async(&mut conn)
            .await?;
        Ok(now.parse().unwrap_or(0))
    }

    /// Who is inside which critical section right now.
    pub(crate) async fn inside(&self) -> redis::RedisResult<Vec<Entrant>> {
        let mut conn = self.conn.clone();
        let all: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg("res:inside")
            .query_async(&mut conn)
            .await?;
        Ok(all
            .into_iter()
            .filter_map(|(key, v)| {
                let mut p = v.split_whitespace();
                let pid = p.next()?.parse().ok()?;
                let writer = p.next()?.to_owned();
                let _token = p.next()?;
                let phase = p.next()?.to_owned();
                Some(Entrant {
                    key,
                    pid,
                    writer,
                    phase,
                })
            })
            .collect())
    }

    /// The time (µs, resource clock) of each key's latest accepted write.
    pub(crate) async fn last_writes(&self, keys: &[String]) -> redis::RedisResult<Vec<u64>> {
        let mut conn = self.conn.clone();
        let v: Vec<Option<String>> = redis::cmd("HMGET")
            .arg("res:last")
            .arg(keys)
            .query_async(&mut conn)
            .await?;
        Ok(v.into_iter()
            .map(|s| s.and_then(|s| s.parse().ok()).unwrap_or(0))
            .collect())
    }

    /// The resource server's clock, µs.
    pub(crate) async fn now_us(&self) -> redis::RedisResult<u64> {
        let mut conn = self.conn.clone();
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
        Ok(s * 1_000_000 + us)
    }

    /// A key's whole log, oldest first.
    pub(crate) async fn log(&self, key: &str) -> redis::RedisResult<Vec<String>> {
        let mut conn = self.conn.clone();
        let mut out = Vec::new();
        let chunk = 20_000isize;
        let mut start = 0isize;
        loop {
            let part: Vec<String> = redis::cmd("LRANGE")
                .arg(k(key, "log"))
                .arg(start)
                .arg(start + chunk - 1)
                .query_async(&mut conn)
                .await?;
            let n = part.len();
            out.extend(part);
            if (n as isize) < chunk {
                return Ok(out);
            }
            start += chunk;
        }
    }

    /// A key's final `(val, ver)`.
    pub(crate) async fn final_state(&self, key: &str) -> redis::RedisResult<(i64, i64)> {
        let mut conn = self.conn.clone();
        let (val, ver): (Option<i64>, Option<i64>) = redis::cmd("MGET")
            .arg(k(key, "val"))
            .arg(k(key, "ver"))
            .query_async(&mut conn)
            .await?;
        Ok((val.unwrap_or(0), ver.unwrap_or(0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Redis tokens are about 2^61, where doubles step by 256: tokens that differ only in their
    /// low (issuer) bits must still be told apart — the higher one is new, not a reuse, and the
    /// lower one is refused once the higher was seen.
    #[tokio::test]
    async fn tokens_are_compared_exactly_above_two_to_the_53() {
        let server = dlock_tests::redis_server::RedisServer::start();
        let resource = Resource::connect(&server.url()).await.unwrap();
        let low: u64 = (1 << 61) + 5;
        let high = low + 1;
        assert_eq!(
            low as f64, high as f64,
            "the case doubles cannot tell apart"
        );
        assert!(resource.begin("k", low, "w1", 1).await.unwrap().is_some());
        assert!(resource.begin("k", high, "w2", 1).await.unwrap().is_some());
        assert!(
            resource.begin("k", low, "w1", 1).await.unwrap().is_none(),
            "a lower token accepted after a higher one"
        );
        let mut conn = resource.conn.clone();
        let log: Vec<String> = redis::cmd("LRANGE")
            .arg(k("k", "log"))
            .arg(0)
            .arg(-1)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(log.len(), 3, "{log:?}");
        assert!(log[1].ends_with(&format!(" B {high} w2 0 0")), "{log:?}");
        assert!(log[2].ends_with(&format!(" b {low} w1")), "{log:?}");
        // The same token twice is a reuse.
        assert!(resource.begin("k", high, "w3", 1).await.unwrap().is_some());
        let last: String = redis::cmd("LINDEX")
            .arg(k("k", "log"))
            .arg(-1)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(last.ends_with(" 1"), "{last}");
    }
}
