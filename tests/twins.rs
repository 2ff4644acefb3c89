//! Each algorithm's Lua script is the twin of its Rust function: on one real redis-server with
//! the script's time pinned, a random limit, a random stored state and a random run of
//! decisions and refunds give identical verdicts from `limiter::decide`/`refund` and from the
//! script, on the whole range the rules accept — periods up to the 2^52 µs bound (142 years),
//! limits up to `u32::MAX` (so coarse ticks and products near 2^53), states a lowered limit
//! leaves behind (above the new limit), stale windows and clocks that went back.
//!
//! The differential test in `redis.rs` runs whole requests through the engine on small
//! numbers; this one runs the arithmetic where Lua's doubles would first go wrong.

mod common;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use common::redis::RedisServer;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use sluice::calendar::{Calendar, CalendarRef, CalendarUnit};
use sluice::clock::ManualClock;
use sluice::counter::{Unit, period_us};
use sluice::limiter::{self, Algorithm, EXACT_MAX, Limit, Stamp, State, TIME_MAX, Verdict};
use sluice::store::redis::{RedisOptions, RedisStore, Topology, redis_key};
use sluice::store::{Check, CheckKind, Store};

const PREFIX: &str = "twin:";

/// One random case: a limit, what is stored, and the calls made on it.
#[derive(Debug, Clone)]
struct Case {
    limit: Limit,
    start_us: u64,
    state: State,
    steps: Vec<Step>,
    /// Where this node's clock is: at Redis's time (0), still in the window before Redis's (1)
    /// or already in the next (2), as at every window's edge: a calendar limit's windows are
    /// sent around the node's time, and the script must pick by its own.
    node_skew: u8,
}

#[derive(Debug, Clone)]
struct Step {
    advance_us: u64,
    hits: u64,
    kind: CheckKind,
    /// A concurrency limit's request: mostly one of a few, so acquires, retries and releases
    /// meet; sometimes the largest slot number (0 elsewhere).
    slot: u64,
    /// A refund's bound (`Check::until_us`): none, one already passed, one ahead, or (for a
    /// concurrency limit) the expiry of the slot released, as a rollback sends it.
    until_pick: u8,
}

/// The slot numbers a case's requests and stored slots are drawn from: a few small ones and
/// the extremes of the range (`limiter::slot_id` gives 1 ..= 2^53 − 1).
fn slot_of(pick: u64) -> u64 {
    match pick % 8 {
        6 => (1 << 53) - 1,
        7 => (1 << 53) - 2,
        n => n + 1,
    }
}

/// A period the rules accept: a unit and a multiplier, up to the 2^52 µs bound.
fn period() -> impl Strategy<Value = u64> {
    let unit = prop_oneof![
        Just(Unit::Second),
        Just(Unit::Minute),
        Just(Unit::Hour),
        Just(Unit::Day),
        Just(Unit::Year),
    ];
    (unit, any::<u32>(), 0..4u8).prop_map(|(unit, m, size)| {
        // Mostly small multipliers, sometimes the largest the unit allows.
        let max = (TIME_MAX / 1_000_000 / unit.seconds()).min(u64::from(u32::MAX)) as u32;
        let m = match size {
            0 => 1,
            1 => 1 + m % 10,
            2 => 1 + m % max,
            _ => max - m % 3.min(max),
        };
        period_us(unit, m.max(1)).expect("within the bound")
    })
}

/// A count near `scale`: small, random below it, or just under and over it.
fn near(scale: u64, pick: u64, kind: u8) -> u64 {
    match kind % 5 {
        0 => pick % 4,
        1 => pick % scale.saturating_add(1),
        2 => scale.saturating_sub(pick % 3),
        3 => scale.saturating_add(pick % 3),
        _ => pick % scale.saturating_mul(2).saturating_add(1),
    }
}

/// `requests` (and `burst`) up to `u32::MAX`, biased to the largest the period allows exactly.
/// `overdraft`: as a cost limit.
/// A calendar (zone and unit) for a third of the limits of the algorithms that keep calendar
/// windows: zones with DST, a half-hour offset, a midnight that springs forward.
fn calendar(algorithm: Algorithm) -> impl Strategy<Value = Option<(CalendarRef, u64)>> {
    let zones = prop::sample::select(vec![
        "UTC",
        "Europe/Berlin",
        "Asia/Kolkata",
        "America/Santiago",
        "Australia/Lord_Howe",
    ]);
    let units = prop::sample::select(vec![
        (CalendarUnit::Day, Unit::Day),
        (CalendarUnit::Week, Unit::Week),
        (CalendarUnit::Month, Unit::Month),
        (CalendarUnit::Year, Unit::Year),
    ]);
    (zones, units, 0..3u8).prop_map(move |(zone, (unit, nominal), pick)| {
        (algorithm.has_calendar_windows() && pick == 0).then(|| {
            let calendar = Calendar::interned(zone, unit).unwrap();
            (calendar, period_us(nominal, 1).unwrap())
        })
    })
}

fn limit(algorithm: Algorithm, overdraft: bool) -> impl Strategy<Value = Limit> {
    let period = (period(), calendar(algorithm)).prop_map(|(p, c)| (c.map_or(p, |c| c.1), c));
    (period, any::<u64>(), 0..5u8, any::<u64>(), 0..3u8).prop_filter_map(
        "out of the exact range",
        move |((period_us, calendar), pick, kind, burst_pick, burst_kind)| {
            if algorithm == Algorithm::Concurrency && period_us > 24 * 3_600_000_000 {
                // max_hold: at most a day.
                return None;
            }
            let top = match algorithm {
                Algorithm::SlidingLog => limiter::SLIDING_LOG_MAX,
                Algorithm::FixedWindow => u64::from(u32::MAX),
                // Products: the largest capacity with a tick of at most one second.
                _ => (EXACT_MAX / (period_us / 1_000_000)).min(u64::from(u32::MAX)),
            };
            let requests = if algorithm == Algorithm::Concurrency {
                // Mostly a handful of slots, so a case fills them; sometimes any the rules take.
                match kind {
                    0..=2 => pick % 6,
                    3 => u64::from(u32::MAX) - pick % 3,
                    _ => pick % (u64::from(u32::MAX) + 1),
                }
            } else {
                near(top, pick, kind).clamp(1, top)
            };
            let burst = (algorithm.has_burst() && burst_kind > 0)
                .then(|| near(top, burst_pick, burst_kind * 2).clamp(1, top));
            let mut limit = Limit::new(algorithm, requests, period_us, burst).ok()?;
            if let Some((c, _)) = calendar {
                limit = limit.with_calendar(c).ok()?;
            }
            if overdraft {
                limit.with_overdraft().ok()
            } else {
                Some(limit)
            }
        },
    )
}

/// A state as a store might hold it at `now`: of this window, the last, or long ago; within
/// the limit or above it (a lowered limit); a bucket updated in the future (a clock set back).
fn state(limit: Limit, now: u64, picks: [u64; 4], kind: u8) -> State {
    let period = limit.period_us;
    // The window holding `now` and the ones before it (a calendar's too).
    let window = limit.window_at(now).0;
    let before = |w: u64| w.checked_sub(1).map_or(0, |t| limit.window_at(t).0);
    let start = match picks[0] % 6 {
        0..=2 => window,
        3 => before(window),
        4 => before(before(window)),
        _ => picks[0] % (now + 1),
    };
    let capacity = limit.requests.max(limit.burst);
    match limit.algorithm {
        Algorithm::FixedWindow => State::Window {
            start_us: start,
            count: near(limit.requests, picks[1], kind),
        },
        Algorithm::SlidingWindow => State::Sliding {
            start_us: start,
            current: near(limit.requests, picks[1], kind),
            previous: near(limit.requests, picks[2], kind.wrapping_add(picks[3] as u8)),
        },
        Algorithm::Concurrency => {
            // Up to a few more slots than the limit (a lowered limit), live and expired, each
            // held for up to its period from when it was taken.
            let n = picks[1] % (limit.requests.min(6) + 3);
            let mut held: Vec<limiter::Slot> = Vec::new();
            for i in 0..n {
                let pick = picks[2].rotate_left(i as u32 * 9);
                let id = slot_of(pick ^ picks[3].rotate_left(i as u32));
                if held.iter().any(|s| s.id == id) {
                    continue;
                }
                let until_us = match pick % 4 {
                    0 => now.saturating_sub(pick % (period + 1)),
                    1 => now,
                    _ => now + 1 + pick % period,
                };
                held.push(limiter::Slot { id, until_us });
            }
            held.sort_unstable_by_key(|s| (s.until_us, s.id));
            if held.is_empty() {
                State::Empty
            } else {
                State::Slots {
                    held: Box::new(held),
                }
            }
        }
        Algorithm::SlidingLog => {
            let n = picks[1] % 5;
            let mut stamps = VecDeque::new();
            let mut at = now.saturating_sub(picks[2] % (2 * period + 1));
            for i in 0..n {
                let hits =
                    1 + near(limit.requests, picks[3].rotate_left(i as u32 * 7), kind) % capacity;
                stamps.push_back(Stamp { at_us: at, hits });
                at = (at + picks[3] % (period / 2 + 1)).min(now);
            }
            let total = stamps.iter().map(|s| s.hits).sum();
            if stamps.is_empty() {
                State::Empty
            } else {
                State::Log {
                    total,
                    stamps: Box::new(stamps),
                }
            }
        }
        _ => {
            // The tick the level is zero again: in the past (empty), within the capacity's
            // drain, past it (a lowered limit), or a cost limit's debt up to its cap; and a
            // fraction of a tick, sometimes of another rate (also a lowered limit).
            let p = limit.period_us / limit.tick_us;
            let now_tick = now / limit.tick_us;
            let top = if limit.overdraft && picks[3].is_multiple_of(3) {
                limit.overdraft_cap()
            } else {
                limit.burst * p / limit.requests + 1
            };
            let empty_tick = if picks[2].is_multiple_of(7) {
                now_tick.saturating_sub(picks[0] % (2 * p + 1))
            } else {
                now_tick + near(top, picks[1], kind)
            };
            let frac = if picks[0].is_multiple_of(11) {
                picks[3] % (2 * limit.requests)
            } else {
                picks[3] % limit.requests
            };
            State::Meter { empty_tick, frac }
        }
    }
}

fn step(period: u64) -> impl Strategy<Value = Step> {
    let advance = prop_oneof![
        Just(0u64),
        0..1_000u64,
        0..=period,
        0..=3 * period,
        // A whole number of seconds: lands on tick and window edges.
        (0..=(3 * period / 1_000_000)).prop_map(|s| s * 1_000_000),
    ];
    let kind = prop_oneof![
        6 => Just(CheckKind::Enforce),
        1 => Just(CheckKind::Shadow),
        2 => Just(CheckKind::Refund),
    ];
    (advance, any::<u64>(), 0..5u8, kind, any::<u64>(), 0..6u8).prop_map(
        |(advance_us, pick, k, kind, slot, until_pick)| Step {
            advance_us,
            // Mostly a few hits; sometimes any the wire carries (u32), which `case` brings near the
            // capacity when it is beyond it.
            hits: if k >= 3 {
                pick % (u64::from(u32::MAX) + 1)
            } else {
                pick % 3
            },
            kind,
            slot: slot_of(slot),
            until_pick,
        },
    )
}

fn case(algorithm: Algorithm, overdraft: bool) -> impl Strategy<Value = Case> {
    limit(algorithm, overdraft).prop_flat_map(|limit| {
        // Epoch times from 1970 to the year 2112 (`TIME_MAX`), mostly around today.
        let start = prop_oneof![
            3 => 1_700_000_000_000_000u64..1_900_000_000_000_000,
            1 => 0..TIME_MAX,
        ];
        (
            Just(limit),
            start,
            any::<[u64; 4]>(),
            0..5u8,
            prop::collection::vec(step(limit.period_us), 1..7),
            any::<u64>(),
            0..3u8,
        )
            .prop_map(
                |(limit, start_us, picks, kind, mut steps, hits_pick, node_skew)| {
                    // Some steps ask for exactly what is left or one more: the edges of "fits".
                    let capacity = limit.requests.max(limit.burst);
                    // A cost limit keeps its big debits (any u32, sometimes up to 2^53): its debt is
                    // what must stay exact.
                    for (i, s) in steps.iter_mut().enumerate() {
                        if !limit.algorithm.holds_slots() {
                            s.slot = 0;
                        }
                        if limit.overdraft && i % 2 == 0 {
                            if hits_pick.rotate_left(i as u32).is_multiple_of(5) {
                                s.hits = hits_pick % EXACT_MAX;
                            }
                            continue;
                        }
                        if s.hits > 2 && s.hits > capacity + 1 {
                            s.hits = near(capacity, hits_pick.rotate_left(i as u32), i as u8);
                        }
                    }
                    Case {
                        limit,
                        start_us,
                        state: state(limit, start_us, picks, kind),
                        steps,
                        node_skew,
                    }
                },
            )
    })
}

/// The state in the script's encoding (see the `.lua` files' headers), on a server holding
/// nothing else (a window's key from an earlier case could be read). With `strings`, a fixed
/// window's odd counts are in the string form older builds wrote.
fn store_state(
    conn: &mut redis::Connection,
    key: &[u8],
    state: &State,
    limit: &Limit,
    strings: bool,
) {
    const TTL_MS: u64 = 3_600_000;
    let ints = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(" ");
    let mut run = |cmd: &mut redis::Cmd| {
        let _: () = cmd.query(conn).unwrap();
    };
    run(&mut redis::cmd("FLUSHALL"));
    let value = match state {
        State::Empty => return,
        // An odd count in the form before the hash ("start_us count" under the key without
        // its '#', as a node of a build before December 2026 leaves it in a rollout), which the
        // script reads, told to, when the hash has no field for the window; an even one in the
        // hash.
        State::Window { start_us, count } if strings && count % 2 == 1 => {
            let old_key = key
                .strip_suffix(b"#")
                .expect("a fixed window's key ends in #");
            let value = ints(&[*start_us, *count]);
            run(redis::cmd("SET")
                .arg(old_key)
                .arg(value)
                .arg("PX")
                .arg(TTL_MS));
            return;
        }
        State::Window { start_us, count } => {
            // As fixed_window.lua names a window: its start in seconds, or in µs if not whole.
            let field = if start_us % 1_000_000 == 0 {
                (start_us / 1_000_000).to_string()
            } else {
                format!("{start_us}us")
            };
            run(redis::cmd("HSET").arg(key).arg(field).arg(count));
            run(redis::cmd("PEXPIRE").arg(key).arg(TTL_MS));
            return;
        }
        State::Sliding {
            start_us,
            current,
            previous,
        } => ints(&[*start_us, *current, *previous]),
        // An odd tick in the form before ("level at_us", as a node of the last version leaves
        // it in a rollout): the same level, some ticks before it is empty.
        State::Meter { empty_tick, frac } if empty_tick % 2 == 1 && *frac < limit.requests => {
            let ticks = (*empty_tick)
                .min((EXACT_MAX - frac) / limit.requests)
                .min(3);
            let level = ticks * limit.requests + frac;
            ints(&[level, (empty_tick - ticks) * limit.tick_us])
        }
        State::Meter { empty_tick, frac } => format!("{empty_tick}:{frac}"),
        State::Slots { held } => {
            for s in held.iter() {
                run(redis::cmd("ZADD").arg(key).arg(s.until_us).arg(s.id));
            }
            run(redis::cmd("PEXPIRE").arg(key).arg(TTL_MS));
            return;
        }
        State::Log { total, stamps } => {
            let mut list = vec![total.to_string()];
            list.extend(stamps.iter().map(|s| ints(&[s.at_us, s.hits])));
            run(redis::cmd("RPUSH").arg(key).arg(list));
            run(redis::cmd("PEXPIRE").arg(key).arg(TTL_MS));
            return;
        }
    };
    run(redis::cmd("SET").arg(key).arg(value).arg("PX").arg(TTL_MS));
}

/// The Rust side of one step: the verdict and the state after it.
fn rust_step(limit: &Limit, state: &State, now: u64, s: &Step, until: u64) -> (Verdict, State) {
    let (hits, slot) = (s.hits, s.slot);
    match s.kind {
        CheckKind::Refund => limiter::refund(limit, state, now, hits, slot, until),
        CheckKind::Enforce | CheckKind::Shadow => {
            let (verdict, update) = limiter::decide(limit, state, now, hits, slot);
            // A cost limit records its charge whatever the verdict.
            let next = if verdict.allowed || limiter::charges_always(limit, hits) {
                state.after(&update)
            } else {
                state.clone()
            };
            (verdict, next)
        }
    }
}

struct Twin {
    /// The store reads fixed windows' string form too (`RedisOptions::read_string_windows`).
    strings: bool,
    runtime: tokio::runtime::Runtime,
    store: RedisStore,
    clock: Arc<ManualClock>,
    node_clock: Arc<ManualClock>,
    conn: redis::Connection,
}

impl Twin {
    fn new(redis: &RedisServer, strings: bool) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let clock = Arc::new(ManualClock::new(0));
        let node_clock = Arc::new(ManualClock::new(0));
        let store = RedisStore::new(&RedisOptions {
            topology: Topology::Standalone(redis.url()),
            pool_size: 1,
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            key_prefix: PREFIX.into(),
            read_string_windows: strings,
        })
        .unwrap()
        .with_pinned_clock(clock.clone())
        .with_node_clock(node_clock.clone());
        let conn = redis::Client::open(redis.url())
            .unwrap()
            .get_connection()
            .unwrap();
        Self {
            strings,
            runtime,
            store,
            clock,
            node_clock,
            conn,
        }
    }

    fn run(&mut self, case: &Case) -> Result<(), TestCaseError> {
        let key = b"k";
        let (redis_key, _) = redis_key(PREFIX.as_bytes(), key, key, case.limit.algorithm);
        store_state(
            &mut self.conn,
            &redis_key,
            &case.state,
            &case.limit,
            self.strings,
        );
        let mut state = case.state.clone();
        let mut now = case.start_us;
        for (i, s) in case.steps.iter().enumerate() {
            now = (now + s.advance_us).min(TIME_MAX);
            self.clock.set(now);
            let (start, end) = case.limit.window_at(now);
            self.node_clock.set(match case.node_skew {
                0 => now,
                1 => start.saturating_sub(1),
                _ => end,
            });
            let until = match (s.kind, s.until_pick) {
                (CheckKind::Refund, 1) => now,
                (CheckKind::Refund, 2) => now + 1,
                (CheckKind::Refund, 3) => match &state {
                    State::Slots { held } => held
                        .iter()
                        .find(|h| h.id == s.slot)
                        .map_or(now + 2, |h| h.until_us),
                    _ => now + 2,
                },
                _ => 0,
            };
            let (want, next) = rust_step(&case.limit, &state, now, s, until);
            let check = Check {
                kind: s.kind,
                slot: s.slot,
                until_us: until,
                ..Check::enforce(key, &case.limit, s.hits)
            };
            let outcome = self
                .runtime
                .block_on(self.store.apply(&[check]))
                .map_err(|e| TestCaseError::fail(format!("the script failed: {e}")))?;
            prop_assert_eq!(
                outcome.verdicts[0],
                want,
                "step {} ({:?}) at {}: the script and the Rust function disagree",
                i,
                s,
                now
            );
            state = next;
        }
        Ok(())
    }
}

fn prove(algorithm: Algorithm, overdraft: bool, strings: bool, redis: &RedisServer) {
    let twin = std::cell::RefCell::new(Twin::new(redis, strings));
    let cases = std::env::var("TWIN_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&case(algorithm, overdraft), |case| {
            twin.borrow_mut().run(&case)
        })
        .unwrap_or_else(|e| panic!("{algorithm} (overdraft: {overdraft}): {e}"));
}

/// Each algorithm is its own test with its own server: they run in parallel, and a failure
/// names its algorithm.
fn with_redis(algorithm: Algorithm) {
    let redis = RedisServer::start();
    prove(algorithm, false, false, &redis);
}

/// The same for a cost limit (`overdraft: true`).
fn overdraft_with_redis(algorithm: Algorithm) {
    let redis = RedisServer::start();
    prove(algorithm, true, false, &redis);
}

/// A fixed window with the string form of builds before December 2026 read too (a rolling
/// upgrade from one): the same twin, some windows counted in that form.
#[test]
fn fixed_window_reading_the_string_form_is_its_rust_twin() {
    let redis = RedisServer::start();
    prove(Algorithm::FixedWindow, false, true, &redis);
    prove(Algorithm::FixedWindow, true, true, &redis);
}

/// One test per algorithm, and per algorithm that takes cost limits, each with its own server
/// (see [`with_redis`]); the lists they are made from are checked against `Algorithm::ALL`.
macro_rules! twin_tests {
    ($list:ident, $prove:ident: $($name:ident => $algorithm:ident),* $(,)?) => {
        const $list: &[Algorithm] = &[$(Algorithm::$algorithm),*];
        $(
            #[test]
            fn $name() {
                $prove(Algorithm::$algorithm);
            }
        )*
    };
}

twin_tests!(PROVEN, with_redis:
    fixed_window_script_is_its_rust_twin => FixedWindow,
    sliding_window_script_is_its_rust_twin => SlidingWindow,
    sliding_log_script_is_its_rust_twin => SlidingLog,
    token_bucket_script_is_its_rust_twin => TokenBucket,
    leaky_bucket_script_is_its_rust_twin => LeakyBucket,
    gcra_script_is_its_rust_twin => Gcra,
    concurrency_script_is_its_rust_twin => Concurrency,
);

twin_tests!(PROVEN_OVERDRAFT, overdraft_with_redis:
    fixed_window_overdraft_script_is_its_rust_twin => FixedWindow,
    token_bucket_overdraft_script_is_its_rust_twin => TokenBucket,
    leaky_bucket_overdraft_script_is_its_rust_twin => LeakyBucket,
    gcra_overdraft_script_is_its_rust_twin => Gcra,
);

/// Step 3 of the limiter's checklist for adding an algorithm: its twin test here.
#[test]
fn every_algorithm_is_proven() {
    for algorithm in Algorithm::ALL {
        assert!(
            PROVEN.contains(&algorithm),
            "{algorithm} has no twin test: add it to twin_tests!(PROVEN, ...) in tests/twins.rs"
        );
        assert_eq!(
            PROVEN_OVERDRAFT.contains(&algorithm),
            algorithm.counts_past_limit(),
            "{algorithm}: twin_tests!(PROVEN_OVERDRAFT, ...) in tests/twins.rs must list exactly the algorithms that take cost limits"
        );
    }
}
