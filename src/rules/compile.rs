//! Validation and compilation of one parsed file into a [`Domain`] tree.

use super::parse::{RawDescriptor, RawLimit, parse};
use super::{Domain, KeyBranch, Level, Node, Pattern, Rule, RuleError, Tier, Unit};
use crate::clock::MICROS_PER_SECOND;
use crate::limiter::{Algorithm, Limit};

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
    let mut c = Compiler {
        file,
        errors: Vec::new(),
        rule_count: 0,
    };
    let name = raw.domain.unwrap_or_default();
    if name.is_empty() {
        c.error("domain", "config file cannot have empty domain".into());
    }
    let root = c.level(&raw.descriptors, "descriptors", &name, "");
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
    })
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
}

impl Compiler<'_> {
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
        for (i, raw) in raws.iter().enumerate() {
            let here = format!("{at}[{i}]");
            let key = raw.key.as_deref().unwrap_or_default();
            if key.is_empty() {
                self.error(&here, "descriptor has empty key".into());
                continue;
            }
            let kv = match raw.value.as_deref() {
                Some(v) => format!("{key}_{v}"),
                None => key.to_owned(),
            };
            let composite = format!("{parent}.{kv}");
            let path = if parent_path.is_empty() {
                kv.clone()
            } else {
                format!("{parent_path}.{kv}")
            };
            let node = self.node(raw, &here, &composite, &path, &kv);
            let branch: &mut KeyBranch = level.keys.entry(key.to_owned()).or_default();
            let duplicate = match raw.value.as_deref() {
                None => branch.any.replace(Box::new(node)).is_some(),
                Some(value) => match Pattern::new(value) {
                    Some(pattern) => {
                        let dup = branch.wildcards.iter().any(|(p, _)| *p == pattern);
                        branch.wildcards.push((pattern, node));
                        dup
                    }
                    None => branch.exact.insert(value.to_owned(), node).is_some(),
                },
            };
            if duplicate {
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
    ) -> Node {
        let is_pattern = raw.value.as_deref().is_some_and(|v| v.contains('*'));
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
        let rule = if limits.is_empty() {
            for (set, field) in [
                (raw.failure_mode.is_some(), "failure_mode"),
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
            Some(self.rule(raw, here, &limits, path))
        };
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

    fn rule(
        &mut self,
        raw: &RawDescriptor,
        here: &str,
        limits: &[(String, &RawLimit)],
        path: &str,
    ) -> Rule {
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
            if let Some(tier) = self.tier(at, limit, &names) {
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
        let failure_mode = match raw.failure_mode.as_deref().map(str::parse) {
            Some(Err(e)) => {
                self.error(&format!("{here}.failure_mode"), e);
                None
            }
            Some(Ok(mode)) => Some(mode),
            None => None,
        };
        if raw.hash_tag.as_deref() == Some("") {
            self.error(
                &format!("{here}.hash_tag"),
                "hash_tag must name an entry key".into(),
            );
        }
        Rule {
            path: path.to_owned(),
            failure_mode,
            hash_tag: raw.hash_tag.clone().filter(|t| !t.is_empty()),
            tiers: if unlimited { Vec::new() } else { tiers },
            unlimited,
            shadow_mode: raw.shadow_mode,
            detailed_metric: raw.detailed_metric,
            value_to_metric: raw.value_to_metric,
            quota_mode: raw.quota_mode,
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
            Some(name) => match Algorithm::parse(name) {
                Some(a) => a,
                None => {
                    let known: Vec<_> = Algorithm::ALL.iter().map(|a| a.name()).collect();
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
        if unit_multiplier == 0 {
            self.error(
                &format!("{at}.unit_multiplier"),
                "unit_multiplier must be at least 1".into(),
            );
            return None;
        }
        let requests_per_unit = raw.requests_per_unit.unwrap_or(0);
        let period_us = unit.seconds() * u64::from(unit_multiplier) * MICROS_PER_SECOND;
        match Limit::new(
            algorithm,
            u64::from(requests_per_unit),
            period_us,
            raw.burst.map(u64::from),
        ) {
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
}
