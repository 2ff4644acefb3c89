//! What to tell one Envoy about one bucket, as pure functions of what it reported, what it holds,
//! the rule and the time (the governor shape: state, now and inputs in, the next step out; the
//! stream task runs the steps). Nothing here knows protobuf or the store.

use crate::clock::MICROS_PER_SECOND;
use crate::limiter::Limit;

/// Envoy 1.40 reports every bucket every 5 s, whatever `reporting_interval` says.
pub const ENVOY_REPORT_INTERVAL_US: u64 = 5 * MICROS_PER_SECOND;

/// With room to spare, a grant is topped up when it would run out within this at the Envoy's
/// demand: a tick (every second) and a half, so the top-up lands before it runs out and what
/// the old grant still held when replaced is about that much demand.
const TOP_UP_LEAD_US: u64 = 1_500_000;

/// How long an `ALLOW_ALL` or a failure policy's `DENY_ALL` lasts without a report: long enough
/// that one lost report does not drop the Envoy into its fallback, short enough that a rule
/// change or a backend's return is seen soon (each report renews it).
pub const BLANKET_TTL_US: u64 = 3 * ENVOY_REPORT_INTERVAL_US;

/// How a bucket's requests are to be treated, from the rules now serving.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Treatment {
    /// No rule, an `unlimited` one, or an unknown domain: allowed.
    Allow,
    /// A `shadow_mode` rule (or global shadow mode): allowed, and what the Envoy admits is
    /// counted.
    Shadow,
    /// Limited: grants are drawn from the counters for a period that ends at `period_end_us`;
    /// `rate` is the tightest limit's requests per second, the first grant's guide. With
    /// `refill`, the grant is a refilling one (see [`Refill`]).
    Limited {
        period_end_us: u64,
        rate: f64,
        refill: Option<Refill>,
    },
}

/// A window shorter than Envoy's report interval ends several times between two reports, so
/// reports cannot say what an ended grant left unspent in time to give it back, and a grant of
/// its own for each window would leave the next window charged with all of the last one (see
/// [`Holding::carry`]). Such a bucket gets one token bucket that refills: it holds at most two
/// tokens and gains a little under `per_window − 1` a window (`wire::refilling`), so in any
/// window, whenever its assignment reached it, the Envoy admits at most `per_window` (what it
/// held at the window's start and what it gained stay under `per_window + 1`). The boundary
/// needs no new bucket: each window's tick charges that much to the window (and to the longer
/// tiers) and renews the assignment. The node's refilling grants of a counter commit at most
/// the window's limit together (`Fleet::committed`), so every window's charges fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refill {
    /// The shortest window, in whole seconds, under the report interval.
    pub window_s: u64,
    /// That window's limit.
    pub limit: u64,
}

impl Refill {
    /// The window's limit a second.
    pub fn rate(self) -> f64 {
        self.limit as f64 / self.window_s.max(1) as f64
    }
}

/// Whether `limits` are served refilling grants: all are windows, the shortest is a whole
/// number of seconds under the report interval, and every other's window is a whole number of
/// it (so its boundaries are all the grant's periods end on).
pub fn refill_of<'a>(limits: impl IntoIterator<Item = &'a Limit> + Clone) -> Option<Refill> {
    let shortest = limits.clone().into_iter().min_by_key(|l| l.period_us)?;
    let window_us = shortest.period_us;
    let eligible = window_us < ENVOY_REPORT_INTERVAL_US
        && window_us % MICROS_PER_SECOND == 0
        && limits.into_iter().all(|l| {
            l.algorithm.windowed()
                && (window_us == MICROS_PER_SECOND
                    || (l.calendar.is_none() && l.period_us % window_us == 0))
        });
    eligible.then_some(Refill {
        window_s: window_us / MICROS_PER_SECOND,
        limit: shortest.requests,
    })
}

/// Where a grant's period ends: the earliest end among the limits it is drawn from. A grant is
/// spent within the window it was charged to (and the moment after, until the end tick replaces
/// it: see the module), which is exact for the window algorithms (a hit
/// charged early in a window counts as one charged later in it; see `store::lease`); for the
/// others (buckets and the sliding log) the period is the current second, so a grant lives at
/// most a second and the fleet's excess is bounded by a second of the rate.
pub fn period_end_us<'a>(limits: impl IntoIterator<Item = &'a Limit>, now_us: u64) -> Option<u64> {
    let longest = next_multiple(now_us, MAX_PERIOD_US);
    limits
        .into_iter()
        .map(|limit| {
            let end = if limit.algorithm.windowed() {
                limit.window_at(now_us).1
            } else {
                next_multiple(now_us, MICROS_PER_SECOND)
            };
            end.min(longest)
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
/// second at once) that lasts past `until_us` by at least [`TICK_SLACK_US`], rounded up to the
/// second: the tick at the period's end (a few milliseconds after it) replaces every assignment
/// of the period before it expires, so the Envoy never waits in its fallback between periods.
/// Only if this node stops before that tick does an assignment outlive its period, by under
/// `1 s + TICK_SLACK_US`. None once the period is over.
pub fn ttl_seconds(now_us: u64, until_us: u64) -> Option<u64> {
    (until_us > now_us).then(|| {
        (until_us - now_us)
            .saturating_add(TICK_SLACK_US)
            .div_ceil(MICROS_PER_SECOND)
    })
}

/// How late the tick at a period's end may run before assignments of the period expire.
pub const TICK_SLACK_US: u64 = 250_000;

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
    /// A refilling grant ([`Refill`]): at most `per_window` admitted a window; `charged` to the
    /// window that ends at `until_us` (what the Envoy may admit in it).
    Refill {
        per_window: u64,
        charged: u64,
        until_us: u64,
        expires_us: u64,
        granted_us: u64,
    },
}

impl Assigned {
    /// What the counters were charged for the window the assignment belongs to (None: it is no
    /// grant).
    pub fn charged(&self) -> Option<u64> {
        match *self {
            Assigned::Tokens { size, .. } => Some(size),
            Assigned::Refill { charged, .. } => Some(charged),
            _ => None,
        }
    }

    /// What the Envoy may admit a window from now on, for the node's commitments.
    pub fn committed(&self) -> u64 {
        match *self {
            Assigned::Refill { per_window, .. } => per_window,
            _ => 0,
        }
    }
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
    /// Requests the Envoy reported allowed since the current grant, whole reports (the first may
    /// hold requests of the grant before): at most what the grant spent is this.
    reported_allowed: u64,
    /// Of those, reported after the grant's period ended: they may have been admitted after it.
    reported_late: u64,
    /// Grants that ended (replaced, or taken away) with tokens the reports did not show spent,
    /// waiting for the reports that settle them, oldest first.
    settling: Vec<Settling>,
    /// Tokens proven unspent by the last report, for the stream to give back (see `returned`).
    returned: u64,
    last_report_us: u64,
    /// A report over time (not the bucket's first, at 0 elapsed) has measured the demand.
    measured: bool,
    /// When a grant was last replaced (0: never): one replaced less than [`DELIVERY_BOUND_US`]
    /// before its window ended may not have reached the Envoy by then.
    replaced_us: u64,
    /// Reports in a row with no request.
    pub idle_reports: u32,
}

/// Tokens of ended grants that the Envoy's reports have not yet shown spent, and from when a
/// report settles them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Settling {
    unspent: u64,
    due_us: u64,
}

/// Ended grants kept apart while they wait (a refilling grant ends every window, several
/// between two reports); past this the youngest are kept together.
const SETTLING_KEPT: usize = 16;

/// How long a grant may take to reach its Envoy, as far as its denials go: the requests it
/// denied in that time, with the grant before it spent, do not say the new one ran out.
const DELIVERY_DENIALS_S: f64 = 0.1;

/// Longer than any message takes between sluice and an Envoy: a report that arrives this long
/// after a replacement was sent left the Envoy after the replacement reached it.
pub const DELIVERY_BOUND_US: u64 = MICROS_PER_SECOND;

/// What the node knows of a counter beyond this Envoy: every Envoy's demand for the bucket on
/// this node, what the counter had left after the last grant from it, and what this node's
/// Envoys hold of the period's grants, unspent as far as their reports tell.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Fleet {
    pub demand: f64,
    pub remaining: Option<u64>,
    pub held: u64,
    /// What this node's refilling grants of the counter commit a window, this Envoy's included
    /// (see [`Refill`]).
    pub committed: u64,
    /// Every Envoy's [`Holding::share_weight`] for the bucket on this node, this one's included.
    pub weight: f64,
}

/// Tokens a grant may still spend after the windows it was charged to ended (the period that
/// ended at `ended_us`), to charge to the windows that follow them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Carry {
    pub tokens: u64,
    pub ended_us: u64,
}

/// The next step for the bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Step {
    Nothing,
    /// Tell the same again with a new time to live (the Envoy keeps its tokens).
    Renew {
        ttl_s: u64,
    },
    /// Draw `want` tokens from the counters for the period that ends at `until_us`, and hand
    /// them over as a fresh bucket (`DENY_ALL` first, so the new one starts full). With a
    /// `carry`, first charge it to the windows that followed the ended ones (see
    /// [`Holding::carry`]).
    Grant {
        want: u64,
        until_us: u64,
        carry: Option<Carry>,
    },
    /// A refilling grant for the window (of `refill`) that ends at `until_us`: let the Envoy
    /// admit `per_window` a window (0: none, `DENY_ALL`), charging what
    /// [`Holding::refill_charge`] says.
    Refill {
        per_window: u64,
        until_us: u64,
        refill: Refill,
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
            reported_allowed: 0,
            reported_late: 0,
            settling: Vec::new(),
            returned: 0,
            last_report_us: 0,
            measured: false,
            replaced_us: 0,
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
            Treatment::Limited {
                period_end_us,
                refill: Some(refill),
                ..
            } => self.refill_on_report(period_end_us, refill, fleet),
            Treatment::Limited {
                period_end_us,
                rate,
                refill: None,
            } => self.limited(now_us, period_end_us, rate, fleet),
        }
    }

    fn learn(&mut self, usage: Usage, now_us: u64) {
        let untaken = self.settle(usage.allowed, now_us);
        self.reported_allowed = self.reported_allowed.saturating_add(untaken);
        if let Assigned::Tokens { until_us, .. } = self.assigned
            && until_us <= now_us
        {
            self.reported_late = self.reported_late.saturating_add(untaken);
        }
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
        self.measured |= usage.elapsed_us > 0;
        let (mut allowed, mut denied) = (usage.allowed, usage.denied);
        if let Assigned::Tokens { granted_us, .. } | Assigned::Refill { granted_us, .. } =
            self.assigned
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

    /// A grant for the period ending at `period_end_us`, sized by [`Holding::want`], with what
    /// the grant it replaces may still spend if its period has ended.
    fn grant(&self, now_us: u64, period_end_us: u64, rate: f64, fleet: Fleet) -> Step {
        let carry = self.carry(period_end_us);
        Step::Grant {
            want: self.want(now_us, period_end_us, rate, fleet),
            until_us: period_end_us,
            carry,
        }
    }

    /// **Nothing late.** Envoy spends a grant until its replacement reaches it, which is after
    /// the window it was charged to ended, so tokens charged to one window may be admitted in
    /// the next. What may be: the tokens of the grant the Envoy holds that its reports from
    /// before the window ended have not shown spent, and of grants replaced less than
    /// [`DELIVERY_BOUND_US`] before the window ended (which may not have reached it by then)
    /// those not yet settled. The stream charges
    /// them to the windows that follow the ended ones before it draws the new grant; the reports
    /// that settle the ended grant give back what they prove unspent there as well (see
    /// [`Holding::take_returned`]), since every request the ended grant admitted late is in
    /// them. None when the assignment's period has not ended.
    pub fn carry(&self, period_end_us: u64) -> Option<Carry> {
        let (ended_us, holds) = match self.assigned {
            Assigned::Tokens { until_us, size, .. } if until_us < period_end_us => (
                until_us,
                size.saturating_sub(self.reported_allowed.saturating_sub(self.reported_late)),
            ),
            Assigned::DenyAll { until_us, .. } if until_us < period_end_us => (until_us, 0),
            _ => return None,
        };
        let replaced_late = self.replaced_us.saturating_add(DELIVERY_BOUND_US) > ended_us;
        let settling = if replaced_late {
            self.settling
                .iter()
                .fold(0, |sum: u64, s| sum.saturating_add(s.unspent))
        } else {
            0
        };
        let tokens = holds.saturating_add(settling);
        (tokens > 0).then_some(Carry { tokens, ended_us })
    }

    /// A report under a refilling rule: a grant when the Envoy holds none for the window (or
    /// nothing was left and it still asks); its rate changes only at a window's end.
    fn refill_on_report(&self, period_end_us: u64, refill: Refill, fleet: Fleet) -> Step {
        match self.assigned {
            Assigned::Refill { until_us, .. } if until_us == period_end_us => Step::Nothing,
            Assigned::DenyAll { until_us, .. }
                if until_us == period_end_us && self.denied == 0 && self.used == 0 =>
            {
                Step::Nothing
            }
            _ => self.refill_step(period_end_us, refill, fleet),
        }
    }

    /// The refilling grant for the window ending at `period_end_us`, at the rate
    /// [`Holding::refill_rate`] says.
    fn refill_step(&self, period_end_us: u64, refill: Refill, fleet: Fleet) -> Step {
        Step::Refill {
            per_window: self.refill_rate(refill, fleet),
            until_us: period_end_us,
            refill,
        }
    }

    /// What to charge the window ending at `period_end_us` for a refilling grant of
    /// `per_window` sent at `now_us`: at a window's start, the higher of the old and new rate
    /// (the new one reaches the Envoy some time into the window); from within one, the token a
    /// new bucket starts with and the new rate for what is left of the window.
    pub fn refill_charge(
        &self,
        per_window: u64,
        now_us: u64,
        period_end_us: u64,
        window_s: u64,
    ) -> u64 {
        match self.assigned {
            Assigned::Refill {
                per_window: running,
                until_us,
                ..
            } if until_us < period_end_us => running.max(per_window),
            _ if per_window == 0 => 0,
            _ => {
                let window_us = window_s.saturating_mul(MICROS_PER_SECOND).max(1);
                let left_us = period_end_us.saturating_sub(now_us).min(window_us);
                let share = u128::from(per_window) * u128::from(left_us);
                let share = share.div_ceil(u128::from(window_us)) as u64;
                per_window.min(share.saturating_add(1))
            }
        }
    }

    /// How much of a refilling limit the Envoy's share weighs: its demand, or until a report
    /// over time says it, the limit's whole rate (its first report, one request, would make it a
    /// sliver, and it waits up to 5 s for the next). Every Envoy not yet measured weighs the
    /// same, so the first to come does not keep the limit from the others until then.
    pub fn share_weight(&self, refill: Refill) -> f64 {
        if self.measured {
            self.demand
        } else {
            self.demand.max(refill.rate())
        }
    }

    /// What a refilling grant may admit a window: the Envoy's demand over a window and a
    /// quarter more (so one under its share is not denied by how its requests fall), or the
    /// window's whole limit until a report over time says its demand; at most its share by
    /// weight (see [`Holding::share_weight`]) of the limit, and what the node's other refilling
    /// grants leave of it.
    pub fn refill_rate(&self, refill: Refill, fleet: Fleet) -> u64 {
        let wanted = if self.measured {
            (self.demand * refill.window_s as f64 * 1.25).ceil() + 1.0
        } else {
            refill.limit as f64
        };
        let weight = self.share_weight(refill);
        let share = refill.limit as f64 * weight / fleet.weight.max(weight).max(f64::MIN_POSITIVE);
        let committed = fleet.committed.saturating_sub(self.assigned.committed());
        let room = refill.limit.saturating_sub(committed);
        // `as` saturates a float (and maps NaN to 0).
        let per_window = wanted.min(share.floor().max(1.0)) as u64;
        per_window.min(room).min(MAX_GRANT)
    }

    fn limited(&mut self, now_us: u64, period_end_us: u64, rate: f64, fleet: Fleet) -> Step {
        let grant = |h: &Self| h.grant(now_us, period_end_us, rate, fleet);
        match self.assigned {
            Assigned::Tokens { size, until_us, .. } if until_us == period_end_us => {
                // Denials say the grant ran out only beyond those of the moment before it
                // reached the Envoy (the old one was spent then), which the report after it
                // also holds.
                let denials_before_it = self.demand * DELIVERY_DENIALS_S + 1.0;
                let spent = self.denied as f64 > denials_before_it || self.used >= size;
                let left = size.saturating_sub(self.used);
                // A fresh bucket replaces the old one, whose unspent rest is lost, so a grant
                // is topped up only about to run out: with room for everyone's demand, when
                // it would run out within a tick and a half at the demand seen (a tick does it
                // between reports, see `on_tick`); without, only once it is nearly spent, so
                // nothing is lost that another Envoy could have used.
                let plentiful = self.plentiful(now_us, period_end_us, fleet);
                let top_up = if plentiful {
                    self.runs_out_soon(now_us)
                } else {
                    left <= size / 8
                };
                // Short of room, a grant holding more than its Envoy will spend before the
                // period ends (it was sized on demand since fallen) is replaced by one sized on
                // the demand now: the rest goes back once a report settles it, in time for
                // another Envoy to use it within the period.
                let oversized = !plentiful && {
                    let seconds_left = period_end_us.saturating_sub(now_us) as f64 / 1e6;
                    let will_spend = (self.demand * seconds_left).ceil() as u64;
                    left >= 2 && left >= 2 * will_spend.max(1)
                };
                if spent || top_up || oversized {
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

    /// Whether the counter has room for every Envoy's present demand until the period ends
    /// (unknown counts as room: only a grant from it tells).
    fn plentiful(&self, now_us: u64, period_end_us: u64, fleet: Fleet) -> bool {
        let seconds_left = period_end_us.saturating_sub(now_us) as f64 / 1e6;
        fleet.remaining.is_none_or(|r| {
            r.saturating_add(fleet.held) as f64
                >= 1.1 * fleet.demand.max(self.demand) * seconds_left
        })
    }

    /// Whether the grant, as the last report left it, runs out within [`TOP_UP_LEAD_US`] of
    /// `now_us` at the demand seen.
    fn runs_out_soon(&self, now_us: u64) -> bool {
        let Assigned::Tokens {
            size, granted_us, ..
        } = self.assigned
        else {
            return false;
        };
        // Usage is counted from the later of the last report and the grant.
        let since = self.last_report_us.max(granted_us);
        let since_report_s = now_us.saturating_sub(since) as f64 / 1e6;
        let left = size.saturating_sub(self.used) as f64 - self.demand * since_report_s;
        left <= self.demand * TOP_UP_LEAD_US as f64 / 1e6
    }

    /// What the Envoy holds of grants for the period ending at `period_end_us`, unspent as far
    /// as its reports tell.
    pub fn unspent(&self, period_end_us: u64) -> u64 {
        match self.assigned {
            Assigned::Tokens { until_us, .. } | Assigned::Refill { until_us, .. }
                if until_us == period_end_us =>
            {
                self.assigned
                    .charged()
                    .unwrap_or(0)
                    .saturating_sub(self.used)
            }
            _ => 0,
        }
    }

    /// Tokens to ask for: the Envoy's demand over the horizon (or what is left of the period),
    /// at most its share of what the counter has left by demand, at least one. A bucket's
    /// grants before any 5-second report says its demand are at least the limit's rate until
    /// the next report, so an Envoy under the limit is not denied while it waits for it.
    pub fn want(&self, now_us: u64, period_end_us: u64, rate: f64, fleet: Fleet) -> u64 {
        let left_us = period_end_us.saturating_sub(now_us);
        // Plenty left: two reports' worth, so a top-up is rarely needed. Little left: just past
        // the next report, so what an Envoy holds unspent when it is topped up is small.
        let horizon_us = if self.plentiful(now_us, period_end_us, fleet) {
            2 * ENVOY_REPORT_INTERVAL_US
        } else {
            ENVOY_REPORT_INTERVAL_US * 11 / 10
        };
        let horizon_s = horizon_us.min(left_us) as f64 / 1e6;
        let mut want = (self.demand * horizon_s).ceil();
        // Until a report over time says the demand (the first is one request, at 0 elapsed),
        // grants are at least the limit's rate until the next report: a window shorter than the
        // report interval would otherwise be granted a request a second until it comes.
        if self.assigned == Assigned::Nothing || !self.measured {
            let until_report_s = ENVOY_REPORT_INTERVAL_US.min(left_us) as f64 / 1e6;
            want = want.max((rate * until_report_s).ceil());
        }
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
        // The period the assignment belongs to (0: none, yet it should have one: reported but
        // not granted, or allowed under rules that have changed since).
        let current = match self.assigned {
            Assigned::Tokens { until_us, .. }
            | Assigned::Refill { until_us, .. }
            | Assigned::DenyAll { until_us, .. } => Some(until_us),
            Assigned::Nothing if self.last_report_us != 0 => Some(0),
            Assigned::AllowAll { .. } => Some(0),
            Assigned::Nothing => None,
        };
        if let Treatment::Limited {
            period_end_us,
            rate,
            refill,
        } = treatment
        {
            let new_period = current.is_some_and(|until_us| until_us != period_end_us);
            if let Some(refill) = refill {
                if new_period {
                    self.grant_between_reports = true;
                    return self.refill_step(period_end_us, refill, fleet);
                }
                return self.renewal(now_us);
            }
            // With room to spare, a grant about to run out is topped up between reports.
            let top_up = matches!(self.assigned,
                Assigned::Tokens { until_us, .. } if until_us == period_end_us)
                && self.demand > 0.0
                && self.plentiful(now_us, period_end_us, fleet)
                && self.runs_out_soon(now_us);
            if new_period || top_up {
                self.grant_between_reports = true;
                return self.grant(now_us, period_end_us, rate, fleet);
            }
        }
        self.renewal(now_us)
    }

    /// A renewal when the assignment would expire within a second, before its period ends.
    fn renewal(&self, now_us: u64) -> Step {
        match self.assigned {
            Assigned::Tokens {
                until_us,
                expires_us,
                ..
            }
            | Assigned::Refill {
                until_us,
                expires_us,
                ..
            }
            | Assigned::DenyAll {
                until_us,
                expires_us,
            } if expires_us < until_us + TICK_SLACK_US
                && expires_us <= now_us + MICROS_PER_SECOND =>
            {
                match ttl_seconds(now_us, until_us) {
                    Some(ttl_s) => Step::Renew { ttl_s },
                    None => Step::Nothing,
                }
            }
            _ => Step::Nothing,
        }
    }

    /// A report's `allowed` settles the ended grants: every one of those requests may have been
    /// spent from them (after their last report, before the Envoy had their replacement), so
    /// they are taken from the waiting grants' tokens, oldest first, and what a grant due to
    /// settle has left after that is proven unspent. What they do not take is the held grant's
    /// (returned): each request is taken once, from the earliest grant that may have spent it,
    /// so a grant gives back too little when a later one spent the requests taken from it, and
    /// the later one makes up for it only when it settles after it — never too much at any
    /// moment (they give back to the same windows, see `stream::end_grant`).
    fn settle(&mut self, allowed: u64, now_us: u64) -> u64 {
        let mut allowed = allowed;
        let mut returned = 0u64;
        self.settling.retain_mut(|s| {
            let taken = allowed.min(s.unspent);
            s.unspent -= taken;
            allowed -= taken;
            let settled = s.due_us <= now_us || s.unspent == 0;
            if settled {
                returned = returned.saturating_add(s.unspent);
            }
            !settled
        });
        self.returned = self.returned.saturating_add(returned);
        allowed
    }

    /// Tokens of ended grants the reports proved unspent since last asked: the stream gives them
    /// back to every limit whose window is still the one they were charged to. **The bound**: a
    /// grant's tokens not shown spent are its size less the requests its reports showed, less
    /// those of the reports after its end that [`Holding::settle`] takes from it. It settles with
    /// the first report that surely left the Envoy after its replacement reached it: the next
    /// one when it was replaced in answer to a report, else one that arrives
    /// [`DELIVERY_BOUND_US`] after the replacement was sent.
    pub fn take_returned(&mut self) -> u64 {
        std::mem::take(&mut self.returned)
    }

    /// Whether an ended grant still waits for a report to settle it.
    pub fn settling(&self) -> bool {
        !self.settling.is_empty()
    }

    /// The Envoy was told `assigned`. A grant it replaces ends: what its reports did not show
    /// spent settles with the next reports (see [`Holding::take_returned`]).
    pub fn assign(&mut self, assigned: Assigned, now_us: u64) {
        if let Some(size) = self.assigned.charged()
            && assigned != self.assigned
        {
            self.replaced_us = now_us;
            let unspent = size.saturating_sub(self.reported_allowed);
            // Replaced in answer to a report: the next report left the Envoy after the
            // replacement reached it. Replaced between reports (a tick): only one that arrives
            // a delivery's bound after it surely did.
            let due_us = if self.grant_between_reports {
                now_us.saturating_add(DELIVERY_BOUND_US)
            } else {
                now_us.saturating_add(1)
            };
            if unspent > 0 {
                if self.settling.len() >= SETTLING_KEPT
                    && let Some(youngest) = self.settling.last_mut()
                {
                    youngest.unspent = youngest.unspent.saturating_add(unspent);
                    youngest.due_us = youngest.due_us.max(due_us);
                } else {
                    self.settling.push(Settling { unspent, due_us });
                }
            }
        }
        if matches!(
            assigned,
            Assigned::Tokens { .. } | Assigned::Refill { .. } | Assigned::DenyAll { .. }
        ) {
            self.reported_allowed = 0;
            self.reported_late = 0;
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
            | Assigned::Refill { expires_us, .. }
            | Assigned::DenyAll { expires_us, .. }
            | Assigned::AllowAll { expires_us } => *expires_us = expires,
            Assigned::Nothing => {}
        }
    }
}

#[cfg(test)]
mod tests;
