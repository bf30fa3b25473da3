# Multi-stage build of the bellhop binary: a static executable in a
# distroless image, running as a non-root user.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# .dockerignore keeps .git out, so go build records no commit: pass it in
# (docker build --build-arg BELLHOP_COMMIT=$(git rev-parse HEAD), or
# BELLHOP_COMMIT in the environment of docker compose) for `bellhop
# version` to name it.
ARG BELLHOP_COMMIT=
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.buildCommit=${BELLHOP_COMMIT}" -o /out/bellhop ./cmd/bellhop
# An empty /secrets owned by the runtime user: a named volume mounted there
# (docker-compose.yml) takes the owner of the image's directory.
RUN mkdir -p /out/secrets

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/bellhop /usr/local/bin/bellhop
COPY --from=build --chown=65532:65532 /out/secrets /secrets
USER nonroot:nonroot
EXPOSE 9090
ENTRYPOINT ["/usr/local/bin/bellhop"]
CMD ["run"]
