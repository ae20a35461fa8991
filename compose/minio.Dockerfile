# MinIO's community edition ships as source only: this builds the version the embedded stack
# and every test run on (hardelete/install.py: MINIO_VERSION), as `./dev` does on first use.
FROM golang:1.26 AS build
ARG MINIO_VERSION=v0.0.0-20260212201848-7aac2a2c5b7c
RUN CGO_ENABLED=0 go install github.com/minio/minio@${MINIO_VERSION}

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /go/bin/minio /usr/local/bin/minio
ENTRYPOINT ["minio"]
