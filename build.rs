//! Compiles the hand-written Envoy protos under `proto/` with protox (pure Rust), so building
//! sluice needs no system-wide protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["envoy/service/ratelimit/v3/rls.proto"];
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
