//! `dlock`: the operator's command for dlock locks and durable jobs.
//!
//! ```text
//! dlock --url redis://127.0.0.1:6379 inspect order:42
//! dlock list --prefix order:            # SCAN, never KEYS
//! dlock release order:42 --force        # asks on a terminal; --yes in scripts
//! dlock release order:42 --force --if-holder 3fa4b2c1   # only while that owner holds it
//! dlock jobs --queue emails dead        # list, dead (first --limit), requeue <id>, purge
//! dlock watch --count 10                # contended locks, refreshed
//! ```
//!
//! The backend comes from `--url` or `DLOCK_URL` (the URLs of `Locker::from_url`). Exit codes:
//! 0 success, 1 the operation did not happen (nothing to requeue, a `release --force` of a lock
//! nobody held or, with `--if-holder`, held by another owner, confirmation declined), 2 bad
//! usage, a bad URL, or a backend that does not answer within `--timeout`. `--json` prints machine-readable output (one JSON document, or one
//! per refresh for `watch`).
//!
//! Keys are shown encoded (`LockKey::as_str`: `user:1%3A2` for a key built from the value
//! `1:2`, `a%20b` for the literal key `a b`), and a key or `--prefix` is taken **as shown**
//! when it is one — every `%` starts a `%XX` escape, no character the encoder escapes, `#` only
//! as a long key's digest marker — and as a literal key otherwise (`"a b"`, `100%`), so both
//! what `list` printed and what the application wrote work
//! (`dlock_runtime::admin::key_as_shown`, `Admin::list`).

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use dlock_runtime::admin::{key_as_shown, Admin};
use dlock_runtime::durable::{DurableQueue, QueueOptions};
use dlock_runtime::{LockError, Locker};

mod output;

/// What `--help` adds after the options: how keys are read, and the exit codes.
const AFTER_HELP: &str = "\
Keys: a key or --prefix is taken as `list` and `inspect` show it (encoded: `user:1%3A2`, \
`a%20b`) when it is one — every `%` starts a `%XX` escape; no `{`, `}`, whitespace, control \
character, or `#` but a long key's digest marker — and as a literal key otherwise (`\"a b\"`, \
`100%`).

Exit codes: 0 done; 1 not done (no such dead letter, `release --force` of a lock nobody held \
or, with --if-holder, held by another owner, confirmation declined); 2 bad usage, a bad URL, \
or a backend that does not answer within --timeout.";

/// Inspect and operate dlock locks and durable jobs.
#[derive(Debug, Parser)]
#[command(name = "dlock", version, after_help = AFTER_HELP)]
struct Cli {
    /// The backend, as for `Locker::from_url` (redis://, redis+cluster://, redis+sentinel://,
    /// postgres://, etcd://, zk://, memory://).
    #[arg(long, env = "DLOCK_URL", global = true, hide_env_values = true)]
    url: Option<String>,
    /// The lockers' namespace prefix (`LockerBuilder::prefix`).
    #[arg(long, default_value = "dlock", global = true)]
    namespace: String,
    /// How long to wait for the backend (connecting, and each call), from 1ms to 1day; also
    /// the job queue's command timeout (`QueueOptions::command_timeout`, at most 60s).
    #[arg(long, default_value = "3s", value_parser = parse_timeout, global = true)]
    timeout: Duration,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show a lock: holder (owner-token prefix, fencing token, lease left), waiters in order.
    Inspect {
        /// The lock's key: as `list` shows it (encoded, e.g. `user:1%3A2`) or as the application
        /// names it (e.g. `order:42`, `"a b"`).
        key: String,
    },
    /// List the locks held or waited for (Redis: SCAN, never KEYS).
    List {
        /// Only keys that start with this (as shown, e.g. `user:1%3A`, or literal text).
        #[arg(long, default_value = "")]
        prefix: String,
        /// At most this many (at least 1).
        #[arg(long, default_value_t = 1000, value_parser = parse_at_least_one)]
        limit: usize,
    },
    /// Free a lock whoever holds it (no owner check) and raise its fencing counter.
    ///
    /// Exits 1 ("`<key>` was not held") when nobody held it, and with `--if-holder` when
    /// another owner holds it ("held by `<prefix>…`, not ...": nothing released).
    Release {
        /// The lock's key, as `list` shows it or as the application names it.
        key: String,
        /// Required: this skips the owner check.
        #[arg(long)]
        force: bool,
        /// Release only while the holder is this owner: the token prefix `inspect` shows
        /// (checked and released in one step, so a lock that changed hands since is left to
        /// its new holder).
        #[arg(long, value_name = "TOKEN_PREFIX")]
        if_holder: Option<String>,
        /// Do not ask for confirmation (needed without a terminal).
        #[arg(long)]
        yes: bool,
    },
    /// The durable job queue (Redis URLs only: redis://, rediss://, redis+unix://, unix://, and
    /// the cluster and Sentinel forms).
    Jobs {
        /// The queue's name (`DurableQueue::connect(url, name)`).
        #[arg(long, default_value = "default")]
        queue: String,
        #[command(subcommand)]
        command: JobsCommand,
    },
    /// Show the contended locks (someone waiting), refreshed until Ctrl-C or `--count`.
    Watch {
        /// Only keys that start with this (as shown, or literal text).
        #[arg(long, default_value = "")]
        prefix: String,
        /// Time between refreshes (100ms to 1day: each refresh scans the locks).
        #[arg(long, default_value = "1s", value_parser = parse_interval)]
        interval: Duration,
        /// Stop after this many refreshes (at least 1).
        #[arg(long, value_parser = parse_at_least_one)]
        count: Option<usize>,
        /// Show every held lock, not only contended ones.
        #[arg(long)]
        all: bool,
        /// Read at most this many locks per refresh (at least 1); a refresh cut there says so.
        #[arg(long, default_value_t = 10_000, value_parser = parse_at_least_one)]
        scan: usize,
    },
}

#[derive(Debug, Subcommand)]
enum JobsCommand {
    /// Jobs queued or running (the first `--limit`, due order first, then claim order).
    List {
        /// At most this many (at least 1); the count line says how many there are in all.
        #[arg(long, default_value_t = 1000, value_parser = parse_at_least_one)]
        limit: usize,
    },
    /// Dead-lettered jobs, with the reason (the first `--limit`, oldest first).
    Dead {
        /// At most this many (at least 1); the count line says how many there are in all.
        #[arg(long, default_value_t = 1000, value_parser = parse_at_least_one)]
        limit: usize,
    },
    /// Put a dead-lettered job back, due now, with a fresh attempt budget.
    Requeue {
        /// The job id.
        id: String,
    },
    /// Delete dead letters for good: one, or all of them with `--all`.
    Purge {
        /// The job id.
        id: Option<String>,
        /// Every dead letter of the queue.
        #[arg(long, conflicts_with = "id")]
        all: bool,
        /// Do not ask for confirmation (needed without a terminal).
        #[arg(long)]
        yes: bool,
    },
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| e.to_string())
}

/// The longest `--timeout`: a wait past it is a hang, not a timeout.
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);

/// `--timeout`: a duration from 1ms to a day.
fn parse_timeout(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(1) || d > MAX_TIMEOUT {
        return Err("must be from 1ms to 1day".into());
    }
    Ok(d)
}

/// `--interval`: from 100ms to a day. Each refresh scans up to 10,000 locks; a zero interval
/// scanned the backend in a busy loop.
fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(100) || d > MAX_TIMEOUT {
        return Err("must be from 100ms to 1day".into());
    }
    Ok(d)
}

/// `--limit` and `--count`: a whole number of at least 1 (zero listed nothing and said "no
/// locks", or refreshed once all the same).
fn parse_at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("must be a whole number of at least 1".into()),
    }
}

/// Why the command failed, and its exit code.
#[derive(Debug)]
enum Failure {
    /// Exit 2: bad usage, a bad URL, an unreachable or unsuitable backend.
    Usage(String),
    /// Exit 1: the operation did not happen.
    NotDone(String),
}

impl From<LockError> for Failure {
    fn from(e: LockError) -> Self {
        if e.is_unavailable() || e.is_misconfigured() || e.is_invalid() || e.is_unsupported() {
            Failure::Usage(e.to_string())
        } else {
            Failure::NotDone(e.to_string())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dlock: cannot start a runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(msg)) => {
            eprintln!("dlock: {msg}");
            ExitCode::from(2)
        }
        Err(Failure::NotDone(msg)) => {
            eprintln!("dlock: {msg}");
            ExitCode::from(1)
        }
    }
}

/// The URL, or an error saying where to put it.
fn url(cli: &Cli) -> Result<&str, Failure> {
    cli.url
        .as_deref()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| Failure::Usage("no backend: pass --url or set DLOCK_URL".into()))
}

/// Runs `fut` within the timeout; past it, the backend is unreachable (exit 2).
async fn within<T>(
    timeout: Duration,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, LockError>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r.map_err(Failure::from),
        Err(_) => Err(Failure::Usage(format!(
            "the backend did not answer {what} within {}",
            humantime::format_duration(timeout)
        ))),
    }
}

async fn admin(cli: &Cli) -> Result<Admin, Failure> {
    let url = url(cli)?;
    let connect = Locker::builder()
        .prefix(cli.namespace.clone())
        .command_timeout(cli.timeout)
        .connect(url);
    let locker = within(cli.timeout, "the connection", connect).await?;
    Ok(locker.admin()?)
}

async fn run(cli: Cli) -> Result<(), Failure> {
    match &cli.command {
        Command::Inspect { key } => {
            let admin = admin(&cli).await?;
            let key = key_as_shown(key)?;
            let state =
                within(cli.timeout.saturating_mul(2), "inspect", admin.inspect(key)).await?;
            output::print_state(&state, cli.json);
        }
        Command::List { prefix, limit } => {
            let admin = admin(&cli).await?;
            // Each page is bounded by `--timeout` (the locker's command timeout); a large
            // keyspace takes many pages, each answered in time.
            let locks = admin.list_all(prefix, *limit).await?;
            output::print_list(&locks, cli.json, true);
        }
        Command::Release {
            key,
            force,
            if_holder,
            yes,
        } => {
            if !force {
                return Err(Failure::Usage(
                    "`release` frees a lock whoever holds it (no owner check): pass --force".into(),
                ));
            }
            confirm(
                &format!("Force-release `{key}`? Its holder loses the lock at its next renewal."),
                *yes,
            )?;
            if let Some(h) = if_holder {
                let hex = h.bytes().all(|b| b.is_ascii_hexdigit());
                if h.is_empty() || h.len() > 32 || !hex {
                    return Err(Failure::Usage(format!(
                        "--if-holder `{h}`: an owner token's prefix is 1 to 32 hex digits, \
                         as `inspect` shows it"
                    )));
                }
            }
            let admin = admin(&cli).await?;
            let key_shown = key_as_shown(key)?;
            let release = async {
                match if_holder {
                    Some(h) => admin.force_release_held_by(key_shown, h).await,
                    None => admin.force_release(key_shown).await,
                }
            };
            let out = within(cli.timeout.saturating_mul(2), "the release", release).await?;
            output::print_released(key, &out, cli.json);
            // Freeing nothing is not what was asked for: a script must not go on as if it had.
            if let (Some(other), Some(h)) = (&out.other_holder, if_holder) {
                return Err(Failure::NotDone(format!(
                    "`{key}` is held by `{other}…`, not by `{h}…`: nothing released"
                )));
            }
            if !out.was_held {
                return Err(Failure::NotDone(format!("`{key}` was not held")));
            }
        }
        Command::Jobs { queue, command } => jobs(&cli, queue, command).await?,
        Command::Watch {
            prefix,
            interval,
            count,
            all,
            scan,
        } => {
            let admin = admin(&cli).await?;
            let mut refreshes = 0usize;
            let clear = !cli.json && std::io::stdout().is_terminal();
            // One Ctrl-C listener for the whole watch, awaited during the refreshes too: the
            // first installs tokio's handler for good (SIGINT no longer ends the process), and
            // one made anew after each refresh missed a Ctrl-C pressed during it.
            let ctrl_c = tokio::signal::ctrl_c();
            tokio::pin!(ctrl_c);
            loop {
                // One more than `scan`, to tell a refresh that saw every lock from one cut
                // short (before, the locks past 10,000 were left out without a word).
                let mut locks = tokio::select! {
                    locks = admin.list_all(prefix, scan.saturating_add(1)) => locks?,
                    _ = &mut ctrl_c => break,
                };
                let cut = (locks.len() > *scan).then_some(*scan);
                locks.truncate(*scan);
                let shown: Vec<_> = locks
                    .into_iter()
                    .filter(|s| *all || !s.waiters.is_empty())
                    .collect();
                output::print_watch(&shown, cut, cli.json, clear);
                refreshes += 1;
                if count.is_some_and(|c| refreshes >= c) {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep(*interval) => {}
                    _ = &mut ctrl_c => break,
                }
            }
        }
    }
    Ok(())
}

async fn jobs(cli: &Cli, queue: &str, command: &JobsCommand) -> Result<(), Failure> {
    let url = url(cli)?;
    let scheme = url.split_once("://").map_or("", |(s, _)| s);
    if !matches!(
        scheme,
        "redis"
            | "rediss"
            | "redis+unix"
            | "unix"
            | "redis+cluster"
            | "rediss+cluster"
            | "redis+sentinel"
            | "rediss+sentinel"
    ) {
        return Err(Failure::Usage(format!(
            "durable job queues live in Redis: `{scheme}://` has none"
        )));
    }
    if let JobsCommand::Purge { id, all, yes } = command {
        if id.is_none() && !all {
            return Err(Failure::Usage(
                "`purge` needs a job id, or --all for every dead letter".into(),
            ));
        }
        let what = id.as_deref().map_or_else(
            || format!("every dead letter of queue `{queue}`"),
            |id| format!("dead letter `{id}`"),
        );
        confirm(&format!("Delete {what} for good?"), *yes)?;
    }
    // `--timeout` is the queue's command timeout too (at most the 60 s a queue takes).
    let options = QueueOptions::default().command_timeout(cli.timeout.min(Duration::from_secs(60)));
    let q = within(
        cli.timeout,
        "the connection",
        DurableQueue::connect_options(url, queue, options),
    )
    .await?;
    let t = cli.timeout.saturating_mul(4);
    match command {
        JobsCommand::List { limit } => {
            let jobs = within(t, "list", q.pending_first(*limit)).await?;
            output::print_jobs(&jobs, cli.json);
        }
        JobsCommand::Dead { limit } => {
            let dead = within(t, "dead", q.dead_letters_first(*limit)).await?;
            output::print_dead(&dead, cli.json);
        }
        JobsCommand::Requeue { id } => {
            if !within(t, "requeue", q.requeue(id)).await? {
                return Err(Failure::NotDone(format!(
                    "no dead letter `{id}` in queue `{queue}`"
                )));
            }
            output::print_done("requeued", id, cli.json);
        }
        JobsCommand::Purge { id, .. } => {
            let n = within(t, "purge", q.purge_dead(id.as_deref())).await?;
            if id.is_some() && n == 0 {
                return Err(Failure::NotDone(format!(
                    "no dead letter `{}` in queue `{queue}`",
                    id.as_deref().unwrap_or_default()
                )));
            }
            output::print_count("purged", n, cli.json);
        }
    }
    Ok(())
}

/// Asks on the terminal unless `yes`; without a terminal and without `yes`, refuses.
fn confirm(question: &str, yes: bool) -> Result<(), Failure> {
    if yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(Failure::Usage(
            "refusing without a terminal to confirm on: pass --yes".into(),
        ));
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Failure::Usage(format!("reading the answer: {e}")))?;
    if matches!(answer.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(Failure::NotDone("not confirmed: nothing done".into()))
    }
}
