package httpapi

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router"
)

// healthLoop probes every instance of p each interval until ctx ends:
// unhealthy_threshold consecutive failures eject an instance,
// healthy_threshold consecutive successes re-admit it.
func (s *Server) healthLoop(ctx context.Context, p *router.Pool) {
	hc := p.Config().Health
	instances := p.Instances() // fixed for the pool's life
	t := time.NewTicker(hc.Interval)
	defer t.Stop()
	for {
		var wg sync.WaitGroup
		for _, in := range instances {
			wg.Go(func() {
				err := s.probeHealth(ctx, in, hc)
				if ctx.Err() != nil {
					return // shutting down: not the instance's fault
				}
				result := "ok"
				if err != nil {
					result = "fail"
				}
				s.m.probes.WithLabelValues(p.Name(), in.ID(), result).Inc()
				if in.ObserveProbe(err == nil, hc.UnhealthyThreshold, hc.HealthyThreshold) {
					if err != nil {
						s.m.ejections.WithLabelValues(p.Name(), in.ID(), "health_checks").Inc()
						s.log.Warn("instance ejected by health checks", "pool", p.Name(), "instance", in.ID(), "err", err)
					} else {
						s.log.Info("instance re-admitted by health checks", "pool", p.Name(), "instance", in.ID())
						p.PokeQueue() // its room is the queue's again
					}
				}
			})
		}
		wg.Wait()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// EngineDown ejects an instance whose kvbridge reports its engine down
// (kvstate.Pipeline.OnEngineDown): the bridge saw the engine's /health fail
// twice, a probe interval apart, with no KV event between, and says so in
// its next heartbeat, within a few seconds; the router's own checks take
// unhealthy_threshold × interval (15 s by default) to eject it, and every
// request sent there meanwhile fails or waits for a retry. The router's
// probes re-admit it (healthy_threshold successes in a row), so a bridge
// that is wrong about its engine costs that instance at most that long.
// With health checks disabled nothing would re-admit it: it is left in.
func (s *Server) EngineDown(pool, instance string) {
	p, ok := s.Pool(pool)
	if !ok || p.Config().Health.Disable {
		return
	}
	in, ok := p.Instance(instance)
	if !ok || !in.Eject() {
		return
	}
	s.m.ejections.WithLabelValues(pool, instance, "engine_down").Inc()
	s.log.Warn("instance ejected: its kvbridge reports the engine down; health checks re-admit it", "pool", pool, "instance", instance)
}

func (s *Server) probeHealth(ctx context.Context, in *router.Instance, hc config.HealthConfig) error {
	ctx, cancel := context.WithTimeout(ctx, hc.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(in.URL().String(), "/")+hc.Path, nil)
	if err != nil {
		return err
	}
	resp, err := s.probe.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("health probe answered %d", resp.StatusCode)
	}
	return nil
}

// discoveryLoop refreshes each instance's LoRA adapters from its
// /v1/models until ctx ends. A failed poll keeps what was known: an
// instance that is briefly unreachable has not unloaded its adapters.
func (s *Server) discoveryLoop(ctx context.Context, p *router.Pool) {
	pc := p.Config()
	instances := p.Instances() // fixed for the pool's life
	t := time.NewTicker(pc.Discovery.Interval)
	defer t.Stop()
	for {
		var wg sync.WaitGroup
		for _, in := range instances {
			wg.Go(func() {
				names, err := s.fetchAdapters(ctx, in, p.Model(), pc.Health.Timeout)
				if err != nil {
					if ctx.Err() == nil {
						s.log.Debug("adapter discovery failed", "pool", p.Name(), "instance", in.ID(), "err", err)
					}
					return
				}
				if in.SetDiscoveredAdapters(names) {
					p.PokeQueue() // queued requests for the new adapter may fit there
				}
			})
		}
		wg.Wait()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// fetchAdapters lists the models an instance serves other than the base
// model: vLLM lists LoRA adapters in /v1/models with "parent" = the base.
func (s *Server) fetchAdapters(ctx context.Context, in *router.Instance, base string, timeout time.Duration) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(in.URL().String(), "/")+"/v1/models", nil)
	if err != nil {
		return nil, err
	}
	resp, err := s.probe.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/v1/models answered %d", resp.StatusCode)
	}
	return parseModelList(io.LimitReader(resp.Body, 4<<20), base)
}

// parseModelList extracts adapter names from an OpenAI model list.
func parseModelList(r io.Reader, base string) ([]string, error) {
	var list struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	if err := json.NewDecoder(r).Decode(&list); err != nil {
		return nil, fmt.Errorf("decode /v1/models: %w", err)
	}
	var out []string
	for _, m := range list.Data {
		if m.ID != "" && m.ID != base {
			out = append(out, m.ID)
		}
	}
	return out, nil
}
