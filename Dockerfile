# Images for docker-compose.yml: `idemd` (the sidecar), `demo` (the stand-in service),
# and the filter's .wasm for Envoy; and `envoy-native`, Envoy with the native module for Envoy Gateway
# (deploy/envoy-gateway/native). Build context: the repository root.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN rustup target add wasm32-wasip1 \
 && cargo build --release -p idemd -p idem-demo -p agent-idempotency-native \
 && cargo build --profile wasm --target wasm32-wasip1 -p agent-idempotency-filter

# idemd: the binary alone (the Lua scripts and SQL migrations are compiled in) on distroless glibc, as a
# numeric non-root user; needs IDEM_AUTH_TOKENS (the bearer tokens it accepts) and IDEM_DATABASE_URL.
FROM gcr.io/distroless/cc-debian12:nonroot AS idemd
COPY --from=build /src/target/release/idemd /usr/local/bin/idemd
USER 65532:65532
EXPOSE 9090
ENTRYPOINT ["/usr/local/bin/idemd", "serve", "--listen", "0.0.0.0:9090"]

FROM debian:bookworm-slim AS demo
COPY --from=build /src/target/release/demo /usr/local/bin/demo
ENTRYPOINT ["demo", "--listen", "0.0.0.0:8080", "--db", "sqlite:///data/demo.db"]

FROM envoyproxy/envoy:v1.40.0 AS envoy
COPY --from=build /src/target/wasm32-wasip1/wasm/agent_idempotency_filter.wasm /etc/envoy/agent_idempotency_filter.wasm
COPY envoy/compose.yaml /etc/envoy/envoy.yaml

# The native module is built for one Envoy minor's ABI: it ships inside that Envoy, where the EnvoyProxy's
# dynamicModules entry loads it (deploy/envoy-gateway/native/native.yaml). Rebuild both together on an upgrade.
FROM envoyproxy/envoy:v1.40.0 AS envoy-native
COPY --from=build /src/target/release/libagent_idempotency_native.so /usr/lib/envoy/modules/libagent_idempotency_native.so
