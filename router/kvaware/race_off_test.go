//go:build !race

package kvaware

const raceOn = false
