//! A batch's checks as `batch.lua` reads them, and its answer as verdicts: the script's
//! encoding beside its decoding (`script` carries the bytes to Redis and back).

use crate::limiter::{Algorithm, Verdict};
use crate::store::{Check, CheckKind};

/// One check's arguments as `batch.lua` reads them: a head (algorithm + 8 × kind + 32 × how
/// many optional fields follow + 256 for a calendar limit), hits, requests, period, then burst,
/// tick, cap, until and slot with the trailing zeros left off (burst and tick are sent only to
/// the algorithms that read them; a slot only by a concurrency limit's check), then a calendar
/// limit's windows around `node_now_us`: Redis picks the one its own clock is in, so decisions
/// stay on Redis `TIME`.
pub(super) fn push_check(args: &mut Vec<u64>, check: &Check<'_>, node_now_us: u64) {
    let kind: u64 = match check.kind {
        CheckKind::Enforce => 1,
        CheckKind::Shadow => 2,
        CheckKind::Refund => 3,
    };
    let limit = &check.limit;
    let algorithm = limit.algorithm;
    let optional = [
        if algorithm.has_burst() {
            limit.burst
        } else {
            0
        },
        if algorithm.has_ticks() {
            limit.tick_us
        } else {
            0
        },
        limit.overdraft_cap(),
        check.until_us,
        check.slot,
    ];
    let extra = optional
        .iter()
        .rposition(|&v| v != 0)
        .map_or(0, |last| last + 1);
    const {
        assert!(
            Algorithm::MAX_ID < 8,
            "batch.lua reads the algorithm from the head's low 3 bits"
        )
    };
    // Past the calendar's range (the year 9999) the limit falls back to the aligned period,
    // as `Limit::window_at` does.
    let windows = limit.calendar.and_then(|c| c.around(node_now_us).ok());
    let head = u64::from(algorithm.id())
        + 8 * kind
        + 32 * extra as u64
        + if windows.is_some() { 256 } else { 0 };
    args.extend([head, check.hits, limit.requests, limit.period_us]);
    args.extend_from_slice(&optional[..extra]);
    if let Some(windows) = windows {
        args.extend(windows);
    }
}

/// What one script run answered.
pub(super) struct GroupReply {
    pub(super) allowed: bool,
    /// Redis's clock when it decided.
    pub(super) now_us: u64,
    pub(super) verdicts: Vec<Verdict>,
}

/// A group's answer (4 integers per check, counted by `script::answers`) as verdicts; the group
/// was allowed when each of its enforced checks was.
pub(super) fn group_reply(
    (now_us, values): (i64, Vec<i64>),
    checks: &[Check<'_>],
    indices: &[usize],
) -> GroupReply {
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    let verdicts: Vec<Verdict> = values
        .chunks_exact(4)
        .map(|v| Verdict {
            allowed: v[0] == 1,
            remaining: n(v[1]),
            reset_after_us: n(v[2]),
            retry_after_us: n(v[3]),
        })
        .collect();
    let allowed = indices
        .iter()
        .zip(&verdicts)
        .all(|(&i, v)| v.allowed || checks[i].kind != CheckKind::Enforce);
    GroupReply {
        allowed,
        now_us: n(now_us),
        verdicts,
    }
}
