//! A durable-queue worker in its own OS process, for the crash test: it runs [`RecordJob`]s
//! from queue `<queue>` until killed.
//!
//! Usage: `dlock-job-worker <redis-url> <queue> <visibility-ms>`.

use std::time::Duration;

use dlock_runtime::durable::{DurableQueue, DurableWorker};
use dlock_runtime::Locker;
use dlock_tests::jobs::RecordJob;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, queue, visibility] = args.as_slice() else {
        eprintln!("usage: dlock-job-worker <redis-url> <queue> <visibility-ms>");
        std::process::exit(2);
    };
    let visibility = Duration::from_millis(visibility.parse().expect("visibility-ms"));
    let queue = DurableQueue::connect_with(url, queue, visibility, Duration::from_secs(600))
        .await
        .expect("queue");
    let locker = Locker::from_url(url).await.expect("locker");
    DurableWorker::new(queue, locker)
        .register::<RecordJob>()
        .poll_interval(Duration::from_millis(20))
        .run_until(std::future::pending())
        .await;
}
