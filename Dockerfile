# Multi-stage build: compile in the Rust image, run on a slim Debian with a non-root user.
#   docker build -t sluice .
#   docker run -p 8081:8081 -p 8080:8080 sluice
FROM rust:1.95-bookworm AS build
WORKDIR /src
# The shipped binary carries no debug info (the repository's release profile keeps some for
# profiling): Cargo's own profile overrides, no extra tool.
ENV CARGO_PROFILE_RELEASE_DEBUG=0 \
    CARGO_PROFILE_RELEASE_STRIP=symbols
# Dependencies in their own layer: built against empty targets from the manifest alone, so an
# edit under src/ rebuilds sluice, not its ~300 crates. (The stubs stand in for every target
# Cargo.toml names; the protos compile here too, they change rarely.)
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
RUN mkdir -p src benches \
    && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && for bench in decision grpc load; do echo 'fn main() {}' > benches/$bench.rs; done \
    && cargo build --release --locked --bin sluice \
    && rm -rf src benches target/release/sluice* target/release/deps/sluice-* \
        target/release/deps/libsluice-* target/release/.fingerprint/sluice-*
COPY src src
COPY benches benches
RUN cargo build --release --locked --bin sluice

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --no-create-home sluice
COPY --from=build /src/target/release/sluice /usr/local/bin/sluice
# Where the reference service's image has its binary: invoked as `ratelimit`, sluice serves and
# reads the reference's environment variables (docs/migrating.md), so
# a deployment of the reference (Envoy Gateway's too) can switch by changing the image.
RUN ln -s /usr/local/bin/sluice /bin/ratelimit
COPY config /etc/sluice/rules
USER 10001:10001
ENV SLUICE_CONFIG=/etc/sluice/rules \
    SLUICE_LOG_FORMAT=json
EXPOSE 8081 8080
HEALTHCHECK --interval=10s --timeout=2s --retries=3 CMD ["sluice", "probe"]
ENTRYPOINT ["sluice"]
CMD ["serve"]
