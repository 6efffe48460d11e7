//! Scenario 2: 16 tasks competing for one key, each holding it for 1 ms
//! (`contended`), or pausing 5 ms after each release before competing again
//! (`contended_think`).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::admin::{Admin, Mark, Work};
use crate::clients::{Client, Driver};
use crate::stats::{as_ns, ms, round1, round3, us, Sorted};
use crate::{BenchError, Plan};

pub(crate) const TASKS: usize = 16;
pub(crate) const HOLD: Duration = Duration::from_millis(1);
pub(crate) const THINK: Duration = Duration::from_millis(5);
const TTL: Duration = Duration::from_secs(10);
/// A single wait longer than this is a driver error (bounded run).
const GIVE_UP: Duration = Duration::from_secs(30);
const KEY: &str = "contended";

/// One critical section.
#[derive(Clone, Copy)]
struct Cs {
    task: usize,
    /// Acquire called.
    t0: Instant,
    /// Acquire returned: the lock is ours.
    t1: Instant,
    /// Critical section over: release called.
    t2: Instant,
}

pub(crate) struct Contended {
    pub(crate) cs: usize,
    pub(crate) secs: f64,
    pub(crate) wait: Sorted,
    /// From a release being called to the next acquire (by anyone) returning.
    pub(crate) handoff: Sorted,
    pub(crate) hold: Sorted,
    pub(crate) per_task: Vec<usize>,
    /// Consecutive critical sections that overlapped (must be 0).
    pub(crate) overlaps: usize,
    pub(crate) work: Work,
}

impl Contended {
    /// Two rounds of the same driver together (per-task counts added task by task).
    pub(crate) fn merge(self, o: Contended) -> Contended {
        Contended {
            cs: self.cs + o.cs,
            secs: self.secs + o.secs,
            wait: self.wait.merge(o.wait),
            handoff: self.handoff.merge(o.handoff),
            hold: self.hold.merge(o.hold),
            per_task: self
                .per_task
                .iter()
                .zip(&o.per_task)
                .map(|(a, b)| a + b)
                .collect(),
            overlaps: self.overlaps + o.overlaps,
            work: self.work.merge(o.work),
        }
    }

    pub(crate) fn cs_per_s(&self) -> f64 {
        self.cs as f64 / self.secs
    }

    pub(crate) fn fairness(&self) -> f64 {
        let min = self.per_task.iter().copied().min().unwrap_or(0) as f64;
        let max = self.per_task.iter().copied().max().unwrap_or(0) as f64;
        if max == 0.0 {
            0.0
        } else {
            round3(min / max)
        }
    }

    pub(crate) fn to_json(&self, driver: Driver) -> Value {
        let per_op = |x: f64| round3(x / self.cs.max(1) as f64);
        let (calls, usec) = self.work.server.per_op(self.cs);
        json!({
            "status": "ok",
            "cs_per_s": round1(self.cs_per_s()),
            "wait_p50_ms": ms(self.wait.median()),
            "wait_p99_ms": ms(self.wait.pct(99.0)),
            "wait_max_ms": ms(self.wait.max()),
            "handoff_p50_us": us(self.handoff.median()),
            "handoff_p99_us": us(self.handoff.pct(99.0)),
            "handoff_max_us": us(self.handoff.max()),
            "fairness": self.fairness(),
            "cs_min_per_task": self.per_task.iter().min(),
            "cs_max_per_task": self.per_task.iter().max(),
            "cs": self.cs,
            "tasks": TASKS,
            "seconds": round3(self.secs),
            "hold_p50_us": us(self.hold.median()),
            "lock_held_fraction": round3(self.hold.ns().iter().sum::<u64>() as f64 / 1e9 / self.secs),
            "overlaps": self.overlaps,
            "client_cpu_us_per_cs": per_op(self.work.client_cpu_s * 1e6),
            "redis_cpu_us_per_cs": per_op(self.work.server.cpu_s * 1e6),
            "redis_requests_per_cs": per_op(self.work.server.calls_of(driver.top_level_commands()) as f64),
            "others_cpu_cores": self.work.others_cores(),
            "redis_calls_per_cs": calls,
            "redis_usec_per_cs": usec,
        })
    }
}

/// Runs 16 competing tasks for `plan.warm + plan.measure`, counting the measured part.
pub(crate) async fn run(
    client: &Client,
    admin: &mut Admin,
    think: Option<Duration>,
    plan: &Plan,
) -> Result<Contended, BenchError> {
    let start = Instant::now();
    let measure_from = start + plan.warm;
    let end = measure_from + plan.measure;
    let mut tasks = Vec::with_capacity(TASKS);
    for task in 0..TASKS {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while Instant::now() < end {
                let t0 = Instant::now();
                let held = client.lock_wait(KEY, TTL, GIVE_UP).await?;
                let t1 = Instant::now();
                precise_sleep(HOLD).await?;
                let t2 = Instant::now();
                client.unlock(held).await?;
                out.push(Cs { task, t0, t1, t2 });
                if let Some(think) = think {
                    precise_sleep(think).await?;
                }
            }
            Ok::<_, BenchError>(out)
        }));
    }
    tokio::time::sleep_until(measure_from.into()).await;
    let m0 = Mark::take(admin, 1).await?;
    tokio::time::sleep_until(end.into()).await;
    let m1 = Mark::take(admin, 1).await?;
    let all = collect(tasks).await?;
    Ok(analyse(all, measure_from, end, m0.work_until(&m1)))
}

/// Like [`run`], for a lock outside the Redis clients (etcd): [`TASKS`] tasks compete through
/// `take` (resolves once the lock is the task's, with what `give` needs to release it), hold
/// it [`HOLD`], and `give` it back, for `plan.warm + plan.measure`. No server figures (the
/// result's `work` is empty).
pub(crate) async fn run_with<H, T, TF, G, GF>(
    plan: &Plan,
    take: T,
    give: G,
) -> Result<Contended, BenchError>
where
    H: Send + 'static,
    T: Fn(usize) -> TF + Send + Sync + Clone + 'static,
    TF: std::future::Future<Output = Result<H, BenchError>> + Send,
    G: Fn(usize, H) -> GF + Send + Sync + Clone + 'static,
    GF: std::future::Future<Output = Result<(), BenchError>> + Send,
{
    let start = Instant::now();
    let measure_from = start + plan.warm;
    let end = measure_from + plan.measure;
    let mut tasks = Vec::with_capacity(TASKS);
    for task in 0..TASKS {
        let (take, give) = (take.clone(), give.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while Instant::now() < end {
                let t0 = Instant::now();
                let held = tokio::time::timeout(GIVE_UP, take(task))
                    .await
                    .map_err(|_| "contended: a wait took too long")??;
                let t1 = Instant::now();
                precise_sleep(HOLD).await?;
                let t2 = Instant::now();
                give(task, held).await?;
                out.push(Cs { task, t0, t1, t2 });
            }
            Ok::<_, BenchError>(out)
        }));
    }
    let all = collect(tasks).await?;
    Ok(analyse(all, measure_from, end, Work::default()))
}

/// Every task's critical sections (a task that does not finish in time is an error).
async fn collect(
    tasks: Vec<tokio::task::JoinHandle<Result<Vec<Cs>, BenchError>>>,
) -> Result<Vec<Cs>, BenchError> {
    let mut all = Vec::new();
    for t in tasks {
        all.extend(
            tokio::time::timeout(GIVE_UP * 2, t)
                .await
                .map_err(|_| "contended: a task did not finish in time")???,
        );
    }
    Ok(all)
}

/// The last stretch of a [`precise_sleep`] spent yielding instead of sleeping.
const SPIN: Duration = Duration::from_micros(200);

/// Sleeps exactly `d` (to a few µs when the machine is not overloaded). tokio's timer has 1 ms
/// granularity and turned a 1 ms `sleep` into 1–2.3 ms, which would make the hold, not the
/// lock, the figure being measured; the OS timer on tokio's blocking pool is precise but its
/// thread hand-offs add ~0.1 ms. So: the OS timer until [`SPIN`] before the deadline, then
/// `yield_now` until it (other tasks run meanwhile; the worker burns at most `SPIN` of CPU).
/// The measured hold is reported as `hold_p50_us`.
pub(crate) async fn precise_sleep(d: Duration) -> Result<(), BenchError> {
    let deadline = Instant::now() + d;
    if let Some(coarse) = d.checked_sub(SPIN) {
        tokio::task::spawn_blocking(move || std::thread::sleep(coarse)).await?;
    }
    while Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
    Ok(())
}

fn analyse(mut all: Vec<Cs>, from: Instant, end: Instant, work: Work) -> Contended {
    all.sort_by_key(|c| c.t1);
    let inside = |t: Instant| t >= from && t < end;
    let mut per_task = vec![0usize; TASKS];
    let (mut wait, mut hold, mut handoff) = (Vec::new(), Vec::new(), Vec::new());
    let mut overlaps = 0;
    for (i, c) in all.iter().enumerate() {
        if inside(c.t0) {
            wait.push(as_ns(c.t1 - c.t0));
        }
        if !inside(c.t1) {
            continue;
        }
        per_task[c.task] += 1;
        hold.push(as_ns(c.t2 - c.t1));
        if let Some(next) = all.get(i + 1).filter(|n| inside(n.t1)) {
            // Mutual exclusion: the next owner got the lock after this one let go.
            if next.t1 < c.t2 {
                overlaps += 1;
            } else {
                handoff.push(as_ns(next.t1 - c.t2));
            }
        }
    }
    Contended {
        cs: per_task.iter().sum(),
        secs: (end - from).as_secs_f64(),
        wait: Sorted::new(wait),
        handoff: Sorted::new(handoff),
        hold: Sorted::new(hold),
        per_task,
        overlaps,
        work,
    }
}
