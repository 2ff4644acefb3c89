//! Calendar windows: a day, an ISO week, a month or a year on the calendar of an IANA time zone.
//!
//! "1 000 requests per month" on a plan means the month the customer sees: it starts on the 1st
//! at local midnight and is 28 to 31 days long, and a local day is 23 or 25 hours on the days
//! the clocks change. An epoch-aligned window of `period_us` cannot say that, so a calendar
//! limit's window is computed here, from the zone's rules (jiff's database, compiled into the
//! binary: every node computes the same boundaries, and the image needs no tzdata).
//!
//! Pure: a function of (zone, unit, instant) → the window containing it, as `[start, end)` in
//! microseconds since the epoch. A day that has no local midnight (a zone that springs forward
//! at 00:00) starts at its first instant.
//!
//! A limit holds its calendar as a [`CalendarRef`]: `Copy`, like the rest of a limit, because
//! calendars are interned — one per (zone, unit) ever named, so at most a few thousand, kept for
//! the process. Each remembers the window it last computed, with its neighbours' bounds, so a
//! decision inside it — and what a node sends Redis for it — costs a comparison, not a
//! time-zone lookup.

use std::sync::Mutex;

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

/// The calendar units a calendar window can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    Day,
    /// ISO week: Monday 00:00 to the next Monday.
    Week,
    Month,
    Year,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CalendarError {
    #[error("unknown time zone '{0}' (an IANA name such as Europe/Berlin, or UTC)")]
    UnknownZone(String),
    #[error("{0} is outside the calendar's range")]
    OutOfRange(u64),
}

impl CalendarUnit {
    pub fn name(self) -> &'static str {
        match self {
            CalendarUnit::Day => "day",
            CalendarUnit::Week => "week",
            CalendarUnit::Month => "month",
            CalendarUnit::Year => "year",
        }
    }
}

/// A calendar unit in a time zone.
#[derive(Debug)]
pub struct Calendar {
    name: String,
    zone: TimeZone,
    unit: CalendarUnit,
    /// The last window computed and its neighbours, as [`CalendarRef::around`] gives them.
    last: Mutex<[u64; 4]>,
}

impl Calendar {
    /// `zone`: an IANA name from the database compiled into the binary.
    pub fn new(zone: &str, unit: CalendarUnit) -> Result<Self, CalendarError> {
        let tz = TimeZone::get(zone).map_err(|_| CalendarError::UnknownZone(zone.to_owned()))?;
        Ok(Self {
            name: zone.to_owned(),
            zone: tz,
            unit,
            last: Mutex::new([0; 4]),
        })
    }

    /// The interned calendar of `zone` and `unit`.
    pub fn interned(zone: &str, unit: CalendarUnit) -> Result<CalendarRef, CalendarError> {
        static INTERNED: Mutex<Vec<&'static Calendar>> = Mutex::new(Vec::new());
        let mut interned = INTERNED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = interned.iter().find(|c| c.unit == unit && c.name == zone) {
            return Ok(CalendarRef(c));
        }
        // Leaked on purpose: one per (zone, unit) a rules file ever names, bounded by the zone
        // database, and a counter's calendar must outlive every reload.
        let calendar: &'static Calendar = Box::leak(Box::new(Self::new(zone, unit)?));
        interned.push(calendar);
        Ok(CalendarRef(calendar))
    }

    /// The window containing `now_us`: `[start, end)` in µs since the epoch.
    pub fn window_at(&self, now_us: u64) -> Result<(u64, u64), CalendarError> {
        let [_, start, end, _] = self.around(now_us)?;
        Ok((start, end))
    }

    /// The window holding `now_us` and its neighbours, as four bounds: remembered while `now_us`
    /// stays in it. Busy (another thread is computing): computed rather than waited for.
    fn around(&self, now_us: u64) -> Result<[u64; 4], CalendarError> {
        let last = self.last.try_lock();
        if let Ok(last) = &last
            && (last[1]..last[2]).contains(&now_us)
        {
            return Ok(**last);
        }
        let (start, end) = self.compute(now_us)?;
        let (previous, _) = self.compute(start.saturating_sub(1))?;
        let (_, next_end) = self.compute(end)?;
        let bounds = [previous, start, end, next_end];
        if let Ok(mut last) = last {
            *last = bounds;
        }
        Ok(bounds)
    }

    fn compute(&self, now_us: u64) -> Result<(u64, u64), CalendarError> {
        let out = || CalendarError::OutOfRange(now_us);
        let now = i64::try_from(now_us)
            .ok()
            .and_then(|us| Timestamp::from_microsecond(us).ok())
            .ok_or_else(out)?;
        let date = now.to_zoned(self.zone.clone()).date();
        let (first, length) = match self.unit {
            CalendarUnit::Day => (Ok(date), 1.day()),
            CalendarUnit::Week => (
                date.checked_sub(i64::from(date.weekday().to_monday_zero_offset()).days()),
                7.days(),
            ),
            CalendarUnit::Month => (Ok(date.first_of_month()), 1.month()),
            CalendarUnit::Year => (Ok(date.first_of_year()), 1.year()),
        };
        let first = first.map_err(|_| out())?;
        let next = first.checked_add(length).map_err(|_| out())?;
        Ok((
            self.start_of(first).ok_or_else(out)?,
            self.start_of(next).ok_or_else(out)?,
        ))
    }

    /// The first instant of `date` in the zone, in µs; 0 for one before the epoch, where
    /// sluice's time line starts (a clock never reads earlier: see `clock`), so the first
    /// window of 1970 is cut there.
    fn start_of(&self, date: Date) -> Option<u64> {
        let start = date.to_zoned(self.zone.clone()).ok()?.start_of_day().ok()?;
        Some(u64::try_from(start.timestamp().as_microsecond()).unwrap_or(0))
    }
}

/// An interned [`Calendar`], as a limit holds it. Two are equal when they are the same
/// calendar (interning makes that the same zone and unit).
#[derive(Clone, Copy)]
pub struct CalendarRef(&'static Calendar);

impl CalendarRef {
    pub fn zone_name(self) -> &'static str {
        &self.0.name
    }

    pub fn unit(self) -> CalendarUnit {
        self.0.unit
    }

    pub fn window_at(self, now_us: u64) -> Result<(u64, u64), CalendarError> {
        self.0.window_at(now_us)
    }

    /// The window before the one holding `now_us`, that one and the next, as their four
    /// boundaries: what a node sends Redis, which picks by its own clock (see `fixed_window.lua`).
    pub fn around(self, now_us: u64) -> Result<[u64; 4], CalendarError> {
        self.0.around(now_us)
    }
}

impl PartialEq for CalendarRef {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for CalendarRef {}

impl std::hash::Hash for CalendarRef {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        std::ptr::hash(self.0, state);
    }
}

impl std::fmt::Debug for CalendarRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} in {}", self.0.unit.name(), self.0.name)
    }
}

/// Tests: µs of a local civil time (`2026-03-29T00:30`) in `zone`, the earlier instant of an
/// ambiguous one.
#[cfg(test)]
pub(crate) fn civil_us(zone: &str, civil: &str) -> u64 {
    let dt: jiff::civil::DateTime = civil.parse().unwrap();
    let z = dt.to_zoned(TimeZone::get(zone).unwrap()).unwrap();
    z.timestamp().as_microsecond() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::civil_us as at;

    fn window(zone: &str, unit: CalendarUnit, civil: &str) -> (u64, u64) {
        Calendar::new(zone, unit)
            .unwrap()
            .window_at(at(zone, civil))
            .unwrap()
    }

    const H: u64 = 3_600_000_000;

    #[test]
    fn a_month_rolls_over_at_local_midnight_on_the_first() {
        let berlin = "Europe/Berlin";
        let last_us = at(berlin, "2026-01-31T23:59:59.999999");
        let (start, end) = window(berlin, CalendarUnit::Month, "2026-01-31T23:59:59.999999");
        assert_eq!(start, at(berlin, "2026-01-01T00:00"));
        assert_eq!(end, at(berlin, "2026-02-01T00:00"));
        assert_eq!(end, last_us + 1, "the last µs of January is in January");
        let (next_start, next_end) = window(berlin, CalendarUnit::Month, "2026-02-01T00:00");
        assert_eq!(next_start, end);
        assert_eq!(next_end - next_start, 28 * 24 * H);
    }

    #[test]
    fn a_local_day_is_23_or_25_hours_when_the_clocks_change() {
        let berlin = "Europe/Berlin";
        let (s, e) = window(berlin, CalendarUnit::Day, "2026-03-29T12:00");
        assert_eq!(e - s, 23 * H, "spring forward");
        let (s, e) = window(berlin, CalendarUnit::Day, "2026-10-25T12:00");
        assert_eq!(e - s, 25 * H, "fall back");
        // The month holding the spring-forward day is an hour short.
        let (s, e) = window(berlin, CalendarUnit::Month, "2026-03-15T00:00");
        assert_eq!(e - s, 31 * 24 * H - H);
    }

    #[test]
    fn a_week_starts_on_monday_and_a_year_on_january_first() {
        let utc = "UTC";
        // 2026-12-05 is a Saturday.
        let (s, e) = window(utc, CalendarUnit::Week, "2026-12-05T10:00");
        assert_eq!(s, at(utc, "2026-11-30T00:00"));
        assert_eq!(e, at(utc, "2026-12-07T00:00"));
        let (s, e) = window(utc, CalendarUnit::Year, "2028-02-29T10:00");
        assert_eq!(s, at(utc, "2028-01-01T00:00"));
        assert_eq!(e - s, 366 * 24 * H, "a leap year");
        let (s, e) = window(utc, CalendarUnit::Day, "2028-02-29T23:59:59");
        assert_eq!(e - s, 24 * H);
        assert_eq!(s, at(utc, "2028-02-29T00:00"));
    }

    #[test]
    fn a_half_hour_zone_starts_its_day_at_its_own_midnight() {
        let kolkata = "Asia/Kolkata";
        let (s, _) = window(kolkata, CalendarUnit::Day, "2026-06-01T00:10");
        assert_eq!(s, at("UTC", "2026-05-31T18:30"));
    }

    #[test]
    fn a_day_without_a_midnight_starts_at_its_first_instant() {
        // America/Santiago springs forward at 00:00: 2026-09-06 starts at 01:00 local.
        let zone = "America/Santiago";
        let (s, e) = window(zone, CalendarUnit::Day, "2026-09-06T12:00");
        assert_eq!(e - s, 23 * H);
        assert_eq!(s, at(zone, "2026-09-06T01:00"));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]
        /// Over every time sluice accepts (below 2^52 µs, the year 2112) and zones with DST,
        /// half-hour offsets and a midnight that springs forward: the window holds the time,
        /// windows tile the line (the next starts where this one ends, the previous ends where
        /// it starts), a window is as long as its unit allows, and the remembered window answers
        /// as a fresh computation does.
        #[test]
        fn windows_tile_time_over_the_whole_range(
            now in 0u64..crate::limiter::TIME_MAX,
            zone in proptest::sample::select(vec![
                "UTC", "Europe/Berlin", "Asia/Kolkata", "America/Santiago",
                "Australia/Lord_Howe", "Pacific/Chatham", "America/St_Johns",
            ]),
            unit in proptest::sample::select(vec![
                CalendarUnit::Day, CalendarUnit::Week, CalendarUnit::Month, CalendarUnit::Year,
            ]),
        ) {
            let c = Calendar::interned(zone, unit).unwrap();
            let (start, end) = c.window_at(now).unwrap();
            proptest::prop_assert!(start <= now && now < end);
            let [previous, s, e, next] = c.around(now).unwrap();
            proptest::prop_assert_eq!((s, e), (start, end));
            proptest::prop_assert!(end < next);
            proptest::prop_assert!(previous < start || start == 0);
            if start > 0 {
                proptest::prop_assert_eq!(c.window_at(start - 1).unwrap().1, start);
            }
            proptest::prop_assert_eq!(c.window_at(end).unwrap().0, end);
            // A day is 23 to 25 hours (Lord Howe's half-hour DST inside that), and a zone that
            // moved across the date line skipped or doubled a day: allow a day either side.
            let days = match unit {
                CalendarUnit::Day => (0, 2),
                CalendarUnit::Week => (6, 8),
                CalendarUnit::Month => (27, 32),
                CalendarUnit::Year => (364, 367),
            };
            let len = end - start;
            // (The first window of 1970 may be cut short at the epoch.)
            proptest::prop_assert!(len > days.0 * 24 * H || start == 0, "{len}");
            proptest::prop_assert!(len < days.1 * 24 * H, "{len}");
            proptest::prop_assert_eq!(Calendar::new(zone, unit).unwrap().compute(now).unwrap(), (start, end));
        }
    }

    #[test]
    fn unknown_zones_are_refused_by_name() {
        assert_eq!(
            Calendar::new("Mars/Olympus", CalendarUnit::Day).unwrap_err(),
            CalendarError::UnknownZone("Mars/Olympus".into())
        );
    }

    #[test]
    fn a_calendar_is_interned_once_and_remembers_its_window() {
        let a = Calendar::interned("Europe/Berlin", CalendarUnit::Month).unwrap();
        let b = Calendar::interned("Europe/Berlin", CalendarUnit::Month).unwrap();
        let c = Calendar::interned("Europe/Berlin", CalendarUnit::Day).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let berlin = "Europe/Berlin";
        // In a window, out of it and back: the remembered window never answers for another.
        for civil in [
            "2026-03-31T23:59:59",
            "2026-04-01T00:00",
            "2026-03-01T00:00",
        ] {
            let month = a.window_at(at(berlin, civil)).unwrap();
            assert_eq!(month, window(berlin, CalendarUnit::Month, civil), "{civil}");
        }
        let [p, s, e, n] = a.around(at(berlin, "2026-03-15T00:00")).unwrap();
        assert_eq!(p, at(berlin, "2026-02-01T00:00"));
        assert_eq!(s, at(berlin, "2026-03-01T00:00"));
        assert_eq!(e, at(berlin, "2026-04-01T00:00"));
        assert_eq!(n, at(berlin, "2026-05-01T00:00"));
    }
}
