//! Scenarios `semaphore` and `rwlock`: 16 tasks on one Redis server competing for a
//! semaphore of 4 permits, or for a read-write lock with 90 % reads, each holding for 1 ms —
//! dlock (`Locker::semaphore`, `Locker::rw`, fair waiting woken by the release) against a
//! hand-written floor in the same run (a Lua script over a sorted set of holders with
//! expiries, the textbook Redis semaphore; a waiter polls every 1 ms; no fencing, no fair
//! queue, no watchdog). rslock has neither primitive.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{LockGuard, Locker, OnFail};
use redis::aio::MultiplexedConnection;
use serde_json::{json, Value};

use crate::clients::{DLOCK_WAIT, RAW_POLL};
use crate::contended::{precise_sleep, HOLD, TASKS};
use crate::stats::{as_ns, ms, round1, round3, Sorted};
use crate::{BenchError, Plan};

/// The semaphore's permits.
pub(crate) const PERMITS: usize = 4;
/// One operation in this many is a write in `rwlock`.
const WRITE_EVERY: usize = 10;
const TTL: Duration = Duration::from_secs(10);
/// A task that did not finish this long after the window is a driver error.
const GIVE_UP: Duration = Duration::from_secs(30);

/// The floor's acquire. KEYS: 1 holders (sorted set, score = expiry ms), 2 writer (string).
/// ARGV: 1 token, 2 ttl ms, 3 capacity, 4 `w` for a writer (`rwlock`) else `r`.
/// Returns 1 when granted, 0 otherwise.
const RAW_ACQUIRE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local n = redis.call('ZCARD', KEYS[1])
if ARGV[4] == 'w' then
  if n > 0 then return 0 end
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  return 1
end
if n >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
"#;

/// The floor's release. KEYS as above. ARGV: 1 token.
const RAW_RELEASE: &str = r#"
if redis.call('GET', KEYS[2]) == ARGV[1] then return redis.call('DEL', KEYS[2]) end
return redis.call('ZREM', KEYS[1], ARGV[1])
"#;

#[derive(Clone)]
enum Driver {
    Raw(
        MultiplexedConnection,
        Arc<redis::Script>,
        Arc<redis::Script>,
    ),
    Dlock(Locker),
}

enum Held {
    Raw(String),
    Dlock(LockGuard),
}

impl Driver {
    fn name(&self) -> &'static str {
        match self {
            Driver::Raw(..) => "raw",
            Driver::Dlock(_) => "dlock",
        }
    }

    /// Waits for a hold until `deadline`; `None` when it passed (a starved waiter).
    async fn acquire(
        &self,
        key: &str,
        write: Option<bool>,
        deadline: Instant,
    ) -> Result<Option<Held>, BenchError> {
        match self {
            Driver::Dlock(locker) => {
                let req = match write {
                    None => locker.semaphore(key, PERMITS as u32),
                    Some(false) => locker.rw(key).read(),
                    Some(true) => locker.rw(key).write(),
                };
                let wait = deadline
                    .saturating_duration_since(Instant::now())
                    .clamp(Duration::from_millis(1), DLOCK_WAIT);
                match req.ttl(TTL).on_fail(OnFail::retry(wait)).acquire().await {
                    Ok(g) => Ok(Some(Held::Dlock(g))),
                    Err(e) if e.is_timeout() => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
            Driver::Raw(conn, acquire, _) => {
                let token = format!("{:032x}", rand_u128());
                loop {
                    let mut c = conn.clone();
                    let got: i64 = acquire
                        .key(format!("{key}:h"))
                        .key(format!("{key}:w"))
                        .arg(&token)
                        .arg(TTL.as_millis() as u64)
                        .arg(if write.is_some() {
                            u32::MAX as usize
                        } else {
                            PERMITS
                        })
                        .arg(if write == Some(true) { "w" } else { "r" })
                        .invoke_async(&mut c)
                        .await?;
                    if got == 1 {
                        return Ok(Some(Held::Raw(token)));
                    }
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    tokio::time::sleep(RAW_POLL).await;
                }
            }
        }
    }

    async fn release(&self, key: &str, held: Held) -> Result<(), BenchError> {
        match (self, held) {
            (_, Held::Dlock(g)) => Ok(g.release().await?),
            (Driver::Raw(conn, _, release), Held::Raw(token)) => {
                let mut c = conn.clone();
                let _: i64 = release
                    .key(format!("{key}:h"))
                    .key(format!("{key}:w"))
                    .arg(token)
                    .invoke_async(&mut c)
                    .await?;
                Ok(())
            }
            _ => Err("release with another driver's hold".into()),
        }
    }
}

/// One driver's figures.
struct Run {
    ops: usize,
    secs: f64,
    /// Waits of shared holds (permits, reads) and of writes.
    wait: Sorted,
    write_wait: Sorted,
    per_task: Vec<usize>,
    max_inside: usize,
    violations: usize,
    /// Waits that reached the deadline (the window's end + `STARVED_AFTER`) without a hold.
    starved: usize,
}

/// A waiter still without a hold this long after the measured window is counted as starved.
const STARVED_AFTER: Duration = Duration::from_secs(2);

fn rand_u128() -> u128 {
    let mut b = [0u8; 16];
    let _ = getrandom::fill(&mut b);
    u128::from_le_bytes(b)
}

impl Run {
    fn to_json(&self) -> Value {
        let min = self.per_task.iter().copied().min().unwrap_or(0) as f64;
        let max = self.per_task.iter().copied().max().unwrap_or(0) as f64;
        let mut v = json!({
            "status": "ok",
            "ops_per_s": round1(self.ops as f64 / self.secs),
            "wait_p50_ms": ms(self.wait.median()),
            "wait_p99_ms": ms(self.wait.pct(99.0)),
            "wait_max_ms": ms(self.wait.max()),
            "fairness": if max == 0.0 { 0.0 } else { round3(min / max) },
            "max_holders_at_once": self.max_inside,
            "violations": self.violations,
            "starved_waits": self.starved,
            "ops": self.ops,
            "tasks": TASKS,
            "seconds": round3(self.secs),
        });
        if !self.write_wait.ns().is_empty() {
            v["write_wait_p50_ms"] = json!(ms(self.write_wait.median()));
            v["write_wait_p99_ms"] = json!(ms(self.write_wait.pct(99.0)));
            v["write_wait_max_ms"] = json!(ms(self.write_wait.max()));
        }
        v
    }
}

/// 16 tasks for `plan.warm + plan.measure`; `rw`: 1 write in 10, else permits.
async fn run_one(driver: &Driver, key: &str, rw: bool, plan: &Plan) -> Result<Run, BenchError> {
    let start = Instant::now();
    let (from, end) = (start + plan.warm, start + plan.warm + plan.measure);
    // (readers or permit holders, writers) inside, the most seen, violations.
    let state = Arc::new(std::sync::Mutex::new((0usize, 0usize)));
    let max_inside = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (driver, key) = (driver.clone(), key.to_owned());
        let (state, max_inside, violations) =
            (state.clone(), max_inside.clone(), violations.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut n = task;
            while Instant::now() < end {
                let write = rw.then_some(n % WRITE_EVERY == 0);
                n += 1;
                let t0 = Instant::now();
                let Some(held) = driver.acquire(&key, write, end + STARVED_AFTER).await? else {
                    out.push((task, write == Some(true), t0, None));
                    break;
                };
                let t1 = Instant::now();
                {
                    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                    let w = write == Some(true);
                    let over = if rw {
                        s.1 > 0 || (w && s.0 > 0)
                    } else {
                        s.0 >= PERMITS
                    };
                    if over {
                        violations.fetch_add(1, Ordering::Relaxed);
                    }
                    if w {
                        s.1 += 1
                    } else {
                        s.0 += 1
                    }
                    max_inside.fetch_max(s.0 + s.1, Ordering::Relaxed);
                }
                precise_sleep(HOLD).await?;
                {
                    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                    if write == Some(true) {
                        s.1 -= 1
                    } else {
                        s.0 -= 1
                    }
                }
                driver.release(&key, held).await?;
                out.push((task, write == Some(true), t0, Some(t1)));
            }
            Ok::<_, BenchError>(out)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(
            tokio::time::timeout(GIVE_UP, t)
                .await
                .map_err(|_| "kinds: a task did not finish in time")???,
        );
    }
    let inside = |t: Instant| t >= from && t < end;
    let mut per_task = vec![0usize; TASKS];
    let (mut wait, mut write_wait, mut starved) = (Vec::new(), Vec::new(), 0);
    for (task, write, t0, t1) in all {
        let Some(t1) = t1 else {
            starved += 1;
            continue;
        };
        if inside(t0) {
            if write { &mut write_wait } else { &mut wait }.push(as_ns(t1 - t0));
        }
        if inside(t1) {
            per_task[task] += 1;
        }
    }
    Ok(Run {
        ops: per_task.iter().sum(),
        secs: (end - from).as_secs_f64(),
        wait: Sorted::new(wait),
        write_wait: Sorted::new(write_wait),
        per_task,
        max_inside: max_inside.load(Ordering::Relaxed),
        violations: violations.load(Ordering::Relaxed),
        starved,
    })
}

/// Runs `semaphore` (`rw` false) or `rwlock` on the server at `url`, every driver in turn.
pub(crate) async fn run(url: &str, rw: bool, plan: &Plan) -> Result<Value, BenchError> {
    let client = redis::Client::open(url)?;
    let conn = client.get_multiplexed_async_connection().await?;
    let raw = Driver::Raw(
        conn,
        Arc::new(redis::Script::new(RAW_ACQUIRE)),
        Arc::new(redis::Script::new(RAW_RELEASE)),
    );
    let dlock = Driver::Dlock(Locker::from_url(url).await?);
    let name = if rw { "rwlock" } else { "semaphore" };
    let mut out = serde_json::Map::new();
    for round in 0..plan.rounds {
        for d in [&raw, &dlock] {
            let key = format!("bench:{name}:{round}:{}", d.name());
            let r = run_one(d, &key, rw, plan).await?;
            if r.violations > 0 {
                return Err(format!("{name}/{}: {} violations", d.name(), r.violations).into());
            }
            crate::progress(format!(
                "{name:15} {:6}: {:7.0} ops/s  wait p99 {:8.2} ms max {:8.2} ms{}  most holders at once {}",
                d.name(),
                r.ops as f64 / r.secs,
                r.wait.pct(99.0).as_secs_f64() * 1e3,
                r.wait.max().as_secs_f64() * 1e3,
                if rw {
                    format!(
                        "  write wait p99 {:8.2} ms max {:8.2} ms",
                        r.write_wait.pct(99.0).as_secs_f64() * 1e3,
                        r.write_wait.max().as_secs_f64() * 1e3
                    )
                } else {
                    String::new()
                },
                r.max_inside
            ));
            if r.starved > 0 {
                crate::progress(format!(
                    "{name:15} {:6}: {} waiters starved (no hold {STARVED_AFTER:?} after the window)",
                    d.name(),
                    r.starved
                ));
            }
            // The last round's figures are reported (rounds > 1 only in the default mode).
            out.insert(d.name().into(), r.to_json());
        }
    }
    out.insert(
        "rslock".into(),
        json!({ "status": "n/a", "reason": "rslock has no semaphore and no read-write lock" }),
    );
    out.insert(
        "config".into(),
        json!({
            "tasks": TASKS,
            "hold": "1 ms",
            "permits": if rw { Value::Null } else { json!(PERMITS) },
            "writes": if rw { json!("1 operation in 10") } else { Value::Null },
            "dlock": "OnFail::Retry(RetryPolicy::new(30 s)): fair FIFO waiting, woken by the release",
            "raw": "one Lua script over a sorted set of holders with expiries (+ a writer key), polling every 1 ms; no fencing, no queue, no renewal",
        }),
    );
    Ok(Value::Object(out))
}
