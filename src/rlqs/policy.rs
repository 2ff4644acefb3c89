//! What to tell one Envoy about one bucket, as pure functions of what it reported, what it holds,
//! the rule and the time (the governor shape: state, now and inputs in, the next step out; the
//! stream task runs the steps). Nothing here knows protobuf or the store.

use crate::clock::MICROS_PER_SECOND;
use crate::limiter::Limit;

/// Envoy 1.40 reports every bucket every 5 s, whatever `reporting_interval` says.
pub const ENVOY_REPORT_INTERVAL_US: u64 = 5 * MICROS_PER_SECOND;

/// A grant is sized to this much of the Envoy's demand, so it lasts past the next report.
const HORIZON_US: u64 = 2 * ENVOY_REPORT_INTERVAL_US;

/// How long an `ALLOW_ALL` or a failure policy's `DENY_ALL` lasts without a report: long enough
/// that one lost report does not drop the Envoy into its fallback, short enough that a rule
/// change or a backend's return is seen soon (each report renews it).
pub const BLANKET_TTL_US: u64 = 3 * ENVOY_REPORT_INTERVAL_US;

/// How a bucket's requests are to be treated, from the rules now serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// No rule, an `unlimited` one, or an unknown domain: allowed.
    Allow,
    /// A `shadow_mode` rule (or global shadow mode): allowed, and what the Envoy admits is
    /// counted.
    Shadow,
    /// Limited: grants are drawn from the counters for a period that ends at `period_end_us`.
    Limited { period_end_us: u64 },
}

/// Where a grant's period ends: the earliest end among the limits it is drawn from. A grant is
/// spent within the window it was charged to, which is exact for the window algorithms (a hit
/// charged early in a window counts as one charged later in it; see `store::lease`); for the
/// others (buckets and the sliding log) the period is the current second, so a grant lives at
/// most a second and the fleet's excess is bounded by a second of the rate.
pub fn period_end_us<'a>(limits: impl IntoIterator<Item = &'a Limit>, now_us: u64) -> Option<u64> {
    let longest = next_multiple(now_us, MAX_PERIOD_US);
    limits
        .into_iter()
        .map(|limit| {
            let period = if limit.algorithm.leasable() {
                limit.period_us
            } else {
                MICROS_PER_SECOND
            };
            next_multiple(now_us, period).min(longest)
        })
        .min()
}

/// A grant lives at most this long (aligned to the epoch, so a period's end is the same at every
/// moment of it): longer windows are granted in 64-day periods. It keeps "no refill" true (see
/// `wire::NO_REFILL_SECONDS`).
pub const MAX_PERIOD_US: u64 = 64 * 86_400 * MICROS_PER_SECOND;

/// The first multiple of `period` after `now_us`.
fn next_multiple(now_us: u64, period: u64) -> u64 {
    (now_us / period).saturating_add(1).saturating_mul(period)
}

/// A time to live in whole seconds (Envoy reads no fraction, and expires an assignment under a
/// second at once) that ends by `until_us`, or up to [`TTL_SLACK_US`] past it: ticks run a few
/// milliseconds after the second, where windows end. None when less than a second is left.
pub fn ttl_seconds(now_us: u64, until_us: u64) -> Option<u64> {
    let seconds = until_us.saturating_sub(now_us).saturating_add(TTL_SLACK_US) / MICROS_PER_SECOND;
    (seconds >= 1).then_some(seconds)
}

/// How far past its window an assignment may live: the lateness a tick is allowed. At the
/// window's end the next grant replaces it anyway.
pub const TTL_SLACK_US: u64 = 50_000;

/// What this node last told the Envoy about the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assigned {
    /// Nothing yet: the Envoy follows its `no_assignment_behavior`.
    Nothing,
    AllowAll {
        expires_us: u64,
    },
    /// No quota is left until `until_us` (or the failure policy says deny).
    DenyAll {
        until_us: u64,
        expires_us: u64,
    },
    /// `size` tokens, charged to the counters for the period that ends at `until_us`, as a token
    /// bucket that does not refill within its life.
    Tokens {
        size: u64,
        until_us: u64,
        expires_us: u64,
        granted_us: u64,
    },
}

/// One report's numbers for the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub allowed: u64,
    pub denied: u64,
    /// Since the previous report; 0 in a bucket's first (Envoy 1.40 sends 0 there).
    pub elapsed_us: u64,
}

/// One Envoy's bucket, as this node sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Holding {
    pub assigned: Assigned,
    /// Requests per second the Envoy saw for the bucket (allowed and denied), smoothed.
    pub demand: f64,
    /// Reported since the last grant.
    used: u64,
    denied: u64,
    /// The first report after a grant made between reports also counts requests from before
    /// it: only the share of it after the grant is counted.
    grant_between_reports: bool,
    last_report_us: u64,
    /// Reports in a row with no request.
    pub idle_reports: u32,
}

/// What the node knows of a counter beyond this Envoy: every Envoy's demand for the bucket on
/// this node, and what the counter had left after the last grant from it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Fleet {
    pub demand: f64,
    pub remaining: Option<u64>,
}

/// The next step for the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Nothing,
    /// Tell the same again with a new time to live (the Envoy keeps its tokens).
    Renew {
        ttl_s: u64,
    },
    /// Draw `want` tokens from the counters for the period that ends at `until_us`, and hand
    /// them over as a fresh bucket (`DENY_ALL` first, so the new one starts full).
    Grant {
        want: u64,
        until_us: u64,
    },
    AllowAll,
    /// Charge what a shadow rule's Envoy admitted (the rule counts, never denies).
    Count {
        hits: u64,
    },
    /// Forget the bucket: the Envoy drops it and its usage, and reports it anew if it comes
    /// back.
    Abandon,
}

impl Default for Holding {
    fn default() -> Self {
        Self {
            assigned: Assigned::Nothing,
            demand: 0.0,
            used: 0,
            denied: 0,
            grant_between_reports: false,
            last_report_us: 0,
            idle_reports: 0,
        }
    }
}

/// The largest grant: `max_tokens` is a 32-bit field.
pub const MAX_GRANT: u64 = u32::MAX as u64;

impl Holding {
    /// The Envoy reported the bucket at `now_us`.
    pub fn on_report(
        &mut self,
        usage: Usage,
        now_us: u64,
        treatment: Treatment,
        fleet: Fleet,
        idle_reports_to_abandon: u32,
    ) -> Step {
        self.learn(usage, now_us);
        if idle_reports_to_abandon > 0 && self.idle_reports >= idle_reports_to_abandon {
            return Step::Abandon;
        }
        match treatment {
            Treatment::Allow => Step::AllowAll,
            Treatment::Shadow if usage.allowed > 0 => Step::Count {
                hits: usage.allowed,
            },
            Treatment::Shadow => Step::AllowAll,
            Treatment::Limited { period_end_us } => self.limited(now_us, period_end_us, fleet),
        }
    }

    fn learn(&mut self, usage: Usage, now_us: u64) {
        let requests = usage.allowed.saturating_add(usage.denied);
        self.idle_reports = if requests == 0 {
            self.idle_reports.saturating_add(1)
        } else {
            0
        };
        // A first report (0 elapsed) is the request that made the bucket: call it a second's.
        let seconds = (usage.elapsed_us.max(MICROS_PER_SECOND)) as f64 / MICROS_PER_SECOND as f64;
        let rate = requests as f64 / seconds;
        self.demand = if self.last_report_us == 0 {
            rate
        } else {
            // Smoothed over about two reports: a burst raises it at once, a lull lowers it
            // over ten seconds.
            rate.max(0.5 * self.demand + 0.5 * rate)
        };
        self.last_report_us = now_us;
        let (mut allowed, mut denied) = (usage.allowed, usage.denied);
        if let Assigned::Tokens { granted_us, .. } = self.assigned
            && self.grant_between_reports
        {
            // Only the share of this report that came after the grant.
            let after = now_us.saturating_sub(granted_us).min(usage.elapsed_us);
            let share = |n: u64| {
                if usage.elapsed_us == 0 {
                    n
                } else {
                    (u128::from(n) * u128::from(after) / u128::from(usage.elapsed_us)) as u64
                }
            };
            (allowed, denied) = (share(allowed), 0);
            self.grant_between_reports = false;
        }
        self.used = self.used.saturating_add(allowed);
        self.denied = self.denied.saturating_add(denied);
    }

    fn limited(&mut self, now_us: u64, period_end_us: u64, fleet: Fleet) -> Step {
        let grant = |h: &Self| Step::Grant {
            want: h.want(now_us, period_end_us, fleet),
            until_us: period_end_us,
        };
        match self.assigned {
            Assigned::Tokens { size, until_us, .. } if until_us == period_end_us => {
                let spent = self.denied > 0 || self.used >= size;
                let left = size.saturating_sub(self.used);
                let seconds_left = period_end_us.saturating_sub(now_us) as f64 / 1e6;
                let plentiful = fleet
                    .remaining
                    .is_none_or(|r| r as f64 >= 2.0 * fleet.demand.max(self.demand) * seconds_left);
                let until_next_report = self.demand * 1.25 * ENVOY_REPORT_INTERVAL_US as f64 / 1e6;
                // Plenty left: top up before it runs out (what it still holds is lost, and
                // that is affordable). Scarce: only when (nearly) spent, so nothing is wasted
                // that another Envoy could have used.
                let top_up = if plentiful {
                    left as f64 <= until_next_report
                } else {
                    left <= size / 8
                };
                if spent || top_up {
                    grant(self)
                } else {
                    Step::Nothing
                }
            }
            // Nothing was left: try again when the Envoy still wants some.
            Assigned::DenyAll { until_us, .. } if until_us == period_end_us => {
                if self.denied > 0 || self.used > 0 {
                    grant(self)
                } else {
                    Step::Nothing
                }
            }
            _ => grant(self),
        }
    }

    /// Tokens to ask for: the Envoy's demand over the horizon (or what is left of the period),
    /// at most its share of what the counter has left by demand, at least one.
    pub fn want(&self, now_us: u64, period_end_us: u64, fleet: Fleet) -> u64 {
        let horizon_s = HORIZON_US.min(period_end_us.saturating_sub(now_us)) as f64 / 1e6;
        let mut want = (self.demand * horizon_s).ceil();
        if let Some(remaining) = fleet.remaining {
            let share = self.demand / fleet.demand.max(self.demand).max(f64::MIN_POSITIVE);
            want = want.min((remaining as f64 * share).ceil());
        }
        // `as` saturates a float (and maps NaN to 0).
        (want as u64).clamp(1, MAX_GRANT)
    }

    /// The periodic check at `now_us`: a new period's grant at the boundary, and a renewal so
    /// that an assignment lasts to its period's end but never past it.
    pub fn on_tick(&mut self, now_us: u64, treatment: Treatment, fleet: Fleet) -> Step {
        match (self.assigned, treatment) {
            (Assigned::Tokens { until_us, .. }, Treatment::Limited { period_end_us })
            | (Assigned::DenyAll { until_us, .. }, Treatment::Limited { period_end_us })
                if until_us != period_end_us =>
            {
                self.grant_between_reports = true;
                Step::Grant {
                    want: self.want(now_us, period_end_us, fleet),
                    until_us: period_end_us,
                }
            }
            (
                Assigned::Tokens {
                    until_us,
                    expires_us,
                    ..
                }
                | Assigned::DenyAll {
                    until_us,
                    expires_us,
                },
                _,
            ) if expires_us < until_us && expires_us <= now_us + MICROS_PER_SECOND => {
                match ttl_seconds(now_us, until_us) {
                    Some(ttl_s) => Step::Renew { ttl_s },
                    None => Step::Nothing,
                }
            }
            _ => Step::Nothing,
        }
    }

    /// The Envoy was told `assigned`.
    pub fn assign(&mut self, assigned: Assigned) {
        if matches!(assigned, Assigned::Tokens { .. } | Assigned::DenyAll { .. }) {
            self.used = 0;
            self.denied = 0;
        }
        self.assigned = assigned;
    }

    /// A renewal was sent at `now_us` for `ttl_s` seconds.
    pub fn renewed(&mut self, now_us: u64, ttl_s: u64) {
        let expires = now_us.saturating_add(ttl_s.saturating_mul(MICROS_PER_SECOND));
        match &mut self.assigned {
            Assigned::Tokens { expires_us, .. }
            | Assigned::DenyAll { expires_us, .. }
            | Assigned::AllowAll { expires_us } => *expires_us = expires,
            Assigned::Nothing => {}
        }
    }
}

#[cfg(test)]
mod tests;
