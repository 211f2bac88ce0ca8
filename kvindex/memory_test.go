package kvindex

import (
	"testing"
)

func newMemoryForTest(t *testing.T, cfg factoryConfig) Index {
	m, err := NewMemory(MemoryConfig{Model: cfg.Model, BlockSize: cfg.BlockSize, Now: cfg.Now})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestMemoryContract(t *testing.T) { testIndexContract(t, newMemoryForTest) }
