//go:build tools

// Package deps pins the project's chosen libraries in go.mod while the
// packages that use them are being written, so that parallel work does not
// race on go.mod. It is never built.
package deps

import (
	_ "github.com/cespare/xxhash/v2"
	_ "github.com/go-zeromq/zmq4"
	_ "github.com/nats-io/nats-server/v2/server"
	_ "github.com/nats-io/nats.go"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/redis/go-redis/v9"
	_ "github.com/tinylib/msgp/msgp"
	_ "google.golang.org/grpc"
	_ "gopkg.in/yaml.v3"
)
