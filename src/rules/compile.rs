//! Validation and compilation of one parsed file into a [`Domain`] tree.

use std::collections::HashMap;

use super::parse::{RawConcurrency, RawDescriptor, RawFile, RawLimit, RawPlan, parse};
use super::{
    Domain, KeyBranch, Level, MetricLevel, MetricMatch, Node, Place, Plan, PlanRef, PlanSource,
    Rule, RuleError, Tier, Unit,
};
use crate::limiter::{Algorithm, Limit};

/// Deepest descriptor nesting: a request carries at most 32 entries by default.
pub const MAX_DEPTH: usize = 32;

/// A concurrency limit's `max_hold`, at least and at most.
const MAX_HOLD_MIN: std::time::Duration = std::time::Duration::from_secs(1);
const MAX_HOLD_MAX: std::time::Duration = std::time::Duration::from_secs(24 * 3_600);
/// Most rules in one domain: far beyond any real set, short of exhausting memory.
pub const MAX_RULES: usize = 100_000;

/// A file that did not compile: every problem found in it, and its domain when it names one
/// (so a duplicate domain in another file is still reported).
#[derive(Debug)]
pub struct FileErrors {
    pub domain: Option<String>,
    pub errors: Vec<RuleError>,
}

/// Compiles one file.
pub fn compile_file(file: &str, text: &str) -> Result<Domain, FileErrors> {
    let raw = parse(text).map_err(|e| FileErrors {
        domain: None,
        errors: vec![yaml_error(file, &e)],
    })?;
    compile_raw(file, &raw)
}

/// Compiles rules already parsed (from a file, or decoded from an xDS resource); `file` names
/// where they came from in errors.
pub fn compile_raw(file: &str, raw: &RawFile) -> Result<Domain, FileErrors> {
    let mut c = Compiler {
        file,
        errors: Vec::new(),
        rule_count: 0,
        metric_path: Vec::new(),
        plans: Vec::new(),
        plan_groups: Vec::new(),
    };
    let name = raw.domain.clone().unwrap_or_default();
    if name.is_empty() {
        c.error("domain", "config file cannot have empty domain".into());
    }
    c.plans(raw);
    let default_plan = match raw.default_plan.as_deref() {
        None => None,
        Some(p) => {
            let found = c.plans.iter().position(|plan| plan.name == p);
            if found.is_none() {
                c.error("default_plan", format!("no plan named '{p}' in plans"));
            }
            found
        }
    };
    let root = c.level(&raw.descriptors, "descriptors", &name, "");
    if !c.plan_groups.is_empty() && default_plan.is_none() && c.errors.is_empty() {
        c.error(
            "default_plan",
            "rules take limits from plans, so default_plan must name the plan of unknown clients"
                .into(),
        );
    }
    for (at, group) in std::mem::take(&mut c.plan_groups) {
        for plan in c.plans.iter().filter(|p| !p.unlimited) {
            if !plan.groups.contains_key(&group) {
                c.errors.push(RuleError {
                    file: file.to_owned(),
                    location: at.clone(),
                    message: format!("plan '{}' has no limits named '{group}'", plan.name),
                });
            }
        }
    }
    let clients = c.clients(raw, "clients");
    if c.rule_count > MAX_RULES {
        c.error(
            "descriptors",
            format!(
                "{} rules in one domain; the limit is {MAX_RULES}",
                c.rule_count
            ),
        );
    }
    if !c.errors.is_empty() {
        return Err(FileErrors {
            domain: Some(name).filter(|n| !n.is_empty()),
            errors: c.errors,
        });
    }
    Ok(Domain {
        name,
        file: file.to_owned(),
        root,
        rule_count: c.rule_count,
        map_only: raw.clients.is_some() && raw.descriptors.is_empty() && raw.plans.is_none(),
        clients_by_name: match (&raw.clients, &raw.plans) {
            (Some(clients), None) => clients.clone().into_iter().collect(),
            _ => Vec::new(),
        },
        plans: c.plans,
        default_plan,
        clients,
    })
}

/// Adds the descriptors of `more`, another file of the same domain, to `into` (domain merging).
/// As in the reference, a top-level descriptor that both define is an error (a descriptor is
/// never merged with another); plans, when used, stay in one of the files. Errors name `more`'s
/// file.
pub(super) fn merge_domain(into: &mut Domain, more: Domain, errors: &mut Vec<RuleError>) {
    let file = more.file.clone();
    let mut error = |location: &str, message: String| {
        errors.push(RuleError {
            file: file.clone(),
            location: location.to_owned(),
            message,
        })
    };
    let domain = into.name.clone();
    for (key, branch) in more.root.keys {
        let target = into.root.keys.entry(key.clone()).or_default();
        let places = (branch.exact.into_iter())
            .map(|(v, n)| (Place::Exact(v), n))
            .chain(
                branch
                    .wildcards
                    .into_iter()
                    .map(|(p, n)| (Place::Pattern(p), n)),
            )
            .chain(branch.any.map(|n| (Place::Any, *n)));
        for (place, node) in places {
            let composite = place.composite(&key);
            if !target.add(place, node) {
                error(
                    "descriptors",
                    format!("duplicate descriptor composite key '{domain}.{composite}'"),
                );
            }
        }
    }
    into.rule_count += more.rule_count;
    if !more.plans.is_empty() {
        if into.plans.is_empty() {
            into.plans = more.plans;
            into.default_plan = more.default_plan;
            into.clients = more.clients;
        } else {
            error(
                "plans",
                format!(
                    "domain '{domain}' has plans in {} already: a merged domain keeps its plans in one file",
                    into.file
                ),
            );
        }
    }
}

/// Adds a client map file's clients to the domain with the plans. Errors name the map file.
pub(super) fn merge_clients(domain: &mut Domain, map: Domain, errors: &mut Vec<RuleError>) {
    if domain.plans.is_empty() {
        errors.push(RuleError {
            file: map.file.clone(),
            location: "clients".into(),
            message: format!("domain '{}' defines no plans", domain.name),
        });
        return;
    }
    for (client, plan) in map.clients_by_name {
        match domain.plans.iter().position(|p| p.name == plan) {
            Some(i) => {
                if domain.clients.insert(client.clone(), i).is_some() {
                    errors.push(RuleError {
                        file: map.file.clone(),
                        location: format!("clients.{client}"),
                        message: format!("client '{client}' is listed twice"),
                    });
                }
            }
            None => errors.push(RuleError {
                file: map.file.clone(),
                location: format!("clients.{client}"),
                message: format!("no plan named '{plan}' in domain '{}'", domain.name),
            }),
        }
    }
}

fn yaml_error(file: &str, e: &serde_yaml::Error) -> RuleError {
    let text = e.to_string();
    match e.location() {
        Some(l) => {
            let suffix = format!(" at line {} column {}", l.line(), l.column());
            RuleError {
                file: file.to_owned(),
                location: format!("line {} column {}", l.line(), l.column()),
                message: text.strip_suffix(&suffix).unwrap_or(&text).to_owned(),
            }
        }
        None => RuleError {
            file: file.to_owned(),
            location: "file".into(),
            message: text,
        },
    }
}

struct Compiler<'f> {
    file: &'f str,
    errors: Vec<RuleError>,
    rule_count: usize,
    /// The levels from the root to the descriptor being compiled (for metrics labels).
    metric_path: Vec<MetricLevel>,
    plans: Vec<Plan>,
    /// (location, group) of every rule that takes limits from a plan.
    plan_groups: Vec<(String, String)>,
}

impl Compiler<'_> {
    fn plans(&mut self, raw: &super::parse::RawFile) {
        for (name, plan) in raw.plans.iter().flatten() {
            let at = format!("plans.{name}");
            let groups: Vec<(String, &Vec<RawLimit>)> = match plan {
                RawPlan::Word(w) if w == "unlimited" => {
                    self.plans.push(Plan {
                        name: name.clone(),
                        unlimited: true,
                        groups: HashMap::new(),
                    });
                    continue;
                }
                RawPlan::Word(w) => {
                    self.error(
                        &at,
                        format!("a plan is 'unlimited' or its limits, not '{w}'"),
                    );
                    continue;
                }
                RawPlan::Limits(limits) => vec![("default".to_owned(), limits)],
                RawPlan::Groups(groups) => groups.iter().map(|(g, l)| (g.clone(), l)).collect(),
            };
            let mut compiled = HashMap::new();
            for (group, limits) in groups {
                let names: Vec<&str> = limits.iter().filter_map(|l| l.name.as_deref()).collect();
                let mut tiers = Vec::new();
                for (i, limit) in limits.iter().enumerate() {
                    let tier_at = format!("{at}.{group}[{i}]");
                    if limit.unlimited || limit.replaces.is_some() {
                        self.error(
                            &tier_at,
                            "a plan's limits cannot be unlimited or replace others (make the plan 'unlimited')"
                                .into(),
                        );
                        continue;
                    }
                    if let Some(mut tier) = self.tier(&tier_at, limit, &names) {
                        // The status names the plan and the tier that decided.
                        let tier_name = limit
                            .name
                            .clone()
                            .unwrap_or_else(|| tier.unit.name().to_ascii_lowercase());
                        tier.name = Some(format!("{name}:{tier_name}").into());
                        tiers.push(tier);
                    }
                }
                compiled.insert(group, tiers);
            }
            self.plans.push(Plan {
                name: name.clone(),
                unlimited: false,
                groups: compiled,
            });
        }
    }

    /// Client → plan index, for clients in this file (a map-only file keeps names to merge).
    fn clients(&mut self, raw: &super::parse::RawFile, at: &str) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        let Some(clients) = &raw.clients else {
            return out;
        };
        if raw.plans.is_none() {
            // A client map for plans in another file: checked when merged.
            return out;
        }
        for (client, plan) in clients {
            match self.plans.iter().position(|p| p.name == *plan) {
                Some(i) => {
                    out.insert(client.clone(), i);
                }
                None => self.error(
                    &format!("{at}.{client}"),
                    format!("no plan named '{plan}' in plans"),
                ),
            }
        }
        out
    }

    fn error(&mut self, location: &str, message: String) {
        self.errors.push(RuleError {
            file: self.file.to_owned(),
            location: location.to_owned(),
            message,
        });
    }

    /// `at` is the path of the list (`descriptors`, `descriptors[0].descriptors`); `parent` the
    /// reference-style composite key of the parent (`domain.key_value`), `parent_path` the same
    /// without the domain.
    fn level(
        &mut self,
        raws: &[RawDescriptor],
        at: &str,
        parent: &str,
        parent_path: &str,
    ) -> Level {
        let mut level = Level::default();
        let depth = at.matches("descriptors").count();
        if depth > MAX_DEPTH && !raws.is_empty() {
            self.error(
                at,
                format!(
                    "descriptors nest deeper than {MAX_DEPTH} levels (no request could match them)"
                ),
            );
            return level;
        }
        for (i, raw) in raws.iter().enumerate() {
            let here = format!("{at}[{i}]");
            let key = raw.key.as_deref().unwrap_or_default();
            if key.is_empty() {
                self.error(&here, "descriptor has empty key".into());
                continue;
            }
            let place = Place::of(raw.value.as_deref());
            let kv = place.composite(key);
            let composite = format!("{parent}.{kv}");
            let path = if parent_path.is_empty() {
                kv.clone()
            } else {
                format!("{parent_path}.{kv}")
            };
            let matched = match &place {
                Place::Any => MetricMatch::KeyOnly,
                Place::Pattern(p) => MetricMatch::Pattern {
                    pattern: p.as_str().to_owned(),
                    share: raw.share_threshold,
                },
                Place::Exact(_) => MetricMatch::Exact,
            };
            self.metric_path.push(MetricLevel {
                key: key.to_owned(),
                matched,
                value_to_metric: raw.value_to_metric,
            });
            let is_pattern = matches!(place, Place::Pattern(_));
            let node = self.node(raw, &here, &composite, &path, &kv, is_pattern);
            self.metric_path.pop();
            let branch: &mut KeyBranch = level.keys.entry(key.to_owned()).or_default();
            if !branch.add(place, node) {
                self.error(
                    &here,
                    format!("duplicate descriptor composite key '{composite}'"),
                );
            }
        }
        level
    }

    fn node(
        &mut self,
        raw: &RawDescriptor,
        here: &str,
        composite: &str,
        path: &str,
        kv: &str,
        is_pattern: bool,
    ) -> Node {
        if raw.share_threshold && !is_pattern {
            self.error(
                here,
                format!(
                    "share_threshold can only be used with wildcard values (containing '*'), but found key '{kv}'"
                ),
            );
        }
        let limits: Vec<(String, &RawLimit)> = match (&raw.rate_limit, &raw.rate_limits) {
            (Some(_), Some(_)) => {
                self.error(
                    here,
                    "use either rate_limit or rate_limits, not both".into(),
                );
                Vec::new()
            }
            (Some(one), None) => vec![(format!("{here}.rate_limit"), one)],
            (None, Some(many)) => {
                if many.is_empty() {
                    self.error(
                        &format!("{here}.rate_limits"),
                        "rate_limits must list at least one limit".into(),
                    );
                }
                many.iter()
                    .enumerate()
                    .map(|(i, l)| (format!("{here}.rate_limits[{i}]"), l))
                    .collect()
            }
            (None, None) => Vec::new(),
        };
        if let Some(c) = &raw.concurrency {
            return self.concurrency_node(raw, c, here, composite, path, !limits.is_empty());
        }
        let plan = raw.plan.as_ref().and_then(|p| {
            let at = format!("{here}.plan");
            if !limits.is_empty() {
                self.error(&at, "use either plan or rate_limit(s), not both".into());
                return None;
            }
            let source = match (&p.client, &p.entry) {
                (Some(k), None) if !k.is_empty() => PlanSource::Client(k.clone()),
                (None, Some(k)) if !k.is_empty() => PlanSource::Entry(k.clone()),
                _ => {
                    self.error(
                        &at,
                        "a plan comes from either `client: <entry key>` (looked up in clients) or `entry: <entry key>` (the plan's name)"
                            .into(),
                    );
                    return None;
                }
            };
            if self.plans.is_empty() {
                self.error(&at, "the domain defines no plans".into());
                return None;
            }
            let group = p.limits.clone().unwrap_or_else(|| "default".into());
            self.plan_groups.push((at, group.clone()));
            Some(PlanRef { source, group })
        });
        let rule = if let Some(plan) = plan {
            if raw.overdraft {
                self.error(
                    &format!("{here}.overdraft"),
                    "overdraft applies to a descriptor's own rate_limit or rate_limits, not to plan limits".into(),
                );
            }
            self.rule_count += 1;
            Some(Rule {
                plan: Some(plan),
                ..self.rule(raw, here, Vec::new(), false, path)
            })
        } else if limits.is_empty() {
            for (set, field) in [
                (raw.overdraft, "overdraft"),
                (raw.failure_mode.is_some(), "failure_mode"),
                (raw.mode.is_some(), "mode"),
                (raw.hash_tag.is_some(), "hash_tag"),
            ] {
                if set {
                    self.error(
                        &format!("{here}.{field}"),
                        format!(
                            "{field} applies only to a descriptor with rate_limit or rate_limits"
                        ),
                    );
                }
            }
            None
        } else {
            self.rule_count += 1;
            let (tiers, unlimited) = self.tiers(raw, here, &limits);
            Some(self.rule(raw, here, tiers, unlimited, path))
        };
        self.node_of(raw, rule, here, composite, path)
    }

    /// The node of `raw` with its `rule`, and its children compiled below it.
    fn node_of(
        &mut self,
        raw: &RawDescriptor,
        rule: Option<Rule>,
        here: &str,
        composite: &str,
        path: &str,
    ) -> Node {
        Node {
            rule,
            share: raw.share_threshold,
            children: self.level(
                &raw.descriptors,
                &format!("{here}.descriptors"),
                composite,
                path,
            ),
        }
    }

    /// A node with `concurrency:`: one tier of the concurrency algorithm, `limit` slots held
    /// for at most `max_hold`, and no children (its entry names one request).
    fn concurrency_node(
        &mut self,
        raw: &RawDescriptor,
        c: &RawConcurrency,
        here: &str,
        composite: &str,
        path: &str,
        has_limits: bool,
    ) -> Node {
        let at = format!("{here}.concurrency");
        if has_limits || raw.plan.is_some() {
            self.error(
                &at,
                "use either concurrency or rate_limit(s)/plan on one descriptor, not both".into(),
            );
        }
        if !raw.descriptors.is_empty() {
            self.error(
                &format!("{here}.descriptors"),
                "a concurrency limit's entry names one request (its slot): it has no child descriptors; put the limit on the request id's level".into(),
            );
        }
        for (set, field) in [(raw.overdraft, "overdraft"), (raw.quota_mode, "quota_mode")] {
            if set {
                self.error(
                    &format!("{here}.{field}"),
                    format!("{field} does not apply to a concurrency limit"),
                );
            }
        }
        let limit = c.limit;
        if limit.is_none() {
            self.error(
                &format!("{at}.limit"),
                "a concurrency limit needs `limit`: how many requests may be in flight at once"
                    .into(),
            );
        }
        let max_hold = match c.max_hold.as_deref() {
            None => {
                self.error(
                    &format!("{at}.max_hold"),
                    "a concurrency limit needs `max_hold`: how long a slot that is never released (a crashed proxy, a lost call) is held; set it above the route's timeout".into(),
                );
                None
            }
            Some(text) => match crate::clock::parse_duration(text) {
                Ok(d) if d < MAX_HOLD_MIN || d > MAX_HOLD_MAX => {
                    self.error(
                        &format!("{at}.max_hold"),
                        format!("max_hold must be between 1s and 24h, not {text}"),
                    );
                    None
                }
                Ok(d) => Some(d),
                Err(e) => {
                    self.error(&format!("{at}.max_hold"), e);
                    None
                }
            },
        };
        let tier = match (limit, max_hold) {
            (Some(limit), Some(max_hold)) => {
                let period_us = max_hold.as_micros() as u64;
                match Limit::new(Algorithm::Concurrency, u64::from(limit), period_us, None) {
                    Ok(l) => Some(Tier {
                        name: None,
                        unit: Unit::Second,
                        unit_multiplier: u32::try_from(max_hold.as_secs()).unwrap_or(u32::MAX),
                        requests_per_unit: limit,
                        limit: l,
                        replaces: Vec::new(),
                    }),
                    Err(e) => {
                        self.error(&at, e.to_string());
                        None
                    }
                }
            }
            _ => None,
        };
        let rule = tier.map(|tier| {
            self.rule_count += 1;
            Rule {
                slot_key: raw.key.clone(),
                ..self.rule(raw, here, vec![tier], false, path)
            }
        });
        self.node_of(raw, rule, here, composite, path)
    }

    /// `mode: hybrid` only where every limit may be leased.
    fn check_hybrid(&mut self, here: &str, mode: Option<crate::counter::Mode>, tiers: &[Tier]) {
        let unsound = tiers.iter().find(|t| !t.limit.algorithm.leasable());
        if let (Some(crate::counter::Mode::Hybrid), Some(tier)) = (mode, unsound) {
            self.error(
                &format!("{here}.mode"),
                format!(
                    "mode: hybrid applies only to {} limits, not to {} (a lease held unused would let it admit more than its limit)",
                    Algorithm::names_where(Algorithm::leasable),
                    tier.limit.algorithm
                ),
            );
        }
    }

    /// A field spelled as one of a set of names (`failure_mode`, `mode`); an error if another.
    fn choice<T: std::str::FromStr<Err = String>>(
        &mut self,
        here: &str,
        field: &str,
        raw: Option<&str>,
    ) -> Option<T> {
        match raw?.parse() {
            Ok(value) => Some(value),
            Err(e) => {
                self.error(&format!("{here}.{field}"), e);
                None
            }
        }
    }

    /// The tiers of a descriptor's `rate_limit(s)`, checked, and whether it is `unlimited`.
    fn tiers(
        &mut self,
        raw: &RawDescriptor,
        here: &str,
        limits: &[(String, &RawLimit)],
    ) -> (Vec<Tier>, bool) {
        let unlimited = limits.iter().any(|(_, l)| l.unlimited);
        if unlimited && limits.len() > 1 {
            self.error(
                &limits[0].0,
                "unlimited cannot be combined with other limits in rate_limits".into(),
            );
        }
        let names: Vec<&str> = limits
            .iter()
            .filter_map(|(_, l)| l.name.as_deref())
            .collect();
        let mut tiers = Vec::new();
        for (at, limit) in limits {
            if let Some(mut tier) = self.tier(at, limit, &names) {
                if raw.overdraft {
                    match tier.limit.with_overdraft() {
                        Ok(l) => tier.limit = l,
                        Err(e) => self.error(&format!("{here}.overdraft"), e.to_string()),
                    }
                }
                tiers.push(tier);
            }
        }
        let mut seen = Vec::new();
        for (at, l) in limits {
            if let Some(name) = l.name.as_deref() {
                if seen.contains(&name) {
                    self.error(
                        at,
                        format!("two limits of one descriptor are named '{name}'"),
                    );
                }
                seen.push(name);
            }
        }
        (tiers, unlimited)
    }

    /// The rule of a descriptor with these `tiers` (its limits, or its concurrency limit's).
    fn rule(
        &mut self,
        raw: &RawDescriptor,
        here: &str,
        tiers: Vec<Tier>,
        unlimited: bool,
        path: &str,
    ) -> Rule {
        let failure_mode = self.choice(here, "failure_mode", raw.failure_mode.as_deref());
        let mode = self.choice(here, "mode", raw.mode.as_deref());
        self.check_hybrid(here, mode, &tiers);
        if raw.overdraft && mode == Some(crate::counter::Mode::Hybrid) {
            self.error(
                &format!("{here}.mode"),
                "mode: hybrid does not apply to an overdraft limit (its every charge must reach the shared counter)".into(),
            );
        }
        if raw.hash_tag.as_deref() == Some("") {
            self.error(
                &format!("{here}.hash_tag"),
                "hash_tag must name an entry key".into(),
            );
        }
        Rule {
            path: path.to_owned(),
            label: path.into(),
            failure_mode,
            mode,
            hash_tag: raw.hash_tag.clone().filter(|t| !t.is_empty()),
            plan: None,
            slot_key: None,
            tiers: if unlimited { Vec::new() } else { tiers },
            unlimited,
            shadow_mode: raw.shadow_mode,
            detailed_metric: raw.detailed_metric,
            metric_levels: if raw.detailed_metric
                || self.metric_path.iter().any(|l| l.value_to_metric)
            {
                self.metric_path.clone()
            } else {
                Vec::new()
            },
            quota_mode: raw.quota_mode,
            metadata: raw.metadata.clone().map(std::sync::Arc::new),
        }
    }

    fn tier(&mut self, at: &str, raw: &RawLimit, own_names: &[&str]) -> Option<Tier> {
        let mut replaces = Vec::new();
        for (i, r) in raw.replaces.iter().flatten().enumerate() {
            match r.name.as_deref() {
                None | Some("") => self.error(
                    &format!("{at}.replaces[{i}]"),
                    "should not have an empty replaces entry".into(),
                ),
                Some(name) if own_names.contains(&name) => self.error(
                    &format!("{at}.replaces[{i}]"),
                    "replaces should not contain name of same descriptor".into(),
                ),
                Some(name) => replaces.push(name.to_owned()),
            }
        }
        if raw.unlimited {
            if raw.unit.is_some() {
                self.error(
                    &format!("{at}.unit"),
                    "should not specify rate limit unit when unlimited".into(),
                );
            }
            return None;
        }
        let unit_text = raw.unit.as_deref().unwrap_or_default();
        let Some(unit) = Unit::parse(unit_text) else {
            self.error(
                &format!("{at}.unit"),
                format!("invalid rate limit unit '{unit_text}'"),
            );
            return None;
        };
        let algorithm = match raw.algorithm.as_deref() {
            None => Algorithm::FixedWindow,
            Some(name) if Algorithm::parse(name).is_some_and(Algorithm::holds_slots) => {
                self.error(
                    &format!("{at}.algorithm"),
                    format!("{name} is not a rate: write `concurrency: {{limit, max_hold}}` on the descriptor whose entry names the request"),
                );
                return None;
            }
            Some(name) => match Algorithm::parse(name) {
                Some(a) => a,
                None => {
                    let known: Vec<_> = Algorithm::RATES.iter().map(|a| a.name()).collect();
                    self.error(
                        &format!("{at}.algorithm"),
                        format!(
                            "unknown algorithm '{name}' (expected one of {})",
                            known.join(", ")
                        ),
                    );
                    return None;
                }
            },
        };
        let unit_multiplier = raw.unit_multiplier.unwrap_or(1);
        let period_us = match crate::counter::period_us(unit, unit_multiplier) {
            Ok(p) => p,
            Err(e) => {
                self.error(&format!("{at}.unit_multiplier"), e.to_string());
                return None;
            }
        };
        let requests_per_unit = raw.requests_per_unit.unwrap_or(0);
        let limit = Limit::new(
            algorithm,
            u64::from(requests_per_unit),
            period_us,
            raw.burst.map(u64::from),
        );
        let limit = match (limit, raw.calendar.as_deref()) {
            (Ok(limit), Some(zone)) => {
                let calendar = self.calendar(at, zone, unit, unit_multiplier)?;
                limit.with_calendar(calendar)
            }
            (limit, _) => limit,
        };
        match limit {
            Ok(limit) => Some(Tier {
                name: raw.name.as_deref().map(Into::into),
                unit,
                unit_multiplier,
                requests_per_unit,
                limit,
                replaces,
            }),
            Err(e) => {
                self.error(at, e.to_string());
                None
            }
        }
    }

    /// The interned calendar of a limit's `calendar:` (errors located at it).
    fn calendar(
        &mut self,
        at: &str,
        zone: &str,
        unit: Unit,
        unit_multiplier: u32,
    ) -> Option<crate::calendar::CalendarRef> {
        use crate::calendar::{Calendar, CalendarUnit};
        let calendar_unit = match unit {
            Unit::Day => CalendarUnit::Day,
            Unit::Week => CalendarUnit::Week,
            Unit::Month => CalendarUnit::Month,
            Unit::Year => CalendarUnit::Year,
            Unit::Second | Unit::Minute | Unit::Hour => {
                self.error(
                    &format!("{at}.calendar"),
                    format!(
                        "calendar applies to the units day, week, month and year, not {}",
                        unit.name()
                    ),
                );
                return None;
            }
        };
        if unit_multiplier != 1 {
            self.error(
                &format!("{at}.unit_multiplier"),
                "a calendar window is one day, week, month or year: unit_multiplier is not allowed with calendar".into(),
            );
            return None;
        }
        match Calendar::interned(zone, calendar_unit) {
            Ok(c) => Some(c),
            Err(e) => {
                self.error(&format!("{at}.calendar"), e.to_string());
                None
            }
        }
    }
}
