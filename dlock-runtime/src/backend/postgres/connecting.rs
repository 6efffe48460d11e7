//! Making the pool's connections: a few at a time, and never waited for when a connection
//! comes back to the pool first.
//!
//! After a database restart (a failover, PgBouncer restarted) every pooled connection is gone
//! at once and every call in the next instant finds none idle. deadpool makes a connection in
//! each of those calls: a pool's worth per process against a server that has just started and
//! forks a process, authenticates and loads its caches for each, while the calls' deadlines
//! run out. Against a server that does not answer, each call sends its own connection attempt.
//!
//! So a backend that made its pool ([`PostgresBackend::connect`](super::PostgresBackend::connect))
//! makes at most [`connects_at_once`](super::PostgresOptions::connects_at_once) connections at
//! a time ([`GatedConnect`], a semaphore around the pool's connect). A call that finds no
//! idle connection while others are being made waits for whichever comes first: its turn to
//! make one, or a connection going back to the pool ([`Making::get`]). The second matters as
//! much as the first: a bound alone queued every call behind its own connection while the
//! first ones made sat idle in the pool.
//!
//! A turn is held for one connect, bounded as a whole by ten connect timeouts per host (the
//! connect timeout bounds the socket's connect; TLS, the startup message and authentication
//! come after it): a server that takes a connection and never answers does not keep a turn,
//! and a connection slow to make is still made. The pool is the backend's, but [`pool`](super::PostgresBackend::pool)
//! lends it out: a connection the application gets from it is made in a turn too, and one it
//! gives back wakes no call waiting for its turn (the call takes the connection when its turn
//! comes, finding it idle).
//!
//! Measured with the fault harness, 12 restarts per run (`CHANGELOG.md` has the commands):
//! with 12 worker processes (192 connections), the longest stall after a restart went from
//! 5.8–6.9 s to 2.5–3.2 s and the longest gap in service from 20–25 s to 3–4 s, with twice the
//! critical sections served; with 4 processes the longest stall was about the same
//! (0.48–0.57 s unbounded, 0.56–0.61 s at 2) and the median stall 0.1 s longer (0.27–0.30 s
//! against 0.38–0.42 s). A service of a few processes next to its database can raise the
//! bound to its pool's size.
//!
//! The hot path pays for a free turn taken and given back (a semaphore's uncontended
//! `try_acquire` and release) around its call to the pool, and a `Notify` with nobody waiting
//! when its slot is given back. Over a pool given to
//! [`from_pool`](super::PostgresBackend::from_pool) the pool makes its connections itself,
//! unbounded.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Object, Pool, PoolError, TimeoutType, Timeouts};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

tokio::task_local! {
    /// What the pool's connect may do in this task (see [`Making::get`]).
    static TURN: Cell<Option<Turn>>;
}

/// Set by [`Making::get`] around its call to the pool, for the connect the pool may run in it.
enum Turn {
    /// Make a connection, in this turn.
    Taken(OwnedSemaphorePermit),
    /// Make none: only an idle connection will do (the pool's create timeout, zero, ends it).
    IdleOnly,
}

/// The bound on connections being made, and the signal of a connection going back to the pool.
pub(super) struct Making {
    turns: Arc<Semaphore>,
    returned: Notify,
}

impl Making {
    pub(super) fn new(at_once: usize) -> Arc<Self> {
        Arc::new(Making {
            turns: Arc::new(Semaphore::new(at_once.max(1))),
            returned: Notify::new(),
        })
    }

    /// A connection from `pool` (built with a runtime, for the zero create timeout): an idle
    /// one, or one made in its turn, or — while waiting for that turn — one that went back to
    /// the pool meanwhile.
    pub(super) async fn get(&self, pool: &Pool) -> Result<Object, PoolError> {
        if let Ok(turn) = self.turns.clone().try_acquire_owned() {
            // A turn is free: an idle connection, or else one made now (the turn is given back
            // at once when the pool had an idle one).
            return TURN
                .scope(Cell::new(Some(Turn::Taken(turn))), pool.get())
                .await;
        }
        let idle_only = Timeouts {
            create: Some(Duration::ZERO),
            ..Timeouts::default()
        };
        loop {
            let back = self.returned.notified();
            tokio::pin!(back);
            back.as_mut().enable();
            // An idle connection the pool finds closed (all of them, after a restart) is
            // dropped, and the next one tried.
            let idle = TURN.scope(
                Cell::new(Some(Turn::IdleOnly)),
                pool.timeout_get(&idle_only),
            );
            match idle.await {
                Err(PoolError::Timeout(TimeoutType::Create)) => {}
                got => return got,
            }
            tokio::select! {
                turn = self.turns.clone().acquire_owned() => {
                    let turn = Turn::Taken(turn.expect("the turns are never closed"));
                    return TURN.scope(Cell::new(Some(turn)), pool.get()).await;
                }
                () = &mut back => {}
            }
        }
    }

    /// A connection went back to the pool (or was closed, or a call gave up its slot): callers
    /// waiting in [`get`](Making::get) look again.
    pub(super) fn returned(&self) {
        self.returned.notify_waiters();
    }
}

/// How many connect timeouts a whole connect may take per host (see [`GatedConnect`]).
const WHOLE_CONNECT: usize = 10;

/// The pool's connect: as tokio-postgres's, in a turn of [`Making`] — the one the caller took,
/// or one it waits for.
pub(super) struct GatedConnect<T> {
    pub(super) tls: T,
    pub(super) making: Arc<Making>,
}

impl<T> deadpool_postgres::Connect for GatedConnect<T>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket> + Clone + Sync + Send + 'static,
    T::Stream: Sync + Send,
    T::TlsConnect: Sync + Send,
    <T::TlsConnect as tokio_postgres::tls::TlsConnect<tokio_postgres::Socket>>::Future: Send,
{
    fn connect(
        &self,
        config: &tokio_postgres::Config,
    ) -> futures_util::future::BoxFuture<
        '_,
        Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>,
    > {
        let tls = self.tls.clone();
        let config = config.clone();
        let turns = self.making.turns.clone();
        Box::pin(async move {
            // Held until the connection is made or has failed, within the connect timeout.
            let _turn = match TURN.try_with(Cell::take).ok().flatten() {
                Some(Turn::Taken(turn)) => turn,
                Some(Turn::IdleOnly) => std::future::pending().await,
                // Not asked through `Making::get`: waits for a turn.
                None => turns
                    .acquire_owned()
                    .await
                    .expect("the turns are never closed"),
            };
            // tokio-postgres's connect timeout bounds each socket's connect, not what follows
            // (TLS, the startup message, authentication): a server that takes the connection
            // and never answers (a wedged postmaster, a proxy that drops everything) held the
            // turn for good, and with it every later connection of the backend. The whole
            // connect gets ten connect timeouts for each host it may try: a connection that is
            // slow to make (a long link, a server busy after a restart) is still made.
            let connect = config.connect(tls);
            let (client, connection) = match config.get_connect_timeout() {
                Some(&limit) => {
                    let hosts = config.get_hosts().len().max(1);
                    let tries =
                        u32::try_from(hosts.saturating_mul(WHOLE_CONNECT)).unwrap_or(u32::MAX);
                    tokio::time::timeout(limit.saturating_mul(tries), connect)
                        .await
                        .map_err(|_| tokio_postgres::Error::__private_api_timeout())??
                }
                None => connect.await?,
            };
            let task = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!("postgres pooled connection ended: {e}");
                }
            });
            Ok((client, task))
        })
    }
}

/// One of the backend's slots (see [`flight`](super::flight)); giving it back tells callers
/// waiting to make a connection to look in the pool again (a slot is given back after its
/// connection went back to the pool, or was closed).
pub(super) struct Slot {
    _permit: OwnedSemaphorePermit,
    making: Option<Arc<Making>>,
}

impl Slot {
    pub(super) fn new(permit: OwnedSemaphorePermit, making: Option<Arc<Making>>) -> Self {
        Slot {
            _permit: permit,
            making,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(m) = &self.making {
            m.returned();
        }
    }
}
