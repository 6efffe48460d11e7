//! The `zookeeper` scenario, on one standalone ZooKeeper server
//! (`dlock_tests::zookeeper_server`):
//!
//! * uncontended lock/unlock pairs per second, dlock's ZooKeeper backend (`try_acquire` +
//!   `release`) against a hand-written floor over the same client crate and one session like
//!   dlock's: create an ephemeral sequential node, then delete it (the two writes any
//!   ZooKeeper lock costs; dlock's try also lists the lock's children to see whether its node
//!   is the lowest, a third round trip) and against the classic recipe below written by hand,
//!   uncontended (create, list, delete);
//! * contended: [`contended::TASKS`] tasks on one key holding it [`contended::HOLD`] — dlock
//!   with `OnFail::retry` (fair queue, predecessor watch) against a hand-written lock of the
//!   classic recipe on the same session (create an ephemeral sequential child, list, watch
//!   only the predecessor, list again when it goes): critical sections per second, handoff
//!   p50/p99, fairness.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use zookeeper_client::{Acls, Client, CreateMode};

use crate::contended;
use crate::etcd::{contended_dlock, contended_json, dlock_pair, interleaved, pair_fn};
use crate::{BenchError, Plan};

/// A node name's sequence (`…-0000000042` → 42).
fn sequence(name: &str) -> u64 {
    name.rsplit('-')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX)
}

/// The hand-written lock: an ephemeral sequential child of `dir`; the lowest holds; a waiter
/// watches only its predecessor. Returns the own node's path once it holds.
async fn recipe_lock(c: &Client, dir: &str) -> Result<String, BenchError> {
    let opts = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
    let (_, seq) = c.create(&format!("{dir}/n-"), &[], &opts).await?;
    let own = format!("n-{seq}");
    loop {
        let mut kids = c.list_children(dir).await?;
        kids.sort_by_key(|k| sequence(k));
        let at = kids
            .iter()
            .position(|k| *k == own)
            .ok_or("recipe: own node gone")?;
        if at == 0 {
            return Ok(format!("{dir}/{own}"));
        }
        let pred = format!("{dir}/{}", kids[at - 1]);
        if let (Some(_), watcher) = c.check_and_watch_stat(&pred).await? {
            watcher.changed().await;
        }
    }
}

/// The scenario's JSON: pairs per second of each driver, and the contended figures.
pub(crate) async fn run(plan: &Plan) -> Result<Value, BenchError> {
    // On a thread that outlives the scenario: the server dies with the thread that started it
    // (`setpriv --pdeathsig`), and tokio retires idle blocking threads after 10 s.
    let server = tokio::task::spawn_blocking(|| {
        dlock_tests::redis_server::on_owner_thread(
            "zk-bench",
            dlock_tests::zookeeper_server::ZkEnsemble::start,
        )
    })
    .await?;
    let url = server.url();
    let hosts = url.trim_start_matches("zk://").to_owned();
    let client = Client::connector()
        .with_session_timeout(Duration::from_secs(30))
        .connect(&hosts)
        .await?;
    let persistent = CreateMode::Persistent.with_acls(Acls::anyone_all());
    for dir in ["/floor", "/recipe"] {
        client.create(dir, &[], &persistent).await?;
    }
    for t in 0..crate::etcd::TASKS {
        client
            .create(&format!("/floor/{t}"), &[], &persistent)
            .await?;
    }

    let c = Arc::new(client.clone());
    let bare = pair_fn(move |t, _| {
        let c = c.clone();
        async move {
            let opts = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
            let (_, seq) = c.create(&format!("/floor/{t}/n-"), &[], &opts).await?;
            c.delete(&format!("/floor/{t}/n-{seq}"), None).await?;
            Ok(())
        }
    });
    let c = Arc::new(client.clone());
    let recipe = pair_fn(move |t, _| {
        let c = c.clone();
        async move {
            let own = recipe_lock(&c, &format!("/floor/{t}")).await?;
            c.delete(&own, None).await?;
            Ok(())
        }
    });
    let dlock = dlock_pair(dlock_runtime::Locker::from_url(&url).await?);
    let [dlock, bare, recipe] = interleaved(plan, [dlock, bare, recipe]).await?;

    let contended_dlock = contended_dlock(plan, &url).await?;
    let c = Arc::new(client.clone());
    let contended_recipe = contended::run_with(
        plan,
        {
            let c = c.clone();
            move |_| {
                let c = c.clone();
                async move { recipe_lock(&c, "/recipe").await }
            }
        },
        move |_, own: String| {
            let c = c.clone();
            async move {
                c.delete(&own, None).await?;
                Ok(())
            }
        },
    )
    .await?;
    drop(client);
    drop(server);
    Ok(json!({
        "tasks": crate::etcd::TASKS,
        "dlock": dlock.json(),
        "bare_create_delete": bare.json(),
        "recipe": recipe.json(),
        "contended": {
            "tasks": contended::TASKS,
            "dlock": contended_json(&contended_dlock),
            "recipe": contended_json(&contended_recipe),
        },
    }))
}
