//! Turns the resource's logs into the report.
//!
//! Definitions (per lock key, replaying its log in the order the resource server applied it):
//!
//! * **critical sections completed** (`cs`): accepted writes (`W`).
//! * **inside**: a writer is inside from its accepted read (`B`) until its end record (`E`), or
//!   until the coordinator records that its process was SIGKILLed (`K`).
//! * **overlap**: a critical section that another writer entered (accepted read) while it was
//!   still inside — two holders of one key at once, in wall-clock terms. `overlaps` counts
//!   such overlapped sections once each; `overlap_entries` counts the entries that found
//!   someone inside. Overlapped sections are classified by how they ended: `wrote` (its write
//!   was accepted: it wrote before any newer token was seen, so the newer holder read its
//!   result), `fenced` (its write was refused), `aborted` (the guard reported the loss and it
//!   did not write), or other. An overlapped section is **paused** when its process was frozen
//!   (a `pause` fault) or killed while it held the lock, before the first other writer entered
//!   beside it: a freeze that began before that entry and ended no more than one command
//!   timeout before the section's own entry (a process frozen while its lock was being granted
//!   enters only when it wakes, once the acquire's answer is read). The holder outlived its lease, which no lease can prevent and fencing
//!   makes harmless. Every other overlap (`overlaps_unpaused`) means the lock service itself let two
//!   holders in (a live section ends a margin before its lease does: see the worker); each is
//!   charged to the latest fault that started before the second writer entered. It is expected
//!   only under a fault that loses locks on the server (a Redis restarted empty, a failover:
//!   `BackendKind::lossy_faults`), and fails the run otherwise, on every backend.
//! * **stale write rejected** (`stale_writes_rejected`): a write refused by the token check
//!   (`w`). `stale_reads_rejected` likewise for reads (`b`). `would_be_lost_updates`: refused
//!   writes whose read was no longer current — each one a lost update that fencing prevented.
//! * **stale write accepted** (`stale_writes_accepted`, must be 0): an accepted write whose
//!   token is lower than one the resource had already accepted for the key, or whose read was
//!   no longer current (a lost update: some other write landed between this section's read and
//!   its write). Also counted: entries with a token equal to the highest one seen
//!   (`token_reuse`, two grants with one token) and any key whose final value differs from its
//!   version (an increment was lost).
//! * **stall**: an interval in which a key had no accepted write, over every key and the whole
//!   fault period (from the first fault's start to the stop). Each interval is charged to the
//!   latest fault that started before the interval ended (the fault the key was recovering
//!   from). `max_gap_ms` is the longest such interval; `max_stall_ms` — what the liveness
//!   bound applies to — is the longest part of one *after the fault was lifted*: for a pause
//!   or a kill that is the whole interval (the lock must move on within the TTL while its
//!   holder is frozen or dead), for a restart, latency or cut only what follows the fault's
//!   end.

use std::collections::{BTreeMap, HashMap};

use crate::config::FaultKind;

/// One injected fault.
#[derive(Clone, Debug)]
pub(crate) struct FaultRecord {
    /// The kind.
    pub(crate) kind: FaultKind,
    /// When it took effect (resource clock, µs).
    pub(crate) start_us: u64,
    /// When it was lifted (µs); equal to `start_us` for instantaneous faults.
    pub(crate) end_us: u64,
    /// Human-readable parameters.
    pub(crate) detail: String,
    /// Pause and kill: the victim's lock key and writer.
    pub(crate) victim: Option<(String, String)>,
    /// A defect of the server itself seen during the fault, with the evidence (an etcd leader
    /// thawed from a freeze that revoked leases the new leader kept alive): overlaps of two
    /// live holders charged to it are counted apart (`overlaps_server_bug`), not as the lock
    /// service's.
    pub(crate) server_bug: Option<String>,
}

/// What one backend's phase measured.
#[derive(Clone, Debug, Default)]
pub(crate) struct PhaseReport {
    /// Accepted writes.
    pub(crate) cs: u64,
    /// Overlapped critical sections.
    pub(crate) overlaps: u64,
    /// Entries that found another writer inside.
    pub(crate) overlap_entries: u64,
    /// Overlapped sections whose write was accepted (before the newer holder's read).
    pub(crate) overlaps_wrote: u64,
    /// Overlapped sections whose write was refused by fencing.
    pub(crate) overlaps_fenced: u64,
    /// Overlapped sections that saw the loss and did not write.
    pub(crate) overlaps_aborted: u64,
    /// Overlapped sections that ended otherwise (error, killed, still open).
    pub(crate) overlaps_other: u64,
    /// Overlaps where the entrant's token was lower than the occupant's.
    pub(crate) inverted_overlaps: u64,
    /// Overlapped sections whose process had not been frozen or killed while inside before
    /// the other writer entered: the lock service gave the key to two live holders.
    pub(crate) overlaps_unpaused: u64,
    /// When (µs) each of those overlaps began (the second writer's entry).
    pub(crate) unpaused_at: Vec<u64>,
    /// Of `overlaps_unpaused`, those charged to a fault during which the server showed a
    /// known defect of its own ([`FaultRecord::server_bug`]).
    pub(crate) overlaps_server_bug: u64,
    /// Refused writes.
    pub(crate) stale_writes_rejected: u64,
    /// Refused reads.
    pub(crate) stale_reads_rejected: u64,
    /// Refused writes that would have been lost updates.
    pub(crate) would_be_lost_updates: u64,
    /// Accepted stale writes (must be 0).
    pub(crate) stale_writes_accepted: u64,
    /// Entries with a token equal to the highest seen (must be 0).
    pub(crate) token_reuse: u64,
    /// Keys whose final value differs from their version (must be 0).
    pub(crate) value_mismatch: u64,
    /// Sections that ended with `abort` (the guard reported loss before the write).
    pub(crate) lost_aborts: u64,
    /// Sections never ended (should be 0: every worker is stopped or its death recorded).
    pub(crate) unfinished: u64,
    /// Longest stall over all faults.
    pub(crate) max_stall: Stall,
    /// The backend's liveness bound (ms): `max_stall.after_ms` must not exceed it.
    pub(crate) stall_bound_ms: u64,
    /// Of `overlaps_unpaused`, those charged to a fault that loses locks on the server
    /// ([`BackendKind::lossy_faults`](crate::config::BackendKind::lossy_faults)): expected.
    /// The rest, less `overlaps_server_bug`, must be 0.
    pub(crate) overlaps_lossy: u64,
    /// Per fault: the stalls charged to it.
    pub(crate) fault_stalls: Vec<Stall>,
    /// Pause faults injected.
    pub(crate) pauses: u64,
    /// Pause faults whose victim's write was then refused by fencing.
    pub(crate) pauses_fenced: u64,
    /// Lock keys present after every worker exited (must be 0).
    pub(crate) locks_left: u64,
    /// Of those, how many were still there one liveness bound later (never expiring).
    pub(crate) locks_unexpired: u64,
    /// Waiter queues present after every worker exited (informational: they expire).
    pub(crate) queues_left: u64,
    /// Worker processes that exited on their own, unexpectedly.
    pub(crate) worker_crashes: u64,
    /// Faults after which some key made no progress within the liveness bound and 5 s (must
    /// be 0).
    pub(crate) unrecovered: u64,
    /// Sum of the workers' client-side counters (workers that were killed are missing).
    pub(crate) client: HashMap<String, u64>,
}

/// One log record.
#[derive(Debug)]
enum Rec<'a> {
    Begin {
        token: u64,
        writer: &'a str,
        dup: bool,
    },
    BeginRefused,
    Write {
        token: u64,
        read_ver: i64,
        cur_ver: i64,
    },
    WriteRefused {
        read_ver: i64,
        cur_ver: i64,
    },
    End {
        writer: &'a str,
        outcome: &'a str,
    },
    Killed {
        worker: &'a str,
    },
}

fn parse(line: &str) -> Option<(u64, Rec<'_>)> {
    let mut p = line.split_whitespace();
    let t = p.next()?.parse().ok()?;
    let op = p.next()?;
    let token_s = p.next()?;
    let writer = p.next()?;
    let mut num = || -> Option<i64> { p.next()?.parse().ok() };
    let token = || token_s.parse::<u64>().ok();
    let rec = match op {
        "B" => {
            let _ver = num()?;
            let dup = num()? == 1;
            Rec::Begin {
                token: token()?,
                writer,
                dup,
            }
        }
        "b" => Rec::BeginRefused,
        "W" => Rec::Write {
            token: token()?,
            read_ver: num()?,
            cur_ver: num()?,
        },
        "w" => Rec::WriteRefused {
            read_ver: num()?,
            cur_ver: num()?,
        },
        "E" => Rec::End {
            writer,
            outcome: p.next()?,
        },
        "K" => Rec::Killed { worker: writer },
        _ => return None,
    };
    Some((t, rec))
}

struct Occupant {
    token: u64,
    overlapped: bool,
    /// When it entered (µs).
    since: u64,
}

/// A process frozen or killed by a worker fault: (worker name `wN`, from, to; µs).
pub(crate) type Stopped<'a> = (&'a str, u64, u64);

/// The worker processes the `pause` and `kill` faults of `faults` stopped, and when.
pub(crate) fn stopped_workers(faults: &[FaultRecord]) -> Vec<Stopped<'_>> {
    (faults.iter())
        .filter(|f| matches!(f.kind, FaultKind::Pause | FaultKind::Kill))
        .filter_map(|f| {
            let (_, writer) = f.victim.as_ref()?;
            Some((
                writer.split('.').next().unwrap_or(writer),
                f.start_us,
                f.end_us,
            ))
        })
        .collect()
}

/// Replays one key's log into `r`, given the worker processes frozen or killed meanwhile
/// ([`stopped_workers`]) and how long after a thaw a section may still enter on a grant from
/// before the freeze (`grace_us`: one command timeout); returns the times (µs) of its
/// accepted writes.
pub(crate) fn replay(
    log: &[String],
    stopped: &[Stopped<'_>],
    grace_us: u64,
    r: &mut PhaseReport,
) -> Result<Vec<u64>, String> {
    let mut inside: HashMap<&str, Occupant> = HashMap::new();
    let mut max_accepted = 0u64;
    let mut completions = Vec::new();
    for line in log {
        let (t, rec) = parse(line).ok_or_else(|| format!("unparsable log record: {line}"))?;
        match rec {
            Rec::Begin { token, writer, dup } => {
                if dup {
                    r.token_reuse += 1;
                }
                let mut found = false;
                for (w, occ) in inside.iter_mut() {
                    if *w != writer {
                        found = true;
                        if !occ.overlapped {
                            occ.overlapped = true;
                            r.overlaps += 1;
                            let worker = w.split('.').next().unwrap_or(w);
                            let paused = stopped.iter().any(|&(p, from, to)| {
                                p == worker && from <= t && to + grace_us >= occ.since
                            });
                            if !paused {
                                r.overlaps_unpaused += 1;
                                r.unpaused_at.push(t);
                            }
                        }
                        if token < occ.token {
                            r.inverted_overlaps += 1;
                        }
                    }
                }
                if found {
                    r.overlap_entries += 1;
                }
                inside.insert(
                    writer,
                    Occupant {
                        token,
                        overlapped: false,
                        since: t,
                    },
                );
            }
            Rec::BeginRefused => r.stale_reads_rejected += 1,
            Rec::Write {
                token,
                read_ver,
                cur_ver,
            } => {
                r.cs += 1;
                completions.push(t);
                if token < max_accepted || read_ver != cur_ver {
                    r.stale_writes_accepted += 1;
                }
                max_accepted = max_accepted.max(token);
            }
            Rec::WriteRefused { read_ver, cur_ver } => {
                r.stale_writes_rejected += 1;
                if read_ver != cur_ver {
                    r.would_be_lost_updates += 1;
                }
            }
            Rec::End { writer, outcome } => {
                if outcome == "abort" {
                    r.lost_aborts += 1;
                }
                if let Some(occ) = inside.remove(writer) {
                    if occ.overlapped {
                        match outcome {
                            "ok" => r.overlaps_wrote += 1,
                            "fenced" => r.overlaps_fenced += 1,
                            "abort" => r.overlaps_aborted += 1,
                            _ => r.overlaps_other += 1,
                        }
                    }
                }
            }
            Rec::Killed { worker } => {
                let prefix = format!("{worker}.");
                inside.retain(|w, occ| {
                    let dead = w.starts_with(&prefix);
                    if dead && occ.overlapped {
                        r.overlaps_other += 1;
                    }
                    !dead
                });
            }
        }
    }
    for occ in inside.values() {
        r.unfinished += 1;
        if occ.overlapped {
            r.overlaps_other += 1;
        }
    }
    Ok(completions)
}

/// How `writer`'s critical section that was open at `at_us` ended, from its key's log: the
/// outcome of its first end record after `at_us` (`ok`, `fenced`, `abort`, `error`), `killed`,
/// or `None` if it never ended.
pub(crate) fn outcome_after(log: &[String], writer: &str, at_us: u64) -> Option<String> {
    let worker = writer.split('.').next().unwrap_or(writer);
    for line in log {
        let Some((t, rec)) = parse(line) else {
            continue;
        };
        if t < at_us {
            continue;
        }
        match rec {
            Rec::End { writer: w, outcome } if w == writer => return Some(outcome.to_owned()),
            Rec::Killed { worker: w } if w == worker => return Some("killed".to_owned()),
            _ => {}
        }
    }
    None
}

/// The stalls charged to one fault.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Stall {
    /// The longest interval without progress on any key, charged to this fault (ms).
    pub(crate) gap_ms: u64,
    /// Of such intervals, the longest part after the fault was lifted (ms): what the liveness
    /// bound applies to.
    pub(crate) after_ms: u64,
    /// Where that interval lies: the key's index in the completions and the interval without
    /// an accepted write (µs, from, to) — for printing the log around a stall over the bound.
    pub(crate) window: Option<(usize, u64, u64)>,
}

impl FaultRecord {
    /// A fault of `kind` that took effect at `start_us` and was lifted at `end_us`.
    pub(crate) fn new(
        kind: FaultKind,
        start_us: u64,
        end_us: u64,
        detail: String,
        victim: Option<(String, String)>,
    ) -> Self {
        FaultRecord {
            kind,
            start_us,
            end_us,
            detail,
            victim,
            server_bug: None,
        }
    }

    /// When the fault stops excusing a lack of progress (µs). A paused or killed holder's
    /// lock must move on within the TTL *while* the holder stays frozen or dead, so those
    /// count from the start; a restart, latency or cut counts from when it was lifted, a
    /// master kill from when its shard serves again, a master pause from when the deployment
    /// settled on the master that serves from then on (a frozen master woken near its
    /// down-after time may still be failed over after it serves again: that failover is part
    /// of the fault), a reshard from when its slot is served by the new master.
    pub(crate) fn lifted_us(&self) -> u64 {
        match self.kind {
            FaultKind::Pause | FaultKind::Kill => self.start_us,
            FaultKind::Restart
            | FaultKind::Latency
            | FaultKind::Cut
            | FaultKind::MasterKill
            | FaultKind::MasterPause
            | FaultKind::Reshard
            | FaultKind::LeaderKill
            | FaultKind::MemberFreeze => self.end_us,
        }
    }
}

/// Charges stalls: `completions[k]` are key k's accepted-write times (sorted), `faults` the
/// faults in order, `stop_us` when the workers were told to stop. Every interval without an
/// accepted write on a key, from the first fault's start to the stop, is charged to the
/// latest fault that started before the interval ended. Returns the per-fault stalls and
/// their maxima.
pub(crate) fn stalls(
    completions: &[Vec<u64>],
    faults: &[FaultRecord],
    stop_us: u64,
) -> (Vec<Stall>, Stall) {
    let mut per_fault = vec![Stall::default(); faults.len()];
    let mut max = Stall::default();
    let Some(first) = faults.first() else {
        return (per_fault, max);
    };
    for (key, times) in completions.iter().enumerate() {
        let mut prev = first.start_us;
        let mut points: Vec<u64> = times
            .iter()
            .copied()
            .filter(|&t| t > first.start_us && t < stop_us)
            .collect();
        points.push(stop_us);
        for t in points {
            if let Some(i) = charged_to(faults, t) {
                let gap_ms = t.saturating_sub(prev) / 1000;
                let after_ms = t.saturating_sub(prev.max(faults[i].lifted_us())) / 1000;
                for s in [&mut per_fault[i], &mut max] {
                    s.gap_ms = s.gap_ms.max(gap_ms);
                    if s.window.is_none() || after_ms > s.after_ms {
                        s.after_ms = after_ms;
                        s.window = Some((key, prev, t));
                    }
                }
            }
            prev = t;
        }
    }
    (per_fault, max)
}

/// A short account of a key's log (`<µs> <record> …` lines) between `from_us` and `to_us`:
/// how many records of each kind, then the first and last `ends` records of the interval.
pub(crate) fn excerpt(log: &[String], from_us: u64, to_us: u64, ends: usize) -> Vec<String> {
    let inside: Vec<&String> = log
        .iter()
        .filter(|l| {
            l.split(' ')
                .next()
                .and_then(|t| t.parse::<u64>().ok())
                .is_some_and(|t| t >= from_us && t <= to_us)
        })
        .collect();
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for l in &inside {
        *kinds.entry(l.split(' ').nth(1).unwrap_or("?")).or_default() += 1;
    }
    let counts: Vec<String> = kinds.iter().map(|(k, n)| format!("{k}={n}")).collect();
    let mut out = vec![format!(
        "{} records in the interval: {}",
        inside.len(),
        counts.join(" ")
    )];
    if inside.len() <= 2 * ends {
        out.extend(inside.iter().map(|l| (*l).clone()));
    } else {
        out.extend(inside[..ends].iter().map(|l| (*l).clone()));
        out.push(format!("… {} more …", inside.len() - 2 * ends));
        out.extend(inside[inside.len() - ends..].iter().map(|l| (*l).clone()));
    }
    out
}

/// The fault an event at `at` (µs) is charged to: the latest that started before it (`None`
/// before the first).
pub(crate) fn charged_to(faults: &[FaultRecord], at: u64) -> Option<usize> {
    faults.iter().rposition(|f| f.start_us < at)
}

/// How many of the overlaps of two live holders that began at `unpaused_at` (µs) are charged to
/// a fault during which the server showed a known defect of its own
/// ([`FaultRecord::server_bug`]).
pub(crate) fn server_bug_overlaps(unpaused_at: &[u64], faults: &[FaultRecord]) -> u64 {
    let bug = |&at: &u64| charged_to(faults, at).is_some_and(|i| faults[i].server_bug.is_some());
    unpaused_at.iter().filter(|at| bug(at)).count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(lines: &[&str]) -> Vec<String> {
        lines.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_paused_holder_overlapped_and_fenced() {
        // w1.0 reads with token 10, freezes; w2.0 takes over with 20, reads, writes, ends;
        // w1.0 wakes and writes with 10: refused, and it would have been a lost update.
        let l = log(&[
            "1 B 10 w1.0 0 0",
            "2 B 20 w2.0 0 0",
            "3 W 20 w2.0 0 0",
            "4 E 20 w2.0 ok",
            "5 w 10 w1.0 0 1",
            "6 E 10 w1.0 fenced",
        ]);
        let mut r = PhaseReport::default();
        let c = replay(&l, &[], 0, &mut r).unwrap();
        assert_eq!(c, vec![3]);
        assert_eq!((r.cs, r.overlaps, r.overlaps_fenced), (1, 1, 1));
        assert_eq!((r.stale_writes_rejected, r.would_be_lost_updates), (1, 1));
        assert_eq!(r.stale_writes_accepted, 0);
        assert_eq!(r.unfinished, 0);
        // Without the pause on record the overlap is the lock service's doing; with w1
        // frozen at 1.5 (after it entered, before w2 did) it is the pause's.
        assert_eq!((r.overlaps_unpaused, r.unpaused_at.clone()), (1, vec![2]));
        let mut r = PhaseReport::default();
        replay(&l, &[("w1", 1, 2), ("w3", 1, 2)], 0, &mut r).unwrap();
        assert_eq!((r.overlaps, r.overlaps_unpaused), (1, 0));
        // A freeze of the occupant after the other writer entered explains nothing.
        let mut r = PhaseReport::default();
        replay(&l, &[("w1", 3, 4)], 0, &mut r).unwrap();
        assert_eq!(r.overlaps_unpaused, 1);
        // Frozen while granted, thawed at 0, entering at 1: within the grace of the thaw.
        let mut r = PhaseReport::default();
        replay(&l, &[("w1", 0, 0)], 1, &mut r).unwrap();
        assert_eq!(r.overlaps_unpaused, 0);
        // Thawed longer than the grace before it entered: its grant was a new one.
        let mut r = PhaseReport::default();
        replay(&l, &[("w1", 0, 0)], 0, &mut r).unwrap();
        assert_eq!(r.overlaps_unpaused, 1);
        assert_eq!(outcome_after(&l, "w1.0", 2).as_deref(), Some("fenced"));
        assert_eq!(outcome_after(&l, "w3.0", 2), None);
    }

    #[test]
    fn a_lost_update_is_a_stale_write_accepted() {
        // Two holders with the same token (a broken lock service): the second write is based
        // on a stale read and gets through.
        let l = log(&[
            "1 B 10 w1.0 0 0",
            "2 B 10 w2.0 0 1",
            "3 W 10 w1.0 0 0",
            "4 W 10 w2.0 0 1",
            "5 E 10 w1.0 ok",
            "6 E 10 w2.0 ok",
        ]);
        let mut r = PhaseReport::default();
        replay(&l, &[], 0, &mut r).unwrap();
        assert_eq!(r.stale_writes_accepted, 1);
        assert_eq!(r.token_reuse, 1);
        assert_eq!(r.overlaps, 1);
    }

    #[test]
    fn killed_workers_leave_the_section() {
        let l = log(&["1 B 10 w1.3 0 0", "2 K - w1", "3 B 20 w2.0 0 0"]);
        let mut r = PhaseReport::default();
        replay(&l, &[], 0, &mut r).unwrap();
        assert_eq!(r.overlaps, 0);
        assert_eq!(r.unfinished, 1);
    }

    #[test]
    fn stalls_are_the_longest_gaps_charged_to_the_latest_fault() {
        let f = |kind, s: u64, e: u64| FaultRecord {
            kind,
            start_us: s,
            end_us: e,
            detail: String::new(),
            victim: None,
            server_bug: None,
        };
        let faults = [
            f(FaultKind::Pause, 1_000_000, 2_000_000),
            f(FaultKind::Latency, 2_050_000, 3_000_000),
        ];
        let completions = vec![
            vec![500, 1_000, 2_000_000, 2_100_000],
            vec![900, 1_500_000, 3_000_000],
        ];
        let (per, max) = stalls(&completions, &faults, 3_500_000);
        // Key 0: gaps 1000 (pause), 100, 1400 (latency; 500 of it after the latency ended);
        // key 1: 500 (pause), 1500 (latency, none after), 500 (latency, all after).
        let st = |gap_ms, after_ms, window| Stall {
            gap_ms,
            after_ms,
            window: Some(window),
        };
        // Where each longest stall after the lift lies: the pause's on key 0 from its start to
        // the next write; the latency's (500 ms on both keys; the first found) on key 0 from
        // its write at 2.1 s to the stop.
        assert_eq!(
            per,
            vec![
                st(1_000, 1_000, (0, 1_000_000, 2_000_000)),
                st(1_500, 500, (0, 2_100_000, 3_500_000)),
            ]
        );
        assert_eq!(max, st(1_500, 1_000, (0, 1_000_000, 2_000_000)));
    }

    #[test]
    fn an_excerpt_counts_the_records_of_the_interval_and_shows_its_ends() {
        let l = log(&[
            "10 B 1 w1 0 0",
            "20 b 1 w2",
            "30 b 1 w3",
            "40 b 1 w4",
            "50 W 2 w5",
            "60 E 2 w5 ok",
        ]);
        let e = excerpt(&l, 20, 50, 1);
        assert_eq!(
            e,
            vec![
                "4 records in the interval: W=1 b=3".to_owned(),
                "20 b 1 w2".to_owned(),
                "… 2 more …".to_owned(),
                "50 W 2 w5".to_owned(),
            ]
        );
        assert_eq!(excerpt(&l, 55, 65, 1).len(), 2);
    }

    /// Only the overlaps charged to a fault with a server defect — those that began after it
    /// started and before the next fault — are the server's; one before it, or after the next
    /// fault started, is still the lock service's.
    #[test]
    fn overlaps_are_the_servers_only_when_charged_to_a_fault_with_a_server_defect() {
        let mut freeze = FaultRecord::new(
            FaultKind::MemberFreeze,
            1_000_000,
            2_000_000,
            String::new(),
            None,
        );
        freeze.server_bug = Some("stale revoke".into());
        let pause = FaultRecord::new(FaultKind::Pause, 5_000_000, 6_000_000, String::new(), None);
        let faults = [freeze, pause];
        assert_eq!(charged_to(&faults, 500_000), None);
        assert_eq!(charged_to(&faults, 3_000_000), Some(0));
        assert_eq!(server_bug_overlaps(&[3_000_000], &faults), 1);
        assert_eq!(server_bug_overlaps(&[500_000, 5_500_000], &faults), 0);
        assert_eq!(
            server_bug_overlaps(&[500_000, 1_500_000, 4_999_999, 7_000_000], &faults),
            2
        );
    }
}
