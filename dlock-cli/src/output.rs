//! What `dlock` prints: text for people, JSON (`--json`) for scripts — the `serde` form of
//! `dlock_runtime::admin`'s types (durations in milliseconds). Owner tokens only ever appear
//! as their 8-digit prefix.

use std::time::{Duration, SystemTime};

use dlock_runtime::admin::{ForceReleased, LockState};
use dlock_runtime::defer::JobInfo;
use dlock_runtime::durable::{JobStatus, JobsPage};
use serde_json::{json, Value};

/// `println!` that, when stdout is closed (`dlock watch | head -n1`), ends the program quietly
/// with success instead of panicking (Rust ignores `SIGPIPE`, so the write fails with
/// `BrokenPipe`).
macro_rules! out {
    () => {
        out_raw("\n")
    };
    ($($arg:tt)*) => {
        out_raw(&format!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes `text` to stdout, flushed; see [`out!`].
fn out_raw(text: &str) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("dlock: cannot write to stdout: {e}");
            std::process::exit(2);
        }
    }
}

fn human(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

pub(crate) fn state_json(s: &LockState) -> Value {
    serde_json::to_value(s).unwrap_or(Value::Null)
}

fn print_json(v: &Value) {
    out!("{v}");
}

pub(crate) fn print_state(s: &LockState, json: bool) {
    if json {
        return print_json(&state_json(s));
    }
    out!("key            {}", s.key);
    match &s.holder {
        Some(h) => {
            let fence = h
                .fencing_token
                .map_or_else(|| "not stored".to_owned(), |t| t.to_string());
            out!(
                "holder         {}…  fencing token {fence}  lease left {}",
                h.token_prefix,
                human(h.ttl_left)
            );
        }
        None => out!("holder         (free)"),
    }
    out!("waiters        {}", s.waiters.len());
    for (i, w) in s.waiters.iter().enumerate() {
        let exp = w
            .expires_in
            .map_or_else(String::new, |d| format!("  entry expires in {}", human(d)));
        out!("  {:>3}. {}…{exp}", i + 1, w.token_prefix);
    }
    if let Some(f) = s.fence_counter {
        out!("fence counter  {f}");
    }
}

pub(crate) fn print_list(locks: &[LockState], json: bool, footer: bool) {
    if json {
        return print_json(&Value::Array(locks.iter().map(state_json).collect()));
    }
    if locks.is_empty() {
        if footer {
            out!("no locks held or waited for");
        }
        return;
    }
    out!(
        "{:<40} {:<10} {:>10} {:>8}",
        "KEY",
        "HOLDER",
        "LEASE",
        "WAITERS"
    );
    for s in locks {
        let (holder, lease) = match &s.holder {
            Some(h) => (format!("{}…", h.token_prefix), human(h.ttl_left)),
            None => ("(free)".to_owned(), "-".to_owned()),
        };
        out!(
            "{:<40} {:<10} {:>10} {:>8}",
            s.key,
            holder,
            lease,
            s.waiters.len()
        );
    }
    if footer {
        out!("{} lock(s)", locks.len());
    }
}

/// One refresh of `watch`; `cut`: the refresh read only that many locks of more.
pub(crate) fn print_watch(locks: &[LockState], cut: Option<usize>, json: bool, clear: bool) {
    let now = humantime::format_rfc3339_seconds(SystemTime::now());
    if json {
        let mut v = json!({
            "at": now.to_string(),
            "locks": locks.iter().map(state_json).collect::<Vec<_>>(),
        });
        if let Some(scanned) = cut {
            v["scanned"] = json!(scanned);
            v["truncated"] = json!(true);
        }
        return print_json(&v);
    }
    if clear {
        out_raw("\x1b[2J\x1b[H");
    }
    match cut {
        None => out!("{now}  {} contended lock(s)", locks.len()),
        Some(scanned) => out!(
            "{now}  {} contended lock(s) among the first {scanned} locks only: there are more \
             (narrow them with --prefix, or raise --scan)",
            locks.len()
        ),
    }
    print_list(locks, false, false);
    out!();
}

pub(crate) fn print_released(key: &str, out: &ForceReleased, json: bool) {
    if json {
        let mut v = serde_json::to_value(out).unwrap_or(Value::Null);
        v["key"] = json!(key);
        return print_json(&v);
    }
    // A lock nobody held is the command's error ("`<key>` was not held", exit 1).
    if out.was_held {
        out!("released `{key}` (its holder loses it at its next renewal)");
    }
    if let Some(f) = out.fence {
        out!("fencing counter raised to {f}: tokens issued before are below it");
    }
}

fn job_json(j: &JobInfo) -> Value {
    json!({
        "id": j.id,
        "key": j.key,
        "attempts": j.attempts,
        "reason": j.reason,
    })
}

/// The count line of a job listing: `<n> <what>`, or `first <n> of <total> <what> (--limit
/// to see more)` when the listing was cut.
fn job_count<T>(page: &JobsPage<T>, what: &str) -> String {
    if page.truncated() {
        format!(
            "first {} of {} {what} (--limit to see more)",
            page.jobs.len(),
            page.total
        )
    } else {
        format!("{} {what}", page.jobs.len())
    }
}

/// With `--json`, a cut listing is still the array of the jobs shown; standard error says it
/// was cut.
fn note_cut<T>(page: &JobsPage<T>, what: &str) {
    if page.truncated() {
        eprintln!("{}", job_count(page, what));
    }
}

pub(crate) fn print_jobs(page: &JobsPage<(JobInfo, JobStatus)>, json: bool) {
    let jobs = &page.jobs;
    let state = |s: &JobStatus| match s {
        JobStatus::Running => "running",
        _ => "queued",
    };
    if json {
        note_cut(page, "job(s)");
        return print_json(&Value::Array(
            jobs.iter()
                .map(|(j, s)| {
                    let mut v = job_json(j);
                    v["state"] = json!(state(s));
                    v
                })
                .collect(),
        ));
    }
    out!("{:<34} {:<8} {:>8}  KEY", "ID", "STATE", "ATTEMPTS");
    for (j, s) in jobs {
        out!("{:<34} {:<8} {:>8}  {}", j.id, state(s), j.attempts, j.key);
    }
    out!("{}", job_count(page, "job(s)"));
}

pub(crate) fn print_dead(page: &JobsPage<JobInfo>, json: bool) {
    let jobs = &page.jobs;
    if json {
        note_cut(page, "dead letter(s)");
        return print_json(&Value::Array(jobs.iter().map(job_json).collect()));
    }
    out!("{:<34} {:>8}  {:<30} REASON", "ID", "ATTEMPTS", "KEY");
    for j in jobs {
        out!(
            "{:<34} {:>8}  {:<30} {}",
            j.id,
            j.attempts,
            j.key,
            printable(j.reason.as_deref().unwrap_or(""))
        );
    }
    out!("{}", job_count(page, "dead letter(s)"));
}

/// `text` with its control characters escaped (`\u{1b}`): a reason quotes a job's error, which
/// may hold request data, and raw it could drive the operator's terminal (an escape sequence
/// that sets the window title or the clipboard).
fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_unicode().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

pub(crate) fn print_done(what: &str, id: &str, json: bool) {
    if json {
        print_json(&json!({ what: id }));
    } else {
        out!("{what} {id}");
    }
}

pub(crate) fn print_count(what: &str, n: usize, json: bool) {
    if json {
        print_json(&json!({ what: n }));
    } else {
        out!("{what} {n}");
    }
}
