//! The most-limited descriptor values (`GET /top`, `sluice top`): per rule, a bounded
//! heavy-hitters sketch of the values its denials carried — "who is hitting the limits right
//! now?" without reading logs.
//!
//! **Why this shape.** Space-Saving (Metwally et al.): each rule keeps at most [`SLOTS`] values
//! with their counts; a value not held replaces the smallest, inheriting its count as its error
//! bound. Memory is fixed per rule whatever the traffic, and any value denied more than
//! `total / SLOTS` times is certain to be held. Counts halve every `half_life`, so the view
//! follows the last few minutes, not the process's life. Only denials are recorded: a request
//! that passes costs this nothing, and the denied path pays one short lock per limited rule.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::clock::Clock;

/// Values held per rule.
pub const SLOTS: usize = 64;

/// Rules tracked at most (beyond it, new rules' denials are not recorded): a bound whatever the
/// rules or labels (a `detailed_metric` rule's label carries values).
pub const MAX_RULES: usize = 1_000;

#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The descriptor's entries, `k=v,k=v`.
    pub value: String,
    /// Denials (decayed).
    pub denials: f64,
    /// Hits those denied requests carried (decayed).
    pub hits: f64,
    /// How much of `denials` may belong to values it replaced (Space-Saving's error bound).
    pub error: f64,
}

#[derive(Debug, Default)]
struct Sketch {
    entries: Vec<Entry>,
}

impl Sketch {
    fn record(&mut self, value: &str, hits: u64) {
        if let Some(e) = self.entries.iter_mut().find(|e| e.value == value) {
            e.denials += 1.0;
            e.hits += hits as f64;
            return;
        }
        if self.entries.len() < SLOTS {
            self.entries.push(Entry {
                value: value.to_owned(),
                denials: 1.0,
                hits: hits as f64,
                error: 0.0,
            });
            return;
        }
        // Replace the smallest: the newcomer inherits its count as the bound of its error.
        if let Some(min) = self
            .entries
            .iter_mut()
            .min_by(|a, b| a.denials.total_cmp(&b.denials))
        {
            let floor = min.denials;
            *min = Entry {
                value: value.to_owned(),
                denials: floor + 1.0,
                hits: hits as f64,
                error: floor,
            };
        }
    }

    fn decay(&mut self, factor: f64) {
        for e in &mut self.entries {
            e.denials *= factor;
            e.hits *= factor;
            e.error *= factor;
        }
        // What decayed below a hundredth of a denial is gone.
        self.entries.retain(|e| e.denials >= 0.01);
    }
}

/// One rule's most-denied values, largest first.
#[derive(Debug, Clone, PartialEq)]
pub struct RuleTop {
    pub domain: String,
    pub rule: String,
    pub entries: Vec<Entry>,
}

/// The sketches of every rule, decaying on `clock` (monotonic microseconds).
pub struct TopLimited {
    clock: Arc<dyn Clock>,
    half_life_us: u64,
    state: Mutex<State>,
}

struct State {
    /// (domain, rule) → its sketch.
    rules: HashMap<(String, Arc<str>), Sketch>,
    decayed_at_us: u64,
}

impl TopLimited {
    pub fn new(clock: Arc<dyn Clock>, half_life: std::time::Duration) -> Self {
        let now = clock.now_micros();
        Self {
            clock,
            half_life_us: (half_life.as_micros() as u64).max(1),
            state: Mutex::new(State {
                rules: HashMap::new(),
                decayed_at_us: now,
            }),
        }
    }

    pub fn half_life(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.half_life_us)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Halves every count once per half-life gone by.
    fn decay(&self, state: &mut State) {
        let now = self.clock.now_micros();
        let halvings = now.saturating_sub(state.decayed_at_us) / self.half_life_us;
        if halvings == 0 {
            return;
        }
        state.decayed_at_us += halvings * self.half_life_us;
        let factor = 0.5f64.powi(i32::try_from(halvings).unwrap_or(i32::MAX));
        for sketch in state.rules.values_mut() {
            sketch.decay(factor);
        }
        state.rules.retain(|_, s| !s.entries.is_empty());
    }

    /// A request carrying `value` (`k=v,k=v`) and `hits` was denied by `rule` of `domain`.
    pub fn record(&self, domain: &str, rule: &Arc<str>, value: &str, hits: u64) {
        let mut state = self.state();
        self.decay(&mut state);
        let key = (domain.to_owned(), rule.clone());
        if !state.rules.contains_key(&key) && state.rules.len() >= MAX_RULES {
            return;
        }
        state.rules.entry(key).or_default().record(value, hits);
    }

    /// The `n` most-denied values of each rule, rules with the most denials first.
    pub fn snapshot(&self, n: usize) -> Vec<RuleTop> {
        let mut state = self.state();
        self.decay(&mut state);
        let mut tops: Vec<RuleTop> = state
            .rules
            .iter()
            .map(|((domain, rule), sketch)| {
                let mut entries = sketch.entries.clone();
                entries.sort_by(|a, b| b.denials.total_cmp(&a.denials));
                entries.truncate(n);
                RuleTop {
                    domain: domain.clone(),
                    rule: rule.to_string(),
                    entries,
                }
            })
            .collect();
        let total = |t: &RuleTop| t.entries.iter().map(|e| e.denials).sum::<f64>();
        tops.sort_by(|a, b| total(b).total_cmp(&total(a)).then(a.rule.cmp(&b.rule)));
        tops
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    const S: u64 = 1_000_000;

    fn top() -> (Arc<ManualClock>, TopLimited) {
        let clock = Arc::new(ManualClock::new(S));
        let top = TopLimited::new(clock.clone(), std::time::Duration::from_secs(60));
        (clock, top)
    }

    #[test]
    fn the_heaviest_values_are_held_whatever_the_traffic() {
        let (_, top) = top();
        let rule: Arc<str> = "user".into();
        // Two heavy hitters among 10 000 values denied once each.
        for i in 0..10_000 {
            top.record("d", &rule, &format!("user=u{i}"), 1);
            if i % 10 == 0 {
                top.record("d", &rule, "user=heavy", 3);
            }
            if i % 20 == 0 {
                top.record("d", &rule, "user=second", 1);
            }
        }
        let snap = top.snapshot(2);
        assert_eq!(snap.len(), 1);
        let values: Vec<&str> = snap[0].entries.iter().map(|e| e.value.as_str()).collect();
        assert_eq!(values, ["user=heavy", "user=second"]);
        let heavy = &snap[0].entries[0];
        // The count is an over-estimate by at most its error bound.
        assert!(heavy.denials - heavy.error <= 1_000.0 && heavy.denials >= 1_000.0);
        assert!(heavy.hits >= 3_000.0);
        let state = top.state();
        assert!(state.rules.values().all(|s| s.entries.len() <= SLOTS));
    }

    #[test]
    fn counts_halve_each_half_life_and_fade_out() {
        let (clock, top) = top();
        let rule: Arc<str> = "k".into();
        for _ in 0..8 {
            top.record("d", &rule, "k=a", 1);
        }
        clock.advance(60 * S);
        assert_eq!(top.snapshot(5)[0].entries[0].denials, 4.0);
        clock.advance(120 * S);
        assert_eq!(top.snapshot(5)[0].entries[0].denials, 1.0);
        clock.advance(3600 * S);
        assert!(top.snapshot(5).is_empty(), "an hour later nothing is left");
    }

    #[test]
    fn rules_are_ordered_by_denials_and_bounded_in_number() {
        let (_, top) = top();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        top.record("d", &a, "k=1", 1);
        for _ in 0..3 {
            top.record("d", &b, "k=2", 1);
        }
        let snap = top.snapshot(5);
        assert_eq!(snap[0].rule, "b");
        assert_eq!(snap[1].rule, "a");
        for i in 0..MAX_RULES + 10 {
            top.record("d", &format!("r{i}").into(), "k=v", 1);
        }
        assert_eq!(top.state().rules.len(), MAX_RULES);
    }
}
