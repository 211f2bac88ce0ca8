// Package version reports which build of kvrouter a binary is: the release
// (or `git describe`) and the commit. `make build` and `make image` set both
// with -ldflags -X (see the Makefile's LDFLAGS); a plain `go build` or
// `go install` falls back to what the Go toolchain recorded in the binary
// (the module version and the vcs.revision build setting), and to "dev" and
// "unknown" when it recorded nothing (-buildvcs=false, a source tarball).
package version

import (
	"fmt"
	"runtime/debug"
	"slices"
)

// Set by the linker: go build -ldflags "-X <this package>.version=v0.1.0
// -X <this package>.commit=<sha>". Empty means "not injected".
var (
	version string
	commit  string
)

// Info is one binary's build identity.
type Info struct {
	Version   string // release or `git describe`; "dev" when unknown
	Commit    string // full or short commit id; "unknown" when not recorded
	GoVersion string // toolchain that built the binary
}

// Get returns the running binary's build identity.
func Get() Info {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		bi = nil
	}
	return resolve(bi, version, commit)
}

// resolve prefers the linker-injected values, then the build info the Go
// toolchain records, then placeholders that say nothing was recorded.
func resolve(bi *debug.BuildInfo, ldVersion, ldCommit string) Info {
	in := Info{Version: ldVersion, Commit: ldCommit}
	if bi != nil {
		in.GoVersion = bi.GoVersion
		// "(devel)" is what the toolchain records for a build inside the
		// module's own tree: not a version.
		if in.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			in.Version = bi.Main.Version
		}
		if in.Commit == "" {
			var rev string
			dirty := false
			for _, s := range bi.Settings {
				switch s.Key {
				case "vcs.revision":
					rev = s.Value
				case "vcs.modified":
					dirty = s.Value == "true"
				}
			}
			if rev != "" && dirty {
				rev += "-dirty"
			}
			in.Commit = rev
		}
	}
	if in.Version == "" {
		in.Version = "dev"
	}
	if in.Commit == "" {
		in.Commit = "unknown"
	}
	return in
}

// String is the line --version prints for binary name.
func (in Info) String(name string) string {
	s := fmt.Sprintf("%s %s (commit %s", name, in.Version, in.Commit)
	if in.GoVersion != "" {
		s += ", " + in.GoVersion
	}
	return s + ")"
}

// Requested reports whether a command line asks for the version: its first
// argument is --version or -version (the form Go's flag package accepts).
// Only the first, so that a subcommand's own arguments are never taken for it.
func Requested(args []string) bool {
	return len(args) > 0 && slices.Contains([]string{"--version", "-version"}, args[0])
}
