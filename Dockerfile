# Multi-stage build: compile in the Rust image, run on a slim Debian with a non-root user.
#   docker build -t sluice .
#   docker run -p 8081:8081 -p 8080:8080 sluice
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
COPY benches benches
# The shipped binary carries no debug info (the repository's release profile keeps some for
# profiling): Cargo's own profile overrides, no extra tool.
ENV CARGO_PROFILE_RELEASE_DEBUG=0 \
    CARGO_PROFILE_RELEASE_STRIP=symbols
RUN cargo build --release --locked --bin sluice

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --no-create-home sluice
COPY --from=build /src/target/release/sluice /usr/local/bin/sluice
# Where the reference service's image has its binary: invoked as `ratelimit`, sluice serves and
# reads the reference's environment variables (README, "Moving from envoyproxy/ratelimit"), so
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
