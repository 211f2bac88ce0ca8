package grpcapi_test

import (
	"encoding/json"
	"os"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"gopkg.in/yaml.v3"

	"github.com/kvrouter/kvrouter/grpcapi"
)

// TestEnvoyConfig decodes the documented Envoy configuration strictly
// (unknown fields fail) into Envoy's own Bootstrap type, runs its
// validation rules, and checks it wires the picker as the protocol needs:
// buffered request bodies, no fail-open, the destination header honoured.
func TestEnvoyConfig(t *testing.T) {
	raw, err := os.ReadFile("testdata/envoy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var doc any
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	js, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	var bs bootstrapv3.Bootstrap
	if err := (protojson.UnmarshalOptions{}).Unmarshal(js, &bs); err != nil {
		t.Fatalf("decode: %v", err)
	}
	if err := bs.ValidateAll(); err != nil {
		t.Fatalf("validate: %v", err)
	}
	var hcm hcmv3.HttpConnectionManager
	if err := bs.GetStaticResources().GetListeners()[0].GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(&hcm); err != nil {
		t.Fatal(err)
	}
	var ep extprocfilterv3.ExternalProcessor
	if err := hcm.GetHttpFilters()[0].GetTypedConfig().UnmarshalTo(&ep); err != nil {
		t.Fatal(err)
	}
	if ep.GetFailureModeAllow() || ep.GetProcessingMode().GetRequestBodyMode().String() != "BUFFERED" {
		t.Errorf("ext_proc: failure_mode_allow %v, request_body_mode %v: want false, BUFFERED", ep.GetFailureModeAllow(), ep.GetProcessingMode().GetRequestBodyMode())
	}
	// The picker replaces the body (cache_salt, kv_transfer_params) and
	// sets content-length with it in the body response. Envoy applies that
	// only in BUFFERED body mode (checked above) after request headers were
	// sent (SEND, the default; with SKIP Envoy drops content-length and
	// the picker sees no path), outside observability_mode (which ignores
	// every response), and with mutation rules that let content-length be
	// set: envoyproxy/envoy api/envoy/extensions/filters/http/ext_proc/v3/
	// processing_mode.proto (BodySendMode) and ext_proc.proto
	// (observability_mode, mutation_rules), v1.29+.
	if m := ep.GetProcessingMode().GetRequestHeaderMode().String(); m != "SEND" && m != "DEFAULT" {
		t.Errorf("ext_proc: request_header_mode %s: want SEND", m)
	}
	if ep.GetObservabilityMode() {
		t.Error("ext_proc: observability_mode ignores the picker's answers")
	}
	if r := ep.GetMutationRules(); r.GetDisallowAll().GetValue() || r.GetDisallowExpression() != nil {
		t.Errorf("ext_proc: mutation_rules %v may refuse content-length", r)
	}
	found := false
	for _, c := range bs.GetStaticResources().GetClusters() {
		if h := c.GetOriginalDstLbConfig().GetHttpHeaderName(); h != "" {
			found = h == grpcapi.DestinationHeader && c.GetOriginalDstLbConfig().GetUseHttpHeader()
		}
	}
	if !found {
		t.Errorf("no ORIGINAL_DST cluster routing on %s", grpcapi.DestinationHeader)
	}
}
