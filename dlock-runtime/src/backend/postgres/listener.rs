//! The `LISTEN` connection: one per backend, on one channel, feeding the [`ReleaseHub`].
//!
//! Payloads (sent by `pg_notify` in the functions of `schema`, delivered after the releasing
//! transaction committed): `<lock name>\t<waiter token>\t<fencing token>` when a release handed
//! the lock to that waiter (which is woken, not handed the grant: see [`deliver`]),
//! `<lock name>\t` to wake one barging waiter. Before a session counts as listening, it asks
//! whether it hears what other sessions send: a notification sent through the backend's pool
//! (as a release's is) to a channel only this session listens on must come within the connect
//! plus command timeout. One that does not — the session goes through PgBouncer in
//! transaction pooling, which hands `LISTEN` and the notifications to server connections the
//! session does not keep, or `notify_url` names another database — is logged (`WARN`, with
//! the fix) and made again after 30 s; meanwhile `is_listening` says `false` and waiters run
//! on their timers. Before, such a session said it listened and heard nothing. Once a session
//! of the task heard its probe, the set-up delivers: a later probe unheard in time (a database
//! too busy) is a lost connection, made again with the usual backoff.
//!
//! The task reconnects with backoff when the connection drops, or when it does not answer an
//! empty query within the connect plus command timeout (asked once per that interval, at most
//! hourly: a peer gone silent is found in two). Each time `LISTEN` is active — the first time
//! too — it wakes every local waiter once: notifications sent while it was down were missed,
//! and the backend's `watch` answers at once without waiting for `LISTEN`, so a waiter
//! registered meanwhile may have missed a release. It ends when the backend is dropped. It
//! starts on the runtime the backend is connected on and moves to the fallback thread if that
//! runtime shuts down first ([`Task`]).

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt as _;
use tokio::sync::watch;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, NoTls, Socket};

use super::{Connector, Inner, PostgresBackend};
use crate::backend::ReleaseHub;

/// Starts the task; the receiver tells whether `LISTEN` is active, and dropping every receiver
/// ends the task.
pub(super) fn spawn(
    config: tokio_postgres::Config,
    connector: Connector,
    channel: String,
    hub: Weak<ReleaseHub>,
    backend: Weak<Inner>,
    limit: Duration,
) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(run(Task {
        config,
        connector,
        channel,
        hub,
        backend,
        limit,
        up: Some(tx),
    }));
    rx
}

/// What the task runs on. Dropped while it runs — the runtime running it shut down (an
/// actix-web worker restarting, a runtime built for set-up and dropped) while the backend lives
/// on — it starts the task again on the fallback runtime, which then wakes every local waiter
/// once `LISTEN` is back (as every session does: notifications meanwhile were missed). Before,
/// the task was gone for good: waiters on other runtimes heard of other processes' releases
/// only by their timers.
struct Task {
    config: tokio_postgres::Config,
    connector: Connector,
    channel: String,
    hub: Weak<ReleaseHub>,
    /// The backend, whose pool sends the probe (see the module docs).
    backend: Weak<Inner>,
    limit: Duration,
    /// `None` once the task returned.
    up: Option<watch::Sender<bool>>,
}

impl Drop for Task {
    fn drop(&mut self) {
        let Some(up) = self.up.take() else { return };
        if self.hub.strong_count() == 0 || up.is_closed() {
            return;
        }
        up.send_replace(false);
        let Some(rt) = crate::util::fallback_runtime() else {
            tracing::warn!("postgres LISTEN task gone with its runtime; waiters run on timers");
            return;
        };
        tracing::debug!("postgres LISTEN task moves to the fallback thread: its runtime shut down");
        rt.spawn(run(Task {
            config: self.config.clone(),
            connector: self.connector.clone(),
            channel: std::mem::take(&mut self.channel),
            hub: self.hub.clone(),
            backend: self.backend.clone(),
            limit: self.limit,
            up: Some(up),
        }));
    }
}

/// The pause before reconnecting `LISTEN`: the shortest (20 ms) after the first drop and
/// after a session that listened for a while (1 s) — a healthy one —, else the last pause
/// doubled, up to 1 s. Before, it kept doubling over the life of the process, and every
/// reconnect after a few drops waited 1 s; a session dropped as soon as it listens keeps
/// doubling, so a server that ends each session is not asked again every 20 ms.
fn reconnect_pause(last: Option<Duration>, listened_for: Option<Duration>) -> Duration {
    const FIRST: Duration = Duration::from_millis(20);
    const LONGEST: Duration = Duration::from_secs(1);
    match last {
        Some(last) if listened_for.is_none_or(|d| d < LONGEST) => (last * 2).min(LONGEST),
        _ => FIRST,
    }
}

/// The pause before a session found deaf (see the module docs) is made again: its cause is the
/// set-up, which a reconnect every second would not change.
const DEAF_PAUSE: Duration = Duration::from_secs(30);

/// How a session ended.
enum Ended {
    /// The connection failed, or did not answer.
    Lost,
    /// It listened, and did not hear the probe sent to it.
    Deaf,
}

async fn run(mut task: Task) {
    let mut pause = None;
    // Whether a session of this task heard its probe (see `Ended::Deaf`).
    let mut heard_once = false;
    let Task {
        config,
        connector,
        channel,
        hub,
        backend,
        limit,
        ..
    } = &task;
    let Some(up) = task.up.as_ref() else { return };
    let ears = Ears {
        channel,
        probe: format!("dlock_probe_{}", crate::util::secure_token::<8>()),
        hub,
        backend,
        limit: *limit,
    };
    loop {
        let began = tokio::time::Instant::now();
        let ended = tokio::select! {
            _ = up.closed() => break,
            ended = async {
                match connector {
                    Connector::Plain => session(config, NoTls, &ears, up).await,
                    #[cfg(feature = "postgres-tls")]
                    Connector::Tls(t) => session(config, t.clone(), &ears, up).await,
                }
            } => ended,
        };
        let listened_for = up.send_replace(false).then(|| began.elapsed());
        heard_once |= listened_for.is_some();
        if hub.strong_count() == 0 {
            break;
        }
        let next = match ended {
            Ended::Lost => {
                tracing::warn!("postgres LISTEN connection lost; reconnecting");
                reconnect_pause(pause, listened_for)
            }
            // Once heard, the set-up delivers: a probe unheard later came too late (a
            // database too busy, just restarted), and waiting 30 s would leave waiters on their
            // timers for nothing.
            Ended::Deaf if heard_once => {
                tracing::warn!(
                    "postgres LISTEN session did not hear its probe in time; reconnecting"
                );
                reconnect_pause(pause, listened_for)
            }
            Ended::Deaf => {
                tracing::warn!(
                    "postgres LISTEN session does not hear notifications sent through the \
                     pool (through PgBouncer in transaction pooling? a notify_url naming \
                     another database?): waiters run on their timers; give the backend a \
                     direct notify_url, or turn notifications off; asking again in {:?}",
                    DEAF_PAUSE
                );
                DEAF_PAUSE
            }
        };
        pause = Some(next);
        tokio::select! {
            _ = up.closed() => break,
            _ = tokio::time::sleep(next) => {}
        }
    }
    task.up = None;
}

/// What a session listens on and reports to.
struct Ears<'a> {
    channel: &'a str,
    /// The channel only this task's sessions listen on (see the module docs).
    probe: String,
    hub: &'a Weak<ReleaseHub>,
    backend: &'a Weak<Inner>,
    limit: Duration,
}

impl Ears<'_> {
    /// Dispatches what comes on the connection until `fut` ends (`Err` if the connection ends
    /// first), noting in `heard` a notification on the probe channel — and, `until_heard`,
    /// ending there (`Ok(None)`).
    async fn pump<F: std::future::Future>(
        &self,
        messages: &mut (impl futures_util::Stream<Item = Result<AsyncMessage, tokio_postgres::Error>>
                  + Unpin),
        heard: &mut bool,
        until_heard: bool,
        fut: F,
    ) -> Result<Option<F::Output>, ()> {
        tokio::pin!(fut);
        loop {
            tokio::select! {
                r = &mut fut => return Ok(Some(r)),
                m = messages.next() => match m {
                    Some(Ok(AsyncMessage::Notification(n))) if n.channel() == self.probe => {
                        *heard = true;
                        if until_heard {
                            return Ok(None);
                        }
                    }
                    Some(Ok(m)) => dispatch(self.hub, m),
                    _ => return Err(()),
                },
            }
        }
    }

    /// Sends the probe through the backend's pool.
    async fn send_probe(&self) -> bool {
        let Some(inner) = self.backend.upgrade() else {
            return false;
        };
        let backend = PostgresBackend { inner };
        let sql = format!("NOTIFY \"{}\"", self.probe);
        backend.call("listen probe", &sql, &[]).await.is_ok()
    }
}

/// One connection's life: connect, `LISTEN`, ask whether it hears other sessions, dispatch
/// until it fails.
async fn session<T>(
    config: &tokio_postgres::Config,
    tls: T,
    ears: &Ears<'_>,
    up: &watch::Sender<bool>,
) -> Ended
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let limit = ears.limit;
    let Ok(Ok((client, mut conn))) = tokio::time::timeout(limit, config.connect(tls)).await else {
        return Ended::Lost;
    };
    let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
    let mut heard = false;
    let listen = format!("LISTEN \"{}\"; LISTEN \"{}\"", ears.channel, ears.probe);
    let listen = tokio::time::timeout(limit, client.batch_execute(&listen));
    let Ok(Some(Ok(Ok(())))) = ears.pump(&mut messages, &mut heard, false, listen).await else {
        return Ended::Lost;
    };
    // The probe is heard within the limit after its sending was answered (a release's
    // notification, too, may come after the releasing statement's answer).
    let Ok(Some(true)) = ears
        .pump(&mut messages, &mut heard, false, ears.send_probe())
        .await
    else {
        return Ended::Lost;
    };
    if !heard {
        let wait = tokio::time::sleep(limit);
        match ears.pump(&mut messages, &mut heard, true, wait).await {
            Err(()) => return Ended::Lost,
            Ok(_) if heard => {}
            Ok(_) => {
                if let Some(inner) = ears.backend.upgrade() {
                    (inner.probes_unheard).fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                return Ended::Deaf;
            }
        }
    }
    up.send_replace(true);
    // Every waiter registered now may have missed a release while LISTEN was down or not yet
    // up (a watch does not wait for it): each asks once more. None, mostly, the first time.
    if let Some(hub) = ears.hub.upgrade() {
        hub.notify_all();
        tracing::debug!("postgres LISTEN up; local waiters woken to re-check");
    }
    // A connection whose peer vanished without a word (a partition, a middlebox that forgot
    // it) stays open and silent for as long as TCP keepalive lets it — hours by default —
    // while its notifications go nowhere. One empty query every `limit` tells: unanswered
    // within `limit`, the connection is taken for dead and made again. At most every hour:
    // the timeouts may be `Duration::MAX` ("none"), and `Instant + Duration::MAX` panics (as
    // does a zero period).
    let every = limit.clamp(Duration::from_millis(1), Duration::from_secs(3600));
    let mut check = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if ears
            .pump(&mut messages, &mut heard, false, check.tick())
            .await
            .is_err()
        {
            return Ended::Lost;
        }
        let ping = tokio::time::timeout(limit, client.batch_execute(""));
        let Ok(Some(Ok(Ok(())))) = ears.pump(&mut messages, &mut heard, false, ping).await else {
            tracing::warn!("postgres LISTEN connection did not answer within {limit:?}");
            return Ended::Lost;
        };
    }
}

fn dispatch(hub: &Weak<ReleaseHub>, message: AsyncMessage) {
    let AsyncMessage::Notification(n) = message else {
        return;
    };
    let Some(hub) = hub.upgrade() else { return };
    deliver(&hub, n.payload());
}

/// Hands one payload to the hub: `<name>\t<waiter token>[\t<fencing token>]` wakes that waiter,
/// `<name>\t` the first local one.
///
/// A handoff's fencing token is not passed on as a grant ([`ReleaseHub::hand_over`]): the
/// notification comes on this connection, not in order with the answers to the waiter's
/// attempts, so it may come after an attempt that found the handed-over lease lapsed and the
/// lock another's — counted from that attempt, the lease would outlast the real one. Woken,
/// the waiter asks, and an attempt by the token the lock was handed to is granted it.
pub(super) fn deliver(hub: &Arc<ReleaseHub>, payload: &str) {
    let mut parts = payload.splitn(3, '\t');
    let (Some(name), Some(token)) = (parts.next(), parts.next()) else {
        return;
    };
    hub.notify(name, Some(token).filter(|t| !t.is_empty()));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::OwnerToken;
    use crate::key::ResourceName;
    use crate::LockKey;
    use futures_util::FutureExt as _;

    #[test]
    fn a_healthy_session_resets_the_reconnect_pause() {
        let ms = Duration::from_millis;
        let mut last = None;
        let mut pauses = Vec::new();
        // Drops of sessions that never listened: 20 ms doubling up to 1 s.
        for _ in 0..7 {
            let p = reconnect_pause(last, None);
            pauses.push(p.as_millis());
            last = Some(p);
        }
        assert_eq!(pauses, [20, 40, 80, 160, 320, 640, 1000]);
        // Dropped after listening for a minute: back to the shortest.
        assert_eq!(reconnect_pause(last, Some(Duration::from_secs(60))), ms(20));
        // Dropped as soon as it listened: still doubling (and capped).
        assert_eq!(reconnect_pause(last, Some(ms(5))), ms(1000));
        assert_eq!(reconnect_pause(Some(ms(80)), Some(ms(5))), ms(160));
    }

    #[test]
    fn payloads_wake_the_named_waiter() {
        let hub = ReleaseHub::new();
        let res = ResourceName::new("p", LockKey::new("k").unwrap());
        let (t1, t2) = (OwnerToken::generate(), OwnerToken::generate());
        let (w1, _) = hub.register(&res, &t1, None);
        let (w2, _) = hub.register(&res, &t2, None);
        deliver(&hub, &format!("{}\t{}\t42", res.as_str(), t2.as_str()));
        assert!(w2.notified().now_or_never().is_some());
        assert_eq!(w2.take_handoff(), None, "a wake-up, not a grant");
        assert!(
            w1.notified().now_or_never().is_none(),
            "only the named waiter"
        );
        // A barging wake-up names nobody: the first local waiter when none barges ...
        deliver(&hub, &format!("{}\t", res.as_str()));
        assert!(w1.notified().now_or_never().is_some());
        assert!(w2.notified().now_or_never().is_none());
        assert_eq!(w1.take_handoff(), None);
        // ... else every barging one, and no other.
        w2.set_barging();
        deliver(&hub, &format!("{}\t", res.as_str()));
        assert!(w2.notified().now_or_never().is_some());
        assert!(w1.notified().now_or_never().is_none());
        // Another lock's release, or garbage, wakes nobody.
        deliver(&hub, "p:{other}\tx\t1");
        deliver(&hub, "garbage");
        assert!(w1.notified().now_or_never().is_none());
        assert!(w2.notified().now_or_never().is_none());
    }
}
