// Package archtest holds the tests that keep the package map of
// docs/architecture.md true: which packages may depend on what, checked
// with `go list -deps` against the module as built. It has no code of its
// own.
package archtest
