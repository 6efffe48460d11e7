//! Statements in flight: what happens to a pooled connection, and to an owner token's gate,
//! when the caller stops waiting for a statement it sent.
//!
//! Giving up on a reply does not stop the statement: it was sent, it sits in the server's
//! socket buffer or runs (waiting on an advisory lock, say), and it still commits. Two things
//! must not follow from that:
//!
//! * **The connection must not go back to the pool busy.** The next call handed it would queue
//!   behind the abandoned statement, invisibly to its own deadline, and — for an acquire —
//!   commit a grant long after its caller gave up and its undo ran on another connection. So
//!   an [`InFlight`] dropped before its statement answered *detaches* the connection from the
//!   pool (deadpool's `Object::take`; the pool makes a new one when it needs it) and hands it to
//!   a drain task. (Returning it once the statement finished would not do either: the cancel
//!   request below may arrive late and cancel a stranger's statement.)
//! * **The owner token's gate must stay closed until the statement has ended.** The gate (see
//!   [`PostgresBackend::gated`](super::PostgresBackend::gated)) orders an acquire's undo after
//!   the acquire. The drain task keeps it closed until the abandoned statement is over, so the
//!   undo lands after any late grant and finds it.
//!
//! **The drain task** sends a cancel request (tokio-postgres's `CancelToken`, over the same TLS
//! as the pool when the backend made the pool; best-effort: it may arrive after the statement
//! ended, which is harmless on a connection nobody else uses) and queues an empty query on the
//! connection: its answer comes after the abandoned statement's end (responses are in order,
//! also through PgBouncer), and an error means the connection is gone. Then the connection is
//! closed and the gate opens. Closing the socket alone would not be enough: a statement already
//! in the server's buffer still runs. The wait is bounded by [`drain_limit`] (a server that
//! neither answers the cancel nor the query for that long is hung); past it the gate opens
//! anyway and a grant that still commits later lives until its lease ends, as after a crash.
//! A connection that breaks meanwhile (a reset, PgBouncer restarted) says nothing of its
//! statement, which the server runs to its end: the gate then stays closed for the whole
//! bound.
//!
//! **A drained connection still counts against the pool.** A call takes one of the backend's
//! slots (as many as the pool's connections) before it takes a connection, and a drain keeps
//! that slot until the connection is closed; so does a connection being made, until it is made
//! — also when its caller gave up on it, as it is then made to its end and goes to the pool
//! for the next call. The pool makes a connection only when it has no idle one, so the
//! connections in use, idle, being made and being drained never exceed the pool's size (with
//! [`from_pool`](super::PostgresBackend::from_pool), the slots are the pool's size when the
//! backend was made, and the application's own use of the pool comes on top): when a database
//! is too slow for the command timeout, every call timing out, calls wait for a slot (and time
//! out as unavailable) instead of each opening a new connection beside the ones still draining
//! — up to eleven times the pool's connections per process before.
//!
//! The hot path pays no extra round trip for this: a flag cleared when the answer is in, an
//! uncontended semaphore permit and the task that takes the connection from the pool (see
//! `PostgresBackend::pooled`).

use std::sync::{Arc, Weak};
use std::time::Duration;

use deadpool_postgres::{ClientWrapper, Object};
use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio_postgres::{CancelToken, NoTls};

use super::connecting::Slot;
use super::{Connector, Inner};
use crate::backend::OwnerToken;

/// How long a drain task waits for an abandoned statement to end: ten command timeouts,
/// within 1 s and 60 s.
pub(super) fn drain_limit(command_timeout: Duration) -> Duration {
    command_timeout
        .saturating_mul(10)
        .clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// A hold on an owner token's gate (closed while this lives); dropping it opens the gate and
/// forgets the gate when nobody else holds or waits on it.
pub(super) struct Gate {
    inner: Weak<Inner>,
    token: OwnerToken,
    gate: Arc<Mutex<()>>,
    held: Option<OwnedMutexGuard<()>>,
}

impl Gate {
    /// Waits for `token`'s gate and closes it.
    pub(super) async fn close(inner: &Arc<Inner>, token: &OwnerToken) -> Gate {
        let gate = inner
            .gates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(token.clone())
            .or_default()
            .clone();
        let mut hold = Gate {
            inner: Arc::downgrade(inner),
            token: token.clone(),
            gate,
            held: None,
        };
        // Dropped while waiting: `hold` still forgets the gate if nobody else has it.
        hold.held = Some(hold.gate.clone().lock_owned().await);
        hold
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.held = None;
        let Some(inner) = self.inner.upgrade() else {
            return;
        };
        let mut gates = inner
            .gates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Only the map and this hold refer to it (clones are made under the map's lock).
        if Arc::strong_count(&self.gate) == 2 {
            gates.remove(&self.token);
        }
    }
}

/// A pooled connection and the backend's slot it takes (see the module docs).
pub(super) struct Pooled {
    // Dropped in this order: the connection goes back to the pool before the slot says so.
    pub(super) client: Object,
    pub(super) slot: Slot,
}

/// A pooled connection with a statement (or a transaction) in flight, and the gate that must
/// stay closed while it runs. [`done`](InFlight::done) when the answer is in; dropped before,
/// the connection never returns to the pool and is drained (see the module docs).
pub(super) struct InFlight {
    client: Option<Pooled>,
    gate: Option<Gate>,
    cancel: Option<Connector>,
    limit: Duration,
}

impl InFlight {
    pub(super) fn new(
        client: Pooled,
        gate: Option<Gate>,
        cancel: Option<Connector>,
        limit: Duration,
    ) -> Self {
        InFlight {
            client: Some(client),
            gate,
            cancel,
            limit,
        }
    }

    /// The connection.
    pub(super) fn client(&mut self) -> &mut ClientWrapper {
        &mut self.client.as_mut().expect("in flight until done").client
    }

    /// The answer is in: the connection goes back to the pool and the gate opens.
    pub(super) fn done(&mut self) {
        self.client = None;
        self.gate = None;
    }

    /// The answer is in, but the connection is not fit for the pool (a failed multi-statement
    /// batch may have left it inside an aborted transaction, where every statement fails
    /// until a `ROLLBACK`): it is closed, and the gate opens.
    pub(super) fn discard(&mut self) {
        if let Some(pooled) = self.client.take() {
            drop(Object::take(pooled.client));
        }
        self.gate = None;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(Pooled { client, slot }) = self.client.take() else {
            return;
        };
        let client = Object::take(client);
        let gate = self.gate.take();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(drain(client, gate, self.cancel.take(), self.limit, slot));
            }
            // No runtime: the connection task is gone with it; nothing can be awaited.
            Err(_) => drop((client, gate, slot)),
        }
    }
}

/// Cancels what runs on `client`, waits (at most `limit`) until everything sent on it has
/// ended, then closes it, opens `gate` and gives its `slot` back.
async fn drain(
    client: ClientWrapper,
    gate: Option<Gate>,
    cancel: Option<Connector>,
    limit: Duration,
    slot: Slot,
) {
    let token = client.cancel_token();
    let until = tokio::time::Instant::now() + limit;
    tokio::spawn(tokio::time::timeout(limit, send_cancel(token, cancel)));
    // Answered after every statement sent before it; an error: cancelled (after the end of
    // the one before) or the connection is gone.
    match tokio::time::timeout_at(until, client.batch_execute("")).await {
        Ok(Err(e)) if e.is_closed() => {
            // The connection is gone, not the statement: the server runs it to its end (a
            // session notices a vanished client only when it next talks to it, and PgBouncer
            // waits for the server's transaction), and it may still commit a grant. The gate
            // stays closed as long as a drain would have waited; the connection and its slot
            // go now.
            drop((client, slot));
            if gate.is_some() {
                tokio::time::sleep_until(until).await;
            }
            drop(gate);
            return;
        }
        Ok(_) => {}
        Err(_) => tracing::warn!(
            ?limit,
            "postgres: a timed-out statement neither ended nor was cancelled in time; \
             closing its connection"
        ),
    }
    drop(client);
    drop(gate);
    drop(slot);
}

async fn send_cancel(token: CancelToken, cancel: Option<Connector>) {
    let sent = match cancel {
        None | Some(Connector::Plain) => token.cancel_query(NoTls).await,
        #[cfg(feature = "postgres-tls")]
        Some(Connector::Tls(tls)) => token.cancel_query(tls).await,
    };
    if let Err(e) = sent {
        tracing::debug!(error = %e, "postgres cancel request not sent");
    }
}
