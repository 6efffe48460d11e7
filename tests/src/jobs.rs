//! A durable job for the defer tests: it records each run in Redis (a separate key space from
//! the queue's), and can be told to hang on its first attempt, as a worker that is killed
//! mid-job would.

use dlock_runtime::defer::{Job, JobContext, JobError};
use dlock_runtime::{LockError, LockKey};
use serde::{Deserialize, Serialize};

/// Records `started`/`done` for job `id` in the Redis at `record_url`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RecordJob {
    /// Which job.
    pub id: u32,
    /// The lock it needs: `record:<lock>`.
    pub lock: String,
    /// Where to record runs.
    pub record_url: String,
    /// Hang forever on attempt 1 (the worker running it is about to be killed).
    pub hang_first: bool,
    /// Fail (return an error) on every attempt.
    pub always_fail: bool,
}

impl Job for RecordJob {
    const NAME: &'static str = "record";

    fn lock_key(&self) -> Result<LockKey, LockError> {
        LockKey::builder().lit("record:").value(&self.lock).finish()
    }

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        use redis::AsyncCommands as _;
        let client = redis::Client::open(self.record_url.as_str())?;
        let mut c = client.get_multiplexed_async_connection().await?;
        let _: () = c.sadd("started", self.id).await?;
        if self.hang_first && ctx.attempt() == 1 {
            std::future::pending::<()>().await;
        }
        if self.always_fail {
            return Err("this job always fails".into());
        }
        let _: () = c
            .hset(
                "done",
                self.id,
                format!("{}:{}", ctx.attempt(), ctx.fencing_token()),
            )
            .await?;
        ctx.set_result(format!("done {}", self.id));
        Ok(())
    }
}
