//! The short test of the fault harness: runs `dlock-torture --smoke` (2 worker processes × 4
//! tasks on 2 keys, TTL 500 ms, every fault kind that applies once against one Redis server,
//! Redlock over five, one PostgreSQL and a Redis Cluster of 3 masters and 3 replicas, about
//! 55 s) and checks its verdict and summary line.
//!
//! The full `--quick` run (about five minutes) is CI's job, not `cargo test`'s: `scripts/test`
//! runs the debug build that `cargo test` made, `target/debug/dlock-torture --quick`.

use std::process::Command;

fn field<'a>(summary: &'a str, name: &str) -> Option<&'a str> {
    summary
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
}

#[test]
fn smoke_run_passes_with_no_stale_write_and_no_lock_left() {
    let out = Command::new(env!("CARGO_BIN_EXE_dlock-torture"))
        .arg("--smoke")
        .output()
        .expect("run dlock-torture");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let summary = stdout.lines().last().unwrap_or_default();
    assert!(
        out.status.success(),
        "dlock-torture --smoke failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(summary.starts_with("summary: "), "last line: {summary}");
    for (name, want) in [
        ("result", "pass"),
        ("backends", "redis,redlock,postgres,cluster,sentinel"),
        ("stale_writes_accepted", "0"),
        ("locks_left", "0"),
        ("token_reuse", "0"),
        ("worker_crashes", "0"),
    ] {
        assert_eq!(field(summary, name), Some(want), "{name} in: {summary}");
    }
    let cs: u64 = field(summary, "cs").unwrap().parse().unwrap();
    assert!(cs > 0, "no critical section completed: {summary}");
    let stall: u64 = field(summary, "max_stall_ms").unwrap().parse().unwrap();
    let bound: u64 = field(summary, "stall_bound_ms").unwrap().parse().unwrap();
    assert!(stall <= bound, "{summary}");
}
