// Package config is kvrouter's configuration: the YAML types of the whole
// binary, their documented defaults (WithDefaults), Load/Parse with
// explained YAML errors, and Validate. It is a leaf: it imports no other
// kvrouter package, so every component reads the same typed, validated
// values and no component owns the file format.
package config
