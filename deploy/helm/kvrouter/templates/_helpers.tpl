{{/* Labels every object carries. */}}
{{- define "kvrouter.labels" -}}
app.kubernetes.io/part-of: kvrouter
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The kvrouter image: repository, then @digest or :tag (appVersion by default). */}}
{{- define "kvrouter.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/*
The NATS URL routers and bridges use: the Service for one node; for a
cluster every node's stable name, so a client starts from whichever answers
and reconnects to another when one goes.
*/}}
{{- define "kvrouter.natsURL" -}}
{{- if .Values.nats.enabled -}}
{{- if gt (int .Values.nats.replicas) 1 -}}
{{- $seeds := list -}}
{{- range $i := until (int .Values.nats.replicas) -}}
{{- $seeds = append $seeds (printf "nats://nats-%d.nats-headless:4222" $i) -}}
{{- end -}}
{{ join "," $seeds }}
{{- else -}}
nats://nats:4222
{{- end -}}
{{- else -}}
{{ .Values.vllm.bridge.natsURL | required "nats.enabled is false: set vllm.bridge.natsURL (and router.config.events.nats.url)" }}
{{- end -}}
{{- end -}}

{{/* The kv-events-config JSON of vLLM (field names: vLLM's KVEventsConfig). */}}
{{- define "kvrouter.kvEventsConfig" -}}
{{- $kv := .Values.vllm.kvEvents -}}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%v" $kv.port) "replay_endpoint" (printf "tcp://*:%v" $kv.replayPort) "topic" $kv.topic | toJson -}}
{{- end -}}

{{/*
router.yaml: what the chart derives (listeners, NATS, index, one pool of the
chart's engines) with router.config merged over it.
*/}}
{{- define "kvrouter.routerConfig" -}}
{{- $r := .Values.router -}}
{{- $cfg := dict "listen" (printf ":%v" $r.ports.http) "admin_listen" (printf ":%v" $r.ports.admin) -}}
{{- $natsURL := "" -}}
{{- if .Values.nats.enabled -}}{{- $natsURL = include "kvrouter.natsURL" . -}}{{- end -}}
{{- $_ := set $cfg "events" (dict "nats" (dict "url" $natsURL "stream" "KV_EVENTS")) -}}
{{- if .Values.redis.enabled -}}
{{- $_ := set $cfg "index" (dict "backend" "redis" "redis" (dict "addrs" (list "redis:6379") "username" "kvrouter" "key_prefix" "kvrouter" "ttl" "1h")) -}}
{{- else -}}
{{- $_ := set $cfg "index" (dict "backend" "memory") -}}
{{- end -}}
{{- $pools := $r.pools -}}
{{- if and (not $pools) .Values.vllm.enabled -}}
{{- $instances := list -}}
{{- range $i := until (int .Values.vllm.replicas) -}}
{{- $instances = append $instances (dict "id" (printf "vllm-%d" $i) "url" (printf "http://vllm-%d.vllm:%v" $i $.Values.vllm.port)) -}}
{{- end -}}
{{- $pools = list (dict "name" .Values.vllm.pool "model" .Values.vllm.model "routing" $r.routing "tokenizer" $r.tokenizer "health" (dict "path" "/health" "interval" "5s" "timeout" "2s") "instances" $instances) -}}
{{- end -}}
{{- $_ := set $cfg "pools" $pools -}}
{{- $cfg = mergeOverwrite $cfg (deepCopy $r.config) -}}
{{- if not (dig "events" "nats" "url" "" $cfg) -}}
{{- fail "nats.enabled is false: set router.config.events.nats.url to your NATS (an empty URL would start an embedded NATS in every router pod)" -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}
