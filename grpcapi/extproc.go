package grpcapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrouter/kvrouter/internal/zero"
	"github.com/kvrouter/kvrouter/router"
)

// Names of the Gateway API Inference Extension endpoint picker protocol
// (gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol).
const (
	// DestinationHeader carries the picked endpoint (ip:port) to Envoy.
	DestinationHeader = "x-gateway-destination-endpoint"
	// DestinationKey is the same value's key in the dynamic metadata.
	DestinationKey = "x-gateway-destination-endpoint"
	// ServedKey names, in the response's filter metadata (DestinationNamespace),
	// the endpoint that really served the request after Envoy's retries.
	ServedKey = "x-gateway-destination-endpoint-served"
	// SubsetKey lists, in the filter metadata, the endpoints to pick from.
	SubsetKey = "x-gateway-destination-endpoint-subset"
	// DefaultDestinationNamespace is the dynamic metadata namespace of the pick.
	DefaultDestinationNamespace = "envoy.lb"
	// DefaultSubsetNamespace is the filter metadata namespace of the subset hint.
	DefaultSubsetNamespace = "envoy.lb.subset_hint"
)

// ExtProcConfig configures the Envoy endpoint picker. The zero value
// follows the GIE protocol's default namespaces and never sheds load.
type ExtProcConfig struct {
	// PoolHeader is the request header naming the pool; default
	// X-Kvrouter-Pool (router.HeaderPool). Without it the pool is the one
	// serving the body's "model", else Config.DefaultPool, else the first.
	PoolHeader string
	// DestinationNamespace is the dynamic metadata namespace of the pick;
	// default "envoy.lb".
	DestinationNamespace string
	// SubsetNamespace is the filter metadata namespace of the subset hint;
	// default "envoy.lb.subset_hint".
	SubsetNamespace string
	// Shed turns on load shedding: when every candidate is at the pool's
	// concurrency threshold and the requests beyond the thresholds
	// (queued in the engines) number MaxQueued or more, answer 429. Off,
	// a saturated pool still routes (to the least loaded), as the HTTP
	// data plane does.
	Shed bool
	// MaxQueued is the queue allowance under Shed (>= 0; 0 = shed as soon
	// as every candidate is full).
	MaxQueued int
	// MaxBodyBytes caps the buffered request body (413 above); default
	// 32 MiB, the router's max_body_bytes.
	MaxBodyBytes int
}

func (c ExtProcConfig) withDefaults() ExtProcConfig {
	zero.Default(&c.PoolHeader, router.HeaderPool)
	c.PoolHeader = strings.ToLower(c.PoolHeader) // Envoy sends lower-case names
	zero.Default(&c.DestinationNamespace, DefaultDestinationNamespace)
	zero.Default(&c.SubsetNamespace, DefaultSubsetNamespace)
	zero.Default(&c.MaxBodyBytes, DefaultMaxMessageBytes)
	return c
}

func (c ExtProcConfig) validate() error {
	if c.MaxQueued < 0 {
		return fmt.Errorf("%w: ext_proc max_queued %d: want >= 0", ErrInvalidConfig, c.MaxQueued)
	}
	if c.MaxBodyBytes < 0 {
		return fmt.Errorf("%w: ext_proc max_body_bytes %d: want > 0", ErrInvalidConfig, c.MaxBodyBytes)
	}
	return nil
}

// extProc is Envoy's ExternalProcessor acting as an endpoint picker. Envoy
// must send request headers and the request body in BUFFERED mode; response
// headers are optional (when sent, the pick's in-flight count and kv_aware's
// pending prefill end at them rather than at the stream's end).
type extProc struct {
	extprocv3.UnimplementedExternalProcessorServer
	s *Server
}

var _ extprocv3.ExternalProcessorServer = (*extProc)(nil)

// epStream is one HTTP request's ext_proc stream.
type epStream struct {
	headers map[string]string
	body    []byte
	// chunks counts the request body messages: 0 for a request whose
	// headers end the stream (no body to rewrite), 1 for a BUFFERED body.
	chunks int
	// bodyMode is the filter's request_body_mode as Envoy names it in the
	// stream's first message (ProcessingRequest.protocol_config, Envoy
	// 1.33+); NONE when it names none.
	bodyMode extprocfilterv3.ProcessingMode_BodySendMode
	// subset is the hint's endpoints; hasSubset tells an empty hint (pick
	// nothing) from none (pick from the pool).
	subset    []string
	hasSubset bool
	// pick, once made: its instance is Acquired until the stream ends.
	pool     *router.Pool
	inst     *router.Instance
	obs      router.Observer
	finished bool
}

func (st *epStream) finish(code int) {
	if st.obs != nil && !st.finished {
		st.finished = true
		st.obs.Done(code, -1)
	}
}

// Process implements extprocv3.ExternalProcessorServer.
func (x *extProc) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	st := &epStream{}
	defer func() {
		st.finish(0)
		if st.inst != nil {
			st.inst.Release()
		}
	}()
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		x.readSubset(st, req.GetMetadataContext())
		if pc := req.GetProtocolConfig(); pc != nil {
			st.bodyMode = pc.GetRequestBodyMode()
		}
		var resp *extprocv3.ProcessingResponse
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			st.headers = headerMap(r.RequestHeaders.GetHeaders())
			if !r.RequestHeaders.GetEndOfStream() && st.inst == nil && streamedMode(st.bodyMode) {
				x.s.m.extproc.WithLabelValues("", "500").Inc()
				x.s.log.Warn("ext_proc: request_body_mode streams the body after the headers went on; set request_body_mode: BUFFERED", "mode", st.bodyMode.String())
				return stream.Send(immediate(http.StatusInternalServerError,
					"the ext_proc filter streams the request body (request_body_mode "+st.bodyMode.String()+"): the picker needs BUFFERED"))
			}
			if !r.RequestHeaders.GetEndOfStream() || st.inst != nil {
				// The pick comes with the body. Until then the request
				// carries no destination: Envoy forwards the headers
				// before the body's answer in STREAMED mode, and lets a
				// BUFFERED_PARTIAL body past its buffer through unseen,
				// and such a request must not reach an endpoint the
				// client named in the header (ORIGINAL_DST reads it).
				// Envoy's default HeaderMutationRules let the processor
				// remove any header but host, :authority, :scheme,
				// :method and x-envoy-* (api/envoy/config/common/
				// mutation_rules/v3/mutation_rules.proto).
				resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
					RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
						HeaderMutation: &extprocv3.HeaderMutation{RemoveHeaders: []string{DestinationHeader}}}}}}
				break
			}
			// No body (a GET, or an empty POST): pick now.
			common, md, imm, err := x.decide(stream.Context(), st)
			if err != nil {
				return err
			}
			if imm != nil {
				return stream.Send(imm)
			}
			resp = &extprocv3.ProcessingResponse{DynamicMetadata: md, Response: &extprocv3.ProcessingResponse_RequestHeaders{
				RequestHeaders: &extprocv3.HeadersResponse{Response: common}}}
		case *extprocv3.ProcessingRequest_RequestBody:
			if len(st.body)+len(r.RequestBody.GetBody()) > x.s.cfg.ExtProc.MaxBodyBytes {
				x.s.m.extproc.WithLabelValues("", "413").Inc()
				return stream.Send(immediate(http.StatusRequestEntityTooLarge,
					fmt.Sprintf("request body exceeds the limit of %d bytes", x.s.cfg.ExtProc.MaxBodyBytes)))
			}
			st.body = append(st.body, r.RequestBody.GetBody()...)
			st.chunks++
			// A BUFFERED body comes whole in one message, whose
			// end_of_stream is false when trailers follow it
			// (envoyproxy/envoy source/extensions/filters/http/ext_proc/
			// ext_proc.cc, Filter::onTrailers, v1.33: the buffered data
			// sent with end_stream false); with request_trailer_mode SKIP
			// nothing else comes, so the pick is made on it.
			last := r.RequestBody.GetEndOfStream() || st.bodyMode == extprocfilterv3.ProcessingMode_BUFFERED
			if !last && st.bodyMode == extprocfilterv3.ProcessingMode_BUFFERED_PARTIAL && st.inst == nil {
				// A partial body's first message, sent at the filter's
				// buffer limit: Envoy streams the rest upstream without
				// sending it here (processor_state.cc,
				// partial_body_processed_), so the body can be neither read
				// whole nor rewritten.
				x.s.m.extproc.WithLabelValues("", "413").Inc()
				return stream.Send(immediate(http.StatusRequestEntityTooLarge,
					"request body over the ext_proc filter's buffer (request_body_mode BUFFERED_PARTIAL): the picker needs the whole body; use BUFFERED"))
			}
			if !last || st.inst != nil {
				// Streamed mode collects until the end; a body after the
				// pick (a misbehaving client) must not pick, and acquire,
				// twice.
				resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
					RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}}
				break
			}
			common, md, imm, err := x.decide(stream.Context(), st)
			if err != nil {
				return err
			}
			if imm != nil {
				return stream.Send(imm)
			}
			resp = &extprocv3.ProcessingResponse{DynamicMetadata: md, Response: &extprocv3.ProcessingResponse_RequestBody{
				RequestBody: &extprocv3.BodyResponse{Response: common}}}
		case *extprocv3.ProcessingRequest_RequestTrailers:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
				RequestTrailers: &extprocv3.TrailersResponse{}}}
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			x.readServed(st, req.GetMetadataContext())
			code, _ := strconv.Atoi(headerMap(r.ResponseHeaders.GetHeaders())[":status"])
			st.finish(code)
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
				ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}}}}
		case *extprocv3.ProcessingRequest_ResponseBody:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
				ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}}
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
				ResponseTrailers: &extprocv3.TrailersResponse{}}}
		default:
			return status.Errorf(codes.InvalidArgument, "ext_proc: unexpected request %T", r)
		}
		if err := stream.Send(resp); err != nil {
			return err
		}
	}
}

// streamedMode reports whether, in request_body_mode m, Envoy lets the
// request headers go on to the router filter, which picks the upstream
// host then, when the picker answers them (at once, in Process) and before
// the body's answer: STREAMED continues the headers on their answer
// (envoyproxy/envoy source/extensions/filters/http/ext_proc/
// processor_state.cc, ProcessorState::handleHeadersResponse, v1.33), and
// FULL_DUPLEX_STREAMED takes the headers answer as the only one that can
// set headers before they leave (a full-duplex picker holds it until the
// body ends; this one does not). A pick made on the body could never be
// applied.
func streamedMode(m extprocfilterv3.ProcessingMode_BodySendMode) bool {
	return m == extprocfilterv3.ProcessingMode_STREAMED || m == extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// readSubset records the GIE subset hint from the filter metadata: a list
// of "ip:port" strings (a comma-separated string is accepted too).
func (x *extProc) readSubset(st *epStream, md *corev3.Metadata) {
	ns := md.GetFilterMetadata()[x.s.cfg.ExtProc.SubsetNamespace]
	v, ok := ns.GetFields()[SubsetKey]
	if !ok {
		return
	}
	st.hasSubset, st.subset = true, st.subset[:0]
	switch k := v.GetKind().(type) {
	case *structpb.Value_ListValue:
		for _, e := range k.ListValue.GetValues() {
			if s := strings.TrimSpace(e.GetStringValue()); s != "" {
				st.subset = append(st.subset, s)
			}
		}
	case *structpb.Value_StringValue:
		for _, s := range strings.Split(k.StringValue, ",") {
			if s = strings.TrimSpace(s); s != "" {
				st.subset = append(st.subset, s)
			}
		}
	}
}

// readServed moves the request's in-flight count when Envoy reports (GIE
// protocol v0.4+) that another endpoint than the pick served it, e.g. after
// a retry down a fallback list.
func (x *extProc) readServed(st *epStream, md *corev3.Metadata) {
	if st.inst == nil {
		return
	}
	served := md.GetFilterMetadata()[x.s.cfg.ExtProc.DestinationNamespace].GetFields()[ServedKey].GetStringValue()
	if served == "" || served == hostPort(st.inst) {
		return
	}
	for _, in := range st.pool.Instances() {
		if hostPort(in) == served {
			in.Acquire()
			st.inst.Release()
			st.inst = in
			return
		}
	}
}

func headerMap(hm *corev3.HeaderMap) map[string]string {
	out := make(map[string]string, len(hm.GetHeaders()))
	for _, h := range hm.GetHeaders() {
		v := h.GetValue()
		if len(h.GetRawValue()) > 0 {
			v = string(h.GetRawValue())
		}
		k := strings.ToLower(h.GetKey())
		if prev, ok := out[k]; ok {
			v = prev + "," + v
		}
		out[k] = v
	}
	return out
}

// decide picks the endpoint: the common response carrying the header
// mutation and the dynamic metadata, or an immediate response, or the
// stream's context error when Envoy ended the stream during the pick.
func (x *extProc) decide(ctx context.Context, st *epStream) (*extprocv3.CommonResponse, *structpb.Struct, *extprocv3.ProcessingResponse, error) {
	s := x.s
	fail := func(pool string, code int, msg string) (*extprocv3.CommonResponse, *structpb.Struct, *extprocv3.ProcessingResponse, error) {
		s.m.extproc.WithLabelValues(pool, strconv.Itoa(code)).Inc()
		return nil, nil, immediate(code, msg), nil
	}
	req, p, err := s.pools.Resolve(x.inbound(st))
	if err != nil {
		re := router.AsRequestError(err)
		return fail(re.Pool, re.Status, re.Message)
	}
	rewrite := rewritten(st.body, req.Body)
	if rewrite && st.chunks > 1 {
		// Envoy sent the body in several messages (request_body_mode
		// STREAMED or BUFFERED_PARTIAL) and let the earlier ones through
		// (Process answers them "continue"): a body mutation now would
		// replace the last chunk alone, and the engine would read the
		// client's members in the chunks before it. Refuse rather than
		// forward them; the filter must be BUFFERED (docs/envoy.md).
		// Every such request counts (kvrouter_extproc_requests_total
		// outcome 500); the warning, rate-limited per pool, says why.
		if ok, suppressed := s.logLimit.Allow("streamed_rewrite/" + p.Name()); ok {
			s.log.Warn("ext_proc: a body to rewrite arrived in several messages; set request_body_mode: BUFFERED", "pool", p.Name(), "messages", st.chunks, "suppressed", suppressed)
		}
		return fail(p.Name(), http.StatusInternalServerError, "the request body must be rewritten and Envoy streamed it: the ext_proc filter needs request_body_mode BUFFERED")
	}
	rc, strat := p.Routing()
	var buf [32]*router.Instance
	cands, _ := p.Candidates(buf[:0], req.Adapter, nil)
	if st.hasSubset {
		kept := cands[:0]
		for _, in := range cands {
			if containsAddr(st.subset, hostPort(in)) {
				kept = append(kept, in)
			}
		}
		cands = kept
	}
	if len(cands) == 0 {
		what := "no eligible instance in pool " + strconv.Quote(p.Name())
		if st.hasSubset {
			what += " among the subset hint"
		}
		return fail(p.Name(), http.StatusServiceUnavailable, what)
	}
	if ep := s.cfg.ExtProc; ep.Shed {
		queued, full := 0, true
		for _, in := range cands {
			if !in.Full(rc.ConcurrencyThreshold) {
				full = false
				break
			}
			queued += in.InFlight() - rc.ConcurrencyThreshold
		}
		if full && queued >= ep.MaxQueued {
			return fail(p.Name(), http.StatusTooManyRequests, fmt.Sprintf("pool %q is saturated: every instance is at its concurrency threshold and %d requests are queued", p.Name(), queued))
		}
	}
	dec, err := strat.Pick(ctx, req, cands)
	if err != nil {
		if ctx.Err() != nil {
			// Envoy ended the stream, its client gone, while the pick was
			// held (kv_aware's sequencing holds a request for its epoch):
			// nobody to answer, and no routing failure. Counted 499, as
			// the HTTP edge counts a client that left.
			s.m.extproc.WithLabelValues(p.Name(), outcomeClientLeft).Inc()
			s.log.Debug("ext_proc: client left during the pick", "pool", p.Name())
			return nil, nil, nil, status.FromContextError(ctx.Err()).Err()
		}
		if errors.Is(err, router.ErrNoCandidates) {
			return fail(p.Name(), http.StatusServiceUnavailable, "no eligible instance in pool "+strconv.Quote(p.Name()))
		}
		s.log.Warn("ext_proc: pick failed", "pool", p.Name(), "err", err)
		return fail(p.Name(), http.StatusInternalServerError, "pick failed")
	}
	dec.Instance.Acquire()
	st.pool, st.inst, st.obs = p, dec.Instance, dec.Observer
	addr := hostPort(dec.Instance)
	md, err := structpb.NewStruct(map[string]any{
		s.cfg.ExtProc.DestinationNamespace: map[string]any{DestinationKey: addr},
	})
	if err != nil { // only for invalid UTF-8 in a configured namespace
		return fail(p.Name(), http.StatusInternalServerError, "dynamic metadata: "+err.Error())
	}
	set := func(k, v string) *corev3.HeaderValueOption {
		return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
			AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
	}
	s.m.extproc.WithLabelValues(p.Name(), "routed").Inc()
	common := &extprocv3.CommonResponse{
		ClearRouteCache: true, // the route may match on the destination header
		HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
			set(DestinationHeader, addr),
			set(strings.ToLower(router.HeaderInstance), dec.Instance.ID()),
			set(strings.ToLower(router.HeaderStrategy), dec.Strategy),
			set(strings.ToLower(router.HeaderReason), string(dec.Reason)),
		}},
	}
	if rewrite {
		// The body Resolve wrote for Envoy to forward (router.Inbound's
		// Forwards: the pool's cache_salt in, a client's
		// kv_transfer_params out), the one kv_aware keyed the pick by.
		//
		// Envoy replaces the buffered body with a BodyMutation's body. In
		// BUFFERED request_body_mode with request_header_mode SEND (the
		// mode testdata/envoy.yaml configures and TestEnvoyConfig checks)
		// Envoy keeps the request's content-length, and "it is external
		// processor's responsibility to set the content length correctly
		// matched to the length of mutated body. If they don't match, the
		// corresponding body mutation will be rejected and local reply
		// will be sent with an error message" (envoyproxy/envoy
		// api/envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto,
		// BodySendMode, since v1.29: envoyproxy/envoy#29536). Envoy applies
		// a body response's header mutation before it compares
		// (source/extensions/filters/http/ext_proc/processor_state.cc,
		// ProcessorState::handleBodyResponse), so content-length is set
		// here in the same response. A request without one (chunked) gets
		// none: Envoy checks nothing then and frames the new body itself.
		common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: req.Body}}
		if _, ok := st.headers["content-length"]; ok {
			common.HeaderMutation.SetHeaders = append(common.HeaderMutation.SetHeaders, set("content-length", strconv.Itoa(len(req.Body))))
		}
	}
	return common, md, nil, nil
}

// rewritten reports whether Resolve replaced the received body: it
// returns the very slice it was given when the body needs no rewrite (no
// salt to write, no kv_transfer_params to remove), so that such a body
// costs no copy and goes upstream as Envoy holds it.
func rewritten(received, forwarded []byte) bool {
	return len(received) != len(forwarded) || len(received) > 0 && &received[0] != &forwarded[0]
}

// inbound is the request as Envoy forwarded it: the path picks the
// endpoint (anything but the OpenAI paths is a raw invocation), the pool
// header names a pool, the adapter and tenant headers as on the HTTP data
// plane. It Forwards: Resolve writes the body Envoy is to send upstream
// exactly as for the HTTP data plane (the pool's cache_salt injected per
// its client policy, a client's kv_transfer_params removed unless the pool
// passes them, a body that needs either and is not strict JSON refused
// with 400), kv_aware keys blocks by the salt of that body, and decide
// hands it to Envoy as a body mutation when it differs from the received
// one. A request without a body (its headers ended the stream) has none
// to rewrite, and is resolved as before.
func (x *extProc) inbound(st *epStream) router.Inbound {
	path, _, _ := strings.Cut(st.headers[":path"], "?")
	in := router.Inbound{
		Body:       st.body,
		PoolHeader: x.s.cfg.ExtProc.PoolHeader,
		PoolName:   st.headers[x.s.cfg.ExtProc.PoolHeader],
		Forwards:   st.chunks > 0,
	}
	switch path {
	case "/v1/chat/completions":
		in.Endpoint = router.EndpointChatCompletions
	case "/v1/completions":
		in.Endpoint = router.EndpointCompletions
	default:
		in.Endpoint = router.EndpointInvoke
		in.Adapter = st.headers[strings.ToLower(router.HeaderAdapter)]
	}
	if t, ok := st.headers[strings.ToLower(router.TenantHeader)]; ok {
		in.Tenant = []string{t}
	}
	return in
}

func containsAddr(list []string, addr string) bool {
	for _, a := range list {
		if a == addr {
			return true
		}
	}
	return false
}

// immediate is an ext_proc immediate response with an OpenAI-style JSON
// error body, as the router's HTTP edge answers.
func immediate(code int, msg string) *extprocv3.ProcessingResponse {
	body, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": msg, "type": http.StatusText(code), "code": code,
	}})
	hdrs := []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "content-type", RawValue: []byte("application/json")}}}
	if code == http.StatusServiceUnavailable || code == http.StatusTooManyRequests {
		hdrs = append(hdrs, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: "retry-after", RawValue: []byte("1")}})
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(code)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: hdrs},
			Body:    body,
			Details: msg,
		}}}
}
