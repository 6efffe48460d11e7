// Methods: `&self` and `&mut self` receivers, `<self.field>` placeholders, a `self` that the body
// uses after the key was built, and a trait's default method.

use dlock_runtime::{distributed_lock, LockError};

struct Reports {
    tenant: String,
    built: u32,
}

impl Reports {
    #[distributed_lock(key = "report:<self.tenant>:<day>", ttl = "10m")]
    async fn build(&self, day: u32) -> String {
        format!("{}-{day}", self.tenant)
    }

    #[distributed_lock(key = "report:<self.tenant>:count")]
    async fn bump(&mut self) -> Result<u32, LockError> {
        self.built += 1;
        Ok(self.built)
    }

    #[distributed_lock(key = "report:<self.tenant>:<other.tenant>")]
    pub(crate) async fn merge(&mut self, other: Reports) {
        self.built += other.built;
    }
}

trait Job {
    fn name(&self) -> &str;

    #[distributed_lock(key = "job:<id>")]
    async fn run(&self, id: u64) -> String {
        format!("{}:{id}", self.name())
    }
}

impl Job for Reports {
    fn name(&self) -> &str {
        &self.tenant
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _previous = dlock_runtime::set_default_locker(dlock_runtime::Locker::memory());
    let mut reports = Reports {
        tenant: "acme".to_owned(),
        built: 0,
    };
    assert_eq!(reports.build(3).await.unwrap(), "acme-3");
    assert_eq!(reports.bump().await.unwrap(), 1);
    let other = Reports {
        tenant: "other".to_owned(),
        built: 2,
    };
    reports.merge(other).await.unwrap();
    assert_eq!(reports.built, 3);
    assert_eq!(reports.run(9).await.unwrap(), "acme:9");
}
