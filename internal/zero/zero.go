// Package zero fills a configuration field left at its zero value with its
// default: the one step every component's WithDefaults repeats per field.
// Standard library free, so leaf packages (config, sim, workload) may use it.
package zero

// Default sets *p to v when *p is the zero value of T.
func Default[T comparable](p *T, v T) {
	var zero T
	if *p == zero {
		*p = v
	}
}
