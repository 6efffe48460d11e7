//! Scenario 1 (and Redlock's first figure): 64 tasks, each acquiring and releasing keys no
//! one else uses, as fast as they can.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::admin::{Admin, Mark, Work};
use crate::clients::{is_soft, Client, Driver, Soft};
use crate::stats::{ms, round1, round3, us, Sorted};
use crate::BenchError;

pub(crate) const TASKS: usize = 64;
const TTL: Duration = Duration::from_secs(10);

/// Pairs (acquire + release) of one driver.
pub(crate) struct Pairs {
    pub(crate) tasks: usize,
    /// Pairs that did not go through (see [`Soft`]); not in `pairs`.
    pub(crate) failed: usize,
    pub(crate) pairs: usize,
    pub(crate) secs: f64,
    pub(crate) lat: Sorted,
    pub(crate) work: Work,
}

impl Pairs {
    /// Two rounds of the same driver together.
    pub(crate) fn merge(self, o: Pairs) -> Pairs {
        Pairs {
            tasks: self.tasks,
            failed: self.failed + o.failed,
            pairs: self.pairs + o.pairs,
            secs: self.secs + o.secs,
            lat: self.lat.merge(o.lat),
            work: self.work.merge(o.work),
        }
    }

    pub(crate) fn per_s(&self) -> f64 {
        self.pairs as f64 / self.secs
    }

    pub(crate) fn to_json(&self, driver: Driver) -> Value {
        let per_op = |x: f64| round3(x / self.pairs.max(1) as f64);
        let (calls, usec) = self.work.server.per_op(self.pairs);
        json!({
            "status": "ok",
            "pairs_per_s": round1(self.per_s()),
            "p50_us": us(self.lat.median()),
            "p99_us": us(self.lat.pct(99.0)),
            "max_ms": ms(self.lat.max()),
            "pairs": self.pairs,
            "tasks": self.tasks,
            "failed_pairs": self.failed,
            "seconds": round3(self.secs),
            "client_cpu_us_per_pair": per_op(self.work.client_cpu_s * 1e6),
            "redis_cpu_us_per_pair": per_op(self.work.server.cpu_s * 1e6),
            "redis_requests_per_pair": per_op(self.work.server.calls_of(driver.top_level_commands()) as f64),
            "others_cpu_cores": self.work.others_cores(),
            "redis_calls_per_pair": calls,
            "redis_usec_per_pair": usec,
        })
    }
}

/// Runs `client` with `tasks` tasks for `warm + measure`; only pairs started after the
/// warm-up count. `servers` is how many servers' work to count.
pub(crate) async fn run(
    client: &Client,
    admin: &mut Admin,
    servers: usize,
    (warm, measure, n_tasks): (Duration, Duration, usize),
    key_prefix: &str,
) -> Result<Pairs, BenchError> {
    let start = Instant::now();
    let measure_from = start + warm;
    let end = measure_from + measure;
    let mut tasks = Vec::with_capacity(n_tasks);
    for t in 0..n_tasks {
        let client = client.clone();
        let prefix = format!("{key_prefix}:{t}");
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut last = measure_from;
            let mut i = 0u64;
            let mut failed = 0usize;
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let key = format!("{prefix}:{i}");
                i += 1;
                let pair = async {
                    let held = client.try_lock(&key, TTL).await?.ok_or_else(|| {
                        Box::new(Soft(format!("uncontended key {key} was not granted")))
                            as BenchError
                    })?;
                    client.unlock(held).await
                };
                match pair.await {
                    Ok(()) => {}
                    Err(e) if is_soft(&e) => {
                        if t0 >= measure_from {
                            failed += 1;
                        }
                        continue;
                    }
                    Err(e) => return Err(e),
                }
                if t0 >= measure_from {
                    let done = Instant::now();
                    lat.push(done - t0);
                    last = done;
                }
            }
            Ok::<_, BenchError>((lat, last, failed))
        }));
    }
    tokio::time::sleep_until(measure_from.into()).await;
    let m0 = Mark::take(admin, servers).await?;
    tokio::time::sleep_until(end.into()).await;
    let m1 = Mark::take(admin, servers).await?;
    let mut all = Vec::new();
    let mut last = measure_from;
    let mut failed = 0;
    for t in tasks {
        let (lat, l, f) = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .map_err(|_| "uncontended: a task did not finish within 60 s")???;
        all.extend(lat);
        last = last.max(l);
        failed += f;
    }
    if failed > all.len() / 10 {
        return Err(format!(
            "{failed} of {} pairs failed (more than 10 %)",
            failed + all.len()
        )
        .into());
    }
    let secs = (last - measure_from).as_secs_f64().max(1e-9);
    Ok(Pairs {
        tasks: n_tasks,
        failed,
        pairs: all.len(),
        secs,
        lat: Sorted::from_durations(all),
        work: m0.work_until(&m1),
    })
}
