//! `compare.json` (figures, ratios, targets) and the markdown table printed at the end.

use std::fmt::Write as _;

use serde_json::{json, Map, Value};

use crate::stats::ratio;

const DRIVERS: [&str; 3] = ["raw", "dlock", "rslock"];

/// The value at a dotted `path`.
pub(crate) fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

fn num(v: &Value, path: &str) -> Option<f64> {
    at(v, path).and_then(Value::as_f64)
}

/// `a / b` of two figures, as JSON (`null` when either is missing).
fn div(s: &Value, a: &str, b: &str) -> Value {
    match (num(s, a), num(s, b)) {
        (Some(a), Some(b)) => ratio(a, b).map_or(Value::Null, |r| json!(r)),
        _ => Value::Null,
    }
}

fn ratios(s: &Value) -> Value {
    let mut r = Map::new();
    r.insert(
        "uncontended".into(),
        json!({
            "dlock_over_raw": div(s, "uncontended.dlock.pairs_per_s", "uncontended.raw.pairs_per_s"),
            "dlock_over_rslock": div(s, "uncontended.dlock.pairs_per_s", "uncontended.rslock.pairs_per_s"),
            "p99_raw_over_dlock": div(s, "uncontended.raw.p99_us", "uncontended.dlock.p99_us"),
            "redis_cpu_dlock_over_raw": div(s, "uncontended.dlock.redis_cpu_us_per_pair", "uncontended.raw.redis_cpu_us_per_pair"),
            // Where Redis is the bottleneck (its one core saturated), pairs/s is one core over
            // the Redis CPU per pair: this ratio is that projection, dlock over rslock.
            "redis_bound_dlock_over_rslock": div(s, "uncontended.rslock.redis_cpu_us_per_pair", "uncontended.dlock.redis_cpu_us_per_pair"),
            "client_cpu_dlock_over_raw": div(s, "uncontended.dlock.client_cpu_us_per_pair", "uncontended.raw.client_cpu_us_per_pair"),
            "one_task_p50_dlock_over_raw": div(s, "uncontended.dlock.one_task_p50_us", "uncontended.raw.one_task_p50_us"),
        }),
    );
    for c in ["contended", "contended_think"] {
        let p = |d: &str, f: &str| format!("{c}.{d}.{f}");
        r.insert(
            c.into(),
            json!({
                "cs_per_s_dlock_over_rslock": div(s, &p("dlock", "cs_per_s"), &p("rslock", "cs_per_s")),
                "cs_per_s_dlock_over_raw": div(s, &p("dlock", "cs_per_s"), &p("raw", "cs_per_s")),
                "handoff_p99_rslock_over_dlock": div(s, &p("rslock", "handoff_p99_us"), &p("dlock", "handoff_p99_us")),
                "handoff_p99_raw_over_dlock": div(s, &p("raw", "handoff_p99_us"), &p("dlock", "handoff_p99_us")),
                "wait_max_rslock_over_dlock": div(s, &p("rslock", "wait_max_ms"), &p("dlock", "wait_max_ms")),
                "redis_cpu_dlock_over_raw": div(s, &p("dlock", "redis_cpu_us_per_cs"), &p("raw", "redis_cpu_us_per_cs")),
            }),
        );
    }
    r.insert(
        "redlock".into(),
        json!({
            "dlock_over_raw": div(s, "redlock.dlock.pairs_per_s", "redlock.raw.pairs_per_s"),
            "dlock_over_rslock": div(s, "redlock.dlock.pairs_per_s", "redlock.rslock.pairs_per_s"),
            "acquire_2_of_5_paused_rslock_over_dlock": div(
                s,
                "redlock.rslock.acquire_2_of_5_paused_median_ms",
                "redlock.dlock.acquire_2_of_5_paused_median_ms"
            ),
        }),
    );
    r.insert(
        "cluster".into(),
        json!({
            "pairs_per_s_cluster_over_one_server": div(s, "cluster.cluster.pairs_per_s", "cluster.one_server.pairs_per_s"),
            "redis_cpu_cluster_over_one_server": div(s, "cluster.cluster.redis_cpu_us_per_pair", "cluster.one_server.redis_cpu_us_per_pair"),
        }),
    );
    r.insert(
        "sentinel".into(),
        json!({
            "pairs_per_s_sentinel_over_one_server": div(s, "sentinel.sentinel.pairs_per_s", "sentinel.one_server.pairs_per_s"),
            "pairs_per_s_replicas_1_over_one_server": div(s, "sentinel.sentinel_replicas_1.pairs_per_s", "sentinel.one_server.pairs_per_s"),
        }),
    );
    r.insert(
        "etcd".into(),
        json!({
            "pairs_per_s_dlock_over_bare_txn": div(s, "etcd.dlock.pairs_per_s", "etcd.bare_txn.pairs_per_s"),
            "pairs_per_s_dlock_over_lock_rpc": div(s, "etcd.dlock.pairs_per_s", "etcd.lock_rpc.pairs_per_s"),
            "client_cpu_dlock_over_bare_txn": div(s, "etcd.dlock.client_cpu_us_per_pair", "etcd.bare_txn.client_cpu_us_per_pair"),
            "contended_cs_per_s_dlock_over_lock_rpc": div(s, "etcd.contended.dlock.cs_per_s", "etcd.contended.lock_rpc.cs_per_s"),
            "contended_handoff_p50_lock_rpc_over_dlock": div(s, "etcd.contended.lock_rpc.handoff_p50_us", "etcd.contended.dlock.handoff_p50_us"),
            "contended_handoff_p99_lock_rpc_over_dlock": div(s, "etcd.contended.lock_rpc.handoff_p99_us", "etcd.contended.dlock.handoff_p99_us"),
            "contended_fairness_dlock": num(s, "etcd.contended.dlock.fairness"),
        }),
    );
    r.insert(
        "zookeeper".into(),
        json!({
            "pairs_per_s_dlock_over_bare_create_delete": div(s, "zookeeper.dlock.pairs_per_s", "zookeeper.bare_create_delete.pairs_per_s"),
            "pairs_per_s_dlock_over_recipe": div(s, "zookeeper.dlock.pairs_per_s", "zookeeper.recipe.pairs_per_s"),
            "contended_cs_per_s_dlock_over_recipe": div(s, "zookeeper.contended.dlock.cs_per_s", "zookeeper.contended.recipe.cs_per_s"),
            "contended_handoff_p50_recipe_over_dlock": div(s, "zookeeper.contended.recipe.handoff_p50_us", "zookeeper.contended.dlock.handoff_p50_us"),
            "contended_handoff_p99_recipe_over_dlock": div(s, "zookeeper.contended.recipe.handoff_p99_us", "zookeeper.contended.dlock.handoff_p99_us"),
            "contended_fairness_dlock": num(s, "zookeeper.contended.dlock.fairness"),
            "contended_fairness_recipe": num(s, "zookeeper.contended.recipe.fairness"),
        }),
    );
    for k in ["semaphore", "rwlock"] {
        let p = |d: &str, f: &str| format!("{k}.{d}.{f}");
        r.insert(
            k.into(),
            json!({
                "ops_per_s_dlock_over_raw": div(s, &p("dlock", "ops_per_s"), &p("raw", "ops_per_s")),
                "wait_max_raw_over_dlock": div(s, &p("raw", "wait_max_ms"), &p("dlock", "wait_max_ms")),
                "write_wait_max_raw_over_dlock": div(s, &p("raw", "write_wait_max_ms"), &p("dlock", "write_wait_max_ms")),
            }),
        );
    }
    r.insert(
        "layer_overhead".into(),
        json!({
            "rps_dlock_over_plain": div(s, "layer_overhead.dlock.rps", "layer_overhead.plain.rps"),
            "rps_dlock_over_raw": div(s, "layer_overhead.dlock.rps", "layer_overhead.raw.rps"),
        }),
    );
    Value::Object(r)
}

/// (name, path in the report, comparison, limit)
const TARGETS: [(&str, &str, &str, f64); 20] = [
    (
        "uncontended dlock/raw ≥ 0.9",
        "ratios.uncontended.dlock_over_raw",
        ">=",
        0.9,
    ),
    (
        "uncontended dlock/rslock ≥ 1.0",
        "ratios.uncontended.dlock_over_rslock",
        ">=",
        1.0,
    ),
    (
        "uncontended dlock/rslock ≥ 0.8 on 2 cores",
        "ratios.uncontended.dlock_over_rslock",
        ">=",
        0.8,
    ),
    (
        "uncontended, Redis the bottleneck: dlock/rslock ≥ 1.0 (projected from Redis CPU per pair)",
        "ratios.uncontended.redis_bound_dlock_over_rslock",
        ">=",
        1.0,
    ),
    (
        "uncontended Redis CPU per pair ≤ 1.5 × raw",
        "ratios.uncontended.redis_cpu_dlock_over_raw",
        "<=",
        1.5,
    ),
    (
        "uncontended client CPU per pair ≤ 1.3 × raw",
        "ratios.uncontended.client_cpu_dlock_over_raw",
        "<=",
        1.3,
    ),
    (
        "uncontended one-task pair p50 ≤ 1.15 × raw",
        "ratios.uncontended.one_task_p50_dlock_over_raw",
        "<=",
        1.15,
    ),
    (
        "contended cs/s ≥ 1.1 × rslock",
        "ratios.contended.cs_per_s_dlock_over_rslock",
        ">=",
        1.1,
    ),
    (
        "contended fairness ≥ 0.95",
        "scenarios.contended.dlock.fairness",
        ">=",
        0.95,
    ),
    (
        "contended_think handoff p99 ≤ 0.5 ms (µs)",
        "scenarios.contended_think.dlock.handoff_p99_us",
        "<=",
        500.0,
    ),
    (
        "contended_think cs/s ≥ 1.8 × rslock",
        "ratios.contended_think.cs_per_s_dlock_over_rslock",
        ">=",
        1.8,
    ),
    (
        "contended_think worst wait ≤ 50 ms",
        "scenarios.contended_think.dlock.wait_max_ms",
        "<=",
        50.0,
    ),
    (
        "contended_think fairness ≥ 0.8",
        "scenarios.contended_think.dlock.fairness",
        ">=",
        0.8,
    ),
    (
        "redlock uncontended ≥ 1.0 × rslock",
        "ratios.redlock.dlock_over_rslock",
        ">=",
        1.0,
    ),
    (
        "redlock acquire, 2 of 5 paused: median ≤ 5 ms",
        "scenarios.redlock.dlock.acquire_2_of_5_paused_median_ms",
        "<=",
        5.0,
    ),
    (
        "redlock failing acquire, 3 of 5 paused: within deadline (ms)",
        "scenarios.redlock.dlock.fail_3_of_5_paused_max_ms",
        "<=deadline",
        0.0,
    ),
    (
        "held at scale: zero locks lost",
        "scenarios.held_at_scale.dlock.lost",
        "<=",
        0.0,
    ),
    (
        "held at scale: RSS < 200 MiB",
        "scenarios.held_at_scale.dlock.rss_max_mib",
        "<",
        200.0,
    ),
    (
        "held at scale: CPU < 1 core",
        "scenarios.held_at_scale.dlock.cpu_cores",
        "<",
        1.0,
    ),
    (
        "layer p99 added ≤ 2 RTT + 100 µs (µs)",
        "scenarios.layer_overhead.added_p99_us",
        "<=budget",
        0.0,
    ),
];

fn targets(report: &Value) -> Value {
    let rows: Vec<Value> = TARGETS
        .iter()
        .map(|&(name, path, op, limit)| {
            let value = num(report, path);
            let limit = match op {
                "<=deadline" => num(report, "scenarios.redlock.dlock.deadline_ms"),
                "<=budget" => num(report, "scenarios.layer_overhead.budget_us"),
                _ => Some(limit),
            };
            let mut met = match (value, limit) {
                (Some(v), Some(l)) => Some(match op {
                    ">=" => v >= l,
                    "<" => v < l,
                    _ => v <= l,
                }),
                _ => None,
            };
            // The 2-core bound is no target on a machine with more cores.
            if name.ends_with("on 2 cores") && num(report, "meta.cpus").is_some_and(|c| c > 2.0) {
                met = None;
            }
            // "Zero lost" also needs every lock to have been under renewal and renewed.
            if path.ends_with("dlock.lost") && met == Some(true) {
                let locks = num(report, "scenarios.held_at_scale.dlock.locks");
                let renewing = num(report, "scenarios.held_at_scale.dlock.renewing");
                let renewals = num(report, "scenarios.held_at_scale.dlock.renewals").unwrap_or(0.0);
                met =
                    Some(locks.is_some() && locks == renewing && renewals >= locks.unwrap_or(0.0));
            }
            json!({
                "target": name,
                "path": path,
                "value": value,
                "limit": limit,
                "comparison": op.trim_end_matches("deadline").trim_end_matches("budget"),
                "met": met,
            })
        })
        .collect();
    Value::Array(rows)
}

/// The whole report.
pub(crate) fn build(meta: Value, scenarios: Map<String, Value>) -> Value {
    let scenarios = Value::Object(scenarios);
    let ratios = ratios(&scenarios);
    let mut report = json!({ "meta": meta, "scenarios": scenarios, "ratios": ratios });
    let t = targets(&report);
    report["targets"] = t;
    report
}

fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "–".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => if *b { "yes" } else { "no" }.to_owned(),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(0.0);
            if n.is_u64() || n.is_i64() {
                format!("{n}")
            } else if x.abs() >= 1000.0 {
                format!("{x:.0}")
            } else if x.abs() >= 10.0 {
                format!("{x:.1}")
            } else {
                format!("{x:.3}")
            }
        }
        Some(v) => v.to_string(),
    }
}

/// One driver's cell of `scenario.driver.field`.
fn driver_cell(report: &Value, scenario: &str, driver: &str, field: &str) -> String {
    let obj = at(report, &format!("scenarios.{scenario}.{driver}"));
    match obj.and_then(|o| o.get("status")).and_then(Value::as_str) {
        Some("n/a") => "n/a".to_owned(),
        Some("skipped") => "skipped".to_owned(),
        _ => cell(obj.and_then(|o| o.get(field))),
    }
}

const ROWS: &[(&str, &[(&str, &str)])] = &[
    (
        "uncontended",
        &[
            ("pairs/s", "pairs_per_s"),
            ("pair p50 (µs)", "p50_us"),
            ("pair p99 (µs)", "p99_us"),
            ("one task: pair p50 (µs)", "one_task_p50_us"),
            ("one task: pair p99 (µs)", "one_task_p99_us"),
            ("client CPU per pair (µs)", "client_cpu_us_per_pair"),
            ("Redis CPU per pair (µs)", "redis_cpu_us_per_pair"),
            ("Redis requests per pair", "redis_requests_per_pair"),
            ("other processes' CPU (cores)", "others_cpu_cores"),
        ],
    ),
    (
        "contended",
        &[
            ("critical sections/s", "cs_per_s"),
            ("wait p50 (ms)", "wait_p50_ms"),
            ("wait p99 (ms)", "wait_p99_ms"),
            ("wait max (ms)", "wait_max_ms"),
            ("handoff p50 (µs)", "handoff_p50_us"),
            ("handoff p99 (µs)", "handoff_p99_us"),
            ("fairness (min/max per task)", "fairness"),
            ("Redis requests per CS", "redis_requests_per_cs"),
            ("Redis CPU per CS (µs)", "redis_cpu_us_per_cs"),
            ("client CPU per CS (µs)", "client_cpu_us_per_cs"),
            ("measured hold p50 (µs)", "hold_p50_us"),
            ("fraction of time the lock was held", "lock_held_fraction"),
            ("other processes' CPU (cores)", "others_cpu_cores"),
        ],
    ),
    (
        "contended_think",
        &[
            ("critical sections/s", "cs_per_s"),
            ("wait p50 (ms)", "wait_p50_ms"),
            ("wait p99 (ms)", "wait_p99_ms"),
            ("wait max (ms)", "wait_max_ms"),
            ("handoff p50 (µs)", "handoff_p50_us"),
            ("handoff p99 (µs)", "handoff_p99_us"),
            ("fairness (min/max per task)", "fairness"),
            ("Redis requests per CS", "redis_requests_per_cs"),
            ("Redis CPU per CS (µs)", "redis_cpu_us_per_cs"),
            ("client CPU per CS (µs)", "client_cpu_us_per_cs"),
            ("measured hold p50 (µs)", "hold_p50_us"),
            ("fraction of time the lock was held", "lock_held_fraction"),
            ("other processes' CPU (cores)", "others_cpu_cores"),
        ],
    ),
    (
        "semaphore",
        &[
            ("holds/s (4 permits, 16 tasks)", "ops_per_s"),
            ("wait p50 (ms)", "wait_p50_ms"),
            ("wait p99 (ms)", "wait_p99_ms"),
            ("wait max (ms)", "wait_max_ms"),
            ("fairness (min/max per task)", "fairness"),
            ("most holders at once", "max_holders_at_once"),
            ("starved waits", "starved_waits"),
        ],
    ),
    (
        "rwlock",
        &[
            ("holds/s (90 % reads, 16 tasks)", "ops_per_s"),
            ("read wait p99 (ms)", "wait_p99_ms"),
            ("read wait max (ms)", "wait_max_ms"),
            ("write wait p50 (ms)", "write_wait_p50_ms"),
            ("write wait p99 (ms)", "write_wait_p99_ms"),
            ("write wait max (ms)", "write_wait_max_ms"),
            ("fairness (min/max per task)", "fairness"),
            ("starved waits", "starved_waits"),
        ],
    ),
    (
        "redlock",
        &[
            ("pairs/s (5 servers)", "pairs_per_s"),
            ("pair p50 (µs)", "p50_us"),
            ("pair p99 (µs)", "p99_us"),
            (
                "acquire, 2 of 5 paused: median (ms)",
                "acquire_2_of_5_paused_median_ms",
            ),
            (
                "acquire, 2 of 5 paused: max (ms)",
                "acquire_2_of_5_paused_max_ms",
            ),
            (
                "release, 2 of 5 paused: median (ms)",
                "release_2_of_5_paused_median_ms",
            ),
            (
                "failing acquire, 3 of 5 paused: median (ms)",
                "fail_3_of_5_paused_median_ms",
            ),
            (
                "failing acquire, 3 of 5 paused: max (ms)",
                "fail_3_of_5_paused_max_ms",
            ),
            ("failing acquire: outcome", "fail_3_of_5_paused_outcome"),
        ],
    ),
    (
        "held_at_scale",
        &[
            ("locks held", "locks"),
            ("locks lost", "lost"),
            ("RSS, max over the hold (MiB)", "rss_max_mib"),
            ("CPU over the hold (cores)", "cpu_cores"),
            ("renewals/s", "renewals_per_s"),
        ],
    ),
];

/// The markdown tables: figures per driver, the layer, ratios and targets.
pub(crate) fn markdown(report: &Value) -> String {
    let mut out = String::new();
    let meta = &report["meta"];
    let _ = writeln!(
        out,
        "`{}` — {}, {} CPUs, Redis {}, PING round trip p50 {} µs, load average {} → {}\n",
        cell(meta.get("command")),
        cell(meta.get("date")),
        cell(meta.get("cpus")),
        cell(meta.get("redis_version")),
        cell(meta.get("ping_rtt_p50_us")),
        cell(meta.get("loadavg_1m_start")),
        cell(meta.get("loadavg_1m_end"))
    );
    let _ = writeln!(out, "| scenario | figure | raw | dlock | rslock |");
    let _ = writeln!(out, "|---|---|---:|---:|---:|");
    for (scenario, rows) in ROWS {
        if at(report, &format!("scenarios.{scenario}.status")).and_then(Value::as_str)
            == Some("skipped")
        {
            let _ = writeln!(out, "| {scenario} | skipped | | | |");
            continue;
        }
        for (label, field) in *rows {
            let cells: Vec<String> = DRIVERS
                .iter()
                .map(|d| driver_cell(report, scenario, d, field))
                .collect();
            let _ = writeln!(out, "| {scenario} | {label} | {} |", cells.join(" | "));
        }
    }

    let l = &report["scenarios"]["layer_overhead"];
    let _ = writeln!(
        out,
        "\n| layer_overhead | rps ({} conns) | p50 (µs) | p99 (µs) | 1 conn: p50 (µs) | 1 conn: p99 (µs) |",
        cell(l.get("connections"))
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|");
    if l.get("status").and_then(Value::as_str) == Some("ok") {
        for (label, k) in [
            ("axum, no lock", "plain"),
            (
                "axum, hand-written SET NX / EVALSHA in the handler (raw)",
                "raw",
            ),
            ("axum + DistributedLockLayer (dlock)", "dlock"),
        ] {
            let _ = writeln!(
                out,
                "| {label} | {} | {} | {} | {} | {} |",
                cell(l[k].get("rps")),
                cell(l[k].get("p50_us")),
                cell(l[k].get("p99_us")),
                cell(l[k].get("one_connection_p50_us")),
                cell(l[k].get("one_connection_p99_us"))
            );
        }
        let _ = writeln!(
            out,
            "| added by raw | | | | {} | {} |",
            cell(l.get("raw_added_p50_us")),
            cell(l.get("raw_added_p99_us")),
        );
        let _ = writeln!(
            out,
            "| added by the layer | | | {} | {} | {} (budget {}) |",
            cell(l.get("added_p99_under_load_us")),
            cell(l.get("added_p50_us")),
            cell(l.get("added_p99_us")),
            cell(l.get("budget_us"))
        );
    } else {
        let _ = writeln!(out, "| skipped: {} | | | | | |", cell(l.get("reason")));
    }

    let _ = writeln!(out, "\n| ratio (same run) | value |");
    let _ = writeln!(out, "|---|---:|");
    if let Some(Value::Object(r)) = report.get("ratios") {
        for (scenario, v) in r {
            if let Value::Object(m) = v {
                for (k, v) in m {
                    let _ = writeln!(out, "| {scenario}.{k} | {} |", cell(Some(v)));
                }
            }
        }
    }

    let _ = writeln!(out, "\n| target | value | limit | met |");
    let _ = writeln!(out, "|---|---:|---:|:---:|");
    if let Some(Value::Array(ts)) = report.get("targets") {
        for t in ts {
            let met = match t.get("met").and_then(Value::as_bool) {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "not measured",
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} {} | {met} |",
                cell(t.get("target")),
                cell(t.get("value")),
                cell(t.get("comparison")),
                cell(t.get("limit"))
            );
        }
    }
    out
}
