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
    #[error("calendar windows are day, week, month or year, not {0}")]
    Unit(String),
    #[error("{0} is outside the calendar's range")]
    OutOfRange(u64),
}

/// A calendar unit in a time zone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Calendar {
    name: String,
    zone: TimeZone,
    unit: CalendarUnit,
}

impl Calendar {
    /// `zone`: an IANA name from the database compiled into the binary.
    pub fn new(zone: &str, unit: CalendarUnit) -> Result<Self, CalendarError> {
        let tz = TimeZone::get(zone).map_err(|_| CalendarError::UnknownZone(zone.to_owned()))?;
        Ok(Self {
            name: zone.to_owned(),
            zone: tz,
            unit,
        })
    }

    pub fn zone_name(&self) -> &str {
        &self.name
    }

    pub fn unit(&self) -> CalendarUnit {
        self.unit
    }

    /// The window containing `now_us`: `[start, end)` in µs since the epoch.
    pub fn window_at(&self, now_us: u64) -> Result<(u64, u64), CalendarError> {
        let out = || CalendarError::OutOfRange(now_us);
        let now = i64::try_from(now_us)
            .ok()
            .and_then(|us| Timestamp::from_microsecond(us).ok())
            .ok_or_else(out)?;
        let date = now.to_zoned(self.zone.clone()).date();
        let first = match self.unit {
            CalendarUnit::Day => date,
            CalendarUnit::Week => date
                .checked_sub(i64::from(date.weekday().to_monday_zero_offset()).days())
                .map_err(|_| out())?,
            CalendarUnit::Month => date.first_of_month(),
            CalendarUnit::Year => date.first_of_year(),
        };
        let next = match self.unit {
            CalendarUnit::Day => first.checked_add(1.day()),
            CalendarUnit::Week => first.checked_add(7.days()),
            CalendarUnit::Month => first.checked_add(1.month()),
            CalendarUnit::Year => first.checked_add(1.year()),
        }
        .map_err(|_| out())?;
        Ok((
            self.start_of(first).ok_or_else(out)?,
            self.start_of(next).ok_or_else(out)?,
        ))
    }

    /// The first instant of `date` in the zone, in µs.
    fn start_of(&self, date: Date) -> Option<u64> {
        let start = date.to_zoned(self.zone.clone()).ok()?.start_of_day().ok()?;
        u64::try_from(start.timestamp().as_microsecond()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// µs of a local civil time in `zone` (the earlier instant of an ambiguous one).
    fn at(zone: &str, civil: &str) -> u64 {
        let dt: jiff::civil::DateTime = civil.parse().unwrap();
        let z = dt.to_zoned(TimeZone::get(zone).unwrap()).unwrap();
        z.timestamp().as_microsecond() as u64
    }

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

    #[test]
    fn unknown_zones_are_refused_by_name() {
        assert_eq!(
            Calendar::new("Mars/Olympus", CalendarUnit::Day),
            Err(CalendarError::UnknownZone("Mars/Olympus".into()))
        );
    }
}
