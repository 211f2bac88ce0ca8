package openai

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// apiError is the OpenAI error shape as vLLM's OpenAI server writes it:
// {"error": {"message", "type", "param", "code"}}.
type apiError struct {
	Error apiErrorBody `json:"error"`
}

type apiErrorBody struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// errorType names the error class of a status, as OpenAI clients expect.
func errorType(status int) string {
	switch status {
	case http.StatusBadRequest, http.StatusRequestEntityTooLarge:
		return "invalid_request_error"
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusServiceUnavailable:
		return "service_unavailable"
	case http.StatusBadGateway, http.StatusGatewayTimeout:
		return "upstream_error"
	}
	if status >= 500 {
		return "server_error"
	}
	return "invalid_request_error"
}

// writeError answers with an OpenAI-shaped error. This is the only place
// errors become HTTP statuses on the data plane.
func WriteError(w http.ResponseWriter, status int, msg string) {
	b, _ := json.Marshal(apiError{Error: apiErrorBody{Message: msg, Type: errorType(status), Code: status}})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

// sseErrorEvent is the event that ends a stream whose upstream failed after
// bytes reached the client: an OpenAI-shaped error, then [DONE].
func SSEErrorEvent(msg string) []byte {
	b, _ := json.Marshal(apiError{Error: apiErrorBody{Message: msg, Type: errorType(http.StatusBadGateway), Code: http.StatusBadGateway}})
	out := make([]byte, 0, len(b)+32)
	out = append(out, "data: "...)
	out = append(out, b...)
	out = append(out, "\n\ndata: [DONE]\n\n"...)
	return out
}
