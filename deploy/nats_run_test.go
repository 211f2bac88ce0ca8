package deploy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/events/kvstream"
)

// TestProductionNATSClusterForms starts the production NATS StatefulSet's
// three servers in-process from the rendered nats.conf (each with its own
// SERVER_NAME, as the downward API gives it; routes and ports mapped to
// loopback) and checks what the manifests promise: the cluster forms, the
// replicated stream and bucket the init Job creates can be created with as
// many replicas as servers, a message published through one server is read
// through another, and with one server stopped (what the PDB allows) the
// stream still takes writes.
func TestProductionNATSClusterForms(t *testing.T) {
	if testing.Short() {
		t.Log("-short: the NATS cluster is not started")
		return
	}
	b := render(t, "kubernetes/overlays/production")
	sts := b.statefulSets["nats"]
	spec := &sts.Spec.Template.Spec
	c := &spec.Containers[0]
	text, ok := mountedFile(t, b, spec, c, mustArg(t, c.Args, "config"))
	if !ok {
		t.Fatal("no nats.conf")
	}
	conf := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	m := &portMap{t: t, ports: map[string]int{}, canon: kubeHosts}
	n := int(derefReplicas(sts.Spec.Replicas))
	servers := make([]*natsserver.Server, n)
	for i := range n {
		name := sts.Name + "-" + strconv.Itoa(i)
		t.Setenv("SERVER_NAME", name)
		o, err := natsserver.ProcessConfigFile(conf)
		if err != nil {
			t.Fatal(err)
		}
		o.Host, o.Port, o.HTTPPort, o.PidFile = "127.0.0.1", m.local(name, "4222"), -1, ""
		o.Cluster.Host, o.Cluster.Port = "127.0.0.1", m.local(name, strconv.Itoa(o.Cluster.Port))
		o.StoreDir, o.NoSigs, o.NoLog = t.TempDir(), true, true
		var routes []*url.URL
		for _, r := range o.Routes {
			host, port, err := net.SplitHostPort(r.Host)
			if err != nil {
				t.Fatal(err)
			}
			routes = append(routes, &url.URL{Scheme: r.Scheme, Host: "127.0.0.1:" + strconv.Itoa(m.local(kubeHosts(host, ""), port))})
		}
		o.Routes = routes
		s, err := natsserver.NewServer(o)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		servers[i] = s
		go s.Start()
		t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	}
	for i, s := range servers {
		if !s.ReadyForConnections(20 * time.Second) {
			t.Fatalf("nats-%d not ready", i)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// Replicas as the init Job creates them.
	job := b.jobs["nats-streams-init"]
	script := job.Spec.Template.Spec.Containers[0].Args[0]
	rm := regexp.MustCompile(`--replicas=(\d+)`).FindAllStringSubmatch(script, -1)
	if len(rm) != 2 {
		t.Fatalf("init Job: want --replicas on the stream and the bucket: %q", script)
	}
	replicas, _ := strconv.Atoi(rm[0][1])

	js0, js1, js2 := jetStream(t, servers[0].ClientURL()), jetStream(t, servers[1].ClientURL()), jetStream(t, servers[2].ClientURL())
	var st jetstream.Stream
	waitFor(t, 20*time.Second, "cluster routes", func() error {
		for i, s := range servers {
			if s.NumRoutes() < n-1 {
				return fmt.Errorf("nats-%d has %d routes", i, s.NumRoutes())
			}
		}
		return nil
	})
	waitFor(t, 60*time.Second, "replicated stream (cluster formed, meta leader elected)", func() error {
		var err error
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		st, err = js0.CreateOrUpdateStream(cctx, jetstream.StreamConfig{
			Name: kvstream.DefaultStreamName, Subjects: []string{kvstream.SubjectEvents + ".>"},
			Replicas: replicas, MaxAge: time.Hour, MaxBytes: 1 << 30, Duplicates: 2 * time.Minute,
			Storage: jetstream.FileStorage, Discard: jetstream.DiscardOld,
		})
		return err
	})
	waitFor(t, 60*time.Second, "replicated snapshot bucket", func() error {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		_, err := js0.CreateOrUpdateKeyValue(cctx, jetstream.KeyValueConfig{
			Bucket: kvstream.DefaultBucketName, History: 1, TTL: 24 * time.Hour, Replicas: replicas, Storage: jetstream.FileStorage,
		})
		return err
	})
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Config.Replicas != n || info.Cluster == nil || info.Cluster.Name == "" {
		t.Fatalf("stream replicas %d cluster %+v, want %d on the cluster", info.Config.Replicas, info.Cluster, n)
	}

	subject := kvstream.SubjectEvents + ".llama.vllm-0"
	waitFor(t, 30*time.Second, "publish through nats-1", func() error {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		_, err := js1.Publish(cctx, subject, []byte("batch-1"))
		return err
	})
	waitFor(t, 30*time.Second, "read through nats-2", func() error {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		s2, err := js2.Stream(cctx, kvstream.DefaultStreamName)
		if err != nil {
			return err
		}
		msg, err := s2.GetLastMsgForSubject(cctx, subject)
		if err != nil {
			return err
		}
		if string(msg.Data) != "batch-1" {
			return errors.New("wrong message")
		}
		return nil
	})

	// One server down (a node drain within the PDB): quorum holds.
	servers[0].Shutdown()
	servers[0].WaitForShutdown()
	waitFor(t, 60*time.Second, "publish with one of three servers down", func() error {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		_, err := js1.Publish(cctx, subject, []byte("batch-2"))
		return err
	})
}
