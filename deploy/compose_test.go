package deploy

import (
	"bytes"
	"net"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/config"
	"gopkg.in/yaml.v3"
)

// composeFile is the subset of the Compose specification that
// deploy/compose/compose.yaml uses; decoding is strict, so any other field
// (or a typo) fails the test until this struct learns it.
type composeFile struct {
	Name     string                    `yaml:"name"`
	Services map[string]composeService `yaml:"services"`
	Volumes  map[string]struct{}       `yaml:"volumes"`
}

type composeService struct {
	Image       string                `yaml:"image"`
	Build       *composeBuild         `yaml:"build"`
	Entrypoint  []string              `yaml:"entrypoint"`
	Command     []string              `yaml:"command"`
	Environment map[string]string     `yaml:"environment"`
	Ports       []string              `yaml:"ports"`
	Volumes     []string              `yaml:"volumes"`
	DependsOn   map[string]composeDep `yaml:"depends_on"`
	Healthcheck *composeHealthcheck   `yaml:"healthcheck"`
	Restart     string                `yaml:"restart"`
	Profiles    []string              `yaml:"profiles"`
}

type composeBuild struct {
	Context    string `yaml:"context"`
	Dockerfile string `yaml:"dockerfile"`
}

type composeDep struct {
	Condition string `yaml:"condition"`
}

type composeHealthcheck struct {
	Test     []string `yaml:"test"`
	Interval string   `yaml:"interval"`
	Timeout  string   `yaml:"timeout"`
	Retries  int      `yaml:"retries"`
}

const composeDir = "compose"

// interpolation is Compose's ${VAR:-default} form; the checks use defaults.
var interpolation = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}`)

func interpolate(s string) string { return interpolation.ReplaceAllString(s, "$2") }

func loadCompose(t *testing.T) composeFile {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(composeDir, "compose.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var cf composeFile
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	if err := dec.Decode(&cf); err != nil {
		t.Fatalf("compose.yaml: %v", err)
	}
	for n, s := range cf.Services {
		for i := range s.Command {
			s.Command[i] = interpolate(s.Command[i])
		}
		for k, v := range s.Environment {
			s.Environment[k] = interpolate(v)
		}
		cf.Services[n] = s
	}
	return cf
}

func TestComposeDecodeIsStrict(t *testing.T) {
	for _, y := range []string{
		"services: {a: {image: x, comand: [y]}}\n",
		"services: {a: {image: x, depends_on: {b: {condtion: service_started}}}}\n",
		"servics: {}\n",
	} {
		var cf composeFile
		dec := yaml.NewDecoder(strings.NewReader(y))
		dec.KnownFields(true)
		if err := dec.Decode(&cf); err == nil {
			t.Errorf("accepted %q", y)
		}
	}
	if got := interpolate(">${REDIS_PASSWORD:-kvrouter-dev}"); got != ">kvrouter-dev" {
		t.Errorf("interpolate: %q", got)
	}
}

// TestCompose cross-checks the compose file: binaries and flags exist, every
// kvsim has exactly one bridge that reads its endpoints under a unique
// identity, two routers share Redis, and router.yaml lists exactly the
// bridged engines and validates.
func TestCompose(t *testing.T) {
	cf := loadCompose(t)
	if len(cf.Services) == 0 {
		t.Fatal("no services")
	}
	byBin := map[string][]string{}
	hostPorts := map[string]string{}
	for _, n := range sortedKeys(cf.Services) {
		s := cf.Services[n]
		if s.Image == "" {
			t.Errorf("service %s: no image", n)
		}
		if s.Build != nil {
			df := filepath.Join(composeDir, s.Build.Context, s.Build.Dockerfile)
			if _, err := os.Stat(df); err != nil {
				t.Errorf("service %s: build %s: %v", n, df, err)
			}
			if _, err := os.Stat(filepath.Join(composeDir, s.Build.Context, "go.mod")); err != nil {
				t.Errorf("service %s: build context %s is not the main module's root", n, s.Build.Context)
			}
		}
		for d := range s.DependsOn {
			if _, ok := cf.Services[d]; !ok {
				t.Errorf("service %s depends on unknown service %s", n, d)
			}
			if c := s.DependsOn[d].Condition; c == "service_healthy" && cf.Services[d].Healthcheck == nil {
				t.Errorf("service %s waits for %s to be healthy, which has no healthcheck", n, d)
			}
		}
		for _, p := range s.Ports {
			// [ip:]host:container; the key is the host side, ip included.
			parts := strings.Split(p, ":")
			if len(parts) < 2 {
				continue
			}
			host := strings.Join(parts[:len(parts)-1], ":")
			if other, dup := hostPorts[host]; dup {
				t.Errorf("host port %s published by %s and %s", host, other, n)
			}
			hostPorts[host] = n
		}
		for _, v := range s.Volumes {
			src, _, _ := strings.Cut(v, ":")
			if strings.HasPrefix(src, ".") {
				if _, err := os.Stat(filepath.Join(composeDir, src)); err != nil {
					t.Errorf("service %s mounts %s: %v", n, src, err)
				}
			} else if _, ok := cf.Volumes[src]; !ok {
				t.Errorf("service %s mounts undeclared volume %s", n, src)
			}
		}
		bin := binaryOf(s.Entrypoint)
		if bin == "" {
			continue
		}
		byBin[bin] = append(byBin[bin], n)
		args := s.Command
		if _, ok := subcommands[bin]; ok {
			if len(args) == 0 {
				t.Errorf("compose service %s: %s needs a subcommand", n, bin)
				continue
			}
			bin, args = bin+" "+args[0], args[1:]
		}
		checkArgs(t, "compose service "+n, bin, args)
		for e := range s.Environment {
			if !envReadBy(t, bin, e) {
				t.Errorf("compose service %s: env %s is not read by %s", n, e, bin)
			}
		}
	}
	if len(byBin["kvsim"]) < 2 || len(byBin["kvrouter"]) < 2 {
		t.Fatalf("want a kvsim fleet and two routers; have sims %v, routers %v", byBin["kvsim"], byBin["kvrouter"])
	}
	checkNATSService := func(where, raw string) {
		u, err := url.Parse(raw)
		if err != nil {
			t.Errorf("%s %q: %v", where, raw, err)
			return
		}
		if s, ok := cf.Services[u.Hostname()]; !ok || !strings.HasPrefix(s.Image, "nats:") || !slices.Contains(s.Command, "--jetstream") {
			t.Errorf("%s %q: not a JetStream-enabled nats service", where, raw)
		}
	}

	// Bridges: one per sim, endpoints the sim binds, unique identity.
	bridged := map[string]string{} // sim service -> bridge instance id
	for _, n := range byBin["kvbridge"] {
		s := cf.Services[n]
		id := s.Environment["KVBRIDGE_INSTANCE"]
		if v, ok := argValue(s.Command, "instance"); ok {
			id = v
		}
		if id == "" {
			t.Errorf("%s: no instance identity (--instance or KVBRIDGE_INSTANCE); the container hostname would be random", n)
		}
		zmq := mustArg(t, s.Command, "zmq-endpoint")
		u, err := url.Parse(zmq)
		if err != nil {
			t.Errorf("%s: --zmq-endpoint %q: %v", n, zmq, err)
			continue
		}
		sim, ok := cf.Services[u.Hostname()]
		if !ok || binaryOf(sim.Entrypoint) != "kvsim" {
			t.Errorf("%s: --zmq-endpoint=%s does not name a kvsim service", n, zmq)
			continue
		}
		if _, dup := bridged[u.Hostname()]; dup {
			t.Errorf("%s: a second bridge for %s", n, u.Hostname())
		}
		bridged[u.Hostname()] = id
		if _, ok := s.DependsOn[u.Hostname()]; !ok {
			t.Errorf("%s: should depend on its engine %s", n, u.Hostname())
		}
		if h, _ := argValue(sim.Command, "zmq-host"); h != "0.0.0.0" {
			t.Errorf("%s binds ZMQ on %q: the bridge container cannot reach it (want 0.0.0.0)", u.Hostname(), h)
		}
		for flag, simFlag := range map[string]string{"zmq-endpoint": "zmq-port", "replay-endpoint": "replay-port"} {
			got := mustArg(t, s.Command, flag)
			want := "tcp://" + net.JoinHostPort(u.Hostname(), mustArg(t, sim.Command, simFlag))
			if got != want {
				t.Errorf("%s --%s=%s, engine binds %s", n, flag, got, want)
			}
		}
		if a, b := mustArg(t, s.Command, "topic"), mustArg(t, sim.Command, "topic"); a != b {
			t.Errorf("%s --topic=%s, engine topic %s", n, a, b)
		}
		checkBridgeFirstSeq(t, n, s.Command, kvsimFirstSeq)
		checkNATSService(n+" --nats-url", mustArg(t, s.Command, "nats-url"))
	}
	for _, sim := range byBin["kvsim"] {
		if _, ok := bridged[sim]; !ok {
			t.Errorf("kvsim service %s has no kvbridge", sim)
		}
	}

	// Routers: same config, shared Redis, pool = the bridged engines.
	var cfgFile string
	for _, n := range byBin["kvrouter"] {
		s := cf.Services[n]
		p := mustArg(t, s.Command, "config")
		var src string
		for _, v := range s.Volumes {
			parts := strings.Split(v, ":")
			if len(parts) >= 2 && parts[1] == p {
				src = parts[0]
			}
		}
		if src == "" {
			t.Errorf("%s: --config=%s is not mounted", n, p)
			continue
		}
		if cfgFile != "" && cfgFile != src {
			t.Errorf("routers use different configs %s and %s; they must agree to share an index", cfgFile, src)
		}
		cfgFile = src
		if s.Environment["KVROUTER_REDIS_PASSWORD"] == "" || s.Environment["KVROUTER_ADMIN_TOKEN"] == "" {
			t.Errorf("%s: KVROUTER_REDIS_PASSWORD and KVROUTER_ADMIN_TOKEN must be set", n)
		}
	}
	if cfgFile == "" {
		t.Fatal("no router config mounted")
	}
	text, err := os.ReadFile(filepath.Join(composeDir, cfgFile))
	if err != nil {
		t.Fatal(err)
	}
	checkConfigWithBinary(t, string(text), cf.Services[byBin["kvrouter"][0]].Command)
	cfg, err := config.ParseConfig(bytes.NewReader(text))
	if err != nil {
		t.Fatalf("%s: %v", cfgFile, err)
	}
	cfg.AdminToken = "x"
	if err := cfg.Validate(); err != nil {
		t.Fatalf("%s: %v", cfgFile, err)
	}
	if cfg.Index == nil || cfg.Index.Backend != "redis" || cfg.Index.Redis == nil {
		t.Fatalf("%s: the two routers must share the redis index", cfgFile)
	}
	for _, a := range cfg.Index.Redis.Addrs {
		host, _, _ := net.SplitHostPort(a)
		rs, ok := cf.Services[host]
		if !ok || !strings.HasPrefix(rs.Image, "redis:") {
			t.Errorf("index.redis.addrs %s: no redis service %s", a, host)
			continue
		}
		for _, n := range byBin["kvrouter"] {
			checkRedisACL(t, n, rs.Command, cfg.Index.Redis, cf.Services[n].Environment["KVROUTER_REDIS_PASSWORD"])
		}
	}
	if cfg.Events == nil {
		t.Fatalf("%s: no events.nats", cfgFile)
	}
	checkNATSService("events.nats.url", cfg.Events.NATS.URL)
	if len(cfg.Pools) != 1 {
		t.Fatalf("%s: want one pool", cfgFile)
	}
	pool := cfg.Pools[0]
	want := map[string]string{} // instance id -> URL
	for sim, id := range bridged {
		want[id] = "http://" + net.JoinHostPort(sim, mustArg(t, cf.Services[sim].Command, "port"))
	}
	if len(pool.Instances) != len(want) {
		t.Errorf("pool lists %d instances, %d engines are bridged", len(pool.Instances), len(want))
	}
	for _, in := range pool.Instances {
		if u, ok := want[in.ID]; !ok || u != in.URL {
			t.Errorf("instance %s %s: want a bridged engine (%v)", in.ID, in.URL, want)
		}
	}
	for _, n := range byBin["kvbridge"] {
		s := cf.Services[n]
		if v, _ := argValue(s.Command, "pool"); v != pool.Name {
			t.Errorf("%s --pool=%s, router pool %s", n, v, pool.Name)
		}
		if v, _ := argValue(s.Command, "model"); v != pool.Model {
			t.Errorf("%s --model=%s, router model %s", n, v, pool.Model)
		}
	}
}

// TestComposeBench: the bench profile drives a router that exists, on the
// ports it listens on, with the admin token the routers use.
func TestComposeBench(t *testing.T) {
	cf := loadCompose(t)
	s, ok := cf.Services["kvbench"]
	if !ok {
		t.Fatal("no kvbench service")
	}
	if !slices.Contains(s.Profiles, "bench") {
		t.Error("kvbench must sit in the bench profile, so that `up` does not start it")
	}
	if len(s.Command) == 0 || s.Command[0] != "live" {
		t.Fatalf("kvbench command %v: want live", s.Command)
	}
	for flag, listen := range map[string]string{"router": "listen", "admin": "admin-listen"} {
		u, err := url.Parse(mustArg(t, s.Command[1:], flag))
		if err != nil {
			t.Fatal(err)
		}
		r, ok := cf.Services[u.Hostname()]
		if !ok || binaryOf(r.Entrypoint) != "kvrouter" {
			t.Errorf("kvbench --%s=%s: not a kvrouter service", flag, u)
			continue
		}
		if l := mustArg(t, r.Command, listen); !strings.HasSuffix(l, ":"+u.Port()) {
			t.Errorf("kvbench --%s=%s: %s listens on %s", flag, u, u.Hostname(), l)
		}
		if s.Environment["KVROUTER_ADMIN_TOKEN"] != r.Environment["KVROUTER_ADMIN_TOKEN"] {
			t.Errorf("kvbench and %s use different admin tokens", u.Hostname())
		}
	}
}

// redisUser is one "--user NAME rules..." of a redis-server command line.
type redisUser struct {
	on        bool
	passwords []string // ">password" rules
	patterns  []string // "~pattern" key rules
	commands  []string // "+command", "-@category" rules, in order
}

// may reports whether the user's command rules, applied in order, allow
// command (lower case) of category ("@dangerous"...); a user starts with
// none.
func (u redisUser) may(command, category string) bool {
	ok := false
	for _, r := range u.commands {
		switch r[1:] {
		case "@all", category, command:
			ok = r[0] == '+'
		}
	}
	return ok
}

// redisUsers parses the ACL users a redis-server command line defines.
func redisUsers(args []string) map[string]redisUser {
	users := map[string]redisUser{}
	for i := 0; i < len(args); i++ {
		if args[i] != "--user" || i+1 >= len(args) {
			continue
		}
		name := args[i+1]
		u := users[name]
		for j := i + 2; j < len(args) && !strings.HasPrefix(args[j], "--"); j++ {
			switch r := args[j]; {
			case r == "on":
				u.on = true
			case r == "off":
				u.on = false
			case strings.HasPrefix(r, ">"):
				u.passwords = append(u.passwords, r[1:])
			case strings.HasPrefix(r, "~"):
				u.patterns = append(u.patterns, r[1:])
			case strings.HasPrefix(r, "+") || strings.HasPrefix(r, "-"):
				u.commands = append(u.commands, r)
			}
		}
		users[name] = u
	}
	return users
}

// checkRedisACL: the router's Redis user exists, is on, has the password
// the router is given, may touch the index's keys (<key_prefix>:...), and
// the default user is off.
func checkRedisACL(t *testing.T, where string, redisArgs []string, rc *config.RedisConfig, routerPassword string) {
	t.Helper()
	users := redisUsers(redisArgs)
	if d, ok := users["default"]; !ok || d.on {
		t.Errorf("%s: the default user must be off (--user default off)", where)
	}
	u, ok := users[rc.Username]
	if rc.Username == "" || !ok || !u.on {
		t.Fatalf("%s: index.redis.username %q is not an enabled ACL user of Redis (%v)", where, rc.Username, redisArgs)
	}
	if !slices.Contains(u.passwords, routerPassword) {
		t.Errorf("%s: the router's password %q is not user %s's (%v)", where, routerPassword, rc.Username, u.passwords)
	}
	prefix := rc.KeyPrefix
	if prefix == "" {
		prefix = "kvrouter"
	}
	if !slices.ContainsFunc(u.patterns, func(p string) bool { ok, _ := path.Match(p, prefix+":b:x"); return ok }) {
		t.Errorf("%s: user %s's key patterns %v do not cover the index's keys %s:...", where, rc.Username, u.patterns, prefix)
	}
	if slices.Contains(u.patterns, "*") {
		t.Errorf("%s: user %s may touch every key", where, rc.Username)
	}
	// The index's rewind check reads the server's run_id (INFO server,
	// kvindex.Redis.Rewound), and INFO is in @dangerous.
	if !u.may("info", "@dangerous") {
		t.Errorf("%s: user %s may not run INFO (%v): a Redis restart that loses only writes newer than the routers' last check would go unseen", where, rc.Username, u.commands)
	}
	if u.may("config", "@dangerous") {
		t.Errorf("%s: user %s may run the dangerous commands (%v)", where, rc.Username, u.commands)
	}
	// The append-only file is loaded by a client running as the default
	// user, whose permissions Redis re-checks at each EXEC (until
	// redis/redis#14545): given nothing, every transaction in the file is
	// refused at load (TestProductionRedisClusterAOFReload).
	aof := slices.Index(redisArgs, "--appendonly")
	if d := users["default"]; aof >= 0 && aof+1 < len(redisArgs) && redisArgs[aof+1] == "yes" &&
		(!slices.Contains(d.commands, "+@all") || slices.ContainsFunc(d.commands, func(r string) bool { return r[0] == '-' }) || !slices.Contains(d.patterns, "*")) {
		t.Errorf("%s: an append-only file, and a default user who may not replay it (%v %v)", where, d.patterns, d.commands)
	}
}

func TestRedisUsers(t *testing.T) {
	got := redisUsers([]string{"--port", "1", "--user", "default", "off", "--user", "k", "on", ">pw", "~k:*", "+@all", "-@dangerous", "+info", "--save", ""})
	if got["default"].on || !got["k"].on || !slices.Equal(got["k"].passwords, []string{"pw"}) || !slices.Equal(got["k"].patterns, []string{"k:*"}) {
		t.Errorf("got %+v", got)
	}
	k := got["k"]
	if !k.may("info", "@dangerous") || k.may("config", "@dangerous") || !k.may("set", "@write") || got["default"].may("set", "@write") {
		t.Errorf("command rules %v read wrong", k.commands)
	}
}
