//! [`AdminStore`] for Postgres: plain `SELECT`s on the lock and waiter tables (the database's
//! clock judges leases and entries), and a force-release transaction that serialises on the
//! lock name like every grant, raises the fencing sequence, and passes the lock on with the
//! schema's own `pass_on` (handoff to the first live waiter and its `NOTIFY`, or delete). Every
//! statement is sent with `query_typed` (PgBouncer-safe) within the command timeout. No schema
//! change: the functions and tables are the backend's.

use std::time::Duration;

use tokio_postgres::types::Type;

use super::{pg_err, PostgresBackend};
use crate::backend::admin::{
    is_holder, key_of, name_prefix, token_prefix, ForceReleased, Holder, LockPage, LockState,
    Waiter,
};
use crate::LockError;

impl PostgresBackend {
    /// `<schema>.<prefix><name>`.
    fn object(&self, name: &str) -> String {
        let o = &self.inner.opts;
        format!("{}.{}{name}", o.schema, o.table_prefix)
    }

    async fn read_lock(&self, name: &str) -> Result<LockState, LockError> {
        let holder = self
            .call(
                "inspect",
                &format!(
                    "SELECT owner, fence, {}(expires_at) FROM {} \
                     WHERE name = $1 AND expires_at > clock_timestamp()",
                    self.object("ms_until"),
                    self.object("locks")
                ),
                &[(&name, Type::TEXT)],
            )
            .await?;
        let waiters = self
            .call(
                "inspect",
                &format!(
                    "SELECT token, {}(expires_at) FROM {} \
                     WHERE name = $1 AND expires_at > clock_timestamp() ORDER BY seq",
                    self.object("ms_until"),
                    self.object("waiters")
                ),
                &[(&name, Type::TEXT)],
            )
            .await?;
        let ms = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
        Ok(LockState {
            key: key_of(name).to_owned(),
            holder: holder.first().map(|r| Holder {
                token_prefix: token_prefix(r.get::<_, &str>(0)),
                fencing_token: u64::try_from(r.get::<_, i64>(1)).ok(),
                ttl_left: ms(r.get(2)),
            }),
            waiters: waiters
                .iter()
                .map(|r| Waiter {
                    token_prefix: token_prefix(r.get::<_, &str>(0)),
                    expires_in: Some(ms(r.get(1))),
                })
                .collect(),
            // The holder's token is stored; reading the sequence would need SELECT on it,
            // beyond the backend's least privileges.
            fence_counter: None,
        })
    }

    async fn list_locks(
        &self,
        namespace: &str,
        key_prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<LockPage, LockError> {
        let want = name_prefix(namespace, key_prefix);
        let after = cursor.unwrap_or("");
        // At least one a page (as the memory store): a page of none could never move the
        // cursor on — and `limit - 1` below would underflow. One name more than the page is
        // read to tell whether there is a next page; saturating, so `usize::MAX` ("all")
        // neither overflows `i64` nor `+ 1`.
        let limit = limit.max(1);
        let fetch = i64::try_from(limit).unwrap_or(i64::MAX).saturating_add(1);
        let rows = self
            .call(
                "list",
                &format!(
                    "SELECT name FROM (SELECT name FROM {} WHERE expires_at > clock_timestamp() \
                     UNION SELECT name FROM {} WHERE expires_at > clock_timestamp()) n \
                     WHERE starts_with(name, $1) AND name > $2 ORDER BY name LIMIT $3",
                    self.object("locks"),
                    self.object("waiters")
                ),
                &[
                    (&want, Type::TEXT),
                    (&after, Type::TEXT),
                    (&fetch, Type::INT8),
                ],
            )
            .await?;
        let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        let more = names.len() > limit;
        let page = names.iter().take(limit).cloned();
        // A quarter of the pool at most: renewals and acquires keep the rest.
        let at_once =
            (self.inner.pool.status().max_size / 4).clamp(1, super::super::admin::PAGE_READS);
        let locks =
            super::super::admin::read_active(
                page,
                at_once,
                |n| async move { self.read_lock(&n).await },
            )
            .await?;
        Ok(LockPage {
            locks,
            cursor: more.then(|| names[limit - 1].clone()),
        })
    }

    /// A force release of `name`; with `holder`, only while that owner holds it.
    async fn force(&self, name: &str, holder: Option<&str>) -> Result<ForceReleased, LockError> {
        let limit = self.inner.opts.command_timeout;
        let run = async {
            let client = self.pooled("force release").await?;
            // Stopped early (the timeout below), the connection leaves the pool (see
            // `flight`).
            let mut flight = self.in_flight(client, None);
            let out = self.force_on(flight.client(), name, holder).await;
            flight.done();
            out
        };
        match tokio::time::timeout(limit, run).await {
            Ok(r) => r,
            Err(_) => Err(LockError::unavailable(
                format!("postgres force release timed out after {limit:?}"),
                None,
            )),
        }
    }

    /// The force-release transaction on `client` (with `holder`, conditional on that owner:
    /// the lock's row is read `FOR UPDATE` before anything is written).
    async fn force_on(
        &self,
        client: &mut deadpool_postgres::ClientWrapper,
        name: &str,
        holder: Option<&str>,
    ) -> Result<ForceReleased, LockError> {
        let tx = client
            .transaction()
            .await
            .map_err(|e| pg_err("force release", e))?;
        let err = |e| pg_err("force release", e);
        tx.query_typed(
            &format!("SELECT {}($1)", self.object("serialise")),
            &[(&name, Type::TEXT)],
        )
        .await
        .map_err(err)?;
        let lock = tx
            .query_typed(
                &format!(
                    "SELECT expires_at > clock_timestamp(), barged, owner FROM {} \
                     WHERE name = $1 FOR UPDATE",
                    self.object("locks")
                ),
                &[(&name, Type::TEXT)],
            )
            .await
            .map_err(err)?;
        if let Some(want) = holder {
            let live_owner = lock
                .first()
                .filter(|row| row.get::<_, bool>(0))
                .map(|row| row.get::<_, &str>(2));
            let untouched = match live_owner {
                None => Some(ForceReleased::default()),
                Some(owner) if !is_holder(owner, want) => {
                    Some(ForceReleased::spared(token_prefix(owner)))
                }
                Some(_) => None,
            };
            if let Some(untouched) = untouched {
                // Nothing written: the transaction ends as it began.
                tx.rollback().await.map_err(err)?;
                return Ok(untouched);
            }
        }
        let fence: i64 = tx
            .query_typed(&format!("SELECT {}()", self.object("next_fence")), &[])
            .await
            .map_err(err)?[0]
            .get(0);
        let was_held = match lock.first() {
            Some(row) => {
                let (live, barged): (bool, bool) = (row.get(0), row.get(1));
                tx.query_typed(
                    &format!("SELECT {}($1, $2)", self.object("pass_on")),
                    &[(&name, Type::TEXT), (&barged, Type::BOOL)],
                )
                .await
                .map_err(err)?;
                live
            }
            None => false,
        };
        tx.commit().await.map_err(err)?;
        Ok(ForceReleased {
            was_held,
            fence: u64::try_from(fence).ok(),
            other_holder: None,
        })
    }
}

crate::backend::admin::admin_store_via!(PostgresBackend);
