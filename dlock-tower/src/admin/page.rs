//! The ops page's HTML: rendered on the server per request, one inline stylesheet, no
//! JavaScript, nothing loaded from elsewhere. Every value from the store or a request is
//! HTML-escaped.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::admin::LockState;
use dlock_runtime::{LockError, Locker};
use serde_json::Value;

const STYLE: &str = "
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:12px 24px}
header h1{margin:0;font-size:20px}header p{margin:2px 0 0;color:#b8c0d0}
.warn{background:#fff4d6;border-bottom:1px solid #e8c96a;padding:6px 24px}
main{padding:8px 24px}section{background:#fff;border:1px solid #dde1e8;border-radius:6px;margin:12px 0;padding:8px 16px}
h2{font-size:16px;margin:6px 0}table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eef0f4;vertical-align:top}
th{color:#5b6475;font-weight:600}code{font-size:13px}.muted{color:#7a8293}
.bars{display:flex;align-items:flex-end;gap:3px;height:60px;margin:6px 0}
.bar{background:#d9534f;width:18px;min-height:1px}.err{color:#b52a1c}
button{font:inherit;padding:2px 10px}
";

/// `s` with `&`, `<`, `>`, `"` and `'` escaped.
pub(super) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn str_of<'a>(v: &'a Value, field: &str) -> &'a str {
    v[field].as_str().unwrap_or("")
}

/// The page's lock listing: the locks (or why not), how old the listing is (a page load within
/// the listing spacing shows the last one), and how often the page refreshes itself.
pub(super) struct Listing<'a> {
    pub(super) held: &'a Result<Arc<Vec<LockState>>, LockError>,
    pub(super) age: Duration,
    /// Seconds.
    pub(super) refresh: u64,
}

/// The page; `base` is its own path with a trailing `/` (the forms post to `<base>requeue/<id>`).
pub(super) fn render(
    locker: &Locker,
    base: &str,
    listing: &Listing<'_>,
    contention: &Value,
    jobs: &Value,
) -> String {
    let mut h = String::with_capacity(8192);
    let _ = write!(
        h,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"{}\"><title>dlock ops</title>\
         <style>{STYLE}</style></head><body>\
         <header><h1>dlock ops</h1><p>backend <b id=\"backend\">{}</b> · namespace <code>{}</code> · {}</p></header>\
         <div class=\"warn\">Operators only: this page has no authentication of its own — it must be mounted behind yours.</div><main>",
        listing.refresh,
        escape(locker.backend_name()),
        escape(locker.prefix()),
        humantime::format_rfc3339_seconds(std::time::SystemTime::now()),
    );
    locks(&mut h, listing);
    contended(&mut h, contention);
    job_tables(&mut h, base, jobs);
    h.push_str("</main></body></html>");
    h
}

fn locks(h: &mut String, listing: &Listing<'_>) {
    h.push_str("<section id=\"locks\"><h2>Held locks</h2>");
    if listing.age >= Duration::from_secs(1) {
        // The last listing, shown again within the listing spacing.
        let _ = write!(
            h,
            "<p class=\"muted\" id=\"listed-ago\">as listed {} s ago</p>",
            listing.age.as_secs()
        );
    }
    match listing.held {
        Err(e) => {
            let _ = write!(h, "<p class=\"err\">{}</p>", escape(&e.to_string()));
        }
        Ok(locks) if locks.is_empty() => {
            h.push_str("<p class=\"muted\">No lock is held or waited for.</p>")
        }
        Ok(locks) => {
            // `held` brings one more than it shows when there are more.
            let shown = locks.len().min(super::MAX_LOCKS);
            let more = if locks.len() > shown {
                " — the first ones only: there are more (narrow them with <code>/api/locks?prefix=</code>, \
                 or list them all with <code>dlock list</code>)"
            } else {
                ""
            };
            let _ = write!(
                h,
                "<p><span id=\"lock-count\">{shown}</span> lock(s){more}</p><table><thead><tr><th>key</th><th>holder</th>\
                 <th>fencing token</th><th>lease left</th><th>waiters (in order)</th></tr></thead><tbody>",
            );
            for s in &locks[..shown] {
                let (holder, fence, lease) = match &s.holder {
                    Some(x) => (
                        format!("<code>{}…</code>", escape(&x.token_prefix)),
                        x.fencing_token.map_or_else(
                            || "<span class=\"muted\">not stored</span>".to_owned(),
                            |t| t.to_string(),
                        ),
                        secs(x.ttl_left),
                    ),
                    None => (
                        "<span class=\"muted\">free</span>".to_owned(),
                        String::new(),
                        String::new(),
                    ),
                };
                let waiters: Vec<String> = s
                    .waiters
                    .iter()
                    .map(|w| format!("<code>{}…</code>", escape(&w.token_prefix)))
                    .collect();
                let _ = write!(
                    h,
                    "<tr class=\"lock\" data-key=\"{k}\" data-waiters=\"{n}\"><td><code>{k}</code></td><td>{holder}</td>\
                     <td>{fence}</td><td>{lease}</td><td>{}</td></tr>",
                    if waiters.is_empty() { "—".to_owned() } else { waiters.join(" → ") },
                    k = escape(&s.key),
                    n = s.waiters.len(),
                );
            }
            h.push_str("</tbody></table>");
        }
    }
    h.push_str("</section>");
}

fn contended(h: &mut String, c: &Value) {
    let minutes = c["window_secs"].as_u64().unwrap_or(600) / 60;
    let _ = write!(
        h,
        "<section id=\"contention\"><h2>Contention, last {minutes} min (this instance)</h2>\
         <p><span id=\"contention-total\">{}</span> contended attempt(s)</p>",
        c["total"].as_u64().unwrap_or(0)
    );
    let per_minute: Vec<u64> = c["per_minute"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let top = per_minute.iter().copied().max().unwrap_or(0).max(1);
    h.push_str("<div class=\"bars\" title=\"contended attempts per minute, oldest first\">");
    for n in &per_minute {
        let _ = write!(
            h,
            "<div class=\"bar\" style=\"height:{}%\" title=\"{n}\"></div>",
            n * 100 / top
        );
    }
    h.push_str("</div>");
    let keys = c["keys"].as_array().cloned().unwrap_or_default();
    if !keys.is_empty() {
        h.push_str("<table><thead><tr><th>key</th><th>attempts</th></tr></thead><tbody>");
        for k in keys.iter().take(50) {
            let _ = write!(
                h,
                "<tr class=\"contended\" data-key=\"{0}\"><td><code>{0}</code></td><td>{1}</td></tr>",
                escape(str_of(k, "key")),
                k["count"].as_u64().unwrap_or(0)
            );
        }
        h.push_str("</tbody></table>");
    }
    h.push_str("</section>");
}

fn job_tables(h: &mut String, base: &str, queues: &Value) {
    h.push_str("<section id=\"jobs\"><h2>Jobs</h2>");
    for q in queues.as_array().into_iter().flatten() {
        let name = escape(str_of(q, "queue"));
        let _ = write!(h, "<h3>queue <code>{name}</code></h3>");
        if let Some(e) = q["error"].as_str() {
            let _ = write!(h, "<p class=\"err\">{}</p>", escape(e));
            continue;
        }
        let deferred = q["deferred"].as_array().cloned().unwrap_or_default();
        let dead = q["dead"].as_array().cloned().unwrap_or_default();
        // The lists are cut at the first 500: `<shown> of <total>` when one was.
        let count = |shown: usize, total: &Value| match total.as_u64() {
            Some(total) if total > shown as u64 => format!("first {shown} of {total}"),
            _ => shown.to_string(),
        };
        let _ = write!(
            h,
            "<p>{} deferred · {} dead</p>",
            count(deferred.len(), &q["deferred_total"]),
            count(dead.len(), &q["dead_total"])
        );
        if !deferred.is_empty() {
            h.push_str("<table><thead><tr><th>deferred job</th><th>key</th><th>attempts</th></tr></thead><tbody>");
            for j in &deferred {
                let _ = write!(
                    h,
                    "<tr class=\"deferred\" data-id=\"{0}\"><td><code>{0}</code></td><td><code>{1}</code></td><td>{2}</td></tr>",
                    escape(str_of(j, "id")),
                    escape(str_of(j, "key")),
                    j["attempts"].as_u64().unwrap_or(0)
                );
            }
            h.push_str("</tbody></table>");
        }
        if !dead.is_empty() {
            h.push_str("<table><thead><tr><th>dead letter</th><th>key</th><th>attempts</th><th>reason</th><th></th></tr></thead><tbody>");
            for j in &dead {
                let id = escape(str_of(j, "id"));
                let _ = write!(
                    h,
                    "<tr class=\"dead\" data-id=\"{id}\"><td><code>{id}</code></td><td><code>{}</code></td><td>{}</td><td>{}</td>\
                     <td><form method=\"post\" action=\"{base}requeue/{id}\"><button>requeue</button></form></td></tr>",
                    escape(str_of(j, "key")),
                    j["attempts"].as_u64().unwrap_or(0),
                    escape(str_of(j, "reason")),
                    base = escape(base),
                );
            }
            h.push_str("</tbody></table>");
        }
    }
    h.push_str("</section>");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_escaped() {
        assert_eq!(
            escape("<a href='x'>&\"</a>"),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;&lt;/a&gt;"
        );
    }
}
