//! What the rules and the stores agree a counter is, so that neither imports the other: its
//! identity (the storage key, from the descriptor's [`KeyPart`]s and the limit's [`Unit`]),
//! its period (checked: [`period_us`]), and the per-rule settings a store acts on
//! ([`FailureMode`], [`Mode`]). Whether an algorithm may be leased is the algorithm's own fact
//! ([`crate::limiter::Algorithm::leasable`]).
//!
//! Dependencies run one way: `limiter` (the arithmetic) ← `counter` ← `rules`, `store` ←
//! `engine`.

mod key;
mod unit;

pub use key::{KeyBuf, fnv1a, slot_id};
pub use unit::Unit;

use crate::clock::MICROS_PER_SECOND;
use crate::limiter::TIME_MAX;

/// `name()`, `Display` and `FromStr` for an enum of settings spelled in rules and flags
/// (`failure_mode`, `mode`); an unknown spelling's error lists the choices.
macro_rules! spelled_enum {
    ($ty:ident, $what:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    _ => Err(format!(
                        "unknown {} '{s}' (expected {})",
                        $what,
                        choices(&[$($name),+])
                    )),
                }
            }
        }
    };
}

/// `a, b or c`.
fn choices(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// How a matched level's value goes into the counter's identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyPart<'a> {
    /// The request's own value: each value has its own counter.
    Value(&'a str),
    /// `share_threshold`: the pattern, shared by every value it matches.
    Pattern(&'a str),
}

/// What a counter's checks get when the shared backend cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FailureMode {
    /// OK, unlimited while the backend is away.
    Allow,
    /// OVER_LIMIT, with a Retry-After of one second.
    Deny,
    /// The default: keeps limiting during an outage, with each node enforcing the limit on its
    /// own traffic.
    #[default]
    Local,
    /// The call fails with UNAVAILABLE and Envoy's `failure_mode_deny` decides.
    Error,
}

spelled_enum!(FailureMode, "failure mode", {
    Allow => "allow",
    Deny => "deny",
    Local => "local",
    Error => "error",
});

/// How a counter is decided against a shared backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// One backend call per request: every decision is exact.
    #[default]
    Strict,
    /// Leases of quota, decided locally (see `store::lease`).
    Hybrid,
}

spelled_enum!(Mode, "mode", {
    Strict => "strict",
    Hybrid => "hybrid",
});

/// A period the arithmetic cannot hold exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PeriodError {
    #[error("unit_multiplier must be at least 1")]
    ZeroMultiplier,
    #[error(
        "{multiplier} × {unit} is longer than the longest period sluice computes exactly ({max_years} years)"
    )]
    TooLong {
        unit: Unit,
        multiplier: u32,
        max_years: u64,
    },
}

/// The period of `multiplier` units in microseconds: the one constructor for rules files and
/// request overrides. Every product is checked, and a period must stay within 2^52 µs (about
/// 142 years, `limiter::TIME_MAX`): the Lua twins compute in doubles, exact up to 2^53, and a
/// time plus a period must stay there.
pub fn period_us(unit: Unit, multiplier: u32) -> Result<u64, PeriodError> {
    if multiplier == 0 {
        return Err(PeriodError::ZeroMultiplier);
    }
    unit.seconds()
        .checked_mul(u64::from(multiplier))
        .and_then(|s| s.checked_mul(MICROS_PER_SECOND))
        .filter(|&us| us <= TIME_MAX)
        .ok_or(PeriodError::TooLong {
            unit,
            multiplier,
            max_years: TIME_MAX / (Unit::Year.seconds() * MICROS_PER_SECOND),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_are_checked_at_the_edges() {
        assert_eq!(period_us(Unit::Minute, 5), Ok(300_000_000));
        assert_eq!(period_us(Unit::Second, 0), Err(PeriodError::ZeroMultiplier));
        // Both numbers the issue found accepted: they wrapped in release builds.
        for (unit, m) in [(Unit::Year, u32::MAX), (Unit::Day, 213_503_983)] {
            let e = period_us(unit, m).unwrap_err();
            assert!(matches!(e, PeriodError::TooLong { .. }), "{unit} × {m}");
            assert!(e.to_string().contains("142 years"), "{e}");
        }
        // The longest exact period is accepted, one more minute is not.
        let max_min = u32::try_from(TIME_MAX / (60 * MICROS_PER_SECOND)).unwrap();
        assert_eq!(
            period_us(Unit::Minute, max_min),
            Ok(u64::from(max_min) * 60 * MICROS_PER_SECOND)
        );
        assert!(period_us(Unit::Minute, max_min + 1).is_err());
        // Seconds cannot reach it: u32::MAX seconds is 136 years.
        assert!(period_us(Unit::Second, u32::MAX).is_ok());
        assert!(period_us(Unit::Year, 142).is_ok());
        assert!(period_us(Unit::Year, 143).is_err());
    }

    #[test]
    fn settings_are_spelled_as_in_the_rules() {
        for mode in [
            FailureMode::Allow,
            FailureMode::Deny,
            FailureMode::Local,
            FailureMode::Error,
        ] {
            assert_eq!(mode.to_string().parse::<FailureMode>(), Ok(mode));
        }
        assert_eq!(
            "allowed".parse::<FailureMode>(),
            Err("unknown failure mode 'allowed' (expected allow, deny, local or error)".into())
        );
        assert_eq!("hybrid".parse::<Mode>(), Ok(Mode::Hybrid));
    }
}
