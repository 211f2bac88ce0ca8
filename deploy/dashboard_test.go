package deploy

import (
	"bytes"
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
)

// The dashboard's fields this test knows; decoding disallows others, so a
// field added to the JSON is added here too, consciously.
type grafanaDashboard struct {
	Title         string          `json:"title"`
	UID           string          `json:"uid"`
	Description   string          `json:"description"`
	Tags          []string        `json:"tags"`
	Editable      bool            `json:"editable"`
	GraphTooltip  int             `json:"graphTooltip"`
	SchemaVersion int             `json:"schemaVersion"`
	Version       int             `json:"version"`
	Refresh       string          `json:"refresh"`
	Time          json.RawMessage `json:"time"`
	Timezone      string          `json:"timezone"`
	Annotations   json.RawMessage `json:"annotations"`
	Links         json.RawMessage `json:"links"`
	Templating    struct {
		List []grafanaVariable `json:"list"`
	} `json:"templating"`
	Panels []grafanaPanel `json:"panels"`
}

type grafanaVariable struct {
	Name       string          `json:"name"`
	Label      string          `json:"label"`
	Type       string          `json:"type"`
	Datasource json.RawMessage `json:"datasource"`
	Query      json.RawMessage `json:"query"`
	Definition string          `json:"definition"`
	Refresh    int             `json:"refresh"`
	IncludeAll bool            `json:"includeAll"`
	Multi      bool            `json:"multi"`
	AllValue   string          `json:"allValue"`
	Current    json.RawMessage `json:"current"`
	Sort       int             `json:"sort"`
	Hide       int             `json:"hide"`
}

type grafanaPanel struct {
	Type        string `json:"type"`
	Title       string `json:"title"`
	Description string `json:"description"`
	ID          int    `json:"id"`
	Collapsed   bool   `json:"collapsed"`
	Datasource  *struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	} `json:"datasource"`
	GridPos struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Panels  []grafanaPanel `json:"panels"`
	Targets []struct {
		RefID        string          `json:"refId"`
		Expr         string          `json:"expr"`
		LegendFormat string          `json:"legendFormat"`
		Datasource   json.RawMessage `json:"datasource"`
	} `json:"targets"`
	FieldConfig json.RawMessage `json:"fieldConfig"`
	Options     json.RawMessage `json:"options"`
}

// grafanaVar matches Grafana variable references: $name, ${name}, ${name:fmt}.
var grafanaVar = regexp.MustCompile(`\$\{?([A-Za-z_][A-Za-z0-9_]*)(?::[a-z]+)?\}?`)

// promqlForCheck replaces Grafana variables with what Prometheus would see:
// interval variables by a duration, others by a plain value.
func promqlForCheck(expr string) string {
	return grafanaVar.ReplaceAllStringFunc(expr, func(m string) string {
		name := grafanaVar.FindStringSubmatch(m)[1]
		if strings.HasPrefix(name, "__") && strings.HasSuffix(name, "interval") {
			return "5m"
		}
		return "x"
	})
}

func TestPromqlForCheck(t *testing.T) {
	got := promqlForCheck(`rate(a{pool=~"$pool",ns=~"${namespace:regex}"}[$__rate_interval])`)
	if want := `rate(a{pool=~"x",ns=~"x"}[5m])`; got != want {
		t.Errorf("got %s, want %s", got, want)
	}
}

// TestDashboard checks deploy/grafana/kvrouter.json: valid JSON of known
// shape, unique panel ids on a 24-column grid, every query parses as PromQL
// and reads only metrics the code exports, every variable used is defined,
// and the panels docs/operations.md lists are there.
func TestDashboard(t *testing.T) {
	raw, err := os.ReadFile("grafana/kvrouter.json")
	if err != nil {
		t.Fatal(err)
	}
	if !json.Valid(raw) {
		t.Fatal("not valid JSON")
	}
	var d grafanaDashboard
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("decode: %v", err)
	}
	if d.Title == "" || d.UID == "" || d.SchemaVersion == 0 {
		t.Errorf("title %q uid %q schemaVersion %d: all required", d.Title, d.UID, d.SchemaVersion)
	}
	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
		if v.Type == "query" {
			var q struct{ Query string }
			if err := json.Unmarshal(v.Query, &q); err != nil {
				t.Errorf("variable %s: query: %v", v.Name, err)
			}
			// label_values(metric{...}, label): the metric must exist.
			if m := regexp.MustCompile(`^label_values\((.+),\s*\w+\)$`).FindStringSubmatch(q.Query); m != nil {
				checkPromQL(t, "variable "+v.Name, promqlForCheck(m[1]))
			} else {
				t.Errorf("variable %s: unexpected query %q", v.Name, q.Query)
			}
		}
	}
	for _, want := range []string{"datasource", "namespace", "pool"} {
		if !vars[want] {
			t.Errorf("variable %s missing", want)
		}
	}

	ids := map[int]bool{}
	titles := map[string]bool{}
	var all []grafanaPanel
	for _, p := range d.Panels {
		all = append(all, p)
		all = append(all, p.Panels...)
	}
	queries := 0
	for _, p := range all {
		where := "panel " + p.Title
		if ids[p.ID] || p.ID == 0 {
			t.Errorf("%s: id %d missing or duplicate", where, p.ID)
		}
		ids[p.ID] = true
		titles[strings.ToLower(p.Title)] = true
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.X+g.W > 24 {
			t.Errorf("%s: gridPos %+v outside the 24-column grid", where, g)
		}
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("%s: datasource must be the ${datasource} variable", where)
		}
		if len(p.Targets) == 0 {
			t.Errorf("%s: no queries", where)
		}
		refs := map[string]bool{}
		for _, tg := range p.Targets {
			queries++
			if refs[tg.RefID] {
				t.Errorf("%s: duplicate refId %s", where, tg.RefID)
			}
			refs[tg.RefID] = true
			for _, m := range grafanaVar.FindAllStringSubmatch(tg.Expr, -1) {
				if !vars[m[1]] && !strings.HasPrefix(m[1], "__") {
					t.Errorf("%s: undefined variable $%s", where, m[1])
				}
			}
			checkPromQL(t, where, promqlForCheck(tg.Expr))
		}
	}
	if queries < 10 {
		t.Errorf("only %d queries", queries)
	}
	// The panels an operator asks for: hit rate, TTFT, decisions by
	// reason, evictions by tier, per-instance share, overflow, event lag.
	for _, want := range []string{"hit rate", "ttft", "decisions by reason", "evictions by tier", "per-instance traffic share", "overflow", "event lag"} {
		found := false
		for title := range titles {
			found = found || strings.Contains(title, want)
		}
		if !found {
			t.Errorf("no panel about %q", want)
		}
	}
}
