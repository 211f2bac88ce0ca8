// Package deploy holds kvrouter's deployment artefacts (Kubernetes
// manifests, a compose file, a Grafana dashboard) and the test that checks
// them against the Kubernetes API types and the binaries' real flags,
// config validation and metric names. It is its own Go module so that the
// heavy Kubernetes dependencies stay out of the main module (docs/deploy.md).
package deploy
