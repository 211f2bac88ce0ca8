package deploy

import (
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// bundle is one rendered kustomization, every object decoded strictly into
// its API type and indexed by name.
type bundle struct {
	dir             string
	namespaces      map[string]*corev1.Namespace
	deployments     map[string]*appsv1.Deployment
	statefulSets    map[string]*appsv1.StatefulSet
	jobs            map[string]*batchv1.Job
	services        map[string]*corev1.Service
	configMaps      map[string]*corev1.ConfigMap
	secrets         map[string]*corev1.Secret
	serviceAccounts map[string]*corev1.ServiceAccount
	pdbs            map[string]*policyv1.PodDisruptionBudget
	hpas            map[string]*autoscalingv2.HorizontalPodAutoscaler
	netpols         map[string]*networkingv1.NetworkPolicy
	serviceMonitors map[string]*monitoringv1.ServiceMonitor
	podMonitors     map[string]*monitoringv1.PodMonitor
	rules           map[string]*monitoringv1.PrometheusRule
	objects         []objectMeta // every object, in render order
}

// objectMeta identifies one rendered object.
type objectMeta struct {
	apiVersion, kind, name, namespace string
}

func (o objectMeta) String() string { return o.kind + "/" + o.name }

// workload is a Deployment, StatefulSet or Job reduced to what the
// cross-reference checks need.
type workload struct {
	kind, name string
	replicas   int32
	template   *corev1.PodTemplateSpec
	claims     []corev1.PersistentVolumeClaim // StatefulSet volumeClaimTemplates
}

func (w workload) String() string { return w.kind + "/" + w.name }

func (b *bundle) workloads() []workload {
	var out []workload
	for _, n := range sortedKeys(b.deployments) {
		d := b.deployments[n]
		out = append(out, workload{kind: "Deployment", name: n, replicas: derefReplicas(d.Spec.Replicas), template: &d.Spec.Template})
	}
	for _, n := range sortedKeys(b.statefulSets) {
		s := b.statefulSets[n]
		out = append(out, workload{kind: "StatefulSet", name: n, replicas: derefReplicas(s.Spec.Replicas), template: &s.Spec.Template, claims: s.Spec.VolumeClaimTemplates})
	}
	for _, n := range sortedKeys(b.jobs) {
		out = append(out, workload{kind: "Job", name: n, replicas: 1, template: &b.jobs[n].Spec.Template})
	}
	return out
}

func derefReplicas(p *int32) int32 {
	if p == nil {
		return 1 // the API default
	}
	return *p
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// newBundle returns an empty bundle for dir.
func newBundle(dir string) *bundle {
	return &bundle{
		dir:             dir,
		namespaces:      map[string]*corev1.Namespace{},
		deployments:     map[string]*appsv1.Deployment{},
		statefulSets:    map[string]*appsv1.StatefulSet{},
		jobs:            map[string]*batchv1.Job{},
		services:        map[string]*corev1.Service{},
		configMaps:      map[string]*corev1.ConfigMap{},
		secrets:         map[string]*corev1.Secret{},
		serviceAccounts: map[string]*corev1.ServiceAccount{},
		pdbs:            map[string]*policyv1.PodDisruptionBudget{},
		hpas:            map[string]*autoscalingv2.HorizontalPodAutoscaler{},
		netpols:         map[string]*networkingv1.NetworkPolicy{},
		serviceMonitors: map[string]*monitoringv1.ServiceMonitor{},
		podMonitors:     map[string]*monitoringv1.PodMonitor{},
		rules:           map[string]*monitoringv1.PrometheusRule{},
	}
}

// render builds the kustomization in dir (relative to this module) with
// kustomize's own library and decodes every object strictly: a field the
// API type does not have (a typo, a wrong indentation) fails the test.
func render(t *testing.T, dir string) *bundle {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), filepath.FromSlash(dir))
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	b := newBundle(dir)
	if len(m.Resources()) == 0 {
		t.Fatalf("%s rendered no objects", dir)
	}
	for _, r := range m.Resources() {
		y, err := r.AsYAML()
		if err != nil {
			t.Fatalf("%s: %s/%s as YAML: %v", dir, r.GetKind(), r.GetName(), err)
		}
		meta := objectMeta{apiVersion: r.GetApiVersion(), kind: r.GetKind(), name: r.GetName(), namespace: r.GetNamespace()}
		if err := b.add(meta, y); err != nil {
			t.Errorf("%s: %v\n%s", dir, err, y)
		}
	}
	return b
}

// add decodes one object strictly into its Go type.
func (b *bundle) add(meta objectMeta, y []byte) error {
	var obj interface{ GetName() string }
	var store func()
	switch meta.apiVersion + " " + meta.kind {
	case "v1 Namespace":
		o := &corev1.Namespace{}
		obj, store = o, func() { b.namespaces[o.Name] = o }
	case "apps/v1 Deployment":
		o := &appsv1.Deployment{}
		obj, store = o, func() { b.deployments[o.Name] = o }
	case "apps/v1 StatefulSet":
		o := &appsv1.StatefulSet{}
		obj, store = o, func() { b.statefulSets[o.Name] = o }
	case "batch/v1 Job":
		o := &batchv1.Job{}
		obj, store = o, func() { b.jobs[o.Name] = o }
	case "v1 Service":
		o := &corev1.Service{}
		obj, store = o, func() { b.services[o.Name] = o }
	case "v1 ConfigMap":
		o := &corev1.ConfigMap{}
		obj, store = o, func() { b.configMaps[o.Name] = o }
	case "v1 Secret":
		o := &corev1.Secret{}
		obj, store = o, func() { b.secrets[o.Name] = o }
	case "v1 ServiceAccount":
		o := &corev1.ServiceAccount{}
		obj, store = o, func() { b.serviceAccounts[o.Name] = o }
	case "policy/v1 PodDisruptionBudget":
		o := &policyv1.PodDisruptionBudget{}
		obj, store = o, func() { b.pdbs[o.Name] = o }
	case "autoscaling/v2 HorizontalPodAutoscaler":
		o := &autoscalingv2.HorizontalPodAutoscaler{}
		obj, store = o, func() { b.hpas[o.Name] = o }
	case "networking.k8s.io/v1 NetworkPolicy":
		o := &networkingv1.NetworkPolicy{}
		obj, store = o, func() { b.netpols[o.Name] = o }
	case "monitoring.coreos.com/v1 ServiceMonitor":
		o := &monitoringv1.ServiceMonitor{}
		obj, store = o, func() { b.serviceMonitors[o.Name] = o }
	case "monitoring.coreos.com/v1 PodMonitor":
		o := &monitoringv1.PodMonitor{}
		obj, store = o, func() { b.podMonitors[o.Name] = o }
	case "monitoring.coreos.com/v1 PrometheusRule":
		o := &monitoringv1.PrometheusRule{}
		obj, store = o, func() { b.rules[o.Name] = o }
	default:
		return fmt.Errorf("%s (%s): no API type registered in the test; add one rather than skipping it", meta, meta.apiVersion)
	}
	if err := decodeStrict(y, obj); err != nil {
		return fmt.Errorf("%s: %w", meta, err)
	}
	if obj.GetName() == "" {
		return fmt.Errorf("%s: no metadata.name", meta)
	}
	store()
	b.objects = append(b.objects, meta)
	return nil
}

// decodeStrict decodes YAML the way the API server's strict field
// validation does: duplicate keys, unknown fields and fields spelt in the
// wrong case (encoding/json would match "targetport" to targetPort) are
// errors.
func decodeStrict(y []byte, obj any) error {
	j, err := yaml.YAMLToJSONStrict(y)
	if err != nil {
		return fmt.Errorf("yaml: %w", err)
	}
	strictErrs, err := kjson.UnmarshalStrict(j, obj, kjson.DisallowDuplicateFields, kjson.DisallowUnknownFields)
	if err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	if len(strictErrs) > 0 {
		return fmt.Errorf("strict decode: %w", errors.Join(strictErrs...))
	}
	return nil
}

// selects reports whether sel (a label selector) matches the labels.
func selects(t *testing.T, sel *metav1.LabelSelector, lbls map[string]string) bool {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		t.Errorf("bad selector %v: %v", sel, err)
		return false
	}
	if s.Empty() {
		return false // an empty selector matching everything is never what a manifest here means
	}
	return s.Matches(labels.Set(lbls))
}
