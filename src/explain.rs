//! `sluice explain`: what the rules do with a request, without serving it — for each
//! descriptor, the rule path that matched (or where matching stopped), the limits and their
//! algorithms, `replaces`, and the counter's storage keys. The engine's own stages
//! ([`engine::explain`]) produce all of it; this module only writes it down. For an RLQS bucket
//! id (a map, no order) it first shows the order the rules give its entries, and what the
//! bucket is assigned ([`crate::rlqs::resolve`], as the service resolves it).

use std::fmt::Write;

use crate::engine::{
    self, Descriptor, Enforcement, ExplainedDescriptor, Limits, MatchedBy, Request,
};
use crate::rules::{PlanSource, RuleSet};
use crate::store::redis::redis_key;

/// One descriptor's entries, as given on the command line: `k=v,k2=v2`.
pub fn parse_descriptor(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
            _ => Err(format!("'{pair}' is not key=value")),
        })
        .collect()
}

pub fn explain(
    rules: &RuleSet,
    domain: &str,
    descriptors: &[Vec<(String, String)>],
    redis_prefix: &str,
) -> String {
    let request = Request {
        domain: domain.to_owned(),
        descriptors: descriptors
            .iter()
            .map(|entries| Descriptor {
                entries: entries.clone(),
                ..Descriptor::of(&[], 1)
            })
            .collect(),
    };
    let mut out = String::new();
    let explanation = match engine::explain(rules, &request) {
        Ok(e) => e,
        Err(e) => {
            let _ = writeln!(out, "the request is refused: {e}");
            return out;
        }
    };
    let Some(d) = explanation.domain else {
        let _ = writeln!(
            out,
            "domain '{domain}' is not configured: every descriptor is answered OK, unlimited"
        );
        return out;
    };
    for (i, (entries, x)) in descriptors.iter().zip(&explanation.descriptors).enumerate() {
        let shown: Vec<String> = entries.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(out, "descriptor {i}: {}", shown.join(", "));
        describe(&mut out, domain, &d.file, entries, x, redis_prefix);
    }
    out
}

/// What `rules` do with RLQS buckets of `domain`, each a map of entries: the order the rules
/// give them, then the same story as a descriptor, and the assignment a bucket gets.
pub fn explain_buckets(
    rules: &RuleSet,
    domain: &str,
    buckets: &[Vec<(String, String)>],
    redis_prefix: &str,
) -> String {
    let mut out = String::new();
    for (i, entries) in buckets.iter().enumerate() {
        let shown: Vec<String> = entries.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(out, "bucket {i}: {{{}}}", shown.join(", "));
        let pairs: Vec<(&str, &str)> = entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let resolved =
            match crate::rlqs::resolve(rules, &engine::EngineSettings::default(), domain, &pairs) {
                Ok(r) => r,
                Err(e) => {
                    let _ = writeln!(out, "  the bucket is refused: {e}");
                    continue;
                }
            };
        let Some(ordered) = resolved.entries() else {
            let _ = writeln!(
                out,
                "  no rule of domain '{domain}' matches these entries in any order\n  assignment: ALLOW_ALL (renewed with each report)"
            );
            continue;
        };
        let shown: Vec<String> = ordered.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(
            out,
            "  as a descriptor, in the rules' order: {}",
            shown.join(", ")
        );
        for line in explain(rules, domain, std::slice::from_ref(ordered), redis_prefix)
            .lines()
            .skip(1)
        {
            let _ = writeln!(out, "  {line}");
        }
        let assignment = match resolved.enforcement() {
            Enforcement::Unlimited => "ALLOW_ALL (renewed with each report)".to_owned(),
            Enforcement::Shadow => {
                "ALLOW_ALL; what the Envoy reports it admitted is counted (shadow mode)".to_owned()
            }
            Enforcement::Limited => match crate::rlqs::refill_of(resolved.limits()) {
                Some(refill) => format!(
                    "one refilling token bucket per Envoy, at most its share of the {} a {}-second \
                     window, charged to the limits above window by window (a window shorter than \
                     Envoy's 5-second reports)",
                    refill.limit, refill.window_s
                ),
                None => {
                    let windowed = resolved.limits().iter().all(|l| l.algorithm.windowed());
                    format!(
                        "token buckets drawn from the limits above, {}",
                        if windowed {
                            "each lasting to the end of the first window to end"
                        } else {
                            "each lasting to the end of the current second (an algorithm here is not a window)"
                        }
                    )
                }
            },
        };
        let _ = writeln!(out, "  assignment: {assignment}");
    }
    out
}

fn describe(
    out: &mut String,
    domain: &str,
    file: &str,
    entries: &[(String, String)],
    x: &ExplainedDescriptor<'_>,
    redis_prefix: &str,
) {
    for (k, by) in &x.levels {
        let step = match by {
            MatchedBy::Exact => format!("{k}: exact value"),
            MatchedBy::Wildcard {
                pattern,
                shared: true,
            } => {
                format!("{k}: wildcard '{pattern}' (one shared counter)")
            }
            MatchedBy::Wildcard { pattern, .. } => format!("{k}: wildcard '{pattern}'"),
            MatchedBy::AnyValue => format!("{k}: any value"),
        };
        let _ = writeln!(out, "  matched {step}");
    }
    let Some(rule) = x.rule else {
        let why = if x.levels.len() < entries.len() {
            let (k, v) = &entries[x.levels.len()];
            format!(
                "no rule for {k}={v} at level {} (no exact value, wildcard or key-only rule)",
                x.levels.len() + 1
            )
        } else {
            "the matched node has no limit (a whitelisted value, or a branch)".to_owned()
        };
        let _ = writeln!(out, "  no limit: {why}; answered OK");
        return;
    };
    let _ = writeln!(out, "  rule: {domain}.{} (file {file})", rule.path);
    if let Some(plan_ref) = &rule.plan {
        let (source, key) = match &plan_ref.source {
            PlanSource::Client(k) => ("the client map, by", k),
            PlanSource::Entry(k) => ("the plan named in", k),
        };
        match x.plan {
            Some(p) if p.unlimited => {
                let _ = writeln!(
                    out,
                    "  plan: {} (from {source} entry '{key}'): unlimited; answered OK",
                    p.name
                );
                return;
            }
            Some(p) => {
                let _ = writeln!(
                    out,
                    "  plan: {} (from {source} entry '{key}'), limits '{}'",
                    p.name, plan_ref.group
                );
            }
            None => {
                let _ = writeln!(out, "  plan: none; answered OK");
                return;
            }
        }
    }
    if matches!(x.limits, Limits::Unlimited) {
        let _ = writeln!(
            out,
            "  unlimited: answered OK with limit_remaining 4294967295"
        );
        return;
    }
    let mut flags = vec![format!("shadow_mode: {}", rule.shadow_mode)];
    if let Some(mode) = rule.failure_mode {
        flags.push(format!("failure_mode: {mode}"));
    }
    if let Some(mode) = rule.mode {
        flags.push(format!("mode: {mode}"));
    }
    if let Some(tag) = &rule.hash_tag {
        flags.push(format!("hash_tag: {tag}"));
    }
    let _ = writeln!(out, "  {}", flags.join(", "));
    for c in &x.checks {
        let t = &c.tier;
        let name = t
            .name
            .as_deref()
            .map(|n| format!(" '{n}'"))
            .unwrap_or_default();
        let window = match (t.limit.calendar, t.unit_multiplier) {
            (Some(c), _) => format!("calendar {} in {}", t.unit, c.zone_name()),
            (None, 1) => t.unit.to_string(),
            (None, m) => format!("{m} {}", t.unit),
        };
        let burst = if t.limit.algorithm.has_burst() {
            format!(", burst {}", t.limit.burst)
        } else {
            String::new()
        };
        let status = if c.replaced {
            " — replaced by another descriptor's limit: not applied"
        } else {
            ""
        };
        if t.limit.algorithm.holds_slots() {
            let _ = writeln!(
                out,
                "  limit: {} in flight (concurrency), a slot held at most {:?}{status}",
                t.requests_per_unit,
                std::time::Duration::from_micros(t.limit.period_us)
            );
            if let Some(key) = &rule.slot_key {
                let _ = writeln!(
                    out,
                    "    held by: each request, named by its {key} entry (acquired with hits, released with is_negative_hits)"
                );
            }
        } else {
            let _ = writeln!(
                out,
                "  limit{name}: {} per {window}, {}{burst}{status}",
                t.requests_per_unit, t.limit.algorithm
            );
        }
        let (redis, slot) = redis_key(redis_prefix.as_bytes(), &c.tag, &c.key, t.limit.algorithm);
        let _ = writeln!(out, "    counter: {}", String::from_utf8_lossy(&c.key));
        let _ = writeln!(
            out,
            "    redis key: {} (slot {slot})",
            String::from_utf8_lossy(&redis)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::load_texts;

    #[test]
    fn explains_matches_misses_and_keys() {
        let rules = load_texts([(
            "edge.yaml",
            "domain: edge\ndescriptors:\n  - key: ip\n    rate_limit: {unit: second, requests_per_unit: 5, name: per_ip}\n  - key: path\n    value: /v1/*\n    rate_limit: {unit: minute, requests_per_unit: 9, algorithm: gcra, burst: 3, replaces: [{name: per_ip}]}\n",
        )])
        .unwrap();
        let text = explain(
            &rules,
            "edge",
            &[
                parse_descriptor("ip=10.0.0.1").unwrap(),
                parse_descriptor("path=/v1/x").unwrap(),
                parse_descriptor("user=u").unwrap(),
            ],
            "sluice:",
        );
        assert!(text.contains("descriptor 0: ip=10.0.0.1\n  matched ip: any value\n  rule: edge.ip (file edge.yaml)"), "{text}");
        assert!(text.contains("limit 'per_ip': 5 per SECOND, fixed_window — replaced by another descriptor's limit"), "{text}");
        assert!(
            text.contains("    counter: 4:edgev2:ip8:10.0.0.1#11*1\n    redis key: sluice:{"),
            "{text}"
        );
        assert!(text.contains("matched path: wildcard '/v1/*'"), "{text}");
        assert!(
            text.contains("limit: 9 per MINUTE, gcra, burst 3"),
            "{text}"
        );
        assert!(
            text.contains("descriptor 2: user=u\n  no limit: no rule for user=u at level 1"),
            "{text}"
        );
        assert!(
            explain(&rules, "other", &[], "s:").starts_with("domain 'other' is not configured")
        );
        assert!(parse_descriptor("novalue").is_err());
    }

    #[test]
    fn a_buckets_assignment_says_how_it_is_granted() {
        let rules = load_texts([(
            "q.yaml",
            "domain: q\ndescriptors:\n  - key: fast\n    rate_limit: {unit: second, requests_per_unit: 20}\n  - key: slow\n    rate_limit: {unit: minute, requests_per_unit: 600}\n",
        )])
        .unwrap();
        let assignment = |entry: &str| {
            let parsed = vec![parse_descriptor(entry).unwrap()];
            let text = explain_buckets(&rules, "q", &parsed, "s:");
            text.lines()
                .find_map(|l| l.strip_prefix("  assignment: "))
                .unwrap_or_else(|| panic!("no assignment: {text}"))
                .to_owned()
        };
        assert!(
            assignment("fast=a").starts_with(
                "one refilling token bucket per Envoy, at most its share of the 20 a 1-second window"
            ),
            "{}",
            assignment("fast=a")
        );
        assert!(
            assignment("slow=a").starts_with("token buckets drawn from the limits above, each lasting to the end of the first window to end"),
            "{}",
            assignment("slow=a")
        );
    }

    #[test]
    fn explains_a_calendar_window_and_its_key() {
        let rules = load_texts([(
            "plans.yaml",
            "domain: api
descriptors:
  - key: user
    rate_limit: {unit: month, requests_per_unit: 1000, calendar: Europe/Berlin}
",
        )])
        .unwrap();
        let text = explain(&rules, "api", &[parse_descriptor("user=u1").unwrap()], "s:");
        assert!(
            text.contains(
                "limit: 1000 per calendar MONTH in Europe/Berlin, fixed_window
    counter: 3:apiv4:user2:u1#16*1@13:Europe/Berlin
"
            ),
            "{text}"
        );
    }

    #[test]
    fn hash_tag_puts_a_tenants_descriptors_in_one_slot() {
        let rules = load_texts([(
            "t.yaml",
            "domain: t\ndescriptors:\n  - key: tenant\n    hash_tag: tenant\n    rate_limit: {unit: second, requests_per_unit: 5}\n    descriptors:\n      - key: path\n        hash_tag: tenant\n        rate_limit: {unit: second, requests_per_unit: 1}\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 5}\n    descriptors:\n      - key: path\n        rate_limit: {unit: second, requests_per_unit: 1}\n",
        )])
        .unwrap();
        let slots = |a: &str, b: &str| -> Vec<String> {
            let text = explain(
                &rules,
                "t",
                &[parse_descriptor(a).unwrap(), parse_descriptor(b).unwrap()],
                "s:",
            );
            text.lines()
                .filter_map(|l| l.split_once("(slot ").map(|(_, s)| s.to_owned()))
                .collect()
        };
        let tagged = slots("tenant=acme", "tenant=acme,path=/a");
        assert_eq!(tagged.len(), 2);
        assert_eq!(tagged[0], tagged[1], "one slot: both decided by one script");
        // Without hash_tag each descriptor has its own tag (these two differ).
        let untagged = slots("user=acme", "user=acme,path=/a");
        assert_ne!(untagged[0], untagged[1]);
    }
}
