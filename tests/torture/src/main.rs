//! `dlock-torture`: a Jepsen-style fault harness for dlock.
//!
//! Several worker **processes** contend on a few lock keys; inside each critical section a task
//! does a read-modify-write on a **resource** that checks fencing tokens and logs every
//! operation. Meanwhile the coordinator injects faults on a seeded schedule — SIGSTOP a lock
//! holder past its TTL (the GC pause), SIGKILL a holder, restart a lock server, add latency and
//! cut connections in a TCP proxy between the workers and Redis — and afterwards reports
//! completed sections, overlaps, stale writes rejected and accepted, the longest stall after a
//! fault, and locks left held. It runs against one Redis server, against Redlock over five,
//! against one PostgreSQL, against a Redis Cluster and Sentinel whose masters it kills and
//! freezes, and against an etcd cluster and a ZooKeeper ensemble whose leaders it kills and
//! whose members it freezes (there, an overlap of two holders that were not frozen fails the
//! run).
//!
//! ```text
//! cargo run --release -p dlock-torture -- --quick     # about 5 minutes, exits non-zero on failure
//! cargo run --release -p dlock-torture                # the long mode, for release checks
//! cargo run --release -p dlock-torture -- --seed 42   # repeat a run's fault schedule
//! cargo run --release -p dlock-torture -- --quick --seed 42 --backend etcd   # one phase of it
//! ```
//!
//! The last line printed is a `summary: key=value …` line. See `tests/README.md` for what each
//! number means and the results of reference runs.
//!
//! Modules: [`coordinator`] (the default mode), [`worker`] (`dlock-torture worker …`, spawned
//! by the coordinator), `dlock_tests::proxy` (the fault-injecting TCP proxy), [`resource`] (the
//! fencing-checked resource), [`report`] (log replay and definitions), [`config`], [`rng`].

mod config;
mod coordinator;
mod report;
mod resource;
mod rng;
mod worker;

use config::{Args, Config};

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.first().map(String::as_str) == Some("worker") {
        let code = match Args::parse(&argv[1..]) {
            Ok(args) => worker::main(&args),
            Err(e) => {
                eprintln!("dlock-torture worker: {e}");
                2
            }
        };
        std::process::exit(code);
    }
    let args = match Args::parse(&argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("dlock-torture: {e}\n\n{}", config::USAGE);
            std::process::exit(2);
        }
    };
    if args.flag("help") {
        print!("{}", config::USAGE);
        return;
    }
    let cfg = match Config::from_args(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("dlock-torture: {e}\n\n{}", config::USAGE);
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = rt.block_on(coordinator::run(cfg));
    // Servers and proxies are gone (dropped with their phase); don't wait for stray tasks.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    std::process::exit(code);
}
