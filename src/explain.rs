//! `sluice explain`: what the rules do with a request, without serving it — for each
//! descriptor, the rule path that matched (or where matching stopped), the limits and their
//! algorithms, `replaces`, and the counter's storage keys.

use std::fmt::Write;

use crate::engine::{counter_prefix, hash_tag};
use crate::rules::{KeyPart, PlanSource, RuleSet, Via};
use crate::store::KeyBuf;
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
    let mut out = String::new();
    let Some(d) = rules.domain(domain) else {
        let _ = writeln!(
            out,
            "domain '{domain}' is not configured: every descriptor is answered OK, unlimited"
        );
        return out;
    };
    let found: Vec<_> = descriptors
        .iter()
        .map(|entries| {
            let mut key = KeyBuf::default();
            let mut steps = Vec::new();
            let rule = counter_prefix(d, domain, entries, &mut key, |k, part, via| {
                steps.push(match via {
                    Via::Exact => format!("{k}: exact value"),
                    Via::Wildcard(p) => match part {
                        KeyPart::Pattern(_) => format!("{k}: wildcard '{p}' (one shared counter)"),
                        KeyPart::Value(_) => format!("{k}: wildcard '{p}'"),
                    },
                    Via::KeyOnly => format!("{k}: any value"),
                });
            });
            (rule, steps, key)
        })
        .collect();
    let replaced: Vec<&str> = found
        .iter()
        .filter_map(|(r, _, _)| *r)
        .flat_map(|r| {
            r.tiers
                .iter()
                .flat_map(|t| t.replaces.iter().map(String::as_str))
        })
        .collect();

    for (i, (entries, (rule, steps, key))) in descriptors.iter().zip(&found).enumerate() {
        let shown: Vec<String> = entries.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(out, "descriptor {i}: {}", shown.join(", "));
        for step in steps {
            let _ = writeln!(out, "  matched {step}");
        }
        let Some(rule) = rule else {
            let why = if steps.len() < entries.len() {
                let (k, v) = &entries[steps.len()];
                format!(
                    "no rule for {k}={v} at level {} (no exact value, wildcard or key-only rule)",
                    steps.len() + 1
                )
            } else {
                "the matched node has no limit (a whitelisted value, or a branch)".to_owned()
            };
            let _ = writeln!(out, "  no limit: {why}; answered OK");
            continue;
        };
        let _ = writeln!(out, "  rule: {domain}.{} (file {})", rule.path, d.file);
        let mut tiers = rule.tiers.as_slice();
        if let Some(plan) = &rule.plan {
            let pairs = entries.iter().map(|(k, v)| (k.as_str(), v.as_str()));
            let (source, key) = match &plan.source {
                PlanSource::Client(k) => ("the client map, by", k),
                PlanSource::Entry(k) => ("the plan named in", k),
            };
            match d.plan_for(plan, pairs) {
                Some((p, _)) if p.unlimited => {
                    let _ = writeln!(
                        out,
                        "  plan: {} (from {source} entry '{key}'): unlimited; answered OK",
                        p.name
                    );
                    continue;
                }
                Some((p, plan_tiers)) => {
                    let _ = writeln!(
                        out,
                        "  plan: {} (from {source} entry '{key}'), limits '{}'",
                        p.name, plan.group
                    );
                    tiers = plan_tiers;
                }
                None => {
                    let _ = writeln!(out, "  plan: none; answered OK");
                    continue;
                }
            }
        }
        if rule.unlimited {
            let _ = writeln!(
                out,
                "  unlimited: answered OK with limit_remaining 4294967295"
            );
            continue;
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
        // The slot tag: the descriptor, or the rule's hash_tag entry (as the engine picks it).
        let mut tag = KeyBuf::default();
        if hash_tag(Some(rule), domain, entries, &mut tag).is_none() {
            tag = key.clone();
        }
        for t in tiers {
            let name = t
                .name
                .as_deref()
                .map(|n| format!(" '{n}'"))
                .unwrap_or_default();
            let window = if t.unit_multiplier == 1 {
                t.unit.to_string()
            } else {
                format!("{} {}", t.unit_multiplier, t.unit)
            };
            let burst = if t.limit.algorithm.has_burst() {
                format!(", burst {}", t.limit.burst)
            } else {
                String::new()
            };
            let status = match &t.name {
                Some(n) if replaced.contains(&n.as_ref()) => {
                    " — replaced by another descriptor's limit: not applied"
                }
                _ => "",
            };
            let _ = writeln!(
                out,
                "  limit{name}: {} per {window}, {}{burst}{status}",
                t.requests_per_unit, t.limit.algorithm
            );
            let mut counter = key.clone();
            counter.limit(t.limit.algorithm, t.unit, t.unit_multiplier);
            let bytes = counter.slice(0..counter.len());
            let (redis, slot) = redis_key(redis_prefix.as_bytes(), tag.slice(0..tag.len()), bytes);
            let _ = writeln!(out, "    counter: {}", String::from_utf8_lossy(bytes));
            let _ = writeln!(
                out,
                "    redis key: {} (slot {slot})",
                String::from_utf8_lossy(&redis)
            );
        }
    }
    out
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
