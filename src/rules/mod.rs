//! Rules: parse the YAML files, validate them (every error with file and location), compile
//! them into an immutable [`RuleSet`], and match request descriptors against it.
//!
//! Matching follows the Go reference service exactly: per request entry, an exact key+value
//! child, else the first wildcard child of that key in file order, else the key-only child; the
//! limit is the one on the node matched by the last entry; no backtracking. Unlike the
//! reference, key and value are never joined into one string, so `(a, "b_c")` and `(a_b, "c")`
//! are different descriptors.

mod compile;
mod load;
mod parse;
mod pattern;
pub mod reload;

use std::collections::HashMap;
use std::fmt;

pub use crate::counter::{KeyPart, Unit};
pub use compile::{FileErrors, compile_file, compile_raw};
pub use load::{
    LoadOptions, MAX_FILE_BYTES, load_parsed_with, load_path, load_path_with, load_texts,
    load_texts_with,
};
pub use parse::{RawDescriptor, RawFile, RawLimit, RawReplace, rewritten, schema};
pub use pattern::Pattern;

use crate::limiter::Limit;

/// One problem in the rules, at a place an operator can find.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {location}: {message}")]
pub struct RuleError {
    pub file: String,
    /// A position (`line 3 column 5`) or a path (`descriptors[0].rate_limit.unit`).
    pub location: String,
    pub message: String,
}

/// Every error found in a set of rules files.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct RuleErrors(pub Vec<RuleError>);

impl fmt::Display for RuleErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// All domains, compiled. Immutable: a reload builds a new one.
#[derive(Debug, Default)]
pub struct RuleSet {
    domains: HashMap<String, Domain>,
}

impl RuleSet {
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    pub fn domain_count(&self) -> usize {
        self.domains.len()
    }

    /// The number of rules that carry a limit (including unlimited ones).
    pub fn rule_count(&self) -> usize {
        self.domains.values().map(|d| d.rule_count).sum()
    }

    pub fn domains(&self) -> impl Iterator<Item = &Domain> {
        self.domains.values()
    }
}

#[derive(Debug, Default)]
pub struct Domain {
    pub name: String,
    /// The file it came from.
    pub file: String,
    root: Level,
    rule_count: usize,
    plans: Vec<Plan>,
    default_plan: Option<usize>,
    /// Client → index in `plans`.
    clients: HashMap<String, usize>,
    /// A file with only `domain` and `clients`: merged into the domain's rules file.
    map_only: bool,
    /// A client map file's clients, by plan name, until merged.
    clients_by_name: Vec<(String, String)>,
}

/// A named plan: unlimited, or groups of tiers (`default`, `search`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub name: String,
    pub unlimited: bool,
    pub groups: HashMap<String, Vec<Tier>>,
}

/// A rule whose limits come from the caller's plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanRef {
    pub source: PlanSource,
    /// Which group of the plan's limits applies.
    pub group: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanSource {
    /// The value of this entry is looked up in the domain's `clients`.
    Client(String),
    /// The value of this entry is the plan's name.
    Entry(String),
}

/// What a plan rule resolves to for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PlanLimits<'a> {
    Unlimited,
    Tiers(&'a Plan, &'a [Tier]),
}

/// The children of a node, grouped by descriptor key.
#[derive(Debug, Default)]
struct Level {
    keys: HashMap<String, KeyBranch>,
}

#[derive(Debug, Default)]
struct KeyBranch {
    exact: HashMap<String, Node>,
    /// In file order: the first that matches wins.
    wildcards: Vec<(Pattern, Node)>,
    any: Option<Box<Node>>,
}

/// Where a node sits under its key: an exact value, a wildcard pattern, or the key alone.
#[derive(Debug)]
enum Place {
    Exact(String),
    Pattern(Pattern),
    Any,
}

impl Place {
    fn of(value: Option<&str>) -> Self {
        match value {
            None => Place::Any,
            Some(v) => Pattern::new(v).map_or_else(|| Place::Exact(v.to_owned()), Place::Pattern),
        }
    }

    /// The reference's composite key part: `key_value`, `key_pattern` or `key`.
    fn composite(&self, key: &str) -> String {
        match self {
            Place::Exact(v) => format!("{key}_{v}"),
            Place::Pattern(p) => format!("{key}_{}", p.as_str()),
            Place::Any => key.to_owned(),
        }
    }
}

impl KeyBranch {
    /// Puts `node` at `place`; false (and `node` dropped) when the place is taken: a
    /// duplicate descriptor, which the caller reports.
    fn add(&mut self, place: Place, node: Node) -> bool {
        match place {
            Place::Any if self.any.is_some() => false,
            Place::Any => {
                self.any = Some(Box::new(node));
                true
            }
            Place::Pattern(p) if self.wildcards.iter().any(|(q, _)| *q == p) => false,
            Place::Pattern(p) => {
                self.wildcards.push((p, node));
                true
            }
            Place::Exact(v) => match self.exact.entry(v) {
                std::collections::hash_map::Entry::Occupied(_) => false,
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(node);
                    true
                }
            },
        }
    }
}

#[derive(Debug, Default)]
struct Node {
    rule: Option<Rule>,
    /// `share_threshold`: every value matching this node's pattern shares one counter.
    share: bool,
    children: Level,
}

/// The limit(s) on one matched descriptor.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Reference-style path, e.g. `key_value.subkey` (for logs, metrics, explain).
    pub path: String,
    /// `path`, shared: the `rule` label of its metrics.
    pub label: std::sync::Arc<str>,
    pub tiers: Vec<Tier>,
    pub unlimited: bool,
    pub shadow_mode: bool,
    pub detailed_metric: bool,
    /// How each level of the rule's path names itself in a metrics label that carries request
    /// values (`detailed_metric`, or `value_to_metric` on some level); empty when the label is
    /// the path alone.
    pub metric_levels: Vec<MetricLevel>,
    pub quota_mode: bool,
    /// `metadata:`, for the response's dynamic metadata.
    pub metadata: Option<std::sync::Arc<serde_json::Map<String, serde_json::Value>>>,
    /// What to answer when the shared backend cannot (None: the server's default).
    pub failure_mode: Option<crate::counter::FailureMode>,
    /// `strict` or `hybrid` (None: the server's default).
    pub mode: Option<crate::counter::Mode>,
    /// The entry key whose value picks the Redis Cluster slot (None: the whole descriptor).
    pub hash_tag: Option<String>,
    /// The limits come from the caller's plan (then `tiers` is empty).
    pub plan: Option<PlanRef>,
    /// A concurrency limit's rule: the key of the entry whose value names the request's slot
    /// (this rule's own level). It is left out of the counter: the counter is the path above.
    pub slot_key: Option<String>,
}

/// One level of a rule's path, as its metrics label writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricLevel {
    pub key: String,
    pub matched: MetricMatch,
    /// `value_to_metric` on this level: a key-only or wildcard level writes the request's value.
    pub value_to_metric: bool,
}

/// How a level of a rule matches, for its metrics label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricMatch {
    Exact,
    /// A wildcard value; `share`: `share_threshold` (the label keeps the pattern).
    Pattern {
        pattern: String,
        share: bool,
    },
    KeyOnly,
}

impl Rule {
    /// The reference's stats key (without the domain) for a request's `entries` when it carries
    /// request values: with `detailed_metric` every level's `key_value` (a `share_threshold`
    /// level keeps its pattern), else `value_to_metric` levels write the request's value where
    /// the path has a key alone or a pattern. None: the label is the rule's path.
    pub fn metric_label(&self, entries: &[(String, String)]) -> Option<String> {
        if self.metric_levels.is_empty() {
            return None;
        }
        let shares = self
            .metric_levels
            .iter()
            .any(|l| matches!(l.matched, MetricMatch::Pattern { share: true, .. }));
        let mut out = String::new();
        for (level, (key, value)) in self.metric_levels.iter().zip(entries) {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(key);
            if self.detailed_metric && !shares {
                // The request's `key_value`, even `key_` for an empty value, as the reference.
                out.push('_');
                out.push_str(value);
                continue;
            }
            let shown: &str = match (&level.matched, self.detailed_metric) {
                (
                    MetricMatch::Pattern {
                        pattern,
                        share: true,
                    },
                    _,
                ) => pattern,
                (_, true) | (MetricMatch::Exact, false) => value,
                (MetricMatch::Pattern { .. } | MetricMatch::KeyOnly, false)
                    if level.value_to_metric =>
                {
                    value
                }
                (MetricMatch::Pattern { pattern, .. }, false) => pattern,
                (MetricMatch::KeyOnly, false) => "",
            };
            if !shown.is_empty() {
                out.push('_');
                out.push_str(shown);
            }
        }
        Some(out)
    }
}

/// One limit of a rule (a rule has several with `rate_limits:`).
#[derive(Debug, Clone, PartialEq)]
pub struct Tier {
    /// Shared, so a status can report it without copying.
    pub name: Option<std::sync::Arc<str>>,
    pub unit: Unit,
    pub unit_multiplier: u32,
    pub requests_per_unit: u32,
    pub limit: Limit,
    pub replaces: Vec<String>,
}

/// How a request entry matched a rule level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via<'a> {
    Exact,
    Wildcard(&'a str),
    KeyOnly,
}

impl Domain {
    pub fn plans(&self) -> &[Plan] {
        &self.plans
    }

    pub fn client_count(&self) -> usize {
        self.clients.len()
    }

    /// The caller's plan for a plan rule: by client (through `clients`) or by the plan name in
    /// an entry; the default plan when unknown.
    pub fn plan_for<'a>(
        &self,
        plan: &PlanRef,
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Option<(&Plan, &[Tier])> {
        let (key, by_client) = match &plan.source {
            PlanSource::Client(k) => (k.as_str(), true),
            PlanSource::Entry(k) => (k.as_str(), false),
        };
        let value = entries.into_iter().find(|(k, _)| *k == key).map(|(_, v)| v);
        let index = value
            .and_then(|v| {
                if by_client {
                    self.clients.get(v).copied()
                } else {
                    self.plans.iter().position(|p| p.name == v)
                }
            })
            .or(self.default_plan)?;
        let p = &self.plans[index];
        // Compilation checked that every limited plan has every group a rule names.
        let tiers = p.groups.get(&plan.group).map_or(&[][..], Vec::as_slice);
        Some((p, tiers))
    }

    /// Finds the rule for a descriptor's entries. `on_level` sees each matched level's key, the
    /// part that identifies its counter, and how it matched, in order.
    pub fn find<'r, 'q>(
        &'r self,
        entries: impl IntoIterator<Item = (&'q str, &'q str)>,
        mut on_level: impl FnMut(&'q str, KeyPart<'_>, Via<'_>),
    ) -> Option<&'r Rule> {
        let mut level = &self.root;
        let mut matched: Option<&Node> = None;
        for (key, value) in entries {
            let branch = level.keys.get(key)?;
            let node = if let Some(node) = branch.exact.get(value) {
                on_level(key, KeyPart::Value(value), Via::Exact);
                node
            } else if let Some((pattern, node)) =
                branch.wildcards.iter().find(|(p, _)| p.matches(value))
            {
                let part = if node.share {
                    KeyPart::Pattern(pattern.as_str())
                } else {
                    KeyPart::Value(value)
                };
                on_level(key, part, Via::Wildcard(pattern.as_str()));
                node
            } else {
                let node = branch.any.as_deref()?;
                on_level(key, KeyPart::Value(value), Via::KeyOnly);
                node
            };
            matched = Some(node);
            level = &node.children;
        }
        matched?.rule.as_ref()
    }

    /// Orders a map's entries (an RLQS bucket id has no order) as the rules nest them: the
    /// first order, trying keys alphabetically at each level, in which every entry matches a
    /// level and the last one a rule. None when no order does: the entries then match no rule.
    /// The search gives up after `MAX_ORDER_STEPS` nodes, so a hostile id costs bounded work.
    pub fn order_entries<'q>(
        &self,
        entries: &[(&'q str, &'q str)],
    ) -> Option<Vec<(&'q str, &'q str)>> {
        const MAX_ORDER_STEPS: usize = 4096;
        fn search<'q>(
            level: &Level,
            left: &mut Vec<(&'q str, &'q str)>,
            path: &mut Vec<(&'q str, &'q str)>,
            steps: &mut usize,
        ) -> bool {
            for i in 0..left.len() {
                let (key, value) = left[i];
                let Some(branch) = level.keys.get(key) else {
                    continue;
                };
                let node = branch
                    .exact
                    .get(value)
                    .or_else(|| {
                        branch
                            .wildcards
                            .iter()
                            .find(|(p, _)| p.matches(value))
                            .map(|(_, n)| n)
                    })
                    .or(branch.any.as_deref());
                let Some(node) = node else { continue };
                *steps += 1;
                if *steps > MAX_ORDER_STEPS {
                    return false;
                }
                left.remove(i);
                path.push((key, value));
                let found = if left.is_empty() {
                    node.rule.is_some()
                } else {
                    search(&node.children, left, path, steps)
                };
                if found {
                    return true;
                }
                path.pop();
                left.insert(i, (key, value));
            }
            false
        }
        let mut left: Vec<_> = entries.to_vec();
        left.sort_unstable();
        let mut path = Vec::with_capacity(left.len());
        search(&self.root, &mut left, &mut path, &mut 0).then_some(path)
    }

    /// Every rule with its path, for `/rlconfig` and explain.
    pub fn rules(&self) -> Vec<&Rule> {
        fn walk<'a>(level: &'a Level, out: &mut Vec<&'a Rule>) {
            let mut keys: Vec<_> = level.keys.iter().collect();
            keys.sort_by(|a, b| a.0.cmp(b.0));
            for (_, branch) in keys {
                let mut exact: Vec<_> = branch.exact.iter().collect();
                exact.sort_by(|a, b| a.0.cmp(b.0));
                let nodes = exact
                    .into_iter()
                    .map(|(_, n)| n)
                    .chain(branch.wildcards.iter().map(|(_, n)| n))
                    .chain(branch.any.as_deref());
                for node in nodes {
                    out.extend(node.rule.as_ref());
                    walk(&node.children, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.root, &mut out);
        out
    }
}

#[cfg(test)]
mod tests;
