//go:build race

package kvaware

// raceOn: the race detector slows code several times over; timing bounds
// widen by raceSlowdown.
const raceOn = true
