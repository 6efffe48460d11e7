//! The bench's own connections to the servers: flushing between drivers, `PING` round
//! trips, and `INFO` snapshots (server CPU, commands per operation).

use std::collections::HashMap;
use std::time::Instant;

use redis::aio::MultiplexedConnection;

use crate::stats::Sorted;
use crate::BenchError;

/// One admin connection per server.
pub(crate) struct Admin {
    conns: Vec<MultiplexedConnection>,
}

/// What one server had done at one instant.
#[derive(Clone, Debug, Default)]
pub(crate) struct ServerSnap {
    /// `used_cpu_user + used_cpu_sys` (all of the server's threads), seconds.
    cpu_s: f64,
    /// `cmdstat_<name>` → (calls, usec).
    calls: HashMap<String, (u64, u64)>,
}

/// The work servers did between two snapshots.
#[derive(Clone, Debug, Default)]
pub(crate) struct ServerDelta {
    pub(crate) cpu_s: f64,
    /// Calls per command, including those made from inside Lua scripts.
    pub(crate) calls: HashMap<String, u64>,
    /// Microseconds spent per command (a script's own figure includes its inner calls').
    pub(crate) usec: HashMap<String, u64>,
}

impl ServerDelta {
    /// `{command: calls per op}` and `{command: µs per op}` for every command seen, as JSON.
    pub(crate) fn per_op(&self, ops: usize) -> (serde_json::Value, serde_json::Value) {
        let ops = ops.max(1) as f64;
        let mut names: Vec<&String> = self.calls.keys().filter(|k| self.calls[*k] > 0).collect();
        names.sort();
        let calls = names
            .iter()
            .map(|k| {
                (
                    (*k).clone(),
                    serde_json::json!(crate::stats::round3(self.calls[*k] as f64 / ops)),
                )
            })
            .collect();
        let usec = names
            .iter()
            .map(|k| {
                let u = self.usec.get(*k).copied().unwrap_or(0) as f64;
                (
                    (*k).clone(),
                    serde_json::json!(crate::stats::round3(u / ops)),
                )
            })
            .collect();
        (
            serde_json::Value::Object(calls),
            serde_json::Value::Object(usec),
        )
    }

    /// Calls of the given (lower-case) commands.
    pub(crate) fn calls_of(&self, commands: &[&str]) -> u64 {
        commands
            .iter()
            .map(|c| self.calls.get(*c).copied().unwrap_or(0))
            .sum()
    }
}

impl Admin {
    pub(crate) async fn connect(urls: &[String]) -> Result<Admin, BenchError> {
        let mut conns = Vec::new();
        for url in urls {
            conns.push(
                redis::Client::open(url.as_str())?
                    .get_multiplexed_async_connection()
                    .await?,
            );
        }
        Ok(Admin { conns })
    }

    /// `FLUSHALL` on every server (keys only; loaded scripts stay).
    pub(crate) async fn flush_all(&mut self) -> Result<(), BenchError> {
        for c in &mut self.conns {
            redis::cmd("FLUSHALL").query_async::<()>(c).await?;
        }
        Ok(())
    }

    /// `n` sequential `PING`s to server 0.
    pub(crate) async fn ping_rtt(&mut self, n: usize) -> Result<Sorted, BenchError> {
        let c = &mut self.conns[0];
        for _ in 0..n.min(100) {
            redis::cmd("PING").query_async::<()>(c).await?;
        }
        let mut s = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            redis::cmd("PING").query_async::<()>(c).await?;
            s.push(t.elapsed());
        }
        Ok(Sorted::from_durations(s))
    }

    pub(crate) async fn version(&mut self) -> Result<String, BenchError> {
        let info = self.info(0, "server").await?;
        Ok(info.get("redis_version").cloned().unwrap_or_default())
    }

    async fn info(
        &mut self,
        i: usize,
        section: &str,
    ) -> Result<HashMap<String, String>, BenchError> {
        let text: String = redis::cmd("INFO")
            .arg(section)
            .query_async(&mut self.conns[i])
            .await?;
        Ok(text
            .lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
            .collect())
    }

    /// Snapshots of the first `n` servers.
    pub(crate) async fn snap(&mut self, n: usize) -> Result<Vec<ServerSnap>, BenchError> {
        let mut out = Vec::with_capacity(n);
        for i in 0..n.min(self.conns.len()) {
            let cpu = self.info(i, "cpu").await?;
            let num = |k: &str| {
                cpu.get(k)
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0)
            };
            let cpu_s = num("used_cpu_user") + num("used_cpu_sys");
            let calls = self
                .info(i, "commandstats")
                .await?
                .into_iter()
                .filter_map(|(k, v)| {
                    let name = k.strip_prefix("cmdstat_")?.to_owned();
                    let field = |f: &str| -> Option<u64> {
                        v.split(',').find_map(|kv| kv.strip_prefix(f))?.parse().ok()
                    };
                    Some((name, (field("calls=")?, field("usec=")?)))
                })
                .collect();
            out.push(ServerSnap { cpu_s, calls });
        }
        Ok(out)
    }
}

/// The summed work of all servers between `a` and `b`.
pub(crate) fn delta(a: &[ServerSnap], b: &[ServerSnap]) -> ServerDelta {
    let mut d = ServerDelta::default();
    for (a, b) in a.iter().zip(b) {
        d.cpu_s += b.cpu_s - a.cpu_s;
        for (k, &(calls, usec)) in &b.calls {
            if k == "info" {
                continue; // the bench's own snapshots
            }
            let (c0, u0) = a.calls.get(k).copied().unwrap_or((0, 0));
            *d.calls.entry(k.clone()).or_default() += calls.saturating_sub(c0);
            *d.usec.entry(k.clone()).or_default() += usec.saturating_sub(u0);
        }
    }
    d
}

/// The client process's and the servers' work over a measured window.
#[derive(Clone, Debug, Default)]
pub(crate) struct Work {
    pub(crate) client_cpu_s: f64,
    pub(crate) server: ServerDelta,
    /// Busy CPU time of the whole machine.
    pub(crate) machine_cpu_s: f64,
    pub(crate) wall_s: f64,
}

impl Work {
    /// The work of two windows together.
    pub(crate) fn merge(mut self, other: Work) -> Work {
        self.client_cpu_s += other.client_cpu_s;
        self.machine_cpu_s += other.machine_cpu_s;
        self.wall_s += other.wall_s;
        self.server.cpu_s += other.server.cpu_s;
        for (k, v) in other.server.calls {
            *self.server.calls.entry(k).or_default() += v;
        }
        for (k, v) in other.server.usec {
            *self.server.usec.entry(k).or_default() += v;
        }
        self
    }

    /// Cores busy with anything but this process and the servers (other builds, say): the
    /// noise indicator of a window.
    pub(crate) fn others_cores(&self) -> f64 {
        let others = self.machine_cpu_s - self.client_cpu_s - self.server.cpu_s;
        crate::stats::round3((others / self.wall_s.max(1e-9)).max(0.0))
    }
}

/// Takes a snapshot of the client's CPU and the first `n` servers.
pub(crate) struct Mark {
    at: Instant,
    machine_cpu_s: f64,
    client_cpu_s: f64,
    servers: Vec<ServerSnap>,
}

impl Mark {
    pub(crate) async fn take(admin: &mut Admin, n: usize) -> Result<Mark, BenchError> {
        let servers = admin.snap(n).await?;
        Ok(Mark {
            at: Instant::now(),
            machine_cpu_s: crate::sys::machine_busy_secs(),
            client_cpu_s: crate::sys::cpu_secs(),
            servers,
        })
    }

    pub(crate) fn work_until(&self, later: &Mark) -> Work {
        Work {
            client_cpu_s: later.client_cpu_s - self.client_cpu_s,
            server: delta(&self.servers, &later.servers),
            machine_cpu_s: later.machine_cpu_s - self.machine_cpu_s,
            wall_s: (later.at - self.at).as_secs_f64(),
        }
    }
}
