//! Rate-limit algorithms as pure functions.
//!
//! Each algorithm is `decide(limit, state, now, hits) -> (verdict, update)` and
//! `refund(limit, state, now, hits) -> next state`: no I/O, no clock, no locks. A store runs them
//! inside whatever atomic read-modify-write it has (a shard lock in memory, a Lua script in Redis)
//! and applies the update only when it commits.
//!
//! All arithmetic is on unsigned integers. Time is in microseconds since the Unix epoch; the
//! algorithms that need products (sliding window, the buckets) work in ticks of `tick_us`, chosen
//! per limit so every product stays at or below 2^53. That keeps the Rust code and its Lua twin
//! (Lua numbers are doubles) bit-for-bit equal.
//!
//! An algorithm's facts are properties of [`Algorithm`] ([`Algorithm::has_burst`],
//! [`Algorithm::leasable`], [`Algorithm::counts_past_limit`], [`Algorithm::denial_is_steady`]):
//! the layers read them instead of matching on algorithms, and error messages list the
//! algorithms from them.
//!
//! # Adding an algorithm
//!
//! 1. Rust: a variant of [`Algorithm`], its `name`, `id` (the next number: the Redis script
//!    packs it in 3 bits, checked at compile time in `store::redis`) and its facts — each is a
//!    `match`, so a missing arm does not compile. Add it to [`Algorithm::ALL`] (the test
//!    `all_lists_every_id` fails otherwise). A module here with `decide` and `refund`, wired
//!    into [`decide`] and [`refund`]; a new [`State`] shape needs the memory store's `Kind`
//!    (2 bits, all four used: widen `KIND_BITS`, checked at compile time) and its `Log`-style
//!    handling if it is not three words.
//! 2. Lua: its twin in `src/store/redis/lua/`, named in the include list of `body!` in
//!    `store::redis::script` (the test `every_lua_file_is_in_the_body` fails otherwise), and its
//!    functions at its id's place in `batch.lua`'s dispatch tables (`decide_of`, `commit_of`,
//!    `refund_of`; `dispatch_tables_have_an_entry_per_algorithm` counts them).
//! 3. Twins: its state generator in `tests/twins.rs` (an exhaustive `match`) and a test in
//!    `twin_tests!(PROVEN, ...)` there; if it counts past its limit
//!    ([`Algorithm::counts_past_limit`]), one in `twin_tests!(PROVEN_OVERDRAFT, ...)` too.
//!    `every_algorithm_is_proven` names a missing one.
//! 4. Docs: the algorithm table of `docs/rules.md` and the rules' schema text (`rules::parse`); the test
//!    `readme_names_every_algorithm` names a missing one.

mod bucket;
mod concurrency;
mod fixed_window;
mod sliding_log;
mod sliding_window;

use std::collections::VecDeque;
use std::fmt;

use crate::calendar::CalendarRef;

/// Products in the algorithms never exceed this (the largest integer a double holds exactly).
pub const EXACT_MAX: u64 = 1 << 53;

/// Times stay below this (2^52 µs after the epoch: the year 2112), and so does the time a full
/// bucket takes to drain: their sum, a bucket's empty time, stays exact in a double.
pub const TIME_MAX: u64 = 1 << 52;

/// Largest `requests_per_unit` for a sliding log: it keeps one entry per admitted request.
pub const SLIDING_LOG_MAX: u64 = 100_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// A counter per epoch-aligned window (the Go reference service's algorithm).
    #[default]
    FixedWindow,
    /// The current and previous window's counters, the previous one weighted by how much of it
    /// still overlaps the sliding window: an estimate that smooths the window edge.
    SlidingWindow,
    /// Exact: one timestamp per admitted request, kept for one period.
    SlidingLog,
    /// Tokens refill continuously at the rate up to `burst`; a request takes `hits` tokens.
    TokenBucket,
    /// A level that drains continuously at the rate; a request that would overflow `burst` is
    /// denied (the leaky bucket as a meter).
    LeakyBucket,
    /// Generic cell rate algorithm: a theoretical arrival time, with tolerance `burst`.
    Gcra,
    /// At most `requests` requests in flight: each holds a slot from its acquiring call until
    /// its release, or for at most `period_us` (a rule's `concurrency:`, see `concurrency`).
    Concurrency,
}

impl Algorithm {
    pub const ALL: [Algorithm; 7] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::Gcra,
        Algorithm::Concurrency,
    ];

    /// The algorithms that count hits against a rate: every one but concurrency, which counts
    /// requests in flight (what a `rate_limit:`'s `algorithm` may name).
    pub const RATES: [Algorithm; 6] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::Gcra,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::LeakyBucket => "leaky_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::Concurrency => "concurrency",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Whether the algorithm computes with products of time and counts, in ticks (see
    /// `Limit::tick_us`); the others count whole windows or keep stamps.
    pub const fn has_ticks(self) -> bool {
        match self {
            Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::Concurrency => false,
            Algorithm::SlidingWindow
            | Algorithm::TokenBucket
            | Algorithm::LeakyBucket
            | Algorithm::Gcra => true,
        }
    }

    /// Whether `burst` means something for this algorithm: it keeps a level that drains
    /// continuously, up to a capacity.
    pub const fn has_burst(self) -> bool {
        match self {
            Algorithm::FixedWindow
            | Algorithm::SlidingWindow
            | Algorithm::SlidingLog
            | Algorithm::Concurrency => false,
            Algorithm::TokenBucket | Algorithm::LeakyBucket | Algorithm::Gcra => true,
        }
    }

    /// Whether it counts hits by window: a hit charged early in the current window counts
    /// exactly like one charged later in it, and what the window has left stays left until the
    /// window ends. Buckets drain as time passes, and a sliding log stamps each hit with when it
    /// was charged.
    pub const fn windowed(self) -> bool {
        match self {
            Algorithm::FixedWindow | Algorithm::SlidingWindow => true,
            Algorithm::SlidingLog
            | Algorithm::TokenBucket
            | Algorithm::LeakyBucket
            | Algorithm::Gcra
            | Algorithm::Concurrency => false,
        }
    }

    /// Whether a lease of quota (`mode: hybrid`, see `store::lease`) can never over-admit: the
    /// algorithm is [windowed](Algorithm::windowed). A bucket would drain while a lease sits
    /// unused, and a sliding log's early charges expire early, so they stay strict.
    pub const fn leasable(self) -> bool {
        self.windowed()
    }

    /// Whether usage past the limit can be kept exactly, as a cost limit (`overdraft`) needs: a
    /// fixed window's count, a bucket's level. A sliding window's weighted estimate and a
    /// sliding log's stamps cannot.
    pub const fn counts_past_limit(self) -> bool {
        match self {
            Algorithm::FixedWindow
            | Algorithm::TokenBucket
            | Algorithm::LeakyBucket
            | Algorithm::Gcra => true,
            Algorithm::SlidingWindow | Algorithm::SlidingLog | Algorithm::Concurrency => false,
        }
    }

    /// Whether the algorithm's window can be a calendar's (a month in a time zone, see
    /// `calendar`): a fixed window's count only needs the window's bounds. The others weigh or
    /// drain over a period of fixed length.
    pub const fn has_calendar_windows(self) -> bool {
        match self {
            Algorithm::FixedWindow => true,
            Algorithm::SlidingWindow
            | Algorithm::SlidingLog
            | Algorithm::TokenBucket
            | Algorithm::LeakyBucket
            | Algorithm::Gcra
            | Algorithm::Concurrency => false,
        }
    }

    /// Whether a denial's status stays as it was until the request fits, whatever it asked: a
    /// fixed window's count only changes when the window ends. (Elsewhere a denial is steady
    /// only when one more hit would have fitted.) The over-limit cache relies on it.
    pub const fn denial_is_steady(self) -> bool {
        match self {
            Algorithm::FixedWindow => true,
            Algorithm::SlidingWindow
            | Algorithm::SlidingLog
            | Algorithm::TokenBucket
            | Algorithm::LeakyBucket
            | Algorithm::Gcra
            | Algorithm::Concurrency => false,
        }
    }

    /// Whether a denied counter fits again only as time passes: a window ends, a bucket drains,
    /// a stamp expires. A concurrency limit's slot comes back when any request in flight ends
    /// (its release), at any moment and on any node, so a denial of it says nothing of the next
    /// call. The over-limit cache relies on it.
    pub const fn room_returns_with_time(self) -> bool {
        match self {
            Algorithm::FixedWindow
            | Algorithm::SlidingWindow
            | Algorithm::SlidingLog
            | Algorithm::TokenBucket
            | Algorithm::LeakyBucket
            | Algorithm::Gcra => true,
            Algorithm::Concurrency => false,
        }
    }

    /// Whether a check names a slot (the request's own, see `concurrency`) besides its counter.
    pub const fn holds_slots(self) -> bool {
        matches!(self, Algorithm::Concurrency)
    }

    /// A stable one-byte identity, part of storage keys.
    pub const fn id(self) -> u8 {
        match self {
            Algorithm::FixedWindow => 1,
            Algorithm::SlidingWindow => 2,
            Algorithm::SlidingLog => 3,
            Algorithm::TokenBucket => 4,
            Algorithm::LeakyBucket => 5,
            Algorithm::Gcra => 6,
            Algorithm::Concurrency => 7,
        }
    }

    /// The largest [`Algorithm::id`].
    pub const MAX_ID: u8 = {
        let mut max = 0;
        let mut i = 0;
        while i < Self::ALL.len() {
            if Self::ALL[i].id() > max {
                max = Self::ALL[i].id();
            }
            i += 1;
        }
        max
    };

    /// The names of the algorithms with a property, for messages: "a, b and c".
    pub fn names_where(property: fn(Algorithm) -> bool) -> String {
        let names: Vec<&str> = Self::ALL
            .into_iter()
            .filter(|&a| property(a))
            .map(Algorithm::name)
            .collect();
        match names.split_last() {
            None => String::new(),
            Some((last, [])) => (*last).to_owned(),
            Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LimitError {
    #[error("the period must be at least one second")]
    ZeroPeriod,
    #[error("burst must be at least 1")]
    ZeroBurst,
    #[error(
        "burst applies only to {names}, not to {0}",
        names = Algorithm::names_where(Algorithm::has_burst)
    )]
    BurstNotApplicable(Algorithm),
    #[error(
        "sliding_log keeps one entry per request and allows at most {SLIDING_LOG_MAX} requests per unit; use sliding_window for larger limits"
    )]
    SlidingLogTooLarge,
    #[error(
        "{requests} requests (or burst) per {period_s} s is too fine-grained to compute exactly; use a shorter unit"
    )]
    OutOfRange { requests: u64, period_s: u64 },
    #[error(
        "overdraft applies to {names}, not to {0} (it cannot count past its limit exactly)",
        names = Algorithm::names_where(Algorithm::counts_past_limit)
    )]
    OverdraftNotApplicable(Algorithm),
    #[error(
        "a full bucket of {burst} drains at {requests} per {period_s} s in more than 142 years; raise the rate or lower the burst"
    )]
    DrainsTooSlowly {
        burst: u64,
        requests: u64,
        period_s: u64,
    },
    #[error(
        "calendar windows apply to {names}, not to {0}",
        names = Algorithm::names_where(Algorithm::has_calendar_windows)
    )]
    CalendarNotApplicable(Algorithm),
}

/// What one limit allows, in the units the algorithms compute with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    pub algorithm: Algorithm,
    /// Requests per period (the rate for buckets).
    pub requests: u64,
    pub period_us: u64,
    /// Capacity of the buckets; equal to `requests` for the window algorithms.
    pub burst: u64,
    /// Time resolution of the products (1 µs for most limits, coarser for long periods).
    pub tick_us: u64,
    /// A cost limit (`overdraft: true`): a request is allowed while at least one unit is left,
    /// and every hit it carries is recorded, past the limit too (a window counts over it, a
    /// bucket's level goes into debt), so later requests wait until usage is back under.
    pub overdraft: bool,
    /// A calendar window (`calendar:`): the window is the day, week, month or year holding the
    /// time in that zone, instead of an epoch-aligned `period_us` (then the unit's nominal
    /// length, for what only needs a rate or a size).
    pub calendar: Option<CalendarRef>,
}

impl Limit {
    pub fn new(
        algorithm: Algorithm,
        requests: u64,
        period_us: u64,
        burst: Option<u64>,
    ) -> Result<Self, LimitError> {
        if period_us < crate::clock::MICROS_PER_SECOND {
            return Err(LimitError::ZeroPeriod);
        }
        let burst = match burst {
            Some(_) if !algorithm.has_burst() => {
                return Err(LimitError::BurstNotApplicable(algorithm));
            }
            Some(0) => return Err(LimitError::ZeroBurst),
            Some(b) => b,
            None => requests,
        };
        if algorithm == Algorithm::SlidingLog && requests > SLIDING_LOG_MAX {
            return Err(LimitError::SlidingLogTooLarge);
        }
        let tick_us = if algorithm.has_ticks() {
            let capacity = requests.max(burst).max(1);
            choose_tick(period_us, capacity).ok_or(LimitError::OutOfRange {
                requests: capacity,
                period_s: period_us / crate::clock::MICROS_PER_SECOND,
            })?
        } else {
            1
        };
        let limit = Self {
            algorithm,
            requests,
            period_us,
            burst,
            tick_us,
            overdraft: false,
            calendar: None,
        };
        if algorithm.has_burst() && requests > 0 && limit.full_drain_us() > u128::from(TIME_MAX) {
            return Err(LimitError::DrainsTooSlowly {
                burst,
                requests,
                period_s: period_us / crate::clock::MICROS_PER_SECOND,
            });
        }
        Ok(limit)
    }

    /// This limit as a cost limit; only where usage past the limit can be kept exactly (a fixed
    /// window's count, a bucket's level).
    pub fn with_overdraft(self) -> Result<Self, LimitError> {
        if !self.algorithm.counts_past_limit() {
            return Err(LimitError::OverdraftNotApplicable(self.algorithm));
        }
        Ok(Self {
            overdraft: true,
            ..self
        })
    }

    /// This limit with calendar windows; only for the algorithms that keep them.
    pub fn with_calendar(self, calendar: CalendarRef) -> Result<Self, LimitError> {
        if !self.algorithm.has_calendar_windows() {
            return Err(LimitError::CalendarNotApplicable(self.algorithm));
        }
        Ok(Self {
            calendar: Some(calendar),
            ..self
        })
    }

    /// The window holding `now_us`, `[start, end)`: the calendar's, or the epoch-aligned
    /// period's. (A calendar fails only past the year 9999, where times never are: they stay
    /// below [`TIME_MAX`]; it then falls back to the aligned period rather than panic.)
    pub fn window_at(&self, now_us: u64) -> (u64, u64) {
        if let Some(window) = self.calendar.and_then(|c| c.window_at(now_us).ok()) {
            return window;
        }
        let start = now_us - now_us % self.period_us;
        (start, start + self.period_us)
    }

    /// The most usage an overdraft limit records (0: not an overdraft limit), exactly: a fixed
    /// window's count up to 2^53 − 1 (billions of limits over), a bucket's debt up to what
    /// drains in [`TIME_MAX`] µs (142 years), given in ticks — the bucket's state is its drain
    /// time (see `bucket`). Both stay below 2^53, so the Lua twins compute them exactly.
    pub fn overdraft_cap(&self) -> u64 {
        if !self.overdraft {
            0
        } else if self.algorithm.has_burst() {
            bucket::debt_cap_ticks(self)
        } else {
            EXACT_MAX - 1
        }
    }

    /// The period in ticks.
    fn period_ticks(&self) -> u64 {
        self.period_us / self.tick_us
    }

    /// Whether `hits` at once can ever be allowed: not more than a window's requests or a
    /// bucket's burst. (A request that cannot reports one period as its wait, not a deadline.)
    pub fn can_ever_allow(&self, hits: u64) -> bool {
        let capacity = if self.algorithm.has_burst() {
            self.burst
        } else {
            self.requests
        };
        hits <= capacity
    }

    /// How long a full bucket takes to drain, in microseconds (u128: a burst of `u32::MAX` at
    /// one request a year is billions of years, which is why it is refused).
    fn full_drain_us(&self) -> u128 {
        let level = u128::from(self.burst) * u128::from(self.period_ticks());
        level.div_ceil(u128::from(self.requests)) * u128::from(self.tick_us)
    }
}

/// The finest tick (a power of ten of microseconds, dividing the period) for which
/// `capacity × period_in_ticks` stays exact.
fn choose_tick(period_us: u64, capacity: u64) -> Option<u64> {
    let mut tick = 1u64;
    while tick <= crate::clock::MICROS_PER_SECOND {
        if period_us.is_multiple_of(tick)
            && capacity
                .checked_mul(period_us / tick)
                .is_some_and(|p| p <= EXACT_MAX)
        {
            return Some(tick);
        }
        tick *= 10;
    }
    None
}

/// The answer for one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    pub allowed: bool,
    /// Hits still available after this request (before it, when denied).
    pub remaining: u64,
    /// Until the limit is fully replenished (allowed) — the window end for fixed windows.
    pub reset_after_us: u64,
    /// Until this same request would be allowed; 0 when allowed. A request that can never fit
    /// (more hits than the capacity) reports one period (the window end for fixed windows).
    pub retry_after_us: u64,
}

impl Verdict {
    /// The same verdict as if the request had not consumed (for a batch that was rolled back).
    pub fn unconsumed(self, hits: u64) -> Self {
        Self {
            remaining: self.remaining.saturating_add(hits),
            ..self
        }
    }
}

/// One admitted batch of hits in a sliding log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub at_us: u64,
    pub hits: u64,
}

/// Per-key state. `Empty` is never stored: a store drops the key instead.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum State {
    #[default]
    Empty,
    Window {
        start_us: u64,
        count: u64,
    },
    Sliding {
        start_us: u64,
        current: u64,
        previous: u64,
    },
    Log {
        /// The hits of all stamps (some may have expired but not been dropped yet).
        total: u64,
        /// Boxed: inline, the log made every state of every algorithm 48 bytes instead of 32,
        /// in a store that holds millions.
        stamps: Box<VecDeque<Stamp>>,
    },
    /// Buckets: the tick at which the level is zero again, `empty_tick + frac / requests`
    /// (`frac < requests`); the level at tick `t` is `(empty_tick − t) × requests + frac` units,
    /// where one hit is `period_ticks` units (see `bucket`). Zero and zero is empty.
    Meter {
        empty_tick: u64,
        frac: u64,
    },
    /// Concurrency: the slots held, oldest expiry first (boxed, as a log's stamps are).
    Slots {
        held: Box<Vec<Slot>>,
    },
}

/// A request in flight under a concurrency limit: its slot, held until `until_us` unless
/// released before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub id: u64,
    pub until_us: u64,
}

// Every counter a store holds is one of these: keep it small (see `Log`).
const _: () = assert!(std::mem::size_of::<State>() <= 32);

impl State {
    /// When this state is empty again if nothing else happens (a store may forget it then).
    pub fn expires_at_us(&self, limit: &Limit) -> u64 {
        match self {
            State::Empty => 0,
            State::Window { start_us, .. } => limit.window_at(*start_us).1,
            State::Sliding { start_us, .. } => start_us + 2 * limit.period_us,
            State::Log { stamps, .. } => stamps.back().map_or(0, |s| s.at_us + limit.period_us),
            State::Meter { empty_tick, frac } => bucket::empty_at_us(limit, *empty_tick, *frac),
            State::Slots { held } => held.iter().map(|s| s.until_us).max().unwrap_or(0),
        }
    }

    pub fn is_empty(&self) -> bool {
        match self {
            State::Empty => true,
            State::Window { count, .. } => *count == 0,
            State::Sliding {
                current, previous, ..
            } => *current == 0 && *previous == 0,
            State::Log { stamps, .. } => stamps.is_empty(),
            State::Meter { empty_tick, frac } => *empty_tick == 0 && *frac == 0,
            State::Slots { held } => held.is_empty(),
        }
    }
}

/// What an allowed decision changes. The sliding log describes its change rather than copying
/// its stamps; the other states are a few integers and are simply replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    Keep,
    Set(State),
    /// Drop the `expired` oldest stamps, then add `hits` at `at_us`.
    Log {
        expired: usize,
        at_us: u64,
        hits: u64,
    },
}

impl State {
    pub fn apply(&mut self, update: Update) {
        match update {
            Update::Keep => {}
            Update::Set(state) => *self = state,
            Update::Log {
                expired,
                at_us,
                hits,
            } => sliding_log::apply(self, expired, at_us, hits),
        }
    }

    /// A copy with `update` applied.
    pub fn after(&self, update: &Update) -> State {
        let mut next = self.clone();
        next.apply(update.clone());
        next
    }
}

/// Decides `hits` against `state` at `now_us`; `slot` names the request's slot under a
/// concurrency limit (0 elsewhere). The update is what the store applies if it commits: only an
/// allowed verdict's, except an overdraft limit's with hits, which the store records whatever
/// the decision ([`charges_always`]).
pub fn decide(
    limit: &Limit,
    state: &State,
    now_us: u64,
    hits: u64,
    slot: u64,
) -> (Verdict, Update) {
    if limit.requests == 0 {
        return (never(limit, now_us, hits), Update::Keep);
    }
    match limit.algorithm {
        Algorithm::FixedWindow => fixed_window::decide(limit, state, now_us, hits),
        Algorithm::SlidingWindow => sliding_window::decide(limit, state, now_us, hits),
        Algorithm::SlidingLog => sliding_log::decide(limit, state, now_us, hits),
        Algorithm::TokenBucket | Algorithm::LeakyBucket | Algorithm::Gcra => {
            bucket::decide(limit, state, now_us, hits)
        }
        Algorithm::Concurrency => concurrency::decide(limit, state, now_us, hits, slot),
    }
}

/// Whether the store records this check's update even when it or its batch is denied: the
/// hits of a cost limit were spent already (a debit sent after the response).
pub fn charges_always(limit: &Limit, hits: u64) -> bool {
    limit.overdraft && hits > 0 && limit.requests > 0
}

/// Gives `hits` back, never below empty (a concurrency limit releases `slot`). Returns the
/// verdict to report: the state a look (0 hits) sees after it — denied while usage is still
/// over the limit (a cost limit's debt, a lowered limit); the engine answers a refund OK
/// whatever it says. `until_us` (0: none) bounds it: a lease's leftover goes
/// back only while the window it came from lasts (before `until_us`); a concurrency limit
/// releases the slot only if it expires at `until_us` — the slot this very call acquired, which
/// a rollback undoes, not one the request held before (a retried call).
pub fn refund(
    limit: &Limit,
    state: &State,
    now_us: u64,
    hits: u64,
    slot: u64,
    until_us: u64,
) -> (Verdict, State) {
    let hits = if until_us != 0 && now_us >= until_us {
        0
    } else {
        hits
    };
    if limit.requests == 0 {
        return (
            Verdict {
                allowed: true,
                ..never(limit, now_us, 0)
            },
            state.clone(),
        );
    }
    let next = match limit.algorithm {
        Algorithm::FixedWindow => fixed_window::refund(limit, state, now_us, hits),
        Algorithm::SlidingWindow => sliding_window::refund(limit, state, now_us, hits),
        Algorithm::SlidingLog => sliding_log::refund(limit, state, now_us, hits),
        Algorithm::TokenBucket | Algorithm::LeakyBucket | Algorithm::Gcra => {
            bucket::refund(limit, state, now_us, hits)
        }
        Algorithm::Concurrency => concurrency::refund(state, now_us, hits, slot, until_us),
    };
    // What a probe would see now is what the refund reports.
    let (verdict, _) = decide(limit, &next, now_us, 0, slot);
    (verdict, next)
}

/// `requests_per_unit: 0`: every request with hits is over the limit (the reference's meaning);
/// a probe is OK. Reset is the end of the window.
fn never(limit: &Limit, now_us: u64, hits: u64) -> Verdict {
    let to_period_end = limit.window_at(now_us).1 - now_us;
    Verdict {
        allowed: hits == 0,
        remaining: 0,
        reset_after_us: to_period_end,
        retry_after_us: if hits == 0 { 0 } else { to_period_end },
    }
}

#[cfg(test)]
mod tests;
