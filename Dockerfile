# Multi-stage build of the bellhop binary: a static executable in a
# distroless image, running as a non-root user.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/bellhop ./cmd/bellhop

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/bellhop /usr/local/bin/bellhop
USER nonroot:nonroot
EXPOSE 9090
ENTRYPOINT ["/usr/local/bin/bellhop"]
CMD ["run"]
