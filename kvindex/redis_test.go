package kvindex

import (
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/internal/testenv"
)

// redisClient returns a client of the test's Redis server.
func redisClient(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: testenv.Redis(t), PoolSize: 8})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func newRedisForTest(t *testing.T, cfg factoryConfig) Index {
	r, err := NewRedis(redisClient(t), RedisConfig{Prefix: testenv.UniqueName(t), Model: cfg.Model, BlockSize: cfg.BlockSize, Now: cfg.Now})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestRedisContract(t *testing.T) { testIndexContract(t, newRedisForTest) }
