//! The `LISTEN` connection: one per backend, on one channel, feeding the [`ReleaseHub`].
//!
//! Payloads (sent by `pg_notify` in the functions of `schema`, delivered after the releasing
//! transaction committed): `<lock name>\t<waiter token>\t<fencing token>` when a release handed
//! the lock to that waiter, `<lock name>\t` to wake one barging waiter. The task reconnects with
//! backoff when the connection drops and then wakes every local waiter once (notifications sent
//! meanwhile were missed); it ends when the backend is dropped.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt as _;
use tokio::sync::watch;
use tokio_postgres::{AsyncMessage, NoTls};

use crate::backend::ReleaseHub;

/// Starts the task; the receiver tells whether `LISTEN` is active, and dropping every receiver
/// ends the task.
pub(super) fn spawn(
    config: tokio_postgres::Config,
    channel: String,
    hub: Weak<ReleaseHub>,
    limit: Duration,
) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(run(config, channel, hub, limit, tx));
    rx
}

async fn run(
    config: tokio_postgres::Config,
    channel: String,
    hub: Weak<ReleaseHub>,
    limit: Duration,
    up: watch::Sender<bool>,
) {
    let mut pause = Duration::from_millis(20);
    let mut missed = false;
    loop {
        tokio::select! {
            _ = up.closed() => return,
            _ = session(&config, &channel, &hub, limit, &up, missed) => {}
        }
        up.send_replace(false);
        if hub.strong_count() == 0 {
            return;
        }
        missed = true;
        tracing::warn!("postgres LISTEN connection lost; reconnecting");
        tokio::select! {
            _ = up.closed() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// One connection's life: connect, `LISTEN`, dispatch until it fails.
async fn session(
    config: &tokio_postgres::Config,
    channel: &str,
    hub: &Weak<ReleaseHub>,
    limit: Duration,
    up: &watch::Sender<bool>,
    missed: bool,
) {
    let Ok(Ok((client, mut conn))) = tokio::time::timeout(limit, config.connect(NoTls)).await
    else {
        return;
    };
    let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
    let listen = format!("LISTEN \"{channel}\"");
    let listened = {
        let listen = tokio::time::timeout(limit, client.batch_execute(&listen));
        tokio::pin!(listen);
        loop {
            tokio::select! {
                r = &mut listen => break matches!(r, Ok(Ok(()))),
                m = messages.next() => match m {
                    Some(Ok(m)) => dispatch(hub, m),
                    _ => return,
                },
            }
        }
    };
    if !listened {
        return;
    }
    up.send_replace(true);
    if missed {
        if let Some(hub) = hub.upgrade() {
            hub.notify_all();
            tracing::debug!("postgres LISTEN back; local waiters woken to re-check");
        }
    }
    while let Some(Ok(m)) = messages.next().await {
        dispatch(hub, m);
    }
    drop(client);
}

fn dispatch(hub: &Weak<ReleaseHub>, message: AsyncMessage) {
    let AsyncMessage::Notification(n) = message else {
        return;
    };
    let Some(hub) = hub.upgrade() else { return };
    deliver(&hub, n.payload());
}

/// Hands one payload to the hub.
pub(super) fn deliver(hub: &Arc<ReleaseHub>, payload: &str) {
    let mut parts = payload.splitn(3, '\t');
    let (Some(name), Some(token)) = (parts.next(), parts.next()) else {
        return;
    };
    if token.is_empty() {
        hub.notify(name, None);
        return;
    }
    match parts.next().and_then(|f| f.parse::<u64>().ok()) {
        Some(fence) if fence > 0 => hub.hand_over(name, token, fence),
        _ => hub.notify(name, Some(token)),
    }
}
