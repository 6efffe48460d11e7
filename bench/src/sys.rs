//! What the process knows about itself and where results go.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

/// Linux's `USER_HZ`: the unit of `utime`/`stime` in `/proc/self/stat` (100 on every
/// mainstream architecture; the kernel exports this fixed value regardless of `CONFIG_HZ`).
const USER_HZ: f64 = 100.0;

/// Resident set size from `/proc/self/status` (`VmRSS`), in KiB.
pub(crate) fn rss_kib() -> u64 {
    status_field("VmRSS:")
}

/// Peak resident set size (`VmHWM`), in KiB.
pub(crate) fn peak_rss_kib() -> u64 {
    status_field("VmHWM:")
}

fn status_field(name: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU time used by this process so far (user + system, all threads), from
/// `/proc/self/stat` fields 14 and 15.
pub(crate) fn cpu_secs() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Field 2 (comm) may contain spaces: count from the closing parenthesis.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3, so field N is at index N - 3.
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (ticks(14 - 3) + ticks(15 - 3)) as f64 / USER_HZ
}

/// CPU time used by the whole machine so far (every CPU's non-idle time, from the first line
/// of `/proc/stat`), seconds.
pub(crate) fn machine_busy_secs() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let Some(cpu) = stat.lines().next().and_then(|l| l.strip_prefix("cpu ")) else {
        return 0.0;
    };
    let f: Vec<u64> = cpu
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let busy: u64 = f
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, v)| v)
        .sum();
    busy as f64 / USER_HZ
}

/// The 1-minute load average.
pub(crate) fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

/// `target/` as cargo resolves it: `CARGO_TARGET_DIR` (relative to the current directory when
/// relative), else the workspace root's `target/`.
pub(crate) fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                std::env::current_dir().unwrap_or_default().join(dir)
            }
        }
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(|p| p.join("target"))
            .unwrap_or_else(|| PathBuf::from("target")),
    }
}

/// Now as `YYYY-MM-DD HH:MM UTC`.
pub(crate) fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        (rem % 3600) / 60
    )
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 to (year, month, day).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }

    #[test]
    fn proc_self_is_readable() {
        assert!(rss_kib() > 0);
        assert!(cpu_secs() >= 0.0);
    }
}
