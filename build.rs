//! Compiles the hand-written protos under `proto/` with protox (pure Rust), so building
//! sluice needs no system-wide protoc.

/// The files of the services sluice serves (RLS and RLQS), which gRPC reflection describes. The
/// xDS files (the rules client's) are compiled too, but sluice does not serve them.
const SERVED: [&str; 2] = [
    "envoy/service/ratelimit/v3/rls.proto",
    "envoy/service/rate_limit_quota/v3/rlqs.proto",
];
const XDS: [&str; 2] = [
    "envoy/service/discovery/v3/ads.proto",
    "ratelimit/config/ratelimit/v3/rls_conf.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(SERVED.iter().chain(&XDS), ["proto"])?;
    // For gRPC reflection: the served files and what they import, encoded, included by
    // src/proto.rs.
    let served = protox::compile(SERVED, ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("rls_descriptor.bin"),
        prost::Message::encode_to_vec(&served),
    )?;
    tonic_prost_build::configure()
        // prost with buffers sized for rate-limit messages (see src/proto.rs).
        .codec_path("crate::proto::codec::SmallBuffers")
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
