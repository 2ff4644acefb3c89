//! Compiles the hand-written Envoy protos under `proto/` with protox (pure Rust), so building
//! sluice needs no system-wide protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["envoy/service/ratelimit/v3/rls.proto"];
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(files, ["proto"])?;
    // For gRPC reflection: the same descriptors, encoded, included by src/proto.rs.
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("rls_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
