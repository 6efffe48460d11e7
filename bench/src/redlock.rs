//! Scenario 3: Redlock over 5 servers — the uncontended pairs, an acquire with 2 of 5 servers
//! frozen (SIGSTOP), and a failing acquire with 3 of 5 frozen.

use std::time::{Duration, Instant};

use dlock_tests::RedisServer;
use serde_json::{json, Map, Value};

use crate::clients::{is_soft, Client, Driver, RAW_NODE_TIMEOUT};
use crate::stats::{ms, Sorted};
use crate::{BenchError, Plan};

const TTL: Duration = Duration::from_secs(10);
/// Longest a single acquire or release may take before it is recorded as hung.
const HUNG: Duration = Duration::from_secs(15);

/// The fault figures of one driver.
pub(crate) struct Faults {
    acquire_2: Sorted,
    release_2: Sorted,
    acquired_2: usize,
    fail_3: Sorted,
    outcomes_3: Vec<String>,
}

impl Faults {
    /// `deadline`: the configured bound of one acquire, when the driver has one.
    pub(crate) fn to_json(&self, fields: &mut Map<String, Value>, deadline: Option<Duration>) {
        let mut put = |k: &str, v: Value| {
            fields.insert(k.to_owned(), v);
        };
        put(
            "acquire_2_of_5_paused_median_ms",
            json!(ms(self.acquire_2.median())),
        );
        put(
            "acquire_2_of_5_paused_max_ms",
            json!(ms(self.acquire_2.max())),
        );
        put("acquire_2_of_5_paused_granted", json!(self.acquired_2));
        put("acquire_2_of_5_paused_samples", json!(self.acquire_2.len()));
        put(
            "release_2_of_5_paused_median_ms",
            json!(ms(self.release_2.median())),
        );
        put(
            "fail_3_of_5_paused_median_ms",
            json!(ms(self.fail_3.median())),
        );
        put("fail_3_of_5_paused_max_ms", json!(ms(self.fail_3.max())));
        put("fail_3_of_5_paused_samples", json!(self.fail_3.len()));
        let mut outcomes = self.outcomes_3.clone();
        outcomes.sort();
        outcomes.dedup();
        put("fail_3_of_5_paused_outcome", json!(outcomes.join("; ")));
        match deadline {
            Some(d) => {
                put("deadline_ms", json!(ms(d)));
                put("fail_within_deadline", json!(self.fail_3.max() <= d));
            }
            None => {
                put("deadline_ms", Value::Null);
                put("fail_within_deadline", Value::Null);
            }
        }
    }
}

/// The configured bound of one acquire attempt: dlock's locker command timeout (1 s default;
/// nodes have 50 ms each), raw's two fan-outs (acquire, undo) of 50 ms each; rslock has none.
pub(crate) fn deadline(driver: Driver) -> Option<Duration> {
    match driver {
        Driver::Raw => Some(RAW_NODE_TIMEOUT * 2),
        Driver::Dlock => Some(Duration::from_secs(1)),
        Driver::Rslock => None,
    }
}

fn describe(
    r: &Result<Result<Option<crate::clients::Held>, BenchError>, tokio::time::error::Elapsed>,
) -> String {
    match r {
        Ok(Ok(Some(_))) => "acquired".to_owned(),
        Ok(Ok(None)) => "not acquired".to_owned(),
        Ok(Err(e)) => {
            let s = e.to_string();
            // Keep the kind, not the per-node detail.
            s.split(':').next().unwrap_or(&s).trim().to_owned()
        }
        Err(_) => format!("hung > {HUNG:?}"),
    }
}

/// Freezes `servers[paused]`, runs `f`, thaws them whatever happened.
async fn with_paused<T>(
    servers: &mut [RedisServer],
    paused: &[usize],
    f: impl std::future::Future<Output = T>,
) -> T {
    for &i in paused {
        servers[i].pause();
    }
    let out = f.await;
    for &i in paused {
        servers[i].resume();
    }
    out
}

/// Acquire/release with 2 of 5 frozen, then failing acquires with 3 of 5 frozen.
pub(crate) async fn faults(
    client: &Client,
    servers: &mut [RedisServer],
    plan: &Plan,
) -> Result<Faults, BenchError> {
    // Warm the connections to every node first.
    for i in 0..20 {
        let key = format!("rl:warm:{i}");
        let h = client
            .try_lock(&key, TTL)
            .await?
            .ok_or("redlock warm-up not granted")?;
        client.unlock(h).await?;
    }
    let (mut acq, mut rel, mut granted) = (Vec::new(), Vec::new(), 0);
    let res: Result<(), BenchError> = with_paused(servers, &[3, 4], async {
        for i in 0..plan.paused_samples {
            let key = format!("rl:2:{i}");
            let t = Instant::now();
            let r = tokio::time::timeout(HUNG, client.try_lock(&key, TTL)).await;
            acq.push(t.elapsed());
            if let Ok(Ok(Some(h))) = r {
                granted += 1;
                let t = Instant::now();
                match tokio::time::timeout(HUNG, client.unlock(h)).await {
                    Ok(Ok(())) => rel.push(t.elapsed()),
                    Ok(Err(e)) if is_soft(&e) => {
                        rel.push(t.elapsed());
                        eprintln!("  redlock 2 of 5 paused, release {i}: {e}");
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Err("redlock: a release hung".into()),
                }
            } else {
                eprintln!("  redlock 2 of 5 paused, sample {i}: {}", describe(&r));
            }
        }
        Ok(())
    })
    .await;
    res?;
    settle().await;
    let (mut fail, mut outcomes) = (Vec::new(), Vec::new());
    let res: Result<(), BenchError> = with_paused(servers, &[2, 3, 4], async {
        for i in 0..plan.failing_samples {
            let key = format!("rl:3:{i}");
            let t = Instant::now();
            let r = tokio::time::timeout(HUNG, client.try_lock(&key, TTL)).await;
            fail.push(t.elapsed());
            outcomes.push(describe(&r));
            if let Ok(Ok(Some(h))) = r {
                // Should not happen; release whatever it is.
                let _ = tokio::time::timeout(HUNG, client.unlock(h)).await;
            }
        }
        Ok(())
    })
    .await;
    res?;
    settle().await;
    Ok(Faults {
        acquire_2: Sorted::from_durations(acq),
        release_2: Sorted::from_durations(rel),
        acquired_2: granted,
        fail_3: Sorted::from_durations(fail),
        outcomes_3: outcomes,
    })
}

/// Lets thawed servers work off their backlog and clients reconnect.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}
