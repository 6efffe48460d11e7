//! A second OS process for the cross-process contention test: takes the lock many times and,
//! inside, does a non-atomic read-modify-write on a Redis counter while checking that nobody
//! else is inside.
//!
//! Usage: `dlock-contender <redis-url> <lock-key> <rounds>`. Prints `overlaps=<n> rounds=<n>`
//! and exits 0, or exits 1 with a message.

use std::time::Duration;

use dlock_runtime::{Locker, OnFail};
use redis::AsyncCommands;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, key, rounds] = args.as_slice() else {
        eprintln!("usage: dlock-contender <redis-url> <lock-key> <rounds>");
        std::process::exit(2);
    };
    let rounds: u64 = rounds.parse().expect("rounds");
    match contend(url, key, rounds, 4).await {
        Ok(overlaps) => println!("overlaps={overlaps} rounds={}", rounds * 4),
        Err(e) => {
            eprintln!("contender failed: {e}");
            std::process::exit(1);
        }
    }
}

/// `tasks` tasks × `rounds` critical sections; returns the overlaps seen.
async fn contend(url: &str, key: &str, rounds: u64, tasks: usize) -> Result<u64, String> {
    let locker = Locker::from_url(url).await.map_err(|e| e.to_string())?;
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let (locker, mut conn, key) = (locker.clone(), conn.clone(), key.to_owned());
        handles.push(tokio::spawn(async move {
            let mut overlaps = 0u64;
            for _ in 0..rounds {
                let g = locker
                    .lock(key.as_str())
                    .ttl(Duration::from_secs(10))
                    .on_fail(OnFail::retry(Duration::from_secs(60)))
                    .acquire()
                    .await
                    .map_err(|e| e.to_string())?;
                let inside: i64 = conn
                    .incr(format!("{key}:inside"), 1)
                    .await
                    .map_err(|e| e.to_string())?;
                if inside != 1 {
                    overlaps += 1;
                }
                let v: i64 = conn.get(format!("{key}:counter")).await.unwrap_or(0);
                tokio::task::yield_now().await;
                let _: () = conn
                    .set(format!("{key}:counter"), v + 1)
                    .await
                    .map_err(|e| e.to_string())?;
                let _: i64 = conn
                    .decr(format!("{key}:inside"), 1)
                    .await
                    .map_err(|e| e.to_string())?;
                g.release().await.map_err(|e| e.to_string())?;
            }
            Ok::<u64, String>(overlaps)
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await.map_err(|e| e.to_string())??;
    }
    Ok(total)
}
