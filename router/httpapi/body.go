package httpapi

import (
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"sync/atomic"
	"unicode/utf8"

	"github.com/kvrouter/kvrouter/config"
	"github.com/kvrouter/kvrouter/router/openai"
)

// Request bodies are read whole before routing (the strategy needs the
// prompt, and the body is kept to retry), so every request in progress
// holds its body in memory. Two bounds keep that from becoming the way to
// run the router out of memory:
//
//   - per request, max_body_bytes, enforced as the body arrives: a body
//     without a Content-Length (chunked) grows in chunks reserved one by
//     one, never by doubling a buffer past the limit, so an over-limit
//     upload costs at most the limit before its 413;
//   - over all requests, limits.max_body_memory_bytes (bodyBudget): every
//     chunk is reserved before it is allocated and the reservation is held
//     until the request is answered; when it cannot be had the request is
//     answered 503 at once (counted in kvrouter_body_budget_rejected_total)
//     instead of the process growing until the kernel kills it.
//
// A body of n bytes read without a Content-Length costs up to about 2n
// while its chunks are joined into one slice, then n until the request
// ends; a body with a Content-Length up to maxBodyPrealloc is read into
// one allocation of its size.

// Body reading constants, from first principles rather than a workload:
const (
	// maxBodyPrealloc bounds the buffer allocated from a request's declared
	// Content-Length before any of the body has arrived (a client declaring
	// max_body_bytes and sending one byte must not pin the limit).
	maxBodyPrealloc = 1 << 20
	// minBodyChunk is the first chunk of a body of unknown length: a page,
	// enough for a short chat request in one read.
	minBodyChunk = 4 << 10
	// maxBodyChunk caps a chunk: chunks double (so a body takes
	// O(log n) allocations) up to 1 MiB, beyond which the slack of the last
	// chunk stays under 1 MiB whatever the size.
	maxBodyChunk = 1 << 20
	// smallBodyBytes: the first 64 KiB of any body may use the whole
	// budget; bytes beyond it may not use its last quarter (bodyBudget).
	// Most chat and completion bodies are a few KiB, so under a flood of
	// large uploads ordinary requests still find room: 64 concurrent
	// uploads hold at most 4 MiB of the reserve.
	smallBodyBytes = 64 << 10
)

// DefaultMaxBodyMemoryBytes is limits.max_body_memory_bytes when unset and
// max_body_bytes is at most a quarter of it (else 4 x max_body_bytes). 128
// MiB holds about 1,000 concurrent 128 KiB bodies (a 32k-token chat
// request) or three bodies of the default 32 MiB limit at once, and keeps
// the process near 2 x 128 MiB + ~30 MB at worst (Go's heap grows to twice
// what is live at GOGC=100): under 300 MB, whatever clients send.
const DefaultMaxBodyMemoryBytes = 128 << 20

// bodyMemory is the effective body-memory budget of c (after defaults).
func bodyMemory(c config.Config) int64 {
	if c.Limits.MaxBodyMemoryBytes != 0 {
		return c.Limits.MaxBodyMemoryBytes
	}
	return max(DefaultMaxBodyMemoryBytes, 4*c.MaxBodyBytes)
}

// bodyBudget bounds the memory held by request bodies across requests.
// Safe for concurrent use; the limit may change on reload (reservations
// already held are kept and count against the new limit).
type bodyBudget struct {
	limit    atomic.Int64
	used     atomic.Int64
	rejected atomic.Uint64 // requests refused for want of budget
}

func newBodyBudget(limit int64) *bodyBudget {
	b := &bodyBudget{}
	b.limit.Store(limit)
	return b
}

// reserve takes n more bytes for a request already holding held; false
// when the budget cannot give them. Bytes beyond a request's first
// smallBodyBytes may not use the last quarter of the budget, which is
// left to small bodies.
func (b *bodyBudget) reserve(held, n int64) bool {
	top := b.limit.Load()
	if held+n > smallBodyBytes {
		top -= top / 4
	}
	for {
		u := b.used.Load()
		if u+n > top {
			return false
		}
		if b.used.CompareAndSwap(u, u+n) {
			return true
		}
	}
}

func (b *bodyBudget) release(n int64) {
	if n != 0 {
		b.used.Add(-n)
	}
}

// errBodyBudget: the body-memory budget could not cover the next chunk.
var errBodyBudget = errors.New("request body memory budget exhausted")

// errBodyTruncated: the upload ended before its Content-Length or its
// chunked encoding's last chunk. net/http says so with io.ErrUnexpectedEOF,
// as io.ReadFull does of a body ending inside a chunk: truncatedBody tells
// the two apart.
var errBodyTruncated = errors.New("request body cut short before its declared end")

type truncatedBody struct{ io.Reader }

func (b truncatedBody) Read(p []byte) (int, error) {
	n, err := b.Reader.Read(p)
	if errors.Is(err, io.ErrUnexpectedEOF) {
		err = errBodyTruncated
	}
	return n, err
}

// bodyReadStatus maps a read error to the status answering it.
func bodyReadStatus(err error, limit int64) (int, string) {
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &mbe):
		return http.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds the limit of %d bytes", limit)
	case errors.Is(err, errBodyBudget):
		return http.StatusServiceUnavailable, "the router is holding too many request bodies (limits.max_body_memory_bytes); retry later"
	case errors.Is(err, errBodyTimeout):
		return http.StatusRequestTimeout, err.Error()
	}
	return http.StatusBadRequest, "reading request body: " + err.Error()
}

// readBody reads the whole body (it is needed to route, and kept to
// retry) within limit bytes and the budget. On success the caller owns
// held bytes of the budget and releases them when the request is answered;
// on failure it has answered, released everything and returns the status.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request, limit int64) (body []byte, held int64, status int) {
	if r.ContentLength > limit {
		openai.WriteError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body of %d bytes exceeds the limit of %d bytes", r.ContentLength, limit))
		return nil, 0, http.StatusRequestEntityTooLarge
	}
	body, held, err := readChunks(http.MaxBytesReader(w, r.Body, limit), r.ContentLength, limit, s.body)
	if err != nil {
		status, msg := bodyReadStatus(err, limit)
		if status == http.StatusServiceUnavailable {
			s.body.rejected.Add(1)
			w.Header().Set("Retry-After", "1")
		}
		openai.WriteError(w, status, msg)
		return nil, 0, status
	}
	return body, held, 0
}

// readChunks reads rd to EOF into one slice, reserving from b every chunk
// before allocating it. declared is the Content-Length (-1 unknown): up to
// maxBodyPrealloc it sizes the first chunk exactly, so a body that keeps
// its word is one allocation and no copy. limit bounds what rd yields
// (it is wrapped by http.MaxBytesReader); no chunk reaches past it.
func readChunks(rd io.Reader, declared, limit int64, b *bodyBudget) (body []byte, held int64, err error) {
	rd = truncatedBody{rd} // a bare io.ErrUnexpectedEOF below is io.ReadFull's
	var chunks [][]byte
	total := int64(0)
	fail := func(err error) ([]byte, int64, error) {
		b.release(held)
		return nil, 0, err
	}
	next := int64(minBodyChunk)
	if declared >= 0 {
		next = min(declared+1, maxBodyPrealloc)
	}
	var carry byte // the byte a probe read, not yet stored
	hasCarry := false
	for {
		// A chunk's last byte is a probe for EOF once the rest is full, so
		// a body that fits its chunk exactly needs no second one.
		size := min(next, limit-total+1)
		var c []byte
		k := 0
		if declared > total && len(chunks) == 1 {
			// The client sent the first maxBodyPrealloc bytes it declared:
			// hold it to its word for the rest in one buffer that takes the
			// first chunk in, rather than chunks and a join (declared+1 MiB
			// at the peak, not twice declared).
			size = declared + 1
			if !b.reserve(held, size) {
				return fail(errBodyBudget)
			}
			c = make([]byte, size)
			k = copy(c, chunks[0])
			b.release(held)
			held, chunks, total = size, chunks[:0], 0
		} else {
			if !b.reserve(held, size) {
				return fail(errBodyBudget)
			}
			held += size
			c = make([]byte, size)
		}
		if hasCarry {
			c[k], k, hasCarry = carry, k+1, false
		}
		n, err := io.ReadFull(rd, c[k:len(c)-1])
		n += k
		chunks = append(chunks, c[:n])
		total += int64(n)
		if err == io.EOF || err == io.ErrUnexpectedEOF { // the body's end
			break
		}
		if err != nil {
			return fail(err)
		}
		if _, err := io.ReadFull(rd, c[n:n+1]); err == io.EOF {
			break
		} else if err != nil {
			return fail(err) // http.MaxBytesReader reports the excess here
		}
		if total >= limit {
			return fail(&http.MaxBytesError{Limit: limit})
		}
		carry, hasCarry = c[n], true
		next = min(max(total, minBodyChunk), maxBodyChunk)
	}
	if declared >= 0 && total != declared { // a reader that does not hold it to its Content-Length
		return fail(errBodyTruncated)
	}
	if len(chunks) == 1 {
		return chunks[0], held, nil
	}
	// Join: reserve the whole, copy, then give back the chunks' share.
	if !b.reserve(held, total) {
		return fail(errBodyBudget)
	}
	out := make([]byte, 0, total)
	for _, c := range chunks {
		out = append(out, c...)
	}
	b.release(held)
	return out, total, nil
}

// Request bodies on the data plane are JSON (OpenAI, and vLLM's SageMaker
// /invocations): a body declared as something else (a form, multipart,
// XML, text) is refused with 415 before it is read, rather than forwarded
// to an engine as if it were JSON. A request without a Content-Type is
// taken as JSON, as before: curl -d with -H omitted and hand-written
// clients send none, and vLLM's own server accepts them. JSON is UTF-8
// (RFC 8259 section 8.1), so a body that is not is refused with 400.

// checkContentType returns "" when a request's Content-Type is JSON (or
// absent), else the message of the 415.
func checkContentType(ct string) string {
	if strings.TrimSpace(ct) == "" {
		return ""
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil {
		return fmt.Sprintf("Content-Type %q: %v; want application/json", ct, err)
	}
	if mt != "application/json" && !(strings.HasPrefix(mt, "application/") && strings.HasSuffix(mt, "+json")) {
		return fmt.Sprintf("Content-Type %q: the body must be JSON (application/json)", ct)
	}
	if cs, ok := params["charset"]; ok && !strings.EqualFold(cs, "utf-8") {
		return fmt.Sprintf("Content-Type %q: JSON must be UTF-8", ct)
	}
	return ""
}

// checkUTF8 returns "" when body is valid UTF-8, else the message of the 400.
func checkUTF8(body []byte) string {
	if utf8.Valid(body) {
		return ""
	}
	return "request body is not valid UTF-8 (JSON text must be UTF-8, RFC 8259 section 8.1)"
}
